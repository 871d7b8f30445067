"""``Rope``: a prepared rotation for the hot loop (a decode step), the way HF/vLLM users hold a module.

``rope = Rope(spec, dtype=np.float32)`` (``backend="auto"``, as everywhere) does once what ``apply_qk`` does per call:
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

import numpy as np

from .. import backends as _backends
from ..backends import OUTSIDE_TABLE
from ..spec import tables as _tables
from ..spec.rope_spec import RopeSpec
from .axes import layout_seq_axis, take_tensor_layout
from .buffers import CheckedBuffers, check_memory
from .plan import build_plan, plan_key
from .positions import packed_positions
from .rotate import rotate_arrays

_FLOAT_DTYPES = ("float16", "float32", "float64")


class Rope:
    """A prepared RoPE: ``rope(q, k, positions)`` and ``rope.apply(x, positions)``.

    Parameters
    ----------
    spec : RopeSpec
    backend : {"auto", "numba", "numpy", "cupy"}
        "auto" (default), as everywhere: CuPy for CuPy arrays, Numba for NumPy arrays when numba is
        installed, else the NumPy reference.
    dtype : float16, float32 or float64
        The dtype of the arrays the fast path is prepared for (others take the general path).
    max_positions : int, optional
        Build the cos/sin table for positions ``0 .. max_positions-1`` now (else it grows on demand).
    seq_axis, layout : int / str, optional
        The sequence axis of the arrays this Rope rotates, held once (``layout="bshd"``, ``"bhsd"``, ``"thd"``,
        ... or ``seq_axis=1``); a call's own ``seq_axis=`` overrides it. Inputs of 3 or more dimensions need
        one or the other.

    Notes
    -----
    Calls take the keywords of :func:`rotary.apply_qk` (seq_axis, inverse, out, cu_seqlens,
    seqlen_offsets, out_pairs) and give the same results.
    """

    def __init__(self, spec, backend="auto", dtype=np.float32, max_positions=None, *, seq_axis=None, layout=None):
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
        if layout is not None and not isinstance(layout, str):
            raise TypeError(f"layout must be a string such as 'bshd', got {type(layout).__name__}")
        if layout is not None:
            layout_seq_axis(layout, len(layout), "the inputs")   # a valid tensor layout
        self.seq_axis = seq_axis if layout is None else (layout if seq_axis is None else (layout, seq_axis))
        self.spec, self.backend, self.dtype, self.max_positions = spec, backend, dt, max_positions
        self._module = None if backend == "auto" else _backends.get(backend)
        self._work = np.dtype(np.float64 if dt == np.float64 else np.float32)
        self._fast_ok = not spec.depends_on_seq_len and not spec.multi_axis and not spec.float_positions
        self._plans: dict = {}
        self._checked = None   # CheckedBuffers of the last prepared call's arrays (the memory rules held for them)
        self._table = None   # a _HeldTable: host rows 0.. hold positions base..end-1
        if max_positions is not None and self._fast_ok:
            self._grow(0, int(max_positions) - 1)

    def __repr__(self):
        axis = "" if self.seq_axis is None else f", seq_axis={self.seq_axis!r}"
        return (f"Rope({self.spec!r}, backend={self.backend!r}, dtype={self.dtype.name}, "
                f"max_positions={self.max_positions}{axis})")

    # -- public calls --------------------------------------------------------------------------------
    def __call__(self, q, k, positions=None, *, seq_axis=None, inverse=False, out=None, cu_seqlens=None,
                 seqlen_offsets=None, layout=None, out_pairs=None):
        """Rotate q and k (one pass); as :func:`rotary.apply_qk`. Returns ``(q_rot, k_rot)``."""
        if layout is not None:
            seq_axis = self._axis(seq_axis, layout)
        elif seq_axis is None:
            seq_axis = self.seq_axis
        if out is None:
            outs = (None, None)
        elif isinstance(out, (tuple, list)) and len(out) == 2:
            outs = tuple(out)
        else:
            raise TypeError("out must be None or a pair (q_out, k_out)")
        if cu_seqlens is not None or seqlen_offsets is not None:
            positions, _ = packed_positions(q, seq_axis, positions, cu_seqlens, seqlen_offsets, "q", self.spec)
        return tuple(self._rotate((q, k), outs, ("q", "k"), positions, seq_axis, inverse, out_pairs))

    def apply(self, x, positions=None, *, seq_axis=None, inverse=False, out=None, cu_seqlens=None, seqlen_offsets=None,
              layout=None, out_pairs=None):
        """Rotate one array; as :func:`rotary.apply`."""
        seq_axis = self._axis(seq_axis, layout)
        if cu_seqlens is not None or seqlen_offsets is not None:
            positions, _ = packed_positions(x, seq_axis, positions, cu_seqlens, seqlen_offsets, "x", self.spec)
        return self._rotate((x,), (out,), ("x",), positions, seq_axis, inverse, out_pairs)[0]

    def _axis(self, seq_axis, layout):
        """A call's sequence axis: its own ``seq_axis`` / ``layout`` (a tensor layout), else the one held."""
        if layout is not None:
            return take_tensor_layout(seq_axis, {"layout": layout})[0]
        return self.seq_axis if seq_axis is None else seq_axis

    # -- the prepared path -----------------------------------------------------------------------------
    def _rotate(self, xs, outs, names, positions, seq_axis, inverse, out_pairs=None):
        checked, arrays, extra = self._checked, xs + outs, (seq_axis, inverse, out_pairs)
        if checked is not None and checked.same(arrays, extra):   # the last call's live arrays: its checks hold
            key, plan, ready = None, checked.value, True
        else:
            key = (plan_key(xs, outs, seq_axis, inverse, self.backend, None, device_arrays=True, out_pairs=out_pairs)
                   if self._fast_ok else None)
            plan = None if key is None else self._plans.get(key)
            # checked for this geometry: the memory rules on these arrays, then the prepared rotation
            ready = plan is not None and check_memory(xs, outs, names, plan.out_layout is not None)
            if ready:
                self._checked = CheckedBuffers.record(arrays, extra, plan)
        if ready:
            given = plan.rows(positions)
            if given is not None:
                result = plan.prepared.run(xs, outs, given[0], given[1], self._table)
                if result is OUTSIDE_TABLE:
                    result = self._run_grown(plan, xs, outs, *given)
                if result is not None:
                    return result
        result = rotate_arrays(list(xs), list(outs), list(names), positions, spec=self.spec, seq_axis=seq_axis,
                               inverse=inverse, backend=self.backend, spec_kwargs={}, out_pairs=out_pairs)
        if key is not None and plan is None and self.dtype == xs[0].dtype:   # validated: prepare this geometry
            plan = self._prepare(xs, outs, names, seq_axis, inverse, out_pairs=out_pairs)
            if plan is not None:
                if len(self._plans) >= 64:
                    self._plans.clear()
                    self._checked = None
                self._plans[key] = plan
        return result

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

    def _prepare(self, xs, outs, names, seq_axis, inverse, module=None, hooks=None, out_pairs=None):
        """The plan of this geometry (:func:`~.plan.build_plan`, the general path's checks) with the backend's
        prepared rotation reading the held table, or None (no ``prepare_rotation`` capability, or views it
        cannot take). ``module``/``hooks`` prepare another backend's path for these arrays (tests and
        benchmarks: the CUDA launch path through the host shim, a mocked launch)."""
        plan = build_plan(list(xs), list(outs), list(names), spec=self.spec, seq_axis=seq_axis, inverse=inverse,
                          backend="auto" if module is not None else self.backend, spec_kwargs={}, out_pairs=out_pairs)
        if self._table is None and not self._grow(0, 255):
            return None
        return plan if plan.prepare(xs, outs, self._table, module=module, hooks=hooks) else None

    def _prepare_device_path(self, xs, outs=None, seq_axis=None, inverse=False, *, backend, out_pairs=None, **hooks):
        """Prepare (and keep) ``backend``'s prepared path (a backend module, e.g. the CuPy one with the host
        shim's hooks) for this geometry (tests, benchmarks)."""
        outs = outs or (None,) * len(xs)
        names = ("x",) if len(xs) == 1 else ("q", "k")
        key = plan_key(xs, outs, seq_axis, inverse, self.backend, None, device_arrays=True, out_pairs=out_pairs)
        plan = self._prepare(xs, outs, names, seq_axis, inverse, module=backend, hooks=hooks, out_pairs=out_pairs)
        self._plans[key] = plan
        return plan

    def _run_grown(self, plan, xs, outs, rows, start):
        """A prepared call whose positions fell outside the held table (nothing was written): grow the table
        and run again; None when the general path must take it."""
        if not self._cover(rows, start):
            return None
        result = plan.prepared.run(xs, outs, rows, start, self._table)
        return None if result is OUTSIDE_TABLE else result


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
