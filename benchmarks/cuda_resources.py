"""Resource use of the CUDA kernels (ptxas), the occupancy it implies, and an H200 roofline of each kernel.

    python benchmarks/cuda_resources.py            # print the tables
    python benchmarks/cuda_resources.py --write    # also replace them in docs/cuda.md (between markers)

No GPU needed: every kernel instantiation (``rotary.backends.cupy.name_expressions``) is compiled with
``nvcc -Xptxas -v`` for sm_80 and sm_90, and the registers / spills / static shared memory / stack of each
entry function are parsed from ptxas's report. Occupancy follows CUDA's occupancy calculation (registers
rounded up to 8 per thread and allocated per warp in units of 256, shared memory per block plus the 1 KiB
the runtime reserves, at most 32 blocks and 64 warps per SM) with the launch geometry the CuPy backend's
planners choose for the shapes of benchmarks/gpu_check.py. The roofline is an estimate to check the
gpu_check measurement against, not a measurement: time >= max(bytes / HBM bandwidth, FLOP / FP32 FMA peak),
with the H200 SXM's published figures (4.8 TB/s, 132 SMs at 1.98 GHz boost: 66.9 FP32 TFLOP/s).
"""

from __future__ import annotations

import argparse
import math
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from rotary.backends import cupy as cb  # noqa: E402

DOC = ROOT / "docs" / "cuda.md"
BEGIN, END = "<!-- cuda_resources:begin -->", "<!-- cuda_resources:end -->"
ARCHS = ("sm_80", "sm_90")

#: per-SM limits: registers, max threads, max blocks, shared memory (bytes) per SM, reserved per block
SM_LIMITS = {
    "sm_80": dict(name="A100", regs=65536, threads=2048, blocks=32, smem=164 * 1024, reserved=1024),
    "sm_90": dict(name="H100/H200", regs=65536, threads=2048, blocks=32, smem=228 * 1024, reserved=1024),
}
H200 = dict(sms=132, hbm_Bps=4.8e12, fp32_FLOPs=132 * 128 * 2 * 1.98e9)


# -- ptxas ---------------------------------------------------------------------------------------------
def ptxas_report(family: str, nvcc: str, out_dir: Path, archs=ARCHS):
    """(rows, ptxas output): a dict(arch, kernel, registers, spill_stores, spill_loads, smem, stack) per
    instantiation of cuda_kernels/<family>.cu compiled standalone (tests/test_nvrtc.py checks the same run)."""
    names = [n for dtype in cb.KERNEL_TYPES for n in cb.name_expressions(family, dtype)]
    tu = out_dir / f"{family}_instances.cu"
    body = ",\n    ".join(f"(const void*)&{n}" for n in names)
    tu.write_text(f'#include "{cb.SOURCES[family]}"\nconst void* rotary_instances[] = {{\n    {body}\n}};\n')
    cmd = [nvcc, "-std=c++17", "-c", "-Xptxas", "-v", f"-I{cb.KERNEL_DIR}", str(tu), "-o", str(out_dir / "k.o")]
    cmd += [f"-gencode=arch=compute_{a[3:]},code={a}" for a in archs]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"nvcc failed: {' '.join(cmd)}\n{proc.stderr[-4000:]}")
    rows, cur = [], None
    for line in proc.stderr.splitlines():
        m = re.search(r"Compiling entry function '(\w+)' for '(sm_\d+)'", line)
        if m:
            cur = dict(arch=m.group(2), mangled=m.group(1), spill_stores=0, spill_loads=0, stack=0, smem=0)
            continue
        if cur is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            cur["stack"], cur["spill_stores"], cur["spill_loads"] = map(int, m.groups())
        m = re.search(r"Used (\d+) registers", line)
        if m:
            cur["registers"] = int(m.group(1))
            s = re.search(r"(\d+) bytes smem", line)
            cur["smem"] = int(s.group(1)) if s else 0
            rows.append(cur)
            cur = None
    demangled = _demangle([r["mangled"] for r in rows])
    for r in rows:
        r["kernel"] = re.sub(r"\(.*", "", demangled.get(r["mangled"], r["mangled"])).replace("void ", "")
    return rows, proc.stderr


