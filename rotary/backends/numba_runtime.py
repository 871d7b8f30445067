"""How the ``numba`` backend calls its kernels, once for all of them (rotation and linear attention in
:mod:`rotary.backends.numba`, the KV cache's in :mod:`rotary.backends.numba_kv`; both import this module, it
imports neither):

- **flat buffers**: an array reaches a kernel as a 1-D buffer with int64 element offset and strides
  (:func:`flat_view`, :func:`flat_buffers`), float16 as its uint16 bits, no copy of a strided input;
- **the size rule**: which calls run the parallel kernel (:func:`parallel_by_size`, its thresholds and
  ``ROTARY_NUMBA_DECODE_KERNEL``);
- **the launch** of a parallel kernel (:func:`launch`): Numba's workqueue threading layer is not thread-safe, so
  there a parallel region runs from one thread at a time, a concurrent call taking the serial kernel;
- **fork**: in a child made by ``os.fork()`` every call is serial (GNU OpenMP cannot run there) and the thread
  pool is new;
- **the thread pool** of task-split kernels (:func:`run_tasks`: linear attention's ranges of tasks).

The thresholds are this module's globals, read at each call (set them here: ``numba_runtime.DECODE_KERNEL =
"serial"``).
"""

from __future__ import annotations

import os
import threading

import numba
import numpy as np

# -- flat buffers ------------------------------------------------------------------------------------------------
#: bound on each memo of geometry arrays (cleared when full)
GEO_CACHE_MAX = 256


def strides_ok(a) -> bool:
    """Whether every stride of a is a multiple of its item size (a flat buffer can address it)."""
    itemsize = a.itemsize
    for st in a.strides:
        if st % itemsize:
            return False
    return True


