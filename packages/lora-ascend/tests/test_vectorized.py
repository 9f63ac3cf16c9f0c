"""The ascend backend's vectorized ops: constant launches, bounded memory, eager = graph."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lora_core.reference import reference_lora_a, reference_lora_a_embedding
from lora_core.testing import assert_close_to_reference, count_launches, make_batch_info, random_linear_weights
from lora_cuda import BlockPlan
from lora_ascend import (
    AscendBackend,
    vectorized_lora_a_embedding_fwd,
    vectorized_lora_a_fwd,
    vectorized_lora_b_fwd,
)

H, R, V = 32, 16, 500


def _counts(num_segments, num_slots, use_graph):
    T = 64
    ranks = [R] * num_slots
    seq = [T // num_segments] * num_segments
    slots = [s % num_slots for s in range(num_segments)]
    info = make_batch_info(seq, slots, ranks, device="cpu", use_graph=use_graph)
    AscendBackend("cpu").prepare_batch(info)  # the plans, built before anything is counted
    gen = torch.Generator().manual_seed(0)
    a, b, offsets = random_linear_weights(gen, num_slots=num_slots, max_rank=R, in_features=H, slice_widths=[H],
                                          lora_ranks=ranks, dtype=torch.float32, device="cpu")
    emb = torch.randn(num_slots, R, V)
    x, y, ids = torch.randn(T, H), torch.randn(T, R), torch.randint(0, V, (T,))
    return {
        "embedding": count_launches(vectorized_lora_a_embedding_fwd, ids, emb, info, V).ops,
        "shrink": count_launches(vectorized_lora_a_fwd, x, a, info).ops,
        "expand": count_launches(vectorized_lora_b_fwd, y, b, info, offsets).ops,
    }


@pytest.mark.parametrize("use_graph", [False, True], ids=["eager", "graph"])
def test_launch_counts_do_not_depend_on_segments_or_slots(use_graph):
    table = {(s, L): _counts(s, L, use_graph) for s in (1, 8, 64) for L in (1, 8)}
    print("\n(segments, slots): dispatched ops", *(f"{k}: {v}" for k, v in table.items()), sep="\n  ")
    first = next(iter(table.values()))
    assert all(counts == first for counts in table.values())


def test_eager_batches_run_the_same_ops_as_graph_batches():
    assert _counts(8, 8, False) == _counts(8, 8, True)


class _AllocatedBytes(TorchDispatchMode):
    """Sums the bytes of every tensor the ops create (results written into an ``out=``
    buffer excluded): with the plan's preallocated buffers, an upper bound of the op's
    peak extra memory."""

    def __init__(self):
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view and "out" not in (kwargs or {}):
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self._inputs:
                    self.total += t.numel() * t.element_size()
        return out

    def watch(self, *inputs):
        self._inputs = {t.untyped_storage().data_ptr() for t in inputs}
        return self


@pytest.mark.parametrize("kernel", ["grouped", "blocked"])
def test_peak_memory_of_the_gather_path_is_bounded_at_8192_tokens(kernel):
    T, L, in_features, c = 8192, 8, 256, 3
    seq = [T // 64] * 64
    info = make_batch_info(seq, [s % L for s in range(64)], [R] * L, device="cpu")
    x = torch.randn(T, in_features)
    a = torch.randn(L, c * R, in_features)
    AscendBackend("cpu", graph_kernel=kernel).prepare_batch(info)  # plans are not the op's allocations
    plan = info.plan(BlockPlan)
    rows = plan.gathered_rows
    assert rows <= T + L * plan.block_size  # the documented bound
    with torch.no_grad():
        vectorized_lora_a_fwd(x, a, info, c, graph_kernel=kernel)  # creates the plan's tables and workspaces
        with _AllocatedBytes().watch(x, a) as mode:
            vectorized_lora_a_fwd(x, a, info, c, graph_kernel=kernel)
    held = sum(info.plan(p).kernel_memory_bytes for p in info.plan_types)
    total = mode.total + held
    elem = x.element_size()
    gathered = (rows * in_features + plan.num_blocks * c * R * in_features) * elem  # x blocks + weight blocks
    # the gathered operands dominate; products, masks and the (T, c*R) result are small beside them
    assert total <= 2 * gathered, (mode.total, held, gathered)
    per_token_gather = T * c * R * in_features * elem  # what gathering weights per token would take
    assert total < per_token_gather / 10
    print(f"\n{kernel} T={T}: {total / 2**20:.1f} MiB allocated or held vs {per_token_gather / 2**20:.0f} MiB for per-token gathering")


def test_empty_embedding_weights_give_an_empty_delta():
    info = make_batch_info([3], [0], [0], device="cpu")
    out = vectorized_lora_a_embedding_fwd(torch.tensor([1, 2, 3]), torch.zeros(1, 0, 10), info, 10)
    assert out.shape == (3, 0)


def test_backend_matches_reference_eagerly():
    backend = AscendBackend("cpu")
    ranks = [8, 0, 3]
    info = make_batch_info([5, 1, 1, 4], [0, 2, None, 1], ranks, device="cpu")
    backend.prepare_batch(info)
    gen = torch.Generator().manual_seed(2)
    a, _, _ = random_linear_weights(gen, num_slots=3, max_rank=8, in_features=12, slice_widths=[4, 4],
                                    lora_ranks=ranks, dtype=torch.float32, device="cpu")
    x = torch.randn(11, 12, generator=gen)
    assert_close_to_reference(backend.run_lora_a(x, a, 2), reference_lora_a(x, a, info, 2))
    emb = torch.randn(3, 8, 20, generator=gen)
    ids = torch.tensor([0, 19, 20, -5, 7, 3, 2, 1, 0, 4, 5])
    assert_close_to_reference(backend.run_lora_a_embedding(ids, emb, 20), reference_lora_a_embedding(ids, emb, info, 20))
