"""DoRA's per-row rescale (``LoRABackend.run_dora_scale``) and the DoRA layers, on every backend and device.

* the op against ``lora_core.dora.reference_dora_scale``: random shapes, slots
  without DoRA (factor 1) and rows on slot -1, with and without a bias, every
  token or the pruned LM-head rows; graph devices capture batch A and replay B,
  compiled devices compile once (``cpu-compile``: no recompile on the refill);
* the op launches the same kernels whatever the segments and slots, and reads
  nothing on the host;
* linear (with a bias), packed gate_up (DoRA on one slice only), GPT-2
  ``Conv1D`` and embedding (PEFT's ``DoraEmbeddingLayer``, out-of-vocabulary ids) layers with mixed ranks (0 included), garbage beyond every rank and
  slot -1 rows, against the per-row DoRA math of lora_core (factors computed once
  at load: ``lora_core.dora.dora_factor``);
* the factors follow the slots (replace, unload), and DoRA is refused where it
  is not served: tensor parallelism, a layer built without ``dora=True``.
"""

import random

import pytest
import torch
from torch import nn

from lora_core import available_backends, get_backend
from lora_core.adapters import LoRAModuleWeights
from lora_core.dora import (dora_factor, dora_terms, no_dora_terms, reference_dora_scale, reference_scaled_dora,
                            scaled_dora)
from lora_core.testing import (BatchPair, TOLERANCES, assert_close_to_reference, count_launches,
                               fill_embedding_garbage, fill_linear_garbage, make_batch_info, random_batch_pair, random_ranks)
from lora_layers.layers import EmbeddingWithLoRA, LinearWithLoRA, LoRAContext, WHOLE_MODULE
from lora_layers.parallel import TensorParallel

BACKENDS = available_backends()


def _factors(gen, num_slots, out, dora_slots):
    """``(L, out)`` float32: random factors around 1 for ``dora_slots``, exactly 1 elsewhere."""
    f = torch.ones(num_slots, out)
    for s in dora_slots:
        f[s] = torch.rand(out, generator=gen) + 0.5
    return f


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", range(3))
def test_dora_scale_matches_the_reference(device, backend, case):
    rng, gen = random.Random(case), torch.Generator().manual_seed(case)
    num_slots, out, T = rng.choice([(1, 5, 7), (4, 24, 33), (6, 40, 64)])
    ranks = random_ranks(rng, num_slots, 8)
    pair = random_batch_pair(rng, T, ranks)
    dev = device.torch_device
    factors = _factors(gen, num_slots, out, range(0, num_slots, 2)).to(dev)
    bias = (torch.randn(out, generator=gen) if case != 1 else None)
    bias_dev = None if bias is None else bias.to(dev)
    output = (torch.randn(T, out, generator=gen) * 3).to(dev)
    be = get_backend(backend)(dev)

    def scale(info, output):
        be.prepare_batch(info)
        return be.run_dora_scale(output.clone(), factors, bias_dev)

    out_a, out_b = pair.run(device, scale, output)
    for got, ref in zip((out_a, out_b), pair.reference_infos()):
        assert_close_to_reference(got, reference_dora_scale(output, factors, ref, bias))


