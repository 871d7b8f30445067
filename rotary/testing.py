"""Independent float64 oracles, the tolerance table and assert helpers (used by tests and users).

The oracles do not use the library's tables, views or backends: each takes the frequencies
(``inv_freq``, e.g. from ``spec.inv_freq()``) and computes the rotation its own way:

- :func:`rope_2x2`: explicit 2x2 rotation matrices applied pair by pair;
- :func:`rope_matrix`: the block-diagonal matrix R_m of RoFormer eq. (15), built per position;
- :func:`rope_complex`: complex multiplication ``z_i * exp(1j * m * theta_i)``;
- :func:`linear_attention_quadratic`: linear attention with RoPE (RoFormer eq. 19) as a T x T matrix;
- :func:`attention_quadratic`: softmax attention with RoPE, masks (causal by position, sliding window),
  soft-capping and GQA as one full score matrix.

Their rotations come from :func:`phase`, exact to a few ulp at any float64 position (exact partial
products, reduced by libm), independently of the library's double-double angles.
"""

from __future__ import annotations

import numpy as np

#: (rtol, atol) per dtype name, for values of order 1 compared with a float64 oracle.
TOLERANCES = {
    "float64": (1e-12, 1e-12),
    "float32": (2e-6, 2e-6),
    "float16": (2e-3, 2e-3),
    "bfloat16": (1.6e-2, 1.6e-2),
}


def _pairs(rotary_dim: int, layout: str):
    half = rotary_dim // 2
    i = np.arange(half)
    return (i, i + half) if layout == "half" else (2 * i, 2 * i + 1)


def _halves(a):
    """(hi, lo), hi + lo == a exactly, each of at most 26 significant bits (Veltkamp splitting)."""
    c = 134217729.0 * a
    hi = c - (c - a)
    return hi, a - hi


def phase(positions, inv_freq, *, inverse=False, pair_axes=None):
    """``exp(1j * p * w)`` (shape positions.shape + (d/2,)) accurate to a few ulp at any float64 p.

    p and w are each split into two 26-bit halves, so the four partial products ``p_j * w_k`` are
    exact doubles; libm reduces each exactly and the four unit phases are multiplied. (A plain
    ``exp(1j * p * w)`` is off by up to ``|p w| * 2**-53`` rad: 6e-8 at p = 2**31.) With ``pair_axes``
    (multi-axis), positions carry coordinates on a trailing axis and pair i reads ``pair_axes[i]``.
    """
    p = np.asarray(positions, dtype=np.float64)
    p = p[..., None] if pair_axes is None else p[..., np.asarray(pair_axes, dtype=np.int64)]
    w = np.asarray(inv_freq, dtype=np.float64)
    sign = -1.0 if inverse else 1.0
    z = np.ones(np.broadcast_shapes(p.shape, w.shape), dtype=np.complex128)
    for pj in _halves(p):
        for wk in _halves(w):
            z = z * np.exp(1j * (sign * (pj * wk)))
    return z


def rope_2x2(x, positions, inv_freq, *, layout="half", scale=1.0, inverse=False):
    """Oracle: rotate each pair of x (..., seq, d) by an explicit 2x2 matrix; positions (seq,) or broadcastable."""
    x = np.asarray(x, dtype=np.float64)
    r = 2 * len(inv_freq)
    a, b = _pairs(r, layout)
    rot_phase = phase(positions, inv_freq, inverse=inverse)   # (..., seq, half)
    y = x.copy()
    for i in range(len(inv_freq)):
        c = rot_phase[..., i].real * scale
        s = rot_phase[..., i].imag * scale
        rot = np.stack([np.stack([c, -s], -1), np.stack([s, c], -1)], -2)   # (..., seq, 2, 2)
        pair = np.stack([x[..., a[i]], x[..., b[i]]], -1)[..., None]        # (..., seq, 2, 1)
        out = (rot @ pair)[..., 0]
        y[..., a[i]], y[..., b[i]] = out[..., 0], out[..., 1]
    return y


