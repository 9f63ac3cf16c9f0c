"""Tensor-parallel placement for the wrappers, over any ``torch.distributed`` backend."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["TensorParallel", "shard_range"]


def shard_range(size: int, rank: int, world: int) -> tuple[int, int]:
    """``[start, end)`` of ``rank``'s equal shard of ``size`` (which ``world`` must divide)."""
    if size % world:
        raise ValueError(f"a dimension of size {size} cannot be split evenly over tp_size = {world}")
    step = size // world
    return rank * step, (rank + 1) * step


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group (``size == 1``: no parallelism)."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None

    @classmethod
    def from_distributed(cls, group: dist.ProcessGroup | None = None) -> TensorParallel:
        """The current process in ``group`` (default: the world) of an initialised process group."""
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised; call init_process_group first")
        return cls(dist.get_rank(group), dist.get_world_size(group), group)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(t, group=self.group)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.size == 1:
            return t
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)
