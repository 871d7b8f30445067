"""Softmax attention on RoPE-rotated q and k, for training-free inference (any array-API namespace).

``o_t = sum_s softmax_s(cap(scale * <R_{p_t} q_t, R_{p_s} k_s>) + mask_ts) v_s`` where
``cap(x) = c tanh(x / c)`` with ``softcap=c`` (Gemma 2; identity without it) and ``mask_ts`` is 0 or
-inf: with ``causal``, key s is visible to query t when ``p_s <= p_t``; with ``window=w`` also only
when ``p_t - p_s < w`` (Mistral/Gemma ``sliding_window``: the query and the w-1 keys before it).

Positions: keys sit at ``positions`` (None -> 0..k_len-1, an int -> offset + 0..k_len-1, or an
array), and the q_len queries at the *last* q_len of those positions: a KV cache's new tokens,
flash-attn's end-aligned causal mask (query i sees keys up to k_len - q_len + i). ``q_positions``
and ``k_positions`` give both explicitly instead (the mask then compares them). Multi-axis (M-RoPE)
positions rotate as given and the mask uses token indices, end-aligned (HF Qwen2-VL's rule: the
mask follows token order); ``q_mask_positions``/``k_mask_positions`` give other 1-D mask coordinates.

Grouped-query attention: q head j uses k/v head ``j // (Hq / Hk)`` (HF ``repeat_kv``), by
broadcasting, never by copying k/v. Packed batches: ``cu_seqlens`` (q) and ``cu_seqlens_k`` (k/v,
default cu_seqlens), flash-attn's varlen form: the tokens of each sequence attend only to their own
sequence's keys, positions restart per sequence (at ``seqlen_offsets``).

The computation is blocked (flash-attention's online softmax) over a block-sparse schedule of tiles
(q block x ``block_size`` keys, :func:`_tiles`): tiles the mask hides entirely are skipped, tiles it
shows entirely run without a mask, and only the rest (the causal diagonal, the window's edge,
packed sequence boundaries) get a per-token mask; a packed batch is one sweep over all its tokens.
Per row a running max and sum; memory O(q_len x block), not O(q_len x k_len). On NumPy a tile is
one k/v head with the q heads that share it (GQA: one (g x q block, d) @ (d, block) matmul), sized
to stay in cache, and the k/v heads are shared out over one thread per core (single-threaded BLAS
in each, see :mod:`rotary.attn.blas`); on CuPy/torch, and for small NumPy calls (a decode step), a
tile spans every head. Scores and softmax are float32 (float64 for float64 inputs).

Non-finite data: a NaN/inf in a visible key, value or query propagates to the outputs that see it; a
masked key contributes exactly nothing, whatever its values (0 * NaN never reaches the product). A
query the mask hides every key from gets 0 (flash-attn's convention), and so does a query whose
visible scores are all -inf (infinite q/k data), as torch's ``scaled_dot_product_attention`` gives
(HF's default attention; a visible key's NaN value still reaches it through its zero weight,
as in torch); a +inf or NaN score gives NaN. An -inf score in one key block and finite
ones in another give the softmax of the finite ones, whatever the block size.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np
from array_api_compat import device as xp_device, is_cupy_array, is_numpy_array

from ..frontend.normalize import (check_float, namespace, normalize_positions, normalize_seq_axis, resolve_spec)
from ..frontend.rotate import apply, apply_qk
from ..spec.validators import optional_number
from ..backends.array_api import visible_matmul
from .blas import single_thread_blas
from ..spec.packing import pack

#: target size of one tile of scores on the NumPy path, in elements ((g x q block) rows x block_size keys):
#: 512 KiB of float32, so the scores stay in a core's L2 through softmax; 32x that (every head) on devices
_SCORE_BLOCK_ELEMENTS = 1 << 17
#: fewer scores than this (q heads x q_len x k_len; a decode step) and NumPy inputs take the array-API
#: path (every head in one batched matmul) instead of the tile loop and its threads
_TILES_MIN_SCORES = 1 << 20
#: the NumPy tile loop for NumPy inputs (tests set it False to run NumPy through the array-API path)
_NUMPY_TILES = True


def _gqa_axis(q_shape, k_shape, ax):
    """The one axis (not seq, not last) where q and k sizes differ, or None; checks divisibility."""
    diff = [i for i in range(len(q_shape) - 1) if i != ax and q_shape[i] != k_shape[i]]
    if not diff:
        return None
    if len(diff) > 1:
        raise ValueError(f"q {tuple(q_shape)} and k {tuple(k_shape)} differ in more than one head axis")
    i = diff[0]
    if q_shape[i] % k_shape[i]:
        raise ValueError(f"q heads ({q_shape[i]}) must be a multiple of k/v heads ({k_shape[i]}) on axis {i}")
    return i


def _mask_positions(pos, seq_len, k_len):
    """1-D mask coordinates (Bp, S) of rotation positions; token indices (end-aligned) for multi-axis ones."""
    if pos.ndim == 3:   # (Bp, S, n_axes): M-RoPE; the mask is by token index
        return np.arange(k_len - seq_len, k_len, dtype=np.int64)[None, :]
    return pos


def _positions_arg(pos):
    """A normalized (Bp, S[, n]) position array as apply's positions argument."""
    return pos[0] if pos.shape[0] == 1 else pos


