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

from .numpy_linear import linear_attention  # noqa: F401  (the backend's linear-attention primitive)
from .numpy_linear_backward import linear_attention_backward  # noqa: F401  (its backward)
PACKED_LINEAR_ATTENTION = True   # linear_attention takes cu_seqlens (a packed batch in one pass)
from .array_api import _compute_dtype, _rotate_xp, gather_rows  # noqa: F401  (gather_rows: tests use it)
from .kv_entries import KV_FORMATS, append_kv, paged_attention  # noqa: F401  (the KV primitives, the references)

NAME = "numpy"
#: the KV formats of its KV primitives: every one
VARIANTS = {"append_kv": tuple(KV_FORMATS), "paged_attention": tuple(KV_FORMATS)}

#: bytes of work-dtype temporaries (all items of a call, rotary part) per token block on the NumPy
#: fast path; each buffer of the block then fits in L2 with the others
BLOCK_BYTES = 1 << 20


def availability():
    return True, "ok"


def accepts(x) -> bool:
    try:
        array_namespace(x)
    except TypeError:
        return False
    return True


def _pair_slices(rotary_dim: int, layout: str):
    half = rotary_dim // 2
    if layout == "half":
        return slice(0, half), slice(half, rotary_dim)
    return slice(0, rotary_dim, 2), slice(1, rotary_dim, 2)


# -- NumPy fast path ---------------------------------------------------------------------------
# fp16 <-> fp32 with integer bit operations. NumPy's own casts between float16 and float32 run one
# element at a time (about 1.2-1.4 ns per element here, more than everything else together); these
# run as a few SIMD ufunc passes over a cache-resident block and give the same bits:
# - in: the fp16 bits, sign-extended to int32, shifted left by 13 and masked (sign kept, exponent
#   and mantissa in fp32 position) are an fp32 number X equal to the fp16 value times 2**-112. X is
#   never scaled back: the tables are multiplied by 2**112 instead (exact), and x*c rounds the
#   same exact product once either way. Infinities/NaNs (|X| >= 2**-96) send the block to NumPy's
#   cast.
# - out: y rounded to fp16 precision with the magic-number trick (|y| + M) - M, M = 2**(e+13) for
#   y's exponent e (at least 2**-1, the fp16 subnormal spacing times 2**23): one fp32 addition does
#   the round-to-nearest-even at fp16 spacing, subnormals included. The rounded value times 2**-112
#   (exact) holds the fp16 bits at bit 13. |y| >= 65520 (overflow: NumPy warns) and NaN send the
#   block to NumPy's cast; so does an errstate that asks for underflow reports, and a CPU that
#   flushes subnormals to zero (checked once per call).
_F16_IN_MASK = np.int32(-0x70002000)            # 0x8FFFE000: sign at bit 31, |bits| at 13..27
_F16_SCALE = 2.0 ** 112
_F16_SPECIAL_IN = np.float32(2.0 ** -96)        # |X| of an fp16 inf/NaN is at least 2**(31-15) * 2**-112
_F16_OVERFLOW = np.float32(65520.0)             # rounds to inf in fp16
_F16_MIN_SPACING_M = np.float32(2.0 ** -14)     # smallest exponent used for M (times 2**13 below)
_F16_M_SHIFT = np.uint32(13 << 23)
_F16_DOWN = np.float32(2.0 ** -112)
_TINY = np.full(8, 2.0 ** -14, dtype=np.float32)


def _f16_bit_path_ok() -> bool:
    """True when the bit-operation fp16 conversions give NumPy's results (no FTZ/DAZ, no underflow
    reports requested)."""
    if np.geterr()["under"] != "ignore":
        return False
    with np.errstate(all="ignore"):
        y = np.multiply(_TINY, _F16_DOWN)                                  # fp32 subnormals
        return bool(y[0] != 0) and bool(np.multiply(y, np.float32(1.0))[0] != 0)


