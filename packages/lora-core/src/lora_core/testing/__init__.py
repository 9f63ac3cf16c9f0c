"""Test support for LoRA ops on every device: the device harness, the CPU graph
simulator, the launch counter and shared random cases (docs/graph-simulator.md)."""

from ..graphs import is_capturing
from .cases import (
    GARBAGE,
    TOLERANCES,
    BatchPair,
    random_batch_pair,
    assert_close_to_reference,
    default_scalings,
    fill_embedding_garbage,
    fill_linear_garbage,
    make_batch_info,
    random_embedding_weights,
    random_linear_weights,
    random_mix,
    random_ranks,
    random_requests,
    random_scales,
)
from .compiled import COMPILE_BACKEND, CompileCapture, CompiledReplay, compile_capture, fastest_compile_backend
from .device_type import DeviceProbe, DeviceType
from .harness import TestDevice, clone_outputs, make_device
from .registry import device_type, device_types, probe_device
from .graphsim import CaptureError, GraphSimulator
from .launches import LaunchCount, count_launches
from .rules import Violation

__all__ = [
    "BatchPair",
    "random_batch_pair",
    "random_scales",
    "random_mix",
    "COMPILE_BACKEND",
    "CaptureError",
    "CompileCapture",
    "CompiledReplay",
    "DEVICE_NAMES",
    "DEVICE_TYPES",
    "DeviceType",
    "DeviceProbe",
    "GARBAGE",
    "GraphSimulator",
    "LaunchCount",
    "TOLERANCES",
    "TestDevice",
    "Violation",
    "assert_close_to_reference",
    "default_scalings",
    "device_type",
    "device_types",
    "clone_outputs",
    "compile_capture",
    "fastest_compile_backend",
    "count_launches",
    "fill_embedding_garbage",
    "fill_linear_garbage",
    "is_capturing",
    "make_batch_info",
    "make_device",
    "probe_device",
    "random_embedding_weights",
    "random_linear_weights",
    "random_ranks",
    "random_requests",
]


def __getattr__(name: str):
    """``DEVICE_TYPES`` (every registered device kind, in parameter order) and ``DEVICE_NAMES``
    (their names): read from the ``lora_core.devices`` entry points on first use, so that
    importing this package loads no other package's device kinds."""
    if name in ("DEVICE_TYPES", "DEVICE_NAMES"):
        from . import devices

        return getattr(devices, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
