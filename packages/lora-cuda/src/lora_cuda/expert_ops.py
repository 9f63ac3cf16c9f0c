"""The public torch-native ops of LoRA on fused experts: validate at the boundary, then dispatch
(docs/moe.md). The fused op, and its two halves (the scaled shrink and the expand) for a caller
that works between them. Graph-mode batches, ``graph_safe=True`` and ``torch.compile`` take the
graph-safe kernels; eager batches the control-flow ones."""

from __future__ import annotations

import torch

from lora_core import BatchInfo
from lora_core.validation import (
    check_experts_lora_a_inputs,
    check_experts_lora_b_inputs,
    check_experts_lora_inputs,
)

from .expert_kernels import (
    control_experts_expand,
    control_experts_lora,
    control_experts_shrink,
    graph_experts_expand,
    graph_experts_lora,
    graph_experts_shrink,
)
from .graph_kernels import check_graph_kernel

__all__ = ["experts_lora_fwd", "experts_lora_a_fwd", "experts_lora_b_fwd"]


def experts_lora_fwd(x: torch.Tensor, expert_ids: torch.Tensor, a_weights: torch.Tensor, b_weights: torch.Tensor,
                     batch_info: BatchInfo, base_output: torch.Tensor | None = None, *,
                     graph_safe: bool = False, graph_kernel: str = "auto") -> torch.Tensor:
    """LoRA delta of one expert parameter. ``x: (T, K, in)``, ``expert_ids: (T, K)`` int32/int64,
    ``a_weights: (L, E, R, in)``, ``b_weights: (L, E, out, R)`` -> ``(T, K, out)`` in ``x.dtype``,
    added to ``base_output (T, K, out)`` in place when given (and returned).

    Semantics (``s``, ``r`` the token's slot scaling and rank; zero for slot -1,
    rank 0 and expert ids outside ``[0, E)``)::

        out[t, k] += s * b_weights[slot_t, e, :, :r] @ a_weights[slot_t, e, :r] @ x[t, k],  e = expert_ids[t, k]

    ``graph_kernel`` (a preference of :data:`lora_cuda.GRAPH_KERNELS`) picks the graph-safe kernel.
    """
    check_experts_lora_inputs(x, expert_ids, a_weights, b_weights, batch_info, base_output)
    if 0 in a_weights.shape[:2] or 0 in x.shape[:2]:  # no slots, no experts or no pairs: no delta, any batch kind
        return base_output if base_output is not None else x.new_zeros(*x.shape[:2], b_weights.shape[2])
    if _graph_safe(graph_safe, batch_info):
        return graph_experts_lora(x, expert_ids, a_weights, b_weights, batch_info, base_output,
                                  kernel=check_graph_kernel(graph_kernel))
    return control_experts_lora(x, expert_ids, a_weights, b_weights, batch_info, base_output)


def _graph_safe(graph_safe: bool, batch_info: BatchInfo) -> bool:
    return graph_safe or batch_info.use_graph or torch.compiler.is_compiling()


def experts_lora_a_fwd(x: torch.Tensor, expert_ids: torch.Tensor, a_weights: torch.Tensor, batch_info: BatchInfo, *,
                       graph_safe: bool = False, graph_kernel: str = "auto") -> torch.Tensor:
    """Scaled shrink of one expert parameter. ``x: (T, K, in)``, ``expert_ids: (T, K)`` int32/int64,
    ``a_weights: (L, E, R, in)`` -> ``(T, K, R)`` in ``x.dtype``.

    Semantics (``s``, ``r`` the token's slot scaling and rank; all zero for slot -1, rank 0
    and expert ids outside ``[0, E)``)::

        out[t, k, :r] = s * a_weights[slot_t, e, :r] @ x[t, k],  e = expert_ids[t, k]
        out[t, k, r:] = 0
    """
    check_experts_lora_a_inputs(x, expert_ids, a_weights, batch_info)
    if 0 in a_weights.shape[:2] or 0 in x.shape[:2]:  # no slots, no experts or no pairs
        return x.new_zeros(*x.shape[:2], a_weights.shape[2])
    if _graph_safe(graph_safe, batch_info):
        return graph_experts_shrink(x, expert_ids, a_weights, batch_info, kernel=check_graph_kernel(graph_kernel))
    return control_experts_shrink(x, expert_ids, a_weights, batch_info)


def experts_lora_b_fwd(x: torch.Tensor, expert_ids: torch.Tensor, b_weights: torch.Tensor, batch_info: BatchInfo,
                       base_output: torch.Tensor | None = None, *, graph_safe: bool = False,
                       graph_kernel: str = "auto") -> torch.Tensor:
    """Expand of one expert parameter. ``x: (T, K, R)`` (a shrink's output), ``expert_ids: (T, K)``
    int32/int64, ``b_weights: (L, E, out, R)`` -> ``(T, K, out)`` in ``x.dtype``, added to
    ``base_output (T, K, out)`` in place when given (and returned).

    Semantics (``r`` the token's slot rank; no delta for slot -1, rank 0 and expert ids
    outside ``[0, E)``; ``x``'s columns beyond ``r`` are never read)::

        out[t, k] += b_weights[slot_t, e, :, :r] @ x[t, k, :r],  e = expert_ids[t, k]
    """
    check_experts_lora_b_inputs(x, expert_ids, b_weights, batch_info, base_output)
    if 0 in b_weights.shape[:2] or 0 in x.shape[:2]:  # no slots, no experts or no pairs
        return base_output if base_output is not None else x.new_zeros(*x.shape[:2], b_weights.shape[2])
    if _graph_safe(graph_safe, batch_info):
        return graph_experts_expand(x, expert_ids, b_weights, batch_info, base_output,
                                    kernel=check_graph_kernel(graph_kernel))
    return control_experts_expand(x, expert_ids, b_weights, batch_info, base_output)
