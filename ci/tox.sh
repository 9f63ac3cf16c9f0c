#!/usr/bin/env bash
# Run tox.ini's matrix in parallel, saying which envs are skipped for a missing interpreter
# and printing every env's test counts at the end (tox -p shows the output of failed envs only).
#   bash ci/tox.sh [--require-all] [--dry-run] [TOX ARGUMENTS]
# The envs are tox.ini's env_list; an env whose python (py311 -> python3.11) is not on PATH is
# left out, with a line saying so, before tox starts (tox.ini's skip_missing_interpreters would
# skip it with no more than a SKIP in its summary). --require-all makes a missing interpreter an
# error (exit 2): for a CI host that is meant to test every Python of the matrix. TOX: the tox
# command (default .venv/bin/tox where it exists, else tox). --dry-run prints the tox command.
# Each env's pytest writes {env_tmp_dir}/junit.xml (tox.ini), read here for the counts.
# Time: a first run installs torch into every env (about 30 minutes on the 2-core CI runner for
# the five py311 envs); later runs rebuild and reinstall only the four wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
require_all=0 dry=0
while [ $# -gt 0 ]; do
  case "$1" in
    --require-all) require_all=1; shift ;;
    --dry-run) dry=1; shift ;;
    *) break ;;
  esac
done
TOX=${TOX:-}
if [ -z "$TOX" ]; then
  if [ -x .venv/bin/tox ]; then TOX=.venv/bin/tox; else TOX=tox; fi
fi
line=$(sed -n 's/^env_list *= *//p' tox.ini)
[ -n "$line" ] || { echo "ci/tox.sh: tox.ini has no env_list line" >&2; exit 2; }
eval "all=($line)"  # bash brace expansion: py3{11,12}-{core,...} -> py311-core ...
envs=() missing=()
for env in "${all[@]}"; do
  py=${env%%-*}
  [[ "$py" =~ ^py3[0-9]+$ ]] || { envs+=("$env"); continue; }
  interpreter="python3.${py#py3}"
  if "$interpreter" -c "import sys" >/dev/null 2>&1; then  # runs: a pyenv shim of an inactive version does not
    envs+=("$env")
  elif [ "$require_all" = 1 ]; then
    echo "ci/tox.sh: error: no working $interpreter on PATH for $env (--require-all)" >&2; missing+=("$env")
  else
    echo "ci/tox.sh: skipping $env: no working $interpreter on PATH"; missing+=("$env")
  fi
done
[ "$require_all" = 0 ] || [ ${#missing[@]} -eq 0 ] || exit 2
[ ${#envs[@]} -gt 0 ] || { echo "ci/tox.sh: no env of tox.ini has its interpreter here" >&2; exit 2; }
command=("$TOX" -p -e "$(IFS=,; echo "${envs[*]}")" "$@")
printf '+'; printf ' %q' "${command[@]}"; printf '\n'
[ "$dry" = 0 ] || exit 0
command -v "$TOX" >/dev/null 2>&1 || { echo "ci/tox.sh: no tox ($TOX): .venv/bin/pip install tox" >&2; exit 2; }
status=0
"${command[@]}" || status=$?
echo "ci/tox.sh: test counts per env (from .tox/<env>/tmp/junit.xml):"
python3 - "${envs[@]}" <<'PY'
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

for env in sys.argv[1:]:
    path = Path(".tox", env, "tmp", "junit.xml")
    if not path.is_file():
        print(f"  {env}: no result (the env failed before its tests, or did not run)")
        continue
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for suite in ET.parse(path).getroot().iter("testsuite"):
        for key in counts:
            counts[key] += int(suite.get(key, 0))
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    print(f"  {env}: {passed} passed, {counts['failures']} failed, {counts['errors']} errors, "
          f"{counts['skipped']} skipped")
PY
exit "$status"
