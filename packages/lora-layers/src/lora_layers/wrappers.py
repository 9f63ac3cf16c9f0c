"""Module wrappers that add a multi-LoRA delta to a base layer through a backend.

Each wrapper keeps its base module (``base_layer``), owns its stacked LoRA
buffers (:mod:`lora_core.layout`) and, in ``forward``, flattens the leading
dims to ``(T, features)``, runs the base layer and lets the backend accumulate
the LoRA delta into the base output in place. Adapter weights are given
unsharded; tensor-parallel wrappers take their shard (vLLM's convention: the
base module passed in is already the local shard).

| wrapper | base (local shard) | LoRA A | LoRA B | backend calls | communication |
|---|---|---|---|---|---|
| LinearWithLoRA | full | full | full | lora_a, lora_b | none |
| ColumnParallelLinearWithLoRA | out rows | full | out rows | lora_a, lora_b | optional all-gather |
| MergedColumnParallelLinearWithLoRA | gate, up rows | full | rows of each | gate_up | optional all-gather |
| QKVParallelLinearWithLoRA | q, k, v heads | full | rows of each | qkv | optional all-gather |
| RowParallelLinearWithLoRA | in columns | in columns | full | lora_a, lora_b | all-reduce x2 |
| EmbeddingWithLoRA | vocab rows | vocab columns | full | lora_a_embedding, lora_b | all-reduce x2 |
| LMHeadWithLoRA | vocab rows | full | vocab rows | lora_a, lora_b | all-gather |
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from lora_core import BatchInfo, EmbeddingLoRABuffers, LinearLoRABuffers, LoRABackend, strict_token_ids
from lora_core.validation import check_token_ids

from .parallel import TensorParallel, shard_range

__all__ = [
    "LoRAContext",
    "LinearWithLoRA",
    "ColumnParallelLinearWithLoRA",
    "MergedColumnParallelLinearWithLoRA",
    "QKVParallelLinearWithLoRA",
    "RowParallelLinearWithLoRA",
    "EmbeddingWithLoRA",
    "LMHeadWithLoRA",
]

SliceWeights = tuple[torch.Tensor, torch.Tensor]  # A (r, in), B (out, r), unsharded, scaling folded into B


class LoRAContext:
    """What every wrapper of one model shares: the backend, the slot count and
    max rank of the buffers, and the current batch."""

    def __init__(self, backend: LoRABackend, *, num_slots: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        self.backend = backend
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.dtype = dtype
        self.device = torch.device(device)
        self._batch_info: BatchInfo | None = None

    @property
    def batch_info(self) -> BatchInfo:
        if self._batch_info is None:
            raise RuntimeError("no batch is set: call MultiLoRA.set_batch(seq_lens, adapters) before the forward pass")
        return self._batch_info

    def set_batch_info(self, batch_info: BatchInfo) -> None:
        self._batch_info = batch_info
        self.backend.prepare_batch(batch_info)


def _flatten(x: torch.Tensor, features: int, name: str) -> torch.Tensor:
    if x.shape[-1] != features:
        raise ValueError(f"{name} expects inputs with {features} features in the last dim, got {tuple(x.shape)}")
    return x.reshape(-1, features)


class LinearWithLoRA(nn.Module):
    """A replicated ``nn.Linear`` with LoRA; with 2 or 3 ``slice_widths`` it is a
    packed gate_up / qkv projection whose adapters come per slice."""

    def __init__(self, base_layer: nn.Linear, context: LoRAContext, slice_widths: Sequence[int] | None = None,
                 tp: TensorParallel | None = None) -> None:
        super().__init__()
        if not isinstance(base_layer, nn.Linear):
            raise TypeError(f"{type(self).__name__} wraps an nn.Linear, got {type(base_layer).__name__}")
        self.base_layer = base_layer
        self.context = context
        self.tp = tp or TensorParallel()
        local = list(slice_widths) if slice_widths is not None else [base_layer.out_features]
        if sum(local) != base_layer.out_features:
            raise ValueError(
                f"slice_widths {local} sum to {sum(local)}, but the base layer has {base_layer.out_features} outputs"
            )
        self.buffers = LinearLoRABuffers(num_slots=context.num_slots, max_rank=context.max_rank,
                                         in_features=base_layer.in_features, slice_widths=local,
                                         dtype=context.dtype, device=context.device)

    @property
    def num_slices(self) -> int:
        return self.buffers.num_slices

    # Tensor-parallel subclasses override these to take their shard of full weights.
    def _shard_a(self, a: torch.Tensor) -> torch.Tensor:
        return a

    def _shard_b(self, slice_index: int, b: torch.Tensor) -> torch.Tensor:
        return b

    def set_lora(self, slot: int, slices: Sequence[SliceWeights | None]) -> None:
        """Load one adapter: per slice ``(A (r, in), B (out_i, r))`` of the unsharded layer, or ``None``."""
        if len(slices) != self.num_slices:
            raise ValueError(f"{type(self).__name__} has {self.num_slices} slice(s), got weights for {len(slices)}")
        a = [None if s is None else self._shard_a(s[0]) for s in slices]
        b = [None if s is None else self._shard_b(i, s[1]) for i, s in enumerate(slices)]
        self.buffers.load(slot, a, b)

    def reset_lora(self, slot: int) -> None:
        self.buffers.clear(slot)

    def _base(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x)

    def _lora(self, x: torch.Tensor, base_output: torch.Tensor) -> torch.Tensor:
        backend, buf = self.context.backend, self.buffers
        if self.num_slices == 3:
            return backend.run_qkv(x, buf.a, buf.b, buf.slice_offsets, base_output)
        if self.num_slices == 2:
            return backend.run_gate_up(x, buf.a, buf.b, buf.slice_offsets, base_output)
        return backend.run_lora_b(backend.run_lora_a(x, buf.a), buf.b, buf.slice_offsets, base_output)

    def _finish(self, out: torch.Tensor) -> torch.Tensor:
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x: (..., in)`` -> ``(..., out)``; the flattened token count must match the batch."""
        lead = x.shape[:-1]
        x2 = _flatten(x, self.base_layer.in_features, type(self).__name__)
        _ = self.context.batch_info  # a clear error when no batch is set
        out = self._finish(self._lora(x2, self._base(x2)))
        return out.reshape(*lead, out.shape[-1])


