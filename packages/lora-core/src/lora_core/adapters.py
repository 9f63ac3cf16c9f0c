"""Loading LoRA adapters saved in PEFT's format (``save_pretrained``).

An adapter directory holds ``adapter_config.json`` and ``adapter_model.safetensors``
(or ``adapter_model.bin``, read with ``torch.load(weights_only=True)``). Tensors are
named ``base_model.model.<module>.lora_A.weight`` / ``lora_B.weight`` for linear
layers and ``...<module>.lora_embedding_A`` / ``lora_embedding_B`` for embeddings.

Scaling follows PEFT: ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with
``use_rslora``, where ``rank_pattern`` / ``alpha_pattern`` override ``r`` and
``lora_alpha`` per module. A DoRA adapter (``use_dora``) also holds each module's
``...<module>.lora_magnitude_vector`` (``(out,)``, an embedding's ``(D,)``;
:mod:`lora_core.dora`). Modules the adapter trained whole (PEFT's
``modules_to_save``, e.g. ``lm_head``, ``embed_tokens``, a classifier ``score``)
are saved as ``base_model.model.<module>.weight`` (and ``.bias``) and read into
:attr:`PeftAdapter.saved_modules`. Anything else the math here does not cover
(LoRA bias, other PEFT types) is rejected with a clear error.
"""

from __future__ import annotations

import json
import math
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch

from .adapter_files import CONFIG_NAME, AdapterFormatError, check_finite_weights, read_adapter_tensors
from .checks import FLOAT32_MAX, check_finite_float

__all__ = ["LoRAModuleWeights", "PeftAdapter", "load_peft_adapter", "peft_scaling", "AdapterFormatError",
           "SavedModuleWeights", "is_saved_module"]

_PREFIX = "base_model.model."
_SUFFIXES = {
    ".lora_A.weight": ("linear", "a"),
    ".lora_B.weight": ("linear", "b"),
    ".lora_embedding_A": ("embedding", "a"),
    ".lora_embedding_B": ("embedding", "b"),
}
_MAGNITUDE = ".lora_magnitude_vector"  # DoRA's magnitude vector (out,), PEFT's key without ".weight"


@dataclass(frozen=True)
class LoRAModuleWeights:
    """One module's LoRA pair.

    Linear: ``lora_a (r, in)``, ``lora_b (out, r)``.
    Embedding: ``lora_a (r, V)``, ``lora_b (D, r)``.
    ``magnitude``: DoRA's ``lora_magnitude_vector (out,)`` of a ``use_dora`` adapter, else ``None``.
    Experts (a targeted parameter ``(E, out, in)``): ``lora_a (E, r, in)``, ``lora_b (E, out, r)``.
    """

    name: str
    kind: str  # "linear" or "embedding"
    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scaling: float
    magnitude: torch.Tensor | None = None

    @property
    def rank(self) -> int:
        return self.lora_a.shape[-2]


@dataclass(frozen=True)
class SavedModuleWeights:
    """One module the adapter trained whole (PEFT's ``modules_to_save``): its own copy's parameters.

    ``weight``: ``(out, in)`` for a linear layer, ``(V, D)`` for an embedding;
    ``bias``: ``(out,)``, or ``None`` when the module has none. ``kind`` is
    ``"saved"`` (a LoRA pair's is ``"linear"`` or ``"embedding"``).
    """

    name: str
    weight: torch.Tensor
    bias: torch.Tensor | None = None
    kind = "saved"


def is_saved_module(config: dict, module: str) -> bool:
    """Whether ``module`` is one of ``config``'s ``modules_to_save`` (PEFT's ``_set_trainable``
    rule: the module's name ends with an entry, e.g. ``lm_head``, ``model.embed_tokens``)."""
    return any(module.endswith(m) for m in config.get("modules_to_save") or ())


