"""``RowParallelLinearWithLoRA``: base and LoRA A sharded by input columns (and, fully sharded, B by output rows)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lora_core.checks import check_bool

from ..parallel import TensorParallel, shard_range
from .context import LoRAContext
from .linear import LinearWithLoRA

__all__ = ["RowParallelLinearWithLoRA"]


class RowParallelLinearWithLoRA(LinearWithLoRA):
    """Base and LoRA A sharded by input columns; the partial base output and the
    partial shrink are all-reduced; the bias is added once. B is replicated, or, with
    ``fully_sharded``, sharded by output rows: each process adds its rows' delta into its
    partial base output before that output's all-reduce, which sums the rows in (the same
    two all-reduces; each process holds ``1/tp`` of A and of B)."""

    def __init__(self, base_layer: nn.Linear, context: LoRAContext, tp: TensorParallel, *,
                 fully_sharded: bool = False) -> None:
        self.fully_sharded = check_bool("fully_sharded", fully_sharded)
        self._output_rows = shard_range(base_layer.out_features, tp.rank, tp.size) if fully_sharded else None
        super().__init__(base_layer, context, None, tp)
        self._cols = shard_range(base_layer.in_features * tp.size, tp.rank, tp.size)

    def _lora_features(self) -> tuple[int, int]:
        if self._output_rows is None:
            return super()._lora_features()
        start, end = self._output_rows
        return self.in_features, end - start

    def _shard_b(self, slice_index: int, b: torch.Tensor) -> torch.Tensor:
        if self._output_rows is None:
            return b
        if b.shape[0] != self.out_features:
            raise ValueError(f"lora_b must have {self.out_features} rows (the unsharded layer), got {tuple(b.shape)}")
        return b[self._output_rows[0] : self._output_rows[1]]

    def _shard_a(self, a: torch.Tensor) -> torch.Tensor:
        if a.shape[1] != self.base_layer.in_features * self.tp.size:
            raise ValueError(f"lora_a must have {self.base_layer.in_features * self.tp.size} columns "
                             f"(the unsharded layer), got {tuple(a.shape)}")
        return a[:, self._cols[0] : self._cols[1]]

    def _base(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.base_layer.weight)
        return partial if self._output_rows is not None else self.tp.all_reduce(partial)  # fully sharded: in _lora

    def _lora(self, x: torch.Tensor, base_output: torch.Tensor) -> torch.Tensor:
        ctx, buf = self.context, self.buffers
        shrunk = self.tp.all_reduce(ctx.backend.run_lora_a(ctx.to_lora_dtype(x), buf.a))
        if self._output_rows is None:
            out = ctx.add_delta(base_output, ctx.backend.run_lora_b(shrunk, buf.b, buf.slice_offsets,
                                                                    ctx.lora_output(base_output)))
        else:  # this process's rows of the delta into its partial output, then the output's all-reduce
            rows = base_output[:, self._output_rows[0] : self._output_rows[1]]
            ctx.add_delta(rows, ctx.backend.run_lora_b(shrunk, buf.b, buf.slice_offsets, ctx.lora_output(rows)))
            out = self.tp.all_reduce(base_output)
        return out if self.base_layer.bias is None else out.add_(self.base_layer.bias)
