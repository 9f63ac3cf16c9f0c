"""``ExpertsWithLoRA``: transformers' fused experts modules (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE,
gpt-oss, ...).

The module holds ``gate_up_proj`` and ``down_proj`` for every expert and is called with the
router's choices: ``forward(hidden_states (T, H), top_k_index (T, K), top_k_weights (T, K))``
(gpt-oss names them ``router_indices`` and ``routing_weights``). Two layouts, read from the
attributes transformers' ``use_experts_implementation`` sets (:class:`ExpertsLayout`):

* ``(experts, out, in)``: ``gate_up_proj (E, 2I, H)``, ``down_proj (E, H, I)``, gate rows
  then up rows, no biases, the module's ``act_fn`` (Mixtral, Qwen-MoE, OLMoE);
* gpt-oss's ``(experts, in, out)`` (``is_transposed``): ``gate_up_proj (E, H, 2I)``, ``down_proj
  (E, I, H)``, with ``gate_up_proj_bias (E, 2I)`` and ``down_proj_bias (E, H)`` (``has_bias``),
  gate and up interleaved (not ``is_concatenated``) and split by the module's own
  ``_apply_gate`` (gpt-oss's clamped SwiGLU).

The weights are used as they are, never copied or transposed. The wrapper runs the experts
itself so that each (token, expert) pair gets its slot's LoRA delta where PEFT's
``ParamWrapper`` puts it (docs/moe.md): on the gate_up output before the activation, and on
the down output before the router weighting; each bias is added once per pair, as the base
module adds it::

    h = x[t] @ W_gate_up[e] + b_gate_up[e] + delta_gate_up[t, k]
    y = gate(h) @ W_down[e] + b_down[e] + delta_down[t, k]
    out[t] = sum_k top_k_weights[t, k] * y
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lora_core import is_capturing
from lora_core.expert_layout import ExpertLoRABuffers

from .context import LoRAContext, WrapTarget, inference_forward
from .expert_projection import expert_projection
from .slot_weights import ModuleParts, folded_b

__all__ = ["ExpertsLayout", "ExpertsWithLoRA"]


@dataclass(frozen=True)
class ExpertsLayout:
    """How a fused experts module stores its weights: ``transposed`` (``(E, in, out)`` instead of
    ``(E, out, in)``), ``bias`` (``gate_up_proj_bias (E, 2I)`` and ``down_proj_bias (E, H)``),
    ``interleaved`` (gate and up alternate in ``gate_up``'s output; the module's ``_apply_gate``
    splits them)."""

    transposed: bool
    bias: bool
    interleaved: bool

    @classmethod
    def of(cls, module: nn.Module) -> ExpertsLayout | str:
        """The module's layout, or why :class:`ExpertsWithLoRA` cannot run it (one line)."""
        gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
        if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)) \
                or gate_up.dim() != 3 or down.dim() != 3:
            return "fused experts need 3-D gate_up_proj and down_proj parameters"
        if not getattr(module, "has_gate", True):
            return "experts without a gate (has_gate=False): gate_up_proj must hold a gate and an up projection"
        layout = cls(bool(getattr(module, "is_transposed", False)), bool(getattr(module, "has_bias", False)),
                     not getattr(module, "is_concatenated", True))
        apply_gate = callable(getattr(module, "_apply_gate", None))
        if not apply_gate and not callable(getattr(module, "act_fn", None)):
            return "experts without an activation: the module needs act_fn or _apply_gate"
        if layout.interleaved and not apply_gate:
            return "experts with gate and up interleaved (is_concatenated=False) need the module's _apply_gate"
        E = gate_up.shape[0]
        hidden, two_i = (gate_up.shape[1], gate_up.shape[2]) if layout.transposed else (gate_up.shape[2],
                                                                                         gate_up.shape[1])
        want_down = (E, two_i // 2, hidden) if layout.transposed else (E, hidden, two_i // 2)
        if two_i % 2 or tuple(down.shape) != want_down:
            return (f"experts of shapes gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)}: "
                    f"expected down_proj {want_down} for {'(E, in, out)' if layout.transposed else '(E, out, in)'}")
        if layout.bias:
            biases = getattr(module, "gate_up_proj_bias", None), getattr(module, "down_proj_bias", None)
            if not all(isinstance(b, torch.Tensor) for b in biases) \
                    or tuple(biases[0].shape) != (E, two_i) or tuple(biases[1].shape) != (E, hidden):
                return (f"experts with a bias (has_bias) need gate_up_proj_bias ({E}, {two_i}) and down_proj_bias "
                        f"({E}, {hidden})")
        return layout


class ExpertsWithLoRA(nn.Module):
    """A fused experts module with LoRA on its ``gate_up_proj`` and ``down_proj`` parameters.

    Takes a module in one of the layouts of :class:`ExpertsLayout` (see the module's
    docstring) and the ``(hidden_states, top_k_index, top_k_weights)`` call, positional or
    by those names or gpt-oss's (``router_indices``, ``routing_weights``).
    """

    parameters_with_lora = ("gate_up_proj", "down_proj")
    """The parameters adapters may target (``target_parameters``), in slot-part order."""

    def __init__(self, base_layer: nn.Module, context: LoRAContext) -> None:
        super().__init__()
        layout = ExpertsLayout.of(base_layer)
        if isinstance(layout, str):
            raise TypeError(f"{type(self).__name__} cannot wrap {type(base_layer).__name__}: {layout}")
        self.base_layer = base_layer
        self.context = context
        self.layout = layout
        E, a, b = base_layer.gate_up_proj.shape
        two_i, hidden = (b, a) if layout.transposed else (a, b)
        self.num_experts, self.hidden_size, self.intermediate_size = E, hidden, two_i // 2
        common = dict(num_slots=context.num_slots, num_experts=E, max_rank=context.max_rank,
                      dtype=context.dtype, device=context.device)
        (gate_up_in, gate_up_out), (down_in, down_out) = self._lora_features(hidden, two_i // 2)
        self.gate_up = ExpertLoRABuffers(in_features=gate_up_in, out_features=gate_up_out, **common)
        self.down = ExpertLoRABuffers(in_features=down_in, out_features=down_out, **common)

    @staticmethod
    def is_experts_module(module: nn.Module) -> bool:
        """A module whose experts this wrapper can run (a layout of :class:`ExpertsLayout`)."""
        return isinstance(ExpertsLayout.of(module), ExpertsLayout)

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

    def _lora_features(self, hidden: int, intermediate: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """``(in, out)`` of this process's gate_up and down LoRA buffers, given the base layer's
        ``hidden`` size and (local) ``intermediate`` size: the parameters' own (``(H, 2I)`` and
        ``(I, H)``), unless a fully sharded wrapper holds only its shard of ``H``."""
        return (hidden, 2 * intermediate), (intermediate, hidden)

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
    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor | None = None,
                top_k_weights: torch.Tensor | None = None, *, router_indices: torch.Tensor | None = None,
                routing_weights: torch.Tensor | None = None) -> torch.Tensor:
        top_k_index = router_indices if top_k_index is None else top_k_index
        top_k_weights = routing_weights if top_k_weights is None else top_k_weights
        if top_k_index is None or top_k_weights is None:
            raise TypeError("the experts need the router's choices: top_k_index and top_k_weights (gpt-oss: "
                            "router_indices and routing_weights)")
        base, backend = self.base_layer, self.context.backend
        biases = (base.gate_up_proj_bias, base.down_proj_bias) if self.layout.bias else (None, None)
        T, K = top_k_index.shape
        graph_safe = backend.batch_info.use_graph or is_capturing() or torch.compiler.is_compiling()
        x = hidden_states.reshape(T, self.hidden_size)[:, None, :].expand(T, K, self.hidden_size)
        h = self._add_lora(x, top_k_index, self.gate_up,
                           expert_projection(x, top_k_index, base.gate_up_proj, graph_safe=graph_safe,
                                             transposed=self.layout.transposed, bias=biases[0]))
        mid = self._gate(h)
        y = self._add_lora(mid, top_k_index, self.down,
                           expert_projection(mid, top_k_index, base.down_proj, graph_safe=graph_safe,
                                             transposed=self.layout.transposed, bias=biases[1]))
        picked = (top_k_index >= 0) & (top_k_index < self.num_experts)
        weights = torch.where(picked, top_k_weights, 0)
        return (y * weights[..., None]).sum(1).to(hidden_states.dtype)
