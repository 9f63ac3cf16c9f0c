"""MultiLoRA on tiny random mixture-of-experts transformers models against PEFT (docs/moe.md).

PEFT cannot mix ``target_parameters`` adapters in one batch, so the oracle is per row:
each row of a mixed batch (three adapters of different ranks and targets, and a
base-model row) equals PEFT's output for that row with only its adapter loaded, or
the base model for the base row. Mixtral, Qwen3-MoE and Qwen2-MoE (whose experts are
transformers' fused ``gate_up_proj`` / ``down_proj``; Qwen2-MoE's shared expert, an
ordinary MLP, targeted as modules) and gpt-oss (experts stored ``(E, in, out)`` with
biases, gate and up interleaved, its clamped SwiGLU) in fp32 at the fp32 tolerance, and Mixtral in
bf16 at the bf16 one (LoRA in bf16, and in fp32 with ``lora_dtype``); greedy
``generate()`` with left padding; a graph-mode forward (captured with batch A,
replayed with batch B) equal to eager; and ``examples/bench_moe.py --smoke`` checks
and times every variant.
"""

import copy
import importlib.util
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs transformers (tests/requirements.txt)")
peft = pytest.importorskip("peft", reason="needs peft (tests/requirements.txt)")

from lora_core import AdapterFormatError, available_backends  # noqa: E402
from lora_core.testing import TOLERANCES  # noqa: E402
from lora_layers import MultiLoRA  # noqa: E402
from lora_layers.layers import ExpertsWithLoRA, LinearWithLoRA  # noqa: E402

EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]
# three adapters: different ranks, targets, patterns; adapter names are not substrings of module names
ADAPTERS = {
    "sql": dict(r=4, lora_alpha=8, target_modules=["q_proj"], target_parameters=EXPERTS,
                rank_pattern={"down_proj": 2}, alpha_pattern={"gate_up_proj": 3}),
    "chat": dict(r=8, lora_alpha=4, use_rslora=True, target_modules=["v_proj", "o_proj"],
                 target_parameters=["experts.down_proj"]),
    "math": dict(r=2, lora_alpha=16, target_modules=[], target_parameters=["experts.gate_up_proj"]),
}
ROUTE = ["sql", None, "chat", "math"]
SHARED_EXPERT = {"qwen2_moe": ["gate_proj", "up_proj", "down_proj"]}
"""Qwen2-MoE's shared expert is an ordinary MLP: "math" targets it as modules, too."""
SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
             max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=None)


def _base_model(kind, dtype=torch.float32):
    torch.manual_seed(0)
    if kind == "mixtral":
        config = transformers.MixtralConfig(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, **SMALL)
        model = transformers.MixtralForCausalLM(config)
    elif kind == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(intermediate_size=64, moe_intermediate_size=24, num_experts=6,
                                             num_experts_per_tok=2, shared_expert_intermediate_size=40,
                                             decoder_sparse_step=1, norm_topk_prob=True, **SMALL)
        model = transformers.Qwen2MoeForCausalLM(config)
    elif kind == "gpt_oss":  # experts stored (E, in, out), biased, gate/up interleaved, clamped SwiGLU
        config = transformers.GptOssConfig(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
                                           head_dim=8, sliding_window=8, **SMALL)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # its default RoPE scaling assumes a longer context
            model = transformers.GptOssForCausalLM(config)
        with torch.no_grad():  # the biases start at zero: make them count
            for name, param in model.named_parameters():
                if name.endswith("_proj_bias"):
                    param.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    else:
        config = transformers.Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=24, num_experts=6,
                                             num_experts_per_tok=2, decoder_sparse_step=1, head_dim=8,
                                             norm_topk_prob=True, **SMALL)
        model = transformers.Qwen3MoeForCausalLM(config)
    return model.to(dtype).eval()


