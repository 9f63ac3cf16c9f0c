"""``lora-sim bench``: the op benchmarks of every installed backend package.

Benchmarks are found, never imported by name, through the entry-point group
``lora_core.benchmarks``: each entry is a callable ``main(argv: list[str]) -> int``
that accepts ``--smoke`` (tiny shapes), e.g. ``torch_native = "lora_cuda.bench:main"``
(see docs/benchmarks.md for what they measure).
"""

from __future__ import annotations

import sys
import time
import traceback
from importlib.metadata import EntryPoint, entry_points
from typing import TextIO

__all__ = ["BENCHMARK_GROUP", "discover_benchmarks", "run_benchmarks"]

BENCHMARK_GROUP = "lora_core.benchmarks"


def discover_benchmarks() -> list[EntryPoint]:
    """The installed benchmarks, sorted by entry-point name (duplicates of a name kept once)."""
    found: dict[str, EntryPoint] = {}
    for ep in entry_points(group=BENCHMARK_GROUP):
        found.setdefault(ep.name, ep)
    return [found[name] for name in sorted(found)]


def _run_one(ep: EntryPoint, argv: list[str], err: TextIO) -> int:
    """Load and run one benchmark; its exit status (1 when it cannot be loaded or raises)."""
    try:
        main = ep.load()
    except Exception as exc:  # a broken package must not hide the other benchmarks
        print(f"lora-sim bench: cannot load {ep.name} ({ep.value}): {type(exc).__name__}: {exc}", file=err)
        return 1
    try:
        status = main(list(argv))
    except SystemExit as exc:  # e.g. its argparse rejected the arguments
        status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except Exception:
        print(f"lora-sim bench: {ep.name} raised:", file=err)
        traceback.print_exc(file=err)
        return 1
    return int(status or 0)


def run_benchmarks(smoke: bool, out: TextIO | None = None, err: TextIO | None = None,
                   progress: bool = False) -> int:
    """Run every benchmark of :func:`discover_benchmarks` in name order (``--smoke``
    passed on when ``smoke``), each under a header line on ``out``; with ``progress``,
    a line on ``err`` when each starts and when it ends (its status and seconds).

    Returns 0 when all of them return 0, else the exit status of the first that did
    not (1 for one that cannot be loaded or raises); every benchmark runs either way.
    With no benchmark installed it says so and returns 1: nothing was measured.
    """
    out, err = out or sys.stdout, err or sys.stderr
    benchmarks = discover_benchmarks()
    if not benchmarks:
        print(f"lora-sim bench: no benchmarks are installed (entry-point group {BENCHMARK_GROUP!r} is empty); "
              "install a backend package that has some, e.g. lora-cuda: bash ci/install-wheels.sh lora-cuda", file=err)
        return 1
    argv = ["--smoke"] if smoke else []
    first_failure = 0
    for i, ep in enumerate(benchmarks):
        if i:
            print(file=out)
        print(f"## benchmark {ep.name} ({ep.value})", file=out, flush=True)
        label = f"lora-sim bench: [{i + 1}/{len(benchmarks)}] {ep.name}"
        if progress:
            print(f"{label}: running {ep.value} {' '.join(argv)}".rstrip(), file=err, flush=True)
        started = time.perf_counter()
        status = _run_one(ep, argv, err)
        out.flush()
        if progress:
            print(f"{label}: exit status {status}, {time.perf_counter() - started:.1f} s", file=err, flush=True)
        if status:
            print(f"lora-sim bench: {ep.name} exited with status {status}", file=err)
            first_failure = first_failure or status
    return first_failure
