"""Linear attention with RoPE in the numerator only (RoFormer eq. 19), causal or not, resumable.

With a_t = phi(q_t), b_t = phi(k_t) and R_p the spec's rotation at position p::

    o_t = sum_s (R_{p_t} a_t)^T (R_{p_s} b_s) v_s  /  (sum_s a_t^T b_s + eps)

s over every token (``causal=False``) or s <= t (``causal=True``). The denominator is unrotated, so
it stays positive for positive feature maps (RoFormer §3.3: "we keep the denominator unchanged to
avoid the risk of dividing zero"); the weights then do not sum to 1 (see docs/linear_attention.md).
A :class:`LinearAttentionState` carries ``S = sum_s (R_{p_s} b_s) v_s^T`` and ``z = sum_s b_s`` of
the tokens seen so far (prefill, then decode or the next segment). The backend primitive is
``linear_attention`` of ``rotary.backends`` (contract in ``rotary.backends``' docstring).
"""

from __future__ import annotations

import math
import numbers

import numpy as np
from array_api_compat import device as xp_device, is_cupy_array, is_numpy_array

from . import _tables
from . import backends as _backends
from ._api import (_check_float, _namespace, _table_converter, canonical_shape, canonical_view, from_canonical,
                   normalize_positions, normalize_seq_axis, resolve_spec, to_canonical)
from ._spec import RopeSpec

FEATURE_MAPS = ("elu", "relu", "identity")


class LinearAttentionState:
    """The carried sums of linear attention after some tokens; immutable.

    Attributes
    ----------
    S : array (..., m, dv)
        ``sum_s (R_{p_s} phi(k_s)) v_s^T``; ``...`` are q's axes other than the sequence and last axes.
    z : array (..., m)
        ``sum_s phi(k_s)`` (unrotated).
    next_position : int or int64 ndarray (batch,)
        The position the next token gets when a call passes ``positions=None``.
    spec : RopeSpec
    feature_map : str or callable

    S and z are float32 (float64 for float64 inputs; never float16), of the inputs' array type and
    device. A state only continues calls with the same spec, feature map and shapes (ValueError).
    """

    __slots__ = ("S", "z", "next_position", "spec", "feature_map")

    def __init__(self, S, z, next_position, *, spec, feature_map="elu"):
        if not isinstance(spec, RopeSpec):
            raise TypeError(f"spec must be a rotary.RopeSpec, got {type(spec).__name__}")
        if len(S.shape) < 2 or tuple(z.shape) != tuple(S.shape[:-1]):
            raise ValueError(f"state S must be (..., m, dv) and z (..., m); got S {tuple(S.shape)}, z {tuple(z.shape)}")
        if S.shape[-2] != spec.head_dim:
            raise ValueError(f"state S has feature dim {S.shape[-2]}, spec.head_dim is {spec.head_dim}")
        if isinstance(next_position, (bool, np.bool_)):
            raise TypeError("next_position must be an int or an integer array, got a bool")
        if isinstance(next_position, numbers.Integral):
            next_position = int(next_position)
        else:
            next_position = np.array(next_position, copy=True)
            if next_position.dtype.kind not in "iu" or next_position.ndim != 1:
                raise TypeError(f"next_position must be an int or a 1-D integer array, got {next_position!r}")
            next_position = next_position.astype(np.int64)
            next_position.setflags(write=False)
        for name, value in (("S", S), ("z", z), ("next_position", next_position), ("spec", spec),
                            ("feature_map", feature_map)):
            object.__setattr__(self, name, value)

    def __setattr__(self, name, value):
        raise AttributeError("LinearAttentionState is immutable")

    def __reduce__(self):
        return (_rebuild_state, (self.S, self.z, self.next_position, self.spec, self.feature_map))

    def __repr__(self):
        return (f"LinearAttentionState(S{tuple(self.S.shape)} {self.S.dtype}, z{tuple(self.z.shape)}, "
                f"next_position={self.next_position!r}, spec={self.spec!r}, feature_map={self.feature_map!r})")


