"""The (token, adapter) pair rows of a batch with weighted mixes (issue #40, part 2).

A request that mixes adapters, ``{a: w_a, b: w_b, ...}``, gets ``sum_i w_i * delta_i``. Its first
adapter runs on its token rows, at ``scale * w_a`` (a request scale like any other); each further
adapter on a pair row per (token, adapter), at ``scale * w_i``. A batch with mixes runs its LoRA ops
over one batch of rows: its token rows, then its pair rows (one request per (mixed request, further
adapter), in request order), each row with its slot, its scale and the token row it reads its input
from and adds its delta to. An op runs each kernel once over all the rows, each reading its token's
row of the inputs and adding its delta into its token's row
(:class:`~lora_core.batch_info_backend.BatchInfoBackend`): the inputs gathered by token row and the
deltas added back, or, where the backend's kernels gather and scatter rows anyway, through
:attr:`PairRows.token_rows`. A batch without mixes has no pair rows and launches what it did.

:class:`PairRows` is the one owner of that batch of rows. An eager batch builds it with the batch
when the batch has mixes; a graph-mode batch with a pair capacity (``max_pairs - max_tokens``)
allocates it once for ``max_pairs`` rows and refills it in place with every batch, its padding rows
on slot -1 and token row 0 (a zero delta added to row 0), so a captured graph replays on other mixes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from .checks import allocating
from .staging import StagedTensors

if TYPE_CHECKING:  # annotations only: the batch imports this module, never the reverse
    from .batch_info import BatchInfo
    from .batch_requests import Requests

__all__ = ["PairRows", "check_pair_capacity"]


class PairRows:
    """The rows of ``parent``'s batch with its pair rows (:meth:`Requests.with_pair_rows`), for
    ``capacity`` rows in graph mode (``None``: eager, exactly the rows).

    Attributes:
        view: the :class:`~lora_core.BatchInfo` of those rows: the token rows at their scales, then
            the pair rows at their mixes' weights times their requests' scales (built with the plans
            ``parent`` has so far, refilled with ``parent`` in graph mode).
    """

    __slots__ = ("view", "_rows")

    def __init__(self, parent: BatchInfo, requests: Requests, capacity: int | None) -> None:
        rows = requests.with_pair_rows()
        self.view = type(parent)(rows, parent.lora_ranks_host, parent.scalings_host, device=parent.device,
                                 use_graph=capacity is not None, capacity=capacity, max_rank=parent.max_rank,
                                 with_scales=parent.with_scales)
        size = rows.num_tokens if capacity is None else capacity
        self._rows = allocating(f"max_pairs ({size} rows)", lambda: StagedTensors(
            {"token_rows": ((size,), torch.int64)}, parent.device, double_buffered=capacity is not None))
        self._publish_rows(requests)
        for plan_type in parent.plan_types:
            self.view.plan(plan_type)

    @property
    def token_rows(self) -> torch.Tensor:
        """``(N,)`` int64 on the device: each row's token row (0 for graph-mode padding)."""
        return self._rows.device["token_rows"]

    @property
    def token_rows_cpu(self) -> torch.Tensor:
        """The host mirror of :attr:`token_rows`."""
        return self._rows.published["token_rows"]

    def refill(self, requests: Requests) -> None:
        """Graph mode: describe ``requests``' rows in place (their plans refilled)."""
        self.view._publish_batch(requests.with_pair_rows())
        self._publish_rows(requests)
        self.view.plans.refill(self.view)

    def set_adapters(self, lora_ranks: tuple[int, ...], scalings: tuple[float, ...]) -> None:
        """The parent's slots got new ranks and scalings: the rows' too (plans refilled)."""
        self.view._publish_adapters(lora_ranks, scalings)
        self.view.plans.refill(self.view)

    def _publish_rows(self, requests: Requests) -> None:
        rows = requests.pair_token_rows()
        host = self._rows.host_arrays["token_rows"]
        host[: rows.size] = rows
        host[rows.size :] = 0
        self._rows.upload()


def check_pair_capacity(requests: Requests, capacity: int, max_tokens: int) -> None:
    """``ValueError`` naming the first request whose mix takes the pair rows of ``requests`` beyond a
    graph-mode batch's pair ``capacity`` (``max_pairs - max_tokens``)."""
    if requests.num_pairs <= capacity:
        return
    mixes = requests.mixes
    totals = np.cumsum(requests.lens[mixes.requests])
    first = int(np.argmax(totals > capacity))
    request = int(mixes.requests[first])
    raise ValueError(
        f"request {request}'s mix brings the batch to {int(totals[first])} (token, adapter) "
        f"pairs beyond one per token, more than this graph batch holds (max_pairs - max_tokens = {capacity}); "
        f"build it with max_pairs >= {max_tokens + requests.num_pairs}"
    )
