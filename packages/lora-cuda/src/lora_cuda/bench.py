"""Benchmarks of the torch_native ops against a dense floor and the upstream designs.

Every case is timed side by side in one process, in interleaved rounds (the
reported ratio is the median over rounds, with its min-max spread), as ratios to
the **floor**: one dense shrink + expand pair (``mm`` + ``addmm``) with the same
FLOPs, as if every token used one adapter. Baselines written here:

* ``upstream control``: a Python loop over requests reading each segment's
  length, slot, rank and scaling with ``.item()`` (sglang's control-flow op);
* ``upstream graph``: a loop over all ``L`` slots multiplying every token by
  every slot and masking with ``torch.where`` (sglang's graph op).

Run ``python -m lora_cuda.bench`` (or ``lora-sim bench``); ``--device cuda`` on a
GPU; ``--smoke`` uses tiny shapes for a quick check that everything runs. Never
run as a timed test.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import torch
from torch.utils import benchmark

from lora_core import BatchInfo
from lora_core.checks import check_device
from lora_core.testing import make_batch_info, random_linear_weights
from lora_core.testing.timing import Spread, apply_threads, benchmark_parser, format_spread, machine_info

from .backend import TorchNativeBackend
from .ops import sgemm_lora_a_fwd, sgemm_lora_b_fwd

__all__ = ["BenchCase", "BenchResult", "default_cases", "smoke_cases", "run_case", "format_table", "main", "time_us",
           "floor_lora", "upstream_control_lora", "upstream_graph_lora", "interleaved_times"]


@dataclass(frozen=True)
class BenchCase:
    name: str
    seq_lens: tuple[int, ...]
    slots: tuple[int, ...]
    num_slots: int
    hidden: int = 2048
    out: int = 2048
    max_rank: int = 16
    dtype: str = "float32"


@dataclass(frozen=True)
class BenchResult:
    """Ratios to the floor (medians over rounds, with spreads), and graph / eager per round."""

    case: str
    floor_us: float
    eager: Spread
    graph: Spread
    upstream_control: Spread
    upstream_graph: Spread
    graph_vs_eager: Spread
    threads: int
    device: str = "cpu"


def default_cases() -> list[BenchCase]:
    """The cases of the lora-cuda issue: prefill T=2048 in 8 segments over 4 adapters;
    decode T=64 single-token requests over L = 1, 2, 4, 8 slots."""
    cases = [BenchCase("prefill T=2048 S=8 L=4", (256,) * 8, tuple(i % 4 for i in range(8)), 4)]
    for L in (1, 2, 4, 8):
        cases.append(BenchCase(f"decode T=64 L={L}", (1,) * 64, tuple(t % L for t in range(64)), L))
    return cases


def smoke_cases() -> list[BenchCase]:
    return [
        BenchCase("smoke prefill", (16,) * 4, (0, 1, 0, 1), 2, hidden=64, out=64, max_rank=4),
        BenchCase("smoke decode", (1,) * 8, tuple(t % 4 for t in range(8)), 4, hidden=64, out=64, max_rank=4),
    ]


def floor_lora(x: torch.Tensor, a0: torch.Tensor, b0: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """Dense floor: every token through one adapter, ``x (T, h)``, ``a0 (R, h)``, ``b0 (out, R)``."""
    return base.addmm_(torch.mm(x, a0.T), b0.T)


def upstream_control_lora(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, seg_lens: torch.Tensor, weight_indices: torch.Tensor,
    ranks: torch.Tensor, scalings: torch.Tensor, base: torch.Tensor,
) -> torch.Tensor:
    """Upstream control design: per-request loop, lengths and scalings read with ``.item()``."""
    start = 0
    for i in range(seg_lens.shape[0]):
        n = int(seg_lens[i].item())
        slot = int(weight_indices[i].item())
        if slot >= 0:
            r = int(ranks[slot].item())
            y = torch.mm(x[start : start + n], a[slot, :r].T) * scalings[slot].item()
            base[start : start + n].addmm_(y, b[slot, :, :r].T)
        start += n
    return base


def upstream_graph_lora(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor, scalings: torch.Tensor,
    base: torch.Tensor,
) -> torch.Tensor:
    """Upstream graph design: every token times every slot, masked with ``torch.where``."""
    for slot in range(a.shape[0]):
        mask = (token_slots == slot)[:, None]
        y = torch.mm(x, a[slot].T) * scalings[slot]
        base += torch.where(mask, torch.mm(y, b[slot].T), 0)
    return base


def _ours(info: BatchInfo, a: torch.Tensor, b: torch.Tensor, offsets: tuple[int, ...]) -> Callable:
    def run(x: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        return sgemm_lora_b_fwd(sgemm_lora_a_fwd(x, a, info), b, info, offsets, base)

    return run


def time_us(fn: Callable, *args, min_run_time: float) -> float:
    # with the process's threads: Timer's default is one thread, whatever torch uses
    timer = benchmark.Timer(stmt="fn(*args)", globals={"fn": fn, "args": args}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=min_run_time).median * 1e6


def interleaved_times(variants: dict[str, tuple[Callable, tuple]], *, min_run_time: float,
                      rounds: int = 7) -> dict[str, list[float]]:
    """Microseconds per call of each ``name: (fn, args)``, measured in ``rounds`` interleaved
    rounds (each variant once per round), so slow phases of a noisy machine hit all alike."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, (fn, args) in variants.items():
            times[name].append(time_us(fn, *args, min_run_time=min_run_time / rounds))
    return times