def _rebuild_state(S, z, next_position, spec, feature_map):
    return LinearAttentionState(S, z, next_position, spec=spec, feature_map=feature_map)


# -- validation --------------------------------------------------------------------------------
def _check_feature_map(feature_map):
    if callable(feature_map):
        return
    if not isinstance(feature_map, str) or feature_map not in FEATURE_MAPS:
        raise ValueError(f"feature_map must be one of {FEATURE_MAPS} or a callable, got {feature_map!r}")


def _check_scalars(causal, eps, chunk, return_state):
    for name, value in (("causal", causal), ("return_state", return_state)):
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    if isinstance(eps, (bool, np.bool_)) or not isinstance(eps, numbers.Real):
        raise TypeError(f"eps must be a real number, got {type(eps).__name__}")
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be a finite number >= 0, got {eps}")
    if isinstance(chunk, (bool, np.bool_)) or not isinstance(chunk, numbers.Integral):
        raise TypeError(f"chunk must be an integer, got {type(chunk).__name__}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")


def _check_shapes(q, k, v, ax):
    if k.ndim != q.ndim or v.ndim != q.ndim:
        raise ValueError(f"q, k, v must have the same number of dimensions, got {q.ndim}, {k.ndim}, {v.ndim}")
    if k.shape[ax] != q.shape[ax] or v.shape[ax] != q.shape[ax]:
        raise ValueError(f"q, k, v must have the same sequence length (axis {ax}), got "
                         f"{q.shape[ax]}, {k.shape[ax]}, {v.shape[ax]}")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k's last dim ({k.shape[-1]}) must equal q's ({q.shape[-1]})")
    if tuple(k.shape) != tuple(q.shape):
        raise ValueError(f"k of shape {tuple(k.shape)} must have q's shape {tuple(q.shape)} (no GQA here)")
    if tuple(v.shape[:-1]) != tuple(q.shape[:-1]):
        raise ValueError(f"v of shape {tuple(v.shape)} must match q {tuple(q.shape)} except in the last axis")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must have the same dtype, got {q.dtype}, {k.dtype}, {v.dtype}")


def _check_state(state, q, spec, feature_map, other_shape, m, dv):
    if not isinstance(state, LinearAttentionState):
        raise TypeError(f"state must be a rotary.LinearAttentionState or None, got {type(state).__name__}")
    _namespace([q, state.S, state.z], ["q", "state.S", "state.z"])
    expected = (*other_shape, m, dv)
    if tuple(state.S.shape) != expected:
        raise ValueError(f"state belongs to inputs with S of shape {tuple(state.S.shape)}; this call needs "
                         f"{expected} (q's axes other than seq and last, then m, dv)")
    if state.spec != spec:
        raise ValueError(f"state was made with {state.spec!r}, this call uses {spec!r}")
    if state.feature_map is not feature_map and state.feature_map != feature_map:
        raise ValueError(f"state was made with feature_map={state.feature_map!r}, this call uses {feature_map!r}")


# -- helpers -----------------------------------------------------------------------------------
def _canonical(x, ax, xp):
    """The (B, S, H, D) view of x (NumPy/CuPy: no copy when the strides allow one)."""
    if is_numpy_array(x) or is_cupy_array(x):
        view = canonical_view(x, ax)
        return view if view is not None else to_canonical(x.copy(), ax, xp)
    return to_canonical(x, ax, xp)


def _start_positions(state, lead_shape, seq_len):
    """positions=None with a state: from the state's next position on (an int offset or (batch, seq))."""
    start = state.next_position
    if isinstance(start, int):
        return start
    if not lead_shape or start.shape != (lead_shape[0],):
        raise ValueError(f"state.next_position of shape {start.shape} does not match the batch axis "
                         f"(size {lead_shape[0] if lead_shape else 'none'}) of q")
    return start[:, None] + np.arange(seq_len, dtype=np.int64)[None, :]


