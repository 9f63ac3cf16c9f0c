"""The device matrix tests run on, and the one way tests run code on a device.

One small class per device kind, in one list (:data:`DEVICE_TYPES`), after
PyTorch's ``common_device_type``: each says which torch device it uses, how to
probe for it, and (for graph kinds) how to capture and replay. Adding a device
is adding a class to the list (docs/adding-a-backend.md).

Probes never raise and never initialise CUDA: they only ask whether a device is
visible. Tests call ``device.run(fn, *inputs)`` (eager, or captured and
replayed), or ``device.run_two_batches(fn, inputs, refill)`` for the
capture-with-batch-A, refill-with-batch-B, replay pattern that catches stale
host data (docs/graph-simulator.md).

The compile kinds (``cpu-compile``, ``cuda-compile``) are graph kinds whose
capture is ``torch.compile(fn, fullgraph=True)`` (:func:`compile_capture`) and
whose replay calls the compiled function again, failing on any recompile: a
refilled batch must reuse the code compiled for the first (docs/compile.md).
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
    "COMPILE_BACKEND",
    "CompiledReplay",
    "DEVICE_NAMES",
    "DEVICE_TYPES",
    "DeviceProbe",
    "DeviceType",
    "TestDevice",
    "compile_capture",
    "probe_device",
    "make_device",
    "clone_outputs",
]

Replay = Callable[[], None]


@dataclass(frozen=True)
class DeviceProbe:
    """Whether a device parameter can run here, and what was probed to decide."""

    name: str
    available: bool
    reason: str


class DeviceType:
    """One device parameter: its name, its torch device type and how to probe it.

    Graph kinds (``is_graph``) also implement :meth:`capture`.
    """

    name: str
    torch_device: str
    is_graph: bool = False

    def probe(self) -> DeviceProbe:
        raise NotImplementedError

    def capture(self, fn: Callable[..., Any], *inputs: Any) -> tuple[Any, Replay]:
        """Capture ``fn(*inputs)``; returns its static outputs and a replay function."""
        raise RuntimeError(f"{self.name} is not a graph device")

    def _probe(self, available: bool, reason: str) -> DeviceProbe:
        return DeviceProbe(self.name, available, reason)


class CpuDevice(DeviceType):
    """Eager on CPU."""

    name, torch_device = "cpu", "cpu"

    def probe(self) -> DeviceProbe:
        return self._probe(True, f"torch {torch.__version__}, {torch.get_num_threads()} threads")


class CpuGraphSimDevice(CpuDevice):
    """Graph capture simulated on CPU by :class:`~lora_core.testing.GraphSimulator` (strict).

    Like the CUDA harness it runs ``fn`` once before capturing (warm-up), so lazy
    set-up happens outside the capture, as real graph users do.
    """

    name, is_graph = "cpu-graphsim", True

    def capture(self, fn: Callable[..., Any], *inputs: Any) -> tuple[Any, Replay]:
        with torch.no_grad():
            fn(*inputs)  # warm-up
        sim = GraphSimulator(strict=True)
        return sim.capture(fn, *inputs), sim.replay


COMPILE_BACKEND = "aot_eager"
"""The ``torch.compile`` backend of the compile device kinds: tracing, fake tensors and
functionalization as every backend has them, without inductor's code generation (fast)."""


def _copy_outputs(static: Any, new: Any) -> None:
    """Write a call's (nested) outputs into the first call's, in place."""
    if isinstance(static, torch.Tensor):
        if new is not static:
            static.copy_(new)
    elif isinstance(static, (tuple, list)):
        for s, n in zip(static, new):
            _copy_outputs(s, n)


class _CountingBackend:
    """A ``torch.compile`` backend that counts the graphs it compiles, then hands them to ``backend``."""

    def __init__(self, backend: str | Callable) -> None:
        self.backend, self.compiles = backend, 0

    def __call__(self, gm: Any, example_inputs: Any) -> Any:
        self.compiles += 1
        import torch._dynamo

        backend = torch._dynamo.lookup_backend(self.backend) if isinstance(self.backend, str) else self.backend
        return backend(gm, example_inputs)


