#!/usr/bin/env bash
# The GPU host job, for a host that already has a CUDA build of torch (>= 2.4), pytest, peft
# and transformers, and no network:
#   bash ci/gpu.sh [--dry-run] [OUTDIR]      OUTDIR: default $OUT, else ./gpu-out
# 1. checks that torch is a CUDA build >= 2.4, that pytest imports and that setuptools is >= 77
#    (the SPDX license field of the packages' pyproject.toml);
# 2. installs the packages of ci/packages.txt into that python ($PYTHON, default python3),
#    editable, with pip install --no-deps --no-build-isolation --no-index: nothing is
#    downloaded, nothing already installed changes; the build uses the host's setuptools;
# 3. runs the tests' cuda, cuda-graph and cuda-compile parameters (failing, not skipping, if one
#    is absent)
#    and writes OUTDIR/gpu-report.json; the tests without a device are the CPU runners' and are
#    left out (--device-tests-only), as is tests/test_install.py, which builds fresh venvs from
#    a package index that this host cannot reach; in $PYTEST_WORKERS (default 8) processes
#    sharing the GPU where pytest-xdist is installed; stopping after $PYTEST_MAXFAIL (default
#    20) failures, so that a failure every test shares ends the run early, its tracebacks printed;
# 4. runs the op benchmarks, python -m lora_cuda.bench, with JSON in OUTDIR/bench-cuda.json, and
#    the planning benchmark for batches on the GPU, python -m lora_cuda.bench_planning --device
#    cuda, with JSON in OUTDIR/bench-planning-cuda.json;
# 5. runs the end-to-end benchmarks on cuda: a compiled decode step against the eager one,
#    examples/bench_compile.py (OUTDIR/bench-compile-cuda.json), and lora-kit against PEFT on a
#    transformers Llama, examples/bench_peft.py (OUTDIR/bench-peft-cuda.json).
# Exit status: the first failing step's. --dry-run prints each command (shell-quoted, as run)
# and runs nothing. Merge gpu-report.json with the other hosts' reports: docs/device-matrix.md.
# CI never runs this script for real (tests/test_ci_scripts.py checks the dry run).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
source ci/packages.sh  # PACKAGES: ci/packages.txt
dry=0
if [ "${1:-}" = "--dry-run" ]; then dry=1; shift; fi
[ $# -le 1 ] || { echo "usage: bash ci/gpu.sh [--dry-run] [OUTDIR]" >&2; exit 2; }
out=${1:-${OUT:-gpu-out}}
case "$out" in /*) ;; *) out=$PWD/$out ;; esac

status=0
run() {  # print the command; run it unless --dry-run; remember the first failure
  printf '+'; printf ' %q' "$@"; printf '\n'
  [ "$dry" = 1 ] && return 0
  "$@" || { rc=$?; echo "ci/gpu.sh: exit status $rc from: ${*:1:4} ..." >&2; [ "$status" != 0 ] || status=$rc; }
}

run "$PYTHON" -c 'import sys, torch, pytest
major, minor = (int(p) for p in torch.__version__.split(".")[:2])
if torch.version.cuda is None or (major, minor) < (2, 4):
    sys.exit(f"ci/gpu.sh needs a CUDA build of torch >= 2.4; found torch {torch.__version__} (CUDA {torch.version.cuda})")
try:
    import setuptools
    found = setuptools.__version__
except ImportError:
    found = "none"
if not found[:2].isdigit() or int(found.split(".")[0]) < 77:
    sys.exit(f"ci/gpu.sh builds the packages with the setuptools of this python, which must be >= 77 "
             f"(the SPDX license field of pyproject.toml); found {found}")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, pytest {pytest.__version__}, setuptools {found}")'
[ "$status" = 0 ] || exit "$status"
editables=()
for pkg in "${PACKAGES[@]}"; do editables+=(-e "packages/$pkg"); done
run "$PYTHON" -m pip install --no-deps --no-build-isolation --no-index "${editables[@]}"
[ "$status" = 0 ] || exit "$status"
run mkdir -p "$out"
workers=()
if "$PYTHON" -c 'import xdist' 2>/dev/null; then workers=(-n "${PYTEST_WORKERS:-8}"); fi
run env TORCH_DEVICE_BACKEND_AUTOLOAD=0 "$PYTHON" -m pytest ${workers[@]+"${workers[@]}"} \
  --maxfail "${PYTEST_MAXFAIL:-20}" \
  --device cuda --device cuda-graph --device cuda-compile \
  --require-device cuda --require-device cuda-graph --require-device cuda-compile --device-tests-only \
  --device-report "$out/gpu-report.json" --ignore=tests/test_install.py
bench=(env TORCH_DEVICE_BACKEND_AUTOLOAD=0 "$PYTHON" -m lora_cuda.bench --json "$out/bench-cuda.json")
if grep -q -- '"--device"' packages/lora-cuda/src/lora_cuda/bench.py; then
  bench+=(--device cuda)
else
  echo "ci/gpu.sh: note: python -m lora_cuda.bench has no --device option, so its timings are of CPU tensors"
fi
run "${bench[@]}"
run env TORCH_DEVICE_BACKEND_AUTOLOAD=0 "$PYTHON" -m lora_cuda.bench_planning --device cuda \
  --json "$out/bench-planning-cuda.json"
run env TORCH_DEVICE_BACKEND_AUTOLOAD=0 "$PYTHON" examples/bench_compile.py --device cuda \
  --json "$out/bench-compile-cuda.json"
run env TORCH_DEVICE_BACKEND_AUTOLOAD=0 "$PYTHON" examples/bench_peft.py --device cuda \
  --json "$out/bench-peft-cuda.json"
exit "$status"
