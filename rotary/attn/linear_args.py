"""Checks of :func:`rotary.linear_attention`'s arguments: scalars, q/k/v shapes (GQA) and decay."""

from __future__ import annotations

import math
import numbers

import numpy as np

from ..spec.validators import as_bool, to_numpy


def plain_scalars(causal, eps, chunk, return_state, normalize) -> bool:
    """The common, valid case of the scalar arguments, in a few type checks (a decode step runs this per token)."""
    return (type(causal) is bool and type(return_state) is bool and type(normalize) is bool and type(eps) is float
            and 0 <= eps < math.inf and type(chunk) is int and chunk >= 1)


def check_scalars(causal, eps, chunk, return_state, normalize):
    if plain_scalars(causal, eps, chunk, return_state, normalize):
        return
    for name, value in (("causal", causal), ("return_state", return_state), ("normalize", normalize)):
        as_bool(value, name)
    if isinstance(eps, (bool, np.bool_)) or not isinstance(eps, numbers.Real):
        raise TypeError(f"eps must be a real number, got {type(eps).__name__}")
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be a finite number >= 0, got {eps}")
    if isinstance(chunk, (bool, np.bool_)) or not isinstance(chunk, numbers.Integral):
        raise TypeError(f"chunk must be an integer, got {type(chunk).__name__}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")


def check_shapes(q, k, v, ax):
    """The GQA axis of q (None without GQA) and the group size G = q heads per k/v head.

    k and v have q's shape (v with its own last dim) except, with GQA, in one axis other than the
    batch (first), sequence and last axes, where q's size is a multiple of theirs.
    """
    if k.ndim != q.ndim or v.ndim != q.ndim:
        raise ValueError(f"q, k, v must have the same number of dimensions, got {q.ndim}, {k.ndim}, {v.ndim}")
    if k.shape[ax] != q.shape[ax] or v.shape[ax] != q.shape[ax]:
        raise ValueError(f"q, k, v must have the same sequence length (axis {ax}), got "
                         f"{q.shape[ax]}, {k.shape[ax]}, {v.shape[ax]}")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k's last dim ({k.shape[-1]}) must equal q's ({q.shape[-1]})")
    if tuple(v.shape[:-1]) != tuple(k.shape[:-1]):
        raise ValueError(f"v of shape {tuple(v.shape)} must match k {tuple(k.shape)} except in the last axis")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must have the same dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    differ = [i for i in range(q.ndim - 1) if q.shape[i] != k.shape[i]]
    if not differ:
        return None, 1
    gax = differ[0]
    if len(differ) > 1 or gax == 0 or k.shape[gax] == 0 or q.shape[gax] % k.shape[gax]:
        raise ValueError(f"k of shape {tuple(k.shape)} must have q's shape {tuple(q.shape)}, or (GQA) differ in "
                         f"one head axis (not the first, batch axis) where q's size is a multiple of k's")
    return gax, q.shape[gax] // k.shape[gax]


def check_decay(decay, k_heads, causal):
    """decay as a float64 array of k's head axes ``k_heads`` (None: no decay)."""
    if decay is None:
        return None
    if isinstance(decay, (bool, np.bool_)):
        raise TypeError("decay must be None, a number or an array of numbers in (0, 1], got a bool")
    try:
        d = np.asarray(to_numpy(decay, "decay"))
    except Exception:
        raise TypeError(f"decay must be None, a number or an array of numbers in (0, 1], got "
                        f"{type(decay).__name__}") from None
    if d.dtype.kind not in "iuf":
        raise TypeError(f"decay must be real numbers in (0, 1], got dtype {d.dtype}")
    d = d.astype(np.float64)
    if d.ndim > len(k_heads) or any(n not in (1, h) for n, h in zip(d.shape[::-1], k_heads[::-1])):
        raise ValueError(f"decay of shape {d.shape} must be a scalar or one value per k/v head: a shape that "
                         f"broadcasts to k's axes other than the sequence and last axes {tuple(k_heads)}")
    if not np.all((d > 0) & (d <= 1)):
        bad = d[~((d > 0) & (d <= 1))]
        raise ValueError(f"decay must be in (0, 1] (gamma of S_t = gamma S_(t-1) + ...), got {bad.ravel()[:4]}")
    full = np.array(np.broadcast_to(d, k_heads), dtype=np.float64)
    if not causal and np.any(full != 1):
        raise ValueError("decay < 1 needs causal=True: a decayed state has a direction (gamma^(t-s), s <= t); "
                         "bidirectional retention (gamma^|t-s|) is two causal calls, see docs/linear_attention.md")
    full.setflags(write=False)
    return full
