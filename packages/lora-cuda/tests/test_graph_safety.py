"""Graph safety and cost of the torch_native ops (docs/upstream-failures.md, failures 1, 4 and 5)."""

import pytest
import torch

from lora_core.reference import reference_lora_a
from lora_core.testing import (
    GraphSimulator,
    assert_close_to_reference,
    count_launches,
    make_batch_info,
    random_linear_weights,
)
from lora_cuda import (
    control_ops,
    BlockPlan,
    ControlPlan,
    TorchNativeBackend,
    graph_kernel,
    sgemm_lora_a_control_fwd,
    sgemm_lora_a_embedding_fwd,
    sgemm_lora_a_fwd,
    sgemm_lora_a_graph_fwd,
    sgemm_lora_b_control_fwd,
    sgemm_lora_b_fwd,
    sgemm_lora_b_graph_fwd,
)

RANKS = [16, 3, 0, 8]  # below R, zero, full
KERNELS = ["grouped", "blocked"]


@pytest.fixture(params=KERNELS)
def kernel(request):
    """Run the test with each graph kernel (grouped GEMM, token blocks), passed as the ops' option."""
    return request.param


def _weights(num_slices, widths, ranks=RANKS, R=16, in_features=32, num_slots=None):
    gen = torch.Generator().manual_seed(1)
    a, b, offsets = random_linear_weights(gen, num_slots=num_slots or len(ranks), max_rank=R, in_features=in_features,
                                          slice_widths=widths, lora_ranks=ranks, dtype=torch.float32, device="cpu")
    return a, b, offsets, torch.randn(20, in_features, generator=gen)


@pytest.mark.parametrize("widths", [[24], [24, 8], [32, 8, 8]], ids=["1-slice", "gate_up", "qkv-gqa"])
def test_graph_and_control_paths_agree_when_ranks_are_below_max_rank(widths, kernel):
    # upstream failure 4: with several slices and rank < R the paths diverged upstream.
    a, b, offsets, x = _weights(len(widths), widths)
    batch = ([3, 5, 2, 6, 4], [0, 1, 3, None, 1])
    eager = make_batch_info(*batch, RANKS, device="cpu")
    graph = make_batch_info(*batch, RANKS, device="cpu", use_graph=True)
    c = len(widths)
    assert graph_kernel(graph, 20, a, 32, 16 * c, preference=kernel) == kernel
    y_control, y_graph = sgemm_lora_a_fwd(x, a, eager, c), sgemm_lora_a_fwd(x, a, graph, c, graph_kernel=kernel)
    torch.testing.assert_close(y_control, y_graph, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sgemm_lora_b_fwd(y_control, b, eager, offsets),
                               sgemm_lora_b_fwd(y_graph, b, graph, offsets, graph_kernel=kernel), rtol=1e-5, atol=1e-5)
    assert_close_to_reference(y_graph, reference_lora_a(x, a, eager, c))


def test_control_path_is_refused_under_capture():
    a, b, offsets, x = _weights(1, [24])
    eager = make_batch_info([10, 10], [0, 1], RANKS, device="cpu")
    for op, args in [(sgemm_lora_a_control_fwd, (x, a, eager)),
                     (sgemm_lora_b_control_fwd, (torch.zeros(20, 16), b, eager, offsets))]:
        with pytest.raises(RuntimeError, match="control-flow op"):
            GraphSimulator(strict=True).capture(op, *args)
    with pytest.raises(RuntimeError, match="use_graph=True"):  # the dispatcher too, for an eager batch info
        GraphSimulator(strict=True).capture(lambda x: sgemm_lora_a_fwd(x, a, eager), x)


