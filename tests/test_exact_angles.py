"""Exact angles: float64 rotations against mpmath (40 digits, the spec's float64 inv_freq taken as exact)
at positions up to 2**53 - 1, on every backend; the test oracle's own accuracy; float32 unchanged."""

from __future__ import annotations

import math

import mpmath
import numpy as np
import pytest

import rotary
from rotary.spec import angles as _angles
from rotary.testing import phase

from .conftest import backend_params

mpmath.mp.dps = 40
EPS = 2.0**-52
TWO_PI = 2 * mpmath.pi

BIG = [2**53 - 1, 2**53 - 2, 2**52 + 12345, 2**40 + 3, 2**31 - 1, 2**26, 2**26 - 1, 4510, 1, 0, -7, -(2**53 - 1)]
SPECS = {
    "llama": rotary.RopeSpec(64, base=500000.0),
    "interleaved-partial": rotary.RopeSpec(40, rotary_dim=24, layout="interleaved"),
    "yarn": rotary.RopeSpec(32, scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}),
}
with pytest.warns(UserWarning, match="< 1 for rope_type 'linear'"):
    SPECS["linear-below-1"] = rotary.RopeSpec(16, scaling={"rope_type": "linear", "factor": 0.5})


def _positions(rng, n=12):
    return np.array(BIG + [int(v) for v in rng.integers(-(2**53) + 1, 2**53, n)], dtype=np.int64)


def _mp_angle(p, w):
    """(p * w) mod 2 pi in [-pi, pi], exactly (40 digits), p and w taken as exact."""
    theta = mpmath.mpf(p) * mpmath.mpf(float(w))
    return theta - TWO_PI * mpmath.nint(theta / TWO_PI)


def _mp_rotate(x, positions, spec):
    """Exact rotation of float64 x (S, D) at positions (S,) in mpmath, rounded to float64 once."""
    w = spec.inv_freq()
    a, b = spec.pair_indices()
    y = np.array(x, dtype=np.float64)
    scale = mpmath.mpf(spec.attention_scaling)
    for t, p in enumerate(positions):
        for i in range(len(w)):
            th = _mp_angle(int(p), w[i])
            c, s = mpmath.cos(th) * scale, mpmath.sin(th) * scale
            xa, xb = mpmath.mpf(float(x[t, a[i]])), mpmath.mpf(float(x[t, b[i]]))
            y[t, a[i]], y[t, b[i]] = float(xa * c - xb * s), float(xb * c + xa * s)
    return y


@pytest.mark.parametrize("name", list(SPECS))
def test_angles_match_mpmath_up_to_2_53(name, rng):
    spec = SPECS[name]
    pos = _positions(rng)
    got = spec.angles(pos)
    w = spec.inv_freq()
    err = max(abs(float(mpmath.mpf(float(got[t, i])) - _mp_angle(int(p), w[i])))
              for t, p in enumerate(pos) for i in range(len(w)))
    assert err <= 3.0e-16, f"angle error {err:.3g} rad (one ulp of pi is 4.4e-16)"
    assert np.all(np.abs(got) <= math.pi)


def test_float_coordinates_match_mpmath(rng):
    """Real-valued coordinates (float_positions specs), with frequencies up to 2 pi (DINOv3-style)."""
    spec = rotary.RopeSpec.axial(16, axes=2, frequency_scale=2 * math.pi, float_positions=True)
    coords = np.concatenate([rng.uniform(-1, 1, (6, 2)), rng.uniform(-2.0**40, 2.0**40, (6, 2))])
    got = spec.angles(coords)
    w, axes = spec.inv_freq(), spec.pair_axes()
    err = max(abs(float(mpmath.mpf(float(got[t, i])) - _mp_angle(mpmath.mpf(float(coords[t, axes[i]])), w[i])))
              for t in range(len(coords)) for i in range(len(w)))
    assert err <= 3.0e-16


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("name", ["llama", "interleaved-partial", "yarn"])
def test_float64_rotation_exact_on_every_backend(backend, name, rng):
    """|y - exact| <= 4 ulp of the pair's norm, per pair, at positions up to 2**53 - 1."""
    spec = SPECS[name]
    pos = _positions(rng, 4)
    x = rng.standard_normal((1, len(pos), 2, spec.head_dim))
    y = rotary.apply(x, pos[None], spec=spec, seq_axis=1, backend=backend)
    _assert_exact(y, x, pos, spec)


def _assert_exact(y, x, pos, spec):
    a, b = spec.pair_indices()
    for h in range(x.shape[2]):
        xh, yh = x[0, :, h], np.asarray(y[0, :, h])
        want = _mp_rotate(xh, pos, spec)
        norm = np.hypot(xh[:, a], xh[:, b]) * spec.attention_scaling
        err = np.maximum(np.abs(yh[:, a] - want[:, a]), np.abs(yh[:, b] - want[:, b]))
        assert np.all(err <= 4 * EPS * norm), f"max error {np.max(err / norm) / EPS:.2f} ulp of |x|"
        np.testing.assert_array_equal(yh[:, spec.rotary_dim:], xh[:, spec.rotary_dim:])


def test_oracle_phase_is_exact(rng):
    """The tests' own oracle (rotary.testing.phase) against mpmath: a few ulp at any position."""
    w = SPECS["llama"].inv_freq()
    pos = _positions(rng, 8)
    z = phase(pos, w)
    for t, p in enumerate(pos):
        for i in range(0, len(w), 3):
            th = _mp_angle(int(p), w[i])
            assert abs(z[t, i] - complex(mpmath.cos(th), mpmath.sin(th))) <= 4 * EPS


def test_float32_tables_unchanged_or_better(rng):
    """float32 tables: the cos/sin of the exact angle, rounded once (never worse than a float32 ulp)."""
    spec = SPECS["llama"]
    for pos in (np.arange(0, 70000, 7), np.array([2**31 - 1, 2**31 - 2, 2**40 + 1, 2**53 - 1])):
        cos32, sin32 = spec.cos_sin(pos, dtype=np.float32)
        z = phase(pos, spec.inv_freq())
        assert np.max(np.abs(cos32 - z.real)) <= 6.0e-8 and np.max(np.abs(sin32 - z.imag)) <= 6.0e-8


def test_exact_angle_building_blocks():
    """turns(w) holds w / (2 pi) to double-double accuracy; the reduction is odd and 2 pi periodic."""
    w = np.array([1.0, 0.1, 1e-6, 2 * math.pi, 3.0])
    vh, vl = _angles.turns(w)[:2]
    for i, wi in enumerate(w):
        exact = mpmath.mpf(float(wi)) / TWO_PI
        assert abs((mpmath.mpf(float(vh[i])) + mpmath.mpf(float(vl[i])) - exact) / exact) < 2.0**-104
    p = np.array([3, 10**9, 2**50 + 1])
    np.testing.assert_array_equal(_angles.reduced_angles(-p[:, None], _angles.turns(w)),
                                  -_angles.reduced_angles(p[:, None], _angles.turns(w)))
