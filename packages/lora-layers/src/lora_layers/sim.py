"""``lora-sim``: simulate a multi-LoRA serving run on every installed backend and device.

The default run needs nothing but this package: a small seeded decoder-shaped
model, four synthetic adapters (ranks 8/16/32/64; one rsLoRA; one also
targeting the embedding and the LM head) saved in PEFT's format and loaded back
through the normal loader, a prefill of prompts of different lengths on mixed
adapters (base-model rows included; the LM head sees only each prompt's last
token) and greedy decode steps. Each backend x device row is checked against an
fp32 reference that merges each adapter into a copy of the base model.

    lora-sim                       # the default run, a table on stdout
    lora-sim devices               # what was probed and found
    lora-sim bench                 # the op benchmarks of lora-cuda / lora-ascend
    lora-sim --adapter sql=path/to/peft_dir --model-config '{"hidden_size": 512}'

Exit status: 0 when every row is within SPEC §6 tolerance, 1 when one is not,
2 for bad input (a one-line message, never a traceback).
"""

from __future__ import annotations

import os

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")  # before torch: a driverless torch_npu breaks import

import argparse  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict, dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Sequence  # noqa: E402

import torch  # noqa: E402

from lora_core import AdapterFormatError, available_backends, load_peft_adapter, save_peft_adapter  # noqa: E402
from lora_core.testing import DEVICE_NAMES, TOLERANCES, CaptureError, count_launches, make_device, probe_device  # noqa: E402

from .models import TinyConfig, TinyDecoder  # noqa: E402
from .multilora import MultiLoRA  # noqa: E402

__all__ = ["main", "run_simulation", "SimRow", "Workload", "default_workload"]

PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
DEFAULT_CONFIG = TinyConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                            num_attention_heads=8, num_key_value_heads=2, fused=True, seed=0)


class UsageError(Exception):
    """Bad input: reported in one line with exit status 2."""


# ------------------------------------------------------------------ workload
@dataclass(frozen=True)
class Workload:
    prompt_lens: tuple[int, ...] = (17, 5, 33, 9, 1, 24)
    adapters: tuple[str | None, ...] = ("r8", None, "r16", "r32-rslora", "r64-embed-head", "r8")
    decode_steps: int = 8
    seed: int = 0


def default_workload(adapter_names: Sequence[str]) -> Workload:
    """The default request mix over the given adapters (base-model rows included)."""
    names = list(adapter_names)
    if not names:
        return Workload(adapters=(None,) * len(Workload.prompt_lens))
    picks = [names[i % len(names)] for i in range(5)]
    return Workload(adapters=(picks[0], None, picks[1], picks[2], picks[3], picks[4]))


def make_synthetic_adapters(config: TinyConfig, directory: Path) -> dict[str, Path]:
    """Four PEFT adapters for a model of ``config``: ranks 8/16/32/64, one rsLoRA,
    one also on the embedding and the LM head. Seeded: the same files every run."""
    gen = torch.Generator().manual_seed(1234)
    shapes = {"q_proj": (config.hidden_size, config.num_attention_heads * config.head_dim),
              "k_proj": (config.hidden_size, config.num_key_value_heads * config.head_dim),
              "v_proj": (config.hidden_size, config.num_key_value_heads * config.head_dim),
              "o_proj": (config.num_attention_heads * config.head_dim, config.hidden_size),
              "gate_proj": (config.hidden_size, config.intermediate_size),
              "up_proj": (config.hidden_size, config.intermediate_size),
              "down_proj": (config.intermediate_size, config.hidden_size)}
    specs = {"r8": (8, 16, False, ["q_proj", "v_proj"]),
             "r16": (16, 16, False, ["q_proj", "k_proj", "v_proj", "o_proj"]),
             "r32-rslora": (32, 8, True, PROJECTIONS),
             "r64-embed-head": (64, 32, False, ["q_proj", "v_proj", "down_proj", "embed_tokens", "lm_head"])}
    paths = {}
    for name, (r, alpha, rslora, targets) in specs.items():
        modules, embedding = {}, []
        for layer in range(config.num_hidden_layers):
            for t in targets:
                if t in shapes:
                    fan_in, fan_out = shapes[t]
                    prefix = "self_attn" if t in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                    modules[f"model.layers.{layer}.{prefix}.{t}"] = (
                        torch.randn(r, fan_in, generator=gen) / fan_in**0.5,
                        torch.randn(fan_out, r, generator=gen) / r**0.5 * 0.5)
        if "embed_tokens" in targets:
            modules["model.embed_tokens"] = (torch.randn(r, config.vocab_size, generator=gen) * 0.1,
                                             torch.randn(config.hidden_size, r, generator=gen) / r**0.5)
            embedding.append("model.embed_tokens")
        if "lm_head" in targets:
            modules["lm_head"] = (torch.randn(r, config.hidden_size, generator=gen) / config.hidden_size**0.5,
                                  torch.randn(config.vocab_size, r, generator=gen) / r**0.5 * 0.5)
        paths[name] = save_peft_adapter(directory / name, modules, r=r, lora_alpha=alpha, use_rslora=rslora,
                                        embedding_modules=tuple(embedding))
    return paths


