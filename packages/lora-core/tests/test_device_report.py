"""``--device-report`` and ``python -m lora_core.testing.matrix``, end to end.

Tiny test files run in a pytest subprocess in a directory without any conftest.py (the
``device`` fixture and its options come from lora-core's installed ``lora_devices``
plugin), once per device selection, as a CPU runner and a hardware host would; their
reports are then merged. The repository's own unprefixed spellings of the options
(root conftest.py) are checked last.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest
from filelock import FileLock  # a dependency of torch

from lora_core.testing import DEVICE_NAMES, probe_device
from lora_core.testing.matrix import SCHEMA, load_report, main, merge, render
from lora_core.testing.report import strip_device_id

ROOT_CONFTEST = Path(__file__).resolve().parents[3] / "conftest.py"

TINY = '''
import pytest

def test_on_every_device(device):
    assert device.name

@pytest.mark.parametrize("n", [1, 2])
def test_with_a_second_parameter(device, n):
    assert n > 0

def test_without_a_device():
    pass

def test_that_skips():
    pytest.skip("not today")
'''

BROKEN = '''
def test_broken(device):
    assert device.name == "no such device"
'''


def _absent_device() -> str | None:
    return next((d for d in DEVICE_NAMES if not probe_device(d).available), None)


def _pytest(project: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "PYTHONPATH"))}
    env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    return subprocess.run([sys.executable, "-m", "pytest", *args], cwd=project, env=env,
                          capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="session")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with the tiny test files and no conftest.py, shared by xdist workers."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # this run's directory, above the per-worker ones
    root = base / "device-report-project"
    with FileLock(f"{root}.lock"):
        if not (root / "test_tiny.py").is_file():
            (root / "broken").mkdir(parents=True, exist_ok=True)
            (root / "pytest.ini").write_text("[pytest]\naddopts = -p no:cacheprovider\n")
            (root / "broken" / "test_broken.py").write_text(BROKEN)
            (root / "test_tiny.py").write_text(TINY)
    return root


@pytest.fixture(scope="session")
def two_runs(project: Path) -> tuple[Path, Path]:
    """A CPU run (with a device that is absent here, if any) and a cpu-graphsim run, made once per pytest run."""
    cpu, graphsim = project / "cpu.json", project / "graphsim.json"
    with FileLock(f"{cpu}.lock"):
        if not graphsim.is_file():
            absent = _absent_device()
            extra = ["--lora-device", absent] if absent else []
            workers = ["-n", "1"] if find_spec("xdist") else []  # the report must survive xdist (controller + a worker)
            first = _pytest(project, "test_tiny.py", "--lora-device", "cpu", *extra, "--lora-device-report", str(cpu),
                            *workers)
            assert first.returncode == 0, first.stdout + first.stderr
            second = _pytest(project, "test_tiny.py", "--lora-device", "cpu-graphsim", "--lora-device-report",
                             str(graphsim))
            assert second.returncode == 0, second.stdout + second.stderr
            assert f"lora-kit device report: {graphsim}" in second.stdout
    return cpu, graphsim


def test_report_holds_the_host_the_probes_and_each_test_x_device(two_runs):
    data = json.loads(two_runs[0].read_text())
    assert data["schema"] == SCHEMA and data["host"] and data["python"] and data["torch"]
    assert {"cuda", "driver", "gpus", "torch_npu"} <= set(data)
    assert [p["name"] for p in data["devices"]] == list(DEVICE_NAMES)
    for probe in data["devices"]:
        expected = probe_device(probe["name"])
        assert (probe["available"], probe["reason"]) == (expected.available, expected.reason)
    tests = {(t["test"], t["device"]): t for t in data["tests"]}
    assert tests[("test_tiny.py::test_on_every_device", "cpu")]["outcome"] == "passed"
    assert tests[("test_tiny.py::test_with_a_second_parameter[2]", "cpu")]["nodeid"] == \
        "test_tiny.py::test_with_a_second_parameter[cpu-2]"
    assert tests[("test_tiny.py::test_without_a_device", None)]["outcome"] == "passed"
    skipped = tests[("test_tiny.py::test_that_skips", None)]
    assert (skipped["outcome"], skipped["reason"]) == ("skipped", "not today")
    assert not any(device == "cpu-graphsim" for _, device in tests), "deselected devices are not in the report"
    absent = _absent_device()
    if absent:
        assert data["selected_devices"] == [d for d in DEVICE_NAMES if d in ("cpu", absent)]
        entry = tests[("test_tiny.py::test_on_every_device", absent)]
        assert entry["outcome"] == "skipped"
        assert entry["reason"] == f"{absent} unavailable: {probe_device(absent).reason}"
    assert data["exit_status"] == 0 and data["counts"]["passed"] >= 4


def test_merged_matrix_shows_each_device_and_where_it_ran(two_runs, capsys, tmp_path):
    cpu, graphsim = two_runs
    assert main([str(cpu), str(graphsim), "--output", str(tmp_path / "matrix.md")]) == 0
    out = capsys.readouterr().out
    host = json.loads(cpu.read_text())["host"]
    assert out == (tmp_path / "matrix.md").read_text()
    header = "| test | " + " | ".join(DEVICE_NAMES) + " |"
    assert header in out
    row = next(line for line in out.splitlines() if line.startswith("| `test_tiny.py::test_on_every_device` |"))
    cells = [c.strip() for c in row.strip("|").split("|")][1:]
    assert cells[:2] == [f"passed ({host})", f"passed ({host})"]
    assert f"- `cpu`: ran on {host} (" in out and f"- `cpu-graphsim`: ran on {host} (" in out
    for name in DEVICE_NAMES:
        probe = probe_device(name)
        if not probe.available:
            assert f"- `{name}`: never ran: {host}: absent: {probe.reason}" in out
    assert "**Result: pass**" in out


def test_require_fails_when_a_device_never_passed_anywhere(two_runs, capsys):
    cpu, graphsim = two_runs
    assert main([str(cpu), str(graphsim), "--require", "cpu", "--require", "cpu-graphsim"]) == 0
    capsys.readouterr()
    absent = _absent_device()
    if absent is None:
        pytest.skip("every device parameter is present on this host")
    assert main([str(cpu), str(graphsim), "--require", absent]) == 1
    captured = capsys.readouterr()
    assert f"--require {absent}: never passed on any host" in captured.err
    assert "**Result: FAIL**" in captured.out


def test_failures_anywhere_fail_the_merge(project, two_runs, capsys, tmp_path):
    report = tmp_path / "broken.json"
    args = ["broken/test_broken.py", "--lora-device", "cpu", "--lora-device-report", str(report)]
    absent = _absent_device()
    if absent:
        args += ["--lora-require-device", absent]
    run = _pytest(project, *args)
    assert run.returncode == 1, run.stdout + run.stderr
    tests = {(t["test"], t["device"]): t for t in json.loads(report.read_text())["tests"]}
    failed = tests[("broken/test_broken.py::test_broken", "cpu")]
    assert failed["outcome"] == "failed" and "no such device" in failed["reason"]
    if absent:
        required = tests[("broken/test_broken.py::test_broken", absent)]
        assert required["outcome"] == "error" and required["reason"].startswith(f"Failed: --lora-require-device {absent}")
    assert main([str(two_runs[0]), str(report)]) == 1
    captured = capsys.readouterr()
    assert "## Failures" in captured.out and "`broken/test_broken.py::test_broken` on `cpu`" in captured.out
    assert "failed or errored" in captured.err


def _write(path: Path, data: object) -> str:
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


@pytest.mark.parametrize(("content", "message"), [
    (None, "no such file"),
    ("{not json", "not JSON"),
    ({"schema": "other"}, "not a lora-kit device report"),
    ({"schema": SCHEMA, "host": "h", "devices": [], "tests": [{"test": "t", "device": None, "outcome": "meh"}]},
     "tests[0] needs"),
    ({"schema": SCHEMA, "host": "h", "devices": [{"reason": "x"}], "tests": []}, "devices[0] is not a probe"),
])
def test_bad_input_is_one_line_and_exit_status_2(tmp_path, capsys, content, message):
    path = str(tmp_path / "missing.json") if content is None else _write(tmp_path / "r.json", content)
    assert main([path]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and path in err


def test_unknown_required_device_is_bad_input(tmp_path, capsys):
    path = _write(tmp_path / "r.json", {"schema": SCHEMA, "host": "h", "devices": [
        {"name": "cpu", "available": True, "reason": "r"}], "tests": []})
    assert main([path, "--require", "cdua"]) == 2
    assert "--require cdua: no report knows this device (known: cpu)" in capsys.readouterr().err


def test_command_line_never_prints_a_traceback(tmp_path):
    run = subprocess.run([sys.executable, "-m", "lora_core.testing.matrix", _write(tmp_path / "r.json", "[]")],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines() == [
        f"python -m lora_core.testing.matrix: error: {tmp_path / 'r.json'}: not a lora-kit device report "
        f"(schema 'list', expected '{SCHEMA}'; write one with pytest --device-report PATH)"]


def test_a_pytest_run_that_exited_non_zero_fails_the_merge(tmp_path):
    path = _write(tmp_path / "r.json", {"schema": SCHEMA, "host": "h", "exit_status": 5, "devices": [],
                                        "tests": []})
    matrix = merge([load_report(path)])
    assert "pytest exited 5" in render(matrix)


def test_the_merge_counts_every_test_without_a_device_per_host(tmp_path):
    """Each host's device-less tests are counted one by one per outcome, never once per outcome."""
    def report(name: str, host: str, outcomes: list[str]) -> str:
        tests = [{"test": f"t.py::test_{i}", "device": None, "outcome": o} for i, o in enumerate(outcomes)]
        return _write(tmp_path / name, {"schema": SCHEMA, "host": host, "devices": [], "tests": tests})

    first = report("a.json", "runner-a", ["passed", "passed", "passed", "skipped"])
    second = report("b.json", "runner-b", ["passed", "passed", "failed"])
    matrix = merge([load_report(first), load_report(second)])
    assert matrix.no_device == {"runner-a (a.json)": {"passed": 3, "skipped": 1},
                                "runner-b (b.json)": {"passed": 2, "failed": 1}}
    assert ("Tests without a device parameter: runner-a (a.json): 3 passed, 1 skipped; "
            "runner-b (b.json): 2 passed, 1 failed.") in render(matrix)


