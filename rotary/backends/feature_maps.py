"""Linear attention's feature maps phi, defined once: names, kernel codes, and the reference bits.

``NAMES`` are the public names, ``CODES`` the integers the Numba and CUDA kernels take. Every backend
computes these bits exactly (tests/test_feature_maps.py):

* ``identity`` (0): phi(x) = x.
* ``elu`` (1), elu(x) + 1: x + 1 if x > 0; x itself if x is NaN (same bits); +0.0 if x < LO
  (LO = -87 float32, -708 float64, so phi(-inf) = +0.0); else exp(x) by :func:`exp_ref`.
* ``relu`` (2): x if x > 0; x itself if x is NaN (same bits); else +0.0 (relu(-0.0) = relu(-inf) = +0.0).

exp(x), one algorithm for every backend (Cephes expf; float64 the same scheme with a longer polynomial),
each operation rounded separately in the work dtype (no FMA contraction, no fast math)::

    c = min(max(x, LO), HI)            (NaN stays NaN; LO, HI = -87, 88 float32, -708, 709 float64)
    n = floor(c * log2(e) + 0.5)
    r = (c - n * L1) + n * L2          (ln 2 = L1 - L2: L1 = 0.693359375, L2 = 2.12194440e-4 float32;
                                        L1 = 0.693145751953125, L2 = -1.42860682030941723212e-6 float64)
    p = P[0] * r + P[1]; p = p * r + P[k] for the rest of P  (Horner)
    p = (p * (r * r) + r) + 1
    exp = p * 2**n                     (2**n from its exponent bits; n in [-126, 127] / [-1021, 1023])

P float32 (Cephes): 1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1,
5.0000001201e-1, within 2 ulp on [-87, 0]. P float64: 1/13!, 1/12!, ..., 1/2! (Taylor, |r| <= ln2/2,
truncation < 1e-17), within 2 ulp on [-708, 0]. Constants are the nearest values of the work dtype.
"""

from __future__ import annotations

import math

import numpy as np

NAMES = ("elu", "relu", "identity")
CODES = {"identity": 0, "elu": 1, "relu": 2}

#: per work dtype: (LO, HI, log2e, L1, L2, P) as Python floats (round to the dtype to use them)
EXP_CONSTANTS = {
    "float32": (-87.0, 88.0, 1.44269504088896341, 0.693359375, 2.12194440e-4,
                (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1,
                 5.0000001201e-1)),
    "float64": (-708.0, 709.0, 1.44269504088896341, 0.693145751953125, -1.42860682030941723212e-6,
                tuple(1.0 / math.factorial(k) for k in range(13, 1, -1))),
}
_EXPONENT = {"float32": (np.int32, 127, 23), "float64": (np.int64, 1023, 52)}


def check_name(name):
    """Raise ValueError unless ``name`` is one of NAMES."""
    if not (isinstance(name, str) and name in NAMES):
        raise ValueError(f"feature_map must be one of {NAMES}, got {name!r}")


def _work_name(dtype):
    dtype = np.dtype(dtype)
    if dtype not in (np.float32, np.float64):
        raise TypeError(f"feature maps take float32 or float64, got {dtype}")
    return dtype.name


_BLOCK_BYTES = 1 << 17     # exp's temporaries per block: cache-sized (a third of the time of whole-array passes)


