"""Linear attention with RoPE in the numerator (RoFormer eq. 19) against a quadratic float64 oracle.

The oracle below is written from the formula, independent of the library's tables and backends:
    o_t = sum_s (R_{p_t} a_t)^T (R_{p_s} b_s) v_s / (sum_s a_t^T b_s + eps),  a = phi(q), b = phi(k),
with M[t, s] = 1 for s <= t (causal) or for every s, R built from complex multiplication.
Every backend that has ``linear_attention`` runs the same cases.
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import rotary
from rotary import backends as _backends
from rotary.testing import to_numpy64

from .conftest import ALL_BACKENDS


# -- backends ----------------------------------------------------------------------------------
def _backend_params():
    avail = _backends.available_backends()
    params = []
    for name in ALL_BACKENDS:
        ok, reason = avail[name]
        if ok and not hasattr(_backends.get(name), "linear_attention"):
            ok, reason = False, f"backend {name} has no linear_attention yet"
        params.append(pytest.param(name, marks=() if ok else pytest.mark.skip(reason=reason), id=name))
    return params


BACKENDS = _backend_params()


def _to_backend(backend):
    """The array constructor for a backend's own array type (CuPy arrays for 'cupy', else NumPy)."""
    if backend == "cupy":
        import cupy

        return cupy.asarray
    return np.asarray


# -- the oracle --------------------------------------------------------------------------------
def phi64(x, feature_map):
    x = np.asarray(x, dtype=np.float64)
    if feature_map == "elu":
        return np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0.0)))
    if feature_map == "relu":
        return np.maximum(x, 0.0)
    return x


def rotate64(x, positions, spec):
    """R_p x by complex multiplication per pair; positions broadcastable to x.shape[:-1]."""
    r = spec.rotary_dim
    half = r // 2
    idx = np.arange(half)
    ia, ib = (idx, idx + half) if spec.layout == "half" else (2 * idx, 2 * idx + 1)
    theta = np.asarray(positions, dtype=np.float64)[..., None] * spec.inv_freq()
    z = (x[..., ia] + 1j * x[..., ib]) * spec.attention_scaling * np.exp(1j * theta)
    y = x.copy()
    y[..., ia], y[..., ib] = z.real, z.imag
    return y


def oracle(q, k, v, positions, spec, *, causal, feature_map="elu", eps=1e-6, mask=None):
    """Quadratic float64 reference for (..., T, d) inputs (sequence axis -2)."""
    a, b = phi64(q, feature_map), phi64(k, feature_map)
    v = np.asarray(v, dtype=np.float64)
    T = q.shape[-2]
    if mask is None:
        mask = np.tril(np.ones((T, T))) if causal else np.ones((T, T))
    ah, bh = rotate64(a, positions, spec), rotate64(b, positions, spec)
    num = ((ah @ np.swapaxes(bh, -1, -2)) * mask) @ v
    den = ((a @ np.swapaxes(b, -1, -2)) * mask).sum(-1, keepdims=True)
    return num / (den + eps)


def rel_rms(actual, desired):
    actual, desired = to_numpy64(actual), np.asarray(desired, dtype=np.float64)
    assert actual.shape == desired.shape, (actual.shape, desired.shape)
    return float(np.linalg.norm(actual - desired) / max(np.linalg.norm(desired), 1e-300))


TOL = {"float64": 1e-12, "float32": 1e-5, "float16": 2e-3}


def _inputs(rng, shape, dv, dtype=np.float64):
    q = rng.standard_normal(shape)
    k = rng.standard_normal(shape)
    v = rng.standard_normal((*shape[:-1], dv))
    return (a.astype(dtype) for a in (q, k, v))


# -- against the oracle ------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("T,chunk", [(1, 64), (13, 64), (63, 64), (64, 64), (65, 64), (7, 8), (8, 8), (9, 8), (33, 8)])
def test_matches_oracle(backend, dtype, layout, causal, T, chunk):
    rng = np.random.default_rng(T * 100 + chunk)
    B, H, d, dv = 2, 3, 8, 5
    q, k, v = _inputs(rng, (B, H, T, d), dv, dtype)
    spec = rotary.RopeSpec(d)
    expected = oracle(q, k, v, np.arange(T), spec, causal=causal)
    xb = _to_backend(backend)
    if layout == "bshd":   # (B, T, H, d), sequence axis -3
        args = [xb(np.ascontiguousarray(np.swapaxes(a, 1, 2))) for a in (q, k, v)]
        o = rotary.linear_attention(*args, causal=causal, chunk=chunk, seq_axis=-3, backend=backend)
        o = np.swapaxes(to_numpy64(o), 1, 2)
    else:
        args = [xb(a) for a in (q, k, v)]
        o = rotary.linear_attention(*args, causal=causal, chunk=chunk, backend=backend, seq_axis=-2)
        assert type(o) is type(args[0]) and o.dtype == args[0].dtype
    assert rel_rms(o, expected) <= TOL[dtype]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
