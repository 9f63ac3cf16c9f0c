"""lora-cuda: torch-native multi-LoRA ops (control-flow and graph-safe) and the
``torch_native`` backend. Runs on any torch device; tuned for CUDA."""

from .backend import TorchNativeBackend
from .control_ops import (
    sgemm_lora_a_control_fwd,
    sgemm_lora_a_embedding_control_fwd,
    sgemm_lora_b_control_fwd,
)
from .control_plan import ControlPlan, SlotBlocks, TokenGroup
from .expert_ops import experts_lora_a_fwd, experts_lora_b_fwd, experts_lora_fwd
from .graph_ops import (
    GRAPH_KERNELS,
    graph_kernel,
    graph_plan_types,
    sgemm_lora_a_embedding_graph_fwd,
    sgemm_lora_a_graph_fwd,
    sgemm_lora_b_graph_fwd,
)
from .graph_plans import BlockPlan, SortedPlan
from .ops import sgemm_lora_a_embedding_fwd, sgemm_lora_a_fwd, sgemm_lora_b_fwd

__all__ = [
    "GRAPH_KERNELS",
    "BlockPlan",
    "ControlPlan",
    "SlotBlocks",
    "SortedPlan",
    "TokenGroup",
    "TorchNativeBackend",
    "experts_lora_fwd",
    "experts_lora_a_fwd",
    "experts_lora_b_fwd",
    "graph_kernel",
    "graph_plan_types",
    "sgemm_lora_a_control_fwd",
    "sgemm_lora_a_embedding_control_fwd",
    "sgemm_lora_a_embedding_fwd",
    "sgemm_lora_a_embedding_graph_fwd",
    "sgemm_lora_a_fwd",
    "sgemm_lora_b_control_fwd",
    "sgemm_lora_b_fwd",
    "sgemm_lora_b_graph_fwd",
]


def __getattr__(name: str):
    if name == "use_graph_kernel":
        raise AttributeError(
            "lora_cuda.use_graph_kernel() was a process-wide switch and has been removed: pass "
            "graph_kernel='grouped' or 'blocked' to TorchNativeBackend / AscendBackend, or to the ops"
        )
    raise AttributeError(f"module 'lora_cuda' has no attribute {name!r}")
