"""Per-head RMSNorm fused before RoPE (Qwen3's / Gemma 3's q_norm and k_norm): ``kv_append(k_norm=)``,
``paged_attention(q_norm=)`` and a many-layer :class:`rotary.KVCache`'s ``append(k_norm=)`` / ``attend(q_norm=)``,
on every backend (NumPy reference, Numba, the CUDA kernels on the host shim), against float64 oracles written out
here: ``N(x)_j = x_j / sqrt(mean(x^2) + eps) * w_j``, then the rotation by complex multiplication, then an explicit
masked softmax. Bad weights and eps raise naming the argument and leave the pools and the cache bit for bit
unchanged."""

from __future__ import annotations

import numpy as np
import pytest

import rotary
from rotary.testing import dequantize64

from .test_kv_engine_cache import assert_state, state
from .test_kv_primitives import (ATTENTION_TOL, CASES, FORMATS, backend, copies, entry_error, filled, grid,  # noqa: F401
                                 make_pools, offered, oracle_paged, oracle_rotate, skip_unsupported)


def norm64(x, weight, eps):
    """float64 RMSNorm of each head (last axis) of x."""
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * np.asarray(weight, np.float64)


def weights(rng, d, dtype=np.float32):
    return (1.0 + 0.5 * rng.standard_normal(d)).astype(dtype)


def norm_error(dtype, head_dim, amax):
    """The work dtype's rounding of the norm (a sum of head_dim squares, a square root, two products) beside the
    entry's own rounding."""
    eps = 1e-15 if np.dtype(dtype) == np.float64 else 6e-8
    return amax * eps * (head_dim + 8)


