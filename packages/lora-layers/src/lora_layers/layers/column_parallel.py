"""Column-parallel linears with LoRA: plain, merged gate_up, and qkv by attention heads.

Base and LoRA B are sharded by output rows, A is replicated (vLLM's convention:
the base module passed in is already the local shard; adapter weights are given
unsharded and each layer takes its shard). With ``fully_sharded=True`` A is sharded
too, by input columns: each process shrinks its columns of the (replicated) input, and
one all-reduce of the ``(T, c*R)`` partial shrinks completes it before the local expand.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from lora_core.checks import check_bool

from ..parallel import TensorParallel, shard_range
from .context import LoRAContext
from .linear import LinearWithLoRA

__all__ = ["ColumnParallelLinearWithLoRA", "MergedColumnParallelLinearWithLoRA", "QKVParallelLinearWithLoRA"]


class ColumnParallelLinearWithLoRA(LinearWithLoRA):
    """Base and LoRA B sharded by output rows; A replicated, or, with ``fully_sharded``,
    sharded by input columns (each process then holds ``1/tp`` of both; one all-reduce of
    the ``(T, c*R)`` shrink per call). ``gather_output`` all-gathers the shards (the full
    output on every rank)."""

    def __init__(self, base_layer: nn.Linear, context: LoRAContext, tp: TensorParallel,
                 slice_widths: Sequence[int] | None = None, gather_output: bool = False, *,
                 fully_sharded: bool = False) -> None:
        full = list(slice_widths) if slice_widths is not None else [base_layer.out_features * tp.size]
        self.full_slice_widths = full
        self._row_ranges = [self._local_rows(i, w, tp) for i, w in enumerate(full)]
        self.fully_sharded = check_bool("fully_sharded", fully_sharded)
        self._input_cols = shard_range(base_layer.in_features, tp.rank, tp.size) if fully_sharded else None
        super().__init__(base_layer, context, [e - s for s, e in self._row_ranges], tp)
        self.gather_output = gather_output

    def _lora_features(self) -> tuple[int, int]:
        if self._input_cols is None:
            return super()._lora_features()
        start, end = self._input_cols
        return end - start, self.out_features

    def _shard_a(self, a: torch.Tensor) -> torch.Tensor:
        if self._input_cols is None:
            return a
        if a.shape[1] != self.in_features:
            raise ValueError(f"lora_a must have {self.in_features} columns (the unsharded layer), got {tuple(a.shape)}")
        return a[:, self._input_cols[0] : self._input_cols[1]]

    def _lora(self, x: torch.Tensor, base_output: torch.Tensor) -> torch.Tensor:
        if self._input_cols is None:
            return super()._lora(x, base_output)
        ctx, buf = self.context, self.buffers
        start, end = self._input_cols
        shrunk = self.tp.all_reduce(ctx.backend.run_lora_a(ctx.to_lora_dtype(x[:, start:end]), buf.a,
                                                           self.num_slices))
        return ctx.add_delta(base_output, ctx.backend.run_lora_b(shrunk, buf.b, buf.slice_offsets,
                                                                 ctx.lora_output(base_output)))

    def _local_rows(self, slice_index: int, width: int, tp: TensorParallel) -> tuple[int, int]:
        return shard_range(width, tp.rank, tp.size)

    @property
    def unsharded_slice_widths(self) -> tuple[int, ...]:
        """The slices' output widths over all ranks (this rank's buffers hold its rows of each)."""
        return tuple(self.full_slice_widths)

    def _shard_b(self, slice_index: int, b: torch.Tensor) -> torch.Tensor:
        if b.shape[0] != self.full_slice_widths[slice_index]:
            raise ValueError(
                f"lora_b of slice {slice_index} must have {self.full_slice_widths[slice_index]} rows "
                f"(the unsharded layer), got {tuple(b.shape)}"
            )
        start, end = self._row_ranges[slice_index]
        return b[start:end]

    def _finish(self, out: torch.Tensor) -> torch.Tensor:
        if not self.gather_output or self.tp.size == 1:
            return out
        if self.num_slices == 1:
            return self.tp.all_gather(out, dim=-1)
        # gather each slice separately so the result is [gate | up] or [q | k | v], not interleaved shards
        offsets = self.buffers.slice_offsets
        return torch.cat([self.tp.all_gather(out[:, offsets[i] : offsets[i + 1]], dim=-1)
                          for i in range(self.num_slices)], dim=-1)


class MergedColumnParallelLinearWithLoRA(ColumnParallelLinearWithLoRA):
    """Packed gate_up: two column-parallel slices ``[gate, up]`` (full widths given)."""

    def __init__(self, base_layer: nn.Linear, context: LoRAContext, tp: TensorParallel,
                 slice_widths: Sequence[int], gather_output: bool = False, *, fully_sharded: bool = False) -> None:
        if len(slice_widths) != 2:
            raise ValueError(f"gate_up has 2 slices, got slice_widths {list(slice_widths)}")
        super().__init__(base_layer, context, tp, slice_widths, gather_output, fully_sharded=fully_sharded)


class QKVParallelLinearWithLoRA(ColumnParallelLinearWithLoRA):
    """Packed qkv, column-parallel by attention heads. With GQA, when ``tp.size``
    exceeds ``num_kv_heads``, each kv head is replicated on ``tp.size / num_kv_heads`` ranks."""

    def __init__(self, base_layer: nn.Linear, context: LoRAContext, tp: TensorParallel, *, num_heads: int,
                 num_kv_heads: int, head_dim: int, gather_output: bool = False, fully_sharded: bool = False) -> None:
        if num_heads % tp.size:
            raise ValueError(f"num_heads = {num_heads} must be divisible by tp_size = {tp.size}")
        if not (num_kv_heads % tp.size == 0 or tp.size % num_kv_heads == 0):
            raise ValueError(f"num_kv_heads = {num_kv_heads} and tp_size = {tp.size} must divide one another")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        widths = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        super().__init__(base_layer, context, tp, widths, gather_output, fully_sharded=fully_sharded)

    def _local_rows(self, slice_index: int, width: int, tp: TensorParallel) -> tuple[int, int]:
        if slice_index == 0 or self.num_kv_heads >= tp.size:
            return shard_range(width, tp.rank, tp.size)
        kv_head = tp.rank // (tp.size // self.num_kv_heads)
        return kv_head * self.head_dim, (kv_head + 1) * self.head_dim

    def _finish(self, out: torch.Tensor) -> torch.Tensor:
        if self.gather_output and self.tp.size > self.num_kv_heads:
            raise ValueError("gather_output with replicated kv heads would duplicate them; gather q/k/v per head")
        return super()._finish(out)
