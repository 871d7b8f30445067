"""Numba CPU backend against this machine's own limits, measured in the same run.

    python benchmarks/bench_numba.py                      # print the tables
    python benchmarks/bench_numba.py --markdown docs/benchmarks.md   # also replace its "Numba CPU backend" section
    python benchmarks/bench_numba.py --linear-vs-sgemm [--rounds 9]    # linear attention / sgemm, same rounds
    python benchmarks/bench_numba.py --first-call [--pairs 3]          # JIT compile time, fresh processes

- apply_qk, Llama-3-8B prefill (q (1, 4096, 32, 128), k (1, 4096, 8, 128), float32, BSHD): the time of
  a Numba ``prange`` copy of q and k into output buffers (the memory-bandwidth limit: RoPE reads and
  writes the same bytes), HF transformers' torch-CPU rotary, and the NumPy backend.
- decode (32 sequences x 1 token): per-call time, and the share of the frontend (full
  ``rotary.apply_qk`` vs the compiled kernel alone with prepared arguments).
- causal linear attention (H=8, T=8192, d=dv=64, C=64, float32): GFLOP/s counting
  ``4 T d (C + d)`` per head, against ``np.dot`` sgemm GFLOP/s, and against the quadratic masked
  form written with NumPy matmuls; per-token cost from T = 1k to 64k.
- first-call JIT compile time (empty cache) and the same call in a second process (cache=True).

Every case is timed in interleaved rounds (each candidate once per round) and the best time is
kept: on a shared machine other processes only add time, and they hit the candidates alike. Candidates
that call BLAS (sgemm, the NumPy backend's and the quadratic linear attention) are timed apart and
followed by a pause, since OpenBLAS's threads keep spinning after a call and slow the next candidate.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time

THREADS = int(os.environ.get("BENCH_THREADS", os.cpu_count() or 1))
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ.setdefault(_var, str(THREADS))
# idle OpenMP threads (torch's) sleep instead of spinning on the cores the next candidate needs
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import rotary  # noqa: E402
from rotary.spec import tables as _tables  # noqa: E402

SECTION_BEGIN = "<!-- BEGIN benchmarks/bench_numba.py -->"
SECTION_END = "<!-- END benchmarks/bench_numba.py -->"


def settle(seconds: float = 0.5) -> None:
    """Let other libraries' idle threads (OpenBLAS, OpenMP) stop spinning before the next timing."""
    time.sleep(seconds)


def best_times(candidates: dict, rounds: int, all_times: dict | None = None) -> dict:
    """{name: best seconds} over ``rounds`` interleaved rounds, after one warm-up call each; every time
    goes into ``all_times[name]`` (a list) when given."""
    for fn in candidates.values():
        fn()
    best = {name: float("inf") for name in candidates}
    for _ in range(rounds):
        for name, fn in candidates.items():
            t0 = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - t0
            best[name] = min(best[name], elapsed)
            if all_times is not None:
                all_times.setdefault(name, []).append(elapsed)
    return best


def machine() -> str:
    model = platform.processor() or "unknown CPU"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        model = next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except Exception:
        pass
    import numba

    return (f"{model}, {os.cpu_count()} cores, {THREADS} threads; Python {platform.python_version()}, "
            f"NumPy {np.__version__}, Numba {numba.__version__}")


