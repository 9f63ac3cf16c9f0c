"""torch_native ops against lora_core's reference math on every device parameter.

Eager devices run the control-flow path, graph devices the graph-safe path under
capture with batch A and replay with a different batch B (docs/upstream-failures.md, failure 1).
"""

import random

import pytest
import torch

from lora_core import build_batch_info
from lora_core.reference import reference_lora_a, reference_lora_a_embedding, reference_lora_b
from lora_core.testing import (
    BatchPair,
    assert_close_to_reference,
    random_batch_pair,
    random_embedding_weights,
    random_linear_weights,
    random_ranks,
)
from lora_cuda import ControlPlan, SortedPlan, sgemm_lora_a_embedding_fwd, sgemm_lora_a_fwd, sgemm_lora_b_fwd
from lora_cuda.graph_plans import CHUNK_ROWS
from lora_cuda.slot_order import slot_order

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _linear_case(seed, num_slices, dtype, device, *, num_tokens=None, in_features=None, widths=None,
                 num_slots=None, max_rank=None):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    L = num_slots or rng.randint(1, 5)
    R = max_rank or rng.choice([1, 4, 8, 16])
    in_features = in_features or rng.randint(1, 96)
    widths = widths or [rng.randint(1, 48) for _ in range(num_slices)]
    T = num_tokens or rng.randint(1, 80)
    ranks = random_ranks(rng, L, R)
    pair = random_batch_pair(rng, T, ranks)
    a, b, offsets = random_linear_weights(gen, num_slots=L, max_rank=R, in_features=in_features,
                                          slice_widths=widths, lora_ranks=ranks, dtype=dtype,
                                          device=device.torch_device)
    x = torch.randn(T, in_features, generator=gen).to(device.torch_device, dtype)
    base = torch.randn(T, offsets[-1], generator=gen).to(device.torch_device, dtype)
    return pair, a, b, offsets, x, base


