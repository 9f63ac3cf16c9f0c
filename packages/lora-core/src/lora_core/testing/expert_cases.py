"""Random cases for LoRA on fused experts (docs/moe.md): stacked expert weights with
large finite garbage beyond each slot's rank, and router choices that leave some
experts unpicked."""

from __future__ import annotations

import random
from typing import Sequence

import torch

from .cases import GARBAGE

__all__ = ["random_expert_weights", "random_expert_ids"]


def random_expert_weights(gen: torch.Generator, *, num_slots: int, num_experts: int, max_rank: int,
                          in_features: int, out_features: int, lora_ranks: Sequence[int], dtype: torch.dtype,
                          device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """``a (L, E, R, in)``, ``b (L, E, out, R)``: random within each slot's rank, :data:`GARBAGE` beyond."""
    a = torch.randn(num_slots, num_experts, max_rank, in_features, generator=gen) / in_features**0.5
    b = torch.randn(num_slots, num_experts, out_features, max_rank, generator=gen) / max_rank**0.5
    for slot, r in enumerate(lora_ranks):
        a[slot, :, r:] = GARBAGE
        b[slot, :, :, r:] = GARBAGE
    return a.to(device, dtype), b.to(device, dtype)


def random_expert_ids(rng: random.Random, gen: torch.Generator, num_tokens: int, top_k: int,
                      num_experts: int) -> torch.Tensor:
    """``(T, K)`` int64 distinct experts per token, drawn from a random subset of the experts
    (so some are never picked); at least ``top_k`` experts are kept."""
    kept = sorted(rng.sample(range(num_experts), rng.randint(top_k, num_experts)))
    scores = torch.rand(num_tokens, len(kept), generator=gen)
    picks = scores.topk(top_k, dim=1).indices
    return torch.tensor(kept, dtype=torch.long)[picks]
