"""LoRA kernels for the experts of a fused mixture-of-experts module (docs/moe.md).

A dispatched pair is one token ``t`` and one of its top-k experts ``e``; its
group is ``(slot_t, e)``. Both kernels multiply each pair by its own group's
weights only, truncated to the slot's rank, so their FLOPs grow with the
dispatched pairs times the rank, never with every expert times every slot:

* :func:`control_experts_lora` (eager batches of ``torch_native``): pairs sorted
  by group on the device, the group sizes read back once per call (the router's
  choices are device data; transformers' own experts loop reads back per expert), then a
  host loop over the groups that exist: one shrink and one expand per group.
* :func:`graph_experts_lora` (graph batches, ``ascend``, ``torch.compile``):
  static shapes and nothing read on the host, with one of two kernels (the
  backend's ``graph_kernel`` preference, :data:`lora_cuda.GRAPH_KERNELS`):
  **grouped**: the pairs sorted by group on the device and two grouped GEMMs
  (``torch._grouped_mm``) against the weight stacks viewed as ``L*E`` groups, no
  weight copies (``"auto"`` uses it where the platform prefers grouped GEMMs, the
  CPU, for 16-byte aligned strides, and never under ``torch.compile``, whose grouped
  GEMM takes bf16 only); **gathered** (everywhere else, ``"blocked"``): each pair's
  ``A`` and ``B`` gathered and multiplied in two ``bmm`` per chunk of pairs, the
  chunk count fixed by the capacity and the weights' shapes (a chunk's gathered
  weights stay under :data:`CHUNK_ELEMENTS`). Either way a capture replays for any batch.

The two halves of the same op, for a caller that works between them (a tensor-parallel
all-reduce of the shrink, docs/layers.md "Fully sharded LoRA"), follow the same split:
:func:`control_experts_shrink` / :func:`control_experts_expand` for eager batches,
:func:`graph_experts_shrink` / :func:`graph_experts_expand` (each one grouped GEMM, or one
``bmm`` per chunk of pairs) for the rest. The shrink applies the slot's scaling, as the
linear shrink does; the expand does not.

Rank masking happens on the shrink output (and on the expand's input): ``A`` rows beyond
a slot's rank never reach the result, and ``B`` columns beyond it meet zeros.
"""

from __future__ import annotations

from typing import Iterator

import torch

from lora_core import BatchInfo, is_capturing
from lora_core.grouped_gemm import grouped_gemm_fits
from lora_core.platforms import platform_for

__all__ = ["CHUNK_ELEMENTS", "control_experts_lora", "graph_experts_lora", "control_experts_shrink",
           "control_experts_expand", "graph_experts_shrink", "graph_experts_expand"]

CHUNK_ELEMENTS = 1 << 22
"""Gathered weight elements per chunk of pairs in the graph-safe kernel (16 MiB in fp32)."""


def _pair_tables(expert_ids: torch.Tensor, batch_info: BatchInfo, num_experts: int, max_rank: int, *,
                 scaled: bool = True):
    """Per pair ``(T*K,)``: its group ``slot * E + e`` (0 for pairs without a delta) and
    ``(T*K, R)`` float32 coefficients: the slot's scaling (``scaled``; else 1) within its rank,
    0 elsewhere."""
    T, K = expert_ids.shape
    slots = batch_info.token_slots[:T]
    has_slot = slots >= 0
    safe_slots = torch.where(has_slot, slots, 0).long()
    ranks = torch.where(has_slot, batch_info.lora_ranks.index_select(0, safe_slots), 0)  # (T,)
    ids = expert_ids.long()
    valid = (ids >= 0) & (ids < num_experts) & has_slot[:, None]  # (T, K)
    groups = (safe_slots[:, None] * num_experts + torch.where(valid, ids, 0)).reshape(-1)
    in_rank = torch.arange(max_rank, device=ids.device)[None, :] < ranks[:, None]  # (T, R)
    value = batch_info.scalings.index_select(0, safe_slots)[:, None, None] if scaled else 1.0  # float32
    coef = torch.where(in_rank[:, None, :] & valid[:, :, None], value, 0.0)
    return groups, coef.reshape(T * K, max_rank)


