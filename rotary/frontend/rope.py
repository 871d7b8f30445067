"""``Rope``: a prepared rotation for the hot loop (a decode step), the way HF/vLLM users hold a module.

``rope = Rope(spec, backend="numba", dtype=np.float32)`` does once what ``apply_qk`` does per call:
it resolves the backend and holds the spec's cos/sin table (grown when a larger position comes, or
made for ``max_positions`` up front; far from 0, a cached window of it, so decoding past the dense
table stays on the prepared path); the first call with a new geometry (shapes, strides, seq_axis,
in place or not) is validated by the full frontend, and later calls with the same geometry reuse
the backend's prepared launch (Numba: the kernel's geometry array; CuPy: the launch arguments), so a
call only reads positions, allocates outputs and launches. On Numba the positions go to the kernel as
they are (with the table's start as a shift): the kernel checks them against the table and writes
nothing when one falls outside; Rope then grows the table and launches again. Anything else (array types other than
NumPy/CuPy, non-contiguous arrays, multi-axis or length-dependent specs, positions outside the table)
takes the general path of :func:`rotary.apply_qk`, with the same results.

On CuPy, device (CuPy) int64 positions are used as table rows without a host round trip and are
*not* range-checked: pass ``max_positions`` and keep positions in ``[0, max_positions)``.
"""

from __future__ import annotations

import numpy as np

from ..spec import tables as _tables
from .. import backends as _backends
from .rotate import _layout, canonical_view, packed_positions, rotate_arrays
from ..spec.rope_spec import RopeSpec

_FLOAT_DTYPES = ("float16", "float32", "float64")
_INT64_LIMIT = 2 ** 63


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
        self._half, self._rotary_dim = spec.rotary_dim // 2, spec.rotary_dim
        self._interleaved = spec.layout == "interleaved"
        self._plans: dict = {}
        self._table = None   # (base, end, cos, sin) on the host: rows 0.. hold positions base..end-1
        self._device_tables: dict = {}
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
                if plan is not None:
                    result = plan.run(self, xs, outs, positions)
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
        key = [seq_axis, inverse]
        dtype = self.dtype
        for x, o in zip(xs, outs):
            t = type(x)
            if x.dtype != dtype or not (t is np.ndarray or t.__module__.startswith("cupy")):
                return None
            if not x.flags.c_contiguous:
                return None
            if o is None:
                key.append((t, x.shape, 0))
            elif o is x:
                key.append((t, x.shape, 1))
            else:
                return None   # a separate out buffer: the general path checks overlaps
        if len(xs) == 2 and (outs[0] is None) != (outs[1] is None):
            return None
        if type(seq_axis) is not int or type(inverse) is not bool:
            return None
        return tuple(key)

    def _grow(self, lo, hi):
        """Hold a host table covering positions lo..hi: the shared dense table near 0, else a cached
        window (see ``_tables``). False when no table row range can (then the general path runs)."""
        cos, sin, rows = _tables.lookup(self.spec, np.array([lo, hi], dtype=np.int64), dtype=self._work)
        base = lo - int(rows[0])
        if int(rows[1]) != hi - base:   # a compact table: rows are not positions - base
            return False
        self._table = (base, base + cos.shape[0], cos, sin)
        self._device_tables.clear()
        return True

    def _device_table(self, to_device):
        """cos/sin of the current host table on the device (moved once per host table)."""
        table = self._device_tables.get(to_device)
        if table is None or table[0] is not self._table[2]:
            table = (self._table[2], to_device(self._table[2]), to_device(self._table[3]))
            self._device_tables[to_device] = table
        return table[1], table[2]

    def _cover(self, lo, hi):
        """Hold a table covering positions lo..hi (see ``_grow``); False: the general path must take the call."""
        table = self._table
        if table is not None and table[0] <= lo and hi < table[1]:
            return True
        return lo >= 0 and self._grow(lo, hi)

    def _rows(self, positions, plan):
        """int64 (Bp, S) table rows of this call (host positions range-checked and shifted to the held
        table; device positions as they are), or None when the general path must take it."""
        S = plan.seq_len
        if plan.device and type(positions).__module__.startswith("cupy") and positions.dtype == np.int64:
            # device positions are table rows as they are (no host round trip): the table must start at 0
            if self._table[0] != 0 and not self._grow(0, (self.max_positions or _tables._MIN_ROWS) - 1):
                return None
            return positions.reshape(1, S) if positions.shape == (S,) else (
                positions if positions.shape == (plan.lead0, S) and plan.batch_rep == 1 else None)
        given = plan._positions(positions)
        if given is None:
            return None
        rows, start = given
        if rows.size:
            if rows.size <= 64:   # decode-sized: cheaper in Python than NumPy reductions
                values = rows.ravel().tolist()
                lo, hi = min(values) + start, max(values) + start
            else:
                lo, hi = int(rows.min()) + start, int(rows.max()) + start
            if not self._cover(lo, hi):
                return None
            shift = start - self._table[0]   # a window far from 0: its row 0 holds position table[0]
            if shift:
                rows = rows + shift
        return rows

    def _prepare(self, xs, outs, seq_axis, inverse, device_hooks=None):
        """The plan of this geometry. ``device_hooks`` (address, empty, to_device, kernel or launch) prepare the
        CUDA launch path for other arrays (tests and benchmarks: the host shim, a mocked launch)."""
        module = self._module or _backends.pick(list(xs), "auto")
        name = "cupy" if device_hooks else module.NAME
        if name not in ("numba", "cupy") or self._table is None and not self._grow(0, 255):
            return None
        x0 = xs[0]
        ndim = x0.ndim
        ax = seq_axis % ndim
        batch_axes, _, _, _ = _layout(ndim, ax)
        S = x0.shape[ax]
        views = [canonical_view(x, ax) for x in xs]
        if any(v is None for v in views):
            return None
        offset = self.spec.rotary_offset
        if offset:   # the kernels rotate the heads from the offset on (as the frontend does)
            views = [v[..., offset:] for v in views]
        B = views[0].shape[0]
        lead0 = x0.shape[0] if ax > 0 else 1
        plan = _Plan(S=S, B=B, lead0=lead0, batch_rep=B // max(1, lead0) if ax > 0 else B,
                     in_place=[o is not None for o in outs], inverse=inverse, offset=offset,
                     shapes=[tuple(x.shape) for x in xs], seq_axis=ax)
        if name == "numba":
            return plan.for_numba(module, views, self)
        return plan.for_cupy(views, self, device_hooks)

    def _prepare_device_path(self, xs, outs=None, seq_axis=-2, inverse=False, **hooks):
        """Prepare (and keep) the CUDA launch path for this geometry with the given hooks (tests, benchmarks)."""
        outs = outs or (None,) * len(xs)
        key = self._key(xs, outs, seq_axis, inverse)
        if self._table is None:
            self._grow(0, 255)
        plan = self._prepare(xs, outs, seq_axis, inverse, device_hooks=hooks)
        self._plans[key] = plan
        return plan


