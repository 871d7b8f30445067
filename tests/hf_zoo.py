"""Walk every text ``*RotaryEmbedding`` class of the installed transformers and compare it with rotary.

Used by tests/test_hf_zoo.py and runnable as a script (``python -m tests.hf_zoo``) for a report.
Each class is built from its model's default config (each layer type it holds); HF's cos/sin at
positions 0..63 are compared with ``RopeSpec.from_hf_config(config, layer_type=...)``'s, and rotary's
cos/sin at large positions with exact float64 angles from HF's own inv_freq.
"""

from __future__ import annotations

import importlib
import inspect
import math
import os
import re
import warnings
from dataclasses import dataclass, field

import numpy as np

#: classes whose HF module is broken with its default config, with the reason (skipped and listed)
EXCEPTIONS: dict[str, str] = {
    "HunYuanVLRotaryEmbedding": "HF's forward needs rope_parameters['mrope_section'], which the default config lacks "
                                "(no default in the module); with a section its XD-RoPE is not a rotation on image "
                                "tokens (tests/test_hf_broken_defaults.py shows both, and rotary's errors)",
}


#: classes HF builds from another config than their annotation says (module: config class it is built from)
BUILT_WITH = {"Qwen3OmniMoeRotaryEmbedding": "Qwen3OmniMoeTalkerCodePredictorConfig"}


def _set_rope(**changes):
    def fix(config):
        config.rope_parameters = {**config.rope_parameters, **changes}
    return fix


def _set_attr(**changes):
    def fix(config):
        for k, v in changes.items():
            setattr(config, k, v)
    return fix


def _rope_per_layer_type(**params):
    def fix(config):
        config.rope_parameters = {lt: {"rope_type": "default", **params} for lt in sorted(set(config.layer_types))}
    return fix


#: default configs HF's own module cannot run (or that give a head HF's attention cannot rotate), made
#: consistent with the released checkpoints: (what is changed and why, fix(config))
CONFIG_FIXES = {
    "CohereCompassRotaryEmbedding": ("rope_parameters per layer type (default, theta 10000): the default text config's "
                                     "rope_parameters is empty and HF's __init__ raises KeyError 'full_attention'",
                                     _rope_per_layer_type(rope_theta=10000.0)),
    "Glm4vTextRotaryEmbedding": ("partial_rotary_factor 0.5 (GLM-4.1V): the default mrope_section [8, 12, 12] sums "
                                 "to 32 pairs, the default head 64 pairs, and HF's forward raises",
                                 _set_rope(partial_rotary_factor=0.5)),
    "GlmImageTextRotaryEmbedding": ("partial_rotary_factor 0.5 (as GLM-4.1V): the default mrope_section sums to 32 "
                                    "pairs, the default head 64, and HF's forward raises",
                                    _set_rope(partial_rotary_factor=0.5)),
    "Glm4vMoeTextRotaryEmbedding": ("head_dim 128 (GLM-4.5V): the default hidden 4096 / 96 heads gives 21 rotary "
                                    "dims, 11 pairs, against mrope_section's 32, and HF's forward raises",
                                    _set_attr(head_dim=128)),
    "Qwen3OmniMoeThinkerTextRotaryEmbedding": ("head_dim 128 (Qwen3-Omni): the default 2048 / 28 heads gives head "
                                               "73, and HF rotates 74 coordinates", _set_attr(head_dim=128)),
    "Qwen3OmniMoeRotaryEmbedding": ("head_dim 128 (Qwen3-Omni): the default 2048 / 28 heads gives head 73, and HF "
                                    "rotates 74 coordinates", _set_attr(head_dim=128)),
    "Qwen3OmniMoeTalkerRotaryEmbedding": ("head_dim 128 (Qwen3-Omni): the default 2048 / 28 heads gives head 73, and "
                                          "HF rotates 74 coordinates", _set_attr(head_dim=128)),
}

SMALL = np.arange(64)
INV_FREQ_RTOL = 2e-6   # HF computes base ** (2i/d) in float32
LARGE = np.array([4095, 65_537, 1_000_003, 123_456_789, 2**31 - 1])


