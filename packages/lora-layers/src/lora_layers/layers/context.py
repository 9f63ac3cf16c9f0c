"""What every wrapped layer of one model shares, and the target description the dispatcher reads."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lora_core import LoRABackend

__all__ = ["LoRAContext", "WrapTarget", "flatten_tokens"]


class LoRAContext:
    """The backend (which also holds the current batch), the slot count, max rank,
    dtype and device of the layers' LoRA buffers, and the layers' options.

    Args:
        strict_token_ids: embedding layers raise ``ValueError`` naming the first
            out-of-vocabulary ids (checked against the whole vocabulary, eager
            calls only) instead of giving them a zero delta.
    """

    def __init__(self, backend: LoRABackend, *, num_slots: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device | str, strict_token_ids: bool = False) -> None:
        if not isinstance(backend, LoRABackend):
            raise TypeError(f"backend must be a lora_core.LoRABackend, got {type(backend).__name__}")
        self.backend = backend
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.dtype = dtype
        self.device = torch.device(device)
        self.strict_token_ids = bool(strict_token_ids)


@dataclass(frozen=True)
class WrapTarget:
    """How ``MultiLoRA`` asks for a module to be wrapped.

    ``name`` is the module's full name; ``slice_widths`` are given for a packed
    projection (qkv, gate_up); ``lm_head`` marks a module that receives every
    token or the last token of each request.
    """

    name: str
    slice_widths: tuple[int, ...] | None = None
    lm_head: bool = False


def flatten_tokens(x: torch.Tensor, features: int, layer: str) -> torch.Tensor:
    """``x (..., features)`` -> ``(T, features)``; ``ValueError`` naming ``layer`` otherwise."""
    if x.shape[-1] != features:
        raise ValueError(f"{layer} expects inputs with {features} features in the last dim, got {tuple(x.shape)}")
    return x.reshape(-1, features)
