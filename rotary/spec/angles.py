"""Exact rotation angles: ``(c * w) mod 2*pi`` for float64 coordinates c and frequencies w.

A float64 product ``c * w`` is off by up to ``|c w| * 2**-53`` (6e-8 rad at c = 2**31), which
float64 data would see. Here the angle is formed in turns, ``t = c * w / (2 pi)``, in double-double
arithmetic (Dekker's two-product with Veltkamp splitting; no FMA needed):

- per frequency (once, d/2 values): ``v = w / (2 pi)`` as ``vh + vl`` (2 pi as three doubles);
- ``c * vh = a + b`` exactly (two-product), ``a - rint(a)`` exactly, plus ``b + c * vl``;
- the fraction ``f`` in [-1/2, 1/2] (double-double) times ``2 pi`` (double-double) rounded once.

The angle lands in [-pi, pi] with an error of about one ulp of pi (< 2.5e-16 rad measured against
mpmath at coordinates up to 2**53 - 1 with w <= 1): it is exact to float64 at any coordinate
representable in float64 (integers below 2**53; larger int64 positions are first rounded to float64).
"""

from __future__ import annotations

import numpy as np

#: 2 pi = _C1 + _C2 + _C3 (each the float64 nearest the remainder)
_C1, _C2, _C3 = 6.283185307179586, 2.4492935982947064e-16, -5.989539619436679e-33
_SPLITTER = 134217729.0   # 2**27 + 1: Veltkamp splitting of a double into two 26-bit halves


def _split(a):
    """(hi, lo) with hi + lo == a exactly and hi, lo of at most 26 significant bits each."""
    c = _SPLITTER * a
    hi = c - (c - a)
    return hi, a - hi


_C1H, _C1L = _split(_C1)


def turns(w) -> tuple:
    """Per-frequency constants of :func:`reduced_angles`: ``w / (2 pi)`` as (vh, vl), vh's halves, w."""
    w = np.asarray(w, dtype=np.float64)
    vh = w / _C1
    ph = vh * _C1                           # two-product vh * C1 = ph + pl
    vhh, vhl = _split(vh)
    pl = ((vhh * _C1H - ph) + vhh * _C1L + vhl * _C1H) + vhl * _C1L
    vl = ((w - ph) - pl - vh * _C2 - vh * _C3) / _C1   # w - ph is exact (Sterbenz)
    return vh, vl, vhh, vhl, w


def reduced_angles(coordinates, freq_turns) -> np.ndarray:
    """float64 ``coordinates * w`` reduced to [-pi, pi] (see module docstring); ``coordinates``
    (integer or float array) broadcasts against the frequencies, ``freq_turns = turns(w)``."""
    vh, vl, vhh, vhl = freq_turns[:4]
    c_in = np.asarray(coordinates)
    c = c_in.astype(np.float64, copy=False)
    a = c * vh                              # two-product c * vh = a + b
    if c_in.dtype.kind in "iub" and (c.size == 0 or (c.max() < 2**26 and c.min() > -2**26)):
        b = c * vhh                         # c has <= 26 bits: c * vhh and c * vhl are exact
        b -= a
        b += c * vhl
    else:
        ch, cl = _split(c)
        b = ch * vhh
        b -= a
        b += ch * vhl
        b += cl * vhh
        b += cl * vhl
    b += c * vl                             # the low part of the turns: b + c vl
    t = np.rint(a)
    np.subtract(a, t, out=t)                # a - rint(a), exact, in [-1/2, 1/2]
    s = t + b                               # two-sum t + b = s + e
    bb = s - t
    e = s - bb
    np.subtract(t, e, out=e)
    np.subtract(b, bb, out=bb)
    e += bb
    s -= np.rint(s)                         # exact: s in [-1/2, 1/2]
    sh, sl = _split(s)                      # angle = (s + e) * 2 pi, rounded once
    hi = s * _C1
    lo = sh * _C1H
    lo -= hi
    lo += sh * _C1L
    lo += sl * _C1H
    lo += sl * _C1L
    lo += s * _C2
    lo += e * _C1
    hi += lo
    return hi


#: elements per block of :func:`cos_sin` (temporaries stay in cache and need no fresh pages)
_BLOCK = 1 << 15


def cos_sin(coordinates, freq_turns, scale: float, dtype) -> tuple:
    """``(cos, sin)`` of :func:`reduced_angles` times ``scale``, cast to ``dtype``: shape
    ``coordinates.shape[:-1] + (d/2,)``, computed in blocks of rows.

    Tables of 4 bytes or less whose angles stay below 2**22 rad take the plain float64 product,
    reduced by ``rint`` (error < 2**22 * 2**-52 = 1e-9 rad, far below a float32 ulp); all others
    take the exact angles.
    """
    coordinates = np.asarray(coordinates)
    dtype = np.dtype(dtype)
    half = freq_turns[0].shape[-1]
    lead = coordinates.shape[:-1]
    flat = coordinates.reshape(-1, coordinates.shape[-1])
    n = flat.shape[0]
    cos, sin = np.empty((n, half), dtype), np.empty((n, half), dtype)
    if n == 0:
        return cos.reshape(lead + (half,)), sin.reshape(lead + (half,))
    fast = None
    if dtype.itemsize <= 4:
        w = freq_turns[4]
        bound = float(np.max(np.abs(flat))) * float(np.max(np.abs(w), initial=0.0))
        fast = w if bound < 2.0**22 else None
    step = max(1, _BLOCK // max(half, 1))
    for start in range(0, n, step):
        block = flat[start:start + step]
        if fast is None:
            theta = reduced_angles(block, freq_turns)
        else:
            theta = block * fast
            k = theta * (1.0 / _C1)
            np.rint(k, out=k)
            theta -= k * _C1
        for fn, dest in ((np.cos, cos), (np.sin, sin)):
            v = fn(theta)
            if scale != 1.0:
                v *= scale
            dest[start:start + step] = v
    return cos.reshape(lead + (half,)), sin.reshape(lead + (half,))
