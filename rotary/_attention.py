"""Softmax attention on RoPE-rotated q and k, for training-free inference (any array-API namespace).

``o_t = sum_s softmax_s(cap(scale * <R_{p_t} q_t, R_{p_s} k_s>) + mask_ts) v_s`` where
``cap(x) = c tanh(x / c)`` with ``softcap=c`` (Gemma 2; identity without it) and ``mask_ts`` is 0 or
-inf: with ``causal``, key s is visible to query t when ``p_s <= p_t``; with ``window=w`` also only
when ``p_t - p_s < w`` (Mistral/Gemma ``sliding_window``: the query and the w-1 keys before it).

Positions: keys sit at ``positions`` (None -> 0..k_len-1, an int -> offset + 0..k_len-1, or an
array), and the q_len queries at the *last* q_len of those positions: a KV cache's new tokens,
flash-attn's end-aligned causal mask (query i sees keys up to k_len - q_len + i). ``q_positions``
and ``k_positions`` give both explicitly instead (the mask then compares them). Multi-axis (M-RoPE)
positions rotate as given and the mask uses token indices, end-aligned.

Grouped-query attention: q head j uses k/v head ``j // (Hq / Hk)`` (HF ``repeat_kv``), by
broadcasting, never by copying k/v. Packed batches: ``cu_seqlens`` (q) and ``cu_seqlens_k`` (k/v,
default cu_seqlens), flash-attn's varlen form: the tokens of each sequence attend only to their own
sequence's keys, positions restart per sequence (at ``seqlen_offsets``).

The computation is blocked (flash-attention's online softmax): q in blocks of rows, keys in blocks of
``block_size``, a running max and sum per row, so the scores never take more than about
``q_block x block_size`` per head (memory O(q_len x block), not O(q_len x k_len)); key blocks the
mask hides entirely are skipped. Scores and softmax are float32 (float64 for float64 inputs).
"""

from __future__ import annotations

import math
import numbers

import numpy as np
from array_api_compat import device as xp_device, is_cupy_array, is_numpy_array

from ._api import (_check_float, _namespace, apply, apply_qk, normalize_positions, normalize_seq_axis,
                   packed_positions, resolve_spec, to_numpy)
from ._packing import pack

#: target size of one block of scores, in elements (all heads of a q block x block_size keys)
_SCORE_BLOCK_ELEMENTS = 1 << 22


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


