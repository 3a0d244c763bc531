#!/usr/bin/env bash
# The guard's GPU check, prepared for a machine with torch + triton + an NVIDIA GPU and neither
# SGLang nor a network (kvguard's core and kernels need no engine). Runs from a plain checkout:
# the package layout of pyproject.toml ([tool.setuptools.package-dir]: kernels/ is
# kvguard.kernels, ...) is laid out as a tree of links on PYTHONPATH, nothing is installed.
#
#   bash scripts/device-check.sh             the check; results under $OUT (7 files, one folder)
#   bash scripts/device-check.sh --dry-run   set-up and import checks only, then the plan (no GPU)
#   bash scripts/device-check.sh --prepare   on the development machine, once: copy the pure-
#                                            Python packages the GPU image lacks (structlog) into
#                                            .device-site/ (git-ignored locally) to carry along
#
# Stages, each under its own time limit (all of them well under 8 minutes):
#   1. environment: GPU, driver, torch, triton; kvguard imports without SGLang (import blocked)
#   2. kernel tests compiled for real: the gpu tests of test_guard_triton.py (every scenario x
#      mode x page size 1/16/64 on CUDA pools against the torch reference, out-of-range steps,
#      the fused checksum), test_kv_checksum.py and test_w4a16_kernel.py
#   3. bench.step on CUDA: microseconds and dispatches per decode step, tags/sampled/paranoid,
#      page sizes 1 and 16
#   4. bench.checksum on CUDA: the fused checksum's GB/s against copy GB/s (and a sweep)
#   5. the step-cost curve on CUDA: guard microseconds per step against context read, 1k..256k
# A device session runs it as: run(command="bash scripts/device-check.sh",
# carry=[".device-site"], timeout_s=540).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT="$(pwd)"
PY="${PYTHON:-python3}"
mode=check
case "${1:-}" in
  --dry-run) mode=dry ;;
  --prepare) mode=prepare ;;
  "") ;;
  *) echo "usage: $0 [--dry-run | --prepare]" >&2; exit 2 ;;
esac

if [[ $mode == prepare ]]; then
  VPY="${VENV:-.venv}/bin/python"
  rm -rf .device-site && mkdir -p .device-site
  "$VPY" - <<'EOF' || exit 1
import importlib.metadata, pathlib, shutil, structlog
src = pathlib.Path(structlog.__file__).parent
if any(src.rglob("*.so")):
    raise SystemExit("structlog here is not pure Python: carry a wheel for the GPU image instead")
site = pathlib.Path(".device-site")
shutil.copytree(src, site / "structlog")
meta = pathlib.Path(importlib.metadata.distribution("structlog")._path)  # its version, for imports
shutil.copytree(meta, site / meta.name)
print(f"copied structlog {structlog.__version__} to .device-site/")
EOF
  if [[ -d .git ]] && ! grep -qx '/.device-site/' .git/info/exclude 2>/dev/null; then
    echo '/.device-site/' >> .git/info/exclude
  fi
  echo "carry it: run(command=\"bash scripts/device-check.sh\", carry=[\".device-site\"], ...)"
  exit 0
fi

if [[ -z "${OUT:-}" ]]; then
  echo "device-check: set OUT to the folder for the results (the device machine sets it)" >&2
  exit 2
fi
mkdir -p "$OUT" || exit 2
LOG="$OUT/log.txt"
: > "$LOG"
say() { echo "$@" | tee -a "$LOG"; }

