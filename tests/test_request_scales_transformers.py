"""Per-request adapter scales (issue #40, part 1) on tiny random transformers models, against PEFT.

The oracle is PEFT, row by row: each row of a mixed batch (adapters at scales 0, 0.3, 1, 1.7 and a
base-model row) equals that row of PEFT's model with only the row's adapter loaded, inside
``peft.helpers.rescale_adapter_scale(model, scale)``. That helper multiplies the ``scaling`` of every
``LoraLayer`` in the model, which in PEFT 0.21 covers every layer kind served here: ``lora.Linear``
(GPT-2's ``Conv1D`` with ``fan_in_fan_out`` included), ``lora.Embedding`` and ``ParamWrapper`` (the
experts' ``target_parameters``); ``ModulesToSaveWrapper`` is not a ``LoraLayer``, so a saved copy is
left unscaled, as lora-kit serves it. The base-model row is the base model itself.

Models: a Llama (an adapter on every linear layer, one on ``embed_tokens`` and ``lm_head``), a Phi3
(fused ``qkv_proj`` / ``gate_up_proj``), a GPT-2 (``Conv1D``, ``fan_in_fan_out``) and a Mixtral with
adapters on its experts (built by tests/test_moe_transformers.py's helpers). Checked: logits on both
backends (relative error <= 1e-4 of the logits' magnitude), greedy ``generate()`` token for token,
scale 0 bit for bit equal to routing the row to ``None``, graph mode captured with batch A and
replayed with batch B (other adapters, scales and split) and ``torch.compile`` without a recompile on
every device parameter, ``modules_to_save`` left unscaled, beam search repeating each prompt's scale
over its beams, and the refusals.
"""

import copy
import importlib.util
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs transformers (tests/requirements.txt)")
peft = pytest.importorskip("peft", reason="needs peft (tests/requirements.txt)")

from peft.helpers import rescale_adapter_scale  # noqa: E402

from lora_core import available_backends  # noqa: E402
from lora_core.testing import TOLERANCES  # noqa: E402
from lora_layers import MultiLoRA  # noqa: E402
from lora_layers.layers import Conv1DWithLoRA, ExpertsWithLoRA  # noqa: E402


def _sibling(name):
    """Another test module of this directory, for its helpers (tests/ is no package: loaded by path)."""
    spec = importlib.util.spec_from_file_location(f"_request_scales_{name}", Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


hf = _sibling("test_transformers")  # _base_model: tiny Llama / GPT-2 (hidden 64, 2 layers, vocab 128)
moe = _sibling("test_moe_transformers")  # _base_model, _save_adapter: tiny Mixtral and its expert adapters
dora = _sibling("test_dora_peft")  # _peft_model: random adapters (B scaled down) saved with PEFT
saved = _sibling("test_modules_to_save")  # _peft_model, _save: adapters whose saved copies differ from the base

BACKENDS = available_backends()
# adapter names must not be substrings of module names: PEFT's save_pretrained filters tensors by name
ADAPTERS = {
    "llama": {
        "wide": dict(r=8, lora_alpha=16, target_modules="all-linear"),
        "edge": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["embed_tokens", "lm_head", "q_proj"]),
    },
    "phi3": {
        "fused": dict(r=8, lora_alpha=16, target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
        "lean": dict(r=4, lora_alpha=12, target_modules=["qkv_proj", "gate_up_proj"], rank_pattern={"gate_up_proj": 2}),
    },
    "gpt2": {
        "attn": dict(r=8, lora_alpha=16, target_modules=["c_attn", "attn.c_proj"], fan_in_fan_out=True),
        "mlp": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["c_fc", "mlp.c_proj", "wte"],
                    fan_in_fan_out=True),
    },
    "mixtral": {name: None for name in moe.ADAPTERS},  # sql, chat, math: built by test_moe_transformers
}
KINDS = sorted(ADAPTERS)
SCALES = [0.3, 1.7, 0.0, 0.5, 1.0]
"""The mixed batch's scales; row 3 is the base-model row (a scale on a base row changes nothing)."""


def _route(kind):
    first, second, *rest = ADAPTERS[kind]
    return [first, second, rest[0] if rest else first, None, second]


def _phi3():
    torch.manual_seed(0)
    config = transformers.Phi3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
                                     pad_token_id=0, bos_token_id=1, eos_token_id=None)
    return transformers.Phi3ForCausalLM(config).eval()


