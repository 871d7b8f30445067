"""Regression tests of the defects the property-based suite (tests/test_properties*.py) found (issue 25).

Each against an independent float64 oracle written here: explicit 2x2 rotations, the quadratic masked
softmax and the quadratic causal linear attention over the visible tokens only.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import rotary
from rotary.attn import softmax as softmax_module

from .test_cuda_kernels_cpu import kernels, use_backend  # noqa: F401  (host-shim fixtures)

BACKENDS = ["numpy"] + (["numba"] if rotary.available_backends()["numba"][0] else [])
#: linear attention also through the CUDA kernel, run on the CPU by tests/cuda_shim (cuda_cpu marker)
LINEAR_BACKENDS = BACKENDS + [pytest.param("cuda-shim", marks=pytest.mark.cuda_cpu)]


def backend_name(backend, request):
    """The frontend name of ``backend``; "cuda-shim" registers the host-shim backend (32 threads a block:
    2x2 register tiles on these small products, so a tile's rows see one later token of the tile)."""
    if backend == "cuda-shim":
        return request.getfixturevalue("use_backend")(threads=32)
    return backend


def rotate64(x, positions, inv_freq):
    """float64 half-layout rotation of x (..., S, D) at integer positions (S,), angles reduced exactly
    (Python ints: p * w mod 2 pi with w's exact binary value, through fractions)."""
    from fractions import Fraction

    x = np.asarray(x, np.float64)
    half = len(inv_freq)
    two_pi = Fraction(math.tau)   # the float64 2 pi (the library reduces by the true 2 pi: ulp-level)
    ang = np.empty((len(positions), half))
    for i, p in enumerate(positions):
        for j, w in enumerate(inv_freq):
            t = Fraction(int(p)) * Fraction(float(w))
            ang[i, j] = float(t - two_pi * round(t / two_pi))
    c, s = np.cos(ang), np.sin(ang)
    a, b = x[..., :half], x[..., half:2 * half]
    return np.concatenate([a * c - b * s, b * c + a * s, x[..., 2 * half:]], axis=-1)


# -- 1: positions=[] ------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_list_positions(backend):
    """[] is float64 to NumPy: it was refused as "float positions" even for zero tokens; now it is zero
    integer positions (and a length mismatch is reported as one)."""
    x = np.zeros((2, 0, 8), np.float32)
    assert rotary.apply(x, [], backend=backend, seq_axis=-2).shape == x.shape
    q, k = rotary.apply_qk(x, x, [], backend=backend, seq_axis=-2)
    assert q.shape == k.shape == x.shape
    assert rotary.RopeSpec(8).cos_sin([])[0].shape == (0, 4)
    with pytest.raises(ValueError, match="positions.*sequence length 3"):
        rotary.apply(np.zeros((3, 8), np.float32), [], backend=backend, seq_axis=-2)


# -- 2: causal linear attention: a later token's NaN/inf ----------------------------------------------
def linear_oracle(q, k, v, causal=True, decay=1.0, eps=1e-6, normalize=True):
    """(B, T, H, d) quadratic causal linear attention with elu+1 features and RoPE (default spec) in
    float64, summing over the visible tokens only (s <= t), so a later token never enters."""
    B, T, H, d = q.shape
    inv = rotary.RopeSpec(d).inv_freq()
    phi = lambda x: np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0)))  # noqa: E731
    a, b = phi(np.asarray(q, np.float64)), phi(np.asarray(k, np.float64))
    pos = np.arange(T)
    ah = rotate64(np.moveaxis(a, 1, 2), pos, inv)   # (B, H, T, d)
    bh = rotate64(np.moveaxis(b, 1, 2), pos, inv)
    vv = np.moveaxis(np.asarray(v, np.float64), 1, 2)
    a_ = np.moveaxis(a, 1, 2)
    b_ = np.moveaxis(b, 1, 2)
    o = np.empty((B, H, T, v.shape[-1]))
    for t in range(T):
        s = np.arange(t + 1 if causal else T)
        w = decay ** (t - s) if causal else np.ones(len(s))
        num = np.einsum("bhd,bhsd,s,bhse->bhe", ah[:, :, t], bh[:, :, s], w, vv[:, :, s])
        den = np.einsum("bhd,bhsd,s->bh", a_[:, :, t], b_[:, :, s], w)
        o[:, :, t] = num / (den[..., None] + eps) if normalize else num
    return np.moveaxis(o, 1, 2)


