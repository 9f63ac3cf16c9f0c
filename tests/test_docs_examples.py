"""The examples of the docs run as written.

* every ``packages/*/README.md`` has exactly one ```python block, and it runs on
  its own (exec in a fresh namespace, in an empty working directory). The wheel
  install test runs the same blocks in fresh virtual environments, so they import
  only their package and its declared dependencies, never the tests;
* the backend of docs/adding-a-backend.md ("A worked backend") runs and checks
  itself on ``cpu`` and ``cpu-graphsim``;
* the test written in docs/testing.md ("Writing a test") passes on ``cpu`` and
  ``cpu-graphsim``;
* the worked PEFT example of docs/layers.md runs (it needs peft);
* docs/compile.md's examples (a compiled MultiLoRA model; a compile-counting backend),
  docs/graph-simulator.md's and docs/layers.md's usage sketches and docs/testing.md's
  new device kind run, the sketches with the names their prose gives them
  (``fn``, ``model``, ...) defined first; docs/transformers.md's example runs in
  tests/test_transformers_examples.py;
* every ```python block of README.md and docs/ is one of those (a new block fails
  ``test_every_python_block_of_the_docs_is_run`` until a test runs it), and every
  shell example names scripts, files and modules that exist.
"""

import re
import textwrap
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
READMES = sorted(ROOT.glob("packages/*/README.md"))
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
ANY_BLOCK = re.compile(r"^( *)```(\w*)\n(.*?)^\1```", re.S | re.M)
DOC_FILES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]

RUN_BLOCKS = {
    # (file, the block's first line): the test that runs it
    ("docs/adding-a-backend.md", "import numpy as np"): "test_worked_backend_of_adding_a_backend_runs",
    ("docs/testing.md", "import random"): "test_the_test_written_in_testing_md_passes",
    ("docs/testing.md", "class XpuDevice(DeviceType):"): "test_the_new_device_kind_of_testing_md_probes",
    ("docs/testing.md", "import pytest"):
        "packages/lora-core/tests/test_plugin.py::test_the_copy_paste_example_of_testing_md_runs_in_a_fresh_directory",
    ("docs/layers.md", "import torch"): "test_worked_peft_example_runs",
    ("docs/layers.md", "from lora_layers import MultiLoRA"): "test_the_multilora_sketch_of_layers_md_runs",
    ("docs/transformers.md", "import copy, tempfile, warnings"):
        "tests/test_transformers_examples.py::test_the_example_of_docs_transformers_md_runs",
    ("docs/compile.md", "import tempfile"): "test_the_compiled_model_of_compile_md_runs",
    ("docs/compile.md", "import torch"): "test_the_counting_backend_of_compile_md_counts",
    ("docs/graph-simulator.md", "from lora_core.testing import GraphSimulator, CaptureError"):
        "test_the_graph_simulator_sketch_runs",
    ("docs/request-scales.md", 'mlora.set_batch([5, 3, 4], ["style", "style", None], scales=[0.3, 1.0, 1.0])'):
        "tests/test_request_scales.py::test_the_example_of_request_scales_md_runs",
    ("docs/request-mixes.md", 'mlora.set_batch([5, 3, 4], [{"math": 0.7, "style": 0.3}, "style", None])'):
        "tests/test_request_mixes_transformers.py::test_the_example_of_request_mixes_md_runs",
}
"""Every ```python block of README.md and docs/*.md, by its file and first line, and the test that runs it."""


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
    assert [p.parent.name for p in READMES] == ["lora-ascend", "lora-core", "lora-cuda", "lora-layers", "lora-vllm"]


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


def _blocks(path: Path, language: str) -> list[str]:
    """The ``language`` blocks of ``path``, indented ones (inside list items) dedented."""
    return [textwrap.dedent("\n".join(line[len(indent):] if line.startswith(indent) else line
                                      for line in body.splitlines())) + "\n"
            for indent, lang, body in ANY_BLOCK.findall(path.read_text()) if lang == language]


def _doc_block(name: str, first_line: str) -> str:
    (block,) = [b for b in _blocks(DOCS / name, "python") if b.splitlines()[0] == first_line]
    return block


def test_every_python_block_of_the_docs_is_run():
    found = {(str(path.relative_to(ROOT)), block.splitlines()[0]) for path in DOC_FILES
             for block in _blocks(path, "python")}
    assert found - set(RUN_BLOCKS) == set(), "a ```python block no test runs: add it to RUN_BLOCKS and run it"
    assert set(RUN_BLOCKS) - found == set(), "RUN_BLOCKS names a block the docs no longer have"
    here = set(globals())
    for test in RUN_BLOCKS.values():
        assert test in here or (ROOT / test.split("::")[0]).is_file(), test  # a test here, or path::name


