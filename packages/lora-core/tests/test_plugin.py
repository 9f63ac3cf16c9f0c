"""The ``lora_devices`` pytest plugin as another project sees it: no conftest, only lora-core installed.

Each test writes a small project into a temporary directory and runs pytest on it in a
subprocess (the plugin is loaded from lora-core's ``pytest11`` entry point there, as in
any environment where lora-core is installed).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lora_core.testing import DEVICE_NAMES, probe_device
from lora_core.testing.plugin import OPTIONS

ROOT = Path(__file__).resolve().parents[3]


def _pytest(project: Path, *args: str, pythonpath: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "PYTHONPATH"))}
    env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs", *args], cwd=project,
                          env=env, capture_output=True, text=True, timeout=600)


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text))
    (root / "pytest.ini").write_text("[pytest]\n")  # this directory is the rootdir: no conftest above it
    return root


OP_TESTS = '''
import pytest
import torch


def test_op(device):
    x = torch.arange(4.0, device=device.torch_device)
    assert torch.equal(device.run(lambda t: t * 2, x).cpu(), torch.arange(4.0) * 2)


@pytest.mark.devices("cpu", "cpu-graphsim")
def test_only_on_two(device):
    assert device.name in ("cpu", "cpu-graphsim")


def test_without_device():
    pass
'''


def test_a_fresh_project_gets_the_fixture_the_marker_and_the_probes(tmp_path):
    project = _write(tmp_path, {"test_op.py": OP_TESTS})
    run = _pytest(project, "-v")
    assert run.returncode == 0, run.stdout + run.stderr
    for name in DEVICE_NAMES:
        outcome = "PASSED" if probe_device(name).available else "SKIPPED"
        assert f"test_op.py::test_op[{name}] {outcome}" in run.stdout
    assert "test_op.py::test_only_on_two[cpu] PASSED" in run.stdout
    assert "test_op.py::test_only_on_two[cpu-graphsim] PASSED" in run.stdout
    assert run.stdout.count("test_only_on_two[") == 2
    assert "devices (lora_devices plugin):" in run.stdout
    for name in DEVICE_NAMES:
        probe = probe_device(name)
        if not probe.available:
            assert f"{name} unavailable: {probe.reason}" in run.stdout


def test_a_project_without_device_tests_sees_no_change(tmp_path):
    project = _write(tmp_path, {"test_plain.py": "def test_plain():\n    pass\n"})
    run = _pytest(project, "-v")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "devices (lora_devices plugin)" not in run.stdout and "test_plain PASSED" in run.stdout


def test_a_projects_own_device_fixture_wins(tmp_path):
    project = _write(tmp_path, {
        "conftest.py": '''
            import pytest

            @pytest.fixture
            def device():
                return "mine"
        ''',
        "test_own.py": '''
            def test_own(device):
                assert device == "mine"
        ''',
    })
    run = _pytest(project, "-v")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "test_own.py::test_own PASSED" in run.stdout and "test_own[" not in run.stdout


def test_p_no_lora_devices_turns_the_plugin_off(tmp_path):
    project = _write(tmp_path, {"test_op.py": "def test_op(device):\n    pass\n"})
    run = _pytest(project, "-p", "no:lora_devices")
    assert run.returncode == 1 and "fixture 'device' not found" in run.stdout
    help_text = _pytest(project, "-p", "no:lora_devices", "--help").stdout
    assert not any(option in help_text for option in OPTIONS.values())


def test_an_unknown_device_in_the_marker_names_the_marker_and_the_known_kinds(tmp_path):
    project = _write(tmp_path, {"test_bad.py": '''
        import pytest

        @pytest.mark.devices("cpu", "cdua")
        def test_bad(device):
            pass
    '''})
    run = _pytest(project)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "@pytest.mark.devices('cpu', 'cdua')" in run.stdout and "unknown: 'cdua'" in run.stdout
    assert "expected one or more device kind names among cpu, cpu-graphsim" in run.stdout


def test_the_options_clash_with_nothing_pytest_or_xdist_have(tmp_path):
    """The plugin's options sit beside pytest's and pytest-xdist's (``-d``/``--dist``) without an
    argparse conflict, and none is ``--device``, which pytest-playwright takes."""
    project = _write(tmp_path, {})
    run = _pytest(project, "--help")
    assert run.returncode == 0, run.stderr
    assert all(option in run.stdout for option in OPTIONS.values())
    assert "--device" not in OPTIONS.values()
    assert all(option.startswith("--lora-") for option in OPTIONS.values())


def _fake_distribution(site: Path, name: str, entry_points: str, modules: dict[str, str]) -> None:
    """A distribution's metadata and modules, importable with ``site`` on PYTHONPATH."""
    info = site / f"{name}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\nRequires-Dist: lora-core\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(entry_points))
    for module, text in modules.items():
        (site / f"{module}.py").write_text(textwrap.dedent(text))


