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

The computation is blocked (flash-attention's online softmax; memory O(q_len x block), not
O(q_len x k_len)) over a block-sparse schedule of tiles that skips what the mask hides: see
:mod:`rotary.backends.online_softmax`, which this module calls once q and k are rotated (NumPy inputs
above ``_TILES_MIN_SCORES`` scores take its NumPy tile loop over threads, the rest its array-API loop).
Scores and softmax are float32 (float64 for float64 inputs).

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

import numpy as np
from array_api_compat import is_numpy_array

from ..backends.online_softmax import Mask, blocked_attention
from ..frontend import dispatch as _adapters
from ..frontend.normalize import (check_float, namespace, normalize_positions, normalize_seq_axis, resolve_spec)
from ..frontend.rotate import apply, apply_qk
from ..spec.packing import pack
from ..spec.validators import optional_number

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


def mask_positions_given(q_mask_positions, k_mask_positions, causal) -> bool:
    """Whether the call places its mask by its own positions; both or neither, and only with causal=True."""
    if q_mask_positions is None and k_mask_positions is None:
        return False
    if q_mask_positions is None or k_mask_positions is None:
        raise ValueError("pass both q_mask_positions and k_mask_positions (or neither)")
    if not causal:
        raise ValueError("q_mask_positions/k_mask_positions need causal=True (they place the causal mask "
                         "and window)")
    return True


@_adapters.dispatch("attention", 3)   # JAX, bfloat16: their adapter's attention; the rest: the core
def attention(q, k, v=None, positions=None, *, causal=None, scale=None, spec=None, seq_axis=None, backend="auto",
              rope=True, q_positions=None, k_positions=None, window=None, softcap=None, cu_seqlens=None,
              cu_seqlens_k=None, seqlen_offsets=None, q_mask_positions=None, k_mask_positions=None, block_size=512,
              attention_mask=None, seq_ids=None, q_norm=None, norm_eps=None, **spec_kwargs):
    """Softmax attention with RoPE applied to q and k (see the module docstring for the formula).

    With a :class:`rotary.KVCache` as ``k`` (``attention(q, cache, ...)``) it attends over the cache: q holds
    the last tokens of each sequence (see :meth:`rotary.KVCache.attend` and :func:`rotary.paged_attention`); values, positions and spec come from
    the cache.

    Parameters
    ----------
    q : array (..., q_len, ..., d)
        ``seq_axis`` (or ``layout=``, e.g. "bshd") names the sequence axis of q, k and v, as in
        :func:`rotary.apply`: required for 3 or more dimensions.
    k : array (..., k_len, ..., d), possibly fewer heads on one axis (GQA); k_len >= q_len when causal
    v : array, k's shape with its own last dim dv
    positions : None, int or integer array
        Positions of the keys ((k_len,) or (batch, k_len)); queries take the last q_len of them.
    causal : bool
        Mask key s from query t unless ``p_s <= p_t`` (end-aligned when q_len < k_len). Default False, and
        True over a :class:`rotary.KVCache`.
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
    attention_mask : array (batch, k_len) of 0/1, optional
        Hugging Face's padding mask: keys with 0 are hidden; positions are counted from each row's first
        real token (``cumsum(mask) - 1``, HF's position_ids) unless ``positions`` gives them. A query that
        sees no key (a left-padding row with causal=True) gets 0.
    seq_ids : integer array, optional
        With a :class:`rotary.KVCache` as ``k``: which sequences q's rows are (all when None).
    q_norm, norm_eps : array (head_dim,), float, optional
        With a :class:`rotary.KVCache` as ``k``: q's per-head RMSNorm before its rotation, fused into the kernel
        (Qwen3's / Gemma 3's ``q_norm``; :meth:`rotary.KVCache.attend`).

    Returns q's array type and dtype, shape of q with last dim dv.
    """
    if causal is None:
        causal = _is_cache(k)
    if _is_cache(k):
        return _cache_call(q, k, v, positions, causal=causal, scale=scale, spec=spec, seq_axis=seq_axis,
                           backend=backend, rope=rope, q_positions=q_positions, k_positions=k_positions, window=window,
                           softcap=softcap, cu_seqlens=cu_seqlens, cu_seqlens_k=cu_seqlens_k,
                           seqlen_offsets=seqlen_offsets, q_mask_positions=q_mask_positions,
                           k_mask_positions=k_mask_positions, block_size=block_size, attention_mask=attention_mask,
                           seq_ids=seq_ids, q_norm=q_norm, norm_eps=norm_eps, spec_kwargs=spec_kwargs)
    if v is None:
        raise TypeError("attention() needs v (the values), unless k is a rotary.KVCache")
    if seq_ids is not None:
        raise ValueError("seq_ids goes with a rotary.KVCache as k")
    if q_norm is not None or norm_eps is not None:
        raise ValueError("q_norm and norm_eps go with a rotary.KVCache as k (elsewhere normalize q before the call)")
    if attention_mask is not None:
        return _padded_attention(q, k, v, positions, attention_mask, causal=causal, scale=scale, spec=spec,
                                 seq_axis=seq_axis, backend=backend, rope=rope, q_positions=q_positions,
                                 k_positions=k_positions, window=window, softcap=softcap, cu_seqlens=cu_seqlens,
                                 q_mask_positions=q_mask_positions, block_size=block_size, spec_kwargs=spec_kwargs)
    xp, ax, gaxis, spec, scale, window, softcap, block_size = checked_arguments(
        q, k, v, causal=causal, scale=scale, spec=spec, seq_axis=seq_axis, rope=rope, window=window, softcap=softcap,
        block_size=block_size, spec_kwargs=spec_kwargs)
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
    if mask_positions_given(q_mask_positions, k_mask_positions, causal):
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
    mask = Mask(mq, mk, q_seq, k_seq, causal, window) if causal or packed else None
    tiles = _numpy_path(q, k, v) and math.prod(q.shape[:-1]) * k_len >= _TILES_MIN_SCORES
    return blocked_attention(xp, q, k, v, ax, gaxis, mask, scale, softcap, block_size, numpy_tiles=tiles,
                             q_is_scratch=rope)


