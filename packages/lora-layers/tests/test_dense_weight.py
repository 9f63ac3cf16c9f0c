"""``dense_weight``: a base layer's weight as the dense tensor its forward computes with, for DoRA's
norm at load; quantized weights dequantized by their library into a temporary, unknown ones refused."""

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from lora_layers.layers.dense_weight import UnsupportedWeight, dense_weight


def _linear() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(64, 96)


def _x() -> torch.Tensor:
    return torch.randn(5, 64, generator=torch.Generator().manual_seed(1))


def test_a_dense_weight_is_returned_as_is():
    layer = _linear()
    assert dense_weight(layer.weight) is layer.weight
    assert dense_weight(layer.weight.detach()).data_ptr() == layer.weight.data_ptr()


@pytest.mark.parametrize("config", ["int8", "int4"])
def test_a_torchao_weight_is_what_the_layer_computes_with(config):
    quantization = pytest.importorskip("torchao.quantization", reason="needs torchao (pip install torchao)")
    granularity = pytest.importorskip("torchao.quantization.granularity")
    layer = _linear()
    quantization.quantize_(layer, quantization.Int8WeightOnlyConfig() if config == "int8" else
                           quantization.IntxWeightOnlyConfig(weight_dtype=torch.int4,
                                                             granularity=granularity.PerGroup(32)))
    weight = dense_weight(layer.weight)
    assert type(weight) is torch.Tensor and weight.shape == (96, 64)
    with torch.no_grad():
        assert torch.allclose(layer(_x()), F.linear(_x(), weight, layer.bias), rtol=0, atol=1e-5)


def _bnb_linear(quant_type: str) -> nn.Module:
    bnb = pytest.importorskip("bitsandbytes", reason="needs bitsandbytes (pip install bitsandbytes)")
    dense = _linear()
    layer = bnb.nn.Linear4bit(64, 96, compute_dtype=torch.float32, quant_type=quant_type)
    layer.weight = bnb.nn.Params4bit(dense.weight.data.clone(), requires_grad=False, quant_type=quant_type)
    layer.bias = nn.Parameter(dense.bias.data.clone(), requires_grad=False)
    return layer.to("cpu")  # quantized here


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_a_bitsandbytes_4bit_weight_is_what_the_layer_computes_with(quant_type):
    layer = _bnb_linear(quant_type)  # training mode: bitsandbytes keeps the weight as quantized
    weight = dense_weight(layer.weight)
    assert weight.shape == (96, 64)
    with torch.no_grad():
        assert torch.allclose(layer(_x()), F.linear(_x(), weight, layer.bias), rtol=0, atol=1e-5)


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_a_bitsandbytes_weight_repacked_for_the_cpu_is_unpacked_on_copies(quant_type):
    """An eval-mode CPU forward (on AVX512-BF16 CPUs) repacks the weight into bitsandbytes' CPU layout with
    bfloat16 block scales: read as the plain layout it is garbage (what PEFT's DoRA reads there); unpacked,
    it is the quantized weight up to the scales' bf16 rounding, and the layer is left as it was."""
    bnb = pytest.importorskip("bitsandbytes", reason="needs bitsandbytes (pip install bitsandbytes)")
    layer = _bnb_linear(quant_type)
    before = dense_weight(layer.weight).clone()
    layer.eval()
    with torch.no_grad():
        layer(_x())
    state = layer.weight.quant_state
    if not getattr(state, "packing_format_for_cpu", False):
        pytest.skip("bitsandbytes did not repack the weight on this CPU (no AVX512-BF16)")
    packed, scales = layer.weight.data.clone(), copy.copy(vars(state))
    weight = dense_weight(layer.weight)
    assert weight.shape == (96, 64)
    assert ((weight - before).abs() <= before.abs() * 2**-8 + 1e-7).all()  # bf16 block scales: 8 mantissa bits
    as_if_plain = bnb.functional.dequantize_4bit(layer.weight.data, state)
    assert (as_if_plain.reshape(before.shape) - before).abs().max() > 0.1 * before.abs().max()
    assert torch.equal(layer.weight.data, packed) and layer.weight.quant_state is state
    assert state.packing_format_for_cpu and all(vars(state)[k] is v for k, v in scales.items())


def test_a_weight_of_an_unknown_quantization_is_refused():
    class PackedWeight(nn.Parameter):
        """Stands for a quantization scheme lora-kit does not know."""

    with pytest.raises(UnsupportedWeight, match=r"PackedWeight weight: lora-kit dequantizes dense, torchao and "
                                                r"bitsandbytes 4-bit \(Params4bit\) weights"):
        dense_weight(PackedWeight(torch.zeros(2, 2), requires_grad=False))


def test_a_torchao_weight_its_library_cannot_dequantize_is_refused():
    """torchao 0.18's int4 tensors (``Int4Tensor``, ``Int4TilePackedTo4dTensor``) define no ``dequantize``:
    ``torch.Tensor.dequantize`` reaches their dispatch, which raises; refused instead of escaping."""
    utils = pytest.importorskip("torchao.utils", reason="needs torchao (pip install torchao)")

    class PackedInt4(utils.TorchAOBaseTensor):
        """A torchao tensor type without ``dequantize``, as the int4 ones."""
        tensor_data_names = ["qdata"]
        tensor_attribute_names = []

        def __new__(cls, qdata):
            return torch.Tensor._make_wrapper_subclass(cls, (qdata.shape[0], qdata.shape[1] * 2),
                                                       dtype=torch.bfloat16, device=qdata.device)

        def __init__(self, qdata):
            self.qdata = qdata

    PackedInt4.__module__ = "torchao.quantization.fake_int4"
    with pytest.raises(UnsupportedWeight, match=r"^a torchao\.quantization\.fake_int4\.PackedInt4 weight, which "
                                                r"torchao does not dequantize$"):
        dense_weight(PackedInt4(torch.zeros(4, 4, dtype=torch.uint8)))


def test_a_bitsandbytes_weight_not_quantized_yet_is_still_dense():
    """A ``Params4bit`` is quantized when moved to a device; before that its data is the dense weight."""
    bnb = pytest.importorskip("bitsandbytes", reason="needs bitsandbytes (pip install bitsandbytes)")
    dense = torch.randn(96, 64, generator=torch.Generator().manual_seed(0))
    weight = bnb.nn.Params4bit(dense.clone(), requires_grad=False, quant_type="nf4")
    assert not weight.bnb_quantized
    assert torch.equal(dense_weight(weight), dense)
