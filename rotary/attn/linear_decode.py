"""The one-token decode step of linear attention: the plan of a (B, 1, H, d) NumPy call continuing a 1-D state.

The general path (:func:`rotary.attn.linear.linear_attention`) checks a call; when that call is a one-token
step that the next token can repeat, it makes a :class:`DecodeStep` (:func:`make_decode_step`) from what it
proved (shapes, dtype, options, the backend module, the cos/sin table it read) and the state it returns
carries it. The next call with that state runs :func:`decode_step`: it compares the call with the step's key
(array types, shapes and dtypes, seq_axis, feature map, normalize, backend, the position within the step's
table) and checks what can change with the same key (the scalar arguments), then calls the backend. Bit
for bit the general path's result."""

from __future__ import annotations

import numpy as np

from .linear_args import check_scalars
from .linear_state import LinearAttentionState

_DECODE_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


class DecodeStep:
    """What the general path proved of a one-token decode call: the shapes, dtype and options it was checked
    for, the backend module, and the cos/sin table rows ``base .. end - 1`` (positions) it reads."""

    __slots__ = ("shapes", "dtype", "backend", "feature_map", "normalize", "module", "cos", "sin", "base", "end")

    def takes(self, q, k, v, seq_axis, feature_map, normalize, backend, pos):
        """Whether a call has this step's key (the arrays exactly NumPy, of the step's shapes and dtype)."""
        return (type(q) is np.ndarray and type(k) is np.ndarray and type(v) is np.ndarray
                and type(seq_axis) is int and seq_axis in (1, -3) and q.shape == self.shapes[0]
                and k.shape == self.shapes[1] and v.shape == self.shapes[2] and q.dtype == self.dtype
                and k.dtype == self.dtype and v.dtype == self.dtype and feature_map == self.feature_map
                and normalize is self.normalize and type(backend) is str and backend == self.backend
                and type(pos) is int and self.base <= pos < self.end)


def decode_step(q, k, v, seq_axis, state, causal, feature_map, eps, chunk, normalize, return_state, backend):
    """A one-token call continuing a ``state`` that carries a :class:`DecodeStep` of this call's key, straight
    to the backend; None when the call is not that case (the general path takes it, and checks it)."""
    step = state._step if type(state) is LinearAttentionState else None
    pos = None if step is None else state.next_position
    if step is None or causal is not True or not step.takes(q, k, v, seq_axis, feature_map, normalize, backend, pos):
        return None
    check_scalars(causal, eps, chunk, return_state, normalize)   # what can change with the same key
    rows = np.array([[pos - step.base]], dtype=np.int64)
    o, (S_new, z_new) = step.module.linear_attention(
        q, k, v, step.cos, step.sin, rows, rotary_dim=state.spec.rotary_dim, layout=state.spec.layout, causal=True,
        feature_map=feature_map, eps=float(eps), chunk=int(chunk), state=(state.S, state.z), decay=None,
        normalize=normalize)
    if o.dtype != step.dtype:
        o = o.astype(step.dtype)
    if not return_state:
        return o
    return o, LinearAttentionState._trusted(S_new, z_new if normalize else None, pos + 1, state.spec, feature_map,
                                            None, normalize, state.groups, step)


def make_decode_step(q, k, v, ax, perm, spec, feature_map, decay, causal, normalize, backend, module, cos, sin, rows,
                     next_pos):
    """The :class:`DecodeStep` of a call the general path has checked, when the next token can repeat it: plain
    NumPy (B, 1, H, d) arrays in BSHD order of float32/float64, causal, a named feature map, no decay, a 1-D
    spec without offset whose frequencies do not depend on the length, a backend reading host tables, an int
    next position. None otherwise."""
    if not (type(q) is np.ndarray and type(k) is np.ndarray and type(v) is np.ndarray and q.ndim == 4 and ax == 1
            and perm is None and q.shape[1] == 1 and q.dtype in _DECODE_DTYPES and causal is True
            and type(feature_map) is str and decay is None and type(next_pos) is int and type(normalize) is bool
            and type(backend) is str and type(cos) is np.ndarray and rows.shape == (1, 1)
            and not (spec.multi_axis or spec.rotary_offset or spec.depends_on_seq_len or spec.float_positions)
            and not hasattr(module, "table_converter")):
        return None
    step = DecodeStep()
    step.shapes, step.dtype, step.backend, step.module = (q.shape, k.shape, v.shape), q.dtype, backend, module
    step.feature_map, step.normalize = feature_map, normalize
    step.cos, step.sin = cos, sin
    step.base = next_pos - 1 - int(rows[0, 0])   # row r of the table holds position base + r
    step.end = step.base + cos.shape[0]
    return step
