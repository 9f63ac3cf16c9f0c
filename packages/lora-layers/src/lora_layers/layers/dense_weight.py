"""A base layer's weight as a dense tensor, for what needs its values at load (DoRA's weight norm).

A quantized layer keeps no dense weight: :func:`dense_weight` dequantizes it into a temporary
tensor that the caller drops once it has what it needs (lora-kit never keeps a dense copy
beside a quantized layer). The libraries are recognised as PEFT's ``dequantize_module_weight``
recognises them, by the weight's type, without importing them:

- a plain ``Tensor`` / ``Parameter``: returned as is;
- torchao (a tensor subclass from ``torchao.*``, e.g. ``Int8Tensor``, ``IntxUnpackedToInt8Tensor``):
  ``weight.dequantize()`` (a subclass that does not implement it, such as 0.18's int4
  ``Int4TilePackedTo4dTensor``, is refused);
- bitsandbytes 4-bit (``Params4bit``, NF4 or FP4): ``bitsandbytes.functional.dequantize_4bit``
  (a ``Params4bit`` not quantized yet, before its move to a device, is still dense).
  On a CPU with AVX512-BF16, bitsandbytes repacks a ``Linear4bit`` weight on its first
  eval-mode forward into a layout of its own (``quant_state.packing_format_for_cpu``) with
  bfloat16 block scales; such a weight is first unpacked, on copies, by bitsandbytes' own
  inverse: the values are the repacked layer's up to that inverse's rounding of the block
  scales (bf16; nested statistics are quantized again).

Anything else is refused with :class:`UnsupportedWeight` rather than read as if it were dense.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

__all__ = ["UnsupportedWeight", "dense_weight"]


class UnsupportedWeight(TypeError):
    """A weight whose dense values lora-kit cannot compute (a quantization scheme it does not know)."""


def dense_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (a layer's ``(out, in)`` weight, quantized or not) as a dense floating-point
    tensor of the same logical shape: the weight itself when it is dense, else a new tensor
    dequantized by its library (see the module docstring). ``UnsupportedWeight`` for a weight
    type of no library lora-kit knows."""
    kind = type(weight)
    if kind in (torch.Tensor, nn.Parameter):
        return weight
    if kind.__module__.startswith("torchao."):
        try:
            return weight.dequantize()
        except NotImplementedError:  # torch.Tensor.dequantize, which the subclass's dispatch does not handle
            raise UnsupportedWeight(f"a {kind.__module__}.{kind.__name__} weight, which torchao does not "
                                    "dequantize") from None
    if kind.__name__ == "Params4bit":
        return _dequantize_bnb_4bit(weight) if getattr(weight, "bnb_quantized", True) else weight.data
    raise UnsupportedWeight(f"a {kind.__module__}.{kind.__name__} weight: lora-kit dequantizes dense, torchao and "
                            "bitsandbytes 4-bit (Params4bit) weights")


def _dequantize_bnb_4bit(weight: torch.Tensor) -> torch.Tensor:
    import bitsandbytes.functional as bnb_functional  # the weight is one of its types: it is installed

    data, state = weight.data, weight.quant_state
    if getattr(state, "packing_format_for_cpu", False):  # repacked by an eval-mode CPU forward
        unpack = getattr(bnb_functional, "_convert_weight_packed_for_cpu_inverse", None)
        if unpack is None:
            raise UnsupportedWeight("a bitsandbytes 4-bit weight repacked for the CPU, and this bitsandbytes has no "
                                    "inverse of that packing")
        data, state = unpack(data.clone(), copy.deepcopy(state))  # it rewrites its arguments: copies
    return bnb_functional.dequantize_4bit(data, state)
