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

from lora_core import available_backends, build_batch_info, get_backend, load_peft_adapter  # noqa: E402
from lora_core.adapters import SavedModuleWeights  # noqa: E402
from lora_core.reference import reference_saved_linear  # noqa: E402
from lora_core.testing import TOLERANCES  # noqa: E402
from lora_layers import MultiLoRA, TinyConfig, TinyDecoder  # noqa: E402
from lora_layers.layers import WHOLE_MODULE, LoRAContext, SavedModule  # noqa: E402

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
    """``call()`` with each adapter of ``route`` active alone, by name (``None``: the base model):
    row ``i`` of ``outs[route[i]]`` is PEFT's single-adapter result for row ``i``."""
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
    for saved in (model.lm_head, model.model.embed_tokens):  # slots without a copy are never read: fill them
        saved.weight[~saved.held] = 1e4
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


SMALL = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
             pad_token_id=0, bos_token_id=1, eos_token_id=None)  # no end-of-sequence token: every row generates
HF_ADAPTERS = {
    "llama": {
        "saver": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                      modules_to_save=["lm_head", "embed_tokens"]),
        "header": dict(r=8, lora_alpha=16, target_modules=["o_proj"], modules_to_save=["lm_head"]),
        "plain": dict(r=8, lora_alpha=16, target_modules=["k_proj", "down_proj"]),
    },
    "gpt2": {  # lm_head is tied to wte; PEFT's saved copy of either is untied from the other
        "saver": dict(r=4, lora_alpha=8, target_modules=["c_attn"], modules_to_save=["lm_head"], fan_in_fan_out=True),
        "header": dict(r=8, lora_alpha=16, target_modules=["c_fc"], modules_to_save=["wte"], fan_in_fan_out=True),
        "plain": dict(r=8, lora_alpha=16, target_modules=["c_attn", "mlp.c_proj"], fan_in_fan_out=True),
    },
}
ROUTE = ["saver", None, "header", "plain"]


def _hf_base(kind):
    torch.manual_seed(0)
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(hidden_size=64, intermediate_size=128,
                                                                      **SMALL)).eval()
    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=64, vocab_size=128,
                                     pad_token_id=0, bos_token_id=1, eos_token_id=None)
    return transformers.GPT2LMHeadModel(config).eval()


def _prompts():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (len(ROUTE), 7), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = ids[1, :3] = 0  # left padding
    mask[3, :1] = ids[3, :1] = 0
    return ids, mask


@pytest.mark.parametrize("kind", sorted(HF_ADAPTERS))
def test_greedy_generate_gives_each_row_peft_single_adapter_tokens(kind, tmp_path):
    base = _hf_base(kind)
    peft_model = _peft_model(base, HF_ADAPTERS[kind])
    paths = _save(peft_model, tmp_path)
    model = copy.deepcopy(base)
    mlora = MultiLoRA.from_adapters(model, paths)
    saved = sorted(n for n, m in mlora.wrapped.items() if isinstance(m, SavedModule))
    assert saved == (["lm_head", "model.embed_tokens"] if kind == "llama" else ["lm_head", "transformer.wte"])
    ids, mask = _prompts()
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, return_dict_in_generate=True,
              output_logits=True)
    want = _single_adapter_rows(peft_model, lambda: peft_model.generate(input_ids=ids, **kw), ROUTE)
    with mlora.route(ROUTE):
        got = model.generate(input_ids=ids, **kw)
    for i, name in enumerate(ROUTE):
        assert torch.equal(got.sequences[i], want[name].sequences[i]), name
        for step_got, step_want in zip(got.logits, want[name].logits, strict=True):
            torch.testing.assert_close(step_got[i], step_want[i], rtol=RTOL, atol=ATOL)
    new = got.sequences[:, ids.shape[1]:].tolist()
    assert len(set(map(tuple, new))) == len(ROUTE), new  # each row generates its own tokens


