"""StagedTensors: named fields of several dtypes published to the device in one copy."""

import numpy as np
import pytest
import torch

from lora_core.staging import StagedTensors, publish_arrays

FIELDS = {"ids": ((5,), torch.int64), "ranks": ((3,), torch.int32), "scales": ((3,), torch.float32),
          "valid": ((2, 3), torch.bool), "empty": ((0,), torch.int32)}


def _fill(staged, k):
    host = staged.host_arrays
    host["ids"][:] = np.arange(5) + k
    host["ranks"][:] = [k, 2, 3]
    host["scales"][:] = [0.5 * k, 1.0, 2.0]
    host["valid"][:] = [[True, False, k % 2 == 0], [False, True, True]]
    staged.upload()


def _expected(k):
    return {"ids": list(range(k, k + 5)), "ranks": [k, 2, 3], "scales": [0.5 * k, 1.0, 2.0],
            "valid": [[True, False, k % 2 == 0], [False, True, True]], "empty": []}


def test_fields_reach_the_device_with_their_dtypes_and_shapes(device):
    for double_buffered in (False, True):
        staged = StagedTensors(FIELDS, device.torch_device, double_buffered=double_buffered)
        views = dict(staged.device)
        for k in (1, 2, 3):
            _fill(staged, k)
            for name, (shape, dtype) in FIELDS.items():
                t = staged.device[name]
                assert t is views[name]  # fixed for the object's lifetime: what a captured graph reads
                assert t.dtype == dtype and tuple(t.shape) == shape and t.device.type == device.torch_device.type
                assert t.tolist() == _expected(k)[name] == staged.published[name].tolist()


def test_double_buffering_keeps_the_published_mirror_while_the_next_batch_is_written(device):
    staged = StagedTensors(FIELDS, device.torch_device, double_buffered=True)
    _fill(staged, 1)
    published = staged.published
    staged.host_arrays["ids"][:] = 99  # the next batch, not uploaded yet
    assert published["ids"].tolist() == _expected(1)["ids"]
    assert staged.device["ids"].tolist() == _expected(1)["ids"]


def test_publish_arrays_gives_device_tensors_with_the_arrays_values_dtypes_and_shapes(device):
    arrays = {"ids": np.arange(5, dtype=np.int64), "ranks": np.array([4, 0, 16], dtype=np.int32),
              "scales": np.array([0.5, 1.0, 2.0], dtype=np.float32),
              "valid": np.array([[True, False, True], [False, True, True]]), "empty": np.zeros(0, dtype=np.int32)}
    published = publish_arrays(arrays, device.torch_device)
    assert list(published) == list(arrays)
    for name, array in arrays.items():
        t = published[name]
        assert t.device.type == device.torch_device.type
        assert t.dtype == {np.int64: torch.int64, np.int32: torch.int32, np.float32: torch.float32,
                           np.bool_: torch.bool}[array.dtype.type]
        assert tuple(t.shape) == array.shape and t.cpu().tolist() == array.tolist()


def test_publish_arrays_rejects_a_dtype_no_field_has():
    with pytest.raises(TypeError, match="float64"):
        publish_arrays({"x": np.zeros(3)}, torch.device("cpu"))


@pytest.mark.parametrize("source_buffers,target_buffers", [(True, True), (True, False), (False, True)],
                         ids=["double-to-double", "double-to-single", "single-to-double"])
def test_copy_published_publishes_the_sources_last_upload(device, source_buffers, target_buffers):
    """Whatever the two sides' buffering (on the CPU a single host copy is the device copy, with
    no staging buffer), the target publishes what the source published last, not what it stages."""
    source = StagedTensors(FIELDS, device.torch_device, double_buffered=source_buffers)
    target = StagedTensors(FIELDS, device.torch_device, double_buffered=target_buffers)
    _fill(target, 1)
    _fill(source, 2)
    if source_buffers:
        source.host_arrays["ids"][:] = 99  # staged for the source's next upload: not published
    target.copy_published(source)
    for name in FIELDS:
        assert target.device[name].tolist() == _expected(2)[name] == target.published[name].tolist()
