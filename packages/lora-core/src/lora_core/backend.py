"""The backend interface every LoRA backend implements, and the registry that finds them (SPEC §4).

Every method is abstract: a backend that forgets one cannot be instantiated, so
the upstream failure mode (a base-class method silently returning ``None`` and a
crash far away) is impossible. Backends register under the ``lora_core.backends``
entry-point group; :func:`get_backend` returns the class by name.
"""

from __future__ import annotations

import abc
from importlib.metadata import entry_points
from typing import Sequence

import torch

from .batch_info import BatchInfo

__all__ = ["LoRABackend", "BatchInfoBackend", "get_backend", "available_backends", "ENTRY_POINT_GROUP"]

ENTRY_POINT_GROUP = "lora_core.backends"

SliceOffsets = Sequence[int] | torch.Tensor


class LoRABackend(abc.ABC):
    """Runs the LoRA ops of one forward pass for the batch given to :meth:`prepare_batch`.

    Shapes: ``T`` tokens, ``L`` slots, ``R`` max rank, ``c`` slices; weights use
    the layout of :mod:`lora_core.layout`. Every ``run_*`` result is in ``x``'s dtype.
    """

    name: str

    @abc.abstractmethod
    def prepare_batch(self, batch_info: BatchInfo) -> None:
        """Use ``batch_info`` for every ``run_*`` call until the next ``prepare_batch``."""

    @abc.abstractmethod
    def init_graph_batch_info(
        self, max_tokens: int, lora_ranks: Sequence[int], scalings: Sequence[float]
    ) -> BatchInfo:
        """A graph-mode batch info for up to ``max_tokens`` tokens, all on slot -1,
        whose tensors later batches refill in place."""

    @abc.abstractmethod
    def run_lora_a(self, x: torch.Tensor, weights: torch.Tensor, num_slices: int = 1) -> torch.Tensor:
        """Scaled shrink: ``x (T, in)``, ``weights (L, c*R, in)`` -> ``(T, c*R)``."""

    @abc.abstractmethod
    def run_lora_b(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        slice_offsets: SliceOffsets,
        base_output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Expand: ``x (T, c*R)``, ``weights (L, out_total, R)`` -> ``(T, out_total)``,
        accumulated into ``base_output`` in place when given (and returned)."""

    @abc.abstractmethod
    def run_qkv(
        self,
        x: torch.Tensor,
        a_weights: torch.Tensor,
        b_weights: torch.Tensor,
        slice_offsets: SliceOffsets,
        base_output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Packed q/k/v: ``a_weights (L, 3R, in)``, ``b_weights (L, q+k+v, R)``."""

    @abc.abstractmethod
    def run_gate_up(
        self,
        x: torch.Tensor,
        a_weights: torch.Tensor,
        b_weights: torch.Tensor,
        slice_offsets: SliceOffsets,
        base_output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Packed gate/up: ``a_weights (L, 2R, in)``, ``b_weights (L, gate+up, R)``."""

    @abc.abstractmethod
    def run_lora_a_embedding(
        self,
        ids: torch.Tensor,
        weights: torch.Tensor,
        vocab_size: int,
        extra_embeddings: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Embedding shrink: ``ids (T,)`` int, ``weights (L, R, V_total)`` -> ``(T, R)``.

        Ids outside ``[0, vocab_size + added)`` (``added = extra_embeddings.shape[1]``)
        get a zero delta."""


def _backend_entry_points() -> dict:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def available_backends() -> list[str]:
    """Names of the installed backends."""
    return sorted(_backend_entry_points())


def get_backend(name: str) -> type[LoRABackend]:
    """The backend class registered as ``name``."""
    eps = _backend_entry_points()
    if name not in eps:
        installed = ", ".join(sorted(eps)) or "none (install lora-cuda or lora-ascend)"
        raise ValueError(f"unknown LoRA backend {name!r}; installed backends: {installed}")
    cls = eps[name].load()
    if not (isinstance(cls, type) and issubclass(cls, LoRABackend)):
        raise TypeError(f"entry point {name!r} ({eps[name].value}) is not a LoRABackend subclass")
    return cls


class BatchInfoBackend(LoRABackend):
    """Shared plumbing for backends whose ops take the prepared :class:`BatchInfo`.

    Implements batch preparation, graph batch-info allocation on ``self.device``
    and the packed layers (qkv: 3 slices, gate_up: 2) as a shrink followed by an
    expand; subclasses implement ``run_lora_a``, ``run_lora_b`` and
    ``run_lora_a_embedding`` (still abstract here).
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._batch_info: BatchInfo | None = None

    @property
    def batch_info(self) -> BatchInfo:
        if self._batch_info is None:
            raise RuntimeError(f"{type(self).__name__}: call prepare_batch() before running LoRA ops")
        return self._batch_info

    def prepare_batch(self, batch_info: BatchInfo) -> None:
        if not isinstance(batch_info, BatchInfo):
            raise TypeError(f"batch_info must be a lora_core.BatchInfo, got {type(batch_info).__name__}")
        self._batch_info = batch_info

    def init_graph_batch_info(
        self, max_tokens: int, lora_ranks: Sequence[int], scalings: Sequence[float]
    ) -> BatchInfo:
        from .batch_info import build_batch_info

        return build_batch_info(
            [max_tokens], [None], lora_ranks, scalings, device=self.device, use_graph=True, max_tokens=max_tokens
        )

    def run_qkv(self, x, a_weights, b_weights, slice_offsets, base_output=None) -> torch.Tensor:
        return self._run_packed("run_qkv", 3, x, a_weights, b_weights, slice_offsets, base_output)

    def run_gate_up(self, x, a_weights, b_weights, slice_offsets, base_output=None) -> torch.Tensor:
        return self._run_packed("run_gate_up", 2, x, a_weights, b_weights, slice_offsets, base_output)

    def _run_packed(self, op, num_slices, x, a_weights, b_weights, slice_offsets, base_output):
        if len(slice_offsets) != num_slices + 1:
            raise ValueError(
                f"{op} needs {num_slices} slices, i.e. {num_slices + 1} slice_offsets, got {len(slice_offsets)}"
            )
        shrunk = self.run_lora_a(x, a_weights, num_slices)
        return self.run_lora_b(shrunk, b_weights, slice_offsets, base_output)
