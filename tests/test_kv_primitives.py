"""rotary.kv_append and rotary.paged_attention over caller-owned pools and tables, one backend-contract grid
over every backend (NumPy reference, Numba, the CUDA kernels on the host shim), against float64 oracles: keys
rotated by complex multiplication (rope_complex), entries dequantized by the formulas written out here,
attention as an explicit masked softmax. Tables in vLLM's, FlashInfer's and flash-attn's conventions, padding
slots, pages shared by two sequences, dense decode and packed mixed steps; bad calls raise the same error on
every backend and leave the pools bit for bit unchanged."""

from __future__ import annotations

import numpy as np
import pytest

import rotary
from rotary.backends import kv_entries
from rotary.kvcache.tables import block_table_from_csr, slots_from_block_table
from rotary.testing import dequantize64, paged_attention64, rope_complex

from .conftest import backend_params
from .test_kv_engine_cache import assert_state, state

BACKENDS = [p for p in backend_params() if p.values[0] != "cupy"] + ["cuda-shim"]
FORMATS = [None, "int8", "float8_e4m3"]
#: attention's error against the float64 oracle, relative to max |o|: the work dtype's summation and exp, plus
#: the rounding of the entries themselves for fp16 (and the format's for quantized pools, see entry_error)
ATTENTION_TOL = {np.float64: 1e-12, np.float32: 2e-6, np.float16: 2e-3}


@pytest.fixture
def backend(request, monkeypatch):
    """A backend name for rotary's calls; "cuda-shim" registers the CUDA kernels on the host shim."""
    name = request.param
    if name == "cuda-shim":
        shim = pytest.importorskip("tests.cuda_shim.kv_backend")
        shim.register(monkeypatch)
    return name


def grid(fn):
    return pytest.mark.parametrize("backend", BACKENDS, indirect=True)(fn)


def inv_freq64(rotary_dim, base):
    return base ** (-np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)


def oracle_rotate(x, positions, spec):
    """float64 keys (T, H, D) rotated at positions (T,) by complex multiplication (the spec's base, layout,
    rotary_dim and offset; no scaling rule)."""
    x = np.asarray(x, np.float64).transpose(1, 0, 2)
    y = rope_complex(x, np.asarray(positions), inv_freq64(spec.rotary_dim, spec.base), layout=spec.layout,
                     rotary_offset=spec.rotary_offset)
    return y.transpose(1, 0, 2)


def make_pools(rng, num_pages, page_size, heads, head_dim, dtype, kv_dtype):
    """Pools (and scales) filled with garbage: an append must write its slots only."""
    shape = (num_pages, page_size, heads, head_dim)
    entry = kv_entries.entry_dtype(kv_dtype, dtype)
    if kv_dtype is None:
        pools = [rng.standard_normal(shape).astype(dtype) for _ in range(2)]
    else:
        pools = [rng.integers(0, 100, shape).astype(entry) for _ in range(2)]
    work = np.float64 if np.dtype(dtype) == np.float64 else np.float32
    scales = None if kv_dtype is None else tuple(rng.random(shape[:3]).astype(work) for _ in range(2))
    return pools[0], pools[1], scales


def copies(k_pool, v_pool, scales):
    return k_pool.copy(), v_pool.copy(), None if scales is None else tuple(s.copy() for s in scales)


def entry_error(kv_dtype, dtype, amax):
    """Bound on |stored - exact| per value: the format's rounding (KV_FORMATS' rel_error of the row's amax) or the
    float dtype's half ulp, plus the work rounding (float64: the oracle's own angles, p * theta formed in float64
    at positions up to 5000, lose ~1e-12)."""
    fmt = kv_entries.KV_FORMATS[kv_dtype]
    work_eps = 1e-12 if np.dtype(dtype) == np.float64 else 4e-7
    if fmt.limit is None:
        return amax * (np.finfo(dtype).eps if np.dtype(dtype) != np.float64 else 0) + amax * work_eps
    return amax * (fmt.rel_error + 8 * work_eps)


def skip_unsupported(dtype, kv_dtype):
    if kv_dtype == "float8_e4m3":
        pytest.importorskip("ml_dtypes")
        if np.dtype(dtype) == np.float64:
            pytest.skip("float8 entries are rounded from float32 work values")


# -- kv_append --------------------------------------------------------------------------------------------------
def offered(backend, kv_dtype, capability, call):
    """False (after checking that ``call`` raises NotImplementedError naming the format) when the named backend
    does not offer ``kv_dtype``: such a backend refuses it as pick_backend does."""
    if backend == "numpy" or not rotary.available_backends().get(backend, (True,))[0]:
        return True
    from rotary import backends as registry

    if registry.supports(registry.get(backend), capability, kv_dtype, any_variant=False):
        return True
    with pytest.raises(NotImplementedError, match=f"has no {capability} for kv_dtype={kv_dtype!r}"):
        call()
    return False


