"""The ``ascend`` backend: the vectorized ops for every batch, eager or captured."""

from __future__ import annotations

from typing import Sequence

import torch

from lora_core import BatchInfo, BatchInfoBackend, BatchPlan
from lora_cuda.dora_ops import dora_scale_fwd
from lora_cuda.expert_ops import experts_lora_a_fwd, experts_lora_b_fwd, experts_lora_fwd
from lora_cuda.graph_ops import check_graph_kernel, graph_plan_types

from .embedding import vectorized_lora_a_embedding_fwd
from .ops import vectorized_lora_a_fwd, vectorized_lora_b_fwd, vectorized_pair_lora_a_fwd, vectorized_pair_lora_b_fwd

__all__ = ["AscendBackend"]


class AscendBackend(BatchInfoBackend):
    """Backend for Ascend NPUs (``device="npu"`` with torch_npu), or any torch device.

    Policy: unlike ``torch_native`` it never loops over segments on the host:
    eager and graph batches alike run the same fixed set of kernels, and every
    batch gets the graph-safe kernels' plans in :meth:`prepare_batch`.

    Args:
        device: where batches and weights live.
        graph_kernel: kernel preference, one of :data:`lora_cuda.GRAPH_KERNELS`.
        strict_token_ids: out-of-vocabulary ids raise instead of getting a zero delta.
    """

    name = "ascend"

    def __init__(self, device: torch.device | str = "cpu", *, graph_kernel: str = "auto",
                 strict_token_ids: bool = False) -> None:
        super().__init__(device, strict_token_ids=strict_token_ids)
        self.graph_kernel = check_graph_kernel(graph_kernel)

    def plan_types(self, batch_info: BatchInfo) -> Sequence[type[BatchPlan]]:
        return graph_plan_types(self.graph_kernel, batch_info.device)

    def shrink(self, x, weights, batch_info, num_slices) -> torch.Tensor:
        return vectorized_lora_a_fwd(x, weights, batch_info, num_slices, graph_kernel=self.graph_kernel)

    def expand(self, x, weights, batch_info, slice_offsets, base_output) -> torch.Tensor:
        return vectorized_lora_b_fwd(x, weights, batch_info, slice_offsets, base_output,
                                     graph_kernel=self.graph_kernel)

    def pair_shrink(self, x, weights, batch_info, num_slices) -> torch.Tensor:
        return vectorized_pair_lora_a_fwd(x, weights, batch_info, num_slices, graph_kernel=self.graph_kernel)

    def pair_expand(self, x, weights, batch_info, slice_offsets, base_output) -> torch.Tensor:
        return vectorized_pair_lora_b_fwd(x, weights, batch_info, slice_offsets, base_output,
                                          graph_kernel=self.graph_kernel)

    def embedding_shrink(self, ids, weights, batch_info, vocab_size, extra_embeddings) -> torch.Tensor:
        return vectorized_lora_a_embedding_fwd(ids, weights, batch_info, vocab_size, extra_embeddings,
                                               strict_token_ids=self.strict_token_ids)

    def dora_scale(self, output, factors, batch_info, bias) -> torch.Tensor:
        return dora_scale_fwd(output, factors, batch_info, bias)  # graph-safe: a fixed set of launches

    def experts_lora(self, x, expert_ids, a_weights, b_weights, batch_info, base_output) -> torch.Tensor:
        # graph-safe for every batch: a fixed set of launches whatever the router picks
        return experts_lora_fwd(x, expert_ids, a_weights, b_weights, batch_info, base_output, graph_safe=True,
                                graph_kernel=self.graph_kernel)

    def experts_shrink(self, x, expert_ids, a_weights, batch_info) -> torch.Tensor:
        return experts_lora_a_fwd(x, expert_ids, a_weights, batch_info, graph_safe=True,
                                  graph_kernel=self.graph_kernel)

    def experts_expand(self, x, expert_ids, b_weights, batch_info, base_output) -> torch.Tensor:
        return experts_lora_b_fwd(x, expert_ids, b_weights, batch_info, base_output, graph_safe=True,
                                  graph_kernel=self.graph_kernel)
