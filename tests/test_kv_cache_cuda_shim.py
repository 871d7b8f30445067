"""The CUDA KV-cache kernels (``cuda_kernels/kv_cache.cu``: kv_append, paged_attention) on the CPU through
tests/cuda_shim, with the CuPy backend's plans (``plan_append_kv``, ``plan_paged_attention``) launched on NumPy
arrays.

kv_append is compared bit for bit with the reference ``rotary.backends.kv_entries.append_kv`` run on NumPy copies
of the same stores (entries, scales, and the slots the append must leave alone), given only the tokens that are not
padding (slot -1: the kernel must skip them): float32/float64/float16/bfloat16 data, float / int8 / float8_e4m3
entries, half and interleaved pairs, partial rotary with an offset, strided / reversed k and v, paged slot orders,
block geometries with many blocks and odd thread groups. paged_attention is compared with a float64 oracle written
here (keys gathered through the block table, dequantized, an explicit masked softmax) over pools the append kernel
filled: packed prefill chunks and decode steps of ragged sequences in one launch (an empty sequence among them),
dense decode, GQA 1/2/4/8/9 (a block per kv head, two head chunks past 8), window, softcap, non-causal, pages
shared between sequences, unused slots and table entries holding NaN (a read of a key the query must not see
shows), -1 table entries before the window, 1, 2 and 7 forced splits (split-K with empty splits, merged by
paged_attention_combine), 16-byte and entry-by-entry staging; within 2e-6 (fp32), 1e-12 (fp64), 2e-3 (fp16) of
max |o|. Then the split rule and the geometry, the plans' checks, the shim's own checks (exact-extent buffers,
two shared-memory poisons, concurrent blocks) and the CuPy glue on NumPy-backed stand-ins.
"""

from __future__ import annotations

import numpy as np
import pytest

from rotary import RopeSpec
from rotary.backends import cupy as cb
from rotary.backends import kv_entries
from rotary.backends.kv_entries import KV_FORMATS

from . import test_cuda_kernels_cpu as _cpu_tests
from .cuda_shim import host
from .cuda_shim.kv_backend import kv_shim_backend, register, shared_kernels, work_of

pytestmark = pytest.mark.cuda_cpu

ml_dtypes = pytest.importorskip("ml_dtypes")

#: CuPy replaced by NumPy-backed stand-ins that launch through the shim (a fixture of test_cuda_kernels_cpu)
fake_cupy = _cpu_tests.fake_cupy
#: kv_append (threads, group, tokens per block cap): the default plan, tiny blocks with odd groups, a block per token
GEOMETRIES = {"default": (256, None, None), "tiny": (5, 3, 1), "odd": (40, 7, 2), "small": (32, None, 3)}
KV_DTYPES = list(KV_FORMATS)
#: every (data dtype, KV format) the kernels take: float8 from float32 work values only
FORMATS = [(d, kv) for d in ("float32", "float16", "float64") for kv in KV_DTYPES
           if not (d == "float64" and KV_FORMATS[kv].fp32_work_only)]
FORMAT_IDS = [f"{d}-{kv}" for d, kv in FORMATS]


@pytest.fixture(scope="module")
def kernels():
    return shared_kernels()


# -- helpers ---------------------------------------------------------------------------------------------
def make_stores(slots, heads, head_dim, dtype, kv_dtype, rng):
    """Pool arrays of format kv_dtype, filled with garbage (the append must only write its slots)."""
    shape = (slots, heads, head_dim)
    if kv_dtype is None:
        entries = [rng.standard_normal(shape).astype(dtype) for _ in range(2)]
    else:
        entry = np.dtype(KV_FORMATS[kv_dtype].entry)
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


def append_reference(k, v, cos, sin, rows, slots, stores, *, rotary_dim, layout, offset, kv_dtype):
    """The reference append (kv_entries.append_kv) of the tokens that are not padding, into ``stores``."""
    keep = np.asarray(slots) >= 0
    kv_entries.append_kv(k[keep], v[keep], cos, sin, np.asarray(rows, np.int64)[keep],
                         np.asarray(slots, np.int64)[keep], stores, rotary_dim=rotary_dim, layout=layout,
                         offset=offset, kv_dtype=kv_dtype)


def reference(k, v, cos, sin, rows, slots, stores, *, spec, kv_dtype):
    """The reference append of the tokens that are not padding, on copies of ``stores``."""
    out = copy_stores(stores)
    append_reference(k, v, cos, sin, rows, slots, out, rotary_dim=spec.rotary_dim, layout=spec.layout,
                     offset=spec.rotary_offset, kv_dtype=kv_dtype)
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


def with_padding(rng, k, v, rows, slots, n_pad):
    """k, v, rows, slots with ``n_pad`` padding tokens inserted at random places: slot -1, row -1 (outside the
    table: a read of it would be out of bounds), k and v NaN (a write of them would show)."""
    if n_pad == 0:
        return k, v, np.asarray(rows, np.int64), np.asarray(slots, np.int64)
    at = np.sort(rng.integers(0, len(slots) + 1, n_pad))
    nan = np.full((n_pad,) + k.shape[1:], np.nan, k.dtype)
    return (np.insert(k, at, nan, axis=0), np.insert(v, at, nan, axis=0),
            np.insert(np.asarray(rows, np.int64), at, -1), np.insert(np.asarray(slots, np.int64), at, -1))


# -- kv_append: bit-identical to the reference -------------------------------------------------------------
SHAPES = {   # name: (head_dim, rotary_dim, rotary_offset)
    "full": (24, 24, 0),
    "partial": (40, 12, 0),
    "offset": (26, 10, 4),     # pass-through before and after the rotated span
    "odd": (19, 14, 2),
}


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("dtype,kv_dtype", FORMATS, ids=FORMAT_IDS)
def test_append_is_bit_identical_to_the_reference(kernels, dtype, kv_dtype, layout, rng):
    """Every shape, each under another block geometry (over the formats and layouts every geometry meets every
    shape), with padding tokens among the others."""
    shift = FORMATS.index((dtype, kv_dtype)) + (layout == "interleaved")
    for i, shape in enumerate(SHAPES):
        geometry = list(GEOMETRIES)[(i + shift) % len(GEOMETRIES)]
        head_dim, rotary_dim, offset = SHAPES[shape]
        spec = RopeSpec(head_dim, rotary_dim=rotary_dim, layout=layout, rotary_offset=offset)
        T, Hk, P = 9, 3, 32
        scale = 1.0 if kv_dtype is None else 10.0 ** rng.uniform(-3, 3, (T, Hk, 1))   # per-(token, head) ranges
        k = (rng.standard_normal((T, Hk, head_dim)) * scale).astype(dtype)
        v = (rng.standard_normal((T, Hk, head_dim)) * scale).astype(dtype)
        k, v, rows, slots = with_padding(rng, k, v, rng.integers(0, 64, T), paged_slots(rng, T, P), i % 3)
        plan = check_append(kernels, k, v, spec, rows, slots, make_stores(P, Hk, head_dim, dtype, kv_dtype, rng),
                            kv_dtype=kv_dtype, geometry=geometry)
        assert plan.kernel == cb.kv_append_kernel_name(dtype, kv_dtype)
        if geometry != "default":
            assert plan.grid >= 3   # many blocks for a small input


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64"])
def test_strided_and_reversed_inputs(kernels, dtype, rng):
    """k a strided view (every other head and coordinate), v a transposed, token-reversed view."""
    spec = RopeSpec(32, rotary_dim=16, layout="interleaved", rotary_offset=6)
    T, Hk, P = 11, 2, 16
    k = rng.standard_normal((T, 2 * Hk, 64)).astype(dtype)[:, ::2, ::2]
    v = np.ascontiguousarray(rng.standard_normal((Hk, T, 32)).astype(dtype)).transpose(1, 0, 2)[::-1]
    assert not k.flags.c_contiguous and v.strides[0] < 0
    for kv_dtype in KV_DTYPES:
        if dtype == "float64" and KV_FORMATS[kv_dtype].fp32_work_only:
            continue
        for geometry in ("default", "tiny"):
            check_append(kernels, k, v, spec, rng.integers(0, 64, T), paged_slots(rng, T, P),
                         make_stores(P, Hk, 32, dtype, kv_dtype, rng), kv_dtype=kv_dtype, geometry=geometry)


def test_padding_only_and_padding_around_blocks(kernels, rng):
    """An append of padding tokens only writes nothing; padding at the ends of blocks and whole blocks of it."""
    spec = RopeSpec(16, rotary_dim=12)
    for kv_dtype in KV_DTYPES:
        stores = make_stores(8, 2, 16, "float32", kv_dtype, rng)
        k = np.full((5, 2, 16), np.nan, np.float32)
        got = copy_stores(stores)
        cos, sin = tables(spec, 8, np.float32)
        launch_append(kernels, k, k, cos, sin, np.full(5, -1), np.full(5, -1), got, spec=spec, kv_dtype=kv_dtype)
        assert_same_bits(got, stores)
        k = rng.standard_normal((6, 2, 16)).astype(np.float32)
        slots = np.array([-1, 3, -1, -1, 7, -1])   # 2 tokens per block ("odd"): padding-only block in the middle
        rows = np.where(slots < 0, -1, rng.integers(0, 64, 6))
        check_append(kernels, k, k[::-1], spec, rows, slots, stores, kv_dtype=kv_dtype, geometry="odd")