def test_long_sequence_float32(backend, causal):
    """T = 1027 (16 chunks + 3): fp32 chunked sums stay within 1e-5 (rel RMS) of the float64 oracle."""
    rng = np.random.default_rng(99)
    T = 1027
    q, k, v = _inputs(rng, (1, 2, T, 32), 16, np.float32)
    spec = rotary.RopeSpec(32)
    xb = _to_backend(backend)
    o = rotary.linear_attention(xb(q), xb(k), xb(v), causal=causal, spec=spec, backend=backend, seq_axis=-2)
    assert rel_rms(o, oracle(q, k, v, np.arange(T), spec, causal=causal)) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", ["offset", "per_batch", "odd_dim", "partial", "interleaved", "relu", "identity",
                                  "strided"])
def test_positions_dims_and_maps(backend, causal, case):
    rng = np.random.default_rng(7)
    B, H, T, d, dv = 3, 2, 21, 8, 4
    spec_kw, feature_map, positions, oracle_pos = {}, "elu", None, np.arange(T)
    if case == "offset":
        positions, oracle_pos = 1000, 1000 + np.arange(T)
    elif case == "per_batch":
        positions = rng.integers(-50, 10**6, size=(B, T))
        oracle_pos = positions[:, None, :]
    elif case == "odd_dim":
        d = 7
    elif case == "partial":
        d, spec_kw = 10, {"rotary_dim": 4, "base": 500.0}
    elif case == "interleaved":
        spec_kw = {"layout": "interleaved"}
    elif case in ("relu", "identity"):
        feature_map = case
    q, k, v = _inputs(rng, (B, H, T, d), dv)
    if case == "identity":   # keep phi >= 0 so the denominator stays away from 0
        q, k = np.abs(q), np.abs(k)
    if case == "strided":   # non-contiguous views; the inputs must not change
        q, k, v = (np.asfortranarray(a)[:, ::-1] for a in (q, k, v))
    before = [a.copy() for a in (q, k, v)]
    spec = rotary.RopeSpec(d, **spec_kw)
    expected = oracle(q, k, v, oracle_pos, spec, causal=causal, feature_map=feature_map)
    xb = _to_backend(backend)
    o = rotary.linear_attention(xb(q), xb(k), xb(v), positions, causal=causal, feature_map=feature_map,
                                spec=spec, chunk=8, backend=backend, seq_axis=-2)
    angle_error = 2e-16 * np.abs(oracle_pos).max()   # float64 p * theta at large p, in either computation
    assert rel_rms(o, expected) <= 1e-12 + angle_error
    for a, b in zip((q, k, v), before):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_five_axes_with_per_batch_positions_and_resume(backend):
    """(batch, group, seq, heads, d) with seq_axis=2: positions (batch, seq) repeat over groups and heads."""
    rng = np.random.default_rng(8)
    B, G, T, H, d, dv = 2, 3, 11, 2, 6, 4
    q, k, v = _inputs(rng, (B, G, T, H, d), dv)
    positions = np.array([0, 40])[:, None] + np.arange(T)
    spec = rotary.RopeSpec(d)
    q_, k_, v_ = (np.moveaxis(a, 2, 3) for a in (q, k, v))   # (batch, group, heads, seq, d) for the oracle
    expected = np.moveaxis(oracle(q_, k_, v_, positions[:, None, None, :], spec, causal=True), 3, 2)
    xb = _to_backend(backend)
    q, k, v = xb(q), xb(k), xb(v)
    o1, state = rotary.linear_attention(q[:, :, :4], k[:, :, :4], v[:, :, :4], positions[:, :4], causal=True,
                                        seq_axis=2, return_state=True, chunk=3, backend=backend)
    assert state.S.shape == (B, G, H, d, dv)
    np.testing.assert_array_equal(state.next_position, [4, 44])
    o2 = rotary.linear_attention(q[:, :, 4:], k[:, :, 4:], v[:, :, 4:], causal=True, seq_axis=2, state=state,
                                 chunk=3, backend=backend)
    assert rel_rms(np.concatenate([to_numpy64(o1), to_numpy64(o2)], axis=2), expected) <= 1e-12


@pytest.mark.parametrize("backend", BACKENDS)
def test_float16_computes_in_float32(backend):
    rng = np.random.default_rng(3)
    q, k, v = _inputs(rng, (2, 2, 70, 8), 8, np.float16)
    xb = _to_backend(backend)
    o, state = rotary.linear_attention(xb(q), xb(k), xb(v), causal=True, return_state=True, backend=backend, seq_axis=-2)
    assert o.dtype == np.float16 and state.S.dtype == np.float32 and state.z.dtype == np.float32
    expected = oracle(q, k, v, np.arange(70), rotary.RopeSpec(8), causal=True)
    assert rel_rms(o, expected) <= TOL["float16"]


