#!/usr/bin/env bash
# Create .venv (if needed) and install the lora-kit packages (ci/packages.txt) into it, editable.
#   bash ci/install.sh          packages + test dependencies (pytest, xdist, hypothesis, peft)
#   bash ci/install.sh --run    packages only: what lora-sim needs
# torch goes through ci/constraints.txt (torch==2.13.0: a version, not a build; pip takes the
# build its indexes offer). TORCH_INDEX_URL=URL installs torch from that index first, e.g.
# https://download.pytorch.org/whl/cpu for the CPU wheel (README, "Choosing the torch build").
# Our packages are named explicitly (-e packages/...), so pip never asks an index for them.
# pip is skipped when nothing it reads has changed since the last install: the stamp
# .venv/lora-kit-install.stamp holds the hash of ci/install_stamp.py (this script, the
# constraints, the pyproject and setup files, each package's top-level src entries,
# tests/requirements.txt, TORCH_INDEX_URL). LORA_KIT_REINSTALL=1 forces pip to run.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
source ci/packages.sh  # PACKAGES: ci/packages.txt
STAMP=.venv/lora-kit-install.stamp
case "${1:-}" in
  "") mode=test extra="[test]" reqs=(-r tests/requirements.txt) ;;
  --run) mode=run extra="" reqs=() ;;
  *) echo "usage: bash ci/install.sh [--run]" >&2; exit 2 ;;
esac
if [ ! -x .venv/bin/python ]; then
  echo "ci/install.sh: creating .venv with $("$PYTHON" -V 2>&1) ($PYTHON)"
  "$PYTHON" -m venv .venv
fi

# What pip would read: if none of it changed, the installed .venv is still right.
inputs_hash=$(.venv/bin/python ci/install_stamp.py "${PACKAGES[@]}")
if [ -z "${LORA_KIT_REINSTALL:-}" ] && [ -f "$STAMP" ]; then
  read -r stamp_hash stamp_mode < "$STAMP" || true
  if [ "$stamp_hash" = "$inputs_hash" ] && { [ "$stamp_mode" = test ] || [ "$mode" = run ]; } \
     && .venv/bin/python -c 'import sys
from importlib.metadata import distribution
for name in sys.argv[1:]: distribution(name)' "${PACKAGES[@]}" 2>/dev/null; then
    echo "ci/install.sh: .venv is up to date ($STAMP matches); skipping pip (LORA_KIT_REINSTALL=1 forces it)"
    exit 0
  fi
fi

rm -f "$STAMP"
export PIP_DISABLE_PIP_VERSION_CHECK=1
if [ -n "${TORCH_INDEX_URL:-}" ]; then
  echo "ci/install.sh: installing torch (ci/constraints.txt) from $TORCH_INDEX_URL"
  .venv/bin/python -m pip install -c ci/constraints.txt --index-url "$TORCH_INDEX_URL" torch
fi
what="${PACKAGES[*]} (editable)"
[ "$mode" = test ] && what="$what with test dependencies and tests/requirements.txt"
torch_from="pip's configured index"
[ -n "${TORCH_INDEX_URL:-}" ] && torch_from=$TORCH_INDEX_URL
echo "ci/install.sh: installing $what into .venv; torch from $torch_from (a first install can take minutes: torch is a large wheel)"
editables=()
for pkg in "${PACKAGES[@]}"; do editables+=(-e "packages/$pkg$extra"); done
.venv/bin/python -m pip install -c ci/constraints.txt "${editables[@]}" ${reqs[@]+"${reqs[@]}"}
echo "$inputs_hash $mode" > "$STAMP"
