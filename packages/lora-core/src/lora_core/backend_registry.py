"""The registry of LoRA backends: backends register their :class:`~lora_core.backend.LoRABackend`
subclass under the ``lora_core.backends`` entry-point group; :func:`get_backend` returns the
class by name."""

from __future__ import annotations

from importlib.metadata import entry_points

from .backend import LoRABackend

__all__ = ["get_backend", "available_backends", "ENTRY_POINT_GROUP"]

ENTRY_POINT_GROUP = "lora_core.backends"


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
