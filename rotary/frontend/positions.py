"""Positions in every form callers pass -> an int64 (or float64) host array ``(Bp, S[, n])`` with Bp in {1, B}:
None / int offset / (S,) / (batch, S) or (1, S) / multi-axis (S, n) or (batch, S, n) / packed (``cu_seqlens``) /
continuing a linear-attention state; :func:`prepared_rows` is the same parse for a planned call's common
forms (no copy, no range check: the backend checks rows against its table)."""

from __future__ import annotations

import math
import numbers

import numpy as np

from ..spec import packing as _packing
from ..spec.rope_spec import RopeSpec
from ..spec.validators import to_numpy
from .axes import normalize_seq_axis

_INT64_MAX = 2**63 - 1


def normalize_positions(positions, lead_shape: tuple, seq_len: int, name: str = "positions",
                        canonical_batch: int | None = None, spec: RopeSpec | None = None) -> np.ndarray:
    """int64 array (Bp, S), Bp in {1, canonical_batch}; (Bp, S, n_axes) for a multi-axis ``spec``
    (float64 for a spec with ``float_positions``).

    None -> 0..S-1; an integer -> offset + 0..S-1; an integer array of shape (S,) or (batch, S)
    with batch = lead_shape[0], or (1, S): one row for every batch entry (a leading 1 broadcasts over the batch
    axis, as in NumPy and HF's position_ids; never onto a heads axis: a 2-D array is (batch, S) and nothing
    else, and an input without a batch axis takes no 2-D positions). A multi-axis spec takes (S, n_axes) or
    (batch, S, n_axes) (or (1, S, n_axes)), and None or an integer for M-RoPE only (text tokens: the same
    position on every axis). ``canonical_batch`` (default lead_shape[0]) is the B of the canonical view (see
    :func:`canonical_axes`); rows are repeated when it merges more axes.
    """
    n_axes = spec.n_axes if spec is not None and spec.multi_axis else 0
    float_ok = spec is not None and spec.float_positions
    if n_axes and (positions is None or isinstance(positions, (int, np.integer))) and spec.mrope_section is None:
        raise ValueError(f"{name} must give the {n_axes} coordinates of every token for this multi-axis spec: an "
                         f"array of shape ({seq_len}, {n_axes}) or (batch, {seq_len}, {n_axes}) (e.g. "
                         "rotary.grid_positions(h, w)); only M-RoPE specs take None or an offset (text positions)")
    if positions is None:
        return spread_positions(np.arange(seq_len, dtype=np.int64)[None, :], n_axes)
    if isinstance(positions, bool) or (isinstance(positions, np.ndarray) and positions.dtype == bool):
        raise TypeError(f"{name} must be None, an integer offset or an integer array, got a bool")
    if isinstance(positions, (int, np.integer)):
        return spread_positions(offset_positions(positions, seq_len, name)[None, :], n_axes)
    if isinstance(positions, float):
        raise TypeError(f"{name} must be None, an integer offset or an integer array, got float {positions!r}")
    p = to_numpy(positions, name)
    if p.size == 0 and p.dtype.kind not in "iu" and not (float_ok and p.dtype.kind == "f"):
        p = p.astype(np.int64)   # an empty list ([] is float64 to NumPy): no values, so no wrong dtype
    if p.dtype.kind not in ("iuf" if float_ok else "iu"):
        if p.dtype.kind == "f":
            raise TypeError(f"{name} must have an integer dtype, got {p.dtype} (real-valued coordinates need a spec "
                            "with float_positions=True)")
        raise TypeError(f"{name} must have an integer dtype, got {p.dtype}")
    if p.dtype.kind == "f":
        p = p.astype(np.float64, copy=False)
        if not np.all(np.isfinite(p)):
            raise ValueError(f"{name} must be finite")
    else:
        if p.dtype == np.uint64 and p.size and p.max() > np.iinfo(np.int64).max:
            raise ValueError(f"{name} does not fit in int64")
        p = p.astype(np.int64, copy=False)
    if n_axes:
        if p.ndim == 0 or p.shape[-1] != n_axes:
            raise ValueError(f"{name} of shape {p.shape} must carry the spec's {n_axes} coordinates on a trailing "
                             f"axis: ({seq_len}, {n_axes}) or (batch, {seq_len}, {n_axes}) (HF's multi-axis "
                             f"position_ids ({n_axes}, batch, seq) become np.moveaxis(position_ids, 0, -1); 1-D ids, "
                             "which HF's text models expand to every axis, become "
                             f"np.repeat(ids[..., None], {n_axes}, axis=-1))")
        core = p.shape[:-1]
    else:
        core = p.shape
        if spec is not None and p.ndim >= 1 and p.shape[-1] != seq_len and p.ndim <= 3 and p.shape[-1] in (2, 3):
            raise ValueError(f"{name} of shape {p.shape} look like multi-axis coordinates, but this spec is 1-D "
                             f"(one position per token): pass shape ({seq_len},) or (batch, {seq_len}), or a "
                             "multi-axis spec (mrope_section=, RopeSpec.axial)")
    if len(core) == 0:
        if n_axes:
            raise ValueError(f"{name} of shape {p.shape} needs a sequence axis: ({seq_len}, {n_axes})")
        return offset_positions(p[()], seq_len, name)[None, :]
    tail = (n_axes,) if n_axes else ()
    if len(core) == 1:
        if core[0] != seq_len:
            raise ValueError(f"{name} of shape {p.shape} does not match the sequence length {seq_len} "
                             f"(expected shape {(seq_len, *tail)} or "
                             f"({lead_shape[0] if lead_shape else 'batch'}, {seq_len}{', ' + str(n_axes) if n_axes else ''}))")
        return np.ascontiguousarray(p[None])
    if len(core) == 2:
        if not lead_shape:
            raise ValueError(f"{name} of shape {p.shape} has a batch axis but the input has no batch axis before the "
                             f"sequence axis; pass shape {(seq_len, *tail)}")
        if core == (1, seq_len):   # one row (HF's (1, S) position_ids): every batch row, as NumPy broadcasts it
            return np.ascontiguousarray(p)
        if core != (lead_shape[0], seq_len):
            raise ValueError(f"{name} of shape {p.shape} must be {(seq_len, *tail)} or (batch, seq{', n_axes' if n_axes else ''}) "
                             f"= {(lead_shape[0], seq_len, *tail)}; positions are never broadcast onto other axes")
        rep = (canonical_batch or lead_shape[0]) // lead_shape[0] if lead_shape[0] else 1
        if rep > 1:
            p = np.repeat(p, rep, axis=0)
        return np.ascontiguousarray(p)
    raise ValueError(f"{name} must be None, an integer, or an array of shape {(seq_len, *tail)} or "
                     f"(batch, {seq_len}{', ' + str(n_axes) if n_axes else ''}); got shape {p.shape}")


