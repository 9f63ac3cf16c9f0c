"""lora-sim's request scales (#40): the workload's scaled requests, their merged references, and
a row checked against the wrong scale failing (test_sim.py runs the scaled default workload on
cpu, cpu-graphsim and cpu-compile)."""

import json

import pytest
import torch

from lora_layers import TinyDecoder, sim
from lora_layers.sim.reference import merged_reference_models, reference_key, reference_keys
from lora_layers.sim.workload import DEFAULT_SCALES, Workload, default_workload

SMALL = '{"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4}'
CONFIG = sim.parse_config(SMALL)  # fused, as lora-sim serves it


def test_the_default_workload_scales_requests_of_every_kind_of_adapter():
    workload = default_workload(["r8", "r16", "r32-rslora", "r64-embed-head"])
    assert workload.requests() == [("r8", 1.0), (None, 1.0), ("r16", 0.5), ("r32-rslora", 1.0),
                                   ("r64-embed-head", 1.5), ("r8", 0.0),
                                   ((("r32-rslora", 0.7), ("r64-embed-head", 0.4)), 0.8)]
    # scales belong to requests, not adapters: one given adapter gets them all
    assert default_workload(["mine"]).scales == DEFAULT_SCALES
    assert default_workload([]).scales == (1.0,) * 7


@pytest.mark.parametrize(("scales", "message"), [
    ((1.0,) * 5, "one entry per prompt; got 7, 7 and 5"),
    ((1.0, 1.0, -0.5, 1.0, 1.0, 1.0, 1.0), "scales must be finite and >= 0, got -0.5"),
    ((1.0, 1.0, float("nan"), 1.0, 1.0, 1.0, 1.0), "scales must be finite and >= 0, got nan"),
])
def test_a_workload_with_bad_scales_is_refused(scales, message):
    with pytest.raises(ValueError, match=message):
        Workload(scales=scales)


def test_reference_keys_are_adapter_and_scale_with_one_base_model():
    assert reference_key(None, 0.5) == (None, 1.0)
    assert reference_keys([("a", 1), (None, 0.0), ("a", 0.5), ("a", 1.0)]) == [(None, 1.0), ("a", 1.0), ("a", 0.5)]


def test_a_reference_merges_its_adapter_at_the_request_scale(tmp_path):
    paths = sim.make_synthetic_adapters(CONFIG, tmp_path)
    models = merged_reference_models(TinyDecoder(CONFIG), paths,
                                     [("r64-embed-head", s) for s in (0.0, 0.5, 1.0)])
    assert list(models) == [(None, 1.0), ("r64-embed-head", 0.0), ("r64-embed-head", 0.5), ("r64-embed-head", 1.0)]
    base = dict(models[(None, 1.0)].named_parameters())
    names = ["lm_head.weight", "model.embed_tokens.weight", "model.layers.0.self_attn.qkv_proj.weight"]
    for name in names:
        half = dict(models[("r64-embed-head", 0.5)].named_parameters())[name] - base[name]
        whole = dict(models[("r64-embed-head", 1.0)].named_parameters())[name] - base[name]
        assert whole.abs().max() > 0
        torch.testing.assert_close(half, 0.5 * whole)
        assert torch.equal(dict(models[("r64-embed-head", 0.0)].named_parameters())[name], base[name])


def test_checked_against_scale_1_references_the_scaled_rows_fail(capsys, monkeypatch, tmp_path):
    def at_scale_1(base, adapters, requests):  # every (adapter, scale) key holds the adapter merged at 1
        unscaled = merged_reference_models(base, adapters, [(a, 1.0) for a, _ in requests])
        return {(a, s): unscaled[reference_key(a, 1.0)] for a, s in reference_keys(requests)}

    monkeypatch.setattr(sim.run, "merged_reference_models", at_scale_1)
    argv = ["--device", "cpu", "--backend", "torch_native", "--model-config", SMALL, "--decode-steps", "1",
            "--rounds", "3", "--json", str(tmp_path / "r.json"), "--quiet"]
    assert sim.main(argv) == 1
    assert "| torch_native | cpu | fail |" in capsys.readouterr().out
    (row,) = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert row["max_abs_error"] > 1e-2  # far outside the fp32 tolerance, not a rounding miss


def test_the_help_states_the_default_workloads_scales():
    adapter_scales = [f"{s:g}" for a, s in Workload().requests() if isinstance(a, str)]
    said = f"{', '.join(adapter_scales[:-1])} and {adapter_scales[-1]}"
    assert f"the five single-adapter requests are at {said} (0: no delta;" in " ".join(sim.cli.EPILOG.split())
