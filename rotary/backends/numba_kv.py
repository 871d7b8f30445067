"""The KV-cache primitives of the ``numba`` backend: ``append_kv`` and ``paged_attention`` (contract in
:mod:`rotary.backends`), the glue that turns the caller's arrays into the flat buffers of
``numba_kernels/kv_cache.py``, picks the serial or the parallel kernel by size, and for a parallel attention call of
few tasks over long keys the split-K count (:func:`attention_splits`: flash-decoding, each
sequence's keys cut into parts on several threads, merged by log-sum-exp; its thresholds are this module's
globals). Buffers, the size rule and the launch under Numba's threading layer are :mod:`.numba_runtime`'s (as for
the rotation); :mod:`rotary.backends.numba` re-exports these primitives and :data:`VARIANTS`.

They check nothing the frontend already checked: the entries and scales are C-contiguous pool arrays, rows and slots
valid int64 (a negative slot: a padding token, skipped), the block table's pages in the pool, q_starts increasing
with ``c_i <= seq_lens[i]``. The entry format is ``kv_dtype``, a row of :data:`.kv_entries.KV_FORMATS` (passed
explicitly, never inferred from the stores' dtype); float8_e4m3 is not among :data:`VARIANTS` (the reference,
``kv_entries`` with ml_dtypes, takes it).
"""

from __future__ import annotations

import math

import numba
import numpy as np

from . import numba_runtime as runtime
from .kv_entries import KV_FORMATS
from .numba_kernels import kv_cache as kernels
from .numba_kernels.simd import VECTOR_BYTES

#: the KV entry formats each primitive takes (``rotary.backends.supports``): the entries in k's own float dtype, and
#: int8 with per-(token, head) scales
VARIANTS = {"append_kv": (None, "int8"), "paged_attention": (None, "int8")}
#: an attention call below this many (query row x key x coordinate) products runs on the calling thread
ATTENTION_PARALLEL_MIN_WORK = 1 << 18
#: split-K (flash-decoding, :func:`attention_splits`): a parallel attention call of fewer tasks (sequences whose q
#: rows fit a row block, a task taking every k/v head; else (sequence, k/v head) pairs) than this many per thread
#: (numba.get_num_threads()) cuts each sequence's keys into splits until it has that many tasks (static scheduling
#: then leaves no thread idle: 8 tasks on 6 threads run as 24, 4 a thread) ...
SPLIT_TASKS_PER_THREAD = 4
#: ... but never into splits of fewer keys than this (of the longest key range a row of the call reads): a split's
#: own cost (q loaded again, its workspace written and merged) stays small beside its keys; a call whose rows read
#: fewer than 2 x this many keys is never split
SPLIT_MIN_KEYS = 1024
#: ... and never into more splits than keep the workspace (per q row and q head and split: head_dim + 2 work values)
#: within this many bytes (a long prefill chunk of one sequence is split less, or not at all)
SPLIT_MAX_WORKSPACE = 1 << 24
#: a task takes every k/v head of its sequence (``all_heads``: the pages read in address order) when a sequence's q
#: rows fit one row block and the call has at least this many (sequence, split) tasks per thread (measured on 2
#: threads: 4 such tasks as fast as 8; batch 1 at 32k keys, 8 splits: 6.9 ms against 12.3 for 8 per-head tasks)
ALL_HEADS_TASKS_PER_THREAD = 2
#: ... or, in a parallel call of too few such tasks and no split by the rule (a short sequence), each sequence is cut
#: into threads / gcd(sequences, threads) splits taking every k/v head (every thread as many tasks) where each split
#: keeps at least this many keys (8 x 128 float32, GQA 4, 2 threads, a 32-layer step's attention: 1k keys x 1
#: sequence, 2 splits: 7.4-7.7 ms against 9.1-10.0 for 8 per-head tasks (4 splits of 256 keys: 7.5-7.8); x 3: 2 splits
#: each, 20.4-21.8 ms against 25.5-26.0)
EVEN_SPLIT_MIN_KEYS = 256
#: the split count of every attention call (tests; read, as the thresholds above, when a prepared call first runs
#: over stores of a number of k/v heads): None follows the rule above; an int >= 1 forces it (the ``splits`` keyword
#: of :func:`prepare_paged_attention` forces it for one call)
ATTENTION_SPLITS = None
#: the window of a call without one (larger than any position difference)
_NO_WINDOW = 1 << 62
_F32, _F64 = np.dtype(np.float32), np.dtype(np.float64)
_WORK = (_F32, _F64)
_ZERO = {dt: dt.type(0.0) for dt in _WORK}
_NO_SCALES = {dt: np.zeros(0, dt) for dt in _WORK}   # the scales argument of float entries (not read)
_INT8 = KV_FORMATS["int8"].code
_NO_ROWS = np.zeros(0, np.int64)   # the q rows and tables of a call without a rotation (not read)
_NO_TABLE = {dt: runtime.readonly(np.zeros((1, 1), dt)) for dt in _WORK}


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


