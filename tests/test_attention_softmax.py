"""Softmax attention with RoPE against a quadratic float64 oracle, causal and not, with GQA."""

import math

import numpy as np
import pytest

import rotary
from rotary.testing import assert_close, rope_complex

from .conftest import backend_params


def oracle(q, k, v, pos, spec, causal):
    """q (B, Hq, S, d), k/v (B, Hk, S, *): explicit loops over heads, float64 softmax."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    inv = spec.inv_freq()
    qr = rope_complex(q, pos, inv, layout=spec.layout)
    kr = rope_complex(k, pos, inv, layout=spec.layout)
    B, Hq, S, d = q.shape
    g = Hq // k.shape[1]
    o = np.zeros((B, Hq, S, v.shape[-1]))
    for b in range(B):
        for h in range(Hq):
            for t in range(S):
                scores = np.array([qr[b, h, t] @ kr[b, h // g, s] / math.sqrt(d) for s in range(S)])
                if causal:
                    scores[t + 1:] = -np.inf
                w = np.exp(scores - scores.max())
                o[b, h, t] = (w / w.sum()) @ v[b, h // g]
    return o


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_attention_matches_oracle_gqa(dtype, layout, causal, backend, rng):
    q = rng.standard_normal((2, 4, 6, 16)).astype(dtype)
    k = rng.standard_normal((2, 2, 6, 16)).astype(dtype)
    v = rng.standard_normal((2, 2, 6, 5)).astype(dtype)
    spec = rotary.RopeSpec(16, layout=layout, base=100.0)
    o = rotary.attention(q, k, v, 3, causal=causal, spec=spec, backend=backend, seq_axis=-2)
    assert_close(o, oracle(q, k, v, np.arange(6) + 3, spec, causal), like=q,
                 **({} if dtype == np.float64 else dict(rtol=2e-5, atol=2e-5)))


def test_attention_bshd_equals_bhsd(rng):
    q = rng.standard_normal((1, 5, 4, 8))
    k = rng.standard_normal((1, 5, 1, 8))
    v = rng.standard_normal((1, 5, 1, 3))
    o1 = rotary.attention(q, k, v, causal=True, seq_axis=-3)
    o2 = rotary.attention(*(np.swapaxes(a, 1, 2) for a in (q, k, v)), causal=True, seq_axis=-2)
    np.testing.assert_allclose(o1, np.swapaxes(o2, 1, 2), atol=1e-12)


def test_attention_bad_input(rng):
    q = np.zeros((1, 3, 5, 8))
    with pytest.raises(ValueError, match="multiple"):
        rotary.attention(q, np.zeros((1, 2, 5, 8)), np.zeros((1, 2, 5, 8)), seq_axis=-2)
    with pytest.raises(ValueError, match="v"):
        rotary.attention(q, q, np.zeros((1, 3, 4, 8)), seq_axis=-2)
    with pytest.raises(ValueError, match="head_dim"):
        rotary.attention(q, np.zeros((1, 3, 5, 6)), np.zeros((1, 3, 5, 6)), seq_axis=-2)
    with pytest.raises(TypeError, match="causal"):
        rotary.attention(q, q, q, causal="yes", seq_axis=-2)
    with pytest.raises(TypeError, match="scale"):
        rotary.attention(q, q, q, scale="big", seq_axis=-2)
