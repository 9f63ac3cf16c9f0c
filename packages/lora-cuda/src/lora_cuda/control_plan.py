"""The host loop plan of the control-flow ops (eager batches).

Control-flow ops loop on the host over token groups of Python ints, so that the
loop never reads a device tensor. Two plans, chosen once per batch:

* **segments**: contiguous row ranges (adjacent requests on one slot merged),
  one GEMM per segment and slice;
* **slot groups**: the tokens of each slot gathered once through ``token_perm``,
  one GEMM per slot and slice, scattered back once. Chosen when it saves GEMMs
  and segments are short (decode batches of many single-token requests).

Only the chosen plan is built, with a few NumPy ops on the batch's host
mirrors; the Python loop runs over segments or slots, never over tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from lora_core import BatchInfo, BatchPlan

__all__ = ["ControlPlan", "TokenGroup", "SLOT_GROUPING_MAX_MEAN_SEGMENT_LEN"]

SLOT_GROUPING_MAX_MEAN_SEGMENT_LEN = 64
"""Slot groups replace the segment loop only when active segments are this short on average."""


@dataclass(frozen=True)
class TokenGroup:
    """A run of tokens that share one active adapter slot.

    ``start:end`` indexes the flattened batch (segments) or ``ControlPlan.token_perm``
    (slot groups). ``rank`` and ``scaling`` are the slot's, as Python numbers.
    """

    slot: int
    rank: int
    scaling: float
    start: int
    end: int

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


class ControlPlan(BatchPlan):
    """Token groups for control-flow ops.

    Attributes:
        by_slot: groups are slot groups over ``token_perm`` (else segments).
        groups: the active groups (slot >= 0, rank > 0, non-empty), as :class:`TokenGroup`.
        token_perm: ``(P,)`` int64 on the device, the tokens of active slots grouped
            by slot (``None`` for the segment plan).
    """

    def __init__(self, by_slot: bool, groups: tuple[TokenGroup, ...], token_perm: torch.Tensor | None) -> None:
        self.by_slot, self.groups, self.token_perm = by_slot, groups, token_perm

    @classmethod
    def build(cls, batch_info: BatchInfo) -> ControlPlan:
        S, L = batch_info.num_segments, batch_info.num_slots
        seg_slots = batch_info.weight_indices_cpu.numpy()[:S]
        seg_lens = batch_info.seg_lens_cpu.numpy()[:S]
        active = np.append(batch_info.lora_ranks_cpu.numpy(), 0)[seg_slots] > 0  # slot -1 -> rank 0
        slots, lens = seg_slots[active], seg_lens[active]
        per_slot = np.bincount(slots, weights=lens, minlength=L).astype(np.int64)
        num_groups, num_slots = int(active.sum()), int(np.count_nonzero(per_slot))
        ranks, scalings = batch_info.lora_ranks_host, batch_info.scalings_host
        by_slot = num_slots < num_groups and int(lens.sum()) / num_groups < SLOT_GROUPING_MAX_MEAN_SEGMENT_LEN
        if not by_slot:
            starts = batch_info.seg_indptr_cpu.numpy()[:S][active].tolist()
            groups = tuple(TokenGroup(s, ranks[s], scalings[s], start, start + n)
                           for s, n, start in zip(slots.tolist(), lens.tolist(), starts))
            return cls(False, groups, None)
        token_slots = batch_info.token_slots_cpu.numpy()[: batch_info.num_real_tokens]
        token_active = np.append(batch_info.lora_ranks_cpu.numpy(), 0)[token_slots] > 0
        perm = np.argsort(np.where(token_active, token_slots, L), kind="stable")[: int(lens.sum())]
        groups, start = [], 0
        for s, n in enumerate(per_slot.tolist()):
            if n:
                groups.append(TokenGroup(s, ranks[s], scalings[s], start, start + n))
                start += n
        return cls(True, tuple(groups), torch.from_numpy(perm).to(batch_info.device))

    def refill(self, batch_info: BatchInfo) -> None:
        fresh = self.build(batch_info)  # eager batches only: sizes may change freely
        self.by_slot, self.groups, self.token_perm = fresh.by_slot, fresh.groups, fresh.token_perm
