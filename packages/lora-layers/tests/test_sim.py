"""lora-sim end to end on CPU: the table, exit statuses, and one-line errors for bad input."""

import json

import pytest

from lora_core import save_peft_adapter
from lora_layers import sim

SMALL = '{"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4}'


def test_default_workload_passes_on_cpu_devices(capsys, tmp_path):
    # its requests carry scales (0.5, 1.5 and 0 among them) and one is a weighted mix of two adapters
    # (test_sim_mixes.py): eager, graph mode and compiled
    code = sim.main(["--device", "cpu", "--device", "cpu-graphsim", "--device", "cpu-compile",
                     "--compile-backend", "aot_eager", "--model-config", SMALL,
                     "--decode-steps", "2", "--rounds", "3", "--json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "| torch_native | cpu | pass |" in out and "| ascend | cpu-graphsim | pass |" in out
    assert "safe (strict simulated capture)" in out and "median (min–max) over 3 rounds" in out
    assert ("requests (prompt tokens, adapter or (weighted mix of adapters) x request scale): 17 tok r8 x1, "
            "5 tok base, 33 tok r16 x0.5, 9 tok r32-rslora x1, 1 tok r64-embed-head x1.5, 24 tok r8 x0, "
            "12 tok (0.7 r32-rslora + 0.4 r64-embed-head) x0.8; a mix's request gets scale * sum of weight * delta;"
            ) in out
    document = json.loads((tmp_path / "r.json").read_text())
    assert document["workload"]["scales"] == [1.0, 1.0, 0.5, 1.0, 1.5, 0.0, 0.8]
    assert document["workload"]["adapters"][6] == [["r32-rslora", 0.7], ["r64-embed-head", 0.4]]
    rows = document["rows"]
    assert [(r["backend"], r["device"]) for r in rows] == [(b, d) for b in ("ascend", "torch_native")
                                                           for d in ("cpu", "cpu-graphsim", "cpu-compile")]
    assert {r["status"] for r in rows} == {"pass"} and all(r["launches_per_decode_step"] > 0 for r in rows)
    # every request checked, the mixed one (the seventh) among them, within the fp32 tolerance
    assert all(len(r["max_abs_error_by_request"]) == 7 for r in rows)
    assert all(max(r["max_abs_error_by_request"]) == r["max_abs_error"] < 1e-4 for r in rows)
    # decode steps at other scales replay the one compiled graph
    assert [r["compiled_decode"]["recompiles"] for r in rows if r["device"] == "cpu-compile"] == [0, 0]


def test_unavailable_devices_are_rows_that_say_why(capsys):
    assert sim.main(["--device", "cpu", "--device", "npu", "--backend", "torch_native", "--model-config", SMALL,
                     "--decode-steps", "1"]) == 0
    assert "| torch_native | npu | skipped: torch_npu" in capsys.readouterr().out


def test_a_row_outside_tolerance_fails_the_run(capsys, monkeypatch):
    real = sim.reference_logits
    monkeypatch.setattr(sim.run, "reference_logits", lambda *a, **k: real(*a, **k) + 1e-3)
    assert sim.main(["--device", "cpu", "--backend", "torch_native", "--model-config", SMALL,
                     "--decode-steps", "1"]) == 1
    assert "| torch_native | cpu | fail |" in capsys.readouterr().out


def test_real_adapters_are_served(capsys, tmp_path):
    config = sim.parse_config(SMALL)
    paths = sim.make_synthetic_adapters(config, tmp_path)
    args = [f"--adapter=mine={paths['r16']}", "--device", "cpu", "--model-config", SMALL, "--decode-steps", "1"]
    assert sim.main(args) == 0
    out = capsys.readouterr().out
    assert "adapters ['mine']" in out
    # request scales belong to requests, so a given adapter is served at each of the workload's
    # and the mixed request, of one adapter here, is that adapter at the mix's first weight
    assert ("17 tok mine x1, 5 tok base, 33 tok mine x0.5, 9 tok mine x1, 1 tok mine x1.5, 24 tok mine x0, "
            "12 tok (0.7 mine) x0.8;") in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--adapter", "x=/no/such/dir"], "--adapter x: no such directory: /no/such/dir"),
        (["--adapter", "nonsense"], "--adapter expects NAME=PATH"),
        (["--backend", "cutlass"], "unknown backend 'cutlass'; --backend accepts ascend, torch_native"),
        (["--device", "tpu"], "unknown device 'tpu'; --device accepts cpu, "),
        (["--model-config", "{bad"], "--model-config: inline JSON is not valid JSON: Expecting property name"),
        (["--model-config", '{"layers": 3}'], "unknown keys ['layers']"),
        (["--decode-steps", "many"], "argument --decode-steps: must be an integer from 1 to 1000, got 'many'"),
        (["frobnicate"], "argument command: invalid choice: 'frobnicate'"),
    ],
)
def test_bad_input_is_one_line_with_exit_status_2(capsys, args, message):
    assert sim.main(args) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_adapter_that_does_not_fit_the_model_is_exit_2(capsys, tmp_path):
    import torch

    path = save_peft_adapter(tmp_path / "wide", {"model.layers.0.self_attn.q_proj": (torch.ones(2, 999), torch.ones(32, 2))},
                             lora_alpha=2)
    assert sim.main(["--adapter", f"w={path}", "--model-config", SMALL]) == 2
    assert "does not fit module 'model.layers.0.self_attn.qkv_proj'" in capsys.readouterr().err
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "adapter_config.json").write_text("{oops")
    assert sim.main(["--adapter", f"b={tmp_path / 'broken'}"]) == 2
    assert "is not valid JSON" in capsys.readouterr().err


def test_devices_command_prints_the_matrix(capsys):
    assert sim.main(["devices"]) == 0
    out = capsys.readouterr().out
    assert "| cpu | yes |" in out and "| cuda |" in out and "| npu | no |" in out


def test_plot_without_matplotlib_is_a_clear_message(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # as if not installed
    code = sim.main(["--device", "cpu", "--backend", "torch_native", "--model-config", SMALL, "--decode-steps", "1",
                     "--plot", str(tmp_path / "p.png")])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""  # refused before the run, not after it
    assert captured.err == "lora-sim: error: --plot needs matplotlib, which is not installed: pip install matplotlib\n"


def test_bench_smoke_runs_both_backends_benchmarks(capsys):
    assert sim.main(["bench", "--smoke"]) == 0
    out = capsys.readouterr().out
    assert "upstream graph" in out and "loop / vectorized" in out and "refill / layer" in out