class _Plan:
    """What a geometry needs per call (see :class:`Rope`)."""

    def __init__(self, S, B, lead0, batch_rep, in_place, inverse, offset, shapes, seq_axis):
        self.seq_len, self.B, self.lead0, self.batch_rep = S, B, lead0, batch_rep
        self.in_place, self.inverse, self.device = in_place, inverse, False
        self.offset = offset   # the spec's rotary_offset: views, buffers and pointers start there
        self.shapes, self.seq_axis = shapes, seq_axis
        self.default_rows = np.arange(S, dtype=np.int64).reshape(1, S)
        self.default_rows.flags.writeable = False

    def _fresh_output(self, empty, i, v):
        """The canonical view of a new output like the one a call allocates for input ``i`` (its shape:
        a BHSD output is a transposed view, whose strides the geometry must have), from the offset on."""
        view = canonical_view(empty(self.shapes[i], v.dtype), self.seq_axis)
        return view[..., self.offset:] if self.offset else view

    def _whole_head_copy(self, x, y):
        """Out of place with an offset: coordinates [0, offset) pass through into the new output."""
        if self.offset and y is not x:
            y[..., :self.offset] = x[..., :self.offset]

    def for_numba(self, nb, views, rope):
        group = [(v, v if ip else self._fresh_output(np.empty, i, v), None, False)
                 for i, (v, ip) in enumerate(zip(views, self.in_place))]
        self.geo = nb._group_geometry(group)
        elements = sum(v.size for v in views)
        self.kernel, self.nb = nb.rotate_kernel(elements, self.B, self.seq_len), nb
        self.consts = (self.B * self.seq_len, self.seq_len, rope._half, rope._rotary_dim, views[0].shape[3],
                       rope._interleaved, bool(self.inverse))
        self.f16 = rope.dtype == np.float16
        self.run = self._run_numba
        return self

    def _positions(self, positions):
        """(rows, start) of this call: token (b, s) is at position rows[b or 0, s] + start (read-only int64
        rows; the kernel checks that they fall in the table), or None when the general path must take it."""
        if positions is None:
            return self.default_rows, 0
        if type(positions) is int:
            return (self.default_rows, positions) if -_INT64_LIMIT <= positions < _INT64_LIMIT - self.seq_len else None
        if type(positions) is not np.ndarray or positions.dtype != np.int64:
            return None
        S = self.seq_len
        if positions.shape == (S,):
            rows = positions.reshape(1, S)
        elif positions.shape == (self.lead0, S) and self.batch_rep == 1 and positions.flags.c_contiguous:
            rows = positions.view()
        else:
            return None
        rows.flags.writeable = False   # one compiled kernel for read-only and writable positions
        return rows, 0

    def _run_numba(self, rope, xs, outs, positions):
        given = self._positions(positions)
        if given is None:
            return None
        rows, start = given
        bufs = []
        results = []
        for x, o in zip(xs, outs):
            y = x if o is not None else np.empty(x.shape, x.dtype)
            xb, yb = x.reshape(-1), y.reshape(-1)
            if self.f16:
                xb, yb = xb.view(np.uint16), yb.view(np.uint16)
            if self.offset:   # the geometry was made for views that start at element `offset` (C-contiguous x, y)
                self._whole_head_copy(x, y)
                xb, yb = xb[self.offset:], yb[self.offset:]
            xb.flags.writeable = False   # a view of its own: one compiled signature for any input
            bufs += (xb, yb)
            results.append(y)
        if len(bufs) == 2:
            bufs += bufs
        if not (bufs[0].size and self.B * self.seq_len):
            return results
        kernel = self.kernel if not self.nb._in_forked_child else self.nb.rotate_kernel(0, 0, 0)   # serial
        table = rope._table
        args = (bufs[0], bufs[1], bufs[2], bufs[3], self.geo)
        if kernel(*args, table[2], table[3], rows, start - table[0], *self.consts):
            return results
        # a position outside the table held: grow it (or the general path takes the call), then rotate
        if rows.size == 0 or not rope._cover(int(rows.min()) + start, int(rows.max()) + start):
            return None
        table = rope._table
        kernel(*args, table[2], table[3], rows, start - table[0], *self.consts)
        return results

    def for_cupy(self, views, rope, hooks=None):
        """The launch with every array slot open; the tables moved to the device once per table size, the
        compiled kernel resolved once (per device: a call on another device takes the general path).

        ``hooks`` (tests, benchmarks): ``address``, ``empty``, ``to_device`` and either ``kernel`` (called
        as a CuPy RawKernel: ``kernel(grid, block, args, shared_mem=...)``) or ``launch(plan, dtype_name)``."""
        from ..backends import cupy as cb

        if hooks:
            address, empty, to_device = hooks["address"], hooks["empty"], hooks["to_device"]
            current_device = lambda: 0   # noqa: E731
        else:
            import cupy

            address, empty, to_device = cb._address, cupy.empty, cupy.asarray
            current_device = cupy.cuda.runtime.getDevice
        self.device = True
        dtype_name = str(views[0].dtype)
        self.address, self.empty, self.to_device = address, empty, to_device
        items = [(v, v if ip else self._fresh_output(empty, i, v)) for i, (v, ip) in enumerate(zip(views, self.in_place))]
        cos, sin = rope._device_table(to_device)
        plan = cb.plan_rotate(items, cos, sin, to_device(self.default_rows), dtype_name=dtype_name,
                              rotary_dim=rope._rotary_dim, layout=rope.spec.layout, inverse=self.inverse,
                              address=address)
        if plan is None:
            return None
        if not hooks:
            self.kernel = cb.launch_kernel(plan, dtype_name)
        elif "kernel" in hooks:
            self.kernel = hooks["kernel"]
        else:
            launch = hooks["launch"]
            self.kernel = lambda grid, block, args, shared_mem=0: launch(plan._replace(args=args), dtype_name)
        self.current_device, self.device_id = current_device, current_device()
        self.grid, self.block, self.shared_mem = (plan.grid,), (plan.block,), plan.shared_mem
        self.align = [address(a) & 15 for pair in items for a in pair]   # a vector width per array
        self.slots = [i for i, a in enumerate(plan.args) if not isinstance(a, np.generic)]
        self.per_batch = (np.int32(0), np.int32(1))
        self.template = list(plan.args)
        self.run = self._run_cupy
        return self

    def _run_cupy(self, rope, xs, outs, positions):
        if self.current_device() != self.device_id:
            return None
        rows = rope._rows(positions, self)
        if rows is None:
            return None
        address = self.address
        arrays = []
        results = []
        for x, o in zip(xs, outs):
            y = x if o is not None else self.empty(x.shape, x.dtype)
            results.append(y)
            if self.offset:   # the kernel's pointers start at the offset (strides come from the plan)
                self._whole_head_copy(x, y)
                x, y = x[..., self.offset:], (x[..., self.offset:] if y is x else y[..., self.offset:])
            arrays += (x, y)
        for a, al in zip(arrays, self.align):
            if address(a) & 15 != al:   # another alignment: another vector width
                return None
        if type(rows) is np.ndarray:
            rows = self.to_device(rows)
        cos, sin = rope._device_table(self.to_device)
        if len(arrays) == 2:
            arrays += arrays
        args = self.template
        for i, a in zip(self.slots, (*arrays, cos, sin, rows)):
            args[i] = a
        args[self.slots[-1] + 1] = self.per_batch[rows.shape[0] > 1]   # rows (Bp, S): Bp > 1 or not
        launch_args = tuple(args)
        for i in self.slots:
            args[i] = None
        self.kernel(self.grid, self.block, launch_args, shared_mem=self.shared_mem)
        return results
