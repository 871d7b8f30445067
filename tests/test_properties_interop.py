"""Property-based tests through the array adapters (issue 25): torch tensors (float16 / bfloat16 / float32
/ float64), JAX arrays under jit, Dask arrays (any chunking, length-dependent specs), NumPy bfloat16
(ml_dtypes, when installed), against the float64 oracles of tests/_props.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, strategies as st

import rotary

from . import _props as P


def oracle_bshd(x, positions, spec, inverse=False):
    """apply's oracle for (B, S, H, D) x, seq_axis=1, positions (S,)."""
    xs = np.moveaxis(np.asarray(x, np.float64), 1, 2)
    return np.moveaxis(P.spec_oracle(xs, positions, spec, inverse=inverse), 2, 1)


@st.composite
def small_calls(draw, dtypes=("float32", "float64")):
    spec = draw(P.plain_specs(max_head_dim=12))
    S, B, H = draw(st.integers(0, 7)), draw(st.integers(1, 2)), draw(st.integers(1, 2))
    dtype = draw(st.sampled_from(dtypes))
    x = P.data(draw, (B, S, H, spec.head_dim), "float64", nonfinite=draw(st.booleans()))
    offset = draw(st.integers(0, 10**6))
    return spec, x, offset, dtype


# -- torch ---------------------------------------------------------------------------------------------
@P.examples(80)
@given(call=small_calls(("float16", "bfloat16", "float32", "float64")), inverse=st.booleans(),
       backend=st.sampled_from(["auto"] + P.BACKENDS))
def test_torch_tensors(call, inverse, backend):
    torch = pytest.importorskip("torch")
    spec, x, offset, dtype = call
    t = torch.from_numpy(x).to(getattr(torch, dtype))
    x_in = t.to(torch.float64).numpy()          # the values the call sees (after rounding to dtype)
    y = rotary.apply(t, offset, spec=spec, seq_axis=1, inverse=inverse, backend=backend)
    assert isinstance(y, torch.Tensor) and y.dtype == t.dtype
    P.assert_matches(y.to(torch.float64).numpy(), oracle_bshd(x_in, np.arange(x.shape[1]) + offset, spec, inverse),
                     dtype)


@P.examples(25)
@given(spec=P.plain_specs(max_head_dim=8), T=st.integers(0, 6), causal=st.booleans(), seed=st.integers(0, 2**31))
def test_torch_attention_and_linear_attention(spec, T, causal, seed):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((1, 2, T, spec.head_dim)) for _ in range(3))
    tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
    o = rotary.attention(tq, tk, tv, spec=spec, causal=causal, seq_axis=-2)
    pos = np.arange(T)
    vis = np.ones((T, T), bool) if not causal else pos[None, :] <= pos[:, None]
    want = P.softmax_attention_oracle(P.spec_oracle(q, pos, spec), P.spec_oracle(k, pos, spec), v, vis,
                                      spec.head_dim ** -0.5)
    P.assert_matches(o.numpy(), want, "float64")
    ol = rotary.linear_attention(tq, tk, tv, spec=spec, causal=causal, seq_axis=-2)
    a, b = P.feature64(q, "elu"), P.feature64(k, "elu")
    want = P.linear_attention_oracle(a[0], b[0], P.spec_oracle(a, pos, spec)[0], P.spec_oracle(b, pos, spec)[0],
                                     v[0], causal=causal, decay=np.ones(2), normalize=True, eps=1e-6)
    P.assert_matches(ol.numpy()[0], want, "float64")


# -- JAX -----------------------------------------------------------------------------------------------
@P.examples(10)
@given(call=small_calls(), linear=st.booleans())
def test_jax_arrays_under_jit(call, linear):
    jax = pytest.importorskip("jax")
    spec, x, offset, dtype = call
    xj = jax.numpy.asarray(x.astype(dtype))
    dtype = str(xj.dtype)   # float32 unless JAX's x64 mode is on
    if not linear:
        y = jax.jit(lambda a: rotary.apply(a, offset, spec=spec, seq_axis=1))(xj)
        P.assert_matches(np.asarray(y), oracle_bshd(x.astype(dtype), np.arange(x.shape[1]) + offset, spec), dtype)
        return
    xs = np.moveaxis(x, 1, 2)   # (B, H, S, D)
    o = jax.jit(lambda a: rotary.linear_attention(a, a, a, spec=spec, causal=True, seq_axis=-2))(jax.numpy.asarray(xs.astype(dtype)))
    pos = np.arange(xs.shape[2])
    xd = xs.astype(dtype).astype(np.float64)
    a = P.feature64(xd, "elu")
    ah = P.spec_oracle(a, pos, spec)
    want = np.stack([P.linear_attention_oracle(a[i], a[i], ah[i], ah[i], xd[i], causal=True,
                                               decay=np.ones(xs.shape[1]), normalize=True, eps=1e-6)
                     for i in range(xs.shape[0])])
    P.assert_matches(np.asarray(o), want, dtype)


