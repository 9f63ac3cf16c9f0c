"""Graph-safe LoRA ops: static shapes, no host reads, FLOPs that do not grow with the slot count.

Upstream's graph path looped over all ``L`` slots and multiplied every token by
every slot's weights, masking the result (SPEC §1 bug 5: ``L`` times the FLOPs).
Here every token is multiplied by its own slot's weights only. The batch info
packs the tokens of each slot into blocks of ``b`` rows (``NB = ceil(T/b) + L``
blocks: static for a given capacity, at most one partly filled block per slot),
computed on the host when the batch is built and refilled in place:

* shrink: gather the blocks' rows of ``x`` and their slots' ``A``; one ``bmm``
  ``(NB, b, in) @ (NB, in, c*R)``; scale and mask by rank; ``index_add`` back;
* expand: the same with ``B``, one ``bmm`` per slice, accumulated into the output;
* embedding: one 3-D gather ``A[slot, :, id]`` per token (all ranks at once).

Every op launches the same kernels whatever the batch's segments and slots, reads
nothing on the host, and keeps every shape fixed by the batch info's capacity.
Inputs are validated by the dispatcher in :mod:`lora_cuda.ops`.
"""

from __future__ import annotations

import torch

from lora_core import BatchInfo

__all__ = [
    "sgemm_lora_a_graph_fwd",
    "sgemm_lora_b_graph_fwd",
    "sgemm_lora_a_embedding_graph_fwd",
]


def _block_row_mask(batch_info: BatchInfo, max_rank: int, num_slices: int) -> torch.Tensor:
    """``(NB, b, c*R)`` bool: the row is a real token and the column is within its slot's rank."""
    cols = torch.arange(max_rank, device=batch_info.device)
    in_rank = (cols[None, :] < batch_info.block_ranks[:, None]).repeat(1, num_slices)  # (NB, c*R)
    return batch_info.block_valid[:, :, None] & in_rank[:, None, :]


def sgemm_lora_a_graph_fwd(
    x: torch.Tensor, weights: torch.Tensor, batch_info: BatchInfo, num_slices: int = 1
) -> torch.Tensor:
    """Scaled shrink. ``x: (T, in)``, ``weights: (L, c*R, in)`` -> ``(T, c*R)`` in ``x.dtype``."""
    T, in_features = x.shape
    cR = weights.shape[1]
    nb, b = batch_info.num_blocks, batch_info.block_size
    xb = x.index_select(0, batch_info.block_tokens).view(nb, b, in_features)
    wb = weights.index_select(0, batch_info.block_slots)  # (NB, c*R, in)
    yb = torch.bmm(xb, wb.transpose(1, 2))  # (NB, b, c*R)
    scaled = yb * batch_info.block_scalings.view(nb, 1, 1)
    yb = torch.where(_block_row_mask(batch_info, cR // num_slices, num_slices), scaled, 0).to(x.dtype)
    out = x.new_zeros(T, cR)
    return out.index_add_(0, batch_info.block_tokens, yb.view(nb * b, cR))


def sgemm_lora_b_graph_fwd(
    x: torch.Tensor,
    weights: torch.Tensor,
    batch_info: BatchInfo,
    slice_offsets: tuple[int, ...],
    base_output: torch.Tensor | None = None,
) -> torch.Tensor:
    """Expand. ``x: (T, c*R)``, ``weights: (L, out_total, R)`` -> ``(T, out_total)``,
    accumulated into ``base_output`` in place when given."""
    T, cR = x.shape
    R, out_total = weights.shape[2], slice_offsets[-1]
    num_slices = len(slice_offsets) - 1
    nb, b = batch_info.num_blocks, batch_info.block_size
    out = base_output if base_output is not None else x.new_zeros(T, out_total)
    yb = x.index_select(0, batch_info.block_tokens).view(nb, b, cR)
    yb = torch.where(_block_row_mask(batch_info, R, num_slices), yb, 0)
    wb = weights.index_select(0, batch_info.block_slots)  # (NB, out_total, R)
    if num_slices == 1:
        delta = torch.bmm(yb, wb.transpose(1, 2))
    else:
        delta = torch.cat(
            [
                torch.bmm(yb[:, :, i * R : (i + 1) * R], wb[:, slice_offsets[i] : slice_offsets[i + 1]].transpose(1, 2))
                for i in range(num_slices)
            ],
            dim=2,
        )
    return out.index_add_(0, batch_info.block_tokens, delta.view(nb * b, out_total))


def sgemm_lora_a_embedding_graph_fwd(
    ids: torch.Tensor, weights: torch.Tensor, batch_info: BatchInfo, num_valid_ids: int
) -> torch.Tensor:
    """Scaled embedding shrink by one 3-D gather. ``ids: (T,)`` integer,
    ``weights: (L, R, V_total)`` -> ``(T, R)``; ids outside ``[0, num_valid_ids)`` get zeros."""
    T, R = ids.shape[0], weights.shape[1]
    slots = batch_info.token_slots[:T]
    valid = (slots >= 0) & (ids >= 0) & (ids < num_valid_ids)
    safe_slots = torch.where(valid, slots, 0).long()
    safe_ids = torch.where(valid, ids, 0).long()
    # (slot, id) picks a row of the (L, V_total, R) view: all R ranks of the token at once
    picked = weights.transpose(1, 2)[safe_slots, safe_ids]  # (T, R)
    in_rank = torch.arange(R, device=ids.device)[None, :] < batch_info.lora_ranks.index_select(0, safe_slots)[:, None]
    scaled = picked * batch_info.scalings.index_select(0, safe_slots)[:, None]
    return torch.where(valid[:, None] & in_rank, scaled, 0).to(weights.dtype)
