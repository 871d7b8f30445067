"""CPU benchmark harness: ``python benchmarks/run.py [--quick]``.

Times ``rotary.apply_qk`` on every available backend, and peers installed here (HF transformers'
torch-CPU ``LlamaRotaryEmbedding`` + ``apply_rotary_pos_emb``; a naive NumPy RoPE written like HF's,
``x*cos + rotate_half(x)*sin``), over three shapes (Llama-8B prefill, decode, long context) and two
dtypes; and ``rotary.linear_attention`` (causal and not) when it exists. Speeds are reported as
ratios against this machine's limits measured in the same run:

- copy bandwidth (bytes read + written per second, with ``--threads`` threads: NumPy copy, and a
  Numba ``prange`` copy when Numba is installed; the better one is the limit);
- sgemm GFLOP/s (``np.dot`` of float32 matrices with ``--threads`` BLAS threads).

RoPE moves ``2 * (Hq + Hk) * S * D * itemsize`` bytes (read q, k; write both), so its "% of copy"
is that over the copy bandwidth. Linear attention's nominal work is ``4 * S * H * D * Dv`` flops
(the state ``sum k v^T`` and its product with q), so its "% of sgemm" is that over sgemm GFLOP/s.

Writes ``benchmarks/results/latest.json`` and replaces the "Summary (benchmarks/run.py)" section of
``docs/benchmarks.md`` (other sections are kept). Per case: one warm-up call, then at least 3 calls
and more until ``--min-time`` seconds or ``--max-reps`` calls; the best time is reported (the median is
kept in the JSON).
"""

from __future__ import annotations

import argparse
import os
import sys

THREADS_DEFAULT = 2


def _set_threads(n: int) -> None:
    """Thread counts for BLAS/OpenMP/Numba; must run before NumPy/Numba/torch are imported."""
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
        os.environ[var] = str(n)


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer repetitions and a shorter long-context case")
    p.add_argument("--threads", type=int, default=THREADS_DEFAULT, help="threads for every implementation (default 2)")
    p.add_argument("--min-time", type=float, default=None, help="seconds of timed calls per case (default 0.5; quick 0.1)")
    p.add_argument("--max-reps", type=int, default=None, help="most timed calls per case (default 200; quick 20)")
    p.add_argument("--out", default=None, help="results JSON (default benchmarks/results/latest.json)")
    p.add_argument("--docs", default=None, help="markdown file whose summary section is replaced (default docs/benchmarks.md)")
    p.add_argument("--no-docs", action="store_true", help="do not touch the markdown file")
    return p.parse_args(argv)


ARGS = None
if __name__ == "__main__":   # imported (by tests), the module leaves the thread settings alone
    ARGS = _parse(sys.argv[1:])
    _set_threads(ARGS.threads)

import datetime  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import rotary  # noqa: E402

BEGIN = "<!-- BEGIN benchmarks/run.py summary -->"
END = "<!-- END benchmarks/run.py summary -->"

#: name -> (batch, seq, q heads, k heads, head_dim, positions description)
SHAPES = {
    "prefill Llama-8B (4096 tok, 32/8 heads, d128)": (1, 4096, 32, 8, 128),
    "decode (32 seqs x 1 tok, 32/8 heads, d128)": (32, 1, 32, 8, 128),
    "long context (32k tok, 8/8 heads, d128)": (1, 32768, 8, 8, 128),
}
LINEAR_SHAPE = (1, 4096, 8, 128)    # batch, seq, heads, d (= dv)
BASE = 500000.0


# -- timing ------------------------------------------------------------------------------------
def time_call(fn, min_time: float, max_reps: int, min_reps: int = 3) -> dict:
    """Best (minimum) and median seconds of ``fn()`` after one warm-up call: at least ``min_reps``
    calls, then more until ``min_time`` seconds have passed or ``max_reps`` calls were made.

    The minimum is reported because on a small shared machine other processes only ever add time,
    and threaded calls suffer most from them (a parallel region waits for its slowest thread)."""
    fn()
    times = []
    start = time.perf_counter()
    while len(times) < max_reps and (len(times) < min_reps or time.perf_counter() - start < min_time):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return {"seconds": min(times), "median_seconds": statistics.median(times), "reps": len(times)}


