"""The Numba backend's KV-cache kernels (``numba_kernels/kv_cache.py`` through ``backends/numba_kv.py``):
``append_kv`` bit for bit against the reference (``kv_entries.append_kv``: float entries, int8 entries and
scales) and against a float64 oracle; ``cache_attention`` against the reference path (the same cache with the
module's ``cache_attention`` taken away: gathered keys through ``rotary.attention``), to the work dtype's
rounding: relative to the largest output, 2e-6 for float32, 1e-12 for float64, 2e-3 for float16 (the reference
rounds dequantized int8 keys and values to float16; the kernel keeps them in float32)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("numba")

import rotary  # noqa: E402
from rotary import testing  # noqa: E402
from rotary.backends import kv_entries, numba_kv  # noqa: E402
from rotary.backends import numba as nb  # noqa: E402
from rotary.backends.numba_kernels import kv_cache as kernels  # noqa: E402
from rotary.spec import tables as _tables  # noqa: E402

DTYPES = [np.float16, np.float32, np.float64]
#: cache_attention against the reference path: max |o - o_ref| / max |o_ref|
ATTENTION_TOL = {np.dtype(np.float16): 2e-3, np.dtype(np.float32): 2e-6, np.dtype(np.float64): 1e-12}
SPECS = {
    "full": dict(head_dim=64),
    "partial": dict(head_dim=64, rotary_dim=32),
    "offset": dict(head_dim=64, rotary_dim=32, rotary_offset=16),
    "odd": dict(head_dim=40, rotary_dim=22),   # pairs and heads that are not whole vectors
}


def _spec(name, layout="half"):
    kw = dict(SPECS[name])
    return rotary.RopeSpec(kw.pop("head_dim"), layout=layout, **kw)


@pytest.fixture(params=["serial", "parallel"])
def kernel_kind(request, monkeypatch):
    """Every call takes the serial kernels, or the parallel ones (size thresholds at 0)."""
    if request.param == "parallel":
        monkeypatch.setattr(nb, "PARALLEL_MIN_ELEMENTS", 0)
        monkeypatch.setattr(nb, "PARALLEL_MIN_TOKENS", 0)
        monkeypatch.setattr(nb, "DECODE_KERNEL", "parallel")
        monkeypatch.setattr(numba_kv, "ATTENTION_PARALLEL_MIN_WORK", 0)
    else:
        monkeypatch.setattr(nb, "PARALLEL_MIN_ELEMENTS", 1 << 62)
        monkeypatch.setattr(numba_kv, "ATTENTION_PARALLEL_MIN_WORK", 1 << 62)
    return request.param


def _stores(kv_dtype, dtype, slots, heads, head_dim):
    entry = {None: dtype, "int8": np.int8}[kv_dtype]
    work = np.float64 if dtype == np.float64 else np.float32
    rng = np.random.default_rng(7)   # garbage in the pool: only the written slots are compared
    stores = [rng.integers(0, 100, (slots, heads, head_dim)).astype(entry) for _ in range(2)]
    scales = [np.full((slots, heads), np.nan, work) for _ in range(2)] if kv_dtype else [None, None]
    return stores + scales


def _tables_for(spec, positions, dtype):
    work = np.float64 if dtype == np.float64 else np.float32
    cos, sin, rows = _tables.lookup(spec, np.asarray(positions, np.int64)[None], dtype=work)
    return cos, sin, rows.reshape(-1)


def _append_both(spec, k, v, positions, slots, kv_dtype, pool=40):
    """(numba stores, reference stores) after one append_kv of k, v at ``positions`` into ``slots``."""
    cos, sin, rows = _tables_for(spec, positions, k.dtype)
    results = []
    for append in (nb.append_kv, kv_entries.append_kv):
        stores = _stores(kv_dtype, k.dtype, pool, k.shape[1], k.shape[2])
        append(k, v, cos, sin, rows, np.asarray(slots, np.int64), stores, rotary_dim=spec.rotary_dim,
               layout=spec.layout, offset=spec.rotary_offset, kv_dtype=kv_dtype)
        results.append(stores)
    return results


def _assert_same_bits(got, want, slots):
    for g, w in zip(got, want):
        if w is None:
            assert g is None
            continue
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(g[slots].view(np.uint8), w[slots].view(np.uint8))


def _kv(rng, dtype, T, H, D, strided):
    """k, v (T, H, D): C-contiguous, or views with every stride unusual (a head axis from a bhsd block, a
    coordinate stride of 2, a negative token stride)."""
    if not strided:
        return (rng.standard_normal((T, H, D)).astype(dtype) for _ in range(2))
    k = rng.standard_normal((H, T, 2 * D)).astype(dtype).transpose(1, 0, 2)[:, :, ::2]
    v = rng.standard_normal((T, H, D)).astype(dtype)[::-1]
    return k, v


# -- append_kv: the reference's bits ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_dtype", [None, "int8"])
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("spec_name", list(SPECS))
def test_append_kv_equals_the_reference_bit_for_bit(rng, kernel_kind, dtype, kv_dtype, layout, spec_name):
    spec = _spec(spec_name, layout)
    for strided in (False, True):
        k, v = _kv(rng, dtype, 11, 3, spec.head_dim, strided)
        positions = rng.integers(0, 5000, 11)
        slots = rng.permutation(40)[:11]
        got, want = _append_both(spec, k, v, positions, slots, kv_dtype)
        _assert_same_bits(got, want, slots)


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_append_kv_edge_values(kernel_kind, kv_dtype):
    """A zero head (int8 scale 0: entries w / 1), a head of one large value, ties at .5 after scaling (round half
    to even), signed zeros, float16 subnormals and its largest values: the reference's bits."""
    spec = rotary.RopeSpec(32, rotary_dim=16)
    for dtype in DTYPES:
        k = np.zeros((4, 2, 32), dtype)
        v = np.zeros((4, 2, 32), dtype)
        k[1, 0, 20] = 3.0
        v[1, 1] = np.arange(32) - 15.5   # amax 15.5: w / scale has exact halves
        v[2, 0] = -0.0
        k[2, 1, ::3] = np.finfo(dtype).tiny if dtype != np.float16 else np.float16(6e-8)
        k[3] = np.finfo(dtype).max / 4 if dtype != np.float16 else np.float16(60000)
        v[3, 1, 5] = 254.5
        with np.errstate(over="ignore"):   # float16 60000 rotated past float16's range: inf in both
            got, want = _append_both(spec, k, v, [0, 1, 77, 3], [3, 0, 2, 1], kv_dtype, pool=4)
        _assert_same_bits(got, want, [3, 0, 2, 1])


