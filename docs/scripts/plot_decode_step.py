"""The decode-step benchmark's figure (issue 43): ms per step of 32 layers per cell (keys held x batch), rotary
(append + attention, fp32 and int8 entries) beside torch (gather + SDPA, and SDPA on keys gathered beforehand;
fp32), log scale, with the same-run read limit of each cell's K+V bytes as ticks; and each one's fraction of the
cell's binding limit: the larger of the read limit's time and the compute limit's (the attention's flops at the
same-run sgemm rate; it binds for int8 entries). From the JSON of ``benchmarks/bench_decode_step.py``.

Run: python docs/scripts/plot_decode_step.py [JSON] [--out PNG]
     (default: benchmarks/results/decode_step.json -> docs/img/decode_step.png)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "decode_step.json"
OUT = ROOT / "docs" / "img" / "decode_step.png"

# (label, entry type of the cell the row comes from, row name, colour)
SERIES = (
    ("rotary int8: append + attention", "int8", "step", "tab:cyan"),
    ("rotary fp32: append + attention", "fp32", "step", "tab:blue"),
    ("torch fp32: gather + SDPA", "fp32", "torch_gather_sdpa", "tab:red"),
    ("torch fp32: SDPA, keys gathered beforehand", "fp32", "torch_sdpa_pregathered", "tab:orange"),
)


def _cells(data):
    """The (context, batch) cells in the run's order, and {(context, batch, kv): cell}."""
    order, by = [], {}
    for c in data["cells"] + data.get("skipped", []):
        key = (c["context"], c["batch"])
        if key not in order:
            order.append(key)
        if "rows" in c:
            by[key + (c["kv"],)] = c
    return order, by


def _label(context, batch, by):
    c = f"{context // 1024}k" if context % 1024 == 0 else str(context)
    timed = sorted({by[(context, batch, kv)]["layers_timed"] for kv in ("fp32", "int8") if (context, batch, kv) in by})
    layers = "" if timed == [32] or not timed else "\nL' " + "/".join(map(str, timed))
    return f"{c} keys\nx {batch}{layers}"


def plot(path: Path = RESULTS, out: Path = OUT) -> Path:
    data = json.loads(Path(path).read_text())
    order, by = _cells(data)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    width = 0.8 / len(SERIES)
    for j, (label, kv, row, colour) in enumerate(SERIES):
        xs, ms, fr = [], [], []
        for n, key in enumerate(order):
            cell = by.get(key + (kv,))
            if cell is None or row not in cell["rows"]:
                continue
            xs.append(n + (j - (len(SERIES) - 1) / 2) * width)
            ms.append(cell["rows"][row]["median_ms"])
            binding = max(cell["read_limit_ms"], cell.get("compute_limit_ms", 0.0))   # (older JSON: the read limit)
            fr.append(binding / cell["rows"][row]["median_ms"])
        ax.bar(xs, ms, width, label=label, color=colour)
        bx.bar(xs, fr, width, label=label, color=colour)
    # the read limit of each cell's own K+V bytes, across the bars it bounds: int8 over the first, fp32 the rest
    for kv, colour, (lo, hi) in (("int8", "0.4", (0, 1)), ("fp32", "k", (1, len(SERIES)))):
        pts = [(n, by[key + (kv,)]["read_limit_ms"]) for n, key in enumerate(order) if key + (kv,) in by]
        if pts:
            left = [n - 0.4 + lo * width for n, _ in pts]
            ax.hlines([y for _, y in pts], left, [x + (hi - lo) * width for x in left], colors=colour, lw=2,
                      label=f"read limit of the {kv} K+V bytes (same run)")
    for n, key in enumerate(order):
        missing = [kv for kv in ("fp32", "int8") if key + (kv,) not in by]
        if missing:
            ax.annotate("skipped: " + ", ".join(missing), (n, 0.02), xycoords=("data", "axes fraction"),
                        ha="center", fontsize=7, rotation=90, va="bottom")
    labels = [_label(*key, by) for key in order]
    for a in (ax, bx):
        a.set_xticks(range(len(order)))
        a.set_xticklabels(labels, fontsize=7)
        a.grid(alpha=0.3, axis="y", which="both")
    ax.set_yscale("log")
    ax.set_ylabel("ms per decode step (32 layers), median")
    bx.set_ylabel("fraction of the binding limit (its time / time)")
    bx.axhline(1.0, color="k", lw=0.8)
    goal = bx.axhline(0.5, color="k", lw=0.8, ls=":", label="0.5 (right): issue 43's goal for the attention")
    m = data["machine"]
    fig.suptitle(f"Decode step, Llama-3-8B attention shapes (8 k/v heads x 128, GQA 4, page 16): {m['cpu']}, "
                 f"numba {m['numba_threads']} / torch {m['torch_threads']} threads, {data['date']}; "
                 "L': layers timed, scaled to 32", fontsize=9)
    fig.tight_layout(rect=(0, 0.1, 1, 0.95))
    handles, names = ax.get_legend_handles_labels()
    fig.legend(handles + [goal], names + [goal.get_label()], fontsize=7, ncol=4, loc="lower center", frameon=False)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", nargs="?", type=Path, default=RESULTS)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    if not args.json.exists():
        print(f"{args.json} not found: run PYTHONPATH=. python benchmarks/bench_decode_step.py first")
        return 1
    print(f"wrote {plot(args.json, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
