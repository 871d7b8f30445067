"""Numba kernels in forked children and from several threads (issue 14), and which kernel small calls take."""

from __future__ import annotations

import multiprocessing
import sys

import numpy as np
import pytest

import rotary
from rotary.testing import assert_close, linear_attention_quadratic, rope_complex

from .conftest import run_in_threads

numba_backend = pytest.importorskip("rotary.backends.numba", reason="numba not installed")
from rotary.backends import numba_runtime  # noqa: E402  (the size rule, the fork flag)

SPEC = rotary.RopeSpec(128, base=500000.0)
BIG = (1, 64, 32, 128)   # 262k elements: the parallel kernel in a parent process


def _rotation_error(seed: int) -> float:
    x = np.random.default_rng(seed).standard_normal(BIG).astype(np.float32)
    y = rotary.apply(x, 1000, spec=SPEC, seq_axis=1, backend="numba")
    want = np.moveaxis(rope_complex(np.moveaxis(x, 1, 2), np.arange(64) + 1000, SPEC.inv_freq()), 2, 1)
    return float(np.max(np.abs(y - want)))


def _linear_error(seed: int) -> float:
    r = np.random.default_rng(seed)
    q, k, v = (r.standard_normal((1, 200, 4, 16)).astype(np.float32) for _ in range(3))
    o = rotary.linear_attention(q, k, v, seq_axis=1, causal=True, backend="numba")
    want = linear_attention_quadratic(*(np.moveaxis(a, 1, 2) for a in (q, k, v)), np.arange(200),
                                      rotary.RopeSpec(16).inv_freq(), causal=True)
    return float(np.max(np.abs(np.moveaxis(o, 1, 2) - want)))


def _kv_error(seed: int) -> float:
    """The KV primitives at sizes that take their parallel kernels in a parent: an append (the reference's bits, or
    inf) and a decode step of paged attention (relative error against the float64 oracle)."""
    from .test_kv_cache_numba import _append_both, _check, _kv, _rel

    r = np.random.default_rng(seed)
    k, v = _kv(r, np.float32, 600, 8, 64, strided=False)
    got, want = _append_both(rotary.RopeSpec(64), k, v, r.integers(0, 4000, 600), r.permutation(700)[:600], "int8",
                             pool=700)
    if not all(np.array_equal(g.view(np.uint8), w.view(np.uint8)) for g, w in zip(got, want)):
        return float("inf")
    _check(r, np.float32, "int8", [300, 280, 310, 290], [1, 1, 1, 1], q_heads=8)   # asserts the tolerance
    return 0.0


def _child(seed: int) -> tuple:
    return _rotation_error(seed), _linear_error(seed), _kv_error(seed), numba_runtime.in_forked_child()


@pytest.mark.skipif(sys.platform == "win32" or "fork" not in multiprocessing.get_all_start_methods(),
                    reason="no fork start method")
def test_fork_pool_after_parallel_kernels():
    """The parent runs the parallel kernels (GNU OpenMP), then a fork pool runs them again: children used to
    die with "fork() called from a process already using GNU OpenMP"; now they rotate serially, correctly."""
    assert _rotation_error(0) < 2e-5 and _linear_error(0) < 1e-4 and _kv_error(0) == 0
    with multiprocessing.get_context("fork").Pool(2) as pool:
        results = pool.map_async(_child, range(3)).get(timeout=240)
    for rot, lin, kv, forked in results:
        assert rot < 2e-5 and lin < 1e-4 and kv == 0 and forked


def test_parallel_kernel_from_several_threads():
    results = []

    def work(seed):
        for _ in range(3):
            results.append(_rotation_error(seed))

    errors = run_in_threads(work, 3)
    assert not errors, errors[0]
    assert len(results) == 9 and all(e < 2e-5 for e in results), results


@pytest.mark.parametrize("shape, parallel", [((32, 1, 40, 128), True),      # decode B=32: DECODE_KERNEL "auto"
                                             ((32, 1, 40, 128), False),     # ... "serial"
                                             ((1, 1, 128, 128), False),     # one token, many heads
                                             ((1, 6, 32, 128), False),      # 6 tokens
                                             ((1, 64, 32, 128), True)])     # prefill
def test_which_kernel_a_call_takes(shape, parallel, monkeypatch):
    """The size rule: small calls stay on the calling thread; decode in the middle range as DECODE_KERNEL says."""
    from rotary.backends.numba_kernels import rotation as kernels

    if shape[1] == 1 and shape[0] == 32:
        monkeypatch.setattr(numba_runtime, "DECODE_KERNEL", "auto" if parallel else "serial")
        monkeypatch.setattr(numba_runtime, "_PASSIVE_WORKERS", False)

    used = []
    for name in ("rotate_qk_parallel", "rotate_qk_serial"):
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _real=real, _name=name: (used.append(_name), _real(*a))[1])
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    y = rotary.apply(x, seq_axis=1, backend="numba")
    assert used == ["rotate_qk_parallel" if parallel else "rotate_qk_serial"]
    assert_close(y, rotary.apply(x, seq_axis=1, backend="numpy"), like=x)


def test_the_size_rule_is_the_runtimes(monkeypatch):
    """One size rule for the rotation and the KV primitives: numba_runtime's, read by both at each call."""
    from rotary.backends import numba_kv
    from rotary.backends import numba_runtime as runtime

    monkeypatch.setattr(runtime, "PARALLEL_MIN_ELEMENTS", 1 << 62)
    assert numba_backend.rotate_kernel(1 << 20, 64, 1).__name__.endswith("serial")
    assert not runtime.parallel_by_size(1 << 20, 64, 1)
    assert numba_kv.runtime is runtime


