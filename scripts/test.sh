#!/usr/bin/env bash
# The test suite, in the project venv (run scripts/setup.sh first). Extra arguments go to pytest;
# without test paths among them it runs tests/ (pyproject.toml: testpaths).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV="${VENV:-.venv}"
exec "$VENV/bin/python" -m pytest -x -q "$@"
