"""Calls that return new arrays, call by call from a fresh process (issue 14): where the slow first calls
come from.

    PYTHONPATH=. python benchmarks/bench_first_touch.py [--processes 3] [--calls 8]

Each candidate runs in fresh processes (a warm-up call first: nothing compiles in the timed calls),
``--calls`` calls in a row, and the table gives the median over processes of each call's time. Every
candidate writes 80 MiB of fresh output (the Llama-8B prefill shape, q (1, 4096, 32, 128), k (1, 4096, 8,
128), fp32) except ``out=``:

- ``rotary.apply_qk`` returning new arrays (the parallel kernel first-touches them from 2 threads);
- ``q.copy(), k.copy()``: what a new-output call must not exceed;
- a 10-line Numba ``prange`` copy of the same bytes into new arrays, 2 threads, and the same loop on
  1 thread: the machine's cost of first-touching fresh pages, with no rotary code involved;
- ``rotary.apply_qk(..., out=)`` into arrays allocated once (no page is new after the first call).

On the 2-vCPU VM of docs/benchmarks.md, fresh pages first touched by the *second* thread cost 4-5x in the
first 2-4 calls of a process, whoever writes them (rotary or the plain prange copy); one thread never
shows it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np

_CHILD = r"""
import json, sys, time
sys.path.insert(0, {root!r})
import numpy as np
from numba import njit, prange
import rotary

@njit(parallel=True)   # compiled in the warm-up (a -c script has no file to cache against)
def copy_parallel(a, out):
    for i in prange(a.shape[0]):
        out[i] = a[i]

@njit
def copy_serial(a, out):
    for i in range(a.shape[0]):
        out[i] = a[i]

rng = np.random.default_rng(0)
q = rng.standard_normal((1, 4096, 32, 128), dtype=np.float32)
k = rng.standard_normal((1, 4096, 8, 128), dtype=np.float32)
spec = rotary.RopeSpec(128, base=500000.0)
out = (np.empty_like(q), np.empty_like(k))
qf, kf = q.reshape(-1), k.reshape(-1)
candidates = {{
    "new": lambda: rotary.apply_qk(q, k, spec=spec, seq_axis=1, backend="numba"),
    "copy": lambda: (q.copy(), k.copy()),
    "prange2": lambda: [copy_parallel(a, b) or b for a, b in ((qf, np.empty_like(qf)), (kf, np.empty_like(kf)))],
    "serial": lambda: [copy_serial(a, b) or b for a, b in ((qf, np.empty_like(qf)), (kf, np.empty_like(kf)))],
    "out": lambda: rotary.apply_qk(q, k, spec=spec, seq_axis=1, backend="numba", out=out),
}}
run = candidates[{name!r}]
rotary.apply_qk(q, k, spec=spec, seq_axis=1, backend="numba", out=out)   # warm: kernels loaded or compiled
copy_parallel(qf[:64], np.empty(64, np.float32)); copy_serial(qf[:64], np.empty(64, np.float32))
times = []
for _ in range({calls}):
    t = time.perf_counter()
    result = run()
    times.append((time.perf_counter() - t) * 1e3)
    del result
print(json.dumps(times))
"""

LABELS = {
    "new": "rotary.apply_qk, new outputs (2 threads)",
    "copy": "q.copy(), k.copy()",
    "prange2": "Numba prange copy into new arrays, 2 threads",
    "serial": "the same copy loop, 1 thread",
    "out": "rotary.apply_qk, out= (allocated once)",
}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--processes", type=int, default=3)
    ap.add_argument("--calls", type=int, default=8)
    args = ap.parse_args(argv)
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    env = dict(os.environ, NUMBA_NUM_THREADS=os.environ.get("NUMBA_NUM_THREADS", "2"))
    rows = []
    for name, label in LABELS.items():
        runs = []
        for _ in range(args.processes):
            code = _CHILD.format(root=root, name=name, calls=args.calls)
            done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        per_call = np.median(np.array(runs), axis=0)
        steady = float(np.median(np.array(runs)[:, args.calls // 2:]))
        rows.append((label, *(f"{t:.0f}" for t in per_call), f"{steady:.1f}", f"{np.max(runs):.0f}"))
    header = ["candidate (ms)", *(f"call {i + 1}" for i in range(args.calls)), "median, 2nd half", "worst"]
    print(f"Fresh processes: median over {args.processes} of each call's time, "
          f"NUMBA_NUM_THREADS={env['NUMBA_NUM_THREADS']}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
