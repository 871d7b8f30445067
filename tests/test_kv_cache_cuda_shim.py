"""The CUDA KV-cache kernel (``cuda_kernels/kv_cache.cu``: kv_append) on the CPU through tests/cuda_shim.

The plans are the CuPy backend's (``rotary.backends.cupy.plan_append_kv``), launched with NumPy arrays; every
result is compared bit for bit with the reference ``rotary.backends.kv_entries.append_kv`` run on NumPy copies
of the same stores (entries, scales, and the slots the append must leave alone): float32/float64/float16
entries, int8 entries and scales, float8_e4m3fn bits (the reference's are ml_dtypes'), half and interleaved
pairs, partial rotary with an offset, strided / reversed k and v, paged slot orders, block geometries with many
blocks and odd thread groups; then ``rotary.KVCache`` end to end with the kernel as its backend's append_kv.
"""

from __future__ import annotations

import os
import tempfile
import types
from pathlib import Path

import numpy as np
import pytest

from rotary import RopeSpec
from rotary import backends as registry
from rotary.backends import cupy as cb
from rotary.backends import kv_entries

from .cuda_shim import host
from . import test_cuda_kernels_cpu as _cpu_tests
from .test_cuda_kernels_cpu import shim_backend

pytestmark = pytest.mark.cuda_cpu

ml_dtypes = pytest.importorskip("ml_dtypes")

#: (threads, group, tokens per block cap): the default plan, tiny blocks with odd groups, a block per token
#: CuPy replaced by NumPy-backed stand-ins that launch through the shim (a fixture of test_cuda_kernels_cpu)
fake_cupy = _cpu_tests.fake_cupy
GEOMETRIES = {"default": (256, None, None), "tiny": (5, 3, 1), "odd": (40, 7, 2), "small": (32, None, 3)}
KV_DTYPES = [None, "int8", "float8_e4m3"]


@pytest.fixture(scope="module")
def kernels():
    if host.compiler() is None:
        pytest.skip("no host C++ compiler (g++/clang++) to build the CUDA sources with the shim")
    # a fixed directory: the library is named by the digest of its sources and flags, so a rerun reuses it
    return host.build(Path(tempfile.gettempdir()) / f"rotary-cuda-shim-kv-{os.getuid()}")


# -- helpers ---------------------------------------------------------------------------------------------
def work_of(dtype):
    return np.float64 if np.dtype(dtype) == np.float64 else np.float32


def make_stores(slots, heads, head_dim, dtype, kv_dtype, rng):
    """Pool arrays as a KVCache holds them, filled with garbage (the append must only write its slots)."""
    shape = (slots, heads, head_dim)
    if kv_dtype is None:
        entries = [rng.standard_normal(shape).astype(dtype) for _ in range(2)]
    else:
        entry = np.int8 if kv_dtype == "int8" else np.uint8
        entries = [rng.integers(-100 if entry == np.int8 else 0, 100, shape).astype(entry) for _ in range(2)]
    scales = [None, None] if kv_dtype is None else [rng.random(shape[:2]).astype(work_of(dtype)) for _ in range(2)]
    return tuple(entries + scales)


def copy_stores(stores):
    return tuple(None if a is None else a.copy() for a in stores)


def bits(a):
    return np.ascontiguousarray(a).view(np.uint8)


def assert_same_bits(actual, desired):
    for i, (a, d) in enumerate(zip(actual, desired)):
        if d is None:
            assert a is None
            continue
        assert a.dtype == d.dtype and a.shape == d.shape
        if not np.array_equal(bits(a), bits(d)):
            diff = np.argwhere(bits(a).reshape(a.shape + (-1,)) != bits(d).reshape(d.shape + (-1,)))[:5]
            raise AssertionError(f"store {i} differs at {diff.tolist()}: {a[tuple(diff[0][:a.ndim])]!r} vs "
                                 f"{d[tuple(diff[0][:d.ndim])]!r}")


def tables(spec, n_rows, work):
    cos, sin = spec.cos_sin(np.arange(n_rows), dtype=work)
    return np.ascontiguousarray(cos), np.ascontiguousarray(sin)


def launch_append(kernels, k, v, cos, sin, rows, slots, stores, *, spec, kv_dtype, geometry="default",
                  dtype_name=None):
    threads, group, tpb = GEOMETRIES[geometry]
    plan = cb.plan_append_kv(k, v, cos, sin, np.ascontiguousarray(rows, np.int64),
                             np.ascontiguousarray(slots, np.int64), stores, dtype_name=dtype_name or str(k.dtype),
                             rotary_dim=spec.rotary_dim, layout=spec.layout, offset=spec.rotary_offset,
                             kv_dtype=kv_dtype, threads=threads, group=group, max_tokens_per_block=tpb)
    kernels.launch(plan)
    return plan


