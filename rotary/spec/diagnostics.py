"""Diagnostics and conversions: long-range decay, layout permutations, weight conversion."""

from __future__ import annotations

import math

import numpy as np

from .rope_spec import LAYOUTS
from .validators import as_int


def decay_curve(head_dim, max_distance, *, base=10000.0) -> np.ndarray:
    """RoFormer's long-range decay bound (§3.4.3), float64, for relative distances r = 0..max_distance.

    ``(1/(d/2)) * sum_{j=1}^{d/2} |S_j|`` with ``S_j = sum_{i<j} exp(1j * r * theta_i)`` and
    ``theta_i = base**(-2i/d)``. Equals ``(d/2 + 1)/2`` at r = 0 and decays (with oscillation) as r grows.
    """
    d = as_int(head_dim, "head_dim")
    if d < 2 or d % 2:
        raise ValueError(f"head_dim must be an even integer >= 2, got {d}")
    n = as_int(max_distance, "max_distance")
    if n < 0:
        raise ValueError(f"max_distance must be >= 0, got {n}")
    if isinstance(base, (bool, np.bool_)) or not isinstance(base, (int, float, np.integer, np.floating)):
        raise TypeError(f"base must be a real number, got {type(base).__name__} {base!r}")
    base = float(base)
    if not (math.isfinite(base) and base > 0) or base == 1.0:
        raise ValueError(f"base must be a finite number > 0 other than 1, got {base}")
    theta = base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    out = np.empty(n + 1, dtype=np.float64)
    step = max(1, 2**20 // (d // 2))
    for r0 in range(0, n + 1, step):
        r = np.arange(r0, min(n + 1, r0 + step), dtype=np.float64)[:, None]
        angle = np.remainder(r * theta, 2 * np.pi)
        partial = np.cumsum(np.exp(1j * angle), axis=1)
        out[r0:r0 + len(r)] = np.abs(partial).mean(axis=1)
    return out


def layout_permutation(rotary_dim: int, *, to: str = "half") -> np.ndarray:
    """Index array ``perm`` with ``x_to = x_from[..., perm]`` over the rotary span.

    ``to="half"`` maps interleaved (2i, 2i+1) to half (i, i + d/2): HF's ``permute`` in
    ``convert_llama_weights_to_hf.py``; ``to="interleaved"`` is its inverse.
    """
    r = as_int(rotary_dim, "rotary_dim")
    if r < 2 or r % 2:
        raise ValueError(f"rotary_dim must be an even integer >= 2, got {r}")
    if to not in LAYOUTS:
        raise ValueError(f"to must be one of {LAYOUTS}, got {to!r}")
    to_half = np.concatenate([np.arange(0, r, 2), np.arange(1, r, 2)])
    if to == "half":
        return to_half
    return np.argsort(to_half)


def _head_permutation(head_dim: int, rotary_dim, rotary_offset, to: str, what: str) -> np.ndarray:
    """The permutation of one head's coordinates: identity outside [rotary_offset, rotary_offset +
    rotary_dim), :func:`layout_permutation` inside (rotary_dim defaults to the rest of the head, even)."""
    off = as_int(rotary_offset, "rotary_offset")
    if off < 0:
        raise ValueError(f"rotary_offset must be >= 0, got {off}")
    rest = head_dim - off
    r = rest - rest % 2 if rotary_dim is None else as_int(rotary_dim, "rotary_dim")
    if r > rest:
        if off:
            raise ValueError(f"rotary_offset + rotary_dim ({off} + {r}) must be <= {what} ({head_dim})")
        raise ValueError(f"rotary_dim must be <= {what} ({head_dim}), got {r}")
    return np.concatenate([np.arange(off), off + layout_permutation(r, to=to), np.arange(off + r, head_dim)])


def convert_layout(x, *, to: str, rotary_dim=None, rotary_offset=0):
    """Permute the last axis of q/k activations between layouts (pass-through dims untouched).

    Coordinates ``[rotary_offset, rotary_offset + rotary_dim)`` are permuted (a spec's
    ``rotary_offset`` / ``rotary_dim``; rotary_dim defaults to the rest of the head, even).
    ``apply(convert_layout(x, to="half"), layout="half") == convert_layout(apply(x, layout="interleaved"), to="half")``.
    """
    from array_api_compat import array_namespace

    xp = array_namespace(x)
    if x.ndim < 1:
        raise ValueError(f"x must have at least 1 dimension (..., head_dim), got a 0-d array of shape {tuple(x.shape)}")
    perm = _head_permutation(x.shape[-1], rotary_dim, rotary_offset, to, "x.shape[-1]")
    return xp.take(x, xp.asarray(perm), axis=x.ndim - 1)


def permute_weights(w, num_heads, *, head_dim, rotary_dim=None, to: str = "half", rotary_offset=0):
    """Convert q/k projection weights (or biases) between layouts, per head, rotary span only.

    ``w`` has shape (num_heads * head_dim, in_features) (a torch/HF Linear weight, out x in) or
    (num_heads * head_dim,) for a bias. Row ``h*head_dim + j`` of the result is row
    ``h*head_dim + perm[j]`` of ``w``, with ``perm`` from :func:`layout_permutation` over rows
    ``[rotary_offset, rotary_offset + rotary_dim)`` of each head. Meta -> HF is ``to="half"`` (HF's
    ``permute``); llama.cpp's converter is ``to="interleaved"``.
    """
    from array_api_compat import array_namespace

    xp = array_namespace(w)
    h = as_int(num_heads, "num_heads")
    hd = as_int(head_dim, "head_dim")
    per_head = _head_permutation(hd, rotary_dim, rotary_offset, to, "head_dim")
    if w.ndim not in (1, 2) or w.shape[0] != h * hd:
        raise ValueError(f"w must have shape (num_heads*head_dim, in) or (num_heads*head_dim,) = "
                         f"({h * hd}, ...), got {tuple(w.shape)}")
    rows = (np.arange(h)[:, None] * hd + per_head[None, :]).reshape(-1)
    return xp.take(w, xp.asarray(rows), axis=0)
