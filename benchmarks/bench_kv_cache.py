"""rotary.KVCache on the Numba backend at Llama-3-8B decode shapes: 32 sequences, 8 k/v heads (32 q heads),
head_dim 128, float32, one new token per sequence, a contiguous cache of capacity 4096 holding ~1000 tokens.

    PYTHONPATH=. python benchmarks/bench_kv_cache.py [--rounds 7] [--calls 50] [--held 1000]
    PYTHONPATH=. python benchmarks/bench_kv_cache.py --quick      # fewer calls (a smoke run)

Three tables, in this order:

1. **append**: ``cache.append(k, v)`` (numba: k rotated into its slots, v copied, one kernel call) against plain
   copies of k and v (unrotated) into preallocated ``(B, capacity, Hk, D)`` stores: NumPy fancy indexing
   ``k_store[b, L] = k``, the same through a flat row index ``k_flat[b * capacity + L] = k``, and a Python loop of
   32 slice copies (the best plain NumPy copy is the fastest of these); and rotate-then-copy (``rotary.apply``
   numba, or a prepared ``rotary.Rope``, then the flat-index copy), and ``rotary.kv_append`` (the stateless
   primitive an engine calls) with prepared slots into pools of its own, and the run of a step's
   ``rotary.prepare_kv_append`` (prepared untimed, once per call's slots: a layer's call). Also the append kernel
   alone, serial and parallel (its prepared arguments, the slots advanced), and the frontend's own work per append
   (the kernel a no-op), of the cache, of ``kv_append`` and of the prepared run. Every candidate
   writes one position further each call (fresh lines, as appends do), into pools whose pages are all touched.
   The candidates are timed interleaved, round by round; best and median over rounds.
2. **decode attention** over a cache holding ~1000 keys per sequence (fp32): ``rotary.attention(q,
   cache)`` (the numba ``paged_attention`` kernel, q rotated as it reads it, keys read where they lie), the same step
   packed (``cu_seqlens``), a mixed step (one sequence's 16-query chunk with 31 decode tokens, pages in place),
   the kernel alone on rotated q, against ``torch.nn.functional.scaled_dot_product_attention`` on the same keys and values
   gathered beforehand into dense (B, Hk, L, D) tensors (``enable_gqa=True``; the gather not timed), and the
   NumPy reference (gather + the online-softmax engine, with ``--reference``). Threads: numba's and torch's
   defaults (the cores).
3. **paged-cache memory**: ``cache.nbytes`` against the tokens held, for a paged cache (page_size 16, pages for
   the full 32 x 4096) as it fills, next to the contiguous cache of the same capacity and int8 entries.

The machine's load average is printed with the tables: on a shared machine the figures move with it.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

import rotary


def interleaved_us(cands, calls, rounds, setup=None):
    """{name: per-round us per call} of the candidates, timed round by round (each round times every candidate
    once). ``setup(name)`` runs before each candidate's round (untimed)."""
    for name, fn in cands.items():
        if setup:
            setup(name)
        fn()
    times = {name: [] for name in cands}
    for _ in range(rounds):
        for name, fn in cands.items():
            if setup:
                setup(name)
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - t) / calls * 1e6)
    return times


def table(times, header, ratio_to=None):
    print(f"| {header} | best us | median us |" + (" median / baseline |" if ratio_to else ""))
    print("|---|---|---|" + ("---|" if ratio_to else ""))
    base = np.median(times[ratio_to]) if ratio_to else None
    for name, ts in times.items():
        extra = f" {np.median(ts) / base:.2f} |" if ratio_to else ""
        print(f"| {name} | {min(ts):.1f} | {np.median(ts):.1f} |" + extra)


def load():
    try:
        return "load average %.1f %.1f %.1f" % os.getloadavg()
    except OSError:
        return "load average unknown"


