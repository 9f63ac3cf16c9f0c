"""The batch: requests, their segments and adapter slots, shared by every LoRA op.

A batch is a flattened sequence of ``T`` tokens made of requests; each request
uses one adapter slot (or none), or a weighted mix of slots. :func:`build_batch_info` validates the
per-request description once, merges adjacent requests on the same slot into
segments and publishes, on the device:

* ``seg_lens`` (S,), ``seg_indptr`` (S+1,), ``weight_indices`` (S,) (slot per
  segment, -1 = no adapter) and ``token_slots`` (T,) (-1 = no adapter or
  padding), all int32, and ``token_scales`` (T,) float32 (each token's request
  scale, the multiplier of its adapter's delta: 1 unless the caller gave ``scales``);
* ``lora_ranks`` (L,) int32 and ``scalings`` (L,) float32, per slot;

with host mirrors (``*_cpu``: CPU tensors of the same values), so that nothing
on the host ever reads a device tensor back. The layout and math these describe
are in docs/layout.md.

A batch info is the batch and nothing else: its requests are validated by
:mod:`lora_core.batch_requests`; kernel-specific plans (tokens sorted by slot,
token blocks, a host loop plan) are each kernel family's
:class:`~lora_core.plans.BatchPlan`, kept in the batch's
:class:`~lora_core.plans.PlanCache` (``BatchInfo.plans``), which the batch tells
when it changes; the rows of a pruned LM head are a batch of their own, owned by
:class:`~lora_core.lm_head_rows.LMHeadRows`, and so are the token and (token, adapter)
pair rows of a batch with weighted mixes, owned by :class:`~lora_core.pair_rows.PairRows`.

In graph mode (``use_graph=True``) every device tensor is allocated once for
``max_tokens`` and :meth:`BatchInfo.refill` rewrites it in place, keeping its
identity and address, so a captured graph replays on the new batch
(docs/graph-rules.md). All planning is a few tensor ops per batch: no Python
loop runs over tokens, and loops over requests only validate their arguments.
"""

from __future__ import annotations

from typing import Sequence, TypeVar

import numpy as np
import torch

from .batch_requests import (Requests, check_capacity, merge_segments, scales_need_with_scales, validate_adapters,
                             validate_requests)
from .checks import allocating, check_bool
from .graphs import is_capturing
from .lm_head_rows import LMHeadRows
from .pair_rows import PairRows, check_pair_capacity
from .plans import BatchPlan, PlanCache
from .staging import StagedTensors

__all__ = ["BatchInfo"]

PlanT = TypeVar("PlanT", bound=BatchPlan)


def _adapter_fields(num_slots: int) -> dict:
    return {"lora_ranks": ((num_slots,), torch.int32), "scalings": ((num_slots,), torch.float32)}


