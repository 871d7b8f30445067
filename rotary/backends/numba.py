"""Numba CPU backend: compiled loops, one parallel pass over q and k (see ``numba_kernels``).

The glue here turns each canonical view into a flat buffer with int64 element offset and strides
(no copy of a strided input; ``out is x`` works in place), picks the parallel or the serial kernel
by size, and allocates outputs and states; how a kernel is called (flat buffers, the size rule, the
launch under Numba's threading layer, fork, the thread pool) is :mod:`.numba_runtime`'s, shared with the
KV-cache primitives ``append_kv`` and ``paged_attention`` (:mod:`.numba_kv`, re-exported here with their
``VARIANTS``). Importing this module imports numba; ``import rotary`` never imports it (the registry loads
this module on first use).
"""

from __future__ import annotations


import numba  # noqa: F401 - ImportError here -> the registry's "pip install" hint
import numpy as np

from . import OUTSIDE_TABLE
from . import numba_runtime as _runtime
from .numba_kernels import common, rotation
from .numba_kernels import linear_attention as la_kernels
from .numba_kernels.linear_backward import ChunkStates, linear_attention_backward  # noqa: F401  (the backward primitive)
from .numba_kv import (VARIANTS, append_kv, paged_attention, prepare_append_kv,  # noqa: F401 - the KV primitives
                       prepare_paged_attention, prepare_stores)
from .numba_runtime import aligned_empty as _aligned_empty, flat_view, readonly as _readonly, readonly_c as _readonly_c, \
    strides_ok as _strides_ok

NAME = "numba"
PACKED_LINEAR_ATTENTION = True   # linear_attention takes cu_seqlens (a packed batch in one pass)
LINEAR_CHUNK_STATES = True       # a causal linear_attention keeps its chunk states for the backward (keep_chunk_states)
COMPILES_ON_FIRST_CALL = True    # Numba compiles each kernel on its first call (cache=True keeps it on disk)

#: dtypes the kernels take (float16 travels as its uint16 bits and is computed in float32)
DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))
#: the size rule's thresholds, the fork flag and the parallel-region lock live in :mod:`.numba_runtime` (one rule
#: for every kernel of this backend): set them there (``numba_runtime.DECODE_KERNEL = "serial"``)


def availability():
    return True, "ok"


def accepts(x) -> bool:
    return isinstance(x, np.ndarray) and x.dtype in DTYPES


def _geometry_row(x, out):
    """(x_buf, out_buf, geo values as a list) of flat-viewable x and writable out; ``out is x``: in place."""
    xf, of = flat_view(x), flat_view(out)
    row = [0] * common.GEO_COLUMNS
    row[common.GEO_HEADS] = x.shape[2]
    row[common.GEO_X:common.GEO_X + 5] = (xf[1], *xf[2])
    row[common.GEO_OUT:common.GEO_OUT + 5] = (of[1], *of[2])
    row[common.GEO_COPY_TAIL] = int(out is not x)
    row[common.GEO_STREAM] = int(out is not x and out.dtype != np.float16
                                 and out.size * out.itemsize >= rotation.STREAM_MIN_BYTES)
    return xf[0], of[0], row


def _geometry(x, out):
    """(x_buf, out_buf, geo row) of flat-viewable x and writable out; ``out is x`` means in place."""
    x_buf, out_buf, row = _geometry_row(x, out)
    return x_buf, out_buf, np.array(row, dtype=np.int64)


def _prepare(x, out):
    """(x', out', result, copy_back): x' flat-viewable, out' flat-viewable and writable."""
    if out is None:   # a fresh C-contiguous array: nothing to check
        result = np.empty(x.shape, dtype=x.dtype)
        return (x if x.flags.c_contiguous or _strides_ok(x) else np.ascontiguousarray(x)), result, result, False
    result = out
    if not _strides_ok(x):
        x = np.ascontiguousarray(x)
    target = result if (_strides_ok(result) and result.flags.writeable) else np.empty(x.shape, x.dtype)
    return x, target, result, target is not result


def _buffer(a):
    """flat_view(a)[0] (offset and strides live in the cached geometry), cheap for C-contiguous a. Inputs keep
    their own writeability (no read-only view per call, ~0.3 us each): a read-only input is its own compiled
    signature, compiled once."""
    if a.flags.c_contiguous:
        return _runtime.bits(a)   # a new view object, like every buffer flat_view returns
    return flat_view(a)[0]


