"""Host-side batch planning, timed against the token count and the request count.

What graph capture saves per decode step is host time, so planning must cost
little beside the kernels it feeds. For each batch shape this times, side by
side in interleaved rounds:

* **eager build**: ``build_batch_info`` + ``TorchNativeBackend.prepare_batch``
  (the control plan);
* **graph build**: the same for a graph-mode batch (its LM-head view and the
  static plan of the kernel that runs included);
* **graph refill**: ``BatchInfo.refill`` of that batch in place (the plans, the
  view and, at decode shapes, one layer's rank/scaling tables refilled with it):
  what a captured decode step pays;

and, at decode shapes, the ratio of the refill to one LoRA layer's graph-safe
shrink + expand (``h = out = 2048``, ``R = 16``) on the same batch.

Run ``python -m lora_cuda.bench_planning`` (or ``lora-sim bench``); ``--smoke``
for a quick check; ``--device cuda`` plans batches for a GPU (each timing then
includes the uploads and waits for the device). Never run as a timed test.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import torch
from torch.utils import benchmark

from lora_core import build_batch_info
from lora_core.checks import check_device
from lora_core.testing import random_linear_weights
from lora_core.testing.timing import Spread, apply_threads, benchmark_parser, format_spread, machine_info

from .backend import TorchNativeBackend
from .ops import sgemm_lora_a_fwd, sgemm_lora_b_fwd

__all__ = ["PlanningCase", "PlanningResult", "default_cases", "smoke_cases", "run_case", "format_table", "main"]


@dataclass(frozen=True)
class PlanningCase:
    num_tokens: int
    num_requests: int
    num_slots: int
    max_rank: int = 16

    @property
    def name(self) -> str:
        return f"T={self.num_tokens} requests={self.num_requests} slots={self.num_slots}"

    @property
    def is_decode(self) -> bool:
        return self.num_tokens == self.num_requests

    def batch(self) -> tuple[list[int], list[int | None]]:
        base, extra = divmod(self.num_tokens, self.num_requests)
        lens = [base + (i < extra) for i in range(self.num_requests)]
        # every eighth request on the base model, the others spread over the slots
        slots = [None if i % 8 == 7 else i % self.num_slots for i in range(self.num_requests)]
        return lens, slots


@dataclass(frozen=True)
class PlanningResult:
    case: str
    eager_build_us: Spread
    graph_build_us: Spread
    refill_us: Spread
    layer_us: Spread | None
    """one LoRA layer's graph-safe shrink + expand at this batch (decode shapes only)"""
    refill_vs_layer: Spread | None
    device: str = "cpu"


def default_cases() -> list[PlanningCase]:
    """T from 64 to 32768 and 1 to 512 requests: decode shapes (T = requests) and prefill."""
    cases = [PlanningCase(t, t, 8) for t in (64, 256, 512)]
    cases += [PlanningCase(2048, r, 4) for r in (1, 8, 64)]
    cases += [PlanningCase(8192, 16, 8), PlanningCase(32768, 32, 8), PlanningCase(32768, 512, 8)]
    return cases


def smoke_cases() -> list[PlanningCase]:
    return [PlanningCase(16, 16, 4, max_rank=4), PlanningCase(64, 4, 2, max_rank=4)]


def _us(fn: Callable[[], object], min_run_time: float) -> float:
    timer = benchmark.Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())  # Timer's default is 1
    return timer.blocked_autorange(min_run_time=min_run_time).median * 1e6


def run_case(case: PlanningCase, *, min_run_time: float = 0.5, rounds: int = 7, hidden: int = 2048,
             device: str = "cpu") -> PlanningResult:
    """Time the planning variants of ``case`` (and one layer at decode) for batches on ``device``,
    in interleaved rounds."""
    lens, slots = case.batch()
    ranks, scalings = [case.max_rank] * case.num_slots, [1.0] * case.num_slots
    T = case.num_tokens

    def eager_build() -> None:
        TorchNativeBackend(device).prepare_batch(build_batch_info(lens, slots, ranks, scalings, device=device))

    def graph_build():
        info = build_batch_info(lens, slots, ranks, scalings, device=device, use_graph=True, max_tokens=T)
        TorchNativeBackend(device).prepare_batch(info)
        return info

    info = graph_build()
    variants: dict[str, Callable[[], object]] = {
        "eager_build": eager_build, "graph_build": graph_build, "refill": lambda: info.refill(lens, slots),
    }
    if case.is_decode:
        gen = torch.Generator().manual_seed(0)
        a, b, offsets = random_linear_weights(gen, num_slots=case.num_slots, max_rank=case.max_rank,
                                              in_features=hidden, slice_widths=[hidden], lora_ranks=ranks,
                                              dtype=torch.float32, device=device, garbage=None)
        x, base = torch.randn(T, hidden, generator=gen).to(device), torch.zeros(T, hidden, device=device)
        variants["layer"] = lambda: sgemm_lora_b_fwd(sgemm_lora_a_fwd(x, a, info), b, info, offsets, base)
    samples: dict[str, list[float]] = {name: [] for name in variants}
    with torch.no_grad():
        for fn in variants.values():
            fn()  # warm-up
        for _ in range(rounds):
            for name, fn in variants.items():
                samples[name].append(_us(fn, min_run_time / rounds))
    layer = samples.get("layer")
    return PlanningResult(
        case.name, Spread.of(samples["eager_build"]), Spread.of(samples["graph_build"]), Spread.of(samples["refill"]),
        Spread.of(layer) if layer else None,
        Spread.of([r / k for r, k in zip(samples["refill"], layer)]) if layer else None, str(device),
    )


def format_table(results: Sequence[PlanningResult]) -> str:
    m = machine_info()
    devices = sorted({r.device for r in results})
    where = ", ".join(f"{d} ({m['cuda_device']})" if d.startswith("cuda") and "cuda_device" in m else d
                      for d in devices)
    lines = [
        f"{m['cpu']} ({m['cpu_count']} cores), torch {m['torch']}, {m['threads']} threads; host planning of "
        f"batches on {where}, microseconds, median (min–max) over interleaved rounds",
        "",
        "| batch | eager build | graph build | graph refill | one layer (graph) | refill / layer |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        layer = format_spread(r.layer_us, "{:.0f}") if r.layer_us else "-"
        ratio = format_spread(r.refill_vs_layer, suffix="x") if r.refill_vs_layer else "-"
        lines.append(f"| {r.case} | {format_spread(r.eager_build_us, '{:.0f}')} | "
                     f"{format_spread(r.graph_build_us, '{:.0f}')} | {format_spread(r.refill_us, '{:.0f}')} | "
                     f"{layer} | {ratio} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = benchmark_parser("python -m lora_cuda.bench_planning", __doc__.split("\n\n")[0], min_run_time=0.5)
    parser.add_argument("--device", default="cpu", help="where the batches live (default cpu; e.g. cuda)")
    args = parser.parse_args(argv)
    apply_threads(args.threads)
    try:
        device = str(check_device("--device", args.device))
    except ValueError as err:
        parser.error(str(err))
    smoke = args.smoke
    results = [run_case(c, min_run_time=0.01 if smoke else args.min_run_time, rounds=3 if smoke else args.rounds,
                        hidden=64 if smoke else 2048, device=device)
               for c in (smoke_cases() if smoke else default_cases())]
    print(format_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_info(), "results": [asdict(r) for r in results]}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
