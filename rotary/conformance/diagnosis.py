"""What a failing implementation does instead: alternative conventions and the precision of its angles.

:func:`hypotheses` lists, for one case, the conventions implementations are known to follow instead of
the spec's (the other pairing, positions shifted by one, the inverse direction, a scaling rule without
its attention factor, NTK base formula variants, YaRN ramp rounding, LongRoPE's factor switch, partial
rotary with the head size as exponent denominator, ...), each as a spec + positions + direction the
float64 oracle is re-run with; ``rotary.conformance.check`` reports the first that the implementation
matches within the case's tolerance (pairs of the structural ones when no single one does).

:func:`fit_precision` reads the error of a rotation at offsets from 4 to 2**31 (the precision probe)
and says in what precision the angles were formed: the error of angles rounded to a float format grows
as ``position * |omega| * 2**-p`` (p = 24 for float32, 11 for float16, 8 for bfloat16, 53 for float64),
exact angles keep it flat.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np

from ..spec import scaling as _scaling
from ..spec.rope_spec import RopeSpec

#: rule names as people write them
RULE_NAMES = {"yarn": "YaRN", "longrope": "LongRoPE", "llama3": "llama3", "linear": "linear", "ntk": "NTK",
              "dynamic": "dynamic NTK", "proportional": "proportional"}


@dataclasses.dataclass(frozen=True)
class Hypothesis:
    """One alternative convention: the oracle re-run with ``spec``, ``positions`` and ``inverse``."""

    message: str
    spec: RopeSpec
    positions: np.ndarray
    inverse: bool
    family: str = ""              # "layout", "shift", "direction", "attention", "scaling": one of each combines


def _seq_len(positions) -> int:
    return int(np.floor(np.max(positions))) + 1


def _with_frequencies(spec: RopeSpec, freqs, attention: float, **changes) -> RopeSpec:
    """``spec`` with explicit per-pair frequencies and attention factor (its layout, head, offset kept)."""
    kwargs = dict(rotary_dim=2 * len(freqs), layout=spec.layout, rotary_offset=spec.rotary_offset)
    kwargs.update(changes)
    return RopeSpec(spec.head_dim, frequencies=np.asarray(freqs, np.float64), attention_factor=attention, **kwargs)


def _base_freqs(base: float, rotary_dim: int, denominator: int | None = None) -> np.ndarray:
    return 1.0 / base ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / (denominator or rotary_dim))


def _rule(spec: RopeSpec) -> str:
    return RULE_NAMES.get(spec.rope_type, spec.rope_type)


def hypotheses(spec: RopeSpec, positions, inverse: bool) -> list[Hypothesis]:
    """The alternative conventions worth trying for a case of ``spec`` at ``positions``."""
    P = np.asarray(positions)
    n = _seq_len(P)
    w, A = spec.inv_freq(n), spec.attention_scaling_at(n)
    d = spec.rotary_dim
    out = []

    def add(message, alt_spec=spec, alt_positions=P, alt_inverse=inverse, family=""):
        out.append(Hypothesis(message, alt_spec, alt_positions, alt_inverse, family))

    other = "interleaved" if spec.layout == "half" else "half"
    pairs = "pairs (2i, 2i+1)" if other == "interleaved" else "pairs (i, i+d/2)"
    add(f"{pairs}: layout={other!r} (the spec's layout is {spec.layout!r})", spec.replace(layout=other),
        family="layout")
    fixed = _with_frequencies(spec, w, A) if spec.depends_on_seq_len else spec   # frequencies of the true length
    add("positions shifted by one: position p rotated as p+1", fixed, P + 1, family="shift")
    add("positions shifted by one: position p rotated as p-1", fixed, P - 1, family="shift")
    add("rotates by -theta: the inverse direction (sin's sign flipped)" if not inverse else
        "rotates by +theta where the inverse (-theta) was asked for", alt_inverse=not inverse, family="direction")
    if A != 1.0:
        name = _rule(spec) if spec.scaling is not None else "custom frequencies"
        add(f"{name} without the attention factor: cos and sin not multiplied by {A:.6g}",
            _with_frequencies(spec, w, 1.0), family="attention")
        add(f"{name} with the attention factor applied twice ({A:.6g}**2 = {A * A:.6g})",
            _with_frequencies(spec, w, A * A))
    if spec.scaling is not None:
        add(f"plain RoPE frequencies: the {_rule(spec)} rule ({spec.rope_type!r}) is not applied",
            spec.replace(scaling=None, max_position_embeddings=None), family="scaling")
        out += _rule_variants(spec, P, w, A, n, inverse)
    if spec.frequencies is None and spec.scaling is None and d < spec.head_dim - spec.rotary_offset:
        full = spec.head_dim - spec.rotary_offset
        add(f"frequencies base**(-2i/{full}): the head size, not rotary_dim={d}, as the exponent's denominator",
            _with_frequencies(spec, _base_freqs(spec.base, d, full), A))
        add(f"the whole head rotates: rotary_dim={d} ignored", spec.replace(rotary_dim=full - full % 2))
    return out


def _rule_variants(spec: RopeSpec, P, w, A, n, inverse) -> list[Hypothesis]:
    """Known variants of the spec's scaling rule (NTK base formulas, YaRN's ramp and factor, LongRoPE's switch)."""
    p = spec.scaling_dict
    d, b = spec.rotary_dim, spec.base
    rule = spec.rope_type
    out = []

    def add(message, alt_spec):
        out.append(Hypothesis(message, alt_spec, P, inverse))

    if rule == "ntk":
        s = p["factor"]
        add(f"NTK base b*s = {b * s:g} without the d/(d-2) exponent (the spec's base is b*s**(d/(d-2)) = "
            f"{b * s ** (d / (d - 2)):g})", _with_frequencies(spec, _base_freqs(b * s, d), A))
        add(f"NTK base b*s**(d/(d-2)) with d = head_dim {spec.head_dim} rather than rotary_dim {d}",
            _with_frequencies(spec, _base_freqs(b * s ** (spec.head_dim / (spec.head_dim - 2)), d), A))
    elif rule == "dynamic":
        s, L = p["factor"], spec.max_position_embeddings
        static = b * s ** (d / (d - 2))
        add(f"static NTK: base b*s**(d/(d-2)) = {static:g} at every length, not dynamic NTK's "
            "b*(s*n/L - (s-1))**(d/(d-2)) for n = max position + 1 > L",
            _with_frequencies(spec, _base_freqs(static, d), A))
        once = b * (s * s - s + 1) ** (d / (d - 2))
        add(f"dynamic NTK computed once for L*s positions: base b*(s**2 - s + 1)**(d/(d-2)) = {once:g} "
            "(vLLM's DynamicNTKScalingRotaryEmbedding)", _with_frequencies(spec, _base_freqs(once, d), A))
        if n > L:
            flat = b * (s * n / L - (s - 1))
            add(f"dynamic NTK base b*(s*n/L - (s-1)) = {flat:g} without the d/(d-2) exponent",
                _with_frequencies(spec, _base_freqs(flat, d), A))
            if spec.head_dim != d:
                wide = b * ((s * n / L) - (s - 1)) ** (spec.head_dim / (spec.head_dim - 2))
                add("dynamic NTK exponent d/(d-2) with d = head_dim rather than rotary_dim",
                    _with_frequencies(spec, _base_freqs(wide, d), A))
    elif rule == "yarn":
        truncate = p.get("truncate", True)
        add("YaRN ramp bounds not rounded to integers (truncate=False)" if truncate else
            "YaRN ramp bounds rounded to integers (truncate=True)", spec.replace(scaling=dict(p, truncate=not truncate)))
        plain = _scaling.yarn_mscale(p["factor"])
        if not math.isclose(plain, A) and "attention_factor" not in p:
            add(f"YaRN attention factor 0.1*ln(s)+1 = {plain:.6g} instead of the mscale ratio {A:.6g}",
                _with_frequencies(spec, w, plain))
    elif rule == "longrope":
        original = p["original_max_position_embeddings"]
        if n > original:
            add(f"LongRoPE short_factor used beyond original_max_position_embeddings={original} (the sequence "
                f"reaches {n} positions)", spec.replace(scaling=dict(p, long_factor=p["short_factor"])))
        else:
            add(f"LongRoPE long_factor used within original_max_position_embeddings={original}",
                spec.replace(scaling=dict(p, short_factor=p["long_factor"])))
    return out


