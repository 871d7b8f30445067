"""``apply`` and ``apply_qk``: rotate arrays through a backend and return the caller's array type.

``rotate_arrays`` is their shared body: :mod:`rotary.frontend.normalize` turns the inputs into
canonical ``(B, S, H, D)`` views and int64 positions, :mod:`rotary.spec.tables` gives the cos/sin
rows, and the backend's ``rotate`` primitive (contract in :mod:`rotary.backends`) does the work.
"""

from __future__ import annotations

import numpy as np
from array_api_compat import device as xp_device, is_cupy_array, is_numpy_array

from .. import backends as _backends
from ..spec import tables as _tables
from . import dispatch as _adapters
from .normalize import (canonical_axes, canonical_layout, canonical_shape, canonical_view, check_cross_overlap,
                        check_float, check_out, from_canonical, namespace, normalize_positions, normalize_seq_axis,
                        packed_positions, pick_backend, prepared_rows, resolve_spec, same_view, table_converter,
                        to_canonical)

# -- rotation ------------------------------------------------------------------------------------
@_adapters.dispatch("rotate", 1)   # torch, JAX, Dask arrays: rotary/_torch.py, _jax.py, _dask.py
def rotate_arrays(xs, outs, names, positions, *, spec, seq_axis, inverse, backend, spec_kwargs, tables=None):
    """Shared body of apply/apply_qk: rotate each x of ``xs`` (same batch/seq/head_dim).

    ``tables(spec, pos, dtype, device_key, convert) -> (cos, sin, rows)`` replaces the table lookup of the
    normalized positions ``pos`` (rerotate gives table rows of angle differences)."""
    key = None
    if tables is None and type(xs[0]) is np.ndarray:   # plain NumPy: a geometry validated before runs its plan
        key = _plan_key(xs, outs, spec, seq_axis, inverse, backend, spec_kwargs)
        if key is not None:
            plan = _plans.get(key)
            if plan is not None:
                result = plan.run(xs, outs, positions)
                if result is not None:
                    return result
                key = None   # the general path takes this call (and says what is wrong, if anything)
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
    if key is not None:
        _remember(key, _Plan.make(xs, outs, ax, spec, inverse, module, device_key, convert, works, offset))
    return outputs


# -- plans of plain NumPy calls ----------------------------------------------------------------------
#: validated geometries of plain NumPy calls (see :class:`_Plan`), by :func:`_plan_key`
_plans: dict = {}
_PLANS_MAX = 64


def _plan_key(xs, outs, spec, seq_axis, inverse, backend, spec_kwargs):
    """The key of a call whose validation a plan can stand for, else None: every array exactly
    ``np.ndarray`` of one dtype, outs None, the input itself or a separate array of the input's shape,
    dtype and type; seq_axis an int, inverse a bool, backend a string, hashable spec keywords. What the
    general path checks of a call depends on these (and on memory overlap, checked per call by the plan)."""
    if type(seq_axis) is not int or type(inverse) is not bool or type(backend) is not str:
        return None
    dtype = xs[0].dtype
    parts = []
    for x, o in zip(xs, outs):
        if type(x) is not np.ndarray or x.dtype is not dtype or not x.flags.aligned:   # (prepared rotations)
            return None
        if o is None:
            parts.append((x.shape, x.strides, 0))
        elif o is x:
            parts.append((x.shape, x.strides, 1))
        else:
            parts.append((x.shape, x.strides, o.strides if type(o) is np.ndarray else None))
    key = (dtype, seq_axis, inverse, backend, None if spec is None else id(spec), *parts)
    if spec_kwargs:
        key += tuple(spec_kwargs.items())
        try:
            hash(key)
        except TypeError:
            return None
    return key


def _remember(key, plan):
    if plan is None:
        return
    if len(_plans) >= _PLANS_MAX:
        _plans.clear()
    _plans[key] = plan


