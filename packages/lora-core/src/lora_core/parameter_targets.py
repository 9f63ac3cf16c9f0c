"""PEFT adapters that target parameters (``target_parameters``): their weights, named.

PEFT's ``ParamWrapper`` puts LoRA on one parameter of a module, e.g. the fused
experts' ``gate_up_proj (E, 2I, H)`` and ``down_proj (E, H, I)``. Several targeted
parameters of one module are nested wrappers, innermost first in the order the
module registers its parameters, so a saved adapter names them by depth only::

    <module>.base_layer.lora_A.weight   the first targeted parameter (of two)
    <module>.lora_A.weight              the last (outermost)

:func:`name_parameter_weights` names them, given the module's parameter names in
registration order (the model knows them, the adapter file does not). Per expert
(PEFT's ``get_delta_weight``, with ``E`` experts and rank ``r``): ``lora_A.weight
(E*r, in)`` is ``A_e = rows [e*r, (e+1)*r)``, and ``lora_B.weight (out, E*r)`` is
``B_e = columns e, E + e, 2E + e, ...`` (``reshape(out, r, E)``); each expert adds
``scaling * B_e @ A_e`` to its ``(out, in)`` weight. Ranks and scalings follow
``r`` / ``lora_alpha``, ``rank_pattern`` / ``alpha_pattern`` keyed by
``<module>.<parameter>``, and ``use_rslora``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import torch

from .adapter_config import ALL_LINEAR, matches_target
from .adapters import AdapterFormatError, LoRAModuleWeights, _pattern_value, peft_scaling

__all__ = ["BASE_LAYER", "split_parameter_pairs", "targeted_parameters", "name_parameter_weights"]

BASE_LAYER = ".base_layer"
"""What PEFT inserts into a saved name per level of parameter-wrapper nesting."""


def targeted_parameters(config: Mapping, module: str, parameters: Sequence[str]) -> list[str]:
    """Those of ``parameters`` (of module ``module``, in registration order) that ``config``'s
    ``target_parameters`` names: ``<module>.<parameter>`` equal to an entry or ending in ``"." + entry``."""
    targets = list(config.get("target_parameters") or ())
    hits = []
    for param in parameters:
        key = f"{module}.{param}"
        if key in targets or any(key.endswith(f".{t}") for t in targets):
            hits.append(param)
    return hits


def name_parameter_weights(config: Mapping, module: str, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
                           parameters: Sequence[str], *, where: str = "adapter") -> dict[str, LoRAModuleWeights]:
    """``<module>.<parameter>`` -> its per-expert weights (kind ``"experts"``: ``lora_a (E, r, in)``,
    ``lora_b (E, out, r)``), for the saved ``pairs`` of ``module`` (``(lora_A (E*r, in), lora_B (out, E*r))``,
    outermost wrapper first) and the module's parameter names in registration order.
    :class:`AdapterFormatError` when they do not fit."""
    targeted = targeted_parameters(config, module, parameters)
    if len(targeted) != len(pairs):
        raise AdapterFormatError(
            f"{where}: module {module!r} has {len(pairs)} nested parameter LoRA pair(s), but target_parameters "
            f"{list(config.get('target_parameters') or ())} name {len(targeted)} of its parameters {list(parameters)}")
    named = {}
    for param, (a, b) in zip(targeted, reversed(pairs)):  # the innermost wrapper is the first parameter
        key = f"{module}.{param}"
        rank = _pattern_value(config.get("rank_pattern") or {}, key, config["r"])
        rows = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != rows or rows % rank or not a.is_floating_point():
            raise AdapterFormatError(
                f"{where}: parameter {key!r} has LoRA weights of shapes {tuple(a.shape)} and {tuple(b.shape)}; "
                f"expected A (E*r, in) and B (out, E*r) with r = {rank} (rank_pattern or r)")
        experts = rows // rank
        alpha = _pattern_value(config.get("alpha_pattern") or {}, key, config["lora_alpha"])
        lora_a = a.reshape(experts, rank, a.shape[1])
        lora_b = b.reshape(b.shape[0], rank, experts).permute(2, 0, 1).contiguous()
        named[key] = LoRAModuleWeights(name=key, kind="experts", lora_a=lora_a, lora_b=lora_b,
                                       scaling=peft_scaling(alpha, rank, bool(config.get("use_rslora", False))))
    return named


def _is_parameter_module(config: dict, module: str) -> bool:
    """Whether the saved pair of ``module`` (no nesting) is a ``target_parameters`` pair: an entry
    ``<module part>.<parameter>`` names it, or a bare parameter entry could and ``target_modules``
    does not (PEFT refuses a module targeted both ways)."""
    for target in config["target_parameters"]:
        owner = target.rpartition(".")[0]
        if owner and (module == owner or module.endswith("." + owner)):
            return True
    if all("." in t for t in config["target_parameters"]):
        return False
    targets = config.get("target_modules")
    if isinstance(targets, str) and targets.lower() == ALL_LINEAR:
        return False
    if not (targets is None or isinstance(targets, str) or isinstance(targets, (list, tuple))):
        return False  # check_targeting names the malformed target_modules when the adapter is wrapped
    return not matches_target({**config, "target_modules": targets or []}, module)


def split_parameter_pairs(path: Path, config: dict, pairs: dict[str, dict[str, torch.Tensor]]
                     ) -> dict[str, tuple[tuple[torch.Tensor, torch.Tensor], ...]]:
    """Take the ``target_parameters`` weights out of ``pairs`` (in place): module -> its pairs by
    nesting depth, outermost first (``<module>``, ``<module>.base_layer``, ...)."""
    nested = sorted(m for m in pairs if m.endswith(BASE_LAYER))
    targets = config.get("target_parameters")
    if not targets:
        if nested:
            raise AdapterFormatError(f"{path}: {nested[0]!r} holds nested parameter LoRA weights, but "
                                     "adapter_config.json has no target_parameters")
        return {}
    if not (isinstance(targets, (list, tuple)) and all(isinstance(t, str) and t for t in targets)):
        raise AdapterFormatError(f"{path}: target_parameters must be a list of parameter names, got {targets!r}")
    roots = {m.split(BASE_LAYER)[0] for m in nested}
    # a nested level (<root>.base_layer...) belongs to its root, even where its own name matches a target
    roots |= {m for m in pairs if m not in roots and not m.endswith(BASE_LAYER) and _is_parameter_module(config, m)}
    found: dict[str, tuple[tuple[torch.Tensor, torch.Tensor], ...]] = {}
    for root in sorted(roots):
        levels = []
        while root + BASE_LAYER * len(levels) in pairs:
            module = root + BASE_LAYER * len(levels)
            if set(pairs[module]) != {"a", "b"}:
                raise AdapterFormatError(f"{path}: parameter LoRA weights of {module!r} lack lora_A or lora_B")
            levels.append((pairs[module]["a"], pairs[module]["b"]))
            del pairs[module]
        if not levels:
            raise AdapterFormatError(f"{path}: nested parameter LoRA weights of {root!r} lack the outermost level")
        found[root] = tuple(levels)
    leftover = sorted(m for m in pairs if m.endswith(BASE_LAYER))
    if leftover:
        raise AdapterFormatError(f"{path}: parameter LoRA weights of {leftover[0]!r} have a gap in their nesting")
    return found
