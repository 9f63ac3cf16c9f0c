"""``EmbeddingWithLoRA``: ``nn.Embedding`` with LoRA, vocab-parallel aware, with per-slot added tokens."""

from __future__ import annotations

import torch
from torch import nn

from lora_core import EmbeddingLoRABuffers
from lora_core.checks import check_bool
from lora_core.dora import NO_DORA_TERMS, dora_factor, dora_terms, no_dora_terms, scaled_dora

from ..parallel import TensorParallel, shard_range
from .context import LoRAContext, WrapTarget, inference_forward
from .slot_weights import ModuleParts, check_dora_parts, folded_b

__all__ = ["EmbeddingWithLoRA"]


class EmbeddingWithLoRA(nn.Module):
    """``nn.Embedding`` with LoRA.

    Ids in ``[V, V + num_added_tokens)`` look up the token's slot's added
    embedding (the backend's ``run_added_tokens``); ids outside the vocabulary
    get a zero base row and a zero LoRA delta, or raise ``ValueError`` when the
    backend was built with ``strict_token_ids=True`` (its embedding op checks
    them; eager calls only). The base layer's ``embed_scale`` (Gemma-style scaled
    embeddings) also scales the delta and the added rows.

    A vocab-parallel embedding (``tp.size > 1``) gives the backend each shard's
    local ids, so the other shards' ids are out of its range: it refuses a
    ``strict_token_ids`` backend. Its A is sharded by vocabulary like the base and B is
    replicated, or, with ``fully_sharded``, sharded by embedding dimension: each process
    adds its dimensions' delta into its partial base rows before their all-reduce (the
    same two all-reduces; ``1/tp`` of A and of B per process).

    DoRA (PEFT's ``DoraEmbeddingLayer``; with ``context.dora``): a row of a DoRA slot is
    ``factor * (base row + delta)``, ``factor = m / ||W.T + s B A||`` per embedding
    dimension (the norm over the vocabulary), computed at load into ``dora_factors``.
    """

    def __init__(self, base_layer: nn.Embedding, context: LoRAContext, num_added_tokens: int = 0,
                 tp: TensorParallel | None = None, *, fully_sharded: bool = False) -> None:
        super().__init__()
        if not isinstance(base_layer, nn.Embedding):
            raise TypeError(f"EmbeddingWithLoRA wraps an nn.Embedding, got {type(base_layer).__name__}")
        self.base_layer = base_layer
        self.context = context
        self.tp = tp or TensorParallel()
        if num_added_tokens and self.tp.size > 1:
            raise ValueError("added tokens are not supported with a vocab-parallel embedding (tp_size > 1)")
        if self.tp.size > 1 and getattr(context.backend, "strict_token_ids", False):
            raise ValueError("a vocab-parallel embedding (tp_size > 1) cannot run on a backend built with "
                             "strict_token_ids=True: the backend checks each shard's ids against the shard's "
                             "vocabulary, which rejects the other shards' ids")
        local_vocab = base_layer.num_embeddings
        self.vocab_size = local_vocab * self.tp.size
        self.vocab_start = self.tp.rank * local_vocab
        self.fully_sharded = check_bool("fully_sharded", fully_sharded)
        self._dims = shard_range(base_layer.embedding_dim, self.tp.rank, self.tp.size) if fully_sharded else None
        lora_dim = base_layer.embedding_dim if self._dims is None else self._dims[1] - self._dims[0]
        self.buffers = EmbeddingLoRABuffers(num_slots=context.num_slots, max_rank=context.max_rank,
                                            vocab_size=local_vocab, embedding_dim=lora_dim,
                                            num_added_tokens=num_added_tokens, dtype=context.dtype,
                                            device=context.device)
        self.dora_factors: torch.Tensor | None = None
        """``(num_slots, D)`` float32 DoRA factors (1: no DoRA), with ``context.dora``."""
        self.dora_terms: torch.Tensor | None = None
        """``(num_slots, 4, D)`` float32 :func:`~lora_core.dora.dora_terms`, for batches with request scales."""
        if context.dora:
            self.dora_factors = torch.ones(context.num_slots, base_layer.embedding_dim, device=context.device)
            self.dora_terms = no_dora_terms(context.num_slots, base_layer.embedding_dim, context.device)

    @classmethod
    def can_wrap(cls, module: nn.Module, target: WrapTarget) -> bool:
        return isinstance(module, nn.Embedding)

    @classmethod
    def wrap(cls, module: nn.Module, context: LoRAContext, target: WrapTarget) -> EmbeddingWithLoRA:
        return cls(module, context)

    def set_lora(self, slot: int, lora_a: torch.Tensor, lora_b: torch.Tensor,
                 extra_embeddings: torch.Tensor | None = None) -> None:
        """``lora_a (r, V)`` or ``(r, V + added)`` of the unsharded vocabulary, ``lora_b (D, r)``."""
        if self.tp.size > 1:
            if lora_a.shape[1] != self.vocab_size:
                raise ValueError(f"lora_a must have {self.vocab_size} columns (the unsharded vocabulary), "
                                 f"got {tuple(lora_a.shape)}")
            lora_a = lora_a[:, self.vocab_start : self.vocab_start + self.base_layer.num_embeddings]
        if self._dims is not None:
            if lora_b.shape[0] != self.base_layer.embedding_dim:
                raise ValueError(f"lora_b must have {self.base_layer.embedding_dim} rows (the unsharded embedding "
                                 f"dimension), got {tuple(lora_b.shape)}")
            lora_b = lora_b[self._dims[0] : self._dims[1]]
        self.buffers.load(slot, lora_a, lora_b, extra_embeddings)

    def load_slot(self, slot: int, parts: ModuleParts, slot_scaling: float) -> None:
        """Load one adapter's ``lora_embedding_A`` ``(r, V)`` / ``lora_embedding_B`` ``(D, r)`` into ``slot``.

        ``parts`` holds the one pair of this embedding (unsharded vocabulary; its
        scaling relative to ``slot_scaling`` is folded into B). ``ValueError`` when
        the weights are not an embedding's or do not fit.
        """
        if len(parts) != 1:
            raise ValueError(f"an embedding takes one lora_embedding_A/B pair, got {len(parts)}")
        (w,) = parts.values()
        if w.kind != "embedding":
            raise ValueError("expected lora_embedding_A/B weights for an embedding")
        if check_dora_parts(parts, self.dora_factors, self.tp.size):
            factors = dora_factor(self.base_layer.weight.T, w.lora_a, w.lora_b, w.scaling, w.magnitude)
            terms = dora_terms(self.base_layer.weight.T, w.lora_a, w.lora_b, w.scaling, w.magnitude)
        self.set_lora(slot, w.lora_a, folded_b(w, slot_scaling))
        if self.dora_factors is not None:
            self.dora_factors[slot] = factors if w.magnitude is not None else 1.0
            self.dora_terms[slot] = terms if w.magnitude is not None else torch.tensor(NO_DORA_TERMS)[:, None]

    def reset_lora(self, slot: int) -> None:
        """Zero ``slot``'s weights and added-token rows (the adapter in it is unloaded)."""
        self.buffers.clear(slot)
        if self.dora_factors is not None:
            self.dora_factors[slot] = 1.0
            self.dora_terms[slot] = self.dora_terms.new_tensor(NO_DORA_TERMS)[:, None]

    @inference_forward
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids: (...)`` integer -> ``(..., D)``."""
        lead = ids.shape
        flat = ids.reshape(-1)
        backend = self.context.backend
        local_ids = flat - self.vocab_start
        local_vocab = self.base_layer.num_embeddings
        in_shard = (local_ids >= 0) & (local_ids < local_vocab)
        base = self.base_layer(torch.where(in_shard, local_ids, 0)) * in_shard[:, None]
        scale = getattr(self.base_layer, "embed_scale", None)
        if self.buffers.extra is not None:  # base rows: in the base layer's dtype
            base = backend.run_added_tokens(flat, self.buffers.extra.to(base.dtype), self.vocab_size, base,
                                            1.0 if scale is None else scale)
        if self._dims is None:
            base = self.tp.all_reduce(base)
        shrunk = self.tp.all_reduce(backend.run_lora_a_embedding(local_ids, self.buffers.a, local_vocab,
                                                                 self.buffers.extra))
        if scale is not None:
            shrunk = shrunk * scale
        ctx = self.context
        if self._dims is None:
            out = ctx.add_delta(base, backend.run_lora_b(shrunk, self.buffers.b, (0, self.base_layer.embedding_dim),
                                                         ctx.lora_output(base)))
        else:  # this process's dimensions of the delta into its partial rows, then their all-reduce
            dims = base[:, self._dims[0] : self._dims[1]]
            ctx.add_delta(dims, backend.run_lora_b(shrunk, self.buffers.b, (0, dims.shape[1]), ctx.lora_output(dims)))
            out = self.tp.all_reduce(base)
        if self.dora_factors is not None:  # at each row's request scale when the batch has them
            rows = backend.batch_info
            out = (scaled_dora(out, self.dora_terms, rows) if rows.has_request_scales
                   else backend.run_dora_scale(out, self.dora_factors))
        return out.reshape(*lead, out.shape[-1])
