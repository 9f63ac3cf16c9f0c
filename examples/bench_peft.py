"""lora-kit against PEFT on one transformers model: the LoRA overhead over the base model.

A random Llama-shaped ``LlamaForCausalLM`` (hidden 1024, 4 layers; no download)
with four PEFT adapters of ranks 8 to 32 on every linear module (one of them
rsLoRA) serves batches in which a quarter of the rows are on the base model and
some prompts are left-padded, in two phases:

* prefill: one forward of 8 padded prompts of 128 tokens, the LM head on each
  row's last token (what ``generate()`` runs first);
* decode: one KV-cache step of one token on each of 64 rows, after a prefill of
  their prompts (the cache is cropped back after each step, so every step is the same).

Variants: the base model without LoRA; PEFT (``model(..., adapter_names=[...])``,
its mixed-batch inference); lora-kit eager on each installed backend
(``MultiLoRA.from_adapters`` + ``route``). Each round calls every variant once
(``--repeats`` forwards), the order rotating (``lora_core.testing.timing``); a
figure is the median over rounds with its min-max spread. The LoRA overhead of
a variant is ``time / base time - 1`` per round, and the ratio of lora-kit's
overhead to PEFT's is the ratio of their medians. lora-kit's logits are checked
against PEFT's before timing.

lora-kit's graph mode (a captured decode step) needs CUDA graphs and a static
KV cache; this script times eager forwards only.

    python examples/bench_peft.py                 # the default sizes, on the CPU
    python examples/bench_peft.py --smoke         # tiny sizes: a check that it runs
    python examples/bench_peft.py --device cuda --json out.json
    python examples/bench_peft.py --threads 1 --clock thread    # CPU time: robust on a busy machine
"""

from __future__ import annotations

import copy
import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable

import torch

from lora_core import available_backends
from lora_core.testing.timing import (Interleaved, Spread, add_clock_option, apply_threads, benchmark_parser,
                                     clock_from, format_spread, machine_info, sync_device)

SIZES = {
    "default": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
                    num_key_value_heads=8, vocab_size=8192),
    "smoke": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128),
}
PROMPT_LEN = {"default": 128, "smoke": 8}
ADAPTERS = {
    "r8": dict(r=8, lora_alpha=16, use_rslora=True, target_modules="all-linear"),
    "r16": dict(r=16, lora_alpha=32, target_modules="all-linear"),
    "r24": dict(r=24, lora_alpha=24, target_modules="all-linear"),
    "r32": dict(r=32, lora_alpha=64, target_modules="all-linear"),
}
PREFILL_ROUTE = ["r8", None, "r16", "r24", "r32", None, "r16", "r8"]
ROUTES = {"prefill": PREFILL_ROUTE, "decode": PREFILL_ROUTE * 8}
"""Each phase's rows: an adapter name, or ``None`` for the base model."""
TARGETS = {"torch_native": {"prefill": 1 / 2, "decode": 1 / 3}, "ascend": {"prefill": 1.0, "decode": 1.0}}
"""Per backend and phase: its LoRA overhead is to be at most this fraction of PEFT's."""


def build(sizes: dict, device: str, workdir: Path):
    """The base model, the PEFT model and one lora-kit model per backend, all from one random base."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from lora_layers import MultiLoRA

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(**sizes, pad_token_id=0)).eval()
    names = list(ADAPTERS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(init_lora_weights=False, **ADAPTERS[names[0]]),
                                    adapter_name=names[0])
        for name in names[1:]:
            peft_model.add_adapter(name, LoraConfig(init_lora_weights=False, **ADAPTERS[name]))
        peft_model.eval().save_pretrained(str(workdir), selected_adapters=names)
    paths = {name: workdir / name for name in names}
    ours = {}
    for backend in available_backends():
        model = copy.deepcopy(base).to(device)
        ours[backend] = (model, MultiLoRA.from_adapters(model, paths, backend=backend))
    return base.to(device), peft_model.to(device), ours


def inputs(vocab: int, rows: int, length: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` prompts of ``length`` random ids and their attention mask; rows 2 and 5 of
    every 8 are left-padded (by a quarter and a half of ``length``)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (rows, length), generator=g)
    mask = torch.ones_like(ids)
    for first, pad in [(2, length // 4), (5, length // 2)]:  # left padding
        mask[first::8, :pad] = 0
        ids[first::8, :pad] = 0
    return ids.to(device), mask.to(device)


def routed(model, route: list[str | None] | None, mlora=None) -> Callable[..., object]:
    """``model``'s forward with each row on its ``route`` entry: the base model for
    ``route=None``; PEFT's ``adapter_names`` (``None`` -> ``"__base__"``) without ``mlora``;
    lora-kit's ``mlora.route`` with it."""
    if route is None:
        return model
    if mlora is None:
        names = [name or "__base__" for name in route]
        return lambda **kw: model(adapter_names=names, **kw)

    def forward(**kw):
        with mlora.route(route):
            return model(**kw)

    return forward


