"""The one buffer layout for stacked LoRA weights (docs/layout.md), and slot bookkeeping.

Linear layer with ``c`` slices (1 plain, 2 gate_up, 3 qkv), ``L`` slots, max rank ``R``:

* ``a``: ``(L, c*R, in)``; slice ``i`` of slot ``l`` occupies rows ``[i*R, i*R + r_l)``;
* ``b``: ``(L, out_total, R)``; slice ``i`` owns rows ``[o_i, o_{i+1})`` of
  ``slice_offsets``; columns ``[0, r_l)`` are used.

Embedding with vocabulary ``V`` and ``added`` per-slot added tokens, width ``D``:

* ``a``: ``(L, R, V_total)`` with ``V_total = V + added``; ``b``: ``(L, D, R)``;
* ``extra``: ``(L, added, D)``, the added tokens' base embeddings (or ``None``).

Loading a slot writes the adapter's weights and zeroes everything beyond its rank,
so stale weights of an evicted adapter can never leak into a new one.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .checks import allocating, check_device, check_finite_float, check_float_dtype, check_int, is_int

__all__ = ["LinearLoRABuffers", "EmbeddingLoRABuffers", "AdapterSlots", "slice_offsets_from_widths"]


def slice_offsets_from_widths(widths: Sequence[int], *, name: str = "slice_widths") -> tuple[int, ...]:
    """``[w0, w1, ...]`` -> ``(0, w0, w0+w1, ..., out_total)``: the one place slice offsets are derived."""
    offsets = [0]
    for i, w in enumerate(widths):
        offsets.append(offsets[-1] + check_int(f"{name}[{i}]", w, minimum=1))
    return tuple(offsets)


def _check_slot(slot: int, num_slots: int) -> None:
    if not is_int(slot) or not 0 <= slot < num_slots:
        raise ValueError(f"slot must be an int in [0, {num_slots}), got {slot!r}")


def _check_positive(name: str, value: int) -> None:
    check_int(name, value, minimum=1)


def _check_dtype(dtype: object) -> None:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
    check_float_dtype("dtype", dtype)  # the buffers feed ops that take float32, float16 or bfloat16


def _check_matrix(name: str, tensor: torch.Tensor, rows: int | None, cols: int | None, max_rank: int,
                  rank_dim: int, limit_name: str = "the buffers' max_rank") -> int:
    """Check a 2-D adapter tensor's shape; returns its rank (the size of ``rank_dim``),
    which must not exceed ``max_rank``."""
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != 2:
        shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise ValueError(f"{name} must be a 2-D tensor, got {shape}")
    if not tensor.is_floating_point():
        raise ValueError(f"{name} must be floating point, got {tensor.dtype}")
    expected = (rows, cols)
    for dim, want in enumerate(expected):
        if want is not None and tensor.shape[dim] != want:
            shown = tuple("r" if d == rank_dim else e for d, e in enumerate(expected))
            raise ValueError(f"{name} must have shape {shown}, got {tuple(tensor.shape)}")
    rank = tensor.shape[rank_dim]
    if rank > max_rank:
        raise ValueError(f"{name} has size {rank} in dim {rank_dim}, more than {limit_name} = {max_rank}")
    return rank


class LinearLoRABuffers:
    """Stacked A/B buffers of one linear layer: ``a (L, c*R, in)``, ``b (L, out_total, R)``."""

    def __init__(
        self,
        *,
        num_slots: int,
        max_rank: int,
        in_features: int,
        slice_widths: Sequence[int],
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        _check_positive("num_slots", num_slots)
        _check_positive("max_rank", max_rank)
        _check_positive("in_features", in_features)
        _check_dtype(dtype)
        device = check_device("device", device)
        self.slice_offsets = slice_offsets_from_widths(slice_widths)
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.in_features = in_features
        self.num_slices = len(self.slice_offsets) - 1
        if self.num_slices == 0:
            raise ValueError("slice_widths must name at least one slice")
        sizes = (f"num_slots = {num_slots}, max_rank = {max_rank}, in_features = {in_features}, "
                 f"slice_widths = {list(self.slice_widths)}")
        self.a = allocating(sizes, lambda: torch.zeros(num_slots, self.num_slices * max_rank, in_features,
                                                       dtype=dtype, device=device))
        self.b = allocating(sizes, lambda: torch.zeros(num_slots, self.slice_offsets[-1], max_rank,
                                                       dtype=dtype, device=device))

    @property
    def out_features(self) -> int:
        return self.slice_offsets[-1]

    @property
    def slice_widths(self) -> tuple[int, ...]:
        o = self.slice_offsets
        return tuple(o[i + 1] - o[i] for i in range(self.num_slices))

    def load(
        self,
        slot: int,
        lora_a: Sequence[torch.Tensor | None],
        lora_b: Sequence[torch.Tensor | None],
    ) -> None:
        """Write one adapter into ``slot``, one ``(A_i, B_i)`` pair per slice.

        ``A_i: (r, in)``, ``B_i: (w_i, r)``; ``None`` for both leaves the slice
        without a delta (an adapter that targets q but not k/v). Scaling is not
        applied here: it lives in the batch info, per slot.
        """
        _check_slot(slot, self.num_slots)
        if len(lora_a) != self.num_slices or len(lora_b) != self.num_slices:
            raise ValueError(
                f"expected {self.num_slices} slice(s) of lora_a and lora_b, got {len(lora_a)} and {len(lora_b)}"
            )
        checked = []
        for i, (a, b) in enumerate(zip(lora_a, lora_b)):
            if (a is None) != (b is None):
                raise ValueError(f"slice {i}: lora_a and lora_b must both be given or both be None")
            if a is None:
                checked.append(None)
                continue
            r = _check_matrix(f"lora_a[{i}]", a, None, self.in_features, self.max_rank, rank_dim=0)
            width = self.slice_widths[i]
            rb = _check_matrix(f"lora_b[{i}]", b, width, None, self.max_rank, rank_dim=1)
            if rb != r:
                raise ValueError(f"slice {i}: lora_a has rank {r} but lora_b has rank {rb}")
            checked.append((a, b, r))
        self.clear(slot)
        R = self.max_rank
        for i, item in enumerate(checked):
            if item is None:
                continue
            a, b, r = item
            self.a[slot, i * R : i * R + r].copy_(a)
            self.b[slot, self.slice_offsets[i] : self.slice_offsets[i + 1], :r].copy_(b)

    def clear(self, slot: int) -> None:
        """Zero the slot (evict)."""
        _check_slot(slot, self.num_slots)
        self.a[slot].zero_()
        self.b[slot].zero_()


class EmbeddingLoRABuffers:
    """Embedding buffers: ``a (L, R, V+added)``, ``b (L, D, R)``, ``extra (L, added, D)``."""

    def __init__(
        self,
        *,
        num_slots: int,
        max_rank: int,
        vocab_size: int,
        embedding_dim: int,
        num_added_tokens: int = 0,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        _check_positive("num_slots", num_slots)
        _check_positive("max_rank", max_rank)
        _check_positive("vocab_size", vocab_size)
        _check_positive("embedding_dim", embedding_dim)
        check_int("num_added_tokens", num_added_tokens, minimum=0)
        _check_dtype(dtype)
        device = check_device("device", device)
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.vocab_size = vocab_size
        self.embedding_dim = embedding_dim
        self.num_added_tokens = num_added_tokens
        total = vocab_size + num_added_tokens
        sizes = (f"num_slots = {num_slots}, max_rank = {max_rank}, vocab_size = {vocab_size}, "
                 f"embedding_dim = {embedding_dim}, num_added_tokens = {num_added_tokens}")
        self.a = allocating(sizes, lambda: torch.zeros(num_slots, max_rank, total, dtype=dtype, device=device))
        self.b = allocating(sizes, lambda: torch.zeros(num_slots, embedding_dim, max_rank, dtype=dtype,
                                                       device=device))
        self.extra = (
            allocating(sizes, lambda: torch.zeros(num_slots, num_added_tokens, embedding_dim, dtype=dtype,
                                                  device=device))
            if num_added_tokens
            else None
        )

    @property
    def total_vocab_size(self) -> int:
        return self.vocab_size + self.num_added_tokens

    def load(
        self,
        slot: int,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        extra_embeddings: torch.Tensor | None = None,
    ) -> None:
        """Write one adapter: ``lora_a (r, V)`` or ``(r, V+added)``, ``lora_b (D, r)``,
        ``extra_embeddings (n, D)`` with ``n <= added`` (the adapter's added tokens)."""
        _check_slot(slot, self.num_slots)
        r = _check_matrix("lora_a", lora_a, None, None, self.max_rank, rank_dim=0)
        if lora_a.shape[1] not in (self.vocab_size, self.total_vocab_size):
            raise ValueError(
                f"lora_a must have {self.vocab_size} or {self.total_vocab_size} columns "
                f"(vocab, or vocab + added tokens), got shape {tuple(lora_a.shape)}"
            )
        rb = _check_matrix("lora_b", lora_b, self.embedding_dim, None, self.max_rank, rank_dim=1)
        if rb != r:
            raise ValueError(f"lora_a has rank {r} but lora_b has rank {rb}")
        if extra_embeddings is not None:
            if self.extra is None:
                raise ValueError("extra_embeddings given but the buffers have num_added_tokens = 0")
            _check_matrix("extra_embeddings", extra_embeddings, None, self.embedding_dim,
                          self.num_added_tokens, rank_dim=0, limit_name="num_added_tokens")
        self.clear(slot)
        self.a[slot, :r, : lora_a.shape[1]].copy_(lora_a)
        self.b[slot, :, :r].copy_(lora_b)
        if extra_embeddings is not None:
            self.extra[slot, : extra_embeddings.shape[0]].copy_(extra_embeddings)

    def clear(self, slot: int) -> None:
        _check_slot(slot, self.num_slots)
        self.a[slot].zero_()
        self.b[slot].zero_()
        if self.extra is not None:
            self.extra[slot].zero_()


class AdapterSlots:
    """Which adapter lives in which slot, with each slot's rank and scaling (host data)."""

    def __init__(self, num_slots: int, max_rank: int) -> None:
        _check_positive("num_slots", num_slots)
        _check_positive("max_rank", max_rank)
        self.num_slots = num_slots
        self.max_rank = max_rank
        self._names: list[str | None] = [None] * num_slots
        self._ranks = [0] * num_slots
        self._scalings = [0.0] * num_slots

    @property
    def lora_ranks(self) -> tuple[int, ...]:
        return tuple(self._ranks)

    @property
    def scalings(self) -> tuple[float, ...]:
        return tuple(self._scalings)

    @property
    def loaded(self) -> dict[str, int]:
        return {name: slot for slot, name in enumerate(self._names) if name is not None}

    def slot_of(self, name: str) -> int:
        for slot, loaded in enumerate(self._names):
            if loaded == name:
                return slot
        known = ", ".join(sorted(self.loaded)) or "none"
        raise KeyError(f"adapter {name!r} is not loaded (loaded: {known})")

    def assign(self, name: str, rank: int, scaling: float) -> int:
        """Reserve a free slot for ``name``; returns the slot."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"adapter name must be a non-empty str, got {name!r}")
        if name in self._names:
            raise ValueError(f"adapter {name!r} is already loaded in slot {self._names.index(name)}")
        if not is_int(rank) or not 0 < rank <= self.max_rank:
            raise ValueError(f"adapter {name!r} has rank {rank!r}; expected 1 <= rank <= max_rank = {self.max_rank}")
        scaling = check_finite_float(f"scaling of adapter {name!r}", scaling, float32=True)
        try:
            slot = self._names.index(None)
        except ValueError:
            raise RuntimeError(
                f"all {self.num_slots} adapter slots are in use ({', '.join(sorted(self.loaded))}); "
                "unload one first"
            ) from None
        self._names[slot] = name
        self._ranks[slot] = int(rank)
        self._scalings[slot] = scaling
        return slot

    def release(self, name: str) -> int:
        """Free ``name``'s slot; returns the slot (whose buffers the caller clears)."""
        slot = self.slot_of(name)
        self._names[slot] = None
        self._ranks[slot] = 0
        self._scalings[slot] = 0.0
        return slot
