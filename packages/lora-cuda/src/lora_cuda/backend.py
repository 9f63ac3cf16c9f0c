"""The ``torch_native`` backend: lora_cuda's ops behind the lora_core interface."""

from __future__ import annotations

from typing import Sequence

import torch

from lora_core import BatchInfo, BatchInfoBackend, BatchPlan

from .control_plan import ControlPlan
from .dora_ops import dora_scale_fwd
from .expert_ops import experts_lora_a_fwd, experts_lora_b_fwd, experts_lora_fwd
from .graph_ops import check_graph_kernel, graph_plan_types
from .ops import sgemm_lora_a_embedding_fwd, sgemm_lora_a_fwd, sgemm_lora_b_fwd

__all__ = ["TorchNativeBackend"]


class TorchNativeBackend(BatchInfoBackend):
    """Pure-PyTorch backend for any device: eager batches run the control-flow ops
    (a host loop over the batch's :class:`~lora_cuda.control_plan.ControlPlan`),
    graph batches (``use_graph=True``) the graph-safe ones.

    Args:
        device: where batches and weights live.
        graph_kernel: graph-safe kernel preference, one of :data:`lora_cuda.GRAPH_KERNELS`.
        strict_token_ids: out-of-vocabulary ids raise instead of getting a zero delta.
    """

    name = "torch_native"

    def __init__(self, device: torch.device | str = "cpu", *, graph_kernel: str = "auto",
                 strict_token_ids: bool = False) -> None:
        super().__init__(device, strict_token_ids=strict_token_ids)
        self.graph_kernel = check_graph_kernel(graph_kernel)

    def plan_types(self, batch_info: BatchInfo) -> Sequence[type[BatchPlan]]:
        if batch_info.use_graph:
            return graph_plan_types(self.graph_kernel, batch_info.device)
        return (ControlPlan,)

    def shrink(self, x, weights, batch_info, num_slices) -> torch.Tensor:
        return sgemm_lora_a_fwd(x, weights, batch_info, num_slices, graph_kernel=self.graph_kernel)

    def expand(self, x, weights, batch_info, slice_offsets, base_output) -> torch.Tensor:
        return sgemm_lora_b_fwd(x, weights, batch_info, slice_offsets, base_output, graph_kernel=self.graph_kernel)

    def pair_shrink(self, x, weights, batch_info, num_slices) -> torch.Tensor:
        return sgemm_lora_a_fwd(x, weights, batch_info, num_slices, graph_kernel=self.graph_kernel, pair_rows=True)

    def pair_expand(self, x, weights, batch_info, slice_offsets, base_output) -> torch.Tensor:
        return sgemm_lora_b_fwd(x, weights, batch_info, slice_offsets, base_output, graph_kernel=self.graph_kernel,
                                pair_rows=True)

    def embedding_shrink(self, ids, weights, batch_info, vocab_size, extra_embeddings) -> torch.Tensor:
        return sgemm_lora_a_embedding_fwd(ids, weights, batch_info, vocab_size, extra_embeddings,
                                          strict_token_ids=self.strict_token_ids)

    def dora_scale(self, output, factors, batch_info, bias) -> torch.Tensor:
        return dora_scale_fwd(output, factors, batch_info, bias)  # one gather for eager and graph batches

    def experts_lora(self, x, expert_ids, a_weights, b_weights, batch_info, base_output) -> torch.Tensor:
        return experts_lora_fwd(x, expert_ids, a_weights, b_weights, batch_info, base_output,
                                graph_kernel=self.graph_kernel)

    def experts_shrink(self, x, expert_ids, a_weights, batch_info) -> torch.Tensor:
        return experts_lora_a_fwd(x, expert_ids, a_weights, batch_info, graph_kernel=self.graph_kernel)

    def experts_expand(self, x, expert_ids, b_weights, batch_info, base_output) -> torch.Tensor:
        return experts_lora_b_fwd(x, expert_ids, b_weights, batch_info, base_output, graph_kernel=self.graph_kernel)