@pytest.mark.parametrize("case", range(3))
def test_scaled_dora_matches_the_reference_at_each_rows_scale(device, case):
    """DoRA's rescale at each row's request scale (``factor(c) = m / ||W + c*s*B@A||``), from the
    per-slot terms; slot -1 rows untouched; captured with batch A, replayed with B's scales."""
    rng, gen = random.Random(case), torch.Generator().manual_seed(case)
    num_slots, out, in_features, T = rng.choice([(1, 5, 3, 7), (4, 24, 16, 33), (6, 40, 8, 64)])
    ranks = random_ranks(rng, num_slots, 8)
    pair = random_batch_pair(rng, T, ranks, scaled=True)
    dev = device.torch_device
    terms = no_dora_terms(num_slots, out, "cpu")
    for slot in range(0, num_slots, 2):  # DoRA on every other slot
        w, a, b = torch.randn(out, in_features, generator=gen), torch.randn(4, in_features, generator=gen), \
            torch.randn(out, 4, generator=gen)
        terms[slot] = dora_terms(w, a, b, 0.5, torch.rand(out, generator=gen) + 0.5)
        c = 1.7  # the terms give PEFT's factor at any scale: the norm of the scaled weight
        m, n0, n1, n2 = terms[slot]
        assert torch.allclose(m / torch.sqrt(n0 + 2 * c * n1 + c * c * n2), dora_factor(w, a, b, 0.5 * c, m), rtol=1e-5)
    terms = terms.to(dev)
    bias = torch.randn(out, generator=gen) if case != 1 else None
    bias_dev = None if bias is None else bias.to(dev)
    output = (torch.randn(T, out, generator=gen) * 3).to(dev)

    def scale(info, output):
        return scaled_dora(output.clone(), terms, info, bias_dev)

    out_a, out_b = pair.run(device, scale, output)
    for got, ref in zip((out_a, out_b), pair.reference_infos()):
        assert_close_to_reference(got, reference_scaled_dora(output, terms, ref, bias))
        slots = ref.token_slots_cpu[:T]
        assert torch.equal(got.cpu()[slots < 0], output.cpu()[slots < 0])  # base rows untouched


@pytest.mark.parametrize("backend", BACKENDS)
def test_dora_scale_on_the_pruned_lm_head_rows(device, backend):
    gen = torch.Generator().manual_seed(5)
    pair = BatchPair([4, 0, 2], ([3, 0, 5, 2], [0, 1, None, 2]), ([1, 4, 4, 1], [2, None, 0, 0]))
    dev = device.torch_device
    factors = _factors(gen, 3, 16, [0, 2]).to(dev)
    rows = torch.randn(3, 16, generator=gen).to(dev)  # one row per non-empty request: 3 in A and 4 in B
    rows_b = torch.randn(4, 16, generator=gen).to(dev)
    be = get_backend(backend)(dev)

    def scale(info, rows_a, rows_b):
        be.prepare_batch(info)
        rows = rows_a if info.lm_head_view(pruned=True).num_tokens == 3 else rows_b
        return be.run_dora_scale(rows.clone(), factors, pruned=True)

    if device.is_graph:
        pytest.skip("a pruned view's row count is fixed by the capture; graph batches use every row")
    out_a, out_b = pair.run(device, scale, rows, rows_b)
    ref_a, ref_b = (info.lm_head_view(pruned=True) for info in pair.reference_infos())
    assert_close_to_reference(out_a, reference_dora_scale(rows, factors, ref_a))
    assert_close_to_reference(out_b, reference_dora_scale(rows_b, factors, ref_b))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("use_graph", [False, True], ids=["eager", "graph"])
