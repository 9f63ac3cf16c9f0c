"""Shrink and expand over token blocks: one ``bmm`` per run of equal blocks, whatever the slot count.

A block layout puts ``b`` rows of one slot in each of its blocks (padding rows are
invalid and point at row 0), in runs of blocks of one size; its kernels gather the
blocks' rows and their slots' weights and run one batched GEMM per run. Two layouts
use these kernels:

* :class:`~lora_cuda.graph_plans.BlockPlan` (graph-safe): one run of ``ceil(T/b) + L``
  blocks of a fixed ``b``, shapes fixed by the capacity;
* :class:`~lora_cuda.control_plan.SlotBlocks` (eager): a run of one block per slot in
  use and, where a few slots hold far more rows than the others, a second run for the
  rows beyond the first run's block size; shapes fixed by the batch.

A layout provides ``runs`` (its :class:`BlockRun` runs, in cell order), ``block_tokens (P,)``
int64 on the inputs' device (each of its ``P`` cells' row), ``token_rows (T,)`` int64 (each
row's cell; for a row in no block, a padding cell's, which the mask zeroes),
``column_tables(R, c)`` (``P x c*R`` scales and outside-rank mask, any shape of ``P``
cells), ``workspace(...)`` and ``call_operands(key, make, *args)`` (all three as in
:class:`~lora_cuda.kernel_tables.KernelTables`), and ``run_weights(weights, i)``: the
``(NB_i, ...)`` weights of each block's slot in run ``i``.
Inputs are validated by the dispatcher in :mod:`lora_cuda.ops`.
"""

from __future__ import annotations

from typing import Callable, Hashable, NamedTuple, Protocol, TypeVar

import torch

from .row_updates import gather_add_rows_, index_add_rows_, through_sources

__all__ = ["BlockLayout", "BlockRun", "block_shrink", "block_expand"]

T = TypeVar("T")


class BlockRun(NamedTuple):
    """``num_blocks`` blocks of ``block_size`` cells each, a layout's cells ``start : end``: one ``bmm``."""

    start: int
    num_blocks: int
    block_size: int

    @property
    def end(self) -> int:
        return self.start + self.num_blocks * self.block_size


