"""Property-based tests of the attention surface (issue 25): softmax attention (GQA, causal, windows,
softcap, offsets, packed cu_seqlens, NaN/inf data, both NumPy paths) and linear attention (causal and
not, feature maps, GQA + decay + normalize=False together, resumed from a state, non-causal with a
state, packed cu_seqlens), against the quadratic float64 oracles of tests/_props.py, on NumPy and Numba.
"""

from __future__ import annotations

import contextlib

import numpy as np
from hypothesis import assume, given, strategies as st

import rotary
from rotary.attn import softmax as softmax_module

from . import _props as P

backends = st.sampled_from(P.BACKENDS)


@contextlib.contextmanager
def softmax_path(path):
    """Force the NumPy tile loop ("tiles") or the array-API path for NumPy inputs."""
    old = softmax_module._TILES_MIN_SCORES
    softmax_module._TILES_MIN_SCORES = 0 if path == "tiles" else 1 << 60
    try:
        yield
    finally:
        softmax_module._TILES_MIN_SCORES = old


def rotated(x, positions, spec):
    """x (B, H, S, d) rotated by the oracle at (S,) positions."""
    return P.spec_oracle(x, positions, spec)


# -- softmax attention -----------------------------------------------------------------------------------
@P.examples(150)
@given(spec=P.plain_specs(max_head_dim=12), B=st.integers(1, 2), hk=st.integers(1, 2), groups=st.integers(1, 3),
       sq=st.integers(0, 7), extra=st.integers(0, 6), causal=st.booleans(), window=st.sampled_from([None, 1, 3]),
       softcap=st.sampled_from([None, 5.0]), offset=st.integers(0, 3000), block=st.integers(1, 6),
       path=st.sampled_from(["tiles", "array-api"]), dtype=st.sampled_from(["float32", "float64"]),
       backend=backends, data=st.data())
def test_softmax_attention_matches_the_quadratic_oracle(spec, B, hk, groups, sq, extra, causal, window, softcap,
                                                         offset, block, path, dtype, backend, data):
    sk = sq + extra
    assume(causal or window is None)
    q = P.data(data.draw, (B, hk * groups, sq, spec.head_dim), dtype, nonfinite=True)
    k = P.data(data.draw, (B, hk, sk, spec.head_dim), dtype, nonfinite=True)
    v = P.data(data.draw, (B, hk, sk, 3), dtype, nonfinite=True)
    with softmax_path(path):
        o = rotary.attention(q, k, v, offset, spec=spec, causal=causal, window=window, softcap=softcap,
                             block_size=block, backend=backend, seq_axis=-2)
    kp = np.arange(sk) + offset
    qp = kp[sk - sq:]
    qo, ko = rotated(q, qp, spec), rotated(k, kp, spec)
    ko, vo = (np.repeat(a, groups, axis=1) for a in (ko, np.asarray(v, np.float64)))
    t, s = qp[:, None], kp[None, :]
    vis = np.ones((sq, sk), bool) if not causal else (s <= t) & ((t - s < window) if window else True)
    want = P.softmax_attention_oracle(qo, ko, vo, vis, spec.head_dim ** -0.5, softcap)
    P.assert_matches(o, want, dtype)


@P.examples(80)
@given(spec=P.plain_specs(max_head_dim=10), lens=st.lists(st.integers(0, 5), min_size=1, max_size=4),
       causal=st.booleans(), h=st.integers(1, 2), offsets=st.booleans(), path=st.sampled_from(["tiles", "array-api"]),
       backend=backends, data=st.data())
def test_packed_softmax_attention(spec, lens, causal, h, offsets, path, backend, data):
    """cu_seqlens (empty sequences too): each sequence attends to its own keys only, positions restart
    per sequence (at seqlen_offsets)."""
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    T = int(cu[-1])
    q = P.data(data.draw, (T, h, spec.head_dim), "float64", nonfinite=True)
    k = P.data(data.draw, (T, h, spec.head_dim), "float64")
    v = P.data(data.draw, (T, h, 2), "float64", nonfinite=True)
    so = np.arange(len(lens), dtype=np.int64) * 7 if offsets else None
    with softmax_path(path):
        o = rotary.attention(q, k, v, spec=spec, seq_axis=0, causal=causal, cu_seqlens=cu, seqlen_offsets=so,
                             backend=backend)
    want = np.zeros((T, h, 2))
    for n, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        p = np.arange(b - a) + (0 if so is None else so[n])
        qo = rotated(np.moveaxis(q[a:b], 0, 1)[None], p, spec)
        ko = rotated(np.moveaxis(k[a:b], 0, 1)[None], p, spec)
        vis = np.ones((b - a, b - a), bool) if not causal else p[None, :] <= p[:, None]
        res = P.softmax_attention_oracle(qo, ko, np.moveaxis(v[a:b], 0, 1)[None], vis, spec.head_dim ** -0.5)
        want[a:b] = np.moveaxis(res[0], 0, 1)
    P.assert_matches(o, want, "float64")


