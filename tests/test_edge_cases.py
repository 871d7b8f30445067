"""Adversarial edge cases for the speed paths (NumPy blocks and fp16 bit ops, Numba borrowed views,
SIMD pairs and cached geometry, NumPy chunkwise-parallel linear attention), checked against the
float64 oracles of rotary.testing or against exact equality with another path."""

import warnings

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import rotary
from rotary.testing import assert_close, linear_attention_quadratic, rope_complex

from .conftest import AVAILABLE, run_in_threads

CPU = [b for b in ("numpy", "numba") if b in AVAILABLE]
DTYPES = [np.float16, np.float32, np.float64]


def oracle(x, positions, spec, seq_axis):
    """rope_complex with the sequence axis moved into place; positions (S,) or (B, S) per batch row."""
    x64 = np.moveaxis(np.asarray(x, dtype=np.float64), seq_axis, -2)
    positions = np.asarray(positions)
    if positions.ndim == 2:
        y = np.stack([rope_complex(x64[b], positions[b], spec.inv_freq(), layout=spec.layout)
                      for b in range(x64.shape[0])])
    else:
        y = rope_complex(x64, positions, spec.inv_freq(), layout=spec.layout)
    return np.moveaxis(y, -2, seq_axis)


def randn(rng, shape, dtype):
    return rng.standard_normal(shape).astype(dtype)


# -- zero-size axes, one token -------------------------------------------------------------------
@pytest.mark.parametrize("backend", CPU)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 4, 0, 8), (0, 4, 2, 8), (1, 0, 2, 8), (2, 1, 3, 8), (1, 3, 2, 2)])
def test_empty_axes_and_single_token(backend, dtype, shape, rng):
    # (1, 4, 0, 8) float16 on numpy crashed: the fp16 block's max over an empty buffer (H = 0)
    spec = rotary.RopeSpec(shape[-1])
    x = randn(rng, shape, dtype)
    x0 = x.copy()
    y = rotary.apply(x, spec=spec, seq_axis=1, backend=backend)
    assert np.array_equal(x, x0)
    assert_close(y, oracle(x, np.arange(shape[1]), spec, 1), like=x)
    out = np.full(shape, np.nan, dtype=dtype)
    assert rotary.apply(x, spec=spec, seq_axis=1, backend=backend, out=out) is out
    assert_close(out, oracle(x, np.arange(shape[1]), spec, 1), like=x)


@pytest.mark.parametrize("backend", CPU)
@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_with_zero_heads_in_one(backend, dtype, rng):
    spec = rotary.RopeSpec(8)
    for hq, hk in ((0, 2), (2, 0), (0, 0)):
        q, k = randn(rng, (2, 3, hq, 8), dtype), randn(rng, (2, 3, hk, 8), dtype)
        yq, yk = rotary.apply_qk(q, k, spec=spec, seq_axis=1, backend=backend)
        assert_close(yq, oracle(q, np.arange(3), spec, 1), like=q)
        assert_close(yk, oracle(k, np.arange(3), spec, 1), like=k)


# -- strides, views, read-only, broadcast --------------------------------------------------------
def _views(rng, dtype):
    base = randn(rng, (3, 5, 4, 16), dtype)
    ro = base.copy()
    ro.flags.writeable = False
    return {
        "negative": base[::-1, ::-1, ::-1, ::-1],
        "fortran": np.asfortranarray(base),
        "broadcast": np.broadcast_to(base[:1], base.shape),
        "step-d": randn(rng, (3, 5, 4, 32), dtype)[..., ::2],
        "read-only": ro,
    }


