"""Merge ``--device-report`` files from several hosts into one Markdown device matrix.

    python -m lora_core.testing.matrix cpu.json gpu.json npu.json [--require cuda-graph] [--output M.md]

The table is test x device: in each cell the outcome and the hosts it came from
(``passed (ci-runner, gpu-01)``). Below it, one line per device says where it ran, or
that it never ran and the probe's reason on each host. Exit status: 0; 1 when any test
failed (or errored) on any host, when a report's pytest run exited non-zero, or when a
device named with ``--require`` never passed on any host; 2 on bad input (one line on
stderr, never a traceback). See docs/device-matrix.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

__all__ = ["SCHEMA", "Matrix", "Report", "ReportError", "load_report", "merge", "render", "problems", "main"]

SCHEMA = "lora-kit-device-report/1"  # written by lora_core.testing.report
OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed")
FAILING = ("failed", "error")
NO_DEVICE = None


class ReportError(ValueError):
    """A report file that cannot be read as a lora-kit device report."""


@dataclass
class Report:
    """One pytest run: where it ran, what it probed, what each test did."""

    path: str
    host: str
    data: dict[str, Any]
    probes: dict[str, dict[str, Any]] = field(default_factory=dict)
    tests: list[dict[str, Any]] = field(default_factory=list)

    @property
    def label(self) -> str:
        return self.host


def load_report(path: str | Path) -> Report:
    """Read and check one ``--device-report`` file; raises :class:`ReportError` naming ``path``."""
    name = str(path)
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ReportError(f"{name}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ReportError(f"{name}: cannot read: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ReportError(f"{name}: not JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        found = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise ReportError(f"{name}: not a lora-kit device report (schema {found!r}, expected {SCHEMA!r}; "
                          "write one with pytest --device-report PATH)")
    host = data.get("host")
    devices, tests = data.get("devices"), data.get("tests")
    if not isinstance(host, str) or not isinstance(devices, list) or not isinstance(tests, list):
        raise ReportError(f"{name}: malformed report: needs a 'host' string and 'devices' and 'tests' lists")
    report = Report(name, host, data)
    for i, probe in enumerate(devices):
        if not (isinstance(probe, dict) and isinstance(probe.get("name"), str) and "available" in probe):
            raise ReportError(f"{name}: devices[{i}] is not a probe with 'name' and 'available'")
        report.probes[probe["name"]] = probe
    for i, test in enumerate(tests):
        if not (isinstance(test, dict) and isinstance(test.get("test"), str)
                and test.get("outcome") in OUTCOMES
                and (test.get("device") is NO_DEVICE or isinstance(test.get("device"), str))):
            raise ReportError(f"{name}: tests[{i}] needs 'test', 'device' (a name or null) and 'outcome' "
                              f"(one of {', '.join(OUTCOMES)})")
        report.tests.append(test)
    return report


@dataclass
class Matrix:
    """Reports merged: ``cells[(test, device)][outcome]`` is the list of hosts with that outcome."""

    reports: list[Report]
    devices: list[str]
    cells: dict[tuple[str, str], dict[str, list[str]]]
    no_device: dict[str, dict[str, int]]  # "host (report file)" -> outcome -> count, tests without a device


def _add_unique(items: list[str], item: str) -> None:
    if item not in items:
        items.append(item)


def merge(reports: Sequence[Report]) -> Matrix:
    """Merge reports (one per pytest run, any number per host) into one :class:`Matrix`."""
    devices: list[str] = []
    for report in reports:
        for name in report.probes:
            _add_unique(devices, name)
        for test in report.tests:
            if test["device"] is not NO_DEVICE:
                _add_unique(devices, test["device"])
    cells: dict[tuple[str, str], dict[str, list[str]]] = {}
    no_device: dict[str, dict[str, int]] = {}
    for report in reports:
        for test in report.tests:
            if test["device"] is NO_DEVICE:
                counts = no_device.setdefault(f"{report.label} ({Path(report.path).name})", {})
                counts[test["outcome"]] = counts.get(test["outcome"], 0) + 1
                continue
            hosts = cells.setdefault((test["test"], test["device"]), {}).setdefault(test["outcome"], [])
            _add_unique(hosts, report.label)
    return Matrix(list(reports), devices, cells, no_device)


def _cell(outcomes: dict[str, list[str]] | None) -> str:
    if not outcomes:
        return "—"
    return "; ".join(f"{o} ({', '.join(outcomes[o])})" for o in OUTCOMES if o in outcomes)


def _escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{counts[o]} {o}" for o in OUTCOMES if counts.get(o)) or "no tests"


def _ran(matrix: Matrix, device: str) -> dict[str, dict[str, int]]:
    """host -> outcome -> count for the tests that ran (were not skipped) on ``device``."""
    ran: dict[str, dict[str, int]] = {}
    for report in matrix.reports:
        for test in report.tests:
            if test["device"] == device and test["outcome"] != "skipped":
                counts = ran.setdefault(report.label, {})
                counts[test["outcome"]] = counts.get(test["outcome"], 0) + 1
    return ran


_SELECTING = ("--lora-device", "--lora-require-device", "--device", "--require-device")
"""The options that select device parameters: the plugin's, and the unprefixed aliases a
project's conftest.py may add (this repository's does)."""


def _selecting_option(report: Report) -> str:
    """The device-selection option as the report's run spelled it (``--lora-device`` if none)."""
    for arg in report.data.get("args") or ():
        name = str(arg).split("=", 1)[0]
        if name in _SELECTING:
            return name
    return _SELECTING[0]


