"""The cos/sin table cache far from position 0 (issue 14): prefill and decode at large offsets cost what
they cost near 0, and a lone call far out builds a small window, not a table from 0.

    PYTHONPATH=. python benchmarks/bench_tables.py [--rounds 9]

apply_qk at the Llama-8B prefill shape (q (1, 4096, 32, 128), k (1, 4096, 8, 128), fp32, out=) at
offsets 0, 131072 and 1e6 (median of the rounds after a warm-up call); Rope decode (32 sequences x
1 token, q 32 heads, k 8 heads, d=128, fp32, in place) at positions near 500 and near 500 000; the
first call at position 131071 in an empty cache (time and bytes kept).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import rotary
from bench_rope import best_us   # the benchmarks folder is on sys.path when run as a script


def median_ms(fn, rounds):
    fn()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * float(np.median(times))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--backend", default="numba")
    args = ap.parse_args()
    spec = rotary.RopeSpec(128, base=5e5)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 4096, 32, 128), dtype=np.float32)
    k = rng.standard_normal((1, 4096, 8, 128), dtype=np.float32)
    oq, ok = np.empty_like(q), np.empty_like(k)
    print(f"backend {args.backend}, median of {args.rounds} calls after a warm-up")
    print("| call | time |\n|---|---|")
    for offset in (0, 131_072, 1_000_000):
        pos = offset + np.arange(4096)
        t = median_ms(lambda: rotary.apply_qk(q, k, pos, spec=spec, seq_axis=1, backend=args.backend, out=(oq, ok)),
                      args.rounds)
        print(f"| apply_qk prefill 4096 tokens at offset {offset}, out= | {t:.2f} ms |")
    qd = rng.standard_normal((32, 1, 32, 128), dtype=np.float32)
    kd = rng.standard_normal((32, 1, 8, 128), dtype=np.float32)
    rope = rotary.Rope(spec, backend=args.backend, dtype=np.float32, seq_axis=-2)
    for near in (500, 500_000):
        pos = near + rng.integers(0, 2000, size=(32, 1))
        t = best_us(lambda: rope(qd, kd, pos, seq_axis=1, out=(qd, kd)), 200, args.rounds)
        print(f"| Rope decode (32 x 1 token) near position {near}, in place | {t:.1f} us |")
    rotary.clear_cache()
    x = rng.standard_normal((1, 1, 32, 128), dtype=np.float32)
    rotary.apply(x, 7, spec=spec, seq_axis=1, backend=args.backend)   # compile outside the timing
    rotary.clear_cache()
    t = time.perf_counter()
    rotary.apply(x, 131_071, spec=spec, seq_axis=1, backend=args.backend)
    t = 1e3 * (time.perf_counter() - t)
    info = rotary.table_cache_info()
    print(f"| first call at position 131071, empty cache | {t:.2f} ms, {info['bytes'] / 2**10:.0f} KiB kept |")


if __name__ == "__main__":
    main()
