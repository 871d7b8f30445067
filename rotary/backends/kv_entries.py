"""KV-cache entries in plain array-API code: the reference append (rotate, quantize, write) and dequantization.

A cache holds, per slot (one token of one sequence) and k/v head, a rotated key and a value, each either
in the cache's float dtype or quantized with one scale per (token, head):

    w      = the rotated key (the value) in the work dtype (float32; float64 for float64 caches)
    amax   = max_d |w_d|,  scale = amax / LIMIT  (LIMIT 127 for "int8", 448 for "float8_e4m3")
    entry  = Q(w / scale) if scale > 0 else Q(w)     Q: round half to even, clipped to +-127 (int8);
                                                      round to nearest even float8_e4m3fn (stored as its bits)
    w'     = entry * scale                            (dequantized, work dtype; then the cache's dtype)

Rotation of pair (a, b) with the token's table row (c, s): ``y_a = x_a c - x_b s``, ``y_b = x_b c + x_a s``
(one multiply and one add per term, as every backend rounds it). Coordinates before ``offset`` and from
``offset + rotary_dim`` on pass through unrotated.

:func:`append_kv` and :func:`paged_attention` are the primitives of the NumPy backend and the references the
kernels of the other backends are tested against (see :mod:`rotary.backends` for the contract).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .array_api import rotate_pairs

class KVFormat(NamedTuple):
    """One KV entry format: what every backend, kernel and test reads of it (the rows of :data:`KV_FORMATS`)."""

    #: the ``kv_dtype`` that names it (None: entries in the cache's float dtype)
    name: str | None
    #: the kernels' code for it (the KIND template argument of kv_cache.cu, the Numba kernels' ``kind``)
    code: int
    #: NumPy dtype name of the stored entries (None: the cache's float dtype; float8 stored as its uint8 bits)
    entry: str | None
    #: the largest magnitude an entry represents (``scale = amax / limit``); None: unquantized
    limit: float | None
    #: quantized from float32 work values only (no float64 caches)
    fp32_work_only: bool
    #: bound on |dequantized - work value| / amax of its (token, head) row: int8 rounds to half a step of
    #: amax / 127; float8_e4m3 to 2^-4 of the value (3 mantissa bits), subnormals to 2^-10 scale
    rel_error: float


#: every KV entry format, by kv_dtype: the one table backends, kernels, frontend and tests read
KV_FORMATS = {
    None: KVFormat(None, 0, None, None, False, 0.0),
    "int8": KVFormat("int8", 1, "int8", 127.0, False, 0.5 / 127.0),
    "float8_e4m3": KVFormat("float8_e4m3", 2, "uint8", 448.0, True, 2.0 ** -4),
}
#: the quantized formats and the largest magnitude each represents
KV_LIMITS = {name: f.limit for name, f in KV_FORMATS.items() if f.limit is not None}


def kv_format(kv_dtype, name="kv_dtype") -> KVFormat:
    """The :class:`KVFormat` of ``kv_dtype``; ValueError naming the argument for an unknown one."""
    try:
        return KV_FORMATS[kv_dtype]
    except (KeyError, TypeError):
        raise ValueError(f"{name} must be one of {tuple(KV_FORMATS)}, got {kv_dtype!r}") from None


def entry_dtype(kv_dtype, dtype) -> np.dtype:
    """The dtype of stored entries of format ``kv_dtype`` for float dtype ``dtype`` (the cache's)."""
    entry = kv_format(kv_dtype).entry
    return np.dtype(dtype) if entry is None else np.dtype(entry)


def _fp8_decode_table() -> np.ndarray:
    """float32 value of each of the 256 float8_e4m3fn bit patterns (sign, 4 exponent bits with bias 7,
    3 mantissa bits, no infinities, NaN at S.1111.111): ``m 2^-9`` for exponent 0, else ``(8 + m) 2^(e - 10)``."""
    bits = np.arange(256)
    e, m = (bits >> 3) & 15, bits & 7
    mag = np.where(e == 0, m * 2.0 ** -9, (8 + m) * np.exp2(e - 10.0))
    mag = np.where((e == 15) & (m == 7), np.nan, mag)
    return np.where(bits >> 7, -mag, mag).astype(np.float32)


FP8_VALUES = _fp8_decode_table()


def fp8_encode(w: np.ndarray) -> np.ndarray:
    """uint8 bits of float8_e4m3fn nearest to ``w`` (host, through ml_dtypes: round to nearest even)."""
    try:
        import ml_dtypes
    except ImportError as exc:   # pragma: no cover - ml_dtypes comes with the bf16 extra
        raise ImportError("kv_dtype='float8_e4m3' on host arrays needs ml_dtypes: pip install 'rotary[bf16]'") from exc
    if w.dtype != np.float32:
        raise TypeError("float8_e4m3 entries are quantized from float32 work values")
    return w.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def quantize(xp, w, kv_dtype):
    """(entries, scales) of work values ``w`` (..., d) for ``kv_dtype`` "int8" or "float8_e4m3" (see the module
    docstring); scales (...) in w's dtype."""
    amax = xp.max(xp.abs(w), axis=-1)
    scale = amax / KV_LIMITS[kv_dtype]
    safe = xp.where(scale > 0, scale, xp.ones_like(scale))
    y = w / safe[..., None]
    if kv_dtype == "int8":
        return xp.astype(xp.clip(xp.round(y), -127.0, 127.0), xp.int8), scale
    return xp.asarray(fp8_encode(np.asarray(y))), scale


def dequantize(xp, entries, scales, kv_dtype, work):
    """Work-dtype values of quantized ``entries`` (..., d) with their ``scales`` (...)."""
    if kv_dtype == "float8_e4m3":
        values = xp.take(xp.asarray(FP8_VALUES), xp.reshape(xp.astype(entries, xp.int64), (-1,)), axis=0)
        values = xp.reshape(values, entries.shape)
    else:
        values = entries
    return xp.astype(values, work) * xp.astype(scales, work)[..., None]


def rotate_work(xp, x, cos_tok, sin_tok, rotary_dim, layout, offset, work):
    """x (..., d) rotated in the work dtype (not rounded back to x's dtype); cos_tok/sin_tok broadcast against
    x[..., :rotary_dim // 2]."""
    w = xp.astype(x, work)
    rotated = rotate_pairs(xp, w[..., offset:offset + rotary_dim], cos_tok, sin_tok, layout)
    return xp.concat([w[..., :offset], rotated, w[..., offset + rotary_dim:]], axis=-1)


def rms_norm_work(xp, x, norm, work):
    """x (..., d) in the work dtype, each head normed when ``norm = (weight, eps)`` is given (per-head RMSNorm,
    Qwen3's / Gemma 3's q_norm and k_norm): ``y_j = (x_j * inv) * weight_j``, ``inv = 1 / sqrt(sum_j x_j^2 / d +
    eps)``, all in the work dtype (not rounded to x's dtype)."""
    w = xp.astype(x, work)
    if norm is None:
        return w
    weight, eps = norm
    d = int(x.shape[-1])
    inv = 1.0 / xp.sqrt(xp.sum(w * w, axis=-1, keepdims=True) / d + eps)
    return (w * inv) * xp.astype(weight, work)


def append_kv(k, v, cos, sin, rows, slots, stores, *, rotary_dim, layout, offset, kv_dtype, norm=None):
    """Normalize each key head when ``norm = (weight, eps)`` is given (:func:`rms_norm_work`), rotate k at its table
    rows, quantize k and v (``kv_dtype`` None: cast), and write them into their slots (the backend contract in
    :mod:`rotary.backends`)."""
    from array_api_compat import array_namespace

    xp = array_namespace(k)
    k_store, v_store, k_scale, v_scale = stores
    work = xp.float64 if cos.dtype == xp.float64 else xp.float32
    kept = slots >= 0
    if not bool(xp.all(kept)):   # padding tokens (slot -1): neither read nor written
        kept = xp.nonzero(kept)[0]
        k, v, rows, slots = (xp.take(a, kept, axis=0) for a in (k, v, rows, slots))
    cos_tok = xp.astype(xp.take(cos, rows, axis=0), work)[:, None, :]
    sin_tok = xp.astype(xp.take(sin, rows, axis=0), work)[:, None, :]
    wk = rotate_work(xp, rms_norm_work(xp, k, norm, work), cos_tok, sin_tok, rotary_dim, layout, offset, work)
    if kv_dtype is None:
        k_store[slots, ...] = xp.astype(wk, k_store.dtype)
        v_store[slots, ...] = xp.astype(v, v_store.dtype)
        return
    entries, scales = quantize(xp, wk, kv_dtype)
    k_store[slots, ...] = entries
    k_scale[slots, ...] = scales
    entries, scales = quantize(xp, xp.astype(v, work), kv_dtype)
    v_store[slots, ...] = entries
    v_scale[slots, ...] = scales


def _host(a) -> np.ndarray:
    """A host int64 copy of a small table (NumPy, CuPy or any array-API array)."""
    get = getattr(a, "get", None)
    return np.asarray(get() if callable(get) and not isinstance(a, np.ndarray) else a, dtype=np.int64)


def gather_entries(stores, which, slots, kv_format, work):
    """Entries of ``slots`` from store ``which`` (0 keys, 1 values) as work-dtype values (dequantized)."""
    from array_api_compat import array_namespace

    store, scale = stores[which], stores[which + 2]
    xp = array_namespace(store)
    entries = xp.take(store, slots, axis=0)
    if kv_format.limit is None:
        return xp.astype(entries, work)
    return dequantize(xp, entries, xp.take(scale, slots, axis=0), kv_format.name, work)


def paged_attention(q, stores, block_table, page_size, seq_lens, q_starts, *, scale, softcap, window, causal,
                    kv_dtype, rotation=None, norm=None):
    """Attention of packed q over pages (the backend contract in :mod:`rotary.backends`): q normed per head when
    ``norm = (weight, eps)`` is given (:func:`rms_norm_work`), then rotated in the work dtype
    at its table rows when ``rotation = (cos, sin, rows, rotary_dim, layout, offset)`` is given, each sequence's keys
    and values gathered through its block table, dequantized to the work dtype, then the online-softmax engine
    (:func:`rotary.backends.online_softmax.blocked_attention`) with a packed mask."""
    from array_api_compat import array_namespace, is_numpy_array

    from .online_softmax import Mask, blocked_attention

    xp = array_namespace(q)
    fmt = KV_FORMATS[kv_dtype]
    lens, table, starts = _host(seq_lens), _host(block_table), _host(q_starts)
    counts = np.diff(starts)
    n = lens.size
    work = xp.float64 if q.dtype == xp.float64 else xp.float32
    dtype, scratch = q.dtype, False
    if norm is not None:
        q, scratch = rms_norm_work(xp, q, norm, work), True
    if rotation is not None:
        cos, sin, rows, rotary_dim, layout, offset = rotation
        cos_tok = xp.astype(xp.take(cos, rows, axis=0), work)[:, None, :]
        sin_tok = xp.astype(xp.take(sin, rows, axis=0), work)[:, None, :]
        q, scratch = rotate_work(xp, q, cos_tok, sin_tok, rotary_dim, layout, offset, work), True
    first = np.zeros(n, np.int64)   # keys before every query's window are not read (their pages may be gone)
    if causal and window is not None:
        first = np.clip(lens - counts - window + 1, 0, None)
    held = lens - first
    k_seq = np.repeat(np.arange(n, dtype=np.int64), held)
    k_pos = np.arange(k_seq.size, dtype=np.int64) + np.repeat(first - (np.cumsum(held) - held), held)
    slots = table[k_seq, k_pos // page_size] * page_size + k_pos % page_size
    q_seq = np.repeat(np.arange(n, dtype=np.int64), counts)
    q_pos = np.arange(q_seq.size, dtype=np.int64) + np.repeat(lens - counts - starts[:-1], counts)
    idx = xp.asarray(slots) if is_numpy_array(q) else xp.asarray(slots, device=getattr(q, "device", None))
    keys, values = (gather_entries(stores, which, idx, fmt, work) for which in (0, 1))
    hq, hk = int(q.shape[1]), int(stores[0].shape[1])
    mask = Mask(q_pos[None], k_pos[None], q_seq, k_seq, bool(causal), window)
    tiles = is_numpy_array(q) and q_seq.size * hq * k_seq.size >= 1 << 20
    o = blocked_attention(xp, q, keys, values, 0, 1 if hq != hk else None, mask, scale, softcap, 512,
                          numpy_tiles=tiles, q_is_scratch=scratch)
    return o if o.dtype == dtype else xp.astype(o, dtype)