# -- machine limits ----------------------------------------------------------------------------
def machine_description() -> dict:
    """CPU model and details from ``lscpu`` (family/model, hypervisor, caches), cores, library versions."""
    model, details = platform.processor() or platform.machine(), []
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        fields = dict(re.findall(r"^([^:\n]+):\s*(.+)$", out, re.M))
        model = fields.get("Model name", model).strip()
        if "CPU family" in fields:
            details.append(f"family {fields['CPU family'].strip()} model {fields.get('Model', '?').strip()}")
        if "Hypervisor vendor" in fields:
            details.append(f"{fields['Hypervisor vendor'].strip()} guest")
        details += [f"{name} {fields[name].strip()}" for name in ("L2 cache", "L3 cache") if name in fields]
    except (OSError, subprocess.SubprocessError):
        pass
    versions = {"python": platform.python_version(), "numpy": np.__version__, "rotary": rotary.__version__}
    for mod in ("numba", "torch", "transformers", "cupy"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception:
            pass
    return {"cpu": model, "cpu_details": ", ".join(details), "logical_cores": os.cpu_count(), "threads": int(os.environ.get("OMP_NUM_THREADS", 0)),
            "versions": versions}


def copy_bandwidth(min_time: float) -> dict:
    """Bytes read + written per second copying a 256 MiB float32 array (NumPy; Numba prange if present)."""
    src = np.random.default_rng(0).standard_normal(1 << 26, dtype=np.float32)
    dst = np.empty_like(src)
    moved = 2 * src.nbytes
    result = {"numpy_copy_GBps": moved / time_call(lambda: np.copyto(dst, src), min_time, 10)["seconds"] / 1e9}
    try:
        import numba

        @numba.njit(parallel=True, cache=False)
        def pcopy(a, b):
            for i in numba.prange(a.shape[0]):
                b[i] = a[i]

        result["numba_prange_copy_GBps"] = moved / time_call(lambda: pcopy(src, dst), min_time, 10)["seconds"] / 1e9
    except ImportError:
        pass
    result["copy_GBps"] = max(result.values())
    return result


def sgemm_gflops(min_time: float) -> float:
    n = 2048
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((n, n), dtype=np.float32) for _ in range(2))
    t = time_call(lambda: np.dot(a, b), min_time, 10)["seconds"]
    return 2 * n**3 / t / 1e9


# -- implementations of apply_qk ----------------------------------------------------------------
def naive_numpy_hf_style(spec):
    """HF's formula in NumPy: ``q*cos + rotate_half(q)*sin`` with cos/sin cast to the input dtype."""
    inv_freq = spec.inv_freq().astype(np.float32)

    def rotate_half(x):
        h = x.shape[-1] // 2
        return np.concatenate([-x[..., h:], x[..., :h]], axis=-1)

    def run(q, k, positions):            # q, k: (B, S, H, D); positions (B, S)
        freqs = positions[..., None].astype(np.float32) * inv_freq
        emb = np.concatenate([freqs, freqs], axis=-1)
        cos = np.cos(emb).astype(q.dtype)[:, :, None, :]
        sin = np.sin(emb).astype(q.dtype)[:, :, None, :]
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

    return run


def hf_torch_rotary(threads: int):
    """HF transformers' LlamaRotaryEmbedding + apply_rotary_pos_emb on torch CPU tensors (BHSD views)."""
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    torch.set_num_threads(threads)
    config = LlamaConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, rope_theta=BASE,
                         max_position_embeddings=131072)
    rope = LlamaRotaryEmbedding(config)

    def prepare(q, k, positions):       # BSHD numpy -> BHSD torch views, as HF's attention does
        return (torch.from_numpy(q).transpose(1, 2), torch.from_numpy(k).transpose(1, 2),
                torch.from_numpy(positions))

    def run(q, k, position_ids):
        with torch.inference_mode():
            cos, sin = rope(q, position_ids)
            return apply_rotary_pos_emb(q, k, cos, sin)

    def to_bshd(outputs):
        return tuple(o.transpose(1, 2).numpy() for o in outputs)

    return prepare, run, f"torch {torch.__version__}, transformers {__import__('transformers').__version__}", to_bshd


