"""Shared plumbing for backends whose kernels take the batch info explicitly: the LoRA ops of
:class:`~lora_core.backend.LoRABackend` as shrinks and expands over a batch's token rows and, in
a batch with weighted mixes, its (token, adapter) pair rows (:mod:`lora_core.pair_rows`)."""

from __future__ import annotations

import abc
from typing import Callable, Sequence

import torch

from .backend import LoRABackend, SliceOffsets
from .batch_builder import build_batch_info
from .batch_info import BatchInfo
from .checks import check_device
from .plans import BatchPlan
from .request_scales import apply_request_scales
from .validation import (check_added_token_inputs, check_experts_lora_inputs, check_num_tokens, check_token_ids,
                         normalize_slice_offsets)

__all__ = ["BatchInfoBackend", "shrink_rows", "expand_rows", "gather_token_rows", "check_pair_rows"]

Shrink = Callable[[BatchInfo, tuple[torch.Tensor, ...]], torch.Tensor]
Expand = Callable[[BatchInfo, torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor | None], torch.Tensor]


def shrink_rows(info: BatchInfo, inputs: tuple[torch.Tensor, ...], shrink: Shrink, name: str = "x") -> torch.Tensor:
    """``shrink(batch, inputs)``, its rows scaled by their request scales: over ``info``'s token rows
    or, when the batch has pair rows (weighted mixes), over its rows with pair rows
    (:mod:`lora_core.pair_rows`), on the inputs gathered by their token rows: ``(T + P, ...)``.
    ``name``: what the first input is called in an error."""
    pairs = info.pairs
    if pairs is None:
        return apply_request_scales(shrink(info, inputs), info)
    return apply_request_scales(shrink(pairs.view, gather_token_rows(info, inputs, name)), pairs.view)


def gather_token_rows(info: BatchInfo, inputs: tuple[torch.Tensor, ...], name: str = "x") -> tuple[torch.Tensor, ...]:
    """``inputs``, each ``(T, ...)`` with a row per token of ``info``, a batch with pair rows, gathered
    to a row per row of ``info.pairs.view``: each row's token row. ``name``: the first input's, in an error."""
    if inputs:
        check_num_tokens(info, inputs[0].shape[0], name)  # before the gather reads rows by index
    return tuple(t.index_select(0, info.pairs.token_rows) for t in inputs)


def check_pair_rows(info: BatchInfo, shrunk: torch.Tensor) -> None:
    """``ValueError`` unless ``shrunk`` has a row per row of ``info.pairs.view`` (``info``'s token rows and
    the pair rows of its mixes): what an expand of a batch with weighted mixes takes."""
    rows = info.pairs.view.num_tokens
    if shrunk.shape[0] != rows:
        raise ValueError(f"x has {shrunk.shape[0]} rows; a shrink of this batch gives {rows}: its token rows and the "
                         f"pair rows of its mixes (pass the shrink's output)")


def expand_rows(info: BatchInfo, shrunk: torch.Tensor, inputs: tuple[torch.Tensor, ...], expand: Expand,
                base_output: torch.Tensor | None, name: str = "inputs[0]") -> torch.Tensor:
    """``expand(batch, shrunk, inputs, base_output)`` of :func:`shrink_rows`' output into ``base_output``
    (``(T, ...)``; zeros when ``None``): with pair rows, every row's delta (on the inputs gathered by its
    token row) added into its token's row. ``name``: what the first input is called in an error."""
    pairs = info.pairs
    if pairs is None:
        return expand(info, shrunk, inputs, base_output)
    check_pair_rows(info, shrunk)
    if base_output is not None:
        check_num_tokens(info, base_output.shape[0], "base_output")
    delta = expand(pairs.view, shrunk, gather_token_rows(info, inputs, name), None)
    if base_output is None:
        base_output = delta.new_zeros(info.num_tokens, *delta.shape[1:])
    return base_output.index_add_(0, pairs.token_rows, delta.to(base_output.dtype))


