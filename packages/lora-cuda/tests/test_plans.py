"""The kernel plans of lora-cuda: built only for the kernel that runs, equal to their definition."""

import random

import numpy as np
import pytest
import torch

from lora_core import build_batch_info
from lora_core.testing import make_batch_info, random_requests
from lora_cuda import BlockPlan, ControlPlan, SortedPlan, TorchNativeBackend
from lora_cuda.block_kernels import BlockRun
from lora_cuda.control_plan import slot_block_size
from lora_cuda.graph_plans import CHUNK_ROWS
from lora_cuda.slot_order import place_in_blocks


def test_segment_plan_lists_active_segments_in_batch_order():
    info = build_batch_info([2, 0, 3, 1, 1], [0, None, 0, 1, -1], [2, 3], [1.0, 2.0], device="cpu")
    plan = info.plan(ControlPlan)
    assert not plan.by_slot and plan.token_perm is None
    assert [(g.slot, g.start, g.end, g.rank, g.scaling) for g in plan.groups] == [(0, 0, 5, 2, 1.0), (1, 5, 6, 3, 2.0)]


def test_short_segments_on_few_slots_become_one_block_per_slot():
    info = build_batch_info([1, 1, 1, 1, 1], [1, 0, 1, None, 2], [4, 4, 0], [1.0, 1.0, 1.0], device="cpu")
    plan = info.plan(ControlPlan)
    # slot 2 has rank 0: no group; slot -1: no group; 3 single-token segments on 2 slots: by slot
    assert plan.by_slot
    assert [(g.slot, g.start, g.end) for g in plan.groups] == [(0, 0, 1), (1, 1, 3)]
    # padded to the largest group (2 rows): 4 block rows for 3 tokens, so one bmm for both slots
    blocks = plan.slot_blocks
    assert (blocks.runs, blocks.run_ranges) == ((BlockRun(0, 2, 2),), ((0, 2),))
    assert blocks.cell_valid.tolist() == [True, False, True, True]
    assert blocks.block_tokens[blocks.cell_valid].tolist() == [1, 0, 2]
    assert blocks.cell_ranks.tolist() == [4, 4, 4, 4] and blocks.cell_scalings.tolist() == [1.0] * 4
    # each token's row in the blocks; tokens without an adapter read a padding row (zero once masked)
    assert blocks.token_rows.tolist() == [2, 0, 3, 1, 1]


def test_a_slots_rows_beyond_the_other_slots_groups_take_a_second_run_of_blocks():
    # 20 single-token requests on slot 0 between base-model ones, one each on slots 1 and 2: 3 blocks
    # of 20 rows would be 60 rows for 22 tokens; one block of 1 row per slot and slot 0's other 19 rows
    # in a second run (one more cell: the base-model rows' padding cell) is two bmms with no padding
    seq_lens, slot_ids = [1] * 42, [0, None] * 20 + [1, 2]
    info = build_batch_info(seq_lens, slot_ids, [4, 2, 3], [1.0, 2.0, 3.0], device="cpu")
    plan = info.plan(ControlPlan)
    assert [(g.slot, g.start, g.end) for g in plan.groups] == [(0, 0, 20), (1, 20, 21), (2, 21, 22)]
    blocks = plan.slot_blocks
    assert (blocks.runs, blocks.run_ranges) == ((BlockRun(0, 3, 1), BlockRun(3, 1, 20)), ((0, 3), (0, 1)))
    assert blocks.block_tokens.tolist() == [0, 40, 41, *range(2, 40, 2), 0]
    assert blocks.cell_valid.tolist() == [True] * 22 + [False]
    assert blocks.cell_ranks.tolist() == [4, 2, 3] + [4] * 20
    assert blocks.cell_scalings.tolist() == [1.0, 2.0, 3.0] + [1.0] * 20
    assert blocks.token_rows.tolist() == [0, 22] + [x for j in range(19) for x in (3 + j, 22)] + [1, 2]
    a = torch.randn(3, 4, 8)
    assert blocks.run_weights(a, 0) is a
    assert blocks.run_weights(a, 1).data_ptr() == a.data_ptr() and blocks.run_weights(a, 1).shape == (1, 4, 8)