@dataclass
class Case:
    family: str                # model directory name, e.g. "llama"
    name: str                  # class name
    config: object = None      # the config the module was built from
    layer_types: list = field(default_factory=list)   # [None] or the per-layer-type keys
    module: object = None
    error: str | None = None   # why HF's own class could not be built


def _is_text_class(cls_name: str, config_cls) -> bool:
    cfg = getattr(config_cls, "__name__", "")
    return not (re.search(r"Vision(?!Text)|ViT", cls_name) or re.search(r"Vision(Encoder)?Config$", cfg))


def _candidate_configs(config):
    yield config
    seen = {id(config)}
    for getter in ("get_text_config",):
        try:
            sub = getattr(config, getter)()
        except Exception:  # noqa: BLE001
            sub = None
        if sub is not None and id(sub) not in seen:
            seen.add(id(sub))
            yield sub
    for value in vars(config).values():
        if hasattr(value, "to_dict") and hasattr(value, "model_type") and id(value) not in seen:
            seen.add(id(value))
            yield value


def rotary_classes():
    """[(family, module name, class name)] of every ``*RotaryEmbedding`` class in transformers' model files."""
    import transformers.models as models

    root = os.path.dirname(models.__file__)
    found = []
    for family in sorted(os.listdir(root)):
        folder = os.path.join(root, family)
        if not os.path.isdir(folder):
            continue
        for fname in sorted(os.listdir(folder)):
            if fname.startswith("modeling_") and fname.endswith(".py"):
                with open(os.path.join(folder, fname), encoding="utf-8") as fh:
                    names = re.findall(r"^class (\w*RotaryEmbedding\w*)\(", fh.read(), re.M)
                found += [(family, f"transformers.models.{family}.{fname[:-3]}", n) for n in names]
    return found


def build(family, module_name, cls_name) -> Case | None:
    """The HF module built from its default config, or a Case with ``error``; None for a non-text class."""
    import torch  # noqa: F401

    case = Case(family, cls_name)
    try:
        mod = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001
        case.error = f"import: {type(exc).__name__}: {exc}"
        return case
    cls = getattr(mod, cls_name)
    params = list(inspect.signature(cls.__init__).parameters.values())
    config_cls = params[1].annotation if len(params) > 1 else None
    if cls_name in BUILT_WITH:
        config_cls = getattr(importlib.import_module(module_name.replace(".modeling_", ".configuration_")),
                             BUILT_WITH[cls_name])
    forward = list(inspect.signature(cls.forward).parameters)[1:]
    if not isinstance(config_cls, type) or not _is_text_class(cls_name, config_cls) \
            or forward[:2] != ["x", "position_ids"]:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            top = config_cls()
    except Exception as exc:  # noqa: BLE001
        case.error = f"default config: {type(exc).__name__}: {exc}"
        return case
    errors = []
    for config in _candidate_configs(top):
        try:
            if cls_name in CONFIG_FIXES:
                CONFIG_FIXES[cls_name][1](config)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                case.module = cls(config)
            case.config = config
            break
        except Exception as exc:  # noqa: BLE001
            errors.append(f"{type(config).__name__}: {type(exc).__name__}: {exc}")
    if case.module is None:
        case.error = "init: " + "; ".join(errors)
        return case
    buffers = dict(case.module.named_buffers())
    per_type = sorted(k[: -len("_inv_freq")] for k in buffers if k.endswith("_inv_freq") and "original" not in k)
    case.layer_types = per_type if "layer_type" in forward and per_type else [None]
    return case


def _n_axes(case: Case) -> int:
    """Position axes HF's module expands position_ids to (M-RoPE: 3, NeoMME: 2), 1 for 1-D RoPE."""
    src = inspect.getsource(type(case.module).forward)
    m = re.search(r"position_ids\.expand\((\d+|len\(self\.mrope_section\))", src)
    if not m:
        return 1
    return 3 if not m.group(1).isdigit() else int(m.group(1))


