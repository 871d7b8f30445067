"""``Rope``: a prepared rotation for the hot loop (a decode step), the way HF/vLLM users hold a module.

``rope = Rope(spec, backend="numba", dtype=np.float32)`` does once what ``apply_qk`` does per call:
it resolves the backend and holds the spec's cos/sin table (grown when a larger position comes, or
made for ``max_positions`` up front; far from 0, a cached window of it, so decoding past the dense
table stays on the prepared path); the first call with a new geometry (shapes, strides, seq_axis,
in place or not) is validated by the full frontend, and later calls with the same geometry reuse
the backend's prepared rotation (the ``prepare_rotation`` capability of :mod:`rotary.backends`: Numba
keeps the kernel's geometry array, CuPy the launch arguments), so a call only reads positions,
allocates outputs and launches. The positions go to the backend as they are (with the table's start
as a shift): it checks them against the table and writes nothing when one falls outside
(``OUTSIDE_TABLE``); Rope then grows the table and runs again. Anything else (array types other than
NumPy/CuPy, non-contiguous arrays, multi-axis or length-dependent specs, a backend without the
capability) takes the general path of :func:`rotary.apply_qk`, with the same results.

On CuPy, device (CuPy) int64 positions are used as table rows without a host round trip and are
*not* range-checked: pass ``max_positions`` and keep positions in ``[0, max_positions)``.
"""

from __future__ import annotations

import weakref

import numpy as np

from .. import backends as _backends
from ..backends import OUTSIDE_TABLE
from ..spec import tables as _tables
from ..spec.rope_spec import RopeSpec
from .normalize import canonical_view, overlaps, packed_positions, pick_backend, prepared_rows
from .rotate import rotate_arrays

_FLOAT_DTYPES = ("float16", "float32", "float64")


