"""lora-kit against PEFT on one Mixtral-shaped mixture-of-experts layer: the LoRA overhead
over the base experts (docs/moe.md).

A random ``MixtralSparseMoeBlock`` (router and fused experts, E = 8, top-2; no
download) with four PEFT adapters of ranks 8 to 32 on ``experts.gate_up_proj`` and
``experts.down_proj`` (``target_parameters``) serves six requests, two of them on
the base model, in two phases: prefill (every request's prompt tokens) and decode
(one token per request). The block is per token, so the requests are one
flattened batch (``MultiLoRA.set_batch``).

Variants: the base block; PEFT with one adapter active on every row (PEFT cannot
mix ``target_parameters`` adapters in one batch, so this is its best case: one
adapter's factors folded into the expert weights); lora-kit eager on each installed
backend, serving the mixed batch. Each round calls every variant once
(``--repeats`` forwards), the order rotating (``lora_core.testing.timing``); a figure
is the median over rounds with its min-max spread, and the LoRA overhead of a
variant is ``time / base time - 1`` per round. Before timing, lora-kit's rows of the
adapter PEFT serves are checked against PEFT's, and its base rows against the base block.

    python examples/bench_moe.py                 # the default sizes, on the CPU
    python examples/bench_moe.py --smoke         # tiny sizes: a check that it runs
    python examples/bench_moe.py --threads 1 --clock thread --json out.json
"""

from __future__ import annotations

import copy
import json
import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from lora_core import available_backends
from lora_core.testing import TOLERANCES
from lora_core.testing.timing import (Interleaved, Spread, add_clock_option, apply_threads, benchmark_parser,
                                     clock_from, format_spread, machine_info, sync_device)

SIZES = {"default": dict(hidden_size=1024, intermediate_size=3584), "smoke": dict(hidden_size=32, intermediate_size=48)}
PROMPT_LEN = {"default": 128, "smoke": 6}
EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]
ADAPTERS = {
    "sql": dict(r=8, lora_alpha=16),
    "chat": dict(r=16, lora_alpha=16, use_rslora=True),
    "code": dict(r=24, lora_alpha=32),
    "math": dict(r=32, lora_alpha=32),
}
ROUTE = ["sql", None, "chat", "code", None, "math"]
PEFT_ADAPTER = "math"
"""The adapter PEFT serves on every row (the largest rank)."""


class MoELayer(nn.Module):
    """One Mixtral MoE block: ``forward(x (T, H)) -> (T, H)``."""

    def __init__(self, config) -> None:
        super().__init__()
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        self.mlp = MixtralSparseMoeBlock(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x[None])[0]


def build(sizes: dict, device: str, workdir: Path):
    """The base layer, PEFT's layer with :data:`PEFT_ADAPTER` active, and one lora-kit layer per backend."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import MixtralConfig

    from lora_layers import MultiLoRA

    torch.manual_seed(0)
    config = MixtralConfig(num_local_experts=8, num_experts_per_tok=2, **sizes)
    base = MoELayer(config).eval()
    with torch.no_grad():
        for p in base.parameters():
            p.normal_(0, p.shape[-1] ** -0.5)
    paths = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, options in ADAPTERS.items():
            model = get_peft_model(copy.deepcopy(base), LoraConfig(target_modules=[], target_parameters=EXPERTS,
                                                                   init_lora_weights=False, **options))
            with torch.no_grad():
                for param_name, param in model.named_parameters():
                    if "lora_B" in param_name:
                        param.mul_(0.1)
            model.save_pretrained(str(workdir / name))
            paths[name] = workdir / name
        peft_model = PeftModel.from_pretrained(copy.deepcopy(base), str(paths[PEFT_ADAPTER])).eval()
    ours = {}
    for backend in available_backends():
        model = copy.deepcopy(base).to(device)
        ours[backend] = (model, MultiLoRA.from_adapters(model, paths, backend=backend))
    return base.to(device), peft_model.to(device), ours


def phase_calls(phase: str, sizes: dict, prompt_len: int, base, peft_model, ours, device: str) -> dict[str, Callable]:
    tokens = prompt_len if phase == "prefill" else 1
    x = torch.randn(len(ROUTE) * tokens, sizes["hidden_size"], generator=torch.Generator().manual_seed(1)).to(device)
    calls = {"base": lambda: base(x), "peft": lambda: peft_model(x)}
    for backend, (model, mlora) in ours.items():
        def call(model=model, mlora=mlora):
            mlora.set_batch([tokens] * len(ROUTE), ROUTE)
            return model(x)
        calls[f"lora-kit {backend}"] = call
    return calls


def check(calls: dict[str, Callable], tokens: int) -> float:
    """lora-kit's rows of :data:`PEFT_ADAPTER` against PEFT's and its base rows against the base
    layer: the largest error relative to max |output| (fp32 tolerance)."""
    with torch.no_grad():
        want = {"peft": calls["peft"]().float().cpu(), "base": calls["base"]().float().cpu()}
        rows = {"peft": [i for i, name in enumerate(ROUTE) if name == PEFT_ADAPTER],
                "base": [i for i, name in enumerate(ROUTE) if name is None]}
        worst = 0.0
        for name, fn in calls.items():
            if not name.startswith("lora-kit"):
                continue
            got = fn().float().cpu()
            for ref, indices in rows.items():
                picked = torch.cat([torch.arange(i * tokens, (i + 1) * tokens) for i in indices])
                scale = max(1.0, want[ref].abs().max().item())
                rtol, atol = TOLERANCES[torch.float32]
                torch.testing.assert_close(got[picked], want[ref][picked], rtol=rtol, atol=atol * scale)
                worst = max(worst, (got[picked] - want[ref][picked]).abs().max().item() / scale)
    return worst


def time_phase(calls: dict[str, Callable], rounds: int, repeats: int, sync, clock) -> dict[str, list[float]]:
    """Seconds per forward of each variant, one sample per interleaved round."""
    timer = Interleaved(list(calls), sync, clock=clock)
    looped = {name: (lambda fn=fn: [fn() for _ in range(repeats)]) for name, fn in calls.items()}
    with torch.no_grad():
        for fn in calls.values():  # warm-up
            fn()
        for _ in range(rounds):
            timer.round(looped)
    return {name: [s / repeats for s in samples] for name, samples in timer.samples.items()}


def summarise(samples: dict[str, list[float]]) -> dict[str, dict]:
    """Per variant: ms per forward and, but for the base, the LoRA overhead per round over that round's base."""
    base = samples["base"]
    rows = {}
    for name, values in samples.items():
        rows[name] = {"ms": Spread.of([v * 1e3 for v in values])}
        if name != "base":
            rows[name]["overhead"] = Spread.of([v / b - 1 for v, b in zip(values, base)])
    return rows


