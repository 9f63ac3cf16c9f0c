"""Whether a graph capture is in progress, for library code that must behave differently."""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Iterator

import torch

__all__ = ["is_capturing", "simulated_capture"]

class _CaptureState(threading.local):
    depth = 0  # a class default: reading it never raises (a missing attribute would, on every call)


_state = _CaptureState()


def is_capturing() -> bool:
    """True inside a CUDA/NPU graph capture on the current stream or a simulated one.

    Unlike ``torch.cuda.is_current_stream_capturing`` this never raises on builds
    without CUDA and never initialises a device.
    """
    if _state.depth:
        return True
    if torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing():
        return True
    if "torch_npu" not in sys.modules:  # torch.npu exists only once torch_npu is imported
        return False
    npu = getattr(torch, "npu", None)
    probe = getattr(npu, "is_current_stream_capturing", None)
    if probe is not None and getattr(npu, "is_initialized", lambda: False)():
        return bool(probe())
    return False


@contextlib.contextmanager
def simulated_capture() -> Iterator[None]:
    """Marks a simulated capture (used by :class:`lora_core.testing.GraphSimulator`)."""
    _state.depth += 1
    try:
        yield
    finally:
        _state.depth -= 1