class Rope:
    """A prepared RoPE: ``rope(q, k, positions)`` and ``rope.apply(x, positions)``.

    Parameters
    ----------
    spec : RopeSpec
    backend : {"numba", "numpy", "cupy", "auto"}
    dtype : float16, float32 or float64
        The dtype of the arrays the fast path is prepared for (others take the general path).
    max_positions : int, optional
        Build the cos/sin table for positions ``0 .. max_positions-1`` now (else it grows on demand).

    Notes
    -----
    Calls take the keywords of :func:`rotary.apply_qk` (seq_axis, inverse, out, cu_seqlens,
    seqlen_offsets) and give the same results.
    """

    def __init__(self, spec, backend="numba", dtype=np.float32, max_positions=None):
        if not isinstance(spec, RopeSpec):
            raise TypeError(f"spec must be a rotary.RopeSpec, got {type(spec).__name__}")
        try:
            dt = np.dtype(dtype)
        except TypeError:
            raise TypeError(f"dtype must be float16, float32 or float64, got {dtype!r}") from None
        if dt.name not in _FLOAT_DTYPES:
            raise TypeError(f"dtype must be float16, float32 or float64, got {dt}")
        if not isinstance(backend, str):
            raise TypeError(f"backend must be a string, got {type(backend).__name__}")
        if max_positions is not None:
            if isinstance(max_positions, bool) or not isinstance(max_positions, (int, np.integer)):
                raise TypeError(f"max_positions must be an int or None, got {type(max_positions).__name__}")
            if max_positions <= 0:
                raise ValueError(f"max_positions must be > 0, got {max_positions}")
        self.spec, self.backend, self.dtype, self.max_positions = spec, backend, dt, max_positions
        self._module = None if backend == "auto" else _backends.get(backend)
        self._work = np.dtype(np.float64 if dt == np.float64 else np.float32)
        self._fast_ok = not spec.depends_on_seq_len and not spec.multi_axis and not spec.float_positions
        self._rotary_dim = spec.rotary_dim
        self._plans: dict = {}
        self._table = None   # a _HeldTable: host rows 0.. hold positions base..end-1
        self._apart = None   # weak references to the arrays of the last call whose outs were checked apart
        if max_positions is not None and self._fast_ok:
            self._grow(0, int(max_positions) - 1)

    def __repr__(self):
        return f"Rope({self.spec!r}, backend={self.backend!r}, dtype={self.dtype.name}, max_positions={self.max_positions})"

    # -- public calls --------------------------------------------------------------------------------
    def __call__(self, q, k, positions=None, *, seq_axis=-2, inverse=False, out=None, cu_seqlens=None,
                 seqlen_offsets=None):
        """Rotate q and k (one pass); as :func:`rotary.apply_qk`. Returns ``(q_rot, k_rot)``."""
        if out is None:
            outs = (None, None)
        elif isinstance(out, (tuple, list)) and len(out) == 2:
            outs = tuple(out)
        else:
            raise TypeError("out must be None or a pair (q_out, k_out)")
        if cu_seqlens is not None or seqlen_offsets is not None:
            positions, _ = packed_positions(q, seq_axis, positions, cu_seqlens, seqlen_offsets, "q", self.spec)
        return tuple(self._rotate((q, k), outs, ("q", "k"), positions, seq_axis, inverse))

    def apply(self, x, positions=None, *, seq_axis=-2, inverse=False, out=None, cu_seqlens=None, seqlen_offsets=None):
        """Rotate one array; as :func:`rotary.apply`."""
        if cu_seqlens is not None or seqlen_offsets is not None:
            positions, _ = packed_positions(x, seq_axis, positions, cu_seqlens, seqlen_offsets, "x", self.spec)
        return self._rotate((x,), (out,), ("x",), positions, seq_axis, inverse)[0]

    # -- the prepared path -----------------------------------------------------------------------------
    def _rotate(self, xs, outs, names, positions, seq_axis, inverse):
        plan = None
        if self._fast_ok:
            key = self._key(xs, outs, seq_axis, inverse)
            if key is not None:
                plan = self._plans.get(key)
                if plan is not None:   # the prepared path (_run_grown when a position lies past the table)
                    given = prepared_rows(positions, *plan.rows_args)
                    if given is not None:
                        result = plan.prepared.run(xs, outs, given[0], given[1], self._table)
                        if result is OUTSIDE_TABLE:
                            result = self._run_grown(plan, xs, outs, *given)
                        if result is not None:
                            return result
        result = rotate_arrays(list(xs), list(outs), list(names), positions, spec=self.spec, seq_axis=seq_axis,
                               inverse=inverse, backend=self.backend, spec_kwargs={})
        if self._fast_ok and key is not None and plan is None:   # validated: prepare this geometry
            plan = self._prepare(xs, outs, seq_axis, inverse)
            if plan is not None:
                if len(self._plans) >= 64:
                    self._plans.clear()
                self._plans[key] = plan
        return result

    def _key(self, xs, outs, seq_axis, inverse):
        """Geometry key of a call the fast path can take, else None."""
        if type(seq_axis) is not int or type(inverse) is not bool:
            return None
        key = [seq_axis, inverse]
        dtype = self.dtype
        separate = False
        for x, o in zip(xs, outs):
            t = type(x)
            if not (t is np.ndarray or t.__module__.startswith("cupy")) or x.dtype != dtype:
                return None
            flags = x.flags
            if not flags.c_contiguous or t is np.ndarray and not flags.aligned:   # what prepared rotations take
                return None
            if o is x:
                key.append((t, x.shape, 1))
            elif o is None:
                key.append((t, x.shape, 0))
            elif _fresh_like(o, x):   # a separate out= buffer: the geometry of a new output
                key.append((t, x.shape, 0))
                separate = True
            else:
                return None   # the general path says what is wrong with it
        if len(xs) == 2 and (outs[0] is None) != (outs[1] is None):
            return None
        if separate and not self._outs_apart(xs, outs):
            return None
        return tuple(key)

    def _outs_apart(self, xs, outs) -> bool:
        """True when every separate out shares no memory with an input or another out. The arrays of the
        last call that passed are remembered (weakly): a decode loop that passes the same buffers every
        step checks them once (the memory of a live NumPy/CuPy array never moves)."""
        arrays = (*xs, *outs)
        last = self._apart
        if last is not None and len(last) == len(arrays):
            for ref, a in zip(last, arrays):
                if ref() is not a:
                    break
            else:
                return True
        for i, (x, o) in enumerate(zip(xs, outs)):
            if o is None or o is x:
                continue
            if any(a is o or overlaps(o, a) for a in xs):
                return False
            if any(b is not None and (b is o or overlaps(o, b)) for j, b in enumerate(outs) if j != i):
                return False
        try:
            self._apart = tuple(weakref.ref(a) for a in arrays)
        except TypeError:   # an array type without weak references: checked every call
            self._apart = None
        return True

    def _grow(self, lo, hi):
        """Hold a host table covering positions lo..hi: the shared dense table near 0, else a cached
        window (see ``spec.tables``). False when no table row range can (then the general path runs)."""
        cos, sin, rows = _tables.lookup(self.spec, np.array([lo, hi], dtype=np.int64), dtype=self._work)
        base = lo - int(rows[0])
        if int(rows[1]) != hi - base:   # a compact table: rows are not positions - base
            return False
        self._table = _HeldTable(base, base + cos.shape[0], cos, sin)
        return True

    def _cover(self, rows, start):
        """Hold a table covering this call's positions (see ``_grow``); False: the general path must take it.
        Device rows index the table as they are: it must start at 0 (``max_positions`` rows, or the least)."""
        if type(rows) is not np.ndarray:
            return self._table[0] == 0 or self._grow(0, (self.max_positions or _tables._MIN_ROWS) - 1)
        if rows.size == 0:
            return True
        lo, hi = int(rows.min()) + start, int(rows.max()) + start
        table = self._table
        if table is not None and table[0] <= lo and hi < table[1]:
            return True
        return lo >= 0 and self._grow(lo, hi)

    def _prepare(self, xs, outs, seq_axis, inverse, module=None, hooks=None):
        """The plan of this geometry: the backend's prepared rotation, or None (no ``prepare_rotation``
        capability, or views it cannot take). ``module``/``hooks`` prepare another backend's path for these
        arrays (tests and benchmarks: the CUDA launch path through the host shim, a mocked launch)."""
        module = module or self._module or pick_backend(list(xs), "auto", capability=None)
        prepare = getattr(module, "prepare_rotation", None)
        if prepare is None or self._table is None and not self._grow(0, 255):
            return None
        x0 = xs[0]
        ax = seq_axis % x0.ndim
        views = [canonical_view(x, ax) for x in xs]
        if any(v is None for v in views):
            return None
        offset = self.spec.rotary_offset
        empty = hooks["empty"] if hooks else module.empty

        def fresh_view(x):
            """The canonical view of a new output like the one a call allocates for x (its shape: a BHSD
            output is a transposed view, whose strides the geometry must have), from the offset on."""
            return canonical_view(empty(tuple(x.shape), x.dtype), ax)

        out_views = [v if o is x else fresh_view(x) for x, o, v in zip(xs, outs, views)]
        if offset:   # the kernels rotate the heads from the offset on (as the frontend does)
            views, out_views = [v[..., offset:] for v in views], [v[..., offset:] for v in out_views]
        out_views = [v if o is x else ov for x, v, o, ov in zip(xs, views, outs, out_views)]
        prepared = prepare(views, out_views, seq_len=x0.shape[ax], rotary_dim=self._rotary_dim,
                           layout=self.spec.layout, inverse=inverse, offset=offset, dtype=self.dtype,
                           table=self._table, **({"hooks": hooks} if hooks else {}))
        if prepared is None:
            return None
        B = views[0].shape[0]
        lead0 = x0.shape[0] if ax > 0 else 1
        return _Plan(prepared, seq_len=x0.shape[ax], lead0=lead0, batch_rep=B // max(1, lead0) if ax > 0 else B)

    def _prepare_device_path(self, xs, outs=None, seq_axis=-2, inverse=False, *, backend, **hooks):
        """Prepare (and keep) ``backend``'s prepared path (a backend module, e.g. the CuPy one with the host
        shim's hooks) for this geometry (tests, benchmarks)."""
        outs = outs or (None,) * len(xs)
        key = self._key(xs, outs, seq_axis, inverse)
        if self._table is None:
            self._grow(0, 255)
        plan = self._prepare(xs, outs, seq_axis, inverse, module=backend, hooks=hooks)
        self._plans[key] = plan
        return plan

    def _run_grown(self, plan, xs, outs, rows, start):
        """A prepared call whose positions fell outside the held table (nothing was written): grow the table
        and run again; None when the general path must take it."""
        if not self._cover(rows, start):
            return None
        result = plan.prepared.run(xs, outs, rows, start, self._table)
        return None if result is OUTSIDE_TABLE else result


def _fresh_like(out, x) -> bool:
    """True when ``out`` can stand where a new output of x would: x's type, shape and dtype, C-contiguous,
    aligned, writable (the prepared path writes it as it writes a new output)."""
    if type(out) is not type(x) or out.shape != x.shape or out.dtype != x.dtype:
        return False
    flags = out.flags
    if type(out) is np.ndarray:
        return flags.c_contiguous and flags.aligned and flags.writeable
    return flags.c_contiguous and getattr(flags, "writeable", True)


class _HeldTable(tuple):
    """``(base, end, cos, sin, on_device)``: host cos/sin rows 0.. for positions base..end-1, and
    ``on_device(to_device)`` -> (cos, sin) moved by ``to_device`` (once per table and device)."""

    def __new__(cls, base, end, cos, sin):
        moved = {}

        def on_device(to_device):
            pair = moved.get(to_device)
            if pair is None:
                pair = moved[to_device] = (to_device(cos), to_device(sin))
            return pair

        return super().__new__(cls, (base, end, cos, sin, on_device))


class _Plan:
    """One geometry's prepared rotation and what its positions are parsed against (see :class:`Rope`)."""

    __slots__ = ("prepared", "seq_len", "lead0", "batch_rep", "default_rows", "device_rows", "rows_args")

    def __init__(self, prepared, *, seq_len, lead0, batch_rep):
        self.prepared, self.seq_len, self.lead0, self.batch_rep = prepared, seq_len, lead0, batch_rep
        self.default_rows = np.arange(seq_len, dtype=np.int64).reshape(1, seq_len)
        self.default_rows.flags.writeable = False
        self.device_rows = getattr(prepared, "device_rows", False)   # rows may be device arrays
        self.rows_args = (seq_len, lead0, batch_rep, self.default_rows, self.device_rows)   # prepared_rows
