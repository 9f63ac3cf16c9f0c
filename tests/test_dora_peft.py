"""DoRA adapters (PEFT's ``use_dora``) served in mixed batches, against PEFT row by row.

PEFT refuses ``adapter_names`` with DoRA ("Cannot pass `adapter_names` when DoRA is
enabled"), so the oracle is PEFT with one adapter active at a time (``set_adapter``,
or ``disable_adapter`` for a base row): each row of a mixed batch holding two DoRA
adapters, a plain LoRA adapter and base rows must equal PEFT's output for that row.
The DoRA magnitudes are perturbed after PEFT initialised them (at initialisation
``m = ||W + s B A||`` and the factor is exactly 1, which would hide a missing rescale).

* TinyDecoder, unfused and with fused ``qkv_proj`` / ``gate_up_proj`` (per-slice
  factors over the concatenated output), every backend and device parameter: graph
  devices capture batch A and replay batch B, ``cpu-compile`` compiles once;
* tiny random Llama and GPT-2 (``Conv1D`` with a bias, PEFT's ``fan_in_fan_out``),
  DoRA on the LM head too: logits per row at the fp32 tolerance (bf16 at the bf16
  one), greedy ``generate()`` under ``route([...])`` gives each row PEFT's tokens;
* DoRA on embeddings (PEFT's ``DoraEmbeddingLayer``) in the TinyDecoder and Llama adapters.
"""

import copy
import warnings

import pytest
import torch

peft = pytest.importorskip("peft", reason="needs peft (tests/requirements.txt)")
transformers = pytest.importorskip("transformers", reason="needs transformers (tests/requirements.txt)")

from lora_core import available_backends  # noqa: E402
from lora_core.testing import TOLERANCES  # noqa: E402
from lora_layers import MultiLoRA, TinyConfig, TinyDecoder  # noqa: E402
from lora_layers.layers import Conv1DWithLoRA  # noqa: E402

BACKENDS = available_backends()
TINY = TinyConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, seed=3)
PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
TINY_ADAPTERS = {  # two DoRA adapters (one on some slices of each packed projection only) and a plain one
    "sql": dict(r=4, lora_alpha=8, use_dora=True,
                target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]),
    "chat": dict(r=8, lora_alpha=4, target_modules=["q_proj", "v_proj", "down_proj", "embed_tokens"]),
    "math": dict(r=6, lora_alpha=12, use_rslora=True, use_dora=True,
                 target_modules=["k_proj", "up_proj", "o_proj", "embed_tokens"],
                 rank_pattern={"o_proj": 2}),
}
BATCH_A = ([5, 5, 5, 5, 5], ["sql", None, "chat", "math", "sql"])
BATCH_B = ([2, 9, 1, 8, 5], ["math", "sql", None, "chat", "math"])

SMALL = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
             pad_token_id=0, bos_token_id=1, eos_token_id=None)
HF_ADAPTERS = {
    "llama": {
        "sql": dict(r=8, lora_alpha=16, use_dora=True,
                    target_modules=["q_proj", "v_proj", "o_proj", "down_proj", "embed_tokens", "lm_head"]),
        "chat": dict(r=4, lora_alpha=8, target_modules=["q_proj", "gate_proj", "up_proj", "embed_tokens"]),
        "math": dict(r=4, lora_alpha=8, use_rslora=True, use_dora=True, target_modules=["k_proj", "up_proj"]),
    },
    "gpt2": {
        "sql": dict(r=8, lora_alpha=16, use_dora=True, target_modules=["c_attn", "attn.c_proj", "c_fc"],
                    fan_in_fan_out=True),
        "chat": dict(r=4, lora_alpha=8, target_modules=["c_attn", "mlp.c_proj"], fan_in_fan_out=True),
        "math": dict(r=4, lora_alpha=8, use_rslora=True, use_dora=True, target_modules=["mlp.c_proj", "lm_head"],
                     fan_in_fan_out=True),
    },
}
ROUTE = ["sql", None, "chat", "math"]


def _peft_model(base, adapters, out_dir):
    """A PEFT model with ``adapters`` (B scaled down, DoRA magnitudes perturbed), saved to ``out_dir``."""
    names = list(adapters)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(init_lora_weights=False, **adapters[names[0]]),
                                    adapter_name=names[0])
        for name in names[1:]:
            model.add_adapter(name, peft.LoraConfig(init_lora_weights=False, **adapters[name]))
        gen = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if "lora_B" in param_name or "lora_embedding_B" in param_name:
                    param.mul_(0.05)
                elif "lora_magnitude_vector" in param_name:
                    param.mul_(torch.rand(param.shape, generator=gen) * 0.6 + 0.7)
        model.eval()
        model.save_pretrained(str(out_dir), selected_adapters=names)
    return model