# ----------------------------------------------------------------- reference
def merged_reference_models(base: TinyDecoder, adapter_paths: dict[str, Path]) -> dict[str | None, TinyDecoder]:
    """fp32 copies of ``base`` with each adapter merged into its weights (``W + s * B @ A``)."""
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
            packed = next((p for p, parts in PACKED.items() if last in parts), None)
            key = f"{module}.weight"
            if key not in params and packed is not None:
                fused = params[f"{parent}.{packed}.weight"]
                parts = PACKED[packed]
                widths = _packed_widths(merged.config, packed)
                start = sum(widths[: parts.index(last)])
                fused.data[start : start + widths[parts.index(last)]] += delta
            else:
                params[key].data += delta
        models[name] = merged
    return models


def _packed_widths(config: TinyConfig, packed: str) -> list[int]:
    if packed == "qkv_proj":
        return [config.num_attention_heads * config.head_dim] + [config.num_key_value_heads * config.head_dim] * 2
    return [config.intermediate_size] * 2


def reference_logits(models: dict, ids: torch.Tensor, seq_lens: Sequence[int], adapters: Sequence[str | None],
                     last_only: bool) -> torch.Tensor:
    rows, start = [], 0
    with torch.no_grad():
        for n, name in zip(seq_lens, adapters):
            logits = models[name](ids[start : start + n].cpu())
            rows.append(logits[-1:] if last_only else logits)
            start += n
    return torch.cat(rows)


# --------------------------------------------------------------------- a run
@dataclass
class SimRow:
    backend: str
    device: str
    status: str  # "pass", "fail", "skipped", "error"
    reason: str = ""
    max_abs_error: float | None = None
    tolerance: str = ""
    prefill_tokens_per_s: float | None = None
    decode_tokens_per_s: float | None = None
    lora_overhead: float | None = None
    launches_per_decode_step: int | None = None
    graph_safety: str = ""
    details: dict = field(default_factory=dict)


def _sync(device) -> None:
    if device.torch_device.type == "cuda":
        torch.cuda.synchronize()


def _median_seconds(fn, device, repeats: int = 5) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _forward_prefill(model: TinyDecoder, ids: torch.Tensor, last_rows: torch.Tensor) -> torch.Tensor:
    """Prefill with LM-head pruning: the head sees the last token of each prompt only."""
    hidden = model.model(ids)
    return model.lm_head(hidden.index_select(0, last_rows))


