"""GPU check for the CuPy backend: speed as fractions of this machine's own limits, measured in the same run.

    python benchmarks/gpu_check.py [--out DIR] [--quick]

1. Device-to-device copy bandwidth (cudaMemcpyAsync and a CuPy copy kernel; the best of the two) is the
   memory roof: bytes moved = 2 x size (read + write).
2. apply_qk at prefill: 65536 tokens, 32 q heads / 8 kv heads, d=128, fp16 and fp32. Bytes = read +
   write of q and k + one fp32 cos/sin row per token. Reported as a fraction of the copy bandwidth
   (goal >= 0.9), for the kernel alone (CUDA events around pre-planned launches) and for the whole
   ``rotary.apply_qk`` call.
3. Decode: 1 token x 32 sequences (per-sequence positions), 32/8 heads, d=128, fp16: microseconds per
   q+k call, GPU time (events) and host wall time per call (goal <= 10 us).
4. Causal linear attention, fp32, B*H = 128, T = 8192, m = dv = 128: GFLOP/s counting
   4*B*H*T*m*(C + dv) FLOP (C = the kernel's chunk), as a fraction of the fp32 FMA peak computed from
   the device's SM count and clock (goal >= 0.4). Also RetNet retention against it (goal <= 1.2x), and a
   ragged packed batch (64 sequences of 1..1024 tokens, cu_seqlens) in one launch against one launch per
   sequence (time ratio and the largest output/state difference, expected ~0).
5. KV cache (cuda_kernels/kv_cache.cu through the CuPy backend's ``append_kv`` and ``paged_attention``): for fp32 /
   fp16 with each KV format (None, int8, float8_e4m3) and fp64 (None, int8), the append of a paged pool (ragged
   sequences, one forking another's first page, padding tokens with slot -1) bit for bit against
   ``kv_entries.append_kv`` on the host, and paged attention (GQA 8:2; a mixed launch of prefill chunks and decode
   steps, dense decode, window + softcap, non-causal) against a float64 oracle within 2e-6 (fp32), 2e-3 (fp16),
   1e-12 (fp64) of max |o|; with the per-head RMSNorm before RoPE (Qwen3 / Gemma 3's k_norm and q_norm, fp32 cast
   and fp16 int8 entries): the normed, rotated keys against a float64 oracle (norm, then float64 angles; int8 within
   half a quantization step), the values as without the norm (bits), and attention with the q norm and the q
   rotation fused (mixed prefill + decode) against the float64 oracle. Speed: the append of a prefill chunk (16384
   tokens, 8 kv heads, d=128, fp16, paged slot order) as a planned launch against ``cupy.copyto`` of k and v (time
   ratio, goal <= 1.5 for fp16 entries) and as a fraction of the copy bandwidth; microseconds per paged_attention
   launch over 32 sequences of 2048 keys (32 q / 8 kv heads, fp16 and int8 entries), dense decode and with one
   512-token prefill chunk mixed in, and the pool's bytes over that time against the copy bandwidth; host
   microseconds per ``KVCache.append`` decode step (32 sequences x 1 token). Decode attention at the memory limit
   (``paged_attention_decode``): 32 sequences x 2048 keys and batch 1 x 32768 keys (Llama-3-8B: 32/8 heads, d=128),
   fp16 and int8 entries, against a device-to-device copy of the same K+V bytes in the same run (goal >= 0.7 of the
   copy bandwidth), at the split rule's count and a sweep of forced split counts.
   Linear attention's backward (cuda_kernels/linear_backward.cu): dq, dk, dv of the causal fp32 problem of 4 (B*H =
   128, T = 8192, m = dv = 128) against the forward's time on it, at several shared-memory budgets and block sizes
   (goal, for information: <= 3x the forward, the Numba backward's ratio on a CPU); and a GQA problem with decay,
   state and a gradient on the state out against the host's backward (fp64 within 1e-9 of the largest entry).
6. Roofline: each measured kernel time against benchmarks/cuda_resources.py's estimate (max of bytes over the
   copy bandwidth and FLOP over the FP32 peak, both of this device), as the fraction estimate / measured.
Writes gpu_check.json (and prints a summary). Nothing is installed or downloaded.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parent))   # benchmarks/cuda_resources.py (roofline)

import numpy as np  # noqa: E402


def _events_time(cupy, fn, repeats: int) -> float:
    """Median seconds per call of fn() on the current stream (CUDA events, after 3 warm-ups)."""
    for _ in range(3):
        fn()
    cupy.cuda.get_current_stream().synchronize()
    times = []
    for _ in range(5):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        for _ in range(repeats):
            fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop) / 1e3 / repeats)
    return float(np.median(times))


def copy_bandwidth(cupy, nbytes: int) -> dict:
    src = cupy.ones(nbytes // 4, dtype=cupy.float32)
    dst = cupy.empty_like(src)
    stream = cupy.cuda.get_current_stream().ptr
    kind = cupy.cuda.runtime.memcpyDeviceToDevice
    t_memcpy = _events_time(cupy, lambda: cupy.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, src.nbytes,
                                                                         kind, stream), 10)
    t_kernel = _events_time(cupy, lambda: cupy.copyto(dst, src), 10)
    moved = 2 * src.nbytes
    return {"bytes": moved, "memcpy_GBps": moved / t_memcpy / 1e9, "copy_kernel_GBps": moved / t_kernel / 1e9,
            "GBps": max(moved / t_memcpy, moved / t_kernel) / 1e9}


def fp32_fma_peak(cupy) -> dict:
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())
    major, minor = props["major"], props["minor"]
    lanes = 64 if (major, minor) in ((6, 0), (7, 0), (7, 2), (7, 5), (8, 0)) else 128
    sms = props["multiProcessorCount"]
    clock_khz = props.get("clockRate", 0)
    if not clock_khz:
        try:
            clock_khz = cupy.cuda.runtime.deviceGetAttribute(13, cupy.cuda.runtime.getDevice())  # cudaDevAttrClockRate
        except Exception:
            clock_khz = 0
    peak = 2 * lanes * sms * clock_khz * 1e3
    return {"sm_count": sms, "fp32_lanes_per_sm": lanes, "clock_MHz": clock_khz / 1e3, "GFLOPs": peak / 1e9,
            "name": props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])}


def prefill(cupy, rotary, cb, dtype, tokens: int, copy_GBps: float) -> dict:
    spec = rotary.RopeSpec(128)
    q = cupy.random.standard_normal((1, tokens, 32, 128), dtype=cupy.float32).astype(dtype)
    k = cupy.random.standard_normal((1, tokens, 8, 128), dtype=cupy.float32).astype(dtype)
    qo, ko = cupy.empty_like(q), cupy.empty_like(k)
    cos, sin = (cupy.asarray(a) for a in spec.cos_sin(np.arange(tokens), dtype=np.float32))
    rows = cupy.arange(tokens, dtype=cupy.int64)[None]
    plan = cb.plan_rotate([(q, qo), (k, ko)], cos, sin, rows, dtype_name=str(q.dtype), rotary_dim=128,
                          layout="half", inverse=False, address=lambda a: a.data.ptr)
    name = str(q.dtype)
    t_kernel = _events_time(cupy, lambda: cb._launch(plan, name), 20)
    t_call = _events_time(cupy, lambda: rotary.apply_qk(q, k, None, spec=spec, seq_axis=-3, out=(qo, ko),
                                                        backend="cupy"), 20)
    nbytes = 2 * (q.nbytes + k.nbytes) + tokens * 64 * 4 * 2 + tokens * 8
    return {"dtype": name, "tokens": tokens, "kernel": plan.kernel, "grid": plan.grid, "block": plan.block,
            "bytes": nbytes, "kernel_us": t_kernel * 1e6, "call_us": t_call * 1e6,
            "kernel_GBps": nbytes / t_kernel / 1e9, "kernel_fraction_of_copy": nbytes / t_kernel / 1e9 / copy_GBps,
            "call_fraction_of_copy": nbytes / t_call / 1e9 / copy_GBps}


def prefill_multi_axis(cupy, rotary, dtype, tokens: int) -> dict:
    """apply_qk through the frontend, 1-D against M-RoPE (3-axis positions of an image grid; per-token
    table rows gathered on the host, then copied to the device): the multi-axis overhead on the GPU."""
    q = cupy.random.standard_normal((1, tokens, 32, 128), dtype=cupy.float32).astype(dtype)
    k = cupy.random.standard_normal((1, tokens, 8, 128), dtype=cupy.float32).astype(dtype)
    qo, ko = cupy.empty_like(q), cupy.empty_like(k)
    side = int(np.sqrt(tokens))
    h, w = np.meshgrid(np.arange(tokens // side), np.arange(side), indexing="ij")
    pos = np.stack([np.zeros(h.size, np.int64), h.ravel(), w.ravel()], -1)[None]
    one_d, mrope = rotary.RopeSpec(128, base=1e6), rotary.RopeSpec(128, base=1e6, mrope_section=(16, 24, 24))
    t1 = _events_time(cupy, lambda: rotary.apply_qk(q, k, None, spec=one_d, seq_axis=-3, out=(qo, ko),
                                                    backend="cupy"), 10)
    tm = _events_time(cupy, lambda: rotary.apply_qk(q, k, pos, spec=mrope, seq_axis=-3, out=(qo, ko),
                                                    backend="cupy"), 10)
    return {"dtype": str(q.dtype), "tokens": int(h.size), "one_d_us": t1 * 1e6, "mrope_us": tm * 1e6,
            "mrope_over_one_d": tm / t1}


def decode(cupy, rotary, cb, batch: int = 32) -> dict:
    spec = rotary.RopeSpec(128)
    q = cupy.random.standard_normal((batch, 1, 32, 128), dtype=cupy.float32).astype(cupy.float16)
    k = cupy.random.standard_normal((batch, 1, 8, 128), dtype=cupy.float32).astype(cupy.float16)
    positions = np.random.default_rng(0).integers(100, 4000, size=(batch, 1))
    cos, sin = (cupy.asarray(a) for a in spec.cos_sin(np.arange(4096), dtype=np.float32))
    rows = cupy.asarray(positions.astype(np.int64))
    plan = cb.plan_rotate([(q, q), (k, k)], cos, sin, rows, dtype_name="float16", rotary_dim=128, layout="half",
                          inverse=False, address=lambda a: a.data.ptr)
    gpu_kernel = _events_time(cupy, lambda: cb._launch(plan, "float16"), 200)
    call = lambda: rotary.apply_qk(q, k, positions, spec=spec, seq_axis=-3, out=(q, k), backend="cupy")
    gpu_call = _events_time(cupy, call, 200)
    for _ in range(20):
        call()
    cupy.cuda.get_current_stream().synchronize()
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    cupy.cuda.get_current_stream().synchronize()
    wall_call = (time.perf_counter() - t0) / n
    t0 = time.perf_counter()
    for _ in range(n):
        cb._launch(plan, "float16")
    cupy.cuda.get_current_stream().synchronize()
    wall_kernel = (time.perf_counter() - t0) / n
    return {"batch": batch, "kernel": plan.kernel, "grid": plan.grid, "block": plan.block,
            "gpu_us_per_launch": gpu_kernel * 1e6, "gpu_us_per_apply_qk": gpu_call * 1e6,
            "host_wall_us_per_launch": wall_kernel * 1e6, "host_wall_us_per_apply_qk": wall_call * 1e6}


def linear_attention(cupy, cb, peak_GFLOPs: float, batch=4, heads=32, T=8192, d=128, dtype="float32",
                     retention=False) -> dict:
    """Causal linear attention at several shared-memory budgets (48 KiB needs no opt-in) and block sizes;
    the best is reported. ``retention``: RetNet's per-head decay, identity features, no denominator."""
    from rotary import RopeSpec

    spec = RopeSpec(d)
    q, k, v = (cupy.random.standard_normal((batch, T, heads, d), dtype=cupy.float32).astype(dtype) for _ in range(3))
    cos, sin = (cupy.asarray(a) for a in spec.cos_sin(np.arange(T), dtype=np.float32))
    rows = cupy.arange(T, dtype=cupy.int64)[None]
    kw = dict(rotary_dim=d, layout="half", causal=True, feature_map="elu", eps=1e-6, chunk=64, state=None)
    if retention:
        gammas = 1 - 2.0 ** (-5 - np.arange(heads))
        kw.update(feature_map="identity", normalize=False, decay=np.tile(gammas, (batch, 1)))
    optin = cb.max_shared_mem()
    budgets = sorted({cb.SHARED_MEM_LIMIT, min(optin, 100 * 1024), optin})
    runs = []
    saved = cb.LINEAR_ATTENTION_SHARED_MEM_LIMIT, cb.LINEAR_ATTENTION_THREADS
    reference = None
    try:
        for budget, threads in [(b, t) for b in budgets for t in (64, 128, 256)]:
            cb.LINEAR_ATTENTION_SHARED_MEM_LIMIT, cb.LINEAR_ATTENTION_THREADS = budget, threads
            _, _, chunk, dv_tile, smem = cb.linear_attention_geometry(batch, heads, d, d, 4, 64,
                                                                      shared_mem_limit=budget)
            try:
                t = _events_time(cupy, lambda: cb.linear_attention(q, k, v, cos, sin, rows, **kw), 2)
                o, _ = cb.linear_attention(q, k, v, cos, sin, rows, **kw)
                cupy.cuda.get_current_stream().synchronize()
                if reference is None:
                    reference = o
                diff = float(cupy.abs(o - reference).max() / cupy.abs(reference).max())
            except Exception as exc:
                runs.append({"budget": budget, "threads": threads, "error": f"{type(exc).__name__}: {exc}"})
                continue
            flop = 4 * batch * heads * T * d * (chunk + d)
            runs.append({"budget": budget, "threads": threads, "chunk": chunk, "dv_tile": dv_tile, "shared_mem": smem, "ms": t * 1e3,
                         "GFLOPs": flop / t / 1e9, "fraction_of_fp32_peak": flop / t / 1e9 / peak_GFLOPs,
                         "max_rel_diff_vs_first_budget": diff})
    finally:
        cb.LINEAR_ATTENTION_SHARED_MEM_LIMIT, cb.LINEAR_ATTENTION_THREADS = saved
    ok = [r for r in runs if "error" not in r]
    best = max(ok, key=lambda r: r["GFLOPs"]) if ok else {}
    return {"B": batch, "H": heads, "T": T, "m": d, "dv": d, "runs": runs, **best}