def test_bfloat16_inputs(kernels, rng):
    """bf16 k/v (uint16 bits on the host; the reference on ml_dtypes bfloat16 arrays): float entries rounded to
    bf16, quantized entries from the exact float32 values."""
    spec = RopeSpec(16, rotary_dim=12, layout="half")
    T, Hk, P = 5, 2, 8
    k = rng.standard_normal((T, Hk, 16)).astype(ml_dtypes.bfloat16)
    v = rng.standard_normal((T, Hk, 16)).astype(ml_dtypes.bfloat16)
    rows, slots = rng.integers(0, 64, T), paged_slots(rng, T, P)
    slots[2] = -1
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


# -- tables, geometry, plan checks, the shim's own checks ----------------------------------------------------
def test_kv_cache_family_in_the_kernel_tables():
    """The family is in SOURCES (so tests/test_nvrtc.py compiles it for every target, and the shim builds it),
    with an append and an attention kernel per KV format (no float8 from float64), and an append with the key norm
    per format (NORM: the module of group "norm", compiled when a call asks for it); the formats and the KIND codes
    are kv_entries.KV_FORMATS'."""
    assert cb.SOURCES["kv_cache"] == "kv_cache.cu"
    assert cb.name_expressions("kv_cache", "float64") == [
        "kv_append<double, double, 0>", "kv_append<double, double, 1>",
        "paged_attention<double, double, 0>", "paged_attention<double, double, 1>",
        "paged_attention_combine<double, double>",
        "kv_append<double, double, 0, true>", "kv_append<double, double, 1, true>"]
    assert cb.name_expressions("kv_cache", "float64", "norm") == cb.name_expressions("kv_cache", "float64")[-2:]
    assert cb.name_expressions("kv_cache", "float64", "") == cb.name_expressions("kv_cache", "float64")[:-2]
    for dtype in ("float32", "float16", "bfloat16"):
        names = cb.name_expressions("kv_cache", dtype)
        assert len(names) == 10 and names[2] == cb.kv_append_kernel_name(dtype, "float8_e4m3")
        assert names[5] == cb.paged_attention_kernel_name(dtype, "float8_e4m3")
        assert names[6] == cb.paged_attention_combine_kernel_name(dtype)
        assert names[7:] == [cb.kv_append_kernel_name(dtype, kind, norm=True) for kind in KV_DTYPES]
        assert [cb.kernel_group(n) for n in names] == [""] * 7 + ["norm"] * 3
    assert cb.kv_append_kernel_name("float32", "float8_e4m3").endswith(f"{KV_FORMATS['float8_e4m3'].code}>")
    assert cb.VARIANTS == {"append_kv": (None, "int8", "float8_e4m3"), "paged_attention": (None, "int8", "float8_e4m3")}
    for gone in ("cache_attention", "plan_cache_attention", "kv_dtype_of", "KV_DTYPES", "KV_KINDS"):
        assert not hasattr(cb, gone)
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


