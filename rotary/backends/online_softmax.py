"""The blocked (online-softmax) engine of :func:`rotary.attention`: the tile schedule and the loops.

``o_t = sum_s softmax_s(cap(scale * <q_t, k_s>) + mask_ts) v_s`` on already rotated q and k, computed
flash-attention's way: per q block a running row max ``m``, sum ``l`` and accumulator ``acc`` over the
key blocks, ``m' = max(m, max_s s_ts)``, ``l' = l e^{m - m'} + sum_s e^{s_ts - m'}``,
``acc' = acc e^{m - m'} + e^{s - m'} v``, and ``o = acc / l`` (0 where no key is visible or every
visible score is -inf); ``cap(x) = c tanh(x / c)`` with ``softcap=c``, the mask 0 or -inf. Memory
O(q_len x block), not O(q_len x k_len).

The schedule (:func:`tiles`) is block-sparse: tiles the mask hides entirely are skipped, tiles it
shows entirely run without a mask, only the rest get a per-token mask. Two engines walk it:

- :func:`numpy_attention` (NumPy inputs): a tile is one k/v head with the q heads that share it
  (GQA: one (g x q block, d) @ (d, block) matmul), sized to stay in cache, the scores in reused
  buffers; the k/v heads are shared out over one thread per core with single-threaded BLAS (many
  small matmuls from several threads and a multi-threaded BLAS lose several-fold). The BLAS limit
  goes through threadpoolctl and is process-wide for most BLAS builds, see :func:`_blas_threads`.
- :func:`array_api_attention` (CuPy, torch, small NumPy calls such as a decode step): a tile spans
  every head, one batched matmul, any array-API namespace.

Scores and softmax are float32 (float64 for float64 inputs). The frontend (:mod:`rotary.attn.softmax`)
checks the arguments, builds positions and the :class:`Mask`, rotates q and k, and calls
:func:`blocked_attention`.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from typing import NamedTuple

import numpy as np
from array_api_compat import device as xp_device, is_cupy_array, is_numpy_array

from .array_api import visible_matmul

#: target size of one tile of scores on the NumPy path, in elements ((g x q block) rows x block_size keys):
#: 512 KiB of float32, so the scores stay in a core's L2 through softmax; 32x that (every head) on devices
_SCORE_BLOCK_ELEMENTS = 1 << 17


def blocked_attention(xp, q, k, v, seq_axis, gqa_axis, mask, scale, softcap, block_size, *, numpy_tiles,
                      q_is_scratch):
    """Softmax attention of rotated q (..., Sq, ..., d) against k (..., Sk, ..., d), v (..., Sk, ..., dv)
    (``seq_axis`` normalized, ``gqa_axis`` the head axis where k has Hq / g heads, or None). ``mask``: a
    :class:`Mask` or None (every key visible). ``numpy_tiles``: the NumPy tile loop (NumPy inputs),
    else the array-API loop. ``q_is_scratch``: q is the caller's own fresh array (the rotation's output),
    which the array-API loop may scale in place. Returns q's array type and dtype, last dim dv."""
    ax, gaxis = seq_axis, gqa_axis
    work = xp.float64 if q.dtype == xp.float64 else xp.float32
    fold = scale / softcap if softcap else scale
    # (lead..., S, d) views; the GQA axis split into (Hk, g) for q
    qf, kf, vf = (xp.moveaxis(a, ax, -2) for a in (q, k, v))
    gpos = gaxis - (1 if gaxis > ax else 0) if gaxis is not None else None
    g = q.shape[gaxis] // k.shape[gaxis] if gaxis is not None else 1
    if gaxis is not None:
        qf = xp.reshape(qf, qf.shape[:gpos] + (k.shape[gaxis], g) + qf.shape[gpos + 1:])
    if numpy_tiles:
        # (U..., g, S, d): the g q heads of one k/v head next to the sequence axis (views, no copies)
        qf = np.moveaxis(qf, gpos + 1, -3) if gaxis is not None else qf[..., None, :, :]
        vf = vf if vf.dtype == work else vf.astype(work)   # (k is copied per head, in the work dtype)
        out = np.empty(q.shape[:-1] + (v.shape[-1],), dtype=q.dtype)
        of = np.moveaxis(out, ax, -2)
        of = (np.moveaxis(np.reshape(of, of.shape[:gpos] + (k.shape[gaxis], g) + of.shape[gpos + 1:]), gpos + 1, -3)
              if gaxis is not None else of[..., None, :, :])
        numpy_attention(qf, kf, vf, of, mask, fold, softcap, block_size, work)
        return out
    if gaxis is not None:   # k/v broadcast over the g axis
        kf, vf = (xp.reshape(a, a.shape[:gpos] + (a.shape[gpos], 1) + a.shape[gpos + 1:]) for a in (kf, vf))
    if q_is_scratch and qf.dtype == work and (is_numpy_array(qf) or is_cupy_array(qf)):
        qf *= fold   # q is the rotation's fresh output here: scaled in place
    else:
        qf = xp.astype(qf, work) * fold   # a scaled work copy (the caller's q is never modified)
    kf, vf = xp.astype(kf, work, copy=False), xp.astype(vf, work, copy=False)
    o = array_api_attention(xp, qf, kf, vf, mask, softcap, block_size)
    if gaxis is not None:
        o = xp.reshape(o, o.shape[:gpos] + (q.shape[gaxis],) + o.shape[gpos + 2:])
    o = xp.moveaxis(o, -2, ax)
    return xp.astype(o, q.dtype, copy=False)


