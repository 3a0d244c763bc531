#!/usr/bin/env bash
# Lint, format and type checks, in the project venv (run scripts/setup.sh first): the same three
# steps .ci/run runs before the tests and .pre-commit-config.yaml runs on a commit. Runs all three,
# then exits non-zero if any failed. Configuration: pyproject.toml ([tool.ruff], [tool.mypy]).
#   scripts/lint.sh            check only
#   scripts/lint.sh --fix      apply ruff's safe fixes and its formatting first
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV="${VENV:-.venv}"
if [[ "${1:-}" == "--fix" ]]; then
  "$VENV/bin/ruff" check --fix . && "$VENV/bin/ruff" format .
fi
failed=()
echo "== ruff check ."
"$VENV/bin/ruff" check . || failed+=("ruff check")
echo "== ruff format --check ."
"$VENV/bin/ruff" format --check . || failed+=("ruff format")
echo "== mypy (strict; files from pyproject.toml: kvguard/, kernels/)"
"$VENV/bin/mypy" || failed+=("mypy")
if (( ${#failed[@]} )); then
  echo "lint: failed: ${failed[*]}" >&2
  exit 1
fi
echo "lint: ok"
