"""The eager batch cache: recent batch layouts keep their batch info (and its plans).

Decode steps repeat one layout (the same ``seq_lens`` and slots) many times;
:class:`BatchCache` keeps the last few batch infos built by
:func:`lora_core.build_batch_info` so a repeated layout reuses the one it built,
with the plans the backend made for it. A batch info carries the slots' ranks
and scalings, so the cache is cleared whenever an adapter is loaded or unloaded.
Graph mode does not use it (one preallocated batch is refilled in place:
:mod:`lora_layers.graph_mode`).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import torch

from lora_core import AdapterSlots, BatchInfo, build_batch_info
from lora_core.checks import are_plain_ints

__all__ = ["BATCH_CACHE_SIZE", "BatchCache"]

BATCH_CACHE_SIZE = 16
"""Batch infos kept, most recently used first."""


class BatchCache:
    """Eager batch infos by layout, least recently used dropped first.

    Args:
        device: where the batch infos' tensors live.
        size: layouts kept.
    """

    def __init__(self, device: torch.device, size: int = BATCH_CACHE_SIZE) -> None:
        self.device = device
        self.size = size
        self._batches: OrderedDict[tuple, BatchInfo] = OrderedDict()

    def __len__(self) -> int:
        return len(self._batches)

    def clear(self) -> None:
        """Forget every batch (the slots' ranks or scalings changed)."""
        self._batches.clear()

    def get(self, seq_lens: Sequence[int], slot_ids: Sequence[int | None], slots: AdapterSlots,
            scales: Sequence[float] | None = None) -> BatchInfo:
        """The batch info of requests of ``seq_lens`` tokens in slots ``slot_ids`` (``None``:
        no adapter) at request ``scales`` (``None``: none given; given, even all 1, the ops
        apply them: ``with_scales``), with ``slots``' ranks and scalings: the cached one for a
        layout seen since the last :meth:`clear`, else a new one (cached when every length
        is a plain ``int``; a ``2.0`` would compare equal to ``2`` and is validated
        by ``build_batch_info`` instead)."""
        lens = tuple(seq_lens)
        given = None if scales is None else tuple(scales.tolist() if hasattr(scales, "tolist") else scales)
        key = (lens, tuple(slot_ids), given) if are_plain_ints(lens) else None
        info = self._batches.get(key) if key is not None else None
        if info is not None:
            self._batches.move_to_end(key)
            return info
        info = build_batch_info(seq_lens, slot_ids, slots.lora_ranks, slots.scalings, device=self.device,
                                max_rank=slots.max_rank, scales=scales, with_scales=scales is not None)
        if key is not None:
            self._batches[key] = info
            if len(self._batches) > self.size:
                self._batches.popitem(last=False)
        return info
