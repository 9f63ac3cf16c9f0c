"""One step's rows as lora-kit batches: a prepared backend per set of slot ranks.

vLLM folds each adapter's scaling into its ``B``, so every batch here has scaling 1. The
ranks come from the buffers themselves (:mod:`lora_vllm.slot_ranks`): each buffer pair has
its slots' live ranks, and the step's batch for that pair gives each slot the step uses its
live rank (slots the step does not use get 0). Most buffers of a step share one set of ranks
(an adapter's rank is usually the same on every module it targets); each distinct set of the
step's ranks gets its own prepared backend, built from the same host segments at first use
in the step, and kept for the next step while the previous one used it.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import numpy as np
import torch
from lora_core import LoRABackend, build_batch_info

from .mapping import run_lengths

__all__ = ["RankedBatches", "StepBatch"]


class StepBatch(NamedTuple):
    """A backend prepared with the step's batch for one set of slot ranks; ``rank`` is the largest of
    them, so the ops read the buffers up to it (``a[:, :rank]``, ``b[:, :, :rank]``)."""

    backend: LoRABackend
    rank: int


class RankedBatches:
    """The current step's rows (tokens, or sampled rows) for every set of slot ranks in use.

    Args:
        make_backend: builds an unprepared lora-kit backend (kept across steps, one per set of ranks
            in use).
        device: where the batches live.
    """

    def __init__(self, make_backend: Callable[[], LoRABackend], device: torch.device) -> None:
        self._make_backend = make_backend
        self.device = device
        self._backends: dict[tuple[tuple[int, ...], int | None], LoRABackend] = {}  # by the step's ranks
        self._batches: dict[tuple[tuple[int, ...], int | None], StepBatch | None] = {}  # by the buffers' ranks
        self._used: set[tuple[tuple[int, ...], int | None]] = set()
        self._seg_lens: list[int] = []
        self._seg_slots: list[int] = []
        self._in_step: tuple[bool, ...] = ()
        self.num_rows = 0
        self.any_adapter = False

    def reset(self, slots: np.ndarray, num_slots: int) -> None:
        """Describe a new step: ``slots (rows,)`` int, each row's adapter slot in ``[0, num_slots)``
        (``-1`` = no adapter)."""
        seg_lens, seg_slots = run_lengths(slots)
        self._seg_lens, self._seg_slots = seg_lens.tolist(), seg_slots.tolist()
        in_step = np.zeros(num_slots, dtype=bool)
        in_step[seg_slots[seg_slots >= 0]] = True
        self._in_step = tuple(in_step.tolist())
        self.num_rows = int(slots.size)
        self.any_adapter = bool(in_step.any())
        self._backends = {key: backend for key, backend in self._backends.items() if key in self._used}
        self._batches.clear()
        self._used = set()

    def for_ranks(self, slot_ranks: Sequence[int], num_rows: int | None = None) -> StepBatch | None:
        """The step's batch for buffers whose slots have these live ranks (``slot_ranks[s]`` for slot
        ``s``), or ``None`` when no row of the step has a slot of rank > 0 (nothing to compute).

        ``num_rows``, when given and not the step's row count, asks for vLLM's prompt log-probabilities
        case: the step has one row and ``num_rows`` rows reached the LM head (every prompt position of
        the one request), each with that row's slot, as vLLM's own ops broadcast it. Any other count is
        a ``ValueError``."""
        spread = num_rows is not None and num_rows != self.num_rows
        if spread and self.num_rows != 1:
            raise ValueError(f"{num_rows} rows reached the LM head but the step maps {self.num_rows} sampled rows")
        key = (tuple(slot_ranks), num_rows if spread else None)
        if key in self._batches:
            return self._batches[key]
        if len(key[0]) != len(self._in_step):
            raise ValueError(f"the LoRA buffers hold {len(key[0])} adapter slots but the step's mapping has "
                             f"{len(self._in_step)}")
        ranks = [r if used else 0 for r, used in zip(key[0], self._in_step)]
        step_key = (tuple(ranks), key[1])  # buffers that differ only in slots the step does not use share it
        batch = None
        if max(ranks, default=0) > 0:
            backend = self._backends.get(step_key)
            if backend is None:
                backend = self._backends[step_key] = self._make_backend()
            if step_key not in self._used:
                seg_lens = [num_rows] if spread else self._seg_lens
                info = build_batch_info(seg_lens, self._seg_slots, ranks, [1.0] * len(ranks), device=self.device)
                backend.prepare_batch(info)
                self._used.add(step_key)
            batch = StepBatch(backend, max(ranks))
        self._batches[key] = batch
        return batch