def _block_tables(cos_tok, sin_tok, rotary_dim, layout, scale, c_buf, s_buf):
    """(C2, S2) of shape (..., rotary_dim) for a block: C2 = c on both members of each pair, S2 = s on
    the first member and -s on the second (so y = x C2 + pairswap(x S2)); times ``scale``."""
    half = rotary_dim // 2
    if layout == "half":
        ca, cb, sa, sb = c_buf[..., :half], c_buf[..., half:], s_buf[..., :half], s_buf[..., half:]
    else:
        ca, cb, sa, sb = c_buf[..., 0::2], c_buf[..., 1::2], s_buf[..., 0::2], s_buf[..., 1::2]
    if scale == 1.0:
        np.copyto(ca, cos_tok)
        np.copyto(sa, sin_tok)
    else:
        np.multiply(cos_tok, scale, out=ca)
        np.multiply(sin_tok, scale, out=sa)
    np.copyto(cb, ca)
    np.negative(sa, out=sb)
    return c_buf, s_buf


def _split_last(a, half):
    """A view of ``a`` with its last axis split into (2, half); never a copy."""
    v = a.view()
    v.shape = a.shape[:-1] + (2, half)
    return v


def _pairswap_add(p, q, rotary_dim, layout, out=None):
    """out = p + pairswap(q): out_a = p_a + q_b, out_b = p_b + q_a for every pair (a, b); out may be p."""
    half = rotary_dim // 2
    out = p if out is None else out
    if layout == "half":
        np.add(_split_last(p, half), _split_last(q, half)[..., ::-1, :], out=_split_last(out, half))
    else:
        np.add(p[..., 0::2], q[..., 1::2], out=out[..., 0::2])
        np.add(p[..., 1::2], q[..., 0::2], out=out[..., 1::2])


def _write_pairs(dst, src, rotary_dim, layout, out_layout):
    """dst[..., :rotary_dim] = src (pairs in ``layout``) with pair i moved to its coordinates in ``out_layout``
    (unsafe casting: src may be the work dtype, or the fp16 bits as uint32)."""
    half = rotary_dim // 2
    a, b = (src[..., :half], src[..., half:rotary_dim]) if layout == "half" else (src[..., 0:rotary_dim:2],
                                                                                src[..., 1:rotary_dim:2])
    if out_layout == "half":
        da, db = dst[..., :half], dst[..., half:rotary_dim]
    else:
        da, db = dst[..., 0:rotary_dim:2], dst[..., 1:rotary_dim:2]
    np.copyto(da, a, casting="unsafe")
    np.copyto(db, b, casting="unsafe")


def _rotate_numpy_block(x, out, c2, s2, rotary_dim, layout, p, q, out_layout=None):
    """Rotate x[..., :rotary_dim] into out[..., :rotary_dim] (both (nb, ns, H, D) views, any strides)
    with block tables c2/s2 (nb or 1, ns, 1, rotary_dim); p, q: work buffers of the block's shape.
    Safe when out is x (x is read in full before out is written). ``out_layout`` (not None: another pair
    layout than ``layout``): the block is rotated in ``layout`` into p and written out with its pairs moved.

    y_a = x_a c - x_b s is computed as (x_a c) + (x_b (-s)) and y_b = x_b c + x_a s as is: IEEE
    a - b == a + (-b) and (-b) s == b (-s), so the bits are those of the two-product formula."""
    xr, outr = x[..., :rotary_dim], out[..., :rotary_dim]
    if xr.dtype == p.dtype:
        np.multiply(xr, s2, out=q)
        np.multiply(xr, c2, out=p)
        if out_layout is None:
            _pairswap_add(p, q, rotary_dim, layout, out=outr)
        else:
            _pairswap_add(p, q, rotary_dim, layout)
            _write_pairs(outr, p, rotary_dim, layout, out_layout)
        return
    np.copyto(p, xr, casting="unsafe")
    np.multiply(p, s2, out=q)
    np.multiply(p, c2, out=p)
    _pairswap_add(p, q, rotary_dim, layout)
    if out_layout is None:
        np.copyto(outr, p, casting="unsafe")
    else:
        _write_pairs(outr, p, rotary_dim, layout, out_layout)


_MAX = np.maximum.reduce
_MIN = np.minimum.reduce


