"""Profile the Numba kernels with Linux ``perf``, jitted functions named.

    NUMBA_CACHE_DIR=$(mktemp -d) perf record -o perf.data python benchmarks/profile_numba.py [linear|prefill|decode]
    perf report -i perf.data --no-children --sort symbol

perf names jitted code only through a map file, ``/tmp/perf-<pid>.map``; this script writes one for every
function in Numba's compiled libraries after the warm-up call, then runs the case ``--calls`` times. The
cache must be empty (a fresh ``NUMBA_CACHE_DIR``): functions loaded from the on-disk cache carry no IR
module to list. Cases: ``linear`` (causal linear attention, H=8, T=8192, d=64, elu: issue 12's shape),
``prefill`` (apply_qk, Llama-8B prefill, fp32) and ``decode`` (apply_qk, 32 x 1 token). Numba helpers
that LLVM inlined into their callers show up under the caller's name.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402

import rotary  # noqa: E402


def write_perf_map(path=None):
    """Write ``/tmp/perf-<pid>.map`` (start size name, hex) for the compiled functions of every Numba code
    library alive in this process; returns the number of functions written."""
    from numba.core.registry import cpu_target

    engine = cpu_target.target_context.codegen()._engine._ee
    entries, seen = [], set()
    for obj in gc.get_objects():
        if type(obj).__name__ != "JITCodeLibrary" or getattr(obj, "_final_module", None) is None:
            continue
        for fn in obj._final_module.functions:
            if fn.is_declaration or fn.name in seen:
                continue
            address = engine.get_function_address(fn.name)
            if address:
                seen.add(fn.name)
                entries.append((address, fn.name))
    entries.sort()
    with open(path or f"/tmp/perf-{os.getpid()}.map", "w") as f:
        for i, (address, name) in enumerate(entries):
            size = min(entries[i + 1][0] - address if i + 1 < len(entries) else 4096, 1 << 20)
            f.write(f"{address:x} {size:x} {name}\n")
    return len(entries)


def case(name):
    rng = np.random.default_rng(0)
    if name == "linear":
        q, k, v = (rng.standard_normal((1, 8192, 8, 64), dtype=np.float32) for _ in range(3))
        return lambda: rotary.linear_attention(q, k, v, causal=True, seq_axis=1, backend="numba")
    shapes = {"prefill": ((1, 4096, 32, 128), (1, 4096, 8, 128)), "decode": ((32, 1, 32, 128), (32, 1, 8, 128))}
    q, k = (rng.standard_normal(s, dtype=np.float32) for s in shapes[name])
    out = (np.empty_like(q), np.empty_like(k))
    return lambda: rotary.apply_qk(q, k, seq_axis=1, backend="numba", out=out)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("case", nargs="?", default="linear", choices=["linear", "prefill", "decode"])
    parser.add_argument("--calls", type=int, default=30)
    args = parser.parse_args(argv)
    run = case(args.case)
    run()   # compiles
    n = write_perf_map()
    start = time.perf_counter()
    for _ in range(args.calls):
        run()
    per_call = (time.perf_counter() - start) / args.calls
    print(f"{args.case}: {per_call * 1e3:.2f} ms per call over {args.calls} calls; perf map: {n} functions"
          + ("" if n else " (none: run with an empty NUMBA_CACHE_DIR)"))


if __name__ == "__main__":
    main()
