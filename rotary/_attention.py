"""Softmax attention on RoPE-rotated q and k (the reference; any array-API namespace).

``o_t = sum_s softmax_s(scale * <R_{p_t} q_t, R_{p_s} k_s> + mask) v_s`` with the causal mask
``s <= t`` when ``causal``. Grouped-query attention: q head j uses k/v head ``j // (Hq / Hk)``
(HF ``repeat_kv``). Scores and softmax are computed in float32 (float64 for float64 inputs).
"""

from __future__ import annotations

import math

from array_api_compat import device as xp_device

from ._api import _check_float, _namespace, apply_qk, normalize_seq_axis


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


def attention(q, k, v, positions=None, *, causal=False, scale=None, spec=None, seq_axis=-2, backend="auto",
              **spec_kwargs):
    """Softmax attention with RoPE applied to q and k.

    q: (..., seq, ..., d); k: same but possibly fewer heads (GQA); v: k's shape with its own last
    dim dv. ``scale`` defaults to ``1/sqrt(d)``. Returns q's array type and dtype, shape of q with
    last dim dv.
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
    if k.shape[ax] != q.shape[ax]:
        raise ValueError(f"q and k must have the same sequence length, got {q.shape[ax]} and {k.shape[ax]}")
    gaxis = _gqa_axis(q.shape, k.shape, ax)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    d = q.shape[-1]
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")

    q_rot, k_rot = apply_qk(q, k, positions, spec=spec, seq_axis=seq_axis, backend=backend, **spec_kwargs)
    work = xp.float64 if q.dtype == xp.float64 else xp.float32
    qf, kf, vf = (xp.astype(a, work) for a in (q_rot, k_rot, v))
    if gaxis is not None:
        rep = q.shape[gaxis] // k.shape[gaxis]
        kf = xp.repeat(kf, rep, axis=gaxis)
        vf = xp.repeat(vf, rep, axis=gaxis)
    # move the sequence axis next to the last: (..., S, d)
    qf, kf, vf = (xp.moveaxis(a, ax, -2) for a in (qf, kf, vf))
    scores = xp.matmul(qf, xp.matrix_transpose(kf)) * scale
    if causal:
        n = q.shape[ax]
        idx = xp.arange(n, device=xp_device(q))
        mask = xp.reshape(idx, (n, 1)) >= xp.reshape(idx, (1, n))
        scores = xp.where(mask, scores, xp.asarray(-math.inf, dtype=work))
    scores = scores - xp.max(scores, axis=-1, keepdims=True)
    weights = xp.exp(scores)
    weights = weights / xp.sum(weights, axis=-1, keepdims=True)
    o = xp.matmul(weights, vf)
    o = xp.moveaxis(o, -2, ax)
    return xp.astype(o, q.dtype)
