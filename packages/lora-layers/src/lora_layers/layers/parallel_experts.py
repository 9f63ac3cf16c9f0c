"""``ParallelExpertsWithLoRA``: fused experts sharded over the intermediate dimension (docs/moe.md).

Each process holds every expert's shard of the intermediate dimension: ``gate_up_proj``
column-parallel (its rows of gate and its rows of up: ``(E, 2 * I / tp, H)``) and
``down_proj`` row-parallel (``(E, H, I / tp)``), as vLLM shards its fused MoE. The LoRA
follows the base: gate_up's A is full and its B takes the gate and up rows of the shard;
down's A takes the shard's input columns and its B is full. Every term after the
activation is linear in the shard's part, so each process's output (base, LoRA delta
and router weighting) is a partial sum, and one all-reduce of the experts' output
completes it.
"""

from __future__ import annotations

import torch
from torch import nn

from ..parallel import TensorParallel, shard_range
from .context import LoRAContext
from .experts import ExpertsLayout, ExpertsWithLoRA

__all__ = ["ParallelExpertsWithLoRA"]


class ParallelExpertsWithLoRA(ExpertsWithLoRA):
    """Experts sharded over the intermediate dimension; one all-reduce of the output.

    ``base_layer`` holds this process's shard (``gate_up_proj (E, 2 * I / tp, H)``: the
    shard's gate rows, then its up rows; ``down_proj (E, H, I / tp)``). Adapter weights are
    given unsharded, as PEFT saves them.
    """

    def __init__(self, base_layer: nn.Module, context: LoRAContext, tp: TensorParallel) -> None:
        super().__init__(base_layer, context)
        if self.layout != ExpertsLayout(transposed=False, bias=False, interleaved=False):
            raise TypeError(f"{type(self).__name__} shards experts in the (E, out, in) layout with gate rows then up "
                            f"rows and no biases; {type(base_layer).__name__} has {self.layout} (a bias would be "
                            "added once per process, before the all-reduce)")
        self.tp = tp
        self._cols = shard_range(self.intermediate_size * tp.size, tp.rank, tp.size)

    @classmethod
    def can_wrap(cls, module: nn.Module, target) -> bool:
        return False  # built explicitly with its tensor-parallel group, never by the dispatch list

    def _shard(self, index: int, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        full, (start, stop) = self.intermediate_size * self.tp.size, self._cols
        if index == 0:  # gate_up: B's rows of the shard's gate and of its up
            if b.shape[1] != 2 * full:
                raise ValueError(f"gate_up_proj's lora_B must have {2 * full} rows per expert (the unsharded "
                                 f"layer), got {tuple(b.shape)}")
            return a, torch.cat([b[:, start:stop], b[:, full + start : full + stop]], dim=1)
        if a.shape[2] != full:
            raise ValueError(f"down_proj's lora_A must have {full} columns per expert (the unsharded layer), "
                             f"got {tuple(a.shape)}")
        return a[:, :, start:stop], b

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(super().forward(hidden_states, top_k_index, top_k_weights))
