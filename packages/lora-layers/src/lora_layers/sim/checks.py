"""``lora-sim``'s input checks, all made before any work starts.

Every value the user gives is checked here: numbers against documented ranges, the
fields of ``--model-config`` one by one, output paths for writability, optional
dependencies for presence, and the memory a run would need against ``--max-memory-gib``.
Each failure is a :class:`~lora_layers.sim.errors.UsageError` of one line that names the
option (or field) and what it accepts; ``lora-sim`` prints it and exits with status 2.
Nothing here imports torch or builds a model.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from .errors import UsageError

__all__ = ["CONFIG_RANGES", "MAX_CONFIG_BYTES", "MAX_DECODE_STEPS", "MAX_MEMORY_GIB", "MAX_ROUNDS", "MIN_ROUNDS",
           "PLOT_SUFFIXES", "MemoryEstimate", "check_config_fields", "check_output_path", "check_plot_support",
           "estimate_memory", "float_in", "int_in", "one_line", "read_config_text"]

MAX_DECODE_STEPS = 1000
"""The most ``--decode-steps`` a run takes."""
MIN_ROUNDS, MAX_ROUNDS = 3, 100
"""``--rounds``: a median and a spread need a few samples; more than 100 measures nothing new."""
MAX_MEMORY_GIB = 4.0
"""The default of ``--max-memory-gib``: a run estimated to need more is refused before it starts."""
MAX_CONFIG_BYTES = 1 << 20
"""A ``--model-config`` file larger than this is not a model config (a transformers config.json is a few KiB)."""
PLOT_SUFFIXES = (".png", ".svg", ".pdf")
"""The formats ``--plot`` writes, by the path's suffix."""

CONFIG_RANGES: dict[str, tuple[int, int]] = {
    "vocab_size": (1, 1 << 20),
    "hidden_size": (1, 1 << 16),
    "intermediate_size": (1, 1 << 18),
    "num_hidden_layers": (1, 512),
    "num_attention_heads": (1, 1024),
    "num_key_value_heads": (1, 1024),
    "seed": (0, 2**63 - 1),
    "num_experts": (0, 256),
    "num_experts_per_tok": (1, 64),
}
"""The accepted range of each integer field of a model config, both ends included
(``num_attention_heads`` must also divide ``hidden_size``, ``num_key_value_heads``
``num_attention_heads``; the memory limit bounds their product further)."""


def one_line(text: str) -> str:
    """``text`` with its line breaks folded, for a one-line error."""
    return " ".join(str(text).split())


def _shown(value: Any) -> str:
    """A value as the user wrote it in JSON (shortened)."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def int_in(low: int, high: int):
    """An argparse ``type``: an integer from ``low`` to ``high``; argparse names the option in its error."""

    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be an integer from {low} to {high}, got {text!r}")
        return value

    return parse


def float_in(low: float, high: float):
    """An argparse ``type``: a number greater than ``low`` and at most ``high``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = None
        if value is None or not low < value <= high:  # NaN fails both comparisons
            raise argparse.ArgumentTypeError(f"must be a number above {low:g} and at most {high:g}, got {text!r}")
        return value

    return parse


def read_config_text(text: str) -> tuple[Any, str]:
    """The parsed JSON of ``--model-config`` and where it came from (``"inline JSON"`` or the file).

    ``text`` starting with ``{`` or ``[`` is inline JSON; anything else is a path, which must be a
    readable UTF-8 file of at most :data:`MAX_CONFIG_BYTES`.
    """
    if text.lstrip()[:1] in ("{", "["):
        source, where = text, "inline JSON"
    else:
        path = Path(text)
        if not path.exists():
            raise UsageError(f"--model-config: no such file: {text} (give a JSON file, or an inline JSON object "
                             "such as '{\"hidden_size\": 512}')")
        if path.is_dir():
            hint = f"; did you mean {path / 'config.json'}?" if (path / "config.json").is_file() else ""
            raise UsageError(f"--model-config: {text} is a directory, not a JSON file{hint}")
        try:
            size = path.stat().st_size
            if size > MAX_CONFIG_BYTES:
                raise UsageError(f"--model-config: {text} is {size:,} bytes; a model config is a JSON file of at "
                                 f"most {MAX_CONFIG_BYTES:,} bytes")
            data = path.read_bytes()
        except OSError as err:
            raise UsageError(f"--model-config: cannot read {text}: {err.strerror or err}") from None
        try:
            source = data.decode("utf-8")
        except UnicodeDecodeError:
            raise UsageError(f"--model-config: {text} is not a text file (a JSON object in UTF-8 is expected)") from None
        where = text
    try:
        return json.loads(source), where
    except json.JSONDecodeError as err:
        raise UsageError(f"--model-config: {where} is not valid JSON: {err}") from None
    except RecursionError:
        raise UsageError(f"--model-config: {where} is nested too deeply to be a model config") from None