# -- apply_qk ------------------------------------------------------------------------------------
def prefill(rounds: int):
    import numba
    from numba import njit, prange

    @njit(parallel=True, cache=True)
    def copy_pair(a, b, out_a, out_b):
        # a memcpy per block of 64 (element loops over prange were 1.5x slower: the limit read too low)
        for src, dst in ((a, out_a), (b, out_b)):
            step = (src.size + 63) // 64
            for i in prange(64):
                lo = i * step
                hi = min(src.size, lo + step)
                dst[lo:hi] = src[lo:hi]

    T, Hq, Hk, D = 4096, 32, 8, 128
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, T, Hq, D), dtype=np.float32)
    k = rng.standard_normal((1, T, Hk, D), dtype=np.float32)
    q_out, k_out = np.empty_like(q), np.empty_like(k)
    spec = rotary.RopeSpec(D, base=500000.0)
    flat = [a.reshape(-1) for a in (q, k, q_out, k_out)]
    candidates = {
        "numba prange copy of q, k (limit)": lambda: copy_pair(*flat),
        "rotary numba, out=(q_out, k_out)": lambda: rotary.apply_qk(q, k, spec=spec, seq_axis=1, out=(q_out, k_out),
                                                                    backend="numba"),
        "rotary numba, in place": lambda: rotary.apply_qk(q, k, spec=spec, seq_axis=1, out=(q, k), backend="numba"),
        "rotary numba, new outputs": lambda: rotary.apply_qk(q, k, spec=spec, seq_axis=1, backend="numba"),
        "q.copy(), k.copy() (new arrays: what a new-output call must not exceed)": lambda: (q.copy(), k.copy()),
        "rotary numpy, out=(q_out, k_out)": lambda: rotary.apply_qk(q, k, spec=spec, seq_axis=1,
                                                                    out=(q_out, k_out), backend="numpy"),
    }
    hf_note = "HF transformers not installed"
    try:
        import torch
        import transformers
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

        torch.set_num_threads(THREADS)
        config = LlamaConfig(hidden_size=4096, num_attention_heads=Hq, num_key_value_heads=Hk, rope_theta=500000.0,
                             max_position_embeddings=131072)
        rope = LlamaRotaryEmbedding(config)
        qt, kt = torch.from_numpy(q).transpose(1, 2), torch.from_numpy(k).transpose(1, 2)   # BHSD views, as in HF
        position_ids = torch.arange(T)[None]
        with torch.inference_mode():
            cos_t, sin_t = rope(qt, position_ids)

        def hf_full():
            with torch.inference_mode():
                cos, sin = rope(qt, position_ids)
                return apply_rotary_pos_emb(qt, kt, cos, sin)

        def hf_apply():
            with torch.inference_mode():
                return apply_rotary_pos_emb(qt, kt, cos_t, sin_t)

        candidates["HF torch: rotary_emb + apply_rotary_pos_emb"] = hf_full
        candidates["HF torch: apply_rotary_pos_emb only"] = hf_apply
        hf_note = f"torch {torch.__version__} ({torch.get_num_threads()} threads), transformers {transformers.__version__}"
    except ImportError:
        pass
    times: dict = {}
    best = best_times(candidates, max(rounds, 15), times)
    moved = 2 * (q.nbytes + k.nbytes)
    limit = best["numba prange copy of q, k (limit)"]
    ours = best["rotary numba, out=(q_out, k_out)"]
    rows = []
    for name, t in best.items():
        rows.append((name, f"{t * 1e3:.2f}", f"{np.median(times[name]) * 1e3:.2f}", f"{max(times[name]) * 1e3:.2f}",
                     f"{moved / t / 1e9:.1f}", f"{limit / t:.2f}", f"{t / ours:.1f}"))
    table = _table(["candidate", "best ms", "median ms", "worst ms", "GB/s (2 x (q+k) bytes, best)", "x copy limit",
                    "time / numba out="], rows)
    return table, hf_note, numba.get_num_threads()