class CompiledReplay:
    """The replay function of :func:`compile_capture`: calls the compiled function again on
    the (refilled) inputs and writes the result into the first call's outputs.

    Any recompile fails the replay (``torch._dynamo.exc.RecompileError``, a
    ``RuntimeError``), as does a replay that compiled anything at all; :attr:`compiles`
    counts the graphs compiled since the capture began (1 after the capture) and
    :attr:`replays` the replays so far.
    """

    def __init__(self, compiled: Callable[..., Any], inputs: Sequence[Any], out: Any, counter: _CountingBackend,
                 sync: Callable[[], None] | None) -> None:
        self._compiled, self._inputs, self._out, self._counter, self._sync = compiled, inputs, out, counter, sync
        self.replays = 0

    @property
    def compiles(self) -> int:
        return self._counter.compiles

    @property
    def recompiles(self) -> int:
        """Compiles after the first (always 0 after a successful replay)."""
        return max(0, self.compiles - 1)

    def __call__(self) -> None:
        import torch._dynamo

        before = self._counter.compiles
        with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
            new = self._compiled(*self._inputs)
        if self._counter.compiles != before:
            raise RuntimeError(f"replay {self.replays + 1} compiled {self._counter.compiles - before} more graph(s): "
                               "the compiled code must be reused as is for a refilled batch")
        _copy_outputs(self._out, new)
        if self._sync is not None:
            self._sync()
        self.replays += 1


def compile_capture(fn: Callable[..., Any], *inputs: Any, backend: str | Callable = COMPILE_BACKEND,
                    sync: Callable[[], None] | None = None) -> tuple[Any, CompiledReplay]:
    """``torch.compile(fn, fullgraph=True, backend=backend)`` called on ``inputs``: its outputs and a
    :class:`CompiledReplay` that recomputes them in place, failing on any recompile.

    Like the graph harnesses it first runs ``fn`` once eagerly (warm-up: lazy plans,
    column tables and workspaces are made outside the compiled region), and it resets
    dynamo's caches, so the compile is the first for ``fn``'s code whatever ran before.
    ``fullgraph=True``: a graph break is an error, not a silent fall back to eager code.
    """
    import torch._dynamo

    with torch.no_grad():
        fn(*inputs)  # warm-up
    torch._dynamo.reset()
    counter = _CountingBackend(backend)
    compiled = torch.compile(fn, backend=counter, fullgraph=True)
    with torch.no_grad():
        out = compiled(*inputs)
    if counter.compiles != 1:
        raise RuntimeError(f"torch.compile produced {counter.compiles} graphs for one call with fullgraph=True")
    if sync is not None:
        sync()
    return out, CompiledReplay(compiled, inputs, out, counter, sync)


def _probe_compile(device: DeviceType, probe: DeviceProbe, backend: str) -> DeviceProbe:
    if not probe.available:
        return probe
    try:
        import torch._dynamo

        supported = torch._dynamo.is_dynamo_supported()
    except Exception as exc:  # a broken install must not break collection
        return device._probe(False, f"torch._dynamo failed to load: {exc}")
    if not supported:
        return device._probe(False, f"torch.compile is not supported on this Python with torch {torch.__version__}")
    return device._probe(True, f"{probe.reason}; torch.compile(fullgraph=True, backend={backend!r})")


class CpuCompileDevice(CpuDevice):
    """``torch.compile(fullgraph=True)`` on CPU: warm-up, compile with batch A, call again after
    refilling batch B; any recompile fails (:func:`compile_capture`)."""

    name, is_graph = "cpu-compile", True
    compile_backend = COMPILE_BACKEND

    def probe(self) -> DeviceProbe:
        return _probe_compile(self, super().probe(), self.compile_backend)

    def capture(self, fn: Callable[..., Any], *inputs: Any) -> tuple[Any, Replay]:
        return compile_capture(fn, *inputs, backend=self.compile_backend)


class CudaDevice(DeviceType):
    """Eager on a CUDA GPU."""

    name, torch_device = "cuda", "cuda"

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


