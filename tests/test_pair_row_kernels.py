"""The kernels that read a mixed batch's pair rows by token row (issue #40, part 5): lora_cuda's shrink and
expand with ``pair_rows=True``, which both built-in backends run for a batch with weighted mixes.

Each row of ``batch_info.pairs.view`` (the tokens, then the pair rows) reads ``x`` at its token row and
adds its delta into its token's row, with no gathered copy of ``x``, no zero-filled delta and no
scatter of it afterwards. Every path is checked here, against lora_core's reference math and against
``BatchInfoBackend``'s own pair ops (which gather ``x`` by token row and scatter the deltas back: what a
backend without such kernels runs): the control plan's layouts (segments, slot groups, slot blocks in
one run and in two), the grouped and blocked graph-safe kernels (the grouped one in one and in several
chunks of sorted rows), eager and graph-mode batches, a new output and a strided one (a column view, as
vLLM passes one slice of a packed output), fp32 and bf16. Captures,
compiles and every device parameter run these kernels in tests/test_request_scales.py (its ``mixes``
cases).
"""

import importlib.util
import re
from pathlib import Path

import pytest
import torch

from lora_core import BatchInfoBackend, available_backends, build_batch_info, get_backend
from lora_core.reference import reference_lora_a, reference_lora_b
from lora_core.testing import assert_close_to_reference, random_linear_weights

BACKENDS = available_backends()
RANKS, SCALINGS = [8, 3, 0, 5], [2.0, 0.5, 1.0, 1.5]
MIXES = {
    # long requests: the view's segments average over 64 rows, so the control plan loops over segments
    "segments": ([70, 80, 75], [{0: 0.5, 1: 1.0}, 1, [(3, 0.7), (0, 0.2), (1, 1.0)]]),
    # single tokens, slots holding 113, 57 and 1 rows: every block layout pads more rows than a GEMM costs
    "slot groups": ([1] * 117, [{0: 0.5, 1: 0.5}, 0] * 56 + [1, 0, 3, None, 2]),
    # single tokens, most on slot 0: a block of 8 rows per slot, then slot 0's other 56 rows
    "slot blocks in two runs": ([1] * 70, [0] * 60 + [{1: 0.5, 0: 0.5}, {3: 1.0, 1: 0.25}] * 4 + [None, 2]),
    # single tokens spread evenly over the slots: one block per slot (one bmm)
    "slot blocks": ([1] * 24, [{s: 0.6, (s + 1) % 4: 0.4} if t % 3 == 0 else s for t, s in
                               ((t, t % 4) for t in range(24))]),
    # 1120 rows: over the grouped kernel's 512 sorted rows per chunk on CPU (and segments, eagerly)
    "chunks": ([300, 260], [{0: 0.5, 1: 1.0}, {3: 0.7, 1: 0.3}]),
}
CONTROL_LAYOUTS = {**{layout: layout for layout in MIXES}, "chunks": "segments"}