def test_yarn_attention_scaling_multiplies_the_numerator():
    rng = np.random.default_rng(5)
    spec = rotary.RopeSpec(8, scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
    assert spec.attention_scaling != 1.0
    q, k, v = _inputs(rng, (1, 2, 30, 8), 3)
    o = rotary.linear_attention(q, k, v, causal=True, spec=spec, backend="numpy", seq_axis=-2)
    assert rel_rms(o, oracle(q, k, v, np.arange(30), spec, causal=True)) <= 1e-12


# -- other array libraries ---------------------------------------------------------------------
@pytest.mark.parametrize("causal", [False, True])
def test_torch_inputs(causal):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(11)
    q, k, v = _inputs(rng, (2, 20, 3, 6), 4)   # (B, T, H, d)
    expected = np.swapaxes(oracle(*(np.swapaxes(a, 1, 2) for a in (q, k, v)), np.arange(20), rotary.RopeSpec(6),
                                  causal=causal), 1, 2)
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        tq, tk, tv = (torch.asarray(a).to(dtype) for a in (q, k, v))
        o, state = rotary.linear_attention(tq, tk, tv, causal=causal, seq_axis=-3, chunk=8, return_state=True)
        assert isinstance(o, torch.Tensor) and o.dtype == dtype and isinstance(state.S, torch.Tensor)
        assert state.S.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        exp = expected if dtype != torch.bfloat16 else oracle(
            *(np.swapaxes(to_numpy64(a), 1, 2) for a in (tq, tk, tv)), np.arange(20), rotary.RopeSpec(6),
            causal=causal).swapaxes(1, 2)
        assert rel_rms(o, exp) <= tol


@pytest.mark.parametrize("causal", [False, True])
def test_array_api_strict_inputs(causal):
    xps = pytest.importorskip("array_api_strict")
    rng = np.random.default_rng(12)
    q, k, v = _inputs(rng, (2, 3, 19, 8), 5)
    xq, xk, xv = (xps.asarray(a) for a in (q, k, v))
    o1, state = rotary.linear_attention(xq[:, :, :9, ...], xk[:, :, :9, ...], xv[:, :, :9, ...], causal=causal, chunk=4,
                                        return_state=True, seq_axis=-2)
    o2 = rotary.linear_attention(xq[:, :, 9:, ...], xk[:, :, 9:, ...], xv[:, :, 9:, ...], causal=causal, chunk=4,
                                 state=state, seq_axis=-2)
    assert type(o1) is type(xq) and o1.dtype == xps.float64 and type(state.S) is type(xq)
    T = 19
    mask = np.tril(np.ones((T, T)))
    if not causal:   # non-causal with a state: tokens 0..8 see 0..8, tokens 9..18 see every token
        mask = np.zeros((T, T))
        mask[:9, :9] = 1
        mask[9:, :] = 1
    expected = oracle(q, k, v, np.arange(T), rotary.RopeSpec(8), causal=causal, mask=mask)
    o = np.concatenate([np.asarray(o1), np.asarray(o2)], axis=2)
    assert rel_rms(o, expected) <= 1e-12


# -- state: split and resume -------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_split_and_resume_at_every_cut(backend, dtype):
    rng = np.random.default_rng(21)
    B, H, T, d, dv = 2, 2, 19, 6, 3
    q, k, v = _inputs(rng, (B, H, T, d), dv, dtype)
    positions = rng.integers(0, 10**5, size=(B,))[:, None] + np.arange(T)
    xb = _to_backend(backend)
    q, k, v = xb(q), xb(k), xb(v)
    full, full_state = rotary.linear_attention(q, k, v, positions, causal=True, chunk=4, return_state=True,
                                               backend=backend, seq_axis=-2)
    for cut in range(T + 1):
        o1, state = rotary.linear_attention(q[:, :, :cut], k[:, :, :cut], v[:, :, :cut], positions[:, :cut],
                                            causal=True, chunk=4, return_state=True, backend=backend, seq_axis=-2)
        if cut:
            np.testing.assert_array_equal(state.next_position, positions[:, cut - 1] + 1)
        carried = to_numpy64(state.S), to_numpy64(state.z)
        o2, state2 = rotary.linear_attention(q[:, :, cut:], k[:, :, cut:], v[:, :, cut:], positions[:, cut:],
                                             causal=True, chunk=4, state=state, return_state=True,
                                             backend=backend, seq_axis=-2)
        np.testing.assert_array_equal(to_numpy64(state.S), carried[0])   # the state is not consumed
        np.testing.assert_array_equal(to_numpy64(state.z), carried[1])
        joined = np.concatenate([to_numpy64(o1), to_numpy64(o2)], axis=2)
        assert rel_rms(joined, to_numpy64(full)) <= TOL[dtype], cut
        assert rel_rms(state2.S, to_numpy64(full_state.S)) <= TOL[dtype], cut
        assert rel_rms(state2.z, to_numpy64(full_state.z)) <= TOL[dtype], cut


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_token_by_token_continues_positions(backend):
    rng = np.random.default_rng(22)
    q, k, v = _inputs(rng, (1, 2, 12, 8), 4)
    spec = rotary.RopeSpec(8, base=100.0)
    xb = _to_backend(backend)
    q, k, v = xb(q), xb(k), xb(v)
    expected = oracle(*(to_numpy64(a) for a in (q, k, v)), 500 + np.arange(12), spec, causal=True)
    outs = []
    o, state = rotary.linear_attention(q[:, :, :5], k[:, :, :5], v[:, :, :5], 500, causal=True, spec=spec,
                                       return_state=True, backend=backend, seq_axis=-2)
    outs.append(o)
    for t in range(5, 12):   # positions=None and no spec: the state's next position and spec
        assert state.next_position == 500 + t
        o, state = rotary.linear_attention(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], causal=True,
                                           state=state, return_state=True, backend=backend, seq_axis=-2)
        outs.append(o)
    assert rel_rms(np.concatenate([to_numpy64(o) for o in outs], axis=2), expected) <= 1e-12


