"""The caller's own cos/sin values (rotary/spec/given_tables.py): vLLM / SGLang / FlashInfer's cos_sin_cache and
TransformerEngine's per-token angles, rotated on every backend, against float64 oracles written the way those
engines apply them."""

import numpy as np
import pytest

import rotary
from rotary import testing

BACKENDS = [name for name, (ok, _) in rotary.available_backends().items() if ok and name != "cupy"]


def _vllm_reference(x, positions, cos_sin_cache, is_neox):
    """vLLM's RotaryEmbedding.forward_native in float64: cos, sin = cache[positions].chunk(2); neox pairs (i, i+r/2),
    else (2i, 2i+1); coordinates past rotary_dim pass through. x (B, S, H, D), positions (B, S)."""
    x = x.astype(np.float64)
    cs = cos_sin_cache.astype(np.float64)[positions]          # (B, S, r)
    r = cs.shape[-1]
    cos, sin = cs[..., : r // 2][:, :, None], cs[..., r // 2:][:, :, None]
    rot, rest = x[..., :r], x[..., r:]
    if is_neox:
        a, b = rot[..., : r // 2], rot[..., r // 2:]
        out = np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)
    else:
        a, b = rot[..., 0::2], rot[..., 1::2]
        out = np.stack([a * cos - b * sin, b * cos + a * sin], -1).reshape(rot.shape)
    return np.concatenate([out, rest], -1)


def _cache(spec, n):
    angles = np.arange(n)[:, None] * spec.inv_freq()[None]
    return np.concatenate([np.cos(angles), np.sin(angles)], -1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("layout, rotary_dim", [("half", 64), ("interleaved", 64), ("half", 32)])
def test_cos_sin_cache_is_read_at_the_positions(rng, backend, dtype, layout, rotary_dim):
    spec = rotary.RopeSpec(64, rotary_dim=rotary_dim, base=10000.0, layout=layout)
    cache = (_cache(spec, 300) * (1 + 0.25 * rng.random((300, 1)))).astype(np.float32)   # any values, not the spec's
    q = rng.standard_normal((3, 5, 4, 64)).astype(dtype)
    k = rng.standard_normal((3, 5, 2, 64)).astype(dtype)
    pos = rng.integers(0, 300, (3, 5))
    got = rotary.apply_qk(q, k, pos, cos_sin_cache=cache, layout=layout, seq_axis=1, backend=backend)
    for x, y in zip((q, k), got):
        testing.assert_close(y, _vllm_reference(x, pos, cache, layout == "half"), like=x)
    y = rotary.apply(q, pos[0], spec=spec, cos_sin_cache=cache, seq_axis=1, backend=backend)
    testing.assert_close(y, _vllm_reference(q, np.broadcast_to(pos[0], (3, 5)), cache, layout == "half"), like=q)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_spec_own_table_gives_the_spec_rotation(rng, backend):
    """A cos_sin_cache made from the spec's frequencies gives what the spec itself gives (float64 data)."""
    spec = rotary.RopeSpec(32, base=500.0)
    x = rng.standard_normal((2, 6, 3, 32))
    pos = rng.integers(0, 1000, (2, 6))
    want = rotary.apply(x, pos, spec=spec, seq_axis=1, backend=backend)
    got = rotary.apply(x, pos, spec=spec, cos_sin_cache=_cache(spec, 1000), seq_axis=1, backend=backend)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("per_batch", [False, True])
def test_angles_as_transformer_engine_freqs(rng, backend, per_batch):
    """TransformerEngine's freqs (S, 1, 1, d) (or per batch (S, B, 1, d)) hold each angle twice; its half-split
    rotation x * cos(freqs) + rotate_half(x) * sin(freqs) is what angles=freqs[..., :d/2] gives."""
    B, S, H, D = 2, 7, 3, 16
    theta = rng.random((S, B if per_batch else 1, 1, D // 2)) * 50
    freqs = np.concatenate([theta, theta], -1)                          # TE: torch.cat((freqs, freqs), dim=-1)
    x = rng.standard_normal((B, S, H, D)).astype(np.float32)
    xs = np.moveaxis(x.astype(np.float64), 1, 0)                        # sbhd, as TE takes it
    half = np.concatenate([-xs[..., D // 2:], xs[..., : D // 2]], -1)   # rotate_half
    want = np.moveaxis(xs * np.cos(freqs) + half * np.sin(freqs), 0, 1)
    angles = np.moveaxis(freqs[:, :, 0, : D // 2], 0, 1) if per_batch else freqs[:, 0, 0, : D // 2]
    got = rotary.apply(x, angles=angles, seq_axis=1, backend=backend)
    testing.assert_close(got, want, like=x)


def test_given_values_errors(rng):
    x = rng.standard_normal((2, 5, 3, 16)).astype(np.float32)
    cache = np.ones((10, 16), np.float32)
    with pytest.raises(ValueError, match=r"0 <= position < 10"):
        rotary.apply(x, 10, cos_sin_cache=cache, seq_axis=1)
    with pytest.raises(ValueError, match="even number of columns"):
        rotary.apply(x, 0, cos_sin_cache=np.ones((10, 15)), seq_axis=1)
    with pytest.raises(ValueError, match="not both"):
        rotary.apply(x, 0, cos_sin_cache=cache, angles=np.zeros((5, 8)), seq_axis=1)
    with pytest.raises(ValueError, match="angles or positions"):
        rotary.apply(x, 0, angles=np.zeros((5, 8)), seq_axis=1)
    with pytest.raises(ValueError, match="sequence length 5"):
        rotary.apply(x, angles=np.zeros((4, 8)), seq_axis=1)
    with pytest.raises(ValueError, match=r"spec.rotary_dim \(16\) does not match cos_sin_cache"):
        rotary.apply(x, 0, spec=rotary.RopeSpec(16), cos_sin_cache=np.ones((10, 8)), seq_axis=1)
    with pytest.raises(TypeError, match="real floating"):
        rotary.apply(x, 0, cos_sin_cache=np.ones((10, 16), np.int32), seq_axis=1)
    with pytest.raises(ValueError, match="finite"):
        rotary.apply(x, 0, cos_sin_cache=np.full((10, 16), np.nan), seq_axis=1)
    kept = cache.copy()
    rotary.apply(x, 3, cos_sin_cache=cache, seq_axis=1)
    np.testing.assert_array_equal(cache, kept)
