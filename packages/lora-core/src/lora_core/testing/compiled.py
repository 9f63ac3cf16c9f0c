"""The compile device kinds' capture: ``torch.compile(fn, fullgraph=True)``, replayed by calling
the compiled function again and failing on any recompile (docs/compile.md).

A refilled batch must reuse the code compiled for the first: :class:`CompiledReplay`
raises if a replay compiles anything. :class:`CompileCapture` is the part the
``cpu-compile`` and ``cuda-compile`` kinds share (probe check and record).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from .device_type import DeviceProbe, DeviceType, Replay

__all__ = ["COMPILE_BACKEND", "CompileCapture", "CompiledReplay", "compile_capture", "fastest_compile_backend"]


COMPILE_BACKEND = "aot_eager"
"""The ``torch.compile`` backend of the compile device kinds: tracing, fake tensors and
functionalization as every backend has them, without inductor's code generation (fast)."""


def fastest_compile_backend(device_type: str) -> tuple[str, str]:
    """The ``torch.compile`` backend that gives the fastest code on ``device_type`` here, and why.

    ``"inductor"`` where it can generate code: on ``"cpu"`` it needs the C++ compiler it
    would use (``torch._inductor.cpp_builder.get_cpp_compiler``: ``$CXX`` or ``g++``/``clang++``
    on ``PATH``), on ``"cuda"`` Triton. Elsewhere ``"aot_eager"`` (traced and functionalized,
    run op by op), with the reason. The test kinds keep :data:`COMPILE_BACKEND` (fast to
    compile); timings use this.
    """
    if device_type == "cpu":
        try:
            from torch._inductor.cpp_builder import get_cpp_compiler

            return "inductor", f"C++ compiler {get_cpp_compiler()}"
        except Exception as exc:  # inductor's search raises its own error type when none is found
            return "aot_eager", f"inductor needs a C++ compiler on CPU: {str(exc).splitlines()[0]}"
    if device_type == "cuda":
        from torch.utils._triton import has_triton

        return ("inductor", "Triton") if has_triton() else ("aot_eager", "inductor needs Triton on CUDA")
    return "aot_eager", f"inductor does not generate {device_type} code"


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
    with torch.no_grad():
        fn(*inputs)  # warm-up
    return _compile_and_call(fn, inputs, backend, sync)


def _compile_and_call(fn: Callable[..., Any], inputs: Sequence[Any], backend: str | Callable,
                      sync: Callable[[], None] | None) -> tuple[Any, CompiledReplay]:
    """The capture of :func:`compile_capture` after its warm-up: reset dynamo, compile, call once."""
    import torch._dynamo

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




class CompileCapture(DeviceType):
    """What the compile kinds add to their eager kind: a probe that also checks dynamo, and a
    capture that is :func:`compile_capture` with ``compile_backend``, synchronised after each call.

    Mix it in before the eager kind: ``class CudaCompileDevice(CompileCapture, CudaDevice)``.
    """

    is_graph = True
    compile_backend: str = COMPILE_BACKEND

    def probe(self) -> DeviceProbe:
        return _probe_compile(self, super().probe(), self.compile_backend)

    def record(self, fn: Callable[..., Any], *inputs: Any, host_resident: tuple[torch.Tensor, ...] = ()
               ) -> tuple[Any, Replay]:
        return _compile_and_call(fn, inputs, self.compile_backend, self.synchronize)
