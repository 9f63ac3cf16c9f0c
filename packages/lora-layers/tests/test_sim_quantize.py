"""``lora-sim --quantize`` (issue #41): the default workload on a quantized base, every row checked
against fp32 references that hold the dequantized base weights; what the served model stores; the
one-line errors for a missing library, a bad size or a command that takes no ``--quantize``."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from lora_layers import sim
from lora_layers.layers.dense_weight import dense_weight
from lora_layers.models import TinyDecoder
from lora_layers.sim.cli import read_model_config
from lora_layers.sim.quantize import QUANTIZATIONS, dequantized_model, quantize_model, quantized_layer_names

# int4 quantizes groups of 32 input features: hidden_size and intermediate_size are multiples of 32;
# no embedding or LM head shape is a projection's, so that a dense copy of one is told by its shape
CONFIG = '{"vocab_size": 96, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4}'
QUANTIZED = [name for name in QUANTIZATIONS if name != "none"]
BNB = [name for name in QUANTIZED if QUANTIZATIONS[name].library == "bitsandbytes"]
MIXTRAL = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 64,
           "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "vocab_size": 64, "num_local_experts": 4, "num_experts_per_tok": 2}


def _needs_library(name: str) -> None:
    library = QUANTIZATIONS[name].library
    if library is not None:
        pytest.importorskip(library, reason=f"--quantize {name} needs {library} (pip install {library})")


def _run(tmp_path: Path, name: str, *args: str) -> tuple[int, dict]:
    """``lora-sim --quantize name`` on the small model, 2 decode steps, 3 rounds: (exit status, the JSON)."""
    path = tmp_path / f"{name}.json"
    code = sim.main(["--quantize", name, "--model-config", CONFIG, "--decode-steps", "2", "--rounds", "3",
                     "--json", str(path), *args])
    return code, json.loads(path.read_text()) if path.exists() else {}


@pytest.mark.parametrize("name", list(QUANTIZATIONS))
def test_each_choice_serves_the_default_workload_and_every_row_passes(name, tmp_path, capsys):
    _needs_library(name)
    code, document = _run(tmp_path, name, "--device", "cpu", "--device", "cpu-graphsim")
    captured = capsys.readouterr()
    assert code == 0, captured.out
    rows = {(r["backend"], r["device"]): r for r in document["rows"]}
    assert len(rows) == 4 and {r["quantize"] for r in rows.values()} == {name}
    simulated = [r for (_, device), r in rows.items() if device == "cpu-graphsim"]
    ran = [r for r in rows.values() if r not in simulated or QUANTIZATIONS[name].not_simulated is None]
    assert {r["status"] for r in ran} == {"pass"}, [(r["device"], r["reason"]) for r in ran]
    assert all(r["max_abs_error"] < 1e-4 for r in ran)
    if QUANTIZATIONS[name].not_simulated:  # bitsandbytes: the simulator cannot judge its op; said, not failed
        assert {(r["status"], r["reason"]) for r in simulated} == {("skipped", QUANTIZATIONS[name].not_simulated)}
    config, _ = read_model_config(CONFIG)
    layers = quantized_layer_names(config)
    assert document["quantize"] == {"name": name, "describe": QUANTIZATIONS[name].describe,
                                    "layers": [] if name == "none" else layers}
    header = f"base weights: --quantize {name}, {QUANTIZATIONS[name].describe}, on the {len(layers)} projections"
    assert (header if name != "none" else "base weights: fp32 (--quantize none)") in captured.out
    if name != "none":
        assert f"reference models from the dequantized {name} base" in captured.err
        assert f"torch_native / cpu ({name} base): pass" in captured.err


@pytest.mark.parametrize("name", ["int4", "nf4"])
def test_the_compiled_decode_passes_on_a_quantized_base(name, tmp_path, capsys):
    _needs_library(name)
    code, document = _run(tmp_path, name, "--device", "cpu-compile", "--backend", "torch_native",
                             "--compile-backend", "aot_eager")
    assert code == 0, capsys.readouterr().out
    (row,) = document["rows"]
    assert row["status"] == "pass" and row["compiled_decode"]["recompiles"] == 0


@pytest.mark.parametrize("name", QUANTIZED)
def test_checked_against_the_unquantized_reference_the_rows_would_fail(name, tmp_path, capsys, monkeypatch):
    """The check can fail: references of the fp32 weights the base was quantized from, not of its
    dequantized weights, miss the tolerance on every row."""
    _needs_library(name)
    monkeypatch.setattr(sim.run, "dequantized_model", lambda quantized: TinyDecoder(quantized.config))
    code, document = _run(tmp_path, name, "--device", "cpu", "--backend", "torch_native")
    assert code == 1
    (row,) = document["rows"]
    assert row["status"] == "fail" and row["max_abs_error"] > 1e-3, row["max_abs_error"]


@pytest.mark.parametrize("name", QUANTIZED)
def test_the_dequantized_model_computes_what_the_quantized_one_does(name):
    _needs_library(name)
    config, _ = read_model_config(CONFIG)
    quantized = quantize_model(TinyDecoder(config), QUANTIZATIONS[name])
    dense = dequantized_model(quantized)
    ids = torch.randint(0, config.vocab_size, (20,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for _ in range(2):  # a library that changes a layer on its first call (bitsandbytes' CPU repack) shows
            got, want = quantized(ids), dense(ids)
            assert ((got - want).abs().max() / want.abs().max()).item() < 1e-6
        original = TinyDecoder(config)(ids)
    assert ((original - want).abs().max() / want.abs().max()).item() > 1e-3  # the weights really are quantized


@pytest.mark.parametrize("name", BNB)
def test_bitsandbytes_layers_compute_in_fp32_in_eval_mode(name):
    """Regression: bitsandbytes' eval-mode CPU kernel (on AVX512-BF16 machines) repacks the weight on its
    first call and computes in bfloat16, 1e-2 off the fp32 product of the dequantized weight; lora-sim's
    layers stay on the fp32 path, with float32 block scales, in eval mode and without gradients."""
    _needs_library(name)
    config, _ = read_model_config(CONFIG)
    model = quantize_model(TinyDecoder(config), QUANTIZATIONS[name])
    assert not model.training
    layer = model.model.layers[0].mlp.down_proj
    x = torch.randn(5, layer.in_features, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        layer(x)
        got = layer(x)
    weight = dense_weight(layer.weight)
    assert layer.weight.quant_state.dtype == torch.float32
    assert (got - x @ weight.T).abs().max().item() < 1e-5


def _dense_copies(model: nn.Module, shapes: set[tuple[int, int]]) -> list[str]:
    """Every float tensor of ``model`` (parameters, registered buffers, plain tensor attributes of any
    module) whose shape is one of ``shapes``."""
    found = []
    for module_name, module in model.named_modules():
        tensors = {**dict(module.named_parameters(recurse=False)), **dict(module.named_buffers(recurse=False)),
                   **{k: v for k, v in vars(module).items() if isinstance(v, torch.Tensor)}}
        found += [f"{module_name}.{k}" for k, t in tensors.items()
                  if type(t) in (torch.Tensor, nn.Parameter) and t.is_floating_point() and tuple(t.shape) in shapes]
    return found


@pytest.mark.parametrize("name", QUANTIZED)
def test_the_served_model_holds_no_dense_copy_of_a_quantized_weight(name, tmp_path, capsys, monkeypatch):
    _needs_library(name)
    served = []
    real = sim.run.build_multilora

    def build(model, *args, **kwargs):
        served.append(model)
        return real(model, *args, **kwargs)

    monkeypatch.setattr(sim.run, "build_multilora", build)
    code, _ = _run(tmp_path, name, "--device", "cpu", "--backend", "torch_native")
    assert code == 0, capsys.readouterr().out
    (model,) = served
    config, _ = read_model_config(CONFIG)
    modules = dict(model.named_modules())
    shapes = set()
    for layer_name in quantized_layer_names(config):
        layer = getattr(modules[layer_name], "base_layer", modules[layer_name])  # wrapped for LoRA, or not
        shapes.add((layer.out_features, layer.in_features))
        stored = sum(t.numel() * t.element_size() for t in _inner_tensors(layer.weight))
        dense = layer.out_features * layer.in_features * 4
        assert stored < dense / 3, (layer_name, stored, dense)  # int8 or 4-bit values and their scales
    assert _dense_copies(model, shapes) == []


def _inner_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that store ``t`` (a torchao quantized weight by its inner tensors)."""
    if hasattr(t, "__tensor_flatten__"):
        return [inner for key in t.__tensor_flatten__()[0] for inner in _inner_tensors(getattr(t, key))]
    return [t]