def _save_adapter(kind, base, name, path):
    options = dict(ADAPTERS[name])
    if name == "math":
        options["target_modules"] = SHARED_EXPERT.get(kind, [])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(init_lora_weights=False, **options))
        with torch.no_grad():  # random B at the scale of the base weights: the adapters steer, not swamp
            for param_name, param in model.named_parameters():
                if "lora_B" in param_name:
                    param.mul_(0.3)
        model.save_pretrained(str(path))


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe", "qwen2_moe", "gpt_oss"])
def served(request, tmp_path_factory):
    """(kind, base model, adapter name -> directory, adapter name -> PEFT model with only it)."""
    kind = request.param
    base = _base_model(kind)
    out = tmp_path_factory.mktemp(f"{kind}-moe-adapters")
    paths, single = {}, {}
    for name in ADAPTERS:
        _save_adapter(kind, base, name, out / name)
        paths[name] = out / name
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            single[name] = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(out / name)).eval()
    return kind, base, paths, single


def _inputs():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, SMALL["vocab_size"], (len(ROUTE), 7), generator=g)
    mask = torch.ones_like(ids)
    for row, pad in [(1, 3), (3, 1)]:  # two prompts shorter than the others, left padded
        mask[row, :pad] = 0
        ids[row, :pad] = 0
    return ids, mask


def _per_row(base, single, fn):
    """``fn(model)`` for each row's own model: its adapter's PEFT model, or the base model."""
    return [fn(single[name] if name else base) for name in ROUTE]


def _served(base, paths, backend, dtype=torch.float32, **options):
    model = copy.deepcopy(base).to(dtype)
    return model, MultiLoRA.from_adapters(model, paths, backend=backend, **options)


@pytest.mark.parametrize("backend", available_backends())
def test_mixed_batch_logits_equal_each_rows_peft_model(backend, served):
    kind, base, paths, single = served
    model, mlora = _served(base, paths, backend)
    experts = [m for m in mlora.wrapped.values() if isinstance(m, ExpertsWithLoRA)]
    assert len(experts) == 2 and any(isinstance(m, LinearWithLoRA) for m in mlora.wrapped.values())
    if kind == "qwen2_moe":  # the shared expert's projections are ordinary linear layers
        assert isinstance(mlora.wrapped["model.layers.0.mlp.shared_expert.down_proj"], LinearWithLoRA)
    assert mlora.slots.max_rank == 8
    ids, mask = _inputs()
    with torch.no_grad(), mlora.route(ROUTE):
        got = model(input_ids=ids, attention_mask=mask).logits
    with torch.no_grad():
        want = _per_row(base, single, lambda m: m(input_ids=ids, attention_mask=mask).logits)
    rtol, atol = TOLERANCES[torch.float32]
    for row, expected in enumerate(want):
        torch.testing.assert_close(got[row], expected[row], rtol=rtol, atol=atol)
    with torch.no_grad():
        plain = base(input_ids=ids, attention_mask=mask).logits
    assert all(not torch.allclose(got[i], plain[i], rtol=1e-3, atol=1e-3) for i in (0, 2, 3))  # each adapter steers


@pytest.mark.parametrize("backend", available_backends())
def test_greedy_generate_with_left_padding_equals_each_rows_peft_generate(backend, served):
    kind, base, paths, single = served
    if kind == "qwen2_moe":
        pytest.skip("the logits test covers Qwen2-MoE's shared expert; generate() runs on the others")
    if kind != "gpt_oss" and backend != "torch_native":
        pytest.skip("one backend for the families in transformers' first experts layout; gpt-oss's on both")
    model, mlora = _served(base, paths, backend)
    ids, mask = _inputs()
    kw = dict(max_new_tokens=5, do_sample=False)
    with mlora.route(ROUTE):
        got = model.generate(input_ids=ids, attention_mask=mask, **kw)
    want = _per_row(base, single, lambda m: m.generate(input_ids=ids, attention_mask=mask, **kw))
    for row, expected in enumerate(want):
        assert torch.equal(got[row], expected[row]), (row, got[row], expected[row])


