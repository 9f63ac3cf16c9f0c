"""The rows that reach a pruned LM head: the last token of each non-empty request.

A prefill usually computes logits for the last token of each request only. Those
rows are a batch of their own (one single-token request per non-empty request, in
request order), with its own segments and plans. :class:`LMHeadRows` is the one
owner of that batch: it builds it from its parent batch, with the plans the parent
has, and :meth:`LMHeadRows.follow` is the one place that keeps it current when the
parent is refilled or gets new adapters (graph mode: rewritten in place, so a
captured graph reads it; eager: dropped, and built again when next asked for).

When every request has one token (decode) the rows are the parent's rows: the
parent's published bytes are copied and its plans' data reused, nothing re-planned.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the batch imports this module, never the reverse
    from .batch_info import BatchInfo

__all__ = ["LMHeadRows"]


class LMHeadRows:
    """The pruned LM-head batch of ``parent``, built with the plans ``parent`` has so far.

    Attributes:
        view: the :class:`~lora_core.BatchInfo` of the rows (a graph-mode parent's view
            is preallocated for the parent's capacity and refilled with it).
    """

    __slots__ = ("view",)

    def __init__(self, parent: BatchInfo) -> None:
        view = type(parent)(parent._requests.last_tokens(), parent.lora_ranks_host, parent.scalings_host,
                            device=parent.device, use_graph=parent.use_graph, capacity=parent.capacity,
                            max_rank=parent.max_rank, with_scales=parent.with_scales,
                            pair_capacity=parent.pair_capacity)
        for plan_type in parent.plan_types:
            view.plan(plan_type)
        self.view = view

    def follow(self, parent: BatchInfo, *, adapters_changed: bool) -> bool:
        """Bring the rows up to date after ``parent`` was refilled (or, with ``adapters_changed``,
        got new ranks and scalings) and its plans were refilled. Returns ``False`` when the rows
        must be dropped instead (an eager parent: rebuilding is cheaper than following)."""
        if not parent.use_graph:
            return False
        view, requests = self.view, parent._requests
        if adapters_changed:
            view._publish_adapters(parent.lora_ranks_host, parent.scalings_host)
        elif requests.is_one_token_each:  # the same rows: copy the parent's bytes, re-plan nothing
            view._publish_copy_of(parent)
        else:
            view._publish_batch(requests.last_tokens())
        if requests.is_one_token_each:
            view.plans.refill_from(view, parent.plans)
        else:
            view.plans.refill(view)
        return True
