"""The host plan of the control-flow ops (eager batches).

Control-flow ops loop on the host over token groups of Python ints, so that the
loop never reads a device tensor. Three layouts, chosen once per batch:

* **segments**: contiguous row ranges (adjacent requests on one slot merged),
  one GEMM per segment and slice;
* **slot groups**: the tokens of each slot gathered once through ``token_perm``,
  one GEMM per slot and slice, scattered back once. Chosen when it saves GEMMs
  and segments are short (decode batches of many single-token requests);
* **slot blocks** (:class:`SlotBlocks`): the same slot groups padded to one block
  size, so all slots run in one ``bmm`` (:mod:`lora_cuda.block_kernels`), and the
  rows of larger groups beyond it in a second ``bmm`` (a hot slot at decode, the
  pair rows of a weighted mix: two runs of blocks). One batched GEMM costs far less
  than a GEMM per slot at decode sizes, but multiplies its padding rows too:
  :func:`slot_block_size` weighs the two (docs/benchmarks.md, "slot blocks in two
  runs").

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

from .block_kernels import BlockRun
from .kernel_tables import KernelTables
from .slot_order import place_in_blocks, slot_order

__all__ = ["ControlPlan", "SlotBlocks", "TokenGroup", "slot_block_size", "SLOT_GROUPING_MAX_MEAN_SEGMENT_LEN",
           "SLOT_BLOCKS_MAX_PADDING", "SLOT_BLOCKS_ROWS_PER_GEMM"]

SLOT_GROUPING_MAX_MEAN_SEGMENT_LEN = 64
"""Slot groups replace the segment loop only when active segments are this short on average."""

SLOT_BLOCKS_MAX_PADDING = 2.0
"""Slot blocks replace the loop over slot groups only when they gather at most this many times the
tokens with an adapter."""

SLOT_BLOCKS_ROWS_PER_GEMM = 48
"""Where launches cost nothing but their host call (``Platform.launches_cost`` false: the CPU), what a
GEMM costs beyond its rows, in rows: what :func:`slot_block_size` weighs layouts by. Set from
``examples/bench_slot_layouts.py`` and the whole-model A/B runs in docs/benchmarks.md ("slot blocks
in two runs"; torch 2.13, 2-core AMD EPYC, 2 threads, ``h`` 256 and 1024, rank 64). Not modelled: a
``bmm`` splits its blocks among the threads (on 2 threads, 3 blocks take what 4 do), so layouts
of an odd number of blocks cost more than their rows say."""


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
    """Slot groups in blocks (a block layout of :mod:`lora_cuda.block_kernels`): a first run of one
    block of ``block_size`` rows per slot in use (its first rows, padded), and, for the slots with
    more rows, a second run of one block each for the rest, as large as the largest rest needs.
    With ``block_size`` = the largest group there is one run: every slot in one ``bmm``.

    Device tensors (``P`` cells: every run's blocks, in order): ``block_tokens (P,)`` int64 (padding
    cells point at row 0), ``token_rows (T,)`` int64 (each token's cell, a padding cell's for tokens
    without an adapter), ``cell_valid (P,)`` bool, ``cell_ranks (P,)`` int32, ``cell_scalings (P,)``
    float32, and per run, ``run_slots[i] (NB_i,)`` int64. ``run_ranges[i]`` is ``(lo, hi)`` when run
    ``i``'s slots are ``lo, ..., hi - 1`` (their weights are then a view, not a copy).
    """

    def __init__(self, batch_info: BatchInfo, perm: np.ndarray, slots: np.ndarray, counts: np.ndarray,
                 block_size: int) -> None:
        super().__init__()
        over = counts > block_size
        if not over.any():  # one run
            runs, rows_in_cells = [(slots, counts, block_size)], perm
        else:  # each slot's rows below block_size in the first run, in slot order; the others in the second
            runs = [(slots, np.minimum(counts, block_size), block_size), (slots[over], counts[over] - block_size, 0)]
            runs[1] = (*runs[1][:2], int(runs[1][1].max()))
            place_in_slot = np.arange(perm.size) - np.repeat(np.cumsum(counts) - counts, counts)
            first = place_in_slot < block_size
            rows_in_cells = np.concatenate([perm[first], perm[~first]])
        if sum(n.size * b for n, _, b in runs) == perm.size < batch_info.num_tokens:
            runs[-1] = (*runs[-1][:2], runs[-1][2] + 1)  # tokens without an adapter read a padding cell: add one
        start, self.runs, self.run_ranges = 0, (), ()
        for run_slots, _, b in runs:
            self.runs += (BlockRun(start, run_slots.size, b),)
            start += run_slots.size * b
            lo, hi = int(run_slots[0]), int(run_slots[-1]) + 1
            self.run_ranges += ((lo, hi) if hi - lo == run_slots.size else None,)
        valid = [(np.arange(b) < n[:, None]).ravel() for _, n, b in runs]
        cell_slots = [np.repeat(run_slots, b) for run_slots, _, b in runs]
        if len(runs) == 1:
            valid, cell_slots = valid[0], cell_slots[0]
        else:
            valid, cell_slots = np.concatenate(valid), np.concatenate(cell_slots)
        block_tokens = np.empty(valid.size, dtype=np.int64)
        token_rows = np.empty(batch_info.num_tokens, dtype=np.int64)
        place_in_blocks(valid, rows_in_cells, block_tokens, token_rows)
        slot_ranks, slot_scalings = batch_info.slot_ranks_scalings_host
        published = publish_arrays(  # one upload (none on the CPU): this layout lives for one batch
            {"block_tokens": block_tokens, "token_rows": token_rows, "cell_valid": valid,
             "cell_ranks": slot_ranks[cell_slots], "cell_scalings": slot_scalings[cell_slots],
             **{f"run_slots{i}": run[0].astype(np.int64, copy=False) for i, run in enumerate(runs)}},
            batch_info.device,
        )
        self.block_tokens, self.token_rows, self.cell_valid, self.cell_ranks, self.cell_scalings, *run_slots = (
            published.values())
        self.run_slots = tuple(run_slots)

    @property
    def num_cells(self) -> int:
        """``P``: the rows the kernels gather, padding included."""
        return self.runs[-1].end

    def _row_ranks_and_scalings(self):
        return self.cell_ranks, self.cell_scalings, self.cell_valid

    def run_weights(self, weights: torch.Tensor, run: int) -> torch.Tensor:
        """``weights (L, ...)`` of each block's slot in run ``run``, ``(NB, ...)``: ``weights`` itself
        when its slots are all of them, a view when they are a range, else gathered into a workspace."""
        slot_range = self.run_ranges[run]
        if slot_range is not None:
            lo, hi = slot_range
            return weights if lo == 0 and hi == weights.shape[0] else weights[lo:hi]
        slots = self.run_slots[run]
        out = self.workspace(f"weights{run}", (slots.shape[0], *weights.shape[1:]), weights.dtype, weights.device)
        return torch.index_select(weights, 0, slots, out=out)


def slot_block_size(counts: list[int], launches_cost: bool) -> int | None:
    """The first run's block size of :class:`SlotBlocks` for slot groups of ``counts`` rows (at
    least one), or ``None`` where the loop over slot groups should run instead.

    A block size ``b`` gathers ``S * b`` rows for the first run (``S`` slots) and, for the slots
    with more than ``b``, the rest padded to the largest rest in a second run. Layouts that gather
    over :data:`SLOT_BLOCKS_MAX_PADDING` times the rows are out. Where launches cost
    (``launches_cost``) the fewest GEMMs win (one run, then the two runs of the fewest rows);
    elsewhere (the CPU) the fewest rows plus :data:`SLOT_BLOCKS_ROWS_PER_GEMM` per GEMM, the slot
    groups' ``S`` GEMMs included, ties to fewer GEMMs. The best ``b`` is one of the counts: the
    rows are linear in ``b`` between them. Not counted: the padding cell :class:`SlotBlocks` adds
    when every cell holds a row, and the slices (slot groups run ``S`` GEMMs per slice, a run one
    ``bmm`` per slice in the expand, one in the shrink)."""
    ordered = sorted(counts)
    S, rows, largest = len(ordered), sum(ordered), ordered[-1]
    limit = SLOT_BLOCKS_MAX_PADDING * rows
    gathered = {b: S * b + (S - i - 1) * (largest - b)  # (the slots after the last with b rows have more)
                for i, b in enumerate(ordered) if i == S - 1 or ordered[i + 1] != b}
    fits = {b: n for b, n in gathered.items() if n <= limit}
    if launches_cost:
        return largest if largest in fits else min(fits, key=fits.get, default=None)
    cost = {b: n + SLOT_BLOCKS_ROWS_PER_GEMM * (1 if b == largest else 2) for b, n in fits.items()}
    best = min(sorted(cost, reverse=True), key=cost.get, default=None)  # (the first of equals: the fewest GEMMs)
    if best is None or cost[best] > rows + SLOT_BLOCKS_ROWS_PER_GEMM * S:
        return None
    return best


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
        block_size = slot_block_size(counts_list, platform_for(batch_info.device).launches_cost)
        if block_size is not None:
            return cls(True, groups, None, SlotBlocks(batch_info, perm, used, counts, block_size))
        return cls(True, groups, torch.from_numpy(perm).to(batch_info.device))

    @property
    def layout(self) -> str:
        """The layout's name: ``"segments"``, ``"slot groups"``, ``"slot blocks"`` (one run) or
        ``"slot blocks in two runs"``."""
        if self.slot_blocks is None:
            return "slot groups" if self.by_slot else "segments"
        return "slot blocks" if len(self.slot_blocks.runs) == 1 else "slot blocks in two runs"

    def refill(self, batch_info: BatchInfo) -> None:
        fresh = self.build(batch_info)  # eager batches only: sizes may change freely
        self.by_slot, self.groups, self.token_perm, self.slot_blocks = (
            fresh.by_slot, fresh.groups, fresh.token_perm, fresh.slot_blocks)