def rotation_matrix(position, inv_freq, head_dim, *, layout="half", scale=1.0):
    """The d x d matrix R_m: block-diagonal 2x2 rotations on the layout's pairs, identity elsewhere."""
    r = 2 * len(inv_freq)
    a, b = _pairs(r, layout)
    R = np.eye(head_dim)
    for i, z in enumerate(phase(float(position), inv_freq)):
        c, s = z.real * scale, z.imag * scale
        R[a[i], a[i]], R[a[i], b[i]] = c, -s
        R[b[i], a[i]], R[b[i], b[i]] = s, c
    return R


def rope_matrix(x, positions, inv_freq, *, layout="half", scale=1.0):
    """Oracle: y_t = R_{p_t} x_t with R from :func:`rotation_matrix`; x (seq, d) or (..., seq, d), positions (seq,)."""
    x = np.asarray(x, dtype=np.float64)
    positions = np.asarray(positions)
    y = np.empty_like(x)
    for t, p in enumerate(positions.reshape(-1)):
        R = rotation_matrix(p, inv_freq, x.shape[-1], layout=layout, scale=scale)
        y[..., t, :] = x[..., t, :] @ R.T
    return y


def rope_complex(x, positions, inv_freq, *, layout="half", scale=1.0, pair_axes=None, rotary_offset=0):
    """Oracle: pairs as complex numbers z = x_a + i x_b, multiplied by scale * exp(i p theta).

    ``pair_axes`` (multi-axis specs): positions carry coordinates on a trailing axis and pair i turns
    by ``positions[..., pair_axes[i]] * inv_freq[i]``. ``rotary_offset``: the pairs' coordinates
    start there (a spec's ``rotary_offset``)."""
    x = np.asarray(x, dtype=np.float64)
    r = 2 * len(inv_freq)
    a, b = (i + rotary_offset for i in _pairs(r, layout))
    z = x[..., a] + 1j * x[..., b]
    z = z * (scale * phase(positions, inv_freq, pair_axes=pair_axes))
    y = x.copy()
    y[..., a], y[..., b] = z.real, z.imag
    return y


def feature_map64(x, feature_map="elu"):
    """phi(x) in float64: "elu" is elu(x) + 1, "relu" is max(x, 0), "identity" is x."""
    x = np.asarray(x, dtype=np.float64)
    if feature_map == "elu":
        return np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0.0)))
    if feature_map == "relu":
        return np.maximum(x, 0.0)
    if feature_map == "identity":
        return x
    raise ValueError(f"feature_map must be 'elu', 'relu' or 'identity', got {feature_map!r}")


def linear_attention_quadratic(q, k, v, positions, inv_freq, *, layout="half", scale=1.0, causal=False,
                               feature_map="elu", eps=1e-6, decay=None, normalize=True, pair_axes=None,
                               rotary_offset=0):
    """Oracle: RoFormer eq. 19 written as a T x T matrix, in float64, with optional decay.

    ``o_t = sum_s D_ts (R_{p_t} a_t)^T (R_{p_s} b_s) v_s / (sum_s D_ts a_t^T b_s + eps)`` with a = phi(q),
    b = phi(k), ``D_ts = gamma^(t-s)`` for s <= t when ``causal`` (gamma = ``decay``, 1 by default, a scalar or
    an array broadcastable to q.shape[:-2], e.g. one per head), ``D_ts = 1`` for every s otherwise;
    ``normalize=False`` returns the numerator. q, k (..., T, d), v (..., T, dv), positions (T,) or
    broadcastable to (..., T) ((..., T, n_axes) with ``pair_axes``: multi-axis specs); R from
    :func:`rope_complex` (``scale`` multiplies each rotation; ``rotary_offset`` as there).
    """
    a, b = feature_map64(q, feature_map), feature_map64(k, feature_map)
    v = np.asarray(v, dtype=np.float64)
    T = a.shape[-2]
    t = np.arange(T)
    if causal:
        gamma = np.ones(()) if decay is None else np.asarray(decay, dtype=np.float64)
        lag = t[:, None] - t[None, :]
        mask = np.where(lag >= 0, np.power(gamma[..., None, None], np.maximum(lag, 0)), 0.0)
    else:
        mask = np.ones((T, T))
    a_hat = rope_complex(a, positions, inv_freq, layout=layout, scale=scale, pair_axes=pair_axes,
                         rotary_offset=rotary_offset)
    b_hat = rope_complex(b, positions, inv_freq, layout=layout, scale=scale, pair_axes=pair_axes,
                         rotary_offset=rotary_offset)
    numerator = ((a_hat @ np.swapaxes(b_hat, -1, -2)) * mask) @ v
    if not normalize:
        return numerator
    denominator = ((a @ np.swapaxes(b, -1, -2)) * mask).sum(-1, keepdims=True)
    return numerator / (denominator + eps)


