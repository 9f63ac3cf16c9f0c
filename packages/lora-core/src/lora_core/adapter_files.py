"""An adapter directory's files: their names, and reading its weights file (safetensors, or
a pickle read with ``torch.load(weights_only=True)``) with every served weight finite."""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["AdapterFormatError", "BIN_NAME", "CONFIG_NAME", "SAFETENSORS_NAME", "check_finite_weights",
           "read_adapter_tensors"]

CONFIG_NAME = "adapter_config.json"
SAFETENSORS_NAME = "adapter_model.safetensors"
BIN_NAME = "adapter_model.bin"


class AdapterFormatError(ValueError):
    """The adapter directory is malformed or uses a feature lora-kit does not support."""


def read_adapter_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the adapter directory ``path``'s weights file, on the CPU as saved."""
    st_path, bin_path = path / SAFETENSORS_NAME, path / BIN_NAME
    if st_path.is_file():
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(st_path))
        except (SafetensorError, OSError, ValueError) as exc:
            raise AdapterFormatError(f"cannot read {st_path}: {exc}") from None
    if bin_path.is_file():
        try:
            tensors = torch.load(bin_path, map_location="cpu", weights_only=True)
        except Exception as exc:  # torch raises several types for unsafe or corrupt pickles
            raise AdapterFormatError(f"cannot read {bin_path} safely (weights_only=True): {exc}") from None
        if not isinstance(tensors, dict) or not all(isinstance(v, torch.Tensor) for v in tensors.values()):
            raise AdapterFormatError(f"{bin_path} must hold a dict of tensors")
        return tensors
    raise FileNotFoundError(f"no {SAFETENSORS_NAME} or {BIN_NAME} in adapter directory {path}")


def check_finite_weights(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Refuse NaN or infinite values in any weight the adapter serves: they would reach every
    token routed to it (the base-model weights PEFT may save beside them are not checked: they
    are ignored)."""
    for key, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            weights = path / SAFETENSORS_NAME if (path / SAFETENSORS_NAME).is_file() else path / BIN_NAME
            bad = int((~torch.isfinite(tensor)).sum())
            raise AdapterFormatError(f"{weights}: tensor {key!r} has {bad} non-finite value(s) (NaN or inf) of "
                                     f"{tensor.numel()}")
