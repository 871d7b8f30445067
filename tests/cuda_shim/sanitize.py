"""Run the CUDA kernels through the host shim under AddressSanitizer + UBSan or ThreadSanitizer.

A sanitized library loads only into a process whose sanitizer runtime was loaded first, so each run is
a child Python with the runtime in LD_PRELOAD (:func:`command` builds it; :func:`run` runs it):

    python -m tests.cuda_shim.sanitize MODE WHAT [--slots N] [--guard] [--compare] [--dir DIR]

MODE: ``address`` or ``thread``. WHAT: ``conformance`` (the rotation conformance cases through the frontend at
two block geometries, and the linear-attention conformance cases), ``direct`` (direct launches: partial rotary
dims, odd head dims, in place, fp16/fp64, GQA, dv tiles, a tiny shared-memory budget, decay, cu_seqlens with an
empty sequence), ``linear_backward`` (linear_backward.cu against the NumPy reference backward), ``random``
(random rotation and linear-attention problems: element offsets, strides along head_dim, a reversed k, GQA,
block geometries, budgets), ``kvcache`` (random KV-cache appends of kv_cache.cu, bit for bit against the
reference append, then paged_attention and its split-K combine against the float64 oracle, then both with the
per-head RMSNorm against float64 oracles), or ``planted:NAME`` (one kernel of planted.cu, or
``rope_short_table``: the rotation kernel given a cos/sin table shorter than its row indices; each must fail).
``--guard``: exact-extent copies of every global buffer; ``--compare``: every launch under two
shared-memory poisons; ``--slots``: concurrent blocks. Prints one line per case and ``OK <n> launches``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
RUNTIMES = {"address": "libasan.so", "thread": "libtsan.so"}
ENV = {
    "address": {"ASAN_OPTIONS": "detect_leaks=0:halt_on_error=1:abort_on_error=0:exitcode=86",
                "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1:exitcode=87"},
    "thread": {"TSAN_OPTIONS": "halt_on_error=1:exitcode=66:report_signal_unsafe=0"},
}


def runtime(mode: str, cxx: str | None = None) -> str | None:
    """Path of the sanitizer runtime the host compiler links against (None if it is not installed)."""
    from . import host

    cxx = cxx or host.compiler()
    if cxx is None:
        return None
    try:
        out = subprocess.run([cxx, f"-print-file-name={RUNTIMES[mode]}"], capture_output=True, text=True,
                             timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    path = Path(out)
    if not path.is_absolute() or not path.exists():
        return None
    return str(path.resolve())


def missing(mode: str) -> str | None:
    """Why ``mode`` cannot run here (None if it can)."""
    from . import host

    if host.compiler() is None:
        return "no host C++ compiler (g++/clang++)"
    if runtime(mode) is None:
        pkg = {"address": "libasan8 libubsan1", "thread": "libtsan2"}[mode]
        return f"the {mode} sanitizer runtime ({RUNTIMES[mode]}) is not installed (apt-get install {pkg})"
    return None


def command(mode: str, what: str, *, slots: int = 1, guard: bool = False, compare: bool = False,
            directory: str | None = None):
    """(argv, env) of a child run."""
    env = dict(os.environ)
    env.update(ENV[mode])
    env["LD_PRELOAD"] = runtime(mode)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    # the oracles' BLAS threads are not instrumented: TSan would report their memsets against the main thread
    env.update(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    argv = [sys.executable, "-m", "tests.cuda_shim.sanitize", mode, what, f"--slots={slots}"]
    if mode == "thread" and no_aslr_prefix():   # TSan's fixed shadow layout fails under high mmap entropy
        argv = no_aslr_prefix() + argv
    argv += ["--guard"] * guard + ["--compare"] * compare
    if directory:
        argv.append(f"--dir={directory}")
    return argv, env


def no_aslr_prefix() -> list[str]:
    """``setarch <machine> -R`` where it works (address-space randomisation off for the child), else []."""
    import platform
    import shutil

    tool = shutil.which("setarch")
    if tool is None:
        return []
    cmd = [tool, platform.machine(), "-R"]
    try:
        ok = subprocess.run(cmd + ["true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    return cmd if ok else []


#: what the sanitizer runtimes print when they cannot start here (not a finding about the kernels)
CANNOT_START = ("unexpected memory mapping", "failed to allocate", "ThreadSanitizer: cannot",
                "Shadow memory range interleaves")


def run(mode: str, what: str, *, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    argv, env = command(mode, what, **kw)
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def build(directory: str | None = None):
    """Build (or reuse) the sanitized libraries of both modes in the parent (no runtime needed to compile)."""
    from . import host

    d = Path(directory or default_dir())
    return {mode: host.build(d, sanitize=mode, planted=True, load=False) for mode in RUNTIMES}


def default_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"rotary-cuda-sanitize-{os.getuid()}"


# -- the child side ------------------------------------------------------------------------------------
def _register(kernels, **geometry):
    from .kv_backend import register, shim_backend

    return register(module=shim_backend(kernels, **geometry)).NAME


def run_conformance(kernels) -> int:
    from rotary.conformance import cases as conformance

    failures = 0
    for label, geometry in (("small", dict(threads=32, max_tokens_per_block=3)),
                            ("tiny", dict(threads=5, max_tokens_per_block=1))):
        name = _register(kernels, **geometry)
        for case in conformance.cases():
            if label != "small" and case.scaling is not None:
                continue
            result = conformance.run_case(case, name)
            failures += not result.passed
            print(f"{'ok' if result.passed else 'FAIL'} rotate {label} {case.name} {result.max_error:.2g}", flush=True)
    name = _register(kernels, threads=32)
    for case in conformance.linear_cases():
        result = conformance.run_linear_case(case, name)
        failures += not result.passed
        print(f"{'ok' if result.passed else 'FAIL'} linear {case.name} {result.max_error:.2g}", flush=True)
    return failures


def _linear_matches(kernels, spec, q, k, v, cos, sin, positions, *, causal, chunk, threads, limit, state) -> bool:
    """The CUDA linear-attention kernel (elu, eps=1e-3) on the shim agrees with the float64 oracle: the
    output and the carried state (S, z) within 2e-5 relative."""
    from tests.test_cuda_kernels_cpu import _rel, la_oracle

    from .kv_backend import run_linear_attention

    o, (S, z) = run_linear_attention(kernels, q, k, v, cos, sin, positions.astype(np.int64),
                                     rotary_dim=spec.rotary_dim, layout=spec.layout, causal=causal,
                                     feature_map="elu", eps=1e-3, chunk=chunk, state=state, threads=threads,
                                     shared_mem_limit=limit)
    ref, (S_ref, z_ref) = la_oracle(q, k, v, positions, spec, causal=causal, feature_map="elu", eps=1e-3,
                                    state=state)
    return _rel(o, ref) < 2e-5 and _rel(S, S_ref) < 2e-5 and _rel(z, z_ref) < 2e-5


def run_direct(kernels) -> int:
    """Direct launches with the shapes the conformance suite does not reach, against float64 oracles."""
    from rotary import RopeSpec
    from tests.test_cuda_kernels_cpu import _oracle, _tables
    from rotary.backends import cupy as cb
    from rotary.testing import tolerance
    from . import host

    rng = np.random.default_rng(25)
    failures = 0
    for head_dim, rotary_dim, dtype, layout, inplace in ((24, 12, "float16", "half", False),
                                                        (19, 18, "float32", "interleaved", True),
                                                        (40, 6, "float64", "half", False),
                                                        (64, 64, "float16", "interleaved", True)):
        spec = RopeSpec(head_dim, rotary_dim=rotary_dim, layout=layout)
        work = np.float64 if dtype == "float64" else np.float32
        positions = rng.integers(0, 50, size=(2, 5))
        cos, sin = _tables(spec, np.arange(50), work)
        q = rng.standard_normal((2, 5, 3, head_dim)).astype(dtype)
        k = rng.standard_normal((2, 5, 1, head_dim)).astype(dtype)
        q0, k0 = q.copy(), k.copy()
        items = [(q, q), (k, k)] if inplace else [(q, np.empty_like(q)), (k, np.empty_like(k))]
        plan = cb.plan_rotate(items, cos, sin, positions.astype(np.int64), dtype_name=dtype, rotary_dim=rotary_dim,
                              layout=layout, inverse=False, address=host.address, threads=7, max_tokens_per_block=2)
        kernels.launch(plan)
        rtol, atol = tolerance(dtype)
        ok = all(np.allclose(y.astype(np.float64), _oracle(x0, positions, spec), rtol=rtol, atol=atol)
                 for (_, y), x0 in zip(items, (q0, k0)))
        failures += not ok
        print(f"{'ok' if ok else 'FAIL'} rotate d={head_dim} r={rotary_dim} {dtype} {layout} inplace={inplace}")
    for B, T, H, m, dv, r, layout, chunk, threads, limit, causal in (
            (1, 21, 2, 13, 10, 8, "interleaved", 8, 32, cb.SHARED_MEM_LIMIT, True),
            (1, 40, 1, 16, 70, 12, "half", 16, 64, cb.SHARED_MEM_LIMIT, False),
            (1, 29, 2, 24, 20, 24, "half", 64, 8, 4096, True),
            (2, 9, 1, 8, 4, 8, "half", 64, 16, cb.SHARED_MEM_LIMIT, False)):
        spec = RopeSpec(m, rotary_dim=r, layout=layout)
        positions = rng.integers(0, 100, size=(B, T))
        cos, sin = _tables(spec, np.arange(100))
        q, k = (rng.standard_normal((B, T, H, m)).astype(np.float32) for _ in range(2))
        v = rng.standard_normal((B, T, H, dv)).astype(np.float32)
        state = (rng.standard_normal((B, H, m, dv)).astype(np.float32), rng.random((B, H, m)).astype(np.float32))
        ok = _linear_matches(kernels, spec, q, k, v, cos, sin, positions, causal=causal, chunk=chunk,
                             threads=threads, limit=limit, state=state)
        failures += not ok
        print(f"{'ok' if ok else 'FAIL'} linear m={m} dv={dv} chunk={chunk} threads={threads} causal={causal}")
    # decay + cu_seqlens (one empty sequence) + normalize=False through the frontend
    from tests.test_linear_attention_variants import ragged_against_oracle

    name = _register(kernels, threads=32)
    for causal, decay, normalize in ((True, [0.8, 0.99], False), (False, None, True), (True, [0.7, 1.0], True)):
        try:
            ragged_against_oracle(name, causal, normalize, np.float32, decay)
            ok = True
        except AssertionError as exc:
            print(exc)
            ok = False
        failures += not ok
        print(f"{'ok' if ok else 'FAIL'} linear ragged causal={causal} decay={decay} normalize={normalize}")
    return failures


def run_random(kernels, n_rotate: int = 40, n_linear: int = 12, seed: int = 2025) -> int:
    """Random problems (shapes, element offsets, strides along head_dim, reversed sequences, GQA, geometries,
    in place, inverse; linear attention with odd m, dv tiles, budgets, states) against float64 oracles."""
    from rotary import RopeSpec
    from rotary.backends import cupy as cb
    from rotary.testing import tolerance
    from tests.test_cuda_kernels_cpu import _oracle, _tables
    from . import host

    rng = np.random.default_rng(seed)
    failures = 0
    for i in range(n_rotate):
        head_dim = int(rng.integers(2, 41))
        rotary_dim = 2 * int(rng.integers(1, head_dim // 2 + 1))
        B, S, Hq, Hk = (int(rng.integers(lo, hi)) for lo, hi in ((1, 3), (1, 8), (1, 4), (0, 3)))
        layout = str(rng.choice(["half", "interleaved"]))
        dtype = str(rng.choice(["float16", "float32", "float64"]))
        offset, step = int(rng.integers(0, 4)), int(rng.choice([1, 1, 2]))
        inplace, inverse = bool(rng.integers(2)), bool(rng.integers(2))
        spec = RopeSpec(head_dim, rotary_dim=rotary_dim, layout=layout)
        work = np.float64 if dtype == "float64" else np.float32
        positions = rng.integers(0, 64, size=(B, S))
        cos, sin = _tables(spec, np.arange(64), work)

        def make(heads):
            shape = (B, S, heads, head_dim * step)
            buf = rng.standard_normal(int(np.prod(shape)) + offset).astype(dtype)
            return buf[offset:].reshape(shape)[..., ::step]

        xs = [make(Hq)] + ([make(Hk)] if Hk else [])
        originals = [x.copy() for x in xs]
        outs = [x if inplace else np.empty(x.shape, x.dtype) for x in xs]
        plan = cb.plan_rotate(list(zip(xs, outs)), cos, sin, positions.astype(np.int64), dtype_name=dtype,
                              rotary_dim=rotary_dim, layout=layout, inverse=inverse, address=host.address,
                              threads=int(rng.choice([1, 3, 32])), max_tokens_per_block=[None, 1, 2][i % 3])
        kernels.launch(plan)
        rtol, atol = tolerance(dtype)
        ok = all(np.allclose(y.astype(np.float64), _oracle(x0, positions, spec, inverse), rtol=rtol, atol=atol)
                 and (inplace or np.array_equal(x, x0)) for x0, x, y in zip(originals, xs, outs))
        failures += not ok
        print(f"{'ok' if ok else 'FAIL'} rotate random {i}: d={head_dim} r={rotary_dim} B={B} S={S} H={Hq}/{Hk} "
              f"{layout} {dtype} offset={offset} step={step} inplace={inplace}", flush=True)
    for i in range(n_linear):
        B, T, H = int(rng.integers(1, 3)), int(rng.integers(1, 41)), int(rng.integers(1, 3))
        m, dv = int(rng.integers(2, 21)), int(rng.integers(1, 13))
        causal, layout = bool(rng.integers(2)), str(rng.choice(["half", "interleaved"]))
        chunk, threads = int(rng.choice([1, 3, 8, 64])), int(rng.choice([1, 7, 32]))
        budget = int(rng.choice([2048, cb.SHARED_MEM_LIMIT]))
        r = 2 * (m // 2)
        spec = RopeSpec(m, rotary_dim=r, layout=layout)
        positions = rng.integers(0, 50, size=(B, T))
        cos, sin = _tables(spec, np.arange(50))
        q = rng.standard_normal((B, T, H, m)).astype(np.float32)
        k = rng.standard_normal((B, T, H, m)).astype(np.float32)[:, ::-1] if i % 2 else \
            rng.standard_normal((B, T, H, m)).astype(np.float32)
        v = rng.standard_normal((B, T, H, dv)).astype(np.float32)
        state = ((rng.standard_normal((B, H, m, dv)).astype(np.float32), rng.random((B, H, m)).astype(np.float32))
                 if i % 3 else None)
        ok = _linear_matches(kernels, spec, q, k, v, cos, sin, positions, causal=causal, chunk=chunk,
                             threads=threads, limit=budget, state=state)
        failures += not ok
        print(f"{'ok' if ok else 'FAIL'} linear random {i}: B={B} T={T} H={H} m={m} dv={dv} causal={causal} "
              f"chunk={chunk} threads={threads} budget={budget}", flush=True)
    return failures


def run_kvcache(kernels, n_random: int = 24, seed: int = 7) -> int:
    """KV-cache appends (kv_append) against the reference append, bit for bit: every kv dtype (cast, int8,
    float8), fp16/fp32/fp64, both pair layouts, partial rotary with an offset, strided and reversed k/v, paged
    slot orders with padding tokens (slot -1, row -1: a read of their table row would leave the table), odd thread
    groups and one-token blocks; then paged_attention over pools the append kernel filled against the float64
    oracle: packed prefill + decode, dense decode, window, softcap, non-causal, GQA 1/2/4/8 (a block per kv head),
    shared pages, block sizes down to 5 threads with 3-key tiles, 1, 2 and 7 splits (paged_attention_combine),
    16-byte and entry-by-entry staging (tests/test_kv_cache_cuda_shim.py's helpers); then the per-head RMSNorm
    (kv_append<..., true>, paged_attention's q norm): random appends with norm against the float64 oracle (norm,
    then rotation by float64 angles; v bit for bit the append's without the norm), and attention with the q norm
    over pools of normed keys (decode and mixed steps, GQA 1 and 4, q rotated as it is read or not, 1 and 3
    splits, 5 threads with 3-key tiles and the default block) against the float64 oracle."""
    from tests.test_kv_cache_cuda_shim import (ATTENTION_CASES, FORMATS, GEOMETRIES, SEQ_LENS, SHARED, Pool, attend,
                                               assert_close, check_append, make_stores, paged_slots, with_padding)

    from .kv_backend import kv_shim_backend

    rng = np.random.default_rng(seed)
    failures = 0
    for i in range(n_random):
        dtype, kv_dtype, spec, T, Hk, P, geometry = _random_append(rng, i, GEOMETRIES, max_tokens=8, max_spare=5)
        head_dim, rotary_dim, offset, layout = spec.head_dim, spec.rotary_dim, spec.rotary_offset, spec.layout
        k = rng.standard_normal((T, 2 * Hk, head_dim)).astype(dtype)[:, ::2] if i % 2 else \
            rng.standard_normal((T, Hk, head_dim)).astype(dtype)
        v = rng.standard_normal((T, Hk, head_dim)).astype(dtype)[::-1] if i % 4 == 1 else \
            rng.standard_normal((T, Hk, head_dim)).astype(dtype)
        k, v, rows, slots = with_padding(rng, k, v, rng.integers(0, 64, T), paged_slots(rng, T, P), i % 3)
        try:
            check_append(kernels, k, v, spec, rows, slots, make_stores(P, Hk, head_dim, dtype, kv_dtype, rng),
                         kv_dtype=kv_dtype, geometry=geometry)
            ok = True
        except AssertionError as exc:
            print(exc)
            ok = False
        failures += not ok
        print(f"{'ok' if ok else 'FAIL'} kv_append random {i}: d={head_dim} r={rotary_dim} offset={offset} T={T} "
              f"Hk={Hk} {layout} {dtype} {kv_dtype} {geometry}", flush=True)

    for i, case in enumerate(list(ATTENTION_CASES) * 2):
        dtype, kv_dtype = FORMATS[(3 * i) % len(FORMATS)]
        attention = [dict(threads=5, tile=3), dict(threads=32, tile=8), dict(threads=64)][i % 3]
        attention["splits"] = (1, 2, 7)[i % 3 if i < 5 else (i + 1) % 3]   # paged_attention_combine with 2 and 7
        group = (2, 1, 4, 8)[i % 4]                                         # GQA: q heads per kv head
        head_dim = 20 if i % 4 == 3 else 32                                 # fp16/int8 rows of 40/20 bytes: staged
        rows, counts, kw = ATTENTION_CASES[case]                            # entry by entry
        try:
            pool = Pool(kernels, dtype=dtype, kv_dtype=kv_dtype, seq_lens=SEQ_LENS, shared=SHARED, seed=i,
                        geometry=list(GEOMETRIES)[i % len(GEOMETRIES)], check_bits=True, head_dim=head_dim)
            q = rng.standard_normal((sum(counts), 2 * group, head_dim)).astype(dtype)
            assert_close(*attend(kv_shim_backend(kernels, attention=attention), pool, q, rows, counts, **kw), dtype)
            ok = True
        except AssertionError as exc:
            print(exc)
            ok = False
        failures += not ok
        print(f"{'ok' if ok else 'FAIL'} paged_attention {case} {dtype} {kv_dtype} GQA {group} d={head_dim} "
              f"{attention}", flush=True)
    return failures + _run_kvcache_norm(kernels, rng)


def _random_append(rng, i, geometries, *, max_tokens, max_spare):
    """A random append of case i: (dtype, kv_dtype (cycling None, int8, float8; float8 never with float64), spec
    (head_dim 2..40, a random even rotary_dim from a random offset, either layout), tokens T, k/v heads, pool slots
    P (T and up to max_spare more), thread geometry (cycling))."""
    from rotary import RopeSpec

    dtype = str(rng.choice(["float16", "float32", "float64"]))
    kv_dtype = [None, "int8", "float8_e4m3"][i % 3]
    if kv_dtype == "float8_e4m3" and dtype == "float64":
        dtype = "float32"
    head_dim = int(rng.integers(2, 41))
    rotary_dim = 2 * int(rng.integers(1, head_dim // 2 + 1))
    offset = int(rng.integers(0, head_dim - rotary_dim + 1))
    layout = str(rng.choice(["half", "interleaved"]))
    T, Hk = int(rng.integers(1, max_tokens + 1)), int(rng.integers(1, 4))
    P = T + int(rng.integers(0, max_spare + 1))
    spec = RopeSpec(head_dim, rotary_dim=rotary_dim, layout=layout, rotary_offset=offset)
    return dtype, kv_dtype, spec, T, Hk, P, list(geometries)[i % len(geometries)]


def _run_kvcache_norm(kernels, rng, n_random: int = 9) -> int:
    """run_kvcache's norm cases (its docstring)."""
    from rotary.backends import cupy as cb
    from tests.test_kv_cache_cuda_shim import (GEOMETRIES, NORM_EPS, NORM_STEPS, NormPool, assert_close,
                                               assert_same_bits, check_normed_keys, copy_stores, make_stores,
                                               norm_weight, oracle, paged_slots, reference, rms_norm64, rotate64,
                                               tables, with_padding)

    from .kv_backend import kv_shim_backend, work_of

    failures = 0
    for i in range(n_random):
        dtype, kv_dtype, spec, T, Hk, P, geometry = _random_append(rng, i, GEOMETRIES, max_tokens=7, max_spare=4)
        head_dim, rotary_dim, offset, layout = spec.head_dim, spec.rotary_dim, spec.rotary_offset, spec.layout
        eps = NORM_EPS[i % 2]
        k = rng.standard_normal((T, 2 * Hk, head_dim)) * 10.0 ** rng.uniform(-2, 2, (T, 2 * Hk, 1))
        k = k.astype(dtype)[:, ::2] if i % 2 else np.ascontiguousarray(k[:, :Hk], dtype)
        v = rng.standard_normal((T, Hk, head_dim)).astype(dtype)
        k, v, rows, slots = with_padding(rng, k, v, rng.integers(0, 64, T), paged_slots(rng, T, P), i % 3)
        work = work_of(dtype)
        cos, sin = tables(spec, 64, work)
        weight = norm_weight(rng, head_dim, work)
        stores = make_stores(P, Hk, head_dim, dtype, kv_dtype, rng)
        got = copy_stores(stores)
        threads, group, tpb = GEOMETRIES[geometry]
        try:
            kernels.launch(cb.plan_append_kv(k, v, cos, sin, rows, slots, got, dtype_name=dtype, rotary_dim=rotary_dim,
                                             layout=layout, offset=offset, kv_dtype=kv_dtype, norm=(weight, eps),
                                             threads=threads, group=group, max_tokens_per_block=tpb))
            if kv_dtype != "float8_e4m3":
                check_normed_keys(got, stores, k, rows, slots, spec, weight, eps, dtype=dtype, kv_dtype=kv_dtype)
            want = reference(k, v, cos, sin, rows, slots, stores, spec=spec, kv_dtype=kv_dtype)
            assert_same_bits(got[1::2], want[1::2])
            ok = True
        except AssertionError as exc:
            print(exc)
            ok = False
        failures += not ok
        print(f"{'ok' if ok else 'FAIL'} kv_append norm random {i}: d={head_dim} r={rotary_dim} offset={offset} T={T} "
              f"Hk={Hk} {layout} {dtype} {kv_dtype} {geometry} eps={eps}", flush=True)

    cases = [  # dtype, kv_dtype, head_dim, layout, step, GQA, rotated, attention geometry
        ("float32", "int8", 20, "half", "decode", 4, True, dict(threads=5, tile=3, splits=1)),
        ("float16", None, 20, "interleaved", "mixed", 1, False, dict(threads=5, tile=3, splits=3)),
        ("float64", None, 72, "interleaved", "mixed", 4, True, dict(splits=3)),
        ("float32", None, 72, "half", "decode", 1, False, dict(splits=1)),
    ]
    for i, (dtype, kv_dtype, head_dim, layout, step, group, rotated, attention) in enumerate(cases):
        work = work_of(dtype)
        counts = NORM_STEPS[step]
        try:
            pool = NormPool(kernels, dtype=dtype, kv_dtype=kv_dtype, head_dim=head_dim, layout=layout,
                            weight=norm_weight(rng, head_dim, work), eps=NORM_EPS[i % 2], seed=i)
            q = (rng.standard_normal((sum(counts), 2 * group, head_dim)) * 3).astype(dtype)
            q_weight, q_eps = norm_weight(rng, head_dim, work), NORM_EPS[(i + 1) % 2]
            rotation, positions = pool.rotation(counts)
            starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
            kw = dict(scale=head_dim ** -0.5, softcap=None, window=None, causal=True, kv_dtype=kv_dtype)
            o = kv_shim_backend(kernels, attention=attention).paged_attention(
                q, pool.stores, pool.block_table, pool.page_size, pool.seq_lens, starts,
                rotation=rotation if rotated else None, norm=(q_weight, q_eps), **kw)
            qn = rms_norm64(q, q_weight, q_eps)
            qn = rotate64(qn, positions, pool.spec) if rotated else qn
            assert_close(o, oracle(qn, pool.stores, pool.block_table, pool.page_size, pool.seq_lens, starts, **kw),
                         dtype)
            ok = True
        except AssertionError as exc:
            print(exc)
            ok = False
        failures += not ok
        print(f"{'ok' if ok else 'FAIL'} paged_attention norm {step} {dtype} {kv_dtype} GQA {group} d={head_dim} "
              f"{layout} rotated={rotated} {attention}", flush=True)
    return failures


def run_linear_backward(kernels, seed: int = 45) -> int:
    """linear_backward.cu's two kernels (the backward of linear attention) on small problems against the NumPy
    reference backward (rotary.backends.numpy_linear_backward; itself checked against torch autograd of the
    quadratic form in tests/test_linear_attention_backward.py): causal and not, decay, normalize on and off, GQA,
    partial rotary, both layouts, every feature map, dv tiles (small budgets), chunks that do not divide T, 1 and 7
    threads, a reversed k, a state in and a gradient on the state out; float64 to 1e-9, float32 to 5e-5."""
    from rotary.backends import cupy as cb
    from rotary.backends.numpy_linear_backward import linear_attention_backward as reference

    from .kv_backend import run_linear_attention_backward

    rng = np.random.default_rng(seed)
    failures = 0
    cases = [  # B, T, Hk, G, m, dv, r, layout, fmap, causal, decay, normalize, chunk, threads, budget, dtype
        (1, 9, 1, 2, 8, 5, 8, "half", "elu", True, True, True, 4, 32, cb.SHARED_MEM_LIMIT, "float64"),
        (2, 7, 2, 1, 6, 12, 4, "interleaved", "relu", True, False, False, 3, 7, 3000, "float64"),
        (1, 11, 1, 3, 9, 7, 6, "half", "identity", False, False, True, 4, 1, 2500, "float64"),
        (1, 6, 2, 2, 8, 3, 8, "interleaved", "elu", False, False, False, 16, 32, cb.SHARED_MEM_LIMIT, "float32"),
        (2, 13, 1, 1, 10, 9, 10, "half", "elu", True, True, True, 5, 7, 2400, "float32"),
        (1, 5, 1, 2, 4, 2, 4, "half", "relu", True, True, False, 2, 32, cb.SHARED_MEM_LIMIT, "float64"),
    ]
    for i, (B, T, Hk, G, m, dv, r, layout, fmap, causal, decay, normalize, chunk, threads, budget,
            dtype) in enumerate(cases):
        q = rng.standard_normal((B, T, Hk * G, m)).astype(dtype)
        k = (rng.standard_normal((B, T, Hk, m)).astype(dtype)[:, ::-1] if i % 2 else
             rng.standard_normal((B, T, Hk, m)).astype(dtype))
        v = rng.standard_normal((B, T, Hk, dv)).astype(dtype)
        go = rng.standard_normal((B, T, Hk * G, dv)).astype(dtype)
        angles = (3 + np.arange(T))[:, None] / 100.0 ** (np.arange(r // 2) * 2.0 / r)
        cos, sin = (np.ascontiguousarray(f(angles), dtype) for f in (np.cos, np.sin))
        rows = np.arange(T, dtype=np.int64)[None]
        state = (rng.standard_normal((B, Hk, m, dv)), np.abs(rng.standard_normal((B, Hk, m))) + 0.5) if i % 3 else None
        grad_state = (rng.standard_normal((B, Hk, m, dv)), rng.standard_normal((B, Hk, m)) if normalize else None)
        gammas = rng.uniform(0.5, 1.0, (B, Hk)) if decay else None
        kw = dict(rotary_dim=r, layout=layout, causal=causal, feature_map=fmap, eps=1e-6, chunk=chunk, state=state,
                  decay=gammas, normalize=normalize, grad_state=grad_state)
        got = run_linear_attention_backward(kernels, q, k, v, cos, sin, rows, go, threads=threads,
                                            shared_mem_limit=budget, **kw)
        want = reference(q, k, v, cos, sin, rows, go, **kw)
        pairs = list(zip(got[:3], want[:3])) + ([] if state is None else list(zip(got[3], want[3])))
        tol = 1e-9 if dtype == "float64" else 5e-5
        errors = [float(np.abs(np.float64(a) - np.float64(b)).max() / max(np.abs(np.float64(b)).max(), 1e-300))
                  for a, b in pairs]
        ok = max(errors) <= tol
        failures += not ok
        print(f"{'ok' if ok else 'FAIL'} linear backward {i}: B={B} T={T} H={Hk * G}/{Hk} m={m} dv={dv} {fmap} "
              f"causal={causal} decay={decay} normalize={normalize} chunk={chunk} threads={threads} budget={budget} "
              f"{dtype} {max(errors):.2g}", flush=True)
    return failures


def run_planted(kernels, name: str) -> None:
    from rotary.backends.cupy import Launch

    n = 8
    x = np.arange(n, dtype=np.float32)
    out = np.zeros(n, np.float32)
    plans = {
        "planted_race": Launch("planted", name, 1, n, 4 * n, (out, np.int32(n))),
        "planted_oob_read": Launch("planted", name, 1, n, 0, (x, out, np.int32(n))),
        "planted_unwritten_shared": Launch("planted", name, 1, n, 4 * (n + 1), (x, out, np.int32(n))),
        "planted_divergent_barrier": Launch("planted", name, 1, n, 0, (out, np.int32(n))),
        "planted_block_race": Launch("planted", name, 4, 2, 0, (out, np.int32(n))),
        "planted_int_overflow": Launch("planted", name, 1, n, 0, (out, np.int32(1 << 30))),
    }
    if name == "rope_short_table":  # a real kernel reading past its cos/sin table (a row index out of range)
        from rotary import RopeSpec
        from rotary.backends import cupy as cb
        from . import host

        spec = RopeSpec(16)
        cos, sin = (np.ascontiguousarray(a) for a in spec.cos_sin(np.arange(6), dtype=np.float32))
        x = np.ones((1, 8, 2, 16), np.float32)
        rows = np.arange(8, dtype=np.int64)[None]   # rows 6 and 7 are past the 6-row table
        plans[name] = cb.plan_rotate([(x, np.empty_like(x))], cos, sin, rows, dtype_name="float32", rotary_dim=16,
                                     layout="half", inverse=False, address=host.address, threads=32)
    for _ in range(3):  # a race need not show on the first run
        kernels.launch(plans[name])
    print("planted kernel ran without an error", out)


def main(argv=None) -> int:
    from . import host

    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=sorted(RUNTIMES))
    ap.add_argument("what")
    ap.add_argument("--slots", type=int, default=1)
    ap.add_argument("--guard", action="store_true")
    ap.add_argument("--compare", action="store_true")
    ap.add_argument("--dir", default=None)
    args = ap.parse_args(argv)
    kernels = host.build(Path(args.dir or default_dir()), sanitize=args.mode, planted=True, slots=args.slots,
                         guard=args.guard, compare=args.compare)
    if args.what.startswith("planted:"):
        run_planted(kernels, args.what.split(":", 1)[1])
        return 0
    failures = {"conformance": run_conformance, "direct": run_direct, "random": run_random,
                "kvcache": run_kvcache, "linear_backward": run_linear_backward}[args.what](kernels)
    print(f"{'OK' if not failures else 'FAILED'} {kernels.launches} launches, {failures} failures", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
