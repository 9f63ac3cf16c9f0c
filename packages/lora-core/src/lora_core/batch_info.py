"""Per-batch segment and adapter-slot data shared by every LoRA op (SPEC §3).

A batch is a flattened sequence of ``T`` tokens made of requests; each request
uses one adapter slot (or none). :func:`build_batch_info` validates the
per-request description once, merges adjacent requests on the same slot into
segments, and derives everything an op needs for the whole batch:

* device tensors (``seg_lens``, ``seg_indptr``, ``weight_indices``,
  ``lora_ranks``, ``scalings``, ``token_slots``, ``token_perm``) for ops that
  run on the device, graph-captured ones included;
* host mirrors (plain CPU tensors) and a host *plan* of Python ints
  (:class:`TokenGroup`) for control-flow ops, so no op ever reads a device
  tensor on the host.

In graph mode (``use_graph=True``) the device tensors are allocated once for
``max_tokens`` and :meth:`BatchInfo.refill` rewrites them in place, keeping
their identity and addresses, so a captured graph replays on the new batch.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["BatchInfo", "TokenGroup", "build_batch_info", "block_size_for"]

# Control-flow ops gather the tokens of each slot (one GEMM per slot) instead of
# looping over segments when that saves GEMMs and segments are this short on average.
SLOT_GROUPING_MAX_MEAN_SEGMENT_LEN = 64
# Bounds of the token-block size used by graph-safe ops (see block_size_for).
MIN_BLOCK_SIZE, MAX_BLOCK_SIZE = 8, 256


def block_size_for(num_rows: int, num_slots: int) -> int:
    """Tokens per block for graph-safe ops: about half a slot's even share of the
    rows, as a power of two in ``[MIN_BLOCK_SIZE, MAX_BLOCK_SIZE]``.

    Every block holds tokens of one slot, so the padding is at most one block per
    slot: ``num_blocks = ceil(num_rows / b) + num_slots`` blocks of ``b`` rows.
    """
    share = max(1, num_rows // (2 * max(1, num_slots)))
    return min(MAX_BLOCK_SIZE, max(MIN_BLOCK_SIZE, 1 << (share.bit_length() - 1)))


@dataclass(frozen=True)
class TokenGroup:
    """A run of tokens that share one active adapter slot.

    ``start:end`` indexes the flattened batch when the group is a segment, or
    ``BatchInfo.token_perm`` when it is a slot group. ``rank`` and ``scaling``
    are the slot's, copied on the host so that ops never read them back.
    """

    slot: int
    rank: int
    scaling: float
    start: int
    end: int

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class _HostBatch:
    """Everything derived on the host from one validated batch description."""

    seq_lens: tuple[int, ...]
    slots: tuple[int, ...]
    seg_lens: tuple[int, ...]
    seg_slots: tuple[int, ...]
    token_slots: tuple[int, ...]
    token_perm: tuple[int, ...]
    segments: tuple[TokenGroup, ...]
    slot_groups: tuple[TokenGroup, ...]

    @property
    def num_real_tokens(self) -> int:
        return len(self.token_slots)

    @functools.cached_property
    def prefers_slot_groups(self) -> bool:
        if len(self.slot_groups) >= len(self.segments):
            return False
        active = sum(g.num_tokens for g in self.segments)
        return active / len(self.segments) < SLOT_GROUPING_MAX_MEAN_SEGMENT_LEN


class BatchInfo:
    """Segment/slot description of one batch; build it with :func:`build_batch_info`.

    Device tensors (on ``device``):
        seg_lens (S,) int32, seg_indptr (S+1,) int32, weight_indices (S,) int32
        (slot per segment, -1 = no adapter), lora_ranks (L,) int32,
        scalings (L,) float32, token_slots (T,) int32 (-1 = no adapter or padding),
        token_perm (P,) int64: the tokens of active slots, grouped by slot
        (control-flow ops only: it is reallocated every batch, never captured).
    Token blocks for graph-safe ops (static shapes: ``NB = ceil(T / b) + L``
    blocks of ``b = block_size`` rows, each on one slot; padding rows point at
    token 0 and are invalid): block_slots (NB,) int64, block_ranks (NB,) int32,
    block_scalings (NB,) float32, block_tokens (NB*b,) int64, block_valid (NB, b) bool.
    Tokens sorted by slot for grouped GEMMs (static ``T`` rows: active tokens
    grouped by slot, then the others): sorted_tokens (T,) int64, sorted_ranks (T,)
    int32 and sorted_scalings (T,) float32 (0 for rows without an adapter),
    group_ends (L,) int32 (end row of each slot's group; the last group also
    holds the rows without an adapter, so it ends at ``T``).
    Host mirrors: ``*_cpu`` CPU tensors of the same, and the plans
    ``segments`` / ``slot_groups`` (tuples of :class:`TokenGroup`, active slots only).

    In graph mode ``S`` and ``T`` are the preallocated capacity (``max_tokens``);
    unused segments have length 0 and slot -1, padding tokens slot -1.
    """

    def __init__(
        self,
        host: _HostBatch,
        lora_ranks: tuple[int, ...],
        scalings: tuple[float, ...],
        *,
        device: torch.device,
        use_graph: bool,
        capacity: int | None,
        _is_view: bool = False,
    ) -> None:
        self.device = device
        self.use_graph = use_graph
        self.capacity = capacity
        self.num_slots = len(lora_ranks)
        rows = capacity if use_graph else host.num_real_tokens
        self.block_size = block_size_for(rows, self.num_slots)
        self.num_blocks = -(-rows // self.block_size) + self.num_slots
        self._pin = device.type == "cuda" and torch.cuda.is_available()
        self._lm_head_view: BatchInfo | None = None
        self._set_adapters_host(lora_ranks, scalings)
        self._set_host(host)
        self._allocate_device_tensors()
        self._copy_host_to_device()
        if use_graph and not _is_view:
            self.lm_head_view(pruned=True)  # preallocated now: never built during a capture

    # ------------------------------------------------------------------ sizes
    @property
    def num_tokens(self) -> int:
        """Rows an op receives: the real token count, or the capacity in graph mode."""
        return self.capacity if self.use_graph else self._host.num_real_tokens

    @property
    def num_real_tokens(self) -> int:
        """Tokens that belong to requests (excludes graph-mode padding)."""
        return self._host.num_real_tokens

    @property
    def num_segments(self) -> int:
        """Segments of the current batch (not the graph-mode capacity)."""
        return len(self._host.seg_lens)

    @property
    def max_len(self) -> int:
        return max(self._host.seg_lens, default=0)

    @property
    def seq_lens(self) -> tuple[int, ...]:
        return self._host.seq_lens

    @property
    def request_slots(self) -> tuple[int, ...]:
        """Slot per request (-1 = no adapter), as given to the builder."""
        return self._host.slots

    @property
    def lora_ranks_host(self) -> tuple[int, ...]:
        return self._lora_ranks

    @property
    def scalings_host(self) -> tuple[float, ...]:
        return self._scalings

    # ------------------------------------------------------------------ plans
    @property
    def segments(self) -> tuple[TokenGroup, ...]:
        """Active segments (slot >= 0, rank > 0, non-empty) in batch order."""
        return self._host.segments

    @property
    def slot_groups(self) -> tuple[TokenGroup, ...]:
        """Active slots with their token ranges into ``token_perm``."""
        return self._host.slot_groups

    @property
    def prefers_slot_groups(self) -> bool:
        """Whether control ops should gather by slot rather than loop over segments:
        when that saves GEMMs and segments are short (decided once per batch)."""
        return self._host.prefers_slot_groups

    # --------------------------------------------------------------- updates
    def refill(self, seq_lens: Sequence[int], slot_ids: Sequence[int | None]) -> None:
        """Describe a new batch by rewriting the preallocated tensors in place (graph mode)."""
        if not self.use_graph:
            raise RuntimeError(
                "refill() needs a graph-mode BatchInfo (use_graph=True); "
                "eager batches are cheap to rebuild with build_batch_info()"
            )
        host = _plan_batch(seq_lens, slot_ids, self._lora_ranks, self._scalings)
        _check_capacity(host, self.capacity)
        self._set_host(host)
        self._copy_host_to_device()
        if self._lm_head_view is not None:
            self._lm_head_view.refill(*_last_token_request(host))

    def set_adapters(self, lora_ranks: Sequence[int], scalings: Sequence[float]) -> None:
        """Update per-slot ranks and scalings in place (after loading or evicting an adapter)."""
        ranks, scales = _validate_adapters(lora_ranks, scalings, max_rank=None)
        if len(ranks) != self.num_slots:
            raise ValueError(
                f"lora_ranks has {len(ranks)} slots; this BatchInfo was built for {self.num_slots}"
            )
        self._set_adapters_host(ranks, scales)
        host = _plan_batch(self._host.seq_lens, self._host.slots, ranks, scales)
        self._set_host(host)
        self._copy_host_to_device()
        if self._lm_head_view is not None:
            self._lm_head_view.set_adapters(ranks, scales)

    def lm_head_view(self, pruned: bool) -> BatchInfo:
        """Batch info for the rows that reach the LM head.

        ``pruned=False``: every token (decode, or a full-logits prefill): ``self``.
        ``pruned=True``: the last token of each non-empty request, in request order.
        The view is built once per batch (and refilled with it in graph mode).
        """
        if not pruned:
            return self
        if self._lm_head_view is None:
            seq_lens, slots = _last_token_request(self._host)
            self._lm_head_view = BatchInfo(
                _plan_batch(seq_lens, slots, self._lora_ranks, self._scalings),
                self._lora_ranks,
                self._scalings,
                device=self.device,
                use_graph=self.use_graph,
                capacity=self.capacity,
                _is_view=True,
            )
        return self._lm_head_view

    # -------------------------------------------------------------- internals
    def _set_adapters_host(self, lora_ranks: tuple[int, ...], scalings: tuple[float, ...]) -> None:
        self._lora_ranks = tuple(lora_ranks)
        self._scalings = tuple(scalings)
        self.lora_ranks_cpu = self._host_tensor(self._lora_ranks, torch.int32)
        self.scalings_cpu = self._host_tensor(self._scalings, torch.float32)

    def _set_host(self, host: _HostBatch) -> None:
        self._host = host
        n_seg = len(host.seg_lens)
        seg_pad = self.capacity - n_seg if self.use_graph else 0
        tok_pad = self.capacity - host.num_real_tokens if self.use_graph else 0
        seg_lens = host.seg_lens + (0,) * seg_pad
        indptr = [0]
        for n in seg_lens:
            indptr.append(indptr[-1] + n)
        self.seg_lens_cpu = self._host_tensor(seg_lens, torch.int32)
        self.seg_indptr_cpu = self._host_tensor(indptr, torch.int32)
        self.weight_indices_cpu = self._host_tensor(host.seg_slots + (-1,) * seg_pad, torch.int32)
        self.token_slots_cpu = self._host_tensor(host.token_slots + (-1,) * tok_pad, torch.int32)
        self.token_perm_cpu = self._host_tensor(host.token_perm, torch.int64)
        self._set_blocks_host(host)
        self._set_sorted_host(host)

    def _set_sorted_host(self, host: _HostBatch) -> None:
        rows = self.capacity if self.use_graph else host.num_real_tokens
        active = set(host.token_perm)
        rest = [t for t in range(host.num_real_tokens) if t not in active]
        pad = rows - host.num_real_tokens
        sorted_tokens, ranks, scalings = list(host.token_perm) + rest + [0] * pad, [], []
        for g in host.slot_groups:
            ranks.extend([g.rank] * g.num_tokens)
            scalings.extend([g.scaling] * g.num_tokens)
        inactive = rows - len(ranks)
        ends, end, groups = [], 0, {g.slot: g for g in host.slot_groups}
        for slot in range(self.num_slots):
            end += groups[slot].num_tokens if slot in groups else 0
            ends.append(end)
        # rows without an adapter join the last group: every row is computed, and
        # their zeroed (masked) inputs give exactly zero deltas
        ends[-1] = rows
        self.sorted_tokens_cpu = self._host_tensor(sorted_tokens, torch.int64)
        self.sorted_ranks_cpu = self._host_tensor(ranks + [0] * inactive, torch.int32)
        self.sorted_scalings_cpu = self._host_tensor(scalings + [0.0] * inactive, torch.float32)
        self.group_ends_cpu = self._host_tensor(ends, torch.int32)

    def _set_blocks_host(self, host: _HostBatch) -> None:
        b, nb = self.block_size, self.num_blocks
        slots, ranks, scalings, tokens, valid = [], [], [], [], []
        for g in host.slot_groups:
            members = host.token_perm[g.start : g.end]
            for i in range(0, len(members), b):
                chunk = list(members[i : i + b])
                slots.append(g.slot)
                ranks.append(g.rank)
                scalings.append(g.scaling)
                tokens.extend(chunk + [0] * (b - len(chunk)))
                valid.extend([True] * len(chunk) + [False] * (b - len(chunk)))
        pad = nb - len(slots)
        assert pad >= 0, "block plan exceeds its static bound"  # ceil(T/b) + L always suffices
        self.block_slots_cpu = self._host_tensor(slots + [0] * pad, torch.int64)
        self.block_ranks_cpu = self._host_tensor(ranks + [0] * pad, torch.int32)
        self.block_scalings_cpu = self._host_tensor(scalings + [0.0] * pad, torch.float32)
        self.block_tokens_cpu = self._host_tensor(tokens + [0] * (pad * b), torch.int64)
        self.block_valid_cpu = self._host_tensor(valid + [False] * (pad * b), torch.bool).view(nb, b)

    def _allocate_device_tensors(self) -> None:
        def like(host: torch.Tensor) -> torch.Tensor:
            return torch.empty(host.shape, dtype=host.dtype, device=self.device)

        self.seg_lens = like(self.seg_lens_cpu)
        self.seg_indptr = like(self.seg_indptr_cpu)
        self.weight_indices = like(self.weight_indices_cpu)
        self.token_slots = like(self.token_slots_cpu)
        self.lora_ranks = like(self.lora_ranks_cpu)
        self.scalings = like(self.scalings_cpu)
        for name in _BLOCK_TENSORS:
            setattr(self, name, like(getattr(self, name + "_cpu")))

    def _copy_host_to_device(self) -> None:
        for name in _STATIC_TENSORS + _BLOCK_TENSORS:
            getattr(self, name).copy_(getattr(self, name + "_cpu"), non_blocking=self._pin)
        # token_perm has a data-dependent length: it serves control-flow ops only,
        # which never run under capture, so it is a fresh tensor every batch.
        self.token_perm = self.token_perm_cpu.to(self.device, non_blocking=self._pin)

    def _host_tensor(self, values: Sequence[int | float], dtype: torch.dtype) -> torch.Tensor:
        tensor = torch.tensor(values, dtype=dtype)
        return tensor.pin_memory() if self._pin else tensor

    def __repr__(self) -> str:
        mode = f"graph, capacity={self.capacity}" if self.use_graph else "eager"
        return (
            f"BatchInfo({mode}, tokens={self.num_real_tokens}, segments={self.num_segments}, "
            f"slots={self.num_slots}, device={self.device})"
        )


_STATIC_TENSORS = ("seg_lens", "seg_indptr", "weight_indices", "token_slots", "lora_ranks", "scalings")
_BLOCK_TENSORS = ("block_slots", "block_ranks", "block_scalings", "block_tokens", "block_valid",
                  "sorted_tokens", "sorted_ranks", "sorted_scalings", "group_ends")


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
        scalings: scaling per slot (``L`` finite floats), host data.
        device: where the device tensors live.
        use_graph: preallocate for ``max_tokens`` and allow :meth:`BatchInfo.refill`.
        max_tokens: graph-mode capacity (required with ``use_graph``).
        max_rank: when given, every rank must be <= it (the buffers' ``R``).
    """
    device = torch.device(device)
    ranks, scales = _validate_adapters(lora_ranks, scalings, max_rank=max_rank)
    host = _plan_batch(seq_lens, slot_ids, ranks, scales)
    if use_graph:
        if max_tokens is None or isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
            raise ValueError(f"max_tokens must be a positive int with use_graph=True, got {max_tokens!r}")
        if max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive int with use_graph=True, got {max_tokens}")
        _check_capacity(host, max_tokens)
    elif max_tokens is not None:
        raise ValueError("max_tokens is only meaningful with use_graph=True")
    return BatchInfo(host, ranks, scales, device=device, use_graph=use_graph, capacity=max_tokens)