@pytest.fixture(scope="module", params=KINDS)
def served(request, tmp_path_factory):
    """(kind, base model, adapter name -> directory, adapter name -> PEFT model with only it loaded)."""
    kind = request.param
    out = tmp_path_factory.mktemp(f"{kind}-scaled-adapters")
    if kind == "mixtral":
        base = moe._base_model("mixtral")
        for name in ADAPTERS[kind]:
            moe._save_adapter(kind, base, name, out / name)
    else:
        base = _phi3() if kind == "phi3" else hf._base_model(kind)
        dora._peft_model(base, ADAPTERS[kind], out)
    paths = {name: out / name for name in ADAPTERS[kind]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        single = {name: peft.PeftModel.from_pretrained(copy.deepcopy(base), str(path)).eval()
                  for name, path in paths.items()}
    return kind, base, paths, single


def _inputs(base, rows=len(SCALES), length=7):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, base.config.vocab_size, (rows, length), generator=g)
    mask = torch.ones_like(ids)
    for row, pad in [(1, 3), (rows - 1, 1)]:  # two prompts shorter than the others, left padded
        mask[row, :pad] = 0
        ids[row, :pad] = 0
    return ids, mask


def _peft_rows(base, single, route, scales, call):
    """``call(model)`` for each row on its own model: its adapter's PEFT model with the adapter's
    scaling multiplied by the row's scale (``rescale_adapter_scale``), or the base model."""
    outs, cache = [], {}
    for name, scale in zip(route, scales):
        key = (name, None if name is None else float(scale))
        if key not in cache:
            if name is None:
                cache[key] = call(base)
            else:
                with rescale_adapter_scale(single[name], float(scale)):
                    cache[key] = call(single[name])
        outs.append(cache[key])
    return outs


def _rel(got, want):
    """The largest error relative to the largest magnitude of ``want``."""
    return ((got.float().cpu() - want.float().cpu()).abs().max() / want.abs().max()).item()


def _serve(base, paths, backend, device="cpu"):
    model = copy.deepcopy(base).to(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT saves the base embedding / LM head beside their LoRA: ignored
        return model, MultiLoRA.from_adapters(model, paths, backend=backend)


# ------------------------------------------------------------------ logits, generate, scale 0
@pytest.mark.parametrize("backend", BACKENDS)
def test_each_rows_logits_equal_peft_with_the_adapter_rescaled_by_the_rows_scale(backend, served):
    kind, base, paths, single = served
    model, mlora = _serve(base, paths, backend)
    if kind == "gpt2":
        assert isinstance(model.transformer.h[0].attn.c_attn, Conv1DWithLoRA)
    if kind == "mixtral":
        assert any(isinstance(m, ExpertsWithLoRA) for m in mlora.wrapped.values())
    route, (ids, mask) = _route(kind), _inputs(base)
    with torch.no_grad(), mlora.route(route, SCALES):
        got = model(input_ids=ids, attention_mask=mask).logits
    with torch.no_grad():
        logits = lambda m: m(input_ids=ids, attention_mask=mask).logits  # noqa: E731
        want = _peft_rows(base, single, route, SCALES, logits)
        unscaled = _peft_rows(base, single, route, [1.0] * len(route), logits)
    for row, expected in enumerate(want):
        assert _rel(got[row], expected[row]) <= 1e-4, (kind, row, route[row], SCALES[row])
    for row in (0, 1, 2):  # the oracle can tell each of these rows' scale from 1
        assert _rel(want[row][row], unscaled[row][row]) > 1e-3, (kind, row)


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_generate_of_each_row_equals_peft_rescaled_and_scale_0_the_base_model(backend, served):
    kind, base, paths, single = served
    model, mlora = _serve(base, paths, backend)
    first, second = list(ADAPTERS[kind])[:2]
    route, scales = [first, second, first, None], [0.0, 1.7, 0.3, 1.0]
    ids, mask = _inputs(base, rows=4)
    kw = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_logits=True)
    got = mlora.generate(input_ids=ids, attention_mask=mask, adapter_names=route, scales=scales, **kw)
    want = _peft_rows(base, single, route, scales, lambda m: m.generate(input_ids=ids, attention_mask=mask, **kw))
    plain = base.generate(input_ids=ids, attention_mask=mask, **kw)
    for row, expected in enumerate(want):
        assert torch.equal(got.sequences[row], expected.sequences[row]), (kind, row, got.sequences, expected.sequences)
        for step_got, step_want in zip(got.logits, expected.logits, strict=True):
            assert _rel(step_got[row], step_want[row]) <= 1e-4, (kind, row)
    assert torch.equal(got.sequences[0], plain.sequences[0])  # scale 0: the base model's tokens


