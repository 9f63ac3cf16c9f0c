"""Reference LoRA math in fp32 on the host: the oracle every op is tested against.

Written for clarity, not speed (docs/layout.md, PEFT's math)::

    shrink:  y[t, i*R : i*R + r] = c_t * scaling_l * A_l[i*R : i*R + r] @ x[t]
    expand:  delta[t, o_i : o_{i+1}] = B_l[o_i : o_{i+1}, :r] @ y[t, i*R : i*R + r]
    layer:   out = base(x) + delta

for each token ``t`` of slot ``l`` with rank ``r`` and request scale ``c_t``
(``BatchInfo.token_scales``); tokens of slot -1 and slots of rank 0 get a zero delta.
A request with a weighted mix has its first slot on its token rows and each further slot
(``BatchInfo.request_mixes``) on a pair row per token, after every token row, in request
order then mix order: a shrink's output has ``T + P`` rows, and the expand adds each pair
row's delta to its token (:func:`adapter_rows`).
Embedding: ``y[t, :r] = c_t * scaling_l * A_l[:r, id]`` when
``0 <= id < V + added``, else zero (the OOV policy: never a clamped neighbour).

Every function takes tensors on any device and returns fp32 CPU tensors.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .batch_info import BatchInfo
from .layout import slice_offsets_from_widths
from .validation import normalize_slice_offsets

__all__ = [
    "reference_lora_a",
    "reference_lora_b",
    "reference_lora_a_embedding",
    "reference_linear",
    "reference_lm_head",
    "reference_embedding",
    "adapter_rows",
    "num_pair_rows",
    "reference_saved_linear",
]


def adapter_rows(batch_info: BatchInfo, num_tokens: int) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``slot -> (rows, tokens, scales)`` for each active slot (slot >= 0 and rank > 0) of the first
    ``num_tokens`` tokens: the shrink output's rows the slot fills, the token each reads and adds to,
    and each row's request scale. Token rows first (row = token, the request's first slot), then a
    row per token of each request's further mixed slots, numbered from ``num_tokens`` in request
    order and mix order (``BatchInfo.request_mixes``)."""
    ranks = batch_info.lora_ranks_host
    groups: dict[int, tuple[list[int], list[int], list[float]]] = {}

    def add(row: int, token: int, slot: int, scale: float) -> None:
        if slot >= 0 and ranks[slot] > 0:
            rows, tokens, scales = groups.setdefault(slot, ([], [], []))
            rows.append(row), tokens.append(token), scales.append(scale)

    slots, scales = batch_info.token_slots_cpu[:num_tokens].tolist(), batch_info.token_scales_cpu[:num_tokens].tolist()
    for t, (slot, scale) in enumerate(zip(slots, scales)):
        add(t, t, slot, scale)
    row, start = num_tokens, 0
    for length, further in zip(batch_info.seq_lens, batch_info.request_mixes):
        for slot, weight in further:
            for t in range(start, start + length):
                add(row, t, slot, weight)
                row += 1
        start += length
    return {slot: (torch.tensor(rows), torch.tensor(tokens), torch.tensor(scales, dtype=torch.float32))
            for slot, (rows, tokens, scales) in groups.items()}


def num_pair_rows(batch_info: BatchInfo) -> int:
    """The rows a request's further mixed slots add to a shrink's output (:func:`adapter_rows`)."""
    return sum(length * len(further) for length, further in zip(batch_info.seq_lens, batch_info.request_mixes))


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(device="cpu", dtype=torch.float32)


def reference_lora_a(x: torch.Tensor, a: torch.Tensor, batch_info: BatchInfo, num_slices: int = 1) -> torch.Tensor:
    """Scaled shrink. ``x: (T, in)``, ``a: (L, c*R, in)`` -> ``(T + P, c*R)`` fp32 (``P``: the pair
    rows of the batch's mixes, :func:`adapter_rows`)."""
    xf, af = _f32(x), _f32(a)
    R = a.shape[1] // num_slices
    out = torch.zeros(x.shape[0] + num_pair_rows(batch_info), a.shape[1])
    for slot, (rows, tokens, scales) in adapter_rows(batch_info, x.shape[0]).items():
        r, s = batch_info.lora_ranks_host[slot], batch_info.scalings_host[slot]
        for i in range(num_slices):
            cols = slice(i * R, i * R + r)
            out[rows, cols] = s * scales[:, None] * (xf[tokens] @ af[slot, cols].T)
    return out


def reference_lora_b(
    y: torch.Tensor, b: torch.Tensor, batch_info: BatchInfo, slice_offsets: Sequence[int] | torch.Tensor
) -> torch.Tensor:
    """Expand (no base). ``y: (T + P, c*R)`` (:func:`reference_lora_a`), ``b: (L, out_total, R)`` ->
    delta ``(T, out_total)`` fp32: each row's delta added to its token."""
    yf, bf = _f32(y), _f32(b)
    offsets = normalize_slice_offsets(slice_offsets)
    R = b.shape[2]
    num_tokens = y.shape[0] - num_pair_rows(batch_info)
    out = torch.zeros(num_tokens, b.shape[1])
    for slot, (rows, tokens, _) in adapter_rows(batch_info, num_tokens).items():
        r = batch_info.lora_ranks_host[slot]
        for i in range(len(offsets) - 1):
            cols = slice(offsets[i], offsets[i + 1])
            out[:, cols].index_add_(0, tokens, yf[rows, i * R : i * R + r] @ bf[slot, cols, :r].T)
    return out


