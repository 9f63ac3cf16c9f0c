"""Targeting: which modules of a model are wrapped, and where an adapter's weights go.

PEFT's ``tuners/lora/model.py`` job, without the layers: match target names
(explicit names, or an adapter config's rules through
:func:`lora_core.adapter_config.matched_modules`), swap each matched module for
the wrapper :func:`lora_layers.layers.wrap_module` picks, put the originals back,
and map each PEFT module name of an adapter onto a wrapped module and slice
(packed projections hold several PEFT modules). Modules that adapters train whole
(PEFT's ``modules_to_save``) are wrapped with ``WrapTarget(saved=True)`` and take
each adapter's copy; a module is either that or LoRA-targeted, never both. It never
looks inside a wrapper: the layer kinds load their own weights
(:meth:`LayerKind.load_slot`).
"""

from __future__ import annotations

import warnings
from typing import Mapping, Sequence

from torch import nn

from lora_core import AdapterFormatError, PeftAdapter
from lora_core.adapter_config import matched_modules
from lora_core.adapters import LoRAModuleWeights, SavedModuleWeights

from .layers import (WHOLE_MODULE, ExpertsLayout, LayerKind, LoRAContext, WrapTarget, is_conv1d, parameter_layer_kind,
                     wrap_module)
from .packing import infer_slice_widths

__all__ = ["TargetModules", "output_embedding_name", "name_parameter_targets"]

LoadPlan = dict[str, dict[int, LoRAModuleWeights | SavedModuleWeights]]
"""Wrapped module name -> its :data:`~lora_layers.layers.ModuleParts` of one adapter."""


