"""Which modules of a model a PEFT LoRA adapter targets, by PEFT's own matching rules.

A PEFT adapter's ``adapter_config.json`` says which modules it was trained on;
serving it needs those modules wrapped. The rules are PEFT's
(``check_target_module_exists``), applied to a module's full name in the base
model (``model.layers.0.self_attn.q_proj``):

* ``modules_to_save`` (modules the adapter trains whole) and anything inside
  them get no LoRA layer (PEFT's ``check_target_module_exists``).
* ``exclude_modules`` first: a string is a regex that must match the whole name
  (``re.fullmatch``); a list excludes a name equal to an entry or ending in
  ``"." + entry``.
* ``target_modules``: a string is a regex that must match the whole name; the
  string ``"all-linear"`` means every linear (``nn.Linear`` / transformers
  ``Conv1D``) module but the output embedding; a list matches a name equal to
  an entry, or ending in ``"." + entry``.
* ``layers_to_transform`` (an int or a list of ints) keeps, of the names a list
  matched by suffix, those in these layers: the layer index is the first
  ``.<digits>.`` component after a ``layers_pattern`` entry (any component when
  there is none). An exact name in the list, or a regex, is not filtered (as in PEFT).
* ``rank_pattern`` / ``alpha_pattern`` override ``r`` / ``lora_alpha`` for the
  modules whose name ends with a pattern key (the first that matches; the rule of
  :func:`lora_core.adapters._pattern_value`).
"""

from __future__ import annotations

import re
from typing import Collection, Iterable, Mapping

from .adapters import AdapterFormatError, _pattern_value
from .checks import is_int

__all__ = ["ALL_LINEAR", "matches_target", "matched_modules", "module_rank", "module_alpha", "check_targeting"]

ALL_LINEAR = "all-linear"
"""PEFT's shorthand ``target_modules`` for every linear layer but the output embedding."""


def _is_str_list(value: object) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)


def check_targeting(config: Mapping) -> None:
    """Raise :class:`AdapterFormatError` when the targeting fields of ``config`` are not
    of the forms PEFT writes (``target_modules`` absent included: a saved adapter has them)."""
    targets = config.get("target_modules")
    if targets is None and config.get("target_parameters"):
        targets = []  # an adapter of parameters only
    if targets is None:
        raise AdapterFormatError("adapter_config.json has no target_modules (a list of names or a regex)")
    if not (isinstance(targets, str) or _is_str_list(targets)):
        raise AdapterFormatError(f"target_modules must be a list of names or a regex string, got {targets!r}")
    exclude = config.get("exclude_modules")
    if exclude is not None and not (isinstance(exclude, str) or _is_str_list(exclude)):
        raise AdapterFormatError(f"exclude_modules must be a list of names or a regex string, got {exclude!r}")
    layers = config.get("layers_to_transform")
    if layers is not None and not (is_int(layers) or (isinstance(layers, (list, tuple)) and all(map(is_int, layers)))):
        raise AdapterFormatError(f"layers_to_transform must be an int or a list of ints, got {layers!r}")
    pattern = config.get("layers_pattern")
    if pattern is not None and not (isinstance(pattern, str) or _is_str_list(pattern)):
        raise AdapterFormatError(f"layers_pattern must be a name or a list of names, got {pattern!r}")
    for field_name, value in (("target_modules", targets), ("exclude_modules", exclude)):
        if isinstance(value, str) and value.lower() != ALL_LINEAR:
            try:
                re.compile(value)
            except re.error as err:
                raise AdapterFormatError(f"{field_name} {value!r} is not a valid regex: {err}") from None


def _excluded(config: Mapping, name: str) -> bool:
    exclude = config.get("exclude_modules")
    if not exclude:
        return False
    if isinstance(exclude, str):
        return re.fullmatch(exclude, name) is not None
    return name in exclude or any(name.endswith(f".{e}") for e in exclude)


def _saved_whole(config: Mapping, name: str) -> bool:
    """PEFT's rule: a module of ``modules_to_save`` (or inside one) gets no LoRA layer."""
    return any(re.match(rf"(^|.*\.){m}($|\..*)", name) for m in config.get("modules_to_save") or ())


def _layer_index(config: Mapping, name: str) -> int | None:
    pattern = config.get("layers_pattern")
    if not pattern:
        match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", name)
    else:
        match = None
        for p in [pattern] if isinstance(pattern, str) else pattern:
            match = re.match(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", name)
            if match is not None:
                break
    return None if match is None else int(match.group("idx"))


def matches_target(config: Mapping, name: str, *, linear_modules: Collection[str] | None = None,
                   output_embedding: str | None = None) -> bool:
    """Whether PEFT would put a LoRA layer of an adapter with ``config`` on the module ``name``.

    ``linear_modules`` (the names of the model's linear modules) and
    ``output_embedding`` (its LM head's name) are needed only for ``"all-linear"``.
    """
    if _excluded(config, name) or _saved_whole(config, name):
        return False
    targets = config.get("target_modules")
    if isinstance(targets, str):
        if targets.lower() == ALL_LINEAR:
            if linear_modules is None:
                raise ValueError('target_modules = "all-linear" needs the names of the model\'s linear modules')
            return name in linear_modules and name != output_embedding
        return re.fullmatch(targets, name) is not None
    targets = list(targets or ())
    if name in targets:
        return True
    if not any(name.endswith(f".{t}") for t in targets):
        return False
    layers = config.get("layers_to_transform")
    if layers is None or (isinstance(layers, (list, tuple)) and not layers):
        return True
    index = _layer_index(config, name)
    if index is None:
        return False
    return index == layers if isinstance(layers, int) else index in layers


def matched_modules(config: Mapping, names: Iterable[str], *, linear_modules: Collection[str] | None = None,
                    output_embedding: str | None = None) -> list[str]:
    """The names among ``names`` (a model's module names, in order) that ``config`` targets."""
    check_targeting(config)
    return [n for n in names if n and matches_target(config, n, linear_modules=linear_modules,
                                                     output_embedding=output_embedding)]


def module_rank(config: Mapping, name: str) -> int:
    """The rank PEFT gives module ``name``: its ``rank_pattern`` entry, else ``r``."""
    return _pattern_value(config.get("rank_pattern") or {}, name, config["r"])


def module_alpha(config: Mapping, name: str) -> float:
    """The ``lora_alpha`` PEFT gives module ``name``: its ``alpha_pattern`` entry, else ``lora_alpha``."""
    return _pattern_value(config.get("alpha_pattern") or {}, name, config["lora_alpha"])
