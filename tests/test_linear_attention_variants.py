"""GQA, decay (RetNet retention / simple gated linear attention) and normalize=False in linear attention.

Every backend against the quadratic float64 oracle ``rotary.testing.linear_attention_quadratic`` with
``D_ts = gamma^(t-s)`` (s <= t) written as a T x T matrix; GQA is checked against the oracle on k/v
heads repeated to q's heads (head h reads k/v head h // G). Resuming through the state, one-token
decode steps, gammas near 0 and near 1, fp32 and fp64. Peer: flash-linear-attention's naive
retention and recurrent linear attention (torch only, loaded from the installed ``fla`` package's
files without importing ``fla`` itself, which needs triton), skipped when absent.
"""

import importlib.util
import pathlib
import pickle

import numpy as np
import pytest

import rotary
from rotary.testing import linear_attention_quadratic

from .test_linear_attention import BACKENDS, _to_backend, rel_rms

TOL = {"float64": 1e-12, "float32": 2e-5}
RETNET = 1 - 2.0 ** (-5 - np.arange(4))          # RetNet's per-head gammas for 4 heads


def _data(rng, B, H, Hk, T, d, dv, dtype):
    q = rng.standard_normal((B, H, T, d)).astype(dtype)
    k = rng.standard_normal((B, Hk, T, d)).astype(dtype)
    v = rng.standard_normal((B, Hk, T, dv)).astype(dtype)
    return q, k, v


def _reference(q, k, v, spec, *, positions=None, causal=True, feature_map="elu", decay=None, normalize=True,
               eps=1e-6):
    """Oracle on (B, H, T, d) q and (B, Hk, T, .) k, v: k/v heads repeated to q's heads; decay per k/v head."""
    G = q.shape[1] // k.shape[1]
    kk, vv = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)
    gamma = None
    if decay is not None:
        gamma = np.broadcast_to(np.asarray(decay, np.float64), (k.shape[1],))
        gamma = np.repeat(gamma, G)[:, None] if np.ndim(decay) else np.asarray(decay, np.float64)
        gamma = np.broadcast_to(gamma.reshape(-1), (q.shape[1],))
    pos = np.arange(q.shape[2]) if positions is None else positions
    return linear_attention_quadratic(q, kk, vv, pos, spec.inv_freq(), layout=spec.layout,
                                      scale=spec.attention_scaling, causal=causal, feature_map=feature_map, eps=eps,
                                      decay=gamma, normalize=normalize)


def _run(backend, q, k, v, bshd=False, **kw):
    to = _to_backend(backend)
    if bshd:
        q, k, v = (np.ascontiguousarray(np.swapaxes(a, 1, 2)) for a in (q, k, v))
        kw["seq_axis"] = -3
    kw.setdefault("seq_axis", -2)   # (B, H, T, d)
    out = rotary.linear_attention(to(q), to(k), to(v), backend=backend, **kw)
    if kw.get("return_state"):
        o, st = out
    else:
        o, st = out, None
    o = np.asarray(o.get() if hasattr(o, "get") else o, dtype=np.float64)
    if bshd:
        o = np.swapaxes(o, 1, 2)
    return o, st


# -- GQA --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bshd", [False, True], ids=["bhsd", "bshd"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("H,Hk", [(4, 2), (6, 1), (3, 3)])
def test_gqa_matches_oracle(backend, bshd, causal, H, Hk):
    rng = np.random.default_rng(H * 10 + Hk)
    spec = rotary.RopeSpec(8, base=100.0)
    q, k, v = _data(rng, 2, H, Hk, 21, 8, 5, np.float64)
    o, st = _run(backend, q, k, v, bshd=bshd, causal=causal, spec=spec, chunk=8, return_state=True)
    assert rel_rms(o, _reference(q, k, v, spec, causal=causal)) <= TOL["float64"]
    kv_shape = (2, 21, Hk) if bshd else (2, Hk)
    assert tuple(st.S.shape) == (2, Hk, 8, 5) and tuple(st.z.shape) == (2, Hk, 8), kv_shape
    assert st.groups == H // Hk