class ColumnParallelLinearWithLoRA(LinearWithLoRA):
    """Base and LoRA B sharded by output rows; A replicated. ``gather_output``
    all-gathers the shards (the full output on every rank)."""

    def __init__(self, base_layer: nn.Linear, context: LoRAContext, tp: TensorParallel,
                 slice_widths: Sequence[int] | None = None, gather_output: bool = False) -> None:
        full = list(slice_widths) if slice_widths is not None else [base_layer.out_features * tp.size]
        self.full_slice_widths = full
        self._row_ranges = [self._local_rows(i, w, tp) for i, w in enumerate(full)]
        super().__init__(base_layer, context, [e - s for s, e in self._row_ranges], tp)
        self.gather_output = gather_output

    def _local_rows(self, slice_index: int, width: int, tp: TensorParallel) -> tuple[int, int]:
        return shard_range(width, tp.rank, tp.size)

    def _shard_b(self, slice_index: int, b: torch.Tensor) -> torch.Tensor:
        if b.shape[0] != self.full_slice_widths[slice_index]:
            raise ValueError(
                f"lora_b of slice {slice_index} must have {self.full_slice_widths[slice_index]} rows "
                f"(the unsharded layer), got {tuple(b.shape)}"
            )
        start, end = self._row_ranges[slice_index]
        return b[start:end]

    def _finish(self, out: torch.Tensor) -> torch.Tensor:
        if not self.gather_output or self.tp.size == 1:
            return out
        if self.num_slices == 1:
            return self.tp.all_gather(out, dim=-1)
        # gather each slice separately so the result is [gate | up] or [q | k | v], not interleaved shards
        offsets = self.buffers.slice_offsets
        return torch.cat([self.tp.all_gather(out[:, offsets[i] : offsets[i + 1]], dim=-1)
                          for i in range(self.num_slices)], dim=-1)


