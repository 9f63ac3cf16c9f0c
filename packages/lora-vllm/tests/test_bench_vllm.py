"""examples/bench_vllm.py's argument checks (its figures come from quiet runs, docs/benchmarks.md)."""

import subprocess
import sys
from pathlib import Path

import pytest
from lora_core import available_backends

SCRIPT = Path(__file__).resolve().parents[3] / "examples" / "bench_vllm.py"


@pytest.mark.parametrize(("args", "message"), [
    (["--rounds", "2"], "--rounds must be 3-50, got 2"),
    (["--backends", "torch_native,nope"],
     f"--backends: nope not installed; installed: {', '.join(available_backends())}"),
])
def test_bad_arguments_are_one_line_and_exit_2(args, message):
    run = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1].endswith(message)