def assert_same_nonfinite_and_close(got, want, tol):
    got = np.asarray(got, np.float64)
    bad_got, bad_want = ~np.isfinite(got), ~np.isfinite(want)
    np.testing.assert_array_equal(bad_got, bad_want, err_msg="non-finite entries differ from the oracle's")
    np.testing.assert_allclose(got[~bad_got], want[~bad_want], rtol=tol, atol=tol)


@pytest.mark.parametrize("backend", LINEAR_BACKENDS)
@pytest.mark.parametrize("decay", [None, 0.9])
@pytest.mark.parametrize("chunk", [4, 64])
def test_causal_linear_attention_later_nan_stays_later(backend, decay, chunk, request):
    """A NaN in v (and an inf in k) at token t reached the outputs of earlier tokens of its chunk
    (0 * NaN in tril(A B^T) V); now only outputs at tokens >= t see them."""
    backend = backend_name(backend, request)
    r = np.random.default_rng(3)
    q, k, v = (r.standard_normal((1, 10, 2, 8)).astype(np.float32) for _ in range(3))
    v[0, 6, 0, 1] = np.nan
    k[0, 8, 1, 3] = np.inf
    o = rotary.linear_attention(q, k, v, seq_axis=1, causal=True, backend=backend, decay=decay, chunk=chunk)
    want = linear_oracle(q, k, v, decay=1.0 if decay is None else decay)
    assert np.isfinite(o[0, :6]).all() and np.isnan(o[0, 6:, 0, 1]).all()
    assert np.isfinite(o[0, :8, 1]).all() and not np.isfinite(o[0, 8:, 1]).any()
    assert_same_nonfinite_and_close(o, want, 2e-4)


@pytest.mark.parametrize("backend", LINEAR_BACKENDS)
@pytest.mark.parametrize("decay", [None, 0.9])
@pytest.mark.parametrize("chunk", [3, 64])
@pytest.mark.parametrize("where", ["v", "k"])
def test_causal_linear_attention_later_nonfinite_every_token(backend, decay, chunk, where, request):
    """A NaN (v) or inf (a feature of k) at each token t in turn, small heads (d = 2, dv = 3): the CUDA
    kernel's 2x2 tiles of P V also multiplied row t - 1's zero weight of token t into its value (0 * NaN:
    a NaN at an odd token of the chunk leaked into the token before it); only outputs at tokens >= t may
    see it."""
    backend = backend_name(backend, request)
    T = 7
    q = np.random.default_rng(0).standard_normal((1, T, 1, 2)).astype(np.float32)
    for t in range(T):
        k, v = q.copy(), np.random.default_rng(1).standard_normal((1, T, 1, 3)).astype(np.float32)
        if where == "v":
            v[0, t, 0, 1] = np.nan
        else:
            k[0, t, 0, 0] = np.inf
        o = rotary.linear_attention(q, k, v, seq_axis=1, causal=True, backend=backend, decay=decay, chunk=chunk)
        assert np.isfinite(o[0, :t]).all(), f"token {t}'s {where} reached earlier outputs"
        assert_same_nonfinite_and_close(o, linear_oracle(q, k, v, decay=1.0 if decay is None else decay), 2e-4)


@pytest.mark.parametrize("backend", LINEAR_BACKENDS)
def test_causal_linear_attention_later_nan_packed_and_decode(backend, request):
    """The packed (cu_seqlens) launch and the one-token decode step: a NaN value reaches only the later
    outputs of its own sequence (sequence 0 is tokens 0..4 with a NaN at token 3, sequence 1 tokens 5..8
    with one at token 6), and a decode step sees its own token's NaN in that column only."""
    backend = backend_name(backend, request)
    r = np.random.default_rng(5)
    q, k = (r.standard_normal((1, 9, 1, 2)).astype(np.float32) for _ in range(2))
    v = r.standard_normal((1, 9, 1, 3)).astype(np.float32)
    v[0, 3, 0, 0] = np.nan
    v[0, 6, 0, 2] = np.nan
    o = rotary.linear_attention(q, k, v, seq_axis=1, causal=True, backend=backend, cu_seqlens=np.array([0, 5, 9]))
    assert np.isfinite(o[0, :3]).all() and np.isnan(o[0, 3:5, 0, 0]).all() and np.isfinite(o[0, 5]).all()
    assert np.isnan(o[0, 6:, 0, 2]).all()
    for s0, s1 in ((0, 5), (5, 9)):
        assert_same_nonfinite_and_close(o[:, s0:s1], linear_oracle(q[:, s0:s1], k[:, s0:s1], v[:, s0:s1]), 2e-4)
    _, state = rotary.linear_attention(q[:, :3], k[:, :3], v[:, :3], seq_axis=1, causal=True, backend=backend,
                                       return_state=True)
    step = rotary.linear_attention(q[:, 3:4], k[:, 3:4], v[:, 3:4], seq_axis=1, causal=True, backend=backend,
                                   state=state)
    assert np.isnan(step[0, 0, 0, 0]) and np.isfinite(step[0, 0, 0, 1:]).all()
    np.testing.assert_allclose(step[0, 0, 0, 1:], o[0, 3, 0, 1:], rtol=2e-4, atol=2e-4)


