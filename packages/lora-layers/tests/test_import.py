"""lora-layers installs and imports on its own dependencies."""

import subprocess
import sys


def test_imports():
    subprocess.run([sys.executable, "-c", "import lora_layers, lora_core"], check=True)