# -- the package layout, as links ----------------------------------------------------------------
shadow="$(mktemp -d)"
trap 'rm -rf "$shadow"' EXIT
mkdir "$shadow/kvguard"
for f in "$ROOT"/kvguard/*.py; do ln -s "$f" "$shadow/kvguard/"; done
"$PY" - "$ROOT" "$shadow" <<'EOF' || { echo "device-check: cannot read pyproject.toml" >&2; exit 2; }
import os, sys, tomllib
root, shadow = sys.argv[1], sys.argv[2]
dirs = tomllib.load(open(os.path.join(root, "pyproject.toml"), "rb"))["tool"]["setuptools"]["package-dir"]
for pkg, folder in dirs.items():
    if pkg != "kvguard" and pkg.count(".") == 1:
        os.symlink(os.path.join(root, folder), os.path.join(shadow, "kvguard", pkg.split(".")[1]))
EOF
export PYTHONPATH="$shadow${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c "import structlog" 2>/dev/null; then
  if [[ -d "$ROOT/.device-site/structlog" ]]; then
    export PYTHONPATH="$PYTHONPATH:$ROOT/.device-site"
  else
    say "device-check: structlog is missing here (the GPU image lacks it): run"
    say "  bash scripts/device-check.sh --prepare   on the development machine, then carry .device-site"
    exit 2
  fi
fi
export PYTHONUNBUFFERED=1 KVGUARD_KERNELS=auto

# -- 1. environment, and the core without SGLang ---------------------------------------------------
"$PY" - <<'EOF' 2>&1 | tee "$OUT/env.txt" | tee -a "$LOG"
import importlib.abc, sys
class NoSGLang(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "sglang" or name.startswith("sglang."):
            raise ImportError(f"device-check: {name} must not be imported by kvguard's core")
sys.meta_path.insert(0, NoSGLang())
import platform, torch, triton
import kvguard.guard, kvguard.kernels.guard_triton, kvguard.kernels.kv_checksum  # noqa: F401
import kvguard.bench.step, kvguard.bench.checksum  # noqa: F401
print(f"python {platform.python_version()}  torch {torch.__version__}  triton {triton.__version__}")
print("kvguard core, kernels and benchmarks import without SGLang: ok")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"gpu {p.name}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB, "
          f"cuda {torch.version.cuda}")
    from kvguard.kernels.guard_state import PageArrays, RowArrays
    from kvguard.kernels.guard_triton import TritonKernels
    k = TritonKernels()
    k.bind(PageArrays.empty(64, "cuda"), RowArrays.empty(4, "cuda"), [])
    print(f"flags written by the kernels into pinned host memory (zero-copy): {k.zero_copy}")
else:
    print("no CUDA device")
EOF
[[ ${PIPESTATUS[0]} -eq 0 ]] || { say "device-check: set-up failed (see above)"; exit 2; }
if [[ $mode == check ]] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  say "device-check: no CUDA device here. This check needs an NVIDIA GPU; use --dry-run elsewhere."
  exit 2
fi

stage() {  # stage NAME LIMIT_S FILE COMMAND...: run, keep its output, note its time and status
  local name=$1 limit=$2 file=$3
  shift 3
  local t0=$SECONDS
  if [[ $mode == dry ]]; then
    say "[dry-run] $name (limit ${limit}s) -> \$OUT/$file: $*"
    return 0
  fi
  say "== $name (limit ${limit}s)"
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$file" 2>&1
  local rc=$?
  tail -n 40 "$OUT/$file" >> "$LOG"
  say "== $name: exit $rc in $((SECONDS - t0)) s"
  echo "$name: exit $rc, $((SECONDS - t0)) s" >> "$OUT/summary.txt"
  return 0
}

[[ $mode == check ]] && : > "$OUT/summary.txt"
# the matrix is 9 tests of ~20 scenarios each: 4 workers where pytest-xdist is installed (it is on
# the GPU image); each compiles what it launches once (Triton's disk cache is shared)
parallel=()
"$PY" -c "import xdist" 2>/dev/null && parallel=(-n 4)
stage "kernel tests on CUDA" 240 tests.txt \
  "$PY" -m pytest -q -p no:cacheprovider -m gpu -rA --durations=10 ${parallel[@]+"${parallel[@]}"} \
  tests/test_guard_triton.py tests/test_kv_checksum.py tests/test_w4a16_kernel.py \
  tests/test_writer_digests.py
stage "bench.step on CUDA" 75 bench_step.txt bash -c "
  '$PY' -m kvguard.bench.step --device cuda --kernels triton --page-size 16 --reps 3 --new 32 --count-ops &&
  '$PY' -m kvguard.bench.step --device cuda --kernels triton --page-size 1 --reps 3 --new 32 --count-ops &&
  '$PY' -m kvguard.bench.step --device cuda --kernels triton --page-size 16 --reps 3 --new 32 --batch 256 --prompt 2000"
stage "bench.checksum on CUDA" 45 checksum.txt \
  "$PY" -m kvguard.bench.checksum --device cuda --layers 32 --slots 65536 --heads 4 --head-dim 128 --sweep
stage "step-cost curve on CUDA" 75 curve.txt \
  "$PY" -m kvguard.bench.step --device cuda --kernels triton --curve --page-size 16 --reps 20

if [[ $mode == dry ]]; then
  say "device-check: dry run done (set-up and imports ok; the stages above need a GPU)"
  exit 0
fi
{
  echo
  echo "-- tests"
  grep -E "passed|failed|error" "$OUT/tests.txt" | tail -n 3
  echo "-- bench.step (us per decode step, dispatches)"
  grep -E "^\||requests x" "$OUT/bench_step.txt"
  echo "-- checksum"
  grep -E "fused|copy_|gather|triton\)" "$OUT/checksum.txt"
  echo "-- curve"
  grep -E "^\||vs context" "$OUT/curve.txt"
} >> "$OUT/summary.txt"
cat "$OUT/summary.txt"
