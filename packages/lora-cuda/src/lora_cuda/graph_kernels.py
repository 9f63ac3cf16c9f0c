"""Graph-safe LoRA kernels: static shapes, no host reads, FLOPs that do not grow with the slot count.

The kernels themselves, with no ``torch.compile`` dispatch: :mod:`lora_cuda.graph_ops`
holds the public ops (which trace as the custom ops of :mod:`lora_cuda.custom_ops`
under ``torch.compile``), and the custom ops run these kernels. So the import
order is one way: kernels, then custom ops, then public ops.

Upstream's graph path looped over all ``L`` slots and multiplied every token by
every slot's weights, masking the result (``L`` times the FLOPs; docs/upstream-failures.md).
Here every token is multiplied by its own slot's weights only, with one of two
kernels; each reads its own per-batch plan (:mod:`lora_cuda.graph_plans`), which
the batch info builds on first request and refills in place with the batch:

* **grouped** (``torch._grouped_mm``): tokens sorted by slot (``sorted_tokens``,
  static ``T`` rows) and per-slot group ends; one grouped GEMM against the
  weight stack as it is, no padding, no weight copies, per chunk of sorted rows
  (one chunk off CPU; on CPU each chunk's gathered rows and delta stay in the
  caches, :data:`~lora_cuda.graph_plans.CHUNK_ROWS`). Used by default where
  it is known to work: CPU with torch >= 2.9 (all float dtypes), contiguous
  weights and 16-byte aligned strides;
* **blocked** (fallback everywhere else): each slot's tokens packed into blocks
  of ``b`` rows (``NB = ceil(T/b) + L`` blocks, at most one partly filled block
  per slot); gather the blocks' rows and their slots' weights and run one ``bmm``
  (:mod:`lora_cuda.block_kernels`, shared with the eager slot blocks).

Either way the shrink is scaled and masked by rank and each row's result gathered
back; the expand runs once per slice and accumulates into the output (into a strided
output through :mod:`lora_cuda.row_updates`).
Embedding: one 3-D gather ``A[slot, :, id]`` per token (all ranks at once).

The kernel preference (``kernel=``, see :data:`GRAPH_KERNELS`) is an argument of
each op and an option of the backend, never process-wide state.

Every op launches the same kernels whatever the batch's segments and slots, reads
nothing on the host, and keeps every shape fixed by the batch info's capacity.
Inputs are validated by the dispatcher in :mod:`lora_cuda.ops`.
"""

from __future__ import annotations

import torch

from lora_core import BatchInfo
from lora_core.grouped_gemm import grouped_gemm_fits
from lora_core.platforms import platform_for

from .block_kernels import block_expand, block_shrink
from .graph_plans import BlockPlan, SortedPlan
from .row_updates import check_sources_output, gather_add_rows_, through_sources

__all__ = [
    "GRAPH_KERNELS",
    "check_graph_kernel",
    "graph_kernel",
    "graph_plan_types",
    "graph_shrink",
    "graph_expand",
    "graph_embedding_shrink",
]

GRAPH_KERNELS = ("auto", "grouped", "blocked")
"""Kernel preferences: ``auto`` (grouped GEMM on CPU where it applies, token blocks
elsewhere), ``grouped`` (wherever its shape and alignment rules hold), ``blocked``."""


def check_graph_kernel(kernel: str) -> str:
    """``kernel`` if it names a preference of :data:`GRAPH_KERNELS`, else ``ValueError``."""
    if kernel not in GRAPH_KERNELS:
        raise ValueError(f"graph_kernel must be one of {', '.join(map(repr, GRAPH_KERNELS))}, got {kernel!r}")
    if kernel == "grouped" and not hasattr(torch, "_grouped_mm"):
        raise ValueError(f"graph_kernel='grouped' needs torch._grouped_mm, which torch {torch.__version__} lacks")
    return kernel