#: geo arrays by the group's shapes, strides, item sizes and in-place flags (all that geo depends on)
_geo_cache: dict = {}


def _group_geometry(group):
    """(2, GEO_COLUMNS) int64 geometry of a group of one or two (x, target) items; cached."""
    key = tuple([(x.shape, x.strides, t.strides, x.itemsize, t is x) for x, t, _, _ in group])
    geo = _geo_cache.get(key)
    if geo is None:
        geo_rows = [_geometry_row(x, t)[2] for x, t, _, _ in group]
        if len(geo_rows) == 1:   # the second item: the same arrays with zero heads
            geo_rows.append(list(geo_rows[0]))
            geo_rows[1][common.GEO_HEADS] = 0
        geo = np.array(geo_rows, dtype=np.int64)
        if len(_geo_cache) >= _runtime.GEO_CACHE_MAX:
            _geo_cache.clear()
        _geo_cache[key] = geo
    return geo


def rotate(items, cos, sin, rows, *, rotary_dim, layout, inverse, out_layout=None):
    """Rotate every ``(x, out)`` of ``items`` (pairs of items in one pass); see ``rotary.backends``."""
    out_layout = out_layout or layout
    if out_layout != layout and any(out is x for x, out in items):
        raise ValueError("out_layout differs from layout: the outputs cannot be the inputs (no rotation in place)")
    results = []
    cos, sin, rows = _readonly_c(cos), _readonly_c(sin), _runtime.writable_c(rows)
    prepared = [_prepare(x, out) for x, out in items]
    for first in range(0, len(prepared), 2):
        group = [p for p in prepared[first:first + 2] if p[0].size]
        if group:
            _rotate_group(group, cos, sin, rows, rotary_dim, layout, inverse, out_layout)
    for x, target, result, copy_back in prepared:
        if copy_back:
            result[...] = target
        results.append(result)
    return results


def _rotate_group(group, cos, sin, rows, rotary_dim, layout, inverse, out_layout):
    B, S, _, D = group[0][0].shape
    geo = _group_geometry(group)
    bufs = [(_buffer(x), _buffer(target)) for x, target, _, _ in group]
    if len(bufs) == 1:
        bufs.append(bufs[0])
    elements = group[0][0].size + (group[1][0].size if len(group) > 1 else 0)
    kernel = rotate_kernel(elements, B, S, _streams(geo))
    if not _launch(kernel, (bufs[0][0], bufs[0][1], bufs[1][0], bufs[1][1], geo, cos, sin, rows, 0, B * S, S,
                            rotary_dim // 2, rotary_dim, D, layout == "interleaved", out_layout == "interleaved",
                            bool(inverse))):
        raise ValueError(f"rows must index the cos/sin table (0 <= row < {cos.shape[0]})")


