"""``--lora-device-report PATH``: one JSON file per pytest run, for the device matrix across hosts.

Written by :class:`DeviceReport`, which the ``lora_devices`` pytest plugin
(:mod:`.plugin`) registers when the option is given. The report holds the host, the
Python / torch / CUDA / driver versions where known, the installed lora-core-based
packages, every device probe (found, or absent and why), the device parameters the run
selected, and each test x device outcome (passed, failed, error, skipped or xfailed,
with the reason). ``lora-device-matrix`` (``python -m lora_core.testing.matrix``) merges
reports from several hosts into one table; see docs/device-matrix.md.

Works under pytest-xdist: workers tag each test with its device parameter
(``user_properties``), and the controller, which receives every report, writes the file.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

from .matrix import SCHEMA
from .registry import device_types, probe_device

__all__ = ["SCHEMA", "DeviceReport", "environment", "device_probes", "lora_core_distributions", "strip_device_id"]

_PROPERTY = "lora_kit_device"
_PHASES = ("setup", "call", "teardown")
_CORE = "lora-core"


def strip_device_id(nodeid: str, device: str | None) -> str:
    """``nodeid`` without the ``device`` parameter's id: the same test on every device.

    ``test_x[cpu-graphsim-0-linear]`` on ``cpu-graphsim`` -> ``test_x[0-linear]``;
    ``test_y[cuda]`` -> ``test_y``.
    """
    if device is None or not nodeid.endswith("]") or "[" not in nodeid:
        return nodeid
    head, ids = nodeid[:-1].split("[", 1)
    parts = f"-{ids}-"
    marker = f"-{device}-"
    at = parts.find(marker)
    if at < 0:
        return nodeid
    rest = (parts[:at] + parts[at + len(marker) - 1:]).strip("-")
    return f"{head}[{rest}]" if rest else head


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _nvidia_smi() -> dict[str, Any]:
    """Driver version and GPU names from nvidia-smi, where it exists (never initialises CUDA)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {}
    try:
        out = subprocess.run([exe, "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return {"nvidia_smi_error": str(exc).splitlines()[0] if str(exc) else type(exc).__name__}
    rows = [[c.strip() for c in line.split(",")] for line in out.splitlines() if line.strip()]
    return {"gpus": [r[0] for r in rows], "driver": rows[0][1] if rows and len(rows[0]) > 1 else None}


def environment() -> dict[str, Any]:
    """Host and versions: python, torch, CUDA (torch's build), driver and GPUs, torch_npu, the CANN path."""
    import torch

    env: dict[str, Any] = {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "driver": None,
        "gpus": [],
        "torch_npu": _version("torch_npu"),
        "ascend_toolkit_home": os.environ.get("ASCEND_TOOLKIT_HOME") or os.environ.get("ASCEND_HOME_PATH"),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    env.update(_nvidia_smi())
    env["lora_kit"] = {name: _version(name) for name in lora_core_distributions()}
    return env


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requires_core(dist: metadata.Distribution) -> bool:
    for requirement in dist.requires or ():
        name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
        if name and _normalized(name.group(1)) == _CORE and not re.search(r"\bextra\s*==", requirement):
            return True
    return False


def lora_core_distributions() -> list[str]:
    """lora-core and every installed distribution that requires it unconditionally (lora-kit's
    packages, and any third-party package built on lora-core), sorted, lora-core first.

    Derived from the installed metadata, so the list of lora-kit packages is written nowhere here.
    """
    found = {_normalized(d.metadata["Name"] or "") for d in metadata.distributions() if _requires_core(d)}
    found.discard(_CORE)
    return [_CORE, *sorted(found)]


def device_probes() -> list[dict[str, Any]]:
    """Every device parameter's probe: name, available, reason."""
    return [{"name": p.name, "available": bool(p.available), "reason": p.reason}
            for p in (probe_device(k.name) for k in device_types())]


def _reason(report: pytest.TestReport) -> str | None:
    """A one-line reason: the skip message, the xfail reason, or the failure's crash message."""
    if report.skipped:
        if hasattr(report, "wasxfail"):
            return report.wasxfail or "xfail"
        longrepr = report.longrepr
        if isinstance(longrepr, tuple) and len(longrepr) == 3:
            message = str(longrepr[2])
            return message[len("Skipped: "):] if message.startswith("Skipped: ") else message
        return str(longrepr) if longrepr else None
    if report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)
        message = getattr(crash, "message", None) or str(report.longrepr or "").strip()
        lines = message.strip().splitlines()
        return lines[0][:300] if lines else "failed"
    return None


class DeviceReport:
    """Collects the outcome of every test phase and writes the report at the end of the session."""

    def __init__(self, config: pytest.Config, path: Path) -> None:
        self.config = config
        self.path = path
        self.tests: dict[str, dict[str, Any]] = {}
        self.started = datetime.datetime.now(datetime.timezone.utc)

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            callspec = getattr(item, "callspec", None)
            device = callspec.params.get("device") if callspec else None
            item.user_properties.append((_PROPERTY, device))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        device = dict(report.user_properties).get(_PROPERTY)
        entry = self.tests.setdefault(report.nodeid, {
            "nodeid": report.nodeid, "test": strip_device_id(report.nodeid, device), "device": device,
            "outcome": None, "reason": None,
        })
        if report.failed:
            if entry["outcome"] not in ("failed", "error"):
                entry["outcome"] = "failed" if report.when == "call" else "error"
                entry["reason"] = _reason(report)
        elif report.skipped and entry["outcome"] is None:
            entry["outcome"] = "xfailed" if hasattr(report, "wasxfail") else "skipped"
            entry["reason"] = _reason(report)
        elif report.when == "call" and report.passed and entry["outcome"] is None:
            entry["outcome"] = "passed"

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if hasattr(self.config, "workerinput"):
            return  # an xdist worker: the controller writes the report
        from .plugin import selected_devices

        selected = selected_devices(self.config)
        names = [k.name for k in device_types()]
        tests = sorted(self.tests.values(), key=lambda t: t["nodeid"])
        for entry in tests:
            if entry["outcome"] is None:  # e.g. interrupted mid-test
                entry["outcome"], entry["reason"] = "error", "no outcome reported"
        counts: dict[str, int] = {}
        for entry in tests:
            counts[entry["outcome"]] = counts.get(entry["outcome"], 0) + 1
        data = {
            "schema": SCHEMA,
            **environment(),
            "started": self.started.isoformat(timespec="seconds"),
            "finished": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "args": list(self.config.invocation_params.args),
            "exit_status": int(exitstatus),
            "selected_devices": [d for d in names if d in selected] if selected else names,
            "required_devices": list(self.config.getoption("lora_require_device") or []),
            "devices": device_probes(),
            "counts": counts,
            "tests": tests,
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        tmp.replace(self.path)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not hasattr(self.config, "workerinput"):
            terminalreporter.write_line(f"lora-kit device report: {self.path}")


if __name__ == "__main__":  # pragma: no cover
    sys.exit("lora_core.testing.report is written by pytest --lora-device-report; merge reports with "
             "lora-device-matrix (python -m lora_core.testing.matrix)")
