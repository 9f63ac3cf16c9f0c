"""fully_sharded=True at the boundary: a bad flag, a dimension that does not split over the
processes, and adapter weights that are not the unsharded layer's, each one clear line
(built single-process: a TensorParallel place needs no process group until a forward)."""

import pytest
import torch
from torch import nn

from lora_cuda import TorchNativeBackend
from lora_layers import (
    ColumnParallelLinearWithLoRA,
    EmbeddingWithLoRA,
    LoRAContext,
    QKVParallelLinearWithLoRA,
    RowParallelLinearWithLoRA,
    TensorParallel,
)

TP = TensorParallel(rank=1, size=2)


def _context():
    return LoRAContext(TorchNativeBackend(), num_slots=2, max_rank=4, dtype=torch.float32, device="cpu")


def test_the_flag_must_be_a_bool():
    with pytest.raises(TypeError, match=r"fully_sharded must be a bool, got 'yes'"):
        ColumnParallelLinearWithLoRA(nn.Linear(8, 6), _context(), TP, fully_sharded="yes")


@pytest.mark.parametrize("make", [
    lambda ctx: ColumnParallelLinearWithLoRA(nn.Linear(7, 6), ctx, TP, fully_sharded=True),  # A's 7 input columns
    lambda ctx: RowParallelLinearWithLoRA(nn.Linear(4, 7), ctx, TP, fully_sharded=True),  # B's 7 output rows
    lambda ctx: EmbeddingWithLoRA(nn.Embedding(10, 7), ctx, tp=TP, fully_sharded=True),  # B's 7 dimensions
])
def test_a_dimension_that_does_not_split_is_refused(make):
    with pytest.raises(ValueError, match=r"a dimension of size 7 cannot be split evenly over tp_size = 2"):
        make(_context())


def test_adapter_weights_must_be_the_unsharded_layers():
    ctx = _context()
    column = QKVParallelLinearWithLoRA(nn.Linear(8, 12), ctx, TP, num_heads=2, num_kv_heads=2, head_dim=4,
                                       fully_sharded=True)
    with pytest.raises(ValueError, match=r"lora_a must have 8 columns \(the unsharded layer\), got \(2, 4\)"):
        column.set_lora(0, [(torch.ones(2, 4), torch.ones(8, 2))] * 3)
    row = RowParallelLinearWithLoRA(nn.Linear(4, 6), ctx, TP, fully_sharded=True)
    with pytest.raises(ValueError, match=r"lora_b must have 6 rows \(the unsharded layer\), got \(3, 2\)"):
        row.set_lora(0, [(torch.ones(2, 8), torch.ones(3, 2))])
    embedding = EmbeddingWithLoRA(nn.Embedding(5, 6), ctx, tp=TP, fully_sharded=True)
    with pytest.raises(ValueError, match=r"lora_b must have 6 rows \(the unsharded embedding dimension\), got \(3, 2\)"):
        embedding.set_lora(0, torch.ones(2, 10), torch.ones(3, 2))
    column.set_lora(0, [(torch.ones(2, 8), torch.ones(8, 2)), None, (torch.ones(2, 8), torch.ones(8, 2))])
    assert column.buffers.a.shape[-1] == 4  # this process's half of the input columns
