"""Every registered backend, on every device parameter, against the reference math
and against each other (docs/testing.md). Graph devices capture with batch A and replay B."""

import inspect
import random

import pytest
import torch

from lora_core import available_backends, build_batch_info, get_backend
from lora_core.reference import reference_lora_a, reference_lora_a_embedding, reference_lora_b
from lora_core.testing import (
    BatchPair,
    assert_close_to_reference,
    random_batch_pair,
    random_embedding_weights,
    random_linear_weights,
    random_ranks,
)
from lora_core.testing.cases import GARBAGE, fill_expand_input_garbage

BACKENDS = available_backends()
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
LAYERS = {"linear": [40], "gate_up": [24, 24], "qkv": [32, 8, 8]}


def _run_layer(backend, layer, x, a, b, offsets, base):
    if layer == "qkv":
        return backend.run_qkv(x, a, b, offsets, base)
    if layer == "gate_up":
        return backend.run_gate_up(x, a, b, offsets, base)
    return backend.run_lora_b(backend.run_lora_a(x, a, len(offsets) - 1), b, offsets, base)


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layer", sorted(LAYERS))
@pytest.mark.parametrize("seed", range(2))
def test_linear_layers_match_reference(device, backend_name, dtype, layer, seed):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    L, R, T, in_features = rng.randint(2, 5), rng.choice([4, 8, 16]), rng.randint(8, 72), rng.randint(8, 64)
    ranks = random_ranks(rng, L, R)
    pair = random_batch_pair(rng, T, ranks)
    a, b, offsets = random_linear_weights(gen, num_slots=L, max_rank=R, in_features=in_features,
                                          slice_widths=LAYERS[layer], lora_ranks=ranks, dtype=dtype,
                                          device=device.torch_device)
    weight = (torch.randn(offsets[-1], in_features, generator=gen) / in_features**0.5).to(device.torch_device, dtype)
    x = torch.randn(T, in_features, generator=gen).to(device.torch_device, dtype)
    backend = get_backend(backend_name)(device.torch_device)

    def forward(info, x):
        backend.prepare_batch(info)
        return _run_layer(backend, layer, x, a, b, offsets, x @ weight.T)

    out_a, out_b = pair.run(device, forward, x)
    for out, ref in zip([out_a, out_b], pair.reference_infos()):
        delta = reference_lora_b(reference_lora_a(x, a, ref, len(offsets) - 1), b, ref, offsets)
        # the base matmul runs in `dtype` in both: compare the LoRA part against fp32 math
        assert_close_to_reference(out, (x @ weight.T).float().cpu() + delta, dtype)


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("seed", range(2))
def test_embedding_shrink_matches_reference(device, backend_name, dtype, seed):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    L, R, V, added, T = rng.randint(1, 4), rng.choice([4, 16]), rng.randint(10, 300), rng.randint(0, 4), rng.randint(4, 64)
    ranks = random_ranks(rng, L, R)
    pair = random_batch_pair(rng, T, ranks)
    a, _ = random_embedding_weights(gen, num_slots=L, max_rank=R, vocab_total=V + added, embedding_dim=8,
                                    lora_ranks=ranks, dtype=dtype, device=device.torch_device)
    extra = torch.zeros(L, added, 8, dtype=dtype, device=device.torch_device) if added else None
    ids = torch.randint(0, V + added, (T,), generator=gen).to(device.torch_device)
    backend = get_backend(backend_name)(device.torch_device)

    def shrink(info, ids):
        backend.prepare_batch(info)
        return backend.run_lora_a_embedding(ids, a, V, extra)

    out_a, out_b = pair.run(device, shrink, ids)
    for out, ref in zip([out_a, out_b], pair.reference_infos()):
        assert_close_to_reference(out, reference_lora_a_embedding(ids, a, ref, V, added), dtype)


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("op", ["linear", "embedding"])
def test_a_replay_after_set_adapters_uses_the_new_ranks_and_scalings(device, backend_name, op):
    """A slot that gets another adapter between steps (``set_adapters``: new ranks and
    scalings written in place) keeps the graph captured before: the replay (on graph devices;
    eager devices run the graph-mode batch again) reads the new ranks and scalings from the
    batch's device tensors, never from its host mirrors or from values read at capture."""
    gen = torch.Generator().manual_seed(7)
    R, T, V = 8, 24, 50
    ranks_a, scalings_a = [8, 3, 0, 5], [0.5, 2.0, 1.0, 1.5]
    ranks_b, scalings_b = [2, 8, 6, 0], [1.25, 0.75, 3.0, 1.0]
    seq_lens, slots = [5, 7, 4, 3, 5], [0, 1, 2, None, 3]
    full = [R] * len(ranks_a)  # weights valid up to R in every slot: both rank sets read real values
    dev = device.torch_device
    info = build_batch_info(seq_lens, slots, ranks_a, scalings_a, device=dev, use_graph=True, max_tokens=T, max_rank=R)
    backend = get_backend(backend_name)(dev)
    if op == "linear":
        a, b, offsets = random_linear_weights(gen, num_slots=4, max_rank=R, in_features=16, slice_widths=[12, 4],
                                              lora_ranks=full, dtype=torch.float32, device=dev)
        x = torch.randn(T, 16, generator=gen).to(dev)

        def step(x):
            backend.prepare_batch(info)
            return backend.run_packed(x, a, b, offsets)
    else:
        a, _ = random_embedding_weights(gen, num_slots=4, max_rank=R, vocab_total=V, embedding_dim=8,
                                        lora_ranks=full, dtype=torch.float32, device=dev)
        x = torch.randint(0, V, (T,), generator=gen).to(dev)

        def step(ids):
            backend.prepare_batch(info)
            return backend.run_lora_a_embedding(ids, a, V)

    outs = device.run_two_batches(step, (x,), lambda: info.set_adapters(ranks_b, scalings_b))
    for out, ranks, scalings in zip(outs, (ranks_a, ranks_b), (scalings_a, scalings_b)):
        ref = build_batch_info(seq_lens, slots, ranks, scalings, device="cpu")
        if op == "linear":
            want = reference_lora_b(reference_lora_a(x, a, ref, 2), b, ref, offsets)
        else:
            want = reference_lora_a_embedding(x, a, ref, V, 0)
        assert_close_to_reference(out, want, torch.float32)


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("bad_id", ["negative", "v_total", "huge"])
def test_out_of_vocab_ids_get_exactly_the_base_output(device, backend_name, bad_id):
    # docs/upstream-failures.md, failure 3: upstream clamped such ids to the last row (a neighbour's delta) or crashed.
    V, added, D = 50, 2, 6
    ids = torch.tensor([3, {"negative": -1, "v_total": V + added, "huge": 2**40}[bad_id], 51, V - 1])
    gen = torch.Generator().manual_seed(0)
    a, b = random_embedding_weights(gen, num_slots=2, max_rank=4, vocab_total=V + added, embedding_dim=D,
                                    lora_ranks=[4, 2], dtype=torch.float32, device=device.torch_device)
    a[:, :, -1] = 5.0  # the last row a clamp would pick: non-zero
    extra = torch.zeros(2, added, D, device=device.torch_device)
    backend = get_backend(backend_name)(device.torch_device)
    pair = BatchPair([4, 2], ([4], [0]), ([1, 3], [1, 0]))

    def shrink(info, ids):
        backend.prepare_batch(info)
        return backend.run_lora_a_embedding(ids, a, V, extra)

    out_a, out_b = pair.run(device, shrink, ids.to(device.torch_device))
    assert torch.count_nonzero(out_b[1]) == 0
    assert torch.count_nonzero(out_a[1]) == 0, "an out-of-vocab id must get a zero delta"
    assert torch.count_nonzero(out_a[0]) > 0 and torch.count_nonzero(out_a[2]) > 0  # added token id 51 is valid