def _why_not(matrix: Matrix, device: str) -> list[str]:
    """Per host where ``device`` did not run: absent (probe reason), not selected, or skipped."""
    notes: list[str] = []
    ran_on = _ran(matrix, device)
    for report in matrix.reports:
        if report.label in ran_on:
            continue
        probe = report.probes.get(device)
        selected = device in report.data.get("selected_devices", [device])
        if probe is None:
            note = f"{report.label}: not probed"
        elif not probe.get("available"):
            note = f"{report.label}: absent: {probe.get('reason', 'no reason given')}"
        elif not selected:
            note = f"{report.label}: found ({probe.get('reason', '')}) but not selected ({_selecting_option(report)})"
        else:
            note = f"{report.label}: found but every test skipped"
        _add_unique(notes, note)
    return notes


def problems(matrix: Matrix, require: Sequence[str] = ()) -> list[str]:
    """Why the merge fails: failed tests, non-zero pytest exits, required devices that never passed."""
    out: list[str] = []
    failed = [(r.label, t) for r in matrix.reports for t in r.tests if t["outcome"] in FAILING]
    if failed:
        out.append(f"{len(failed)} test(s) failed or errored")
    for report in matrix.reports:
        status = report.data.get("exit_status", 0)
        if status not in (0, None) and not any(t["outcome"] in FAILING for t in report.tests):
            out.append(f"{report.path} ({report.label}): pytest exited {status}")
    for device in require:
        if not any(t["device"] == device and t["outcome"] == "passed" for r in matrix.reports for t in r.tests):
            why = "; ".join(_why_not(matrix, device)) or "no test ran on it"
            out.append(f"--require {device}: never passed on any host ({why})")
    return out


def _version_row(report: Report) -> str:
    d = report.data
    selected = ", ".join(d.get("selected_devices", [])) or "all"
    gpus = ", ".join(d.get("gpus") or []) or "—"
    cells = [report.label, d.get("python") or "—", d.get("torch") or "—", d.get("cuda") or "—",
             d.get("driver") or "—", gpus, d.get("torch_npu") or "—", selected,
             _counts(d.get("counts") or {}), Path(report.path).name]
    return "| " + " | ".join(_escape(str(c)) for c in cells) + " |"


