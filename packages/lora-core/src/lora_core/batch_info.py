"""The batch: requests, their segments and adapter slots, shared by every LoRA op.

A batch is a flattened sequence of ``T`` tokens made of requests; each request
uses one adapter slot (or none). :func:`build_batch_info` validates the
per-request description once, merges adjacent requests on the same slot into
segments and publishes, on the device:

* ``seg_lens`` (S,), ``seg_indptr`` (S+1,), ``weight_indices`` (S,) (slot per
  segment, -1 = no adapter) and ``token_slots`` (T,) (-1 = no adapter or
  padding), all int32;
* ``lora_ranks`` (L,) int32 and ``scalings`` (L,) float32, per slot;

with host mirrors (``*_cpu``: CPU tensors of the same values), so that nothing
on the host ever reads a device tensor back. The layout and math these describe
are in docs/layout.md.

Kernel-specific plans (tokens sorted by slot, token blocks, a host loop plan)
are not built here: each kernel family owns a :class:`~lora_core.plans.BatchPlan`
that :meth:`BatchInfo.plan` builds on first request and keeps in step with the
batch.

In graph mode (``use_graph=True``) every device tensor is allocated once for
``max_tokens`` and :meth:`BatchInfo.refill` rewrites it in place, keeping its
identity and address, so a captured graph replays on the new batch
(docs/graph-rules.md). All planning is a few tensor ops per batch: no Python
loop runs over tokens, and loops over requests only validate their arguments.
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from typing import Callable, Sequence, TypeVar

import numpy as np
import torch

from .checks import FLOAT32_MAX, allocating, check_bool, check_device, check_finite_float, check_int, is_int
from .graphs import is_capturing
from .plans import BatchPlan
from .staging import StagedTensors

__all__ = ["BatchInfo", "build_batch_info"]

PlanT = TypeVar("PlanT", bound=BatchPlan)
T_co = TypeVar("T_co")

_MAX_TOKENS = 2**31 - 1  # token and segment offsets are int32 on the device


class _Requests:
    """A validated batch description: tokens and slot per request (host NumPy int64 arrays),
    with the shortest and longest request (0 for an empty batch)."""

    __slots__ = ("lens", "slots", "num_tokens", "min_len", "max_len", "_lens_tuple", "_slots_tuple")

    def __init__(self, lens: np.ndarray, slots: np.ndarray, num_tokens: int, min_len: int, max_len: int) -> None:
        self.lens, self.slots, self.num_tokens = lens, slots, num_tokens
        self.min_len, self.max_len = min_len, max_len
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
        """Every non-empty request has one token (decode): the pruned LM-head view equals the batch."""
        return self.max_len <= 1

    def last_tokens(self) -> _Requests:
        """One single-token request per non-empty request: the rows a pruned LM head receives."""
        if self.min_len == self.max_len == 1:  # already one token each, none empty
            return self
        slots = self.slots[self.lens > 0]
        n = int(slots.size)
        return _Requests(np.ones_like(slots), slots, n, min(n, 1), min(n, 1))


def _merge_segments(requests: _Requests) -> tuple[np.ndarray, np.ndarray]:
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


def _adapter_fields(num_slots: int) -> dict:
    return {"lora_ranks": ((num_slots,), torch.int32), "scalings": ((num_slots,), torch.float32)}


def _batch_fields(num_segments: int, num_rows: int) -> dict:
    return {
        "seg_lens": ((num_segments,), torch.int32),
        "seg_indptr": ((num_segments + 1,), torch.int32),
        "weight_indices": ((num_segments,), torch.int32),
        "token_slots": ((num_rows,), torch.int32),
    }


class _Published:
    """A device tensor (``name``) or its host mirror (``name_cpu``) of a :class:`StagedTensors`."""

    def __init__(self, staged: str, host: bool = False) -> None:
        self.staged, self.host = staged, host

    def __set_name__(self, owner: type, name: str) -> None:
        self.field = name[: -len("_cpu")] if self.host else name

    def __get__(self, obj: object, owner: type | None = None) -> torch.Tensor:
        staged: StagedTensors = getattr(obj, self.staged)
        return (staged.published if self.host else staged.device)[self.field]


class BatchInfo:
    """Segment/slot description of one batch; build it with :func:`build_batch_info`.

    Device tensors (on ``device``), with host mirrors ``<name>_cpu``:
        seg_lens (S,) int32, seg_indptr (S+1,) int32, weight_indices (S,) int32
        (slot per segment, -1 = no adapter), token_slots (T,) int32 (-1 = no
        adapter or padding), lora_ranks (L,) int32, scalings (L,) float32.

    In graph mode ``S`` and ``T`` are the preallocated capacity (``max_tokens``);
    unused segments have length 0 and slot -1, padding tokens slot -1.
    Kernel plans: :meth:`plan`.
    """

    seg_lens = _Published("_batch")
    seg_indptr = _Published("_batch")
    weight_indices = _Published("_batch")
    token_slots = _Published("_batch")
    lora_ranks = _Published("_adapters")
    scalings = _Published("_adapters")
    seg_lens_cpu = _Published("_batch", host=True)
    seg_indptr_cpu = _Published("_batch", host=True)
    weight_indices_cpu = _Published("_batch", host=True)
    token_slots_cpu = _Published("_batch", host=True)
    lora_ranks_cpu = _Published("_adapters", host=True)
    scalings_cpu = _Published("_adapters", host=True)

    def __init__(
        self,
        requests: _Requests,
        lora_ranks: tuple[int, ...],
        scalings: tuple[float, ...],
        *,
        device: torch.device,
        use_graph: bool,
        capacity: int | None,
        max_rank: int | None = None,
    ) -> None:
        self.device = device
        self.max_rank = max_rank
        self.use_graph = use_graph
        self.capacity = capacity
        self.num_slots = len(lora_ranks)
        self._plans: dict[type[BatchPlan], BatchPlan] = {}
        self._derived: dict[str, object] = {}
        self._lm_head_view: BatchInfo | None = None
        self._lora_ranks, self._scalings = lora_ranks, scalings
        self._slot_ranks_scalings: tuple[np.ndarray, np.ndarray] | None = None
        if use_graph:  # adapters and batch are rewritten independently, each in place
            self._adapters = allocating(f"lora_ranks ({self.num_slots} slots)", lambda: StagedTensors(
                _adapter_fields(self.num_slots), device, double_buffered=True))
            self._publish_adapters(lora_ranks, scalings)
            self._batch = allocating(f"max_tokens = {capacity}", lambda: StagedTensors(
                _batch_fields(capacity, capacity), device, double_buffered=True))
        self._publish_batch(requests)  # eager: batch and adapters in one buffer, one upload

    # ------------------------------------------------------------------ sizes
    @property
    def num_tokens(self) -> int:
        """Rows an op receives: the real token count, or the capacity in graph mode."""
        return self.capacity if self.use_graph else self._requests.num_tokens

    @property
    def num_real_tokens(self) -> int:
        """Tokens that belong to requests (excludes graph-mode padding)."""
        return self._requests.num_tokens

    @property
    def num_segments(self) -> int:
        """Segments of the current batch (not the graph-mode capacity)."""
        return self._num_segments

    @property
    def segments_host(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(seg_lens, seg_slots, seg_starts)`` of the current batch's segments as int64
        NumPy arrays (``S`` each; read-only by convention): what host planning reads."""
        return self._segments

    @property
    def max_len(self) -> int:
        """The longest segment of the current batch (0 for an empty batch)."""
        return int(self.seg_lens_cpu[: self._num_segments].max()) if self._num_segments else 0

    @property
    def seq_lens(self) -> tuple[int, ...]:
        """Tokens per request, as given to the builder."""
        return self._requests.lens_tuple

    @property
    def request_slots(self) -> tuple[int, ...]:
        """Slot per request (-1 = no adapter), as given to the builder."""
        return self._requests.slots_tuple

    @property
    def slot_ranks_scalings_host(self) -> tuple[np.ndarray, np.ndarray]:
        """Rank and scaling per slot as NumPy arrays (int32, float32) of ``L + 1`` entries, which
        host planning indexes with slot arrays: the last entry, the one slot ``-1`` reads, is the
        base model's (rank 0, scaling 0), and a slot of rank 0 has scaling 0. Read-only by convention."""
        if self._slot_ranks_scalings is None:
            ranks = np.array((*self._lora_ranks, 0), dtype=np.int32)
            scalings = np.array((*self._scalings, 0.0), dtype=np.float32)
            scalings[ranks == 0] = 0.0
            self._slot_ranks_scalings = (ranks, scalings)
        return self._slot_ranks_scalings

    @property
    def lora_ranks_host(self) -> tuple[int, ...]:
        return self._lora_ranks

    @property
    def scalings_host(self) -> tuple[float, ...]:
        return self._scalings

    # ------------------------------------------------------------------ plans
    def plan(self, plan_type: type[PlanT]) -> PlanT:
        """The ``plan_type`` plan of this batch, built on first request and refilled with the batch.

        Raises ``RuntimeError`` when the plan would first be built during a graph
        capture (building reads host data that the graph would bake in): build
        it before capturing, as ``LoRABackend.prepare_batch`` does.
        """
        plan = self._plans.get(plan_type)
        if plan is None:
            if is_capturing():
                raise RuntimeError(
                    f"{plan_type.__name__} of this batch was not built before the graph capture; call "
                    "backend.prepare_batch(batch_info), or run the step once, before capturing"
                )
            plan = self._plans[plan_type] = plan_type.build(self)
            if self._lm_head_view is not None:
                self._lm_head_view.plan(plan_type)
        return plan  # type: ignore[return-value]

    def derived(self, key: str, compute: Callable[[BatchInfo], T_co]) -> T_co:
        """``compute(self)``, memoised until the batch or its adapters change: host-side
        values that several plans of one batch share (e.g. the rows ordered by slot)."""
        if key not in self._derived:
            self._derived[key] = compute(self)
        return self._derived[key]  # type: ignore[return-value]

    @property
    def plan_types(self) -> tuple[type[BatchPlan], ...]:
        """The plans built for this batch so far (only those some kernel asked for)."""
        return tuple(self._plans)

    # --------------------------------------------------------------- updates
    def refill(self, seq_lens: Sequence[int], slot_ids: Sequence[int | None]) -> None:
        """Describe a new batch by rewriting the preallocated tensors in place (graph mode).

        A rejected batch (bad values, more tokens than ``max_tokens``) changes nothing.
        """
        if not self.use_graph:
            raise RuntimeError(
                "refill() needs a graph-mode BatchInfo (use_graph=True); "
                "eager batches are cheap to rebuild with build_batch_info()"
            )
        requests = _validate_requests(seq_lens, slot_ids, self.num_slots)
        _check_capacity(requests, self.capacity)
        self._publish_batch(requests)
        self._refill_dependents()

    def set_adapters(self, lora_ranks: Sequence[int], scalings: Sequence[float]) -> None:
        """Update per-slot ranks and scalings in place (after loading or evicting an adapter).

        A rejected call changes nothing.
        """
        ranks, scales = _validate_adapters(lora_ranks, scalings, max_rank=self.max_rank)
        if len(ranks) != self.num_slots:
            raise ValueError(
                f"lora_ranks has {len(ranks)} slots; this BatchInfo was built for {self.num_slots}"
            )
        self._publish_adapters(ranks, scales)
        if self._lm_head_view is not None:
            self._lm_head_view._publish_adapters(ranks, scales)
            self._lm_head_view._derived = {}
        self._refill_dependents()

    def lm_head_view(self, pruned: bool) -> BatchInfo:
        """Batch info for the rows that reach the LM head.

        ``pruned=False``: every token (decode, or a full-logits prefill): ``self``.
        ``pruned=True``: the last token of each non-empty request, in request order.
        The view is built once per batch, with the plans built for this batch
        (and, in graph mode, preallocated with it and refilled with it).
        """
        if not check_bool("pruned", pruned):
            return self
        if self._lm_head_view is None:
            if is_capturing():
                raise RuntimeError("the pruned LM-head view was not built before the graph capture")
            view = BatchInfo(self._requests.last_tokens(), self._lora_ranks, self._scalings, device=self.device,
                             use_graph=self.use_graph, capacity=self.capacity, max_rank=self.max_rank)
            for plan_type in self._plans:
                view.plan(plan_type)
            self._lm_head_view = view
        return self._lm_head_view

    # -------------------------------------------------------------- internals
    def _publish_adapters(self, lora_ranks: tuple[int, ...], scalings: tuple[float, ...]) -> None:
        host = self._adapters.host_arrays
        host["lora_ranks"][:] = lora_ranks
        host["scalings"][:] = scalings
        self._adapters.upload()
        self._lora_ranks, self._scalings = tuple(lora_ranks), tuple(scalings)
        self._slot_ranks_scalings = None
        self._derived = {}

    def _publish_batch(self, requests: _Requests) -> None:
        seg_lens, seg_slots = _merge_segments(requests)
        S, T = seg_lens.size, requests.num_tokens
        if not self.use_graph:  # built once per eager batch, with the adapters' fields
            self._batch = self._adapters = allocating(f"seq_lens ({T} tokens)", lambda: StagedTensors(
                {**_batch_fields(S, T), **_adapter_fields(self.num_slots)}, self.device))
            self._adapters.host_arrays["lora_ranks"][:] = self._lora_ranks
            self._adapters.host_arrays["scalings"][:] = self._scalings
        host = self._batch.host_arrays
        host["seg_lens"][:S] = seg_lens
        host["seg_lens"][S:] = 0
        indptr = host["seg_indptr"]
        indptr[0] = 0
        np.cumsum(seg_lens, out=indptr[1 : S + 1], dtype=np.int32)
        indptr[S + 1 :] = T
        host["weight_indices"][:S] = seg_slots
        host["weight_indices"][S:] = -1
        host["token_slots"][:T] = seg_slots if S == T else np.repeat(seg_slots, seg_lens)
        host["token_slots"][T:] = -1
        self._batch.upload()
        self._requests, self._num_segments = requests, S
        self._segments = (seg_lens, seg_slots, indptr[:S].astype(np.int64))
        self._derived = {}
        if self.use_graph and self._lm_head_view is not None:
            self._lm_head_view._publish_view_of(self)

    def _publish_view_of(self, batch: BatchInfo) -> None:
        """Graph mode: publish the pruned LM-head view of ``batch``. When every request has
        one token (decode) the view is the same batch: its bytes are copied, not re-planned."""
        requests = batch._requests.last_tokens()
        if not batch._requests.is_one_token_each:
            self._publish_batch(requests)
            return
        self._batch.copy_published(batch._batch)
        self._requests, self._num_segments, self._segments = requests, batch._num_segments, batch._segments
        self._derived = batch._derived  # equal host data: the same derived values

    def _refill_dependents(self) -> None:
        for plan in self._plans.values():
            plan.refill(self)
        view = self._lm_head_view
        if view is None:
            return
        if not self.use_graph:  # eager: rebuilt from the current batch when next asked for
            self._lm_head_view = None
        elif self._requests.is_one_token_each:
            for plan_type, plan in view._plans.items():
                plan.refill_from(view, self._plans[plan_type])
        else:
            view._refill_dependents()

    def __repr__(self) -> str:
        mode = f"graph, capacity={self.capacity}" if self.use_graph else "eager"
        return (
            f"BatchInfo({mode}, tokens={self.num_real_tokens}, segments={self.num_segments}, "
            f"slots={self.num_slots}, device={self.device})"
        )


