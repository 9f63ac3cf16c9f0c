"""Weighted adapter mixes (issue #40, part 2): a request naming several slots with weights gets
``sum_i w_i * delta_i``, through every backend op, against lora_core's reference math on every
device parameter, both backends.

Batches mix requests of one slot, of a mix of 1 to 3 slots (weights 0, 1 and in (0, 1.5], as dicts
and as lists of pairs), of slot -1, with request scales on top, rank-0 slots and garbage beyond each
rank; graph devices capture batch A and replay batch B (other requests, other mixes, more pairs) and
the reverse, the compile device runs B on the code compiled for A. The reference
(``lora_core.reference.adapter_rows``) walks each request's slots independently of the pair rows'
device layout.
"""

import importlib.util
import json
import random
import re
from pathlib import Path

import pytest
import torch

from lora_core import available_backends, build_batch_info, get_backend
from lora_core.reference import (
    num_pair_rows,
    reference_lm_head,
    reference_lora_a,
    reference_lora_a_embedding,
    reference_lora_b,
)
from lora_core.reference_experts import reference_experts_lora, reference_experts_lora_a
from lora_core.testing import (
    BatchPair,
    assert_close_to_reference,
    count_launches,
    random_batch_pair,
    random_embedding_weights,
    random_linear_weights,
    random_ranks,
)
from lora_core.testing.expert_cases import random_expert_ids, random_expert_weights

BACKENDS = available_backends()
DTYPES = [torch.float32, torch.bfloat16]


