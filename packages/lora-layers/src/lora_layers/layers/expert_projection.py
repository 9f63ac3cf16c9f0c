"""The base projection of a fused experts module for each dispatched (token, expert) pair.

``expert_projection(x (T, K, in), expert_ids (T, K), weight (E, out, in))`` ->
``(T, K, out)``: ``x[t, k] @ weight[expert_ids[t, k]].T``, zero for ids outside
``[0, E)`` (an expert-parallel mask); ``transposed=True`` takes ``weight (E, in, out)``
(gpt-oss's layout) as it is. Three ways, the same numbers:

* a grouped GEMM over the pairs sorted by expert (``torch._grouped_mm``), where the
  device's platform prefers it (the CPU), for contiguous weights with 16-byte aligned
  strides, and not under ``torch.compile`` (whose grouped GEMM takes bf16 only): no
  host read, no weight copies;
* eager batches elsewhere: a host loop over the experts the router picked, after one
  read back of how many pairs each expert got (transformers' own experts loop reads
  back once per expert);
* graph batches and compiled code elsewhere: each pair's weight gathered for one ``bmm`` per chunk of
  pairs, static shapes and nothing read on the host.
"""

from __future__ import annotations

import itertools

import torch

from lora_core.grouped_gemm import grouped_gemm_fits
from lora_core.platforms import platform_for

__all__ = ["expert_projection"]

_CHUNK_ELEMENTS = 1 << 24
"""Gathered weight elements per chunk of pairs on the graph path (64 MiB in fp32)."""


def expert_projection(x: torch.Tensor, expert_ids: torch.Tensor, weight: torch.Tensor, *,
                      graph_safe: bool, transposed: bool = False, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x (T, K, in)``, ``expert_ids (T, K)``, ``weight (E, out, in)`` (``transposed``: ``(E, in,
    out)``, as gpt-oss stores its experts; used as it is, never copied), ``bias (E, out)`` added
    once per pair, or ``None`` -> ``(T, K, out)``; zero for ids outside ``[0, E)``."""
    T, K, in_features = x.shape
    E = weight.shape[0]
    out_features = weight.shape[2] if transposed else weight.shape[1]
    weight_t = weight if transposed else weight.transpose(1, 2)  # (E, in, out), a view
    P = T * K
    ids = expert_ids.reshape(P).long()
    valid = (ids >= 0) & (ids < E)
    safe = torch.where(valid, ids, 0)
    xs = x.reshape(P, in_features)
    if P == 0:
        return x.new_zeros(T, K, out_features)
    grouped = (not torch.compiler.is_compiling()  # compiled grouped GEMMs take bf16 only
               and platform_for(x.device).prefers_grouped_gemm
               and grouped_gemm_fits((weight,), in_features, out_features))
    if grouped:
        order = torch.argsort(safe, stable=True)
        counts = torch.zeros(E, dtype=torch.int32, device=x.device).index_add_(
            0, safe, torch.ones_like(safe, dtype=torch.int32))
        sorted_out = torch._grouped_mm(xs.index_select(0, order).contiguous(), weight_t,
                                       offs=torch.cumsum(counts, 0, dtype=torch.int32))
        out = torch.empty_like(sorted_out).index_copy_(0, order, sorted_out)
    elif graph_safe:
        chunk = max(1, _CHUNK_ELEMENTS // (in_features * out_features))
        out = torch.cat([torch.bmm(xs[s : s + chunk, None, :], weight_t.index_select(0, safe[s : s + chunk]))[:, 0]
                         for s in range(0, P, chunk)])
    else:
        out = xs.new_zeros(P, out_features)
        key = torch.where(valid, safe, E)  # the pairs outside [0, E) last, in no expert's rows
        order = torch.argsort(key, stable=True)
        # (bincount would read the largest key back first, to size its output)
        counts = torch.zeros(E + 1, dtype=torch.int64, device=x.device).index_add_(
            0, key, torch.ones_like(key))[:E].tolist()  # the one read back
        ends = itertools.accumulate(counts)
        for expert, (n, end) in enumerate(zip(counts, ends)):
            if n:  # an expert the router picked
                rows = order[end - n : end]
                out.index_copy_(0, rows, xs.index_select(0, rows) @ weight_t[expert])
    if bias is not None:
        out = out + bias.index_select(0, safe).to(out.dtype)
    return torch.where(valid[:, None], out, 0).view(T, K, out_features)
