"""Per-layer-shape tables and workspaces that a kernel plan keeps on the device.

A plan lays a batch's rows out for one kernel (sorted by slot, or in blocks);
its kernels then need, for every planned row and column of a layer, whether the
column is within the row's slot rank and the slot's scaling. :class:`KernelTables`
computes those once per layer shape and keeps them, with preallocated buffers
for gathered operands, beside the plan.
"""

from __future__ import annotations

from typing import Callable, Hashable, TypeVar

import torch

__all__ = ["KernelTables"]

T = TypeVar("T")


class KernelTables:
    """What a plan keeps for its kernels per layer shape, on the device.

    * column tables, per ``(R, c)``: for every planned row and every one of the
      ``c*R`` columns, the row's slot scaling where the column is within the slot's
      rank (else 0), and as bool whether the column lies *outside* it (beyond the
      rank, or a padding row), the cells a kernel must zero with ``masked_fill_``:
      whatever was computed there from garbage beyond a rank may be inf or NaN, so
      a multiplication by 0 would not clear it. Recomputed on the device after each
      refill, so a kernel reads one table instead of rebuilding the mask per call;
    * workspaces, per ``(shape, dtype)``: preallocated buffers for gathered
      operands, so a call neither allocates nor page-faults them afresh;
    * call operands, per call shape: what a kernel derives from the above for one
      shape of its arguments (the workspaces it writes, their views, the tables it
      reads), made once so that a call does one lookup instead of a dozen: at decode
      sizes these host-side steps cost as much as a small GEMM (docs/benchmarks.md).

    All are created on first use. During a graph capture that is allowed: a
    table is then also computed inside the graph, from the plan's device tensors,
    so a replay reads the refilled batch either way. Under ``torch.compile`` they
    are created and looked up inside lora_cuda's custom ops, when the op runs:
    the compiled code never reads these dicts, so their growth guards nothing.

    Subclasses give the planned rows' ranks, scalings and validity
    (:meth:`_row_ranks_and_scalings`, any common shape ``P``; tables are ``P x c*R``)
    and call :meth:`_refresh_tables` whenever those change.
    """

    def __init__(self) -> None:
        self._tables: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._operands: dict[tuple[int, int], tuple] = {}  # what a refresh reads, made once per table
        self._workspaces: dict[tuple, torch.Tensor] = {}
        self._call_operands: dict[Hashable, object] = {}

    def _row_ranks_and_scalings(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(ranks, scalings, valid)`` of the planned rows: int, float32 and bool (or ``None``
        when every row is valid), all of one shape ``P``."""
        raise NotImplementedError

    def column_tables(self, max_rank: int, num_slices: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scales, outside)`` of shape ``P x c*R`` (float32, bool) for this plan's rows:
        ``scales`` is the row's scaling inside its rank and 0 elsewhere, ``outside`` is true
        exactly where ``scales`` is forced to 0."""
        key = (max_rank, num_slices)
        tables = self._tables.get(key)
        if tables is None:
            ranks, _, _ = self._row_ranks_and_scalings()
            shape = (*ranks.shape, max_rank * num_slices)
            tables = self._tables[key] = (torch.empty(shape, device=ranks.device),
                                          torch.empty(shape, dtype=torch.bool, device=ranks.device))
            self._fill_tables(key, tables)
        return tables

    def workspace(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A preallocated buffer for the kernels' operand ``name`` of ``shape`` and ``dtype``,
        shared by every call with that operand shape (its content is whatever the last
        call left: kernels write it in full before reading it)."""
        key = (name, tuple(shape), dtype, device)
        buffer = self._workspaces.get(key)
        if buffer is None:
            buffer = self._workspaces[key] = torch.empty(shape, dtype=dtype, device=device)
        return buffer

    def call_operands(self, key: Hashable, make: Callable[..., T], *args: object) -> T:
        """``make(self, *args)`` for the call shape ``key``, made on first use and kept for the
        plan's lifetime. ``make`` may only derive views of this plan's tensors, tables and
        workspaces (fixed for its lifetime: refills rewrite them in place), never anything
        of a call's tensors, which differ from layer to layer; ``args`` are what ``key`` says
        of the call (passed, not closed over, so that a call builds no closure)."""
        operands = self._call_operands.get(key)
        if operands is None:
            operands = self._call_operands[key] = make(self, *args)
        return operands  # type: ignore[return-value]

    @property
    def kernel_memory_bytes(self) -> int:
        """Bytes held by the column tables and workspaces created so far."""
        tensors = [t for pair in self._tables.values() for t in pair] + list(self._workspaces.values())
        return sum(t.numel() * t.element_size() for t in tensors)

    def _refresh_tables(self) -> None:
        for key, tables in self._tables.items():
            self._fill_tables(key, tables)

    def _fill_tables(self, key: tuple[int, int], tables: tuple[torch.Tensor, torch.Tensor]) -> None:
        operands = self._operands.get(key)
        if operands is None:  # views of the plan's tensors (fixed for its lifetime) and the column ranks
            max_rank, num_slices = key
            ranks, scalings, valid = self._row_ranks_and_scalings()
            # the ranks' dtype (int32): comparing int64 columns with them would promote in every refresh
            cols = torch.arange(max_rank, dtype=ranks.dtype, device=ranks.device).repeat(num_slices)
            operands = self._operands[key] = (cols, ranks[..., None], scalings[..., None],
                                              None if valid is None else valid[..., None])
        cols, ranks, scalings, valid = operands
        scales, outside = tables
        torch.lt(cols, ranks, out=outside)  # inside for now: four ops, no temporaries
        if valid is not None:
            outside &= valid
        torch.mul(outside, scalings, out=scales)
        outside.logical_not_()
