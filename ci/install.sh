#!/usr/bin/env bash
# Create .venv (if needed) and install every lora-kit package (editable).
#   bash ci/install.sh          packages + test dependencies (pytest, xdist, peft)
#   bash ci/install.sh --run    packages only: what lora-sim needs
# torch is pinned by ci/constraints-cpu.txt: an unpinned torch pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
export PIP_CONSTRAINT="$PWD/ci/constraints-cpu.txt" PIP_DISABLE_PIP_VERSION_CHECK=1
if [ "${1:-}" = "--run" ]; then
  extra="" reqs=()
else
  extra="[test]" reqs=(-r tests/requirements.txt)
fi
.venv/bin/python -m pip install -q \
  -e "packages/lora-core$extra" \
  -e "packages/lora-cuda$extra" \
  -e "packages/lora-ascend$extra" \
  -e "packages/lora-layers$extra" \
  "${reqs[@]}" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