def output_embedding_name(model: nn.Module) -> str | None:
    """The full name of a transformers model's LM head (``get_output_embeddings()``), if it has one."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if head is None:
        return None
    return next((name for name, m in model.named_modules() if m is head), None)


def name_parameter_targets(name: str, adapter: PeftAdapter, modules: Mapping[str, nn.Module]) -> PeftAdapter:
    """Adapter ``name`` with its ``target_parameters`` weights named after the parameters of
    ``modules`` (the model's modules by name, as the adapter knew them); an
    :class:`~lora_core.AdapterFormatError` names a parameter no layer kind takes adapters for."""
    if not adapter.parameter_pairs:
        return adapter

    def parameter_names(module: str) -> list[str]:
        return [p for p, _ in modules[module].named_parameters(recurse=False)]

    named = adapter.with_parameters(parameter_names)
    for key, weights in named.modules.items():
        module, _, parameter = key.rpartition(".")
        if weights.kind == "experts" and parameter_layer_kind(modules[module], parameter, WrapTarget(module)) is None:
            layout = ExpertsLayout.of(modules[module])
            why = f"{layout}; " if isinstance(layout, str) else ""
            raise AdapterFormatError(
                f"adapter {name!r} targets parameter {key!r} ({type(modules[module]).__name__}), which lora-kit has "
                f"no wrapper for: {why}target_parameters are served on fused experts modules (gate_up_proj, "
                "down_proj)")
    return named


def _parameter_owners(adapter: PeftAdapter) -> set[str]:
    """The modules whose parameters ``adapter`` targets (its named ``target_parameters`` weights)."""
    return {key.rpartition(".")[0] for key, w in adapter.modules.items() if w.kind == "experts"}


class TargetModules:
    """The wrapped modules of ``model``, by full name, and how adapters map onto them.

    Args:
        model: the model whose submodules are replaced in place.
        context: what every wrapper shares (backend, slots, rank, dtype, device).
        packed_modules: fused projection name -> the PEFT module names it holds, in slice order.
        slice_widths: explicit slice widths of packed modules (else inferred).
        lm_head_modules: names (full, or last component) wrapped as LM heads.
        modules_to_save: names (full, or last component) of the modules wrapped as
            saved modules (a copy per slot, PEFT's ``modules_to_save``).
    """

    def __init__(self, model: nn.Module, context: LoRAContext, *,
                 packed_modules: Mapping[str, Sequence[str]] | None = None,
                 slice_widths: Mapping[str, Sequence[int]] | None = None,
                 lm_head_modules: Sequence[str] = ("lm_head",), modules_to_save: Sequence[str] = ()) -> None:
        self.model = model
        self.context = context
        self.packed_modules = {k: list(v) for k, v in (packed_modules or {}).items()}
        self.slice_widths = dict(slice_widths or {})
        self.lm_heads = set(lm_head_modules)
        self.modules_to_save = set(modules_to_save)
        self.wrapped: dict[str, LayerKind] = {}
        self.originals: dict[str, nn.Module] = {}

    def wrap(self, targets: Sequence[str]) -> None:
        """Wrap every submodule whose full name or last component is in ``targets``;
        ``ValueError`` naming the targets that match nothing."""
        matched: set[str] = set()
        for name, module in list(self.model.named_modules()):
            last = name.rsplit(".", 1)[-1]
            hit = name if name in targets else last if last in targets else None
            if hit is None or name in self.wrapped:
                continue
            matched.add(hit)
            self.wrap_one(name, module)
        missing = [t for t in targets if t not in matched]
        if missing:
            raise ValueError(f"target_modules {missing} match no submodule of {type(self.model).__name__}")

    def wrap_one(self, name: str, module: nn.Module) -> LayerKind:
        """Replace submodule ``name`` (which is ``module``) by its wrapper; returns the wrapper."""
        last = name.rsplit(".", 1)[-1]
        lm_head = name in self.lm_heads or last in self.lm_heads
        saved = self.is_saved(name)
        widths = None
        if last in self.packed_modules and not lm_head and not saved:
            parts = self.packed_modules[last]
            widths = tuple(self.slice_widths.get(last) or infer_slice_widths(name, module, parts, self.model))
        wrapper = wrap_module(module, self.context, WrapTarget(name, slice_widths=widths, lm_head=lm_head, saved=saved))
        setattr(self._parent(name), last, wrapper)
        self.originals[name] = module
        self.wrapped[name] = wrapper
        return wrapper

    def is_saved(self, name: str) -> bool:
        """Whether module ``name`` is (to be) wrapped as a saved module: its full name or last component
        is one of ``modules_to_save``."""
        return name in self.modules_to_save or name.rsplit(".", 1)[-1] in self.modules_to_save

    def _parent(self, name: str) -> nn.Module:
        return self.model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else self.model

    def unwrap(self) -> None:
        """Put the original modules back; nothing stays wrapped."""
        for name, original in self.originals.items():
            setattr(self._parent(name), name.rsplit(".", 1)[-1], original)
        self.originals.clear()
        self.wrapped.clear()

    def base_modules(self) -> dict[str, nn.Module]:
        """The model's modules by name as the adapters knew them: wrapped modules are
        their original modules, and a wrapper's own submodules are not listed."""
        found: dict[str, nn.Module] = {}
        inside: str | None = None
        for name, module in self.model.named_modules():
            if inside is not None and name.startswith(inside):
                continue  # named_modules is pre-order: a wrapper's submodules follow it
            inside = None
            if name in self.wrapped:
                found[name] = self.originals[name]
                inside = name + "."
            elif name:
                found[name] = module
        return found

    def adapter_targets(self, adapter: PeftAdapter) -> dict[str, str]:
        """PEFT module name -> the module of ``model`` it lives in, for every module the
        adapter's config targets (a packed module's parts map to the packed module)."""
        modules = self.base_modules()
        candidates = {name: name for name in modules}
        for name in modules:
            parent, _, last = name.rpartition(".")
            for part in self.packed_modules.get(last, ()):
                candidates.setdefault(f"{parent}.{part}" if parent else part, name)
        linear = {n for n, m in modules.items() if isinstance(m, nn.Linear) or is_conv1d(m)}
        hits = matched_modules(adapter.config, candidates, linear_modules=linear,
                               output_embedding=output_embedding_name(self.model))
        return {hit: candidates[hit] for hit in hits}

    def wrap_for(self, name: str, adapter: PeftAdapter, *, fixed: bool = False) -> None:
        """Wrap the modules adapter ``name`` targets (by its config) that are not wrapped yet.

        Warns when its config targets modules it holds no weights for. ``fixed``
        (graph mode): the wrapped modules may not change, so a module to wrap is a
        ``ValueError``.
        """
        targets = self.adapter_targets(adapter)
        base = self.base_modules()
        without = sorted(t for t in targets if t not in adapter.modules)
        if without:
            shown = ", ".join(without[:3]) + (", ..." if len(without) > 3 else "")
            warnings.warn(f"adapter {name!r}: its target_modules match {len(without)} module(s) it holds no LoRA "
                          f"weights for ({shown}); was it trained on this model?", stacklevel=4)
        saved = sorted(set(adapter.saved_modules) - set(self.wrapped))
        wanted = {targets[t] for t in targets if t in adapter.modules} | _parameter_owners(adapter)
        lora = sorted(wanted - set(self.wrapped))
        for module_name in saved:
            if module_name not in base:
                raise ValueError(f"adapter {name!r} saves {module_name!r} (modules_to_save), which is not a module of "
                                 f"{type(self.model).__name__}")
        if fixed and (lora or saved):
            raise ValueError(f"adapter {name!r} targets {(lora or saved)[0]!r}, which is not wrapped; in graph mode "
                             "the wrapped modules are fixed (wrap it before enable_graph)")
        self.modules_to_save.update(saved)
        for module_name in lora + saved:
            self.wrap_one(module_name, base[module_name])

    def locate(self, adapter: str, module: str) -> tuple[str, int]:
        """The wrapped module and slice (or :data:`~lora_layers.layers.WHOLE_MODULE`) that
        PEFT module ``module`` of adapter ``adapter`` loads into; ``ValueError`` if none."""
        if module in self.wrapped:
            return module, WHOLE_MODULE  # every slice, for a packed module trained fused
        parent, _, last = module.rpartition(".")
        owned = getattr(self.wrapped.get(parent), "parameters_with_lora", ())
        if last in owned:  # a targeted parameter of a wrapped module
            return parent, owned.index(last)
        for packed, parts in self.packed_modules.items():
            if last in parts:
                target = f"{parent}.{packed}" if parent else packed
                if target in self.wrapped:
                    return target, parts.index(last)
        wrapped = ", ".join(sorted(self.wrapped)) or "none"
        raise ValueError(f"adapter {adapter!r} targets {module!r}, which is not wrapped (wrapped: {wrapped})")

    def load_plan(self, name: str, adapter: PeftAdapter) -> LoadPlan:
        """Adapter ``name``'s weights grouped by the wrapped module and slice they load into."""
        plan: LoadPlan = {}
        for module_name, weights in adapter.modules.items():
            target, index = self.locate(name, module_name)
            if self.is_saved(target):
                raise ValueError(f"adapter {name!r} has LoRA weights for {module_name!r}, which is served as a saved "
                                 "module (modules_to_save): a module is either LoRA-targeted or saved whole, not both")
            plan.setdefault(target, {})[index] = weights
        for module_name, saved in adapter.saved_modules.items():
            if module_name not in self.wrapped or not self.is_saved(module_name):
                how = "LoRA-targeted" if module_name in self.wrapped else "not wrapped"
                raise ValueError(f"adapter {name!r} saves {module_name!r} whole (modules_to_save), which is {how}; "
                                 "serve it as a saved module: MultiLoRA(..., modules_to_save=[...]) or from_adapters")
            plan[module_name] = {WHOLE_MODULE: saved}
        return plan
