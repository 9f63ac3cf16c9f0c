"""Graph mode: one preallocated batch, refilled in place, so a captured forward replays.

After :meth:`GraphMode.enable` the backend holds a batch info of ``max_tokens``
rows (``backend.init_graph_batch_info``) whose tensors never move: each new batch
is written into it (:meth:`BatchInfo.refill`, which refills the backend's plans
with it), and loading or unloading an adapter updates its ranks and scalings in
place (:meth:`BatchInfo.set_adapters`). See docs/graph-rules.md.
"""

from __future__ import annotations

from typing import Sequence

from lora_core import AdapterSlots, BatchInfo, LoRABackend

__all__ = ["GraphMode"]


class GraphMode:
    """Whether the backend's batch is a preallocated graph-mode batch, and its refills."""

    def __init__(self, backend: LoRABackend) -> None:
        self.backend = backend
        self.enabled = False

    def enable(self, max_tokens: int, slots: AdapterSlots, *, scales: bool = False,
               max_pairs: int | None = None) -> BatchInfo:
        """Preallocate a batch of ``max_tokens`` rows with ``slots``' ranks and scalings (that
        takes request scales when ``scales``, and weighted mixes of up to ``max_pairs`` (token,
        adapter) pairs, with scales), hand it to the backend, and switch to refilling it; returns it."""
        options = {"with_scales": True} if scales or max_pairs is not None else {}  # a backend of its own
        if max_pairs is not None:                                                   # may not know the options
            options["max_pairs"] = max_pairs
        info = self.backend.init_graph_batch_info(max_tokens, slots.lora_ranks, slots.scalings, **options)
        self.backend.prepare_batch(info)
        self.enabled = True
        return info

    def refill(self, seq_lens: Sequence[int], slot_ids: Sequence[int | None | tuple[tuple[int, float], ...]],
               scales: Sequence[float] | None = None) -> BatchInfo:
        """Write requests of ``seq_lens`` tokens in slots ``slot_ids`` (``None``: no adapter) at
        request ``scales`` into the preallocated batch, in place; returns it."""
        info = self.backend.batch_info
        info.refill(seq_lens, slot_ids, scales)  # in place: the backend's plans are refilled with it
        return info

    def update_adapters(self, slots: AdapterSlots) -> None:
        """Copy ``slots``' ranks and scalings into the preallocated batch (a no-op before :meth:`enable`)."""
        if self.enabled:
            self.backend.batch_info.set_adapters(slots.lora_ranks, slots.scalings)