_UNNORMED = (None, True)   # the kernels' (norm, unnormed) markers of a call without a norm


def kernel_norm(norm, work, head_dim):
    """The kernels' ``(norm, unnormed)`` markers of the contract's ``norm = (weight, eps)``: (None, True) without one,
    else ((weight read-only, eps and head_dim in the work dtype), None) (``kv_cache.norm_head``)."""
    if norm is None:
        return _UNNORMED
    weight, eps = norm
    scalars = _norm_scalars.get((work, eps, head_dim))
    if scalars is None:
        if len(_norm_scalars) >= 64:
            _norm_scalars.clear()
        scalars = _norm_scalars[work, eps, head_dim] = (work.type(eps), work.type(head_dim))
    return (weight if weight.flags.c_contiguous else np.ascontiguousarray(weight),) + scalars, None


#: (work dtype, eps, head_dim) -> eps and head_dim as work-dtype scalars (kernel_norm's, kept: a decode step's)
_norm_scalars: dict = {}


def prepare_append_kv(k, v, cos, sin, rows, slots, *, rotary_dim, layout, offset, kv_dtype):
    """``run(k, v, stores, norm=None)``: the append of keys and values shaped and strided as ``k`` and ``v`` at these
    tables, rows and slots, into any stores of format ``kv_dtype`` (None or "int8"), keys normed by ``norm`` (weight,
    eps) when given: each layer of a step calls it (the ``prepare_append_kv`` capability of
    :mod:`rotary.backends`; ``run.moved(cos, sin, rows, slots)``: the same at a decode chain's next rows and
    slots)."""
    n_tokens, heads, head_dim = k.shape
    work = _F64 if cos.dtype == np.float64 else _F32
    markers = _APPEND_MARKERS.get((kv_dtype, work))
    if markers is None:
        _quantized(kv_dtype)   # raises for a format not taken here
    if n_tokens == 0 or heads == 0 or head_dim == 0:
        return _nothing
    contiguous = k.flags.c_contiguous and v.flags.c_contiguous
    geo = _pair_geometry(k, v) if contiguous else runtime.flat_buffers((k, v))[1]
    parallel = runtime.parallel_by_size(2 * k.size, n_tokens, 1)   # sized as a decode call (tokens of many sequences)
    kernel = kernels.append_kv_parallel if parallel else kernels.append_kv_serial
    fixed = (kernel, geo, contiguous and k.dtype != np.float16, work, markers[0] is not None, cos, sin)  # (f16: bits)
    stream = True if (markers[1] is not None and k.dtype == work and v.dtype == work and geo[0, 3] == 1
                      and geo[1, 3] == 1 and offset == 0 and rotary_dim == head_dim
                      and (rotary_dim // 2) % (VECTOR_BYTES // work.itemsize) == 0) else None
    return PreparedAppend(fixed, (runtime.readonly_c(cos), runtime.readonly_c(sin), runtime.c_int64(rows),
                                  runtime.c_int64(slots), n_tokens, heads, head_dim, rotary_dim // 2, rotary_dim, offset,
                                  layout == "interleaved", *markers, stream))


_I64, _I64_STRIDES = np.dtype(np.int64), (8,)


class PreparedAppend:
    """A prepared append (:func:`prepare_append_kv`): ``run(k, v, stores, norm=None)``; :meth:`moved` gives the same
    append at other rows and slots of the same tables (a decode chain's next step) for the cost of a tuple.
    ``fixed``: (kernel, k/v geometry, k/v read as flat views, work dtype, quantized, cos, sin); ``tail``: the
    kernel's arguments after the stores."""

    __slots__ = ("fixed", "tail")

    def __init__(self, fixed, tail):
        self.fixed, self.tail = fixed, tail

    def __call__(self, k, v, stores, norm=None):
        kernel, geo, flat_views, work, quantized, _, _ = self.fixed
        if flat_views:
            kb, vb = k.reshape(-1), v.reshape(-1)
        else:
            kb, vb = runtime.flat_buffers((k, v))[0]
        flat = stores.flat if type(stores) is PreparedStores else flat_stores(stores, quantized, work)
        tail = self.tail
        serial = kernels.append_kv_serial
        runtime.launch(serial if runtime.in_forked_child() else kernel, serial,
                       (kb, vb, geo, *flat, *tail, *(_UNNORMED if norm is None else kernel_norm(norm, work, tail[6]))))

    def moved(self, cos, sin, rows, slots):
        """This append with the tables' ``rows`` and ``slots`` (host int64 arrays of its tokens) in place of its own;
        None when ``cos``/``sin`` are not its tables or the arrays not its tokens' (the caller prepares anew). It
        reads rows and slots when it runs: given the very arrays it reads (rewritten in place by their caller, as a
        decode chain does), it is itself."""
        fixed, tail = self.fixed, self.tail
        if rows is tail[2] and slots is tail[3] and cos is fixed[5] and sin is fixed[6]:
            return self
        if cos is not fixed[5] or sin is not fixed[6] or type(rows) is not np.ndarray or type(slots) is not np.ndarray \
                or rows.dtype is not _I64 or slots.dtype is not _I64 or rows.shape != tail[2].shape \
                or slots.shape != tail[3].shape or rows.strides != _I64_STRIDES or slots.strides != _I64_STRIDES:
            return None   # (a dtype equal to int64 but not NumPy's own object: prepared anew)
        return PreparedAppend(fixed, tail[:2] + (rows, slots) + tail[4:])


#: (shapes, dtypes) of C-contiguous k and v -> their geometry (runtime.flat_buffers'; a pure function of the key)
_contiguous_geo: dict = {}


def _pair_geometry(k, v):
    """The geometry :func:`runtime.flat_buffers` gives C-contiguous k and v, memoised by their shapes and dtypes (its
    own memo costs microseconds a decode step)."""
    key = (k.shape, v.shape, k.dtype.char, v.dtype.char)
    geo = _contiguous_geo.get(key)
    if geo is None:
        if len(_contiguous_geo) >= runtime.GEO_CACHE_MAX:
            _contiguous_geo.clear()
        geo = _contiguous_geo[key] = runtime.flat_buffers((k, v))[1]
    return geo


def flat_stores(stores, quantized, work):
    """(k entries, v entries, k scales, v scales) of ``stores`` (or of a :class:`PreparedStores`) as the kernels take
    them: flat buffers, work-dtype placeholders for the scales of float entries."""
    if type(stores) is PreparedStores:
        return stores.flat
    k_ent, v_ent, k_scale, v_scale = stores
    if quantized:
        return runtime.bits(k_ent), runtime.bits(v_ent), k_scale.reshape(-1), v_scale.reshape(-1)
    return runtime.bits(k_ent), runtime.bits(v_ent), _NO_SCALES[work], _NO_SCALES[work]


class PreparedStores:
    """One set of stores flattened once (:func:`prepare_stores`): ``stores``, their kernel buffers ``flat`` and
    ``kv_heads``."""

    __slots__ = ("stores", "flat", "kv_heads")

    def __init__(self, stores, flat):
        self.stores, self.flat, self.kv_heads = stores, flat, stores[0].shape[1]


def prepare_stores(stores, kv_dtype):
    """The ``prepare_stores`` capability: ``stores`` of format ``kv_dtype`` flattened once, for the prepared runs of
    every step of their owner (a cache's layer); its lifetime is the owner's (no module-level memo holds pools)."""
    quantized = _quantized(kv_dtype)
    work = _F64 if (stores[2] if quantized else stores[0]).dtype == np.float64 else _F32
    return PreparedStores(stores, flat_stores(stores, quantized, work))


def append_kv(k, v, cos, sin, rows, slots, stores, *, rotary_dim, layout, offset, kv_dtype, norm=None):
    """Rotate k (normed first by ``norm`` = (weight, eps) when given) at its table rows and write it with v into their
    slots of ``stores`` (entries of format ``kv_dtype``: None or "int8"); slots < 0 are padding, skipped. See
    :mod:`rotary.backends` for the contract."""
    prepare_append_kv(k, v, cos, sin, rows, slots, rotary_dim=rotary_dim, layout=layout, offset=offset,
                      kv_dtype=kv_dtype)(k, v, stores, norm)


def _nothing(*arrays):
    return None


def attention_splits(tasks: int, keys: int, threads: int) -> int:
    """The split-K rule (as CUDA's ``paged_attention_splits``): how many parts a parallel attention call of ``tasks``
    tasks (sequences whose task takes every k/v head, else (sequence, k/v head) pairs) cuts each sequence's keys into,
    ``keys`` the longest key range a row reads, on ``threads`` threads. 1 when the tasks are SPLIT_TASKS_PER_THREAD
    per thread or more; else enough splits to reach that many tasks, but no more than keep SPLIT_MIN_KEYS keys per
    split. Batch 1 decoding at 32k keys (one task a sequence): min(ceil(8 / 1), 32) = 8 splits on 2 threads, 32 on
    16; a prefill chunk's sequence of 8 k/v heads (a task per head) on 2 threads: 1."""
    target = SPLIT_TASKS_PER_THREAD * max(1, threads)
    if tasks <= 0 or tasks >= target:
        return 1
    return max(1, min(-(-target // tasks), keys // max(1, SPLIT_MIN_KEYS)))


def prepare_paged_attention(q, block_table, page_size, seq_lens, q_starts, *, scale, softcap, window, causal, kv_dtype,
                            rotation=None, splits=None):
    """``run(q, stores, norm=None) -> o``: the attention of packed q shaped as ``q`` (T, Hq, D) over these tables in
    any stores of format ``kv_dtype`` (each layer of a step calls it; the ``prepare_paged_attention`` capability), q
    normed by ``norm`` = (weight, eps) when given and rotated in the kernel by ``rotation = (cos, sin, rows,
    rotary_dim, layout, offset)`` when given. ``splits`` (None:
    ATTENTION_SPLITS, else the rule of :func:`attention_splits` for a parallel call) forces the split-K count: each
    run allocates its own workspace for splits > 1 (runs of one prepared call from several threads share nothing)."""
    quantized = _quantized(kv_dtype)
    n_q, q_heads, head_dim = q.shape
    dtype = np.dtype(q.dtype)
    seq_lens, q_starts = runtime.c_int64(seq_lens), runtime.c_int64(q_starts)
    n = seq_lens.shape[0]
    work = _F64 if dtype == np.float64 else _F32
    if q.size == 0 or n == 0:
        return lambda q, stores, norm=None: np.zeros(q.shape, q.dtype)
    covered = q_starts[0] == 0 and q_starts[n] == n_q   # every row some sequence's (else the others are 0)
    new_output = np.empty if covered else np.zeros
    fold = work.type(scale / softcap if softcap else scale)
    if rotation is None:
        cos = sin = _NO_TABLE[work]
        q_rows, half, rotary_dim, offset, interleaved = _NO_ROWS, 0, 0, 0, False
    else:
        cos, sin, q_rows, rotary_dim, layout, offset = rotation
        cos, sin, q_rows = runtime.readonly_c(cos), runtime.readonly_c(sin), runtime.c_int64(q_rows)
        half, interleaved = rotary_dim // 2, layout == "interleaved"
    work_size = _total(seq_lens) * n_q // n * q_heads * head_dim   # exact for a dense step (c queries each)
    window = _NO_WINDOW if window is None else int(window)
    tail = (runtime.c_int64(block_table), seq_lens, q_starts, int(page_size), q_heads, None, head_dim, fold,
            work.type(softcap or 0.0), _ZERO[work], window, bool(causal), quantized, cos, sin, q_rows, half, rotary_dim,
            offset, interleaved)
    serial, bits, half_bits = kernels.paged_attention_serial, runtime.bits, dtype == np.float16
    split_bytes = n_q * q_heads * (head_dim + 2) * work.itemsize   # the workspace of one split
    kernels_of = {}   # kv_heads -> (kernel, args after the buffers, splits)

    def choose(kv_heads):
        """(kernel, tail with kv_heads and splits, splits) of calls over stores of kv_heads heads."""
        pairs = n * kv_heads
        # a sequence's q rows in one row block: its task may take every k/v head (kv_cache.attend_task, all_heads)
        most_queries = int(q_starts[1] - q_starts[0]) if n == 1 else int(np.max(q_starts[1:] - q_starts[:-1]))
        whole = most_queries * (q_heads // kv_heads) <= kernels.ROW_BLOCK
        tasks = n if whole else pairs
        big = work_size >= ATTENTION_PARALLEL_MIN_WORK
        forced = ATTENTION_SPLITS if splits is None else splits
        if forced is not None:
            count = max(1, int(forced))
        elif big and tasks < SPLIT_TASKS_PER_THREAD * numba.config.NUMBA_NUM_THREADS and \
                tasks < SPLIT_TASKS_PER_THREAD * (threads := numba.get_num_threads()):   # (the bound first: cheap)
            count = attention_splits(tasks, _longest_range(seq_lens, q_starts, window, causal), threads)
            count = max(1, min(count, SPLIT_MAX_WORKSPACE // split_bytes))
        else:
            count = 1
        parallel = big and pairs * count > 1
        kernel = kernels.paged_attention_parallel if parallel else serial
        all_heads = not parallel or whole and (n * count >= ALL_HEADS_TASKS_PER_THREAD * numba.config.NUMBA_NUM_THREADS
                                               or n * count >= ALL_HEADS_TASKS_PER_THREAD * numba.get_num_threads())
        if parallel and whole and not all_heads and count == 1 and forced is None:
            even = (threads := numba.get_num_threads()) // math.gcd(n, threads)   # splits: every thread as many tasks
            if _longest_range(seq_lens, q_starts, window, causal) // even >= EVEN_SPLIT_MIN_KEYS \
                    and even * split_bytes <= SPLIT_MAX_WORKSPACE:
                count, all_heads = even, True
        return kernel, tail[:5] + (kv_heads,) + tail[6:] + (count, all_heads), count

    no_workspace = (_NO_SCALES[work], _NO_SCALES[work])

    def run(q, stores, norm=None):
        if type(stores) is PreparedStores:
            kv_heads, flat = stores.kv_heads, stores.flat
        else:
            kv_heads, flat = stores[0].shape[1], flat_stores(stores, quantized, work)
        o = new_output(q.shape, dtype)
        if kv_heads == 0:
            return o
        chosen = kernels_of.get(kv_heads)
        if chosen is None:
            chosen = kernels_of[kv_heads] = choose(kv_heads)
        kernel, args, count = chosen
        qc = q if q.flags.c_contiguous else np.ascontiguousarray(q)
        buffers = (qc.reshape(-1), o.reshape(-1)) if not half_bits else (bits(qc), bits(o))
        if count > 1:   # this run's own workspace: partial accumulators, then (max, sum), per q row, q head, split
            buffers += (np.empty(n_q * q_heads * count * head_dim, work), np.empty(n_q * q_heads * count * 2, work))
        else:
            buffers += no_workspace
        runtime.launch(serial if runtime.in_forked_child() else kernel, serial,
                       buffers + flat + args + (_UNNORMED if norm is None else kernel_norm(norm, work, head_dim)))
        return o

    return run


def _total(a) -> int:
    """The sum of a host int64 array: in Python for decode-sized arrays (cheaper than NumPy's reduction)."""
    return sum(a.tolist()) if a.size <= 64 else int(a.sum())


def _longest_range(seq_lens, q_starts, window, causal) -> int:
    """The most keys a sequence's rows read together (:func:`.numba_kernels.kv_cache.split_keys`' range: causal,
    from its first query's window on; else all of its keys)."""
    if not causal or window >= _NO_WINDOW:
        return int(seq_lens.max())
    counts = np.diff(q_starts)
    return int(np.minimum(seq_lens, window + counts - 1).max())


def paged_attention(q, stores, block_table, page_size, seq_lens, q_starts, *, scale, softcap, window, causal, kv_dtype,
                    rotation=None, norm=None, splits=None):
    """Attention of packed q (T, Hq, D) over each sequence's pages where they lie: sequence i's queries are q's rows
    ``q_starts[i] .. q_starts[i + 1] - 1``, the last of its ``seq_lens[i]`` positions, q normed (``norm``) and
    rotated as it is read when given; see :mod:`rotary.backends`. ``splits``: as :func:`prepare_paged_attention`'s."""
    return prepare_paged_attention(q, block_table, page_size, seq_lens, q_starts, scale=scale, softcap=softcap,
                                   window=window, causal=causal, kv_dtype=kv_dtype, rotation=rotation,
                                   splits=splits)(q, stores, norm)
