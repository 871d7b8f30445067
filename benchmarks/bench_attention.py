"""rotary.attention on a long prefill: wall time and extra memory (tracemalloc peak beyond the inputs).

    python benchmarks/bench_attention.py [--seq 4096] [--heads 32] [--kv-heads 32] [--dim 128] [--backend numba]
                                         [--window W] [--path tiles|array-api]

Memory is NumPy's traced allocations (tracemalloc sees NumPy buffers), the output included. The
matmul work (2 x 2 x d per visible (query, key) pair and head) is reported as GFLOP/s and as a
fraction of a plain sgemm (2048^3) timed in the same run, which stays meaningful on a busy machine.
``--path array-api`` runs NumPy inputs through the array-API path (the one CuPy and torch take).
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
    ap.add_argument("--window", type=int, default=None)
    ap.add_argument("--path", choices=["tiles", "array-api"], default="tiles")
    args = ap.parse_args()
    from rotary.attn import softmax as _attention

    _attention._NUMPY_TILES = args.path == "tiles"
    a = np.ones((2048, 2048), dtype=np.float32)
    a @ a
    sgemm = 2 * 2048**3 / min(_timed(lambda: a @ a) for _ in range(3)) / 1e9
    print(f"sgemm 2048^3: {sgemm:.1f} GFLOP/s")
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, args.seq, args.heads, args.dim), dtype=np.float32)
    k = rng.standard_normal((1, args.seq, args.kv_heads, args.dim), dtype=np.float32)
    v = rng.standard_normal((1, args.seq, args.kv_heads, args.dim), dtype=np.float32)
    spec = rotary.RopeSpec(args.dim)
    for causal in (True, False) if args.window is None else (True,):
        run = lambda: rotary.attention(q, k, v, causal=causal, spec=spec, seq_axis=1, backend=args.backend,  # noqa: E731
                                       block_size=args.block_size, window=args.window)
        t = np.arange(args.seq)
        pairs = (args.seq * args.seq if not causal else
                 int(np.sum(np.minimum(t + 1, args.window or args.seq))))
        gflop = 4 * args.dim * pairs * args.heads / 1e9
        run()
        best = min(_timed(run) for _ in range(args.repeat))
        tracemalloc.start()
        run()
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        print(f"attention (1, {args.seq}, {args.heads}/{args.kv_heads}, {args.dim}) fp32 causal={causal} "
              f"window={args.window} backend={args.backend} path={args.path}: best of {args.repeat} {best:.3f} s "
              f"({gflop / best:.1f} GFLOP/s, {gflop / best / sgemm:.0%} of sgemm), extra memory "
              f"{peak / 2**20:.0f} MiB (output {q.nbytes / 2**20:.0f} MiB included)")


def _timed(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


if __name__ == "__main__":
    main()
