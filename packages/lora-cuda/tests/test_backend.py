"""TorchNativeBackend: the whole lora_core interface, packed layers, in-place accumulation."""

import pytest
import torch

from lora_core import get_backend
from lora_core.reference import reference_linear
from lora_core.testing import BatchPair, assert_close_to_reference, random_linear_weights
from lora_cuda import TorchNativeBackend

RANKS = [8, 2, 0]


def test_registered_as_torch_native():
    assert get_backend("torch_native") is TorchNativeBackend


@pytest.mark.parametrize(("method", "widths"), [("run_qkv", [32, 8, 8]), ("run_gate_up", [24, 24])])
def test_packed_layers_match_the_reference_layer(device, method, widths):
    gen = torch.Generator().manual_seed(0)
    a, b, offsets = random_linear_weights(gen, num_slots=3, max_rank=8, in_features=16, slice_widths=widths,
                                          lora_ranks=RANKS, dtype=torch.float32, device=device.torch_device)
    weight = torch.randn(offsets[-1], 16, generator=gen).to(device.torch_device)
    x = torch.randn(12, 16, generator=gen).to(device.torch_device)
    pair = BatchPair(RANKS, ([4, 4, 4], [0, None, 1]), ([2, 9, 1], [1, 2, 0]))
    backend = TorchNativeBackend(device.torch_device)

    def layer(info, x):
        backend.prepare_batch(info)
        return getattr(backend, method)(x, a, b, offsets, x @ weight.T)

    out_a, out_b = pair.run(device, layer, x)
    for out, ref in zip([out_a, out_b], pair.reference_infos()):
        assert_close_to_reference(out, reference_linear(x, weight, None, a, b, ref, offsets))


def test_base_output_is_accumulated_in_place_and_kept_without_adapters():
    backend = TorchNativeBackend()
    gen = torch.Generator().manual_seed(0)
    a, b, offsets = random_linear_weights(gen, num_slots=3, max_rank=8, in_features=4, slice_widths=[6],
                                          lora_ranks=RANKS, dtype=torch.float32, device="cpu")
    x = torch.randn(5, 4)
    for slots in ([None, None], [0, 1]):
        info = BatchPair(RANKS, ([2, 3], slots), ([2, 3], slots)).build(([2, 3], slots), "cpu")
        backend.prepare_batch(info)
        base = torch.randn(5, 6)
        before = base.clone()
        out = backend.run_lora_b(backend.run_lora_a(x, a), b, offsets, base)
        assert out is base
        if slots[0] is None:
            assert torch.equal(out, before)


def test_init_graph_batch_info_is_refillable():
    backend = TorchNativeBackend()
    info = backend.init_graph_batch_info(16, RANKS, [1.0, 2.0, 0.0])
    assert info.use_graph and info.capacity == 16 and info.token_slots.tolist() == [-1] * 16
    info.refill([3, 5], [0, 1])
    assert info.token_slots.tolist()[:9] == [0, 0, 0, 1, 1, 1, 1, 1, -1]


def test_errors_before_prepare_and_for_slice_counts_the_weights_do_not_fit():
    backend = TorchNativeBackend()
    with pytest.raises(RuntimeError, match="prepare_batch"):
        backend.run_lora_a(torch.randn(1, 4), torch.randn(1, 2, 4))
    backend.prepare_batch(backend.init_graph_batch_info(4, [2], [1.0]))
    # the slice count is the offsets': A's rows must be that many ranks, and there is at least one slice
    with pytest.raises(ValueError, match=r"weights dim 1 \(6\) is not num_slices \(4\) times a rank"):
        backend.run_qkv(torch.randn(4, 4), torch.randn(1, 6, 4), torch.randn(1, 16, 2), [0, 4, 8, 12, 16])
    for method in (backend.run_packed, backend.run_gate_up):
        with pytest.raises(ValueError, match=r"slice_offsets must be increasing ints starting at 0.*got \[0\]"):
            method(torch.randn(4, 4), torch.randn(1, 2, 4), torch.randn(1, 8, 2), [0])
    with pytest.raises(TypeError, match="must be a lora_core.BatchInfo"):
        backend.prepare_batch(object())