# ---------------------------------------------------------------------- helpers
def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _host_values(name: str, values: Sequence) -> list:
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu":
            raise ValueError(
                f"{name} must be host data (a list or a CPU tensor), got a tensor on {values.device}; "
                "reading it would synchronize the device"
            )
        if values.dim() != 1:
            raise ValueError(f"{name} must be one-dimensional, got shape {tuple(values.shape)}")
        return values.tolist()
    try:
        return list(values)
    except TypeError:
        raise TypeError(f"{name} must be a sequence, got {type(values).__name__}") from None


def _validate_adapters(
    lora_ranks: Sequence[int], scalings: Sequence[float], *, max_rank: int | None
) -> tuple[tuple[int, ...], tuple[float, ...]]:
    ranks = _host_values("lora_ranks", lora_ranks)
    scales = _host_values("scalings", scalings)
    if len(ranks) != len(scales):
        raise ValueError(
            f"lora_ranks and scalings must have one entry per slot; got {len(ranks)} and {len(scales)}"
        )
    for slot, rank in enumerate(ranks):
        if not _is_int(rank) or rank < 0:
            raise ValueError(f"lora_ranks[{slot}] must be an int >= 0, got {rank!r}")
        if max_rank is not None and rank > max_rank:
            raise ValueError(f"lora_ranks[{slot}] = {rank} exceeds max_rank = {max_rank}")
    for slot, scale in enumerate(scales):
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
            raise ValueError(f"scalings[{slot}] must be a finite float, got {scale!r}")
    return tuple(ranks), tuple(float(s) for s in scales)