def test_a_second_run_of_slots_that_are_no_range_gathers_their_weights():
    # slots 0 and 2 hold 40 rows, slots 1 and 3 one: the rest of slots 0 and 2 is a second run over (0, 2)
    slot_ids = [0, 2] * 40 + [1, 3]
    info = build_batch_info([1] * 82, slot_ids, [2, 2, 2, 2], [1.0] * 4, device="cpu")
    blocks = info.plan(ControlPlan).slot_blocks
    assert (blocks.runs, blocks.run_ranges) == ((BlockRun(0, 4, 1), BlockRun(4, 2, 39)), ((0, 4), None))
    assert blocks.run_slots[1].tolist() == [0, 2]
    a = torch.randn(4, 2, 8)
    torch.testing.assert_close(blocks.run_weights(a, 1), a[[0, 2]], rtol=0, atol=0)


def test_slot_groups_run_where_every_block_layout_pads_more_rows_than_its_bmms_save():
    # groups of 1, 49, 97, 145 and 193 rows: one run pads 480 rows and the best two runs 192, more than
    # the GEMMs they save cost on the CPU (48 rows each): one GEMM per slot
    counts = [1 + 48 * s for s in range(5)]
    slot_ids = [s for t in range(max(counts)) for s in range(5) if t < counts[s]]  # single tokens, interleaved
    info = build_batch_info([1] * len(slot_ids), slot_ids, [4] * 5, [1.0] * 5, device="cpu")
    plan = info.plan(ControlPlan)
    assert plan.by_slot and plan.slot_blocks is None and plan.layout == "slot groups"
    assert [g.num_tokens for g in plan.groups] == counts
    assert plan.token_perm.tolist() == sorted(range(len(slot_ids)), key=lambda t: slot_ids[t])


@pytest.mark.parametrize(("counts", "on_the_cpu", "where_launches_cost"), [
    ([8, 8, 8, 8], 8, 8),  # even: one run, no padding
    ([6, 8, 14, 7], 14, 14),  # a mixed decode: one run pads 21 rows, two runs 3 for one more GEMM
    ([32, 64, 64, 64], 64, 64),  # a prefill: one run pads 32 rows, two runs none for one more GEMM
    ([32, 64, 128, 64], 64, 128),  # a quarter of it mixed: one run pads 224 rows, two runs 32
    ([64, 16, 16, 16], 16, 16),  # one run pads 144 rows, two runs none
    ([20, 1, 1], 1, 1),  # one run would triple the rows: two runs everywhere
    ([1, 49, 97, 145, 193], None, 193),  # two runs pad 192 rows, more than the 3 GEMMs they save
    ([1, 2, 4, 8, 16, 32, 64], 16, 16),  # over twice the rows in one run (448 for 127)
    ([5], 5, 5),  # one slot: one run, whatever the platform
])
def test_slot_block_size_takes_the_fewest_gemms_where_launches_cost_else_the_fewest_rows_and_gemms(
        counts, on_the_cpu, where_launches_cost):
    assert slot_block_size(counts, launches_cost=False) == on_the_cpu
    assert slot_block_size(counts, launches_cost=True) == where_launches_cost


def test_slot_blocks_on_the_cpu_take_a_second_run_where_one_would_pad_more_rows_than_a_gemm_costs():
    # 8 requests of 16 tokens, slot 0 on four: blocks of 64 rows for 4 slots would be 256 rows for 112
    # tokens; a run of 16-row blocks and one of slot 0's other 48 rows (and the base-model rows'
    # padding cell) pads none
    prefill = build_batch_info([16] * 8, [0, 1, 0, 2, 0, 3, 0, None], [4] * 4, [1.0] * 4, device="cpu")
    plan = prefill.plan(ControlPlan)
    assert [(g.slot, g.num_tokens) for g in plan.groups] == [(0, 64), (1, 16), (2, 16), (3, 16)]
    assert plan.slot_blocks.runs == (BlockRun(0, 4, 16), BlockRun(64, 1, 49))
    # the same spread over single tokens pads 8 rows: one bmm
    decode = build_batch_info([1] * 16, [0, 1, 0, 2, 0, 1, 2, 3] * 2, [4] * 4, [1.0] * 4, device="cpu")
    assert decode.plan(ControlPlan).slot_blocks.runs == (BlockRun(0, 4, 6),)


