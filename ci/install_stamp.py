"""Print a hash of everything ci/install.sh's pip install reads, for its skip-if-unchanged stamp.

    python ci/install_stamp.py [--also FILE]... PACKAGE...     (run from the repository root)

Hashed: ci/install.sh, ci/packages.txt, ci/constraints.txt, tests/requirements.txt, each package's
pyproject.toml (dependencies and entry points live there) and setup.py / setup.cfg /
MANIFEST.in if present, the names of the top-level entries of each package's src/ (a new
top-level package changes what an install provides; new modules inside one do not, as
editable installs put src/ itself on sys.path), the TORCH_INDEX_URL environment variable
and the Python version; ``--also FILE`` adds a file another install script reads
(ci/install-vllm.sh: itself and ci/vllm-requirements.txt).
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

INSTALL_FILES = ("ci/install.sh", "ci/packages.txt", "ci/constraints.txt", "tests/requirements.txt")
PACKAGE_FILES = ("pyproject.toml", "setup.py", "setup.cfg", "MANIFEST.in")


def inputs_hash(packages: list[str], also: tuple[str, ...] = ()) -> str:
    """The SHA-256 of the install inputs of ``packages`` (names of directories under packages/) and
    of the files ``also``."""
    digest = hashlib.sha256()

    def add(label: str, data: bytes) -> None:
        digest.update(f"{label}\0{len(data)}\0".encode() + data)

    for name in (*INSTALL_FILES, *also):
        add(name, Path(name).read_bytes())
    for package in packages:
        root = Path("packages", package)
        if not root.is_dir():
            raise SystemExit(f"install_stamp.py: package {package!r}: no directory {root}")
        for name in PACKAGE_FILES:
            path = root / name
            if path.is_file():
                add(str(path), path.read_bytes())
        src = root / "src"
        entries = sorted(p.name for p in src.iterdir() if not p.name.endswith(".egg-info") and p.name != "__pycache__")
        add(f"{src} entries", "\n".join(entries).encode())
    add("TORCH_INDEX_URL", os.environ.get("TORCH_INDEX_URL", "").encode())
    add("python", sys.version.encode())
    return digest.hexdigest()


def main(argv: list[str]) -> str:
    also = []
    while len(argv) >= 2 and argv[0] == "--also":
        also.append(argv[1])
        argv = argv[2:]
    return inputs_hash(argv, tuple(also))


if __name__ == "__main__":
    print(main(sys.argv[1:]))
