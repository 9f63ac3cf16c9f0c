"""What lora-kit's runtime code needs to know about a torch device type: one class per type.

Library code never branches on ``device.type``; it asks the device's
:class:`Platform` (``platform_for(device)``), whose attributes say *why* a path
differs: device memory that is host memory, staging buffers that are page-locked
with asynchronous copies, kernel launches that cost time. A device type lora-kit
does not know gets the generic :class:`Platform`, which is correct everywhere
(synchronous copies, no assumptions), if not the fastest. Adding a device type is
one subclass here and one entry in :data:`PLATFORMS` (docs/architecture.md).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["PLATFORMS", "Platform", "CPUPlatform", "CUDAPlatform", "NPUPlatform", "platform_for"]


class Platform:
    """A torch device type as lora-kit's runtime code sees it; the generic defaults are safe anywhere.

    Attributes:
        device_type: the ``torch.device.type`` this describes.
        host_memory: the device's tensors live in host memory: NumPy can view them, and
            publishing host data to the device is a host copy (or none at all).
        launches_cost: each kernel launch costs time (a GPU or NPU queue): fewer, larger
            kernels win, where on the host an op call is a function call and what decides
            the cost is how much data goes through the caches.
        prefers_grouped_gemm: ``torch._grouped_mm`` was measured faster than token blocks
            and ``bmm`` here (docs/benchmarks.md); the graph-safe kernels' ``"auto"``
            preference takes it only where this holds.
    """

    host_memory = False
    launches_cost = True
    prefers_grouped_gemm = False

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type

    @property
    def pinned_staging(self) -> bool:
        """Host staging buffers are page-locked and uploads from them asynchronous: a staging
        buffer must not be rewritten before :meth:`record_copy`'s event has completed."""
        return False

    def record_copy(self, device: torch.device) -> Any | None:
        """An event recorded after the asynchronous copies queued so far on ``device``'s current
        stream (``event.synchronize()`` waits for them), or ``None`` where copies are synchronous."""
        return None

    def synchronize(self) -> None:
        """Wait for all work queued on this device type (a timer's fence)."""
        module = getattr(torch, self.device_type, None)
        sync = getattr(module, "synchronize", None)
        if sync is not None:
            sync()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.device_type!r})"


class CPUPlatform(Platform):
    """The host: no queue, no copies; the caches decide the cost of the graph-safe kernels."""

    host_memory = True
    launches_cost = False
    prefers_grouped_gemm = True

    def synchronize(self) -> None:
        return None


class CUDAPlatform(Platform):
    """NVIDIA GPUs: page-locked staging with non-blocking uploads, fenced by a CUDA event."""

    @property
    def pinned_staging(self) -> bool:
        return torch.cuda.is_available()

    def record_copy(self, device: torch.device) -> torch.cuda.Event | None:
        if not self.pinned_staging:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))  # the copy's stream, whatever device is current
        return event

    def synchronize(self) -> None:
        torch.cuda.synchronize()


class NPUPlatform(Platform):
    """Ascend NPUs (``torch_npu``): synchronous staging copies until pinned uploads are measured there."""


PLATFORMS: dict[str, Platform] = {
    "cpu": CPUPlatform("cpu"),
    "cuda": CUDAPlatform("cuda"),
    "npu": NPUPlatform("npu"),
}
"""The device types lora-kit knows, by ``torch.device.type``."""


def platform_for(device: torch.device | str) -> Platform:
    """The :class:`Platform` of ``device`` (a ``torch.device``, a device string or a device type);
    the generic :class:`Platform` for a device type lora-kit does not know."""
    # a string is read, not parsed by torch.device: "npu" is a device type only once torch_npu is loaded
    device_type = device.type if isinstance(device, torch.device) else str(device).split(":", 1)[0]
    platform = PLATFORMS.get(device_type)
    return platform if platform is not None else Platform(device_type)