def attention(q, k, v, positions=None, *, causal=False, scale=None, spec=None, seq_axis=-2, backend="auto",
              rope=True, q_positions=None, k_positions=None, window=None, softcap=None, cu_seqlens=None,
              cu_seqlens_k=None, seqlen_offsets=None, q_mask_positions=None, k_mask_positions=None, block_size=512,
              **spec_kwargs):
    """Softmax attention with RoPE applied to q and k (see the module docstring for the formula).

    Parameters
    ----------
    q : array (..., q_len, ..., d)
    k : array (..., k_len, ..., d), possibly fewer heads on one axis (GQA); k_len >= q_len when causal
    v : array, k's shape with its own last dim dv
    positions : None, int or integer array
        Positions of the keys ((k_len,) or (batch, k_len)); queries take the last q_len of them.
    causal : bool
        Mask key s from query t unless ``p_s <= p_t`` (end-aligned when q_len < k_len).
    scale : float, optional
        Default ``head_dim**-0.5`` times the spec's ``softmax_scale_factor`` (if it has one).
    rope : bool
        False: q and k are already rotated (e.g. a cache of rotated keys); positions then only mask.
    q_positions, k_positions : int or integer arrays, optional
        Explicit positions of queries and keys (both), instead of ``positions``.
    window : int, optional
        Sliding window (causal only): query t sees keys with ``p_t - p_s < window``.
    softcap : float, optional
        Soft-capping of the scores, ``c tanh(scores / c)`` (Gemma 2's attn_logit_softcapping).
    cu_seqlens, cu_seqlens_k : integer arrays (N+1,), optional
        Packed q and k/v (seq_axis=0, shapes (total_tokens, heads, d)); see :mod:`rotary.spec.packing`.
    seqlen_offsets : int or integer array (N,), optional
        With cu_seqlens: the position of each sequence's first key.
    q_mask_positions, k_mask_positions : integer arrays, optional
        1-D coordinates the causal mask and window compare instead of the rotation positions (both,
        causal only), shaped like 1-D q_positions/k_positions (per token when packed). Default: the
        1-D positions, or for multi-axis positions the token indices, end-aligned (HF Qwen2-VL masks
        by token order too; its packed "text position ids" are these).
    block_size : int
        Keys per block of the online softmax.

    Returns q's array type and dtype, shape of q with last dim dv.
    """
    xp = namespace([q, k, v], ["q", "k", "v"])
    for a, name in ((q, "q"), (k, "k"), (v, "v")):
        check_float(a, name, xp)
    ax = normalize_seq_axis(seq_axis, q.ndim, "q")
    if k.ndim != q.ndim or v.ndim != q.ndim:
        raise ValueError(f"q, k, v must have the same number of dimensions, got {q.ndim}, {k.ndim}, {v.ndim}")
    if tuple(v.shape[:-1]) != tuple(k.shape[:-1]):
        raise ValueError(f"v {tuple(v.shape)} must match k {tuple(k.shape)} except in the last axis")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"q and k must have the same head_dim, got {q.shape[-1]} and {k.shape[-1]}")
    gaxis = _gqa_axis(q.shape, k.shape, ax)
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if not isinstance(rope, (bool, np.bool_)):
        raise TypeError(f"rope must be a bool, got {type(rope).__name__}")
    window = optional_number(window, "window", integer=True)
    softcap = optional_number(softcap, "softcap")
    block_size = optional_number(block_size, "block_size", integer=True)
    if window is not None and not causal:
        raise ValueError("window (a sliding window) needs causal=True")
    d = q.shape[-1]
    if rope or spec is not None or spec_kwargs:
        spec = resolve_spec(spec, spec_kwargs, int(d), "q")
    if scale is None:
        scale = getattr(spec, "softmax_scale_factor", 1.0) / math.sqrt(d)
    else:
        scale = optional_number(scale, "scale")
    q_len, k_len = int(q.shape[ax]), int(k.shape[ax])

    # positions of q and k tokens (host int64, (Bp, S[, n_axes])), per sequence for packed input
    explicit = q_positions is not None or k_positions is not None
    if explicit and (q_positions is None or k_positions is None):
        raise ValueError("pass both q_positions and k_positions (or neither)")
    if explicit and positions is not None:
        raise ValueError("pass positions or q_positions/k_positions, not both")
    use_spec = spec if rope else None
    packed = False
    if cu_seqlens is not None or cu_seqlens_k is not None or seqlen_offsets is not None:
        if cu_seqlens is None:
            raise ValueError("cu_seqlens_k and seqlen_offsets need cu_seqlens (the packed q's offsets)")
        if positions is not None:
            raise ValueError("with cu_seqlens pass seqlen_offsets (per-sequence key offsets) or per-token "
                             "q_positions/k_positions, not positions")
        packed = True
        qpos, kpos, mq, mk, q_seq, k_seq = _packed(q, k, ax, seq_axis, cu_seqlens, cu_seqlens_k, seqlen_offsets,
                                            q_positions, k_positions, causal, use_spec)
    elif explicit:
        qpos = normalize_positions(q_positions, tuple(q.shape[:ax]), q_len, "q_positions", spec=use_spec)
        kpos = normalize_positions(k_positions, tuple(k.shape[:ax]), k_len, "k_positions", spec=use_spec)
    else:
        if causal and q_len > k_len:
            raise ValueError(f"q_len ({q_len}) > k_len ({k_len}) with causal=True: the end-aligned causal mask "
                             "would hide every key from the first queries; pass q_positions/k_positions")
        kpos = normalize_positions(positions, tuple(k.shape[:ax]), k_len, spec=use_spec)
        if q_len <= k_len:
            qpos = kpos[:, k_len - q_len:]
        else:   # non-causal, more queries than keys: end-aligned, the first queries before position 0
            base = kpos[:, :1] if kpos.ndim == 2 else kpos[:, :1, :]
            shift = np.arange(k_len - q_len, k_len, dtype=np.int64)
            qpos = base + (shift[None, :] if kpos.ndim == 2 else shift[None, :, None])

    if not packed:
        mq, mk = _mask_positions(qpos, q_len, k_len), _mask_positions(kpos, k_len, k_len)
        q_seq = k_seq = None
    if q_mask_positions is not None or k_mask_positions is not None:
        if q_mask_positions is None or k_mask_positions is None:
            raise ValueError("pass both q_mask_positions and k_mask_positions (or neither)")
        if not causal:
            raise ValueError("q_mask_positions/k_mask_positions need causal=True (they place the causal mask "
                             "and window)")
        mq = normalize_positions(q_mask_positions, () if packed else tuple(q.shape[:ax]), q_len, "q_mask_positions")
        mk = normalize_positions(k_mask_positions, () if packed else tuple(k.shape[:ax]), k_len, "k_mask_positions")
    if gaxis == 0 and max(qpos.shape[0], kpos.shape[0], mq.shape[0], mk.shape[0]) > 1:
        raise ValueError("per-batch positions need a batch axis 0 that q and k share; here q and k differ "
                         "in their head counts on axis 0")
    if rope:
        if qpos.shape == kpos.shape and np.array_equal(qpos, kpos):
            q, k = apply_qk(q, k, _positions_arg(qpos), spec=spec, seq_axis=ax, backend=backend)
        else:
            q = apply(q, _positions_arg(qpos), spec=spec, seq_axis=ax, backend=backend)
            k = apply(k, _positions_arg(kpos), spec=spec, seq_axis=ax, backend=backend)
    mask = _Mask(mq, mk, q_seq, k_seq, causal, window) if causal or packed else None

    work = xp.float64 if q.dtype == xp.float64 else xp.float32
    fold = scale / softcap if softcap else scale
    # (lead..., S, d) views; the GQA axis split into (Hk, g) for q
    qf, kf, vf = (xp.moveaxis(a, ax, -2) for a in (q, k, v))
    gpos = gaxis - (1 if gaxis > ax else 0) if gaxis is not None else None
    g = q.shape[gaxis] // k.shape[gaxis] if gaxis is not None else 1
    if gaxis is not None:
        qf = xp.reshape(qf, qf.shape[:gpos] + (k.shape[gaxis], g) + qf.shape[gpos + 1:])
    if _numpy_path(q, k, v) and math.prod(q.shape[:-1]) * k_len >= _TILES_MIN_SCORES:
        # (U..., g, S, d): the g q heads of one k/v head next to the sequence axis (views, no copies)
        qf = np.moveaxis(qf, gpos + 1, -3) if gaxis is not None else qf[..., None, :, :]
        vf = vf if vf.dtype == work else vf.astype(work)   # (k is copied per head, in the work dtype)
        out = np.empty(q.shape[:-1] + (v.shape[-1],), dtype=q.dtype)
        of = np.moveaxis(out, ax, -2)
        of = (np.moveaxis(np.reshape(of, of.shape[:gpos] + (k.shape[gaxis], g) + of.shape[gpos + 1:]), gpos + 1, -3)
              if gaxis is not None else of[..., None, :, :])
        _numpy_attention(qf, kf, vf, of, mask, fold, softcap, block_size, work)
        return out
    if gaxis is not None:   # k/v broadcast over the g axis
        kf, vf = (xp.reshape(a, a.shape[:gpos] + (a.shape[gpos], 1) + a.shape[gpos + 1:]) for a in (kf, vf))
    if rope and qf.dtype == work and (is_numpy_array(qf) or is_cupy_array(qf)):
        qf *= fold   # q is the rotation's fresh output here: scaled in place
    else:
        qf = xp.astype(qf, work) * fold   # a scaled work copy (the caller's q is never modified)
    kf, vf = xp.astype(kf, work, copy=False), xp.astype(vf, work, copy=False)
    o = _array_api_attention(xp, qf, kf, vf, mask, softcap, block_size)
    if gaxis is not None:
        o = xp.reshape(o, o.shape[:gpos] + (q.shape[gaxis],) + o.shape[gpos + 2:])
    o = xp.moveaxis(o, -2, ax)
    return xp.astype(o, q.dtype, copy=False)


