"""Writing adapters in PEFT's on-disk format: what tests, examples and ``lora-sim``'s
synthetic adapters use to make adapters without training one (:mod:`.adapters` reads them)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping, Sequence

import torch

from .adapter_files import CONFIG_NAME, SAFETENSORS_NAME
from .adapters import _PREFIX

__all__ = ["save_peft_adapter"]


def save_peft_adapter(
    path: str | Path,
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]],
    *,
    lora_alpha: float,
    r: int | None = None,
    use_rslora: bool = False,
    embedding_modules: tuple[str, ...] = (),
    rank_pattern: dict[str, int] | None = None,
    alpha_pattern: dict[str, float] | None = None,
    base_model_name_or_path: str | None = None,
    parameters: Mapping[str, Sequence[tuple[str, torch.Tensor, torch.Tensor]]] | None = None,
) -> Path:
    """Write an adapter in PEFT's on-disk format (what ``save_pretrained`` writes).

    ``modules`` maps a module name to ``(A, B)``: ``A (r, in)``, ``B (out, r)``
    (embeddings, named in ``embedding_modules``: ``A (r, V)``, ``B (D, r)``).
    ``parameters`` maps a module name to its targeted parameters (``target_parameters``,
    e.g. fused experts) in the module's registration order, each ``(name, A (E, r, in),
    B (E, out, r))``, saved as PEFT's nested parameter wrappers (docs/moe.md).
    ``r`` defaults to the most common module rank.
    """
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    ranks = [a.shape[0] for a, _ in modules.values()] + [a.shape[1] for p in (parameters or {}).values()
                                                          for _, a, _ in p]
    r = r if r is not None else max(set(ranks), key=ranks.count)
    tensors = {}
    for name, (a, b) in modules.items():
        if name in embedding_modules:
            tensors[f"{_PREFIX}{name}.lora_embedding_A"] = a.contiguous()
            tensors[f"{_PREFIX}{name}.lora_embedding_B"] = b.contiguous()
        else:
            tensors[f"{_PREFIX}{name}.lora_A.weight"] = a.contiguous()
            tensors[f"{_PREFIX}{name}.lora_B.weight"] = b.contiguous()
    target_parameters = set()
    for module, params in (parameters or {}).items():
        for depth, (param, a, b) in enumerate(reversed(params)):  # the last parameter is the outermost wrapper
            experts, rank, _ = a.shape
            key = f"{_PREFIX}{module}" + ".base_layer" * depth
            tensors[f"{key}.lora_A.weight"] = a.reshape(experts * rank, -1).contiguous()
            tensors[f"{key}.lora_B.weight"] = b.permute(1, 2, 0).reshape(b.shape[1], rank * experts).contiguous()
            target_parameters.add(f"{module.rsplit('.', 1)[-1]}.{param}")
    save_file(tensors, str(path / SAFETENSORS_NAME))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": r,
        "lora_alpha": lora_alpha,
        "use_rslora": use_rslora,
        "target_modules": sorted({name.rsplit(".", 1)[-1] for name in modules}),
        "rank_pattern": rank_pattern or {},
        "alpha_pattern": alpha_pattern or {},
        "lora_dropout": 0.0,
        "bias": "none",
        "use_dora": False,
        "modules_to_save": None,
        "target_parameters": sorted(target_parameters) or None,
    }
    (path / CONFIG_NAME).write_text(json.dumps(config, indent=2))
    return path