def bench_append(args, rng, cache, spec):
    from rotary.backends import numba as nb
    from rotary.backends import numba_runtime as runtime
    from rotary.backends.numba_kernels import kv_cache as kernels

    B, Hk, D, cap = 32, 8, 128, args.capacity
    k = rng.standard_normal((B, 1, Hk, D), dtype=np.float32)
    v = rng.standard_normal((B, 1, Hk, D), dtype=np.float32)
    k_store = np.empty((B, cap, Hk, D), np.float32)   # the plain caches: every page touched, as the cache's are
    v_store = np.empty((B, cap, Hk, D), np.float32)
    k_store.fill(0)
    v_store.fill(0)
    k_flat, v_flat = k_store.reshape(B * cap, Hk * D), v_store.reshape(B * cap, Hk * D)
    b = np.arange(B)
    state = {}
    rope = rotary.Rope(spec, backend="numba", dtype=np.float32, max_positions=cap, seq_axis=-2)
    k2, v2 = k.reshape(B, Hk * D), v.reshape(B, Hk * D)

    def fancy():
        L = next(state["L"])
        k_store[b, L] = k[:, 0]
        v_store[b, L] = v[:, 0]

    def flat():
        rows = b * cap + next(state["L"])
        k_flat[rows] = k2
        v_flat[rows] = v2

    def loop():
        for i, L in enumerate(next(state["L"]).tolist()):
            k_store[i, L] = k[i, 0]
            v_store[i, L] = v[i, 0]

    def rotate_then_copy():
        L = next(state["L"])
        kr = rotary.apply(k, L[:, None], spec=spec, seq_axis=1, backend="numba")
        rows = b * cap + L
        k_flat[rows] = kr.reshape(B, Hk * D)
        v_flat[rows] = v2

    def rope_then_copy():
        L = next(state["L"])
        kr = rope.apply(k, L[:, None], seq_axis=1)
        rows = b * cap + L
        k_flat[rows] = kr.reshape(B, Hk * D)
        v_flat[rows] = v2

    captured = {}
    launch = runtime.launch

    def capture(kernel, serial, kargs):
        captured["call"] = (kernel, kargs)
        return launch(kernel, serial, kargs)

    runtime.launch = capture
    try:
        cache.append(k, v)
    finally:
        runtime.launch = launch
    kernel, kargs = captured["call"]
    append = f"cache.append(k, v) numba (rotate k + write k, v; {kernel.__name__.split('_')[-1]} kernel by the size rule)"
    serial, parallel = kernels.append_kv_serial, kernels.append_kv_parallel
    # the primitive on the engine's own pools, the slots and positions prepared by the engine (host int64)
    k_pool, v_pool = k_store.reshape(B * cap // 16, 16, Hk, D), v_store.reshape(B * cap // 16, 16, Hk, D)
    kt, vt = k.reshape(B, Hk, D), v.reshape(B, Hk, D)

    def primitive():
        L = next(state["L"])
        rotary.kv_append(kt, vt, k_pool, v_pool, b * cap + L, L, spec=spec, backend="numba")

    def prepared():   # a step's append prepared once (untimed: setup), run per layer (here, per call)
        next(state["prepared"])(kt, vt, k_pool, v_pool)

    cands = {
        append: lambda: cache.append(k, v),
        "rotary.kv_append numba, prepared slots into the caller's pools": primitive,
        "rotary.prepare_kv_append's run (the step prepared once; a layer's call)": prepared,
        "append kernel alone, serial (prepared arguments)": lambda: serial(*kargs[:10], next(state["slots"]),
                                                                           *kargs[11:]),
        "append kernel alone, parallel (prepared arguments)": lambda: parallel(*kargs[:10], next(state["slots"]),
                                                                               *kargs[11:]),
        "plain copy, fancy index k_store[b, L] = k (unrotated)": fancy,
        "plain copy, flat row index k_flat[b * cap + L] = k (unrotated)": flat,
        "plain copy, Python loop of 32 slice copies (unrotated)": loop,
        "rotary.apply numba, then the flat-index copy": rotate_then_copy,
        "rotary.Rope numba (prepared), then the flat-index copy": rope_then_copy,
    }
    room = cap - args.held - 1
    total = (2 * args.rounds + 3) * args.calls
    if total > room:
        raise SystemExit(f"--rounds x --calls appends ({total}) do not fit the cache's room ({room}): fewer calls")

    def setup(name):
        """The plain copies write where the cache's next appends go, one position further each call, as
        cache.append does (fresh lines, not the same hot ones round after round)."""
        start = cache.lengths.copy()
        state["L"] = iter([start + i for i in range(args.calls + 1)])
        state["slots"] = iter([b * cap + start + i for i in range(args.calls + 1)])   # the kernel alone: slots
        if name.startswith("rotary.prepare_kv_append") or name == "own":   # one prepared step per call
            state["prepared"] = iter([rotary.prepare_kv_append(kt, vt, k_pool, v_pool, b * cap + start + i, start + i,
                                                               spec=spec, backend="numba")
                                      for i in range(args.calls + 1)])

    times = interleaved_us(cands, args.calls, args.rounds, setup)
    print(f"\nappend: B={B} sequences x 1 token, {Hk} k/v heads x {D}, float32, capacity {cap}, "
          f"{args.held}+ tokens held; {args.rounds} rounds x {args.calls} calls, interleaved; "
          f"numba threads {__import__('numba').get_num_threads()}; {load()}")
    best_copy = min(("plain copy, fancy index k_store[b, L] = k (unrotated)",
                     "plain copy, flat row index k_flat[b * cap + L] = k (unrotated)",
                     "plain copy, Python loop of 32 slice copies (unrotated)"), key=lambda n: np.median(times[n]))
    table(times, "call", ratio_to=best_copy)
    print(f"(baseline: the best plain copy by median: {best_copy})")
    # the frontend's own work per append: every kernel launch a no-op (the lengths still advance)
    runtime.launch = lambda kernel, serial, kargs: None
    try:
        setup("own")
        own = interleaved_us({"cache.append": lambda: cache.append(k, v), "rotary.kv_append": primitive,
                              "rotary.prepare_kv_append's run": prepared}, args.calls, args.rounds,
                             lambda name: setup("own"))
    finally:
        runtime.launch = launch
    for name, ts in own.items():
        print(f"| {name}, its own work per call (the kernel launch a no-op) | {min(ts):.1f} | "
              f"{np.median(ts):.1f} | |")


def bench_attention(args, rng, cache, spec):
    import torch

    from rotary.backends import numba as nb

    B, Hk, D, Hq = cache.batch, cache.kv_heads, cache.head_dim, 32
    q = rng.standard_normal((B, 1, Hq, D), dtype=np.float32)
    lengths = cache.lengths.copy()
    L = int(lengths.min())
    assert np.all(lengths == L), "the benchmark keeps every sequence at one length"
    q_rot = rotary.apply(q, lengths[:, None] - 1, spec=spec, seq_axis=1, backend="numba")
    keys = np.stack([cache.keys(b) for b in range(B)]).transpose(0, 2, 1, 3)      # (B, Hk, L, D)
    values = np.stack([cache.values(b) for b in range(B)]).transpose(0, 2, 1, 3)
    tq = torch.from_numpy(np.ascontiguousarray(q_rot.transpose(0, 2, 1, 3)))      # (B, Hq, 1, D)
    tk, tv = torch.from_numpy(np.ascontiguousarray(keys)), torch.from_numpy(np.ascontiguousarray(values))
    scale = 1.0 / np.sqrt(D)
    block_table = np.ascontiguousarray(cache.block_table)
    q_packed = np.ascontiguousarray(q_rot.reshape(B, Hq, D))
    starts = np.arange(B + 1, dtype=np.int64)

    def kernel():
        return nb.paged_attention(q_packed, cache.stores, block_table, cache.page_size, lengths, starts, scale=scale,
                                  softcap=None, window=None, causal=True, kv_dtype=None).reshape(q.shape)

    # a mixed step: sequence 0 brings a chunk of 16 queries (its keys read once for all 16), the rest decode
    chunk = 16
    q_mixed = rng.standard_normal((B - 1 + chunk, Hq, D), dtype=np.float32)
    cu_mixed = np.concatenate([[0], np.cumsum([chunk] + [1] * (B - 1))])

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, scale=scale, enable_gqa=True)

    ours = kernel()
    theirs = sdpa().numpy().transpose(0, 2, 1, 3)
    err = float(np.abs(ours - theirs).max() / np.abs(theirs).max())
    q_one = np.ascontiguousarray(q.reshape(B, Hq, D))
    cands = {
        "rotary.attention(q, cache) numba, dense decode (q rotated inside the paged_attention kernel)":
            lambda: rotary.attention(q, cache),
        "rotary.attention(q, cache, cu_seqlens) numba, the same step packed": lambda: rotary.attention(
            q_one, cache, cu_seqlens=starts),
        f"mixed step: one sequence's {chunk}-query chunk + {B - 1} decode tokens, packed (pages in place)":
            lambda: rotary.attention(q_mixed, cache, cu_seqlens=cu_mixed),
        "numba paged_attention alone (rotated q, through the block table)": kernel,
        "torch scaled_dot_product_attention (keys/values gathered beforehand, enable_gqa)": sdpa,
    }
    if args.reference:
        cands["reference path: NumPy backend (gather through the table + the online-softmax engine)"] = \
            lambda: rotary.paged_attention(q, cache.k_pool, cache.v_pool, cache.block_table, lengths, spec=spec,
                                           backend="numpy")
    calls = max(1, args.calls // 10)
    times = interleaved_us(cands, calls, args.rounds)
    kv_mb = 2 * keys.nbytes / 2**20
    print(f"\ndecode attention: B={B}, q {Hq} heads / k,v {Hk} heads x {D}, {L} keys each (K+V {kv_mb:.0f} MiB), "
          f"float32, causal; {args.rounds} rounds x {calls} calls, interleaved; numba threads "
          f"{__import__('numba').get_num_threads()}, torch threads {torch.get_num_threads()}; {load()}")
    table(times, "call", ratio_to="torch scaled_dot_product_attention (keys/values gathered beforehand, enable_gqa)")
    best = min(np.median(t) for t in times.values())
    print(f"(kernel vs torch: max |diff| / max |o| = {err:.1e}; K+V read at the fastest median: "
          f"{kv_mb * 2**20 / best / 1e3:.1f} GB/s)")


def bench_memory(args, rng):
    B, Hk, D, cap, ps = 32, 8, 128, args.capacity, 16
    spec = rotary.RopeSpec(D)
    contiguous = rotary.KVCache(spec, batch=B, kv_heads=Hk, head_dim=D, capacity=cap, backend="numba")
    print(f"\npaged-cache memory: B={B}, {Hk} k/v heads x {D}, float32, page_size {ps}, pool of {B * cap // ps} pages "
          f"(the contiguous cache of capacity {cap}: {contiguous.nbytes / 2**20:.0f} MiB)")
    print("| tokens held per sequence | tokens' own bytes MiB | paged cache.nbytes MiB | paged int8 cache.nbytes MiB "
          "| contiguous cache.nbytes MiB |\n|---|---|---|---|---|")
    del contiguous
    caches = [rotary.KVCache(spec, batch=B, kv_heads=Hk, head_dim=D, page_size=ps, num_pages=B * cap // ps,
                             kv_dtype=kv, backend="numba") for kv in (None, "int8")]
    chunk = rng.standard_normal((B, 125, Hk, D), dtype=np.float32)
    held = 0
    for target in (1, 125, 250, 500, 1000, 2000):
        while held < target:
            step = min(target - held, chunk.shape[1])
            for cache in caches:
                cache.append(chunk[:, :step], chunk[:, :step])
            held += step
        own = 2 * B * held * Hk * D * 4
        contiguous_bytes = 2 * B * cap * Hk * D * 4
        print(f"| {held} | {own / 2**20:.1f} | {caches[0].nbytes / 2**20:.1f} | {caches[1].nbytes / 2**20:.1f} "
              f"| {contiguous_bytes / 2**20:.0f} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=50, help="append calls per round (attention: a tenth)")
    ap.add_argument("--held", type=int, default=1000, help="tokens each sequence holds before the appends")
    ap.add_argument("--capacity", type=int, default=4096)
    ap.add_argument("--reference", action="store_true", help="also time the gather + rotary.attention path")
    ap.add_argument("--quick", action="store_true", help="3 rounds x 10 calls")
    ap.add_argument("--skip", nargs="*", default=(), choices=("append", "attention", "memory"))
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.calls = 3, 10
    rng = np.random.default_rng(0)
    # the appends first, before torch runs: torch's OpenMP threads, spinning after its calls, took the cores from
    # numba's parallel append (7 ms a call measured after the attention table, 9 us before it, 2 cores)
    for section in ("append", "attention"):
        if section not in args.skip:
            cache, spec = _filled(args, rng)   # a fresh cache holding `held` tokens per sequence
            (bench_append if section == "append" else bench_attention)(args, rng, cache, spec)
            del cache
    if "memory" not in args.skip:
        bench_memory(args, rng)


def _filled(args, rng):
    """The decode cache holding ``args.held`` tokens per sequence, every page of its pool touched (zeros past
    the tokens held, as a cache in use has touched them: no first-touch page faults in the timings)."""
    spec = rotary.RopeSpec(128, base=500000.0)
    cache = rotary.KVCache(spec, batch=32, kv_heads=8, head_dim=128, capacity=args.capacity, backend="numba")
    for store in cache.stores:
        if store is not None:
            store.fill(0)
    fill = rng.standard_normal((32, args.held, 8, 128), dtype=np.float32)
    cache.append(fill, fill)
    return cache, spec


if __name__ == "__main__":
    main()
