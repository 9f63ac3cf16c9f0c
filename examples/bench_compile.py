"""A compiled LoRA decode step against the eager one: docs/compile.md's recipe, timed.

lora-layers' ``TinyDecoder`` (Llama-shaped: hidden 256, 4 layers, every linear
module wrapped) serves four PEFT adapters of ranks 8, 16, 24 and 32 on every
linear module, in a graph-mode batch of 32 decode rows (one token each), every
fifth row on the base model. The same wrapped model runs eagerly and under
``torch.compile(fullgraph=True)`` (inductor where it can generate code, else
``aot_eager``: lora-sim's ``compile_backend_for``; ``--backend`` picks).
The compiled step's logits are checked against the eager step's first. Each round
calls both variants (``--repeats`` steps each), the order rotating
(``lora_core.testing.timing``); the figure is compiled / eager per round, as the
median over rounds with its min-max spread, beside the compile time.

    python examples/bench_compile.py              # on the CPU, 7 rounds
    python examples/bench_compile.py --smoke      # tiny sizes: a check that it runs
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from lora_core import save_peft_adapter
from lora_core.testing import TOLERANCES
from lora_core.testing.timing import (Interleaved, Spread, apply_threads, benchmark_parser, format_spread, machine_info,
                                     sync_device)
from lora_layers import MultiLoRA, TinyConfig, TinyDecoder
from lora_layers.sim.run import COMPILE_BACKENDS, compile_backend_for

SIZES = {
    "default": dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4),
    "smoke": dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2),
}
RANKS = (8, 16, 24, 32)
ROWS = {"default": 32, "smoke": 8}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build(sizes: dict, rows: int, device: str, tmp: Path) -> tuple[TinyDecoder, torch.Tensor]:
    """The wrapped model with its four adapters loaded and a graph-mode decode batch set, and its input ids."""
    torch.manual_seed(0)
    model = TinyDecoder(TinyConfig(**sizes)).to(device).eval()
    linears = {n: m for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in TARGETS}
    mlora = MultiLoRA(model, TARGETS, max_loras=len(RANKS), max_rank=max(RANKS))
    for i, r in enumerate(RANKS):
        weights = {n: (torch.randn(r, m.in_features) / 8, torch.randn(m.out_features, r) / 8)
                   for n, m in linears.items()}
        mlora.load_adapter(f"a{i}", save_peft_adapter(tmp / f"a{i}", weights, r=r, lora_alpha=2 * r))
    mlora.enable_graph(max_tokens=rows)
    mlora.set_batch([1] * rows, [None if t % 5 == 0 else f"a{t % len(RANKS)}" for t in range(rows)])
    return model, torch.randint(0, sizes["vocab_size"], (rows,), device=device)


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser("bench_compile", "a compiled LoRA decode step against the eager one")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--backend", choices=COMPILE_BACKENDS, default="auto",
                        help="torch.compile backend (default auto: inductor where it can generate code)")
    parser.add_argument("--repeats", type=int, default=None, help="steps per variant per round (default 20)")
    args = parser.parse_args(argv)
    apply_threads(args.threads)
    size = "smoke" if args.smoke else "default"
    rounds = 3 if args.smoke else args.rounds
    repeats = args.repeats or (2 if args.smoke else 20)
    try:
        backend, why = compile_backend_for(args.backend, torch.device(args.device).type)
    except ValueError as err:
        parser.error(str(err))
    load_before = os.getloadavg()[0]
    sync = sync_device(torch.device(args.device).type)
    with tempfile.TemporaryDirectory(prefix="bench-compile-") as tmp, torch.inference_mode():
        model, ids = build(SIZES[size], ROWS[size], args.device, Path(tmp))
        want = model(ids)
        compiled = torch.compile(model, fullgraph=True, backend=backend)
        started = time.perf_counter()
        got = compiled(ids)
        sync()
        compile_s = time.perf_counter() - started
        rtol, atol = TOLERANCES[torch.float32]
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol * max(1.0, want.abs().max().item()))

        def steps(fn):
            return lambda: [fn(ids) for _ in range(repeats)]

        timer = Interleaved(["eager", "compiled"], sync)
        for _ in range(rounds):
            timer.round({"eager": steps(model), "compiled": steps(compiled)})
    seconds = timer.samples
    ratio = Spread.of([c / e for c, e in zip(seconds["compiled"], seconds["eager"])])
    ms = {name: Spread.of([s / repeats * 1e3 for s in values]) for name, values in seconds.items()}
    machine = machine_info()
    print(f"# compiled / eager decode step: TinyDecoder {SIZES[size]}, {ROWS[size]} decode rows, adapters of ranks "
          f"{list(RANKS)} on every linear module")
    print(f"# {machine['cpu']}, torch {machine['torch']}, {torch.get_num_threads()} threads, device {args.device}; "
          f"{rounds} rounds x {repeats} steps; load average {load_before:.2f} before, "
          f"{os.getloadavg()[0]:.2f} after")
    print(f"compile backend: {backend} ({why}); first call (compile) {compile_s:.1f} s")
    print(f"eager step:    {format_spread(ms['eager'], '{:.2f}', ' ms')}")
    print(f"compiled step: {format_spread(ms['compiled'], '{:.2f}', ' ms')}")
    print(f"compiled / eager: {format_spread(ratio, '{:.2f}', 'x')}")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine, "backend": backend, "why": why,
                                               "compile_s": compile_s, "ratio": ratio.__dict__,
                                               "step_ms": {k: v.__dict__ for k, v in ms.items()},
                                               "seconds": seconds}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