def test_dora_scale_launches_do_not_depend_on_segments_or_slots(backend, use_graph):
    counts = set()
    for num_segments in (1, 8, 64):
        for num_slots in (1, 8):
            info = make_batch_info([64 // num_segments] * num_segments, [s % num_slots for s in range(num_segments)],
                                   [4] * num_slots, device="cpu", use_graph=use_graph)
            be = get_backend(backend)("cpu")
            be.prepare_batch(info)
            launch = count_launches(be.run_dora_scale, torch.randn(64, 32), torch.ones(num_slots, 32),
                                    torch.randn(32))
            assert launch.host_reads == 0
            counts.add(launch.ops)
    assert len(counts) == 1, counts


def test_dora_scale_rejects_bad_inputs_by_name():
    be = get_backend("torch_native")("cpu")
    be.prepare_batch(make_batch_info([2, 3], [0, None], [4, 2], device="cpu"))
    out = torch.randn(5, 6)
    with pytest.raises(ValueError, match=r"factors must be float32 of shape \(2, 6\)"):
        be.run_dora_scale(out, torch.ones(3, 6))
    with pytest.raises(ValueError, match=r"factors must be float32"):
        be.run_dora_scale(out, torch.ones(2, 6, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"bias must have shape \(6,\)"):
        be.run_dora_scale(out, torch.ones(2, 6), torch.ones(5))
    with pytest.raises(ValueError, match="output has 4 rows but the batch info was built for 5 tokens"):
        be.run_dora_scale(out[:4], torch.ones(2, 6))


# ------------------------------------------------------------------ layers
L, R, IN = 4, 6, 12


def _conv1d(in_features, out_features, gen):
    transformers = pytest.importorskip("transformers", reason="needs transformers (tests/requirements.txt)")
    conv = transformers.pytorch_utils.Conv1D(out_features, in_features)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(in_features, out_features, generator=gen) / IN**0.5)
        conv.bias.copy_(torch.randn(out_features, generator=gen))
    return conv


def _layer(kind, context, gen):
    if kind == "conv1d":
        from lora_layers.layers import Conv1DWithLoRA

        base = _conv1d(IN, 20, gen)
        return Conv1DWithLoRA(base, context), base.weight.T, base.bias
    base = nn.Linear(IN, 20, bias=kind == "linear")
    with torch.no_grad():
        base.weight.copy_(torch.randn(20, IN, generator=gen) / IN**0.5)
    widths = [8, 12] if kind == "gate_up" else None
    return LinearWithLoRA(base, context, widths), base.weight, base.bias


def _module(gen, r, out, scaling, dora):
    a = torch.randn(r, IN, generator=gen) / IN**0.5
    b = torch.randn(out, r, generator=gen) * 0.3
    m = torch.rand(out, generator=gen) + 0.5 if dora else None
    return LoRAModuleWeights("m", "linear", a, b, scaling, m)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["linear", "gate_up", "conv1d"])
def test_dora_layers_match_the_per_row_dora_math(device, backend, kind):
    gen = torch.Generator().manual_seed(7)
    ranks = [4, 0, 6, 1]  # slot 1: no adapter; slots 0 and 3 DoRA, slot 2 plain LoRA
    scalings = [2.0, 1.0, 0.5, 3.0]
    be = get_backend(backend)(device.torch_device)
    context = LoRAContext(be, num_slots=L, max_rank=R, dtype=torch.float32, device=device.torch_device, dora=True)
    layer, weight, bias = _layer(kind, context, gen)
    offsets = [0, 8, 20] if kind == "gate_up" else [0, 20]
    parts_by_slot = {}
    for slot, (r, s) in enumerate(zip(ranks, scalings)):
        if r == 0:
            continue
        dora = slot in (0, 3)
        if kind == "gate_up":  # slot 0: DoRA on the gate slice only (PEFT: gate_proj with DoRA, up_proj without)
            parts = {0: _module(gen, r, 8, s, dora), 1: _module(gen, r, 12, s, dora and slot == 3)}
        else:
            parts = {WHOLE_MODULE: _module(gen, r, 20, s, dora)}
        layer.load_slot(slot, parts, s)
        parts_by_slot[slot] = parts
    fill_linear_garbage(layer.buffers.a, layer.buffers.b, ranks, layer.num_slices)
    layer.to(device.torch_device)
    pair = BatchPair(ranks, ([3, 4, 2, 5, 6], [0, None, 2, 3, 1]), ([6, 6, 4, 4], [3, 2, None, 0]), scalings=scalings)
    x = torch.randn(pair.num_tokens, IN, generator=gen)

    def forward(info, x):
        be.prepare_batch(info)
        return layer(x)

    out_a, out_b = pair.run(device, forward, x.to(device.torch_device))
    for got, ref in zip((out_a, out_b), pair.reference_infos()):
        want = x @ weight.detach().T + (0 if bias is None else bias.detach())
        for t, slot in enumerate(ref.token_slots_cpu.tolist()):
            if slot < 0 or slot not in parts_by_slot:
                continue
            for i, w in parts_by_slot[slot].items():
                lo, hi = (0, 20) if i == WHOLE_MODULE else (offsets[i], offsets[i + 1])
                row = want[t, lo:hi] + w.scaling * (w.lora_b @ (w.lora_a @ x[t]))
                if w.magnitude is not None:
                    f = dora_factor(weight.detach()[lo:hi], w.lora_a, w.lora_b, w.scaling, w.magnitude)
                    b = 0 if bias is None else bias.detach()[lo:hi]
                    row = f * (row - b) + b
                want[t, lo:hi] = row
        assert_close_to_reference(got, want.detach())