def _control_layout(info) -> str:
    from lora_cuda.control_plan import ControlPlan

    plan = info.pairs.view.plan(ControlPlan)
    return plan.layout


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("kernel", ["auto", "grouped", "blocked"])
@pytest.mark.parametrize("layout", list(MIXES))
@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("into", ["new", "column view"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_every_kernel_path_reads_the_pair_rows_by_token_row(backend_name, kernel, layout, mode, into, dtype):
    if backend_name == "torch_native" and mode == "eager" and kernel != "auto":
        pytest.skip("torch_native's eager batches run the control plan, whatever the graph kernel")
    seq_lens, slot_ids = MIXES[layout]
    T = sum(seq_lens)
    scales = [0.5 + 0.25 * (i % 4) for i in range(len(seq_lens))]
    gen = torch.Generator().manual_seed(list(MIXES).index(layout) + 7 * (mode == "graph"))
    a, b, offsets = random_linear_weights(gen, num_slots=len(RANKS), max_rank=8, in_features=24, slice_widths=[16, 8, 8],
                                          lora_ranks=RANKS, dtype=dtype, device="cpu")
    x = torch.randn(T, 24, generator=gen).to(dtype)
    wide = torch.randn(T, offsets[-1] + 5, generator=gen).to(dtype)
    graph = dict(use_graph=True, max_tokens=T + 3, max_pairs=2 * T + 8) if mode == "graph" else {}
    info = build_batch_info(seq_lens, slot_ids, RANKS, SCALINGS, device="cpu", scales=scales, with_scales=True,
                            **graph)
    reference = build_batch_info(seq_lens, slot_ids, RANKS, SCALINGS, device="cpu", scales=scales)
    backend = get_backend(backend_name)("cpu", graph_kernel=kernel)
    backend.prepare_batch(info)
    if backend_name == "torch_native" and mode == "eager":  # keep the layouts honest
        assert _control_layout(info) == CONTROL_LAYOUTS[layout]

    def run(pair_shrink, pair_expand):
        base = wide.clone()
        out = base[:, 2 : 2 + offsets[-1]] if into == "column view" else None
        shrunk = pair_shrink(backend, x, a, info, 3)
        return shrunk, pair_expand(backend, shrunk, b, info, offsets, out), base

    rows = reference.pairs.view.num_tokens  # the rows without graph-mode padding
    # the ops leave the request scales (here each row's request scale times its mix weight) to the backend
    want_shrunk = reference_lora_a(x, a, reference, 3) / reference.pairs.view.token_scales[:, None]
    for pair_shrink, pair_expand in [(type(backend).pair_shrink, type(backend).pair_expand),
                                     (BatchInfoBackend.pair_shrink, BatchInfoBackend.pair_expand)]:
        shrunk, out, base = run(pair_shrink, pair_expand)
        assert shrunk.shape[0] == info.pairs.view.num_tokens
        assert_close_to_reference(shrunk[:rows], want_shrunk, dtype)
        assert_close_to_reference(shrunk[rows:], torch.zeros(shrunk.shape[0] - rows, shrunk.shape[1]), dtype)
        delta = reference_lora_b(shrunk[:rows], b, reference, offsets)
        if into == "column view":  # added in place; the other columns untouched
            assert out.data_ptr() == base[:, 2:].data_ptr()
            assert torch.equal(base[:, :2], wide[:, :2]) and torch.equal(base[:, 2 + offsets[-1]:], wide[:, 2 + offsets[-1]:])
            delta += wide[:, 2 : 2 + offsets[-1]].float()
        assert_close_to_reference(out[:T], delta, dtype)  # a new graph-mode output has the capacity's rows
        assert not out[T:].any()


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_pair_rows_need_a_batch_with_mixes_and_the_expand_its_tokens_output(backend_name):
    from lora_cuda.control_ops import sgemm_lora_b_control_fwd
    from lora_cuda.graph_kernels import graph_expand
    from lora_cuda.ops import sgemm_lora_a_fwd

    gen = torch.Generator().manual_seed(0)
    a, b, offsets = random_linear_weights(gen, num_slots=2, max_rank=4, in_features=8, slice_widths=[6],
                                          lora_ranks=[4, 2], dtype=torch.float32, device="cpu")
    x = torch.randn(5, 8, generator=gen)
    plain = build_batch_info([3, 2], [0, 1], [4, 2], [1.0, 1.0], device="cpu")
    with pytest.raises(ValueError, match=r"pair_rows=True takes a batch with weighted mixes"):
        sgemm_lora_a_fwd(x, a, plain, pair_rows=True)
    mixed = build_batch_info([3, 2], [{0: 0.5, 1: 0.5}, 1], [4, 2], [1.0, 1.0], device="cpu")
    backend = get_backend(backend_name)("cpu")
    backend.prepare_batch(mixed)
    shrunk = backend.pair_shrink(x, a, mixed, 1)
    view, sources = mixed.pairs.view, mixed.pairs.token_rows
    for expand in (lambda: graph_expand(shrunk, b, view, offsets, None, "auto", sources),
                   lambda: sgemm_lora_b_control_fwd(shrunk, b, view, offsets, None, sources)):
        with pytest.raises(ValueError, match=r"an expand with sources adds into its tokens' rows: pass base_output"):
            expand()
    with pytest.raises(ValueError, match=r"base_output has 4 rows but the batch info was built for 5 tokens"):
        backend.pair_expand(shrunk, b, mixed, offsets, torch.zeros(4, 6))
    with pytest.raises(ValueError, match=r"x has 5 rows; a shrink of this batch gives 8"):
        backend.pair_expand(shrunk[:5], b, mixed, offsets, torch.zeros(5, 6))


def test_the_slot_layouts_benchmark_checks_every_layout_then_times_them(capsys):
    """examples/bench_slot_layouts.py in smoke sizes (what docs/benchmarks.md's "slot layouts" figures
    come from): every layout gives the same delta, and it reports each block layout's ratio to
    slot groups and the plan's choice (the figures are timings: only their form is checked)."""
    path = Path(__file__).resolve().parents[1] / "examples" / "bench_slot_layouts.py"
    spec = importlib.util.spec_from_file_location("example_bench_slot_layouts", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^decode 32, even: 32 rows over 4 slots; slot blocks \(0 padding rows\) / slot groups "
                     r"\d+\.\d\d \(.*\); the plan picks slot blocks$", out, re.M), out
    assert re.search(r"^prefill 8 x 32, a quarter mixed: 288 rows over 4 slots; slot blocks \(224 padding rows\) / "
                     r"slot groups .*; slot blocks in two runs \(32 padding rows\) / slot groups .*; the plan picks "
                     r"slot blocks in two runs$", out, re.M), out
