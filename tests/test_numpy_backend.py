"""NumPy backend fast path: bit-identical to the plain two-product formula it replaced (fp16 via
integer bit operations, fp32/fp64 via full-width products and a pair swap), special values included."""

import warnings

import numpy as np
import pytest

import rotary
from rotary.spec import tables as _tables
from rotary.backends import numpy as nb

# inputs near the fp16 limits overflow on purpose (the overflow test checks the warning with pytest.warns)
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning",
                                        "ignore:underflow encountered in cast:RuntimeWarning")


LAYOUTS = ["half", "interleaved"]


def frozen_rotate(x, cos_tok, sin_tok, rotary_dim, layout):
    """The algorithm before the fast path: work-dtype copies of the pair members, y_a = x_a c - x_b s,
    y_b = x_b c + x_a s (each product and sum rounded in the work dtype), one cast back on assignment."""
    work = cos_tok.dtype
    half = rotary_dim // 2
    sa, sb = (slice(0, half), slice(half, rotary_dim)) if layout == "half" else \
        (slice(0, rotary_dim, 2), slice(1, rotary_dim, 2))
    xa, xb = x[..., sa].astype(work), x[..., sb].astype(work)
    out = x.copy()
    with np.errstate(all="ignore"):
        out[..., sa] = xa * cos_tok - xb * sin_tok
        out[..., sb] = xb * cos_tok + xa * sin_tok
    return out


def tables(spec, positions, dtype, inverse=False):
    work = np.float64 if dtype == np.float64 else np.float32
    cos, sin, rows = _tables.lookup(spec, positions, dtype=work)
    return (cos, sin, rows), nb.gather_rows(np, cos, sin, rows, work, inverse)


def assert_same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    ia, ib = (np.ascontiguousarray(v).view(f"u{v.dtype.itemsize}") for v in (a, b))
    bad = np.flatnonzero(ia.ravel() != ib.ravel())
    assert bad.size == 0, f"{bad.size} elements differ, first at {bad[:5]}: {a.ravel()[bad[:5]]} vs {b.ravel()[bad[:5]]}"