def build_batch_info(
    seq_lens: Sequence[int],
    slot_ids: Sequence[int | None],
    lora_ranks: Sequence[int],
    scalings: Sequence[float],
    *,
    device: torch.device | str,
    use_graph: bool = False,
    max_tokens: int | None = None,
    max_rank: int | None = None,
) -> BatchInfo:
    """Validate a batch description and build its :class:`BatchInfo`.

    Args:
        seq_lens: tokens per request (ints >= 0); they sum to the token count ``T``.
        slot_ids: adapter slot per request; ``None`` or ``-1`` means the base model.
        lora_ranks: rank per slot (``L`` ints, 0 = empty slot), host data.
        scalings: scaling per slot (``L`` floats, finite in float32), host data.
        device: where the device tensors live.
        use_graph: preallocate for ``max_tokens`` and allow :meth:`BatchInfo.refill`.
        max_tokens: graph-mode capacity (required with ``use_graph``).
        max_rank: when given, every rank must be <= it (the buffers' ``R``).
    """
    use_graph = check_bool("use_graph", use_graph)
    if max_rank is not None:
        max_rank = check_int("max_rank", max_rank, minimum=0)
    if use_graph:
        if max_tokens is None or not is_int(max_tokens) or not 0 < max_tokens <= _MAX_TOKENS:
            raise ValueError(f"max_tokens must be a positive int <= 2**31 - 1 (token offsets are int32) "
                             f"with use_graph=True, got {max_tokens!r}")
        max_tokens = int(max_tokens)
    elif max_tokens is not None:
        raise ValueError(f"max_tokens is only meaningful with use_graph=True, got max_tokens = {max_tokens!r}")
    ranks, scales = _validate_adapters(lora_ranks, scalings, max_rank=max_rank)
    requests = _validate_requests(seq_lens, slot_ids, len(ranks))
    if use_graph:
        _check_capacity(requests, max_tokens)
    device = _check_device(device)
    info = BatchInfo(requests, ranks, scales, device=device, use_graph=use_graph, capacity=max_tokens,
                     max_rank=max_rank)
    if use_graph:
        info.lm_head_view(pruned=True)  # preallocated now: never built during a capture
    return info