def prefill(forward, ids, mask, config) -> Callable[[], torch.Tensor]:
    """One forward of the prompts, the LM head on each row's last token."""
    return lambda: forward(input_ids=ids, attention_mask=mask, logits_to_keep=1, use_cache=False).logits


def decode(forward, ids, mask, config) -> Callable[[], torch.Tensor]:
    """One decode step after a prefill of ``ids``; the cache (for a model of ``config``) is
    cropped back after each step."""
    from transformers import DynamicCache

    try:
        cache = DynamicCache(config=config)
    except TypeError:  # transformers before 4.56
        cache = DynamicCache()
    with torch.no_grad():
        forward(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    step_ids = ids[:, -1:].clone()
    step_mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)

    def call():
        out = forward(input_ids=step_ids, attention_mask=step_mask, past_key_values=cache, use_cache=True)
        cache.crop(-1)
        return out.logits

    return call


def time_phase(calls: dict[str, Callable], rounds: int, repeats: int, sync,
               clock: Callable[[], float] = time.perf_counter) -> dict[str, list[float]]:
    """Seconds per forward of each variant, one sample per interleaved round."""
    for fn in calls.values():  # warm-up
        fn()
    timer = Interleaved(list(calls), sync, clock=clock)

    def repeated(fn):
        def run():
            for _ in range(repeats):
                fn()
        return run

    looped = {name: repeated(fn) for name, fn in calls.items()}
    with torch.no_grad():
        for _ in range(rounds):
            timer.round(looped)
    return {name: [s / repeats for s in samples] for name, samples in timer.samples.items()}


MODEL_TOLERANCE = 1e-4
"""rtol, and atol relative to max |logit|, of lora-kit's fp32 logits against PEFT's: ten times an
op's fp32 tolerance (``lora_core.testing.TOLERANCES``), for four layers of hidden 1024 summed
in other orders (the largest error seen is about 1.2e-5 x max |logit|)."""


def check(calls: dict[str, Callable]) -> float:
    """lora-kit's logits against PEFT's (:data:`MODEL_TOLERANCE`): the largest error relative to max |logit|."""
    with torch.no_grad():
        want = calls["peft"]().float().cpu()
        worst = 0.0
        for name, fn in calls.items():
            if name.startswith("lora-kit"):
                got = fn().float().cpu()
                scale = max(1.0, want.abs().max().item())
                torch.testing.assert_close(got, want, rtol=MODEL_TOLERANCE, atol=MODEL_TOLERANCE * scale)
                worst = max(worst, (got - want).abs().max().item() / scale)
    return worst


def summarise(samples: dict[str, list[float]]) -> dict[str, dict]:
    """Per variant: ms per forward and the LoRA overhead (per round, over that round's base), as
    spreads; for lora-kit, ``vs_peft``: its median overhead over PEFT's (``None`` if PEFT's is not positive)."""
    base = samples["base"]
    rows = {}
    for name, values in samples.items():
        row: dict = {"ms": Spread.of([v * 1e3 for v in values])}
        if name != "base":
            row["overhead"] = Spread.of([v / b - 1 for v, b in zip(values, base)])
        rows[name] = row
    peft_over = rows["peft"]["overhead"].median
    for name, row in rows.items():
        if name.startswith("lora-kit"):
            row["vs_peft"] = row["overhead"].median / peft_over if peft_over > 0 else None
    return rows


def wait_for_quiet(limit_s: float) -> float:
    """Wait up to ``limit_s`` for the 1-minute load average to drop below 1; returns it."""
    deadline = time.monotonic() + limit_s
    load = os.getloadavg()[0]
    while load >= 1 and time.monotonic() < deadline:
        time.sleep(15)
        load = os.getloadavg()[0]
    return load


