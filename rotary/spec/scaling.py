"""Length-extension rules: scaled inverse frequencies and attention factors (float64, host).

Every rule maps the base frequencies ``omega_i = base**(-2i/d)`` (d = rotary_dim,
i = 0..d/2-1) to scaled ones ``omega'_i`` and gives the attention factor ``A`` that HF
multiplies into cos and sin (so logits scale by ``A**2``). Key names and semantics are
HF transformers' (``rope_scaling`` in 4.x, ``rope_parameters`` in 5.x,
``modeling_rope_utils._compute_*_parameters``); everything here is float64 where HF is fp32.

==============  ===========================================================================
rope_type       rule (s = factor, L = max_position_embeddings, L0 = original_max_position_embeddings)
==============  ===========================================================================
default         omega' = omega
linear          omega' = omega / s                                   (position interpolation)
ntk             base' = base * s**(d/(d-2))                          (static NTK-aware, HF 4.4x)
dynamic         base' = base * (s*n/L - (s-1))**(d/(d-2)), n = max(seq_len, L)   (seq_len <= L
                or None: the original frequencies, HF's reset). Stateless: HF's module keeps
                the frequencies of the longest length seen until a call falls back below L;
                here every call uses its own seq_len (keys cached under another length are
                not re-rotated, HF #25104)
yarn            omega' = (omega/s)*(1-E) + omega*E, E = 1 - ramp(low, high); A = attention_factor,
                or g(s, mscale)/g(s, mscale_all_dim) when both are set, else g(s, 1),
                g(s, m) = 0.1*m*ln(s) + 1 (1 if s <= 1)
llama3          by wavelength lambda = 2*pi/omega: lambda < L0/hf keeps omega, lambda > L0/lf gives
                omega/s, in between (inclusive) sigma = (L0/lambda - lf)/(hf - lf) and
                omega' = (1-sigma)*omega/s + sigma*omega; lf == hf (Llama 4): no middle band
longrope        omega'_i = omega_i / f_i, f = long_factor when seq_len > L0 else short_factor;
                A = attention_factor, or sqrt(1 + ln(s)/ln(L0)) (1 if s <= 1)
proportional    omega'_i = base**(-2i/head_dim) / s for i < int(p*head_dim//2), 0 after (p =
                partial_rotary_factor; the spec rotates the whole head, the zero pairs stay put)
==============  ===========================================================================

Public to the package (used by ``_spec.py`` only):

- ``ROPE_TYPES``
- ``canonical_scaling(scaling, *, rotary_dim, head_dim, base, max_position_embeddings)`` -> hashable, validated
- ``scaled_inv_freq(base, rotary_dim, scaling, *, seq_len, max_position_embeddings, head_dim)``
  -> (inv_freq float64 array of length d/2, attention_scaling float)
- ``depends_on_seq_len(scaling)`` -> bool

The canonical form holds the *effective* parameters: HF's defaults are filled in (``beta_fast``
32, ``beta_slow`` 1, ``truncate`` True, a missing ``factor`` = L/L0, a missing
``original_max_position_embeddings`` = L, with a warning for llama3), so two specs compare equal
exactly when they give the same rule, and different parameters never compare equal. Keys a rule
does not use are dropped with a warning (HF warns too). Values past the ranges that keep every
derived quantity finite (``RATIO_MIN`` / ``RATIO_MAX``) are refused, naming the key and the value.
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from collections.abc import Mapping, Sequence

import numpy as np

from .validators import finite_float, is_bool

ROPE_TYPES = ("default", "linear", "ntk", "dynamic", "yarn", "llama3", "longrope", "proportional")

#: Older names HF still reads: Phi-3's first checkpoints wrote ``"su"`` for LongRoPE.
ROPE_TYPE_ALIASES = {"su": "longrope"}

# Keys each rule reads (besides rope_type). Keys marked with defaults in _canonical_* are optional.
_KEYS = {
    "default": (),
    "linear": ("factor",),
    "ntk": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "truncate",
             "attention_factor", "mscale", "mscale_all_dim"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor", "factor", "original_max_position_embeddings", "attention_factor"),
    "proportional": ("factor", "partial_rotary_factor"),
}


# -- validation helpers ----------------------------------------------------------------------------
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _caller_stacklevel() -> int:
    """The ``warnings.warn`` stacklevel of the first frame outside the rotary package (the caller's code),
    for a warning issued by the function that calls this."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    return level


#: the range of the scaling ratios (beta_fast / beta_slow, low / high_freq_factor, mscale, attention_factor,
#: LongRoPE's factors; linear's factor from below): far wider than any released config uses, narrow enough
#: that every derived quantity (inv_freq, YaRN's ramp, the attention factor) stays finite and > 0
RATIO_MIN, RATIO_MAX = 1e-6, 1e6
_IN_RANGE = f"in [{RATIO_MIN:g}, {RATIO_MAX:g}]"
#: the largest original_max_position_embeddings (positions are int64)
_MAX_LENGTH = 2**63 - 1


def _real(params: dict, key: str, rope_type: str, *, minimum: float | None = None, strict: bool = False,
          maximum: float | None = None, what: str | None = None) -> float:
    """params[key] as a finite float, checked against ``minimum`` (``strict``: > instead of >=) and
    ``maximum``; the error names the key, what it must be (``what``) and the value."""
    value = params.get(key)
    bound = "" if minimum is None else f" {'>' if strict else '>='} {minimum:g}"
    need = what or f"a finite number{bound}" + ("" if maximum is None else f" and <= {maximum:g}")
    if value is None:
        raise ValueError(f"scaling['{key}'] is required for rope_type {rope_type!r} ({need})")
    number = finite_float(value)
    if number is None or (minimum is not None and (number <= minimum if strict else number < minimum)) \
            or (maximum is not None and number > maximum):
        raise ValueError(f"scaling['{key}'] must be {need} for rope_type {rope_type!r}; got {value!r}"[:400])
    return number


def _ratio(params: dict, key: str, rope_type: str) -> float:
    """A positive ratio (beta_fast, low_freq_factor, attention_factor, ...) in [RATIO_MIN, RATIO_MAX]."""
    return _real(params, key, rope_type, minimum=RATIO_MIN, maximum=RATIO_MAX,
                 what=f"a finite number > 0 ({_IN_RANGE})")


def _positive_int(value, key: str, rope_type: str) -> int:
    number = finite_float(value)
    if number is not None and number.is_integer() and 1 <= number and int(value) <= _MAX_LENGTH:
        return int(value)
    raise ValueError(f"scaling['{key}'] must be a positive integer (at most 2**63 - 1) for rope_type "
                     f"{rope_type!r}; got {value!r}"[:400])


def _original_length(params: dict, rope_type: str, max_position_embeddings) -> int:
    """L0: ``original_max_position_embeddings``, falling back to ``max_position_embeddings`` like HF."""
    value = params.get("original_max_position_embeddings")
    if value is None:
        if max_position_embeddings is None:
            raise ValueError(f"scaling['original_max_position_embeddings'] is required for rope_type "
                             f"{rope_type!r} (HF falls back to max_position_embeddings, which is not set either)")
        value = max_position_embeddings
        if rope_type == "llama3":   # its band edges are L0 / low_freq_factor and L0 / high_freq_factor
            warnings.warn(f"scaling['original_max_position_embeddings'] is missing for rope_type 'llama3': using "
                          f"max_position_embeddings = {value!r}, as HF 5 does (HF 4 refuses the config); the band "
                          "edges depend on it: set the pre-training context (Llama 3.1: 8192)", UserWarning,
                          stacklevel=_caller_stacklevel())
    return _positive_int(value, "original_max_position_embeddings", rope_type)


def _implicit_factor(params: dict, rope_type: str, original: int, max_position_embeddings) -> float:
    """``factor``, or HF's fallback max_position_embeddings / original_max_position_embeddings."""
    if params.get("factor") is not None:
        return _real(params, "factor", rope_type, minimum=1.0)
    if max_position_embeddings is None:
        raise ValueError(f"scaling['factor'] is required for rope_type {rope_type!r} (or set "
                         "max_position_embeddings, and HF's factor = max_position_embeddings / "
                         "original_max_position_embeddings is used)")
    try:
        return max_position_embeddings / original
    except OverflowError:
        raise ValueError(f"max_position_embeddings / scaling['original_max_position_embeddings'] (HF's factor when "
                         f"scaling['factor'] is not set) = {max_position_embeddings} / {original} is past float's "
                         f"range for rope_type {rope_type!r}") from None


def _factor_list(params: dict, key: str, half: int) -> tuple:
    value = params.get(key)
    if value is None:
        raise ValueError(f"scaling['{key}'] is required for rope_type 'longrope' (a list of rotary_dim/2 = "
                         f"{half} positive numbers)")
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"scaling['{key}'] must be a list of {half} positive numbers; got {type(value).__name__}")
    if len(value) != half:
        raise ValueError(f"scaling['{key}'] must have length rotary_dim/2 = {half}; got length {len(value)}")
    out = []
    for i, v in enumerate(value):
        number = finite_float(v)
        if number is None or not RATIO_MIN <= number <= RATIO_MAX:   # inv_freq / f must stay finite and > 0
            raise ValueError(f"scaling['{key}'] must hold finite numbers > 0 ({_IN_RANGE}) for rope_type "
                             f"'longrope'; got {key}[{i}] = {v!r}"[:400])
        out.append(number)
    return tuple(out)