def test_backends_agree_with_each_other():
    if len(BACKENDS) < 2:
        pytest.skip(f"needs two backends, installed: {BACKENDS}")
    rng = random.Random(5)
    gen = torch.Generator().manual_seed(5)
    ranks = [16, 3, 0, 9]
    pair = random_batch_pair(rng, 40, ranks)
    a, b, offsets = random_linear_weights(gen, num_slots=4, max_rank=16, in_features=24, slice_widths=[16, 8, 8],
                                          lora_ranks=ranks, dtype=torch.float32, device="cpu")
    x = torch.randn(40, 24, generator=gen)
    info = pair.build(pair.batch_a, "cpu")
    outs = []
    for name in BACKENDS:
        backend = get_backend(name)("cpu")
        backend.prepare_batch(info)
        outs.append(backend.run_qkv(x, a, b, offsets))
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- the expand alone
# Bug class 9 (docs/bug-classes.md): through a layer the expand only ever sees a shrink output,
# zero beyond each rank, so an expand that reads past the rank in some slice (the control
# loop's slices after the first, say) adds nothing and passes. Here the expand gets an input
# with garbage beyond every row's rank in *every* slice, and B with or without garbage there.
EXPAND_LAYOUTS = ("segments", "slot groups", "slot blocks", "slot blocks in two runs")
"""The eager control plan's layouts (lora_cuda.control_plan); graph-mode batches and the
vectorized backend take the static kernels whatever the layout."""