@pytest.mark.parametrize("backend", available_backends())
@pytest.mark.parametrize("lora_dtype", [None, torch.float32], ids=["lora-bf16", "lora-fp32"])
def test_bf16_logits_are_within_the_bf16_tolerance(backend, lora_dtype, served):
    kind, base, paths, single = served
    if kind != "mixtral":
        pytest.skip("one model family is enough for the bf16 tolerance")
    model, mlora = _served(base, paths, backend, torch.bfloat16, lora_dtype=lora_dtype)
    assert all(m.gate_up.a.dtype == (lora_dtype or torch.bfloat16)
               for m in mlora.wrapped.values() if isinstance(m, ExpertsWithLoRA))
    ids, mask = _inputs()
    with torch.no_grad(), mlora.route(ROUTE):
        got = model(input_ids=ids, attention_mask=mask).logits
    with torch.no_grad():
        want = _per_row(base, single, lambda m: m(input_ids=ids, attention_mask=mask).logits)  # fp32 PEFT
    rtol, atol = TOLERANCES[torch.bfloat16]
    for row, expected in enumerate(want):
        torch.testing.assert_close(got[row].float(), expected[row], rtol=rtol, atol=atol)


@pytest.mark.parametrize("backend", available_backends())
def test_graph_mode_captured_with_one_batch_replays_another_as_eager(device, backend, served):
    kind, base, paths, _ = served
    if kind not in ("mixtral", "gpt_oss") or device.torch_device.type != "cpu":
        pytest.skip("two experts layouts on the CPU device kinds")
    batches = [([3, 5, 4], ["sql", "chat", None]), ([6, 2, 4], ["math", "sql", "chat"])]
    T = 12
    ids = torch.randint(3, SMALL["vocab_size"], (1, T), generator=torch.Generator().manual_seed(2))
    model, mlora = _served(base, paths, backend)
    expected, outs = device.eager_and_replayed(
        lambda i: model(input_ids=i, use_cache=False).logits, [ids], lambda: mlora.set_batch(*batches[0]),
        lambda: mlora.set_batch(*batches[1]), lambda: mlora.enable_graph(T))
    rtol, atol = TOLERANCES[torch.float32]
    for got, want in zip(outs, expected):
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


def test_load_adapter_later_and_refusals(served, tmp_path):
    kind, base, paths, single = served
    if kind != "mixtral":
        pytest.skip("one model family")
    model, mlora = _served(base, {"sql": paths["sql"]}, "torch_native")
    mlora = MultiLoRA.from_adapters(copy.deepcopy(base), {"sql": paths["sql"]}, max_loras=2)
    mlora.load_adapter("math", paths["math"])
    assert sorted(mlora.adapters) == ["math", "sql"]
    # a parameter lora-kit has no wrapper for is refused by name
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        other = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(
            r=2, target_modules=[], target_parameters=["self_attn.q_proj.weight"], init_lora_weights=False))
        other.save_pretrained(str(tmp_path / "odd"))
    with pytest.raises(AdapterFormatError, match=r"parameter 'model\.layers\.0\.self_attn\.q_proj\.weight'"):
        MultiLoRA.from_adapters(copy.deepcopy(base), {"odd": tmp_path / "odd"})


