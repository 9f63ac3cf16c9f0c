"""Which modules ``lora-sim`` wraps, written once: the target list, the packed map,
and the :class:`~lora_layers.MultiLoRA` built over them."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from torch import nn

from lora_core import PeftAdapter, load_peft_adapter

from ..models import TinyConfig
from ..multilora import MultiLoRA
from ..packing import LLAMA_PACKED_MODULES
from ..targeting import name_parameter_targets

__all__ = ["ATTENTION", "MAX_RANK", "MLP", "PROJECTIONS", "WHOLE_MODEL", "AdapterSources", "build_multilora",
           "load_adapters", "module_path", "packed_modules", "packed_module_of", "saved_modules", "target_modules",
           "unmixable"]

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
PROJECTIONS = ATTENTION + MLP
"""The per-layer projections, by their PEFT (unfused) names."""
WHOLE_MODEL = ("embed_tokens", "lm_head")
"""Modules outside the layers that adapters may target too."""
MAX_RANK = 64
"""The largest rank of the synthetic adapters (given adapters are served at their own largest rank)."""


AdapterSources = Mapping[str, "str | Path | PeftAdapter"]
"""Adapters by name: PEFT adapter directories, or adapters already read from one."""


def load_adapters(adapters: AdapterSources) -> dict[str, PeftAdapter]:
    """Each adapter read once: a directory is loaded (its warnings, such as ignored base-model
    weights, shown then), an adapter already read is kept as it is. lora-sim reads every
    adapter once per run and hands the result to each step that needs it."""
    return {name: a if isinstance(a, PeftAdapter) else load_peft_adapter(a) for name, a in adapters.items()}


def packed_module_of(projection: str) -> str | None:
    """The fused module holding PEFT module ``projection`` (``"q_proj"`` -> ``"qkv_proj"``), or ``None``."""
    return next((packed for packed, parts in LLAMA_PACKED_MODULES.items() if projection in parts), None)


def module_path(layer: int, projection: str) -> str:
    """The full name of a layer's projection, e.g. ``model.layers.0.self_attn.q_proj``."""
    block = "self_attn" if projection in ATTENTION or projection == "qkv_proj" else "mlp"
    return f"model.layers.{layer}.{block}.{projection}"


def target_modules(config: TinyConfig) -> list[str]:
    """The modules to wrap in a model of ``config``: every projection (its fused
    module where ``config.fused``; in a mixture-of-experts model the fused experts
    instead of the MLP projections), the embedding and the LM head."""
    names: list[str] = ["experts"] if config.num_experts else []
    for projection in ATTENTION if config.num_experts else PROJECTIONS:
        name = (packed_module_of(projection) or projection) if config.fused else projection
        if name not in names:
            names.append(name)
    return names + list(WHOLE_MODEL)


def packed_modules(config: TinyConfig) -> dict[str, list[str]] | None:
    """The packed-module map for a model of ``config``: Llama's where fused, else none."""
    return {k: list(v) for k, v in LLAMA_PACKED_MODULES.items()} if config.fused else None


def saved_modules(adapters: AdapterSources) -> dict[str, int]:
    """The modules the adapters train whole (PEFT's ``modules_to_save``) -> the parameters
    of one copy (weight and bias): what each adapter slot holds of that module."""
    saved: dict[str, int] = {}
    for adapter in load_adapters(adapters).values():
        for name, w in adapter.saved_modules.items():
            saved[name] = max(saved.get(name, 0), w.weight.numel() + (0 if w.bias is None else w.bias.numel()))
    return saved


def unmixable(adapters: AdapterSources) -> list[str]:
    """The adapters that cannot be in a weighted mix of two or more, as :class:`~lora_layers.MultiLoRA`
    refuses them: DoRA adapters (their norm is not linear in the delta) and adapters that train
    modules whole (``modules_to_save``, which a mix cannot sum)."""
    return [name for name, a in load_adapters(adapters).items() if a.use_dora or a.saved_modules]


def build_multilora(model: nn.Module, config: TinyConfig, adapters: AdapterSources,
                    backend: str | None = None) -> MultiLoRA:
    """Wrap :func:`target_modules` of ``model`` (in place) and load every adapter.

    A module an adapter trains whole (``modules_to_save``, e.g. ``lm_head``) is
    wrapped as a saved module (a copy per slot) instead of for LoRA.

    The buffers' rank is the largest of the adapters (:data:`MAX_RANK` without
    adapters). ``backend`` is a registered backend name
    (``lora_core.available_backends()``); ``None`` takes
    :class:`~lora_layers.MultiLoRA`'s default. Raises ``ValueError`` when an
    adapter does not fit the model.
    """
    kwargs = {} if backend is None else {"backend": backend}
    modules = dict(model.named_modules())
    loaded = load_adapters(adapters)
    max_rank = max((name_parameter_targets(name, adapter, modules).rank for name, adapter in loaded.items()),
                   default=MAX_RANK)
    saved = sorted(saved_modules(loaded))
    targets = [t for t in target_modules(config) if not any(s == t or s.endswith(f".{t}") for s in saved)]
    mlora = MultiLoRA(model, targets, max_loras=max(1, len(loaded)), max_rank=max_rank,
                      packed_modules=packed_modules(config), modules_to_save=saved, **kwargs)
    for name, adapter in loaded.items():
        mlora.load_adapter(name, adapter)
    return mlora
