"""lora-cuda: torch-native multi-LoRA ops (control-flow and graph-safe) and the
``torch_native`` backend. Runs on any torch device; tuned for CUDA."""

from .backend import TorchNativeBackend
from .control_ops import (
    sgemm_lora_a_control_fwd,
    sgemm_lora_a_embedding_control_fwd,
    sgemm_lora_b_control_fwd,
)
from .graph_ops import (
    graph_kernel,
    use_graph_kernel,
    sgemm_lora_a_embedding_graph_fwd,
    sgemm_lora_a_graph_fwd,
    sgemm_lora_b_graph_fwd,
)
from .ops import sgemm_lora_a_embedding_fwd, sgemm_lora_a_fwd, sgemm_lora_b_fwd

__all__ = [
    "TorchNativeBackend",
    "graph_kernel",
    "use_graph_kernel",
    "sgemm_lora_a_control_fwd",
    "sgemm_lora_a_embedding_control_fwd",
    "sgemm_lora_a_embedding_fwd",
    "sgemm_lora_a_embedding_graph_fwd",
    "sgemm_lora_a_fwd",
    "sgemm_lora_a_graph_fwd",
    "sgemm_lora_b_control_fwd",
    "sgemm_lora_b_fwd",
    "sgemm_lora_b_graph_fwd",
]
