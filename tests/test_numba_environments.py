"""The Numba backend under Numba's own settings (issue 35), each case in fresh processes with their own
NUMBA_CACHE_DIR: a cache shared by processes of different NUMBA_CPU_NAME, float16 on a generic CPU, the
workqueue threading layer from several threads, NUMBA_DISABLE_JIT=1. Results against the NumPy backend."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("numba")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_COMMON = """
import sys, threading
import numpy as np, rotary
from rotary.backends import numba as nb
from rotary.backends import numba_runtime as nb_runtime  # noqa: E402  (the size rule)
rng = np.random.default_rng(0)

def rel(a, b):
    b = np.asarray(b, np.float64)
    return float(np.abs(np.asarray(a, np.float64) - b).max() / max(np.abs(b).max(), 1e-30))

def check_linear(dtype, tol, T=40, dv=32, m=32, **kw):
    q, k = (rng.standard_normal((2, T, 4, m)).astype(dtype) for _ in range(2))
    v = rng.standard_normal((2, T, 4, dv)).astype(dtype)
    o = rotary.linear_attention(q, k, v, seq_axis=1, backend="numba", chunk=16, **kw)
    ref = rotary.linear_attention(*(a.astype(np.float64) for a in (q, k, v)), seq_axis=1, backend="numpy",
                                  chunk=16, **kw)
    assert rel(o, ref) < tol, (dtype, kw, rel(o, ref))

def check_qk(dtype, tol, shape=(1, 64, 32, 128), **kw):
    q = rng.standard_normal(shape).astype(dtype)
    k = rng.standard_normal(shape[:2] + (8, shape[3])).astype(dtype)
    got = rotary.apply_qk(q, k, seq_axis=1, backend="numba", **kw)
    want = rotary.apply_qk(q.astype(np.float64), k.astype(np.float64), seq_axis=1, backend="numpy", **kw)
    for a, b in zip(got, want):
        assert rel(a, b) < tol, (dtype, shape, rel(a, b))
"""


def _run(code, tmp_path, timeout=600, **env_vars):
    env = {key: value for key, value in os.environ.items() if not key.startswith("NUMBA_")}
    env.update(NUMBA_CACHE_DIR=str(tmp_path / "numba-cache"), PYTHONPATH=ROOT, **env_vars)
    proc = subprocess.run([sys.executable, "-c", _COMMON + code], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0 and "ok" in proc.stdout, (env_vars, proc.returncode, proc.stdout, proc.stderr[-3000:])


_MIXED = """
check_qk(np.float32, 2e-6)
check_linear(np.float32, 1e-5, m=20, dv=20, causal=True)   # sizes not multiples of any tile: padded buffers
if "{mode}" == "more":   # kernels the first process did not compile, linking helpers it compiled
    check_linear(np.float32, 1e-5, m=20, dv=20, causal=False)
    check_linear(np.float32, 1e-5, m=20, dv=20, causal=True, decay=np.full((2, 4), 0.9))
    check_linear(np.float32, 1e-5, m=20, dv=20, T=1, causal=True)
print("ok")
"""


@pytest.mark.slow
def test_processes_of_different_cpu_names_share_a_cache(tmp_path):
    """The default, then NUMBA_CPU_NAME set to the host's own name (Numba then still compiles for the host's
    features) compiling kernels the first did not, then the default again, on one NUMBA_CACHE_DIR: every result
    right. The vector width used to be
    taken as 16 bytes under NUMBA_CPU_NAME while Numba compiled 64-byte code, and the processes' cached helpers
    of different widths were linked together (wrong results, heap corruption)."""
    import llvmlite.binding as ll

    host = ll.get_host_cpu_name()
    _run(_MIXED.replace("{mode}", ""), tmp_path)
    _run(_MIXED.replace("{mode}", "more"), tmp_path, NUMBA_CPU_NAME=host)
    _run(_MIXED.replace("{mode}", "more"), tmp_path)


@pytest.mark.slow
def test_float16_on_a_generic_cpu(tmp_path):
    """NUMBA_CPU_NAME=generic (features empty: no F16C): float16 rotation (serial and parallel kernels, a Rope
    call) and linear attention convert float16 bits by integer operations: no libcall Numba does not link
    (``Symbol not found: __extendhfsf2``) or crash, on a fresh cache and on the cache it filled."""
    code = """