def _layout_batch(rng: random.Random, layout: str, T: int, ranks: list[int]) -> tuple[list[int], list]:
    """``T`` tokens (slot groups: as many as they need) of eager control plan ``layout``; slot -1, None, rank 0 too."""
    active = [s for s, r in enumerate(ranks) if r > 0]
    idle = [-1, None] + [s for s, r in enumerate(ranks) if r == 0]
    if layout == "segments":  # a few long requests, no slot twice: one GEMM per request and slice
        slots = active + idle
        rng.shuffle(slots)
        cuts = sorted(rng.sample(range(1, T), len(slots) - 1))
        return [b - a for a, b in zip([0, *cuts], [*cuts, T])], slots
    if layout == "slot groups":  # single tokens, the slots' groups 56 rows apart: any block layout pads too much
        slots = [s for i, s in enumerate(active) for _ in range(1 + 56 * i)] + idle
        rng.shuffle(slots)
        return [1] * len(slots), slots
    if layout == "slot blocks in two runs":  # single tokens, one hot slot: the others' blocks, then its rest
        hot = rng.choice(active)
        others = [s for s in active if s != hot] + idle
        slots = [hot] * T
        for pos, s in zip(rng.sample(range(1, T - 1), len(others)), others):
            slots[pos] = s
        return [1] * T, slots
    slots = [active[t % len(active)] for t in range(T)]  # slot blocks: single tokens spread evenly
    for pos, s in zip(rng.sample(range(T), len(idle)), idle):
        slots[pos] = s
    return [1] * T, slots


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("kernel", ["auto", "grouped", "blocked"])
@pytest.mark.parametrize("layout", EXPAND_LAYOUTS)
@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("into", ["new", "column view"])
def test_expand_reads_nothing_beyond_each_slots_rank_in_any_slice(device, backend_name, kernel, layout, mode, into):
    """Every expand path (control loop in its four layouts, grouped and blocked static
    kernels, the vectorized backend; eager, graph-mode, captured or compiled and replayed
    after a refill) equals the reference, which reads ``y[:, i*R : i*R + r]`` and ``B[:, :r]``
    of each slice ``i`` only, on an input with garbage beyond every row's rank in every slice;
    into a new output, or added into a base output that is a strided view (some columns of
    a wider tensor, as vLLM's LoRA layers pass one slice of a packed output), whose other
    columns stay as they were."""
    if device.is_graph and mode == "eager":
        pytest.skip("graph devices run graph-mode batches")
    seed = EXPAND_LAYOUTS.index(layout) + len(EXPAND_LAYOUTS) * ["auto", "grouped", "blocked"].index(kernel)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    dtype = rng.choice(DTYPES)
    R = rng.choice([8, 16])  # 16-byte aligned sizes in every dtype, so "grouped" takes the grouped GEMM
    ranks = [R, 1, 0] + [rng.randint(1, R - 1) for _ in range(rng.randint(1, 3))]  # >= 3 active slots
    rng.shuffle(ranks)
    widths = rng.choice([[16, 8, 8], [24, 24], [8, 16, 24]])
    T = rng.randint(20, 40)
    batches = [_layout_batch(rng, layout, T, ranks) for _ in "AB"]
    T = sum(batches[0][0])  # (slot groups: as many tokens as their groups need, in A and in B)
    pair = BatchPair(ranks, *batches)
    refs = pair.reference_infos()
    if mode == "eager":  # keep the layouts honest: each runs the control loop it is named after
        from lora_cuda.control_plan import ControlPlan

        assert [ControlPlan.build(ref).layout for ref in refs] == [layout, layout]
    garbage_in_b = seed % 2 == 0  # without it, only the input's garbage shows a read past the rank
    _, b, offsets = random_linear_weights(gen, num_slots=len(ranks), max_rank=R, in_features=8, slice_widths=widths,
                                          lora_ranks=ranks, dtype=dtype, device=device.torch_device,
                                          garbage=GARBAGE if garbage_in_b else None)
    c = len(widths)
    y = torch.randn(T, c * R, generator=gen)
    fill_expand_input_garbage(y, ranks, c, *(ref.token_slots_cpu.tolist() for ref in refs))
    y = y.to(device.torch_device, dtype)
    cls = get_backend(backend_name)
    backend = cls(device.torch_device, **({"graph_kernel": kernel} if "graph_kernel" in inspect.signature(cls).parameters
                                          else {}))

    wide = torch.randn(T, offsets[-1] + 24, generator=gen).to(device.torch_device, dtype)
    lo = 16  # the output's columns in the wider tensor: [16, 16 + out_total)

    def expand(info, y):
        backend.prepare_batch(info)
        if into == "new":
            return backend.run_lora_b(y, b, offsets)
        base = wide.clone()  # a fresh copy per call: the same base for batches A and B
        backend.run_lora_b(y, b, offsets, base_output=base[:, lo: lo + offsets[-1]])
        return base  # the delta must have been added into the view given

    if mode == "graph" and not device.is_graph:  # one graph-mode batch info, refilled in place with B
        info = pair.build(pair.batch_a, device.torch_device, use_graph=True)
        with torch.no_grad():
            out_a = expand(info, y).clone()
            info.refill(*pair.batch_b)
            out_b = expand(info, y)
    else:
        out_a, out_b = pair.run(device, expand, y)
    for out, ref, batch in zip([out_a, out_b], refs, "AB"):
        if into != "new":
            outside = torch.cat([out[:, :lo], out[:, lo + offsets[-1]:]], dim=1)
            assert torch.equal(outside, torch.cat([wide[:, :lo], wide[:, lo + offsets[-1]:]], dim=1)), (
                f"batch {batch}: columns outside the view changed")
            out = out[:, lo: lo + offsets[-1]]
        assert torch.isfinite(out.float()).all(), f"batch {batch}: the expand read garbage beyond a rank"
        expected = reference_lora_b(y, b, ref, offsets)
        if into != "new":
            expected = expected + wide[:, lo: lo + offsets[-1]].float().cpu()
        assert_close_to_reference(out, expected, dtype)