class CudaGraphDevice(CudaDevice):
    """Real ``torch.cuda.CUDAGraph`` capture (after a warm-up on a side stream) and replay."""

    name, is_graph = "cuda-graph", True

    def probe(self) -> DeviceProbe:
        probe = super().probe()
        if probe.available and not hasattr(torch.cuda, "CUDAGraph"):
            return self._probe(False, "torch.cuda.CUDAGraph is unavailable in this torch build")
        return probe

    def capture(self, fn: Callable[..., Any], *inputs: Any) -> tuple[Any, Replay]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad():
            fn(*inputs)  # warm-up: lazy initialisation and allocator growth happen here
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), torch.no_grad():
            out = fn(*inputs)

        def replay() -> None:
            graph.replay()
            torch.cuda.synchronize()

        return out, replay


class CudaCompileDevice(CudaDevice):
    """``torch.compile(fullgraph=True)`` on a CUDA GPU, as ``cpu-compile`` (synchronised after each call)."""

    name, is_graph = "cuda-compile", True
    compile_backend = COMPILE_BACKEND

    def probe(self) -> DeviceProbe:
        return _probe_compile(self, super().probe(), self.compile_backend)

    def capture(self, fn: Callable[..., Any], *inputs: Any) -> tuple[Any, Replay]:
        return compile_capture(fn, *inputs, backend=self.compile_backend, sync=torch.cuda.synchronize)


class NpuDevice(DeviceType):
    """Eager on an Ascend NPU through torch_npu."""

    name, torch_device = "npu", "npu"

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


class NpuGraphDevice(NpuDevice):
    """Real ``torch.npu.NPUGraph`` capture (after a warm-up on a side stream) and replay."""

    name, is_graph = "npu-graph", True

    def probe(self) -> DeviceProbe:
        probe = super().probe()
        if probe.available and not (hasattr(torch.npu, "NPUGraph") and hasattr(torch.npu, "graph")):
            return self._probe(False, "torch.npu.NPUGraph / torch.npu.graph are unavailable in this torch_npu")
        return probe

    def capture(self, fn: Callable[..., Any], *inputs: Any) -> tuple[Any, Replay]:
        npu = torch.npu
        side = npu.Stream()
        side.wait_stream(npu.current_stream())
        with npu.stream(side), torch.no_grad():
            fn(*inputs)  # warm-up
        npu.current_stream().wait_stream(side)
        graph = npu.NPUGraph()
        with npu.graph(graph), torch.no_grad():
            out = fn(*inputs)

        def replay() -> None:
            graph.replay()
            npu.synchronize()

        return out, replay


DEVICE_TYPES: tuple[DeviceType, ...] = (
    CpuDevice(), CpuGraphSimDevice(), CpuCompileDevice(),
    CudaDevice(), CudaGraphDevice(), CudaCompileDevice(),
    NpuDevice(), NpuGraphDevice(),
)
"""Every device parameter, in test order."""

DEVICE_NAMES = tuple(t.name for t in DEVICE_TYPES)

_BY_NAME = {t.name: t for t in DEVICE_TYPES}


def _device_type(name: str) -> DeviceType:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown device {name!r}; expected one of {', '.join(DEVICE_NAMES)}") from None


@functools.lru_cache(maxsize=None)
def probe_device(name: str) -> DeviceProbe:
    """Probe one device parameter (cached for the process)."""
    return _device_type(name).probe()


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

    def __init__(self, device_type: DeviceType) -> None:
        self.device_type = device_type
        self.name = device_type.name
        self.torch_device = torch.device(device_type.torch_device)
        self.is_graph = device_type.is_graph

    def __repr__(self) -> str:
        return f"TestDevice({self.name!r})"

    def capture(self, fn: Callable[..., Any], *inputs: Any) -> tuple[Any, Replay]:
        """Capture ``fn(*inputs)`` on a graph device; returns its static outputs and a
        replay function that recomputes them in place from the (refilled) inputs."""
        return self.device_type.capture(fn, *inputs)

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
    return TestDevice(_device_type(name))
