#!/usr/bin/env bash
# One prepared GPU check for the CuPy backend (installs nothing, downloads nothing).
#   bash benchmarks/gpu_check.sh            # tests + measurements, results in $OUT or benchmarks/results
#   QUICK=1 bash benchmarks/gpu_check.sh    # smaller sizes
# Steps: environment report, the CuPy/GPU tests, then benchmarks/gpu_check.py (see its docstring).
set -u
cd "$(dirname "$0")/.."
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
"$PY" - <<'PYEOF'
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
status=0
if "$PY" -c "import pytest" >/dev/null 2>&1; then
  echo "== tests (CuPy on the GPU) =="
  timeout 420 "$PY" -m pytest -q -p no:cacheprovider -rs tests/test_cupy.py || status=1
  timeout 300 "$PY" -m pytest -q -p no:cacheprovider tests/test_conformance.py tests/test_rotation.py \
    tests/test_linear_attention.py tests/test_linear_attention_variants.py tests/test_attention_softmax.py tests/test_multi_axis.py -k cupy || status=1
  echo "== inference: packed batches, KV-cache attention, rerotate, Rope on CuPy =="
  timeout 300 "$PY" -m pytest -q -p no:cacheprovider tests/test_packing.py tests/test_attention_inference.py \
    tests/test_rerotate.py tests/test_rope_object.py -k cupy || status=1
  echo "== interop on the GPU: torch CUDA tensors (DLPack, out=, autograd), Dask CuPy chunks =="
  timeout 300 "$PY" -m pytest -q -p no:cacheprovider -rs -m gpu tests/test_torch_adapter.py tests/test_dask_adapter.py \
    tests/test_interop_matrix.py || status=1
  echo "== python -m rotary conformance --backend cupy (rotation and linear attention) =="
  timeout 120 "$PY" -m rotary conformance --backend cupy --failures-only || status=1
else
  echo "pytest not installed: tests skipped"
fi
echo "== measurements =="
QUICK_ARG=""
[ -n "${QUICK:-}" ] && QUICK_ARG="--quick"
timeout 420 "$PY" benchmarks/gpu_check.py --out "$OUT_DIR" $QUICK_ARG || status=1
echo "== done (status $status); results in $OUT_DIR =="
exit $status