def _rows(out: torch.Tensor, num_tokens: int, ref_info) -> torch.Tensor:
    """A shrink's output without graph-mode padding: its token rows, then the batch's pair rows."""
    return torch.cat([out[:num_tokens], out[num_tokens : num_tokens + num_pair_rows(ref_info)]])


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_slices", [1, 3])
@pytest.mark.parametrize("seed", range(3))
def test_packed_projection_and_shrink_give_each_request_its_weighted_sum(device, backend_name, dtype, num_slices,
                                                                         seed):
    rng, gen = random.Random(seed * 11 + num_slices), torch.Generator().manual_seed(seed)
    L, R, T = rng.randint(2, 5), rng.choice([4, 8]), rng.randint(6, 40)
    ranks = random_ranks(rng, L, R)
    pair = random_batch_pair(rng, T, ranks, scaled=True, mixed=True)
    widths = [rng.randint(3, 24) for _ in range(num_slices)]
    a, b, offsets = random_linear_weights(gen, num_slots=L, max_rank=R, in_features=rng.randint(4, 48),
                                          slice_widths=widths, lora_ranks=ranks, dtype=dtype,
                                          device=device.torch_device)
    x = torch.randn(T, a.shape[2], generator=gen).to(device.torch_device, dtype)
    base = torch.randn(T, offsets[-1], generator=gen).to(device.torch_device, dtype)
    backend = get_backend(backend_name)(device.torch_device)

    def layer(info, x, base):
        backend.prepare_batch(info)
        return backend.run_lora_a(x, a, num_slices), backend.run_packed(x, a, b, offsets, base.clone())

    for (shrunk, out), ref in zip(pair.run(device, layer, x, base), pair.reference_infos()):
        want_shrunk = reference_lora_a(x, a, ref, num_slices)
        assert_close_to_reference(_rows(shrunk, T, ref), want_shrunk, dtype)
        assert_close_to_reference(out, base.float().cpu() + reference_lora_b(want_shrunk, b, ref, offsets), dtype)


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("pruned", [False, True], ids=["every-token", "last-tokens"])
@pytest.mark.parametrize("seed", range(2))
def test_lm_head_gives_each_mixed_row_its_weighted_sum(device, backend_name, pruned, seed):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    ranks = random_ranks(rng, 3, 8)
    lens_a, lens_b = [3, 1, 4, 2], [2, 2, 5, 1]  # non-empty requests: the pruned rows are one per request
    pair = BatchPair(ranks, (lens_a, [{0: 0.7, 2: 0.3}, None, 2, [(1, 1.0), (2, 0.5), (0, 1.2)]], [1.0, 1.0, 0.5, 1.0]),
                     (lens_b, [2, {1: 0.25}, [(0, 0.5), (1, 0.5)], 0], [1.0, 2.0, 1.5, 0.0]))
    rows = 4 if pruned and not device.is_graph else sum(lens_a)  # a capture takes the capacity's rows
    a, b, _ = random_linear_weights(gen, num_slots=3, max_rank=8, in_features=16, slice_widths=[24],
                                    lora_ranks=ranks, dtype=torch.float32, device=device.torch_device)
    hidden = torch.randn(rows, 16, generator=gen).to(device.torch_device)
    weight = torch.randn(24, 16, generator=gen).to(device.torch_device)
    backend = get_backend(backend_name)(device.torch_device)

    def head(info, hidden):
        backend.prepare_batch(info)
        return backend.run_lm_head(hidden, a, b, hidden @ weight.T, pruned=pruned)

    real = 4 if pruned else rows
    for out, ref in zip(pair.run(device, head, hidden), pair.reference_infos()):
        assert_close_to_reference(out[:real], reference_lm_head(hidden[:real], weight, a, b, ref, pruned),
                                  torch.float32)


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("seed", range(2))
def test_embedding_gives_each_mixed_token_its_weighted_sum(device, backend_name, seed):
    rng, gen = random.Random(seed + 5), torch.Generator().manual_seed(seed)
    ranks = random_ranks(rng, 4, 8)
    V, T, D = 50, 24, 12
    pair = random_batch_pair(rng, T, ranks, scaled=True, mixed=True)
    a, b = random_embedding_weights(gen, num_slots=4, max_rank=8, vocab_total=V, embedding_dim=D,
                                    lora_ranks=ranks, dtype=torch.float32, device=device.torch_device)
    ids = torch.randint(-2, V + 2, (T,), generator=gen).to(device.torch_device)  # out-of-vocab ids too
    base = torch.randn(T, D, generator=gen).to(device.torch_device)
    backend = get_backend(backend_name)(device.torch_device)

    def embedding(info, ids, base):
        backend.prepare_batch(info)
        shrunk = backend.run_lora_a_embedding(ids, a, V)
        return shrunk, backend.run_lora_b(shrunk, b, (0, D), base.clone())

    for (shrunk, out), ref in zip(pair.run(device, embedding, ids, base), pair.reference_infos()):
        want = reference_lora_a_embedding(ids, a, ref, V)
        assert_close_to_reference(_rows(shrunk, T, ref), want, torch.float32)
        assert_close_to_reference(out, base.cpu() + reference_lora_b(want, b, ref, (0, D)), torch.float32)


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("seed", range(2))
def test_experts_give_each_mixed_token_its_weighted_sum(device, backend_name, top_k, seed):
    rng, gen = random.Random(seed + 9), torch.Generator().manual_seed(seed)
    L, E, R, T, H, out_features = 3, 4, 8, 18, 12, 10
    ranks = random_ranks(rng, L, R)
    pair = random_batch_pair(rng, T, ranks, scaled=True, mixed=True)
    a, b = random_expert_weights(gen, num_slots=L, num_experts=E, max_rank=R, in_features=H,
                                 out_features=out_features, lora_ranks=ranks, dtype=torch.float32,
                                 device=device.torch_device)
    ids = random_expert_ids(rng, gen, T, top_k, E).to(device.torch_device)
    x = torch.randn(T, top_k, H, generator=gen).to(device.torch_device)
    base = torch.randn(T, top_k, out_features, generator=gen).to(device.torch_device)
    backend = get_backend(backend_name)(device.torch_device)

    def experts(info, x, base):
        backend.prepare_batch(info)
        return backend.run_experts_lora_a(x, ids, a), backend.run_experts_lora(x, ids, a, b, base.clone())

    for (shrunk, out), ref in zip(pair.run(device, experts, x, base), pair.reference_infos()):
        assert_close_to_reference(_rows(shrunk, T, ref), reference_experts_lora_a(x, ids, a, ref), torch.float32)
        assert_close_to_reference(out, base.float().cpu() + reference_experts_lora(x, ids, a, b, ref), torch.float32)


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_a_mix_equals_the_sum_of_its_adapters_run_one_by_one(backend_name):
    """The mix's definition, checked without the reference: a request ``{0: 0.7, 1: 0.3}`` gets
    ``0.7 * delta_0 + 0.3 * delta_1``, each delta from a batch of that slot alone at that scale."""
    gen = torch.Generator().manual_seed(3)
    ranks = [4, 8]
    a, b, offsets = random_linear_weights(gen, num_slots=2, max_rank=8, in_features=16, slice_widths=[12, 8],
                                          lora_ranks=ranks, dtype=torch.float32, device="cpu")
    x, base = torch.randn(5, 16, generator=gen), torch.randn(5, 20, generator=gen)
    backend = get_backend(backend_name)("cpu")

    def delta(slot_ids, scales=None):
        backend.prepare_batch(build_batch_info([3, 2], slot_ids, ranks, [2.0, 0.5], device="cpu", scales=scales))
        return backend.run_packed(x, a, b, offsets, base.clone()) - base

    mixed = delta([{0: 0.7, 1: 0.3}, [(1, 1.5), (0, 0.5)]])
    one_by_one = delta([0, 1], [0.7, 1.5]) + delta([1, 0], [0.3, 0.5])
    torch.testing.assert_close(mixed, one_by_one, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_a_mix_runs_the_matrix_products_of_its_pair_rows_as_requests_and_a_batch_without_mixes_none(backend_name):
    """A batch without mixes (a one-slot mix included) launches what it did. A mixed batch runs each
    kernel once over its token rows and pair rows: the matrix products of the same rows served as
    requests of their own (not every adapter on every token), plus a gather of the inputs and a
    scatter-add of the deltas, and no host read."""
    gen = torch.Generator().manual_seed(0)
    ranks = [4, 8, 0]
    a, b, offsets = random_linear_weights(gen, num_slots=3, max_rank=8, in_features=16, slice_widths=[12, 8],
                                          lora_ranks=ranks, dtype=torch.float32, device="cpu")
    x, base = torch.randn(9, 16, generator=gen), torch.randn(9, 20, generator=gen)
    backend = get_backend(backend_name)("cpu")

    def launches(seq_lens, slot_ids, x, base, scales=None):
        backend.prepare_batch(build_batch_info(seq_lens, slot_ids, ranks, [2.0, 0.5, 1.0], device="cpu",
                                               scales=scales))
        return count_launches(lambda: backend.run_packed(x, a, b, offsets, base.clone()))

    plain = launches([3, 2, 4], [0, 1, None], x, base)
    one_slot_mix = launches([3, 2, 4], [{0: 1.0}, 1, None], x, base)
    assert one_slot_mix.ops == plain.ops and one_slot_mix.by_op == plain.by_op
    mixed = launches([3, 2, 4], [{0: 0.5, 1: 1.0}, 1, None], x, base)  # 3 pair rows of slot 1
    as_requests = launches([3, 2, 4, 3], [0, 1, None, 1], torch.cat([x, x[:3]]), torch.cat([base, base[:3]]),
                           [0.5, 1.0, 1.0, 1.0])
    assert mixed.matmul_macs == as_requests.matmul_macs > plain.matmul_macs
    assert mixed.ops <= as_requests.ops + 3 and mixed.host_reads == plain.host_reads == 0


@pytest.mark.parametrize("slot_ids, message", [
    ([{}, 0], r"slot_ids\[0\] \(request 0\): a mix must name at least one adapter slot, got \{\}"),
    ([0, {0: 0.5, 3: 0.5}], r"slot_ids\[1\] \(request 1\): a mix names adapter slots in \[0, 2\), got 3"),
    ([0, {None: 0.5}], r"slot_ids\[1\] \(request 1\): a mix names adapter slots in \[0, 2\), got None"),
    ([[(1, 0.5), (1, 0.5)], 0], r"slot_ids\[0\] \(request 0\): slot 1 is named twice in the mix"),
    ([{0: -0.1}, 0], r"slot_ids\[0\] \(request 0\): the weight of slot 0 must be >= 0, got -0.1"),
    ([{0: float("nan")}, 0], r"slot_ids\[0\] \(request 0\): the weight of slot 0 must be a finite float, got nan"),
    ([{0: float("inf")}, 0], r"slot_ids\[0\] \(request 0\): the weight of slot 0 must be a finite float, got inf"),
    ([[0, 1], 0], r"slot_ids\[0\] \(request 0\): a mix is \{slot: weight\} or \[\(slot, weight\), \.\.\.\], got "
                  r"the entry 0"),
    ([0, "a"], r"slot_ids\[1\] must be None, -1, a slot in \[0, 2\) or a weighted mix \{slot: weight\}, got 'a'"),
])
def test_bad_mixes_are_refused_naming_the_request(slot_ids, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        build_batch_info([2, 3], slot_ids, [4, 4], [1.0, 1.0], device="cpu")


def test_a_graph_batch_holds_mixes_up_to_its_pair_capacity():
    kwargs = dict(device="cpu", use_graph=True, max_tokens=8, with_scales=True)
    graph = build_batch_info([4], [0], [4, 4], [1.0, 1.0], max_pairs=12, **kwargs)
    with pytest.raises(ValueError, match=r"^request 2's mix brings the batch to 5 \(token, "
                                         r"adapter\) pairs beyond one per token, more than this graph batch holds "
                                         r"\(max_pairs - max_tokens = 4\); build it with max_pairs >= 13$"):
        graph.refill([2, 3, 3], [{0: 0.5, 1: 0.5}, 1, [(1, 1.0), (0, 0.25)]])  # 2 + 3 pairs
    assert graph.request_mixes == ((),) and graph.request_slots == (0,)  # the rejected refill changed nothing
    graph.refill([2, 3, 3], [{0: 0.5, 1: 0.5}, 1, {1: 1.0}])
    assert graph.request_mixes == (((1, 0.5),), (), ())
    rows = graph.pairs  # the 8 token rows, the 2 pair rows, 2 rows of padding
    assert rows.token_rows_cpu.tolist() == [*range(8), 0, 1, 0, 0]
    assert rows.view.token_slots_cpu.tolist() == [0, 0, 1, 1, 1, 1, 1, 1, 1, 1, -1, -1]
    assert rows.view.token_scales_cpu.tolist() == [0.5, 0.5, 1, 1, 1, 1, 1, 1, 0.5, 0.5, 0, 0]
    with pytest.raises(ValueError, match=r"^max_pairs = 12: a graph-mode batch holds weighted mixes only when built "
                                         r"with with_scales=True"):
        build_batch_info([4], [0], [4], [1.0], device="cpu", use_graph=True, max_tokens=8, max_pairs=12)
    with pytest.raises(ValueError, match=r"^max_pairs must be an int >= 8, got 7$"):
        build_batch_info([4], [0], [4], [1.0], max_pairs=7, **kwargs)
    with pytest.raises(ValueError, match=r"^max_pairs is only meaningful with use_graph=True"):
        build_batch_info([4], [0], [4], [1.0], device="cpu", max_pairs=7)


def test_the_request_mixes_benchmark_checks_then_times_both_backends(capsys, tmp_path):
    """examples/bench_request_mixes.py in smoke sizes: its checks pass (rows without a mix unchanged by the
    mixes beside them, mixed rows not their first adapter's) and it reports each ratio with its bound."""
    path = Path(__file__).resolve().parents[1] / "examples" / "bench_request_mixes.py"
    spec = importlib.util.spec_from_file_location("example_bench_request_mixes", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--smoke", "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^ascend, decode \(8 x 1 tokens\), a quarter mixed / one adapter each: \d\.\d{3} \(.*; "
                     r"bounds: FLOPs 1\.\d{3}, LoRA time 1\.\d{3} \(LoRA -?\d+% of the time, pairs \+\d+% of its "
                     r"MACs\)$", out, re.M), out
    results = json.loads((tmp_path / "r.json").read_text())["results"]
    assert set(results) == {f"{b}/{p}" for b in ("torch_native", "ascend") for p in ("decode", "prefill")}
    assert all(len(r["ratio"]["samples"]) == 3 and 1.1 < r["flops_bound"] < 2 and 0 < r["extra_lora"] < 1
               for r in results.values())
