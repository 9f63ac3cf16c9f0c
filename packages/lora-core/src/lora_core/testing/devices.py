"""The device matrix tests run on, and the one way tests run code on a device (SPEC §5).

Devices: ``cpu``, ``cpu-graphsim`` (graph capture simulated on CPU), ``cuda``,
``cuda-graph`` (real ``torch.cuda.CUDAGraph``), ``npu`` (eager, via torch_npu).
Probes never raise and never initialise CUDA: they only ask whether a device is
visible.

Tests call ``device.run(fn, *inputs)`` (eager, or captured and replayed), or
``device.run_two_batches(fn, inputs, refill)`` for the capture-with-batch-A,
refill-with-batch-B, replay pattern that catches stale host data.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from .graphsim import GraphSimulator

__all__ = [
    "DEVICE_NAMES",
    "DeviceProbe",
    "TestDevice",
    "probe_device",
    "make_device",
    "clone_outputs",
]

DEVICE_NAMES = ("cpu", "cpu-graphsim", "cuda", "cuda-graph", "npu")


@dataclass(frozen=True)
class DeviceProbe:
    """Whether a device parameter can run here, and what was probed to decide."""

    name: str
    available: bool
    reason: str


def _probe_cuda(name: str) -> DeviceProbe:
    if torch.version.cuda is None:
        return DeviceProbe(name, False, f"torch {torch.__version__} is built without CUDA")
    try:
        count = torch.cuda.device_count()
    except Exception as exc:  # a broken driver must not break collection
        return DeviceProbe(name, False, f"torch.cuda.device_count() failed: {exc}")
    if count == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        extra = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        return DeviceProbe(name, False, f"no CUDA device visible to torch {torch.__version__}{extra}")
    if name == "cuda-graph" and not hasattr(torch.cuda, "CUDAGraph"):
        return DeviceProbe(name, False, "torch.cuda.CUDAGraph is unavailable in this torch build")
    return DeviceProbe(name, True, f"{count} CUDA device(s), CUDA {torch.version.cuda}")


def _probe_npu(name: str) -> DeviceProbe:
    if importlib.util.find_spec("torch_npu") is None:
        return DeviceProbe(name, False, "torch_npu is not installed (pip install lora-ascend[npu])")
    try:
        import torch_npu  # noqa: F401

        available = torch.npu.is_available()
        count = torch.npu.device_count() if available else 0
    except Exception as exc:  # torch_npu without the CANN stack raises on import
        return DeviceProbe(name, False, f"torch_npu failed to load (CANN driver stack missing?): {exc}")
    if not count:
        return DeviceProbe(name, False, "torch_npu is installed but sees no NPU")
    return DeviceProbe(name, True, f"{count} NPU device(s)")


@functools.lru_cache(maxsize=None)
def probe_device(name: str) -> DeviceProbe:
    """Probe one device parameter (cached for the process)."""
    if name in ("cpu", "cpu-graphsim"):
        return DeviceProbe(name, True, f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if name in ("cuda", "cuda-graph"):
        return _probe_cuda(name)
    if name == "npu":
        return _probe_npu(name)
    raise ValueError(f"unknown device {name!r}; expected one of {', '.join(DEVICE_NAMES)}")


def clone_outputs(out: Any) -> Any:
    """Detached copies of a (nested) output, so later replays cannot overwrite them."""
    if isinstance(out, torch.Tensor):
        return out.detach().clone()
    if isinstance(out, (tuple, list)):
        return type(out)(clone_outputs(o) for o in out)
    return out


class TestDevice:
    """A device parameter: where tensors live (``torch_device``) and how code runs there."""

    __test__ = False  # not a pytest test class

    def __init__(self, name: str, torch_device: str, is_graph: bool) -> None:
        self.name = name
        self.torch_device = torch.device(torch_device)
        self.is_graph = is_graph

    def __repr__(self) -> str:
        return f"TestDevice({self.name!r})"

    def capture(self, fn: Callable[..., Any], *inputs: Any) -> tuple[Any, Callable[[], None]]:
        """Capture ``fn(*inputs)`` on a graph device; returns its static outputs and a
        replay function that recomputes them in place from the (refilled) inputs."""
        if self.name == "cpu-graphsim":
            sim = GraphSimulator(strict=True)
            return sim.capture(fn, *inputs), sim.replay
        if self.name == "cuda-graph":
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn(*inputs)  # warm-up: lazy initialisation and allocator growth happen here
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = fn(*inputs)

            def replay() -> None:
                graph.replay()
                torch.cuda.synchronize()

            return out, replay
        raise RuntimeError(f"{self.name} is not a graph device")

    def run(self, fn: Callable[..., Any], *inputs: Any) -> Any:
        """``fn(*inputs)``: called on eager devices; captured and replayed once on graph devices."""
        if not self.is_graph:
            with torch.no_grad():
                return fn(*inputs)
        out, replay = self.capture(fn, *inputs)
        replay()
        return out

    def run_two_batches(
        self, fn: Callable[..., Any], inputs: Sequence[Any], refill: Callable[[], None]
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
        out, replay = self.capture(fn, *inputs)
        replay()
        out_a = clone_outputs(out)
        refill()
        replay()
        return out_a, clone_outputs(out)


def make_device(name: str) -> TestDevice:
    """The :class:`TestDevice` for a device parameter (probe it first)."""
    torch_device = {"cpu": "cpu", "cpu-graphsim": "cpu", "cuda": "cuda", "cuda-graph": "cuda", "npu": "npu"}
    if name not in torch_device:
        raise ValueError(f"unknown device {name!r}; expected one of {', '.join(DEVICE_NAMES)}")
    return TestDevice(name, torch_device[name], is_graph=name.endswith(("-graph", "-graphsim")))