@pytest.mark.parametrize("backend", BACKENDS)
def test_scale_0_is_bit_for_bit_the_row_routed_to_the_base_model(backend, served):
    kind, base, paths, _ = served
    model, mlora = _serve(base, paths, backend)
    route, (ids, mask) = _route(kind), _inputs(base)
    zero = SCALES.index(0.0)
    as_base = [None if row == zero else name for row, name in enumerate(route)]
    with torch.no_grad():
        with mlora.route(route, SCALES):
            scaled = model(input_ids=ids, attention_mask=mask).logits
        with mlora.route(as_base, SCALES):
            routed = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(scaled[zero], routed[zero])
    torch.testing.assert_close(scaled, routed, rtol=TOLERANCES[torch.float32][0], atol=TOLERANCES[torch.float32][1])


# ------------------------------------------------------------------ graph mode and compile
GRAPH_ROWS, GRAPH_LEN = 4, 5
"""Graph batches run a (4, 5) input without padding: 20 tokens, each request whole rows."""


def _graph_batches(kind):
    """Batch A: a request per row; batch B: another split (its first request two rows), other
    adapters and scales. Each as (seq_lens, adapters, scales, each row's adapter and scale)."""
    first, second, *rest = ADAPTERS[kind]
    third = rest[0] if rest else first
    a = ([5, 5, 5, 5], [first, None, second, third], [0.3, 1.0, 1.7, 0.0])
    b = ([10, 5, 5], [second, first, None], [0.5, 2.0, 0.7])
    rows = lambda batch: [(n, s) for k, n, s in zip(*batch) for _ in range(k // GRAPH_LEN)]  # noqa: E731
    return [(*batch, rows(batch)) for batch in (a, b)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_graph_mode_captured_with_one_batch_of_scales_replays_another_as_eager_and_peft(device, backend, served):
    """Captured (or compiled) with batch A, run with batch B: each equals the eager forward of its
    batch, whose rows equal PEFT's rescaled rows. ``enable_graph(T, scales=True)``; the compile device
    fails on a recompile."""
    kind, base, paths, single = served
    if device.is_graph and kind in ("gpt2", "phi3") and device.name != "cpu-graphsim":
        pytest.skip("captured on the simulator; compiled and on hardware: the Llama's and Mixtral's layer kinds")
    batches = _graph_batches(kind)
    T = GRAPH_ROWS * GRAPH_LEN
    ids = torch.randint(3, base.config.vocab_size, (GRAPH_ROWS, GRAPH_LEN), generator=torch.Generator().manual_seed(2))
    model, mlora = _serve(base, paths, backend, device.torch_device)
    ids_on = ids.to(device.torch_device)
    eager, outs = device.eager_and_replayed(
        lambda i: model(input_ids=i, use_cache=False).logits, [ids_on], lambda: mlora.set_batch(*batches[0][:3]),
        lambda: mlora.set_batch(*batches[1][:3]), lambda: mlora.enable_graph(T, scales=True))
    rtol, atol = TOLERANCES[torch.float32]
    for out, expected, (*_, rows) in zip(outs, eager, batches, strict=True):
        expected = expected.cpu()
        torch.testing.assert_close(out.cpu(), expected, rtol=rtol, atol=atol)
        with torch.no_grad():
            want = _peft_rows(base, single, *zip(*rows), lambda m: m(input_ids=ids, use_cache=False).logits)
        for row, peft_row in enumerate(want):
            assert _rel(expected[row], peft_row[row]) <= 1e-4, (kind, row, rows[row])


# ------------------------------------------------------------------ modules_to_save
def test_a_saved_lm_head_is_the_adapters_whole_copy_unscaled_while_its_lora_deltas_scale(tmp_path):
    """An adapter with ``modules_to_save=["lm_head"]`` at scale 0.5 (and 0, and 1): its rows run through
    its saved LM head as saved, the LoRA deltas of its projections scaled. The oracle is PEFT under
    ``rescale_adapter_scale``, which rescales ``LoraLayer`` modules only: PEFT's ``ModulesToSaveWrapper``
    is none, so its copy is used unscaled (a scaled copy would move these rows' logits by half)."""
    base = hf._base_model("llama")
    adapters = {"keeper": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"])}
    paths = saved._save(saved._peft_model(base, adapters), tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        single = {"keeper": peft.PeftModel.from_pretrained(copy.deepcopy(base), str(paths["keeper"])).eval()}
    model, mlora = _serve(base, paths, "torch_native")
    route, scales = ["keeper", "keeper", "keeper", None], [0.5, 0.0, 1.0, 0.5]
    ids, mask = _inputs(base, rows=4)
    with torch.no_grad():
        with mlora.route(route, scales):
            got = model(input_ids=ids, attention_mask=mask).logits
        want = _peft_rows(base, single, route, scales, lambda m: m(input_ids=ids, attention_mask=mask).logits)
        plain = base(input_ids=ids, attention_mask=mask).logits
    for row, expected in enumerate(want):
        assert _rel(got[row], expected[row]) <= 1e-4, (row, scales[row])
    assert _rel(want[1][1], plain[1]) > 1e-2  # at scale 0 the row still runs through the saved copy
    assert _rel(want[0][0], want[2][0]) > 1e-3  # and its LoRA deltas do scale


# ------------------------------------------------------------------ refusals
def test_refusals_name_the_request_or_the_option(tmp_path):
    base = hf._base_model("llama")
    dora._peft_model(base, {"plain": dict(r=4, lora_alpha=8, target_modules=["q_proj"])}, tmp_path)
    model, mlora = _serve(base, {"plain": tmp_path / "plain"}, "torch_native")
    ids = torch.randint(3, 128, (2, 3), generator=torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match=r"scales\[1\] \(request 1\) must be >= 0, got -0\.5"):
        mlora.set_batch([3, 3], ["plain", None], [1.0, -0.5])
    with pytest.raises(ValueError, match=r"scales\[0\] \(request 0\) must be a finite float, got nan"):
        mlora.set_batch([3, 3], ["plain", None], [float("nan"), 1.0])
    with pytest.raises(ValueError, match=r"scales\[1\] \(request 1\) must be >= 0"), torch.no_grad(), \
            mlora.route(["plain", None], [1.0, -0.5]):
        model(input_ids=ids)
    with pytest.raises(ValueError, match=r"scales\[0\] \(request 0\) must be a finite float"), torch.no_grad(), \
            mlora.route(["plain", None], [float("nan"), 1.0]):
        model(input_ids=ids)
    with pytest.raises(ValueError, match=r"scales must have one entry per request; got 1 for 2 requests"):
        mlora.set_batch([3, 3], ["plain", None], [1.0])
    with pytest.raises(ValueError, match=r"scales must have one entry per request; got 3 for 2 requests"):
        mlora.route(["plain", None], [1.0, 1.0, 1.0]).__enter__()
    beams = dict(num_beams=2, max_new_tokens=1, do_sample=False)  # two rows a prompt: named by the prompt's index
    with pytest.raises(ValueError, match=r"scales\[1\] \(request 1\) must be >= 0, got -0\.5"):
        mlora.generate(input_ids=ids, adapter_names=["plain", None], scales=[1.0, -0.5], **beams)
    mlora.enable_graph(6)
    mlora.set_batch([3, 3], ["plain", None], [1.0, 1.0])  # every scale 1: what a batch without scales applies
    with pytest.raises(ValueError, match=r"built without request scales.*with_scales=True"):
        mlora.set_batch([3, 3], ["plain", None], [0.5, 1.0])


def test_beam_search_repeats_each_prompts_scale_over_its_beams(served):
    kind, base, paths, single = served
    if kind != "llama":
        pytest.skip("one model suffices")
    model, mlora = _serve(base, paths, "torch_native")
    route, scales = ["wide", "edge", "wide"], [0.3, 1.7, 0.0]
    ids, mask = _inputs(base, rows=3)
    kw = dict(max_new_tokens=3, do_sample=False, num_beams=2)
    got = mlora.generate(input_ids=ids, attention_mask=mask, adapter_names=route, scales=scales, **kw)
    want = _peft_rows(base, single, route, scales, lambda m: m.generate(input_ids=ids, attention_mask=mask, **kw))
    for row, expected in enumerate(want):
        assert torch.equal(got[row], expected[row]), (row, got, expected)
