"""The one-token decode step of linear attention: (B, 1, H, d) NumPy arrays continuing a 1-D state at its
next position, straight to the backend, checked once per geometry (:class:`DecodeStep`, carried by the
state it returns) instead of per call. Bit for bit the general path's result."""

from __future__ import annotations

import numpy as np

from ..frontend.normalize import pick_backend
from ..spec import tables as _tables
from .linear_args import plain_scalars
from .linear_state import LinearAttentionState

_INT64_MAX = 2**63 - 1


_DECODE_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


class DecodeStep:
    """What a one-token decode step continuing a state needs besides its arrays, checked once: the shapes,
    dtype and call options it was checked for, the backend module, and the cos/sin table rows
    ``base .. end - 1`` (positions) it reads. A state made by the step carries it to the next call."""

    __slots__ = ("shapes", "dtype", "backend", "feature_map", "normalize", "module", "cos", "sin", "base", "end")

    def takes(self, q, k, v, feature_map, normalize, backend, pos):
        return (q.shape == self.shapes[0] and k.shape == self.shapes[1] and v.shape == self.shapes[2]
                and q.dtype == self.dtype and k.dtype == self.dtype and v.dtype == self.dtype
                and feature_map == self.feature_map and normalize is self.normalize and backend == self.backend
                and self.base <= pos < self.end)


def decode_step(q, k, v, seq_axis, state, causal, feature_map, eps, chunk, normalize, return_state, backend):
    """The one-token decode step, (B, 1, H, d) NumPy arrays continuing a 1-D ``state`` at its next position,
    straight to the backend: the general path's result bit for bit, without its per-call checks (every
    field below is compared with what the state was made for; after the first step the comparisons are
    those of the :class:`DecodeStep` the state carries). None: not that case (the general path takes the
    call and does the full checks)."""
    if type(state) is not LinearAttentionState or type(q) is not np.ndarray or type(k) is not np.ndarray \
            or type(v) is not np.ndarray or type(seq_axis) is not int or seq_axis not in (1, -3) or q.ndim != 4:
        return None
    if causal is not True or not plain_scalars(causal, eps, chunk, return_state, normalize):
        return None
    pos = state.next_position
    step = state._step
    if step is None or type(pos) is not int or not step.takes(q, k, v, feature_map, normalize, backend, pos):
        step = prepare_decode_step(q, k, v, state, feature_map, normalize, backend)
        if step is None:
            return None
    S, z = state.S, state.z
    rows = np.array([[pos - step.base]], dtype=np.int64)
    o, (S_new, z_new) = step.module.linear_attention(
        q, k, v, step.cos, step.sin, rows, rotary_dim=state.spec.rotary_dim, layout=state.spec.layout, causal=True,
        feature_map=feature_map, eps=eps, chunk=chunk, state=(S, z), decay=None, normalize=normalize)
    if o.dtype != step.dtype:
        o = o.astype(step.dtype)
    if not return_state:
        return o
    return o, LinearAttentionState._trusted(S_new, z_new if normalize else None, pos + 1, state.spec, feature_map,
                                            None, normalize, state.groups, step)


def prepare_decode_step(q, k, v, state, feature_map, normalize, backend):
    """The checks of a decode step (see :func:`decode_step`) and its :class:`DecodeStep`, or None."""
    dtype = q.dtype
    if dtype not in _DECODE_DTYPES or k.dtype != dtype or v.dtype != dtype or k.ndim != 4 or v.ndim != 4:
        return None
    B, S1, H, m = q.shape
    Hk, dv = k.shape[2], v.shape[3]
    if S1 != 1 or k.shape != (B, 1, Hk, m) or v.shape[:3] != (B, 1, Hk) or Hk == 0 or H % Hk or dv == 0 or B == 0:
        return None
    spec, pos, S, z = state.spec, state.next_position, state.S, state.z
    if (spec.multi_axis or spec.rotary_offset or spec.depends_on_seq_len or spec.float_positions
            or spec.head_dim != m or state.decay is not None or state.groups != H // Hk
            or type(pos) is not int or not 0 <= pos < _INT64_MAX):
        return None
    if type(feature_map) is not str or feature_map != state.feature_map or normalize != state.normalize:
        return None
    if type(S) is not np.ndarray or S.shape != (B, Hk, m, dv) or S.dtype != dtype:
        return None
    if normalize and (type(z) is not np.ndarray or z.shape != (B, Hk, m) or z.dtype != dtype):
        return None
    module = pick_backend([q, k, v], backend, capability=None) if type(backend) is str else None
    if module is None or not hasattr(module, "linear_attention") or hasattr(module, "table_converter"):
        return None
    cos, sin, rows = _tables.lookup(spec, np.array([[pos]], dtype=np.int64), dtype=dtype, device_key="numpy")
    step = DecodeStep()
    step.shapes, step.dtype, step.backend, step.module = (q.shape, k.shape, v.shape), dtype, backend, module
    step.feature_map, step.normalize = state.feature_map, state.normalize   # the state's own objects
    step.cos, step.sin = cos, sin
    step.base = pos - int(rows[0, 0])   # row r of the table holds position base + r
    step.end = step.base + cos.shape[0]
    return step
