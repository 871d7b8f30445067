"""Packed variable-length batches (flash-attn's "varlen" / THD form), on the host.

A packed batch concatenates N sequences along one token axis of length T; ``cu_seqlens`` (shape
(N+1,), int32 or int64) holds the cumulative offsets: sequence n owns tokens
``cu_seqlens[n] <= t < cu_seqlens[n+1]``, with ``cu_seqlens[0] == 0`` and ``cu_seqlens[N] == T``.
Positions restart at each sequence: token t of sequence n sits at
``positions[t] = seqlen_offsets[n] + t - cu_seqlens[n]`` (``seqlen_offsets`` defaults to 0: a
sequence continuing a cache of length L has offset L).

:func:`pack` validates ``cu_seqlens`` and the offsets once and returns a :class:`Packed` with
everything the frontends and kernels need (int64 NumPy arrays):

>>> p = pack([0, 3, 5], 5, seqlen_offsets=[0, 10])
>>> p.positions.tolist(), p.seq_ids.tolist()
([0, 1, 2, 10, 11], [0, 0, 0, 1, 1])

Used by ``apply``/``apply_qk``/``attention`` (``cu_seqlens=``) and by ``linear_attention``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .validators import to_numpy


class Packed(NamedTuple):
    """A validated packed batch; every field is an int64 NumPy array.

    cu_seqlens (N+1,), starts = cu_seqlens[:-1] (N,), lengths (N,), offsets (N,) (the per-sequence
    position offsets), positions (T,) and seq_ids (T,) (the sequence of each token).
    """

    cu_seqlens: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray
    offsets: np.ndarray
    positions: np.ndarray
    seq_ids: np.ndarray

    @property
    def n_seqs(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def n_tokens(self) -> int:
        return int(self.cu_seqlens[-1])


def _host_int_array(a, name: str) -> np.ndarray:
    if isinstance(a, (bool, np.bool_)) or (isinstance(a, np.ndarray) and a.dtype == bool):
        raise TypeError(f"{name} must be an integer array, got a bool")
    arr = to_numpy(a, name) if not isinstance(a, (list, tuple)) else np.asarray(a)
    if arr.dtype.kind not in "iu":
        if arr.size == 0 and arr.dtype.kind == "f":   # np.asarray([]) is float64
            arr = arr.astype(np.int64)
        else:
            raise TypeError(f"{name} must have an integer dtype (int32/int64), got {arr.dtype}")
    if arr.dtype == np.uint64 and arr.size and arr.max() > np.iinfo(np.int64).max:
        raise ValueError(f"{name} does not fit in int64")
    return arr.astype(np.int64, copy=False)


host_int_array = _host_int_array   # a host int64 copy of any integer array-like, naming the argument on error


def check_cu_seqlens(cu_seqlens, n_tokens: int, name: str = "cu_seqlens") -> np.ndarray:
    """``cu_seqlens`` as a validated int64 (N+1,) array: 1-D, starts at 0, non-decreasing, ends at
    ``n_tokens``; ValueError/TypeError naming ``name`` otherwise."""
    cu = _host_int_array(cu_seqlens, name)
    if cu.ndim != 1 or cu.shape[0] < 1:
        raise ValueError(f"{name} must be a 1-D array of N+1 cumulative offsets (flash-attn's convention), "
                         f"got shape {cu.shape}")
    if cu[0] != 0:
        raise ValueError(f"{name} must start at 0, got {name}[0] = {int(cu[0])}")
    steps = np.diff(cu)
    if steps.size and steps.min() < 0:
        i = int(np.argmax(steps < 0))
        raise ValueError(f"{name} must be non-decreasing, got {name}[{i}] = {int(cu[i])} > "
                         f"{name}[{i + 1}] = {int(cu[i + 1])}")
    if cu[-1] != n_tokens:
        raise ValueError(f"{name} must end at the token count {n_tokens} (the packed sequence axis), "
                         f"got {name}[-1] = {int(cu[-1])}")
    return np.ascontiguousarray(cu)


_INT64 = np.iinfo(np.int64)


def check_offsets(seqlen_offsets, n_seqs: int, name: str = "seqlen_offsets") -> np.ndarray:
    """Per-sequence position offsets as int64 (N,): None -> zeros, an int -> that value for every
    sequence, else an integer array of shape (N,)."""
    if seqlen_offsets is None:
        return np.zeros(n_seqs, np.int64)
    if isinstance(seqlen_offsets, (int, np.integer)) and not isinstance(seqlen_offsets, (bool, np.bool_)):
        value = int(seqlen_offsets)
        if not _INT64.min <= value <= _INT64.max:
            raise ValueError(f"{name} {value} is outside int64 [{_INT64.min}, {_INT64.max}]")
        return np.full(n_seqs, value, np.int64)
    off = _host_int_array(seqlen_offsets, name)
    if off.shape != (n_seqs,):
        raise ValueError(f"{name} must have one offset per sequence, shape ({n_seqs},) (len(cu_seqlens) - 1), "
                         f"got shape {off.shape}")
    return np.ascontiguousarray(off)


def pack(cu_seqlens, n_tokens: int, seqlen_offsets=None, *, name: str = "cu_seqlens",
         offsets_name: str = "seqlen_offsets") -> Packed:
    """Validate a packed batch and expand it to per-token positions and sequence ids (see module doc)."""
    cu = check_cu_seqlens(cu_seqlens, n_tokens, name)
    starts = cu[:-1]
    lengths = np.diff(cu)
    offsets = check_offsets(seqlen_offsets, lengths.shape[0], offsets_name)
    over = np.flatnonzero((lengths > 0) & (offsets > _INT64.max - np.maximum(lengths - 1, 0)))   # no int64 wrap
    if over.size:
        n = int(over[0])
        raise ValueError(f"{offsets_name}[{n}] = {int(offsets[n])} with {int(lengths[n])} tokens gives positions up to "
                         f"{int(offsets[n]) + int(lengths[n]) - 1}, outside int64 (max {_INT64.max}); they would wrap "
                         "around")
    seq_ids = np.repeat(np.arange(lengths.shape[0], dtype=np.int64), lengths)
    positions = np.arange(n_tokens, dtype=np.int64) + np.repeat(offsets - starts, lengths)
    return Packed(cu, starts, lengths, offsets, positions, seq_ids)
