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

from .batch_info import BatchInfo

__all__ = ["LoRABackend"]

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

    Weighted mixes (``BatchInfo.pairs``, :mod:`lora_core.pair_rows`): a batch whose requests mix
    adapters has ``P`` pair rows beyond its ``T`` token rows, each a (token, further adapter) with
    its own slot and scale. A shrink (``run_lora_a``, ``run_lora_a_embedding``,
    ``run_experts_lora_a``) then returns ``T + P`` rows, the token rows first, and an expand takes
    them and adds each pair row's delta into its token's row::

        shrunk[T + p] = shrink of x[token_p] by pair p's slot and scale
        out[token_p] += expand of shrunk[T + p] by pair p's slot

    The whole ops (``run_packed``, ``run_lm_head``, ``run_experts_lora``) do both. The
    added-token rows and the DoRA rescale read each token's first adapter only.
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
                              with_scales: bool = False, max_pairs: int | None = None) -> BatchInfo:
        """A graph-mode batch info for up to ``max_tokens`` tokens, all on slot -1, whose tensors
        later batches refill in place (with request scales when ``with_scales``, and weighted mixes
        of up to ``max_pairs`` (token, adapter) pairs: build_batch_info)."""

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



def __getattr__(name: str):
    if name == "BatchInfoBackend":  # its home is lora_core.batch_info_backend (which imports this module)
        from .batch_info_backend import BatchInfoBackend
        return BatchInfoBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