def test_factors_follow_the_slots_and_are_computed_at_load():
    gen = torch.Generator().manual_seed(3)
    be = get_backend("torch_native")("cpu")
    context = LoRAContext(be, num_slots=2, max_rank=R, dtype=torch.float32, device="cpu", dora=True)
    layer, weight, _ = _layer("linear", context, gen)
    first, second = _module(gen, 4, 20, 2.0, True), _module(gen, 2, 20, 1.0, True)
    layer.load_slot(1, {WHOLE_MODULE: first}, 2.0)
    torch.testing.assert_close(layer.dora_factors[1], dora_factor(weight, first.lora_a, first.lora_b, 2.0,
                                                                  first.magnitude))
    assert torch.equal(layer.dora_factors[0], torch.ones(20))
    layer.load_slot(1, {WHOLE_MODULE: second}, 1.0)  # replaced: the new adapter's factors
    torch.testing.assert_close(layer.dora_factors[1], dora_factor(weight, second.lora_a, second.lora_b, 1.0,
                                                                  second.magnitude))
    layer.load_slot(1, {WHOLE_MODULE: _module(gen, 4, 20, 2.0, False)}, 2.0)  # a plain adapter: factor 1
    assert torch.equal(layer.dora_factors[1], torch.ones(20))
    layer.load_slot(1, {WHOLE_MODULE: first}, 2.0)
    layer.reset_lora(1)  # unloaded
    assert torch.equal(layer.dora_factors[1], torch.ones(20))
    be.prepare_batch(make_batch_info([3], [1], [0, 4], device="cpu"))
    launch = count_launches(layer, torch.randn(3, IN))
    assert "aten.linalg_vector_norm.default" not in launch.by_op  # no norm per batch: only at load