def graph_kernel(
    batch_info: BatchInfo, rows: int, weights: torch.Tensor, *sizes: int, preference: str = "auto"
) -> str:
    """``"grouped"`` or ``"blocked"``: the kernel for ``rows`` rows against ``weights``
    whose row strides / slice offsets are ``sizes`` elements. Decided from metadata only.

    The grouped GEMM needs one row per planned row, contiguous weights and 16-byte
    aligned strides; ``preference="auto"`` uses it only where the device's platform
    prefers it (``Platform.prefers_grouped_gemm``: the CPU, where it was measured to
    beat the blocked kernel), ``"grouped"`` wherever it applies.
    """
    if preference == "blocked" or not hasattr(torch, "_grouped_mm"):
        return "blocked"
    possible = rows == batch_info.num_tokens and grouped_gemm_fits((weights,), *sizes)
    if preference == "grouped":
        return "grouped" if possible else "blocked"
    return "grouped" if possible and platform_for(batch_info.device).prefers_grouped_gemm else "blocked"


def graph_plan_types(preference: str, device: torch.device) -> tuple[type, ...]:
    """The plan of the kernel the graph-safe ops take for ``preference`` on ``device``:
    what a backend builds before a capture. Where grouped GEMMs run, a layer whose
    sizes they reject takes the blocked kernel instead; its plan is then built on that
    layer's first call, which the warm-up step before a capture makes
    (docs/graph-rules.md), so a batch pays for refilling it only where it is used."""
    if preference == "blocked" or not hasattr(torch, "_grouped_mm"):
        return (BlockPlan,)
    if preference == "auto" and not platform_for(device).prefers_grouped_gemm:
        return (BlockPlan,)
    return (SortedPlan,)


def graph_shrink(x: torch.Tensor, weights: torch.Tensor, batch_info: BatchInfo, num_slices: int,
                 kernel: str, sources: torch.Tensor | None = None) -> torch.Tensor:
    """Scaled shrink. ``x: (T, in)``, ``weights: (L, c*R, in)`` -> ``(T, c*R)`` in ``x.dtype``;
    ``kernel`` is a preference of :data:`GRAPH_KERNELS`. With ``sources (N,)`` int64 (``batch_info``
    the rows with pair rows of a batch whose tokens ``x`` has): row ``n`` reads ``x[sources[n]]`` and
    the output has ``N`` rows. Inputs are validated by the caller."""
    in_features = x.shape[1]
    T = x.shape[0] if sources is None else sources.shape[0]
    L, cR = weights.shape[:2]
    if T == 0 or L == 0 or cR == 0:  # static shapes: nothing to compute, whatever the batch
        return x.new_zeros(T, cR)
    R = cR // num_slices
    if graph_kernel(batch_info, T, weights, in_features, cR, preference=kernel) == "grouped":
        plan = batch_info.plan(SortedPlan)
        scales, outside = plan.column_tables(R, num_slices)
        rows = plan.workspace("rows", (plan.chunk_rows, in_features), x.dtype, x.device)
        weights_t = weights.transpose(1, 2)
        parts = []
        for c in plan.chunks:  # each chunk's rows gathered into one workspace, reused chunk after chunk
            xs = torch.index_select(x, 0, through_sources(c.tokens, sources), out=rows[: c.stop - c.start])
            parts.append(torch._grouped_mm(xs, weights_t, offs=c.group_ends))
        ys = parts[0] if len(parts) == 1 else torch.cat(parts)
        ys.mul_(scales).masked_fill_(outside, 0)  # inf*0 beyond a rank is NaN: masked, not multiplied, away
        # every row is in the order once: gather each row's result back (no scatter into zeros)
        return ys.index_select(0, plan.token_rows)
    return block_shrink(x, weights, batch_info.plan(BlockPlan), num_slices, sources)


