"""``apply`` and ``apply_qk``: rotate arrays through a backend and return the caller's array type.

``rotate_arrays`` is their shared body: :mod:`rotary.frontend.normalize` turns the inputs into
canonical ``(B, S, H, D)`` views and int64 positions, :mod:`rotary.spec.tables` gives the cos/sin
rows, and the backend's ``rotate`` primitive (contract in :mod:`rotary.backends`) does the work.
"""

from __future__ import annotations

import numpy as np
from array_api_compat import device as xp_device, is_cupy_array, is_numpy_array

from ..spec import tables as _tables
from . import dispatch as _adapters
from .normalize import (canonical_axes, canonical_shape, canonical_view, check_cross_overlap, check_float, check_out,
                        from_canonical, namespace, normalize_positions, normalize_seq_axis, packed_positions,
                        pick_backend, resolve_spec, same_view, table_converter, to_canonical)

# -- rotation ------------------------------------------------------------------------------------
@_adapters.dispatch("rotate", 1)   # torch, JAX, Dask arrays: rotary/_torch.py, _jax.py, _dask.py
def rotate_arrays(xs, outs, names, positions, *, spec, seq_axis, inverse, backend, spec_kwargs, tables=None):
    """Shared body of apply/apply_qk: rotate each x of ``xs`` (same batch/seq/head_dim).

    ``tables(spec, pos, dtype, device_key, convert) -> (cos, sin, rows)`` replaces the table lookup of the
    normalized positions ``pos`` (rerotate gives table rows of angle differences)."""
    xp = namespace(xs, names)
    for x, name in zip(xs, names):
        check_float(x, name, xp)
    x0 = xs[0]
    ndim = x0.ndim
    ax = normalize_seq_axis(seq_axis, ndim, names[0])
    batch_axes, _ = canonical_axes(ndim, ax)
    for x, name in zip(xs[1:], names[1:]):
        if x.ndim != ndim:
            raise ValueError(f"{name} must have the same number of dimensions as {names[0]} ({ndim}), got {x.ndim}")
        if any(x.shape[i] != x0.shape[i] for i in batch_axes + [ax, ndim - 1]):
            raise ValueError(f"{name} of shape {tuple(x.shape)} must match {names[0]} of shape {tuple(x0.shape)} "
                             f"in the batch axes {tuple(batch_axes)}, the sequence axis {ax} and head_dim "
                             "(only head axes may differ)")
    if not isinstance(inverse, (bool, np.bool_)):
        raise TypeError(f"inverse must be a bool, got {type(inverse).__name__}")
    spec = resolve_spec(spec, spec_kwargs, int(x0.shape[-1]), names[0])
    for x, out, name in zip(xs, outs, names):
        check_out(out, x, xp, name="out" if len(xs) == 1 else f"out for {name}", xname=name)
    if len(xs) == 2 and (outs[0] is not None or outs[1] is not None):
        check_cross_overlap(xs, outs, names)
    shape0 = tuple(x0.shape)
    pos = normalize_positions(positions, shape0[:ax], shape0[ax], canonical_batch=canonical_shape(shape0, ax)[0],
                              spec=spec)
    module = pick_backend(xs, backend)

    works = [np.float64 if x.dtype == xp.float64 else np.float32 for x in xs]   # each operand its own precision
    device_key, convert = table_converter(module, x0, xp)
    lookup = tables or _tables.lookup
    by_work = {w: lookup(spec, pos, dtype=w, device_key=device_key, convert=convert) for w in set(works)}

    strided = type(x0) is np.ndarray or is_numpy_array(x0) or is_cupy_array(x0)
    offset = spec.rotary_offset
    items, written, heads = [], [], []
    for x, out in zip(xs, outs):
        if strided:
            xv = canonical_view(x, ax)
            if xv is None:
                xv = to_canonical(x.copy(), ax, xp)
            ov = None if out is None else canonical_view(out, ax)
            if out is not None and ov is not None and same_view(out, x):
                ov = xv  # in place: the backend sees out is x
            done = ov is not None
            if offset:   # the backend rotates the view from the offset on; the coordinates before it are copied
                xv, ov, full = _offset_views(xv, ov, offset, xp)
                heads.append(full)
                done = full is None
            items.append((xv, ov))
            written.append(done)
        else:
            xc = to_canonical(x, ax, xp)
            heads.append(xc[..., :offset] if offset else None)
            items.append((xc[..., offset:] if offset else xc, None))
            written.append(False)
    geometry = dict(rotary_dim=spec.rotary_dim, layout=spec.layout, inverse=bool(inverse))
    if len(by_work) == 1:
        results = module.rotate(items, *by_work[works[0]], **geometry)
    else:   # mixed float64 / narrower operands (apply_qk): one call each, in its own precision
        results = [module.rotate([item], *by_work[w], **geometry)[0] for item, w in zip(items, works)]
    if offset:   # back to whole heads: the fresh output buffers, or the untouched coordinates joined on
        results = [full if strided else xp.concat([full, xp.astype(res, full.dtype, copy=False)], axis=-1)
                   for full, res in zip(heads, results)]
    outputs = []
    for x, res, out, done in zip(xs, results, outs, written):
        if done:
            outputs.append(out)
            continue
        y = from_canonical(res, tuple(x.shape), ax, xp)
        if out is not None:
            out[...] = y
            y = out
        outputs.append(y)
    return outputs


