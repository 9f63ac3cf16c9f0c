"""The package structure of docs/architecture.md, checked on the source.

Dependencies point down: lora-core imports no other lora-kit package; lora-cuda
imports lora-core; lora-ascend imports lora-core and lora-cuda (whose graph-safe
kernels it builds on); lora-layers imports lora-core only and finds backends and
benchmarks through entry points. The table of imports in docs/architecture.md is
compared with the source, so the document cannot drift from the code.
"""

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"lora_core": "lora-core", "lora_cuda": "lora-cuda", "lora_ascend": "lora-ascend",
            "lora_layers": "lora-layers", "lora_vllm": "lora-vllm"}
DISTRIBUTIONS = {dist: package for package, dist in PACKAGES.items()}


def _documented_imports() -> dict[str, tuple[set[str], set[str] | None]]:
    """docs/architecture.md's table of imports: package -> (packages it imports, and for each
    row that lists them, the modules that import the other lora-kit packages; None = any)."""
    text = (ROOT / "docs/architecture.md").read_text()
    table = text.split("| package | imports | from these of its modules |", 1)[1].split("\n\n", 1)[0]
    rows = {}
    for line in table.strip().splitlines()[1:]:
        package, imports, modules = (cell.strip() for cell in line.strip().strip("|").split("|"))
        imported = set() if imports == "(none)" else {DISTRIBUTIONS[name.strip()] for name in imports.split(",")}
        listed = None if modules in ("", "(any)") else set(re.findall(r"`([\w/]+\.py)`", modules))
        rows[DISTRIBUTIONS[package]] = (imported, listed)
    return rows


def _imported_packages(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found |= {n.split(".")[0] for n in names if n.split(".")[0] in PACKAGES}
    return found


def test_the_documented_table_names_every_package():
    assert set(_documented_imports()) == set(PACKAGES)


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_imports_between_packages_are_the_documented_ones(package):
    allowed, listed_modules = _documented_imports()[package]
    src = ROOT / "packages" / PACKAGES[package] / "src" / package
    imported, importers = set(), set()
    for path in sorted(src.rglob("*.py")):
        others = _imported_packages(path) - {package}
        imported |= others
        if others - {"lora_core"}:
            importers.add(str(path.relative_to(src)))
    assert imported - allowed == set(), (
        f"{package} imports {sorted(imported - allowed)}, which docs/architecture.md does not show")
    assert allowed - imported == set(), (
        f"docs/architecture.md says {package} imports {sorted(allowed - imported)}, which no module does")
    if listed_modules is not None:
        assert importers == listed_modules, (
            f"modules of {package} importing other backends: {sorted(importers)}; "
            f"docs/architecture.md lists {sorted(listed_modules)}")


def test_lora_layers_declares_only_what_it_imports():
    text = (ROOT / "packages/lora-layers/pyproject.toml").read_text()
    assert "lora-ascend" not in text.split("[project.optional-dependencies]")[0]


def test_the_repository_stands_on_its_own():
    # the design contract lives in docs/: nothing cites a specification outside the repository
    word = "SP" + "EC"  # spelt apart so that this file does not cite it
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    citing = [f for f in files if f.endswith((".py", ".md", ".toml", ".ini", ".sh", ".txt"))
              and word in (ROOT / f).read_text(errors="ignore")]
    assert citing == [], f"files citing {word}: {citing}"


_IMPORT_EACH = r"""
import importlib, os, sys
import torch  # third-party: shared by the forks; every lora-kit module is imported fresh in its own
for heavy in ("numpy", "safetensors", "transformers", "peft", "hypothesis"):
    try:
        importlib.import_module(heavy)
    except ImportError:
        pass
failed = 0
for name in sys.argv[1:]:
    pid = os.fork()
    if pid == 0:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as err:
            # lora_vllm.punica and lora_vllm.offline_run are vLLM code: they import only beside vLLM
            # (packages/lora-vllm/tests import them there)
            if err.name == "vllm" and name.startswith("lora_vllm."):
                os._exit(0)
            print(f"{name}: {type(err).__name__}: {err}", flush=True)
            os._exit(1)
        except BaseException as err:
            print(f"{name}: {type(err).__name__}: {err}", flush=True)
            os._exit(1)
        os._exit(0)
    failed += os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0
sys.exit(1 if failed else 0)
"""


def _modules(package: str) -> list[str]:
    src = ROOT / "packages" / PACKAGES[package] / "src"
    names = []
    for path in sorted((src / package).rglob("*.py")):
        parts = path.relative_to(src).with_suffix("").parts
        if parts[-1] == "__main__":  # importing it runs the program
            continue
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_every_module_imports_alone_in_a_fresh_interpreter(package):
    # no module may depend on another having been imported first (e.g. a custom op that
    # only some other module registers); each import runs in a fork with no lora-kit module loaded
    import sys

    result = subprocess.run([sys.executable, "-c", _IMPORT_EACH, *_modules(package)], capture_output=True,
                            text=True, env={**__import__("os").environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]


MAX_MODULE_LINES, MAX_CLASS_LINES = 400, 300


def test_source_modules_and_classes_stay_small():
    # small modules with one job each (docs/architecture.md): a module over 400 lines or a class
    # over 300 is a sign that it does two jobs
    too_long = []
    for path in sorted((ROOT / "packages").glob("*/src/**/*.py")):
        text = path.read_text()
        where = str(path.relative_to(ROOT))
        if text.count("\n") > MAX_MODULE_LINES:
            too_long.append(f"{where}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text, where)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                too_long.append(f"{where}: class {node.name}, {node.end_lineno - node.lineno + 1} lines")
    assert not too_long, f"over {MAX_MODULE_LINES} lines a module or {MAX_CLASS_LINES} a class: {too_long}"