def graph_expand(x: torch.Tensor, weights: torch.Tensor, batch_info: BatchInfo, slice_offsets: tuple[int, ...],
                 base_output: torch.Tensor | None, kernel: str, sources: torch.Tensor | None = None) -> torch.Tensor:
    """Expand. ``x: (T, c*R)``, ``weights: (L, out_total, R)`` -> ``(T, out_total)``,
    accumulated into ``base_output`` in place when given; ``kernel`` as for the shrink. With
    ``sources (N,)`` int64 (``x (N, c*R)`` a batch's rows with pair rows, ``base_output`` its tokens,
    required): row ``n``'s delta is added into ``base_output[sources[n]]``."""
    check_sources_output(sources, base_output)
    T, cR = x.shape
    L, R, out_total = weights.shape[0], weights.shape[2], slice_offsets[-1]
    num_slices = len(slice_offsets) - 1
    out = base_output if base_output is not None else x.new_zeros(T, out_total)
    if T == 0 or L == 0 or R == 0:  # static shapes: nothing to add, whatever the batch
        return out
    strides = (R, out_total * R, *(o * R for o in slice_offsets[1:-1]), *slice_offsets[1:])
    if graph_kernel(batch_info, T, weights, *strides, preference=kernel) == "grouped":
        plan = batch_info.plan(SortedPlan)
        _, outside = plan.column_tables(R, num_slices)
        # rows without an adapter (rank 0) are zeroed here, so the last group's GEMM gives them 0
        ys = x.index_select(0, plan.sorted_tokens).masked_fill_(outside, 0)
        ys_slices = [ys] if num_slices == 1 else [ys[:, i * R : (i + 1) * R].contiguous() for i in range(num_slices)]
        weights_t = [weights[:, slice_offsets[i] : slice_offsets[i + 1]].transpose(1, 2) for i in range(num_slices)]
        # a strided out (one slice of a wider output) takes the chunks' deltas through one contiguous buffer
        add_by_gather = len(plan.chunks) == 1 and sources is None
        target = out if add_by_gather or out.is_contiguous() else out.new_zeros(out.shape)
        for c in plan.chunks:  # each chunk's delta is added before the next one's is computed
            parts = [torch._grouped_mm(y[c.start : c.stop], w, offs=c.group_ends) for y, w in zip(ys_slices, weights_t)]
            delta = parts[0] if num_slices == 1 else torch.cat(parts, dim=1)
            if sources is not None:  # a token may have several rows
                target.index_add_(0, through_sources(c.tokens, sources), delta)
            elif add_by_gather:  # every row's delta is here, at token_rows (rank-0 rows: zeros)
                gather_add_rows_(out, plan.token_rows[:T], delta, c.tokens)
            else:
                target.index_add_(0, c.tokens, delta)
        return out if target is out else out.add_(target)
    return block_expand(x, weights, batch_info.plan(BlockPlan), slice_offsets, out, sources)


def graph_embedding_shrink(ids: torch.Tensor, weights: torch.Tensor, batch_info: BatchInfo,
                           num_valid_ids: int) -> torch.Tensor:
    """Scaled embedding shrink by one 3-D gather. ``ids: (T,)`` integer,
    ``weights: (L, R, V_total)`` -> ``(T, R)``; ids outside ``[0, num_valid_ids)`` get zeros."""
    T, R = ids.shape[0], weights.shape[1]
    if T == 0 or weights.shape[0] == 0:
        return weights.new_zeros(T, R)
    slots = batch_info.token_slots[:T]
    valid = (slots >= 0) & (ids >= 0) & (ids < num_valid_ids)
    safe_slots = torch.where(valid, slots, 0).long()
    safe_ids = torch.where(valid, ids, 0).long()
    # (slot, id) picks a row of the (L, V_total, R) view: all R ranks of the token at once
    picked = weights.transpose(1, 2)[safe_slots, safe_ids]  # (T, R)
    in_rank = torch.arange(R, device=ids.device)[None, :] < batch_info.lora_ranks.index_select(0, safe_slots)[:, None]
    scaled = picked * batch_info.scalings.index_select(0, safe_slots)[:, None]
    return torch.where(valid[:, None] & in_rank, scaled, 0).to(weights.dtype)


def graph_dora_scale(output: torch.Tensor, factors: torch.Tensor, batch_info: BatchInfo,
                     bias: torch.Tensor | None) -> torch.Tensor:
    """DoRA's per-row rescale, in place: ``output (T, out)``, ``factors (L, out)`` float32,
    ``bias (out,)`` or ``None``; semantics of ``LoRABackend.run_dora_scale``.

    One gather of each row's factor row (keyed by ``token_slots``; slot -1 reads factor 1)
    and one in-place add of ``(f - 1) * (output - bias)`` computed in float32, so a row whose
    factor is 1 (slot -1, a slot without DoRA) is left exactly as it was."""
    if factors.shape[0] == 0:  # no slots: no row has an adapter (static shapes: the same in every batch)
        return output
    slots = batch_info.token_slots[: output.shape[0]]
    picked = factors.index_select(0, slots.clamp(min=0).long())  # (T, out)
    excess = torch.where(slots[:, None] >= 0, picked - 1, 0)
    unbiased = output.float() if bias is None else output.float() - bias.float()
    return output.add_((excess * unbiased).to(output.dtype))
