"""Per-batch plans: what a kernel family derives from a batch, owned by that family.

A :class:`~lora_core.BatchInfo` holds the batch itself (segments, slots, ranks,
scalings). Anything a particular kernel needs beyond that (tokens grouped by
slot, token blocks, a host loop plan) is a :class:`BatchPlan` subclass that
lives beside its kernel in the backend package.

The plans of one batch live in its :class:`PlanCache`: it builds a plan the
first time a kernel asks for it (backends ask in ``prepare_batch``, before any
graph capture), refuses to build one during a capture, and refills every plan
built so far when the batch changes, so a graph-mode plan is rewritten in place
together with the batch. Plans that no kernel asked for are never built.
Host values that several plans of one batch read (e.g. the rows ordered by slot)
are :meth:`PlanCache.shared`: computed once per batch, keyed by their type
(docs/architecture.md).

This module never imports the batch: a batch hands itself to the cache.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Callable, TypeVar

from .graphs import is_capturing

if TYPE_CHECKING:  # annotations only: the batch imports this module, never the reverse
    from .batch_info import BatchInfo

__all__ = ["BatchPlan", "PlanCache"]

PlanT = TypeVar("PlanT", bound="BatchPlan")
SharedT = TypeVar("SharedT")


class BatchPlan(abc.ABC):
    """One kernel family's view of a batch; build it through ``batch_info.plan(PlanType)``."""

    @classmethod
    @abc.abstractmethod
    def build(cls, batch_info: BatchInfo) -> BatchPlan:
        """The plan of ``batch_info``'s current batch.

        Semantics: read the batch's host data only (``batch_info.*_cpu``,
        ``lora_ranks_host``, ``scalings_host``), never a device tensor; in graph
        mode (``batch_info.use_graph``) allocate every device tensor for the
        batch's capacity so that :meth:`refill` can rewrite it in place."""

    @abc.abstractmethod
    def refill(self, batch_info: BatchInfo) -> None:
        """Describe ``batch_info``'s new batch (after a refill or new adapter ranks).

        Semantics: graph mode rewrites the device tensors in place (same objects,
        same addresses, so a captured graph reads the new plan); eager plans may
        rebuild freely."""

    def refill_from(self, batch_info: BatchInfo, twin: BatchPlan) -> None:
        """Refill for a batch whose host data equals ``twin``'s batch (a decode step's
        LM-head rows): plans that can copy ``twin``'s published data override this."""
        self.refill(batch_info)


class PlanCache:
    """The plans of one batch, and the host values they share.

    ``get(PlanType, batch)`` builds a plan on first request; :meth:`refill` keeps
    every built plan in step with the batch; :meth:`shared` memoises values that
    several plans compute from the same batch until the batch changes.
    """

    __slots__ = ("_plans", "_shared")

    def __init__(self) -> None:
        self._plans: dict[type[BatchPlan], BatchPlan] = {}
        self._shared: dict[type, object] = {}

    @property
    def types(self) -> tuple[type[BatchPlan], ...]:
        """The plan types built so far, in the order they were first asked for."""
        return tuple(self._plans)

    def get(self, plan_type: type[PlanT], batch_info: BatchInfo) -> PlanT:
        """The ``plan_type`` plan of ``batch_info`` (whose cache this is), built on first request.

        Raises ``RuntimeError`` when the plan would first be built during a graph
        capture (building reads host data that the graph would bake in)."""
        plan = self._plans.get(plan_type)
        if plan is None:
            if is_capturing():
                built = ", ".join(t.__name__ for t in self._plans) or "none"
                raise RuntimeError(
                    f"{plan_type.__name__} of this batch was not built before the graph capture: a kernel "
                    f"asked for it during the capture (plans built so far: {built}). Run the captured step "
                    "once before capturing (a warm-up): its first call builds every plan its kernels read, "
                    "e.g. the blocked kernel's plan for a layer whose sizes the grouped GEMM rejects"
                )
            plan = self._plans[plan_type] = plan_type.build(batch_info)
        return plan  # type: ignore[return-value]

    def shared(self, value_type: Callable[[BatchInfo], SharedT], batch_info: BatchInfo) -> SharedT:
        """``value_type(batch_info)``, computed once per batch and adapter set: host values that
        several plans of one batch read. The key is the type itself, owned by the package
        that defines it, so two packages can never collide."""
        value = self._shared.get(value_type)
        if value is None:
            value = self._shared[value_type] = value_type(batch_info)
        return value  # type: ignore[return-value]

    def batch_changed(self) -> None:
        """Forget the shared values (the batch or its adapters changed); plans are refilled next."""
        self._shared = {}

    def refill(self, batch_info: BatchInfo) -> None:
        """Refill every plan built so far for ``batch_info``'s new batch."""
        for plan in self._plans.values():
            plan.refill(batch_info)

    def refill_from(self, batch_info: BatchInfo, twin: PlanCache) -> None:
        """Refill for a batch whose host data equals ``twin``'s batch: each plan from its twin,
        and the shared values are the twin's (they are computed from equal data)."""
        self._shared = twin._shared
        for plan_type, plan in self._plans.items():
            twin_plan = twin._plans.get(plan_type)
            if twin_plan is None:  # built for these rows only (a layer's first call on them)
                plan.refill(batch_info)
            else:
                plan.refill_from(batch_info, twin_plan)
