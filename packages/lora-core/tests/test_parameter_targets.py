"""PEFT target_parameters adapters (docs/moe.md): saved by depth, named by the model's parameter order,
per-expert layout, ranks and scalings by pattern; malformed ones refused by name."""

import json

import pytest
import torch

from lora_core import AdapterFormatError, load_peft_adapter, save_peft_adapter

MODULE = "model.layers.0.mlp.experts"
ORDER = ["gate_up_proj", "down_proj"]  # the experts module's registration order


def _experts(gen, E, r, in_f, out_f):
    return torch.randn(E, r, in_f, generator=gen), torch.randn(E, out_f, r, generator=gen)


def test_round_trip_names_each_parameter_and_its_experts(tmp_path):
    gen = torch.Generator().manual_seed(0)
    gu, down = _experts(gen, 3, 4, 8, 12), _experts(gen, 3, 4, 6, 8)
    q = (torch.randn(4, 8, generator=gen), torch.randn(8, 4, generator=gen))
    path = save_peft_adapter(tmp_path / "a", {"model.layers.0.self_attn.q_proj": q}, lora_alpha=8, use_rslora=True,
                             parameters={MODULE: [("gate_up_proj", *gu), ("down_proj", *down)]})
    config = json.loads((path / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["experts.down_proj", "experts.gate_up_proj"]
    adapter = load_peft_adapter(path)
    assert set(adapter.parameter_pairs) == {MODULE} and len(adapter.parameter_pairs[MODULE]) == 2
    with pytest.raises(ValueError, match="known once they are named"):
        adapter.rank
    named = adapter.with_parameters(lambda module: ORDER)
    for param, (a, b) in (("gate_up_proj", gu), ("down_proj", down)):
        w = named.modules[f"{MODULE}.{param}"]
        assert w.kind == "experts" and w.rank == 4 and w.scaling == pytest.approx(8 / 4**0.5)
        torch.testing.assert_close(w.lora_a, a, rtol=0, atol=0)
        torch.testing.assert_close(w.lora_b, b, rtol=0, atol=0)
    assert named.rank == 4 and named.modules["model.layers.0.self_attn.q_proj"].kind == "linear"


def test_rank_and_alpha_patterns_are_keyed_by_module_and_parameter(tmp_path):
    gen = torch.Generator().manual_seed(1)
    down = _experts(gen, 2, 2, 6, 8)
    path = save_peft_adapter(tmp_path / "a", {}, r=4, lora_alpha=8, rank_pattern={"down_proj": 2},
                             alpha_pattern={"experts.down_proj": 3}, parameters={MODULE: [("down_proj", *down)]})
    w = load_peft_adapter(path).with_parameters(lambda module: ORDER).modules[f"{MODULE}.down_proj"]
    assert (w.rank, w.scaling) == (2, pytest.approx(3 / 2))
    torch.testing.assert_close(w.lora_b, down[1], rtol=0, atol=0)


def test_pairs_that_do_not_match_the_targeted_parameters_are_refused(tmp_path):
    gen = torch.Generator().manual_seed(2)
    path = save_peft_adapter(tmp_path / "a", {}, lora_alpha=8, parameters={
        MODULE: [("gate_up_proj", *_experts(gen, 2, 4, 8, 12)), ("down_proj", *_experts(gen, 2, 4, 6, 8))]})
    adapter = load_peft_adapter(path)
    with pytest.raises(AdapterFormatError, match="2 nested parameter LoRA pair"):
        adapter.with_parameters(lambda module: ["gate_up_proj"])
    with pytest.raises(AdapterFormatError, match="which the model does not have"):
        adapter.with_parameters(lambda module: {}[module])
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**config, "target_parameters": None}))
    with pytest.raises(AdapterFormatError, match="has no target_parameters"):
        load_peft_adapter(path)


def test_nested_levels_stay_with_their_module_when_a_bare_parameter_name_is_targeted(tmp_path):
    """PEFT 0.22 rewrites some MoE configs for transformers v5 into target_parameters with bare names
    (``["gate_up_proj", "experts.gate_up_proj", "down_proj"]``, target_modules empty): a bare name could
    name any module's pair, but ``<module>.base_layer`` is a nested level of ``<module>``, never a root."""
    gen = torch.Generator().manual_seed(3)
    gu, down = _experts(gen, 2, 4, 8, 12), _experts(gen, 2, 4, 6, 8)
    path = save_peft_adapter(tmp_path / "a", {}, lora_alpha=8, parameters={
        MODULE: [("gate_up_proj", *gu), ("down_proj", *down)]})
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps(
        {**config, "target_parameters": ["gate_up_proj", "experts.gate_up_proj", "down_proj"], "target_modules": []}))
    adapter = load_peft_adapter(path)
    assert set(adapter.parameter_pairs) == {MODULE} and len(adapter.parameter_pairs[MODULE]) == 2
