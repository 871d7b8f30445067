"""Numba CPU backend: compiled loops, one parallel pass over q and k (see ``numba_kernels``).

The glue here turns each canonical view into a flat buffer with int64 element offset and strides
(no copy of a strided input; ``out is x`` works in place), picks the parallel or the serial kernel
by size, and allocates outputs and states. Importing this module imports numba; ``import rotary``
never imports it (the registry loads this module on first use).
"""

from __future__ import annotations

import os
import threading
import time

import numba  # ImportError here -> the registry's "pip install" hint
import numpy as np

from . import OUTSIDE_TABLE
from .numba_kernels import common, rotation
from .numba_kernels import linear_attention as la_kernels

NAME = "numba"
PACKED_LINEAR_ATTENTION = True   # linear_attention takes cu_seqlens (a packed batch in one pass)
COMPILES_ON_FIRST_CALL = True    # Numba compiles each kernel on its first call (cache=True keeps it on disk)

#: dtypes the kernels take (float16 travels as its uint16 bits and is computed in float32)
DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))
#: below this many elements of q + k a call runs on the calling thread (thread hand-off costs more).
#: Measured (2 cores, fp32, D=128): the serial kernel wins below ~2.5k elements (1.0 vs 2.0 us at
#: 256), the parallel one from ~5k on (2.8 vs 3.0 us at 5120; 15 vs 71 us at 164k, decode B=32).
#: Now: >= 64k elements and >= 8 tokens. One-token-per-sequence calls (decode) of a prepared geometry
#: (Rope, apply_qk) between that and DECODE_PARALLEL_MIN_ELEMENTS run the kernel a :class:`KernelChoice`
#: measures faster: quiet, the parallel one (Rope decode B=32, 32/8 heads, d=128: 18-19 us against 27-29
#: serial); on a busy machine the serial one (the parallel call's mean rose to 190-420 us, its median
#: staying at 19: a worker preempted now and then; issue 14 saw 680 us median). Unprepared decode calls
#: in that range run serial. From DECODE_PARALLEL_MIN_ELEMENTS on, decode runs parallel.
PARALLEL_MIN_ELEMENTS = 1 << 16
PARALLEL_MIN_TOKENS = 8
DECODE_PARALLEL_MIN_ELEMENTS = 1 << 20
#: how prepared decode calls in the measured range pick their kernel: "measured" (:class:`KernelChoice`),
#: "serial" or "parallel"; the environment variable ROTARY_NUMBA_DECODE_KERNEL sets it at import
DECODE_KERNEL = os.environ.get("ROTARY_NUMBA_DECODE_KERNEL", "measured")
if DECODE_KERNEL not in ("measured", "serial", "parallel"):
    raise ValueError(f"environment variable ROTARY_NUMBA_DECODE_KERNEL must be 'measured', 'serial' or "
                     f"'parallel', got {DECODE_KERNEL!r}")

#: True in a child made by os.fork(): GNU OpenMP (numba's default threading layer) cannot run in a
#: forked child of a process that used it ("fork() called from a process already using GNU OpenMP"),
#: so a forked child rotates on its calling thread (serial kernel) and makes its own thread pool.
_in_forked_child = False


def _after_fork_in_child():
    global _in_forked_child, _pool, _pool_lock
    _in_forked_child = True
    _pool, _pool_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def availability():
    return True, "ok"


def accepts(x) -> bool:
    return isinstance(x, np.ndarray) and x.dtype in DTYPES


