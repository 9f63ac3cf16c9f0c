"""Scalar argument checks shared by every boundary of lora-kit.

Each check names the argument and the expected value in its error, so a bad
call fails where it is made (docs/architecture.md, "Policies that hold everywhere").
Integers are Python ``int`` or NumPy integers; ``bool`` is never an integer here.
"""

from __future__ import annotations

import math
import numbers

__all__ = ["is_int", "check_int", "check_finite_float"]


def is_int(value: object) -> bool:
    """True for Python and NumPy integers, False for bools (``True`` is not a length)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and type(value).__name__ != "bool_"


def check_int(name: str, value: object, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` as a Python int, or ``ValueError`` naming ``name`` and the bound it breaks."""
    lower = "a positive int" if minimum == 1 else f"an int >= {minimum}" if minimum is not None else "an int"
    if not is_int(value):
        raise ValueError(f"{name} must be {lower}, got {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be {lower}, got {value!r}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be an int <= {maximum}, got {value!r}")
    return value


def check_finite_float(name: str, value: object) -> float:
    """``value`` as a Python float, or ``ValueError`` if it is not a finite real number."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite float, got {value!r}")
    return float(value)
