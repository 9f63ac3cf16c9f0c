"""The pytest plugin ``lora_devices``: the ``device`` fixture and its options for any project.

Installed with lora-core through the ``pytest11`` entry point, so a project needs no
conftest (docs/testing.md). It gives:

* the ``device`` fixture, parametrized over every registered device kind
  (:mod:`.registry`); an absent device is skipped with its probe's reason;
* ``@pytest.mark.devices("cpu", "cuda-graph")``: only these kinds for one test;
* ``--lora-device NAME`` (repeatable): keep only these device parameters;
* ``--lora-require-device NAME`` (repeatable): fail instead of skipping when NAME is absent;
* ``--lora-device-tests-only``: deselect the tests that take no device;
* ``--lora-device-report PATH``: the run's probes and outcomes as JSON (:mod:`.report`),
  merged across hosts by ``lora-device-matrix`` (``python -m lora_core.testing.matrix``).

The options carry a ``lora-`` prefix because ``--device`` is pytest-playwright's; a
project may add unprefixed aliases in its conftest (lora-kit's root conftest.py does).
A project that never asks for ``device`` sees no change: no parameters, no report
lines. A project's own ``device`` fixture wins (the plugin then parametrizes nothing),
and ``-p no:lora_devices`` turns the plugin off.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

try:
    import pytest
except ImportError:  # only pytest loads this module as a plugin; other tools that load every
    pytest = None    # entry point (lora-kit's install test) must still be able to import it

from .registry import device_names, device_type, device_types, probe_device

__all__ = ["OPTIONS", "device", "device_parameter", "selected_devices"]

OPTIONS = {"device": "--lora-device", "require": "--lora-require-device",
           "tests_only": "--lora-device-tests-only", "report": "--lora-device-report"}
"""The plugin's command-line options (their ``dest`` is the name without dashes, ``-`` as ``_``)."""

_MARKER = "devices"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("lora_devices", "device parameters (lora-core's lora_devices plugin)")
    names = device_names()
    group.addoption(OPTIONS["device"], dest="lora_device", action="append", default=[], choices=names,
                    metavar="NAME", help="run only these device parameters (repeatable; default: all)")
    group.addoption(OPTIONS["require"], dest="lora_require_device", action="append", default=[], choices=names,
                    metavar="NAME", help="fail instead of skipping when this device is absent (repeatable)")
    group.addoption(OPTIONS["tests_only"], dest="lora_device_tests_only", action="store_true", default=False,
                    help="deselect the tests without a device parameter (a hardware host runs what CPU runners "
                         "cannot)")
    group.addoption(OPTIONS["report"], dest="lora_device_report", metavar="PATH", default=None,
                    help="write this run's device probes and test x device outcomes as JSON to PATH (merge "
                         "reports from several hosts with: lora-device-matrix)")


def selected_devices(config: pytest.Config) -> list[str]:
    """The device parameters the run asked for by name (``--lora-device`` and
    ``--lora-require-device``); empty means all."""
    return list(config.getoption("lora_device") or []) + list(config.getoption("lora_require_device") or [])


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{_MARKER}(*names): run this test's device fixture only on these device kinds "
                   "(lora-core's lora_devices plugin)")
    path = config.getoption("lora_device_report")
    if path:
        from .report import DeviceReport

        config.pluginmanager.register(DeviceReport(config, Path(config.invocation_params.dir, path)),
                                      "lora_devices-report")


def _uses_our_fixture(metafunc: pytest.Metafunc) -> bool:
    """Whether ``device`` resolves to this plugin's fixture (a project's own fixture wins)."""
    info = getattr(metafunc.definition, "_fixtureinfo", None)
    defs = getattr(info, "name2fixturedefs", {}).get("device") if info is not None else None
    if not defs:
        return False
    func = getattr(defs[-1], "func", None)
    return getattr(func, "__module__", None) == __name__


def _marked_names(metafunc: pytest.Metafunc) -> tuple[str, ...]:
    known = tuple(k.name for k in device_types())
    marker = metafunc.definition.get_closest_marker(_MARKER)
    if marker is None:
        return known
    names = tuple(marker.args)
    bad = [n for n in names if n not in known]
    if not names or bad or marker.kwargs:
        raise ValueError(f"@pytest.mark.{_MARKER}{names!r} on {metafunc.definition.nodeid}: expected one or more "
                         f"device kind names among {', '.join(known)}"
                         + (f"; unknown: {', '.join(map(repr, bad))}" if bad else "")
                         + ("; it takes no keyword arguments" if marker.kwargs else ""))
    return tuple(n for n in known if n in names)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "device" in metafunc.fixturenames and _uses_our_fixture(metafunc):
        metafunc.parametrize("device", _marked_names(metafunc), indirect=True)


def device_parameter(item: pytest.Item) -> str | None:
    """The device parameter of a collected test, or ``None``."""
    callspec = getattr(item, "callspec", None)
    return callspec.params.get("device") if callspec else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    selected = set(selected_devices(config))
    tests_only = config.getoption("lora_device_tests_only")
    if not selected and not tests_only:
        return
    keep, drop = [], []
    for item in items:
        name = device_parameter(item)
        dropped = tests_only if name is None else bool(selected) and name not in selected
        (drop if dropped else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_report_collectionfinish(config: pytest.Config, start_path: Path, items: list[pytest.Item]) -> Any:
    """The probes, once, when some collected test takes a device."""
    if not any(device_parameter(item) is not None for item in items):
        return []
    lines = ["devices (lora_devices plugin):"]
    for kind in device_types():
        probe = probe_device(kind.name)
        lines.append(f"  {kind.name:<13} {'found' if probe.available else 'absent'}: {probe.reason}")
    return lines


def device(request: pytest.FixtureRequest):
    """The :class:`lora_core.testing.TestDevice` of this device parameter; skipped with the
    probe's reason where the device is absent (a failure under ``--lora-require-device``)."""
    from .harness import TestDevice

    name = request.param
    probe = probe_device(name)
    if not probe.available:
        message = f"{name} unavailable: {probe.reason}"
        if name in (request.config.getoption("lora_require_device") or []):
            pytest.fail(f"{OPTIONS['require']} {name}: {message}")
        pytest.skip(message)
    return TestDevice(device_type(name))


if pytest is not None:
    device = pytest.fixture(device)
