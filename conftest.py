"""Device parametrization for every test in the repository (docs/testing.md).

A test that takes the ``device`` fixture runs once per device parameter in
``lora_core.testing.DEVICE_NAMES``. Absent hardware is skipped with the probe's
reason; ``--device X`` (repeatable) keeps only those parameters,
``--require-device X`` turns X's skip into a failure for hardware runners, and
``--device-tests-only`` leaves out the tests that take no device.
"""

from __future__ import annotations

import os

# An installed torch_npu without its driver stack breaks `import torch` unless
# device-backend autoloading is off; this must happen before torch is imported.
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import pytest  # noqa: E402

from lora_core.testing import DEVICE_NAMES, make_device, probe_device  # noqa: E402

# --device-report PATH: this run's probes and outcomes as JSON, for the device matrix across
# hosts (python -m lora_core.testing.matrix; docs/device-matrix.md).
pytest_plugins = ["lora_core.testing.report"]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("lora-kit devices")
    group.addoption(
        "--device", action="append", default=[], choices=DEVICE_NAMES,
        help="run only these device parameters (repeatable; default: all)",
    )
    group.addoption(
        "--require-device", action="append", default=[], choices=DEVICE_NAMES,
        help="fail instead of skipping when this device is absent (repeatable)",
    )
    group.addoption(
        "--device-tests-only", action="store_true", default=False,
        help="deselect the tests without a device parameter (a hardware host runs what CPU runners cannot)",
    )


def pytest_report_header(config: pytest.Config) -> list[str]:
    lines = ["lora-kit devices:"]
    for name in DEVICE_NAMES:
        probe = probe_device(name)
        lines.append(f"  {name:<13} {'found' if probe.available else 'absent'}: {probe.reason}")
    return lines


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "device" in metafunc.fixturenames:
        metafunc.parametrize("device", DEVICE_NAMES, indirect=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    selected = set(config.getoption("--device")) | set(config.getoption("--require-device"))
    device_tests_only = config.getoption("--device-tests-only")
    if not selected and not device_tests_only:
        return
    keep, drop = [], []
    for item in items:
        callspec = getattr(item, "callspec", None)
        name = callspec.params.get("device") if callspec else None
        if name is None:
            dropped = device_tests_only
        else:
            dropped = bool(selected) and name not in selected
        (drop if dropped else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture
def device(request: pytest.FixtureRequest):
    """The :class:`lora_core.testing.TestDevice` of this parameter (skipped if absent)."""
    name = request.param
    probe = probe_device(name)
    if not probe.available:
        message = f"{name} unavailable: {probe.reason}"
        if name in request.config.getoption("--require-device"):
            pytest.fail(f"--require-device {name}: {message}")
        pytest.skip(message)
    return make_device(name)