def flat_view(a):
    """``(buf, offset, strides)``: a 1-D view of the memory a spans, a[idx] = buf[offset + idx . strides].

    ``buf`` starts at a's lowest address (negative strides allowed); float16 buffers come as uint16
    bits. None when a stride is not a multiple of the item size (the caller copies then).
    """
    itemsize = a.itemsize
    bits = np.uint16 if a.dtype == np.float16 else a.dtype
    if a.flags.c_contiguous and a.size:   # the common case, without as_strided's cost
        return a.reshape(-1).view(bits), 0, tuple([st // itemsize for st in a.strides])
    if not strides_ok(a):
        return None
    if a.size == 0:
        return np.empty(0, bits), 0, (0,) * a.ndim
    if min(a.strides) >= 0:   # a transposition of a dense block (e.g. a BHSD view): flatten that block
        dense = a.transpose(sorted(range(a.ndim), key=a.strides.__getitem__, reverse=True))
        if dense.flags.c_contiguous:
            return dense.reshape(-1).view(bits), 0, tuple([st // itemsize for st in a.strides])
    low = sum((n - 1) * st for n, st in zip(a.shape, a.strides) if st < 0)
    high = sum((n - 1) * st for n, st in zip(a.shape, a.strides) if st > 0)
    first = a[tuple(slice(n - 1, n) if st < 0 else slice(0, 1) for n, st in zip(a.shape, a.strides))]
    buf = np.lib.stride_tricks.as_strided(first, shape=((high - low) // itemsize + 1,), strides=(itemsize,),
                                          writeable=a.flags.writeable)
    return buf.view(bits), -low // itemsize, tuple(st // itemsize for st in a.strides)


def aligned_empty(shape, dtype, align=64):
    """np.empty(shape, dtype) whose data starts at a multiple of ``align`` bytes (NumPy's own alignment is 16)."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape))
    raw = np.empty(n * dtype.itemsize + align, np.uint8)
    start = -raw.ctypes.data % align
    return raw[start:start + n * dtype.itemsize].view(dtype).reshape(shape)


def bits(a):
    """The flat buffer of a C-contiguous array (a new view; float16 as its uint16 bits)."""
    flat = a.reshape(-1)
    return flat.view(np.uint16) if flat.dtype == np.float16 else flat


def readonly(a):
    """A read-only view of a (one compiled signature for read-only and writable inputs)."""
    view = a.view()
    view.flags.writeable = False
    return view


def readonly_c(a):
    """A read-only C-contiguous array equal to a: a itself when it already is one (cached tables)."""
    if a.flags.writeable or not a.flags.c_contiguous:
        return readonly(np.ascontiguousarray(a))
    return a


def writable_c(a):
    """A writable C-contiguous array equal to a: a itself when it is one, else a copy. The rotation kernels take
    their rows so (they never write them): one compiled signature, and no read-only view per call (~0.4 us)."""
    flags = a.flags
    return a if flags.writeable and flags.c_contiguous else np.array(a, order="C")


def c_int64(a):
    """a as a C-contiguous int64 array (itself when it is one)."""
    a = np.asarray(a)
    return a if a.dtype == np.int64 and a.flags.c_contiguous else np.ascontiguousarray(a, dtype=np.int64)


#: (shape, strides, dtype) of each array of a :func:`flat_buffers` call -> its geometry (a pure function of the key)
_flat_geo_cache: dict = {}


def flat_buffers(arrays):
    """``(buffers, geo)`` of arrays of one rank n: each one's flat buffer (:func:`flat_view`; an array whose strides
    are not multiples of its item size is copied first) and a read-only ``(len(arrays), 1 + n)`` int64 geometry,
    row i ``(offset, strides...)`` of array i. Memoised for C-contiguous arrays (a decode step's glue is a few
    microseconds)."""
    if all([a.flags.c_contiguous for a in arrays]):
        key = tuple([(a.shape, a.strides, a.dtype.char) for a in arrays])
        geo = _flat_geo_cache.get(key)
        if geo is not None:
            return [bits(a) for a in arrays], geo
    else:
        key = None
    views = [flat_view(a) or flat_view(np.ascontiguousarray(a)) for a in arrays]
    geo = np.array([(view[1], *view[2]) for view in views], dtype=np.int64)
    geo.flags.writeable = False
    if key is not None:
        if len(_flat_geo_cache) >= GEO_CACHE_MAX:
            _flat_geo_cache.clear()
        _flat_geo_cache[key] = geo
    return [view[0] for view in views], geo


# -- the size rule ---------------------------------------------------------------------------------------------
#: below this many elements (q + k of a rotation; k + v of an append) a call runs on the calling thread (thread
#: hand-off costs more). Measured (2 cores, fp32, D=128): the serial rotation wins below ~2.5k elements (1.0 vs
#: 2.0 us at 256), the parallel one from ~5k on (2.8 vs 3.0 us at 5120; 15 vs 71 us at 164k, decode B=32).
#: The size rule: >= PARALLEL_MIN_ELEMENTS and >= PARALLEL_MIN_TOKENS tokens runs parallel. One-token-per-sequence
#: calls (decode) below DECODE_PARALLEL_MIN_ELEMENTS follow DECODE_KERNEL: "auto" runs them parallel where the
#: workers spin between calls (Rope decode B=32, 32/8 heads, d=128: 18-19 us against 27-29 serial on a quiet
#: machine) and serial under OMP_WAIT_POLICY=PASSIVE, where every parallel call wakes sleeping workers (the
#: parallel kernel alone 87-107 us against 25-38 serial, measured in bench_numba.py, which sets it). On a busy
#: machine a parallel call now and then waits for a preempted worker (means of 190-420 us were seen):
#: ROTARY_NUMBA_DECODE_KERNEL=serial keeps those calls on the calling thread (docs/getting-started.md).
PARALLEL_MIN_ELEMENTS = 1 << 16
PARALLEL_MIN_TOKENS = 8
DECODE_PARALLEL_MIN_ELEMENTS = 1 << 20
#: the kernel of decode calls between PARALLEL_MIN_ELEMENTS and DECODE_PARALLEL_MIN_ELEMENTS: "auto"
#: (the rule above: parallel, serial under OMP_WAIT_POLICY=PASSIVE), "serial" or "parallel"; the environment
#: variable ROTARY_NUMBA_DECODE_KERNEL sets it at import ("measured", the name of the run-time timing this rule
#: replaced, is read as "auto")
DECODE_KERNEL = os.environ.get("ROTARY_NUMBA_DECODE_KERNEL", "auto")
if DECODE_KERNEL == "measured":
    DECODE_KERNEL = "auto"
if DECODE_KERNEL not in ("auto", "serial", "parallel"):
    raise ValueError(f"environment variable ROTARY_NUMBA_DECODE_KERNEL must be 'auto', 'serial' or "
                     f"'parallel', got {DECODE_KERNEL!r}")
#: OpenMP's documented wait policy: PASSIVE workers sleep between parallel regions (each wake costs more than a
#: decode call's work), ACTIVE (or unset: GNU OpenMP spins a while) they are ready
_PASSIVE_WORKERS = os.environ.get("OMP_WAIT_POLICY", "").strip().upper() == "PASSIVE"


def parallel_by_size(elements: int, n_batch: int, seq_len: int) -> bool:
    """Whether a call over ``n_batch`` sequences of ``seq_len`` tokens and ``elements`` elements runs the parallel
    kernel (the size rule at PARALLEL_MIN_ELEMENTS; decode calls, ``seq_len`` 1, below DECODE_PARALLEL_MIN_ELEMENTS
    as DECODE_KERNEL says); never in a forked child."""
    if _in_forked_child or n_batch * seq_len < PARALLEL_MIN_TOKENS or elements < PARALLEL_MIN_ELEMENTS:
        return False
    if seq_len > 1 or elements >= DECODE_PARALLEL_MIN_ELEMENTS or DECODE_KERNEL == "parallel":
        return True
    return DECODE_KERNEL == "auto" and not _PASSIVE_WORKERS


# -- fork ------------------------------------------------------------------------------------------------------
#: True in a child made by os.fork(): GNU OpenMP (numba's default threading layer) cannot run in a
#: forked child of a process that used it ("fork() called from a process already using GNU OpenMP"),
#: so a forked child runs the serial kernels on its calling thread and makes its own thread pool.
_in_forked_child = False
_pool = None
_pool_lock = threading.Lock()


def in_forked_child() -> bool:
    """Whether this process is a child made by ``os.fork()`` (its kernels run serially)."""
    return _in_forked_child


def _after_fork_in_child():
    global _in_forked_child, _pool, _pool_lock
    _in_forked_child = True
    _pool, _pool_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


# -- the launch of a parallel kernel -------------------------------------------------------------------------------
#: held while a parallel kernel runs under a threading layer that is not thread-safe (workqueue)
_parallel_lock = threading.Lock()
_layer_is_thread_safe = None   # None: Numba has not chosen its threading layer yet (no parallel run so far)


def launch(kernel, serial, args):
    """kernel(*args), where ``kernel`` is the parallel or the ``serial`` form of one kernel. A parallel kernel under
    Numba's workqueue threading layer (not thread-safe: concurrent parallel regions abort the process) runs from one
    thread at a time, a concurrent call taking ``serial`` instead. Before the first parallel run the layer is unknown
    and the lock is taken as well."""
    global _layer_is_thread_safe
    if _layer_is_thread_safe or kernel is serial:
        return kernel(*args)
    if _layer_is_thread_safe is None:
        try:
            _layer_is_thread_safe = numba.threading_layer() != "workqueue"
        except ValueError:   # no parallel region has run yet: the layer is chosen by the first one
            pass
    if _layer_is_thread_safe:
        return kernel(*args)
    if not _parallel_lock.acquire(blocking=False):
        return serial(*args)
    try:
        return kernel(*args)
    finally:
        _parallel_lock.release()


# -- the thread pool -------------------------------------------------------------------------------------------
def run_tasks(kernel, args, n_tasks):
    """kernel(*args, first, last) over 0..n_tasks split into numba.get_num_threads() contiguous ranges,
    run on a thread pool (the kernel releases the GIL); one range runs on the calling thread."""
    global _pool
    n = max(1, min(numba.get_num_threads(), n_tasks))
    bounds = [n_tasks * i // n for i in range(n + 1)]
    if n == 1:
        kernel(*args, 0, n_tasks)
        return
    with _pool_lock:
        if _pool is None:
            from concurrent.futures import ThreadPoolExecutor

            _pool = ThreadPoolExecutor(max_workers=numba.config.NUMBA_NUM_THREADS, thread_name_prefix="rotary-la")
        pool = _pool
    futures = [pool.submit(kernel, *args, bounds[i], bounds[i + 1]) for i in range(1, n)]
    kernel(*args, bounds[0], bounds[1])
    for f in futures:
        f.result()
