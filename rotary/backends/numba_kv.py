"""The KV-cache primitives of the ``numba`` backend: ``append_kv`` and ``cache_attention`` (contract in
:mod:`rotary.backends`), the glue that turns the cache's arrays into the flat buffers of
``numba_kernels/kv_cache.py`` and picks the serial or the parallel kernel by size. :mod:`rotary.backends.numba`
gets them from :func:`primitives`, handing over what they share with its rotation (flat views, the size rule,
the lock of parallel regions): this module never imports it (no import circle).

They check nothing the frontend (:class:`rotary.KVCache`) already checked: the entries and scales are the
cache's C-contiguous pool arrays, rows and slots valid int64, the block table's pages those of each sequence.
float8_e4m3 entries are not in :data:`KV_DTYPES`: such a cache takes the reference (``kv_entries``, ml_dtypes).
"""

from __future__ import annotations

import os

import numba
import numpy as np

from .numba_kernels import kv_cache as kernels
from .numba_kernels import rotation

#: the cache entry kinds the kernels write and read: the cache's own float dtype, and int8 with per-(token, head)
#: scales
KV_DTYPES = (None, "int8")
#: an attention call below this many (query row x key x coordinate) products runs on the calling thread
ATTENTION_PARALLEL_MIN_WORK = 1 << 18
#: the window of a call without one (larger than any position difference)
_NO_WINDOW = 1 << 62
_INT8_LIMIT = {np.dtype(np.float32): np.float32(127.0), np.dtype(np.float64): np.float64(127.0)}
_ZERO = {np.dtype(np.float32): np.float32(0.0), np.dtype(np.float64): np.float64(0.0)}
_NO_SCALES = {dt: np.zeros(0, dt) for dt in _ZERO}   # the scales argument of float entries (not read)
_geo_cache: dict = {}
_GEO_CACHE_MAX = 256
#: what rotary.backends.numba shares (:func:`primitives`): flat_view, rotate_kernel, the parallel-region lock
_flat_view = _rotate_kernel = _parallel_lock = None
#: True in a child made by os.fork() (GNU OpenMP cannot run there: the serial kernels, as the rotation's)
_in_forked_child = False


def _after_fork_in_child():
    global _in_forked_child
    _in_forked_child = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def primitives(flat_view, rotate_kernel, parallel_lock):
    """(append_kv, cache_attention), sharing the numba backend's ``flat_view`` (strided arrays as flat buffers),
    ``rotate_kernel`` (its serial/parallel size rule: an append is sized as a decode call) and the lock its
    parallel kernels take under Numba's workqueue threading layer."""
    global _flat_view, _rotate_kernel, _parallel_lock
    _flat_view, _rotate_kernel, _parallel_lock = flat_view, rotate_kernel, parallel_lock
    return append_kv, cache_attention


def _bits(a):
    """The flat C-contiguous buffer of a C-contiguous array (float16 as its uint16 bits)."""
    flat = a.reshape(-1)
    return flat.view(np.uint16) if flat.dtype == np.float16 else flat


def _head_buffers(k, v):
    """(k buffer, v buffer, geo (2, 4) int64) of (T, Hk, D) arrays of any strides: flat buffers with element
    offset and token / head / coordinate strides (the backend's ``flat_view``; an array whose strides are not
    multiples of its item size is copied first)."""
    key = (k.shape, k.strides, v.strides, k.dtype.char)
    geo = _geo_cache.get(key)
    if geo is not None and k.flags.c_contiguous and v.flags.c_contiguous:
        return _bits(k), _bits(v), geo
    views = []
    for a in (k, v):
        view = _flat_view(a)
        if view is None:
            view = _flat_view(np.ascontiguousarray(a))
        views.append(view)
    geo = np.array([(view[1], *view[2]) for view in views], dtype=np.int64)
    geo.flags.writeable = False
    if k.flags.c_contiguous and v.flags.c_contiguous:
        if len(_geo_cache) >= _GEO_CACHE_MAX:
            _geo_cache.clear()
        _geo_cache[key] = geo
    return views[0][0], views[1][0], geo


def _c_int64(a):
    a = np.asarray(a)
    return a if a.dtype == np.int64 and a.flags.c_contiguous else np.ascontiguousarray(a, dtype=np.int64)


