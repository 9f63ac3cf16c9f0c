"""The backend interface every LoRA backend implements (the registry that finds them:
:mod:`lora_core.backend_registry`).

Every op is abstract (``run_qkv`` and ``run_gate_up`` are :meth:`LoRABackend.run_packed`
under the names vLLM- and SGLang-style callers use): a backend that forgets one
cannot be instantiated, so the upstream failure mode (a base-class method silently
returning ``None`` and a crash far away) is impossible.
"""

from __future__ import annotations

import abc
from typing import Sequence

import torch

from .batch_info import BatchInfo, build_batch_info
from .checks import check_device
from .plans import BatchPlan
from .request_scales import apply_request_scales
from .validation import check_added_token_inputs, check_experts_lora_inputs, normalize_slice_offsets

__all__ = ["LoRABackend", "BatchInfoBackend"]

SliceOffsets = Sequence[int] | torch.Tensor


class LoRABackend(abc.ABC):
    """Runs the LoRA ops of one forward pass for the batch given to :meth:`prepare_batch`.

    The backend is the one holder of the current batch: wrappers and the
    ``MultiLoRA`` API read it from :attr:`batch_info` and change it only through
    :meth:`prepare_batch`.

    Notation: ``T`` tokens (rows), ``L`` slots, ``R`` max rank, ``c`` slices;
    ``slot_t`` and ``r_t`` are token ``t``'s slot and the slot's rank, ``s_t`` its scaling:
    the slot's times the token's request scale (``BatchInfo.token_scales``); ``o_i`` the
    slice offsets. Weights use the layout of
    docs/layout.md. Tokens of slot -1 and slots of rank 0 get a zero delta, and
    nothing beyond a slot's rank in A or B is ever read. Every ``run_*`` result
    is in the dtype of its input activations.
    """

    name: str

    @property
    @abc.abstractmethod
    def batch_info(self) -> BatchInfo:
        """The batch given to the last :meth:`prepare_batch` (``RuntimeError`` before one)."""

    @abc.abstractmethod
    def prepare_batch(self, batch_info: BatchInfo) -> None:
        """Use ``batch_info`` for every ``run_*`` call until the next ``prepare_batch``.

        Semantics: builds every plan this backend's kernels will read for the
        batch (its LM-head view included), so that nothing is planned during a
        graph capture; a graph-mode batch refilled in place needs no new call."""

    @abc.abstractmethod
    def init_graph_batch_info(self, max_tokens: int, lora_ranks: Sequence[int], scalings: Sequence[float], *,
                              with_scales: bool = False) -> BatchInfo:
        """A graph-mode batch info for up to ``max_tokens`` tokens, all on slot -1, whose tensors
        later batches refill in place (with request scales when ``with_scales``: build_batch_info)."""

    @abc.abstractmethod
    def run_lora_a(self, x: torch.Tensor, weights: torch.Tensor, num_slices: int = 1) -> torch.Tensor:
        """Scaled shrink: ``x (T, in)``, ``weights (L, c*R, in)`` -> ``(T, c*R)``.

        Semantics::

            for t, i in tokens, slices:
                out[t, i*R : i*R + r_t] = s_t * x[t] @ weights[slot_t, i*R : i*R + r_t].T
                out[t, i*R + r_t : (i+1)*R] = 0
        """

    @abc.abstractmethod
    def run_lora_b(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        slice_offsets: SliceOffsets,
        base_output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Expand: ``x (T, c*R)``, ``weights (L, out_total, R)`` -> ``(T, out_total)``,
        accumulated into ``base_output`` in place when given (and returned).

        Semantics::

            out = base_output if base_output is not None else zeros(T, out_total)
            for t, i in tokens, slices:
                out[t, o_i : o_{i+1}] += x[t, i*R : i*R + r_t] @ weights[slot_t, o_i : o_{i+1}, :r_t].T
        """

    def run_qkv(
        self,
        x: torch.Tensor,
        a_weights: torch.Tensor,
        b_weights: torch.Tensor,
        slice_offsets: SliceOffsets,
        base_output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Packed q/k/v (with any further parts, like an output gate): :meth:`run_packed`
        under the name vLLM- and SGLang-style callers use. The slice count is
        ``len(slice_offsets) - 1``, usually 3 (``a_weights (L, 3R, in)``, ``b_weights (L, q+k+v, R)``)."""
        return self.run_packed(x, a_weights, b_weights, slice_offsets, base_output)

    def run_gate_up(
        self,
        x: torch.Tensor,
        a_weights: torch.Tensor,
        b_weights: torch.Tensor,
        slice_offsets: SliceOffsets,
        base_output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Packed gate/up: :meth:`run_packed` under the name vLLM- and SGLang-style callers use;
        usually 2 slices (``a_weights (L, 2R, in)``, ``b_weights (L, gate+up, R)``)."""
        return self.run_packed(x, a_weights, b_weights, slice_offsets, base_output)

    @abc.abstractmethod
    def run_lm_head(
        self,
        x: torch.Tensor,
        a_weights: torch.Tensor,
        b_weights: torch.Tensor,
        base_output: torch.Tensor | None = None,
        *,
        pruned: bool,
    ) -> torch.Tensor:
        """LM head: ``x (rows, H)``, ``a_weights (L, R, H)``, ``b_weights (L, V, R)`` -> ``(rows, V)``.

        Semantics: shrink and expand (one slice) over the batch's LM-head view:
        ``rows`` are every token when ``pruned`` is false, else the last token of
        each non-empty request in request order (``batch_info.lm_head_view(pruned)``)."""

    @abc.abstractmethod
    def run_lora_a_embedding(
        self,
        ids: torch.Tensor,
        weights: torch.Tensor,
        vocab_size: int,
        extra_embeddings: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Embedding shrink: ``ids (T,)`` int, ``weights (L, R, V_total)`` -> ``(T, R)``.

        Semantics (``added = extra_embeddings.shape[1]``, or 0)::

            for t in tokens:
                if 0 <= ids[t] < vocab_size + added:
                    out[t, :r_t] = s_t * weights[slot_t, :r_t, ids[t]]
                else:
                    out[t, :] = 0    # out of vocabulary: never a clamped neighbour's row
        """

    @abc.abstractmethod
    def run_added_tokens(
        self,
        ids: torch.Tensor,
        extra_embeddings: torch.Tensor,
        vocab_size: int,
        base_output: torch.Tensor,
        scale: float | torch.Tensor = 1.0,
    ) -> torch.Tensor:
        """Base rows of adapter-added tokens: ``ids (T,)`` int, ``extra_embeddings (L, added, D)``,
        ``base_output (T, D)`` updated in place and returned; ``scale`` is the base
        embedding's own scale (Gemma-style ``embed_scale``).

        Semantics::

            for t in tokens:
                if slot_t >= 0 and vocab_size <= ids[t] < vocab_size + added:
                    base_output[t] = scale * extra_embeddings[slot_t, ids[t] - vocab_size]
        """

    @abc.abstractmethod
    def run_packed(
        self,
        x: torch.Tensor,
        a_weights: torch.Tensor,
        b_weights: torch.Tensor,
        slice_offsets: SliceOffsets,
        base_output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Packed projection of ``c = len(slice_offsets) - 1 >= 1`` slices of any widths:
        ``x (T, in)``, ``a_weights (L, c*R, in)``, ``b_weights (L, out_total, R)`` ->
        ``(T, out_total)``, accumulated into ``base_output`` in place when given (and returned).

        Semantics::

            c = len(slice_offsets) - 1
            run_lora_b(run_lora_a(x, a_weights, c), b_weights, slice_offsets, base_output)
        """

    @abc.abstractmethod
    def run_dora_scale(
        self,
        output: torch.Tensor,
        factors: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        pruned: bool = False,
    ) -> torch.Tensor:
        """DoRA's per-row rescale (lora_core.dora): ``output (T, out)`` (base output plus the
        LoRA delta) updated in place and returned; ``factors (L, out)`` float32, each slot's
        ``m / ||W + s B A||`` per output feature (1 for a slot without DoRA; at request scale 1:
        rows at other scales need ``lora_core.dora.scaled_dora``); ``bias (out,)`` the base
        layer's bias. ``T`` is every token, or with ``pruned`` the LM-head rows (``lm_head_view``).

        Semantics::

            for t in rows:
                if slot_t >= 0:
                    output[t] = factors[slot_t] * (output[t] - bias) + bias    # bias = 0 when None
        """

    @abc.abstractmethod
    def run_experts_lora(
        self,
        x: torch.Tensor,
        expert_ids: torch.Tensor,
        a_weights: torch.Tensor,
        b_weights: torch.Tensor,
        base_output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """LoRA on one expert parameter of a fused experts module (docs/moe.md):
        ``x (T, K, in)`` (token ``t``'s input to its ``k``-th expert), ``expert_ids (T, K)``
        int (the router's top-k), ``a_weights (L, E, R, in)``, ``b_weights (L, E, out, R)``
        -> ``(T, K, out)``, accumulated into ``base_output`` in place when given (and returned).

        Semantics::

            out = base_output if base_output is not None else zeros(T, K, out)
            for t, k in tokens, top-k choices:
                e = expert_ids[t, k]
                if slot_t >= 0 and 0 <= e < E:
                    out[t, k] += s_t * b_weights[slot_t, e, :, :r_t] @ a_weights[slot_t, e, :r_t] @ x[t, k]

        which is ``run_experts_lora_b(run_experts_lora_a(x, expert_ids, a_weights), expert_ids, b_weights,
        base_output)`` in one op.
        """


    @abc.abstractmethod
    def run_experts_lora_a(self, x: torch.Tensor, expert_ids: torch.Tensor, a_weights: torch.Tensor) -> torch.Tensor:
        """Scaled shrink of one expert parameter, the first half of :meth:`run_experts_lora`:
        ``x (T, K, in)``, ``expert_ids (T, K)`` int, ``a_weights (L, E, R, in)`` -> ``(T, K, R)``.
        A tensor-parallel caller may sum the shrinks of its shards (an all-reduce) before the expand.

        Semantics::

            out = zeros(T, K, R)
            for t, k in tokens, top-k choices:
                e = expert_ids[t, k]
                if slot_t >= 0 and 0 <= e < E:
                    out[t, k, :r_t] = s_t * a_weights[slot_t, e, :r_t] @ x[t, k]
        """

    @abc.abstractmethod
    def run_experts_lora_b(self, x: torch.Tensor, expert_ids: torch.Tensor, b_weights: torch.Tensor,
                           base_output: torch.Tensor | None = None) -> torch.Tensor:
        """Expand of one expert parameter, the second half of :meth:`run_experts_lora`:
        ``x (T, K, R)`` (a shrink's output), ``expert_ids (T, K)`` int, ``b_weights (L, E, out, R)``
        -> ``(T, K, out)``, accumulated into ``base_output`` in place when given (and returned).

        Semantics::

            out = base_output if base_output is not None else zeros(T, K, out)
            for t, k in tokens, top-k choices:
                e = expert_ids[t, k]
                if slot_t >= 0 and 0 <= e < E:
                    out[t, k] += b_weights[slot_t, e, :, :r_t] @ x[t, k, :r_t]
        """


class BatchInfoBackend(LoRABackend):
    """Shared plumbing for backends whose kernels take the batch info explicitly.

    Holds the current batch and builds the kernels' plans in :meth:`prepare_batch`;
    implements every ``run_*`` method, the packed projections (any number of slices)
    and the LM head as a shrink followed by an expand, and the added-token rows.
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

    @abc.abstractmethod
    def embedding_shrink(self, ids: torch.Tensor, weights: torch.Tensor, batch_info: BatchInfo, vocab_size: int,
                         extra_embeddings: torch.Tensor | None) -> torch.Tensor:
        """:meth:`run_lora_a_embedding` for an explicit batch."""

    @abc.abstractmethod
    def dora_scale(self, output: torch.Tensor, factors: torch.Tensor, batch_info: BatchInfo,
                   bias: torch.Tensor | None) -> torch.Tensor:
        """:meth:`run_dora_scale` for an explicit batch."""

    def init_graph_batch_info(self, max_tokens, lora_ranks, scalings, *, with_scales=False) -> BatchInfo:
        return build_batch_info([max_tokens], [None], lora_ranks, scalings, device=self.device, use_graph=True,
                                max_tokens=max_tokens, with_scales=with_scales)

    def run_lora_a(self, x: torch.Tensor, weights: torch.Tensor, num_slices: int = 1) -> torch.Tensor:
        return apply_request_scales(self.shrink(x, weights, self.batch_info, num_slices), self.batch_info)

    def run_lora_b(self, x, weights, slice_offsets, base_output=None) -> torch.Tensor:
        return self.expand(x, weights, self.batch_info, slice_offsets, base_output)

    def run_lm_head(self, x, a_weights, b_weights, base_output=None, *, pruned: bool) -> torch.Tensor:
        view = self.batch_info.lm_head_view(pruned)
        shrunk = apply_request_scales(self.shrink(x, a_weights, view, 1), view)
        return self.expand(shrunk, b_weights, view, (0, b_weights.shape[1]), base_output)

    def run_lora_a_embedding(self, ids, weights, vocab_size, extra_embeddings=None) -> torch.Tensor:
        return apply_request_scales(self.embedding_shrink(ids, weights, self.batch_info, vocab_size,
                                                               extra_embeddings), self.batch_info)

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
        shrunk = apply_request_scales(self.shrink(x, a_weights, self.batch_info, len(offsets) - 1),
                                           self.batch_info)
        return self.expand(shrunk, b_weights, self.batch_info, offsets, base_output)

    def run_dora_scale(self, output, factors, bias=None, *, pruned: bool = False) -> torch.Tensor:
        return self.dora_scale(output, factors, self.batch_info.lm_head_view(pruned), bias)

    def run_experts_lora(self, x, expert_ids, a_weights, b_weights, base_output=None) -> torch.Tensor:
        if not self.batch_info.has_request_scales:
            return self.experts_lora(x, expert_ids, a_weights, b_weights, self.batch_info, base_output)
        check_experts_lora_inputs(x, expert_ids, a_weights, b_weights, self.batch_info, base_output)  # A with B
        shrunk = self.run_experts_lora_a(x, expert_ids, a_weights)  # the fused op has no shrink output to scale
        return self.run_experts_lora_b(shrunk, expert_ids, b_weights, base_output)

    @abc.abstractmethod
    def experts_lora(self, x: torch.Tensor, expert_ids: torch.Tensor, a_weights: torch.Tensor,
                     b_weights: torch.Tensor, batch_info: BatchInfo, base_output: torch.Tensor | None) -> torch.Tensor:
        """:meth:`run_experts_lora` for an explicit batch."""

    def run_experts_lora_a(self, x, expert_ids, a_weights) -> torch.Tensor:
        return apply_request_scales(self.experts_shrink(x, expert_ids, a_weights, self.batch_info),
                                         self.batch_info)

    def run_experts_lora_b(self, x, expert_ids, b_weights, base_output=None) -> torch.Tensor:
        return self.experts_expand(x, expert_ids, b_weights, self.batch_info, base_output)

    @abc.abstractmethod
    def experts_shrink(self, x: torch.Tensor, expert_ids: torch.Tensor, a_weights: torch.Tensor,
                       batch_info: BatchInfo) -> torch.Tensor:
        """:meth:`run_experts_lora_a` for an explicit batch."""

    @abc.abstractmethod
    def experts_expand(self, x: torch.Tensor, expert_ids: torch.Tensor, b_weights: torch.Tensor,
                       batch_info: BatchInfo, base_output: torch.Tensor | None) -> torch.Tensor:
        """:meth:`run_experts_lora_b` for an explicit batch."""
