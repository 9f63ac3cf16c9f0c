"""Vectorized shrink and expand: a constant number of kernel launches for every batch.

On an Ascend NPU every host-side loop iteration costs a kernel launch, so the
``ascend`` backend never loops over segments, eager batches included. Its
shrink and expand are lora-cuda's graph-safe kernels (one implementation of
that math, not two: lora-ascend's one dependency on lora-cuda,
docs/architecture.md). What this module owns is the dispatch policy: those
kernels for every batch, ``use_graph`` or not, with validation at the boundary.

Memory: for ``T`` rows, ``L`` slots and block size ``b`` (at most 256), the
blocked kernel gathers ``NB = ceil(T / b) + L`` blocks (``BlockPlan.gathered_rows``):
``NB * b <= T + L * b`` rows of ``x`` and ``NB`` copies of a ``(c*R, in)``
weight slice. Peak extra memory therefore grows like ``T`` (about
``1 + L*b/T`` times the input), never like ``T * c*R * in`` as per-token
weight gathering would, so no chunking is needed. The grouped kernel gathers
exactly ``T`` rows and copies no weights.
"""

from __future__ import annotations

from typing import Sequence

import torch

from lora_core import BatchInfo
from lora_core.validation import check_lora_a_inputs, check_lora_b_inputs
from lora_cuda.graph_ops import check_graph_kernel, sgemm_lora_a_graph_fwd, sgemm_lora_b_graph_fwd
from lora_cuda.ops import sgemm_lora_a_fwd, sgemm_lora_b_fwd

__all__ = ["vectorized_lora_a_fwd", "vectorized_lora_b_fwd", "vectorized_pair_lora_a_fwd", "vectorized_pair_lora_b_fwd"]


def vectorized_lora_a_fwd(
    x: torch.Tensor, weights: torch.Tensor, batch_info: BatchInfo, num_slices: int = 1, *,
    graph_kernel: str = "auto",
) -> torch.Tensor:
    """Scaled shrink for any batch. ``x: (T, in)``, ``weights: (L, c*R, in)`` -> ``(T, c*R)``
    in ``x.dtype``; semantics of ``LoRABackend.run_lora_a``."""
    check_lora_a_inputs(x, weights, batch_info, num_slices)
    return sgemm_lora_a_graph_fwd(x, weights, batch_info, num_slices, kernel=check_graph_kernel(graph_kernel))


def vectorized_lora_b_fwd(
    x: torch.Tensor,
    weights: torch.Tensor,
    batch_info: BatchInfo,
    slice_offsets: Sequence[int] | torch.Tensor,
    base_output: torch.Tensor | None = None,
    *,
    graph_kernel: str = "auto",
) -> torch.Tensor:
    """Expand for any batch. ``x: (T, c*R)``, ``weights: (L, out_total, R)`` -> ``(T, out_total)``,
    accumulated into ``base_output (T, out_total)`` in place when given; semantics of
    ``LoRABackend.run_lora_b``."""
    offsets = check_lora_b_inputs(x, weights, batch_info, slice_offsets, base_output)
    return sgemm_lora_b_graph_fwd(x, weights, batch_info, offsets, base_output,
                                  kernel=check_graph_kernel(graph_kernel))


def vectorized_pair_lora_a_fwd(x: torch.Tensor, weights: torch.Tensor, batch_info: BatchInfo, num_slices: int = 1, *,
                               graph_kernel: str = "auto") -> torch.Tensor:
    """Scaled shrink over a batch's rows with pair rows (weighted mixes): ``x (T, in)``, the batch's
    tokens -> ``(N, c*R)``; semantics of ``lora_cuda.sgemm_lora_a_fwd(..., pair_rows=True)``, with
    the graph-safe kernels for every batch."""
    return sgemm_lora_a_fwd(x, weights, batch_info, num_slices, graph_safe=True, graph_kernel=graph_kernel,
                            pair_rows=True)


def vectorized_pair_lora_b_fwd(x: torch.Tensor, weights: torch.Tensor, batch_info: BatchInfo,
                               slice_offsets: Sequence[int] | torch.Tensor, base_output: torch.Tensor | None = None,
                               *, graph_kernel: str = "auto") -> torch.Tensor:
    """The expand of :func:`vectorized_pair_lora_a_fwd`'s output: ``x (N, c*R)``, each row's delta added
    into its token's row of ``base_output (T, out_total)``; semantics of
    ``lora_cuda.sgemm_lora_b_fwd(..., pair_rows=True)``, with the graph-safe kernels for every batch."""
    return sgemm_lora_b_fwd(x, weights, batch_info, slice_offsets, base_output, graph_safe=True,
                            graph_kernel=graph_kernel, pair_rows=True)
