"""Slots: which adapter is in which slot of the wrapped layers; loading, replacing, eviction.

:class:`SlotTable` owns the host record (:class:`lora_core.AdapterSlots`: name,
rank and scaling per slot) and the use counts LRU eviction reads. Loading an
adapter frees a slot (replace, or evict), reserves it, and asks every wrapped
layer to load its part (:meth:`~lora_layers.layers.LayerKind.load_slot`) or to
clear the slot; a failed load leaves the slot free and zeroed. It knows nothing
of layer kinds, model structure or batches: after every change it calls
``on_change`` (``MultiLoRA`` refreshes its batches there).
"""

from __future__ import annotations

from typing import Callable, Collection, Iterable, Mapping

from lora_core import AdapterSlots, PeftAdapter, peft_scaling

from .layers import LayerKind, ModuleParts
from .routing import PEFT_BASE

__all__ = ["EVICTION_POLICIES", "SlotTable", "check_eviction"]

EVICTION_POLICIES = (None, "lru")
"""What loading into a full table does: ``None`` raises, ``"lru"`` unloads the least recently used adapter."""


def check_eviction(eviction: str | None) -> None:
    """``ValueError`` unless ``eviction`` is one of :data:`EVICTION_POLICIES`."""
    if eviction not in EVICTION_POLICIES:
        raise ValueError(f"eviction must be one of {EVICTION_POLICIES}, got {eviction!r}")


class SlotTable:
    """The adapters loaded into the wrapped layers' ``max_loras`` slots.

    Args:
        max_loras: slots (adapters loaded at once).
        max_rank: the largest adapter rank the layers' buffers hold.
        eviction: ``None`` or ``"lru"`` (:data:`EVICTION_POLICIES`).
        on_change: called after every load and unload (the slots' ranks and
            scalings changed).
    """

    def __init__(self, max_loras: int, max_rank: int, *, eviction: str | None = None,
                 on_change: Callable[[], None] = lambda: None) -> None:
        check_eviction(eviction)
        self.slots = AdapterSlots(max_loras, max_rank)
        self.eviction = eviction
        self._on_change = on_change
        self._last_used: dict[str, int] = {}
        self._uses = 0

    def slot_of(self, name: str) -> int:
        """``name``'s slot; ``ValueError`` naming the loaded adapters if it is not loaded."""
        try:
            return self.slots.slot_of(name)
        except KeyError as err:
            raise ValueError(err.args[0]) from None

    def touch(self, adapters: Iterable[str | None]) -> None:
        """Record one use (a batch) of each named adapter, for LRU eviction."""
        self._uses += 1
        for a in adapters:
            if a is not None:
                self._last_used[a] = self._uses

    def check_new(self, name: str, adapter: PeftAdapter, *, replace: bool = False) -> None:
        """``ValueError`` unless ``adapter`` can be loaded as ``name``: a valid name, its
        rank within ``max_rank``, and ``name`` not loaded yet (unless ``replace``)."""
        if not isinstance(name, str) or not name or name == PEFT_BASE:
            raise ValueError(f"adapter name must be a non-empty str other than {PEFT_BASE!r}, got {name!r}")
        if adapter.rank > self.slots.max_rank:
            raise ValueError(f"adapter {name!r} has rank {adapter.rank}, more than max_rank = {self.slots.max_rank} "
                             "(the buffers' rank is fixed when the model is wrapped: pass a larger max_rank)")
        if name in self.slots.loaded and not replace:
            raise ValueError(f"adapter {name!r} is already loaded in slot {self.slots.loaded[name]}; "
                             "pass replace=True to load it again, or unload_adapter it first")

    def load(self, name: str, adapter: PeftAdapter, plan: Mapping[str, ModuleParts],
             layers: Mapping[str, LayerKind], *, protected: Collection[str | None] = ()) -> int:
        """Load ``adapter`` as ``name`` into a free slot of every layer; returns the slot.

        ``plan``: wrapped module name -> the adapter's parts for it (every layer not in
        it gets a zeroed slot). A loaded ``name`` is unloaded first (replace). When
        every slot is taken, ``eviction="lru"`` unloads the least recently used
        adapter not in ``protected`` (the active route); otherwise ``RuntimeError``.
        A layer refusing its weights is a ``ValueError`` naming the adapter and
        module, and leaves the slot free and zeroed.
        """
        if name in self.slots.loaded:
            self.unload(name, layers)
        elif len(self.slots.loaded) == self.slots.num_slots:
            if self.eviction != "lru":
                raise RuntimeError(f"all {self.slots.num_slots} adapter slots are in use "
                                   f"({', '.join(sorted(self.slots.loaded))}); unload_adapter one first, or build "
                                   "with eviction='lru' or more max_loras")
            self.unload(self.least_recently_used(protected), layers)
        cfg = adapter.config
        slot_scaling = peft_scaling(cfg["lora_alpha"], cfg["r"], adapter.use_rslora)
        slot = self.slots.assign(name, adapter.rank, slot_scaling)
        try:
            for target, layer in layers.items():
                if target not in plan:
                    layer.reset_lora(slot)
                    continue
                try:
                    layer.load_slot(slot, plan[target], slot_scaling)
                except ValueError as err:
                    raise ValueError(f"adapter {name!r} does not fit module {target!r}: {err}") from None
        except Exception:
            self.slots.release(name)
            for layer in layers.values():
                layer.reset_lora(slot)
            raise
        self._on_change()
        return slot

    def unload(self, name: str, layers: Mapping[str, LayerKind]) -> None:
        """Free ``name``'s slot and zero it in every layer; ``ValueError`` if it is not loaded."""
        slot = self.slot_of(name)
        self.slots.release(name)
        self._last_used.pop(name, None)
        for layer in layers.values():
            layer.reset_lora(slot)
        self._on_change()

    def least_recently_used(self, protected: Collection[str | None] = ()) -> str:
        """The loaded adapter used longest ago (never used: the lowest slot first),
        not one of ``protected``; ``RuntimeError`` when every one is protected."""
        candidates = [n for n in self.slots.loaded if n not in protected]
        if not candidates:
            raise RuntimeError(f"all {self.slots.num_slots} adapter slots hold adapters of the active route "
                               f"({', '.join(sorted(self.slots.loaded))}); none can be evicted")
        return min(candidates, key=lambda n: (self._last_used.get(n, -1), self.slots.loaded[n]))