def linear_attention_backward(cupy, cb, batch=4, heads=32, T=8192, d=128, check_T=1000) -> dict:
    """The backward (cuda_kernels/linear_backward.cu: dq, dk, dv from dL/do) against the forward on the same causal
    fp32 problem (elu, state None), the forward at its default settings and the backward at several shared-memory
    budgets and block sizes (the best reported, its time over the forward's); and, on a smaller GQA problem with a
    decay, a carried state and a gradient on the state out (fp64 and fp32), the largest difference to the host's
    backward (the Numba kernels, else the NumPy reference), relative to the largest entry (expected ~1e-12 fp64,
    ~1e-5 fp32)."""
    from rotary import RopeSpec
    from rotary import backends as registry

    spec = RopeSpec(d)
    q, k, v, g = (cupy.random.standard_normal((batch, T, heads, d), dtype=cupy.float32) for _ in range(4))
    cos, sin = (cupy.asarray(a) for a in spec.cos_sin(np.arange(T), dtype=np.float32))
    rows = cupy.arange(T, dtype=cupy.int64)[None]
    kw = dict(rotary_dim=d, layout="half", causal=True, feature_map="elu", eps=1e-6, chunk=64, state=None)
    forward = _events_time(cupy, lambda: cb.linear_attention(q, k, v, cos, sin, rows, **kw), 2)
    optin = cb.max_shared_mem()
    budgets = sorted({cb.SHARED_MEM_LIMIT, min(optin, 100 * 1024), min(optin, cb.LINEAR_BACKWARD_SHARED_MEM_LIMIT),
                      optin})
    runs = []
    saved = cb.LINEAR_BACKWARD_SHARED_MEM_LIMIT, cb.LINEAR_BACKWARD_THREADS
    try:
        for budget, threads in [(b, t) for b in budgets for t in (128, 256)]:
            cb.LINEAR_BACKWARD_SHARED_MEM_LIMIT, cb.LINEAR_BACKWARD_THREADS = budget, threads
            geo = cb.linear_backward_geometry(batch, heads, d, d, 4, 64, threads=threads, shared_mem_limit=budget)
            try:
                t = _events_time(cupy, lambda: cb.linear_attention_backward(q, k, v, cos, sin, rows, g, **kw), 2)
            except Exception as exc:   # e.g. out of memory for the scratch of many dv tiles
                runs.append({"budget": budget, "threads": threads, "error": f"{type(exc).__name__}: {exc}"})
                continue
            finally:
                cupy.get_default_memory_pool().free_all_blocks()
            scratch = sum(cb.linear_backward_workspace(batch, T, heads, heads, d, d, geo).values()) * 4
            runs.append({"budget": budget, "threads": threads, "chunk": geo.chunk, "dv_tile": geo.dv_tile,
                         "n_tiles": geo.n_tiles, "shared_mem": geo.shared_mem, "scratch_GB": scratch / 1e9,
                         "ms": t * 1e3, "over_forward": t / forward})
    finally:
        cb.LINEAR_BACKWARD_SHARED_MEM_LIMIT, cb.LINEAR_BACKWARD_THREADS = saved
    ok = [r for r in runs if "error" not in r]
    best = min(ok, key=lambda r: r["ms"]) if ok else {}
    result = {"B": batch, "H": heads, "T": T, "m": d, "dv": d, "forward_ms": forward * 1e3, "runs": runs, **best}

    rng = np.random.default_rng(45)
    host = registry.get("numba") if registry.available_backends()["numba"][0] else registry.get("numpy")
    result["check_backend"] = host.NAME
    B, H, Hk, m, dv = 2, 4, 2, 64, 48
    for dtype in ("float64", "float32"):
        x = [rng.standard_normal(shape).astype(dtype) for shape in
             ((B, check_T, H, m), (B, check_T, Hk, m), (B, check_T, Hk, dv), (B, check_T, H, dv))]
        spec = RopeSpec(m, rotary_dim=48)
        c, s = spec.cos_sin(np.arange(check_T), dtype=np.dtype(dtype))
        state = (rng.standard_normal((B, Hk, m, dv)), np.abs(rng.standard_normal((B, Hk, m))) + 1.0)
        grad_state = (rng.standard_normal((B, Hk, m, dv)), rng.standard_normal((B, Hk, m)))
        opts = dict(rotary_dim=48, layout="interleaved", causal=True, feature_map="elu", eps=1e-6, chunk=64,
                    decay=rng.uniform(0.9, 1.0, (B, Hk)), normalize=True)
        host_rows = np.arange(check_T, dtype=np.int64)[None]
        want = host.linear_attention_backward(*x[:3], c, s, host_rows, x[3], state=state, grad_state=grad_state,
                                              **opts)
        dev = [cupy.asarray(a) for a in x]
        got = cb.linear_attention_backward(*dev[:3], cupy.asarray(c), cupy.asarray(s), cupy.asarray(host_rows),
                                           dev[3], state=tuple(cupy.asarray(a) for a in state),
                                           grad_state=tuple(cupy.asarray(a) for a in grad_state), **opts)
        errors = {}
        for name, a, b in zip(("dq", "dk", "dv", "dS", "dz"), got[:3] + tuple(got[3]), want[:3] + tuple(want[3])):
            a, b = cupy.asnumpy(a).astype(np.float64), np.asarray(b, np.float64)
            errors[name] = float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300))
        result[f"max_rel_diff_{dtype}"] = max(errors.values())
        result[f"rel_diff_{dtype}"] = errors
    return result