def attention_quadratic(q, k, v, q_positions, k_positions, inv_freq=None, *, layout="half", rotation_scale=1.0,
                        scale=None, causal=False, window=None, softcap=None, rotary_offset=0):
    """Oracle: softmax attention in float64 with the whole (Sq, Sk) score matrix.

    q (..., Hq, Sq, d), k (..., Hk, Sk, d), v (..., Hk, Sk, dv): q head j uses k/v head j // (Hq/Hk)
    (explicitly repeated). q_positions (Sq,) or (B, Sq) and k_positions likewise (B = axis 0) rotate
    q and k (:func:`rope_complex` from ``rotary_offset`` on; none when ``inv_freq`` is None) and mask: key s is hidden from
    query t when ``causal`` and p_s > p_t, or ``window`` and p_t - p_s >= window. Scores
    ``softcap * tanh(scale <q, k> / softcap)`` (scale default d**-0.5); rows seeing no key give 0.
    """
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    qp, kp = np.asarray(q_positions), np.asarray(k_positions)
    qpb = qp.reshape(qp.shape[:1] + (1,) * (q.ndim - 3) + qp.shape[1:]) if qp.ndim == 2 else qp
    kpb = kp.reshape(kp.shape[:1] + (1,) * (k.ndim - 3) + kp.shape[1:]) if kp.ndim == 2 else kp
    if inv_freq is not None:
        q = rope_complex(q, qpb, inv_freq, layout=layout, scale=rotation_scale, rotary_offset=rotary_offset)
        k = rope_complex(k, kpb, inv_freq, layout=layout, scale=rotation_scale, rotary_offset=rotary_offset)
    g = q.shape[-3] // k.shape[-3]
    k, v = np.repeat(k, g, axis=-3), np.repeat(v, g, axis=-3)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = np.einsum("...td,...sd->...ts", q, k) * scale
    if softcap:
        scores = softcap * np.tanh(scores / softcap)
    t, s_ = np.asarray(qpb, np.float64)[..., :, None], np.asarray(kpb, np.float64)[..., None, :]
    visible = np.ones(np.broadcast_shapes(t.shape, s_.shape), bool)
    if causal:
        visible &= s_ <= t
    if window is not None:
        visible &= (t - s_) < window
    scores = np.where(visible, scores, -np.inf)
    top = scores.max(-1, keepdims=True)
    w = np.exp(scores - np.where(np.isfinite(top), top, 0.0))
    total = w.sum(-1, keepdims=True)
    return (w / np.where(total > 0, total, 1.0)) @ v


def to_numpy64(a) -> np.ndarray:
    """A float64 NumPy copy of any array (CuPy, torch, JAX, array-api-strict)."""
    from .spec.validators import to_numpy

    if hasattr(a, "dtype") and "bfloat16" in str(a.dtype):
        try:
            import torch

            if isinstance(a, torch.Tensor):
                return a.detach().float().cpu().numpy().astype(np.float64)
        except ImportError:
            pass
    return np.asarray(to_numpy(a, "array"), dtype=np.float64)


def tolerance(dtype) -> tuple[float, float]:
    name = str(dtype).split(".")[-1]
    return TOLERANCES.get(name, TOLERANCES["float32"])


def assert_close(actual, desired, *, like=None, rtol=None, atol=None, err_msg=""):
    """Assert ``actual`` is close to the float64 ``desired``, after checking type, shape and dtype.

    ``like`` (default: none) is the input array whose type and dtype ``actual`` must have. Tolerances
    default to :data:`TOLERANCES` for actual's dtype.
    """
    if like is not None:
        assert type(actual) is type(like), f"array type {type(actual).__name__} != {type(like).__name__} {err_msg}"
        assert actual.dtype == like.dtype, f"dtype {actual.dtype} != {like.dtype} {err_msg}"
    assert tuple(actual.shape) == tuple(np.shape(desired)), f"shape {tuple(actual.shape)} != {np.shape(desired)} {err_msg}"
    r, a = tolerance(actual.dtype)
    rtol = r if rtol is None else rtol
    atol = a if atol is None else atol
    np.testing.assert_allclose(to_numpy64(actual), np.asarray(desired, dtype=np.float64), rtol=rtol, atol=atol,
                               err_msg=err_msg)


