"""``Conv1DWithLoRA``: transformers' ``Conv1D`` (GPT-2 style), a linear layer whose weight is stored ``(in, out)``.

transformers is optional: the module is recognised without importing it
(:func:`is_conv1d`). The adapter's factors have the usual shapes, ``A (r, in)``
and ``B (out, r)``, as PEFT saves them for such a layer (its ``fan_in_fan_out``
only transposes the delta when merging it into the weight); unmerged, the delta
is the one of a ``nn.Linear``, so everything but the base layer's shape is
:class:`~lora_layers.layers.linear.LinearWithLoRA`'s.
"""

from __future__ import annotations

import sys
from typing import Sequence

import torch
from torch import nn

from .context import LoRAContext, WrapTarget
from .linear import LinearWithLoRA

__all__ = ["Conv1DWithLoRA", "is_conv1d"]


def is_conv1d(module: nn.Module) -> bool:
    """A transformers ``Conv1D``: an instance of ``transformers.pytorch_utils.Conv1D`` when
    transformers is imported (a model built from it imported it), or, duck-typed, a
    module of that class name with ``nf`` outputs and a 2-D ``(in, nf)`` weight."""
    utils = sys.modules.get("transformers.pytorch_utils")
    cls = getattr(utils, "Conv1D", None)
    if cls is not None and isinstance(module, cls):
        return True
    weight = getattr(module, "weight", None)
    return (type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor) and weight.dim() == 2
            and getattr(module, "nf", None) == weight.shape[1])


class Conv1DWithLoRA(LinearWithLoRA):
    """A replicated transformers ``Conv1D`` (``y = x @ W + b`` with ``W (in, out)``) with LoRA.

    PEFT trains GPT-2's fused ``c_attn`` as one module (one ``lora_B`` of
    ``3 * hidden`` rows): one slice, unless ``slice_widths`` make it a packed
    projection as for :class:`LinearWithLoRA`. ``forward``: ``x (..., in)`` -> ``(..., out)``.
    """

    def __init__(self, base_layer: nn.Module, context: LoRAContext, slice_widths: Sequence[int] | None = None) -> None:
        super().__init__(base_layer, context, slice_widths)

    @classmethod
    def _features(cls, base_layer: nn.Module) -> tuple[int, int]:
        if not is_conv1d(base_layer):
            raise TypeError(f"{cls.__name__} wraps a transformers Conv1D, got {type(base_layer).__name__}")
        fan_in, fan_out = base_layer.weight.shape
        return int(fan_in), int(fan_out)

    def _base_weight(self) -> torch.Tensor:
        return self.base_layer.weight.T  # stored (in, out): PEFT's fan_in_fan_out transpose

    @classmethod
    def can_wrap(cls, module: nn.Module, target: WrapTarget) -> bool:
        return is_conv1d(module) and not target.lm_head

    @classmethod
    def wrap(cls, module: nn.Module, context: LoRAContext, target: WrapTarget) -> Conv1DWithLoRA:
        return cls(module, context, target.slice_widths)
