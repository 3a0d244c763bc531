#!/usr/bin/env bash
# Lint, format and type checks, in the project venv (run scripts/setup.sh first): the same three
# steps .ci/run runs before the tests and .pre-commit-config.yaml runs on a commit. Runs all three,
# then exits non-zero if any failed. Configuration: pyproject.toml ([tool.ruff], [tool.mypy]).
#   scripts/lint.sh            check only
#   scripts/lint.sh --fix      apply ruff's safe fixes and its formatting first
#   scripts/lint.sh --mypy     the type check only (the pre-commit hook)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT="$(pwd)"
VENV="${VENV:-.venv}"
if [[ "${1:-}" == "--fix" ]]; then
  "$VENV/bin/ruff" check --fix . && "$VENV/bin/ruff" format .
fi
failed=()
if [[ "${1:-}" != "--mypy" ]]; then
  echo "== ruff check ."
  "$VENV/bin/ruff" check . || failed+=("ruff check")
  echo "== ruff format --check ."
  "$VENV/bin/ruff" format --check . || failed+=("ruff format")
fi
echo "== mypy (strict: the core kvguard/ and kernels/)"
# pyproject.toml maps folders to packages (kernels/ is kvguard.kernels, ...); mypy cannot, so it
# checks a tree of links laid out as the packages import each other.
shadow="$(mktemp -d)"
trap 'rm -rf "$shadow"' EXIT
mkdir "$shadow/kvguard"
for f in "$ROOT"/kvguard/*.py; do ln -s "$f" "$shadow/kvguard/"; done
for pkg in kernels patches serve quant bench fuzz; do ln -s "$ROOT/$pkg" "$shadow/kvguard/$pkg"; done
mypy="$(cd "$VENV" && pwd)/bin/mypy"
# --no-native-parser: mypy 2.x parses with a native parser on threads by default; it crashed
# ("INTERNAL ERROR", no file named) in one fresh-clone CI run and never here. The Python parser is
# the long-standing one; --show-traceback so a crash, if one comes again, says where.
(cd "$shadow" && "$mypy" --no-native-parser --show-traceback --config-file "$ROOT/pyproject.toml" \
  kvguard/*.py kvguard/kernels) \
  || failed+=("mypy")
if (( ${#failed[@]} )); then
  echo "lint: failed: ${failed[*]}" >&2
  exit 1
fi
echo "lint: ok"