def render(matrix: Matrix, require: Sequence[str] = ()) -> str:
    """The merged matrix as Markdown (hosts, devices, test x device table, failures, result)."""
    lines = ["# Device matrix", "", f"{len(matrix.reports)} report(s) merged.", "",
             "| host | python | torch | CUDA | driver | GPUs | torch_npu | devices selected | outcomes | report |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [_version_row(r) for r in matrix.reports]
    lines += ["", "## Devices", ""]
    for device in matrix.devices:
        ran = _ran(matrix, device)
        if ran:
            where = "; ".join(f"{host} ({_counts(c)})" for host, c in ran.items())
            line = f"- `{device}`: ran on {where}"
            rest = _why_not(matrix, device)
            if rest:
                line += "; did not run on " + "; ".join(rest)
        else:
            line = f"- `{device}`: never ran: " + ("; ".join(_why_not(matrix, device)) or "no report mentions it")
        lines.append(_escape(line))
    tests = sorted({test for test, _ in matrix.cells})
    lines += ["", "## Tests × devices", ""]
    if tests:
        lines.append("| test | " + " | ".join(matrix.devices) + " |")
        lines.append("|---" * (len(matrix.devices) + 1) + "|")
        for test in tests:
            cells = [_cell(matrix.cells.get((test, d))) for d in matrix.devices]
            lines.append(f"| `{_escape(test)}` | " + " | ".join(_escape(c) for c in cells) + " |")
    else:
        lines.append("No test took the `device` fixture.")
    if matrix.no_device:
        lines += ["", "Tests without a device parameter: "
                  + "; ".join(f"{host}: {_counts(c)}" for host, c in matrix.no_device.items()) + "."]
    failures = [(r.label, t) for r in matrix.reports for t in r.tests if t["outcome"] in FAILING]
    lines += ["", "## Failures", ""]
    if failures:
        for host, t in failures:
            where = f" on `{t['device']}`" if t["device"] is not NO_DEVICE else ""
            lines.append(_escape(f"- `{t['test']}`{where}, {host}: {t['outcome']}: {t.get('reason') or ''}".rstrip(": ")))
    else:
        lines.append("None.")
    found = problems(matrix, require)
    lines += ["", ("**Result: FAIL**: " + "; ".join(_escape(p) for p in found)) if found else "**Result: pass**"]
    return "\n".join(lines) + "\n"


class _UsageError(Exception):
    """Bad input: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse whose errors raise :class:`_UsageError` instead of printing a usage block."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise _UsageError(message)


def main(argv: Sequence[str] | None = None) -> int:
    """Merge the reports named in ``argv``, print the Markdown, return the exit status."""
    parser = _Parser(prog="python -m lora_core.testing.matrix",
                     description="Merge pytest --device-report files from several hosts into one Markdown "
                                 "test x device table.")
    parser.add_argument("reports", nargs="+", metavar="REPORT.json", help="files written by pytest --device-report")
    parser.add_argument("--require", action="append", default=[], metavar="DEVICE",
                        help="exit 1 unless some test passed on DEVICE on some host (repeatable)")
    parser.add_argument("--output", metavar="PATH", help="also write the Markdown to PATH")
    try:
        args = parser.parse_args(argv)
        try:
            reports = [load_report(p) for p in args.reports]
        except ReportError as exc:
            raise _UsageError(str(exc)) from None
        matrix = merge(reports)
        unknown = [d for d in args.require if d not in matrix.devices]
        if unknown:
            raise _UsageError(f"--require {unknown[0]}: no report knows this device "
                              f"(known: {', '.join(matrix.devices)})")
        text = render(matrix, args.require)
        if args.output:
            try:
                Path(args.output).write_text(text)
            except OSError as exc:
                raise _UsageError(f"--output {args.output}: cannot write: {exc.strerror or exc}") from None
    except _UsageError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(text)
    found = problems(matrix, args.require)
    for problem in found:
        print(f"{parser.prog}: {problem}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