class _Plan:
    """What the general path proved of a plain NumPy call's geometry (shapes, strides, dtype, seq_axis,
    spec, backend): the canonical shape, the backend module and its table converter. A call with the same
    key only parses its positions (:func:`prepared_rows`), checks separate outs (writable, sharing no
    memory with another array of the call), looks up the tables (the table cache as on the general path)
    and calls the backend's ``rotate``. Made only for C-contiguous inputs whose canonical view is a
    reshape (no transposition), without a rotary offset, of a 1-D spec with integer positions."""

    __slots__ = ("spec", "module", "name", "device_key", "convert", "work", "cshape", "seq_len", "lead0",
                 "batch_rep", "default_rows", "geometry", "separate", "prepared", "dense_key")

    @classmethod
    def make(cls, xs, outs, ax, spec, inverse, module, device_key, convert, works, offset):
        if offset or spec.multi_axis or spec.float_positions or len(set(works)) != 1:
            return None
        x0 = xs[0]
        perm = canonical_layout(x0.ndim, ax)[2]
        if perm != tuple(range(x0.ndim)) or not all(x.flags.c_contiguous for x in xs):
            return None
        for x, o in zip(xs, outs):
            if o is not None and o is not x and not (o.flags.c_contiguous and o.shape == x.shape):
                return None
        name = getattr(module, "NAME", None)
        if name is None or _backends.loaded(name) is not module:
            return None
        plan = cls()
        plan.spec, plan.module, plan.name, plan.device_key, plan.convert = spec, module, name, device_key, convert
        plan.work = works[0]
        plan.cshape = [canonical_shape(tuple(x.shape), ax) for x in xs]
        plan.seq_len = x0.shape[ax]
        plan.lead0 = x0.shape[0] if ax > 0 else 1
        plan.batch_rep = plan.cshape[0][0] // max(1, plan.lead0) if ax > 0 else plan.cshape[0][0]
        plan.default_rows = np.arange(plan.seq_len, dtype=np.int64).reshape(1, plan.seq_len)
        plan.default_rows.flags.writeable = False
        plan.geometry = dict(rotary_dim=spec.rotary_dim, layout=spec.layout, inverse=bool(inverse))
        plan.separate = any(o is not None and o is not x for x, o in zip(xs, outs))
        plan.prepared = None
        plan.dense_key = _tables.dense_key(spec, plan.work, device_key)   # the cached table a prepared call tries
        prepare = getattr(module, "prepare_rotation", None)   # host tables: the backend's prepared rotation
        empty = getattr(module, "empty", None)
        if prepare is not None and empty is not None and type(empty((0,), x0.dtype)) is np.ndarray:
            views = [x.reshape(shape) for x, shape in zip(xs, plan.cshape)]
            out_views = [v if o is x else np.empty(x.shape, x.dtype).reshape(shape)
                         for x, o, v, shape in zip(xs, outs, views, plan.cshape)]
            plan.prepared = prepare(views, out_views, seq_len=plan.seq_len, rotary_dim=spec.rotary_dim,
                                    layout=spec.layout, inverse=bool(inverse), offset=0, dtype=x0.dtype, table=None)
        return plan

    def run(self, xs, outs, positions):
        """The outputs of this call, or None when the general path must take it."""
        if _backends.loaded(self.name) is not self.module:   # the registry changed (tests)
            return None
        if self.separate and not _outs_apart(xs, outs):
            return None
        given = prepared_rows(positions, self.seq_len, self.lead0, self.batch_rep, self.default_rows)
        if given is None:
            return None
        rows, start = given
        prepared = self.prepared
        if prepared is not None and self.dense_key is not None:   # the cached dense table, if it holds the positions
            entry = _tables.cached_dense(self.dense_key)
            if entry is not None:
                result = prepared.run(xs, outs, rows, start, (0, entry[0], entry[1], entry[2]))
                if result is not _backends.OUTSIDE_TABLE:
                    return result
        if start:
            rows = rows + np.int64(start)
        cos, sin, rows = _tables.lookup(self.spec, rows, dtype=self.work, device_key=self.device_key,
                                        convert=self.convert)
        if prepared is not None and cos.flags.c_contiguous and sin.flags.c_contiguous and rows.flags.c_contiguous:
            result = prepared.run(xs, outs, rows, 0, (0, cos.shape[0], _readonly(cos), _readonly(sin)))
            return None if result is _backends.OUTSIDE_TABLE else result
        items = []
        for x, o, shape in zip(xs, outs, self.cshape):
            xv = x.reshape(shape)
            items.append((xv, None if o is None else xv if o is x else o.reshape(shape)))
        results = self.module.rotate(items, cos, sin, rows, **self.geometry)
        return [res.reshape(x.shape) if o is None else o for x, o, res in zip(xs, outs, results)]


def _readonly(a):
    """a, or a read-only view of it (the backend's kernels take read-only tables and rows)."""
    if a.flags.writeable:
        a = a.view()
        a.flags.writeable = False
    return a


def _outs_apart(xs, outs) -> bool:
    """True when each separate out is a writable aligned NumPy array of its input's shape and dtype whose memory
    bounds meet no other array of the call (else the general path's exact checks decide: in place
    through a view, disjoint slices of one buffer, errors). Its strides are part of the plan's key."""
    for i, (o, x) in enumerate(zip(outs, xs)):
        if o is None or o is x:
            continue
        if type(o) is not np.ndarray or o.shape != x.shape or o.dtype != x.dtype:
            return False
        flags = o.flags
        if not (flags.writeable and flags.aligned):   # aligned: what prepared rotations take
            return False
        for a in xs:
            if a is o or np.may_share_memory(o, a):
                return False
        for j, b in enumerate(outs):
            if j != i and b is not None and (b is o or np.may_share_memory(o, b)):
                return False
    return True


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
