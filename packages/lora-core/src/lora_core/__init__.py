"""lora-core: batch info, buffer layout, reference math and the backend interface
for serving many LoRA adapters in one batch (docs/architecture.md, docs/layout.md)."""

from .adapters import (
    AdapterFormatError,
    LoRAModuleWeights,
    PeftAdapter,
    SavedModuleWeights,
    load_peft_adapter,
    peft_scaling,
)
from .adapter_writer import save_peft_adapter
from .backend import LoRABackend
from .batch_info_backend import BatchInfoBackend
from .backend_registry import available_backends, get_backend
from .batch_builder import build_batch_info
from .batch_info import BatchInfo
from .graphs import is_capturing
from .layout import AdapterSlots, EmbeddingLoRABuffers, LinearLoRABuffers, slice_offsets_from_widths
from .plans import BatchPlan

__all__ = [
    "AdapterFormatError",
    "AdapterSlots",
    "BatchInfo",
    "BatchInfoBackend",
    "BatchPlan",
    "EmbeddingLoRABuffers",
    "LinearLoRABuffers",
    "LoRABackend",
    "LoRAModuleWeights",
    "PeftAdapter",
    "SavedModuleWeights",
    "available_backends",
    "build_batch_info",
    "get_backend",
    "is_capturing",
    "load_peft_adapter",
    "peft_scaling",
    "save_peft_adapter",
    "slice_offsets_from_widths",
]


def __getattr__(name: str):
    if name == "strict_token_ids":
        raise AttributeError(
            "lora_core.strict_token_ids() was a process-wide switch and has been removed: pass "
            "strict_token_ids=True to the backend (get_backend(name)(device, strict_token_ids=True)), "
            "to MultiLoRA, or to the embedding op"
        )
    raise AttributeError(f"module 'lora_core' has no attribute {name!r}")
