"""A packed batch (``cu_seqlens``) laid out as padded batches, for code that runs on (B, L, ...) batches.

Sequence n of a packed token axis of length T is tokens ``cu[n]:cu[n + 1]``. A *bucket* of the non-empty
sequences becomes a (nb, W, ...) batch, W its longest length: row i holds the bucket's i-th sequence, its
tokens first, then padding (``gather_padded``). Packed token t of sequence n comes back from slot
``row(n) * W + t - cu[n]`` of its bucket's flattened output, the buckets' outputs concatenated
(``BucketPlan.scatter``, ``merge_tokens``); per-sequence results come back with ``merge_sequences``.

Buckets (``plan_buckets``): the non-empty sequences sorted by length, cut greedily into runs of
consecutive ones, each padded to its longest; a run ends before a sequence that would take it past
``max_rows`` rows, past ``max_elements`` (rows x min(W, chunk) x ``token_cost``: a cache-sized block;
no limit: one bucket) or past ``PAD_RATIO`` x its real tokens in padded ones (one sequence much longer
than the rest gets a bucket of its own instead of padding every other one to its length). Empty
sequences are in no bucket."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from array_api_compat import device as xp_device, is_numpy_array

PAD_RATIO = 4   # a bucket's padded tokens stay within PAD_RATIO x its real tokens


@dataclass(frozen=True)
class Bucket:
    """Sequences ``ids`` (ascending) of ``lengths``, padded to ``width``; ``gather`` (nb * width,) the
    packed token of each padded slot, T for padding."""
    ids: np.ndarray
    lengths: np.ndarray
    width: int
    gather: np.ndarray


@dataclass(frozen=True)
class BucketPlan:
    """``buckets``; ``empty`` the ids of empty sequences; ``state_rows`` (N,) each sequence's row in the
    buckets' per-sequence results concatenated, then the empty ones' (None where that is 0..N-1);
    ``scatter`` (T,) each packed token's slot in the buckets' flattened outputs concatenated."""
    buckets: tuple
    empty: np.ndarray
    state_rows: np.ndarray | None
    scatter: np.ndarray


def _runs(sorted_lengths, max_rows, max_elements, token_cost, chunk):
    """(start, stop) runs of ascending ``sorted_lengths``; see the module docstring."""
    runs, start, real = [], 0, 0
    for i, length in enumerate(sorted_lengths.tolist()):
        rows = i + 1 - start
        if rows > 1 and (rows > max_rows or rows * min(length, chunk) * token_cost > max_elements
                         or rows * length > PAD_RATIO * (real + length)):
            runs.append((start, i))
            start, real = i, 0
        real += length
    if sorted_lengths.size:
        runs.append((start, sorted_lengths.size))
    return runs


def plan_buckets(cu_seqlens, *, max_rows=None, max_elements=None, token_cost=1, chunk=None) -> BucketPlan:
    """The buckets of a packed batch (see the module docstring); None: no limit."""
    cu = np.asarray(cu_seqlens, dtype=np.int64).reshape(-1)
    lengths = np.diff(cu)
    T = int(cu[-1]) if cu.size else 0
    live = np.flatnonzero(lengths)
    by_length = live[np.argsort(lengths[live], kind="stable")]
    inf = float("inf")
    runs = _runs(lengths[by_length], inf if max_rows is None else max_rows,
                 inf if max_elements is None else max_elements, token_cost, inf if chunk is None else chunk)
    buckets, scatter, base = [], np.empty(T, dtype=np.int64), 0
    for start, stop in runs:
        ids = np.sort(by_length[start:stop])
        lens = lengths[ids]
        width = int(lens.max())
        j = np.arange(width)
        real = j < lens[:, None]
        gather = np.where(real, cu[ids][:, None] + j, T).reshape(-1)
        real = real.reshape(-1)
        scatter[gather[real]] = base + np.flatnonzero(real)
        base += gather.size
        buckets.append(Bucket(ids, lens, width, gather))
    empty = np.flatnonzero(lengths == 0)
    order = np.concatenate([b.ids for b in buckets] + [empty])
    identity = np.array_equal(order, np.arange(order.size))
    return BucketPlan(tuple(buckets), empty, None if identity else np.argsort(order), scatter)


def gather_padded(xp, x, gather, fill=0):
    """x (T, ...) -> (len(gather), ...): rows ``x[gather]``, ``fill`` where gather == T."""
    n = x.shape[0]
    if is_numpy_array(x):
        out = np.take(x, np.minimum(gather, n - 1), axis=0)
        out[gather == n] = fill
        return out
    dev = xp_device(x)
    pad = xp.full((1,) + tuple(x.shape[1:]), fill, dtype=x.dtype, device=dev)
    return xp.take(xp.concat([x, pad], axis=0), xp.asarray(gather, device=dev), axis=0)


def merge_tokens(xp, plan, outs):
    """The packed (T, ...) array from the buckets' flattened padded outputs ``outs`` (nb * W, ...)."""
    T = int(plan.scatter.size)
    if is_numpy_array(outs[0]):                       # written in place: one copy
        out = np.empty((T,) + tuple(outs[0].shape[1:]), dtype=outs[0].dtype)
        for bucket, o in zip(plan.buckets, outs):
            real = bucket.gather < T
            out[bucket.gather[real]] = o[real]
        return out
    flat = outs[0] if len(outs) == 1 else xp.concat(outs, axis=0)
    return xp.take(flat, xp.asarray(plan.scatter, device=xp_device(flat)), axis=0)


def merge_sequences(xp, plan, parts):
    """The (N, ...) per-sequence array from ``parts``: one per bucket (rows in its ``ids`` order), then
    one for the empty sequences if there are any."""
    groups = [b.ids for b in plan.buckets] + ([plan.empty] if plan.empty.size else [])
    if is_numpy_array(parts[0]):
        out = np.empty((sum(g.size for g in groups),) + tuple(parts[0].shape[1:]), dtype=parts[0].dtype)
        for ids, part in zip(groups, parts):
            out[ids] = part
        return out
    out = parts[0] if len(parts) == 1 else xp.concat(parts, axis=0)
    if plan.state_rows is None:
        return out
    return xp.take(out, xp.asarray(plan.state_rows, device=xp_device(out)), axis=0)
