"""PEFT adapter loading from files built on the fly."""

import json

import pytest
import torch
from safetensors.torch import save_file

from lora_core import AdapterFormatError, load_peft_adapter, save_peft_adapter


def _modules():
    g = torch.Generator().manual_seed(0)
    return {
        "model.layers.0.self_attn.q_proj": (torch.randn(4, 8, generator=g), torch.randn(8, 4, generator=g)),
        "model.layers.0.mlp.down_proj": (torch.randn(2, 16, generator=g), torch.randn(8, 2, generator=g)),
        "model.embed_tokens": (torch.randn(4, 32, generator=g), torch.randn(8, 4, generator=g)),
    }


def test_round_trip_with_rank_and_alpha_patterns(tmp_path):
    modules = _modules()
    save_peft_adapter(tmp_path, modules, r=4, lora_alpha=16, embedding_modules=("model.embed_tokens",),
                      rank_pattern={"down_proj": 2}, alpha_pattern={"down_proj": 8})
    adapter = load_peft_adapter(tmp_path)
    assert set(adapter.modules) == set(modules) and adapter.rank == 4
    q = adapter.modules["model.layers.0.self_attn.q_proj"]
    assert q.kind == "linear" and q.scaling == 16 / 4 and torch.equal(q.lora_a, modules[q.name][0])
    down = adapter.modules["model.layers.0.mlp.down_proj"]
    assert down.rank == 2 and down.scaling == 8 / 2
    emb = adapter.modules["model.embed_tokens"]
    assert emb.kind == "embedding" and torch.equal(emb.lora_b, modules[emb.name][1])


def test_rslora_scaling(tmp_path):
    save_peft_adapter(tmp_path, _modules(), r=4, lora_alpha=16, use_rslora=True,
                      embedding_modules=("model.embed_tokens",), rank_pattern={"down_proj": 2})
    adapter = load_peft_adapter(tmp_path)
    assert adapter.modules["model.layers.0.self_attn.q_proj"].scaling == 16 / 2.0
    assert adapter.modules["model.layers.0.mlp.down_proj"].scaling == pytest.approx(16 / 2**0.5)


