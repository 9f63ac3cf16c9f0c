"""The oracle of ``lora-sim``: fp32 copies of the base model with each request's adapter, or weighted
mix of adapters, merged in at its request scale."""

from __future__ import annotations

import copy
from typing import Iterable, Mapping, Sequence

import torch

from lora_core import PeftAdapter
from lora_core.testing import TOLERANCES

from ..models import TinyDecoder
from ..packing import LLAMA_PACKED_MODULES, infer_slice_widths
from ..targeting import name_parameter_targets
from .serving import AdapterSources, load_adapters, packed_module_of
from .workload import Entry, mix_pairs, request_entry

__all__ = ["ReferenceKey", "ScaledCheck", "merged_reference_models", "reference_key", "reference_keys",
           "reference_logits"]

ReferenceKey = tuple[Entry, float]
"""Which reference model a request is checked against: its adapter (or weighted mix, as a
:data:`~lora_layers.sim.workload.Mix`) and its request scale."""


def reference_key(adapter: object, scale: float) -> ReferenceKey:
    """The reference of a request of ``adapter`` (a name, ``None`` or a weighted mix) at request scale
    ``scale``: ``(adapter, scale)``, a mix as a hashable :data:`~lora_layers.sim.workload.Mix`; the
    unmerged model ``(None, 1.0)`` for a base-model request, whatever its scale (it has no delta to scale)."""
    return (None, 1.0) if adapter is None else (request_entry("adapter", adapter), float(scale))


def reference_keys(requests: Iterable[tuple[object, float]]) -> list[ReferenceKey]:
    """The reference models ``requests`` (each an adapter or mix and its request scale) are checked
    against, once each: the unmerged ``(None, 1.0)`` first, then each (adapter, scale) in order."""
    return list(dict.fromkeys([(None, 1.0)] + [reference_key(a, s) for a, s in requests]))


def _merge(model: TinyDecoder, name: str, loaded: PeftAdapter, scale: float) -> None:
    """Merge adapter ``name`` into the fp32 ``model`` in place at ``scale`` (a request scale times the
    adapter's weight in the request's mix): each module's ``W += scale * scaling * B @ A`` (see
    :func:`merged_reference_models`), and each module it trained whole replaced by its copy, not scaled."""
    params = dict(model.named_parameters())
    adapter = name_parameter_targets(name, loaded, dict(model.named_modules()))
    for module, saved in adapter.saved_modules.items():
        params[f"{module}.weight"].data.copy_(saved.weight)
        if saved.bias is not None:
            params[f"{module}.bias"].data.copy_(saved.bias)
    for module, w in adapter.modules.items():
        delta = scale * w.scaling * (w.lora_b.float() @ w.lora_a.float())  # per expert for a targeted parameter
        if w.kind == "embedding":
            params[f"{module}.weight"].data += delta.T
            continue
        if w.kind == "experts":  # (E, out, in), as PEFT's ParamWrapper merges it
            params[module].data += delta
            continue
        parent, _, last = module.rpartition(".")
        packed = packed_module_of(last)
        if f"{module}.weight" in params or packed is None:
            params[f"{module}.weight"].data += delta
            continue
        fused_name = f"{parent}.{packed}"
        parts = LLAMA_PACKED_MODULES[packed]
        widths = infer_slice_widths(fused_name, model.get_submodule(fused_name), parts, model)
        start = sum(widths[: parts.index(last)])
        params[f"{fused_name}.weight"].data[start : start + widths[parts.index(last)]] += delta


