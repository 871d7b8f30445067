"""apply / apply_qk against three independent float64 oracles, properties, array types, precision."""

import threading

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import rotary
from rotary import testing as T

from .conftest import backend_params

LAYOUTS = ["half", "interleaved"]


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("oracle", [T.rope_2x2, T.rope_matrix, T.rope_complex], ids=["2x2", "matrix", "complex"])
def test_three_oracles_float64(oracle, layout, backend, rng):
    spec = rotary.RopeSpec(12, rotary_dim=10, base=500.0, layout=layout)
    x = rng.standard_normal((3, 7, 12))
    pos = np.array([0, 1, 2, 5, 100, 4095, 70000])
    y = rotary.apply(x, pos, spec=spec, backend=backend, seq_axis=-2)
    # float64 angles p*w carry a rounding of about p * 2**-53 rad (1e-11 at p = 70000), on both sides
    T.assert_close(y, oracle(x, pos, spec.inv_freq(), layout=layout), like=x, atol=1e-10)


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("layout", LAYOUTS)
def test_float32_against_oracle_and_dtype_kept(layout, backend, rng):
    x = rng.standard_normal((2, 33, 4, 64)).astype(np.float32)
    y = rotary.apply(x, 1000, seq_axis=-3, layout=layout, backend=backend)
    pos = np.arange(33) + 1000
    spec = rotary.RopeSpec(64, layout=layout)
    ref = T.rope_complex(np.moveaxis(x, 1, 2).astype(np.float64), pos, spec.inv_freq(), layout=layout)
    T.assert_close(y, np.moveaxis(ref, 2, 1), like=x)


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("shape,per_batch", [((40, 2, 32, 128), True), ((40, 2, 32, 128), False),
                                             ((3, 50, 32, 128), True), ((2, 70, 32, 130), False)])
@pytest.mark.parametrize("inplace", [False, True])
def test_many_blocks_decode_and_prefill(shape, per_batch, inplace, backend, rng):
    """Inputs larger than one work block (the NumPy path works in 256 KiB blocks): batches of short
    sequences (decode), long sequences, per-batch and shared positions, a head dim past rotary_dim."""
    B, S, H, D = shape
    x = rng.standard_normal(shape).astype(np.float32)
    spec = rotary.RopeSpec(D, rotary_dim=128, base=500000.0)
    pos = rng.integers(0, 100000, size=(B, S)) if per_batch else 77
    original = x.copy()
    y = rotary.apply(x, pos, spec=spec, seq_axis=1, out=x if inplace else None, backend=backend)
    p = pos[:, None, :] if per_batch else 77 + np.arange(S)
    ref = T.rope_complex(np.moveaxis(original, 1, 2).astype(np.float64), p, spec.inv_freq())
    T.assert_close(y, np.moveaxis(ref, 2, 1), like=x)
    assert (y is x) == inplace
    if not inplace:
        np.testing.assert_array_equal(x, original)


def _exact_rotation(x, position, inv_freq, layout):
    """mpmath: angle p * w with w taken exactly as the float64 value, cos/sin to 30 digits."""
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 40
    y = np.array(x, dtype=np.float64)
    a, b = (np.arange(len(inv_freq)), np.arange(len(inv_freq)) + len(inv_freq)) if layout == "half" else \
        (2 * np.arange(len(inv_freq)), 2 * np.arange(len(inv_freq)) + 1)
    for i, w in enumerate(inv_freq):
        t = mpmath.mpf(int(position)) * mpmath.mpf(float(w))
        c, s = float(mpmath.cos(t)), float(mpmath.sin(t))
        y[..., a[i]] = x[..., a[i]] * c - x[..., b[i]] * s
        y[..., b[i]] = x[..., b[i]] * c + x[..., a[i]] * s
    return y


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("base", [1e4, 5e5, 1e6])
def test_fp32_exact_at_position_2_31_minus_1(base, backend, rng):
    """Goal: fp32 output within 2e-6 * |x| of the exact rotation at position 2**31 - 1."""
    spec = rotary.RopeSpec(128, base=base)
    x = rng.standard_normal((1, 128)).astype(np.float32)
    p = 2**31 - 1
    y = rotary.apply(x, p, spec=spec, backend=backend, seq_axis=-2)
    exact = _exact_rotation(x.astype(np.float64), p, spec.inv_freq(), "half")
    err = np.abs(y.astype(np.float64) - exact).max() / np.abs(x).max()
    assert err < 2e-6
    # an HF-style fp32 angle is far off at this position, so the test can tell the difference
    theta32 = (np.float32(p) * spec.inv_freq().astype(np.float32)).astype(np.float64)
    assert np.abs(theta32 - p * spec.inv_freq()).max() > 1.0