def _is_cache(k) -> bool:
    """A :class:`rotary.KVCache` or one of its layers (``cache.layer(i)``), which mark their class with
    ``_attends_through_cache``: attn never imports kvcache."""
    return getattr(type(k), "_attends_through_cache", False) is True


def _cache_call(q, cache, v, positions, *, causal, scale, spec, seq_axis, backend, rope, q_positions, k_positions,
                window, softcap, cu_seqlens, cu_seqlens_k, seqlen_offsets, q_mask_positions, k_mask_positions,
                block_size, attention_mask, seq_ids, q_norm, norm_eps, spec_kwargs):
    """attention(q, cache, ...): the arguments a cache takes, then the cache's own :meth:`~rotary.KVCache.attend`."""
    if v is not None or positions is not None or k_positions is not None or cu_seqlens_k is not None or \
            seqlen_offsets is not None or q_mask_positions is not None or k_mask_positions is not None or \
            attention_mask is not None or spec_kwargs:
        given = {"v": v, "positions": positions, "k_positions": k_positions, "cu_seqlens_k": cu_seqlens_k,
                 "seqlen_offsets": seqlen_offsets, "q_mask_positions": q_mask_positions,
                 "k_mask_positions": k_mask_positions, "attention_mask": attention_mask}
        wrong = [name for name, value in given.items() if value is not None]
        raise TypeError(f"attention(q, cache) takes its keys, values, positions and mask from the cache; got "
                        f"{', '.join(wrong + sorted(spec_kwargs))}")
    if spec is not None and spec is not cache.spec:
        raise ValueError("spec must be None or the cache's own spec (the cache rotated its keys with it)")
    if rope is not True and not rope:
        raise ValueError("attention(q, cache) rotates q at its positions in the cache (rope=False does not apply)")
    if seq_axis is not None and seq_axis not in (cache.layout, 1 if cache.layout == "bshd" else 2):
        raise ValueError(f"seq_axis={seq_axis!r} does not match the cache's layout {cache.layout!r}")
    if backend != "auto" and backend != cache.backend:
        raise ValueError(f"backend={backend!r}: the cache runs on its own backend ({cache.backend!r})")
    return cache.attend(q, causal=causal, seq_ids=seq_ids, cu_seqlens=cu_seqlens, q_positions=q_positions, scale=scale,
                        window=window, softcap=softcap, block_size=block_size, q_norm=q_norm, norm_eps=norm_eps)


#: the mask coordinate of a padding key: never <= a query's, so never visible
_HIDDEN = np.int64(1) << 62


