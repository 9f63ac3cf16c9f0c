"""Each package README shows only public names: what it imports in its examples, what it
names as ``package.name`` and every module-level class or function of the package it names
in backticks is exported in an ``__all__`` (of the package, or of a module the README names)."""

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"lora_core": "lora-core", "lora_cuda": "lora-cuda", "lora_ascend": "lora-ascend",
            "lora_layers": "lora-layers", "lora_vllm": "lora-vllm"}


def _module_level_names(package: str) -> set[str]:
    """Classes, functions and UPPER_CASE constants defined at module level anywhere in ``package``."""
    names = set()
    for path in (ROOT / "packages" / PACKAGES[package] / "src" / package).rglob("*.py"):
        for node in ast.parse(path.read_text(), str(path)).body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                names |= {t.id for t in node.targets if isinstance(t, ast.Name) and t.id.isupper()}
    return {name for name in names if not name.startswith("_")}


def _exports(module: str) -> set[str] | None:
    """``module.__all__``, or None when ``module`` is not a lora-kit module."""
    try:
        return set(importlib.import_module(module).__all__)
    except ModuleNotFoundError:
        return None


def _readme(package: str) -> tuple[str, str]:
    text = (ROOT / "packages" / PACKAGES[package] / "README.md").read_text()
    code = "\n".join(re.findall(r"```python\n(.*?)```", text, flags=re.S))
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    return prose, code


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_names_imported_in_a_readme_example_are_exported(package):
    _, code = _readme(package)
    missing = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PACKAGES:
            exported = _exports(node.module)
            missing += [f"{node.module}.{alias.name}" for alias in node.names
                        if exported is None or alias.name not in exported]
    assert not missing, f"packages/{PACKAGES[package]}/README.md imports names no __all__ exports: {missing}"


def _entry_point_groups() -> set[str]:
    groups = set()
    for path in (ROOT / "packages").glob("*/pyproject.toml"):
        groups |= set(re.findall(r'^\[project\.entry-points\."([^"]+)"\]', path.read_text(), flags=re.M))
    return groups


def _unexported(package: str, prose: str) -> list[str]:
    """The names ``prose`` (Markdown without code blocks) shows that no relevant ``__all__`` exports."""
    spans = re.findall(r"`([^`]+)`", prose)
    qualified = {m for span in spans for m in re.findall(r"\b(lora_\w+(?:\.\w+)+)", span)}
    qualified -= _entry_point_groups()  # e.g. lora_core.backends: a group of entry points, not a name
    modules = {package} | {q for q in qualified if _exports(q) is not None}
    exported = set().union(*(_exports(m) for m in modules))
    missing = []
    for name in qualified - modules:  # package.name: a name its module exports
        module, _, attr = name.rpartition(".")
        if attr not in (_exports(module) or set()):
            missing.append(name)
    defined = _module_level_names(package)
    for span in spans:  # a class, constant or called function of the package: exported where the README looks
        match = re.match(r"(\w+)(\(|\.|$)", span)
        # a bare lower-case word is an argument or a concept (PEFT's `target_modules`) unless called
        if (match and match.group(1) in defined and match.group(1) not in exported
                and (match.group(2) == "(" or match.group(1)[0].isupper())):
            missing.append(match.group(1))
    return sorted(set(missing))


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_names_a_readme_shows_are_exported(package):
    prose, _ = _readme(package)
    missing = _unexported(package, prose)
    assert not missing, f"packages/{PACKAGES[package]}/README.md shows names that no __all__ exports: {missing}"


def test_the_check_reports_a_name_that_is_defined_but_not_exported():
    assert _unexported("lora_cuda", "the rows ordered by slot (`SlotOrder`)") == ["SlotOrder"]
    assert _unexported("lora_cuda", "`lora_cuda.slot_order.SlotOrder`, `lora_cuda.nothing`") == ["lora_cuda.nothing"]
    assert _unexported("lora_cuda", "`SortedPlan`, `lora_core.backends`, `refill`") == []
    # lora_layers.sim.serving defines a function target_modules; PEFT's argument of that name is prose
    assert _unexported("lora_layers", "PEFT's `target_modules` rules") == []
