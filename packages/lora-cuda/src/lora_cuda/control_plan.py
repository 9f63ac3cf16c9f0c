"""The host plan of the control-flow ops (eager batches).

Control-flow ops loop on the host over token groups of Python ints, so that the
loop never reads a device tensor. Three layouts, chosen once per batch:

* **segments**: contiguous row ranges (adjacent requests on one slot merged),
  one GEMM per segment and slice;
* **slot groups**: the tokens of each slot gathered once through ``token_perm``,
  one GEMM per slot and slice, scattered back once. Chosen when it saves GEMMs
  and segments are short (decode batches of many single-token requests);
* **slot blocks** (:class:`SlotBlocks`): the same slot groups padded to the
  largest one, so all slots run in one ``bmm`` (:mod:`lora_cuda.block_kernels`):
  chosen over slot groups when padding at most doubles the rows, since one batched
  GEMM costs far less than a GEMM per slot at decode sizes, and, on a device whose
  launches cost nothing but their host call (the CPU), adds at most
  :data:`SLOT_BLOCKS_PADDING_PER_GEMM` rows per GEMM it saves: there the padding
  rows of a prefill cost more than the GEMMs (docs/benchmarks.md).

Only the chosen layout is built, with a few NumPy ops on the batch's host
mirrors; the Python loop runs over segments or slots, never over tokens.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import numpy as np
import torch

from lora_core import BatchInfo, BatchPlan
from lora_core.platforms import platform_for
from lora_core.staging import publish_arrays

from .kernel_tables import KernelTables
from .slot_order import place_in_blocks, slot_order

__all__ = ["ControlPlan", "SlotBlocks", "TokenGroup", "SLOT_GROUPING_MAX_MEAN_SEGMENT_LEN",
           "SLOT_BLOCKS_MAX_PADDING", "SLOT_BLOCKS_PADDING_PER_GEMM"]

SLOT_GROUPING_MAX_MEAN_SEGMENT_LEN = 64
"""Slot groups replace the segment loop only when active segments are this short on average."""

SLOT_BLOCKS_MAX_PADDING = 2.0
"""Slot blocks replace the loop over slot groups when ``slots used x largest group`` is at
most this many times the tokens with an adapter."""

SLOT_BLOCKS_PADDING_PER_GEMM = 16
"""Where launches cost nothing but their host call (``Platform.launches_cost`` false: the CPU), slot
blocks also need their padding rows to be at most this many per GEMM they save (slots used - 1).
Measured on one ``h x h`` module at rank 64 over 4 slots (``examples/bench_slot_layouts.py``, torch 2.13,
2-core AMD EPYC; docs/benchmarks.md, "slot blocks or slot groups"): at ``h = 256`` slot blocks took
0.57-0.77 of the slot groups' time at decode (0-32 padding rows) and 1.26-1.57 times it at prefill
(128-224 padding rows); at ``h = 1024``, 0.63-1.00 and 0.99-1.29."""


class TokenGroup(NamedTuple):
    """A run of tokens that share one active adapter slot.

    ``start:end`` indexes the flattened batch (segments) or ``ControlPlan.token_perm``
    (slot groups). ``rank`` and ``scaling`` are the slot's, as Python numbers.
    """

    slot: int
    rank: int
    scaling: float
    start: int
    end: int

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


class SlotBlocks(KernelTables):
    """Slot groups padded into one block per slot in use (a block layout of
    :mod:`lora_cuda.block_kernels`): ``NB`` = slots in use, ``b`` = the largest group.

    Device tensors: ``block_tokens (NB*b,)`` int64 (padding rows point at row 0),
    ``token_rows (T,)`` int64 (each token's position in the blocks, a padding row's for
    tokens without an adapter), ``block_valid (NB, b)`` bool, ``block_slots (NB,)`` int64, ``block_ranks (NB,)``
    int32, ``block_scalings (NB,)`` float32. ``slot_range`` is ``(lo, hi)`` when the
    slots in use are ``lo, ..., hi - 1`` (their weights are then a view, not a copy).
    """

    def __init__(self, batch_info: BatchInfo, perm: np.ndarray, slots: np.ndarray, counts: np.ndarray) -> None:
        super().__init__()
        nb, b = int(slots.size), max(counts.tolist())
        if nb * b == perm.size < batch_info.num_tokens:
            b += 1  # tokens without an adapter read a padding row: make sure there is one
        self.num_blocks, self.block_size = nb, b
        lo = int(slots[0])
        self.slot_range = (lo, lo + nb) if int(slots[-1]) == lo + nb - 1 else None
        valid = np.arange(b) < counts[:, None]
        block_tokens = np.empty(nb * b, dtype=np.int64)
        token_rows = np.empty(batch_info.num_tokens, dtype=np.int64)
        place_in_blocks(valid, perm, block_tokens, token_rows)
        slot_ranks, slot_scalings = batch_info.slot_ranks_scalings_host
        published = publish_arrays(  # one upload (none on the CPU): this layout lives for one batch
            {"block_tokens": block_tokens, "block_valid": valid, "block_slots": slots.astype(np.int64, copy=False),
             "block_ranks": slot_ranks[slots], "block_scalings": slot_scalings[slots], "token_rows": token_rows},
            batch_info.device,
        )
        (self.block_tokens, self.block_valid, self.block_slots, self.block_ranks, self.block_scalings,
         self.token_rows) = published.values()

    def _row_ranks_and_scalings(self):
        nb, b = self.num_blocks, self.block_size
        return (self.block_ranks[:, None].expand(nb, b), self.block_scalings[:, None].expand(nb, b),
                self.block_valid)

    def block_weights(self, weights: torch.Tensor) -> torch.Tensor:
        """``weights (L, ...)`` of each block's slot, ``(NB, ...)``: ``weights`` itself when every
        slot is in use, a view when the slots are a range, else gathered into a workspace."""
        if self.slot_range is not None:
            lo, hi = self.slot_range
            return weights if lo == 0 and hi == weights.shape[0] else weights[lo:hi]
        out = self.workspace("weights", (self.num_blocks, *weights.shape[1:]), weights.dtype, weights.device)
        return torch.index_select(weights, 0, self.block_slots, out=out)


class ControlPlan(BatchPlan):
    """Token groups for control-flow ops.

    Attributes:
        by_slot: groups are slot groups over ``token_perm`` (else segments).
        groups: the active groups (slot >= 0, rank > 0, non-empty), as :class:`TokenGroup`.
        token_perm: ``(P,)`` int64 on the device, the tokens of active slots grouped
            by slot, which ``groups`` index (``None`` for the segment plan and for slot blocks).
        slot_blocks: the slot groups as :class:`SlotBlocks`, when they replace the
            loop over groups (``None`` otherwise).
    """

    def __init__(self, by_slot: bool, groups: tuple[TokenGroup, ...], token_perm: torch.Tensor | None,
                 slot_blocks: SlotBlocks | None = None) -> None:
        self.by_slot, self.groups, self.token_perm, self.slot_blocks = by_slot, groups, token_perm, slot_blocks

    @classmethod
    def build(cls, batch_info: BatchInfo) -> ControlPlan:
        L = batch_info.num_slots
        seg_lens, seg_slots, seg_starts = batch_info.segments_host
        active = batch_info.slot_ranks_scalings_host[0][seg_slots] > 0  # slot -1 -> rank 0
        slots, lens = seg_slots[active], seg_lens[active]
        per_slot = np.bincount(slots, weights=lens, minlength=L)
        num_groups, num_tokens = slots.size, int(lens.sum())
        ranks, scalings = batch_info.lora_ranks_host, batch_info.scalings_host
        used = np.flatnonzero(per_slot)
        by_slot = used.size < num_groups and num_tokens / num_groups < SLOT_GROUPING_MAX_MEAN_SEGMENT_LEN
        if not by_slot:
            groups = tuple(TokenGroup(s, ranks[s], scalings[s], start, start + n)
                           for s, n, start in zip(slots.tolist(), lens.tolist(), seg_starts[active].tolist()))
            return cls(False, groups, None)
        order = slot_order(batch_info)
        perm, counts = order.order[:num_tokens], order.counts[used]
        used_list, counts_list = used.tolist(), counts.tolist()  # (Python ints: NumPy's max costs more here)
        groups = tuple(TokenGroup(s, ranks[s], scalings[s], end - n, end)
                       for s, n, end in zip(used_list, counts_list, itertools.accumulate(counts_list)))
        padding, limit = len(used_list) * max(counts_list) - num_tokens, (SLOT_BLOCKS_MAX_PADDING - 1) * num_tokens
        if not platform_for(batch_info.device).launches_cost:
            limit = min(limit, SLOT_BLOCKS_PADDING_PER_GEMM * (len(used_list) - 1))
        if padding <= limit:
            return cls(True, groups, None, SlotBlocks(batch_info, perm, used, counts))
        return cls(True, groups, torch.from_numpy(perm).to(batch_info.device))

    def refill(self, batch_info: BatchInfo) -> None:
        fresh = self.build(batch_info)  # eager batches only: sizes may change freely
        self.by_slot, self.groups, self.token_perm, self.slot_blocks = (
            fresh.by_slot, fresh.groups, fresh.token_perm, fresh.slot_blocks)
