"""lora-layers: module wrappers over lora-kit backends, tensor parallelism, the
``MultiLoRA`` API and the ``lora-sim`` command."""

import os

# An installed torch_npu without its CANN driver stack breaks `import torch` unless device-backend
# autoloading is off; this must run before the first `import torch` (lora-sim's entry point lands here).
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

from .models import TinyConfig, TinyDecoder  # noqa: E402
from .multilora import MultiLoRA  # noqa: E402
from .parallel import TensorParallel  # noqa: E402
from .layers import (  # noqa: E402
    LAYER_TYPES,
    ColumnParallelLinearWithLoRA,
    Conv1DWithLoRA,
    EmbeddingWithLoRA,
    LinearWithLoRA,
    LMHeadWithLoRA,
    LoRAContext,
    MergedColumnParallelLinearWithLoRA,
    QKVParallelLinearWithLoRA,
    RowParallelLinearWithLoRA,
    ExpertsWithLoRA,
    ParallelExpertsWithLoRA,
)

__version__ = "0.1.0"

__all__ = [
    "LAYER_TYPES",
    "ColumnParallelLinearWithLoRA",
    "Conv1DWithLoRA",
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
    "ExpertsWithLoRA",
    "ParallelExpertsWithLoRA",
]
