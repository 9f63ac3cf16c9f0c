"""Graph-safe LoRA ops: the kernels of :mod:`lora_cuda.graph_kernels`, and one custom op each
under ``torch.compile``.

Called eagerly (or while a CUDA/NPU graph is captured) each op runs its kernel; a
graph-mode batch is first given its compile key (:func:`~lora_cuda.graph_plans.batch_key`),
so that a warm-up step prepares the batch for a later compile. Under
``torch.compile`` (``torch.compiler.is_compiling()``) the shrink and the expand
trace as one call of :mod:`lora_cuda.custom_ops` each (imported here, so they are
registered before any op can trace): the compiled graph holds an opaque call whose
fake implementation gives the output's shape, and the kernel (its choice, plan
look-ups and lazily created tables and workspaces included) runs when the op runs,
on real tensors. So no meta/fake rule of ``torch._grouped_mm`` is ever consulted
and the compiled code's guards read no batch content (docs/compile.md).

Inputs are validated by the dispatcher in :mod:`lora_cuda.ops`.
"""

from __future__ import annotations

import torch

from lora_core import BatchInfo

from . import custom_ops  # noqa: F401  (registers torch.ops.lora_cuda.*, which these ops call)
from .graph_kernels import (
    GRAPH_KERNELS,
    check_graph_kernel,
    graph_embedding_shrink,
    graph_expand,
    graph_kernel,
    graph_plan_types,
    graph_shrink,
)
from .graph_plans import batch_args, batch_key

__all__ = [
    "GRAPH_KERNELS",
    "check_graph_kernel",
    "graph_kernel",
    "graph_plan_types",
    "sgemm_lora_a_graph_fwd",
    "sgemm_lora_b_graph_fwd",
    "sgemm_lora_a_embedding_graph_fwd",
]


def sgemm_lora_a_graph_fwd(
    x: torch.Tensor, weights: torch.Tensor, batch_info: BatchInfo, num_slices: int = 1, *, kernel: str = "auto",
    sources: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scaled shrink. ``x: (T, in)``, ``weights: (L, c*R, in)`` -> ``(T, c*R)`` in ``x.dtype``;
    ``kernel`` is a preference of :data:`GRAPH_KERNELS`; ``sources`` as for
    :func:`~lora_cuda.graph_kernels.graph_shrink` (eager calls and captures only).

    Semantics: ``out[t, i*R + r] = scaling[s] * (weights[s, i*R + r] @ x[t])`` for ``r < rank[s]``,
    0 elsewhere and for ``s = token_slots[t] = -1``."""
    if torch.compiler.is_compiling():  # one custom op, which runs graph_shrink
        _check_no_sources(sources)
        key, host = batch_args(batch_info, x, weights)
        return torch.ops.lora_cuda.shrink(x, weights, key, host, num_slices, kernel)
    if batch_info.use_graph:
        batch_key(batch_info)  # a warm-up call prepares the batch for compiling
    return graph_shrink(x, weights, batch_info, num_slices, kernel, sources)


def sgemm_lora_b_graph_fwd(
    x: torch.Tensor,
    weights: torch.Tensor,
    batch_info: BatchInfo,
    slice_offsets: tuple[int, ...],
    base_output: torch.Tensor | None = None,
    *,
    kernel: str = "auto",
    sources: torch.Tensor | None = None,
) -> torch.Tensor:
    """Expand. ``x: (T, c*R)``, ``weights: (L, out_total, R)`` -> ``(T, out_total)``,
    accumulated into ``base_output`` in place when given; ``kernel`` and ``sources`` as for the shrink
    (:func:`~lora_cuda.graph_kernels.graph_expand`).

    Semantics: ``out[t, o_i:o_{i+1}] += weights[s, o_i:o_{i+1}, :rank[s]] @ x[t, i*R : i*R + rank[s]]``
    for each slice ``i``; nothing past a slot's rank is read, nothing added for slot -1."""
    if torch.compiler.is_compiling():  # one custom op that updates base_output in place
        _check_no_sources(sources)
        out = base_output if base_output is not None else x.new_zeros(x.shape[0], slice_offsets[-1])
        key, host = batch_args(batch_info, x, weights, out)
        torch.ops.lora_cuda.expand_(x, weights, key, host, list(slice_offsets), out, kernel)
        return out
    if batch_info.use_graph:
        batch_key(batch_info)
    return graph_expand(x, weights, batch_info, slice_offsets, base_output, kernel, sources)


def _check_no_sources(sources: torch.Tensor | None) -> None:
    if sources is not None:  # the custom ops take a batch, not its rows' sources
        raise ValueError("sources are not taken under torch.compile: gather the inputs by sources first")


def sgemm_lora_a_embedding_graph_fwd(
    ids: torch.Tensor, weights: torch.Tensor, batch_info: BatchInfo, num_valid_ids: int
) -> torch.Tensor:
    """Scaled embedding shrink by one 3-D gather. ``ids: (T,)`` integer,
    ``weights: (L, R, V_total)`` -> ``(T, R)``; ids outside ``[0, num_valid_ids)`` get zeros.
    (Under ``torch.compile`` the embedding traces through :func:`lora_cuda.ops.sgemm_lora_a_embedding_fwd`.)"""
    if batch_info.use_graph and not torch.compiler.is_compiling():
        batch_key(batch_info)
    return graph_embedding_shrink(ids, weights, batch_info, num_valid_ids)