def test_long_segments_prefer_the_segment_loop():
    info = build_batch_info([100, 100, 100], [0, 1, 0], [4, 4], [1.0, 1.0], device="cpu")
    assert not info.plan(ControlPlan).by_slot


def test_an_eager_torch_native_batch_builds_no_static_kernel_plan():
    info = make_batch_info([3, 5], [0, 1], [4, 4], device="cpu")
    TorchNativeBackend("cpu").prepare_batch(info)
    assert info.plan_types == (ControlPlan,)
    graph = make_batch_info([3, 5], [0, 1], [4, 4], device="cpu", use_graph=True)
    TorchNativeBackend("cpu", graph_kernel="blocked").prepare_batch(graph)
    assert graph.plan_types == (BlockPlan,)
    assert graph.lm_head_view(pruned=True).plan_types == (BlockPlan,)


def _sorted_by_definition(token_slots, ranks):
    """Active rows grouped by slot in row order, then the other rows in row order."""
    active = [t for t, s in enumerate(token_slots) if s >= 0 and ranks[s] > 0]
    order = sorted(active, key=lambda t: token_slots[t]) + [t for t in range(len(token_slots)) if t not in active]
    ends, end = [], 0
    for slot in range(len(ranks)):
        end += sum(1 for t in active if token_slots[t] == slot)
        ends.append(end)
    ends[-1] = len(token_slots)
    return order, ends


def _check_static_plans(info, ranks):
    sorted_plan, blocks = info.plan(SortedPlan), info.plan(BlockPlan)
    token_slots = info.token_slots_cpu.tolist()
    order, ends = _sorted_by_definition(token_slots, ranks)
    assert sorted_plan.sorted_tokens.tolist() == order
    # chunks of chunk_rows sorted rows; in each, a slot's group ends after the chunk's rows
    # of that slot's group and of the groups before it
    group_of = [next(g for g, end in enumerate(ends) if p < end) for p in range(len(order))]
    starts = range(0, len(order), sorted_plan.chunk_rows) if order else []
    assert [(c.start, c.stop) for c in sorted_plan.chunks] == [
        (start, min(start + sorted_plan.chunk_rows, len(order))) for start in starts]
    assert sorted_plan.group_ends.tolist() == [
        [sum(1 for g in group_of[c.start : c.stop] if g <= slot) for slot in range(len(ranks))]
        for c in sorted_plan.chunks]
    assert [c.tokens.tolist() for c in sorted_plan.chunks] == [order[c.start : c.stop] for c in sorted_plan.chunks]
    assert sorted_plan.sorted_ranks.tolist() == [ranks[token_slots[t]] if token_slots[t] >= 0 else 0 for t in order]
    scalings = info.scalings_cpu.tolist()  # 0 for the rows without an adapter (slot -1 or rank 0)
    assert sorted_plan.sorted_scalings.tolist() == [
        scalings[token_slots[t]] if token_slots[t] >= 0 and ranks[token_slots[t]] else 0.0 for t in order]
    # blocks: every active token exactly once, in a block of its own slot, with that slot's rank
    valid = blocks.block_valid
    tokens = blocks.block_tokens.view(valid.shape)
    seen = []
    for j in range(blocks.num_blocks):
        members = tokens[j][valid[j]].tolist()
        seen += members
        assert all(token_slots[t] == int(blocks.block_slots[j]) for t in members)
        assert int(blocks.block_ranks[j]) == (ranks[token_slots[members[0]]] if members else int(blocks.block_ranks[j]))
    assert sorted(seen) == [t for t, s in enumerate(token_slots) if s >= 0 and ranks[s] > 0]
    # a slot's rows in row order through its blocks; padding cells hold row 0; each row's cell
    # in token_rows, the first padding cell for the rows without an adapter
    cells, filled = blocks.block_tokens.tolist(), valid.reshape(-1).tolist()
    assert all(row == 0 for row, f in zip(cells, filled) if not f)
    cell_slots = blocks.block_slots.repeat_interleave(blocks.block_size).tolist()
    for slot in set(cell_slots):
        rows = [row for row, f, s in zip(cells, filled, cell_slots) if f and s == slot]
        assert rows == sorted(rows)
    padding = filled.index(False)
    position = {row: j for j, row in enumerate(cells) if filled[j]}
    assert blocks.token_rows.tolist() == [position.get(t, padding) for t in range(len(token_slots))]


