"""The NumPy backend's chunkwise-parallel linear attention (rotary/backends/numpy_linear.py).

Groups of chunks for all (batch, head) at once, chunk states as an exclusive prefix sum on top of a float64
carry. Checked against the quadratic float64 oracle ``rotary.testing.linear_attention_quadratic`` with small
group caps so that sequences span several groups, partial last chunks and group edges. Packed batches
(``cu_seqlens``): padded batches of sequences (``padded_batch``), one batched call for a small ragged
batch, a long sequence in a batch of its own, cache-sized blocks, the bucket plan's invariants.
"""

import numpy as np
import pytest

import rotary
from rotary.backends import numpy_linear as nl
from rotary.testing import linear_attention_quadratic

TOL = {"float64": 1e-12, "float32": 1e-5, "float16": 2e-3}


@pytest.fixture(params=["default", "small_groups"])
def groups(request, monkeypatch):
    """Default group caps, or caps small enough that every case below spans several groups."""
    if request.param == "small_groups":
        monkeypatch.setattr(nl, "_GROUP_ELEMENTS", 1)      # one chunk per group
        monkeypatch.setattr(nl, "_STATE_ELEMENTS", 1)
    return request.param


def _rel_rms(actual, desired):
    actual, desired = np.asarray(actual, np.float64), np.asarray(desired, np.float64)
    assert actual.shape == desired.shape
    return float(np.linalg.norm(actual - desired) / max(np.linalg.norm(desired), 1e-300))


def _oracle(q, k, v, positions, spec, *, causal, feature_map="elu", eps=1e-6):
    """q, k, v (B, H, T, d) and positions broadcastable to (B, H, T)."""
    inv_freq = spec.inv_freq()
    return linear_attention_quadratic(q, k, v, positions, inv_freq, layout=spec.layout, causal=causal,
                                      feature_map=feature_map, eps=eps, scale=spec.attention_scaling)


def _inputs(rng, shape, dv, dtype):
    q, k, v = rng.standard_normal(shape), rng.standard_normal(shape), rng.standard_normal((*shape[:-1], dv))
    return [a.astype(dtype) for a in (q, k, v)]


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("T,chunk", [(1, 8), (7, 8), (8, 8), (9, 8), (41, 8), (64, 16), (5, 1), (6, 100)])
def test_matches_the_oracle_across_groups(groups, dtype, causal, T, chunk):
    rng = np.random.default_rng(T * 31 + chunk)
    B, H, d, dv = 2, 3, 8, 5
    q, k, v = _inputs(rng, (B, H, T, d), dv, dtype)
    spec = rotary.RopeSpec(d)
    o = rotary.linear_attention(q, k, v, causal=causal, chunk=chunk, backend="numpy", seq_axis=-2)
    assert type(o) is np.ndarray and o.dtype == q.dtype and o.shape == (B, H, T, dv)
    assert _rel_rms(o, _oracle(q, k, v, np.arange(T), spec, causal=causal)) <= TOL[dtype]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("case", ["odd_dim", "partial", "interleaved", "relu", "identity", "per_batch", "bshd"])
def test_dims_maps_layouts_positions(groups, causal, case):
    rng = np.random.default_rng(5)
    B, H, T, d, dv, chunk = 2, 2, 23, 6, 3, 4
    kwargs, feature_map, positions = {}, "elu", np.arange(T) + 7
    if case == "odd_dim":
        d = 7
    elif case == "partial":
        kwargs["rotary_dim"] = 4
    elif case == "interleaved":
        kwargs["layout"] = "interleaved"
    elif case in ("relu", "identity"):
        feature_map = case
    elif case == "per_batch":
        positions = np.array([3, 1000])[:, None] + np.arange(T)
    spec = rotary.RopeSpec(d, **kwargs)
    q, k, v = _inputs(rng, (B, H, T, d), dv, np.float64)
    oracle_pos = positions[:, None, :] if positions.ndim == 2 else positions
    eps = 1e-3 if feature_map == "identity" else 1e-6
    expected = _oracle(q, k, v, oracle_pos, spec, causal=causal, feature_map=feature_map, eps=eps)
    before = [a.copy() for a in (q, k, v)]
    if case == "bshd":   # (B, T, H, d) strided views of the (B, H, T, d) arrays
        args = [np.swapaxes(a, 1, 2) for a in (q, k, v)]
        o = rotary.linear_attention(*args, positions, spec=spec, causal=causal, chunk=chunk, seq_axis=1,
                                    feature_map=feature_map, eps=eps, backend="numpy")
        o = np.swapaxes(o, 1, 2)
    else:
        o = rotary.linear_attention(q, k, v, positions, spec=spec, causal=causal, chunk=chunk,
                                    feature_map=feature_map, eps=eps, backend="numpy", seq_axis=-2)
    assert _rel_rms(o, expected) <= 1e-12
    for a, b in zip((q, k, v), before):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("causal", [True, False])
