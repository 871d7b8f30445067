"""cos/sin values a caller brings instead of the spec's frequencies (what other engines hand a RoPE kernel).

- ``cos_sin_cache``: a ``(max_position, rotary_dim)`` table, ``cos(p w_i)`` in the first ``rotary_dim / 2``
  columns and ``sin(p w_i)`` in the rest (vLLM / SGLang's ``cos_sin_cache``, FlashInfer's
  ``apply_rope_with_cos_sin_cache``), rotated at the call's positions (row ``p`` for position ``p``).
- ``angles``: the angle of every token and pair, ``(S, rotary_dim / 2)`` or per batch row
  ``(batch, S, rotary_dim / 2)`` (``(1, S, rotary_dim / 2)``: one row for every batch entry), turned into cos/sin in
  float64 (TransformerEngine's ``freqs``
  ``(S, 1, 1, rotary_dim)`` holds each angle twice: ``angles = freqs[:, 0, 0, :rotary_dim // 2]`` for its
  half-split layout, ``freqs[:, 0, 0, ::2]`` for interleaved; per batch ``(S, B, 1, d)``:
  ``np.moveaxis(freqs[:, :, 0, :rotary_dim // 2], 0, 1)``).

Either becomes a ``tables(spec, positions, dtype, device_key, convert) -> (cos, sin, rows)`` callable,
the hook the rotation's general path takes instead of :func:`rotary.spec.tables.lookup`: the backends
see their usual contract (table rows per token) and rotate with these values on every backend. The
spec still gives the pair layout, ``rotary_dim`` and ``rotary_offset``; its frequencies and
``attention_scaling`` are not used (a given table holds whatever scaling its maker applied).
"""

from __future__ import annotations

import numpy as np

from .validators import to_numpy


def _float_table(a, name, ndim):
    t = to_numpy(a, name)
    if t.dtype.kind != "f" or t.dtype.itemsize > 8:
        raise TypeError(f"{name} must be a real floating array (float16/32/64), got dtype {t.dtype}")
    if t.ndim not in ndim:
        raise ValueError(f"{name} must have {' or '.join(str(n) for n in ndim)} dimensions, got shape {t.shape}")
    if not np.all(np.isfinite(t)):
        raise ValueError(f"{name} must be finite")
    return t


def cos_sin_cache_tables(cos_sin_cache):
    """``(tables, rotary_dim)`` of a ``(max_position, rotary_dim)`` cos-then-sin table (see the module)."""
    cache = _float_table(cos_sin_cache, "cos_sin_cache", (2,))
    n_rows, width = cache.shape
    if width == 0 or width % 2:
        raise ValueError(f"cos_sin_cache must have an even number of columns (cos then sin, rotary_dim / 2 each), "
                         f"got shape {cache.shape}")
    half = width // 2

    def tables(spec, positions, *, dtype, device_key=None, convert=None):
        pos = np.asarray(positions)
        if pos.dtype.kind not in "iu" or pos.ndim != 2:
            raise ValueError(f"positions with cos_sin_cache must be integer positions (one per token), got {pos.dtype} "
                             f"of shape {pos.shape}")
        if pos.size and (pos.min() < 0 or pos.max() >= n_rows):
            raise ValueError(f"positions must index the rows of cos_sin_cache: 0 <= position < {n_rows}, got "
                             f"{int(pos.min())}..{int(pos.max())}")
        rows_used, rows = np.unique(pos, return_inverse=True)   # only the rows this call reads
        cos = np.ascontiguousarray(cache[rows_used, :half], dtype=dtype)
        sin = np.ascontiguousarray(cache[rows_used, half:], dtype=dtype)
        rows = rows.reshape(pos.shape).astype(np.int64)
        move = convert or (lambda a: a)
        return move(cos), move(sin), move(rows)

    return tables, width


def angle_tables(angles):
    """``(tables, rotary_dim, positions)`` of per-token angles ``(S, r/2)`` or ``(batch, S, r/2)`` (see the module):
    ``positions`` are the ids of the angle rows (0..S-1, or ``b * S + s`` per batch row) that the call passes on."""
    a = _float_table(angles, "angles", (2, 3)).astype(np.float64)
    half = a.shape[-1]
    if half == 0:
        raise ValueError(f"angles must have rotary_dim / 2 >= 1 columns, got shape {a.shape}")
    seq = a.shape[-2]
    ids = np.arange(seq, dtype=np.int64) if a.ndim == 2 else np.arange(a.shape[0] * seq, dtype=np.int64).reshape(-1, seq)
    flat = a.reshape(-1, half)
    cos64, sin64 = np.cos(flat), np.sin(flat)

    def tables(spec, positions, *, dtype, device_key=None, convert=None):
        move = convert or (lambda t: t)
        return (move(np.ascontiguousarray(cos64, dtype=dtype)), move(np.ascontiguousarray(sin64, dtype=dtype)),
                move(np.ascontiguousarray(positions, dtype=np.int64)))

    return tables, 2 * half, ids