@grid
@pytest.mark.parametrize("kv_dtype", FORMATS, ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
@pytest.mark.parametrize("spec", [dict(layout="half"), dict(layout="interleaved", rotary_dim=16, rotary_offset=6)],
                         ids=["half", "interleaved-partial-offset"])
def test_kv_append_against_the_oracle(backend, kv_dtype, dtype, spec, rng):
    """vLLM's slot_mapping with padding tokens (-1): every written slot within the format's rounding of the
    float64 rotated key / value, every other slot of the pools (and scales) bit for bit as it was."""
    skip_unsupported(dtype, kv_dtype)
    spec = rotary.RopeSpec(32, base=1000.0, **spec)
    T, H = 11, 2
    k_pool, v_pool, scales = make_pools(rng, 6, 4, H, 32, dtype, kv_dtype)
    before = copies(k_pool, v_pool, scales)
    k = rng.standard_normal((T, H, 32)).astype(dtype)
    v = (rng.standard_normal((T, H, 32)) * 3).astype(dtype)
    slots = rng.permutation(24)[:T]
    slots[[2, 7]] = -1
    positions = rng.integers(0, 5000, T)

    def call():
        rotary.kv_append(k, v, k_pool, v_pool, slots, positions, spec=spec, scales=scales, kv_dtype=kv_dtype,
                         backend=backend)

    if not offered(backend, kv_dtype, "append_kv", call):
        return
    call()
    real = slots >= 0
    want_k, want_v = oracle_rotate(k, positions, spec)[real], np.asarray(v, np.float64)[real]
    flat = lambda a: a.reshape((-1,) + a.shape[2:])   # noqa: E731
    got_scales = (None, None) if scales is None else (flat(scales[0]), flat(scales[1]))
    for pool, scale, want in ((k_pool, got_scales[0], want_k), (v_pool, got_scales[1], want_v)):
        got = dequantize64(flat(pool)[slots[real]], None if scale is None else scale[slots[real]], kv_dtype)
        amax = np.abs(want).max(axis=-1, keepdims=True)
        assert np.all(np.abs(got - want) <= entry_error(kv_dtype, dtype, amax) + 1e-300)
    untouched = np.setdiff1d(np.arange(24), slots[real])
    for a, b in zip((k_pool, v_pool) + (scales or ()), before[:2] + (before[2] or ())):
        np.testing.assert_array_equal(flat(a)[untouched].view(np.uint8), flat(b)[untouched].view(np.uint8))


@grid
@pytest.mark.parametrize("kv_dtype", FORMATS, ids=str)
def test_kv_append_is_the_reference_bit_for_bit(backend, kv_dtype, rng):
    """Every backend writes the NumPy reference's bits (the one rounding contract: no fused multiply-add)."""
    skip_unsupported(np.float32, kv_dtype)
    spec = rotary.RopeSpec(64, base=10000.0, layout="interleaved")
    k = rng.standard_normal((9, 3, 64)).astype(np.float32)
    v = rng.standard_normal((9, 3, 64)).astype(np.float32)
    slots = np.array([5, -1, 0, 17, 3, 9, -1, 12, 1])
    positions = np.array([0, 1, 70000, 3, 123456, 5, 6, 7, 2 ** 30])
    pools = [make_pools(np.random.default_rng(7), 5, 4, 3, 64, np.float32, kv_dtype) for _ in range(2)]
    for (k_pool, v_pool, scales), name in zip(pools, (backend, "numpy")):
        if not offered(name, kv_dtype, "append_kv", lambda: rotary.kv_append(
                k, v, k_pool, v_pool, slots, positions, spec=spec, scales=scales, kv_dtype=kv_dtype, backend=name)):
            return
        rotary.kv_append(k, v[::1], k_pool, v_pool, slots, positions, spec=spec, scales=scales, kv_dtype=kv_dtype,
                         backend=name)
    for a, b in zip(pools[0][:2] + (pools[0][2] or ()), pools[1][:2] + (pools[1][2] or ())):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


@grid
def test_kv_append_decode_loop_of_one_geometry(backend, rng):
    """Calls of one geometry (a plan's; Numba moves the last prepared append to each call's slots and positions)
    at new slots and positions every call, consecutive, then far past the dense table and back: every token's key
    is its own rotated key, within float32 rounding of the float64 oracle."""
    spec = rotary.RopeSpec(32, base=10000.0)
    B, H = 4, 2
    k_pool, v_pool, _ = make_pools(rng, 16, 4, H, 32, np.float32, None)
    positions = np.array([3, 9, 0, 17])
    written = []
    for step in range(12):
        if step == 8:
            positions = positions + 70000   # (another table), then back
        if step == 10:
            positions = positions - 70000
        k = rng.standard_normal((B, H, 32)).astype(np.float32)
        v = rng.standard_normal((B, H, 32)).astype(np.float32)
        slots = np.arange(B) * 16 + step
        rotary.kv_append(k, v, k_pool, v_pool, slots, positions, spec=spec, backend=backend)
        written.append((slots, oracle_rotate(k, positions, spec), v))
        positions = positions + 1
    for slots, want_k, v in written:
        np.testing.assert_allclose(k_pool.reshape(64, H, 32)[slots], want_k, rtol=0, atol=4e-6)
        np.testing.assert_array_equal(v_pool.reshape(64, H, 32)[slots], v)


@grid
def test_kv_append_strided_inputs_and_multi_axis_positions(backend, rng):
    """k and v as strided views (heads reversed, every other token), and M-RoPE (tokens, 3) positions."""
    spec = rotary.RopeSpec(32, mrope_section=(4, 6, 6), base=10000.0)
    base = rng.standard_normal((16, 4, 32)).astype(np.float32)
    k, v = base[::2, ::-2], base[1::2, ::2]
    k_pool, v_pool, _ = make_pools(rng, 4, 4, 2, 32, np.float32, None)
    slots = np.arange(8)[::-1].copy()
    pos = rng.integers(0, 100, (8, 3))
    rotary.kv_append(k, v, k_pool, v_pool, slots, pos, spec=spec, backend=backend)
    want = rotary.apply(np.ascontiguousarray(k), pos, spec=spec, seq_axis=0)
    np.testing.assert_allclose(k_pool.reshape(16, 2, 32)[slots], want, rtol=0, atol=2e-6)
    np.testing.assert_array_equal(v_pool.reshape(16, 2, 32)[slots], v)


# -- paged_attention ----------------------------------------------------------------------------------------------
def filled(rng, backend, *, dtype, kv_dtype, spec, page_size=4, num_pages=24, lens=(11, 6, 1, 13), shared=True):
    """Pools written by kv_append through a block table (sequences 0 and 1 share their first page: 1 is a fork
    of 0's first page_size tokens), and the table and lengths."""
    n, H = len(lens), 2
    k_pool, v_pool, scales = make_pools(rng, num_pages, page_size, H, 32, dtype, kv_dtype)
    width = -(-max(lens) // page_size)
    pages = rng.permutation(num_pages)
    table = np.full((n, width), -1, np.int64)
    used = 0
    for i, L in enumerate(lens):
        m = -(-L // page_size)
        table[i, :m] = pages[used:used + m]
        used += m
    if shared:
        table[1, 0] = table[0, 0]
    written = set()
    for i, L in enumerate(lens):
        pos = np.arange(L)
        slots = slots_from_block_table(table, np.full(L, i), pos, page_size)
        keep = np.array([s not in written for s in slots.tolist()])
        written.update(slots.tolist())
        k = rng.standard_normal((L, H, 32)).astype(dtype)
        v = rng.standard_normal((L, H, 32)).astype(dtype)
        rotary.kv_append(k, v, k_pool, v_pool, np.where(keep, slots, -1), pos, spec=spec, scales=scales,
                         kv_dtype=kv_dtype, backend=backend)
    return k_pool, v_pool, scales, table, np.array(lens, np.int64)


def oracle_paged(q, counts, k_pool, v_pool, scales, table, lens, kv_dtype, spec, *, scale, causal=True, window=None,
                 softcap=None, q_positions=None):
    """float64 attention of packed q (T, Hq, D), rotated here by complex multiplication at each sequence's last
    positions (or q_positions; not at all without a spec), over keys read through the block table:
    :func:`rotary.testing.paged_attention64`."""
    counts, lens = np.asarray(counts), np.asarray(lens)
    starts = np.concatenate([[0], np.cumsum(counts)])
    if spec is not None:
        pos = np.concatenate([np.arange(L - c, L) for L, c in zip(lens.tolist(), counts.tolist())]) \
            if q_positions is None else np.asarray(q_positions)
        q = oracle_rotate(q, pos, spec)
    flat = lambda a: None if a is None else a.reshape((-1,) + a.shape[2:])   # noqa: E731
    stores = (flat(k_pool), flat(v_pool)) + ((None, None) if scales is None else (flat(scales[0]), flat(scales[1])))
    return paged_attention64(q, stores, table, k_pool.shape[1], lens, starts, scale=scale, softcap=softcap,
                             window=window, causal=causal, kv_dtype=kv_dtype)


CASES = {   # name: (queries per sequence, attention keywords)
    "decode": ((1, 1, 1, 1), {}),
    "mixed": ((5, 1, 1, 3), {}),
    "window-softcap": ((3, 2, 1, 1), dict(window=4, softcap=3.0, scale=0.3)),
    "noncausal": ((2, 1, 1, 4), dict(causal=False)),
}


@grid
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kv_dtype", FORMATS, ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_paged_attention_against_the_oracle(backend, case, kv_dtype, dtype, rng):
    """Packed q (cu_seqlens) over pages where they lie, two sequences sharing a page, GQA 8:2; dense (n, s, ...) q
    for equal counts."""
    skip_unsupported(dtype, kv_dtype)
    spec = rotary.RopeSpec(32, base=500.0, layout="interleaved", rotary_dim=24)
    k_pool, v_pool, scales, table, lens = filled(rng, "numpy", dtype=dtype, kv_dtype=kv_dtype, spec=spec)
    counts, kw = CASES[case]
    counts = np.array(counts)
    q = rng.standard_normal((int(counts.sum()), 8, 32)).astype(dtype)
    cu = np.concatenate([[0], np.cumsum(counts)])

    def call():
        return rotary.paged_attention(q, k_pool, v_pool, table, lens, spec=spec, cu_seqlens=cu, scales=scales,
                                      kv_dtype=kv_dtype, backend=backend, **kw)

    if not offered(backend, kv_dtype, "paged_attention", call):
        return
    o = call()
    assert type(o) is np.ndarray and o.dtype == q.dtype and o.shape == q.shape
    scale = kw.pop("scale", 32 ** -0.5)
    want = oracle_paged(q, counts, k_pool, v_pool, scales, table, lens, kv_dtype, spec, scale=scale, **kw)
    err = np.abs(o.astype(np.float64) - want).max() / np.abs(want).max()
    assert err <= ATTENTION_TOL[dtype], f"relative error {err:.3g}"
    if case == "decode":   # the dense form gives the same bits
        dense = rotary.paged_attention(q.reshape(4, 1, 8, 32), k_pool, v_pool, table, lens, spec=spec,
                                       scales=scales, kv_dtype=kv_dtype, backend=backend, **CASES[case][1])
        np.testing.assert_array_equal(dense.reshape(q.shape), o)


@grid
def test_paged_attention_of_rotated_queries_and_given_positions(backend, rng):
    """spec=None: q taken as already rotated; q_positions: q rotated where the caller says (the mask still at the
    sequence's last positions)."""
    spec = rotary.RopeSpec(32, base=500.0)
    k_pool, v_pool, scales, table, lens = filled(rng, "numpy", dtype=np.float32, kv_dtype=None, spec=spec)
    counts = np.array([2, 1, 1, 1])
    q = rng.standard_normal((5, 2, 32)).astype(np.float32)
    cu = np.concatenate([[0], np.cumsum(counts)])
    o = rotary.paged_attention(q, k_pool, v_pool, table, lens, cu_seqlens=cu, backend=backend)
    want = oracle_paged(q, counts, k_pool, v_pool, None, table, lens, None, None, scale=32 ** -0.5)
    np.testing.assert_allclose(o, want, rtol=0, atol=2e-6 * np.abs(want).max())
    qpos = np.array([100, 7, 3, 0, 50])
    o = rotary.paged_attention(q, k_pool, v_pool, table, lens, cu_seqlens=cu, spec=spec, q_positions=qpos,
                               backend=backend)
    want = oracle_paged(q, counts, k_pool, v_pool, None, table, lens, None, spec, scale=32 ** -0.5, q_positions=qpos)
    np.testing.assert_allclose(o, want, rtol=0, atol=2e-6 * np.abs(want).max())


# -- engines' tables ----------------------------------------------------------------------------------------------
@grid
def test_flashinfer_csr_tables_and_append(backend, rng):
    """FlashInfer's (kv_indptr, kv_indices, kv_last_page_len) page table and its append's (batch_indices,
    positions): converted by block_table_from_csr / slots_from_block_table, the same attention as the oracle."""
    spec = rotary.RopeSpec(32, base=10000.0)
    ps, H = 4, 2
    k_pool, v_pool, _ = make_pools(rng, 12, ps, H, 32, np.float32, None)
    kv_indptr, kv_indices, last = np.array([0, 3, 4, 6]), np.array([7, 2, 9, 0, 11, 5]), np.array([2, 4, 1])
    table, seq_lens = block_table_from_csr(kv_indptr, kv_indices, last, ps)
    assert seq_lens.tolist() == [10, 4, 5] and table.tolist() == [[7, 2, 9], [0, -1, -1], [11, 5, -1]]
    batch_indices = np.repeat(np.arange(3), seq_lens)
    positions = np.concatenate([np.arange(n) for n in seq_lens])
    k = rng.standard_normal((positions.size, H, 32)).astype(np.float32)
    v = rng.standard_normal((positions.size, H, 32)).astype(np.float32)
    slots = slots_from_block_table(table, batch_indices, positions, ps)
    rotary.kv_append(k, v, k_pool, v_pool, slots, positions, spec=spec, backend=backend)
    q = rng.standard_normal((3, 1, 4, 32)).astype(np.float32)
    o = rotary.paged_attention(q, k_pool, v_pool, table, seq_lens, spec=spec, backend=backend)
    want = oracle_paged(q.reshape(3, 4, 32), np.ones(3, int), k_pool, v_pool, None, table, seq_lens, None, spec,
                        scale=32 ** -0.5)
    np.testing.assert_allclose(o.reshape(3, 4, 32), want, rtol=0, atol=2e-6 * np.abs(want).max())


@grid
def test_flash_attn_block_table_and_cache_seqlens(backend, rng):
    """flash-attn's decode: block_table (batch, max_pages) and cache_seqlens (lengths before the new token); the new
    k, v written at position cache_seqlens[b], attention with seq_lens = cache_seqlens + 1. Padding batch rows
    (vLLM's -1 slots) are skipped."""
    spec = rotary.RopeSpec(32, base=10000.0, layout="interleaved")
    ps, H = 8, 1
    k_pool, v_pool, _ = make_pools(rng, 10, ps, H, 32, np.float64, None)
    table = np.array([[3, 1, 0], [4, 9, 2], [5, 6, 7]])
    cache_seqlens = np.array([9, 0, 17])
    for b, n in enumerate(cache_seqlens):   # what the cache already held
        if n:
            pos = np.arange(n)
            rotary.kv_append(rng.standard_normal((n, H, 32)), rng.standard_normal((n, H, 32)), k_pool, v_pool,
                             slots_from_block_table(table, np.full(n, b), pos, ps), pos, spec=spec, backend=backend)
    k_new, v_new = rng.standard_normal((4, H, 32)), rng.standard_normal((4, H, 32))
    seq = np.array([0, 1, 2, -1])   # a padding row
    slots = slots_from_block_table(table, seq, np.append(cache_seqlens, 0), ps)
    assert slots[-1] == -1
    before = k_pool.copy()
    rotary.kv_append(k_new, v_new, k_pool, v_pool, slots, np.append(cache_seqlens, 0), spec=spec, backend=backend)
    changed = np.flatnonzero(np.any(k_pool.reshape(80, -1) != before.reshape(80, -1), axis=1))
    assert sorted(changed.tolist()) == sorted(slots[:3].tolist())
    q = rng.standard_normal((3, 1, 2, 32))
    o = rotary.paged_attention(q, k_pool, v_pool, table, cache_seqlens + 1, spec=spec, backend=backend)
    want = oracle_paged(q.reshape(3, 2, 32), np.ones(3, int), k_pool, v_pool, None, table, cache_seqlens + 1, None,
                        spec, scale=32 ** -0.5)
    np.testing.assert_allclose(o.reshape(3, 2, 32), want, rtol=0, atol=1e-12 * np.abs(want).max())


# -- errors --------------------------------------------------------------------------------------------------------
def _call_append(k_pool, v_pool, k, spec, **kw):
    args = dict(slots=np.arange(k.shape[0]), positions=np.arange(k.shape[0]), spec=spec)
    args.update(kw)
    rotary.kv_append(k, k.copy(), k_pool, v_pool, **args)


APPEND_ERRORS = [
    (lambda kp, vp, k, s, b: _call_append(kp, vp, kp[0, :2], s, backend=b), ValueError, "k shares memory with k_pool"),
    (lambda kp, vp, k, s, b: rotary.kv_append(k, vp[1, :3], kp, vp, np.arange(3), np.arange(3), spec=s, backend=b),
     ValueError, "v shares memory with v_pool"),
    (lambda kp, vp, k, s, b: _call_append(kp, kp, k, s, backend=b), ValueError, "k_pool and v_pool share memory"),
    (lambda kp, vp, k, s, b: _call_append(kp, vp, k, s, slots=np.array([0, 40, 1]), backend=b), ValueError,
     r"slots\[1\] = 40 is outside the pools' 32 slots"),
    (lambda kp, vp, k, s, b: _call_append(kp, vp, k, s, slots=np.array([0, -2, 1]), backend=b), ValueError,
     r"slots\[1\] = -2"),
    (lambda kp, vp, k, s, b: _call_append(kp, vp, k, s, slots=np.array([4, 2, 4]), backend=b), ValueError,
     "must not repeat"),
    (lambda kp, vp, k, s, b: _call_append(kp, vp, k, s, slots=np.arange(2), backend=b), ValueError,
     r"slots must have shape \(3,\)"),
    (lambda kp, vp, k, s, b: _call_append(kp, vp, k, s, slots=[0.0, 1.0, 2.0], backend=b), TypeError,
     "slots must have an integer dtype"),
    (lambda kp, vp, k, s, b: _call_append(kp, vp, k, s, positions=np.arange(4), backend=b), ValueError,
     r"positions must have shape \(3,\)"),
    (lambda kp, vp, k, s, b: _call_append(kp, vp, k.astype(np.float64), s, backend=b), TypeError,
     "k_pool has dtype float32; k's dtype is float64"),
    (lambda kp, vp, k, s, b: _call_append(kp, vp, k[:, :1], s, backend=b), ValueError, "k has 1 heads, the pools 2"),
    (lambda kp, vp, k, s, b: _call_append(kp, vp, k, s, kv_dtype="int8", backend=b), TypeError,
     "k_pool has dtype float32; the entries of kv_dtype='int8' is int8"),
    (lambda kp, vp, k, s, b: _call_append(kp, vp, k, s, kv_dtype="int4", backend=b), ValueError,
     "kv_dtype must be one of"),
    (lambda kp, vp, k, s, b: _call_append(kp, vp, k, s, scales=(kp[..., 0], vp[..., 0]), backend=b), ValueError,
     "scales= goes with a quantized kv_dtype"),
    (lambda kp, vp, k, s, b: _call_append(kp[:, :, :, :8], vp, k, s, backend=b), ValueError,
     "v_pool .* must have k_pool's shape"),
    (lambda kp, vp, k, s, b: _call_append(kp.transpose(1, 0, 2, 3), vp.transpose(1, 0, 2, 3), k, s, backend=b),
     ValueError, "k_pool must be C-contiguous"),
    (lambda kp, vp, k, s, b: _call_append(kp, vp, k, None, backend=b), TypeError, "spec must be"),
    (lambda kp, vp, k, s, b: _call_append(kp, vp, k, rotary.RopeSpec(8), backend=b), ValueError,
     r"spec.head_dim \(8\) does not match k.shape\[-1\] \(16\)"),
]


@grid
@pytest.mark.parametrize("call, error, match", APPEND_ERRORS)
def test_bad_appends_raise_naming_the_argument_and_write_nothing(backend, call, error, match, rng):
    """The same error on every backend, raised before a byte of the pools changes."""
    spec = rotary.RopeSpec(16)
    k_pool, v_pool, _ = make_pools(rng, 8, 4, 2, 16, np.float32, None)
    k = rng.standard_normal((3, 2, 16)).astype(np.float32)
    before = k_pool.copy(), v_pool.copy()
    with pytest.raises(error, match=match):
        call(k_pool, v_pool, k, spec, backend)
    np.testing.assert_array_equal(k_pool.view(np.uint8), before[0].view(np.uint8))
    np.testing.assert_array_equal(v_pool.view(np.uint8), before[1].view(np.uint8))


def test_read_only_pools_and_named_backends_without_a_format(rng):
    spec = rotary.RopeSpec(16)
    k_pool, v_pool, _ = make_pools(rng, 8, 4, 2, 16, np.float32, None)
    k = rng.standard_normal((3, 2, 16)).astype(np.float32)
    k_pool.flags.writeable = False
    with pytest.raises(ValueError, match="k_pool is read-only"):
        _call_append(k_pool, v_pool, k, spec)
    if rotary.available_backends()["numba"][0]:
        pools = make_pools(rng, 8, 4, 2, 16, np.float32, "float8_e4m3")
        with pytest.raises(NotImplementedError, match="'numba' has no append_kv for kv_dtype='float8_e4m3'"):
            _call_append(pools[0], pools[1], k, spec, scales=pools[2], kv_dtype="float8_e4m3", backend="numba")


ATTENTION_ERRORS = [
    (dict(seq_lens=np.array([3, 40])), ValueError, r"seq_lens\[1\] = 40 needs more than the block table's 2 pages"),
    (dict(seq_lens=np.array([0, 4])), ValueError, "q has 1 tokens for sequence 0, which holds 0"),
    (dict(block_table=np.array([[0, 1], [2, 99]])), ValueError, r"block_table\[1, 1\] = 99 is not a page of the pool"),
    (dict(block_table=np.array([[0, -1], [2, 3]]), seq_lens=np.array([5, 5])), ValueError, r"block_table\[0, 1\] = -1"),
    (dict(seq_lens=np.array([3])), ValueError, r"seq_lens must have shape \(2,\)"),
    (dict(q=np.zeros((2, 1, 3, 16), np.float32)), ValueError, "q heads .3. must be a multiple of the pools' kv_heads"),
    (dict(q=np.zeros((2, 16), np.float32)), ValueError, "q must be 4-D"),
    (dict(window=0), ValueError, "window must be > 0"),
    (dict(window=2, causal=False), ValueError, "window .* needs causal=True"),
    (dict(softcap=-1.0), ValueError, "softcap must be > 0"),
    (dict(causal=1), TypeError, "causal must be a bool"),
    (dict(softcap=1e39), ValueError, r"softcap=1e\+39 does not fit float32"),
    (dict(softcap=1e-46), ValueError, "softcap=1e-46 does not fit float32"),
    (dict(q_positions=np.arange(2)), ValueError, "q_positions goes with spec="),
]


@grid
@pytest.mark.parametrize("change, error, match", ATTENTION_ERRORS)
def test_bad_attention_calls_raise_naming_the_argument(backend, change, error, match, rng):
    k_pool, v_pool, _ = make_pools(rng, 4, 4, 2, 16, np.float32, None)
    args = dict(q=np.zeros((2, 1, 4, 16), np.float32), block_table=np.array([[0, 1], [2, 3]]),
                seq_lens=np.array([3, 5]))
    kw = {key: value for key, value in change.items() if key not in args}
    args.update({key: value for key, value in change.items() if key in args})
    with pytest.raises(error, match=match):
        rotary.paged_attention(args["q"], k_pool, v_pool, args["block_table"], args["seq_lens"], backend=backend, **kw)


# -- the cache over the primitives: defects of the thin owner -------------------------------------------------------
def small_cache(backend="auto", **kw):
    args = dict(batch=3, kv_heads=2, head_dim=16, page_size=4, num_pages=12)
    args.update(kw)
    return rotary.KVCache(rotary.RopeSpec(16, base=100.0), backend=backend, **args)


@grid
def test_cache_refuses_keys_that_are_views_of_its_own_pool(backend, rng):
    """Keys read from the cache's own pool and appended over the slots they live in: refused (Numba wrote wrong keys
    and values here before the plan checked memory), the cache bit for bit unchanged."""
    cache = small_cache(backend if backend != "cuda-shim" else "numpy", capacity=8, page_size=None, num_pages=None)
    k = rng.standard_normal((3, 4, 2, 16)).astype(np.float32)
    cache.append(k, k)
    snap = state(cache)
    own = cache.k_pool[:, :2]   # (3, 2, 2, 16): views of slots 0..1 of each sequence
    cache.free()
    snap = state(cache)
    with pytest.raises(ValueError, match="k shares memory with k_pool"):
        cache.append(own, own.copy())
    assert_state(cache, snap)


def test_cache_seq_ids_lists_and_zero_sequences(rng):
    cache = small_cache()
    k = rng.standard_normal((3, 2, 2, 16)).astype(np.float32)
    cache.append(k, k)
    snap = state(cache)
    cache.free([])
    cache.append(k[:0], k[:0], seq_ids=[])
    cache.slide(sinks=1, window=2, seq_ids=[])
    assert_state(cache, snap)
    o = rotary.attention(np.zeros((0, 1, 4, 16), np.float32), cache, seq_ids=[])
    assert o.shape == (0, 1, 4, 16)
    o = rotary.attention(np.zeros((0, 4, 16), np.float32), cache, seq_ids=[], cu_seqlens=[0])
    assert o.shape == (0, 4, 16)


@pytest.mark.parametrize("kw, error, match", [
    (dict(sinks=1.5, window=2), TypeError, "sinks must be an integer, got float 1.5"),
    (dict(sinks="1", window=2), TypeError, "sinks must be an integer, got str"),
    (dict(sinks=None, window=2), TypeError, "sinks must be an integer, got NoneType"),
    (dict(sinks=-1, window=2), ValueError, "sinks must be >= 0"),
    (dict(sinks=1, window=2.5), ValueError, "window must be a positive int"),
    (dict(sinks=1, window=True), ValueError, "window must be a positive int"),
])
def test_slide_arguments(kw, error, match, rng):
    cache = small_cache()
    k = rng.standard_normal((3, 6, 2, 16)).astype(np.float32)
    cache.append(k, k)
    snap = state(cache)
    with pytest.raises(error, match=match):
        cache.slide(**kw)
    assert_state(cache, snap)


@pytest.mark.parametrize("scaling", [dict(rope_type="dynamic", factor=2.0),
                                     dict(rope_type="longrope", short_factor=[1.0] * 8, long_factor=[2.0] * 8,
                                          original_max_position_embeddings=8)],
                         ids=["dynamic", "longrope"])
def test_slide_refuses_length_dependent_specs(scaling, rng):
    spec = rotary.RopeSpec(16, scaling=scaling, max_position_embeddings=16)
    cache = rotary.KVCache(spec, batch=1, kv_heads=1, head_dim=16, capacity=32)
    k = rng.standard_normal((1, 20, 1, 16)).astype(np.float32)
    cache.append(k, k)
    snap = state(cache)
    with pytest.raises(ValueError, match="depend on the sequence length"):
        cache.slide(sinks=2, window=4)
    assert_state(cache, snap)


def test_cache_errors_for_other_array_types_and_dtypes(rng):
    cache = small_cache()
    snap = state(cache)
    with pytest.raises(TypeError, match="k has dtype int32 but the cache holds float32: cast k to float32"):
        cache.append(np.zeros((3, 1, 2, 16), np.int32), np.zeros((3, 1, 2, 16), np.int32))
    torch = pytest.importorskip("torch")
    t = torch.zeros((3, 1, 2, 16))
    with pytest.raises(TypeError, match="k is a torch.Tensor; this cache holds numpy.ndarray arrays"):
        cache.append(t, t)
    assert_state(cache, snap)


@pytest.mark.parametrize("kv_dtype", [None, "int8"], ids=str)
def test_copies_and_pickles_are_independent_caches(kv_dtype, rng):
    import copy
    import pickle

    cache = small_cache(kv_dtype=kv_dtype)
    k = rng.standard_normal((3, 5, 2, 16)).astype(np.float32)
    cache.append(k, k)
    snap = state(cache)
    q = rng.standard_normal((2, 1, 4, 16)).astype(np.float32)
    for clone in (copy.copy(cache), copy.deepcopy(cache), pickle.loads(pickle.dumps(cache))):
        assert_state(clone, snap)
        twin = copy.deepcopy(cache)
        for c in (clone, twin):
            c.append(k[:, :1], k[:, :1])
            c.free([0])
        assert_state(cache, snap)   # the original untouched
        np.testing.assert_array_equal(rotary.attention(q, clone, seq_ids=[1, 2]),
                                      rotary.attention(q, twin, seq_ids=[1, 2]))


@grid
def test_pages_before_the_window_may_be_gone(backend, rng):
    """With a causal window, pages wholly before the first query's window are never read: an engine (or a windowed
    KVCache) gives them back and marks them -1; the result is the oracle's over the pages still held."""
    spec = rotary.RopeSpec(32, base=500.0)
    k_pool, v_pool, _, table, lens = filled(rng, "numpy", dtype=np.float32, kv_dtype=None, spec=spec,
                                            lens=(11, 6, 1, 13), shared=False)
    counts, window = np.array([1, 2, 1, 1]), 3
    gone = table.copy()
    for i, (L, c) in enumerate(zip(lens.tolist(), counts.tolist())):
        gone[i, :max(0, L - c - window + 1) // 4] = -1
    assert (gone == -1).sum() > (table == -1).sum()
    q = rng.standard_normal((int(counts.sum()), 8, 32)).astype(np.float32)
    cu = np.concatenate([[0], np.cumsum(counts)])
    o = rotary.paged_attention(q, k_pool, v_pool, gone, lens, spec=spec, cu_seqlens=cu, window=window,
                               backend=backend)
    want = oracle_paged(q, counts, k_pool, v_pool, None, table, lens, None, spec, scale=32 ** -0.5, window=window)
    np.testing.assert_allclose(o, want, rtol=0, atol=2e-6 * np.abs(want).max())
    with pytest.raises(ValueError, match="is not a page of the pool"):   # without the window they are read
        rotary.paged_attention(q, k_pool, v_pool, gone, lens, spec=spec, cu_seqlens=cu, backend=backend)