# -- canonical form --------------------------------------------------------------------------------
def _rope_type_of(params: dict) -> str:
    """HF's lookup: ``rope_type``, else the 4.x key ``type``; aliases resolved."""
    rope_type = params.get("rope_type")
    if rope_type is None:
        rope_type = params.get("type")
    if rope_type is None:
        raise ValueError(f"scaling must have a 'rope_type' key, one of: {', '.join(ROPE_TYPES)}")
    rope_type = ROPE_TYPE_ALIASES.get(rope_type, rope_type) if isinstance(rope_type, str) else rope_type
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"scaling['rope_type'] must be one of: {', '.join(ROPE_TYPES)}; got {rope_type!r}")
    return rope_type


def canonical_scaling(scaling, *, rotary_dim: int, head_dim: int, base: float, max_position_embeddings):
    """Validate ``scaling`` and return its effective parameters as a sorted tuple of (key, value)
    pairs (lists become tuples), or None for no scaling ("default").

    Raises ValueError naming the offending parameter; TypeError when ``scaling`` is not a dict.
    ``rope_theta`` / ``partial_rotary_factor`` inside ``scaling`` (HF 5.x ``rope_parameters``) are
    accepted when they agree with ``base`` / ``rotary_dim``.
    """
    if scaling is None:
        return None
    if isinstance(scaling, tuple):   # a spec's own canonical form: ((key, value), ...)
        if not all(isinstance(kv, tuple) and len(kv) == 2 and isinstance(kv[0], str) for kv in scaling):
            raise TypeError(f"scaling must be a dict like {{'rope_type': 'linear', 'factor': 2.0}} or None, got the "
                            f"tuple {scaling!r}")
        scaling = dict(scaling)
    if not isinstance(scaling, Mapping):
        raise TypeError("scaling must be a dict like {'rope_type': 'linear', 'factor': 2.0} or None, "
                        f"got {type(scaling).__name__}")
    params = {str(k): v for k, v in scaling.items()}
    rope_type = _rope_type_of(params)
    for key in ("rope_type", "type"):
        params.pop(key, None)

    theta = params.pop("rope_theta", None)
    if theta is not None and finite_float(theta) != base:
        raise ValueError(f"scaling['rope_theta'] = {theta!r} disagrees with base = {base!r}")
    if rope_type != "proportional" and params.get("partial_rotary_factor") is not None:
        p = params.pop("partial_rotary_factor")
        number = finite_float(p)
        if number is None or not math.isfinite(head_dim * number) or int(head_dim * number) != rotary_dim:
            raise ValueError(f"scaling['partial_rotary_factor'] = {p!r} disagrees with rotary_dim = {rotary_dim} "
                             f"(HF: rotary_dim = int(head_dim * partial_rotary_factor), head_dim = {head_dim})")

    unknown = sorted(k for k, v in params.items() if k not in _KEYS[rope_type])
    if unknown:
        warnings.warn(f"scaling keys {unknown} are not used by rope_type {rope_type!r} and are ignored "
                      f"(it reads: {', '.join(_KEYS[rope_type]) or 'nothing'})", stacklevel=_caller_stacklevel())
    if rope_type == "default":
        return None
    canonical = _CANONICAL[rope_type](params, rotary_dim=rotary_dim, head_dim=head_dim,
                                      max_position_embeddings=max_position_embeddings)
    canonical["rope_type"] = rope_type
    return tuple(sorted(canonical.items()))