def test_append_kv_through_the_cache_equals_a_numpy_cache(rng, kernel_kind):
    """A contiguous and a paged numba cache hold the bits of the same caches on the NumPy backend (the reference
    append) after appends of ragged chunks to subsets of the sequences, dense and packed."""
    spec = rotary.RopeSpec(64, rotary_dim=48, layout="interleaved")
    for kv_dtype in (None, "int8"):
        for kw in (dict(capacity=64), dict(page_size=8, num_pages=40)):
            caches = [rotary.KVCache(spec, batch=3, kv_heads=2, head_dim=64, kv_dtype=kv_dtype, backend=b, **kw)
                      for b in ("numba", "numpy")]
            for s, ids in ((5, None), (1, [2, 0]), (9, [1]), (1, None)):
                n = 3 if ids is None else len(ids)
                k, v = (rng.standard_normal((n, s, 2, 64)).astype(np.float32) for _ in range(2))
                for cache in caches:
                    cache.append(k, v, ids)
            k, v = (rng.standard_normal((7, 2, 64)).astype(np.float32) for _ in range(2))
            for cache in caches:
                cache.append(k, v, [0, 2], cu_seqlens=[0, 3, 7])
            assert caches[0].module is nb and caches[1].module is rotary.backends.get("numpy")
            np.testing.assert_array_equal(caches[0].lengths, caches[1].lengths)
            for b in range(3):
                for got, want in ((caches[0].keys(b), caches[1].keys(b)), (caches[0].values(b), caches[1].values(b))):
                    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


