"""Linear attention's feature maps, bit for bit on every backend (rotary.backends.feature_maps).

The reference ``feature_map`` against: its array-API form, NumPy linear attention's internals, the CUDA
kernel's ``feature<W>()`` built with the host compiler (the shim's flags) and compiled by NVRTC (no FMA in
it), and the Numba kernel's ``feature``. Plus the accuracy of the exp they share, and eps = 0 with a zero
denominator (NaN in that row only) on NumPy and on the CUDA kernel through the shim.
"""

from __future__ import annotations

import ctypes
import re
import subprocess

import numpy as np
import pytest

from rotary import RopeSpec
from rotary.backends import cupy as cb, numpy_linear
from rotary.backends.feature_maps import CODES, EXP_CONSTANTS, NAMES, exp_ref, feature_map, feature_map_xp

from .cuda_shim import host

INT = {np.float32: np.int32, np.float64: np.int64}


def values(dtype):
    """Special values, both signs of zero and NaN, subnormals, the exp range's edges, random normals and
    a dense sweep of [-90, 5] (and of [-720, 5] for float64)."""
    f = np.finfo(dtype)
    rng = np.random.default_rng(35)
    special = [0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 1.0, -1.0, -87.0, -87.5, -86.99, -100.0, 88.0, 88.5,
               89.0, -103.0, -104.0, -708.0, -708.5, -709.0, -745.0, -746.0, 709.0, 710.0, 1e-30, -1e-30,
               float(f.smallest_subnormal), -float(f.smallest_subnormal), float(f.tiny), -float(f.tiny),
               float(f.tiny) / 3, -float(f.tiny) / 3, float(f.max), -float(f.max), float(f.eps), -float(f.eps)]
    x = np.concatenate([np.array(special, dtype), rng.standard_normal(20_000).astype(dtype),
                        (rng.standard_normal(5_000) * 50).astype(dtype), np.linspace(-90, 5, 200_001, dtype=dtype)])
    if dtype == np.float64:
        x = np.concatenate([x, np.linspace(-720, 5, 100_001)])
    # NaNs with payloads, negative, and signalling (0x7FA00001 / 0x7FF4...): phi keeps their bits
    if dtype == np.float32:
        nans = np.array([0x7FC00001, 0xFFC12345, 0x7FFFFFFF, 0x7FA00001, 0xFF800001], np.uint32).view(dtype)
    else:
        nans = np.array([0x7FF8000000000001, 0xFFF8123456789ABC, 0x7FF4000000000001, 0xFFF0000000000001],
                        np.uint64).view(dtype)
    return np.concatenate([x, nans])


def same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    return np.array_equal(a.view(INT[a.dtype.type]), b.view(INT[b.dtype.type]))


def first_differences(x, a, b, n=8):
    it = INT[x.dtype.type]
    bad = np.flatnonzero(a.view(it) != b.view(it))[:n]
    return [(float(x[i]), float(a[i]), float(b[i])) for i in bad]


DTYPES = [np.float32, np.float64]


