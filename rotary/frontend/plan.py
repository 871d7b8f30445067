"""One plan per rotation geometry: what the general path proves of a call, built in one place and reused.

Every rotation (``apply``, ``apply_qk``, ``Rope``, ``rerotate``) runs the same three steps:

1. :func:`build_plan` makes every check that the call's *geometry key* (:func:`plan_key`: array types,
   dtypes, shapes, strides and contiguity, which inputs are rotated in place or into separate outs,
   ``seq_axis``, ``inverse``, the spec, ``backend``, ``out_pairs``) fixes: float dtypes, the sequence axis,
   matching shapes, the spec against head_dim, the output pair layout (``out_pairs``: no call in place when it
   differs from the spec's layout), the outs' type/shape/dtype/device, the backend and its tables.
2. :func:`~.buffers.check_memory` checks what can change between calls with the same key: an out's
   writeable flag and the memory the call's arrays share (out vs. its input, q's out vs. k; with a plan's
   ``out_layout``, an out that shares any memory with its input). It runs on every call, planned or not.
3. The run: positions are parsed (:func:`~.positions.prepared_rows` for the common forms, else
   :func:`~.positions.normalize_positions`), cos/sin rows looked up, and the backend rotates, through its
   prepared rotation (the ``prepare_rotation`` capability, made once per plan) or its ``rotate`` primitive
   on canonical views.

Plans are cached by their owners under the key: plain NumPy calls of ``apply``/``apply_qk`` in this
module's cache, a :class:`rotary.Rope` in its own (with the cos/sin table it holds).
"""

from __future__ import annotations

import numpy as np
from array_api_compat import device as xp_device, is_cupy_array, is_numpy_array

from .. import backends as _backends
from ..spec import tables as _tables
from ..spec.validators import check_float
from .arguments import namespace, pick_backend, resolve_spec, table_converter
from .axes import (canonical_axes, canonical_layout, canonical_shape, canonical_view, from_canonical,
                   normalize_seq_axis, to_canonical)
from .buffers import check_memory, check_out, out_names, same_view
from .positions import normalize_positions, prepared_rows

_PLANS_MAX = 64
#: the pair layouts a call may write (``out_pairs``; None: the spec's own layout)
OUT_PAIRS = ("half", "interleaved")


def _array_part(x):
    """(type, dtype, shape, strides, C-contiguous, aligned) of an array: what a plan's key holds of it."""
    t = type(x)
    flags = x.flags
    return t, x.dtype, x.shape, x.strides, flags.c_contiguous, flags.aligned if t is np.ndarray else True


def plan_key(xs, outs, seq_axis, inverse, backend, spec, spec_kwargs=None, device_arrays=False, out_pairs=None):
    """The key of a call whose checks a plan can stand for, else None: NumPy arrays (CuPy too with
    ``device_arrays``), an int ``seq_axis``, a bool ``inverse``, a string ``backend``, hashable spec keywords,
    ``out_pairs`` None or a string. Each out is None, its input itself (in place) or an array of the input's type
    (its own geometry)."""
    if (type(seq_axis) not in (int, str, tuple, type(None)) or type(inverse) is not bool or type(backend) is not str
            or type(out_pairs) not in (str, type(None))):
        return None
    key = [seq_axis, inverse, backend, id(spec), out_pairs]   # the plan holds the spec: its id is not reused while cached
    for x, o in zip(xs, outs):
        t = type(x)
        if t is not np.ndarray and not (device_arrays and t.__module__.startswith("cupy")):
            return None
        key.append(_array_part(x))
        if o is None or o is x:
            key.append(o is x)
        elif type(o) is t:
            key.append(_array_part(o))
        else:
            return None
    if spec_kwargs:
        key.extend(spec_kwargs.items())
        try:
            hash(tuple(key))
        except TypeError:
            return None
    return tuple(key)