def format_report(results: dict, machine: dict, meta: dict) -> str:
    batches = ", ".join(f"{phase} {len(route)} rows ({route.count(None)} on the base model)"
                        for phase, route in ROUTES.items())
    lines = [f"lora-kit vs PEFT: {meta['model']}; {batches}; prompts of {meta['prompt_len']} tokens; "
             f"adapters {meta['adapters']}",
             f"machine: {machine['cpu']} ({machine['cpu_count']} cores){', ' + machine['cuda_device'] if 'cuda_device' in machine else ''}, "
             f"torch {machine['torch']}, {machine['threads']} threads; device {meta['device']}; "
             f"load average {meta['load_before']:.2f} before, {meta['load_after']:.2f} after",
             f"{'ms of wall-clock time' if meta['clock'] == 'wall' else 'ms of the thread CPU time'}: "
             f"median (min–max) over {meta['rounds']} interleaved rounds of {meta['repeats']} forwards; "
             f"lora-kit's logits vs PEFT's: max error {meta['max_rel_error']:.1e} x max|logit|", "",
             "| phase | variant | ms per forward | LoRA overhead vs base | overhead / PEFT's (medians) |",
             "|---|---|---|---|---|"]
    for phase, rows in results.items():
        for name, row in rows.items():
            over = format_spread(row["overhead"], "{:+.1%}") if "overhead" in row else ""
            ratio = row.get("vs_peft")
            ratio_text = "" if name in ("base", "peft") else ("n/a" if ratio is None else f"{ratio:.2f}")
            lines.append(f"| {phase} | {name} | {format_spread(row['ms'], '{:.2f}')} | {over} | {ratio_text} |")
    lines.append("")
    for name in results["prefill"]:
        if not name.startswith("lora-kit "):
            continue
        backend = name.removeprefix("lora-kit ")
        for phase in results:
            target = TARGETS.get(backend, {}).get(phase)
            ratio = results[phase][name]["vs_peft"]
            if target is None:
                lines.append(f"target ({phase}, {name}): none set for this backend")
                continue
            verdict = "n/a (PEFT's overhead is not positive)" if ratio is None else (
                f"{'met' if ratio <= target else 'not met'} ({ratio:.2f})")
            lines.append(f"target ({phase}, {name}): LoRA overhead at most {target:.2f} of PEFT's: {verdict}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser("bench_peft", "lora-kit vs PEFT's mixed-batch inference on a transformers model")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--repeats", type=int, default=None, help="forwards per variant per round")
    add_clock_option(parser)
    parser.add_argument("--wait-quiet", type=float, default=0.0, metavar="S",
                        help="first wait up to S seconds for the load average to drop below 1")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers renaming past_key_values
    clock = clock_from(parser, args)
    apply_threads(args.threads)
    size = "smoke" if args.smoke else "default"
    rounds = 3 if args.smoke else args.rounds
    load_before = wait_for_quiet(args.wait_quiet) if args.wait_quiet else os.getloadavg()[0]
    sync = sync_device(torch.device(args.device).type)
    with tempfile.TemporaryDirectory(prefix="bench-peft-") as tmp:
        base, peft_model, ours = build(SIZES[size], args.device, Path(tmp))
        results, worst = {}, 0.0
        for phase, make in [("prefill", prefill), ("decode", decode)]:
            route = ROUTES[phase]
            ids, mask = inputs(SIZES[size]["vocab_size"], len(route), PROMPT_LEN[size], args.device)
            calls = {"base": make(routed(base, None), ids, mask, base.config),
                     "peft": make(routed(peft_model, route), ids, mask, base.config)}
            for backend, (model, mlora) in ours.items():
                calls[f"lora-kit {backend}"] = make(routed(model, route, mlora), ids, mask, base.config)
            worst = max(worst, check(calls))
            repeats = args.repeats or (1 if args.smoke else (2 if phase == "prefill" else 20))
            results[phase] = summarise(time_phase(calls, rounds, repeats, sync, clock))
    meta = {"model": f"LlamaForCausalLM {SIZES[size]}", "prompt_len": PROMPT_LEN[size], "adapters": ADAPTERS,
            "routes": ROUTES, "targets": TARGETS,
            "device": args.device, "clock": args.clock, "rounds": rounds, "repeats": args.repeats or "2 (prefill) / 20 (decode)",
            "load_before": load_before, "load_after": os.getloadavg()[0], "max_rel_error": worst}
    machine = machine_info()
    print(format_report(results, machine, meta))
    if args.json:
        as_json = {phase: {name: {k: (v.__dict__ if isinstance(v, Spread) else v) for k, v in row.items()}
                           for name, row in rows.items()} for phase, rows in results.items()}
        Path(args.json).write_text(json.dumps({"machine": machine, "meta": meta, "results": as_json}, indent=2,
                                              default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
