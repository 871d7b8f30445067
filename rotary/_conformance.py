"""The cross-backend conformance cases, shared by the pytest suite and ``python -m rotary conformance``.

Each :class:`Case` describes one call of ``apply``/``apply_qk`` (shape, axes, spec, positions,
dtype, inverse, in place, strided input). :func:`run_case` makes seeded inputs, runs the call on
a backend and compares with the float64 complex-multiplication oracle of ``rotary.testing``
(computed from the spec's frequencies, independently of tables, views and backends).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from . import _scaling
from ._spec import RopeSpec
from .testing import rope_complex, tolerance

#: Scaling rules exercised by the suite (only those this build knows are used).
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "ntk": {"rope_type": "ntk", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32},
    "longrope": {"rope_type": "longrope", "factor": 4.0, "original_max_position_embeddings": 16,
                 "short_factor": [1.0 + 0.05 * i for i in range(8)],
                 "long_factor": [1.0 + 0.5 * i for i in range(8)]},
}


@dataclasses.dataclass(frozen=True)
class Case:
    """One conformance call. ``k_heads`` set -> apply_qk with a k of that many heads (axis -2 of BSHD)."""

    name: str
    shape: tuple
    seq_axis: int = -2
    layout: str = "half"
    rotary_dim: int | None = None
    base: float = 10000.0
    scaling: str | None = None
    positions: str = "none"       # none | offset | tokens | batch | huge | shuffled
    dtype: str = "float32"
    inverse: bool = False
    k_heads: int | None = None
    inplace: bool = False
    strided: bool = False

    def spec(self) -> RopeSpec:
        scaling = SCALINGS[self.scaling] if self.scaling else None
        mpe = 64 if self.scaling else None
        return RopeSpec(self.shape[-1], rotary_dim=self.rotary_dim, base=self.base, layout=self.layout,
                        scaling=scaling, max_position_embeddings=mpe)


def cases(quick: bool = False) -> list[Case]:
    """Every case (``quick``: a representative subset that runs in about a second)."""
    out = []
    for layout in ("half", "interleaved"):
        L = layout[:4]
        out += [
            Case(f"{L}-basic", (2, 9, 16), layout=layout),
            Case(f"{L}-bshd-gqa", (2, 7, 4, 16), seq_axis=-3, layout=layout, k_heads=2, positions="batch"),
            Case(f"{L}-bhsd-batchpos", (3, 2, 6, 16), seq_axis=-2, layout=layout, positions="batch"),
            Case(f"{L}-partial", (2, 5, 3, 20), seq_axis=-3, layout=layout, rotary_dim=12, k_heads=1),
            Case(f"{L}-odd-dim", (4, 17), layout=layout, positions="offset"),
            Case(f"{L}-d80", (3, 5, 80), layout=layout, positions="tokens"),
            Case(f"{L}-inverse", (2, 6, 2, 16), seq_axis=-3, layout=layout, inverse=True, k_heads=2),
            Case(f"{L}-huge-pos", (2, 5, 32), layout=layout, positions="huge"),
            Case(f"{L}-strided", (2, 6, 3, 16), seq_axis=-3, layout=layout, strided=True, k_heads=3),
            Case(f"{L}-inplace", (2, 6, 4, 16), seq_axis=-3, layout=layout, inplace=True, k_heads=2),
            Case(f"{L}-fp64", (2, 9, 3, 24), seq_axis=-3, layout=layout, dtype="float64", k_heads=1),
            Case(f"{L}-fp16", (2, 9, 3, 24), seq_axis=-3, layout=layout, dtype="float16", k_heads=3),
            Case(f"{L}-shuffled-pos", (1, 12, 2, 16), seq_axis=-3, layout=layout, positions="shuffled"),
            Case(f"{L}-seq-axis-0", (11, 3, 16), seq_axis=0, layout=layout, positions="offset"),
        ]
    for name in SCALINGS:
        out.append(Case(f"scaling-{name}", (2, 40, 2, 16), seq_axis=-3, scaling=name, positions="batch", k_heads=1))
        out.append(Case(f"scaling-{name}-interleaved-partial", (2, 70, 18), layout="interleaved", rotary_dim=16,
                        scaling=name, positions="offset"))
    known = set(_scaling.ROPE_TYPES)
    out = [c for c in out if c.scaling is None or SCALINGS[c.scaling]["rope_type"] in known]
    if quick:
        keep = ("basic", "bshd-gqa", "partial", "odd-dim", "inplace", "fp16", "huge-pos", "strided")
        out = [c for c in out if c.name.split("-", 1)[1] in keep] + [c for c in out if c.name == "scaling-yarn"]
    return out


def make_inputs(case: Case, seed: int = 0):
    """Seeded host inputs: (x, k or None, positions argument)."""
    rng = np.random.default_rng(seed)
    shape = case.shape
    ax = case.seq_axis % len(shape)
    seq = shape[ax]
    dtype = np.dtype(case.dtype)

    def data(shp):
        if case.strided:   # a non-contiguous view: every other element of a wider last axis, reversed seq
            full = rng.standard_normal(shp[:-1] + (2 * shp[-1],)).astype(dtype)
            return np.flip(full[..., ::2], axis=ax)
        return rng.standard_normal(shp).astype(dtype)

    x = data(shape)
    k = None
    if case.k_heads is not None:
        kshape = list(shape)
        kshape[-2] = case.k_heads
        k = data(tuple(kshape))
    if case.positions == "none":
        pos = None
    elif case.positions == "offset":
        pos = 37
    elif case.positions == "tokens":
        pos = np.arange(seq, dtype=np.int64) * 3 + 5
    elif case.positions == "batch":
        pos = rng.integers(0, 90, size=(shape[0], seq), dtype=np.int64)
    elif case.positions == "huge":
        pos = np.int64(2**31 - 1) - np.arange(seq, dtype=np.int64)[::-1] * 1000
    elif case.positions == "shuffled":
        pos = rng.permutation(seq).astype(np.int64) + 1000
    else:
        raise ValueError(case.positions)
    return x, k, pos


def expected(case: Case, x, pos):
    """float64 oracle for one input array (its own head count)."""
    spec = case.spec()
    ax = case.seq_axis % x.ndim
    seq = x.shape[ax]
    if pos is None:
        p = np.arange(seq)
    elif np.ndim(pos) == 0:
        p = np.arange(seq) + int(pos)
    else:
        p = np.asarray(pos)
    seq_len = int(p.max()) + 1
    inv_freq = spec.inv_freq(seq_len)
    scale = spec.attention_scaling_at(seq_len)
    xs = np.moveaxis(np.asarray(x, dtype=np.float64), ax, -2)      # (..., seq, d)
    if p.ndim == 2:   # (batch, seq): batch is axis 0, broadcast over the middle axes
        p = p.reshape((p.shape[0],) + (1,) * (xs.ndim - 3) + (p.shape[1],))
    y = rope_complex(xs, p, -inv_freq if case.inverse else inv_freq, layout=spec.layout, scale=scale)
    return np.moveaxis(y, -2, ax)


@dataclasses.dataclass
class Result:
    case: str
    backend: str
    max_error: float
    tolerance: float
    passed: bool
    seconds: float
    detail: str = ""


def run_case(case: Case, backend: str, *, to_backend=None, to_host=None, seed: int = 0) -> Result:
    """Run ``case`` on ``backend`` (inputs moved with ``to_backend``, results back with ``to_host``)."""
    from . import _api

    to_backend = to_backend or (lambda a: a)
    to_host = to_host or (lambda a: _api.to_numpy(a))
    x, k, pos = make_inputs(case, seed)
    refs = [expected(case, x, pos)] + ([expected(case, k, pos)] if k is not None else [])
    xs = [to_backend(x)] + ([to_backend(k)] if k is not None else [])
    originals = [to_host(a).copy() for a in xs]
    pos_arg = to_backend(pos) if isinstance(pos, np.ndarray) else pos
    kwargs = dict(spec=case.spec(), seq_axis=case.seq_axis, inverse=case.inverse, backend=backend)
    t0 = time.perf_counter()
    try:
        if k is None:
            outs = [_api.apply(xs[0], pos_arg, out=xs[0] if case.inplace else None, **kwargs)]
        else:
            outs = list(_api.apply_qk(xs[0], xs[1], pos_arg, out=tuple(xs) if case.inplace else None, **kwargs))
    except Exception as exc:  # reported as a failure, not raised, so the runner can print a table
        return Result(case.name, backend, float("nan"), 0.0, False, 0.0, f"{type(exc).__name__}: {exc}")
    seconds = time.perf_counter() - t0
    rtol, atol = tolerance(case.dtype)
    worst, ok, detail = 0.0, True, ""
    for a, out, ref, orig in zip(xs, outs, refs, originals):
        if type(out) is not type(a) or out.dtype != a.dtype or tuple(out.shape) != tuple(a.shape):
            return Result(case.name, backend, float("nan"), atol, False, seconds,
                          f"returned {type(out).__name__} {out.dtype} {tuple(out.shape)}")
        host = to_host(out).astype(np.float64)
        err = np.abs(host - ref)
        worst = max(worst, float(err.max()))
        ok &= bool(np.all(err <= atol + rtol * np.abs(ref)))
        if case.inplace:
            ok &= out is a
        elif not np.array_equal(to_host(a), orig):
            ok, detail = False, "input was modified"
    return Result(case.name, backend, worst, atol, ok, seconds, detail)


def array_converters(backend: str):
    """(to_backend, to_host) for the array type a backend takes (CuPy arrays for "cupy")."""
    if backend == "cupy":
        import cupy

        return cupy.asarray, (lambda a: cupy.asnumpy(a) if isinstance(a, cupy.ndarray) else np.asarray(a))
    return None, None


def run(backends=None, quick: bool = False) -> list[Result]:
    """Run every case on every requested (default: every available) backend."""
    from .backends import available_backends

    avail = available_backends()
    names = [b for b, (ok, _) in avail.items() if ok] if backends is None else list(backends)
    results = []
    for name in names:
        to_backend, to_host = array_converters(name)
        for case in cases(quick):
            results.append(run_case(case, name, to_backend=to_backend, to_host=to_host))
    return results