def _f16_round_bits(p, q, t, floor):
    """fp32 ``p`` (any shape, contiguous) -> its fp16 bits in ``p.view(np.uint32)`` (round to nearest
    even, subnormals included); q, t: scratch of p's shape; floor: 2**-14 everywhere. False (p
    destroyed) when p holds a NaN or a value that overflows fp16: then use NumPy's cast."""
    pi, qi, ti = p.view(np.uint32), q.view(np.uint32), t.view(np.uint32)
    np.bitwise_and(pi, np.uint32(0x7F800000), out=qi)    # 2**e (0 for fp32 subnormals)
    np.maximum(q, floor, out=q)                          # (an array: a scalar operand is 8x slower)
    np.add(qi, _F16_M_SHIFT, out=qi)                     # M = 2**(max(e, -14) + 13)
    np.right_shift(pi, 16, out=ti)
    np.bitwise_and(ti, np.uint32(0x8000), out=ti)        # fp16 sign bit
    np.absolute(p, out=p)
    if not _MAX(p.reshape(-1)) < _F16_OVERFLOW:          # overflow or NaN: NumPy's cast (and warnings)
        return False
    np.add(p, q, out=p)
    np.subtract(p, q, out=p)                             # |y| rounded to fp16 (round to nearest even)
    np.multiply(p, _F16_DOWN, out=p)                     # fp16 bits at bit 13
    np.right_shift(pi, 13, out=pi)
    np.bitwise_or(pi, ti, out=pi)
    return True


def _rotate_f16_group(xs, outs, c2, s2, rotary_dim, layout, p, q, t, floor, out_layout=None):
    """fp16 items of one token block, heads side by side in the (nb, ns, sum H, rotary_dim) buffers
    p, q, t (fp32) and floor (2**-14 everywhere); c2/s2 are the tables times 2**112 (see above).
    ``out_layout``: the pairs written in another layout (see :func:`_rotate_numpy_block`)."""
    pi32 = p.view(np.int32)
    heads = []
    h0 = 0
    for x in xs:
        h1 = h0 + x.shape[2]
        heads.append(slice(h0, h1))
        np.copyto(pi32[:, :, h0:h1], x[..., :rotary_dim].view(np.int16))
        h0 = h1
    pf = p.reshape(-1)
    np.left_shift(pi32, 13, out=pi32)
    np.bitwise_and(pi32, _F16_IN_MASK, out=pi32)
    if _MAX(pf) >= _F16_SPECIAL_IN or _MIN(pf) <= -_F16_SPECIAL_IN:
        return False                                     # inf/NaN in the block: NumPy's casts
    np.multiply(p, s2, out=q)
    np.multiply(p, c2, out=p)
    _pairswap_add(p, q, rotary_dim, layout)              # p = y
    if not _f16_round_bits(p, q, t, floor):
        return False
    pi = p.view(np.uint32)
    for x, out, hs in zip(xs, outs, heads):
        if out_layout is None:
            np.copyto(out[..., :rotary_dim].view(np.uint16), pi[:, :, hs], casting="unsafe")
        else:
            _write_pairs(out[..., :rotary_dim].view(np.uint16), pi[:, :, hs], rotary_dim, layout, out_layout)
    return True


