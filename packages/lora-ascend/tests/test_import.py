"""lora-ascend must import without torch_npu (docs/ascend.md)."""

import importlib.util
import subprocess
import sys


def test_imports_without_torch_npu():
    code = "import sys; import lora_ascend; assert 'torch_npu' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
    assert importlib.util.find_spec("lora_ascend") is not None
