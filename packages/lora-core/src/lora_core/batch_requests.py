"""A batch description validated at the boundary: tokens, adapter slot (or weighted mix of
slots) and scale per request.

:func:`validate_requests` and :func:`validate_adapters` check what a caller hands
to :func:`lora_core.build_batch_info` (and to ``BatchInfo.refill`` /
``set_adapters``) once, naming the bad argument and the expected value, and turn
it into host NumPy arrays that the batch publishes. Plain Python ints, the common
case, are checked with C-level loops; anything else element by element.

:func:`merge_segments` is the one rule that turns requests into segments:
adjacent non-empty requests on one slot become one segment.

A request may name a weighted mix of slots instead of one slot (:class:`Mixes`): its first
slot is its slot, at ``scale * weight``, and each further slot gives the batch one more row
per token of the request, a (token, adapter) pair row (:meth:`Requests.with_pair_rows`).
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from typing import Callable, Sequence

import numpy as np
import torch

from .checks import FLOAT32_MAX, are_plain_ints, check_finite_float, check_int, is_int, plain_int_array

__all__ = ["MAX_TOKENS", "Mixes", "Requests", "check_capacity", "merge_segments", "parse_mix", "scales_need_with_scales",
           "validate_adapters", "validate_mix", "validate_requests", "validate_scales"]

MAX_TOKENS = 2**31 - 1
"""The most tokens a batch can hold: token and segment offsets are int32 on the device."""


class Mixes:
    """The slots beyond the first of the batch's mixed requests: one entry per (request, further
    slot), in request order and, within a request, in the mix's order. ``requests``, ``slots``
    (int64) and ``weights`` (float32: the slot's weight times its request's scale), ``(M,)`` each."""

    __slots__ = ("requests", "slots", "weights")

    def __init__(self, requests: np.ndarray, slots: np.ndarray, weights: np.ndarray) -> None:
        self.requests, self.slots, self.weights = requests, slots, weights


class Requests:
    """A validated batch description: tokens and slot per request (host NumPy int64 arrays),
    with the shortest and longest request (0 for an empty batch), each request's scale
    (float32, the multiplier of its adapter's delta), ``None`` when every scale is 1, and the
    further slots of its mixed requests (:class:`Mixes`), ``None`` when no request has two."""

    __slots__ = ("lens", "slots", "num_tokens", "min_len", "max_len", "scales", "mixes", "_lens_tuple",
                 "_slots_tuple")

    def __init__(self, lens: np.ndarray, slots: np.ndarray, num_tokens: int, min_len: int, max_len: int,
                 scales: np.ndarray | None = None, mixes: Mixes | None = None) -> None:
        self.lens, self.slots, self.num_tokens = lens, slots, num_tokens
        self.min_len, self.max_len = min_len, max_len
        self.scales, self.mixes = scales, mixes
        self._lens_tuple: tuple[int, ...] | None = None
        self._slots_tuple: tuple[int, ...] | None = None

    @property
    def lens_tuple(self) -> tuple[int, ...]:
        if self._lens_tuple is None:
            self._lens_tuple = tuple(self.lens.tolist())
        return self._lens_tuple

    @property
    def slots_tuple(self) -> tuple[int, ...]:
        if self._slots_tuple is None:
            self._slots_tuple = tuple(self.slots.tolist())
        return self._slots_tuple

    @property
    def is_one_token_each(self) -> bool:
        """Every non-empty request has one token (decode): the pruned LM-head rows equal the batch."""
        return self.max_len <= 1

    @property
    def num_pairs(self) -> int:
        """Pair rows beyond one per token: the further slots' (token, adapter) pairs."""
        return 0 if self.mixes is None else int(self.lens[self.mixes.requests].sum())

    def token_scales(self) -> np.ndarray:
        """``(num_tokens,)`` float32: each token's request scale (1 when none was given)."""
        if self.scales is None:
            return np.ones(self.num_tokens, dtype=np.float32)
        return self.scales if self.min_len == self.max_len == 1 else np.repeat(self.scales, self.lens)

    def further_slots(self) -> tuple[tuple[tuple[int, float], ...], ...]:
        """Each request's :class:`Mixes` entries, ``((slot, weight), ...)`` (empty for a request of one slot)."""
        further: list[list[tuple[int, float]]] = [[] for _ in range(len(self.lens))]
        if self.mixes is not None:
            mixes = self.mixes
            for request, slot, weight in zip(mixes.requests.tolist(), mixes.slots.tolist(), mixes.weights.tolist()):
                further[request].append((slot, weight))
        return tuple(map(tuple, further))

    def with_pair_rows(self) -> Requests:
        """The batch with its pair rows: these requests (their first slots, at their scales), then one
        request per :class:`Mixes` entry, with its request's tokens, the entry's slot, and the entry's
        weight as its scale. Its rows are the token rows, then the pair rows."""
        mixes = self.mixes
        if mixes is None:
            return self
        lens = np.concatenate([self.lens, self.lens[mixes.requests]])
        scales = np.concatenate([np.ones(len(self.lens), np.float32) if self.scales is None else self.scales,
                                 mixes.weights])
        return Requests(lens, np.concatenate([self.slots, mixes.slots]), self.num_tokens + self.num_pairs,
                        self.min_len, self.max_len,
                        None if (scales == 1).all() else scales)

    def pair_token_rows(self) -> np.ndarray:
        """``(num_tokens + num_pairs,)`` int64: the token row each row of :meth:`with_pair_rows` reads its
        input from and adds its delta to (a token row: itself)."""
        rows = np.arange(self.num_tokens, dtype=np.int64)
        if self.mixes is None:
            return rows
        lens = self.lens[self.mixes.requests]
        request_starts = np.cumsum(self.lens) - self.lens
        pair_starts = np.cumsum(lens) - lens
        pairs = np.arange(int(lens.sum()), dtype=np.int64) + np.repeat(request_starts[self.mixes.requests] - pair_starts,
                                                                       lens)
        return np.concatenate([rows, pairs])

    def last_tokens(self) -> Requests:
        """One single-token request per non-empty request, with its scale and mix: the rows a
        pruned LM head receives."""
        if self.min_len == self.max_len == 1:  # already one token each, none empty
            return self
        keep = self.lens > 0
        slots = self.slots[keep]
        n = int(slots.size)
        scales = None if self.scales is None else self.scales[keep]
        mixes = self.mixes
        if mixes is not None:
            kept = keep[mixes.requests]
            renumbered = np.cumsum(keep) - 1
            mixes = Mixes(renumbered[mixes.requests[kept]], mixes.slots[kept], mixes.weights[kept]) if kept.any() else None
        return Requests(np.ones_like(slots), slots, n, min(n, 1), min(n, 1), scales, mixes)


def merge_segments(requests: Requests) -> tuple[np.ndarray, np.ndarray]:
    """Adjacent non-empty requests on one slot merged: ``(seg_lens, seg_slots)``, int64."""
    lens, slots = requests.lens, requests.slots
    if requests.min_len == 0:  # drop empty requests (they hold no rows)
        keep = lens > 0
        lens, slots = lens[keep], slots[keep]
    if not lens.size:
        return lens, slots
    starts = np.empty(slots.shape, dtype=bool)
    starts[0] = True
    np.not_equal(slots[1:], slots[:-1], out=starts[1:])
    first = np.flatnonzero(starts)
    return np.add.reduceat(lens, first), slots[first]


def validate_requests(seq_lens: Sequence[int], slot_ids: Sequence[int | None | Mix], num_slots: int,
                      scales: Sequence[float] | None = None) -> Requests:
    """``seq_lens`` (ints >= 0), ``slot_ids`` (``None``, -1, a slot in ``[0, num_slots)`` or a weighted
    mix of slots: :func:`validate_mix`) and ``scales`` (:func:`validate_scales`), one entry per request,
    as :class:`Requests`; ``ValueError``/``TypeError`` naming the bad entry."""
    lens = _host_values("seq_lens", seq_lens)
    slots = _host_values("slot_ids", slot_ids)
    if len(lens) != len(slots):
        raise ValueError(
            f"seq_lens and slot_ids must have one entry per request; got {len(lens)} and {len(slots)}"
        )
    lens_array = plain_int_array(lens)
    bounds = None if lens_array is None else (int(lens_array.min()), int(lens_array.max()))
    if bounds is None or bounds[0] < 0:
        lens, lens_array = _int_values("seq_lens", lens, 0), None  # raises naming a bad length
        bounds = (min(lens, default=0), max(lens, default=0))
    min_len, max_len = bounds
    total = int(lens_array.sum()) if lens_array is not None and max_len <= MAX_TOKENS else sum(lens)
    if total > MAX_TOKENS:
        raise ValueError(f"seq_lens sum to {total} tokens, more than a batch can index (2**31 - 1)")
    if lens_array is None:
        lens_array = np.array(lens, dtype=np.int64)
    if None in slots:
        slots = [-1 if s is None else s for s in slots]
    slots_array = plain_int_array(slots)
    if slots_array is None or slots_array.min() < -1 or slots_array.max() >= num_slots:
        return _requests_with_mixes(lens_array, slots, num_slots, total, min_len, max_len, scales)
    return Requests(lens_array, slots_array, total, min_len, max_len, validate_scales(scales, len(lens_array)))


Mix = Mapping[int, float] | Sequence[tuple[int, float]]
"""A weighted mix of adapter slots: ``{slot: weight}``, or ``[(slot, weight), ...]``."""


def parse_mix(name: str, mix: object, describe: Callable[[object], str] = repr) -> list[tuple[object, float]]:
    """A weighted mix, ``{key: weight}`` or ``[(key, weight), ...]``, as ``[(key, weight), ...]`` in its
    order: at least one entry, each key (a slot, an adapter's name: the caller checks what it is) named
    once, each weight a finite float ``>= 0`` (finite in float32). ``ValueError`` that starts with
    ``name``; ``describe(key)`` names a key in it (``slot 1``, ``adapter 'math'``)."""
    if not isinstance(mix, (Mapping, list, tuple)):
        raise ValueError(f"{name}: a mix is {{key: weight}} or [(key, weight), ...], got {mix!r}")
    entries = list(mix.items()) if isinstance(mix, Mapping) else list(mix)
    if not entries:
        raise ValueError(f"{name}: a mix must name at least one adapter, got {mix!r}")
    pairs, seen = [], set()
    for entry in entries:
        if not isinstance(entry, (tuple, list)) or len(entry) != 2:
            raise ValueError(f"{name}: a mix is {{key: weight}} or [(key, weight), ...], got the entry {entry!r}")
        key, weight = entry
        try:
            if key in seen:
                raise ValueError(f"{name}: {describe(key)} is named twice in the mix")
            seen.add(key)
        except TypeError:  # an unhashable key: the caller's check of the key names it
            pass
        value = check_finite_float(f"{name}: the weight of {describe(key)}", weight, float32=True)
        if value < 0:
            raise ValueError(f"{name}: the weight of {describe(key)} must be >= 0, got {weight!r}")
        pairs.append((key, value))
    return pairs


def validate_mix(index: int, mix: object, num_slots: int) -> list[tuple[int, float]]:
    """Request ``index``'s mix of slots (:func:`parse_mix`) as ``[(slot, weight), ...]``, each slot in
    ``[0, num_slots)``. ``ValueError`` naming the request."""
    name = f"slot_ids[{index}] (request {index})"
    pairs = parse_mix(name, mix, lambda slot: f"slot {slot!r}")
    for slot, _ in pairs:
        if not is_int(slot) or not 0 <= slot < num_slots:
            raise ValueError(f"{name}: a mix names adapter slots in [0, {num_slots}), got {slot!r}")
    return [(int(slot), weight) for slot, weight in pairs]


def _requests_with_mixes(lens: np.ndarray, slots: Sequence, num_slots: int, total: int, min_len: int,
                         max_len: int, scales: Sequence[float] | None) -> Requests:
    """:func:`validate_requests` for ``slot_ids`` that are not all plain slots: each entry checked,
    naming the bad one; a mix's first slot is its request's slot at ``scale * weight``, each further
    slot an entry of :class:`Mixes` at ``scale * its weight``."""
    main, first_weights, mixed = [], [], []
    for i, entry in enumerate(slots):
        if entry is None or is_int(entry):
            if entry is not None and not -1 <= entry < num_slots:
                raise ValueError(f"slot_ids[{i}] must be None, -1, a slot in [0, {num_slots}) or a weighted mix "
                                 f"{{slot: weight}}, got {entry!r}")
            main.append(-1 if entry is None else int(entry))
            first_weights.append(1.0)
        elif isinstance(entry, (Mapping, list, tuple)):
            (slot, weight), *rest = validate_mix(i, entry, num_slots)
            main.append(slot)
            first_weights.append(weight)
            mixed += [(i, s, w) for s, w in rest]
        else:
            raise ValueError(f"slot_ids[{i}] must be None, -1, a slot in [0, {num_slots}) or a weighted mix "
                             f"{{slot: weight}}, got {entry!r}")
    request_scales = validate_scales(scales, len(lens))
    base = np.ones(len(lens)) if request_scales is None else request_scales.astype(np.float64)
    main_scales = _finite_products(base, np.array(first_weights), np.arange(len(lens)))
    mixes = None
    if mixed:
        requests, mix_slots, weights = (np.array(column) for column in zip(*mixed))
        mixes = Mixes(requests.astype(np.int64), mix_slots.astype(np.int64),
                      _finite_products(base[requests], weights, requests).astype(np.float32))
    return Requests(lens, np.array(main, dtype=np.int64), total, min_len, max_len,
                    None if (main_scales == 1).all() else main_scales.astype(np.float32), mixes)


def validate_scales(scales: Sequence[float] | None, num_requests: int) -> np.ndarray | None:
    """``scales``: one multiplier per request, each a finite float ``>= 0`` (finite in float32),
    or ``None`` (every request at scale 1); ``(num_requests,)`` float32, or ``None`` when every
    scale is 1. ``ValueError`` naming the bad request."""
    if scales is None:
        return None
    values = _host_values("scales", scales)
    if len(values) != num_requests:
        raise ValueError(f"scales must have one entry per request; got {len(values)} for {num_requests} requests")
    array = None
    if values and set(map(type, values)) <= {float, int}:
        try:
            array = np.array(values, dtype=np.float64)
        except OverflowError:  # an int too large for a float: checked one by one below
            array = None
    if array is None or not (np.isfinite(array).all() and (array >= 0).all() and array.max(initial=0) <= FLOAT32_MAX):
        for i, value in enumerate(values):
            if check_finite_float(f"scales[{i}] (request {i})", value, float32=True) < 0:
                raise ValueError(f"scales[{i}] (request {i}) must be >= 0, got {value!r}")
        array = np.array([float(v) for v in values], dtype=np.float64)
    return None if (array == 1).all() else array.astype(np.float32)


def validate_adapters(
    lora_ranks: Sequence[int], scalings: Sequence[float], *, max_rank: int | None
) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """Per-slot ``lora_ranks`` (ints in ``[0, max_rank]``) and ``scalings`` (finite in float32),
    one entry per slot each, as tuples of Python numbers."""
    ranks = _host_values("lora_ranks", lora_ranks)
    scales = _host_values("scalings", scalings)
    if len(ranks) != len(scales):
        raise ValueError(
            f"lora_ranks and scalings must have one entry per slot; got {len(ranks)} and {len(scales)}"
        )
    ranks = _int_values("lora_ranks", ranks, 0, MAX_TOKENS)  # int32 on the device
    for slot, rank in enumerate(ranks):
        if max_rank is not None and rank > max_rank:
            raise ValueError(f"lora_ranks[{slot}] = {rank} exceeds max_rank = {max_rank}")
    return tuple(ranks), _finite_float32_values(scales)


def _finite_products(scales: np.ndarray, weights: np.ndarray, requests: np.ndarray) -> np.ndarray:
    """``scales * weights`` (float64), each finite in float32, or ``ValueError`` naming the first request
    whose scale times a mix weight is not."""
    products = scales * weights
    bad = np.flatnonzero(products > FLOAT32_MAX)
    if bad.size:
        i = int(requests[bad[0]])
        raise ValueError(f"slot_ids[{i}] (request {i}): its scale times a mix weight, {products[bad[0]]:.3e}, "
                         "is not finite in float32")
    return products


def scales_need_with_scales(requests: Requests, scales: Sequence[float] | None, built: bool) -> str:
    """The refusal of ``requests``' scales by a graph-mode batch without request scales: naming the option,
    and the request when the scales come from a mix's weights rather than from ``scales``."""
    if validate_scales(scales, len(requests.lens)) is None:  # none given: a mix's weight is the scale
        i = int(np.flatnonzero(requests.scales != 1)[0])
        return (f"slot_ids[{i}] (request {i}): a mix's weights are request scales, which a graph-mode batch applies "
                "only when built with with_scales=True (MultiLoRA: enable_graph(..., scales=True) or max_pairs=)")
    if built:
        return ("scales: this graph-mode batch was built without request scales, so its captured ops do not apply "
                "them; build it with with_scales=True")
    return ("scales: a graph-mode batch applies request scales only when built with with_scales=True (its captured "
            "ops must hold the multiply)")


def check_capacity(requests: Requests, capacity: int) -> None:
    """``ValueError`` when ``requests`` hold more tokens than a graph-mode batch's ``capacity``."""
    if requests.num_tokens > capacity:
        raise ValueError(
            f"seq_lens sum to {requests.num_tokens} tokens, more than max_tokens = {capacity}"
        )


def _host_values(name: str, values: Sequence) -> list | tuple:
    """``values`` as a list or tuple of host numbers, read and never written (so not copied)."""
    if type(values) is list or type(values) is tuple:  # the common case, before the ABC checks below
        return values
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu":
            raise ValueError(
                f"{name} must be host data (a list or a CPU tensor), got a tensor on {values.device}; "
                "reading it would synchronize the device"
            )
        if values.dim() != 1:
            raise ValueError(f"{name} must be one-dimensional, got shape {tuple(values.shape)}")
        return values.tolist()
    if isinstance(values, (str, bytes, Mapping, Set)):  # unordered or not numbers: never a silent guess
        raise TypeError(f"{name} must be a sequence of numbers, got {type(values).__name__}")
    try:
        return list(values)
    except TypeError:
        raise TypeError(f"{name} must be a sequence, got {type(values).__name__}") from None


def _int_values(name: str, values: Sequence, minimum: int, maximum: int | None = None) -> Sequence[int]:
    """``values`` unchanged when they are plain ints in range; else each checked, naming the bad one."""
    if values and are_plain_ints(values):
        if min(values) >= minimum and (maximum is None or max(values) <= maximum):
            return values
    return [check_int(f"{name}[{i}]", v, minimum=minimum, maximum=maximum) for i, v in enumerate(values)]


def _finite_float32_values(scales: Sequence) -> tuple[float, ...]:
    """Scalings as Python floats, each finite in float32; vectorised for plain floats and ints."""
    if scales and set(map(type, scales)) <= {float, int}:
        try:
            values = np.array(scales, dtype=np.float64)
        except OverflowError:  # an int too large for a float: checked one by one below
            values = None
        if values is not None and np.isfinite(values).all() and np.abs(values).max() <= FLOAT32_MAX:
            return tuple(values.tolist())
    return tuple(check_finite_float(f"scalings[{slot}]", scale, float32=True) for slot, scale in enumerate(scales))
