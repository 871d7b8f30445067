#!/usr/bin/env bash
# One prepared GPU check for the CuPy backend (installs nothing, downloads nothing).
#   bash benchmarks/gpu_check.sh            # tests + measurements, results in $OUT or benchmarks/results
#   QUICK=1 bash benchmarks/gpu_check.sh    # smaller sizes
#   BUDGET=300 bash benchmarks/gpu_check.sh # a tighter overall limit in seconds (default 450: under 8 minutes)
#   bash benchmarks/gpu_check.sh --prepare-carry   # on a machine that has them: copy rotary's pure-Python
#                                                  # dependencies into .gpu_carry/site (git-ignored), for a bare one
# Steps: environment report, the CuPy/GPU tests, then benchmarks/gpu_check.py (see its docstring), which also
# holds the measured times against the roofline estimates of benchmarks/cuda_resources.py (docs/cuda.md).
# A GPU machine without array-api-compat (rotary's one dependency besides NumPy): the check puts
# .gpu_carry/site and any .gpu_carry/*.whl (pure-Python wheels import as zips) on PYTHONPATH; nothing is
# installed or downloaded. Carry .gpu_carry with the checkout (it is git-ignored).
set -u
START=$SECONDS
cd "$(dirname "$0")/.."
CARRY="$PWD/.gpu_carry"
if [ "${1:-}" = "--prepare-carry" ]; then
  "${PYTHON:-python3}" - "$CARRY/site" <<'PYEOF' || exit 1
import pathlib, shutil, sys
import array_api_compat
src, dst = pathlib.Path(array_api_compat.__file__).parent, pathlib.Path(sys.argv[1]) / "array_api_compat"
shutil.rmtree(dst, ignore_errors=True)
shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
print(f"array-api-compat {array_api_compat.__version__}: {src} -> {dst}")
PYEOF
  exit 0
fi
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for cand in python3 python; do
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c "import cupy" >/dev/null 2>&1; then PY="$cand"; break; fi
  done
fi
OUT_DIR="${OUT:-benchmarks/results}"
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/gpu_check.log"
exec > >(tee "$LOG") 2>&1
echo "== gpu_check $(date -u +%FT%TZ) =="
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>/dev/null || echo "nvidia-smi unavailable"
if [ -z "$PY" ]; then
  echo "no python with CuPy found (set PYTHON=/path/to/python); nothing run"; exit 2
fi
if ! "$PY" -c "import array_api_compat" >/dev/null 2>&1; then
  extra=""
  [ -d "$CARRY/site" ] && extra="$CARRY/site"
  for whl in "$CARRY"/*.whl; do
    [ -e "$whl" ] && extra="${extra:+$extra:}$whl"
  done
  [ -n "$extra" ] && export PYTHONPATH="$extra${PYTHONPATH:+:$PYTHONPATH}"
  if "$PY" -c "import array_api_compat" >/dev/null 2>&1; then
    echo "array-api-compat from the carried $extra"
  else
    echo "array-api-compat is not importable and .gpu_carry has none: run 'bash benchmarks/gpu_check.sh --prepare-carry'"
    echo "where it is installed (or put its wheel in .gpu_carry/) and carry .gpu_carry; nothing run"; exit 2
  fi
fi
timeout 60 "$PY" - <<'PYEOF'
import sys, cupy
print("python", sys.version.split()[0], "cupy", cupy.__version__)
try:
    print("devices", cupy.cuda.runtime.getDeviceCount(), "runtime", cupy.cuda.runtime.runtimeGetVersion(),
          "driver", cupy.cuda.runtime.driverGetVersion())
    from cupy_backends.cuda.libs import nvrtc; print("nvrtc", nvrtc.getVersion())
except Exception as e:
    print("environment problem:", type(e).__name__, e)
PYEOF
export PYTHONDONTWRITEBYTECODE=1
# The whole check fits in 8 minutes: every step gets at most its cap and never more than what is left of
# BUDGET seconds (default 450), so a hung or slow step cannot push the later ones past the limit.
BUDGET="${BUDGET:-450}"
status=0
step() {  # step CAP_SECONDS LABEL COMMAND...: run with timeout min(CAP, time left - reserve for measurements)
  local cap=$1 label=$2; shift 2
  local left=$(( BUDGET - (SECONDS - START) - RESERVE ))
  [ "$left" -lt "$cap" ] && cap=$left
  if [ "$cap" -lt 10 ]; then echo "== $label: skipped (time budget spent)"; status=1; return; fi
  echo "== $label (at most ${cap}s; $(( SECONDS - START ))s elapsed) =="
  timeout -k 5 "$cap" "$@"   # worst case BUDGET + 5 s per step: under 8 minutes
  local rc=$?
  [ $rc -eq 124 ] && echo "== $label: TIMED OUT after ${cap}s"
  [ $rc -ne 0 ] && status=1
  return 0
}
PYTEST=("$PY" -m pytest -q -p no:cacheprovider --maxfail=5)
QUICK_ARG=""
[ -n "${QUICK:-}" ] && QUICK_ARG="--quick"
RESERVE=$(( BUDGET * 3 / 10 ))   # kept back for the measurements while the tests run
if "$PY" -c "import pytest" >/dev/null 2>&1; then
  step 150 "tests (CuPy on the GPU): tests/test_cupy.py" "${PYTEST[@]}" -rs tests/test_cupy.py
  step 90 "CuPy rows of the conformance, rotation and linear-attention tests" "${PYTEST[@]}" \
    tests/test_conformance.py tests/test_rotation.py tests/test_linear_attention.py \
    tests/test_linear_attention_variants.py tests/test_attention_softmax.py tests/test_multi_axis.py -k cupy
  step 60 "inference on CuPy: packed batches, KV-cache attention, rerotate, Rope" "${PYTEST[@]}" \
    tests/test_packing.py tests/test_attention_inference.py tests/test_rerotate.py tests/test_rope_object.py -k cupy
  step 60 "interop on the GPU: torch CUDA tensors (DLPack, out=, autograd), Dask CuPy chunks" "${PYTEST[@]}" -rs \
    -m gpu tests/test_torch_adapter.py tests/test_dask_adapter.py tests/test_interop_matrix.py
  step 40 "python -m rotary conformance --backend cupy" "$PY" -m rotary conformance --backend cupy --failures-only
else
  echo "pytest not installed: tests skipped"
fi
RESERVE=0
step 200 "measurements: benchmarks/gpu_check.py" "$PY" benchmarks/gpu_check.py --out "$OUT_DIR" $QUICK_ARG
echo "== done (status $status) in $(( SECONDS - START ))s; results in $OUT_DIR =="
exit $status