def decode(rounds: int):
    from rotary.backends import numba as nb

    B, Hq, Hk, D = 32, 32, 8, 128
    rng = np.random.default_rng(1)
    q = rng.standard_normal((B, 1, Hq, D), dtype=np.float32)
    k = rng.standard_normal((B, 1, Hk, D), dtype=np.float32)
    positions = rng.integers(100, 8000, size=(B, 1))
    q_out, k_out = np.empty_like(q), np.empty_like(k)
    spec = rotary.RopeSpec(D, base=500000.0)
    cos, sin, rows = _tables.lookup(spec, positions, dtype=np.float32)
    xq, oq, gq = nb._geometry(q, q_out)
    xk, ok, gk = nb._geometry(k, k_out)
    geo = np.stack([gq, gk])
    args = (xq, oq, xk, ok, geo, nb._readonly(cos), nb._readonly(sin), np.array(rows), 0, B, 1, D // 2, D, D,
            False, False, False)   # (..., interleaved, out_interleaved, inverse)
    serial, parallel = nb.rotation.rotate_qk_serial, nb.rotation.rotate_qk_parallel   # apply_qk measures, picks one
    candidates = {
        "rotary.apply_qk numba (frontend + kernel)": lambda: rotary.apply_qk(
            q, k, positions, spec=spec, seq_axis=1, out=(q_out, k_out), backend="numba"),
        "compiled serial kernel alone (prepared arguments)": lambda: serial(*args),
        "compiled parallel kernel alone (prepared arguments)": lambda: parallel(*args),
        "backend primitive numba.rotate (tables given)": lambda: nb.rotate(
            [(q, q_out), (k, k_out)], cos, sin, rows, rotary_dim=D, layout="half", inverse=False),
        "rotary.apply_qk numpy": lambda: rotary.apply_qk(q, k, positions, spec=spec, seq_axis=1, out=(q_out, k_out),
                                                         backend="numpy"),
    }
    best = best_times(candidates, rounds * 50)
    full = best["rotary.apply_qk numba (frontend + kernel)"]
    rows_out = [(name, f"{t * 1e6:.1f}", f"{t / full:.2f}") for name, t in best.items()]
    share = 1 - min(best["compiled serial kernel alone (prepared arguments)"],
                    best["compiled parallel kernel alone (prepared arguments)"]) / full
    return _table(["candidate", "us per call", "time / apply_qk numba"], rows_out), share


# -- linear attention ------------------------------------------------------------------------------
def _linear_inputs(T, H=8, d=64, seed=2):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((1, T, H, d), dtype=np.float32) for _ in range(3))


#: the issue's causal linear-attention case: heads, head dim, chunk, tokens
LINEAR_SHAPE = (8, 64, 64, 8192)
SGEMM_N = 2048


def _linear_case():
    """(spec, (q, k, v), (cos, sin, rows), (a, c)): the linear-attention inputs with their tables, and the
    sgemm operands (a @ a into c) the kernel is measured against."""
    H, d, _, T = LINEAR_SHAPE
    spec = rotary.RopeSpec(d)
    a = np.random.default_rng(3).standard_normal((SGEMM_N, SGEMM_N), dtype=np.float32)
    return (spec, _linear_inputs(T, H, d), _tables.lookup(spec, np.arange(T)[None], dtype=np.float32),
            (a, np.empty_like(a)))


