"""The stacked buffer layout: slice placement, zeroed tails, eviction, slot bookkeeping."""

import pytest
import torch

from lora_core import AdapterSlots, EmbeddingLoRABuffers, LinearLoRABuffers


def test_linear_load_places_slices_and_zeroes_beyond_rank(device):
    buf = LinearLoRABuffers(num_slots=2, max_rank=4, in_features=3, slice_widths=[2, 1],
                            dtype=torch.float32, device=device.torch_device)
    buf.a.fill_(7.0)
    buf.b.fill_(7.0)
    a0, a1 = torch.ones(2, 3), 2 * torch.ones(2, 3)
    b0, b1 = 3 * torch.ones(2, 2), 4 * torch.ones(1, 2)
    buf.load(1, [a0, a1], [b0, b1])
    a, b = buf.a[1].cpu(), buf.b[1].cpu()
    assert buf.slice_offsets == (0, 2, 3) and buf.a.shape == (2, 8, 3) and buf.b.shape == (2, 3, 4)
    assert torch.equal(a[0:2], a0) and torch.equal(a[4:6], a1)
    assert not a[2:4].any() and not a[6:8].any()  # rows beyond rank zeroed
    assert torch.equal(b[0:2, :2], b0) and torch.equal(b[2:3, :2], b1) and not b[:, 2:].any()
    assert (buf.a[0] == 7).all()  # other slots untouched
    buf.clear(1)
    assert not buf.a[1].any() and not buf.b[1].any()


def test_linear_load_accepts_a_missing_slice():
    buf = LinearLoRABuffers(num_slots=1, max_rank=2, in_features=2, slice_widths=[2, 2, 2],
                            dtype=torch.float32, device="cpu")
    buf.load(0, [torch.ones(2, 2), None, None], [torch.ones(2, 2), None, None])
    assert buf.a[0, :2].all() and not buf.a[0, 2:].any() and not buf.b[0, 2:].any()


@pytest.mark.parametrize(
    ("a", "b", "match"),
    [
        ([torch.ones(2, 5)], [torch.ones(4, 2)], r"lora_a\[0\] must have shape \('r', 3\), got \(2, 5\)"),
        ([torch.ones(2, 3)], [torch.ones(5, 2)], r"lora_b\[0\] must have shape \(4, 'r'\), got \(5, 2\)"),
        ([torch.ones(9, 3)], [torch.ones(4, 9)], r"size 9 in dim 0, more than the buffers' max_rank = 8"),
        ([torch.ones(2, 3)], [torch.ones(4, 3)], "lora_a has rank 2 but lora_b has rank 3"),
        ([torch.ones(2, 3), torch.ones(2, 3)], [torch.ones(4, 2)], "expected 1 slice"),
        ([torch.ones(3)], [torch.ones(4, 2)], "must be a 2-D tensor"),
    ],
)
def test_linear_load_rejects_shapes_that_do_not_fit(a, b, match):
    buf = LinearLoRABuffers(num_slots=2, max_rank=8, in_features=3, slice_widths=[4],
                            dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match=match):
        buf.load(0, a, b)


def test_bad_slot_and_sizes_are_rejected():
    with pytest.raises(ValueError, match=r"slice_widths\[1\] must be a positive int"):
        LinearLoRABuffers(num_slots=1, max_rank=2, in_features=2, slice_widths=[2, 0], dtype=torch.float32, device="cpu")
    buf = LinearLoRABuffers(num_slots=2, max_rank=2, in_features=2, slice_widths=[2], dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match=r"slot must be an int in \[0, 2\), got 2"):
        buf.load(2, [torch.ones(1, 2)], [torch.ones(2, 1)])


def test_embedding_load_with_added_tokens(device):
    buf = EmbeddingLoRABuffers(num_slots=2, max_rank=4, vocab_size=5, embedding_dim=3, num_added_tokens=2,
                               dtype=torch.float32, device=device.torch_device)
    assert buf.a.shape == (2, 4, 7) and buf.b.shape == (2, 3, 4) and buf.extra.shape == (2, 2, 3)
    buf.a.fill_(9.0)
    buf.load(0, torch.ones(2, 5), torch.ones(3, 2), extra_embeddings=torch.ones(1, 3))
    a = buf.a[0].cpu()
    assert a[:2, :5].eq(1).all() and not a[:2, 5:].any() and not a[2:].any()
    assert buf.extra[0, 0].eq(1).all() and not buf.extra[0, 1].any()
    with pytest.raises(ValueError, match="lora_a must have 5 or 7 columns"):
        buf.load(0, torch.ones(2, 6), torch.ones(3, 2))
    with pytest.raises(ValueError, match="more than num_added_tokens = 2"):
        buf.load(0, torch.ones(2, 5), torch.ones(3, 2), extra_embeddings=torch.ones(3, 3))


def test_adapter_slots_assign_release_and_errors():
    slots = AdapterSlots(num_slots=2, max_rank=8)
    assert slots.assign("a", 4, 2.0) == 0 and slots.assign("b", 8, 1.0) == 1
    assert slots.lora_ranks == (4, 8) and slots.scalings == (2.0, 1.0)
    with pytest.raises(RuntimeError, match=r"all 2 adapter slots are in use \(a, b\)"):
        slots.assign("c", 2, 1.0)
    with pytest.raises(ValueError, match="already loaded in slot 0"):
        slots.assign("a", 2, 1.0)
    assert slots.release("a") == 0 and slots.lora_ranks == (0, 8)
    with pytest.raises(KeyError, match=r"adapter 'a' is not loaded \(loaded: b\)"):
        slots.slot_of("a")
    with pytest.raises(ValueError, match=r"rank 9; expected 1 <= rank <= max_rank = 8"):
        slots.assign("c", 9, 1.0)
