#!/usr/bin/env bash
# The README's test command: install into .venv, then run every package's tests and
# the cross-package suites on all device parameters (absent hardware is skipped).
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/install.sh
export TORCH_DEVICE_BACKEND_AUTOLOAD=0
exec .venv/bin/python -m pytest -n "${PYTEST_WORKERS:-2}" "$@"
