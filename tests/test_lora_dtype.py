"""``lora_dtype``: fp32 adapters kept in fp32 on a bf16 model.

The oracle of a wrapped layer is fp32 math on what the layer's own base computes:
``base(x)`` (bf16, exactly as the layer runs it) + ``delta`` in fp32 from the adapter's
fp32 weights. With ``lora_dtype=torch.float32`` the layer's output is that sum rounded
once to bf16, so it is within one bf16 rounding of the oracle (docs/testing.md,
Tolerances); with the model's dtype (bf16) the adapter and its math are rounded too,
and only the bf16 tolerance holds. On every device parameter (graph devices capture
with batch A and replay batch B; compile devices compile once and reuse).
"""

import copy
import warnings

import pytest
import torch

peft = pytest.importorskip("peft", reason="saving PEFT adapters needs peft (tests/requirements.txt)")

from lora_core import load_peft_adapter  # noqa: E402
from lora_core.testing import TOLERANCES  # noqa: E402
from lora_layers import MultiLoRA, TinyConfig, TinyDecoder  # noqa: E402

CONFIG = TinyConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                    num_attention_heads=4, num_key_value_heads=2, seed=5)
TARGETS = ["q_proj", "v_proj", "down_proj", "embed_tokens", "lm_head"]
ADAPTERS = {"alpha": dict(r=4, lora_alpha=8), "beta": dict(r=8, lora_alpha=4, use_rslora=True)}
BATCH_A = ([3, 5, 4], ["alpha", None, "beta"])
BATCH_B = ([6, 2, 4], ["beta", "alpha", None])
FP32_ADAPTERS_ON_BF16 = (5e-3, 1e-5)
"""(rtol, atol) of a bf16 layer with fp32 adapters and lora_dtype=float32 against the oracle
(docs/testing.md, Tolerances): one bf16 rounding of the output, whose relative error is at
most bf16's unit roundoff 2**-8 (3.9e-3), with room for the fp32 delta's accumulation order."""


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory):
    torch.manual_seed(0)
    model = peft.get_peft_model(TinyDecoder(CONFIG), peft.LoraConfig(target_modules=TARGETS, init_lora_weights=False,
                                                                     **ADAPTERS["alpha"]), adapter_name="alpha")
    model.add_adapter("beta", peft.LoraConfig(target_modules=TARGETS, init_lora_weights=False, **ADAPTERS["beta"]))
    out = tmp_path_factory.mktemp("adapters")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "not a transformers model" notices
        model.save_pretrained(str(out), selected_adapters=list(ADAPTERS))
    dirs = {name: out / name for name in ADAPTERS}
    assert all(m.lora_a.dtype == torch.float32 for d in dirs.values() for m in load_peft_adapter(d).modules.values())
    return dirs


def _serve(adapter_dirs, device, lora_dtype):
    model = TinyDecoder(CONFIG).to(device.torch_device, torch.bfloat16)
    mlora = MultiLoRA.from_adapters(model, adapter_dirs, max_rank=8, **({} if lora_dtype is None else
                                                                        {"lora_dtype": lora_dtype}))
    return model, mlora


def _inputs(mlora, device):
    gen = torch.Generator().manual_seed(7)
    T = sum(BATCH_A[0])
    inputs = {}
    for name, layer in mlora.wrapped.items():
        if isinstance(layer.base_layer, torch.nn.Embedding):
            inputs[name] = torch.randint(0, CONFIG.vocab_size, (T,), generator=gen)
        else:
            inputs[name] = torch.randn(T, layer.base_layer.in_features, generator=gen).to(torch.bfloat16)
    return {name: x.to(device.torch_device) for name, x in inputs.items()}


def _oracle(layer, x, adapters, batch):
    """fp32 math on the layer's own bf16 base output: ``base(x) + sum_t scaling * B A x_t``."""
    with torch.no_grad():
        base = layer.base_layer(x).float().cpu()
    x = x.cpu()
    start = 0
    for n, adapter in zip(*batch):
        if adapter is not None:
            w = adapters[adapter]
            if w.kind == "embedding":
                shrunk = w.lora_a[:, x[start : start + n]].T  # (n, r)
            else:
                shrunk = x[start : start + n].float() @ w.lora_a.T
            base[start : start + n] += w.scaling * shrunk @ w.lora_b.T
        start += n
    return base


