"""Reference math of LoRA on a fused experts module, in fp32 on the host (docs/moe.md).

For each token ``t`` of slot ``l`` (rank ``r``, scaling ``s``) and each of its
top-k choices ``k`` (expert ``e = expert_ids[t, k]``)::

    y[t, k, :r] = s * A_l[e, :r] @ x[t, k]          (the shrink: reference_experts_lora_a)
    delta[t, k] = B_l[e, :, :r] @ y[t, k, :r]       (the expand: reference_experts_lora_b)

(the scaling applied by the shrink, as in :mod:`lora_core.reference`), added to
that expert's projection output, where PEFT's ``ParamWrapper`` adds
``s * B_e @ A_e`` to the expert's weight: the gate_up output before the
activation, the down output before the router weighting. Slot -1, rank 0 and
expert ids outside ``[0, E)`` get a zero delta.
"""

from __future__ import annotations

from typing import Callable

import torch

from .batch_info import BatchInfo
from .reference import adapter_rows, num_pair_rows

__all__ = ["reference_experts_lora_a", "reference_experts_lora_b", "reference_experts_lora", "reference_experts"]


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(device="cpu", dtype=torch.float32)


def _pairs_with_delta(expert_ids: torch.Tensor, batch_info: BatchInfo, num_experts: int, num_tokens: int):
    """``(row, t, k, slot, e, r, s)`` of every dispatched pair that gets a delta: a shrink-output row
    (the token's, or a pair row of a mix's further slot: ``lora_core.reference.adapter_rows``) of a
    slot ``>= 0`` of rank ``r > 0`` (``s``: its scaling times the row's request scale) and an expert
    ``e`` in ``[0, E)``."""
    ids = expert_ids.detach().cpu().tolist()
    for slot, (rows, tokens, scales) in adapter_rows(batch_info, num_tokens).items():
        r = batch_info.lora_ranks_host[slot]
        for row, t, c in zip(rows.tolist(), tokens.tolist(), scales.tolist()):
            for k in range(expert_ids.shape[1]):
                if 0 <= ids[t][k] < num_experts:
                    yield row, t, k, slot, ids[t][k], r, batch_info.scalings_host[slot] * c


def reference_experts_lora_a(x: torch.Tensor, expert_ids: torch.Tensor, a: torch.Tensor,
                             batch_info: BatchInfo) -> torch.Tensor:
    """Scaled shrink. ``x: (T, K, in)``, ``expert_ids: (T, K)`` int, ``a: (L, E, R, in)`` -> ``(T + P, K, R)``
    fp32 (``P``: the pair rows of the batch's mixes)::

        y[row, k, :r] = s * A_l[e, :r] @ x[t, k]      (zero beyond r, and for pairs without a delta)
    """
    xf, af = _f32(x), _f32(a)
    T = expert_ids.shape[0]
    out = torch.zeros(T + num_pair_rows(batch_info), expert_ids.shape[1], a.shape[2])
    for row, t, k, slot, e, r, s in _pairs_with_delta(expert_ids, batch_info, a.shape[1], T):
        out[row, k, :r] = s * (af[slot, e, :r] @ xf[t, k])
    return out


def reference_experts_lora_b(y: torch.Tensor, expert_ids: torch.Tensor, b: torch.Tensor,
                             batch_info: BatchInfo) -> torch.Tensor:
    """Expand (no base). ``y: (T + P, K, R)``, ``expert_ids: (T, K)`` int, ``b: (L, E, out, R)`` -> delta
    ``(T, K, out)`` fp32, each row's delta added to its token::

        delta[t, k] += B_l[e, :, :r] @ y[row, k, :r]     (columns of y beyond r are never read)
    """
    yf, bf = _f32(y), _f32(b)
    out = torch.zeros(*expert_ids.shape, b.shape[2])
    for row, t, k, slot, e, r, _ in _pairs_with_delta(expert_ids, batch_info, b.shape[1], expert_ids.shape[0]):
        out[t, k] += bf[slot, e, :, :r] @ yf[row, k, :r]
    return out


def reference_experts_lora(x: torch.Tensor, expert_ids: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                           batch_info: BatchInfo) -> torch.Tensor:
    """``x: (T, K, in)``, ``expert_ids: (T, K)`` int, ``a: (L, E, R, in)``, ``b: (L, E, out, R)``
    -> delta ``(T, K, out)`` fp32: the shrink, then the expand."""
    return reference_experts_lora_b(reference_experts_lora_a(x, expert_ids, a, batch_info), expert_ids, b,
                                     batch_info)


def reference_experts(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                      gate_up_proj: torch.Tensor, down_proj: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor],
                      gate_up_lora: tuple[torch.Tensor, torch.Tensor], down_lora: tuple[torch.Tensor, torch.Tensor],
                      batch_info: BatchInfo) -> torch.Tensor:
    """A whole transformers experts module with LoRA: ``x: (T, H)``, ``top_k_index`` and
    ``top_k_weights: (T, K)``, ``gate_up_proj: (E, 2I, H)``, ``down_proj: (E, H, I)``,
    each LoRA pair ``(a, b)`` in the layout of :class:`lora_core.expert_layout.ExpertLoRABuffers`
    -> ``(T, H)`` fp32::

        h = x[t] @ gate_up_proj[e].T + delta_gate_up[t, k]
        y = (act(h[:I]) * h[I:]) @ down_proj[e].T + delta_down[t, k]
        out[t] = sum_k top_k_weights[t, k] * y
    """
    T, K = top_k_index.shape
    xf, wg, wd = _f32(x), _f32(gate_up_proj), _f32(down_proj)
    E, I = wg.shape[0], wd.shape[2]
    ids = top_k_index.detach().cpu().long()
    safe = ids.clamp(0, E - 1)
    xk = xf[:, None, :].expand(T, K, xf.shape[1])
    h = torch.einsum("tkh,tkoh->tko", xk, wg[safe]) + reference_experts_lora(xk, ids, *gate_up_lora, batch_info)
    mid = act(h[..., :I]) * h[..., I:]
    y = torch.einsum("tki,tkoi->tko", mid, wd[safe]) + reference_experts_lora(mid, ids, *down_lora, batch_info)
    weights = torch.where((ids >= 0) & (ids < E), _f32(top_k_weights), 0.0)
    return (y * weights[..., None]).sum(1)
