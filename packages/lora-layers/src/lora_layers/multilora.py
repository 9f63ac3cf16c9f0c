"""``MultiLoRA``: serve many PEFT adapters at once on a plain PyTorch or transformers model.

    mlora = MultiLoRA.from_adapters(model, {"sql": "path/to/sql", "chat": "path/to/chat"})
    with mlora.route(["sql", None, "chat"]):                  # one adapter (or None) per row
        out = model.generate(input_ids, attention_mask=mask, max_new_tokens=16)

    mlora = MultiLoRA(model, target_modules=["q_proj", "v_proj"], max_loras=4, max_rank=64)
    mlora.load_adapter("sql", "path/to/peft_adapter")      # returns its slot
    mlora.set_batch(seq_lens=[5, 1, 7], adapters=["sql", None, "sql"])   # a flattened ragged batch
    logits = model(input_ids)                               # called as before
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import torch
from torch import nn

from lora_core import (
    AdapterSlots,
    BatchInfo,
    LoRABackend,
    PeftAdapter,
    build_batch_info,
    get_backend,
    load_peft_adapter,
    peft_scaling,
    slice_offsets_from_widths,
)
from lora_core.adapter_config import matched_modules
from lora_core.checks import check_device
from lora_core.adapters import LoRAModuleWeights

from .layers import EmbeddingWithLoRA, LinearWithLoRA, LoRAContext, WrapTarget, is_conv1d, wrap_module
from .packing import infer_slice_widths

__all__ = ["MultiLoRA"]

Wrapper = LinearWithLoRA | EmbeddingWithLoRA

PEFT_BASE = "__base__"
"""PEFT's name for "no adapter" in ``adapter_names``; ``route`` accepts it as well as ``None``."""

EVICTION_POLICIES = (None, "lru")
_BATCH_CACHE_SIZE = 16


