"""The ``ascend`` backend: vectorized ops for every batch, eager or captured."""

from __future__ import annotations

import torch

from lora_core import BatchInfoBackend

from .ops import vectorized_lora_a_embedding_fwd, vectorized_lora_a_fwd, vectorized_lora_b_fwd

__all__ = ["AscendBackend"]


class AscendBackend(BatchInfoBackend):
    """Backend for Ascend NPUs (``device="npu"`` with torch_npu), or any torch device.

    Unlike ``torch_native`` it never loops over segments on the host: eager and
    graph batches alike run the same fixed set of kernels.
    """

    name = "ascend"

    def run_lora_a(self, x: torch.Tensor, weights: torch.Tensor, num_slices: int = 1) -> torch.Tensor:
        return vectorized_lora_a_fwd(x, weights, self.batch_info, num_slices)

    def run_lora_b(self, x, weights, slice_offsets, base_output=None) -> torch.Tensor:
        return vectorized_lora_b_fwd(x, weights, self.batch_info, slice_offsets, base_output)

    def run_lora_a_embedding(self, ids, weights, vocab_size, extra_embeddings=None) -> torch.Tensor:
        return vectorized_lora_a_embedding_fwd(ids, weights, self.batch_info, vocab_size, extra_embeddings)