def test_dora_is_refused_without_dora_factors_and_under_tensor_parallelism():
    gen = torch.Generator().manual_seed(4)
    be = get_backend("torch_native")("cpu")
    plain = LoRAContext(be, num_slots=2, max_rank=R, dtype=torch.float32, device="cpu")
    layer, _, _ = _layer("linear", plain, gen)
    assert layer.dora_factors is None
    with pytest.raises(ValueError, match=r"MultiLoRA\(\.\.\., dora=True\)"):
        layer.load_slot(0, {WHOLE_MODULE: _module(gen, 4, 20, 1.0, True)}, 1.0)
    from lora_layers.layers import ColumnParallelLinearWithLoRA, RowParallelLinearWithLoRA

    context = LoRAContext(be, num_slots=2, max_rank=R, dtype=torch.float32, device="cpu", dora=True)
    tp = TensorParallel(rank=0, size=2)
    column = ColumnParallelLinearWithLoRA(nn.Linear(IN, 10), context, tp)
    row = RowParallelLinearWithLoRA(nn.Linear(IN // 2, 20), context, tp)
    embedding = EmbeddingWithLoRA(nn.Embedding(10, 20), context, tp=tp)
    with pytest.raises(ValueError, match=r"DoRA is not supported with tensor parallelism \(tp_size = 2\)"):
        embedding.load_slot(0, {WHOLE_MODULE: LoRAModuleWeights("e", "embedding", torch.ones(4, 20),
                                                                torch.ones(20, 4), 1.0, torch.ones(20))}, 1.0)
    for layer in (column, row):
        with pytest.raises(ValueError, match=r"DoRA is not supported with tensor parallelism \(tp_size = 2\)"):
            layer.load_slot(0, {WHOLE_MODULE: _module(gen, 4, 20, 1.0, True)}, 1.0)
        layer.load_slot(0, {WHOLE_MODULE: _module(gen, 4, 20, 1.0, False)}, 1.0)  # plain LoRA still loads


def test_bf16_layer_is_within_the_bf16_tolerance():
    gen = torch.Generator().manual_seed(9)
    be = get_backend("torch_native")("cpu")
    context = LoRAContext(be, num_slots=2, max_rank=R, dtype=torch.bfloat16, device="cpu", dora=True)
    layer, weight, bias = _layer("linear", context, gen)
    w = _module(gen, 4, 20, 2.0, True)
    layer.load_slot(0, {WHOLE_MODULE: w}, 2.0)
    x = torch.randn(5, IN, generator=gen)
    ref_factor = dora_factor(weight, w.lora_a, w.lora_b, 2.0, w.magnitude)
    want = ref_factor * (x @ weight.detach().T + 2.0 * x @ w.lora_a.T @ w.lora_b.T) + bias.detach()
    layer.base_layer.to(torch.bfloat16)
    be.prepare_batch(make_batch_info([5], [0], [4, 0], device="cpu", scalings=[2.0, 1.0]))
    got = layer(x.to(torch.bfloat16))
    assert got.dtype == torch.bfloat16
    rtol, atol = TOLERANCES[torch.bfloat16]
    torch.testing.assert_close(got.float(), want.detach(), rtol=rtol, atol=atol * max(1.0, want.abs().max().item()))


@pytest.mark.parametrize("backend", BACKENDS)
def test_dora_embedding_matches_the_per_row_dora_math(device, backend):
    gen = torch.Generator().manual_seed(8)
    V, D, ranks, scalings = 30, 16, [3, 0, 5], [2.0, 1.0, 0.5]
    be = get_backend(backend)(device.torch_device)
    context = LoRAContext(be, num_slots=3, max_rank=R, dtype=torch.float32, device=device.torch_device, dora=True)
    base = nn.Embedding(V, D)
    with torch.no_grad():
        base.weight.copy_(torch.randn(V, D, generator=gen))
    layer = EmbeddingWithLoRA(base, context)
    parts = {}
    for slot, dora in ((0, True), (2, False)):
        r = ranks[slot]
        w = LoRAModuleWeights("e", "embedding", torch.randn(r, V, generator=gen), torch.randn(D, r, generator=gen) * 0.3,
                              scalings[slot], torch.rand(D, generator=gen) + 0.5 if dora else None)
        layer.load_slot(slot, {WHOLE_MODULE: w}, scalings[slot])
        parts[slot] = w
    fill_embedding_garbage(layer.buffers.a, layer.buffers.b, ranks)
    layer.to(device.torch_device)
    pair = BatchPair(ranks, ([4, 3, 5], [0, None, 2]), ([2, 6, 4], [2, 0, 1]), scalings=scalings)
    ids = torch.randint(0, V, (pair.num_tokens,), generator=gen)
    ids[[1, 7]] = torch.tensor([V + 3, -1])  # out of vocabulary: zero row

    def forward(info, ids):
        be.prepare_batch(info)
        return layer(ids)

    out_a, out_b = pair.run(device, forward, ids.to(device.torch_device))
    for got, ref in zip((out_a, out_b), pair.reference_infos()):
        valid = (ids >= 0) & (ids < V)
        want = base.weight.detach()[ids.clamp(0, V - 1)] * valid[:, None]
        for t, slot in enumerate(ref.token_slots_cpu.tolist()):
            w = parts.get(slot)
            if w is None or not valid[t]:
                continue
            row = want[t] + w.scaling * (w.lora_b @ w.lora_a[:, ids[t]])
            if w.magnitude is not None:
                row = dora_factor(base.weight.detach().T, w.lora_a, w.lora_b, w.scaling, w.magnitude) * row
            want[t] = row
        assert_close_to_reference(got, want)
