"""lora-sim's figures: medians and spreads of interleaved rounds (structure only, never speed)."""

import json

import pytest

from lora_layers import sim
from lora_core.testing.timing import Interleaved, Spread

SMALL = '{"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4}'


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_rounds_alternate_which_variant_goes_first_and_time_each_call():
    clock, calls = FakeClock(), []

    def variant(name, seconds):
        def fn():
            calls.append(name)
            clock.now += seconds
            return name.upper()
        return fn

    timer = Interleaved(["lora", "base"], clock=clock)
    variants = {"lora": variant("lora", 3.0), "base": variant("base", 1.0)}
    for _ in range(4):
        assert timer.round(variants) == {"lora": "LORA", "base": "BASE"}
    assert calls == ["lora", "base", "base", "lora", "lora", "base", "base", "lora"]
    assert timer.samples == {"lora": [3.0] * 4, "base": [1.0] * 4}
    spreads = timer.spreads()
    assert spreads["lora"] == Spread(3.0, 3.0, 3.0, (3.0,) * 4)


def test_sync_runs_after_every_call_inside_its_timing():
    clock = FakeClock()

    def sync():
        clock.now += 0.5

    timer = Interleaved(["a"], sync=sync, clock=clock)
    timer.round({"a": lambda: None})
    assert timer.samples["a"] == [0.5]


def test_a_round_must_call_exactly_the_named_variants():
    with pytest.raises(ValueError, match="exactly"):
        Interleaved(["lora", "base"]).round({"lora": lambda: None})


def test_spread_is_median_min_max_of_the_samples_in_round_order():
    s = Spread.of([5.0, 1.0, 4.0, 2.0, 3.0])
    assert (s.median, s.minimum, s.maximum, s.samples) == (3.0, 1.0, 5.0, (5.0, 1.0, 4.0, 2.0, 3.0))
    assert Spread.of([1.0, 2.0]).median == 1.5
    with pytest.raises(ValueError):
        Spread.of([])
    assert sim.report.format_spread(Spread.of([0.5, 0.2, 1.0]), lambda x: f"{x:+.0%}") == "+50% (+20%–+100%)"


def test_a_row_times_lora_and_base_interleaved_and_reports_every_round(capsys, monkeypatch, tmp_path):
    orders = []

    class Recording(Interleaved):
        def round(self, calls):
            orders.append(self.order())
            return super().round(calls)

    monkeypatch.setattr(sim.run, "Interleaved", Recording)
    code = sim.main(["--device", "cpu", "--backend", "torch_native", "--model-config", SMALL, "--decode-steps", "2",
                     "--rounds", "3", "--json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert code == 0, out
    # 3 prefill rounds, then 3 rounds of 2 decode steps; each a LoRA and a base call, the first alternating
    assert orders[:3] == [["lora", "base"], ["base", "lora"], ["lora", "base"]]
    assert orders[3:] == [["lora", "base"], ["base", "lora"]] * 3
    assert "median (min–max) over 3 rounds" in out and "machine: " in out and " threads" in out

    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["rounds"] == 3 and {"cpu", "torch", "threads"} <= set(doc["machine"])
    row = doc["rows"][0]
    for figure in ("prefill_tokens_per_s", "decode_tokens_per_s", "lora_overhead"):
        f = row[figure]
        assert len(f["samples"]) == 3 and f["minimum"] <= f["median"] <= f["maximum"]
    seconds = row["details"]["seconds"]
    assert [len(seconds["prefill"][k]) for k in ("lora", "base")] == [3, 3]
    assert [[len(r) for r in seconds["decode_step"][k]] for k in ("lora", "base")] == [[2, 2, 2]] * 2
    tokens = sum(doc["workload"]["prompt_lens"])
    assert row["prefill_tokens_per_s"]["samples"] == pytest.approx([tokens / s for s in seconds["prefill"]["lora"]])


def test_too_few_rounds_is_bad_input(capsys):
    assert sim.main(["--rounds", "1"]) == 2
    assert "argument --rounds: must be an integer from 3 to 100, got '1'" in capsys.readouterr().err


def test_the_plot_draws_medians_with_min_max_whiskers(monkeypatch, tmp_path):
    import sys
    from unittest import mock

    plt = mock.MagicMock()
    axes = (mock.MagicMock(), mock.MagicMock())
    plt.subplots.return_value = (mock.MagicMock(), axes)
    matplotlib = mock.MagicMock(pyplot=plt)
    monkeypatch.setitem(sys.modules, "matplotlib", matplotlib)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", plt)
    row = sim.SimRow("b", "cpu", "pass", prefill_tokens_per_s=Spread.of([1.0, 2.0, 3.0]),
                     decode_tokens_per_s=Spread.of([10.0, 20.0, 40.0]), lora_overhead=Spread.of([0.1, 0.2, 0.5]),
                     details={"rounds": 3})
    sim.write_plot([row, sim.SimRow("b", "npu", "skipped", reason="absent")], str(tmp_path / "p.png"))
    decode_bar = axes[0].bar.call_args
    assert decode_bar.args == (["b\ncpu"], [20.0]) and decode_bar.kwargs["yerr"] == [[10.0], [20.0]]
    overhead_bar = axes[1].bar.call_args
    assert overhead_bar.args[1] == [pytest.approx(20.0)]
    assert overhead_bar.kwargs["yerr"] == [[pytest.approx(10.0)], [pytest.approx(30.0)]]
