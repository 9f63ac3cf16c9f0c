"""Stable figures: samples from interleaved rounds, summarised as median and spread.

Wall-clock speed drifts (other work on the machine, frequency scaling), so every
variant that a figure compares is timed in the same rounds, each once per round,
rotating which goes first; a figure is the median over rounds, shown with its
min-max spread (docs/benchmarks.md). Shared by the op benchmarks and lora-sim.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from lora_core.platforms import platform_for

__all__ = ["Interleaved", "Spread", "machine_info", "sync_device", "format_spread", "benchmark_parser",
           "apply_threads", "positive_int", "add_clock_option", "clock_from"]


@dataclass(frozen=True)
class Spread:
    """A figure measured over rounds: its ``median``, the ``minimum`` and ``maximum``
    over rounds, and the per-round ``samples`` themselves (in round order)."""

    median: float
    minimum: float
    maximum: float
    samples: tuple[float, ...]

    @classmethod
    def of(cls, samples: Sequence[float]) -> Spread:
        """The spread of ``samples`` (at least one)."""
        if not samples:
            raise ValueError("a spread needs at least one sample")
        values = tuple(float(s) for s in samples)
        return cls(statistics.median(values), min(values), max(values), values)


class Interleaved:
    """Times named variants round by round: each :meth:`round` calls every variant
    once, the one going first rotating from round to round, and appends each
    call's seconds to ``samples[name]``.

    ``sync`` runs after every call, inside its timing (a device synchronisation,
    so asynchronous work is counted); ``clock`` returns seconds.
    """

    def __init__(self, names: Sequence[str], sync: Callable[[], None] = lambda: None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if not names:
            raise ValueError("Interleaved needs at least one variant")
        self.names = list(names)
        self.samples: dict[str, list[float]] = {n: [] for n in self.names}
        self._sync, self._clock, self._rounds = sync, clock, 0

    def order(self) -> list[str]:
        """The order of the next round's calls."""
        k = self._rounds % len(self.names)
        return self.names[k:] + self.names[:k]

    def round(self, calls: Mapping[str, Callable[[], Any]]) -> dict[str, Any]:
        """Call each variant once (``calls`` holds one callable per name), timed; returns their results."""
        if set(calls) != set(self.names):
            raise ValueError(f"a round calls exactly {self.names}, got {sorted(calls)}")
        results = {}
        for name in self.order():
            start = self._clock()
            results[name] = calls[name]()
            self._sync()
            self.samples[name].append(self._clock() - start)
        self._rounds += 1
        return results

    def spreads(self) -> dict[str, Spread]:
        """Seconds per call of each variant over the rounds so far, as a :class:`Spread`."""
        return {name: Spread.of(samples) for name, samples in self.samples.items()}


def sync_device(device_type: str) -> Callable[[], None]:
    """A function that waits for the queued work of a ``device_type`` (``"cuda"``,
    ``"npu"``; a no-op on the host): its platform's ``synchronize``."""
    return platform_for(device_type).synchronize


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict[str, Any]:
    """Where the figures were measured: CPU model and cores, torch version, intra-op
    threads, Python and OS, and the CUDA device when torch sees one."""
    info = {"cpu": _cpu_model(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "python": platform.python_version(), "os": platform.platform()}
    if torch.cuda.is_available():
        info["cuda_device"] = torch.cuda.get_device_name(0)
    return info


def format_spread(spread: Spread, fmt: str = "{:.2f}", suffix: str = "") -> str:
    """``median (min–max)`` of a spread, each value formatted with ``fmt``."""
    return (f"{fmt.format(spread.median)}{suffix} "
            f"({fmt.format(spread.minimum)}–{fmt.format(spread.maximum)})")


def _rounds(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive_int(text: str) -> int:
    """An ``argparse`` type: ``text`` as an int of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def benchmark_parser(prog: str, description: str, *, min_run_time: float = 1.0) -> argparse.ArgumentParser:
    """The options every lora-kit benchmark takes: ``--smoke``, ``--min-run-time``,
    ``--rounds``, ``--json`` and ``--threads`` (``lora-sim bench`` passes ``--smoke`` to each)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, a quick check that everything runs")
    parser.add_argument("--min-run-time", type=float, default=min_run_time,
                        help=f"seconds per variant, split over the interleaved rounds (default {min_run_time})")
    parser.add_argument("--rounds", type=_rounds, default=7, help="interleaved rounds, at least 1 (default 7)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="torch intra-op threads to time with (default: torch's, "
                             f"{torch.get_num_threads()} here); reported with the figures")
    return parser


def add_clock_option(parser: argparse.ArgumentParser) -> None:
    """``--clock {wall,thread}`` for an end-to-end benchmark; :func:`clock_from` reads it back."""
    parser.add_argument("--clock", choices=["wall", "thread"], default="wall",
                        help="wall: elapsed time (default); thread: this thread's CPU time, which other "
                             "processes on a busy machine do not inflate (CPU only, needs --threads 1)")


def clock_from(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Callable[[], float]:
    """The timer ``--clock`` picks: ``time.perf_counter``, or ``time.thread_time`` (one thread's CPU
    time, so only with ``--threads 1`` and, where the parser has ``--device``, on the CPU: else a
    parser error)."""
    if args.clock == "wall":
        return time.perf_counter
    if args.threads != 1 or getattr(args, "device", "cpu") != "cpu":
        parser.error("--clock thread counts one thread's CPU time: use it with --threads 1 on the CPU")
    return time.thread_time


def apply_threads(threads: int | None) -> int:
    """Set this benchmark process's torch intra-op threads (``--threads``) and return the
    count every timer must use: ``torch.utils.benchmark.Timer`` times with one thread unless
    told otherwise, which would disagree with the threads reported beside the figures."""
    if threads is not None:
        torch.set_num_threads(threads)
    return torch.get_num_threads()
