"""A CPU simulation of CUDA-graph capture and replay (docs/graph-simulator.md).

``GraphSimulator.capture(fn, *static_inputs)`` runs ``fn`` once while recording a
tape of the aten ops it dispatches, over the very tensor objects involved
(inputs, intermediates, outputs: all kept alive, like a graph's private memory
pool). ``replay()`` re-executes the tape and writes every result into the tensor
recorded at capture time, so outputs keep their identity and ``data_ptr`` and a
reference held from an earlier step is overwritten, as on CUDA.

What a real graph bakes in, the tape bakes in too: Python scalars computed during
capture (``.item()``, ``.tolist()``, ``len(...)`` of host data) are constants of
the recorded ops, and tensors rebound after capture are not seen. In strict mode
the first capture-unsafe call raises :class:`CaptureError`; in lenient mode it is
recorded in ``violations`` and the replay shows the resulting staleness.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..graphs import simulated_capture
from .rules import HostAccessMonitor, Violation

__all__ = ["GraphSimulator", "CaptureError"]


class CaptureError(RuntimeError):
    """A capture-unsafe operation (strict mode), or a replay that cannot match its capture."""


@dataclass
class _Step:
    func: torch._ops.OpOverload
    args: tuple
    kwargs: dict
    out: Any


def _storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _write_back(captured: Any, fresh: Any, func: torch._ops.OpOverload) -> None:
    """Copy a replayed result into the tensor(s) recorded at capture."""
    if isinstance(captured, torch.Tensor):
        if not isinstance(fresh, torch.Tensor):
            raise CaptureError(f"replay of {func} returned {type(fresh).__name__}, captured a tensor")
        if captured.shape != fresh.shape:
            raise CaptureError(
                f"replay of {func} produced shape {tuple(fresh.shape)} but capture produced "
                f"{tuple(captured.shape)}: graph outputs cannot change shape"
            )
        if captured.numel() and _storage_ptr(captured) != _storage_ptr(fresh):
            captured.copy_(fresh)
        # else: a view or an in-place result already aliasing the captured memory
    elif isinstance(captured, (tuple, list)):
        for c, f in zip(captured, fresh):
            _write_back(c, f, func)
    # Python scalars are baked into the ops that consumed them, as on real hardware.


class GraphSimulator:
    """Simulated graph capture on any device (CPU in CI).

    Args:
        strict: raise :class:`CaptureError` at the first capture-unsafe call
            (default); otherwise record it in :attr:`violations` and carry on.
    """

    def __init__(self, strict: bool = True) -> None:
        self.strict = strict
        self.violations: list[Violation] = []
        self._tape: list[_Step] = []
        self._captured = False
        self._outputs: Any = None

    @property
    def num_ops(self) -> int:
        """Aten ops on the tape (what a replay launches, views included)."""
        return len(self._tape)

    def _on_violation(self, violation: Violation) -> None:
        self.violations.append(violation)
        if self.strict:
            raise CaptureError(f"capture-unsafe: {violation}")

    def _on_op(self, func, args, kwargs, out) -> None:
        self._tape.append(_Step(func, args, kwargs, out))

    def capture(self, fn: Callable[..., Any], *static_inputs: Any) -> Any:
        """Run ``fn(*static_inputs)`` once under capture and return its outputs.

        Refill ``static_inputs`` in place, then :meth:`replay` to recompute the
        returned tensors in place.
        """
        if self._captured:
            raise CaptureError("this simulator already holds a capture; make a new GraphSimulator")
        real_sync = torch.cuda.synchronize

        def synchronize(*args, **kwargs):
            self._on_violation(
                Violation("device sync: torch.cuda.synchronize() is illegal during capture",
                          "torch.cuda.synchronize", "capture")
            )

        monitor = HostAccessMonitor(self._on_violation, self._on_op)
        torch.cuda.synchronize = synchronize
        try:
            with torch.no_grad(), simulated_capture(), monitor:
                self._outputs = fn(*static_inputs)
        finally:
            torch.cuda.synchronize = real_sync
        self._captured = True
        return self._outputs

    def replay(self) -> Any:
        """Re-execute the captured ops against the same tensors; returns the capture's outputs."""
        if not self._captured:
            raise CaptureError("replay() before capture()")
        if self.strict and self.violations:
            raise CaptureError(f"cannot replay a capture with violations: {self.violations[0]}")
        with torch.no_grad():
            for step in self._tape:
                fresh = step.func(*step.args, **step.kwargs)
                _write_back(step.out, fresh, step.func)
        return self._outputs