@dataclass(frozen=True)
class PeftAdapter:
    """A loaded PEFT LoRA adapter: its config, the LoRA weights of each module it targets,
    and the modules it trained whole (``modules_to_save``), by module name."""

    path: Path
    config: dict
    modules: dict[str, LoRAModuleWeights] = field(repr=False)
    parameter_pairs: dict[str, tuple[tuple[torch.Tensor, torch.Tensor], ...]] = field(default_factory=dict, repr=False)
    """Modules with ``target_parameters`` weights not named yet: module -> its saved
    ``(lora_A, lora_B)`` pairs, outermost wrapper first (:meth:`with_parameters` names them)."""
    saved_modules: dict[str, SavedModuleWeights] = field(default_factory=dict, repr=False)

    @property
    def rank(self) -> int:
        """The largest module rank (the rank of the slot it occupies)."""
        if self.parameter_pairs:
            raise ValueError(f"{self.path}: the ranks of its parameter targets are known once they are named "
                             "(PeftAdapter.with_parameters)")
        return max(m.rank for m in self.modules.values())

    def with_parameters(self, parameter_names: Callable[[str], Sequence[str]]) -> PeftAdapter:
        """This adapter with its ``target_parameters`` weights named (``<module>.<parameter>``
        entries of kind ``"experts"`` in :attr:`modules`), given each module's parameter names
        in registration order (``parameter_names(module)``; ``KeyError`` for a module the model lacks)."""
        from .parameter_targets import name_parameter_weights

        modules = dict(self.modules)
        for module, pairs in self.parameter_pairs.items():
            try:
                names = parameter_names(module)
            except KeyError:
                raise AdapterFormatError(f"{self.path}: target_parameters weights for module {module!r}, "
                                         "which the model does not have") from None
            modules.update(name_parameter_weights(self.config, module, pairs, names, where=str(self.path)))
        return PeftAdapter(path=self.path, config=self.config, modules=modules, saved_modules=self.saved_modules)

    @property
    def use_rslora(self) -> bool:
        return bool(self.config.get("use_rslora", False))

    @property
    def use_dora(self) -> bool:
        return bool(self.config.get("use_dora", False))


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rule: the first pattern key that matches the end of the module name, on a
    name-component boundary: ``q`` matches ``q`` and ``layers.0.q`` but not ``q_proj``,
    ``proj`` does not match ``q_proj``. Keys are regular expressions, as in PEFT's
    ``get_pattern_key``."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _is_positive_number(value: object) -> bool:
    try:
        return check_finite_float("value", value) > 0
    except ValueError:
        return False


def peft_scaling(alpha: float, rank: int, use_rslora: bool) -> float:
    """PEFT's scaling: ``alpha / r``, or ``alpha / sqrt(r)`` for rsLoRA."""
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