def run_row(backend: str, device_name: str, config: TinyConfig, adapter_paths: dict[str, Path],
            workload: Workload, references: dict) -> SimRow:
    probe = probe_device(device_name)
    if not probe.available:
        return SimRow(backend, device_name, "skipped", reason=probe.reason)
    device = make_device(device_name)
    dev = device.torch_device
    torch.manual_seed(workload.seed)
    model = TinyDecoder(config).to(dev)
    base_model = copy.deepcopy(model)
    targets = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj", "embed_tokens", "lm_head"] if config.fused else \
        PROJECTIONS + ["embed_tokens", "lm_head"]
    mlora = MultiLoRA(model, targets, max_loras=max(1, len(adapter_paths)), max_rank=64, backend=backend,
                      packed_modules=PACKED if config.fused else None)
    for name, path in adapter_paths.items():
        mlora.load_adapter(name, path)

    gen = torch.Generator().manual_seed(workload.seed)
    lens, adapters = list(workload.prompt_lens), list(workload.adapters)
    prompt_ids = torch.randint(0, config.vocab_size, (sum(lens),), generator=gen)
    last_rows = torch.tensor([sum(lens[: i + 1]) - 1 for i in range(len(lens))])
    errors, within = [], []
    rtol, atol = TOLERANCES[torch.float32]

    def compare(got: torch.Tensor, want: torch.Tensor) -> None:
        got = got.float().cpu()
        errors.append((got - want).abs().max().item())
        within.append(bool(torch.isclose(got, want, rtol=rtol, atol=atol).all()))

    with torch.no_grad():
        # prefill (eager in every mode: graphs are captured for decode steps), after a warm-up pass
        mlora.set_batch(lens, adapters)
        prompt_dev, last_dev = prompt_ids.to(dev), last_rows.to(dev)
        logits = _forward_prefill(model, prompt_dev, last_dev)
        prefill_s = _median_seconds(lambda: _forward_prefill(model, prompt_dev, last_dev), device)
        base_prefill_s = _median_seconds(lambda: _forward_prefill(base_model, prompt_dev, last_dev), device)
        compare(logits, reference_logits(references, prompt_ids, lens, adapters, last_only=True))

        # decode: one token per request per step, greedy
        B = len(lens)
        step_ids = torch.empty(B, dtype=torch.long, device=dev)
        step_ids.copy_(logits.argmax(-1))
        verdict = "eager"
        if device.is_graph:
            mlora.enable_graph(B)
        mlora.set_batch([1] * B, adapters)
        decode_fn = model
        launches = count_launches(decode_fn, step_ids).ops
        if device.is_graph:
            try:
                static_out, replay = device.capture(decode_fn, step_ids)
            except CaptureError as err:
                return SimRow(backend, device_name, "fail", reason=str(err), graph_safety=f"unsafe: {err}")
            verdict = "safe (strict simulated capture)" if device_name == "cpu-graphsim" else "captured"
        step_s, base_step_s = [], []
        rotated = list(adapters)
        for _ in range(workload.decode_steps):
            rotated = rotated[1:] + rotated[:1]  # a different adapter mix every step
            mlora.set_batch([1] * B, rotated)
            start = time.perf_counter()
            if device.is_graph:
                replay()
                out = static_out
            else:
                out = model(step_ids)
            _sync(device)
            step_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            base_model(step_ids)
            _sync(device)
            base_step_s.append(time.perf_counter() - start)
            compare(out, reference_logits(references, step_ids.cpu(), [1] * B, rotated, last_only=False))
            step_ids.copy_(out.argmax(-1))
    mlora.unwrap()
    return SimRow(
        backend, device_name, "pass" if all(within) else "fail",
        max_abs_error=max(errors), tolerance=f"fp32 rtol={rtol:g} atol={atol:g}",
        prefill_tokens_per_s=sum(lens) / prefill_s,
        decode_tokens_per_s=B / statistics.median(step_s),
        lora_overhead=(prefill_s + statistics.median(step_s)) / (base_prefill_s + statistics.median(base_step_s)) - 1,
        launches_per_decode_step=launches, graph_safety=verdict,
    )


