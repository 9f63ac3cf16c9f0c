"""The oracle of ``lora-sim``: fp32 copies of the base model with each adapter merged in."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Mapping, Sequence

import torch

from lora_core import load_peft_adapter

from ..models import TinyDecoder
from ..packing import LLAMA_PACKED_MODULES, infer_slice_widths
from .serving import packed_module_of

__all__ = ["merged_reference_models", "reference_logits"]


def merged_reference_models(base: TinyDecoder, adapter_paths: Mapping[str, Path]) -> dict[str | None, TinyDecoder]:
    """fp32 copies of ``base``, one per adapter with it merged into the weights
    (``W += scaling * B @ A``; an embedding's delta transposed; a PEFT module that
    lives in a fused module lands in its slice, of the widths
    :func:`lora_layers.packing.infer_slice_widths` gives), and the unmerged copy
    under the key ``None``."""
    models: dict[str | None, TinyDecoder] = {None: copy.deepcopy(base).float()}
    for name, path in adapter_paths.items():
        merged = copy.deepcopy(base).float()
        params = dict(merged.named_parameters())
        for module, w in load_peft_adapter(path).modules.items():
            delta = w.scaling * (w.lora_b.float() @ w.lora_a.float())
            if w.kind == "embedding":
                params[f"{module}.weight"].data += delta.T
                continue
            parent, _, last = module.rpartition(".")
            packed = packed_module_of(last)
            if f"{module}.weight" in params or packed is None:
                params[f"{module}.weight"].data += delta
                continue
            fused_name = f"{parent}.{packed}"
            parts = LLAMA_PACKED_MODULES[packed]
            widths = infer_slice_widths(fused_name, merged.get_submodule(fused_name), parts, merged)
            start = sum(widths[: parts.index(last)])
            params[f"{fused_name}.weight"].data[start : start + widths[parts.index(last)]] += delta
        models[name] = merged
    return models


def reference_logits(models: Mapping[str | None, TinyDecoder], ids: torch.Tensor, seq_lens: Sequence[int],
                     adapters: Sequence[str | None], last_only: bool) -> torch.Tensor:
    """Logits of a flattened batch, request by request through its adapter's merged
    model, on the host in fp32: request ``i`` is the next ``seq_lens[i]`` ids of
    ``ids``; ``last_only`` keeps only each request's last row (LM-head pruning)."""
    rows, start = [], 0
    with torch.no_grad():
        for n, name in zip(seq_lens, adapters):
            logits = models[name](ids[start : start + n].cpu())
            rows.append(logits[-1:] if last_only else logits)
            start += n
    return torch.cat(rows)
