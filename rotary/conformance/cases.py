"""The cross-backend conformance cases, shared by the pytest suite and ``python -m rotary conformance``.

Each :class:`Case` describes one call of ``apply``/``apply_qk`` (shape, axes, spec, positions,
dtype, inverse, in place, strided input, output pair layout). :func:`run_case` makes seeded inputs, runs the call on
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

from ..spec import scaling as _scaling
from ..spec.rope_spec import RopeSpec
from ..spec.validators import to_numpy
from ..testing import linear_attention_quadratic, rope_complex, tolerance

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

#: Multi-axis conventions exercised by the suite: (kind, arguments); positions then carry n_axes coordinates.
MULTI_AXIS = {
    "mrope": ("mrope", dict(mrope_layout="chunked")),          # Qwen2-VL / 2.5-VL (GLM-4V with interleaved pairs)
    "mrope-il": ("mrope", dict(mrope_layout="interleaved")),   # Qwen3-VL / 3.5
    "mrope-ernie": ("mrope", dict(mrope_layout="ernie")),      # ERNIE-4.5-VL
    "axial2": ("axial", dict(axes=2)),                          # Qwen2-VL vision, SAM (interleaved pairs)
    "axial2-strided": ("axial", dict(axes=2, frequencies="strided")),   # Pixtral
    "axial2-wh": ("axial", dict(axes=2, axis_order=(1, 0))),    # w before h
    "axial3": ("axial", dict(axes=3)),
    "axial2-float": ("axial", dict(axes=2, float_positions=True, frequency_scale=6.283185307179586)),  # DINOv3
}


def multi_axis_spec(kind: str, head_dim: int, *, rotary_dim=None, layout="half", base=10000.0, scaling=None,
                    max_position_embeddings=None) -> RopeSpec:
    """The spec of one :data:`MULTI_AXIS` convention (M-RoPE sections split rotary_dim/2 as 1:1:1 + rest)."""
    family, kwargs = MULTI_AXIS[kind]
    if family == "mrope":
        half = (rotary_dim or head_dim - head_dim % 2) // 2
        section = (half - 2 * (half // 3), half // 3, half // 3)
        return RopeSpec(head_dim, rotary_dim=rotary_dim, base=base, layout=layout, scaling=scaling,
                        max_position_embeddings=max_position_embeddings, mrope_section=section, **kwargs)
    return RopeSpec.axial(head_dim, rotary_dim=rotary_dim, base=base, layout=layout, **kwargs)


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
    axes: str | None = None       # a MULTI_AXIS convention: positions (seq, n) / (batch, seq, n)
    custom: bool = False          # caller-supplied frequencies (some negative) with an attention factor
    rotary_offset: int = 0        # the spec rotates coordinates from this one on ([nope | rope | rest] heads)
    out_pairs: str | None = None  # the outputs' pair layout (DeepSeek MLA: interleaved in, half-split out)

    def spec(self) -> RopeSpec:
        if self.rotary_offset:   # the spec of the head from the offset on, moved behind rotary_offset coordinates
            inner = dataclasses.replace(self, shape=self.shape[:-1] + (self.shape[-1] - self.rotary_offset,),
                                        rotary_offset=0).spec()
            return inner.replace(head_dim=self.shape[-1], rotary_offset=self.rotary_offset)
        if self.custom:
            half = (self.rotary_dim or self.shape[-1] - self.shape[-1] % 2) // 2
            freqs = [(-1.0) ** i * 0.9 ** (3 * i) for i in range(half)]   # learned-like; odd pairs turn backwards
            return RopeSpec.from_inv_freq(freqs, head_dim=self.shape[-1], layout=self.layout, attention_scaling=1.3)
        scaling = SCALINGS[self.scaling] if self.scaling else None
        mpe = 64 if self.scaling else None
        if self.axes:
            return multi_axis_spec(self.axes, self.shape[-1], rotary_dim=self.rotary_dim, base=self.base,
                                   layout=self.layout, scaling=scaling, max_position_embeddings=mpe)
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
    out += [
        Case("custom-freq-scaled", (2, 9, 3, 20), seq_axis=-3, custom=True, rotary_dim=12, positions="batch",
             k_heads=1),
        Case("custom-freq-interleaved-huge", (2, 6, 16), layout="interleaved", custom=True, positions="huge"),
        Case("mrope-text", (2, 9, 3, 24), seq_axis=-3, axes="mrope", positions="offset", k_heads=1),
        Case("mrope-batch", (2, 11, 4, 24), seq_axis=-3, axes="mrope", positions="batch", k_heads=2),
        Case("mrope-glm4v-partial", (2, 10, 2, 32), seq_axis=-3, axes="mrope", layout="interleaved",
             rotary_dim=16, positions="tokens", k_heads=1),
        Case("mrope-il-batch", (2, 10, 3, 36), seq_axis=-3, axes="mrope-il", positions="batch", k_heads=1),
        Case("mrope-ernie", (1, 12, 2, 28), seq_axis=-3, axes="mrope-ernie", layout="interleaved", positions="batch"),
        Case("mrope-huge", (2, 6, 2, 24), seq_axis=-3, axes="mrope", positions="huge", k_heads=1),
        Case("mrope-fp16-inplace", (2, 9, 4, 24), seq_axis=-3, axes="mrope-il", positions="batch", dtype="float16",
             inplace=True, k_heads=2),
        Case("mrope-inverse", (2, 7, 2, 24), seq_axis=-3, axes="mrope", positions="batch", inverse=True, k_heads=2),
        Case("mrope-yarn", (2, 40, 2, 24), seq_axis=-3, axes="mrope", scaling="yarn", positions="batch", k_heads=1),
        Case("mrope-dynamic", (1, 70, 2, 24), seq_axis=-3, axes="mrope-il", scaling="dynamic", positions="batch"),
        Case("axial2-vit", (2, 3, 12, 16), axes="axial2", positions="tokens"),
        Case("axial2-sam", (2, 12, 3, 16), seq_axis=-3, axes="axial2", layout="interleaved", positions="tokens",
             k_heads=3),
        Case("axial2-pixtral", (3, 12, 20), axes="axial2-strided", positions="tokens"),
        Case("axial2-wh-strided", (2, 12, 2, 16), seq_axis=-3, axes="axial2-wh", positions="tokens", strided=True,
             k_heads=1),
        Case("axial3-video", (1, 18, 2, 24), seq_axis=-3, axes="axial3", positions="tokens", inverse=True),
        Case("axial2-dinov3-float", (2, 12, 3, 16), seq_axis=-3, axes="axial2-float", positions="tokens",
             dtype="float64", k_heads=3),
        Case("axial2-partial-odd", (2, 12, 21), axes="axial2", rotary_dim=12, positions="batch"),
    ]
    for layout in ("half", "interleaved"):   # rotary_offset: [nope | rope] (MLA) and [nope | rope | rest] heads
        L = layout[:4]
        out += [
            Case(f"offset-{L}-mla", (2, 7, 3, 24), seq_axis=-3, layout=layout, rotary_offset=16, k_heads=1,
                 positions="batch"),
            Case(f"offset-{L}-middle", (2, 9, 22), layout=layout, rotary_offset=5, rotary_dim=12, positions="offset"),
            Case(f"offset-{L}-inplace", (2, 6, 4, 20), seq_axis=-3, layout=layout, rotary_offset=4, rotary_dim=8,
                 inplace=True, k_heads=2),
            Case(f"offset-{L}-fp16-strided", (2, 6, 3, 20), seq_axis=-3, layout=layout, rotary_offset=6,
                 dtype="float16", strided=True, k_heads=3),
        ]
    out += [
        Case("offset-fp64-inverse-huge", (2, 5, 2, 26), seq_axis=-3, rotary_offset=10, dtype="float64", inverse=True,
             positions="huge", k_heads=1),
        Case("offset-yarn", (2, 40, 2, 24), seq_axis=-3, scaling="yarn", rotary_offset=8, positions="batch", k_heads=1),
        Case("offset-custom-freq", (2, 9, 3, 22), seq_axis=-3, custom=True, rotary_offset=6, rotary_dim=12,
             positions="batch", k_heads=1),
        Case("offset-mrope", (2, 9, 3, 32), seq_axis=-3, axes="mrope", rotary_offset=8, positions="batch", k_heads=1),
        Case("offset-axial2-inplace", (2, 12, 2, 20), seq_axis=-3, axes="axial2", rotary_offset=4, positions="tokens",
             inplace=True, k_heads=1),
    ]
    out += [   # out_pairs: pairs read in the spec's layout, written in the other one (never in place)
        Case("pairs-deepseek-mla", (2, 7, 4, 64), seq_axis=-3, layout="interleaved", out_pairs="half", k_heads=1,
             positions="batch"),
        Case("pairs-inte-to-half-partial-fp16", (2, 6, 3, 24), seq_axis=-3, layout="interleaved", rotary_dim=16,
             out_pairs="half", dtype="float16", k_heads=3),
        Case("pairs-half-to-inte-strided", (2, 6, 3, 20), seq_axis=-3, rotary_dim=12, out_pairs="interleaved",
             strided=True, k_heads=1, positions="offset"),
        Case("pairs-half-to-inte-inverse-fp64", (2, 5, 2, 16), seq_axis=-3, out_pairs="interleaved", inverse=True,
             dtype="float64", k_heads=2, positions="huge"),
        Case("pairs-offset-mla", (2, 7, 3, 24), seq_axis=-3, layout="interleaved", rotary_offset=8,
             out_pairs="half", k_heads=1, positions="batch"),
    ]
    known = set(_scaling.ROPE_TYPES)
    out = [c for c in out if c.scaling is None or SCALINGS[c.scaling]["rope_type"] in known]
    if quick:
        keep = ("basic", "bshd-gqa", "partial", "odd-dim", "inplace", "fp16", "huge-pos", "strided")
        extra = ("scaling-yarn", "mrope-batch", "mrope-il-batch", "axial2-sam", "axial2-dinov3-float",
                 "offset-half-mla", "offset-inte-inplace", "pairs-deepseek-mla")
        out = [c for c in out if c.name.split("-", 1)[1] in keep and not c.axes] + [c for c in out if c.name in extra]
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
    if case.axes:
        return x, _k_input(case, data), _multi_axis_positions(case, rng, seq)
    k = _k_input(case, data)
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


def _k_input(case: Case, data):
    if case.k_heads is None:
        return None
    kshape = list(case.shape)
    kshape[-2] = case.k_heads
    return data(tuple(kshape))


def _multi_axis_positions(case: Case, rng, seq: int):
    """Positions of a multi-axis case: "offset" -> an int (M-RoPE text tokens); "tokens" -> an image
    grid (seq, n) of row/col(/frame) ids (patch centres in [-1, 1] for float specs); "batch" -> random
    (batch, seq, n) ids; "huge" -> (seq, n) ids near 2**31."""
    spec = case.spec()
    n = spec.n_axes
    if case.positions == "offset":
        return 37
    if case.positions == "tokens":
        side = [int(np.ceil(seq ** (1.0 / n)))] * n
        grid = np.stack(np.meshgrid(*[np.arange(s) for s in side], indexing="ij"), -1).reshape(-1, n)[:seq]
        if spec.float_positions:
            return (grid + 0.5) / np.array(side) * 2.0 - 1.0
        return grid.astype(np.int64) + np.arange(n)   # distinct offsets per axis
    if case.positions == "batch":
        return rng.integers(0, 90, size=(case.shape[0], seq, n), dtype=np.int64)
    if case.positions == "huge":
        return np.int64(2**31 - 1) - rng.integers(0, 5000, size=(seq, n), dtype=np.int64)
    raise ValueError(case.positions)


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
    pair_axes = None
    if spec.multi_axis:
        pair_axes = spec.pair_axes()
        if p.ndim == 1:   # M-RoPE text tokens: the same position on every axis
            p = np.repeat(p[:, None], spec.n_axes, axis=1)
    seq_len = int(np.floor(p.max())) + 1
    inv_freq = spec.inv_freq(seq_len) if spec.depends_on_seq_len else spec.inv_freq()
    scale = spec.attention_scaling_at(seq_len)
    xs = np.moveaxis(np.asarray(x, dtype=np.float64), ax, -2)      # (..., seq, d)
    if p.ndim == (3 if spec.multi_axis else 2):   # (batch, seq[, n]): batch is axis 0, broadcast over the middle axes
        p = p.reshape((p.shape[0],) + (1,) * (xs.ndim - 3) + p.shape[1:])
    off = spec.rotary_offset   # coordinates before it pass through: the oracle rotates the rest
    y = xs.copy()
    y[..., off:] = rope_complex(xs[..., off:], p, -inv_freq if case.inverse else inv_freq, layout=spec.layout,
                                scale=scale, pair_axes=pair_axes)
    if case.out_pairs is not None and case.out_pairs != spec.layout:   # pair i moved to its out_pairs coordinates
        rotated = y[..., off:off + spec.rotary_dim].copy()
        for src, dst in zip(_pair_coordinates(spec.rotary_dim, spec.layout),
                            _pair_coordinates(spec.rotary_dim, case.out_pairs)):
            y[..., off + dst] = rotated[..., src]
    return np.moveaxis(y, -2, ax)


def _pair_coordinates(rotary_dim: int, layout: str):
    """(a coordinates, b coordinates) of the pairs of ``layout`` within ``rotary_dim``."""
    half = rotary_dim // 2
    if layout == "half":
        return np.arange(half), np.arange(half, rotary_dim)
    return np.arange(0, rotary_dim, 2), np.arange(1, rotary_dim, 2)


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
    from ..frontend import rotate as _api

    to_backend = to_backend or (lambda a: a)
    to_host = to_host or (lambda a: to_numpy(a))
    x, k, pos = make_inputs(case, seed)
    refs = [expected(case, x, pos)] + ([expected(case, k, pos)] if k is not None else [])
    xs = [to_backend(x)] + ([to_backend(k)] if k is not None else [])
    originals = [to_host(a).copy() for a in xs]
    pos_arg = to_backend(pos) if isinstance(pos, np.ndarray) else pos
    kwargs = dict(spec=case.spec(), seq_axis=case.seq_axis, inverse=case.inverse, backend=backend)
    if case.out_pairs is not None:
        kwargs["out_pairs"] = case.out_pairs
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
    axes: str | None = None      # a MULTI_AXIS convention; positions "batch" are then (B, T, n)
    rotary_offset: int = 0       # the features rotate from this one on

    def spec(self) -> RopeSpec:
        if self.axes:
            return multi_axis_spec(self.axes, self.d, rotary_dim=self.rotary_dim, base=100.0, layout=self.layout)
        return RopeSpec(self.d, rotary_dim=self.rotary_dim, base=100.0, layout=self.layout,
                        rotary_offset=self.rotary_offset)

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
        LinearCase("la-causal-mrope", d=12, axes="mrope", positions="batch", bshd=True),
        LinearCase("la-noncausal-mrope-il", d=18, axes="mrope-il", positions="batch", causal=False),
        LinearCase("la-causal-mrope-resume", d=12, axes="mrope", positions="batch", T=21, split=13, chunk=4),
        LinearCase("la-causal-axial2", d=16, axes="axial2", positions="batch", layout="interleaved"),
        LinearCase("la-noncausal-axial2-float", d=16, axes="axial2-float", positions="batch", causal=False,
                   dtype="float64"),
        LinearCase("la-causal-offset-resume", d=14, rotary_dim=6, rotary_offset=5, layout="interleaved", T=21,
                   split=13, chunk=4, kv_heads=1),
        LinearCase("la-noncausal-offset", d=12, rotary_offset=4, positions="batch", causal=False, bshd=True),
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
    n = case.spec().n_axes if case.axes else 0
    if case.positions == "offset":
        pos = 1000
    elif case.positions == "batch" and case.axes and case.spec().float_positions:
        pos = rng.uniform(-1.0, 1.0, size=(case.B, case.T, n))
    elif case.positions == "batch":
        pos = rng.integers(0, 500, size=(case.B, case.T) + ((n,) if n else ()), dtype=np.int64)
    else:
        pos = None
    return q, k, v, pos


def run_linear_case(case: LinearCase, backend: str, *, to_backend=None, to_host=None, seed: int = 0) -> Result:
    """Run ``case`` on ``backend``; error = max |o - o_ref| / rms(o_ref) against the quadratic oracle."""
    from ..attn.linear import linear_attention

    to_backend = to_backend or (lambda a: a)
    to_host = to_host or (lambda a: to_numpy(a))
    q, k, v, pos = make_linear_inputs(case, seed)
    spec = case.spec()
    if pos is None:
        p = np.arange(case.T)
    elif np.ndim(pos) == 0:
        p = int(pos) + np.arange(case.T)
    else:
        p = pos[:, None]
    if spec.multi_axis and np.ndim(p) == 1:
        p = np.repeat(p[:, None], spec.n_axes, axis=1)
    G = case.groups()
    gamma = None   # the oracle's: per q head (q head h reads k/v head h // G and its gamma)
    if case.decay is not None:
        gamma = np.repeat(np.broadcast_to(np.asarray(case.decay, np.float64), (case.kv_heads or case.H,)), G)
    oracle_kw = dict(layout=spec.layout, scale=spec.attention_scaling, causal=case.causal,
                     feature_map=case.feature_map, decay=gamma, normalize=case.normalize,
                     pair_axes=spec.pair_axes() if spec.multi_axis else None, rotary_offset=spec.rotary_offset)
    k_rep, v_rep = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)
    ref = linear_attention_quadratic(q, k_rep, v_rep, p, spec.inv_freq(), **oracle_kw)
    if case.split and not case.causal:   # non-causal calls chained by a state are block-causal
        n = case.split
        p_head = (p[..., :n, :] if spec.multi_axis else p[..., :n]) if np.ndim(p) else p
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
    """(to_backend, to_host) for the array type a backend takes: its module's ``array_converters()``
    capability (CuPy: device arrays), (None, None) for a backend of NumPy arrays."""
    from ..backends import get

    converters = getattr(get(backend), "array_converters", None)
    return converters() if converters is not None else (None, None)


def run(backends=None, quick: bool = False) -> list[Result]:
    """Run every case (rotation, then linear attention) on every requested (default: available) backend."""
    from ..backends import available_backends, get

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
