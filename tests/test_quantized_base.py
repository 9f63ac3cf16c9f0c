"""LoRA over quantized base layers (issue #41): a tiny Phi3 (fused ``qkv_proj`` / ``gate_up_proj``)
whose decoder linears are torchao int8 weight-only or bitsandbytes 4-bit (NF4, FP4) layers, two
PEFT adapters on every linear target and a base row in one batch. Each row equals PEFT on the same
quantized model (logits within 1e-4 of their magnitude, greedy ``generate()`` token for token); the
base output comes from the quantized layer itself, and wrapping keeps no dense copy of a base weight.

bitsandbytes' CPU forward takes another path in eval mode (weights repacked with bf16 block scales)
than in training mode: a hand-quantized ``Linear4bit`` is created in training mode, so the model is
put in eval mode after quantizing, for lora-kit and PEFT alike (docs/quantization.md).
"""

import copy
import functools
import warnings

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers", reason="needs transformers (tests/requirements.txt)")
peft = pytest.importorskip("peft", reason="needs peft (tests/requirements.txt)")

from lora_core import available_backends  # noqa: E402
from lora_layers import MultiLoRA  # noqa: E402

TARGETS = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
ADAPTERS = {"wide": dict(r=8, lora_alpha=16), "narrow": dict(r=4, lora_alpha=4, use_rslora=True)}
ROUTE = ["wide", None, "narrow"]


def _torchao_int8(model: nn.Module) -> None:
    quantization = pytest.importorskip("torchao.quantization", reason="needs torchao (pip install torchao)")
    quantization.quantize_(model.model, quantization.Int8WeightOnlyConfig())


def _torchao_int4(model: nn.Module) -> None:
    """int4 weight-only values with a scale and zero point per 32 inputs, through the config that runs
    on CPUs (``IntxWeightOnlyConfig``: one int4 value per int8 byte); ``Int4WeightOnlyConfig``'s packed
    formats need CUDA or the ``mslk`` package (test_torchao_int4_packed_on_cuda)."""
    quantization = pytest.importorskip("torchao.quantization", reason="needs torchao (pip install torchao)")
    granularity = pytest.importorskip("torchao.quantization.granularity")
    quantization.quantize_(model.model, quantization.IntxWeightOnlyConfig(weight_dtype=torch.int4,
                                                                          granularity=granularity.PerGroup(32)))


def _bnb_4bit(quant_type: str, bf16_cpu_path: bool = False):
    """bitsandbytes ``Linear4bit`` layers. On a CPU with AVX512-BF16, bitsandbytes' eval-mode forward
    repacks the weight and computes in bfloat16 (bf16 block scales and activations): there a rounding
    difference of one float32 ulp in a layer's input can flip a bf16 rounding, so equality within 1e-4
    in fp32 would hold by the seed's luck. Unless ``bf16_cpu_path``, the layers take the float32 path
    that other CPUs take (``support_avx512bf16_for_cpu = False``);
    test_the_bitsandbytes_bf16_cpu_path_equals_peft_within_bf16 covers the other."""
    def quantize(model: nn.Module) -> None:
        bnb = pytest.importorskip("bitsandbytes", reason="needs bitsandbytes (pip install bitsandbytes)")
        for parent in list(model.model.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear:
                    layer = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                              compute_dtype=torch.float32, quant_type=quant_type)
                    layer.weight = bnb.nn.Params4bit(child.weight.data.clone(), requires_grad=False,
                                                     quant_type=quant_type)
                    if child.bias is not None:
                        layer.bias = nn.Parameter(child.bias.data.clone(), requires_grad=False)
                    layer.support_avx512bf16_for_cpu &= bf16_cpu_path
                    setattr(parent, name, layer.to("cpu"))  # quantized here
        model.is_loaded_in_4bit = True  # what PEFT reads to pick its bitsandbytes LoRA layer
    return quantize