def _read_config(path: Path) -> dict:
    config_path = path / CONFIG_NAME
    if not config_path.is_file():
        raise FileNotFoundError(f"no {CONFIG_NAME} in adapter directory {path}")
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AdapterFormatError(f"{config_path} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterFormatError(f"{config_path} must hold a JSON object, got {type(config).__name__}")
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise AdapterFormatError(f"{config_path}: peft_type {peft_type!r} is not supported (only LORA)")
    unsupported = {
        "lora_bias": "LoRA bias (lora_bias)",
        "trainable_token_indices": "trainable tokens (trainable_token_indices)",
        "alora_invocation_tokens": "Activated LoRA, applied from the invocation tokens on (alora_invocation_tokens)",
        "use_qalora": "QALoRA's pooled inputs (use_qalora)",
        "layer_replication": "replicated layers (layer_replication)",
        "kasa_config": "KaSA (kasa_config)",
        "monteclora_config": "MonteCLoRA (monteclora_config)",
        "arrow_config": "Arrow routing (arrow_config)",
        "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    }
    for key, what in unsupported.items():
        if config.get(key):
            raise AdapterFormatError(f"{config_path}: {what} is not supported")
    saved = config.get("modules_to_save")
    if saved is not None and not (isinstance(saved, list) and all(isinstance(m, str) and m for m in saved)):
        raise AdapterFormatError(f"{config_path}: modules_to_save must be a list of module names, got {saved!r}")
    if config.get("bias") not in (None, "none"):  # trained base biases are saved with the adapter
        raise AdapterFormatError(f"{config_path}: trained biases (bias = {config['bias']!r}) are not supported")
    for key in ("r", "lora_alpha"):
        value = config.get(key)
        if not _is_positive_number(value):
            raise AdapterFormatError(f"{config_path}: {key} must be a positive number (finite), got {value!r}")
    for key in ("use_rslora", "use_dora"):
        flag = config.get(key, False)
        if flag is not None and not isinstance(flag, bool):
            raise AdapterFormatError(f"{config_path}: {key} must be true or false, got {flag!r}")
    for key in ("rank_pattern", "alpha_pattern"):
        patterns = config.get(key) or {}
        if not isinstance(patterns, dict):
            raise AdapterFormatError(f"{config_path}: {key} must be an object, got {config.get(key)!r}")
        for pattern, value in patterns.items():
            try:
                re.compile(rf"(.*\.)?({pattern})$")  # how _pattern_value uses it
            except re.error as exc:
                raise AdapterFormatError(f"{config_path}: {key} key {pattern!r} is not a valid pattern: {exc}") from None
            integral = key == "rank_pattern"
            if not _is_positive_number(value) or (integral and value != int(value)):
                what = "a positive int" if integral else "a positive finite number"
                raise AdapterFormatError(f"{config_path}: {key}[{pattern!r}] must be {what}, got {value!r}")
    return config


def load_peft_adapter(path: str | Path) -> PeftAdapter:
    """Read a PEFT LoRA adapter directory; tensors stay on the CPU in their saved dtype."""
    if not isinstance(path, (str, Path)) and not hasattr(path, "__fspath__"):
        raise TypeError(f"path must be a str or os.PathLike naming an adapter directory, got {type(path).__name__}")
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"adapter directory {path} does not exist")
    config = _read_config(path)
    tensors = read_adapter_tensors(path)

    pairs: dict[str, dict[str, torch.Tensor]] = {}
    kinds: dict[str, str] = {}
    magnitudes: dict[str, torch.Tensor] = {}
    saved_modules = _saved_modules(path, config, tensors)
    adapter_keys = {k for k in tensors if not _saved_key(config, k)}
    base_weights = sorted(k for k in adapter_keys if k.endswith(".weight") and "lora_" not in k)
    check_finite_weights(path, {k: v for k, v in tensors.items() if k not in base_weights})
    tensors = {k: tensors[k] for k in adapter_keys}
    if base_weights:
        # PEFT's save_embedding_layers stores full embedding / LM-head weights next to the
        # adapter; they are the base model's, which the serving model already holds
        warnings.warn(f"{path}: ignoring base-model weights saved with the adapter: {', '.join(base_weights)}",
                      stacklevel=2)
    for key, tensor in tensors.items():
        if key in base_weights:
            continue
        if key.endswith(_MAGNITUDE):
            module = key[: -len(_MAGNITUDE)]
            magnitudes[module[len(_PREFIX):] if module.startswith(_PREFIX) else module] = tensor
            continue
        for suffix, (kind, side) in _SUFFIXES.items():
            if key.endswith(suffix):
                module = key[: -len(suffix)]
                module = module[len(_PREFIX):] if module.startswith(_PREFIX) else module
                if not module:
                    raise AdapterFormatError(f"{path}: tensor {key!r} names no module")
                if kinds.setdefault(module, kind) != kind:
                    raise AdapterFormatError(
                        f"{path}: module {module!r} has both linear (lora_A/lora_B) and embedding "
                        "(lora_embedding_A/B) weights"
                    )
                if side in pairs.setdefault(module, {}):
                    raise AdapterFormatError(f"{path}: module {module!r} has two LoRA {side.upper()} weights "
                                             f"(with and without the {_PREFIX!r} prefix?)")
                if module in saved_modules:
                    raise AdapterFormatError(f"{path}: module {module!r} has LoRA weights and is saved whole "
                                             "(modules_to_save); PEFT trains a saved module without LoRA")
                pairs[module][side] = tensor
                break
        else:
            raise AdapterFormatError(
                f"{path}: unsupported tensor {key!r} (expected lora_A/lora_B or lora_embedding_A/B weights)"
            )
    if not pairs:
        raise AdapterFormatError(f"{path}: the adapter holds no LoRA weights")

    from .parameter_targets import split_parameter_pairs

    parameter_pairs = split_parameter_pairs(path, config, pairs)
    _check_magnitudes(path, bool(config.get("use_dora", False)), pairs, kinds, magnitudes)
    use_rslora = bool(config.get("use_rslora", False))
    rank_pattern = config.get("rank_pattern") or {}
    alpha_pattern = config.get("alpha_pattern") or {}
    modules: dict[str, LoRAModuleWeights] = {}
    for module, pair in sorted(pairs.items()):
        if set(pair) != {"a", "b"}:
            missing = "B" if "a" in pair else "A"
            raise AdapterFormatError(f"{path}: module {module!r} has no LoRA {missing} weight")
        a, b = pair["a"], pair["b"]
        if (a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or a.shape[0] == 0
                or not a.is_floating_point() or not b.is_floating_point()):
            raise AdapterFormatError(
                f"{path}: module {module!r} has LoRA weights of shapes {tuple(a.shape)} and {tuple(b.shape)}; "
                "expected A (r, in) and B (out, r) with the same r"
            )
        rank = a.shape[0]
        declared = _pattern_value(rank_pattern, module, config["r"])
        if declared != rank:
            raise AdapterFormatError(
                f"{path}: module {module!r} has rank {rank} but adapter_config.json declares r = {declared}"
            )
        alpha = _pattern_value(alpha_pattern, module, config["lora_alpha"])
        scaling = peft_scaling(alpha, rank, use_rslora)
        if not abs(scaling) <= FLOAT32_MAX:
            raise AdapterFormatError(
                f"{path}: module {module!r} has scaling {scaling!r} (lora_alpha {alpha!r}, r {rank}), "
                "which is not finite in float32"
            )
        modules[module] = LoRAModuleWeights(
            name=module,
            kind=kinds[module],
            lora_a=a,
            lora_b=b,
            scaling=scaling,
            magnitude=magnitudes.get(module),
        )
    return PeftAdapter(path=path, config=config, modules=modules, parameter_pairs=parameter_pairs,
                       saved_modules=saved_modules)


def _check_magnitudes(path: Path, use_dora: bool, pairs: dict, kinds: dict[str, str],
                      magnitudes: dict[str, torch.Tensor]) -> None:
    """DoRA: every module of a ``use_dora`` adapter has a magnitude vector ``(out,)`` (its
    ``lora_B``'s rows) and no other adapter has one."""
    if not use_dora:
        if magnitudes:
            raise AdapterFormatError(f"{path}: DoRA magnitude vectors ({', '.join(sorted(magnitudes))}) in an "
                                     "adapter whose adapter_config.json does not set use_dora")
        return
    for module in sorted(set(magnitudes) - set(pairs)):
        raise AdapterFormatError(f"{path}: DoRA magnitude vector for module {module!r}, which has no LoRA weights")
    for module in sorted(pairs):
        m, b = magnitudes.get(module), pairs[module].get("b")
        if m is None:
            raise AdapterFormatError(f"{path}: module {module!r} of a DoRA adapter (use_dora) has no "
                                     "lora_magnitude_vector")
        if b is not None and (m.shape != (b.shape[0],) or not m.is_floating_point()):
            raise AdapterFormatError(f"{path}: module {module!r} has a lora_magnitude_vector of shape "
                                     f"{tuple(m.shape)}; expected ({b.shape[0]},), one per output feature")


def _saved_key(config: dict, key: str) -> tuple[str, str] | None:
    """``(module, "weight" | "bias")`` when tensor ``key`` is a parameter of one of the
    adapter's ``modules_to_save`` (saved as ``base_model.model.<module>.<param>``), else ``None``."""
    module, _, param = key.removeprefix(_PREFIX).rpartition(".")
    if param in ("weight", "bias") and "lora_" not in key and module and is_saved_module(config, module):
        return module, param
    return None


def _saved_modules(path: Path, config: dict, tensors: dict[str, torch.Tensor]) -> dict[str, SavedModuleWeights]:
    """The adapter's ``modules_to_save`` copies, each a floating-point ``weight`` (2-D) and
    an optional ``bias`` with one entry per weight row; ``AdapterFormatError`` otherwise."""
    params: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        hit = _saved_key(config, key)
        if hit is not None:
            params.setdefault(hit[0], {})[hit[1]] = tensor
    saved = {}
    for module, p in sorted(params.items()):
        weight, bias = p.get("weight"), p.get("bias")
        if weight is None or weight.dim() != 2 or not weight.is_floating_point():
            shape = None if weight is None else tuple(weight.shape)
            raise AdapterFormatError(f"{path}: saved module {module!r} (modules_to_save) needs a floating-point 2-D "
                                     f"weight, got {shape}")
        if bias is not None and (bias.shape != weight.shape[:1] or not bias.is_floating_point()):
            raise AdapterFormatError(f"{path}: saved module {module!r} (modules_to_save) has a bias of shape "
                                     f"{tuple(bias.shape)}; expected ({weight.shape[0]},) for its weight of shape "
                                     f"{tuple(weight.shape)}")
        saved[module] = SavedModuleWeights(name=module, weight=weight, bias=bias)
    return saved