def merged_reference_models(base: TinyDecoder, adapters: AdapterSources,
                            requests: Iterable[tuple[object, float]] | None = None
                            ) -> dict[ReferenceKey, TinyDecoder]:
    """fp32 copies of ``base``, one per (adapter or weighted mix, request scale) of ``requests``
    (``None``: every adapter at scale 1) with the request's adapters merged into the weights at that
    scale, keyed by :func:`reference_key`, and the unmerged copy under ``(None, 1.0)``.

    Merged at scale ``s``: ``W += s * w_i * scaling_i * B_i @ A_i`` for each adapter ``i`` of the
    request and its weight ``w_i`` (:func:`~lora_layers.sim.workload.mix_pairs`: 1 for a request of
    one adapter), so a mix's model holds ``s * sum_i w_i * delta_i`` (an embedding's delta
    transposed; a PEFT module that lives in a fused module lands in its slice, of the widths
    :func:`lora_layers.packing.infer_slice_widths` gives; a targeted experts parameter gets each
    expert's ``s * w_i * scaling_i * B_e @ A_e``); a module the adapter trained whole,
    ``modules_to_save``, is replaced by its copy at any scale (request scales do not scale it; no mix
    of two or more holds such an adapter), so at scale 0 the model is the unmerged one but for those
    copies.
    """
    loaded = load_adapters(adapters)
    models: dict[ReferenceKey, TinyDecoder] = {}
    for entry, scale in reference_keys([(n, 1.0) for n in loaded] if requests is None else requests):
        models[(entry, scale)] = copy.deepcopy(base).float()
        for name, weight in mix_pairs(entry):
            _merge(models[(entry, scale)], name, loaded[name], scale * weight)
    return models


def reference_logits(models: Mapping[ReferenceKey, TinyDecoder], ids: torch.Tensor, seq_lens: Sequence[int],
                     requests: Sequence[tuple[object, float]], last_only: bool) -> torch.Tensor:
    """Logits of a flattened batch, request by request through the merged model of its
    (adapter or mix, scale) (:func:`reference_key`), on the host in fp32: request ``i`` is the next
    ``seq_lens[i]`` ids of ``ids``; ``last_only`` keeps only each request's last row (LM-head pruning)."""
    rows, start = [], 0
    with torch.no_grad():
        for n, (name, scale) in zip(seq_lens, requests):
            logits = models[reference_key(name, scale)](ids[start : start + n].cpu())
            rows.append(logits[-1:] if last_only else logits)
            start += n
    return torch.cat(rows)


class ScaledCheck:
    """Compares outputs with the reference at a tolerance relative to the output's magnitude.

    An output passes when ``|got - want| <= atol * max(1, max |want|) + rtol * |want|``
    elementwise, with ``(rtol, atol)`` the fp32 entry of ``lora_core.testing.TOLERANCES``:
    fp32 rounding grows with the size of the values summed, so a valid adapter with large
    weights (logits of tens or hundreds) is not judged at the absolute tolerance of unit-scale
    logits. Keeps the largest absolute error and the largest error relative to ``max |want|``.
    Called as ``check(got, want)``, or ``check(got, want, requests)`` with ``requests[j]`` the
    request (its index in the workload) that output row ``j`` belongs to, which also keeps each
    request's largest absolute error (:attr:`max_error_by_request`); ``ok`` says whether every
    output passed.
    """

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        self.rtol, self.atol = TOLERANCES[dtype]
        self.errors: list[float] = []
        self.relative_errors: list[float] = []
        self.request_errors: dict[int, float] = {}
        self.ok = True

    def __call__(self, got: torch.Tensor, want: torch.Tensor, requests: Sequence[int] | None = None) -> None:
        got, want = got.float().cpu(), want.float().cpu()
        scale = max(1.0, want.abs().max().item()) if want.numel() else 1.0
        error = (got - want).abs().max().item() if want.numel() else 0.0
        self.errors.append(error)
        self.relative_errors.append(error / scale)
        self.ok = self.ok and bool(torch.isclose(got, want, rtol=self.rtol, atol=self.atol * scale).all())
        if requests is not None:
            rows = (got - want).abs().reshape(len(requests), -1).amax(-1).tolist()
            for request, row in zip(requests, rows):
                seen = self.request_errors.get(request, row)
                self.request_errors[request] = torch.tensor([seen, row]).max().item()  # NaN propagates

    @property
    def max_error(self) -> float:
        return torch.tensor(self.errors).max().item()  # NaN propagates

    @property
    def max_relative_error(self) -> float:
        return torch.tensor(self.relative_errors).max().item()

    @property
    def max_error_by_request(self) -> list[float]:
        """Each request's largest absolute error over the outputs checked with ``requests``, by request
        index ``0, 1, ...`` (every one of them checked at least once)."""
        return [self.request_errors[r] for r in range(len(self.request_errors))]

    @property
    def tolerance(self) -> str:
        return f"fp32 rtol={self.rtol:g} atol={self.atol:g} x max(1, max|ref|)"
