"""Property-based differential tests: every backend against lora_core.reference on random batches.

Hypothesis draws batches (0-40 requests of 0-50 tokens, slots in [-1, L) or None),
1-8 slots of ranks 0..R, 1-3 slices of unequal widths, fp32/fp16/bf16, strided
weights and activations, large garbage beyond every slot's rank in A and B,
out-of-vocabulary, negative, huge and added-token ids. Each example runs through one
backend (every registered one), one graph-kernel preference and one mode:

* ``eager``: an eager batch info per batch;
* ``graph``: one graph-mode batch info for batch A, refilled in place with batch B
  (and, on graph devices, captured with A and replayed after the refill; on
  compile devices, compiled with A and called again after the refill, which must
  not recompile: the ``*_compiled`` tests, with a smaller budget).

Backend and mode are pytest parameters (every pair runs); the rest is drawn.

Outputs are compared with the fp32 reference at the dtype's tolerance *relative to
the magnitude of the terms* (the same reference run on absolute values), so a
bf16 output of size 100 is allowed bf16's error of 100, and a wrong term of
garbage (1e3) is never hidden. Budgets and profiles: lora_core.testing.hypothesis_profiles
(``-p lora_core.testing.hypothesis_profiles --hypothesis-profile long``).
"""

from __future__ import annotations

import inspect

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import event, given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from lora_core import available_backends, build_batch_info, get_backend  # noqa: E402
from lora_core.reference import reference_lora_a, reference_lora_a_embedding, reference_lora_b  # noqa: E402
from lora_core.testing import GARBAGE, TOLERANCES, clone_outputs, fill_embedding_garbage  # noqa: E402
from lora_core.testing.hypothesis_profiles import budget  # noqa: E402
from lora_core.testing.cases import fill_expand_input_garbage  # noqa: E402

BACKENDS = available_backends()
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
KERNELS = ("auto", "grouped", "blocked")

pytestmark = pytest.mark.skipif(not BACKENDS, reason="no LoRA backend is installed")


# ----------------------------------------------------------------------------- strategies
def requests(num_slots: int, max_requests: int = 40, max_len: int = 50):
    slot = st.one_of(st.none(), st.integers(-1, num_slots - 1))
    return st.lists(st.tuples(st.integers(0, max_len), slot), max_size=max_requests).map(
        lambda pairs: ([n for n, _ in pairs], [s for _, s in pairs]))


@st.composite
def adapters(draw, max_slots: int = 8, max_rank: int = 16, aligned: bool = False):
    L = draw(st.integers(1, max_slots))
    R = draw(st.sampled_from([8, 16]) if aligned else st.integers(1, max_rank))
    ranks = draw(st.lists(st.integers(0, R), min_size=L, max_size=L))
    scalings = draw(st.lists(st.floats(-4, 4, allow_nan=False, width=32), min_size=L, max_size=L))
    return R, ranks, scalings


