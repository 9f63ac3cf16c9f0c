"""``lora-sim --quantize``: the quantized bases lora-sim serves, and their dequantized weights.

One table, :data:`QUANTIZATIONS`, says for each ``--quantize`` choice which library makes the
layers, how a layer is quantized and how its weight is read back dense. What is quantized: every
``*_proj`` linear layer of the decoder layers (``q/k/v/o_proj`` or ``qkv_proj``, ``gate/up/down_proj``
or ``gate_up_proj``: :func:`quantized_layer_names`). The embedding, the LM head, the layer norms, a
mixture-of-experts router (``mlp.gate``) and fused experts (3-D parameters, not ``nn.Linear``) stay
dense. The oracle is a dense fp32 model holding each quantized layer's dequantized weight
(:func:`dequantized_model`), so a served row is checked against the base weights it really computes
with, at the fp32 tolerance.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ..layers.dense_weight import dense_weight
from ..models import TinyConfig, TinyDecoder
from .errors import UsageError

__all__ = ["INT4_GROUP_SIZE", "QUANTIZATIONS", "Quantization", "check_quantization", "dequantized_model",
           "quantize_model", "quantized_layer_names"]

INT4_GROUP_SIZE = 32
"""Input features per scale and zero point of ``--quantize int4``."""


@dataclass(frozen=True)
class Quantization:
    """One ``--quantize`` choice.

    ``library``/``package``: the module imported and the package that provides it (``None``: no
    library). ``describe``: what the base layers are, for the help, the table header and the JSON.
    ``quantize(layer)``: a quantized layer computing what ``layer`` (an fp32 ``nn.Linear`` on the
    host) computes, its weight stored quantized (read back dense by
    :func:`lora_layers.layers.dense_weight.dense_weight`, as DoRA's norm is). ``group_size``: when set,
    each quantized layer's ``in_features`` must be a multiple of it. ``not_simulated``: why the graph
    simulator (``cpu-graphsim``) cannot judge a capture of these layers, whose rows there are then
    skipped with it as the reason; ``None`` when it can.
    """

    name: str
    library: str | None
    package: str | None
    describe: str
    quantize: Callable[[nn.Linear], nn.Module]
    group_size: int | None = None
    not_simulated: str | None = None


def _import(library: str):
    """``library`` imported with log records below ERROR dropped meanwhile: at import torchao logs
    warnings about its CUDA extensions that do not load on a CPU machine (and torch one about an
    enum torchao registers), bitsandbytes about a missing optional bf16 CPU kernel package; lora-sim
    uses none of them (see :func:`_bnb_4bit`), and its errors must stay one line."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        return importlib.import_module(library)
    finally:
        logging.disable(previous)


def _torchao(config_of: Callable[[], object]) -> Callable[[nn.Linear], nn.Module]:
    def quantize(layer: nn.Linear) -> nn.Module:
        quantization = _import("torchao.quantization")
        quantization.quantize_(layer, config_of())  # the weight becomes a quantized tensor; the layer stays nn.Linear
        return layer
    return quantize


def _int8_config() -> object:
    return _import("torchao.quantization").Int8WeightOnlyConfig()


def _int4_config() -> object:
    granularity = _import("torchao.quantization.granularity")
    return _import("torchao.quantization").IntxWeightOnlyConfig(weight_dtype=torch.int4,
                                                                granularity=granularity.PerGroup(INT4_GROUP_SIZE))


def _bnb_4bit(quant_type: str) -> Callable[[nn.Linear], nn.Module]:
    """A ``bnb.nn.Linear4bit`` of ``quant_type`` (``"nf4"``/``"fp4"``, blocks of 64) computing in fp32.

    bitsandbytes' CPU forward in eval mode without gradients, on a CPU with AVX512-BF16, repacks
    the weight and computes in bfloat16 (activations and block scales rounded to bf16): not an fp32
    computation, and one that depends on the CPU. lora-sim turns that path off for its layers
    (``support_avx512bf16_for_cpu = False``), so each forward dequantizes the 4-bit weight to fp32
    and multiplies in fp32, on every CPU and in train and eval mode alike.
    """

    def quantize(layer: nn.Linear) -> nn.Module:
        bnb = _import("bitsandbytes")
        quantized = bnb.nn.Linear4bit(layer.in_features, layer.out_features, bias=layer.bias is not None,
                                      compute_dtype=torch.float32, quant_type=quant_type, device="cpu")
        quantized.weight = bnb.nn.Params4bit(layer.weight.data.clone(), requires_grad=False, quant_type=quant_type)
        if layer.bias is not None:
            quantized.bias = nn.Parameter(layer.bias.data.clone(), requires_grad=False)
        if hasattr(layer, "output_sizes"):  # a fused layer's slice widths (lora_layers.packing reads them)
            quantized.output_sizes = layer.output_sizes
        quantized.support_avx512bf16_for_cpu = False
        return quantized.to("cpu")  # Params4bit quantizes when moved

    return quantize


def _unquantized(layer: nn.Linear) -> nn.Module:
    return layer


_BNB_NOT_SIMULATED = ("bitsandbytes' 4-bit matmul is an opaque custom op (bitsandbytes::gemm_4bit): the graph "
                      "simulator cannot see its host logic, so only real graph hardware can say whether it captures")

QUANTIZATIONS: dict[str, Quantization] = {q.name: q for q in (
    Quantization("none", None, None, "fp32 (not quantized)", _unquantized),
    Quantization("int8", "torchao", "torchao",
                 "torchao int8 weight-only (Int8WeightOnlyConfig: symmetric, one scale per output row)",
                 _torchao(_int8_config)),
    Quantization("int4", "torchao", "torchao",
                 f"torchao int4 weight-only values (IntxWeightOnlyConfig, weight_dtype int4: symmetric, "
                 f"one scale per {INT4_GROUP_SIZE} input features; values -8..7 stored one per int8 byte)",
                 _torchao(_int4_config), group_size=INT4_GROUP_SIZE),
    Quantization("nf4", "bitsandbytes", "bitsandbytes",
                 "bitsandbytes Linear4bit NF4 (blocks of 64, fp32 compute)", _bnb_4bit("nf4"),
                 not_simulated=_BNB_NOT_SIMULATED),
    Quantization("fp4", "bitsandbytes", "bitsandbytes",
                 "bitsandbytes Linear4bit FP4 (blocks of 64, fp32 compute)", _bnb_4bit("fp4"),
                 not_simulated=_BNB_NOT_SIMULATED),
)}
"""The ``--quantize`` choices by name; ``none`` (the default) serves the fp32 model."""


def quantized_layer_names(config: TinyConfig) -> list[str]:
    """The layers ``--quantize`` replaces in a model of ``config``: each ``nn.Linear`` of the decoder
    layers whose name ends in ``_proj`` (the attention and MLP projections, fused or not), in module
    order (read from a model on the meta device: no memory)."""
    with torch.device("meta"):
        model = TinyDecoder(config)
    return [name for name, module in model.model.layers.named_modules(prefix="model.layers")
            if isinstance(module, nn.Linear) and name.endswith("_proj")]


def check_quantization(choice: str | None, config: TinyConfig) -> Quantization:
    """The :class:`Quantization` of ``--quantize choice`` (``None``: ``none``) for a model of ``config``.

    Raises :class:`UsageError` (one line) for an unknown choice, when its library cannot be
    imported (naming what to install), or when the model's sizes do not fit its group size.
    """
    name = "none" if choice is None else choice
    if name not in QUANTIZATIONS:
        raise UsageError(f"--quantize accepts {', '.join(QUANTIZATIONS)}, got {name!r}")
    quantization = QUANTIZATIONS[name]
    if quantization.library is not None:
        try:
            _import(quantization.library)
        except ImportError:
            raise UsageError(f"--quantize {name} needs {quantization.library}, which is not installed: "
                             f"pip install {quantization.package}") from None
    group = quantization.group_size
    if group is not None:
        sizes = {"hidden_size": config.hidden_size}
        if not config.num_experts:  # a mixture of experts has no dense MLP projection
            sizes["intermediate_size"] = config.intermediate_size
        bad = [f"{key} {value}" for key, value in sizes.items() if value % group]
        if bad:
            raise UsageError(f"--quantize {name} quantizes in groups of {group} input features: "
                             f"{' and '.join(sorted(sizes))} must be multiples of {group} (--model-config), "
                             f"got {', '.join(bad)}")
    return quantization


def quantize_model(model: TinyDecoder, quantization: Quantization) -> TinyDecoder:
    """Replace :func:`quantized_layer_names` of ``model`` (fp32, on the host) in place with
    ``quantization``'s layers; returns ``model``, in eval mode."""
    for name in quantized_layer_names(model.config):
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent)
        setattr(owner, leaf, quantization.quantize(getattr(owner, leaf)))
    return model.eval()


def dequantized_model(quantized: TinyDecoder) -> TinyDecoder:
    """A dense fp32 :class:`TinyDecoder` (on the host) computing what ``quantized`` (made by
    :func:`quantize_model`) computes: the weight of each replaced layer is its dequantized weight
    (:func:`~lora_layers.layers.dense_weight.dense_weight`), every other parameter a copy."""
    dense = TinyDecoder(quantized.config)
    modules = dict(quantized.named_modules())
    replaced = set(quantized_layer_names(quantized.config))
    with torch.no_grad():
        for name, param in dense.named_parameters():
            owner, _, leaf = name.rpartition(".")
            module = modules[owner]
            if owner in replaced and leaf == "weight":
                value = dense_weight(module.weight)
            else:
                value = getattr(module, leaf)
            param.copy_(value.detach().float().cpu())
    return dense.eval()
