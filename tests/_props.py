"""Shared pieces of the property-based suite (tests/test_properties*.py, issue 25): hypothesis budgets,
strategies for valid calls, and independent float64 oracles written here.

The oracles use neither the library's tables nor its views nor its backends: angles are
``coordinate * frequency`` reduced modulo 2 pi exactly (Python fractions against a 60-digit pi when the
product is large, else the float64 product, off by < 2**-43 rad), rotations are explicit 2x2 rotations
of each pair, softmax attention is the quadratic masked softmax over the visible keys only, linear
attention the quadratic sum over the visible tokens only. The frequencies themselves come from
``spec.inv_freq()`` (the length-extension rules are checked against HF elsewhere); plain specs also have
them checked against ``base**(-2i/d)`` here.

Budgets: ``examples(n)`` is n examples in the default ``ci`` profile (bounded, derandomized: CI is
reproducible) and 20 n in ``thorough`` (``HYPOTHESIS_PROFILE=thorough pytest tests/test_properties*.py``).
"""

from __future__ import annotations

import os
from fractions import Fraction

import numpy as np
from hypothesis import settings, strategies as st

import rotary

PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
_SCALE = 20 if PROFILE == "thorough" else 1

#: pi to 60 digits (the float64 pi would be off by 1.2e-16: 0.3 rad of error at 2**53 turns)
_PI = Fraction("3.141592653589793238462643383279502884197169399375105820974944")
_TWO_PI = 2 * _PI

BACKENDS = ["numpy"] + (["numba"] if rotary.available_backends()["numba"][0] else [])
TOL = {"float64": 1e-10, "float32": 2e-5, "float16": 3e-3, "bfloat16": 3e-2}


def examples(n: int):
    """hypothesis settings for a property: n examples (ci) or 20 n (thorough), other settings from the
    loaded profile (tests/conftest.py)."""
    return settings(max_examples=n * _SCALE)


# -- exact angles and rotations ------------------------------------------------------------------------
def exact_angles(coords, freqs) -> np.ndarray:
    """``coords[..., None] * freqs`` reduced to [-pi, pi]: float64 coordinates (ints or reals) times float64
    frequencies, the product and its reduction exact (fractions) where |c w| > 2**10."""
    c = np.asarray(coords)
    w = np.asarray(freqs, np.float64)
    plain = c.astype(np.float64)[..., None] * w
    if plain.size == 0 or np.max(np.abs(plain)) <= 2.0**10:
        return plain - 2 * np.pi * np.rint(plain / (2 * np.pi))
    out = np.empty(plain.shape)
    wf = [Fraction(float(x)) for x in w]
    for idx in np.ndindex(c.shape):
        v = c[idx]
        cf = Fraction(int(v)) if c.dtype.kind in "iu" else Fraction(float(v))
        for j, wj in enumerate(wf):
            t = cf * wj
            out[idx + (j,)] = float(t - _TWO_PI * round(t / _TWO_PI))
    return out


def pair_indices(rotary_dim, layout, offset=0):
    half = rotary_dim // 2
    i = np.arange(half)
    a, b = (i, i + half) if layout == "half" else (2 * i, 2 * i + 1)
    return a + offset, b + offset


def rotate_oracle(x, angles, *, rotary_dim, layout, offset=0, scale=1.0):
    """x (..., S, D) rotated pair by pair by ``angles`` (broadcasting to (..., S, rotary_dim/2)), rotated
    coordinates times ``scale``; float64."""
    y = np.array(x, np.float64)
    a, b = pair_indices(rotary_dim, layout, offset)
    c, s = np.cos(angles), np.sin(angles)
    xa, xb = y[..., a].copy(), y[..., b].copy()
    with np.errstate(invalid="ignore", over="ignore"):
        y[..., a] = (xa * c - xb * s) * scale
        y[..., b] = (xb * c + xa * s) * scale
    return y


def pair_axes_oracle(spec) -> np.ndarray:
    """The coordinate each pair reads, derived here from the documented M-RoPE / axial rules."""
    half = spec.rotary_dim // 2
    if spec.mrope_section is not None:
        s = list(spec.mrope_section)
        if spec.mrope_layout == "chunked":
            return np.repeat(np.arange(3), s)
        if spec.mrope_layout == "interleaved":   # h at i % 3 == 1, i < 3 s1; w at i % 3 == 2, i < 3 s2
            i = np.arange(half)
            return np.where((i % 3 == 1) & (i < 3 * s[1]), 1, np.where((i % 3 == 2) & (i < 3 * s[2]), 2, 0))
        hw = s[0] + s[1]                           # ernie: h, w alternate over s0 + s1 pairs, then t
        return np.array([1 + i % 2 for i in range(hw)] + [0] * (half - hw))
    return None