def _next_position(pos, lead_shape, seq_len, positions, state):
    """next_position after this call: last position + 1 (int, or (batch,) for per-batch positions)."""
    if seq_len == 0:
        if state is not None:
            return state.next_position
        return int(positions) if isinstance(positions, numbers.Integral) else 0
    if pos.ndim == 3 or pos.dtype.kind == "f":
        # multi-axis (M-RoPE's decode rule: every axis continues from the largest coordinate + 1) or
        # real-valued coordinates: one past the largest coordinate seen
        last = np.floor(pos.reshape(pos.shape[0], -1).max(axis=1)).astype(np.int64) + 1
    else:
        last = pos[:, -1] + 1
    if pos.shape[0] == 1:
        return int(last[0])
    rep = pos.shape[0] // lead_shape[0]
    return last[::rep]


def _backend_module(arrays, backend):
    module = _backends.pick(arrays, backend)
    if hasattr(module, "linear_attention"):
        return module
    if backend == "auto":
        return _backends.get("numpy")
    raise NotImplementedError(f"backend {backend!r} has no linear_attention; use backend='numpy' or 'auto'")


# -- public ------------------------------------------------------------------------------------
def linear_attention(q, k, v, positions=None, *, causal=False, feature_map="elu", eps=1e-6, spec=None,
                     seq_axis=-2, state=None, return_state=False, backend="auto", chunk=64, **spec_kwargs):
    """Linear attention with RoPE on the feature-mapped q and k, numerator only (RoFormer eq. 19).

    ``o_t = sum_s (R_{p_t} a_t)^T (R_{p_s} b_s) v_s / (sum_s a_t^T b_s + eps)`` with a = phi(q),
    b = phi(k); s <= t when ``causal``, every s otherwise; a ``state`` adds its earlier tokens to
    both sums.

    Parameters
    ----------
    q, k : arrays (..., seq, ..., d), same shape and dtype
    v : array, q's shape with its own last dim dv
    positions : None, int or integer array
        As in :func:`rotary.apply`. None: 0..seq-1, or with a ``state`` its ``next_position`` onwards.
    causal : bool
    feature_map : {"elu", "relu", "identity"} or callable
        "elu" is elu(x) + 1 (Katharopoulos et al.). A callable gets q (and k) as float32 arrays
        (float64 for float64 input) of the input's array type and returns phi(q) (..., m); m may differ
        from d, and the spec then describes m. It runs here, before the backend (which then gets
        "identity"), so every backend takes it. Positive maps keep the denominator > 0.
    eps : float >= 0
        Added to the denominator.
    spec : RopeSpec, optional
        Or the spec keywords (``base=``, ``layout=``, ...). With a ``state`` and no spec given, the
        state's spec. The spec's attention scaling multiplies the numerator by its square.
    seq_axis : int
        The sequence axis (default -2; -3 for (batch, seq, heads, d)).
    state : LinearAttentionState, optional
        The sums of earlier tokens (from ``return_state=True``). Causal: token t sees the state's
        tokens and this call's s <= t. Non-causal: every token of this call sees the state's tokens
        and every token of this call (block-causal across calls).
    return_state : bool
        Also return the state after this call's tokens: ``(o, state)``.
    backend : {"auto", "numpy", "numba", "cupy"}
    chunk : int
        Chunk length of the causal algorithm (intra-chunk quadratic, carried state in between).

    Returns
    -------
    o or (o, state)
        ``o`` has q's array type and dtype and q's shape with last dim dv; ``(o, state)`` with
        ``return_state=True``.
    """
    xp = _namespace([q, k, v], ["q", "k", "v"])
    for a, name in ((q, "q"), (k, "k"), (v, "v")):
        _check_float(a, name, xp)
    ax = normalize_seq_axis(seq_axis, q.ndim, "q")
    _check_shapes(q, k, v, ax)
    _check_scalars(causal, eps, chunk, return_state)
    _check_feature_map(feature_map)

    work = xp.float64 if q.dtype == xp.float64 else xp.float32
    if callable(feature_map):
        a, b = feature_map(xp.astype(q, work)), feature_map(xp.astype(k, work))
        for x, name in ((a, "feature_map(q)"), (b, "feature_map(k)")):
            if tuple(x.shape[:-1]) != tuple(q.shape[:-1]) or x.ndim != q.ndim:
                raise ValueError(f"{name} must have shape {tuple(q.shape[:-1])} + (m,), got {tuple(x.shape)}")
        if b.shape[-1] != a.shape[-1]:
            raise ValueError(f"feature_map(q) and feature_map(k) must have the same last dim, got "
                             f"{a.shape[-1]} and {b.shape[-1]}")
        a, b, v_in = xp.astype(a, work), xp.astype(b, work), xp.astype(v, work)
        backend_map = "identity"
    else:
        a, b, v_in, backend_map = q, k, v, feature_map
    m, dv, seq_len = int(a.shape[-1]), int(v.shape[-1]), int(q.shape[ax])
    lead_shape = tuple(q.shape[:ax])
    other_shape = lead_shape + tuple(q.shape[ax + 1:-1])

    if state is not None and spec is None and not spec_kwargs and isinstance(state, LinearAttentionState):
        spec = state.spec
    spec = resolve_spec(spec, spec_kwargs, m, "phi(q)" if callable(feature_map) else "q")
    if state is not None:
        _check_state(state, q, spec, feature_map, other_shape, m, dv)
        if positions is None:
            positions = _start_positions(state, lead_shape, seq_len)
    B, _, H, _ = canonical_shape(tuple(q.shape), ax)
    pos = normalize_positions(positions, lead_shape, seq_len, canonical_batch=B, spec=spec)

    if seq_len == 0:
        dev = xp_device(q)
        o = xp.zeros((*q.shape[:-1], dv), dtype=q.dtype, device=dev)
        if not return_state:
            return o
        if state is not None:
            return o, state
        S = xp.zeros((*other_shape, m, dv), dtype=work, device=dev)
        z = xp.zeros((*other_shape, m), dtype=work, device=dev)
        return o, LinearAttentionState(S, z, _next_position(pos, lead_shape, 0, positions, None), spec=spec,
                                       feature_map=feature_map)

    module = _backend_module([q, k, v], backend)
    device_key, convert = _table_converter(module, q, xp)
    table_dtype = np.float64 if q.dtype == xp.float64 else np.float32
    cos, sin, rows = _tables.lookup(spec, pos, dtype=table_dtype, device_key=device_key, convert=convert)
    carried = None
    if state is not None:
        # canonical (B, H) is the row-major merge of q's axes other than seq and last: a plain reshape
        carried = (xp.reshape(xp.astype(state.S, work, copy=False), (B, H, m, dv)),
                   xp.reshape(xp.astype(state.z, work, copy=False), (B, H, m)))
    o, (S, z) = module.linear_attention(
        _canonical(a, ax, xp), _canonical(b, ax, xp), _canonical(v_in, ax, xp), cos, sin, rows,
        rotary_dim=spec.rotary_dim, layout=spec.layout, causal=bool(causal), feature_map=backend_map,
        eps=float(eps), chunk=int(chunk), state=carried)
    o = xp.astype(from_canonical(o, (*q.shape[:-1], dv), ax, xp), q.dtype, copy=False)   # fresh from the backend
    if not return_state:
        return o
    new_state = LinearAttentionState(xp.reshape(S, (*other_shape, m, dv)), xp.reshape(z, (*other_shape, m)),
                                     _next_position(pos, lead_shape, seq_len, positions, state), spec=spec,
                                     feature_map=feature_map)
    return o, new_state
