"""Weighted adapter mixes (issue #40, part 2) on tiny random transformers models, against PEFT.

The oracle is PEFT, row by row: a row whose request mixes adapters ``{a: w_a, b: w_b}`` at request
scale ``c`` equals that row of a PEFT model holding both adapters and their
``add_weighted_adapter([a, b], [c * w_a, c * w_b], combination_type="cat")`` (exactly
``sum_i c * w_i * delta_i``: PEFT concatenates ``c * w_i * scaling_i * A_i`` and ``B_i`` at scaling 1);
a row of one adapter is the same with one adapter, a base-model row the base model. One lora-kit
batch holds every kind of row at once. (PEFT 0.21's ``cat`` copies the first adapter's config with
``lora_alpha = r``, ``use_rslora`` included: after an rsLoRA first adapter its scaling is
``sqrt(r)``, not the 1 its concatenated factors assume, so the oracle sets it to 1.)

Models: a Llama (one adapter on every linear layer, the other on ``embed_tokens``, ``lm_head`` and
``q_proj``: a mix of adapters of different ranks that target different modules, rsLoRA in one), a
Phi3 (fused ``qkv_proj`` / ``gate_up_proj``, a ``rank_pattern``) and a GPT-2 (``Conv1D``,
``fan_in_fan_out``). Checked: logits on both backends (relative error <= 1e-4 of the logits'
magnitude), greedy ``generate()`` token for token, graph mode captured with batch A and replayed with
batch B (other mixes, scales and split) and ``torch.compile`` without a recompile on every device
parameter, and the refusals (a mix with a DoRA or ``modules_to_save`` adapter, an unknown or
repeated name, a bad weight, more pairs than the graph batch holds).

A Mixtral's experts (``target_parameters``) are not in PEFT's ``cat`` oracle: PEFT 0.21 refuses to
hold two adapters whose ``target_parameters`` differ in one model ("all adapters must target the same
set of parameters"). Their mixes are checked against the base model with each adapter's PEFT
``merge_and_unload()`` weights added at its weight (``W + sum_i w_i * (M_i - W)``: every delta is
linear in its adapter's factors), and the experts op against the reference math, captured, replayed
and compiled, on every device parameter (tests/test_request_mixes.py).
"""

import copy
import importlib.util
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="needs transformers (tests/requirements.txt)")
peft = pytest.importorskip("peft", reason="needs peft (tests/requirements.txt)")

from lora_core import available_backends  # noqa: E402
from lora_core.testing import TOLERANCES  # noqa: E402