def test_state_resume_at_several_cuts(groups, dtype, causal):
    rng = np.random.default_rng(9)
    B, H, T, d, dv, chunk = 2, 2, 37, 6, 4, 5
    q, k, v = _inputs(rng, (B, H, T, d), dv, dtype)
    positions = np.array([11, 400])[:, None] + np.arange(T)
    spec = rotary.RopeSpec(d)
    full, full_state = rotary.linear_attention(q, k, v, positions, spec=spec, causal=causal, chunk=chunk,
                                               return_state=True, backend="numpy", seq_axis=-2)
    for cut in (0, 1, 4, 5, 6, 17, 36, 37):
        sl, sr = slice(None, cut), slice(cut, None)
        o1, st = rotary.linear_attention(q[:, :, sl], k[:, :, sl], v[:, :, sl], positions[:, sl], spec=spec,
                                         causal=causal, chunk=chunk, return_state=True, backend="numpy", seq_axis=-2)
        S_before, z_before = st.S.copy(), st.z.copy()
        o2, st2 = rotary.linear_attention(q[:, :, sr], k[:, :, sr], v[:, :, sr], positions[:, sr],
                                          causal=causal, chunk=chunk, state=st, return_state=True, backend="numpy", seq_axis=-2)
        np.testing.assert_array_equal(st.S, S_before)              # the state passed in is not written
        np.testing.assert_array_equal(st.z, z_before)
        assert st2.S.dtype == st2.z.dtype == np.dtype(dtype)
        if causal:
            assert _rel_rms(np.concatenate([o1, o2], axis=2), full) <= TOL[dtype], cut
        assert _rel_rms(st2.S, full_state.S) <= TOL[dtype], cut
        assert _rel_rms(st2.z, full_state.z) <= TOL[dtype], cut
    # the state is the plain sum over all tokens: S = sum b̂ vᵀ, z = sum b
    b = np.where(q.dtype.type(0) < k, k.astype(np.float64) + 1, np.exp(np.minimum(k.astype(np.float64), 0)))
    z = b.sum(axis=2)
    assert _rel_rms(full_state.z, z) <= TOL[dtype]


def test_float16_state_is_float32(groups):
    rng = np.random.default_rng(4)
    q, k, v = _inputs(rng, (1, 2, 50, 8), 6, np.float16)
    o, st = rotary.linear_attention(q, k, v, causal=True, chunk=8, return_state=True, backend="numpy", seq_axis=-2)
    assert o.dtype == np.float16 and st.S.dtype == np.float32 and st.z.dtype == np.float32
    assert _rel_rms(o, _oracle(q, k, v, np.arange(50), rotary.RopeSpec(8), causal=True)) <= TOL["float16"]


