"""Each slot's live rank in vLLM's zero-padded LoRA buffers, read once per change of a buffer.

vLLM allocates every LoRA buffer at ``max_lora_rank`` for every slot and zero-fills what an
adapter leaves out: the ranks below ``max_lora_rank`` are zero-padded, and a module the
adapter does not target (the LM head of an adapter on the attention layers, say) is all
zeros in that adapter's slot. Its own ops multiply all of it, every step. Rank component
``k`` of slot ``s`` contributes ``b[s, :, k] (x) a[s, k, :]``, which is zero when either
factor is, so reading ``a[s, :r]`` and ``b[s, :, :r]`` up to the last live component gives
the same delta from fewer bytes, and a slot with no live component needs no math at all.

Finding ``r`` reads the whole buffer (and, on an accelerator, waits for it), so it runs only
when a buffer changed. The contract: the buffers are vLLM's persistent stacked tensors (the
same objects every call; a ranks entry is tied to them by weak reference), written in place
through ordinary tensor ops, as vLLM's ``set_lora`` / ``reset_lora`` do (``copy_``, item
assignment). Such writes bump the tensor's version counter (``Tensor._version``, the counter
autograd uses to detect in-place writes), and the ranks of a buffer pair are kept with the
versions they were read at. A write the counter does not see (through ``.data``, DLPack or
a NumPy alias) would leave stale ranks. Inference tensors have no version counter: their
slots are all taken at the buffers' full rank, every call (correct, without the saving).
"""

from __future__ import annotations

import weakref

import torch

__all__ = ["SlotRanks", "live_ranks", "stacked_view"]


def stacked_view(w: torch.Tensor) -> torch.Tensor:
    """vLLM's stacked buffer ``(L, 1, rows, cols)`` as the lora-kit layout ``(L, rows, cols)`` (a view);
    a 3-D buffer as it is."""
    return w.squeeze(1) if w.dim() == 4 else w


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
    """:func:`live_ranks` of vLLM's buffer pairs, recomputed only when a buffer was written since."""

    def __init__(self) -> None:
        self._known: dict[tuple[int, int], tuple[tuple, tuple[int, int], tuple[int, ...]]] = {}

    def of(self, a: torch.Tensor | None, b: torch.Tensor | None) -> tuple[int, ...]:
        """The live rank of each slot of the pair: vLLM's stacked ``a (L, 1, R, in)`` and ``b (L, 1, out, R)``
        (or their 3-D views), either may be ``None``."""
        if (a is not None and a.is_inference()) or (b is not None and b.is_inference()):
            w = a if a is not None else b
            return (stacked_view(w).shape[1 if a is not None else 2],) * w.shape[0]
        key = (id(a), id(b))
        versions = (-1 if a is None else a._version, -1 if b is None else b._version)
        known = self._known.get(key)
        if known is not None and known[1] == versions and all(ref() is t for ref, t in zip(known[0], (a, b))):
            return known[2]
        ranks = live_ranks(None if a is None else stacked_view(a), None if b is None else stacked_view(b))
        refs = tuple((lambda: None) if t is None else weakref.ref(t, self._forget(key)) for t in (a, b))
        self._known[key] = (refs, versions, ranks)
        return ranks

    def _forget(self, key: tuple[int, int]):
        """A weak-reference callback that drops ``key``'s entry when one of its buffers is freed."""
        owner = weakref.ref(self)

        def forget(_ref: weakref.ref) -> None:
            ranks = owner()
            if ranks is not None:
                ranks._known.pop(key, None)

        return forget