def run_simulation(backends: Sequence[str], devices: Sequence[str], config: TinyConfig,
                   adapter_paths: dict[str, Path], workload: Workload, progress: bool = True) -> list[SimRow]:
    references = merged_reference_models(TinyDecoder(config), adapter_paths)
    rows = []
    jobs = [(b, d) for b in backends for d in devices]
    started = time.perf_counter()
    progress = progress and sys.stderr.isatty()
    for i, (backend, device_name) in enumerate(jobs):
        if progress and time.perf_counter() - started > 2.0:
            _progress(i, len(jobs), f"{backend} / {device_name}")
        try:
            rows.append(run_row(backend, device_name, config, adapter_paths, workload, references))
        except (ValueError, RuntimeError, TypeError) as err:
            rows.append(SimRow(backend, device_name, "error", reason=f"{type(err).__name__}: {err}"))
    if progress and time.perf_counter() - started > 2.0:
        _progress(len(jobs), len(jobs), "done")
        print(file=sys.stderr)
    return rows


def _progress(done: int, total: int, label: str) -> None:
    width = 24
    filled = width * done // total
    print(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label:<32}", end="", file=sys.stderr,
          flush=True)


# ------------------------------------------------------------------- output
def format_rows(rows: Sequence[SimRow]) -> str:
    head = ("| backend | device | result | max abs err | prefill tok/s | decode tok/s | LoRA overhead "
            "| launches/decode step | graph safety |")
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        if r.status in ("skipped", "error"):
            lines.append(f"| {r.backend} | {r.device} | {r.status}: {r.reason} | | | | | | |")
            continue
        lines.append(
            f"| {r.backend} | {r.device} | {r.status} | {r.max_abs_error:.1e} | {r.prefill_tokens_per_s:,.0f} | "
            f"{r.decode_tokens_per_s:,.0f} | {r.lora_overhead:+.0%} | {r.launches_per_decode_step} | {r.graph_safety} |"
        )
    return "\n".join(lines)


def write_plot(rows: Sequence[SimRow], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'lora-layers[plot]'") from None
    ran = [r for r in rows if r.status in ("pass", "fail")]
    labels = [f"{r.backend}\n{r.device}" for r in ran]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(6, 1.6 * len(ran)), 4))
    ax1.bar(labels, [r.decode_tokens_per_s for r in ran], color="tab:blue")
    ax1.set_title("decode tokens/s")
    ax2.bar(labels, [100 * r.lora_overhead for r in ran], color="tab:orange")
    ax2.set_title("LoRA overhead vs base model (%, prefill + one decode step)")
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", labelsize=7, labelrotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def print_devices() -> None:
    print("| device | found | probe |")
    print("|---|---|---|")
    for name in DEVICE_NAMES:
        probe = probe_device(name)
        print(f"| {name} | {'yes' if probe.available else 'no'} | {probe.reason} |")


def run_benchmarks(smoke: bool) -> int:
    from lora_cuda import bench as cuda_bench

    status = cuda_bench.main(["--smoke"] if smoke else [])
    try:
        from lora_ascend import bench as ascend_bench
    except ImportError:
        print("\nlora-ascend is not installed: its benchmark is skipped")
        return status
    print()
    return status or ascend_bench.main(["--smoke"] if smoke else [])


# ---------------------------------------------------------------------- CLI
def _parse_config(text: str | None) -> TinyConfig:
    if text is None:
        return DEFAULT_CONFIG
    source = Path(text).read_text() if Path(text).is_file() else text
    try:
        values = json.loads(source)
    except json.JSONDecodeError as err:
        raise UsageError(f"--model-config is neither a JSON file nor inline JSON: {err}") from None
    if not isinstance(values, dict):
        raise UsageError("--model-config must be a JSON object, e.g. '{\"hidden_size\": 512}'")
    known = set(TinyConfig.__dataclass_fields__)
    unknown = sorted(set(values) - known)
    if unknown:
        raise UsageError(f"--model-config: unknown keys {unknown}; known: {sorted(known)}")
    config = TinyConfig(**{**DEFAULT_CONFIG.to_dict(), **values})
    if config.hidden_size % config.num_attention_heads or config.num_attention_heads % config.num_key_value_heads:
        raise UsageError("--model-config: hidden_size must divide by num_attention_heads, "
                         "and num_attention_heads by num_key_value_heads")
    return config