def test_causal_linear_attention_later_nan_torch_path():
    """The array-API path (torch tensors) has the same fix."""
    torch = pytest.importorskip("torch")
    r = np.random.default_rng(4)
    q, k, v = (r.standard_normal((1, 9, 2, 8)).astype(np.float32) for _ in range(3))
    v[0, 5, 1, 2] = np.nan
    for decay in (None, 0.8):
        o = rotary.linear_attention(*(torch.from_numpy(a) for a in (q, k, v)), seq_axis=1, causal=True, decay=decay)
        assert_same_nonfinite_and_close(o.numpy(), linear_oracle(q, k, v, decay=1.0 if decay is None else decay), 2e-4)


# -- 3 and 4: softmax attention: masked keys' NaN, all -inf visible scores ------------------------------
def softmax_oracle(q, k, v, visible, scale):
    """(..., Sq, d) x (..., Sk, d) float64 softmax over the visible keys only (max-subtracted): a query
    with no visible key, or whose visible scores are all -inf, gives 0 (torch's SDPA)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    out = np.zeros(q.shape[:-1] + (v.shape[-1],))
    for idx in np.ndindex(q.shape[:-2]):
        for t in range(q.shape[-2]):
            keys = np.flatnonzero(visible[t])
            if keys.size == 0:
                continue
            with np.errstate(invalid="ignore"):
                sc = (k[idx][keys] @ q[idx][t]) * scale
                w = np.exp(sc - sc.max())
                if not (sc == -np.inf).all():
                    out[idx + (t,)] = (w / w.sum()) @ v[idx][keys]
    return out


@pytest.fixture(params=["tiles", "array-api"])
def softmax_path(request, monkeypatch):
    """The NumPy tile loop (forced for small calls) and the array-API path."""
    monkeypatch.setattr(softmax_module, "_TILES_MIN_SCORES", 0 if request.param == "tiles" else 1 << 60)
    return request.param


def _check_masked_key_nan(attend):
    """``attend(q, k, v, window) -> NumPy o``: a NaN / inf in v (or k) of a key the causal mask (and the
    window) hides from a query leaves that query's output finite and equal to the float64 oracle."""
    r = np.random.default_rng(5)
    q, k, v = (r.standard_normal((1, 2, 10, 8)).astype(np.float32) for _ in range(3))
    v[0, 0, 7, 0] = np.nan
    v[0, 1, 8, 3] = np.inf
    k[0, 1, 9, 2] = np.nan
    for window in (None, 3):
        o = attend(q, k, v, window)
        t, s = np.arange(10)[:, None], np.arange(10)[None, :]
        vis = (s <= t) & ((t - s < window) if window else True)
        assert np.isfinite(o[0, 0, :7]).all() and np.isfinite(o[0, 1, :8]).all()
        assert_same_nonfinite_and_close(o, softmax_oracle(q, k, v, vis, 8 ** -0.5), 2e-5)


def test_softmax_masked_key_nan_does_not_leak(softmax_path):
    """A NaN (or inf) in v of a key the causal mask hides leaked into the outputs of the queries it is
    hidden from (p = 0 times NaN in p @ V); a masked key contributes nothing now."""
    _check_masked_key_nan(lambda q, k, v, window: rotary.attention(q, k, v, causal=True, window=window,
                                                                   block_size=4, rope=False, seq_axis=-2))


def test_softmax_masked_key_nan_does_not_leak_device_path():
    """The same on non-NumPy arrays (torch tensors here): the branch-free visible_matmul of the array-API
    tile loop that CuPy arrays take too (no kernel of its own: rotary/attn/softmax.py is array-API code)."""
    torch = pytest.importorskip("torch")
    _check_masked_key_nan(lambda q, k, v, window: rotary.attention(
        *(torch.from_numpy(a) for a in (q, k, v)), causal=True, window=window, block_size=4, rope=False, seq_axis=-2).numpy())


