"""The compile device parameters and lora-sim's compiled decode row (docs/compile.md).

``cpu-compile`` compiles with ``fullgraph=True`` (a graph break fails the
capture), replays by calling the compiled function again into the first
call's outputs, and fails any replay that recompiles; ``cuda-compile`` is
skipped without CUDA. lora-sim serves a compiled decode step on it and
reports one compile and zero recompiles.
"""

import importlib.util
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from lora_core.testing import (COMPILE_BACKEND, CompiledReplay, compile_capture, fastest_compile_backend, make_device,
                               probe_device)
from lora_layers import sim

SMALL = '{"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4}'


def test_the_compile_devices_are_graph_kinds_on_their_torch_device():
    cpu, cuda = make_device("cpu-compile"), make_device("cuda-compile")
    assert cpu.is_graph and cuda.is_graph and cpu.torch_device.type == "cpu" and cuda.torch_device.type == "cuda"
    probe = probe_device("cpu-compile")
    assert probe.available and f"backend={COMPILE_BACKEND!r}" in probe.reason
    if torch.version.cuda is None:
        assert not probe_device("cuda-compile").available


def test_a_replay_rewrites_the_first_outputs_and_fails_on_a_recompile():
    state = {"scale": 2}
    x = torch.arange(4.0)

    def fn(x):
        return x * state["scale"], x + 1

    out, replay = compile_capture(fn, x)
    assert isinstance(replay, CompiledReplay) and replay.compiles == 1
    x.add_(1)  # "refill" the input in place
    replay()
    torch.testing.assert_close(out[0], torch.arange(1.0, 5.0) * 2)
    torch.testing.assert_close(out[1], torch.arange(2.0, 6.0))
    assert (replay.compiles, replay.recompiles, replay.replays) == (1, 0, 1)
    state["scale"] = 3  # a guarded constant changed: the compiled code does not hold any more
    with pytest.raises(RuntimeError, match="Recompiling function"):
        replay()


def test_a_graph_break_fails_the_capture():
    def fn(x):
        torch._dynamo.graph_break()
        return x + 1

    with pytest.raises(Exception, match="graph_break"):
        compile_capture(fn, torch.ones(2))


def test_lora_sim_reports_the_compiled_decode_row(capsys, tmp_path):
    code = sim.main(["--device", "cpu-compile", "--model-config", SMALL, "--decode-steps", "2",
                     "--rounds", "3", "--compile-backend", "aot_eager", "--json", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert any(line.startswith("| backend |") and line.endswith("| compiled decode |") for line in out.splitlines())
    for backend in ("torch_native", "ascend"):
        line = next(row for row in out.splitlines() if row.startswith(f"| {backend} | cpu-compile | pass |"))
        assert "compiled (fullgraph, aot_eager)" in line, line
        assert re.search(r"\| aot_eager: compiled once in \d+\.\d s, 0 recompiles, [\d,]+ tok/s \|$", line), line
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    compiled = {r["backend"]: r["compiled_decode"] for r in rows if r["device"] == "cpu-compile"}
    assert len(compiled) == 2 and all(c.pop("compile_s") > 0 for c in compiled.values()), compiled
    # every decode step of every round is a compiled step (plus the warm-up one), all without a recompile
    assert all(c == {"backend": "aot_eager", "why": "asked for", "compiles": 1, "recompiles": 0, "steps": 1 + 3 * 2}
               for c in compiled.values()), compiled


def test_auto_compiles_with_the_fastest_backend_and_says_why(monkeypatch):
    monkeypatch.setattr(sim.run, "fastest_compile_backend", lambda device_type: ("aot_eager", f"no {device_type} cc"))
    assert sim.run.compile_backend_for("auto", "cpu") == ("aot_eager", "no cpu cc")
    with pytest.raises(ValueError, match=r"inductor cannot compile for cpu here \(no cpu cc\)"):
        sim.run.compile_backend_for("inductor", "cpu")
    assert sim.run.compile_backend_for("aot_eager", "cpu") == ("aot_eager", "asked for")


def test_inductor_is_the_fastest_backend_only_with_a_cpp_compiler():
    import torch._inductor.config

    if shutil.which("g++") or shutil.which("c++"):
        assert fastest_compile_backend("cpu")[0] == "inductor"
    with torch._inductor.config.patch({"cpp.cxx": ("/nonexistent/c++",)}):
        backend, why = fastest_compile_backend("cpu")
    assert backend == "aot_eager" and why.startswith("inductor needs a C++ compiler on CPU"), why
    assert fastest_compile_backend("npu") == ("aot_eager", "inductor does not generate npu code")


def test_lora_sim_refuses_inductor_where_it_cannot_compile(monkeypatch, capsys):
    monkeypatch.setattr(sim.run, "fastest_compile_backend", lambda device_type: ("aot_eager", "no C++ compiler"))
    assert sim.main(["--device", "cpu-compile", "--compile-backend", "inductor", "--model-config", SMALL]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("lora-sim: error: --compile-backend inductor: inductor cannot compile for cpu here "
                   "(no C++ compiler)"), err


def test_rows_of_other_devices_leave_the_compiled_decode_cell_empty():
    row = sim.SimRow("torch_native", "cpu", "pass")
    assert row.compiled_decode is None and sim.report.format_compiled_decode(row) == ""


def test_the_compiled_decode_benchmark_checks_then_times_both_steps(capsys, tmp_path):
    path = Path(__file__).resolve().parents[1] / "examples" / "bench_compile.py"
    spec = importlib.util.spec_from_file_location("example_bench_compile", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--smoke", "--backend", "aot_eager", "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert "compile backend: aot_eager (asked for)" in out and re.search(r"compiled / eager: \d+\.\d\dx \(", out), out
    result = json.loads((tmp_path / "r.json").read_text())
    assert len(result["seconds"]["eager"]) == len(result["seconds"]["compiled"]) == 3 and result["compile_s"] > 0