def _demangle(names):
    if not shutil.which("c++filt") or not names:
        return {}
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.split("\n")
    return dict(zip(names, out))


# -- occupancy -----------------------------------------------------------------------------------------
def blocks_per_sm(arch: str, registers: int, threads: int, smem: int) -> tuple[int, str]:
    """(resident blocks per SM, the limiting resource)."""
    lim = SM_LIMITS[arch]
    warps = math.ceil(threads / 32)
    regs_per_warp = math.ceil(max(registers, 1) / 8) * 8 * 32
    regs_per_warp = math.ceil(regs_per_warp / 256) * 256
    by = {
        "registers": (lim["regs"] // regs_per_warp) // warps,
        "threads": lim["threads"] // (warps * 32),
        "blocks": lim["blocks"],
        "shared memory": lim["smem"] // (smem + lim["reserved"]),
    }
    limit = min(by, key=by.get)
    return by[limit], limit


def occupancy(arch: str, registers: int, threads: int, smem: int) -> tuple[float, int, str]:
    n, limit = blocks_per_sm(arch, registers, threads, smem)
    return n * math.ceil(threads / 32) / (SM_LIMITS[arch]["threads"] // 32), n, limit


# -- the gpu_check shapes: geometry, bytes and FLOP ------------------------------------------------------
def _fake(shape, dtype):
    """An array with the shape and C strides of ``shape`` that owns one element (planning reads metadata)."""
    dtype = np.dtype(dtype)
    strides = tuple(int(np.prod(shape[i + 1:])) * dtype.itemsize for i in range(len(shape)))
    return np.lib.stride_tricks.as_strided(np.zeros(1, dtype), shape, strides)


def rotation_workloads():
    """(label, plan, bytes, FLOP) of apply_qk at gpu_check's prefill (fp16, fp32) and decode shapes."""
    out = []
    for label, B, S, dtype, table_rows in (("prefill 65536 tok fp16", 1, 65536, "float16", 65536),
                                           ("prefill 65536 tok fp32", 1, 65536, "float32", 65536),
                                           ("decode 32 seq x 1 tok fp16", 32, 1, "float16", 4096)):
        q, k = _fake((B, S, 32, 128), dtype), _fake((B, S, 8, 128), dtype)
        qo, ko = _fake(q.shape, dtype), _fake(k.shape, dtype)
        cos = sin = _fake((table_rows, 64), np.float32)
        rows = _fake((B if B > 1 else 1, S), np.int64)
        plan = cb._plan_rotate([(q, qo), (k, ko)], cos, sin, rows, dtype_name=dtype, rotary_dim=128, layout="half",
                               inverse=False, address=lambda a: 0, threads=256, max_tokens_per_block=None,
                               shared_mem_limit=cb.SHARED_MEM_LIMIT)
        itemsize = np.dtype(dtype).itemsize
        n_tok = B * S
        nbytes = 2 * n_tok * 40 * 128 * itemsize + n_tok * (2 * 64 * 4 + 8)
        flop = n_tok * 40 * 64 * 6           # per pair: 4 mul + 2 add
        out.append((label, plan, nbytes, flop))
    return out


def linear_workloads(B: int = 4, H: int = 32, T: int = 8192, d: int = 128):
    """(label, geometry, bytes (L2 catching the re-reads; none), FLOP, gpu_check's FLOP) of causal linear
    attention, fp32, at gpu_check's shape by default, for each shared-memory budget."""
    out = []
    for budget in (cb.SHARED_MEM_LIMIT, 100 * 1024, 227 * 1024):
        grid, _, chunk, dv_tile, smem = cb.linear_attention_geometry(B, H, d, d, 4, 64, shared_mem_limit=budget)
        tiles = math.ceil(d / dv_tile)
        tensor = B * H * T * d * 4
        bytes_l2 = 4 * tensor + 2 * B * H * d * d * 4          # q, k, v, o once; the state in and out
        bytes_none = (2 * tiles + 2) * tensor + 2 * B * H * d * d * 4   # q and k re-read by every dv tile
        # per token and q head: A S and the state update (2 m dv each), P V (2 C dv), P once per dv tile
        # (2 C m x tiles; the causal half is computed tile-wise, counted whole), the denominator (2 m)
        flop = B * H * T * (4 * d * d + 2 * chunk * d + 2 * chunk * d * tiles + 2 * d)
        out.append((f"{budget // 1024} KiB", dict(grid=grid, chunk=chunk, dv_tile=dv_tile, smem=smem),
                    bytes_l2, bytes_none, flop, 4 * B * H * T * d * (chunk + d)))
    return out


# -- tables ----------------------------------------------------------------------------------------------
def tables(nvcc: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        rows = [r for family in cb.SOURCES for r in ptxas_report(family, nvcc, Path(tmp))[0]]
    by = {(r["arch"], r["kernel"]): r for r in rows}
    kernels = sorted({r["kernel"] for r in rows})
    lines = [f"Generated by `python benchmarks/cuda_resources.py --write` ({nvcc_version(nvcc)}).", "",
             "| kernel | sm_80 registers | sm_90 registers | spill stores / loads (B) | stack (B) | static smem (B) |",
             "|---|---|---|---|---|---|"]
    for k in kernels:
        a, b = by.get(("sm_80", k)), by.get(("sm_90", k))
        spills = "/".join(str(max(r[f"spill_{x}"] for r in (a, b) if r)) for x in ("stores", "loads"))
        stack = max(r["stack"] for r in (a, b) if r)
        smem = max(r["smem"] for r in (a, b) if r)
        lines.append(f"| `{k}` | {a['registers'] if a else '-'} | {b['registers'] if b else '-'} | {spills} | "
                     f"{stack} | {smem} |")
    lines += ["", "Occupancy implied (resident warps of 64 per SM; the limiting resource), at the CuPy backend's "
              "launch geometry:", "",
              "| kernel family | threads | dynamic smem (B) | sm_80 (A100) | sm_90 (H100/H200) |", "|---|---|---|---|---|"]

    def family_regs(prefix, arch):
        regs = [r["registers"] for r in rows if r["arch"] == arch and r["kernel"].startswith(prefix)
                and (prefix == "rope_rotate" or "<double" not in r["kernel"])]  # the fp32-work instantiations
        return min(regs), max(regs)

    def cell(arch, prefix, threads, smem):
        lo, hi = family_regs(prefix, arch)
        occ_hi, n_hi, lim = occupancy(arch, lo, threads, smem)
        occ_lo, n_lo, lim_lo = occupancy(arch, hi, threads, smem)
        if n_lo == n_hi:
            return f"{n_hi} blocks, {occ_hi:.0%} ({lim})"
        return f"{n_lo}-{n_hi} blocks, {occ_lo:.0%}-{occ_hi:.0%} ({lim_lo})"

    rot = rotation_workloads()
    for label, plan, _, _ in rot[:1] + rot[2:]:
        lines.append(f"| `rope_rotate` ({label}) | {plan.block} | {plan.shared_mem} | "
                     f"{cell('sm_80', 'rope_rotate', plan.block, plan.shared_mem)} | "
                     f"{cell('sm_90', 'rope_rotate', plan.block, plan.shared_mem)} |")
    lin = linear_workloads()
    for label, g, *_ in lin:
        for threads in (64, 128, 256):
            sm80 = cell("sm_80", "linear_attention", threads, g["smem"]) if g["smem"] <= 163 * 1024 else "does not fit"
            lines.append(f"| `linear_attention_chunked` fp32/bf16/fp16 ({label} budget: C={g['chunk']}, "
                         f"dv_tile={g['dv_tile']}) | {threads} | {g['smem']} | {sm80} | "
                         f"{cell('sm_90', 'linear_attention', threads, g['smem'])} |")

    lines += ["", f"H200 roofline of the gpu_check shapes (HBM {H200['hbm_Bps'] / 1e12:.1f} TB/s, FP32 "
              f"{H200['fp32_FLOPs'] / 1e12:.1f} TFLOP/s, {H200['sms']} SMs); an estimate to hold the measurement "
              "against:", "",
              "| workload | grid (blocks) | waves on 132 SMs | bytes | FLOP | memory bound | compute bound | estimate |",
              "|---|---|---|---|---|---|---|---|"]
    for label, plan, nbytes, flop in rot:
        n, _ = blocks_per_sm("sm_90", family_regs("rope_rotate", "sm_90")[1], plan.block, plan.shared_mem)
        t_mem, t_flop = nbytes / H200["hbm_Bps"], flop / H200["fp32_FLOPs"]
        est = max(t_mem, t_flop)
        note = f"{_us(est)}" if est > 5e-6 else f"{_us(est)} (launch-bound: expect ~3-5 µs)"
        lines.append(f"| `apply_qk` {label} (32/8 heads, d=128) | {plan.grid} | {plan.grid / (n * H200['sms']):.2f} | "
                     f"{_si(nbytes)}B | {_si(flop)} | {_us(t_mem)} | {_us(t_flop)} | {note} |")
    for shape, workloads in (("B=4, H=32", lin), ("B=1, H=8", linear_workloads(1, 8))):
        for label, g, b_l2, b_none, flop, nominal in workloads:
            n, _ = blocks_per_sm("sm_90", family_regs("linear_attention", "sm_90")[1], 128, g["smem"])
            t_mem, t_mem_none = b_l2 / H200["hbm_Bps"], b_none / H200["hbm_Bps"]
            t_flop = flop / H200["fp32_FLOPs"]
            if g["grid"] < H200["sms"]:   # idle SMs: the compute bound scales with the SMs in use
                t_flop *= H200["sms"] / g["grid"]
            lines.append(f"| causal linear attention fp32, {shape}, T=8192, m=dv=128, {label} (C={g['chunk']}, "
                         f"dv_tile={g['dv_tile']}, 128 threads) | {g['grid']} | {g['grid'] / (n * H200['sms']):.2f} | "
                         f"{_si(b_l2)}B-{_si(b_none)}B | {_si(flop)} ({_si(nominal)} counted by gpu_check) | "
                         f"{_us(t_mem)}-{_us(t_mem_none)} | {_us(t_flop)} | >= {_us(max(t_flop, t_mem))}; "
                         f"{_us(2 * t_flop)} at the 50 % shared-load cap |")
    return "\n".join(lines) + "\n"


def _us(t: float) -> str:
    return f"{t * 1e6:.3g} µs" if t < 1e-3 else f"{t * 1e3:.3g} ms"


def _si(x: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x:.3g} "


def nvcc_version(nvcc: str) -> str:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release ([\d.]+)", out)
    return f"nvcc {m.group(1)}, `-Xptxas -v`" if m else "nvcc `-Xptxas -v`"


def write(doc: Path, text: str) -> None:
    body = doc.read_text()
    if BEGIN not in body or END not in body:
        raise SystemExit(f"{doc} has no {BEGIN} ... {END} markers")
    head, rest = body.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(f"{head}{BEGIN}\n{text}{END}{tail}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--write", action="store_true", help="replace the tables in docs/cuda.md")
    ap.add_argument("--nvcc", default=shutil.which("nvcc"))
    args = ap.parse_args(argv)
    if not args.nvcc:
        print("nvcc not found (CUDA toolkit); nothing to report", file=sys.stderr)
        return 2
    text = tables(args.nvcc)
    print(text)
    if args.write:
        write(DOC, text)
        print(f"written to {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
