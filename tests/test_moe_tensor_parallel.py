"""Tensor-parallel experts over torch.distributed (docs/moe.md): TP=2 (gloo on CPU) equals TP=1."""

import os
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).with_name("tp_moe_worker.py")


def test_tp2_experts_match_the_unsharded_experts(tmp_path):
    init = f"file://{tmp_path / 'rendezvous'}"
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(rank), "2", init], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(2)]
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    for rank, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {rank} failed:\n{out}"
        assert f"rank {rank}: experts match on torch_native and ascend" in out, out
