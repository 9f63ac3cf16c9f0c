"""Per-batch plans: what a kernel family derives from a batch, owned by that family.

A :class:`~lora_core.BatchInfo` holds the batch itself (segments, slots, ranks,
scalings). Anything a particular kernel needs beyond that (tokens grouped by
slot, token blocks, a host loop plan) is a :class:`BatchPlan` subclass that
lives beside its kernel in the backend package. The batch info builds a plan
the first time :meth:`BatchInfo.plan` asks for it (backends ask in
``prepare_batch``, before any graph capture) and keeps it in step with the
batch: :meth:`BatchInfo.refill` and :meth:`BatchInfo.set_adapters` call
:meth:`BatchPlan.refill` on every plan built so far, so a graph-mode plan is
rewritten in place together with the batch. Plans that no kernel asked for are
never built (docs/architecture.md).
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .batch_info import BatchInfo

__all__ = ["BatchPlan"]


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
        LM-head view): plans that can copy ``twin``'s published data override this."""
        self.refill(batch_info)
