"""Every package installs alone from its wheel into a fresh venv, imports, and runs its README.

The wheels come from ``ci/wheels.sh``; the installs are the README's per-package
install path. Third-party packages (torch pinned by ci/constraints.txt, numpy,
safetensors, pip) live in one shared venv, built once per run the way a user would:
``ci/install-wheels.sh`` with every package of ci/packages.txt, from pip's normal configuration,
our names only from the wheels; then emptied of our packages. Each package then gets
a fresh venv of its own that sees the shared third-party packages through a ``.pth``
file, and ``pip install --no-index --find-links DIST PACKAGE`` (the README's offline
form) puts in it that package and the lora-kit packages it declares, nothing else.
A module missing from a wheel, an undeclared lora-kit dependency, a broken entry
point or a README example that fails shows here, not on a user's machine. (Sharing
the third-party layer instead of installing torch into every venv saves about 3 GB
of writes per run.)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

import pytest
from filelock import FileLock  # a dependency of torch

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = tuple(line for line in (ROOT / "ci/packages.txt").read_text().splitlines()
                 if line and not line.startswith("#"))
PIP_TIMEOUT_S = 1800  # a hang guard for a slow index, not a timing assertion

# Runs inside the fresh venv: what got installed, from where, and every entry point loaded.
PROBE = r"""
import importlib, json, sys
from importlib import metadata

import lora_core

module = importlib.import_module(sys.argv[1].replace("-", "_"))
installed, entry_points = [], []
for name in sys.argv[2:]:  # every lora-kit package (ci/packages.txt)
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        continue
    installed.append(name)
    for ep in dist.entry_points:
        ep.load()
        entry_points.append(f"{ep.group}:{ep.name}")
backends = lora_core.available_backends()
for backend in backends:
    lora_core.get_backend(backend)
print(json.dumps({"file": module.__file__, "installed": installed, "backends": backends,
                  "entry_points": sorted(entry_points)}))
"""


def _pyproject(package: str) -> dict:
    return tomllib.loads((ROOT / "packages" / package / "pyproject.toml").read_text())["project"]


def _local_closure(package: str) -> list[str]:
    """``package`` and the lora-kit packages it depends on, transitively (from the pyprojects)."""
    seen, todo = [], [package]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.append(name)
        for req in _pyproject(name).get("dependencies", []):
            dep = re.match(r"[A-Za-z0-9._-]+", req).group(0).lower().replace("_", "-")
            if dep in PACKAGES:
                todo.append(dep)
    return sorted(seen, key=PACKAGES.index)


def _first_python_block(package: str) -> str | None:
    readme = (ROOT / "packages" / package / "README.md").read_text()
    match = re.search(r"^```python[ \t]*\n(.*?)^```", readme, re.S | re.M)
    return match.group(1) if match else None


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    return env


def _run(cmd: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """Run ``cmd`` (with ``env`` added to the environment); fail the test with its output if it fails."""
    result = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env={**_env(), **env},
                            timeout=PIP_TIMEOUT_S)
    assert result.returncode == 0, (
        f"{' '.join(map(str, cmd))} exited {result.returncode}\n"
        f"--- stdout\n{result.stdout[-6000:]}\n--- stderr\n{result.stderr[-6000:]}"
    )
    return result


@pytest.fixture(scope="session")
def wheel_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Our wheels, built by ``ci/wheels.sh`` once per pytest run (xdist workers share them)."""
    dist = _shared_dir(tmp_path_factory, "lora-kit-wheels")
    with FileLock(f"{dist}.lock"):
        if not (dist / "constraints.txt").is_file():
            dist.mkdir(exist_ok=True)
            # with build isolation, as on a clean machine: build-system.requires must suffice
            _run(["bash", str(ROOT / "ci" / "wheels.sh"), str(dist)], cwd=dist, PYTHON=sys.executable)
    assert sorted(p.name.split("-")[0] for p in dist.glob("*.whl")) == sorted(p.replace("-", "_") for p in PACKAGES)
    return dist


