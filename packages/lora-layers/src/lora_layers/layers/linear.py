"""``LinearWithLoRA``: a replicated ``nn.Linear`` (plain, or packed: qkv, gate_up, any parts)."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from lora_core import LinearLoRABuffers, slice_offsets_from_widths

from ..parallel import TensorParallel
from .context import LoRAContext, WrapTarget, flatten_tokens, inference_forward
from .slot_weights import WHOLE_MODULE, ModuleParts, folded_b

__all__ = ["LinearWithLoRA", "SliceWeights"]

SliceWeights = tuple[torch.Tensor, torch.Tensor]
"""One slice's ``(A (r, in), B (out, r))``, unsharded, with any per-module scaling ratio folded into B."""


class LinearWithLoRA(nn.Module):
    """A replicated ``nn.Linear`` with LoRA; with several ``slice_widths`` it is a packed
    projection (gate_up, qkv, or any number of parts) whose adapters come per slice.

    ``forward``: ``x (..., in)`` -> ``base(x) + delta`` of shape ``(..., out)``; the
    flattened token count must match the backend's batch.
    """

    def __init__(self, base_layer: nn.Linear, context: LoRAContext, slice_widths: Sequence[int] | None = None,
                 tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = self._features(base_layer)
        self.base_layer = base_layer
        self.context = context
        self.tp = tp or TensorParallel()
        local = list(slice_widths) if slice_widths is not None else [self.out_features]
        if sum(local) != self.out_features:
            raise ValueError(
                f"slice_widths {local} sum to {sum(local)}, but the base layer has {self.out_features} outputs"
            )
        self.buffers = LinearLoRABuffers(num_slots=context.num_slots, max_rank=context.max_rank,
                                         in_features=self.in_features, slice_widths=local,
                                         dtype=context.dtype, device=context.device)

    @classmethod
    def _features(cls, base_layer: nn.Module) -> tuple[int, int]:
        """``(in_features, out_features)`` of the (local) base layer; ``TypeError`` for a module of another kind."""
        if not isinstance(base_layer, nn.Linear):
            raise TypeError(f"{cls.__name__} wraps an nn.Linear, got {type(base_layer).__name__}")
        return base_layer.in_features, base_layer.out_features

    # -- dispatch (lora_layers.layers.dispatch)
    @classmethod
    def can_wrap(cls, module: nn.Module, target: WrapTarget) -> bool:
        return isinstance(module, nn.Linear) and not target.lm_head

    @classmethod
    def wrap(cls, module: nn.Module, context: LoRAContext, target: WrapTarget) -> LinearWithLoRA:
        return cls(module, context, target.slice_widths)

    @property
    def num_slices(self) -> int:
        return self.buffers.num_slices

    @property
    def unsharded_slice_widths(self) -> tuple[int, ...]:
        """Output widths of the slices of the unsharded layer, which adapter weights are given for."""
        return self.buffers.slice_widths

    # Tensor-parallel subclasses override these to take their shard of full weights.
    def _shard_a(self, a: torch.Tensor) -> torch.Tensor:
        return a

    def _shard_b(self, slice_index: int, b: torch.Tensor) -> torch.Tensor:
        return b

    def set_lora(self, slot: int, slices: Sequence[SliceWeights | None]) -> None:
        """Load one adapter: per slice ``(A (r, in), B (out_i, r))`` of the unsharded layer, or ``None``."""
        if len(slices) != self.num_slices:
            raise ValueError(f"{type(self).__name__} has {self.num_slices} slice(s), got weights for {len(slices)}")
        a = [None if s is None else self._shard_a(s[0]) for s in slices]
        b = [None if s is None else self._shard_b(i, s[1]) for i, s in enumerate(slices)]
        self.buffers.load(slot, a, b)

    def load_slot(self, slot: int, parts: ModuleParts, slot_scaling: float) -> None:
        """Load one adapter's ``lora_A`` / ``lora_B`` weights for this layer into ``slot``.

        ``parts``: slice index -> weights (``A (r, in)``, ``B (out_i, r)``; slices
        the adapter does not train get no delta), or :data:`WHOLE_MODULE` -> one pair
        for the whole layer (``B (out, r)``, split by slice here: a packed projection
        the adapter trained fused). Weights are unsharded; each module's scaling
        relative to ``slot_scaling`` is folded into B. ``ValueError`` when the
        weights are not a linear layer's or do not fit.
        """
        if any(w.kind != "linear" for w in parts.values()):
            raise ValueError("expected lora_A/lora_B weights for a linear layer")
        if WHOLE_MODULE in parts:
            w = parts[WHOLE_MODULE]
            b, offsets = folded_b(w, slot_scaling), slice_offsets_from_widths(self.unsharded_slice_widths)
            if b.shape[0] != offsets[-1]:
                raise ValueError(f"lora_B has {b.shape[0]} rows, the layer has {offsets[-1]} outputs")
            slices = [(w.lora_a, b[offsets[i] : offsets[i + 1]]) for i in range(self.num_slices)]
        else:
            slices = [(parts[i].lora_a, folded_b(parts[i], slot_scaling)) if i in parts else None
                      for i in range(self.num_slices)]
        self.set_lora(slot, slices)

    def reset_lora(self, slot: int) -> None:
        """Zero ``slot``'s weights (the adapter in it is unloaded)."""
        self.buffers.clear(slot)

    def _base(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x)

    def _lora(self, x: torch.Tensor, base_output: torch.Tensor) -> torch.Tensor:
        ctx, buf = self.context, self.buffers
        delta_into = ctx.lora_output(base_output)
        return ctx.add_delta(base_output, ctx.backend.run_packed(ctx.to_lora_dtype(x), buf.a, buf.b,
                                                                 buf.slice_offsets, delta_into))

    def _finish(self, out: torch.Tensor) -> torch.Tensor:
        return out

    @inference_forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = flatten_tokens(x, self.in_features, type(self).__name__)
        out = self._finish(self._lora(x2, self._base(x2)))
        return out.reshape(*lead, out.shape[-1])
