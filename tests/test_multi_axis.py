"""Multi-axis specs (M-RoPE, axial RoPE): pair assignment, angles, every entry point, bad input.

The conformance suite (rotary.conformance.cases, ``*mrope*`` / ``*axial*`` cases) runs every backend against
the float64 oracle; here: the spec's own contract, written out pair by pair from HF's code, and the
entry points the suite does not cover (softmax attention, cos_sin, tables, errors).
"""

import pickle

import numpy as np
import pytest

import rotary
from rotary import RopeSpec, testing
from rotary.conformance import cases as conformance

from .conftest import backend_params


# -- which pair reads which coordinate, written out from HF's recomposition code ------------------
def _hf_chunked(section):
    """Qwen2-VL: torch.cat([m[i % 3] for i, m in enumerate(freq.split(section))])."""
    out = []
    for i, n in enumerate(section):
        out += [i % 3] * n
    return out


def _hf_interleaved(section):
    """Qwen3-VL apply_interleaved_mrope: freqs_t = freqs[0]; freqs_t[..., offset:3*section[dim]:3] = freqs[dim]."""
    out = [0] * sum(section)
    for dim, offset in ((1, 1), (2, 2)):
        for i in range(offset, section[dim] * 3, 3):
            if i < len(out):   # a torch slice past the end stops at the end
                out[i] = dim
    return out


def _hf_ernie(section):
    """ERNIE-4.5-VL: the first s0 + s1 pairs stack (h, w) pairwise, the last s2 read t."""
    return [1, 2] * section[0] + [0] * section[2]


@pytest.mark.parametrize("section", [(16, 24, 24), (24, 20, 20), (8, 12, 12), (11, 11, 10)])
def test_mrope_pair_axes_follow_hf(section):
    half = sum(section)
    chunked = RopeSpec(2 * half, mrope_section=section)
    assert chunked.pair_axes().tolist() == _hf_chunked(section)
    assert chunked.mrope_section == tuple(section) and chunked.mrope_interleaved is False and chunked.n_axes == 3
    inter = RopeSpec(2 * half, mrope_section=section, mrope_interleaved=True)
    assert inter.pair_axes().tolist() == _hf_interleaved(section) and inter.mrope_interleaved is True
    if section[0] == section[1]:
        ernie = RopeSpec(2 * half, mrope_section=section, mrope_layout="ernie", layout="interleaved")
        assert ernie.pair_axes().tolist() == _hf_ernie(section)