def reference(k, v, cos, sin, rows, slots, stores, *, spec, kv_dtype):
    out = copy_stores(stores)
    kv_entries.append_kv(k, v, cos, sin, np.asarray(rows, np.int64), np.asarray(slots, np.int64), out,
                         rotary_dim=spec.rotary_dim, layout=spec.layout, offset=spec.rotary_offset, kv_dtype=kv_dtype)
    return out


def check_append(kernels, k, v, spec, rows, slots, stores, *, kv_dtype, geometry="default", n_rows=64,
                 dtype_name=None):
    """The kernel's stores (from ``stores``) equal the reference's bit for bit; returns the plan."""
    cos, sin = tables(spec, n_rows, work_of(k.dtype))
    want = reference(k, v, cos, sin, rows, slots, stores, spec=spec, kv_dtype=kv_dtype)
    got = copy_stores(stores)
    k0, v0 = k.copy(), v.copy()
    plan = launch_append(kernels, k, v, cos, sin, rows, slots, got, spec=spec, kv_dtype=kv_dtype, geometry=geometry,
                         dtype_name=dtype_name)
    assert_same_bits(got, want)
    np.testing.assert_array_equal(bits(k), bits(k0))   # inputs untouched
    np.testing.assert_array_equal(bits(v), bits(v0))
    return plan


def paged_slots(rng, n_tokens, pool):
    """Distinct slots in a scattered (paged) order."""
    return rng.permutation(pool)[:n_tokens].astype(np.int64)


# -- bit-identical to the reference --------------------------------------------------------------------------
SHAPES = {   # name: (head_dim, rotary_dim, rotary_offset)
    "full": (24, 24, 0),
    "partial": (40, 12, 0),
    "offset": (26, 10, 4),     # pass-through before and after the rotated span
    "odd": (19, 14, 2),
}


@pytest.mark.parametrize("geometry", list(GEOMETRIES))
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_append_is_bit_identical_to_the_reference(kernels, dtype, kv_dtype, layout, shape, geometry, rng):
    if kv_dtype == "float8_e4m3" and dtype == "float64":
        pytest.skip("float8 entries are quantized from float32 work values (a float64 cache refuses them)")
    head_dim, rotary_dim, offset = SHAPES[shape]
    spec = RopeSpec(head_dim, rotary_dim=rotary_dim, layout=layout, rotary_offset=offset)
    T, Hk, P = 9, 3, 32
    scale = 1.0 if kv_dtype is None else 10.0 ** rng.uniform(-3, 3, (T, Hk, 1))   # per-(token, head) ranges
    k = (rng.standard_normal((T, Hk, head_dim)) * scale).astype(dtype)
    v = (rng.standard_normal((T, Hk, head_dim)) * scale).astype(dtype)
    rows = rng.integers(0, 64, T)
    plan = check_append(kernels, k, v, spec, rows, paged_slots(rng, T, P), make_stores(P, Hk, head_dim, dtype,
                                                                                       kv_dtype, rng),
                        kv_dtype=kv_dtype, geometry=geometry)
    assert plan.kernel == cb.kv_append_kernel_name(dtype, kv_dtype)
    if geometry != "default":
        assert plan.grid >= 3   # many blocks for a small input


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", ["float32", "float16", "float64"])
def test_strided_and_reversed_inputs(kernels, dtype, kv_dtype, rng):
    """k a strided view (every other head and coordinate), v a transposed, token-reversed view."""
    if kv_dtype == "float8_e4m3" and dtype == "float64":
        pytest.skip("no float8 from float64")
    spec = RopeSpec(32, rotary_dim=16, layout="interleaved", rotary_offset=6)
    T, Hk, P = 11, 2, 16
    k = rng.standard_normal((T, 2 * Hk, 64)).astype(dtype)[:, ::2, ::2]
    v = np.ascontiguousarray(rng.standard_normal((Hk, T, 32)).astype(dtype)).transpose(1, 0, 2)[::-1]
    assert not k.flags.c_contiguous and v.strides[0] < 0
    for geometry in ("default", "tiny"):
        check_append(kernels, k, v, spec, rng.integers(0, 64, T), paged_slots(rng, T, P),
                     make_stores(P, Hk, 32, dtype, kv_dtype, rng), kv_dtype=kv_dtype, geometry=geometry)


