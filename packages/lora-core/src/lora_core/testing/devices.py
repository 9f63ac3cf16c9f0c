"""The device matrix, as one import: every name the harness modules export.

The work is split by job: :mod:`.device_type` (what a device kind is), :mod:`.kinds`
(lora-core's kinds), :mod:`.compiled` (the compile kinds' capture), :mod:`.registry`
(the ``lora_core.devices`` entry points) and :mod:`.harness` (:class:`TestDevice`).
``DEVICE_TYPES`` and ``DEVICE_NAMES`` are read from the registry on first use.
"""

from __future__ import annotations

from typing import Any

from .compiled import COMPILE_BACKEND, CompiledReplay, compile_capture
from .device_type import DeviceProbe, DeviceType
from .harness import TestDevice, clone_outputs, make_device
from .registry import device_type, device_types, probe_device

__all__ = [
    "COMPILE_BACKEND",
    "CompiledReplay",
    "DEVICE_NAMES",
    "DEVICE_TYPES",
    "DeviceProbe",
    "DeviceType",
    "TestDevice",
    "compile_capture",
    "device_type",
    "device_types",
    "probe_device",
    "make_device",
    "clone_outputs",
]


def __getattr__(name: str) -> Any:
    """``DEVICE_TYPES`` (every registered kind, in parameter order) and ``DEVICE_NAMES``
    (their names), loaded from the entry points on first use."""
    if name == "DEVICE_TYPES":
        return device_types()
    if name == "DEVICE_NAMES":
        return tuple(t.name for t in device_types())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
