"""``rotary.conformance.check``: rotary's conformance cases run against anyone's RoPE.

``check(impl, signature="plain")`` runs every case (both layouts, partial rotary and odd head dims,
scalar / per-token / per-batch positions, large positions, every scaling rule, rules read from HF
configs, fp32/fp16/bf16/fp64, the inverse) through the signature's adapter (:mod:`.adapters`), compares
each result with the float64 oracle of ``rotary.conformance.cases.expected`` and, for each failure, says
which convention the implementation follows instead (:mod:`.diagnosis`). It returns a :class:`Report`.

Tolerance of a case: ``atol + rtol * |y_ref|`` of ``rotary.testing.tolerance(dtype)``, plus, except in the
large-position cases, what angles formed in float32 cost: ``|pair| * |angle| * 2**-21`` (every peer forms
its angles in float32; 2**-50 for float64 data). The large-position cases (positions near 2**31) take
the dtype's tolerance alone: angles formed in float32 are off by radians there. ``strict=True`` asks for
exact angles everywhere.
"""

from __future__ import annotations

import collections
import dataclasses
import fnmatch
import importlib
import sys
import time
import zlib
from typing import NamedTuple

import numpy as np

from ..spec.rope_spec import RopeSpec
from ..testing import tolerance
from . import diagnosis as _diagnosis
from .adapters import DTYPES, Arrays, Call, NotApplicable, adapter as _adapter
from .cases import SCALINGS, Case, expected

#: relative angle error allowed outside the large-position cases (angles formed in float32; float64 data)
ANGLE_ALLOWANCE = {"float64": 2.0**-50}
ANGLE_ALLOWANCE_DEFAULT = 2.0**-21
#: short dtype names used in case names
SHORT = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64"}
#: the positions each kind gives, and the caller-side form it takes
FORMS = {"arange": "scalar", "offset": "scalar", "huge-offset": "scalar", "batch-offset": "vector",
         "tokens": "tokens", "huge": "tokens", "batch": "batch"}


def _factors(n: int, lo: float, hi: float) -> list:
    return [round(lo + (hi - lo) * (i / max(n - 1, 1)) ** 2, 4) for i in range(n)]


