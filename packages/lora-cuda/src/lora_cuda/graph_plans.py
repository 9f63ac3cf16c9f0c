"""Static-shape plans of the graph-safe kernels: tokens sorted by slot, and token blocks.

Both plans are computed on the host from the batch's mirrors with a few NumPy
ops (a stable sort of the segments by slot, their expansion to rows, a bincount,
a cumsum: no Python loop over tokens or segments) and published to the device in one copy. Their shapes
depend only on the batch's row count (the capacity in graph mode) and slot
count, so in graph mode :meth:`refill` rewrites them in place and a captured
graph replays on the new batch.

* :class:`SortedPlan` (grouped GEMM): every row, active tokens first grouped by
  slot, then the rows without an adapter, which join the last group with rank 0;
  on CPU cut into chunks of :data:`CHUNK_ROWS` sorted rows, each with its own
  group ends, so the kernels gather and scatter a chunk at a time.
* :class:`BlockPlan` (token blocks): each slot's tokens packed into blocks of
  ``b`` rows, ``NB = ceil(T / b) + L`` blocks, at most one partly filled block
  per slot; padding rows point at token 0 and are invalid.

Under ``torch.compile`` the kernels run inside lora_cuda's custom ops
(:mod:`lora_cuda.custom_ops`), which take a batch as an int: a graph-mode batch's
:func:`batch_key`, given to it when its first plan is built (``prepare_batch`` or
a warm-up call, before compiling) and kept for its lifetime, refills included;
:func:`batch_args` is what the compiled code passes for a batch (docs/compile.md).
"""

from __future__ import annotations

import itertools
import weakref
from typing import NamedTuple

import numpy as np
import torch

from lora_core import BatchInfo, BatchPlan
from lora_core.platforms import platform_for
from lora_core.staging import StagedTensors

from .block_kernels import BlockRun
from .kernel_tables import KernelTables
from .slot_order import place_in_blocks, slot_order

__all__ = ["SortedPlan", "SortedChunk", "BlockPlan", "batch_args", "batch_key", "batch_of_key", "block_size_for",
           "chunk_rows_for", "CHUNK_ROWS", "MIN_BLOCK_SIZE", "MAX_BLOCK_SIZE"]

MIN_BLOCK_SIZE, MAX_BLOCK_SIZE = 8, 256

CHUNK_ROWS = 512
"""Sorted rows per chunk of the grouped kernels on CPU. A chunk's gathered rows and
its expand's delta (``512 x 2048`` fp32: 4 MiB each) stay in the caches between the
gather, the GEMM and the scatter, where a whole prefill batch's (16 MiB each at
``T = 2048``) go through memory. Measured at prefill ``T = 2048``, ``h = out = 2048``
fp32, 2 threads (docs/benchmarks.md): 512 rows measured like 256 (with half the
calls, each a parallel region) and better than 128 and 1024."""


def chunk_rows_for(num_rows: int, device: torch.device) -> int:
    """Sorted rows per chunk of a :class:`SortedPlan` of ``num_rows`` rows on ``device``:
    :data:`CHUNK_ROWS` where kernel launches cost nothing (the CPU), all rows (one chunk)
    where they do (``Platform.launches_cost``): there the caches this saves do not decide
    the cost and every chunk costs kernel launches."""
    return num_rows if platform_for(device).launches_cost else min(CHUNK_ROWS, num_rows)


