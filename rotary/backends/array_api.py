"""Rotation helpers in plain array-API code, shared by the NumPy backend's rotation and linear attention.

Rotation of pair (a, b) by angle t: ``y_a = x_a cos t - x_b sin t``, ``y_b = x_b cos t + x_a sin t``.
"""

from __future__ import annotations


def _compute_dtype(dtype, xp):
    return xp.float64 if dtype == xp.float64 else xp.float32


def _rotate_xp(xp, x, cos_tok, sin_tok, rotary_dim, layout, rotary_offset=0, out_layout=None):
    """Functional version for any array-API namespace; returns a new array. With ``rotary_offset``
    the coordinates before it pass through and the rotation starts there. Pairs are read in ``layout`` and
    written in ``out_layout`` (None: ``layout``)."""
    if rotary_offset:
        rotated = _rotate_xp(xp, x[..., rotary_offset:], cos_tok, sin_tok, rotary_dim, layout, out_layout=out_layout)
        return xp.concat([x[..., :rotary_offset], rotated], axis=-1)
    dtype = x.dtype
    xr = xp.astype(x[..., :rotary_dim], _compute_dtype(dtype, xp))
    y = xp.astype(rotate_pairs(xp, xr, cos_tok, sin_tok, layout, out_layout), dtype)
    if x.shape[-1] > rotary_dim:
        y = xp.concat([y, x[..., rotary_dim:]], axis=-1)
    return y


def rotate_pairs(xp, xr, cos_tok, sin_tok, layout, out_layout=None):
    """The rotated pairs of ``xr`` (..., rotary_dim), every coordinate a pair member, in xr's (work) dtype:
    pairs read in ``layout``, written in ``out_layout`` (None: ``layout``); cos_tok/sin_tok broadcast against
    (..., rotary_dim // 2)."""
    half = xr.shape[-1] // 2
    if layout == "half":
        xa, xb = xr[..., :half], xr[..., half:]
    else:
        pairs = xp.reshape(xr, (*xr.shape[:-1], half, 2))
        xa, xb = pairs[..., 0], pairs[..., 1]
    ya = xa * cos_tok - xb * sin_tok
    yb = xb * cos_tok + xa * sin_tok
    if (out_layout or layout) == "half":
        return xp.concat([ya, yb], axis=-1)
    return xp.reshape(xp.stack([ya, yb], axis=-1), xr.shape)


def gather_rows(xp, cos, sin, rows, work_dtype, inverse):
    """(cos_tok, sin_tok) of shape (Bp, S, 1, half) in ``work_dtype``; sin negated for the inverse."""
    bp, s = rows.shape
    flat = xp.reshape(rows, (-1,))
    cos_tok = xp.reshape(xp.astype(xp.take(cos, flat, axis=0), work_dtype), (bp, s, 1, cos.shape[-1]))
    sin_tok = xp.reshape(xp.astype(xp.take(sin, flat, axis=0), work_dtype), (bp, s, 1, sin.shape[-1]))
    if inverse:
        sin_tok = -sin_tok
    return cos_tok, sin_tok


def visible_matmul(xp, w, x, visible, product=None):
    """``w @ x`` where the entries of ``w`` that ``visible`` (a bool array broadcasting against w) marks
    False contribute exactly nothing (a causal or attention mask; those weights are 0).

    The plain product leaks: 0 * NaN is NaN, so a NaN/inf value in a masked row of x (a later token, a
    hidden key) reached every output row. An entry of the plain product (``product``, computed when None)
    that came out non-finite although no visible row of x is non-finite in its column is replaced by the
    product with x's non-finite values zeroed: exact, since masked weights are 0 and visible values are
    unchanged; every visible NaN/inf still propagates. NumPy arrays take it only when the product has a
    non-finite entry; other arrays (devices, JAX traces) branch-free.
    """
    import numpy as np
    from array_api_compat import device as xp_device, is_numpy_array

    if product is None:
        product = xp.matmul(w, x)
    host = is_numpy_array(product)
    if host and np.isfinite(product).all():
        return product
    bad = xp.logical_not(xp.isfinite(x))
    clean = xp.where(bad, xp.zeros((), dtype=x.dtype, device=xp_device(x)), x)
    if not host and is_numpy_array(visible):
        visible = xp.asarray(visible, device=xp_device(x))
    reached = xp.matmul(xp.astype(visible, x.dtype), xp.astype(bad, x.dtype))   # visible non-finite values
    leaked = xp.logical_and(xp.logical_not(xp.isfinite(product)), reached == 0)
    return xp.where(leaked, xp.matmul(w, clean), product)