def test_the_compiled_model_of_compile_md_runs(capsys):
    import torch

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    doc = DOCS / "compile.md"
    block = _doc_block("compile.md", "import tempfile")
    _exec(block, doc)
    printed = capsys.readouterr().out.strip()
    assert printed == "(256, 128) 1 compiled graph(s)"
    assert f"It prints `{printed}`" in doc.read_text()


def test_the_counting_backend_of_compile_md_counts():
    import torch

    namespace = _exec(_doc_block("compile.md", "import torch"), DOCS / "compile.md")
    counting = namespace["Counting"]()
    torch._dynamo.reset()
    fn = torch.compile(lambda x: x * 2 + 1, backend=counting, fullgraph=True)
    assert torch.equal(fn(torch.ones(3)), torch.full((3,), 3.0)) and counting.compiles == 1
    fn(torch.ones(3))
    assert counting.compiles == 1


def test_the_graph_simulator_sketch_runs():
    """docs/graph-simulator.md's sketch with an ``fn`` and ``static_inputs`` of its own."""
    import torch

    x = torch.arange(4.0)
    namespace = _exec(_doc_block("graph-simulator.md", "from lora_core.testing import GraphSimulator, CaptureError"),
                      DOCS / "graph-simulator.md", {"fn": lambda t: t * 2 + 1, "static_inputs": (x,)})
    x.copy_(torch.full((4,), 10.0))  # what the sketch's comment says happens before replay()
    namespace["sim"].replay()
    assert torch.equal(namespace["out"], torch.full((4,), 21.0))


def test_the_multilora_sketch_of_layers_md_runs(tmp_path, monkeypatch):
    """docs/layers.md's explicit form, with the ``model`` and ``input_ids`` its prose assumes and
    adapters at the paths it names."""
    import torch

    from lora_layers import TinyConfig, TinyDecoder
    from lora_layers.sim.adapters import make_synthetic_adapters

    config = TinyConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4, fused=True)
    monkeypatch.chdir(tmp_path)
    made = make_synthetic_adapters(config, tmp_path / "made")
    (tmp_path / "path" / "to").mkdir(parents=True)
    made["r8"].rename(tmp_path / "path" / "to" / "peft_adapter_dir")
    made["r16"].rename(tmp_path / "path" / "to" / "another_adapter_dir")
    model = TinyDecoder(config)
    namespace = _exec(_doc_block("layers.md", "from lora_layers import MultiLoRA"), DOCS / "layers.md",
                      {"model": model, "input_ids": torch.randint(0, 64, (13,))})
    assert namespace["logits"].shape == (13, 64)
    assert type(model.model.layers[0].self_attn.qkv_proj) is torch.nn.Linear  # unwrapped again


def test_the_new_device_kind_of_testing_md_probes():
    import torch

    from lora_core.testing import DeviceProbe, DeviceType

    namespace = _exec(_doc_block("testing.md", "class XpuDevice(DeviceType):"), DOCS / "testing.md",
                      {"DeviceType": DeviceType, "DeviceProbe": DeviceProbe, "torch": torch})
    probe = namespace["XpuDevice"]().probe()
    assert isinstance(probe, DeviceProbe) and probe.reason


SHELL_WORDS = re.compile(r"(?:^|\s)(?:bash |\./)?((?:ci|examples|tests|packages)/[\w./-]+)")
MODULES = re.compile(r"python -m ([\w.]+)")


def test_shell_examples_name_scripts_files_and_modules_that_exist():
    """The bash and console blocks run tests, builds and hardware jobs, too long or too
    host-specific for a test; what they name must exist: scripts, files, python modules."""
    import importlib.util

    checked = 0
    for path in DOC_FILES:
        for language in ("bash", "console"):
            for block in _blocks(path, language):
                for name in SHELL_WORDS.findall(block):
                    assert (ROOT / name).exists(), f"{path.name}: {name} does not exist"
                    checked += 1
                for module in MODULES.findall(block):
                    if module not in ("pytest", "pip"):
                        assert importlib.util.find_spec(module) is not None, f"{path.name}: no module {module}"
                        checked += 1
    assert checked > 10


PIP_FROM_WHEELS = re.compile(r"pip install [^`\n]*dist/constraints\.txt[^`\n]*")


def test_every_install_from_the_wheels_pins_torch_too():
    """One install line everywhere: an install that takes lora-kit's wheels through
    ``dist/constraints.txt`` also gives ``-c ci/constraints.txt`` (torch 2.13.0), before it, so
    no doc leaves torch to whatever pip resolves."""
    found = 0
    for path in [*DOC_FILES, *READMES]:
        for line in PIP_FROM_WHEELS.findall(path.read_text()):
            found += 1
            assert "-c ci/constraints.txt -c dist/constraints.txt" in line, f"{path.relative_to(ROOT)}: {line}"
    assert found >= 3