class MergedColumnParallelLinearWithLoRA(ColumnParallelLinearWithLoRA):
    """Packed gate_up: two column-parallel slices ``[gate, up]`` (full widths given)."""

    def __init__(self, base_layer: nn.Linear, context: LoRAContext, tp: TensorParallel,
                 slice_widths: Sequence[int], gather_output: bool = False) -> None:
        if len(slice_widths) != 2:
            raise ValueError(f"gate_up has 2 slices, got slice_widths {list(slice_widths)}")
        super().__init__(base_layer, context, tp, slice_widths, gather_output)


class QKVParallelLinearWithLoRA(ColumnParallelLinearWithLoRA):
    """Packed qkv, column-parallel by attention heads. With GQA, when ``tp.size``
    exceeds ``num_kv_heads``, each kv head is replicated on ``tp.size / num_kv_heads`` ranks."""

    def __init__(self, base_layer: nn.Linear, context: LoRAContext, tp: TensorParallel, *, num_heads: int,
                 num_kv_heads: int, head_dim: int, gather_output: bool = False) -> None:
        if num_heads % tp.size:
            raise ValueError(f"num_heads = {num_heads} must be divisible by tp_size = {tp.size}")
        if not (num_kv_heads % tp.size == 0 or tp.size % num_kv_heads == 0):
            raise ValueError(f"num_kv_heads = {num_kv_heads} and tp_size = {tp.size} must divide one another")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        widths = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        super().__init__(base_layer, context, tp, widths, gather_output)

    def _local_rows(self, slice_index: int, width: int, tp: TensorParallel) -> tuple[int, int]:
        if slice_index == 0 or self.num_kv_heads >= tp.size:
            return shard_range(width, tp.rank, tp.size)
        kv_head = tp.rank // (tp.size // self.num_kv_heads)
        return kv_head * self.head_dim, (kv_head + 1) * self.head_dim

    def _finish(self, out: torch.Tensor) -> torch.Tensor:
        if self.gather_output and self.tp.size > self.num_kv_heads:
            raise ValueError("gather_output with replicated kv heads would duplicate them; gather q/k/v per head")
        return super()._finish(out)


