"""The ``torch_native`` backend: lora_cuda's ops behind the lora_core interface."""

from __future__ import annotations

from typing import Sequence

import torch

from lora_core import BatchInfo, LoRABackend, build_batch_info

from .ops import sgemm_lora_a_embedding_fwd, sgemm_lora_a_fwd, sgemm_lora_b_fwd

__all__ = ["TorchNativeBackend"]


def _check_num_slices(op: str, slice_offsets: Sequence[int] | torch.Tensor, expected: int) -> None:
    if len(slice_offsets) != expected + 1:
        raise ValueError(
            f"{op} needs {expected} slices, i.e. {expected + 1} slice_offsets, got {len(slice_offsets)}"
        )


class TorchNativeBackend(LoRABackend):
    """Pure-PyTorch backend for any device; eager batches use control-flow ops,
    graph batches (``use_graph=True``) the graph-safe ones."""

    name = "torch_native"

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._batch_info: BatchInfo | None = None

    @property
    def batch_info(self) -> BatchInfo:
        if self._batch_info is None:
            raise RuntimeError(f"{type(self).__name__}: call prepare_batch() before running LoRA ops")
        return self._batch_info

    def prepare_batch(self, batch_info: BatchInfo) -> None:
        if not isinstance(batch_info, BatchInfo):
            raise TypeError(f"batch_info must be a lora_core.BatchInfo, got {type(batch_info).__name__}")
        self._batch_info = batch_info

    def init_graph_batch_info(
        self, max_tokens: int, lora_ranks: Sequence[int], scalings: Sequence[float]
    ) -> BatchInfo:
        return build_batch_info(
            [max_tokens], [None], lora_ranks, scalings, device=self.device, use_graph=True, max_tokens=max_tokens
        )

    def run_lora_a(self, x: torch.Tensor, weights: torch.Tensor, num_slices: int = 1) -> torch.Tensor:
        return sgemm_lora_a_fwd(x, weights, self.batch_info, num_slices)

    def run_lora_b(self, x, weights, slice_offsets, base_output=None) -> torch.Tensor:
        return sgemm_lora_b_fwd(x, weights, self.batch_info, slice_offsets, base_output)

    def run_qkv(self, x, a_weights, b_weights, slice_offsets, base_output=None) -> torch.Tensor:
        _check_num_slices("run_qkv", slice_offsets, 3)
        shrunk = sgemm_lora_a_fwd(x, a_weights, self.batch_info, num_slices=3)
        return sgemm_lora_b_fwd(shrunk, b_weights, self.batch_info, slice_offsets, base_output)

    def run_gate_up(self, x, a_weights, b_weights, slice_offsets, base_output=None) -> torch.Tensor:
        _check_num_slices("run_gate_up", slice_offsets, 2)
        shrunk = sgemm_lora_a_fwd(x, a_weights, self.batch_info, num_slices=2)
        return sgemm_lora_b_fwd(shrunk, b_weights, self.batch_info, slice_offsets, base_output)

    def run_lora_a_embedding(self, ids, weights, vocab_size, extra_embeddings=None) -> torch.Tensor:
        return sgemm_lora_a_embedding_fwd(ids, weights, self.batch_info, vocab_size, extra_embeddings)
