"""The rows of a batch ordered by slot: what the sorted and blocked plans and the
control plan's slot groups are built from.

Computed on the host from the batch's segments with a few NumPy ops (a stable
sort of the segments by slot and their expansion to rows): no Python loop over
tokens or segments. One per batch, shared by the plans that read it
(:meth:`lora_core.plans.PlanCache.shared`).
"""

from __future__ import annotations

import numpy as np

from lora_core import BatchInfo

__all__ = ["SlotOrder", "slot_order", "place_in_blocks"]


class SlotOrder:
    """Rows of a batch ordered by slot (host NumPy arrays): active rows first, grouped by
    slot in row order, then the rows without an adapter (slot -1, rank 0, padding).

    Computed per segment, not per token: a segment's rows are contiguous, so the
    order is the segments sorted by slot, each expanded to its row range (nothing
    to expand when every segment is one row, as at decode).

    Attributes (``rows`` = the batch info's ``num_tokens``, ``L`` = its slots):
        order: ``(rows,)`` int64, the rows in that order.
        counts: ``(L,)`` int64, the active rows of each slot (0 for a slot of rank 0).
        num_active: the active rows (those first in ``order``), ``counts.sum()``.
        row_ranks: ``(rows,)`` int32, each ordered row's rank (0 without an adapter).
        row_scalings: ``(rows,)`` float32, each ordered row's scaling (0 without an adapter).

    ``row_ranks`` and ``row_scalings`` are computed on first read (the sorted plan reads
    them; the block layouts do not).
    """

    def __init__(self, batch_info: BatchInfo) -> None:
        L = batch_info.num_slots
        rows, real = batch_info.num_tokens, batch_info.num_real_tokens
        seg_lens, seg_slots, seg_starts = batch_info.segments_host
        self._slot_tables = batch_info.slot_ranks_scalings_host  # slot -1 -> rank 0, scaling 0
        key = np.where(self._slot_tables[0][seg_slots] > 0, seg_slots, L)
        by_slot = np.argsort(key, kind="stable")
        # graph-mode padding rows [real, rows) have no adapter and come last, in row order
        self.order = np.arange(rows, dtype=np.int64)
        self._sorted_segment_slots = seg_slots[by_slot]
        if seg_lens.size == real:  # one row per segment: the sorted segments are the sorted rows
            self.order[:real] = seg_starts[by_slot]
            self._sorted_segment_lens = None
            self.counts = np.bincount(key, minlength=L + 1)[:L]
        else:
            lens = self._sorted_segment_lens = seg_lens[by_slot]
            self.order[:real] += np.repeat(seg_starts[by_slot] - (np.cumsum(lens) - lens), lens)
            self.counts = np.bincount(key, weights=seg_lens, minlength=L + 1)[:L].astype(np.int64)
        self.num_active = int(self.counts.sum())
        self._row_slots = self._row_ranks = self._row_scalings = None  # computed on first read

    @property
    def row_ranks(self) -> np.ndarray:
        if self._row_ranks is None:
            self._row_ranks = self._row_values(self._slot_tables[0])
        return self._row_ranks

    @property
    def row_scalings(self) -> np.ndarray:
        if self._row_scalings is None:
            self._row_scalings = self._row_values(self._slot_tables[1])
        return self._row_scalings

    def _row_values(self, per_slot: np.ndarray) -> np.ndarray:
        """``per_slot`` (``L + 1`` entries) of each ordered row: of its slot for a row of a request,
        0 for graph-mode padding."""
        if self._row_slots is None:
            slots, lens = self._sorted_segment_slots, self._sorted_segment_lens
            self._row_slots = slots if lens is None else np.repeat(slots, lens)
        values = np.zeros(self.order.size, dtype=per_slot.dtype)
        values[: self._row_slots.size] = per_slot[self._row_slots]
        return values


def slot_order(batch_info: BatchInfo) -> SlotOrder:
    """The batch's :class:`SlotOrder`, computed once per batch (and adapter set) for every plan that reads it."""
    return batch_info.plans.shared(SlotOrder, batch_info)


def place_in_blocks(valid: np.ndarray, rows: np.ndarray, block_tokens: np.ndarray, token_rows: np.ndarray) -> None:
    """Fill a block layout's row tables (:mod:`lora_cuda.block_kernels`) from rows in cell order.

    Args:
        valid: ``(NB, b)`` or ``(C,)`` bool, whether each of the ``C`` cells holds a row; in
            row-major order its true cells are ``rows`` in order (for one run of blocks in
            slot order, a slot's rows filling its blocks from the start, the active rows of
            a :class:`SlotOrder`, ``order[:num_active]``).
        rows: ``(N,)`` int64, the rows the cells hold (``N = valid.sum()``), in cell order.
        block_tokens: ``(C,)`` int64, written: each cell's row, 0 for a padding cell.
        token_rows: ``(T,)`` int64, written: each row's cell; a row not in ``rows`` gets
            the first padding cell, which must exist when ``N < T``.

    Two scatters, no sort: each row's cell is its rank among the true cells.
    """
    cells = np.flatnonzero(valid)
    padding = 0
    if cells.size < token_rows.size:  # rows without an adapter read the first padding cell
        padding = int(np.argmin(valid))
        if valid.flat[padding]:
            raise ValueError(f"valid has no padding cell for the {token_rows.size - cells.size} rows not in rows")
    block_tokens.fill(0)
    block_tokens[cells] = rows
    token_rows.fill(padding)
    token_rows[rows] = cells
