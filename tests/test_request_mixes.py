"""Weighted adapter mixes (issue #40, part 2) at the backend: a request naming several slots with
weights gets ``sum_i w_i * delta_i``.

Every op against lora_core's reference math on every device parameter, with mixes, captured and
replayed and compiled, is in tests/test_request_scales.py (its ``mixes`` cases). Here: a mix against
its adapters run one at a time, the refusals, a graph
batch's pair capacity, and the benchmark's smoke run.
"""

import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch

from lora_core import available_backends, build_batch_info, get_backend
from lora_core.reference import reference_lm_head
from lora_core.testing import assert_close_to_reference, random_embedding_weights, random_linear_weights
from lora_core.testing.expert_cases import random_expert_weights

BACKENDS = available_backends()


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_a_mix_equals_the_sum_of_its_adapters_run_one_by_one(backend_name):
    """The mix's definition, checked without the reference: a request ``{0: 0.7, 1: 0.3}`` at scale 2 gets
    ``2 * (0.7 * delta_0 + 0.3 * delta_1)``, each delta from a batch of that slot alone at that scale."""
    gen = torch.Generator().manual_seed(3)
    ranks = [4, 8]
    a, b, offsets = random_linear_weights(gen, num_slots=2, max_rank=8, in_features=16, slice_widths=[12, 8],
                                          lora_ranks=ranks, dtype=torch.float32, device="cpu")
    x, base = torch.randn(5, 16, generator=gen), torch.randn(5, 20, generator=gen)
    backend = get_backend(backend_name)("cpu")

    def delta(slot_ids, scales=None):
        backend.prepare_batch(build_batch_info([3, 2], slot_ids, ranks, [2.0, 0.5], device="cpu", scales=scales))
        return backend.run_packed(x, a, b, offsets, base.clone()) - base

    mixed = delta([{0: 0.7, 1: 0.3}, [(1, 1.5), (0, 0.5)]], [2.0, 0.4])  # request scales on top of the weights
    one_by_one = delta([0, 1], [1.4, 0.6]) + delta([1, 0], [0.6, 0.2])
    torch.testing.assert_close(mixed, one_by_one, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("slot_ids, message", [
    ([{}, 0], r"slot_ids\[0\] \(request 0\): a mix must name at least one adapter, got \{\}"),
    ([0, {0: 0.5, 3: 0.5}], r"slot_ids\[1\] \(request 1\): a mix names adapter slots in \[0, 2\), got 3"),
    ([0, {None: 0.5}], r"slot_ids\[1\] \(request 1\): a mix names adapter slots in \[0, 2\), got None"),
    ([[(1, 0.5), (1, 0.5)], 0], r"slot_ids\[0\] \(request 0\): slot 1 is named twice in the mix"),
    ([{0: -0.1}, 0], r"slot_ids\[0\] \(request 0\): the weight of slot 0 must be >= 0, got -0.1"),
    ([{0: float("nan")}, 0], r"slot_ids\[0\] \(request 0\): the weight of slot 0 must be a finite float, got nan"),
    ([{0: float("inf")}, 0], r"slot_ids\[0\] \(request 0\): the weight of slot 0 must be a finite float, got inf"),
    ([[0, 1], 0], r"slot_ids\[0\] \(request 0\): a mix is \{key: weight\} or \[\(key, weight\), \.\.\.\], got "
                  r"the entry 0"),
    ([0, "a"], r"slot_ids\[1\] must be None, -1, a slot in \[0, 2\) or a weighted mix \{slot: weight\}, got 'a'"),
    ([0, {0: 3e38, 1: 1.0}], r"slot_ids\[1\] \(request 1\): its scale times a mix weight, 9\.000e\+38, is not finite "
                            r"in float32"),
    ([0, {1: 1.0, 0: 3e38}], r"slot_ids\[1\] \(request 1\): its scale times a mix weight, 9\.000e\+38, is not finite "
                            r"in float32"),
])
def test_bad_mixes_are_refused_naming_the_request(slot_ids, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        build_batch_info([2, 3], slot_ids, [4, 4], [1.0, 1.0], device="cpu", scales=[1.0, 3.0])


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
    mixes beside them, mixed rows not their first adapter's) and it reports each ratio with its bounds. The
    LoRA-time bound comes from timings (noise can make it anything on a busy machine: only its form is
    checked); the FLOPs bound from counted multiply-accumulates."""
    path = Path(__file__).resolve().parents[1] / "examples" / "bench_request_mixes.py"
    spec = importlib.util.spec_from_file_location("example_bench_request_mixes", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--smoke", "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^ascend, decode \(8 x 1 tokens\), a quarter mixed / one adapter each: \d+\.\d{3} \(.*; "
                     r"bounds: FLOPs 1\.\d{3}, LoRA time -?\d+\.\d{3} \(LoRA -?\d+% of the time, pairs \+\d+% of its "
                     r"MACs\)$", out, re.M), out
    results = json.loads((tmp_path / "r.json").read_text())["results"]
    assert set(results) == {f"{b}/{p}" for b in ("torch_native", "ascend") for p in ("decode", "prefill")}
    assert all(len(r["ratio"]["samples"]) == 3 and 1.1 < r["flops_bound"] < 2 and 0 < r["extra_lora"] < 1
               for r in results.values())


def test_a_graph_batch_without_scales_refuses_a_mixs_weights_naming_the_request():
    graph = build_batch_info([4], [0], [4, 4], [1.0, 1.0], device="cpu", use_graph=True, max_tokens=8)
    graph.refill([2, 2], [{0: 1.0}, 1])  # weight 1: no scale to apply
    with pytest.raises(ValueError, match=r"^slot_ids\[1\] \(request 1\): a mix's weights are request scales, which a "
                                         r"graph-mode batch applies only when built with with_scales=True \(MultiLoRA: "
                                         r"enable_graph\(\.\.\., scales=True\) or max_pairs=\)$"):
        graph.refill([2, 2], [0, {1: 0.5}])
    with pytest.raises(ValueError, match=r"^slot_ids\[0\] \(request 0\): a mix's weights are request scales"):
        build_batch_info([4], [{0: 0.5}], [4, 4], [1.0, 1.0], device="cpu", use_graph=True, max_tokens=8)


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_a_mixed_batch_checks_its_rows_before_gathering_them_and_names_bad_ids_in_the_callers_terms(backend_name):
    gen = torch.Generator().manual_seed(0)
    a, b, offsets = random_linear_weights(gen, num_slots=2, max_rank=4, in_features=8, slice_widths=[6],
                                          lora_ranks=[4, 2], dtype=torch.float32, device="cpu")
    backend = get_backend(backend_name)("cpu", strict_token_ids=True)
    backend.prepare_batch(build_batch_info([3, 2], [{0: 0.5, 1: 0.5}, 1], [4, 2], [1.0, 1.0], device="cpu"))
    for rows in (4, 7):
        with pytest.raises(ValueError, match=rf"^x has {rows} rows but the batch info was built for 5 tokens "
                                             r"\(seq_lens = \[3, 2\]\)$"):
            backend.run_lora_a(torch.randn(rows, 8), a)
    shrunk = backend.run_lora_a(torch.randn(5, 8), a)
    assert shrunk.shape == (8, 4)  # 5 token rows, 3 pair rows
    with pytest.raises(ValueError, match=r"^x has 5 rows; a shrink of this batch gives 8: its token rows and the pair "
                                         r"rows of its mixes \(pass the shrink's output\)$"):
        backend.run_lora_b(shrunk[:5], b, offsets)
    with pytest.raises(ValueError, match=r"^base_output has 4 rows but the batch info was built for 5 tokens"):
        backend.run_lora_b(shrunk, b, offsets, torch.zeros(4, 6))
    xa, xb = random_expert_weights(gen, num_slots=2, num_experts=3, max_rank=4, in_features=8, out_features=6,
                                   lora_ranks=[4, 2], dtype=torch.float32, device="cpu")
    expert_ids = torch.tensor([[0], [2], [1], [0], [1]])
    shrunk = backend.run_experts_lora_a(torch.randn(5, 1, 8), expert_ids, xa)
    with pytest.raises(ValueError, match=r"^expert_ids has 4 rows but the batch info was built for 5 tokens"):
        backend.run_experts_lora_b(shrunk, expert_ids[:4], xb)
    ea, _ = random_embedding_weights(gen, num_slots=2, max_rank=4, vocab_total=10, embedding_dim=6, lora_ranks=[4, 2],
                                     dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match=r"^token ids outside the vocabulary \[0, 10\): ids\[1\] = 12, ids\[4\] = -1$"):
        backend.run_lora_a_embedding(torch.tensor([0, 12, 3, 4, -1]), ea, 10)


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_a_graph_batch_with_pair_rows_follows_new_adapters_in_its_lm_head_rows_too(backend_name):
    """Loading an adapter into a slot (``set_adapters``) reaches the pair rows of the batch and of its
    pruned LM-head view: both equal a batch built with the new ranks and scalings."""
    gen = torch.Generator().manual_seed(1)
    a, b, _ = random_linear_weights(gen, num_slots=2, max_rank=4, in_features=8, slice_widths=[6],
                                    lora_ranks=[4, 4], dtype=torch.float32, device="cpu")
    weight, hidden = torch.randn(6, 8, generator=gen), torch.randn(5, 8, generator=gen)
    backend = get_backend(backend_name)("cpu")
    graph = build_batch_info([5], [None], [4, 4], [1.0, 1.0], device="cpu", use_graph=True, max_tokens=5,
                             with_scales=True, max_pairs=10)
    graph.refill([3, 2], [{0: 1.0, 1: 1.0}, 0])
    backend.prepare_batch(graph)
    graph.set_adapters([2, 4], [1.0, 3.0])
    want = build_batch_info([3, 2], [{0: 1.0, 1: 1.0}, 0], [2, 4], [1.0, 3.0], device="cpu")
    for pruned, rows in ((False, 5), (True, 2)):
        got = backend.run_lm_head(hidden[:rows] if pruned else hidden, a, b, hidden[:rows] @ weight.T, pruned=pruned)
        expected = reference_lm_head(hidden[:rows], weight, a, b, want, pruned)
        assert_close_to_reference(got[:rows], expected, torch.float32)
