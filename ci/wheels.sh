#!/usr/bin/env bash
# Build the four lora-kit wheels into one directory (default dist/, gitignored).
#   bash ci/wheels.sh [--no-build-isolation] [DIR]
# Each package is built from a clean copy (no build/ or *.egg-info left over from editable
# installs, so a deleted module never ships and parallel builds do not collide). DIR also
# gets constraints.txt, which pins lora-core, lora-cuda, lora-ascend and lora-layers to these
# wheel files: `pip install -c DIR/constraints.txt lora-layers` then never asks an index for
# our names. Build isolation fetches setuptools from pip's configured index;
# --no-build-isolation uses the setuptools of $PYTHON instead (>= 77, for the SPDX license field).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
source ci/packages.sh  # PACKAGES: ci/packages.txt
isolation=()
if [ "${1:-}" = "--no-build-isolation" ]; then isolation=(--no-build-isolation); shift; fi
[ $# -le 1 ] || { echo "usage: bash ci/wheels.sh [--no-build-isolation] [DIR]" >&2; exit 2; }
dist=${1:-dist}
mkdir -p "$dist"
dist=$(cd "$dist" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for pkg in "${PACKAGES[@]}"; do
  tar -C packages -cf - --exclude=build --exclude=dist --exclude='*.egg-info' --exclude=__pycache__ "$pkg" \
    | tar -C "$work" -xf -
  rm -f "$dist/${pkg//-/_}"-*.whl
done
echo "ci/wheels.sh: building ${PACKAGES[*]} into $dist"
PIP_DISABLE_PIP_VERSION_CHECK=1 "$PYTHON" -m pip wheel -q --no-deps ${isolation[@]+"${isolation[@]}"} --wheel-dir "$dist" \
  "${PACKAGES[@]/#/$work/}"
{
  echo "# Written by ci/wheels.sh: our packages (ci/packages.txt) come from these wheel files, never from an index."
  for pkg in "${PACKAGES[@]}"; do
    wheels=("$dist/${pkg//-/_}"-*.whl)
    [ ${#wheels[@]} -eq 1 ] && [ -f "${wheels[0]}" ] || { echo "ci/wheels.sh: no single wheel for $pkg in $dist" >&2; exit 1; }
    echo "$pkg @ $("$PYTHON" -c 'import pathlib, sys; print(pathlib.Path(sys.argv[1]).as_uri())' "${wheels[0]}")"
  done
} > "$dist/constraints.txt"
echo "ci/wheels.sh: wrote $(cd "$dist" && echo lora_*.whl) and constraints.txt"