QUANTIZERS = {"torchao-int8": _torchao_int8, "torchao-int4": _torchao_int4,
              "bnb-nf4": _bnb_4bit("nf4"), "bnb-fp4": _bnb_4bit("fp4")}


def _tiny_phi3() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.Phi3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
                                     pad_token_id=0, eos_token_id=None)
    return transformers.Phi3ForCausalLM(config)


def _quantized_base(kind: str) -> nn.Module:
    model = _tiny_phi3()
    QUANTIZERS[kind](model)
    return model.eval()  # after quantizing: the new layers too


@pytest.fixture(scope="module", params=list(QUANTIZERS))
def served(request, tmp_path_factory):
    """(kind, quantized base, adapter name -> directory, adapter name -> PEFT model with only it)."""
    base = _quantized_base(request.param)
    out = tmp_path_factory.mktemp(f"{request.param}-adapters")
    paths, single = {}, {}
    for name, options in ADAPTERS.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(
                target_modules=TARGETS, init_lora_weights=False, **options)).eval()
        model.save_pretrained(str(out / name))
        paths[name], single[name] = out / name, model
    return request.param, base, paths, single


def _inputs():
    return torch.randint(3, 128, (len(ROUTE), 7), generator=torch.Generator().manual_seed(1))


def _per_row(base, single, ids, fn):
    """``fn(model, row_ids)`` for each row alone, on its own model (its adapter's PEFT model, or the
    base model): ``(1, ...)`` results, one per row."""
    return [fn(single[name] if name else base, ids[row : row + 1]) for row, name in enumerate(ROUTE)]


@pytest.mark.parametrize("backend", available_backends())
def test_each_row_equals_peft_on_the_same_quantized_model(backend, served):
    kind, base, paths, single = served
    model = copy.deepcopy(base)
    mlora = MultiLoRA.from_adapters(model, paths, backend=backend)
    wrapped = mlora.wrapped["model.layers.0.self_attn.qkv_proj"]
    assert type(wrapped.base_layer) is type(base.model.layers[0].self_attn.qkv_proj)  # the quantized layer itself
    ids = _inputs()
    with mlora.route(ROUTE), torch.no_grad():
        got = model(ids).logits
    with torch.no_grad():
        want = _per_row(base, single, ids, lambda m, row_ids: m(row_ids).logits)
    for row, expected in enumerate(want):
        error = ((got[row] - expected[0]).abs().max() / expected[0].abs().max()).item()
        assert error <= 1e-4, (kind, row, ROUTE[row], error)


@pytest.mark.parametrize("backend", available_backends())
def test_greedy_generate_equals_each_rows_peft_generate(backend, served):
    kind, base, paths, single = served
    model = copy.deepcopy(base)
    mlora = MultiLoRA.from_adapters(model, paths, backend=backend)
    ids, kw = _inputs(), dict(max_new_tokens=5, do_sample=False)
    with mlora.route(ROUTE), torch.no_grad():
        got = model.generate(input_ids=ids, **kw)
    with torch.no_grad():
        want = _per_row(base, single, ids, lambda m, row_ids: m.generate(input_ids=row_ids, **kw))
    for row, expected in enumerate(want):
        assert torch.equal(got[row], expected[0]), (kind, row, got[row], expected[0])


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_the_bitsandbytes_bf16_cpu_path_equals_peft_within_bf16(quant_type, tmp_path):
    """bitsandbytes' eval-mode path on AVX512-BF16 CPUs (weights repacked, bf16 compute), for lora-kit and
    PEFT alike: each row within a few bf16 roundings of PEFT's (measured: 3.5e-4 at most over eight
    adapter seeds, most rows 3e-7; a float32 rounding difference in a layer's input flips a bf16 rounding
    now and then). A base computed in another mode than PEFT's was 4.5e-3 off (docs/quantization.md)."""
    base = _tiny_phi3()
    _bnb_4bit(quant_type, bf16_cpu_path=True)(base)
    base.eval()
    single, paths = {}, {}
    for name, options in ADAPTERS.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            single[name] = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(
                target_modules=TARGETS, init_lora_weights=False, **options)).eval()
        single[name].save_pretrained(str(tmp_path / name))
        paths[name] = tmp_path / name
    ids = _inputs()
    with torch.no_grad():
        want = _per_row(base, single, ids, lambda m, row_ids: m(row_ids).logits)
    if not getattr(base.model.layers[0].self_attn.qkv_proj.weight.quant_state, "packing_format_for_cpu", False):
        pytest.skip("bitsandbytes took its float32 path: this CPU has no AVX512-BF16")
    for backend in available_backends():
        model = copy.deepcopy(base)
        mlora = MultiLoRA.from_adapters(model, paths, backend=backend)
        with mlora.route(ROUTE), torch.no_grad():
            got = model(ids).logits
        for row, expected in enumerate(want):
            error = ((got[row] - expected[0]).abs().max() / expected[0].abs().max()).item()
            assert error <= 2e-3, (quant_type, backend, row, ROUTE[row], error)