# ----------------------------------------------------------------------------- packed projections of any arity
PACKED_METHODS = ("run_packed", "run_qkv", "run_gate_up")
"""One op under three names: the slice count is the call's ``len(slice_offsets) - 1``."""


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("seed", range(3))
def test_packed_projections_of_any_slice_count_match_reference(device, backend_name, dtype, seed):
    """1 to 5 slices of uneven widths (q/k/v plus an output gate, say), mixed ranks (rank 0,
    slot -1, garbage beyond every rank), accumulated into a base output; captured with batch A
    and replayed with B on graph devices, compiled once and reused on compile devices."""
    rng = random.Random(100 + seed)
    gen = torch.Generator().manual_seed(100 + seed)
    num_slices = [1, 4, 5][seed] if dtype == torch.float32 else rng.randint(1, 5)
    widths = [rng.choice([8, 16, 24, 40]) for _ in range(num_slices)]
    L, R, T, in_features = rng.randint(2, 5), rng.choice([4, 8, 16]), rng.randint(8, 60), rng.randint(8, 48)
    ranks = random_ranks(rng, L, R)
    pair = random_batch_pair(rng, T, ranks)
    a, b, offsets = random_linear_weights(gen, num_slots=L, max_rank=R, in_features=in_features, slice_widths=widths,
                                          lora_ranks=ranks, dtype=dtype, device=device.torch_device)
    weight = (torch.randn(offsets[-1], in_features, generator=gen) / in_features**0.5).to(device.torch_device, dtype)
    x = torch.randn(T, in_features, generator=gen).to(device.torch_device, dtype)
    backend = get_backend(backend_name)(device.torch_device)
    method = getattr(backend, PACKED_METHODS[seed])

    def forward(info, x):
        backend.prepare_batch(info)
        return method(x, a, b, offsets, x @ weight.T)

    out_a, out_b = pair.run(device, forward, x)
    for out, ref in zip([out_a, out_b], pair.reference_infos()):
        delta = reference_lora_b(reference_lora_a(x, a, ref, num_slices), b, ref, offsets)
        assert_close_to_reference(out, (x @ weight.T).float().cpu() + delta, dtype)


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_sglang_four_slice_run_qkv_case(backend_name):
    """SGLang's backend test (test/manual/lora/test_torch_backend.py::test_run_qkv_lora) in this
    layout: two requests of one token on slots 0 and 1 (rank 1, scalings 1 and 0.5), a qkv call
    with five offsets [0, 3, 6, 9, 12] given as a CPU int32 tensor, i.e. four slices."""
    gen = torch.Generator().manual_seed(0)
    ranks, scalings, offsets = [1, 1], [1.0, 0.5], torch.tensor([0, 3, 6, 9, 12], dtype=torch.int32)
    x = torch.randn(2, 6, generator=gen)
    a = torch.randn(2, 1 * 4, 6, generator=gen)  # (L, c*R, in)
    b = torch.randn(2, 12, 1, generator=gen)  # (L, out_total, R)
    info = BatchPair(ranks, ([1, 1], [0, 1]), ([1, 1], [0, 1]), scalings).build(([1, 1], [0, 1]), "cpu")
    backend = get_backend(backend_name)("cpu")
    backend.prepare_batch(info)
    expected = torch.stack([
        torch.cat([b[s, 3 * i : 3 * i + 3, 0] * (scalings[s] * a[s, i] @ x[s]) for i in range(4)])
        for s in (0, 1)])  # token s is on slot s; rank 1, so slice i's shrink is one number
    torch.testing.assert_close(backend.run_qkv(x, a, b, offsets), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(backend.run_qkv(x, a, b, offsets), reference_lora_b(
        reference_lora_a(x, a, info, 4), b, info, offsets.tolist()), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("batch", ["eager", "graph"])
@pytest.mark.parametrize("empty", ["slots", "experts"])
def test_empty_adapter_tables_mean_no_delta_on_every_op(device, backend_name, batch, empty):
    """Zero adapter slots (a server before its first adapter) or fused experts with zero experts:
    every op works and adds nothing, on every backend and batch kind (an empty table is not an
    error, and not an ``IndexError`` or a raw ``RuntimeError`` out of a kernel)."""
    if device.is_graph and batch == "eager":
        pytest.skip("graph devices run graph-mode batches")
    dev = device.torch_device
    gen = torch.Generator().manual_seed(3)
    T, R, H, V, D, K = 5, 4, 8, 16, 6, 2
    ranks, scalings = ([], []) if empty == "slots" else ([4, 2], [0.5, 2.0])
    seq_lens, slots = [3, 2], ([None, None] if empty == "slots" else [0, 1])
    L, E = len(ranks), (3 if empty == "slots" else 0)
    info = build_batch_info(seq_lens, slots, ranks, scalings, device=dev, use_graph=batch == "graph",
                            max_tokens=T if batch == "graph" else None)
    backend = get_backend(backend_name)(dev)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dev)

    x, base, ids = rand(T, H), rand(T, 10), torch.randint(0, V, (T,), generator=gen).to(dev)
    xk, expert_ids, base_k = rand(T, K, H), torch.randint(0, 3, (T, K), generator=gen).to(dev), rand(T, K, 7)
    logits, embedded = rand(T, V), rand(T, D)

    a, a2, b2, emb, head_a, head_b = rand(L, R, H), rand(L, 2 * R, H), rand(L, 10, R), rand(L, R, V), rand(L, R, H), \
        rand(L, V, R)
    added, factors, bias, ea, eb = rand(L, 2, D), torch.ones(L, 10, device=dev) * 3, rand(10), rand(L, E, R, H), \
        rand(L, E, 7, R)

    def every_op(x, base, ids, xk, expert_ids, base_k, logits, embedded):
        backend.prepare_batch(info)
        return (backend.run_lora_a(x, a),
                backend.run_packed(x, a2, b2, (0, 6, 10), base.clone()),
                backend.run_lora_a_embedding(ids, emb, V),
                backend.run_lm_head(x, head_a, head_b, logits.clone(), pruned=False),
                backend.run_added_tokens(ids, added, V - 2, embedded.clone()),
                backend.run_dora_scale(base.clone(), factors, bias),
                backend.run_experts_lora(xk, expert_ids, ea, eb, base_k.clone()),
                backend.run_experts_lora_a(xk, expert_ids, ea),
                backend.run_experts_lora_b(yk, expert_ids, eb, base_k.clone()))

    yk = rand(T, K, R)
    inputs = (x, base, ids, xk, expert_ids, base_k, logits, embedded)
    outs, _ = device.run_two_batches(every_op, inputs, lambda: None)
    experts = (base_k, torch.zeros(T, K, R), base_k)
    if empty == "slots":
        want = (torch.zeros(T, R), base, torch.zeros(T, R), logits, embedded, base, *experts)
    else:
        want = (None, None, None, None, None, None, *experts)  # only the experts' table is empty here
    for i, (out, expected) in enumerate(zip(outs, want)):
        if expected is not None:
            assert torch.equal(out.cpu(), expected.cpu()), f"op {i} added a delta"


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_a_tensor_of_slice_offsets_is_host_data_and_refused_under_compile(device, backend_name):
    """A 1-D CPU integer tensor is documented as valid ``slice_offsets``. Eager calls read it;
    a graph capture reads it as host data (declared ``host_resident`` on the simulator, as any
    CPU metadata) and bakes its values in, like ints; ``torch.compile`` cannot guard on its
    values and refuses it with one line naming it (not dynamo's data-dependent guard error)."""
    dev = device.torch_device
    gen = torch.Generator().manual_seed(5)
    info = build_batch_info([3, 2], [0, 1], [4, 2], [1.0, 0.5], device=dev, use_graph=device.is_graph,
                            max_tokens=5 if device.is_graph else None)
    x, b = torch.randn(5, 8, generator=gen).to(dev), torch.randn(2, 10, 4, generator=gen).to(dev)
    backend = get_backend(backend_name)(dev)
    offsets = torch.tensor([0, 6, 10])

    def expand(x, offsets=offsets):
        backend.prepare_batch(info)
        return backend.run_lora_b(x, b, offsets)

    with torch.no_grad():
        backend.prepare_batch(info)
        want = backend.run_lora_b(x, b, (0, 6, 10))
    if getattr(device.device_type, "compile_backend", None) is not None:  # a compile device
        with pytest.raises((ValueError, torch._dynamo.exc.TorchDynamoException)) as err:
            device.run_two_batches(expand, (x,), lambda: None)
        assert "slice_offsets is a tensor inside torch.compile" in str(err.value)
        return
    out_a, out_b = device.run_two_batches(expand, (x,), lambda: None, host_resident=[offsets])
    assert torch.equal(out_a, want.cpu()) and torch.equal(out_b, want.cpu())
