#!/usr/bin/env bash
# The vLLM plugin's tests (packages/lora-vllm/tests) in .venv-vllm, which ci/install-vllm.sh
# makes: method-by-method checks against vLLM's own CPU wrapper, real offline engines against
# vLLM and PEFT, and a `vllm serve` test. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/install-vllm.sh
export TORCH_DEVICE_BACKEND_AUTOLOAD=0
exec .venv-vllm/bin/python -m pytest -n "${PYTEST_WORKERS:-2}" packages/lora-vllm/tests "$@"
