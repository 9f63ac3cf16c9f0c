"""``LinearWithLoRA``: a replicated ``nn.Linear`` (plain, or packed: qkv, gate_up, any parts)."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from lora_core import LinearLoRABuffers, slice_offsets_from_widths
from lora_core.dora import NO_DORA_TERMS, dora_factor, dora_terms, no_dora_terms, scaled_dora

from ..parallel import TensorParallel
from .context import LoRAContext, WrapTarget, flatten_tokens, inference_forward
from .dense_weight import UnsupportedWeight, dense_weight
from .slot_weights import WHOLE_MODULE, ModuleParts, check_dora_parts, folded_b

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
        lora_in, lora_out = self._lora_features()
        local = list(slice_widths) if slice_widths is not None else [lora_out]
        if sum(local) != lora_out:
            raise ValueError(
                f"slice_widths {local} sum to {sum(local)}, but the base layer has {lora_out} outputs"
            )
        self.buffers = LinearLoRABuffers(num_slots=context.num_slots, max_rank=context.max_rank,
                                         in_features=lora_in, slice_widths=local,
                                         dtype=context.dtype, device=context.device)
        self.dora_factors: torch.Tensor | None = None
        """``(num_slots, out)`` float32 DoRA factors of the local outputs (1: no DoRA), with ``context.dora``."""
        self.dora_terms: torch.Tensor | None = None
        """``(num_slots, 4, out)`` float32 :func:`~lora_core.dora.dora_terms`, for batches with request scales."""
        if context.dora:
            self.dora_factors = torch.ones(context.num_slots, self.out_features, device=context.device)
            self.dora_terms = no_dora_terms(context.num_slots, self.out_features, context.device)

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
    def _lora_features(self) -> tuple[int, int]:
        """``(in, out)`` of this process's LoRA buffers: the base layer's, unless a fully sharded
        wrapper holds only its shard of A's input columns or of B's output rows."""
        return self.in_features, self.out_features

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
        dora = self._dora_of(parts)  # checked before anything is written
        self.set_lora(slot, slices)
        if dora is not None:
            self.dora_factors[slot], self.dora_terms[slot] = dora

    def reset_lora(self, slot: int) -> None:
        """Zero ``slot``'s weights (the adapter in it is unloaded)."""
        self.buffers.clear(slot)
        if self.dora_factors is not None:
            self.dora_factors[slot] = 1.0
            self.dora_terms[slot] = self.dora_terms.new_tensor(NO_DORA_TERMS)[:, None]

    def _base_weight(self) -> torch.Tensor:
        """The base layer's weight as a dense ``(out, in)`` tensor (what DoRA's norm is taken over):
        a quantized layer's weight dequantized into a temporary copy (:func:`dense_weight`)."""
        return dense_weight(self.base_layer.weight)

    def _dora_of(self, parts: ModuleParts) -> tuple[torch.Tensor, torch.Tensor] | None:
        """An adapter's ``(out,)`` DoRA factors and ``(4, out)`` terms for this layer, computed once,
        at load (lora_core.dora.dora_factor, dora_terms): each part with a magnitude vector sets its
        output rows, other rows get factor 1. ``None`` for a layer without DoRA factors."""
        check_dora_parts(parts, self.dora_factors, self.tp.size)
        if self.dora_factors is None:
            return None
        dora = {i: w for i, w in parts.items() if w.magnitude is not None}
        factors = torch.ones_like(self.dora_factors[0])
        terms = self.dora_terms.new_tensor(NO_DORA_TERMS)[:, None].repeat(1, factors.shape[0])
        offsets = slice_offsets_from_widths(self.unsharded_slice_widths)
        try:
            weight = self._base_weight() if dora else None
        except UnsupportedWeight as error:
            raise ValueError(f"DoRA over {type(self.base_layer).__name__} is not supported: its norm needs the dense "
                             f"weight, and this layer has {error}") from None
        for i, w in dora.items():
            lo, hi = (0, offsets[-1]) if i == WHOLE_MODULE else (offsets[i], offsets[i + 1])
            factors[lo:hi] = dora_factor(weight[lo:hi], w.lora_a, w.lora_b, w.scaling, w.magnitude)
            terms[:, lo:hi] = dora_terms(weight[lo:hi], w.lora_a, w.lora_b, w.scaling, w.magnitude)
        return factors, terms

    def _base(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x)

    def _lora(self, x: torch.Tensor, base_output: torch.Tensor) -> torch.Tensor:
        ctx, buf = self.context, self.buffers
        delta_into = ctx.lora_output(base_output)
        return ctx.add_delta(base_output, ctx.backend.run_packed(ctx.to_lora_dtype(x), buf.a, buf.b,
                                                                 buf.slice_offsets, delta_into))

    def _dora(self, out: torch.Tensor, *, pruned: bool = False) -> torch.Tensor:
        """Each row rescaled by its slot's DoRA factors (with ``context.dora``), in place."""
        if self.dora_factors is None:
            return out
        backend, bias = self.context.backend, self.base_layer.bias
        rows = backend.batch_info.lm_head_view(pruned)
        if rows.has_request_scales:  # the factor depends on each row's scale
            return scaled_dora(out, self.dora_terms, rows, bias)
        return backend.run_dora_scale(out, self.dora_factors, bias, pruned=pruned)

    def _finish(self, out: torch.Tensor) -> torch.Tensor:
        return out

    @inference_forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = flatten_tokens(x, self.in_features, type(self).__name__)
        out = self._finish(self._dora(self._lora(x2, self._base(x2))))
        return out.reshape(*lead, out.shape[-1])
