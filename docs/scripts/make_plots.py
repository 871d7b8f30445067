"""Make every figure of the docs: ``python docs/scripts/make_plots.py`` (matplotlib, Agg).

Writes into ``docs/img/``:

- ``decay.png``: RoFormer's long-range decay bound (``rotary.decay_curve``), d=128, bases 1e4/5e5/1e6;
- ``precision.png``: max angle error and max output error against position (1e2 .. 2**31), rotary
  vs HF-style fp32 angles, both against an mpmath reference;
- ``scaling.png``: effective frequency per pair for linear / NTK / YaRN / Llama 3 / LongRoPE
  (from ``RopeSpec.inv_freq``);
- ``layouts.png``: which coordinates pair up in the "half" and "interleaved" layouts;
- ``benchmarks.png``: apply_qk throughput per implementation, from ``benchmarks/results/latest.json``;
- ``linear_attention_mass.png``, ``linear_attention_decay.png``, ``multi_axis.png``: made by their own
  scripts in this folder (``plot_linear_attention.py``, ``plot_linear_attention_decay.py``,
  ``plot_multi_axis.py``), run from here too.

Each figure can be made alone: ``python docs/scripts/make_plots.py decay precision``.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import rotary  # noqa: E402

IMG = ROOT / "docs" / "img"
RESULTS = ROOT / "benchmarks" / "results" / "latest.json"
D = 128


def _save(fig, name: str) -> Path:
    IMG.mkdir(parents=True, exist_ok=True)
    path = IMG / name
    fig.savefig(path, dpi=110, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    return path


def plot_decay() -> Path:
    """RoFormer §3.4.3 bound ``mean_j |sum_{i<j} exp(i r theta_i)|`` against relative distance r."""
    r_max = 1 << 16
    r = np.arange(r_max + 1)
    fig, ax = plt.subplots(figsize=(7, 4))
    for base in (1e4, 5e5, 1e6):
        ax.plot(r[1:], rotary.decay_curve(D, r_max, base=base)[1:], lw=0.8, label=f"base {base:.0e}")
    ax.set_xscale("log")
    ax.set_xlabel("relative distance m - n")
    ax.set_ylabel("bound on |<R_m q, R_n k>| (units of max|h|)")
    ax.set_title(f"Long-range decay of RoPE (head_dim {D})")
    ax.legend()
    ax.grid(alpha=0.3)
    return _save(fig, "decay.png")


def exact_angles(positions, base: float, d: int) -> np.ndarray:
    """``p * base**(-2i/d)`` reduced to [-pi, pi) with mpmath at 50 digits, as float64 (len(p), d/2)."""
    import mpmath

    mpmath.mp.dps = 50
    two_pi = 2 * mpmath.pi
    omega = [mpmath.power(mpmath.mpf(base), -mpmath.mpf(2 * i) / d) for i in range(d // 2)]
    out = np.empty((len(positions), d // 2))
    for a, p in enumerate(positions):
        for i, w in enumerate(omega):
            t = mpmath.fmod(mpmath.mpf(int(p)) * w + mpmath.pi, two_pi)
            out[a, i] = float((t + two_pi if t < 0 else t) - mpmath.pi)
    return out


def hf_style_angles(positions, base: float, d: int) -> np.ndarray:
    """HF LlamaRotaryEmbedding: inv_freq and ``position.float() * inv_freq`` in float32."""
    inv = (1.0 / (np.float32(base) ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / np.float32(d))))
    return np.asarray(positions).astype(np.float32)[:, None] * inv.astype(np.float32)


def _wrap(delta):
    return np.abs(np.remainder(delta + np.pi, 2 * np.pi) - np.pi)


def precision_data(base: float = 5e5, d: int = D, points: int = 36):
    """positions, and max angle / output errors of rotary and HF-style fp32 angles per position."""
    positions = np.unique(np.round(np.logspace(2, 31 * math.log10(2), points)).astype(np.int64))
    positions[-1] = min(positions[-1], 2**31 - 1)
    exact = exact_angles(positions, base, d)
    spec = rotary.RopeSpec(d, base=base)
    ours = spec.angles(positions)
    hf = hf_style_angles(positions, base, d).astype(np.float64)
    x = np.random.default_rng(0).standard_normal(d)
    x32 = x.astype(np.float32)
    h = d // 2

    def rotate(v, theta):       # layout "half", float64
        c, s = np.cos(theta), np.sin(theta)
        return np.concatenate([v[:h] * c - v[h:] * s, v[h:] * c + v[:h] * s], axis=-1)

    reference = rotate(x32.astype(np.float64), exact)
    ours_out = rotary.apply(np.broadcast_to(x32, (len(positions), d)).copy(), positions, spec=spec, seq_axis=-2).astype(np.float64)
    c32, s32 = np.cos(hf).astype(np.float32), np.sin(hf).astype(np.float32)
    hf_out = np.concatenate([x32[:h] * c32 - x32[h:] * s32, x32[h:] * c32 + x32[:h] * s32], axis=-1).astype(np.float64)
    return {
        "positions": positions,
        "rotary_angle": _wrap(ours - exact).max(axis=1),
        "hf_angle": _wrap(hf - exact).max(axis=1),
        "rotary_output": np.abs(ours_out - reference).max(axis=1),
        "hf_output": np.abs(hf_out - reference).max(axis=1),
    }


def plot_precision() -> Path:
    data = precision_data()
    p = data["positions"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    floor = 1e-12   # log axes: show exact zeros at the floor
    for ax, key, title in ((a1, "angle", "max |angle error| (rad)"), (a2, "output", "max |output error|, fp32 vector")):
        ax.plot(p, np.maximum(data[f"hf_{key}"], floor), "o-", ms=3, label="HF-style fp32 angles")
        ax.plot(p, np.maximum(data[f"rotary_{key}"], floor), "s-", ms=3, label="rotary (float64 angles, mod 2pi)")
        ax.set_xscale("log", base=10)
        ax.set_yscale("log")
        ax.set_xlabel("position")
        ax.set_title(title)
        ax.grid(alpha=0.3, which="both")
    a1.legend()
    fig.suptitle(f"Precision at large positions (head_dim {D}, base 5e5; reference: mpmath, 50 digits)")
    return _save(fig, "precision.png")


SCALING_EXAMPLES = {   # d=128, base 5e5, original context 8192, factor 8
    "linear (PI)": {"rope_type": "linear", "factor": 8.0},
    "NTK (static)": {"rope_type": "ntk", "factor": 8.0},
    "YaRN": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192},
    "Llama 3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192},
    "LongRoPE (long factors)": {"rope_type": "longrope", "factor": 8.0, "original_max_position_embeddings": 8192,
                                "short_factor": [1.0] * (D // 2),
                                "long_factor": list(1.0 + 7.0 / (1.0 + np.exp(-(np.arange(D // 2) - 32) / 4)))},
}


def scaling_frequencies(base: float = 5e5):
    """(base inv_freq, {label: scaled inv_freq}) for the examples; LongRoPE at a long sequence."""
    plain = rotary.RopeSpec(D, base=base)
    scaled = {}
    for label, scaling in SCALING_EXAMPLES.items():
        spec = rotary.RopeSpec(D, base=base, scaling=scaling, max_position_embeddings=65536)
        scaled[label] = spec.inv_freq(65536)
    return plain.inv_freq(), scaled


def plot_scaling() -> Path:
    base_freq, scaled = scaling_frequencies()
    i = np.arange(len(base_freq))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    a1.plot(i, base_freq, "k--", lw=1, label="no scaling")
    for label, w in scaled.items():
        a1.plot(i, w, lw=1.2, label=label)
        a2.plot(i, base_freq / w, lw=1.2, label=label)
    a1.set_yscale("log")
    a1.set_ylabel("effective frequency omega'_i (rad / token)")
    a2.set_ylabel("omega_i / omega'_i (position compression)")
    for ax in (a1, a2):
        ax.set_xlabel("pair index i")
        ax.grid(alpha=0.3, which="both")
    a1.legend(fontsize=8)
    lengths = 2 * np.pi / base_freq
    a2.axvline(np.searchsorted(lengths, 8192 / 4), color="grey", lw=0.6)
    a2.axvline(np.searchsorted(lengths, 8192 / 1), color="grey", lw=0.6)
    fig.suptitle("Length extension by factor 8 (head_dim 128, base 5e5, original context 8192); "
                 "grey: Llama 3 band edges")
    return _save(fig, "scaling.png")


def plot_layouts(d: int = 8) -> Path:
    """Boxes for coordinates 0..d-1, arcs between the two members of each rotated pair."""
    fig, axes = plt.subplots(2, 1, figsize=(7, 3.6))
    colors = plt.get_cmap("tab10").colors
    for ax, layout in zip(axes, rotary.LAYOUTS):
        a, b = rotary.RopeSpec(d, layout=layout).pair_indices()
        pair_of = np.empty(d, dtype=int)
        pair_of[a], pair_of[b] = np.arange(d // 2), np.arange(d // 2)
        for j in range(d):
            ax.add_patch(plt.Rectangle((j - 0.4, -0.4), 0.8, 0.8, color=colors[pair_of[j]], alpha=0.35))
            ax.text(j, 0, f"x{j}", ha="center", va="center", fontsize=10)
        for i, (ja, jb) in enumerate(zip(a, b)):
            mid, width = (ja + jb) / 2, jb - ja
            arc = matplotlib.patches.Arc((mid, 0.4), width, 0.5 + 0.25 * width, theta1=0, theta2=180,
                                         color=colors[i], lw=1.5)
            ax.add_patch(arc)
            for j in (ja, jb):
                ax.text(j, -0.6, rf"$\theta_{i}$", ha="center", va="top", fontsize=9, color=colors[i])
        name = {"half": 'layout="half" (NeoX, HF LLaMA rotate_half): pairs (i, i + d/2)',
                "interleaved": 'layout="interleaved" (RoFormer, GPT-J, Meta): pairs (2i, 2i + 1)'}[layout]
        ax.set_title(name, fontsize=9)
        ax.set_xlim(-0.6, d - 0.4)
        ax.set_ylim(-1.0, 1.7)
        ax.axis("off")
    fig.tight_layout()
    return _save(fig, "layouts.png")


def plot_benchmarks(path: Path = RESULTS) -> Path | None:
    """Grouped bars: GB/s of each apply_qk implementation per (case, dtype); dashed: copy bandwidth."""
    if not path.exists():
        print(f"skipping benchmarks.png: {path} not found (run python benchmarks/run.py)")
        return None
    data = json.loads(path.read_text())
    rows = [r for r in data["results"] if r["kind"] == "apply_qk"]
    impls = list(dict.fromkeys(name for r in rows for name in r["impls"]))
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / len(impls)
    for j, impl in enumerate(impls):
        x = [n + j * width for n, r in enumerate(rows) if impl in r["impls"]]
        y = [r["impls"][impl]["GBps"] for r in rows if impl in r["impls"]]
        ax.bar(x, y, width, label=impl)
    copy = data["limits"]["copy_GBps"]
    ax.axhline(copy, color="k", ls="--", lw=1, label=f"copy bandwidth {copy:.1f} GB/s")
    ax.set_xticks([n + 0.4 - width / 2 for n in range(len(rows))])
    ax.set_xticklabels([f"{r['case'].split(' (')[0]}\n{r['dtype']}" for r in rows], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("GB/s (q and k read + written)")
    m = data["machine"]
    ax.set_title(f"apply_qk on {m['cpu']} ({m['threads']} threads), {data['date']}", fontsize=10)
    # below the axes, so that no bar is hidden behind it
    ax.legend(fontsize=8, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.16), frameon=False)
    ax.grid(alpha=0.3, axis="y", which="both")
    return _save(fig, "benchmarks.png")


def _script(name: str):
    """A plotting script of this folder as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def plot_linear_attention_mass() -> Path:
    module = _script("plot_linear_attention")
    module.main()
    return module.OUT


def plot_linear_attention_decay() -> Path:
    module = _script("plot_linear_attention_decay")
    module.main()
    return module.OUT


def plot_multi_axis() -> Path:
    return _script("plot_multi_axis").plot()


def plot_decode_step() -> Path:
    return _script("plot_decode_step").plot()


PLOTS = {"decay": plot_decay, "precision": plot_precision, "scaling": plot_scaling, "layouts": plot_layouts,
         "benchmarks": plot_benchmarks, "linear_attention_mass": plot_linear_attention_mass,
         "linear_attention_decay": plot_linear_attention_decay, "multi_axis": plot_multi_axis,
         "decode_step": plot_decode_step}


def main(argv) -> int:
    names = argv or list(PLOTS)
    unknown = [n for n in names if n not in PLOTS]
    if unknown:
        print(f"unknown plot(s) {unknown}; choose from {list(PLOTS)}")
        return 2
    for name in names:
        path = PLOTS[name]()
        if path:
            print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