# -- the definition ----------------------------------------------------------------------------------
def test_names_and_codes():
    assert set(NAMES) == set(CODES) and sorted(CODES.values()) == [0, 1, 2] and CODES["identity"] == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_rules(dtype):
    t = dtype
    x = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 2.0, -2.0, -1e6], t)
    relu, elu = feature_map(x, "relu"), feature_map(x, "elu")
    it = INT[t]
    assert list(relu.view(it)[[0, 1, 3, 7, 8]]) == [0] * 5                                # +0.0, never -0.0
    assert relu[2] == np.inf and relu[6] == 2.0
    assert same_bits(relu[4:6], x[4:6]) and same_bits(elu[4:6], x[4:6]) and same_bits(feature_map(x, "identity"), x)
    assert list(elu[[0, 1, 2, 6]]) == [1.0, 1.0, np.inf, 3.0]
    assert list(elu.view(it)[[3, 8]]) == [0, 0]                                           # exp(-inf) = +0.0
    assert elu[7] == exp_ref(x[7:8])[0] and abs(float(elu[7]) - np.exp(-2.0)) < 1e-6
    with pytest.raises(ValueError):
        feature_map(x, "gelu")


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_in_place_and_array_api_form(dtype, name):
    x = values(dtype)
    ref = feature_map(x, name)
    y = x.copy()
    assert feature_map(y, name, out=y) is y and same_bits(y, ref)
    n = x.size // 2 * 2
    strided = x[:n].reshape(2, -1).T                    # non-contiguous in and out
    out = np.empty((2, n // 2), dtype).T
    assert same_bits(feature_map(strided, name), ref[:n].reshape(2, -1).T)
    assert same_bits(feature_map(strided, name, out=out), ref[:n].reshape(2, -1).T)
    assert same_bits(feature_map_xp(np, x, name), ref)
    strict = pytest.importorskip("array_api_strict")
    assert same_bits(np.asarray(feature_map_xp(strict, strict.asarray(x), name)), ref)


def test_float32_exp_within_2_ulp():
    x = np.concatenate([np.linspace(-87, 0, 1_000_001, dtype=np.float32),
                        np.random.default_rng(1).uniform(-87, 0, 200_000).astype(np.float32)])
    got = exp_ref(x).astype(np.float64)
    want = np.exp(x.astype(np.float64))                 # float64 exp: exact enough to count float32 ulps
    ulps = np.abs(got - want) / np.spacing(want.astype(np.float32)).astype(np.float64)
    assert ulps.max() <= 2.0, ulps.max()


def test_float64_exp_within_2_ulp():
    mpmath = pytest.importorskip("mpmath")
    rng = np.random.default_rng(2)
    x = np.concatenate([rng.uniform(-708, 0, 3_000), rng.uniform(-1, 0, 2_000), np.linspace(-708, 0, 1_001)])
    got = exp_ref(x)
    with mpmath.workprec(200):
        want = np.array([float(mpmath.exp(mpmath.mpf(float(v)))) for v in x])
    ulps = np.abs(got - want) / np.spacing(want)
    assert ulps.max() <= 2.0, ulps.max()


# -- NumPy linear attention ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_numpy_linear_internals(dtype, name):
    x = values(dtype)
    ref = feature_map(x, name)
    assert same_bits(numpy_linear._feature_map(np, x, name), ref)
    # the NumPy fast path's features (_features_np), (B, n, H, m) in, (B, H, n, m) phi out
    m = 64
    n = x.size // m
    xs = x[:n * m].reshape(1, n, 1, m)
    buffers = {}

    def buf(tag, shape, work, zeros=False):
        buffers[tag] = (np.zeros if zeros else np.empty)(shape, work)
        return buffers[tag]

    cf, sf = np.ones((1, 1, n, m), dtype), np.zeros((1, 1, n, m), dtype)
    with np.errstate(invalid="ignore"):    # the rotation's inf * 0
        f, _ = numpy_linear._features_np(xs, 0, n, cf, sf, m, "half", name, dtype, buf, "q")
    assert same_bits(f.reshape(-1), ref[:n * m])


# -- CUDA: feature<W>() on the host (the shim's build) and under NVRTC ----------------------------------
PROBE = r'''
#include "cuda_shim.h"
#include "linear_attention.cu"
extern "C" void probe_f32(const float* x, float* y, long long n, int code) {
    for (long long i = 0; i < n; ++i) y[i] = feature<float>(x[i], code);
}
extern "C" void probe_f64(const double* x, double* y, long long n, int code) {
    for (long long i = 0; i < n; ++i) y[i] = feature<double>(x[i], code);
}
'''


@pytest.fixture(scope="module", params=["-O1", "-O3 -march=native"])
def cuda_feature(request, tmp_path_factory):
    """feature<W>() of linear_attention.cu compiled with the shim's flags (and at -O3 for the host CPU, where
    FMA exists: -ffp-contract=off must keep the two roundings)."""
    cxx = host.compiler()
    if cxx is None:
        pytest.skip("no host C++ compiler")
    d = tmp_path_factory.mktemp("feature_probe")
    (d / "probe.cpp").write_text(PROBE)
    lib = d / "probe.so"
    cmd = [cxx, "-std=c++20", *request.param.split(), *host.HOST_FLAGS, f"-I{host.SHIM_DIR}",
           f"-I{cb.KERNEL_DIR}", str(d / "probe.cpp"), "-o", str(lib)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    so = ctypes.CDLL(str(lib))

    def run(x, name):
        x = np.ascontiguousarray(x)
        y = np.empty_like(x)
        fn = so.probe_f32 if x.dtype == np.float32 else so.probe_f64
        fn(ctypes.c_void_p(x.ctypes.data), ctypes.c_void_p(y.ctypes.data), ctypes.c_longlong(x.size),
           ctypes.c_int(CODES[name]))
        return y

    return run


@pytest.mark.cuda_cpu
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_feature_on_host(cuda_feature, dtype, name):
    x = values(dtype)
    ref, got = feature_map(x, name), cuda_feature(x, name)
    assert same_bits(got, ref), first_differences(x, got, ref)


@pytest.mark.nvrtc
def test_cuda_feature_under_nvrtc_has_no_fma():
    """NVRTC fuses a * b + c into an FMA by default (--fmad=true): the feature maps' exp must not be."""
    try:
        from cupy_backends.cuda.libs import nvrtc
        nvrtc.getVersion()
    except Exception as exc:   # noqa: BLE001
        pytest.skip(f"NVRTC not available: {exc}")
    probe = ('\nextern "C" __global__ void probe_f32(const float* x, float* y, int code) '
             '{ y[threadIdx.x] = feature<float>(x[threadIdx.x], code); }\n'
             'extern "C" __global__ void probe_f64(const double* x, double* y, int code) '
             '{ y[threadIdx.x] = feature<double>(x[threadIdx.x], code); }\n')
    prog = nvrtc.createProgram(cb.source_text("linear_attention") + probe, "probe.cu", (), ())
    try:
        try:
            nvrtc.compileProgram(prog, (*cb.NVRTC_OPTIONS, "--gpu-architecture=compute_80"))
        except nvrtc.NVRTCError:
            pytest.fail(nvrtc.getProgramLog(prog))
        ptx = nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)
    ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
    for entry, width in (("probe_f32", "f32"), ("probe_f64", "f64")):
        body = re.search(r"\.entry " + entry + r"\((.*?)\n}", ptx, re.S).group(1)
        assert "fma" not in body and "ex2" not in body, body
        assert f"mul.rn.{width}" in body and f"add.rn.{width}" in body


# -- Numba ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def numba_feature():
    numba = pytest.importorskip("numba")
    from rotary.backends.numba_kernels.linear_attention import feature

    @numba.njit
    def run(x, y, code):
        for i in range(x.size):
            y[i] = feature(x[i], code)

    def call(x, name):
        y = np.empty_like(x)
        run(x, y, CODES[name])
        return y

    return call


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_numba_feature(numba_feature, dtype, name):
    x = values(dtype)
    ref, got = feature_map(x, name), numba_feature(x, name)
    assert same_bits(got, ref), first_differences(x, got, ref)


# -- eps = 0 with a zero denominator --------------------------------------------------------------------
def _zero_denominator_problem(dtype, causal):
    rng = np.random.default_rng(7)
    B, T, H, m, dv = 1, 9, 2, 8, 4
    q = rng.standard_normal((B, T, H, m)).astype(dtype)
    k = np.abs(rng.standard_normal((B, T, H, m))).astype(dtype)
    v = rng.standard_normal((B, T, H, dv)).astype(dtype)
    q[0, 4, 1] = -np.abs(q[0, 4, 1]) - 0.5      # relu(q) = 0: row (t=4, head 1) has a zero denominator
    q[0, 6, 0, ::2] = -0.0                       # relu(-0.0) = +0.0 must not make a signed-zero NaN elsewhere
    q[0, 6, 0, 1::2] = 1.0
    spec = RopeSpec(m)
    work = np.float64 if dtype == np.float64 else np.float32
    cos, sin = spec.cos_sin(np.arange(T), dtype=work)
    kw = dict(rotary_dim=m, layout="half", causal=causal, feature_map="relu", eps=0.0, chunk=4)
    return (q, k, v, np.ascontiguousarray(cos), np.ascontiguousarray(sin), np.arange(T, dtype=np.int64)[None]), kw


def _check_nan_row_only(o):
    nan = np.isnan(o)
    assert nan[0, 4, 1].all(), o[0, 4, 1]
    nan[0, 4, 1] = False
    assert not nan.any() and np.isfinite(o[~np.isnan(o)]).all()


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_eps0_zero_denominator_numpy(dtype, causal):
    args, kw = _zero_denominator_problem(dtype, causal)
    with np.errstate(divide="ignore", invalid="ignore"):
        o, _ = numpy_linear.linear_attention(*args, **kw, state=None)
    _check_nan_row_only(np.asarray(o))


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    if host.compiler() is None:
        pytest.skip("no host C++ compiler (g++/clang++) to build the CUDA sources with the shim")
    return host.build(tmp_path_factory.mktemp("cuda_shim"))


@pytest.mark.cuda_cpu
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_eps0_zero_denominator_cuda_shim(kernels, dtype, causal):
    from .test_cuda_kernels_cpu import run_linear_attention

    args, kw = _zero_denominator_problem(dtype, causal)
    o, _ = run_linear_attention(kernels, *args, **kw, state=None, threads=16)
    _check_nan_row_only(o)
    with np.errstate(divide="ignore", invalid="ignore"):
        ref, _ = numpy_linear.linear_attention(*args, **kw, state=None)
    finite = ~np.isnan(ref)
    np.testing.assert_allclose(o[finite], np.asarray(ref)[finite], rtol=1e-4 if dtype == np.float32 else 1e-10)
