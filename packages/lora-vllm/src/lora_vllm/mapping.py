"""vLLM's per-step LoRA mapping as lora-kit batches, vectorized.

vLLM describes a step with a ``LoRAMapping``: ``index_mapping`` (one LoRA id per token,
``0`` = no adapter) and ``prompt_mapping`` (one LoRA id per sampled row), plus
``lora_index_to_id`` (the LoRA id held by each adapter slot, ``None`` = empty). Its own
``convert_mapping`` turns them into index tensors with a Python loop over tokens; this
module computes the same tensors with NumPy, and the run-length segments a lora-kit
``BatchInfo`` is built from. Nothing here imports vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = ["StepMapping", "lora_slots", "run_lengths"]


def lora_slots(lora_ids: Sequence[int] | np.ndarray, lora_index_to_id: Sequence[int | None]) -> np.ndarray:
    """The adapter slot of each LoRA id (``-1`` for ids ``<= 0``), as an int64 array.

    ``lora_index_to_id[slot]`` is the id held by ``slot``. An id > 0 that no slot holds raises
    ``KeyError`` naming it, as vLLM's own ``convert_mapping`` does (its dict lookup).
    """
    ids = np.asarray(lora_ids, dtype=np.int64).reshape(-1)
    slots = np.full(ids.shape, -1, dtype=np.int64)
    wanted = ids > 0
    if not wanted.any():
        return slots
    held = np.array([-1 if i is None else i for i in lora_index_to_id], dtype=np.int64)
    order = np.argsort(held, kind="stable")
    held_sorted = held[order]
    asked = ids[wanted]
    pos = np.searchsorted(held_sorted, asked).clip(max=max(held.size - 1, 0))
    hit = held_sorted[pos] == asked if held.size else np.zeros(asked.shape, dtype=bool)
    if not hit.all():
        raise KeyError(int(asked[np.argmin(hit)]))
    slots[wanted] = order[pos]
    return slots


def run_lengths(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(lengths, values)`` of the runs of equal adjacent entries of a 1-D array."""
    if values.size == 0:
        return np.zeros(0, dtype=np.int64), values[:0]
    starts = np.flatnonzero(np.concatenate(([True], values[1:] != values[:-1])))
    lengths = np.diff(np.append(starts, values.size))
    return lengths, values[starts]


@dataclass(frozen=True)
class StepMapping:
    """One step's mapping in slots.

    Attributes:
        token_slots: (T,) int64, each token's adapter slot (-1 = none).
        row_slots: (N,) int64, each sampled row's adapter slot (-1 = none).
        embedding_offsets: (T,) int64, ``slot * vocab_size`` (0 for tokens without an
            adapter): the row offset of the token's slot in vLLM's embedding ``lora_a``.
        row_offsets_padded: (N,) int64, vLLM's ``sampler_indices_padded``:
            ``row + n * (slot if slot >= 0 else max_loras - 1)``.
    """

    token_slots: np.ndarray
    row_slots: np.ndarray
    embedding_offsets: np.ndarray
    row_offsets_padded: np.ndarray

    @classmethod
    def from_vllm(cls, index_mapping: Sequence[int], prompt_mapping: Sequence[int],
                  lora_index_to_id: Sequence[int | None], max_loras: int, vocab_size: int) -> StepMapping:
        """The mapping of one ``LoRAMapping`` (its ``index_mapping`` and ``prompt_mapping``).

        ``max_loras`` is the value vLLM passes to ``update_metadata`` (its slots + 1)."""
        token_slots = lora_slots(index_mapping, lora_index_to_id)
        row_slots = lora_slots(prompt_mapping, lora_index_to_id)
        n = row_slots.size
        padded = np.where(row_slots == -1, max_loras - 1, row_slots)
        return cls(
            token_slots=token_slots,
            row_slots=row_slots,
            embedding_offsets=np.maximum(token_slots, 0) * vocab_size,
            row_offsets_padded=np.arange(n, dtype=np.int64) + padded * n,
        )
