#!/usr/bin/env bash
# Create .venv (if needed) and install every lora-kit package with its test extras.
# torch is pinned by ci/constraints-cpu.txt: an unpinned torch pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
export PIP_CONSTRAINT="$PWD/ci/constraints-cpu.txt" PIP_DISABLE_PIP_VERSION_CHECK=1
.venv/bin/python -m pip install -q \
  -e "packages/lora-core[test]" \
  -e "packages/lora-cuda[test]" \
  -e "packages/lora-ascend[test]" \
  -e "packages/lora-layers[test]" \
  -r tests/requirements.txt 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
