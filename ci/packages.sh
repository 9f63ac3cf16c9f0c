# Sourced by the ci/ scripts: PACKAGES=(the names of ci/packages.txt), the one list of our packages.
# shellcheck shell=bash
PACKAGES=()
while read -r _pkg; do
  case "$_pkg" in ""|"#"*) continue ;; esac
  PACKAGES+=("$_pkg")
done < "$(dirname "${BASH_SOURCE[0]}")/packages.txt"
unset _pkg
[ ${#PACKAGES[@]} -gt 0 ] || { echo "ci/packages.sh: ci/packages.txt lists no package" >&2; exit 2; }