def test_per_batch_next_position_continues():
    rng = np.random.default_rng(23)
    q, k, v = _inputs(rng, (2, 3, 10, 4), 2)
    starts = np.array([0, 70])
    positions = starts[:, None] + np.arange(10)
    full = rotary.linear_attention(q, k, v, positions, causal=True, seq_axis=-2)
    o1, state = rotary.linear_attention(q[:, :, :6], k[:, :, :6], v[:, :, :6], positions[:, :6], causal=True,
                                        return_state=True, seq_axis=-2)
    np.testing.assert_array_equal(state.next_position, starts + 6)
    o2 = rotary.linear_attention(q[:, :, 6:], k[:, :, 6:], v[:, :, 6:], causal=True, state=state, seq_axis=-2)
    assert rel_rms(np.concatenate([o1, o2], axis=2), full) <= 1e-12


def test_non_causal_state_is_the_sum_of_all_tokens():
    rng = np.random.default_rng(24)
    q, k, v = _inputs(rng, (2, 9, 4), 3)   # no batch axis before seq: (H, T, d)
    spec = rotary.RopeSpec(4)
    _, state = rotary.linear_attention(q, k, v, causal=False, return_state=True, seq_axis=-2)
    b = phi64(k, "elu")
    np.testing.assert_allclose(state.z, b.sum(-2), rtol=1e-13)
    np.testing.assert_allclose(state.S, np.swapaxes(rotate64(b, np.arange(9), spec), -1, -2) @ v, rtol=1e-12)
    assert state.next_position == 9


def test_empty_sequence_keeps_the_state():
    rng = np.random.default_rng(25)
    q, k, v = _inputs(rng, (1, 2, 5, 4), 3)
    o, state = rotary.linear_attention(q, k, v, causal=True, return_state=True, seq_axis=-2)
    o0, state0 = rotary.linear_attention(q[:, :, :0], k[:, :, :0], v[:, :, :0], causal=True, state=state,
                                         return_state=True, seq_axis=-2)
    assert o0.shape == (1, 2, 0, 3) and state0 is state
    o0, fresh = rotary.linear_attention(q[:, :, :0], k[:, :, :0], v[:, :, :0], 7, causal=True, return_state=True, seq_axis=-2)
    assert fresh.next_position == 7 and not np.any(fresh.S) and fresh.S.dtype == np.float64


def test_state_is_immutable_and_float32_for_float16():
    q, k, v = _inputs(np.random.default_rng(26), (1, 4, 4), 2, np.float16)
    _, state = rotary.linear_attention(q, k, v, causal=True, return_state=True, seq_axis=-2)
    assert state.S.dtype == np.float32 and state.S.shape == (1, 4, 2) and state.z.shape == (1, 4)
    with pytest.raises(AttributeError):
        state.next_position = 3
    assert "LinearAttentionState" in repr(state)


def test_state_pickles_and_copies():
    import copy
    import pickle

    spec = rotary.RopeSpec(4, base=500.0)
    try:
        pickle.loads(pickle.dumps(spec))
    except AttributeError:
        pytest.skip("RopeSpec does not pickle here")
    q, k, v = _inputs(np.random.default_rng(27), (2, 6, 4), 3)
    positions = np.array([[0, 1, 2, 3, 4, 5], [9, 10, 11, 12, 13, 14]])
    _, state = rotary.linear_attention(q, k, v, positions, causal=True, spec=spec, return_state=True, seq_axis=-2)
    for other in (pickle.loads(pickle.dumps(state)), copy.deepcopy(state)):
        assert other.spec == spec and other.feature_map == "elu"
        np.testing.assert_array_equal(other.S, state.S)
        np.testing.assert_array_equal(other.next_position, [6, 15])