def _canonical_factor_only(rope_type):
    def canonical(params, *, rotary_dim, head_dim, max_position_embeddings):
        if rotary_dim <= 2 and rope_type in ("ntk", "dynamic"):
            raise ValueError(f"rotary_dim must be > 2 for rope_type {rope_type!r} (exponent d/(d-2)); got {rotary_dim}")
        if rope_type == "dynamic" and max_position_embeddings is None:
            raise ValueError("max_position_embeddings is required for rope_type 'dynamic' (the length L in "
                             "base * (factor*n/L - (factor-1))**(d/(d-2)))")
        if rope_type != "linear":
            return {"factor": _real(params, "factor", rope_type, minimum=1.0)}
        factor = _real(params, "factor", rope_type, minimum=RATIO_MIN,   # inv_freq <= 1 / factor stays finite
                       what=f"a finite number > 0 (at least {RATIO_MIN:g}: frequencies up to {1 / RATIO_MIN:g} rad "
                            "per position)")
        if factor < 1.0:   # MLX's scale = 1/factor and ggml's freq_scale > 1 (as HF: warn, accept)
            warnings.warn(f"scaling['factor'] = {factor!r} < 1 for rope_type 'linear' speeds the rotation up "
                          "(positions * 1/factor) instead of stretching the context", stacklevel=_caller_stacklevel())
        return {"factor": factor}
    return canonical


