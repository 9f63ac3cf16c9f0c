"""fully_sharded=True at the boundary: a bad flag, a dimension that does not split over the
processes, and adapter weights that are not the unsharded layer's, each one clear line
(built single-process: a TensorParallel place needs no process group until a forward)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lora_core.adapters import LoRAModuleWeights
from lora_cuda import TorchNativeBackend
from lora_layers import (
    ColumnParallelLinearWithLoRA,
    EmbeddingWithLoRA,
    LoRAContext,
    ParallelExpertsWithLoRA,
    QKVParallelLinearWithLoRA,
    RowParallelLinearWithLoRA,
    TensorParallel,
)

TP = TensorParallel(rank=1, size=2)


def _context():
    return LoRAContext(TorchNativeBackend(), num_slots=2, max_rank=4, dtype=torch.float32, device="cpu")


class _Experts(nn.Module):
    """This process's shard of fused experts: ``gate_up_proj (E, 2 * I / tp, H)``, ``down_proj (E, H, I / tp)``."""

    def __init__(self, num_experts: int, hidden: int, local_intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(num_experts, 2 * local_intermediate, hidden))
        self.down_proj = nn.Parameter(torch.zeros(num_experts, hidden, local_intermediate))
        self.act_fn = F.silu


def _experts_weights(a_shape, b_shape):
    return LoRAModuleWeights("experts", "experts", torch.ones(a_shape), torch.ones(b_shape), 1.0)


def test_the_flag_must_be_a_bool():
    with pytest.raises(TypeError, match=r"fully_sharded must be a bool, got 'yes'"):
        ColumnParallelLinearWithLoRA(nn.Linear(8, 6), _context(), TP, fully_sharded="yes")
    with pytest.raises(TypeError, match=r"fully_sharded must be a bool, got 1"):
        ParallelExpertsWithLoRA(_Experts(3, 8, 2), _context(), TP, fully_sharded=1)


@pytest.mark.parametrize("make", [
    lambda ctx: ColumnParallelLinearWithLoRA(nn.Linear(7, 6), ctx, TP, fully_sharded=True),  # A's 7 input columns
    lambda ctx: RowParallelLinearWithLoRA(nn.Linear(4, 7), ctx, TP, fully_sharded=True),  # B's 7 output rows
    lambda ctx: EmbeddingWithLoRA(nn.Embedding(10, 7), ctx, tp=TP, fully_sharded=True),  # B's 7 dimensions
    lambda ctx: ParallelExpertsWithLoRA(_Experts(3, 7, 2), ctx, TP, fully_sharded=True),  # hidden size 7
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


def test_expert_adapter_weights_must_be_the_unsharded_experts():
    E, H, I = 3, 8, 4  # unsharded intermediate size 4: 2 per process
    experts = ParallelExpertsWithLoRA(_Experts(E, H, I // 2), _context(), TP, fully_sharded=True)
    good_gate_up, good_down = _experts_weights((E, 2, H), (E, 2 * I, 2)), _experts_weights((E, 2, I), (E, H, 2))
    with pytest.raises(ValueError, match=r"gate_up_proj's lora_A must have 8 columns per expert \(the unsharded "
                                         r"layer\), got \(3, 2, 4\)"):
        experts.load_slot(0, {0: _experts_weights((E, 2, H // 2), (E, 2 * I, 2)), 1: good_down}, 1.0)
    with pytest.raises(ValueError, match=r"down_proj's lora_B must have 8 rows per expert \(the unsharded "
                                         r"layer\), got \(3, 4, 2\)"):
        experts.load_slot(0, {0: good_gate_up, 1: _experts_weights((E, 2, I), (E, H // 2, 2))}, 1.0)
    experts.load_slot(0, {0: good_gate_up, 1: good_down}, 1.0)
    assert experts.gate_up.a.shape[-1] == H // 2 and experts.down.b.shape[2] == H // 2  # this process's half of H
    assert experts.gate_up.b.shape[2] == I and experts.down.a.shape[-1] == I // 2  # the intermediate shard, as today