@pytest.mark.parametrize("causal", [True, False])
def test_long_float32_stays_within_1e_5(causal):
    """T = 4099 (64 chunks + 3 tokens), fp32: chunked fp32 sums + float64 carry, 1e-5 relative RMS."""
    rng = np.random.default_rng(17)
    T = 4099
    q, k, v = _inputs(rng, (1, 2, T, 32), 16, np.float32)
    spec = rotary.RopeSpec(32)
    o, st = rotary.linear_attention(q, k, v, causal=causal, spec=spec, return_state=True, backend="numpy", seq_axis=-2)
    assert _rel_rms(o, _oracle(q, k, v, np.arange(T), spec, causal=causal)) <= 1e-5
    z = np.where(k > 0, k.astype(np.float64) + 1, np.exp(np.minimum(k.astype(np.float64), 0))).sum(axis=2)
    assert _rel_rms(st.z, z) <= 1e-6


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("causal", [True, False])
def test_same_result_as_the_generic_path(groups, dtype, causal):
    """The NumPy fast path and the array-API loop (used for torch/JAX/...) agree to rounding."""
    rng = np.random.default_rng(2)
    q, k, v = _inputs(rng, (2, 35, 3, 6), 4, dtype)       # canonical (B, S, H, m)
    spec = rotary.RopeSpec(6, layout="interleaved")
    from rotary.spec import tables as _tables

    pos = np.array([0, 50])[:, None] + np.arange(35)
    cos, sin, rows = _tables.lookup(spec, pos, dtype=q.dtype, device_key="cpu")
    kw = dict(rotary_dim=6, layout="interleaved", causal=causal, feature_map="elu", eps=1e-6, chunk=4, state=None)
    fast, (S1, z1) = nl.linear_attention(q, k, v, cos, sin, rows, **kw)
    slow, (S2, z2) = nl._linear_attention_xp(q, k, v, cos, sin, rows, **kw)
    for a, b in ((fast, slow), (S1, S2), (z1, z2)):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert _rel_rms(a, b) <= TOL[dtype]


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_token_by_token_decode_equals_one_call(groups, dtype):
    """One token per call (the K = 1 outer-product path, state carried in the work dtype)."""
    rng = np.random.default_rng(12)
    q, k, v = _inputs(rng, (3, 4, 9, 8), 6, dtype)
    full = rotary.linear_attention(q, k, v, causal=True, chunk=4, backend="numpy", seq_axis=-2)
    o, st = rotary.linear_attention(q[:, :, :2], k[:, :, :2], v[:, :, :2], causal=True, chunk=4, return_state=True,
                                    backend="numpy", seq_axis=-2)
    pieces = [o]
    for t in range(2, 9):
        o, st = rotary.linear_attention(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], causal=True, chunk=4,
                                        state=st, return_state=True, backend="numpy", seq_axis=-2)
        pieces.append(o)
    assert _rel_rms(np.concatenate(pieces, axis=2), full) <= TOL[dtype]
    assert _rel_rms(np.concatenate(pieces, axis=2), _oracle(q, k, v, np.arange(9), rotary.RopeSpec(8),
                                                            causal=True)) <= TOL[dtype]


# -- packed batches (cu_seqlens): padded passes ----------------------------------------------------------
def _packed_inputs(rng, lengths, H=2, d=6, dv=3):
    T = int(np.sum(lengths))
    return (rng.standard_normal((T, H, n)) for n in (d, d, dv))


def _assert_packed_matches_oracle(o, q, k, v, lengths, spec, *, causal, decay=None, tol=1e-12):
    """Each sequence of the packed (T, H, .) arrays against the float64 oracle on that sequence alone."""
    o = np.asarray(o, dtype=np.float64)
    cu = np.concatenate([[0], np.cumsum(lengths)])
    for n, (s0, s1) in enumerate(zip(cu, cu[1:])):
        if s1 == s0:
            continue
        qs, ks, vs = (np.moveaxis(a[s0:s1], 0, 1)[None] for a in (q, k, v))
        ref = linear_attention_quadratic(qs, ks, vs, np.arange(s1 - s0), spec.inv_freq(), layout=spec.layout,
                                         causal=causal, decay=decay, feature_map="elu", eps=1e-6)[0]
        assert _rel_rms(o[s0:s1], np.moveaxis(ref, 1, 0)) <= tol, n


def _namespace(name):
    if name == "numpy":
        return np.asarray
    if name == "torch":
        return pytest.importorskip("torch").as_tensor
    return pytest.importorskip(name).asarray