def _numpy_path(*arrays):
    """True when the NumPy tile loop runs: NumPy inputs (whatever the rotation backend), unless a test
    sends them through the array-API path."""
    return _NUMPY_TILES and all(is_numpy_array(a) for a in arrays)


def _packed(q, k, ax, seq_axis, cu_seqlens, cu_seqlens_k, seqlen_offsets, q_positions, k_positions, causal, spec):
    """(q positions, k positions, q mask coordinates, k mask coordinates, q sequence ids, k sequence ids)
    of a packed call; per sequence keys at offset + 0..Lk-1 and queries at the last Lq of them (or the
    explicit per-token positions)."""
    if ax != 0:
        raise ValueError(f"cu_seqlens needs packed q, k, v (total_tokens, heads, head_dim) with seq_axis=0, "
                         f"got seq_axis={seq_axis}")
    tq, tk = int(q.shape[0]), int(k.shape[0])
    pq = pack(cu_seqlens, tq)
    pk = pack(cu_seqlens if cu_seqlens_k is None else cu_seqlens_k, tk, seqlen_offsets,
              name="cu_seqlens" if cu_seqlens_k is None else "cu_seqlens_k")
    if pk.n_seqs != pq.n_seqs:
        raise ValueError(f"cu_seqlens_k must describe as many sequences as cu_seqlens ({pq.n_seqs}), "
                         f"got {pk.n_seqs}")
    if q_positions is not None:
        if seqlen_offsets is not None:
            raise ValueError("pass seqlen_offsets or per-token q_positions/k_positions with cu_seqlens, not both")
        qpos = normalize_positions(q_positions, (), tq, "q_positions", spec=spec)
        kpos = normalize_positions(k_positions, (), tk, "k_positions", spec=spec)
        if qpos.ndim == 3:   # multi-axis: the mask by token index, end-aligned per sequence
            mq = (np.arange(tq) + np.repeat(pk.lengths - pq.lengths + pk.starts - pq.starts, pq.lengths))[None]
            return qpos, kpos, mq, np.arange(tk)[None], pq.seq_ids, pk.seq_ids
        return qpos, kpos, qpos, kpos, pq.seq_ids, pk.seq_ids
    if causal and np.any(pq.lengths > pk.lengths):
        n = int(np.argmax(pq.lengths > pk.lengths))
        raise ValueError(f"sequence {n} has q_len {int(pq.lengths[n])} > k_len {int(pk.lengths[n])} with "
                         "causal=True (cu_seqlens vs cu_seqlens_k); pass q_positions/k_positions")
    # the last Lq key positions of each sequence: key offset + (Lk - Lq) + i
    q_first = pk.offsets + pk.lengths - pq.lengths
    qpos1 = np.arange(tq, dtype=np.int64) + np.repeat(q_first - pq.starts, pq.lengths)
    kpos1 = pk.positions
    qpos, kpos = qpos1[None, :], kpos1[None, :]
    if spec is not None and spec.multi_axis:   # M-RoPE text positions: the same on every axis
        qpos = normalize_positions(qpos1, (), tq, "q_positions", spec=spec)
        kpos = normalize_positions(kpos1, (), tk, "k_positions", spec=spec)
    return qpos, kpos, qpos1[None, :], kpos1[None, :], pq.seq_ids, pk.seq_ids


