"""Property-based tests of the CUDA kernels through the host shim (tests/cuda_shim, issue 25): drawn
rotations (offsets, partial rotary_dim, layouts, dtypes, per-batch positions, M-RoPE) and linear
attention (causal or not, GQA, decay, normalize) against the float64 oracles of tests/_props.py. Few
draws: every launch runs one host thread per CUDA thread.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, strategies as st

import rotary

from . import _props as P
from .test_cuda_kernels_cpu import kernels, use_backend  # noqa: F401  (host-shim fixtures)

pytestmark = pytest.mark.cuda_cpu


@P.examples(25)
@given(spec=st.one_of(P.plain_specs(max_head_dim=20), P.mrope_specs()), S=st.integers(0, 6), B=st.integers(1, 2),
       dtype=st.sampled_from(["float16", "float32", "float64"]), per_batch=st.booleans(), inverse=st.booleans(),
       geometry=st.sampled_from([(256, None), (5, 1), (32, 3)]), seed=st.integers(0, 2**31), nonfinite=st.booleans())
def test_shim_rotation(use_backend, spec, S, B, dtype, per_batch, inverse, geometry, seed, nonfinite):  # noqa: F811
    name = use_backend(threads=geometry[0], max_tokens_per_block=geometry[1])
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((B, S, 3, spec.head_dim))
    if nonfinite and x.size:
        x.reshape(-1)[rng.integers(x.size)] = np.nan
    x = x.astype(dtype)
    if spec.multi_axis:
        coords = rng.integers(0, 500, size=(B, S, 3) if per_batch else (S, 3))
    else:
        coords = rng.integers(0, 10**6, size=(B, S) if per_batch else (S,))
    y = rotary.apply(x, coords, spec=spec, seq_axis=1, inverse=inverse and not spec.multi_axis, backend=name)
    xs = np.moveaxis(x.astype(np.float64), 1, 2)
    want = np.moveaxis(P.spec_oracle(xs, coords, spec, inverse=inverse and not spec.multi_axis), 2, 1)
    P.assert_matches(y, want, dtype)


@P.examples(20)
@given(spec=P.plain_specs(max_head_dim=8), T=st.integers(0, 9), hk=st.integers(1, 2), groups=st.integers(1, 2),
       causal=st.booleans(), decay=st.sampled_from([None, 0.8]), normalize=st.booleans(), chunk=st.sampled_from([2, 64]),
       threads=st.sampled_from([32, 128]), seed=st.integers(0, 2**31))
def test_shim_linear_attention(use_backend, spec, T, hk, groups, causal, decay, normalize, chunk, threads,  # noqa: F811
                               seed):
    name = use_backend(threads=threads)
    decay = decay if causal else None
    rng = np.random.default_rng(seed)
    H, d = hk * groups, spec.head_dim
    q = rng.standard_normal((1, H, T, d)).astype(np.float32)
    k = rng.standard_normal((1, hk, T, d)).astype(np.float32)
    v = rng.standard_normal((1, hk, T, 3)).astype(np.float32)
    if T and seed % 3 == 0:   # a NaN value: reaches exactly the outputs that see its token
        v[0, 0, seed % T, 1] = np.nan
    o = rotary.linear_attention(q, k, v, spec=spec, causal=causal, decay=decay, normalize=normalize, chunk=chunk,
                                backend=name, seq_axis=-2)
    k64, v64 = (np.repeat(a.astype(np.float64), groups, axis=1) for a in (k, v))
    a, b = P.feature64(q, "elu"), P.feature64(k64, "elu")
    pos = np.arange(T)
    ah, bh = P.spec_oracle(a, pos, spec), P.spec_oracle(b, pos, spec)
    gam = np.full(H, 1.0 if decay is None else decay)
    want = P.linear_attention_oracle(a[0], b[0], ah[0], bh[0], v64[0], causal=causal, decay=gam, normalize=normalize,
                                     eps=1e-6)
    P.assert_matches(o[0], want, "float32")


@pytest.mark.parametrize("decay", [None, 0.9])
@pytest.mark.parametrize("chunk", [4, 64])
def test_shim_causal_linear_attention_later_nan_stays_later(use_backend, decay, chunk):  # noqa: F811
    """The CUDA kernel keeps a later token's NaN out of earlier outputs in this geometry (d = 8, T = 10, the
    NaN at token 6)."""
    name = use_backend(threads=32)
    q = np.random.default_rng(0).standard_normal((1, 2, 10, 8)).astype(np.float32)
    v = q.copy()
    v[0, 0, 6, 1] = np.nan
    o = rotary.linear_attention(q, q, v, causal=True, chunk=chunk, decay=decay, backend=name, seq_axis=-2)
    assert np.isfinite(o[0, 0, :6]).all() and np.isnan(o[0, 0, 6:, 1]).all() and np.isfinite(o[0, 1]).all()


@pytest.mark.parametrize("T, t", [(5, 3), (4, 1)])
def test_shim_causal_linear_attention_later_nan_small_heads(use_backend, T, t):  # noqa: F811
    """d = 2, T = 4/5: the kernel's 2x2 tiles of P V multiplied row t - 1's zero weight of token t into its
    NaN value (0 * NaN), until the diagonal block skipped those terms (mma_tile_diagonal)."""
    name = use_backend(threads=32)
    q = np.random.default_rng(0).standard_normal((1, 1, T, 2)).astype(np.float32)
    v = np.random.default_rng(1).standard_normal((1, 1, T, 3)).astype(np.float32)
    v[0, 0, t, 1] = np.nan
    o = rotary.linear_attention(q, q, v, causal=True, chunk=64, backend=name, seq_axis=-2)
    assert np.isfinite(o[0, 0, :t]).all()
