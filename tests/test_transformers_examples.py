"""The offline examples run: serving PEFT adapters with generate() on a tiny Llama, and the PEFT benchmark (smoke)."""

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="needs transformers (tests/requirements.txt)")
pytest.importorskip("peft", reason="needs peft (tests/requirements.txt)")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _load(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_serve_peft_llama_matches_peft_on_every_backend(capsys):
    assert _load("serve_peft_llama").main(["--max-new-tokens", "5"]) == 0
    out = capsys.readouterr().out
    assert "torch_native: wrapped 16 modules" in out and "tokens match PEFT's" in out and "DIFFER" not in out


def test_bench_peft_smoke_checks_and_times_every_variant(capsys, tmp_path):
    assert _load("bench_peft").main(["--smoke", "--json", str(tmp_path / "bench.json")]) == 0
    out = capsys.readouterr().out
    for variant in ("| prefill | base |", "| prefill | peft |", "| decode | lora-kit torch_native |"):
        assert variant in out
    assert "target (decode, lora-kit torch_native): LoRA overhead at most 0.33 of PEFT's" in out
    assert "target (prefill, lora-kit torch_native): LoRA overhead at most 0.50 of PEFT's" in out
    assert "target (prefill, lora-kit ascend): LoRA overhead at most 1.00 of PEFT's" in out
    meta = json.loads((tmp_path / "bench.json").read_text())["meta"]
    assert len(meta["routes"]["decode"]) == 64 and meta["targets"]["ascend"] == {"prefill": 1.0, "decode": 1.0}


def test_the_example_of_docs_transformers_md_runs(capsys, tmp_path, monkeypatch):
    import re
    import warnings

    doc = EXAMPLES.parent / "docs" / "transformers.md"
    (block,) = re.findall(r"^```python\n(.*?)^```", doc.read_text(), re.S | re.M)[:1]
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(compile(block, str(doc), "exec"), {"__name__": "__docs_example__"})
    assert "tokens equal PEFT's" in capsys.readouterr().out
    # the one warning the example prints outside its own catch_warnings is the one the doc explains
    ours = [str(w.message) for w in caught if "base-model weights" in str(w.message)]
    assert len(ours) == 1 and ours[0].endswith(
        "/chat: ignoring base-model weights saved with the adapter: base_model.model.lm_head.base_layer.weight"), ours
    assert "ignoring base-model weights saved with the adapter: base_model.model.lm_head.base_layer.weight" in \
        doc.read_text()