# -- properties --------------------------------------------------------------------------------
_settings = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_settings
@given(seed=st.integers(0, 2**32 - 1), T=st.integers(1, 24), p=st.integers(-10**6, 10**9),
       causal=st.booleans())
def test_equal_positions_give_plain_linear_attention(seed, T, p, causal):
    rng = np.random.default_rng(seed)
    q, k, v = _inputs(rng, (2, T, 6), 3)
    o = rotary.linear_attention(q, k, v, np.full(T, p), causal=causal, chunk=5, seq_axis=-2)
    a, b = phi64(q, "elu"), phi64(k, "elu")
    mask = np.tril(np.ones((T, T))) if causal else np.ones((T, T))
    w = (a @ np.swapaxes(b, -1, -2)) * mask
    plain = (w @ v) / (w.sum(-1, keepdims=True) + 1e-6)
    assert rel_rms(o, plain) <= 1e-12


@_settings
@given(seed=st.integers(0, 2**32 - 1), T=st.integers(1, 40), causal=st.booleans(),
       layout=st.sampled_from(["half", "interleaved"]))
def test_shift_invariance_float32(seed, T, causal, layout):
    rng = np.random.default_rng(seed)
    q, k, v = _inputs(rng, (2, 2, T, 8), 4, np.float32)
    spec = rotary.RopeSpec(8, layout=layout)
    shifted = rotary.linear_attention(q, k, v, 10**9, causal=causal, spec=spec, chunk=16, seq_axis=-2)
    expected = oracle(q, k, v, np.arange(T), spec, causal=causal)
    assert rel_rms(shifted, expected) <= 1e-5


@_settings
@given(seed=st.integers(0, 2**32 - 1), T=st.integers(1, 30), d=st.sampled_from([4, 7, 10]), causal=st.booleans())
def test_interleaved_equals_half_on_permuted_features(seed, T, d, causal):
    rng = np.random.default_rng(seed)
    q, k, v = _inputs(rng, (2, T, d), 3)
    inter = rotary.linear_attention(q, k, v, 17, causal=causal, layout="interleaved", chunk=4, seq_axis=-2)
    qh, kh = (rotary.convert_layout(x, to="half") for x in (q, k))
    half = rotary.linear_attention(qh, kh, v, 17, causal=causal, layout="half", chunk=4, seq_axis=-2)
    assert rel_rms(half, inter) <= 1e-12


@_settings
@given(seed=st.integers(0, 2**32 - 1), lengths=st.lists(st.integers(0, 12), min_size=1, max_size=5),
       chunk=st.integers(1, 9), causal=st.booleans())
def test_a_chain_of_calls_equals_the_oracle(seed, lengths, chunk, causal):
    """Segments of any lengths; causal: one causal call; non-causal: each segment sees all before and itself."""
    rng = np.random.default_rng(seed)
    T = sum(lengths)
    q, k, v = _inputs(rng, (2, T, 4), 2)
    outs, state, start = [], None, 0
    mask = np.zeros((T, T))
    for n in lengths:
        o, state = rotary.linear_attention(q[:, start:start + n], k[:, start:start + n], v[:, start:start + n],
                                           causal=causal, chunk=chunk, state=state, return_state=True, seq_axis=-2)
        outs.append(o)
        mask[start:start + n, :start + n] = 1
        start += n
    assert state.next_position == T
    if causal:
        mask = np.tril(np.ones((T, T)))
    expected = oracle(q, k, v, np.arange(T), rotary.RopeSpec(4), causal=causal, mask=mask)
    assert rel_rms(np.concatenate(outs, axis=1), expected) <= 1e-12


def _elu_plus_one_times_row_scale(x):
    """phi(x) = (elu(x) + 1) * exp(mean(x)): a positive per-row scale (1 on rows of mean 0)."""
    import array_api_compat

    xp = array_api_compat.array_namespace(x)
    base = xp.exp(xp.minimum(x, xp.zeros_like(x))) + xp.maximum(x, xp.zeros_like(x))
    return base * xp.exp(xp.mean(x, axis=-1, keepdims=True))


@_settings
@given(seed=st.integers(0, 2**32 - 1), T=st.integers(1, 30), causal=st.booleans())
def test_positive_row_scale_on_phi_q_cancels(seed, T, causal):
    rng = np.random.default_rng(seed)
    q, k, v = _inputs(rng, (2, T, 6), 3)
    q = q * 3.0
    k = k - k.mean(-1, keepdims=True)   # the callable's scale is 1 on every key row
    scaled = rotary.linear_attention(q, k, v, causal=causal, eps=0.0, feature_map=_elu_plus_one_times_row_scale,
                                     chunk=7, seq_axis=-2)
    plain = rotary.linear_attention(q, k, v, causal=causal, eps=0.0, chunk=7, seq_axis=-2)
    assert rel_rms(scaled, plain) <= 1e-12


