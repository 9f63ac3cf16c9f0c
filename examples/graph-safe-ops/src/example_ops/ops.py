"""Per-request sums of the rows of ``x``: the graph-safe way and the host-reading way."""

from __future__ import annotations

import torch


def segment_sums(x: torch.Tensor, segment_ids: torch.Tensor, num_segments: int) -> torch.Tensor:
    """Row sums per segment: ``out[s] = x[segment_ids == s].sum(0)``, shape ``(num_segments, D)``.

    Graph-safe: which segment a row belongs to is device data (``segment_ids``, int64 of
    shape ``(T,)``), and ``num_segments`` is a capacity fixed before capture, so a replay
    with other segments gives their sums.
    """
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D (tokens, features), got shape {tuple(x.shape)}")
    if segment_ids.shape != x.shape[:1]:
        raise ValueError(f"segment_ids must have shape ({x.shape[0]},), got {tuple(segment_ids.shape)}")
    out = torch.zeros(num_segments, x.shape[1], dtype=x.dtype, device=x.device)
    return out.index_add_(0, segment_ids, x)


def segment_sums_host(x: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """The same sums from per-request lengths, split on the host.

    Correct when called eagerly, but ``seq_lens.tolist()`` reads the batch on the host:
    under a graph capture the split is baked in, and a replay with other lengths sums the
    captured batch's rows.
    """
    parts = torch.split(x, seq_lens.tolist())
    return torch.stack([p.sum(0) for p in parts])