@pytest.mark.parametrize(("args", "option"), [
    (["--lora-device", "cpu"], "--lora-device"), (["--lora-device=cpu"], "--lora-device"),
    (["-q", "--device", "cpu"], "--device"), (["--require-device=cpu"], "--require-device"), ([], "--lora-device"),
])
def test_a_device_found_but_not_selected_names_the_option_the_run_used(tmp_path, args, option):
    """A third-party project has only the plugin's ``--lora-device``; this repository's conftest.py
    adds ``--device``: the matrix names the spelling the host's run used."""
    path = _write(tmp_path / "r.json", {
        "schema": SCHEMA, "host": "box", "args": args, "selected_devices": ["cpu"],
        "devices": [{"name": "cpu", "available": True, "reason": "here"},
                    {"name": "cpu-graphsim", "available": True, "reason": "simulated"}],
        "tests": [{"test": "t.py::test_x", "device": "cpu", "outcome": "passed"}]})
    text = render(merge([load_report(path)]))
    assert f"- `cpu-graphsim`: never ran: box: found (simulated) but not selected ({option})" in text


@pytest.mark.parametrize(("nodeid", "device_name", "key"), [
    ("t.py::test_x[cpu-graphsim-0-linear]", "cpu-graphsim", "t.py::test_x[0-linear]"),
    ("t.py::test_x[cpu-huge-torch_native]", "cpu", "t.py::test_x[huge-torch_native]"),
    ("t.py::test_x[0-cuda-graph]", "cuda-graph", "t.py::test_x[0]"),
    ("t.py::test_x[a-npu-b]", "npu", "t.py::test_x[a-b]"),
    ("t.py::test_y[cuda]", "cuda", "t.py::test_y"),
    ("t.py::test_z", None, "t.py::test_z"),
    ("t.py::test_z[1-2]", None, "t.py::test_z[1-2]"),
])
def test_strip_device_id(nodeid, device_name, key):
    assert strip_device_id(nodeid, device_name) == key


