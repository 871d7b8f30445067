"""Effective weight mass of numerator-only RoPE linear attention against position (docs/img).

With w_ts = (R_{p_t} a_t)^T (R_{p_s} b_s) / sum_s a_t^T b_s, the mass sum_{s<=t} w_ts is exactly the
output of causal ``rotary.linear_attention`` with v = 1 (dv = 1). Random q, k ~ N(0, 1), d = 64,
elu + 1, T = 4096, float64, eps = 0; mean over heads and the 10-90 % band, for a few bases. Dotted:
the rule of thumb max(0, 1 - ln(t + 1) / ln(base)), the share of pairs whose angle (t + 1) theta_l is
still below one radian (theta_l = base**(-2l/d)); faster pairs average out over the prefix.

Run: python docs/scripts/plot_linear_attention.py  (writes docs/img/linear_attention_mass.png)
"""

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import rotary  # noqa: E402

T, D, HEADS, SEED = 4096, 64, 32, 0
BASES = (100.0, 10_000.0, 500_000.0)
OUT = ROOT / "docs" / "img" / "linear_attention_mass.png"


def mass(base: float) -> np.ndarray:
    """(HEADS, T) effective mass sum_s w_ts on one random draw."""
    rng = np.random.default_rng(SEED)
    q = rng.standard_normal((HEADS, T, D))
    k = rng.standard_normal((HEADS, T, D))
    ones = np.ones((HEADS, T, 1))
    o = rotary.linear_attention(q, k, ones, causal=True, eps=0.0, base=base, backend="numpy", seq_axis=-2)
    return o[..., 0]


def main() -> None:
    t = np.arange(T)
    fig, ax = plt.subplots(figsize=(7.0, 4.2), dpi=120)
    for base in BASES:
        m = mass(base)
        mean = m.mean(0)
        lo, hi = np.percentile(m, [10, 90], axis=0)
        line, = ax.plot(t + 1, mean, label=f"base {base:g}")
        ax.fill_between(t + 1, lo, hi, color=line.get_color(), alpha=0.2, linewidth=0)
        ax.plot(t + 1, np.maximum(0.0, 1.0 - np.log(t + 1) / np.log(base)), color=line.get_color(),
                linestyle=":", linewidth=1.2)
        print(f"base {base:>9g}: mass at t=0 {mean[0]:.3f}, t=255 {mean[255]:.3f}, t=4095 {mean[-1]:.3f}")
    ax.plot([], [], color="gray", linestyle=":", label=r"$1 - \ln(t+1)/\ln(\mathrm{base})$")
    ax.axhline(1.0, color="k", linewidth=0.8, linestyle="--", label="without RoPE (= 1)")
    ax.set_xscale("log")
    ax.set_xlabel("position t + 1 (causal, tokens 0..t)")
    ax.set_ylabel(r"effective mass $\sum_{s \leq t} w_{ts}$")
    ax.set_title(f"Numerator-only RoPE in linear attention (d={D}, elu+1, N(0,1) q,k; {HEADS} heads, 10-90 %)",
                 fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUT)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