def max_error(actual, desired) -> float:
    """max |actual - desired| in float64."""
    d = to_numpy64(actual) - np.asarray(desired, dtype=np.float64)
    return float(np.max(np.abs(d))) if d.size else 0.0


def dequantize64(entries, scales, kv_dtype):
    """float64 values of stored KV entries, by the formats' definitions written out here (independent of
    ``rotary.backends.kv_entries``): float entries as they are; int8 times the scale of the (token, head); float8
    e4m3fn bits decoded (sign, 4 exponent bits of bias 7, 3 mantissa bits; exponent 0: m 2^-9) times the scale."""
    entries = np.asarray(entries)
    if kv_dtype is None:
        return entries.astype(np.float64)
    scales = np.asarray(scales, np.float64)[..., None]
    if kv_dtype == "int8":
        return entries.astype(np.float64) * scales
    bits = entries.astype(np.int64)
    e, m = (bits >> 3) & 15, bits & 7
    mag = np.where(e == 0, m * 2.0 ** -9, (8 + m) * 2.0 ** (e - 10.0))
    mag = np.where((e == 15) & (m == 7), np.nan, mag)
    return np.where(bits >> 7, -mag, mag) * scales


def paged_attention64(q, stores, block_table, page_size, seq_lens, q_starts, *, scale, softcap=None, window=None,
                      causal=True, kv_dtype=None):
    """Oracle of the ``paged_attention`` primitive (``rotary.backends``' contract) in float64: packed rotated q
    (T, Hq, D); stores = flat (slots, Hk, D) entries and (slots, Hk) scales; sequence i's keys ``0 ..
    seq_lens[i] - 1`` gathered through ``block_table`` (only those some query sees: pages before a window may be
    -1) and dequantized (:func:`dequantize64`); its queries ``q_starts[i] ..`` at the last positions; an explicit
    masked softmax per query and head (q head h reads k/v head h // (Hq / Hk)); a query that sees no key gets 0."""
    k_ent, v_ent, k_scale, v_scale = stores
    q = np.asarray(q, np.float64)
    table, lens, starts = (np.asarray(a, np.int64) for a in (block_table, seq_lens, q_starts))
    groups = q.shape[1] // k_ent.shape[1]
    o = np.zeros(q.shape)
    for i, length in enumerate(lens.tolist()):
        count = int(starts[i + 1] - starts[i])
        at = length - count + np.arange(count)   # each query's position
        first = max(0, length - count - window + 1) if causal and window is not None else 0
        p = np.arange(first, length)
        slots = table[i, p // page_size] * page_size + p % page_size
        keys = dequantize64(k_ent[slots], None if k_scale is None else k_scale[slots], kv_dtype)
        values = dequantize64(v_ent[slots], None if v_scale is None else v_scale[slots], kv_dtype)
        keys, values = np.repeat(keys, groups, axis=1), np.repeat(values, groups, axis=1)   # (L, Hq, D)
        scores = scale * np.einsum("jhd,phd->jhp", q[starts[i]:starts[i + 1]], keys)
        if softcap is not None:
            scores = softcap * np.tanh(scores / softcap)
        seen = np.ones((count, p.size), bool)
        if causal:
            seen = (p[None] <= at[:, None]) & (True if window is None else at[:, None] - p[None] < window)
        seen = np.broadcast_to(seen[:, None, :], scores.shape)
        top = np.where(seen, scores, -np.inf).max(-1, keepdims=True, initial=-np.inf)
        weights = np.where(seen, np.exp(np.where(seen, scores - np.where(np.isfinite(top), top, 0.0), 0.0)), 0.0)
        total = weights.sum(-1, keepdims=True)
        o[starts[i]:starts[i + 1]] = np.einsum("jhp,phd->jhd", weights / np.where(total > 0, total, 1.0), values)
    return o