@pytest.mark.parametrize("seed", range(6))
def test_static_plans_match_their_definition_and_refill_in_place(seed):
    rng = random.Random(seed)
    L = rng.randint(1, 6)
    capacity = rng.randint(1, 90) if seed % 2 else rng.randint(CHUNK_ROWS + 1, 3 * CHUNK_ROWS)  # several chunks
    ranks = [rng.choice([0, 1, 4, 8]) for _ in range(L)]
    info = make_batch_info(*random_requests(rng, capacity, L), ranks, device="cpu", use_graph=True)
    TorchNativeBackend("cpu", graph_kernel="grouped").prepare_batch(info)
    view = info.lm_head_view(pruned=True)
    plans = [info.plan(SortedPlan), info.plan(BlockPlan), view.plan(SortedPlan), view.plan(BlockPlan)]
    tensors = [(p.sorted_tokens, p.group_ends) if isinstance(p, SortedPlan) else (p.block_tokens, p.block_valid)
               for p in plans]
    for step in range(6):
        if step % 2:  # a decode step: one token per request (the view equals the batch)
            n = rng.randint(0, capacity)
            batch = ([1] * n, [rng.choice([None, *range(L)]) for _ in range(n)])
        else:
            batch = random_requests(rng, rng.randint(0, capacity), L)
        info.refill(*batch)
        assert [info.plan(SortedPlan), info.plan(BlockPlan), view.plan(SortedPlan), view.plan(BlockPlan)] == plans
        for p, kept in zip(plans, tensors):
            now = (p.sorted_tokens, p.group_ends) if isinstance(p, SortedPlan) else (p.block_tokens, p.block_valid)
            assert all(a is b for a, b in zip(now, kept))  # refilled in place
        _check_static_plans(info, ranks)
        _check_static_plans(view, ranks)


def test_plans_follow_new_adapter_ranks():
    info = make_batch_info([2, 2], [0, 1], [4, 4], device="cpu", use_graph=True)
    plan = info.plan(SortedPlan)
    info.set_adapters([0, 4], [1.0, 1.0])
    assert plan.sorted_tokens.tolist() == [2, 3, 0, 1] and plan.sorted_ranks.tolist() == [4, 4, 0, 0]


def test_a_plan_is_never_built_during_a_capture():
    from lora_core.testing import GraphSimulator

    info = make_batch_info([2, 2], [0, 1], [4, 4], device="cpu", use_graph=True)
    with pytest.raises(RuntimeError, match="was not built before the graph capture"):
        GraphSimulator(strict=True).capture(lambda: info.plan(BlockPlan))


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="needs torch._grouped_mm (torch >= 2.9)")
def test_the_blocked_plan_is_built_by_the_warm_up_of_a_layer_the_grouped_gemm_rejects():
    # on CPU the graph-safe ops take the grouped GEMM, so prepare_batch builds (and refills) its
    # plan only; a layer with unaligned sizes takes the blocked kernel, whose plan its first call
    # builds: outside a capture (the warm-up) that works, inside one it raises
    from lora_core.reference import reference_lora_a
    from lora_core.testing import GraphSimulator, random_linear_weights
    from lora_cuda import sgemm_lora_a_fwd

    info = make_batch_info([2, 3], [0, 1], [4, 2], device="cpu", use_graph=True)
    TorchNativeBackend("cpu").prepare_batch(info)
    assert info.plan_types == (SortedPlan,)
    a, _, _ = random_linear_weights(torch.Generator().manual_seed(0), num_slots=2, max_rank=4, in_features=3,
                                    slice_widths=[3], lora_ranks=[4, 2], dtype=torch.float32, device="cpu")
    x = torch.randn(5, 3)  # 3 float32 = 12-byte rows: not a grouped GEMM shape

    def step(x):
        return sgemm_lora_a_fwd(x, a, info)

    with pytest.raises(RuntimeError, match="BlockPlan of this batch was not built before the graph capture"):
        GraphSimulator(strict=True).capture(step, x)
    step(x)  # the warm-up
    assert info.plan_types == (SortedPlan, BlockPlan)
    assert info.lm_head_view(pruned=True).plan_types == (SortedPlan, BlockPlan)
    sim = GraphSimulator(strict=True)
    out = sim.capture(step, x)
    info.refill([4, 1], [1, None])
    x.copy_(torch.randn(5, 3))
    sim.replay()
    torch.testing.assert_close(out, reference_lora_a(x, a, info))