def _sibling(name):
    """Another test module of this directory, for its helpers (tests/ is no package: loaded by path)."""
    spec = importlib.util.spec_from_file_location(f"_request_mixes_{name}", Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


scaled = _sibling("test_request_scales_transformers")  # models, adapters, inputs, _rel, _serve
ops = _sibling("test_request_scales")  # doc_example_namespace
hf, dora, saved = scaled.hf, scaled.dora, scaled.saved

BACKENDS = available_backends()
KINDS = ["gpt2", "llama", "phi3"]


def _route(kind):
    """A mix of both adapters, one adapter, a base row, the mix the other way round at other weights
    (as a list of pairs), a one-adapter mix; and each row's request scale."""
    first, second = scaled.ADAPTERS[kind]
    route = [{first: 0.7, second: 0.3}, first, None, [(second, 1.2), (first, 0.5)], {second: 0.6}]
    return route, [1.0, 0.5, 1.0, 0.8, 1.5]


def _weighted(entry, scale):
    """A route entry as ``(names, weights)`` at its request scale (``None``: the base model)."""
    if entry is None:
        return None
    items = [(entry, 1.0)] if isinstance(entry, str) else list(entry.items()) if isinstance(entry, dict) else entry
    return tuple(name for name, _ in items), tuple(float(scale) * w for _, w in items)


class PeftMixes:
    """PEFT models holding every adapter of ``paths``, with one ``cat`` adapter per (names, weights)."""

    def __init__(self, base, paths):
        self.base, self.paths, self._models = base, paths, {}

    def model(self, names, weights):
        key = tuple(sorted(names))
        if key not in self._models:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = peft.PeftModel.from_pretrained(copy.deepcopy(self.base), str(self.paths[key[0]]),
                                                       adapter_name=key[0]).eval()
                for name in key[1:]:
                    model.load_adapter(str(self.paths[name]), adapter_name=name)
            self._models[key] = (model, {})
        model, mixes = self._models[key]
        if (names, weights) not in mixes:
            mixes[(names, weights)] = mixed = f"mix{len(mixes)}"
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model.add_weighted_adapter(list(names), list(weights), mixed, combination_type="cat")
            for layer in model.modules():  # PEFT 0.21's cat keeps the first adapter's use_rslora, so its
                if isinstance(layer, peft.tuners.lora.LoraLayer) and mixed in layer.scaling:  # scaling is
                    layer.scaling[mixed] = 1.0  # sqrt(r) for an rsLoRA first adapter: cat's sum needs 1
        model.set_adapter(mixes[(names, weights)])
        return model

    def rows(self, route, scales, call):
        """``call(model)`` for each row on its own model: the base model, or the PEFT ``cat`` mix."""
        outs = []
        for entry, scale in zip(route, scales):
            weighted = _weighted(entry, scale)
            outs.append(call(self.base if weighted is None else self.model(*weighted)))
        return outs


@pytest.fixture(scope="module", params=KINDS)
def served(request, tmp_path_factory):
    """(kind, base model, adapter name -> directory, PeftMixes)."""
    kind = request.param
    out = tmp_path_factory.mktemp(f"{kind}-mixed-adapters")
    base = scaled._phi3() if kind == "phi3" else hf._base_model(kind)
    dora._peft_model(base, scaled.ADAPTERS[kind], out)
    paths = {name: out / name for name in scaled.ADAPTERS[kind]}
    return kind, base, paths, PeftMixes(base, paths)


# ------------------------------------------------------------------ logits and generate
@pytest.mark.parametrize("backend", BACKENDS)
def test_each_rows_logits_equal_pefts_cat_mix_of_its_adapters(backend, served):
    kind, base, paths, oracle = served
    model, mlora = scaled._serve(base, paths, backend)
    (route, scales), (ids, mask) = _route(kind), scaled._inputs(base)
    with torch.no_grad(), mlora.route(route, scales):
        got = model(input_ids=ids, attention_mask=mask).logits
    with torch.no_grad():
        logits = lambda m: m(input_ids=ids, attention_mask=mask).logits  # noqa: E731
        want = oracle.rows(route, scales, logits)
        first_only = oracle.rows([next(iter(e)) if isinstance(e, dict) else e for e in route], scales, logits)
    for row, expected in enumerate(want):
        assert scaled._rel(got[row], expected[row]) <= 1e-4, (kind, row, route[row], scales[row])
    assert scaled._rel(want[0][0], first_only[0][0]) > 1e-3  # the oracle tells a mix from its first adapter


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_generate_of_each_mixed_row_equals_peft(backend, served):
    kind, base, paths, oracle = served
    model, mlora = scaled._serve(base, paths, backend)
    first, second = scaled.ADAPTERS[kind]
    route, scales = [{first: 0.6, second: 0.9}, second, None, [(second, 0.4), (first, 1.1)]], [1.0, 1.0, 1.0, 0.7]
    ids, mask = scaled._inputs(base, rows=4)
    kw = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_logits=True)
    got = mlora.generate(input_ids=ids, attention_mask=mask, adapter_names=route, scales=scales, **kw)
    want = oracle.rows(route, scales, lambda m: m.generate(input_ids=ids, attention_mask=mask, **kw))
    for row, expected in enumerate(want):
        assert torch.equal(got.sequences[row], expected.sequences[row]), (kind, row, got.sequences, expected.sequences)
        for step_got, step_want in zip(got.logits, expected.logits, strict=True):
            assert scaled._rel(step_got[row], step_want[row]) <= 1e-4, (kind, row)


def test_beam_search_repeats_each_prompts_mix_over_its_beams(served):
    kind, base, paths, oracle = served
    if kind != "llama":
        pytest.skip("one model suffices")
    model, mlora = scaled._serve(base, paths, "torch_native")
    route, scales = [{"wide": 0.5, "edge": 1.5}, "edge", [("edge", 0.2), ("wide", 0.8)]], [1.0, 0.7, 1.0]
    ids, mask = scaled._inputs(base, rows=3)
    kw = dict(max_new_tokens=3, do_sample=False, num_beams=2)
    got = mlora.generate(input_ids=ids, attention_mask=mask, adapter_names=route, scales=scales, **kw)
    want = oracle.rows(route, scales, lambda m: m.generate(input_ids=ids, attention_mask=mask, **kw))
    for row, expected in enumerate(want):
        assert torch.equal(got[row], expected[row]), (row, got, expected)


# ------------------------------------------------------------------ graph mode and compile
GRAPH_ROWS, GRAPH_LEN = 4, 5


