"""Adding a kernel's rows into an output that may be a strided view.

``out.index_add_(0, index, rows)`` into a column slice of a wider output (vLLM's packed
q/k/v and gate/up outputs, which its LoRA layers hand over one slice at a time) runs 3-12x
slower on CPU than into a contiguous output of the same shape (torch 2.13 on a 2-core AMD
EPYC: 38 against 11 us for 32 rows of 1024 columns, 2.9 against 0.25 ms for 2048 rows;
docs/benchmarks.md). The expands therefore add into a strided output through a contiguous
buffer, or, where each row of the output has exactly one source row, by gathering.

A batch's rows with pair rows (weighted mixes) read their inputs and add their deltas at their
tokens' rows: :func:`through_sources` is the one way a kernel's row index reaches them.
"""

from __future__ import annotations

import torch

__all__ = ["index_add_rows_", "gather_add_rows_", "check_sources_output", "through_sources"]


def index_add_rows_(out: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``out[index[j]] += rows[j]`` for every ``j`` (repeated indices accumulate), in place;
    ``out (T, n)`` any strides, ``index (P,)`` int64, ``rows (P, n)``. Returns ``out``."""
    if out.is_contiguous():
        return out.index_add_(0, index, rows)
    return out.add_(out.new_zeros(out.shape).index_add_(0, index, rows))


def gather_add_rows_(out: torch.Tensor, source_rows: torch.Tensor, rows: torch.Tensor,
                     scatter_index: torch.Tensor) -> torch.Tensor:
    """``out[t] += rows[source_rows[t]]`` for every row ``t`` of ``out (T, n)``, in place, where
    every other row of ``rows (P, n)`` is zero and ``scatter_index (P,)`` maps each row of
    ``rows`` to its row of ``out`` (the inverse, with the zero rows pointing anywhere): a
    contiguous ``out`` gets ``index_add_`` over ``scatter_index``, a strided one the gather
    over ``source_rows (T,)``, which adds the same values. Returns ``out``.

    The kernels' zero rows are zero because their inputs are masked before the GEMM, which
    holds for finite weights (``0 * inf`` is NaN): adapters are checked finite at load
    (:func:`lora_core.load_peft_adapter`)."""
    if out.is_contiguous():
        return out.index_add_(0, scatter_index, rows)
    return out.add_(rows.index_select(0, source_rows))


def check_sources_output(sources: torch.Tensor | None, base_output: torch.Tensor | None) -> None:
    """An expand whose rows add into other rows (``sources``: a batch's rows with pair rows) needs the
    output they add into: ``ValueError`` when it is missing."""
    if sources is not None and base_output is None:
        raise ValueError("an expand with sources adds into its tokens' rows: pass base_output (T, out_total)")


def through_sources(index: torch.Tensor, sources: torch.Tensor | None) -> torch.Tensor:
    """The rows of its inputs (or outputs) a kernel reaches through ``index (P,)`` int64, rows of its batch:
    ``index`` itself, or, where the batch's rows are a batch's rows with pair rows and the inputs its tokens
    (``sources (N,)``: each row's token row), ``sources[index]`` (one small gather)."""
    return index if sources is None else sources.index_select(0, index)