def _check_linear(device, pair, a, b, offsets, x, base, dtype, *, strided=False):
    """``strided``: the expand adds into a column view of a wider tensor (one slice of a packed output)."""
    num_slices = len(offsets) - 1

    def layer(info, x, base):
        shrunk = sgemm_lora_a_fwd(x, a, info, num_slices)
        if not strided:
            return shrunk, sgemm_lora_b_fwd(shrunk, b, info, offsets, base.clone())
        wide = torch.cat([base, base[:, :8]], dim=1)  # base's columns, then 8 more
        view = wide[:, : offsets[-1]]
        sgemm_lora_b_fwd(shrunk, b, info, offsets, view)
        return shrunk, view

    (shrink_a, out_a), (shrink_b, out_b) = pair.run(device, layer, x, base)
    for (shrunk, out), ref in zip([(shrink_a, out_a), (shrink_b, out_b)], pair.reference_infos()):
        expected_shrink = reference_lora_a(x, a, ref, num_slices)
        assert_close_to_reference(shrunk, expected_shrink, dtype)
        expected = base.float().cpu() + reference_lora_b(expected_shrink, b, ref, offsets)
        assert_close_to_reference(out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_slices", [1, 2, 3])
@pytest.mark.parametrize("seed", range(4))
def test_shrink_expand_match_reference_on_random_shapes(device, seed, num_slices, dtype):
    case = _linear_case(seed * 10 + num_slices, num_slices, dtype, device)
    _check_linear(device, *case, dtype)


def test_realistic_gqa_qkv_case(device):
    # hidden 4096, q/k/v = 4096/1024/1024, 4 slots of mixed rank up to 64
    case = _linear_case(7, 3, torch.float32, device, num_tokens=24, in_features=4096,
                        widths=[4096, 1024, 1024], num_slots=4, max_rank=64)
    _check_linear(device, *case, torch.float32)


def test_decode_batch_of_single_token_requests(device):
    rng = random.Random(3)
    ranks = [8, 16, 0, 4, 16, 1, 2, 16]
    slots_a = [rng.randrange(8) for _ in range(48)]
    slots_b = [None if t % 7 == 0 else rng.randrange(8) for t in range(48)]
    pair = BatchPair(ranks, ([1] * 48, slots_a), ([1] * 48, slots_b))
    gen = torch.Generator().manual_seed(3)
    a, b, offsets = random_linear_weights(gen, num_slots=8, max_rank=16, in_features=64, slice_widths=[40, 24],
                                          lora_ranks=ranks, dtype=torch.float32, device=device.torch_device)
    x = torch.randn(48, 64, generator=gen).to(device.torch_device)
    base = torch.randn(48, 64, generator=gen).to(device.torch_device)
    _check_linear(device, pair, a, b, offsets, x, base, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_slices", [1, 3])
def test_a_hot_slots_rows_beyond_the_other_slots_blocks(device, num_slices, dtype):
    """Single tokens, most on one slot (another in A and in B): eagerly, slot blocks in two runs, the
    second over the hot slot's rest (in A over two hot slots that are no range of slots: gathered
    weights), with rank-0 slots, slot -1 and requests without an adapter. (The layouts asserted are
    the CPU's: off the CPU the plan takes the fewest GEMMs, one run for A.)"""
    ranks = [8, 0, 3, 16, 5]
    slots_a = [0, 3] * 40 + [2, 4, 1, -1, None, 2]
    slots_b = [4, None] * 40 + [4, 0, 2, 3, -1, 1]
    pair = BatchPair(ranks, ([1] * 86, slots_a), ([1] * 86, slots_b))
    if not device.is_graph:
        assert [ControlPlan.build(ref).layout for ref in pair.reference_infos()] == ["slot blocks in two runs"] * 2
    gen = torch.Generator().manual_seed(num_slices)
    a, b, offsets = random_linear_weights(gen, num_slots=5, max_rank=16, in_features=24,
                                          slice_widths=[16, 8, 24][:num_slices], lora_ranks=ranks, dtype=dtype,
                                          device=device.torch_device)
    x = torch.randn(86, 24, generator=gen).to(device.torch_device, dtype)
    base = torch.randn(86, offsets[-1], generator=gen).to(device.torch_device, dtype)
    _check_linear(device, pair, a, b, offsets, x, base, dtype)


def _requests_of(rng, rows_per_slot):
    """Requests of 1 to 60 rows in random order, ``rows_per_slot[slot]`` rows on each slot
    (``None``: without an adapter)."""
    requests = []
    for slot, rows in rows_per_slot.items():
        while rows:
            n = min(rng.randint(1, 60), rows)
            requests.append((n, slot))
            rows -= n
    rng.shuffle(requests)
    return [n for n, _ in requests], [slot for _, slot in requests]


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous-out", "strided-out"])
@pytest.mark.parametrize("num_slices", [1, 3])
@pytest.mark.parametrize("num_chunks, partial_rows", [(3, 37), (2, 0)], ids=["partial-last-chunk", "full-chunks"])
def test_batches_of_several_grouped_kernel_chunks(device, num_chunks, partial_rows, num_slices, strided):
    # on CPU the grouped kernel works in chunks of CHUNK_ROWS sorted rows, each slot's group cut at the chunk
    # boundaries: slot groups that cross them, active rows in every chunk, mixed ranks (rank 0, slot -1),
    # captured on one batch and replayed on another
    rng = random.Random(num_chunks * 10 + num_slices)
    T, ranks = (num_chunks - 1) * CHUNK_ROWS + (partial_rows or CHUNK_ROWS), [8, 3, 0, 5]
    inactive = 11  # rows without an adapter, after the active ones: every chunk keeps active rows
    shares = [(0.39, 0.29, 0.01), (0.20, 0.45, 0.02)]  # of slots 0, 1, 2 (rank 0); slot 3 takes the rest
    batches = []
    for share in shares:
        rows = [int(f * T) for f in share]
        batches.append(_requests_of(rng, {0: rows[0], 1: rows[1], 2: rows[2], 3: T - inactive - sum(rows),
                                          None: inactive}))
    pair = BatchPair(ranks, *batches)
    widths = [24, 8, 16][:num_slices]  # 16-byte aligned fp32 strides: sizes the grouped kernel takes
    gen = torch.Generator().manual_seed(num_slices)
    a, b, offsets = random_linear_weights(gen, num_slots=4, max_rank=8, in_features=32, slice_widths=widths,
                                          lora_ranks=ranks, dtype=torch.float32, device=device.torch_device)
    x = torch.randn(T, 32, generator=gen).to(device.torch_device)
    base = torch.randn(T, offsets[-1], generator=gen).to(device.torch_device)
    # on a CPU graph-mode batch these sizes take the grouped kernel, in num_chunks chunks, each with active rows
    for batch in batches:
        cpu_info = pair.build(batch, "cpu", use_graph=True)
        sgemm_lora_b_fwd(sgemm_lora_a_fwd(x.cpu(), a.cpu(), cpu_info, num_slices), b.cpu(), cpu_info, offsets)
        assert cpu_info.plan_types == (SortedPlan,)  # no layer fell back to the blocked kernel's plan
        assert len(cpu_info.plan(SortedPlan).chunks) == num_chunks
        assert slot_order(cpu_info).num_active > (num_chunks - 1) * CHUNK_ROWS
    _check_linear(device, pair, a, b, offsets, x, base, torch.float32, strided=strided)


@pytest.mark.parametrize("use_graph", [False, True], ids=["eager", "graph"])
def test_a_batch_built_on_a_device_name_without_index_runs_on_that_devices_tensors(device, use_graph):
    """Regression: a batch built on "cuda" rejected x on cuda:0 ("the batch info lives on cuda but
    x is on cuda:0"), and on the CPU one built on "cpu:0" rejected x on cpu: the batch info now
    keeps the device its tensors report."""
    kind = device.torch_device.type
    gen = torch.Generator().manual_seed(0)
    ranks = [4, 2]
    a, b, offsets = random_linear_weights(gen, num_slots=2, max_rank=4, in_features=8, slice_widths=[6],
                                          lora_ranks=ranks, dtype=torch.float32, device=device.torch_device)
    x = torch.randn(5, 8, generator=gen).to(device.torch_device)
    base = torch.randn(5, 6, generator=gen).to(device.torch_device)
    ref = build_batch_info([3, 2], [0, 1], ranks, [1.0, 0.5], device="cpu")
    expected = base.cpu() + reference_lora_b(reference_lora_a(x.cpu(), a.cpu(), ref), b.cpu(), ref, offsets)
    for name in (kind, f"{kind}:0", torch.device(kind)):
        info = build_batch_info([3, 2], [0, 1], ranks, [1.0, 0.5], device=name, use_graph=use_graph,
                                max_tokens=5 if use_graph else None)
        assert info.device == x.device and info.seg_lens.device == x.device
        out = sgemm_lora_b_fwd(sgemm_lora_a_fwd(x, a, info), b, info, offsets, base.clone())
        assert_close_to_reference(out, expected, torch.float32)


@pytest.mark.parametrize("graph_kernel", ["auto", "blocked"])
@pytest.mark.parametrize("seq_lens", [[1] * 48, [12] * 4], ids=["decode", "prefill"])
def test_garbage_beyond_a_rank_that_overflows_fp16_never_reaches_the_result(device, seq_lens, graph_kernel):
    # the block and grouped kernels compute every row of A, garbage included, and clear what lies beyond
    # a rank afterwards: 64 * 6e4 overflows fp16 to inf there, and inf * 0 is NaN, so clearing must mask
    ranks = [8, 16, 0, 4, 16, 1, 2, 16]
    T = sum(seq_lens)
    slots = [None if i % 7 == 3 else (5 * i) % 8 for i in range(len(seq_lens))]
    pair = BatchPair(ranks, (seq_lens, slots), (seq_lens, slots[::-1]))
    gen = torch.Generator().manual_seed(5)
    a, b, offsets = random_linear_weights(gen, num_slots=8, max_rank=16, in_features=64, slice_widths=[40, 24],
                                          lora_ranks=ranks, dtype=torch.float16, device=device.torch_device,
                                          garbage=6.0e4)
    x = torch.ones(T, 64, dtype=torch.float16, device=device.torch_device)
    base = torch.zeros(T, 64, dtype=torch.float16, device=device.torch_device)

    def layer(info, x, base):
        shrunk = sgemm_lora_a_fwd(x, a, info, 2, graph_kernel=graph_kernel)
        return shrunk, sgemm_lora_b_fwd(shrunk, b, info, offsets, base.clone(), graph_kernel=graph_kernel)

    for (shrunk, out), ref in zip(pair.run(device, layer, x, base), pair.reference_infos()):
        expected_shrink = reference_lora_a(x, a, ref, 2)
        assert_close_to_reference(shrunk, expected_shrink, torch.float16)
        assert_close_to_reference(out, base.float().cpu() + reference_lora_b(expected_shrink, b, ref, offsets),
                                  torch.float16)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("seed", range(3))
def test_embedding_matches_reference_with_oov_and_added_tokens(device, seed, dtype):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    L, R, V, added, D = rng.randint(1, 4), rng.choice([2, 8, 16]), rng.randint(5, 200), rng.randint(0, 3), 12
    T = rng.randint(4, 60)
    ranks = random_ranks(rng, L, R)
    pair = random_batch_pair(rng, T, ranks)
    a, _ = random_embedding_weights(gen, num_slots=L, max_rank=R, vocab_total=V + added, embedding_dim=D,
                                    lora_ranks=ranks, dtype=dtype, device=device.torch_device)
    extra = torch.randn(L, added, D).to(device.torch_device, dtype) if added else None
    ids = torch.randint(0, V + added, (T,), generator=gen)
    ids[: min(T, 4)] = torch.tensor([-1, V + added, 10**9, -(10**9)])[: min(T, 4)]  # out of vocabulary
    ids = ids.to(device.torch_device)

    def shrink(info, ids):
        return sgemm_lora_a_embedding_fwd(ids, a, info, V, extra)

    out_a, out_b = pair.run(device, shrink, ids)
    for out, ref in zip([out_a, out_b], pair.reference_infos()):
        assert_close_to_reference(out, reference_lora_a_embedding(ids, a, ref, V, added), dtype)


def test_realistic_embedding_vocab(device):
    gen = torch.Generator().manual_seed(0)
    ranks = [16, 8, 0, 16]
    pair = BatchPair(ranks, ([5, 3, 8], [0, 1, 3]), ([2, 2, 12], [3, None, 1]))
    a, _ = random_embedding_weights(gen, num_slots=4, max_rank=16, vocab_total=32000, embedding_dim=8,
                                    lora_ranks=ranks, dtype=torch.float32, device=device.torch_device)
    ids = torch.randint(0, 32000, (16,), generator=gen).to(device.torch_device)
    out_a, out_b = pair.run(device, lambda info, ids: sgemm_lora_a_embedding_fwd(ids, a, info, 32000), ids)
    for out, ref in zip([out_a, out_b], pair.reference_infos()):
        assert_close_to_reference(out, reference_lora_a_embedding(ids, a, ref, 32000))
