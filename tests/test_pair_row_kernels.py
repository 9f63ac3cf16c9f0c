"""The kernels that read a mixed batch's pair rows by token row (issue #40, part 5): lora_cuda's shrink and
expand with ``pair_rows=True``, which both built-in backends run for a batch with weighted mixes.

Each row of ``batch_info.pairs.view`` (the tokens, then the pair rows) reads ``x`` at its token row and
adds its delta into its token's row, with no gathered copy of ``x``, no zero-filled delta and no
scatter of it afterwards. Every path is checked here, against lora_core's reference math and against
``BatchInfoBackend``'s own pair ops (which gather ``x`` by token row and scatter the deltas back: what a
backend without such kernels runs): the control plan's three layouts (segments, slot groups, slot
blocks), the grouped and blocked graph-safe kernels, eager and graph-mode batches, a new output and a
strided one (a column view, as vLLM passes one slice of a packed output), fp32 and bf16. Captures,
compiles and every device parameter run these kernels in tests/test_request_scales.py (its ``mixes``
cases).
"""

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
    # single tokens, most on slot 0: padding every slot to its group would double the rows: slot groups
    "slot groups": ([1] * 30, [0] * 20 + [{1: 0.5, 0: 0.5}, {3: 1.0, 1: 0.25}] * 4 + [None, 2]),
    # single tokens spread evenly over the slots: one block per slot (one bmm)
    "slot blocks": ([1] * 24, [{s: 0.6, (s + 1) % 4: 0.4} if t % 3 == 0 else s for t, s in
                               ((t, t % 4) for t in range(24))]),
}


def _control_layout(info) -> str:
    from lora_cuda.control_plan import ControlPlan

    plan = info.pairs.view.plan(ControlPlan)
    return "slot blocks" if plan.slot_blocks is not None else "slot groups" if plan.by_slot else "segments"


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("kernel", ["auto", "grouped", "blocked"])
@pytest.mark.parametrize("layout", list(MIXES))
@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("into", ["new", "column view"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_every_kernel_path_reads_the_pair_rows_by_token_row(backend_name, kernel, layout, mode, into, dtype):
    seq_lens, slot_ids = MIXES[layout]
    T = sum(seq_lens)
    scales = [0.5 + 0.25 * (i % 4) for i in range(len(seq_lens))]
    gen = torch.Generator().manual_seed(len(layout) + 7 * (mode == "graph"))
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
        assert _control_layout(info) == layout

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
