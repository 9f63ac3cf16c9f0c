"""Build a :class:`~lora_core.BatchInfo` from a caller's per-request description, validated once."""

from __future__ import annotations

from typing import Sequence

import torch

from .batch_info import BatchInfo
from .batch_requests import (MAX_TOKENS, Mix, check_capacity, scales_need_with_scales, validate_adapters,
                             validate_requests)
from .checks import check_bool, check_device, check_int, is_int
from .pair_rows import check_pair_capacity

__all__ = ["build_batch_info"]


def build_batch_info(
    seq_lens: Sequence[int],
    slot_ids: Sequence[int | None | Mix],
    lora_ranks: Sequence[int],
    scalings: Sequence[float],
    *,
    device: torch.device | str,
    use_graph: bool = False,
    max_tokens: int | None = None,
    max_rank: int | None = None,
    scales: Sequence[float] | None = None,
    with_scales: bool = False,
    max_pairs: int | None = None,
) -> BatchInfo:
    """Validate a batch description and build its :class:`BatchInfo`.

    Args:
        seq_lens: tokens per request (ints >= 0); they sum to the token count ``T``.
        slot_ids: adapter slot per request; ``None`` or ``-1`` means the base model; a weighted mix
            of slots, ``{slot: weight}`` or ``[(slot, weight), ...]`` (weights finite, >= 0, each
            slot once), gives the request ``sum_i weight_i * delta_i`` (:mod:`lora_core.pair_rows`).
        lora_ranks: rank per slot (``L`` ints, 0 = empty slot), host data.
        scalings: scaling per slot (``L`` floats, finite in float32), host data.
        device: where the device tensors live.
        use_graph: preallocate for ``max_tokens`` and allow :meth:`BatchInfo.refill`.
        max_tokens: graph-mode capacity (required with ``use_graph``).
        max_rank: when given, every rank must be <= it (the buffers' ``R``).
        scales: one multiplier per request (finite, >= 0; ``None``: 1 each), on top of its
            slot's scaling: the request's delta is ``scales[i] * scalings[slot] * B @ A @ x``,
            so 0 gives the base model's output. Host data.
        with_scales: the ops apply request scales even when every scale is 1: required for a graph
            batch to take scales (its captured ops then replay for any); on an eager batch, it keeps
            ``torch.compile`` from recompiling when a batch with scales follows one without.
        max_pairs: graph mode: the (token, adapter) pairs the batch holds, one per token and one per
            token of a mix's further slot (default ``max_tokens``: no room for mixes). Every replay
            runs the ops over ``max_pairs`` rows. Needs ``with_scales`` (a mix's weights are scales).
    """
    use_graph = check_bool("use_graph", use_graph)
    with_scales = check_bool("with_scales", with_scales)
    if max_rank is not None:
        max_rank = check_int("max_rank", max_rank, minimum=0)
    if use_graph:
        if max_tokens is None or not is_int(max_tokens) or not 0 < max_tokens <= MAX_TOKENS:
            raise ValueError(f"max_tokens must be a positive int <= 2**31 - 1 (token offsets are int32) "
                             f"with use_graph=True, got {max_tokens!r}")
        max_tokens = int(max_tokens)
        max_pairs = max_tokens if max_pairs is None else check_int("max_pairs", max_pairs, minimum=max_tokens,
                                                                   maximum=MAX_TOKENS)
        if max_pairs > max_tokens and not with_scales:
            raise ValueError(f"max_pairs = {max_pairs}: a graph-mode batch holds weighted mixes only when built "
                             "with with_scales=True (a mix's weights are request scales)")
    elif max_tokens is not None or max_pairs is not None:
        name, value = ("max_tokens", max_tokens) if max_tokens is not None else ("max_pairs", max_pairs)
        raise ValueError(f"{name} is only meaningful with use_graph=True, got {name} = {value!r}")
    ranks, slot_scalings = validate_adapters(lora_ranks, scalings, max_rank=max_rank)
    requests = validate_requests(seq_lens, slot_ids, len(ranks), scales)
    if use_graph:
        check_capacity(requests, max_tokens)
        check_pair_capacity(requests, max_pairs - max_tokens, max_tokens)
        if requests.scales is not None and not with_scales:
            raise ValueError(scales_need_with_scales(requests, scales, built=False))
    device = check_device("device", device)
    info = BatchInfo(requests, ranks, slot_scalings, device=device, use_graph=use_graph, capacity=max_tokens,
                     max_rank=max_rank, with_scales=with_scales,
                     pair_capacity=max_pairs - max_tokens if use_graph else 0)
    if use_graph:
        info.lm_head_view(pruned=True)  # preallocated now: never built during a capture
    return info
