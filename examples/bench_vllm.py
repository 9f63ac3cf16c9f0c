"""vLLM's LoRA overhead with its own punica wrapper and with the lora-kit plugin, side by side.

    .venv-vllm/bin/python examples/bench_vllm.py [--rounds N] [--json PATH|-] [--backends A,B] [--quick]

One offline engine (``enforce_eager=True``) per LoRA path, one at a time, on the same tiny
random Llama (hidden 1024, 4 layers, vocabulary 32000; ``--quick``: a small model for a
smoke run) and four all-linear PEFT adapters of ranks 8, 16, 24 and 32, every adapter in a
slot (``max_loras`` 4, ``max_lora_rank`` 32), prefix caching off. Two workloads, a fifth of
their requests on the base model:

* prefill: 8 prompts of 256 tokens, 1 output token each;
* decode: 32 requests of 8 prompt tokens, 32 output tokens each.

In each engine every round runs a workload as given and the same requests without
adapters, alternating which goes first (after one warm-up round of each); the LoRA overhead
of a round is ``time(LoRA) / time(base) - 1``, reported as the median (min-max) over the
rounds. Beside it: the share of the worker's ``execute_model`` time spent in vLLM's per-step
LoRA bookkeeping (``set_active_loras``, which includes the wrapper's ``update_metadata``).
Targets (issue #39): the plugin's overhead at most 1/10 of vLLM's own at prefill and at most
1/3 at decode. Run it on a quiet machine: the 1-minute load average is printed before and
after (after, it includes the engines' own threads), and a load above 1 before is flagged.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from lora_core.testing.timing import Spread, format_spread, machine_info
from lora_vllm.testing import ALL_LINEAR, AdapterSpec, start_engine, write_adapters, write_model

WORKLOADS = {"prefill": (8, 256, 1), "decode": (32, 8, 32)}  # requests, prompt tokens, output tokens
TARGETS = {"prefill": 1 / 10, "decode": 1 / 3}  # of vLLM's own overhead
PATHS = ("vllm",)  # vLLM's own wrapper; the plugin's backends are added from --backends


def _requests(adapters: list[str], count: int, prompt_len: int, vocab: int, rng: random.Random) -> list[dict]:
    """``count`` requests of ``prompt_len`` random tokens; every fifth on the base model, the rest
    on the adapters in turn."""
    return [{"prompt": [rng.randrange(3, vocab) for _ in range(prompt_len)],
             "adapter": None if i % 5 == 4 else adapters[i % len(adapters)]} for i in range(count)]


def _overhead(lora: list[float], base: list[float]) -> Spread:
    """``lora / base - 1`` per round (the two were timed in the same round)."""
    return Spread.of([a / b - 1 for a, b in zip(lora, base)])


def _pct(x: float) -> str:
    return f"{x:+.0%}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per workload (3-50, default 5)")
    parser.add_argument("--backends", default="torch_native,ascend", help="lora-kit backends to run the plugin on")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON (- for stdout)")
    parser.add_argument("--quick", action="store_true", help="a small model and 3 rounds: a smoke run, no figures")
    parser.add_argument("--workdir", type=Path, help="where the model and adapters go (default: a temporary directory)")
    args = parser.parse_args(argv)
    if not 3 <= args.rounds <= 50:
        parser.error(f"--rounds must be 3-50, got {args.rounds}")
    backends = [b for b in args.backends.split(",") if b]
    from lora_core import available_backends

    unknown = sorted(set(backends) - set(available_backends()))
    if unknown:
        parser.error(f"--backends: {', '.join(unknown)} not installed; installed: {', '.join(available_backends())}")
    sizes = (dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, vocab_size=512) if args.quick else
             dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
                  num_key_value_heads=16, vocab_size=32000))
    rounds = 3 if args.quick else args.rounds
    log = sys.stderr

    with tempfile.TemporaryDirectory() as tmp:
        root = args.workdir or Path(tmp)
        model = write_model(root / "model", "llama", max_position_embeddings=512, initializer_range=0.02, **sizes)
        specs = tuple(AdapterSpec(f"all-linear-r{r}", r, tuple(ALL_LINEAR)) for r in (8, 16, 24, 32))
        adapters = {k: str(v) for k, v in write_adapters(model, root / "adapters", specs).items()}
        rng = random.Random(0)
        names = sorted(adapters)
        timed = [{"name": name, "requests": _requests(names, n, p, sizes["vocab_size"], rng), "max_tokens": out}
                 for name, (n, p, out) in WORKLOADS.items()]
        engine = dict(enable_lora=True, max_loras=4, max_lora_rank=32, enforce_eager=True, dtype="float32",
                      max_model_len=512, max_num_seqs=32, max_num_batched_tokens=2048, enable_prefix_caching=False)
        spec = {"model": str(model), "engine": engine, "adapters": adapters, "requests": timed[1]["requests"][:4],
                "max_tokens": 2, "timed": timed, "rounds": rounds}
        load_before = os.getloadavg()[0]
        results = {}
        for path in (*PATHS, *backends):
            print(f"bench_vllm: {path}: starting an engine and timing {rounds} rounds of each workload", file=log)
            t0 = time.perf_counter()
            results[path] = start_engine(spec, None if path == "vllm" else path, root, path)()
            results[path].pop("log")
            print(f"bench_vllm: {path}: done in {time.perf_counter() - t0:.0f} s "
                  f"(engine start {results[path]['start_s']:.0f} s)", file=log)
        load_after = os.getloadavg()[0]

    report = {"machine": {**machine_info(), "load_before": load_before, "load_after": load_after},
              "model": sizes, "engine": engine, "rounds": rounds, "paths": {}}
    for path, result in results.items():
        entry = report["paths"][path] = {"wrapper": result["wrapper"], "start_s": result["start_s"]}
        for name, t in result["timed"].items():
            w = t["worker_s"]
            entry[name] = {"overhead": asdict(_overhead(t["lora"], t["base"])),
                           "lora_s": t["lora"], "base_s": t["base"],
                           "bookkeeping_share": w["set_active_loras"] / w["execute_model"],
                           "update_metadata_share": w["update_metadata"] / w["execute_model"]}
    for backend in backends:
        for name, target in TARGETS.items():
            ours = report["paths"][backend][name]["overhead"]["median"]
            theirs = report["paths"]["vllm"][name]["overhead"]["median"]
            report["paths"][backend][name]["target"] = {"at_most": target * theirs, "met": ours <= target * theirs}

    machine = report["machine"]
    out = sys.stderr if args.json == "-" else sys.stdout  # `--json -`: stdout holds the JSON alone
    show = functools.partial(print, file=out)
    show(f"machine: {machine['cpu']} ({machine['cpu_count']} CPUs), torch {machine['torch']}, Python "
         f"{machine['python']}; load average {load_before:.2f} before, {load_after:.2f} after"
         + ("  (LOADED before the run: figures unreliable)" if load_before > 1 else ""))
    show(f"model: Llama hidden {sizes['hidden_size']}, {sizes['num_hidden_layers']} layers, vocabulary "
         f"{sizes['vocab_size']}; 4 all-linear adapters r 8-32; {rounds} interleaved rounds")
    show("| LoRA path | workload | LoRA overhead median (min–max) | target | bookkeeping share |")
    show("|---|---|---|---|---|")
    for path, entry in report["paths"].items():
        for name in WORKLOADS:
            e = entry[name]
            target = e.get("target")
            met = "" if target is None else f"≤ {_pct(target['at_most'])}: {'met' if target['met'] else 'NOT met'}"
            label = "vLLM's own" if path == "vllm" else f"lora-kit {path}"
            show(f"| {label} | {name} | {format_spread(Spread(**e['overhead']), '{:+.0%}')} | {met} | "
                 f"{e['bookkeeping_share'] * 100:.1f}% |")
    if args.json:
        text = json.dumps(report, indent=1)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
