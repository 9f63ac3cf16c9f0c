"""``ExpertsWithLoRA``: transformers' fused experts modules (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, ...).

The module holds ``gate_up_proj (E, 2I, H)`` and ``down_proj (E, H, I)`` and is called
with the router's choices: ``forward(hidden_states (T, H), top_k_index (T, K),
top_k_weights (T, K))``. The wrapper runs the experts itself so that each
(token, expert) pair gets its slot's LoRA delta where PEFT's ``ParamWrapper`` puts
it (docs/moe.md): on the gate_up output before the activation, and on the down
output before the router weighting::

    h = x[t] @ gate_up_proj[e].T + delta_gate_up[t, k]
    y = (act(gate(h)) * up(h)) @ down_proj[e].T + delta_down[t, k]
    out[t] = sum_k top_k_weights[t, k] * y
"""

from __future__ import annotations

import torch
from torch import nn

from lora_core import is_capturing
from lora_core.expert_layout import ExpertLoRABuffers

from .context import LoRAContext, WrapTarget, inference_forward
from .expert_projection import expert_projection
from .slot_weights import ModuleParts, folded_b

__all__ = ["ExpertsWithLoRA"]


class ExpertsWithLoRA(nn.Module):
    """A fused experts module with LoRA on its ``gate_up_proj`` and ``down_proj`` parameters.

    Takes a module with 3-D ``gate_up_proj (E, 2I, H)`` and ``down_proj (E, H, I)``
    parameters (``(experts, out, in)``, as transformers stores them: not
    ``is_transposed``, no biases, a gate), an ``act_fn``, and the
    ``(hidden_states, top_k_index, top_k_weights)`` call.
    """

    parameters_with_lora = ("gate_up_proj", "down_proj")
    """The parameters adapters may target (``target_parameters``), in slot-part order."""

    def __init__(self, base_layer: nn.Module, context: LoRAContext) -> None:
        super().__init__()
        if not self.is_experts_module(base_layer):
            raise TypeError(f"{type(self).__name__} wraps a fused experts module (3-D gate_up_proj (E, 2I, H) and "
                            f"down_proj (E, H, I), act_fn), got {type(base_layer).__name__}")
        self.base_layer = base_layer
        self.context = context
        E, two_i, hidden = base_layer.gate_up_proj.shape
        self.num_experts, self.hidden_size, self.intermediate_size = E, hidden, two_i // 2
        common = dict(num_slots=context.num_slots, num_experts=E, max_rank=context.max_rank,
                      dtype=context.dtype, device=context.device)
        self.gate_up = ExpertLoRABuffers(in_features=hidden, out_features=two_i, **common)
        self.down = ExpertLoRABuffers(in_features=two_i // 2, out_features=hidden, **common)

    @staticmethod
    def is_experts_module(module: nn.Module) -> bool:
        """A module whose experts this wrapper can run (transformers' fused layout)."""
        gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
        if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)):
            return False
        if gate_up.dim() != 3 or down.dim() != 3 or not callable(getattr(module, "act_fn", None)):
            return False
        if getattr(module, "is_transposed", False) or getattr(module, "has_bias", False) \
                or not getattr(module, "has_gate", True) or not getattr(module, "is_concatenated", True):
            return False
        E, two_i, hidden = gate_up.shape
        return two_i % 2 == 0 and tuple(down.shape) == (E, hidden, two_i // 2)

    # -- dispatch (lora_layers.layers.dispatch)
    @classmethod
    def can_wrap(cls, module: nn.Module, target: WrapTarget) -> bool:
        return cls.is_experts_module(module)

    @classmethod
    def wrap(cls, module: nn.Module, context: LoRAContext, target: WrapTarget) -> ExpertsWithLoRA:
        return cls(module, context)

    def load_slot(self, slot: int, parts: ModuleParts, slot_scaling: float) -> None:
        """Load one adapter's per-expert weights into ``slot``: ``parts`` maps the index of a
        parameter in :attr:`parameters_with_lora` to its weights (kind ``"experts"``:
        ``lora_a (E, r, in)``, ``lora_b (E, out, r)``); a parameter without weights gets no delta."""
        if any(w.kind != "experts" for w in parts.values()):
            raise ValueError("expected per-expert LoRA weights of target_parameters "
                             f"({', '.join(self.parameters_with_lora)})")
        unknown = sorted(set(parts) - set(range(len(self.parameters_with_lora))))
        if unknown:
            raise ValueError(f"no expert parameter of index {unknown[0]}; the parameters are "
                             f"{list(self.parameters_with_lora)}")
        weights = {i: self._shard(i, w.lora_a, folded_b(w, slot_scaling)) for i, w in parts.items()}
        self.reset_lora(slot)
        for index, buffers in enumerate((self.gate_up, self.down)):
            if index in weights:
                buffers.load(slot, *weights[index])

    def _shard(self, index: int, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This process's part of parameter ``index``'s unsharded ``(A (E, r, in), B (E, out, r))``
        (all of it here; the tensor-parallel wrapper takes its shard)."""
        return a, b

    def reset_lora(self, slot: int) -> None:
        """Zero ``slot``'s weights (the adapter in it is unloaded)."""
        self.gate_up.clear(slot)
        self.down.clear(slot)

    def _add_lora(self, x: torch.Tensor, expert_ids: torch.Tensor, buffers: ExpertLoRABuffers,
                  base_output: torch.Tensor) -> torch.Tensor:
        """``base_output`` plus the delta of one parameter, the math in the LoRA dtype (``context.dtype``)."""
        ctx = self.context
        result = ctx.backend.run_experts_lora(ctx.to_lora_dtype(x), expert_ids, buffers.a, buffers.b,
                                              ctx.lora_output(base_output))
        return ctx.add_delta(base_output, result)

    def _gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        apply_gate = getattr(self.base_layer, "_apply_gate", None)
        if callable(apply_gate):
            return apply_gate(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.base_layer.act_fn(gate) * up

    @inference_forward
    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        base, backend = self.base_layer, self.context.backend
        T, K = top_k_index.shape
        graph_safe = backend.batch_info.use_graph or is_capturing() or torch.compiler.is_compiling()
        x = hidden_states.reshape(T, self.hidden_size)[:, None, :].expand(T, K, self.hidden_size)
        h = self._add_lora(x, top_k_index, self.gate_up,
                           expert_projection(x, top_k_index, base.gate_up_proj, graph_safe=graph_safe))
        mid = self._gate(h)
        y = self._add_lora(mid, top_k_index, self.down,
                           expert_projection(mid, top_k_index, base.down_proj, graph_safe=graph_safe))
        picked = (top_k_index >= 0) & (top_k_index < self.num_experts)
        weights = torch.where(picked, top_k_weights, 0)
        return (y * weights[..., None]).sum(1).to(hidden_states.dtype)
