"""``LMHeadWithLoRA``: the LM head, for every token or the last token of each request."""

from __future__ import annotations

import torch
from torch import nn

from ..parallel import TensorParallel
from .column_parallel import ColumnParallelLinearWithLoRA
from .context import LoRAContext, WrapTarget, flatten_tokens, inference_forward

__all__ = ["LMHeadWithLoRA"]


class LMHeadWithLoRA(ColumnParallelLinearWithLoRA):
    """LM head (vocab-parallel ``nn.Linear``) with LoRA; logits are gathered over ranks.

    It receives every token's row (decode, or full logits) or one row per
    non-empty request (prefill pruning); the backend's ``run_lm_head`` applies
    each row's adapter through the batch's LM-head view.
    """

    def __init__(self, base_layer: nn.Linear, context: LoRAContext, tp: TensorParallel | None = None) -> None:
        super().__init__(base_layer, context, tp or TensorParallel(), gather_output=True)

    @classmethod
    def can_wrap(cls, module: nn.Module, target: WrapTarget) -> bool:
        return isinstance(module, nn.Linear) and target.lm_head

    @classmethod
    def wrap(cls, module: nn.Module, context: LoRAContext, target: WrapTarget) -> LMHeadWithLoRA:
        return cls(module, context)

    @inference_forward
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden: (..., H)`` with every token's row, or one row per non-empty request."""
        lead = hidden.shape[:-1]
        x2 = flatten_tokens(hidden, self.base_layer.in_features, "LMHeadWithLoRA")
        info = self.context.backend.batch_info
        pruned = x2.shape[0] != info.num_tokens
        if pruned and x2.shape[0] != info.lm_head_view(pruned=True).num_tokens:
            raise ValueError(
                f"LMHeadWithLoRA got {x2.shape[0]} rows; expected every token ({info.num_tokens}) or the last "
                f"token of each request ({info.lm_head_view(pruned=True).num_tokens})"
            )
        ctx, buf = self.context, self.buffers
        base = self._base(x2)
        out = ctx.add_delta(base, ctx.backend.run_lm_head(ctx.to_lora_dtype(x2), buf.a, buf.b, ctx.lora_output(base),
                                                          pruned=pruned))
        return self._finish(out).reshape(*lead, -1)