def hf_cos_sin(case: Case, layer_type, positions):
    """HF's per-pair (cos, sin) for 1-D positions (S,) or multi-axis positions (S, n), float64 (S, pairs).

    HF's modules return cat(f, f) or repeat_interleave(f, 2) (each pair's value twice), one value per
    pair (GPT-OSS; GPT-J returns (sin, cos)), or complex ``cos + i sin`` (DeepSeek-V2, Llama 4).
    """
    import torch

    pos = torch.as_tensor(np.asarray(positions))
    pos = pos.T[:, None, :] if pos.ndim == 2 else pos[None]
    x = torch.zeros(1, dtype=torch.float32)
    kwargs = {} if layer_type is None else {"layer_type": layer_type}
    with torch.no_grad():
        out = case.module(x, pos, **kwargs)
    if torch.is_tensor(out) and out.is_complex():
        cos, sin = out.real, out.imag
    else:
        cos, sin = out[0], out[1]
    while cos.ndim > 2:
        cos, sin = cos[0], sin[0]
    cos, sin = cos.double().numpy(), sin.double().numpy()
    if np.all(cos[0] == 0) and np.all(sin[0] != 0):   # (sin, cos) order: position 0 has sin 0, cos 1
        cos, sin = sin, cos
    return cos, sin


def hf_inv_freq(case: Case, layer_type):
    """HF's per-pair frequencies and attention factor; M-RoPE modules' buffers are mapped through their
    own ``recomposition_frequencies`` (ERNIE-4.5-VL stores them permuted)."""
    name = "inv_freq" if layer_type is None else f"{layer_type}_inv_freq"
    buf = dict(case.module.named_buffers()).get(name)
    scale = getattr(case.module, "attention_scaling" if layer_type is None else f"{layer_type}_attention_scaling", 1.0)
    if buf is None:
        return None, float(scale)
    recompose = getattr(case.module, "recomposition_frequencies", None)
    if recompose is not None:
        n = _n_axes(case)
        freq = buf.double()[None, None, None, :].expand(n, 1, 1, -1).clone()
        args = (freq,) if layer_type is None else (freq, layer_type)
        try:
            emb = recompose(*args)
        except TypeError:
            emb = recompose(freq)
        emb = emb.reshape(-1, emb.shape[-1]).numpy()
        c, _ = _pairs_of(emb, emb, case.name)
        return c[0], float(scale)
    return buf.double().numpy(), float(scale)