def flat_view(a):
    """``(buf, offset, strides)``: a 1-D view of the memory a spans, a[idx] = buf[offset + idx . strides].

    ``buf`` starts at a's lowest address (negative strides allowed); float16 buffers come as uint16
    bits. None when a stride is not a multiple of the item size (the caller copies then).
    """
    itemsize = a.itemsize
    bits = np.uint16 if a.dtype == np.float16 else a.dtype
    if a.flags.c_contiguous and a.size:   # the common case, without as_strided's cost
        return a.reshape(-1).view(bits), 0, tuple([st // itemsize for st in a.strides])
    if not _strides_ok(a):
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


def _strides_ok(a) -> bool:
    itemsize = a.itemsize
    for st in a.strides:
        if st % itemsize:
            return False
    return True


def _readonly(a):
    view = a.view()
    view.flags.writeable = False   # one compiled signature for read-only and writable inputs
    return view


def _readonly_c(a):
    """A read-only C-contiguous array equal to a: a itself when it already is one (cached tables)."""
    if a.flags.writeable or not a.flags.c_contiguous:
        return _readonly(np.ascontiguousarray(a))
    return a


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
    return _readonly(xf[0]), of[0], row


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


def _buffer(a, readonly: bool):
    """flat_view(a)[0] (offset and strides live in the cached geometry), cheap for C-contiguous a."""
    if a.flags.c_contiguous:
        buf = a.reshape(-1)   # a new view object, like every buffer flat_view returns
        if a.dtype == np.float16:
            buf = buf.view(np.uint16)
    else:
        buf = flat_view(a)[0]
    if readonly:
        buf.flags.writeable = False   # one compiled signature for read-only and writable inputs
    return buf


#: geo arrays by the group's shapes, strides, item sizes and in-place flags (all that geo depends on)
_geo_cache: dict = {}
_GEO_CACHE_MAX = 256


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
        if len(_geo_cache) >= _GEO_CACHE_MAX:
            _geo_cache.clear()
        _geo_cache[key] = geo
    return geo


def rotate(items, cos, sin, rows, *, rotary_dim, layout, inverse):
    """Rotate every ``(x, out)`` of ``items`` (pairs of items in one pass); see ``rotary.backends``."""
    results = []
    cos, sin, rows = _readonly_c(cos), _readonly_c(sin), _readonly_c(rows)
    prepared = [_prepare(x, out) for x, out in items]
    for first in range(0, len(prepared), 2):
        group = [p for p in prepared[first:first + 2] if p[0].size]
        if group:
            _rotate_group(group, cos, sin, rows, rotary_dim, layout, inverse)
    for x, target, result, copy_back in prepared:
        if copy_back:
            result[...] = target
        results.append(result)
    return results


def _rotate_group(group, cos, sin, rows, rotary_dim, layout, inverse):
    B, S, _, D = group[0][0].shape
    geo = _group_geometry(group)
    bufs = [(_buffer(x, True), _buffer(target, False)) for x, target, _, _ in group]
    if len(bufs) == 1:
        bufs.append(bufs[0])
    elements = group[0][0].size + (group[1][0].size if len(group) > 1 else 0)
    kernel = rotate_kernel(elements, B, S)
    if not kernel(bufs[0][0], bufs[0][1], bufs[1][0], bufs[1][1], geo, cos, sin, rows, 0, B * S, S, rotary_dim // 2,
                  rotary_dim, D, layout == "interleaved", bool(inverse)):
        raise ValueError(f"rows must index the cos/sin table (0 <= row < {cos.shape[0]})")


class PreparedRotation:
    """The ``prepare_rotation`` capability (see :mod:`rotary.backends`): one geometry's kernel, geometry
    array and constants, so a call only flattens its arrays and launches. The kernel checks every row
    against the held table and writes nothing when one falls outside (``run`` returns OUTSIDE_TABLE).

    After a kernel's first call here (through its dispatcher, with read-only inputs: the compiled signature
    of every call), later calls go to that compiled version's entry point directly: the argument types are
    this geometry's by construction (C-contiguous aligned arrays of the plan's dtype, checked by the caller),
    so the dispatcher's per-call type lookup (~0.5 us for 16 arguments) and the read-only views it needs
    (~0.3 us each) are skipped; the entry point unboxes the arrays as the dispatcher would."""

    def __init__(self, views, out_views, *, seq_len, rotary_dim, layout, inverse, offset, f16):
        group = [(v, o, None, False) for v, o in zip(views, out_views)]
        self.geo = _group_geometry(group)
        self.batch, self.seq_len = views[0].shape[0], seq_len
        self.elements = sum(v.size for v in views)   # the kernel is picked per call (rotate_kernel's knobs)
        self.consts = (self.batch * seq_len, seq_len, rotary_dim // 2, rotary_dim, views[0].shape[3],
                       layout == "interleaved", bool(inverse))
        self.offset, self.f16 = offset, f16
        self.nothing = not (views[0].size and self.batch * seq_len)   # no token or no coordinate to rotate
        self.choice = KernelChoice()   # serial or parallel in the decode range (rotate_kernel)
        self.entries = {}              # kernel -> the entry point of its version for this geometry

    def run(self, xs, outs, rows, start, table):
        """Rotate ``xs`` into new arrays, into ``outs`` (in place: ``outs[i] is xs[i]``); token (b, s) at position
        ``rows[b or 0, s] + start``, table ``(base, end, cos, sin, ...)``. The caller guarantees what the entry
        points were compiled for: xs and outs C-contiguous, aligned, of this geometry; rows C-contiguous
        aligned int64 (Bp, S); read-only C-contiguous tables."""
        bufs, results = [], []
        for x, o in zip(xs, outs):
            y = np.empty(x.shape, x.dtype) if o is None else o
            bufs += (x.ravel(), y.ravel())   # views (C-contiguous), 4x cheaper than reshape(-1)
            results.append(y)
        if self.f16 or self.offset:
            bufs = self._spans(xs, results, bufs)
        if len(bufs) == 2:
            bufs += bufs
        if self.nothing:
            return results
        kernel = rotate_kernel(self.elements, self.batch, self.seq_len, self.choice)   # serial in a forked child
        entry = self.entries.get(kernel)
        try:
            if entry is not None:
                inside = entry(bufs[0], bufs[1], bufs[2], bufs[3], self.geo, table[2], table[3], rows,
                               start - table[0], *self.consts)
            else:
                inside = self._first_call(kernel, (_readonly(bufs[0]), bufs[1], _readonly(bufs[2]), bufs[3],
                                                   self.geo, table[2], table[3], _readonly(rows), start - table[0],
                                                   *self.consts))
        finally:
            self.choice.done()
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

    def _first_call(self, kernel, args):
        """A kernel's first call here: through its dispatcher (which compiles or loads it), then its entry
        point kept for the argument types of this call (a stand-in that is no dispatcher: itself)."""
        inside = kernel(*args)
        overloads = getattr(kernel, "overloads", None)
        if overloads is None:
            self.entries[kernel] = kernel
        else:
            compiled = overloads.get(tuple(numba.typeof(a) for a in args))
            if compiled is not None:
                self.entries[kernel] = compiled.entry_point
        return inside


def prepare_rotation(views, out_views, *, seq_len, rotary_dim, layout, inverse, offset, dtype, table=None):
    """A :class:`PreparedRotation` for canonical ``views`` (from the rotary offset on) and the views of
    their outputs (``out_views[i] is views[i]``: in place); the table is passed to each ``run``."""
    return PreparedRotation(views, out_views, seq_len=seq_len, rotary_dim=rotary_dim, layout=layout,
                            inverse=inverse, offset=offset, f16=np.dtype(dtype) == np.float16)


def empty(shape, dtype):
    """A new host array (the allocator of this backend's outputs)."""
    return np.empty(shape, dtype)


def rotate_kernel(elements: int, n_batch: int, seq_len: int, choice=None):
    """The rotation kernel for a call of this size (see PARALLEL_MIN_ELEMENTS); serial in a forked child.
    ``choice``: the call geometry's :class:`KernelChoice`, which picks in the decode range where either
    kernel can be the faster (without one, serial there)."""
    if _in_forked_child or n_batch * seq_len < PARALLEL_MIN_TOKENS or elements < PARALLEL_MIN_ELEMENTS:
        return rotation.rotate_qk_serial
    if seq_len > 1 or elements >= DECODE_PARALLEL_MIN_ELEMENTS:
        return rotation.rotate_qk_parallel
    mode = DECODE_KERNEL if choice is not None else "serial"
    if mode == "measured":
        return rotation.rotate_qk_parallel if choice.parallel() else rotation.rotate_qk_serial
    return rotation.rotate_qk_parallel if mode == "parallel" else rotation.rotate_qk_serial


class KernelChoice:
    """Serial or parallel rotation kernel for the decode calls of one geometry, by measured mean time.

    Calls are timed in blocks of ``BLOCK``; a block's time per call is the mean without its first call
    (which pays the switch) and without its slowest (one hiccup of the machine). One block of each kernel
    first; the faster then runs ``period`` calls, its estimate a running average over its blocks (a quarter
    the newest); when that exceeds the other's, or after ``period`` calls, the other is timed again (its
    estimate that block's: the machine may have changed) in a block that stops as soon as its calls took
    twice a whole block of the faster. In the faster's run, a timed block is followed by ``UNTIMED_BLOCKS``
    blocks that are not timed (two clock reads and the accounting cost ~0.4 us a call, 2 % of a decode
    call). ``period`` doubles up to ``MAX_PERIOD`` while the slower stays
    slower and starts again at ``FIRST_PERIOD`` when they swap. Means, not medians: on a busy machine a
    parallel call is usually as fast as on a quiet one and now and then waits milliseconds for a preempted
    worker. Both kernels compute the same values bit for bit; only the time differs. Not locked: calls
    from several threads at once can miscount, never fail.
    """

    BLOCK = 32
    UNTIMED_BLOCKS = 3
    FIRST_PERIOD = 64
    MAX_PERIOD = 16384

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.estimate = [None, None]      # seconds per call of the serial and the parallel kernel
        self.winner = 1                   # the kernel of the long runs
        self.timing = 0                   # the kernel of a block timed to compare, or None (the winner's run)
        self.period = self.FIRST_PERIOD
        self.left = 0                     # calls of the winner's run before the other is timed again
        self.untimed = 0                  # calls of the winner's run before its next timed block
        self.started = None
        self._new_block()

    def _new_block(self):
        # calls, seconds of them all, seconds of all but the first, the slowest of those
        self.calls, self.wall, self.spent, self.slowest = 0, 0.0, 0.0, 0.0

    def parallel(self) -> bool:
        """Whether the next call runs the parallel kernel (then call :meth:`done`)."""
        if self.untimed:
            self.untimed -= 1
            return bool(self.winner)
        self.started = self.clock()
        return bool(self.winner if self.timing is None else self.timing)

    def done(self):
        """Account the call since :meth:`parallel` (nothing when it did not ask)."""
        started, self.started = self.started, None
        if started is None:
            return
        elapsed = self.clock() - started
        arm = self.winner if self.timing is None else self.timing
        other = 1 - arm
        self.calls += 1
        self.wall += elapsed
        if self.calls > 1:
            self.spent += elapsed
            self.slowest = max(self.slowest, elapsed)
        against = self.estimate[other] if self.timing is not None else None
        hopeless = against is not None and self.wall > 2 * self.BLOCK * against
        if self.calls < self.BLOCK and not hopeless:
            return
        mean = self.wall / self.calls if hopeless else (self.spent - self.slowest) / (self.calls - 2)
        self._new_block()
        if self.timing is None:           # a block of the winner's run
            self.estimate[arm] = 0.75 * self.estimate[arm] + 0.25 * mean
            self.left -= self.BLOCK
            if self.left <= 0 or self.estimate[arm] > self.estimate[other]:
                self.timing = other
            else:
                self.untimed = min(self.left, self.UNTIMED_BLOCKS * self.BLOCK)
                self.left -= self.untimed
            return
        self.estimate[arm] = mean
        if self.estimate[other] is None:  # the first comparison: the other kernel's block next
            self.timing = other
            return
        faster = 0 if self.estimate[0] <= self.estimate[1] else 1
        if faster == self.winner:
            self.period = min(2 * self.period, self.MAX_PERIOD)
        else:
            self.winner, self.period = faster, self.FIRST_PERIOD
        self.timing, self.left = None, self.period


def linear_attention(q, k, v, cos, sin, rows, *, rotary_dim, layout, causal, feature_map, eps, chunk, state,
                     decay=None, normalize=True, cu_seqlens=None):
    """Chunked linear attention with RoPE in the numerator; see ``rotary.backends`` for the contract.

    One task per (batch, k/v head) running its q heads, ranges of tasks on ``numba.get_num_threads()``
    threads; a one-token call (decode) runs :func:`la_kernels.linear_attention_step` on the calling
    thread (no thread hand-off, one pass over S). ``cu_seqlens`` (N + 1 int64 offsets, q of batch 1):
    a packed batch in one pass, one task per (sequence, k/v head), states (N, Hk, ...).
    """
    if (q.shape[1] == 1 and cu_seqlens is None and decay is None and state is not None
            and type(q) is type(k) is type(v) is np.ndarray):
        o = _one_token_step(q, k, v, cos, sin, rows, state, rotary_dim, layout, feature_map, eps, normalize)
        if o is not None:
            return o
    from .numpy_linear import decay_powers

    B, S, H, m = q.shape
    Hk, dv = k.shape[2], v.shape[3]
    groups = H // Hk if Hk else 1
    work = np.float64 if q.dtype == np.float64 else np.float32
    cos = _readonly_c(cos if cos.dtype == work else cos.astype(work))
    sin = _readonly_c(sin if sin.dtype == work else sin.astype(work))
    rows = _readonly_c(rows if rows.dtype == np.int64 else rows.astype(np.int64))
    if feature_map not in la_kernels.FEATURE_MAPS:
        raise ValueError(f"feature_map must be one of {tuple(la_kernels.FEATURE_MAPS)}, got {feature_map!r}")
    n_states = B
    if cu_seqlens is not None:
        cu_seqlens = _readonly_c(np.asarray(cu_seqlens, dtype=np.int64))
        n_states = cu_seqlens.shape[0] - 1
    if state is None:
        state_s, state_z = np.zeros((n_states, Hk, m, dv), work), np.zeros((n_states, Hk, m), work)
    else:
        state_s = np.ascontiguousarray(state[0], dtype=work)
        state_z = (np.zeros((n_states, Hk, m), work) if state[1] is None
                   else np.ascontiguousarray(state[1], dtype=work))
    o = _aligned_empty((B, S, H, dv), q.dtype)   # aligned rows: the kernel streams a large o (non-temporal stores)
    new_s, new_z = np.empty((n_states, Hk, m, dv), work), np.empty((n_states, Hk, m), work)
    if n_states * Hk == 0:
        return o, (new_s, new_z)
    chunk = max(1, min(int(chunk), S))
    decayed = decay is not None and bool(np.any(np.asarray(decay) != 1))
    powers = _readonly(decay_powers(decay, chunk)) if decayed else _NO_POWERS
    bufs, geo = [], np.zeros((4, 5), dtype=np.int64)
    for i, a in enumerate((q, k, v, o)):
        view = flat_view(a)
        if view is None:
            view = flat_view(np.ascontiguousarray(a))
        geo[i] = (view[1], *view[2])
        bufs.append(view[0] if i == 3 else _readonly(view[0]))
    interleaved, fmap = layout == "interleaved", la_kernels.FEATURE_MAPS[feature_map]
    if S == 1 and cu_seqlens is None:
        la_kernels.linear_attention_step(*bufs, geo, cos, sin, rows, _readonly(state_s), _readonly(state_z), new_s,
                                      new_z, rotary_dim // 2, rotary_dim, interleaved, fmap, float(eps), groups,
                                      powers, decayed, bool(normalize))
    else:
        args = (*bufs, geo, cos, sin, rows, _readonly(state_s), _readonly(state_z), new_s, new_z, S, rotary_dim // 2,
                rotary_dim, interleaved, True if causal else None, fmap, float(eps), chunk, groups, powers if decayed else None,
                bool(normalize), _NO_SEQLENS if cu_seqlens is None else cu_seqlens)
        _run_tasks(la_kernels.linear_attention_tasks, args, n_states * Hk)
    return o, (new_s, new_z)


def _aligned_empty(shape, dtype, align=64):
    """np.empty(shape, dtype) whose data starts at a multiple of ``align`` bytes (NumPy's own alignment is 16)."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape))
    raw = np.empty(n * dtype.itemsize + align, np.uint8)
    start = -raw.ctypes.data % align
    return raw[start:start + n * dtype.itemsize].view(dtype).reshape(shape)


#: (q, k, v shapes) -> the (4, 5) geometry of C-contiguous q, k, v and o (see _one_token_step)
_step_geo_cache: dict = {}


def _one_token_step(q, k, v, cos, sin, rows, state, rotary_dim, layout, feature_map, eps, normalize):
    """The one-token step without decay for C-contiguous q, k, v of one dtype and a C-contiguous state in
    that (work) dtype: the general path's kernel call with less glue (geometry cached by shapes, buffers
    as flat reshapes). None when the call is not that case (the general path takes it)."""
    S0, z0 = state
    dtype = q.dtype
    if (dtype == np.float16 or k.dtype != dtype or v.dtype != dtype or type(S0) is not np.ndarray
            or type(z0) is not np.ndarray or S0.dtype != dtype or z0.dtype != dtype or cos.dtype != dtype
            or sin.dtype != dtype or rows.dtype != np.int64 or feature_map not in la_kernels.FEATURE_MAPS):
        return None
    for a in (q, k, v, S0, z0, cos, sin, rows):
        if not a.flags.c_contiguous:
            return None
    B, _, H, m = q.shape
    Hk, dv = k.shape[2], v.shape[3]
    if B * Hk == 0 or S0.shape != (B, Hk, m, dv) or z0.shape != (B, Hk, m) or not q.size or not v.size:
        return None
    key = (q.shape, k.shape, v.shape)
    geo = _step_geo_cache.get(key)
    if geo is None:   # offset 0 and the C strides (in elements) of q, k, v and o
        geo = np.zeros((4, 5), dtype=np.int64)
        for i, (_, n1, n2, n3) in enumerate((q.shape, k.shape, v.shape, (B, 1, H, dv))):
            geo[i, 1:] = (n1 * n2 * n3, n2 * n3, n3, 1)
        if len(_step_geo_cache) >= _GEO_CACHE_MAX:
            _step_geo_cache.clear()
        _step_geo_cache[key] = geo
    o = np.empty((B, 1, H, dv), dtype=dtype)
    new_s, new_z = np.empty(S0.shape, dtype), np.empty(z0.shape, dtype)
    qb, kb, vb = q.reshape(-1), k.reshape(-1), v.reshape(-1)   # new view objects
    qb.flags.writeable = kb.flags.writeable = vb.flags.writeable = False
    S0, z0, cos, sin, rows = [_readonly(a) if a.flags.writeable else a for a in (S0, z0, cos, sin, rows)]
    la_kernels.linear_attention_step(qb, kb, vb, o.reshape(-1), geo, cos, sin, rows, S0, z0, new_s, new_z,
                                  rotary_dim // 2, rotary_dim, layout == "interleaved",
                                  la_kernels.FEATURE_MAPS[feature_map], float(eps), H // Hk, _NO_POWERS, False,
                                  bool(normalize))
    return o, (new_s, new_z)


_NO_POWERS = _readonly(np.ones((1, 1, 1)))   # the powers argument of a call without decay (not read)
_NO_SEQLENS = _readonly(np.zeros(0, np.int64))   # the cu_seqlens argument of an unpacked call
_pool = None
_pool_lock = threading.Lock()


def _run_tasks(kernel, args, n_tasks):
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
