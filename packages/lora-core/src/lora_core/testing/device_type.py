"""What a device kind is: its probe, its synchronisation and (for graph kinds) its capture.

After PyTorch's ``common_device_type``: each device kind is a small class that owns
everything that differs between devices, so the harness (:mod:`.harness`), the pytest
plugin and ``lora-sim`` ask the kind instead of branching on its name:

* :meth:`DeviceType.probe` -- can it run here, and why (never raises, never
  initialises the device);
* :meth:`DeviceType.synchronize` -- wait for the work queued on it;
* :meth:`DeviceType.capture` -- for graph kinds, the one capture method: warm up
  (:meth:`DeviceType.warm_up`), record (:meth:`DeviceType.record`), and hand back the
  static outputs and a replay function that replays and synchronises;
* :attr:`DeviceType.simulated` -- whether the capture is the strict CPU simulation, so
  a successful capture proves the code free of the host reads the simulator checks.

Kinds are registered through the ``lora_core.devices`` entry-point group
(:mod:`.registry`); lora-core's own kinds (:mod:`.kinds`) register the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

__all__ = ["DeviceProbe", "DeviceType", "Replay"]

Replay = Callable[[], Any]
"""Recomputes a capture's outputs in place from the (refilled) inputs."""


@dataclass(frozen=True)
class DeviceProbe:
    """Whether a device parameter can run here (``available``), and what was probed to decide (``reason``)."""

    name: str
    available: bool
    reason: str


class DeviceType:
    """One device parameter.

    Class attributes a kind sets:

    * ``name``: the parameter and report name (``"cuda-graph"``); it must equal the
      name of the kind's ``lora_core.devices`` entry point;
    * ``torch_device``: where its tensors live (``"cuda"``);
    * ``is_graph``: the harness captures and replays instead of calling eagerly;
    * ``simulated``: the capture is simulated on the host by the strict graph
      simulator (a passing capture is a graph-safety verdict, not a hardware run);
    * ``order``: its place among the device parameters (test and report order;
      lora-core's kinds use 0-99, other packages' kinds default to 100, ties by name).

    A graph kind overrides :meth:`record` (and, where it needs one, :meth:`warm_up`);
    :meth:`capture` is the same for every kind.
    """

    name: str
    torch_device: str
    is_graph: bool = False
    simulated: bool = False
    order: int = 100

    def probe(self) -> DeviceProbe:
        """Whether this kind can run here. Must never raise and never initialise the device:
        probes run in every test process, CPU-only ones too."""
        raise NotImplementedError(f"{type(self).__name__} must implement probe()")

    def synchronize(self) -> None:
        """Wait for the work queued on this device: ``torch.<torch_device>.synchronize()``
        where torch has one (``cuda``, ``npu``, ``xpu``, ``mps``); host work is already done."""
        module = getattr(torch, self.torch_device, None)
        sync = getattr(module, "synchronize", None)
        if sync is not None and self.torch_device != "cpu":
            sync()

    def warm_up(self, fn: Callable[..., Any], *inputs: Any) -> None:
        """Run ``fn(*inputs)`` once before capturing, so lazy set-up (plans, workspaces,
        allocator growth) happens outside the capture, as real graph users do."""
        with torch.no_grad():
            fn(*inputs)

    def record(self, fn: Callable[..., Any], *inputs: Any, host_resident: tuple[torch.Tensor, ...] = ()
               ) -> tuple[Any, Replay]:
        """Capture ``fn(*inputs)`` (already warmed up): its static outputs and a replay function
        that recomputes them in place and synchronises. Graph kinds implement it.

        ``host_resident``: tensors the code under test keeps in host memory on a real device
        (reads allowed, baked into the capture); only a simulated kind can tell them apart.
        """
        raise RuntimeError(f"{self.name} is not a graph device: call fn directly (is_graph is False)")

    def capture(self, fn: Callable[..., Any], *inputs: Any, host_resident: tuple[torch.Tensor, ...] = ()
                ) -> tuple[Any, Replay]:
        """Warm up, then capture ``fn(*inputs)``; returns its static outputs and a replay function.

        Raises ``RuntimeError`` on an eager kind.
        """
        if not self.is_graph:
            raise RuntimeError(f"{self.name} is not a graph device: call fn directly (is_graph is False)")
        self.warm_up(fn, *inputs)
        return self.record(fn, *inputs, host_resident=tuple(host_resident))

    def _probe(self, available: bool, reason: str) -> DeviceProbe:
        return DeviceProbe(self.name, available, reason)

    def __repr__(self) -> str:
        return f"<device kind {self.name!r}>"