def test_numpy_linear_attention_caps_the_chunk_at_T():
    """chunk=40000 with T=6 used to allocate a 40000 x 40000 mask (1.6 GB per temporary); now the chunk is T."""
    import tracemalloc

    r = np.random.default_rng(2)
    q, k, v = (r.standard_normal((1, 6, 2, 8)).astype(np.float32) for _ in range(3))
    tracemalloc.start()
    try:
        o = rotary.linear_attention(q, k, v, seq_axis=1, causal=True, chunk=40000, backend="numpy")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * 2**20, f"peak {peak / 2**20:.1f} MiB"
    np.testing.assert_array_equal(o, rotary.linear_attention(q, k, v, seq_axis=1, causal=True, chunk=6,
                                                             backend="numpy"))


# -- issue 25: one Rope / one spec from 8 threads, spawn after parallel Numba use, cache eviction under load --
def _exact(x, positions, spec):
    """float64 oracle of apply for (B, H, S, D) x at (S,) positions."""
    from . import _props

    return _props.spec_oracle(x, positions, spec)


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_one_rope_and_one_spec_from_8_threads(backend):
    """8 threads share one Rope (its table grows: each thread moves to positions far beyond the others')
    and one spec (rotary.apply, the shared table cache); every result equals the serial call's."""
    spec = rotary.RopeSpec(32, base=10000.0, layout="interleaved")
    rope = rotary.Rope(spec, backend=backend, dtype=np.float32, max_positions=16, seq_axis=-2)
    rng = np.random.default_rng(8)
    plans = []   # per thread: (q, k, [positions offsets]) -- growing and jumping
    for i in range(8):
        q = rng.standard_normal((1, 4, 3, 32)).astype(np.float32)
        k = rng.standard_normal((1, 2, 3, 32)).astype(np.float32)
        offsets = [i * 37 + step * (1 + i) ** 3 for step in range(12)] + [10**6 * (i + 1), 5]
        plans.append((q, k, offsets))
    serial = [[(rotary.apply_qk(q, k, p, spec=spec, backend=backend, seq_axis=-2)) for p in offsets] for q, k, offsets in plans]
    results = [[None] * len(plans[i][2]) for i in range(8)]

    def work(i):
        q, k, offsets = plans[i]
        for j, p in enumerate(offsets):
            qr, kr = rope(q, k, p) if j % 2 == 0 else rotary.apply_qk(q, k, p, spec=spec, backend=backend, seq_axis=-2)
            results[i][j] = (qr.copy(), kr.copy())

    errors = run_in_threads(work, 8)
    assert not errors, errors[0]
    for i in range(8):
        for j, p in enumerate(plans[i][2]):
            for got, want in zip(results[i][j], serial[i][j]):
                np.testing.assert_array_equal(got, want)
        q, k, offsets = plans[i]
        np.testing.assert_allclose(results[i][-2][0], _exact(q, np.arange(3) + offsets[-2], spec), atol=2e-5, rtol=2e-5)


def test_table_cache_under_concurrent_eviction():
    """Threads rotate at many positions while another shrinks, restores and clears the table cache: every
    result is right (entries evicted under a reader are never half-used), the cache ends within its limit."""
    from rotary.spec import tables

    spec = rotary.RopeSpec(16, base=500000.0)
    x = np.random.default_rng(3).standard_normal((2, 5, 16))
    offsets = [0, 7, 4096, 123_457, 2**31, 9, 65_536 * 3]
    want = {p: _exact(x[None], np.arange(5) + p, spec)[0] for p in offsets}
    stop = []
    previous = rotary.set_table_cache_limit(1 << 20)

    def evictor():
        limits = [0, 1 << 12, 1 << 20, 1 << 16]
        n = 0
        while not stop:
            rotary.set_table_cache_limit(limits[n % len(limits)])
            if n % 5 == 0:
                rotary.clear_cache()
            n += 1

    import threading

    t = threading.Thread(target=evictor)
    t.start()
    try:
        def work(i):
            for rep in range(30):
                p = offsets[(i + rep) % len(offsets)]
                np.testing.assert_allclose(rotary.apply(x, p, spec=spec, backend="numpy", seq_axis=-2), want[p], atol=1e-12,
                                           rtol=1e-12)

        errors = run_in_threads(work, 6)
    finally:
        stop.append(True)
        t.join(timeout=60)
        rotary.set_table_cache_limit(previous)
    assert not errors, errors[0]
    info = rotary.table_cache_info()
    assert info["bytes"] <= info["limit"]
    assert tables._state["bytes"] == sum(nbytes for _, nbytes in tables._cache.values())


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_process_pools_after_parallel_numba_use(method):
    """The parent runs the parallel kernels, then a pool of the given start method runs them: no hang (the
    pool's results arrive within the timeout) and the children's results are right."""
    if method not in multiprocessing.get_all_start_methods():
        pytest.skip(f"no {method} start method")
    assert _rotation_error(1) < 2e-5 and _linear_error(1) < 1e-4
    with multiprocessing.get_context(method).Pool(2) as pool:
        results = pool.map_async(_child, range(2)).get(timeout=240)
    for rot, lin, kv, forked in results:
        assert rot < 2e-5 and lin < 1e-4 and kv == 0
        assert forked == (method == "fork")
