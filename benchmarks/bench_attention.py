"""rotary.attention on a long prefill: wall time and extra memory (tracemalloc peak beyond the inputs).

    python benchmarks/bench_attention.py [--seq 4096] [--heads 32] [--kv-heads 32] [--dim 128] [--backend numba]

Memory is NumPy's traced allocations (tracemalloc sees NumPy buffers), the output included.
"""

from __future__ import annotations

import argparse
import time
import tracemalloc

import numpy as np

import rotary


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=32)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--backend", default="numba")
    ap.add_argument("--block-size", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, args.seq, args.heads, args.dim), dtype=np.float32)
    k = rng.standard_normal((1, args.seq, args.kv_heads, args.dim), dtype=np.float32)
    v = rng.standard_normal((1, args.seq, args.kv_heads, args.dim), dtype=np.float32)
    spec = rotary.RopeSpec(args.dim)
    for causal in (True, False):
        run = lambda: rotary.attention(q, k, v, causal=causal, spec=spec, seq_axis=1, backend=args.backend,  # noqa: E731
                                       block_size=args.block_size)
        run()
        best = min(_timed(run) for _ in range(args.repeat))
        tracemalloc.start()
        run()
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        print(f"attention (1, {args.seq}, {args.heads}/{args.kv_heads}, {args.dim}) fp32 causal={causal} "
              f"backend={args.backend}: best of {args.repeat} {best:.3f} s, extra memory {peak / 2**20:.0f} MiB "
              f"(output {q.nbytes / 2**20:.0f} MiB included)")


def _timed(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


if __name__ == "__main__":
    main()
