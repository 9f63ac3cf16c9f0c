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

Rank masking happens on the shrink output: ``A`` rows beyond a slot's rank never
reach the result, and ``B`` columns beyond it meet zeros.
"""

from __future__ import annotations

import torch

from lora_core import BatchInfo, is_capturing
from lora_core.grouped_gemm import grouped_gemm_fits
from lora_core.platforms import platform_for

__all__ = ["CHUNK_ELEMENTS", "control_experts_lora", "graph_experts_lora"]

CHUNK_ELEMENTS = 1 << 22
"""Gathered weight elements per chunk of pairs in the graph-safe kernel (16 MiB in fp32)."""


def _pair_tables(expert_ids: torch.Tensor, batch_info: BatchInfo, num_experts: int, max_rank: int):
    """Per pair ``(T*K,)``: its group ``slot * E + e`` (0 for pairs without a delta) and
    ``(T*K, R)`` float32 coefficients: the slot's scaling within its rank, 0 elsewhere."""
    T, K = expert_ids.shape
    slots = batch_info.token_slots[:T]
    has_slot = slots >= 0
    safe_slots = torch.where(has_slot, slots, 0).long()
    ranks = torch.where(has_slot, batch_info.lora_ranks.index_select(0, safe_slots), 0)  # (T,)
    scales = batch_info.scalings.index_select(0, safe_slots)  # (T,) float32
    ids = expert_ids.long()
    valid = (ids >= 0) & (ids < num_experts) & has_slot[:, None]  # (T, K)
    groups = (safe_slots[:, None] * num_experts + torch.where(valid, ids, 0)).reshape(-1)
    in_rank = torch.arange(max_rank, device=ids.device)[None, :] < ranks[:, None]  # (T, R)
    coef = torch.where(in_rank[:, None, :] & valid[:, :, None], scales[:, None, None], 0.0)
    return groups, coef.reshape(T * K, max_rank)


def _grouped(kernel: str, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the grouped-GEMM kernel runs for preference ``kernel`` (metadata only)."""
    if kernel == "blocked" or torch.compiler.is_compiling():
        return False
    R, in_features, out_features = a.shape[2], a.shape[3], b.shape[2]
    possible = grouped_gemm_fits((a, b), R, in_features, out_features)  # (x is in the weights' dtype)
    return possible and (kernel == "grouped" or platform_for(x.device).prefers_grouped_gemm)


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
    if _grouped(kernel, x, a, b):
        order = torch.argsort(groups, stable=True)  # pairs without a delta sit in group 0, masked below
        counts = torch.zeros(L * E, dtype=torch.int32, device=x.device).index_add_(
            0, groups, torch.ones_like(groups, dtype=torch.int32))
        ends = torch.cumsum(counts, 0, dtype=torch.int32)
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


def control_experts_lora(x: torch.Tensor, expert_ids: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                         batch_info: BatchInfo, base_output: torch.Tensor | None) -> torch.Tensor:
    """Control flow over the groups that exist; the same contract as :func:`graph_experts_lora`.
    Refuses to run under a graph capture (its group loop would be baked into the graph)."""
    if is_capturing():
        raise RuntimeError("control_experts_lora is a control-flow op: its loop over (slot, expert) groups is "
                           "fixed at capture time; capture a graph-mode batch (graph-safe ops) instead")
    T, K, in_features = x.shape
    L, E, R, _ = a.shape
    out_features = b.shape[2]
    out = base_output if base_output is not None else x.new_zeros(T, K, out_features)
    if T * K == 0 or R == 0:
        return out
    ranks, scalings = batch_info.lora_ranks_host, batch_info.scalings_host
    groups, coef = _pair_tables(expert_ids, batch_info, E, R)
    active = coef[:, 0] != 0  # a delta: a slot of rank > 0, an expert in [0, E)
    keys = torch.where(active, groups, L * E)
    order = torch.argsort(keys, stable=True)
    # the one read back per call (bincount would first read back the keys' min and max)
    counts = torch.zeros(L * E + 1, dtype=torch.int64, device=x.device).index_add_(
        0, keys, torch.ones_like(keys))[: L * E].tolist()
    xs, delta = x.reshape(T * K, in_features), x.new_zeros(T * K, out_features)
    start = 0
    for group, count in enumerate(counts):
        if count == 0:
            continue
        slot, expert = divmod(group, E)
        r, rows = ranks[slot], order[start : start + count]
        start += count
        y = torch.mm(xs.index_select(0, rows), a[slot, expert, :r].T)
        delta.index_add_(0, rows, torch.mm(y, b[slot, expert, :, :r].T), alpha=scalings[slot])
    return out.add_(delta.view(T, K, out_features))
