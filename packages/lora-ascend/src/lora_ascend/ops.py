"""Vectorized LoRA ops: a constant number of kernel launches in every mode.

The kernels are lora-cuda's graph-safe ones (one implementation of the math,
not two): the batch info packs each slot's tokens into static blocks, so

* embedding shrink is one 3-D gather ``A[slot, rank, id]`` per token, with the
  out-of-vocabulary policy of SPEC §3 (zero delta, never a clamped neighbour);
* shrink and expand gather each block's rows and its slot's weights and run one
  ``bmm`` (one per slice for expand), scattered back with ``index_add``.

(where available the blocks give way to one grouped GEMM over tokens sorted by
slot, with the same properties and no padding). What this module adds is the
Ascend dispatch policy: these ops run for eager batches too (``use_graph=False``),
because on an NPU a host loop over segments costs a launch per segment, and the
memory bound below.

Memory: for ``T`` rows, ``L`` slots and block size ``b`` (``BatchInfo.block_size``,
at most 256), the blocked kernel's gathered operands are ``NB = ceil(T / b) + L`` blocks:
``NB * b <= T + L * b`` rows of ``x`` and ``NB`` copies of a ``(c*R, in)`` weight
slice. Peak extra memory therefore grows like ``T`` (about ``1 + L*b/T`` times
the input), never like ``T * c*R * in`` as per-token weight gathering would, so
no chunking is needed: at ``T = 8192`` the gathered weights are ``NB <= 40 + L``
slices. The grouped kernel gathers exactly ``T`` rows and copies no weights.
"""

from __future__ import annotations

from typing import Sequence

import torch

from lora_core import BatchInfo
from lora_cuda.ops import sgemm_lora_a_embedding_fwd, sgemm_lora_a_fwd, sgemm_lora_b_fwd

__all__ = [
    "gathered_rows_bound",
    "vectorized_lora_a_fwd",
    "vectorized_lora_b_fwd",
    "vectorized_lora_a_embedding_fwd",
]


def gathered_rows_bound(batch_info: BatchInfo) -> int:
    """Rows of ``x`` the blocked kernel gathers (``NB * b``); at most ``T + L * b``."""
    return batch_info.num_blocks * batch_info.block_size


def vectorized_lora_a_fwd(
    x: torch.Tensor, weights: torch.Tensor, batch_info: BatchInfo, num_slices: int = 1
) -> torch.Tensor:
    """Scaled shrink, graph-safe kernels for any batch: see :func:`lora_cuda.sgemm_lora_a_fwd`."""
    return sgemm_lora_a_fwd(x, weights, batch_info, num_slices, graph_safe=True)


def vectorized_lora_b_fwd(
    x: torch.Tensor,
    weights: torch.Tensor,
    batch_info: BatchInfo,
    slice_offsets: Sequence[int] | torch.Tensor,
    base_output: torch.Tensor | None = None,
) -> torch.Tensor:
    """Expand, graph-safe kernels for any batch: see :func:`lora_cuda.sgemm_lora_b_fwd`."""
    return sgemm_lora_b_fwd(x, weights, batch_info, slice_offsets, base_output, graph_safe=True)


def vectorized_lora_a_embedding_fwd(
    ids: torch.Tensor,
    weights: torch.Tensor,
    batch_info: BatchInfo,
    vocab_size: int,
    extra_embeddings: torch.Tensor | None = None,
) -> torch.Tensor:
    """Embedding shrink by one gather per token, for any batch: see
    :func:`lora_cuda.sgemm_lora_a_embedding_fwd` (zero delta out of vocabulary)."""
    return sgemm_lora_a_embedding_fwd(ids, weights, batch_info, vocab_size, extra_embeddings, graph_safe=True)
