"""Slot blocks or slot groups: what the eager control plan's two slot layouts cost on one LoRA module.

``torch_native``'s eager control plan (``lora_cuda.control_plan``) runs a batch of short segments either
as **slot groups** (each slot's tokens gathered once, one GEMM per slot and slice) or as **slot
blocks** (the groups padded to the largest one, one ``bmm`` for all slots). One ``bmm`` saves a
GEMM per slot but multiplies its padding rows too; this times both on the same batches, side by
side in interleaved rounds (``lora_core.testing.timing``), on one ``h x h`` module at rank 64 over 4
slots (ranks 8, 16, 32, 64): each round runs every layout once (20 shrink + expand pairs), and a
case's figure is slot blocks' time over slot groups' in the same round, the median over rounds with
its min-max spread. It also prints which layout the plan picks (``SLOT_BLOCKS_MAX_PADDING``,
``SLOT_BLOCKS_PADDING_PER_GEMM``).

    python examples/bench_slot_layouts.py            # h = 256 (lora-sim's width), 15 rounds
    python examples/bench_slot_layouts.py --wide     # h = 1024
    python examples/bench_slot_layouts.py --smoke    # tiny sizes: a check that it runs
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from pathlib import Path
from unittest import mock

import torch

from lora_core import build_batch_info, get_backend
from lora_core.testing import random_linear_weights
from lora_core.testing.timing import Interleaved, Spread, apply_threads, benchmark_parser, format_spread, machine_info
from lora_cuda import control_plan
from lora_cuda.control_plan import ControlPlan

RANKS, SCALINGS = [8, 16, 32, 64], [2.0, 2.0, 1.0, 0.5]
CASES = {  # (seq_lens, slot ids): batches of short segments spread over the 4 slots
    "decode 32, even": ([1] * 32, [i % 4 for i in range(32)]),
    "decode 32, 16/8/4/4": ([1] * 32, [0, 0, 1, 2] * 4 + [0, 0, 1, 3] * 4),
    "decode 32, a quarter mixed": ([1] * 32, [{i % 4: 0.6, (i + 1) % 4: 0.4} if i % 4 == 1 else i % 4
                                              for i in range(32)]),
    "decode 64, 24/24/8/8": ([1] * 64, [0, 1, 0, 1, 0, 1, 2, 3] * 8),
    "prefill 8 x 16, 4/1/1/1": ([16] * 8, [0, 1, 0, 2, 0, 3, 0, None]),
    "prefill 8 x 32, a quarter mixed": ([32] * 8, [None, {1: 0.6, 2: 0.4}, 2, 3, 0, {1: 0.6, 2: 0.4}, 2, 3]),
    "prefill 8 x 32, 3/2/2/1": ([32] * 8, [0, 1, 0, 2, 0, 1, 2, 3]),
}
SMOKE_CASES = {name: CASES[name] for name in ("decode 32, even", "prefill 8 x 32, a quarter mixed")}


FORCE = {"slot blocks": dict(SLOT_BLOCKS_MAX_PADDING=math.inf, SLOT_BLOCKS_PADDING_PER_GEMM=math.inf),
         "slot groups": dict(SLOT_BLOCKS_MAX_PADDING=0.0)}


def planned(backend, seq_lens: list[int], slot_ids: list, layout: str | None, run) -> tuple:
    """The batch, its layout forced to ``layout`` (``None``: the plan's own choice) while its plans are
    built (by one warm-up ``run``), and the control plan its kernels read (a mixed batch's: its pair rows')."""
    info = build_batch_info(seq_lens, slot_ids, RANKS, SCALINGS, device="cpu")
    with mock.patch.multiple(control_plan, **FORCE[layout]) if layout else contextlib.nullcontext():
        backend.prepare_batch(info)
        run(info)
    return info, (info if info.pairs is None else info.pairs.view).plan(ControlPlan)


def layout_of(plan: ControlPlan) -> str:
    return "slot blocks" if plan.slot_blocks is not None else "slot groups" if plan.by_slot else "segments"


def main(argv: list[str] | None = None) -> int:
    parser = benchmark_parser("bench_slot_layouts", __doc__.splitlines()[0])
    parser.add_argument("--wide", action="store_true", help="h = 1024 instead of 256")
    args = parser.parse_args(argv)
    threads = apply_threads(args.threads)
    h = 16 if args.smoke else 1024 if args.wide else 256
    rounds, repeats = (3, 2) if args.smoke else (args.rounds, 20)
    load = os.getloadavg()[0]
    gen = torch.Generator().manual_seed(0)
    a, b, offsets = random_linear_weights(gen, num_slots=4, max_rank=64, in_features=h, slice_widths=[h],
                                          lora_ranks=RANKS, dtype=torch.float32, device="cpu")
    backend = get_backend("torch_native")("cpu")
    results = {}
    for name, (seq_lens, slot_ids) in (SMOKE_CASES if args.smoke else CASES).items():
        T = sum(seq_lens)
        x, base = torch.randn(T, h, generator=gen), torch.randn(T, h, generator=gen)

        def run(info) -> torch.Tensor:
            backend.prepare_batch(info)
            for _ in range(repeats):
                out = backend.run_packed(x, a, b, offsets, base.clone())
            return out

        (blocks, blocks_plan), (groups, groups_plan) = (planned(backend, seq_lens, slot_ids, layout, run)
                                                        for layout in ("slot blocks", "slot groups"))
        _, chosen = planned(backend, seq_lens, slot_ids, None, run)
        assert (layout_of(blocks_plan), layout_of(groups_plan)) == ("slot blocks", "slot groups"), name
        torch.testing.assert_close(run(blocks), run(groups), rtol=1e-4, atol=1e-4)  # the same delta either way
        timer = Interleaved(["slot blocks", "slot groups"])
        for _ in range(rounds):
            timer.round({"slot blocks": lambda: run(blocks), "slot groups": lambda: run(groups)})
        ratio = Spread.of([x / y for x, y in zip(timer.samples["slot blocks"], timer.samples["slot groups"])])
        rows = sum(g.num_tokens for g in groups_plan.groups)
        sb = blocks_plan.slot_blocks
        results[name] = {"rows": rows, "padding": sb.num_blocks * sb.block_size - rows, "slots": sb.num_blocks,
                         "choice": layout_of(chosen), "blocks_over_groups": ratio}
    info = machine_info()
    print(f"bench_slot_layouts: {info['cpu']} ({info['cpu_count']} cores), torch {info['torch']}, {threads} threads; "
          f"load average {load:.2f} before the run; {rounds} rounds; one {h} x {h} module, rank 64, 4 slots")
    for name, r in results.items():
        print(f"{name}: {r['rows']} rows, {r['padding']} padding rows over {r['slots']} slots; slot blocks / slot "
              f"groups {format_spread(r['blocks_over_groups'], '{:.2f}')}; the plan picks {r['choice']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": info, "load": load, "rounds": rounds, "h": h, "results": {
            name: {**r, "blocks_over_groups": vars(r["blocks_over_groups"])} for name, r in results.items()}},
            indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