_INT64 = np.iinfo(np.int64)


def offset_positions(offset, seq_len: int, name: str = "positions") -> np.ndarray:
    """int64 ``offset + 0..seq_len-1``; ValueError when a position falls outside int64 (never wraps)."""
    offset = int(offset)
    last = offset + max(seq_len - 1, 0)
    if offset < _INT64.min or last > _INT64.max:
        raise ValueError(f"{name}: offset {offset} with {seq_len} tokens gives positions {offset}..{last}, outside "
                         f"int64 [{_INT64.min}, {_INT64.max}] (angles are exact below 2**53)")
    return np.arange(seq_len, dtype=np.int64) + np.int64(offset)


def spread_positions(p: np.ndarray, n_axes: int) -> np.ndarray:
    """(Bp, S) text positions -> (Bp, S, n_axes) with the same value on every axis (n_axes > 0)."""
    if not n_axes:
        return p
    return np.ascontiguousarray(np.broadcast_to(p[..., None], p.shape + (n_axes,)))



def packed_positions(x, seq_axis, positions, cu_seqlens, seqlen_offsets, name="x", spec=None):
    """``positions`` for a call with ``cu_seqlens`` (a packed batch, see :mod:`rotary.spec.packing`).

    Without cu_seqlens: positions unchanged (seqlen_offsets must be None). With it: x must have no
    batch axis before its sequence axis (or one of size 1); positions None -> restarting per sequence
    at seqlen_offsets; an explicit per-token positions array is used as given. Returns
    ``(positions, packed)`` with ``packed`` None without cu_seqlens. For an M-RoPE spec the restarted
    text positions are spread over its axes, (T, n_axes).
    """
    if cu_seqlens is None:
        if seqlen_offsets is not None:
            raise ValueError("seqlen_offsets needs cu_seqlens (one offset per packed sequence); for a padded "
                             "batch pass positions=offset or positions of shape (batch, seq)")
        return positions, None
    shape = tuple(x.shape)
    ax = normalize_seq_axis(seq_axis, len(shape), name)
    if math.prod(shape[:ax]) != 1:
        raise ValueError(f"cu_seqlens needs packed input: {name} of shape {shape} has batch axes {shape[:ax]} "
                         f"before the sequence axis {ax}; pack the sequences along one token axis "
                         "(total_tokens, heads, head_dim) and pass seq_axis=0")
    try:
        packed = _packing.pack(cu_seqlens, shape[ax], seqlen_offsets)
    except ValueError as exc:
        if "token count" in str(exc) and ax != 0:
            raise ValueError(f"{exc}; {name}'s sequence axis is {ax} (seq_axis={seq_axis}): for packed "
                             "(total_tokens, heads, head_dim) input pass seq_axis=0") from None
        raise
    if positions is None:
        if isinstance(spec, RopeSpec) and spec.multi_axis and spec.mrope_section is not None:
            return spread_positions(packed.positions, spec.n_axes), packed
        return packed.positions, packed
    if seqlen_offsets is not None:
        raise ValueError("pass seqlen_offsets or per-token positions with cu_seqlens, not both")
    return positions, packed