def _output_embedding_name(model: nn.Module) -> str | None:
    """The full name of a transformers model's LM head (``get_output_embeddings()``), if it has one."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if head is None:
        return None
    return next((name for name, m in model.named_modules() if m is head), None)


class MultiLoRA:
    """Wraps ``target_modules`` of ``model`` in place so that each request of a
    batch runs with its own adapter (or none).

    Serving is inference only: wrapped layers run without autograd (also when
    the model is called with grad mode on; see
    :func:`lora_layers.layers.inference_forward`).

    Args:
        model: any ``nn.Module``; targets are matched by full name or last name component.
        target_modules: names of ``nn.Linear`` / ``nn.Embedding`` / transformers ``Conv1D``
            submodules to wrap (:meth:`from_adapters` reads them from the adapters instead).
        max_loras: adapter slots (adapters loaded at once).
        max_rank: the largest adapter rank accepted.
        backend: a registered backend name (``lora_core.available_backends()``), built
            on ``device`` with its default options, or a backend instance (its options
            are its own, e.g. ``TorchNativeBackend(device, graph_kernel="blocked")``).
            The backend holds the current batch.
        packed_modules: fused projections and the adapter modules they hold, e.g.
            ``{"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}``.
        slice_widths: explicit widths of packed modules, when they cannot be inferred.
        lm_head_modules: names (full, or last component) wrapped as LM heads (accept
            every token or one per request).
        strict_token_ids: embedding layers raise on out-of-vocabulary ids instead of
            giving them a zero delta (eager calls only).
        eviction: what :meth:`load_adapter` does when every slot is taken: ``None``
            (default) raises; ``"lru"`` unloads the adapter used least recently by a
            batch (``set_batch`` / ``route``), never one of the active route.
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
        eviction: str | None = None,
    ) -> None:
        if eviction not in EVICTION_POLICIES:
            raise ValueError(f"eviction must be one of {EVICTION_POLICIES}, got {eviction!r}")
        if isinstance(target_modules, str):
            raise TypeError(f"target_modules must be a list of names, got the string {target_modules!r}")
        param = next(model.parameters(), None)
        device = check_device("device", device) if device is not None else (
            param.device if param is not None else torch.device("cpu"))
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
        self.eviction = eviction
        self._slice_widths = dict(slice_widths or {})
        self._lm_heads = set(lm_head_modules)
        self._graph_mode = False
        self._auto_wrap = False
        self._route: list[str | None] | None = None
        self._batches: OrderedDict[tuple, BatchInfo] = OrderedDict()
        self._last_used: dict[str, int] = {}
        self._uses = 0
        self.wrapped: dict[str, Wrapper] = {}
        self._originals: dict[str, nn.Module] = {}
        self._wrap(list(target_modules))
        self._hook = model.register_forward_pre_hook(self._pre_forward, with_kwargs=True)

    @classmethod
    def from_adapters(
        cls,
        model: nn.Module,
        adapters: Mapping[str, str | Path],
        *,
        max_loras: int | None = None,
        max_rank: int | None = None,
        backend: str | LoRABackend = "torch_native",
        lm_head_modules: Sequence[str] | None = None,
        **options: Any,
    ) -> MultiLoRA:
        """Wrap what the adapters were trained on, and load them.

        Each adapter's ``target_modules`` (a list or a regex, ``"all-linear"``),
        ``exclude_modules`` and ``layers_to_transform`` / ``layers_pattern`` are
        matched against ``model``'s module names by PEFT's rules
        (:mod:`lora_core.adapter_config`); the union is wrapped and every adapter is
        loaded, in order, into slots ``0, 1, ...``.

        Args:
            adapters: adapter name -> PEFT adapter directory.
            max_loras: slots; default: one per adapter (pass more to load others later).
            max_rank: default: the largest rank of the adapters (``r`` and
                ``rank_pattern``); pass more to load higher-rank adapters later.
            lm_head_modules: default: the model's output embedding
                (``get_output_embeddings()``), else ``lm_head``.
            options: the other keyword arguments of :class:`MultiLoRA` (``packed_modules``,
                ``device``, ``dtype``, ``eviction``, ...).

        Adapters loaded later with :meth:`load_adapter` wrap the further modules
        they target, too (eager mode; their other slots hold zeros).
        """
        if not isinstance(adapters, Mapping):
            raise TypeError("adapters must map adapter names to PEFT adapter directories, "
                            f"e.g. {{'sql': 'path/to/sql'}}; got {type(adapters).__name__}")
        if not adapters:
            raise ValueError("from_adapters needs at least one adapter")
        loaded = {name: load_peft_adapter(path) for name, path in adapters.items()}
        if lm_head_modules is None:
            head = _output_embedding_name(model)
            lm_head_modules = (head,) if head else ("lm_head",)
        mlora = cls(model, [], max_loras=max_loras or len(loaded),
                    max_rank=max_rank or max(a.rank for a in loaded.values()),
                    backend=backend, lm_head_modules=lm_head_modules, **options)
        mlora._auto_wrap = True
        try:
            for name, adapter in loaded.items():
                mlora._load(name, adapter)
        except Exception:
            mlora.unwrap()
            raise
        return mlora

    # ----------------------------------------------------------------- wrapping
    def _wrap(self, targets: list[str]) -> None:
        """Wrap every submodule whose full name or last component is in ``targets``."""
        matched: set[str] = set()
        for name, module in list(self.model.named_modules()):
            last = name.rsplit(".", 1)[-1]
            hit = name if name in targets else last if last in targets else None
            if hit is None or name in self.wrapped:
                continue
            matched.add(hit)
            self._wrap_one(name, module)
        missing = [t for t in targets if t not in matched]
        if missing:
            raise ValueError(f"target_modules {missing} match no submodule of {type(self.model).__name__}")

    def _wrap_one(self, name: str, module: nn.Module) -> Wrapper:
        last = name.rsplit(".", 1)[-1]
        lm_head = name in self._lm_heads or last in self._lm_heads
        widths = None
        if last in self.packed_modules and not lm_head:
            parts = self.packed_modules[last]
            widths = tuple(self._slice_widths.get(last) or infer_slice_widths(name, module, parts, self.model))
        wrapper = wrap_module(module, self.context, WrapTarget(name, slice_widths=widths, lm_head=lm_head))
        parent = self.model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else self.model
        setattr(parent, last, wrapper)
        self._originals[name] = module
        self.wrapped[name] = wrapper
        return wrapper

    def _base_modules(self) -> dict[str, nn.Module]:
        """The model's modules by name as the adapters knew them: wrapped modules are
        their original modules, and a wrapper's own submodules are not listed."""
        found: dict[str, nn.Module] = {}
        inside: str | None = None
        for name, module in self.model.named_modules():
            if inside is not None and name.startswith(inside):
                continue  # named_modules is pre-order: a wrapper's submodules follow it
            inside = None
            if name in self.wrapped:
                found[name] = self._originals[name]
                inside = name + "."
            elif name:
                found[name] = module
        return found

    def _adapter_targets(self, adapter: PeftAdapter) -> dict[str, str]:
        """PEFT module name -> the module of ``model`` it lives in, for every module the
        adapter's config targets (a packed module's parts map to the packed module)."""
        modules = self._base_modules()
        candidates = {name: name for name in modules}
        for name in modules:
            parent, _, last = name.rpartition(".")
            for part in self.packed_modules.get(last, ()):
                candidates.setdefault(f"{parent}.{part}" if parent else part, name)
        linear = {n for n, m in modules.items() if isinstance(m, nn.Linear) or is_conv1d(m)}
        hits = matched_modules(adapter.config, candidates, linear_modules=linear,
                               output_embedding=_output_embedding_name(self.model))
        return {hit: candidates[hit] for hit in hits}

    def _wrap_for(self, name: str, adapter: PeftAdapter) -> None:
        """Wrap the modules ``adapter`` targets that are not wrapped yet (eager mode)."""
        targets = self._adapter_targets(adapter)
        base = self._base_modules()
        without = sorted(t for t in targets if t not in adapter.modules)
        if without:
            shown = ", ".join(without[:3]) + (", ..." if len(without) > 3 else "")
            warnings.warn(f"adapter {name!r}: its target_modules match {len(without)} module(s) it holds no LoRA "
                          f"weights for ({shown}); was it trained on this model?", stacklevel=3)
        for module_name in sorted({targets[t] for t in targets if t in adapter.modules} - set(self.wrapped)):
            if self._graph_mode:
                raise ValueError(f"adapter {name!r} targets {module_name!r}, which is not wrapped; in graph mode the "
                                 "wrapped modules are fixed (wrap it before enable_graph)")
            self._wrap_one(module_name, base[module_name])

    def unwrap(self) -> nn.Module:
        """Put the original modules back and remove the routing hook; returns the model."""
        for name, original in self._originals.items():
            parent = self.model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else self.model
            setattr(parent, name.rsplit(".", 1)[-1], original)
        self._originals.clear()
        self.wrapped.clear()
        self._hook.remove()
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

    def load_adapter(self, name: str, path: str | Path, *, replace: bool = False) -> int:
        """Load a PEFT adapter directory into a free slot; returns the slot.

        ``replace=True`` reloads an adapter already loaded under ``name`` (its slot is
        freed first). When every slot is taken, the ``eviction`` policy decides: by
        default this raises; with ``eviction="lru"`` the least recently used adapter
        is unloaded. A :meth:`from_adapters` instance also wraps the modules the
        adapter targets that are not wrapped yet.
        """
        return self._load(name, load_peft_adapter(path), replace=replace)

    def _load(self, name: str, adapter: PeftAdapter, *, replace: bool = False) -> int:
        if not isinstance(name, str) or not name or name == PEFT_BASE:
            raise ValueError(f"adapter name must be a non-empty str other than {PEFT_BASE!r}, got {name!r}")
        if adapter.rank > self.slots.max_rank:
            raise ValueError(f"adapter {name!r} has rank {adapter.rank}, more than max_rank = {self.slots.max_rank} "
                             "(the buffers' rank is fixed when the model is wrapped: pass a larger max_rank)")
        if name in self.slots.loaded and not replace:
            raise ValueError(f"adapter {name!r} is already loaded in slot {self.slots.loaded[name]}; "
                             "pass replace=True to load it again, or unload_adapter it first")
        if self._auto_wrap:
            self._wrap_for(name, adapter)
        plan: dict[str, dict[int, LoRAModuleWeights]] = {}
        for module_name, weights in adapter.modules.items():
            target, index = self._locate(name, module_name)
            plan.setdefault(target, {})[index] = weights
        if name in self.slots.loaded:
            self.unload_adapter(name)
        elif len(self.slots.loaded) == self.slots.num_slots:
            if self.eviction != "lru":
                raise RuntimeError(f"all {self.slots.num_slots} adapter slots are in use "
                                   f"({', '.join(sorted(self.slots.loaded))}); unload_adapter one first, or build "
                                   "with eviction='lru' or more max_loras")
            self.unload_adapter(self._least_recently_used())
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

    def _least_recently_used(self) -> str:
        active = set(self._route or ())
        candidates = [n for n in self.slots.loaded if n not in active]
        if not candidates:
            raise RuntimeError(f"all {self.slots.num_slots} adapter slots hold adapters of the active route "
                               f"({', '.join(sorted(self.slots.loaded))}); none can be evicted")
        return min(candidates, key=lambda n: (self._last_used.get(n, -1), self.slots.loaded[n]))

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
        """Free ``name``'s slot (and zero its weights); the modules stay wrapped."""
        slot = self._slot_of(name)
        self.slots.release(name)
        self._last_used.pop(name, None)
        for wrapper in self.wrapped.values():
            wrapper.reset_lora(slot)
        self._sync_adapters()

    @property
    def adapters(self) -> dict[str, int]:
        """The loaded adapters and their slots."""
        return self.slots.loaded

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
        self._batches.clear()  # cached eager batches carry the old ranks and scalings
        if self._graph_mode:
            self.backend.batch_info.set_adapters(self.slots.lora_ranks, self.slots.scalings)

    # ------------------------------------------------------------------ batches
    def set_batch(self, seq_lens: Sequence[int], adapters: Sequence[str | None]) -> BatchInfo:
        """Describe the next forward pass: tokens per request and each request's adapter
        (``None`` = base model). In graph mode the preallocated batch is refilled in place.

        For a flattened ragged batch; a ``(B, S)`` input of B requests is routed per
        call by :meth:`route`. Eager batches are kept (a few, most recent first), so a
        repeated layout (decode steps) reuses its batch info and plans."""
        if len(seq_lens) != len(adapters):
            raise ValueError(f"seq_lens and adapters must have one entry per request; got {len(seq_lens)} and {len(adapters)}")
        slot_ids = [None if a is None else self._slot_of(a) for a in adapters]
        self._uses += 1
        for a in adapters:
            if a is not None:
                self._last_used[a] = self._uses
        if self._graph_mode:
            info = self.backend.batch_info
            info.refill(seq_lens, slot_ids)  # in place: the backend's plans are refilled with it
            return info
        lens = tuple(seq_lens)
        key = (lens, tuple(slot_ids)) if set(map(type, lens)) <= {int} else None  # plain ints only: 2.0 == 2
        info = self._batches.get(key) if key is not None else None
        if info is None:
            info = build_batch_info(seq_lens, slot_ids, self.slots.lora_ranks, self.slots.scalings,
                                    device=self.context.device, max_rank=self.slots.max_rank)
            if key is not None:
                self._batches[key] = info
                if len(self._batches) > _BATCH_CACHE_SIZE:
                    self._batches.popitem(last=False)
        else:
            self._batches.move_to_end(key)
        self.backend.prepare_batch(info)
        return info

    # ------------------------------------------------------------------ routing
    def _check_route(self, adapters: Sequence[str | None]) -> list[str | None]:
        if isinstance(adapters, str) or not isinstance(adapters, Sequence):
            raise TypeError(f"adapters must be a list with one adapter name (or None) per row, got {adapters!r}")
        names = [None if a is None or a == PEFT_BASE else a for a in adapters]
        if not names:
            raise ValueError("a route needs one adapter name (or None) per row; got none")
        for a in names:
            if a is not None:
                self._slot_of(a)  # an unknown name raises here, naming the loaded ones
        return names

    @contextmanager
    def route(self, adapters: Sequence[str | None]) -> Iterator[MultiLoRA]:
        """Route the rows of every model call inside the block: row ``i`` of a ``(B, S)``
        input uses ``adapters[i]`` (``None`` or ``"__base__"``: the base model).

        Each call of ``model`` (its forward pre-hook) describes its own batch from its
        input (``input_ids``, the first positional argument, or ``inputs_embeds``; a
        floating-point input is ``(B, S, H)`` features, an integer one ``(B, S)`` ids): B
        requests of S tokens each, in row-major order, so prefill, padded prompts (left or
        right: a padding token gets its row's adapter, as in PEFT) and KV-cache decode steps
        of ``model.generate(...)`` all get the right batch. When the input has ``k * len(adapters)``
        rows (``num_beams`` or ``num_return_sequences = k`` in generate) each adapter covers
        ``k`` consecutive rows. A 1-D input is one request (one adapter). Routes nest; the
        batch of a call inside a route replaces whatever :meth:`set_batch` described.

            with mlora.route(["sql", None, "chat"]):
                out = model.generate(input_ids, attention_mask=mask, max_new_tokens=8)
        """
        names = self._check_route(adapters)
        previous, self._route = self._route, names
        try:
            yield self
        finally:
            self._route = previous

    def generate(self, *args: Any, adapter_names: Sequence[str | None], **kwargs: Any) -> Any:
        """``model.generate(*args, **kwargs)`` with one adapter per input row (PEFT's
        ``generate(..., adapter_names=[...])``); the same as inside :meth:`route`."""
        with self.route(adapter_names):
            return self.model.generate(*args, **kwargs)

    @staticmethod
    def _layout(args: tuple, kwargs: dict) -> tuple[int, int]:
        """``(rows, tokens per row)`` of a model call's input."""
        x = kwargs.get("input_ids")
        if x is None and args and isinstance(args[0], torch.Tensor):
            x = args[0]
        if x is None:
            x = kwargs.get("inputs_embeds")
        if not isinstance(x, torch.Tensor):
            raise ValueError("a routed model call needs its input as a tensor: token ids (input_ids or the first "
                             "positional argument) or inputs_embeds")
        features = x.is_floating_point()  # embeddings or hidden states: (..., H)
        dims = x.dim() - features
        if dims == 2:
            return int(x.shape[0]), int(x.shape[1])
        if dims == 1:
            return 1, int(x.shape[0])
        raise ValueError(f"a routed model call needs (B, S) token ids or (B, S, H) embeddings, "
                         f"got {'embeddings' if features else 'ids'} of shape {tuple(x.shape)}")

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """The model's forward pre-hook: a PEFT-style ``adapter_names=`` argument, or the
        active :meth:`route`, becomes this call's batch."""
        route = self._route
        if "adapter_names" in kwargs:
            route = self._check_route(kwargs.pop("adapter_names"))
        elif route is None:
            return None
        rows, length = self._layout(args, kwargs)
        if rows % len(route):
            raise ValueError(f"the route has {len(route)} adapters but the model was called with {rows} rows; "
                             "give one adapter per row (or per request of num_beams / num_return_sequences rows)")
        k = rows // len(route)
        adapters = route if k == 1 else [a for a in route for _ in range(k)]
        self.set_batch([length] * rows, adapters)
        return args, kwargs

    def enable_graph(self, max_tokens: int) -> BatchInfo:
        """Preallocate a graph-mode batch of ``max_tokens`` rows; afterwards ``set_batch``
        refills it in place so a captured forward replays with new batches. The model
        is then called with exactly ``max_tokens`` rows (padding rows use no adapter)."""
        info = self.backend.init_graph_batch_info(max_tokens, self.slots.lora_ranks, self.slots.scalings)
        self.backend.prepare_batch(info)
        self._graph_mode = True
        return info

