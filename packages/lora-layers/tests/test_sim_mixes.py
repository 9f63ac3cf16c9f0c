"""lora-sim's weighted mix (#40): the default workload's mixed request, its merged reference (a
weighted sum of deltas), the graph batch's pair capacity, and a row checked against a reference of
the mix's first adapter alone failing (test_sim.py runs the default workload, the mix among it, on
cpu, cpu-graphsim and cpu-compile for both backends)."""

import json
from pathlib import Path

import pytest
import torch

from lora_layers import TinyDecoder, sim
from lora_layers.sim.reference import merged_reference_models, reference_key, reference_keys
from lora_layers.sim.report import format_requests
from lora_layers.sim.serving import unmixable
from lora_layers.sim.workload import MIX_WEIGHTS, Workload, default_workload, mix_pairs

SMALL = '{"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4}'
CONFIG = sim.parse_config(SMALL)  # fused, as lora-sim serves it
SYNTHETIC = ["r8", "r16", "r32-rslora", "r64-embed-head"]
MIX = (("r32-rslora", 0.7), ("r64-embed-head", 0.4))


def test_the_default_workload_has_a_request_mixing_two_adapters(tmp_path):
    workload = default_workload(SYNTHETIC)
    mixed = [(n, a, s) for n, a, s in zip(workload.prompt_lens, workload.adapters, workload.scales)
             if not (a is None or isinstance(a, str))]
    assert mixed == [(12, MIX, 0.8)]  # the embedding / LM-head adapter among them, weights not summing to 1
    assert default_workload(SYNTHETIC) == Workload()
    # the synthetic adapters are plain LoRA: none is DoRA or saves modules, so all can be mixed
    assert unmixable(sim.make_synthetic_adapters(CONFIG, tmp_path)) == []


def test_the_mix_takes_the_last_two_adapters_that_can_be_mixed():
    assert default_workload(["a", "b", "c"]).adapters[6] == (("b", 0.7), ("c", 0.4))
    assert default_workload(["a", "saver", "b"], unmixable=["saver"]).adapters[6] == (("a", 0.7), ("b", 0.4))
    # fewer than two: one adapter at the first weight, a mix of one (which any adapter can be)
    assert default_workload(["saver", "plain"], unmixable=["saver"]).adapters[6] == (("plain", 0.7),)
    assert default_workload(["dora"], unmixable=["dora"]).adapters[6] == (("dora", 0.7),)
    assert default_workload([]).adapters[6] is None
    assert MIX_WEIGHTS == (0.7, 0.4)


def test_a_workload_holds_mixes_in_either_form_as_pairs():
    lens, scales = (3, 2, 1), (1.0, 1.0, 0.5)
    given = Workload(prompt_lens=lens, adapters=("a", {"a": 0.5, "b": 2}, [("b", 1.0)]), scales=scales)
    assert given.adapters == ("a", (("a", 0.5), ("b", 2.0)), (("b", 1.0),))
    assert given.requests()[1] == ((("a", 0.5), ("b", 2.0)), 1.0)
    assert [mix_pairs(a) for a in (None, "a")] == [(), (("a", 1.0),)]
    hash(given)  # frozen and hashable, mixes included


@pytest.mark.parametrize(("mix", "message"), [
    ({}, r"adapters\[6\]: a mix must name at least one adapter, got \{\}"),
    ([("a", 1.0, 2.0)], r"adapters\[6\]: a mix is \{key: weight\} or \[\(key, weight\), \.\.\.\], got the entry"),
    ([("a", 0.5), ("a", 0.5)], r"adapters\[6\]: 'a' is named twice in the mix"),
    ([(3, 0.5)], r"adapters\[6\]: a mix names adapters by their names"),
    ({"a": -0.5}, r"adapters\[6\]: the weight of 'a' must be >= 0, got -0.5"),
    ({"a": float("inf")}, r"adapters\[6\]: the weight of 'a' must be a finite float, got inf"),
    ({"a": True}, r"adapters\[6\]: the weight of 'a' must be a finite float, got True"),
    (3, r"adapters\[6\] must be an adapter name, None or a weighted mix"),
])
def test_a_bad_mix_is_refused_naming_its_request(mix, message):
    with pytest.raises(ValueError, match=message):
        Workload(adapters=Workload.adapters[:6] + (mix,))


def test_the_pairs_count_a_token_per_adapter_of_its_request():
    workload = Workload()
    assert workload.pairs(workload.prompt_lens) == sum(workload.prompt_lens) + 12  # 12 tokens of a two-adapter mix
    assert workload.pairs([1] * 7) == 8  # a decode step: one pair row, wherever the rotation puts the mix
    three = Workload(prompt_lens=(4, 5), adapters=("a", {"a": 1, "b": 1, "c": 1}), scales=(1.0, 1.0))
    assert three.pairs([4, 5]) == 4 + 5 * 3