# -- positions that continue a state (linear attention) ------------------------------------------
def start_positions(state, lead_shape, seq_len):
    """positions=None with a state: from the state's next position on (an int offset or (batch, seq))."""
    start = state.next_position
    if isinstance(start, int):
        return start
    if not lead_shape or start.shape != (lead_shape[0],):
        raise ValueError(f"state.next_position of shape {start.shape} does not match the batch axis "
                         f"(size {lead_shape[0] if lead_shape else 'none'}) of q")
    return start[:, None] + np.arange(seq_len, dtype=np.int64)[None, :]


def next_position(pos, lead_shape, seq_len, positions, state):
    """next_position after this call: last position + 1 (int, or (batch,) for per-batch positions)."""
    if seq_len == 0:
        if state is not None:
            return state.next_position
        return int(positions) if isinstance(positions, numbers.Integral) else 0
    if pos.ndim == 2 and pos.shape[0] == 1 and pos.dtype == np.int64:   # one row of positions (decode: one)
        last = int(pos[0, -1])
        if last == _INT64_MAX:
            raise ValueError("the last position is the largest int64: the next position (for a state) would "
                             "overflow int64")
        return last + 1
    if pos.ndim == 3 or pos.dtype.kind == "f":
        # multi-axis (M-RoPE's decode rule: every axis continues from the largest coordinate + 1) or
        # real-valued coordinates: one past the largest coordinate seen
        last = np.floor(pos.reshape(pos.shape[0], -1).max(axis=1)).astype(np.int64) + 1
    else:
        if int(pos[:, -1].max()) == _INT64_MAX:
            raise ValueError("the last position is the largest int64: the next position (for a state) would "
                             "overflow int64")
        last = pos[:, -1] + 1
    if pos.shape[0] == 1:
        return int(last[0])
    rep = pos.shape[0] // lead_shape[0]
    return last[::rep]



_INT64_LIMIT = 2 ** 63


def prepared_rows(positions, seq_len: int, lead0: int, batch_rep: int, default_rows, device_rows: bool = False):
    """``(rows, start)`` for the common positions of a prepared call (:class:`rotary.Rope`): token (b, s)
    is at position ``rows[b or 0, s] + start``; rows are C-contiguous aligned int64 (Bp, S) (the caller's
    positions or a view of them: backends only read them) and not range-checked (the backend checks them
    against its table). None, an int offset, a C-contiguous int64 (S,) or (batch, S) array are taken, and (1, S)
    where the input has a batch axis (``lead0`` >= 0; -1 for none) (with
    ``device_rows``, also device int64 arrays of those shapes); None is returned for anything else, which
    :func:`normalize_positions` then parses on the general path."""
    if positions is None:
        return default_rows, 0
    if type(positions) is int:
        return (default_rows, positions) if -_INT64_LIMIT <= positions < _INT64_LIMIT - seq_len else None
    if device_rows and type(positions).__module__.startswith("cupy") and positions.dtype == np.int64:
        if positions.shape == (seq_len,):
            return positions.reshape(1, seq_len), 0
        return (positions, 0) if (positions.shape == (lead0, seq_len) and batch_rep == 1
                                  or positions.shape == (1, seq_len) and lead0 >= 0) else None
    if type(positions) is not np.ndarray or positions.dtype != np.int64:
        return None
    flags = positions.flags
    if not (flags.c_contiguous and flags.aligned):
        return None
    if positions.shape == (lead0, seq_len) and batch_rep == 1 or (positions.shape == (1, seq_len) and lead0 >= 0):
        return positions, 0
    return (positions.reshape(1, seq_len), 0) if positions.shape == (seq_len,) else None