def _canonical_yarn(params, *, rotary_dim, head_dim, max_position_embeddings):
    original = _original_length(params, "yarn", max_position_embeddings)
    out = {"original_max_position_embeddings": original,
           "factor": _implicit_factor(params, "yarn", original, max_position_embeddings)}
    if out["factor"] < 1.0:
        raise ValueError(f"scaling['factor'] must be >= 1 for rope_type 'yarn'; max_position_embeddings / "
                         f"original_max_position_embeddings gives {out['factor']!r}")
    # HF reads `beta_fast or 32`, `beta_slow or 1`: a 0 (or None) means the default.
    for key, default in (("beta_fast", 32.0), ("beta_slow", 1.0)):
        out[key] = _ratio(params, key, "yarn") if params.get(key) else default
    if out["beta_fast"] < out["beta_slow"]:
        raise ValueError(f"scaling['beta_fast'] ({out['beta_fast']:g}) must be >= scaling['beta_slow'] "
                         f"({out['beta_slow']:g}) for rope_type 'yarn'")
    truncate = params.get("truncate", True)
    if not is_bool(truncate):
        raise ValueError(f"scaling['truncate'] must be True or False for rope_type 'yarn'; got {truncate!r}")
    out["truncate"] = bool(truncate)
    if params.get("attention_factor") is not None:
        out["attention_factor"] = _ratio(params, "attention_factor", "yarn")
    for key in ("mscale", "mscale_all_dim"):
        if params.get(key) is not None:
            out[key] = _real(params, key, "yarn", minimum=0.0, maximum=RATIO_MAX)   # 0.1*m*ln(s) + 1 stays > 0
    return out


