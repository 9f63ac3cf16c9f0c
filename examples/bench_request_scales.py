"""What request scales cost (issue #40): a decode step and a prefill with and without them, side by side.

lora-layers' ``TinyDecoder`` (Llama-shaped: hidden 256, 4 layers) serves lora-sim's four synthetic
PEFT adapters (ranks 8, 16, 32 and 64, one with rsLoRA, one on the embedding and LM head too),
eagerly, on a decode batch of 32 one-token requests and a prefill of 8 requests of 32 tokens
(every fifth request on the base model). Each
round runs every variant once, the order rotating (``lora_core.testing.timing``):

* ``no scales``: the batch without scales (what every caller that does not use them runs; it
  launches the ops it launched before request scales existed), which the figures are relative to;
* ``scales, all 1``: scales given, every one 1.0 (the ops apply them: one elementwise product of
  each shrink's ``T x c*R`` output);
* ``scales``: scales 0.3, 1.0, 1.7 and 0 over the requests.

Figures are each variant's time over ``no scales``' in the same round, as the median over rounds
with its min-max spread. The outputs are checked first: ``scales, all 1`` equals ``no scales``
within fp32 rounding, and a request at scale 0 equals its row routed to the base model, bit for bit.

    python examples/bench_request_scales.py              # 9 rounds
    python examples/bench_request_scales.py --smoke      # tiny sizes: a check that it runs
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import torch

from lora_core.testing.timing import Interleaved, Spread, apply_threads, benchmark_parser, format_spread, machine_info
from lora_layers import MultiLoRA, TinyConfig, TinyDecoder
from lora_layers.sim.adapters import make_synthetic_adapters

SIZES = {
    "default": dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4),
    "smoke": dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2),
}
SHAPES = {"default": {"decode": (32, 1), "prefill": (8, 32)}, "smoke": {"decode": (8, 1), "prefill": (3, 5)}}
VARIANTS = ("no scales", "scales, all 1", "scales")


def build(sizes: dict, tmp: Path) -> tuple[TinyDecoder, MultiLoRA, list[str]]:
    """The model serving lora-sim's four synthetic adapters, and their names."""
    torch.manual_seed(0)
    config = TinyConfig(**sizes)
    model = TinyDecoder(config).eval()
    paths = make_synthetic_adapters(config, tmp)
    return model, MultiLoRA.from_adapters(model, paths), list(paths)


class Calls(dict):
    """The variants' calls by name, with the input ids they run on."""

    def __init__(self, calls: dict, *, ids: torch.Tensor) -> None:
        super().__init__(calls)
        self.ids = ids


def step_calls(model: TinyDecoder, mlora: MultiLoRA, names: list[str], requests: int, length: int) -> tuple:
    """``(calls, seq_lens, adapters, scales)``: one forward of ``requests`` x ``length`` tokens per
    variant (the batch set inside the call, as a server sets it each step; eager batches are cached
    by layout and scales), and the batch the ``scales`` variant runs."""
    lens = [length] * requests
    adapters = [None if i % 5 == 0 else names[i % len(names)] for i in range(requests)]
    mixed = [(0.3, 1.0, 1.7, 0.0)[i % 4] for i in range(requests)]
    ids = torch.randint(0, model.config.vocab_size, (requests * length,), generator=torch.Generator().manual_seed(1))

    def run(scales=None):
        def call():
            with torch.no_grad():
                mlora.set_batch(lens, adapters, scales)
                return model(ids)
        return call

    calls = Calls({"no scales": run(), "scales, all 1": run([1.0] * requests), "scales": run(mixed)}, ids=ids)
    return calls, lens, adapters, mixed



def check(model, mlora, calls, lens, adapters, mixed) -> None:
    """``scales, all 1`` equals ``no scales`` within fp32 rounding; a request at scale 0 equals its row
    routed to the base model in the same batch, bit for bit."""
    if not torch.allclose(calls["scales, all 1"](), calls["no scales"](), rtol=1e-5, atol=1e-5):
        raise SystemExit("bench_request_scales: scales of 1 changed the output")
    scaled = calls["scales"]()
    with torch.no_grad():
        mlora.set_batch(lens, [None if c == 0 else a for a, c in zip(adapters, mixed)], mixed)
        routed = model(calls.ids)
    for i, (length, scale) in enumerate(zip(lens, mixed)):
        rows = slice(sum(lens[:i]), sum(lens[:i]) + length)
        if scale == 0 and not torch.equal(scaled[rows], routed[rows]):
            raise SystemExit(f"bench_request_scales: request {i} at scale 0 is not the base model's output")


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser("bench_request_scales", __doc__.splitlines()[0])
    args = parser.parse_args(argv)
    threads = apply_threads(args.threads)
    size = "smoke" if args.smoke else "default"
    rounds = 3 if args.smoke else args.rounds
    load = os.getloadavg()[0]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model, mlora, names = build(SIZES[size], Path(tmp))
        for phase, (requests, length) in SHAPES[size].items():
            calls, *batch = step_calls(model, mlora, names, requests, length)
            check(model, mlora, calls, *batch)
            for call in calls.values():
                call()  # warm up: batches built and cached, plans made
            timer = Interleaved(VARIANTS)
            repeats = 3 if args.smoke else 20
            for _ in range(rounds):
                timer.round({name: (lambda c=call: [c() for _ in range(repeats)]) for name, call in calls.items()})
            base = timer.samples["no scales"]
            results[phase] = {name: Spread.of([s / b for s, b in zip(timer.samples[name], base)])
                              for name in VARIANTS[1:]}
    info = machine_info()
    print(f"bench_request_scales: {info['cpu']} ({info['cpu_count']} cores), torch {info['torch']}, {threads} "
          f"threads; load average {load:.2f} before the run; {rounds} rounds")
    for phase, figures in results.items():
        requests, length = SHAPES[size][phase]
        cells = ", ".join(f"{name} {format_spread(s, '{:.3f}')}" for name, s in figures.items())
        print(f"{phase} ({requests} x {length} tokens), time / no scales: {cells}")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": info, "load": load, "rounds": rounds, "results": {
            phase: {name: vars(s) for name, s in figures.items()} for phase, figures in results.items()}},
            indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