def spec_oracle(x, positions, spec, *, inverse=False, seq_len=None):
    """``rotary.apply`` of x (..., S, D), sequence axis -2, positions (S[, n]) or (B, S[, n]) with B =
    x.shape[0], by the oracle."""
    p = np.asarray(positions)
    multi = spec.multi_axis
    freqs = spec.inv_freq(seq_len)
    if multi:
        axes = pair_axes_oracle(spec)
        axes = spec.pair_axes() if axes is None else axes
        coords = np.take(p, axes, axis=-1)                 # (..., S, half): each pair's coordinate
        ang = np.empty(coords.shape)
        for j in range(coords.shape[-1]):
            ang[..., j] = exact_angles(coords[..., j], freqs[j:j + 1])[..., 0]
    else:
        ang = exact_angles(p, freqs)
    if inverse:
        ang = -ang
    if p.ndim - int(multi) == 2 and x.ndim >= 3:           # per-batch positions on axis 0
        ang = ang.reshape((ang.shape[0],) + (1,) * (x.ndim - 3) + ang.shape[1:])
    scale = spec.attention_scaling_at(seq_len)
    return rotate_oracle(x, ang, rotary_dim=spec.rotary_dim, layout=spec.layout, offset=spec.rotary_offset,
                         scale=1.0 / scale if inverse else scale)


def assert_matches(got, want, dtype, err_msg=""):
    """Non-finite exactly where the oracle is non-finite; the finite rest within the dtype's tolerance
    relative to the scale of the values."""
    got = np.asarray(got).astype(np.float64)
    want = np.asarray(want, np.float64)
    assert got.shape == want.shape, f"shape {got.shape} != oracle's {want.shape} {err_msg}"
    bad_g, bad_w = ~np.isfinite(got), ~np.isfinite(want)
    if not np.array_equal(bad_g, bad_w):
        where = np.argwhere(bad_g != bad_w)[:5].tolist()
        raise AssertionError(f"non-finite entries differ from the oracle's at {where} {err_msg}")
    if (~bad_w).any():
        tol = TOL[np.dtype(dtype).name if not isinstance(dtype, str) else dtype]
        ref = max(1.0, float(np.max(np.abs(want[~bad_w]))))
        np.testing.assert_allclose(got[~bad_g], want[~bad_w], rtol=tol, atol=tol * ref, err_msg=err_msg)