def test_axial_frequencies_and_axes():
    d = 80
    spec = RopeSpec.axial(d, axes=2, base=10000.0)
    phi = 1.0 / 10000.0 ** (np.arange(0, d // 2, 2) / (d // 2))       # Qwen2-VL vision: dim = head_dim / 2
    np.testing.assert_array_equal(spec.inv_freq(), np.concatenate([phi, phi]))
    assert spec.pair_axes().tolist() == [0] * 20 + [1] * 20
    pix = RopeSpec.axial(d, axes=2, frequencies="strided")
    full = 1.0 / 10000.0 ** (np.arange(0, d, 2) / d)                   # Pixtral: h gets freqs[::2], w freqs[1::2]
    np.testing.assert_array_equal(pix.inv_freq(), np.concatenate([full[::2], full[1::2]]))
    wh = RopeSpec.axial(d, axes=2, axis_order=(1, 0))
    assert wh.pair_axes().tolist() == [1] * 20 + [0] * 20
    dino = RopeSpec.axial(64, axes=2, frequency_scale=2 * np.pi, float_positions=True, base=100.0)
    periods = 100.0 ** (2 * np.arange(16) / 32)                          # DINOv3: angle = 2 pi coord / period
    np.testing.assert_allclose(dino.inv_freq(), np.tile(2 * np.pi / periods, 2), rtol=1e-15)


def test_one_d_spec_reads_coordinate_zero():
    spec = RopeSpec(64)
    assert not spec.multi_axis and spec.n_axes == 1 and spec.pair_axes().tolist() == [0] * 32


def test_specs_are_values():
    a = RopeSpec(128, mrope_section=(16, 24, 24), base=1e6)
    assert a == RopeSpec(128, mrope_section=[16, 24, 24], base=1e6) and hash(a) == hash(RopeSpec(128, mrope_section=(16, 24, 24), base=1e6))
    assert a != a.replace(mrope_interleaved=True) and a != RopeSpec(128, base=1e6)
    assert pickle.loads(pickle.dumps(a)) == a
    assert a.replace(layout="interleaved").mrope_section == (16, 24, 24)
    v = RopeSpec.axial(64, axes=2, float_positions=True)
    assert pickle.loads(pickle.dumps(v)) == v and eval(repr(a), {"RopeSpec": RopeSpec}) == a
    assert "mrope_section=(16, 24, 24)" in repr(a) and "... 32 values" in repr(v)


# -- angles and cos/sin ----------------------------------------------------------------------------
def test_cos_sin_multi_axis_shape_and_values(rng):
    spec = RopeSpec(128, mrope_section=(16, 24, 24), base=1e6)
    pos = rng.integers(0, 5000, size=(2, 7, 3))
    cos, sin = spec.cos_sin(pos, dtype=np.float64)
    assert cos.shape == (2, 7, 64)
    axes = spec.pair_axes()
    for i in range(64):
        np.testing.assert_allclose(cos[..., i], np.cos(pos[..., axes[i]] * spec.inv_freq()[i]), atol=2e-12)
        np.testing.assert_allclose(sin[..., i], np.sin(pos[..., axes[i]] * spec.inv_freq()[i]), atol=2e-12)


def test_text_positions_equal_a_1d_spec(rng):
    """M-RoPE with the same position on every axis is the 1-D rotation (text tokens), every backend."""
    spec = RopeSpec(64, mrope_section=(8, 12, 12), mrope_interleaved=True)
    x = rng.standard_normal((2, 9, 3, 64)).astype(np.float32)
    one_d = rotary.apply(x, 5, spec=RopeSpec(64), seq_axis=-3, backend="numpy")
    for backend in ("numpy", "numba"):
        a = rotary.apply(x, 5, spec=spec, seq_axis=-3, backend=backend)
        b = rotary.apply(x, np.repeat((np.arange(9) + 5)[:, None], 3, axis=1), spec=spec, seq_axis=-3, backend=backend)
        np.testing.assert_array_equal(a, one_d)
        np.testing.assert_array_equal(b, one_d)


def test_large_coordinates_take_the_direct_path(rng):
    """Coordinates past the dense table (and negative ones) are computed directly, still exact."""
    spec = RopeSpec(32, mrope_section=(6, 5, 5))
    pos = np.stack([rng.integers(-10, 10, 6), rng.integers(0, 10, 6), rng.integers(2**30, 2**31, 6)], -1)
    x = rng.standard_normal((6, 32))
    ref = testing.rope_complex(x, pos, spec.inv_freq(), pair_axes=spec.pair_axes())
    for backend in ("numpy", "numba"):
        testing.assert_close(rotary.apply(x, pos, spec=spec, backend=backend, seq_axis=-2), ref, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("backend", backend_params())
def test_inverse_undoes_multi_axis(backend, rng):
    to_backend, to_host = conformance.array_converters(backend)
    to_backend = to_backend or (lambda a: a)
    spec = RopeSpec.axial(48, axes=3, layout="interleaved")
    x = rng.standard_normal((2, 27, 4, 48))
    grid = np.stack(np.meshgrid(np.arange(3), np.arange(3), np.arange(3), indexing="ij"), -1).reshape(-1, 3)
    y = rotary.apply(to_backend(x), grid, spec=spec, seq_axis=-3, backend=backend)
    back = rotary.apply(y, grid, spec=spec, seq_axis=-3, inverse=True, backend=backend)
    np.testing.assert_allclose(rotary.spec.validators.to_numpy(back), x, atol=1e-12)


def test_relative_position_property_per_axis(rng):
    """<R(p) q, R(p') k> depends on p' - p only, axis by axis (the reason axial RoPE exists)."""
    spec = RopeSpec.axial(32, axes=2)
    q, k = rng.standard_normal((2, 32))
    shift = np.array([7, -3])
    p, pk = np.array([[2, 5]]), np.array([[9, 1]])
    dot = lambda a, b: float((rotary.apply(q[None], a, spec=spec, seq_axis=-2) @ rotary.apply(k[None], b, spec=spec, seq_axis=-2).T)[0, 0])
    np.testing.assert_allclose(dot(p, pk), dot(p + shift, pk + shift), rtol=1e-12)


# -- attention ------------------------------------------------------------------------------------
def test_softmax_attention_with_mrope(rng):
    spec = RopeSpec(16, mrope_section=(4, 2, 2))
    q = rng.standard_normal((1, 2, 10, 16))
    k, v = rng.standard_normal((2, 1, 2, 10, 16))
    pos = rng.integers(0, 30, size=(1, 10, 3))
    o = rotary.attention(q, k, v, pos, causal=True, spec=spec, seq_axis=-2)
    axes = spec.pair_axes()
    qr = testing.rope_complex(q, pos[:, None], spec.inv_freq(), pair_axes=axes)
    kr = testing.rope_complex(k, pos[:, None], spec.inv_freq(), pair_axes=axes)
    s = qr @ np.swapaxes(kr, -1, -2) / 4.0
    s = np.where(np.tril(np.ones((10, 10), bool)), s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    np.testing.assert_allclose(o, (w / w.sum(-1, keepdims=True)) @ v, atol=1e-12)


def test_linear_attention_state_continues_mrope(rng):
    """A state after multi-axis tokens continues with M-RoPE's decode rule (max coordinate + 1, all axes)."""
    spec = RopeSpec(12, mrope_section=(2, 2, 2))
    q, k, v = rng.standard_normal((3, 1, 2, 6, 12))
    pos = np.array([[[0, 0, 0], [1, 1, 1], [2, 2, 2], [2, 2, 3], [2, 3, 2], [2, 3, 3]]])
    _, state = rotary.linear_attention(q, k, v, pos, causal=True, spec=spec, return_state=True, seq_axis=-2)
    assert state.next_position == 4
    o = rotary.linear_attention(q[:, :, :1], k[:, :, :1], v[:, :, :1], spec=spec, state=state, causal=True, seq_axis=-2)
    full_pos = np.concatenate([pos, [[[4, 4, 4]]]], axis=1)
    qq, kk, vv = (np.concatenate([a, a[:, :, :1]], axis=2) for a in (q, k, v))
    ref = testing.linear_attention_quadratic(qq, kk, vv, full_pos[:, None], spec.inv_freq(), causal=True,
                                             pair_axes=spec.pair_axes())
    np.testing.assert_allclose(o, ref[:, :, -1:], atol=1e-12)


# -- a multi-axis check can fail ---------------------------------------------------------------------
def test_wrong_axis_assignment_fails_the_conformance_check(monkeypatch):
    """Rotating every pair by the first coordinate (a 1-D rotation) is caught by the multi-axis cases."""
    from rotary.spec import tables as _tables

    original = _tables._axis_columns
    monkeypatch.setattr(_tables, "_axis_columns", lambda pair_axes: original((0,) * len(pair_axes)))
    _tables.clear_cache()
    try:
        case = next(c for c in conformance.cases() if c.name == "mrope-batch")
        result = conformance.run_case(case, "numpy")
    finally:
        _tables.clear_cache()   # drop the tables gathered with the wrong assignment
    assert not result.passed and result.max_error > 1e-2


# -- bad input ---------------------------------------------------------------------------------------
def test_bad_specs():
    with pytest.raises(ValueError, match=r"mrope_section .* must sum to rotary_dim/2 = 64, got 60"):
        RopeSpec(128, mrope_section=(16, 24, 20))
    with pytest.raises(ValueError, match="mrope_section must be 3"):
        RopeSpec(128, mrope_section=(32, 32))
    with pytest.raises(TypeError, match=r"mrope_section\[1\] must be an integer"):
        RopeSpec(128, mrope_section=(16, 24.5, 24))
    with pytest.raises(ValueError, match="mrope_layout must be one of"):
        RopeSpec(128, mrope_section=(16, 24, 24), mrope_layout="diagonal")
    with pytest.raises(ValueError, match="need mrope_section"):
        RopeSpec(128, mrope_interleaved=True)
    with pytest.raises(ValueError, match="pair_axes must have rotary_dim/2 = 32 entries"):
        RopeSpec(64, pair_axes=(0, 1))
    with pytest.raises(ValueError, match="frequencies must be a 1-D sequence of rotary_dim/2 = 4"):
        RopeSpec(8, frequencies=[1.0, 2.0])
    with pytest.raises(ValueError, match="rotary_dim must be a positive multiple of 2\\*axes = 4"):
        RopeSpec.axial(18, axes=2, rotary_dim=18)
    with pytest.raises(ValueError, match="axis_order must be a permutation"):
        RopeSpec.axial(16, axes=2, axis_order=(0, 0))


def test_bad_positions():
    mrope = RopeSpec(16, mrope_section=(4, 2, 2))
    x = np.zeros((2, 5, 16), np.float32)
    with pytest.raises(ValueError, match=r"positions of shape \(5, 2\) must carry the spec's 3 coordinates"):
        rotary.apply(x, np.zeros((5, 2), np.int64), spec=mrope, seq_axis=-2)
    with pytest.raises(ValueError, match=r"np.moveaxis\(position_ids, 0, -1\)"):
        rotary.apply(x, np.zeros((3, 2, 5), np.int64), spec=mrope, seq_axis=-2)
    with pytest.raises(TypeError, match="float_positions=True"):
        rotary.apply(x, np.zeros((5, 3)), spec=mrope, seq_axis=-2)
    with pytest.raises(ValueError, match="this spec is 1-D"):
        rotary.apply(x, np.zeros((5, 3), np.int64), spec=RopeSpec(16), seq_axis=-2)
    axial = RopeSpec.axial(16, axes=2)
    with pytest.raises(ValueError, match="only M-RoPE specs take None or an offset"):
        rotary.apply(x, None, spec=axial, seq_axis=-2)
    with pytest.raises(ValueError, match="must be finite"):
        rotary.apply(x, np.full((5, 2), np.nan), spec=RopeSpec.axial(16, axes=2, float_positions=True), seq_axis=-2)
    with pytest.raises(ValueError, match=r"\(batch, seq, n_axes\) = \(2, 5, 3\)"):
        rotary.apply(x, np.zeros((3, 5, 3), np.int64), spec=mrope, seq_axis=-2)
    with pytest.raises(ValueError, match=r"trailing axis"):
        mrope.cos_sin(np.zeros((4,), np.int64))
