"""The ``torch_native`` backend: lora_cuda's ops behind the lora_core interface."""

from __future__ import annotations

import torch

from lora_core import BatchInfoBackend

from .ops import sgemm_lora_a_embedding_fwd, sgemm_lora_a_fwd, sgemm_lora_b_fwd

__all__ = ["TorchNativeBackend"]


class TorchNativeBackend(BatchInfoBackend):
    """Pure-PyTorch backend for any device; eager batches use control-flow ops,
    graph batches (``use_graph=True``) the graph-safe ones."""

    name = "torch_native"

    def run_lora_a(self, x: torch.Tensor, weights: torch.Tensor, num_slices: int = 1) -> torch.Tensor:
        return sgemm_lora_a_fwd(x, weights, self.batch_info, num_slices)

    def run_lora_b(self, x, weights, slice_offsets, base_output=None) -> torch.Tensor:
        return sgemm_lora_b_fwd(x, weights, self.batch_info, slice_offsets, base_output)

    def run_lora_a_embedding(self, ids, weights, vocab_size, extra_embeddings=None) -> torch.Tensor:
        return sgemm_lora_a_embedding_fwd(ids, weights, self.batch_info, vocab_size, extra_embeddings)
