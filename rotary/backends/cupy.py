"""CuPy backend: raw CUDA kernels (``cuda_kernels/*.cu``) compiled lazily with NVRTC per device and dtype.

Nothing is compiled at import or install: the first call for a (device, kernel file, dtype) builds a
``cupy.RawModule`` with that dtype's template instantiations (``name_expressions``); CuPy's on-disk
kernel cache makes later processes fast. Kernels run on the input's device and current stream.

Rotation (``rope.cu``): for token (b, s) with table row ``r = rows[b or 0, s]`` and pair (a, b) of
the layout, ``y_a = x_a cos[r,i] - x_b sin[r,i]``, ``y_b = x_b cos[r,i] + x_a sin[r,i]`` (sin
negated for the inverse), in fp32 (fp64 for float64), each product and sum rounded on its own (never fused into
an FMA: NumPy's bits, and the KV cache's keys are the same bits); q and k in one launch; the pairs written in the
layout read, or in the other one (``out_layout``: the kernels with a fifth template argument, compiled on first use).
Linear attention (``linear_attention.cu``): RoFormer eq. 19 with the (S, z) state kept on chip in fp32/fp64; its
backward (``linear_backward.cu``, :func:`linear_attention_backward`): dq, dk, dv and the carried state's gradient by
a chunked kernel per (batch, k/v head, dv tile) and a finishing kernel per (batch, k/v head). KV cache
(``kv_cache.cu``): ``append_kv`` and ``paged_attention`` (the end of this file).

The planning functions (:func:`plan_rotate`, :func:`plan_linear_attention`, :func:`plan_linear_attention_backward`,
the geometry helpers)
are pure Python and do not import CuPy: the CPU test harness (``tests/cuda_shim``) launches the same
kernel sources with the same plans through the host C++ compiler.
"""

from __future__ import annotations

import math
import re
import sys
import threading
import warnings
from pathlib import Path
from typing import NamedTuple

import numpy as np

from . import OUTSIDE_TABLE
from .feature_maps import CODES
from .kv_entries import KV_FORMATS
from .numpy_linear_backward import check_backward_args as check_linear_backward   # (one copy)

NAME = "cupy"
PACKED_LINEAR_ATTENTION = True   # linear_attention takes cu_seqlens (a packed batch in one pass)
COMPILES_ON_FIRST_CALL = True    # NVRTC compiles each kernel on its first launch (CuPy caches it on disk)

KERNEL_DIR = Path(__file__).with_name("cuda_kernels")
COMMON_HEADER = "rotary_common.cuh"
#: kernel file of each kernel family
SOURCES = {"rope": "rope.cu", "linear_attention": "linear_attention.cu"}
SOURCES["kv_cache"] = "kv_cache.cu"   # KV-cache kernels (append_kv, paged_attention; the end of this file)
SOURCES["linear_backward"] = "linear_backward.cu"   # linear attention's backward (includes linear_attention.cu)
#: dtype name -> (C++ storage type, C++ work type)
KERNEL_TYPES = {
    "float32": ("float", "float"),
    "float64": ("double", "double"),
    "float16": ("rotary_half", "float"),
    "bfloat16": ("rotary_bfloat16", "float"),
}
ITEMSIZE = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2}
#: widest vector access in bytes
VECTOR_BYTES = 16
#: default dynamic shared memory budget per block (no opt-in attribute needed on any GPU)
SHARED_MEM_LIMIT = 48 * 1024
NVRTC_OPTIONS = ("-std=c++17",)
#: shared memory budget of the linear attention kernel; more than SHARED_MEM_LIMIT opts the kernel in to
#: larger dynamic shared memory (up to the device's cudaDevAttrMaxSharedMemoryPerBlockOptin).
#: benchmarks/gpu_check.py measures several budgets; the default is the one that needs no opt-in.
LINEAR_ATTENTION_SHARED_MEM_LIMIT = SHARED_MEM_LIMIT
#: threads per block of the linear attention kernel (also swept by benchmarks/gpu_check.py)
LINEAR_ATTENTION_THREADS = 128


# -- sources and instantiations (pure Python) ---------------------------------------------------
def included_sources(name: str) -> list[str]:
    """The files of KERNEL_DIR that kernel file ``name`` includes (``#include "x"`` lines), in order."""
    text = (KERNEL_DIR / name).read_text()
    return [m for m in _INCLUDE.findall(text) if (KERNEL_DIR / m).is_file()]


_INCLUDE = re.compile(r'^#include "([^"]+)"[ \t]*$', re.M)


def source_text(family: str) -> str:
    """The kernel file of ``family`` with the common header and the kernel files it includes inlined, each once
    (so NVRTC needs no -I; linear_backward.cu includes linear_attention.cu)."""
    text = (KERNEL_DIR / SOURCES[family]).read_text()
    include = f'#include "{COMMON_HEADER}"'
    if include not in text:
        raise RuntimeError(f"{SOURCES[family]} does not include {COMMON_HEADER}")
    seen: set = set()

    def inline(match):
        name = match.group(1)
        if not (KERNEL_DIR / name).is_file():
            return match.group(0)
        if name in seen:
            return f"// {name}: inlined above"
        seen.add(name)
        return _INCLUDE.sub(inline, (KERNEL_DIR / name).read_text())

    return _INCLUDE.sub(inline, text)


def vector_widths(dtype_name: str) -> tuple[int, ...]:
    """Vector widths (elements per access) instantiated for a dtype: 1, 2, ... up to 16 bytes."""
    widths, v = [], 1
    while v * ITEMSIZE[dtype_name] <= VECTOR_BYTES:
        widths.append(v)
        v *= 2
    return tuple(widths)


def rope_kernel_name(dtype_name: str, vector: int, interleaved: bool, out_interleaved: bool | None = None) -> str:
    """The rotation kernel reading pairs ``interleaved`` or not and writing them ``out_interleaved`` or not
    (None: as read; the template's default, so a same-layout name has four arguments)."""
    t, w = KERNEL_TYPES[dtype_name]
    flag = lambda b: "true" if b else "false"   # noqa: E731
    if out_interleaved is None or bool(out_interleaved) == bool(interleaved):
        return f"rope_rotate<{t}, {w}, {vector}, {flag(interleaved)}>"
    return f"rope_rotate<{t}, {w}, {vector}, {flag(interleaved)}, {flag(out_interleaved)}>"


def kernel_group(name: str) -> str:
    """The module a kernel name is compiled in: "mixed" for the rotations that write another pair layout than
    they read, "norm" for the KV appends with the key norm (each compiled only when a call asks for one), else ""
    (the family's usual module)."""
    if name.startswith("rope_rotate<") and name.count(",") == 4:
        return "mixed"
    return "norm" if name.startswith("kv_append<") and name.endswith(", true>") else ""


def linear_attention_kernel_name(dtype_name: str) -> str:
    t, w = KERNEL_TYPES[dtype_name]
    return f"linear_attention_chunked<{t}, {w}>"


def linear_backward_kernel_names(dtype_name: str) -> tuple[str, str]:
    """(chunked kernel, finishing kernel) of linear attention's backward for one dtype."""
    t, w = KERNEL_TYPES[dtype_name]
    return f"linear_backward_chunked<{t}, {w}>", f"linear_backward_finish<{t}, {w}>"


def name_expressions(family: str, dtype_name: str, group: str | None = None) -> list[str]:
    """Every template instantiation of ``family`` for one dtype (``group``: only those of one
    :func:`kernel_group`). Rotation: each vector width, reading half-split / interleaved pairs, writing them
    in the same layout, then (the "mixed" group) in the other one."""
    if family == "rope":
        names = [rope_kernel_name(dtype_name, v, inter) for v in vector_widths(dtype_name) for inter in (False, True)]
        names += [rope_kernel_name(dtype_name, v, inter, not inter) for v in vector_widths(dtype_name)
                  for inter in (False, True)]
    elif family == "kv_cache":
        names = kv_cache_name_expressions(dtype_name)
    elif family == "linear_backward":
        names = list(linear_backward_kernel_names(dtype_name))
    else:
        names = [linear_attention_kernel_name(dtype_name)]
    return names if group is None else [n for n in names if kernel_group(n) == group]


# -- launch plans (pure Python) -------------------------------------------------------------------
class Launch(NamedTuple):
    """One kernel launch. args: arrays (passed as device pointers) and NumPy scalars whose type is the
    C++ parameter type (int64 -> long long, int32 -> int, float32 -> float, float64 -> double)."""
    family: str
    kernel: str          # name expression
    grid: int
    block: int
    shared_mem: int      # dynamic shared memory, bytes
    args: tuple