# -- linear attention -------------------------------------------------------------------------------------
def linear_oracle(q, k, v, positions, spec, *, causal, feature_map, decay, normalize, eps, groups, state=None):
    """(B, H, T, d) inputs (k, v with H / groups heads) -> (B, H, T, dv) by the quadratic oracle."""
    k, v = (np.repeat(np.asarray(a, np.float64), groups, axis=1) for a in (k, v))
    a, b = P.feature64(q, feature_map), P.feature64(k, feature_map)
    ah, bh = P.spec_oracle(a, positions, spec), P.spec_oracle(b, positions, spec)
    B, H = q.shape[:2]
    gam = np.broadcast_to(np.repeat(np.broadcast_to(decay, (k.shape[1] // groups,)), groups), (H,))
    out = np.empty(q.shape[:-1] + (v.shape[-1],))
    for bi in range(B):
        st_b = None if state is None else (state[0][bi], state[1][bi])
        out[bi] = P.linear_attention_oracle(a[bi], b[bi], ah[bi], bh[bi], v[bi], causal=causal, decay=gam,
                                            normalize=normalize, eps=eps, state=st_b)
    return out


@st.composite
def linear_calls(draw):
    spec = draw(P.plain_specs(max_head_dim=10))
    fm = draw(st.sampled_from(["elu", "elu", "relu", "identity"]))
    normalize = fm == "elu" and draw(st.booleans())   # relu/identity denominators can vanish: numerator only
    causal = draw(st.booleans())
    hk, groups = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    decay = None
    if causal and draw(st.booleans()):
        decay = draw(st.sampled_from([0.9, 0.5, 1.0, 0.999, "per-head"]))
        if decay == "per-head":
            decay = np.array([0.8, 0.97])[:hk]
    return dict(spec=spec, feature_map=fm, normalize=normalize, causal=causal, hk=hk, groups=groups, decay=decay,
                chunk=draw(st.sampled_from([1, 2, 3, 5, 64])), T=draw(st.integers(0, 9)), B=draw(st.integers(1, 2)),
                dtype=draw(st.sampled_from(["float32", "float64"])), offset=draw(st.integers(0, 500)))


@P.examples(150)
@given(call=linear_calls(), backend=backends, split=st.integers(0, 9), data=st.data())
def test_linear_attention_matches_the_quadratic_oracle(call, backend, split, data):
    """GQA + decay + normalize=False together, every feature map, any chunk; the same call split in two
    with return_state / state= gives the same outputs (causal), and block-causal sums (non-causal)."""
    c = call
    spec, T, B, H, hk = c["spec"], c["T"], c["B"], c["hk"] * c["groups"], c["hk"]
    d = spec.head_dim
    nonfinite = data.draw(st.booleans())
    q = P.data(data.draw, (B, H, T, d), c["dtype"], nonfinite=nonfinite)
    k = P.data(data.draw, (B, hk, T, d), c["dtype"], nonfinite=nonfinite)
    v = P.data(data.draw, (B, hk, T, 3), c["dtype"], nonfinite=nonfinite)
    kw = dict(spec=spec, causal=c["causal"], feature_map=c["feature_map"], normalize=c["normalize"],
              decay=c["decay"], chunk=c["chunk"], backend=backend, seq_axis=-2)
    o = rotary.linear_attention(q, k, v, c["offset"], **kw)
    pos = np.arange(T) + c["offset"]
    okw = dict(causal=c["causal"], feature_map=c["feature_map"], decay=1.0 if c["decay"] is None else c["decay"],
               normalize=c["normalize"], eps=1e-6, groups=c["groups"])
    want = linear_oracle(q, k, v, pos, spec, **okw)
    P.assert_matches(o, want, c["dtype"])
    # resumed from a state
    t1 = min(split, T)
    o1, state = rotary.linear_attention(q[:, :, :t1], k[:, :, :t1], v[:, :, :t1], c["offset"], return_state=True, **kw)
    o2 = rotary.linear_attention(q[:, :, t1:], k[:, :, t1:], v[:, :, t1:], state=state, **kw)
    if c["causal"]:
        P.assert_matches(np.concatenate([o1, o2], axis=2), want, c["dtype"])
    else:   # block-causal: the first part sees itself, the second part sees everything
        P.assert_matches(o1, linear_oracle(q[:, :, :t1], k[:, :, :t1], v[:, :, :t1], pos[:t1], spec, **okw),
                         c["dtype"])
        P.assert_matches(o2, want[:, :, t1:], c["dtype"])


@P.examples(80)
@given(spec=P.plain_specs(max_head_dim=10), lens=st.lists(st.integers(0, 6), min_size=1, max_size=4),
       causal=st.booleans(), decay=st.sampled_from([None, 0.7]), normalize=st.booleans(), offsets=st.booleans(),
       chunk=st.sampled_from([2, 64]), backend=backends, data=st.data())
def test_packed_linear_attention(spec, lens, causal, decay, normalize, offsets, chunk, backend, data):
    """cu_seqlens (empty sequences too): sequences never see each other, positions restart per sequence."""
    assume(causal or decay is None)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    T, h, d = int(cu[-1]), 2, spec.head_dim
    q, k = (P.data(data.draw, (T, h, d), "float64") for _ in range(2))
    v = P.data(data.draw, (T, h, 2), "float64", nonfinite=True)
    so = (np.arange(len(lens)) * 5).astype(np.int64) if offsets else None
    o = rotary.linear_attention(q, k, v, spec=spec, seq_axis=0, causal=causal, decay=decay, normalize=normalize,
                                cu_seqlens=cu, seqlen_offsets=so, chunk=chunk, backend=backend)
    want = np.zeros((T, h, 2))
    for n, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        p = np.arange(b - a) + (0 if so is None else so[n])
        res = linear_oracle(*(np.moveaxis(x[a:b], 0, 1)[None] for x in (q, k, v)), p, spec, causal=causal,
                            feature_map="elu", decay=1.0 if decay is None else decay, normalize=normalize, eps=1e-6,
                            groups=1)
        want[a:b] = np.moveaxis(res[0], 0, 1)
    P.assert_matches(o, want, "float64")


@P.examples(40)
@given(spec=P.plain_specs(max_head_dim=8), first=st.lists(st.integers(0, 5), min_size=1, max_size=3),
       data=st.data(), decay=st.sampled_from([None, 0.8]), normalize=st.booleans(), backend=backends)
def test_packed_linear_attention_resumed_per_sequence(spec, first, data, decay, normalize, backend):
    """A packed prefill with return_state, then a packed continuation of the same sequences from that
    state: each sequence's outputs equal the causal oracle over its whole token run."""
    second = data.draw(st.lists(st.integers(0, 4), min_size=len(first), max_size=len(first)))
    h, d = 2, spec.head_dim
    seqs = [(P.data(data.draw, (a + b, h, d), "float64"), P.data(data.draw, (a + b, h, d), "float64"),
             P.data(data.draw, (a + b, h, 2), "float64")) for a, b in zip(first, second)]

    def packed(part):
        lens = first if part == 0 else second
        cut = [(0, a) if part == 0 else (a, a + b) for a, b in zip(first, second)]
        arrays = [np.concatenate([s[i][c0:c1] for s, (c0, c1) in zip(seqs, cut)]) for i in range(3)]
        return arrays, np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)

    kw = dict(spec=spec, seq_axis=0, causal=True, decay=decay, normalize=normalize, backend=backend)
    (q1, k1, v1), cu1 = packed(0)
    o1, state = rotary.linear_attention(q1, k1, v1, cu_seqlens=cu1, return_state=True, **kw)
    (q2, k2, v2), cu2 = packed(1)
    o2 = rotary.linear_attention(q2, k2, v2, cu_seqlens=cu2, state=state, **{**kw, "spec": None})
    for n, (a, b) in enumerate(zip(first, second)):
        q, k, v = (np.moveaxis(x, 0, 1)[None] for x in seqs[n])
        want = np.moveaxis(linear_oracle(q, k, v, np.arange(a + b), spec, causal=True, feature_map="elu",
                                         decay=1.0 if decay is None else decay, normalize=normalize, eps=1e-6,
                                         groups=1)[0], 0, 1)
        P.assert_matches(o1[cu1[n]:cu1[n + 1]], want[:a], "float64")
        P.assert_matches(o2[cu2[n]:cu2[n + 1]], want[a:], "float64")
