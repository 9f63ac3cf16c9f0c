"""The benchmark runs end to end on tiny shapes (no timing is asserted)."""

import math

from lora_cuda import bench


def test_smoke_run_prints_a_ratio_table(capsys, tmp_path):
    assert bench.main(["--smoke", "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert "| smoke decode |" in out and "upstream graph" in out
    results = [bench.run_case(c, min_run_time=0.001, rounds=3) for c in bench.smoke_cases()]
    for r in results:
        for spread in (r.eager, r.graph, r.upstream_control, r.upstream_graph, r.graph_vs_eager):
            assert len(spread.samples) == 3  # one ratio per interleaved round
            assert all(math.isfinite(v) and v > 0 for v in spread.samples)
            assert spread.minimum <= spread.median <= spread.maximum


def test_baselines_compute_the_same_delta_as_the_ops():
    import torch

    from lora_core.testing import make_batch_info, random_linear_weights
    from lora_cuda import sgemm_lora_a_fwd, sgemm_lora_b_fwd

    ranks = [4, 4, 4]
    gen = torch.Generator().manual_seed(0)
    a, b, offsets = random_linear_weights(gen, num_slots=3, max_rank=4, in_features=8, slice_widths=[6],
                                          lora_ranks=ranks, dtype=torch.float32, device="cpu", garbage=None)
    x = torch.randn(6, 8, generator=gen)
    seq, slots = (2, 1, 3), (0, 2, 1)
    info = make_batch_info(seq, slots, ranks, device="cpu")
    ours = sgemm_lora_b_fwd(sgemm_lora_a_fwd(x, a, info), b, info, offsets)
    control = bench.upstream_control_lora(x, a, b, torch.tensor(seq), torch.tensor(slots), info.lora_ranks,
                                          info.scalings, torch.zeros(6, 6))
    graph = bench.upstream_graph_lora(x, a, b, info.token_slots, info.scalings, torch.zeros(6, 6))
    torch.testing.assert_close(control, ours)
    torch.testing.assert_close(graph, ours)


def test_planning_benchmark_runs_and_reports_spreads(capsys):
    from lora_cuda import bench_planning

    assert bench_planning.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    assert "| T=16 requests=16 slots=4 |" in out and "refill / layer" in out
    decode, prefill = (bench_planning.run_case(c, min_run_time=0.001, rounds=2, hidden=16)
                       for c in bench_planning.smoke_cases())
    assert decode.refill_vs_layer is not None and len(decode.refill_us.samples) == 2
    assert prefill.layer_us is None  # the layer ratio is for decode shapes


def test_benchmarks_time_with_the_threads_they_report(monkeypatch):
    # torch.utils.benchmark.Timer times with one thread unless told otherwise; the tables
    # report torch.get_num_threads(), so every timer must be given that count
    import torch
    from torch.utils import benchmark as torch_benchmark

    from lora_cuda import bench_planning

    seen = []
    real_timer = torch_benchmark.Timer

    def recording_timer(*args, **kwargs):
        seen.append(kwargs.get("num_threads", 1))
        return real_timer(*args, **kwargs)

    monkeypatch.setattr(torch_benchmark, "Timer", recording_timer)
    threads = torch.get_num_threads()
    try:
        assert bench.main(["--smoke", "--threads", "2"]) == 0
        assert bench_planning.main(["--smoke", "--threads", "2"]) == 0
    finally:
        torch.set_num_threads(threads)
    assert seen and set(seen) == {2}


def test_planning_benchmark_plans_batches_on_each_device(device):
    from lora_cuda import bench_planning

    name = str(device.torch_device)
    decode = bench_planning.run_case(bench_planning.smoke_cases()[0], min_run_time=0.001, rounds=1, hidden=16,
                                     device=name)
    assert decode.device == name and decode.refill_vs_layer is not None
    assert f"host planning of batches on {name}" in bench_planning.format_table([decode])


def test_planning_benchmark_rejects_a_device_it_cannot_use_in_one_line(capsys):
    import pytest

    from lora_cuda import bench_planning

    with pytest.raises(SystemExit) as exit_info:
        bench_planning.main(["--smoke", "--device", "no-such-device"])
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("python -m lora_cuda.bench_planning: error: --device must be a torch.device")