@pytest.mark.parametrize("namespace", ["numpy", "array_api_strict", "torch"])
@pytest.mark.parametrize("causal,decay", [(True, None), (True, 0.7), (False, None)])
def test_packed_batch_is_one_pass(namespace, causal, decay, monkeypatch):
    """43 ragged sequences (lengths 0..6 and 11) go through one padded batch: one call of the batched
    algorithm (a loop over the sequences would make one per non-empty sequence), and each sequence equals
    the oracle on it alone; the caller's array type comes back."""
    rng = np.random.default_rng(40)
    lengths = np.concatenate([rng.integers(0, 7, size=40), [11, 0, 1]])
    q, k, v = _packed_inputs(rng, lengths)
    calls = []
    real = nl._batched
    monkeypatch.setattr(nl, "_batched", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    to = _namespace(namespace)
    spec = rotary.RopeSpec(6, base=100.0)
    o = rotary.linear_attention(to(q), to(k), to(v), cu_seqlens=np.concatenate([[0], np.cumsum(lengths)]),
                                causal=causal, decay=decay, spec=spec, seq_axis=0, chunk=4, backend="numpy")
    assert type(o) is type(to(q))
    assert calls == [(np.count_nonzero(lengths), 11, 2, 6)]
    _assert_packed_matches_oracle(np.asarray(o), q, k, v, lengths, spec, causal=causal, decay=decay)


@pytest.mark.parametrize("namespace", ["numpy", "array_api_strict"])
def test_a_long_sequence_among_short_ones_gets_its_own_pass(namespace, monkeypatch):
    """Padding 30 short sequences to one of 300 tokens would be 30 x 300 padded tokens for 340 real ones:
    the long one runs in a pass of its own (PAD_RATIO), the short ones padded to 2."""
    rng = np.random.default_rng(41)
    lengths = np.array([1] * 20 + [300] + [2] * 10)
    q, k, v = _packed_inputs(rng, lengths)
    calls = []
    real = nl._batched
    monkeypatch.setattr(nl, "_batched", lambda *a, **kw: calls.append(a[0].shape[:2]) or real(*a, **kw))
    to = _namespace(namespace)
    spec = rotary.RopeSpec(6, base=1000.0)
    o, st = rotary.linear_attention(to(q), to(k), to(v), cu_seqlens=np.concatenate([[0], np.cumsum(lengths)]),
                                    causal=True, decay=0.9, spec=spec, seq_axis=0, chunk=16, return_state=True,
                                    backend="numpy")
    assert sorted(calls) == [(1, 300), (30, 2)]
    _assert_packed_matches_oracle(np.asarray(o), q, k, v, lengths, spec, causal=True, decay=0.9)
    assert np.asarray(st.S).shape == (31, 2, 6, 3) and st.next_position.tolist() == lengths.tolist()


def test_packed_batch_in_cache_sized_blocks(groups):
    """With small group caps the padded batch runs in blocks of sequences (one per block here): the same
    results, states back in sequence order."""
    rng = np.random.default_rng(42)
    lengths = np.array([3, 0, 9, 1, 5, 2])
    q, k, v = _packed_inputs(rng, lengths)
    spec = rotary.RopeSpec(6)
    cu = np.concatenate([[0], np.cumsum(lengths)])
    kw = dict(cu_seqlens=cu, causal=True, spec=spec, seq_axis=0, chunk=4, return_state=True, backend="numpy")
    o, st = rotary.linear_attention(q, k, v, **kw)
    _assert_packed_matches_oracle(o, q, k, v, lengths, spec, causal=True)
    for n in range(len(lengths)):                  # each sequence's state is its own call's
        one = rotary.linear_attention(q[cu[n]:cu[n + 1]], k[cu[n]:cu[n + 1]], v[cu[n]:cu[n + 1]],
                                      **dict(kw, cu_seqlens=[0, lengths[n]]))[1]
        assert _rel_rms(st.S[n], one.S[0]) <= 1e-12 and _rel_rms(st.z[n], one.z[0]) <= 1e-12


@pytest.mark.parametrize("seed", range(6))
def test_bucket_plan_covers_every_token_once(seed):
    """plan_buckets: every packed token has one padded slot and comes back from it; each bucket within its
    caps and PAD_RATIO; state_rows puts the per-bucket rows back in sequence order."""
    from rotary.backends import padded_batch as pb

    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 40, size=int(rng.integers(1, 60)))
    if seed % 2:
        lengths[rng.integers(0, lengths.size)] = int(rng.integers(100, 500))   # a long one among short ones
    if seed == 4:
        lengths[:] = 0
    cu = np.concatenate([[0], np.cumsum(lengths)])
    max_rows = int(rng.integers(1, 20))
    plan = pb.plan_buckets(cu, max_rows=max_rows, max_elements=4096, token_cost=8, chunk=16)
    T = int(cu[-1])
    slots = np.concatenate([b.gather for b in plan.buckets]) if plan.buckets else np.zeros(0, np.int64)
    assert np.array_equal(slots[plan.scatter], np.arange(T))
    assert np.array_equal(np.sort(slots[slots < T]), np.arange(T))
    for b in plan.buckets:
        assert b.width == b.lengths.max() and b.lengths.min() > 0 and np.array_equal(lengths[b.ids], b.lengths)
        if b.ids.size > 1:
            assert b.ids.size <= max_rows and b.ids.size * min(b.width, 16) * 8 <= 4096
            assert b.ids.size * b.width <= pb.PAD_RATIO * b.lengths.sum()
    order = np.concatenate([b.ids for b in plan.buckets] + [plan.empty])
    assert np.array_equal(order if plan.state_rows is None else order[plan.state_rows], np.arange(lengths.size))
    assert np.array_equal(plan.empty, np.flatnonzero(lengths == 0))