def _peft_rows(model, rows, names, **kw):
    """PEFT's output of each request with only its adapter active: ``rows`` is a list of inputs."""
    outs = []
    with torch.no_grad():
        for row, name in zip(rows, names):
            if name is None:
                with model.disable_adapter():
                    outs.append(model(row, **kw))
            else:
                model.set_adapter(name)
                outs.append(model(row, **kw))
    return outs


# ------------------------------------------------------------------ TinyDecoder: every backend and device
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.manual_seed(0)
    base = TinyDecoder(TINY).eval()
    out = tmp_path_factory.mktemp("dora-tiny")
    return base, _peft_model(base, TINY_ADAPTERS, out), out


def _tiny_check(device, backend, tiny, fused):
    base, peft_model, adapter_dir = tiny
    model = copy.deepcopy(base)
    if fused:
        model = TinyDecoder(TinyConfig(**{**TINY.to_dict(), "fused": True})).fuse_from(model)
    model = model.to(device.torch_device)
    targets = ["o_proj", "down_proj", "embed_tokens", "lm_head"]
    targets += list(PACKED) if fused else ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"]
    mlora = MultiLoRA(model, targets, max_loras=4, max_rank=8, backend=backend, dora=True,
                      packed_modules=PACKED if fused else None)
    for name in TINY_ADAPTERS:
        mlora.load_adapter(name, adapter_dir / name)
    factors = mlora.wrapped["model.layers.0.self_attn.o_proj"].dora_factors.cpu()  # rows: sql, chat, math, (free)
    assert (factors[[1, 3]] == 1).all() and (factors[[0, 2]] - 1).abs().min() > 1e-4  # the rescale is visible
    T = sum(BATCH_A[0])
    ids = torch.randint(0, TINY.vocab_size, (T,), generator=torch.Generator().manual_seed(1))
    if device.is_graph:
        mlora.enable_graph(T)
    mlora.set_batch(*BATCH_A)
    out_a, out_b = device.run_two_batches(model, [ids.to(device.torch_device)], lambda: mlora.set_batch(*BATCH_B))
    rtol, atol = TOLERANCES[torch.float32]
    for out, (seq_lens, names) in [(out_a, BATCH_A), (out_b, BATCH_B)]:
        rows = list(torch.split(ids, seq_lens))
        want = torch.cat([o[0] for o in _peft_rows(peft_model, [r[None] for r in rows], names)])
        torch.testing.assert_close(out.cpu(), want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("backend", BACKENDS)
def test_tiny_decoder_dora_rows_equal_peft_single_adapter_rows(device, backend, tiny):
    _tiny_check(device, backend, tiny, fused=False)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_qkv_and_gate_up_take_per_slice_dora_factors(device, backend, tiny):
    _tiny_check(device, backend, tiny, fused=True)


# ------------------------------------------------------------------ transformers Llama and GPT-2
def _hf_base(kind, dtype=torch.float32):
    torch.manual_seed(0)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(hidden_size=64, intermediate_size=128, **SMALL))
    else:
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_embd=64, n_layer=2, n_head=4, n_positions=64, vocab_size=128, pad_token_id=0, bos_token_id=1,
            eos_token_id=None))
    return model.to(dtype).eval()


@pytest.fixture(scope="module", params=sorted(HF_ADAPTERS))
def served(request, tmp_path_factory):
    kind = request.param
    base = _hf_base(kind)
    out = tmp_path_factory.mktemp(f"dora-{kind}")
    model = _peft_model(base, HF_ADAPTERS[kind], out)
    return kind, base, model, {name: out / name for name in HF_ADAPTERS[kind]}


def _inputs():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (len(ROUTE), 7), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left-padded prompts
    mask[3, :1] = 0
    ids[mask == 0] = 0
    return ids, mask


