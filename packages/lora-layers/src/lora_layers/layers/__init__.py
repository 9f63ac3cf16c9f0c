"""Module wrappers that add a multi-LoRA delta to a base layer through a backend.

One module per layer kind. Each wrapper keeps its base module (``base_layer``),
owns its stacked LoRA buffers (docs/layout.md), loads an adapter's weights into
a slot of them itself (``load_slot``; ``reset_lora`` zeroes one) and, in
``forward``, flattens the leading dims to ``(T, features)``, runs the base layer
and lets the backend accumulate the LoRA delta into the base output in place.
Adapter weights are given unsharded; tensor-parallel wrappers take their shard.
:func:`wrap_module` picks the kind from the ordered :data:`LAYER_TYPES`.

| wrapper | base (local shard) | LoRA A | LoRA B | backend calls | communication |
|---|---|---|---|---|---|
| LinearWithLoRA | full | full | full | lora_a, lora_b (qkv, gate_up) | none |
| Conv1DWithLoRA (transformers Conv1D, weight (in, out)) | full | full | full | lora_a, lora_b | none |
| ColumnParallelLinearWithLoRA | out rows | full | out rows | lora_a, lora_b | optional all-gather |
| MergedColumnParallelLinearWithLoRA | gate, up rows | full | rows of each | gate_up | optional all-gather |
| QKVParallelLinearWithLoRA | q, k, v heads | full | rows of each | qkv | optional all-gather |
| RowParallelLinearWithLoRA | in columns | in columns | full | lora_a, lora_b | all-reduce x2 |
| EmbeddingWithLoRA | vocab rows | vocab columns | full | added_tokens, lora_a_embedding, lora_b | all-reduce x2 |
| LMHeadWithLoRA | vocab rows | full | vocab rows | lm_head | all-gather |
| ExpertsWithLoRA (fused experts, per-expert A/B) | full | full | full | experts_lora x2 | none |
| ParallelExpertsWithLoRA | gate/up rows, down columns of the intermediate dim | gate_up full, down columns | gate_up rows, down full | experts_lora x2 | all-reduce of the output |
| SavedModule (modules_to_save: a copy per slot) | full | - | - | none | none |
"""

from .column_parallel import (
    ColumnParallelLinearWithLoRA,
    MergedColumnParallelLinearWithLoRA,
    QKVParallelLinearWithLoRA,
)
from .context import LoRAContext, WrapTarget, flatten_tokens, inference_forward
from .conv1d import Conv1DWithLoRA, is_conv1d
from .dispatch import LAYER_TYPES, LayerKind, parameter_layer_kind, wrap_module
from .embedding import EmbeddingWithLoRA
from .experts import ExpertsLayout, ExpertsWithLoRA
from .linear import LinearWithLoRA, SliceWeights
from .lm_head import LMHeadWithLoRA
from .parallel_experts import ParallelExpertsWithLoRA
from .row_parallel import RowParallelLinearWithLoRA
from .saved_module import SavedModule
from .slot_weights import WHOLE_MODULE, ModuleParts, folded_b

__all__ = [
    "LAYER_TYPES",
    "ColumnParallelLinearWithLoRA",
    "Conv1DWithLoRA",
    "EmbeddingWithLoRA",
    "ExpertsLayout",
    "ExpertsWithLoRA",
    "LMHeadWithLoRA",
    "LayerKind",
    "LinearWithLoRA",
    "LoRAContext",
    "MergedColumnParallelLinearWithLoRA",
    "ModuleParts",
    "ParallelExpertsWithLoRA",
    "QKVParallelLinearWithLoRA",
    "RowParallelLinearWithLoRA",
    "SavedModule",
    "SliceWeights",
    "WHOLE_MODULE",
    "WrapTarget",
    "flatten_tokens",
    "folded_b",
    "inference_forward",
    "is_conv1d",
    "parameter_layer_kind",
    "wrap_module",
]