def _canonical_llama3(params, *, rotary_dim, head_dim, max_position_embeddings):
    out = {"factor": _real(params, "factor", "llama3", minimum=1.0),
           "low_freq_factor": _ratio(params, "low_freq_factor", "llama3"),
           "high_freq_factor": _ratio(params, "high_freq_factor", "llama3"),
           "original_max_position_embeddings": _original_length(params, "llama3", max_position_embeddings)}
    if out["high_freq_factor"] < out["low_freq_factor"]:
        raise ValueError(f"scaling['high_freq_factor'] ({out['high_freq_factor']:g}) must be >= "
                         f"scaling['low_freq_factor'] ({out['low_freq_factor']:g}) for rope_type 'llama3'")
    return out


def _canonical_longrope(params, *, rotary_dim, head_dim, max_position_embeddings):
    half = rotary_dim // 2
    original = _original_length(params, "longrope", max_position_embeddings)
    out = {"short_factor": _factor_list(params, "short_factor", half),
           "long_factor": _factor_list(params, "long_factor", half),
           "original_max_position_embeddings": original}
    # s only sets the attention factor (A = 1 for s <= 1), so any s > 0 is accepted, as in HF.
    if params.get("factor") is not None:
        out["factor"] = _real(params, "factor", "longrope", minimum=0.0, strict=True)
    else:
        out["factor"] = _implicit_factor(params, "longrope", original, max_position_embeddings)
    if params.get("attention_factor") is not None:
        out["attention_factor"] = _ratio(params, "attention_factor", "longrope")
    elif out["factor"] > 1.0 and original < 2:
        raise ValueError(f"scaling['original_max_position_embeddings'] must be >= 2 for rope_type 'longrope' (its "
                         f"attention factor is sqrt(1 + ln(factor) / ln(original))); got {original}")
    return out


def _canonical_proportional(params, *, rotary_dim, head_dim, max_position_embeddings):
    if rotary_dim // 2 != head_dim // 2:
        raise ValueError(f"rope_type 'proportional' rotates the whole head (rotary_dim = {head_dim - head_dim % 2}); "
                         f"got rotary_dim = {rotary_dim}. Its partial_rotary_factor goes in scaling")
    out = {"factor": _real(params, "factor", "proportional", minimum=1.0) if params.get("factor") is not None else 1.0,
           "partial_rotary_factor": 1.0}
    if params.get("partial_rotary_factor") is not None:
        out["partial_rotary_factor"] = _real(params, "partial_rotary_factor", "proportional", minimum=0.0,
                                             what="a number in [0, 1]")
        if out["partial_rotary_factor"] > 1.0:
            raise ValueError("scaling['partial_rotary_factor'] must be a number in [0, 1] for rope_type "
                             f"'proportional'; got {out['partial_rotary_factor']!r}")
    return out


_CANONICAL = {
    "linear": _canonical_factor_only("linear"),
    "ntk": _canonical_factor_only("ntk"),
    "dynamic": _canonical_factor_only("dynamic"),
    "yarn": _canonical_yarn,
    "llama3": _canonical_llama3,
    "longrope": _canonical_longrope,
    "proportional": _canonical_proportional,
}


def depends_on_seq_len(scaling) -> bool:
    """True for the rules whose frequencies change with the sequence length (dynamic, longrope)."""
    return scaling is not None and dict(scaling)["rope_type"] in ("dynamic", "longrope")


# -- the rules -------------------------------------------------------------------------------------
def _base_inv_freq(base: float, rotary_dim: int) -> np.ndarray:
    """omega_i = base**(-2i/d), i = 0..d/2-1, float64."""
    return 1.0 / (float(base) ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim))


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's g(s, m) = 0.1*m*ln(s) + 1, and 1 for s <= 1."""
    return 1.0 if scale <= 1.0 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_correction_range(base: float, rotary_dim: int, original: int, beta_fast: float, beta_slow: float,
                          truncate: bool = True) -> tuple[float, float]:
    """(low, high) pair indices of YaRN's ramp, HF's ``find_correction_range``.

    corr(r) = d*ln(L0/(2*pi*r)) / (2*ln(base)); low = corr(beta_fast), high = corr(beta_slow),
    floor/ceil when ``truncate``, then low = max(low, 0), high = min(high, d-1).
    """
    def corr(rotations):
        return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = corr(beta_fast), corr(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, rotary_dim - 1)


