"""build_batch_info: segments, graph-mode refill, lm_head view, bad input."""

import numpy as np
import pytest
import torch

from lora_core import build_batch_info


def test_adjacent_requests_on_one_slot_merge_and_empty_requests_vanish(device):
    info = build_batch_info([2, 0, 3, 1, 1], [0, None, 0, 1, -1], [2, 3], [1.0, 2.0],
                            device=device.torch_device)
    assert info.seg_lens.tolist() == [5, 1, 1]
    assert info.seg_indptr.tolist() == [0, 5, 6, 7]
    assert info.weight_indices.tolist() == [0, 1, -1]
    assert info.token_slots.tolist() == [0, 0, 0, 0, 0, 1, -1]
    assert info.num_tokens == 7 and info.max_len == 5 and info.num_segments == 3
    assert info.seg_lens.device.type == device.torch_device.type
    # host mirrors are CPU tensors; on another device they are separate copies, while an eager
    # batch on the CPU keeps one buffer for both (publishing it copies nothing)
    assert info.seg_lens_cpu.device.type == "cpu" and info.seg_lens_cpu.tolist() == [5, 1, 1]
    shares = info.seg_lens_cpu.data_ptr() == info.seg_lens.data_ptr()
    assert shares == (device.torch_device.type == "cpu")
    assert info.scalings.dtype == torch.float32 and info.lora_ranks.dtype == torch.int32


def test_graph_refill_keeps_tensor_identity_and_pads_with_slot_minus_one(device):
    info = build_batch_info([2, 3], [0, 1], [2, 2], [1.0, 2.0], device=device.torch_device,
                            use_graph=True, max_tokens=8)
    tensors = {n: getattr(info, n) for n in ("seg_lens", "seg_indptr", "weight_indices", "token_slots",
                                             "lora_ranks", "scalings")}
    ptrs = {n: t.data_ptr() for n, t in tensors.items()}
    assert info.num_tokens == 8 and info.token_slots.tolist() == [0, 0, 1, 1, 1, -1, -1, -1]
    info.refill([1, 1, 1], [1, None, 0])
    for n, t in tensors.items():
        assert getattr(info, n) is t and t.data_ptr() == ptrs[n]
    assert info.token_slots.tolist() == [1, -1, 0, -1, -1, -1, -1, -1]
    assert info.seg_lens.tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    assert info.weight_indices.tolist() == [1, -1, 0, -1, -1, -1, -1, -1]
    info.set_adapters([4, 0], [0.5, 0.25])
    assert info.lora_ranks is tensors["lora_ranks"] and info.lora_ranks.tolist() == [4, 0]
    assert info.scalings.tolist() == [0.5, 0.25]


def test_lm_head_view_keeps_last_token_of_each_request_and_refills_with_the_batch():
    info = build_batch_info([3, 0, 2, 1], [1, 0, None, 1], [2, 2], [1.0, 1.0], device="cpu",
                            use_graph=True, max_tokens=8)
    assert info.lm_head_view(pruned=False) is info
    view = info.lm_head_view(pruned=True)
    assert view.seq_lens == (1, 1, 1) and view.token_slots.tolist()[:3] == [1, -1, 1]
    slots = view.token_slots
    info.refill([2, 2], [0, None])
    assert info.lm_head_view(pruned=True) is view and view.token_slots is slots
    assert view.token_slots.tolist()[:3] == [0, -1, -1]


def test_slot_ranks_and_scalings_index_slot_minus_one_as_the_base_model_and_follow_the_adapters():
    info = build_batch_info([1, 2], [0, None], [4, 0, 2], [0.5, 2.0, 1.5], device="cpu",
                            use_graph=True, max_tokens=4)
    ranks, scalings = info.slot_ranks_scalings_host
    assert ranks.dtype == np.int32 and scalings.dtype == np.float32
    assert ranks.tolist() == [4, 0, 2, 0] and scalings.tolist() == [0.5, 0.0, 1.5, 0.0]  # rank 0: scaling 0
    assert ranks[info.weight_indices_cpu.numpy()[:2]].tolist() == [4, 0]  # slot -1 reads the last entry
    info.set_adapters([0, 8, 2], [0.5, 2.0, 1.5])
    ranks, scalings = info.slot_ranks_scalings_host
    assert ranks.tolist() == [0, 8, 2, 0] and scalings.tolist() == [0.0, 2.0, 1.5, 0.0]


@pytest.mark.parametrize("lens", [[1, 1, 1], [1, 0, 1], [0, 0, 0], [2, 1, 0]])
def test_the_pruned_view_of_a_refilled_batch_has_one_token_per_non_empty_request(lens):
    info = build_batch_info([1], [0], [2, 2], [1.0, 1.0], device="cpu", use_graph=True, max_tokens=4)
    view = info.lm_head_view(pruned=True)
    slots = [1, None, 0]
    info.refill(lens, slots)
    kept = [s for n, s in zip(lens, slots) if n]
    assert view.seq_lens == (1,) * len(kept) and view.request_slots == tuple(-1 if s is None else s for s in kept)
    assert view.token_slots.tolist() == [-1 if s is None else s for s in kept] + [-1] * (4 - len(kept))


def test_refill_is_for_graph_mode_only():
    info = build_batch_info([1], [0], [1], [1.0], device="cpu")
    with pytest.raises(RuntimeError, match="graph-mode"):
        info.refill([1], [0])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(seq_lens=[2, -1]), r"seq_lens\[1\] must be an int >= 0, got -1"),
        (dict(seq_lens=[2, 1.5]), r"seq_lens\[1\] must be an int >= 0"),
        (dict(slot_ids=[0, 2]), r"slot_ids\[1\] must be None, -1, a slot in \[0, 2\) or a weighted mix \{slot: weight\}, got 2"),
        (dict(slot_ids=[0, -2]), r"slot_ids\[1\]"),
        (dict(slot_ids=[0]), "one entry per request; got 2 and 1"),
        (dict(lora_ranks=[2, 9], max_rank=8), r"lora_ranks\[1\] = 9 exceeds max_rank = 8"),
        (dict(lora_ranks=[2, -1]), r"lora_ranks\[1\] must be an int >= 0"),
        (dict(scalings=[1.0]), "one entry per slot; got 2 and 1"),
        (dict(scalings=[1.0, float("nan")]), r"scalings\[1\] must be a finite float"),
        (dict(use_graph=True), "max_tokens must be a positive int"),
        (dict(use_graph=True, max_tokens=2), "sum to 3 tokens, more than max_tokens = 2"),
        (dict(max_tokens=8), "only meaningful with use_graph=True"),
        (dict(lora_ranks=torch.tensor([1, 1], device="meta")), "must be host data"),
    ],
)
def test_bad_batch_descriptions_name_the_argument(kwargs, match):
    args = dict(seq_lens=[2, 1], slot_ids=[0, None], lora_ranks=[2, 2], scalings=[1.0, 1.0], device="cpu")
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        build_batch_info(**args)


def test_the_builder_and_the_shared_backend_are_importable_from_their_former_modules():
    """build_batch_info and BatchInfoBackend moved to modules of their own; the old paths still give them."""
    from lora_core import BatchInfoBackend, build_batch_info
    from lora_core.backend import BatchInfoBackend as from_backend
    from lora_core.batch_info import build_batch_info as from_batch_info

    assert from_batch_info is build_batch_info and from_backend is BatchInfoBackend
