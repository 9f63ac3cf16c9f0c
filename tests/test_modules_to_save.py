"""Adapters with PEFT's ``modules_to_save`` (whole trained copies of ``lm_head``,
``embed_tokens``, a classifier ``score``) served in mixed batches, against PEFT.

A row on an adapter that saved a module runs through that adapter's copy; a base
row, or a row on an adapter that saved none, through the base module (PEFT's
``ModulesToSaveWrapper``). The oracle is PEFT itself: its mixed batch
(``adapter_names=``) where every adapter of the batch saved the module (PEFT 0.21
fails on an adapter without a copy in a mixed batch), else each row with its
adapter active alone (``set_adapter``). On every backend and device (graph
devices capture batch A and replay batch B); greedy ``generate()`` on tiny random
Llama and GPT-2 (whose ``lm_head`` is tied to ``wte``: PEFT's copy is untied);
a ``LlamaForSequenceClassification`` with its ``score`` saved; the pruned LM
head; ``torch.compile(fullgraph=True)`` without a recompile; and the refusals.
"""

import contextlib
import copy
import warnings

import pytest
import torch

peft = pytest.importorskip("peft", reason="needs peft (tests/requirements.txt)")
transformers = pytest.importorskip("transformers", reason="needs transformers (tests/requirements.txt)")

from lora_core import available_backends, load_peft_adapter  # noqa: E402
from lora_core.testing import TOLERANCES  # noqa: E402
from lora_layers import MultiLoRA, TinyConfig, TinyDecoder  # noqa: E402
from lora_layers.layers import SavedModule  # noqa: E402

CONFIG = TinyConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, seed=3)
# adapter names must not be substrings of module names: PEFT's save_pretrained filters tensors by name
ADAPTERS = {
    "saver": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head", "embed_tokens"]),
    "header": dict(r=8, lora_alpha=4, target_modules=["o_proj", "down_proj"], modules_to_save=["lm_head"]),
    "plain": dict(r=6, lora_alpha=12, target_modules=["q_proj", "k_proj", "up_proj"]),
}
BATCH_A = ([5, 5, 5, 5], ["plain", None, "header", "plain"])  # no saver: a replay of B must not run A's slots only
BATCH_B = ([2, 9, 1, 8], ["plain", "saver", None, "header"])  # same token count, new split and adapters
RTOL, ATOL = TOLERANCES[torch.float32]


def _peft_model(base, adapters, **extra):
    """PEFT model with ``adapters`` (name -> LoraConfig kwargs), random LoRA weights and
    saved copies moved off the base weights (so every saved module changes its rows)."""
    names = list(adapters)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(init_lora_weights=False, **extra,
                                                                          **adapters[names[0]]), adapter_name=names[0])
        for name in names[1:]:
            model.add_adapter(name, peft.LoraConfig(init_lora_weights=False, **extra, **adapters[name]))
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "lora_B" in param_name:
                param.mul_(0.1)
            elif ".modules_to_save." in param_name:
                param.add_(torch.randn(param.shape, generator=gen).to(param.dtype) * param.std() * 0.5)
    return model.eval()


def _save(model, out):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(str(out), selected_adapters=list(model.peft_config))
    return {name: out / name for name in model.peft_config}


@contextlib.contextmanager
def _active(peft_model, name):
    """PEFT with one adapter active (``None``: the base model)."""
    if name is None:
        with peft_model.disable_adapter():
            yield
    else:
        peft_model.set_adapter(name)
        yield


def _single_adapter_rows(peft_model, call, route):
    """Row ``i`` of ``call()`` with ``route[i]`` active alone: PEFT's single-adapter result per row."""
    outs = {}
    with torch.no_grad():
        for name in dict.fromkeys(route):
            with _active(peft_model, name):
                outs[name] = call()
    return outs


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    base = TinyDecoder(CONFIG)
    peft_model = _peft_model(base, ADAPTERS)
    return base, peft_model, _save(peft_model, tmp_path_factory.mktemp("adapters"))


def _tiny_peft_logits(peft_model, ids, seq_lens, adapters):
    """Request by request, each with its adapter active alone."""
    parts, start = [], 0
    with torch.no_grad():
        for n, name in zip(seq_lens, adapters):
            with _active(peft_model, name):
                parts.append(peft_model(ids[start : start + n]))
            start += n
    return torch.cat(parts)


@pytest.mark.parametrize("backend", available_backends())
def test_saved_lm_head_and_embedding_match_peft_on_every_device(device, backend, tiny):
    base, peft_model, paths = tiny
    model = copy.deepcopy(base).to(device.torch_device)
    mlora = MultiLoRA.from_adapters(model, paths, backend=backend, max_loras=4)
    assert isinstance(model.lm_head, SavedModule) and isinstance(model.model.embed_tokens, SavedModule)
    T = sum(BATCH_A[0])
    ids = torch.randint(0, CONFIG.vocab_size, (T,), generator=torch.Generator().manual_seed(1))
    if device.is_graph:
        mlora.enable_graph(T)
    mlora.set_batch(*BATCH_A)
    out_a, out_b = device.run_two_batches(model, [ids.to(device.torch_device)], lambda: mlora.set_batch(*BATCH_B))
    plain = base(ids).detach()
    for out, (seq_lens, adapters) in [(out_a, BATCH_A), (out_b, BATCH_B)]:
        expected = _tiny_peft_logits(peft_model, ids, seq_lens, adapters)
        torch.testing.assert_close(out.cpu(), expected, rtol=RTOL, atol=ATOL)
        start = 0
        for n, name in zip(seq_lens, adapters):  # every adapter changes its rows; the base row is the base model's
            same = torch.allclose(out[start : start + n].cpu(), plain[start : start + n], rtol=RTOL, atol=ATOL)
            assert same == (name is None), name
            start += n
    mlora.unwrap()
    assert isinstance(model.lm_head, torch.nn.Linear) and isinstance(model.model.embed_tokens, torch.nn.Embedding)


def test_peft_mixed_batch_of_a_saving_adapter_and_base_rows(tiny):
    # PEFT's own mixed forward (adapter_names=) needs a copy of every saved module for each adapter of the batch
    base, peft_model, paths = tiny
    model = copy.deepcopy(base)
    mlora = MultiLoRA.from_adapters(model, paths)
    ids = torch.randint(0, CONFIG.vocab_size, (4, 6), generator=torch.Generator().manual_seed(2))
    route = ["saver", None, None, "saver"]
    with torch.no_grad():
        want = peft_model(ids, adapter_names=[a or "__base__" for a in route])
        with mlora.route(route):
            got = model(ids)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    assert not torch.allclose(got[0], got[1], rtol=RTOL, atol=ATOL)