@st.composite
def scenarios(draw, max_slots: int = 8, max_rank: int = 16):
    """Adapters, two batches over them, the kernel preference, dtype, seed. Half the
    cases have 16-byte aligned sizes and contiguous weights, which the grouped GEMM needs
    (the other half exercise its fallback)."""
    aligned = draw(st.booleans())
    R, ranks, scalings = draw(adapters(max_slots, max_rank, aligned))
    return dict(
        R=R, ranks=ranks, scalings=scalings, aligned=aligned,
        batch_a=draw(requests(len(ranks))), batch_b=draw(requests(len(ranks))),
        padding=draw(st.integers(0, 5)), kernel=draw(st.sampled_from(KERNELS)),
        dtype=draw(st.sampled_from(DTYPES)), strided=not aligned and draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


# ----------------------------------------------------------------------------- harness
def is_compile_device(device) -> bool:
    return getattr(device.device_type, "compile_backend", None) is not None


def scenario(device, case: dict, backend: str, mode: str) -> dict:
    """The drawn case for one backend and mode (pytest parameters, so every pair runs)."""
    if device.is_graph and mode == "eager":
        pytest.skip("graph devices run graph-mode batches")
    return {**case, "backend": backend, "graph": mode == "graph"}


def only_compile_devices(device, wanted: bool) -> None:
    """Compile devices compile once per example: their own test, with a smaller budget."""
    if is_compile_device(device) != wanted:
        pytest.skip("compile devices run the *_compiled variant" if not wanted else "not a compile device")


def make_backend(name: str, device, kernel: str):
    cls = get_backend(name)
    options = {"graph_kernel": kernel} if "graph_kernel" in inspect.signature(cls).parameters else {}
    return cls(device.torch_device, **options)


class Runner:
    """Runs ``fn(info, *inputs)`` for batch A, then batch B, the way the scenario's mode asks."""

    def __init__(self, device, case: dict) -> None:
        self.device, self.case = device, case
        self.use_graph = case["graph"] or device.is_graph
        tokens = [sum(case["batch_a"][0]), sum(case["batch_b"][0])]
        event(f"kernel={case['kernel']}, {case['dtype']}, {'aligned' if case['aligned'] else 'unaligned'}")
        event(f"tokens {'0' if not max(tokens) else '1-99' if max(tokens) < 100 else '100+'}")
        self.capacity = max(*tokens, 1) + case["padding"] if self.use_graph else None
        self.max_rows = self.capacity if self.use_graph else max(tokens)
        # a graph-mode batch run without a capture may get fewer rows than its capacity
        # (at least its tokens); a captured one gets exactly its capacity
        self.graph_rows = self.capacity if device.is_graph else max(tokens) + case["padding"] // 2

    def build(self, batch, device="cpu", use_graph=False, scalings=None) -> object:
        ranks, scalings = self.case["ranks"], scalings if scalings is not None else self.case["scalings"]
        return build_batch_info(*batch, ranks, scalings, device=device, use_graph=use_graph,
                                max_tokens=self.capacity if use_graph else None)

    def references(self, absolute: bool = False):
        """Eager CPU batch infos of A and B (with |scalings| for the magnitude bound)."""
        scalings = [abs(s) for s in self.case["scalings"]] if absolute else None
        return [self.build(b, scalings=scalings) for b in (self.case["batch_a"], self.case["batch_b"])]

    def run(self, fn, inputs_for):
        """``[(outputs, inputs)]`` for A and B; ``inputs_for(info, rows)`` gives the inputs of a batch
        info whose ops receive ``rows`` rows."""
        device, (batch_a, batch_b) = self.device, (self.case["batch_a"], self.case["batch_b"])
        if not self.use_graph:
            results = []
            for batch in (batch_a, batch_b):
                info = self.build(batch, device.torch_device)
                inputs = inputs_for(info, info.num_tokens)
                results.append((device.run(lambda *xs: fn(info, *xs), *inputs), inputs))
            return [(clone_outputs(out), inputs) for out, inputs in results]
        info = self.build(batch_a, device.torch_device, use_graph=True)
        inputs = inputs_for(info, self.graph_rows)
        out_a, out_b = device.run_two_batches(lambda *xs: fn(info, *xs), inputs, lambda: info.refill(*batch_b))
        return [(out_a, inputs), (out_b, inputs)]


def assert_within(name, actual, expected, magnitude, dtype, info=None):
    """``|actual - expected| <= rtol * magnitude + atol`` element-wise, with ``magnitude`` the
    reference on absolute values (an upper bound of every term's size)."""
    rtol, atol = TOLERANCES[dtype]
    actual = actual.detach().float().cpu()
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{name}: non-finite values"
    excess = (actual - expected).abs() - (rtol * magnitude + atol)
    if excess.numel() and excess.max() > 0:
        row, col = divmod(int(excess.argmax()), excess.shape[1])
        slot = info.token_slots_cpu[row].item() if info is not None and row < info.num_tokens else "padding"
        raise AssertionError(
            f"{name}: {int((excess > 0).sum())} element(s) off; worst [{row}, {col}] (slot {slot}): "
            f"got {actual[row, col].item():.6g}, expected {expected[row, col].item():.6g} "
            f"(tolerance {rtol * magnitude[row, col].item() + atol:.3g}, dtype {dtype})")


def _strided(t: torch.Tensor, strided: bool) -> torch.Tensor:
    """``t``, or an equal tensor whose last dim is strided (a view into a wider buffer)."""
    if not strided:
        return t
    wide = torch.full((*t.shape[:-1], t.shape[-1] + 3), GARBAGE, dtype=t.dtype, device=t.device)
    wide[..., : t.shape[-1]] = t
    return wide[..., : t.shape[-1]]


def _garbage_linear(a, b, ranks, num_slices):
    R = b.shape[2]
    for slot, r in enumerate(ranks):
        for i in range(num_slices):
            a[slot, i * R + r : (i + 1) * R] = GARBAGE
        b[slot, :, r:] = GARBAGE


# ----------------------------------------------------------------------------- linear layers
LINEAR_CASES = dict(case=scenarios(), num_slices=st.integers(1, 3),
                    widths=st.lists(st.integers(1, 24), min_size=3, max_size=3, unique=True),
                    in_features=st.integers(1, 40), vocab=st.integers(1, 24))


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("mode", ["eager", "graph"])
@given(**LINEAR_CASES)
@budget(ci=15, long=400)
def test_linear_ops_match_reference(device, backend_name, mode, case, num_slices, widths, in_features, vocab):
    only_compile_devices(device, False)
    check_linear_ops(device, backend_name, mode, case, num_slices, widths, in_features, vocab)


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("mode", ["graph"])
@given(**LINEAR_CASES)
@budget(ci=4, long=60)
def test_linear_ops_match_reference_compiled(device, backend_name, mode, case, num_slices, widths, in_features, vocab):
    only_compile_devices(device, True)
    check_linear_ops(device, backend_name, mode, case, num_slices, widths, in_features, vocab)


def check_linear_ops(device, backend_name, mode, case, num_slices, widths, in_features, vocab):
    """Shrink, expand alone (non-zero input everywhere, rows without an adapter and padding
    rows included), the packed layer into a base output, and the LM head (every token and
    pruned) equal the reference, for batch A and for batch B after the switch."""
    case = scenario(device, case, backend_name, mode)
    runner = Runner(device, case)
    dtype, R, ranks, L = case["dtype"], case["R"], case["ranks"], len(case["ranks"])
    widths = widths[:num_slices]
    if case["aligned"]:  # multiples of 8 elements: 16 bytes in every dtype
        widths, in_features, vocab = [8 * w for w in widths], 8 * (1 + in_features % 5), 8 * (1 + vocab % 4)
    offsets = [0]
    for w in widths:
        offsets.append(offsets[-1] + w)
    gen = torch.Generator().manual_seed(case["seed"])
    rows = runner.max_rows
    a = torch.randn(L, num_slices * R, in_features, generator=gen) / in_features**0.5
    b = torch.randn(L, offsets[-1], R, generator=gen) / R**0.5
    _garbage_linear(a, b, ranks, num_slices)
    a_lm = torch.randn(L, R, in_features, generator=gen) / in_features**0.5
    b_lm = torch.randn(L, vocab, R, generator=gen) / R**0.5
    _garbage_linear(a_lm, b_lm, ranks, 1)
    x = torch.randn(rows, in_features, generator=gen)
    y = torch.randn(rows, num_slices * R, generator=gen)  # expand input: non-zero beyond every rank too
    base = torch.randn(rows, offsets[-1], generator=gen)
    hidden = torch.randn(rows, in_features, generator=gen)
    dev = device.torch_device
    a, b, a_lm, b_lm = (_strided(t.to(dev, dtype), case["strided"]) for t in (a, b, a_lm, b_lm))
    x, y, base, hidden = (t.to(dev, dtype) for t in (x, y, base, hidden))
    x = _strided(x, case["strided"])
    backend = make_backend(case["backend"], device, case["kernel"])

    def layer(info, x, y, base, hidden, pruned_hidden):
        backend.prepare_batch(info)
        shrunk = backend.run_lora_a(x, a, num_slices)
        expanded = backend.run_lora_b(y, b, offsets)
        acc = base.clone()
        if num_slices == 3:
            packed = backend.run_qkv(x, a, b, offsets, acc)
        elif num_slices == 2:
            packed = backend.run_gate_up(x, a, b, offsets, acc)
        else:
            packed = backend.run_lora_b(backend.run_lora_a(x, a), b, offsets, acc)
        assert packed is acc, "the packed layer must accumulate into base_output in place and return it"
        head = backend.run_lm_head(hidden, a_lm, b_lm, pruned=False)
        head_pruned = backend.run_lm_head(pruned_hidden, a_lm, b_lm, pruned=True)
        return shrunk, expanded, packed, head, head_pruned

    def inputs_for(info, n):
        pruned_rows = n if info.use_graph else info.lm_head_view(pruned=True).num_tokens
        return x[:n], y[:n], base[:n], hidden[:n], hidden[:pruned_rows]

    snapshot = [t.clone() for t in (x, y, a, b)]
    results = runner.run(layer, inputs_for)
    for t, before in zip((x, y, a, b), snapshot):
        assert torch.equal(t, before), "an op wrote into one of its inputs"
    for (outs, inputs), ref, mag_ref, batch in zip(results, runner.references(), runner.references(absolute=True),
                                                   "AB"):
        shrunk, expanded, packed, head, head_pruned = outs
        xi, yi, basei, hi, hpi = inputs
        for out, inp in ((shrunk, xi), (expanded, yi), (packed, basei), (head, hi)):
            assert out.dtype == dtype and out.shape[0] == inp.shape[0]
        want_shrink = reference_lora_a(xi, a, ref, num_slices)
        mag_shrink = reference_lora_a(xi.abs(), a.abs(), mag_ref, num_slices)
        assert_within(f"batch {batch} shrink", shrunk, want_shrink, mag_shrink, dtype, ref)
        assert_within(f"batch {batch} expand", expanded, reference_lora_b(yi, b, ref, offsets),
                      reference_lora_b(yi.abs(), b.abs(), mag_ref, offsets), dtype, ref)
        assert_within(f"batch {batch} packed layer", packed,
                      basei.float().cpu() + reference_lora_b(want_shrink, b, ref, offsets),
                      basei.float().cpu().abs() + reference_lora_b(mag_shrink, b.abs(), mag_ref, offsets), dtype, ref)
        for pruned, h, out in ((False, hi, head), (True, hpi, head_pruned)):
            view, mag_view = ref.lm_head_view(pruned), mag_ref.lm_head_view(pruned)
            want = reference_lora_b(reference_lora_a(h, a_lm, view), b_lm, view, [0, vocab])
            mag = reference_lora_b(reference_lora_a(h.abs(), a_lm.abs(), mag_view), b_lm.abs(), mag_view, [0, vocab])
            assert_within(f"batch {batch} lm_head (pruned={pruned})", out, want, mag, dtype, view)


# ----------------------------------------------------------------------------- embeddings
EMBEDDING_CASES = dict(case=scenarios(), vocab=st.integers(1, 64), added=st.integers(1, 4), dim=st.integers(1, 16),
                       id_dtype=st.sampled_from([torch.int32, torch.int64]), embed_scale=st.floats(0.25, 4))


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("mode", ["eager", "graph"])
@given(**EMBEDDING_CASES)
@budget(ci=15, long=400)
def test_embedding_ops_match_reference(device, backend_name, mode, case, vocab, added, dim, id_dtype, embed_scale):
    only_compile_devices(device, False)
    check_embedding_ops(device, backend_name, mode, case, vocab, added, dim, id_dtype, embed_scale)


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("mode", ["graph"])
@given(**EMBEDDING_CASES)
@budget(ci=4, long=60)
def test_embedding_ops_match_reference_compiled(device, backend_name, mode, case, vocab, added, dim, id_dtype,
                                                embed_scale):
    only_compile_devices(device, True)
    check_embedding_ops(device, backend_name, mode, case, vocab, added, dim, id_dtype, embed_scale)


def check_embedding_ops(device, backend_name, mode, case, vocab, added, dim, id_dtype, embed_scale):
    """The embedding shrink (in-vocabulary, added-token, out-of-vocabulary, negative and huge
    ids) and the added-token rows (only tokens with an adapter take them; rows without
    one keep their base row, padding included) equal the reference for A and B."""
    case = scenario(device, case, backend_name, mode)
    runner = Runner(device, case)
    dtype, R, ranks, L = case["dtype"], case["R"], case["ranks"], len(case["ranks"])
    gen = torch.Generator().manual_seed(case["seed"])
    rows = runner.max_rows
    a = torch.randn(L, R, vocab + added, generator=gen)
    b = torch.randn(L, dim, R, generator=gen)
    fill_embedding_garbage(a, b, ranks)
    extra = torch.randn(L, added, dim, generator=gen)
    ids = torch.randint(-3, vocab + added + 3, (rows,), generator=gen)
    extremes = torch.tensor([2**31 - 1, -(2**31)] + ([2**40, -(2**40)] if id_dtype == torch.int64 else []))
    pick = torch.rand(rows, generator=gen) < 0.1
    ids = torch.where(pick, extremes[torch.randint(0, len(extremes), (rows,), generator=gen)], ids).to(id_dtype)
    base = torch.randn(rows, dim, generator=gen)
    dev = device.torch_device
    a = _strided(a.to(dev, dtype), case["strided"])
    extra, base, ids = extra.to(dev, dtype), base.to(dev, dtype), ids.to(dev)
    backend = make_backend(case["backend"], device, case["kernel"])

    def embedding(info, ids, base):
        backend.prepare_batch(info)
        shrunk = backend.run_lora_a_embedding(ids, a, vocab, extra)
        acc = base.clone()
        rows_out = backend.run_added_tokens(ids, extra, vocab, acc, embed_scale)
        assert rows_out is acc, "run_added_tokens must update base_output in place and return it"
        return shrunk, rows_out

    results = runner.run(embedding, lambda info, n: (ids[:n], base[:n]))
    for (outs, (idsi, basei)), ref, mag_ref, batch in zip(results, runner.references(),
                                                          runner.references(absolute=True), "AB"):
        shrunk, rows_out = outs
        assert shrunk.dtype == dtype and rows_out.dtype == dtype
        assert_within(f"batch {batch} embedding shrink", shrunk, reference_lora_a_embedding(idsi, a, ref, vocab, added),
                      reference_lora_a_embedding(idsi, a.abs(), mag_ref, vocab, added), dtype, ref)
        want = basei.float().cpu().clone()
        slots = ref.token_slots_cpu.tolist()
        for t, token in enumerate(idsi.tolist()):
            if t < len(slots) and slots[t] >= 0 and vocab <= token < vocab + added:
                want[t] = embed_scale * extra[slots[t], token - vocab].float().cpu()
        assert_within(f"batch {batch} added-token rows", rows_out, want, want.abs(), dtype, ref)


# ----------------------------------------------------------------------------- the expand alone
# Bug class 9 (docs/bug-classes.md): garbage beyond every row's rank in *every* slice of the
# expand's input, on batches drawn to take each control layout: the scenario's requests
# (mostly segments), single tokens mostly on one hot slot (slot blocks in two runs), single
# tokens spread over the slots (slot blocks); tests/test_backend_conformance.py adds slot groups.
@st.composite
def decode_requests(draw, ranks: list[int], num_tokens: int, hot: bool):
    """``num_tokens`` single-token requests. ``hot``: every slot (rank 0 included), slot -1
    and ``None`` once each at inner positions, the rest on one slot with a rank, so that
    padding every slot's group to the hot one would more than double the rows when at least
    three slots have a rank (a block of one row per slot, then the hot slot's rest); else slots
    drawn freely."""
    L = len(ranks)
    if not hot:
        slot = st.one_of(st.none(), st.integers(-1, L - 1))
        return [1] * num_tokens, draw(st.lists(slot, min_size=num_tokens, max_size=num_tokens))
    hot_slot = draw(st.sampled_from([s for s, r in enumerate(ranks) if r > 0]))
    others = [s for s in range(L) if s != hot_slot] + [-1, None]
    positions = draw(st.permutations(range(1, num_tokens - 1)))[: len(others)]
    slots: list = [hot_slot] * num_tokens
    for pos, s in zip(positions, others):
        slots[pos] = s
    return [1] * num_tokens, slots


EXPAND_CASES = dict(case=scenarios(), num_slices=st.integers(2, 3),
                    widths=st.lists(st.integers(1, 24), min_size=3, max_size=3, unique=True),
                    layout=st.sampled_from(["requests", "hot slot", "spread"]), garbage_in_b=st.booleans(),
                    data=st.data())


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("mode", ["eager", "graph"])
@given(**EXPAND_CASES)
@budget(ci=15, long=400)
def test_expand_reads_nothing_beyond_each_slots_rank(device, backend_name, mode, case, num_slices, widths, layout,
                                                     garbage_in_b, data):
    only_compile_devices(device, False)
    check_expand_beyond_rank(device, backend_name, mode, case, num_slices, widths, layout, garbage_in_b, data)


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("mode", ["graph"])
@given(**EXPAND_CASES)
@budget(ci=4, long=60)
def test_expand_reads_nothing_beyond_each_slots_rank_compiled(device, backend_name, mode, case, num_slices, widths,
                                                              layout, garbage_in_b, data):
    only_compile_devices(device, True)
    check_expand_beyond_rank(device, backend_name, mode, case, num_slices, widths, layout, garbage_in_b, data)


def check_expand_beyond_rank(device, backend_name, mode, case, num_slices, widths, layout, garbage_in_b, data):
    """The expand alone, for A and B, on an input with garbage beyond each row's rank in every
    slice (the largest rank the row has in A or B: no batch may read it), and B with or
    without garbage beyond the ranks, equals the reference, which reads ``y[:, i*R : i*R + r]``
    and ``B[:, :r]`` of each slice only."""
    if layout != "requests":  # decode batches; "hot slot" adds three slots with a rank
        R = case["R"]
        extra = data.draw(st.lists(st.integers(1, R), min_size=3, max_size=3)) if layout == "hot slot" else []
        ranks = case["ranks"] + extra
        n = data.draw(st.integers(len(ranks) + 4, 48))
        case = {**case, "ranks": ranks, "scalings": case["scalings"] + [0.5] * len(extra),
                "batch_a": data.draw(decode_requests(ranks, n, layout == "hot slot")),
                "batch_b": data.draw(decode_requests(ranks, n, layout == "hot slot"))}
    case = scenario(device, case, backend_name, mode)
    runner = Runner(device, case)
    dtype, R, ranks, L = case["dtype"], case["R"], case["ranks"], len(case["ranks"])
    widths = [8 * w for w in widths[:num_slices]] if case["aligned"] else widths[:num_slices]
    offsets = [0]
    for w in widths:
        offsets.append(offsets[-1] + w)
    refs, mag_refs = runner.references(), runner.references(absolute=True)
    if not runner.use_graph and backend_name == "torch_native":
        from lora_cuda.control_plan import ControlPlan

        event(f"{layout}: control layout {ControlPlan.build(refs[0]).layout}")
    gen = torch.Generator().manual_seed(case["seed"])
    b = torch.randn(L, offsets[-1], R, generator=gen) / R**0.5
    if garbage_in_b:  # else only the input's garbage shows a read beyond a rank
        for slot, r in enumerate(ranks):
            b[slot, :, r:] = GARBAGE
    y = torch.randn(runner.max_rows, num_slices * R, generator=gen)
    fill_expand_input_garbage(y, ranks, num_slices, *(ref.token_slots_cpu.tolist() for ref in refs))
    dev = device.torch_device
    b = _strided(b.to(dev, dtype), case["strided"])
    y = y.to(dev, dtype)
    backend = make_backend(case["backend"], device, case["kernel"])

    def expand(info, y):
        backend.prepare_batch(info)
        return backend.run_lora_b(y, b, offsets)

    results = runner.run(expand, lambda info, n: (y[:n],))
    for (out, (yi,)), ref, mag_ref, batch in zip(results, refs, mag_refs, "AB"):
        assert out.dtype == dtype and out.shape == (yi.shape[0], offsets[-1])
        assert_within(f"batch {batch} expand", out, reference_lora_b(yi, b, ref, offsets),
                      reference_lora_b(yi.abs(), b.abs(), mag_ref, offsets), dtype, ref)
