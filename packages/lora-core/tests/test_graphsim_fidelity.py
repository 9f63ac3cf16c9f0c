"""Fidelity of the graph simulator on code written elsewhere, and the capture check.

The gaps that porting public CUDA-graph bugs to CPU showed (issue #31): host-resident
metadata (sglang's ``output_offset_cpu``), ``t.to(x.device)`` onto the tensor's own
device, and a replay that goes wrong only when the replayed batch is the richer one.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lora_core.testing import BatchPair, CaptureError, GraphSimulator, make_device
from lora_core.testing.capture_check import check_capture, main


def _segment_sums(x: torch.Tensor, offsets_cpu: torch.Tensor) -> torch.Tensor:
    """An sglang-style op: per-segment sums with the segment ends read from CPU metadata."""
    total = int(offsets_cpu[-1].item())
    return torch.stack([x[: total].sum(), x[: int(offsets_cpu[0].item())].sum()])


def test_reads_of_undeclared_metadata_are_violations():
    with pytest.raises(CaptureError, match=r"Tensor.item\(\)"):
        GraphSimulator(strict=True).capture(_segment_sums, torch.arange(8.0), torch.tensor([2, 6]))


def test_host_resident_reads_are_allowed_and_baked_in():
    x, offsets = torch.arange(8.0), torch.tensor([2, 6])
    sim = GraphSimulator(strict=True, host_resident=[offsets])
    out = sim.capture(_segment_sums, x, offsets)
    assert sim.violations == [] and out.tolist() == [15.0, 1.0]
    x.copy_(torch.arange(8.0) * 2)
    assert sim.replay().tolist() == [30.0, 2.0]  # the device data is replayed, the host values are baked


def test_a_replay_after_a_host_resident_tensor_changed_is_stale():
    x, offsets = torch.arange(8.0), torch.tensor([2, 6])
    sim = GraphSimulator(strict=True, host_resident=[offsets])
    sim.capture(_segment_sums, x, offsets)
    offsets.copy_(torch.tensor([3, 8]))
    with pytest.raises(CaptureError, match="stale replay: a host-resident tensor") as err:
        sim.replay()
    assert "test_graphsim_fidelity.py" in str(err.value) and "Tensor.item" in str(err.value)
    lenient = GraphSimulator(strict=False, host_resident=[offsets])
    lenient.capture(_segment_sums, x, offsets)
    offsets.add_(1)
    lenient.replay()
    assert [v.rule.split(":")[0] for v in lenient.violations] == ["stale replay"] * 2


def test_host_resident_must_be_tensors():
    with pytest.raises(TypeError, match=r"host_resident\[1\] must be a torch.Tensor, got list"):
        GraphSimulator(host_resident=[torch.zeros(1), [1, 2]])


def test_the_device_harness_passes_host_resident_tensors_to_the_simulator():
    device, x, offsets = make_device("cpu-graphsim"), torch.arange(8.0), torch.tensor([2, 6])
    assert device.run(_segment_sums, x, offsets, host_resident=[offsets]).tolist() == [15.0, 1.0]
    with pytest.raises(CaptureError):
        device.run(_segment_sums, x, offsets)


def test_to_the_tensors_own_device_is_not_a_host_copy():
    def fn(x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        return x.to(other.device) + x.to(device=other.device) * 2

    sim = GraphSimulator(strict=True)
    sim.capture(fn, torch.arange(3.0), torch.zeros(1))
    assert sim.violations == []
    with pytest.raises(CaptureError, match=r"Tensor.to\('cpu'\)"):  # the string still means the host
        GraphSimulator(strict=True).capture(lambda x: x.to("cpu") + 1, torch.arange(3.0))


class _RecordingDevice:
    """A graph TestDevice stand-in that records which batch each capture and replay saw."""

    is_graph, torch_device = True, torch.device("cpu")

    def __init__(self) -> None:
        self.runs: list[tuple[tuple, tuple]] = []

    def run_two_batches(self, fn, inputs, refill):
        captured = fn(*inputs)
        refill()
        replayed = fn(*inputs)
        self.runs.append((captured, replayed))
        return captured, replayed


def test_batch_pairs_capture_each_batch_and_replay_the_other_on_graph_devices():
    poor, rich = ([4, 0], [0, None]), ([1, 1, 1, 1], [0, 1, 2, None])
    device = _RecordingDevice()
    out_a, out_b = BatchPair([2, 2, 2], poor, rich).run(device, lambda info, x: info.seq_lens, torch.zeros(1))
    assert device.runs == [((4, 0), (1, 1, 1, 1)), ((1, 1, 1, 1), (4, 0))], \
        "graph devices capture the poorer batch and replay the richer one, and the reverse"
    assert (out_a, out_b) == ((4, 0), (1, 1, 1, 1))  # each output is a replay after capturing the other batch


def test_batch_pairs_run_once_on_eager_devices():
    device = _RecordingDevice()
    device.is_graph = False
    BatchPair([2], ([2], [0]), ([1, 1], [0, 0])).run(device, lambda info, x: info.seq_lens, torch.zeros(1))
    assert device.runs == [((2,), (1, 1))]


def _host_read(x: torch.Tensor) -> torch.Tensor:
    n = int(x[0])
    return x[:n].sum() + x.nonzero().sum() + x[0].item()


def test_capture_check_reports_every_violation_grouped_and_counted():
    report = check_capture(_host_read, torch.tensor([3.0, 1.0, 0.0, 2.0]))
    assert not report.clean and report.aborted is None
    groups = report.by_rule()
    assert set(groups) == {"host read: int(tensor) syncs and bakes a Python int",
                           "data-dependent shape: aten.nonzero syncs and sizes its output from device data",
                           "host read: Tensor.item() syncs and bakes a Python scalar"}
    assert report.violations == 3 and all("test_graphsim_fidelity.py" in f.where for f in report.findings)
    text = report.format()
    assert "3 capture-unsafe call(s) at 3 place(s), 3 rule(s)" in text and "1x" in text


def test_capture_check_counts_a_call_in_a_loop_once_per_call():
    def loop(x: torch.Tensor) -> torch.Tensor:
        return sum(x * x[i].item() for i in range(3))

    report = check_capture(loop, torch.ones(3))
    assert [f.count for f in report.findings] == [3] and report.violations == 3
    text = report.format()
    assert "  3x  Tensor.item" in text and "3 capture-unsafe call(s) at 1 place(s), 1 rule(s)" in text
    assert "Tensor.item() syncs and bakes a Python scalar  [3]" in text  # the rule's total: calls, not places


def test_capture_check_of_clean_code_is_clean():
    report = check_capture(lambda x: x * 2, torch.ones(3), target="double")
    assert report.clean and "no capture-unsafe calls" in report.format() and report.target == "double"


def test_capture_check_reports_a_call_that_raises_under_capture():
    def raises_second_time(x, calls=[]):  # noqa: B006 - counts the calls on purpose
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("boom")
        return x

    report = check_capture(raises_second_time, torch.ones(1))
    assert report.aborted == "RuntimeError: boom" and not report.clean


def test_capture_check_command_runs_a_callable(tmp_path, capsys, monkeypatch):
    (tmp_path / "my_step.py").write_text("import torch\nx = torch.ones(3)\n\ndef step():\n    return x * x[0].item()\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["--call", "my_step:step"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("capture check: my_step:step\n") and "my_step.py:5 in step" in out


@pytest.mark.parametrize(("args", "message"), [
    (["--call", "nocolon"], "--call nocolon: expected MODULE:FUNCTION"),
    (["--call", "no_such_module_xyz:f"], "--call no_such_module_xyz:f: cannot import no_such_module_xyz"),
    (["--call", "os:sep"], "--call os:sep: sep is str, expected a function taking no arguments"),
    (["--model-config", "/nonexistent/config.json"], "expected a config.json file or a directory holding one"),
])
def test_capture_check_command_bad_input_exits_2_naming_the_argument(args, message, capsys):
    assert main(args) == 2
    assert message in capsys.readouterr().err


TINY_GPT2 = {"model_type": "gpt2", "vocab_size": 64, "n_embd": 32, "n_layer": 1, "n_head": 2, "n_positions": 32}


def test_capture_check_command_on_a_transformers_forward_built_from_a_config(tmp_path):
    pytest.importorskip("transformers")
    config = tmp_path / "config.json"
    config.write_text(__import__("json").dumps(TINY_GPT2))
    run = subprocess.run([sys.executable, "-m", "lora_core.testing.capture_check", "--model-config", str(config),
                          "--tokens", "4", "--batch", "1"], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "HF_HUB_OFFLINE": "1"})
    assert run.returncode in (0, 1), run.stderr
    assert run.stdout.startswith(f"capture check: GPT2LMHeadModel forward from {config} (batch 1, 4 tokens")
    assert "Traceback" not in run.stderr
    assert Path(config).is_file()