def _plan_batch(
    seq_lens: Sequence[int],
    slot_ids: Sequence[int | None],
    lora_ranks: tuple[int, ...],
    scalings: tuple[float, ...],
) -> _HostBatch:
    lens = _host_values("seq_lens", seq_lens)
    slots_in = _host_values("slot_ids", slot_ids)
    if len(lens) != len(slots_in):
        raise ValueError(
            f"seq_lens and slot_ids must have one entry per request; got {len(lens)} and {len(slots_in)}"
        )
    num_slots = len(lora_ranks)
    slots: list[int] = []
    for i, (n, slot) in enumerate(zip(lens, slots_in)):
        if not _is_int(n) or n < 0:
            raise ValueError(f"seq_lens[{i}] must be an int >= 0, got {n!r}")
        slot = -1 if slot is None else slot
        if not _is_int(slot) or not -1 <= slot < num_slots:
            raise ValueError(
                f"slot_ids[{i}] must be None, -1 or a slot in [0, {num_slots}), got {slot!r}"
            )
        slots.append(slot)

    seg_lens: list[int] = []
    seg_slots: list[int] = []
    for n, slot in zip(lens, slots):
        if n == 0:
            continue
        if seg_slots and seg_slots[-1] == slot:
            seg_lens[-1] += n
        else:
            seg_lens.append(n)
            seg_slots.append(slot)

    token_slots: list[int] = []
    segments: list[TokenGroup] = []
    for n, slot in zip(seg_lens, seg_slots):
        start = len(token_slots)
        token_slots.extend([slot] * n)
        if slot >= 0 and lora_ranks[slot] > 0:
            segments.append(TokenGroup(slot, lora_ranks[slot], scalings[slot], start, start + n))

    by_slot: dict[int, list[int]] = {}
    for g in segments:
        by_slot.setdefault(g.slot, []).extend(range(g.start, g.end))
    token_perm: list[int] = []
    slot_groups: list[TokenGroup] = []
    for slot in sorted(by_slot):
        start = len(token_perm)
        token_perm.extend(by_slot[slot])
        slot_groups.append(TokenGroup(slot, lora_ranks[slot], scalings[slot], start, len(token_perm)))

    return _HostBatch(
        seq_lens=tuple(lens),
        slots=tuple(slots),
        seg_lens=tuple(seg_lens),
        seg_slots=tuple(seg_slots),
        token_slots=tuple(token_slots),
        token_perm=tuple(token_perm),
        segments=tuple(segments),
        slot_groups=tuple(slot_groups),
    )


def _check_capacity(host: _HostBatch, capacity: int) -> None:
    if host.num_real_tokens > capacity:
        raise ValueError(
            f"seq_lens sum to {host.num_real_tokens} tokens, more than max_tokens = {capacity}"
        )


def _last_token_request(host: _HostBatch) -> tuple[list[int], list[int]]:
    """One row per non-empty request: the rows a pruned LM head receives."""
    kept = [slot for n, slot in zip(host.seq_lens, host.slots) if n > 0]
    return [1] * len(kept), kept