def format_report(results: dict, machine: dict, meta: dict) -> str:
    lines = [f"lora-kit vs PEFT on one Mixtral MoE layer {meta['sizes']}, E = 8, top-2; {len(ROUTE)} requests "
             f"({ROUTE.count(None)} on the base model), prompts of {meta['prompt_len']} tokens; adapters {meta['adapters']} "
             f"on {EXPERTS}; PEFT serves {PEFT_ADAPTER!r} on every row (it cannot mix them)",
             f"machine: {machine['cpu']} ({machine['cpu_count']} cores), torch {machine['torch']}, "
             f"{machine['threads']} threads; device {meta['device']}; load average {meta['load_before']:.2f} before, "
             f"{meta['load_after']:.2f} after",
             f"{'ms of wall-clock time' if meta['clock'] == 'wall' else 'ms of the thread CPU time'}: median (min–max) "
             f"over {meta['rounds']} interleaved rounds of {meta['repeats']} forwards; lora-kit's checked rows vs "
             f"PEFT's and the base layer's: max error {meta['max_rel_error']:.1e} x max|output|", "",
             "| phase | variant | ms per forward | LoRA overhead vs base |", "|---|---|---|---|"]
    for phase, rows in results.items():
        for name, row in rows.items():
            over = format_spread(row["overhead"], "{:+.1%}") if "overhead" in row else ""
            lines.append(f"| {phase} | {name} | {format_spread(row['ms'], '{:.3f}')} | {over} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser("bench_moe", "lora-kit vs PEFT on a Mixtral-shaped mixture-of-experts layer")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--repeats", type=int, default=None, help="forwards per variant per round")
    add_clock_option(parser)
    args = parser.parse_args(argv)
    clock = clock_from(parser, args)
    apply_threads(args.threads)
    size = "smoke" if args.smoke else "default"
    rounds = 3 if args.smoke else args.rounds
    load_before = os.getloadavg()[0]
    sync = sync_device(torch.device(args.device).type)
    results, worst = {}, 0.0
    with tempfile.TemporaryDirectory(prefix="bench-moe-") as tmp:
        base, peft_model, ours = build(SIZES[size], args.device, Path(tmp))
        for phase in ("prefill", "decode"):
            calls = phase_calls(phase, SIZES[size], PROMPT_LEN[size], base, peft_model, ours, args.device)
            worst = max(worst, check(calls, PROMPT_LEN[size] if phase == "prefill" else 1))
            repeats = args.repeats or (1 if args.smoke else (3 if phase == "prefill" else 50))
            results[phase] = summarise(time_phase(calls, rounds, repeats, sync, clock))
    meta = {"sizes": SIZES[size], "prompt_len": PROMPT_LEN[size], "device": args.device, "clock": args.clock,
            "adapters": {n: o["r"] for n, o in ADAPTERS.items()}, "rounds": rounds,
            "repeats": args.repeats or (1 if args.smoke else "3 (prefill) / 50 (decode)"), "load_before": load_before,
            "load_after": os.getloadavg()[0], "max_rel_error": worst}
    machine = machine_info()
    print(format_report(results, machine, meta))
    if args.json:
        as_json = {phase: {name: {k: v.__dict__ for k, v in row.items()} for name, row in rows.items()}
                   for phase, rows in results.items()}
        Path(args.json).write_text(json.dumps({"machine": machine, "meta": meta, "results": as_json}, indent=2,
                                              default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