class BatchInfoBackend(LoRABackend):
    """Shared plumbing for backends whose kernels take the batch info explicitly.

    Holds the current batch and builds the kernels' plans in :meth:`prepare_batch`;
    implements every ``run_*`` method, the packed projections (any number of slices)
    and the LM head as a shrink followed by an expand, and the added-token rows; applies
    the request scales to each shrink's output, and runs a batch's pair rows (weighted
    mixes: :meth:`pair_shrink` and :meth:`pair_expand` for the linear ops, which a backend
    whose kernels read rows through an index may override; :func:`shrink_rows` and
    :func:`expand_rows` for the others), so that no kernel knows of either.
    Subclasses implement :meth:`plan_types`, :meth:`shrink`, :meth:`expand`,
    :meth:`embedding_shrink`, :meth:`dora_scale`, :meth:`experts_lora`, :meth:`experts_shrink`
    and :meth:`experts_expand` (still abstract here).

    Args:
        device: where batches and weights live.
        strict_token_ids: out-of-vocabulary ids raise ``ValueError`` naming their
            positions instead of getting a zero delta (eager calls only: the check
            reads ids back, so it is skipped while a graph is captured).
    """

    def __init__(self, device: torch.device | str = "cpu", *, strict_token_ids: bool = False) -> None:
        self.device = check_device("device", device)
        self.strict_token_ids = bool(strict_token_ids)
        self._batch_info: BatchInfo | None = None

    @property
    def batch_info(self) -> BatchInfo:
        if self._batch_info is None:
            raise RuntimeError(
                f"{type(self).__name__}: no batch is prepared; call MultiLoRA.set_batch(seq_lens, adapters) "
                "or backend.prepare_batch(batch_info) before running LoRA ops"
            )
        return self._batch_info

    def prepare_batch(self, batch_info: BatchInfo) -> None:
        if not isinstance(batch_info, BatchInfo):
            raise TypeError(f"batch_info must be a lora_core.BatchInfo, got {type(batch_info).__name__}")
        for plan_type in self.plan_types(batch_info):
            batch_info.plan(plan_type)  # the pruned LM-head view gets the same plans
        self._batch_info = batch_info

    @abc.abstractmethod
    def plan_types(self, batch_info: BatchInfo) -> Sequence[type[BatchPlan]]:
        """The plans this backend's kernels read for ``batch_info`` (built by :meth:`prepare_batch`)."""

    @abc.abstractmethod
    def shrink(self, x: torch.Tensor, weights: torch.Tensor, batch_info: BatchInfo, num_slices: int) -> torch.Tensor:
        """:meth:`run_lora_a` for an explicit batch."""

    @abc.abstractmethod
    def expand(self, x: torch.Tensor, weights: torch.Tensor, batch_info: BatchInfo, slice_offsets: SliceOffsets,
               base_output: torch.Tensor | None) -> torch.Tensor:
        """:meth:`run_lora_b` for an explicit batch."""

    def pair_shrink(self, x: torch.Tensor, weights: torch.Tensor, batch_info: BatchInfo,
                    num_slices: int) -> torch.Tensor:
        """:meth:`shrink` of a batch with weighted mixes over its rows with pair rows: ``x (T, in)``,
        ``batch_info``'s tokens -> ``(N, c*R)``, a row per row of ``batch_info.pairs.view`` (its token rows,
        then its pair rows): the shrink of the row's token's row of ``x`` at the row's slot (its request
        scale not applied). Here ``x`` is gathered by token row (``N`` rows) for :meth:`shrink` of the
        view; a backend whose kernels read each row's token row themselves overrides this and
        :meth:`pair_expand`, and copies no rows."""
        (rows,) = gather_token_rows(batch_info, (x,))
        return self.shrink(rows, weights, batch_info.pairs.view, num_slices)

    def pair_expand(self, x: torch.Tensor, weights: torch.Tensor, batch_info: BatchInfo,
                    slice_offsets: SliceOffsets, base_output: torch.Tensor | None) -> torch.Tensor:
        """:meth:`expand` of :meth:`pair_shrink`'s output: ``x (N, c*R)``, every row's delta added into
        its token's row of ``base_output (T, out_total)`` (zeros when ``None``) in place. Here the view's
        :meth:`expand` into zeros, then one ``index_add_`` (:func:`expand_rows`)."""
        return expand_rows(batch_info, x, (), lambda rows, shrunk, _, out: self.expand(
            shrunk, weights, rows, slice_offsets, out), base_output)

    @abc.abstractmethod
    def embedding_shrink(self, ids: torch.Tensor, weights: torch.Tensor, batch_info: BatchInfo, vocab_size: int,
                         extra_embeddings: torch.Tensor | None) -> torch.Tensor:
        """:meth:`run_lora_a_embedding` for an explicit batch."""

    @abc.abstractmethod
    def dora_scale(self, output: torch.Tensor, factors: torch.Tensor, batch_info: BatchInfo,
                   bias: torch.Tensor | None) -> torch.Tensor:
        """:meth:`run_dora_scale` for an explicit batch."""

    def init_graph_batch_info(self, max_tokens, lora_ranks, scalings, *, with_scales=False, max_pairs=None) -> BatchInfo:
        return build_batch_info([max_tokens], [None], lora_ranks, scalings, device=self.device, use_graph=True,
                                max_tokens=max_tokens, with_scales=with_scales, max_pairs=max_pairs)

    def run_lora_a(self, x: torch.Tensor, weights: torch.Tensor, num_slices: int = 1) -> torch.Tensor:
        return self._linear_shrink(self.batch_info, x, weights, num_slices)

    def run_lora_b(self, x, weights, slice_offsets, base_output=None) -> torch.Tensor:
        return self._linear_expand(self.batch_info, x, weights, slice_offsets, base_output)

    def run_lm_head(self, x, a_weights, b_weights, base_output=None, *, pruned: bool) -> torch.Tensor:
        view = self.batch_info.lm_head_view(pruned)
        shrunk = self._linear_shrink(view, x, a_weights, 1)
        return self._linear_expand(view, shrunk, b_weights, (0, b_weights.shape[1]), base_output)

    def run_lora_a_embedding(self, ids, weights, vocab_size, extra_embeddings=None) -> torch.Tensor:
        if self.strict_token_ids and self.batch_info.pairs is not None:  # positions in the caller's ids
            check_token_ids(ids, vocab_size + (0 if extra_embeddings is None else extra_embeddings.shape[1]))
        return shrink_rows(self.batch_info, (ids,), lambda info, inputs: self.embedding_shrink(
            inputs[0], weights, info, vocab_size, extra_embeddings), "ids")

    def run_added_tokens(self, ids, extra_embeddings, vocab_size, base_output, scale=1.0) -> torch.Tensor:
        check_added_token_inputs(ids, extra_embeddings, self.batch_info, vocab_size, base_output)
        if extra_embeddings.shape[0] == 0 or extra_embeddings.shape[1] == 0:  # no slot or no added token
            return base_output
        slots = self.batch_info.token_slots[: ids.shape[0]]
        added = ids - vocab_size
        is_added = (added >= 0) & (added < extra_embeddings.shape[1]) & (slots >= 0)
        rows = extra_embeddings[slots.clamp(min=0).long(), torch.where(is_added, added, 0).long()]  # (T, D)
        return base_output.copy_(torch.where(is_added[:, None], rows * scale, base_output))

    def run_packed(self, x, a_weights, b_weights, slice_offsets, base_output=None) -> torch.Tensor:
        offsets = normalize_slice_offsets(slice_offsets)  # the slice count comes from the call's offsets
        shrunk = self._linear_shrink(self.batch_info, x, a_weights, len(offsets) - 1)
        return self._linear_expand(self.batch_info, shrunk, b_weights, offsets, base_output)

    def _linear_shrink(self, info: BatchInfo, x: torch.Tensor, weights: torch.Tensor, num_slices: int) -> torch.Tensor:
        if info.pairs is None:
            return apply_request_scales(self.shrink(x, weights, info, num_slices), info)
        return apply_request_scales(self.pair_shrink(x, weights, info, num_slices), info.pairs.view)

    def _linear_expand(self, info: BatchInfo, x: torch.Tensor, weights: torch.Tensor, slice_offsets: SliceOffsets,
                       base_output: torch.Tensor | None) -> torch.Tensor:
        if info.pairs is None:
            return self.expand(x, weights, info, slice_offsets, base_output)
        return self.pair_expand(x, weights, info, slice_offsets, base_output)

    def run_dora_scale(self, output, factors, bias=None, *, pruned: bool = False) -> torch.Tensor:
        return self.dora_scale(output, factors, self.batch_info.lm_head_view(pruned), bias)

    def run_experts_lora(self, x, expert_ids, a_weights, b_weights, base_output=None) -> torch.Tensor:
        info = self.batch_info
        if not info.has_request_scales and info.pairs is None:
            return self.experts_lora(x, expert_ids, a_weights, b_weights, info, base_output)
        check_experts_lora_inputs(x, expert_ids, a_weights, b_weights, info, base_output)  # A with B
        shrunk = self.run_experts_lora_a(x, expert_ids, a_weights)  # the fused op has no shrink output to scale
        return self.run_experts_lora_b(shrunk, expert_ids, b_weights, base_output)

    @abc.abstractmethod
    def experts_lora(self, x: torch.Tensor, expert_ids: torch.Tensor, a_weights: torch.Tensor,
                     b_weights: torch.Tensor, batch_info: BatchInfo, base_output: torch.Tensor | None) -> torch.Tensor:
        """:meth:`run_experts_lora` for an explicit batch."""

    def run_experts_lora_a(self, x, expert_ids, a_weights) -> torch.Tensor:
        return shrink_rows(self.batch_info, (x, expert_ids), lambda info, inputs: self.experts_shrink(
            inputs[0], inputs[1], a_weights, info))

    def run_experts_lora_b(self, x, expert_ids, b_weights, base_output=None) -> torch.Tensor:
        return expand_rows(self.batch_info, x, (expert_ids,), lambda info, shrunk, inputs, out: self.experts_expand(
            shrunk, inputs[0], b_weights, info, out), base_output, "expert_ids")

    @abc.abstractmethod
    def experts_shrink(self, x: torch.Tensor, expert_ids: torch.Tensor, a_weights: torch.Tensor,
                       batch_info: BatchInfo) -> torch.Tensor:
        """:meth:`run_experts_lora_a` for an explicit batch."""

    @abc.abstractmethod
    def experts_expand(self, x: torch.Tensor, expert_ids: torch.Tensor, b_weights: torch.Tensor,
                       batch_info: BatchInfo, base_output: torch.Tensor | None) -> torch.Tensor:
        """:meth:`run_experts_lora_b` for an explicit batch."""