class RowParallelLinearWithLoRA(LinearWithLoRA):
    """Base and LoRA A sharded by input columns; the partial base output and the
    partial shrink are all-reduced, B is replicated; the bias is added once."""

    def __init__(self, base_layer: nn.Linear, context: LoRAContext, tp: TensorParallel) -> None:
        super().__init__(base_layer, context, None, tp)
        self._cols = shard_range(base_layer.in_features * tp.size, tp.rank, tp.size)

    def _shard_a(self, a: torch.Tensor) -> torch.Tensor:
        if a.shape[1] != self.base_layer.in_features * self.tp.size:
            raise ValueError(f"lora_a must have {self.base_layer.in_features * self.tp.size} columns "
                             f"(the unsharded layer), got {tuple(a.shape)}")
        return a[:, self._cols[0] : self._cols[1]]

    def _base(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(F.linear(x, self.base_layer.weight))

    def _lora(self, x: torch.Tensor, base_output: torch.Tensor) -> torch.Tensor:
        backend, buf = self.context.backend, self.buffers
        shrunk = self.tp.all_reduce(backend.run_lora_a(x, buf.a))
        out = backend.run_lora_b(shrunk, buf.b, buf.slice_offsets, base_output)
        return out if self.base_layer.bias is None else out.add_(self.base_layer.bias)


class EmbeddingWithLoRA(nn.Module):
    """``nn.Embedding`` with LoRA, vocab-parallel aware, with per-slot added tokens.

    Ids in ``[V, V + num_added_tokens)`` look up the token's slot's added
    embedding; ids outside the vocabulary get a zero base row and a zero LoRA
    delta (or raise under ``lora_core.strict_token_ids``). The base layer's
    ``embed_scale`` (Gemma-style scaled embeddings) also scales the delta.
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
        local_vocab = base_layer.num_embeddings
        self.vocab_size = local_vocab * self.tp.size
        self.vocab_start = self.tp.rank * local_vocab
        self.buffers = EmbeddingLoRABuffers(num_slots=context.num_slots, max_rank=context.max_rank,
                                            vocab_size=local_vocab, embedding_dim=base_layer.embedding_dim,
                                            num_added_tokens=num_added_tokens, dtype=context.dtype,
                                            device=context.device)

    def set_lora(self, slot: int, lora_a: torch.Tensor, lora_b: torch.Tensor,
                 extra_embeddings: torch.Tensor | None = None) -> None:
        """``lora_a (r, V)`` or ``(r, V + added)`` of the unsharded vocabulary, ``lora_b (D, r)``."""
        if self.tp.size > 1:
            if lora_a.shape[1] != self.vocab_size:
                raise ValueError(f"lora_a must have {self.vocab_size} columns (the unsharded vocabulary), "
                                 f"got {tuple(lora_a.shape)}")
            lora_a = lora_a[:, self.vocab_start : self.vocab_start + self.base_layer.num_embeddings]
        self.buffers.load(slot, lora_a, lora_b, extra_embeddings)

    def reset_lora(self, slot: int) -> None:
        self.buffers.clear(slot)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids: (...)`` integer -> ``(..., D)``."""
        lead = ids.shape
        flat = ids.reshape(-1)
        info = self.context.batch_info
        num_valid = self.vocab_size + self.buffers.num_added_tokens
        check_token_ids(flat, num_valid)
        local_ids = flat - self.vocab_start
        local_vocab = self.base_layer.num_embeddings
        in_shard = (local_ids >= 0) & (local_ids < local_vocab)
        base = self.base_layer(torch.where(in_shard, local_ids, 0)) * in_shard[:, None]
        if self.buffers.extra is not None:
            added = flat - self.vocab_size
            is_added = (added >= 0) & (added < self.buffers.num_added_tokens) & (info.token_slots[: flat.shape[0]] >= 0)
            slots = info.token_slots[: flat.shape[0]].clamp(min=0).long()
            rows = self.buffers.extra[slots, torch.where(is_added, added, 0)]
            base = torch.where(is_added[:, None], rows * getattr(self.base_layer, "embed_scale", 1.0), base)
        base = self.tp.all_reduce(base)
        backend = self.context.backend
        with strict_token_ids(False):  # checked above against the whole vocabulary, not this shard
            shrunk = backend.run_lora_a_embedding(local_ids, self.buffers.a, local_vocab, self.buffers.extra)
        shrunk = self.tp.all_reduce(shrunk)
        scale = getattr(self.base_layer, "embed_scale", None)
        if scale is not None:
            shrunk = shrunk * scale
        out = backend.run_lora_b(shrunk, self.buffers.b, (0, self.base_layer.embedding_dim), base)
        return out.reshape(*lead, out.shape[-1])


class LMHeadWithLoRA(ColumnParallelLinearWithLoRA):
    """LM head (vocab-parallel ``nn.Linear``) with LoRA, for every token or only the
    last token of each request (prefill pruning); logits are gathered over ranks."""

    def __init__(self, base_layer: nn.Linear, context: LoRAContext, tp: TensorParallel | None = None) -> None:
        super().__init__(base_layer, context, tp or TensorParallel(), gather_output=True)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden: (..., H)`` with every token's row, or one row per non-empty request."""
        lead = hidden.shape[:-1]
        x2 = _flatten(hidden, self.base_layer.in_features, "LMHeadWithLoRA")
        info = self.context.batch_info
        view = info if x2.shape[0] == info.num_tokens else info.lm_head_view(pruned=True)
        if x2.shape[0] != view.num_tokens:
            raise ValueError(
                f"LMHeadWithLoRA got {x2.shape[0]} rows; expected every token ({info.num_tokens}) or the last "
                f"token of each request ({view.num_tokens})"
            )
        backend = self.context.backend
        backend.prepare_batch(view)
        try:
            out = self._finish(self._lora(x2, self._base(x2)))
        finally:
            backend.prepare_batch(info)
        return out.reshape(*lead, out.shape[-1])
