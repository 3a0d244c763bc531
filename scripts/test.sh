#!/usr/bin/env bash
# The test suite, in the project venv (run scripts/setup.sh first). Extra arguments go to pytest;
# without test paths among them it runs tests/ (pyproject.toml: testpaths).
#   scripts/test.sh            every tier (engine tests and the CI campaign included)
#   scripts/test.sh --fast     no engine, campaign or slow tests: unit, kernel, CLI; under 2 minutes
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV="${VENV:-.venv}"
args=()
for a in "$@"; do
  if [[ "$a" == "--fast" ]]; then
    args+=(-m "not engine and not campaign and not slow")
  else
    args+=("$a")
  fi
done
exec "$VENV/bin/python" -m pytest -x -q ${args[@]+"${args[@]}"}