def _check_number(value, name, *, positive=True, integer=False):
    if value is None:
        return None
    kinds = numbers.Integral if integer else numbers.Real
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, kinds):
        raise TypeError(f"{name} must be {'an integer' if integer else 'a real number'} or None, "
                        f"got {type(value).__name__}")
    if not math.isfinite(float(value)):
        raise ValueError(f"{name} must be finite, got {value}")
    if positive and not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return int(value) if integer else float(value)


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
              cu_seqlens_k=None, seqlen_offsets=None, block_size=512, **spec_kwargs):
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
        Packed q and k/v (seq_axis=0, shapes (total_tokens, heads, d)); see :mod:`rotary._packing`.
    seqlen_offsets : int or integer array (N,), optional
        With cu_seqlens: the position of each sequence's first key.
    block_size : int
        Keys per block of the online softmax.

    Returns q's array type and dtype, shape of q with last dim dv.
    """
    xp = _namespace([q, k, v], ["q", "k", "v"])
    for a, name in ((q, "q"), (k, "k"), (v, "v")):
        _check_float(a, name, xp)
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
    window = _check_number(window, "window", integer=True)
    softcap = _check_number(softcap, "softcap")
    block_size = _check_number(block_size, "block_size", integer=True)
    if window is not None and not causal:
        raise ValueError("window (a sliding window) needs causal=True")
    d = q.shape[-1]
    if rope or spec is not None or spec_kwargs:
        spec = resolve_spec(spec, spec_kwargs, int(d), "q")
    if scale is None:
        scale = getattr(spec, "softmax_scale_factor", 1.0) / math.sqrt(d)
    else:
        scale = _check_number(scale, "scale")
    q_len, k_len = int(q.shape[ax]), int(k.shape[ax])

    # positions of q and k tokens (host int64, (Bp, S[, n_axes])), per sequence for packed input
    explicit = q_positions is not None or k_positions is not None
    if explicit and (q_positions is None or k_positions is None):
        raise ValueError("pass both q_positions and k_positions (or neither)")
    if explicit and positions is not None:
        raise ValueError("pass positions or q_positions/k_positions, not both")
    use_spec = spec if rope else None
    packs = None
    if cu_seqlens is not None or cu_seqlens_k is not None or seqlen_offsets is not None:
        if cu_seqlens is None:
            raise ValueError("cu_seqlens_k and seqlen_offsets need cu_seqlens (the packed q's offsets)")
        if positions is not None:
            raise ValueError("with cu_seqlens pass seqlen_offsets (per-sequence key offsets) or per-token "
                             "q_positions/k_positions, not positions")
        qpos, kpos, mq, mk, packs = _packed(q, k, ax, seq_axis, cu_seqlens, cu_seqlens_k, seqlen_offsets,
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

    if gaxis == 0 and max(mq.shape[0] if packs else qpos.shape[0], kpos.shape[0]) > 1:
        raise ValueError("per-batch positions need a batch axis 0 that q and k share; here q and k differ "
                         "in their head counts on axis 0")
    if packs is None:
        mq, mk = _mask_positions(qpos, q_len, k_len), _mask_positions(kpos, k_len, k_len)
    if rope:
        if qpos.shape == kpos.shape and np.array_equal(qpos, kpos):
            q, k = apply_qk(q, k, _positions_arg(qpos), spec=spec, seq_axis=ax, backend=backend)
        else:
            q = apply(q, _positions_arg(qpos), spec=spec, seq_axis=ax, backend=backend)
            k = apply(k, _positions_arg(kpos), spec=spec, seq_axis=ax, backend=backend)

    work = xp.float64 if q.dtype == xp.float64 else xp.float32
    # (lead..., S, d) views; the GQA axis split into (Hk, g) for q and (Hk, 1) for k/v (broadcast)
    qf, kf, vf = (xp.moveaxis(a, ax, -2) for a in (q, k, v))
    gpos = None
    if gaxis is not None:
        gpos = gaxis - (1 if gaxis > ax else 0)
        g = q.shape[gaxis] // k.shape[gaxis]
        qf = xp.reshape(qf, qf.shape[:gpos] + (k.shape[gaxis], g) + qf.shape[gpos + 1:])
        kf, vf = (xp.reshape(a, a.shape[:gpos] + (a.shape[gpos], 1) + a.shape[gpos + 1:]) for a in (kf, vf))
    fold = scale / softcap if softcap else scale
    if rope and qf.dtype == work and (is_numpy_array(qf) or is_cupy_array(qf)):
        qf *= fold   # q is the rotation's fresh output here: scaled in place
    else:
        qf = xp.astype(qf, work) * fold   # a scaled work copy (the caller's q is never modified)
    kf, vf = xp.astype(kf, work, copy=False), xp.astype(vf, work, copy=False)

    mask_needed = causal
    if packs is None:
        o = _blocked(xp, qf, kf, vf, mq if mask_needed else None, mk, window, softcap, block_size)
    else:   # one sequence at a time: (Tq, ...) packed along axis -2 of every view
        cu_q, cu_k = packs
        parts = []
        for n in range(cu_q.shape[0] - 1):
            a, b, c, e = int(cu_q[n]), int(cu_q[n + 1]), int(cu_k[n]), int(cu_k[n + 1])
            parts.append(_blocked(xp, qf[..., a:b, :], kf[..., c:e, :], vf[..., c:e, :],
                                  mq[:, a:b] if mask_needed else None, mk[:, c:e], window, softcap, block_size))
        o = xp.concat(parts, axis=-2) if parts else xp.zeros(qf.shape[:-1] + (vf.shape[-1],), dtype=work)
    if gaxis is not None:
        o = xp.reshape(o, o.shape[:gpos] + (q.shape[gaxis],) + o.shape[gpos + 2:])
    o = xp.moveaxis(o, -2, ax)
    return xp.astype(o, q.dtype, copy=False)


def _packed(q, k, ax, seq_axis, cu_seqlens, cu_seqlens_k, seqlen_offsets, q_positions, k_positions, causal, spec):
    """(q positions, k positions, q mask coordinates, k mask coordinates, (cu_q, cu_k)) of a packed call; per sequence keys at offset + 0..Lk-1 and
    queries at the last Lq of them (or the explicit per-token positions)."""
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
            return qpos, kpos, mq, np.arange(tk)[None], (pq.cu_seqlens, pk.cu_seqlens)
        return qpos, kpos, qpos, kpos, (pq.cu_seqlens, pk.cu_seqlens)
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
    return qpos, kpos, qpos1[None, :], kpos1[None, :], (pq.cu_seqlens, pk.cu_seqlens)


def _cupy():
    import cupy

    return cupy


def _block_bounds(pos, size):
    """(starts, per-block min over (Bp, block), per-block max) of 1-D mask coordinates (Bp, S)."""
    n = pos.shape[1]
    starts = np.arange(0, n, size)
    if n == 0:
        return starts, np.zeros(0, np.int64), np.zeros(0, np.int64)
    lo = np.minimum.reduceat(pos.min(axis=0), starts)
    hi = np.maximum.reduceat(pos.max(axis=0), starts)
    return starts, lo, hi


def _blocked(xp, qf, kf, vf, mq, mk, window, softcap, block_size):
    """Online-softmax attention of scaled q (lead..., Sq, d) against k (lead..., Sk, d), v (lead..., Sk, dv)
    (lead axes broadcast); mq/mk: (Bp, S) int64 mask coordinates (mq None: no mask). Returns
    (lead..., Sq, dv) in q's work dtype; rows that see no key are 0."""
    lead = tuple(max(a, b) for a, b in zip(qf.shape[:-2], kf.shape[:-2]))
    sq, d = qf.shape[-2], qf.shape[-1]
    sk, dv = kf.shape[-2], vf.shape[-1]
    dtype = qf.dtype
    inplace = is_numpy_array(qf) or is_cupy_array(qf)
    native = np if is_numpy_array(qf) else (_cupy() if inplace else None)   # ufuncs with out=
    dev = xp_device(qf)
    if sq == 0 or sk == 0 or math.prod(lead) == 0:
        return xp.zeros(lead + (sq, dv), dtype=dtype, device=dev)
    per_row = max(1, math.prod(lead)) * block_size
    q_block = int(min(sq, max(16, _SCORE_BLOCK_ELEMENTS // per_row)))
    kstarts, klo, khi = _block_bounds(mk, block_size)
    qstarts = np.arange(0, sq, q_block)
    if mq is not None:
        _, qlo, qhi = _block_bounds(mq, q_block)
    n_lead = len(lead)
    neg_inf = -math.inf
    out = xp.empty(lead + (sq, dv), dtype=dtype, device=dev) if inplace else None
    parts = []
    for qi, q0 in enumerate(qstarts):
        q1 = min(sq, q0 + q_block)
        qb = qf[..., q0:q1, :]
        m = xp.full(lead + (q1 - q0, 1), neg_inf, dtype=dtype, device=dev)
        l = xp.zeros(lead + (q1 - q0, 1), dtype=dtype, device=dev)
        acc = xp.zeros(lead + (q1 - q0, dv), dtype=dtype, device=dev)
        for ki, k0 in enumerate(kstarts):
            k1 = min(sk, k0 + block_size)
            full = True
            if mq is not None:
                if klo[ki] > qhi[qi] or (window is not None and qlo[qi] - khi[ki] >= window):
                    continue   # every key of the block is hidden from every query of the block
                full = khi[ki] <= qlo[qi] and (window is None or qhi[qi] - klo[ki] < window)
            s = xp.matmul(qb, xp.matrix_transpose(kf[..., k0:k1, :]))
            if softcap:
                if inplace:
                    native.tanh(s, out=s)
                    s *= softcap
                else:
                    s = xp.tanh(s) * softcap
            if not full:
                qp, kp = mq[:, q0:q1, None], mk[:, None, k0:k1]
                visible = kp <= qp
                if window is not None:
                    visible &= (qp - kp) < window
                visible = (visible.reshape((visible.shape[0],) + (1,) * (n_lead - 1) + visible.shape[1:])
                           if n_lead else visible[0])
                hidden = xp.asarray(~visible, device=dev) if not is_numpy_array(s) else ~visible
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
            acc = acc * alpha + xp.matmul(p, vf[..., k0:k1, :])
            m = m_new
        res = acc / xp.where(l > 0, l, xp.asarray(1.0, dtype=dtype, device=dev))
        if inplace:
            out[..., q0:q1, :] = res
        else:
            parts.append(res)
    return out if inplace else xp.concat(parts, axis=-2)
