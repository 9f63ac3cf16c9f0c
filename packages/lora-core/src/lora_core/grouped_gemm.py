"""When ``torch._grouped_mm`` can multiply by a stack of weight matrices as it is.

The grouped GEMM (torch >= 2.9) takes a ``(G, K, N)`` stack of matrices, one per
group of rows, without copying it, when the stack is contiguous, its data 16-byte
aligned, and every row stride and slice offset a multiple of 16 bytes. The
graph-safe kernels of lora-cuda (linear and experts) and the base projection of
fused experts in lora-layers ask here before taking it, and fall back otherwise.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["grouped_gemm_fits"]

_ALIGNMENT = 16  # bytes


def grouped_gemm_fits(stacks: Sequence[torch.Tensor], *sizes: int) -> bool:
    """Whether ``torch._grouped_mm`` takes the weight ``stacks`` (one or more, of one dtype) as
    they are, with row strides and slice offsets of ``sizes`` elements of that dtype: the op
    exists, every stack is contiguous with 16-byte aligned data, and every size is a multiple
    of 16 bytes. Decided from metadata only; ``ValueError`` for no stacks or mixed dtypes."""
    if not stacks or any(w.dtype != stacks[0].dtype for w in stacks):
        raise ValueError(f"stacks must be one or more tensors of one dtype, got {[w.dtype for w in stacks]}")
    if not hasattr(torch, "_grouped_mm"):
        return False
    if not all(w.is_contiguous() and w.data_ptr() % _ALIGNMENT == 0 for w in stacks):
        return False
    itemsize = stacks[0].dtype.itemsize
    return all(size * itemsize % _ALIGNMENT == 0 for size in sizes)
