"""rotary.KVCache as an engine's cache, Numba backend, Llama-3-8B layer shapes (8 k/v heads x 128, 32 q heads, fp32):

    PYTHONPATH=. python benchmarks/bench_kv_engine.py [--rounds 5] [--held 1000] [--layers 32]

1. **A decode step of 32 layers on one pool** (32 sequences x 1 token, ``layers=32``): per layer ``layer.append(k, v)``
   then ``layer.attend(q)`` (``layer = cache.layer(i)``; also through ``cache.append(..., layer=i)`` and
   ``rotary.attention(q, cache.layer(i))``), against the same kernels called alone on prepared arguments (a step's
   launches captured and replayed: each layer's append on the step's slots and its paged attention, which rotates
   q, over its own pools), and the step with every kernel launch replaced by a no-op: the cache's host work per layer (the issue's bound: 5 us per layer). Every step adds a token
   to each sequence (no rollback between rounds: a page is taken every 16 steps, as in decoding). Then the step of a
   Qwen3-style model, q and k normed per head before RoPE (each layer's own weights): fused (``append(k_norm=)``,
   ``attend(q_norm=)``) against a separate NumPy norm pass before the plain calls, and its host work per layer.
2. **fork** of a 4096-token sequence (page_size 16): the time and the pages it takes (a shared prefix: no token
   copied), against copying the sequence's keys and values.
3. **prefix reuse**: a 1024-token prompt added a second time with ``add(tokens=prompt)``: the tokens left to
   prefill, the time of add, and the pool's pages in use, against prefilling it again (append of every layer).

The machine's load average is printed: on a shared machine the figures move with it.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

import rotary


def load():
    try:
        return "load average %.1f %.1f %.1f" % os.getloadavg()
    except OSError:
        return "load average unknown"


def best_median(fn, rounds, calls=1):
    fn()
    ts = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        ts.append((time.perf_counter() - t) / calls)
    return min(ts), float(np.median(ts))


def bench_step(args, rng):
    from rotary.backends import numba as nb
    from rotary.backends import numba_runtime as runtime

    B, Hk, Hq, D, L = 32, 8, 32, 128, args.layers
    held = args.held
    steps = 7 * args.rounds + 8   # every step below adds one token to each sequence (a page every 16 steps)
    spec = rotary.RopeSpec(D, base=500000.0)
    cache = rotary.KVCache(spec, batch=B, kv_heads=Hk, head_dim=D, page_size=16,
                           num_pages=B * -(-(held + steps) // 16), layers=L, backend="numba")
    fill = rng.standard_normal((B, held, Hk, D), dtype=np.float32)
    for i in range(L):
        cache.append(fill, fill, layer=i)
    del fill
    k = rng.standard_normal((B, 1, Hk, D), dtype=np.float32)
    q = rng.standard_normal((B, 1, Hq, D), dtype=np.float32)
    layers = [cache.layer(i) for i in range(L)]

    def step():   # an engine's decode step: per layer, its append, then its attention
        for layer in layers:
            layer.append(k, k)
            layer.attend(q)

    k_norms, q_norms = (1 + 0.1 * rng.standard_normal((2, L, D))).astype(np.float32)

    def step_normed():   # Qwen3 / Gemma 3: q and k normed per head before RoPE, fused into the cache's kernels
        for layer, k_norm, q_norm in zip(layers, k_norms, q_norms):
            layer.append(k, k, k_norm=k_norm, norm_eps=1e-6)
            layer.attend(q, q_norm=q_norm, norm_eps=1e-6)

    def rms(x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(1e-6)) * w

    def step_norm_pass():   # the same norms as a NumPy pass before the plain calls
        for layer, k_norm, q_norm in zip(layers, k_norms, q_norms):
            layer.append(rms(k, k_norm), k)
            layer.attend(rms(q, q_norm))

    def step_frontend():   # the same through cache.append(layer=) and rotary.attention(q, cache.layer(i))
        for i in range(L):
            cache.append(k, k, layer=i)
            rotary.attention(q, cache.layer(i))

    # the kernels alone, on prepared arguments: every kernel a whole step launches (per layer the append and the paged
    # attention, which rotates q as it reads it), each layer's own pools, replayed in order
    captured = []
    launch = runtime.launch
    runtime.launch = lambda kernel, serial, kargs: (captured.append((kernel, kargs)), launch(kernel, serial, kargs))[1]
    try:
        step()
    finally:
        runtime.launch = launch
    names = sorted({kernel.__name__ for kernel, _ in captured})
    assert len(captured) == 2 * L and any("append" in n for n in names) and any("paged" in n for n in names), names

    def kernels():
        for kernel, kargs in captured:
            kernel(*kargs)

    t_step = best_median(step, args.rounds)
    t_front = best_median(step_frontend, args.rounds)
    t_kernels = best_median(kernels, args.rounds)
    t_normed = best_median(step_normed, args.rounds)
    t_norm_pass = best_median(step_norm_pass, args.rounds)
    runtime.launch = lambda kernel, serial, kargs: True   # every kernel a no-op: what is left is the host's work
    try:
        t_host = best_median(step, args.rounds)
        t_host_front = best_median(step_frontend, args.rounds)
        t_host_normed = best_median(step_normed, args.rounds)
    finally:
        runtime.launch = launch
    assert cache.free_pages >= 0 and int(cache.lengths.max()) <= held + steps
    per_layer = [t / L * 1e6 for t in t_host]
    per_layer_front = [t / L * 1e6 for t in t_host_front]
    print(f"\ndecode step, {L} layers on one pool: B={B} x 1 token, {Hk} k/v heads x {D}, {Hq} q heads, fp32, "
          f"{held}+ keys held; numba threads {nb.numba.get_num_threads()}; {args.rounds} rounds; {load()}")
    print("| what | best ms | median ms |\n|---|---|---|")
    print(f"| the step: per layer layer.append(k, v) + layer.attend(q) (layer = cache.layer(i)) | "
          f"{t_step[0] * 1e3:.2f} | {t_step[1] * 1e3:.2f} |")
    print(f"| the same through cache.append(k, v, layer=i) + rotary.attention(q, cache.layer(i)) | "
          f"{t_front[0] * 1e3:.2f} | {t_front[1] * 1e3:.2f} |")
    print(f"| the kernels alone: the step's {len(captured)} launches ({' / '.join(names)}), prepared arguments | "
          f"{t_kernels[0] * 1e3:.2f} | {t_kernels[1] * 1e3:.2f} |")
    print(f"| the step with every kernel launch a no-op (the host's work) | {t_host[0] * 1e3:.2f} | "
          f"{t_host[1] * 1e3:.2f} |")
    print(f"| host work per layer (append + attention, the step's books included), us | {per_layer[0]:.1f} | "
          f"{per_layer[1]:.1f} |")
    print(f"| host work per layer through cache.append(layer=) + rotary.attention, us | {per_layer_front[0]:.1f} | "
          f"{per_layer_front[1]:.1f} |")
    print(f"| q and k normed per head (Qwen3): append(k_norm=) + attend(q_norm=), fused | {t_normed[0] * 1e3:.2f} | "
          f"{t_normed[1] * 1e3:.2f} |")
    print(f"| the same norms as a NumPy pass before the plain calls | {t_norm_pass[0] * 1e3:.2f} | "
          f"{t_norm_pass[1] * 1e3:.2f} |")
    print(f"| host work per layer with the fused norms, us | {t_host_normed[0] / L * 1e6:.1f} | "
          f"{t_host_normed[1] / L * 1e6:.1f} |")


def bench_fork(args, rng):
    B, Hk, D, n = 4, 8, 128, 4096
    cache = rotary.KVCache(rotary.RopeSpec(D), batch=B, kv_heads=Hk, head_dim=D, page_size=16,
                           num_pages=B * n // 16 + 8, backend="numba")
    fill = rng.standard_normal((1, n, Hk, D), dtype=np.float32)
    cache.append(fill, fill, seq_ids=[0])
    before = cache.free_pages

    def fork():
        dst = cache.fork(0)
        cache.free([dst])

    t = best_median(fork, args.rounds, calls=20)
    dst = cache.fork(0)
    taken = before - cache.free_pages
    cache.free([dst])
    keys = cache.keys(0)
    t_copy = best_median(lambda: (cache.keys(0).copy(), cache.values(0).copy()), args.rounds)
    print(f"\nfork of a {n}-token sequence ({n // 16} pages of 16), 8 k/v heads x 128 fp32 "
          f"({2 * keys.nbytes / 2**20:.0f} MiB of keys and values); {load()}")
    print("| what | best us | median us | pages taken |\n|---|---|---|---|")
    print(f"| cache.fork(0) (pages shared) + free | {t[0] * 1e6:.1f} | {t[1] * 1e6:.1f} | {taken} |")
    print(f"| copying the sequence's keys and values (gather + copy) | {t_copy[0] * 1e6:.0f} | {t_copy[1] * 1e6:.0f} "
          f"| {n // 16} |")


def bench_prefix(args, rng):
    B, Hk, D, L, n = 4, 8, 128, 4, 1024
    spec = rotary.RopeSpec(D, base=500000.0)
    cache = rotary.KVCache(spec, batch=B, kv_heads=Hk, head_dim=D, page_size=16, num_pages=B * (n + 16) // 16,
                           layers=L, backend="numba")
    prompt = list(rng.integers(0, 32000, n))
    k = rng.standard_normal((1, n, Hk, D), dtype=np.float32)
    a = cache.add(tokens=prompt)
    for i in range(L):
        cache.append(k, k, seq_ids=[a], layer=i)
    in_use = cache.num_pages - cache.free_pages

    def prefill():
        b = cache.add()
        for i in range(L):
            cache.append(k, k, seq_ids=[b], layer=i)
        cache.free([b])

    def reuse():
        b = cache.add(tokens=prompt)
        left = n - int(cache.lengths[b])
        for i in range(L):
            cache.append(k[:, -left:], k[:, -left:], seq_ids=[b], layer=i)
        cache.free([b])
        return left

    t_prefill = best_median(prefill, args.rounds)
    t_reuse = best_median(reuse, args.rounds)
    b = cache.add(tokens=prompt)
    left = n - int(cache.lengths[b])
    for i in range(L):
        cache.append(k[:, -left:], k[:, -left:], seq_ids=[b], layer=i)
    pages_second = cache.num_pages - cache.free_pages - in_use
    print(f"\nprefix reuse: a {n}-token prompt added again (page_size 16, {L} layers, 8 k/v heads x 128 fp32); "
          f"{load()}")
    print("| what | best ms | median ms | tokens prefilled | new pages |\n|---|---|---|---|---|")
    print(f"| add() + append of the whole prompt, every layer | {t_prefill[0] * 1e3:.2f} | {t_prefill[1] * 1e3:.2f} | "
          f"{n} | {n // 16} |")
    print(f"| add(tokens=prompt) + append of what is not cached, every layer | {t_reuse[0] * 1e3:.2f} | "
          f"{t_reuse[1] * 1e3:.2f} | {left} | {pages_second} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--held", type=int, default=1000)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--quick", action="store_true", help="3 rounds, 4 layers, 256 keys held")
    ap.add_argument("--skip", nargs="*", default=(), choices=("step", "fork", "prefix"))
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.layers, args.held = 3, 4, 256
    rng = np.random.default_rng(0)
    for name, fn in (("step", bench_step), ("fork", bench_fork), ("prefix", bench_prefix)):
        if name not in args.skip:
            fn(args, rng)


if __name__ == "__main__":
    main()
