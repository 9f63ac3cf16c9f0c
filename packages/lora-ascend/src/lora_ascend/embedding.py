"""The embedding shrink as one flat gather: ``A[slot, :, id]`` for every token at once.

The Ascend design: instead of a loop over segments (one ``F.embedding`` launch
each), every token's ``R`` values are picked from the contiguous ``(L, R, V_total)``
stack by a single 1-D gather over flat indices ``(slot * R + r) * V_total + id``,
then scaled and masked. It launches the same few kernels whatever the batch,
reads nothing on the host, and is graph-safe.

Out-of-vocabulary policy (docs/layout.md): an id outside ``[0, V + added)`` gets a
zero delta on every device, never a clamped neighbour's row.
"""

from __future__ import annotations

import torch

from lora_core import BatchInfo
from lora_core.validation import check_embedding_inputs, check_token_ids

__all__ = ["vectorized_lora_a_embedding_fwd"]


def vectorized_lora_a_embedding_fwd(
    ids: torch.Tensor,
    weights: torch.Tensor,
    batch_info: BatchInfo,
    vocab_size: int,
    extra_embeddings: torch.Tensor | None = None,
    *,
    strict_token_ids: bool = False,
) -> torch.Tensor:
    """Scaled embedding shrink. ``ids: (T,)`` integer, ``weights: (L, R, V_total)`` -> ``(T, R)``
    in ``weights.dtype`` (``(T, 0)`` for empty weights).

    Valid ids are ``[0, vocab_size + added)`` with ``added = extra_embeddings.shape[1]``;
    any other id gets a zero delta, or raises ``ValueError`` naming its positions
    with ``strict_token_ids=True`` (eager calls only).

    Semantics::

        out[t, :r] = s * weights[slot_t, :r, ids[t]]   if slot_t >= 0 and 0 <= ids[t] < vocab_size + added
        out[t, :]  = 0                                 otherwise
    """
    num_valid = check_embedding_inputs(ids, weights, batch_info, vocab_size, extra_embeddings)
    if strict_token_ids:
        check_token_ids(ids, num_valid)
    T, (L, R, V_total) = ids.shape[0], weights.shape
    if weights.numel() == 0:
        return weights.new_zeros(T, R)
    slots = batch_info.token_slots[:T].long()
    valid = (slots >= 0) & (ids >= 0) & (ids < num_valid)
    slot = torch.where(valid, slots, 0)
    ranks = torch.arange(R, device=ids.device)
    keep = valid[:, None] & (ranks[None, :] < batch_info.lora_ranks.long().index_select(0, slot)[:, None])
    flat = (slot[:, None] * R + ranks[None, :]) * V_total + torch.where(valid, ids, 0).long()[:, None]
    picked = weights.reshape(-1).take(torch.where(keep, flat, 0))  # (T, R), one gather
    scaled = picked * batch_info.scalings.index_select(0, slot)[:, None]
    return torch.where(keep, scaled, 0).to(weights.dtype)
