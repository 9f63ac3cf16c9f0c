"""Routing: one adapter per input row, turned into each model call's batch by a forward pre-hook.

:class:`Router` registers a forward pre-hook on the model. Inside
``MultiLoRA.route(adapters)`` (or on a call with PEFT's ``adapter_names=``
keyword) the hook reads the call's input layout, ``(B, S)`` ids or ``(B, S, H)``
embeddings, and describes B requests of S tokens, row ``i`` with ``adapters[i]``
(each repeated ``k`` times when the input has ``k * len(adapters)`` rows), through
the ``set_batch`` it was given.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from lora_core.batch_requests import validate_scales

__all__ = ["PEFT_BASE", "Router", "call_layout"]

PEFT_BASE = "__base__"
"""PEFT's name for "no adapter" in ``adapter_names``; ``route`` accepts it as well as ``None``."""


def call_layout(args: tuple, kwargs: dict) -> tuple[int, int]:
    """``(rows, tokens per row)`` of a model call's input: ``input_ids``, the first
    positional tensor, or ``inputs_embeds``; ``(B, S)`` ids or ``(B, S, H)`` features
    (a 1-D / 2-D one is one request). ``ValueError`` for anything else."""
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


class Router:
    """The model's forward pre-hook and the active route (``None`` outside any route).

    Args:
        model: the model whose calls are routed (the hook is registered here).
        check_entry: ``check_entry(index, entry)`` raises ``ValueError`` / ``TypeError`` for a route
            entry that is not a loaded adapter's name or a valid weighted mix of loaded adapters.
        set_batch: ``set_batch(seq_lens, adapters, scales)``, which makes a call's batch current.
    """

    def __init__(self, model: nn.Module, check_entry: Callable[[int, Any], Any],
                 set_batch: Callable[[list[int], list[Any], list[float] | None], Any]) -> None:
        self.active: list[Any] | None = None
        self.active_scales: list[float] | None = None
        self._check_entry = check_entry
        self._set_batch = set_batch
        self._hook = model.register_forward_pre_hook(self.pre_forward, with_kwargs=True)

    def remove(self) -> None:
        """Remove the hook: model calls are no longer routed."""
        self._hook.remove()

    def check(self, adapters: Sequence[Any]) -> list[Any]:
        """``adapters`` as a route: a list with ``None`` for ``None`` / ``"__base__"``;
        ``TypeError`` / ``ValueError`` for a non-list, an empty one, an unknown name or a bad mix."""
        if isinstance(adapters, str) or not isinstance(adapters, Sequence):
            raise TypeError(f"adapters must be a list with one adapter name (or None) per row, got {adapters!r}")
        names = [None if a is None or (isinstance(a, str) and a == PEFT_BASE) else a for a in adapters]
        if not names:
            raise ValueError("a route needs one adapter name (or None) per row; got none")
        for i, a in enumerate(names):
            if a is not None:
                self._check_entry(i, a)  # an unknown name raises here, naming the loaded ones
        return names

    @contextmanager
    def routing(self, adapters: Sequence[Any], scales: Sequence[float] | None = None) -> Iterator[list[Any]]:
        """Make ``adapters`` (at ``scales``, one per row, when given) the active route inside the
        block (routes nest); yields it checked."""
        names = self.check(adapters)
        if scales is not None:  # checked per route entry here, not per row once k beams repeat them
            validate_scales(scales, len(names))
            scales = list(scales.tolist() if hasattr(scales, "tolist") else scales)
        previous = self.active, self.active_scales
        self.active, self.active_scales = names, scales
        try:
            yield names
        finally:
            self.active, self.active_scales = previous

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """The forward pre-hook: a PEFT-style ``adapter_names=`` argument (taken out of
        ``kwargs``), or the active route, becomes this call's batch."""
        route, scales = self.active, self.active_scales
        if "adapter_names" in kwargs:
            route, scales = self.check(kwargs.pop("adapter_names")), None
        elif route is None:
            return None
        rows, length = call_layout(args, kwargs)
        if rows % len(route):
            raise ValueError(f"the route has {len(route)} adapters but the model was called with {rows} rows; "
                             "give one adapter per row (or per request of num_beams / num_return_sequences rows)")
        k = rows // len(route)
        adapters = route if k == 1 else [a for a in route for _ in range(k)]
        if scales is not None and k > 1:
            scales = [c for c in scales for _ in range(k)]
        self._set_batch([length] * rows, adapters, scales)
        return args, kwargs
