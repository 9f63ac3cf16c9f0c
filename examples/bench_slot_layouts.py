"""Slot blocks or slot groups: what the eager control plan's slot layouts cost on one LoRA module.

``torch_native``'s eager control plan (``lora_cuda.control_plan``) runs a batch of short segments either
as **slot groups** (each slot's tokens gathered once, one GEMM per slot and slice) or as **slot
blocks**: one ``bmm`` over one block per slot, each padded to a block size, and, where some slots
hold more rows than that, a second ``bmm`` over their rest (``SlotBlocks``). One ``bmm`` saves a GEMM
per slot but multiplies its padding rows too; this times, on the same batches, side by side in
interleaved rounds (``lora_core.testing.timing``), on one ``h x h`` module at rank 64 over 4 slots
(ranks 8, 16, 32, 64):

* ``slot blocks``: every slot padded to the largest group, one ``bmm``;
* ``slot blocks in two runs``: the block size among the groups' sizes that gathers the fewest rows, the rest of the
  larger groups in a second ``bmm`` (not for batches whose groups are all one size);
* ``slot groups``: one GEMM per slot.

Each round runs every layout once (20 shrink + expand pairs); a case's figures are each block layout's
time over slot groups' in the same round, the median over rounds with its min-max spread. It also
prints which layout the plan picks (``lora_cuda.control_plan.slot_block_size``).

    python examples/bench_slot_layouts.py            # h = 256 (lora-sim's width), 15 rounds
    python examples/bench_slot_layouts.py --wide     # h = 1024
    python examples/bench_slot_layouts.py --smoke    # tiny sizes: a check that it runs
"""

from __future__ import annotations

import contextlib
import json
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
    "prefill 8 x 32, 1/2/2/2": ([32] * 8, [None, 1, 2, 3, 0, 1, 2, 3]),
    "prefill 8 x 32, a quarter mixed": ([32] * 8, [None, {1: 0.6, 2: 0.4}, 2, 3, 0, {1: 0.6, 2: 0.4}, 2, 3]),
    "prefill 8 x 32, 3/2/2/1": ([32] * 8, [0, 1, 0, 2, 0, 1, 2, 3]),
}
SMOKE_CASES = {name: CASES[name] for name in ("decode 32, even", "prefill 8 x 32, a quarter mixed")}


LAYOUTS = ("slot blocks", "slot blocks in two runs", "slot groups")


def two_run_block_size(counts: list[int]) -> int | None:
    """The block size below the largest group that gathers the fewest rows, the largest of equals as the
    plan takes it (``None``: one group size)."""
    largest = max(counts)
    gathered = {b: len(counts) * b + sum(n > b for n in counts) * (largest - b) for b in set(counts) if b < largest}
    return min(sorted(gathered, reverse=True), key=gathered.get, default=None)


FORCE = {"slot blocks": max, "slot blocks in two runs": two_run_block_size, "slot groups": lambda counts: None}


def planned(backend, seq_lens: list[int], slot_ids: list, layout: str | None, run) -> tuple:
    """The batch, its layout forced to ``layout`` (``None``: the plan's own choice) while its plans are
    built (by one warm-up ``run``), and the control plan its kernels read (a mixed batch's: its pair rows')."""
    info = build_batch_info(seq_lens, slot_ids, RANKS, SCALINGS, device="cpu")
    force = FORCE[layout] if layout else None
    with mock.patch.object(control_plan, "slot_block_size", lambda counts, _: force(counts)) if force \
            else contextlib.nullcontext():
        backend.prepare_batch(info)
        run(info)
    return info, (info if info.pairs is None else info.pairs.view).plan(ControlPlan)


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

        plans = {layout: planned(backend, seq_lens, slot_ids, layout, run) for layout in LAYOUTS}
        _, chosen = planned(backend, seq_lens, slot_ids, None, run)
        layouts = [layout for layout, (_, plan) in plans.items() if plan.layout == layout]
        assert layouts[0] == "slot blocks" and layouts[-1] == "slot groups", (name, layouts)  # (2 runs need 2 sizes)
        expected = run(plans["slot groups"][0])
        for layout in layouts:  # the same delta every way
            torch.testing.assert_close(run(plans[layout][0]), expected, rtol=1e-4, atol=1e-4)
        timer = Interleaved(layouts)
        for _ in range(rounds):
            timer.round({layout: lambda info=plans[layout][0]: run(info) for layout in layouts})
        groups_plan = plans["slot groups"][1]
        rows = sum(g.num_tokens for g in groups_plan.groups)
        results[name] = {"rows": rows, "slots": len(groups_plan.groups), "choice": chosen.layout, "layouts": {
            layout: {"padding": plans[layout][1].slot_blocks.num_cells - rows,
                     "over_groups": Spread.of([x / y for x, y in zip(timer.samples[layout],
                                                                     timer.samples["slot groups"])])}
            for layout in layouts[:-1]}}
    info = machine_info()
    print(f"bench_slot_layouts: {info['cpu']} ({info['cpu_count']} cores), torch {info['torch']}, {threads} threads; "
          f"load average {load:.2f} before the run; {rounds} rounds; one {h} x {h} module, rank 64, 4 slots")
    for name, r in results.items():
        figures = "; ".join(f"{layout} ({f['padding']} padding rows) / slot groups "
                            f"{format_spread(f['over_groups'], '{:.2f}')}" for layout, f in r["layouts"].items())
        print(f"{name}: {r['rows']} rows over {r['slots']} slots; {figures}; the plan picks {r['choice']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": info, "load": load, "rounds": rounds, "h": h, "results": {
            name: {**r, "layouts": {layout: {**f, "over_groups": vars(f["over_groups"])}
                                    for layout, f in r["layouts"].items()}} for name, r in results.items()}},
            indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
