"""rotary.KVCache against float64 oracles: appends (dense, ragged, packed; contiguous and paged), quantized entries,
attention over the cache, sliding with sinks, and errors that leave the cache unchanged."""


import numpy as np
import pytest

import rotary
from rotary.backends import kv_entries
from rotary.testing import rope_complex

from .conftest import backend_params

CPU_BACKENDS = [p for p in backend_params() if p.values[0] != "cupy"]
KINDS = [dict(capacity=24), dict(page_size=4, num_pages=40), dict(page_size=3, num_pages=40, capacity=20)]


def inv_freq64(rotary_dim, base=10000.0):
    """The default spec's frequencies, computed here (not by rotary): base^(-2i/rotary_dim)."""
    return base ** (-np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)


def oracle_keys(chunks, rotary_dim, layout="half", base=10000.0):
    """float64 rotated keys of one sequence from its appended chunks (each (s, H, D)), positions 0.."""
    k = np.concatenate([np.asarray(c, np.float64) for c in chunks])
    pos = np.arange(k.shape[0])
    return rope_complex(k.transpose(1, 0, 2), pos, inv_freq64(rotary_dim, base), layout=layout).transpose(1, 0, 2)


def oracle_attention(q, keys, values, q_pos, *, scale, causal=True, window=None, softcap=None):
    """float64 softmax attention of q (s, Hq, D) (already rotated) at positions q_pos over keys (L, Hk, D)."""
    s, hq, _ = q.shape
    g = hq // keys.shape[1]
    o = np.zeros((s, hq, values.shape[-1]))
    kp = np.arange(keys.shape[0])
    for t in range(s):
        for h in range(hq):
            scores = keys[:, h // g] @ q[t, h] * scale
            if softcap:
                scores = softcap * np.tanh(scores / softcap)
            vis = np.ones(keys.shape[0], bool)
            if causal:
                vis &= kp <= q_pos[t]
                if window is not None:
                    vis &= q_pos[t] - kp < window
            scores = np.where(vis, scores, -np.inf)
            w = np.exp(scores - scores.max())
            o[t, h] = (w / w.sum()) @ values[:, h // g]
    return o


def snapshot(cache):
    return (cache.lengths.copy(), cache.block_table.copy(), [None if a is None else a.copy() for a in cache.stores],
            cache.free_pages)


def assert_unchanged(cache, snap):
    lengths, table, stores, free = snap
    np.testing.assert_array_equal(cache.lengths, lengths)
    np.testing.assert_array_equal(cache.block_table, table)
    assert cache.free_pages == free
    for a, b in zip(cache.stores, stores):
        if a is not None:
            np.testing.assert_array_equal(a[: b.shape[0]], b)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("kind", KINDS, ids=["contiguous", "paged", "paged-capped"])
@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_ragged_appends_match_float64_oracle(backend, kind, layout, rng):
    spec = rotary.RopeSpec(16, layout=layout)
    cache = rotary.KVCache(spec, batch=3, kv_heads=2, head_dim=16, dtype=np.float64, backend=backend, **kind)
    chunks = {b: [] for b in range(3)}
    vals = {b: [] for b in range(3)}
    # a dense append of all, a dense append of two (reordered), a packed ragged append, a decode step
    steps = [(None, [4, 4, 4]), ([2, 0], [3, 3]), ([1, 2, 0], [5, 1, 2]), (None, [1, 1, 1])]
    for i, (ids, counts) in enumerate(steps):
        order = list(range(3)) if ids is None else ids
        ks = [rng.standard_normal((c, 2, 16)) for c in counts]
        vs = [rng.standard_normal((c, 2, 16)) for c in counts]
        if len(set(counts)) == 1 and i != 2:
            cache.append(np.stack(ks), np.stack(vs), seq_ids=ids)
        else:
            cu = np.concatenate([[0], np.cumsum(counts)])
            cache.append(np.concatenate(ks), np.concatenate(vs), seq_ids=order, cu_seqlens=cu)
        for b, kk, vv in zip(order, ks, vs):
            chunks[b].append(kk)
            vals[b].append(vv)
    np.testing.assert_array_equal(cache.lengths, [10, 10, 9])
    for b in range(3):
        np.testing.assert_allclose(cache.keys(b), oracle_keys(chunks[b], 16, layout), rtol=0, atol=1e-13)
        np.testing.assert_array_equal(cache.values(b), np.concatenate(vals[b]))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("spec", [rotary.RopeSpec(32), rotary.RopeSpec(32, layout="interleaved"),
                                  rotary.RopeSpec(32, rotary_dim=16),
                                  rotary.RopeSpec(32, scaling={"rope_type": "yarn", "factor": 4.0,
                                                               "original_max_position_embeddings": 16})],
                         ids=["half", "interleaved", "partial", "yarn"])
def test_append_is_apply_written_into_slots(backend, dtype, spec, rng):
    """A float cache's keys are exactly rotary.apply's output (same rounding), values exactly v."""
    cache = rotary.KVCache(spec, batch=2, kv_heads=3, head_dim=32, page_size=4, num_pages=16, dtype=dtype,
                           backend=backend)
    k = rng.standard_normal((2, 7, 3, 32)).astype(dtype)
    v = rng.standard_normal((2, 7, 3, 32)).astype(dtype)
    cache.append(k[:, :5], v[:, :5])
    cache.append(k[:, 5:], v[:, 5:])
    for b in range(2):
        np.testing.assert_array_equal(cache.keys(b), rotary.apply(k[b], spec=spec, seq_axis=0))
        np.testing.assert_array_equal(cache.values(b), v[b])


@pytest.mark.parametrize("kv_dtype", ["int8", "float8_e4m3"])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_quantized_entries_within_their_rounding(kv_dtype, backend, rng):
    """|dequantized - exact| <= half a step: scale/2 for int8; for float8_e4m3 2^-4 relative (3 mantissa bits)
    or 2^-10 of the scale (subnormals); the exact values are the float64 oracle's rotated keys."""
    pytest.importorskip("ml_dtypes")
    if backend == "numba" and kv_dtype == "float8_e4m3":   # a named backend without the format raises
        with pytest.raises(NotImplementedError, match="numba.*append_kv for kv_dtype='float8_e4m3'"):
            rotary.KVCache(rotary.RopeSpec(16), batch=1, kv_heads=1, head_dim=16, capacity=4, backend=backend,
                           kv_dtype=kv_dtype)
        backend = "auto"   # falls back to the NumPy reference
    spec = rotary.RopeSpec(16)
    cache = rotary.KVCache(spec, batch=2, kv_heads=2, head_dim=16, capacity=8, kv_dtype=kv_dtype, backend=backend)
    k = (rng.standard_normal((2, 6, 2, 16)) * np.exp(rng.standard_normal((2, 6, 2, 1)))).astype(np.float32)
    v = rng.standard_normal((2, 6, 2, 16)).astype(np.float32)
    cache.append(k, v)
    for b in range(2):
        exact = oracle_keys([k[b]], 16)
        for got, want in ((cache.keys(b), exact), (cache.values(b), v[b].astype(np.float64))):
            scale = np.abs(want).max(axis=-1, keepdims=True) / kv_entries.KV_LIMITS[kv_dtype]
            err = np.abs(got - want)
            if kv_dtype == "int8":
                bound = scale / 2 * (1 + 1e-5) + 1e-6 * np.abs(want)
            else:
                bound = np.maximum(np.abs(want) * 2.0 ** -4, scale * 2.0 ** -10) * (1 + 1e-5) + 1e-6 * np.abs(want)
            assert np.all(err <= bound), float((err - bound).max())
    assert cache.stores[0].dtype == (np.int8 if kv_dtype == "int8" else np.uint8)


def test_int8_rounds_half_to_even_and_zero_heads():
    """The entry formula on chosen values: a zero head has scale 0 and zero entries; ties round to even."""
    w = np.array([[[0.0] * 4, [127.0, 0.5, 1.5, -2.5]]], dtype=np.float32)
    entries, scales = kv_entries.quantize(np, w, "int8")
    np.testing.assert_array_equal(scales, [[0.0, 1.0]])
    np.testing.assert_array_equal(entries, [[[0, 0, 0, 0], [127, 0, 2, -2]]])


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("kind", KINDS[:2], ids=["contiguous", "paged"])
@pytest.mark.parametrize("s, window, softcap", [(1, None, None), (3, None, None), (1, 4, None), (2, 3, 5.0)])
def test_attention_over_cache_matches_oracle(backend, kind, s, window, softcap, rng):
    spec = rotary.RopeSpec(16)
    cache = rotary.KVCache(spec, batch=3, kv_heads=2, head_dim=16, dtype=np.float64, backend=backend, **kind)
    counts = [7, 3, 11]
    ks = [rng.standard_normal((c, 2, 16)) for c in counts]
    vs = [rng.standard_normal((c, 2, 16)) for c in counts]
    cache.append(np.concatenate(ks), np.concatenate(vs), cu_seqlens=np.concatenate([[0], np.cumsum(counts)]))
    q = rng.standard_normal((3, s, 4, 16))
    o = rotary.attention(q, cache, causal=True, window=window, softcap=softcap)
    assert o.shape == q.shape and o.dtype == np.float64
    for b in range(3):
        keys = oracle_keys([ks[b]], 16)
        pos = np.arange(counts[b] - s, counts[b])
        qr = rope_complex(q[b].transpose(1, 0, 2), pos, inv_freq64(16)).transpose(1, 0, 2)
        want = oracle_attention(qr, keys, vs[b], pos, scale=16 ** -0.5, window=window, softcap=softcap)
        np.testing.assert_allclose(o[b], want, rtol=1e-11, atol=1e-12)
    # a subset of the sequences, in another order, packed with their own chunk lengths
    q2 = rng.standard_normal((3, 4, 16))
    o2 = rotary.attention(q2, cache, seq_ids=[2, 0], cu_seqlens=[0, 2, 3], window=window, softcap=softcap)
    for rows, b in ((slice(0, 2), 2), (slice(2, 3), 0)):
        pos = np.arange(counts[b] - (rows.stop - rows.start), counts[b])
        qr = rope_complex(q2[rows].transpose(1, 0, 2), pos, inv_freq64(16)).transpose(1, 0, 2)
        want = oracle_attention(qr, oracle_keys([ks[b]], 16), vs[b], pos, scale=16 ** -0.5, window=window,
                                softcap=softcap)
        np.testing.assert_allclose(o2[rows], want, rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("kv_dtype", ["int8", "float8_e4m3"])
def test_quantized_attention_error_is_small(kv_dtype, rng):
    pytest.importorskip("ml_dtypes")
    spec = rotary.RopeSpec(64)
    exact = rotary.KVCache(spec, batch=2, kv_heads=2, head_dim=64, capacity=40, dtype=np.float64, backend="numpy")
    quant = rotary.KVCache(spec, batch=2, kv_heads=2, head_dim=64, capacity=40, kv_dtype=kv_dtype, backend="numpy")
    k = rng.standard_normal((2, 33, 2, 64))
    v = rng.standard_normal((2, 33, 2, 64))
    exact.append(k, v)
    quant.append(k.astype(np.float32), v.astype(np.float32))
    q = rng.standard_normal((2, 1, 8, 64))
    want = rotary.attention(q, exact)
    got = rotary.attention(q.astype(np.float32), quant)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < (0.02 if kv_dtype == "int8" else 0.1), err


def test_paged_memory_grows_with_tokens_and_pages_return(rng):
    spec = rotary.RopeSpec(16)
    cache = rotary.KVCache(spec, batch=4, kv_heads=2, head_dim=16, page_size=4, num_pages=1000, backend="numpy")
    start = cache.nbytes
    per_page = 2 * 4 * 2 * 16 * 4
    assert start == 4 * per_page   # one page per sequence to start with, not num_pages
    k = rng.standard_normal((4, 10, 2, 16)).astype(np.float32)
    cache.append(k, k)
    assert cache.nbytes <= 2 * 12 * per_page and cache.free_pages == 1000 - 12
    before = cache.keys(1)
    cache.free([0, 2])
    assert cache.free_pages == 1000 - 6 and cache.lengths.tolist() == [0, 10, 0, 10]
    cache.append(k[:2], k[:2], seq_ids=[2, 0])   # reuses the freed pages
    assert cache.free_pages == 1000 - 12
    np.testing.assert_array_equal(cache.keys(1), before)
    np.testing.assert_array_equal(cache.keys(2), rotary.apply(k[0], spec=spec, seq_axis=0))
    cache.reset()
    assert cache.lengths.tolist() == [0] * 4 and cache.free_pages == 1000


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_slide_keeps_sinks_and_window_rerotated(backend, kv_dtype, rng):
    spec = rotary.RopeSpec(16)
    cache = rotary.KVCache(spec, batch=2, kv_heads=2, head_dim=16, page_size=4, num_pages=20, dtype=np.float64,
                           kv_dtype=kv_dtype, backend=backend)
    k = rng.standard_normal((2, 13, 2, 16))
    v = rng.standard_normal((2, 13, 2, 16))
    cache.append(k, v)
    held_v = cache.values(0)
    cache.slide(sinks=2, window=5, seq_ids=[0])
    assert cache.lengths.tolist() == [7, 13]
    kept = np.concatenate([k[0, :2], k[0, 8:]])
    tol = 1e-12 if kv_dtype is None else 0.05
    np.testing.assert_allclose(cache.keys(0), oracle_keys([kept], 16), atol=tol)
    np.testing.assert_array_equal(cache.values(0), np.concatenate([held_v[:2], held_v[8:]]))
    assert cache.free_pages == 20 - 2 - 4   # sequence 0 is back to 2 pages
    cache.append(k[:1, :1], v[:1, :1], seq_ids=[0])   # the next token at position 7
    np.testing.assert_allclose(cache.keys(0)[7], oracle_keys([np.concatenate([kept, k[0, :1]])], 16)[7], atol=tol)


def test_multi_axis_spec_appends_at_given_positions(rng):
    spec = rotary.RopeSpec.axial(16, axes=2)
    cache = rotary.KVCache(spec, batch=1, kv_heads=2, head_dim=16, capacity=16, backend="numpy")
    k = rng.standard_normal((1, 6, 2, 16)).astype(np.float32)
    pos = rotary.grid_positions(2, 3)
    with pytest.raises(ValueError, match="positions="):
        cache.append(k, k)
    cache.append(k, k, positions=pos[None])
    np.testing.assert_array_equal(cache.keys(0), rotary.apply(k[0], pos, spec=spec, seq_axis=0))


def test_bhsd_layout(rng):
    spec = rotary.RopeSpec(16)
    cache = rotary.KVCache(spec, batch=2, kv_heads=2, head_dim=16, capacity=8, backend="numpy", layout="bhsd")
    k = rng.standard_normal((2, 2, 5, 16)).astype(np.float32)   # (n, heads, s, d)
    cache.append(k, k)
    np.testing.assert_array_equal(cache.keys(1), rotary.apply(k[1], spec=spec, layout="hsd").transpose(1, 0, 2))
    q = rng.standard_normal((2, 4, 1, 16)).astype(np.float32)
    o = rotary.attention(q, cache)
    ref = rotary.KVCache(spec, batch=2, kv_heads=2, head_dim=16, capacity=8, backend="numpy")
    ref.append(k.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3))
    np.testing.assert_array_equal(o, rotary.attention(q.transpose(0, 2, 1, 3), ref).transpose(0, 2, 1, 3))


# -- errors leave the cache unchanged ---------------------------------------------------------------------
def _filled(kind, rng):
    cache = rotary.KVCache(rotary.RopeSpec(16), batch=3, kv_heads=2, head_dim=16, backend="numpy", **kind)
    k = rng.standard_normal((3, 3, 2, 16)).astype(np.float32)
    cache.append(k, k)
    return cache, k


@pytest.mark.parametrize("call, error, match", [
    (lambda c, k: c.append(np.zeros((1, 6, 2, 16), np.float32), np.zeros((1, 6, 2, 16), np.float32), seq_ids=[1]),
     rotary.KVCacheFullError, "sequence 1 would hold 9 tokens, past the cache's capacity of 8"),
    (lambda c, k: c.append(k[:1], k[:1], seq_ids=[3]), ValueError, r"seq_ids\[0\] = 3 is out of range"),
    (lambda c, k: c.append(k[:2], k[:2], seq_ids=[1, 1]), ValueError, "must not repeat"),
    (lambda c, k: c.append(k[:2], k[:2]), ValueError, "pass seq_ids"),
    (lambda c, k: c.append(k.astype(np.float64), k.astype(np.float64)), TypeError, "dtype float64 but the cache holds"),
    (lambda c, k: c.append(k[..., :8], k[..., :8]), ValueError, "k has head size 8, the pools 16"),
    (lambda c, k: c.append(k, k[:, :2]), ValueError, "same shape"),
    (lambda c, k: c.append(k[0], k[0], cu_seqlens=[0, 2, 4]), ValueError, "cu_seqlens"),
    (lambda c, k: rotary.attention(np.zeros((3, 4, 4, 16), np.float32), c), ValueError,
     "q has 4 tokens for sequence 0, which holds 3"),
    (lambda c, k: rotary.attention(np.zeros((3, 1, 3, 16), np.float32), c), ValueError, "multiple of the pools' kv_heads"),
    (lambda c, k: rotary.attention(np.zeros((3, 1, 4, 16), np.float32), c, k), TypeError, "takes its keys"),
])
def test_bad_appends_raise_and_leave_cache_unchanged(call, error, match, rng):
    cache, k = _filled(dict(capacity=8), rng)
    snap = snapshot(cache)
    with pytest.raises(error, match=match):
        call(cache, k)
    assert_unchanged(cache, snap)


def test_no_free_page_names_the_sequence(rng):
    cache, k = _filled(dict(page_size=2, num_pages=7), rng)   # 3 sequences x 2 pages taken, 1 free
    snap = snapshot(cache)
    with pytest.raises(rotary.KVCacheFullError, match="no free page for sequence 0"):
        cache.append(k[:, :2], k[:, :2])   # needs a page each for 0 and 2... 3 pages, 1 free
    assert_unchanged(cache, snap)
    cache.append(k[:1, :1], k[:1, :1], seq_ids=[1])   # 4 tokens: fits in its 2 pages
    cache.append(k[:1, :1], k[:1, :1], seq_ids=[1])   # the last free page
    with pytest.raises(rotary.KVCacheFullError, match="free finished sequences"):
        cache.append(k[:1, :2], k[:1, :2], seq_ids=[2])


def test_constructor_errors():
    spec = rotary.RopeSpec(16)
    with pytest.raises(ValueError, match="give capacity"):
        rotary.KVCache(spec, batch=1, kv_heads=1, head_dim=16)
    with pytest.raises(ValueError, match="num_pages"):
        rotary.KVCache(spec, batch=1, kv_heads=1, head_dim=16, page_size=4)
    bounded = rotary.KVCache(spec, batch=3, kv_heads=1, head_dim=16, page_size=4, capacity=10)
    assert bounded.num_pages == 9 and bounded.nbytes == 3 * 2 * 4 * 16 * 4
    with pytest.raises(ValueError, match="head_dim"):
        rotary.KVCache(spec, batch=1, kv_heads=1, head_dim=32, capacity=4)
    with pytest.raises(ValueError, match="kv_dtype"):
        rotary.KVCache(spec, batch=1, kv_heads=1, head_dim=16, capacity=4, kv_dtype="int4")
    with pytest.raises(ValueError, match="capacity must be a positive int"):
        rotary.KVCache(spec, batch=1, kv_heads=1, head_dim=16, capacity=0)


# -- attention_mask on plain attention ---------------------------------------------------------------------
@pytest.mark.parametrize("causal, window", [(True, None), (True, 3), (False, None)])
def test_attention_mask_left_padding_matches_unpadded_rows(causal, window, rng):
    """Each left-padded row equals the attention of its real tokens alone (positions from 0), float64 oracle;
    causal padding queries give 0."""
    spec = rotary.RopeSpec(16)
    lengths = [6, 3, 1]
    S = 6
    q = rng.standard_normal((3, S, 4, 16))
    k = rng.standard_normal((3, S, 2, 16))
    v = rng.standard_normal((3, S, 2, 16))
    mask = np.zeros((3, S), np.int64)
    for b, n in enumerate(lengths):
        mask[b, S - n:] = 1
    o = rotary.attention(q, k, v, causal=causal, window=window, spec=spec, layout="bshd", attention_mask=mask)
    for b, n in enumerate(lengths):
        pos = np.arange(n)
        qr = rope_complex(q[b, S - n:].transpose(1, 0, 2), pos, inv_freq64(16)).transpose(1, 0, 2)
        kr = rope_complex(k[b, S - n:].transpose(1, 0, 2), pos, inv_freq64(16)).transpose(1, 0, 2)
        want = oracle_attention(qr, kr, v[b, S - n:], pos, scale=16 ** -0.5, causal=causal, window=window)
        np.testing.assert_allclose(o[b, S - n:], want, rtol=1e-11, atol=1e-12)
        if causal:   # a padding query sees no key (non-causal: every real key, as HF's key-side mask gives)
            np.testing.assert_array_equal(o[b, :S - n], 0.0)


def test_attention_mask_matches_torch_sdpa_with_hf_mask(rng):
    torch = pytest.importorskip("torch")
    spec = rotary.RopeSpec(16)
    S = 5
    q, k, v = (rng.standard_normal((2, S, 2, 16)) for _ in range(3))
    mask = np.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    o = rotary.attention(q, k, v, causal=True, spec=spec, layout="bshd", attention_mask=mask)
    pos = np.where(mask, np.cumsum(mask, 1) - 1, 1)   # HF's position_ids for a left-padded batch
    qr = np.stack([rotary.apply(q[b], pos[b], spec=spec, seq_axis=0) for b in range(2)])
    kr = np.stack([rotary.apply(k[b], pos[b], spec=spec, seq_axis=0) for b in range(2)])
    allowed = np.tril(np.ones((S, S), bool))[None] & mask.astype(bool)[:, None, :]
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a.transpose(0, 2, 1, 3)))   # noqa: E731
    want = torch.nn.functional.scaled_dot_product_attention(t(qr), t(kr), t(v),
                                                            attn_mask=torch.from_numpy(allowed)[:, None])
    want = want.numpy().transpose(0, 2, 1, 3)
    np.testing.assert_allclose(o[0, 2:], want[0, 2:], rtol=1e-11, atol=1e-12)
    np.testing.assert_allclose(o[1], want[1], rtol=1e-11, atol=1e-12)


def test_attention_mask_errors(rng):
    q = rng.standard_normal((2, 4, 2, 8))
    with pytest.raises(ValueError, match=r"attention_mask must have shape \(batch, k_len\) = \(2, 4\)"):
        rotary.attention(q, q, q, causal=True, layout="bshd", attention_mask=np.ones((2, 3)))
    with pytest.raises(ValueError, match="0/1"):
        rotary.attention(q, q, q, causal=True, layout="bshd", attention_mask=np.full((2, 4), 2))
    with pytest.raises(TypeError, match="needs v"):
        rotary.attention(q, q)
