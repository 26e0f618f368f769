#!/usr/bin/env bash
# Install the system packages the tests need (infra/system-packages.txt) that are missing.
#
#   infra/install-deps.sh [--check] [LIST]
#
# As root: apt-get update and apt-get install -y of the missing packages only. Otherwise, or with
# --check: print the one command that installs them and exit 1. Exits 0 when nothing is missing.
set -euo pipefail

check_only=0
if [[ "${1:-}" == --check ]]; then
  check_only=1
  shift
fi
list="$(realpath "${1:-$(dirname "$0")/system-packages.txt}")"
cd "$(dirname "$0")/.."  # the checks look at the checkout's .venv
export PYTHON="${PYTHON:-python3.11}"

missing=()
while read -r package present; do
  [[ -z "$package" || "$package" == \#* ]] && continue
  bash -c "$present" >/dev/null 2>&1 || missing+=("$package")
done <"$list"

if ((${#missing[@]} == 0)); then
  echo "system packages: all present"
  exit 0
fi
if ((check_only)) || [[ "$(id -u)" != 0 ]]; then
  echo "system packages missing: ${missing[*]}" >&2
  if command -v apt-get >/dev/null; then
    echo "install them with: sudo apt-get install -y ${missing[*]}" >&2
  else
    echo "these are Debian package names; install their equivalents with your package manager" >&2
  fi
  exit 1
fi
echo "installing: ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q "${missing[@]}"