# -- attention oracles ---------------------------------------------------------------------------------
def softmax_attention_oracle(q, k, v, visible, scale, softcap=None):
    """q (..., Sq, d), k (..., Sk, d), v (..., Sk, dv) (k/v heads already repeated), visible (Bp?, Sq, Sk)
    broadcasting: the float64 softmax over the visible keys only (max-subtracted); a query with no
    visible key, or whose visible scores are all -inf, gives 0 (torch's SDPA; a visible key's NaN value
    still reaches it through its zero weight, as in torch)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    lead = np.broadcast_shapes(q.shape[:-2], k.shape[:-2])
    q, k, v = (np.broadcast_to(a, lead + a.shape[-2:]) for a in (q, k, v))
    vis = np.broadcast_to(visible, lead + (q.shape[-2], k.shape[-2]))
    out = np.zeros(lead + (q.shape[-2], v.shape[-1]))
    with np.errstate(invalid="ignore", over="ignore"):
        for idx in np.ndindex(lead):
            for t in range(q.shape[-2]):
                keys = np.flatnonzero(vis[idx + (t,)])
                if keys.size == 0:
                    continue
                sc = (k[idx][keys] @ q[idx][t]) * scale
                if softcap:
                    sc = softcap * np.tanh(sc / softcap)
                if (sc == -np.inf).all():   # weights 0, a visible NaN value still propagates (as in torch)
                    out[idx + (t,)] = np.zeros(keys.size) @ v[idx][keys]
                    continue
                w = np.exp(sc - sc.max())
                out[idx + (t,)] = (w / w.sum()) @ v[idx][keys]
    return out


def feature64(x, name):
    x = np.asarray(x, np.float64)
    if name == "elu":
        return np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0.0)))
    if name == "relu":
        return np.maximum(x, 0.0)
    return x


def linear_attention_oracle(a, b, ah, bh, v, *, causal, decay, normalize, eps, state=None):
    """Quadratic linear attention over (H, T, m) features (a, b: phi(q), phi(k); ah, bh: rotated) and v
    (H, T, dv), decay (H,) gammas; token t sees s <= t (causal) or every s, plus the state (S0 (H, m, dv),
    z0 (H, m)) decayed by gamma^(t+1). Only visible tokens enter the sums."""
    H, T, _ = a.shape
    o = np.zeros((H, T, v.shape[-1]))
    with np.errstate(invalid="ignore", over="ignore"):
        for h in range(H):
            g = decay[h]
            for t in range(T):
                s = np.arange(t + 1) if causal else np.arange(T)
                w = g ** (t - s) if causal else np.ones(len(s))
                num = (bh[h, s] @ ah[h, t] * w) @ v[h, s]
                den = (b[h, s] @ a[h, t] * w).sum()
                if state is not None:
                    f = g ** (t + 1) if causal else 1.0
                    num = num + f * (ah[h, t] @ state[0][h])
                    den = den + f * (a[h, t] @ state[1][h])
                o[h, t] = num / (den + eps) if normalize else num
    return o


# -- strategies ----------------------------------------------------------------------------------------
@st.composite
def plain_specs(draw, max_head_dim=24):
    """A 1-D RopeSpec: head_dim, rotary_dim (any even <= the rest), rotary_offset, layout, base."""
    head_dim = draw(st.integers(2, max_head_dim))
    offset = draw(st.sampled_from([0, 0, 0, 1, 3])) if head_dim >= 5 else 0
    rest = head_dim - offset
    rotary_dim = 2 * draw(st.integers(1, rest // 2))
    layout = draw(st.sampled_from(rotary.LAYOUTS))
    base = draw(st.sampled_from([10000.0, 500000.0, 10.0, 1e6, 2.5]))
    return rotary.RopeSpec(head_dim, rotary_dim=rotary_dim, rotary_offset=offset, layout=layout, base=base)


@st.composite
def mrope_specs(draw):
    """An M-RoPE spec of any layout with sections summing to rotary_dim/2."""
    s = [draw(st.integers(0, 4)) for _ in range(3)]
    if sum(s) == 0:
        s[0] = 1
    layout = draw(st.sampled_from(["chunked", "interleaved", "ernie"]))
    rotary_dim = 2 * sum(s)
    head_dim = rotary_dim + draw(st.sampled_from([0, 0, 2, 3]))
    return rotary.RopeSpec(head_dim, rotary_dim=rotary_dim, layout=draw(st.sampled_from(rotary.LAYOUTS)),
                           mrope_section=s, mrope_layout=layout, base=draw(st.sampled_from([10000.0, 1e6])))


@st.composite
def axial_specs(draw, float_positions=None):
    axes = draw(st.integers(1, 3))
    n = draw(st.integers(1, 3))
    rotary_dim = 2 * axes * n
    head_dim = rotary_dim + draw(st.sampled_from([0, 0, 1, 4]))
    fp = draw(st.booleans()) if float_positions is None else float_positions
    order = draw(st.permutations(range(axes)))
    return rotary.RopeSpec.axial(head_dim, axes=axes, rotary_dim=rotary_dim,
                                 layout=draw(st.sampled_from(rotary.LAYOUTS)),
                                 frequencies=draw(st.sampled_from(["per_axis", "strided"])), axis_order=order,
                                 frequency_scale=draw(st.sampled_from([1.0, 2 * np.pi])), float_positions=fp,
                                 base=draw(st.sampled_from([100.0, 10000.0])))


def data(draw, shape, dtype, nonfinite=False):
    """Standard-normal data of ``shape`` (seeded by hypothesis), optionally with NaN/inf at a few places."""
    seed = draw(st.integers(0, 2**32 - 1))
    x = np.random.default_rng(seed).standard_normal(shape)
    if nonfinite and x.size and draw(st.booleans()):
        for _ in range(draw(st.integers(1, 3))):
            flat = draw(st.integers(0, x.size - 1))
            x.reshape(-1)[flat] = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
    return x.astype(dtype)


def positions_1d(draw, S, batch=None, big=False):
    """None, an int offset, (S,) or (batch, S) int64 positions (big: anywhere below 2**53)."""
    kind = draw(st.sampled_from(["none", "int", "array", "batch"] if batch else ["none", "int", "array"]))
    hi = 2**53 - 1 - S if big else 5000
    if kind == "none":
        return None
    if kind == "int":
        return draw(st.integers(-hi if big else 0, hi))
    shape = (S,) if kind == "array" else (batch, S)
    seed = draw(st.integers(0, 2**32 - 1))
    lo = -hi if big else 0
    return np.random.default_rng(seed).integers(lo, hi, size=shape, dtype=np.int64)


def positions_array(p, S, batch=None):
    """The int64 positions an argument stands for: (S,) or (batch, S)."""
    if p is None:
        return np.arange(S, dtype=np.int64)
    if isinstance(p, (int, np.integer)):
        return np.arange(S, dtype=np.int64) + int(p)
    return np.asarray(p, np.int64)
