"""What breaks under graph capture: host reads, device syncs, data-dependent shapes.

Two interception layers see different things (docs/graph-simulator.md):

* the torch-function layer sees Tensor methods that never reach the dispatcher
  (``tolist``, ``numpy``, ``cpu``, ``__bool__`` ...);
* the dispatch layer sees aten ops after decomposition (``_local_scalar_dense``,
  ``nonzero``, boolean-mask ``index``, ``repeat_interleave`` without ``output_size``).

:class:`HostAccessMonitor` installs both and calls back with a :class:`Violation`;
the graph simulator and the launch counter share it.
"""

from __future__ import annotations

import os
import re
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["Violation", "HostAccessMonitor", "call_site", "function_rule", "dispatch_rule"]

# Tensor methods that read tensor data on the host, bypassing the dispatcher.
_HOST_READ_METHODS = {
    "tolist": "host read: Tensor.tolist() copies device data to Python",
    "numpy": "host read: Tensor.numpy() copies device data to the host",
    "__array__": "host read: numpy conversion copies device data to the host",
    "cpu": "host read: Tensor.cpu() copies device data to the host",
    "item": "host read: Tensor.item() syncs and bakes a Python scalar",
    "__bool__": "host read: bool(tensor) syncs and branches on device data",
    "__int__": "host read: int(tensor) syncs and bakes a Python int",
    "__float__": "host read: float(tensor) syncs and bakes a Python float",
    "__index__": "host read: using a tensor as a Python index syncs and bakes it",
    "__complex__": "host read: complex(tensor) syncs and bakes a Python scalar",
    "__repr__": "host read: repr(tensor) reads device data",
    "__str__": "host read: str(tensor) reads device data",
    "__format__": "host read: formatting a tensor reads device data",
}

_SYNC_OPS = {
    "_local_scalar_dense": "host read: aten._local_scalar_dense (item/bool/int on a tensor) syncs the device",
    "nonzero": "data-dependent shape: aten.nonzero syncs and sizes its output from device data",
    "masked_select": "data-dependent shape: aten.masked_select sizes its output from device data",
    "equal": "host read: aten.equal returns a Python bool from device data",
    "allclose": "host read: aten.allclose returns a Python bool from device data",
    "bincount": "data-dependent shape: aten.bincount sizes its output from device data",
    "lift_fresh": "host data: a tensor built from Python data during capture is baked into the graph",
    "lift_fresh_copy": "host data: a tensor built from Python data during capture is baked into the graph",
}

# Ops that synchronize inside on CUDA although they return device tensors, with where PyTorch
# does it (paths in the PyTorch repository, v2.13): the CPU simulator runs them without any
# visible host read, so they are named here.
_CUDA_SYNC_OPS = {
    "_linalg_check_errors": (
        "device sync: aten._linalg_check_errors reads the solver's status back to raise "
        "(torch.linalg.cholesky, inv, solve, ... without _ex; use the _ex variant and check info later)",
        "aten/src/ATen/native/BatchLinearAlgebra.cpp: _linalg_check_errors (info.cpu() / item)"),
}
# The _ex variants check too when asked (check_errors=True): same sync.
_CHECKED_EX_OPS = ("linalg_cholesky_ex", "linalg_inv_ex", "_linalg_solve_ex", "linalg_lu_factor_ex",
                   "linalg_ldl_factor_ex")  # as dispatched: torch.linalg.solve_ex reaches aten._linalg_solve_ex


@dataclass(frozen=True)
class Violation:
    """One capture-unsafe operation: the ``rule`` it broke, the ``op``, and ``where`` (file:line)."""

    rule: str
    op: str
    where: str

    def __str__(self) -> str:
        return f"{self.rule} [{self.op}] at {self.where}"


def _has_bool_index(indices: Any) -> bool:
    return any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in (indices or ())
    )


def function_rule(func: Callable, args: tuple, kwargs: dict) -> str | None:
    """The rule a torch-function-level call breaks, or ``None``."""
    name = getattr(func, "__name__", "")
    if name in _HOST_READ_METHODS and args and isinstance(args[0], torch.Tensor):
        return _HOST_READ_METHODS[name]
    if name == "to" and args and isinstance(args[0], torch.Tensor) and _copies_to_host(args[0], args, kwargs):
        return "host read: Tensor.to('cpu') copies device data to the host"
    if name in _FROM_PYTHON_DATA and _onto_a_device(kwargs.get("device")):
        return (f"host data: torch.{name}(..., device=...) copies Python data to the device during capture "
                "(a copy from pageable memory: the capture fails); build it before the capture")
    return None


_FROM_PYTHON_DATA = ("tensor", "as_tensor", "scalar_tensor")


def _onto_a_device(device: object) -> bool:
    """Whether a factory's ``device=`` puts the tensor on a device. On the CPU simulator the
    device tensors are on the CPU too: a CPU device counts as the host only when the calling
    line spells it (``device="cpu"``, ``torch.device("cpu")``)."""
    if device is None:
        return False
    if isinstance(device, str):
        return torch.device(device).type != "cpu"
    if isinstance(device, torch.device) and device.type == "cpu":
        return not _names_the_host(call_site_line())
    return True


def _copies_to_host(tensor: torch.Tensor, args: tuple, kwargs: dict) -> bool:
    """Whether ``tensor.to(...)`` is a copy to the host.

    The string ``"cpu"`` always is (the code means the host, whatever the simulator runs
    on); a ``torch.device`` is when it differs from the tensor's own device, or, on the CPU
    simulator where device tensors are on the CPU too, when the calling line spells
    ``device("cpu")``: ``t.to(x.device)`` onto the device ``t`` already lives on copies nothing.
    A CPU device object built elsewhere and passed in is a false negative
    (docs/graph-simulator.md).
    """
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    if isinstance(target, str):
        return torch.device(target).type == "cpu"
    if isinstance(target, torch.device):
        if target.type != "cpu":
            return False
        # on the CPU simulator every device tensor is on the CPU: a torch.device("cpu") spelled at
        # the call is the host, a tensor's own .device (t.to(x.device)) is not
        return target != tensor.device or _names_the_host(call_site_line())
    return False


