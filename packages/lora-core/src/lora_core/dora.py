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

A request scale ``c`` (``BatchInfo.token_scales``) scales ``s`` inside the norm as well, as
PEFT's scaled DoRA does, so a batch with request scales rescales each row by ``factor(c)``,
built from four per-slot row vectors kept at load (:func:`dora_terms`, :func:`scaled_dora`).
"""

from __future__ import annotations

import torch

from .batch_info import BatchInfo
from .validation import check_dora_scale_inputs  # noqa: F401  (its home is lora_core.validation; kept importable here)

__all__ = ["NO_DORA_TERMS", "dora_factor", "dora_terms", "no_dora_terms", "reference_dora_scale",
           "reference_scaled_dora", "scaled_dora"]

NO_DORA_TERMS = (1.0, 1.0, 0.0, 0.0)
"""The :func:`dora_terms` of a slot without DoRA: a factor of 1 at every request scale."""


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


def dora_terms(base_weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float,
               magnitude: torch.Tensor) -> torch.Tensor:
    """What DoRA's factor at any request scale ``c`` is made of, per output feature: ``(4, out)``
    float32 rows ``m``, ``||W||^2``, ``<W, s*B@A>`` and ``||s*B@A||^2``, so that (PEFT's DoRA with its
    scaling multiplied by ``c``, e.g. under ``peft.helpers.rescale_adapter_scale``)::

        factor(c) = m / ||W + c * s * B @ A|| = m / sqrt(||W||^2 + 2c <W, s*B@A> + c^2 ||s*B@A||^2)

    ``factor(1)`` is :func:`dora_factor`. Shapes as :func:`dora_factor`'s."""
    dora_factor(base_weight, lora_a, lora_b, scaling, magnitude)  # validates the shapes
    device = base_weight.device
    w = base_weight.detach().float()
    delta = scaling * (lora_b.to(device).float() @ lora_a.to(device).float())
    return torch.stack([magnitude.to(device).float(), (w * w).sum(1), (w * delta).sum(1), (delta * delta).sum(1)])


def no_dora_terms(num_slots: int, out_features: int, device: torch.device | str) -> torch.Tensor:
    """``(num_slots, 4, out_features)`` float32 :data:`NO_DORA_TERMS` for every slot and feature."""
    return torch.tensor(NO_DORA_TERMS, device=device)[None, :, None].repeat(num_slots, 1, out_features)


def scaled_dora(output: torch.Tensor, terms: torch.Tensor, batch_info: BatchInfo,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """DoRA's rescale at each row's request scale, in place: ``output (n, out)`` (the first ``n``
    rows of ``batch_info``: base output plus the scaled delta), ``terms (L, 4, out)`` float32
    (:func:`dora_terms` per slot; :data:`NO_DORA_TERMS` for slots without DoRA). Graph-safe: a
    fixed number of device ops, nothing read on the host.

    Semantics::

        for t in rows:
            if slot_t >= 0:
                c = token_scales[t]
                m, n0, n1, n2 = terms[slot_t]
                output[t] = m / sqrt(n0 + 2c n1 + c^2 n2) * (output[t] - bias) + bias
    """
    n = output.shape[0]
    slots = batch_info.token_slots[:n]
    c = batch_info.token_scales[:n, None]
    m, n0, n1, n2 = terms.index_select(0, slots.clamp(min=0)).unbind(1)  # (n, out) each
    factors = m * torch.rsqrt((n0 + 2 * c * n1 + c * c * n2).clamp(min=torch.finfo(torch.float32).tiny))
    b = 0.0 if bias is None else bias.float()
    rescaled = factors * (output.float() - b) + b
    return output.copy_(torch.where((slots >= 0)[:, None], rescaled, output.float()))


def reference_scaled_dora(output: torch.Tensor, terms: torch.Tensor, batch_info: BatchInfo,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """The oracle of :func:`scaled_dora`, in float32 on the host; returns a new ``(n, out)`` tensor."""
    out = output.detach().float().cpu().clone()
    t_cpu = terms.detach().float().cpu()
    b = torch.zeros(out.shape[1]) if bias is None else bias.detach().float().cpu()
    scales = batch_info.token_scales_cpu.tolist()
    for t, slot in enumerate(batch_info.token_slots_cpu.tolist()[: out.shape[0]]):
        if slot >= 0:
            m, n0, n1, n2 = t_cpu[slot]
            c = scales[t]
            out[t] = m / torch.sqrt(n0 + 2 * c * n1 + c * c * n2) * (out[t] - b) + b
    return out


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
