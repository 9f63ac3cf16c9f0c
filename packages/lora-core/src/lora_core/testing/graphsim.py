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

Host-resident tensors (``host_resident=``) model metadata that real code keeps in
CPU memory beside its device tensors (sglang's ``output_offset_cpu``): reading them
during a capture is legal on real hardware, so it is allowed here, and the value read
is baked in; a :meth:`GraphSimulator.replay` after such a tensor changed is stale and
reported (raised in strict mode, recorded in ``violations`` otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ..graphs import simulated_capture
from .rules import HostAccessMonitor, Violation, call_site

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


_BY_VALUE = (bool, int, float, complex, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def _signature(value: Any) -> Any:
    """``value`` with tensors as ``(shape, dtype)``, Python numbers, strings, dtypes and devices
    by value (their ``repr``: a NaN constant equals itself), and any other object by its type
    (a generator made on each call is the same argument each time)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    if isinstance(value, (list, tuple)):
        return tuple(_signature(v) for v in value)
    return repr(value) if isinstance(value, _BY_VALUE) else type(value).__qualname__


def _host_values(step: _Step) -> tuple:
    """The Python data a step lifted into a tensor (``torch.tensor(step)``): a constant of the
    graph, compared by value."""
    if step.func.overloadpacket.__name__ in ("lift_fresh", "lift_fresh_copy") and step.args \
            and isinstance(step.args[0], torch.Tensor):
        return (repr(step.args[0].tolist()),)
    return ()


class GraphSimulator:
    """Simulated graph capture on any device (CPU in CI).

    Args:
        strict: raise :class:`CaptureError` at the first capture-unsafe call
            (default); otherwise record it in :attr:`violations` and carry on.
        host_resident: tensors that live in host memory on real hardware; reading them
            (or views of them) during capture is allowed and baked in, and a replay
            after a read one changed is reported as stale.
    """

    def __init__(self, strict: bool = True, host_resident: Sequence[torch.Tensor] = ()) -> None:
        for i, t in enumerate(host_resident):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"host_resident[{i}] must be a torch.Tensor, got {type(t).__name__}")
        self.strict = strict
        self.violations: list[Violation] = []
        self._tape: list[_Step] = []
        self._captured = False
        self._outputs: Any = None
        self._resident = {_storage_ptr(t) for t in host_resident}
        self._resident_reads: list[tuple[torch.Tensor, torch.Tensor, Violation]] = []

    def _on_host_read(self, tensor: torch.Tensor, violation: Violation) -> bool:
        """Allow (and remember, with the value read) a read of a host-resident tensor."""
        if not self._resident or _storage_ptr(tensor) not in self._resident:
            return False
        self._resident_reads.append((tensor, tensor.detach().clone(), violation))
        return True

    def _check_stale(self) -> None:
        for tensor, value, read in self._resident_reads:
            if not torch.equal(tensor, value):
                self._on_violation(Violation(
                    "stale replay: a host-resident tensor read during capture has changed since; "
                    "a real graph replays the value read then", read.op, read.where))

    @property
    def num_ops(self) -> int:
        """Aten ops on the tape (what a replay launches, views included)."""
        return len(self._tape)

    def recorded_ops(self) -> list[tuple[str, tuple]]:
        """What the capture baked in, op by op: the op and its arguments, each tensor as its
        shape and dtype and every other argument (a Python number, a size, a dtype) by value.
        Two captures of one call differ here only if the call read host data that changed
        between them."""
        return [(str(step.func), _signature((step.args, sorted(step.kwargs.items()))) + _host_values(step))
                for step in self._tape]

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
                          "torch.cuda.synchronize", call_site())
            )

        monitor = HostAccessMonitor(self._on_violation, self._on_op, self._on_host_read)
        # For the capture only, torch.cuda answers as inside a real capture: synchronize() is a
        # violation, and is_current_stream_capturing() is True, so code that takes a capture-safe
        # path when asked (transformers' is_tracing) takes it here too.
        real_capturing = torch.cuda.is_current_stream_capturing
        torch.cuda.synchronize = synchronize
        torch.cuda.is_current_stream_capturing = lambda: True
        try:
            with torch.no_grad(), simulated_capture(), monitor:
                self._outputs = fn(*static_inputs)
        finally:
            torch.cuda.synchronize = real_sync
            torch.cuda.is_current_stream_capturing = real_capturing
        self._captured = True
        return self._outputs

    def replay(self) -> Any:
        """Re-execute the captured ops against the same tensors; returns the capture's outputs."""
        if not self._captured:
            raise CaptureError("replay() before capture()")
        if self.strict and self.violations:
            raise CaptureError(f"cannot replay a capture with violations: {self.violations[0]}")
        self._check_stale()
        with torch.no_grad():
            for step in self._tape:
                fresh = step.func(*step.args, **step.kwargs)
                _write_back(step.out, fresh, step.func)
        return self._outputs
