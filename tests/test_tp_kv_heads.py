"""QKV tensor parallelism with replicated kv heads (tp_size > num_kv_heads), over gloo.

Bug class 6 (docs/bug-classes.md): the rank -> kv-head mapping was never exercised
where it matters: TP=2 with 1 kv head, TP=4 with 1 and with 2 kv heads (ranks 0, 1
hold head 0 and ranks 2, 3 head 1), next to the sharded cases (TP=2 with 2 and 4
kv heads, TP=4 with 4). Each rank's output must equal its rows of the unsharded layer, which
tests/tp_kv_worker.py derives without asking the wrapper.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("tp_kv_worker.py")
LAYOUTS = 3  # kv heads 1, 2 and 4 for each world size


@pytest.mark.parametrize("world", [2, 4])
def test_qkv_with_replicated_kv_heads_matches_the_unsharded_layer(tmp_path, world):
    pytest.importorskip("lora_layers")
    init = f"file://{tmp_path / 'rendezvous'}"
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(rank), str(world), init], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(world)]
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    failed = [rank for rank, p in enumerate(procs) if p.returncode != 0]
    # a rank that fails its check takes the others down with it: show the mismatch first
    failed.sort(key=lambda rank: "AssertionError" not in outputs[rank])
    assert not failed, "\n".join(f"rank {rank} failed:\n{outputs[rank][-3000:]}" for rank in failed)
    for rank, out in enumerate(outputs):
        assert f"rank {rank}: {LAYOUTS} qkv layouts match" in out, out