def test_why_the_control_path_is_refused_its_replay_is_stale(monkeypatch):
    # Without the guard, a captured control op replays the capture-time segments.
    monkeypatch.setattr(control_ops, "is_capturing", lambda: False)
    a, _, _, x = _weights(1, [24])
    info = make_batch_info([10, 10], [0, 1], RANKS, device="cpu")
    info.plan(ControlPlan)  # planned before the capture, as a backend's prepare_batch does
    holder = {"info": info}
    sim = GraphSimulator(strict=False)
    out = sim.capture(lambda x: sgemm_lora_a_control_fwd(x, a, holder["info"]), x)
    holder["info"] = make_batch_info([4, 16], [3, 0], RANKS, device="cpu")
    sim.replay()
    assert not torch.allclose(out, reference_lora_a(x, a, holder["info"]))


def test_control_path_makes_no_host_reads():
    a, b, offsets, x = _weights(2, [24, 8])
    for batch in [([3, 5, 2, 6, 4], [0, 1, 3, None, 1]), ([1] * 20, [t % 4 for t in range(20)])]:
        info = make_batch_info(*batch, RANKS, device="cpu")
        TorchNativeBackend("cpu").prepare_batch(info)  # planning reads host mirrors; the ops read nothing
        counts = count_launches(lambda: sgemm_lora_b_fwd(sgemm_lora_a_fwd(x, a, info, 2), b, info, offsets))
        assert counts.host_reads == 0, counts.reads


def _graph_counts(seq_lens, slots, ranks, num_slots, widths=(24, 8), kernel="auto"):
    a, b, offsets, x = _weights(len(widths), list(widths), ranks=ranks, num_slots=num_slots)
    x = torch.randn(sum(seq_lens), 32)
    info = make_batch_info(seq_lens, slots, ranks, device="cpu", use_graph=True)
    ids = torch.arange(sum(seq_lens))
    emb = torch.randn(len(ranks), 16, 64)
    y = torch.randn(x.shape[0], 16 * len(widths))
    sgemm_lora_a_graph_fwd(x, a, info, len(widths), kernel=kernel)  # plans are built on the first call
    sgemm_lora_b_graph_fwd(y, b, info, offsets, kernel=kernel)
    return (
        count_launches(lambda: sgemm_lora_a_graph_fwd(x, a, info, len(widths), kernel=kernel)),
        count_launches(lambda: sgemm_lora_b_graph_fwd(y, b, info, offsets, kernel=kernel)),
        count_launches(lambda: sgemm_lora_a_embedding_fwd(ids, emb, info, 64)),
    )


@pytest.mark.parametrize("num_segments", [1, 8, 64])
def test_graph_ops_launch_the_same_kernels_whatever_the_segments(num_segments, kernel):
    ranks = [16, 8, 4, 16, 2, 16, 1, 16]
    seq = [64 // num_segments] * num_segments
    slots = [s % 8 for s in range(num_segments)]
    reference = _graph_counts([64], [0], ranks, 8, kernel=kernel)
    counts = _graph_counts(seq, slots, ranks, 8, kernel=kernel)
    for got, ref in zip(counts, reference):
        assert got.ops == ref.ops and got.host_reads == 0
    print(f"{kernel} segments={num_segments}: shrink/expand/embedding ops = {[c.ops for c in counts]}")


def test_graph_path_flops_do_not_grow_with_the_number_of_slots(kernel):
    # upstream failure 5: upstream multiplied every token by every slot (L x the FLOPs).
    T = 512
    macs = {}
    for L in (1, 8):
        ranks = [16] * L
        shrink, expand, _ = _graph_counts([T], [0], ranks, L, widths=(32,), kernel=kernel)
        macs[L] = shrink.matmul_macs + expand.matmul_macs
        one_pass = 2 * T * 32 * 16  # shrink + expand of every token with its own adapter
        # padding is at most one block per slot
        info = make_batch_info([T], [0], ranks, device="cpu", use_graph=True)
        assert macs[L] <= one_pass * (T + L * info.plan(BlockPlan).block_size) / T
    assert macs[8] < 2 * macs[1], macs