class PreparedRotation:
    """The ``prepare_rotation`` capability (see :mod:`rotary.backends`): one geometry's geometry array and
    constants, so a call only flattens its arrays and launches the kernel (through its dispatcher). The kernel
    checks every row against the held table and writes nothing when one falls outside (``run`` returns
    OUTSIDE_TABLE)."""

    def __init__(self, views, out_views, *, seq_len, rotary_dim, layout, inverse, offset, f16, out_layout=None):
        group = [(v, o, None, False) for v, o in zip(views, out_views)]
        self.geo = _group_geometry(group)
        self.batch, self.seq_len = views[0].shape[0], seq_len
        self.elements = sum(v.size for v in views)   # the kernel is picked per call (rotate_kernel)
        self.consts = (self.batch * seq_len, seq_len, rotary_dim // 2, rotary_dim, views[0].shape[3],
                       layout == "interleaved", (out_layout or layout) == "interleaved", bool(inverse))
        self.offset, self.f16 = offset, f16
        self.nothing = not (views[0].size and self.batch * seq_len)   # no token or no coordinate to rotate
        self.streams = _streams(self.geo)

    def run(self, xs, outs, rows, start, table):
        """Rotate ``xs`` into new arrays, into ``outs`` (in place: ``outs[i] is xs[i]``); token (b, s) at position
        ``rows[b or 0, s] + start``, table ``(base, end, cos, sin, ...)``. The caller guarantees xs and outs
        C-contiguous of this geometry, rows C-contiguous int64 (Bp, S), read-only C-contiguous tables."""
        bufs, results = [], []
        for x, o in zip(xs, outs):
            y = np.empty(x.shape, x.dtype) if o is None else o
            bufs += (x.ravel(), y.ravel())   # new views (C-contiguous), of x's own writeability (see _buffer)
            results.append(y)
        if self.f16 or self.offset:
            bufs = self._spans(xs, results, bufs)
        if len(bufs) == 2:
            bufs += bufs
        if self.nothing:
            return results
        if not rows.flags.writeable:
            rows = rows.copy()   # the kernels take rows writable (they never write them): one compiled signature
        kernel = rotate_kernel(self.elements, self.batch, self.seq_len, self.streams)
        inside = _launch(kernel, (bufs[0], bufs[1], bufs[2], bufs[3], self.geo, table[2], table[3], rows,
                                  start - table[0], *self.consts))
        return results if inside else OUTSIDE_TABLE

    def _spans(self, xs, results, bufs):
        """The flat buffers as the kernel takes them: float16 as its uint16 bits; with a rotary offset, from
        element ``offset`` on (the geometry was made for views that start there), the coordinates before
        it copied into a separate output (they pass through)."""
        offset, spans = self.offset, []
        for x, y, xb, yb in zip(xs, results, bufs[0::2], bufs[1::2]):
            if self.f16:
                xb, yb = xb.view(np.uint16), yb.view(np.uint16)
            if offset:
                if y is not x:
                    y[..., :offset] = x[..., :offset]
                xb, yb = xb[offset:], yb[offset:]
            spans += (xb, yb)
        return spans


def prepare_rotation(views, out_views, *, seq_len, rotary_dim, layout, inverse, offset, dtype, table=None,
                     out_layout=None):
    """A :class:`PreparedRotation` for canonical ``views`` (from the rotary offset on) and the views of
    their outputs (``out_views[i] is views[i]``: in place; never with an ``out_layout`` other than ``layout``);
    the table is passed to each ``run``."""
    return PreparedRotation(views, out_views, seq_len=seq_len, rotary_dim=rotary_dim, layout=layout,
                            inverse=inverse, offset=offset, f16=np.dtype(dtype) == np.float16, out_layout=out_layout)


def empty(shape, dtype):
    """A new host array (the allocator of this backend's outputs)."""
    return np.empty(shape, dtype)


def rotate_kernel(elements: int, n_batch: int, seq_len: int, streams: bool = False):
    """The rotation kernel for a call of this size (:func:`.numba_runtime.parallel_by_size`: the size rule at
    PARALLEL_MIN_ELEMENTS, decode calls below DECODE_PARALLEL_MIN_ELEMENTS as DECODE_KERNEL says; serial in a
    forked child); a parallel call whose geometry marks an output for non-temporal stores (``streams``,
    :func:`_streams`) takes the streamed kernel."""
    if _runtime.parallel_by_size(elements, n_batch, seq_len):
        return rotation.rotate_qk_streamed if streams else rotation.rotate_qk_parallel
    return rotation.rotate_qk_serial


def _streams(geo) -> bool:
    """Whether a (2, GEO_COLUMNS) geometry marks an output for non-temporal stores (GEO_STREAM)."""
    return bool(geo[0, common.GEO_STREAM] or geo[1, common.GEO_STREAM])


def _launch(kernel, args):
    """The rotation kernel ``kernel`` (:func:`rotate_kernel`) on args, through :func:`.numba_runtime.launch`."""
    return _runtime.launch(kernel, rotation.rotate_qk_serial, args)


