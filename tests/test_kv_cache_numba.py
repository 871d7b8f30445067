"""The Numba backend's KV primitives (``backends/numba_kv.py`` over ``numba_kernels/kv_cache.py``), called directly
(the backend contract in :mod:`rotary.backends`), serial and parallel kernels:

- ``append_kv`` bit for bit against the reference (``kv_entries.append_kv``: float entries, int8 entries and scales),
  padding tokens (slot -1) touching nothing, and the keys against a float64 oracle;
- ``paged_attention`` (packed q, ``q_starts``) against an independent float64 oracle written here (each sequence's
  keys gathered through its block table, dequantized, an explicit masked softmax), relative to the largest output:
  2e-6 for float32, 1e-12 for float64, 2e-3 for float16.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("numba")

import rotary  # noqa: E402
from rotary import testing  # noqa: E402
from rotary.backends import kv_entries, numba_kv, numba_runtime, supports  # noqa: E402
from rotary.backends import numba as nb  # noqa: E402
from rotary.backends.numba_kernels import kv_cache as kernels  # noqa: E402
from rotary.spec import tables as _tables  # noqa: E402

DTYPES = [np.float16, np.float32, np.float64]
#: paged_attention against the float64 oracle: max |o - o_oracle| / max |o_oracle|
ATTENTION_TOL = {np.dtype(np.float16): 2e-3, np.dtype(np.float32): 2e-6, np.dtype(np.float64): 1e-12}
SPECS = {
    "full": dict(head_dim=64),
    "partial": dict(head_dim=64, rotary_dim=32),
    "offset": dict(head_dim=64, rotary_dim=32, rotary_offset=16),
    "odd": dict(head_dim=40, rotary_dim=22),   # pairs and heads that are not whole vectors
}
KERNELS = ("append_kv_serial", "append_kv_parallel", "paged_attention_serial", "paged_attention_parallel")


def _spec(name, layout="half"):
    kw = dict(SPECS[name])
    return rotary.RopeSpec(kw.pop("head_dim"), layout=layout, **kw)


@pytest.fixture(params=["serial", "parallel"])
def kernel_kind(request, monkeypatch):
    """Every call takes the serial kernels, or the parallel ones (size thresholds at 0); the kernels that ran are
    checked to be of that kind."""
    if request.param == "parallel":
        monkeypatch.setattr(numba_runtime, "PARALLEL_MIN_ELEMENTS", 0)
        monkeypatch.setattr(numba_runtime, "PARALLEL_MIN_TOKENS", 0)
        monkeypatch.setattr(numba_runtime, "DECODE_KERNEL", "parallel")
        monkeypatch.setattr(numba_kv, "ATTENTION_PARALLEL_MIN_WORK", 0)
    else:
        monkeypatch.setattr(numba_runtime, "PARALLEL_MIN_ELEMENTS", 1 << 62)
        monkeypatch.setattr(numba_kv, "ATTENTION_PARALLEL_MIN_WORK", 1 << 62)
    ran = _record_kernels(monkeypatch, KERNELS)
    yield request.param
    assert ran and all(name.endswith(request.param) for name in ran), ran


def _record_kernels(monkeypatch, names):
    """A list that gets the name of each of these kernels of kv_cache.py as it runs (the glue looks them up per call)."""
    ran = []
    for name in names:
        kernel = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _k=kernel, _n=name: (ran.append(_n), _k(*a))[1])
    return ran


# -- append_kv -----------------------------------------------------------------------------------------------------
def _stores(kv_dtype, dtype, slots, heads, head_dim, seed=7):
    entry = {None: dtype, "int8": np.int8}[kv_dtype]
    work = np.float64 if dtype == np.float64 else np.float32
    rng = np.random.default_rng(seed)   # garbage in the pool: what is not written must stay as it is
    stores = [rng.integers(0, 100, (slots, heads, head_dim)).astype(entry) for _ in range(2)]
    scales = [np.full((slots, heads), np.nan, work) for _ in range(2)] if kv_dtype else [None, None]
    return stores + scales


def _tables_for(spec, positions, dtype):
    work = np.float64 if dtype == np.float64 else np.float32
    cos, sin, rows = _tables.lookup(spec, np.asarray(positions, np.int64)[None], dtype=work)
    return cos, sin, rows.reshape(-1)


def _append_both(spec, k, v, positions, slots, kv_dtype, pool=40):
    """(numba stores, reference stores) after one append_kv of k, v at ``positions`` into ``slots`` of pools of the
    same initial garbage; the reference gets the tokens whose slot is >= 0 only (it does not skip padding)."""
    cos, sin, rows = _tables_for(spec, positions, k.dtype)
    slots = np.asarray(slots, np.int64)
    keep = slots >= 0
    kw = dict(rotary_dim=spec.rotary_dim, layout=spec.layout, offset=spec.rotary_offset, kv_dtype=kv_dtype)
    got = _stores(kv_dtype, k.dtype, pool, k.shape[1], k.shape[2])
    nb.append_kv(k, v, cos, sin, rows, slots, got, **kw)
    want = _stores(kv_dtype, k.dtype, pool, k.shape[1], k.shape[2])
    kv_entries.append_kv(k[keep], v[keep], cos, sin, rows[keep], slots[keep], want, **kw)
    return got, want


def _assert_same_bits(got, want):
    """Whole pools (entries and scales) bit for bit: the written slots and every other one."""
    for g, w in zip(got, want):
        if w is None:
            assert g is None
            continue
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8))


def _kv(rng, dtype, T, H, D, strided):
    """k, v (T, H, D): C-contiguous, or views with every stride unusual (a head axis from a bhsd block, a
    coordinate stride of 2, a negative token stride)."""
    if not strided:
        return (rng.standard_normal((T, H, D)).astype(dtype) for _ in range(2))
    k = rng.standard_normal((H, T, 2 * D)).astype(dtype).transpose(1, 0, 2)[:, :, ::2]
    v = rng.standard_normal((T, H, D)).astype(dtype)[::-1]
    return k, v


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_dtype", [None, "int8"])
@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_append_kv_equals_the_reference_bit_for_bit(rng, kernel_kind, dtype, kv_dtype, layout):
    """Full, partial, offset and odd rotary dims; C-contiguous and strided k/v; the whole pools compared."""
    for spec_name in SPECS:
        spec = _spec(spec_name, layout)
        for strided in (False, True):
            k, v = _kv(rng, dtype, 11, 3, spec.head_dim, strided)
            positions = rng.integers(0, 5000, 11)
            slots = rng.permutation(40)[:11]
            _assert_same_bits(*_append_both(spec, k, v, positions, slots, kv_dtype))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_append_kv_streams_aligned_float_entries(rng, kernel_kind, monkeypatch, dtype):
    """Float entries of k's float32 / float64, every coordinate rotated, unit-stride heads: the kernel gets the
    ``stream`` marker (non-temporal stores, ``kv_cache.stream_token``), and writes the reference's bits into aligned
    pools and, by plain stores, into pools 4 bytes off 16-byte alignment; partial rotary, strided k and int8 entries
    get no marker."""
    markers = []
    for name in ("append_kv_serial", "append_kv_parallel"):
        kernel = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _k=kernel: (markers.append(a[20]), _k(*a))[1])
    spec = _spec("full")
    k, v = _kv(rng, dtype, 11, 3, spec.head_dim, strided=False)
    positions, slots = rng.integers(0, 5000, 11), rng.permutation(40)[:11]
    got, want = _append_both(spec, k, v, positions, slots, None)
    _assert_same_bits(got, want)
    assert markers[-1] is True
    cos, sin, rows = _tables_for(spec, positions, dtype)
    kw = dict(rotary_dim=spec.rotary_dim, layout=spec.layout, offset=spec.rotary_offset, kv_dtype=None)
    off = []
    for store in got[:2]:
        buf = np.zeros(store.size + 1, dtype=dtype)[1:]   # one element past a 16-byte aligned start
        off.append(buf.reshape(store.shape))
        assert off[-1].ctypes.data % 16 != 0
        off[-1][...] = _stores(None, dtype, 40, 3, spec.head_dim)[len(off) - 1]
    nb.append_kv(k, v, cos, sin, rows, np.asarray(slots, np.int64), off + [None, None], **kw)
    assert markers[-1] is True
    _assert_same_bits(off + [None, None], want)
    for spec_name, strided, kv_dtype in (("partial", False, None), ("full", True, None), ("full", False, "int8")):
        k, v = _kv(rng, dtype, 11, 3, 64, strided)
        _assert_same_bits(*_append_both(_spec(spec_name), k, v, positions, slots, kv_dtype))
        assert markers[-1] is None


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_append_kv_skips_padding_tokens(rng, kernel_kind, kv_dtype):
    """slots[t] = -1 (any negative): nothing of token t read or written (its k/v may be anything, NaN included); the
    other tokens as the reference writes them; every other slot of the pools, entries and scales, unchanged. Padding
    at the start, in a run, before the last token (the prefetch of the next token's lines skips it) and at the end;
    all padding."""
    spec = _spec("offset", "interleaved")
    for dtype in (np.float16, np.float32, np.float64):
        k, v = _kv(rng, dtype, 12, 3, spec.head_dim, strided=True)
        slots = np.array([-1, 5, 9, -1, -1, 0, 33, 2, -7, 17, -1, -1])
        k[slots < 0], v[slots < 0] = np.nan, np.inf
        positions = rng.integers(0, 3000, 12)
        _assert_same_bits(*_append_both(spec, k, v, positions, slots, kv_dtype))
        got, want = _append_both(spec, k, v, positions, np.full(12, -1), kv_dtype)
        _assert_same_bits(got, want)
        _assert_same_bits(got, _stores(kv_dtype, dtype, 40, 3, spec.head_dim))   # nothing written at all


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_a_prepared_append_reads_its_rows_and_slots_when_it_runs(rng, kernel_kind, kv_dtype):
    """``run.moved`` given the very rows and slots arrays the run reads (a decode chain rewrites its own in place) is
    the run itself, and each run writes at the values the arrays hold then, as the reference does; other arrays of
    the same values give another run of the same bits; other tables give None."""
    spec = _spec("full")
    T, H = 6, 2
    k, v = _kv(rng, np.float32, T, H, spec.head_dim, strided=False)
    positions = np.arange(100, 100 + T, dtype=np.int64)
    cos, sin, rows = _tables_for(spec, np.arange(4096), np.float32)
    rows, slots = positions.copy(), np.arange(T, dtype=np.int64) * 3
    kw = dict(rotary_dim=spec.rotary_dim, layout=spec.layout, offset=spec.rotary_offset, kv_dtype=kv_dtype)
    run = nb.prepare_append_kv(k, v, cos, sin, rows, slots, **kw)
    for step in range(3):
        if step:   # the next decode step, written into the same arrays
            rows += 1
            slots += 1
            assert run.moved(cos, sin, rows, slots) is run
        got = _stores(kv_dtype, np.float32, 40, H, spec.head_dim)
        run(k, v, got)
        want = _stores(kv_dtype, np.float32, 40, H, spec.head_dim)
        kv_entries.append_kv(k, v, cos, sin, rows.copy(), slots.copy(), want, **kw)
        _assert_same_bits(got, want)
        other = run.moved(cos, sin, rows.copy(), slots.copy())
        assert other is not None and other is not run
        again = _stores(kv_dtype, np.float32, 40, H, spec.head_dim)
        other(k, v, again)
        _assert_same_bits(again, want)
    assert run.moved(cos.copy(), sin, rows, slots) is None


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
            _assert_same_bits(*_append_both(spec, k, v, [0, 1, 77, 3], [3, 0, 2, 1], kv_dtype, pool=4))


def test_append_kv_large_calls_and_the_size_rule(rng, monkeypatch):
    """Under the default size rule: a decode-sized append (32 tokens x 8 heads x 128) and a prefill-sized one
    (600 tokens) give the reference's bits, the latter on the parallel kernel (numba_runtime.parallel_by_size)."""
    spec = rotary.RopeSpec(128, layout="half")
    ran = _record_kernels(monkeypatch, ("append_kv_serial", "append_kv_parallel"))
    for T in (32, 600):
        k, v = _kv(rng, np.float32, T, 8, 128, strided=False)
        slots = rng.permutation(700)[:T]
        slots[::5] = -1
        _assert_same_bits(*_append_both(spec, k, v, rng.integers(0, 4000, T), slots, "int8", pool=700))
    assert ran[-1] == "append_kv_parallel"


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
def test_append_kv_matches_a_float64_oracle(rng, dtype, layout):
    for spec_name in ("full", "offset"):
        spec = _spec(spec_name, layout)
        k, v = _kv(rng, dtype, 9, 2, spec.head_dim, strided=True)
        positions = np.array([0, 1, 2, 50, 333, 1000, 4095, 4096, 7])
        slots = np.arange(9)
        want_k = _oracle_keys(spec, k, positions)
        got, _ = _append_both(spec, k, v, positions, slots, None)
        testing.assert_close(got[0][slots], want_k)
        np.testing.assert_array_equal(got[1][slots], v)
        got, _ = _append_both(spec, k, v, positions, slots, "int8")
        for entries, scales, want in ((got[0], got[2], want_k), (got[1], got[3], np.asarray(v, np.float64))):
            amax = np.abs(want).max(axis=-1, keepdims=True)
            dequantized = entries[slots].astype(np.float64) * scales[slots][..., None]
            # half a quantization step, plus the rounding of the work values
            assert np.all(np.abs(dequantized - want) <= amax * (0.5 / 127 + 4 * float(np.finfo(dtype).eps)) + 1e-30)


# -- paged_attention -------------------------------------------------------------------------------------------
def oracle_attention(q, stores, block_table, page_size, seq_lens, q_starts, *, scale, softcap, window, causal,
                     kv_dtype):
    """The float64 oracle of the contract: :func:`rotary.testing.paged_attention64`."""
    return testing.paged_attention64(q, stores, block_table, page_size, seq_lens, q_starts, scale=scale,
                                     softcap=softcap, window=window, causal=causal, kv_dtype=kv_dtype)


def _rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-300))


