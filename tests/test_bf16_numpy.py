"""ml_dtypes.bfloat16 NumPy arrays: accepted where float16 is, computed in float32."""

import numpy as np
import pytest

import rotary
import rotary.testing
from rotary.testing import attention_quadratic, linear_attention_quadratic, rope_complex

from .conftest import AVAILABLE

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)
CPU_BACKENDS = [b for b in ("numba", "numpy") if b in AVAILABLE]


def _bf16(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(BF16)


@pytest.mark.interop("NumPy + ml_dtypes.bfloat16", "cpu", "numba, numpy", "-")
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_bf16_rotation_and_out(backend):
    q, k = _bf16((2, 17, 4, 64), 0), _bf16((2, 17, 1, 64), 1)
    spec = rotary.RopeSpec(64, layout="interleaved")
    pos = np.arange(17) + 1000
    q0 = q.copy()
    qr, kr = rotary.apply_qk(q, k, pos, spec=spec, seq_axis=-3, backend=backend)
    assert qr.dtype == BF16 and kr.dtype == BF16 and np.array_equal(q.view(np.uint16), q0.view(np.uint16))
    for r, x in ((qr, q), (kr, k)):
        exact = np.moveaxis(rope_complex(np.moveaxis(x.astype(np.float64), 2, 1), pos, spec.inv_freq(),
                                         layout="interleaved"), 1, 2)
        # float32 result rounded once to bfloat16: within half a bfloat16 ulp (2**-8 relative) plus fp32 error
        np.testing.assert_allclose(r.astype(np.float64), exact, rtol=2**-8 + 1e-6, atol=1e-6)
        np.testing.assert_array_equal(r.view(np.uint16), rotary.apply(x.astype(np.float32), pos, spec=spec,
                                                                      seq_axis=-3, backend=backend).astype(BF16).view(np.uint16))
    rotary.apply_qk(q, k, pos, spec=spec, seq_axis=-3, backend=backend, out=(q, k))
    np.testing.assert_array_equal(q.view(np.uint16), qr.view(np.uint16))
    with pytest.raises(ValueError, match="out for x"):
        rotary.apply(q, seq_axis=-3, out=np.empty(q.shape, np.float32))


@pytest.mark.interop("NumPy + ml_dtypes.bfloat16", "cpu", "numba, numpy", "-")
def test_bf16_linear_attention():
    q, k, v = _bf16((1, 30, 2, 16), 2), _bf16((1, 30, 2, 16), 3), _bf16((1, 30, 2, 8), 4)
    o, st = rotary.linear_attention(q, k, v, causal=True, seq_axis=-3, return_state=True)
    assert o.dtype == BF16 and st.S.dtype == np.float32
    exp = np.moveaxis(linear_attention_quadratic(*(np.moveaxis(a.astype(np.float64), 2, 1) for a in (q, k, v)),
                                                 np.arange(30), rotary.RopeSpec(16).inv_freq(), causal=True), 1, 2)
    np.testing.assert_allclose(o.astype(np.float64), exp, rtol=1.6e-2, atol=1.6e-2)


@pytest.mark.interop("NumPy + ml_dtypes.bfloat16", "cpu", "numba, numpy", "attention, rerotate")
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_bf16_attention_and_rerotate(backend):
    """bfloat16 q, k, v (causal GQA, a sliding window) and keys to re-rotate: computed in float32 (the
    float32 call on the widened arrays, rounded once), returned as bfloat16, within bfloat16 tolerance of
    the float64 oracles."""
    q, k, v = _bf16((2, 13, 4, 32), 5), _bf16((2, 13, 2, 32), 6), _bf16((2, 13, 2, 16), 7)
    spec = rotary.RopeSpec(32, base=10000.0)
    rtol, atol = rotary.testing.tolerance(BF16)
    wide = [a.astype(np.float32) for a in (q, k, v)]
    for kw in ({"causal": True}, {"causal": True, "window": 4}, {"causal": False, "scale": 0.2}):
        o = rotary.attention(q, k, v, 100, spec=spec, seq_axis=-3, backend=backend, **kw)
        assert o.dtype == BF16 and o.shape == (2, 13, 4, 16)
        f32 = rotary.attention(*wide, 100, spec=spec, seq_axis=-3, backend=backend, **kw)
        np.testing.assert_array_equal(o.view(np.uint16), f32.astype(BF16).view(np.uint16))
        pos = np.arange(13) + 100
        exact = attention_quadratic(*(np.moveaxis(a.astype(np.float64), 2, 1) for a in (q, k, v)), pos, pos,
                                    spec.inv_freq(), **kw)
        np.testing.assert_allclose(o.astype(np.float64), np.moveaxis(exact, 1, 2), rtol=rtol, atol=atol)
    o = rotary.attention(q[:, -1:], k, v, q_positions=12, k_positions=0, causal=True, spec=spec, seq_axis=-3,
                         backend=backend)   # a decode step
    assert o.dtype == BF16
    np.testing.assert_allclose(o.astype(np.float64),
                               rotary.attention(*wide, causal=True, spec=spec, seq_axis=-3)[:, -1:], rtol=rtol,
                               atol=atol)
    # rerotate: keys rotated at 0..12 move to 500..512 (bfloat16 in and out)
    kr = rotary.apply(k, spec=spec, seq_axis=-3, backend=backend)
    moved = rotary.rerotate(kr, 0, 500, spec=spec, seq_axis=-3, backend=backend)
    assert moved.dtype == BF16
    exact = np.moveaxis(rope_complex(np.moveaxis(kr.astype(np.float64), 2, 1), np.full(13, 500),   # R_(p+500) R_p^-1
                                     spec.inv_freq()), 1, 2)
    np.testing.assert_allclose(moved.astype(np.float64), exact, rtol=rtol, atol=atol)
    out = np.empty_like(kr)
    assert rotary.rerotate(kr, 0, 500, spec=spec, seq_axis=-3, backend=backend, out=out) is out
    np.testing.assert_array_equal(out.view(np.uint16), moved.view(np.uint16))
