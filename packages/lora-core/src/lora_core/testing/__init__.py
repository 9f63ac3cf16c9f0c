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
    random_ranks,
    random_requests,
)
from .devices import (
    COMPILE_BACKEND,
    DEVICE_NAMES,
    DEVICE_TYPES,
    CompiledReplay,
    DeviceProbe,
    DeviceType,
    TestDevice,
    clone_outputs,
    compile_capture,
    make_device,
    probe_device,
)
from .graphsim import CaptureError, GraphSimulator
from .launches import LaunchCount, count_launches
from .rules import Violation

__all__ = [
    "BatchPair",
    "random_batch_pair",
    "COMPILE_BACKEND",
    "CaptureError",
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
    "clone_outputs",
    "compile_capture",
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
