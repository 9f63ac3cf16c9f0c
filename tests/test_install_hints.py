"""No install hint in the repository asks a package index for our own names.

``lora-core``, ``lora-cuda``, ``lora-ascend``, ``lora-layers`` and ``lora-vllm`` are not registered on
an index by this project (README, "One package on its own"): ``pip install lora-ascend[npu]``
could install somebody else's package. A ``pip install`` that names one of them must
take it from our wheels or sources: ``--no-index``, a ``constraints.txt`` of
``ci/wheels.sh``, an editable ``-e packages/...`` or a path. Third-party packages are
named themselves (``pip install matplotlib``, ``pip install torch_npu``).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OURS = re.compile(r"(?<![\w/.-])(lora-(?:core|cuda|ascend|layers|vllm))(?![\w/-])")
SAFE = ("--no-index", "constraints.txt", "-e ", "install-wheels.sh")
SUFFIXES = {".py", ".md", ".sh", ".toml", ".ini", ".txt", ".cfg"}


def _tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / n for n in names.splitlines() if Path(n).suffix in SUFFIXES and (ROOT / n).is_file()]


def unsafe_hints(text: str) -> list[str]:
    """The ``pip install`` commands of ``text`` that would ask an index for one of our names."""
    found = []
    for match in re.finditer(r"pip install[^`\n\"')]*(?:[\"'][^\"'\n]*[\"'][^`\n)]*)?", text):
        command = match.group(0)
        if OURS.search(command) and not any(safe in command for safe in SAFE):
            found.append(command.strip())
    return found


def test_the_check_catches_the_hints_of_issue_34():
    assert unsafe_hints("torch_npu is not installed (pip install lora-ascend[npu])")
    assert unsafe_hints("--plot needs matplotlib: pip install 'lora-layers[plot]'")
    assert unsafe_hints("optional (`pip install 'lora-layers[hf]'`)")
    assert not unsafe_hints("pip install matplotlib")
    assert not unsafe_hints("pip install -c ci/constraints.txt -c dist/constraints.txt lora-layers")
    assert not unsafe_hints("`pip install --no-index --find-links dist \"lora-ascend[npu]\"`")
    assert not unsafe_hints("`pip install ./packages/lora-cuda` on its own fails")


def test_no_install_hint_asks_an_index_for_our_names():
    offenders = [f"{path.relative_to(ROOT)}: {hint}" for path in _tracked_text_files()
                 if path.name != Path(__file__).name for hint in unsafe_hints(path.read_text(errors="replace"))]
    assert offenders == []
