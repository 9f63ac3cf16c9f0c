"""One step's rows as lora-kit batches: a prepared backend per buffer rank.

vLLM zero-pads every adapter to the buffers' rank ``R`` and folds each adapter's scaling
into its ``B``, so a lora-kit batch for vLLM's buffers gives every occupied slot rank ``R``
and scaling 1. Most layers share one ``R`` (``max_lora_rank``); a few have another (a
fully sharded layer's ``R / tp``, a classifier head's label count), so each rank gets its
own prepared backend, built from the same host segments once per step: at
:meth:`RankedBatches.reset` for the rank given there, at first use for any other.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch
from lora_core import LoRABackend, build_batch_info

from .mapping import run_lengths

__all__ = ["RankedBatches"]


class RankedBatches:
    """The current step's rows (tokens, or sampled rows) for every buffer rank in use.

    Args:
        make_backend: builds an unprepared lora-kit backend (one per rank, kept across steps).
        device: where the batches live.
    """

    def __init__(self, make_backend: Callable[[], LoRABackend], device: torch.device) -> None:
        self._make_backend = make_backend
        self.device = device
        self._backends: dict[int, LoRABackend] = {}
        self._prepared: set[int] = set()
        self._spread: dict[tuple[int, int], LoRABackend] = {}
        self._seg_lens: list[int] = []
        self._seg_slots: list[int] = []
        self._occupied: tuple[bool, ...] = ()
        self.num_rows = 0
        self.any_adapter = False

    def reset(self, slots: np.ndarray, occupied: Sequence[bool], rank: int | None) -> None:
        """Describe a new step: ``slots (rows,)`` int (``-1`` = no adapter), ``occupied[s]``
        whether slot ``s`` holds an adapter; prepares the batch for buffers of rank ``rank`` now
        (``None``: every rank at first use)."""
        seg_lens, seg_slots = run_lengths(slots)
        self._seg_lens, self._seg_slots = seg_lens.tolist(), seg_slots.tolist()
        self._occupied = tuple(bool(o) for o in occupied)
        self.num_rows = int(slots.size)
        self.any_adapter = bool((seg_slots >= 0).any())
        self._prepared.clear()
        self._spread.clear()
        if rank is not None:
            self.backend(rank)

    def backend(self, rank: int) -> LoRABackend:
        """The backend prepared with this step's batch for buffers of rank ``rank``."""
        backend = self._backends.get(rank)
        if backend is None:
            backend = self._backends[rank] = self._make_backend()
        if rank not in self._prepared:
            self._prepare(backend, self._seg_lens, self._seg_slots, rank)
            self._prepared.add(rank)
        return backend

    def backend_for_rows(self, num_rows: int, rank: int) -> LoRABackend:
        """:meth:`backend` for ``num_rows`` rows: the step's own, or, when the step has one row and
        ``num_rows`` are given (vLLM's prompt log-probabilities: every prompt position of the one
        request goes through the LM head), that row's slot for each of them, as vLLM's own ops
        broadcast it. Any other count is a ``ValueError``."""
        if num_rows == self.num_rows:
            return self.backend(rank)
        if self.num_rows != 1:
            raise ValueError(f"{num_rows} rows reached the LM head but the step maps {self.num_rows} sampled rows")
        backend = self._spread.get((num_rows, rank))
        if backend is None:
            backend = self._spread[(num_rows, rank)] = self._make_backend()
            self._prepare(backend, [num_rows], self._seg_slots, rank)
        return backend

    def _prepare(self, backend: LoRABackend, seg_lens: list[int], seg_slots: list[int], rank: int) -> None:
        """Prepare ``backend`` with the batch of these segments, every occupied slot at rank ``rank``, scaling 1."""
        info = build_batch_info(seg_lens, seg_slots, [rank if o else 0 for o in self._occupied],
                                [1.0] * len(self._occupied), device=self.device, max_rank=rank)
        backend.prepare_batch(info)