def linear(rounds: int, lengths):
    from rotary.backends import numba as nb

    H, d, C, T = LINEAR_SHAPE
    spec, (q, k, v), (cos, sin, rows), (a, c) = _linear_case()

    def quadratic_numpy():
        """The masked quadratic form, float32 NumPy matmuls, one head at a time (T x T scores)."""
        mask = np.tril(np.ones((T, T), dtype=np.float32))
        feats = [np.where(x > 0, x + 1, np.exp(np.minimum(x, 0))) for x in (q, k)]
        rot = [rotary.apply(f, spec=spec, seq_axis=1, backend="numpy") for f in feats]
        out = np.empty((1, T, H, d), np.float32)
        for h in range(H):
            num = ((rot[0][0, :, h] @ rot[1][0, :, h].T) * mask) @ v[0, :, h]
            den = ((feats[0][0, :, h] @ feats[1][0, :, h].T) * mask).sum(-1, keepdims=True)
            out[0, :, h] = num / (den + 1e-6)
        return out

    def primitive(feature_map, causal=True):
        return lambda: nb.linear_attention(q, k, v, cos, sin, rows, rotary_dim=d, layout="half", causal=causal,
                                           feature_map=feature_map, eps=1e-6, chunk=C, state=None)

    # BLAS users are timed on their own, each followed by a pause: OpenBLAS's threads spin for a while
    # after a call and would take the two cores from the Numba threads of the next candidate.
    sgemm = 2 * SGEMM_N**3 / best_times({"sgemm": lambda: np.dot(a, a, out=c)}, rounds)["sgemm"] / 1e9
    settle()
    candidates = {
        "numba causal, identity": primitive("identity"),
        "numba causal, elu": primitive("elu"),
        "rotary.linear_attention numba causal, elu": lambda: rotary.linear_attention(
            q, k, v, causal=True, seq_axis=1, chunk=C, backend="numba"),
        "numba non-causal, elu": primitive("elu", causal=False),
    }
    best = best_times(candidates, rounds)
    best.update(best_times({"numpy backend causal, elu": lambda: rotary.linear_attention(
        q, k, v, causal=True, seq_axis=1, chunk=C, backend="numpy")}, rounds))
    quad = best_times({"quadratic": quadratic_numpy}, max(1, rounds // 3))["quadratic"]
    settle()
    flop = 4 * T * d * (C + d) * H
    rows_out = [("sgemm np.dot 2048 x 2048 (limit)", "", f"{sgemm:.1f}", "1.00", "")]
    for name, t in best.items():
        rows_out.append((name, f"{t * 1e3:.1f}", f"{flop / t / 1e9:.1f}", f"{flop / t / 1e9 / sgemm:.2f}",
                         f"{quad / t:.0f}"))
    rows_out.append(("quadratic masked form, NumPy float32 matmuls", f"{quad * 1e3:.0f}", f"{flop / quad / 1e9:.2f}",
                     f"{flop / quad / 1e9 / sgemm:.3f}", "1"))
    table = _table(["candidate", "ms", "GFLOP/s (4 T d (C+d) H)", "x sgemm", "speed-up vs quadratic"], rows_out)

    curve = []
    for length in lengths:
        ql, kl, vl = _linear_inputs(length, H, d)
        cl, sl, rl = _tables.lookup(spec, np.arange(length)[None], dtype=np.float32)
        t = best_times({"la": lambda: nb.linear_attention(ql, kl, vl, cl, sl, rl, rotary_dim=d, layout="half",
                                                          causal=True, feature_map="elu", eps=1e-6, chunk=C,
                                                          state=None)},
                       max(2, rounds * 8192 // length))["la"]
        curve.append((f"{length}", f"{t * 1e3:.1f}", f"{t / (length * H) * 1e9:.0f}",
                      f"{4 * length * d * (C + d) * H / t / 1e9:.1f}"))
    curve_table = _table(["T", "ms", "ns per token and head", "GFLOP/s"], curve)
    return table, curve_table, sgemm


# -- linear attention against sgemm, in the same rounds -----------------------------------------------
def linear_vs_sgemm(rounds: int, gap: float = 0.3):
    """Causal linear attention (H=8, T=8192, d=dv=64, C=64, elu, fp32) against NumPy's sgemm (2048^3) in
    the same interleaved rounds: each round times every candidate once, sgemm included, with a pause of
    ``gap`` s before each (BLAS's and torch's idle threads stop spinning). FLOPs counted as issue 23 does,
    H (2 T C (d + dv) + 4 T d dv) with H the q heads, for every linear candidate. Reported per candidate:
    best and median wall time, best GFLOP/s over best sgemm GFLOP/s, the median over rounds of the
    same-round ratio, and the ratio of process CPU-time rates (robust to other processes' load: the
    time the process's threads ran, not the time they waited for a core). One more candidate runs
    straight after sgemm with no pause, to show what a harness without one measures."""
    from rotary.backends import numba as nb

    H, d, C, T = LINEAR_SHAPE
    spec, (q, k, v), (cos, sin, rows), (a, c) = _linear_case()
    flop = H * (2 * T * C * (d + d) + 4 * T * d * d)
    gammas = (1 - 2.0 ** (-5 - np.arange(2)))[None]

    def primitive(kk=k, vv=v, **kw):
        base = dict(rotary_dim=d, layout="half", causal=True, feature_map="elu", eps=1e-6, chunk=C, state=None)
        base.update(kw)
        return lambda: nb.linear_attention(q, kk, vv, cos, sin, rows, **base)

    cands = {
        "sgemm np.dot 2048^3": lambda: np.dot(a, a, out=c),
        "rotary.linear_attention numba causal, elu": lambda: rotary.linear_attention(
            q, k, v, causal=True, seq_axis=1, chunk=C, backend="numba"),
        "numba primitive causal, elu": primitive(),
        "numba primitive non-causal, elu": primitive(causal=False),
        "numba primitive causal, elu, GQA (2 k/v heads)": primitive(kk=k[:, :, :2], vv=v[:, :, :2]),
        "numba primitive causal, elu, GQA 2 + decay": primitive(kk=k[:, :, :2], vv=v[:, :, :2], decay=gammas),
    }
    notes = []
    try:
        import torch

        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from bench_peers import exact_tables, rel_error, torch_linear

        torch.set_num_threads(THREADS)
        cos_t, sin_t = exact_tables(spec, T - 1)
        tq, tk, tv = (torch.from_numpy(np.ascontiguousarray(np.swapaxes(x[0], 0, 1))) for x in (q, k, v))
        tc, ts = torch.from_numpy(np.array(cos_t)), torch.from_numpy(np.array(sin_t))   # writable copies
        want = rotary.linear_attention(q, k, v, causal=True, seq_axis=1, chunk=C, backend="numba", spec=spec)
        got = np.swapaxes(torch_linear(tq, tk, tv, tc, ts, C, 1e-6).numpy(), 0, 1)[None]
        err = rel_error(got, want)
        notes.append(f"torch eager chunked form (bench_peers.torch_linear, heads-first inputs prepared outside the "
                     f"timing, torch {torch.__version__}): relative error {err:.1e} against rotary")
        if err < 1e-4:
            cands["torch eager chunked (bench_peers.torch_linear)"] = lambda: torch_linear(tq, tk, tv, tc, ts, C, 1e-6)
        else:
            notes.append("torch chunked form rejected: it disagrees with rotary")
    except ImportError as exc:
        notes.append(f"torch contender skipped: {exc}")
    straight = "numba primitive causal, elu, straight after sgemm (no pause)"
    for fn in cands.values():
        fn()
    wall = {name: [] for name in [*cands, straight]}
    cpu = {name: [] for name in wall}
    for _ in range(rounds):
        for name, fn in cands.items():
            settle(gap)
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
            if name.startswith("sgemm"):   # the same kernel again with no pause after BLAS
                t0, c0 = time.perf_counter(), time.process_time()
                cands["numba primitive causal, elu"]()
                wall[straight].append(time.perf_counter() - t0)
                cpu[straight].append(time.process_time() - c0)
    sg_flop = 2 * SGEMM_N**3
    sg_wall, sg_cpu = np.array(wall["sgemm np.dot 2048^3"]), np.array(cpu["sgemm np.dot 2048^3"])
    out = []
    for name in wall:
        w, cp = np.array(wall[name]), np.array(cpu[name])
        work = sg_flop if name.startswith("sgemm") else flop
        per_round = (work / w) / (sg_flop / sg_wall)
        out.append((name, f"{w.min() * 1e3:.1f}", f"{np.median(w) * 1e3:.1f}", f"{work / w.min() / 1e9:.0f}",
                    f"{(work / w.min()) / (sg_flop / sg_wall.min()):.2f}", f"{np.median(per_round):.2f}",
                    f"{(work / cp.min()) / (sg_flop / sg_cpu.min()):.2f}"))
    table = _table(["candidate", "best ms", "median ms", "GFLOP/s (best)", "x sgemm (best / best)",
                    "x sgemm (median of same-round ratios)", "x sgemm (CPU-time rates)"], out)
    eager = "torch eager chunked (bench_peers.torch_linear)"
    if eager in wall:
        ours = np.array(wall["rotary.linear_attention numba causal, elu"])
        notes.append(f"torch eager chunked / rotary.linear_attention: {min(wall[eager]) / ours.min():.2f}x (best), "
                     f"{np.median(np.array(wall[eager]) / ours):.2f}x (median of same-round ratios)")
    return table, notes


# -- first call with an empty cache, A/B-able ---------------------------------------------------------------
_FIRST_CALL_PROBE = """
import sys, time
t0 = time.perf_counter()
import numpy as np, rotary
q = np.ones((1, 4, 2, 64), np.float32); k = np.ones((1, 4, 1, 64), np.float32)
t1 = time.perf_counter()
if sys.argv[1] == "linear_attention":
    rotary.linear_attention(q, q, q, causal=True, seq_axis=1, backend="numba")
else:
    rotary.apply_qk(q, k, seq_axis=1, backend="numba")
print(time.perf_counter() - t1)
"""


def first_call(pairs: int, trees):
    """Seconds of the first linear_attention and the first apply_qk call, each in a fresh process with an
    empty NUMBA_CACHE_DIR (nothing compiled before it in that process), ``pairs`` times, alternating the
    source trees given (an A/B of two checkouts in the same minutes)."""
    rows = []
    results = {(tree, what): [] for tree in trees for what in ("linear_attention", "apply_qk")}
    for _ in range(pairs):
        for what in ("linear_attention", "apply_qk"):
            for tree in trees:
                with tempfile.TemporaryDirectory() as cache:
                    env = dict(os.environ, NUMBA_CACHE_DIR=cache, PYTHONPATH=tree)
                    out = subprocess.run([sys.executable, "-c", _FIRST_CALL_PROBE, what], env=env, cwd=tree,
                                         capture_output=True, text=True, check=True).stdout.split()
                results[(tree, what)].append(float(out[-1]))
    for (tree, what), ts in results.items():
        rows.append((tree, what, " ".join(f"{t:.2f}" for t in ts), f"{np.median(ts):.2f}"))
    return _table(["source tree", "first call", "seconds (fresh process each)", "median"], rows)


# -- compile time ----------------------------------------------------------------------------------
_COMPILE_PROBE = """
import time, sys
t0 = time.perf_counter()
import numpy as np, rotary
q = np.ones((1, 4, 2, 64), np.float32); k = np.ones((1, 4, 1, 64), np.float32)   # < PARALLEL_MIN_ELEMENTS
t1 = time.perf_counter()
rotary.apply_qk(q, k, seq_axis=1, backend="numba")
t2 = time.perf_counter()
rotary.apply_qk(q.repeat(1024, 1), k.repeat(1024, 1), seq_axis=1, backend="numba")   # the parallel kernel
t3 = time.perf_counter()
rotary.linear_attention(q, q, q, causal=True, seq_axis=1, backend="numba")
t4 = time.perf_counter()
print(t1 - t0, t2 - t1, t3 - t2, t4 - t3)
"""

#: the compile probe's four figures
_COMPILE_COLUMNS = ("import rotary + numpy (s)", "apply_qk serial kernel (s)", "apply_qk parallel kernel (s)",
                    "linear_attention (s)")


def compile_times():
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache, PYTHONPATH=root)
        for label in ("first process, empty cache (JIT compile)", "second process (cache=True hit)"):
            out = subprocess.run([sys.executable, "-c", _COMPILE_PROBE], env=env, capture_output=True, text=True,
                                 check=True).stdout.split()
            rows.append((label, *(f"{float(x):.2f}" for x in out)))
    return _table(["process", *_COMPILE_COLUMNS], rows)


def compile_times_ab(pairs: int, trees):
    """The compile probe's seconds (import, first serial apply_qk, first parallel apply_qk, first linear_attention),
    each run in a fresh process with an empty NUMBA_CACHE_DIR, ``pairs`` times, alternating the source trees."""
    results = {tree: [] for tree in trees}
    for _ in range(pairs):
        for tree in trees:
            with tempfile.TemporaryDirectory() as cache:
                env = dict(os.environ, NUMBA_CACHE_DIR=cache, PYTHONPATH=tree)
                out = subprocess.run([sys.executable, "-c", _COMPILE_PROBE], env=env, cwd=tree, capture_output=True,
                                     text=True, check=True).stdout.split()
            results[tree].append([float(x) for x in out])
    rows = [(tree, *(" ".join(f"{run[i]:.2f}" for run in runs) for i in range(4))) for tree, runs in results.items()]
    return _table(["source tree", *_COMPILE_COLUMNS], rows)


def _table(header, rows) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def report(args) -> str:
    prefill_table, hf_note, threads = prefill(args.rounds)
    decode_table, share = decode(args.rounds)
    linear_table, curve_table, sgemm = linear(args.rounds, args.lengths)
    compile_table = compile_times()
    return "\n".join([
        "## Numba CPU backend", "",
        f"Command: `python benchmarks/bench_numba.py --markdown docs/benchmarks.md` "
        f"(best of {args.rounds} interleaved rounds).", "",
        f"Machine: {machine()}; Numba threads: {threads}. Peer: {hf_note}.", "",
        "### apply_qk, Llama-3-8B prefill: q (1, 4096, 32, 128), k (1, 4096, 8, 128), float32, BSHD", "",
        "The limit is a Numba `prange` copy of q and k into output buffers: the same bytes read and written.", "",
        prefill_table, "",
        "### apply_qk, decode: q (32, 1, 32, 128), k (32, 1, 8, 128), one position per sequence", "",
        decode_table, "",
        f"Frontend share of a decode call (1 - the faster kernel alone / apply_qk): {share:.0%}.", "",
        "### Causal linear attention: H = 8, T = 8192, d = dv = 64, chunk C = 64, float32", "",
        f"Work counted as 4 T d (C + d) per head; sgemm (NumPy `np.dot`, {THREADS} threads) "
        f"runs at {sgemm:.0f} GFLOP/s here.", "",
        linear_table, "",
        "Per-token cost against sequence length (numba, causal, elu, H = 8):", "",
        curve_table, "",
        "### JIT compile time and the on-disk cache", "",
        compile_table, "",
    ])


def write_section(path: str, text: str) -> None:
    block = f"{SECTION_BEGIN}\n{text.rstrip()}\n{SECTION_END}\n"
    try:
        with open(path) as f:
            page = f.read()
    except FileNotFoundError:
        page = "# Benchmarks\n\n"
    if SECTION_BEGIN in page and SECTION_END in page:
        head, rest = page.split(SECTION_BEGIN, 1)
        page = head + block + rest.split(SECTION_END, 1)[1].lstrip("\n")
    else:
        page = page.rstrip("\n") + "\n\n" + block
    with open(path, "w") as f:
        f.write(page)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds (best is kept)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384, 65536],
                        help="sequence lengths of the per-token linear-attention curve")
    parser.add_argument("--markdown", metavar="PATH", help="replace the 'Numba CPU backend' section of this file")
    parser.add_argument("--linear-vs-sgemm", action="store_true",
                        help="only causal linear attention (and its variants, torch eager) against sgemm, same rounds")
    parser.add_argument("--first-call", action="store_true",
                        help="only the first-call JIT compile times (fresh processes, empty NUMBA_CACHE_DIR)")
    parser.add_argument("--compile-times", action="store_true",
                        help="only the compile probe (each kernel family's first call, empty cache) per tree")
    parser.add_argument("--pairs", type=int, default=3, help="--first-call / --compile-times: processes per tree")
    parser.add_argument("--trees", nargs="+", default=[os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")],
                        help="--first-call / --compile-times: source trees to alternate (an A/B of two checkouts)")
    args = parser.parse_args(argv)
    if args.linear_vs_sgemm or args.first_call or args.compile_times:
        print(f"Machine: {machine()}; load average before: {os.getloadavg()[0]:.2f}")
        if args.linear_vs_sgemm:
            table, notes = linear_vs_sgemm(args.rounds)
            print(table)
            for note in notes:
                print(f"- {note}")
        if args.first_call:
            print(first_call(args.pairs, [os.path.abspath(t) for t in args.trees]))
        if args.compile_times:
            print(compile_times_ab(args.pairs, [os.path.abspath(t) for t in args.trees]))
        print(f"load average after: {os.getloadavg()[0]:.2f}")
        return
    text = report(args)
    print(text)
    if args.markdown:
        write_section(args.markdown, text)


if __name__ == "__main__":
    main()