def _parse_adapters(specs: Sequence[str]) -> dict[str, Path]:
    adapters = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise UsageError(f"--adapter expects NAME=PATH, got {spec!r}")
        if name in adapters:
            raise UsageError(f"--adapter {name!r} given twice")
        try:
            load_peft_adapter(path)
        except (FileNotFoundError, AdapterFormatError) as err:
            raise UsageError(f"--adapter {name}: {err}") from None
        adapters[name] = Path(path)
    return adapters


def _check_choice(kind: str, given: Sequence[str], known: Sequence[str]) -> list[str]:
    unknown = [g for g in given if g not in known]
    if unknown:
        raise UsageError(f"unknown {kind} {', '.join(map(repr, unknown))}; choose from {', '.join(known)}")
    return list(given) or list(known)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lora-sim", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", nargs="?", choices=["run", "devices", "bench"], default="run",
                        help="run (default): the simulation; devices: the device matrix; bench: op benchmarks")
    parser.add_argument("--adapter", action="append", default=[], metavar="NAME=PATH",
                        help="a PEFT adapter directory to serve (repeatable; default: four synthetic adapters)")
    parser.add_argument("--model-config", metavar="JSON", help="model sizes, a JSON file or inline JSON object")
    parser.add_argument("--backend", action="append", default=[], help="restrict to these backends (repeatable)")
    parser.add_argument("--device", action="append", default=[], help="restrict to these devices (repeatable)")
    parser.add_argument("--decode-steps", type=int, default=Workload.decode_steps, help="decode steps (default 8)")
    parser.add_argument("--json", metavar="PATH", help="write the full results as JSON")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG chart of throughput and overhead (matplotlib)")
    parser.add_argument("--smoke", action="store_true", help="with bench: tiny shapes")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "devices":
            print_devices()
            return 0
        if args.command == "bench":
            return run_benchmarks(args.smoke)
        backends = _check_choice("backend", args.backend, available_backends())
        devices = _check_choice("device", args.device, DEVICE_NAMES)
        config = _parse_config(args.model_config)
        if args.decode_steps < 1:
            raise UsageError("--decode-steps must be at least 1")
        with tempfile.TemporaryDirectory(prefix="lora-sim-") as tmp:
            adapters = _parse_adapters(args.adapter) if args.adapter else make_synthetic_adapters(config, Path(tmp))
            workload = default_workload(list(adapters))
            workload = Workload(workload.prompt_lens, workload.adapters, args.decode_steps, workload.seed)
            _check_adapters_fit(config, adapters)
            rows = run_simulation(backends, devices, config, adapters, workload)
        print(f"lora-sim: model {config.to_dict()}, adapters {list(adapters)}, "
              f"{len(workload.prompt_lens)} prompts of {list(workload.prompt_lens)} tokens, "
              f"{workload.decode_steps} decode steps, torch {torch.__version__}, {torch.get_num_threads()} threads")
        print(format_rows(rows))
        if args.json:
            Path(args.json).write_text(json.dumps({"config": config.to_dict(), "workload": asdict(workload),
                                                   "rows": [asdict(r) for r in rows]}, indent=2))
        if args.plot:
            write_plot(rows, args.plot)
    except UsageError as err:
        print(f"lora-sim: error: {err}", file=sys.stderr)
        return 2
    ran = [r for r in rows if r.status != "skipped"]
    return 0 if ran and all(r.status == "pass" for r in ran) else 1


def _check_adapters_fit(config: TinyConfig, adapters: dict[str, Path]) -> None:
    """Adapters whose modules or shapes do not fit the model config fail here, in one line."""
    model = TinyDecoder(config)
    targets = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj", "embed_tokens", "lm_head"]
    try:
        mlora = MultiLoRA(model, targets if config.fused else PROJECTIONS + ["embed_tokens", "lm_head"],
                          max_loras=max(1, len(adapters)), max_rank=64,
                          packed_modules=PACKED if config.fused else None)
        for name, path in adapters.items():
            mlora.load_adapter(name, path)
    except (ValueError, RuntimeError, FileNotFoundError) as err:
        raise UsageError(str(err)) from None


if __name__ == "__main__":
    raise SystemExit(main())
