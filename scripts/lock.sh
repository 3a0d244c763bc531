#!/usr/bin/env bash
# Regenerate requirements/lock.txt from the working venv (after changing a requirements file and
# running scripts/setup.sh). The lock is the constraints file (-c) of every install in setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
{
  echo "# Every package of the working environment, pinned: the constraints (-c) of every install"
  echo "# in scripts/setup.sh, so that a fresh machine gets exactly this set. Made by scripts/lock.sh."
  "$VENV/bin/pip" freeze --all --exclude-editable --disable-pip-version-check \
    | grep -v -i -E '^(pip|sglang|compressed-tensors|kvguard)==' | sort -f
} > requirements/lock.txt
echo "requirements/lock.txt: $(grep -c '==' requirements/lock.txt) pins"
