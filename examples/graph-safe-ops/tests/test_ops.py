"""example-ops on every device kind, through lora-core's pytest plugin (no conftest.py).

Each test captures batch A and replays batch B on graph devices (``run_two_batches``),
so an op that read A on the host gives A's answer for B.
"""

from __future__ import annotations

import pytest
import torch

from example_ops import segment_sums, segment_sums_host
from lora_core.testing import CaptureError

LENS_A, LENS_B = [3, 1, 4], [1, 5, 2]  # the same 8 tokens, split differently


def _ids(lens: list[int]) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))


def _reference(x: torch.Tensor, lens: list[int]) -> torch.Tensor:
    return torch.stack([p.sum(0) for p in torch.split(x.cpu(), lens)])


def test_graph_safe_op_is_right_for_both_batches(device):
    x = torch.randn(8, 4).to(device.torch_device)
    ids = _ids(LENS_A).to(device.torch_device)
    out_a, out_b = device.run_two_batches(lambda x, ids: segment_sums(x, ids, 3), (x, ids),
                                          lambda: ids.copy_(_ids(LENS_B)))
    torch.testing.assert_close(out_a.cpu(), _reference(x, LENS_A))
    torch.testing.assert_close(out_b.cpu(), _reference(x, LENS_B))


def test_host_reading_op_is_right_for_both_batches(device, request):
    if device.simulated:
        request.applymarker(pytest.mark.xfail(raises=CaptureError, strict=True,
                                              reason="segment_sums_host reads seq_lens on the host"))
    elif device.is_graph:  # a device graph refuses or bakes in the host read; torch.compile may trace it
        request.applymarker(pytest.mark.xfail(strict=False, reason="a capture may bake in batch A's split"))
    x = torch.randn(8, 4).to(device.torch_device)
    lens = torch.tensor(LENS_A).to(device.torch_device)
    out_a, out_b = device.run_two_batches(segment_sums_host, (x, lens), lambda: lens.copy_(torch.tensor(LENS_B)))
    torch.testing.assert_close(out_a.cpu(), _reference(x, LENS_A))
    torch.testing.assert_close(out_b.cpu(), _reference(x, LENS_B))


@pytest.mark.devices("cpu-graphsim")
def test_the_simulator_names_the_host_read_and_where(device):
    lens = torch.tensor(LENS_A)
    with pytest.raises(CaptureError, match=r"host read: Tensor.tolist\(\).* at .*example_ops.ops.py:\d+ in "
                                           r"segment_sums_host"):
        device.run(segment_sums_host, torch.randn(8, 4), lens)
