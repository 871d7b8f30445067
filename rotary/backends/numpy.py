"""Reference backend: array-API code (NumPy, CuPy, torch, JAX, array-api-strict, ...).

For NumPy arrays it takes a fast path that works in token blocks with ``out=`` ufuncs, so its
temporaries are a few block-sized buffers that stay in cache instead of q-sized arrays. Every
other namespace goes through the plain array-API expression (new arrays; the frontend writes
them into ``out`` when asked).

Rotation of pair (a, b) by angle t (s negated for the inverse)::

    y_a = x_a cos t - x_b sin t
    y_b = x_b cos t + x_a sin t
"""

from __future__ import annotations

import numpy as np
from array_api_compat import array_namespace, is_numpy_array

NAME = "numpy"

#: bytes of x per block on the NumPy fast path (fits in L2 with the temporaries)
BLOCK_BYTES = 1 << 18


def availability():
    return True, "ok"


def accepts(x) -> bool:
    try:
        array_namespace(x)
    except TypeError:
        return False
    return True


def _compute_dtype(dtype, xp):
    return xp.float64 if dtype == xp.float64 else xp.float32


def _pair_slices(rotary_dim: int, layout: str):
    half = rotary_dim // 2
    if layout == "half":
        return slice(0, half), slice(half, rotary_dim)
    return slice(0, rotary_dim, 2), slice(1, rotary_dim, 2)


# -- NumPy fast path ---------------------------------------------------------------------------
def _rotate_numpy_block(x, out, c, s, sa, sb, tmp_a, tmp_b):
    """Rotate x[..., sa], x[..., sb] by (c, s) into out; safe when out is x (reads before writes)."""
    work_dtype = tmp_a.dtype
    xa, xb = x[..., sa], x[..., sb]
    if xa.dtype != work_dtype:
        xa = xa.astype(work_dtype)
        xb = xb.astype(work_dtype)
    # tmp_a = xa c - xb s ; tmp_b = xb c + xa s  (two block-sized temporaries + one product buffer)
    prod = np.multiply(xb, s)
    np.multiply(xa, c, out=tmp_a)
    np.subtract(tmp_a, prod, out=tmp_a)
    np.multiply(xa, s, out=prod)
    np.multiply(xb, c, out=tmp_b)
    np.add(tmp_b, prod, out=tmp_b)
    out[..., sa] = tmp_a
    out[..., sb] = tmp_b


def _rotate_numpy(x, out, cos_tok, sin_tok, rotary_dim, layout):
    """x, out: (B, S, H, D) NumPy; cos_tok/sin_tok: (Bp, S, 1, half) in the work dtype."""
    B, S, H, D = x.shape
    sa, sb = _pair_slices(rotary_dim, layout)
    if out is not x and D > rotary_dim:
        out[..., rotary_dim:] = x[..., rotary_dim:]
    half = rotary_dim // 2
    per_token = max(1, H * D * x.itemsize)
    tokens_per_block = max(1, BLOCK_BYTES // per_token)
    work = cos_tok.dtype
    bp = cos_tok.shape[0]
    if B * S <= tokens_per_block:
        tmp_a = np.empty((B, S, H, half), dtype=work)
        _rotate_numpy_block(x, out, cos_tok, sin_tok, sa, sb, tmp_a, np.empty_like(tmp_a))
        return
    if S <= tokens_per_block:   # short sequences (decode): blocks of whole batch rows
        rows_per_block = tokens_per_block // S
        tmp_a = np.empty((min(B, rows_per_block), S, H, half), dtype=work)
        tmp_b = np.empty_like(tmp_a)
        for b0 in range(0, B, rows_per_block):
            b1 = min(B, b0 + rows_per_block)
            cb = slice(b0, b1) if bp > 1 else slice(0, 1)
            _rotate_numpy_block(x[b0:b1], out[b0:b1], cos_tok[cb], sin_tok[cb], sa, sb, tmp_a[:b1 - b0],
                                tmp_b[:b1 - b0])
        return
    step = tokens_per_block
    tmp_a = np.empty((1, step, H, half), dtype=work)
    tmp_b = np.empty_like(tmp_a)
    for b in range(B):
        cb = b if bp > 1 else 0
        for s0 in range(0, S, step):
            s1 = min(S, s0 + step)
            n = s1 - s0
            _rotate_numpy_block(x[b:b + 1, s0:s1], out[b:b + 1, s0:s1], cos_tok[cb:cb + 1, s0:s1],
                                sin_tok[cb:cb + 1, s0:s1], sa, sb, tmp_a[:, :n], tmp_b[:, :n])


# -- generic array-API path --------------------------------------------------------------------
def _rotate_xp(xp, x, cos_tok, sin_tok, rotary_dim, layout):
    """Functional version for any array-API namespace; returns a new array."""
    dtype = x.dtype
    work = _compute_dtype(dtype, xp)
    xr = xp.astype(x[..., :rotary_dim], work)
    half = rotary_dim // 2
    if layout == "half":
        xa, xb = xr[..., :half], xr[..., half:]
    else:
        pairs = xp.reshape(xr, (*xr.shape[:-1], half, 2))
        xa, xb = pairs[..., 0], pairs[..., 1]
    ya = xa * cos_tok - xb * sin_tok
    yb = xb * cos_tok + xa * sin_tok
    if layout == "half":
        y = xp.concat([ya, yb], axis=-1)
    else:
        y = xp.reshape(xp.stack([ya, yb], axis=-1), xr.shape)
    y = xp.astype(y, dtype)
    if x.shape[-1] > rotary_dim:
        y = xp.concat([y, x[..., rotary_dim:]], axis=-1)
    return y


def gather_rows(xp, cos, sin, rows, work_dtype, inverse):
    """(cos_tok, sin_tok) of shape (Bp, S, 1, half) in ``work_dtype``; sin negated for the inverse."""
    bp, s = rows.shape
    flat = xp.reshape(rows, (-1,))
    cos_tok = xp.reshape(xp.astype(xp.take(cos, flat, axis=0), work_dtype), (bp, s, 1, cos.shape[-1]))
    sin_tok = xp.reshape(xp.astype(xp.take(sin, flat, axis=0), work_dtype), (bp, s, 1, sin.shape[-1]))
    if inverse:
        sin_tok = -sin_tok
    return cos_tok, sin_tok


def rotate(items, cos, sin, rows, *, rotary_dim, layout, inverse):
    """Rotate every ``(x, out)`` of ``items``; see ``rotary.backends`` for the contract."""
    results = []
    xp = array_namespace(items[0][0])
    gathered = {}
    for x, out in items:
        work = _compute_dtype(x.dtype, xp)
        if work not in gathered:
            gathered[work] = gather_rows(xp, cos, sin, rows, work, inverse)
        cos_tok, sin_tok = gathered[work]
        if is_numpy_array(x):
            if out is None:
                out = np.empty(x.shape, dtype=x.dtype)
            _rotate_numpy(x, out, cos_tok, sin_tok, rotary_dim, layout)
            results.append(out)
        else:
            y = _rotate_xp(xp, x, cos_tok, sin_tok, rotary_dim, layout)
            if out is not None:
                out[...] = y
                y = out
            results.append(y)
    return results


from ._numpy_linear import linear_attention  # noqa: F401
