"""Control-flow (eager) LoRA ops: a host loop over the batch's token groups.

Groups come from the batch's :class:`~lora_cuda.control_plan.ControlPlan`, so
the loop reads Python ints only and never synchronises the device:

* segments: contiguous row ranges, one fused ``addmm`` per segment and slice;
* slot groups: the tokens of each slot gathered once (``token_perm``), one
  ``addmm`` per slot and slice, scattered back once: the GEMM count is the
  number of slots;
* slot blocks: the slot groups padded to one block per slot, one ``bmm`` for all
  slots, and the rows of larger groups beyond the block size in a second one
  (:mod:`lora_cuda.block_kernels`). Decode batches of many single-token requests
  spread over the slots use this; the embedding shrink takes the per-token
  gather of the graph-safe op there, which needs no grouping at all.

Rank truncation: only rows/columns ``[0, r)`` of each slot are read, so
whatever lies beyond a rank never reaches the result. Inputs are validated by
the dispatcher in :mod:`lora_cuda.ops`; these functions trust them.

The host plan is baked into whatever a graph capture records, so these ops
refuse to run under capture (real or simulated): a captured control-flow op
would replay the capture-time batch's segments on every later batch.
"""

from __future__ import annotations

import torch

from lora_core import BatchInfo, is_capturing

from .block_kernels import block_expand, block_shrink
from .control_plan import ControlPlan
from .graph_ops import sgemm_lora_a_embedding_graph_fwd
from .row_updates import check_sources_output, index_add_rows_, through_sources

__all__ = [
    "sgemm_lora_a_control_fwd",
    "sgemm_lora_b_control_fwd",
    "sgemm_lora_a_embedding_control_fwd",
]


def _capture_error(op: str) -> RuntimeError:
    """The error for ``op`` under a capture (callers test :func:`is_capturing` themselves: it
    runs on every call, this function only when they raise)."""
    return RuntimeError(
        f"{op} is a control-flow op: its segment loop is fixed at capture time and would replay "
        "stale batches; build the batch info with use_graph=True to use the graph-safe ops"
    )


