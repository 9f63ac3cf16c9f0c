"""``lora-sim``'s outputs: the Markdown tables, the JSON document and the plot."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Callable, Mapping, Sequence

from lora_core.testing import DEVICE_NAMES, probe_device

from ..models import TinyConfig
from .checks import MemoryEstimate
from .errors import UsageError
from .quantize import QUANTIZATIONS, Quantization, quantized_layer_names
from .run import SimRow
from lora_core.testing.timing import Spread
from .workload import Entry, Workload

__all__ = ["format_adapter", "format_compiled_decode", "format_devices", "format_header", "format_quantization",
           "format_requests", "format_rows", "format_spread", "to_json", "write_plot"]


def format_spread(spread: Spread, fmt: Callable[[float], str]) -> str:
    """``median (min–max)``, each number written by ``fmt``."""
    return f"{fmt(spread.median)} ({fmt(spread.minimum)}–{fmt(spread.maximum)})"


def _count(x: float) -> str:
    return f"{x:,.0f}"


def _percent(x: float) -> str:
    return f"{x:+.0%}"


def format_compiled_decode(row: SimRow) -> str:
    """The "compiled decode" cell: on a compile device, the compile backend, the seconds the
    compile took, the compiles and recompiles of the decode step and its tokens/s (median);
    empty on the other devices."""
    c = row.compiled_decode
    if not c:
        return ""
    compiles = "compiled once" if c["compiles"] == 1 else f"{c['compiles']} compiles"
    speed = f", {_count(row.decode_tokens_per_s.median)} tok/s" if row.decode_tokens_per_s is not None else ""
    return f"{c['backend']}: {compiles} in {c['compile_s']:.1f} s, {c['recompiles']} recompiles{speed}"


def format_rows(rows: Sequence[SimRow]) -> str:
    """The results as a Markdown table, one line per row; timed figures as median (min–max) over rounds."""
    head = ("| backend | device | result | max abs err | prefill tok/s | decode tok/s | LoRA overhead "
            "| launches/decode step | graph safety | compiled decode |")
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        if r.status in ("skipped", "error") or r.prefill_tokens_per_s is None:
            lines.append(f"| {r.backend} | {r.device} | {r.status}: {r.reason} | | | | | | | |")
            continue
        lines.append(
            f"| {r.backend} | {r.device} | {r.status} | {r.max_abs_error:.1e} "
            f"| {format_spread(r.prefill_tokens_per_s, _count)} | {format_spread(r.decode_tokens_per_s, _count)} "
            f"| {format_spread(r.lora_overhead, _percent)} | {r.launches_per_decode_step} | {r.graph_safety} "
            f"| {format_compiled_decode(r)} |"
        )
    return "\n".join(lines)


def format_quantization(config: TinyConfig, quantization: Quantization) -> str:
    """The "base weights" line: what ``--quantize`` served the decoder projections as, and how
    the reference was built."""
    if quantization.name == "none":
        return "base weights: fp32 (--quantize none)"
    layers = len(quantized_layer_names(config))
    return (f"base weights: --quantize {quantization.name}, {quantization.describe}, on the {layers} "
            "projections of the decoder layers (everything else fp32); references: fp32 with the "
            "dequantized weights")


def format_adapter(entry: Entry) -> str:
    """A request's adapter as the "requests" line shows it: its name, or a weighted mix as
    ``(0.7 a + 0.4 b)`` (a mix of one adapter too: ``(0.7 a)``); ``base`` for none."""
    if entry is None:
        return "base"
    return entry if isinstance(entry, str) else f"({' + '.join(f'{w:g} {name}' for name, w in entry)})"


def format_requests(workload: Workload) -> str:
    """The "requests" line: each prompt's tokens, adapter or weighted mix and request scale, in order
    (``17 tok r8 x0.5``, ``12 tok (0.7 a + 0.4 b) x0.8``; ``base`` for a request on the base model,
    which has no delta to scale), and what a mix gets when the workload has one."""
    shown = [f"{n} tok {'base' if a is None else f'{format_adapter(a)} x{s:g}'}"
             for n, a, s in zip(workload.prompt_lens, workload.adapters, workload.scales)]
    mixed = any(a is not None and not isinstance(a, str) for a in workload.adapters)
    what = ("adapter or (weighted mix of adapters) x request scale" if mixed else "adapter x request scale")
    gets = "; a mix's request gets scale * sum of weight * delta" if mixed else ""
    return f"requests (prompt tokens, {what}): {', '.join(shown)}{gets}; each decode step rotates them by one request"


def format_header(config: TinyConfig, adapters: Sequence[str], workload: Workload, rounds: int,
                  machine: Mapping[str, Any], memory: MemoryEstimate | None = None,
                  quantization: Quantization = QUANTIZATIONS["none"]) -> str:
    """The lines printed above the table: what was served (each request's adapter and scale, the
    base weights of ``quantization`` among it), how it was timed, on what machine, and (given ``memory``) what one adapter slot holds."""
    gpu = f", {machine['cuda_device']}" if "cuda_device" in machine else ""
    per_slot = [] if memory is None else [f"memory per adapter slot: {memory.per_slot()}"]
    return "\n".join([
        f"lora-sim: model {config.to_dict()}, adapters {list(adapters)}, "
        f"{len(workload.prompt_lens)} prompts of {list(workload.prompt_lens)} tokens, "
        f"{workload.decode_steps} decode steps",
        format_requests(workload),
        format_quantization(config, quantization),
        f"machine: {machine['cpu']} ({machine['cpu_count']} cores){gpu}, torch {machine['torch']}, "
        f"{machine['threads']} threads, Python {machine['python']}",
        f"timings: median (min–max) over {rounds} rounds, the LoRA and the base model interleaved in each",
    ] + per_slot)


def to_json(config: TinyConfig, workload: Workload, rows: Sequence[SimRow], rounds: int,
            machine: Mapping[str, Any], quantization: Quantization = QUANTIZATIONS["none"]) -> dict[str, Any]:
    """The full results as a JSON-able document; ``workload`` has each prompt's length, adapter
    (``null``: the base model; a weighted mix as ``[[name, weight], ...]``) and request scale
    (``prompt_lens``, ``adapters``, ``scales``); each row has ``max_abs_error`` and each request's,
    ``max_abs_error_by_request`` (by prompt); each
    timed figure carries its per-round ``samples`` and each row its raw per-round seconds
    (``details.seconds``). ``quantize`` says
    what base was served: ``{"name", "describe", "layers"}`` (the ``--quantize`` choice, what its
    layers are, the names of the layers it replaced: none for ``none``); each row repeats the name."""
    layers = [] if quantization.name == "none" else quantized_layer_names(config)
    return {"machine": dict(machine), "config": config.to_dict(), "workload": asdict(workload), "rounds": rounds,
            "quantize": {"name": quantization.name, "describe": quantization.describe, "layers": layers},
            "rows": [asdict(r) for r in rows]}


def format_devices() -> str:
    """The device matrix: every device name, whether it was found, and what its probe said."""
    lines = ["| device | found | probe |", "|---|---|---|"]
    for name in DEVICE_NAMES:
        probe = probe_device(name)
        lines.append(f"| {name} | {'yes' if probe.available else 'no'} | {probe.reason} |")
    return "\n".join(lines)


def write_plot(rows: Sequence[SimRow], path: str) -> None:
    """A PNG of decode tokens/s and LoRA overhead per row, bars at the median and
    whiskers at min and max, in the format of ``path``'s suffix. Raises :class:`UsageError`
    without matplotlib (``lora-sim --plot`` checks for it before the run)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("--plot needs matplotlib, which is not installed: pip install matplotlib") from None
    ran = [r for r in rows if r.status in ("pass", "fail") and r.decode_tokens_per_s is not None]
    labels = [f"{r.backend}\n{r.device}" for r in ran]
    fig, axes = plt.subplots(1, 2, figsize=(max(6, 1.6 * len(ran)), 4))
    panels = [("decode_tokens_per_s", 1, "tab:blue", "decode tokens/s"),
              ("lora_overhead", 100, "tab:orange", "LoRA overhead vs base model (%, prefill + one decode step)")]
    for ax, (figure, scale, color, title) in zip(axes, panels):
        spreads = [getattr(r, figure) for r in ran]
        low = [scale * (s.median - s.minimum) for s in spreads]
        high = [scale * (s.maximum - s.median) for s in spreads]
        ax.bar(labels, [scale * s.median for s in spreads], yerr=[low, high], capsize=3, color=color)
        ax.set_title(title, fontsize=9)
        ax.tick_params(axis="x", labelsize=7, labelrotation=20)
    rounds = ran[0].details.get("rounds") if ran else None
    fig.suptitle(f"bars: median, whiskers: min–max over {rounds} interleaved rounds", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