def _grouped(kernel: str, x: torch.Tensor, stacks: tuple[torch.Tensor, ...], *sizes: int) -> bool:
    """Whether the grouped-GEMM kernel runs for preference ``kernel`` over the weight ``stacks``
    with row strides of ``sizes`` elements (metadata only)."""
    if kernel == "blocked" or torch.compiler.is_compiling():
        return False
    possible = grouped_gemm_fits(stacks, *sizes)  # (x is in the weights' dtype)
    return possible and (kernel == "grouped" or platform_for(x.device).prefers_grouped_gemm)


def _sort_by_group(groups: torch.Tensor, num_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs' order sorted by group (stable) and each group's end in it (int32, a grouped GEMM's ``offs``)."""
    order = torch.argsort(groups, stable=True)
    counts = torch.zeros(num_groups, dtype=torch.int32, device=groups.device).index_add_(
        0, groups, torch.ones_like(groups, dtype=torch.int32))
    return order, torch.cumsum(counts, 0, dtype=torch.int32)


def _graph_pair_products(rows: torch.Tensor, groups: torch.Tensor, stack: torch.Tensor, grouped: bool) -> torch.Tensor:
    """Graph-safe: each pair's ``rows[p] (n,)`` times its group's ``stack[groups[p]] (m, n)`` ->
    ``(P, m)`` in the pairs' order: one grouped GEMM over the pairs sorted by group (no weight
    copies), or one ``bmm`` per chunk of pairs against their gathered matrices (a chunk count
    fixed by the shapes)."""
    if grouped:
        order, ends = _sort_by_group(groups, stack.shape[0])
        products = torch._grouped_mm(rows.index_select(0, order), stack.transpose(1, 2), offs=ends)
        return torch.empty_like(products).index_copy_(0, order, products)
    chunk = max(1, CHUNK_ELEMENTS // (stack.shape[1] * stack.shape[2]))
    parts = [torch.bmm(stack.index_select(0, groups[s : s + chunk]), rows[s : s + chunk, :, None])[..., 0]
             for s in range(0, rows.shape[0], chunk)]  # a count fixed by the shapes
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def graph_experts_lora(x: torch.Tensor, expert_ids: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                       batch_info: BatchInfo, base_output: torch.Tensor | None, kernel: str = "auto") -> torch.Tensor:
    """Graph-safe: ``x (T, K, in)``, ``expert_ids (T, K)``, ``a (L, E, R, in)``, ``b (L, E, out, R)``
    -> ``(T, K, out)`` in ``x.dtype``, added to ``base_output`` in place when given; ``kernel``
    is a preference of :data:`lora_cuda.GRAPH_KERNELS`. Inputs are validated by the caller."""
    T, K, in_features = x.shape
    L, E, R, _ = a.shape
    out_features = b.shape[2]
    out = base_output if base_output is not None else x.new_zeros(T, K, out_features)
    P = T * K
    if P == 0 or R == 0:  # static shapes: nothing to add, whatever the batch
        return out
    groups, coef = _pair_tables(expert_ids, batch_info, E, R)
    a_groups, b_groups = a.reshape(L * E, R, in_features), b.reshape(L * E, out_features, R)
    xs = x.reshape(P, in_features)
    if _grouped(kernel, x, (a, b), R, in_features, out_features):
        order, ends = _sort_by_group(groups, L * E)  # pairs without a delta sit in group 0, masked below
        y = torch._grouped_mm(xs.index_select(0, order), a_groups.transpose(1, 2), offs=ends)  # (P, R)
        c = coef.index_select(0, order)
        y = torch.where(c != 0, y.float() * c, 0.0).to(x.dtype)
        d = torch._grouped_mm(y, b_groups.transpose(1, 2), offs=ends)  # (P, out), sorted
        return out.add_(torch.empty_like(d).index_copy_(0, order, d).view(T, K, out_features))
    chunk = max(1, CHUNK_ELEMENTS // (R * (in_features + out_features)))
    deltas = []
    for start in range(0, P, chunk):  # a count fixed by the shapes: the same launches for every batch
        g, rows = groups[start : start + chunk], slice(start, start + chunk)
        y = torch.bmm(a_groups.index_select(0, g), xs[rows, :, None])[..., 0]  # (C, R)
        y = torch.where(coef[rows] != 0, y.float() * coef[rows], 0.0).to(x.dtype)  # garbage beyond r: masked away
        deltas.append(torch.bmm(b_groups.index_select(0, g), y[:, :, None])[..., 0])  # (C, out)
    delta = deltas[0] if len(deltas) == 1 else torch.cat(deltas)
    return out.add_(delta.view(T, K, out_features))


def graph_experts_shrink(x: torch.Tensor, expert_ids: torch.Tensor, a: torch.Tensor, batch_info: BatchInfo,
                         kernel: str = "auto") -> torch.Tensor:
    """Graph-safe scaled shrink: ``x (T, K, in)``, ``expert_ids (T, K)``, ``a (L, E, R, in)`` ->
    ``(T, K, R)`` in ``x.dtype``, zero beyond each slot's rank and for pairs without a delta.
    Inputs are validated by the caller."""
    T, K, in_features = x.shape
    L, E, R, _ = a.shape
    if T * K == 0 or R == 0:
        return x.new_zeros(T, K, R)
    groups, coef = _pair_tables(expert_ids, batch_info, E, R)
    y = _graph_pair_products(x.reshape(T * K, in_features), groups, a.reshape(L * E, R, in_features),
                             _grouped(kernel, x, (a,), R, in_features))
    return torch.where(coef != 0, y.float() * coef, 0.0).to(x.dtype).view(T, K, R)


def graph_experts_expand(x: torch.Tensor, expert_ids: torch.Tensor, b: torch.Tensor, batch_info: BatchInfo,
                         base_output: torch.Tensor | None, kernel: str = "auto") -> torch.Tensor:
    """Graph-safe expand: ``x (T, K, R)``, ``expert_ids (T, K)``, ``b (L, E, out, R)`` -> ``(T, K, out)``
    in ``x.dtype``, added to ``base_output`` in place when given; ``x``'s columns beyond each slot's
    rank are masked away. Inputs are validated by the caller."""
    T, K, R = x.shape
    L, E, out_features, _ = b.shape
    out = base_output if base_output is not None else x.new_zeros(T, K, out_features)
    if T * K == 0 or R == 0:
        return out
    groups, in_rank = _pair_tables(expert_ids, batch_info, E, R, scaled=False)
    y = torch.where(in_rank != 0, x.reshape(T * K, R), 0)
    delta = _graph_pair_products(y, groups, b.reshape(L * E, out_features, R),
                                 _grouped(kernel, x, (b,), R, out_features))
    return out.add_(delta.view(T, K, out_features))


def _refuse_capture(kernel: str) -> None:
    if is_capturing():
        raise RuntimeError(f"{kernel} is a control-flow op: its loop over (slot, expert) groups is fixed at "
                           "capture time; capture a graph-mode batch (graph-safe ops) instead")


def _present_groups(groups: torch.Tensor, active: torch.Tensor, num_experts: int,
                    num_groups: int) -> Iterator[tuple[int, int, torch.Tensor]]:
    """``(slot, expert, pairs)`` of each (slot, expert) group with an ``active`` pair, ``pairs`` the
    indices of its active pairs, after one read back of the group sizes."""
    keys = torch.where(active, groups, num_groups)
    order = torch.argsort(keys, stable=True)
    # the one read back per call (bincount would first read back the keys' min and max)
    counts = torch.zeros(num_groups + 1, dtype=torch.int64, device=groups.device).index_add_(
        0, keys, torch.ones_like(keys))[:num_groups].tolist()
    start = 0
    for group, count in enumerate(counts):
        if count:
            slot, expert = divmod(group, num_experts)
            yield slot, expert, order[start : start + count]
            start += count


def control_experts_lora(x: torch.Tensor, expert_ids: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                         batch_info: BatchInfo, base_output: torch.Tensor | None) -> torch.Tensor:
    """Control flow over the groups that exist; the same contract as :func:`graph_experts_lora`.
    Refuses to run under a graph capture (its group loop would be baked into the graph)."""
    _refuse_capture("control_experts_lora")
    T, K, in_features = x.shape
    L, E, R, _ = a.shape
    out_features = b.shape[2]
    out = base_output if base_output is not None else x.new_zeros(T, K, out_features)
    if T * K == 0 or R == 0:
        return out
    ranks, scalings = batch_info.lora_ranks_host, batch_info.scalings_host
    groups, coef = _pair_tables(expert_ids, batch_info, E, R)
    xs, delta = x.reshape(T * K, in_features), x.new_zeros(T * K, out_features)
    # active: a delta (a slot of rank > 0, an expert in [0, E))
    for slot, expert, rows in _present_groups(groups, coef[:, 0] != 0, E, L * E):
        r = ranks[slot]
        y = torch.mm(xs.index_select(0, rows), a[slot, expert, :r].T)
        delta.index_add_(0, rows, torch.mm(y, b[slot, expert, :, :r].T), alpha=scalings[slot])
    return out.add_(delta.view(T, K, out_features))


def control_experts_shrink(x: torch.Tensor, expert_ids: torch.Tensor, a: torch.Tensor,
                           batch_info: BatchInfo) -> torch.Tensor:
    """Control flow over the groups that exist; the same contract as :func:`graph_experts_shrink`."""
    _refuse_capture("control_experts_shrink")
    T, K, in_features = x.shape
    L, E, R, _ = a.shape
    out = x.new_zeros(T * K, R)
    if T * K and R:
        ranks, scalings = batch_info.lora_ranks_host, batch_info.scalings_host
        groups, coef = _pair_tables(expert_ids, batch_info, E, R)
        xs = x.reshape(T * K, in_features)
        for slot, expert, rows in _present_groups(groups, coef[:, 0] != 0, E, L * E):
            r = ranks[slot]
            out[rows, :r] = torch.mm(xs.index_select(0, rows), a[slot, expert, :r].T) * scalings[slot]
    return out.view(T, K, R)


def control_experts_expand(x: torch.Tensor, expert_ids: torch.Tensor, b: torch.Tensor, batch_info: BatchInfo,
                           base_output: torch.Tensor | None) -> torch.Tensor:
    """Control flow over the groups that exist; the same contract as :func:`graph_experts_expand`."""
    _refuse_capture("control_experts_expand")
    T, K, R = x.shape
    L, E, out_features, _ = b.shape
    out = base_output if base_output is not None else x.new_zeros(T, K, out_features)
    if T * K == 0 or R == 0:
        return out
    ranks = batch_info.lora_ranks_host
    groups, in_rank = _pair_tables(expert_ids, batch_info, E, R, scaled=False)
    xs, delta = x.reshape(T * K, R), x.new_zeros(T * K, out_features)
    for slot, expert, rows in _present_groups(groups, in_rank[:, 0] != 0, E, L * E):
        r = ranks[slot]
        delta.index_add_(0, rows, torch.mm(xs.index_select(0, rows)[:, :r], b[slot, expert, :, :r].T))
    return out.add_(delta.view(T, K, out_features))