class Mask(NamedTuple):
    """Who sees whom: key s is visible to query t when ``q_seq[t] == k_seq[s]`` (packed input only),
    and, with ``causal``, ``k_pos[s] <= q_pos[t]`` and ``q_pos[t] - k_pos[s] < window``.
    q_pos (Bp, Sq) and k_pos (Bp, Sk) are int64 1-D mask coordinates (Bp: 1 or the batch, axis 0);
    q_seq (Sq,) and k_seq (Sk,) the sequence ids of packed tokens (None otherwise)."""

    q_pos: np.ndarray
    k_pos: np.ndarray
    q_seq: np.ndarray | None
    k_seq: np.ndarray | None
    causal: bool
    window: int | None

    def visible(self, q0, q1, k0, k1):
        """(Bp, q1-q0, k1-k0) bool: which keys of block [k0, k1) each query of [q0, q1) sees."""
        qp, kp = self.q_pos[:, q0:q1, None], self.k_pos[:, None, k0:k1]
        vis = np.ones(np.broadcast_shapes(qp.shape, kp.shape), dtype=bool)
        if self.causal:
            vis &= kp <= qp
            if self.window is not None:
                vis &= (qp - kp) < self.window
        if self.q_seq is not None:
            vis &= self.q_seq[None, q0:q1, None] == self.k_seq[None, None, k0:k1]
        return vis


def _block_bounds(a, size):
    """Per block of ``size`` along the last axis of ``a`` ((Bp, S) or (S,)): (min, max) over the block."""
    a = a.reshape(-1, a.shape[-1])
    starts = np.arange(0, a.shape[1], size)
    if a.shape[1] == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.minimum.reduceat(a.min(axis=0), starts), np.maximum.reduceat(a.max(axis=0), starts)


def tiles(mask, sq, sk, q_block, k_block):
    """The block-sparse schedule: per block of q_block queries, ``(q0, q1, [(k0, k1, hidden), ...])``
    with the key blocks that hold a visible key; ``hidden`` (Bp, q1-q0, k1-k0) bool is True where the
    key is masked, or None for a block the queries see entirely. Generated one q block at a time (so
    the masks held never exceed one row of tiles). Block bounds decide most tiles; the rest (the
    diagonal, the window's edge, packed sequence boundaries) get their exact mask, trimmed to the keys
    some query of the block sees."""
    kstarts = range(0, sk, k_block)
    if mask is None:
        every = [(k0, min(sk, k0 + k_block), None) for k0 in kstarts]
        for q0 in range(0, sq, q_block):
            yield q0, min(sq, q0 + q_block), every
        return
    qlo, qhi = _block_bounds(mask.q_pos, q_block)
    klo, khi = _block_bounds(mask.k_pos, k_block)
    packed = mask.q_seq is not None
    if packed:
        qslo, qshi = _block_bounds(mask.q_seq, q_block)
        kslo, kshi = _block_bounds(mask.k_seq, k_block)
    causal, window = mask.causal, mask.window
    for qi, q0 in enumerate(range(0, sq, q_block)):
        q1 = min(sq, q0 + q_block)
        row = []
        for ki, k0 in enumerate(kstarts):
            k1 = min(sk, k0 + k_block)
            if packed and (kshi[ki] < qslo[qi] or kslo[ki] > qshi[qi]):
                continue   # no common sequence
            if causal and (klo[ki] > qhi[qi] or (window is not None and qlo[qi] - khi[ki] >= window)):
                continue   # every key after every query, or out of every query's window
            full = not packed or qslo[qi] == qshi[qi] == kslo[ki] == kshi[ki]
            if causal:
                full = full and khi[ki] <= qlo[qi] and (window is None or qhi[qi] - klo[ki] < window)
            if full:
                row.append((k0, k1, None))
                continue
            vis = mask.visible(q0, q1, k0, k1)
            seen = np.flatnonzero(vis.any(axis=(0, 1)))
            if seen.size == 0:
                continue
            a, b = int(seen[0]), int(seen[-1]) + 1   # trimmed to the keys some query sees
            vis = vis[..., a:b]
            row.append((k0 + a, k0 + b, None if vis.all() else ~vis))
        yield q0, q1, row