def _yarn(inv_freq, p, *, base, rotary_dim, **_):
    factor = p["factor"]
    low, high = yarn_correction_range(base, rotary_dim, p["original_max_position_embeddings"],
                                      p["beta_fast"], p["beta_slow"], p["truncate"])
    if low == high:
        high += 0.001  # HF: prevent a 0/0 ramp
    ramp = np.clip((np.arange(rotary_dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    extrapolation = 1.0 - ramp
    scaled = (inv_freq / factor) * (1.0 - extrapolation) + inv_freq * extrapolation
    if "attention_factor" in p:
        attention = p["attention_factor"]
    elif p.get("mscale") and p.get("mscale_all_dim"):
        attention = yarn_mscale(factor, p["mscale"]) / yarn_mscale(factor, p["mscale_all_dim"])
    else:
        attention = yarn_mscale(factor)
    return scaled, attention


def _llama3(inv_freq, p, **_):
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    original = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = original / low, original / high      # low_wavelen >= high_wavelen
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    if high > low:
        smooth = (original / wavelen[medium] - low) / (high - low)
        scaled[medium] = (1 - smooth) * inv_freq[medium] / factor + smooth * inv_freq[medium]
    else:  # Llama 4 (low == high): the band is one wavelength; like vLLM, sigma = 0 there
        scaled[medium] = inv_freq[medium] / factor
    return scaled, 1.0


def _longrope(inv_freq, p, *, seq_len, **_):
    original, factor = p["original_max_position_embeddings"], p["factor"]
    ext = p["long_factor"] if seq_len is not None and seq_len > original else p["short_factor"]
    if "attention_factor" in p:
        attention = p["attention_factor"]
    elif factor <= 1.0:
        attention = 1.0
    else:
        attention = math.sqrt(1.0 + math.log(factor) / math.log(original))
    return inv_freq / np.asarray(ext, dtype=np.float64), attention


def _dynamic(inv_freq, p, *, base, rotary_dim, seq_len, max_position_embeddings, **_):
    if seq_len is None or seq_len <= max_position_embeddings:
        return inv_freq, 1.0
    factor = p["factor"]
    new_base = base * ((factor * seq_len / max_position_embeddings) - (factor - 1)) ** (rotary_dim / (rotary_dim - 2))
    return _base_inv_freq(new_base, rotary_dim), 1.0


def _proportional(inv_freq, p, *, base, head_dim, **_):
    rotated = int(p["partial_rotary_factor"] * head_dim // 2)
    scaled = np.zeros(head_dim // 2, dtype=np.float64)
    scaled[:rotated] = 1.0 / (base ** (np.arange(0, 2 * rotated, 2, dtype=np.float64) / head_dim))
    return scaled / p["factor"], 1.0


_RULES = {
    "linear": lambda inv_freq, p, **_: (inv_freq / p["factor"], 1.0),
    "ntk": lambda inv_freq, p, *, base, rotary_dim, **_: (
        _base_inv_freq(base * p["factor"] ** (rotary_dim / (rotary_dim - 2)), rotary_dim), 1.0),
    "dynamic": _dynamic,
    "yarn": _yarn,
    "llama3": _llama3,
    "longrope": _longrope,
    "proportional": _proportional,
}


def scaled_inv_freq(base: float, rotary_dim: int, scaling, *, seq_len, max_position_embeddings, head_dim):
    """Return (inv_freq, attention_scaling): omega_i = base**(-2i/d), then the rule of ``scaling``.

    ``seq_len`` is HF's ``max(position_ids) + 1`` (None: the model's original context); only
    "dynamic" and "longrope" read it.
    """
    inv_freq = _base_inv_freq(base, rotary_dim)
    if scaling is None:
        return inv_freq, 1.0
    params = dict(scaling)
    return _RULES[params["rope_type"]](inv_freq, params, base=float(base), rotary_dim=rotary_dim, head_dim=head_dim,
                                       seq_len=seq_len, max_position_embeddings=max_position_embeddings)