def rope_cases(quick: bool):
    shapes = dict(SHAPES)
    if quick:
        shapes = {k.replace("32k", "8k"): (v if v[1] != 32768 else (1, 8192) + v[2:]) for k, v in shapes.items()}
    rng = np.random.default_rng(0)
    for shape_name, (b, s, hq, hk, d) in shapes.items():
        positions = (np.broadcast_to(np.arange(s), (b, s)) if s > 1 else rng.integers(100, 8000, size=(b, 1)))
        positions = np.ascontiguousarray(positions, dtype=np.int64)
        for dtype in ("float32", "float16"):
            q = rng.standard_normal((b, s, hq, d)).astype(dtype)
            k = rng.standard_normal((b, s, hk, d)).astype(dtype)
            yield shape_name, dtype, q, k, positions


CHECK_TOKENS = 16


def oracle_check(spec, q, k, positions):
    """A function (q_out, k_out) -> max |out - float64 oracle| over the last CHECK_TOKENS tokens of each row."""
    from rotary.testing import rope_complex

    sel = slice(max(0, q.shape[1] - CHECK_TOKENS), q.shape[1])
    pos = positions[:, sel][:, None, :]                      # (B, 1, s') against (B, H, s', D)
    refs = [rope_complex(np.swapaxes(x[:, sel], 1, 2), pos, spec.inv_freq()) for x in (q, k)]

    def check(q_out, k_out):
        return max(float(np.abs(np.swapaxes(np.asarray(o)[:, sel], 1, 2).astype(np.float64) - ref).max())
                   for o, ref in zip((q_out, k_out), refs))

    return check


# -- linear attention ---------------------------------------------------------------------------
def linear_cases():
    b, s, h, d = LINEAR_SHAPE
    rng = np.random.default_rng(1)
    for dtype in ("float32", "float16"):
        q, k, v = (rng.standard_normal((b, s, h, d)).astype(dtype) for _ in range(3))
        for causal in (False, True):
            yield f"linear attention {'causal' if causal else 'non-causal'} ({s} tok, {h} heads, d{d})", dtype, q, k, v, causal


# -- main -----------------------------------------------------------------------------------------
def progress(total):
    try:
        from tqdm import tqdm

        return tqdm(total=total, unit="case", file=sys.stderr, dynamic_ncols=True)
    except ImportError:
        class Plain:
            def __init__(self):
                self.n = 0

            def update(self, k=1):
                self.n += k
                print(f"  {self.n}/{total}", file=sys.stderr, flush=True)

            def set_description(self, text):
                print(f"  {text}", file=sys.stderr, flush=True)

            def close(self):
                pass

        return Plain()