def test_softmax_all_minus_inf_visible_scores(softmax_path):
    """Decision (documented in rotary.attn.softmax): a query that sees no key gives 0 (flash-attn), and so
    does one whose visible scores are all -inf (infinite data), as torch's scaled_dot_product_attention
    gives (it was NaN on the tile path when the tile was unmasked, 0 when masked); scores that are -inf
    in one key block and finite in a later one give the finite softmax (was NaN on the tile path)."""
    q = np.ones((1, 1, 4, 4), np.float32)
    k = np.ones((1, 1, 8, 4), np.float32)
    v = np.arange(32, dtype=np.float32).reshape(1, 1, 8, 4)
    k[..., :4, :] = -np.inf                      # keys 0..3: score -inf for every query
    q[..., 0, :] = 1.0
    o = rotary.attention(q, k, v, rope=False, block_size=4, seq_axis=-2)
    want = softmax_oracle(q, k, v, np.ones((4, 8), bool), 0.5)
    np.testing.assert_allclose(o, want, rtol=1e-6)   # finite: the -inf keys get weight 0
    for causal in (False, True):                 # unmasked and masked tiles alike
        o = rotary.attention(q, k[..., :4, :], v[..., :4, :], rope=False, block_size=2, causal=causal, seq_axis=-2)
        np.testing.assert_array_equal(o, 0)      # every visible score -inf: 0
    torch = pytest.importorskip("torch")
    ref = torch.nn.functional.scaled_dot_product_attention(*(torch.from_numpy(np.ascontiguousarray(a))
                                                             for a in (q, k[..., :4, :], v[..., :4, :])))
    np.testing.assert_array_equal(ref.numpy(), 0)   # the same as torch's
    hidden = rotary.attention(q, k, v, q_positions=np.arange(4), k_positions=np.arange(8) + 10, causal=True,
                              rope=False, seq_axis=-2)
    np.testing.assert_array_equal(hidden, 0)     # no visible key: 0


# -- 5: rerotate with int64 deltas --------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_rerotate_large_int64_offsets_do_not_wrap(backend):
    """to - from of int64 positions near +-2**62 wrapped around int64; rerotate now equals rotating
    at the destination directly."""
    r = np.random.default_rng(6)
    k = r.standard_normal((1, 4, 8))
    src = np.array([2**62, 2**62 + 1, -(2**62), 5], np.int64)
    dst = np.array([-(2**62), 2**62, 2**62, 2**61], np.int64)
    moved = rotary.rerotate(rotary.apply(k, src, backend=backend, seq_axis=-2), src, dst, backend=backend, seq_axis=-2)
    np.testing.assert_allclose(moved, rotary.apply(k, dst, backend=backend, seq_axis=-2), rtol=1e-9, atol=1e-9)


# -- 6: Dask with length-dependent specs --------------------------------------------------------------
@pytest.mark.parametrize("scaling, mpe", [({"rope_type": "dynamic", "factor": 2.0}, 16),
                                          ({"rope_type": "longrope", "short_factor": [1.0] * 8,
                                            "long_factor": [3.0] * 8, "original_max_position_embeddings": 16}, 64)])
