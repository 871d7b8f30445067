"""Re-rotation of already-rotated keys: move cached keys to new positions, or to another spec.

A key rotated at position p by spec A is ``R^A_p k``; ``rerotate`` returns ``R^B_{p'} k`` (B = to_spec,
default A) in one pass, without the unrotated key: per pair, the rotation by the angle difference
``p' w^B_i - p w^A_i`` scaled by ``s^B / s^A`` (the specs' attention scaling factors). The host makes
one cos/sin table row per token from that float64 difference (for one spec, from the exact integer
offset ``p' - p``), and the backends rotate with their usual primitive (no new kernels).

Uses: attention sinks / a sliding cache (StreamingLLM renumbers the kept keys), context shift,
LongRoPE's switch from the short to the long factors (``seq_len`` -> ``to_seq_len``), or a change of
base/scaling. Positions follow :func:`rotary.apply`'s forms; in place with ``out=k``.
"""

from __future__ import annotations

import numpy as np

from ..frontend.axes import take_tensor_layout
from ..frontend.normalize import canonical_shape, namespace, normalize_positions, normalize_seq_axis, resolve_spec
from ..frontend.rotate import rotate_arrays
from ..spec.rope_spec import RopeSpec


def rerotate(k, from_positions, to_positions, *, spec=None, to_spec=None, seq_len=None, to_seq_len=None,
             seq_axis=None, out=None, backend="auto", **spec_kwargs):
    """Move keys rotated at ``from_positions`` (by ``spec``) to ``to_positions`` (by ``to_spec``).

    ``y = R^{to_spec}_{to} R^{spec}_{from}^{-1} k`` in one pass, per pair a rotation by
    ``to * w'_i - from * w_i`` times ``s' / s`` (attention scaling factors).

    Parameters
    ----------
    k : array (..., seq, ..., head_dim), rotated keys
    from_positions, to_positions : int or integer arrays (seq,) or (batch, seq)
        The positions k was rotated at and the positions it moves to (an int: offset + 0..seq-1).
    spec : RopeSpec (or the spec keywords of :func:`rotary.apply`)
    to_spec : RopeSpec, optional
        The spec of the result (default ``spec``); same head_dim, rotary_dim, layout and rotary_offset.
    seq_len, to_seq_len : int, optional
        The sequence length each spec's frequencies were taken at (dynamic / LongRoPE rules).
    seq_axis : int or str
        k's sequence axis, or the layout of its axes ("bshd", ...; also as ``layout=``), as in :func:`rotary.apply`.
    out : array, optional
        Where to write; ``out=k`` for in place.
    """
    xp = namespace([k], ["k"])
    seq_axis, spec_kwargs = take_tensor_layout(seq_axis, spec_kwargs)
    ax = normalize_seq_axis(seq_axis, k.ndim, "k")
    spec = resolve_spec(spec, spec_kwargs, int(k.shape[-1]), "k")
    if to_spec is None:
        to_spec = spec
    elif not isinstance(to_spec, RopeSpec):
        raise TypeError(f"to_spec must be a rotary.RopeSpec or None, got {type(to_spec).__name__}")
    for attr in ("head_dim", "rotary_dim", "layout", "rotary_offset"):
        if getattr(to_spec, attr) != getattr(spec, attr):
            raise ValueError(f"to_spec.{attr} ({getattr(to_spec, attr)!r}) must equal spec.{attr} "
                             f"({getattr(spec, attr)!r}): a re-rotation keeps the pairs")
    for name, value in (("seq_len", seq_len), ("to_seq_len", to_seq_len)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1):
            raise ValueError(f"{name} must be a positive int or None, got {value!r}")
    shape = tuple(k.shape)
    lead, S, B = shape[:ax], shape[ax], canonical_shape(shape, ax)[0]
    if from_positions is None or to_positions is None:
        raise TypeError("from_positions and to_positions are required (an int offset or an integer array)")
    src = normalize_positions(from_positions, lead, S, "from_positions", canonical_batch=B, spec=spec)
    dst = normalize_positions(to_positions, lead, S, "to_positions", canonical_batch=B, spec=to_spec)
    if src.shape[0] != dst.shape[0]:
        src, dst = (np.broadcast_to(a, (B,) + a.shape[1:]) for a in (src, dst))
    n_rows = src.shape[0] * S

    def tables(_spec, _pos, dtype, device_key, convert):
        convert = convert or (lambda a: a)
        if n_rows == 0:
            empty = np.zeros((1, spec.rotary_dim // 2), dtype)
            return convert(empty), convert(empty), convert(np.zeros(src.shape[:2], np.int64))
        if to_spec == spec and seq_len == to_seq_len and not spec.float_positions and _small_offsets(src, dst):
            theta = spec.angles(dst - src, seq_len)                   # the exact integer offset
        else:
            theta = to_spec.angles(dst, to_seq_len) - spec.angles(src, seq_len)
        theta = theta.reshape(n_rows, -1)
        ratio = to_spec.attention_scaling_at(to_seq_len) / spec.attention_scaling_at(seq_len)
        cos = np.ascontiguousarray((np.cos(theta) * ratio).astype(dtype))
        sin = np.ascontiguousarray((np.sin(theta) * ratio).astype(dtype))
        rows = np.arange(n_rows, dtype=np.int64).reshape(src.shape[0], S)
        return convert(cos), convert(sin), convert(rows)

    del xp
    return rotate_arrays([k], [out], ["k"], from_positions, spec=spec, seq_axis=ax, inverse=False, backend=backend,
                         spec_kwargs={}, tables=tables)[0]


def _small_offsets(src, dst) -> bool:
    """Whether every ``dst - src`` is an int64 below 2**53 in magnitude (exact in float64, no wrap-around:
    int64 positions near +-2**62 used to wrap to a wrong offset)."""
    if src.size == 0 or dst.size == 0:
        return True
    lo = min(int(src.min()), int(dst.min()))
    hi = max(int(src.max()), int(dst.max()))
    return hi - lo < 2**53
