"""The worked example in docs/layers.md runs as written (it needs peft)."""

import re
import warnings
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "layers.md"


def test_worked_peft_example_runs(tmp_path, monkeypatch):
    pytest.importorskip("peft", reason="the example needs peft (tests/requirements.txt)")
    (code,) = re.findall(r"## A worked example with a PEFT adapter\n\n```python\n(.*?)```", DOC.read_text(), re.S)
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(code, str(DOC), "exec"), {})
