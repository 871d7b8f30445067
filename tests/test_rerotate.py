"""rotary.rerotate: rotated keys moved to new positions / another spec equal rotating the unrotated keys
directly (float64 oracle and the library's own apply), on every backend, in place, and through the CUDA
kernels via the host shim."""

import numpy as np
import pytest

import rotary
from rotary import RopeSpec, testing

from .conftest import backend_params
from .test_cuda_kernels_cpu import kernels, use_backend  # noqa: F401  (host-shim fixtures)

SPEC = RopeSpec(32, base=10000.0)


def _oracle_bshd(k, positions, spec, seq_len=None):
    """float64 rotation of BSHD k at positions (S,) or (B, S) with spec's frequencies and scaling."""
    pos = np.broadcast_to(np.asarray(positions), (k.shape[0], k.shape[1]))
    bhsd = np.swapaxes(np.asarray(k, np.float64), 1, 2)
    y = testing.rope_2x2(bhsd, pos[:, None, :], spec.inv_freq(seq_len), layout=spec.layout,
                         scale=spec.attention_scaling_at(seq_len))
    return np.swapaxes(y, 1, 2)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("backend", backend_params())
def test_rerotate_moves_keys(backend, dtype, layout, rng):
    spec = RopeSpec(32, base=10000.0, layout=layout, rotary_dim=24)
    k = rng.standard_normal((3, 6, 2, 32)).astype(dtype)
    src = rng.integers(0, 2**20, size=(3, 6))
    dst = rng.integers(0, 2**20, size=(3, 6))
    k_rot = rotary.apply(k, src, spec=spec, seq_axis=1, backend=backend)
    moved = rotary.rerotate(k_rot, src, dst, spec=spec, seq_axis=1, backend=backend)
    want = _oracle_bshd(k, dst, spec)
    r, a = testing.tolerance(dtype)
    testing.assert_close(moved, want, like=k, rtol=2 * r, atol=2 * a)   # two roundings of the stored key
    # in place, int offsets (StreamingLLM: the window after the sinks)
    buf = k_rot.copy()
    assert rotary.rerotate(buf, src, 4, spec=spec, seq_axis=1, out=buf, backend=backend) is buf
    testing.assert_close(buf, _oracle_bshd(k, np.arange(6) + 4, spec), like=k, rtol=2 * r, atol=2 * a)


@pytest.mark.parametrize("backend", backend_params())
def test_rerotate_longrope_short_to_long(backend, rng):
    """LongRoPE: keys rotated with the short factors (cache below the original context) moved to the long
    factors (and attention factor) once the sequence grows past it."""
    half = 8
    scaling = {"rope_type": "longrope", "short_factor": list(1.0 + 0.1 * np.arange(half)),
               "long_factor": list(2.0 + 0.5 * np.arange(half)), "original_max_position_embeddings": 64}
    spec = RopeSpec(16, base=10000.0, scaling=scaling, max_position_embeddings=256)
    k = rng.standard_normal((1, 40, 2, 16))
    pos = np.arange(40)
    k_short = rotary.apply(k, pos, spec=spec, seq_axis=1, backend=backend)   # 40 < 64: short factors
    testing.assert_close(k_short, _oracle_bshd(k, pos, spec, seq_len=40))
    moved = rotary.rerotate(k_short, pos, pos, spec=spec, seq_len=40, to_seq_len=200, seq_axis=1, backend=backend)
    testing.assert_close(moved, _oracle_bshd(k, pos, spec, seq_len=200), rtol=1e-11, atol=1e-11)
    other = RopeSpec(16, base=500.0)   # to_spec: a different base
    moved = rotary.rerotate(k_short, pos, pos + 3, spec=spec, seq_len=40, to_spec=other, seq_axis=1, backend=backend)
    testing.assert_close(moved, _oracle_bshd(k, pos + 3, other), rtol=1e-11, atol=1e-11)


def test_rerotate_cuda_kernels_through_host_shim(use_backend, rng):  # noqa: F811
    name = use_backend(threads=32, max_tokens_per_block=3)
    k = rng.standard_normal((2, 5, 3, 32)).astype(np.float32)
    src, dst = rng.integers(0, 5000, size=(2, 5)), rng.integers(0, 5000, size=5)
    moved = rotary.rerotate(rotary.apply(k, src, spec=SPEC, seq_axis=1), src, dst, spec=SPEC, seq_axis=1, backend=name)
    testing.assert_close(moved, _oracle_bshd(k, dst, SPEC), like=k, rtol=4e-6, atol=4e-6)


def test_rerotate_bad_input(rng):
    k = rng.standard_normal((1, 4, 2, 32))
    with pytest.raises(ValueError, match="from_positions of shape"):
        rotary.rerotate(k, np.arange(3), 0, spec=SPEC, seq_axis=1)
    with pytest.raises(ValueError, match="to_positions of shape"):
        rotary.rerotate(k, 0, np.arange(5), spec=SPEC, seq_axis=1)
    with pytest.raises(TypeError, match="from_positions and to_positions are required"):
        rotary.rerotate(k, None, 3, spec=SPEC, seq_axis=1)
    with pytest.raises(ValueError, match="to_spec.layout"):
        rotary.rerotate(k, 0, 3, spec=SPEC, to_spec=RopeSpec(32, layout="interleaved"), seq_axis=1)
    with pytest.raises(TypeError, match="to_spec must be a rotary.RopeSpec"):
        rotary.rerotate(k, 0, 3, spec=SPEC, to_spec="llama", seq_axis=1)
    with pytest.raises(ValueError, match="to_seq_len must be a positive int"):
        rotary.rerotate(k, 0, 3, spec=SPEC, to_seq_len=0, seq_axis=1)

