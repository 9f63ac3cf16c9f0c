"""Request scales: each request's multiplier of its adapter's delta, applied to the shrink's output.

A token's delta is ``token_scales[t] * scalings[slot_t] * B @ A @ x[t]``
(:class:`~lora_core.BatchInfo`). Every op's delta passes through one shrink output
(``(T, c*R)``, or ``(T, K, R)`` for experts) on its way to the expand, and the delta is linear
in it, so multiplying that output's rows by their request scales applies them to every op
without any kernel knowing of them: a ``T x R`` elementwise product, nothing read on the host,
the same for a captured graph replayed with other scales.
"""

from __future__ import annotations

import torch

from .batch_info import BatchInfo

__all__ = ["apply_request_scales"]


def apply_request_scales(shrunk: torch.Tensor, batch_info: BatchInfo) -> torch.Tensor:
    """``shrunk (n, ...)``, a shrink's output for the first ``n`` rows of ``batch_info``, with each
    row multiplied in place by its request's scale (``batch_info.token_scales``, float32; the
    product rounded once more to ``shrunk``'s dtype) when ``batch_info.has_request_scales``;
    otherwise returned untouched (no op is launched)."""
    if not batch_info.has_request_scales:
        return shrunk
    scales = batch_info.token_scales[: shrunk.shape[0]]
    return shrunk.mul_(scales.view(-1, *(1,) * (shrunk.dim() - 1)))
