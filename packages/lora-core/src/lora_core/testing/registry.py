"""The device kinds this process knows: every ``lora_core.devices`` entry point, loaded once.

A package adds a device kind by naming a :class:`~.device_type.DeviceType` subclass in
its ``pyproject.toml``::

    [project.entry-points."lora_core.devices"]
    xpu = "my_kernels.testing:XpuDevice"

The entry point's name is the parameter name and must equal the class's ``name``.
lora-core's own kinds are registered the same way (its ``pyproject.toml``).

Nothing here raises at collection for a broken third-party kind: an entry point that
fails to load, or whose class is wrong, becomes an absent device whose probe says why,
so the run goes on and the report shows it. Two entry points with one name are an
error (which one a test ran on would depend on install order).
"""

from __future__ import annotations

import functools
from importlib import metadata
from typing import Any

from .device_type import DeviceProbe, DeviceType

__all__ = ["ENTRY_POINT_GROUP", "device_names", "device_type", "device_types", "probe_device"]

ENTRY_POINT_GROUP = "lora_core.devices"


class _UnloadableDevice(DeviceType):
    """A registered kind that could not be loaded: always absent, with the reason."""

    torch_device = "cpu"

    def __init__(self, name: str, reason: str) -> None:
        self.name, self._reason = name, reason

    def probe(self) -> DeviceProbe:
        return self._probe(False, self._reason)


def _entry_points() -> list[metadata.EntryPoint]:
    points = list(metadata.entry_points(group=ENTRY_POINT_GROUP))
    seen: dict[str, str] = {}
    unique = []
    for point in points:
        origin = f"{point.value} ({point.dist.name if point.dist else 'unknown distribution'})"
        if point.name in seen:
            if seen[point.name] == origin:  # the same distribution seen twice on sys.path
                continue
            raise RuntimeError(f"device kind {point.name!r} is registered twice in entry-point group "
                               f"{ENTRY_POINT_GROUP!r}: {seen[point.name]} and {origin}; uninstall one")
        seen[point.name] = origin
        unique.append(point)
    return unique


def _load(point: metadata.EntryPoint) -> DeviceType:
    where = f"entry point {point.name} = {point.value} ({ENTRY_POINT_GROUP})"
    try:
        loaded: Any = point.load()
        kind = loaded() if isinstance(loaded, type) else loaded
    except Exception as exc:  # a broken kind must not break collection
        return _UnloadableDevice(point.name, f"{where} failed to load: {type(exc).__name__}: {exc}")
    if not isinstance(kind, DeviceType):
        return _UnloadableDevice(point.name, f"{where} is {type(kind).__name__}, expected a DeviceType subclass")
    if getattr(kind, "name", None) != point.name:
        return _UnloadableDevice(point.name, f"{where}: its class's name is {getattr(kind, 'name', None)!r}, "
                                             f"expected {point.name!r} (the entry point's name)")
    return kind


@functools.lru_cache(maxsize=None)
def device_names() -> tuple[str, ...]:
    """The registered device parameters' names, read from the entry points' metadata only
    (nothing is imported: cheap enough for command-line choices)."""
    names = {p.name for p in _entry_points()}
    if "cpu" not in names:  # lora-core's metadata is missing (a bare source tree): see device_types()
        names |= {k.name for k in device_types()}
    return tuple(sorted(names))


@functools.lru_cache(maxsize=None)
def device_types() -> tuple[DeviceType, ...]:
    """Every registered device kind, loaded, in parameter order (``order``, then name)."""
    kinds = [_load(point) for point in _entry_points()]
    if not any(k.name == "cpu" for k in kinds):  # lora-core's metadata is missing (a bare source tree)
        from . import kinds as builtin

        kinds += [getattr(builtin, cls)() for cls in builtin.__all__ if cls.endswith("Device")]
    return tuple(sorted(kinds, key=lambda k: (k.order, k.name)))


def device_type(name: str) -> DeviceType:
    """The registered kind called ``name``; ``ValueError`` naming the known ones otherwise."""
    for kind in device_types():
        if kind.name == name:
            return kind
    known = ", ".join(k.name for k in device_types())
    raise ValueError(f"unknown device {name!r}; expected one of {known}")


@functools.lru_cache(maxsize=None)
def probe_device(name: str) -> DeviceProbe:
    """Probe one device parameter (cached for the process)."""
    return device_type(name).probe()