def _peft_batch_rows(peft_model, ids, mask, fn):
    """Row i of ``fn(peft_model)`` with only ``ROUTE[i]`` active, for every i (the whole batch each time)."""
    rows = []
    for i, name in enumerate(ROUTE):
        with torch.no_grad():
            if name is None:
                with peft_model.disable_adapter():
                    rows.append(fn(peft_model)[i])
            else:
                peft_model.set_adapter(name)
                rows.append(fn(peft_model)[i])
    return torch.stack(rows)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_batch_logits_equal_peft_per_row(backend, served):
    kind, base, peft_model, paths = served
    model = copy.deepcopy(base)
    mlora = MultiLoRA.from_adapters(model, paths, backend=backend)  # use_dora in a config: dora=True
    assert mlora.context.dora
    if kind == "gpt2":
        assert isinstance(model.transformer.h[0].attn.c_attn, Conv1DWithLoRA)
    ids, mask = _inputs()
    want = _peft_batch_rows(peft_model, ids, mask, lambda m: m(input_ids=ids, attention_mask=mask).logits)
    with torch.no_grad(), mlora.route(ROUTE):
        got = model(input_ids=ids, attention_mask=mask).logits
    rtol, atol = TOLERANCES[torch.float32]
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    with torch.no_grad():
        plain = base(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got[1], plain[1], rtol=rtol, atol=atol)  # the base row
    assert all(not torch.allclose(got[i], plain[i], rtol=1e-3, atol=1e-3) for i in (0, 2, 3))


@pytest.mark.parametrize("backend", BACKENDS)
def test_request_scales_give_each_row_pefts_scaled_dora(backend, served):
    """A DoRA adapter at a request scale is PEFT's scaled DoRA adapter (``rescale_adapter_scale``):
    the scale multiplies the delta and the scaling inside the weight norm, so scale 0 rescales the
    base output by ``m / ||W||`` (it is not the base model's output, as it is without DoRA)."""
    from peft.helpers import rescale_adapter_scale

    kind, base, peft_model, paths = served
    model = copy.deepcopy(base)
    mlora = MultiLoRA.from_adapters(model, paths, backend=backend)
    ids, mask = _inputs()
    scales = [0.3, 1.0, 1.7, 0.0]
    with torch.no_grad(), mlora.route(ROUTE, scales):
        got = model(input_ids=ids, attention_mask=mask).logits
    for i, (name, scale) in enumerate(zip(ROUTE, scales)):
        if name is None:
            continue
        peft_model.set_adapter(name)
        with torch.no_grad(), rescale_adapter_scale(peft_model, scale):
            want = peft_model(input_ids=ids, attention_mask=mask).logits[i]
        assert ((got[i] - want).abs().max() / want.abs().max()).item() <= 1e-5, (kind, name, scale)
    with torch.no_grad():
        plain = base(input_ids=ids, attention_mask=mask).logits
    assert not torch.allclose(got[3], plain[3], rtol=1e-3, atol=1e-3)  # DoRA at scale 0: m / ||W||


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_generate_gives_each_row_peft_single_adapter_tokens(backend, served):
    kind, base, peft_model, paths = served
    model = copy.deepcopy(base)
    mlora = MultiLoRA.from_adapters(model, paths, backend=backend)
    ids, mask = _inputs()
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    want = _peft_batch_rows(peft_model, ids, mask, lambda m: m.generate(**kw))
    with mlora.route(ROUTE):
        got = model.generate(**kw)
    assert torch.equal(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_mixed_batch_is_within_the_bf16_tolerance(backend, served):
    kind, base, peft_model, paths = served
    model = copy.deepcopy(base).to(torch.bfloat16)
    mlora = MultiLoRA.from_adapters(model, paths, backend=backend)
    assert mlora.context.dtype == torch.bfloat16
    ids, mask = _inputs()
    want = _peft_batch_rows(peft_model, ids, mask, lambda m: m(input_ids=ids, attention_mask=mask).logits)
    with torch.no_grad(), mlora.route(ROUTE):
        got = model(input_ids=ids, attention_mask=mask).logits
    rtol, atol = TOLERANCES[torch.bfloat16]
    torch.testing.assert_close(got.float(), want, rtol=rtol, atol=atol * max(1.0, want.abs().max().item()))


def test_graph_mode_replays_the_eager_dora_logits(served):
    """enable_graph: capture with batch A under the CPU graph simulator, refill B, replay: equal to eager."""
    from lora_core.testing import make_device

    kind, base, peft_model, paths = served
    ids, mask = _inputs()
    flat = ids.reshape(1, -1)  # the graph-mode batch: all rows as one (1, T) call, split by set_batch
    batch_a = ([7] * 4, ROUTE)
    batch_b = ([7] * 4, ["math", "sql", None, "chat"])
    eager_model = copy.deepcopy(base)
    eager = MultiLoRA.from_adapters(eager_model, paths)
    want = []
    for seq_lens, names in (batch_a, batch_b):
        eager.set_batch(seq_lens, names)
        with torch.no_grad():
            want.append(eager_model(input_ids=flat, use_cache=False).logits)
    model = copy.deepcopy(base)
    mlora = MultiLoRA.from_adapters(model, paths)
    mlora.enable_graph(flat.numel())
    mlora.set_batch(*batch_a)

    def step(ids):
        return model(input_ids=ids, use_cache=False).logits  # no KV cache: a pure function of ids

    out_a, out_b = make_device("cpu-graphsim").run_two_batches(step, [flat], lambda: mlora.set_batch(*batch_b))
    rtol, atol = TOLERANCES[torch.float32]
    torch.testing.assert_close(out_a, want[0], rtol=rtol, atol=atol)
    torch.testing.assert_close(out_b, want[1], rtol=rtol, atol=atol)


def test_the_refusal_table_of_docs_transformers_md_is_the_loaders(tmp_path):
    """Every field the docs' "What is refused" table names is refused by the loader, naming it, and
    DoRA (served) is not in the table."""
    import json
    import re
    from pathlib import Path

    from lora_core import AdapterFormatError, load_peft_adapter
    from safetensors.torch import save_file

    doc = (Path(__file__).parent.parent / "docs" / "transformers.md").read_text()
    table = doc.split("## What is refused", 1)[1].split("\n\n", 2)[2].split("\n\n", 1)[0]
    fields = [re.findall(r"`([a-z_]+)`", line.split("|")[1]) for line in table.splitlines()[2:]]
    assert fields and not any("use_dora" in f for f in fields)
    values = {"peft_type": "IA3", "bias": "all", "layer_replication": [[0, 1]]}
    save_file({"base_model.model.fc.lora_A.weight": torch.ones(2, 3),
               "base_model.model.fc.lora_B.weight": torch.ones(4, 2)}, str(tmp_path / "adapter_model.safetensors"))
    for field in (f for row in fields for f in row if f not in ("LORA", "none")):
        config = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, field: values.get(field, ["x"])}
        (tmp_path / "adapter_config.json").write_text(json.dumps(config))
        with pytest.raises(AdapterFormatError, match=field):
            load_peft_adapter(tmp_path)