# ---------------------------------------------------------------------- validation
def _check_device(device: torch.device | str) -> torch.device:
    return check_device("device", device)


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
    """Fast path for plain ints (the type check runs in C); element-wise checks otherwise."""
    if values and set(map(type, values)) == {int}:
        if min(values) >= minimum and (maximum is None or max(values) <= maximum):
            return values
    return [check_int(f"{name}[{i}]", v, minimum=minimum, maximum=maximum) for i, v in enumerate(values)]


def _validate_adapters(
    lora_ranks: Sequence[int], scalings: Sequence[float], *, max_rank: int | None
) -> tuple[tuple[int, ...], tuple[float, ...]]:
    ranks = _host_values("lora_ranks", lora_ranks)
    scales = _host_values("scalings", scalings)
    if len(ranks) != len(scales):
        raise ValueError(
            f"lora_ranks and scalings must have one entry per slot; got {len(ranks)} and {len(scales)}"
        )
    ranks = _int_values("lora_ranks", ranks, 0, _MAX_TOKENS)  # int32 on the device
    for slot, rank in enumerate(ranks):
        if max_rank is not None and rank > max_rank:
            raise ValueError(f"lora_ranks[{slot}] = {rank} exceeds max_rank = {max_rank}")
    return tuple(ranks), _finite_float32_values(scales)


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