def test_the_reference_of_a_mix_is_the_weighted_sum_of_its_adapters_deltas(tmp_path):
    paths = sim.make_synthetic_adapters(CONFIG, tmp_path)
    requests = [("r32-rslora", 1.0), ("r64-embed-head", 1.0), (dict(MIX), 0.8)]
    models = merged_reference_models(TinyDecoder(CONFIG), paths, requests)
    assert list(models) == [(None, 1.0), ("r32-rslora", 1.0), ("r64-embed-head", 1.0), (MIX, 0.8)]
    assert reference_key(dict(MIX), 0.8) == (MIX, 0.8) and reference_keys(requests) == list(models)
    params = {key: dict(m.named_parameters()) for key, m in models.items()}
    base = params[(None, 1.0)]
    # the embedding and the LM head (r64-embed-head's only), a fused projection both adapters target,
    # and one only r32-rslora targets
    names = ["model.embed_tokens.weight", "lm_head.weight", "model.layers.0.self_attn.qkv_proj.weight",
             "model.layers.1.mlp.gate_up_proj.weight"]
    for name in names:
        delta_a = params[("r32-rslora", 1.0)][name] - base[name]
        delta_b = params[("r64-embed-head", 1.0)][name] - base[name]
        mixed = params[(MIX, 0.8)][name] - base[name]
        torch.testing.assert_close(mixed, 0.8 * (0.7 * delta_a + 0.4 * delta_b))
        assert mixed.abs().max() > 0


def _small_run(tmp_path, *devices):
    argv = ["--backend", "torch_native", "--model-config", SMALL, "--decode-steps", "2", "--rounds", "3",
            "--json", str(tmp_path / "r.json"), "--quiet"]
    for device in devices:
        argv += ["--device", device]
    code = sim.main(argv)
    return code, json.loads((tmp_path / "r.json").read_text())["rows"]


def test_checked_against_the_mixs_first_adapter_alone_the_mixed_request_fails(monkeypatch, tmp_path):
    def first_adapter_only(base, adapters, requests):  # the mix's key holds its first adapter, weighted
        keys = reference_keys(requests)
        firsts = [(mix_pairs(a)[:1], s) if a is not None else (a, s) for a, s in keys]
        built = merged_reference_models(base, adapters, firsts)
        return dict(zip(keys, [built[reference_key(a, s)] for a, s in firsts]))

    monkeypatch.setattr(sim.run, "merged_reference_models", first_adapter_only)
    code, rows = _small_run(tmp_path, "cpu", "cpu-graphsim")
    assert code == 1 and [r["status"] for r in rows] == ["fail", "fail"]
    for row in rows:
        *others, mixed = row["max_abs_error_by_request"]
        assert mixed > 1e-2 and max(others) < 1e-4, row["max_abs_error_by_request"]  # the mix alone is off


def test_a_graph_batch_sized_for_the_tokens_alone_cannot_hold_the_mix(monkeypatch, tmp_path):
    # what Workload.pairs gives enable_graph is what makes room for the mix's pair rows
    monkeypatch.setattr(Workload, "pairs", lambda self, seq_lens: sum(seq_lens))
    code, rows = _small_run(tmp_path, "cpu", "cpu-graphsim")
    assert code == 1 and [r["status"] for r in rows] == ["pass", "error"]
    assert "build it with max_pairs >= 8" in rows[1]["reason"]


def test_the_requests_line_says_what_a_mix_gets_only_when_there_is_one():
    assert "12 tok (0.7 r32-rslora + 0.4 r64-embed-head) x0.8; a mix's request gets scale * sum of weight * delta;" \
        in format_requests(Workload())
    plain = format_requests(Workload(prompt_lens=(3, 2), adapters=("a", None), scales=(0.5, 1.0)))
    assert plain == ("requests (prompt tokens, adapter x request scale): 3 tok a x0.5, 2 tok base; "
                     "each decode step rotates them by one request")


def test_the_help_and_the_readme_state_the_default_mix():
    (mix, scale), = [(a, s) for a, s in Workload().requests() if not (a is None or isinstance(a, str))]
    said = f"{' + '.join(f'{w:g} {name}' for name, w in mix)}"
    epilog = " ".join(sim.cli.EPILOG.split())
    assert f"The seventh request mixes the last two adapters, {said} (the embedding and LM head among its " \
           f"modules), at scale {scale:g}: it gets {scale:g} * (0.7 delta_a + 0.4 delta_b)" in epilog
    assert "No request mixes" not in epilog
    readme = " ".join((Path(__file__).resolve().parents[3] / "README.md").read_text().split())
    assert f"(`{said}` at scale {scale:g}: `{scale:g} * (0.7 delta_a + 0.4 delta_b)`)" in readme
    assert "no mixed requests" not in readme
