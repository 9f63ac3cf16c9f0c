"""MultiLoRA against PEFT's own mixed-batch forward, on every backend and device.

Three adapters with different r / lora_alpha (one rsLoRA, one with rank and
alpha patterns) target every projection plus the embedding and the LM head.
Graph devices capture with batch A and replay batch B.
"""

import warnings

import pytest
import torch

peft = pytest.importorskip("peft", reason="the PEFT equivalence suite needs peft (tests/requirements.txt)")

from lora_core import available_backends  # noqa: E402
from lora_core.testing import TOLERANCES  # noqa: E402
from lora_layers import MultiLoRA, TinyConfig, TinyDecoder  # noqa: E402

CONFIG = TinyConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, seed=3)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens", "lm_head"]
ADAPTERS = {
    "alpha": dict(r=4, lora_alpha=8),
    "beta": dict(r=8, lora_alpha=4, use_rslora=True),
    "gamma": dict(r=6, lora_alpha=12, rank_pattern={"down_proj": 2}, alpha_pattern={"lm_head": 3}),
}
PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
BATCH_A = ([5, 5, 5, 5], ["alpha", None, "gamma", "beta"])  # equal lengths: PEFT's batched mixed forward
BATCH_B = ([2, 9, 1, 8], ["beta", "alpha", None, "gamma"])  # same token count, new split and adapters


@pytest.fixture(scope="module")
def peft_model_and_dir(tmp_path_factory):
    torch.manual_seed(0)
    base = TinyDecoder(CONFIG)
    names = list(ADAPTERS)
    model = peft.get_peft_model(base, peft.LoraConfig(target_modules=TARGETS, init_lora_weights=False,
                                                      **ADAPTERS[names[0]]), adapter_name=names[0])
    for name in names[1:]:
        model.add_adapter(name, peft.LoraConfig(target_modules=TARGETS, init_lora_weights=False, **ADAPTERS[name]))
    model.eval()
    out = tmp_path_factory.mktemp("adapters")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "not a transformers model" notices
        model.save_pretrained(str(out), selected_adapters=names)
    return model, out


def _peft_logits(model, ids, seq_lens, adapters):
    """PEFT's forward: one batched mixed call for equal lengths, else request by request."""
    names = [a or "__base__" for a in adapters]
    with torch.no_grad():
        if len(set(seq_lens)) == 1:
            return model(ids.view(len(seq_lens), seq_lens[0]), adapter_names=names).reshape(-1, CONFIG.vocab_size)
        parts, start = [], 0
        for n, name in zip(seq_lens, names):
            parts.append(model(ids[start : start + n][None], adapter_names=[name])[0])
            start += n
        return torch.cat(parts)


def _check(device, backend, peft_model, adapter_dir, fused):
    model = TinyDecoder(CONFIG)
    if fused:
        model = TinyDecoder(TinyConfig(**{**CONFIG.to_dict(), "fused": True})).fuse_from(model)
    model = model.to(device.torch_device)
    targets = [t for t in TARGETS if not (fused and any(t in parts for parts in PACKED.values()))]
    targets += list(PACKED) if fused else []
    mlora = MultiLoRA(model, targets, max_loras=4, max_rank=8, backend=backend,
                      packed_modules=PACKED if fused else None)
    for name in ADAPTERS:
        mlora.load_adapter(name, adapter_dir / name)
    T = sum(BATCH_A[0])
    ids = torch.randint(0, CONFIG.vocab_size, (T,), generator=torch.Generator().manual_seed(1))
    if device.is_graph:
        mlora.enable_graph(T)
    mlora.set_batch(*BATCH_A)
    out_a, out_b = device.run_two_batches(model, [ids.to(device.torch_device)], lambda: mlora.set_batch(*BATCH_B))
    rtol, atol = TOLERANCES[torch.float32]
    for out, batch in [(out_a, BATCH_A), (out_b, BATCH_B)]:
        expected = _peft_logits(peft_model, ids, *batch)
        torch.testing.assert_close(out.cpu(), expected, rtol=rtol, atol=atol)
    mlora.unwrap()
    assert not any("WithLoRA" in type(m).__name__ for m in model.modules())


@pytest.mark.parametrize("backend", available_backends())
def test_multilora_matches_peft_mixed_batch(device, backend, peft_model_and_dir):
    _check(device, backend, *peft_model_and_dir, fused=False)


@pytest.mark.parametrize("backend", available_backends())
def test_fused_qkv_and_gate_up_load_the_same_adapters(device, backend, peft_model_and_dir):
    _check(device, backend, *peft_model_and_dir, fused=True)
