"""cos/sin tables: made from the spec in float64, cached per (spec, frequencies, dtype, device).

The frontend asks ``lookup(spec, positions, dtype=..., device_key=..., convert=...)`` and gets
``(cos, sin, rows)``: tables of shape (R, rotary_dim//2) in the backend's array type and the row of
each token, shape positions.shape, int64. Two kinds of table:

- dense: rows 0..R-1 hold positions 0..R-1. Grown (doubled) as larger positions arrive and
  shared by every call with the same key. Used when 0 <= positions < a size cap.
- compact: one row per distinct position of this call (negative, huge or sparse positions, and
  dynamic-NTK lengths past the model's context, whose frequencies change with the length).
- per-token (multi-axis specs, positions ``(..., n_axes)``): one row per token, pair i taken from
  the row of the coordinate it reads, ``cos[t, i] = dense[pos[t, pair_axes[i]], i]`` (gathered from
  the dense table when every coordinate fits it, else computed directly; always directly for
  real-valued coordinates). Backends see the same (table, rows) contract.

Cache keys hold the spec itself and the exact frequencies used, so two specs never share an
entry. The cache is guarded by a lock (safe from several threads); tables are read-only.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from functools import lru_cache

import numpy as np

from ._spec import RopeSpec, _inv_freq_and_scaling

#: Largest dense table, in bytes (cos + sin); past it a compact table is made per call.
DENSE_TABLE_MAX_BYTES = 64 * 2**20
_MIN_ROWS = 256
_MAX_ENTRIES = 32

_lock = threading.Lock()
_cache: OrderedDict = OrderedDict()


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


_sub_lock = threading.Lock()
_sub_tables: OrderedDict = OrderedDict()


def _axis_sub_tables(dense, pair_axes: tuple):
    """For each axis, the columns of a dense table that read it, as one contiguous table (cached with
    the dense table), so a token's row is gathered with one contiguous read per axis."""
    key = (id(dense), dense.shape[0], pair_axes)
    with _sub_lock:
        entry = _sub_tables.get(key)
        if entry is not None and entry[0] is dense:
            _sub_tables.move_to_end(key)
            return entry[1]
    groups, _ = _axis_columns(pair_axes)
    subs = tuple(np.ascontiguousarray(dense[:, cols]) for _, cols in groups)
    with _sub_lock:
        _sub_tables[key] = (dense, subs)
        while len(_sub_tables) > 2 * _MAX_ENTRIES:
            _sub_tables.popitem(last=False)
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


def _dense_entry(spec: RopeSpec, hi: int, seq_len, dtype: np.dtype, device_key, convert):
    """The cached dense entry (n_rows, cos, sin) covering rows 0..hi, grown (doubled) when needed."""
    key = (_frequency_key(spec, seq_len), dtype.str, device_key)
    convert = convert or (lambda a: a)
    with _lock:
        entry = _cache.get(key)
        if entry is None or entry[0] <= hi:
            n = _MIN_ROWS if entry is None else entry[0]
            while n <= hi:
                n *= 2
            n = min(n, _max_rows(spec, dtype))
            cos, sin = _make(spec, np.arange(n, dtype=np.int64), seq_len, dtype)
            cos.setflags(write=False)
            sin.setflags(write=False)
            entry = (n, convert(cos), convert(sin))
            _cache[key] = entry
            while len(_cache) > _MAX_ENTRIES:
                _cache.popitem(last=False)
        else:
            _cache.move_to_end(key)
    return entry


@lru_cache(maxsize=512)
def _frequency_key(spec: RopeSpec, seq_len):
    """(spec, exact inv_freq bytes, attention scaling): one tuple object per (spec, seq_len), so the
    table cache's key compares by identity and hashes cached bytes on every call."""
    inv_freq, scale = _inv_freq_and_scaling(spec, seq_len)
    return spec, inv_freq.tobytes(), scale


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
    if lo < 0 or hi >= _max_rows(spec, dtype) or _varying(spec, seq_len):
        unique, rows = np.unique(positions, return_inverse=True)
        cos, sin = _make(spec, unique, seq_len, dtype)
        return convert(cos), convert(sin), convert(rows.reshape(positions.shape).astype(np.int64))
    entry = _dense_entry(spec, hi, seq_len, dtype, device_key, convert)
    rows = positions if positions.dtype == np.int64 else positions.astype(np.int64)
    return entry[1], entry[2], convert(np.ascontiguousarray(rows))


def clear_cache() -> None:
    """Drop every cached table."""
    with _lock:
        _cache.clear()
    with _sub_lock:
        _sub_tables.clear()