# -- properties (hypothesis) ---------------------------------------------------------------------
dims = st.sampled_from([(2, 2), (8, 8), (10, 6), (17, 16), (64, 64)])
positions = st.integers(min_value=0, max_value=2**31 - 1)


@settings(max_examples=40, deadline=None)
@given(dims=dims, p=positions, layout=st.sampled_from(LAYOUTS), seed=st.integers(0, 2**16))
def test_norm_preserved_per_pair(dims, p, layout, seed):
    d, r = dims
    x = np.random.default_rng(seed).standard_normal((1, d))
    y = rotary.apply(x, p, rotary_dim=r, layout=layout, backend="numpy", seq_axis=-2)
    a, b = rotary.RopeSpec(d, rotary_dim=r, layout=layout).pair_indices()
    np.testing.assert_allclose(np.hypot(y[0, a], y[0, b]), np.hypot(x[0, a], x[0, b]), rtol=1e-12)
    np.testing.assert_array_equal(y[0, r:], x[0, r:])


@settings(max_examples=40, deadline=None)
@given(dims=dims, m=st.integers(0, 10**6), n=st.integers(0, 10**6), layout=st.sampled_from(LAYOUTS),
       seed=st.integers(0, 2**16))
def test_inner_product_depends_on_offset_only(dims, m, n, layout, seed):
    d, r = dims
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((2, 1, d))
    lhs = rotary.apply(q, m, rotary_dim=r, layout=layout, seq_axis=-2) @ rotary.apply(k, n, rotary_dim=r, layout=layout, seq_axis=-2)[0]
    rhs = q @ rotary.apply(k, n - m, rotary_dim=r, layout=layout, seq_axis=-2)[0] if n >= m else \
        rotary.apply(q, m - n, rotary_dim=r, layout=layout, seq_axis=-2) @ k[0]
    np.testing.assert_allclose(lhs, rhs, rtol=1e-9, atol=1e-9)