def _tensor_bytes(t: torch.Tensor) -> int:
    """Storage bytes of ``t``; a tensor subclass (torchao's quantized weights) counts its inner tensors."""
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(t, name)) for name in names)
    return t.numel() * t.element_size()


def _bytes(module: nn.Module) -> int:
    """Bytes of ``module``'s parameters and registered buffers (a wrapper's ``buffers`` attribute is its
    LoRA weights, so ``nn.Module.buffers`` is called by its class)."""
    tensors = {id(t): t for t in [*module.parameters(), *nn.Module.buffers(module)]}.values()
    return sum(_tensor_bytes(t) for t in tensors)


def test_wrapping_keeps_no_dense_copy_of_a_base_weight(served):
    """The wrapped model holds the quantized model's parameters and buffers and, beside them, only the
    adapters' LoRA buffers: no base weight is dequantized into a copy."""
    kind, base, paths, _ = served
    model = copy.deepcopy(base)
    before = _bytes(model)
    mlora = MultiLoRA.from_adapters(model, paths, backend="torch_native")
    lora_tensors = {id(t): t for m in mlora.wrapped.values() for t in vars(m.buffers).values()
                    if isinstance(t, torch.Tensor)}.values()
    lora_bytes = sum(t.numel() * t.element_size() for t in lora_tensors)
    registered_lora = sum(t.numel() * t.element_size() for t in lora_tensors
                          if any(t is r for r in [*model.parameters(), *nn.Module.buffers(model)]))
    assert lora_bytes > 0
    assert _bytes(model) - registered_lora == before, kind
    for name, m in mlora.wrapped.items():  # nor is a copy kept outside the registered tensors
        kept = [k for k, v in vars(m).items() if isinstance(v, torch.Tensor) and k != "dora_factors"]
        assert kept == [], (name, kept)
    dense = sum(m.base_layer.in_features * m.base_layer.out_features * 4 for m in mlora.wrapped.values())
    stored = sum(_bytes(m.base_layer) for m in mlora.wrapped.values())
    assert stored < dense / 3  # the wrapped base weights stay int8 or packed 4-bit (float32 would be `dense`)


