"""MultiLoRA on tiny random transformers models against PEFT's own mixed-batch inference.

Llama, Qwen2 and GPT-2 (whose projections are transformers ``Conv1D``s), each
with three PEFT adapters (different r / lora_alpha, one rsLoRA, rank and alpha
patterns, the embedding and the LM head, list / regex / ``all-linear`` targets,
``layers_to_transform``, ``exclude_modules``), wrapped by ``MultiLoRA.from_adapters``
without a hand-written target list, and served in one batch with a base-model
row: greedy ``generate()`` with left padding gives PEFT's
``generate(..., adapter_names=...)`` tokens, on every backend; logits agree at
the fp32 tolerance, and at the bf16 one in bf16.
"""

import copy
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs transformers (tests/requirements.txt)")
peft = pytest.importorskip("peft", reason="needs peft (tests/requirements.txt)")

from lora_core import available_backends  # noqa: E402
from lora_core.testing import TOLERANCES  # noqa: E402
from lora_layers import MultiLoRA  # noqa: E402
from lora_layers.layers import Conv1DWithLoRA  # noqa: E402

# no end-of-sequence token: every row generates every token
SMALL = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
             pad_token_id=0, bos_token_id=1, eos_token_id=None)
# adapter names must not be substrings of module names: PEFT's save_pretrained filters tensors by name
ADAPTERS = {
    "llama": {
        "sql": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
        "chat": dict(r=16, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj", "embed_tokens", "lm_head"],
                     rank_pattern={"down_proj": 4}, alpha_pattern={"lm_head": 32}),
        "math": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=r".*\.(q|v)_proj"),
    },
    "qwen2": {
        "sql": dict(r=8, lora_alpha=16, target_modules="all-linear"),
        "chat": dict(r=16, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "lm_head"],
                     layers_to_transform=[1], layers_pattern="layers"),
        "math": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj", "o_proj", "embed_tokens"],
                     exclude_modules=r"model\.layers\.0\..*"),
    },
    "gpt2": {
        "sql": dict(r=8, lora_alpha=16, target_modules=["c_attn", "attn.c_proj"], fan_in_fan_out=True),
        "chat": dict(r=16, lora_alpha=8, target_modules=["c_fc", "mlp.c_proj", "wte"], fan_in_fan_out=True),
        "math": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["c_attn", "lm_head"], fan_in_fan_out=True,
                     layers_to_transform=[1]),
    },
}
ROUTE = ["sql", None, "chat", "math"]  # three adapters and a base-model row


def _base_model(kind, dtype=torch.float32):
    torch.manual_seed(0)
    if kind == "llama":
        config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, **SMALL)
        model = transformers.LlamaForCausalLM(config)
    elif kind == "qwen2":
        config = transformers.Qwen2Config(hidden_size=64, intermediate_size=128, **SMALL)
        model = transformers.Qwen2ForCausalLM(config)
    else:
        config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=64, vocab_size=128,
                                         pad_token_id=0, bos_token_id=1, eos_token_id=None)
        model = transformers.GPT2LMHeadModel(config)
    return model.to(dtype).eval()


@pytest.fixture(scope="module", params=sorted(ADAPTERS))
def served(request, tmp_path_factory):
    """(kind, base model, PEFT model with the three adapters, adapter name -> directory)."""
    kind = request.param
    base = _base_model(kind)
    names = list(ADAPTERS[kind])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(init_lora_weights=False, **ADAPTERS[kind][names[0]]),
                                    adapter_name=names[0])
        for name in names[1:]:
            model.add_adapter(name, peft.LoraConfig(init_lora_weights=False, **ADAPTERS[kind][name]))
        with torch.no_grad():  # random B at the scale of the base weights: the adapters steer, not swamp
            for param_name, param in model.named_parameters():
                if "lora_B" in param_name or "lora_embedding_B" in param_name:
                    param.mul_(0.05)
        model.eval()
        out = tmp_path_factory.mktemp(f"{kind}-adapters")
        model.save_pretrained(str(out), selected_adapters=names)
    return kind, base, model, {name: out / name for name in names}


def _inputs(padding="left"):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (len(ROUTE), 7), generator=g)
    mask = torch.ones_like(ids)
    for row, pad in [(1, 3), (3, 1)]:  # two prompts shorter than the others
        cols = slice(0, pad) if padding == "left" else slice(7 - pad, 7)
        mask[row, cols] = 0
        ids[row, cols] = 0
    return ids, mask


def _peft_names(route):
    return [name or "__base__" for name in route]


def _served_copy(base, paths, backend, device, **kw):
    model = copy.deepcopy(base).to(device)
    return model, MultiLoRA.from_adapters(model, paths, backend=backend, **kw)


def _eager_device(device):
    if device.is_graph:
        pytest.skip("generate() runs eager; captured and compiled forwards: tests/test_peft_equivalence.py")
    return device.torch_device