def _shared_dir(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """A directory of this pytest run that every xdist worker sees (under a lock, build it once)."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # this run's directory, above the per-worker ones
    return base / name


@pytest.fixture(scope="session")
def third_party(tmp_path_factory: pytest.TempPathFactory, wheel_dir: Path) -> Path:
    """The site-packages of a venv with every third-party dependency of our packages."""
    env_dir = _shared_dir(tmp_path_factory, "lora-kit-third-party")
    python = env_dir / "bin" / "python"
    with FileLock(f"{env_dir}.lock"):
        if not (env_dir / "ready").is_file():
            shutil.rmtree(env_dir, ignore_errors=True)
            venv.EnvBuilder(with_pip=True).create(env_dir)
            # --no-compile: no .pyc for torch's thousands of modules, which halves the install time
            _run(["bash", str(ROOT / "ci" / "install-wheels.sh"), "--dist", str(wheel_dir), *PACKAGES,
                  "--no-compile"], cwd=env_dir, PYTHON=str(python))
            # pytest, by name, for the fresh project of the plugin test: `lora-core[test]` through the
            # wheel constraints needs pip >= 26.1, and a Python 3.11 venv starts with pip 23.2
            _run([str(python), "-m", "pip", "install", "-c", str(ROOT / "ci" / "constraints.txt"), "pytest",
                  "--no-compile"], cwd=env_dir, PIP_DISABLE_PIP_VERSION_CHECK="1")
            _run([str(python), "-m", "pip", "uninstall", "-q", "-y", *PACKAGES], cwd=env_dir)
            (env_dir / "ready").write_text("")
    torch_version = _run([str(python), "-c", "from importlib.metadata import version; print(version('torch'))"],
                         cwd=env_dir).stdout.strip()
    assert torch_version.split("+")[0] == "2.13.0", f"ci/constraints.txt pins torch 2.13.0, got {torch_version}"
    return Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                     cwd=env_dir).stdout.strip())


def _fresh_venv(package: str, wheel_dir: Path, third_party: Path, tmp_path: Path) -> tuple[Path, Path, Path]:
    """``(env_dir, python, site)`` of a new venv holding ``package`` from its wheel (and the lora-kit
    packages it declares), seeing the shared third-party layer through a ``.pth`` file."""
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)  # pip, like torch, comes from the shared layer
    python = env_dir / "bin" / "python"
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                     cwd=tmp_path).stdout.strip())
    (site / "lora_kit_third_party.pth").write_text(f"{third_party}\n")
    _run([str(python), "-m", "pip", "install", "--no-index", "--find-links", str(wheel_dir), package], cwd=tmp_path,
         PIP_DISABLE_PIP_VERSION_CHECK="1")
    return env_dir, python, site


@pytest.mark.parametrize("package", PACKAGES)
def test_wheel_installs_alone_in_a_fresh_venv(package: str, wheel_dir: Path, third_party: Path,
                                              tmp_path: Path) -> None:
    env_dir, python, site = _fresh_venv(package, wheel_dir, third_party, tmp_path)

    closure = _local_closure(package)
    probe = json.loads(_run([str(python), "-c", PROBE, package, *PACKAGES], cwd=tmp_path).stdout.strip().splitlines()[-1])
    assert probe["installed"] == closure, "the venv holds exactly the package and its declared lora-kit deps"
    assert Path(probe["file"]).is_relative_to(site), f"imported from {probe['file']}, not the fresh venv"
    expected_backends = sorted(
        name for dep in closure
        for name in _pyproject(dep).get("entry-points", {}).get("lora_core.backends", {})
    )
    assert probe["backends"] == expected_backends
    for script in (s for dep in closure for s in _pyproject(dep).get("scripts", {})):
        _run([str(env_dir / "bin" / script), "--help"], cwd=tmp_path)

    code = _first_python_block(package)
    if code is None:
        pytest.skip(f"installed, imported, backends {probe['backends']}; "
                    f"packages/{package}/README.md has no ```python block to run yet")
    _run([str(python), "-c", code], cwd=tmp_path)


FRESH_PROJECT_TEST = """
import torch


def test_op(device):
    x = torch.arange(4.0, device=device.torch_device)
    out_a, out_b = device.run_two_batches(lambda t: t * 2, (x,), lambda: x.add_(1))
    assert out_a.tolist() == [0.0, 2.0, 4.0, 6.0] and out_b.tolist() == [2.0, 4.0, 6.0, 8.0]
"""


def test_the_lora_core_wheel_gives_a_fresh_project_the_device_fixture(wheel_dir: Path, third_party: Path,
                                                                        tmp_path: Path) -> None:
    """Issue #31's new user: lora-core installed from its wheel, a directory with one test file that
    takes ``device`` and no conftest; pytest finds the fixture and the options through the plugin."""
    _, python, _ = _fresh_venv("lora-core", wheel_dir, third_party, tmp_path)
    project = tmp_path / "project"
    project.mkdir()
    (project / "test_op.py").write_text(FRESH_PROJECT_TEST)
    run = subprocess.run([str(python), "-m", "pytest", "-p", "no:cacheprovider", "-v", "--lora-device", "cpu",
                          "--lora-device", "cpu-graphsim", "--lora-device", "cuda"], cwd=project,
                         env={k: v for k, v in _env().items() if not k.startswith("PYTEST_")},
                         capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "test_op.py::test_op[cpu] PASSED" in run.stdout
    assert "test_op.py::test_op[cpu-graphsim] PASSED" in run.stdout
    assert re.search(r"test_op\.py::test_op\[cuda\] (SKIPPED|PASSED)", run.stdout), run.stdout