@pytest.mark.parametrize("positions", [None, 3, "array", "dask"])
def test_dask_length_dependent_spec_uses_the_whole_length(scaling, mpe, positions):
    """Each Dask block took dynamic-NTK / LongRoPE frequencies at its own max position; now every block
    uses the whole call's (as one NumPy call does)."""
    da = pytest.importorskip("dask.array")
    spec = rotary.RopeSpec(16, scaling=scaling, max_position_embeddings=mpe)
    x = np.random.default_rng(7).standard_normal((2, 40, 16))
    p = {"array": np.arange(40) * 2, "dask": da.from_array(np.arange(40) * 2, chunks=9)}.get(positions, positions)
    host_p = np.arange(40) * 2 if isinstance(positions, str) else p
    want = rotary.apply(x, host_p, spec=spec, backend="numpy", seq_axis=-2)
    got = rotary.apply(da.from_array(x, chunks=(1, 7, 16)), p, spec=spec, backend="numpy", seq_axis=-2).compute()
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    pos = np.arange(40) * 2 if isinstance(positions, str) else np.arange(40) + (positions or 0)
    seq_len = int(pos.max()) + 1
    oracle = rotate64(x, pos, spec.inv_freq(seq_len)) * spec.attention_scaling_at(seq_len)
    np.testing.assert_allclose(got, oracle, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("causal", [True, False])
def test_dask_linear_attention_length_dependent_spec(causal):
    """Dask linear attention with a dynamic-NTK spec took each block's length; now the whole call's, also
    when continuing a state (whose spec stays the caller's)."""
    da = pytest.importorskip("dask.array")
    spec = rotary.RopeSpec(8, scaling={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=8)
    r = np.random.default_rng(9)
    q, k, v = (r.standard_normal((1, 2, 30, 8)) for _ in range(3))
    chunks = (1, 2, 7, 8)
    want = rotary.linear_attention(q, k, v, spec=spec, causal=causal, seq_axis=-2)
    got = rotary.linear_attention(*(da.from_array(a, chunks=chunks) for a in (q, k, v)), spec=spec, causal=causal, seq_axis=-2)
    np.testing.assert_allclose(got.compute(), want, rtol=1e-12, atol=1e-12)
    _, state = rotary.linear_attention(q[:, :, :10], k[:, :, :10], v[:, :, :10], spec=spec, causal=causal,
                                       return_state=True, seq_axis=-2)
    want = rotary.linear_attention(q[:, :, 10:], k[:, :, 10:], v[:, :, 10:], causal=causal, state=state, seq_axis=-2)
    got, after = rotary.linear_attention(*(da.from_array(a[:, :, 10:], chunks=chunks) for a in (q, k, v)),
                                         causal=causal, state=state, return_state=True, seq_axis=-2)
    np.testing.assert_allclose(got.compute(), want, rtol=1e-12, atol=1e-12)
    assert after.spec == spec


@pytest.mark.parametrize("backend", ["numba", pytest.param("cuda-shim", marks=pytest.mark.cuda_cpu)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("m", [2, 16])
def test_numba_relu_of_minus_inf_is_zero(backend, dtype, m, request):
    """The Numba kernels' relu feature was ``x * 0`` below 0: -inf * 0 = NaN (NumPy's maximum(x, 0) is 0);
    now relu(-inf) = 0 on the scalar and SIMD paths, and a NaN stays NaN. The CUDA kernel's relu gave 0
    for NaN too (x > 0 ? x : 0): a NaN key feature was dropped; now it stays NaN."""
    if backend == "numba" and "numba" not in BACKENDS:
        pytest.skip("numba not installed")
    backend = backend_name(backend, request)
    q = np.random.default_rng(1).standard_normal((1, 1, 3, m)).astype(dtype)
    k = q.copy()
    k[0, 0, 0, 0] = -np.inf
    k[0, 0, 1, 1] = np.nan
    for causal in (False, True):
        a = rotary.linear_attention(q, k, q, feature_map="relu", normalize=False, causal=causal, backend=backend, seq_axis=-2)
        b = rotary.linear_attention(q, k, q, feature_map="relu", normalize=False, causal=causal, backend="numpy", seq_axis=-2)
        np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
        np.testing.assert_allclose(np.nan_to_num(a), np.nan_to_num(b), rtol=1e-5, atol=1e-6)
        assert np.isfinite(a[0, 0, 0]).all() == bool(causal)   # token 0 sees only itself when causal


@pytest.mark.parametrize("backend", LINEAR_BACKENDS)
@pytest.mark.parametrize("feature_map", ["elu", "relu", "identity"])
def test_linear_attention_nonfinite_features_match_numpy(backend, feature_map, request):
    """-inf, NaN and inf inputs to each feature map, in q and k, causal or not: the non-finite entries of
    every backend's output are NumPy's (phi(-inf) is 0 for elu + 1 and relu, NaN stays NaN) and the
    finite ones agree."""
    backend = backend_name(backend, request)
    r = np.random.default_rng(2)
    q, k, v = (r.standard_normal((1, 1, 6, 4)).astype(np.float32) for _ in range(3))
    q[0, 0, 1, 2], k[0, 0, 2, 0], k[0, 0, 4, 3] = -np.inf, -np.inf, np.nan
    if feature_map != "identity":   # identity: -inf is a value like any other (inf - inf orders differ)
        q[0, 0, 3, 1] = np.nan
    for causal in (False, True):
        kw = dict(feature_map=feature_map, causal=causal, normalize=feature_map != "identity", seq_axis=-2)
        a = rotary.linear_attention(q, k, v, backend=backend, **kw)
        b = rotary.linear_attention(q, k, v, backend="numpy", **kw)
        np.testing.assert_array_equal(np.isnan(a), np.isnan(b), err_msg=f"causal={causal}")
        np.testing.assert_allclose(np.nan_to_num(a), np.nan_to_num(b), rtol=1e-4, atol=1e-5)