def _elem_strides(a, itemsize: int) -> list:
    """Strides in elements as np.int64; 0 for axes of length 1 (their stride is never used)."""
    out = []
    for n, s in zip(a.shape, a.strides):
        if s % itemsize:
            raise ValueError(f"stride {s} is not a multiple of the item size {itemsize}")
        out.append(np.int64(0 if n == 1 else s // itemsize))
    return out


def _lowbit(n: int) -> int:
    """Largest power of two dividing n (n == 0 -> a huge power of two)."""
    return n & -n if n else 1 << 62


def vector_width(arrays, dtype_name: str, rotary_dim: int, address) -> int:
    """Largest instantiated V such that every (B, S, H, D) array allows V-element aligned accesses.

    Needs unit stride along D, strides and base addresses that are multiples of V elements, and
    ``(rotary_dim // 2) % V == 0`` (pair groups never straddle the a/b halves).
    """
    itemsize = ITEMSIZE[dtype_name]
    v = min(VECTOR_BYTES // itemsize, _lowbit(rotary_dim // 2))
    for a in arrays:
        shape, strides = a.shape, a.strides
        if shape[3] > 1 and strides[3] != itemsize:
            return 1
        bits = address(a)
        for n, st in zip(shape[:3], strides[:3]):
            if n > 1:
                bits |= st
        v = min(v, _lowbit(bits) // itemsize)
    return max(1, v)


def rotate_geometry(n_tokens: int, units_per_token: int, bytes_per_token: int, *, threads: int = 256,
                    units_per_thread: int = 4, max_tokens_per_block: int | None = None,
                    shared_mem_limit: int = SHARED_MEM_LIMIT) -> tuple[int, int, int, int]:
    """(grid, block, tokens_per_block, shared_mem) for the rotation kernel; grid is linear in tokens.

    A block takes ``tokens_per_block`` tokens, enough for about ``units_per_thread`` work units per
    thread, capped by shared memory (``bytes_per_token`` staged per token) and ``max_tokens_per_block``.
    """
    per_token = max(1, units_per_token)
    tpb = max(1, -(-threads * units_per_thread // per_token))
    tpb = min(tpb, max(1, shared_mem_limit // max(1, bytes_per_token)), max(1, n_tokens), (2**31 - 1) // per_token)
    if max_tokens_per_block is not None:
        tpb = min(tpb, max(1, max_tokens_per_block))
    block = min(threads, per_token * tpb)
    if threads >= 32:
        block = min(threads, 32 * -(-block // 32))
    grid = -(-n_tokens // tpb)
    return grid, max(1, block), tpb, tpb * bytes_per_token


def plan_rotate(items, cos, sin, rows, *, dtype_name: str, rotary_dim: int, layout: str, inverse: bool,
                address, threads: int = 256, max_tokens_per_block: int | None = None,
                shared_mem_limit: int = SHARED_MEM_LIMIT, out_layout: str | None = None) -> Launch | None:
    """The launch that rotates one or two ``(x, y)`` items (same B, S, D and dtype; y may be x).

    x, y: (B, S, H, D) arrays with ``.shape``/``.strides`` (bytes); ``address(a)`` gives a data pointer.
    cos, sin: (R, rotary_dim // 2) contiguous in the work dtype; rows: (Bp, S) contiguous int64.
    ``out_layout``: the pair layout y is written in (None: ``layout``; another one: y must not be x).
    Returns None when there is nothing to do (no tokens or no heads).
    """
    if not 1 <= len(items) <= 2:
        raise ValueError("plan_rotate takes one or two items")
    out_layout = out_layout or layout
    if out_layout != layout and any(y is x for x, y in items):
        raise ValueError("out_layout differs from layout: y cannot be x (the pairs are written to other coordinates)")
    arrays = [a for pair in items for a in pair]
    key = (dtype_name, rotary_dim, layout, bool(inverse), threads, max_tokens_per_block, shared_mem_limit,
           rows.shape, tuple((a.shape, a.strides, address(a) & 15) for a in arrays),
           tuple(y is x for x, y in items), out_layout)
    cached = _plan_cache.get(key)
    if cached is None:
        plan = _plan_rotate(items, cos, sin, rows, dtype_name=dtype_name, rotary_dim=rotary_dim, layout=layout,
                            inverse=inverse, address=address, threads=threads,
                            max_tokens_per_block=max_tokens_per_block, shared_mem_limit=shared_mem_limit,
                            out_layout=out_layout)
        if plan is None:
            return None
        slots = [i for i, a in enumerate(plan.args) if not isinstance(a, np.generic)]
        if len(_plan_cache) >= 1024:
            _plan_cache.clear()
        template = list(plan.args)
        for i in slots:
            template[i] = None  # the cache holds no arrays
        _plan_cache[key] = cached = (plan._replace(args=()), template, slots)
        return plan
    plan, template, slots = cached
    args = list(template)
    order = arrays + ([arrays[0], arrays[0]] if len(items) == 1 else []) + [cos, sin, rows]
    for i, a in zip(slots, order):
        args[i] = a
    return plan._replace(args=tuple(args))


#: plan_rotate's cache: everything but the arrays, keyed by shapes, strides, alignments and options
_plan_cache: dict = {}


def _plan_rotate(items, cos, sin, rows, *, dtype_name, rotary_dim, layout, inverse, address, threads,
                 max_tokens_per_block, shared_mem_limit, out_layout=None):
    i64, i32 = np.int64, np.int32
    itemsize = ITEMSIZE[dtype_name]
    x0 = items[0][0]
    n_batch, seq_len, _, head_dim = x0.shape
    n_tokens = n_batch * seq_len
    half = rotary_dim // 2
    v = vector_width([a for pair in items for a in pair], dtype_name, rotary_dim, address)
    tail_len = head_dim - rotary_dim
    tail_v = v if tail_len % v == 0 else 1
    copy_tail = [int(y is not x and tail_len > 0) for x, y in items]
    units = sum(x.shape[2] * (half // v + (tail_len // tail_v if ct else 0)) for (x, _), ct in zip(items, copy_tail))
    if n_tokens == 0 or units == 0:
        return None
    work_itemsize = 8 if KERNEL_TYPES[dtype_name][1] == "double" else 4
    grid, block, tpb, smem = rotate_geometry(n_tokens, units, 4 * 8 + 2 * half * work_itemsize, threads=threads,
                                             max_tokens_per_block=max_tokens_per_block,
                                             shared_mem_limit=shared_mem_limit)
    args = []
    for (x, y), ct in zip(items, copy_tail):
        args += [x, y, i64(x.shape[2]), *_elem_strides(x, itemsize), *_elem_strides(y, itemsize), i32(ct)]
    if len(items) == 1:  # no second tensor: zero heads
        args += [x0, x0, *[i64(0)] * 9, i32(0)]
    args += [cos, sin, rows, i32(rows.shape[0] > 1), i64(n_tokens), i64(seq_len), i32(head_dim), i32(rotary_dim),
             i32(tail_v), i32(bool(inverse)), i32(tpb)]
    name = rope_kernel_name(dtype_name, v, layout == "interleaved", (out_layout or layout) == "interleaved")
    return Launch("rope", name, grid, block, smem, tuple(args))


def linear_attention_shared_bytes(m: int, chunk: int, dv_tile: int, work_itemsize: int) -> int:
    """Dynamic shared memory of linear_attention_chunked (layout documented in the .cu file)."""
    mp, dtp = m | 1, dv_tile | 1
    return work_itemsize * (3 * chunk * mp + chunk * dtp + m * dtp + chunk * (chunk + 1) + chunk + m + chunk + 1)


def linear_attention_geometry(n_batch: int, n_heads: int, m: int, dv: int, work_itemsize: int, chunk: int, *,
                              threads: int = 256, shared_mem_limit: int = SHARED_MEM_LIMIT):
    """(grid, block, chunk_used, dv_tile, shared_mem): one block per (batch, head, dv tile).

    Takes the widest dv tile (<= 64) and the longest chunk (<= ``chunk``, >= 16 when possible)
    whose state and chunk buffers fit in ``shared_mem_limit``; smaller chunks give the same result
    (the chunked sums are exact rearrangements) with more, shorter steps.
    """
    tiles = sorted({min(dv, t) for t in (64, 32, 16, 8, 4, 2, 1)}, reverse=True)
    chunks = [c for c in (chunk, 64, 32, 16, 8, 4, 2, 1) if c <= chunk]
    chunks = sorted(set(chunks), reverse=True)
    for min_chunk in (min(16, chunk), 1):
        for dt in tiles:
            for c in chunks:
                if c < min_chunk:
                    break
                smem = linear_attention_shared_bytes(m, c, dt, work_itemsize)
                if smem <= shared_mem_limit:
                    grid = n_batch * n_heads * math.ceil(dv / dt)
                    return grid, threads, c, dt, smem
    raise ValueError(f"head dims m={m}, dv={dv} are too large for the CUDA linear attention kernel's "
                     f"shared memory ({shared_mem_limit} bytes); use backend='numpy' or 'numba'")


def plan_linear_attention(q, k, v, o, state_s, z_in, z_out, cos, sin, rows, *, dtype_name: str, rotary_dim: int,
                          layout: str, causal: bool, feature_map: str, eps: float, chunk: int, threads: int = 256,
                          shared_mem_limit: int = SHARED_MEM_LIMIT, powers=None, normalize: bool = True,
                          cu_seqlens=None) -> Launch | None:
    """The launch for linear attention: state_s (B, Hk, m, dv) is read and overwritten with the new S;
    z_in (B, Hk, m) is read and z_out (another buffer) receives the new z. q (B, S, H, m) with
    H = groups * Hk; k, v (B, S, Hk, .). ``powers``: None (no decay) or a device array (B * Hk, P) of
    gamma^j in the work dtype, P > the chunk used (``powers_table`` makes it). ``cu_seqlens``: a device
    int64 array of N + 1 offsets for a packed batch (q of batch 1, rows (1, T)): one block per (sequence,
    k/v head, dv tile), state_s and z (N, Hk, ...), powers (N * Hk, P)."""
    itemsize = ITEMSIZE[dtype_name]
    n_batch, seq_len, n_heads_q, m = q.shape
    packed = cu_seqlens is not None
    if packed:
        n_batch = int(cu_seqlens.shape[0]) - 1
    n_heads = k.shape[2]
    dv = v.shape[3]
    if n_batch * n_heads * dv == 0 or m == 0:
        return None
    work = KERNEL_TYPES[dtype_name][1]
    work_itemsize = 8 if work == "double" else 4
    grid, block, c, dt, smem = linear_attention_geometry(n_batch, n_heads, m, dv, work_itemsize, chunk,
                                                         threads=threads, shared_mem_limit=shared_mem_limit)
    args = []
    for a in (q, k, v, o):
        args += [a, *_elem_strides(a, itemsize)]
    fmap = CODES[feature_map]
    i32 = np.int32
    decayed = powers is not None
    if decayed and powers.shape[-1] <= c:
        raise ValueError(f"powers table has {powers.shape[-1]} columns, the kernel's chunk {c} needs {c + 1}")
    args += [state_s, z_in, z_out, cos, sin, rows, i32(rows.shape[0] > 1), np.int64(seq_len), i32(n_heads),
             i32(n_heads_q // n_heads), i32(m), i32(dv), i32(rotary_dim), i32(layout == "interleaved"),
             i32(bool(causal)), i32(fmap), (np.float64 if work == "double" else np.float32)(eps), i32(c), i32(dt),
             powers if decayed else z_in, i32(powers.shape[-1] if decayed else 0), i32(decayed),
             i32(bool(normalize)), cu_seqlens if packed else rows, i32(packed)]
    return Launch("linear_attention", linear_attention_kernel_name(dtype_name), grid, block, smem, tuple(args))


def powers_table(decay, chunk: int, work_dtype):
    """Host (B * Hk, chunk + 1) gamma^j in ``work_dtype`` of a float64 (B, Hk) decay; None when there is no
    decay or every gamma is 1 (the kernels then skip the factors)."""
    from .numpy_linear import decay_powers

    if decay is None or bool(np.all(np.asarray(decay) == 1)):
        return None
    table = decay_powers(decay, chunk)
    return np.ascontiguousarray(table.reshape(-1, chunk + 1), dtype=work_dtype)


# -- linear attention's backward (linear_backward.cu; pure Python planning) -------------------------------
#: threads per block of the backward's two kernels
LINEAR_BACKWARD_THREADS = 128
#: the finishing kernel's chunk at most (it keeps chunk x m values in shared memory)
LINEAR_BACKWARD_FINISH_CHUNK = 64
#: shared memory budget of the backward's chunked kernel (opt-in above 48 KiB, capped by the device's maximum): its
#: state and reverse state (2 m x dv_tile) and ten chunk buffers need more than the forward's, and each extra dv
#: tile repeats the chunk's q/k work and adds a T x H x m slice of scratch
LINEAR_BACKWARD_SHARED_MEM_LIMIT = 160 * 1024


def linear_backward_shared_bytes(m: int, chunk: int, dv_tile: int, work_itemsize: int) -> int:
    """Dynamic shared memory of linear_backward_chunked (layout documented in the .cu file)."""
    mp, dtp, pp = m | 1, dv_tile | 1, chunk + 1
    return work_itemsize * (5 * chunk * mp + 3 * chunk * dtp + 2 * m * dtp + 2 * chunk * pp + 3 * chunk + m + 1)


def linear_backward_finish_shared_bytes(m: int, chunk: int, work_itemsize: int) -> int:
    """Dynamic shared memory of linear_backward_finish: chunk x (m | 1) rows and m values."""
    return work_itemsize * (chunk * (m | 1) + m)


class LinearBackwardGeometry(NamedTuple):
    """The two launches of the backward: linear_backward_chunked (grid = B * Hk * n_tiles blocks, ``chunk``,
    ``dv_tile``, ``shared_mem``) and linear_backward_finish (``finish_grid`` = B * Hk, its own chunk and shared
    memory); ``block`` threads each."""
    grid: int
    block: int
    chunk: int
    dv_tile: int
    n_tiles: int
    shared_mem: int
    finish_grid: int
    finish_chunk: int
    finish_shared_mem: int


def linear_backward_geometry(n_batch: int, n_heads: int, m: int, dv: int, work_itemsize: int, chunk: int, *,
                             threads: int = LINEAR_BACKWARD_THREADS,
                             shared_mem_limit: int = SHARED_MEM_LIMIT) -> LinearBackwardGeometry:
    """The widest dv tile (<= 64) and the longest chunk (<= ``chunk``) whose buffers fit ``shared_mem_limit``, in
    rounds: chunk >= 16 with a tile >= 32, then chunk >= 8 with a tile >= 16, then anything (each tile repeats the
    q/k work and adds scratch, so a wide tile goes before a long chunk; a smaller chunk or tile gives the same sums
    in other groupings); the finishing kernel's chunk: the longest power of two <= 64 that fits. dv = 0: no chunked
    launch (n_tiles 0)."""
    tiles = sorted({min(max(dv, 1), t) for t in (64, 32, 16, 8, 4, 2, 1)}, reverse=True)
    chunks = sorted({c for c in (chunk, 64, 32, 16, 8, 4, 2, 1) if c <= chunk}, reverse=True)
    finish = [c for c in (64, 32, 16, 8, 4, 2, 1)
              if c <= LINEAR_BACKWARD_FINISH_CHUNK and linear_backward_finish_shared_bytes(m, c, work_itemsize)
              <= shared_mem_limit]
    for min_chunk, min_tile in ((16, 32), (8, 16), (1, 1)):
        for dt in tiles:
            if dt < min(min_tile, dv):
                break
            for c in chunks:
                if c < min(min_chunk, chunk):
                    break
                smem = linear_backward_shared_bytes(m, c, dt, work_itemsize)
                if smem <= shared_mem_limit and finish:
                    n_tiles = math.ceil(dv / dt)
                    return LinearBackwardGeometry(n_batch * n_heads * n_tiles, threads, c, dt, n_tiles, smem,
                                                  n_batch * n_heads, finish[0],
                                                  linear_backward_finish_shared_bytes(m, finish[0], work_itemsize))
    raise ValueError(f"head dims m={m}, dv={dv} are too large for the CUDA linear attention backward kernel's "
                     f"shared memory ({shared_mem_limit} bytes); use backend='numpy' or 'numba'")


def linear_backward_workspace(n_batch: int, seq_len: int, n_heads_q: int, n_heads: int, m: int, dv: int,
                              geometry: LinearBackwardGeometry) -> dict:
    """Sizes (work-dtype elements, at least 1) of the backward's global scratch buffers: the saved states before
    each chunk (s_saved, z_saved), the dv tiles' parts of dÂ, dB̂ and gN . N, the denominators and gD."""
    n_chunks = -(-seq_len // geometry.chunk)
    tiles = geometry.n_tiles
    sizes = dict(s_saved=n_batch * n_heads * n_chunks * m * dv, z_saved=n_batch * n_heads * tiles * n_chunks * m,
                 dA_part=tiles * n_batch * seq_len * n_heads_q * m, dB_part=tiles * n_batch * seq_len * n_heads * m,
                 gdot_part=tiles * n_batch * seq_len * n_heads_q, den=n_batch * seq_len * n_heads_q,
                 gD=n_batch * seq_len * n_heads_q)
    return {name: max(1, n) for name, n in sizes.items()}


def plan_linear_attention_backward(q, k, v, grad_o, dq, dk, dv, state_s, z_in, grad_s, grad_z, d_s, d_z, cos, sin,
                                   rows, alloc, *, dtype_name: str, rotary_dim: int, layout: str, causal: bool,
                                   feature_map: str, eps: float, chunk: int, threads: int = LINEAR_BACKWARD_THREADS,
                                   shared_mem_limit: int = SHARED_MEM_LIMIT, powers=None,
                                   normalize: bool = True) -> tuple:
    """The launches of the backward (linear_backward_chunked, then linear_backward_finish; only the second when
    dv = 0), or () when there is nothing to run (no token, head or feature). q, k, v, grad_o (B, T, ., .) read;
    dq, dk, dv their shapes, written; state_s, grad_s, d_s (B, Hk, m, dv) and z_in, grad_z, d_z (B, Hk, m)
    C-contiguous in the work dtype (S0, G_S, dS0; z0, G_z, dz0; zeros for None); ``alloc(n)``: a new 1-D
    work-dtype array of n elements (the scratch of :func:`linear_backward_workspace`); ``powers`` as for
    :func:`plan_linear_attention` (a table of at least ``chunk + 1`` columns)."""
    itemsize = ITEMSIZE[dtype_name]
    n_batch, seq_len, n_heads_q, m = q.shape
    n_heads, dvd = k.shape[2], v.shape[3]
    if n_batch * n_heads * seq_len * m == 0:
        return ()
    work = KERNEL_TYPES[dtype_name][1]
    work_itemsize = 8 if work == "double" else 4
    geo = linear_backward_geometry(n_batch, n_heads, m, dvd, work_itemsize, chunk, threads=threads,
                                   shared_mem_limit=shared_mem_limit)
    decayed = powers is not None
    if decayed and powers.shape[-1] <= geo.chunk:
        raise ValueError(f"powers table has {powers.shape[-1]} columns, the kernel's chunk {geo.chunk} needs "
                         f"{geo.chunk + 1}")
    ws = {name: alloc(n) for name, n in linear_backward_workspace(n_batch, seq_len, n_heads_q, n_heads, m, dvd,
                                                                   geo).items()}
    strides = lambda a: [a, *_elem_strides(a, itemsize)]   # noqa: E731
    i32, scalar = np.int32, (np.float64 if work == "double" else np.float32)
    pw = (powers, i32(powers.shape[-1])) if decayed else (z_in, i32(0))
    tables = [cos, sin, rows, i32(rows.shape[0] > 1), np.int64(seq_len), i32(n_batch), i32(n_heads),
              i32(n_heads_q // n_heads), i32(m)]
    names = linear_backward_kernel_names(dtype_name)
    launches = []
    if geo.n_tiles:
        args = [*strides(q), *strides(k), *strides(v), *strides(grad_o), *strides(dv), state_s, z_in, grad_s, d_s,
                ws["s_saved"], ws["z_saved"], ws["dA_part"], ws["dB_part"], ws["gdot_part"], ws["den"], *tables,
                i32(dvd), i32(rotary_dim), i32(layout == "interleaved"), i32(bool(causal)), i32(CODES[feature_map]),
                scalar(eps), i32(geo.chunk), i32(geo.dv_tile), *pw, i32(decayed), i32(bool(normalize))]
        launches.append(Launch("linear_backward", names[0], geo.grid, geo.block, geo.shared_mem, tuple(args)))
    args = [*strides(q), *strides(k), *strides(dq), *strides(dk), z_in, grad_z, d_z, ws["dA_part"], ws["dB_part"],
            ws["gdot_part"], ws["den"], ws["gD"], *tables, i32(rotary_dim), i32(layout == "interleaved"),
            i32(bool(causal)), i32(CODES[feature_map]), scalar(eps), i32(geo.finish_chunk), i32(geo.n_tiles), *pw,
            i32(decayed), i32(bool(normalize) and geo.n_tiles > 0)]
    launches.append(Launch("linear_backward", names[1], geo.finish_grid, geo.block, geo.finish_shared_mem,
                           tuple(args)))
    return tuple(launches)


# -- CuPy side ----------------------------------------------------------------------------------------
_module_lock = threading.Lock()
_modules: dict = {}   # (device, family, dtype, kernel_group) -> cupy.RawModule
_kernels: dict = {}   # (device, name expression) -> cupy.RawKernel


def array_converters():
    """(to device, to host): the array type this backend takes, for callers holding NumPy data."""
    import cupy

    return cupy.asarray, (lambda a: cupy.asnumpy(a) if isinstance(a, cupy.ndarray) else np.asarray(a))


def availability():
    """(ok, reason): CuPy importable and at least one CUDA device visible."""
    try:
        import cupy
    except ImportError as exc:
        return False, f"CuPy is not installed ({exc})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no driver, no device, broken install
        return False, f"no usable CUDA device ({type(exc).__name__}: {exc})"
    if count < 1:
        return False, "no CUDA device found"
    return True, "ok"


def _is_torch_cuda(x) -> bool:
    return type(x).__module__.startswith("torch") and getattr(x, "is_cuda", False)


def accepts(x) -> bool:
    """CuPy arrays, and torch CUDA tensors (exchanged zero-copy through DLPack)."""
    cupy = sys.modules.get("cupy")  # a CuPy array implies CuPy is imported; never import it here
    if cupy is not None and isinstance(x, cupy.ndarray):
        return True
    return _is_torch_cuda(x)


def _device_id(x) -> int:
    if _is_torch_cuda(x):
        return x.device.index if x.device.index is not None else 0
    return x.device.id


def table_converter(x):
    """(device key, convert): cos/sin tables and rows are cached per device as CuPy arrays."""
    import cupy

    dev = _device_id(x)

    def convert(a):
        with cupy.cuda.Device(dev):
            return cupy.ascontiguousarray(cupy.asarray(a))

    return ("cupy", dev), convert


def _kernel(family: str, dtype_name: str, name: str):
    """The compiled kernel ``name`` on the current device (its dtype's module built on first use)."""
    import cupy

    device = cupy.cuda.runtime.getDevice()
    kernel = _kernels.get((device, name))
    if kernel is not None:
        return kernel
    with _module_lock:
        group = kernel_group(name)   # the kernels of out_pairs calls: a module of their own, built when asked for
        key = (device, family, dtype_name, group)
        module = _modules.get(key)
        if module is None:
            module = cupy.RawModule(code=source_text(family), options=NVRTC_OPTIONS,
                                    name_expressions=name_expressions(family, dtype_name, group))
            _modules[key] = module
        kernel = _kernels[(device, name)] = module.get_function(name)
    return kernel


def launch_kernel(plan: Launch, dtype_name: str):
    """The compiled kernel of ``plan`` on the current device, allowed the plan's dynamic shared memory;
    called as ``kernel((plan.grid,), (plan.block,), args, shared_mem=plan.shared_mem)``."""
    kernel = _kernel(plan.family, dtype_name, plan.kernel)
    if plan.shared_mem > SHARED_MEM_LIMIT and kernel.max_dynamic_shared_size_bytes < plan.shared_mem:
        kernel.max_dynamic_shared_size_bytes = plan.shared_mem
    return kernel


def _launch(plan: Launch, dtype_name: str) -> None:
    launch_kernel(plan, dtype_name)((plan.grid,), (plan.block,), plan.args, shared_mem=plan.shared_mem)


def max_shared_mem() -> int:
    """The current device's largest dynamic shared memory per block with opt-in (bytes)."""
    import cupy

    dev = cupy.cuda.runtime.getDevice()
    try:
        return int(cupy.cuda.runtime.deviceGetAttribute(97, dev))  # cudaDevAttrMaxSharedMemoryPerBlockOptin
    except Exception:
        return SHARED_MEM_LIMIT


def _address(a) -> int:
    return a.data.ptr


def _external_stream(cupy, torch_stream, device_id: int):
    """A CuPy view of torch's current stream (the CUDA stream protocol, else ExternalStream)."""
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None:
        try:
            return from_external(torch_stream)
        except TypeError:
            pass
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return cupy.cuda.ExternalStream(torch_stream.cuda_stream, device_id)


class _Exchange:
    """Moves torch CUDA tensors to CuPy views (zero copy) and results back; CuPy arrays pass through.

    bfloat16 tensors travel as int16 views (CuPy has no bfloat16 dtype) and are labelled "bfloat16".
    """

    def __init__(self, x):
        import cupy

        self.torch = _is_torch_cuda(x)
        self.device = cupy.cuda.Device(_device_id(x))
        self.stream = None
        if self.torch:
            import torch

            self.stream = _external_stream(cupy, torch.cuda.current_stream(x.device), _device_id(x))

    def to_cupy(self, a):
        import cupy

        if not self.torch or a is None:
            return a
        import torch

        if a.dtype == torch.bfloat16:
            return cupy.from_dlpack(a.view(torch.int16))
        return cupy.from_dlpack(a)

    def dtype_name(self, a) -> str:
        name = str(a.dtype).replace("torch.", "")
        if name not in KERNEL_TYPES:
            raise TypeError(f"the cupy backend takes float16/bfloat16/float32/float64 arrays, got {a.dtype}")
        return name

    def empty_like(self, a):
        if self.torch:
            import torch

            return torch.empty(tuple(a.shape), dtype=a.dtype, device=a.device)
        import cupy

        return cupy.empty(a.shape, dtype=a.dtype)

    def __enter__(self):
        self.device.__enter__()
        if self.stream is not None:
            self.stream.__enter__()
        return self

    def __exit__(self, *exc):
        if self.stream is not None:
            self.stream.__exit__(*exc)
        self.device.__exit__(*exc)


def _work_tables(cos, sin, work: str):
    import cupy

    dtype = cupy.float64 if work == "double" else cupy.float32
    return (cupy.ascontiguousarray(cos, dtype=dtype), cupy.ascontiguousarray(sin, dtype=dtype))


class PreparedRotation:
    """The ``prepare_rotation`` capability (see :mod:`rotary.backends`): the launch with every array slot
    open, the tables moved to the device once per table, the compiled kernel resolved once (per device:
    a call on another device, or with other alignments, returns None and takes the general path). Host
    rows are range-checked here (OUTSIDE_TABLE before anything is launched); device int64 rows are table
    rows as they are (no host round trip, not range-checked: the table must start at position 0).

    ``hooks`` (tests, benchmarks): ``address``, ``empty``, ``to_device`` and either ``kernel`` (called as a
    CuPy RawKernel: ``kernel(grid, block, args, shared_mem=...)``) or ``launch(plan, dtype_name)``."""

    device_rows = True

    def __init__(self, views, out_views, launch, *, offset, address, to_device, kernel, current_device):
        self.offset, self.address, self.to_device, self.kernel = offset, address, to_device, kernel
        self.current_device, self.device_id = current_device, current_device()
        self.grid, self.block, self.shared_mem = (launch.grid,), (launch.block,), launch.shared_mem
        self.align = [address(a) & 15 for pair in zip(views, out_views) for a in pair]   # a vector width per array
        self.slots = [i for i, a in enumerate(launch.args) if not isinstance(a, np.generic)]
        self.per_batch = (np.int32(0), np.int32(1))
        self.template = list(launch.args)
        self.empty = None

    def run(self, xs, outs, rows, start, table):
        if self.current_device() != self.device_id:
            return None
        if type(rows) is np.ndarray:
            if rows.size:
                if rows.size <= 64:   # decode-sized: cheaper in Python than NumPy reductions
                    values = rows.ravel().tolist()
                    lo, hi = min(values) + start, max(values) + start
                else:
                    lo, hi = int(rows.min()) + start, int(rows.max()) + start
                if lo < table[0] or hi >= table[1]:
                    return OUTSIDE_TABLE
            shift = start - table[0]   # a window far from 0: its row 0 holds position table[0]
            rows = self.to_device(rows + shift if shift else rows)
        elif table[0] != 0:   # device rows index the table as they are
            return OUTSIDE_TABLE
        address, offset = self.address, self.offset
        arrays, results = [], []
        for x, o in zip(xs, outs):
            y = o if o is not None else self.empty(x.shape, x.dtype)
            results.append(y)
            if offset:   # the kernel's pointers start at the offset (strides come from the plan)
                if y is not x:
                    y[..., :offset] = x[..., :offset]
                x, y = x[..., offset:], (x[..., offset:] if y is x else y[..., offset:])
            arrays += (x, y)
        for a, al in zip(arrays, self.align):
            if address(a) & 15 != al:   # another alignment: another vector width
                return None
        cos, sin = table[4](self.to_device)
        if len(arrays) == 2:
            arrays += arrays
        args = self.template
        for i, a in zip(self.slots, (*arrays, cos, sin, rows)):
            args[i] = a
        args[self.slots[-1] + 1] = self.per_batch[rows.shape[0] > 1]   # rows (Bp, S): Bp > 1 or not
        launch_args = tuple(args)
        for i in self.slots:
            args[i] = None
        self.kernel(self.grid, self.block, launch_args, shared_mem=self.shared_mem)
        return results


def prepare_rotation(views, out_views, *, seq_len, rotary_dim, layout, inverse, offset, dtype, table, hooks=None,
                     out_layout=None):
    """A :class:`PreparedRotation` for canonical ``views`` and their outputs' views (see ``rotary.backends``)."""
    if hooks:
        address, empty, to_device = hooks["address"], hooks["empty"], hooks["to_device"]
        current_device = lambda: 0   # noqa: E731
    else:
        import cupy

        address, empty, to_device = _address, cupy.empty, cupy.asarray
        current_device = cupy.cuda.runtime.getDevice
    dtype_name = str(views[0].dtype)
    cos, sin = table[4](to_device)
    rows = to_device(np.arange(seq_len, dtype=np.int64).reshape(1, seq_len))
    launch = plan_rotate(list(zip(views, out_views)), cos, sin, rows, dtype_name=dtype_name, rotary_dim=rotary_dim,
                         layout=layout, inverse=inverse, address=address, out_layout=out_layout)
    if launch is None:
        return None
    if not hooks:
        kernel = launch_kernel(launch, dtype_name)
    elif "kernel" in hooks:
        kernel = hooks["kernel"]
    else:
        run = hooks["launch"]
        kernel = lambda grid, block, args, shared_mem=0: run(launch._replace(args=args), dtype_name)   # noqa: E731
    prepared = PreparedRotation(views, out_views, launch, offset=offset, address=address, to_device=to_device,
                                kernel=kernel, current_device=current_device)
    prepared.empty = empty
    return prepared


def empty(shape, dtype):
    """A new device array on the current device (the allocator of this backend's outputs)."""
    import cupy

    return cupy.empty(shape, dtype)


def rotate(items, cos, sin, rows, *, rotary_dim, layout, inverse, out_layout=None):
    """Rotate every ``(x, out)`` of ``items`` (see ``rotary.backends``); q and k share one launch."""
    import cupy

    exchange = _Exchange(items[0][0])
    results = []
    with exchange:
        rows_dev = cupy.ascontiguousarray(cupy.asarray(rows), dtype=cupy.int64)
        prepared = []
        for x, out in items:
            name = exchange.dtype_name(x)
            y = exchange.empty_like(x) if out is None else out
            prepared.append((name, exchange.to_cupy(x), exchange.to_cupy(y) if y is not x else None, y))
        # the CuPy view of an in-place output is the input's view itself (the kernel sees y is x)
        pairs = [(name, xc, xc if yc is None else yc) for name, xc, yc, _ in prepared]
        groups = []
        for name, xc, yc in pairs:
            if groups and len(groups[-1][1]) == 1 and groups[-1][0] == name:
                groups[-1][1].append((xc, yc))
            else:
                groups.append((name, [(xc, yc)]))
        for name, group in groups:
            c, s = _work_tables(cos, sin, KERNEL_TYPES[name][1])
            plan = plan_rotate(group, c, s, rows_dev, dtype_name=name, rotary_dim=rotary_dim, layout=layout,
                               inverse=inverse, address=_address, out_layout=out_layout)
            if plan is not None:
                _launch(plan, name)
        for (_, xc, yc, y) in prepared:
            results.append(y if exchange.torch else (xc if yc is None else yc))
    return results


def linear_attention(q, k, v, cos, sin, rows, *, rotary_dim, layout, causal, feature_map, eps, chunk, state,
                     decay=None, normalize=True, cu_seqlens=None):
    """Linear attention with RoPE in the numerator; returns ``(o, (S, z))`` (see rotary.attn.linear).
    ``cu_seqlens`` (N + 1 offsets): a packed batch in one launch, states (N, Hk, ...)."""
    import cupy

    exchange = _Exchange(q)
    with exchange:
        name = exchange.dtype_name(q)
        work = KERNEL_TYPES[name][1]
        wdtype = cupy.float64 if work == "double" else cupy.float32
        n_batch, seq_len, n_heads_q, m = q.shape
        n_heads, dv = k.shape[2], v.shape[3]
        shape_o = (n_batch, seq_len, n_heads_q, dv)
        cu_dev = None
        if cu_seqlens is not None:
            cu_dev = cupy.asarray(np.asarray(cu_seqlens, dtype=np.int64))
            n_batch = int(cu_dev.shape[0]) - 1   # the states' batch: one per sequence
        if exchange.torch:
            import torch

            o = torch.empty(shape_o, dtype=q.dtype, device=q.device)
        else:
            o = cupy.empty(shape_o, dtype=q.dtype)
        if state is None:
            s_state = cupy.zeros((n_batch, n_heads, m, dv), dtype=wdtype)
            z_in = cupy.zeros((n_batch, n_heads, m), dtype=wdtype)
        else:
            s_state = cupy.array(exchange.to_cupy(state[0]), dtype=wdtype, order="C", copy=True)
            z_in = (cupy.zeros((n_batch, n_heads, m), dtype=wdtype) if state[1] is None
                    else cupy.ascontiguousarray(exchange.to_cupy(state[1]), dtype=wdtype))
        z_state = cupy.empty((n_batch, n_heads, m), dtype=wdtype)
        c, s = _work_tables(cos, sin, work)
        rows_dev = cupy.ascontiguousarray(cupy.asarray(rows), dtype=cupy.int64)
        table = powers_table(decay, max(1, int(chunk)), np.float64 if work == "double" else np.float32)
        plan = plan_linear_attention(exchange.to_cupy(q), exchange.to_cupy(k), exchange.to_cupy(v),
                                     exchange.to_cupy(o), s_state, z_in, z_state, c, s, rows_dev, dtype_name=name,
                                     rotary_dim=rotary_dim, layout=layout, causal=causal,
                                     feature_map=feature_map, eps=eps, chunk=chunk, threads=LINEAR_ATTENTION_THREADS,
                                     shared_mem_limit=min(LINEAR_ATTENTION_SHARED_MEM_LIMIT, max_shared_mem()),
                                     powers=None if table is None else cupy.asarray(table), normalize=normalize,
                                     cu_seqlens=cu_dev)
        if plan is not None:
            _launch(plan, name)
        else:  # no (batch, head) to run
            z_state = z_in.copy()
        if exchange.torch:
            import torch

            return o, (torch.from_dlpack(s_state), torch.from_dlpack(z_state))
    return o, (s_state, z_state)


def linear_attention_backward(q, k, v, cos, sin, rows, grad_o, *, rotary_dim, layout, causal, feature_map, eps, chunk,
                              state, decay=None, normalize=True, grad_state=None):
    """(dq, dk, dv, dstate) of the ``linear_attention`` primitive (contract in ``rotary.backends``; formulas in
    :mod:`rotary.backends.numpy_linear_backward`) by linear_backward.cu's two kernels; CuPy arrays or torch CUDA
    tensors in, the same out (dstate in the work dtype, None without ``state``). Inputs are never written."""
    import cupy

    decayed = check_linear_backward(q, k, v, grad_o, feature_map=feature_map, causal=causal, decay=decay)
    exchange = _Exchange(q)
    with exchange:
        name = exchange.dtype_name(q)
        for a, what in ((k, "k"), (v, "v")):
            if exchange.dtype_name(a) != name:
                raise TypeError(f"{what} must have q's dtype {name} on the cupy backend, got {a.dtype}")
        if exchange.dtype_name(grad_o) != name:
            grad_o = grad_o.to(q.dtype) if exchange.torch else grad_o.astype(q.dtype)
        work = KERNEL_TYPES[name][1]
        wdtype = cupy.float64 if work == "double" else cupy.float32
        B, T, H, m = q.shape
        Hk, dvd = k.shape[2], v.shape[3]

        def new(shape, like, zero=False):
            if exchange.torch:
                import torch

                return (torch.zeros if zero else torch.empty)(shape, dtype=like.dtype, device=like.device)
            return (cupy.zeros if zero else cupy.empty)(shape, dtype=like.dtype)

        def work_array(x, shape):
            if x is None:
                return cupy.zeros(shape, dtype=wdtype)
            return cupy.ascontiguousarray(exchange.to_cupy(x), dtype=wdtype).reshape(shape)

        S0, z0 = (None, None) if state is None else state
        gS, gz = (None, None) if grad_state is None else grad_state
        s_shape, z_shape = (B, Hk, m, dvd), (B, Hk, m)
        args_state = [work_array(S0, s_shape), work_array(z0, z_shape), work_array(gS, s_shape),
                      work_array(gz, z_shape)]
        d_s, d_z = cupy.empty(s_shape, dtype=wdtype), cupy.empty(z_shape, dtype=wdtype)
        c, s = _work_tables(cos, sin, work)
        rows_dev = cupy.ascontiguousarray(cupy.asarray(rows), dtype=cupy.int64)
        table = powers_table(decay, max(1, int(chunk)), np.float64 if work == "double" else np.float32)
        empty_plan = B * Hk * T * m == 0
        dq, dk, dv = (new(tuple(x.shape), x, zero=empty_plan) for x in (q, k, v))
        plans = plan_linear_attention_backward(
            exchange.to_cupy(q), exchange.to_cupy(k), exchange.to_cupy(v), exchange.to_cupy(grad_o),
            exchange.to_cupy(dq), exchange.to_cupy(dk), exchange.to_cupy(dv), args_state[0], args_state[1],
            args_state[2], args_state[3], d_s, d_z, c, s, rows_dev, lambda n: cupy.empty(n, dtype=wdtype),
            dtype_name=name, rotary_dim=rotary_dim, layout=layout, causal=causal, feature_map=feature_map, eps=eps,
            chunk=chunk, threads=LINEAR_BACKWARD_THREADS, shared_mem_limit=min(LINEAR_BACKWARD_SHARED_MEM_LIMIT,
                                                                               max_shared_mem()),
            powers=None if table is None else cupy.asarray(table), normalize=normalize)
        for plan in plans:
            _launch(plan, name)
        if not plans:   # nothing ran: the state's gradient passes through
            d_s, d_z = args_state[2], args_state[3]
        if state is None:
            dstate = None
        elif exchange.torch:
            import torch

            dstate = (torch.from_dlpack(d_s), torch.from_dlpack(d_z))
        else:
            dstate = (d_s, d_z)
    return dq, dk, dv, dstate


# -- KV cache (kv_cache.cu): the append_kv and paged_attention primitives ------------------------------------
# kv_append rotates k, quantizes k and v per (token, head) or casts them, and writes entries and scales into
# their slots in one launch (slot < 0: a padding token, skipped), bit for bit rotary.backends.kv_entries.append_kv
# (the formulas are in the .cu file). paged_attention attends packed queries (prefill chunks and decode steps of
# any sequences in one launch) over the entries where they lie (the caller's block table), dequantizing in
# registers: one block per (q row, kv head) reads each key and value once for the q heads of its GQA group, and a
# launch with too few blocks for the GPU splits each row's keys (split-K; paged_attention_combine merges the splits
# by log-sum-exp). docs/cuda.md has the structure and the split rule.
# The KV formats are kv_entries.KV_FORMATS (passed explicitly; never inferred from a storage dtype). Planning is
# pure Python like the rotation's (the host shim launches the same plans).

#: the KV formats each capability takes (kv_entries.KV_FORMATS; "float8_e4m3" for fp32-work dtypes only)
VARIANTS = {"append_kv": tuple(KV_FORMATS), "paged_attention": tuple(KV_FORMATS)}
#: threads per block of kv_append
KV_APPEND_THREADS = 256
#: threads per block of paged_attention (raised where a head's P.V chunks or the block's q heads need more)
KV_ATTENTION_THREADS = 128
#: q heads one paged_attention block takes at most (kv_cache.cu's KV_HEADS; a larger GQA group: several blocks)
KV_ATTENTION_HEADS = 8
#: threads of a paged_attention block at most (kv_cache.cu's KV_MAX_THREADS: its __launch_bounds__)
KV_ATTENTION_MAX_THREADS = 256
#: split-K (flash-decoding): a launch of fewer blocks than this (2 x the 132 SMs of an H100 / H200 SXM) cuts each
#: row's keys into splits until it has this many ...
KV_SPLIT_BLOCKS = 2 * 132
#: ... but never into splits of fewer keys than this (on the longest key range the block table allows)
KV_SPLIT_MIN_KEYS = 256
#: threads per block of paged_attention_combine
KV_COMBINE_THREADS = 128


def _kv_format(kv_dtype, where: str):
    if kv_dtype not in KV_FORMATS:
        raise ValueError(f"{where}: kv_dtype must be one of {tuple(KV_FORMATS)}, got {kv_dtype!r}")
    return KV_FORMATS[kv_dtype]


def kv_append_kernel_name(dtype_name: str, kv_dtype, norm: bool = False) -> str:
    """The append kernel of a dtype and KV format; ``norm``: the one with the key norm (kv_append's NORM, a kernel
    of its own so that the one without keeps its registers; its own module, :func:`kernel_group` "norm")."""
    t, w = KERNEL_TYPES[dtype_name]
    return f"kv_append<{t}, {w}, {KV_FORMATS[kv_dtype].code}{', true' if norm else ''}>"


def paged_attention_kernel_name(dtype_name: str, kv_dtype) -> str:
    t, w = KERNEL_TYPES[dtype_name]
    return f"paged_attention<{t}, {w}, {KV_FORMATS[kv_dtype].code}>"


def paged_attention_combine_kernel_name(dtype_name: str) -> str:
    t, w = KERNEL_TYPES[dtype_name]
    return f"paged_attention_combine<{t}, {w}>"


def kv_cache_name_expressions(dtype_name: str) -> list[str]:
    """The kv_cache family's instantiations for one dtype: append and attention for each KV format (those quantized
    from float32 work values only for fp32-work dtypes), then the split-K combine, then (the "norm" group) the
    appends with the key norm. paged_attention takes its q norm as an argument (no kernel of its own)."""
    fp32_work = KERNEL_TYPES[dtype_name][1] == "float"
    kinds = [name for name, f in KV_FORMATS.items() if fp32_work or not f.fp32_work_only]
    return [kv_append_kernel_name(dtype_name, kind) for kind in kinds] + \
        [paged_attention_kernel_name(dtype_name, kind) for kind in kinds] + \
        [paged_attention_combine_kernel_name(dtype_name)] + \
        [kv_append_kernel_name(dtype_name, kind, norm=True) for kind in kinds]


def kv_append_geometry(n_tokens: int, heads: int, head_dim: int, *, work_itemsize: int, quantized: bool,
                       threads: int = KV_APPEND_THREADS, group: int | None = None,
                       max_tokens_per_block: int | None = None, rounds: int = 4,
                       norm: bool = False) -> tuple[int, int, int, int, int]:
    """(grid, block, group, tokens_per_block, shared_mem) of kv_append.

    A (token, k|v, head) row of head_dim values goes to ``group`` threads (the power of two >= head_dim, at most
    32 and at most ``threads``, unless given); a block runs ``threads // group`` rows at a time and takes enough
    tokens (2 * heads rows each) for about ``rounds`` such rounds. Quantized kinds reduce the amax of each row,
    and the key norm (``norm``) each k row's sum of squares, in ``block`` work-dtype elements of dynamic shared
    memory.
    """
    if group is None:
        group = 1
        while group < min(32, head_dim):
            group *= 2
        while group > max(1, threads):
            group //= 2
    if not 1 <= group <= min(max(1, threads), 1024):
        raise ValueError(f"group must be in 1..{min(threads, 1024)}, got {group}")
    per_round = max(1, threads // group)
    rows_per_token = 2 * heads
    tpb = max(1, -(-rounds * per_round // rows_per_token))
    tpb = min(tpb, max(1, n_tokens), max(1, (2**31 - 1) // rows_per_token))
    if max_tokens_per_block is not None:
        tpb = min(tpb, max(1, max_tokens_per_block))
    block = group * min(per_round, tpb * rows_per_token)
    grid = -(-n_tokens // tpb)
    return grid, block, group, tpb, block * work_itemsize if quantized or norm else 0


def _kv_check(ok: bool, what: str, where: str = "append_kv") -> None:
    if not ok:
        raise ValueError(f"{where}: {what}")


def _check_stores(stores, kv_dtype, dtype_name: str, heads: int, head_dim: int, where: str) -> None:
    """The stores of format ``kv_dtype`` for k/v (q) of ``dtype_name``: entries (P, heads, head_dim) C-contiguous of
    the format's entry dtype (the float dtype itself for None), scales (P, heads) C-contiguous in the work dtype for
    quantized formats."""
    fmt = _kv_format(kv_dtype, where)
    work_name = "float64" if KERNEL_TYPES[dtype_name][1] == "double" else "float32"
    if fmt.fp32_work_only and work_name != "float32":
        raise ValueError(f"{where}: {kv_dtype} entries are quantized from float32 work values (not float64)")
    k_store, v_store, k_scale, v_scale = stores
    for name, a in (("k entries", k_store), ("v entries", v_store)):
        _kv_check(len(a.shape) == 3 and tuple(a.shape[1:]) == (heads, head_dim) and a.flags.c_contiguous,
                  f"{name} must be C-contiguous (slots, {heads}, {head_dim}), got {tuple(a.shape)}", where)
        entry = np.dtype(a.dtype)
        if fmt.entry is None:
            same = entry.name == dtype_name or (dtype_name == "bfloat16" and entry.itemsize == 2)
            _kv_check(same, f"{name} are {entry.name}, the data {dtype_name}", where)
        else:
            _kv_check(entry.name == fmt.entry, f"{kv_dtype} {name} must be {fmt.entry}, got {entry.name}", where)
    _kv_check(tuple(v_store.shape) == tuple(k_store.shape), "k and v entries must have the same shape", where)
    if fmt.limit is not None:
        for name, a in (("k scales", k_scale), ("v scales", v_scale)):
            _kv_check(a is not None and tuple(a.shape) == tuple(k_store.shape[:2]) and a.flags.c_contiguous
                      and np.dtype(a.dtype).name == work_name,
                      f"{name} must be C-contiguous {work_name} {tuple(k_store.shape[:2])}", where)


def _norm_args(norm, head_dim: int, work: str, unread, where: str) -> tuple:
    """The kernels' (norm_weight, norm_eps, has_norm) arguments of ``norm``: None (``unread`` in the pointer's
    place: the kernel never reads it), or (weight, eps) with weight a C-contiguous (head_dim,) array of the work
    dtype and eps a float >= 0 (passed in the work dtype)."""
    wtype = np.float64 if work == "double" else np.float32
    if norm is None:
        return unread, wtype(0), np.int32(0)
    work_name = np.dtype(wtype).name
    _kv_check(isinstance(norm, tuple) and len(norm) == 2, f"norm must be None or (weight, eps), got {norm!r}", where)
    weight, eps = norm
    shape = tuple(getattr(weight, "shape", ()))
    dtype = np.dtype(weight.dtype).name if hasattr(weight, "dtype") else type(weight).__name__
    _kv_check(shape == (head_dim,) and getattr(getattr(weight, "flags", None), "c_contiguous", False)
              and dtype == work_name, f"norm weight must be a C-contiguous {work_name} ({head_dim},), got {dtype} "
              f"{shape}", where)
    _kv_check(isinstance(eps, (float, np.floating)) and eps >= 0,
              f"norm eps must be a float >= 0, got {eps!r}", where)
    return weight, wtype(eps), np.int32(1)


def plan_append_kv(k, v, cos, sin, rows, slots, stores, *, dtype_name: str, rotary_dim: int, layout: str,
                   offset: int, kv_dtype, norm=None, threads: int = KV_APPEND_THREADS, group: int | None = None,
                   max_tokens_per_block: int | None = None) -> Launch | None:
    """The kv_append launch: k, v (T, Hk, D) with any strides (``.shape``/``.strides`` in bytes), cos/sin
    (R, rotary_dim // 2) C-contiguous in the work dtype, rows and slots (T,) contiguous int64 (``slots[t] < 0``: a
    padding token, skipped), ``stores`` = (k entries, v entries, k scales, v scales) of format ``kv_dtype`` (entries
    (P, Hk, D) and scales (P, Hk) C-contiguous; scales None unless quantized). ``norm``: None, or (weight, eps) for
    the per-head RMSNorm of each key head before its rotation (weight (D,) C-contiguous in the work dtype, eps a
    float >= 0; kv_cache.cu has the formula; v is never normed). Slots are not checked here (the others distinct,
    < P: the caller's); rows index the tables as they are. None when there is no token."""
    _kv_format(kv_dtype, "append_kv")
    work = KERNEL_TYPES[dtype_name][1]
    work_name = "float64" if work == "double" else "float32"
    _kv_check(len(k.shape) == 3 and tuple(v.shape) == tuple(k.shape), f"k {tuple(k.shape)} and v {tuple(v.shape)} "
              "must be the same (tokens, heads, head_dim)")
    n_tokens, heads, head_dim = (int(n) for n in k.shape)
    half = rotary_dim // 2
    _kv_check(rotary_dim % 2 == 0 and 0 <= offset and offset + rotary_dim <= head_dim,
              f"rotary_dim {rotary_dim} (even) from offset {offset} does not fit head_dim {head_dim}")
    _kv_check(layout in ("half", "interleaved"), f"layout must be 'half' or 'interleaved', got {layout!r}")
    _check_stores(stores, kv_dtype, dtype_name, heads, head_dim, "append_kv")
    k_store, v_store, k_scale, v_scale = stores
    for name, a in (("cos", cos), ("sin", sin)):
        _kv_check(len(a.shape) == 2 and int(a.shape[1]) == half and a.flags.c_contiguous
                  and np.dtype(a.dtype).name == work_name, f"{name} must be C-contiguous {work_name} (rows, {half})")
    for name, a in (("rows", rows), ("slots", slots)):
        _kv_check(tuple(a.shape) == (n_tokens,) and a.flags.c_contiguous and np.dtype(a.dtype).name == "int64",
                  f"{name} must be a contiguous int64 ({n_tokens},), got {np.dtype(a.dtype).name} {tuple(a.shape)}")
    norm_args = _norm_args(norm, head_dim, work, cos, "append_kv")   # None: cos in the weight's place (unread)
    if n_tokens == 0 or heads == 0 or head_dim == 0:
        return None
    itemsize = ITEMSIZE[dtype_name]
    grid, block, group, tpb, smem = kv_append_geometry(
        n_tokens, heads, head_dim, work_itemsize=8 if work == "double" else 4, quantized=kv_dtype is not None,
        threads=threads, group=group, max_tokens_per_block=max_tokens_per_block, norm=norm is not None)
    i32 = np.int32
    args = (k, *_elem_strides(k, itemsize), v, *_elem_strides(v, itemsize), cos, sin, rows, slots, k_store, v_store,
            cos if k_scale is None else k_scale, sin if v_scale is None else v_scale,   # KIND 0 never writes them
            np.int64(n_tokens), i32(heads), i32(head_dim), i32(rotary_dim), i32(offset), i32(layout == "interleaved"),
            i32(group), i32(tpb), *norm_args[:2])   # (the kernel's NORM in place of has_norm)
    return Launch("kv_cache", kv_append_kernel_name(dtype_name, kv_dtype, norm is not None), grid, block, smem, args)


def _device_norm(exchange, norm):
    """``norm`` with a torch weight as its CuPy view (a CuPy weight as it is; the plan checks it)."""
    if norm is None or not (isinstance(norm, tuple) and len(norm) == 2):
        return norm
    weight, eps = norm
    return (exchange.to_cupy(weight) if _is_torch_cuda(weight) else weight), eps


def append_kv(k, v, cos, sin, rows, slots, stores, *, rotary_dim, layout, offset, kv_dtype, norm=None):
    """The ``append_kv`` primitive (see :mod:`rotary.backends`): one kv_append launch on k's device and stream;
    k and v CuPy arrays (or torch CUDA tensors), ``stores`` CuPy arrays of format ``kv_dtype``; ``slots[t] < 0``
    skips token t. ``norm``: None or (weight, eps), the keys' per-head RMSNorm before their rotation (weight a
    (head_dim,) C-contiguous device array of the work dtype)."""
    import cupy

    exchange = _Exchange(k)
    with exchange:
        name = exchange.dtype_name(k)
        c, s = _work_tables(cos, sin, KERNEL_TYPES[name][1])
        rows_dev = cupy.ascontiguousarray(cupy.asarray(rows), dtype=cupy.int64).reshape(-1)
        slots_dev = cupy.ascontiguousarray(cupy.asarray(slots), dtype=cupy.int64).reshape(-1)
        plan = plan_append_kv(exchange.to_cupy(k), exchange.to_cupy(v), c, s, rows_dev, slots_dev, stores,
                              dtype_name=name, rotary_dim=rotary_dim, layout=layout, offset=offset, kv_dtype=kv_dtype,
                              norm=_device_norm(exchange, norm))
        if plan is not None:
            _launch(plan, name)


def kv_entry_chunks(entry_itemsize: int, work_itemsize: int) -> tuple[int, int]:
    """(entries per 16-byte chunk of the score phase, entries per P.V chunk) of paged_attention: 16 bytes of
    entries, and as many as 16 bytes of work values hold (4 for fp32 work, 2 for fp64), at most a chunk."""
    chunk = 16 // entry_itemsize
    return chunk, min(chunk, 16 // work_itemsize)


def paged_attention_layout(head_dim: int, threads: int, tile: int, heads: int, entry_itemsize: int,
                           work_itemsize: int) -> dict:
    """Byte offsets of paged_attention's dynamic shared memory (kv_cache.cu's kv_attention_layout, the same
    formula): staged rows (2 * tile of ``row_stride`` bytes; at the end the key groups' sums) at 0, then ``qs``,
    ``sp``, ``pt``, ``red``, ``hv``, ``scl``, ``slot``; ``total`` bytes."""
    ce, cv = kv_entry_chunks(entry_itemsize, work_itemsize)
    nck, nc = -(-head_dim * entry_itemsize // 16), -(-head_dim // cv)
    r16 = lambda n: -(-n // 16) * 16   # noqa: E731
    out = {"row_stride": (nck if nck % 2 else nck + 1) * 16}
    out["qs"] = r16(max(2 * tile * out["row_stride"], threads // nc * nc * cv * work_itemsize))
    out["sp"] = out["qs"] + r16(heads * nck * ce * work_itemsize)
    out["pt"] = out["sp"] + r16(threads // tile * heads * tile * work_itemsize)
    out["red"] = out["pt"] + r16(tile * KV_ATTENTION_HEADS * work_itemsize)
    out["hv"] = out["red"] + r16(threads * work_itemsize)
    out["scl"] = out["hv"] + r16(3 * heads * work_itemsize)
    out["slot"] = out["scl"] + r16(4 * tile * work_itemsize)
    out["total"] = out["slot"] + 2 * tile * 8
    return out


def paged_attention_splits(base_blocks: int, keys: int) -> int:
    """The split-K rule: 1 when a launch has KV_SPLIT_BLOCKS blocks or more without splitting; else enough splits
    to reach that many blocks, but no more than keep KV_SPLIT_MIN_KEYS keys per split of ``keys`` (the longest key
    range a row may read). Batch 1 at 32k keys with 8 kv heads: min(ceil(264 / 8), 32768 // 256) = 33 splits;
    32 sequences x 8 kv heads at 2048 keys: 256 blocks, 2 splits."""
    if base_blocks >= KV_SPLIT_BLOCKS:
        return 1
    return max(1, min(-(-KV_SPLIT_BLOCKS // max(1, base_blocks)), keys // KV_SPLIT_MIN_KEYS))


class PagedAttentionGeometry(NamedTuple):
    """The launch geometry of paged_attention: blocks (q row, kv head, head chunk, split), ``threads`` per block,
    ``tile`` keys per tile, ``heads_per_block`` q heads per block (``head_chunks`` blocks per GQA group), ``splits``
    per row, dynamic ``shared_mem`` bytes."""
    grid: int
    threads: int
    tile: int
    heads_per_block: int
    head_chunks: int
    splits: int
    shared_mem: int


def paged_attention_geometry(n_rows: int, q_heads: int, kv_heads: int, head_dim: int, *, keys: int,
                             entry_itemsize: int, work_itemsize: int, threads: int | None = None,
                             tile: int | None = None, splits: int | None = None,
                             shared_mem_limit: int = SHARED_MEM_LIMIT) -> PagedAttentionGeometry:
    """The geometry of a paged_attention launch. ``threads`` (None: KV_ATTENTION_THREADS) is raised to the head's
    P.V chunks (ceil(head_dim / CV)) and to the block's q heads, and must stay within KV_ATTENTION_MAX_THREADS
    (else ValueError: head_dim <= 1024 for fp32 work, <= 512 for fp64); ``tile`` (None:
    the largest power of two <= threads whose shared memory fits ``shared_mem_limit``) is at most ``threads``;
    ``splits`` (None: :func:`paged_attention_splits` of the blocks without splits and ``keys``, the longest key
    range a row may read) forces the split count."""
    group = q_heads // kv_heads
    heads = min(group, KV_ATTENTION_HEADS)
    head_chunks = -(-group // heads)
    _, cv = kv_entry_chunks(entry_itemsize, work_itemsize)
    need = max(-(-head_dim // cv), heads)
    threads = max(int(KV_ATTENTION_THREADS if threads is None else threads), need, 1)
    if threads > KV_ATTENTION_MAX_THREADS:
        raise ValueError(f"paged_attention: {threads} threads per block (head_dim {head_dim} needs {need}), more "
                         f"than the kernel's {KV_ATTENTION_MAX_THREADS}")

    def smem(n):
        return paged_attention_layout(head_dim, threads, n, heads, entry_itemsize, work_itemsize)["total"]

    if tile is None:
        tile = 1 << (threads.bit_length() - 1)
        while tile > 1 and smem(tile) > shared_mem_limit:
            tile //= 2
    tile = max(1, min(int(tile), threads))
    if smem(tile) > shared_mem_limit:
        raise ValueError(f"paged_attention: {smem(tile)} bytes of shared memory for head_dim {head_dim} and "
                         f"{tile}-key tiles, more than the {shared_mem_limit} allowed")
    base = n_rows * kv_heads * head_chunks
    splits = paged_attention_splits(base, keys) if splits is None else max(1, int(splits))
    if base * splits >= 2**31:
        raise ValueError(f"paged_attention: {base * splits} blocks, more than a launch takes")
    return PagedAttentionGeometry(base * splits, threads, tile, heads, head_chunks, splits, smem(tile))


class PagedAttentionPlan(NamedTuple):
    """The launches of one paged_attention call: paged_attention, then (splits > 1) paged_attention_combine over
    the ``workspace`` (partial o (rows, q heads, splits, D) and (m, l) (rows, q heads, splits, 2), work dtype)."""
    launches: tuple
    geometry: PagedAttentionGeometry
    workspace: tuple | None


def _pointer(a) -> int:
    """The device (CuPy) or host (NumPy) address of an array's first element."""
    ptr = getattr(getattr(a, "data", None), "ptr", None)
    return int(ptr) if ptr is not None else int(a.__array_interface__["data"][0])


def plan_paged_attention(q, o, stores, block_table, page_size: int, seq_lens, q_starts, *, dtype_name: str,
                         scale: float, softcap, window, causal: bool, kv_dtype, rotation=None, norm=None,
                         threads: int | None = None, tile: int | None = None, splits: int | None = None, empty=None,
                         shared_mem_limit: int = SHARED_MEM_LIMIT) -> PagedAttentionPlan | None:
    """The paged_attention launches: q (T, Hq, D) packed queries with any strides, o a C-contiguous (T, Hq, D) array
    of q's dtype, ``stores`` of format ``kv_dtype`` (entries (P, Hk, D), scales (P, Hk) or None; C-contiguous),
    block_table (n, W), seq_lens (n,) and q_starts (n + 1,) contiguous int64 (sequence i's queries are q rows
    q_starts[i] .. q_starts[i + 1] - 1, the last ones of its seq_lens[i] keys; not range-checked: the caller's).
    ``threads``, ``tile``, ``splits``: :func:`paged_attention_geometry` (the keys bound of the split rule: W *
    page_size, or the window when causal); ``empty(shape, dtype)`` (None: NumPy's) allocates the split-K workspace.
    ``rotation`` = (cos, sin, rows, rotary_dim, layout, offset): q rotated as it is read, row r at table row rows[r]
    (cos/sin (R, rotary_dim // 2) C-contiguous in the work dtype, rows (T,) contiguous int64); None: q is rotated.
    ``norm``: None, or (weight, eps): each q head RMS-normed as it is read, before its rotation and the scale
    (weight (D,) C-contiguous in the work dtype, eps a float >= 0; the append's key norm). None when there is no
    q row."""
    where = "paged_attention"
    _kv_check(len(q.shape) == 3, f"q must be (tokens, q heads, head_dim), got {tuple(q.shape)}", where)
    n_rows, q_heads, head_dim = (int(d) for d in q.shape)
    k_store = stores[0]
    kv_heads = int(k_store.shape[1]) if len(k_store.shape) == 3 else 0
    _kv_check(tuple(o.shape) == tuple(q.shape) and o.flags.c_contiguous and np.dtype(o.dtype) == np.dtype(q.dtype),
              "o must be C-contiguous like q", where)
    _kv_check(kv_heads > 0 and q_heads % kv_heads == 0, f"q heads ({q_heads}) must be a multiple of kv heads "
              f"({kv_heads})", where)
    _check_stores(stores, kv_dtype, dtype_name, kv_heads, head_dim, where)
    n = int(block_table.shape[0]) if len(block_table.shape) == 2 else -1
    for name, a, shape in (("block_table", block_table, (n, int(block_table.shape[-1]))), ("seq_lens", seq_lens, (n,)),
                           ("q_starts", q_starts, (n + 1,))):
        _kv_check(np.dtype(a.dtype).name == "int64" and a.flags.c_contiguous and tuple(a.shape) == shape and n >= 0,
                  f"{name} must be a contiguous int64 array {shape} (block_table 2-D), got {np.dtype(a.dtype).name} "
                  f"{tuple(a.shape)}", where)
    work = KERNEL_TYPES[dtype_name][1]
    norm_args = _norm_args(norm, head_dim, work, seq_lens, where)   # None: seq_lens in the weight's place (unread)
    if n_rows * q_heads == 0 or head_dim == 0:
        return None
    wtype = np.float64 if work == "double" else np.float32
    work_itemsize = 8 if work == "double" else 4
    k_store, v_store, k_scale, v_scale = stores
    entry_itemsize = np.dtype(k_store.dtype).itemsize
    keys = int(block_table.shape[1]) * int(page_size)
    if causal and window:
        keys = min(keys, int(window))
    geo = paged_attention_geometry(n_rows, q_heads, kv_heads, head_dim, keys=keys, entry_itemsize=entry_itemsize,
                                   work_itemsize=work_itemsize, threads=threads, tile=tile, splits=splits,
                                   shared_mem_limit=shared_mem_limit)
    vec = head_dim * entry_itemsize % 16 == 0 and _pointer(k_store) % 16 == 0 and _pointer(v_store) % 16 == 0
    workspace = None
    if geo.splits > 1:
        empty = np.empty if empty is None else empty
        workspace = (empty((n_rows * q_heads * geo.splits * head_dim,), wtype),
                     empty((n_rows * q_heads * geo.splits * 2,), wtype))
    part_o, part_ml = workspace or (o, o)   # splits == 1: never touched
    itemsize = ITEMSIZE[dtype_name]
    fold = scale / softcap if softcap else scale
    i32, i64 = np.int32, np.int64
    if rotation is None:
        q_rot = (seq_lens, seq_lens, seq_lens, i32(0), i32(0), i32(0))   # rotary_dim 0: the tables are not read
    else:
        cos, sin, rows, rotary_dim, layout, offset = rotation
        half = rotary_dim // 2
        _kv_check(rotary_dim % 2 == 0 and 0 <= offset and offset + rotary_dim <= head_dim and
                  layout in ("half", "interleaved"), f"rotation: rotary_dim {rotary_dim} (even) from offset {offset} in "
                  f"layout {layout!r} does not fit head_dim {head_dim}", where)
        work_name = "float64" if work == "double" else "float32"
        for name, a in (("cos", cos), ("sin", sin)):
            _kv_check(len(a.shape) == 2 and int(a.shape[1]) == half and a.flags.c_contiguous and
                      np.dtype(a.dtype).name == work_name, f"rotation {name} must be C-contiguous {work_name} (rows, "
                      f"{half})", where)
        _kv_check(tuple(rows.shape) == (n_rows,) and rows.flags.c_contiguous and np.dtype(rows.dtype).name == "int64",
                  f"rotation rows must be a contiguous int64 ({n_rows},), got {np.dtype(rows.dtype).name} "
                  f"{tuple(rows.shape)}", where)
        q_rot = (cos, sin, rows, i32(rotary_dim), i32(offset), i32(layout == "interleaved"))
    args = (q, *_elem_strides(q, itemsize), o, part_o, part_ml, k_store, v_store,
            seq_lens if k_scale is None else k_scale, seq_lens if v_scale is None else v_scale,   # KIND 0: unread
            block_table, i64(block_table.shape[1]), i64(page_size), seq_lens, q_starts, i64(n), i32(q_heads),
            i32(kv_heads), i32(head_dim), wtype(fold), wtype(softcap or 0), i64(window or 0), i32(bool(causal)),
            i32(geo.tile), i32(geo.heads_per_block), i32(geo.splits), i32(vec), *q_rot, *norm_args)
    launches = [Launch("kv_cache", paged_attention_kernel_name(dtype_name, kv_dtype), geo.grid, geo.threads,
                       geo.shared_mem, args)]
    if geo.splits > 1:
        launches.append(Launch("kv_cache", paged_attention_combine_kernel_name(dtype_name), n_rows * q_heads,
                               max(1, min(KV_COMBINE_THREADS, head_dim)), geo.splits * work_itemsize,
                               (part_o, part_ml, o, i32(geo.splits), i32(head_dim))))
    return PagedAttentionPlan(tuple(launches), geo, workspace)


def paged_attention(q, stores, block_table, page_size, seq_lens, q_starts, *, scale, softcap, window, causal,
                    kv_dtype, rotation=None, norm=None):
    """The ``paged_attention`` capability (see :mod:`rotary.backends`): the launches of :func:`plan_paged_attention`
    (paged_attention, then the split-K combine when the rule splits) on q's device and stream over the pages where
    they lie, q RMS-normed (``norm`` = (weight, eps)) and rotated as it is read when those are given; returns o (T,
    Hq, D) in q's dtype (a torch tensor for a torch q). The tables are used as they are when they are contiguous
    int64 device arrays (else copied once)."""
    import cupy

    exchange = _Exchange(q)
    with exchange:
        name = exchange.dtype_name(q)
        o = exchange.empty_like(q)
        table, lens, starts = (cupy.ascontiguousarray(cupy.asarray(exchange.to_cupy(a) if _is_torch_cuda(a) else a),
                                                      dtype=cupy.int64) for a in (block_table, seq_lens, q_starts))
        if rotation is not None:
            cos, sin, rows, rotary_dim, layout, offset = rotation
            cos, sin = _work_tables(cos, sin, KERNEL_TYPES[name][1])
            rows = cupy.ascontiguousarray(cupy.asarray(rows), dtype=cupy.int64).reshape(-1)
            rotation = (cos, sin, rows, rotary_dim, layout, offset)
        plan = plan_paged_attention(exchange.to_cupy(q), exchange.to_cupy(o), stores, table, page_size, lens, starts,
                                    dtype_name=name, scale=scale, softcap=softcap, window=window, causal=causal,
                                    kv_dtype=kv_dtype, rotation=rotation, norm=_device_norm(exchange, norm),
                                    empty=cupy.empty)
        if plan is not None:
            for launch in plan.launches:   # the workspace is freed after them, in the stream's order (CuPy's pool)
                _launch(launch, name)
    return o
