"""The examples of the docs run as written.

* every ``packages/*/README.md`` has exactly one ```python block, and it runs on
  its own (exec in a fresh namespace, in an empty working directory). The wheel
  install test runs the same blocks in fresh virtual environments, so they import
  only their package and its declared dependencies, never the tests;
* the backend of docs/adding-a-backend.md ("A worked backend") runs and checks
  itself on ``cpu`` and ``cpu-graphsim``;
* the test written in docs/testing.md ("Writing a test") passes on ``cpu`` and
  ``cpu-graphsim``;
* the worked PEFT example of docs/layers.md runs (it needs peft).
"""

import re
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
READMES = sorted(ROOT.glob("packages/*/README.md"))
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _python_blocks(path: Path) -> list[str]:
    return PYTHON_BLOCK.findall(path.read_text())


def _block_under(path: Path, heading: str) -> str:
    """The first ```python block of the section that starts with ``heading``."""
    text = path.read_text()
    start = text.index(f"\n{heading}\n")
    (block,) = PYTHON_BLOCK.findall(text[start:])[:1]
    return block


def _exec(code: str, path: Path, namespace: dict | None = None) -> dict:
    namespace = {"__name__": "__docs_example__"} if namespace is None else namespace
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(code, str(path), "exec"), namespace)
    return namespace


def test_there_is_a_readme_per_package():
    assert [p.parent.name for p in READMES] == ["lora-ascend", "lora-core", "lora-cuda", "lora-layers"]


@pytest.mark.parametrize("readme", READMES, ids=lambda p: p.parent.name)
def test_package_readme_example_runs(readme, tmp_path, monkeypatch, capsys):
    blocks = _python_blocks(readme)
    assert len(blocks) == 1, f"{readme} must have exactly one ```python block, has {len(blocks)}"
    assert "not implemented yet" not in readme.read_text()
    assert not re.search(r"^\s*(from|import) (tests|conftest)\b", blocks[0], re.M), "examples must be self-contained"
    monkeypatch.chdir(tmp_path)
    _exec(blocks[0], readme)
    assert capsys.readouterr().out.strip(), "the example should print what it shows"


def test_worked_backend_of_adding_a_backend_runs():
    doc = DOCS / "adding-a-backend.md"
    namespace = _exec(_block_under(doc, "### A worked backend"), doc)
    from lora_core import BatchInfoBackend

    assert issubclass(namespace["ToyBackend"], BatchInfoBackend)
    namespace["ToyBackend"]("cpu")  # complete: constructible


@pytest.mark.parametrize("device_name", ["cpu", "cpu-graphsim"])
def test_the_test_written_in_testing_md_passes(device_name):
    from lora_core.testing import make_device

    doc = DOCS / "testing.md"
    namespace = _exec(_block_under(doc, "## Writing a test"), doc)
    namespace["test_gate_up_matches_the_reference"](make_device(device_name))


def test_worked_peft_example_runs(tmp_path, monkeypatch):
    pytest.importorskip("peft", reason="the example needs peft (tests/requirements.txt)")
    doc = DOCS / "layers.md"
    monkeypatch.chdir(tmp_path)
    _exec(_block_under(doc, "## A worked example with a PEFT adapter"), doc)
