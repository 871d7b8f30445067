"""``python -m rotary warm``: compile the Numba backend's kernels into Numba's on-disk cache ahead of use.

A kernel's first call in a process with an empty cache compiles it (seconds: linear attention most);
every later process loads the cached machine code instead. This command makes those first calls now,
on tiny inputs, for each dtype: the rotation kernels (serial and parallel, as ``apply_qk`` and a
``Rope`` call them), the linear-attention kernels (the chunked one, causal or not, with decay and
packed sequences, the one-token decode step, and the backward's) and the KV cache's (append and attention, serial and
parallel, float and int8 entries). The cache lives where Numba puts it: next to the
installed package (``__pycache__``) or under ``NUMBA_CACHE_DIR``, so run it as the user and with the
environment of the programs that will use it. Running it again costs a cache load per kernel.

Numba invalidates a cached kernel when the kernel's own source file changes; an edit to a helper it inlines
(``numba_kernels/simd.py``, ``common.py``) is caught on import by a digest of those files
(``numba_kernels.refresh_after_helper_edits``). ``--refresh`` marks the kernel files as changed by hand (their
modification time set to now) before compiling, so every process recompiles them once.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

HELP = "compile the Numba kernels into Numba's on-disk cache, so first calls load instead of compile"
EPILOG = """examples:
  python -m rotary warm                     # every kernel, float16 / float32 / float64 (minutes: the KV cache most)
  python -m rotary warm --dtypes float32    # only the float32 kernels
  python -m rotary warm --kernels rotation kv_cache   # a server's: RoPE and the KV cache, no linear attention
  NUMBA_CACHE_DIR=/opt/cache python -m rotary warm   # the cache a service reads with the same setting
  python -m rotary warm --refresh           # after editing a kernel helper: recompile every kernel
"""
DTYPES = ("float16", "float32", "float64")
#: the families of kernels warm compiles (``--kernels``; :func:`warm_calls` groups its calls by them)
KERNELS = ("rotation", "linear_attention", "kv_cache")


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``warm`` on the subparsers of ``python -m rotary``."""
    parser = subparsers.add_parser("warm", help=HELP, description=HELP, epilog=EPILOG,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES), metavar="DTYPE",
                        help=f"the dtypes to compile for, from {', '.join(DTYPES)} (default: all)")
    parser.add_argument("--kernels", nargs="+", choices=KERNELS, default=list(KERNELS), metavar="FAMILY",
                        help=f"the kernel families to compile, from {', '.join(KERNELS)} (default: all; the KV cache's "
                             "take the longest)")
    parser.add_argument("--refresh", action="store_true",
                        help="mark the kernel sources as changed first, so cached kernels are compiled again")
    parser.set_defaults(func=run_cli)
    return parser


