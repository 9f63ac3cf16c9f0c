"""``ParallelExpertsWithLoRA``: fused experts sharded over the intermediate dimension (docs/moe.md).

Each process holds every expert's shard of the intermediate dimension: ``gate_up_proj``
column-parallel (its rows of gate and its rows of up: ``(E, 2 * I / tp, H)``) and
``down_proj`` row-parallel (``(E, H, I / tp)``), as vLLM shards its fused MoE. The LoRA
follows the base: gate_up's A is full and its B takes the gate and up rows of the shard;
down's A takes the shard's input columns and its B is full. Every term after the
activation is linear in the shard's part, so each process's output (base, LoRA delta
and router weighting) is a partial sum, and one all-reduce of the experts' output
completes it.

With ``fully_sharded=True`` the two factors each process replicates are sharded too, by the
hidden dimension ``H`` (each process then holds ``1/tp`` of every A and B):

* gate_up's A by its input columns: each process shrinks its columns of the (replicated)
  input, a partial ``(T, K, R)`` sum; one all-reduce of it, then the expand with its B rows;
* down's B by its output rows: the shrink over the shard's intermediate columns is partial
  (as today), one all-reduce of it, then each process expands only its ``H / tp`` rows into
  its partial output, which the all-reduce of the experts' output sums with the others'
  rows (the router weighting is linear).

Two all-reduces of ``(T, K, R)`` per call beside the output's: the down shrink needs the
gate_up delta, so they cannot be merged.
"""

from __future__ import annotations

import torch
from torch import nn

from lora_core.checks import check_bool
from lora_core.expert_layout import ExpertLoRABuffers

from ..parallel import TensorParallel, shard_range
from .context import LoRAContext
from .experts import ExpertsLayout, ExpertsWithLoRA

__all__ = ["ParallelExpertsWithLoRA"]

_LAYOUT = ExpertsLayout(transposed=False, bias=False, interleaved=False)


class ParallelExpertsWithLoRA(ExpertsWithLoRA):
    """Experts sharded over the intermediate dimension; one all-reduce of the output.

    ``base_layer`` holds this process's shard (``gate_up_proj (E, 2 * I / tp, H)``: the
    shard's gate rows, then its up rows; ``down_proj (E, H, I / tp)``). Adapter weights are
    given unsharded, as PEFT saves them. ``fully_sharded``: gate_up's A and down's B are
    sharded by ``H`` too (``1/tp`` of every A and B per process), at the cost of two
    all-reduces of the ``(T, K, R)`` shrinks per call.
    """

    def __init__(self, base_layer: nn.Module, context: LoRAContext, tp: TensorParallel, *,
                 fully_sharded: bool = False) -> None:
        layout = ExpertsLayout.of(base_layer)
        if isinstance(layout, ExpertsLayout) and layout != _LAYOUT:
            raise TypeError(f"{type(self).__name__} shards experts in the (E, out, in) layout with gate rows then up "
                            f"rows and no biases; {type(base_layer).__name__} has {layout} (a bias would be "
                            "added once per process, before the all-reduce)")
        self.tp = tp
        self.fully_sharded = check_bool("fully_sharded", fully_sharded)
        self._hidden_shard: tuple[int, int] | None = None
        """Fully sharded: the ``[start, stop)`` of ``H`` this process holds of gate_up's A columns and down's B rows."""
        if fully_sharded and isinstance(layout, ExpertsLayout):  # (another module is refused by the base class)
            self._hidden_shard = shard_range(base_layer.gate_up_proj.shape[2], tp.rank, tp.size)
        super().__init__(base_layer, context)
        self._cols = shard_range(self.intermediate_size * tp.size, tp.rank, tp.size)

    def _lora_features(self, hidden: int, intermediate: int) -> tuple[tuple[int, int], tuple[int, int]]:
        (gate_up_in, gate_up_out), (down_in, down_out) = super()._lora_features(hidden, intermediate)
        if self._hidden_shard is None:
            return (gate_up_in, gate_up_out), (down_in, down_out)
        local = self._hidden_shard[1] - self._hidden_shard[0]
        return (local, gate_up_out), (down_in, local)

    @classmethod
    def can_wrap(cls, module: nn.Module, target) -> bool:
        return False  # built explicitly with its tensor-parallel group, never by the dispatch list

    def _shard(self, index: int, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        full, (start, stop) = self.intermediate_size * self.tp.size, self._cols
        if index == 0:  # gate_up: B's rows of the shard's gate and of its up
            if b.shape[1] != 2 * full:
                raise ValueError(f"gate_up_proj's lora_B must have {2 * full} rows per expert (the unsharded "
                                 f"layer), got {tuple(b.shape)}")
            return (self._hidden_part(a, 2, "gate_up_proj's lora_A", "columns"),
                    torch.cat([b[:, start:stop], b[:, full + start : full + stop]], dim=1))
        if a.shape[2] != full:
            raise ValueError(f"down_proj's lora_A must have {full} columns per expert (the unsharded layer), "
                             f"got {tuple(a.shape)}")
        return a[:, :, start:stop], self._hidden_part(b, 1, "down_proj's lora_B", "rows")

    def _hidden_part(self, t: torch.Tensor, dim: int, name: str, what: str) -> torch.Tensor:
        """``t``'s part of the hidden dimension ``dim`` this process holds (all of it unless fully sharded)."""
        if self._hidden_shard is None:
            return t
        if t.shape[dim] != self.hidden_size:
            raise ValueError(f"{name} must have {self.hidden_size} {what} per expert (the unsharded layer), "
                             f"got {tuple(t.shape)}")
        start, stop = self._hidden_shard
        return t.narrow(dim, start, stop - start)

    def _add_lora(self, x: torch.Tensor, expert_ids: torch.Tensor, buffers: ExpertLoRABuffers,
                  base_output: torch.Tensor) -> torch.Tensor:
        if self._hidden_shard is None:
            return super()._add_lora(x, expert_ids, buffers, base_output)
        ctx, (start, stop) = self.context, self._hidden_shard
        gate_up = buffers is self.gate_up
        x = x[..., start:stop] if gate_up else x  # gate_up's A holds the shard's input columns
        shrunk = self.tp.all_reduce(ctx.backend.run_experts_lora_a(ctx.to_lora_dtype(x), expert_ids, buffers.a))
        rows = base_output if gate_up else base_output[..., start:stop]  # down's B holds the shard's output rows
        ctx.add_delta(rows, ctx.backend.run_experts_lora_b(shrunk, expert_ids, buffers.b, ctx.lora_output(rows)))
        return base_output

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(super().forward(hidden_states, top_k_index, top_k_weights))
