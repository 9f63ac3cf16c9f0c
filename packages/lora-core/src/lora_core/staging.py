"""Host-filled tensors that reach the device in one copy.

A batch description (and each kernel's plan of it) is computed on the host and
read by ops on the device. :class:`StagedTensors` lays a set of named tensors
out in one byte buffer on each side, so publishing them is a single
host-to-device copy, whatever their number and dtypes. The device buffer is
allocated once: its views keep their identity and addresses, which is what lets
a captured graph replay on refilled data (docs/graph-rules.md). On the CPU with
one host copy (an eager batch) that copy is the device copy: nothing is copied,
and each field is an array of its own.

:func:`publish_arrays` does the same for host data computed once (an eager
batch's plan): NumPy arrays reach the device in one copy, or, on the CPU, are
wrapped as they are.

With ``double_buffered=True`` (graph-mode batches, which are refilled every
step) the host side alternates between two staging buffers: the host mirrors of
the previous batch stay intact while the next one is written, and on CUDA the
non-blocking copy out of a pinned buffer is waited for before that buffer is
written again (an event, not a device synchronisation).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np
import torch

from .platforms import platform_for

__all__ = ["StagedTensors", "publish_arrays"]

_ALIGN = 16  # bytes: every field starts on a 16-byte boundary (dtype views, grouped-GEMM offsets)

FieldSpecs = Mapping[str, tuple[tuple[int, ...], torch.dtype]]

_NUMPY_DTYPES = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32, torch.bool: np.bool_}
"""The field dtypes batch descriptions and plans use."""

_TORCH_DTYPES = {np.dtype(numpy_dtype): torch_dtype for torch_dtype, numpy_dtype in _NUMPY_DTYPES.items()}


def _layout(fields: FieldSpecs) -> tuple[dict[str, tuple[int, tuple[int, ...], torch.dtype]], int]:
    offsets, nbytes = {}, 0
    for name, (shape, dtype) in fields.items():
        offsets[name] = (nbytes, tuple(shape), dtype)
        nbytes += -(-math.prod(shape) * dtype.itemsize // _ALIGN) * _ALIGN
    return offsets, max(nbytes, _ALIGN)


def _empty_array(shape: tuple[int, ...], dtype: torch.dtype) -> np.ndarray:
    numpy_dtype = _NUMPY_DTYPES.get(dtype)
    return np.empty(shape, dtype=numpy_dtype) if numpy_dtype is not None else torch.empty(shape, dtype=dtype).numpy()


def _views(buffer: torch.Tensor, layout: dict) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray] | None]:
    """The fields' tensor views of ``buffer`` and, for a buffer in host memory, their NumPy views."""
    if platform_for(buffer.device).host_memory and all(dtype in _NUMPY_DTYPES for _, _, dtype in layout.values()):
        data = buffer.numpy()  # views made through NumPy cost a third of torch's view calls
        arrays = {
            name: data[offset : offset + math.prod(shape) * dtype.itemsize].view(_NUMPY_DTYPES[dtype]).reshape(shape)
            for name, (offset, shape, dtype) in layout.items()
        }
        return {name: torch.from_numpy(array) for name, array in arrays.items()}, arrays
    views = {
        name: buffer[offset : offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
        for name, (offset, shape, dtype) in layout.items()
    }
    return views, None


class StagedTensors:
    """Named tensors with a host staging copy and a device copy, published by :meth:`upload`.

    Args:
        fields: ``name -> (shape, dtype)``.
        device: where the device copies live.
        double_buffered: alternate between two host staging buffers (for data
            rewritten every step); otherwise one.

    Fill :attr:`host` (the staging views for the next upload), then call
    :meth:`upload`; :attr:`device` holds the device views (fixed for the object's
    lifetime) and :attr:`published` the host views of the last upload.
    """

    def __init__(self, fields: FieldSpecs, device: torch.device, *, double_buffered: bool = False) -> None:
        self._platform = platform = platform_for(device)
        self._pin = platform.pinned_staging
        self._device = device
        count = 2 if double_buffered else 1
        self._events: list[Any | None] = [None] * count
        self._next = 0
        # one host copy, in host memory: it is the device copy too, and an upload copies nothing; with
        # no copy to make in one piece, each field is an array of its own (a third of the cost of
        # laying them out in one buffer: what an eager batch pays)
        self._shared = count == 1 and platform.host_memory
        if self._shared:
            arrays = {name: _empty_array(shape, dtype) for name, (shape, dtype) in fields.items()}
            self._host_arrays = [arrays]
            self._host_views = [{name: torch.from_numpy(array) for name, array in arrays.items()}]
            self._buffers, self._byte_arrays = [], None
            self.device = self.published = self._host_views[0]
            return
        self._layout, nbytes = _layout(fields)
        self._buffers = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._pin) for _ in range(count)]
        self._host_views, self._host_arrays = [], []
        for buffer in self._buffers:
            views, arrays = _views(buffer, self._layout)
            self._host_views.append(views)
            self._host_arrays.append(arrays if arrays is not None else {k: v.numpy() for k, v in views.items()})
        self._device_buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.device: dict[str, torch.Tensor] = _views(self._device_buffer, self._layout)[0]
        # a device buffer in host memory is written with NumPy copies: a third of a torch copy's cost
        self._byte_arrays = ([buffer.numpy() for buffer in self._buffers], self._device_buffer.numpy()) \
            if platform.host_memory else None
        self.published: dict[str, torch.Tensor] = self._host_views[0]

    @property
    def host(self) -> dict[str, torch.Tensor]:
        """Staging views to fill before the next :meth:`upload` (safe to write now)."""
        self._wait_for_staging()
        return self._host_views[self._next]

    @property
    def host_arrays(self) -> dict:
        """The same staging views as NumPy arrays (host planning is NumPy: about a
        microsecond per small op, against several for a torch op)."""
        self._wait_for_staging()
        return self._host_arrays[self._next]

    def _wait_for_staging(self) -> None:
        event = self._events[self._next]
        if event is not None:
            event.synchronize()  # the previous copy out of this pinned buffer has finished
            self._events[self._next] = None

    def copy_published(self, other: StagedTensors) -> None:
        """Publish the data ``other`` published last (same fields): one host copy, one upload."""
        self._wait_for_staging()
        if self._shared or other._shared:  # fields of their own on one side: copied one by one
            for name, array in self.host_arrays.items():
                array[...] = other.published[name].numpy()
            self.upload()
            return
        source = (other._next - 1) % len(other._buffers)
        if self._byte_arrays is not None and other._byte_arrays is not None:
            self._byte_arrays[0][self._next][:] = other._byte_arrays[0][source]
        else:
            self._buffers[self._next].copy_(other._buffers[source])
        self.upload()

    def upload(self) -> None:
        """Copy the staging buffer to the device in one copy; it becomes :attr:`published`."""
        if self._byte_arrays is not None:
            host_bytes, device_bytes = self._byte_arrays
            device_bytes[:] = host_bytes[self._next]
        elif not self._shared:  # (a shared host copy is the device copy)
            self._device_buffer.copy_(self._buffers[self._next], non_blocking=self._pin)
        if self._pin:
            self._events[self._next] = self._platform.record_copy(self._device)
        self.published = self._host_views[self._next]
        self._next = (self._next + 1) % len(self._host_arrays)


def publish_arrays(arrays: Mapping[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    """``name -> array`` as tensors on ``device`` (same shapes and dtypes, which must be among
    the field dtypes: int64, int32, float32, bool), for data published once.

    In host memory (the CPU) the tensors share the arrays' memory (no copy, no staging buffer:
    the caller hands the arrays over and must not write them afterwards); elsewhere the
    arrays are packed into one :class:`StagedTensors` buffer and reach the device in
    one copy."""
    for name, array in arrays.items():
        if array.dtype not in _TORCH_DTYPES:
            raise TypeError(f"{name} has dtype {array.dtype}; publish_arrays takes "
                            f"{', '.join(map(str, _TORCH_DTYPES))}")
    if platform_for(device).host_memory:
        return {name: torch.from_numpy(np.ascontiguousarray(array)) for name, array in arrays.items()}
    fields = {name: (array.shape, _TORCH_DTYPES[array.dtype]) for name, array in arrays.items()}
    staged = StagedTensors(fields, device)
    host = staged.host_arrays
    for name, array in arrays.items():
        host[name][...] = array
    staged.upload()
    return staged.device
