"""``RowParallelLinearWithLoRA``: base and LoRA A sharded by input columns."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel import TensorParallel, shard_range
from .context import LoRAContext
from .linear import LinearWithLoRA

__all__ = ["RowParallelLinearWithLoRA"]


class RowParallelLinearWithLoRA(LinearWithLoRA):
    """Base and LoRA A sharded by input columns; the partial base output and the
    partial shrink are all-reduced, B is replicated; the bias is added once."""

    def __init__(self, base_layer: nn.Linear, context: LoRAContext, tp: TensorParallel) -> None:
        super().__init__(base_layer, context, None, tp)
        self._cols = shard_range(base_layer.in_features * tp.size, tp.rank, tp.size)

    def _shard_a(self, a: torch.Tensor) -> torch.Tensor:
        if a.shape[1] != self.base_layer.in_features * self.tp.size:
            raise ValueError(f"lora_a must have {self.base_layer.in_features * self.tp.size} columns "
                             f"(the unsharded layer), got {tuple(a.shape)}")
        return a[:, self._cols[0] : self._cols[1]]

    def _base(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(F.linear(x, self.base_layer.weight))

    def _lora(self, x: torch.Tensor, base_output: torch.Tensor) -> torch.Tensor:
        ctx, buf = self.context, self.buffers
        shrunk = self.tp.all_reduce(ctx.backend.run_lora_a(ctx.to_lora_dtype(x), buf.a))
        out = ctx.add_delta(base_output, ctx.backend.run_lora_b(shrunk, buf.b, buf.slice_offsets,
                                                                ctx.lora_output(base_output)))
        return out if self.base_layer.bias is None else out.add_(self.base_layer.bias)
