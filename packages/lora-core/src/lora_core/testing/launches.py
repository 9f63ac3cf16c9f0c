"""A device-independent cost model: what one call dispatches (docs/graph-simulator.md).

``count_launches(fn, *inputs)`` runs ``fn`` once and counts the aten ops that
would launch a kernel (views and other pure metadata ops excluded), the host
reads and syncs (the same rules as the graph simulator), and the distinct
``(op, input shapes)`` signatures. "A constant number of launches whatever the
number of segments" is then a plain equality between two counts, and the
matrix-product multiply-accumulates (``matmul_macs``) show wasted FLOPs.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .rules import HostAccessMonitor, Violation

__all__ = ["LaunchCount", "count_launches"]

# Ops that only produce metadata/aliases and launch nothing.
_NO_KERNEL = {"detach", "alias", "lift_fresh", "_unsafe_view", "empty", "empty_strided", "empty_like"}


@dataclass(frozen=True)
class LaunchCount:
    """Result of :func:`count_launches`."""

    ops: int
    host_reads: int
    signatures: int
    matmul_macs: int
    """Multiply-accumulates of the matrix products (mm, addmm, bmm, baddbmm, _grouped_mm)."""
    by_op: Counter = field(compare=False, repr=False)
    reads: tuple[Violation, ...] = field(compare=False, repr=False)


def _shapes(args: Any) -> tuple:
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(tuple(a.shape))
        elif isinstance(a, (list, tuple)):
            out.append(_shapes(a))
    return tuple(out)


def _matmul_macs(name: str, args: tuple) -> int:
    if name == "_grouped_mm":  # (T, K) rows, each multiplied by one (K, N) matrix of the group stack
        return args[0].numel() * args[1].shape[-1]
    operands = {"mm": (0, 1), "bmm": (0, 1), "addmm": (1, 2), "baddbmm": (1, 2)}.get(name)
    if operands is None:
        return 0
    a, b = args[operands[0]], args[operands[1]]
    return a.numel() * b.shape[-1]


def count_launches(fn: Callable[..., Any], *inputs: Any) -> LaunchCount:
    """Run ``fn(*inputs)`` once and count its kernel launches, host reads and op signatures."""
    by_op: Counter = Counter()
    macs = [0]
    signatures: set = set()
    reads: list[Violation] = []

    def on_op(func, args, kwargs, out) -> None:
        name = func.overloadpacket.__name__
        if func.is_view or name in _NO_KERNEL:
            return
        by_op[str(func)] += 1
        macs[0] += _matmul_macs(name, args)
        signatures.add((str(func), _shapes(args)))

    with torch.no_grad(), HostAccessMonitor(reads.append, on_op):
        fn(*inputs)
    return LaunchCount(
        ops=sum(by_op.values()),
        host_reads=len(reads),
        signatures=len(signatures),
        matmul_macs=macs[0],
        by_op=by_op,
        reads=tuple(reads),
    )
