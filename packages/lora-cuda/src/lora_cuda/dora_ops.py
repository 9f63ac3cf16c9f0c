"""DoRA's per-row rescale (``LoRABackend.run_dora_scale``): one graph-safe op for every batch.

Each row's factor is gathered by its slot (``batch_info.token_slots``) from the
layer's ``(L, out)`` factor buffer, which the layer filled when the adapter was
loaded (:func:`lora_core.dora.dora_factor`). The op launches the same kernels
whatever the batch and reads nothing on the host, so eager batches use it too (a
host loop over segments would not be cheaper than one elementwise pass). Under
``torch.compile`` it traces as the custom op ``lora_cuda::dora_scale_``.
"""

from __future__ import annotations

import torch

from lora_core import BatchInfo
from lora_core.validation import check_dora_scale_inputs

from . import custom_ops  # noqa: F401  (registers torch.ops.lora_cuda.dora_scale_)
from .graph_kernels import graph_dora_scale
from .graph_plans import batch_args, batch_key

__all__ = ["dora_scale_fwd"]


def dora_scale_fwd(output: torch.Tensor, factors: torch.Tensor, batch_info: BatchInfo,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """``output (T, out)`` updated in place and returned; ``factors (L, out)`` float32; ``bias (out,)``.

    Semantics::

        output[t] = factors[slot_t] * (output[t] - bias) + bias   for slot_t >= 0 (bias = 0 when None)
    """
    if torch.compiler.is_compiling():  # one custom op that updates output in place
        key, host = batch_args(batch_info, output, factors)
        torch.ops.lora_cuda.dora_scale_(output, factors, bias, key, host)
        return output
    check_dora_scale_inputs(output, factors, batch_info, bias)
    if batch_info.use_graph:
        batch_key(batch_info)  # a warm-up call prepares the batch for compiling
    return graph_dora_scale(output, factors, batch_info, bias)
