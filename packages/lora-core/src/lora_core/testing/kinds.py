"""lora-core's own device kinds: ``cpu``, ``cpu-graphsim``, ``cpu-compile``, ``cuda``,
``cuda-graph``, ``cuda-compile``, ``npu``, ``npu-graph``.

Each is registered in lora-core's ``pyproject.toml`` under the ``lora_core.devices``
entry-point group, as another package's kinds would be (docs/testing.md, "Adding a
device"). A graph kind is its eager kind plus a capture mixin:

* :class:`StreamGraphCapture` -- real device graphs (``torch.cuda.CUDAGraph``,
  ``torch.npu.NPUGraph``): warm-up on a side stream, capture, replay and synchronise;
  one implementation for every device module that has ``Stream``, ``graph`` and a
  graph class;
* :class:`~.compiled.CompileCapture` -- ``torch.compile(fullgraph=True)``;
* :class:`CpuGraphSimDevice` -- the strict CPU graph simulator (``simulated``).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any, Callable

import torch

from .compiled import CompileCapture
from .device_type import DeviceProbe, DeviceType, Replay
from .graphsim import GraphSimulator

__all__ = [
    "CpuDevice", "CpuGraphSimDevice", "CpuCompileDevice",
    "CudaDevice", "CudaGraphDevice", "CudaCompileDevice",
    "NpuDevice", "NpuGraphDevice",
    "StreamGraphCapture",
]


class CpuDevice(DeviceType):
    """Eager on CPU."""

    name, torch_device, order = "cpu", "cpu", 0

    def probe(self) -> DeviceProbe:
        return self._probe(True, f"torch {torch.__version__}, {torch.get_num_threads()} threads")


class CpuGraphSimDevice(CpuDevice):
    """Graph capture simulated on CPU by a strict :class:`~lora_core.testing.GraphSimulator`.

    Like the device harnesses it warms up once before capturing. The replay raises
    :class:`~lora_core.testing.CaptureError` if a declared host-resident tensor that
    the capture read has changed since (a real graph would replay the stale value).
    """

    name, is_graph, simulated, order = "cpu-graphsim", True, True, 10

    def record(self, fn: Callable[..., Any], *inputs: Any, host_resident: tuple[torch.Tensor, ...] = ()
               ) -> tuple[Any, Replay]:
        sim = GraphSimulator(strict=True, host_resident=host_resident)
        return sim.capture(fn, *inputs), sim.replay


class CpuCompileDevice(CompileCapture, CpuDevice):
    """``torch.compile(fullgraph=True)`` on CPU: warm-up, compile with batch A, call again after
    refilling batch B; any recompile fails (:func:`~lora_core.testing.compile_capture`)."""

    name, order = "cpu-compile", 20


class StreamGraphCapture(DeviceType):
    """Real device-graph capture for a torch device module with ``Stream``, ``graph`` and
    ``graph_class`` (``torch.cuda`` and ``CUDAGraph``, ``torch.npu`` and ``NPUGraph``).

    Mix it in before the eager kind: ``class CudaGraphDevice(StreamGraphCapture, CudaDevice)``.
    """

    is_graph = True
    graph_class: str

    def _module(self) -> Any:
        return getattr(torch, self.torch_device)

    def probe(self) -> DeviceProbe:
        probe = super().probe()
        module = getattr(torch, self.torch_device, None)
        if probe.available and not (hasattr(module, self.graph_class) and hasattr(module, "graph")):
            return self._probe(False, f"torch.{self.torch_device}.{self.graph_class} / "
                                      f"torch.{self.torch_device}.graph are unavailable in this build")
        return probe

    def warm_up(self, fn: Callable[..., Any], *inputs: Any) -> None:
        """Run ``fn`` once on a side stream: lazy initialisation and allocator growth happen there."""
        module = self._module()
        side = module.Stream()
        side.wait_stream(module.current_stream())
        with module.stream(side), torch.no_grad():
            fn(*inputs)
        module.current_stream().wait_stream(side)

    def record(self, fn: Callable[..., Any], *inputs: Any, host_resident: tuple[torch.Tensor, ...] = ()
               ) -> tuple[Any, Replay]:
        module = self._module()
        graph = getattr(module, self.graph_class)()
        with module.graph(graph), torch.no_grad():
            out = fn(*inputs)

        def replay() -> None:
            graph.replay()
            self.synchronize()

        return out, replay


class CudaDevice(DeviceType):
    """Eager on a CUDA GPU."""

    name, torch_device, order = "cuda", "cuda", 30

    def probe(self) -> DeviceProbe:
        if torch.version.cuda is None:
            return self._probe(False, f"torch {torch.__version__} is built without CUDA")
        try:
            count = torch.cuda.device_count()
        except Exception as exc:  # a broken driver must not break collection
            return self._probe(False, f"torch.cuda.device_count() failed: {exc}")
        if count == 0:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            extra = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
            return self._probe(False, f"no CUDA device visible to torch {torch.__version__}{extra}")
        return self._probe(True, f"{count} CUDA device(s), CUDA {torch.version.cuda}")


class CudaGraphDevice(StreamGraphCapture, CudaDevice):
    """Real ``torch.cuda.CUDAGraph`` capture (after a warm-up on a side stream) and replay."""

    name, graph_class, order = "cuda-graph", "CUDAGraph", 40


class CudaCompileDevice(CompileCapture, CudaDevice):
    """``torch.compile(fullgraph=True)`` on a CUDA GPU, as ``cpu-compile`` (synchronised after each call)."""

    name, order = "cuda-compile", 50


class NpuDevice(DeviceType):
    """Eager on an Ascend NPU through torch_npu."""

    name, torch_device, order = "npu", "npu", 60

    def probe(self) -> DeviceProbe:
        if importlib.util.find_spec("torch_npu") is None:
            return self._probe(False, "torch_npu is not installed (pip install torch_npu, with the CANN stack: docs/ascend.md)")
        try:
            import torch_npu  # noqa: F401

            available = torch.npu.is_available()
            count = torch.npu.device_count() if available else 0
        except Exception as exc:  # torch_npu without the CANN stack raises on import
            return self._probe(False, f"torch_npu failed to load (CANN driver stack missing?): {exc}")
        if not count:
            return self._probe(False, "torch_npu is installed but sees no NPU")
        return self._probe(True, f"{count} NPU device(s)")


class NpuGraphDevice(StreamGraphCapture, NpuDevice):
    """Real ``torch.npu.NPUGraph`` capture (after a warm-up on a side stream) and replay."""

    name, graph_class, order = "npu-graph", "NPUGraph", 70
