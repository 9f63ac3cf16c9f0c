"""Public torch-native LoRA ops: validate at the boundary, then dispatch on
``batch_info.use_graph`` to the graph-safe or the control-flow implementation
(``graph_safe=True`` selects the graph-safe one for any batch, as the ascend
backend does).

Validation reads shapes, dtypes, devices and host-side batch data only, so it
never synchronises the device and is safe under graph capture.
"""

from __future__ import annotations

from typing import Sequence

import torch

from lora_core import BatchInfo
from lora_core.validation import (
    check_embedding_inputs,
    check_lora_a_inputs,
    check_lora_b_inputs,
    check_token_ids,
)

from .control_ops import (
    sgemm_lora_a_control_fwd,
    sgemm_lora_a_embedding_control_fwd,
    sgemm_lora_b_control_fwd,
)
from .graph_ops import (
    sgemm_lora_a_embedding_graph_fwd,
    sgemm_lora_a_graph_fwd,
    sgemm_lora_b_graph_fwd,
)

__all__ = ["sgemm_lora_a_fwd", "sgemm_lora_b_fwd", "sgemm_lora_a_embedding_fwd"]


def sgemm_lora_a_fwd(
    x: torch.Tensor, weights: torch.Tensor, batch_info: BatchInfo, num_slices: int = 1, *, graph_safe: bool = False
) -> torch.Tensor:
    """Scaled shrink per slot. ``x: (T, in)``, ``weights: (L, c*R, in)`` -> ``(T, c*R)``
    in ``x.dtype``; columns beyond a slot's rank and rows of slot -1 are zero."""
    check_lora_a_inputs(x, weights, batch_info, num_slices)
    impl = sgemm_lora_a_graph_fwd if graph_safe or batch_info.use_graph else sgemm_lora_a_control_fwd
    return impl(x, weights, batch_info, num_slices)


def sgemm_lora_b_fwd(
    x: torch.Tensor,
    weights: torch.Tensor,
    batch_info: BatchInfo,
    slice_offsets: Sequence[int] | torch.Tensor,
    base_output: torch.Tensor | None = None,
    *,
    graph_safe: bool = False,
) -> torch.Tensor:
    """Expand per slice. ``x: (T, c*R)``, ``weights: (L, out_total, R)``,
    ``slice_offsets: [0, o1, ..., out_total]`` -> ``(T, out_total)``; when
    ``base_output (T, out_total)`` is given the delta is added to it in place and
    it is returned (also when no token has an adapter)."""
    offsets = check_lora_b_inputs(x, weights, batch_info, slice_offsets, base_output)
    impl = sgemm_lora_b_graph_fwd if graph_safe or batch_info.use_graph else sgemm_lora_b_control_fwd
    return impl(x, weights, batch_info, offsets, base_output)


def sgemm_lora_a_embedding_fwd(
    ids: torch.Tensor,
    weights: torch.Tensor,
    batch_info: BatchInfo,
    vocab_size: int,
    extra_embeddings: torch.Tensor | None = None,
    *,
    graph_safe: bool = False,
) -> torch.Tensor:
    """Scaled embedding shrink. ``ids: (T,)`` integer, ``weights: (L, R, V_total)`` -> ``(T, R)``
    (``(T, 0)`` for empty weights).

    Valid ids are ``[0, vocab_size + added)`` with ``added = extra_embeddings.shape[1]``
    (the slot's added tokens); any other id gets a zero delta, or raises
    ``ValueError`` under :func:`lora_core.strict_token_ids`.
    """
    num_valid = check_embedding_inputs(ids, weights, batch_info, vocab_size, extra_embeddings)
    check_token_ids(ids, num_valid)
    if weights.numel() == 0:
        return weights.new_zeros(ids.shape[0], weights.shape[1])
    impl = (sgemm_lora_a_embedding_graph_fwd if graph_safe or batch_info.use_graph
            else sgemm_lora_a_embedding_control_fwd)
    return impl(ids, weights, batch_info, num_valid)
