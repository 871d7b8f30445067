"""``rotary.attention(q, cache)``: softmax attention of each sequence's newest queries over its own cached keys.

q holds the last s tokens of each sequence (their keys already appended): query j of sequence b sits at
position ``p = lengths[b] - s + j``, is rotated there, and attends to the keys of sequence b only::

    o = sum_t softmax_t(cap(scale <R_p q, k_t>) + mask) v_t,   t < lengths[b]

with the causal mask ``t <= p`` (and ``p - t < window``), ``cap(x) = c tanh(x / c)`` with ``softcap=c``,
keys/values dequantized (int8/float8 caches). A sequence may have any length: one call decodes (s = 1) or
prefills a chunk (s > 1) for a batch of different lengths; packed queries (``cu_seqlens``) give each
sequence its own chunk length.

A backend with the ``cache_attention`` capability reads the keys where they lie (the block table); otherwise
the keys of the sequences are gathered (dequantized) into a packed batch for :func:`rotary.attention`'s
online-softmax engine (``cu_seqlens_k``), which is also the reference the kernels are tested against.
"""

from __future__ import annotations

import math

import numpy as np

from ..spec.packing import check_cu_seqlens
from ..spec.validators import optional_number


def cache_attention(q, cache, *, causal=True, seq_ids=None, cu_seqlens=None, q_positions=None, scale=None,
                    window=None, softcap=None, block_size=512):
    """See the module docstring; called by :func:`rotary.attention` when its second argument is a KVCache."""
    from ..attn.softmax import attention
    from ..frontend.rotate import apply

    cache._check_entries(q, "q", None)
    hk = cache.kv_heads
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    window = optional_number(window, "window", integer=True)
    softcap = optional_number(softcap, "softcap")
    if window is not None and not causal:
        raise ValueError("window (a sliding window) needs causal=True")
    if scale is None:
        scale = getattr(cache.spec, "softmax_scale_factor", 1.0) / math.sqrt(cache.head_dim)
    else:
        scale = optional_number(scale, "scale")
    if cu_seqlens is None:
        qd = cache._dense(q, "q")
        n, s, hq = (int(d) for d in qd.shape[:3])
        counts = np.full(n, s, dtype=np.int64)
    else:
        if q.ndim != 3:
            raise ValueError(f"packed q (with cu_seqlens) must be (tokens, q_heads, head_dim), got {tuple(q.shape)}")
        counts = np.diff(check_cu_seqlens(cu_seqlens, int(q.shape[0]), "cu_seqlens"))
        n, hq = counts.size, int(q.shape[1])
        qd = None
    if hq % hk:
        raise ValueError(f"q heads ({hq}) must be a multiple of the cache's kv_heads ({hk})")
    ids = cache._seq_ids(seq_ids, n)
    lengths = cache.lengths[ids]
    longer = np.flatnonzero(counts > lengths)
    if longer.size:
        i = int(longer[0])
        raise ValueError(f"q has {int(counts[i])} tokens for sequence {int(ids[i])}, which holds {int(lengths[i])}: "
                         "append the new keys and values first (q are the last tokens of each sequence)")
    # rotation positions: the last counts[i] positions of each sequence (or as given)
    tok_pos = np.concatenate([np.arange(L - c, L, dtype=np.int64) for L, c in zip(lengths, counts)]) if n else \
        np.zeros(0, np.int64)
    if q_positions is None and cache.spec.multi_axis and cache.spec.mrope_section is None:
        raise ValueError("this multi-axis spec needs q_positions= (each query's coordinates)")
    rot_pos = cache._rotation_positions(q_positions, tok_pos, n, None if cu_seqlens is None else counts)
    backend = cache.backend
    if qd is not None:
        q_rot = apply(qd, rot_pos[0].reshape((n, int(counts[0]) if n else 0) + rot_pos.shape[2:]), spec=cache.spec,
                      seq_axis=1, backend=backend)
        kernel = getattr(cache.module, "cache_attention", None)
        if kernel is not None and cache.kv_dtype in getattr(cache.module, "KV_DTYPES", (None,)):
            convert = cache._convert or (lambda a: a)
            o = kernel(q_rot, cache.stores, convert(cache.block_table[ids]), cache.page_size, convert(lengths),
                       scale=scale, softcap=softcap, window=window, causal=bool(causal))
            return o if cache.layout == "bshd" else o.transpose(0, 2, 1, 3)
        q_packed = q_rot.reshape(n * int(counts[0]), hq, cache.head_dim)
    else:
        q_packed = apply(q, rot_pos[0], spec=cache.spec, seq_axis=0, backend=backend)
    keys, values, cu_k = cache.packed(ids)
    cu_q = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    o = attention(q_packed, keys, values, causal=bool(causal), rope=False, seq_axis=0, cu_seqlens=cu_q,
                  cu_seqlens_k=cu_k, scale=scale, window=window, softcap=softcap, block_size=block_size,
                  backend=backend)
    if qd is None:
        return o
    o = o.reshape(n, int(counts[0]), hq, cache.head_dim)
    return o if cache.layout == "bshd" else o.transpose(0, 2, 1, 3)