def test_lora_sim_refuses_a_dora_adapter_by_name(tiny, capsys):
    from lora_layers.sim import cli

    _, _, adapter_dir = tiny
    assert cli.main([f"--adapter=sql={adapter_dir / 'sql'}", "--device", "cpu"]) == 2
    assert "is a DoRA adapter (use_dora); lora-sim serves plain LoRA adapters only" in capsys.readouterr().err


def test_a_captured_step_serves_a_dora_adapter_replaced_after_the_capture(tiny):
    """The factors live in fixed buffers rewritten in place at load: a graph captured with one
    DoRA adapter in slot 0 replays another loaded into that slot (and a new batch) correctly."""
    from lora_core.testing import make_device

    base, peft_model, adapter_dir = tiny
    model = copy.deepcopy(base)
    mlora = MultiLoRA(model, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                              "embed_tokens", "lm_head"], max_loras=2, max_rank=8, dora=True)
    mlora.load_adapter("a", adapter_dir / "sql")
    mlora.load_adapter("b", adapter_dir / "chat")
    T = sum(BATCH_A[0])
    ids = torch.randint(0, TINY.vocab_size, (T,), generator=torch.Generator().manual_seed(6))
    mlora.enable_graph(T)
    mlora.set_batch([10, 5, 10], ["a", None, "b"])

    def replace():
        mlora.load_adapter("a", adapter_dir / "math", replace=True)  # slot 0: other DoRA factors
        mlora.set_batch([5, 10, 10], ["b", "a", None])

    out_a, out_b = make_device("cpu-graphsim").run_two_batches(model, [ids], replace)
    rtol, atol = TOLERANCES[torch.float32]
    for out, (seq_lens, names) in [(out_a, ([10, 5, 10], ["sql", None, "chat"])),
                                   (out_b, ([5, 10, 10], ["chat", "math", None]))]:
        want = torch.cat([o[0] for o in _peft_rows(peft_model, [r[None] for r in torch.split(ids, seq_lens)], names)])
        torch.testing.assert_close(out, want, rtol=rtol, atol=atol)