def test_another_package_registers_a_device_kind_through_the_entry_point_group(tmp_path):
    """A kind from another distribution's ``lora_core.devices`` entry point becomes a device
    parameter with its probe and harness; a kind that fails to load is an absent device whose
    reason says why, and the run goes on."""
    site = tmp_path / "site"
    _fake_distribution(site, "my_kinds", '''
        [lora_core.devices]
        my-sim = my_kinds:MySimDevice
        my-broken = my_kinds:NoSuchClass
    ''', {"my_kinds": '''
        from lora_core.testing.device_type import DeviceType


        class MySimDevice(DeviceType):
            name, torch_device, is_graph = "my-sim", "cpu", True

            def probe(self):
                return self._probe(True, "always here")

            def record(self, fn, *inputs, host_resident=()):
                out = fn(*inputs)
                return out, lambda: out.copy_(fn(*inputs))
    '''})
    project = _write(tmp_path / "project", {"test_op.py": OP_TESTS})
    run = _pytest(project, "-v", "--lora-device", "my-sim", "--lora-device", "my-broken",
                  pythonpath=str(site))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "test_op.py::test_op[my-sim] PASSED" in run.stdout
    assert "test_op.py::test_op[my-broken] SKIPPED" in run.stdout
    assert "my-broken unavailable: entry point my-broken = my_kinds:NoSuchClass (lora_core.devices) failed to load: " \
           "AttributeError" in run.stdout
    assert "my-sim        found: always here" in run.stdout


@pytest.mark.parametrize("bad", ["--lora-device=cdua", "--lora-require-device=cdua"])
def test_an_unknown_device_option_is_a_usage_error_naming_the_choices(tmp_path, bad):
    project = _write(tmp_path, {"test_op.py": "def test_op(device):\n    pass\n"})
    run = _pytest(project, bad)
    assert run.returncode == 4 and "invalid choice: 'cdua'" in run.stderr and "'cpu-graphsim'" in run.stderr


def test_the_example_package_suite_runs_through_the_plugin_alone():
    """examples/graph-safe-ops (its own pyproject.toml, no conftest.py): the graph-safe op passes
    on every present device kind, the host-reading one is an expected failure on cpu-graphsim
    with the simulator's message. ``tox -e py311-example`` runs the same suite from the wheels."""
    example = ROOT / "examples" / "graph-safe-ops"
    run = _pytest(example, "-c", str(example / "pyproject.toml"), "--rootdir", str(example), "-v",
                  "-p", "no:logging", str(example / "tests"), pythonpath=str(example / "src"))
    assert run.returncode == 0, run.stdout + run.stderr
    for name in DEVICE_NAMES:
        outcome = "PASSED" if probe_device(name).available else "SKIPPED"
        assert f"test_graph_safe_op_is_right_for_both_batches[{name}] {outcome}" in run.stdout
    assert "test_host_reading_op_is_right_for_both_batches[cpu] PASSED" in run.stdout
    assert "test_host_reading_op_is_right_for_both_batches[cpu-graphsim] XFAIL" in run.stdout
    assert "test_the_simulator_names_the_host_read_and_where[cpu-graphsim] PASSED" in run.stdout
    assert "conftest" not in " ".join(p.name for p in example.rglob("*.py"))


def test_the_copy_paste_example_of_testing_md_runs_in_a_fresh_directory(tmp_path):
    text = (ROOT / "docs" / "testing.md").read_text()
    section = text[text.index("## The pytest plugin, for any project"):]
    block = section.split("```python\n", 1)[1].split("```", 1)[0]
    project = _write(tmp_path, {"test_my_op.py": block})
    run = _pytest(project, "-v")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "test_my_op.py::test_scale_rows[cpu-graphsim] PASSED" in run.stdout
    assert run.stdout.count("test_only_where_it_matters[") == 2