def combined(single: list[Hypothesis], spec: RopeSpec, positions, inverse) -> list[Hypothesis]:
    """Two hypotheses of different families applied together (e.g. the other pairing and shifted
    positions); spec changes compose only with the layout."""
    P = np.asarray(positions)
    out = []
    for a, b in itertools.combinations([h for h in single if h.family], 2):
        if a.family == b.family:
            continue
        moved = [h for h in (a, b) if h.spec is not spec]
        if len(moved) == 2:
            layout = next((h for h in moved if h.family == "layout"), None)
            if layout is None:
                continue
            other = moved[0] if moved[1] is layout else moved[1]
            alt_spec = other.spec.replace(layout=layout.spec.layout)
        else:
            alt_spec = moved[0].spec if moved else spec
        alt_pos = a.positions + b.positions - P
        alt_inv = inverse ^ (a.inverse != inverse) ^ (b.inverse != inverse)
        out.append(Hypothesis(f"{a.message}; and {b.message}", alt_spec, alt_pos, alt_inv))
    return out


# -- precision of the angles -----------------------------------------------------------------------
#: the precision probe's offsets (the rotation of 4 tokens from each)
PROBE_OFFSETS = (4, 16, 128, 1024, 8192, 65536, 131072, 1 << 20, 1 << 23, 1 << 26, 1 << 29, (1 << 31) - 4)
#: float formats by significand bits (the relative rounding of an angle formed in them is 2**-bits)
FORMATS = (("fp64", 53), ("fp32", 24), ("fp16", 11), ("bf16", 8))