from rotary.backends.numba_kernels import simd
assert simd.VECTOR_BYTES == 16, simd.VECTOR_BYTES
check_qk(np.float16, 2e-3, shape=(1, 5, 2, 64))
check_qk(np.float16, 2e-3)
spec = rotary.RopeSpec(64)
rope = rotary.Rope(spec, backend="numba", dtype=np.float16)
q = rng.standard_normal((2, 3, 4, 64)).astype(np.float16)
got = rope(q, q[:, :, :1], seq_axis=1)
want = rotary.apply_qk(q.astype(np.float64), q[:, :, :1].astype(np.float64), seq_axis=1, spec=spec, backend="numpy")
assert all(rel(a, b) < 2e-3 for a, b in zip(got, want))
check_linear(np.float16, 2e-3, causal=True)
print("ok")
"""
    _run(code, tmp_path, NUMBA_CPU_NAME="generic", NUMBA_CPU_FEATURES="")
    _run(code, tmp_path, NUMBA_CPU_NAME="generic", NUMBA_CPU_FEATURES="")


@pytest.mark.slow
def test_workqueue_threading_layer_from_four_threads(tmp_path):
    """NUMBA_THREADING_LAYER=workqueue (not thread-safe: concurrent parallel regions abort) and apply_qk large
    enough for the parallel kernel, from 4 threads at once, and linear attention from 4 threads: no abort,
    every result right (a concurrent call takes the serial kernel)."""
    code = """
import numba
q = rng.standard_normal((1, 64, 32, 128)).astype(np.float32)
k = rng.standard_normal((1, 64, 8, 128)).astype(np.float32)
want = rotary.apply_qk(q, k, seq_axis=1, backend="numpy")
errors = []

def work(i):
    try:
        for _ in range(8):
            got = rotary.apply_qk(q, k, seq_axis=1, backend="numba")
            assert all(rel(a, b) < 2e-6 for a, b in zip(got, want))
            check_linear(np.float32, 1e-5, causal=True)
    except BaseException as exc:
        errors.append(exc)

threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
assert not errors, errors
assert numba.threading_layer() == "workqueue"
print("ok")
"""
    _run(code, tmp_path, NUMBA_THREADING_LAYER="workqueue")


@pytest.mark.slow
def test_every_kernel_runs_with_the_jit_disabled(tmp_path):
    """NUMBA_DISABLE_JIT=1: every kernel runs as plain Python (each helper and building block has a Python
    form): rotation (serial and parallel paths, float16/32/64, both layouts, a Rope call), linear attention
    causal / non-causal / decayed / one-token step with dv >= one vector, float16/32/64: the NumPy backend's
    results; the KV primitives append_kv (padding included) and paged_attention (packed rows), float and int8
    entries, serial and parallel kernels: the reference's bits and the float64 oracle of test_kv_cache_numba."""
    code = """
import numba
from rotary.backends.numba_kernels import rotation
assert numba.config.DISABLE_JIT and not hasattr(rotation.rotate_qk_serial, "signatures")
for dtype, tol in ((np.float16, 2e-3), (np.float32, 2e-6), (np.float64, 1e-12)):
    for layout in ("half", "interleaved"):
        spec = rotary.RopeSpec(32, layout=layout, rotary_dim=24)
        check_qk(dtype, tol, shape=(2, 3, 2, 32), spec=spec)
        nb_runtime.PARALLEL_MIN_ELEMENTS, nb_runtime.PARALLEL_MIN_TOKENS = 0, 0
        check_qk(dtype, tol, shape=(2, 3, 2, 32), spec=spec)
        nb_runtime.PARALLEL_MIN_ELEMENTS, nb_runtime.PARALLEL_MIN_TOKENS = 1 << 16, 8
    rope = rotary.Rope(rotary.RopeSpec(32), backend="numba", dtype=dtype)
    q = rng.standard_normal((2, 1, 4, 32)).astype(dtype)
    got = rope(q, q[:, :, :2], np.array([[5], [9]]), seq_axis=1)
    want = rotary.apply_qk(q.astype(np.float64), q[:, :, :2].astype(np.float64), np.array([[5], [9]]), seq_axis=1,
                           spec=rotary.RopeSpec(32), backend="numpy")
    assert all(rel(a, b) < tol for a, b in zip(got, want))
    ltol = 2e-3 if dtype == np.float16 else 1e-5 if dtype == np.float32 else 1e-12
    for fmap in ("elu", "relu", "identity"):
        check_linear(dtype, ltol, T=20, dv=16, m=16, causal=True, feature_map=fmap)
    check_linear(dtype, ltol, T=20, dv=17, m=16, causal=False)
    check_linear(dtype, ltol, T=20, dv=16, m=16, causal=True, decay=np.full((2, 4), 0.9))
    check_linear(dtype, ltol, T=1, dv=16, m=16, causal=True)
    from rotary.backends import numba_kv, numba_runtime as rt   # the KV primitives, serial and parallel kernels:
    from tests.test_kv_cache_numba import _append_both, _assert_same_bits, _check, _kv   # append (bits), attention
    spec = rotary.RopeSpec(32, rotary_dim=24, layout="interleaved")
    for kv_dtype in (None, "int8"):
        for threshold in (1 << 62, 0):
            rt.PARALLEL_MIN_ELEMENTS = rt.PARALLEL_MIN_TOKENS = numba_kv.ATTENTION_PARALLEL_MIN_WORK = threshold
            rt.DECODE_KERNEL = "parallel"
            k, v = _kv(rng, dtype, 5, 2, 32, strided=True)
            _assert_same_bits(*_append_both(spec, k, v, [1, 9, 3, 4, 0], [4, -1, 2, 1, 7], kv_dtype, pool=8))
            _check(rng, dtype, kv_dtype, [3, 6, 9], [2, 0, 3], q_heads=4, kv_heads=2, head_dim=32, page_size=4,
                   cases=(dict(softcap=5.0), dict(window=2)))
        rt.PARALLEL_MIN_ELEMENTS, rt.PARALLEL_MIN_TOKENS, numba_kv.ATTENTION_PARALLEL_MIN_WORK = 1 << 16, 8, 1 << 18
        rt.DECODE_KERNEL = "auto"
print("ok")
"""
    _run(code, tmp_path, NUMBA_DISABLE_JIT="1")


def test_an_edited_helper_recompiles_the_kernels(tmp_path):
    """A helper file the cached kernels inline (simd.py) is edited in a copy of the package: on the next import
    the kernel files are marked changed (Numba then compiles them again instead of loading stale machine code);
    an import with nothing edited leaves them alone."""
    import shutil

    import rotary

    tree = tmp_path / "tree"
    shutil.copytree(os.path.dirname(rotary.__file__), tree / "rotary",
                    ignore=shutil.ignore_patterns("__pycache__"))
    kernels = tree / "rotary" / "backends" / "numba_kernels"
    probe = ("import os, rotary.backends.numba_kernels as nk; "
             "print(os.stat(os.path.join(os.path.dirname(nk.__file__), 'rotation.py')).st_mtime_ns)")

    def kernel_mtime():
        out = subprocess.run([sys.executable, "-c", probe], cwd=tree, capture_output=True, text=True, timeout=300,
                             env=dict(os.environ, PYTHONPATH=str(tree)))
        assert out.returncode == 0, out.stderr
        return int(out.stdout.split()[-1])

    first = kernel_mtime()            # no digest recorded yet: marked once
    assert kernel_mtime() == first    # nothing edited: left alone
    with open(kernels / "simd.py", "a") as f:
        f.write("\n# an edit\n")
    os.utime(kernels / "rotation.py", ns=(first - 10**9, first - 10**9))
    assert kernel_mtime() > first - 10**9   # the edit marked the kernels changed