class _Mask(NamedTuple):
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


def _tiles(mask, sq, sk, q_block, k_block):
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


def _numpy_attention(qf, kf, vf, out, mask, fold, softcap, block_size, work):
    """Blocked online softmax on NumPy views: qf (U..., g, Sq, d) unscaled queries (any float dtype,
    any strides), kf (U..., Sk, d), vf (U..., Sk, dv), written to out (U..., g, Sq, dv). U: the k/v
    heads (and batch: axis 0 when the mask is per batch), g: the q heads sharing one k/v head (GQA).

    Per tile, the g heads of a k/v head are one (g*Bq, d) @ (d, Bk) matmul; the scores stay in a
    reused (g*Bq, Bk) buffer (about ``_SCORE_BLOCK_ELEMENTS``: cache-sized) through the cap, mask,
    max, exp and sum, all in place. Rows that see no key (or only -inf scores) give 0. The k/v heads are shared out over
    one thread per core, each with single-threaded BLAS (many small matmuls from one thread and a
    multi-threaded BLAS lose several-fold as soon as anything else runs); serial, with BLAS's own
    threads, where the BLAS cannot be set per thread.
    """
    units, (g, sq, d) = qf.shape[:-3], qf.shape[-3:]
    sk, dv = kf.shape[-2], vf.shape[-1]
    if sq == 0 or sk == 0 or math.prod(units) == 0:
        out[...] = 0
        return
    block_size = max(1, min(block_size, sk))
    q_block = max(1, min(sq, _SCORE_BLOCK_ELEMENTS // (g * block_size)))
    per_batch = mask is not None and mask.q_pos.shape[0] > 1
    schedule = list(_tiles(mask, sq, sk, q_block, block_size))   # masks: about Sq x block_size bools
    unit_list = list(np.ndindex(units))
    one_thread = single_thread_blas()
    n_threads = min(len(unit_list), _cpu_count()) if one_thread is not None else 1

    def attend_units(some_units, in_worker):
        if in_worker:
            one_thread()   # this thread's matmuls single-threaded: the units are the parallelism
        rows = g * q_block
        buffers = (np.empty(rows * d, dtype=work), np.empty(rows * block_size, dtype=work),
                   np.empty(rows * dv, dtype=work), np.empty((sk, d), dtype=work))
        for u in some_units:
            _attend_unit(qf[u], kf[u], vf[u], out[u], mask, u[0] if per_batch else 0, schedule, fold, softcap,
                         work, buffers)

    if n_threads <= 1:
        attend_units(unit_list, False)
        return
    with ThreadPoolExecutor(n_threads) as pool:
        for done in [pool.submit(attend_units, unit_list[i::n_threads], True) for i in range(n_threads)]:
            done.result()


def _cpu_count():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:   # not Linux
        return os.cpu_count() or 1


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


def _array_api_attention(xp, qf, kf, vf, mask, softcap, block_size):
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
    for q0, q1, row in _tiles(mask, sq, sk, q_block, block_size):
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

