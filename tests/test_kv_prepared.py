"""The KV primitives prepared once per step and run per layer (``rotary.prepare_kv_append``,
``rotary.prepare_paged_attention``), over every backend (NumPy, Numba, the CUDA kernels on the host shim): each
layer's keys and attention against the float64 oracles and bit for bit the stateless call's, the caller's tables
copied when preparing, and every run of another geometry, overlapping memory or bad norm refused with the
argument's name and nothing written."""

from __future__ import annotations

import numpy as np
import pytest

import rotary

from .test_kv_primitives import (ATTENTION_TOL, backend, entry_error, filled, grid, make_pools,  # noqa: F401
                                 oracle_paged, oracle_rotate, skip_unsupported)
from rotary.testing import dequantize64

FORMATS = [None, "int8"]


def norm64(x, w, eps=1e-6):
    x = np.asarray(x, np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * np.asarray(w, np.float64)


@grid
@pytest.mark.parametrize("kv_dtype", FORMATS, ids=str)
def test_prepared_append_writes_each_layers_keys(backend, kv_dtype, rng):
    """Three layers through one prepared append (vLLM's slot_mapping with a padding token, each layer its own pools
    and k_norm): every layer's entries within the format's rounding of its float64 normed and rotated keys, bit for
    bit the stateless kv_append's; changing the caller's slots and positions after preparing changes nothing."""
    skip_unsupported(np.float32, kv_dtype)
    spec = rotary.RopeSpec(32, base=1000.0)
    L, T, H = 3, 7, 2
    pools = [make_pools(np.random.default_rng(i), 6, 4, H, 32, np.float32, kv_dtype) for i in range(L)]
    again = [make_pools(np.random.default_rng(i), 6, 4, H, 32, np.float32, kv_dtype) for i in range(L)]
    slots = rng.permutation(24)[:T]
    slots[3] = -1
    positions = rng.integers(0, 3000, T)
    ks = [rng.standard_normal((T, H, 32)).astype(np.float32) for _ in range(L)]
    vs = [rng.standard_normal((T, H, 32)).astype(np.float32) for _ in range(L)]
    weights = [(1 + 0.2 * rng.standard_normal(32)).astype(np.float32) for _ in range(L)]
    want_slots, want_positions = slots.copy(), positions.copy()
    append = rotary.prepare_kv_append(ks[0], vs[0], pools[0][0], pools[0][1], want_slots, want_positions, spec=spec,
                                      scales=pools[0][2], kv_dtype=kv_dtype, backend=backend)
    want_slots[:], want_positions[:] = 0, 0   # (copied when preparing)
    real = slots >= 0
    flat = lambda a: a.reshape((-1,) + a.shape[2:])   # noqa: E731
    for i in range(L):
        append(ks[i], vs[i], *pools[i], k_norm=weights[i])
        rotary.kv_append(ks[i], vs[i], again[i][0], again[i][1], slots, positions, spec=spec, scales=again[i][2],
                         kv_dtype=kv_dtype, backend=backend, k_norm=weights[i])
        k_pool, v_pool, scales = pools[i]
        for a, b in zip((k_pool, v_pool) + (scales or ()), again[i][:2] + (again[i][2] or ())):
            np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
        want_k = oracle_rotate(norm64(ks[i], weights[i]), positions, spec)[real]
        got = dequantize64(flat(k_pool)[slots[real]], None if scales is None else flat(scales[0])[slots[real]],
                           kv_dtype)
        assert np.all(np.abs(got - want_k) <= entry_error(kv_dtype, np.float32, np.abs(want_k).max(-1, keepdims=True))
                      + 1e-6 * np.abs(want_k).max())


@grid
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_prepared_attention_reads_each_layers_pools(backend, packed, rng):
    """Two layers' pools (a shared page, a GQA group of 2) through one prepared attention (q rotated at each
    sequence's last positions, each layer its own q_norm, dense (n, s, ...) or packed with cu_seqlens): each
    layer's output within float32 rounding of the float64 oracle and bit for bit the stateless paged_attention's;
    read-only pools are read; changing the caller's table afterwards changes nothing."""
    spec = rotary.RopeSpec(32, base=1000.0)
    k_pool, v_pool, _, table, lens = filled(rng, backend, dtype=np.float32, kv_dtype=None, spec=spec)
    other = [(a + rng.standard_normal(a.shape)).astype(np.float32) for a in (k_pool, v_pool)]   # layer 1's pools
    layers = [(k_pool, v_pool), tuple(other)]
    s = 2
    counts = np.full(lens.size, s)
    counts[2] = 1   # (sequence 2 holds one token)
    if packed:
        cu = np.concatenate([[0], np.cumsum(counts)])
        qs = [rng.standard_normal((int(cu[-1]), 4, 32)).astype(np.float32) for _ in range(2)]
        kw = dict(cu_seqlens=cu)
    else:
        counts[:] = 1
        qs = [rng.standard_normal((lens.size, 1, 4, 32)).astype(np.float32) for _ in range(2)]
        kw = {}
    weights = [(1 + 0.2 * rng.standard_normal(32)).astype(np.float32) for _ in range(2)]
    caller_table = table.copy()
    attend = rotary.prepare_paged_attention(qs[0], layers[0][0], layers[0][1], caller_table, lens, spec=spec,
                                            backend=backend, **kw)
    caller_table[:] = -1   # (copied when preparing)
    for i, (k_pool, v_pool) in enumerate(layers):
        k_pool.flags.writeable = v_pool.flags.writeable = False
        o = attend(qs[i], k_pool, v_pool, q_norm=weights[i])
        ref = rotary.paged_attention(qs[i], k_pool, v_pool, table, lens, spec=spec, backend=backend,
                                     q_norm=weights[i], **kw)
        np.testing.assert_array_equal(o, ref)
        qp = qs[i].reshape(-1, 4, 32)
        want = oracle_paged(norm64(qp, weights[i]), counts, k_pool, v_pool, None, table, lens, None, spec,
                            scale=32 ** -0.5)
        np.testing.assert_allclose(o.reshape(qp.shape), want, rtol=0,
                                   atol=ATTENTION_TOL[np.float32] * 4 * np.abs(want).max())


@grid
def test_prepared_attention_keeps_its_query_positions(backend, rng):
    """q rotated at given q_positions (the caller's int64 array): changing it after preparing changes nothing."""
    spec = rotary.RopeSpec(32, base=1000.0)
    k_pool, v_pool, _, table, lens = filled(rng, backend, dtype=np.float32, kv_dtype=None, spec=spec)
    q = rng.standard_normal((lens.size, 1, 4, 32)).astype(np.float32)
    positions = (lens - 1)[:, None].astype(np.int64) + 7   # (dense: (n, s))
    want = rotary.paged_attention(q, k_pool, v_pool, table, lens, spec=spec, q_positions=positions.copy(),
                                  backend=backend)
    attend = rotary.prepare_paged_attention(q, k_pool, v_pool, table, lens, spec=spec, q_positions=positions,
                                            backend=backend)
    positions[:] = 0
    np.testing.assert_array_equal(attend(q, k_pool, v_pool), want)


def _append_and_pools(rng, backend, kv_dtype=None):
    spec = rotary.RopeSpec(32, base=1000.0)
    k_pool, v_pool, scales = make_pools(rng, 6, 4, 2, 32, np.float32, kv_dtype)
    k = rng.standard_normal((3, 2, 32)).astype(np.float32)
    append = rotary.prepare_kv_append(k, k.copy(), k_pool, v_pool, np.array([0, 5, 9]), np.arange(3), spec=spec,
                                      scales=scales, kv_dtype=kv_dtype, backend=backend)
    return append, k, k_pool, v_pool, scales


RUN_ERRORS = {   # name: (the run's arguments from (k, k_pool, v_pool), error, message)
    "k of another shape": (lambda k, kp, vp: (k[:2], k[:2], kp, vp), ValueError, r"^k is .* \(2, 2, 32\).*prepared for"),
    "v strided otherwise": (lambda k, kp, vp: (k, np.asfortranarray(k), kp, vp), ValueError, r"^v is .*strides"),
    "k float64": (lambda k, kp, vp: (k.astype(np.float64), k, kp, vp), ValueError, r"^k is .*float64"),
    "k a list": (lambda k, kp, vp: (k.tolist(), k, kp, vp), ValueError, r"^k is not an array"),
    "a smaller k_pool": (lambda k, kp, vp: (k, k, kp[:3], vp), ValueError, r"^k_pool is .*\(3, 4, 2, 32\)"),
    "v_pool float64": (lambda k, kp, vp: (k, k, kp, vp.astype(np.float64)), ValueError, r"^v_pool is .*float64"),
    "k a view of k_pool": (lambda k, kp, vp: (kp[0, :3], k, kp, vp), ValueError, "k shares memory with k_pool"),
    "v a view of v_pool": (lambda k, kp, vp: (k, vp[1, :3], kp, vp), ValueError, "v shares memory with v_pool"),
    "scales without a quantized format": (lambda k, kp, vp: (k, k, kp, vp, (kp, vp)), ValueError,
                                          "scales goes with a quantized kv_dtype"),
}


@grid
@pytest.mark.parametrize("case", list(RUN_ERRORS))
def test_prepared_append_refuses_runs_of_another_geometry(backend, case, rng):
    """A run whose arrays or pools differ from the prepared ones (shape, dtype, strides, type), whose k or v
    overlaps the pools, or with scales it was not prepared for: a clear error naming the argument, the pools bit for
    bit unchanged."""
    append, k, k_pool, v_pool, _ = _append_and_pools(rng, backend)
    make, error, match = RUN_ERRORS[case]
    before = k_pool.copy(), v_pool.copy()
    with pytest.raises(error, match=match):
        append(*make(k.copy(), k_pool, v_pool))
    np.testing.assert_array_equal(k_pool, before[0])
    np.testing.assert_array_equal(v_pool, before[1])


def test_prepared_runs_refuse_missing_scales_read_only_pools_and_bad_norms(rng):
    """An int8 append run without its scales, an append into a read-only pool, a bad k_norm, and a prepared
    attention given q of another shape or pools of another geometry: errors naming the argument."""
    append, k, k_pool, v_pool, scales = _append_and_pools(rng, "numpy", "int8")
    with pytest.raises(ValueError, match=r"scales must be \(k_scales, v_scales\) as prepared"):
        append(k, k, k_pool, v_pool)
    with pytest.raises(TypeError, match="scales must be"):
        append(k, k, k_pool, v_pool, scales[0])
    with pytest.raises(ValueError, match=r"k_norm must have shape \(32,\)"):
        append(k, k, k_pool, v_pool, scales, k_norm=np.ones(31, np.float32))
    append, k, k_pool, v_pool, _ = _append_and_pools(rng, "numpy")
    v_pool.flags.writeable = False
    with pytest.raises(ValueError, match="v_pool is read-only"):
        append(k, k, k_pool, v_pool)
    q = rng.standard_normal((2, 1, 4, 32)).astype(np.float32)
    attend = rotary.prepare_paged_attention(q, k_pool, v_pool, np.array([[0], [1]]), np.array([1, 1]))
    with pytest.raises(ValueError, match=r"^q is .*\(2, 2, 4, 32\)"):
        attend(np.concatenate([q, q], axis=1), k_pool, v_pool)
    with pytest.raises(ValueError, match=r"^v_pool is .*\(5, 4, 2, 32\)"):
        attend(q, k_pool, v_pool[:5])
    with pytest.raises(ValueError, match="q_norm"):
        attend(q, k_pool, v_pool, q_norm=np.ones((2, 32), np.float32))


def test_preparing_checks_what_the_stateless_calls_check(rng):
    """Preparing raises what the stateless call raises for its arguments (slots outside the pools, a page the pool
    does not have): the same checks, made once."""
    append, k, k_pool, v_pool, _ = _append_and_pools(rng, "numpy")
    spec = rotary.RopeSpec(32, base=1000.0)
    with pytest.raises(ValueError, match=r"slots\[1\] = 24 is outside"):
        rotary.prepare_kv_append(k, k, k_pool, v_pool, np.array([0, 24, 2]), np.arange(3), spec=spec)
    q = rng.standard_normal((1, 1, 4, 32)).astype(np.float32)
    with pytest.raises(ValueError, match=r"block_table\[0, 0\] = 6 is not a page"):
        rotary.prepare_paged_attention(q, k_pool, v_pool, np.array([[6]]), np.array([1]))
