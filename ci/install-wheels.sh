#!/usr/bin/env bash
# Install lora-kit packages from the wheels of ci/wheels.sh into the current python ($PYTHON,
# default python3), each with only the dependencies it declares.
#   bash ci/install-wheels.sh [--dist DIR] REQUIREMENT... [PIP ARGUMENTS]
#   e.g.  bash ci/install-wheels.sh lora-layers
#         bash ci/install-wheels.sh --dist /tmp/dist 'lora-cuda[test]' -r tests/requirements.txt
# Our names (ci/packages.txt) come only from DIR (default dist/): DIR/constraints.txt pins each one to its
# wheel file, so pip never asks an index for them. Everything else (torch, numpy, safetensors,
# pytest, ...) comes from pip's own configuration, with torch pinned by ci/constraints.txt;
# TORCH_INDEX_URL=URL installs torch from that index instead (see README, "Choosing the torch build").
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
source "$root/ci/packages.sh"  # PACKAGES: ci/packages.txt
PYTHON=${PYTHON:-python3}
dist=$root/dist
if [ "${1:-}" = "--dist" ]; then
  [ $# -ge 2 ] || { echo "ci/install-wheels.sh: --dist needs a directory" >&2; exit 2; }
  dist=$2; shift 2
fi
[ $# -ge 1 ] || { echo "usage: bash ci/install-wheels.sh [--dist DIR] REQUIREMENT... [PIP ARGUMENTS]" >&2; exit 2; }
[ -f "$dist/constraints.txt" ] || {
  echo "ci/install-wheels.sh: no $dist/constraints.txt; build the wheels first: bash ci/wheels.sh $dist" >&2; exit 2; }
export PIP_DISABLE_PIP_VERSION_CHECK=1
# A rebuilt wheel keeps its version, and pip keeps an installed distribution of the same
# version: remove ours first so that these wheels are the ones installed.
installed=$("$PYTHON" -c '
import sys
from importlib import metadata
for name in sys.argv[1:]:
    try:
        metadata.distribution(name)
    except metadata.PackageNotFoundError:
        continue
    print(name)' "${PACKAGES[@]}")
if [ -n "$installed" ]; then
  # shellcheck disable=SC2086  # one name per word
  "$PYTHON" -m pip uninstall -q -y $installed
fi
if [ -n "${TORCH_INDEX_URL:-}" ]; then
  echo "ci/install-wheels.sh: torch from $TORCH_INDEX_URL (constraints: ci/constraints.txt)"
  "$PYTHON" -m pip install -c "$root/ci/constraints.txt" --index-url "$TORCH_INDEX_URL" torch
fi
echo "ci/install-wheels.sh: installing $* from $dist (our packages), the rest from pip's configured index"
"$PYTHON" -m pip install -c "$root/ci/constraints.txt" -c "$dist/constraints.txt" "$@"