@settings(max_examples=40, deadline=None)
@given(dims=dims, p=positions, layout=st.sampled_from(LAYOUTS), seed=st.integers(0, 2**16))
def test_inverse_undoes_rotation_and_position_zero_is_identity(dims, p, layout, seed):
    d, r = dims
    x = np.random.default_rng(seed).standard_normal((3, d))
    pos = np.array([p, 0, p // 2])
    y = rotary.apply(x, pos, rotary_dim=r, layout=layout, seq_axis=-2)
    np.testing.assert_allclose(rotary.apply(y, pos, rotary_dim=r, layout=layout, inverse=True, seq_axis=-2), x, atol=1e-12)
    np.testing.assert_array_equal(y[1], x[1])


@settings(max_examples=30, deadline=None)
@given(dims=dims, p=positions, seed=st.integers(0, 2**16))
def test_interleaved_equals_permuted_half(dims, p, seed):
    d, r = dims
    x = np.random.default_rng(seed).standard_normal((2, d))
    y_int = rotary.apply(x, p, rotary_dim=r, layout="interleaved", seq_axis=-2)
    to_half = rotary.convert_layout(x, to="half", rotary_dim=r)
    y_half = rotary.apply(to_half, p, rotary_dim=r, layout="half", seq_axis=-2)
    np.testing.assert_allclose(rotary.convert_layout(y_int, to="half", rotary_dim=r), y_half, atol=1e-12)
    np.testing.assert_allclose(rotary.convert_layout(y_half, to="interleaved", rotary_dim=r), y_int, atol=1e-12)


# -- positions, axes, out --------------------------------------------------------------------------
def test_positions_forms_agree(rng):
    x = rng.standard_normal((2, 3, 5, 8))        # (B, H, S, D)
    base = rotary.apply(x, np.arange(5) + 3, seq_axis=-2)
    np.testing.assert_array_equal(rotary.apply(x, 3, seq_axis=-2), base)
    np.testing.assert_array_equal(rotary.apply(x, np.int32(3), seq_axis=-2), base)
    np.testing.assert_array_equal(rotary.apply(x, np.tile(np.arange(5) + 3, (2, 1)), seq_axis=-2), base)
    np.testing.assert_array_equal(rotary.apply(x, np.arange(5, dtype=np.uint16) + 3, seq_axis=-2), base)


def test_batch_positions_apply_per_batch_row(rng):
    x = rng.standard_normal((2, 3, 5, 8))        # BHSD, positions (B, S) broadcast over heads
    pos = np.array([[0, 1, 2, 3, 4], [10, 11, 12, 13, 14]])
    y = rotary.apply(x, pos, seq_axis=-2)
    np.testing.assert_array_equal(y[0], rotary.apply(x[0], pos[0], seq_axis=-2))
    np.testing.assert_array_equal(y[1], rotary.apply(x[1], pos[1], seq_axis=-2))


def test_bshd_equals_bhsd(rng):
    x = rng.standard_normal((2, 5, 3, 8)).astype(np.float32)
    y1 = rotary.apply(x, 7, seq_axis=-3)
    y2 = rotary.apply(np.swapaxes(x, 1, 2), 7, seq_axis=-2)
    np.testing.assert_array_equal(y1, np.swapaxes(y2, 1, 2))


@pytest.mark.parametrize("backend", backend_params())
def test_out_in_place_and_separate(backend, rng):
    x = rng.standard_normal((2, 6, 3, 16)).astype(np.float32)
    ref = rotary.apply(x, 5, seq_axis=-3, backend=backend)
    buf = np.empty_like(x)
    r = rotary.apply(x, 5, seq_axis=-3, out=buf, backend=backend)
    assert r is buf
    np.testing.assert_array_equal(buf, ref)
    x2 = x.copy()
    r = rotary.apply(x2, 5, seq_axis=-3, out=x2, backend=backend)
    assert r is x2
    np.testing.assert_array_equal(x2, ref)


def test_out_on_non_mergeable_view(rng):
    """A view whose strides cannot merge is still written correctly (through a copy)."""
    base = rng.standard_normal((4, 3, 5, 8))
    x = base[:, ::2].transpose(1, 0, 2, 3)   # (2, 4, 5, 8) with odd strides
    out = np.zeros((2, 4, 5, 8))
    rotary.apply(x, 3, out=out, seq_axis=-2)
    np.testing.assert_allclose(out, rotary.apply(np.ascontiguousarray(x), 3, seq_axis=-2))
    y = x.copy()
    view = np.empty((4, 2, 5, 8))[:, ::1].transpose(1, 0, 2, 3)
    view[...] = y
    rotary.apply(view, 3, out=view, seq_axis=-2)
    np.testing.assert_allclose(view, rotary.apply(y, 3, seq_axis=-2))


def test_input_never_modified(rng):
    q = rng.standard_normal((2, 5, 4, 8)).astype(np.float32)
    k = rng.standard_normal((2, 5, 2, 8)).astype(np.float32)
    q0, k0 = q.copy(), k.copy()
    rotary.apply_qk(q, k, 11, seq_axis=-3)
    np.testing.assert_array_equal(q, q0)
    np.testing.assert_array_equal(k, k0)


def test_readonly_and_broadcast_inputs_work(rng):
    x = np.broadcast_to(rng.standard_normal((1, 6, 8)), (3, 6, 8))
    y = rotary.apply(x, 2, seq_axis=-2)
    np.testing.assert_allclose(y[0], y[2])


def test_apply_qk_matches_two_applies(rng):
    q = rng.standard_normal((2, 7, 8, 32)).astype(np.float32)
    k = rng.standard_normal((2, 7, 2, 32)).astype(np.float32)
    pos = rng.integers(0, 5000, size=(2, 7))
    qr, kr = rotary.apply_qk(q, k, pos, seq_axis=-3, base=5e5)
    np.testing.assert_array_equal(qr, rotary.apply(q, pos, seq_axis=-3, base=5e5))
    np.testing.assert_array_equal(kr, rotary.apply(k, pos, seq_axis=-3, base=5e5))


# -- other array types -----------------------------------------------------------------------------
def test_array_api_strict_roundtrip(rng):
    xps = pytest.importorskip("array_api_strict")
    x = rng.standard_normal((2, 5, 8)).astype(np.float32)
    y = rotary.apply(xps.asarray(x), 4, layout="interleaved", seq_axis=-2)
    assert type(y) is type(xps.asarray(x)) and y.dtype == xps.float32
    np.testing.assert_allclose(np.asarray(y), rotary.apply(x, 4, layout="interleaved", seq_axis=-2), rtol=1e-6, atol=1e-6)


def test_array_api_strict_other_device(rng):
    xps = pytest.importorskip("array_api_strict")
    dev = xps.Device("device1")
    x = xps.asarray(rng.standard_normal((5, 8)).astype(np.float32), device=dev)
    y = rotary.apply(x, 4, seq_axis=-2)
    assert y.device == dev


def test_torch_roundtrip_and_bf16(rng):
    torch = pytest.importorskip("torch")
    x = rng.standard_normal((2, 5, 3, 16)).astype(np.float32)
    y = rotary.apply(torch.from_numpy(x), 9, seq_axis=-3)
    assert isinstance(y, torch.Tensor) and y.dtype == torch.float32
    np.testing.assert_allclose(y.numpy(), rotary.apply(x, 9, seq_axis=-3), rtol=1e-6, atol=1e-6)
    yb = rotary.apply(torch.from_numpy(x).bfloat16(), 9, seq_axis=-3)
    assert yb.dtype == torch.bfloat16
    ref = T.rope_complex(np.moveaxis(torch.from_numpy(x).bfloat16().double().numpy(), 1, 2), np.arange(5) + 9,
                         rotary.RopeSpec(16).inv_freq())
    T.assert_close(yb, np.moveaxis(ref, 2, 1))
    out = torch.empty_like(torch.from_numpy(x))
    r = rotary.apply(torch.from_numpy(x), 9, seq_axis=-3, out=out)
    assert r is out


def test_jax_roundtrip(rng):
    jnp = pytest.importorskip("jax.numpy")
    x = rng.standard_normal((5, 8)).astype(np.float32)
    y = rotary.apply(jnp.asarray(x), 4, seq_axis=-2)
    np.testing.assert_allclose(np.asarray(y), rotary.apply(x, 4, seq_axis=-2), rtol=1e-6, atol=1e-6)
    with pytest.raises(TypeError, match="JAX"):
        rotary.apply(jnp.asarray(x), 4, out=jnp.asarray(x), seq_axis=-2)


# -- tables ----------------------------------------------------------------------------------------
def test_tables_grow_and_never_share_between_specs(rng):
    rotary.clear_cache()
    x = rng.standard_normal((3, 8))
    a = rotary.apply(x, 10, base=100.0, seq_axis=-2)
    b = rotary.apply(x, 10, base=1000.0, seq_axis=-2)
    assert not np.allclose(a, b)
    big = rotary.apply(x, 100_000, base=100.0, seq_axis=-2)         # grows the dense table
    np.testing.assert_allclose(big, T.rope_complex(x, np.arange(3) + 100_000, rotary.RopeSpec(8, base=100.0).inv_freq()),
                               atol=1e-12)
    np.testing.assert_array_equal(rotary.apply(x, 10, base=100.0, seq_axis=-2), a)
    neg = rotary.apply(x, -5, base=100.0, seq_axis=-2)              # negative positions: compact table
    np.testing.assert_allclose(neg, T.rope_complex(x, np.arange(3) - 5, rotary.RopeSpec(8, base=100.0).inv_freq()),
                               atol=1e-12)


def test_tables_thread_safe(rng):
    rotary.clear_cache()
    x = rng.standard_normal((4, 16)).astype(np.float32)
    errors = []

    def work(i):
        try:
            for j in range(30):
                p = (i * 1000 + j * 997) % 300_000
                y = rotary.apply(x, p, base=1e4 + (i % 3), seq_axis=-2)
                ref = T.rope_complex(x, np.arange(4) + p, rotary.RopeSpec(16, base=1e4 + (i % 3)).inv_freq())
                T.assert_close(y, ref)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
