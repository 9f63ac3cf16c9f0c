"""What every wrapped layer of one model shares, and the target description the dispatcher reads."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, TypeVar

import torch

from lora_core import LoRABackend
from lora_core.checks import check_device

__all__ = ["LoRAContext", "WrapTarget", "flatten_tokens", "inference_forward"]

F = TypeVar("F", bound=Callable)


class LoRAContext:
    """The backend (which also holds the current batch and the ops' options, such as
    ``strict_token_ids``), and the slot count, max rank, dtype and device of the
    layers' LoRA buffers: what every wrapper of one model shares.

    ``dtype`` is the LoRA dtype: the buffers' and the shrink/expand math's. It may
    differ from the base layers' dtype (fp32 adapters on a bf16 model): a wrapper
    then converts its activations once (:meth:`to_lora_dtype`), lets the backend write
    the delta apart (:meth:`lora_output`) and adds it in the base output's dtype
    (:meth:`add_delta`).

    ``dora=True``: the linear, Conv1D, LM-head and embedding layers keep a
    ``(num_slots, out)`` float32 buffer of DoRA factors (1 for slots without DoRA) and rescale every row by its slot's factors
    (``backend.run_dora_scale``), so DoRA adapters can be loaded (lora_core.dora). It is
    fixed when the model is wrapped, so a captured graph always holds the rescale."""

    def __init__(self, backend: LoRABackend, *, num_slots: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device | str, dora: bool = False) -> None:
        if not isinstance(backend, LoRABackend):
            raise TypeError(f"backend must be a lora_core.LoRABackend, got {type(backend).__name__}")
        self.backend = backend
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.dtype = dtype
        self.device = check_device("device", device)
        self.dora = bool(dora)

    def to_lora_dtype(self, x: torch.Tensor) -> torch.Tensor:
        """Activations ``x`` in the LoRA dtype (``x`` itself when it has it)."""
        return x if x.dtype == self.dtype else x.to(self.dtype)

    def lora_output(self, base_output: torch.Tensor) -> torch.Tensor | None:
        """What a backend op accumulates its delta into: ``base_output`` itself when it has
        the LoRA dtype (in place, no copy), else ``None`` (the op returns the delta)."""
        return base_output if base_output.dtype == self.dtype else None

    def add_delta(self, base_output: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
        """``base_output`` with the delta added (in place; returned), given ``result``, the op's
        output for :meth:`lora_output`: already the sum, or the delta, added here in
        ``base_output``'s dtype."""
        return result if base_output.dtype == self.dtype else base_output.add_(result)


@dataclass(frozen=True)
class WrapTarget:
    """How ``MultiLoRA`` asks for a module to be wrapped.

    ``name`` is the module's full name; ``slice_widths`` are given for a packed
    projection (qkv, gate_up); ``lm_head`` marks a module that receives every
    token or the last token of each request; ``saved`` a module that adapters
    train whole (``modules_to_save``), served as a copy per slot.
    """

    name: str
    slice_widths: tuple[int, ...] | None = None
    lm_head: bool = False
    saved: bool = False


def flatten_tokens(x: torch.Tensor, features: int, layer: str) -> torch.Tensor:
    """``x (..., features)`` -> ``(T, features)``; ``ValueError`` naming ``layer`` otherwise."""
    if x.shape[-1] != features:
        raise ValueError(f"{layer} expects inputs with {features} features in the last dim, got {tuple(x.shape)}")
    return x.reshape(-1, features)


def inference_forward(forward: F) -> F:
    """Run a wrapper's ``forward`` without autograd: the layers serve adapters (inference only).

    The backends accumulate the LoRA delta into the base output in place and write
    into preallocated outputs (``out=``), which autograd refuses. When grad mode is
    on (a model called without ``torch.no_grad()``) the whole wrapped layer, base
    and delta, runs under ``torch.no_grad()``: its output is the same, it carries no
    graph, and no gradient reaches the wrapped layer's base weights or its adapters.
    Under ``no_grad`` / ``inference_mode`` nothing changes.
    """

    @functools.wraps(forward)
    def run(self, *args, **kwargs):
        if torch.is_grad_enabled():
            with torch.no_grad():
                return forward(self, *args, **kwargs)
        return forward(self, *args, **kwargs)

    return run  # type: ignore[return-value]
