"""The rows of a batch ordered by slot: what the sorted and blocked plans and the
control plan's slot groups are built from.

Computed on the host from the batch's segments with a few NumPy ops (a stable
sort of the segments by slot and their expansion to rows): no Python loop over
tokens or segments. One per batch, shared by the plans that read it
(:meth:`lora_core.BatchInfo.derived`).
"""

from __future__ import annotations

import numpy as np

from lora_core import BatchInfo

__all__ = ["SlotOrder", "slot_order"]


class SlotOrder:
    """Rows of a batch ordered by slot (host NumPy arrays): active rows first, grouped by
    slot in row order, then the rows without an adapter (slot -1, rank 0, padding).

    Computed per segment, not per token: a segment's rows are contiguous, so the
    order is the segments sorted by slot, each expanded to its row range (nothing
    to expand when every segment is one row, as at decode).

    Attributes (``rows`` = the batch info's ``num_tokens``, ``L`` = its slots):
        order: ``(rows,)`` int64, the rows in that order.
        counts: ``(L,)`` int64, the active rows of each slot (0 for a slot of rank 0).
        row_ranks: ``(rows,)`` int32, each ordered row's rank (0 without an adapter).
        row_scalings: ``(rows,)`` float32, each ordered row's scaling (0 without an adapter).
    """

    def __init__(self, batch_info: BatchInfo) -> None:
        L = batch_info.num_slots
        rows, real = batch_info.num_tokens, batch_info.num_real_tokens
        seg_lens, seg_slots, seg_starts = batch_info.segments_host
        slot_ranks, slot_scalings = batch_info.slot_ranks_scalings_host  # slot -1 -> rank 0, scaling 0
        key = np.where(slot_ranks[seg_slots] > 0, seg_slots, L)
        by_slot = np.argsort(key, kind="stable")
        # graph-mode padding rows [real, rows) have no adapter and come last, in row order
        self.order = np.arange(rows, dtype=np.int64)
        if seg_lens.size == real:  # one row per segment: the sorted segments are the sorted rows
            self.order[:real] = seg_starts[by_slot]
            row_slots = seg_slots[by_slot]
            self.counts = np.bincount(key, minlength=L + 1)[:L]
        else:
            lens = seg_lens[by_slot]
            self.order[:real] += np.repeat(seg_starts[by_slot] - (np.cumsum(lens) - lens), lens)
            row_slots = np.repeat(seg_slots[by_slot], lens)
            self.counts = np.bincount(key, weights=seg_lens, minlength=L + 1)[:L].astype(np.int64)
        self.row_ranks = np.zeros(rows, dtype=np.int32)
        self.row_ranks[:real] = slot_ranks[row_slots]
        self.row_scalings = np.zeros(rows, dtype=np.float32)
        self.row_scalings[:real] = slot_scalings[row_slots]


def slot_order(batch_info: BatchInfo) -> SlotOrder:
    """The batch's :class:`SlotOrder`, computed once per batch (and adapter set) for every plan that reads it."""
    return batch_info.derived("lora_cuda.slot_order", SlotOrder)