@pytest.mark.parametrize("backend", CPU)
@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_inputs_and_outputs(backend, dtype, rng):
    spec = rotary.RopeSpec(16)
    for name, x in _views(rng, dtype).items():
        x0 = x.copy()
        ref = oracle(x, np.arange(5), spec, 1)
        y = rotary.apply(x, spec=spec, seq_axis=1, backend=backend)
        assert np.array_equal(x, x0), name
        assert_close(y, ref, like=x0, err_msg=name)
        for out in (np.empty((3, 5, 4, 32), dtype)[..., ::2], np.empty((3, 5, 4, 16), dtype)[::-1],
                    np.empty((16, 4, 5, 3), dtype).T):
            assert rotary.apply(x, spec=spec, seq_axis=1, backend=backend, out=out) is out
            assert_close(out, ref, like=x0, err_msg=name)
        if x.flags.writeable:
            rotary.apply(x, spec=spec, seq_axis=1, backend=backend, out=x)
            assert_close(x, ref, like=x0, err_msg=f"{name} in place")


@pytest.mark.parametrize("backend", CPU)
@pytest.mark.parametrize("shape,seq_axis", [((5, 2, 3, 8), 0), ((2, 3, 5, 4, 8), 2), ((3, 5, 8), 1),
                                             ((5, 8), 0), ((2, 3, 5, 4, 8), -2)])
def test_merged_axes_and_seq_axis(backend, shape, seq_axis, rng):
    spec = rotary.RopeSpec(8)
    x = randn(rng, shape, np.float32)
    ax = seq_axis % len(shape)
    pos = rng.integers(0, 1000, (shape[0], shape[ax])) if ax >= 1 else np.arange(shape[ax])
    y = rotary.apply(x, pos, spec=spec, seq_axis=seq_axis, backend=backend)
    assert_close(y, oracle(x, pos, spec, ax), like=x)


# -- out= aliasing -------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", CPU)
def test_out_shifted_view_of_x_errors(backend, rng):
    buf = randn(rng, 2 * 7 * 2 * 64 + 64, np.float32)
    x, out = buf[:-64].reshape(2, 7, 2, 64), buf[64:].reshape(2, 7, 2, 64)
    with pytest.raises(ValueError, match="out"):
        rotary.apply(x, spec=rotary.RopeSpec(64), seq_axis=1, backend=backend, out=out)


@pytest.mark.parametrize("backend", CPU)
def test_out_of_q_overlapping_k_errors(backend, rng):
    # was silently wrong on both backends: q's rotation was written into k before k was read
    spec = rotary.RopeSpec(64)
    q, k = randn(rng, (2, 7, 2, 64), np.float32), randn(rng, (2, 7, 2, 64), np.float32)
    q0, k0 = q.copy(), k.copy()
    with pytest.raises(ValueError, match="out for q overlaps k"):
        rotary.apply_qk(q, k, spec=spec, seq_axis=1, backend=backend, out=(k, q))
    with pytest.raises(ValueError, match="out for q overlaps k"):
        rotary.apply_qk(q, k, spec=spec, seq_axis=1, backend=backend, out=(k, None))
    o = np.empty_like(q)
    with pytest.raises(ValueError, match="out for q and out for k overlap"):
        rotary.apply_qk(q, k, spec=spec, seq_axis=1, backend=backend, out=(o, o))
    assert np.array_equal(q, q0) and np.array_equal(k, k0)


@pytest.mark.parametrize("backend", CPU)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_qkv_views_in_place(backend, dtype, rng):
    # disjoint views of one buffer (fused projection) stay allowed, in place and with GQA k heads = 1
    spec = rotary.RopeSpec(64)
    for hk in (1, 4):
        qkv = randn(rng, (2, 7, 8 + 2 * hk, 64), dtype)
        q, k, v = qkv[:, :, :8], qkv[:, :, 8:8 + hk], qkv[:, :, 8 + hk:]
        rq, rk, v0 = oracle(q, np.arange(7), spec, 1), oracle(k, np.arange(7), spec, 1), v.copy()
        a, b = rotary.apply_qk(q, k, spec=spec, seq_axis=1, backend=backend, out=(q, k))
        assert a is q and b is k
        assert_close(q, rq, like=q)
        assert_close(k, rk, like=k)
        assert np.array_equal(v, v0)


