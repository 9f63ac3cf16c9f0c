"""lora_layers.sim depends on lora-core only: backends and benchmarks are found through entry points."""

import ast
from pathlib import Path

import lora_layers.sim

SIM = Path(lora_layers.sim.__file__).parent
BACKEND_PACKAGES = {"lora_cuda", "lora_ascend"}


def _imported_names(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                yield node.args[0].value


def test_the_sim_subpackage_imports_no_backend_package_by_name():
    files = sorted(SIM.rglob("*.py"))
    assert len(files) > 5
    offenders = [f"{f.name}: {name}" for f in files for name in _imported_names(ast.parse(f.read_text()))
                 if name.split(".")[0] in BACKEND_PACKAGES]
    assert offenders == []

