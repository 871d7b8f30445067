"""eps=0 with a zero denominator (relu of an all-negative q row: phi(q) = 0, so phi(q) . z = 0): that row of o is
NaN (0/0) on every backend, in one call, chunked, causal or not, and in the decode step; no exception, and
every other row is finite and equals the float64 oracle."""

import numpy as np
import pytest

import rotary
from rotary import testing

BACKENDS = [name for name, (ok, _) in rotary.available_backends().items() if ok]


def _inputs(dtype, B=2, T=6, H=2, d=16, dv=16, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, H, d)).astype(dtype)
    k = np.abs(rng.standard_normal((B, T, H, d))).astype(dtype)   # relu(k) > 0: every other denominator > 0
    v = rng.standard_normal((B, T, H, dv)).astype(dtype)
    q[1, 3, 0] = -np.abs(q[1, 3, 0]) - 0.5                         # phi(q) = 0 in this row alone
    return q, k, v


def _oracle(q, k, v, causal):
    """Quadratic float64 linear attention with RoPE in the numerator (relu, eps=0), per (b, h)."""
    spec = rotary.RopeSpec(q.shape[-1], base=10000.0)
    o = np.empty(q.shape[:-1] + (v.shape[-1],))
    for b in range(q.shape[0]):
        for h in range(q.shape[2]):
            o[b, :, h] = _quadratic(q[b, :, h], k[b, :, h], v[b, :, h], spec, causal)
    return o


def _quadratic(q, k, v, spec, causal):
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    T = q.shape[0]
    a, b = np.maximum(q, 0), np.maximum(k, 0)
    ra = testing.rope_2x2(a[None], np.arange(T)[None], spec.inv_freq())[0]
    rb = testing.rope_2x2(b[None], np.arange(T)[None], spec.inv_freq())[0]
    num, den = ra @ rb.T, a @ b.T
    if causal:
        mask = np.tril(np.ones((T, T), bool))
        num, den = num * mask, den * mask
    with np.errstate(invalid="ignore", divide="ignore"):
        return (num @ v) / den.sum(axis=1, keepdims=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("chunk", [2, 64])
def test_zero_denominator_is_nan_in_that_row_only(backend, dtype, causal, chunk):
    q, k, v = _inputs(dtype)
    o = rotary.linear_attention(q, k, v, causal=causal, feature_map="relu", eps=0.0, chunk=chunk, seq_axis=1,
                                spec=rotary.RopeSpec(16, base=10000.0), backend=backend)
    want = _oracle(q, k, v, causal)
    nan = np.isnan(o)
    assert nan[1, 3, 0].all() and nan.sum() == o.shape[-1], np.argwhere(nan)[:8]
    mask = ~np.isnan(want)
    tol = 2e-4 if dtype == np.float32 else 1e-9
    np.testing.assert_allclose(o[mask], want[mask], rtol=tol, atol=tol)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_zero_denominator_in_decode_steps(backend, dtype):
    """The one-token decode step (general path, then the step's plan) gives NaN in the all-negative row."""
    q, k, v = _inputs(dtype, T=6)
    spec = rotary.RopeSpec(16, base=10000.0)
    kw = dict(causal=True, feature_map="relu", eps=0.0, seq_axis=1, spec=spec, backend=backend, return_state=True)
    o, state = rotary.linear_attention(q[:, :1], k[:, :1], v[:, :1], **kw)
    outs = [o]
    kw.pop("spec")
    for t in range(1, 6):
        o, state = rotary.linear_attention(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], state=state, **kw)
        outs.append(o)
    o = np.concatenate(outs, axis=1)
    nan = np.isnan(o)
    assert nan[1, 3, 0].all() and nan.sum() == o.shape[-1], np.argwhere(nan)[:8]
    want = _oracle(q, k, v, True)
    mask = ~np.isnan(want)
    tol = 2e-4 if dtype == np.float32 else 1e-9
    np.testing.assert_allclose(o[mask], want[mask], rtol=tol, atol=tol)
