"""cos/sin tables: made from the spec in float64, cached per (spec, frequencies, dtype, device).

The frontend asks ``lookup(spec, positions, dtype=..., device_key=..., convert=...)`` and gets
``(cos, sin, rows)``: tables of shape (R, rotary_dim//2) in the backend's array type and the row of
each token, shape positions.shape, int64. Kinds of table:

- dense: rows 0..R-1 hold positions 0..R-1. Grown (doubled) as larger positions arrive and
  shared by every call with the same key. Used for positions near 0 (a call whose positions start
  within a few spans of 0, that the dense table already covers, or that lie below twice its rows:
  a decode stream that walks past the table's end doubles it, once per doubling of its positions).
- window: rows 0..2W-1 hold positions base..base+2W-1, with W the call's span rounded up to a power
  of two (>= 256) and base a multiple of W, so any span of W positions fits one window. Used for
  positions far from 0 (long-context prefill at an offset, decoding past the dense table): cached
  like the dense table, so repeated calls there cost what calls near 0 cost; rows = positions - base.
- compact: one row per distinct position of this call (negative positions, spans too wide for a
  window, and dynamic-NTK lengths past the model's context, whose frequencies change with the length).
- per-token (multi-axis specs, positions ``(..., n_axes)``): one row per token, pair i taken from
  the row of the coordinate it reads, ``cos[t, i] = dense[pos[t, pair_axes[i]], i]`` (gathered from
  the dense table when every coordinate fits it, else computed directly; always directly for
  real-valued coordinates). Backends see the same (table, rows) contract.

Cache keys hold the spec itself and the exact frequencies used, so two specs never share an
entry. The cache is bounded by bytes (least recently used first out): 256 MiB unless the
environment variable ``ROTARY_TABLE_CACHE_BYTES`` or ``rotary.set_table_cache_limit(nbytes)`` says
otherwise; ``rotary.table_cache_info()`` reports it. A table larger than the whole limit is still made
for its call, just not kept. The cache is guarded by a lock (safe from several threads); tables are
read-only.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections import OrderedDict
from functools import lru_cache

import numpy as np

from .rope_spec import RopeSpec, _inv_freq_and_scaling

#: Largest dense or window table, in bytes (cos + sin); past it a compact table is made per call.
DENSE_TABLE_MAX_BYTES = 64 * 2**20
_MIN_ROWS = 256
#: Positions below this always use the dense table (grown as needed): the common case stays one table.
_DENSE_ALWAYS_BELOW = 4096
_DEFAULT_LIMIT = 256 * 2**20
_ENV_LIMIT = "ROTARY_TABLE_CACHE_BYTES"


def _check_limit(nbytes, name):
    if isinstance(nbytes, (bool, np.bool_)) or not isinstance(nbytes, (int, np.integer)):
        raise TypeError(f"{name} must be an int number of bytes >= 0, got {nbytes!r}")
    if nbytes < 0:
        raise ValueError(f"{name} must be >= 0 bytes, got {nbytes}")
    return int(nbytes)


def _limit_from_environment() -> int:
    raw = os.environ.get(_ENV_LIMIT)
    if raw is None or not raw.strip():
        return _DEFAULT_LIMIT
    try:
        value = int(raw.strip())
    except ValueError:
        raise ValueError(f"environment variable {_ENV_LIMIT} must be an int number of bytes >= 0, "
                         f"got {raw!r}") from None
    return _check_limit(value, _ENV_LIMIT)


_lock = threading.RLock()
#: key -> (value, nbytes), least recently used first
_cache: OrderedDict = OrderedDict()
_state = {"bytes": 0, "limit": None, "hits": 0, "misses": 0}


def _limit() -> int:
    if _state["limit"] is None:
        _state["limit"] = _limit_from_environment()
    return _state["limit"]


def _cache_get(key):
    """The cached value of ``key`` (marked recently used), or None. Call with _lock held."""
    item = _cache.get(key)
    if item is None:
        return None
    _cache.move_to_end(key)
    return item[0]


def _cache_put(key, value, nbytes: int) -> None:
    """Keep ``value`` under ``key`` and evict least recently used entries past the byte limit. Call
    with _lock held."""
    old = _cache.pop(key, None)
    if old is not None:
        _state["bytes"] -= old[1]
    _cache[key] = (value, nbytes)
    _state["bytes"] += nbytes
    _evict(_limit())


def _evict(limit: int) -> None:
    while _cache and _state["bytes"] > limit:
        _, (_, nbytes) = _cache.popitem(last=False)
        _state["bytes"] -= nbytes


def _nbytes(*arrays) -> int:
    return int(sum(int(getattr(a, "nbytes", 0)) for a in arrays))


def set_table_cache_limit(nbytes: int) -> int:
    """Bound the cos/sin table cache to ``nbytes`` bytes (0 keeps nothing); returns the previous limit.

    Least recently used tables are dropped first. The default is 256 MiB, or the environment
    variable ``ROTARY_TABLE_CACHE_BYTES`` when set.
    """
    nbytes = _check_limit(nbytes, "nbytes")
    with _lock:
        previous = _limit()
        _state["limit"] = nbytes
        _evict(nbytes)
    return previous


def table_cache_info() -> dict:
    """``{"entries", "bytes", "limit", "hits", "misses"}`` of the cos/sin table cache (misses: tables
    made because no cached one covered a call's positions)."""
    with _lock:
        return {"entries": len(_cache), "bytes": _state["bytes"], "limit": _limit(),
                "hits": _state["hits"], "misses": _state["misses"]}


def _make(spec: RopeSpec, positions: np.ndarray, seq_len, dtype):
    """Per-position rows: every pair's cos/sin at each of ``positions`` (1-D), shape (n, d/2)."""
    cos, sin = spec.pair_cos_sin(positions[:, None], seq_len=seq_len, dtype=dtype)
    return np.ascontiguousarray(cos), np.ascontiguousarray(sin)


@lru_cache(maxsize=256)
def _axis_columns(pair_axes: tuple):
    """((axis, columns), ...) of the pairs reading each coordinate, and the permutation that puts the
    columns grouped by axis back in pair order (None when they already are)."""
    groups = tuple((axis, np.array([i for i, a in enumerate(pair_axes) if a == axis], dtype=np.int64))
                   for axis in sorted(set(pair_axes)))
    order = np.concatenate([cols for _, cols in groups])
    return groups, (None if np.array_equal(order, np.arange(len(pair_axes))) else np.argsort(order))


def _axis_sub_tables(dense, pair_axes: tuple):
    """For each axis, the columns of a dense table that read it, as one contiguous table (cached with
    the dense table), so a token's row is gathered with one contiguous read per axis."""
    key = ("axis columns", id(dense), dense.shape[0], pair_axes)
    with _lock:
        entry = _cache_get(key)
        if entry is not None and entry[0] is dense:
            return entry[1]
    groups, _ = _axis_columns(pair_axes)
    subs = tuple(np.ascontiguousarray(dense[:, cols]) for _, cols in groups)
    with _lock:
        _cache_put(key, (dense, subs), _nbytes(*subs))
    return subs


def _per_token(spec: RopeSpec, positions: np.ndarray, *, dtype, device_key, convert):
    """(cos, sin, rows) with one table row per token for a multi-axis spec; positions (Bp, S, n_axes)."""
    lead = positions.shape[:-1]
    flat = positions.reshape(-1, positions.shape[-1])
    rows = np.arange(flat.shape[0], dtype=np.int64).reshape(lead)
    if flat.shape[0] == 0:
        empty = np.zeros((1, spec.rotary_dim // 2), dtype=dtype)
        return convert(empty), convert(empty), convert(rows)
    if positions.dtype.kind == "f":
        cos, sin = spec.cos_sin(flat, dtype=dtype)
        return convert(np.ascontiguousarray(cos)), convert(np.ascontiguousarray(sin)), convert(rows)
    lo, hi = int(flat.min()), int(flat.max())
    seq_len = hi + 1 if (spec.depends_on_seq_len and hi >= 0) else None
    if lo < 0 or hi >= _max_rows(spec, np.dtype(dtype)) or _varying(spec, seq_len):
        cos, sin = spec.cos_sin(flat, seq_len=seq_len, dtype=dtype)
        return convert(np.ascontiguousarray(cos)), convert(np.ascontiguousarray(sin)), convert(rows)
    _, dense_cos, dense_sin = _dense_entry(spec, hi, seq_len, np.dtype(dtype), "numpy", None)
    groups, back = _axis_columns(spec._pair_axes)
    tables = []
    for dense in (dense_cos, dense_sin):
        parts = [np.take(sub, flat[:, axis], axis=0)
                 for (axis, _), sub in zip(groups, _axis_sub_tables(dense, spec._pair_axes))]
        table = np.concatenate(parts, axis=1)
        tables.append(table if back is None else np.ascontiguousarray(table[:, back]))
    return convert(tables[0]), convert(tables[1]), convert(rows)


def _max_rows(spec: RopeSpec, dtype: np.dtype) -> int:
    return max(_MIN_ROWS, DENSE_TABLE_MAX_BYTES // (2 * (spec.rotary_dim // 2) * dtype.itemsize))


def _varying(spec: RopeSpec, seq_len) -> bool:
    """True for dynamic-NTK lengths past the model's context (frequencies change with every length)."""
    return (spec.rope_type == "dynamic" and seq_len is not None
            and seq_len > (spec.max_position_embeddings or 0))


def _dense_entry(spec: RopeSpec, hi: int, seq_len, dtype: np.dtype, device_key, convert, grow: bool = True):
    """The cached dense entry (n_rows, cos, sin) covering rows 0..hi, grown (doubled) when needed; with
    ``grow=False`` only an entry that already covers hi, or one of more than hi / 2 rows, grown (positions that
    walked past its end, as a decode stream's do; a single far position leaves it as it is); else None."""
    key = (_frequency_key(spec, seq_len), dtype.str, device_key)
    with _lock:
        entry = _cache_get(key)
        if entry is not None and entry[0] > hi:
            _state["hits"] += 1
            return entry
        if not grow and (entry is None or 2 * entry[0] <= hi):
            return None
        n = _MIN_ROWS if entry is None else entry[0]
        while n <= hi:
            n *= 2
        n = min(n, _max_rows(spec, dtype))
        entry = _build(spec, 0, n, seq_len, dtype, convert)
        _cache_put(key, entry, _nbytes(entry[1], entry[2]))
    return entry


def _build(spec: RopeSpec, base: int, n: int, seq_len, dtype: np.dtype, convert):
    """(n, cos, sin) of positions base..base+n-1, read-only, converted to the backend's arrays."""
    cos, sin = _make(spec, np.arange(base, base + n, dtype=np.int64), seq_len, dtype)
    cos.setflags(write=False)
    sin.setflags(write=False)
    _state["misses"] += 1
    return (n, cos, sin) if convert is None else (n, convert(cos), convert(sin))


def _window_entry(spec: RopeSpec, lo: int, hi: int, seq_len, dtype: np.dtype, device_key, convert):
    """(base, cos, sin) of a cached window holding positions lo..hi at rows position - base, or None
    when the span is too wide for one (then the caller makes a compact table).

    Windows have 2W rows at a base that is a multiple of W (W: a power of two >= 256), so a span of
    up to W positions always fits the window of size W that starts at or below it; a larger cached
    window covering lo..hi is used first."""
    cap = _max_rows(spec, dtype)
    W = _MIN_ROWS
    while W < hi - lo + 1:
        W *= 2
    if 2 * W > cap:
        return None
    frequencies = _frequency_key(spec, seq_len)
    with _lock:
        size = W
        while 2 * size <= cap:   # the smallest cached window that covers lo..hi (windows overlap by half)
            aligned = lo // size * size
            for base in (aligned, aligned - size):
                entry = _cache_get((frequencies, dtype.str, device_key, base, 2 * size))
                if entry is not None and hi < base + 2 * size:
                    _state["hits"] += 1
                    return base, entry[1], entry[2]
            size *= 2
        base = lo // W * W
        entry = _build(spec, base, 2 * W, seq_len, dtype, convert)
        _cache_put((frequencies, dtype.str, device_key, base, 2 * W), entry, _nbytes(entry[1], entry[2]))
    return base, entry[1], entry[2]


#: spec -> the number that stands for it in the table cache's keys (an int hashes in C; a spec's own __hash__ is a
#: Python call, and a decode step's dense-table read hashes its key twice). Numbers are never reused, so the dict may
#: be cleared when it holds _SPEC_NUMBERS_MAX specs: a spec numbered again only misses its old tables (which the
#: byte limit evicts), never reads another spec's
_spec_numbers: dict = {}
_next_number = itertools.count()
_SPEC_NUMBERS_MAX = 4096


@lru_cache(maxsize=512)
def _frequency_key(spec: RopeSpec, seq_len):
    """(spec's number, exact inv_freq bytes, attention scaling): one tuple object per (spec, seq_len), so the
    table cache's key compares by identity and hashes cached bytes on every call. Equal specs share a number."""
    inv_freq, scale = _inv_freq_and_scaling(spec, seq_len)
    if len(_spec_numbers) >= _SPEC_NUMBERS_MAX and spec not in _spec_numbers:
        _spec_numbers.clear()
    return _spec_numbers.setdefault(spec, next(_next_number)), inv_freq.tobytes(), scale


def lookup(spec: RopeSpec, positions: np.ndarray, *, dtype, device_key="cpu", convert=None):
    """Tables and rows for ``positions`` (an int64 NumPy array of any shape).

    ``convert(np_array)`` moves a host array to the backend's array type/device (identity for
    NumPy); ``device_key`` is a hashable name of that destination, part of the cache key, or None:
    then only the host tables are cached and ``convert`` runs on every call (arrays of a JAX trace,
    or of any namespace whose arrays may not outlive the call, never enter the cache).
    """
    if device_key is None:   # cache the host tables only; convert on every call (see _api._table_converter)
        cos, sin, rows = lookup(spec, positions, dtype=dtype)
        return convert(cos), convert(sin), convert(rows)
    dtype = np.dtype(dtype)
    convert = convert or (lambda a: a)
    if spec.multi_axis:
        return _per_token(spec, positions, dtype=dtype, device_key=device_key, convert=convert)
    half = spec.rotary_dim // 2
    if positions.size == 0:
        empty = convert(np.zeros((1, half), dtype=dtype))
        return empty, empty, convert(np.zeros(positions.shape, dtype=np.int64))
    if positions.dtype.kind == "f":   # real-valued 1-D coordinates: one row per token
        cos, sin = spec.cos_sin(positions.reshape(-1), dtype=dtype)
        rows = np.arange(positions.size, dtype=np.int64).reshape(positions.shape)
        return convert(np.ascontiguousarray(cos)), convert(np.ascontiguousarray(sin)), convert(rows)
    if positions.size <= 64:   # decode-sized: cheaper in Python than two NumPy reductions
        values = positions.ravel().tolist()
        lo, hi = min(values), max(values)
    else:
        lo, hi = int(positions.min()), int(positions.max())
    seq_len = hi + 1 if (spec.depends_on_seq_len and hi >= 0) else None
    rows = positions if positions.dtype == np.int64 else positions.astype(np.int64)
    if lo >= 0 and not _varying(spec, seq_len):
        if hi < _max_rows(spec, dtype):   # near 0 (or already covered): the dense table
            near = hi < _DENSE_ALWAYS_BELOW or hi < 4 * (hi - lo + 1)
            entry = _dense_entry(spec, hi, seq_len, dtype, device_key, convert, grow=near)
            if entry is not None:
                return entry[1], entry[2], convert(np.ascontiguousarray(rows))
        window = _window_entry(spec, lo, hi, seq_len, dtype, device_key, convert)
        if window is not None:
            base, cos, sin = window
            return cos, sin, convert(rows - base)
    unique, inverse = np.unique(positions, return_inverse=True)
    cos, sin = _make(spec, unique, seq_len, dtype)
    return convert(cos), convert(sin), convert(inverse.reshape(positions.shape).astype(np.int64))


def dense_key(spec: RopeSpec, dtype, device_key="cpu"):
    """The cache key of spec's dense table (positions 0..n-1) in ``dtype`` on ``device_key``, for
    :func:`cached_dense`; None for a spec whose frequencies depend on the positions (dynamic NTK: a table
    per length) or a table that is never cached (``device_key`` None)."""
    if spec.multi_axis or spec.depends_on_seq_len or device_key is None:
        return None
    return (_frequency_key(spec, None), np.dtype(dtype).str, device_key)


def cached_dense(key):
    """(n, cos, sin) of the dense table under ``key`` (from :func:`dense_key`) while it is cached, else None:
    a dict read and the entry marked recently used (no lock, no table made), for a prepared caller whose
    kernel checks its positions against n and which falls back to :func:`lookup` otherwise (lookup makes and
    grows the tables; for positions below n it returns this same table). Marked, a table that only prepared
    calls read is not the first evicted when other tables fill the cache."""
    item = _cache.get(key)
    if item is None:
        return None
    try:
        _cache.move_to_end(key)   # one C call (atomic under the GIL); the entry may have been evicted since
    except KeyError:
        pass
    return item[0]


def clear_cache() -> None:
    """Drop every cached cos/sin table (and zero the hit and miss counts of ``table_cache_info``)."""
    with _lock:
        _cache.clear()
        _state.update(bytes=0, hits=0, misses=0)
