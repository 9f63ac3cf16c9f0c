"""What MultiLoRA.from_adapters wraps is what PEFT wraps, and what lora-kit cannot serve is refused.

Target matching (lora_core.adapter_config) is checked against the LoRA layers
PEFT itself puts on tiny random Llama and GPT-2 models, for list, dotted,
full-name, regex and ``all-linear`` targets, ``exclude_modules`` and
``layers_to_transform`` / ``layers_pattern``. PEFT features whose math lora-kit
does not implement are refused on load with one line naming the feature.
"""

import copy
import json
import shutil
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs transformers (tests/requirements.txt)")
peft = pytest.importorskip("peft", reason="needs peft (tests/requirements.txt)")

from lora_core import AdapterFormatError, load_peft_adapter  # noqa: E402
from lora_core.adapter_config import matched_modules, module_alpha, module_rank  # noqa: E402
from lora_layers import MultiLoRA, sim  # noqa: E402

LLAMA = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=64)


def _llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).eval()


def _gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=32, vocab_size=64,
                                     bos_token_id=1, eos_token_id=2)
    return transformers.GPT2LMHeadModel(config).eval()


def _save(model, tmp_path, name="a", **config):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapped = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(init_lora_weights=False, **config))
        wrapped.save_pretrained(str(tmp_path / name))
    return wrapped, tmp_path / name


def _peft_targets(peft_model):
    return sorted(name.removeprefix("base_model.model.") for name, m in peft_model.named_modules()
                  if isinstance(m, peft.tuners.lora.LoraLayer))


TARGETING = [
    ("llama", dict(target_modules=["q_proj", "v_proj"])),
    ("llama", dict(target_modules=["self_attn.o_proj", "mlp.down_proj", "lm_head"])),
    ("llama", dict(target_modules=["model.layers.0.self_attn.q_proj", "k_proj"], layers_to_transform=[1])),
    ("llama", dict(target_modules=r".*\.layers\.1\..*(k|v)_proj")),
    ("llama", dict(target_modules="all-linear")),
    ("llama", dict(target_modules=["up_proj", "embed_tokens"], layers_to_transform=1, layers_pattern="layers")),
    ("llama", dict(target_modules=r".*_proj", exclude_modules=["q_proj", "mlp.up_proj"])),
    ("llama", dict(target_modules=["q_proj", "gate_proj"], exclude_modules=r".*\.layers\.0\..*")),
    ("gpt2", dict(target_modules=["c_attn", "c_proj"], layers_to_transform=[1], layers_pattern=["h"], fan_in_fan_out=True)),
    ("gpt2", dict(target_modules="all-linear", fan_in_fan_out=True)),
    ("gpt2", dict(target_modules=["c_fc", "wte", "lm_head"], fan_in_fan_out=True)),
]


@pytest.mark.parametrize(("kind", "config"), TARGETING, ids=[f"{k}-{i}" for i, (k, _) in enumerate(TARGETING)])
def test_from_adapters_wraps_the_modules_peft_wraps(tmp_path, kind, config):
    base = _llama() if kind == "llama" else _gpt2()
    peft_model, path = _save(base, tmp_path, r=4, lora_alpha=8, **config)
    expected = _peft_targets(peft_model)
    names = [name for name, _ in base.named_modules()]
    linear = {n for n, m in base.named_modules() if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D"}
    saved = json.loads((path / "adapter_config.json").read_text())
    assert sorted(matched_modules(saved, names, linear_modules=linear, output_embedding="lm_head")) == expected
    model = copy.deepcopy(base)
    mlora = MultiLoRA.from_adapters(model, {"a": path})
    assert sorted(mlora.wrapped) == expected
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = peft_model.eval()(input_ids=ids, adapter_names=["default", "__base__"]).logits
        got = model(input_ids=ids, adapter_names=["a", None]).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_rank_and_alpha_patterns_follow_peft(tmp_path):
    peft_model, path = _save(_llama(), tmp_path, r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"],
                             rank_pattern={"down_proj": 2, "layers.1.self_attn.q_proj": 6}, alpha_pattern={"q_proj": 3})
    config = json.loads((path / "adapter_config.json").read_text())
    for name, layer in peft_model.named_modules():
        if isinstance(layer, peft.tuners.lora.LoraLayer):
            module = name.removeprefix("base_model.model.")
            assert module_rank(config, module) == layer.r["default"]
            assert module_alpha(config, module) == layer.lora_alpha["default"]
    mlora = MultiLoRA.from_adapters(_llama(), {"a": path})
    assert mlora.slots.max_rank == 6


def _refused(path, feature):
    with pytest.raises(AdapterFormatError) as err:
        load_peft_adapter(path)
    message = str(err.value)
    assert feature in message and "not supported" in message and "\n" not in message
    with pytest.raises(AdapterFormatError, match=feature):
        MultiLoRA.from_adapters(_llama(), {"x": path})
    return message


def test_an_activated_lora_is_refused_not_applied_to_every_token(tmp_path, capsys):
    _, path = _save(_llama(), tmp_path, r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM",
                    alora_invocation_tokens=[5, 6, 7])
    message = _refused(path, "alora_invocation_tokens")
    assert "Activated LoRA" in message
    assert sim.main([f"--adapter=x={path}", "--device", "cpu"]) == 2
    assert "alora_invocation_tokens" in capsys.readouterr().err


@pytest.mark.parametrize(("config", "feature"), [
    (dict(bias="lora_only"), "bias = 'lora_only'"),
    (dict(bias="all"), "bias = 'all'"),
    (dict(layer_replication=[[0, 2], [1, 2]]), "layer_replication"),
    (dict(trainable_token_indices=[3, 4]), "trainable_token_indices"),
])
def test_peft_features_without_lora_kit_math_are_refused(tmp_path, config, feature):
    _, path = _save(_llama(), tmp_path, r=4, target_modules=["q_proj"], **config)
    _refused(path, feature)


@pytest.mark.parametrize(("key", "value"), [
    ("use_qalora", True),
    ("kasa_config", {"init_method": "svd"}),
    ("monteclora_config", {"num_samples": 4}),
    ("arrow_config", {"top_k": 2}),
    ("use_bdlora", {"nblocks": 2}),
])
def test_configured_features_are_refused_by_name(tmp_path, key, value):
    # features PEFT builds only on special layers or with extra inputs: set in a saved config
    _, path = _save(_llama(), tmp_path, r=4, target_modules=["q_proj"])
    edited = tmp_path / "edited"
    shutil.copytree(path, edited)
    config = json.loads((edited / "adapter_config.json").read_text())
    (edited / "adapter_config.json").write_text(json.dumps({**config, key: value}))
    _refused(edited, key)


def test_features_that_do_not_change_inference_are_served(tmp_path):
    # training-only or initialisation-only options (dropout, VeLoRA's backward, init methods) serve as plain LoRA
    _, path = _save(_llama(), tmp_path, r=4, target_modules=["q_proj"], lora_dropout=0.1)
    config = json.loads((path / "adapter_config.json").read_text())
    edited = {**config, "velora_config": {"rank": 2}, "eva_config": {"rho": 2.0}, "megatron_config": None}
    (path / "adapter_config.json").write_text(json.dumps(edited))
    assert load_peft_adapter(path).rank == 4
