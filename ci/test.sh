#!/usr/bin/env bash
# The README's test command: install into .venv, then run every package's tests and the
# cross-package suites on all device parameters (absent hardware is skipped); then the vLLM
# plugin's suite in its own venv (bash ci/test-vllm.sh). With arguments, only the first part
# runs, with the arguments given to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/install.sh
export TORCH_DEVICE_BACKEND_AUTOLOAD=0
if [ $# -gt 0 ]; then
  exec .venv/bin/python -m pytest -n "${PYTEST_WORKERS:-2}" "$@"
fi
.venv/bin/python -m pytest -n "${PYTEST_WORKERS:-2}"
bash ci/test-vllm.sh