def test_bin_weights_load_with_weights_only(tmp_path):
    save_peft_adapter(tmp_path, _modules(), r=4, lora_alpha=4, embedding_modules=("model.embed_tokens",),
                      rank_pattern={"down_proj": 2})
    from safetensors.torch import load_file

    tensors = load_file(str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_model.safetensors").unlink()
    torch.save(tensors, tmp_path / "adapter_model.bin")
    assert len(load_peft_adapter(tmp_path).modules) == 3


_FC = {"base_model.model.fc.lora_A.weight": torch.ones(2, 3), "base_model.model.fc.lora_B.weight": torch.ones(4, 2)}


def test_saved_modules_are_read_with_the_lora_weights(tmp_path):
    # PEFT's modules_to_save: the module's own copy, saved as base_model.model.<module>.weight / .bias
    head, bias, table = torch.randn(5, 3), torch.randn(5), torch.randn(7, 3)
    adapter = load_peft_adapter(_write(tmp_path, {"modules_to_save": ["score", "embed_tokens", "classifier"]}, {
        **_FC, "base_model.model.score.weight": head, "base_model.model.score.bias": bias,
        "base_model.model.model.embed_tokens.weight": table}))
    assert set(adapter.modules) == {"fc"} and set(adapter.saved_modules) == {"score", "model.embed_tokens"}
    score, embed = adapter.saved_modules["score"], adapter.saved_modules["model.embed_tokens"]
    assert score.kind == "saved" and torch.equal(score.weight, head) and torch.equal(score.bias, bias)
    assert torch.equal(embed.weight, table) and embed.bias is None


def _write(tmp_path, config=None, tensors=None):
    base = {"peft_type": "LORA", "r": 2, "lora_alpha": 4}
    (tmp_path / "adapter_config.json").write_text(json.dumps({**base, **(config or {})}))
    if tensors is None:
        tensors = {"base_model.model.fc.lora_A.weight": torch.ones(2, 3),
                   "base_model.model.fc.lora_B.weight": torch.ones(4, 2)}
    save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    return tmp_path


@pytest.mark.parametrize(
    ("config", "tensors", "error", "match"),
    [
        ({"use_dora": True}, None, AdapterFormatError, "module 'fc' of a DoRA adapter .* has no lora_magnitude_vector"),
        ({"use_dora": "yes"}, None, AdapterFormatError, "use_dora must be true or false"),
        ({"use_dora": True}, {"base_model.model.fc.lora_A.weight": torch.ones(2, 3), "base_model.model.fc.lora_B.weight": torch.ones(4, 2), "base_model.model.fc.lora_magnitude_vector": torch.ones(3)}, AdapterFormatError,
         r"lora_magnitude_vector of shape \(3,\); expected \(4,\)"),
        ({"use_dora": True}, {"base_model.model.fc.lora_A.weight": torch.ones(2, 3), "base_model.model.fc.lora_B.weight": torch.ones(4, 2), "base_model.model.fc.lora_magnitude_vector": torch.ones(4),
                              "base_model.model.up.lora_magnitude_vector": torch.ones(4)}, AdapterFormatError,
         "magnitude vector for module 'up', which has no LoRA weights"),
        ({"lora_bias": True}, None, AdapterFormatError, "LoRA bias"),
        ({"peft_type": "IA3"}, None, AdapterFormatError, "peft_type 'IA3' is not supported"),
        ({"modules_to_save": "lm_head"}, None, AdapterFormatError, "modules_to_save must be a list"),
        ({"modules_to_save": ["head"]}, {**_FC, "base_model.model.head.weight": torch.ones(4)}, AdapterFormatError,
         r"saved module 'head' \(modules_to_save\) needs a floating-point 2-D weight, got \(4,\)"),
        ({"modules_to_save": ["head"]}, {**_FC, "base_model.model.head.weight": torch.ones(4, 3),
                                         "base_model.model.head.bias": torch.ones(3)}, AdapterFormatError,
         r"saved module 'head' \(modules_to_save\) has a bias of shape \(3,\); expected \(4,\)"),
        ({"modules_to_save": ["fc"]}, {**_FC, "base_model.model.fc.weight": torch.ones(4, 3)}, AdapterFormatError,
         "module 'fc' has LoRA weights and is saved whole"),
        ({"r": 0}, None, AdapterFormatError, "r must be a positive number"),
        ({"r": 3}, None, AdapterFormatError, "module 'fc' has rank 2 but adapter_config.json declares r = 3"),
        ({}, {"base_model.model.fc.lora_A.weight": torch.ones(2, 3)}, AdapterFormatError, "has no LoRA B weight"),
        ({}, {"base_model.model.fc.lora_A.weight": torch.ones(2, 3),
              "base_model.model.fc.lora_B.weight": torch.ones(4, 3)}, AdapterFormatError, "expected A"),
        ({}, {"base_model.model.fc.lora_A.weight": torch.ones(2, 3), "base_model.model.fc.lora_B.weight": torch.ones(4, 2), "base_model.model.fc.lora_magnitude_vector": torch.ones(4)}, AdapterFormatError,
         "DoRA magnitude vectors \\(fc\\) in an adapter whose adapter_config.json does not set use_dora"),
    ],
)
def test_malformed_or_unsupported_adapters_are_rejected(tmp_path, config, tensors, error, match):
    with pytest.raises(error, match=match):
        load_peft_adapter(_write(tmp_path, config, tensors))


def test_missing_files_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_peft_adapter(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no adapter_config.json"):
        load_peft_adapter(tmp_path)
    (tmp_path / "adapter_config.json").write_text('{"r": 2, "lora_alpha": 4}')
    with pytest.raises(FileNotFoundError, match="no adapter_model.safetensors or adapter_model.bin"):
        load_peft_adapter(tmp_path)
    (tmp_path / "adapter_config.json").write_text("{not json")
    with pytest.raises(AdapterFormatError, match="is not valid JSON"):
        load_peft_adapter(tmp_path)


def test_corrupt_weights_are_a_format_error(tmp_path):
    _write(tmp_path)
    (tmp_path / "adapter_model.safetensors").write_bytes(b"garbage")
    with pytest.raises(AdapterFormatError, match="cannot read"):
        load_peft_adapter(tmp_path)


def test_base_weights_saved_with_the_adapter_are_ignored_with_a_warning(tmp_path):
    _write(tmp_path, tensors={"base_model.model.fc.lora_A.weight": torch.ones(2, 3),
                              "base_model.model.fc.lora_B.weight": torch.ones(4, 2),
                              "base_model.model.lm_head.weight": torch.ones(10, 4)})
    with pytest.warns(UserWarning, match="ignoring base-model weights saved with the adapter: .*lm_head.weight"):
        adapter = load_peft_adapter(tmp_path)
    assert list(adapter.modules) == ["fc"]


def test_a_dora_adapter_loads_each_modules_magnitude(tmp_path):
    magnitude = torch.arange(1.0, 5.0)
    path = _write(tmp_path, {"use_dora": True},
                  {"base_model.model.fc.lora_A.weight": torch.ones(2, 3),
                   "base_model.model.fc.lora_B.weight": torch.ones(4, 2),
                   "base_model.model.fc.lora_magnitude_vector": magnitude,
                   "base_model.model.emb.lora_embedding_A": torch.ones(2, 5),
                   "base_model.model.emb.lora_embedding_B": torch.ones(3, 2),
                   "base_model.model.emb.lora_magnitude_vector": magnitude[:3].clone()})
    adapter = load_peft_adapter(path)
    assert adapter.use_dora and torch.equal(adapter.modules["fc"].magnitude, magnitude)
    assert torch.equal(adapter.modules["emb"].magnitude, magnitude[:3])  # (D,): one per embedding dimension


@pytest.mark.parametrize("key", ["base_model.model.fc.lora_A.weight", "base_model.model.fc.lora_B.weight",
                                 "base_model.model.score.weight"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weights_are_refused_naming_the_file_and_tensor(tmp_path, key, bad):
    """A NaN or infinite value in any weight the adapter serves (LoRA A or B, a saved module's
    copy) is refused at load: every token routed to the adapter would get it."""
    tensors = {**_FC, "base_model.model.score.weight": torch.ones(5, 3)}
    tensors[key] = tensors[key].clone()
    tensors[key][0, 1] = bad
    path = _write(tmp_path, {"modules_to_save": ["score"]}, tensors)
    with pytest.raises(AdapterFormatError) as err:
        load_peft_adapter(path)
    assert str(err.value) == (f"{path / 'adapter_model.safetensors'}: tensor {key!r} has 1 non-finite value(s) "
                              f"(NaN or inf) of {tensors[key].numel()}")


def test_non_finite_base_model_weights_saved_beside_the_adapter_are_ignored_not_refused(tmp_path):
    table = torch.ones(7, 3)
    table[0, 0] = float("nan")
    with pytest.warns(UserWarning, match="ignoring base-model weights"):
        adapter = load_peft_adapter(_write(tmp_path, None, {**_FC, "base_model.model.embed_tokens.weight": table}))
    assert set(adapter.modules) == {"fc"}