def reference_lora_a_embedding(
    ids: torch.Tensor, a: torch.Tensor, batch_info: BatchInfo, vocab_size: int, num_added_tokens: int = 0
) -> torch.Tensor:
    """Scaled embedding shrink. ``ids: (T,)`` int, ``a: (L, R, V_total)`` -> ``(T + P, R)`` fp32.

    Ids outside ``[0, vocab_size + num_added_tokens)`` get zeros.
    """
    af = _f32(a)
    id_list = ids.detach().cpu().tolist()
    total = vocab_size + num_added_tokens
    out = torch.zeros(len(id_list) + num_pair_rows(batch_info), a.shape[1])
    for slot, (rows, tokens, scales) in adapter_rows(batch_info, len(id_list)).items():
        r, s = batch_info.lora_ranks_host[slot], batch_info.scalings_host[slot]
        for row, t, c in zip(rows.tolist(), tokens.tolist(), scales.tolist()):
            token = id_list[t]
            if 0 <= token < total:
                out[row, :r] = s * c * af[slot, :r, token]
    return out


def reference_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    a: torch.Tensor,
    b: torch.Tensor,
    batch_info: BatchInfo,
    slice_offsets: Sequence[int] | torch.Tensor | None = None,
) -> torch.Tensor:
    """Whole linear layer, plain or packed (qkv, gate_up): ``x @ W.T + bias + delta``.

    ``x: (T, in)``, ``weight: (out_total, in)``, ``a: (L, c*R, in)``,
    ``b: (L, out_total, R)``; ``slice_offsets`` defaults to one slice.
    """
    offsets = normalize_slice_offsets(slice_offsets) if slice_offsets is not None else slice_offsets_from_widths([b.shape[1]])
    base = _f32(x) @ _f32(weight).T
    if bias is not None:
        base = base + _f32(bias)
    shrink = reference_lora_a(x, a, batch_info, num_slices=len(offsets) - 1)
    return base + reference_lora_b(shrink, b, batch_info, offsets)


def reference_lm_head(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    batch_info: BatchInfo,
    pruned: bool,
) -> torch.Tensor:
    """LM head: ``hidden: (rows, H)`` are every token (``pruned=False``) or the last
    token of each request (``pruned=True``); ``weight: (V, H)``, ``b: (L, V, R)``."""
    return reference_linear(hidden, weight, None, a, b, batch_info.lm_head_view(pruned))


def reference_embedding(
    ids: torch.Tensor,
    weight: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    batch_info: BatchInfo,
    extra_embeddings: torch.Tensor | None = None,
    embed_scale: float = 1.0,
) -> torch.Tensor:
    """Whole embedding layer: ``embed_scale * (base(ids) + B_l @ shrink)``.

    ``ids: (T,)``, ``weight: (V, D)``, ``a: (L, R, V + added)``, ``b: (L, D, R)``,
    ``extra_embeddings: (L, added, D)``. ``base(id)`` is ``weight[id]`` for
    ``id < V``, the slot's added embedding for ``V <= id < V + added`` (zero for
    slot -1), and zero outside the vocabulary.
    """
    vocab_size = weight.shape[0]
    added = extra_embeddings.shape[1] if extra_embeddings is not None else 0
    wf = _f32(weight)
    slots = batch_info.token_slots_cpu[: ids.shape[0]].tolist()
    base = torch.zeros(ids.shape[0], weight.shape[1])
    for t, token in enumerate(ids.detach().cpu().tolist()):
        if 0 <= token < vocab_size:
            base[t] = wf[token]
        elif vocab_size <= token < vocab_size + added and slots[t] >= 0:
            base[t] = _f32(extra_embeddings[slots[t], token - vocab_size])
    shrink = reference_lora_a_embedding(ids, a, batch_info, vocab_size, added)
    offsets = slice_offsets_from_widths([b.shape[1]])
    return embed_scale * (base + reference_lora_b(shrink, b, batch_info, offsets))


def reference_saved_linear(x: torch.Tensor, batch_info: BatchInfo, held: torch.Tensor, weight: torch.Tensor,
                           bias: torch.Tensor | None, base_out: torch.Tensor) -> torch.Tensor:
    """A module adapters train whole (PEFT's ``modules_to_save``), one copy per slot::

        out[t] = weight[s] @ x[t] + bias[s]   if s = token_slots[t] >= 0 and held[s]
        out[t] = base_out[t]                  otherwise (no adapter, or its adapter saved no copy)

    ``x (T, in)``, ``weight (L, out, in)``, ``bias (L, out)`` or ``None``, ``held (L,)`` bool,
    ``base_out (T, out)`` (the base module's output). The slot's rank plays no part.
    """
    out = base_out.detach().float().cpu().clone()
    held_host = held.cpu().tolist()
    for t, s in enumerate(batch_info.token_slots_cpu[: x.shape[0]].tolist()):
        if s >= 0 and held_host[s]:
            out[t] = weight[s].float().cpu() @ x[t].float().cpu()
            if bias is not None:
                out[t] += bias[s].float().cpu()
    return out
