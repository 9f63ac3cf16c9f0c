"""Stacked LoRA buffers of a fused experts module (docs/layout.md, docs/moe.md).

One expert parameter ``W (E, out, in)`` (transformers' ``gate_up_proj (E, 2I, H)``
or ``down_proj (E, H, I)``), ``L`` slots, max rank ``R``:

* ``a``: ``(L, E, R, in)``; expert ``e`` of slot ``l`` uses rows ``[0, r_l)`` of ``a[l, e]``;
* ``b``: ``(L, E, out, R)``; columns ``[0, r_l)`` of ``b[l, e]`` are used.

An adapter gives every expert of a parameter the same rank (PEFT's
``ParamWrapper``); an adapter that does not target the parameter leaves the slot
zero. Loading zeroes the slot first, so nothing of an evicted adapter survives.
"""

from __future__ import annotations

import torch

from .checks import allocating, check_device, check_float_dtype, check_int, is_int

__all__ = ["ExpertLoRABuffers"]


class ExpertLoRABuffers:
    """A/B buffers of one expert parameter: ``a (L, E, R, in)``, ``b (L, E, out, R)``."""

    def __init__(self, *, num_slots: int, num_experts: int, max_rank: int, in_features: int, out_features: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        for name, value in (("num_slots", num_slots), ("num_experts", num_experts), ("max_rank", max_rank),
                            ("in_features", in_features), ("out_features", out_features)):
            check_int(name, value, minimum=1)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
        check_float_dtype("dtype", dtype)
        device = check_device("device", device)
        self.num_slots, self.num_experts, self.max_rank = num_slots, num_experts, max_rank
        self.in_features, self.out_features = in_features, out_features
        sizes = (f"num_slots = {num_slots}, num_experts = {num_experts}, max_rank = {max_rank}, "
                 f"in_features = {in_features}, out_features = {out_features}")
        self.a = allocating(sizes, lambda: torch.zeros(num_slots, num_experts, max_rank, in_features,
                                                       dtype=dtype, device=device))
        self.b = allocating(sizes, lambda: torch.zeros(num_slots, num_experts, out_features, max_rank,
                                                       dtype=dtype, device=device))

    def _check_slot(self, slot: int) -> None:
        if not is_int(slot) or not 0 <= slot < self.num_slots:
            raise ValueError(f"slot must be an int in [0, {self.num_slots}), got {slot!r}")

    def load(self, slot: int, lora_a: torch.Tensor, lora_b: torch.Tensor) -> None:
        """Write one adapter into ``slot``: ``lora_a (E, r, in)``, ``lora_b (E, out, r)`` with
        ``r <= max_rank``. Scaling is not applied here: it lives in the batch info, per slot."""
        self._check_slot(slot)
        E, R = self.num_experts, self.max_rank
        for name, t in (("lora_a", lora_a), ("lora_b", lora_b)):
            if not isinstance(t, torch.Tensor) or t.dim() != 3 or not t.is_floating_point():
                shown = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{name} must be a 3-D floating-point tensor, got {shown}")
        r = lora_a.shape[1]
        if lora_a.shape != (E, r, self.in_features) or not 0 < r <= R:
            raise ValueError(f"lora_a must have shape ({E}, r, {self.in_features}) with 1 <= r <= max_rank = {R}, "
                             f"got {tuple(lora_a.shape)}")
        if lora_b.shape != (E, self.out_features, r):
            raise ValueError(f"lora_b must have shape ({E}, {self.out_features}, {r}) for lora_a of rank {r}, "
                             f"got {tuple(lora_b.shape)}")
        self.clear(slot)
        self.a[slot, :, :r].copy_(lora_a)
        self.b[slot, :, :, :r].copy_(lora_b)

    def clear(self, slot: int) -> None:
        """Zero the slot (evict)."""
        self._check_slot(slot)
        self.a[slot].zero_()
        self.b[slot].zero_()