def test_bfloat16_inputs(kernels, rng):
    """bf16 k/v (uint16 bits on the host; the reference on ml_dtypes bfloat16 arrays): float entries rounded to
    bf16, quantized entries from the exact float32 values."""
    spec = RopeSpec(16, rotary_dim=12, layout="half")
    T, Hk, P = 5, 2, 8
    k = rng.standard_normal((T, Hk, 16)).astype(ml_dtypes.bfloat16)
    v = rng.standard_normal((T, Hk, 16)).astype(ml_dtypes.bfloat16)
    rows, slots = rng.integers(0, 64, T), paged_slots(rng, T, P)
    cos, sin = tables(spec, 64, np.float32)
    for kv_dtype in KV_DTYPES:
        stores = make_stores(P, Hk, 16, np.float32, kv_dtype, rng)
        if kv_dtype is None:
            stores = (stores[0].astype(ml_dtypes.bfloat16), stores[1].astype(ml_dtypes.bfloat16), None, None)
        want = reference(k, v, cos, sin, rows, slots, stores, spec=spec, kv_dtype=kv_dtype)
        got = copy_stores(stores)
        launch_append(kernels, k.view(np.uint16), v.view(np.uint16), cos, sin, rows, slots, got, spec=spec,
                      kv_dtype=kv_dtype, dtype_name="bfloat16")
        assert_same_bits(got, want)


def test_float8_encoder_on_every_value_and_every_tie(kernels):
    """v rows whose amax is 448 (scale 1): every finite float8_e4m3fn value, every midpoint between neighbours
    (ties to even), points just off the midpoints, subnormals and signed zeros; against ml_dtypes."""
    finite = kv_entries.FP8_VALUES[np.isfinite(kv_entries.FP8_VALUES)]
    pos = np.unique(finite[finite >= 0]).astype(np.float64)
    mids = (pos[1:] + pos[:-1]) / 2
    values = np.concatenate([pos, mids, np.nextafter(mids.astype(np.float32), 0), np.nextafter(mids.astype(np.float32),
                                                                                                 np.inf)])
    values = np.concatenate([values, -values, [-0.0, 2.0 ** -12, -(2.0 ** -10), 447.9]]).astype(np.float32)
    D = 15
    n_rows = -(-values.size // (D - 1))
    filled = np.zeros(n_rows * (D - 1), np.float32)
    filled[:values.size] = values
    v = np.concatenate([filled.reshape(n_rows, 1, D - 1), np.full((n_rows, 1, 1), 448, np.float32)], axis=-1)
    k = np.zeros_like(v)
    spec = RopeSpec(D, rotary_dim=2)   # k rows are zeros: scale 0
    stores = make_stores(n_rows, 1, D, np.float32, "float8_e4m3", np.random.default_rng(0))
    cos, sin = tables(spec, 4, np.float32)
    got = copy_stores(stores)
    launch_append(kernels, k, v, cos, sin, np.zeros(n_rows), np.arange(n_rows), got, spec=spec, kv_dtype="float8_e4m3")
    assert np.all(got[3] == 1.0) and np.all(got[2] == 0.0)
    np.testing.assert_array_equal(got[1], v.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))
    assert_same_bits(got, reference(k, v, cos, sin, np.zeros(n_rows), np.arange(n_rows), stores, spec=spec,
                                    kv_dtype="float8_e4m3"))


