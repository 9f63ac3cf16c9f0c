"""The ascend benchmark runs end to end on tiny shapes (no timing is asserted)."""

import torch

from lora_ascend import bench
from lora_core.reference import reference_lora_a_embedding
from lora_core.testing import make_batch_info


def test_smoke_run_prints_the_table(capsys):
    assert bench.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    assert "| embedding shrink |" in out and "| shrink+expand |" in out


def test_loop_baseline_computes_the_reference():
    info = make_batch_info([2, 3], [1, 0], [2, 4], device="cpu")
    weights = torch.randn(2, 4, 9)
    ids = torch.tensor([0, 8, 3, 2, 1])
    out = bench.loop_embedding_shrink(ids, weights, torch.tensor([2, 3]), torch.tensor([1, 0]), info.lora_ranks,
                                      info.scalings)
    torch.testing.assert_close(out, reference_lora_a_embedding(ids, weights, info, 9))