@pytest.mark.parametrize("backend", available_backends())
def test_a_dora_adapter_over_a_quantized_base_equals_peft(backend, served, tmp_path):
    """DoRA's norm is taken once, at load, over the layer's weight dequantized by its library (as PEFT's
    ``dequantize_module_weight`` does, into a temporary): each row of a batch mixing a DoRA adapter (on a
    fused and a plain projection), a plain adapter and a base row equals PEFT's.

    bitsandbytes' layers take their float32 path here (``_bnb_4bit``): PEFT's DoRA reads a weight that
    bitsandbytes repacked for its bf16 CPU path as if it were not repacked, and is 12% off there
    (docs/quantization.md); lora-kit unpacks it (test_dense_weight.py)."""
    kind, base, paths, single = served
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dora = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(
            r=4, lora_alpha=8, use_dora=True, target_modules=["qkv_proj", "down_proj"], init_lora_weights=False)).eval()
    dora.save_pretrained(str(tmp_path / "dora"))
    route = ["dora", None, "wide"]
    oracles = {"dora": dora, None: base, "wide": single["wide"]}
    model = copy.deepcopy(base)
    mlora = MultiLoRA.from_adapters(model, {"dora": tmp_path / "dora", "wide": paths["wide"]}, backend=backend)
    assert mlora.wrapped["model.layers.0.mlp.down_proj"].dora_factors is not None
    ids = _inputs()
    with mlora.route(route), torch.no_grad():
        got = model(ids).logits
    with torch.no_grad():
        for row, name in enumerate(route):
            expected = oracles[name](ids[row : row + 1]).logits[0]
            error = ((got[row] - expected).abs().max() / expected.abs().max()).item()
            assert error <= 1e-4, (kind, row, name, error)


def test_dora_over_a_weight_of_an_unknown_quantization_is_refused_naming_the_module(tmp_path):
    """A weight type of no library lora-kit dequantizes is refused at load, in one line naming the module,
    the layer and the weight's type, rather than read as if it were dense."""
    base = _tiny_phi3().eval()

    class PackedWeight(nn.Parameter):
        """Stands for a quantization scheme lora-kit does not know."""

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(
            r=4, lora_alpha=8, use_dora=True, target_modules=["lm_head"], init_lora_weights=False)).save_pretrained(
                str(tmp_path / "dora"))
    model = copy.deepcopy(base)
    model.lm_head.weight = PackedWeight(model.lm_head.weight.detach().clone(), requires_grad=False)
    with pytest.raises(ValueError, match=r"^adapter 'dora' does not fit module 'lm_head': DoRA over Linear is not "
                                         r"supported: its norm needs the dense weight, and this layer has a "
                                         r"[\w.<>]+\.PackedWeight weight: lora-kit dequantizes dense, torchao and "
                                         r"bitsandbytes 4-bit \(Params4bit\) weights$"):
        MultiLoRA.from_adapters(model, {"dora": tmp_path / "dora"}, backend="torch_native")


@pytest.mark.parametrize("backend", available_backends())
def test_graph_mode_captured_with_one_batch_replays_another_as_eager(device, backend, served):
    """Captured (or compiled) with batch A, run with batch B: each equals the eager forward of its batch."""
    kind, base, paths, _ = served
    if device.torch_device.type != "cpu":
        pytest.skip("the quantization libraries' CPU layers")
    if device.simulated and kind.startswith("bnb"):
        pytest.skip("bitsandbytes' 4-bit matmul is an opaque custom op (bitsandbytes::gemm_4bit, gemv_4bit on its "
                    "bf16 CPU path): the graph "
                    "simulator cannot see its host logic, so only real graph hardware can say whether it captures")
    batches = [([3, 5, 4], ["wide", "narrow", None]), ([6, 2, 4], [None, "wide", "narrow"])]
    T = 12
    ids = torch.randint(3, 128, (1, T), generator=torch.Generator().manual_seed(2))
    model = copy.deepcopy(base)
    mlora = MultiLoRA.from_adapters(model, paths, backend=backend)
    expected, outs = device.eager_and_replayed(
        lambda i: model(input_ids=i, use_cache=False).logits, [ids], lambda: mlora.set_batch(*batches[0]),
        lambda: mlora.set_batch(*batches[1]), lambda: mlora.enable_graph(T))
    for got, want in zip(outs, expected):
        assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-4, kind


