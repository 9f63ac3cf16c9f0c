"""``MultiLoRA``: serve many PEFT adapters at once on a plain PyTorch or transformers model.

    mlora = MultiLoRA.from_adapters(model, {"sql": "path/to/sql", "chat": "path/to/chat"})
    with mlora.route(["sql", None, "chat"]):                  # one adapter (or None) per row
        out = model.generate(input_ids, attention_mask=mask, max_new_tokens=16)

    mlora = MultiLoRA(model, target_modules=["q_proj", "v_proj"], max_loras=4, max_rank=64)
    mlora.load_adapter("sql", "path/to/peft_adapter")      # returns its slot
    mlora.set_batch(seq_lens=[5, 1, 7], adapters=["sql", None, "sql"])   # a flattened ragged batch
    logits = model(input_ids)                               # called as before

``MultiLoRA`` is a front over modules with one job each: :mod:`.targeting` (PEFT's
target rules; wrapping and unwrapping modules), :mod:`.slots` (loading, replacing,
LRU eviction), :mod:`.batches` (the eager batch cache), :mod:`.routing` (the
forward pre-hook) and :mod:`.graph_mode` (the preallocated batch). The layer kinds
in :mod:`.layers` load their own weights; nothing here names one.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import torch
from torch import nn

from lora_core import AdapterSlots, BatchInfo, LoRABackend, PeftAdapter, get_backend, load_peft_adapter
from lora_core.checks import check_device, check_float_dtype

from .batches import BatchCache
from .graph_mode import GraphMode
from .layers import LayerKind, LoRAContext
from .mixes import AdapterEntry, MixResolver, adapter_names
from .routing import PEFT_BASE, Router  # noqa: F401  (PEFT_BASE: importable from here as before)
from .slots import EVICTION_POLICIES, SlotTable, check_eviction  # noqa: F401  (EVICTION_POLICIES: likewise)
from .targeting import TargetModules, name_parameter_targets, output_embedding_name

__all__ = ["MultiLoRA"]


def _placement(model: nn.Module, device: torch.device | str | None,
               lora_dtype: torch.dtype | None) -> tuple[torch.device, torch.dtype]:
    """Device and dtype of the LoRA buffers and math: as given, else the model's (its first
    floating-point parameter's), else CPU float32."""
    param = next((p for p in model.parameters() if p.is_floating_point()), None)
    device = check_device("device", device) if device is not None else (
        param.device if param is not None else torch.device("cpu"))
    if lora_dtype is None:
        return device, param.dtype if param is not None else torch.float32
    if not isinstance(lora_dtype, torch.dtype) or not lora_dtype.is_floating_point:
        raise TypeError("lora_dtype must be a floating-point torch.dtype (torch.float32, torch.float16 or "
                        f"torch.bfloat16), got {lora_dtype!r}")
    check_float_dtype("lora_dtype", lora_dtype)  # one the backends run: float64 is refused here, by name
    return device, lora_dtype


