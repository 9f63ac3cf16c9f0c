"""What is specific to this repository's tests (the device fixture comes from lora-core's plugin).

lora-core's pytest plugin ``lora_devices`` (``lora_core.testing.plugin``, loaded through
its ``pytest11`` entry point) gives every test the ``device`` fixture and the options
``--lora-device``, ``--lora-require-device``, ``--lora-device-tests-only`` and
``--lora-device-report`` (docs/testing.md). This repository also accepts them without the
prefix, as its docs and ci/gpu.sh have always spelled them: ``--device``,
``--require-device``, ``--device-tests-only``, ``--device-report``.
"""

from __future__ import annotations

import os

# An installed torch_npu without its driver stack breaks `import torch` unless device-backend
# autoloading is off. The plugin has imported torch by now (lora_core imports it), so this only
# reaches the subprocesses the tests start; ci/test.sh and tox set it for the pytest process.
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import pytest  # noqa: E402

from lora_core.testing.plugin import OPTIONS  # noqa: E402
from lora_core.testing.registry import device_names  # noqa: E402

_ALIASES = {"device": "--device", "require": "--require-device", "tests_only": "--device-tests-only",
            "report": "--device-report"}


def pytest_addoption(parser: pytest.Parser) -> None:
    """The plugin's options under this repository's unprefixed names (same destinations)."""
    group = parser.getgroup("lora_devices")
    for key, alias in _ALIASES.items():
        canonical = OPTIONS[key]
        dest = canonical.lstrip("-").replace("-", "_")
        if key == "tests_only":
            group.addoption(alias, dest=dest, action="store_true", help=f"alias of {canonical}")
        elif key == "report":
            group.addoption(alias, dest=dest, metavar="PATH", help=f"alias of {canonical}")
        else:
            group.addoption(alias, dest=dest, action="append", metavar="NAME", choices=device_names(),
                            help=f"alias of {canonical}")