def test_append_plan_refuses_what_the_kernel_cannot_take(rng):
    spec = RopeSpec(16)
    k = v = np.zeros((3, 2, 16), np.float32)
    cos, sin = tables(spec, 8, np.float32)
    rows = slots = np.arange(3, dtype=np.int64)
    kw = dict(dtype_name="float32", rotary_dim=16, layout="half", offset=0)
    good = make_stores(4, 2, 16, np.float32, "int8", rng)
    assert cb.plan_append_kv(k, v, cos, sin, rows, slots, good, kv_dtype="int8", **kw).family == "kv_cache"
    bad = [
        ((k, v, cos, sin, rows, slots, good), dict(kv_dtype="float8_e4m3"), "uint8"),
        ((k, v, cos, sin, rows, slots, good), dict(kv_dtype=None), "int8, the data float32"),   # never inferred
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


def test_append_passes_the_shim_checks(kernels, rng):
    """Exact-extent copies of the buffers (out-of-bounds accesses fault), every launch under two shared-memory
    poisons (a read of unwritten shared memory changes the result) and three concurrent block slots."""
    checked = host.HostKernels(kernels.path, kernels.entries, slots=3, guard=True, compare=True)
    for kv_dtype in KV_DTYPES:
        for geometry in ("tiny", "odd", "default"):
            spec = RopeSpec(20, rotary_dim=14, rotary_offset=2, layout="interleaved")
            T, Hk = 7, 3
            k = rng.standard_normal((T, Hk, 20)).astype(np.float16)
            v = rng.standard_normal((T, Hk, 20)).astype(np.float16)
            k, v, rows, slots = with_padding(rng, k, v, rng.integers(0, 64, T), paged_slots(rng, T, 12), 2)
            check_append(checked, k, v, spec, rows, slots, make_stores(12, Hk, 20, np.float16, kv_dtype, rng),
                         kv_dtype=kv_dtype, geometry=geometry)
    assert checked.launches == 9


def test_cupy_glue_append_kv(fake_cupy, rng):
    """rotary.backends.cupy.append_kv with NumPy-backed stand-ins for CuPy: one launch, the reference's bits."""
    spec = RopeSpec(16, rotary_dim=8, rotary_offset=4)
    T, Hk, P = 6, 2, 10
    k = rng.standard_normal((T, Hk, 16)).astype(np.float32)
    v = rng.standard_normal((T, Hk, 16)).astype(np.float32)
    cos, sin = tables(spec, 32, np.float32)
    k, v, rows, slots = with_padding(rng, k, v, rng.integers(0, 32, T), paged_slots(rng, T, P), 2)
    for i, kv_dtype in enumerate(KV_DTYPES):
        stores = make_stores(P, Hk, 16, np.float32, kv_dtype, rng)
        want = reference(k, v, cos, sin, rows, slots, stores, spec=spec, kv_dtype=kv_dtype)
        got = tuple(None if a is None else fake_cupy.wrap(a.copy()) for a in stores)
        cb.append_kv(fake_cupy.wrap(k), fake_cupy.wrap(v), fake_cupy.wrap(cos), fake_cupy.wrap(sin),
                     fake_cupy.wrap(rows), fake_cupy.wrap(slots), got, rotary_dim=8, layout="half", offset=4,
                     kv_dtype=kv_dtype)
        assert fake_cupy.launched[i] == cb.kv_append_kernel_name("float32", kv_dtype)
        assert_same_bits([None if a is None else np.asarray(a) for a in got], want)


# -- paged_attention against a float64 oracle ----------------------------------------------------------------
#: max |o - oracle| / max |oracle|: the work dtype's products, sums, exp and tanh (and fp16's rounding of o)
ATTENTION_TOL = {"float32": 2e-6, "float64": 1e-12, "float16": 2e-3}


class Pool:
    """A paged KV pool the append kernel filled (``kernels`` None: the reference append), with its host tables.
    Sequences ``seq_lens`` (ragged, one empty), pages of ``page_size`` slots in a scattered order; sequence
    ``shared[1]`` reads its first ``shared[2]`` pages from sequence ``shared[0]``'s table (a fork: those keys are
    the other sequence's). Unused slots and the table entries past each sequence's pages hold NaN keys and values
    (NaN scales for quantized formats). ``initial``, ``tables`` and ``batches`` (k, v, rows, slots of each append)
    replay the appends elsewhere (tests/test_cupy.py: on a GPU)."""

    def __init__(self, kernels, *, dtype, kv_dtype, seq_lens, page_size=4, kv_heads=2, head_dim=32, shared=None,
                 seed=0, check_bits=False, geometry=None):
        rng = np.random.default_rng(seed)
        self.dtype, self.kv_dtype, self.page_size = dtype, kv_dtype, page_size
        self.seq_lens = np.asarray(seq_lens, np.int64)
        n = len(seq_lens)
        pages = [-(-int(L) // page_size) for L in self.seq_lens]
        width = max(pages) + 1
        num_pages = sum(pages) + 1
        nan_page = num_pages - 1
        self.block_table = np.full((n, width), nan_page, np.int64)
        order = iter(rng.permutation(nan_page))
        for i, count in enumerate(pages):
            for j in range(count):
                self.block_table[i, j] = next(order)
        first_own = np.zeros(n, np.int64)
        if shared is not None:
            src, dst, count = shared
            self.block_table[dst, :count] = self.block_table[src, :count]
            first_own[dst] = count * page_size
        shape = (num_pages * page_size, kv_heads, head_dim)
        work = work_of(dtype)
        if kv_dtype is None:
            self.stores = (np.full(shape, np.nan, dtype), np.full(shape, np.nan, dtype), None, None)
        else:
            entry = np.dtype(KV_FORMATS[kv_dtype].entry)
            self.stores = (np.zeros(shape, entry), np.zeros(shape, entry), np.full(shape[:2], np.nan, work),
                           np.full(shape[:2], np.nan, work))
        self.spec = RopeSpec(head_dim, rotary_dim=head_dim - 8, layout="interleaved", base=500.0)
        self.tables = cos, sin = tables(self.spec, int(self.seq_lens.max(initial=1)), work)
        append = append_reference if kernels is None else kv_shim_backend(
            kernels, append=dict(zip(("threads", "group", "max_tokens_per_block"), GEOMETRIES[geometry or "default"]))
        ).append_kv
        self.initial = copy_stores(self.stores)
        self.batches = []
        # a packed prefill of every sequence's keys but its last two, then two decode steps (padding among them)
        for step, (lo, hi) in enumerate(((None, -2), (-2, -1), (-1, None))):
            ks, vs, rows, slots = [], [], [], []
            for i, L in enumerate(self.seq_lens):
                positions = np.arange(L)[lo:hi] if L else np.arange(0)
                positions = positions[positions >= first_own[i]]
                rows.append(positions)
                slots.append(self.block_table[i, positions // page_size] * page_size + positions % page_size)
                ks.append(rng.standard_normal((len(positions), kv_heads, head_dim)))
                vs.append(rng.standard_normal((len(positions), kv_heads, head_dim)))
            k, v = np.concatenate(ks).astype(dtype), np.concatenate(vs).astype(dtype)
            k, v, rows, slots = with_padding(rng, k, v, np.concatenate(rows), np.concatenate(slots), 2)
            self.batches.append((k, v, rows, slots))
            append(k, v, cos, sin, rows, slots, self.stores, rotary_dim=self.spec.rotary_dim,
                   layout=self.spec.layout, offset=self.spec.rotary_offset, kv_dtype=kv_dtype)
        if check_bits:   # the kernel's pool is the reference's, bit for bit
            want = copy_stores(self.initial)
            for k, v, rows, slots in self.batches:
                append_reference(k, v, cos, sin, rows, slots, want, rotary_dim=self.spec.rotary_dim,
                                 layout=self.spec.layout, offset=self.spec.rotary_offset, kv_dtype=kv_dtype)
            assert_same_bits(self.stores, want)

    def q_starts(self, counts):
        return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


def dequantized(stores, kv_dtype):
    """float64 keys and values of the whole pool (ml_dtypes decodes float8 bits)."""
    k, v, ks, vs = stores
    if kv_dtype is None:
        return k.astype(np.float64), v.astype(np.float64)
    if kv_dtype == "float8_e4m3":
        k, v = k.view(ml_dtypes.float8_e4m3fn), v.view(ml_dtypes.float8_e4m3fn)
    return (k.astype(np.float64) * ks.astype(np.float64)[..., None],
            v.astype(np.float64) * vs.astype(np.float64)[..., None])


def oracle(q, stores, block_table, page_size, seq_lens, q_starts, *, kv_dtype, scale, softcap=None, window=None,
           causal=True):
    """float64 paged attention: each sequence's keys gathered through its block table row, dequantized, then an
    explicit masked softmax per query and q head; a row that sees no key (or belongs to no sequence) is 0."""
    K, V = dequantized(stores, kv_dtype)
    T, Hq, D = q.shape
    group = Hq // K.shape[1]
    o = np.zeros((T, Hq, D))
    qf = q.astype(np.float64)
    for i, L in enumerate(seq_lens):
        a, b = int(q_starts[i]), int(q_starts[i + 1])
        p = np.arange(L)
        slot = block_table[i, p // page_size] * page_size + p % page_size
        Ki, Vi = K[slot], V[slot]   # (L, Hk, D)
        for j in range(b - a):
            pos = L - (b - a) + j
            seen = (p <= pos) & (pos - p < (window or L + 1)) if causal else np.ones(L, bool)
            if not seen.any():
                continue
            for h in range(Hq):
                s = scale * (Ki[seen, h // group] @ qf[a + j, h])
                if softcap:
                    s = softcap * np.tanh(s / softcap)
                w = np.exp(s - s.max())
                o[a + j, h] = (w / w.sum()) @ Vi[seen, h // group]
    return o


def attend(module, pool, q, rows, counts, **kw):
    """The kernel (through the shim backend's paged_attention) and the oracle on sequences ``rows`` of the pool
    with ``counts`` queries each; returns (o, oracle)."""
    table, lens, starts = pool.block_table[rows], pool.seq_lens[rows], pool.q_starts(counts)
    kw = dict(dict(scale=1 / np.sqrt(q.shape[-1]), softcap=None, window=None, causal=True), **kw)
    o = module.paged_attention(q, pool.stores, table, pool.page_size, lens, starts, kv_dtype=pool.kv_dtype, **kw)
    return o, oracle(q, pool.stores, table, pool.page_size, lens, starts, kv_dtype=pool.kv_dtype, **kw)


def assert_close(o, want, dtype):
    assert o.dtype == np.dtype(dtype) and o.shape == want.shape
    tol = ATTENTION_TOL[np.dtype(dtype).name]
    err = np.abs(o.astype(np.float64) - want).max() / np.abs(want).max()
    assert err <= tol, f"relative error {err:.3g} > {tol:.1g}"


#: sequence lengths of the pools: ragged, one empty, one of a single key; sequence 2 forks sequence 3's first
#: two pages (keys 0..7)
SEQ_LENS = [11, 0, 13, 32, 5, 1]
SHARED = (3, 2, 2)
ALL = list(range(len(SEQ_LENS)))
NONEMPTY = [i for i in ALL if SEQ_LENS[i]]
ATTENTION_CASES = {   # name: (sequences, queries per sequence, keyword arguments)
    # one launch mixing a prefill chunk, a whole-sequence prefill, decode steps and an empty sequence
    "mixed": (ALL, [3, 0, 1, 32, 1, 1], {}),
    "decode": (NONEMPTY, [1] * len(NONEMPTY), {}),                      # dense: q_starts = arange(n + 1)
    "window": ([0, 2, 3, 4], [3, 3, 3, 3], dict(window=4)),             # dense chunks of 3
    "softcap": (ALL, [2, 0, 13, 5, 5, 1], dict(softcap=2.5, scale=0.4, window=7)),
    "noncausal": (ALL, [3, 0, 2, 32, 1, 1], dict(causal=False)),
}
_pools: dict = {}


def pool_for(kernels, dtype, kv_dtype) -> Pool:
    """The pool of (dtype, kv_dtype), filled once per module (its appends checked bit for bit as it fills)."""
    key = (dtype, kv_dtype)
    if key not in _pools:
        _pools[key] = Pool(kernels, dtype=dtype, kv_dtype=kv_dtype, seq_lens=SEQ_LENS, shared=SHARED,
                           seed=len(_pools), check_bits=True, geometry=list(GEOMETRIES)[len(_pools) % 4])
    return _pools[key]


def kernels_of(dtype, kv_dtype, splits):
    """The kernels of one paged_attention call (with the combine when it splits)."""
    attention = cb.paged_attention_kernel_name(dtype, kv_dtype)
    return (attention,) if splits == 1 else (attention, cb.paged_attention_combine_kernel_name(dtype))


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
@pytest.mark.parametrize("dtype,kv_dtype", FORMATS, ids=FORMAT_IDS)
def test_paged_attention_matches_the_oracle(kernels, dtype, kv_dtype, case, rng):
    """GQA 4:2 over pools of every format: packed mixed prefill + decode, dense decode, window, softcap,
    non-causal (ragged lengths, an empty sequence, shared pages, NaN in every slot no query may read), each split
    into 1, 2 or 7 key ranges (over the formats every case meets every split count; with 7, most rows have empty
    splits, and the rows that see no key have only empty ones)."""
    pool = pool_for(kernels, dtype, kv_dtype)
    splits = (1, 2, 7)[(FORMATS.index((dtype, kv_dtype)) + list(ATTENTION_CASES).index(case)) % 3]
    module = kv_shim_backend(kernels, attention=dict(threads=8, tile=4, splits=splits))
    rows, counts, kw = ATTENTION_CASES[case]
    q = rng.standard_normal((sum(counts), 4, 32)).astype(dtype)
    o, want = attend(module, pool, q, rows, counts, **kw)
    assert_close(o, want, dtype)
    assert module.calls == [kernels_of(dtype, kv_dtype, splits)]


#: (dtype, kv_dtype, head_dim) of the GQA / split grid: vec staging (16-byte rows), and entry by entry (fp16 rows of
#: 40 bytes, int8 rows of 20)
GQA_POOLS = [("float32", None, 32), ("float16", None, 20), ("float32", "int8", 20), ("float16", "float8_e4m3", 32)]


@pytest.mark.parametrize("dtype,kv_dtype,head_dim", GQA_POOLS, ids=[f"{d}-{k}-d{h}" for d, k, h in GQA_POOLS])
def test_paged_attention_gqa_groups_and_splits(kernels, dtype, kv_dtype, head_dim, rng):
    """One block per (q row, kv head): GQA 1, 4, 8 and 9 (two head chunks of a group past 8 heads) with 2 kv heads,
    each with 1, 2 and 7 splits over ragged lengths (empty splits, an empty sequence, a one-key sequence) in a mixed
    prefill + decode launch; the staging path (16-byte copies or entry by entry) the rows' alignment allows."""
    pool = Pool(kernels, dtype=dtype, kv_dtype=kv_dtype, seq_lens=[23, 0, 9, 1, 40], page_size=4, head_dim=head_dim,
                seed=21)
    rows, counts = [0, 1, 2, 3, 4], [3, 0, 1, 1, 5]
    for group, splits in ((1, 7), (4, 2), (8, 1), (9, 7), (4, 7), (8, 2)):
        module = kv_shim_backend(kernels, attention=dict(threads=16, tile=4, splits=splits))
        q = rng.standard_normal((sum(counts), 2 * group, head_dim)).astype(dtype)
        assert_close(*attend(module, pool, q, rows, counts, window=13 if group == 4 else None), dtype)
        assert module.calls == [kernels_of(dtype, kv_dtype, splits)]
    q = rng.standard_normal((sum(counts), 18, head_dim)).astype(dtype)
    o = np.empty_like(q)
    table, lens, starts = pool.block_table[rows], pool.seq_lens[rows], pool.q_starts(counts)
    plan = cb.plan_paged_attention(q, o, pool.stores, table, 4, lens, starts, dtype_name=dtype, scale=0.1,
                                   softcap=None, window=None, causal=True, kv_dtype=kv_dtype, threads=16, tile=4)
    entry = np.dtype(pool.stores[0].dtype).itemsize
    assert plan.launches[0].args[-10] == (head_dim * entry % 16 == 0)   # vec (then 6 rotation, 3 norm arguments)
    assert plan.geometry.heads_per_block == 8 and plan.geometry.head_chunks == 2   # group 9: 8 + 1


def test_paged_attention_never_reads_pages_before_the_window(kernels, rng):
    """Pages wholly before every query's window are -1 in the table (an engine gave them back): the pool sits in a
    buffer whose page before it is NaN (entries and scales), so a read through a -1 entry would show; windows
    across page boundaries, with 1, 2 and 7 splits and a decode row and a prefill chunk."""
    page, lens, window = 4, np.array([37, 30], np.int64), 9
    for dtype, kv_dtype in (("float32", None), ("float16", "int8")):
        pool = Pool(kernels, dtype=dtype, kv_dtype=kv_dtype, seq_lens=lens, page_size=page, seed=3)
        counts = [1, 5]
        table = pool.block_table[:2].copy()
        for i, (L, c) in enumerate(zip(lens, counts)):
            table[i, :(L - c - window + 1) // page] = -1   # before the first query's window
        assert (table == -1).sum() >= 9
        guarded = []
        for a in pool.stores:   # the same values, after a NaN page: slot -page .. -1 is NaN
            if a is None:
                guarded.append(None)
                continue
            big = np.full((a.shape[0] + page,) + a.shape[1:], np.nan if a.dtype.kind == "f" else 0x7f, a.dtype)
            big[page:] = a
            guarded.append(big[page:])
        for splits in (1, 2, 7):
            module = kv_shim_backend(kernels, attention=dict(threads=8, tile=3, splits=splits))
            q = rng.standard_normal((sum(counts), 4, 32)).astype(dtype)
            kw = dict(scale=0.3, softcap=None, window=window, causal=True, kv_dtype=kv_dtype)
            o = module.paged_attention(q, tuple(guarded), table, page, lens, pool.q_starts(counts), **kw)
            want = oracle(q, pool.stores, pool.block_table[:2], page, lens, pool.q_starts(counts), **kw)
            assert np.isfinite(o).all()
            assert_close(o, want, dtype)


@pytest.mark.parametrize("attention", [dict(threads=128), dict(threads=5, tile=3), dict(threads=48, tile=48)],
                         ids=["default", "tiny", "odd"])
def test_paged_attention_geometries_and_strided_q(kernels, attention, rng):
    """Block sizes (the default, 5 threads with 3-key tiles, 48), GQA 8:2, q a strided view; window and softcap."""
    pool = pool_for(kernels, "float32", "int8")
    module = kv_shim_backend(kernels, attention=attention)
    rows, counts = ALL, [2, 0, 1, 3, 1, 1]
    q = rng.standard_normal((sum(counts), 16, 64)).astype(np.float32)[:, ::2, ::2]
    for kw in ({}, dict(window=5, softcap=4.0)):
        assert_close(*attend(module, pool, q, rows, counts, **kw), "float32")


def test_paged_attention_long_sequences(kernels, rng):
    """Sequences of several tiles and pages (70 and 45 keys, pages of 8, 16-key tiles), float8 entries; a chunk
    and a decode step in one launch, with a window across page boundaries and softcap; unsplit and in 3 splits of
    whole tiles (the split rule's own choice is 1 here: 10 pages of 8 keys are under 256 keys)."""
    pool = Pool(kernels, dtype="float32", kv_dtype="float8_e4m3", seq_lens=[70, 45], page_size=8, kv_heads=1,
                seed=11)
    q = rng.standard_normal((7, 3, 32)).astype(np.float32)
    for splits in (None, 3):
        module = kv_shim_backend(kernels, attention=dict(threads=32, tile=16, splits=splits))
        assert_close(*attend(module, pool, q, [0, 1], [6, 1]), "float32")
        assert_close(*attend(module, pool, q, [0, 1], [6, 1], window=20, softcap=5.0), "float32")
        assert len(module.calls[-1]) == (1 if splits is None else 2)


def test_paged_attention_rows_without_keys_are_zero(kernels, rng):
    """q rows past q_starts[n] (and all rows with no sequence) give 0, and so do rows seeing no key (unsplit, and
    through the combine with every split empty); nothing is launched without q rows."""
    pool = pool_for(kernels, "float32", None)
    for splits in (1, 3):
        module = kv_shim_backend(kernels, attention=dict(threads=8, splits=splits))
        q = rng.standard_normal((6, 4, 32)).astype(np.float32)
        table, lens = pool.block_table[[0, 4]], pool.seq_lens[[0, 4]]
        kw = dict(scale=0.2, softcap=None, window=None, causal=True, kv_dtype=None)
        o = module.paged_attention(q, pool.stores, table, 4, lens, np.array([0, 2, 4]), **kw)
        want = oracle(q[:4], pool.stores, table, 4, lens, np.array([0, 2, 4]), kv_dtype=None, scale=0.2)
        assert_close(o[:4], want, "float32")
        assert np.all(o[4:] == 0)
        o = module.paged_attention(q, pool.stores, table[:0], 4, lens[:0], np.array([0]), **kw)
        assert np.all(o == 0)
        o = module.paged_attention(q[:2], pool.stores, table, 4, lens * 0, np.array([0, 1, 2]), **kw)   # c > length
        assert np.all(o == 0)
        assert module.paged_attention(q[:0], pool.stores, table, 4, lens, np.array([0, 0, 0]), **kw).shape == \
            (0, 4, 32)
        assert module.calls[-1] is None


def test_paged_attention_split_rule_and_geometry():
    """The split rule (blocks >= 2 x 132 SMs, each split >= 256 keys of the table's reach or the window) and the
    geometry: threads raised to the P.V chunks and the block's q heads, tiles whose shared memory fits, the
    layout of the .cu file."""
    geo = lambda *a, **kw: cb.paged_attention_geometry(*a, **{**dict(entry_itemsize=2, work_itemsize=4), **kw})  # noqa
    assert geo(32, 32, 8, 128, keys=2048).splits == 2           # 256 blocks: 2 splits of 1024 keys
    assert geo(1, 32, 8, 128, keys=32768).splits == 33          # 8 blocks: ceil(264 / 8)
    assert geo(1, 32, 8, 128, keys=32768).grid == 264
    assert geo(1, 32, 8, 128, keys=1000).splits == 3            # 1000 // 256
    assert geo(1, 32, 8, 128, keys=255).splits == 1
    assert geo(33, 32, 8, 128, keys=32768).splits == 1          # 264 blocks already
    assert geo(512, 32, 8, 128, keys=4096).splits == 1          # a prefill chunk
    assert geo(1, 32, 8, 128, keys=32768, splits=5).splits == 5
    assert cb.paged_attention_splits(4, 10**6) == cb.KV_SPLIT_BLOCKS // 4
    g = geo(1, 128, 8, 128, keys=64)                            # GQA 16: two blocks of 8 q heads per kv head
    assert (g.heads_per_block, g.head_chunks, g.grid) == (8, 2, 16)
    assert geo(1, 2, 2, 1000, keys=8).threads == 250            # ceil(1000 / 4) P.V chunks
    assert geo(1, 16, 2, 8, keys=8, threads=2).threads == 8     # 8 q heads
    for d, entry, work in ((128, 2, 4), (128, 4, 4), (128, 1, 4), (128, 8, 8), (256, 2, 4), (64, 1, 8)):
        g = geo(4, 32, 8, d, keys=4096, entry_itemsize=entry, work_itemsize=work)
        assert g.shared_mem <= cb.SHARED_MEM_LIMIT and g.tile >= 8 and g.tile & (g.tile - 1) == 0
        layout = cb.paged_attention_layout(d, g.threads, g.tile, g.heads_per_block, entry, work)
        assert layout["total"] == g.shared_mem and layout["row_stride"] % 32 == 16
        assert layout["row_stride"] >= d * entry and layout["qs"] >= 2 * g.tile * layout["row_stride"]
    assert geo(4, 32, 8, 128, keys=4096).tile == 64 and geo(4, 32, 8, 128, keys=4096, entry_itemsize=1).tile == 64
    with pytest.raises(ValueError, match="threads"):
        geo(1, 2, 2, 2048, keys=8)
    with pytest.raises(ValueError, match="shared memory"):
        geo(1, 2, 2, 512, keys=8, entry_itemsize=8, work_itemsize=8, tile=64)


def test_paged_attention_plan_and_shim_checks(kernels, rng):
    """The plan's checks, and the kernels under exact-extent copies, two shared-memory poisons and three block
    slots (a read of shared memory no thread wrote, or past a buffer, would show): unsplit and split (the combine
    and its workspace), 16-byte staging and entry by entry."""
    checked = host.HostKernels(kernels.path, kernels.entries, slots=3, guard=True, compare=True)
    for kv_dtype, head_dim in [(kv, d) for kv in KV_DTYPES for d in (20, 16)]:   # (the checks below: the last)
        stores = make_stores(24, 2, head_dim, np.float16, kv_dtype, rng)
        if kv_dtype is not None:
            stores = stores[:2] + tuple(np.abs(a) + 0.01 for a in stores[2:])
        else:
            stores = tuple(np.clip(a, -4, 4) if a is not None else None for a in stores)
        table = np.array([[5, 2, 0], [1, 3, 4]], np.int64)
        lens = np.array([11, 7], np.int64)
        starts = np.array([0, 3, 4], np.int64)
        q = rng.standard_normal((4, 4, head_dim)).astype(np.float16)
        outs = []
        for threads, tile, splits in ((7, 3, 1), (32, 32, 1), (8, 2, 3)):
            o = np.full(q.shape, np.nan, q.dtype)
            plan = cb.plan_paged_attention(q, o, stores, table, 4, lens, starts, dtype_name="float16", scale=0.25,
                                           softcap=None, window=5, causal=True, kv_dtype=kv_dtype, threads=threads,
                                           tile=tile, splits=splits)
            assert plan.launches[0].args[-10] == (head_dim == 16)   # 16-byte staging: rows of 32 or 16 bytes
            for launch in plan.launches:
                checked.launch(launch)
            assert np.all(np.isfinite(o))
            outs.append(o.astype(np.float64))
        np.testing.assert_allclose(outs[0], outs[1], rtol=2e-3, atol=2e-3)
        np.testing.assert_allclose(outs[2], outs[1], rtol=2e-3, atol=2e-3)
        want = oracle(q, stores, table, 4, lens, starts, kv_dtype=kv_dtype, scale=0.25, window=5)
        assert_close(outs[1].astype(np.float16), want, "float16")
    assert checked.launches == 6 * 4
    o = np.empty_like(q)
    kw = dict(dtype_name="float16", scale=1.0, softcap=None, window=None, causal=True)
    args = (stores, table, 4, lens, starts)
    with pytest.raises(ValueError, match="multiple"):
        cb.plan_paged_attention(q[:, :3], np.empty((4, 3, 16), q.dtype), *args, kv_dtype="float8_e4m3", **kw)
    with pytest.raises(ValueError, match="int64"):
        cb.plan_paged_attention(q, o, stores, table.astype(np.int32), 4, lens, starts, kv_dtype="float8_e4m3", **kw)
    with pytest.raises(ValueError, match="q_starts"):
        cb.plan_paged_attention(q, o, stores, table, 4, lens, starts[:2], kv_dtype="float8_e4m3", **kw)
    with pytest.raises(ValueError, match="float8_e4m3 k entries must be uint8"):   # the format is never inferred
        cb.plan_paged_attention(q, o, make_stores(24, 2, 16, np.float16, "int8", rng), table, 4, lens, starts,
                                kv_dtype="float8_e4m3", **kw)
    with pytest.raises(ValueError, match="entries are uint8"):
        cb.plan_paged_attention(q, o, *args, kv_dtype=None, **kw)
    with pytest.raises(ValueError, match="float32 work"):
        q64 = q.astype(np.float64)
        cb.plan_paged_attention(q64, np.empty_like(q64), *args, kv_dtype="float8_e4m3",
                                **{**kw, "dtype_name": "float64"})
    with pytest.raises(ValueError, match="o must be"):
        cb.plan_paged_attention(q, o.astype(np.float32), *args, kv_dtype="float8_e4m3", **kw)
    assert cb.plan_paged_attention(q[:0], o[:0], *args, kv_dtype="float8_e4m3", **kw) is None
    plan = cb.plan_paged_attention(q, o, *args, kv_dtype="float8_e4m3", splits=4, **kw)
    part_o, part_ml = plan.workspace
    assert part_o.shape == (4 * 4 * 4 * 16,) and part_ml.shape == (4 * 4 * 4 * 2,) and part_o.dtype == np.float32
    assert [launch.grid for launch in plan.launches] == [4 * 2 * 4, 4 * 4]


def test_cupy_glue_paged_attention(fake_cupy, kernels, rng, monkeypatch):
    """rotary.backends.cupy.paged_attention with the NumPy stand-ins for CuPy (host tables copied to the
    'device'): the launches (one; with the split rule forced to split, the attention and the combine over a
    workspace from cupy.empty) and the bits of the same plan launched on the NumPy arrays directly."""
    pool = pool_for(kernels, "float32", "int8")
    rows, counts = ALL, [2, 0, 1, 3, 1, 1]
    q = rng.standard_normal((sum(counts), 4, 32)).astype(np.float32)
    kw = dict(scale=0.3, softcap=None, window=None, causal=True, kv_dtype="int8")
    table, lens, starts = pool.block_table[rows], pool.seq_lens[rows], pool.q_starts(counts)
    stores = tuple(None if a is None else fake_cupy.wrap(a) for a in pool.stores)
    o = cb.paged_attention(fake_cupy.wrap(q), stores, table, pool.page_size, fake_cupy.wrap(lens), starts, **kw)
    assert fake_cupy.launched == [cb.paged_attention_kernel_name("float32", "int8")]
    assert isinstance(o, _cpu_tests.FakeCupyArray) and o.shape == q.shape and o.dtype == q.dtype
    direct = kv_shim_backend(kernels).paged_attention(q, pool.stores, table, pool.page_size, lens, starts, **kw)
    np.testing.assert_array_equal(np.asarray(o), direct)
    monkeypatch.setattr(cb, "KV_SPLIT_MIN_KEYS", 8)   # 36 keys of table reach: 4 splits
    o = cb.paged_attention(fake_cupy.wrap(q), stores, table, pool.page_size, fake_cupy.wrap(lens), starts, **kw)
    assert fake_cupy.launched[1:] == list(kernels_of("float32", "int8", 4))
    direct = kv_shim_backend(kernels, attention=dict(splits=4)).paged_attention(q, pool.stores, table,
                                                                                pool.page_size, lens, starts, **kw)
    np.testing.assert_array_equal(np.asarray(o), direct)


def test_shim_backend_through_the_registry(kernels, monkeypatch):
    """tests/cuda_shim/kv_backend.py's register(): the module answers as backend "cuda-shim" with its VARIANTS
    (with a monkeypatch: until the test ends; without: until unregister())."""
    from rotary import backends as registry

    module = register(monkeypatch)
    assert registry.get("cuda-shim") is module and module.NAME == "cuda-shim"
    for kind in KV_DTYPES:
        assert registry.supports(module, "paged_attention", kind, any_variant=False)
    assert not registry.supports(module, "append_kv", "int4", any_variant=False)
    other = register(module=kv_shim_backend(kernels))
    assert registry.get("cuda-shim") is other
    other.unregister()
    assert registry.get("cuda-shim") is module


# -- the per-head RMSNorm before RoPE (Qwen3 / Gemma 3's q_norm and k_norm) against float64 oracles ----------------
#: head_dim -> (rotary_dim, rotary_offset): partial rotary with an offset, partial, full
NORM_SHAPES = {20: (12, 4), 72: (48, 8), 128: (128, 0)}
#: eps small (the mean square rules) and large (eps rules the small heads: the norm is not scale-free)
NORM_EPS = (1e-6, 4.0)
#: float entries: max |entry - oracle| / max |oracle| of each head (the dtype's rounding of the normed, rotated work
#: values, and the work dtype's own operations)
NORM_TOL = {"float32": 2e-6, "float64": 1e-13, "float16": 1e-3, "bfloat16": 8e-3}
NORM_FORMATS = [(d, kv) for d in ("float32", "float16", "bfloat16", "float64") for kv in (None, "int8")]


def rms_norm64(x, weight, eps):
    """float64 per-head RMSNorm over the last axis: (x / sqrt(mean(x^2) + eps)) * weight."""
    x = np.asarray(x, np.float64)
    inv = 1.0 / np.sqrt((x * x).sum(-1, keepdims=True) / x.shape[-1] + eps)
    return (x * inv) * np.asarray(weight, np.float64)


def rotate64(x, positions, spec):
    """x (T, H, D) rotated at positions (T,) by the spec's float64 angles (rotary.testing.rope_complex: its pairs
    and offset)."""
    from rotary.testing import rope_complex

    return rope_complex(x, np.asarray(positions, np.float64)[:, None], spec.inv_freq(), layout=spec.layout,
                        rotary_offset=spec.rotary_offset)


def norm_weight(rng, head_dim, work):
    """A non-trivial weight: random, mostly around 1, a few negative and near-zero coordinates."""
    w = rng.normal(1.0, 0.6, head_dim)
    w[rng.integers(0, head_dim, 2)] *= 1e-3
    return np.ascontiguousarray(w, work)


def as_kernel_array(a, dtype):
    """(host array, kernel dtype name): bfloat16 as its uint16 bits (the shim's convention)."""
    if dtype == "bfloat16":
        return a.view(np.uint16), "bfloat16"
    return a, dtype


def host_dtype(dtype):
    return ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)


def check_normed_keys(got, initial, k, rows, slots, spec, weight, eps, *, dtype, kv_dtype):
    """The k entries (and scales) the append wrote at each appended slot against the float64 oracle (norm, then
    rotation by float64 angles); every other k entry and scale unchanged."""
    keep = np.asarray(slots) >= 0
    want = rotate64(rms_norm64(k[keep], weight, eps), np.asarray(rows)[keep], spec)   # (n, Hk, D)
    at = np.asarray(slots)[keep]
    untouched = np.setdiff1d(np.arange(got[0].shape[0]), at)
    np.testing.assert_array_equal(bits(got[0][untouched]), bits(initial[0][untouched]))
    peak = np.abs(want).max(-1)                                                       # (n, Hk)
    if kv_dtype is None:
        err = np.abs(got[0][at].astype(np.float64) - want).max(-1)
        assert np.all(err <= NORM_TOL[dtype] * peak), f"relative error {(err / peak).max():.3g}"
        return
    np.testing.assert_array_equal(got[2][untouched], initial[2][untouched])
    scale = got[2][at].astype(np.float64)
    work_tol = 1e-13 if dtype == "float64" else 2e-6
    np.testing.assert_allclose(scale, peak / 127, rtol=work_tol)
    err = np.abs(got[0][at].astype(np.float64) * scale[..., None] - want).max(-1)
    assert np.all(err <= 0.5 * scale * (1 + work_tol) + work_tol * peak), f"{(err / scale).max():.4g} steps"
    assert np.abs(got[0][at]).max() == 127


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("dtype,kv_dtype", NORM_FORMATS, ids=[f"{d}-{kv}" for d, kv in NORM_FORMATS])
def test_append_with_norm_matches_the_float64_oracle(kernels, dtype, kv_dtype, layout, rng):
    """kv_append<..., true>: each key head RMS-normed (random weight; eps small and large over heads whose scales
    span 1e-2 .. 1e2) before its rotation, then cast or quantized once: head_dim 20 (partial rotary from offset 4),
    72 (partial, offset 8) and 128 (full), each under another block geometry (odd thread groups: trees over 3 and 7
    partials), padding tokens among the others (NaN k and v: never read), k a strided view once; against the
    float64 oracle. The v entries and scales are the append's without the norm, bit for bit (v is never normed)."""
    work = work_of(np.float64 if dtype == "float64" else np.float32)
    for i, head_dim in enumerate(NORM_SHAPES):
        rotary_dim, offset = NORM_SHAPES[head_dim]
        spec = RopeSpec(head_dim, rotary_dim=rotary_dim, layout=layout, rotary_offset=offset)
        geometry = list(GEOMETRIES)[(i + (layout == "half") + NORM_FORMATS.index((dtype, kv_dtype))) % 4]
        T, Hk, P = 7, 3, 20
        scale = 10.0 ** rng.uniform(-2, 2, (T, Hk, 1))
        k = (rng.standard_normal((T, Hk, 2 * head_dim)) * scale).astype(host_dtype(dtype))
        k = k[..., ::2] if i == 1 else np.ascontiguousarray(k[..., :head_dim])
        v = (rng.standard_normal((T, Hk, head_dim)) * scale).astype(host_dtype(dtype))
        k, v, rows, slots = with_padding(rng, k, v, rng.integers(0, 64, T), paged_slots(rng, T, P), 1 + i % 2)
        cos, sin = tables(spec, 64, work)
        for eps in NORM_EPS:
            weight = norm_weight(rng, head_dim, work)
            stores = make_stores(P, Hk, head_dim, np.float32 if dtype == "bfloat16" else dtype, kv_dtype, rng)
            if kv_dtype is None and dtype == "bfloat16":
                stores = (stores[0].astype(ml_dtypes.bfloat16), stores[1].astype(ml_dtypes.bfloat16), None, None)
            got = copy_stores(stores)
            threads, group, tpb = GEOMETRIES[geometry]
            kk, name = as_kernel_array(k, dtype)
            plan = cb.plan_append_kv(kk, as_kernel_array(v, dtype)[0], cos, sin, rows, slots, got, dtype_name=name,
                                     rotary_dim=rotary_dim, layout=layout, offset=offset, kv_dtype=kv_dtype,
                                     norm=(weight, eps), threads=threads, group=group, max_tokens_per_block=tpb)
            assert plan.kernel == cb.kv_append_kernel_name(name, kv_dtype, norm=True)
            assert plan.shared_mem == plan.block * np.dtype(work).itemsize
            kernels.launch(plan)
            check_normed_keys(got, stores, k, rows, slots, spec, weight, eps, dtype=dtype, kv_dtype=kv_dtype)
            want_v = reference(k, v, cos, sin, rows, slots, stores, spec=spec, kv_dtype=kv_dtype)
            assert_same_bits(got[1::2], want_v[1::2])


def test_append_with_norm_is_scale_free_for_small_eps(kernels, rng):
    """With eps far below the heads' mean squares the normed keys do not depend on each head's scale: a head and the
    same head times 2^10 (exact in every dtype) give the same entries, bit for bit (the sum of squares scales by
    2^20 exactly, the factor by 2^-10), unless eps shows; with eps large they differ."""
    spec = RopeSpec(72, rotary_dim=48, rotary_offset=8)
    k = rng.standard_normal((5, 2, 72)).astype(np.float32)
    k2 = k * np.float32(1024)
    cos, sin = tables(spec, 16, np.float32)
    weight = norm_weight(rng, 72, np.float32)
    rows, slots = np.arange(5), np.arange(5)
    outs = {}
    for eps in (0.0, 4.0):
        for name, x in (("k", k), ("k2", k2)):
            got = make_stores(5, 2, 72, np.float32, None, rng)
            kernels.launch(cb.plan_append_kv(x, x, cos, sin, rows, slots, got, dtype_name="float32", rotary_dim=48,
                                             layout="half", offset=8, kv_dtype=None, norm=(weight, eps)))
            outs[name, eps] = got[0]
    np.testing.assert_array_equal(outs["k", 0.0], outs["k2", 0.0])
    assert np.abs(outs["k", 4.0] - outs["k2", 4.0]).max() > 0.1


#: the norm attention cases: (name, queries per sequence); sequences of NORM_SEQ_LENS keys, pages of 4
NORM_SEQ_LENS = [9, 1, 14, 6]
NORM_STEPS = {"decode": [1, 1, 1, 1], "mixed": [1, 0, 6, 2]}   # mixed: a 6-query chunk of one sequence
NORM_ATTENTION_FORMATS = [(d, kv) for d in ("float32", "float16", "float64") for kv in (None, "int8")]


class NormPool:
    """A paged pool the append kernel filled with normed keys (``weight``, ``eps``; layout, partial rotary and
    offset of NORM_SHAPES), with the block table and the spec."""

    def __init__(self, kernels, *, dtype, kv_dtype, head_dim, layout, weight, eps, kv_heads=2, page_size=4, seed=0):
        rng = np.random.default_rng(seed)
        rotary_dim, offset = NORM_SHAPES[head_dim]
        self.spec = RopeSpec(head_dim, rotary_dim=rotary_dim, layout=layout, rotary_offset=offset, base=500.0)
        self.dtype, self.kv_dtype, self.page_size = dtype, kv_dtype, page_size
        self.seq_lens = np.asarray(NORM_SEQ_LENS, np.int64)
        pages = [-(-int(L) // page_size) for L in self.seq_lens]
        self.block_table = np.full((len(pages), max(pages)), sum(pages), np.int64)   # unused: a NaN page
        order = iter(rng.permutation(sum(pages)))
        for i, n in enumerate(pages):
            self.block_table[i, :n] = [next(order) for _ in range(n)]
        shape = ((sum(pages) + 1) * page_size, kv_heads, head_dim)
        work = work_of(dtype)
        if kv_dtype is None:
            self.stores = (np.full(shape, np.nan, dtype), np.full(shape, np.nan, dtype), None, None)
        else:
            self.stores = (np.zeros(shape, np.int8), np.zeros(shape, np.int8), np.full(shape[:2], np.nan, work),
                           np.full(shape[:2], np.nan, work))
        positions = np.concatenate([np.arange(L) for L in self.seq_lens])
        slots = np.concatenate([self.block_table[i, p // page_size] * page_size + p % page_size
                                for i, p in enumerate(np.arange(L) for L in self.seq_lens)])
        k = (rng.standard_normal((len(slots), kv_heads, head_dim)) * 10.0 ** rng.uniform(-1, 1, (len(slots), kv_heads,
                                                                                                 1))).astype(dtype)
        v = rng.standard_normal((len(slots), kv_heads, head_dim)).astype(dtype)
        cos, sin = tables(self.spec, 16, work)
        initial = copy_stores(self.stores)
        kv_shim_backend(kernels).append_kv(k, v, cos, sin, positions, slots, self.stores, rotary_dim=rotary_dim,
                                           layout=layout, offset=offset, kv_dtype=kv_dtype, norm=(weight, eps))
        check_normed_keys(self.stores, initial, k, positions, slots, self.spec, weight, eps, dtype=dtype,
                          kv_dtype=kv_dtype)

    def rotation(self, counts):
        """The rotation tuple of q rows of ``counts`` queries per sequence (each at its position) and the positions."""
        positions = np.concatenate([np.arange(L - c, L) for L, c in zip(self.seq_lens, counts)]).astype(np.int64)
        cos, sin = tables(self.spec, 16, work_of(self.dtype))
        return (cos, sin, positions, self.spec.rotary_dim, self.spec.layout, self.spec.rotary_offset), positions


#: head_dim -> its two attention calls (step, q rotated as it is read, GQA group): each step rotated and not, each
#: with GQA 1 and 4 (the formats of odd index swap rotated and not: every combination over the formats)
NORM_ATTENTION_CASES = {20: [("decode", True, 4), ("mixed", False, 1)],
                        72: [("decode", False, 4), ("mixed", True, 1)],
                        128: [("decode", True, 1), ("mixed", False, 4)]}


@pytest.mark.parametrize("dtype,kv_dtype", NORM_ATTENTION_FORMATS,
                         ids=[f"{d}-{kv}" for d, kv in NORM_ATTENTION_FORMATS])
def test_paged_attention_with_norm_matches_the_float64_oracle(kernels, dtype, kv_dtype, rng):
    """paged_attention with the q norm over pools of normed keys: head_dim 20 / 72 / 128 (partial rotary from an
    offset, partial, full), both layouts, GQA 1 and 4 (2 kv heads), a decode step and a mixed step (a 6-query chunk
    of one sequence with a 2-query chunk and a decode row of others), q rotated as it is read and not (rotation
    None: normed only), eps small and large (q's and k's apart), q a strided view, unsplit and in 3 splits, the
    default block and 16 threads (raised to the head's P.V chunks: 18 for 72 fp32 coordinates, so GQA 4 has 4
    threads per head and 2 idle ones); against the float64 oracle (q normed, rotated by the float64 angles, then the
    masked softmax over the dequantized keys)."""
    work = work_of(dtype)
    index = NORM_ATTENTION_FORMATS.index((dtype, kv_dtype))
    for i, head_dim in enumerate(NORM_SHAPES):
        layout = ("half", "interleaved")[(i + index) % 2]
        k_weight = norm_weight(rng, head_dim, work)
        pool = NormPool(kernels, dtype=dtype, kv_dtype=kv_dtype, head_dim=head_dim, layout=layout, weight=k_weight,
                        eps=NORM_EPS[i % 2], seed=i)
        for j, (step, rotated, group) in enumerate(NORM_ATTENTION_CASES[head_dim]):
            rotated ^= bool(index % 2)
            counts = NORM_STEPS[step]
            q_weight, q_eps = norm_weight(rng, head_dim, work), NORM_EPS[(i + j + 1) % 2]
            big = rng.standard_normal((sum(counts), 2 * group, 2 * head_dim)) * 10.0 ** rng.uniform(-1, 1)
            q = big.astype(dtype)[..., ::2] if j else np.ascontiguousarray(big[..., :head_dim], dtype)
            rotation, positions = pool.rotation(counts)
            starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
            splits = 3 if j else 1
            module = kv_shim_backend(kernels, attention=dict(splits=splits) if head_dim == 128 else
                                     dict(threads=16, tile=8, splits=splits))
            kw = dict(scale=head_dim ** -0.5, softcap=None, window=None, causal=True, kv_dtype=kv_dtype)
            o = module.paged_attention(q, pool.stores, pool.block_table, pool.page_size, pool.seq_lens, starts,
                                       rotation=rotation if rotated else None, norm=(q_weight, q_eps), **kw)
            assert module.calls == [kernels_of(dtype, kv_dtype, splits)]
            qn = rms_norm64(q, q_weight, q_eps)
            if rotated:
                qn = rotate64(qn, positions, pool.spec)
            want = oracle(qn, pool.stores, pool.block_table, pool.page_size, pool.seq_lens, starts, **kw)
            assert_close(o, want, dtype)


def test_norm_none_launches_the_kernels_without_it(kernels, rng):
    """norm=None is the launch without the norm: the append kernel without NORM (the old name), no shared memory
    for cast entries, the reference's bits; paged_attention with has_norm 0 (weight and eps unread), the same bits
    as a call without the argument and the oracle's values."""
    spec = RopeSpec(20, rotary_dim=12, rotary_offset=4, layout="interleaved")
    T, Hk, P = 6, 2, 10
    k = rng.standard_normal((T, Hk, 20)).astype(np.float32)
    v = rng.standard_normal((T, Hk, 20)).astype(np.float32)
    k, v, rows, slots = with_padding(rng, k, v, rng.integers(0, 32, T), paged_slots(rng, T, P), 2)
    cos, sin = tables(spec, 32, np.float32)
    kw = dict(dtype_name="float32", rotary_dim=12, layout="interleaved", offset=4)
    for kv_dtype in KV_DTYPES:
        stores = make_stores(P, Hk, 20, np.float32, kv_dtype, rng)
        plain = cb.plan_append_kv(k, v, cos, sin, rows, slots, stores, kv_dtype=kv_dtype, **kw)
        plan = cb.plan_append_kv(k, v, cos, sin, rows, slots, stores, kv_dtype=kv_dtype, norm=None, **kw)
        assert plan.kernel == plain.kernel == f"kv_append<float, float, {KV_FORMATS[kv_dtype].code}>"
        assert (plan.grid, plan.block, plan.shared_mem) == (plain.grid, plain.block, plain.shared_mem)
        assert plan.shared_mem == (0 if kv_dtype is None else plan.block * 4)
        assert plan.args[-2] is cos and plan.args[-1] == 0   # the weight's place: unread
        check_append(kernels, k, v, spec, rows, slots, stores, kv_dtype=kv_dtype, n_rows=32)
    pool = pool_for(kernels, "float32", "int8")
    rows, counts = ALL, [2, 0, 1, 3, 1, 1]
    q = rng.standard_normal((sum(counts), 4, 32)).astype(np.float32)
    module = kv_shim_backend(kernels, attention=dict(threads=8, tile=4))
    table, lens, starts = pool.block_table[rows], pool.seq_lens[rows], pool.q_starts(counts)
    o_plain, want = attend(module, pool, q, rows, counts)
    o_none = module.paged_attention(q, pool.stores, table, 4, lens, starts, scale=1 / np.sqrt(32), softcap=None,
                                    window=None, causal=True, kv_dtype="int8", norm=None)
    np.testing.assert_array_equal(o_none, o_plain)
    assert_close(o_none, want, "float32")
    plan = cb.plan_paged_attention(q, np.empty_like(q), pool.stores, table, 4, lens, starts, dtype_name="float32",
                                   scale=0.1, softcap=None, window=None, causal=True, kv_dtype="int8", norm=None)
    assert plan.launches[0].args[-3] is lens and plan.launches[0].args[-2:] == (0, 0)


def test_norm_plan_checks(rng):
    """Both plans refuse a norm weight of another shape, dtype or layout, an eps that is not a float >= 0 and a norm
    that is not (weight, eps), with the module's messages; a float64 weight for float64 data, eps 0 and a NumPy
    float eps are taken."""
    spec = RopeSpec(16)
    k = np.zeros((3, 2, 16), np.float32)
    cos, sin = tables(spec, 8, np.float32)
    rows = slots = np.arange(3, dtype=np.int64)
    stores = make_stores(4, 2, 16, np.float32, "int8", rng)
    w = np.ones(16, np.float32)

    def append(norm, data=k, work_tables=(cos, sin), dtype_name="float32", st=stores):
        return cb.plan_append_kv(data, data, *work_tables, rows, slots, st, dtype_name=dtype_name, rotary_dim=16,
                                 layout="half", offset=0, kv_dtype=None if st is not stores else "int8", norm=norm)

    q = np.zeros((3, 4, 16), np.float32)
    table, lens, starts = np.zeros((1, 1), np.int64), np.array([3], np.int64), np.array([0, 3], np.int64)

    def attention(norm):
        return cb.plan_paged_attention(q, np.empty_like(q), stores, table, 4, lens, starts, dtype_name="float32",
                                       scale=1.0, softcap=None, window=None, causal=True, kv_dtype="int8", norm=norm)

    bad = [((w[:15], 1e-6), r"norm weight must be a C-contiguous float32 \(16,\), got float32 \(15,\)"),
           ((w.astype(np.float64), 1e-6), "norm weight must be a C-contiguous float32 .* got float64"),
           ((np.ones(32, np.float32)[::2], 1e-6), "norm weight must be a C-contiguous"),
           ((w.reshape(1, 16), 1e-6), "norm weight"),
           ((w, -1e-6), "norm eps must be a float >= 0"),
           ((w, float("nan")), "norm eps"),
           ((w, 1), "norm eps must be a float"),
           ((w, None), "norm eps"),
           ((w,), r"norm must be None or \(weight, eps\)"),
           ([w, 1e-6], "norm must be"),
           (w, "norm must be")]
    for norm, match in bad:
        with pytest.raises(ValueError, match="append_kv: " + match):
            append(norm)
        with pytest.raises(ValueError, match="paged_attention: " + match):
            attention(norm)
    for eps in (0.0, np.float64(1e-5), np.float32(1e-5)):
        assert append((w, eps)).args[-1] == np.float32(eps)
        assert attention((w, eps)).launches[0].args[-3:] == (w, np.float32(eps), 1)
    assert append((w, 1e-6)).kernel == "kv_append<float, float, 1, true>"
    k64, w64 = k.astype(np.float64), w.astype(np.float64)
    plan = append((w64, 0.5), data=k64, work_tables=tables(spec, 8, np.float64), dtype_name="float64",
                  st=make_stores(4, 2, 16, np.float64, None, rng))
    assert plan.kernel == "kv_append<double, double, 0, true>" and plan.args[-2] is w64 and plan.shared_mem > 0
    with pytest.raises(ValueError, match="norm weight must be a C-contiguous float64"):
        append((w, 0.5), data=k64, work_tables=tables(spec, 8, np.float64), dtype_name="float64",
               st=make_stores(4, 2, 16, np.float64, None, rng))
    empty = dict(dtype_name="float32", rotary_dim=16, layout="half", offset=0, kv_dtype="int8")
    assert cb.plan_append_kv(k[:0], k[:0], cos, sin, rows[:0], slots[:0], stores, norm=(w, 1e-6), **empty) is None
    with pytest.raises(ValueError, match="norm weight"):   # checked, then nothing to launch
        cb.plan_append_kv(k[:0], k[:0], cos, sin, rows[:0], slots[:0], stores, norm=(w[:3], 1e-6), **empty)


def test_norm_passes_the_shim_checks(kernels, rng):
    """The norm kernels under exact-extent copies, two shared-memory poisons (the sums of squares read only where
    written) and three concurrent block slots: the append at odd thread groups (trees over 3 and 7 partials, rows
    of a round across k and v) for each format, the attention at 7 threads with 3-key tiles (GQA 2: 3 threads per
    head, one idle) unsplit and split; against the float64 oracles."""
    checked = host.HostKernels(kernels.path, kernels.entries, slots=3, guard=True, compare=True)
    spec = RopeSpec(20, rotary_dim=14, rotary_offset=2, layout="interleaved")
    weight = norm_weight(rng, 20, np.float32)
    for kv_dtype in KV_DTYPES:
        for geometry in ("tiny", "odd", "default"):
            T, Hk, P = 7, 3, 12
            k = (rng.standard_normal((T, Hk, 20)) * 10.0 ** rng.uniform(-1, 1, (T, Hk, 1))).astype(np.float16)
            v = rng.standard_normal((T, Hk, 20)).astype(np.float16)
            k, v, rows, slots = with_padding(rng, k, v, rng.integers(0, 64, T), paged_slots(rng, T, P), 2)
            stores = make_stores(P, Hk, 20, np.float16, kv_dtype, rng)
            got = copy_stores(stores)
            cos, sin = tables(spec, 64, np.float32)
            threads, group, tpb = GEOMETRIES[geometry]
            checked.launch(cb.plan_append_kv(k, v, cos, sin, rows, slots, got, dtype_name="float16", rotary_dim=14,
                                             layout="interleaved", offset=2, kv_dtype=kv_dtype, norm=(weight, 0.5),
                                             threads=threads, group=group, max_tokens_per_block=tpb))
            if kv_dtype != "float8_e4m3":
                check_normed_keys(got, stores, k, rows, slots, spec, weight, 0.5, dtype="float16", kv_dtype=kv_dtype)
            want = reference(k, v, cos, sin, rows, slots, stores, spec=spec, kv_dtype=kv_dtype)
            assert_same_bits(got[1::2], want[1::2])
    assert checked.launches == 9
    pool = NormPool(kernels, dtype="float32", kv_dtype="int8", head_dim=20, layout="half", weight=weight, eps=1e-6)
    counts = NORM_STEPS["mixed"]
    q = rng.standard_normal((sum(counts), 4, 20)).astype(np.float32)
    rotation, positions = pool.rotation(counts)
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    q_weight = norm_weight(rng, 20, np.float32)
    kw = dict(scale=0.3, softcap=None, window=None, causal=True, kv_dtype="int8")
    want = oracle(rotate64(rms_norm64(q, q_weight, 2.0), positions, pool.spec), pool.stores, pool.block_table, 4,
                  pool.seq_lens, starts, **kw)
    for splits in (1, 3):
        o = np.full(q.shape, np.nan, q.dtype)
        plan = cb.plan_paged_attention(q, o, pool.stores, pool.block_table, 4, pool.seq_lens, starts,
                                       dtype_name="float32", rotation=rotation, norm=(q_weight, 2.0), threads=7,
                                       tile=3, splits=splits, **kw)
        for launch in plan.launches:
            checked.launch(launch)
        assert_close(o, want, "float32")


def test_cupy_glue_with_norm(fake_cupy, kernels, rng):
    """rotary.backends.cupy.append_kv and paged_attention with a norm through the NumPy stand-ins for CuPy: the
    append kernel with NORM from a module of its own (group "norm", built when asked for), paged_attention's usual
    kernel; the bits of the same plans launched on the NumPy arrays directly."""
    spec = RopeSpec(32, rotary_dim=24, rotary_offset=4)
    T, Hk, P = 6, 2, 12
    k = rng.standard_normal((T, Hk, 32)).astype(np.float32)
    v = rng.standard_normal((T, Hk, 32)).astype(np.float32)
    cos, sin = tables(spec, 32, np.float32)
    rows, slots = rng.integers(0, 32, T), paged_slots(rng, T, P)
    weight = norm_weight(rng, 32, np.float32)
    stores = make_stores(P, Hk, 32, np.float32, "int8", rng)
    got = tuple(fake_cupy.wrap(a.copy()) for a in stores)
    cb.append_kv(fake_cupy.wrap(k), fake_cupy.wrap(v), fake_cupy.wrap(cos), fake_cupy.wrap(sin), fake_cupy.wrap(rows),
                 fake_cupy.wrap(slots), got, rotary_dim=24, layout="half", offset=4, kv_dtype="int8",
                 norm=(fake_cupy.wrap(weight), 1e-6))
    assert fake_cupy.launched == ["kv_append<float, float, 1, true>"]
    assert [key[-1] for key in cb._modules] == ["norm"]
    assert next(iter(cb._modules.values())).names == cb.name_expressions("kv_cache", "float32", "norm")
    direct = copy_stores(stores)
    kv_shim_backend(kernels).append_kv(k, v, cos, sin, rows, slots, direct, rotary_dim=24, layout="half", offset=4,
                                       kv_dtype="int8", norm=(weight, 1e-6))
    assert_same_bits([np.asarray(a) for a in got], direct)
    check_normed_keys(direct, stores, k, rows, slots, spec, weight, 1e-6, dtype="float32", kv_dtype="int8")
    table = np.array([[slots[0] // 4, 0]], np.int64)   # one sequence over the page of the first slot (4 keys)
    lens, starts = np.array([4], np.int64), np.array([0, 2], np.int64)
    q = rng.standard_normal((2, 4, 32)).astype(np.float32)
    q_rot = (fake_cupy.wrap(cos), fake_cupy.wrap(sin), fake_cupy.wrap(np.array([2, 3])), 24, "half", 4)
    kw = dict(scale=0.2, softcap=None, window=None, causal=True, kv_dtype="int8")
    o = cb.paged_attention(fake_cupy.wrap(q), got, table, 4, fake_cupy.wrap(lens), starts, rotation=q_rot,
                           norm=(fake_cupy.wrap(weight), 0.25), **kw)
    assert fake_cupy.launched[1:] == [cb.paged_attention_kernel_name("float32", "int8")]
    want = kv_shim_backend(kernels).paged_attention(q, direct, table, 4, lens, starts, norm=(weight, 0.25),
                                                    rotation=(cos, sin, np.array([2, 3]), 24, "half", 4), **kw)
    np.testing.assert_array_equal(np.asarray(o), want)