def test_bench_moe_smoke_checks_and_times_every_variant(capsys, tmp_path):
    path = Path(__file__).resolve().parents[1] / "examples" / "bench_moe.py"
    spec = importlib.util.spec_from_file_location("example_bench_moe", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--smoke", "--json", str(tmp_path / "bench.json")]) == 0
    out = capsys.readouterr().out
    for row in ("| prefill | base |", "| prefill | peft |", "| decode | lora-kit torch_native |",
                "| decode | lora-kit ascend |"):
        assert row in out
    assert (tmp_path / "bench.json").is_file()


def _gpt_oss_experts():
    experts = _base_model("gpt_oss").model.layers[0].mlp.experts
    return experts


@pytest.mark.parametrize("backend", available_backends())
def test_gpt_oss_experts_on_base_rows_equal_the_module_biases_and_mask_id_included(backend):
    """Wrapped directly, with every row on the base model: the module's own output, its
    biases added once per (token, expert) pair and nothing for the expert-parallel mask id E
    (the module skips it), called positionally (as GptOssMLP calls it) or with the
    forward's own keyword names."""
    from lora_core import build_batch_info, get_backend
    from lora_layers.layers import ExpertsLayout, LoRAContext

    experts = _gpt_oss_experts()
    layer = ExpertsWithLoRA(experts, LoRAContext(get_backend(backend)("cpu"), num_slots=2, max_rank=4,
                                                 dtype=torch.float32, device=torch.device("cpu")))
    assert layer.layout == ExpertsLayout(transposed=True, bias=True, interleaved=True)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(6, SMALL["hidden_size"], generator=gen)
    ids = torch.randint(0, 4, (6, 2), generator=gen)
    ids[2, 1], ids[4, 0], ids[5, 1] = 4, -1, 7  # the mask id E, and ids below and beyond: no expert, no bias
    weights = torch.softmax(torch.randn(6, 2, generator=gen), dim=-1)
    layer.context.backend.prepare_batch(build_batch_info([4, 2], [None, None], [4, 2], [1.0, 1.0], device="cpu"))
    with torch.no_grad():
        want = torch.zeros_like(x)  # gpt-oss's eager loop, pair by pair (its grouped-GEMM dispatch has no mask id)
        for t, k in ((t, k) for t in range(6) for k in range(2) if 0 <= ids[t, k] < 4):
            e = ids[t, k]
            h = experts._apply_gate(x[t] @ experts.gate_up_proj[e] + experts.gate_up_proj_bias[e])
            want[t] += weights[t, k] * (h @ experts.down_proj[e] + experts.down_proj_bias[e])
        got = layer(x, router_indices=ids, routing_weights=weights)
        positional = layer(x, ids, weights)
        unmasked = ids.clamp(0, 3)
        module = experts(x, unmasked, weights)  # transformers' experts dispatch takes them positionally
        wrapped = layer(x, unmasked, weights)
    rtol, atol = TOLERANCES[torch.float32]
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    torch.testing.assert_close(positional, want, rtol=rtol, atol=atol)
    torch.testing.assert_close(wrapped, module, rtol=rtol, atol=atol)


def test_experts_layouts_the_wrappers_cannot_run_are_refused_saying_why():
    from lora_core import get_backend
    from lora_layers.layers import LoRAContext, ParallelExpertsWithLoRA
    from lora_layers.parallel import TensorParallel

    context = LoRAContext(get_backend("torch_native")("cpu"), num_slots=1, max_rank=2, dtype=torch.float32,
                          device=torch.device("cpu"))
    no_gate = _gpt_oss_experts()
    no_gate.has_gate = False
    with pytest.raises(TypeError, match=r"cannot wrap GptOssExperts: experts without a gate \(has_gate=False\)"):
        ExpertsWithLoRA(no_gate, context)
    no_bias = _gpt_oss_experts()
    del no_bias.gate_up_proj_bias
    with pytest.raises(TypeError, match=r"experts with a bias \(has_bias\) need gate_up_proj_bias \(4, 48\)"):
        ExpertsWithLoRA(no_bias, context)
    interleaved = _gpt_oss_experts()
    interleaved._apply_gate = None
    interleaved.act_fn = torch.nn.functional.silu
    with pytest.raises(TypeError, match=r"gate and up interleaved \(is_concatenated=False\) need the module's "
                                        r"_apply_gate"):
        ExpertsWithLoRA(interleaved, context)
    with pytest.raises(TypeError, match=r"ParallelExpertsWithLoRA shards experts in the \(E, out, in\) layout .* "
                                        r"GptOssExperts has ExpertsLayout\(transposed=True, bias=True"):
        ParallelExpertsWithLoRA(_gpt_oss_experts(), context, TensorParallel(0, 1))
