"""A decode step of a Llama-3-8B-shaped model's attention part on one ``rotary.KVCache`` (issue 43), beside torch:

    PYTHONPATH=. python benchmarks/bench_decode_step.py             # 1k / 4k / 16k keys x batch 1 / 8 / 32
                                                                    # x fp32 / int8 -> results/decode_step.json
    PYTHONPATH=. python benchmarks/bench_decode_step.py --quick     # one small cell (1k keys x 8), 2 layers, 3 rounds
    PYTHONPATH=. python benchmarks/bench_decode_step.py --cells 4kx8 16kx1 --kv int8 --rounds 9 --max-gb 12
    python docs/scripts/plot_decode_step.py                         # docs/img/decode_step.png from the JSON

The model: 32 layers, 8 k/v heads x 128, 32 q heads (GQA 4), one ``KVCache(spec, batch=B, kv_heads=8, head_dim=128,
page_size=16, layers=L, backend="numba", kv_dtype=None or "int8")``. A step, per layer: ``layer = cache.layer(i);
layer.append(k, v); o = layer.attend(q)`` (k, v (B, 1, 8, 128), q (B, 1, 32, 128) float32, the same arrays every
layer; q is rotated inside the attention kernel). Each cell (keys held per sequence x batch x entry type) is filled
first, untimed: the context appended in chunks of random normal keys and values (a chunk reused along the sequence:
rotated at other positions, the keys differ).

Rows per cell, each a step's time (median and best of ``--rounds`` rounds, each round ``reps`` steps, reps chosen
so that a round of the step takes ~0.1 s, at most 16), timed interleaved round by round. Every round first truncates
the sequences back to ``context - 1`` keys (untimed), so the step appends from there and attends over ``context`` ..
``context + reps - 1`` keys (the bytes are counted at ``context``), and takes a page as decoding does:

- **step**: append + attention of every layer (the engine's hot loop);
- **append** alone and **attention** alone (every layer's; the attention between steps, its prepared call);
- **read limit**: a ``numba.get_num_threads()``-thread Numba ``prange`` kernel that sums every byte (as int64 words)
  of the cache's own pools over the pages the step reads (K and V; int8: entries and scales): the same bytes, in the
  same run; its GB/s turns the step's K+V bytes into the time a streaming read of them takes, and
  ``fraction = read-limit time / measured time`` (1.0: the step reads its keys as fast as a plain read does);
- **compute limit**: the attention's flops (``4 x head_dim`` a q head and key: q.k and p.v) at the same run's float32
  matrix-multiply rate (NumPy's BLAS, 2048 x 2048, as benchmarks/run.py measures it); ``binding`` = the larger of
  the two limits' times / the attention's time (int8 entries read a quarter of the bytes: the compute limit binds
  there);
- **torch** (fp32 cells, ``torch.set_num_threads(numba.get_num_threads())``): per layer
  ``scaled_dot_product_attention(q, k, v, enable_gqa=True)`` on keys and values the step first **gathers** from a
  paged torch pool (``torch.index_select(k_pool, 0, block_table.flatten(), out=workspace)``, the workspace reused by
  every layer; the pools are torch views of the cache's own, no copy), and the same SDPA on keys and values
  **gathered beforehand** (a copy per layer, the gather untimed; ``--torch-layout``: token-major copies given as
  transposed views, the default, which SDPA ran ~12 % faster than contiguous (B, 8, keys, 128) ones on the
  development VM). Torch does no append and gets q rotated beforehand (both favour it). The int8 rows show the fp32
  torch rows of the same shape (torch has no int8 SDPA): the comparison for int8 is against fp32 torch.

Before timing, one layer's ``layer.attend(q)`` is checked against torch SDPA on the gathered keys (fp32: the same
paged pool through torch indexing; int8: the dequantized keys/values of ``cache.keys(b, layer=i)`` /
``cache.values(b, layer=i)``, up to 8 sequences): max |diff| / max |o| < 1e-4, printed.

**Memory-heavy cells** (the whole model's K+V at 16k keys x 32 sequences is 128 GiB in fp32): a cell times
``L' <= 32`` layers, the most whose peak memory (the pools while they grow by doubling, torch's pre-gathered copies
of every timed layer and one gather's temporaries) stays under ``--max-gb`` (default 6 GiB), and reports the L'-layer
time x 32 / L'. Every layer reads its own pool and a step's time is the sum of its layers' (the same work each); in
the cells that time fewer than 32 layers the timed layers' K+V are >= 128 MiB a layer, far past the last-level
cache, so no layer's keys are still cached when the next step reads them: the scaling does not flatter them. A cell
whose one layer does not fit is skipped (said in the output and the JSON): 16k x 32 fp32 (4 GiB a layer) at the
default budget. ``--layers`` caps L' (``--quick``: 2; the step is still scaled to 32 layers). The cache holds the
timed layers in one pool (``layers=L'``). Reusing one layer's pool for all 32 layers (``layers=1``, 32 appends and
attentions a step) was not done: it would read the same keys 32 times a step (from the cache, in the small cells)
and grow every sequence by 32 tokens a step.

The machine's load average is printed with each table: on a shared machine the figures move with it.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import rotary  # noqa: E402

MODEL_LAYERS, HK, HQ, D, PAGE = 32, 8, 32, 128, 16
BASE = 500000.0
CONTEXTS, BATCHES, KVS = (1024, 4096, 16384), (1, 8, 32), ("fp32", "int8")
RESULTS = ROOT / "benchmarks" / "results" / "decode_step.json"
QUICK_CELL = (1024, 8)
TOL = 1e-4
ROUND_S = 0.1      # a round's target time for the step (reps = steps per round)
MAX_REPS = 16      # lengths stay within C .. C + MAX_REPS (every round truncates back)
CHECK_SEQS = 8     # int8 check: the dequantized keys of this many sequences
GiB = 2**30
MiB = 2**20


# -- pure helpers (tests/test_bench_decode_step.py) ---------------------------------------------------------------
def parse_cell(text: str) -> tuple[int, int]:
    """``"4kx8"`` / ``"4096x8"`` -> (keys held per sequence, batch)."""
    try:
        c, b = text.lower().replace("*", "x").split("x")
        context = int(float(c[:-1]) * 1024) if c.endswith("k") else int(c)
        batch = int(b)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a cell is KEYSxBATCH (e.g. 4kx8 or 1000x32), got {text!r}") from None
    if context < 2 or batch < 1:
        raise argparse.ArgumentTypeError(f"a cell needs >= 2 keys and >= 1 sequence, got {text!r}")
    return context, batch


def cell_label(context: int, batch: int) -> str:
    c = f"{context // 1024}k" if context % 1024 == 0 else str(context)
    return f"{c} x {batch}"


def entry_bytes(kv: str) -> int:
    """Bytes of one (token, head) entry of K (or V) as the cache stores it: fp32 D x 4, int8 D x 1 + a fp32 scale."""
    return D * 4 if kv == "fp32" else D + 4


def kv_bytes_per_layer(context: int, batch: int, kv: str) -> int:
    """K+V bytes that one layer's attention reads for ``batch`` sequences of ``context`` keys."""
    return 2 * batch * context * HK * entry_bytes(kv)


