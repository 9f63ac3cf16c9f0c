"""Which wrapper a module gets: an ordered list of layer kinds, first match wins.

Each layer class answers ``can_wrap(module, target)`` and builds itself with
``wrap(module, context, target)`` (PEFT's ``dispatch_default`` pattern), then
loads and clears its own slots' weights (:class:`LayerKind`). A new layer kind
(another module type) is one module with one such class plus its entry in
:data:`LAYER_TYPES`, placed before any more general kind it specialises; nothing
in ``MultiLoRA`` names layer kinds.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from .context import LoRAContext, WrapTarget
from .conv1d import Conv1DWithLoRA
from .embedding import EmbeddingWithLoRA
from .experts import ExpertsWithLoRA
from .linear import LinearWithLoRA
from .lm_head import LMHeadWithLoRA
from .saved_module import SavedModule
from .slot_weights import ModuleParts

__all__ = ["LAYER_TYPES", "LayerKind", "wrap_module", "parameter_layer_kind"]


class LayerKind(Protocol):
    """What a wrapper class in :data:`LAYER_TYPES` provides (an ``nn.Module`` around ``base_layer``).

    PEFT's split, kept: the dispatcher picks the kind, the kind owns its buffers.
    """

    base_layer: nn.Module

    @classmethod
    def can_wrap(cls, module: nn.Module, target: WrapTarget) -> bool:
        """Whether this kind wraps ``module`` (of the model, as ``target`` describes it)."""
        ...

    @classmethod
    def wrap(cls, module: nn.Module, context: LoRAContext, target: WrapTarget) -> LayerKind:
        """The wrapper around ``module``, with zeroed LoRA buffers of ``context``'s slots and rank."""
        ...

    def load_slot(self, slot: int, parts: ModuleParts, slot_scaling: float) -> None:
        """Write one adapter's weights for this module into ``slot`` (``ValueError`` if they do not fit)."""
        ...

    def reset_lora(self, slot: int) -> None:
        """Zero ``slot``'s weights."""
        ...

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        """The base layer's output plus each token's adapter delta, shaped as the base layer's."""
        ...


LAYER_TYPES: list[type[nn.Module]] = [SavedModule, EmbeddingWithLoRA, LMHeadWithLoRA, Conv1DWithLoRA, LinearWithLoRA,
                                      ExpertsWithLoRA]
"""Layer kinds in dispatch order."""


def wrap_module(module: nn.Module, context: LoRAContext, target: WrapTarget) -> nn.Module:
    """The first layer kind of :data:`LAYER_TYPES` that can wrap ``module``, built around it."""
    for layer_type in LAYER_TYPES:
        if layer_type.can_wrap(module, target):
            return layer_type.wrap(module, context, target)
    kinds = ", ".join(t.__name__ for t in LAYER_TYPES)
    raise TypeError(f"cannot wrap {target.name!r}: no layer kind ({kinds}) accepts a {type(module).__name__}")


def parameter_layer_kind(module: nn.Module, parameter: str, target: WrapTarget) -> type[nn.Module] | None:
    """The layer kind that wraps ``module`` and takes adapters on its ``parameter``
    (PEFT's ``target_parameters``; a kind lists them in ``parameters_with_lora``), or ``None``."""
    for layer_type in LAYER_TYPES:
        if layer_type.can_wrap(module, target):
            return layer_type if parameter in getattr(layer_type, "parameters_with_lora", ()) else None
    return None
