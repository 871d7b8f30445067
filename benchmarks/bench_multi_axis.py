"""Multi-axis RoPE speed: ``python benchmarks/bench_multi_axis.py [--rounds N] [--no-docs]``.

``rotary.apply_qk`` at the Llama-8B prefill shape (q (1, 4096, 32, 128), k (1, 4096, 8, 128), fp32)
on one backend (default Numba), 1-D positions against M-RoPE (Qwen2.5-VL chunked sections, Qwen3-VL
interleaved assignment) with a 3-axis position array of an image-and-text prompt, and a 2-D axial
spec with grid coordinates. Candidates run interleaved, round by round, and the best time of each is
kept, so a busy machine slows them alike; the goal is multi-axis within 1.25x of 1-D in the same run.
Also times the per-token table gather alone, and HF transformers' Qwen2-VL text rotary
(cos/sin from (3, batch, seq) position_ids + apply_rotary_pos_emb on torch CPU) when it is installed.

Replaces the "Multi-axis (benchmarks/bench_multi_axis.py)" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import sys

from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_numba import best_times  # noqa: E402  (sets the thread counts before numba/numpy load)

import numpy as np  # noqa: E402

import rotary  # noqa: E402
from rotary.spec import tables as _tables  # noqa: E402

SECTION = "## Multi-axis (benchmarks/bench_multi_axis.py)"
S, HQ, HK, D = 4096, 32, 8, 128


def prompt_positions() -> np.ndarray:
    """(1, S, 3) t/h/w ids of a Qwen2.5-VL-style prompt: 96 text tokens, a 48 x 64 merged image grid
    (3072 tokens), then text to S (positions after the image continue from max + 1)."""
    text0 = np.arange(96)
    h, w = np.meshgrid(np.arange(48), np.arange(64), indexing="ij")
    image = np.stack([np.zeros(h.size, np.int64), h.ravel(), w.ravel()], -1) + 96
    rest = np.arange(S - 96 - h.size) + image.max() + 1
    pos = np.concatenate([np.repeat(text0[:, None], 3, 1), image, np.repeat(rest[:, None], 3, 1)])
    return pos[None].astype(np.int64)


def hf_qwen2_vl():
    """A callable running HF's Qwen2-VL text rotary + apply on torch CPU tensors, or None."""
    try:
        import torch
        from transformers import Qwen2VLTextConfig
        from transformers.models.qwen2_vl import modeling_qwen2_vl as m
    except Exception:
        return None
    torch.set_num_threads(2)
    cfg = Qwen2VLTextConfig(hidden_size=HQ * D, num_attention_heads=HQ, num_key_value_heads=HK,
                            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]})
    emb = m.Qwen2VLRotaryEmbedding(cfg)
    rng = np.random.default_rng(0)
    q = torch.from_numpy(rng.standard_normal((1, HQ, S, D), dtype=np.float32))
    k = torch.from_numpy(rng.standard_normal((1, HK, S, D), dtype=np.float32))
    pid = torch.from_numpy(np.ascontiguousarray(np.moveaxis(prompt_positions(), -1, 0)))

    def call():
        with torch.no_grad():
            cos, sin = emb(q, pid)
            m.apply_rotary_pos_emb(q, k, cos, sin)
    return call


def measure(rounds: int, backend: str) -> dict:
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, S, HQ, D), dtype=np.float32)
    k = rng.standard_normal((1, S, HK, D), dtype=np.float32)
    qo, ko = np.empty_like(q), np.empty_like(k)
    pos = prompt_positions()
    grid = np.stack(np.meshgrid(np.arange(64), np.arange(64), indexing="ij"), -1).reshape(-1, 2)
    specs = {
        "1-D": (rotary.RopeSpec(D, base=1e6), None),
        "M-RoPE chunked (Qwen2.5-VL)": (rotary.RopeSpec(D, base=1e6, mrope_section=(16, 24, 24)), pos),
        "M-RoPE interleaved (Qwen3-VL)": (rotary.RopeSpec(D, base=1e6, mrope_section=(24, 20, 20),
                                                          mrope_interleaved=True), pos),
        "axial 2-D (ViT, 64 x 64 grid)": (rotary.RopeSpec.axial(D, axes=2, base=1e4), grid),
    }
    candidates = {}
    for name, (spec, p) in specs.items():
        candidates[f"{name}, out="] = (lambda s=spec, p=p: rotary.apply_qk(q, k, p, spec=s, seq_axis=-3,
                                                                           out=(qo, ko), backend=backend))
        candidates[f"{name}, new outputs"] = (lambda s=spec, p=p: rotary.apply_qk(q, k, p, spec=s, seq_axis=-3,
                                                                                  backend=backend))
        if p is not None:
            candidates[f"{name}: table gather alone"] = (lambda s=spec, p=p: _tables.lookup(s, p, dtype=np.float32))
    peer = hf_qwen2_vl()
    if peer is not None:
        candidates["HF transformers Qwen2-VL rotary + apply (torch CPU)"] = peer
    return best_times(candidates, rounds)


def report(best: dict, rounds: int, backend: str, note: str) -> str:
    base_out, base_new = best["1-D, out="], best["1-D, new outputs"]
    rows = []
    for name, t in best.items():
        if name.endswith("out="):
            ratio = f"{t / base_out:.2f}x"
        elif name.endswith("new outputs"):
            ratio = f"{t / base_new:.2f}x"
        else:
            ratio = ""
        rows.append(f"| {name} | {t * 1e3:.2f} | {ratio} |")
    cpu = os.cpu_count()
    return "\n".join([
        SECTION, "",
        f"`python benchmarks/bench_multi_axis.py --rounds {rounds}` ({backend}, {cpu} cores; {note}). apply_qk at "
        "the Llama-8B prefill shape, fp32, best of the interleaved rounds; the ratio is against the 1-D call of the "
        "same kind in the same run (goal: multi-axis <= 1.25x).", "",
        "| case | ms | vs 1-D |", "|---|---|---|", *rows, ""])


def write_section(path: Path, text: str) -> None:
    page = path.read_text() if path.exists() else "# Benchmarks\n"
    lines = page.split("\n")
    if SECTION in lines:
        start = lines.index(SECTION)
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        lines[start:end] = text.rstrip("\n").split("\n") + [""]
        page = "\n".join(lines)
    else:
        page = page.rstrip("\n") + "\n\n" + text
    path.write_text(page)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--backend", default="numba")
    parser.add_argument("--note", default="quiet machine", help="what else ran during the measurement")
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args(argv)
    best = measure(args.rounds, args.backend)
    text = report(best, args.rounds, args.backend, args.note)
    print(text)
    if not args.no_docs:
        write_section(Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