#: RoPE parts of real config.json files (shapes as published; LongRoPE factors synthetic)
HF_CONFIGS = {
    "llama3.1": {"hidden_size": 4096, "num_attention_heads": 32, "max_position_embeddings": 131072,
                 "rope_theta": 500000.0,
                 "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    "llama4": {"hidden_size": 5120, "num_attention_heads": 40, "max_position_embeddings": 262144,
               "rope_theta": 500000.0,
               "rope_scaling": {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 1.0, "original_max_position_embeddings": 8192}},
    "qwen2.5-yarn": {"hidden_size": 5120, "num_attention_heads": 40, "max_position_embeddings": 131072,
                     "rope_theta": 1e6,
                     "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}},
    "deepseek-yarn-mscale": {"hidden_size": 1024, "num_attention_heads": 16, "max_position_embeddings": 163840,
                             "rope_theta": 10000.0,
                             "rope_scaling": {"type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707,
                                              "beta_fast": 32, "beta_slow": 1,
                                              "original_max_position_embeddings": 4096}},
    "gpt-oss-yarn": {"hidden_size": 2880, "num_attention_heads": 64, "head_dim": 64,
                     "max_position_embeddings": 131072, "rope_theta": 150000.0,
                     "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                      "truncate": False, "original_max_position_embeddings": 4096}},
    "phi3-longrope": {"hidden_size": 3072, "num_attention_heads": 32, "max_position_embeddings": 131072,
                      "original_max_position_embeddings": 4096, "rope_theta": 10000.0,
                      "rope_scaling": {"type": "longrope", "short_factor": _factors(48, 1.0, 1.1),
                                       "long_factor": _factors(48, 1.0, 40.0)}},
    "phi2-partial": {"hidden_size": 2560, "num_attention_heads": 32, "partial_rotary_factor": 0.4,
                     "rope_theta": 10000.0, "max_position_embeddings": 2048},
}


@dataclasses.dataclass(frozen=True)
class ImplCase(Case):
    """A conformance case for an outside implementation: x (batch, seq, heads, head_dim), positions of
    ``kind`` (:data:`FORMS`), ``exact``: exact angles required (no float32 allowance)."""

    seq_axis: int = -3
    kind: str = "arange"
    offset: int = 37
    exact: bool = False
    quick: bool = False
    hf_config: str | None = None     # a key of HF_CONFIGS: the spec from_hf_config reads

    def spec(self) -> RopeSpec:
        if self.hf_config is not None:
            return RopeSpec.from_hf_config(HF_CONFIGS[self.hf_config])
        return super().spec()

    @property
    def form(self) -> str:
        return FORMS[self.kind]

    def make_positions(self, rng=None):
        """(per-token positions (seq,) or (batch, seq), caller-side offsets: an int, a (batch,) array or None)."""
        b, s = self.shape[0], self.shape[1]
        if self.kind == "arange":
            return np.arange(s), 0
        if self.kind in ("offset", "huge-offset"):
            off = self.offset if self.kind == "offset" else 2**31 - s
            return off + np.arange(s), off
        if self.kind == "batch-offset":
            offs = 19 * np.arange(b) + 3
            return offs[:, None] + np.arange(s), offs
        if self.kind == "tokens":
            return np.arange(s) * 3 + 5, None
        if self.kind == "huge":
            return 2**31 - 1 - np.arange(s)[::-1] * 1000, None
        rng = rng if rng is not None else np.random.default_rng(1)
        return rng.integers(0, 90, size=(b, s)), None


def _core_cases() -> list[ImplCase]:
    out = []
    for layout in ("half", "interleaved"):
        L = layout[:4]
        out += [
            ImplCase(f"{L}-basic", (2, 8, 2, 16), layout=layout, quick=True),
            ImplCase(f"{L}-offset", (2, 6, 2, 16), layout=layout, kind="offset", quick=True),
            ImplCase(f"{L}-tokens", (2, 7, 2, 16), layout=layout, kind="tokens", quick=True),
            ImplCase(f"{L}-batch", (3, 6, 2, 16), layout=layout, kind="batch", quick=True),
            ImplCase(f"{L}-batch-offset", (3, 5, 2, 16), layout=layout, kind="batch-offset", quick=True),
            ImplCase(f"{L}-gqa", (2, 5, 4, 16), layout=layout, kind="offset", k_heads=2, quick=True),
            ImplCase(f"{L}-partial", (2, 6, 2, 20), layout=layout, rotary_dim=12, kind="offset", quick=True),
            ImplCase(f"{L}-partial-quarter", (1, 5, 2, 64), layout=layout, rotary_dim=16, base=1e6, kind="tokens"),
            ImplCase(f"{L}-odd-dim", (2, 5, 1, 17), layout=layout, kind="offset", quick=True),
            ImplCase(f"{L}-d80", (1, 6, 2, 80), layout=layout, kind="tokens"),
            ImplCase(f"{L}-d128-base5e5", (1, 6, 2, 128), layout=layout, base=500000.0, kind="offset", offset=3000),
            ImplCase(f"{L}-inverse", (2, 6, 2, 16), layout=layout, kind="offset", inverse=True, quick=True),
            ImplCase(f"{L}-huge-pos", (2, 5, 1, 32), layout=layout, kind="huge", exact=True, quick=True),
            ImplCase(f"{L}-huge-offset", (1, 4, 1, 32), layout=layout, kind="huge-offset", exact=True, quick=True),
        ]
    for name in SCALINGS:
        out.append(ImplCase(f"scaling-{name}", (1, 70, 1, 16), scaling=name, quick=True))
        out.append(ImplCase(f"scaling-{name}-interleaved-partial", (2, 70, 1, 18), layout="interleaved", rotary_dim=16,
                            scaling=name, kind="batch-offset"))
    out += [ImplCase("scaling-dynamic-short", (1, 12, 1, 16), scaling="dynamic", quick=True),
            ImplCase("scaling-longrope-short", (1, 12, 1, 16), scaling="longrope", quick=True)]
    for key, shape, offset, quick in (("llama3.1", (1, 6, 1, 128), 9000, True), ("llama4", (1, 4, 1, 128), 9000, False),
                                      ("qwen2.5-yarn", (1, 4, 1, 128), 40000, False),
                                      ("deepseek-yarn-mscale", (1, 6, 1, 64), 5000, True),
                                      ("gpt-oss-yarn", (1, 4, 1, 64), 5000, False),
                                      ("phi3-longrope", (1, 6, 1, 96), 5000, True),
                                      ("phi2-partial", (1, 5, 2, 80), 100, False)):
        out.append(ImplCase(f"hf-{key}", shape, kind="offset", offset=offset, hf_config=key, quick=quick))
    return out


#: the cases run again in every dtype other than the main one (quick: the first five)
DTYPE_SWEEP = ("half-basic", "inte-basic", "half-partial", "scaling-yarn", "half-huge-offset", "half-batch",
               "half-gqa", "scaling-longrope")


def impl_cases(quick: bool = False, dtypes=DTYPES) -> list[ImplCase]:
    """The cases for ``dtypes``: every core case in the main dtype (float32 when listed, else the first),
    :data:`DTYPE_SWEEP` in the others (``quick``: the quick subset)."""
    dtypes = tuple(dict.fromkeys(dtypes))
    bad = [d for d in dtypes if d not in DTYPES]
    if bad or not dtypes:
        raise ValueError(f"dtypes must be a non-empty selection of {DTYPES}, got {dtypes!r}")
    main = "float32" if "float32" in dtypes else dtypes[0]
    core = [c for c in _core_cases() if c.quick or not quick]
    out = [dataclasses.replace(c, dtype=main) for c in core]
    by_name = {c.name: c for c in core}
    sweep = [by_name[n] for n in DTYPE_SWEEP[:5 if quick else None] if n in by_name]
    for dt in dtypes:
        if dt != main:
            out += [dataclasses.replace(c, name=f"{c.name}-{SHORT[dt]}", dtype=dt) for c in sweep]
    return out


# -- results -----------------------------------------------------------------------------------------
@dataclasses.dataclass
class CaseResult:
    """One case: ``status`` "pass", "FAIL" or "n/a"; ``error`` against the float64 oracle and the
    ``tolerance`` at the element furthest beyond (or closest to) its tolerance, ``max_error`` over every
    element; ``diagnosis`` what a failure matches (or why n/a)."""

    case: str
    status: str
    dtype: str = ""
    error: float = float("nan")
    tolerance: float = float("nan")
    max_error: float = float("nan")
    max_position: int = 0
    diagnosis: str = ""
    detail: str = ""
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return self.status == "pass"

    @property
    def failed(self) -> bool:
        return self.status == "FAIL"

    @property
    def applicable(self) -> bool:
        return self.status != "n/a"


def _angle_term(spec: RopeSpec, x: np.ndarray, positions) -> np.ndarray:
    """Per element of x (batch, seq, heads, d): ``|pair| * |angle| * attention factor`` on the rotated
    coordinates (0 elsewhere), the error a unit relative angle error makes."""
    p = np.asarray(positions, dtype=np.float64)
    n = int(np.floor(p.max())) + 1
    w, A = spec.inv_freq(n), spec.attention_scaling_at(n)
    p = np.broadcast_to(p, x.shape[:2])
    theta = np.abs(p[..., None, None] * w)                   # (batch, seq, 1, half)
    a, b = spec.pair_indices()
    mag = np.hypot(x[..., a], x[..., b]) * A * theta
    out = np.zeros_like(x)
    out[..., a] = mag
    out[..., b] = mag
    return out


class _Score(NamedTuple):
    ratio: float         # max over elements of |y - y_ref| / bound (inf for NaN or inf outputs)
    error: float         # |y - y_ref| at that element
    tolerance: float     # the bound there
    max_error: float     # max |y - y_ref| over every element
    where: tuple | None  # that element's index
    which: int           # in which output (x, k)


def _compare(case: ImplCase, spec: RopeSpec, xs, positions, inverse: bool, ys, *, dtype=None, exact=None,
             eps=None) -> _Score:
    """The outputs ``ys`` against the oracle of ``spec`` at ``positions``; the bound per element is the
    dtype's tolerance, plus the angle allowance (``eps``, default by dtype) unless ``exact``."""
    dtype = dtype or case.dtype
    exact = case.exact if exact is None else exact
    eps = ANGLE_ALLOWANCE.get(dtype, ANGLE_ALLOWANCE_DEFAULT) if eps is None else eps
    rtol, atol = tolerance(dtype)
    alt = dataclasses.replace(case, inverse=inverse)
    worst = _Score(-1.0, 0.0, atol, 0.0, None, 0)
    for i, (x, y) in enumerate(zip(xs, ys)):
        if not np.all(np.isfinite(y)):
            return _Score(float("inf"), float("inf"), atol, float("inf"), None, i)
        ref = _oracle(alt, spec, x, positions)
        bound = atol + rtol * np.abs(ref)
        if not exact:
            bound = bound + _angle_term(spec, x, positions) * eps
        err = np.abs(y - ref)
        ratio = err / bound
        j = int(np.argmax(ratio))
        top = max(worst.max_error, float(err.max()))
        if ratio.flat[j] > worst.ratio:
            worst = _Score(float(ratio.flat[j]), float(err.flat[j]), float(bound.flat[j]), top,
                           np.unravel_index(j, y.shape), i)
        else:
            worst = worst._replace(max_error=top)
    return worst


def _oracle(case: ImplCase, spec: RopeSpec, x, positions):
    """``rotary.conformance.cases.expected`` of ``case`` with ``spec`` (the case's own or an alternative)."""
    return expected(_SpecCase(case, spec), x, positions)


class _SpecCase:
    """A case whose ``spec()`` is a given spec (what ``expected`` reads: spec(), seq_axis, inverse, out_pairs)."""

    def __init__(self, case, spec):
        self._case, self._spec = case, spec

    def spec(self):
        return self._spec

    def __getattr__(self, name):
        return getattr(self._case, name)


# -- running an implementation -----------------------------------------------------------------------
class Runner:
    """One implementation under one signature: runs cases, diagnoses failures, probes precision."""

    def __init__(self, impl, *, signature="plain", arrays=None, device=None, cos_sin=None, strict=False,
                 skip=(), name=None):
        if isinstance(impl, str):
            impl = load_impl(impl)
        self.impl = impl
        self.adapter = _adapter(signature, cos_sin)
        self.arrays = Arrays(arrays or self.adapter.default_arrays, device)
        self.adapter.check_arrays(self.arrays)
        self.strict = bool(strict)
        self.skip = (skip,) if isinstance(skip, str) else tuple(skip)
        self.name = name or _name_of(impl)
        self._probes: dict = {}
        self._layouts: dict = {}

    # one case ------------------------------------------------------------------------------------
    def _execute(self, case: ImplCase):
        """(host inputs, positions, host outputs) of one case; raises NotApplicable."""
        spec = case.spec()
        self.adapter.applicable(spec, case.form, case.inverse)
        rng = np.random.default_rng(zlib.crc32(case.name.encode()))
        shape = case.shape
        try:
            x = self.arrays.array(rng.standard_normal(shape), case.dtype)
            k = None
            if case.k_heads is not None:
                k = self.arrays.array(rng.standard_normal(shape[:2] + (case.k_heads,) + shape[3:]), case.dtype)
            xs_host = [self.arrays.host(a) for a in (x, k) if a is not None]
        except NotApplicable:
            raise
        except Exception as exc:
            raise _Harness() from exc
        positions, offsets = case.make_positions(rng)
        call = Call(spec, x, k, positions, offsets, case.inverse, self.arrays)
        outs = self.adapter.run(self.impl, call)
        ins = [a for a in (x, k) if a is not None]
        for a, y in zip(ins, outs):
            shape_y = tuple(getattr(y, "shape", ()))
            if shape_y != tuple(a.shape):
                raise _Wrong(f"returned shape {shape_y} for an input of shape {tuple(a.shape)}")
            if self.arrays.is_array(y) and self.arrays.dtype_name(y) != self.arrays.dtype_name(a):
                raise _Wrong(f"returned {self.arrays.dtype_name(y)} for {self.arrays.dtype_name(a)} input")
        if len(outs) != len(ins):
            raise _Wrong(f"returned {len(outs)} arrays for {len(ins)} inputs")
        return spec, xs_host, positions, [self.arrays.host(y) for y in outs]

    def run(self, case: ImplCase, diagnose: bool = True) -> CaseResult:
        """Run one case (and diagnose it when it fails)."""
        if any(fnmatch.fnmatchcase(case.name, pat) for pat in self.skip):
            return CaseResult(case.name, "n/a", case.dtype, diagnosis="skipped (skip=)")
        t0 = time.perf_counter()
        try:
            spec, xs, positions, ys = self._execute(case)
        except _Harness as exc:   # rotary's side (inputs in the array library): raised, not blamed on impl
            raise exc.__cause__
        except NotApplicable as exc:
            return CaseResult(case.name, "n/a", case.dtype, diagnosis=str(exc) or "not applicable")
        except _Wrong as exc:
            return CaseResult(case.name, "FAIL", case.dtype, diagnosis=str(exc), seconds=time.perf_counter() - t0)
        except Exception as exc:  # the implementation raised: reported, not raised
            return CaseResult(case.name, "FAIL", case.dtype, diagnosis=f"raised {type(exc).__name__}: {exc}"[:300],
                              seconds=time.perf_counter() - t0)
        seconds = time.perf_counter() - t0
        exact = case.exact or self.strict
        score = _compare(case, spec, xs, positions, case.inverse, ys, exact=exact)
        result = CaseResult(case.name, "pass" if score.ratio <= 1.0 else "FAIL", case.dtype, score.error,
                            score.tolerance, score.max_error, int(np.max(positions)), seconds=seconds)
        if not result.passed:
            if score.where is not None:
                p = np.broadcast_to(np.asarray(positions), xs[score.which].shape[:2])[score.where[:2]]
                result.detail = f"worst at position {int(p)}, coordinate {int(score.where[-1])}"
            if diagnose:
                result.diagnosis = self.diagnose(case, spec, xs, positions, ys, exact)
        return result

    # diagnosis -----------------------------------------------------------------------------------
    def diagnose(self, case, spec, xs, positions, ys, exact) -> str:
        """What the failing outputs ``ys`` match: an alternative convention, the precision of the angles,
        a lower precision, or "no known convention matches"."""
        finite = all(np.all(np.isfinite(y)) for y in ys)
        if finite:   # conventions are told apart with angles formed in float64 allowed (a precision question aside)
            single = _diagnosis.hypotheses(spec, positions, case.inverse)
            loose = dict(exact=False, dtype=_coarser(case.dtype, "float32"))
            if exact:
                loose["eps"] = ANGLE_ALLOWANCE["float64"]
            for group in (single, None):
                hyps = group if group is not None else _diagnosis.combined(single, spec, positions, case.inverse)
                scored = [(_compare(case, h.spec, xs, h.positions, h.inverse, ys, **loose).ratio, h) for h in hyps]
                scored = [(r, h) for r, h in scored if r <= 1.0]
                if scored:
                    return min(scored, key=lambda t: t[0])[1].message
        fit = self.precision(case.dtype)
        if case.dtype != "float32":   # float32's finer rounding names coarse angles best; the dtype's own
            f32 = self.precision("float32")   # probe shows positions formed in it (and hides fine errors)
            if f32.angles in ("fp16", "bf16") or (not fit.named and f32.inexact):
                fit = f32
        if fit.inexact and (exact or not finite or fit.angles in ("fp16", "bf16", "fp16 positions", "bf16 positions")
                            or (fit.angles == "fp32" and case.dtype == "float64")):
            return fit.message
        if not finite:
            return "non-finite output (NaN or inf)"
        for lower in ("float32", "bfloat16", "float16"):
            if tolerance(lower)[0] > tolerance(case.dtype)[0]:
                if _compare(case, spec, xs, positions, case.inverse, ys, dtype=lower, exact=exact).ratio <= 1.0:
                    return (f"computed in {lower} (or coarser tables): the error fits {lower}'s tolerance, "
                            f"not {case.dtype}'s")
        extra = self.adapter.hint(spec)
        return "no known convention matches" + (f" ({extra})" if extra else "")

    # precision probe -----------------------------------------------------------------------------
    def _probe_layout(self, dtype: str) -> str:
        """The layout the implementation gets closest to at small positions (its basic case's error)."""
        if dtype not in self._layouts:
            best = (float("inf"), "half")
            for layout in ("half", "interleaved"):
                case = ImplCase("probe-layout", (1, 6, 1, 16), layout=layout, dtype=dtype)
                try:
                    spec, xs, positions, ys = self._execute(case)
                except Exception:
                    continue
                ratio = _compare(case, spec, xs, positions, False, ys).ratio
                best = min(best, (ratio, layout))
            self._layouts[dtype] = best[1]
        return self._layouts[dtype]

    def precision(self, dtype: str = "float32") -> _diagnosis.PrecisionFit:
        """The precision probe at ``dtype``: 4 tokens from each of :data:`~.diagnosis.PROBE_OFFSETS`
        (head_dim 64, base 10000, so the fastest pair turns one radian per position), fitted."""
        if dtype in self._probes:
            return self._probes[dtype]
        layout = self._probe_layout(dtype)
        positions, errors, units, mags = [], [], [], []
        for off in _diagnosis.PROBE_OFFSETS:
            case = ImplCase(f"probe-{off}", (1, 4, 2, 64), layout=layout, kind="offset", offset=off, dtype=dtype,
                            exact=True)
            try:
                spec, xs, pos, ys = self._execute(case)
            except Exception:
                continue
            alt = dataclasses.replace(case, inverse=False)
            errs = [np.abs(y - _oracle(alt, spec, x, pos)) for x, y in zip(xs, ys)]
            positions.append(int(off))
            errors.append(max(float(np.nanmax(e)) if np.all(np.isfinite(e)) else float("inf") for e in errs))
            units.append(max(float(_angle_term(spec, x, pos).max()) for x in xs))
            a, b = spec.pair_indices()
            mags.append(max(float(np.hypot(x[..., a], x[..., b]).max()) for x in xs))
        fit = _diagnosis.fit_precision(dtype, positions, errors, units, tolerance(dtype)[1])
        fit.magnitudes = mags
        self._probes[dtype] = fit
        return fit


def _coarser(a: str, b: str) -> str:
    """The dtype of the two with the looser tolerance."""
    return a if tolerance(a)[0] >= tolerance(b)[0] else b


class _Harness(Exception):
    """An error on rotary's side of a case (making its inputs), raised as the error it wraps."""


class _Wrong(Exception):
    """Outputs of the wrong shape, dtype or number: a failure with that as its diagnosis."""


def _name_of(impl) -> str:
    module = getattr(impl, "__module__", None) or ""
    name = getattr(impl, "__qualname__", None) or getattr(impl, "__name__", None) or type(impl).__name__
    return f"{module}:{name}" if module else str(name)


def load_impl(target: str):
    """``package.module:function`` (dotted attributes after the colon allowed) -> the object."""
    if ":" not in target:
        raise ValueError(f"expected package.module:function, got {target!r}")
    module_name, _, attr = target.partition(":")
    obj = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


# -- the report --------------------------------------------------------------------------------------
@dataclasses.dataclass
class Report:
    """The outcome of :func:`check`: one :class:`CaseResult` per case, the precision probe, findings."""

    implementation: str
    signature: str
    arrays: str
    results: list
    precision: dict = dataclasses.field(default_factory=dict)   # dtype -> PrecisionFit

    @property
    def passed(self) -> bool:
        """True when no applicable case failed."""
        return not self.failures

    @property
    def failures(self) -> list:
        return [r for r in self.results if r.failed]

    @property
    def not_applicable(self) -> list:
        return [r for r in self.results if not r.applicable]

    def __getitem__(self, name: str) -> CaseResult:
        for r in self.results:
            if r.case == name:
                return r
        raise KeyError(name)

    def findings(self) -> list[str]:
        """The failures' diagnoses, most frequent first, each with the cases it explains."""
        groups = collections.defaultdict(list)
        for r in self.failures:
            groups[r.diagnosis].append(r.case)
        return [f"{msg} ({len(names)} case{'s' if len(names) > 1 else ''}: {', '.join(names[:6])}"
                f"{', ...' if len(names) > 6 else ''})" for msg, names in
                sorted(groups.items(), key=lambda kv: -len(kv[1]))]

    def table(self, failures_only: bool = False) -> str:
        header = ("case", "result", "error", "tolerance", "diagnosis")
        rows = [(r.case, r.status, f"{r.error:.2e}", f"{r.tolerance:.1e}", r.diagnosis)
                for r in self.results if not (failures_only and not r.failed)]
        widths = [max(len(str(row[i])) for row in [header] + rows) for i in range(len(header) - 1)]
        lines = ["  ".join([str(c).ljust(w) for c, w in zip(row[:-1], widths)] + [row[-1]]).rstrip()
                 for row in [header] + rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)

    def summary(self) -> str:
        n_pass = sum(r.passed for r in self.results)
        n_fail = len(self.failures)
        n_na = len(self.not_applicable)
        verdict = "OK" if self.passed else f"{n_fail} FAILED"
        return (f"conformance of {self.implementation} (signature {self.signature!r}, {self.arrays} arrays): "
                f"{verdict}; {n_pass} passed, {n_fail} failed, {n_na} not applicable")

    def format(self, failures_only: bool = False) -> str:
        parts = [self.table(failures_only)]
        if self.failures:
            parts.append("diagnosis:\n" + "\n".join(f"  - {f}" for f in self.findings()))
        if self.precision:
            parts.append("precision:\n" + "\n".join(f"  - {dt}: {fit.message}" for dt, fit in self.precision.items()))
        parts.append(self.summary())
        return "\n\n".join(parts)

    def __str__(self):
        return self.format()

    def assert_ok(self) -> None:
        """Raise AssertionError listing every failure and its diagnosis."""
        if not self.passed:
            raise AssertionError(self.summary() + "\n" + "\n".join(
                f"  {r.case}: error {r.error:.3g} (tolerance {r.tolerance:.2g}): {r.diagnosis}"
                for r in self.failures))

    def to_dict(self) -> dict:
        return {"implementation": self.implementation, "signature": self.signature, "arrays": self.arrays,
                "passed": self.passed, "results": [dataclasses.asdict(r) for r in self.results],
                "precision": {dt: {"angles": f.angles, "message": f.message, "positions": f.positions,
                                   "errors": f.errors} for dt, f in self.precision.items()}}

    def plot(self, path=None, ax=None):
        """Max error against position (the precision probe, log-log; matplotlib, imported here), with the
        error angles formed in float32 would make. Saved to ``path`` when given; returns the axes."""
        import matplotlib

        if ax is None and path is not None:
            matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt

        fig = None
        if ax is None:
            fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for dt, fit in self.precision.items():
            pts = [(p, e) for p, e in zip(fit.positions, fit.errors) if np.isfinite(e) and e > 0]
            if pts:
                ax.loglog(*zip(*pts), "o-", label=f"{self.implementation} ({dt}): {fit.angles} angles")
            if fit.positions:   # a rotation moves a pair by at most twice its length: the model saturates there
                model = np.minimum(np.asarray(fit.units, dtype=np.float64) * 2.0**-24, 2 * max(fit.magnitudes))
                ax.loglog(fit.positions, model, ":", color="grey",
                          label="angles formed in fp32 (|pair| x angle x 2^-24)" if dt == next(iter(self.precision)) else None)
        ax.set_xlabel("position")
        ax.set_ylabel("max |error| against the float64 oracle")
        ax.set_title(f"RoPE error against position: {self.implementation}", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        if path is not None:
            (fig or ax.figure).savefig(path, dpi=120, bbox_inches="tight")
            if fig is not None:
                plt.close(fig)
        return ax


# -- the entry points --------------------------------------------------------------------------------
def select_cases(cases="quick", dtypes=DTYPES) -> list[ImplCase]:
    """``cases``: "quick", "full", a list of :class:`ImplCase`, or a list of case names / fnmatch patterns
    (matched against the full set)."""
    if isinstance(cases, str) and cases in ("quick", "full"):
        return impl_cases(quick=cases == "quick", dtypes=dtypes)
    cases = [cases] if isinstance(cases, (str, ImplCase)) else list(cases)
    if all(isinstance(c, ImplCase) for c in cases):
        return cases
    everything = impl_cases(quick=False, dtypes=dtypes)
    chosen = [c for c in everything if any(fnmatch.fnmatchcase(c.name, str(p)) for p in cases)]
    if not chosen:
        raise ValueError(f"no case matches {cases!r} (cases is 'quick', 'full', or case names / patterns)")
    return chosen


def check(impl, *, signature="plain", cases="quick", dtypes=DTYPES, report=True, arrays=None, device=None,
          cos_sin=None, strict=False, skip=(), name=None) -> Report:
    """Run rotary's conformance cases against ``impl`` and return a :class:`Report`.

    Parameters
    ----------
    impl : callable or "package.module:function"
        The implementation, in the form ``signature`` names (for "vllm": a factory ``spec -> module``).
    signature : {"plain", "hf", "flash_attn", "vllm", "mlx"}
        How it is called (see :mod:`rotary.conformance.adapters`).
    cases : "quick", "full", or a list of case names / patterns / ImplCase
    dtypes : the dtypes to run (default fp32, fp16, bf16, fp64); fp32 runs every case, the others a sweep.
    report : True prints the report to stdout, a file object prints it there, False prints nothing.
    arrays : "numpy", "torch", "jax", "cupy" or "mlx"; default the signature's ("plain": NumPy).
    device : torch device for torch arrays.
    cos_sin : for "hf" / "flash_attn": the implementation's own cos/sin instead of rotary's.
    strict : exact angles in every case (no float32-angle allowance).
    skip : fnmatch patterns of case names reported not applicable (what ``impl`` does not implement).
    """
    runner = Runner(impl, signature=signature, arrays=arrays, device=device, cos_sin=cos_sin, strict=strict,
                    skip=skip, name=name)
    results = [runner.run(c) for c in select_cases(cases, dtypes)]
    main = "float32" if "float32" in dtypes else tuple(dtypes)[0]
    runner.precision(main)
    out = Report(runner.name, runner.adapter.name, runner.arrays.name, results, dict(runner._probes))
    if report:
        print(out.format(), file=sys.stdout if report is True else report)
    return out


class ConformanceItem:
    """One case of one implementation, for a pytest parametrization (:func:`conformance_cases`):
    ``run()`` returns its :class:`CaseResult`; ``check()`` skips it (pytest) when not applicable and raises
    AssertionError with the diagnosis when it fails."""

    def __init__(self, runner: Runner, case: ImplCase):
        self.runner, self.case = runner, case

    @property
    def name(self) -> str:
        return self.case.name

    def __repr__(self):
        return f"ConformanceItem({self.case.name!r})"

    def run(self) -> CaseResult:
        return self.runner.run(self.case)

    def check(self) -> CaseResult:
        result = self.run()
        if not result.applicable:
            try:
                import pytest
            except ImportError:
                return result
            pytest.skip(f"{self.case.name}: not applicable: {result.diagnosis}")
        assert result.passed, (f"{self.case.name}: error {result.error:.3g} against the float64 oracle "
                               f"(tolerance {result.tolerance:.2g}): {result.diagnosis}")
        return result


def items(impl, *, signature="plain", cases="quick", dtypes=DTYPES, **options) -> list[ConformanceItem]:
    """One :class:`ConformanceItem` per case, sharing one runner (and its precision probe)."""
    runner = Runner(impl, signature=signature, **options)
    return [ConformanceItem(runner, c) for c in select_cases(cases, dtypes)]


def conformance_cases(impl, *, signature="plain", cases="quick", dtypes=None, **options) -> list:
    """pytest parameters, one per conformance case of ``impl`` (``rotary.conformance.check``'s cases), to run
    them inside a project's own suite::

        @pytest.mark.parametrize("case", rotary.conformance.conformance_cases(my_rope))
        def test_rope_conformance(case):
            case.check()   # skips a case that does not apply; fails with the diagnosis

    ``signature``, ``cases``, ``dtypes`` and the other keywords (``arrays``, ``cos_sin``, ``skip``,
    ``strict``, ``device``) are those of ``rotary.conformance.check``. Each parameter's id is the case name;
    the cases share one runner (and its precision probe, run when a failure needs it).
    """
    import pytest

    return [pytest.param(item, id=item.name)
            for item in items(impl, signature=signature, cases=cases, dtypes=dtypes or DTYPES, **options)]