def run_case(case: BenchCase, *, min_run_time: float = 1.0, device: str = "cpu", rounds: int = 7) -> BenchResult:
    """Time every variant of ``case`` in ``rounds`` interleaved rounds; ratios are taken per round."""
    dtype = getattr(torch, case.dtype)
    ranks = [case.max_rank] * case.num_slots
    gen = torch.Generator().manual_seed(0)
    a, b, offsets = random_linear_weights(gen, num_slots=case.num_slots, max_rank=case.max_rank,
                                          in_features=case.hidden, slice_widths=[case.out], lora_ranks=ranks,
                                          dtype=dtype, device=device, garbage=None)
    T = sum(case.seq_lens)
    x = torch.randn(T, case.hidden, generator=gen).to(device, dtype)
    base = torch.zeros(T, case.out, device=device, dtype=dtype)
    eager = make_batch_info(case.seq_lens, case.slots, ranks, device=device)
    graph = make_batch_info(case.seq_lens, case.slots, ranks, device=device, use_graph=True)
    for info in (eager, graph):
        TorchNativeBackend(device).prepare_batch(info)  # plans are the batch's, not the op's, cost
    seg_lens = torch.tensor(case.seq_lens, device=device)
    weight_indices = torch.tensor(case.slots, device=device)
    variants = {
        "floor": (floor_lora, (x, a[0], b[0], base)),
        "eager": (_ours(eager, a, b, offsets), (x, base)),
        "graph": (_ours(graph, a, b, offsets), (x, base)),
        "upstream_control": (upstream_control_lora,
                             (x, a, b, seg_lens, weight_indices, eager.lora_ranks, eager.scalings, base)),
        "upstream_graph": (upstream_graph_lora, (x, a, b, graph.token_slots, graph.scalings, base)),
    }
    with torch.no_grad():
        for fn, args in variants.values():
            fn(*args)  # warm-up: lazily created tables and workspaces, allocator growth
        times = interleaved_times(variants, min_run_time=min_run_time, rounds=rounds)
    floors = times.pop("floor")
    ratios = {name: Spread.of([t / f for t, f in zip(values, floors)]) for name, values in times.items()}
    ratios["graph_vs_eager"] = Spread.of([g / e for g, e in zip(times["graph"], times["eager"])])
    return BenchResult(case.name, statistics.median(floors), threads=torch.get_num_threads(), device=device, **ratios)


def format_table(results: Sequence[BenchResult]) -> str:
    """A Markdown table of ratios to the floor: median (min–max) over interleaved rounds."""
    m = machine_info()
    lines = [
        f"{m['cpu']} ({m['cpu_count']} cores), torch {m['torch']}, {m['threads']} threads, "
        f"device {results[0].device if results else 'cpu'}; ratios to the dense floor (lower is better), "
        "median (min–max) over interleaved rounds",
        "",
        "| case | floor (us) | eager | graph | graph / eager | upstream control | upstream graph |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        cells = [format_spread(v, suffix="x") for v in
                 (r.eager, r.graph, r.graph_vs_eager, r.upstream_control, r.upstream_graph)]
        lines.append(f"| {r.case} | {r.floor_us:.0f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = benchmark_parser("python -m lora_cuda.bench", __doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="torch device to run on (default cpu; e.g. cuda)")
    args = parser.parse_args(argv)
    apply_threads(args.threads)
    try:
        args.device = str(check_device("--device", args.device))
    except ValueError as err:
        parser.error(str(err))
    cases = smoke_cases() if args.smoke else default_cases()
    min_run_time = 0.01 if args.smoke else args.min_run_time
    results = [run_case(c, min_run_time=min_run_time, device=args.device, rounds=3 if args.smoke else args.rounds)
               for c in cases]
    print(format_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_info(), "results": [asdict(r) for r in results]}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