@pytest.mark.parametrize("backend", available_backends())
def test_greedy_generate_of_a_mixed_batch_gives_peft_tokens(device, backend, served):
    kind, base, peft_model, paths = served
    model, mlora = _served_copy(base, paths, backend, _eager_device(device))
    assert sorted(mlora.adapters) == ["chat", "math", "sql"] and mlora.slots.max_rank == 16
    if kind == "gpt2":
        assert isinstance(model.transformer.h[0].attn.c_attn, Conv1DWithLoRA)
    ids, mask = _inputs("left")
    kw = dict(max_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_logits=True)
    want = peft_model.generate(input_ids=ids, attention_mask=mask, adapter_names=_peft_names(ROUTE), **kw)
    with mlora.route(ROUTE):
        got = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device), **kw)
    assert torch.equal(got.sequences.cpu(), want.sequences)
    new_tokens = want.sequences[:, ids.shape[1]:].tolist()
    assert len(set(map(tuple, new_tokens))) == len(ROUTE), new_tokens  # each row generates its own tokens
    rtol, atol = TOLERANCES[torch.float32]
    for step_got, step_want in zip(got.logits, want.logits, strict=True):
        torch.testing.assert_close(step_got.cpu(), step_want, rtol=rtol, atol=atol)
    # every adapter changes its row: the base row is the only one that matches the base model's
    plain = base.generate(input_ids=ids, attention_mask=mask, **kw).logits[0]
    first = got.logits[0].cpu()
    torch.testing.assert_close(first[1], plain[1], rtol=rtol, atol=atol)
    assert all(not torch.allclose(first[i], plain[i], rtol=1e-3, atol=1e-3) for i in (0, 2, 3))


@pytest.mark.parametrize("backend", available_backends())
def test_forward_logits_with_right_padding_and_peft_adapter_names(backend, served):
    kind, base, peft_model, paths = served
    model, mlora = _served_copy(base, paths, backend, "cpu")
    ids, mask = _inputs("right")
    route = ["math", "chat", None, "sql"]
    with torch.no_grad():
        want = peft_model(input_ids=ids, attention_mask=mask, adapter_names=_peft_names(route)).logits
        got = model(input_ids=ids, attention_mask=mask, adapter_names=route).logits  # PEFT's keyword works too
    torch.testing.assert_close(got, want, rtol=TOLERANCES[torch.float32][0], atol=TOLERANCES[torch.float32][1])


def test_grad_mode_on_serves_the_no_grad_logits(served):
    kind, base, peft_model, paths = served
    model, mlora = _served_copy(base, paths, "torch_native", "cpu")
    ids, mask = _inputs()
    with mlora.route(ROUTE):
        with torch.no_grad():
            want = model(input_ids=ids, attention_mask=mask).logits
        got = model(input_ids=ids, attention_mask=mask).logits  # no torch.no_grad(): inference semantics
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_beam_search_routes_each_prompts_beams_to_its_adapter(served):
    kind, base, peft_model, paths = served
    if kind != "llama":
        pytest.skip("one model suffices")
    model, mlora = _served_copy(base, paths, "torch_native", "cpu")
    ids, mask = _inputs()
    kw = dict(max_new_tokens=4, do_sample=False, num_beams=2)
    want = peft_model.generate(input_ids=ids, attention_mask=mask, adapter_names=_peft_names(ROUTE), **kw)
    got = mlora.generate(input_ids=ids, attention_mask=mask, adapter_names=ROUTE, **kw)
    assert torch.equal(got, want)


@pytest.mark.parametrize("backend", available_backends())
def test_bf16_logits_are_within_the_bf16_tolerance(backend, served):
    """bf16 against PEFT's fp32 logits, at the bf16 tolerance with atol scaled by the logits'
    magnitude (GPT-2's reach 4); and no further from them than PEFT's own bf16 logits (x 1.5)."""
    kind, base, peft_model, paths = served
    model, mlora = _served_copy(base.to(torch.bfloat16), paths, backend, "cpu")
    base.float()
    assert mlora.context.dtype == torch.bfloat16
    ids, mask = _inputs()
    names = _peft_names(ROUTE)
    with torch.no_grad():
        want = peft_model(input_ids=ids, attention_mask=mask, adapter_names=names).logits  # fp32
        peft_bf16 = copy.deepcopy(peft_model).to(torch.bfloat16)
        theirs = peft_bf16(input_ids=ids, attention_mask=mask, adapter_names=names).logits.float()
        got = model(input_ids=ids, attention_mask=mask, adapter_names=ROUTE).logits
    assert got.dtype == torch.bfloat16
    rtol, atol = TOLERANCES[torch.bfloat16]
    torch.testing.assert_close(got.float(), want, rtol=rtol, atol=atol * max(1.0, want.abs().max().item()))
    assert (got.float() - want).abs().max() <= 1.5 * (theirs - want).abs().max()
