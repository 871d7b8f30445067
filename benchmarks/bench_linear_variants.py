"""Numba linear attention: decay and GQA against the plain causal kernel, the one-token decode step
against one read + write of the state, and the first-call JIT compile time (fresh process, empty cache).

    python benchmarks/bench_linear_variants.py [--rounds 7] [--no-compile]

Prints a markdown table; every figure is a ratio taken in this one run (interleaved best-of rounds).
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_numba import best_times  # noqa: E402  (sets the thread counts before numba/numpy load)

import numpy as np  # noqa: E402
import rotary  # noqa: E402
from rotary.spec import tables as _tables  # noqa: E402


def prefill(rounds):
    from rotary.backends import numba as nb

    rng = np.random.default_rng(0)
    H, d, T, C = 8, 64, 8192, 64
    q, k, v = (rng.standard_normal((1, T, H, d), dtype=np.float32) for _ in range(3))
    cos, sin, rows = _tables.lookup(rotary.RopeSpec(d), np.arange(T)[None], dtype=np.float32)
    gammas = (1 - 2.0 ** (-5 - np.arange(H)))[None]
    n = 2048
    a = rng.standard_normal((n, n), dtype=np.float32)
    c = np.empty_like(a)
    sgemm = 2 * n**3 / best_times({"sgemm": lambda: np.dot(a, a, out=c)}, rounds)["sgemm"]
    time.sleep(0.5)

    def run(kk=k, vv=v, **kw):
        base = dict(rotary_dim=d, layout="half", causal=True, feature_map="elu", eps=1e-6, chunk=C, state=None)
        base.update(kw)
        return lambda: nb.linear_attention(q, kk, vv, cos, sin, rows, **base)

    best = best_times({
        "causal elu": run(),
        "causal elu, decay (RetNet gammas)": run(decay=gammas),
        "retention: identity, decay, normalize=False": run(feature_map="identity", decay=gammas, normalize=False),
        "causal elu, GQA 4 k/v heads": run(kk=k[:, :, :4], vv=v[:, :, :4]),
    }, rounds)
    flop = 4 * T * d * (C + d) * H
    plain = best["causal elu"]
    rows_out = [(name, f"{t * 1e3:.1f}", f"{flop / t / sgemm:.2f}", f"{t / plain:.2f}") for name, t in best.items()]
    return rows_out, sgemm / 1e9


def decode(rounds):
    from rotary.backends import numba as nb

    rng = np.random.default_rng(1)
    H, d = 32, 128
    q, k, v = (rng.standard_normal((1, 1, H, d), dtype=np.float32) for _ in range(3))
    S = rng.standard_normal((1, H, d, d), dtype=np.float32)
    z = rng.random((1, H, d), dtype=np.float32)
    spec = rotary.RopeSpec(d)
    cos, sin, rows = _tables.lookup(spec, np.array([[100]]), dtype=np.float32)
    out, out_z = np.empty_like(S), np.empty_like(z)
    states = [rotary.LinearAttentionState(S, z, 100, spec=spec)]

    def decode_step():   # a decode loop: each step continues the state the previous step returned
        o, states[0] = rotary.linear_attention(q, k, v, causal=True, seq_axis=1, state=states[0], backend="numba",
                                               return_state=True)

    copy = "read + write the state once (np.copyto of S and z, 2 MB)"
    best = best_times({
        copy: lambda: (np.copyto(out, S), np.copyto(out_z, z)),
        "numba backend primitive (step kernel + glue)": lambda: nb.linear_attention(
            q, k, v, cos, sin, rows, rotary_dim=d, layout="half", causal=True, feature_map="elu", eps=1e-6,
            chunk=64, state=(S, z)),
        "rotary.linear_attention(..., state=, return_state=True), state carried step to step": decode_step,
    }, rounds)
    copy = best[copy]
    return [(name, f"{t * 1e3:.3f}", f"{t / copy:.2f}") for name, t in best.items()]


_PROBE = """
import sys, time
sys.path.insert(0, {root!r})
import numpy as np, rotary
q = np.ones((1, 4, 2, 64), np.float32)
c0 = time.process_time(); w0 = time.perf_counter()
rotary.linear_attention(q, q, q, causal=True, seq_axis=1, backend="numba")
c1 = time.process_time(); w1 = time.perf_counter()
rotary.linear_attention(q[:, :1], q[:, :1], q[:, :1], causal=True, seq_axis=1, backend="numba")
c2 = time.process_time(); w2 = time.perf_counter()
print(c1 - c0, w1 - w0, c2 - c1, w2 - w1)
"""


def compile_times():
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache)
        for label in ("first process, empty cache", "second process, cache hit"):
            out = subprocess.run([sys.executable, "-c", _PROBE.format(root=root)], env=env, capture_output=True,
                                 text=True, check=True).stdout.split()
            rows.append((label, *(f"{float(x):.2f}" for x in out)))
    return rows


def table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args(argv)
    rows, sgemm = prefill(args.rounds)
    print(f"Causal linear attention, H = 8, T = 8192, d = dv = 64, C = 64, fp32 (sgemm {sgemm:.0f} GFLOP/s):\n")
    print(table(["candidate", "ms", "x sgemm (4 T d (C+d) H)", "x causal elu time"], rows))
    import numba

    print(f"\nDecode step, B = 1, H = 32, d = dv = 128, fp32, state 2 MB (NUMBA_NUM_THREADS = "
          f"{numba.config.NUMBA_NUM_THREADS}; a one-token call always runs the serial step kernel):\n")
    print(table(["candidate", "ms", "x state read + write"], decode(args.rounds * 4)))
    if not args.no_compile:
        print("\nFirst call, linear attention (T = 4, then one token):\n")
        print(table(["process", "prefill CPU s", "prefill wall s", "one-token CPU s", "one-token wall s"],
                    compile_times()))


if __name__ == "__main__":
    main()
