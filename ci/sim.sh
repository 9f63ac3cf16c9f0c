#!/usr/bin/env bash
# The README's main job: install into .venv, then run lora-sim (arguments pass through;
# none = the embedded default workload on every installed backend and available device).
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/install.sh --run
export TORCH_DEVICE_BACKEND_AUTOLOAD=0
exec .venv/bin/lora-sim "$@"