def warm_calls(dtype, kernels=KERNELS):
    """(label, call) pairs whose first calls compile every Numba kernel a call in ``dtype`` can reach, of the
    families ``kernels`` (:data:`KERNELS`)."""
    import rotary

    dt = np.dtype(dtype)
    rng = np.random.default_rng(0)

    def arr(*shape):
        return rng.standard_normal(shape).astype(dt)

    spec = rotary.RopeSpec(64)
    small_q, small_k = arr(1, 4, 2, 64), arr(1, 4, 1, 64)
    big_q, big_k = arr(1, 512, 4, 64), arr(1, 512, 2, 64)     # above the parallel kernel's size threshold
    q, k, v = arr(1, 6, 2, 64), arr(1, 6, 2, 64), arr(1, 6, 2, 64)
    rope = rotary.Rope(spec, backend="numba", dtype=dt)

    def linear(**kw):
        return lambda: rotary.linear_attention(q, k, v, seq_axis=1, spec=spec, backend="numba", **kw)

    def decode():
        _, state = rotary.linear_attention(q, k, v, causal=True, seq_axis=1, spec=spec, backend="numba",
                                           return_state=True)
        rotary.linear_attention(q[:, :1], k[:, :1], v[:, :1], causal=True, seq_axis=1, spec=spec, backend="numba",
                                state=state, positions=np.array([6]))

    def backward():
        from ..attn.linear_backward import linear_attention_backward

        linear_attention_backward(q, k, v, v, causal=True, seq_axis=1, spec=spec, backend="numba")
        _, saved = rotary.linear_attention(q, k, v, causal=True, seq_axis=1, spec=spec, backend="numba",
                                           save_for_backward=True)   # the forward keeping its chunk states
        linear_attention_backward(q, k, v, v, causal=True, seq_axis=1, spec=spec, backend="numba", saved=saved)

    def kv_cache(kv_dtype):
        def call():
            cache = rotary.KVCache(spec, batch=2, kv_heads=2, head_dim=64, capacity=2056, dtype=dt, kv_dtype=kv_dtype,
                                   backend="numba")
            keys = arr(2, 2048, 2, 64)
            cache.append(keys, keys)                    # the parallel append (2^20 elements of k and v)
            cache.append(keys[:, :1], keys[:, :1])      # a decode-sized one: serial
            rotary.attention(arr(2, 1, 4, 64), cache)   # parallel attention (thousands of keys)
            small = rotary.KVCache(spec, batch=1, kv_heads=1, head_dim=64, capacity=8, dtype=dt, kv_dtype=kv_dtype,
                                   backend="numba")
            small.append(arr(1, 2, 1, 64), arr(1, 2, 1, 64))
            rotary.attention(arr(1, 1, 1, 64), small)   # serial attention
            w = np.ones(64, np.float32)                 # Qwen3's q/k norms, fused: the same four kernels with them
            cache.append(keys[:, :1], keys[:, :1], k_norm=w)
            cache.attend(arr(2, 1, 4, 64), q_norm=w)
            small.append(arr(1, 1, 1, 64), arr(1, 1, 1, 64), k_norm=w)
            small.attend(arr(1, 1, 1, 64), q_norm=w)
            cache.reset()
            cache.append(keys, keys, k_norm=w)
        return call

    calls = {
        "rotation": [
            ("apply_qk, serial rotation kernel", lambda: rotary.apply_qk(small_q, small_k, seq_axis=1,
                                                                         backend="numba")),
            ("apply_qk, parallel rotation kernel", lambda: rotary.apply_qk(big_q, big_k, seq_axis=1, backend="numba")),
            ("Rope call (prepared rotation)", lambda: (rope(small_q, small_k, seq_axis=1),
                                                       rope(big_q, big_k, seq_axis=1))),
        ],
        "linear_attention": [
            ("linear_attention, causal and not", lambda: (linear(causal=True)(), linear(causal=False)())),
            ("linear_attention with decay", linear(causal=True, decay=np.full((1, 2), 0.9))),
            ("linear_attention, packed sequences", lambda: rotary.linear_attention(
                q, k, v, seq_axis=1, spec=spec, backend="numba", causal=True, cu_seqlens=np.array([0, 2, 6]))),
            ("linear_attention, one-token decode step", decode),
            ("linear_attention backward (training)", backward),
        ],
        "kv_cache": [
            ("KV cache append and attention", kv_cache(None)),
            ("KV cache, int8 entries", kv_cache("int8")),
        ],
    }
    return [pair for family in KERNELS if family in kernels for pair in calls[family]]


def run_cli(args) -> int:
    from .. import backends

    ok, reason = backends.available_backends().get("numba", (False, "unknown backend"))
    if not ok:
        print(f"the numba backend is unavailable here: {reason}")
        return 2
    import numba

    if getattr(args, "refresh", False):
        from ..backends import numba_kernels

        numba_kernels.mark_kernels_changed()   # Numba's cache stamp: the kernel files' modification time and size
    total = time.perf_counter()
    where = numba.config.CACHE_DIR or "unset: next to the package"
    print(f"compiling into Numba's on-disk cache (NUMBA_CACHE_DIR={where}):")
    for dtype in args.dtypes:
        for label, call in warm_calls(dtype, getattr(args, "kernels", KERNELS)):
            t0 = time.perf_counter()
            call()
            print(f"  {dtype:8s} {label:42s} {time.perf_counter() - t0:6.2f} s", flush=True)
    print(f"done in {time.perf_counter() - total:.1f} s; first calls in new processes now load from the cache")
    return 0
