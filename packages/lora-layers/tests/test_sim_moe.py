"""lora-sim on a mixture-of-experts model (docs/moe.md): a Mixtral config.json, synthetic adapters
whose MLP targets are the fused experts' parameters, served eager and captured (the ``ascend``
backend's MoE op is the graph-safe one: tests/test_moe_ops.py)."""

import json

from lora_layers import sim
from lora_layers.layers import ExpertsWithLoRA
from lora_layers.models import TinyDecoder
from lora_layers.sim.cli import read_model_config
from lora_layers.sim.serving import build_multilora

MIXTRAL = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 32,
           "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "vocab_size": 64, "num_local_experts": 4, "num_experts_per_tok": 2, "rms_norm_eps": 1e-5}


def test_a_mixtral_config_gives_a_mixture_of_experts_model_with_expert_adapters(tmp_path):
    config, note = read_model_config(json.dumps(MIXTRAL))
    assert (config.num_experts, config.num_experts_per_tok) == (4, 2) and "num_local_experts" not in note
    paths = sim.make_synthetic_adapters(config, tmp_path)
    mlora = build_multilora(TinyDecoder(config), config, paths)
    experts = [n for n, m in mlora.wrapped.items() if isinstance(m, ExpertsWithLoRA)]
    assert experts == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    loaded = json.loads((paths["r32-rslora"] / "adapter_config.json").read_text())
    assert loaded["target_parameters"] == ["experts.down_proj", "experts.gate_up_proj"]


def test_the_mixtral_workload_passes_on_cpu_devices(capsys, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(MIXTRAL))
    code = sim.main(["--backend", "torch_native", "--device", "cpu", "--device", "cpu-graphsim", "--model-config", str(path),
                     "--decode-steps", "2", "--rounds", "3", "--json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert code == 0, out
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert len(rows) == 2 and {r["status"] for r in rows} == {"pass"}


def test_bad_expert_counts_are_named(capsys):
    assert sim.main(["--model-config", json.dumps({**MIXTRAL, "num_experts_per_tok": 5})]) == 2
    assert "num_experts_per_tok must be an integer from 1 to 4" in capsys.readouterr().err