@pytest.mark.parametrize("kv_dtype", ["int8", "float8_e4m3"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_degenerate_heads(kernels, dtype, kv_dtype):
    """Heads of zeros (scale 0), of signed zeros, of subnormals whose scale underflows or rounds to the
    smallest subnormal (y = w / scale far past the range: int8 clips, float8 turns NaN as ml_dtypes does),
    int8 ties (x.5 after scaling), a head with one huge value."""
    D = 8
    heads = [np.zeros(D), -np.zeros(D), np.full(D, 2.0 ** -140), np.full(D, 1e-45), np.r_[127.0, 0.5, 1.5, 2.5,
                                                                                           -0.5, -1.5, 63.5, -126.5],
             np.r_[6e4, np.ones(D - 1)], np.r_[-448.0, 0.75, 224.0 + 8, 3.0, -1e-3, 7.0, 2.0 ** -9, 0.0]]
    v = np.array(heads, np.float64)[:, None, :]
    if dtype == "float16":
        v = np.where(np.abs(v) < 2.0 ** -24, 0.0, np.minimum(v, 6e4))
    v = v.astype(dtype)
    T = v.shape[0]
    k = v[::-1].copy()
    spec = RopeSpec(D, rotary_dim=4)
    stores = make_stores(T + 3, 1, D, dtype, kv_dtype, np.random.default_rng(1))
    for geometry in ("default", "tiny"):
        check_append(kernels, k, v, spec, np.zeros(T, np.int64), np.arange(T)[::-1] + 2, stores, kv_dtype=kv_dtype,
                     geometry=geometry, n_rows=4)


def test_many_heads_and_a_wide_head(kernels, rng):
    """More rows than a block holds at once (several rounds per block), head_dim 256 (units past the group)."""
    for T, Hk, D, kv_dtype in ((40, 16, 8, "int8"), (3, 2, 256, "float8_e4m3"), (6, 5, 130, None)):
        spec = RopeSpec(D, rotary_dim=D - 2 if D > 8 else D)
        k = rng.standard_normal((T, Hk, D)).astype(np.float32)
        v = rng.standard_normal((T, Hk, D)).astype(np.float32)
        for geometry in ("default", "small"):
            check_append(kernels, k, v, spec, rng.integers(0, 64, T), paged_slots(rng, T, 2 * T),
                         make_stores(2 * T, Hk, D, np.float32, kv_dtype, rng), kv_dtype=kv_dtype, geometry=geometry)


# -- geometry, plan checks, the shim's own checks ------------------------------------------------------------
def test_kv_cache_family_in_the_kernel_tables():
    """The family is in SOURCES (so tests/test_nvrtc.py compiles it for every target, and the shim builds it),
    with an append and an attention kernel per kv dtype (no float8 from float64)."""
    assert cb.SOURCES["kv_cache"] == "kv_cache.cu"
    assert cb.name_expressions("kv_cache", "float64") == [
        "kv_append<double, double, 0>", "kv_append<double, double, 1>",
        "kv_decode_attention<double, double, 0>", "kv_decode_attention<double, double, 1>"]
    for dtype in ("float32", "float16", "bfloat16"):
        names = cb.name_expressions("kv_cache", dtype)
        assert len(names) == 6 and names[2] == cb.kv_append_kernel_name(dtype, "float8_e4m3")
    built = {expr for family, _, expr in host.instantiations() if family == "kv_cache"}
    assert built == {n for d in host.DTYPES for n in cb.name_expressions("kv_cache", d)}


@pytest.mark.parametrize("n_tokens,heads,head_dim", [(1, 8, 128), (4096, 8, 128), (7, 1, 64), (3, 40, 16),
                                                     (1, 1, 2), (100000, 32, 256)])
@pytest.mark.parametrize("threads", [256, 128, 5])
def test_geometry_covers_every_token(n_tokens, heads, head_dim, threads):
    grid, block, group, tpb, smem = cb.kv_append_geometry(n_tokens, heads, head_dim, work_itemsize=4,
                                                          quantized=True, threads=threads)
    assert grid * tpb >= n_tokens > (grid - 1) * tpb
    assert block % group == 0 and block <= max(threads, group) and group & (group - 1) == 0
    assert group == min(32, 1 << (head_dim - 1).bit_length(), 1 << (threads.bit_length() - 1))
    assert smem == 4 * block
    assert cb.kv_append_geometry(n_tokens, heads, head_dim, work_itemsize=4, quantized=False,
                                 threads=threads)[4] == 0


def test_plan_refuses_what_the_kernel_cannot_take(rng):
    spec = RopeSpec(16)
    k = v = np.zeros((3, 2, 16), np.float32)
    cos, sin = tables(spec, 8, np.float32)
    rows = slots = np.arange(3, dtype=np.int64)
    kw = dict(dtype_name="float32", rotary_dim=16, layout="half", offset=0)
    good = make_stores(4, 2, 16, np.float32, "int8", rng)
    assert cb.plan_append_kv(k, v, cos, sin, rows, slots, good, kv_dtype="int8", **kw).family == "kv_cache"
    bad = [
        ((k, v, cos, sin, rows, slots, good), dict(kv_dtype="float8_e4m3"), "uint8"),
        ((k, v, cos, sin, rows, slots, (good[0], good[1], None, None)), dict(kv_dtype="int8"), "scales"),
        ((k, v, cos, sin, rows, slots, make_stores(4, 2, 16, np.float32, None, rng)), dict(kv_dtype="int8"), "int8"),
        ((k, v, cos, sin, rows, slots, make_stores(4, 2, 16, np.float16, None, rng)), dict(kv_dtype=None), "float16"),
        ((k, v, cos, sin, rows, slots, (good[0][:, :, ::-1],) + good[1:]), dict(kv_dtype="int8"), "C-contiguous"),
        ((k, v[:2], cos, sin, rows, slots, good), dict(kv_dtype="int8"), "same"),
        ((k, v, cos, sin, rows.astype(np.int32), slots, good), dict(kv_dtype="int8"), "int64"),
        ((k, v, cos.astype(np.float64), sin, rows, slots, good), dict(kv_dtype="int8"), "cos"),
        ((k, v, cos, sin, rows, slots, good), dict(kv_dtype="int4"), "kv_dtype"),
    ]
    for args, extra, match in bad:
        with pytest.raises(ValueError, match=match):
            cb.plan_append_kv(*args, **kw, **extra)
    with pytest.raises(ValueError, match="float32 work"):
        cb.plan_append_kv(k.astype(np.float64), v.astype(np.float64), *tables(spec, 8, np.float64), rows, slots,
                          good, kv_dtype="float8_e4m3", **{**kw, "dtype_name": "float64"})
    with pytest.raises(ValueError, match="does not fit"):
        cb.plan_append_kv(k, v, cos, sin, rows, slots, good, kv_dtype="int8", **{**kw, "offset": 2})
    empty = np.zeros((0, 2, 16), np.float32)
    assert cb.plan_append_kv(empty, empty, cos, sin, rows[:0], slots[:0], good, kv_dtype="int8", **kw) is None


def test_kernel_passes_the_shim_checks(kernels, rng):
    """Exact-extent copies of the buffers (out-of-bounds accesses fault), every launch under two shared-memory
    poisons (a read of unwritten shared memory changes the result) and three concurrent block slots."""
    checked = host.HostKernels(kernels.path, kernels.entries, slots=3, guard=True, compare=True)
    for kv_dtype in KV_DTYPES:
        for geometry in ("tiny", "odd", "default"):
            spec = RopeSpec(20, rotary_dim=14, rotary_offset=2, layout="interleaved")
            T, Hk = 7, 3
            k = rng.standard_normal((T, Hk, 20)).astype(np.float16)
            v = rng.standard_normal((T, Hk, 20)).astype(np.float16)
            check_append(checked, k, v, spec, rng.integers(0, 64, T), paged_slots(rng, T, 12),
                         make_stores(12, Hk, 20, np.float16, kv_dtype, rng), kv_dtype=kv_dtype, geometry=geometry)
    assert checked.launches == 9


# -- the CuPy glue and rotary.KVCache -------------------------------------------------------------------------
def test_cupy_glue_append_kv(fake_cupy, rng):
    """rotary.backends.cupy.append_kv with NumPy-backed stand-ins for CuPy: one launch, the reference's bits."""
    spec = RopeSpec(16, rotary_dim=8, rotary_offset=4)
    T, Hk, P = 6, 2, 10
    k = rng.standard_normal((T, Hk, 16)).astype(np.float32)
    v = rng.standard_normal((T, Hk, 16)).astype(np.float32)
    cos, sin = tables(spec, 32, np.float32)
    rows, slots = rng.integers(0, 32, T), paged_slots(rng, T, P)
    for i, kv_dtype in enumerate(KV_DTYPES):
        stores = make_stores(P, Hk, 16, np.float32, kv_dtype, rng)
        want = reference(k, v, cos, sin, rows, slots, stores, spec=spec, kv_dtype=kv_dtype)
        got = tuple(None if a is None else fake_cupy.wrap(a.copy()) for a in stores)
        cb.append_kv(fake_cupy.wrap(k), fake_cupy.wrap(v), fake_cupy.wrap(cos), fake_cupy.wrap(sin),
                     fake_cupy.wrap(rows), fake_cupy.wrap(slots), got, rotary_dim=8, layout="half", offset=4,
                     kv_dtype=kv_dtype)
        assert fake_cupy.launched[i] == cb.kv_append_kernel_name("float32", kv_dtype)
        assert_same_bits([None if a is None else np.asarray(a) for a in got], want)
    assert cb.KV_DTYPES == (None, "int8", "float8_e4m3")


def kv_shim_backend(kernels, attention=None, **geometry):
    """The rotation shim backend plus the kv_append kernel as its ``append_kv`` (NumPy arrays); ``attention``:
    also kv_decode_attention as its ``cache_attention``, with these plan options (a dict: threads, tile)."""
    module = shim_backend(kernels, threads=geometry.get("threads", 256))
    calls = []

    def append_kv(k, v, cos, sin, rows, slots, stores, *, rotary_dim, layout, offset, kv_dtype):
        work = work_of(k.dtype)
        cos, sin = np.ascontiguousarray(cos, work), np.ascontiguousarray(sin, work)
        plan = cb.plan_append_kv(k, v, cos, sin, np.ascontiguousarray(rows, np.int64).reshape(-1),
                                 np.ascontiguousarray(slots, np.int64).reshape(-1), stores, dtype_name=str(k.dtype),
                                 rotary_dim=rotary_dim, layout=layout, offset=offset, kv_dtype=kv_dtype, **geometry)
        kernels.launch(plan)
        calls.append(plan.kernel)

    def cache_attention(q, stores, block_table, page_size, lengths, *, scale, softcap, window, causal):
        o = np.empty(q.shape, q.dtype)
        plan = cb.plan_cache_attention(q, o, stores, np.ascontiguousarray(block_table, np.int64), page_size,
                                       np.ascontiguousarray(lengths, np.int64), dtype_name=str(q.dtype), scale=scale,
                                       softcap=softcap, window=window, causal=causal, **attention)
        kernels.launch(plan)
        calls.append(plan.kernel if plan is not None else None)
        return o

    extra = {} if attention is None else {"cache_attention": cache_attention}
    return types.SimpleNamespace(**vars(module), append_kv=append_kv, KV_DTYPES=cb.KV_DTYPES, calls=calls, **extra)


@pytest.fixture
def kv_backend(kernels, monkeypatch):
    def register(attention=None, **geometry):
        module = kv_shim_backend(kernels, attention, **geometry)
        monkeypatch.setitem(registry._MODULES, "cuda-shim", "tests.cuda_shim")
        monkeypatch.setitem(registry._loaded, "cuda-shim", module)
        return module

    return register


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_kvcache_paged_appends_and_attention(kv_backend, dtype, kv_dtype, rng):
    """rotary.KVCache on the append kernel (a paged pool: prefill of ragged sequences packed with cu_seqlens, decode
    steps, a freed sequence whose pages are reused) holds the NumPy backend's bits after every append, and
    rotary.attention over it (the gathered keys: no cache_attention here) gives the same output."""
    import rotary

    module = kv_backend(threads=64, max_tokens_per_block=2)
    spec = RopeSpec(32, rotary_dim=24, layout="interleaved", base=500.0)
    kw = dict(batch=3, kv_heads=2, head_dim=32, page_size=4, num_pages=16, dtype=dtype, kv_dtype=kv_dtype)
    caches = {name: rotary.KVCache(spec, backend=name, **kw) for name in ("cuda-shim", "numpy")}
    assert caches["cuda-shim"].module is module

    def both(fn):
        for cache in caches.values():
            fn(cache)
        shim, ref = caches["cuda-shim"], caches["numpy"]
        np.testing.assert_array_equal(shim.block_table, ref.block_table)
        np.testing.assert_array_equal(shim.lengths, ref.lengths)
        held = np.concatenate([ref.slots(b, 0, int(n)) for b, n in enumerate(ref.lengths)])   # the pools are
        assert_same_bits([None if a is None else a[held] for a in shim.stores],               # np.empty elsewhere
                         [None if a is None else a[held] for a in ref.stores])

    cu = np.array([0, 5, 6, 13])
    k = rng.standard_normal((13, 2, 32)).astype(dtype)
    v = rng.standard_normal((13, 2, 32)).astype(dtype)
    both(lambda c: c.append(k, v, cu_seqlens=cu))
    for step in range(3):
        kd = rng.standard_normal((3, 1, 2, 32)).astype(dtype)
        vd = rng.standard_normal((3, 1, 2, 32)).astype(dtype)
        both(lambda c: c.append(kd, vd))
    both(lambda c: c.free([1]))
    kd = rng.standard_normal((1, 6, 2, 32)).astype(dtype)
    both(lambda c: c.append(kd, kd[:, ::-1], seq_ids=[1]))
    assert len(module.calls) == 5 and set(module.calls) == {cb.kv_append_kernel_name(np.dtype(dtype).name, kv_dtype)}
    q = rng.standard_normal((3, 1, 4, 32)).astype(dtype)
    outs = [rotary.attention(q, caches[name]) for name in ("cuda-shim", "numpy")]
    np.testing.assert_array_equal(outs[0], outs[1])


# -- kv_decode_attention (the cache_attention capability) ----------------------------------------------------
#: what the kernel's output may differ by from the reference path (keys gathered, dequantized into the cache's
#: dtype, rotary.attention's engine): exp/tanh and the summation order, and for fp16 caches the reference's
#: rounding of dequantized keys to fp16; relative to max |o|
ATTENTION_TOL = {"float32": 2e-6, "float64": 1e-12, "float16": 2e-3}


def filled_caches(rng, kv_backend, *, dtype, kv_dtype, attention, kind, layout="bshd", spec=None, hq=4):
    """A cache on the shim (append and attention kernels) and one on NumPy with the same ragged appends."""
    import rotary

    kv_backend(attention=attention, threads=64)
    spec = spec or RopeSpec(32, rotary_dim=24, layout="interleaved", base=500.0)
    kw = dict(batch=3, kv_heads=2, head_dim=32, dtype=dtype, kv_dtype=kv_dtype, layout=layout, **kind)
    caches = [rotary.KVCache(spec, backend=name, **kw) for name in ("cuda-shim", "numpy")]
    cu = np.array([0, 9, 10, 30])
    k = rng.standard_normal((30, 2, 32)).astype(dtype)
    v = rng.standard_normal((30, 2, 32)).astype(dtype)
    for cache in caches:
        cache.append(k, v, cu_seqlens=cu)
    for _ in range(2):   # decode steps: lengths 11, 12, 32
        kd = rng.standard_normal((3, 1, 2, 32)).astype(dtype)
        vd = rng.standard_normal((3, 1, 2, 32)).astype(dtype)
        if layout == "bhsd":
            kd, vd = kd.transpose(0, 2, 1, 3), vd.transpose(0, 2, 1, 3)
        for cache in caches:
            cache.append(kd, vd)
    return caches


def assert_attention_close(caches, q, dtype, **kw):
    import rotary

    got, want = (rotary.attention(q, cache, **kw) for cache in caches)
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = ATTENTION_TOL[np.dtype(dtype).name]
    err = np.abs(got.astype(np.float64) - want.astype(np.float64)).max() / np.abs(want.astype(np.float64)).max()
    assert err <= tol, f"relative error {err:.3g} > {tol:.1g}"


ATTENTION_CASES = {   # name: (attention keyword arguments, queries per sequence)
    "decode": ({}, 1),
    "chunk": ({}, 3),
    "window": (dict(window=4), 3),
    "softcap": (dict(softcap=2.5, scale=0.4), 2),
    "noncausal": (dict(causal=False), 2),
}


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", ["float32", "float16", "float64"])
def test_cache_attention_matches_the_reference_path(kv_backend, dtype, kv_dtype, case, rng):
    """GQA 4:2, a paged pool, ragged lengths 11/12/32, decode and chunks, window, softcap, non-causal."""
    if kv_dtype == "float8_e4m3" and dtype == "float64":
        pytest.skip("no float8 from float64")
    kw, s = ATTENTION_CASES[case]
    caches = filled_caches(rng, kv_backend, dtype=dtype, kv_dtype=kv_dtype, attention=dict(threads=32, tile=8),
                           kind=dict(page_size=4, num_pages=40))
    q = rng.standard_normal((3, s, 4, 32)).astype(dtype)
    assert_attention_close(caches, q, dtype, **kw)
    assert caches[0].module.calls[-1] == cb.kv_attention_kernel_name(dtype, kv_dtype)


@pytest.mark.parametrize("attention", [dict(threads=128), dict(threads=5, tile=3), dict(threads=48, tile=48)],
                         ids=["default", "tiny", "odd"])
def test_cache_attention_geometries_contiguous_bhsd_seq_ids(kv_backend, attention, rng):
    """Block sizes (the default, 5 threads with 3-key tiles, 48), a contiguous cache in the bhsd layout, queries
    of some sequences only (seq_ids), GQA 8:2."""
    caches = filled_caches(rng, kv_backend, dtype="float32", kv_dtype="int8", attention=attention,
                           kind=dict(capacity=40), layout="bhsd", hq=8)
    q = rng.standard_normal((2, 8, 2, 32)).astype(np.float32)   # (n, heads, s, d)
    assert_attention_close(caches, q, "float32", seq_ids=[2, 0], window=7)
    assert_attention_close(caches, q[:, :, 1:], "float32", seq_ids=[1, 2])


def test_cache_attention_partial_rotary_offset_and_long_sequences(kv_backend, rng):
    """rotary_offset and partial rotary through attention's q rotation; sequences of several tiles."""
    import rotary

    kv_backend(attention=dict(threads=32, tile=16), threads=64)
    spec = RopeSpec(32, rotary_dim=16, rotary_offset=6)
    kw = dict(batch=2, kv_heads=1, head_dim=32, page_size=8, num_pages=40, dtype=np.float32, kv_dtype="float8_e4m3")
    caches = [rotary.KVCache(spec, backend=name, **kw) for name in ("cuda-shim", "numpy")]
    k = rng.standard_normal((2, 70, 1, 32)).astype(np.float32)
    v = rng.standard_normal((2, 70, 1, 32)).astype(np.float32)
    for cache in caches:
        cache.append(k, v)
    q = rng.standard_normal((2, 1, 3, 32)).astype(np.float32)
    assert_attention_close(caches, q, "float32")
    assert_attention_close(caches, q, "float32", window=20, softcap=5.0)


def test_cache_attention_plan_and_shim_checks(kernels, rng):
    """The plan's checks, and the kernel under exact-extent copies, two shared-memory poisons and three block
    slots (a read of shared memory no thread wrote, or past a buffer, would show)."""
    checked = host.HostKernels(kernels.path, kernels.entries, slots=3, guard=True, compare=True)
    for kv_dtype in KV_DTYPES:
        stores = make_stores(24, 2, 16, np.float16, kv_dtype, rng)
        if kv_dtype is not None:
            stores = stores[:2] + tuple(np.abs(a) + 0.01 for a in stores[2:])
        else:
            stores = tuple(np.clip(a, -4, 4) if a is not None else None for a in stores)
        table = np.array([[5, 2, 0], [1, 3, 4]], np.int64)
        lengths = np.array([11, 7], np.int64)
        q = rng.standard_normal((2, 3, 4, 16)).astype(np.float16)
        outs = []
        for threads, tile in ((7, 3), (32, 32)):
            o = np.full(q.shape, np.nan, q.dtype)
            plan = cb.plan_cache_attention(q, o, stores, table, 4, lengths, dtype_name="float16", scale=0.25,
                                           softcap=None, window=5, causal=True, threads=threads, tile=tile)
            checked.launch(plan)
            assert np.all(np.isfinite(o))
            outs.append(o.astype(np.float64))
        np.testing.assert_allclose(outs[0], outs[1], rtol=2e-3, atol=2e-3)
    o = np.empty_like(q)
    with pytest.raises(ValueError, match="multiple"):
        cb.plan_cache_attention(q[:, :, :3], np.empty((2, 3, 3, 16), q.dtype), stores, table, 4, lengths,
                                dtype_name="float16", scale=1.0, softcap=None, window=None, causal=True)
    with pytest.raises(ValueError, match="int64"):
        cb.plan_cache_attention(q, o, stores, table.astype(np.int32), 4, lengths, dtype_name="float16", scale=1.0,
                                softcap=None, window=None, causal=True)
    assert cb.plan_cache_attention(q[:0], o[:0], stores, table[:0], 4, lengths[:0], dtype_name="float16", scale=1.0,
                                   softcap=None, window=None, causal=True) is None
    assert cb.kv_dtype_of(stores) == "float8_e4m3"


def test_cupy_glue_cache_attention(fake_cupy, kv_backend, rng):
    """rotary.backends.cupy.cache_attention with the NumPy stand-ins for CuPy: one launch, the bits of the same
    plan launched on the NumPy arrays directly."""
    caches = filled_caches(rng, kv_backend, dtype="float32", kv_dtype="int8", attention=dict(),
                           kind=dict(page_size=4, num_pages=40))
    shim, cache = caches
    q = rng.standard_normal((3, 2, 4, 32)).astype(np.float32)
    kw = dict(scale=0.3, softcap=None, window=None, causal=True)
    stores = tuple(None if a is None else fake_cupy.wrap(a) for a in cache.stores)
    o = cb.cache_attention(fake_cupy.wrap(q), stores, fake_cupy.wrap(cache.block_table), cache.page_size,
                           fake_cupy.wrap(cache.lengths), **kw)
    assert fake_cupy.launched == [cb.kv_attention_kernel_name("float32", "int8")]
    assert isinstance(o, _cpu_tests.FakeCupyArray) and o.shape == q.shape and o.dtype == q.dtype
    direct = shim.module.cache_attention(q, cache.stores, cache.block_table, cache.page_size, cache.lengths, **kw)
    np.testing.assert_array_equal(np.asarray(o), direct)
