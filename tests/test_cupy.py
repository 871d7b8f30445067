"""The CuPy backend on a real GPU (skipped cleanly without CuPy or a CUDA device)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import rotary
from rotary import RopeSpec
from rotary.spec import tables as _tables
from rotary.backends import cupy as cb
from rotary.testing import rope_complex, tolerance

from .test_cuda_kernels_cpu import la_oracle

pytestmark = pytest.mark.gpu


def test_availability_says_why_not():
    ok, reason = cb.availability()
    assert isinstance(ok, bool) and isinstance(reason, str) and reason
    if not ok:
        assert "CuPy" in reason or "CUDA" in reason
    assert not cb.accepts(np.zeros(3))


def test_import_compiles_nothing():
    """Importing the backend module imports no CuPy (so it compiles nothing)."""
    code = "import sys, rotary, rotary.backends.cupy as cb; assert 'cupy' not in sys.modules; print(cb.NAME)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "cupy", proc.stderr


@pytest.fixture(scope="module")
def cupy():
    cp = pytest.importorskip("cupy")
    ok, reason = cb.availability()
    if not ok:
        pytest.skip(reason)
    return cp


def _oracle(x, positions, spec, inverse=False):
    """float64 oracle for (B, S, H, D)."""
    xs = np.moveaxis(np.asarray(x, np.float64), 2, 1)
    p = np.asarray(positions)
    p = p[:, None, :] if p.ndim == 2 else p
    inv = spec.inv_freq()
    return np.moveaxis(rope_complex(xs, p, -inv if inverse else inv, layout=spec.layout), 1, 2)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("head_dim,rotary_dim", [(128, 128), (80, 80), (24, 12), (19, 18)])
def test_apply_qk_gqa(cupy, layout, dtype, head_dim, rotary_dim):
    rng = np.random.default_rng(0)
    B, S = 3, 37
    spec = RopeSpec(head_dim, rotary_dim=rotary_dim, layout=layout)
    q = rng.standard_normal((B, S, 8, head_dim)).astype(dtype)
    k = rng.standard_normal((B, S, 2, head_dim)).astype(dtype)
    pos = rng.integers(0, 5000, size=(B, S))
    qd, kd = cupy.asarray(q), cupy.asarray(k)
    qr, kr = rotary.apply_qk(qd, kd, pos, spec=spec, seq_axis=-3, backend="cupy")
    assert isinstance(qr, cupy.ndarray) and qr.dtype == qd.dtype and qr.device == qd.device
    rtol, atol = tolerance(dtype)
    np.testing.assert_allclose(cupy.asnumpy(qr).astype(np.float64), _oracle(q, pos, spec), rtol=rtol, atol=atol)
    np.testing.assert_allclose(cupy.asnumpy(kr).astype(np.float64), _oracle(k, pos, spec), rtol=rtol, atol=atol)
    np.testing.assert_array_equal(cupy.asnumpy(qd), q)  # inputs untouched


def test_in_place_strided_inverse_and_stream(cupy):
    rng = np.random.default_rng(1)
    spec = RopeSpec(64)
    full = cupy.asarray(rng.standard_normal((2, 50, 4, 128)).astype(np.float32))
    x = full[..., ::2][:, ::-1]          # non-contiguous, reversed sequence
    x0 = cupy.asnumpy(x)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        y = rotary.apply(x, 7, spec=spec, seq_axis=-3, backend="cupy")
        rotary.apply(y, 7, spec=spec, seq_axis=-3, inverse=True, out=y, backend="cupy")
    stream.synchronize()
    np.testing.assert_allclose(cupy.asnumpy(y), x0, rtol=1e-5, atol=1e-5)


def test_huge_positions_and_table_cache(cupy):
    spec = RopeSpec(64)
    x = cupy.ones((1, 4, 1, 64), dtype=cupy.float32)
    pos = np.array([2**31 - 1, 2**40, 3, 0])
    y = rotary.apply(x, pos, spec=spec, seq_axis=-3, backend="cupy")
    np.testing.assert_allclose(cupy.asnumpy(y), _oracle(np.ones((1, 4, 1, 64)), pos, spec), rtol=2e-6, atol=2e-6)
    rotary.apply(x, None, spec=spec, seq_axis=-3, backend="cupy")
    assert any(key[-1] == ("cupy", x.device.id) for key in _tables._cache)


def test_more_than_2_31_elements(cupy):
    """int64 indexing: a 2**31 + 1024 element fp16 tensor, rotated in place; the last tokens checked."""
    free, _ = cupy.cuda.runtime.memGetInfo()
    if free < 6 * 2**30:
        pytest.skip("needs 6 GiB of free GPU memory")
    S = 2**31 // (8 * 128) + 1
    x = cupy.ones((1, S, 8, 128), dtype=cupy.float16)
    rotary.apply(x, None, spec=RopeSpec(128), seq_axis=-3, out=x, backend="cupy")
    tail = cupy.asnumpy(x[:, -2:])
    ref = _oracle(np.ones((1, 2, 8, 128)), np.arange(S - 2, S), RopeSpec(128))
    np.testing.assert_allclose(tail.astype(np.float64), ref, rtol=2e-3, atol=2e-3)
    del x


def test_torch_cuda_tensors_zero_copy(cupy):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    rng = np.random.default_rng(2)
    spec = RopeSpec(64)
    for dtype, tol in ((torch.float32, 2e-6), (torch.bfloat16, 1.6e-2), (torch.float16, 2e-3)):
        q = torch.tensor(rng.standard_normal((2, 9, 4, 64)), dtype=dtype, device="cuda")
        k = torch.tensor(rng.standard_normal((2, 9, 1, 64)), dtype=dtype, device="cuda")
        qr, kr = rotary.apply_qk(q, k, 3, spec=spec, seq_axis=-3, backend="cupy")
        assert isinstance(qr, torch.Tensor) and qr.dtype == dtype and qr.device == q.device
        ref = _oracle(q.float().cpu().numpy(), np.arange(9) + 3, spec)
        np.testing.assert_allclose(qr.float().cpu().numpy(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("float64", 1e-12), ("float16", 1e-3)])
def test_linear_attention_primitive(cupy, causal, dtype, tol):
    rng = np.random.default_rng(3)
    B, T, H, m, dv = 2, 300, 3, 64, 48
    spec = RopeSpec(m)
    work = np.float64 if dtype == "float64" else np.float32
    cos, sin = spec.cos_sin(np.arange(T), dtype=work)
    q, k, v = (rng.standard_normal((B, T, H, d)).astype(dtype) for d in (m, m, dv))
    o, (S, z) = cb.linear_attention(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), cupy.asarray(cos),
                                    cupy.asarray(sin), cupy.arange(T, dtype=cupy.int64)[None], rotary_dim=m,
                                    layout="half", causal=causal, feature_map="elu", eps=1e-6, chunk=64, state=None)
    ref, (S_ref, z_ref) = la_oracle(q, k, v, np.arange(T), spec, causal=causal, feature_map="elu", eps=1e-6)
    rel = lambda a, b: np.linalg.norm(cupy.asnumpy(a).astype(np.float64) - b) / np.linalg.norm(b)
    assert o.dtype == q.dtype and S.dtype == work and z.dtype == work
    assert rel(o, ref) < tol and rel(S, S_ref) < max(tol, 1e-6) and rel(z, z_ref) < max(tol, 1e-6)


def test_out_overlapping_the_other_input_is_an_error(cupy):
    """apply_qk rotates q and k in one launch: an out for q that is k (or overlaps it) would race."""
    rng = np.random.default_rng(3)
    qkv = cupy.asarray(rng.standard_normal((1, 6, 3, 2, 32)).astype(np.float32))
    q, k = qkv[:, :, 0], qkv[:, :, 1]
    with pytest.raises(ValueError, match="overlaps"):
        rotary.apply_qk(q, k, out=(k, q), seq_axis=1, backend="cupy")
    before = cupy.asnumpy(qkv)
    q_rot, k_rot = rotary.apply_qk(q, k, out=(q, k), seq_axis=1, backend="cupy")   # fused-qkv in place: fine
    assert q_rot is q and k_rot is k
    np.testing.assert_array_equal(cupy.asnumpy(qkv[:, :, 2]), before[:, :, 2])   # v untouched


# -- the KV primitives on the GPU (tests/test_kv_cache_cuda_shim.py runs the same kernels on the host shim) ------
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_kv_append_keys_are_rotated_keys_bit_for_bit(cupy, dtype, layout):
    """The rounding contract on the device: rope_rotate's rotation and kv_append's keys (float entries) are the
    same bits, and both are NumPy's (x_a c - x_b s in the work dtype, each product and sum rounded alone: no FMA,
    then one rounding to the dtype); padding slots (-1) are skipped, other slots left alone."""
    rng = np.random.default_rng(4)
    T, H, D = 40, 4, 64
    spec = RopeSpec(D, layout=layout)
    work = np.float64 if dtype == "float64" else np.float32
    cos, sin = (np.ascontiguousarray(a) for a in spec.cos_sin(np.arange(4096), dtype=work))
    rows = rng.integers(0, 4096, T)
    k = rng.standard_normal((T, H, D)).astype(dtype)
    ia = 2 * np.arange(D // 2) if layout == "interleaved" else np.arange(D // 2)
    ib = ia + (1 if layout == "interleaved" else D // 2)
    w, c, s = k.astype(work), cos[rows][:, None], sin[rows][:, None]
    y = w.copy()
    y[..., ia], y[..., ib] = w[..., ia] * c - w[..., ib] * s, w[..., ib] * c + w[..., ia] * s
    want = y.astype(dtype)
    cos_d, sin_d = cupy.asarray(cos), cupy.asarray(sin)
    (rot,) = cb.rotate([(cupy.asarray(k[None]), None)], cos_d, sin_d, cupy.asarray(rows[None]), rotary_dim=D,
                       layout=layout, inverse=False)
    slots = rng.permutation(T + 8)[:T]
    slots[::7] = -1
    stores = (cupy.full((T + 8, H, D), np.nan, dtype), cupy.full((T + 8, H, D), np.nan, dtype), None, None)
    cb.append_kv(cupy.asarray(k), cupy.asarray(k), cos_d, sin_d, cupy.asarray(rows), cupy.asarray(slots), stores,
                 rotary_dim=D, layout=layout, offset=0, kv_dtype=None)
    np.testing.assert_array_equal(cupy.asnumpy(rot)[0].view(np.uint8), want.view(np.uint8))
    entries, keep = cupy.asnumpy(stores[0]), slots >= 0
    np.testing.assert_array_equal(entries[slots[keep]].view(np.uint8), want[keep].view(np.uint8))
    assert np.isnan(np.delete(entries, slots[keep], axis=0)).all()


KV_GPU_FORMATS = [("float32", None), ("float32", "int8"), ("float32", "float8_e4m3"), ("float16", None),
                  ("float16", "int8"), ("float16", "float8_e4m3"), ("float64", None), ("float64", "int8")]


@pytest.mark.parametrize("dtype,kv_dtype", KV_GPU_FORMATS, ids=[f"{d}-{k}" for d, k in KV_GPU_FORMATS])
def test_kv_primitives_on_the_gpu(cupy, dtype, kv_dtype):
    """cb.append_kv replays a paged pool's appends (packed prefill, decode steps, padding, a forked page) bit for bit
    the reference's; cb.paged_attention over it (GQA, mixed prefill + decode in one launch, dense decode, window,
    softcap, non-causal) against the float64 oracle of tests/test_kv_cache_cuda_shim.py."""
    from .test_kv_cache_cuda_shim import ATTENTION_CASES, SEQ_LENS, SHARED, Pool, assert_close, assert_same_bits, oracle

    pool = Pool(None, dtype=dtype, kv_dtype=kv_dtype, seq_lens=SEQ_LENS, shared=SHARED, seed=5)
    dev = tuple(None if a is None else cupy.asarray(a) for a in pool.initial)
    cos, sin = (cupy.asarray(a) for a in pool.tables)
    for k, v, rows, slots in pool.batches:
        cb.append_kv(cupy.asarray(k), cupy.asarray(v), cos, sin, cupy.asarray(rows), cupy.asarray(slots), dev,
                     rotary_dim=pool.spec.rotary_dim, layout=pool.spec.layout, offset=pool.spec.rotary_offset,
                     kv_dtype=kv_dtype)
    assert_same_bits([None if a is None else cupy.asnumpy(a) for a in dev], pool.stores)
    rng = np.random.default_rng(6)
    for case, (seqs, counts, kw) in ATTENTION_CASES.items():
        q = rng.standard_normal((sum(counts), 4, 32)).astype(dtype)
        kw = dict(dict(scale=32 ** -0.5, softcap=None, window=None, causal=True), **kw)
        table, lens, starts = pool.block_table[seqs], pool.seq_lens[seqs], pool.q_starts(counts)
        o = cb.paged_attention(cupy.asarray(q), dev, cupy.asarray(table), pool.page_size, cupy.asarray(lens),
                               cupy.asarray(starts), kv_dtype=kv_dtype, **kw)
        want = oracle(q, pool.stores, table, pool.page_size, lens, starts, kv_dtype=kv_dtype, **kw)
        assert_close(cupy.asnumpy(o), want, dtype)


@pytest.mark.parametrize("dtype,kv_dtype", [("float16", None), ("float32", "int8"), ("float16", "float8_e4m3")],
                         ids=["float16-None", "float32-int8", "float16-float8_e4m3"])
def test_paged_attention_gqa_and_splits_on_the_gpu(cupy, dtype, kv_dtype):
    """The block per (q row, kv head) and split-K on the device (cp.async staging on sm_80+): GQA 1, 4, 8 and 9 (two
    head chunks) with 1, 2 and 7 forced splits (empty ones among them) and the split rule's own choice, over a pool
    the reference append filled, against the float64 oracle; the rule splits a long batch-1 decode."""
    from .test_kv_cache_cuda_shim import Pool, assert_close, kernels_of, oracle

    pool = Pool(None, dtype=dtype, kv_dtype=kv_dtype, seq_lens=[23, 0, 9, 1, 40], page_size=4, seed=21)
    dev = tuple(None if a is None else cupy.asarray(a) for a in pool.stores)
    rows, counts = [0, 1, 2, 3, 4], [3, 0, 1, 1, 5]
    table, lens, starts = pool.block_table[rows], pool.seq_lens[rows], pool.q_starts(counts)
    rng = np.random.default_rng(8)
    for group, splits, window in ((1, 7, None), (4, 2, 13), (8, 1, None), (9, 7, None), (4, None, 6)):
        q = rng.standard_normal((sum(counts), 2 * group, 32)).astype(dtype)
        o = cupy.empty(q.shape, q.dtype)
        kw = dict(scale=32 ** -0.5, softcap=None, window=window, causal=True)
        plan = cb.plan_paged_attention(cupy.asarray(q), o, dev, cupy.asarray(table), pool.page_size,
                                       cupy.asarray(lens), cupy.asarray(starts), dtype_name=dtype, kv_dtype=kv_dtype,
                                       splits=splits, empty=cupy.empty, **kw)
        assert tuple(launch.kernel for launch in plan.launches) == kernels_of(dtype, kv_dtype, plan.geometry.splits)
        for launch in plan.launches:
            cb._launch(launch, dtype)
        want = oracle(q, pool.stores, table, pool.page_size, lens, starts, kv_dtype=kv_dtype, **kw)
        assert_close(cupy.asnumpy(o), want, dtype)
    # batch 1, 1000 keys (64 pages of 16 in the table): the rule splits through cb.paged_attention (the combine
    # over a workspace from cupy.empty)
    long = Pool(None, dtype=dtype, kv_dtype=kv_dtype, seq_lens=[1000], page_size=16, kv_heads=2, seed=2)
    dev = tuple(None if a is None else cupy.asarray(a) for a in long.stores)
    q = rng.standard_normal((1, 8, 32)).astype(dtype)
    kw = dict(scale=32 ** -0.5, softcap=None, window=None, causal=True)
    starts = np.array([0, 1], np.int64)
    o = cb.paged_attention(cupy.asarray(q), dev, cupy.asarray(long.block_table), 16, cupy.asarray(long.seq_lens),
                           cupy.asarray(starts), kv_dtype=kv_dtype, **kw)
    assert cb.paged_attention_splits(2, long.block_table.shape[1] * 16) > 1
    assert_close(cupy.asnumpy(o), oracle(q, long.stores, long.block_table, 16, long.seq_lens, starts,
                                         kv_dtype=kv_dtype, **kw), dtype)
