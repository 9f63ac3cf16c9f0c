"""Public torch-native LoRA ops: validate at the boundary, then dispatch.

Graph-mode batches (``batch_info.use_graph``) run the graph-safe kernels of
:mod:`lora_cuda.graph_ops`, eager batches the control-flow ones of
:mod:`lora_cuda.control_ops`; ``graph_safe=True`` selects the graph-safe
kernels for any batch. Options are arguments, never process-wide state:
``graph_kernel`` (a preference of :data:`lora_cuda.GRAPH_KERNELS`) and, for the
embedding, ``strict_token_ids``.

Validation reads shapes, dtypes, devices and host-side batch data only, so it
never synchronises the device and is safe under graph capture.

Under ``torch.compile`` (``torch.compiler.is_compiling()``) each op traces as one
custom op of :mod:`lora_cuda.custom_ops`, which validates and runs the
graph-safe kernel when the compiled code runs: nothing here reads the batch's
content while tracing, so a refilled graph-mode batch reuses the compiled code,
and an eager batch takes the graph-safe kernels too (the control-flow ops' host
loop would specialize the compiled code to one batch's segments). docs/compile.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from lora_core import BatchInfo
from lora_core.batch_info_backend import check_pair_rows, expand_rows, gather_token_rows
from lora_core.validation import (
    check_embedding_inputs,
    check_offsets_readable,
    check_lora_a_inputs,
    check_lora_b_inputs,
    check_token_ids,
)

from .custom_ops import compiled_embedding_shrink
from .control_ops import (
    sgemm_lora_a_control_fwd,
    sgemm_lora_a_embedding_control_fwd,
    sgemm_lora_b_control_fwd,
)
from .graph_ops import (
    check_graph_kernel,
    sgemm_lora_a_embedding_graph_fwd,
    sgemm_lora_a_graph_fwd,
    sgemm_lora_b_graph_fwd,
)

if TYPE_CHECKING:
    from lora_core.pair_rows import PairRows

__all__ = ["sgemm_lora_a_fwd", "sgemm_lora_b_fwd", "sgemm_lora_a_embedding_fwd"]


def sgemm_lora_a_fwd(
    x: torch.Tensor,
    weights: torch.Tensor,
    batch_info: BatchInfo,
    num_slices: int = 1,
    *,
    graph_safe: bool = False,
    graph_kernel: str = "auto",
    pair_rows: bool = False,
) -> torch.Tensor:
    """Scaled shrink per slot. ``x: (T, in)``, ``weights: (L, c*R, in)`` -> ``(T, c*R)``
    in ``x.dtype``; columns beyond a slot's rank and rows of slot -1 are zero.

    Semantics (``R = weights.shape[1] // num_slices``, ``r`` and ``s`` the token's
    slot rank and scaling)::

        out[t, i*R : i*R + r] = s * x[t] @ weights[slot_t, i*R : i*R + r].T

    ``pair_rows=True`` (a batch with weighted mixes, ``batch_info.pairs``; ``ValueError`` for a batch
    without): the op runs over the
    batch's rows with pair rows, ``batch_info.pairs.view`` (its token rows, then its pair rows), each
    reading the row of ``x`` of its token (``pairs.token_rows``), and returns ``(N, c*R)``, a row per
    row: ``out[n] = s_n * x[token_rows[n]] @ weights[slot_n].T``. The kernels read ``x`` by token
    row themselves, except under ``torch.compile``, where ``x`` is gathered first.
    """
    if pair_rows:
        return _pair_shrink(x, weights, batch_info, num_slices, graph_safe, graph_kernel)
    if torch.compiler.is_compiling():  # checked and run inside lora_cuda::shrink, when it runs
        return sgemm_lora_a_graph_fwd(x, weights, batch_info, num_slices, kernel=check_graph_kernel(graph_kernel))
    check_lora_a_inputs(x, weights, batch_info, num_slices)
    if graph_safe or batch_info.use_graph:
        return sgemm_lora_a_graph_fwd(x, weights, batch_info, num_slices, kernel=check_graph_kernel(graph_kernel))
    return sgemm_lora_a_control_fwd(x, weights, batch_info, num_slices)


def sgemm_lora_b_fwd(
    x: torch.Tensor,
    weights: torch.Tensor,
    batch_info: BatchInfo,
    slice_offsets: Sequence[int] | torch.Tensor,
    base_output: torch.Tensor | None = None,
    *,
    graph_safe: bool = False,
    graph_kernel: str = "auto",
    pair_rows: bool = False,
) -> torch.Tensor:
    """Expand per slice. ``x: (T, c*R)``, ``weights: (L, out_total, R)``,
    ``slice_offsets: [0, o1, ..., out_total]`` -> ``(T, out_total)``; when
    ``base_output (T, out_total)`` is given the delta is added to it in place and
    it is returned (also when no token has an adapter).

    Semantics::

        out[t, o_i : o_{i+1}] += x[t, i*R : i*R + r] @ weights[slot_t, o_i : o_{i+1}, :r].T

    ``pair_rows=True``: the expand of the shrink with ``pair_rows=True``: ``x (N, c*R)``, a row per row
    of ``batch_info.pairs.view``, each row's delta added into its token's row of ``base_output
    (T, out_total)``: ``out[token_rows[n]] += x[n] @ weights[slot_n].T`` (rows of one token accumulate).
    """
    if pair_rows:
        return _pair_expand(x, weights, batch_info, slice_offsets, base_output, graph_safe, graph_kernel)
    if torch.compiler.is_compiling():  # checked and run inside lora_cuda::expand_, when it runs
        return sgemm_lora_b_graph_fwd(x, weights, batch_info, _compiled_offsets(slice_offsets), base_output,
                                      kernel=check_graph_kernel(graph_kernel))
    offsets = check_lora_b_inputs(x, weights, batch_info, slice_offsets, base_output)
    if graph_safe or batch_info.use_graph:
        return sgemm_lora_b_graph_fwd(x, weights, batch_info, offsets, base_output,
                                      kernel=check_graph_kernel(graph_kernel))
    return sgemm_lora_b_control_fwd(x, weights, batch_info, offsets, base_output)


def sgemm_lora_a_embedding_fwd(
    ids: torch.Tensor,
    weights: torch.Tensor,
    batch_info: BatchInfo,
    vocab_size: int,
    extra_embeddings: torch.Tensor | None = None,
    *,
    graph_safe: bool = False,
    strict_token_ids: bool = False,
) -> torch.Tensor:
    """Scaled embedding shrink. ``ids: (T,)`` integer, ``weights: (L, R, V_total)`` -> ``(T, R)``
    (``(T, 0)`` for empty weights).

    Valid ids are ``[0, vocab_size + added)`` with ``added = extra_embeddings.shape[1]``
    (the slot's added tokens); any other id gets a zero delta, or raises
    ``ValueError`` naming its positions with ``strict_token_ids=True`` (eager only:
    the check reads ids back, so it is skipped while a graph is captured).

    Semantics::

        out[t, :r] = s * weights[slot_t, :r, ids[t]]   if 0 <= ids[t] < vocab_size + added
        out[t, :]  = 0                                 otherwise, and for slot -1
    """
    if torch.compiler.is_compiling():  # checked and run inside lora_cuda::embedding_shrink, when it runs
        return compiled_embedding_shrink(ids, weights, batch_info, vocab_size, extra_embeddings, strict_token_ids)
    num_valid = check_embedding_inputs(ids, weights, batch_info, vocab_size, extra_embeddings)
    if strict_token_ids:
        check_token_ids(ids, num_valid)
    if weights.numel() == 0:
        return weights.new_zeros(ids.shape[0], weights.shape[1])
    if graph_safe or batch_info.use_graph:
        return sgemm_lora_a_embedding_graph_fwd(ids, weights, batch_info, num_valid)
    return sgemm_lora_a_embedding_control_fwd(ids, weights, batch_info, num_valid)


def _pair_shrink(x: torch.Tensor, weights: torch.Tensor, batch_info: BatchInfo, num_slices: int, graph_safe: bool,
                 graph_kernel: str) -> torch.Tensor:
    """:func:`sgemm_lora_a_fwd` with ``pair_rows=True``."""
    pairs = _pairs_of(batch_info)
    if torch.compiler.is_compiling():  # the custom ops take a batch as rows: its inputs gathered
        (rows,) = gather_token_rows(batch_info, (x,))
        return sgemm_lora_a_fwd(rows, weights, pairs.view, num_slices, graph_kernel=graph_kernel)
    check_lora_a_inputs(x, weights, batch_info, num_slices)  # x: the tokens; the rows share their slots
    if graph_safe or pairs.view.use_graph:
        return sgemm_lora_a_graph_fwd(x, weights, pairs.view, num_slices, kernel=check_graph_kernel(graph_kernel),
                                      sources=pairs.token_rows)
    return sgemm_lora_a_control_fwd(x, weights, pairs.view, num_slices, pairs.token_rows)


def _pair_expand(x: torch.Tensor, weights: torch.Tensor, batch_info: BatchInfo,
                 slice_offsets: Sequence[int] | torch.Tensor, base_output: torch.Tensor | None, graph_safe: bool,
                 graph_kernel: str) -> torch.Tensor:
    """:func:`sgemm_lora_b_fwd` with ``pair_rows=True``."""
    pairs = _pairs_of(batch_info)
    if torch.compiler.is_compiling():
        return expand_rows(batch_info, x, (), lambda rows, shrunk, _, out: sgemm_lora_b_fwd(
            shrunk, weights, rows, slice_offsets, out, graph_kernel=graph_kernel), base_output)
    if isinstance(x, torch.Tensor) and x.dim() > 0:  # its rows first: the message names the pair rows
        check_pair_rows(batch_info, x)
    offsets = check_lora_b_inputs(x, weights, pairs.view, slice_offsets, base_output, base_batch=batch_info)
    out = base_output if base_output is not None else x.new_zeros(batch_info.num_tokens, offsets[-1])
    if graph_safe or pairs.view.use_graph:
        return sgemm_lora_b_graph_fwd(x, weights, pairs.view, offsets, out, kernel=check_graph_kernel(graph_kernel),
                                      sources=pairs.token_rows)
    return sgemm_lora_b_control_fwd(x, weights, pairs.view, offsets, out, pairs.token_rows)


def _pairs_of(batch_info: BatchInfo) -> PairRows:
    if batch_info.pairs is None:
        raise ValueError("pair_rows=True takes a batch with weighted mixes (batch_info.pairs), and this one has none")
    return batch_info.pairs


def _compiled_offsets(slice_offsets: Sequence[int] | torch.Tensor) -> tuple[int, ...]:
    """Slice offsets as ints for a custom op's ``SymInt[]`` (the op validates them); a tensor is refused."""
    check_offsets_readable(slice_offsets)
    return tuple(slice_offsets)
