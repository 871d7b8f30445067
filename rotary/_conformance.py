"""The cross-backend conformance cases, shared by the pytest suite and ``python -m rotary conformance``.

Each :class:`Case` describes one call of ``apply``/``apply_qk`` (shape, axes, spec, positions,
dtype, inverse, in place, strided input). :func:`run_case` makes seeded inputs, runs the call on
a backend and compares with the float64 complex-multiplication oracle of ``rotary.testing``
(computed from the spec's frequencies, independently of tables, views and backends).

Each :class:`LinearCase` is one ``linear_attention`` computation (causal or not, chunk edges,
layouts, partial rotary, odd feature dims, feature maps, offsets, per-batch positions, prefill then
resume through the state), compared by :func:`run_linear_case` with the quadratic float64 oracle
``rotary.testing.linear_attention_quadratic``.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from . import _scaling
from ._spec import RopeSpec
from .testing import linear_attention_quadratic, rope_complex, tolerance

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


@dataclasses.dataclass(frozen=True)
class LinearCase:
    """One ``linear_attention`` computation on (B, H, T, d) inputs (BSHD when ``bshd``).

    ``split`` > 0: the first ``split`` tokens in one call (``return_state=True``), the rest in a second
    call that continues from the state; the two outputs together must equal the one-call oracle
    (non-causal: block-causal, the first call's tokens do not see the second call's).
    """

    name: str
    B: int = 2
    H: int = 3
    T: int = 20
    d: int = 8
    dv: int = 5
    causal: bool = True
    layout: str = "half"
    rotary_dim: int | None = None
    feature_map: str = "elu"
    positions: str = "none"      # none | offset | batch
    dtype: str = "float32"
    chunk: int = 8
    bshd: bool = False
    split: int = 0
    kv_heads: int = 0            # k/v heads (GQA); 0: H
    decay: float | tuple | None = None   # gamma: a scalar or one per k/v head
    normalize: bool = True

    def spec(self) -> RopeSpec:
        return RopeSpec(self.d, rotary_dim=self.rotary_dim, base=100.0, layout=self.layout)

    def groups(self) -> int:
        return self.H // (self.kv_heads or self.H)


#: Bound on max |o - o_ref| / rms(o_ref) per dtype: fp32 chunked sums and fp16 output rounding,
#: with margin; a wrong rotation, mask or denominator is off by O(1).
LINEAR_TOLERANCES = {"float64": 1e-10, "float32": 3e-5, "float16": 1e-2}


def linear_cases(quick: bool = False) -> list[LinearCase]:
    """Every linear-attention case (``quick``: one causal and one non-causal per layout, and a resume)."""
    out = []
    for causal in (True, False):
        c = "causal" if causal else "noncausal"
        out += [
            LinearCase(f"la-{c}-basic", causal=causal),
            LinearCase(f"la-{c}-interleaved", causal=causal, layout="interleaved", bshd=True),
            LinearCase(f"la-{c}-chunk-edges", causal=causal, T=17, chunk=8, positions="offset"),
            LinearCase(f"la-{c}-one-token", causal=causal, T=1),
            LinearCase(f"la-{c}-partial-odd", causal=causal, d=11, rotary_dim=6, layout="interleaved"),
            LinearCase(f"la-{c}-batch-pos", causal=causal, positions="batch", bshd=True),
            LinearCase(f"la-{c}-relu", causal=causal, feature_map="relu"),
            LinearCase(f"la-{c}-fp64", causal=causal, dtype="float64", T=33),
            LinearCase(f"la-{c}-fp16", causal=causal, dtype="float16", bshd=True),
            LinearCase(f"la-{c}-resume", causal=causal, T=21, split=13, chunk=4),
        ]
    out.append(LinearCase("la-causal-long", B=1, H=2, T=300, d=32, dv=16, chunk=64))
    out += [
        LinearCase("la-gqa", H=4, kv_heads=2, T=19, chunk=8),
        LinearCase("la-noncausal-mqa", H=3, kv_heads=1, causal=False, bshd=True),
        LinearCase("la-retention", H=4, decay=tuple(1 - 2.0 ** (-5 - np.arange(4))), normalize=False,
                   feature_map="identity", T=37, chunk=16),
        LinearCase("la-decay-gqa-resume", H=4, kv_heads=2, decay=(0.9, 1e-4), T=21, split=13, chunk=4),
        LinearCase("la-decay-near-one-fp64", decay=1 - 1e-9, dtype="float64", T=33, bshd=True),
    ]
    if quick:
        keep = {"la-causal-basic", "la-noncausal-interleaved", "la-causal-resume", "la-causal-fp16"}
        out = [c for c in out if c.name in keep]
    return out


def make_linear_inputs(case: LinearCase, seed: int = 0):
    """Seeded (q, k, v) in (B, H, T, d) order and the positions argument (None, int or (B, T))."""
    rng = np.random.default_rng(seed)
    dtype = np.dtype(case.dtype)
    hk = case.kv_heads or case.H
    q = rng.standard_normal((case.B, case.H, case.T, case.d)).astype(dtype)
    k = rng.standard_normal((case.B, hk, case.T, case.d)).astype(dtype)
    v = rng.standard_normal((case.B, hk, case.T, case.dv)).astype(dtype)
    if case.positions == "offset":
        pos = 1000
    elif case.positions == "batch":
        pos = rng.integers(0, 500, size=(case.B, case.T), dtype=np.int64)
    else:
        pos = None
    return q, k, v, pos


def run_linear_case(case: LinearCase, backend: str, *, to_backend=None, to_host=None, seed: int = 0) -> Result:
    """Run ``case`` on ``backend``; error = max |o - o_ref| / rms(o_ref) against the quadratic oracle."""
    from . import _api
    from ._linear_attention import linear_attention

    to_backend = to_backend or (lambda a: a)
    to_host = to_host or (lambda a: _api.to_numpy(a))
    q, k, v, pos = make_linear_inputs(case, seed)
    spec = case.spec()
    if pos is None:
        p = np.arange(case.T)
    elif np.ndim(pos) == 0:
        p = int(pos) + np.arange(case.T)
    else:
        p = pos[:, None, :]
    G = case.groups()
    gamma = None   # the oracle's: per q head (q head h reads k/v head h // G and its gamma)
    if case.decay is not None:
        gamma = np.repeat(np.broadcast_to(np.asarray(case.decay, np.float64), (case.kv_heads or case.H,)), G)
    oracle_kw = dict(layout=spec.layout, scale=spec.attention_scaling, causal=case.causal,
                     feature_map=case.feature_map, decay=gamma, normalize=case.normalize)
    k_rep, v_rep = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)
    ref = linear_attention_quadratic(q, k_rep, v_rep, p, spec.inv_freq(), **oracle_kw)
    if case.split and not case.causal:   # non-causal calls chained by a state are block-causal
        n = case.split
        p_head = p[..., :n] if np.ndim(p) else p
        ref[:, :, :n] = linear_attention_quadratic(q[:, :, :n], k_rep[:, :, :n], v_rep[:, :, :n], p_head,
                                                   spec.inv_freq(), **oracle_kw)
    to_layout = (lambda a: np.ascontiguousarray(np.swapaxes(a, 1, 2))) if case.bshd else (lambda a: a)
    args = [to_backend(to_layout(a)) for a in (q, k, v)]
    originals = [to_host(a).copy() for a in args]
    kwargs = dict(causal=case.causal, feature_map=case.feature_map, spec=spec, chunk=case.chunk,
                  seq_axis=-3 if case.bshd else -2, backend=backend, normalize=case.normalize,
                  decay=None if case.decay is None else np.asarray(case.decay, np.float64))
    t0 = time.perf_counter()
    try:
        if case.split:
            ax = 1 if case.bshd else 2
            cut = [slice(None)] * 4
            cut[ax] = slice(None, case.split)
            head = tuple(cut)
            cut[ax] = slice(case.split, None)
            tail = tuple(cut)
            pos_parts = (None, None) if pos is None else (pos, pos + case.split) if np.ndim(pos) == 0 else (
                to_backend(pos[:, :case.split]), to_backend(pos[:, case.split:]))
            o1, state = linear_attention(*(a[head] for a in args), pos_parts[0], return_state=True, **kwargs)
            o2 = linear_attention(*(a[tail] for a in args), pos_parts[1], state=state, **kwargs)
            outs = [o1, o2]
        else:
            pos_arg = to_backend(pos) if isinstance(pos, np.ndarray) else pos
            outs = [linear_attention(*args, pos_arg, **kwargs)]
    except Exception as exc:  # reported as a failure, not raised, so the runner can print a table
        return Result(case.name, backend, float("nan"), 0.0, False, 0.0, f"{type(exc).__name__}: {exc}")
    seconds = time.perf_counter() - t0
    tol = LINEAR_TOLERANCES[case.dtype]
    for out in outs:
        if type(out) is not type(args[0]) or out.dtype != args[0].dtype:
            return Result(case.name, backend, float("nan"), tol, False, seconds,
                          f"returned {type(out).__name__} {out.dtype}")
    host = np.concatenate([to_host(o).astype(np.float64) for o in outs], axis=1 if case.bshd else 2)
    if case.bshd:
        host = np.swapaxes(host, 1, 2)
    if host.shape != ref.shape:
        return Result(case.name, backend, float("nan"), tol, False, seconds, f"shape {host.shape} != {ref.shape}")
    err = float(np.max(np.abs(host - ref)) / np.sqrt(np.mean(ref**2)))
    ok, detail = err <= tol, "error relative to rms(o)"
    if not all(np.array_equal(to_host(a), o) for a, o in zip(args, originals)):
        ok, detail = False, "input was modified"
    return Result(case.name, backend, err, tol, ok, seconds, detail)


def array_converters(backend: str):
    """(to_backend, to_host) for the array type a backend takes (CuPy arrays for "cupy")."""
    if backend == "cupy":
        import cupy

        return cupy.asarray, (lambda a: cupy.asnumpy(a) if isinstance(a, cupy.ndarray) else np.asarray(a))
    return None, None


def run(backends=None, quick: bool = False) -> list[Result]:
    """Run every case (rotation, then linear attention) on every requested (default: available) backend."""
    from .backends import available_backends, get

    avail = available_backends()
    names = [b for b, (ok, _) in avail.items() if ok] if backends is None else list(backends)
    results = []
    for name in names:
        to_backend, to_host = array_converters(name)
        for case in cases(quick):
            results.append(run_case(case, name, to_backend=to_backend, to_host=to_host))
        if hasattr(get(name), "linear_attention"):
            for case in linear_cases(quick):
                results.append(run_linear_case(case, name, to_backend=to_backend, to_host=to_host))
    return results
