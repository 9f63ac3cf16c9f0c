"""Synthetic PEFT adapters for ``lora-sim``'s default run."""

from __future__ import annotations

from pathlib import Path

import torch

from lora_core import save_peft_adapter

from ..models import TinyConfig
from .serving import MLP, PROJECTIONS, module_path

__all__ = ["SYNTHETIC_ADAPTERS", "make_synthetic_adapters"]

SYNTHETIC_ADAPTERS: dict[str, tuple[int, int, bool, tuple[str, ...]]] = {
    "r8": (8, 16, False, ("q_proj", "v_proj")),
    "r16": (16, 16, False, ("q_proj", "k_proj", "v_proj", "o_proj")),
    "r32-rslora": (32, 8, True, PROJECTIONS),
    "r64-embed-head": (64, 32, False, ("q_proj", "v_proj", "down_proj", "embed_tokens", "lm_head")),
}
"""name -> (rank, lora_alpha, use_rslora, target modules by their PEFT names)."""


def _projection_shapes(config: TinyConfig) -> dict[str, tuple[int, int]]:
    """(fan_in, fan_out) of each per-layer projection of a model of ``config``."""
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    h, i = config.hidden_size, config.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def _expert_parameters(config: TinyConfig, targets: tuple[str, ...], r: int, gen: torch.Generator) -> list:
    """A mixture-of-experts model's stand-ins for the MLP targets: ``gate_proj`` / ``up_proj`` ->
    the experts' ``gate_up_proj``, ``down_proj`` -> their ``down_proj`` (``target_parameters``)."""
    E, h, i = config.num_experts, config.hidden_size, config.intermediate_size
    params = []
    if {"gate_proj", "up_proj"} & set(targets):
        params.append(("gate_up_proj", torch.randn(E, r, h, generator=gen) / h**0.5,
                       torch.randn(E, 2 * i, r, generator=gen) / r**0.5 * 0.5))
    if "down_proj" in targets:
        params.append(("down_proj", torch.randn(E, r, i, generator=gen) / i**0.5,
                       torch.randn(E, h, r, generator=gen) / r**0.5 * 0.5))
    return params


def make_synthetic_adapters(config: TinyConfig, directory: Path) -> dict[str, Path]:
    """Save the four :data:`SYNTHETIC_ADAPTERS` for a model of ``config`` under
    ``directory`` in PEFT's format (ranks 8/16/32/64, one rsLoRA, one also on the
    embedding and the LM head); returns name -> adapter directory. In a
    mixture-of-experts model (``config.num_experts``) the MLP targets are the experts'
    parameters (``target_parameters``, docs/moe.md).

    Seeded: the same weights every run. The LoRA B factors are non-zero (unlike a
    freshly initialised PEFT adapter), so every adapter changes the logits.
    """
    gen = torch.Generator().manual_seed(1234)
    shapes = _projection_shapes(config)
    if config.num_experts:
        shapes = {t: shape for t, shape in shapes.items() if t not in MLP}
    paths = {}
    for name, (r, alpha, rslora, targets) in SYNTHETIC_ADAPTERS.items():
        modules, embedding, parameters = {}, [], {}
        for layer in range(config.num_hidden_layers):
            for t in targets:
                if t in shapes:
                    fan_in, fan_out = shapes[t]
                    modules[module_path(layer, t)] = (torch.randn(r, fan_in, generator=gen) / fan_in**0.5,
                                                      torch.randn(fan_out, r, generator=gen) / r**0.5 * 0.5)
            experts = _expert_parameters(config, targets, r, gen) if config.num_experts else []
            if experts:
                parameters[f"model.layers.{layer}.mlp.experts"] = experts
        if "embed_tokens" in targets:
            modules["model.embed_tokens"] = (torch.randn(r, config.vocab_size, generator=gen) * 0.1,
                                             torch.randn(config.hidden_size, r, generator=gen) / r**0.5)
            embedding.append("model.embed_tokens")
        if "lm_head" in targets:
            modules["lm_head"] = (torch.randn(r, config.hidden_size, generator=gen) / config.hidden_size**0.5,
                                  torch.randn(config.vocab_size, r, generator=gen) / r**0.5 * 0.5)
        paths[name] = save_peft_adapter(directory / name, modules, r=r, lora_alpha=alpha, use_rslora=rslora,
                                        embedding_modules=tuple(embedding), parameters=parameters)
    return paths