def test_gqa_state_is_the_kv_heads_sum():
    """The state per k/v head is sum_s R b_s v_s^T (no q in it): checked directly in float64."""
    rng = np.random.default_rng(1)
    spec = rotary.RopeSpec(6, base=50.0)
    q, k, v = _data(rng, 1, 4, 2, 9, 6, 3, np.float64)
    _, st = rotary.linear_attention(q, k, v, causal=True, spec=spec, return_state=True, backend="numpy",
                                    feature_map="identity", seq_axis=-2)
    from rotary.testing import rope_complex

    bh = rope_complex(k, np.arange(9), spec.inv_freq())
    np.testing.assert_allclose(st.S, np.swapaxes(bh, -1, -2) @ v, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(st.z, k.sum(axis=2), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gqa_on_a_middle_axis_and_per_batch_positions(backend):
    """(B, T, H, X, d) with the GQA axis H not innermost: moved in the frontend, o and state in the caller's order."""
    rng = np.random.default_rng(2)
    spec = rotary.RopeSpec(4, base=30.0)
    q = rng.standard_normal((2, 11, 4, 3, 4))
    k = rng.standard_normal((2, 11, 2, 3, 4))
    v = rng.standard_normal((2, 11, 2, 3, 5))
    pos = rng.integers(0, 300, size=(2, 11))
    o, st = rotary.linear_attention(q, k, v, pos, seq_axis=1, causal=True, spec=spec, return_state=True,
                                    backend=backend, decay=np.array([[0.9], [0.5]]), chunk=4)
    # q head (h, x) reads k/v head (h // 2, x), with the gamma of k/v head h // 2
    expect = np.empty(q.shape[:-1] + (5,))
    for h in range(4):
        for x in range(3):
            qh, kh, vh = q[:, :, h, x], k[:, :, h // 2, x], v[:, :, h // 2, x]
            expect[:, :, h, x] = linear_attention_quadratic(
                qh, kh, vh, pos, spec.inv_freq(), causal=True, decay=[0.9, 0.5][h // 2])
    assert rel_rms(o, expect) <= 1e-12
    assert tuple(st.S.shape) == (2, 2, 3, 4, 5) and st.decay.shape == (2, 2, 3)
    o2 = rotary.linear_attention(q[:, :3], k[:, :3], v[:, :3], pos[:, :3], seq_axis=1, causal=True, spec=spec,
                                 backend=backend, decay=np.array([[0.9], [0.5]]))
    assert rel_rms(o2, expect[:, :3]) <= 1e-12


# -- decay ------------------------------------------------------------------------------------------
DECAYS = {
    "scalar": 0.9,
    "retnet": RETNET,
    "near-one": 1 - 1e-7,
    "near-zero": 1e-6,
    "tiny": 1e-300,
    "mixed": np.array([1.0, 1e-3, 0.5, 1 - 2.0 ** -30]),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("name", list(DECAYS))
@pytest.mark.parametrize("normalize", [True, False])
def test_decay_matches_oracle(backend, dtype, name, normalize):
    rng = np.random.default_rng(len(name))
    spec = rotary.RopeSpec(8, base=100.0)
    q, k, v = _data(rng, 2, 4, 4, 45, 8, 6, np.dtype(dtype))
    decay = DECAYS[name]
    o, st = _run(backend, q, k, v, causal=True, spec=spec, chunk=16, decay=decay, normalize=normalize,
                 return_state=True)
    ref = _reference(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), spec, decay=decay,
                     normalize=normalize)
    assert rel_rms(o, ref) <= TOL[dtype], name
    assert (st.z is None) == (not normalize)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_decay_gqa_split_resume_and_decode(backend, dtype):
    """Prefill in uneven pieces, then one-token decode steps; decay per k/v head, GQA, both normalize modes."""
    rng = np.random.default_rng(3)
    spec = rotary.RopeSpec(8, base=100.0, layout="interleaved")
    q, k, v = _data(rng, 2, 4, 2, 40, 8, 5, np.dtype(dtype))
    decay = np.array([0.95, 1 - 1e-6])
    for normalize in (True, False):
        ref = _reference(*(a.astype(np.float64) for a in (q, k, v)), spec, decay=decay, normalize=normalize)
        pieces, st = [], None
        cuts = [0, 7, 23, 24, 33] + list(range(34, 41))
        for s0, s1 in zip(cuts, cuts[1:]):
            o, st = _run(backend, q[:, :, s0:s1], k[:, :, s0:s1], v[:, :, s0:s1], causal=True, decay=decay,
                         normalize=normalize, state=st, return_state=True, chunk=8, spec=spec)
            pieces.append(o)
        assert rel_rms(np.concatenate(pieces, axis=2), ref) <= TOL[dtype]
        assert st.next_position == 40


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("H,Hk", [(2, 2), (6, 2)])
@pytest.mark.parametrize("decay", [None, 0.9])
def test_decode_steps_on_wide_heads(backend, dtype, H, Hk, decay):
    """One-token steps on heads wider than a SIMD vector (d = 24, dv = 20: whole vectors plus a tail) after a
    prefill, with and without GQA and decay, against the float64 oracle."""
    rng = np.random.default_rng(11)
    spec = rotary.RopeSpec(24, base=50.0)
    q, k, v = _data(rng, 1, H, Hk, 12, 24, 20, np.dtype(dtype))
    ref = _reference(*(a.astype(np.float64) for a in (q, k, v)), spec, decay=decay)
    o, st = _run(backend, q[:, :, :5], k[:, :, :5], v[:, :, :5], causal=True, decay=decay, spec=spec,
                 return_state=True)
    pieces = [o]
    for t in range(5, 12):
        o, st = _run(backend, q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], causal=True, decay=decay,
                     state=st, return_state=True)
        pieces.append(o)
    assert rel_rms(np.concatenate(pieces, axis=2), ref) <= TOL[dtype]
    assert st.next_position == 12


@pytest.mark.parametrize("backend", BACKENDS)
def test_decayed_state_is_the_decayed_sum(backend):
    rng = np.random.default_rng(4)
    spec = rotary.RopeSpec(4, base=10.0)
    q, k, v = _data(rng, 1, 2, 2, 13, 4, 3, np.float64)
    gamma = np.array([0.7, 0.2])
    _, st = _run(backend, q, k, v, causal=True, spec=spec, decay=gamma, return_state=True, chunk=5)
    from rotary.testing import feature_map64, rope_complex

    b = feature_map64(k)
    w = gamma[:, None] ** (12 - np.arange(13))                       # gamma^(T-1-s)
    S = np.einsum("hs,bhsm,bhsv->bhmv", w, rope_complex(b, np.arange(13), spec.inv_freq()), v)
    z = np.einsum("hs,bhsm->bhm", w, b)
    S_out, z_out = (np.asarray(a.get() if hasattr(a, "get") else a) for a in (st.S, st.z))
    np.testing.assert_allclose(S_out, S, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(z_out, z, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decay_one_equals_no_decay_and_non_causal_takes_ones(backend):
    rng = np.random.default_rng(5)
    q, k, v = _data(rng, 1, 2, 2, 17, 4, 3, np.float64)
    for causal in (True, False):
        a = _run(backend, q, k, v, causal=causal, decay=1.0, base=10.0)[0]
        b = _run(backend, q, k, v, causal=causal, base=10.0)[0]
        assert rel_rms(a, b) <= 1e-14


@pytest.mark.parametrize("backend", BACKENDS)
def test_normalize_false_non_causal_is_the_numerator(backend):
    rng = np.random.default_rng(6)
    spec = rotary.RopeSpec(8)
    q, k, v = _data(rng, 2, 2, 1, 19, 8, 4, np.float64)
    o, _ = _run(backend, q, k, v, causal=False, normalize=False, spec=spec, feature_map="relu")
    assert rel_rms(o, _reference(q, k, v, spec, causal=False, normalize=False, feature_map="relu")) <= 1e-12


def test_retention_long_gamma_near_one_float32_stays_accurate():
    """gamma = 1 - 2^-12 over 4096 tokens: gamma^(t-s) spans 1 .. e^-1; no gamma^-t anywhere."""
    rng = np.random.default_rng(7)
    spec = rotary.RopeSpec(16)
    q, k, v = _data(rng, 1, 1, 1, 4096, 16, 8, np.float32)
    for backend in ("numpy", "numba"):
        o, _ = _run(backend, q, k, v, causal=True, decay=1 - 2.0 ** -12, normalize=False, spec=spec,
                    feature_map="identity")
        ref = _reference(*(a.astype(np.float64) for a in (q, k, v)), spec, decay=1 - 2.0 ** -12, normalize=False,
                         feature_map="identity")
        assert rel_rms(o, ref) <= 1e-5, backend


# -- state ------------------------------------------------------------------------------------------
def test_state_records_decay_normalize_groups_and_pickles():
    rng = np.random.default_rng(8)
    q, k, v = _data(rng, 1, 4, 2, 6, 4, 3, np.float64)
    _, st = rotary.linear_attention(q, k, v, causal=True, decay=[0.5, 0.25], normalize=False, return_state=True, seq_axis=-2)
    assert st.z is None and not st.normalize and st.groups == 2
    np.testing.assert_array_equal(st.decay, [[0.5, 0.25]])
    with pytest.raises(ValueError):
        st.decay[0, 0] = 1.0
    again = pickle.loads(pickle.dumps(st))
    np.testing.assert_array_equal(again.decay, st.decay)
    assert again.z is None and again.groups == 2 and not again.normalize


def _small():
    rng = np.random.default_rng(9)
    return _data(rng, 2, 4, 2, 5, 4, 3, np.float64)


@pytest.mark.parametrize("kwargs,exc,match", [
    ({"decay": 0.0}, ValueError, "decay must be in \\(0, 1\\]"),
    ({"decay": 1.5}, ValueError, "decay must be in"),
    ({"decay": -0.5}, ValueError, "decay must be in"),
    ({"decay": float("nan")}, ValueError, "decay must be in"),
    ({"decay": [0.5, 0.5, 0.5]}, ValueError, "decay of shape \\(3,\\)"),
    ({"decay": [0.5] * 4}, ValueError, "one value per k/v head"),
    ({"decay": np.ones((2, 2, 2)) * 0.5}, ValueError, "decay of shape"),
    ({"decay": True}, TypeError, "decay"),
    ({"decay": "0.5"}, TypeError, "decay"),
    ({"decay": 0.5, "causal": False}, ValueError, "decay < 1 needs causal=True"),
    ({"normalize": 1}, TypeError, "normalize"),
])
def test_bad_decay_and_normalize(kwargs, exc, match):
    q, k, v = _small()
    kwargs.setdefault("causal", True)
    with pytest.raises(exc, match=match):
        rotary.linear_attention(q, k, v, seq_axis=-2, **kwargs)


def test_gqa_ratio_that_does_not_divide():
    rng = np.random.default_rng(10)
    q, k, v = _data(rng, 2, 4, 3, 5, 4, 3, np.float64)
    with pytest.raises(ValueError, match="k of shape \\(2, 3, 5, 4\\).*multiple"):
        rotary.linear_attention(q, k, v, seq_axis=-2)
    with pytest.raises(ValueError, match="batch"):                      # fewer k/v along the batch axis
        rotary.linear_attention(q, q[:1], q[:1], seq_axis=-2)
    with pytest.raises(ValueError, match="v of shape"):
        rotary.linear_attention(q, k[:, :2], v, seq_axis=-2)


def test_state_from_another_configuration_is_rejected():
    q, k, v = _small()
    _, st = rotary.linear_attention(q, k, v, causal=True, decay=0.5, return_state=True, seq_axis=-2)
    with pytest.raises(ValueError, match="state was made with decay"):
        rotary.linear_attention(q, k, v, causal=True, decay=0.25, state=st, seq_axis=-2)
    with pytest.raises(ValueError, match="state was made with decay"):
        rotary.linear_attention(q, k, v, causal=True, state=st, seq_axis=-2)
    with pytest.raises(ValueError, match="state was made with normalize=True"):
        rotary.linear_attention(q, k, v, causal=True, decay=0.5, normalize=False, state=st, seq_axis=-2)
    with pytest.raises(ValueError, match="GQA groups"):                 # same k/v heads, other q heads
        rotary.linear_attention(q[:, :2], k, v, causal=True, decay=0.5, state=st, seq_axis=-2)
    with pytest.raises(ValueError, match="state belongs to inputs"):    # other k/v heads
        rotary.linear_attention(q, k[:, :1], v[:, :1], causal=True, decay=0.5, state=st, seq_axis=-2)


# -- peer: flash-linear-attention's naive references -------------------------------------------------
def _fla_module(relative):
    """A module of the installed fla package loaded from its file (fla/__init__ needs triton; these do not)."""
    torch = pytest.importorskip("torch")
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("flash-linear-attention (fla-core) is not installed")
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / relative
    if not path.exists():
        pytest.skip(f"fla has no {relative}")
    loader = importlib.util.spec_from_file_location(f"_fla_{path.stem}", path)
    module = importlib.util.module_from_spec(loader)
    try:
        loader.loader.exec_module(module)
    except ImportError as exc:
        pytest.skip(f"fla's {relative} does not import here: {exc}")
    return torch, module


@pytest.mark.peer
@pytest.mark.parametrize("backend", BACKENDS)
def test_peer_fla_naive_retention(backend):
    """fla's naive_retention (gamma_h = 1 - 2^(-5-h), q scaled by d^-1/2, no RoPE): ours with identity
    features, normalize=False, RetNet's gammas and every token at one position (R = I)."""
    torch, naive = _fla_module("ops/retention/naive.py")
    rng = np.random.default_rng(11)
    B, H, T, d, dv = 2, 4, 50, 16, 8
    q, k, v = _data(rng, B, H, H, T, d, dv, np.float32)
    theirs = naive.naive_retention(*(torch.from_numpy(a) for a in (q, k, v))).numpy()
    ours, _ = _run(backend, q * np.float32(d ** -0.5), k, v, causal=True, decay=RETNET, normalize=False,
                   feature_map="identity", positions=np.zeros(T, np.int64), chunk=16)
    assert rel_rms(ours, theirs.astype(np.float64)) <= 1e-5


@pytest.mark.peer
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("normalize", [True, False])
def test_peer_fla_naive_recurrent_linear_attn(backend, normalize):
    """fla's naive_recurrent_linear_attn (BTHD, scale d^-1/2, denominator eps 1e-10) against ours with
    identity features of positive inputs, eps=1e-10, no RoPE (one position), state carried across two calls."""
    torch, naive = _fla_module("ops/linear_attn/naive.py")
    rng = np.random.default_rng(12)
    B, T, H, d, dv = 2, 37, 3, 8, 4
    q, k = (np.abs(rng.standard_normal((B, T, H, d))).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((B, T, H, dv)).astype(np.float32)
    theirs, _ = naive.naive_recurrent_linear_attn(*(torch.from_numpy(a) for a in (q, k, v)), normalize=normalize)
    kw = dict(causal=True, feature_map="identity", normalize=normalize, eps=1e-10, seq_axis=-3, backend=backend,
              return_state=True, positions=np.zeros(20, np.int64))
    to = _to_backend(backend)
    qs = q * np.float32(d ** -0.5)
    o1, st = rotary.linear_attention(to(qs[:, :20]), to(k[:, :20]), to(v[:, :20]), **kw)
    kw["positions"] = np.zeros(T - 20, np.int64)
    o2, _ = rotary.linear_attention(to(qs[:, 20:]), to(k[:, 20:]), to(v[:, 20:]), state=st, **kw)
    ours = np.concatenate([np.asarray(o.get() if hasattr(o, "get") else o) for o in (o1, o2)], axis=1)
    assert rel_rms(ours, theirs.numpy().astype(np.float64)) <= 1e-5


# -- packed batches (cu_seqlens) ----------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lengths", [(5, 0, 9, 1), (4, 4, 4)], ids=["ragged", "equal"])
def test_packed_batch_per_sequence_state(backend, lengths):
    """(total_tokens, H, d) with cu_seqlens: each sequence alone against the oracle (positions restarting
    at seqlen_offsets), one state per sequence; then a packed one-token decode step from those states."""
    rng = np.random.default_rng(13)
    spec = rotary.RopeSpec(8, base=100.0)
    T, H, Hk = sum(lengths), 4, 2
    cu = np.concatenate([[0], np.cumsum(lengths)])
    offsets = np.array([3, 100, 0, 7][:len(lengths)])
    q = rng.standard_normal((T + len(lengths), H, 8))
    k = rng.standard_normal((T + len(lengths), Hk, 8))
    v = rng.standard_normal((T + len(lengths), Hk, 5))
    decay = np.array([0.9, 0.6])
    to = _to_backend(backend)
    host = (lambda a: np.asarray(a.get() if hasattr(a, "get") else a))
    kw = dict(causal=True, spec=spec, seq_axis=0, decay=decay, backend=backend, chunk=4, return_state=True)
    o, st = rotary.linear_attention(to(q[:T]), to(k[:T]), to(v[:T]), cu_seqlens=cu, seqlen_offsets=offsets, **kw)
    o = host(o)
    assert st.S.shape == (len(lengths), Hk, 8, 5) and st.next_position.tolist() == (offsets + lengths).tolist()
    # the decode step: token T + n continues sequence n
    step = np.arange(len(lengths) + 1)
    o2, st2 = rotary.linear_attention(to(q[T:]), to(k[T:]), to(v[T:]), cu_seqlens=step, state=st, **kw)
    o2 = host(o2)
    for n, (s0, s1) in enumerate(zip(cu, cu[1:])):
        idx = list(range(s0, s1)) + [T + n]
        qs, ks, vs = (np.moveaxis(a[idx], 0, 1)[None] for a in (q, k, v))       # (1, H, L + 1, .)
        pos = offsets[n] + np.arange(len(idx))
        ref = _reference(qs, ks, vs, spec, positions=pos, decay=decay)[0]      # (H, L + 1, dv)
        assert rel_rms(o[s0:s1], np.moveaxis(ref[:, :-1], 1, 0)) <= 1e-12 if s1 > s0 else True
        assert rel_rms(o2[n], ref[:, -1]) <= 1e-12
    assert st2.next_position.tolist() == (offsets + lengths + 1).tolist()


@pytest.mark.parametrize("backend", BACKENDS)
def test_bidirectional_retention_recipe_of_the_docs(backend):
    """docs/linear_attention.md: gamma^|t-s| without a denominator as a forward causal call plus a causal call on
    the reversed sequence minus the diagonal, against the float64 quadratic form written out here."""
    from rotary.testing import rope_complex

    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((3, 1, 2, 12, 8))
    spec = rotary.RopeSpec(8, base=100.0)
    pos = np.arange(12)
    kw = dict(causal=True, decay=0.9, normalize=False, feature_map="identity", spec=spec, seq_axis=-2)
    forward = _run(backend, q, k, v, positions=pos, **kw)[0]
    backward = _run(backend, q[:, :, ::-1], k[:, :, ::-1], v[:, :, ::-1], positions=pos[::-1], **kw)[0][:, :, ::-1]
    o = forward + backward - np.einsum("bhtd,bhtd->bht", q, k)[..., None] * v
    D = 0.9 ** np.abs(pos[:, None] - pos[None, :])
    scores = np.einsum("bhtd,bhsd->bhts", rope_complex(q, pos, spec.inv_freq()), rope_complex(k, pos, spec.inv_freq()))
    assert rel_rms(o, np.einsum("ts,bhts,bhsv->bhtv", D, scores, v)) <= 1e-12


def ragged_against_oracle(backend, causal, normalize, dtype, decay, calls=None):
    """A ragged packed batch (lengths 6, 0, 11, 1, 3; GQA 4/2; positions from seqlen_offsets) in one call,
    each sequence against the float64 quadratic oracle run on that sequence alone; returns the state."""
    rng = np.random.default_rng(21)
    spec = rotary.RopeSpec(8, base=100.0)
    lengths = (6, 0, 11, 1, 3)
    T, H, Hk = sum(lengths), 4, 2
    cu = np.concatenate([[0], np.cumsum(lengths)])
    offsets = np.array([3, 9, 0, 40, 5])
    q, k, v = (rng.standard_normal((T, h, n)).astype(dtype) for h, n in ((H, 8), (Hk, 8), (Hk, 5)))
    to = _to_backend(backend)
    o, st = rotary.linear_attention(to(q), to(k), to(v), cu_seqlens=cu, seqlen_offsets=offsets, causal=causal,
                                    spec=spec, seq_axis=0, decay=decay, normalize=normalize, backend=backend,
                                    chunk=4, return_state=True)
    o = np.asarray(o.get() if hasattr(o, "get") else o, dtype=np.float64)
    for n, (s0, s1) in enumerate(zip(cu, cu[1:])):
        if s1 == s0:
            continue
        qs, ks, vs = (np.moveaxis(a[s0:s1].astype(np.float64), 0, 1)[None] for a in (q, k, v))
        ref = _reference(qs, ks, vs, spec, positions=offsets[n] + np.arange(s1 - s0), causal=causal, decay=decay,
                         normalize=normalize)[0]
        assert rel_rms(o[s0:s1], np.moveaxis(ref, 1, 0)) <= TOL[np.dtype(dtype).name], n
    assert st.S.shape == (5, Hk, 8, 5) and st.next_position.tolist() == (offsets + np.array(lengths)).tolist()
    return st


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal,decay", [(True, None), (True, [0.8, 0.99]), (False, None)])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_ragged_packed_batch_in_one_backend_call(backend, causal, decay, normalize, dtype, monkeypatch):
    """Different lengths (one empty) go to the backend as one call with cu_seqlens; every sequence equals
    the float64 oracle on that sequence alone."""
    module = rotary.backends.get(backend)
    calls = []
    real = module.linear_attention
    monkeypatch.setattr(module, "linear_attention", lambda *a, **kw: calls.append(kw.get("cu_seqlens")) or real(*a, **kw))
    ragged_against_oracle(backend, causal, normalize, dtype, decay)
    assert len(calls) == 1 and calls[0] is not None


def _packed_state_oracle(k, v, spec, positions, gamma):
    """The state after the tokens of one sequence, in float64: S = sum_s gamma^(L-1-s) R_(p_s) phi(k_s) v_s^T,
    z = sum_s gamma^(L-1-s) phi(k_s), per k/v head; k (L, Hk, m), v (L, Hk, dv), gamma (Hk,) or None."""
    from rotary.testing import feature_map64, rope_complex

    b = np.moveaxis(feature_map64(k), 0, 1)                                   # (Hk, L, m)
    L = b.shape[1]
    w = np.ones((b.shape[0], L)) if gamma is None else np.asarray(gamma)[:, None] ** (L - 1 - np.arange(L))
    bhat = rope_complex(b, positions, spec.inv_freq())
    return (np.einsum("hs,hsm,hsv->hmv", w, bhat, np.moveaxis(np.asarray(v, np.float64), 0, 1)),
            np.einsum("hs,hsm->hm", w, b))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("decay", [None, 0.85, [0.5, 0.97]], ids=["no_decay", "scalar", "per_head"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_ragged_packed_resume_equals_one_call(backend, decay, dtype):
    """Two ragged packed calls (lengths 4, 0, 7, 1, 3 then 2, 3, 0, 5, 1; GQA 4/2; positions from
    seqlen_offsets, then from the state): every sequence's outputs equal the float64 oracle on the whole
    sequence, and the final state equals the decayed sum over its tokens (an empty piece keeps the state)."""
    rng = np.random.default_rng(31)
    spec = rotary.RopeSpec(8, base=100.0)
    first, second = np.array([4, 0, 7, 1, 3]), np.array([2, 3, 0, 5, 1])
    offsets = np.array([5, 0, 11, 2, 30])
    H, Hk = 4, 2
    seqs = [tuple(rng.standard_normal((n, h, d)).astype(dtype) for h, d in ((H, 8), (Hk, 8), (Hk, 5)))
            for n in first + second]
    to = _to_backend(backend)
    host = (lambda a: np.asarray(a.get() if hasattr(a, "get") else a, dtype=np.float64))
    kw = dict(causal=True, spec=spec, seq_axis=0, decay=decay, backend=backend, chunk=4, return_state=True)
    outs, st = [], None
    for part, (lengths, lo) in enumerate(((first, np.zeros(5, int)), (second, first))):
        packed = [np.concatenate([s[i][a:a + n] for s, a, n in zip(seqs, lo, lengths)]) for i in range(3)]
        cu = np.concatenate([[0], np.cumsum(lengths)])
        extra = dict(seqlen_offsets=offsets) if part == 0 else dict(state=st)
        o, st = rotary.linear_attention(*(to(a) for a in packed), cu_seqlens=cu, **extra, **kw)
        outs.append(np.split(host(o), cu[1:-1]))
    assert st.next_position.tolist() == (offsets + first + second).tolist()
    gamma = None if decay is None else np.broadcast_to(np.asarray(decay, np.float64), (Hk,))
    for n, (qs, ks, vs) in enumerate(seqs):
        pos = offsets[n] + np.arange(len(qs))
        ref = _reference(*(np.moveaxis(a.astype(np.float64), 0, 1)[None] for a in (qs, ks, vs)), spec,
                         positions=pos, decay=decay)[0]
        got = np.concatenate([outs[0][n], outs[1][n]])
        assert rel_rms(got, np.moveaxis(ref, 1, 0)) <= TOL[dtype], n
        S, z = _packed_state_oracle(ks, vs, spec, pos, gamma)
        assert rel_rms(host(st.S)[n], S) <= TOL[dtype] and rel_rms(host(st.z)[n], z) <= TOL[dtype], n


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal,decay", [(False, None), (True, None), (True, 0.5)])
def test_packed_padding_adds_nothing(backend, causal, decay):
    """Short sequences next to a long one (lengths 1, 16, 2, 0), elu features (phi(0) = 1: a zero-padded key
    would add to z and S), strong decay (0.5: a state decayed through 15 padded tokens would shrink 0.5^15):
    outputs and states equal the float64 oracle on each sequence alone."""
    rng = np.random.default_rng(32)
    spec = rotary.RopeSpec(6, base=50.0)
    lengths = np.array([1, 16, 2, 0])
    T, cu = int(lengths.sum()), np.concatenate([[0], np.cumsum(lengths)])
    q, k, v = (rng.standard_normal((T, 2, d)) + 1.0 for d in (6, 6, 3))       # mostly positive: phi(x) large
    to = _to_backend(backend)
    o, st = rotary.linear_attention(to(q), to(k), to(v), cu_seqlens=cu, causal=causal, decay=decay, spec=spec,
                                    seq_axis=0, chunk=4, backend=backend, return_state=True)
    o, S_out, z_out = (np.asarray(a.get() if hasattr(a, "get") else a) for a in (o, st.S, st.z))
    gamma = None if decay is None else np.full(2, decay)
    for n, (s0, s1) in enumerate(zip(cu, cu[1:])):
        pos = np.arange(s1 - s0)
        S, z = _packed_state_oracle(k[s0:s1], v[s0:s1], spec, pos, gamma)
        np.testing.assert_allclose(S_out[n], S, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(z_out[n], z, rtol=1e-12, atol=1e-12)
        if s1 > s0:
            ref = _reference(*(np.moveaxis(a[s0:s1], 0, 1)[None] for a in (q, k, v)), spec, positions=pos,
                             causal=causal, decay=decay)[0]
            assert rel_rms(o[s0:s1], np.moveaxis(ref, 1, 0)) <= 1e-12, n


def test_packed_batch_errors():
    q = np.zeros((6, 2, 4))
    with pytest.raises(ValueError, match="cu_seqlens must end at the token count 6"):
        rotary.linear_attention(q, q, q, causal=True, cu_seqlens=[0, 2, 5], seq_axis=0)
    with pytest.raises(ValueError, match="seqlen_offsets needs cu_seqlens"):
        rotary.linear_attention(q, q, q, causal=True, seqlen_offsets=[0, 1], seq_axis=0)
    with pytest.raises(ValueError, match="packed input"):
        rotary.linear_attention(np.zeros((2, 6, 2, 4)), np.zeros((2, 6, 2, 4)), np.zeros((2, 6, 2, 4)),
                                cu_seqlens=[0, 6], seq_axis=1)
    _, st = rotary.linear_attention(q, q, q, causal=True, cu_seqlens=[0, 2, 6], seq_axis=0, return_state=True)
    with pytest.raises(ValueError, match="a state of 3 sequences"):
        rotary.linear_attention(q, q, q, causal=True, cu_seqlens=[0, 1, 2, 6], seq_axis=0, state=st)
    with pytest.raises(ValueError, match="decay"):
        rotary.linear_attention(q, q, q, causal=True, cu_seqlens=[0, 2, 6], seq_axis=0, decay=[0.5, 0.5, 0.5])