def _block_list(B, S, tokens_per_block):
    """(b0, b1, s0, s1) blocks: whole batch rows when sequences are short (decode), else runs of one row."""
    if S <= tokens_per_block:
        rows = max(1, tokens_per_block // max(S, 1))
        return [(b0, min(B, b0 + rows), 0, S) for b0 in range(0, B, rows)]
    return [(b, b + 1, s0, min(S, s0 + tokens_per_block)) for b in range(B) for s0 in range(0, S, tokens_per_block)]


def _rotate_numpy(items, cos_tok, sin_tok, rotary_dim, layout, out_layout=None):
    """Rotate every ``(x, out)`` of items ((B, S, H, D) NumPy arrays, same B, S and D, any H) with
    cos_tok/sin_tok (Bp, S, 1, half) in the work dtype, token block by token block; the items of a
    block share its tables, and fp16 items share one set of buffers (one pass per step for all).
    ``out_layout``: None, or the other pair layout, which the outputs are written in."""
    items = [(x, out) for x, out in items if x.size]   # nothing to do for an empty item (H = 0 included)
    if not items:
        return
    B, S = items[0][0].shape[:2]
    for x, out in items:
        if out is not x and x.shape[-1] > rotary_dim:
            out[..., rotary_dim:] = x[..., rotary_dim:]
    work = cos_tok.dtype
    f16 = [(x, out) for x, out in items if x.dtype == np.float16] if work == np.float32 else []
    if f16 and not (_f16_bit_path_ok() and float(np.abs(cos_tok).max(initial=0.0)) < 2.0 ** 15
                    and float(np.abs(sin_tok).max(initial=0.0)) < 2.0 ** 15):
        f16 = []
    other = [(x, out) for x, out in items if not any(x is y for y, _ in f16)]
    h16 = sum(x.shape[2] for x, _ in f16)
    hmax = max([h16] + [x.shape[2] for x, _ in other])
    tokens_per_block = max(1, BLOCK_BYTES // max(1, hmax * rotary_dim * np.dtype(work).itemsize))
    blocks = _block_list(B, S, tokens_per_block)
    nb, ns = max(b1 - b0 for b0, b1, _, _ in blocks), max(s1 - s0 for _, _, s0, s1 in blocks)
    bp = cos_tok.shape[0]
    nbp = nb if bp > 1 else 1
    tab = np.empty((2, 2, nbp, ns, 1, rotary_dim), dtype=work)
    size = nb * ns * hmax * rotary_dim
    bufs = [np.empty(size, dtype=work) for _ in range(3 if f16 else 2)]
    floor = np.full(size, _F16_MIN_SPACING_M, dtype=work) if f16 else None

    def shaped(buf, n_b, n_s, h):
        return buf[:n_b * n_s * h * rotary_dim].reshape(n_b, n_s, h, rotary_dim)

    for b0, b1, s0, s1 in blocks:
        n_b, n_s = b1 - b0, s1 - s0
        cb = slice(b0, b1) if bp > 1 else slice(0, 1)
        c_blk, s_blk = cos_tok[cb, s0:s1], sin_tok[cb, s0:s1]
        m = c_blk.shape[0]
        fallback = []
        if f16:
            c2, s2 = _block_tables(c_blk, s_blk, rotary_dim, layout, _F16_SCALE, tab[1, 0, :m, :n_s], tab[1, 1, :m, :n_s])
            xs = [x[b0:b1, s0:s1] for x, _ in f16]
            outs = [out[b0:b1, s0:s1] for _, out in f16]
            if not _rotate_f16_group(xs, outs, c2, s2, rotary_dim, layout,
                                     *(shaped(buf, n_b, n_s, h16) for buf in bufs), shaped(floor, n_b, n_s, h16),
                                     out_layout):
                fallback = f16
        if other or fallback:
            c2, s2 = _block_tables(c_blk, s_blk, rotary_dim, layout, 1.0, tab[0, 0, :m, :n_s], tab[0, 1, :m, :n_s])
            for x, out in other + fallback:
                h = x.shape[2]
                _rotate_numpy_block(x[b0:b1, s0:s1], out[b0:b1, s0:s1], c2, s2, rotary_dim, layout,
                                    shaped(bufs[0], n_b, n_s, h), shaped(bufs[1], n_b, n_s, h), out_layout)


def rotate(items, cos, sin, rows, *, rotary_dim, layout, inverse, out_layout=None):
    """Rotate every ``(x, out)`` of ``items``; see ``rotary.backends`` for the contract (``out_layout``: the
    outputs' pair layout, None: ``layout``)."""
    if out_layout == layout:
        out_layout = None
    results = []
    xp = array_namespace(items[0][0])
    gathered = {}
    numpy_items = []
    for x, out in items:
        work = _compute_dtype(x.dtype, xp)
        if work not in gathered:
            gathered[work] = gather_rows(xp, cos, sin, rows, work, inverse)
        cos_tok, sin_tok = gathered[work]
        if is_numpy_array(x):
            if out is None:
                out = np.empty(x.shape, dtype=x.dtype)
            numpy_items.append((x, out))
            results.append(out)
        else:
            y = _rotate_xp(xp, x, cos_tok, sin_tok, rotary_dim, layout, out_layout=out_layout)
            if out is not None:
                out[...] = y
                y = out
            results.append(y)
    by_work = {}
    for x, out in numpy_items:
        by_work.setdefault(_compute_dtype(x.dtype, xp), []).append((x, out))
    for work, group in by_work.items():
        _rotate_numpy(group, *gathered[work], rotary_dim, layout, out_layout)
    return results