def _graph_batches(kind):
    """Batch A: a request per row, one of them a mix; batch B: another split (its first request two
    rows, a mix), another mix and other scales. Each as (seq_lens, adapters, scales, each row's entry
    and scale). A has 5 pair rows, B 15: the graph batch holds 20 + 15."""
    first, second = scaled.ADAPTERS[kind]
    a = ([5, 5, 5, 5], [{first: 0.4, second: 1.3}, None, second, first], [1.0, 1.0, 1.7, 0.0])
    b = ([10, 5, 5], [[(second, 0.5), (first, 0.5)], first, {second: 0.9, first: 0.2}], [1.0, 2.0, 0.7])
    rows = lambda batch: [(e, s) for k, e, s in zip(*batch) for _ in range(k // GRAPH_LEN)]  # noqa: E731
    return [(*batch, rows(batch)) for batch in (a, b)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_graph_mode_captured_with_one_batch_of_mixes_replays_another_as_eager_and_peft(device, backend, served):
    """Captured (or compiled) with batch A, run with batch B: each equals the eager forward of its batch,
    whose rows equal PEFT's; ``enable_graph(T, max_pairs=T + 15)``; the compile device fails on a recompile."""
    kind, base, paths, oracle = served
    if device.is_graph and kind != "llama" and device.name != "cpu-graphsim":
        pytest.skip("captured on the simulator; compiled and on hardware: the Llama's layer kinds")
    batches = _graph_batches(kind)
    T = GRAPH_ROWS * GRAPH_LEN
    ids = torch.randint(3, base.config.vocab_size, (GRAPH_ROWS, GRAPH_LEN), generator=torch.Generator().manual_seed(2))
    model, mlora = scaled._serve(base, paths, backend, device.torch_device)
    eager, outs = device.eager_and_replayed(
        lambda i: model(input_ids=i, use_cache=False).logits, [ids.to(device.torch_device)],
        lambda: mlora.set_batch(*batches[0][:3]), lambda: mlora.set_batch(*batches[1][:3]),
        lambda: mlora.enable_graph(T, max_pairs=T + 15))
    rtol, atol = TOLERANCES[torch.float32]
    for out, expected, (*_, rows) in zip(outs, eager, batches, strict=True):
        expected = expected.cpu()
        torch.testing.assert_close(out.cpu(), expected, rtol=rtol, atol=atol)
        with torch.no_grad():
            want = oracle.rows(*zip(*rows), lambda m: m(input_ids=ids, use_cache=False).logits)
        for row, peft_row in enumerate(want):
            assert scaled._rel(expected[row], peft_row[row]) <= 1e-4, (kind, row, rows[row])


# ------------------------------------------------------------------ refusals
def test_refusals_name_the_request_and_the_adapter(tmp_path):
    base = hf._base_model("llama")
    dora._peft_model(base, {"plain": dict(r=4, lora_alpha=8, target_modules=["q_proj"]),
                            "other": dict(r=2, lora_alpha=4, target_modules=["v_proj"]),
                            "norm": dict(r=4, lora_alpha=8, target_modules=["q_proj"], use_dora=True)}, tmp_path)
    keeper = {"keeper": dict(r=4, lora_alpha=8, target_modules=["q_proj"], modules_to_save=["lm_head"])}
    paths = {name: tmp_path / name for name in ("plain", "other", "norm")}
    paths.update(saved._save(saved._peft_model(base, keeper), tmp_path / "saved"))
    model, mlora = scaled._serve(base, paths, "torch_native")
    ids = torch.randint(3, 128, (2, 3), generator=torch.Generator().manual_seed(3))
    cases = [
        ([{}, None], r"adapters\[0\] \(request 0\): a mix must name at least one adapter, got \{\}"),
        ([None, {"plain": 0.5, "nope": 0.5}], r"adapters\[1\] \(request 1\): adapter 'nope' is not loaded"),
        ([[("plain", 0.5), ("plain", 0.5)], None], r"adapters\[0\] \(request 0\): adapter 'plain' is named twice"),
        ([{"plain": -0.5, "other": 1.0}, None], r"adapters\[0\] \(request 0\): the weight of adapter 'plain' must be >= 0, "
                                                r"got -0\.5"),
        ([{"plain": float("nan")}, None], r"adapters\[0\] \(request 0\): the weight of adapter 'plain' must be a finite "
                                          r"float, got nan"),
        ([{"plain": 0.5, None: 0.5}, None], r"adapters\[0\] \(request 0\): a mix names loaded adapters, got None"),
        ([None, {"plain": 0.5, "norm": 0.5}], r"adapters\[1\] \(request 1\): adapter 'norm' cannot be mixed with "
                                              r"others: a DoRA adapter's norm is not linear in its delta"),
        ([{"keeper": 0.5, "plain": 0.5}, None], r"adapters\[0\] \(request 0\): adapter 'keeper' cannot be mixed "
                                                r"with others: it replaces whole modules \(modules_to_save\)"),
        ([3, None], r"adapters\[0\] \(request 0\) must be an adapter name, None or a weighted mix"),
    ]
    for adapters, message in cases:
        with pytest.raises((ValueError, TypeError), match=message):
            mlora.set_batch([3, 3], adapters)
        with pytest.raises((ValueError, TypeError), match=message):
            mlora.route(adapters).__enter__()
    with torch.no_grad(), mlora.route([{"norm": 0.5}, {"keeper": 2.0}]):  # one adapter: a scale, not a mix
        model(input_ids=ids)
    mlora.enable_graph(6, max_pairs=8)
    mlora.set_batch([2, 4], [{"plain": 0.5, "other": 0.5}, "plain"])
    with pytest.raises(ValueError, match=r"request 1's mix brings the batch to 6 \(token, adapter\) "
                                         r"pairs beyond one per token, more than this graph batch holds \(max_pairs - "
                                         r"max_tokens = 2\); build it with max_pairs >= 12"):
        mlora.set_batch([2, 4], [{"plain": 0.5, "other": 0.5}, {"other": 1.0, "plain": 1.0}])


# ------------------------------------------------------------------ experts (Mixtral)
def _merged_mix(base, merged, mix):
    """The base model with the weights ``W + sum_i w_i * (M_i - W)``: ``mix`` is ``{name: weight}``
    (weights at the request's scale) and ``M_i`` adapter ``i``'s PEFT ``merge_and_unload()`` weights.
    Every delta is linear in its adapter's factors, so this is the mix's model (PEFT cannot build
    ``add_weighted_adapter`` for adapters whose ``target_parameters`` differ)."""
    state = {key: value.clone() for key, value in base.state_dict().items()}
    for name, weight in mix.items():
        for key, value in merged[name].items():
            state[key] += weight * (value - base.state_dict()[key])
    model = copy.deepcopy(base)
    model.load_state_dict(state)
    return model


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_mixtral_experts_mix_equals_the_base_model_with_its_adapters_merged_at_their_weights(backend, tmp_path):
    """Adapters on a Mixtral's fused experts (``target_parameters``, other ranks, rsLoRA, ``alpha_pattern``)
    mixed with each other: each row's logits against the base model with the row's adapters merged by
    PEFT (``merge_and_unload``) at their weights times the row's scale, summed."""
    moe = scaled.moe
    base = moe._base_model("mixtral")
    for name in moe.ADAPTERS:
        moe._save_adapter("mixtral", base, name, tmp_path / name)
    paths = {name: tmp_path / name for name in moe.ADAPTERS}
    merged = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, path in paths.items():
            merged[name] = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(path)).merge_and_unload().state_dict()
    model, mlora = scaled._serve(base, paths, backend)
    route = [{"sql": 0.7, "chat": 0.3}, "math", None, [("chat", 1.2), ("math", 0.5), ("sql", 0.4)]]
    scales = [1.0, 0.5, 1.0, 0.8]
    ids, mask = scaled._inputs(base, rows=4)
    with torch.no_grad(), mlora.route(route, scales):
        got = model(input_ids=ids, attention_mask=mask).logits
    for row, (entry, scale) in enumerate(zip(route, scales)):
        names, weights = _weighted(entry, scale) if entry is not None else ((), ())
        with torch.no_grad():
            want = _merged_mix(base, merged, dict(zip(names, weights)))(input_ids=ids, attention_mask=mask).logits
        assert scaled._rel(got[row], want[row]) <= 1e-4, (row, entry)
    with torch.no_grad():
        first_only = _merged_mix(base, merged, {"sql": 0.7})(input_ids=ids, attention_mask=mask).logits
    assert scaled._rel(got[0], first_only[0]) > 1e-3  # the oracle tells the mix from its first adapter


def test_the_example_of_request_mixes_md_runs(tmp_path):
    """docs/request-mixes.md's block, on a tiny Llama with two PEFT adapters named as there: it runs, and
    its graph batch holds the pairs it asked for."""
    namespace = ops.doc_example_namespace(tmp_path, "request-mixes.md")
    assert namespace["out"].shape == (3, 12)
    assert namespace["mlora"].backend.batch_info.pair_capacity == 32
