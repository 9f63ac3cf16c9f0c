"""Which wrapper a module gets: an ordered list of layer kinds, first match wins.

Each layer class answers ``can_wrap(module, target)`` and builds itself with
``wrap(module, context, target)`` (PEFT's ``dispatch_default`` pattern). A new
layer kind (another module type) is one more class in :data:`LAYER_TYPES`, placed
before any more general kind it specialises.
"""

from __future__ import annotations

from torch import nn

from .context import LoRAContext, WrapTarget
from .conv1d import Conv1DWithLoRA
from .embedding import EmbeddingWithLoRA
from .linear import LinearWithLoRA
from .lm_head import LMHeadWithLoRA

__all__ = ["LAYER_TYPES", "wrap_module"]

LAYER_TYPES: list[type[nn.Module]] = [EmbeddingWithLoRA, LMHeadWithLoRA, Conv1DWithLoRA, LinearWithLoRA]
"""Layer kinds in dispatch order."""


def wrap_module(module: nn.Module, context: LoRAContext, target: WrapTarget) -> nn.Module:
    """The first layer kind of :data:`LAYER_TYPES` that can wrap ``module``, built around it."""
    for layer_type in LAYER_TYPES:
        if layer_type.can_wrap(module, target):
            return layer_type.wrap(module, context, target)
    kinds = ", ".join(t.__name__ for t in LAYER_TYPES)
    raise TypeError(f"cannot wrap {target.name!r}: no layer kind ({kinds}) accepts a {type(module).__name__}")
