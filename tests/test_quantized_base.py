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


def _bnb_4bit(quant_type: str):
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
                    setattr(parent, name, layer.to("cpu"))  # quantized here
        model.is_loaded_in_4bit = True  # what PEFT reads to pick its bitsandbytes LoRA layer
    return quantize


QUANTIZERS = {"torchao-int8": _torchao_int8, "bnb-nf4": _bnb_4bit("nf4"), "bnb-fp4": _bnb_4bit("fp4")}


def _quantized_base(kind: str) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.Phi3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
                                     pad_token_id=0, eos_token_id=None)
    model = transformers.Phi3ForCausalLM(config)
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


def test_a_dora_adapter_over_a_quantized_layer_is_refused_naming_the_module(served, tmp_path):
    """DoRA's norm is over the dense weight, which a quantized layer does not hold: refused at load, in one
    line naming the module and the layer, before any slot is written."""
    kind, base, _, _ = served
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(
            r=4, lora_alpha=8, use_dora=True, target_modules=["o_proj"], init_lora_weights=False)).save_pretrained(
                str(tmp_path / "dora"))
    with pytest.raises(ValueError, match=r"module 'model\.layers\.0\.self_attn\.o_proj': DoRA over a quantized base "
                                         r"layer \((Linear|Linear4bit), weight \w+\) is not supported yet"):
        MultiLoRA.from_adapters(copy.deepcopy(base), {"dora": tmp_path / "dora"}, backend="torch_native")


@pytest.mark.parametrize("backend", available_backends())
def test_graph_mode_captured_with_one_batch_replays_another_as_eager(device, backend, served):
    """Captured (or compiled) with batch A, run with batch B: each equals the eager forward of its batch."""
    kind, base, paths, _ = served
    if device.torch_device.type != "cpu":
        pytest.skip("the quantization libraries' CPU layers")
    if device.simulated and kind.startswith("bnb"):
        pytest.skip("bitsandbytes' 4-bit matmul is an opaque custom op (bitsandbytes::gemv_4bit): the graph "
                    "simulator cannot see its host logic, so only real graph hardware can say whether it captures")
    batches = [([3, 5, 4], ["wide", "narrow", None]), ([6, 2, 4], [None, "wide", "narrow"])]
    T = 12
    ids = torch.randint(3, 128, (1, T), generator=torch.Generator().manual_seed(2))
    model = copy.deepcopy(base)
    mlora = MultiLoRA.from_adapters(model, paths, backend=backend)
    expected = []
    for batch in batches:
        mlora.set_batch(*batch)
        with torch.no_grad():
            expected.append(model(input_ids=ids, use_cache=False).logits)
    if device.is_graph:
        mlora.enable_graph(T)
    mlora.set_batch(*batches[0])
    out_a, out_b = device.run_two_batches(lambda i: model(input_ids=i, use_cache=False).logits, [ids],
                                          lambda: mlora.set_batch(*batches[1]))
    for got, want in ((out_a, expected[0]), (out_b, expected[1])):
        assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-4, kind