def test_sequence_classification_with_a_saved_score_matches_peft_mixed_batch(tmp_path):
    torch.manual_seed(0)
    base = transformers.LlamaForSequenceClassification(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_labels=3, **SMALL)).eval()
    adapters = {"sentiment": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
                "topic": dict(r=8, lora_alpha=8, target_modules=["o_proj"])}
    peft_model = _peft_model(base, adapters, task_type="SEQ_CLS")  # SEQ_CLS saves "classifier" and "score"
    paths = _save(peft_model, tmp_path)
    assert set(load_peft_adapter(paths["topic"]).saved_modules) == {"score"}
    model = copy.deepcopy(base)
    mlora = MultiLoRA.from_adapters(model, paths)
    assert isinstance(model.score, SavedModule)
    ids, mask = _prompts()
    route = ["topic", None, "sentiment", "topic"]
    with torch.no_grad():
        want = peft_model(input_ids=ids, attention_mask=mask, adapter_names=[a or "__base__" for a in route]).logits
        with mlora.route(route):
            got = model(input_ids=ids, attention_mask=mask).logits
        plain = base(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    assert [torch.allclose(got[i], plain[i], rtol=RTOL, atol=ATOL) for i in range(4)] == [False, True, False, False]


def test_a_pruned_lm_head_runs_each_requests_last_row_through_its_copy(tiny):
    base, peft_model, paths = tiny
    model = copy.deepcopy(base)
    mlora = MultiLoRA.from_adapters(model, paths)
    seq_lens, adapters = [3, 0, 2, 4, 1], ["header", "saver", None, "plain", "saver"]
    mlora.set_batch(seq_lens, adapters)
    hidden = torch.randn(4, CONFIG.hidden_size, generator=torch.Generator().manual_seed(3))  # 4 non-empty requests
    with torch.no_grad():
        got = model.lm_head(hidden)
    head = peft_model.base_model.model.lm_head
    rows = [a for n, a in zip(seq_lens, adapters) if n]
    want = torch.stack([(head.modules_to_save[a] if a in head.modules_to_save else head.original_module)(h)
                        for h, a in zip(hidden, rows)]).detach()
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    with pytest.raises(ValueError) as err:
        model.lm_head(torch.randn(5, CONFIG.hidden_size))
    assert str(err.value) == ("a saved module (modules_to_save) got 5 rows; expected one row per token (10 tokens) "
                              "or, for the LM head, one per non-empty request (4 requests)")
    mlora.enable_graph(16)  # rows: the graph's capacity
    mlora.set_batch(seq_lens, adapters)
    with pytest.raises(ValueError) as err:
        model.lm_head(torch.randn(10, CONFIG.hidden_size))
    assert str(err.value) == ("a saved module (modules_to_save) got 10 rows; expected the graph batch's capacity "
                              "(16 rows, 10 of them tokens now)")


@pytest.mark.parametrize("backend", available_backends())
def test_compiled_graph_mode_serves_new_batches_and_adapters_without_a_recompile(backend, tiny):
    base, peft_model, paths = tiny
    model = copy.deepcopy(base)
    mlora = MultiLoRA(model, ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"], max_loras=3,
                      max_rank=8, backend=backend, modules_to_save=["lm_head", "embed_tokens"])
    mlora.load_adapter("plain", paths["plain"])
    T = 12
    mlora.enable_graph(T)
    compiles = []

    def counting(gm, example_inputs):
        compiles.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    compiled = torch.compile(model, backend=counting, fullgraph=True)
    ids = torch.randint(0, CONFIG.vocab_size, (T,), generator=torch.Generator().manual_seed(4))
    torch._dynamo.reset()
    with torch.no_grad():
        mlora.set_batch([6, 6], ["plain", None])
        compiled(ids)
        for name in ("saver", "header"):  # new adapters, loaded into the preallocated copies
            mlora.load_adapter(name, paths[name])
        for seq_lens, adapters in [([3, 5, 1, 3], ["plain", "saver", None, "header"]), ([1, 11], ["saver", "header"])]:
            mlora.set_batch(seq_lens, adapters)
            with torch._dynamo.config.patch(error_on_recompile=True):
                got = compiled(ids).clone()
            want = _tiny_peft_logits(peft_model, ids, seq_lens, adapters)
            torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    assert len(compiles) == 1


def test_unload_runs_the_slots_rows_through_the_base_module_again(tiny):
    base, peft_model, paths = tiny
    model = copy.deepcopy(base)
    mlora = MultiLoRA.from_adapters(model, paths)
    slot = mlora.adapters["saver"]
    mlora.unload_adapter("saver")
    assert not model.lm_head.held[slot] and not model.lm_head.weight[slot].any()
    mlora.load_adapter("saver", paths["plain"])  # another adapter in the freed slot, with no saved modules
    ids = torch.randint(0, CONFIG.vocab_size, (4,), generator=torch.Generator().manual_seed(5))
    mlora.set_batch([4], ["saver"])
    with torch.no_grad():
        got = model(ids)
    torch.testing.assert_close(got, _tiny_peft_logits(peft_model, ids, [4], ["plain"]), rtol=RTOL, atol=ATOL)


def test_a_module_is_lora_targeted_or_saved_never_both(tmp_path, tiny):
    base, peft_model, paths = tiny
    lora_head = _save(_peft_model(base, {"lorahead": dict(r=4, lora_alpha=8, target_modules=["lm_head"])}),
                      tmp_path / "lorahead")["lorahead"]
    with pytest.raises(ValueError, match=r"adapter 'lorahead' has LoRA weights for 'lm_head', which is served as a "
                                         r"saved module \(modules_to_save\)"):
        MultiLoRA.from_adapters(copy.deepcopy(base), {"saver": paths["saver"], "lorahead": lora_head})
    mlora = MultiLoRA.from_adapters(copy.deepcopy(base), {"lorahead": lora_head}, max_loras=2)
    with pytest.raises(ValueError, match=r"adapter 'saver' saves 'lm_head' whole \(modules_to_save\), which is "
                                         r"LoRA-targeted"):
        mlora.load_adapter("saver", paths["saver"])
    assert list(mlora.adapters) == ["lorahead"]
    mlora = MultiLoRA(copy.deepcopy(base), ["q_proj", "v_proj"], max_rank=8)
    with pytest.raises(ValueError, match=r"adapter 'saver' saves 'lm_head' whole \(modules_to_save\), which is "
                                         r"not wrapped"):
        mlora.load_adapter("saver", paths["saver"])
    assert not mlora.adapters


def test_a_saved_copy_of_another_shape_is_refused_naming_module_and_shapes(tmp_path, tiny):
    base, _, paths = tiny
    bigger = TinyDecoder(TinyConfig(**{**CONFIG.to_dict(), "vocab_size": 100}))
    wide = _save(_peft_model(bigger, {"wide": ADAPTERS["header"]}), tmp_path / "wide")["wide"]
    mlora = MultiLoRA(copy.deepcopy(base), ["o_proj", "down_proj"], max_rank=8, modules_to_save=["lm_head"])
    with pytest.raises(ValueError, match=r"adapter 'wide' does not fit module 'lm_head': the saved weight has shape "
                                         r"\(100, 32\), the module's weight \(96, 32\)"):
        mlora.load_adapter("wide", wide)
    assert not mlora.adapters and not mlora.wrapped["lm_head"].held.any()


def test_graph_mode_refuses_an_adapter_saving_a_module_not_wrapped_before(tiny):
    base, _, paths = tiny
    mlora = MultiLoRA.from_adapters(copy.deepcopy(base), {"plain": paths["plain"]}, max_loras=2)
    mlora.enable_graph(8)
    with pytest.raises(ValueError, match="in graph mode the wrapped modules are fixed"):
        mlora.load_adapter("saver", paths["saver"])


def test_lora_sim_serves_a_saving_adapter_and_reports_the_memory_per_slot(tmp_path, capsys):
    from lora_layers import sim
    from lora_layers.sim.workload import DEFAULT_CONFIG

    base = TinyDecoder(TinyConfig(**{**DEFAULT_CONFIG.to_dict(), "fused": False}))  # PEFT's names; served fused
    paths = _save(_peft_model(base, {"saver": ADAPTERS["saver"], "plain": ADAPTERS["plain"]}), tmp_path)
    argv = [f"--adapter=saver={paths['saver']}", f"--adapter=plain={paths['plain']}", "--device", "cpu",
            "--backend", "torch_native", "--rounds", "3", "--decode-steps", "1"]
    assert sim.main(argv) == 0
    out = capsys.readouterr().out
    copies = 2 * DEFAULT_CONFIG.vocab_size * DEFAULT_CONFIG.hidden_size * 4 / 2**20  # lm_head and embed_tokens, fp32
    memory = [line for line in out.splitlines() if line.startswith("memory per adapter slot:")]
    assert len(memory) == 1 and f"saved modules (modules_to_save) {copies:,.2f} MiB" in memory[0]
    assert "| torch_native | cpu | pass |" in out


def test_only_linear_and_embedding_modules_are_served_as_saved_modules(tiny):
    base, _, _ = tiny
    with pytest.raises(TypeError, match=r"cannot serve 'model.norm' as a saved module \(modules_to_save\): only "
                                        r"nn.Linear and nn.Embedding modules are, got a LayerNorm"):
        MultiLoRA(copy.deepcopy(base), ["q_proj"], modules_to_save=["model.norm"])


@pytest.mark.parametrize("backend", available_backends())
def test_a_saved_linear_with_bias_against_the_reference(device, backend):
    # random sizes, rows of slot -1, a slot without a copy (holding garbage), batch B other than A
    gen = torch.Generator().manual_seed(11)
    d_in, d_out = (int(v) for v in torch.randint(3, 40, (2,), generator=gen))
    slots = 4
    dev = device.torch_device
    context = LoRAContext(get_backend(backend)(dev), num_slots=slots, max_rank=4, dtype=torch.float32, device=dev)
    layer = SavedModule(torch.nn.Linear(d_in, d_out).to(dev), context)
    for slot in (0, 2):
        layer.load_slot(slot, {WHOLE_MODULE: SavedModuleWeights("head", torch.randn(d_out, d_in, generator=gen),
                                                                torch.randn(d_out, generator=gen))}, 1.0)
    layer.weight[1], layer.bias[1] = 1e4, 1e4  # slot 1 holds no copy: never read
    batch_a, batch_b = ([3, 2, 4], [0, 1, None]), ([1, 5, 3], [2, None, 0])
    T = sum(batch_a[0])
    ranks, scalings = [4] * slots, [1.0] * slots
    backend_obj = context.backend

    def describe(seq_lens, slot_ids):
        if device.is_graph:
            backend_obj.batch_info.refill(seq_lens, slot_ids)
        else:
            backend_obj.prepare_batch(build_batch_info(seq_lens, slot_ids, ranks, scalings, device=dev))

    if device.is_graph:
        backend_obj.prepare_batch(backend_obj.init_graph_batch_info(T, ranks, scalings))
    describe(*batch_a)
    x = torch.randn(T, d_in, generator=gen)
    out_a, out_b = device.run_two_batches(layer, [x.to(dev)], lambda: describe(*batch_b))
    base_out = torch.nn.functional.linear(x, layer.base_layer.weight.cpu(), layer.base_layer.bias.cpu())
    for out, batch in ((out_a, batch_a), (out_b, batch_b)):
        info = build_batch_info(*batch, ranks, scalings, device="cpu")
        want = reference_saved_linear(x, info, layer.held, layer.weight, layer.bias, base_out)
        torch.testing.assert_close(out.cpu(), want, rtol=RTOL, atol=ATOL)


def test_compiled_eager_batches_of_other_slots_reuse_the_compiled_code(tiny):
    """Regression: with an eager batch, a saved linear module chose its copies from the batch's slots on
    the host, which the compiled code then guarded on: a batch of other slots recompiled."""
    base, peft_model, paths = tiny
    model = copy.deepcopy(base)
    mlora = MultiLoRA(model, ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"], max_loras=3, max_rank=8,
                      modules_to_save=["lm_head", "embed_tokens"])
    for name in ("plain", "saver", "header"):
        mlora.load_adapter(name, paths[name])
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    ids = torch.randint(0, CONFIG.vocab_size, (12,), generator=torch.Generator().manual_seed(5))
    torch._dynamo.reset()
    with torch.no_grad():
        for i, (seq_lens, adapters) in enumerate([([6, 6], ["plain", None]), ([4, 8], ["header", "saver"]),
                                                  ([12], ["saver"])]):
            mlora.set_batch(seq_lens, adapters)
            with torch._dynamo.config.patch(error_on_recompile=i > 0):
                got = compiled(ids).clone()
            want = _tiny_peft_logits(peft_model, ids, seq_lens, adapters)
            torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