def _pairs_of(cos, sin, name):
    """HF's per-pair values: its emb holds each pair's value twice, as cat(f, f) or repeat_interleave(f, 2)."""
    d = cos.shape[-1]
    if d % 2 == 0 and np.array_equal(cos[:, : d // 2], cos[:, d // 2:]) and np.array_equal(sin[:, : d // 2], sin[:, d // 2:]):
        return cos[:, : d // 2], sin[:, : d // 2]
    if d % 2 == 0 and np.array_equal(cos[:, 0::2], cos[:, 1::2]) and np.array_equal(sin[:, 0::2], sin[:, 1::2]):
        return cos[:, 0::2], sin[:, 0::2]
    raise AssertionError(f"{name}: HF's cos/sin of width {d} is neither cat(f, f) nor repeat_interleave(f, 2)")


def positions_for(spec, values):
    """1-D positions, or 3-axis positions with distinct t/h/w coordinates for an M-RoPE spec."""
    values = np.asarray(values, dtype=np.int64)
    if not spec.multi_axis:
        return values
    return np.stack([values, values // 3 + 1, (values * 7) % 1000003 // 2][: spec.n_axes], axis=-1)


def compare(case: Case, layer_type, spec) -> list[str]:
    """Mismatches between HF's module and ``spec`` (empty when they agree)."""
    import rotary

    name = case.name + ("" if layer_type is None else f"[{layer_type}]")
    problems = []
    hf_freq, hf_scale = hf_inv_freq(case, layer_type)
    if spec.n_axes != _n_axes(case):
        return [f"HF's module reads {_n_axes(case)} position axes, the spec {spec.n_axes}"]
    if not math.isclose(spec.attention_scaling, hf_scale, rel_tol=1e-6):
        problems.append(f"attention scaling {spec.attention_scaling} != HF's {hf_scale}")
    half = spec.rotary_dim // 2
    small = positions_for(spec, SMALL)
    cos, sin = hf_cos_sin(case, layer_type, small)
    if _backwards(case):   # HF's rotate_half gives (x2, -x1): its pairs turn by -theta
        sin = -sin
        hf_freq = None if hf_freq is None else -hf_freq
    if cos.shape[-1] == (half if hf_freq is None else hf_freq.shape[0]):
        hf_c, hf_s = cos, sin       # one value per pair
    else:
        hf_c, hf_s = _pairs_of(cos, sin, name)
    if hf_c.shape[-1] != half:
        return problems + [f"HF rotates {2 * hf_c.shape[-1]} dims, rotary {spec.rotary_dim}"]
    ours_c, ours_s = spec.cos_sin(small, dtype=np.float64)
    # HF's fp32 angles p * inv_freq carry ~p * 1e-7 error at positions <= 63
    err = max(np.max(np.abs(ours_c - hf_c)), np.max(np.abs(ours_s - hf_s)))
    if err > 2e-5 * max(1.0, hf_scale):
        problems.append(f"cos/sin at positions 0..63 differ by {err:.3g}")
    if hf_freq is not None and hf_freq.shape != (half,):
        return problems + [f"HF's inv_freq has shape {hf_freq.shape}, rotary {half} pairs"]
    ours_freq = spec.inv_freq()
    if hf_freq is not None and not np.allclose(ours_freq, hf_freq, rtol=INV_FREQ_RTOL, atol=0):
        worst = int(np.argmax(np.abs(ours_freq - hf_freq) / np.maximum(np.abs(hf_freq), 1e-300)))
        problems.append(f"inv_freq[{worst}] {ours_freq[worst]!r} != HF's {hf_freq[worst]!r}")
    # large positions: rotary's cos/sin against exact angles p * omega (omega = rotary's float64
    # frequencies, shown equal to HF's above to float32's precision), reduced mod 2*pi in rationals
    hf_softmax = _hf_softmax_factor(case, layer_type)
    if not math.isclose(spec.softmax_scale_factor, hf_softmax, rel_tol=1e-12):
        problems.append(f"softmax_scale_factor {spec.softmax_scale_factor} != HF's {hf_softmax}")
    large = positions_for(spec, LARGE)
    theta = _exact_angles(large, ours_freq, spec)
    oc, os_ = spec.cos_sin(large, dtype=np.float64)
    err = max(np.max(np.abs(oc - np.cos(theta) * hf_scale)), np.max(np.abs(os_ - np.sin(theta) * hf_scale)))
    if err > 2e-6 * max(1.0, hf_scale):
        problems.append(f"cos/sin at positions up to 2**31-1 differ from exact angles by {err:.3g}")
    if hf_freq is not None:   # HF's own float32 frequencies as caller-supplied ones: exact angles of HF's inv_freq
        custom = rotary.RopeSpec.from_inv_freq(hf_freq, head_dim=spec.head_dim, layout=spec.layout,
                                               attention_scaling=hf_scale)
        if spec.multi_axis:
            custom = custom.replace(pair_axes=tuple(spec.pair_axes().tolist()), n_axes=spec.n_axes)
        theta = _exact_angles(large, hf_freq, spec)
        cc, cs = custom.cos_sin(large, dtype=np.float64)
        err = max(np.max(np.abs(cc - np.cos(theta) * hf_scale)), np.max(np.abs(cs - np.sin(theta) * hf_scale)))
        if err > 2e-6 * max(1.0, hf_scale):
            problems.append(f"from_inv_freq(HF's inv_freq) at large positions differs from exact angles by {err:.3g}")
    return problems


def _backwards(case: Case) -> bool:
    """True when the family's HF ``rotate_half`` returns (x2, -x1) instead of (-x2, x1)."""
    import torch

    fn = getattr(importlib.import_module(type(case.module).__module__), "rotate_half", None)
    return fn is not None and fn(torch.tensor([1.0, 2.0])).tolist() == [2.0, -1.0]


def _hf_softmax_factor(case: Case, layer_type) -> float:
    """What HF's attention multiplies its softmax scale by (the module's ``yarn_apply_mscale``), else 1."""
    mod = importlib.import_module(type(case.module).__module__)
    fn = getattr(mod, "yarn_apply_mscale", None)
    if fn is None:
        return 1.0
    params = case.config.rope_parameters
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    return float(fn(params, 1.0))


def _exact_angles(coords, inv_freq, spec):
    """p * omega reduced into [-pi, pi) exactly (omega = the float64 frequencies, 2*pi = the float64 2*pi):
    both are dyadic rationals, so the reduction is done on Python integers; float64 at the end."""
    axes = spec.pair_axes() if spec.multi_axis else None
    m2, e2 = math.frexp(2 * math.pi)
    out = np.empty((len(coords), len(inv_freq)))
    for i, w in enumerate(inv_freq):
        mw, ew = math.frexp(float(w))
        mw, ew = int(mw * 2**53), ew - 53
        mt, et = int(m2 * 2**53), e2 - 53
        lo = min(ew, et)
        two_pi = mt << (et - lo)
        for r, p in enumerate(coords):
            pos = int(p[axes[i]]) if axes is not None else int(p)
            t = (pos * mw) << (ew - lo)
            t = (t + two_pi // 2) % two_pi - two_pi // 2   # into [-pi, pi) (up to the 1-ulp halving of 2*pi)
            out[r, i] = math.ldexp(t, lo) if abs(t) < 2**1000 else float(t) * 2.0**lo
    return out


#: classes whose attention uses another apply function than the family's main attention (by HF's code)
APPLY_WITH = {"Dots3NoteAudioRotaryEmbedding": "apply_rotary_pos_emb"}


def _signature(fn):
    """The parameters of an HF apply function: transformers >= 5.25 wraps them in a torch Module (hub kernels,
    ``use_kernelized_func``) called as the function, whose own signature is ``(*args, **kwargs)``."""
    return inspect.signature(fn if inspect.isfunction(fn) else getattr(fn, "forward", fn)).parameters


def _apply_fn(case: Case):
    """(kind, fn): the function HF's attention of this family rotates q/k with, by HF's own rule:
    ``config.rope_interleave`` picks ``apply_rotary_pos_emb_interleave`` where the family reads it,
    families that define only the interleaved form (MLA attention) use it, complex forms take freqs_cis."""
    mod = importlib.import_module(type(case.module).__module__)
    if case.name in APPLY_WITH:
        return "qk", getattr(mod, APPLY_WITH[case.name])
    inter = getattr(mod, "apply_rotary_pos_emb_interleave", None)
    flag = getattr(case.config, "rope_interleave", None)
    if inter is not None and (flag is True or (flag is None and "rope_interleave" not in inspect.getsource(mod))):
        return "deinterleaved", inter
    if hasattr(mod, "apply_rotary_emb") and "freqs_cis" in _signature(mod.apply_rotary_emb):
        return "complex", mod.apply_rotary_emb
    fn = getattr(mod, "apply_rotary_pos_emb", None)
    if fn is None:
        return None, None
    names = list(_signature(fn))
    if names[:3] == ["tensor", "sin", "cos"]:
        return "sin_cos", fn
    if names[:2] == ["q", "k"]:
        return "qk", fn
    if names[:3] == ["x", "cos", "sin"]:
        return "x", fn
    return None, None


def compare_rotation(case: Case, layer_type, spec, rng) -> list[str]:
    """HF's own apply function on (1, 2, S, rotary_dim) q/k against rotary.apply_qk with ``spec``
    (checks the pairing layout); [] when they agree, ["no apply"] when HF has no callable form."""
    import torch

    import rotary

    kind, fn = _apply_fn(case)
    if kind is None:
        return ["no apply function found"]
    width = spec.rotary_dim
    small = positions_for(spec, SMALL[:16])
    q = rng.standard_normal((1, 2, len(SMALL[:16]), width)).astype(np.float32)
    k = rng.standard_normal((1, 2, len(SMALL[:16]), width)).astype(np.float32)
    pos = torch.as_tensor(np.asarray(small))
    pos = pos.T[:, None, :] if pos.ndim == 2 else pos[None]
    kwargs = {} if layer_type is None else {"layer_type": layer_type}
    with torch.no_grad():
        raw = case.module(torch.zeros(1, dtype=torch.float32), pos, **kwargs)
        tq, tk = torch.from_numpy(q), torch.from_numpy(k)
        if kind == "complex":
            bshd = "unsqueeze(1)" not in inspect.getsource(fn)
            if bshd:
                hq, hk = fn(tq.transpose(1, 2), tk.transpose(1, 2), raw)
                hq, hk = hq.transpose(1, 2), hk.transpose(1, 2)
            else:
                hq, hk = fn(tq, tk, raw)
        elif kind == "sin_cos":
            hq = fn(tq.transpose(1, 2), raw[0], raw[1]).transpose(1, 2)
            hk = fn(tk.transpose(1, 2), raw[0], raw[1]).transpose(1, 2)
        elif kind == "x":
            hq, hk = fn(tq, raw[0], raw[1]), fn(tk, raw[0], raw[1])
        else:
            hq, hk = fn(tq, tk, raw[0], raw[1])
    hq, hk = hq.double().numpy(), hk.double().numpy()
    if kind == "deinterleaved":   # HF returns the interleaved rotation as cat(y[0::2], y[1::2])
        hq, hk = (np.stack([h[..., : width // 2], h[..., width // 2:]], axis=-1).reshape(h.shape) for h in (hq, hk))
    oq, ok = rotary.apply_qk(q, k, small, spec=spec.replace(head_dim=width), backend="numpy", seq_axis=-2)
    err = max(np.max(np.abs(oq - hq)), np.max(np.abs(ok - hk)))
    if err > 2e-4 * max(1.0, spec.attention_scaling):
        return [f"rotation with HF's {fn.__name__} differs by {err:.3g} (layout {spec.layout!r})"]
    return []


def run_zoo():
    """Build and compare every text rotary class: (rows for docs/models.md, failures, unbuildable, skipped)."""
    import rotary

    rng = np.random.default_rng(0)
    rows, failures, unbuildable, skipped = [], [], [], []
    for family, module_name, cls_name in rotary_classes():
        if cls_name in EXCEPTIONS:
            skipped.append((family, cls_name, EXCEPTIONS[cls_name]))
            continue
        case = build(family, module_name, cls_name)
        if case is None:
            continue
        if case.error:
            unbuildable.append((family, cls_name, case.error))
            continue
        for layer_type in case.layer_types:
            label = f"{family}.{cls_name}" + ("" if layer_type is None else f"[{layer_type}]")
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    spec = rotary.RopeSpec.from_hf_config(case.config, layer_type=layer_type)
                problems = compare(case, layer_type, spec) or compare_rotation(case, layer_type, spec, rng)
            except Exception as exc:  # noqa: BLE001 - a refusal is a failure to report
                spec, problems = None, [f"{type(exc).__name__}: {exc}"]
            if problems:
                failures.append(f"{label}: {'; '.join(problems)}")
            else:
                rows.append((family, cls_name, layer_type, spec, CONFIG_FIXES.get(cls_name, ("",))[0]))
    return rows, failures, unbuildable, skipped


def models_markdown(rows, skipped, version: str) -> str:
    """docs/models.md: every family reproduced, generated from the zoo test's passing rows."""
    out = [
        "# Supported model families",
        "",
        "Generated by `tests/test_hf_zoo.py` (transformers " + version + "; do not edit: run",
        "`ROTARY_UPDATE_MODELS_DOC=1 python -m pytest tests/test_hf_zoo.py` to regenerate). Every row is a",
        "text `*RotaryEmbedding` class of transformers built from its model's default config: HF's cos/sin at",
        "positions 0..63, its inv_freq and attention factor, the rotation by the family's own apply function",
        "(pair layout) and the softmax factor of its attention agree with `RopeSpec.from_hf_config(config,",
        "layer_type=...)`, and rotary's cos/sin at positions up to 2**31 - 1 agree with exact angles.",
        "",
        "| family | class | layer type | rope type | layout | rotary / head dims | positions | notes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for family, cls_name, layer_type, spec, note in rows:
        dims = f"{spec.rotary_dim} / {spec.head_dim}"
        if spec.frequencies is not None and any(f < 0 for f in spec.frequencies):
            note = (note + "; " if note else "") + "pairs turn by -theta (HF's rotate_half gives (x2, -x1))"
        elif spec.frequencies is not None and not spec.multi_axis:
            note = (note + "; " if note else "") + "odd frequency dim (HF's arange(0, d, 2) / d)"
        if spec.softmax_scale_factor != 1.0:
            note = (note + "; " if note else "") + f"softmax scale x {spec.softmax_scale_factor:.6g}"
        if spec.mrope_section is not None:
            axes = f"M-RoPE {spec.mrope_layout} {list(spec.mrope_section)}"
        elif spec.multi_axis:
            axes = f"{spec.n_axes} axes"
        else:
            axes = "1-D"
        out.append(f"| {family} | `{cls_name}` | {layer_type or ''} | {spec.rope_type} | {spec.layout} | {dims} | "
                   f"{axes} | {note} |")
    out += vision_markdown()
    out += ["", "## Not covered", "", "HF's own module cannot run with its default config:", ""]
    out += [f"- `{cls_name}` ({family}): {reason}" for family, cls_name, reason in skipped]
    return "\n".join(out) + "\n"


def vision_markdown() -> list[str]:
    """The vision section of docs/models.md: rotary's vision table (rotary/spec/hf_vision.py), each tower's
    spec read from HF's default config by ``RopeSpec.from_hf_vision_config``; every row is checked against
    HF's module and apply function by tests/test_peers_vision_towers.py (which fails on an unchecked row)."""
    import transformers

    import rotary
    from rotary.cli.inspect import pair_assignment
    from rotary.spec.hf_vision import SPLIT_TOWERS, VISION_TOWERS

    out = ["", "## Vision towers", "",
           "`RopeSpec.from_hf_vision_config(config)` (the vision tower of a composite config, or a vision config",
           "itself), from each tower's HF default config; `python -m rotary inspect config.json` prints the same.",
           "Coordinates: r = row, c = col (t = frame) of `rotary.grid_positions`.", "",
           "| tower | HF class | rotary / head dims | layout | pairs read | positions (as HF builds them) |",
           "|---|---|---|---|---|---|"]
    for model_type, (family, cls_name, _, positions) in VISION_TOWERS.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            spec = rotary.RopeSpec.from_hf_vision_config(transformers.AutoConfig.for_model(model_type))
        names = {2: "rc", 3: "trc"}[spec.n_axes]
        reads = pair_assignment(spec, names)
        reads = reads[0].replace("pairs read", "").strip() if len(reads) == 1 else \
            "alternating " + "/".join(names) + " pair by pair"
        extra = "" if spec.float_positions is False else ", float coordinates"
        out.append(f"| {family} (`{model_type}`) | `{cls_name}` | {spec.rotary_dim} / {spec.head_dim} | "
                   f"{spec.layout}{extra} | {reads} | {positions} |")
    out += ["", "Not one spec (`from_hf_vision_config` raises and names what reproduces it):", ""]
    out += [f"- {family} (`{model_type}`, `{cls_name}`): {why}" for model_type, (family, cls_name, why)
            in SPLIT_TOWERS.items()]
    return out


if __name__ == "__main__":
    rows, failures, unbuildable, skipped = run_zoo()
    print(f"{len(rows)} reproduced, {len(failures)} failures, {len(unbuildable)} unbuildable, {len(skipped)} skipped")
    for line in failures + [f"cannot build {f}.{c}: {e}" for f, c, e in unbuildable]:
        print(line)