@grid
@pytest.mark.parametrize("kv_dtype", FORMATS, ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
@pytest.mark.parametrize("spec", [dict(layout="half"), dict(layout="interleaved", rotary_dim=16, rotary_offset=6)],
                         ids=["half", "interleaved-partial-offset"])
def test_kv_append_norms_keys_before_rotating(backend, kv_dtype, dtype, spec, rng):
    """Each key head normed (its weights and eps), then rotated and rounded once; values never normed; a zero head
    stays zero (eps > 0); padding tokens and the other slots untouched; the weights not written."""
    skip_unsupported(dtype, kv_dtype)
    spec = rotary.RopeSpec(32, base=1000.0, **spec)
    T, H = 9, 2
    k_pool, v_pool, scales = make_pools(rng, 6, 4, H, 32, dtype, kv_dtype)
    before = copies(k_pool, v_pool, scales)
    k = (rng.standard_normal((T, H, 32)) * 7).astype(dtype)
    k[4, 1] = 0
    v = (rng.standard_normal((T, H, 32)) * 3).astype(dtype)
    w = weights(rng, 32)
    w_before = w.copy()
    slots = rng.permutation(24)[:T]
    slots[2] = -1
    positions = rng.integers(0, 5000, T)

    def call():
        rotary.kv_append(k, v, k_pool, v_pool, slots, positions, spec=spec, scales=scales, kv_dtype=kv_dtype,
                         backend=backend, k_norm=w, norm_eps=1e-5)

    if not offered(backend, kv_dtype, "append_kv", call):
        return
    call()
    np.testing.assert_array_equal(w, w_before)
    real = slots >= 0
    want_k = oracle_rotate(norm64(k, w, 1e-5), positions, spec)[real]
    want_v = np.asarray(v, np.float64)[real]
    flat = lambda a: a.reshape((-1,) + a.shape[2:])   # noqa: E731
    got_scales = (None, None) if scales is None else (flat(scales[0]), flat(scales[1]))
    for pool, scale, want in ((k_pool, got_scales[0], want_k), (v_pool, got_scales[1], want_v)):
        got = dequantize64(flat(pool)[slots[real]], None if scale is None else scale[slots[real]], kv_dtype)
        amax = np.abs(want).max(axis=-1, keepdims=True)
        bound = entry_error(kv_dtype, dtype, amax) + norm_error(dtype, 32, amax) + 1e-300
        assert np.all(np.abs(got - want) <= bound)
    zero = int(np.flatnonzero(real).tolist().index(4))
    assert np.all(dequantize64(flat(k_pool)[slots[4]][1], None if scales is None else flat(scales[0])[slots[4]][1],
                               kv_dtype) == 0), zero
    untouched = np.setdiff1d(np.arange(24), slots[real])
    for a, b in zip((k_pool, v_pool) + (scales or ()), before[:2] + (before[2] or ())):
        np.testing.assert_array_equal(flat(a)[untouched].view(np.uint8), flat(b)[untouched].view(np.uint8))


@grid
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kv_dtype", [None, "int8"], ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_paged_attention_norms_q_before_rotating(backend, case, kv_dtype, dtype, rng):
    """q normed as the kernel reads it, then rotated and scaled: decode, mixed, window + softcap and non-causal
    steps, GQA 8:2."""
    skip_unsupported(dtype, kv_dtype)
    spec = rotary.RopeSpec(32, base=500.0, layout="interleaved", rotary_dim=24)
    k_pool, v_pool, scales, table, lens = filled(rng, "numpy", dtype=dtype, kv_dtype=kv_dtype, spec=spec)
    counts, kw = CASES[case]
    counts = np.array(counts)
    q = (rng.standard_normal((int(counts.sum()), 8, 32)) * 4).astype(dtype)
    cu = np.concatenate([[0], np.cumsum(counts)])
    w = weights(rng, 32)

    def call():
        return rotary.paged_attention(q, k_pool, v_pool, table, lens, spec=spec, cu_seqlens=cu, scales=scales,
                                      kv_dtype=kv_dtype, backend=backend, q_norm=w, norm_eps=1e-4, **kw)

    if not offered(backend, kv_dtype, "paged_attention", call):
        return
    o = call()
    assert o.dtype == q.dtype and o.shape == q.shape
    scale = kw.pop("scale", 32 ** -0.5)
    want = oracle_paged(norm64(q, w, 1e-4), counts, k_pool, v_pool, scales, table, lens, kv_dtype, spec,
                        scale=scale, **kw)
    err = np.abs(o.astype(np.float64) - want).max() / np.abs(want).max()
    assert err <= 2 * ATTENTION_TOL[dtype], f"relative error {err:.3g}"


@grid
def test_q_norm_without_a_rotation(backend, rng):
    """spec=None (q taken as rotated): q_norm alone is applied."""
    k_pool, v_pool, scales, table, lens = filled(rng, "numpy", dtype=np.float32, kv_dtype=None,
                                                 spec=rotary.RopeSpec(32))
    q = rng.standard_normal((4, 1, 8, 32)).astype(np.float32)
    w = weights(rng, 32)
    o = rotary.paged_attention(q, k_pool, v_pool, table, lens, q_norm=w, backend=backend)
    want = oracle_paged(norm64(q.reshape(4, 8, 32), w, 1e-6), [1] * 4, k_pool, v_pool, None, table, lens, None,
                        None, scale=32 ** -0.5)
    np.testing.assert_allclose(o.reshape(4, 8, 32), want, rtol=0, atol=4e-6 * np.abs(want).max())


@grid
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_cache_layers_norm_with_their_own_weights(backend, layout, rng):
    """A 3-layer cache (Qwen3's shape: GQA 4:2, head_dim 20) with each layer's own k_norm / q_norm through a prefill
    and decode steps (the prepared runs the first layer leaves for the others): every layer's keys are its own
    normed and rotated keys, and its attention that of its own normed q."""
    if backend == "cuda-shim":
        pytest.skip("a cache holds CuPy arrays on the CUDA backend; the shim runs the primitives")
    spec = rotary.RopeSpec(20, base=10000.0)
    L, B, Hq, Hk, D = 3, 2, 4, 2, 20
    cache = rotary.KVCache(spec, batch=B, kv_heads=Hk, head_dim=D, page_size=4, num_pages=16, layers=L,
                           backend=backend, layout=layout)
    k_norms = [weights(rng, D) for _ in range(L)]
    q_norms = [weights(rng, D) for _ in range(L)]
    keys = [[] for _ in range(L)]
    values = [[] for _ in range(L)]

    def dense(a):   # (n, s, h, d) -> the cache's layout
        return a if layout == "bshd" else np.ascontiguousarray(a.transpose(0, 2, 1, 3))

    for s in (5, 1, 1, 1):
        qs = []
        for i in range(L):
            k = (rng.standard_normal((B, s, Hk, D)) * 3).astype(np.float32)
            v = rng.standard_normal((B, s, Hk, D)).astype(np.float32)
            q = (rng.standard_normal((B, s, Hq, D)) * 3).astype(np.float32)
            cache.layer(i).append(dense(k), dense(v), k_norm=k_norms[i])
            if i == 1:   # (through rotary.attention: the same keywords)
                o = rotary.attention(dense(q), cache.layer(i), q_norm=q_norms[i])
            else:
                o = cache.layer(i).attend(dense(q), q_norm=q_norms[i])
            keys[i].append(k)
            values[i].append(v)
            qs.append((q, o if layout == "bshd" else o.transpose(0, 2, 1, 3)))
        n = int(cache.lengths[0])
        pos = np.arange(n)
        for i, (q, o) in enumerate(qs):
            k_all = np.concatenate(keys[i], axis=1)
            v_all = np.concatenate(values[i], axis=1).astype(np.float64)
            for b in range(B):
                want_k = oracle_rotate(norm64(k_all[b], k_norms[i], 1e-6), pos, spec)
                got_k = cache.keys(b, layer=i)   # (tokens, heads, head_dim) in either layout
                np.testing.assert_allclose(got_k, want_k, rtol=0, atol=2e-6 * np.abs(want_k).max())
                qn = oracle_rotate(norm64(q[b], q_norms[i], 1e-6), pos[n - s:], spec)   # (s, Hq, D)
                kk = np.repeat(want_k, Hq // Hk, axis=1)
                vv = np.repeat(v_all[b], Hq // Hk, axis=1)
                scores = np.einsum("jhd,phd->jhp", qn, kk) / np.sqrt(D)
                scores = np.where(pos[None, None, :] <= pos[n - s:, None, None], scores, -np.inf)
                p = np.exp(scores - scores.max(-1, keepdims=True))
                want_o = np.einsum("jhp,phd->jhd", p / p.sum(-1, keepdims=True), vv)
                np.testing.assert_allclose(o[b], want_o, rtol=0, atol=4e-6 * np.abs(want_o).max())


def test_attention_takes_q_norm_only_over_a_cache(rng):
    """rotary.attention(q, k, v, q_norm=) (no cache) is refused with a message naming q_norm; over a cache it is the
    cache's attend with the same weights, bit for bit."""
    spec = rotary.RopeSpec(16, base=100.0)
    q = rng.standard_normal((1, 3, 2, 16)).astype(np.float32)
    w = weights(rng, 16)
    with pytest.raises(ValueError, match="q_norm and norm_eps go with a rotary.KVCache"):
        rotary.attention(q, q, q, spec=spec, seq_axis=1, q_norm=w)
    cache = rotary.KVCache(spec, batch=1, kv_heads=2, head_dim=16, capacity=8, backend="numpy")
    cache.append(q, q)
    np.testing.assert_array_equal(rotary.attention(q[:, -1:], cache, q_norm=w, norm_eps=1e-5),
                                  cache.attend(q[:, -1:], q_norm=w, norm_eps=1e-5))
    assert not np.array_equal(rotary.attention(q[:, -1:], cache, q_norm=w), rotary.attention(q[:, -1:], cache))


BAD_NORMS = [
    (dict(k_norm=np.ones(31, np.float32)), ValueError, r"k_norm must have shape \(32,\)"),
    (dict(k_norm=np.ones((1, 32), np.float32)), ValueError, r"k_norm must have shape \(32,\)"),
    (dict(k_norm=[1.0] * 32), TypeError, "k_norm must be an array"),
    (dict(k_norm=np.ones(32, np.int32)), TypeError, "k_norm must have a real floating dtype"),
    (dict(k_norm=np.ones(32, np.float32), norm_eps=-1e-6), ValueError, "norm_eps must be >= 0"),
    (dict(k_norm=np.ones(32, np.float32), norm_eps=float("nan")), ValueError, "norm_eps must be finite"),
    (dict(k_norm=np.ones(32, np.float32), norm_eps="1e-6"), TypeError, "norm_eps must be a real number"),
    (dict(norm_eps=1e-6), ValueError, "norm_eps goes with k_norm="),
]


@grid
@pytest.mark.parametrize("kw, error, match", BAD_NORMS, ids=[m for _, _, m in BAD_NORMS])
def test_bad_norms_raise_naming_the_argument_and_write_nothing(backend, kw, error, match, rng):
    spec = rotary.RopeSpec(32)
    k_pool, v_pool, _ = make_pools(rng, 4, 4, 2, 32, np.float32, None)
    before = copies(k_pool, v_pool, None)
    k = rng.standard_normal((3, 2, 32)).astype(np.float32)
    with pytest.raises(error, match=match):
        rotary.kv_append(k, k, k_pool, v_pool, np.arange(3), np.arange(3), spec=spec, backend=backend, **kw)
    np.testing.assert_array_equal(k_pool, before[0])
    np.testing.assert_array_equal(v_pool, before[1])
    q_kw = {("q_norm" if name == "k_norm" else name): value for name, value in kw.items()}
    with pytest.raises(error, match=match.replace("k_norm", "q_norm")):
        rotary.paged_attention(k[:1, None], k_pool, v_pool, np.array([[0]]), np.array([3]), spec=spec,
                               backend=backend, **q_kw)


@pytest.mark.parametrize("kw, error, match", BAD_NORMS, ids=[m for _, _, m in BAD_NORMS])
def test_a_cache_refuses_bad_norms_unchanged(kw, error, match, rng):
    cache = rotary.KVCache(rotary.RopeSpec(32), batch=2, kv_heads=2, head_dim=32, page_size=4, num_pages=8,
                           layers=2)
    k = rng.standard_normal((2, 3, 2, 32)).astype(np.float32)
    cache.layer(0).append(k, k)
    cache.layer(1).append(k, k)
    k1 = k[:, :1].copy()
    cache.layer(0).append(k1, k1, k_norm=np.ones(32, np.float32))
    was = state(cache)
    with pytest.raises(error, match=match):
        cache.layer(1).append(k1, k1, **kw)
    assert_state(cache, was)
    q_kw = {("q_norm" if name == "k_norm" else name): value for name, value in kw.items()}
    with pytest.raises(error, match=match.replace("k_norm", "q_norm")):
        cache.attend(k1, layer=0, **q_kw)
    assert_state(cache, was)


def test_weights_of_other_dtypes_and_read_only_weights(rng):
    """float16 / float64 / read-only / strided weights are taken as their float32 values (never written)."""
    spec = rotary.RopeSpec(32)
    k = rng.standard_normal((3, 2, 32)).astype(np.float32)
    base = weights(rng, 64, np.float64)
    variants = [base[:32].astype(np.float16), base[:32], base[::2]]
    ro = base[:32].astype(np.float32)
    ro.flags.writeable = False
    variants.append(ro)
    for w in variants:
        k_pool, v_pool, _ = make_pools(rng, 4, 4, 2, 32, np.float32, None)
        rotary.kv_append(k, k, k_pool, v_pool, np.arange(3), np.arange(3), spec=spec, k_norm=w)
        want = oracle_rotate(norm64(k, np.asarray(w, np.float32), 1e-6), np.arange(3), spec)
        np.testing.assert_allclose(k_pool.reshape(-1, 2, 32)[:3], want, rtol=0, atol=2e-6 * np.abs(want).max())
