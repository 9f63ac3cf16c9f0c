"""``MultiLoRA``: serve many PEFT adapters at once on a plain PyTorch model.

    mlora = MultiLoRA(model, target_modules=["q_proj", "v_proj"], max_loras=4, max_rank=64)
    mlora.load_adapter("sql", "path/to/peft_adapter")      # returns its slot
    mlora.set_batch(seq_lens=[5, 1, 7], adapters=["sql", None, "sql"])
    logits = model(input_ids)                               # called as before
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import torch
from torch import nn

from lora_core import (
    AdapterSlots,
    BatchInfo,
    LoRABackend,
    build_batch_info,
    get_backend,
    load_peft_adapter,
    peft_scaling,
    slice_offsets_from_widths,
)
from lora_core.adapters import LoRAModuleWeights

from .layers import EmbeddingWithLoRA, LinearWithLoRA, LoRAContext, WrapTarget, wrap_module
from .packing import infer_slice_widths

__all__ = ["MultiLoRA"]

Wrapper = LinearWithLoRA | EmbeddingWithLoRA


class MultiLoRA:
    """Wraps ``target_modules`` of ``model`` in place so that each request of a
    batch runs with its own adapter (or none).

    Args:
        model: any ``nn.Module``; targets are matched by full name or last name component.
        target_modules: names of ``nn.Linear`` / ``nn.Embedding`` submodules to wrap.
        max_loras: adapter slots (adapters loaded at once).
        max_rank: the largest adapter rank accepted.
        backend: a registered backend name (``lora_core.available_backends()``), built
            on ``device`` with its default options, or a backend instance (its options
            are its own, e.g. ``TorchNativeBackend(device, graph_kernel="blocked")``).
            The backend holds the current batch.
        packed_modules: fused projections and the adapter modules they hold, e.g.
            ``{"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}``.
        slice_widths: explicit widths of packed modules, when they cannot be inferred.
        lm_head_modules: names wrapped as LM heads (accept every token or one per request).
        strict_token_ids: embedding layers raise on out-of-vocabulary ids instead of
            giving them a zero delta (eager calls only).
    """

    def __init__(
        self,
        model: nn.Module,
        target_modules: Sequence[str],
        *,
        max_loras: int = 4,
        max_rank: int = 64,
        backend: str | LoRABackend = "torch_native",
        packed_modules: Mapping[str, Sequence[str]] | None = None,
        slice_widths: Mapping[str, Sequence[int]] | None = None,
        lm_head_modules: Sequence[str] = ("lm_head",),
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        strict_token_ids: bool = False,
    ) -> None:
        param = next(model.parameters(), None)
        device = torch.device(device) if device is not None else (param.device if param is not None else torch.device("cpu"))
        dtype = dtype or (param.dtype if param is not None else torch.float32)
        self.model = model
        self.slots = AdapterSlots(max_loras, max_rank)
        backend_obj = get_backend(backend)(device) if isinstance(backend, str) else backend
        backend_device = getattr(backend_obj, "device", device)
        if backend_device.type != device.type or (None not in (backend_device.index, device.index)
                                                 and backend_device.index != device.index):
            raise ValueError(f"backend runs on {backend_device} but the model's LoRA buffers live on {device}; "
                             f"build the backend with device={str(device)!r}")
        self.context = LoRAContext(backend_obj, num_slots=max_loras, max_rank=max_rank, dtype=dtype,
                                   device=device, strict_token_ids=strict_token_ids)
        self.packed_modules = {k: list(v) for k, v in (packed_modules or {}).items()}
        self._graph_mode = False
        self.wrapped: dict[str, Wrapper] = {}
        self._originals: dict[str, nn.Module] = {}
        self._wrap(list(target_modules), dict(slice_widths or {}), set(lm_head_modules))

    # ----------------------------------------------------------------- wrapping
    def _wrap(self, targets: list[str], slice_widths: dict, lm_heads: set[str]) -> None:
        matched: set[str] = set()
        for name, module in list(self.model.named_modules()):
            last = name.rsplit(".", 1)[-1]
            hit = name if name in targets else last if last in targets else None
            if hit is None:
                continue
            matched.add(hit)
            wrapper = self._make_wrapper(name, last, module, slice_widths, lm_heads)
            parent = self.model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else self.model
            setattr(parent, last, wrapper)
            self._originals[name] = module
            self.wrapped[name] = wrapper
        missing = [t for t in targets if t not in matched]
        if missing:
            raise ValueError(f"target_modules {missing} match no submodule of {type(self.model).__name__}")

    def _make_wrapper(self, name: str, last: str, module: nn.Module, slice_widths: dict, lm_heads: set[str]):
        widths = None
        if last in self.packed_modules and last not in lm_heads:
            parts = self.packed_modules[last]
            widths = tuple(slice_widths.get(last) or infer_slice_widths(name, module, parts, self.model))
        return wrap_module(module, self.context, WrapTarget(name, slice_widths=widths, lm_head=last in lm_heads))

    def unwrap(self) -> nn.Module:
        """Put the original modules back; returns the model."""
        for name, original in self._originals.items():
            parent = self.model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else self.model
            setattr(parent, name.rsplit(".", 1)[-1], original)
        self._originals.clear()
        self.wrapped.clear()
        return self.model

    # ----------------------------------------------------------------- adapters
    def _locate(self, adapter: str, module: str) -> tuple[str, int]:
        """The wrapped module and slice an adapter module's weights go to."""
        if module in self.wrapped:
            return module, -1  # the whole module (every slice, for a packed module trained fused)
        parent, _, last = module.rpartition(".")
        for packed, parts in self.packed_modules.items():
            if last in parts:
                target = f"{parent}.{packed}" if parent else packed
                if target in self.wrapped:
                    return target, parts.index(last)
        wrapped = ", ".join(sorted(self.wrapped)) or "none"
        raise ValueError(f"adapter {adapter!r} targets {module!r}, which is not wrapped (wrapped: {wrapped})")

    def load_adapter(self, name: str, path: str | Path) -> int:
        """Load a PEFT adapter directory into a free slot; returns the slot."""
        adapter = load_peft_adapter(path)
        if adapter.rank > self.slots.max_rank:
            raise ValueError(f"adapter {name!r} has rank {adapter.rank}, more than max_rank = {self.slots.max_rank}")
        plan: dict[str, dict[int, LoRAModuleWeights]] = {}
        for module_name, weights in adapter.modules.items():
            target, index = self._locate(name, module_name)
            plan.setdefault(target, {})[index] = weights
        cfg = adapter.config
        slot_scaling = peft_scaling(cfg["lora_alpha"], cfg["r"], adapter.use_rslora)
        slot = self.slots.assign(name, adapter.rank, slot_scaling)
        try:
            for target, wrapper in self.wrapped.items():
                if target in plan:
                    self._load_module(name, target, wrapper, slot, plan[target], slot_scaling)
                else:
                    wrapper.reset_lora(slot)
        except Exception:
            self.slots.release(name)
            for wrapper in self.wrapped.values():
                wrapper.reset_lora(slot)
            raise
        self._sync_adapters()
        return slot

    def _load_module(self, adapter: str, target: str, wrapper: Wrapper, slot: int,
                     parts: dict[int, LoRAModuleWeights], slot_scaling: float) -> None:
        def folded(w: LoRAModuleWeights) -> torch.Tensor:
            # the slot applies slot_scaling; a module with its own alpha/rank pattern folds the ratio into B
            return w.lora_b * (w.scaling / slot_scaling) if w.scaling != slot_scaling else w.lora_b

        try:
            if isinstance(wrapper, EmbeddingWithLoRA):
                (w,) = parts.values()
                if w.kind != "embedding":
                    raise ValueError("expected lora_embedding_A/B weights for an embedding")
                wrapper.set_lora(slot, w.lora_a, folded(w))
                return
            if any(w.kind != "linear" for w in parts.values()):
                raise ValueError("expected lora_A/lora_B weights for a linear layer")
            if -1 in parts:  # one pair for the whole (possibly packed) module: split B by slice
                w = parts[-1]
                widths = getattr(wrapper, "full_slice_widths", None) or wrapper.buffers.slice_widths
                b, offsets = folded(w), slice_offsets_from_widths(widths)
                if b.shape[0] != offsets[-1]:
                    raise ValueError(f"lora_B has {b.shape[0]} rows, the layer has {offsets[-1]} outputs")
                slices = [(w.lora_a, b[offsets[i] : offsets[i + 1]]) for i in range(wrapper.num_slices)]
            else:
                slices = [(parts[i].lora_a, folded(parts[i])) if i in parts else None for i in range(wrapper.num_slices)]
            wrapper.set_lora(slot, slices)
        except ValueError as err:
            raise ValueError(f"adapter {adapter!r} does not fit module {target!r}: {err}") from None

    def unload_adapter(self, name: str) -> None:
        """Free ``name``'s slot (and zero its weights)."""
        slot = self._slot_of(name)
        self.slots.release(name)
        for wrapper in self.wrapped.values():
            wrapper.reset_lora(slot)
        self._sync_adapters()

    def _slot_of(self, name: str) -> int:
        try:
            return self.slots.slot_of(name)
        except KeyError as err:
            raise ValueError(err.args[0]) from None

    @property
    def backend(self) -> LoRABackend:
        """The backend: it runs the LoRA ops and holds the current batch."""
        return self.context.backend

    def _sync_adapters(self) -> None:
        if self._graph_mode:
            self.backend.batch_info.set_adapters(self.slots.lora_ranks, self.slots.scalings)

    # ------------------------------------------------------------------ batches
    def set_batch(self, seq_lens: Sequence[int], adapters: Sequence[str | None]) -> BatchInfo:
        """Describe the next forward pass: tokens per request and each request's adapter
        (``None`` = base model). In graph mode the preallocated batch is refilled in place."""
        if len(seq_lens) != len(adapters):
            raise ValueError(f"seq_lens and adapters must have one entry per request; got {len(seq_lens)} and {len(adapters)}")
        slot_ids = [None if a is None else self._slot_of(a) for a in adapters]
        if self._graph_mode:
            info = self.backend.batch_info
            info.refill(seq_lens, slot_ids)  # in place: the backend's plans are refilled with it
            return info
        info = build_batch_info(seq_lens, slot_ids, self.slots.lora_ranks, self.slots.scalings,
                                device=self.context.device, max_rank=self.slots.max_rank)
        self.backend.prepare_batch(info)
        return info

    def enable_graph(self, max_tokens: int) -> BatchInfo:
        """Preallocate a graph-mode batch of ``max_tokens`` rows; afterwards ``set_batch``
        refills it in place so a captured forward replays with new batches. The model
        is then called with exactly ``max_tokens`` rows (padding rows use no adapter)."""
        info = self.backend.init_graph_batch_info(max_tokens, self.slots.lora_ranks, self.slots.scalings)
        self.backend.prepare_batch(info)
        self._graph_mode = True
        return info

