"""``ml_dtypes.bfloat16`` NumPy arrays: computed in float32, returned as bfloat16.

NumPy has no bfloat16 of its own; ml_dtypes (JAX's dtype package) adds one. Such arrays are accepted
wherever float16 is (``apply``, ``apply_qk``, ``rerotate``, ``attention``, ``linear_attention``): each is
widened to float32 (exact), the call runs on the chosen backend as for float32, and the result is rounded
back to bfloat16 (round to nearest even; attention returns q's dtype). ``out=`` bfloat16 arrays
are written in place. The cost is one float32 copy of each input and output.
"""

from __future__ import annotations

import numpy as np


def is_bf16(a) -> bool:
    return isinstance(a, np.ndarray) and a.dtype.name == "bfloat16"


def _widen(a):
    return a.astype(np.float32) if is_bf16(a) else a


def rotate(core, xs, outs, names, positions, **kwargs):
    """``rotary.frontend.rotate.rotate_arrays`` for bfloat16 NumPy arrays."""
    for x, out, name in zip(xs, outs, names):
        if out is not None and (not isinstance(out, np.ndarray) or out.dtype != x.dtype or out.shape != x.shape):
            raise ValueError(f"out for {name} must be a NumPy array of {name}'s shape {x.shape} and dtype {x.dtype}, "
                             f"got {type(out).__name__} {getattr(out, 'shape', None)} {getattr(out, 'dtype', None)}")
    results = core([_widen(x) for x in xs], [None if is_bf16(x) else o for x, o in zip(xs, outs)], names, positions,
                   **kwargs)
    final = []
    for x, out, y in zip(xs, outs, results):
        if not is_bf16(x):
            final.append(y)
        elif out is None:
            final.append(y.astype(x.dtype))
        else:
            np.copyto(out, y, casting="unsafe")
            final.append(out)
    return final


def linear_attention(core, q, k, v, positions=None, **kwargs):
    """``rotary.linear_attention`` for bfloat16 NumPy arrays (the state is float32 as for float16)."""
    dtype = q.dtype
    for a, name in ((k, "k"), (v, "v")):
        if a.dtype != dtype:
            raise TypeError(f"q, k, v must have the same dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    result = core(_widen(q), _widen(k), _widen(v), positions, **kwargs)
    if kwargs.get("return_state", False):
        return result[0].astype(dtype), result[1]
    return result.astype(dtype)


def attention(core, q, k, v, positions=None, **kwargs):
    """``rotary.attention`` for bfloat16 NumPy arrays: q, k, v widened to float32 (the scores and softmax
    are float32 for 16-bit inputs anyway), the output rounded to q's dtype."""
    o = core(_widen(q), _widen(k), _widen(v), positions, **kwargs)
    return o.astype(q.dtype) if is_bf16(q) else o
