"""What weighted adapter mixes cost (issue #40): a decode step and a prefill with and without them, side by side.

lora-layers' ``TinyDecoder`` (Llama-shaped: hidden 256, intermediate 512, vocab 512, 4 layers, unfused
projections; lora-sim's default model is the same width with 2 layers) serves lora-sim's four synthetic
PEFT adapters (ranks 8, 16, 32 and 64, one with rsLoRA, one on the embedding and LM head too),
eagerly, on a decode batch of 32 one-token requests and a prefill of 8 requests of 32 tokens
(every fifth request on the base model, except the mixed ones), with the ``torch_native`` and ``ascend``
backends.
Each round runs every variant once, the order rotating (``lora_core.testing.timing``):

* ``one adapter each``: every request on one adapter (or the base model), which the figures are
  relative to;
* ``a quarter mixed``: every fourth request (8 of 32 at decode, 2 of 8 at prefill) a two-adapter mix
  (``{a: 0.6, b: 0.4}``) of its own adapter and the next one: one more (token, adapter) pair per
  token of those requests.

For each phase the script also prints two readings of the issue's bound, "a mixed batch may cost
its extra (token, adapter) pairs' FLOPs plus 10%":

* ``FLOPs``: ``(1 + extra / (base + lora)) * 1.10``, the pairs' share of the forward's multiply-
  accumulates, as if every product ran at one speed;
* ``LoRA time``: ``1 + share * extra / lora + 0.10``, the pairs' share of the LoRA products at the
  speed the LoRA ops run (``share``: the LoRA ops' share of the batch without mixes' time, from a
  third variant, ``base model``, the batch routed to the base model).

``base`` is the base model's multiply-accumulates (``lora_core.testing.count_launches``), ``lora`` the
batch without mixes' LoRA products and ``extra`` the pair rows', each token at its slot's rank in every
wrapped module: what the rows need, not what a kernel's padding spends.
Figures are each variant's time over ``one adapter each`` in the same round,
as the median over rounds with its min-max spread. The outputs are checked first: the rows of
requests without a mix equal the batch without mixes, and a mixed request's rows differ from its
first adapter's alone.

    python examples/bench_request_mixes.py              # 9 rounds
    python examples/bench_request_mixes.py --wide       # hidden 1024: the base model's share grows
    python examples/bench_request_mixes.py --smoke      # tiny sizes: a check that it runs
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import torch

from lora_core.testing import count_launches
from lora_core.testing.timing import Interleaved, Spread, apply_threads, benchmark_parser, format_spread, machine_info
from lora_layers import MultiLoRA, TinyConfig, TinyDecoder
from lora_layers.layers import EmbeddingWithLoRA
from lora_layers.sim.adapters import make_synthetic_adapters

SIZES = {
    "default": dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4),
    "wide": dict(vocab_size=2048, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4),
    "smoke": dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2),
}
SHAPES = {"default": {"decode": (32, 1), "prefill": (8, 32)}, "smoke": {"decode": (8, 1), "prefill": (4, 5)}}
SHAPES["wide"] = SHAPES["default"]
BACKENDS = ("torch_native", "ascend")
VARIANTS = ("base model", "one adapter each", "a quarter mixed")
WEIGHTS = (0.6, 0.4)


def build(sizes: dict, tmp: Path, backend: str) -> tuple[TinyDecoder, MultiLoRA, list[str]]:
    """The model serving lora-sim's four synthetic adapters on ``backend``, and their names."""
    torch.manual_seed(0)
    config = TinyConfig(**sizes)
    model = TinyDecoder(config).eval()
    paths = make_synthetic_adapters(config, tmp)
    return model, MultiLoRA.from_adapters(model, paths, backend=backend), list(paths)


def batches(names: list[str], requests: int) -> tuple[list, list]:
    """The adapters of ``one adapter each`` (every fifth request on the base model, but never one of
    the mixed ones) and of ``a quarter mixed`` (requests 1, 5, 9, ...: a mix of the request's adapter
    and the next one)."""
    plain = [None if i % 5 == 0 and i % 4 != 1 else names[i % len(names)] for i in range(requests)]
    mixed = [{a: WEIGHTS[0], names[(names.index(a) + 1) % len(names)]: WEIGHTS[1]} if i % 4 == 1 else a
             for i, a in enumerate(plain)]
    return plain, mixed


def lora_macs_per_token(mlora: MultiLoRA) -> dict[str, int]:
    """Each adapter's LoRA multiply-accumulates for one token through every wrapped module, at its slot's
    rank (the shrink over the module's slices and the expand; an embedding's shrink is a lookup)."""
    R = mlora.slots.max_rank
    macs = {}
    for name, slot in mlora.adapters.items():
        r = mlora.slots.lora_ranks[slot]
        total = 0
        for layer in mlora.wrapped.values():
            a, b = layer.buffers.a, layer.buffers.b
            shrink = 0 if isinstance(layer, EmbeddingWithLoRA) else a.shape[1] // R * r * a.shape[2]
            total += shrink + b.shape[1] * r
        macs[name] = total
    return macs


