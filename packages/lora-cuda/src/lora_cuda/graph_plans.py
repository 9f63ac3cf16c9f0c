"""Static-shape plans of the graph-safe kernels: tokens sorted by slot, and token blocks.

Both plans are computed on the host from the batch's mirrors with a few tensor
ops (a stable sort of token slots, a bincount, a cumsum: no Python loop over
tokens or segments) and published to the device in one copy. Their shapes
depend only on the batch's row count (the capacity in graph mode) and slot
count, so in graph mode :meth:`refill` rewrites them in place and a captured
graph replays on the new batch.

* :class:`SortedPlan` (grouped GEMM): every row, active tokens first grouped by
  slot, then the rows without an adapter, which join the last group with rank 0.
* :class:`BlockPlan` (token blocks): each slot's tokens packed into blocks of
  ``b`` rows, ``NB = ceil(T / b) + L`` blocks, at most one partly filled block
  per slot; padding rows point at token 0 and are invalid.
"""

from __future__ import annotations

import torch

from lora_core import BatchInfo, BatchPlan
from lora_core.staging import StagedTensors

__all__ = ["SortedPlan", "BlockPlan", "block_size_for", "MIN_BLOCK_SIZE", "MAX_BLOCK_SIZE"]

MIN_BLOCK_SIZE, MAX_BLOCK_SIZE = 8, 256


def block_size_for(num_rows: int, num_slots: int) -> int:
    """Tokens per block: about half a slot's even share of the rows, as a power of two
    in ``[MIN_BLOCK_SIZE, MAX_BLOCK_SIZE]`` (padding is at most one block per slot)."""
    share = max(1, num_rows // (2 * max(1, num_slots)))
    return min(MAX_BLOCK_SIZE, max(MIN_BLOCK_SIZE, 1 << (share.bit_length() - 1)))


class _SlotOrder:
    """Rows of a batch ordered by slot (host tensors): active rows first, by slot, stable."""

    def __init__(self, batch_info: BatchInfo) -> None:
        L = batch_info.num_slots
        token_slots = batch_info.token_slots_cpu.long()  # (rows,), -1 for no adapter and padding
        ranks = torch.cat([batch_info.lora_ranks_cpu.long(), torch.zeros(1, dtype=torch.long)])
        scalings = torch.cat([batch_info.scalings_cpu, torch.zeros(1)])
        self.row_ranks = ranks[token_slots]  # slot -1 picks the trailing 0
        active = self.row_ranks > 0
        self.key = torch.where(active, token_slots, L)
        self.row_scalings = torch.where(active, scalings[token_slots], 0.0)
        self.order = torch.argsort(self.key, stable=True)
        self.counts = torch.bincount(self.key, minlength=L + 1)[:L]  # active rows per slot


class SortedPlan(BatchPlan):
    """Rows sorted by slot for grouped GEMMs (``rows`` = the batch info's ``num_tokens``).

    Device tensors: ``sorted_tokens (rows,)`` int64, ``sorted_ranks (rows,)`` int32,
    ``sorted_scalings (rows,)`` float32 (0 for rows without an adapter),
    ``group_ends (L,)`` int32 (end row of each slot's group; the last group also
    holds the rows without an adapter, so it ends at ``rows``).
    """

    def __init__(self, batch_info: BatchInfo) -> None:
        self.num_rows, L = batch_info.num_tokens, batch_info.num_slots
        self._staged = StagedTensors(
            {"sorted_tokens": ((self.num_rows,), torch.int64), "sorted_ranks": ((self.num_rows,), torch.int32),
             "sorted_scalings": ((self.num_rows,), torch.float32), "group_ends": ((L,), torch.int32)},
            batch_info.device, double_buffered=batch_info.use_graph,
        )
        self.sorted_tokens, self.sorted_ranks, self.sorted_scalings, self.group_ends = self._staged.device.values()
        self.refill(batch_info)

    @classmethod
    def build(cls, batch_info: BatchInfo) -> SortedPlan:
        return cls(batch_info)

    def refill(self, batch_info: BatchInfo) -> None:
        order = _SlotOrder(batch_info)
        host = self._staged.host
        host["sorted_tokens"].copy_(order.order)
        host["sorted_ranks"].copy_(order.row_ranks[order.order])
        host["sorted_scalings"].copy_(order.row_scalings[order.order])
        ends = host["group_ends"]
        if ends.numel():
            ends.copy_(order.counts.cumsum(0))
            ends[-1] = self.num_rows
        self._staged.upload()


class BlockPlan(BatchPlan):
    """Token blocks for the blocked kernel: ``NB = ceil(rows / b) + L`` blocks of ``b`` rows.

    Device tensors: ``block_slots (NB,)`` int64, ``block_ranks (NB,)`` int32,
    ``block_scalings (NB,)`` float32, ``block_tokens (NB*b,)`` int64,
    ``block_valid (NB, b)`` bool. Padding blocks have rank 0, slot 0, scaling 0.
    """

    def __init__(self, batch_info: BatchInfo) -> None:
        rows, L = batch_info.num_tokens, batch_info.num_slots
        self.block_size = b = block_size_for(rows, L)
        self.num_blocks = nb = -(-rows // b) + L
        self._staged = StagedTensors(
            {"block_slots": ((nb,), torch.int64), "block_ranks": ((nb,), torch.int32),
             "block_scalings": ((nb,), torch.float32), "block_tokens": ((nb * b,), torch.int64),
             "block_valid": ((nb, b), torch.bool)},
            batch_info.device, double_buffered=batch_info.use_graph,
        )
        (self.block_slots, self.block_ranks, self.block_scalings, self.block_tokens,
         self.block_valid) = self._staged.device.values()
        self.refill(batch_info)

    @property
    def gathered_rows(self) -> int:
        """Rows of ``x`` the blocked kernel gathers, ``NB * b``: at most ``rows + L * b``."""
        return self.num_blocks * self.block_size

    @classmethod
    def build(cls, batch_info: BatchInfo) -> BlockPlan:
        return cls(batch_info)

    def refill(self, batch_info: BatchInfo) -> None:
        host = self._staged.host
        L, b, nb = batch_info.num_slots, self.block_size, self.num_blocks
        if L == 0 or batch_info.num_tokens == 0:  # nothing to plan: every block is padding
            for t in host.values():
                t.zero_()
            self._staged.upload()
            return
        order = _SlotOrder(batch_info)
        counts = order.counts
        blocks_per_slot = (counts + b - 1) // b
        block_ends = blocks_per_slot.cumsum(0)
        slot = torch.searchsorted(block_ends, torch.arange(nb), right=True)  # L for padding blocks
        real = slot < L
        slot = slot.clamp(max=L - 1)
        index_in_slot = torch.arange(nb) - (block_ends - blocks_per_slot)[slot]
        row_in_slot = index_in_slot[:, None] * b + torch.arange(b)[None, :]  # (NB, b)
        valid = real[:, None] & (row_in_slot < counts[slot][:, None])
        group_start = counts.cumsum(0) - counts
        position = (group_start[slot][:, None] + row_in_slot).clamp(max=order.order.numel() - 1)
        host["block_valid"].copy_(valid)
        host["block_tokens"].view(nb, b).copy_(torch.where(valid, order.order[position], 0))
        host["block_slots"].copy_(torch.where(real, slot, 0))
        host["block_ranks"].copy_(torch.where(real, batch_info.lora_ranks_cpu.long()[slot], 0))
        host["block_scalings"].copy_(torch.where(real, batch_info.scalings_cpu[slot], 0.0))
        self._staged.upload()