def test_a_graph_batch_is_captured_with_exactly_its_capacity():
    # captured with fewer rows, a later batch filling the capacity would index past x on replay
    from lora_core.testing import GraphSimulator, random_linear_weights
    from lora_cuda import sgemm_lora_a_fwd

    info = make_batch_info([2, 2], [0, 1], [4, 4], device="cpu", use_graph=True)
    a, _, _ = random_linear_weights(torch.Generator().manual_seed(0), num_slots=2, max_rank=4, in_features=8,
                                    slice_widths=[8], lora_ranks=[4, 4], dtype=torch.float32, device="cpu")
    TorchNativeBackend("cpu").prepare_batch(info)
    with pytest.raises(ValueError, match="exactly its capacity"):
        GraphSimulator(strict=True).capture(lambda x: sgemm_lora_a_fwd(x, a, info), torch.randn(3, 8))


def test_set_adapters_keeps_the_max_rank_of_the_batch():
    info = build_batch_info([1], [0], [4], [1.0], device="cpu", use_graph=True, max_tokens=4, max_rank=8)
    with pytest.raises(ValueError, match=r"lora_ranks\[0\] = 9 exceeds max_rank = 8"):
        info.set_adapters([9], [1.0])
    assert info.lora_ranks.tolist() == [4]


@pytest.mark.parametrize("kernel", ["grouped", "blocked"])
@pytest.mark.parametrize("case", ["no rows", "no slots"])
def test_static_kernels_handle_empty_batches_and_no_slots(kernel, case):
    from lora_cuda import sgemm_lora_a_embedding_fwd, sgemm_lora_a_fwd, sgemm_lora_b_fwd

    ranks = [4] if case == "no rows" else []
    seq, slots = ([0, 0], [0, None]) if case == "no rows" else ([3], [None])
    info = build_batch_info(seq, slots, ranks, [1.0] * len(ranks), device="cpu")
    T, L = sum(seq), len(ranks)
    x, base = torch.randn(T, 8), torch.randn(T, 6)
    y = sgemm_lora_a_fwd(x, torch.randn(L, 8, 8), info, 2, graph_safe=True, graph_kernel=kernel)
    assert y.shape == (T, 8) and not y.any()
    out = sgemm_lora_b_fwd(y, torch.randn(L, 6, 4), info, [0, 3, 6], base.clone(), graph_safe=True,
                           graph_kernel=kernel)
    torch.testing.assert_close(out, base)
    emb = sgemm_lora_a_embedding_fwd(torch.zeros(T, dtype=torch.long), torch.randn(L, 4, 10), info, 10,
                                     graph_safe=True)
    assert emb.shape == (T, 4) and not emb.any()


def test_block_kernel_operands_kept_per_call_shape_follow_rows_layers_and_refills():
    """Block kernels keep their workspaces' views and tables per call shape (KernelTables.call_operands):
    an x with fewer rows than the capacity, a second layer of another width and a refilled batch
    must each still get their own rows, weights and slots."""
    from lora_core.reference import reference_lora_a, reference_lora_b
    from lora_cuda import sgemm_lora_a_fwd, sgemm_lora_b_fwd

    gen = torch.Generator().manual_seed(7)
    ranks, scalings = [4, 2, 3], [0.5, 2.0, 1.0]
    info = build_batch_info([2, 1, 3], [0, 2, 1], ranks, scalings, device="cpu", use_graph=True, max_tokens=8)
    TorchNativeBackend("cpu", graph_kernel="blocked").prepare_batch(info)
    layers = [(torch.randn(3, 4, 16, generator=gen), torch.randn(3, 12, 4, generator=gen), (0, 12)),
              (torch.randn(3, 8, 16, generator=gen), torch.randn(3, 10, 4, generator=gen), (0, 4, 10))]
    for seq, slots in [([2, 1, 3], [0, 2, 1]), ([1, 4, 1, 2], [1, None, 0, 2])]:
        info.refill(seq, slots)
        for rows in (sum(seq), 8):
            for a, b, offsets in layers:
                x = torch.randn(rows, 16, generator=gen)
                y = sgemm_lora_a_fwd(x, a, info, len(offsets) - 1, graph_kernel="blocked")
                torch.testing.assert_close(y, reference_lora_a(x, a, info, len(offsets) - 1))
                out = sgemm_lora_b_fwd(y, b, info, offsets, torch.zeros(rows, offsets[-1]), graph_kernel="blocked")
                torch.testing.assert_close(out, reference_lora_b(y, b, info, offsets))


