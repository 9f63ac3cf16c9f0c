"""Each slot's live rank in vLLM's zero-padded LoRA buffers, read once per change of a buffer.

vLLM allocates every LoRA buffer at ``max_lora_rank`` for every slot and zero-fills what an
adapter leaves out: the ranks below ``max_lora_rank`` are zero-padded, and a module the
adapter does not target (the LM head of an adapter on the attention layers, say) is all
zeros in that adapter's slot. Its own ops multiply all of it, every step. Rank component
``k`` of slot ``s`` contributes ``b[s, :, k] (x) a[s, k, :]``, which is zero when either
factor is, so reading ``a[s, :r]`` and ``b[s, :, :r]`` up to the last live component gives
the same delta from fewer bytes, and a slot with no live component needs no math at all.

Finding ``r`` reads the whole buffer (and, on an accelerator, waits for it), so it runs only
when a buffer changed: vLLM writes its buffers in place (``set_lora``, ``reset_lora``), which
bumps the tensor's version counter (``Tensor._version``, the counter autograd uses to detect
in-place writes); the ranks of a buffer pair are kept with the versions they were read at.
"""

from __future__ import annotations

import torch

__all__ = ["SlotRanks", "live_ranks"]


def live_ranks(a: torch.Tensor | None, b: torch.Tensor | None) -> tuple[int, ...]:
    """The live rank of each slot of ``a (L, R, in)`` and/or ``b (L, out, R)``: one plus the last
    rank component ``k`` with ``a[s, k, :]`` and ``b[s, :, k]`` both nonzero (0 when there is none).
    With one of them ``None``, the other decides alone. Reads the tensors back to the host."""
    live = None
    if a is not None:
        live = a.ne(0).any(dim=2)
    if b is not None:
        live_b = b.ne(0).any(dim=1)
        live = live_b if live is None else live & live_b
    if live is None:
        raise ValueError("live_ranks needs a or b")
    num_slots, rank = live.shape
    if rank == 0:
        return (0,) * num_slots
    positions = torch.arange(1, rank + 1, device=live.device)
    return tuple(torch.where(live, positions, 0).amax(dim=1).tolist())


class SlotRanks:
    """:func:`live_ranks` of buffer pairs, recomputed only when a buffer was written since."""

    def __init__(self) -> None:
        self._known: dict[tuple, tuple[tuple[int, int], tuple[int, ...]]] = {}

    def of(self, a: torch.Tensor | None, b: torch.Tensor | None) -> tuple[int, ...]:
        """The live rank of each slot of the pair (``a (L, R, in)``, ``b (L, out, R)``, either may be ``None``)."""
        key = (_identity(a), _identity(b))
        versions = (_version(a), _version(b))
        known = self._known.get(key)
        if known is not None and known[0] == versions:
            return known[1]
        ranks = live_ranks(a, b)
        self._known[key] = (versions, ranks)
        return ranks


def _identity(t: torch.Tensor | None) -> tuple | None:
    return None if t is None else (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)


def _version(t: torch.Tensor | None) -> int:
    return -1 if t is None else t._version
