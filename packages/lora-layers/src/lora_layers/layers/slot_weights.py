"""What a layer kind's ``load_slot`` receives: one adapter's weights for one wrapped module.

``MultiLoRA`` reads a PEFT adapter (:class:`lora_core.adapters.LoRAModuleWeights`
per PEFT module), finds the wrapped module each PEFT module lives in, and hands
each wrapper its part as :data:`ModuleParts`: slice index -> weights, where a
packed projection (qkv, gate_up) gets one entry per slice the adapter trained
(``q_proj`` -> 0, ``k_proj`` -> 1, ...) and a module trained as a whole (a plain
layer, or a packed one the adapter trained fused) gets the single key
:data:`WHOLE_MODULE`. The wrapper checks the kind and shapes and writes its own
buffers.
"""

from __future__ import annotations

from typing import Mapping

import torch

from lora_core.adapters import LoRAModuleWeights, SavedModuleWeights

__all__ = ["WHOLE_MODULE", "ModuleParts", "folded_b", "check_dora_parts"]

WHOLE_MODULE = -1
"""The key of :data:`ModuleParts` for weights that cover the whole module (every slice)."""

ModuleParts = Mapping[int, LoRAModuleWeights | SavedModuleWeights]
"""Slice index (or :data:`WHOLE_MODULE`) -> that part's LoRA pair, unsharded; a saved
module (``modules_to_save``) gets ``{WHOLE_MODULE: SavedModuleWeights}``."""


def folded_b(weights: LoRAModuleWeights, slot_scaling: float) -> torch.Tensor:
    """``weights.lora_b`` ``(out, r)`` with the module's own scaling relative to the slot's folded in.

    The slot applies ``slot_scaling`` (the adapter's ``lora_alpha / r``) to every
    module; a module with its own ``alpha_pattern`` / ``rank_pattern`` scaling
    gets ``lora_b * (scaling / slot_scaling)``, so the product is its scaling.
    """
    if weights.scaling == slot_scaling:
        return weights.lora_b
    return weights.lora_b * (weights.scaling / slot_scaling)


def check_dora_parts(parts: ModuleParts, dora_factors: torch.Tensor | None, tp_size: int) -> bool:
    """Whether ``parts`` carry DoRA magnitudes (PEFT's ``use_dora``); ``ValueError`` when the layer
    cannot serve them: built without DoRA factors, or tensor-parallel (DoRA's norm is over the
    full weight's rows, which no shard holds)."""
    if all(w.magnitude is None for w in parts.values()):
        return False
    if dora_factors is None:
        raise ValueError("a DoRA adapter (use_dora) needs the layers built with DoRA factors: "
                         "MultiLoRA(..., dora=True) (from_adapters sets it when an adapter uses DoRA)")
    if tp_size > 1:
        raise ValueError(f"DoRA is not supported with tensor parallelism (tp_size = {tp_size}): its norm is "
                         "over the full weight's rows")
    return True