# -- append_kv: a float64 oracle ---------------------------------------------------------------------------------
def _oracle_keys(spec, k, positions):
    """k (T, H, D) rotated at ``positions`` in float64: angles of the spec's inv_freq in float64, the pairs of
    [offset, offset + rotary_dim) in the spec's layout, the other coordinates as they are."""
    k = np.asarray(k, np.float64)
    half, off = spec.rotary_dim // 2, spec.rotary_offset
    angle = np.asarray(positions, np.float64)[:, None] * np.asarray(spec.inv_freq(), np.float64)[None, :]
    c, s = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    a = off + (np.arange(half) if spec.layout == "half" else 2 * np.arange(half))
    b = a + (half if spec.layout == "half" else 1)
    y = k.copy()
    y[..., a] = k[..., a] * c - k[..., b] * s
    y[..., b] = k[..., b] * c + k[..., a] * s
    return y


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("spec_name", ["full", "partial", "offset"])
def test_append_kv_matches_a_float64_oracle(rng, dtype, layout, spec_name):
    spec = _spec(spec_name, layout)
    k, v = _kv(rng, dtype, 9, 2, spec.head_dim, strided=True)
    positions = np.array([0, 1, 2, 50, 333, 1000, 4095, 4096, 7])
    slots = np.arange(9)
    want_k = _oracle_keys(spec, k, positions)
    (got, _) = _append_both(spec, k, v, positions, slots, None)
    testing.assert_close(got[0][slots], want_k)
    np.testing.assert_array_equal(got[1][slots], v)
    (got, _) = _append_both(spec, k, v, positions, slots, "int8")
    for entries, scales, want in ((got[0], got[2], want_k), (got[1], got[3], np.asarray(v, np.float64))):
        amax = np.abs(want).max(axis=-1, keepdims=True)
        dequantized = entries[slots].astype(np.float64) * scales[slots][..., None]
        # half a quantization step, plus the rounding of the work values
        assert np.all(np.abs(dequantized - want) <= amax * (0.5 / 127 + 4 * float(np.finfo(dtype).eps)) + 1e-30)


# -- cache_attention: the reference path ---------------------------------------------------------------------
def _reference(monkeypatch, call):
    """call() with the numba module's cache_attention taken away (attend.py then gathers the keys and runs the
    packed rotary.attention path)."""
    with monkeypatch.context() as m:
        m.delattr(nb, "cache_attention")
        return call()


def _rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-300))