def peak_bytes(context: int, batch: int, kv: str, layers: int, torch_rows: bool = True) -> int:
    """A cell's peak memory, roughly: the pools (x1.5 while they grow by doubling during the fill), for fp32 with
    torch also its pre-gathered copy of every timed layer and one gather's temporaries; int8: the check's
    dequantized keys and values of up to CHECK_SEQS sequences."""
    s = kv_bytes_per_layer(context, batch, kv)
    if kv == "fp32":
        return (2 * layers + 1) * s if torch_rows else (3 * layers * s) // 2 + s
    check = 2 * min(batch, CHECK_SEQS) * context * HK * D * 4
    return max((3 * layers * s) // 2, layers * s + check)


def plan_layers(context: int, batch: int, kv: str, max_layers: int, budget_bytes: float,
                torch_rows: bool = True) -> int:
    """The most layers (<= max_layers) a cell can time under the memory budget; 0: not even one."""
    for layers in range(max_layers, 0, -1):
        if peak_bytes(context, batch, kv, layers, torch_rows) <= budget_bytes:
            return layers
    return 0


def summarize(times_s, reps: int, scale: float) -> dict:
    """Per-round block times -> per-step ms (median, best) scaled to the model's layers."""
    per = np.asarray(times_s, float) / reps * scale * 1e3
    return {"median_ms": float(np.median(per)), "best_ms": float(per.min()), "rounds_ms": [float(t) for t in per]}


def load() -> str:
    try:
        return "load average %.1f %.1f %.1f" % os.getloadavg()
    except OSError:
        return "load average unknown"


def _loadavg():
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def llc_bytes() -> int | None:
    """The last-level cache's size from sysfs (Linux), else None."""
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    best = None
    for index in sorted(base.glob("index*")) if base.exists() else ():
        try:
            text = (index / "size").read_text().strip()
            level = int((index / "level").read_text())
        except (OSError, ValueError):
            continue
        mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        size = int(text.rstrip("KMG")) * mult
        if best is None or level >= best[0]:
            best = (level, size)
    return best[1] if best else None


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# -- the limits -------------------------------------------------------------------------------------------------------
def sgemm_gflops() -> float:
    """This run's float32 matrix-multiply rate (``benchmarks/run.py``'s measure: NumPy's BLAS, 2048 x 2048)."""
    from benchmarks.run import sgemm_gflops as measured

    return measured(0.1)


_READ = None


def read_kernel():
    """``read(words, rows, n)``: the int64 sum of ``words[r, :n]`` for r < rows (a C-contiguous 2-D int64 array),
    split over numba's threads (prange over rows x threads; each task sums a contiguous slice, vectorized)."""
    global _READ
    if _READ is None:
        import numba

        @numba.njit(nogil=True)
        def _sum(x):
            s = np.int64(0)
            for i in range(x.size):   # a 1-D C slice and range(size): LLVM vectorizes it (range(lo, hi) on the
                s += x[i]             # whole array did not: ~5 GB/s a core against 20-40 on the development VM)
            return s

        @numba.njit(parallel=True)
        def read(words, rows, n):
            threads = numba.get_num_threads()
            per = (n + threads - 1) // threads
            out = np.zeros(rows * threads, np.int64)
            for task in numba.prange(rows * threads):
                lo = min(n, (task % threads) * per)
                out[task] = _sum(words[task // threads, lo:min(n, lo + per)])
            return out.sum()

        _READ = read
    return _READ


def read_parts(cache, layers: int, pages: int, kv: str):
    """[(int64 words (layers, pool words), words per layer to read)] over the pages ``0 .. pages - 1`` of every timed
    layer's pools (the pages the step reads: pages are taken lowest first), K and V (int8: and their scales)."""
    arrays = [cache.k_pool, cache.v_pool] + (list(cache.scales) if kv == "int8" else [])
    parts = []
    for a in arrays:
        assert a.flags.c_contiguous and a.shape[0] == layers
        page_bytes = a[0, 0].nbytes
        parts.append((a.reshape(layers, -1).view(np.uint8).view(np.int64), pages * page_bytes // 8))
    return parts


# -- one cell ------------------------------------------------------------------------------------------------------
def run_cell(context: int, batch: int, kv: str, layers: int, args, rng, torch=None) -> dict:
    import numba

    spec = rotary.RopeSpec(D, base=BASE)
    held0 = context - 1   # rounds start here: the step's append writes position context - 1, attention reads context
    pages_per_seq = -(-(context + MAX_REPS + 1) // PAGE) + 1
    cache = rotary.KVCache(spec, batch=batch, kv_heads=HK, head_dim=D, page_size=PAGE,
                           num_pages=batch * pages_per_seq, layers=layers, backend="numba",
                           kv_dtype=None if kv == "fp32" else "int8")
    views = [cache.layer(i) for i in range(layers)]
    scale_to_model = MODEL_LAYERS / layers

    # fill (untimed as a figure): chunks of <= 32 MiB of keys, every layer
    t0 = time.perf_counter()
    chunk = max(1, min(held0, (32 * MiB) // (batch * HK * D * 4)))
    kc = rng.standard_normal((batch, chunk, HK, D), dtype=np.float32)
    vc = rng.standard_normal((batch, chunk, HK, D), dtype=np.float32)
    pos = 0
    while pos < held0:
        n = min(chunk, held0 - pos)
        kn, vn = (kc, vc) if n == chunk else (np.ascontiguousarray(kc[:, :n]), np.ascontiguousarray(vc[:, :n]))
        for view in views:
            view.append(kn, vn)
        pos += n
    del kc, vc
    fill_s = time.perf_counter() - t0

    k = rng.standard_normal((batch, 1, HK, D), dtype=np.float32)
    v = rng.standard_normal((batch, 1, HK, D), dtype=np.float32)
    q = rng.standard_normal((batch, 1, HQ, D), dtype=np.float32)

    def step():
        for view in views:
            view.append(k, v)
            view.attend(q)

    def append_only():
        for view in views:
            view.append(k, v)

    def attend_only():
        for view in views:
            view.attend(q)

    for view in views:   # one step: every sequence now holds `context` keys
        view.append(k, v)
    lengths = cache.lengths.copy()
    assert np.all(lengths == context), lengths
    last = layers - 1
    o = views[last].attend(q)
    pages_read = -(-context // PAGE)
    table = np.ascontiguousarray(cache.block_table[:, :pages_read])
    assert table.min() >= 0
    pages_used = int(table.max()) + 1

    # the check: layer `last` against torch SDPA on the gathered (fp32) / dequantized (int8) keys and values
    q_rot = rotary.apply(q, lengths[:, None] - 1, spec=spec, seq_axis=1, backend="numba")   # (B, 1, HQ, D)
    scale = 1.0 / math.sqrt(D)
    err = check_seqs = None
    tq = tk_pools = tv_pools = bt_flat = None
    if torch is not None:
        tq = torch.from_numpy(np.ascontiguousarray(q_rot.transpose(0, 2, 1, 3)))       # (B, HQ, 1, D)
        if kv == "fp32":
            tk_pools = [torch.from_numpy(cache.k_pool[i]) for i in range(layers)]      # views of the cache's pools
            tv_pools = [torch.from_numpy(cache.v_pool[i]) for i in range(layers)]
            bt_flat = torch.from_numpy(table.reshape(-1))

    work = {}

    def gathered(pool, which=0):
        """(pages, 16, HK, D) -> the keys of every sequence as (B, HK, context, D): the pages gathered by
        ``index_select`` into a workspace reused by every layer (an engine's; a new tensor per call,
        ``pool[block_table]``, pays the page faults of fresh memory: ~2.6x the gather's time here), returned as
        the token-major workspace's transposed view (SDPA took it ~12 % faster than a (B, HK, keys, D) copy)."""
        buf = work.get(which)
        if buf is None:
            buf = work[which] = torch.empty((batch * pages_read, PAGE, HK, D), dtype=pool.dtype)
        torch.index_select(pool, 0, bt_flat, out=buf)
        return buf.view(batch, pages_read * PAGE, HK, D)[:, :context].transpose(1, 2)

    def sdpa(qq, kk, vv):
        return torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, scale=scale, enable_gqa=True)

    if torch is not None:
        if kv == "fp32":
            check_seqs = batch
            want = sdpa(tq, gathered(tk_pools[last]), gathered(tv_pools[last], 1)).numpy().transpose(0, 2, 1, 3)
            got = o
        else:
            check_seqs = min(batch, CHECK_SEQS)
            keys = np.stack([cache.keys(b, layer=last) for b in range(check_seqs)]).transpose(0, 2, 1, 3)
            values = np.stack([cache.values(b, layer=last) for b in range(check_seqs)]).transpose(0, 2, 1, 3)
            want = sdpa(tq[:check_seqs], torch.from_numpy(np.ascontiguousarray(keys)),
                        torch.from_numpy(np.ascontiguousarray(values))).numpy().transpose(0, 2, 1, 3)
            got = o[:check_seqs]
            del keys, values
        err = float(np.abs(got - want).max() / np.abs(want).max())
        print(f"  check {cell_label(context, batch)} {kv}, layer {last}: layer.attend(q) against torch SDPA on the "
              f"{'gathered' if kv == 'fp32' else 'dequantized'} keys of {check_seqs} sequence(s): "
              f"max |diff| / max |o| = {err:.1e}")
        if not err < TOL:
            raise SystemExit(f"{cell_label(context, batch)} {kv}: layer.attend(q) disagrees with torch SDPA "
                             f"({err:.1e} >= {TOL:g}); nothing timed")

    # the candidates
    read = read_kernel()
    parts = read_parts(cache, layers, pages_used, kv)
    read_bytes = sum(layers * n * 8 for _, n in parts)

    def read_all():
        return sum(int(read(words, layers, n)) for words, n in parts)

    cands = {"step": step, "append": append_only, "attend": attend_only, "read_limit": read_all}
    pre = None
    if torch is not None and kv == "fp32":
        if args.torch_layout == "bshd":   # token-major copies (B, keys, HK, D), given as transposed views
            pre = [tuple(gathered(p, j).transpose(1, 2).clone().transpose(1, 2) for j, p in enumerate(pools))
                   for pools in zip(tk_pools, tv_pools)]
        else:                              # (B, HK, keys, D) contiguous
            pre = [tuple(gathered(p, j).contiguous() for j, p in enumerate(pools)) for pools in zip(tk_pools, tv_pools)]

        def torch_gather_sdpa():
            for i in range(layers):
                sdpa(tq, gathered(tk_pools[i]), gathered(tv_pools[i], 1))

        def torch_pregathered():
            for kk, vv in pre:
                sdpa(tq, kk, vv)

        cands["torch_gather_sdpa"] = torch_gather_sdpa
        cands["torch_sdpa_pregathered"] = torch_pregathered

    def before(name):   # untimed: the step's lengths back to context - 1 (attention alone: at context)
        if name in ("step", "append", "attend"):
            cache.truncate(None, held0)
            if name == "attend":
                append_only()

    # reps from one warm step; every candidate runs once before the rounds (compiles, first touches)
    for name, fn in cands.items():
        before(name)
        fn()
    before("step")
    t = time.perf_counter()
    step()
    reps = int(min(MAX_REPS, max(1, round(ROUND_S / max(time.perf_counter() - t, 1e-6)))))
    times = {name: [] for name in cands}
    load_before = _loadavg()
    for _ in range(args.rounds):
        for name, fn in cands.items():
            before(name)
            t = time.perf_counter()
            for _ in range(reps):
                fn()
            times[name].append(time.perf_counter() - t)
    load_after = _loadavg()
    assert int(cache.lengths.max()) <= context + MAX_REPS

    rows = {name: summarize(ts, reps, scale_to_model) for name, ts in times.items()}
    read_s = float(np.median(times["read_limit"])) / reps
    gbps = read_bytes / read_s / 1e9
    step_bytes = MODEL_LAYERS * kv_bytes_per_layer(context, batch, kv)
    limit_ms = step_bytes / (gbps * 1e9) * 1e3
    fractions = {name: limit_ms / rows[name]["median_ms"]
                 for name in ("step", "attend", "torch_gather_sdpa", "torch_sdpa_pregathered") if name in rows}
    # the compute limit: the attention's flops (q.k and p.v: 2 x 2 x head_dim a q head and key) at this run's sgemm rate
    gflops = sgemm_gflops()
    compute_ms = MODEL_LAYERS * 4 * batch * context * HQ * D / (gflops * 1e9) * 1e3
    binding_ms = max(limit_ms, compute_ms)
    binding = {name: binding_ms / rows[name]["median_ms"] for name in ("step", "attend")}
    llc = llc_bytes()
    timed_bytes = layers * kv_bytes_per_layer(context, batch, kv)
    res = {
        "context": context, "batch": batch, "kv": kv, "label": cell_label(context, batch),
        "layers_timed": layers, "scale_to_model": scale_to_model,
        "kv_bytes_per_step": step_bytes, "kv_bytes_timed_layers": timed_bytes,
        "fits_llc": bool(llc and timed_bytes < 4 * llc),
        "reps_per_round": reps, "rounds": args.rounds, "fill_s": fill_s,
        "rows": rows, "read_GBps": gbps, "read_bytes": read_bytes, "read_limit_ms": limit_ms,
        "fraction_of_read_limit": fractions,
        "sgemm_GFLOPs": gflops, "compute_limit_ms": compute_ms,
        "binding_limit": "read" if limit_ms >= compute_ms else "compute", "fraction_of_binding_limit": binding,
        "check": {"rel_error": err, "sequences": check_seqs, "layer": last,
                  "against": None if err is None else ("torch SDPA, keys gathered from the paged pool" if kv == "fp32"
                                                       else "torch SDPA on cache.keys/values (dequantized)")},
        "load_before": load_before, "load_after": load_after,
        "numba_threads": numba.get_num_threads(),
    }
    del pre, tk_pools, tv_pools, views, cache, work
    gc.collect()
    return res


# -- the report ----------------------------------------------------------------------------------------------------
def _ms(row) -> str:
    return "" if row is None else f"{row['median_ms']:.2f} ({row['best_ms']:.2f})"


def report(res: dict) -> str:
    lines = [f"\ndecode step of a Llama-3-8B-shaped attention ({MODEL_LAYERS} layers, {HK} k/v heads x {D}, {HQ} q "
             f"heads, page_size {PAGE}), numba {res['machine']['numba_threads']} threads, torch "
             f"{res['machine']['torch_threads']} threads; {res['machine']['cpu']}; {res['date']}; "
             f"rounds {res['rounds']}; {load()}",
             "ms per step of 32 layers: median (best); a cell timing L' < 32 layers shows its time x 32 / L'; torch "
             "is fp32 in every row (int8 rows: the fp32 torch rows of the same shape); read limit: a streaming read "
             "of the step's K+V bytes at the same-run GB/s; fraction = read-limit time / time; compute limit: the "
             "attention's flops at the same-run sgemm rate; binding = the larger limit's time / attention's time",
             "",
             "| keys x batch | KV | layers timed | K+V MiB / step | step (append + attention) | append | attention "
             "| torch gather + SDPA (fp32) | torch SDPA pre-gathered (fp32) | read limit (GB/s) | fraction: step "
             "| fraction: attention | torch gather+SDPA / step | torch pre-gathered / attention | check max err "
             "| compute limit (sgemm GFLOP/s) | binding limit: attention |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    torch_of = {(c["context"], c["batch"]): c["rows"] for c in res["cells"] if "torch_gather_sdpa" in c["rows"]}
    for c in res["cells"]:
        rows = c["rows"]
        trows = torch_of.get((c["context"], c["batch"]), {})
        tg, tp = trows.get("torch_gather_sdpa"), trows.get("torch_sdpa_pregathered")
        fr = c["fraction_of_read_limit"]
        layers = str(c["layers_timed"])
        if c["layers_timed"] != MODEL_LAYERS:
            layers += f" (x{c['scale_to_model']:.3g})"
        if c["fits_llc"]:
            layers += " (in LLC)"
        err = c["check"]["rel_error"]
        lines.append(
            f"| {c['label']} | {c['kv']} | {layers} | {c['kv_bytes_per_step'] / MiB:.0f} | {_ms(rows['step'])} | "
            f"{_ms(rows['append'])} | {_ms(rows['attend'])} | {_ms(tg)} | {_ms(tp)} | "
            f"{c['read_limit_ms']:.2f} ({c['read_GBps']:.1f}) | {fr['step']:.2f} | {fr['attend']:.2f} | "
            + (f"{tg['median_ms'] / rows['step']['median_ms']:.2f}" if tg else "") + " | "
            + (f"{tp['median_ms'] / rows['attend']['median_ms']:.2f}" if tp else "") + " | "
            + ("" if err is None else f"{err:.1e}") + " | "
            + (f"{c['compute_limit_ms']:.2f} ({c['sgemm_GFLOPs']:.0f}) | {c['fraction_of_binding_limit']['attend']:.2f}"
               f" ({c['binding_limit']}) |" if "compute_limit_ms" in c else " | |"))
    for s in res["skipped"]:
        lines.append(f"| {cell_label(s['context'], s['batch'])} | {s['kv']} | skipped: {s['reason']} |"
                     + " |" * 14)
    if any(c["layers_timed"] != MODEL_LAYERS for c in res["cells"]):
        lines.append(f"\n(x N: the cell timed fewer than {MODEL_LAYERS} layers to stay under --max-gb "
                     f"{res['max_gb']:g} GiB (or --layers) and shows that time x N: each layer reads its own pool.)")
    over = [f"{c['label']} {c['kv']}" for c in res["cells"] if max(c["fraction_of_read_limit"].values()) > 1.05]
    if over:
        lines.append(f"(fraction > 1 in {', '.join(over)}: the plain read ran slower than the kernels that read the "
                     "same bytes: the machine was busy (a descheduled thread stalls the read's static split), or "
                     "the bytes were in the cache; rerun on a quiet machine.)")
    if any(c["fits_llc"] for c in res["cells"]):
        lines.append("(in LLC: the timed layers' K+V are under 4x the last-level cache: the step and the read limit "
                     "may read from the cache, not memory.)")
    return "\n".join(lines)


def _git():
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", nargs="+", type=parse_cell, default=None,
                    help="KEYSxBATCH cells (default: 1k 4k 16k x 1 8 32), e.g. 4kx8 16kx1 1000x32")
    ap.add_argument("--kv", nargs="+", choices=KVS, default=list(KVS), help="entry types (default: fp32 int8)")
    ap.add_argument("--layers", type=int, default=MODEL_LAYERS,
                    help=f"at most this many layers timed per cell (the step is reported for {MODEL_LAYERS})")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--max-gb", type=float, default=6.0,
                    help="peak memory of a cell, GiB: cells time fewer layers (or are skipped) to stay under it")
    ap.add_argument("--no-torch", action="store_true", help="no torch rows and no check against torch")
    ap.add_argument("--torch-layout", choices=("bshd", "bhsd"), default="bshd",
                    help="torch's pre-gathered keys: token-major (B, keys, 8, 128) copies given to SDPA as transposed "
                         "views (default), or contiguous (B, 8, keys, 128)")
    ap.add_argument("--quick", action="store_true",
                    help=f"one cell ({cell_label(*QUICK_CELL)}), 2 layers, 3 rounds; JSON under the temp folder")
    ap.add_argument("--out", type=Path, default=None,
                    help=f"the JSON (default {RESULTS.relative_to(ROOT)}; --quick: <tmp>/decode_step_quick.json)")
    args = ap.parse_args(argv)
    if args.quick:
        args.cells = args.cells or [QUICK_CELL]
        args.layers = min(args.layers, 2)
        args.rounds = min(args.rounds, 3)
    if args.cells is None:
        args.cells = [(c, b) for c in CONTEXTS for b in BATCHES]
    if args.out is None:
        args.out = Path(tempfile.gettempdir()) / "decode_step_quick.json" if args.quick else RESULTS
    if not 1 <= args.layers <= MODEL_LAYERS or args.rounds < 1:
        ap.error(f"--layers must be in 1..{MODEL_LAYERS} and --rounds >= 1")
    return args


def main(argv=None) -> dict:
    import numba

    args = parse_args(argv)
    torch = None
    if not args.no_torch:
        try:
            import torch
        except ImportError:
            print("torch is not installed: no torch rows, no check")
    threads = numba.get_num_threads()
    if torch is not None:
        torch.set_num_threads(threads)
    rng = np.random.default_rng(0)
    budget = args.max_gb * GiB
    res = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(["bench_decode_step.py"] + (sys.argv[1:] if argv is None else list(argv))),
        "git": _git(), "rounds": args.rounds, "torch_layout": args.torch_layout, "max_gb": args.max_gb,
        "layers_cap": args.layers,
        "model": {"layers": MODEL_LAYERS, "kv_heads": HK, "q_heads": HQ, "head_dim": D, "page_size": PAGE,
                  "rope_base": BASE, "q_dtype": "float32"},
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "numba_threads": threads,
                    "numba_threading_layer": None, "torch_threads": torch.get_num_threads() if torch else None,
                    "llc_bytes": llc_bytes(), "numba": numba.__version__, "numpy": np.__version__,
                    "torch": torch.__version__ if torch else None, "python": platform.python_version()},
        "load_start": _loadavg(), "cells": [], "skipped": [],
    }
    print(f"decode step benchmark: cells {[cell_label(*c) for c in args.cells]}, kv {args.kv}, layers <= "
          f"{args.layers}, rounds {args.rounds}, --max-gb {args.max_gb:g}; numba {threads} threads; {load()}")
    for context, batch in args.cells:
        for kv in args.kv:
            layers = plan_layers(context, batch, kv, args.layers, budget, torch_rows=torch is not None)
            if layers == 0:
                need = peak_bytes(context, batch, kv, 1, torch is not None) / GiB
                reason = (f"one layer needs ~{need:.1f} GiB at its peak (K+V "
                          f"{kv_bytes_per_layer(context, batch, kv) / GiB:.2f} GiB a layer), over --max-gb "
                          f"{args.max_gb:g}")
                print(f"{cell_label(context, batch)} {kv}: skipped: {reason}")
                res["skipped"].append({"context": context, "batch": batch, "kv": kv, "reason": reason})
                continue
            t = time.perf_counter()
            cell = run_cell(context, batch, kv, layers, args, rng, torch)
            res["cells"].append(cell)
            r = cell["rows"]
            print(f"{cell['label']} {kv}: {layers} layers timed (x{cell['scale_to_model']:.3g}), filled in "
                  f"{cell['fill_s']:.1f} s; step {r['step']['median_ms']:.2f} ms, attention "
                  f"{r['attend']['median_ms']:.2f} ms, read limit {cell['read_limit_ms']:.2f} ms "
                  f"({cell['read_GBps']:.1f} GB/s): fraction {cell['fraction_of_read_limit']['step']:.2f}"
                  + (f"; torch gather + SDPA {r['torch_gather_sdpa']['median_ms']:.2f} ms"
                     if "torch_gather_sdpa" in r else "")
                  + f"  [{time.perf_counter() - t:.0f} s; {load()}]")
    try:
        res["machine"]["numba_threading_layer"] = numba.threading_layer()
    except ValueError:
        pass
    res["load_end"] = _loadavg()
    print(report(res))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"\nwrote {args.out}")
    return res


if __name__ == "__main__":
    main()