def _pool(rng, kv_dtype, dtype, n_pages, page_size, kv_heads, head_dim):
    """Random stores of n_pages pages (float entries of dtype, or int8 entries with work-dtype scales)."""
    slots = n_pages * page_size
    if kv_dtype is None:
        return [rng.standard_normal((slots, kv_heads, head_dim)).astype(dtype) for _ in range(2)] + [None, None]
    work = np.float64 if dtype == np.float64 else np.float32
    entries = [rng.integers(-127, 128, (slots, kv_heads, head_dim)).astype(np.int8) for _ in range(2)]
    return entries + [(rng.random((slots, kv_heads)) * 0.03).astype(work) for _ in range(2)]


def _table(rng, seq_lens, page_size, n_pages, share=True):
    """(n, W) block table of distinct random pages for each sequence's keys; with ``share``, sequences 0 and 1 name
    the same first pages (a forked prefix)."""
    widths = [-(-int(n) // page_size) for n in seq_lens]
    pages = iter(rng.permutation(n_pages))
    table = np.full((len(seq_lens), max(widths + [1])), -1, np.int64)   # pages past a sequence's own: never read
    for i, w in enumerate(widths):
        table[i, :w] = [next(pages) for _ in range(w)]
    if share and len(seq_lens) > 1:
        common = min(widths[0], widths[1])
        table[1, :common] = table[0, :common]
    return table


def _check(rng, dtype, kv_dtype, seq_lens, counts, *, q_heads, kv_heads=2, head_dim=64, page_size=16, cases=None):
    """paged_attention against the oracle for sequences of ``seq_lens`` keys with ``counts`` queries each (packed),
    over a shared-prefix block table, for each dict of (scale, softcap, window, causal) in ``cases``."""
    n_pages = sum(-(-n // page_size) for n in seq_lens) + 3
    stores = _pool(rng, kv_dtype, dtype, n_pages, page_size, kv_heads, head_dim)
    table = _table(rng, seq_lens, page_size, n_pages)
    seq_lens = np.asarray(seq_lens, np.int64)
    q_starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    q = rng.standard_normal((int(q_starts[-1]), q_heads, head_dim)).astype(dtype)
    for kw in cases or (dict(),):
        kw = dict(dict(scale=head_dim ** -0.5, softcap=None, window=None, causal=True), **kw)
        got = nb.paged_attention(q, stores, table, page_size, seq_lens, q_starts, kv_dtype=kv_dtype, **kw)
        want = oracle_attention(q, stores, table, page_size, seq_lens, q_starts, kv_dtype=kv_dtype, **kw)
        assert got.dtype == q.dtype and got.shape == q.shape
        assert _rel(got, want) <= ATTENTION_TOL[np.dtype(dtype)], (kw, _rel(got, want))
    return q, stores, table, seq_lens, q_starts


CASES = (dict(), dict(window=9), dict(softcap=3.0), dict(causal=False), dict(window=40, softcap=50.0),
         dict(scale=0.3))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_paged_attention_dense_decode(rng, kernel_kind, dtype, kv_dtype):
    """One query per sequence (q_starts = arange(n + 1)), ragged lengths from 1 to past a few key blocks, pages of
    16 and 7 keys, GQA groups of 4 and 1; causal, window, softcap, non-causal, a given scale."""
    for page_size, q_heads in ((16, 8), (7, 2)):
        _check(rng, dtype, kv_dtype, [1, 37, 150, 66], [1, 1, 1, 1], q_heads=q_heads, page_size=page_size,
               cases=CASES)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_paged_attention_packed_prefill_chunks_and_decode(rng, kernel_kind, dtype, kv_dtype):
    """One call of mixed rows: a prefill chunk of 7 tokens ending at position 39, a decode token, a sequence with no
    query this step, a whole prefill of 20 tokens (more GQA rows than a row block), a decode token at position 0, a
    dense chunk s = 3; pages shared by sequences 0 and 1."""
    _check(rng, dtype, kv_dtype, [40, 150, 30, 20, 1, 70], [7, 1, 0, 20, 1, 3], q_heads=8, cases=CASES)


def test_paged_attention_head_dims_and_dense_chunks(rng, kernel_kind):
    """head_dim 40 (not whole vectors) and 8; a dense step of s = 5 queries each (q_starts = arange(n + 1) * 5); one
    k/v head, GQA of 6; fp32 and int8."""
    for kv_dtype in (None, "int8"):
        _check(rng, np.float32, kv_dtype, [8, 70, 20], [5, 5, 5], q_heads=6, kv_heads=1, head_dim=40, page_size=8,
               cases=(dict(), dict(window=2, softcap=4.0)))
        _check(rng, np.float32, kv_dtype, [3, 33], [2, 1], q_heads=2, head_dim=8, page_size=4, cases=CASES)


def test_paged_attention_rows_that_see_no_key_give_zero(rng, kernel_kind):
    """window=0 leaves every query without a key: zeros (not NaN); a sequence of no keys and no queries, rows of q
    past the last sequence's: zeros; a call of no rows."""
    q, stores, table, seq_lens, q_starts = _check(rng, np.float32, None, [4, 9], [2, 2], q_heads=4)
    kw = dict(scale=0.125, softcap=None, causal=True, kv_dtype=None)
    o = nb.paged_attention(q, stores, table, 16, seq_lens, q_starts, window=0, **kw)
    assert np.all(o == 0)
    o = nb.paged_attention(q, stores, table, 16, np.array([4, 0]), np.array([0, 3, 3]), window=None, **kw)
    assert np.all(o[3:] == 0) and np.all(np.isfinite(o)) and np.any(o[:3] != 0)
    assert nb.paged_attention(q[:0], stores, table, 16, seq_lens, np.zeros(3, np.int64), window=None,
                              **kw).shape == (0, 4, 64)


def test_paged_attention_large_call_takes_the_parallel_kernel(rng, monkeypatch):
    """Under the default size rule a decode step over long sequences runs the parallel kernel, a small one the serial
    one; both against the oracle."""
    ran = _record_kernels(monkeypatch, ("paged_attention_serial", "paged_attention_parallel"))
    _check(rng, np.float32, "int8", [300, 280, 310, 290], [1, 1, 1, 1], q_heads=8)
    _check(rng, np.float32, None, [3, 5], [1, 1], q_heads=2)
    assert ran == ["paged_attention_parallel", "paged_attention_serial"]


# -- the kernels' bodies as plain Python (small inputs: what NUMBA_DISABLE_JIT runs; coverage sees them) -----------
@pytest.fixture
def pure_python(monkeypatch):
    for name in KERNELS:
        monkeypatch.setattr(kernels, name, getattr(kernels, name).py_func)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernels_in_pure_python(rng, monkeypatch, pure_python, dtype):
    spec = rotary.RopeSpec(20, rotary_dim=12, layout="interleaved")
    for kv_dtype in (None, "int8"):
        for threshold in (1 << 62, 0):   # the serial and the parallel kernels' Python forms
            monkeypatch.setattr(numba_runtime, "PARALLEL_MIN_ELEMENTS", threshold)
            monkeypatch.setattr(numba_runtime, "PARALLEL_MIN_TOKENS", threshold)
            monkeypatch.setattr(numba_kv, "ATTENTION_PARALLEL_MIN_WORK", threshold)
            monkeypatch.setattr(numba_runtime, "DECODE_KERNEL", "parallel")
            k, v = _kv(rng, dtype, 5, 2, 20, strided=True)
            _assert_same_bits(*_append_both(spec, k, v, [1, 9, 3, 4, 0], [4, -1, 2, 1, 7], kv_dtype, pool=8))
            _check(rng, dtype, kv_dtype, [3, 6], [2, 1], q_heads=2, kv_heads=1, head_dim=20, page_size=4,
                   cases=(dict(softcap=5.0),))


# -- module surface --------------------------------------------------------------------------------------------
def test_module_surface():
    assert nb.VARIANTS == numba_kv.VARIANTS == {"append_kv": (None, "int8"), "paged_attention": (None, "int8")}
    assert nb.append_kv is numba_kv.append_kv and nb.paged_attention is numba_kv.paged_attention
    assert not hasattr(nb, "cache_attention") and not hasattr(nb, "KV_DTYPES")
    for capability in ("append_kv", "paged_attention"):
        assert supports(nb, capability, "int8", any_variant=False)
        assert not supports(nb, capability, "float8_e4m3", any_variant=False)
    for kernel in (getattr(kernels, name) for name in KERNELS):
        assert type(kernel._cache).__name__ != "NullCache"   # cache=True
        assert kernel.targetoptions.get("error_model") == "numpy" and not kernel.targetoptions.get("fastmath")
    from rotary.backends import numba_kernels

    assert "kv_cache.py" in numba_kernels.KERNEL_FILES and "rotation.py" in numba_kernels.HELPER_FILES


def test_formats_not_offered_are_refused(rng):
    """float8_e4m3 (and a name of no format) is refused with a ValueError naming kv_dtype, before anything is
    written: that format takes the reference (kv_entries)."""
    stores = _stores(None, np.float32, 4, 1, 8)
    k = rng.standard_normal((2, 1, 8)).astype(np.float32)
    cos, sin, rows = _tables_for(rotary.RopeSpec(8), [0, 1], np.float32)
    for kv_dtype in ("float8_e4m3", "int4"):
        with pytest.raises(ValueError, match="kv_dtype"):
            nb.append_kv(k, k, cos, sin, rows, np.array([0, 1]), stores, rotary_dim=8, layout="half", offset=0,
                         kv_dtype=kv_dtype)
        with pytest.raises(ValueError, match="kv_dtype"):
            nb.paged_attention(k, stores, np.zeros((1, 1), np.int64), 4, np.array([2]), np.array([0, 2]), scale=1.0,
                               softcap=None, window=None, causal=True, kv_dtype=kv_dtype)
    _assert_same_bits(stores, _stores(None, np.float32, 4, 1, 8))


def test_helpers_match_their_python_forms():
    """load_as / vload_as / vsum_pairwise compiled against their Python forms, for every entry dtype."""
    import numba

    from rotary.backends.numba_kernels import simd

    @numba.njit
    def compiled(buf, like, i):
        return kernels.load_as(buf, i, like), simd.vsum_pairwise(kernels.vload_as(buf, i, like))

    like32, like64 = np.zeros(1, np.float32), np.zeros(1, np.float64)
    for buf in (np.arange(-40, 40, dtype=np.int8), (np.arange(80) * 0.37 - 9).astype(np.float16).view(np.uint16),
                np.linspace(-3, 5, 80).astype(np.float32), np.linspace(-3, 5, 80)):
        for like in (like32, like64):
            if buf.dtype == np.float64 and like is like32:
                continue
            got = compiled(buf, like, 3)
            want = (kernels.load_as(buf, 3, like), simd.vsum_pairwise(kernels.vload_as(buf, 3, like)))
            assert got[0] == want[0] and abs(got[1] - want[1]) <= 1e-6 * max(1.0, abs(want[1])), (buf.dtype, like.dtype)


_NRT_BALANCE_PROBE = """
import numpy as np, rotary
from numba.core.runtime import rtsys
from rotary.backends import numba as nb, numba_kv, numba_runtime as rt
from rotary.spec import tables
rng = np.random.default_rng(0)
spec = rotary.RopeSpec(64)
k = rng.standard_normal((4, 2, 64)).astype(np.float32)
q = rng.standard_normal((5, 4, 64)).astype(np.float32)
cos, sin, rows = tables.lookup(spec, np.arange(4)[None], dtype=np.float32)
rows = rows.reshape(-1)
slots = np.array([3, -1, 40, 7])
table = np.arange(12, dtype=np.int64).reshape(4, 3)   # pages of 16 keys
seq_lens, q_starts = np.array([30, 20, 5, 1]), np.array([0, 2, 3, 3, 5])
pools = {kv: [np.zeros((192, 2, 64), np.int8 if kv else np.float32) for _ in range(2)]
             + [np.zeros((192, 2), np.float32) if kv else None for _ in range(2)] for kv in (None, "int8")}

def calls():
    for kv, stores in pools.items():
        for threshold in (0, 1 << 62):   # the parallel and the serial kernels
            rt.PARALLEL_MIN_ELEMENTS = rt.PARALLEL_MIN_TOKENS = numba_kv.ATTENTION_PARALLEL_MIN_WORK = threshold
            rt.DECODE_KERNEL = "parallel"
            nb.append_kv(k, k, cos, sin, rows, slots, stores, rotary_dim=64, layout="half", offset=0, kv_dtype=kv)
            nb.paged_attention(q, stores, table, 16, seq_lens, q_starts, scale=0.125, softcap=None, window=None,
                               causal=True, kv_dtype=kv)

calls()
before = rtsys.get_allocation_stats()
for _ in range(30):
    calls()
after = rtsys.get_allocation_stats()
print(after.alloc - after.free - (before.alloc - before.free), after.mi_alloc - after.mi_free - (before.mi_alloc - before.mi_free))
"""


def test_kernels_release_every_allocation():
    """NUMBA_NRT_STATS=1: appends (float and int8: a work buffer per token; padding tokens) and attention (buffers
    per task; a sequence without queries), serial and parallel, free every allocation they make."""
    env = dict(os.environ, NUMBA_NRT_STATS="1")
    out = subprocess.run([sys.executable, "-c", _NRT_BALANCE_PROBE], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["0", "0"], out.stdout