def _build_context(backend: str | LoRABackend, *, max_loras: int, max_rank: int, device: torch.device,
                   lora_dtype: torch.dtype, strict_token_ids: bool, dora: bool = False) -> LoRAContext:
    """The wrappers' shared context: the backend (built on ``device`` by name, or the
    instance given, which must run there) and the LoRA buffers' shape, dtype, device."""
    if isinstance(backend, str):
        backend_cls = get_backend(backend)
        backend_obj = backend_cls(device, strict_token_ids=True) if strict_token_ids else backend_cls(device)
    else:
        backend_obj = backend
        if strict_token_ids and not getattr(backend, "strict_token_ids", False):
            raise ValueError("strict_token_ids=True is the backend's option, and this backend instance was built "
                             f"without it: build it with {type(backend).__name__}(..., strict_token_ids=True)")
    backend_device = getattr(backend_obj, "device", device)
    if backend_device.type != device.type or (None not in (backend_device.index, device.index)
                                             and backend_device.index != device.index):
        raise ValueError(f"backend runs on {backend_device} but the model's LoRA buffers live on {device}; "
                         f"build the backend with device={str(device)!r}")
    return LoRAContext(backend_obj, num_slots=max_loras, max_rank=max_rank, dtype=lora_dtype, device=device,
                       dora=dora)


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
        device: where the LoRA buffers live; default: the model's.
        lora_dtype: the dtype of the LoRA buffers and of the shrink/expand math
            (``torch.float32``, ``torch.float16`` or ``torch.bfloat16``); default: the
            model's. Adapters are stored in it (an fp32 adapter stays fp32 on a bf16
            model with ``lora_dtype=torch.float32``); each wrapped layer converts its
            activations to it once per call and adds the delta to its base output in
            the base layer's dtype, so the model's output dtype never changes.
        strict_token_ids: the backend's option of that name: out-of-vocabulary token
            ids raise ``ValueError`` naming them instead of getting a zero delta
            (eager calls only). A backend built by name is built with it; a backend
            instance must have been built with it (``ValueError`` otherwise).
        eviction: what :meth:`load_adapter` does when every slot is taken: ``None``
            (default) raises; ``"lru"`` unloads the adapter used least recently by a
            batch (``set_batch`` / ``route``), never one of the active route.
        dora: the linear layers keep per-slot DoRA factors and rescale each row by its
            slot's (``LoRAContext``), so DoRA adapters (PEFT's ``use_dora``) can be loaded;
            without it loading one raises. :meth:`from_adapters` sets it when one of its
            adapters uses DoRA.
        modules_to_save: names (full, or last component) of ``nn.Linear`` / ``nn.Embedding``
            modules that adapters train whole (PEFT's ``modules_to_save``: ``lm_head``,
            ``embed_tokens``, a classifier ``score``): each gets a copy per slot
            (:class:`~lora_layers.layers.SavedModule`), and a row runs through its
            adapter's copy, or the base module when the adapter saved none.
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
        lora_dtype: torch.dtype | None = None,
        strict_token_ids: bool = False,
        eviction: str | None = None,
        dora: bool = False,
        modules_to_save: Sequence[str] = (),
    ) -> None:
        check_eviction(eviction)
        if isinstance(target_modules, str):
            raise TypeError(f"target_modules must be a list of names, got the string {target_modules!r}")
        if isinstance(modules_to_save, str):
            raise TypeError(f"modules_to_save must be a list of names, got the string {modules_to_save!r}")
        device, lora_dtype = _placement(model, device, lora_dtype)
        self.model = model
        self._slot_table = SlotTable(max_loras, max_rank, eviction=eviction, on_change=self._sync_adapters)
        self.context = _build_context(backend, max_loras=max_loras, max_rank=max_rank, device=device,
                                      lora_dtype=lora_dtype, strict_token_ids=strict_token_ids, dora=dora)
        self._targets = TargetModules(model, self.context, packed_modules=packed_modules,
                                      slice_widths=slice_widths, lm_head_modules=lm_head_modules,
                                      modules_to_save=modules_to_save)
        self._batches = BatchCache(self.context.device)
        self._graph = GraphMode(self.context.backend)
        self._auto_wrap = False
        self._targets.wrap(list(target_modules) + [m for m in modules_to_save if m not in target_modules])
        self._unmixable: dict[str, str] = {}
        self._mixes = MixResolver(self._slot_table.slot_of, self._unmixable.get)
        self._router = Router(model, self._mixes.resolve, self.set_batch)

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
        loaded, in order, into slots ``0, 1, ...``. The modules an adapter trained
        whole (``modules_to_save``) are wrapped as saved modules, a copy per slot.

        Args:
            adapters: adapter name -> PEFT adapter directory.
            max_loras: slots; default: one per adapter (pass more to load others later).
            max_rank: default: the largest rank of the adapters (``r`` and
                ``rank_pattern``); pass more to load higher-rank adapters later.
            lm_head_modules: default: the model's output embedding
                (``get_output_embeddings()``), else ``lm_head``.
            options: the other keyword arguments of :class:`MultiLoRA` (``packed_modules``,
                ``device``, ``lora_dtype``, ``eviction``, ``modules_to_save`` for modules
                that adapters loaded later save, ...).

        Adapters loaded later with :meth:`load_adapter` wrap the further modules
        they target, too (eager mode; their other slots hold zeros).
        """
        if not isinstance(adapters, Mapping):
            raise TypeError("adapters must map adapter names to PEFT adapter directories, "
                            f"e.g. {{'sql': 'path/to/sql'}}; got {type(adapters).__name__}")
        if not adapters:
            raise ValueError("from_adapters needs at least one adapter")
        modules = dict(model.named_modules())
        loaded = {name: name_parameter_targets(name, load_peft_adapter(path), modules)
                  for name, path in adapters.items()}
        options.setdefault("dora", any(a.use_dora for a in loaded.values()))
        if lm_head_modules is None:
            head = output_embedding_name(model)
            lm_head_modules = (head,) if head else ("lm_head",)
        saved = sorted({m for a in loaded.values() for m in a.saved_modules} | set(options.pop("modules_to_save", ())))
        mlora = cls(model, [], max_loras=max_loras or len(loaded),
                    max_rank=max_rank or max(a.rank for a in loaded.values()),
                    backend=backend, lm_head_modules=lm_head_modules, modules_to_save=saved, **options)
        mlora._auto_wrap = True
        try:
            for name, adapter in loaded.items():
                mlora._load(name, adapter)
        except Exception:
            mlora.unwrap()
            raise
        return mlora

    # ---------------------------------------------------------------- the parts
    @property
    def backend(self) -> LoRABackend:
        """The backend: it runs the LoRA ops and holds the current batch."""
        return self.context.backend

    @property
    def wrapped(self) -> dict[str, LayerKind]:
        """The wrapped modules by full name (each a wrapper around its ``base_layer``)."""
        return self._targets.wrapped

    @property
    def lora_dtype(self) -> torch.dtype:
        """The dtype of the LoRA buffers and math (the ``lora_dtype`` argument, or the model's)."""
        return self.context.dtype

    @property
    def packed_modules(self) -> dict[str, list[str]]:
        """Fused projection name -> the adapter modules it holds, in slice order."""
        return self._targets.packed_modules

    @property
    def slots(self) -> AdapterSlots:
        """Which adapter is in which slot, with each slot's rank and scaling (``num_slots``, ``max_rank``)."""
        return self._slot_table.slots

    @property
    def eviction(self) -> str | None:
        """What :meth:`load_adapter` does when every slot is taken: ``None`` raises, ``"lru"`` evicts."""
        return self._slot_table.eviction

    @property
    def adapters(self) -> dict[str, int]:
        """The loaded adapters and their slots."""
        return self.slots.loaded

    @property
    def _route(self) -> list[str | None] | None:
        """The active route (``None`` outside :meth:`route`); its home is the router."""
        return self._router.active

    def unwrap(self) -> nn.Module:
        """Put the original modules back and remove the routing hook; returns the model."""
        self._targets.unwrap()
        self._router.remove()
        return self.model

    # ----------------------------------------------------------------- adapters
    def load_adapter(self, name: str, path: str | Path | PeftAdapter, *, replace: bool = False) -> int:
        """Load a PEFT adapter directory (or an adapter already read with
        :func:`lora_core.load_peft_adapter`) into a free slot; returns the slot.

        ``replace=True`` reloads an adapter already loaded under ``name`` (its slot is
        freed first). When every slot is taken, the ``eviction`` policy decides: by
        default this raises; with ``eviction="lru"`` the least recently used adapter
        is unloaded. A :meth:`from_adapters` instance also wraps the modules the
        adapter targets that are not wrapped yet.
        """
        return self._load(name, path if isinstance(path, PeftAdapter) else load_peft_adapter(path), replace=replace)

    def _load(self, name: str, adapter: PeftAdapter, *, replace: bool = False) -> int:
        adapter = name_parameter_targets(name, adapter, self._targets.base_modules())
        self._slot_table.check_new(name, adapter, replace=replace)
        if self._auto_wrap:
            self._targets.wrap_for(name, adapter, fixed=self._graph.enabled)
        plan = self._targets.load_plan(name, adapter)
        slot = self._slot_table.load(name, adapter, plan, self._targets.wrapped,
                                     protected=set(adapter_names(self._router.active or ())))
        self._unmixable.pop(name, None)
        if adapter.use_dora:
            self._unmixable[name] = "a DoRA adapter's norm is not linear in its delta (use_dora)"
        elif adapter.saved_modules:
            self._unmixable[name] = "it replaces whole modules (modules_to_save), which a mix cannot sum"
        return slot

    def unload_adapter(self, name: str) -> None:
        """Free ``name``'s slot (and zero its weights); the modules stay wrapped."""
        self._slot_table.unload(name, self._targets.wrapped)

    def _sync_adapters(self) -> None:
        """The slots changed: cached eager batches carry the old ranks and scalings, and a
        graph-mode batch takes the new ones in place."""
        self._batches.clear()
        self._graph.update_adapters(self.slots)

    # ------------------------------------------------------------------ batches
    def set_batch(self, seq_lens: Sequence[int], adapters: Sequence[AdapterEntry],
                  scales: Sequence[float] | None = None) -> BatchInfo:
        """Describe the next forward pass: tokens per request, each request's adapter
        (``None`` = base model) and, optionally, each request's scale: a multiplier (finite,
        ``>= 0``) of its adapter's delta in every LoRA module its tokens pass through, on top
        of the adapter's own scaling (0: the base model's output; a DoRA adapter is PEFT's scaled
        DoRA adapter: docs/request-scales.md).
        A request's adapter may be a weighted mix, ``{"math": 0.7, "style": 0.3}``: it gets
        ``0.7 * delta_math + 0.3 * delta_style`` (:mod:`lora_layers.mixes`, docs/request-mixes.md).
        In graph mode the preallocated batch is refilled in place (scales need
        ``enable_graph(..., scales=True)``, mixes ``max_pairs``).

        For a flattened ragged batch; a ``(B, S)`` input of B requests is routed per
        call by :meth:`route`. Eager batches are kept (a few, most recent first), so a
        repeated layout (decode steps) reuses its batch info and plans."""
        if len(seq_lens) != len(adapters):
            raise ValueError(f"seq_lens and adapters must have one entry per request; got {len(seq_lens)} and {len(adapters)}")
        slot_ids = self._mixes.slot_ids(adapters)
        self._slot_table.touch(adapter_names(adapters))
        if self._graph.enabled:
            return self._graph.refill(seq_lens, slot_ids, scales)
        info = self._batches.get(seq_lens, slot_ids, self.slots, scales)
        self.backend.prepare_batch(info)
        return info

    # ------------------------------------------------------------------ routing
    @contextmanager
    def route(self, adapters: Sequence[AdapterEntry], scales: Sequence[float] | None = None) -> Iterator[MultiLoRA]:
        """Route the rows of every model call inside the block: row ``i`` of a ``(B, S)``
        input uses ``adapters[i]`` (``None`` or ``"__base__"``: the base model; a weighted mix as
        in :meth:`set_batch`), at ``scales[i]`` when given (as :meth:`set_batch`; checked on entry,
        a refusal naming the route's entry, whatever number of rows each later covers).

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
        with self._router.routing(adapters, scales):
            yield self

    def generate(self, *args: Any, adapter_names: Sequence[AdapterEntry], scales: Sequence[float] | None = None,
                 **kwargs: Any) -> Any:
        """``model.generate(*args, **kwargs)`` with one adapter per input row (PEFT's
        ``generate(..., adapter_names=[...])``), at ``scales`` when given; the same as inside :meth:`route`."""
        with self.route(adapter_names, scales):
            return self.model.generate(*args, **kwargs)

    # --------------------------------------------------------------- graph mode
    def enable_graph(self, max_tokens: int, *, scales: bool = False, max_pairs: int | None = None) -> BatchInfo:
        """Preallocate a graph-mode batch of ``max_tokens`` rows; afterwards ``set_batch``
        refills it in place so a captured forward replays with new batches. The model
        is then called with exactly ``max_tokens`` rows (padding rows use no adapter).
        ``scales``: batches may give request scales, and a captured forward applies them
        for any scales (one elementwise product per LoRA module more than without).
        ``max_pairs``: batches may have weighted mixes of up to ``max_pairs`` (token, adapter)
        pairs in all (a token per adapter of its request; implies ``scales``): every LoRA op of
        a captured forward runs over ``max_pairs`` rows, whatever the batch."""
        return self._graph.enable(max_tokens, self.slots, scales=scales, max_pairs=max_pairs)