def special_values(shape, dtype, rng):
    x = (rng.standard_normal(shape) * rng.choice([1e-6, 1e-3, 1.0, 1e3, 3e4], size=shape)).astype(dtype)
    flat = x.reshape(-1)
    if dtype == np.float16:
        picks = [0.0, -0.0, 6e-8, -6e-8, 2.0**-24, 2.0**-14, -(2.0**-14), 65504.0, -65504.0, 6.1e-5, 1e-7]
    else:
        picks = [0.0, -0.0, np.finfo(dtype).tiny, -np.finfo(dtype).tiny, np.finfo(dtype).max / 4]
    idx = rng.choice(flat.size, size=len(picks) * 3, replace=False)
    flat[idx] = np.tile(np.array(picks, dtype=dtype), 3)
    return x


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("block_bytes", [1 << 12, 1 << 20])
@pytest.mark.parametrize("shape,rotary_dim", [((2, 37, 5, 16), 16), ((3, 9, 4, 13), 8), ((1, 130, 3, 64), 32)])
def test_bit_identical_to_frozen_formula(dtype, layout, block_bytes, shape, rotary_dim, rng, monkeypatch):
    monkeypatch.setattr(nb, "BLOCK_BYTES", block_bytes)
    B, S, H, D = shape
    spec = rotary.RopeSpec(D, rotary_dim=rotary_dim, base=10000.0, layout=layout)
    positions = rng.integers(0, 50000, size=(B, S))
    x = special_values(shape, dtype, rng)
    k = special_values((B, S, 2, D), dtype, rng)
    for inverse in (False, True):
        (cos, sin, rows), (c, s) = tables(spec, positions, dtype, inverse)
        got = nb.rotate([(x, None), (k, None)], cos, sin, rows, rotary_dim=rotary_dim, layout=layout, inverse=inverse)
        assert_same_bits(got[0], frozen_rotate(x, c, s, rotary_dim, layout))
        assert_same_bits(got[1], frozen_rotate(k, c, s, rotary_dim, layout))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_float16_every_input_bit_pattern(layout, monkeypatch):
    """All 65536 fp16 bit patterns (NaNs, infinities, subnormals) as x_a and x_b of many angles."""
    monkeypatch.setattr(nb, "BLOCK_BYTES", 1 << 14)
    x = np.arange(1 << 16, dtype=np.uint16).view(np.float16).reshape(1, 4096, 1, 16)
    x = np.concatenate([x, x[:, ::-1]], axis=2)                       # (1, 4096, 2, 16)
    spec = rotary.RopeSpec(16, base=10.0, layout=layout)
    positions = np.arange(4096)[None] * 7
    (cos, sin, rows), (c, s) = tables(spec, positions, np.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        got = nb.rotate([(x, None)], cos, sin, rows, rotary_dim=16, layout=layout, inverse=False)[0]
    assert_same_bits(got, frozen_rotate(x, c, s, 16, layout))


def test_float16_output_stage_ties_and_subnormals(rng):
    """The fp32 -> fp16 rounding on its own: values on and next to fp16 rounding ties across every
    exponent from fp32 subnormals to 65504, both signs, zeros; equal to NumPy's cast bit for bit."""
    exps = np.arange(-40, 16)
    mant = rng.integers(0, 1 << 23, size=(exps.size, 64))
    mant[:, :16] = (rng.integers(0, 1 << 10, size=(exps.size, 16)) << 13) | (1 << 12)   # exact ties
    y = np.ldexp(1.0 + mant / 2.0**23, exps[:, None]).astype(np.float32).reshape(-1)
    y = y[np.abs(y) < 65504]
    y = np.concatenate([y, np.nextafter(y, np.float32(0)), np.nextafter(y, np.float32(1e9)),
                        np.array([0.0, 1e-45, 2.0**-24, 2.0**-25, 3 * 2.0**-26, 65504.0], np.float32)])
    y = np.concatenate([y, -y])
    p = y.copy()
    scratch = [np.empty_like(p), np.empty_like(p), np.full_like(p, 2.0**-14)]
    assert nb._f16_round_bits(p, *scratch)
    np.testing.assert_array_equal(p.view(np.uint32).astype(np.uint16), y.astype(np.float16).view(np.uint16))
    for bad in (65520.0, np.inf, np.nan):
        p = np.array([1.0, bad], np.float32)
        assert not nb._f16_round_bits(p, np.empty_like(p), np.empty_like(p), np.full_like(p, 2.0**-14))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_float16_overflow_warns_like_numpy_cast(layout):
    x = np.full((1, 3, 1, 8), 60000.0, dtype=np.float16)
    spec = rotary.RopeSpec(8, base=10.0, layout=layout)
    (cos, sin, rows), (c, s) = tables(spec, np.arange(3)[None] + 1, np.float16)
    with pytest.warns(RuntimeWarning, match="overflow"):
        got = nb.rotate([(x, None)], cos, sin, rows, rotary_dim=8, layout=layout, inverse=False)[0]
    assert_same_bits(got, frozen_rotate(x, c, s, 8, layout))
    assert np.isinf(got).any()


def test_float16_underflow_errstate_respected(rng):
    x = (rng.standard_normal((1, 8, 2, 16)) * 1e-6).astype(np.float16)
    with np.errstate(under="raise"):
        assert not nb._f16_bit_path_ok()
    spec = rotary.RopeSpec(16)
    (cos, sin, rows), (c, s) = tables(spec, np.arange(8)[None], np.float16)
    with np.errstate(under="warn"):
        got = nb.rotate([(x, None)], cos, sin, rows, rotary_dim=16, layout="half", inverse=False)[0]
    assert_same_bits(got, frozen_rotate(x, c, s, 16, "half"))


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_frontend_strides_inplace_gqa_bits(dtype, layout, rng, monkeypatch):
    """BHSD input, per-batch positions, GQA, out= and in place through apply_qk: same bits as the
    frozen formula on the canonical view; the inputs are untouched unless in place."""
    monkeypatch.setattr(nb, "BLOCK_BYTES", 1 << 13)
    spec = rotary.RopeSpec(64, rotary_dim=48, layout=layout, base=500000.0)
    q = rng.standard_normal((2, 4, 33, 64)).astype(dtype)             # (B, H, S, D)
    k = rng.standard_normal((2, 2, 33, 64)).astype(dtype)
    pos = rng.integers(0, 9000, size=(2, 33))
    q0, k0 = q.copy(), k.copy()
    qr, kr = rotary.apply_qk(q, k, pos, spec=spec, seq_axis=2, backend="numpy")
    np.testing.assert_array_equal(q, q0)
    np.testing.assert_array_equal(k, k0)
    _, (c, s) = tables(spec, pos, dtype)
    for got, x in ((qr, q0), (kr, k0)):
        ref = frozen_rotate(np.swapaxes(x, 1, 2), c, s, 48, layout)
        assert_same_bits(np.ascontiguousarray(np.swapaxes(got, 1, 2)), ref)
    rotary.apply_qk(q, k, pos, spec=spec, seq_axis=2, backend="numpy", out=(q, k))
    assert_same_bits(q, qr)
    assert_same_bits(k, kr)