def sgemm_lora_a_control_fwd(
    x: torch.Tensor, weights: torch.Tensor, batch_info: BatchInfo, num_slices: int = 1,
    sources: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scaled shrink. ``x: (T, in)``, ``weights: (L, c*R, in)`` -> ``(T, c*R)`` in ``x.dtype``.
    With ``sources (N,)`` int64 (``batch_info`` the rows with pair rows of a batch whose tokens ``x``
    has): row ``n`` reads ``x[sources[n]]`` and the output has ``N`` rows."""
    if is_capturing():
        raise _capture_error("sgemm_lora_a_control_fwd")
    plan = batch_info.plan(ControlPlan)
    if plan.slot_blocks is not None:
        return block_shrink(x, weights, plan.slot_blocks, num_slices, sources)
    T, cR = (x.shape[0] if sources is None else sources.shape[0]), weights.shape[1]
    R = cR // num_slices
    out = x.new_zeros(T, cR)
    if plan.by_slot:
        perm = through_sources(plan.token_perm, sources)
        src, dst = x.index_select(0, perm), x.new_zeros(perm.shape[0], cR)
    else:
        src, dst = (x if sources is None else x.index_select(0, sources)), out
    for g in plan.groups:
        rows = slice(g.start, g.end)
        for i in range(num_slices):
            cols = slice(i * R, i * R + g.rank)
            o = dst[rows, cols]
            torch.addmm(o, src[rows], weights[g.slot, cols].t(), beta=0, alpha=g.scaling, out=o)
    if plan.by_slot:
        out.index_copy_(0, plan.token_perm, dst)
    return out


def sgemm_lora_b_control_fwd(
    x: torch.Tensor,
    weights: torch.Tensor,
    batch_info: BatchInfo,
    slice_offsets: tuple[int, ...],
    base_output: torch.Tensor | None = None,
    sources: torch.Tensor | None = None,
) -> torch.Tensor:
    """Expand. ``x: (T, c*R)``, ``weights: (L, out_total, R)``, ``slice_offsets: (0, ..., out_total)``
    -> ``(T, out_total)``, accumulated into ``base_output`` in place when given. With ``sources (N,)``
    int64 (``x (N, c*R)`` a batch's rows with pair rows, ``base_output`` its tokens, required): row
    ``n``'s delta is added into ``base_output[sources[n]]``."""
    if is_capturing():
        raise _capture_error("sgemm_lora_b_control_fwd")
    check_sources_output(sources, base_output)
    out = base_output if base_output is not None else x.new_zeros(x.shape[0], slice_offsets[-1])
    plan = batch_info.plan(ControlPlan)
    if plan.slot_blocks is not None:
        return block_expand(x, weights, plan.slot_blocks, slice_offsets, out, sources)
    R, num_slices = weights.shape[2], len(slice_offsets) - 1
    if plan.by_slot:
        perm = plan.token_perm
        yp = x.index_select(0, perm)
        delta = x.new_empty(perm.shape[0], slice_offsets[-1])  # every row and column is written below
        for g in plan.groups:
            rows = slice(g.start, g.end)
            for i in range(num_slices):
                cols = slice(slice_offsets[i], slice_offsets[i + 1])
                torch.mm(yp[rows, i * R : i * R + g.rank], weights[g.slot, cols, : g.rank].t(), out=delta[rows, cols])
        index_add_rows_(out, through_sources(perm, sources), delta)
        return out
    if sources is not None:  # the segments' rows are not out's: their deltas are added by token afterwards
        delta = x.new_zeros(x.shape[0], slice_offsets[-1])
        _add_segments(x, weights, plan, slice_offsets, delta)
        return index_add_rows_(out, sources, delta)
    return _add_segments(x, weights, plan, slice_offsets, out)


def _add_segments(x: torch.Tensor, weights: torch.Tensor, plan: ControlPlan, slice_offsets: tuple[int, ...],
                  out: torch.Tensor) -> torch.Tensor:
    """The segment plan's expand: each segment's delta added into its rows of ``out`` in place."""
    R, num_slices = weights.shape[2], len(slice_offsets) - 1
    for g in plan.groups:
        rows = slice(g.start, g.end)
        for i in range(num_slices):
            cols = slice(slice_offsets[i], slice_offsets[i + 1])
            out[rows, cols].addmm_(x[rows, i * R : i * R + g.rank], weights[g.slot, cols, : g.rank].t())
    return out


def sgemm_lora_a_embedding_control_fwd(
    ids: torch.Tensor, weights: torch.Tensor, batch_info: BatchInfo, num_valid_ids: int
) -> torch.Tensor:
    """Scaled embedding shrink. ``ids: (T,)`` integer, ``weights: (L, R, V_total)`` -> ``(T, R)``.

    Ids outside ``[0, num_valid_ids)`` get zeros (looked up as id 0, then masked).
    """
    if is_capturing():
        raise _capture_error("sgemm_lora_a_embedding_control_fwd")
    plan = batch_info.plan(ControlPlan)
    if plan.slot_blocks is not None:
        return sgemm_lora_a_embedding_graph_fwd(ids, weights, batch_info, num_valid_ids)
    T, R = ids.shape[0], weights.shape[1]
    out = weights.new_zeros(T, R)
    valid = (ids >= 0) & (ids < num_valid_ids)
    safe_ids = torch.where(valid, ids, 0)
    if plan.by_slot:
        src, dst = safe_ids.index_select(0, plan.token_perm), weights.new_zeros(plan.token_perm.shape[0], R)
    else:
        src, dst = safe_ids, out
    for g in plan.groups:
        rows = slice(g.start, g.end)
        picked = weights[g.slot, : g.rank].index_select(1, src[rows])  # (r, n)
        torch.mul(picked.t(), g.scaling, out=dst[rows, : g.rank])
    if plan.by_slot:
        out.index_copy_(0, plan.token_perm, dst)
    return out.masked_fill_(~valid[:, None], 0)