def check_config_fields(values: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """``defaults`` overridden by ``values``, each field checked: the integers of
    :data:`CONFIG_RANGES` in range (never a bool, a float or a string), ``fused`` a
    bool, and the head counts dividing what they split."""
    merged = {**defaults, **values}
    for name, (low, high) in CONFIG_RANGES.items():
        value = merged[name]
        if name == "num_attention_heads":  # at most one head per hidden unit (checked just before)
            high = min(high, merged["hidden_size"])
        elif name == "num_key_value_heads":
            high = min(high, merged["num_attention_heads"])
        elif name == "num_experts_per_tok" and _is_int(merged["num_experts"]) and merged["num_experts"] > 0:
            high = min(high, merged["num_experts"])  # top-k of the experts there are
        if not _is_int(value) or not low <= value <= high:
            kind = " (a string)" if isinstance(value, str) else ""
            raise UsageError(f"--model-config: {name} must be an integer from {low} to {high}, "
                             f"got {_shown(value)}{kind}")
    if not isinstance(merged["fused"], bool):
        raise UsageError(f"--model-config: fused must be true or false, got {_shown(merged['fused'])}")
    hidden, heads, kv_heads = merged["hidden_size"], merged["num_attention_heads"], merged["num_key_value_heads"]
    if hidden % heads:
        raise UsageError(f"--model-config: num_attention_heads must divide hidden_size (from 1 to {hidden}), "
                         f"got {heads} for hidden_size {hidden}")
    if heads % kv_heads:
        raise UsageError(f"--model-config: num_key_value_heads must divide num_attention_heads (from 1 to {heads}), "
                         f"got {kv_heads} for num_attention_heads {heads}")
    return merged


def check_output_path(option: str, text: str) -> Path:
    """A path ``option`` will write at the end of the run, checked now: not a directory,
    in an existing directory where a file can be created, and writable if it exists."""
    if not text:
        raise UsageError(f"{option} needs a file path")
    path = Path(text)
    if path.is_dir():
        raise UsageError(f"{option}: {text} is a directory; give a file path")
    parent = path.parent
    if not parent.exists():
        raise UsageError(f"{option}: no such directory: {parent} (create it first)")
    if not parent.is_dir():
        raise UsageError(f"{option}: {parent} is not a directory")
    try:
        if path.exists():
            with open(path, "ab"):  # appends nothing: only whether it can be written
                pass
        else:
            with tempfile.NamedTemporaryFile(dir=parent, prefix=".lora-sim-check-"):
                pass
    except OSError as err:
        raise UsageError(f"{option}: cannot write {text}: {err.strerror or err}") from None
    return path


def check_plot_support(path: Path) -> None:
    """``--plot``: a suffix of :data:`PLOT_SUFFIXES` and matplotlib importable."""
    if path.suffix.lower() not in PLOT_SUFFIXES:
        raise UsageError(f"--plot: {path} must end in {', '.join(PLOT_SUFFIXES[:-1])} or {PLOT_SUFFIXES[-1]}")
    try:
        import matplotlib  # noqa: F401  (pyplot is imported when the plot is drawn)
    except ImportError:
        raise UsageError("--plot needs matplotlib, which is not installed: pip install matplotlib") from None


@dataclass(frozen=True)
class MemoryEstimate:
    """The host memory a ``lora-sim`` run needs at its peak, roughly, in bytes, and how it adds up."""

    model_params: int
    model_copies: int
    lora_buffer_params: int
    adapter_params: int
    activation_params: int
    slots: int = 1
    saved_params_per_slot: int = 0

    @property
    def bytes(self) -> int:
        return 4 * (self.model_params * self.model_copies + self.lora_buffer_params + self.adapter_params
                    + self.activation_params + self.slots * self.saved_params_per_slot)

    def per_slot(self) -> str:
        """What one adapter slot of the served model holds: its LoRA buffers and its copies of
        the modules adapters train whole (``modules_to_save``), fp32."""
        lora = 4 * self.lora_buffer_params / self.slots / 2**20
        return (f"LoRA buffers {lora:,.2f} MiB + saved modules (modules_to_save) "
                f"{4 * self.saved_params_per_slot / 2**20:,.2f} MiB")

    @property
    def gib(self) -> float:
        return self.bytes / 2**30

    def size(self) -> str:
        """The estimate in MiB below 1 GiB, else in GiB."""
        return f"{self.bytes / 2**20:,.0f} MiB" if self.bytes < 2**30 else f"{self.gib:,.1f} GiB"

    def describe(self) -> str:
        return (f"{self.model_copies} fp32 copies of a {self.model_params:.3g}-parameter model, "
                f"LoRA buffers and adapters of {self.lora_buffer_params + self.adapter_params:.3g} parameters")


def _projection_dims(config: Mapping[str, Any]) -> Iterable[tuple[int, int]]:
    """(fan_in, fan_out) of the wrapped modules of one layer (fused or not: the same sums)."""
    h, i = config["hidden_size"], config["intermediate_size"]
    head_dim = h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    return [(h, q + 2 * kv), (q, h), (h, 2 * i), (i, h)]


def estimate_memory(config: Mapping[str, Any], adapter_ranks: Sequence[int], tokens: int,
                    saved_params_per_slot: int = 0, merged_references: int | None = None) -> MemoryEstimate:
    """The peak memory of a run of a model of ``config`` (a :class:`~lora_layers.TinyConfig`
    as a dict) serving adapters of ``adapter_ranks`` on ``tokens`` prefill tokens, with
    ``saved_params_per_slot`` parameters of copies of modules adapters train whole
    (``modules_to_save``) in every slot, checked against ``merged_references`` fp32 reference
    models with an adapter or a weighted mix merged in (one per (adapter or mix, request scale) of the workload;
    ``None``: one per adapter).

    Alive at once: the merged fp32 reference models, the unmerged one and the model they
    are merged from, and a row's model with LoRA and its base copy (``merged_references + 4`` copies);
    the LoRA buffers of one :class:`~lora_layers.MultiLoRA` (every module, embedding and LM
    head included, at the largest rank in every slot); the adapters' weights (each at most
    every module at its rank); and a few logits-sized activations of the prefill.
    """
    h, v, layers = config["hidden_size"], config["vocab_size"], config["num_hidden_layers"]
    experts = max(1, config.get("num_experts", 0))  # a mixture of experts: the MLP (and its LoRA) per expert
    dims = _projection_dims(config)
    counts = [1] * (len(dims) - 2) + [experts] * 2
    per_layer = sum(n * a * b for n, (a, b) in zip(counts, dims)) + 4 * h  # + the two layer norms
    params = 2 * v * h + layers * per_layer + 2 * h
    module_width = layers * sum(n * (a + b) for n, (a, b) in zip(counts, dims)) + 2 * (v + h)
    slots, rank = max(1, len(adapter_ranks)), max(adapter_ranks, default=1)
    width = max(v, 2 * config["intermediate_size"], 3 * h)
    merged = len(adapter_ranks) if merged_references is None else merged_references
    return MemoryEstimate(model_params=params, model_copies=merged + 4,
                          lora_buffer_params=slots * rank * module_width,
                          adapter_params=sum(adapter_ranks) * module_width,
                          activation_params=8 * tokens * width, slots=slots,
                          saved_params_per_slot=saved_params_per_slot)

