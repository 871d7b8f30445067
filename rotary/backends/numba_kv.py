"""The KV-cache primitives of the ``numba`` backend: ``append_kv`` and ``paged_attention`` (contract in
:mod:`rotary.backends`), the glue that turns the caller's arrays into the flat buffers of
``numba_kernels/kv_cache.py`` and picks the serial or the parallel kernel by size. Buffers, the size rule and the
launch under Numba's threading layer are :mod:`.numba_runtime`'s (as for the rotation); :mod:`rotary.backends.numba`
re-exports these primitives and :data:`VARIANTS`.

They check nothing the frontend already checked: the entries and scales are C-contiguous pool arrays, rows and slots
valid int64 (a negative slot: a padding token, skipped), the block table's pages in the pool, q_starts increasing
with ``c_i <= seq_lens[i]``. The entry format is ``kv_dtype``, a row of :data:`.kv_entries.KV_FORMATS` (passed
explicitly, never inferred from the stores' dtype); float8_e4m3 is not among :data:`VARIANTS` (the reference,
``kv_entries`` with ml_dtypes, takes it).
"""

from __future__ import annotations

import numpy as np

from . import numba_runtime as runtime
from .kv_entries import KV_FORMATS
from .numba_kernels import kv_cache as kernels

#: the KV entry formats each primitive takes (``rotary.backends.supports``): the entries in k's own float dtype, and
#: int8 with per-(token, head) scales
VARIANTS = {"append_kv": (None, "int8"), "paged_attention": (None, "int8")}
#: an attention call below this many (query row x key x coordinate) products runs on the calling thread
ATTENTION_PARALLEL_MIN_WORK = 1 << 18
#: the window of a call without one (larger than any position difference)
_NO_WINDOW = 1 << 62
_F32, _F64 = np.dtype(np.float32), np.dtype(np.float64)
_WORK = (_F32, _F64)
_ZERO = {dt: dt.type(0.0) for dt in _WORK}
_NO_SCALES = {dt: np.zeros(0, dt) for dt in _WORK}   # the scales argument of float entries (not read)
_INT8 = KV_FORMATS["int8"].code


def _quantized(kv_dtype) -> bool:
    """Whether entries of format ``kv_dtype`` are int8 with scales (its code in KV_FORMATS), False for the float
    entries (code 0); ValueError for a format these kernels do not take."""
    if kv_dtype not in VARIANTS["append_kv"]:
        raise ValueError(f"kv_dtype must be one of {VARIANTS['append_kv']} on the numba backend, got {kv_dtype!r}")
    return KV_FORMATS[kv_dtype].code == _INT8


#: (kv_dtype, work dtype) -> the append kernel's markers (int8_limit, float_entries): the format's limit in the
#: work dtype and None for int8 entries, None and True for float entries (see ``kv_cache.append_token``)
_APPEND_MARKERS = {(name, work): ((work.type(KV_FORMATS[name].limit), None) if _quantized(name) else (None, True))
                   for name in VARIANTS["append_kv"] for work in _WORK}


def append_kv(k, v, cos, sin, rows, slots, stores, *, rotary_dim, layout, offset, kv_dtype):
    """Rotate k at its table rows and write it with v into their slots of ``stores`` (entries of format
    ``kv_dtype``: None or "int8"); slots < 0 are padding, skipped. See :mod:`rotary.backends` for the contract."""
    n_tokens, heads, head_dim = k.shape
    work = _F64 if cos.dtype == np.float64 else _F32
    markers = _APPEND_MARKERS.get((kv_dtype, work))
    if markers is None:
        _quantized(kv_dtype)   # raises for a format not taken here
    if n_tokens == 0 or heads == 0 or head_dim == 0:
        return
    k_ent, v_ent, k_scale, v_scale = stores
    (k_buf, v_buf), geo = runtime.flat_buffers((k, v))
    if markers[0] is not None:
        k_scale, v_scale = k_scale.reshape(-1), v_scale.reshape(-1)
    else:
        k_scale = v_scale = _NO_SCALES[work]
    parallel = runtime.parallel_by_size(2 * k.size, n_tokens, 1)   # sized as a decode call (tokens of many sequences)
    kernel = kernels.append_kv_parallel if parallel else kernels.append_kv_serial
    args = (k_buf, v_buf, geo, runtime.bits(k_ent), runtime.bits(v_ent), k_scale, v_scale, runtime.readonly_c(cos),
            runtime.readonly_c(sin), runtime.c_int64(rows), runtime.c_int64(slots), n_tokens, heads, head_dim,
            rotary_dim // 2, rotary_dim, offset, layout == "interleaved", *markers)
    runtime.launch(kernel, kernels.append_kv_serial, args)


def paged_attention(q, stores, block_table, page_size, seq_lens, q_starts, *, scale, softcap, window, causal, kv_dtype):
    """Attention of packed q (T, Hq, D) over each sequence's pages where they lie: sequence i's queries are q's rows
    ``q_starts[i] .. q_starts[i + 1] - 1``, the last of its ``seq_lens[i]`` positions; see :mod:`rotary.backends`."""
    quantized = _quantized(kv_dtype)
    q = np.ascontiguousarray(q)
    n_q, q_heads, head_dim = q.shape
    k_ent, v_ent, k_scale, v_scale = stores
    kv_heads = k_ent.shape[1]
    seq_lens, q_starts = runtime.c_int64(seq_lens), runtime.c_int64(q_starts)
    n = seq_lens.shape[0]
    if q.size == 0 or kv_heads == 0 or n == 0:
        return np.zeros(q.shape, q.dtype)
    covered = q_starts[0] == 0 and q_starts[n] == n_q   # every row some sequence's (else the others are 0)
    o = np.empty(q.shape, q.dtype) if covered else np.zeros(q.shape, q.dtype)
    work = _F64 if q.dtype == np.float64 else _F32
    if quantized:
        k_scale, v_scale = k_scale.reshape(-1), v_scale.reshape(-1)
    else:
        k_scale = v_scale = _NO_SCALES[work]
    fold = work.type(scale / softcap if softcap else scale)
    work_size = int(seq_lens.sum()) * n_q // n * q_heads * head_dim   # exact for a dense step (c queries each)
    parallel = n * kv_heads > 1 and work_size >= ATTENTION_PARALLEL_MIN_WORK and not runtime.in_forked_child()
    kernel = kernels.paged_attention_parallel if parallel else kernels.paged_attention_serial
    args = (runtime.bits(q), runtime.bits(o), runtime.bits(k_ent), runtime.bits(v_ent), k_scale, v_scale,
            runtime.c_int64(block_table), seq_lens, q_starts, int(page_size), q_heads, kv_heads, head_dim, fold,
            work.type(softcap or 0.0), _ZERO[work], _NO_WINDOW if window is None else int(window), bool(causal),
            quantized)
    runtime.launch(kernel, kernels.paged_attention_serial, args)
    return o