@_settings
@given(seed=st.integers(0, 2**32 - 1), T=st.integers(1, 50), scale=st.floats(0.0, 60.0),
       feature_map=st.sampled_from(["elu", "relu"]), eps=st.floats(1e-12, 1.0), causal=st.booleans())
def test_no_nan_for_positive_eps(seed, T, scale, feature_map, eps, causal):
    rng = np.random.default_rng(seed)
    q, k, v = _inputs(rng, (1, 2, T, 8), 4, np.float32)
    o, state = rotary.linear_attention(q * scale, k * scale, v, causal=causal, feature_map=feature_map, eps=eps,
                                       return_state=True, chunk=16, seq_axis=-2)
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(state.S)) and np.all(np.isfinite(state.z))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chunk", [1, 3, 16, 1000])
def test_chunk_length_does_not_change_the_result(backend, chunk):
    rng = np.random.default_rng(31)
    q, k, v = _inputs(rng, (2, 2, 37, 8), 8)
    xb = _to_backend(backend)
    o = rotary.linear_attention(xb(q), xb(k), xb(v), causal=True, chunk=chunk, backend=backend, seq_axis=-2)
    assert rel_rms(o, oracle(q, k, v, np.arange(37), rotary.RopeSpec(8), causal=True)) <= 1e-12


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_callable_feature_map_on_every_backend(backend, dtype):
    rng = np.random.default_rng(33)
    q, k, v = _inputs(rng, (2, 2, 20, 6), 3, dtype)
    xb = _to_backend(backend)

    def softplus(x):
        import array_api_compat

        xp = array_api_compat.array_namespace(x)
        return xp.log(1 + xp.exp(x))

    o = rotary.linear_attention(xb(q), xb(k), xb(v), causal=True, feature_map=softplus, backend=backend, seq_axis=-2)
    assert o.dtype == np.dtype(dtype)
    a, b = (np.log1p(np.exp(np.asarray(x, dtype=np.float64))) for x in (q, k))
    expected = oracle(a, b, v, np.arange(20), rotary.RopeSpec(6), causal=True, feature_map="identity")
    assert rel_rms(o, expected) <= TOL[dtype]


def test_callable_may_change_the_feature_dim():
    rng = np.random.default_rng(32)
    q, k, v = _inputs(rng, (2, 11, 3), 2)

    def doubled(x):
        return np.concatenate([np.exp(x), np.exp(-x)], axis=-1)

    spec = rotary.RopeSpec(6)
    o = rotary.linear_attention(q, k, v, causal=True, feature_map=doubled, spec=spec, seq_axis=-2)
    expected = oracle(doubled(q), doubled(k), v, np.arange(11), spec, causal=True, feature_map="identity")
    assert rel_rms(o, expected) <= 1e-12


# -- bad input ---------------------------------------------------------------------------------
def _qkv(T=(5, 5, 5), d=(4, 4), dv=3):
    rng = np.random.default_rng(0)
    return (rng.standard_normal((2, T[0], d[0])), rng.standard_normal((2, T[1], d[1])),
            rng.standard_normal((2, T[2], dv)))


@pytest.mark.parametrize("kwargs,args,exc,match", [
    ({}, _qkv(T=(5, 4, 5)), ValueError, "sequence length"),
    ({}, _qkv(T=(5, 5, 6)), ValueError, "sequence length"),
    ({}, _qkv(d=(4, 6)), ValueError, "k's last dim"),
    ({"feature_map": "softmax"}, _qkv(), ValueError, "feature_map"),
    ({"feature_map": 3}, _qkv(), ValueError, "feature_map"),
    ({"eps": -1e-6}, _qkv(), ValueError, "eps"),
    ({"eps": float("nan")}, _qkv(), ValueError, "eps"),
    ({"eps": "1e-6"}, _qkv(), TypeError, "eps"),
    ({"causal": 1}, _qkv(), TypeError, "causal"),
    ({"causal": "yes"}, _qkv(), TypeError, "causal"),
    ({"return_state": None}, _qkv(), TypeError, "return_state"),
    ({"chunk": 0}, _qkv(), ValueError, "chunk"),
    ({"chunk": 2.0}, _qkv(), TypeError, "chunk"),
    ({"state": "S"}, _qkv(), TypeError, "state"),
    ({"spec": rotary.RopeSpec(6)}, _qkv(), ValueError, "head_dim"),
    ({"backend": "nope"}, _qkv(), ValueError, "backend"),
])
def test_bad_input_names_the_argument(kwargs, args, exc, match):
    kwargs.setdefault("seq_axis", -2)
    with pytest.raises(exc, match=match):
        rotary.linear_attention(*args, **kwargs)