def _padded_attention(q, k, v, positions, attention_mask, *, causal, scale, spec, seq_axis, backend, rope,
                      q_positions, k_positions, window, softcap, cu_seqlens, q_mask_positions, block_size,
                      spec_kwargs):
    """attention with Hugging Face's ``attention_mask`` (batch, k_len) of 0/1 (padding keys hidden).

    Rotation positions (unless given): ``cumsum(mask) - 1`` per row, 1 at padding (HF's position_ids). The mask is
    placed by token index (end-aligned queries), each padding key at a coordinate no query reaches; without
    ``causal`` every query sits past every real key."""
    if cu_seqlens is not None:
        raise ValueError("attention_mask is for padded batches; a packed batch (cu_seqlens) has no padding")
    if q_mask_positions is not None:
        raise ValueError("pass attention_mask or q_mask_positions/k_mask_positions, not both")
    ax = normalize_seq_axis(seq_axis, q.ndim, "q")
    if ax == 0:
        raise ValueError("attention_mask needs a batch axis 0 before the sequence axis")
    m = attention_mask
    m = np.asarray(m.detach().cpu() if hasattr(m, "detach") else m)
    batch, q_len, k_len = int(q.shape[0]), int(q.shape[ax]), int(k.shape[ax])
    if m.shape != (batch, k_len):
        raise ValueError(f"attention_mask must have shape (batch, k_len) = ({batch}, {k_len}), got {m.shape}")
    if m.dtype != bool and (m.dtype.kind not in "iuf" or not np.all((m == 0) | (m == 1))):
        raise ValueError("attention_mask must hold 0/1 (or bool) values: 1 for real tokens, 0 for padding")
    real = m.astype(bool)
    if q_positions is None and k_positions is None:
        if positions is None:
            kpos = np.where(real, np.cumsum(real, axis=1) - 1, 1).astype(np.int64)
        else:
            kpos = normalize_positions(positions, tuple(k.shape[:ax]), k_len, spec=None)
            kpos = np.broadcast_to(kpos, (batch, k_len)) if kpos.shape[0] == 1 else kpos
        if q_len > k_len:
            raise ValueError(f"q_len ({q_len}) > k_len ({k_len}) with attention_mask: queries are the last q_len "
                             "tokens; pass q_positions/k_positions")
        q_positions, k_positions = kpos[:, k_len - q_len:], kpos
    elif positions is not None:
        raise ValueError("pass positions or q_positions/k_positions, not both")
    index = np.arange(k_len, dtype=np.int64)
    mk = np.where(real, index[None, :], _HIDDEN)
    if causal:
        mq = np.broadcast_to(index[None, k_len - q_len:], (batch, q_len)) if q_len <= k_len else None
        if mq is None:
            raise ValueError(f"q_len ({q_len}) > k_len ({k_len}) with causal=True and attention_mask")
    else:
        mq = np.full((batch, q_len), _HIDDEN - 1, dtype=np.int64)
    return attention(q, k, v, causal=True, scale=scale, spec=spec, seq_axis=ax, backend=backend, rope=rope,
                     q_positions=q_positions, k_positions=k_positions, window=window if causal else None,
                     softcap=softcap, q_mask_positions=np.ascontiguousarray(mq), k_mask_positions=mk,
                     block_size=block_size, **spec_kwargs)


def checked_arguments(q, k, v, *, causal, scale, spec, seq_axis, rope, window, softcap, block_size, spec_kwargs):
    """The checks of :func:`attention`'s arrays and scalars: ``(xp, seq_axis, gqa_axis, spec, scale, window,
    softcap, block_size)`` normalized (spec None when ``rope=False`` and no spec is given)."""
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
    if softcap is not None and q.dtype != xp.float64:
        check_float32_softcap(softcap, scale, q.dtype)
    return xp, ax, gaxis, spec, scale, window, softcap, block_size


_F32_TINY, _F32_MAX = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)


def check_float32_softcap(softcap, scale, dtype):
    """A softcap the float32 work dtype (scores of float32/16 and bfloat16 inputs) holds: ``c tanh(s / c)`` is
    computed as ``tanh(s * (scale / c)) * c`` in float32, so c and scale / c must be finite normal float32 values
    (1e39 would be inf there and 1e-46 zero, and every score NaN). ValueError naming softcap otherwise."""
    fold = scale / softcap if isinstance(scale, (int, float, np.floating)) else 1.0   # a traced scale: not read
    if _F32_TINY <= softcap <= _F32_MAX and abs(fold) <= _F32_MAX:
        return
    raise ValueError(f"softcap={softcap!r} does not fit float32, the work dtype of attention on {dtype} inputs "
                     f"(scores are float32 for float32, float16 and bfloat16 inputs): the cap must lie in "
                     f"[{_F32_TINY:.4g}, {_F32_MAX:.4g}] and scale / softcap (here {scale!r} / {softcap!r}) must be "
                     f"at most {_F32_MAX:.4g}. Pass softcap=None for a huge cap (c tanh(s / c) = s to float32 "
                     "precision for |s| < c / 3000), a larger softcap or smaller scale, or float64 inputs")


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