def linear_attention_ragged(cupy, cb, heads=16, d=64, n_seqs=64, max_len=1024) -> dict:
    """A ragged packed batch (cu_seqlens; lengths 1..max_len) in one launch against one launch per
    sequence; and the one-launch output against the per-sequence outputs (same kernel, same bits
    expected up to the order of blocks, which does not enter the sums)."""
    from rotary import RopeSpec

    rng = np.random.default_rng(0)
    lengths = rng.integers(1, max_len + 1, n_seqs)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    T = int(cu[-1])
    spec = RopeSpec(d)
    q, k, v = (cupy.random.standard_normal((1, T, heads, d), dtype=cupy.float32) for _ in range(3))
    pos = np.concatenate([np.arange(n) for n in lengths])
    cos, sin = (cupy.asarray(a) for a in spec.cos_sin(np.arange(max_len), dtype=np.float32))
    rows = cupy.asarray(pos, dtype=cupy.int64)[None]
    kw = dict(rotary_dim=d, layout="half", causal=True, feature_map="elu", eps=1e-6, chunk=64, state=None)

    def packed():
        return cb.linear_attention(q, k, v, cos, sin, rows, cu_seqlens=cu, **kw)

    def per_sequence():
        return [cb.linear_attention(q[:, a:b], k[:, a:b], v[:, a:b], cos, sin, rows[:, a:b], **kw)
                for a, b in zip(cu[:-1], cu[1:])]

    t_packed = _events_time(cupy, packed, 3)
    t_loop = _events_time(cupy, per_sequence, 1)
    o, (S, z) = packed()
    pieces = per_sequence()
    o_loop = cupy.concatenate([p[0] for p in pieces], axis=1)
    S_loop = cupy.concatenate([p[1][0] for p in pieces], axis=0)
    diff = float(cupy.abs(o - o_loop).max() / cupy.abs(o_loop).max())
    diff_s = float(cupy.abs(S - S_loop).max() / cupy.abs(S_loop).max())
    return {"n_seqs": n_seqs, "tokens": T, "H": heads, "d": d, "ms": t_packed * 1e3, "ms_per_sequence_loop":
            t_loop * 1e3, "speedup_vs_loop": t_loop / t_packed, "max_rel_diff_o": diff, "max_rel_diff_S": diff_s}