# -- Dask ----------------------------------------------------------------------------------------------
@st.composite
def length_dependent_specs(draw):
    d = 2 * draw(st.integers(2, 5))
    if draw(st.booleans()):
        return rotary.RopeSpec(d, scaling={"rope_type": "dynamic", "factor": draw(st.sampled_from([2.0, 4.0]))},
                               max_position_embeddings=draw(st.sampled_from([4, 16])))
    half = d // 2
    return rotary.RopeSpec(d, scaling={"rope_type": "longrope", "short_factor": [1.0] * half,
                                       "long_factor": [draw(st.sampled_from([2.0, 5.0]))] * half,
                                       "original_max_position_embeddings": 8}, max_position_embeddings=64)


@P.examples(60)
@given(spec=st.one_of(P.plain_specs(max_head_dim=12), length_dependent_specs()), S=st.integers(1, 20),
       chunk=st.integers(1, 8), form=st.sampled_from(["none", "int", "array", "dask"]), seed=st.integers(0, 2**31),
       backend=st.sampled_from(["auto"] + P.BACKENDS))
def test_dask_rotation(spec, S, chunk, form, seed, backend):
    """Any chunking of the sequence (and batch) axis, every positions form; length-dependent specs take
    their frequencies at the whole call's max position + 1."""
    da = pytest.importorskip("dask.array")
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, S, spec.head_dim))
    p = {"none": None, "int": 5, "array": rng.integers(0, 40, S), "dask": None}[form]
    host = np.arange(S) + (5 if form == "int" else 0) if p is None or form == "int" else np.asarray(p)
    if form == "dask":
        host = rng.integers(0, 40, S)
        p = da.from_array(host, chunks=max(1, chunk - 1))
    y = rotary.apply(da.from_array(x, chunks=(1, chunk, spec.head_dim)), p, spec=spec, backend=backend, seq_axis=-2).compute()
    P.assert_matches(y, P.spec_oracle(x, host, spec, seq_len=int(host.max()) + 1), "float64")


@P.examples(30)
@given(spec=st.one_of(P.plain_specs(max_head_dim=8), length_dependent_specs()), T=st.integers(1, 12),
       chunk=st.integers(1, 5), causal=st.booleans(), seed=st.integers(0, 2**31))
def test_dask_linear_attention(spec, T, chunk, causal, seed):
    """Any chunking; length-dependent specs at the whole call's length (T)."""
    da = pytest.importorskip("dask.array")
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((1, 2, T, spec.head_dim)) for _ in range(3))
    qd, kd, vd = (da.from_array(a, chunks=(1, 2, chunk, spec.head_dim)) for a in (q, k, v))
    o = rotary.linear_attention(qd, kd, vd, spec=spec, causal=causal, seq_axis=-2).compute()
    pos = np.arange(T)
    a, b = P.feature64(q, "elu"), P.feature64(k, "elu")
    want = P.linear_attention_oracle(a[0], b[0], P.spec_oracle(a, pos, spec, seq_len=T)[0],
                                     P.spec_oracle(b, pos, spec, seq_len=T)[0], v[0], causal=causal, decay=np.ones(2),
                                     normalize=True, eps=1e-6)
    P.assert_matches(o[0], want, "float64")


# -- NumPy bfloat16 (ml_dtypes) ------------------------------------------------------------------------
@P.examples(20)
@given(call=small_calls(), backend=st.sampled_from(P.BACKENDS))
def test_numpy_bfloat16(call, backend):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    spec, x, offset, _ = call
    xb = x.astype(ml_dtypes.bfloat16)
    y = rotary.apply(xb, offset, spec=spec, seq_axis=1, backend=backend)
    assert y.dtype == xb.dtype
    P.assert_matches(y.astype(np.float64), oracle_bshd(xb.astype(np.float64), np.arange(x.shape[1]) + offset, spec),
                     "bfloat16")


@P.examples(8)
@given(spec=P.plain_specs(max_head_dim=8), T=st.integers(1, 6), causal=st.booleans(), block=st.integers(1, 4),
       seed=st.integers(0, 2**31), nan_at=st.one_of(st.none(), st.integers(0, 5)))
def test_jax_softmax_attention_under_jit(spec, T, causal, block, seed, nan_at):
    """Softmax attention on JAX arrays under jit (the branch-free masked product), NaN in a value too."""
    jax = pytest.importorskip("jax")
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((1, 2, T, spec.head_dim)).astype(np.float32) for _ in range(3))
    if nan_at is not None and nan_at < T:
        v[0, 0, nan_at, 0] = np.nan
    f = jax.jit(lambda a, b, c: rotary.attention(a, b, c, spec=spec, causal=causal, block_size=block, seq_axis=-2))
    o = np.asarray(f(*(jax.numpy.asarray(a) for a in (q, k, v))))
    pos = np.arange(T)
    vis = np.ones((T, T), bool) if not causal else pos[None, :] <= pos[:, None]
    want = P.softmax_attention_oracle(P.spec_oracle(q, pos, spec), P.spec_oracle(k, pos, spec), v, vis,
                                      spec.head_dim ** -0.5)
    P.assert_matches(o, want, "float32")