def numpy_attention(qf, kf, vf, out, mask, fold, softcap, block_size, work):
    """Blocked online softmax on NumPy views: qf (U..., g, Sq, d) unscaled queries (any float dtype,
    any strides), kf (U..., Sk, d), vf (U..., Sk, dv), written to out (U..., g, Sq, dv). U: the k/v
    heads (and batch: axis 0 when the mask is per batch), g: the q heads sharing one k/v head (GQA).

    Per tile, the g heads of a k/v head are one (g*Bq, d) @ (d, Bk) matmul; the scores stay in a
    reused (g*Bq, Bk) buffer (about ``_SCORE_BLOCK_ELEMENTS``: cache-sized) through the cap, mask,
    max, exp and sum, all in place. Rows that see no key (or only -inf scores) give 0. The k/v heads
    are shared out over threads with single-threaded BLAS (:func:`_blas_threads`); serial, with the
    BLAS's own threads, where that cannot be arranged.
    """
    units, (g, sq, d) = qf.shape[:-3], qf.shape[-3:]
    sk, dv = kf.shape[-2], vf.shape[-1]
    if sq == 0 or sk == 0 or math.prod(units) == 0:
        out[...] = 0
        return
    block_size = max(1, min(block_size, sk))
    q_block = max(1, min(sq, _SCORE_BLOCK_ELEMENTS // (g * block_size)))
    per_batch = mask is not None and mask.q_pos.shape[0] > 1
    schedule = list(tiles(mask, sq, sk, q_block, block_size))   # masks: about Sq x block_size bools
    unit_list = list(np.ndindex(units))

    def attend_units(some_units, limit_here):
        # limit_here: this worker sets its own limit too (BLAS with per-thread limits, OpenMP builds)
        with limit_here() if limit_here is not None else contextlib.nullcontext():
            rows = g * q_block
            buffers = (np.empty(rows * d, dtype=work), np.empty(rows * block_size, dtype=work),
                       np.empty(rows * dv, dtype=work), np.empty((sk, d), dtype=work))
            for u in some_units:
                _attend_unit(qf[u], kf[u], vf[u], out[u], mask, u[0] if per_batch else 0, schedule, fold,
                             softcap, work, buffers)

    with _blas_threads(len(unit_list)) as (n_threads, limit_here):
        if n_threads <= 1:
            attend_units(unit_list, None)
            return
        with ThreadPoolExecutor(n_threads) as pool:
            for done in [pool.submit(attend_units, unit_list[i::n_threads], limit_here) for i in range(n_threads)]:
                done.result()


#: one threaded section at a time: the BLAS thread limit it sets is process-wide
_SECTION = threading.Lock()


@lru_cache(maxsize=1)
def _blas_controller():
    """threadpoolctl's controller of the BLAS libraries loaded now (NumPy's among them), or None when it
    finds none it can set (the engine then runs serially and lets the BLAS thread itself)."""
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:   # a source tree without its dependencies: serial
        return None
    blas = ThreadpoolController().select(user_api="blas")
    return blas if blas.lib_controllers else None


def _blas_thread_counts(blas):
    return [n for n in (info.get("num_threads") for info in blas.info()) if n is not None]


@contextlib.contextmanager
def _blas_threads(n_units):
    """Context for a section that shares n_units of small matmuls out over threads: yields
    ``(n_threads, limit_here)``. n_threads <= 1: run serially, BLAS untouched. Otherwise every BLAS
    library runs single-threaded until the section ends, and each worker enters ``limit_here()``.

    ``threadpool_limits(1, "blas")`` is process-wide for OpenBLAS's pthreads build (NumPy's wheels), MKL
    and BLIS: set once by the calling thread around the whole section (which waits for its workers) and
    restored after, one section at a time (``_SECTION``; a concurrent call waits: the cores are busy
    anyway). OpenBLAS's OpenMP build keeps a limit per thread, so each worker sets its own as well
    (``limit_here``; a no-op elsewhere). While a section runs, other threads' BLAS calls are
    single-threaded too. The user's limits stand: n_threads is at most the cores this process may
    use, ``NUMBA_NUM_THREADS`` and the BLAS's thread count before the section (``OPENBLAS_NUM_THREADS``,
    a ``threadpool_limits`` of the user's); a BLAS at 1 thread, or one whose limit another thread
    holds (threadpoolctl >= 3.8 lets one thread at a time set OpenBLAS's), gives the serial loop.
    """
    n = min(n_units, _cpu_count(), _numba_threads())
    blas = _blas_controller() if n > 1 else None
    if blas is None:
        yield 1, None
        return
    with _SECTION:
        n = min([n] + _blas_thread_counts(blas))
        if n <= 1:
            yield 1, None
            return
        with blas.limit(limits=1, user_api="blas"):
            if max(_blas_thread_counts(blas), default=1) > 1:   # the limit did not take
                yield 1, None
            else:
                yield n, lambda: blas.limit(limits=1, user_api="blas")


def _cpu_count():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:   # not Linux
        return os.cpu_count() or 1


def _numba_threads():
    """The user's NUMBA_NUM_THREADS (Numba's config when Numba is imported; never imports it), else no cap."""
    numba = sys.modules.get("numba")
    value = getattr(getattr(numba, "config", None), "NUMBA_NUM_THREADS", None) or os.environ.get("NUMBA_NUM_THREADS")
    try:
        return max(1, int(value)) if value else sys.maxsize
    except ValueError:
        return sys.maxsize


def _attend_unit(qu, ku_in, vu, ou, mask, b, schedule, fold, softcap, work, buffers):
    """One k/v head: qu (g, Sq, d), ku_in (Sk, d), vu (Sk, dv) -> ou (g, Sq, dv), along the schedule."""
    q_buf, s_buf, pv_buf, ku = buffers
    g, _, d = qu.shape
    dv = vu.shape[-1]
    neg_inf = -math.inf
    np.copyto(ku, ku_in)   # BLAS needs K^T with unit stride along d (a strided K row falls off BLAS)
    for q0, q1, row in schedule:
        bq = q1 - q0
        r = g * bq
        qt = q_buf[:r * d].reshape(g, bq, d)
        np.multiply(qu[:, q0:q1, :], fold, out=qt)   # the scale (and 1/softcap) folded into q
        qt = qt.reshape(r, d)
        m = np.full((r, 1), neg_inf, dtype=work)
        l = np.zeros((r, 1), dtype=work)
        acc = np.zeros((r, dv), dtype=work)
        for k0, k1, hidden in row:
            s = s_buf[:r * (k1 - k0)].reshape(r, k1 - k0)
            np.matmul(qt, ku[k0:k1].T, out=s)
            if softcap:
                np.tanh(s, out=s)
                s *= softcap
            if hidden is not None:
                np.copyto(s.reshape(g, bq, k1 - k0), neg_inf, where=hidden[b])
            m_new = np.maximum(m, s.max(axis=1, keepdims=True))
            # a row whose scores so far are all -inf (no visible key, or -inf data) keeps max -inf: subtract 0
            # there (its exps are 0), so a later finite score still gives it a finite result
            m_safe = np.where(m_new == neg_inf, 0.0, m_new)
            s -= m_safe
            np.exp(s, out=s)
            alpha = np.exp(m - m_safe)
            l *= alpha
            l += s.sum(axis=1, keepdims=True)
            acc *= alpha
            pv = pv_buf[:r * dv].reshape(r, dv)
            np.matmul(s, vu[k0:k1], out=pv)
            if hidden is not None and not np.isfinite(pv).all():   # a masked key's NaN must not leak in
                visible = ~np.broadcast_to(hidden[b], (g,) + hidden[b].shape).reshape(r, k1 - k0)
                pv = visible_matmul(np, s, vu[k0:k1], visible, product=pv)
            acc += pv
            m = m_new
        l[l == 0] = 1.0   # no visible key, or visible scores all -inf: 0 (torch's scaled_dot_product_attention)
        np.divide(acc.reshape(g, bq, dv), l.reshape(g, bq, 1), out=ou[:, q0:q1, :], casting="same_kind")


def _cupy():
    import cupy

    return cupy


def array_api_attention(xp, qf, kf, vf, mask, softcap, block_size):
    """Online-softmax attention of scaled q (lead..., Sq, d) against k (lead..., Sk, d), v (lead..., Sk, dv)
    (lead axes broadcast) for any array-API namespace (CuPy, torch, ...): each tile spans every head
    (one batched matmul), sized for a device (``_SCORE_BLOCK_ELEMENTS * 32`` scores). Returns
    (lead..., Sq, dv) in q's work dtype; rows that see no key (or only -inf scores) are 0."""
    lead = tuple(max(a, b) for a, b in zip(qf.shape[:-2], kf.shape[:-2]))
    sq = qf.shape[-2]
    sk, dv = kf.shape[-2], vf.shape[-1]
    dtype = qf.dtype
    inplace = is_numpy_array(qf) or is_cupy_array(qf)
    native = np if is_numpy_array(qf) else (_cupy() if inplace else None)   # ufuncs with out=
    dev = xp_device(qf)
    if sq == 0 or sk == 0 or math.prod(lead) == 0:
        return xp.zeros(lead + (sq, dv), dtype=dtype, device=dev)
    block_size = max(1, min(block_size, sk))
    q_block = int(max(1, min(sq, (_SCORE_BLOCK_ELEMENTS * 32) // (max(1, math.prod(lead)) * block_size))))
    n_lead = len(lead)
    neg_inf = -math.inf
    out = xp.empty(lead + (sq, dv), dtype=dtype, device=dev) if inplace else None
    parts = []
    for q0, q1, row in tiles(mask, sq, sk, q_block, block_size):
        qb = qf[..., q0:q1, :]
        m = xp.full(lead + (q1 - q0, 1), neg_inf, dtype=dtype, device=dev)
        l = xp.zeros(lead + (q1 - q0, 1), dtype=dtype, device=dev)
        acc = xp.zeros(lead + (q1 - q0, dv), dtype=dtype, device=dev)
        for k0, k1, hidden in row:
            s = xp.matmul(qb, xp.matrix_transpose(kf[..., k0:k1, :]))
            if softcap:
                if inplace:
                    native.tanh(s, out=s)
                    s *= softcap
                else:
                    s = xp.tanh(s) * softcap
            if hidden is not None:   # (Bp, bq, bk), Bp on lead axis 0
                hidden = (hidden.reshape((hidden.shape[0],) + (1,) * (n_lead - 1) + hidden.shape[1:])
                          if n_lead else hidden[0])
                hidden = xp.asarray(hidden, device=dev) if not is_numpy_array(s) else hidden
                s = xp.where(hidden, xp.asarray(neg_inf, dtype=dtype, device=dev), s)
            m_new = xp.maximum(m, xp.max(s, axis=-1, keepdims=True))
            m_safe = xp.where(m_new == neg_inf, xp.asarray(0.0, dtype=dtype, device=dev), m_new)
            if inplace:
                s -= m_safe
                native.exp(s, out=s)
                p = s
            else:
                p = xp.exp(s - m_safe)
            alpha = xp.exp(m - m_safe)
            l = l * alpha + xp.sum(p, axis=-1, keepdims=True)
            pv = xp.matmul(p, vf[..., k0:k1, :])
            if hidden is not None:   # a masked key's NaN must not leak in
                pv = visible_matmul(xp, p, vf[..., k0:k1, :], xp.logical_not(hidden), product=pv)
            acc = acc * alpha + pv
            m = m_new
        res = acc / xp.where(l > 0, l, xp.asarray(1.0, dtype=dtype, device=dev))
        if inplace:
            out[..., q0:q1, :] = res
        else:
            parts.append(res)
    return out if inplace else xp.concat(parts, axis=-2)