def _kv_oracle(q, stores, block_table, page_size, seq_lens, q_starts, *, kv_dtype, scale, softcap=None, window=None,
               causal=True):
    """float64 paged attention on the host (keys gathered through the block table, dequantized, an explicit masked
    softmax); the contract of rotary.backends' paged_attention."""
    from rotary.backends.kv_entries import FP8_VALUES

    k, v, ks, vs = stores
    if kv_dtype is None:
        K, V = k.astype(np.float64), v.astype(np.float64)
    else:
        decode = (lambda e: FP8_VALUES[e].astype(np.float64)) if kv_dtype == "float8_e4m3" else \
            (lambda e: e.astype(np.float64))
        K, V = decode(k) * ks[..., None], decode(v) * vs[..., None]
    T, Hq, D = q.shape
    group = Hq // K.shape[1]
    o = np.zeros((T, Hq, D))
    for i, L in enumerate(seq_lens):
        a, b = int(q_starts[i]), int(q_starts[i + 1])
        p = np.arange(L)
        slot = block_table[i, p // page_size] * page_size + p % page_size
        Ki, Vi = K[slot], V[slot]
        for j in range(b - a):
            pos = L - (b - a) + j
            seen = (p <= pos) & (pos - p < (window or L + 1)) if causal else np.ones(L, bool)
            if not seen.any():
                continue
            kh = np.repeat(Ki[seen], group, axis=1)   # (keys, Hq, D)
            s = scale * np.einsum("khd,hd->hk", kh, q[a + j].astype(np.float64))
            if softcap:
                s = softcap * np.tanh(s / softcap)
            w = np.exp(s - s.max(axis=1, keepdims=True))
            o[a + j] = np.einsum("hk,khd->hd", w / w.sum(axis=1, keepdims=True), np.repeat(Vi[seen], group, axis=1))
    return o


def _host_stores(fmt, shape, dtype, work):
    """Host stores (k entries, v entries, k scales, v scales) of format ``fmt`` for ``shape`` (slots, heads, d): NaN
    float entries (or zero quantized entries with NaN scales), so a slot the append misses shows."""
    if fmt.entry is None:
        return np.full(shape, np.nan, dtype), np.full(shape, np.nan, dtype), None, None
    return (np.zeros(shape, fmt.entry), np.zeros(shape, fmt.entry), np.full(shape[:2], np.nan, work),
            np.full(shape[:2], np.nan, work))


def _kv_pool(rng, seq_lens, page_size, heads, d):
    """A block table over a scattered page order for ``seq_lens`` (sequence 1 forks sequence 0's first page) and
    the append of every key (packed, with padding tokens: slot -1, row -1): (table, positions, slots, pages)."""
    pages = [-(-int(L) // page_size) for L in seq_lens]
    n_pages = sum(pages) + 1
    table = np.full((len(seq_lens), max(pages) + 1), n_pages - 1, np.int64)   # unused entries: an unwritten page
    order = iter(rng.permutation(n_pages - 1))
    for i, count in enumerate(pages):
        table[i, :count] = [next(order) for _ in range(count)]
    table[1, 0] = table[0, 0]
    positions, slots = [], []
    for i, L in enumerate(seq_lens):
        p = np.arange(page_size if i == 1 else 0, L)
        positions.append(p)
        slots.append(table[i, p // page_size] * page_size + p % page_size)
    positions, slots = np.concatenate(positions), np.concatenate(slots)
    pad = np.sort(rng.integers(0, len(slots), 3))
    return table, np.insert(positions, pad, -1), np.insert(slots, pad, -1), n_pages


def kv_cache_check(cupy, rotary, cb) -> dict:
    """The CuPy backend's KV primitives against the host (item 5 of the module docstring): ``append_kv`` bit for
    bit kv_entries.append_kv (padding tokens skipped), ``paged_attention`` against a float64 oracle; then the same
    with the per-head RMSNorm (:func:`kv_norm_check`)."""
    from rotary.backends import kv_entries

    rng = np.random.default_rng(0)
    spec = rotary.RopeSpec(64, rotary_dim=48, layout="interleaved", rotary_offset=8)
    seq_lens, page_size, heads, d = [37, 21, 63, 1, 140], 16, 2, 64
    cases = {   # name: (queries per sequence, keyword arguments)
        "mixed prefill + decode": ([5, 1, 63, 1, 1], {}),
        "decode": ([1] * 5, {}),
        "window + softcap": ([3, 2, 4, 1, 7], dict(window=50, softcap=30.0)),
        "non-causal": ([2, 1, 1, 1, 3], dict(causal=False)),
    }
    checks = []
    for dtype, kv_dtype in ((np.float32, None), (np.float32, "int8"), (np.float32, "float8_e4m3"),
                            (np.float16, None), (np.float16, "int8"), (np.float16, "float8_e4m3"),
                            (np.float64, None), (np.float64, "int8")):
        entry = {"dtype": np.dtype(dtype).name, "kv_dtype": kv_dtype}
        if kv_dtype == "float8_e4m3" and importlib.util.find_spec("ml_dtypes") is None:
            entry.update(ok=True, skipped="the host reference's float8 encoder needs ml_dtypes (not installed)")
            checks.append(entry)
            continue
        try:
            fmt = kv_entries.KV_FORMATS[kv_dtype]
            work = np.float64 if dtype == np.float64 else np.float32
            table, positions, slots, n_pages = _kv_pool(rng, seq_lens, page_size, heads, d)
            shape = (n_pages * page_size, heads, d)
            host = _host_stores(fmt, shape, dtype, work)
            dev = tuple(None if a is None else cupy.asarray(a) for a in host)
            k = rng.standard_normal((len(slots), heads, d)).astype(dtype)
            v = rng.standard_normal((len(slots), heads, d)).astype(dtype)
            cos, sin = (np.ascontiguousarray(a) for a in spec.cos_sin(np.arange(max(seq_lens)), dtype=work))
            cb.append_kv(cupy.asarray(k), cupy.asarray(v), cupy.asarray(cos), cupy.asarray(sin),
                         cupy.asarray(positions), cupy.asarray(slots), dev, rotary_dim=48, layout="interleaved",
                         offset=8, kv_dtype=kv_dtype)
            keep = slots >= 0
            kv_entries.append_kv(k[keep], v[keep], cos, sin, positions[keep], slots[keep], host, rotary_dim=48,
                                 layout="interleaved", offset=8, kv_dtype=kv_dtype)
            entry["append_bit_identical"] = all(
                b is None or np.array_equal(np.ascontiguousarray(cupy.asnumpy(a)).view(np.uint8),
                                            np.ascontiguousarray(b).view(np.uint8)) for a, b in zip(dev, host))
            lens = np.array(seq_lens, np.int64)
            table_dev, lens_dev = cupy.asarray(table), cupy.asarray(lens)
            tol = {np.float32: 2e-6, np.float16: 2e-3, np.float64: 1e-12}[dtype]
            worst = 0.0
            for name, (counts, kw) in cases.items():
                starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
                q = rng.standard_normal((int(starts[-1]), 8, d)).astype(dtype)
                kw = dict(dict(scale=d ** -0.5, softcap=None, window=None, causal=True), **kw)
                o = cb.paged_attention(cupy.asarray(q), dev, table_dev, page_size, lens_dev, cupy.asarray(starts),
                                       kv_dtype=kv_dtype, **kw)
                want = _kv_oracle(q, host, table, page_size, lens, starts, kv_dtype=kv_dtype, **kw)
                rel = float(np.abs(cupy.asnumpy(o).astype(np.float64) - want).max() / np.abs(want).max())
                entry[f"attention {name} rel diff"] = rel
                worst = max(worst, rel)
            entry["ok"] = bool(entry["append_bit_identical"] and worst <= tol)
        except Exception as exc:   # the other kinds still run; the failure is in the report
            entry.update(ok=False, error=f"{type(exc).__name__}: {exc}")
        checks.append(entry)
    checks += kv_norm_check(cupy, rotary, cb)
    return {"checks": checks, "all_ok": all(c["ok"] for c in checks)}


def _rms_norm64(x, weight, eps):
    """float64 per-head RMSNorm over the last axis: (x / sqrt(mean(x^2) + eps)) * weight."""
    x = np.asarray(x, np.float64)
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps) * np.asarray(weight, np.float64)


def _rotate64(x, positions, spec):
    """x (T, H, D) rotated at positions (T,) by the spec's float64 angles (its pairs, from its offset)."""
    from rotary.testing import rope_complex

    return rope_complex(x, np.asarray(positions, np.float64)[:, None], spec.inv_freq(), layout=spec.layout,
                        rotary_offset=spec.rotary_offset)


def kv_norm_check(cupy, rotary, cb) -> list:
    """The KV primitives with the per-head RMSNorm before RoPE (item 5 of the module docstring): ``append_kv`` with
    ``norm=(k_weight, eps)`` over a paged pool (padding tokens among the keys) and ``paged_attention`` with
    ``norm=(q_weight, eps)`` and the q rotation fused, for fp32 cast and fp16 int8 entries, against float64
    oracles; one entry per format (``ok``, the errors), as kv_cache_check's."""
    from rotary.backends import kv_entries

    rng = np.random.default_rng(5)
    spec = rotary.RopeSpec(64, rotary_dim=48, layout="interleaved", rotary_offset=8)
    seq_lens, page_size, heads, d = [37, 21, 63, 1, 140], 16, 2, 64
    counts = [5, 1, 63, 1, 1]   # mixed prefill chunks and decode steps
    checks = []
    for dtype, kv_dtype in ((np.float32, None), (np.float16, "int8")):
        entry = {"dtype": np.dtype(dtype).name, "kv_dtype": kv_dtype, "norm": True}
        try:
            fmt = kv_entries.KV_FORMATS[kv_dtype]
            work = np.float32
            table, positions, slots, n_pages = _kv_pool(rng, seq_lens, page_size, heads, d)
            shape = (n_pages * page_size, heads, d)
            host = _host_stores(fmt, shape, dtype, work)
            dev = tuple(None if a is None else cupy.asarray(a) for a in host)
            k = (rng.standard_normal((len(slots), heads, d)) * 10.0 ** rng.uniform(-1, 1, (len(slots), heads, 1))
                 ).astype(dtype)
            v = rng.standard_normal((len(slots), heads, d)).astype(dtype)
            k_weight, q_weight = (np.ascontiguousarray(rng.normal(1.0, 0.5, d), work) for _ in range(2))
            k_eps, q_eps = 1e-6, 0.5
            cos, sin = (np.ascontiguousarray(a) for a in spec.cos_sin(np.arange(max(seq_lens)), dtype=work))
            cb.append_kv(cupy.asarray(k), cupy.asarray(v), cupy.asarray(cos), cupy.asarray(sin),
                         cupy.asarray(positions), cupy.asarray(slots), dev, rotary_dim=48, layout="interleaved",
                         offset=8, kv_dtype=kv_dtype, norm=(cupy.asarray(k_weight), k_eps))
            got = tuple(None if a is None else cupy.asnumpy(a) for a in dev)
            keep = slots >= 0
            want = _rotate64(_rms_norm64(k[keep], k_weight, k_eps), positions[keep], spec)   # (n, heads, d)
            peak = np.abs(want).max(axis=-1)
            at = slots[keep]
            if kv_dtype is None:
                err = np.abs(got[0][at].astype(np.float64) - want).max(axis=-1) / peak
                entry["append_keys_rel_err"] = float(err.max())
                keys_ok = entry["append_keys_rel_err"] <= 2e-6
            else:
                scale = got[2][at].astype(np.float64)
                steps = np.abs(got[0][at] * scale[..., None] - want).max(axis=-1) / scale
                entry["append_keys_max_steps"] = float(steps.max())   # <= 0.5 (+ fp32 rounding)
                entry["append_scale_rel_err"] = float(np.abs(scale / (peak / 127) - 1).max())
                keys_ok = entry["append_keys_max_steps"] <= 0.5 + 1e-4 and entry["append_scale_rel_err"] <= 2e-6
            plain = tuple(None if a is None else a.copy() for a in host)   # v: as appended without the norm
            kv_entries.append_kv(k[keep], v[keep], cos, sin, positions[keep], slots[keep], plain, rotary_dim=48,
                                 layout="interleaved", offset=8, kv_dtype=kv_dtype)
            entry["append_values_bit_identical"] = all(
                b is None or np.array_equal(np.ascontiguousarray(a).view(np.uint8),
                                            np.ascontiguousarray(b).view(np.uint8))
                for a, b in zip(got[1::2], plain[1::2]))
            starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
            lens = np.array(seq_lens, np.int64)
            q_pos = np.concatenate([np.arange(L - c, L) for L, c in zip(seq_lens, counts)]).astype(np.int64)
            q = (rng.standard_normal((int(starts[-1]), 8, d)) * 3).astype(dtype)
            kw = dict(scale=d ** -0.5, softcap=None, window=None, causal=True)
            o = cb.paged_attention(cupy.asarray(q), dev, cupy.asarray(table), page_size, cupy.asarray(lens),
                                   cupy.asarray(starts), kv_dtype=kv_dtype,
                                   rotation=(cupy.asarray(cos), cupy.asarray(sin), cupy.asarray(q_pos), 48,
                                             "interleaved", 8),
                                   norm=(cupy.asarray(q_weight), q_eps), **kw)
            q64 = _rotate64(_rms_norm64(q, q_weight, q_eps), q_pos, spec)
            want = _kv_oracle(q64, got, table, page_size, lens, starts, kv_dtype=kv_dtype, **kw)
            rel = float(np.abs(cupy.asnumpy(o).astype(np.float64) - want).max() / np.abs(want).max())
            entry["attention mixed prefill + decode rel diff"] = rel
            tol = 2e-6 if dtype == np.float32 else 2e-3
            entry["ok"] = bool(keys_ok and entry["append_values_bit_identical"] and rel <= tol)
        except Exception as exc:   # the other checks still run; the failure is in the report
            entry.update(ok=False, error=f"{type(exc).__name__}: {exc}")
        checks.append(entry)
    return checks


def kv_cache_speed(cupy, rotary, cb, copy_GBps: float, tokens: int, heads: int = 8, d: int = 128) -> dict:
    """The kv_append launch of a prefill chunk (fp16 k/v, paged slot order) for each KV format against
    cupy.copyto of k and v; paged_attention launches at decode (32 sequences, 32/8 heads) and mixed with a prefill
    chunk; the host time of KVCache.append decode steps (item 5 of the module docstring)."""
    rng = np.random.default_rng(1)
    spec = rotary.RopeSpec(d)
    k = cupy.random.standard_normal((tokens, heads, d), dtype=cupy.float32).astype(cupy.float16)
    v = cupy.random.standard_normal((tokens, heads, d), dtype=cupy.float32).astype(cupy.float16)
    cos, sin = (cupy.asarray(np.ascontiguousarray(a)) for a in spec.cos_sin(np.arange(tokens), dtype=np.float32))
    rows = cupy.arange(tokens, dtype=cupy.int64)
    page = 16
    pages = rng.permutation(-(-tokens // page))
    t = np.arange(tokens)
    slots = cupy.asarray((pages[t // page] * page + t % page).astype(np.int64))
    dk, dv = cupy.empty_like(k), cupy.empty_like(v)

    def plain_copy():
        cupy.copyto(dk, k)
        cupy.copyto(dv, v)

    def pool(kv_dtype, n_slots):
        entry = {None: cupy.float16, "int8": cupy.int8, "float8_e4m3": cupy.uint8}[kv_dtype]
        shape = (n_slots, heads, d)
        return (cupy.empty(shape, entry), cupy.empty(shape, entry),
                None if kv_dtype is None else cupy.empty(shape[:2], cupy.float32),
                None if kv_dtype is None else cupy.empty(shape[:2], cupy.float32))

    t_copy = _events_time(cupy, plain_copy, 20)
    runs = []
    for kv_dtype in cb.VARIANTS["append_kv"]:
        stores = pool(kv_dtype, -(-tokens // page) * page)
        plan = cb.plan_append_kv(k, v, cos, sin, rows, slots, stores, dtype_name="float16", rotary_dim=d,
                                 layout="half", offset=0, kv_dtype=kv_dtype)
        t_kernel = _events_time(cupy, lambda: cb._launch(plan, "float16"), 20)
        written = 2 * tokens * heads * d * np.dtype(stores[0].dtype).itemsize
        written += 0 if kv_dtype is None else 2 * tokens * heads * 4   # scales
        nbytes = k.nbytes + v.nbytes + written + tokens * (d // 2) * 4 * 2 + 2 * tokens * 8
        gbps = nbytes / t_kernel / 1e9
        runs.append({"kv_dtype": kv_dtype, "kernel": plan.kernel, "grid": plan.grid, "block": plan.block,
                     "kernel_us": t_kernel * 1e6, "plain_copy_us": t_copy * 1e6,
                     "time_over_plain_copy": t_kernel / t_copy, "bytes": nbytes, "GBps": gbps,
                     "fraction_of_copy": gbps / copy_GBps})
    attention = {}
    context = 512 if tokens <= 4096 else 2048
    n_seq, q_heads = 32, 4 * heads
    per_seq = -(-context // page)
    table = cupy.asarray(rng.permutation(n_seq * per_seq).reshape(n_seq, per_seq).astype(np.int64))
    t = np.arange(n_seq * context)
    pos = t % context
    slots = cupy.asarray((cupy.asnumpy(table)[t // context, pos // page] * page + pos % page).astype(np.int64))
    kp = cupy.random.standard_normal((n_seq * context, heads, d), dtype=cupy.float32).astype(cupy.float16)
    ctab, stab = (cupy.asarray(np.ascontiguousarray(a)) for a in spec.cos_sin(np.arange(context), dtype=np.float32))
    lens = cupy.full(n_seq, context, dtype=cupy.int64)
    for kv_dtype in (None, "int8"):   # paged_attention: dense decode, and a 512-token prefill chunk mixed in
        stores = pool(kv_dtype, n_seq * per_seq * page)
        cb.append_kv(kp, kp, ctab, stab, cupy.asarray(pos.astype(np.int64)), slots, stores, rotary_dim=d,
                     layout="half", offset=0, kv_dtype=kv_dtype)
        held = sum(a.nbytes for a in stores if a is not None)
        for label, counts in (("decode", [1] * n_seq), ("decode + one 512-token chunk", [512] + [1] * (n_seq - 1))):
            starts = cupy.asarray(np.concatenate([[0], np.cumsum(counts)]).astype(np.int64))
            q = cupy.random.standard_normal((sum(counts), q_heads, d), dtype=cupy.float32).astype(cupy.float16)
            o = cupy.empty_like(q)
            plan = cb.plan_paged_attention(q, o, stores, table, page, lens, starts, dtype_name="float16",
                                           scale=d ** -0.5, softcap=None, window=None, causal=True, kv_dtype=kv_dtype,
                                           empty=cupy.empty)
            t_kernel = _events_time(cupy, lambda: _launch_all(cb, plan, "float16"), 10)
            attention[f"{kv_dtype} {label}"] = {
                "sequences": n_seq, "context": context, "q_rows": sum(counts), "q_heads": q_heads,
                "kernels": [launch.kernel for launch in plan.launches], "grid": plan.geometry.grid,
                "splits": plan.geometry.splits, "us_per_call": t_kernel * 1e6,
                "cache_GBps": held / t_kernel / 1e9, "cache_fraction_of_copy": held / t_kernel / 1e9 / copy_GBps}
        del stores
    del kp
    decode = {}
    try:   # KVCache.append decode steps: the frontend's host time (KVCache is the cache owner over kv_append)
        for kv_dtype in (None, "int8"):
            cache = rotary.KVCache(spec, batch=32, kv_heads=heads, head_dim=d, capacity=512, dtype=np.float16,
                                   kv_dtype=kv_dtype, backend="cupy")
            kd = cupy.random.standard_normal((32, 1, heads, d), dtype=cupy.float32).astype(cupy.float16)
            for _ in range(10):
                cache.append(kd, kd)
            cupy.cuda.get_current_stream().synchronize()
            n = 200
            t0 = time.perf_counter()
            for _ in range(n):
                cache.append(kd, kd)
            cupy.cuda.get_current_stream().synchronize()
            decode[str(kv_dtype)] = (time.perf_counter() - t0) / n * 1e6
    except Exception as exc:
        decode["error"] = f"{type(exc).__name__}: {exc}"
    return {"tokens": tokens, "heads": heads, "d": d, "runs": runs, "decode_append_host_us": decode,
            "paged_attention": attention, "fp16_time_over_plain_copy": runs[0]["time_over_plain_copy"]}


def _launch_all(cb, plan, dtype_name: str) -> None:
    for launch in plan.launches:   # paged_attention, then the split-K combine when the plan splits
        cb._launch(launch, dtype_name)


def paged_attention_speed(cupy, cb, quick: bool = False) -> dict:
    """paged_attention at decode (Llama-3-8B shapes: 32 q / 8 kv heads, d=128, pages of 16 keys in a scattered
    order, fp16 q) over fp16 and int8 entries, against a device-to-device copy of the same K+V bytes (entries and
    scales) in the same run: 32 sequences x 2048 keys, and batch 1 x 32768 keys (quick: 8 x 2048, 1 x 8192). The
    fraction is (K+V bytes / attention time) / (2 x bytes / copy time) (the copy reads and writes them; goal >= 0.7).
    Each shape at the split rule's count (the plan's default) and at forced counts (the best is reported beside it);
    the largest difference between the rule's output and the unsplit one (expected ~1e-3 of max |o| in fp16)."""
    rng = np.random.default_rng(3)
    q_heads, kv_heads, d, page = 32, 8, 128, 16
    shapes = {"32 x 2048 decode": (8 if quick else 32, 2048), "1 x 32768 decode": (1, 8192 if quick else 32768)}
    out = {}
    for label, (n_seq, context) in shapes.items():
        per_seq = context // page
        table = cupy.asarray(rng.permutation(n_seq * per_seq).reshape(n_seq, per_seq).astype(np.int64))
        lens = cupy.full(n_seq, context, dtype=cupy.int64)
        starts = cupy.arange(n_seq + 1, dtype=cupy.int64)
        q = cupy.random.standard_normal((n_seq, q_heads, d), dtype=cupy.float32).astype(cupy.float16)
        n_slots = n_seq * per_seq * page
        for kv_dtype in (None, "int8"):
            if kv_dtype is None:
                entries = [cupy.random.standard_normal((n_slots, kv_heads, d), dtype=cupy.float32)
                           .astype(cupy.float16) for _ in range(2)]
                stores = (*entries, None, None)
            else:
                entries = [cupy.random.randint(-127, 128, (n_slots, kv_heads, d)).astype(cupy.int8) for _ in range(2)]
                scales = [cupy.random.uniform(0.001, 0.02, (n_slots, kv_heads)).astype(cupy.float32)
                          for _ in range(2)]
                stores = (*entries, *scales)
            nbytes = sum(a.nbytes for a in stores if a is not None)   # every key of every sequence is read
            src = cupy.empty(nbytes, dtype=cupy.uint8)
            dst = cupy.empty_like(src)
            stream = cupy.cuda.get_current_stream().ptr
            t_copy = _events_time(cupy, lambda: cupy.cuda.runtime.memcpyAsync(
                dst.data.ptr, src.data.ptr, nbytes, cupy.cuda.runtime.memcpyDeviceToDevice, stream), 10)
            del src, dst
            copy_GBps = 2 * nbytes / t_copy / 1e9
            runs = []
            outputs = {}
            rule = cb.plan_paged_attention(q, cupy.empty_like(q), stores, table, page, lens, starts,
                                           dtype_name="float16", scale=d ** -0.5, softcap=None, window=None,
                                           causal=True, kv_dtype=kv_dtype, empty=cupy.empty).geometry.splits
            for splits in sorted({rule, 1, 2, 4, 8, 16, 33, 66}):
                if splits > 1 and context // splits < 64:
                    continue
                o = cupy.empty_like(q)
                plan = cb.plan_paged_attention(q, o, stores, table, page, lens, starts, dtype_name="float16",
                                               scale=d ** -0.5, softcap=None, window=None, causal=True,
                                               kv_dtype=kv_dtype, splits=splits, empty=cupy.empty)
                t = _events_time(cupy, lambda: _launch_all(cb, plan, "float16"), 10)
                outputs[splits] = o
                gbps = nbytes / t / 1e9
                runs.append({"splits": splits, "rule": splits == rule, "grid": plan.geometry.grid,
                             "threads": plan.geometry.threads, "tile": plan.geometry.tile, "us": t * 1e6,
                             "GBps": gbps, "fraction_of_copy": gbps / copy_GBps})
            ref = outputs[1].astype(cupy.float32)
            diff = float(cupy.abs(outputs[rule].astype(cupy.float32) - ref).max() / cupy.abs(ref).max())
            best = max(runs, key=lambda r: r["GBps"])
            at_rule = next(r for r in runs if r["rule"])
            out[f"{kv_dtype or 'float16'} {label}"] = {
                "sequences": n_seq, "keys": context, "q_heads": q_heads, "kv_heads": kv_heads, "d": d,
                "kv_bytes": nbytes, "copy_us": t_copy * 1e6, "copy_GBps": copy_GBps, "rule_splits": rule,
                "us": at_rule["us"], "fraction_of_copy": at_rule["fraction_of_copy"],
                "best_splits": best["splits"], "best_fraction_of_copy": best["fraction_of_copy"],
                "rule_vs_unsplit_max_rel_diff": diff, "runs": runs}
            del stores, entries, outputs
    return out


def roofline(results: dict) -> dict:
    """Measured kernel times against the roofline of benchmarks/cuda_resources.py (docs/cuda.md), with this
    device's measured copy bandwidth and computed FP32 peak in place of the H200's published figures:
    fraction = estimate / measured (1 = at the roof)."""
    import cuda_resources as cr

    bw = results["copy"]["GBps"] * 1e9
    peak = results["device"]["GFLOPs"] * 1e9
    out = {}
    for (label, plan, nbytes, flop), key in zip(cr.rotation_workloads(), ("prefill_fp16", "prefill_fp32", "decode_fp16")):
        measured = results[key].get("kernel_us", results[key].get("gpu_us_per_launch"))
        est = max(nbytes / bw, flop / peak) * 1e6
        out[label] = {"estimate_us": est, "measured_us": measured, "fraction": est / measured if measured else None}
    best = results["linear_attention_causal_fp32"]
    for label, g, b_l2, _, flop, _ in cr.linear_workloads():
        if g["chunk"] == best.get("chunk") and g["dv_tile"] == best.get("dv_tile"):
            est = max(b_l2 / bw, flop / peak) * 1e3
            out[f"causal linear attention {label}"] = {"estimate_ms": est, "measured_ms": best["ms"],
                                                       "fraction": est / best["ms"]}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or str(Path(__file__).with_name("results")))
    parser.add_argument("--quick", action="store_true", help="smaller sizes (smoke run)")
    args = parser.parse_args(argv)
    try:
        import cupy
    except ImportError as exc:
        print(f"gpu_check: CuPy is not importable ({exc}); nothing measured", file=sys.stderr)
        return 2
    import rotary
    from rotary.backends import cupy as cb

    ok, reason = cb.availability()
    if not ok:
        print(f"gpu_check: no usable GPU: {reason}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"python": platform.python_version(), "cupy": cupy.__version__,
               "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(), "driver": cupy.cuda.runtime.driverGetVersion()}

    def step(name, fn):
        t0 = time.perf_counter()
        try:
            results[name] = fn()
        except Exception as exc:  # keep measuring the rest; the failure is in the report
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
        results[name]["seconds"] = round(time.perf_counter() - t0, 2)
        print(name, json.dumps(results[name]), flush=True)
        (out / "gpu_check.json").write_text(json.dumps(results, indent=2))

    step("device", lambda: fp32_fma_peak(cupy))
    step("copy", lambda: copy_bandwidth(cupy, (256 if args.quick else 1024) * 2**20))
    copy_GBps = results["copy"].get("GBps", float("nan"))
    tokens = 8192 if args.quick else 65536
    step("prefill_fp16", lambda: prefill(cupy, rotary, cb, cupy.float16, tokens, copy_GBps))
    step("prefill_fp32", lambda: prefill(cupy, rotary, cb, cupy.float32, tokens, copy_GBps))
    step("decode_fp16", lambda: decode(cupy, rotary, cb))
    step("kv_cache_check", lambda: kv_cache_check(cupy, rotary, cb))
    step("kv_cache_append", lambda: kv_cache_speed(cupy, rotary, cb, copy_GBps, 4096 if args.quick else 16384))
    step("paged_attention_decode", lambda: paged_attention_speed(cupy, cb, args.quick))
    step("prefill_multi_axis_fp16", lambda: prefill_multi_axis(cupy, rotary, cupy.float16, tokens))
    peak = results["device"].get("GFLOPs", float("nan"))
    step("linear_attention_causal_fp32",
         lambda: linear_attention(cupy, cb, peak, T=1024 if args.quick else 8192))
    step("linear_attention_retention_fp32",
         lambda: linear_attention(cupy, cb, peak, T=1024 if args.quick else 8192, retention=True))
    step("linear_attention_ragged_packed_fp32",
         lambda: linear_attention_ragged(cupy, cb, n_seqs=16 if args.quick else 64))
    step("linear_attention_backward_fp32",
         lambda: linear_attention_backward(cupy, cb, T=1024 if args.quick else 8192,
                                           check_T=200 if args.quick else 1000))
    plain_ms = results["linear_attention_causal_fp32"].get("ms", float("nan"))
    results["linear_attention_retention_fp32"]["ms_over_plain"] = (
        results["linear_attention_retention_fp32"].get("ms", float("nan")) / plain_ms)
    if not args.quick:   # the roofline is for the full shapes
        step("roofline", lambda: roofline(results))

    def goal(value, target, above=True):
        if not isinstance(value, (int, float)) or math.isnan(value):
            return "n/a"
        return "MET" if (value >= target if above else value <= target) else "missed"

    summary = [
        ("prefill fp16 kernel / copy BW (>= 0.9)", results["prefill_fp16"].get("kernel_fraction_of_copy"), 0.9, True),
        ("prefill fp32 kernel / copy BW (>= 0.9)", results["prefill_fp32"].get("kernel_fraction_of_copy"), 0.9, True),
        ("decode GPU us per q+k launch (<= 10)", results["decode_fp16"].get("gpu_us_per_launch"), 10, False),
        ("decode host us per apply_qk call (<= 10)", results["decode_fp16"].get("host_wall_us_per_apply_qk"), 10, False),
        ("causal linear attention / fp32 FMA peak (>= 0.4)",
         results["linear_attention_causal_fp32"].get("fraction_of_fp32_peak"), 0.4, True),
        ("retention (decay, no denominator) ms / plain causal ms (<= 1.2)",
         results["linear_attention_retention_fp32"].get("ms_over_plain"), 1.2, False),
        ("linear attention backward ms / forward ms (info: <= 3)",
         results["linear_attention_backward_fp32"].get("over_forward"), 3, False),
        ("linear attention backward fp64 vs host backward (<= 1e-9)",
         results["linear_attention_backward_fp32"].get("max_rel_diff_float64"), 1e-9, False),
        ("KV primitives on CuPy: append bits, attention vs oracle (1 = all)",
         {True: 1.0, False: 0.0}.get(results["kv_cache_check"].get("all_ok")), 1, True),
        ("KV append fp16 kernel time / plain copy of k, v (<= 1.5)",
         results["kv_cache_append"].get("fp16_time_over_plain_copy"), 1.5, False),
    ]
    for key in ("float16 32 x 2048 decode", "float16 1 x 32768 decode", "int8 32 x 2048 decode",
                "int8 1 x 32768 decode"):
        entry = results["paged_attention_decode"].get(key, {})
        summary.append((f"paged attention {key} / D2D copy BW (>= 0.7)", entry.get("fraction_of_copy"), 0.7, True))
    results["goals"] = {name: {"value": v, "status": goal(v, t, a)} for name, v, t, a in summary}
    (out / "gpu_check.json").write_text(json.dumps(results, indent=2))
    print("\nSUMMARY")
    for name, v, t, a in summary:
        print(f"  {name:55s} {v if v is None else round(v, 3)!s:>10}  {goal(v, t, a)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