def test_bad_arrays():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="q"):
        rotary.linear_attention(q.astype(np.int64), k, v, seq_axis=-2)
    with pytest.raises(TypeError, match="dtype"):
        rotary.linear_attention(q, k.astype(np.float32), v, seq_axis=-2)
    with pytest.raises(ValueError, match="v"):
        rotary.linear_attention(q, k, v[:1], seq_axis=-2)
    with pytest.raises(ValueError, match="feature_map"):
        rotary.linear_attention(q, k, v, feature_map=lambda x: x[..., :-1, :], seq_axis=-2)


def test_state_from_another_call_is_rejected():
    q, k, v = _qkv()
    _, state = rotary.linear_attention(q, k, v, causal=True, return_state=True, seq_axis=-2)
    with pytest.raises(ValueError, match="state"):   # another batch shape
        rotary.linear_attention(q[:1], k[:1], v[:1], causal=True, state=state, seq_axis=-2)
    with pytest.raises(ValueError, match="state"):   # another dv
        rotary.linear_attention(q, k, v[..., :2], causal=True, state=state, seq_axis=-2)
    with pytest.raises(ValueError, match="state"):   # another spec
        rotary.linear_attention(q, k, v, causal=True, state=state, base=500.0, seq_axis=-2)
    with pytest.raises(ValueError, match="state"):   # another feature map
        rotary.linear_attention(q, k, v, causal=True, state=state, feature_map="relu", seq_axis=-2)
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="state"):    # another array library
        rotary.linear_attention(*(torch.asarray(a) for a in (q, k, v)), causal=True, state=state, seq_axis=-2)


