"""``SavedModule``: a module some adapters trained whole (PEFT's ``modules_to_save``), one copy per slot.

PEFT's ``ModulesToSaveWrapper`` keeps a full copy of the module per adapter and,
in a mixed batch (``adapter_names=``), runs each row through its adapter's copy,
or through the original module for a base row or an adapter without a copy.
``SavedModule`` does the same with per-slot stacked copies preallocated when the
model is wrapped (``weight (L, out, in)`` / ``(L, V, D)``, ``bias (L, out)``, in
the base module's dtype) and a per-slot flag saying which slots hold one, so the
forward pass reads nothing on the host and a captured graph replays with new
batches and adapters (docs/graph-rules.md).

Each row's slot is the batch's ``token_slots`` (a pruned LM head: the rows of
``lm_head_view(pruned=True)``). An embedding gathers ``copy[slot, id]`` per token
(one gather); a linear layer runs the base layer and, for each slot, that slot's
copy over the rows, keeping each row's own (a constant count in graph mode:
every slot; eager: the slots of this batch that hold a copy).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lora_core.adapters import SavedModuleWeights

from .context import LoRAContext, WrapTarget, inference_forward
from .slot_weights import WHOLE_MODULE, ModuleParts

__all__ = ["SavedModule"]


class SavedModule(nn.Module):
    """An ``nn.Linear`` (a projection, an LM head, a classifier head) or an ``nn.Embedding``
    whose rows run through their slot's saved copy when the slot holds one.

    Attributes:
        weight: ``(num_slots, *base.weight.shape)``, the copies (zeros where none is loaded).
        bias: ``(num_slots, out)`` or ``None`` (the base module has no bias).
        held: ``(num_slots,)`` bool, which slots hold a copy.
    """

    def __init__(self, base_layer: nn.Module, context: LoRAContext, *, lm_head: bool = False) -> None:
        super().__init__()
        if not isinstance(base_layer, (nn.Linear, nn.Embedding)):
            raise TypeError("modules_to_save serves nn.Linear and nn.Embedding modules, "
                            f"got {type(base_layer).__name__}")
        self.base_layer = base_layer
        self.context = context
        self.lm_head = lm_head
        self.is_embedding = isinstance(base_layer, nn.Embedding)
        base_weight, base_bias = base_layer.weight, getattr(base_layer, "bias", None)
        self.weight = torch.zeros((context.num_slots, *base_weight.shape), dtype=base_weight.dtype,
                                  device=context.device)
        self.bias = None if base_bias is None else torch.zeros((context.num_slots, base_bias.shape[0]),
                                                                dtype=base_bias.dtype, device=context.device)
        self.held = torch.zeros(context.num_slots, dtype=torch.bool, device=context.device)
        self._held_slots: set[int] = set()  # the host's record of ``held``, for eager batches

    @classmethod
    def can_wrap(cls, module: nn.Module, target: WrapTarget) -> bool:
        return target.saved

    @classmethod
    def wrap(cls, module: nn.Module, context: LoRAContext, target: WrapTarget) -> SavedModule:
        if not isinstance(module, (nn.Linear, nn.Embedding)):
            raise TypeError(f"cannot serve {target.name!r} as a saved module (modules_to_save): only nn.Linear and "
                            f"nn.Embedding modules are, got a {type(module).__name__}")
        return cls(module, context, lm_head=target.lm_head)

    @property
    def bytes_per_slot(self) -> int:
        """The memory one slot's copy takes (weight and bias)."""
        per = self.weight[0].numel() * self.weight.element_size()
        return per + (0 if self.bias is None else self.bias[0].numel() * self.bias.element_size())

    def load_slot(self, slot: int, parts: ModuleParts, slot_scaling: float) -> None:
        """Write one adapter's saved copy (``parts = {WHOLE_MODULE: SavedModuleWeights}``) into ``slot``.

        ``ValueError`` for LoRA weights (a saved module takes no LoRA, as in PEFT) or
        for a copy whose weight or bias is not shaped as the base module's.
        """
        saved = parts.get(WHOLE_MODULE)
        if len(parts) != 1 or not isinstance(saved, SavedModuleWeights):
            raise ValueError("the module is served as a saved module (modules_to_save): it takes an adapter's own "
                             "copy of its weights, not LoRA weights")
        if tuple(saved.weight.shape) != tuple(self.weight.shape[1:]):
            raise ValueError(f"the saved weight has shape {tuple(saved.weight.shape)}, the module's weight "
                             f"{tuple(self.weight.shape[1:])}")
        if (saved.bias is None) != (self.bias is None):
            copy_has, module_has = ("has", "has no") if saved.bias is not None else ("has no", "has")
            raise ValueError(f"the saved copy {copy_has} bias, the module {module_has} bias")
        self.weight[slot].copy_(saved.weight)
        if self.bias is not None:
            self.bias[slot].copy_(saved.bias)
        self.held[slot] = True
        self._held_slots.add(slot)

    def reset_lora(self, slot: int) -> None:
        """Zero ``slot``'s copy; its rows run through the base module again."""
        self.weight[slot].zero_()
        if self.bias is not None:
            self.bias[slot].zero_()
        self.held[slot] = False
        self._held_slots.discard(slot)

    def _row_slots(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(slot, uses_copy)`` per row, ``(rows,)`` each: the slot clamped to a valid index, and
        whether the row runs through that slot's copy (a slot of -1 or without a copy: no)."""
        info = self.context.backend.batch_info
        view = info
        if rows != info.num_tokens and self.lm_head:
            view = info.lm_head_view(pruned=True)
        if rows != view.num_tokens:
            if info.use_graph:  # a graph's rows are its capacity, whatever the batch in it (LM-head rows too)
                expected = f"the graph batch's capacity ({info.capacity} rows, {info.num_real_tokens} of them tokens now)"
            else:
                expected = f"one row per token ({info.num_tokens} tokens)"
                if self.lm_head:
                    requests = info.lm_head_view(pruned=True).num_tokens
                    expected += f" or, for the LM head, one per non-empty request ({requests} requests)"
            raise ValueError(f"a saved module (modules_to_save) got {rows} rows; expected {expected}")
        slots = view.token_slots.long()
        index = slots.clamp(min=0)
        return index, (slots >= 0) & self.held[index]

    def _slots_to_run(self) -> list[int]:
        """The slots whose copies a linear layer runs: every slot in graph mode (a captured
        graph serves any batch) and under ``torch.compile`` (reading the batch's slots would
        guard the compiled code on them), else those of this batch that hold a copy (host values)."""
        info = self.context.backend.batch_info
        if info.use_graph or torch.compiler.is_compiling():
            return list(range(self.weight.shape[0]))
        return sorted(self._held_slots.intersection(info.request_slots))

    @inference_forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Embedding: ``ids (...)`` -> ``(..., D)``; linear: ``x (..., in)`` -> ``(..., out)``.

        Every row gets its slot's copy's output where the slot holds one, else the base module's.
        """
        return self._embed(x) if self.is_embedding else self._linear(x)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        slot, use_copy = self._row_slots(flat.shape[0])
        base = self.base_layer(flat)
        copied = self.weight[slot, flat]
        scale = getattr(self.base_layer, "embed_scale", None)  # Gemma-style scaled embeddings scale the copy too
        if scale is not None:
            copied = copied * scale
        out = torch.where(use_copy[:, None], copied.to(base.dtype), base)
        return out.reshape(*ids.shape, out.shape[-1])

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        slot, use_copy = self._row_slots(x2.shape[0])
        out = self.base_layer(x2)
        for s in self._slots_to_run():
            own = F.linear(x2, self.weight[s], None if self.bias is None else self.bias[s])
            out = torch.where((use_copy & (slot == s))[:, None], own, out)
        return out.reshape(*lead, out.shape[-1])
