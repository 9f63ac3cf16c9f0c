"""The one way tests run code on a device: :class:`TestDevice` (the ``device`` fixture's value).

Tests call ``device.run(fn, *inputs)`` (eager, or captured and replayed), or
``device.run_two_batches(fn, inputs, refill)`` for the capture-with-batch-A,
refill-with-batch-B, replay pattern that catches stale host data
(docs/graph-simulator.md). What differs between devices is asked of the
:class:`~.device_type.DeviceType`, never of its name.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from .device_type import DeviceType, Replay
from .registry import device_type

__all__ = ["TestDevice", "clone_outputs", "make_device"]


def clone_outputs(out: Any) -> Any:
    """Detached copies of a (nested) output, so later replays cannot overwrite them."""
    if isinstance(out, torch.Tensor):
        return out.detach().clone()
    if isinstance(out, (tuple, list)):
        return type(out)(clone_outputs(o) for o in out)
    return out


class TestDevice:
    """A device parameter: where tensors live (``torch_device``) and how code runs there.

    ``is_graph``: code is captured and replayed; ``simulated``: the capture is the strict
    CPU graph simulator's (see :class:`~.device_type.DeviceType`).
    """

    __test__ = False  # not a pytest test class

    def __init__(self, device_type: DeviceType) -> None:
        self.device_type = device_type
        self.name = device_type.name
        self.torch_device = torch.device(device_type.torch_device)
        self.is_graph = device_type.is_graph
        self.simulated = device_type.simulated

    def __repr__(self) -> str:
        return f"TestDevice({self.name!r})"

    def synchronize(self) -> None:
        """Wait for the work queued on this device."""
        self.device_type.synchronize()

    def capture(self, fn: Callable[..., Any], *inputs: Any, host_resident: Sequence[torch.Tensor] = ()
                ) -> tuple[Any, Replay]:
        """Capture ``fn(*inputs)`` on a graph device; returns its static outputs and a
        replay function that recomputes them in place from the (refilled) inputs.

        ``host_resident``: tensors the code keeps in host memory on real hardware (reads
        allowed and baked in; the simulated device reports a replay after they changed).
        """
        return self.device_type.capture(fn, *inputs, host_resident=tuple(host_resident))

    def run(self, fn: Callable[..., Any], *inputs: Any, host_resident: Sequence[torch.Tensor] = ()) -> Any:
        """``fn(*inputs)``: called on eager devices; captured and replayed once on graph devices."""
        if not self.is_graph:
            with torch.no_grad():
                return fn(*inputs)
        out, replay = self.capture(fn, *inputs, host_resident=host_resident)
        replay()
        return out

    def run_two_batches(
        self, fn: Callable[..., Any], inputs: Sequence[Any], refill: Callable[[], None],
        host_resident: Sequence[torch.Tensor] = (),
    ) -> tuple[Any, Any]:
        """Run ``fn`` on batch A, ``refill()`` the same input buffers in place with batch B,
        run again; returns copies of both outputs.

        On graph devices the second run is a *replay* of the capture made with A,
        so anything read on the host at capture time shows up as a wrong result for B.
        """
        if not self.is_graph:
            with torch.no_grad():
                out_a = clone_outputs(fn(*inputs))
                refill()
                return out_a, clone_outputs(fn(*inputs))
        out, replay = self.capture(fn, *inputs, host_resident=host_resident)
        replay()
        out_a = clone_outputs(out)
        refill()
        replay()
        return out_a, clone_outputs(out)

    def eager_and_replayed(
        self, fn: Callable[..., Any], inputs: Sequence[Any], set_batch_a: Callable[[], None],
        set_batch_b: Callable[[], None], enable_graph: Callable[[], None],
    ) -> tuple[tuple[Any, Any], tuple[Any, Any]]:
        """The check of a served model in graph mode: ``((eager_a, eager_b), (out_a, out_b))``.

        ``eager_a`` / ``eager_b`` are ``fn(*inputs)`` run eagerly after ``set_batch_a()`` /
        ``set_batch_b()`` (what each batch must give); then, on a graph device, ``enable_graph()``
        switches the model to its preallocated batch, and :meth:`run_two_batches` runs batch A
        (captured or compiled) and batch B (replayed) in the same buffers.
        """
        eager = []
        for set_batch in (set_batch_a, set_batch_b):
            set_batch()
            with torch.no_grad():
                eager.append(clone_outputs(fn(*inputs)))
        if self.is_graph:
            enable_graph()
        set_batch_a()
        return (eager[0], eager[1]), self.run_two_batches(fn, inputs, set_batch_b)


def make_device(name: str) -> TestDevice:
    """The :class:`TestDevice` for a device parameter (probe it first with ``probe_device``)."""
    return TestDevice(device_type(name))