# -- the docs page's figure script (its code blocks: tests/test_docs.py) ---------------------------------
def test_plot_script_mass_is_the_weight_sum(monkeypatch):
    pytest.importorskip("matplotlib")
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "docs" / "scripts" / "plot_linear_attention.py"
    spec = importlib.util.spec_from_file_location("plot_linear_attention_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "T", 40)
    monkeypatch.setattr(module, "HEADS", 2)
    mass = module.mass(10_000.0)
    rng = np.random.default_rng(module.SEED)
    q, k = rng.standard_normal((2, 40, module.D)), rng.standard_normal((2, 40, module.D))
    a, b = phi64(q, "elu"), phi64(k, "elu")
    spec = rotary.RopeSpec(module.D, base=10_000.0)
    num = np.tril(rotate64(a, np.arange(40), spec) @ np.swapaxes(rotate64(b, np.arange(40), spec), -1, -2))
    den = np.tril(a @ np.swapaxes(b, -1, -2))
    np.testing.assert_allclose(mass, num.sum(-1) / den.sum(-1), rtol=1e-12, atol=1e-14)
    assert np.allclose(mass[:, 0], 1.0)


@pytest.mark.parametrize("backend", ["numpy", "numba"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("groups, normalize, feature_map", [(1, True, "elu"), (4, True, "relu"),
                                                            (2, False, "identity")])
def test_decode_step_fast_path_equals_general_path(backend, dtype, groups, normalize, feature_map, monkeypatch):
    """A (B, 1, H, d) decode step continuing a state goes straight to the backend once the general path has
    checked the first one-token call (its plan rides on the state): the same bits and the same state as the
    general path (forced here by passing the state's next position explicitly), step after step, and the
    general path is really skipped; the prefill before it is checked against the oracle."""
    if not _backends.available_backends()[backend][0]:
        pytest.skip(_backends.available_backends()[backend][1])
    import rotary.attn.linear as la

    rng = np.random.default_rng(7)
    B, H, d, dv, T = 2, 4, 16, 8, 5
    Hk = H // groups
    spec = rotary.RopeSpec(d, base=500.0)
    q, k, v = (rng.standard_normal((B, T, h, n)).astype(dtype) for h, n in ((H, d), (Hk, d), (Hk, dv)))
    kw = dict(causal=True, seq_axis=1, backend=backend, feature_map=feature_map, normalize=normalize)
    o, state = rotary.linear_attention(q[:, :2], k[:, :2], v[:, :2], spec=spec, return_state=True, **kw)
    if groups == 1 and normalize:
        want = oracle(*(x[:, :2].swapaxes(1, 2) for x in (q, k, v)), np.arange(2), spec, causal=True,
                      feature_map=feature_map).swapaxes(1, 2)
        np.testing.assert_allclose(o, want, rtol=1e-4 if dtype == np.float32 else 1e-10,
                                   atol=1e-4 if dtype == np.float32 else 1e-10)
    fast_state, general_state = state, state
    general = la._linear_attention
    for t in range(2, T):
        step = (q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1])
        o_general, general_state = rotary.linear_attention(*step, general_state.next_position, state=general_state,
                                                           return_state=True, **kw)
        if t > 2:   # the first one-token call is checked by the general path, which makes the step's plan
            monkeypatch.setattr(la, "_linear_attention", None)   # the later ones must not need it
        o_fast, fast_state = rotary.linear_attention(*step, state=fast_state, return_state=True, **kw)
        monkeypatch.setattr(la, "_linear_attention", general)
        assert fast_state._step is not None
        np.testing.assert_array_equal(o_fast, o_general)
        assert o_fast.dtype == dtype and o_fast.shape == (B, 1, H, dv)
        np.testing.assert_array_equal(fast_state.S, general_state.S)
        assert (fast_state.z is None) == (not normalize)
        if normalize:
            np.testing.assert_array_equal(fast_state.z, general_state.z)
        assert fast_state.next_position == general_state.next_position == t + 1
        assert (fast_state.groups, fast_state.normalize, fast_state.feature_map) == (groups, normalize, feature_map)
    # the whole sequence in one call gives what the decode steps gave at the last token
    o_all = rotary.linear_attention(q, k, v, spec=spec, **kw)
    np.testing.assert_allclose(o_fast, o_all[:, -1:], rtol=1e-4 if dtype == np.float32 else 1e-10,
                               atol=1e-4 if dtype == np.float32 else 1e-10)


def test_decode_step_fast_path_keeps_the_checks():
    """Arguments the state does not vouch for are still checked on a decode step (eps=inf, a state for
    another feature map): the general path takes the call and raises."""
    q = np.ones((1, 2, 2, 8), np.float32)
    _, state = rotary.linear_attention(q, q, q, causal=True, seq_axis=1, return_state=True)
    step = (q[:, :1], q[:, :1], q[:, :1])
    with pytest.raises(ValueError, match="eps"):
        rotary.linear_attention(*step, causal=True, seq_axis=1, state=state, eps=float("inf"))
    with pytest.raises(ValueError, match="feature_map"):
        rotary.linear_attention(*step, causal=True, seq_axis=1, state=state, feature_map="relu")


@pytest.mark.parametrize("backend", ["numpy", "numba"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_decode_steps_carry_their_prepared_step_across_the_table_end(backend, dtype, monkeypatch):
    """Contiguous decode steps from position 250 to 261: each state carries the step the general path checked
    to the next call, which skips the general path while its position lies in the step's table (the first call,
    on a state made by hand, and the first past the table's end take the general path, which makes a new step);
    the outputs and states are those of the general path bit for bit; the last output matches the whole
    sequence computed at once."""
    if not _backends.available_backends()[backend][0]:
        pytest.skip(_backends.available_backends()[backend][1])
    import rotary.attn.linear as la

    rng = np.random.default_rng(3)
    B, H, Hk, d, dv, T = 2, 4, 2, 16, 8, 12
    spec = rotary.RopeSpec(d, base=500.0)
    q, k, v = (rng.standard_normal((B, T, h, n)).astype(dtype) for h, n in ((H, d), (Hk, d), (Hk, dv)))
    S0 = rng.standard_normal((B, Hk, d, dv)).astype(dtype)
    z0 = rng.random((B, Hk, d)).astype(dtype)
    fast = general = rotary.LinearAttentionState(S0, z0, 250, spec=spec, groups=2)
    kw = dict(causal=True, seq_axis=1, backend=backend, return_state=True)
    rotary.clear_cache()   # the first step's table: the 256-row dense one
    steps = []
    for t in range(T):
        step = tuple(np.ascontiguousarray(x[:, t:t + 1]) for x in (q, k, v))
        o_general, general = rotary.linear_attention(*step, general.next_position, state=general, **kw)
        if steps and 250 + t < steps[-1].end:
            monkeypatch.setattr(la, "_linear_attention", None)   # the fast path must not need the general one
        o_fast, fast = rotary.linear_attention(*step, state=fast, **kw)
        monkeypatch.undo()
        np.testing.assert_array_equal(o_fast, o_general)
        np.testing.assert_array_equal(fast.S, general.S)
        np.testing.assert_array_equal(fast.z, general.z)
        assert fast.next_position == 251 + t and fast._step is not None
        steps.append(fast._step)
    for t, prepared in enumerate(steps):   # each step read a table holding its position; a new one only past its end
        assert prepared.base <= 250 + t < prepared.end
        assert t == 0 or prepared is steps[t - 1] or 250 + t >= steps[t - 1].end
    assert steps[0] is steps[5] and steps[5] is not steps[6]   # position 256 is past the first (256-row) table
    o_all = rotary.linear_attention(q, k, v, 250, state=rotary.LinearAttentionState(S0, z0, 250, spec=spec, groups=2),
                                    causal=True, seq_axis=1, backend=backend)
    np.testing.assert_allclose(o_fast, o_all[:, -1:], rtol=1e-4 if dtype == np.float32 else 1e-10,
                               atol=1e-4 if dtype == np.float32 else 1e-10)