def linear_attention(q, k, v, cos, sin, rows, *, rotary_dim, layout, causal, feature_map, eps, chunk, state,
                     decay=None, normalize=True, cu_seqlens=None, keep_chunk_states=False):
    """Chunked linear attention with RoPE in the numerator; see ``rotary.backends`` for the contract.

    One task per (batch, k/v head) running its q heads, ranges of tasks on ``numba.get_num_threads()``
    threads; a one-token call (decode) runs :func:`la_kernels.linear_attention_step` on the calling
    thread (no thread hand-off, one pass over S). ``cu_seqlens`` (N + 1 int64 offsets, q of batch 1):
    a packed batch in one pass, one task per (sequence, k/v head), states (N, Hk, ...).
    ``keep_chunk_states`` (causal, unpacked): also return the states before each chunk for the backward,
    ``(o, state, chunk_states)`` (a :class:`ChunkStates`; None for an empty call).
    """
    B, S, H, m = q.shape
    Hk, dv = k.shape[2], v.shape[3]
    groups = H // Hk if Hk else 1
    work = np.float64 if q.dtype == np.float64 else np.float32
    cos = _readonly_c(cos if cos.dtype == work else cos.astype(work))
    sin = _readonly_c(sin if sin.dtype == work else sin.astype(work))
    rows = _readonly_c(rows if rows.dtype == np.int64 else rows.astype(np.int64))
    fmap = la_kernels.FEATURE_MAPS.get(feature_map) if isinstance(feature_map, str) else None
    if fmap is None:
        raise ValueError(f"feature_map must be one of {tuple(la_kernels.FEATURE_MAPS)}, got {feature_map!r}")
    n_states = B
    if cu_seqlens is not None:
        cu_seqlens = _readonly_c(np.asarray(cu_seqlens, dtype=np.int64))
        n_states = cu_seqlens.shape[0] - 1
    if state is None:
        state_s, state_z = np.zeros((n_states, Hk, m, dv), work), np.zeros((n_states, Hk, m), work)
    else:
        state_s = _readonly_c(np.ascontiguousarray(state[0], dtype=work))
        state_z = (np.zeros((n_states, Hk, m), work) if state[1] is None
                   else _readonly_c(np.ascontiguousarray(state[1], dtype=work)))
    # aligned rows for a long call: the kernel streams a large o (non-temporal stores); a decode step does not
    o = np.empty((B, S, H, dv), q.dtype) if S == 1 else _aligned_empty((B, S, H, dv), q.dtype)
    new_s, new_z = np.empty((n_states, Hk, m, dv), work), np.empty((n_states, Hk, m), work)
    keep = keep_chunk_states and causal and cu_seqlens is None
    if n_states * Hk == 0:
        return (o, (new_s, new_z)) + ((None,) if keep_chunk_states else ())
    decayed = decay is not None and bool(np.any(np.asarray(decay) != 1))
    bufs, geo = _linear_buffers(q, k, v, o)
    interleaved = layout == "interleaved"
    chunk = max(1, min(int(chunk), S))
    kept = ChunkStates((B, S, Hk, m, dv, chunk, np.dtype(work))) if keep else None
    if S == 1 and cu_seqlens is None and kept is None:
        powers = _readonly(_decay_powers(decay, 1)) if decayed else _NO_POWERS
        la_kernels.linear_attention_step(*bufs, geo, cos, sin, rows, _readonly_c(state_s), _readonly_c(state_z),
                                         new_s, new_z, rotary_dim // 2, rotary_dim, interleaved, fmap, float(eps),
                                         groups, powers, decayed, bool(normalize))
    else:
        powers = _readonly(_decay_powers(decay, chunk)) if decayed else None
        args = (*bufs, geo, cos, sin, rows, _readonly_c(state_s), _readonly_c(state_z), new_s, new_z, S,
                rotary_dim // 2, rotary_dim, interleaved, True if causal else None, fmap, float(eps), chunk, groups,
                powers, bool(normalize), _NO_SEQLENS if cu_seqlens is None else cu_seqlens,
                None if kept is None else kept.s, None if kept is None else kept.z)
        _runtime.run_tasks(la_kernels.linear_attention_tasks, args, n_states * Hk)
    return (o, (new_s, new_z)) + ((kept,) if keep_chunk_states else ())


def _decay_powers(decay, chunk):
    from .numpy_linear import decay_powers

    return decay_powers(decay, chunk)


def _linear_buffers(q, k, v, o):
    """([q, k, v, o] as flat buffers (inputs read-only), their (4, 5) geometry (offset, sB, sS, sH, sD));
    copies an input whose strides are not multiples of its item size."""
    bufs, geo = _runtime.flat_buffers((q, k, v, o))
    for buf in bufs[:3]:
        buf.flags.writeable = False   # one compiled signature for read-only and writable inputs
    return bufs, geo


_NO_POWERS = _readonly(np.ones((1, 1, 1)))   # the powers argument of a call without decay (not read)
_NO_SEQLENS = _readonly(np.zeros(0, np.int64))   # the cu_seqlens argument of an unpacked call