class RotationPlan:
    """What :func:`build_plan` proved of one geometry, and how to run calls of it (see the module docstring).

    ``prepared`` is the backend's prepared rotation when :meth:`prepare` made one (None: every call takes
    :meth:`run`, the general execution on canonical views). ``out_layout``: the pair layout the outputs are
    written in when it differs from the spec's (``out_pairs``), else None."""

    __slots__ = ("xp", "names", "ax", "spec", "inverse", "module", "works", "device_key", "convert", "shapes",
                 "prepared", "rows_args", "dense_key", "out_layout")

    def current(self) -> bool:
        """Whether the backend module is still the registry's (tests replace and reset backends)."""
        name = getattr(self.module, "NAME", None)
        return name is not None and _backends.loaded(name) is self.module

    # -- the general execution -------------------------------------------------------------------------
    def positions(self, positions):
        """This call's positions as host rows ``(Bp, S[, n])``: :func:`prepared_rows` for the common forms of a
        1-D spec (None, an int offset, C-contiguous int64 (S,) / (batch, S)), else the general parse."""
        if self.rows_args is not None:
            given = prepared_rows(positions, *self.rows_args[:4])
            if given is not None:
                rows, start = given
                return rows + np.int64(start) if start else rows
        shape0 = self.shapes[0]
        ax = self.ax
        return normalize_positions(positions, shape0[:ax], shape0[ax], canonical_batch=canonical_shape(shape0, ax)[0],
                                   spec=self.spec)

    def run(self, xs, outs, positions, tables=None):
        """Rotate ``xs`` into ``outs`` (None: new arrays; ``out is x``: in place) through the backend's ``rotate``
        primitive on canonical views. ``tables(spec, pos, dtype, device_key, convert) -> (cos, sin, rows)``
        replaces the table lookup (rerotate gives rows of angle differences)."""
        xp, ax, spec, module = self.xp, self.ax, self.spec, self.module
        pos = self.positions(positions)
        x0 = xs[0]
        lookup = tables or _tables.lookup
        by_work = {w: lookup(spec, pos, dtype=w, device_key=self.device_key, convert=self.convert)
                   for w in set(self.works)}
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
        geometry = dict(rotary_dim=spec.rotary_dim, layout=spec.layout, inverse=self.inverse)
        if self.out_layout is not None:   # (a backend is asked for out_layout only by the calls that set it)
            geometry["out_layout"] = self.out_layout
        if len(by_work) == 1:
            results = module.rotate(items, *by_work[self.works[0]], **geometry)
        else:   # mixed float64 / narrower operands (apply_qk): one call each, in its own precision
            results = [module.rotate([item], *by_work[w], **geometry)[0] for item, w in zip(items, self.works)]
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

    # -- the prepared execution ------------------------------------------------------------------------
    def prepare(self, xs, outs, table, *, module=None, hooks=None) -> bool:
        """Make the backend's prepared rotation for this geometry (``module``'s, default the plan's;
        ``hooks``: a device path through the host shim, tests and benchmarks) reading ``table``
        (``(base, end, cos, sin, on_device)``). False (nothing prepared) when the backend has no
        ``prepare_rotation`` capability, the spec needs the general path (multi-axis, real-valued or
        length-dependent positions), the arrays are not C-contiguous or their views cannot be taken."""
        module = module or self.module
        prepare = getattr(module, "prepare_rotation", None)
        spec = self.spec
        if (prepare is None or spec.multi_axis or len(xs) == 2 and (outs[0] is None) != (outs[1] is None) or spec.float_positions or spec.depends_on_seq_len
                or len(set(self.works)) != 1 or not all(x.flags.c_contiguous and x.size for x in xs)
                or not all(o is None or o is x or o.flags.c_contiguous for x, o in zip(xs, outs))
                or not all(_array_part(a)[5] for a in (*xs, *outs) if a is not None)):   # aligned (NumPy)
            return False
        ax = self.ax
        views = [canonical_view(x, ax) for x in xs]
        if any(v is None for v in views):
            return False
        empty = hooks["empty"] if hooks else module.empty

        def fresh_view(x):
            """The canonical view of a new output like the one a call allocates for x (its shape: a BHSD
            output is a transposed view, whose strides the geometry must have)."""
            return canonical_view(empty(tuple(x.shape), x.dtype), ax)

        out_views = [v if o is x else fresh_view(x) for x, o, v in zip(xs, outs, views)]
        offset = spec.rotary_offset
        if offset:   # the kernels rotate the heads from the offset on (as the general path does)
            views, out_views = [v[..., offset:] for v in views], [v[..., offset:] for v in out_views]
        out_views = [v if o is x else ov for x, v, o, ov in zip(xs, views, outs, out_views)]
        x0 = xs[0]
        extra = {"hooks": hooks} if hooks else {}
        if self.out_layout is not None:
            extra["out_layout"] = self.out_layout
        prepared = prepare(views, out_views, seq_len=x0.shape[ax], rotary_dim=spec.rotary_dim, layout=spec.layout,
                           inverse=self.inverse, offset=offset, dtype=x0.dtype, table=table, **extra)
        if prepared is None:
            return False
        self.prepared = prepared
        self.rows_args = self.rows_args[:4] + (getattr(prepared, "device_rows", False),)
        return True

    def rows(self, positions):
        """``(rows, start)`` of a prepared call's positions (see :func:`prepared_rows`), or None."""
        return prepared_rows(positions, *self.rows_args)

    def run_prepared(self, xs, outs, positions):
        """A planned plain-NumPy call through the prepared rotation, reading the shared table cache (the dense
        table if it holds the positions, else a lookup); None when the general :meth:`run` must take it."""
        given = self.rows(positions)
        if given is None:
            return None
        rows, start = given
        if self.dense_key is not None:   # the cached dense table, if it holds the positions
            entry = _tables.cached_dense(self.dense_key)
            if entry is not None:
                result = self.prepared.run(xs, outs, rows, start, (0, entry[0], entry[1], entry[2]))
                if result is not _backends.OUTSIDE_TABLE:
                    return result
        if start:
            rows = rows + np.int64(start)
        cos, sin, rows = _tables.lookup(self.spec, rows, dtype=self.works[0], device_key=self.device_key,
                                        convert=self.convert)
        if not (cos.flags.c_contiguous and sin.flags.c_contiguous and rows.flags.c_contiguous):
            return None
        result = self.prepared.run(xs, outs, rows, 0, (0, cos.shape[0], _readonly(cos), _readonly(sin)))
        return None if result is _backends.OUTSIDE_TABLE else result