def _plain_int_array(values: Sequence) -> np.ndarray | None:
    """``values`` as int64 when all are plain Python ints that fit (the type check runs in C),
    else ``None``: the caller then checks them one by one, naming the bad one."""
    if not values or set(map(type, values)) != {int}:
        return None
    try:
        return np.array(values, dtype=np.int64)
    except OverflowError:
        return None


def _validate_requests(seq_lens: Sequence[int], slot_ids: Sequence[int | None], num_slots: int) -> _Requests:
    lens = _host_values("seq_lens", seq_lens)
    slots = _host_values("slot_ids", slot_ids)
    if len(lens) != len(slots):
        raise ValueError(
            f"seq_lens and slot_ids must have one entry per request; got {len(lens)} and {len(slots)}"
        )
    lens_array = _plain_int_array(lens)
    bounds = None if lens_array is None else (int(lens_array.min()), int(lens_array.max()))
    if bounds is None or bounds[0] < 0:
        lens, lens_array = _int_values("seq_lens", lens, 0), None  # raises naming a bad length
        bounds = (min(lens, default=0), max(lens, default=0))
    min_len, max_len = bounds
    total = int(lens_array.sum()) if lens_array is not None and max_len <= _MAX_TOKENS else sum(lens)
    if total > _MAX_TOKENS:
        raise ValueError(f"seq_lens sum to {total} tokens, more than a batch can index (2**31 - 1)")
    if lens_array is None:
        lens_array = np.array(lens, dtype=np.int64)
    if None in slots:
        slots = [-1 if s is None else s for s in slots]
    slots_array = _plain_int_array(slots)
    if slots_array is None or slots_array.min() < -1 or slots_array.max() >= num_slots:
        for i, s in enumerate(slots):
            if not is_int(s) or not -1 <= s < num_slots:
                raise ValueError(f"slot_ids[{i}] must be None, -1 or a slot in [0, {num_slots}), got {s!r}")
        slots_array = np.array([int(s) for s in slots], dtype=np.int64)
    return _Requests(lens_array, slots_array, total, min_len, max_len)


def _check_capacity(requests: _Requests, capacity: int) -> None:
    if requests.num_tokens > capacity:
        raise ValueError(
            f"seq_lens sum to {requests.num_tokens} tokens, more than max_tokens = {capacity}"
        )
