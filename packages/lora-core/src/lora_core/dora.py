"""DoRA (weight-decomposed LoRA, PEFT's ``use_dora``): the per-output-feature factor and its math.

PEFT's ``DoraLinearLayer`` computes, for a layer with base weight ``W (out, in)``
(a transformers ``Conv1D`` stores ``W.T``: PEFT's ``fan_in_fan_out``), bias
``b``, LoRA pair ``A (r, in)``, ``B (out, r)``, scaling ``s`` and the adapter's
magnitude vector ``m (out,)``::

    factor = m / ||W + s * B @ A||_row          # per output feature, the norm detached
    out    = base(x) + (factor - 1) * (base(x) - b) + factor * s * B @ A @ x
           = factor * (base(x) + s * B @ A @ x - b) + b

The factor depends on the weights only, so it is computed once, when the adapter
is loaded (:func:`dora_factor`), and kept per slot in a ``(L, out)`` float32
buffer whose rows are 1 for slots without DoRA; a batch then only rescales each
row by its slot's factor (:func:`reference_dora_scale`, the semantics of
``LoRABackend.run_dora_scale``). Rows of slot -1 are unchanged.
"""

from __future__ import annotations

import torch

from .batch_info import BatchInfo
from .validation import check_dora_scale_inputs  # noqa: F401  (its home is lora_core.validation; kept importable here)

__all__ = ["dora_factor", "reference_dora_scale"]


def dora_factor(base_weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float,
                magnitude: torch.Tensor) -> torch.Tensor:
    """PEFT's DoRA factor ``m / ||W + scaling * B @ A||`` per output feature, in float32.

    ``base_weight: (out, in)`` (a ``Conv1D``'s ``(in, out)`` weight transposed), ``lora_a: (r, in)``,
    ``lora_b: (out, r)``, ``magnitude: (out,)`` -> ``(out,)`` float32 on ``base_weight``'s device.
    """
    out_features, in_features = base_weight.shape
    if lora_a.shape[1] != in_features or lora_b.shape[0] != out_features or lora_a.shape[0] != lora_b.shape[1]:
        raise ValueError(f"DoRA needs lora_a (r, {in_features}) and lora_b ({out_features}, r) for a base weight "
                         f"({out_features}, {in_features}); got {tuple(lora_a.shape)} and {tuple(lora_b.shape)}")
    if magnitude.shape != (out_features,):
        raise ValueError(f"lora_magnitude_vector must have shape ({out_features},), got {tuple(magnitude.shape)}")
    device = base_weight.device
    weight = base_weight.detach().float() + scaling * (lora_b.to(device).float() @ lora_a.to(device).float())
    return magnitude.to(device).float() / torch.linalg.vector_norm(weight, dim=1)


def reference_dora_scale(output: torch.Tensor, factors: torch.Tensor, batch_info: BatchInfo,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """The oracle of ``run_dora_scale``, in float32 on the host; returns a new ``(T, out)`` tensor.

    Semantics::

        for t in tokens:
            if slot_t >= 0:
                out[t] = factors[slot_t] * (output[t] - bias) + bias     # bias = 0 when None
            else:
                out[t] = output[t]
    """
    out = output.detach().float().cpu().clone()
    f = factors.detach().float().cpu()
    b = torch.zeros(out.shape[1]) if bias is None else bias.detach().float().cpu()
    for t, slot in enumerate(batch_info.token_slots_cpu.tolist()[: out.shape[0]]):
        if slot >= 0:
            out[t] = f[slot] * (out[t] - b) + b
    return out
