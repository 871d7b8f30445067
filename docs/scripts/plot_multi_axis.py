"""Which coordinate each head dimension reads, per multi-axis family (docs/img/multi_axis.png).

One row per family, one cell per head coordinate 0..head_dim-1 (as the model stores it): the colour
says which axis (t / h / w, or row / col) the coordinate's rotated pair reads, the shade the pair's
frequency (dark = fast), grey = passes through unrotated. Every row comes from the spec's own
``pair_axes()``, ``pair_indices()`` and ``inv_freq()``; the specs are the ones the peer tests check
against HF (tests/test_peers_multi_axis.py).

Run: python docs/scripts/plot_multi_axis.py  (writes docs/img/multi_axis.png)
"""

import math
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import rotary  # noqa: E402

OUT = ROOT / "docs" / "img" / "multi_axis.png"

#: label -> (spec, names of its coordinates)
FAMILIES = {
    "Qwen2-VL / Qwen2.5-VL text\nmrope_section (16, 24, 24)":
        (rotary.RopeSpec(128, base=1e6, mrope_section=(16, 24, 24)), ("t", "h", "w")),
    "Qwen3-VL text\n(24, 20, 20), mrope_interleaved":
        (rotary.RopeSpec(128, base=5e6, mrope_section=(24, 20, 20), mrope_interleaved=True), ("t", "h", "w")),
    "GLM-4V text\n(8, 12, 12), interleaved pairs, half rotary":
        (rotary.RopeSpec(128, rotary_dim=64, base=1e4, layout="interleaved", mrope_section=(8, 12, 12)),
         ("t", "h", "w")),
    "ERNIE-4.5-VL text\n(22, 22, 20), h/w alternate, then t":
        (rotary.RopeSpec(128, base=5e5, layout="interleaved", mrope_section=(22, 22, 20), mrope_layout="ernie"),
         ("t", "h", "w")),
    "Qwen2-VL vision (and Qwen2.5/3-VL, GLM-4V)\naxial, per-axis frequencies":
        (rotary.RopeSpec.axial(80, axes=2), ("row", "col")),
    "Pixtral vision\naxial, strided frequencies":
        (rotary.RopeSpec.axial(64, axes=2, frequencies="strided"), ("row", "col")),
    "SAM 2 / SAM 3 ViT\ninterleaved pairs, column first":
        (rotary.RopeSpec.axial(64, axes=2, layout="interleaved", axis_order=(1, 0)), ("row", "col")),
    "DINOv3\npatch centres in [-1, 1], 2*pi/period":
        (rotary.RopeSpec.axial(64, axes=2, base=100.0, frequency_scale=2 * math.pi, float_positions=True),
         ("row", "col")),
}

#: axis name -> colour map
CMAPS = {"t": "Reds", "h": "Blues", "w": "Greens", "row": "Blues", "col": "Greens"}


def coordinate_map(spec):
    """(axis, shade) per head coordinate: the axis its pair reads (-1 = not rotated) and the pair's
    frequency rank in [0, 1] (0 = fastest) among the pairs reading that axis."""
    axis = np.full(spec.head_dim, -1, dtype=np.int64)
    shade = np.zeros(spec.head_dim)
    pair_axes, freq = spec.pair_axes(), spec.inv_freq()
    a, b = spec.pair_indices()
    for i in range(spec.rotary_dim // 2):
        same = freq[pair_axes == pair_axes[i]]
        rank = np.sum(same > freq[i]) / max(1, len(same) - 1)
        for j in (a[i], b[i]):
            axis[j], shade[j] = pair_axes[i], rank
    return axis, shade


def plot(path=OUT):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(FAMILIES), 1, figsize=(11, 1.0 * len(FAMILIES) + 0.6))
    for ax, (label, (spec, names)) in zip(axes, FAMILIES.items()):
        axis, shade = coordinate_map(spec)
        for j in range(spec.head_dim):
            if axis[j] < 0:
                color = (0.85, 0.85, 0.85)
            else:
                color = plt.get_cmap(CMAPS[names[axis[j]]])(0.9 - 0.6 * shade[j])
            ax.add_patch(plt.Rectangle((j, 0), 1, 1, color=color, lw=0))
        ax.set_xlim(0, 128)
        ax.set_ylim(0, 1)
        ax.set_yticks([])
        ax.set_xticks(range(0, 129, 16))
        ax.tick_params(labelsize=7)
        ax.set_ylabel(label, rotation=0, ha="right", va="center", fontsize=8)
        handles = [plt.Rectangle((0, 0), 1, 1, color=plt.get_cmap(CMAPS[n])(0.75)) for n in names]
        ax.legend(handles, names, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=7, frameon=False)
    axes[-1].set_xlabel("head coordinate (dark = fast frequency, light = slow; grey = not rotated)")
    fig.suptitle("Which coordinate each rotated dimension reads", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    return path


if __name__ == "__main__":
    print(plot())