def test_slot_blocks_equal_their_definition_on_random_short_request_batches():
    """The first run: a block per slot in slot order, holding the slot's first ``b`` tokens in row
    order (``b`` the block size :func:`slot_block_size` picks for the groups); the second run, for the
    slots with more: a block each of their other tokens, as large as the largest rest. Tokens without
    an adapter point at the first padding cell (one row is added to the last run's blocks when they
    are full)."""
    rng = random.Random(5)
    runs_seen = set()
    for _ in range(300):
        num_slots = rng.randint(1, 5)
        ranks = [rng.choice([0, 2, 4]) for _ in range(num_slots)]
        scalings = [rng.choice([0.5, 1.0, 2.0]) for _ in range(num_slots)]
        hot = rng.choice([None, *range(num_slots)])  # often a slot with far more requests than the others
        slot_ids = [hot if rng.random() < 0.5 else rng.choice([None, *range(num_slots)])
                    for _ in range(rng.randint(1, 40))]
        seq_lens = [rng.choice([1, 1, 1, 2, 3]) for _ in slot_ids]  # mostly decode, some short requests
        info = build_batch_info(seq_lens, slot_ids, ranks, scalings, device="cpu")
        blocks = info.plan(ControlPlan).slot_blocks
        if blocks is None:
            continue
        token_slots = [slot for slot, n in zip(slot_ids, seq_lens) for _ in range(n)]
        tokens = {s: [t for t, slot in enumerate(token_slots) if slot == s] for s in range(num_slots) if ranks[s]}
        tokens = {s: ts for s, ts in sorted(tokens.items()) if ts}
        b = slot_block_size([len(ts) for ts in tokens.values()], launches_cost=False)
        rests = {s: ts[b:] for s, ts in tokens.items() if len(ts) > b}
        runs = [(tokens, b, [ts[:b] for ts in tokens.values()])]
        if rests:
            runs.append((rests, max(map(len, rests.values())), list(rests.values())))
        active = sum(map(len, tokens.values()))
        if sum(len(slots) * size for slots, size, _ in runs) == active < len(token_slots):
            runs[-1] = (runs[-1][0], runs[-1][1] + 1, runs[-1][2])
        runs_seen.add(len(runs))
        assert [(r.num_blocks, r.block_size) for r in blocks.runs] == [(len(slots), size) for slots, size, _ in runs]
        assert [n.tolist() for n in blocks.run_slots] == [list(slots) for slots, _, _ in runs]
        cells = [ts[j] if j < len(ts) else None for _, size, rows in runs for ts in rows for j in range(size)]
        cell_slots = [s for slots, size, _ in runs for s in slots for _ in range(size)]
        assert blocks.cell_valid.tolist() == [c is not None for c in cells]
        assert blocks.block_tokens.tolist() == [0 if c is None else c for c in cells]
        assert blocks.cell_ranks.tolist() == [ranks[s] for s in cell_slots]
        assert blocks.cell_scalings.tolist() == [scalings[s] for s in cell_slots]
        padding = next((i for i, c in enumerate(cells) if c is None), 0)
        assert blocks.token_rows.tolist() == [cells.index(t) if t in cells else padding
                                              for t in range(len(token_slots))]
    assert runs_seen == {1, 2}


def test_place_in_blocks_refuses_blocks_without_a_padding_cell_for_the_other_rows():
    """A row without an adapter must read a padding cell; with every cell filled it would read
    another row's delta, so the layout is refused instead."""
    with pytest.raises(ValueError, match="valid has no padding cell for the 1 rows not in rows"):
        place_in_blocks(np.ones((1, 2), dtype=bool), np.array([0, 2]), np.empty(2, dtype=np.int64),
                        np.empty(3, dtype=np.int64))
