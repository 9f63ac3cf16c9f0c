"""Packed (fused) projections: which adapter modules a fused module holds, and its slice widths."""

from __future__ import annotations

from typing import Sequence

from torch import nn

__all__ = ["LLAMA_PACKED_MODULES", "infer_slice_widths"]

LLAMA_PACKED_MODULES: dict[str, list[str]] = {
    "qkv_proj": ["q_proj", "k_proj", "v_proj"],
    "gate_up_proj": ["gate_proj", "up_proj"],
}
"""vLLM's fused names for Llama-style models and the PEFT module names they hold."""


def infer_slice_widths(name: str, module: nn.Module, parts: Sequence[str], model: nn.Module) -> list[int]:
    """Output widths of the slices of packed module ``name``, one per name in ``parts``.

    In order: the module's ``output_sizes`` attribute (vLLM's merged linears and
    :class:`lora_layers.TinyDecoder` set it), the model config's attention heads
    for a 3-way qkv (``[heads, kv_heads, kv_heads] * head_dim``), else equal parts.
    """
    sizes = getattr(module, "output_sizes", None)
    if sizes is not None:
        return list(sizes)
    config = getattr(model, "config", None)
    if len(parts) == 3 and config is not None and hasattr(config, "num_attention_heads"):
        heads = config.num_attention_heads
        kv = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return [heads * head_dim, kv * head_dim, kv * head_dim]
    out_features = getattr(module, "out_features", None) or getattr(module, "nf")  # nn.Linear, or a Conv1D
    if out_features % len(parts):
        raise ValueError(
            f"cannot split packed module {name!r} ({out_features} outputs) into {list(parts)}: "
            "pass slice_widths={...} to MultiLoRA"
        )
    return [out_features // len(parts)] * len(parts)