def _max_error(out, expected, rtol, atol):
    """The largest ``|out - expected| / (atol + rtol * |expected|)``: at most 1 is within tolerance."""
    return ((out.float().cpu() - expected).abs() / (atol + rtol * expected.abs())).max().item()


def test_fp32_adapters_on_a_bf16_model_with_lora_dtype_float32(device, adapter_dirs):
    served = {dtype: _serve(adapter_dirs, device, dtype) for dtype in (torch.float32, None)}
    model, mlora = served[torch.float32]
    assert mlora.lora_dtype == torch.float32 and served[None][1].lora_dtype == torch.bfloat16  # default: the model's
    for layer in mlora.wrapped.values():
        assert layer.buffers.a.dtype == layer.buffers.b.dtype == torch.float32
        assert layer.base_layer.weight.dtype == torch.bfloat16  # the base model is untouched
    weights = {name: load_peft_adapter(d).modules for name, d in adapter_dirs.items()}
    inputs = _inputs(mlora, device)
    names = list(inputs)
    T = sum(BATCH_A[0])
    outs = {}  # lora_dtype -> outputs of every wrapped layer for batches A and B
    for dtype, (_, m) in served.items():  # one compiled function per model (one backend, one batch each)
        if device.is_graph:
            m.enable_graph(T)
        m.set_batch(*BATCH_A)
        outs[dtype] = device.run_two_batches(lambda *xs, m=m: tuple(m.wrapped[n](x) for n, x in zip(names, xs)),
                                             [inputs[n] for n in names], lambda m=m: m.set_batch(*BATCH_B))
    rtol, atol = FP32_ADAPTERS_ON_BF16
    bf16_rtol, bf16_atol = TOLERANCES[torch.bfloat16]
    for i, batch in enumerate([BATCH_A, BATCH_B]):
        for name, out32, out16 in zip(names, outs[torch.float32][i], outs[None][i]):
            assert out32.dtype == out16.dtype == torch.bfloat16, f"{name}: the base output's dtype is kept"
            adapters = {a: weights[a][name] for a in ADAPTERS}
            expected = _oracle(mlora.wrapped[name], inputs[name], adapters, batch)
            fp32_error = _max_error(out32, expected, rtol, atol)
            bf16_error = _max_error(out16, expected, rtol, atol)
            assert fp32_error <= 1, f"{name}: lora_dtype=float32 is {fp32_error:.2f}x the fp32-adapter tolerance"
            torch.testing.assert_close(out16.float().cpu(), expected, rtol=bf16_rtol, atol=bf16_atol)
            assert bf16_error > 1, f"{name}: bf16 LoRA math met the fp32-adapter tolerance: the oracle cannot tell"
    logits = model(torch.arange(T, device=device.torch_device)) if not device.is_graph else None
    assert logits is None or logits.dtype == torch.bfloat16


@pytest.mark.parametrize(("value", "error", "message"), [
    ("float32", TypeError, r"lora_dtype must be a floating-point torch.dtype .* got 'float32'"),
    (torch.int8, TypeError, r"lora_dtype must be a floating-point torch.dtype .* got torch.int8"),
    (torch.float64, ValueError, r"lora_dtype has dtype torch.float64; supported dtypes are float32, float16, "
                                r"bfloat16"),
])
def test_lora_dtype_is_validated_at_the_boundary(value, error, message):
    with pytest.raises(error, match=message):
        MultiLoRA(TinyDecoder(CONFIG), ["q_proj"], lora_dtype=value)


def test_lora_dtype_reaches_from_adapters_and_keeps_the_adapter_values(adapter_dirs):
    model = TinyDecoder(CONFIG).to(torch.bfloat16)
    mlora = MultiLoRA.from_adapters(copy.deepcopy(model), adapter_dirs, lora_dtype=torch.float32)
    name = "model.layers.0.self_attn.q_proj"
    w = load_peft_adapter(adapter_dirs["alpha"]).modules[name]
    slot = mlora.adapters["alpha"]
    buf = mlora.wrapped[name].buffers
    assert torch.equal(buf.a[slot, : w.rank], w.lora_a)  # bit for bit: never rounded through bf16
    assert torch.equal(buf.b[slot, :, : w.rank], w.lora_b)