@dataclasses.dataclass
class PrecisionFit:
    """Error of a rotation against position (the precision probe) and what it says about the angles.

    ``angles`` is "exact" (the error stays at the output's rounding), one of "fp64", "fp32", "fp16",
    "bf16" (the error grows as position x 2**-bits of that format), "fp16 positions" / "bf16 positions"
    (exact until positions stop being representable, then off by radians), "inexact" (off by radians
    from some position on, format not named), "flat" (an error above the output's rounding that does not
    grow with position: coarser arithmetic, not the angles), or "unknown"."""

    dtype: str
    positions: list
    errors: list
    units: list                    # max |pair| * |angle| of each probe point (the error of a unit angle error)
    magnitudes: list = dataclasses.field(default_factory=list)   # max |pair| of each probe point
    angles: str = "unknown"
    exponent: float | None = None  # log2 of the fitted relative angle error
    message: str = ""

    @property
    def inexact(self) -> bool:
        return self.angles not in ("exact", "unknown", "flat")

    @property
    def named(self) -> bool:
        """True when the fit names the format the angles (or positions) were formed in."""
        return self.inexact and self.angles != "inexact"


#: integers a float format holds exactly (positions formed in it are rounded beyond)
EXACT_INTEGERS = (("fp16", 2048), ("bf16", 256))


def _jump(exact_to: int, off_from: int, tail: str) -> tuple[str, str]:
    """(angles class, message) of an error at the output's rounding up to ``exact_to`` and off by radians
    from ``off_from`` on: positions rounded to a narrow format, or angles too coarse for the probe's dtype."""
    for name, top in EXACT_INTEGERS:
        if exact_to < 4 * top and top < off_from:
            return (f"{name} positions", f"positions formed in {name}: exact up to position {exact_to}, off by "
                    f"radians from {off_from} on ({name} holds integers exactly only up to {top}){tail}")
    return "inexact", (f"angles not exact: error at the output's rounding up to position {exact_to}, off by radians "
                       f"from {off_from} on{tail}")


def fit_precision(dtype: str, positions, errors, units, atol: float) -> PrecisionFit:
    """Fit the probe's errors: the relative angle error ``err / (|pair| |angle|)`` where the error is above
    the output's rounding and below saturation (angles off by a radian or more)."""
    fit = PrecisionFit(dtype, list(positions), list(errors), list(units))
    pts = [(p, e, u) for p, e, u in zip(positions, errors, units) if np.isfinite(e) and 8 * atol < e < 0.25]
    finite = [(p, e) for p, e in zip(positions, errors) if np.isfinite(e)]
    nonfinite = [p for p, e in zip(positions, errors) if not np.isfinite(e)]
    tail = f", NaN or inf from position {min(nonfinite)} on" if nonfinite else ""
    if not positions:
        fit.message = "precision not measured: no probe call ran"
        return fit
    if not finite:
        fit.message = "precision not measured: every probe output is NaN or inf"
        return fit
    if not pts:
        small = [p for p, e in finite if e <= 8 * atol]
        large = [p for p, e in finite if e > 8 * atol]
        if not large:
            fit.angles = "exact"
            fit.message = (f"angles exact: error flat in position up to {max(small)} "
                           f"(max {max(e for _, e in finite):.1e}){tail}")
        elif small and min(large) > max(small):
            fit.angles, fit.message = _jump(max(small), min(large), tail)
        else:
            fit.message = "precision not measured: the error is large from the smallest probe position on"
        return fit
    if len(pts) >= 2:   # angle errors grow with |angle|; a flat error is the arithmetic's, not the angles'
        slope = np.polyfit(np.log([u for _, _, u in pts]), np.log([e for _, e, _ in pts]), 1)[0]
        if slope < 0.5:
            fit.angles = "flat"
            fit.message = (f"error flat in position at about {np.median([e for _, e, _ in pts]):.0e}, above "
                           f"{dtype}'s rounding: computed in a coarser precision than the data{tail}")
            return fit
    rel = np.median([e / u for _, e, u in pts])
    fit.exponent = float(np.log2(rel))
    bits = -fit.exponent
    name, nominal = min(FORMATS, key=lambda f: abs(f[1] - bits))
    if abs(nominal - bits) > 4:
        fit.message = f"error grows with position as position x 2^{fit.exponent:.1f} (no float format fits){tail}"
        return fit
    fit.angles = name
    at = dict(finite).get(131072)
    where = f"{at:.0e} at 131072" if at is not None else f"{pts[-1][1]:.0e} at {pts[-1][0]}"
    fit.message = f"angles formed in {name}: error grows as position x 2^-{nominal}, {where}{tail}"
    return fit
