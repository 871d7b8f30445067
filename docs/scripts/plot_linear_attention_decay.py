"""Effective attention weights of RoPE linear attention with and without decay (docs/img).

w_ts = gamma^(t-s) (R_{p_t} a_t)^T (R_{p_s} b_s) / sum_{s'<=t} gamma^(t-s') a_t^T b_s' is exactly the
output of causal ``rotary.linear_attention`` with v = the identity matrix (dv = T, v_s = e_s). Random
q, k ~ N(0, 1), d = 64, elu + 1, base 10000, float64, eps = 0. Left: |w_ts| of the last token against
the distance t - s (mean over heads, smoothed over 16 lags), for no decay and RetNet-like gammas.
Right: the effective mass sum_s w_ts against position, with the decayed denominator (normalize=True).

Run: python docs/scripts/plot_linear_attention_decay.py  (writes docs/img/linear_attention_decay.png)
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

T, D, HEADS, SEED = 512, 64, 16, 0
GAMMAS = (None, 1 - 2.0 ** -8, 1 - 2.0 ** -6, 1 - 2.0 ** -5)
OUT = ROOT / "docs" / "img" / "linear_attention_decay.png"


def weights(gamma) -> np.ndarray:
    """(HEADS, T, T) effective weights w_ts (row t, column s; zero above the diagonal)."""
    rng = np.random.default_rng(SEED)
    q = rng.standard_normal((HEADS, T, D))
    k = rng.standard_normal((HEADS, T, D))
    eye = np.broadcast_to(np.eye(T), (HEADS, T, T))
    return rotary.linear_attention(q, k, eye, causal=True, eps=0.0, decay=gamma, backend="numpy", seq_axis=-2)


def label(gamma) -> str:
    return "no decay" if gamma is None else f"gamma = 1 - 2^{int(round(np.log2(1 - gamma)))}"


def main() -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(10.0, 4.0), dpi=120)
    lags = np.arange(T)
    for gamma in GAMMAS:
        w = weights(gamma)
        last = np.abs(w[:, -1, ::-1]).mean(0)                      # by lag t - s, t = T - 1
        smooth = np.convolve(last, np.ones(16) / 16, mode="same")
        left.plot(lags, smooth, label=label(gamma))
        right.plot(np.arange(1, T + 1), w.sum(-1).mean(0), label=label(gamma))
    left.set_yscale("log")
    left.set_xlabel("distance t - s (last token, t = 511)")
    left.set_ylabel("mean |w_ts| (16-lag average)")
    left.set_title("weight of each earlier token")
    right.set_xscale("log")
    right.set_xlabel("position t + 1")
    right.set_ylabel("effective mass  sum_s w_ts")
    right.set_title("mass (normalize=True, decayed denominator)")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(OUT)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