def _with_adapter_hooks(model: nn.Module, adapter_dir) -> nn.Module:
    """``model`` with each module an adapter targets computing ``base(x) + scaling * B @ A @ x`` (the
    adapter's saved weights, in float32) through forward hooks: the math PEFT's LoRA layer adds to a
    quantized layer, as an oracle where PEFT refuses the layer (torchao's ``Int4Tensor``)."""
    from safetensors.torch import load_file

    config = peft.LoraConfig.from_pretrained(str(adapter_dir))
    scaling = config.lora_alpha / (config.r ** 0.5 if config.use_rslora else config.r)
    saved = load_file(str(adapter_dir / "adapter_model.safetensors"), device=str(model.device))
    for key, a in saved.items():
        if key.endswith(".lora_A.weight"):
            b = saved[key.replace(".lora_A.", ".lora_B.")]
            module = model.get_submodule(key.removeprefix("base_model.model.").removesuffix(".lora_A.weight"))
            module.register_forward_hook(functools.partial(_add_delta, a.float(), b.float(), scaling))
    return model


def _add_delta(a: torch.Tensor, b: torch.Tensor, scaling: float, module: nn.Module, args: tuple,
               output: torch.Tensor) -> torch.Tensor:
    return output + (scaling * (args[0].float() @ a.T @ b.T)).to(output.dtype)


def test_the_hook_oracle_equals_peft(served):
    """The oracle of the CUDA int4 case, checked where PEFT runs: on each quantized model here it gives
    PEFT's logits."""
    kind, base, paths, single = served
    ids = _inputs()
    for name in ADAPTERS:
        with torch.no_grad():
            got = _with_adapter_hooks(copy.deepcopy(base), paths[name])(ids).logits
            expected = single[name](ids).logits
        assert ((got - expected).abs().max() / expected.abs().max()).item() <= 1e-5, (kind, name)


def test_torchao_int4_packed_on_cuda(device, tmp_path):
    """torchao's ``Int4WeightOnlyConfig`` (tinygemm's packed int4 layout, bf16) runs on CUDA only: its CPU
    formats need the ``mslk`` package (which the package index only has as an empty 0.0.0 placeholder) or
    are not implemented for the CPU. PEFT refuses ``Int4Tensor`` weights, so the oracle is the same
    quantized model with each adapter's math added by forward hooks, in float32."""
    if device.name != "cuda":
        pytest.skip("tinygemm's packed int4 layout is a CUDA kernel: this case is the eager cuda parameter")
    quantization = pytest.importorskip("torchao.quantization", reason="needs torchao (pip install torchao)")
    base = _tiny_phi3().to(device.torch_device, torch.bfloat16).eval()
    quantization.quantize_(base.model, quantization.Int4WeightOnlyConfig(group_size=32,
                                                                         int4_packing_format="tile_packed_to_4d"))
    assert type(base.model.layers[0].self_attn.qkv_proj.weight).__name__ == "Int4TilePackedTo4dTensor"
    dirs = {}
    for name, options in ADAPTERS.items():
        model = peft.get_peft_model(_tiny_phi3(), peft.LoraConfig(target_modules=TARGETS, init_lora_weights=False,
                                                                  **options))
        model.save_pretrained(str(tmp_path / name))  # trained on the dense twin: the same module shapes
        dirs[name] = tmp_path / name
    model = copy.deepcopy(base)
    mlora = MultiLoRA.from_adapters(model, dirs, backend="torch_native")
    ids = _inputs().to(device.torch_device)
    with mlora.route(ROUTE), torch.no_grad():
        got = model(ids).logits.float()
    for row, name in enumerate(ROUTE):
        oracle = _with_adapter_hooks(copy.deepcopy(base), dirs[name]) if name else base
        with torch.no_grad():
            expected = oracle(ids[row : row + 1]).logits[0].float()
        error = ((got[row] - expected).abs().max() / expected.abs().max()).item()
        assert error <= 3e-2, (row, name, error)  # bf16 activations and LoRA buffers
