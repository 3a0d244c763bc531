#!/usr/bin/env bash
# One command from a fresh clone to a working environment:
#   scripts/setup.sh            -> .venv with torch, SGLang (CPU path), kvguard (editable), pytest
# Every package is pinned (requirements/lock.txt is the constraints file of every install).
# Idempotent: a stamp keyed by a hash of requirements/*.txt, pyproject.toml and this script makes a
# second run a no-op that takes seconds. As root on Debian it also installs the prometheus package
# (server and promtool) for the alert-rule tests, when promtool is missing.
# Environment: VENV (default .venv), PYTHON (interpreter to build the venv with; default
# python3.11 if present, else python3 >= 3.10).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${VENV:-$ROOT/.venv}"
STAMP="$VENV/.kvguard-setup-stamp"

say() { printf 'setup: %s\n' "$*"; }
die() { printf 'setup: error: %s\n' "$*" >&2; exit 1; }

inputs_hash() {  # the compiled kernels' and no-device libraries' sources too: a changed one is rebuilt
  cat requirements/*.txt pyproject.toml scripts/setup.sh kernels/csrc/*.c patches/csrc/* \
    | sha256sum | cut -d' ' -f1
}

venv_works() {  # interpreter runs, kvguard and its compiled kernels import, the .pth hook is active
  "$VENV/bin/python" -c 'import sys, kvguard, kvguard.kernels._guard_cpu
sys.exit(0 if any(type(f).__name__ == "SglKernelCompatFinder" for f in sys.meta_path) else 1)' \
    >/dev/null 2>&1
}

pick_python() {
  if [[ -n "${PYTHON:-}" ]]; then
    echo "$PYTHON"
    return
  fi
  local c
  for c in python3.11 python3; do
    if command -v "$c" >/dev/null 2>&1 \
      && "$c" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' >/dev/null 2>&1; then
      echo "$c"
      return
    fi
  done
  die "no python3.11 and no python3 >= 3.10 on PATH (or set PYTHON=/path/to/python3.x)"
}

# tests/test_ops_rules.py runs the operators' alert rules in a real Prometheus: Debian's package
# ships the server and promtool (~10 s to install). Before the stamp check, so a machine with an
# up-to-date venv gets it too; a no-op once promtool is there. Only the binaries are wanted: a
# service the package's install started is stopped and disabled.
install_prometheus() {
  command -v promtool >/dev/null 2>&1 && return 0
  if [[ "$(id -u)" != 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
    say "no promtool: tests/test_ops_rules.py's Prometheus checks skip (Debian, as root: apt-get install prometheus)"
    return 0
  fi
  say "Prometheus and promtool (Debian package prometheus)"
  local t=$SECONDS
  if DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus \
      >/dev/null; then
    if [[ -d /run/systemd/system ]]; then systemctl disable --now prometheus >/dev/null 2>&1 || true; fi
    say "prometheus installed in $((SECONDS - t)) s ($(prometheus --version 2>&1 | head -1))"
  else
    say "warning: apt-get install prometheus failed: tests/test_ops_rules.py's Prometheus checks fail in CI"
  fi
}
install_prometheus

HASH="$(inputs_hash)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$HASH" ]] && venv_works; then
  say "$VENV is up to date (stamp $HASH)"
  exit 0
fi

start=$SECONDS
if [[ ! -x "$VENV/bin/python" ]] || ! "$VENV/bin/python" -c '' >/dev/null 2>&1; then
  PY="$(pick_python)"
  say "creating $VENV with $PY ($("$PY" -c 'import sys; print(sys.version.split()[0])'))"
  "$PY" -m venv --clear "$VENV" \
    || die "'$PY -m venv' failed (on Debian/Ubuntu: apt-get install python3-venv)"
fi
pyver="$("$VENV/bin/python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
[[ "$pyver" == "3.11" ]] \
  || say "warning: requirements/lock.txt was made on Python 3.11; on $pyver some pins may not resolve"

pip_install() {  # this machine's pip config names index folders some packages lack: drop that noise
  "$VENV/bin/python" -m pip install --disable-pip-version-check --progress-bar off -q "$@" 2>&1 \
    | { grep -v -E "^WARNING: Location '[^']*' is ignored: it is neither a file nor a directory" || true; }
}
LOCK=(-c requirements/lock.txt)

say "build backend (requirements/build.txt)"
pip_install -r requirements/build.txt "${LOCK[@]}"
say "torch, SGLang's CPU-path dependencies, PD transfer and router, test tools (requirements/{torch,sglang-cpu,pd,test}.txt)"
pip_install -r requirements/torch.txt -r requirements/sglang-cpu.txt -r requirements/pd.txt \
  -r requirements/test.txt "${LOCK[@]}"
say "SGLang itself, without its CUDA-only dependency set (requirements/sglang.txt, --no-deps)"
pip_install --no-deps -r requirements/sglang.txt
say "kvguard, editable (builds the compiled CPU kernels, kernels/csrc/*.c, and the PD path's no-device libraries, patches/csrc/*.c, with the system C compiler)"
pip_install --no-deps --no-build-isolation -e .

# SGLang's scheduler imports sgl_kernel before any plugin loads; PyPI has no CPU build of it.
# This hook serves kvguard's compat module as sgl_kernel in every process of the venv, and only
# when no real sgl_kernel is installed (see patches/sgl_kernel_finder.py).
purelib="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "import kvguard.patches.sgl_kernel_finder as f; f.install()" > "$purelib/kvguard_sgl_kernel_compat.pth"

say "smoke import"
"$VENV/bin/python" -c 'import kvguard, torch, sglang, structlog, prometheus_client, pytest
import kvguard.serve.cli
print("setup: torch", torch.__version__, "| sglang", sglang.__version__)'
venv_works || die "the sgl_kernel .pth hook is not active in $VENV"

echo "$HASH" > "$STAMP"
say "done in $((SECONDS - start)) s: $VENV"
