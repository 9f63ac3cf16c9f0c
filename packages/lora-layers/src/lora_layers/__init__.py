"""lora-layers: module wrappers over lora-kit backends, tensor parallelism, the
``MultiLoRA`` API and the ``lora-sim`` command."""

from .models import TinyConfig, TinyDecoder
from .multilora import MultiLoRA
from .parallel import TensorParallel
from .layers import (
    ColumnParallelLinearWithLoRA,
    EmbeddingWithLoRA,
    LinearWithLoRA,
    LMHeadWithLoRA,
    LoRAContext,
    MergedColumnParallelLinearWithLoRA,
    QKVParallelLinearWithLoRA,
    RowParallelLinearWithLoRA,
)

__version__ = "0.1.0"

__all__ = [
    "ColumnParallelLinearWithLoRA",
    "EmbeddingWithLoRA",
    "LMHeadWithLoRA",
    "LinearWithLoRA",
    "LoRAContext",
    "MergedColumnParallelLinearWithLoRA",
    "MultiLoRA",
    "QKVParallelLinearWithLoRA",
    "RowParallelLinearWithLoRA",
    "TensorParallel",
    "TinyConfig",
    "TinyDecoder",
]