def test_a_mixture_of_experts_model_quantizes_its_attention_projections_only(tmp_path, capsys):
    _needs_library("int8")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(MIXTRAL))
    code = sim.main(["--quantize", "int8", "--model-config", str(path), "--device", "cpu", "--backend",
                     "torch_native", "--decode-steps", "2", "--rounds", "3", "--json", str(tmp_path / "r.json")])
    assert code == 0, capsys.readouterr().out
    document = json.loads((tmp_path / "r.json").read_text())
    assert document["quantize"]["layers"] == [f"model.layers.{i}.self_attn.{p}_proj" for i in range(2)
                                              for p in ("qkv", "o")]  # lora-sim's model is fused by default
    assert {r["status"] for r in document["rows"]} == {"pass"}


@pytest.mark.parametrize("name", QUANTIZED)
def test_a_missing_library_is_one_line_and_exit_2_before_anything_runs(name, capsys, monkeypatch):
    library = QUANTIZATIONS[name].library
    monkeypatch.setitem(sys.modules, library, None)  # as if not installed
    assert sim.main(["--quantize", name, "--device", "cpu"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"lora-sim: error: --quantize {name} needs {library}, which is not installed: " \
                           f"pip install {library}\n"


@pytest.mark.parametrize(("args", "message"), [
    (["bench", "--quantize", "int8"], "--quantize is an option of run, not of bench"),
    (["devices", "--quantize", "int8"], "--quantize is not an option of devices"),
    (["--quantize", "int3"], "argument --quantize: invalid choice: 'int3' (choose from 'none', 'int8', 'int4', "
                             "'nf4', 'fp4')"),
])
def test_bad_quantize_input_is_one_line_and_exit_2(args, message, capsys):
    assert sim.main(args) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.splitlines()) == 1


def test_int4_names_the_sizes_that_are_no_multiple_of_its_group(capsys):
    _needs_library("int4")
    assert sim.main(["--quantize", "int4", "--model-config", '{"hidden_size": 48, "num_attention_heads": 4}']) == 2
    assert capsys.readouterr().err == (
        "lora-sim: error: --quantize int4 quantizes in groups of 32 input features: hidden_size and "
        "intermediate_size must be multiples of 32 (--model-config), got hidden_size 48\n")


def test_importing_the_library_adds_no_line_to_an_error():
    """Regression: a fresh process imports torchao for ``--quantize``, and torchao's import logs warnings
    (CUDA extensions that do not load here; torch's about an enum): the error must still be one line."""
    _needs_library("int4")
    done = subprocess.run([sys.executable, "-m", "lora_layers.sim", "--quantize", "int4", "--model-config",
                           '{"hidden_size": 48, "num_attention_heads": 4}'], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("lora-sim: error: --quantize int4 quantizes in groups of 32") \
        and len(done.stderr.splitlines()) == 1, done.stderr


@pytest.mark.parametrize("name", QUANTIZED)
def test_a_quantized_fused_layer_keeps_its_slice_widths(name):
    """``output_sizes`` (the widths of a fused layer's slices, read by lora_layers.packing) survives the
    replacement of the layer, whatever the library."""
    _needs_library(name)
    config, _ = read_model_config(CONFIG)
    assert config.fused
    original = TinyDecoder(config).model.layers[0]
    quantized = quantize_model(TinyDecoder(config), QUANTIZATIONS[name]).model.layers[0]
    assert quantized.self_attn.qkv_proj.output_sizes == original.self_attn.qkv_proj.output_sizes
    assert quantized.mlp.gate_up_proj.output_sizes == original.mlp.gate_up_proj.output_sizes
