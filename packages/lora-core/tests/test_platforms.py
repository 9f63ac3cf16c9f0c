"""Device behaviour lives on the platforms (lora_core.platforms), not in branches on device.type."""

import numpy as np
import torch

from lora_core.platforms import CPUPlatform, CUDAPlatform, NPUPlatform, Platform, platform_for
from lora_core.staging import StagedTensors, publish_arrays


def test_each_known_device_type_has_its_platform_and_an_unknown_one_the_generic_one():
    assert isinstance(platform_for("cpu"), CPUPlatform)
    assert isinstance(platform_for(torch.device("cuda", 1)), CUDAPlatform)  # no CUDA needed to ask
    assert isinstance(platform_for("npu"), NPUPlatform)
    generic = platform_for("meta")
    assert type(generic) is Platform and generic.device_type == "meta"
    # the generic platform is the safe one: synchronous copies, launches that cost, nothing preferred
    assert not generic.host_memory and generic.launches_cost and not generic.prefers_grouped_gemm
    assert not generic.pinned_staging and generic.record_copy(torch.device("meta")) is None
    generic.synchronize()  # torch.meta has no synchronize: a no-op, not an error


def test_the_cpu_platform_is_host_memory_without_launch_costs():
    cpu = platform_for("cpu")
    assert cpu.host_memory and not cpu.launches_cost and cpu.prefers_grouped_gemm
    assert not cpu.pinned_staging and cpu.record_copy(torch.device("cpu")) is None


def test_host_memory_decides_whether_staging_copies():
    # on a host-memory platform one host copy is the device copy: nothing is copied
    staged = StagedTensors({"a": ((3,), torch.int32)}, torch.device("cpu"))
    staged.host_arrays["a"][:] = [1, 2, 3]
    staged.upload()
    assert staged.device["a"].data_ptr() == staged.published["a"].data_ptr()
    array = np.arange(4, dtype=np.int64)
    assert publish_arrays({"x": array}, torch.device("cpu"))["x"].data_ptr() == array.ctypes.data
