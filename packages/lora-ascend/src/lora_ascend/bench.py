"""Benchmarks of the vectorized ops against a per-segment loop, side by side in one process.

* embedding shrink: one flat gather vs a loop over segments (``F.embedding`` per
  segment, scaling read with ``.item()``), at 1, 8 and 64 segments;
* shrink + expand: vectorized vs the same per-segment loop and the dense floor
  of :mod:`lora_cuda.bench`, at 1, 8 and 64 segments over 8 slots.

Variants are timed in interleaved rounds; ratios are taken per round and
reported as median (min–max) over rounds.

Run ``python -m lora_ascend.bench`` (or ``lora-sim bench``); ``--smoke`` for tiny shapes.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from lora_core.testing import make_batch_info, random_linear_weights
from lora_core.testing.timing import Spread, apply_threads, benchmark_parser, format_spread, machine_info
from lora_cuda.bench import floor_lora, interleaved_times, upstream_control_lora

from .backend import AscendBackend
from .embedding import vectorized_lora_a_embedding_fwd
from .ops import vectorized_lora_a_fwd, vectorized_lora_b_fwd

__all__ = ["loop_embedding_shrink", "run", "main"]


def loop_embedding_shrink(
    ids: torch.Tensor, weights: torch.Tensor, seg_lens: torch.Tensor, weight_indices: torch.Tensor,
    ranks: torch.Tensor, scalings: torch.Tensor,
) -> torch.Tensor:
    """The per-segment design: a host loop reading each segment's length, slot and scaling."""
    out = weights.new_zeros(ids.shape[0], weights.shape[1])
    start = 0
    for i in range(seg_lens.shape[0]):
        n, slot = int(seg_lens[i].item()), int(weight_indices[i].item())
        if slot >= 0:
            r = int(ranks[slot].item())
            out[start : start + n, :r] = F.embedding(ids[start : start + n], weights[slot, :r].T) * scalings[slot].item()
        start += n
    return out


@dataclass(frozen=True)
class Row:
    """One case: the vectorized op's median time, and per-round ratios as spreads."""

    op: str
    case: str
    vectorized_us: float
    speedup: Spread
    """per-segment loop / vectorized"""
    vs_floor: Spread | None
    """vectorized / dense floor"""


def _row(op: str, case: str, times: dict[str, list[float]]) -> Row:
    vec = times["vectorized"]
    floor = times.get("floor")
    return Row(op, case, Spread.of(vec).median, Spread.of([lp / v for lp, v in zip(times["loop"], vec)]),
               Spread.of([v / f for v, f in zip(vec, floor)]) if floor else None)


def _layout(num_tokens: int, num_segments: int, num_slots: int) -> tuple[list[int], list[int]]:
    base, extra = divmod(num_tokens, num_segments)
    seq = [base + (i < extra) for i in range(num_segments)]
    return seq, [i % num_slots for i in range(num_segments)]


def run(*, smoke: bool = False, min_run_time: float = 1.0, rounds: int = 7) -> list[Row]:
    """Times per op and case, in ``rounds`` interleaved rounds."""
    V, R, L, H = (500, 4, 4, 64) if smoke else (32000, 16, 8, 2048)
    gen = torch.Generator().manual_seed(0)
    rows: list[Row] = []
    emb = torch.randn(L, R, V, generator=gen)
    ranks = [R] * L
    for T, segments in ([(16, 1), (16, 4), (16, 16)] if smoke else [(64, 1), (64, 8), (64, 64), (2048, 8)]):
        seq, slots = _layout(T, segments, L)
        info = make_batch_info(seq, slots, ranks, device="cpu")
        AscendBackend("cpu").prepare_batch(info)  # the plans are the batch's cost, not the op's
        ids = torch.randint(0, V, (T,), generator=gen)
        args = (torch.tensor(seq), torch.tensor(slots), info.lora_ranks, info.scalings)
        t = interleaved_times({"vectorized": (vectorized_lora_a_embedding_fwd, (ids, emb, info, V)),
                               "loop": (loop_embedding_shrink, (ids, emb, *args))}, min_run_time=min_run_time,
                              rounds=rounds)
        rows.append(_row("embedding shrink", f"T={T} segments={segments}", t))
    a, b, offsets = random_linear_weights(gen, num_slots=L, max_rank=R, in_features=H, slice_widths=[H],
                                          lora_ranks=ranks, dtype=torch.float32, device="cpu", garbage=None)
    T = 16 if smoke else 64
    x = torch.randn(T, H, generator=gen)
    base = torch.zeros(T, H)
    for segments in ((1, 4, 16) if smoke else (1, 8, 64)):
        seq, slots = _layout(T, segments, L)
        info = make_batch_info(seq, slots, ranks, device="cpu")
        AscendBackend("cpu").prepare_batch(info)  # the plans are the batch's cost, not the op's

        def vectorized(x, base, info=info):
            return vectorized_lora_b_fwd(vectorized_lora_a_fwd(x, a, info), b, info, offsets, base)

        loop_args = (x, a, b, torch.tensor(seq), torch.tensor(slots), info.lora_ranks, info.scalings, base)
        with torch.no_grad():
            t = interleaved_times({"vectorized": (vectorized, (x, base)), "loop": (upstream_control_lora, loop_args),
                                   "floor": (floor_lora, (x, a[0], b[0], base))}, min_run_time=min_run_time,
                                  rounds=rounds)
        rows.append(_row("shrink+expand", f"T={T} segments={segments} L={L}", t))
    return rows


def format_table(rows: Sequence[Row]) -> str:
    m = machine_info()
    lines = [
        f"{m['cpu']} ({m['cpu_count']} cores), torch {m['torch']}, {m['threads']} threads; "
        "ratios are median (min–max) over interleaved rounds",
        "",
        "| op | case | vectorized (us) | loop / vectorized | vectorized / dense floor |",
        "|---|---|---:|---:|---:|",
    ]
    for r in rows:
        floor = format_spread(r.vs_floor, suffix="x") if r.vs_floor else "-"
        lines.append(f"| {r.op} | {r.case} | {r.vectorized_us:.0f} | {format_spread(r.speedup, '{:.1f}', 'x')} "
                     f"| {floor} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = benchmark_parser("python -m lora_ascend.bench", __doc__.split("\n\n")[0]).parse_args(argv)
    apply_threads(args.threads)
    rows = run(smoke=args.smoke, min_run_time=0.01 if args.smoke else args.min_run_time,
               rounds=3 if args.smoke else args.rounds)
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_info(), "rows": [asdict(r) for r in rows]}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