def mac_counts(model, mlora, lens, plain, mixed, ids) -> tuple[int, int, int]:
    """``(base, lora, extra)`` multiply-accumulates: the base model's forward (counted on the batch routed
    to the base model), the LoRA products of the batch without mixes, and those of the mixed batch's
    pair rows (each at its slot's rank in every wrapped module: what the pairs need, not a kernel's padding)."""
    base = count_launches(lambda: forward(model, mlora, lens, [None] * len(lens), ids)).matmul_macs
    per_token = lora_macs_per_token(mlora)
    lora = sum(n * per_token[a] for n, a in zip(lens, plain) if a is not None)
    extra = sum(n * per_token[name] for n, entry in zip(lens, mixed) if isinstance(entry, dict)
                for name in list(entry)[1:])
    return base, lora, extra


def forward(model, mlora, lens, adapters, ids, scales=None):
    """One forward of the batch, the batch set inside the call as a server sets it each step."""
    with torch.no_grad():
        mlora.set_batch(lens, adapters, scales)
        return model(ids)


def check(model, mlora, lens, plain, mixed, ids) -> None:
    """The rows of requests without a mix equal the batch without mixes (within 1e-4 of their magnitude:
    fp32 rounding), and each mixed request's rows differ from its first adapter's alone (by over 1e-2) (the mixes' values against PEFT:
    tests/test_request_mixes_transformers.py)."""
    got, plain_out = forward(model, mlora, lens, mixed, ids), forward(model, mlora, lens, plain, ids)
    for i, (length, entry) in enumerate(zip(lens, mixed)):
        rows = slice(sum(lens[:i]), sum(lens[:i]) + length)
        error = ((got[rows] - plain_out[rows]).abs().max() / plain_out[rows].abs().max()).item()
        same = error <= 1e-4  # other kernel layouts round differently; a mix moves its rows by far more
        if same == isinstance(entry, dict) or (not same and error <= 1e-2):
            raise SystemExit(f"bench_request_mixes: request {i} ({entry!r}) " +
                             ("equals its first adapter alone" if same else "changed in the mixed batch"))


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser("bench_request_mixes", __doc__.splitlines()[0])
    parser.add_argument("--wide", action="store_true", help="a wider model: hidden 1024, intermediate 2816, vocab 2048")
    args = parser.parse_args(argv)
    threads = apply_threads(args.threads)
    size = "smoke" if args.smoke else "wide" if args.wide else "default"
    rounds = 3 if args.smoke else args.rounds
    load = os.getloadavg()[0]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for backend in BACKENDS:
            model, mlora, names = build(SIZES[size], Path(tmp) / backend, backend)
            for phase, (requests, length) in SHAPES[size].items():
                lens = [length] * requests
                plain, mixed = batches(names, requests)
                ids = torch.randint(0, model.config.vocab_size, (requests * length,),
                                    generator=torch.Generator().manual_seed(1))
                check(model, mlora, lens, plain, mixed, ids)
                base_macs, lora_macs, extra_macs = mac_counts(model, mlora, lens, plain, mixed, ids)
                calls = {"base model": lambda: forward(model, mlora, lens, [None] * requests, ids),
                         "one adapter each": lambda a=plain: forward(model, mlora, lens, a, ids),
                         "a quarter mixed": lambda a=mixed: forward(model, mlora, lens, a, ids)}
                for call in calls.values():
                    call()  # warm up: batches built and cached, plans made
                timer = Interleaved(VARIANTS)
                repeats = 3 if args.smoke else 20
                for _ in range(rounds):
                    timer.round({name: (lambda c=call: [c() for _ in range(repeats)]) for name, call in calls.items()})
                base, plain_t, mixed_t = (timer.samples[name] for name in VARIANTS)
                share = Spread.of([(p - b) / p for p, b in zip(plain_t, base)]).median
                results[(backend, phase)] = {
                    "ratio": Spread.of([m / p for m, p in zip(mixed_t, plain_t)]),
                    "lora_share": share,
                    "extra_lora": extra_macs / lora_macs,
                    "flops_bound": (1 + extra_macs / (base_macs + lora_macs)) * 1.10,
                    "lora_time_bound": 1 + share * extra_macs / lora_macs + 0.10,
                }
    info = machine_info()
    print(f"bench_request_mixes: {info['cpu']} ({info['cpu_count']} cores), torch {info['torch']}, {threads} "
          f"threads; load average {load:.2f} before the run; {rounds} rounds; model {SIZES[size]}")
    for (backend, phase), r in results.items():
        requests, length = SHAPES[size][phase]
        print(f"{backend}, {phase} ({requests} x {length} tokens), a quarter mixed / one adapter each: "
              f"{format_spread(r['ratio'], '{:.3f}')}; bounds: FLOPs {r['flops_bound']:.3f}, LoRA time "
              f"{r['lora_time_bound']:.3f} (LoRA {r['lora_share']:.0%} of the time, pairs +{r['extra_lora']:.0%} "
              f"of its MACs)")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": info, "load": load, "rounds": rounds, "results": {
            f"{backend}/{phase}": {**r, "ratio": vars(r["ratio"])} for (backend, phase), r in results.items()}},
            indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