class BlockLayout(Protocol):
    runs: tuple[BlockRun, ...]
    block_tokens: torch.Tensor
    token_rows: torch.Tensor

    def column_tables(self, max_rank: int, num_slices: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def workspace(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor: ...

    def call_operands(self, key: Hashable, make: Callable[..., T], *args: object) -> T: ...

    def run_weights(self, weights: torch.Tensor, run: int) -> torch.Tensor: ...


def _run_views(cells: torch.Tensor, runs: tuple[BlockRun, ...]) -> tuple[torch.Tensor, ...]:
    """Each run's ``(NB, b, n)`` view of ``cells (P, n)`` (contiguous: the views are too)."""
    return tuple(cells[r.start : r.end].view(r.num_blocks, r.block_size, cells.shape[1]) for r in runs)


class _ShrinkOperands(NamedTuple):
    rows: torch.Tensor  # (P, in) workspace: the gathered rows of x
    row_runs: tuple[torch.Tensor, ...]  # its (NB, b, in) views, the bmms' inputs
    shrunk: torch.Tensor  # (P, c*R) workspace, scaled and masked, gathered into the result
    shrunk_runs: tuple[torch.Tensor, ...]  # its (NB, b, c*R) views, the bmms' outputs
    scales: torch.Tensor  # (P, c*R) column tables
    outside: torch.Tensor
    token_rows: torch.Tensor  # (T,): each output row's cell


class _ExpandOperands(NamedTuple):
    low_rank_rows: torch.Tensor  # (P, c*R) workspace: the gathered rows of x, masked
    low_rank_runs: tuple[torch.Tensor, ...]  # its (NB, b, c*R) views, the bmms' inputs
    outside: torch.Tensor  # (P, c*R) column table
    delta: torch.Tensor  # (P, out_total) workspace, added into the result
    delta_runs: tuple[torch.Tensor, ...]  # its (NB, b, out_total) views, the bmms' outputs


def _shrink_operands(blocks: BlockLayout, num_rows: int, in_features: int, max_rank: int, num_slices: int,
                     dtype: torch.dtype) -> _ShrinkOperands:
    cells, cR = blocks.block_tokens.shape[0], max_rank * num_slices
    device = blocks.block_tokens.device  # the inputs' (validated by the ops)
    rows = blocks.workspace("rows", (cells, in_features), dtype, device)
    shrunk = blocks.workspace("shrunk", (cells, cR), dtype, device)
    scales, outside = blocks.column_tables(max_rank, num_slices)
    token_rows = blocks.token_rows
    if num_rows < token_rows.shape[0]:  # a graph-mode x may stop at the real tokens
        token_rows = token_rows[:num_rows]
    return _ShrinkOperands(rows, _run_views(rows, blocks.runs), shrunk, _run_views(shrunk, blocks.runs),
                           scales.view(cells, cR), outside.view(cells, cR), token_rows)


def _expand_operands(blocks: BlockLayout, max_rank: int, num_slices: int, out_total: int,
                     dtype: torch.dtype) -> _ExpandOperands:
    cells, cR = blocks.block_tokens.shape[0], max_rank * num_slices
    device = blocks.block_tokens.device
    low_rank = blocks.workspace("low_rank_rows", (cells, cR), dtype, device)
    delta = blocks.workspace("delta", (cells, out_total), dtype, device)
    _, outside = blocks.column_tables(max_rank, num_slices)
    return _ExpandOperands(low_rank, _run_views(low_rank, blocks.runs), outside.view(cells, cR), delta,
                           _run_views(delta, blocks.runs))


def block_shrink(x: torch.Tensor, weights: torch.Tensor, blocks: BlockLayout, num_slices: int,
                 sources: torch.Tensor | None = None) -> torch.Tensor:
    """Scaled shrink. ``x: (T, in)``, ``weights: (L, c*R, in)`` -> ``(T, c*R)`` in ``x.dtype``:
    ``out[t, i*R + k] = scaling[s] * x[t] @ weights[s, i*R + k]`` for ``k < rank[s]``, ``s``
    the slot of ``t``'s block, else 0 (rows in no block included). With ``sources (N,)`` int64 (the
    layout's ``N`` rows are a batch's rows with pair rows, ``x`` its tokens): row ``n`` reads
    ``x[sources[n]]`` and the output has ``N`` rows.

    The gathered rows and the block results live in the layout's workspaces, scaled and
    masked in place: a call allocates only its output. Each row's result is gathered
    from the blocks (``token_rows``), not scattered into zeros: every row has at most one
    cell, and a gather is deterministic and, on CPU, several microseconds cheaper
    than ``index_add_`` at decode sizes."""
    x_shape, dtype = x.shape, x.dtype
    _, cR, _ = w_shape = weights.shape
    rows = x_shape[0] if sources is None else sources.shape[0]
    ops = blocks.call_operands(("shrink", x_shape, w_shape, num_slices, dtype, rows), _shrink_operands,
                               rows, x_shape[1], cR // num_slices, num_slices, dtype)
    torch.index_select(x, 0, through_sources(blocks.block_tokens, sources), out=ops.rows)
    for run, (xb, yb) in enumerate(zip(ops.row_runs, ops.shrunk_runs)):
        torch.bmm(xb, blocks.run_weights(weights, run).transpose(1, 2), out=yb)
    ops.shrunk.mul_(ops.scales).masked_fill_(ops.outside, 0)  # padding rows are 0; so is inf*0 = NaN beyond a rank
    return ops.shrunk.index_select(0, ops.token_rows)


def block_expand(
    x: torch.Tensor, weights: torch.Tensor, blocks: BlockLayout, slice_offsets: tuple[int, ...], out: torch.Tensor,
    sources: torch.Tensor | None = None,
) -> torch.Tensor:
    """Expand into ``out`` in place. ``x: (T, c*R)``, ``weights: (L, out_total, R)``,
    ``out: (T, out_total)``: ``out[t, o_i:o_i+1] += x[t, i*R : i*R + rank[s]] @ weights[s, o_i:o_i+1, :rank[s]].T``
    for each slice ``i``, ``s`` the slot of ``t``'s block; the columns of ``x`` beyond the rank
    are zeroed in the gathered rows before the GEMM. Gathered rows and the delta live in the
    layout's workspaces. ``out`` may be a strided view (a slice's columns of a wider output):
    each row's delta is then gathered from the blocks (:func:`~lora_cuda.row_updates.gather_add_rows_`).
    With ``sources (N,)`` int64 (``x (N, c*R)`` a batch's rows with pair rows, ``out (T, out_total)`` its
    tokens): row ``n``'s delta is added into ``out[sources[n]]``."""
    R, num_slices, dtype = weights.shape[2], len(slice_offsets) - 1, x.dtype
    ops = blocks.call_operands(("expand", x.shape[1], slice_offsets, dtype), _expand_operands,
                               R, num_slices, slice_offsets[-1], dtype)
    torch.index_select(x, 0, blocks.block_tokens, out=ops.low_rank_rows)
    ops.low_rank_rows.masked_fill_(ops.outside, 0)
    for run, (yb, delta) in enumerate(zip(ops.low_rank_runs, ops.delta_runs)):
        wb = blocks.run_weights(weights, run)  # (NB, out_total, R)
        if num_slices == 1:  # the common case, without the slicing below
            torch.bmm(yb, wb.transpose(1, 2), out=delta)
            continue
        for i in range(num_slices):  # each slice's columns of the delta, written in place
            lo, hi = slice_offsets[i], slice_offsets[i + 1]
            torch.bmm(yb[:, :, i * R : (i + 1) * R], wb[:, lo:hi].transpose(1, 2), out=delta[:, :, lo:hi])
    # a padding row's delta is zero (its gathered row is masked) and every row of out has one cell,
    # or with sources, any number of them
    if sources is not None:
        return index_add_rows_(out, through_sources(blocks.block_tokens, sources), ops.delta)
    return gather_add_rows_(out, blocks.token_rows[: out.shape[0]], ops.delta, blocks.block_tokens)
