"""lora-sim with real adapters: a transformers config.json as --model-config, the adapters' own
rank, and a tolerance relative to the outputs' magnitude (no transformers needed)."""

import json

import pytest
import torch

from lora_core import load_peft_adapter, save_peft_adapter
from lora_layers import TinyConfig, sim
from lora_layers.sim.cli import TRANSFORMERS_KEYS, read_model_config
from lora_layers.sim.errors import UsageError
from lora_layers.sim.reference import ScaledCheck

SMALL = '{"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4}'
# what LlamaConfig(...).save_pretrained writes, trimmed to a few of its keys
LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 1, "eos_token_id": 2, "head_dim": 8, "hidden_act": "silu", "hidden_size": 32,
    "initializer_range": 0.02, "intermediate_size": 48, "max_position_embeddings": 2048, "mlp_bias": False,
    "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2, "pretraining_tp": 1,
    "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "float32",
    "transformers_version": "4.46.0", "use_cache": True, "vocab_size": 64,
}


def test_a_transformers_config_json_gives_the_sizes_and_a_note(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA_CONFIG))
    config, note = read_model_config(str(path))
    assert (config.vocab_size, config.hidden_size, config.intermediate_size, config.num_hidden_layers,
            config.num_attention_heads, config.num_key_value_heads) == (64, 32, 48, 2, 4, 2)
    assert config.fused == sim.DEFAULT_CONFIG.fused and config.seed == sim.DEFAULT_CONFIG.seed
    ignored = len(set(LLAMA_CONFIG) - set(TRANSFORMERS_KEYS) - {"head_dim"})
    assert note.startswith("--model-config: a transformers config (llama): using hidden_size, intermediate_size")
    assert f"ignoring {ignored} other key(s) (architectures, attention_bias," in note
    # Qwen2 and Mistral configs may leave num_key_value_heads out: the model then has MHA
    qwen = {k: v for k, v in LLAMA_CONFIG.items() if k not in ("num_key_value_heads", "head_dim")}
    assert read_model_config(json.dumps({**qwen, "model_type": "qwen2"}))[0].num_key_value_heads == 4
    assert read_model_config(SMALL) == (sim.parse_config(SMALL), None)


@pytest.mark.parametrize(("values", "message"), [
    ({**LLAMA_CONFIG, "head_dim": 16}, r"head_dim = 16 is not hidden_size / num_attention_heads \(32 / 4\)"),
    ({"model_type": "gpt2", "n_embd": 32, "n_head": 4}, r"has no hidden_size, num_attention_heads \(lora-sim reads"),
    ({"hidden_size": 32, "rope_theta": 1.0}, r"unknown keys \['rope_theta'\].*or give a transformers config.json"),
])
def test_config_errors_are_one_line(values, message):
    with pytest.raises(UsageError, match=message):
        read_model_config(json.dumps(values))


def _large_adapter(tmp_path, config: TinyConfig, name="big", rank=128, scale=30.0):
    """A valid adapter of rank 128 (above the synthetic 64) whose weights make logits in the hundreds."""
    paths = sim.make_synthetic_adapters(config, tmp_path / "synthetic")
    adapter = load_peft_adapter(paths["r64-embed-head"])
    modules = {m: (torch.cat([w.lora_a, w.lora_a]), torch.cat([w.lora_b, w.lora_b], dim=1) * scale / 2)
               for m, w in adapter.modules.items()}
    return save_peft_adapter(tmp_path / name, modules, r=rank, lora_alpha=64, embedding_modules=("model.embed_tokens",))


def test_the_adapters_own_rank_is_served_from_a_transformers_config(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA_CONFIG))
    adapter = _large_adapter(tmp_path, read_model_config(str(path))[0], scale=1.0)
    code = sim.main([f"--adapter=big={adapter}", "--model-config", str(path), "--device", "cpu",
                     "--backend", "torch_native", "--decode-steps", "1", "--rounds", "3"])
    out = capsys.readouterr()
    assert code == 0, out.out
    assert "lora-sim: --model-config: a transformers config (llama)" in out.err
    assert "| torch_native | cpu | pass |" in out.out


def test_the_check_is_relative_to_the_outputs_magnitude():
    check = ScaledCheck()
    want = torch.linspace(-300.0, 300.0, 1000)
    check(want * (1 + 2e-7), want)  # fp32 rounding of logits in the hundreds: 6e-5 absolute
    assert check.ok and check.max_error > 1e-5 and check.max_relative_error < 1e-6
    check(torch.tensor([0.5 + 2e-5]), torch.tensor([0.5]))  # unit-scale outputs keep the absolute tolerance
    assert not check.ok
    assert check.tolerance == "fp32 rtol=1e-05 atol=1e-05 x max(1, max|ref|)"


def test_a_valid_adapter_with_large_weights_passes(tmp_path, capsys):
    config = sim.parse_config(SMALL)
    adapter = _large_adapter(tmp_path, config)
    code = sim.main([f"--adapter=big={adapter}", "--model-config", SMALL, "--device", "cpu",
                     "--backend", "torch_native", "--decode-steps", "2", "--rounds", "3"])
    assert code == 0, capsys.readouterr().out


def _with_tensor(path, key, tensor):
    """The adapter at ``path`` with one more tensor in its safetensors file."""
    from safetensors.torch import load_file, save_file

    weights = path / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    tensors[key] = tensor
    save_file(tensors, str(weights))
    return path


def test_base_model_weights_saved_with_an_adapter_are_reported_once_per_run(tmp_path, capsys, recwarn):
    """PEFT's save_embedding_layers stores the base model's table beside the adapter: lora-sim
    reads each adapter once per run (the check, every row and the references use that read),
    so its warning shows once, not once per load and again per row."""
    config = sim.parse_config(SMALL)
    adapter = _with_tensor(_large_adapter(tmp_path, config, scale=1.0), "base_model.model.lm_head.weight",
                           torch.zeros(64, 32))
    code = sim.main([f"--adapter=big={adapter}", "--model-config", SMALL, "--device", "cpu", "--device",
                     "cpu-graphsim", "--backend", "torch_native", "--decode-steps", "1", "--rounds", "3"])
    assert code == 0, capsys.readouterr().out
    ignored = [w for w in recwarn if "ignoring base-model weights saved with the adapter" in str(w.message)]
    assert len(ignored) == 1 and str(adapter) in str(ignored[0].message)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_an_adapter_with_non_finite_weights_is_refused_before_the_run(tmp_path, capsys, bad):
    config = sim.parse_config(SMALL)
    adapter = _large_adapter(tmp_path, config, scale=1.0)
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    from safetensors.torch import load_file

    b = load_file(str(adapter / "adapter_model.safetensors"))[key].clone()
    b[3, 5] = bad
    _with_tensor(adapter, key, b)
    code = sim.main([f"--adapter=big={adapter}", "--model-config", SMALL, "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [f"lora-sim: error: --adapter big: {adapter / 'adapter_model.safetensors'}: "
                                 f"tensor {key!r} has 1 non-finite value(s) (NaN or inf) of {b.numel()}"]
