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


def _child(seed: int) -> tuple:
    return _rotation_error(seed), _linear_error(seed), numba_backend._in_forked_child


@pytest.mark.skipif(sys.platform == "win32" or "fork" not in multiprocessing.get_all_start_methods(),
                    reason="no fork start method")
def test_fork_pool_after_parallel_kernels():
    """The parent runs the parallel kernels (GNU OpenMP), then a fork pool runs them again: children used to
    die with "fork() called from a process already using GNU OpenMP"; now they rotate serially, correctly."""
    assert _rotation_error(0) < 2e-5 and _linear_error(0) < 1e-4
    with multiprocessing.get_context("fork").Pool(2) as pool:
        results = pool.map_async(_child, range(3)).get(timeout=240)
    for rot, lin, forked in results:
        assert rot < 2e-5 and lin < 1e-4 and forked


def test_parallel_kernel_from_several_threads():
    results = []

    def work(seed):
        for _ in range(3):
            results.append(_rotation_error(seed))

    errors = run_in_threads(work, 3)
    assert not errors, errors[0]
    assert len(results) == 9 and all(e < 2e-5 for e in results), results


@pytest.mark.parametrize("shape, parallel", [((32, 1, 40, 128), False),     # decode B=32: one token each
                                             ((1, 1, 128, 128), False),     # one token, many heads
                                             ((1, 6, 32, 128), False),      # 6 tokens
                                             ((1, 64, 32, 128), True)])     # prefill
def test_small_and_one_token_calls_stay_on_the_calling_thread(shape, parallel, monkeypatch):
    from rotary.backends.numba_kernels import rotation as kernels

    used = []
    for name in ("rotate_qk_parallel", "rotate_qk_serial"):
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _real=real, _name=name: (used.append(_name), _real(*a))[1])
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    y = rotary.apply(x, seq_axis=1, backend="numba")
    assert used == ["rotate_qk_parallel" if parallel else "rotate_qk_serial"]
    assert_close(y, rotary.apply(x, seq_axis=1, backend="numpy"), like=x)


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