# -- fp16 specials and extremes ------------------------------------------------------------------
@pytest.mark.parametrize("backend", CPU)
@pytest.mark.parametrize("inverse", [False, True])
def test_fp16_extremes_equal_fp32_then_cast(backend, inverse, rng):
    spec = rotary.RopeSpec(16)
    x = randn(rng, (2, 6, 3, 16), np.float16)
    x[0, 1] = 65504
    x[0, 2, :, :4] = -65504
    x[1, 0] = np.float16(6e-8)          # subnormal
    x[1, 1] = -0.0
    x[1, 2, 0, 3] = np.inf              # specials in some tokens only
    x[1, 3, 1, 5] = np.nan
    x[1, 4] = np.float16(3e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        y = rotary.apply(x, spec=spec, seq_axis=1, backend=backend, inverse=inverse)
        y32 = rotary.apply(x.astype(np.float32), spec=spec, seq_axis=1, backend=backend,
                           inverse=inverse).astype(np.float16)
    np.testing.assert_array_equal(y.view(np.uint16)[~np.isnan(y32)], y32.view(np.uint16)[~np.isnan(y32)])
    assert np.array_equal(np.isnan(y), np.isnan(y32))
    # the tokens without specials are unaffected by the special tokens of the block
    assert np.isfinite(y[0, 3:]).all() and np.isfinite(y[1, 5]).all()


# -- positions -----------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", CPU)
@pytest.mark.parametrize("positions", [np.array([2**31 - 1]), np.array([[2**31 - 2], [5], [0]], dtype=np.int32),
                                       np.array([[2**31 - 1], [2**30], [7]]), np.int32(-3), np.array([-5])],
                         ids=["max-int32", "int32-per-batch", "per-batch-S1", "int32-scalar", "negative"])
def test_positions_per_batch_single_token(backend, positions, rng):
    spec = rotary.RopeSpec(32)
    x = randn(rng, (3, 1, 4, 32), np.float32)
    pos = np.asarray(positions)
    full = np.broadcast_to(pos.reshape(-1, 1) if pos.ndim == 2 else np.arange(1) + pos, (3, 1))
    y = rotary.apply(x, positions, spec=spec, seq_axis=1, backend=backend)
    assert_close(y, oracle(x, full, spec, 1), like=x)


# -- Numba geometry cache ------------------------------------------------------------------------
@pytest.mark.skipif("numba" not in AVAILABLE, reason="numba not installed")
def test_numba_geometry_cache_same_shape_other_layouts(rng):
    spec = rotary.RopeSpec(64)
    base = randn(rng, (2, 9, 4, 64), np.float32)
    out = np.empty((2, 8, 4, 64), np.float32)
    for x in (base[:, :8], base[:, 1:], base[:, ::-1][:, :8], base[:, :8].copy()):
        ref = oracle(x, np.arange(8), spec, 1)
        assert_close(rotary.apply(x, spec=spec, seq_axis=1, backend="numba"), ref, like=x)
        rotary.apply(x, spec=spec, seq_axis=1, backend="numba", out=out)
        assert_close(out, ref, like=x)
    x = base[:, :8].copy()                     # the same array in place, then out of place
    ref = oracle(x, np.arange(8), spec, 1)
    rotary.apply(x, spec=spec, seq_axis=1, backend="numba", out=x[...])
    assert_close(x, ref, like=x)
    assert_close(rotary.apply(x, spec=spec, seq_axis=1, backend="numba"), oracle(x, np.arange(8), spec, 1), like=x)
    for dtype in (np.float16, np.float64):     # same shape, other item size
        xd = base[:, :8].astype(dtype)
        assert_close(rotary.apply(xd, spec=spec, seq_axis=1, backend="numba"), oracle(xd, np.arange(8), spec, 1),
                     like=xd)


def test_threads_share_table_and_geometry_caches():
    def work(seed):
        r = np.random.default_rng(seed)
        for j in range(24):
            S, D = int(r.integers(1, 40)), int(r.choice([8, 16, 64]))
            dtype, backend = DTYPES[j % 3], CPU[j % len(CPU)]
            x = r.standard_normal((2, S, 3, D)).astype(dtype)
            off = int(r.integers(0, 3000))
            spec = rotary.RopeSpec(D, base=(10000.0, 500000.0)[seed % 2])
            y = rotary.apply(x, off, spec=spec, seq_axis=1, backend=backend)
            assert_close(y, oracle(x, np.arange(S) + off, spec, 1), like=x)

    errors = run_in_threads(work, 4)
    assert not errors, errors[0]


@settings(max_examples=25, deadline=None)
@given(b=st.integers(1, 3), s=st.integers(1, 9), h=st.integers(0, 3), half=st.integers(1, 12),
       extra=st.integers(0, 3), layout=st.sampled_from(["half", "interleaved"]), dtype=st.sampled_from(DTYPES),
       offset=st.one_of(st.integers(-5, 5000), st.integers(-(2**53) + 10, 2**53 - 10)), inplace=st.booleans(),
       reverse=st.booleans())
def test_numba_equals_numpy_property(b, s, h, half, extra, layout, dtype, offset, inplace, reverse):
    """Both backends against the exact oracle at any offset below 2**53 (angles are exact, issue 14),
    and against each other to a few ulp."""
    if "numba" not in AVAILABLE:
        pytest.skip("numba not installed")
    D = 2 * half + extra
    spec = rotary.RopeSpec(D, layout=layout, rotary_dim=2 * half)
    x = np.random.default_rng(b * 1000 + s * 10 + h).standard_normal((b, s, h, D)).astype(dtype)
    if reverse:
        x = x[:, ::-1, :, ::-1]
    ref = rotary.apply(x, offset, spec=spec, seq_axis=1, backend="numpy")
    assert_close(ref, oracle(x, np.arange(s) + offset, spec, 1), like=x)
    if inplace:
        y = x.copy()
        rotary.apply(y, offset, spec=spec, seq_axis=1, backend="numba", out=y)
    else:
        y = rotary.apply(x, offset, spec=spec, seq_axis=1, backend="numba")
    assert_close(y, oracle(x, np.arange(s) + offset, spec, 1), like=x)
    ulp = np.finfo(dtype).eps * max(1.0, float(np.max(np.abs(x), initial=0.0)))
    np.testing.assert_allclose(y.astype(np.float64), ref.astype(np.float64), rtol=0, atol=4 * ulp)


# -- linear attention ----------------------------------------------------------------------------
LA_CASES = [dict(), dict(chunk=1), dict(chunk=100), dict(T=50, chunk=7, split=23), dict(m=7, dv=3),
            dict(m=5, dv=1), dict(B=3, H=1, T=1, split=0), dict(T=2, split=1), dict(dtype=np.float64),
            dict(feature_map="relu", m=6, dv=9)]


@pytest.mark.parametrize("first,second", [(a, b) for a in CPU for b in CPU])
@pytest.mark.parametrize("case", LA_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default")
def test_linear_attention_state_across_backends(first, second, case, rng):
    c = dict(B=1, H=2, T=7, m=8, dv=8, chunk=3, split=4, dtype=np.float32, feature_map="elu") | case
    B, H, T, m, dv, split, dtype = c["B"], c["H"], c["T"], c["m"], c["dv"], c["split"], c["dtype"]
    q, k = randn(rng, (B, H, T, m), dtype), randn(rng, (B, H, T, m), dtype)
    v = randn(rng, (B, H, T, dv), dtype)
    spec = rotary.RopeSpec(m)
    kw = dict(causal=True, chunk=c["chunk"], feature_map=c["feature_map"], seq_axis=-2)
    o1, state = rotary.linear_attention(q[:, :, :split], k[:, :, :split], v[:, :, :split], spec=spec,
                                        backend=first, return_state=True, **kw)
    S0, z0 = state.S.copy(), state.z.copy()
    o2 = rotary.linear_attention(q[:, :, split:], k[:, :, split:], v[:, :, split:], state=state, backend=second, **kw)
    assert np.array_equal(state.S, S0) and np.array_equal(state.z, z0)
    ref = linear_attention_quadratic(q, k, v, np.arange(T), spec.inv_freq(), causal=True,
                                     feature_map=c["feature_map"])
    tol = {} if dtype == np.float64 else dict(rtol=3e-5, atol=3e-5)
    assert_close(np.concatenate([o1, o2], axis=2), ref, like=q, **tol)


@pytest.mark.parametrize("backend", CPU)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("T,dv", [(100, 64), (37, 32)])
def test_linear_attention_several_groups(backend, causal, T, dv, rng):
    # B*H*chunk*m large enough that the NumPy path splits T into several groups (float64 carry)
    B, H, m = 4, 8, 64
    q, k = randn(rng, (B, H, T, m), np.float32), randn(rng, (B, H, T, m), np.float32)
    v = randn(rng, (B, H, T, dv), np.float32)
    spec = rotary.RopeSpec(m)
    inputs = [a.copy() for a in (q, k, v)]
    o = rotary.linear_attention(q, k, v, spec=spec, causal=causal, chunk=16, backend=backend, seq_axis=-2)
    assert all(np.array_equal(a, b) for a, b in zip(inputs, (q, k, v)))
    ref = linear_attention_quadratic(q, k, v, np.arange(T), spec.inv_freq(), causal=causal)
    assert_close(o, ref, like=q, rtol=3e-5, atol=3e-5)


@pytest.mark.parametrize("backend", CPU)
def test_linear_attention_empty_batch_or_heads(backend):
    for shape in ((0, 2, 5, 8), (2, 0, 5, 8)):
        q = np.zeros(shape, np.float32)
        v = np.zeros(shape[:-1] + (4,), np.float32)
        for causal in (True, False):
            o, state = rotary.linear_attention(q, q, v, causal=causal, backend=backend, return_state=True, seq_axis=-2)
            assert o.shape == shape[:-1] + (4,) and o.dtype == np.float32
            assert state.S.shape == shape[:2] + (8, 4)


# -- out= overlap of device arrays, decided on the host from addresses ---------------------------------
def _device_like(a):
    """An object shaped like a CuPy array (data.ptr, shape, strides, dtype) over a NumPy array's memory."""
    import types

    return types.SimpleNamespace(data=types.SimpleNamespace(ptr=a.__array_interface__["data"][0]), shape=a.shape,
                                 strides=a.strides, dtype=a.dtype)


@pytest.mark.parametrize("seed", range(5))
def test_address_view_overlap_equals_numpy(seed):
    """_address_view answers shares_memory like NumPy does on the real memory: fused-qkv slices (disjoint,
    interleaved bounds), shifted views, reversed views, the same view."""
    from rotary.frontend import buffers as _api

    rng = np.random.default_rng(seed)
    qkv = np.zeros((2, 5, 3, 4, 8), np.float32)          # (B, S, q|k|v, H, D)
    views = [qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 1, :1], qkv[:, :, 2, ::-1], qkv.reshape(-1)[8:8 + 2 * 5 * 4 * 8]
             .reshape(2, 5, 4, 8), qkv[:, ::2, 0], qkv[:, 1::2, 0], qkv[..., 3:5]]
    for _ in range(20):
        i, j = rng.integers(0, len(views), 2)
        a, b = views[i], views[j]
        got = np.shares_memory(_api._address_view(_device_like(a)), _api._address_view(_device_like(b)))
        assert got == np.shares_memory(a, b), (i, j)