def append_kv(k, v, cos, sin, rows, slots, stores, *, rotary_dim, layout, offset, kv_dtype):
    """Rotate k at its table rows and write it with v into their slots of ``stores`` (float or int8 entries);
    see :mod:`rotary.backends` for the contract."""
    n_tokens, heads, head_dim = k.shape
    if n_tokens == 0 or heads == 0 or head_dim == 0:
        return
    k_ent, v_ent, k_scale, v_scale = stores
    work = np.dtype(np.float64 if cos.dtype == np.float64 else np.float32)
    k_buf, v_buf, geo = _head_buffers(k, v)
    quantize = kv_dtype is not None
    if quantize:
        k_scale, v_scale = k_scale.reshape(-1), v_scale.reshape(-1)
    else:
        k_scale = v_scale = _NO_SCALES[work]
    elements = 2 * k.size
    kernel = kernels.append_kv_parallel if _parallel(elements, n_tokens) else kernels.append_kv_serial
    args = (k_buf, v_buf, geo, _bits(k_ent), _bits(v_ent), k_scale, v_scale, _c(cos), _c(sin), _c_int64(rows),
            _c_int64(slots), n_tokens, heads, head_dim, rotary_dim // 2, rotary_dim, offset, layout == "interleaved",
            _INT8_LIMIT[work] if quantize else None, None if quantize else True)
    _run(kernel, kernels.append_kv_serial, args)


def cache_attention(q, stores, block_table, page_size, lengths, *, scale, softcap, window, causal):
    """Attention of q (n, s, Hq, D) over the cache's entries through its block table; see :mod:`rotary.backends`."""
    q = np.ascontiguousarray(q)
    n, seq_q, q_heads, head_dim = q.shape
    o = np.empty(q.shape, q.dtype)
    k_ent, v_ent, k_scale, v_scale = stores
    kv_heads = k_ent.shape[1]
    if o.size == 0 or kv_heads == 0:
        o[...] = 0
        return o
    work = np.dtype(np.float64 if q.dtype == np.float64 else np.float32)
    quantized = k_ent.dtype == np.int8
    if quantized:
        k_scale, v_scale = k_scale.reshape(-1), v_scale.reshape(-1)
    else:
        k_scale = v_scale = _NO_SCALES[work]
    lengths = _c_int64(lengths)
    fold = work.type(scale / softcap if softcap else scale)
    work_size = int(lengths.sum()) * seq_q * q_heads * head_dim
    parallel = n * kv_heads > 1 and work_size >= ATTENTION_PARALLEL_MIN_WORK and not _in_forked_child
    kernel = kernels.cache_attention_parallel if parallel else kernels.cache_attention_serial
    args = (_bits(q), _bits(o), _bits(k_ent), _bits(v_ent), k_scale, v_scale, _c_int64(block_table), lengths,
            int(page_size), seq_q, q_heads, kv_heads, head_dim, fold, work.type(softcap or 0.0), _ZERO[work],
            _NO_WINDOW if window is None else int(window), bool(causal), quantized)
    _run(kernel, kernels.cache_attention_serial, args)
    return o


def _c(a):
    """A read-only C-contiguous array equal to a (the cos/sin tables: cached read-only arrays, passed as they
    are): one compiled signature."""
    if a.flags.writeable or not a.flags.c_contiguous:
        a = np.ascontiguousarray(a).view()
        a.flags.writeable = False
    return a


def _parallel(elements, n_tokens):
    """Whether an append of this size runs the parallel kernel: the rotation's size rule
    (:func:`rotary.backends.numba.rotate_kernel`), sized as a decode call (tokens of different sequences)."""
    return _rotate_kernel(elements, n_tokens, 1) is not rotation.rotate_qk_serial


_layer_is_thread_safe = None   # None: not known yet (no parallel region has run)


def _run(kernel, serial, args):
    """kernel(*args); a parallel kernel under Numba's workqueue threading layer (not thread-safe) runs from one
    thread at a time, under the lock the rotation's parallel kernel takes (see
    :func:`rotary.backends.numba._launch`), a concurrent call taking ``serial`` instead."""
    global _layer_is_thread_safe
    if kernel is serial or _layer_is_thread_safe:
        return kernel(*args)
    if _layer_is_thread_safe is None:
        try:
            _layer_is_thread_safe = numba.threading_layer() != "workqueue"
        except ValueError:   # no parallel region has run yet
            pass
    if _layer_is_thread_safe:
        return kernel(*args)
    if not _parallel_lock.acquire(blocking=False):
        return serial(*args)
    try:
        return kernel(*args)
    finally:
        _parallel_lock.release()
