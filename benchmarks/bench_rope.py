"""rotary.Rope on a decode step: 32 sequences x 1 token, q 32 heads, k 8 heads, d=128, fp32.

    PYTHONPATH=. python benchmarks/bench_rope.py [--rounds 7]
    PYTHONPATH=. python benchmarks/bench_rope.py --kernel-choice 20 [--busy 2]   # decode kernel: serial / parallel

``--kernel-choice SECONDS``: Rope decode calls with the Numba kernel forced serial and forced parallel
(``ROTARY_NUMBA_DECODE_KERNEL``; "auto" is one of the two by its rule), 300 calls per mode in turn for SECONDS; median, p90, p99 and
mean per mode. ``--busy N`` runs N busy-looping processes meanwhile (a machine whose cores are taken).

Numba: per-call time of ``rope(q, k, positions)`` (new outputs, separate ``out=`` buffers and in place) next
to ``rotary.apply_qk``, the compiled kernel alone with prepared arguments (the floor; the streamed parallel kernel
beside the plain one: what the stream path compiled in costs a decode call) and ``q.copy(), k.copy()``
of the same inputs; the candidates are timed interleaved (round by round), and the ratios of issue 23
(Rope / copy, Rope out= / Rope, apply_qk / Rope) are printed twice: best round against best round, and the
median over rounds of the ratio within a round (the steadier figure on a VM whose speed drifts between rounds). CUDA launch path: the host time per call
of the same object's CuPy path with the launch mocked (NumPy arrays stand in for device arrays, the
launch is a no-op), i.e. everything Rope does on the host besides the launch itself.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import rotary
from rotary.backends import cupy as cuda_backend
from rotary.spec import tables as _tables


def best_us(fn, calls, rounds):
    fn()
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls)
    return best * 1e6


def interleaved_us(cands, calls, rounds, per_round=None):
    """{name: best us per call}, the candidates timed round by round (each round times every candidate once),
    so a load that comes and goes falls on all of them alike. ``per_round``: a dict that gets
    {name: [us per call of each round]} (for ratios of the same round)."""
    for fn in cands.values():
        fn()
    times = {name: [] for name in cands}
    for _ in range(rounds):
        for name, fn in cands.items():
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - t) / calls * 1e6)
    if per_round is not None:
        per_round.update(times)
    return {name: min(ts) for name, ts in times.items()}


def round_ratio(per_round, a, b):
    """Median over rounds of a's time / b's time in the same round (the VM's speed drifts between rounds)."""
    return float(np.median(np.array(per_round[a]) / np.array(per_round[b])))


def kernel_choice(seconds: float, busy: int):
    """Per-call times of Rope decode with DECODE_KERNEL serial and parallel, in turn."""
    import subprocess
    import sys

    from rotary.backends import numba as nb
    from rotary.backends import numba_runtime as nb_runtime  # noqa: E402  (the size rule)

    rng = np.random.default_rng(0)
    q = rng.standard_normal((32, 1, 32, 128), dtype=np.float32)
    k = rng.standard_normal((32, 1, 8, 128), dtype=np.float32)
    positions = rng.integers(0, 8000, (32, 1))
    rope = rotary.Rope(rotary.RopeSpec(128), backend="numba", max_positions=8192, seq_axis=-2)
    for _ in range(50):
        rope(q, k, positions, seq_axis=1)
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    modes = ("serial", "parallel")
    before = nb_runtime.DECODE_KERNEL
    times = {m: [] for m in modes}
    try:
        end = time.time() + seconds
        while time.time() < end:
            for mode in modes:
                nb_runtime.DECODE_KERNEL = mode
                for _ in range(300):
                    t = time.perf_counter()
                    rope(q, k, positions, seq_axis=1)
                    times[mode].append(time.perf_counter() - t)
    finally:
        for p in loops:
            p.kill()
        nb_runtime.DECODE_KERNEL = before
    print(f"Rope decode (32, 1, 32/8, 128) fp32, numba threads {__import__('numba').get_num_threads()}, "
          f"{busy} busy-looping processes, {seconds:g} s")
    print("| kernel | calls | median us | p90 us | p99 us | mean us |\n|---|---|---|---|---|---|")
    for mode in modes:
        a = np.array(times[mode]) * 1e6
        print(f"| {mode} | {a.size} | {np.median(a):.1f} | {np.percentile(a, 90):.1f} | {np.percentile(a, 99):.1f} "
              f"| {a.mean():.1f} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--kernel-choice", type=float, default=None, metavar="SECONDS",
                    help="serial / parallel decode kernel, in turn for SECONDS")
    ap.add_argument("--busy", type=int, default=0, help="busy-looping processes during --kernel-choice")
    args = ap.parse_args()
    if args.kernel_choice is not None:
        return kernel_choice(args.kernel_choice, args.busy)
    from rotary.backends import numba as nb
    from rotary.backends import numba_runtime as nb_runtime  # noqa: E402  (the size rule)

    B, Hq, Hk, D = 32, 32, 8, 128
    rng = np.random.default_rng(1)
    q = rng.standard_normal((B, 1, Hq, D), dtype=np.float32)
    k = rng.standard_normal((B, 1, Hk, D), dtype=np.float32)
    positions = rng.integers(100, 8000, size=(B, 1))
    spec = rotary.RopeSpec(D, base=500000.0)
    rope = rotary.Rope(spec, backend="numba", dtype=np.float32, max_positions=8192, seq_axis=-2)
    qi, ki = q.copy(), k.copy()

    q_out, k_out = np.empty_like(q), np.empty_like(k)
    cos, sin, rows = _tables.lookup(spec, positions, dtype=np.float32)
    xq, oq, gq = nb._geometry(q, q_out)
    xk, ok, gk = nb._geometry(k, k_out)
    kargs = (xq, oq, xk, ok, np.stack([gq, gk]), nb._readonly(cos), nb._readonly(sin), np.array(rows), 0, B, 1,
             D // 2, D, D, False, False, False)   # (shift, tokens, seq_len, half, rotary_dim, head_dim, interleaved,
    #                                                out_interleaved, inverse)
    serial, parallel = nb.rotation.rotate_qk_serial, nb.rotation.rotate_qk_parallel   # Rope's size rule picks one
    streamed = nb.rotation.rotate_qk_streamed   # the parallel kernel with the non-temporal stream path
    qo, ko = np.empty_like(q), np.empty_like(k)
    copy, new, sep = "q.copy(), k.copy() (the same inputs)", "Rope numba: rope(q, k, positions)", \
        "Rope numba, separate out=: rope(q, k, positions, out=(q_out, k_out))"
    qk = "rotary.apply_qk numba"
    cands = {
        copy: lambda: (q.copy(), k.copy()),
        "compiled serial kernel alone (prepared arguments)": lambda: serial(*kargs),
        "compiled parallel kernel alone (prepared arguments)": lambda: parallel(*kargs),
        "compiled streamed kernel alone (its stream path compiled in, not taken here)": lambda: streamed(*kargs),
        new: lambda: rope(q, k, positions, seq_axis=1),
        sep: lambda: rope(q, k, positions, seq_axis=1, out=(qo, ko)),
        "Rope numba, in place: rope(q, k, positions, out=(q, k))": lambda: rope(qi, ki, positions, seq_axis=1,
                                                                                 out=(qi, ki)),
        qk: lambda: rotary.apply_qk(q, k, positions, spec=spec, seq_axis=1, backend="numba"),
    }
    print(f"decode q {q.shape} k {k.shape} fp32, best of {args.rounds} x {args.calls} calls (interleaved), "
          f"numba threads {__import__('numba').get_num_threads()}")
    print("| call | us per call |\n|---|---|")
    rounds = {}
    times = interleaved_us(cands, args.calls, args.rounds, rounds)
    for name, t in times.items():
        print(f"| {name} | {t:.1f} |")
    pairs = (("Rope new / copy", new, copy, 1.5), ("Rope out= / copy", sep, copy, 1.5),
             ("Rope out= / Rope new", sep, new, 1.1), ("apply_qk / Rope new", qk, new, 1.5))
    print("ratios (issue 23 targets), best / best: " + ", ".join(
        f"{label} {times[a] / times[b]:.2f} (<= {goal})" for label, a, b, goal in pairs))
    print("ratios, median over rounds of the same round's times: " + ", ".join(
        f"{label} {round_ratio(rounds, a, b):.2f}" for label, a, b, _ in pairs))

    # Rope's own Python work per Numba call: the prepared plan with the kernel replaced by a no-op
    real = nb.rotation.rotate_qk_serial, nb.rotation.rotate_qk_parallel
    nb.rotation.rotate_qk_serial = nb.rotation.rotate_qk_parallel = (lambda *a: True)   # True: rows in the table
    try:
        t = best_us(lambda: rope(q, k, positions, seq_axis=1), args.calls, args.rounds)
        t_sep = best_us(lambda: rope(q, k, positions, seq_axis=1, out=(qo, ko)), args.calls, args.rounds)
        t_qk = best_us(lambda: rotary.apply_qk(q, k, positions, spec=spec, seq_axis=1, backend="numba"), args.calls,
                       args.rounds)
    finally:
        nb.rotation.rotate_qk_serial, nb.rotation.rotate_qk_parallel = real
    print(f"| Rope numba, its own work per call (kernel replaced by a no-op) | {t:.1f} |")
    print(f"| Rope numba, separate out=, its own work per call (kernel replaced by a no-op) | {t_sep:.1f} |")
    print(f"| apply_qk numba, its own work per call (kernel replaced by a no-op) | {t_qk:.1f} |")

    # the CUDA launch path with a mocked kernel: Rope's host work per call. NumPy arrays stand in for
    # device arrays: their address is looked up (as cheap as CuPy's a.data.ptr), device positions are an
    # ndarray subclass from a "cupy" module (used as table rows with no host round trip, as on CuPy)
    launches = []
    dev_rope = rotary.Rope(spec, backend="numpy", dtype=np.float32, max_positions=8192, seq_axis=-2)
    addresses = {id(a): a.ctypes.data for a in (qi, ki)}
    hooks = dict(address=lambda a: addresses[id(a)] if id(a) in addresses else a.ctypes.data,
                 kernel=lambda grid, block, args, shared_mem=0: launches.append(args), empty=np.empty,
                 to_device=lambda a: a)
    dev_rope._prepare_device_path((qi, ki), (qi, ki), seq_axis=1, backend=cuda_backend, **hooks)
    pos_dev = positions.view(DevicePositions)
    pos_host = positions.copy()
    for label, pos in (("device positions", pos_dev), ("host NumPy positions: range check + copy to device", pos_host)):
        t = best_us(lambda: dev_rope(qi, ki, pos, seq_axis=1, out=(qi, ki)), args.calls, args.rounds)
        launches.clear()
        dev_rope(qi, ki, pos, seq_axis=1, out=(qi, ki))
        assert len(launches) == 1, "the CUDA path must launch exactly once per call"
        print(f"| Rope CUDA launch path, host time per call, kernel mocked (in place, {label}) | {t:.1f} |")


class DevicePositions(np.ndarray):
    """Stands for CuPy int64 positions in the mocked launch path."""


DevicePositions.__module__ = "cupy._bench_stand_in"


if __name__ == "__main__":
    main()