_HOST_DEVICE = re.compile(r"""device\(\s*["']cpu["']|device\s*=\s*["']cpu["']""")


def _names_the_host(line: str) -> bool:
    """Whether a source line spells the host as a device: ``torch.device("cpu")``, ``device="cpu"``."""
    return _HOST_DEVICE.search(line) is not None


def dispatch_rule(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> str | None:
    """The rule an aten-level op breaks, or ``None``."""
    packet = func.overloadpacket.__name__
    if func.namespace not in ("aten", "prims"):
        return (
            f"opaque custom op: {func.namespace}::{packet} hides its host logic from the simulator; "
            "test it on real graph hardware or express it in aten ops"
        )
    if packet in ("lift_fresh", "lift_fresh_copy") and args and isinstance(args[0], torch.Tensor) \
            and args[0].dim() == 0:
        return None  # torch.tensor(2.0): a Python number, baked like any scalar argument (docs/graph-simulator.md)
    if packet in _SYNC_OPS:
        return _SYNC_OPS[packet]
    if packet in _CUDA_SYNC_OPS:
        return _CUDA_SYNC_OPS[packet][0]
    if packet in _CHECKED_EX_OPS and kwargs.get("check_errors", False):
        return f"device sync: aten.{packet}(check_errors=True) reads the solver's status back to raise"
    if packet.startswith("unique") or packet in ("_unique", "_unique2"):
        return f"data-dependent shape: aten.{packet} sizes its output from device data"
    if packet in ("index", "_unsafe_index") and _has_bool_index(args[1] if len(args) > 1 else None):
        return "data-dependent shape: boolean-mask indexing sizes its output from device data"
    if packet in ("index_put", "index_put_", "_index_put_impl_") and _has_bool_index(
        args[1] if len(args) > 1 else None
    ):
        return "data-dependent shape: boolean-mask assignment syncs on the mask"
    if packet == "repeat_interleave" and func._overloadname in ("Tensor", "self_Tensor"):
        if kwargs.get("output_size") is None:
            return "data-dependent shape: repeat_interleave with tensor repeats needs output_size"
    return None


_THIS_DIR = os.path.dirname(os.path.abspath(__file__))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


def _caller_frame(frames: list[traceback.FrameSummary]) -> traceback.FrameSummary | None:
    """The innermost of ``frames`` outside torch, this testing package and contextlib."""
    for frame in reversed(frames):
        path = os.path.abspath(frame.filename)
        if not path.startswith((_THIS_DIR, _TORCH_DIR)) and "contextlib" not in path:
            return frame
    return None


def call_site(frames: list[traceback.FrameSummary] | None = None) -> str:
    """``file:line in function`` of the code that made the current call (or of ``frames``, a
    traceback's), skipping torch and this testing package."""
    frame = _caller_frame(traceback.extract_stack() if frames is None else frames)
    return "<unknown>" if frame is None else f"{frame.filename}:{frame.lineno} in {frame.name}"


def call_site_line() -> str:
    """The source line of :func:`call_site` (empty where the source is not available)."""
    frame = _caller_frame(traceback.extract_stack())
    return (frame.line or "") if frame is not None else ""



class _FunctionLayer(TorchFunctionMode):
    def __init__(self, monitor: HostAccessMonitor) -> None:
        super().__init__()
        self.monitor = monitor

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rule = function_rule(func, args, kwargs)
        if rule is None:
            return func(*args, **kwargs)
        self.monitor._report(Violation(rule, f"Tensor.{getattr(func, '__name__', func)}", call_site()), args)
        self.monitor._nested_host_read += 1
        try:
            return func(*args, **kwargs)
        finally:
            self.monitor._nested_host_read -= 1


class _DispatchLayer(TorchDispatchMode):
    def __init__(self, monitor: HostAccessMonitor) -> None:
        super().__init__()
        self.monitor = monitor

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rule = dispatch_rule(func, args, kwargs)
        if rule is not None and not self.monitor._nested_host_read:
            self.monitor._report(Violation(rule, str(func), call_site()), args)
        out = func(*args, **kwargs)
        self.monitor.on_op(func, args, kwargs, out)
        return out


class HostAccessMonitor:
    """Context manager that reports every capture-unsafe call to ``on_violation``
    and every dispatched aten op to ``on_op``. Subclass or pass callbacks.

    ``on_host_read(tensor, violation) -> bool``, when given, is asked first about a call
    that reads its first tensor argument on the host: returning ``True`` allows the read
    (the tensor lives in host memory on real hardware) and nothing is reported.
    """

    def __init__(
        self,
        on_violation: Callable[[Violation], None],
        on_op: Callable[[torch._ops.OpOverload, tuple, dict, Any], None] | None = None,
        on_host_read: Callable[[torch.Tensor, Violation], bool] | None = None,
    ) -> None:
        self._on_violation = on_violation
        self.on_op = on_op or (lambda func, args, kwargs, out: None)
        self._on_host_read = on_host_read
        self._nested_host_read = 0
        self._modes: list = []

    def _report(self, violation: Violation, args: tuple = ()) -> None:
        tensor = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if self._on_host_read is not None and tensor is not None and self._on_host_read(tensor, violation):
            return
        self._on_violation(violation)

    def __enter__(self) -> HostAccessMonitor:
        self._modes = [_FunctionLayer(self), _DispatchLayer(self)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        self._modes = []
