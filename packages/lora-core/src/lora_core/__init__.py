"""lora-core: batch info, buffer layout, reference math and the backend interface
for serving many LoRA adapters in one batch (see SPEC §3-§4)."""

from .adapters import (
    AdapterFormatError,
    LoRAModuleWeights,
    PeftAdapter,
    load_peft_adapter,
    peft_scaling,
    save_peft_adapter,
)
from .backend import BatchInfoBackend, LoRABackend, available_backends, get_backend
from .batch_info import BatchInfo, TokenGroup, build_batch_info
from .graphs import is_capturing
from .layout import AdapterSlots, EmbeddingLoRABuffers, LinearLoRABuffers, slice_offsets_from_widths
from .validation import strict_token_ids

__all__ = [
    "AdapterFormatError",
    "AdapterSlots",
    "BatchInfo",
    "BatchInfoBackend",
    "EmbeddingLoRABuffers",
    "LinearLoRABuffers",
    "LoRABackend",
    "LoRAModuleWeights",
    "PeftAdapter",
    "TokenGroup",
    "available_backends",
    "build_batch_info",
    "get_backend",
    "is_capturing",
    "load_peft_adapter",
    "peft_scaling",
    "save_peft_adapter",
    "slice_offsets_from_widths",
    "strict_token_ids",
]
