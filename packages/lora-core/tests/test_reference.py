"""Reference math against hand computations on small explicit tensors."""

import math

import torch

from lora_core import build_batch_info, peft_scaling
from lora_core.reference import (
    reference_embedding,
    reference_linear,
    reference_lm_head,
    reference_lora_a,
    reference_lora_a_embedding,
    reference_lora_b,
)

G = 1e3  # garbage beyond each rank: must never show up


def test_shrink_and_expand_one_slice_by_hand():
    info = build_batch_info([1, 1, 1], [0, 1, None], [1, 2], [2.0, 0.5], device="cpu")
    x = torch.tensor([[1.0, 1.0], [2.0, 3.0], [5.0, 5.0]])
    a = torch.tensor([[[1.0, 2.0], [G, G]], [[1.0, 0.0], [0.0, 1.0]]])
    b = torch.tensor([[[1.0, G], [0.0, G], [2.0, G]], [[1.0, 1.0], [0.0, 1.0], [1.0, 0.0]]])
    shrink = reference_lora_a(x, a, info)
    assert torch.equal(shrink, torch.tensor([[6.0, 0.0], [1.0, 1.5], [0.0, 0.0]]))
    delta = reference_lora_b(shrink, b, info, [0, 3])
    assert torch.equal(delta, torch.tensor([[6.0, 0.0, 12.0], [2.5, 1.5, 1.0], [0.0, 0.0, 0.0]]))


def test_two_slices_of_unequal_width_by_hand():
    info = build_batch_info([1], [0], [1], [1.0], device="cpu")
    x = torch.tensor([[1.0]])
    a = torch.tensor([[[2.0], [G], [3.0], [G]]])  # slice 0 rows 0-1, slice 1 rows 2-3, R = 2
    b = torch.tensor([[[5.0, G], [1.0, G], [2.0, G]]])  # slice 0: row 0, slice 1: rows 1-2
    shrink = reference_lora_a(x, a, info, num_slices=2)
    assert torch.equal(shrink, torch.tensor([[2.0, 0.0, 3.0, 0.0]]))
    assert torch.equal(reference_lora_b(shrink, b, info, [0, 1, 3]), torch.tensor([[10.0, 3.0, 6.0]]))


def test_linear_layer_adds_base_and_bias():
    info = build_batch_info([2], [0], [1], [3.0], device="cpu")
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    weight = torch.tensor([[1.0, 2.0]])
    bias = torch.tensor([0.5])
    a = torch.tensor([[[1.0, 1.0]]])
    b = torch.tensor([[[2.0]]])
    # base: [1, 2] + 0.5; delta: 2 * 3 * (x0 + x1) = 6
    assert torch.equal(reference_linear(x, weight, bias, a, b, info), torch.tensor([[7.5], [8.5]]))


def test_lm_head_uses_the_pruned_view():
    info = build_batch_info([2, 1], [0, None], [1], [1.0], device="cpu")
    hidden = torch.tensor([[1.0], [2.0]])  # last token of each request
    weight = torch.tensor([[1.0]])
    a, b = torch.tensor([[[1.0]]]), torch.tensor([[[10.0]]])
    assert torch.equal(reference_lm_head(hidden, weight, a, b, info, pruned=True), torch.tensor([[11.0], [2.0]]))


def test_embedding_shrink_zeroes_out_of_vocab_ids_and_reaches_added_tokens():
    info = build_batch_info([4], [0], [1], [2.0], device="cpu")
    a = torch.tensor([[[1.0, 2.0, 3.0, 4.0], [G, G, G, G]]])
    ids = torch.tensor([0, 3, 4, -1])
    with_added = reference_lora_a_embedding(ids, a, info, vocab_size=3, num_added_tokens=1)
    assert torch.equal(with_added, torch.tensor([[2.0, 0.0], [8.0, 0.0], [0.0, 0.0], [0.0, 0.0]]))
    without = reference_lora_a_embedding(ids, a, info, vocab_size=3)
    assert torch.equal(without[1], torch.zeros(2))  # id 3 is out of vocabulary without added tokens


def test_embedding_layer_by_hand():
    info = build_batch_info([3, 1], [0, None], [1], [2.0], device="cpu")
    weight = torch.tensor([[10.0], [20.0], [30.0]])
    extra = torch.tensor([[[40.0]]])
    a = torch.tensor([[[1.0, 2.0, 3.0, 4.0], [G, G, G, G]]])
    b = torch.tensor([[[1.0, G]]])
    ids = torch.tensor([0, 3, 4, 1])
    out = reference_embedding(ids, weight, a, b, info, extra_embeddings=extra, embed_scale=2.0)
    # base 10 / 40 (added) / 0 (oov) / 20 (slot -1); delta 2 / 8 / 0 / 0; all times 2
    assert torch.equal(out, torch.tensor([[24.0], [96.0], [0.0], [40.0]]))


def test_scaling_matches_peft_formula():
    # PEFT's LoraLayer.update_layer: lora_alpha / math.sqrt(r) if use_rslora else lora_alpha / r
    for alpha, r in [(16, 4), (32, 8), (8, 64), (1, 1)]:
        assert peft_scaling(alpha, r, use_rslora=False) == alpha / r
        assert peft_scaling(alpha, r, use_rslora=True) == alpha / math.sqrt(r)
    assert peft_scaling(16, 4, use_rslora=False) == 4.0 and peft_scaling(16, 4, use_rslora=True) == 8.0