def build_plan(xs, outs, names, *, spec, seq_axis, inverse, backend, spec_kwargs, out_pairs=None) -> RotationPlan:
    """The checks of a rotation call that its geometry key fixes (see the module docstring), as a plan.
    Raises what the call's arguments get wrong, naming the argument."""
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
    out_layout = output_layout(out_pairs, spec)
    for x, out, name, oname in zip(xs, outs, names, out_names(names)):
        check_out(out, x, xp, name=oname, xname=name)
        if out_layout is not None and out is x:
            raise ValueError(f"{oname} is {name} itself, but out_pairs={out_pairs!r} writes the pairs to other "
                             f"coordinates than the spec's layout {spec.layout!r} reads them from: pass a separate "
                             f"buffer as {oname} (or none)")
    module = pick_backend(xs, backend)
    plan = RotationPlan()
    plan.xp, plan.names, plan.ax, plan.spec, plan.inverse, plan.module = xp, tuple(names), ax, spec, bool(inverse), module
    plan.works = [np.float64 if x.dtype == xp.float64 else np.float32 for x in xs]   # each operand its own precision
    plan.device_key, plan.convert = table_converter(module, x0, xp)
    plan.shapes = [tuple(x.shape) for x in xs]
    plan.prepared = plan.rows_args = None
    plan.out_layout = out_layout
    if not (spec.multi_axis or spec.float_positions):   # what prepared_rows parses: (seq_len, lead0, batch_rep, 0..S-1)
        seq_len, lead0 = x0.shape[ax], x0.shape[0] if ax > 0 else -1   # no batch axis: no (batch, S) form
        B = canonical_shape(plan.shapes[0], ax)[0]
        default_rows = np.arange(seq_len, dtype=np.int64).reshape(1, seq_len)
        default_rows.flags.writeable = False
        plan.rows_args = (seq_len, lead0, B // max(1, lead0) if ax > 0 else B, default_rows, False)
    plan.dense_key = _tables.dense_key(spec, plan.works[0], plan.device_key)
    return plan


# -- the plans of plain NumPy apply / apply_qk calls -------------------------------------------------------
#: plans of plain NumPy calls by :func:`plan_key`
_plans: dict = {}


def planned(xs, outs, names, *, spec, seq_axis, inverse, backend, spec_kwargs, out_pairs=None) -> RotationPlan:
    """The plan of this call: the cached one of its key (plain NumPy arrays), else a new one (cached when it
    has a key). Memory is not checked here (:func:`~.buffers.check_memory`, every call)."""
    key = (plan_key(xs, outs, seq_axis, inverse, backend, spec, spec_kwargs, out_pairs=out_pairs)
           if type(xs[0]) is np.ndarray else None)
    plan = None if key is None else _plans.get(key)
    if plan is not None and plan.current():
        return plan
    plan = build_plan(xs, outs, names, spec=spec, seq_axis=seq_axis, inverse=inverse, backend=backend,
                      spec_kwargs=spec_kwargs, out_pairs=out_pairs)
    if key is not None:
        if (not plan.spec.rotary_offset and canonical_layout(xs[0].ndim, plan.ax)[2] == tuple(range(xs[0].ndim))
                and type(plan.module.empty((0,), xs[0].dtype) if hasattr(plan.module, "empty") else None) is np.ndarray):
            plan.prepare(xs, outs, None)   # host tables: the backend's prepared rotation (read per call)
        if len(_plans) >= _PLANS_MAX:
            _plans.clear()
        _plans[key] = plan
    return plan


def output_layout(out_pairs, spec):
    """The pair layout a call with ``out_pairs`` writes when it differs from the spec's layout (pairs read in
    ``spec.layout``, written in this one: e.g. DeepSeek's interleaved q/k rotated into half-split pairs), else None
    (``out_pairs`` None or the spec's own layout). A value other than None, "half" or "interleaved" is a ValueError
    naming out_pairs."""
    if out_pairs is None:
        return None
    if not isinstance(out_pairs, str) or out_pairs not in OUT_PAIRS:
        raise ValueError(f"out_pairs must be None (the spec's layout), 'half' or 'interleaved', got {out_pairs!r}")
    return None if out_pairs == spec.layout else out_pairs


def _readonly(a):
    """a, or a read-only view of it (the backend's kernels take read-only tables and rows)."""
    if a.flags.writeable:
        a = a.view()
        a.flags.writeable = False
    return a


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


__all__ = ["OUT_PAIRS", "RotationPlan", "build_plan", "check_memory", "output_layout", "plan_key", "planned"]