def _offset_views(xv, ov, offset, xp):
    """(x view, out view, whole-head buffer) for a spec with ``rotary_offset``: the backend rotates the
    canonical views from coordinate ``offset`` on (its usual contract: [0, rotary_dim) rotate, the rest
    passes through); coordinates [0, offset) are copied into a separate out (never touched in place).
    Without a usable out view, a fresh canonical buffer is the output (returned as the third value)."""
    full = None
    if ov is None:
        ov = full = xp.empty(tuple(xv.shape), dtype=xv.dtype, device=xp_device(xv))
    if ov is xv:
        part = xv[..., offset:]
        return part, part, full
    ov[..., :offset] = xv[..., :offset]
    return xv[..., offset:], ov[..., offset:], full


def apply(x, positions=None, *, spec=None, seq_axis=-2, inverse=False, out=None, backend="auto", cu_seqlens=None,
          seqlen_offsets=None, **spec_kwargs):
    """Rotate ``x`` (..., seq, ..., head_dim) by RoPE at ``positions``; returns x's array type and dtype.

    ``y_a = x_a cos(p w_i) - x_b sin(p w_i)``, ``y_b = x_b cos(p w_i) + x_a sin(p w_i)`` for each pair
    (a, b) of the spec's layout, ``w_i`` from ``spec.inv_freq()``; the pairs lie in coordinates
    ``[rotary_offset, rotary_offset + rotary_dim)`` and every other coordinate passes through.

    Parameters
    ----------
    x : array, real floating
        ``seq_axis`` names the sequence axis (default -2, i.e. ``(..., seq, dim)``; use -3 for BSHD).
    positions : None, int or integer array
        None -> 0..seq-1; int -> offset + 0..seq-1; shape (seq,) or (batch, seq), batch = x.shape[0].
    spec : RopeSpec, optional
        Or give ``base=``, ``layout=``, ``rotary_dim=``, ``scaling=``, ``max_position_embeddings=``,
        ``rotary_offset=``.
    inverse : bool
        Rotate by -angle (undo a rotation; the backward of RoPE).
    out : array, optional
        Where to write (same shape/dtype/type as x); may be ``x`` itself for in place.
    backend : {"auto", "numpy", "numba", "cupy"}
    cu_seqlens : integer array (N+1,), optional
        A packed batch (flash-attn's varlen/THD form): N sequences concatenated along the sequence
        axis (x of shape (total_tokens, heads, head_dim) with ``seq_axis=0``), sequence n owning tokens
        ``cu_seqlens[n]:cu_seqlens[n+1]``. Positions restart at each sequence (at
        ``seqlen_offsets[n]``, default 0); explicit per-token ``positions`` may be given instead.
        One pass over all sequences.
    seqlen_offsets : int or integer array (N,), optional
        Per-sequence position offsets with ``cu_seqlens`` (a sequence continuing a cache of L tokens
        has offset L).
    """
    positions, _ = packed_positions(x, seq_axis, positions, cu_seqlens, seqlen_offsets, spec=spec)
    return rotate_arrays([x], [out], ["x"], positions, spec=spec, seq_axis=seq_axis, inverse=inverse,
                         backend=backend, spec_kwargs=spec_kwargs)[0]


def apply_qk(q, k, positions=None, *, spec=None, seq_axis=-2, inverse=False, out=None, backend="auto",
             cu_seqlens=None, seqlen_offsets=None, **spec_kwargs):
    """Rotate q and k together (one pass / one launch); head counts may differ (GQA).

    Same arguments as :func:`apply` (``cu_seqlens``/``seqlen_offsets`` for packed q and k); ``out`` is None or a pair ``(q_out, k_out)`` (either may be None;
    ``out=(q, k)`` rotates in place). Returns ``(q_rot, k_rot)``.
    """
    if out is None:
        outs = [None, None]
    elif isinstance(out, (tuple, list)) and len(out) == 2:
        outs = list(out)
    else:
        raise TypeError("out must be None or a pair (q_out, k_out)")
    positions, _ = packed_positions(q, seq_axis, positions, cu_seqlens, seqlen_offsets, "q", spec)
    q_rot, k_rot = rotate_arrays([q, k], outs, ["q", "k"], positions, spec=spec, seq_axis=seq_axis,
                                 inverse=inverse, backend=backend, spec_kwargs=spec_kwargs)
    return q_rot, k_rot