def test_device_tests_only_leaves_out_the_tests_without_a_device(project):
    """``--lora-device-tests-only`` (a hardware host's run) keeps each device test's selected parameters
    and deselects the device-less tests, which the CPU runners run."""
    run = _pytest(project, "test_tiny.py", "--lora-device", "cpu", "--lora-device-tests-only", "--collect-only", "-q")
    assert run.returncode == 0, run.stdout + run.stderr
    collected = [line for line in run.stdout.splitlines() if "::" in line]
    assert collected == ["test_tiny.py::test_on_every_device[cpu]", "test_tiny.py::test_with_a_second_parameter[cpu-1]",
                         "test_tiny.py::test_with_a_second_parameter[cpu-2]"]
    # the other devices' 3 parameters each, and the 2 tests without a device
    assert f"{(len(DEVICE_NAMES) - 1) * 3 + 2} deselected" in run.stdout


def test_device_tests_only_without_a_device_choice_keeps_every_device_test(project):
    """``--lora-device-tests-only`` alone deselects only the device-less tests: every device
    parameter stays (absent ones then skip with their reason)."""
    run = _pytest(project, "test_tiny.py", "--lora-device-tests-only", "--collect-only", "-q")
    assert run.returncode == 0, run.stdout + run.stderr
    collected = [line for line in run.stdout.splitlines() if "::" in line]
    assert len(collected) == len(DEVICE_NAMES) * 3 and all("[" in line for line in collected)
    assert "2 deselected" in run.stdout


def test_the_repository_spells_the_options_without_the_prefix(tmp_path):
    """The root conftest.py's aliases (--device, --require-device, --device-tests-only,
    --device-report, as ci/gpu.sh and the docs spell them) set the plugin's options."""
    (tmp_path / "test_tiny.py").write_text(TINY)
    shutil.copy(ROOT_CONFTEST, tmp_path / "conftest.py")
    report = tmp_path / "r.json"
    run = _pytest(tmp_path, "test_tiny.py", "-p", "no:cacheprovider", "--device", "cpu", "--device-tests-only",
                  "--require-device", "cpu", "--device-report", str(report))
    assert run.returncode == 0, run.stdout + run.stderr
    data = json.loads(report.read_text())
    assert data["selected_devices"] == ["cpu"] and data["required_devices"] == ["cpu"]
    assert sorted(t["nodeid"] for t in data["tests"]) == [
        "test_tiny.py::test_on_every_device[cpu]", "test_tiny.py::test_with_a_second_parameter[cpu-1]",
        "test_tiny.py::test_with_a_second_parameter[cpu-2]"]
    bad = _pytest(tmp_path, "test_tiny.py", "-p", "no:cacheprovider", "--device", "cdua")
    assert bad.returncode == 4 and "invalid choice: 'cdua'" in bad.stderr
