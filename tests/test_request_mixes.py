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
from lora_core.testing import random_linear_weights

BACKENDS = available_backends()


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
    mixes beside them, mixed rows not their first adapter's) and it reports each ratio with its bounds."""
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
