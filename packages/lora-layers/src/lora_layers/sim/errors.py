"""The one error ``lora-sim`` reports to the user rather than as a traceback."""

from __future__ import annotations

__all__ = ["UsageError"]


class UsageError(Exception):
    """Bad input: ``lora-sim`` prints it as one line and exits with status 2."""
