"""``EmbeddingWithLoRA``: ``nn.Embedding`` with LoRA, vocab-parallel aware, with per-slot added tokens."""

from __future__ import annotations

import torch
from torch import nn

from lora_core import EmbeddingLoRABuffers

from ..parallel import TensorParallel
from .context import LoRAContext, WrapTarget, inference_forward
from .slot_weights import ModuleParts, folded_b

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
    ``strict_token_ids`` backend.
    """

    def __init__(self, base_layer: nn.Embedding, context: LoRAContext, num_added_tokens: int = 0,
                 tp: TensorParallel | None = None) -> None:
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
        self.buffers = EmbeddingLoRABuffers(num_slots=context.num_slots, max_rank=context.max_rank,
                                            vocab_size=local_vocab, embedding_dim=base_layer.embedding_dim,
                                            num_added_tokens=num_added_tokens, dtype=context.dtype,
                                            device=context.device)

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
        self.set_lora(slot, w.lora_a, folded_b(w, slot_scaling))

    def reset_lora(self, slot: int) -> None:
        """Zero ``slot``'s weights and added-token rows (the adapter in it is unloaded)."""
        self.buffers.clear(slot)

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
        base = self.tp.all_reduce(base)
        shrunk = self.tp.all_reduce(backend.run_lora_a_embedding(local_ids, self.buffers.a, local_vocab,
                                                                 self.buffers.extra))
        if scale is not None:
            shrunk = shrunk * scale
        ctx = self.context
        out = ctx.add_delta(base, backend.run_lora_b(shrunk, self.buffers.b, (0, self.base_layer.embedding_dim),
                                                     ctx.lora_output(base)))
        return out.reshape(*lead, out.shape[-1])