def _exp_blocks(x, out, upper, add_relu):
    """out = exp(clip(x, LO, upper)) (+ max(x, 0) if ``add_relu``), by the algorithm above, block by block.
    x, out: C-contiguous, same shape and float dtype; out may be x. 2**n by np.ldexp (exact scaling, one
    rounding: the same bits as the product with 2**n's exponent bits)."""
    t = x.dtype.type
    lo, hi, log2e, l1, l2, poly = EXP_CONSTANTS[_work_name(x.dtype)]
    xf, of = x.reshape(-1), out.reshape(-1)
    block = max(1, _BLOCK_BYTES // x.dtype.itemsize)
    c, n, r, p = (np.empty(min(block, xf.size), x.dtype) for _ in range(4))
    k = np.empty(c.shape, np.int32)
    with np.errstate(invalid="ignore", over="ignore", under="ignore"):
        for i in range(0, xf.size, block):
            xb, ob = xf[i:i + block], of[i:i + block]
            m = xb.size
            cb, nb, rb, pb, kb = c[:m], n[:m], r[:m], p[:m], k[:m]
            np.clip(xb, t(lo), t(upper), out=cb)
            np.multiply(cb, t(log2e), out=nb)
            nb += t(0.5)
            np.floor(nb, out=nb)
            np.multiply(nb, t(l1), out=rb)
            np.subtract(cb, rb, out=rb)
            np.multiply(nb, t(l2), out=cb)
            rb += cb
            np.multiply(rb, t(poly[0]), out=pb)
            pb += t(poly[1])
            for coefficient in poly[2:]:
                pb *= rb
                pb += t(coefficient)
            np.multiply(rb, rb, out=cb)
            pb *= cb
            pb += rb
            pb += t(1.0)
            kb[...] = nb                    # NaN: any integer (p is NaN)
            if add_relu:
                np.maximum(xb, t(0.0), out=cb)
                np.ldexp(pb, kb, out=pb)
                np.add(pb, cb, out=ob)
            else:
                np.ldexp(pb, kb, out=ob)
    return out


def _contiguous(fn, x, out, *args):
    if x.flags.c_contiguous and out.flags.c_contiguous:
        return fn(x, out, *args)
    np.copyto(out, fn(np.ascontiguousarray(x), np.empty(x.shape, x.dtype), *args))
    return out


def exp_ref(x, out=None):
    """exp(x) of a float32 / float64 NumPy array by the algorithm above (the bits of every backend), no
    flush below LO (there it is exp(LO)); NaN in, NaN out."""
    x = np.asarray(x)
    hi = EXP_CONSTANTS[_work_name(x.dtype)][1]
    return _contiguous(_exp_blocks, x, np.empty_like(x) if out is None else out, hi, False)


def feature_map(x, name, out=None):
    """phi(x) of a float32 / float64 NumPy array (the reference bits, module docstring); into ``out`` if
    given (``out`` may be ``x``). Branch-free array operations (NumPy's masked copies are slow on random
    masks): relu = max(x, 0) + 0 (the + 0 makes -0.0 +0.0), elu + 1 = exp(min(x, 0)) + max(x, 0) (exp(0) is
    exactly 1, exp(x) + 0 is exp(x)); then the few x < LO set to +0.0 and NaNs copied from x (their bits)."""
    check_name(name)
    x = np.asarray(x)
    t = x.dtype.type
    lo = EXP_CONSTANTS[_work_name(x.dtype)][0]
    if out is None:
        out = np.empty_like(x)
    if name == "identity":
        if out is not x:
            np.copyto(out, x)
        return out
    nan = np.isnan(x)
    nan, nans = (nan, x[nan]) if nan.any() else (None, None)    # x[nan]: a copy (out may be x)
    below = None
    if name == "elu":
        below = x < t(lo)
        below = below if below.any() else None
        _contiguous(_exp_blocks, x, out, 0.0, True)
    else:
        with np.errstate(invalid="ignore"):     # a signalling NaN (restored below)
            np.maximum(x, t(0.0), out=out)
            out += t(0.0)
    if below is not None:
        out[below] = t(0.0)
    if nan is not None:
        out[nan] = nans
    return out


def feature_map_xp(xp, x, name):
    """phi(x) for any array-API namespace, functional (no in-place writes), the same bits as
    :func:`feature_map` (2**n from an exact table of powers of two instead of exponent bits)."""
    check_name(name)
    if name == "identity":
        return x
    dtype = x.dtype
    name64 = "float64" if dtype == xp.float64 else "float32"
    zero = xp.asarray(0.0, dtype=dtype)
    nan = xp.isnan(x)
    if name == "relu":
        return xp.where((x > zero) | nan, x, zero)
    x0 = x
    x = xp.where(nan, zero, x)      # no arithmetic on NaNs (a signalling one would warn); restored at the end
    lo, hi, log2e, l1, l2, poly = EXP_CONSTANTS[name64]
    rnd = np.float64 if name64 == "float64" else np.float32

    def k(v):
        return xp.asarray(float(rnd(v)), dtype=dtype)

    c = xp.where(x < k(lo), k(lo), x)
    c = xp.where(c > k(hi), k(hi), c)
    n = xp.floor(c * k(log2e) + k(0.5))
    r = (c - n * k(l1)) + n * k(l2)
    p = k(poly[0]) * r + k(poly[1])
    for coefficient in poly[2:]:
        p = p * r + k(coefficient)
    p = (p * (r * r) + r) + k(1.0)
    first, last = (-126, 127) if name64 == "float32" else (-1022, 1023)   # n's range after the clamp
    powers = xp.asarray([2.0 ** j for j in range(first, last + 1)], dtype=dtype)
    idx = xp.astype(n, xp.int32) - first   # n in [first, last]: int32 holds it (JAX without x64 has no int64)
    shape = idx.shape
    scale = xp.reshape(xp.take(powers, xp.reshape(idx, (-1,)), axis=0), shape)
    e = xp.where(x < k(lo), zero, p * scale)
    return xp.where(x > zero, x + k(1.0), xp.where(nan, x0, e))
