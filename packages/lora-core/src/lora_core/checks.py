"""Scalar argument checks shared by every boundary of lora-kit.

Each check names the argument and the expected value in its error, so a bad
call fails where it is made (docs/architecture.md, "Policies that hold everywhere").
Integers are Python ``int`` or NumPy integers; ``bool`` is never an integer here.
"""

from __future__ import annotations

import math
import numbers
from typing import Callable, Sequence, TypeVar

import numpy as np
import torch

__all__ = [
    "FLOAT32_MAX",
    "SUPPORTED_FLOAT_DTYPES",
    "is_int",
    "are_plain_ints",
    "plain_int_array",
    "check_int",
    "check_bool",
    "check_finite_float",
    "check_float_dtype",
    "check_device",
    "allocating",
]

T = TypeVar("T")

_JUST_INT = frozenset({int})

FLOAT32_MAX = float(torch.finfo(torch.float32).max)

SUPPORTED_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""The activation and weight dtypes every op supports (float64 is not one: the
grouped-GEMM kernels reject it, so no path accepts it)."""


def is_int(value: object) -> bool:
    """True for Python and NumPy integers, False for bools (``True`` is not a length)."""
    if type(value) is int:  # the common case, without the ABC check below
        return True
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def are_plain_ints(values: Sequence[object]) -> bool:
    """True when every element of ``values`` is a plain Python ``int`` (not a bool, not a NumPy
    integer); True for an empty sequence. The type test runs in C, so a hot path can take it
    before checking elements one by one with :func:`check_int`."""
    return set(map(type, values)) <= _JUST_INT


def plain_int_array(values: Sequence[object]) -> np.ndarray | None:
    """``values`` as an int64 array when it is non-empty and every element is a plain Python
    int that fits in int64; ``None`` otherwise, and the caller checks the elements one by one
    (naming the bad one)."""
    if not values or not are_plain_ints(values):
        return None
    try:
        return np.array(values, dtype=np.int64)
    except OverflowError:
        return None


def check_int(name: str, value: object, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` as a Python int, or ``ValueError`` naming ``name`` and the bound it breaks.

    Ops call this on every call: an in-range Python int returns before any message is built."""
    if type(value) is int and (minimum is None or value >= minimum) and (maximum is None or value <= maximum):
        return value
    lower = "a positive int" if minimum == 1 else f"an int >= {minimum}" if minimum is not None else "an int"
    if not is_int(value):
        raise ValueError(f"{name} must be {lower}, got {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be {lower}, got {value!r}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be an int <= {maximum}, got {value!r}")
    return value


def check_bool(name: str, value: object) -> bool:
    """``value`` as a Python bool, or ``TypeError`` naming ``name`` (``"no"`` is not False).
    A ``torch.SymBool`` (a comparison of sizes while ``torch.compile`` traces) is a bool too."""
    if not isinstance(value, (bool, np.bool_, getattr(torch, "SymBool", bool))):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return bool(value)


def check_finite_float(name: str, value: object, *, float32: bool = False) -> float:
    """``value`` as a Python float, or ``ValueError`` if it is not a finite real number
    (with ``float32=True``: not finite once stored as float32, e.g. ``1e39``)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a finite float, got {value!r}")
    try:
        result = float(value)
    except (OverflowError, ValueError):  # e.g. a Fraction too large for a float
        raise ValueError(f"{name} must be a finite float, got {value!r}") from None
    if not math.isfinite(result):
        raise ValueError(f"{name} must be a finite float, got {value!r}")
    if float32 and abs(result) > FLOAT32_MAX:
        raise ValueError(f"{name} must be finite in float32 (|x| <= {FLOAT32_MAX:.3e}), got {value!r}")
    return result


def check_float_dtype(name: str, dtype: torch.dtype) -> None:
    """``ValueError`` naming ``name`` unless ``dtype`` is one of :data:`SUPPORTED_FLOAT_DTYPES`."""
    if dtype not in SUPPORTED_FLOAT_DTYPES:
        supported = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_FLOAT_DTYPES)
        raise ValueError(f"{name} has dtype {dtype}; supported dtypes are {supported}")


def allocating(what: str, fn: Callable[[], T]) -> T:
    """``fn()``, with an allocation failure (host or device out of memory) turned into a
    ``ValueError`` that says which argument asked for too much (``what``)."""
    try:
        return fn()
    except MemoryError as err:
        raise ValueError(f"{what}: cannot allocate the memory it needs ({err})") from err
    except RuntimeError as err:  # torch.OutOfMemoryError, or the CPU allocator's RuntimeError
        message = str(err)
        if isinstance(err, getattr(torch, "OutOfMemoryError", ())) or "allocate" in message:
            raise ValueError(f"{what}: cannot allocate the memory it needs ({message.splitlines()[0]})") from err
        raise


def check_device(name: str, device: object) -> torch.device:
    """``device`` as the ``torch.device`` that tensors allocated on it report, or ``ValueError``
    naming ``name`` (an unknown device string, a device type this torch build lacks, an absent index).

    The result compares equal to ``tensor.device`` for every tensor made on ``device`` while the
    current CUDA device stays what it was: ``"cuda"`` resolves to the current CUDA device
    (``cuda:0`` unless another is current), any CPU name to ``cpu``.
    """
    if isinstance(device, (bool, np.bool_)):
        raise ValueError(f"{name} must be a torch.device or a device string like 'cpu' or 'cuda:0', got {device!r}")
    try:
        resolved = torch.device(device)
        if resolved.type == "cpu":
            return torch.device("cpu")  # (CPU tensors report no index)
        # where tensors asked for on it land; a torch build without the device type raises here, not later
        resolved = torch.empty(0, device=resolved).device
    except (RuntimeError, TypeError, ValueError, AssertionError, ImportError, NotImplementedError) as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ValueError(f"{name} must be a torch.device or a device string like 'cpu' or 'cuda:0' that this "
                         f"process can use, got {device!r}: {reason}") from None
    return resolved