def run(args) -> dict:
    min_time = args.min_time if args.min_time is not None else (0.1 if args.quick else 0.5)
    max_reps = args.max_reps if args.max_reps is not None else (20 if args.quick else 200)
    backends = [name for name, (ok, _) in rotary.available_backends().items() if ok]
    unavailable = {name: reason for name, (ok, reason) in rotary.available_backends().items() if not ok}
    peers, peer_errors = {}, {}
    spec = rotary.RopeSpec(128, base=BASE)
    peers["numpy-naive-hf-style"] = (lambda q, k, p: (q, k, p), naive_numpy_hf_style(spec),
                                     "NumPy, x*cos + rotate_half(x)*sin", lambda outputs: outputs)
    try:
        peers["hf-torch-cpu"] = hf_torch_rotary(args.threads)
    except Exception as exc:   # torch/transformers missing or incompatible: report, do not fail
        peer_errors["hf-torch-cpu"] = f"{type(exc).__name__}: {exc}"
    has_linear = hasattr(rotary, "linear_attention")

    machine = machine_description()
    load_before = os.getloadavg()[0]
    print(f"machine: {machine['cpu']}, {machine['logical_cores']} logical cores, {args.threads} threads; "
          f"load average {load_before:.2f}", file=sys.stderr)
    if load_before > 0.5:
        print("warning: other processes are running; threaded implementations will look slower than they are",
              file=sys.stderr)
    limits = copy_bandwidth(min_time)
    limits["sgemm_GFLOPs"] = sgemm_gflops(min_time)
    print(f"limits: copy {limits['copy_GBps']:.1f} GB/s, sgemm {limits['sgemm_GFLOPs']:.1f} GFLOP/s", file=sys.stderr)

    rope = list(rope_cases(args.quick))
    linear = list(linear_cases()) if has_linear else []
    bar = progress(len(rope) * (len(backends) + len(peers)) + len(linear) * len(backends))
    results = []
    for shape_name, dtype, q, k, positions in rope:
        moved = 2 * (q.nbytes + k.nbytes)
        row = {"kind": "apply_qk", "case": shape_name, "dtype": dtype, "q_shape": list(q.shape), "k_shape": list(k.shape),
               "bytes_moved": moved, "impls": {}}
        impls = {f"rotary[{b}]": (None, b) for b in backends}
        impls.update({name: (peer, None) for name, peer in peers.items()})
        check = oracle_check(spec, q, k, positions)
        for impl, (peer, backend) in impls.items():
            bar.set_description(f"{shape_name[:24]} {dtype} {impl}")
            if backend is not None:
                pos_arg = positions if positions.shape[0] > 1 else positions[0]
                fn = (lambda b=backend, pa=pos_arg: rotary.apply_qk(q, k, pa, spec=spec, seq_axis=-3, backend=b))
                to_bshd = (lambda outputs: outputs)
            else:
                prepare, call, to_bshd = peer[0], peer[1], peer[3]
                qa, ka, pa = prepare(q, k, positions)
                fn = (lambda call=call, qa=qa, ka=ka, pa=pa: call(qa, ka, pa))
            max_error = check(*to_bshd(fn()))
            timing = time_call(fn, min_time, max_reps)
            timing["max_error"] = max_error
            timing["GBps"] = moved / timing["seconds"] / 1e9
            timing["fraction_of_copy"] = timing["GBps"] / limits["copy_GBps"]
            row["impls"][impl] = timing
            bar.update()
        hf = row["impls"].get("hf-torch-cpu")
        for timing in row["impls"].values():
            timing["speedup_vs_hf_torch"] = hf["seconds"] / timing["seconds"] if hf else None
        results.append(row)
    for name, dtype, q, k, v, causal in linear:
        b, s, h, d = q.shape
        flops = 4 * b * s * h * d * v.shape[-1]
        row = {"kind": "linear_attention", "case": name, "dtype": dtype, "q_shape": list(q.shape), "causal": causal,
               "nominal_flops": flops, "impls": {}}
        for backend in backends:
            bar.set_description(f"{name[:24]} {dtype} {backend}")
            fn = (lambda b=backend: rotary.linear_attention(q, k, v, spec=spec, seq_axis=-3, causal=causal, backend=b))
            timing = time_call(fn, min_time, max_reps)
            timing["GFLOPs"] = flops / timing["seconds"] / 1e9
            timing["fraction_of_sgemm"] = timing["GFLOPs"] / limits["sgemm_GFLOPs"]
            row["impls"][f"rotary[{backend}]"] = timing
            bar.update()
        results.append(row)
    bar.close()
    machine["load_average_1min"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    return {
        "command": "python benchmarks/run.py" + (" --quick" if args.quick else ""),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine, "limits": limits, "backends": backends, "unavailable_backends": unavailable,
        "peers": {name: peer[2] for name, peer in peers.items()}, "peer_errors": peer_errors,
        "error_check": f"max |output - float64 oracle| over the last {CHECK_TOKENS} tokens of each sequence",
        "timing": {"min_time_s": min_time, "max_reps": max_reps, "statistic": "min"},
        "results": results,
    }


def headline(data) -> str | None:
    """NumPy backend vs HF torch-CPU at the Llama-8B prefill shape, fp32."""
    for row in data["results"]:
        if row["kind"] == "apply_qk" and row["case"].startswith("prefill") and row["dtype"] == "float32":
            ours, hf = row["impls"].get("rotary[numpy]"), row["impls"].get("hf-torch-cpu")
            if ours and hf:
                return (f"**NumPy backend vs HF torch-CPU rotary, Llama-8B prefill, fp32:** "
                        f"{ours['seconds'] * 1e3:.1f} ms vs {hf['seconds'] * 1e3:.1f} ms, "
                        f"**{hf['seconds'] / ours['seconds']:.2f}x** (goal: >= 2x).")
    return None


def markdown(data) -> str:
    m, lim = data["machine"], data["limits"]
    copy_parts = ", ".join(f"{k.replace('_GBps', '').replace('_', ' ')} {v:.1f}"
                           for k, v in lim.items() if k.endswith("_GBps") and k != "copy_GBps")
    lines = [
        BEGIN,
        "## Summary (benchmarks/run.py)",
        "",
        f"Command: `{data['command']}`, run {data['date']} on **{m['cpu']}** "
        f"({m['logical_cores']} logical cores{'; ' + m['cpu_details'] if m.get('cpu_details') else ''}), "
        f"{m['threads']} threads for every implementation; 1-minute load average "
        + (" -> ".join(f"{x:.2f}" for x in m["load_average_1min"]) + " (start -> end; other processes slow "
           "threaded calls most). " if m.get("load_average_1min") else "") + "Versions: "
        + ", ".join(f"{k} {v}" for k, v in m["versions"].items()) + ".",
        "",
        f"Limits measured in the same run: copy bandwidth **{lim['copy_GBps']:.1f} GB/s** (read + write; {copy_parts}), "
        f"sgemm **{lim['sgemm_GFLOPs']:.1f} GFLOP/s** (`np.dot`, 2048^3 float32). "
        f"Times are the best of at least 3 calls (more, up to {data['timing']['max_reps']}, until "
        f"{data['timing']['min_time_s']} s have passed) after a warm-up call; medians are in the JSON.",
        "",
    ]
    if data["unavailable_backends"]:
        lines += ["Backends not available in this run: " + "; ".join(
            f"{k} ({v.split(';')[0]})" for k, v in data["unavailable_backends"].items()) + ".", ""]
    if data["peer_errors"]:
        lines += ["Peers not run: " + "; ".join(f"{k} ({v})" for k, v in data["peer_errors"].items()) + ".", ""]
    head = headline(data)
    if head:
        lines += [head, ""]
    lines += ["### apply_qk", "",
              "GB/s counts q and k read and written once (`2 * (q.nbytes + k.nbytes)` per call); "
              "\"% copy\" is that over the copy bandwidth; \"vs HF\" is HF torch-CPU time / this time; "
              f"\"max err\" is the {data['error_check']}.", "",
              "| case | dtype | implementation | ms | GB/s | % copy | vs HF | max err |",
              "|---|---|---|---:|---:|---:|---:|---:|"]
    for row in data["results"]:
        if row["kind"] != "apply_qk":
            continue
        for impl, t in row["impls"].items():
            vs = f"{t['speedup_vs_hf_torch']:.2f}x" if t.get("speedup_vs_hf_torch") else "-"
            err = f"{t['max_error']:.1e}" if t.get("max_error") is not None else "-"
            lines.append(f"| {row['case']} | {row['dtype']} | {impl} | {t['seconds'] * 1e3:.3f} | {t['GBps']:.2f} | "
                         f"{100 * t['fraction_of_copy']:.0f}% | {vs} | {err} |")
    lin = [r for r in data["results"] if r["kind"] == "linear_attention"]
    if lin:
        lines += ["", "### linear_attention", "",
                  "Nominal work `4 * S * H * D * Dv` flops (the state and its product with q); \"% sgemm\" is that "
                  "rate over the sgemm rate.", "",
                  "| case | dtype | implementation | ms | GFLOP/s | % sgemm |", "|---|---|---|---:|---:|---:|"]
        for row in lin:
            for impl, t in row["impls"].items():
                lines.append(f"| {row['case']} | {row['dtype']} | {impl} | {t['seconds'] * 1e3:.2f} | "
                             f"{t['GFLOPs']:.1f} | {100 * t['fraction_of_sgemm']:.0f}% |")
    lines += ["", "Raw numbers: `benchmarks/results/latest.json`; bar chart: `python docs/scripts/make_plots.py` "
              "writes `docs/img/benchmarks.png`.", "", "![apply_qk throughput per implementation](img/benchmarks.png)",
              END]
    return "\n".join(lines)


def update_docs(path: Path, section: str) -> None:
    """Replace the marked summary section of ``path`` (or put it after the title); keep everything else."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if BEGIN in text and END in text:
        before, rest = text.split(BEGIN, 1)
        after = rest.split(END, 1)[1]
        text = before + section + after
    else:
        lines = text.split("\n")
        title = 1 if lines and lines[0].startswith("# ") else 0
        text = "\n".join(lines[:title] + ["", section, ""] + lines[title:]).replace("\n\n\n", "\n\n")
    path.write_text(text if text.endswith("\n") else text + "\n")


def main(args) -> int:
    data = run(args)
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / "latest.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    section = markdown(data)
    if not args.no_docs:
        update_docs(Path(args.docs) if args.docs else ROOT / "docs" / "benchmarks.md", section)
    print(section)
    print(f"\nwrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