def _filled_cache(rng, dtype, kv_dtype, lengths, *, heads=2, head_dim=64, spec=None, layout="bshd", **kw):
    spec = spec or rotary.RopeSpec(head_dim)
    kw = kw or dict(capacity=160)
    cache = rotary.KVCache(spec, batch=len(lengths), kv_heads=heads, head_dim=head_dim, dtype=dtype,
                           kv_dtype=kv_dtype, backend="numba", layout=layout, **kw)
    for b, n in enumerate(lengths):   # ragged: each sequence its own length, in two appends
        for part in (n // 2, n - n // 2):
            if part:
                k, v = (rng.standard_normal((1, part, heads, head_dim)).astype(dtype) for _ in range(2))
                if layout == "bhsd":
                    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
                cache.append(k, v, [b])
    return cache


CACHES = {"contiguous": dict(capacity=160), "paged": dict(page_size=16, num_pages=40),
          "paged-7": dict(page_size=7, num_pages=80)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_dtype", [None, "int8"])
@pytest.mark.parametrize("cache_kind", list(CACHES))
def test_cache_attention_matches_the_reference_path(rng, monkeypatch, kernel_kind, dtype, kv_dtype, cache_kind):
    """Ragged lengths (1 to past a few key blocks), decode (s = 1) and chunks (s > 1: more q rows than a row block)
    of a subset of the sequences, GQA groups of 1 and 4, causal / window / softcap / not causal / a given scale."""
    cache = _filled_cache(rng, dtype, kv_dtype, [1, 37, 150, 66], **CACHES[cache_kind])
    tol = ATTENTION_TOL[np.dtype(dtype)]
    for s, q_heads, ids in ((1, 8, None), (1, 2, None), (5, 8, [3, 1, 2]), (13, 2, [2])):
        q = rng.standard_normal((4 if ids is None else len(ids), s, q_heads, 64)).astype(dtype)
        for kw in (dict(), dict(window=9), dict(softcap=3.0), dict(causal=False), dict(window=40, softcap=50.0),
                   dict(scale=0.3)):
            kw = dict(kw, seq_ids=ids)
            got = rotary.attention(q, cache, **kw)
            want = _reference(monkeypatch, lambda: rotary.attention(q, cache, **kw))
            assert got.dtype == q.dtype and got.shape == q.shape
            assert _rel(got, want) <= tol, (s, q_heads, kw, _rel(got, want))


def test_cache_attention_seq_ids_bhsd_and_odd_head_dim(rng, monkeypatch, kernel_kind):
    """A subset of the sequences (seq_ids), a bhsd cache, head_dim 40 (not whole vectors), partial rotary."""
    spec = rotary.RopeSpec(40, rotary_dim=24, layout="interleaved")
    for kv_dtype in (None, "int8"):
        cache = _filled_cache(rng, np.float32, kv_dtype, [8, 70, 20], head_dim=40, spec=spec, layout="bhsd",
                              page_size=8, num_pages=30)
        q = rng.standard_normal((2, 4, 6, 40)).astype(np.float32)   # bhsd: (n, heads, s, d)
        for kw in (dict(seq_ids=[2, 1]), dict(seq_ids=[0, 1], window=2)):
            got = rotary.attention(q, cache, **kw)
            want = _reference(monkeypatch, lambda: rotary.attention(q, cache, **kw))
            assert _rel(got, want) <= 2e-6, (kv_dtype, kw)


def test_cache_attention_rows_that_see_no_key_give_zero(rng, kernel_kind):
    """window=0 leaves every query without a key: zeros (the reference's rule), not NaN."""
    cache = _filled_cache(rng, np.float32, None, [4, 9])
    q = rng.standard_normal((2, 2, 4, 64)).astype(np.float32)
    o = nb.cache_attention(np.ascontiguousarray(q), cache.stores, cache.block_table, cache.page_size, cache.lengths,
                           scale=0.125, softcap=None, window=0, causal=True)
    assert np.all(o == 0)


def test_cache_attention_float64_matches_a_dense_oracle(rng):
    """float64: softmax(q k^T scale) v of the gathered keys in plain NumPy, the causal rule of the last tokens."""
    cache = _filled_cache(rng, np.float64, None, [5, 40], page_size=4, num_pages=20)
    q = rng.standard_normal((2, 3, 4, 64))
    o = rotary.attention(q, cache)
    for b in range(2):
        keys, values = cache.keys(b), cache.values(b)
        length = int(cache.lengths[b])
        q_rot = rotary.apply(q[b], np.arange(length - 3, length), spec=cache.spec, seq_axis=0, backend="numpy")
        for j in range(3):
            for h in range(4):
                scores = keys[: length - 3 + j + 1, h // 2] @ q_rot[j, h] / 8.0
                p = np.exp(scores - scores.max())
                want = (p / p.sum()) @ values[: length - 3 + j + 1, h // 2]
                np.testing.assert_allclose(o[b, j, h], want, rtol=1e-12, atol=1e-13)


# -- the kernels' bodies as plain Python (small inputs: what NUMBA_DISABLE_JIT runs; coverage sees them) -----------
@pytest.fixture
def pure_python(monkeypatch):
    for name in ("append_kv_serial", "append_kv_parallel", "cache_attention_serial", "cache_attention_parallel"):
        monkeypatch.setattr(kernels, name, getattr(kernels, name).py_func)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernels_in_pure_python(rng, monkeypatch, pure_python, dtype):
    spec = rotary.RopeSpec(20, rotary_dim=12, layout="interleaved")
    for kv_dtype in (None, "int8"):
        k, v = _kv(rng, dtype, 5, 2, 20, strided=True)
        got, want = _append_both(spec, k, v, [1, 9, 3, 4, 0], [4, 0, 2, 1, 7], kv_dtype, pool=8)
        _assert_same_bits(got, want, [4, 0, 2, 1, 7])
        cache = _filled_cache(rng, dtype, kv_dtype, [3, 6], heads=1, head_dim=20, spec=spec, page_size=4,
                              num_pages=6)
        q = rng.standard_normal((2, 2, 2, 20)).astype(dtype)
        got = rotary.attention(q, cache, softcap=5.0)
        want = _reference(monkeypatch, lambda: rotary.attention(q, cache, softcap=5.0))
        assert _rel(got, want) <= max(ATTENTION_TOL[np.dtype(dtype)], 1e-6)


# -- module surface --------------------------------------------------------------------------------------------
def test_module_surface():
    assert nb.KV_DTYPES == (None, "int8")
    assert nb.append_kv is numba_kv.append_kv and nb.cache_attention is numba_kv.cache_attention
    for kernel in (kernels.append_kv_serial, kernels.append_kv_parallel, kernels.cache_attention_serial,
                   kernels.cache_attention_parallel):
        assert type(kernel._cache).__name__ != "NullCache"   # cache=True
        assert kernel.targetoptions.get("error_model") == "numpy" and not kernel.targetoptions.get("fastmath")
    from rotary.backends import numba_kernels

    assert "kv_cache.py" in numba_kernels.KERNEL_FILES and "rotation.py" in numba_kernels.HELPER_FILES


def test_float8_caches_take_the_reference(rng, monkeypatch):
    """float8_e4m3 is not in KV_DTYPES: a numba cache of it appends through the reference (the NumPy cache's
    bits) and attends by the reference path."""
    pytest.importorskip("ml_dtypes")
    assert "float8_e4m3" not in nb.KV_DTYPES
    caches = [rotary.KVCache(rotary.RopeSpec(64), batch=2, kv_heads=2, head_dim=64, capacity=16,
                             kv_dtype="float8_e4m3", backend=b) for b in ("numba", "numpy")]
    k, v = (rng.standard_normal((2, 5, 2, 64)).astype(np.float32) for _ in range(2))
    for cache in caches:
        cache.append(k, v)
    for got, want in zip(*(c.stores for c in caches)):
        np.testing.assert_array_equal(got[:5], want[:5])
    q = rng.standard_normal((2, 1, 4, 64)).astype(np.float32)
    got = rotary.attention(q, caches[0])
    assert _rel(got, _reference(monkeypatch, lambda: rotary.attention(q, caches[0]))) == 0


def test_helpers_match_their_python_forms():
    """load_as / vload_as / vsum_pairwise compiled against their Python forms, for every entry dtype."""
    import numba

    @numba.njit
    def compiled(buf, like, i):
        return kernels.load_as(buf, i, like), kernels.vsum_pairwise(kernels.vload_as(buf, i, like))

    like32, like64 = np.zeros(1, np.float32), np.zeros(1, np.float64)
    for buf in (np.arange(-40, 40, dtype=np.int8), (np.arange(80) * 0.37 - 9).astype(np.float16).view(np.uint16),
                np.linspace(-3, 5, 80).astype(np.float32), np.linspace(-3, 5, 80)):
        for like in (like32, like64):
            if buf.dtype == np.float64 and like is like32:
                continue
            got = compiled(buf, like, 3)
            want = (kernels.load_as(buf, 3, like), kernels.vsum_pairwise(kernels.vload_as(buf, 3, like)))
            assert got[0] == want[0] and abs(got[1] - want[1]) <= 1e-6 * max(1.0, abs(want[1])), (buf.dtype, like.dtype)


_NRT_BALANCE_PROBE = """
import numpy as np, rotary
from numba.core.runtime import rtsys
from rotary.backends import numba as nb, numba_kv
rng = np.random.default_rng(0)
caches = [rotary.KVCache(rotary.RopeSpec(64), batch=4, kv_heads=2, head_dim=64, capacity=300, kv_dtype=kv,
                         backend="numba") for kv in (None, "int8")]
k = rng.standard_normal((4, 1, 2, 64)).astype(np.float32)
q = rng.standard_normal((4, 1, 4, 64)).astype(np.float32)

def calls():
    for cache in caches:
        if cache.lengths[0] > 250:
            cache.reset()
        cache.append(k, k)
        rotary.attention(q, cache)
        for threshold in (0, 1 << 62):   # the parallel and the serial kernels
            nb.PARALLEL_MIN_ELEMENTS = numba_kv.ATTENTION_PARALLEL_MIN_WORK = threshold
            nb.PARALLEL_MIN_TOKENS, nb.DECODE_KERNEL = 0, "parallel"
            cache.append(k, k)
            rotary.attention(q, cache)

calls()
before = rtsys.get_allocation_stats()
for _ in range(30):
    calls()
after = rtsys.get_allocation_stats()
print(after.alloc - after.free - (before.alloc - before.free), after.mi_alloc - after.mi_free - (before.mi_alloc - before.mi_free))
"""


def test_kernels_release_every_allocation():
    """NUMBA_NRT_STATS=1: appends (float and int8: a work buffer per token) and attention (buffers per task), serial
    and parallel, free every allocation they make."""
    env = dict(os.environ, NUMBA_NRT_STATS="1")
    out = subprocess.run([sys.executable, "-c", _NRT_BALANCE_PROBE], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["0", "0"], out.stdout
