"""Tensor parallelism over torch.distributed: TP=2 (gloo on CPU) equals the unsharded layer,
for every wrapper (tp_worker.py) and for the fused experts (tp_moe_worker.py, docs/moe.md)."""

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def _run_tp2(worker: str, tmp_path: Path) -> list[str]:
    """Run ``worker`` as ranks 0 and 1 of a gloo group; each rank's output, after checking it exited 0."""
    init = f"file://{tmp_path / 'rendezvous'}"
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(HERE / worker), str(rank), "2", init], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(2)]
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    for rank, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {rank} failed:\n{out}"
    return outputs


def test_tp2_matches_the_unsharded_layer_for_every_wrapper(tmp_path):
    for rank, out in enumerate(_run_tp2("tp_worker.py", tmp_path)):
        assert f"rank {rank}: 9 wrappers match" in out, out


def test_tp2_experts_match_the_unsharded_experts(tmp_path):
    for rank, out in enumerate(_run_tp2("tp_moe_worker.py", tmp_path)):
        assert f"rank {rank}: experts match on torch_native and ascend" in out, out


def test_tp2_fully_sharded_wrappers_match_the_unsharded_layer(tmp_path):
    """fully_sharded=True on the column-parallel (plain, gate_up, qkv), row-parallel, vocab-parallel
    embedding and fused experts wrappers: both backends, eager (LoRA in float32 and in bf16 beside a float32
    model) and a refilled graph-mode batch, two batches each."""
    for rank, out in enumerate(_run_tp2("tp_fully_sharded_worker.py", tmp_path)):
        assert f"rank {rank}: 84 fully sharded checks match the unsharded layer" in out, out