def block_size_for(num_rows: int, num_slots: int) -> int:
    """Tokens per block: about half a slot's even share of the rows, as a power of two
    in ``[MIN_BLOCK_SIZE, MAX_BLOCK_SIZE]`` (padding is at most one block per slot)."""
    share = max(1, num_rows // (2 * max(1, num_slots)))
    return min(MAX_BLOCK_SIZE, max(MIN_BLOCK_SIZE, 1 << (share.bit_length() - 1)))


_KEYS: dict[int, int] = {}  # id(batch info) -> key, while the batch info lives (a plain dict: traceable)
_BATCHES: weakref.WeakValueDictionary[int, BatchInfo] = weakref.WeakValueDictionary()
_NEXT_KEY = itertools.count(1)


def batch_key(batch_info: BatchInfo) -> int:
    """The batch info's key for lora_cuda's custom ops: a positive int, the same for the
    batch info's whole life (refills change its content, not its key), never reused.

    Graph-mode batch infos get theirs when a graph plan is built (``prepare_batch``) or a
    graph-safe op first runs on them eagerly (a warm-up), before any compile."""
    key = _KEYS.get(id(batch_info))
    if key is None:
        key = _KEYS[id(batch_info)] = next(_NEXT_KEY)
        _BATCHES[key] = batch_info
        weakref.finalize(batch_info, _KEYS.pop, id(batch_info), None)
    return key


def batch_of_key(key: int) -> BatchInfo:
    """The live batch info of :func:`batch_key` ``key`` (``RuntimeError`` once it is gone)."""
    batch_info = _BATCHES.get(key)
    if batch_info is None:
        raise RuntimeError(f"lora_cuda: the batch info of key {key} no longer exists; a compiled function "
                           "must be called with the graph-mode batch info it was compiled with")
    return batch_info


def batch_args(batch_info: BatchInfo, *tensors: torch.Tensor) -> tuple[int, list[torch.Tensor]]:
    """How compiled code hands ``batch_info`` to lora_cuda's custom ops: ``(key, host tensors)``;
    ``tensors`` are the op's tensor inputs, which must not require grad (the ops have no backward).

    Read while tracing, this reads no batch content, so the compiled code's guards hold
    for every later batch: a graph-mode batch passes its :func:`batch_key` (guarded: the
    same batch info object) and no tensors; an eager batch passes key 0 and its host
    mirrors ``token_slots`` (as many rows as the op's input), ``lora_ranks`` and ``scalings``:
    graph inputs whose sizes are the only thing guarded, from which the op plans the batch
    when it runs.
    """
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise RuntimeError(
            "lora_cuda's ops are inference-only under torch.compile (their custom ops have no backward): "
            "call the compiled model under torch.no_grad() or torch.inference_mode() (docs/compile.md)"
        )
    if not batch_info.use_graph:
        return 0, [batch_info.token_slots_cpu, batch_info.lora_ranks_cpu, batch_info.scalings_cpu]
    key = _KEYS.get(id(batch_info))
    if key is None:
        raise RuntimeError(
            "a graph-mode batch info reached torch.compile before it was prepared; call "
            "backend.prepare_batch(batch_info) (MultiLoRA.enable_graph does), or run the step once eagerly, "
            "before compiling (docs/compile.md)"
        )
    return key, []


class SortedChunk(NamedTuple):
    """One chunk of a :class:`SortedPlan`: sorted rows ``[start, stop)``."""

    start: int
    stop: int
    tokens: torch.Tensor  # (stop - start,) int64: the rows of x, a view of sorted_tokens
    group_ends: torch.Tensor  # (L,) int32: each slot's group end within the chunk, a row of group_ends


class SortedPlan(KernelTables, BatchPlan):
    """Rows sorted by slot for grouped GEMMs (``rows`` = the batch info's ``num_tokens``),
    in ``NC = ceil(rows / chunk_rows)`` chunks of ``chunk_rows`` sorted rows
    (:func:`chunk_rows_for`; the last chunk may be shorter; no chunk for 0 rows).

    Device tensors: ``sorted_tokens (rows,)`` int64, ``token_rows (rows,)`` int64 (its
    inverse: each row's position in the order), ``sorted_ranks (rows,)`` int32,
    ``sorted_scalings (rows,)`` float32 (0 for rows without an adapter),
    ``group_ends (NC, L)`` int32: for each chunk, the end of each slot's group counted
    from the chunk's first row, in ``[0, chunk length]`` (the last group also holds the
    rows without an adapter, so it ends at the chunk's length). ``chunks``: the
    :class:`SortedChunk` of each chunk, views of these tensors, fixed for the plan's life.
    """

    def __init__(self, batch_info: BatchInfo) -> None:
        super().__init__()
        if batch_info.use_graph:
            batch_key(batch_info)  # for compiled code: see batch_args
        self.num_rows = rows = batch_info.num_tokens
        L = batch_info.num_slots
        self.chunk_rows = C = chunk_rows_for(rows, batch_info.device)
        starts = range(0, rows, C or 1)  # none for 0 rows
        self._chunk_starts = np.array(starts, dtype=np.int64).reshape(-1, 1)
        self._chunk_lens = np.minimum(rows - self._chunk_starts, C)
        self._positions = np.arange(rows, dtype=np.int64)
        self._staged = StagedTensors(
            {"sorted_tokens": ((rows,), torch.int64), "token_rows": ((rows,), torch.int64),
             "sorted_ranks": ((rows,), torch.int32),
             "sorted_scalings": ((rows,), torch.float32), "group_ends": ((len(starts), L), torch.int32)},
            batch_info.device, double_buffered=batch_info.use_graph,
        )
        (self.sorted_tokens, self.token_rows, self.sorted_ranks, self.sorted_scalings,
         self.group_ends) = self._staged.device.values()
        # (a chunk's row of group_ends is 16-byte aligned only where L % 4 == 0: CPU grouped GEMMs
        # do not need it, and off CPU there is one chunk)
        self.chunks = tuple(map(SortedChunk, starts, [min(start + C, rows) for start in starts],
                                self.sorted_tokens.split(C or 1), self.group_ends.unbind(0)))
        self.refill(batch_info)

    @classmethod
    def build(cls, batch_info: BatchInfo) -> SortedPlan:
        return cls(batch_info)

    def refill_from(self, batch_info: BatchInfo, twin: BatchPlan) -> None:
        self._staged.copy_published(twin._staged)
        self._refresh_tables()

    def _row_ranks_and_scalings(self):
        return self.sorted_ranks, self.sorted_scalings, None

    def refill(self, batch_info: BatchInfo) -> None:
        order = slot_order(batch_info)
        host = self._staged.host_arrays
        host["sorted_tokens"][:] = order.order
        host["token_rows"][order.order] = self._positions
        host["sorted_ranks"][:] = order.row_ranks
        host["sorted_scalings"][:] = order.row_scalings
        ends = host["group_ends"]
        if ends.size:
            slot_ends = np.cumsum(order.counts)  # (L,): of the whole order
            slot_ends[-1] = self.num_rows
            in_chunk = slot_ends - self._chunk_starts  # (NC, L); then clipped to [0, chunk length]
            np.maximum(in_chunk, 0, out=in_chunk)
            np.minimum(in_chunk, self._chunk_lens, out=ends)  # (np.clip costs 3x these two at decode)
        self._staged.upload()
        self._refresh_tables()


class BlockPlan(KernelTables, BatchPlan):
    """Token blocks for the blocked kernel: ``NB = ceil(rows / b) + L`` blocks of ``b`` rows, one run
    (:class:`~lora_cuda.block_kernels.BlockRun`).

    Device tensors: ``block_slots (NB,)`` int64, ``block_ranks (NB,)`` int32,
    ``block_scalings (NB,)`` float32, ``block_tokens (NB*b,)`` int64,
    ``block_valid (NB, b)`` bool, ``token_rows (rows,)`` int64 (each row's position in
    the blocks; for rows without an adapter, the first padding row's: with
    ``NB*b >= rows + b`` there always is one). Padding blocks have rank 0, slot 0,
    scaling 0.
    """

    def __init__(self, batch_info: BatchInfo) -> None:
        super().__init__()
        if batch_info.use_graph:
            batch_key(batch_info)
        rows, L = batch_info.num_tokens, batch_info.num_slots
        self.block_size = b = block_size_for(rows, L)
        self.num_blocks = nb = -(-rows // b) + L
        self.runs = (BlockRun(0, nb, b),)
        self._staged = StagedTensors(
            {"block_slots": ((nb,), torch.int64), "block_ranks": ((nb,), torch.int32),
             "block_scalings": ((nb,), torch.float32), "block_tokens": ((nb * b,), torch.int64),
             "block_valid": ((nb, b), torch.bool), "token_rows": ((rows,), torch.int64)},
            batch_info.device, double_buffered=batch_info.use_graph,
        )
        (self.block_slots, self.block_ranks, self.block_scalings, self.block_tokens,
         self.block_valid, self.token_rows) = self._staged.device.values()
        self.refill(batch_info)

    def refill_from(self, batch_info: BatchInfo, twin: BatchPlan) -> None:
        self._staged.copy_published(twin._staged)
        self._refresh_tables()

    def _row_ranks_and_scalings(self):
        nb = self.num_blocks
        return (self.block_ranks[:, None].expand(nb, self.block_size),
                self.block_scalings[:, None].expand(nb, self.block_size), self.block_valid)

    def run_weights(self, weights: torch.Tensor, run: int) -> torch.Tensor:
        """``weights (L, ...)`` of each block's slot, ``(NB, ...)``, gathered into a workspace (one run)."""
        out = self.workspace("weights", (self.num_blocks, *weights.shape[1:]), weights.dtype, weights.device)
        return torch.index_select(weights, 0, self.block_slots, out=out)

    @property
    def gathered_rows(self) -> int:
        """Rows of ``x`` the blocked kernel gathers, ``NB * b``: at most ``rows + L * b``."""
        return self.num_blocks * self.block_size

    @classmethod
    def build(cls, batch_info: BatchInfo) -> BlockPlan:
        return cls(batch_info)

    def refill(self, batch_info: BatchInfo) -> None:
        host = self._staged.host_arrays
        L, b, nb = batch_info.num_slots, self.block_size, self.num_blocks
        if L == 0 or batch_info.num_tokens == 0:  # nothing to plan: every block is padding
            for array in host.values():
                array.fill(0)
            self._staged.upload()
            self._refresh_tables()
            return
        order = slot_order(batch_info)
        counts = order.counts
        blocks_per_slot = (counts + b - 1) // b
        block_ends = np.cumsum(blocks_per_slot)
        slot = np.searchsorted(block_ends, np.arange(nb), side="right")  # L for padding blocks
        real = slot < L
        slot = np.minimum(slot, L - 1)
        index_in_slot = np.arange(nb) - (block_ends - blocks_per_slot)[slot]
        row_in_slot = index_in_slot[:, None] * b + np.arange(b)[None, :]  # (NB, b)
        valid = host["block_valid"]
        np.logical_and(real[:, None], row_in_slot < counts[slot][:, None], out=valid)
        place_in_blocks(valid, order.order[: order.num_active], host["block_tokens"], host["token_rows"])
        host["block_slots"][:] = np.where(real, slot, 0)
        slot_ranks, slot_scalings = batch_info.slot_ranks_scalings_host
        host["block_ranks"][:] = np.where(real, slot_ranks[slot], 0)
        host["block_scalings"][:] = np.where(real, slot_scalings[slot], 0)
        self._staged.upload()
        self._refresh_tables()