def _batch_fields(num_segments: int, num_rows: int) -> dict:
    return {
        "seg_lens": ((num_segments,), torch.int32),
        "seg_indptr": ((num_segments + 1,), torch.int32),
        "weight_indices": ((num_segments,), torch.int32),
        "token_slots": ((num_rows,), torch.int32),
        "token_scales": ((num_rows,), torch.float32),
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
        adapter or padding), token_scales (T,) float32 (request scale per token),
        lora_ranks (L,) int32, scalings (L,) float32.

    A token's delta is ``token_scales[t] * scalings[slot_t] * B @ A @ x[t]``, plus, for a request
    with a weighted mix, its further slots' deltas on its :attr:`pairs` rows. The request scales
    and pair rows are applied by the backend (:class:`~lora_core.batch_info_backend.BatchInfoBackend`).

    In graph mode ``S`` and ``T`` are the preallocated capacity (``max_tokens``);
    unused segments have length 0 and slot -1, padding tokens slot -1 and scale 0;
    ``pair_capacity`` pair rows (``max_pairs - max_tokens``) are preallocated beside them.
    Kernel plans: :meth:`plan` (kept in :attr:`plans`, refilled with the batch).
    """

    seg_lens = _Published("_batch")
    seg_indptr = _Published("_batch")
    weight_indices = _Published("_batch")
    token_slots = _Published("_batch")
    token_scales = _Published("_batch")
    lora_ranks = _Published("_adapters")
    scalings = _Published("_adapters")
    seg_lens_cpu = _Published("_batch", host=True)
    seg_indptr_cpu = _Published("_batch", host=True)
    weight_indices_cpu = _Published("_batch", host=True)
    token_slots_cpu = _Published("_batch", host=True)
    token_scales_cpu = _Published("_batch", host=True)
    lora_ranks_cpu = _Published("_adapters", host=True)
    scalings_cpu = _Published("_adapters", host=True)

    def __init__(
        self,
        requests: Requests,
        lora_ranks: tuple[int, ...],
        scalings: tuple[float, ...],
        *,
        device: torch.device,
        use_graph: bool,
        capacity: int | None,
        max_rank: int | None = None,
        with_scales: bool = False,
        pair_capacity: int = 0,
    ) -> None:
        self.device = device
        self.max_rank = max_rank
        self.use_graph = use_graph
        self.capacity = capacity
        self.with_scales = with_scales
        self.pair_capacity = pair_capacity
        self.num_slots = len(lora_ranks)
        self.plans = PlanCache()
        self._lm_head: LMHeadRows | None = None
        self._pairs: PairRows | None = None
        self._lora_ranks, self._scalings = lora_ranks, scalings
        self._slot_ranks_scalings: tuple[np.ndarray, np.ndarray] | None = None
        if use_graph:  # adapters and batch are rewritten independently, each in place
            self._adapters = allocating(f"lora_ranks ({self.num_slots} slots)", lambda: StagedTensors(
                _adapter_fields(self.num_slots), device, double_buffered=True))
            self._publish_adapters(lora_ranks, scalings)
            self._batch = allocating(f"max_tokens = {capacity}", lambda: StagedTensors(
                _batch_fields(capacity, capacity), device, double_buffered=True))
        self._publish_batch(requests)  # eager: batch and adapters in one buffer, one upload; then the pairs

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
        """Slot per request (-1 = no adapter); a mix's first slot (the rest: :attr:`request_mixes`)."""
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
    def request_scales(self) -> tuple[float, ...]:
        """Scale of each request's token rows, in float32 as the ops apply it (1.0 each when none was
        given); a mixed request's: its scale times its first weight."""
        scales = self._requests.scales
        return (1.0,) * len(self._requests.lens) if scales is None else tuple(scales.tolist())

    @property
    def has_request_scales(self) -> bool:
        """Whether the ops apply :attr:`token_scales` to the token rows: a batch built ``with_scales`` (a graph batch
        that replays for any scales, or an eager one that keeps one compiled graph), or a batch with
        a scale other than 1. Otherwise every scale is 1 and the ops skip the multiply."""
        return self.with_scales or self._requests.scales is not None

    @property
    def request_mixes(self) -> tuple[tuple[tuple[int, float], ...], ...]:
        """Each request's slots beyond :attr:`request_slots` (the pair rows'), ``((slot, weight * scale), ...)``."""
        return self._requests.further_slots()

    @property
    def pairs(self) -> PairRows | None:
        """The (token, adapter) pair rows of the batch's weighted mixes (:mod:`lora_core.pair_rows`):
        present when an eager batch has a mix, and always in a graph-mode batch built with a pair
        capacity (``max_pairs > max_tokens``); ``None`` otherwise, and the ops run no pair rows."""
        return self._pairs

    @property
    def num_pairs(self) -> int:
        """Pair rows of the current batch's mixes (beyond one row per token; not the graph capacity)."""
        return self._requests.num_pairs

    @property
    def lora_ranks_host(self) -> tuple[int, ...]:
        return self._lora_ranks

    @property
    def scalings_host(self) -> tuple[float, ...]:
        return self._scalings

    # ------------------------------------------------------------------ plans
    def plan(self, plan_type: type[PlanT]) -> PlanT:
        """The ``plan_type`` plan of this batch (:meth:`PlanCache.get`), built on first request,
        for the pruned LM-head rows too when they exist, and refilled with the batch.

        Raises ``RuntimeError`` when the plan would first be built during a graph
        capture: build it before capturing, as ``LoRABackend.prepare_batch`` does.
        """
        plan = self.plans.get(plan_type, self)
        if self._lm_head is not None:
            self._lm_head.view.plan(plan_type)
        if self._pairs is not None:
            self._pairs.view.plan(plan_type)
        return plan

    @property
    def plan_types(self) -> tuple[type[BatchPlan], ...]:
        """The plans built for this batch so far (only those some kernel asked for)."""
        return self.plans.types

    # --------------------------------------------------------------- updates
    def refill(self, seq_lens: Sequence[int], slot_ids: Sequence[int | None | dict[int, float]],
               scales: Sequence[float] | None = None) -> None:
        """Describe a new batch by rewriting the preallocated tensors in place (graph mode);
        ``slot_ids`` and ``scales`` as for ``build_batch_info`` (scales and mixes for a batch built
        ``with_scales``, mixes up to its pair capacity).

        A rejected batch (bad values, more tokens than ``max_tokens``, more pairs than ``max_pairs``,
        scales for a batch built without them) changes nothing.
        """
        if not self.use_graph:
            raise RuntimeError(
                "refill() needs a graph-mode BatchInfo (use_graph=True); "
                "eager batches are cheap to rebuild with build_batch_info()"
            )
        requests = validate_requests(seq_lens, slot_ids, self.num_slots, scales)
        check_capacity(requests, self.capacity)
        check_pair_capacity(requests, self.pair_capacity, self.capacity)
        if requests.scales is not None and not self.with_scales:
            raise ValueError(scales_need_with_scales(requests, scales, built=True))
        self._publish_batch(requests)
        self._changed(adapters_changed=False)

    def set_adapters(self, lora_ranks: Sequence[int], scalings: Sequence[float]) -> None:
        """Update per-slot ranks and scalings in place (after loading or evicting an adapter).

        A rejected call changes nothing.
        """
        ranks, scales = validate_adapters(lora_ranks, scalings, max_rank=self.max_rank)
        if len(ranks) != self.num_slots:
            raise ValueError(
                f"lora_ranks has {len(ranks)} slots; this BatchInfo was built for {self.num_slots}"
            )
        self._publish_adapters(ranks, scales)
        self._changed(adapters_changed=True)

    def lm_head_view(self, pruned: bool) -> BatchInfo:
        """Batch info for the rows that reach the LM head.

        ``pruned=False``: every token (decode, or a full-logits prefill): ``self``.
        ``pruned=True``: the last token of each non-empty request, in request order.
        The view is built once per batch, with the plans built for this batch
        (and, in graph mode, preallocated with it and refilled with it).
        """
        if not check_bool("pruned", pruned):
            return self
        if self._lm_head is None:
            if is_capturing():
                raise RuntimeError("the pruned LM-head view was not built before the graph capture")
            self._lm_head = LMHeadRows(self)
        return self._lm_head.view

    # -------------------------------------------------------------- internals
    def _publish_adapters(self, lora_ranks: tuple[int, ...], scalings: tuple[float, ...]) -> None:
        host = self._adapters.host_arrays
        host["lora_ranks"][:] = lora_ranks
        host["scalings"][:] = scalings
        self._adapters.upload()
        self._lora_ranks, self._scalings = tuple(lora_ranks), tuple(scalings)
        self._slot_ranks_scalings = None
        self.plans.batch_changed()
        if self._pairs is not None:  # the pair rows' slots are these slots (an LM-head view's too)
            self._pairs.set_adapters(self._lora_ranks, self._scalings)

    def _publish_batch(self, requests: Requests) -> None:
        seg_lens, seg_slots = merge_segments(requests)
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
        host["token_scales"][:T] = requests.token_scales()
        host["token_scales"][T:] = 0.0
        self._batch.upload()
        self._requests, self._num_segments = requests, S
        self._segments = (seg_lens, seg_slots, indptr[:S].astype(np.int64))
        self.plans.batch_changed()
        self._publish_pairs(requests)

    def _publish_pairs(self, requests: Requests) -> None:
        """``requests``' pair rows: built for an eager batch with mixes, refilled for a graph one with room."""
        if not self.use_graph:
            self._pairs = None if requests.mixes is None else PairRows(self, requests, None)
        elif self.pair_capacity:
            if self._pairs is None:
                self._pairs = PairRows(self, requests, self.capacity + self.pair_capacity)
            else:
                self._pairs.refill(requests)

    def _publish_copy_of(self, batch: BatchInfo) -> None:
        """Graph mode: publish ``batch``'s rows, which are this batch's rows too (a decode step's
        LM-head rows): its bytes are copied, not re-planned."""
        self._batch.copy_published(batch._batch)
        self._requests = batch._requests.last_tokens()
        self._num_segments, self._segments = batch._num_segments, batch._segments
        if self._pairs is not None:
            self._pairs.refill(self._requests)

    def _changed(self, *, adapters_changed: bool) -> None:
        """The batch or its adapters were republished: refill the plans, then the LM-head rows."""
        self.plans.refill(self)
        if self._lm_head is not None and not self._lm_head.follow(self, adapters_changed=adapters_changed):
            self._lm_head = None

    def __repr__(self) -> str:
        mode = f"graph, capacity={self.capacity}" if self.use_graph else "eager"
        if self.pair_capacity:
            mode += f", pair capacity={self.pair_capacity}"
        return (
            f"BatchInfo({mode}, tokens={self.num_real_tokens}, pairs={self.num_pairs}, segments={self.num_segments}, "
            f"slots={self.num_slots}, device={self.device})"
        )


def __getattr__(name: str):
    if name == "build_batch_info":  # its home is lora_core.batch_builder (which imports this module)
        from .batch_builder import build_batch_info
        return build_batch_info
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
