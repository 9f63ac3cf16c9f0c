"""Weighted adapter mixes at the API: a request's ``{"math": 0.7, "style": 0.3}`` as slots.

``MultiLoRA.set_batch``, ``route`` and ``generate`` take, in place of a request's adapter name, a
weighted mix of loaded adapters: ``{name: weight, ...}`` or ``[(name, weight), ...]``. The request
gets ``sum_i weight_i * delta_i`` (times its request scale) in every LoRA module its tokens pass
through: PEFT's ``add_weighted_adapter(names, weights, combination_type="cat")`` of those adapters,
for that request alone, with nothing merged or copied (docs/request-mixes.md). Its first adapter
runs on its tokens, each further one on (token, adapter) pair rows (:mod:`lora_core.pair_rows`).

:class:`MixResolver` turns a request's entry into what ``lora_core.build_batch_info`` takes (a
slot, ``None``, or ``((slot, weight), ...)``), refusing in one line that names the request: an
empty mix, a name that is not loaded or named twice, a weight that is negative or not finite, and
an adapter a mix cannot hold (DoRA's norm is not linear in the delta; a ``modules_to_save`` copy
replaces a module whole).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Callable, Iterable, Iterator, Sequence

from lora_core.batch_requests import parse_mix

from .routing import PEFT_BASE

__all__ = ["AdapterEntry", "MixResolver", "adapter_names", "is_mix"]

AdapterEntry = str | None | Mapping[str, float] | Sequence[tuple[str, float]]
"""A request's adapter: a loaded adapter's name, ``None`` (the base model), or a weighted mix."""


def is_mix(entry: object) -> bool:
    """Whether a request's adapter entry is a weighted mix (a mapping, or a list / tuple of pairs)."""
    return isinstance(entry, (Mapping, list, tuple))


def adapter_names(entries: Iterable[AdapterEntry]) -> Iterator[str]:
    """Every adapter name the entries use, a mix's names included (duplicates kept)."""
    for entry in entries:
        if isinstance(entry, Mapping):
            yield from entry
        elif is_mix(entry):
            yield from (item[0] for item in entry if isinstance(item, (tuple, list)) and item)
        elif entry is not None:
            yield entry


class MixResolver:
    """Request entries as slots.

    Args:
        slot_of: a loaded adapter's slot (``ValueError`` naming the loaded ones otherwise).
        unmixable: an adapter's reason it cannot be in a mix of two or more (``None``: it can).
    """

    def __init__(self, slot_of: Callable[[str], int], unmixable: Callable[[str], str | None]) -> None:
        self._slot_of = slot_of
        self._unmixable = unmixable

    def slot_ids(self, adapters: Sequence[AdapterEntry]) -> list[int | None | tuple[tuple[int, float], ...]]:
        """Each request's slot (``None``: the base model), or its mix as ``((slot, weight), ...)``."""
        return [self.resolve(i, a) for i, a in enumerate(adapters)]

    def resolve(self, index: int, entry: AdapterEntry) -> int | None | tuple[tuple[int, float], ...]:
        if entry is None or (isinstance(entry, str) and entry == PEFT_BASE):
            return None
        if isinstance(entry, str):
            return self._slot_of(entry)
        if not is_mix(entry):
            raise TypeError(f"adapters[{index}] (request {index}) must be an adapter name, None or a weighted mix "
                            f"{{name: weight}}, got {entry!r}")
        name = f"adapters[{index}] (request {index})"
        items = parse_mix(name, entry, lambda adapter: f"adapter {adapter!r}")
        mix = []
        for adapter, weight in items:
            if not isinstance(adapter, str) or adapter == PEFT_BASE:
                raise ValueError(f"{name}: a mix names loaded adapters, got {adapter!r}")
            try:
                slot = self._slot_of(adapter)
            except ValueError as err:
                raise ValueError(f"{name}: {err}") from None
            reason = self._unmixable(adapter) if len(items) > 1 else None
            if reason is not None:
                raise ValueError(f"{name}: adapter {adapter!r} cannot be mixed with others: {reason}")
            mix.append((slot, weight))
        return tuple(mix)
