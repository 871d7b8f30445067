"""Dask arrays: lazy, one task per block on the backends' kernels, a state prefix for linear attention."""

import numpy as np
import pytest

import rotary
from rotary.testing import assert_close, linear_attention_quadratic, rope_complex

from .conftest import AVAILABLE

da = pytest.importorskip("dask.array")
dask = pytest.importorskip("dask")
CPU_BACKENDS = [b for b in ("numba", "numpy") if b in AVAILABLE]
SPEC = rotary.RopeSpec(32, base=10000.0)


def _data(seed=0, T=96, H=3, Hk=None, d=32, dv=8, dtype=np.float32):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, T, H, d)).astype(dtype)
    k = rng.standard_normal((2, T, Hk or H, d)).astype(dtype)
    v = rng.standard_normal((2, T, Hk or H, dv)).astype(dtype)
    return q, k, v


def _oracle_bshd(x, positions, spec=SPEC):
    p = np.asarray(positions)
    y = rope_complex(np.moveaxis(x.astype(np.float64), 2, 1), p[:, None] if p.ndim == 2 else p, spec.inv_freq(),
                     layout=spec.layout, scale=spec.attention_scaling)
    return np.moveaxis(y, 1, 2)


def _la_oracle(q, k, v, causal, positions=None):
    T = q.shape[1]
    groups = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, groups, axis=2), np.repeat(v, groups, axis=2)
    o = linear_attention_quadratic(*(np.moveaxis(a, 2, 1) for a in (q, k, v)),
                                   np.arange(T) if positions is None else positions, SPEC.inv_freq(), causal=causal)
    return np.moveaxis(o, 1, 2)


@pytest.mark.interop("Dask (NumPy chunks)", "cpu", "numba, numpy", "threaded scheduler")
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_rotation_blockwise_matches_oracle(backend):
    q, k, _ = _data(1, Hk=1)
    pos = np.random.default_rng(2).integers(0, 2**31 - 1, size=(2, 96))
    for chunks in ((1, 32, 3, 32), (2, (10, 50, 36), 1, 32)):
        dq = da.from_array(q, chunks=chunks)
        dk = da.from_array(k, chunks=(1, 24, 1, 32))
        for p in (pos, da.from_array(pos, chunks=(1, 48)), pos[0], None, 7):
            qr, kr = rotary.apply_qk(dq, dk, p, spec=SPEC, seq_axis=-3, backend=backend)
            assert isinstance(qr, da.Array) and qr.chunks == dq.chunks and kr.chunks == dk.chunks
            expect = np.broadcast_to(np.arange(96) + (7 if isinstance(p, int) else 0), (2, 96)) if p is None or isinstance(p, int) else np.asarray(p)
            expect = expect if np.ndim(expect) == 2 else np.broadcast_to(expect, (2, 96))
            with dask.config.set(scheduler="threads"):
                assert_close(qr.compute(), _oracle_bshd(q, expect))
                assert_close(kr.compute(), _oracle_bshd(k, expect))
    # the same bits as the in-memory call (each block runs the same kernel at its global positions)
    dq = da.from_array(q, chunks=(1, 32, 3, 32))
    np.testing.assert_array_equal(rotary.apply(dq, pos, seq_axis=-3, backend=backend, inverse=True).compute(),
                                  rotary.apply(q, pos, seq_axis=-3, backend=backend, inverse=True))


def test_rotation_is_lazy_and_one_task_per_block():
    q, _, _ = _data()
    dq = da.from_array(q, chunks=(1, 16, 3, 32))
    y = rotary.apply(dq, seq_axis=-3)
    graph = dict(y.__dask_graph__())
    n_blocks = 2 * 6
    assert len([key for key in graph if key[0] == y.name]) == n_blocks
    assert len(graph) <= 3 * n_blocks + 2                     # input blocks, positions blocks, outputs


def test_errors_name_the_fix():
    q, _, v = _data()
    with pytest.raises(ValueError, match=r"head_dim.*x\.rechunk\(\{-1: -1\}\)"):
        rotary.apply(da.from_array(q, chunks=(2, 32, 3, 16)), seq_axis=-3)
    with pytest.raises(TypeError, match="out= is not supported for Dask arrays"):
        rotary.apply(da.from_array(q), seq_axis=-3, out=q)
    with pytest.raises(ValueError, match=r"chunks the sequence axis only.*rechunk"):
        rotary.linear_attention(*(da.from_array(a, chunks=(1, 32, 3, a.shape[-1])) for a in (q, q, v)), seq_axis=-3)
    with pytest.raises(ValueError, match="head_dim"):
        rotary.linear_attention(*(da.from_array(a, chunks=(2, 32, 3, 4)) for a in (q, q, v)), seq_axis=-3)


@pytest.mark.interop("Dask (NumPy chunks)", "cpu", "numba, numpy", "linear attention, threaded scheduler")
@pytest.mark.parametrize("causal", [True, False])
def test_linear_attention_chunked_sequence(causal):
    q, k, v = _data(3, H=4, Hk=2)
    dq, dk, dv = (da.from_array(a, chunks=(2, (20, 30, 14, 32), a.shape[2], a.shape[3])) for a in (q, k, v))
    with dask.config.set(scheduler="threads"):
        for backend in CPU_BACKENDS:
            o, st = rotary.linear_attention(dq, dk, dv, causal=causal, seq_axis=-3, return_state=True, backend=backend)
            assert isinstance(o, da.Array) and o.chunks[1] == dq.chunks[1]
            assert_close(o.compute(), _la_oracle(q, k, v, causal), rtol=3e-5, atol=3e-5)
            o_mem, st_mem = rotary.linear_attention(q, k, v, causal=causal, seq_axis=-3, return_state=True,
                                                    backend=backend)
            assert st.next_position == st_mem.next_position == 96 and st.groups == st_mem.groups == 2
            assert_close(st.S.compute(), st_mem.S, rtol=3e-5, atol=3e-4)
            assert_close(st.z.compute(), st_mem.z, rtol=3e-5, atol=3e-4)
            # resume from the (lazy) state: the same as the in-memory resume
            o2 = rotary.linear_attention(dq, dk, dv, causal=causal, seq_axis=-3, state=st, backend=backend)
            e2 = rotary.linear_attention(q, k, v, causal=causal, seq_axis=-3, state=st_mem, backend=backend)
            assert_close(o2.compute(), e2, rtol=3e-5, atol=3e-5)
    n = 4
    assert len(dict(o.__dask_graph__())) <= 12 * n            # O(number of chunks)


def test_linear_attention_decay_and_positions():
    q, k, v = _data(4)
    pos = np.random.default_rng(5).integers(0, 10**6, size=(2, 96))
    dec = np.array([0.9, 0.97, 1.0])
    dq, dk, dv = (da.from_array(a, chunks=(2, 24, 3, a.shape[3])) for a in (q, k, v))
    with dask.config.set(scheduler="threads"):
        o, st = rotary.linear_attention(dq, dk, dv, pos, causal=True, seq_axis=-3, decay=dec, return_state=True)
        e, est = rotary.linear_attention(q, k, v, pos, causal=True, seq_axis=-3, decay=dec, return_state=True)
        assert_close(o.compute(), e, rtol=3e-5, atol=3e-5)
        assert_close(st.S.compute(), est.S, rtol=3e-5, atol=3e-4)
        np.testing.assert_array_equal(st.next_position, est.next_position)
        o2 = rotary.linear_attention(dq, dk, dv, causal=True, seq_axis=-3, decay=dec,
                                     positions=da.from_array(pos, chunks=(2, 48)))
        assert_close(o2.compute(), e, rtol=3e-5, atol=3e-5)



def _autograd_oracle():
    """test_linear_attention_backward's float64 oracle (autograd of the quadratic form), or None without torch."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return None
    from . import test_linear_attention_backward

    return test_linear_attention_backward


def _backward_case(causal, seed=14, T=96, dtype=np.float64):
    """GQA 4/2 inputs (B, T, H, d) with a grad_o, a carried state of an earlier call and a gradient at the state
    out (decay per head when causal)."""
    from rotary.attn.linear_backward import linear_attention_backward

    rng = np.random.default_rng(seed)
    q, k, v = _data(seed, T=T, H=4, Hk=2, dtype=dtype)
    g = rng.standard_normal((2, T, 4, 8)).astype(dtype)
    dec = np.array([0.9, 0.97]) if causal else None
    q0, k0, v0 = _data(seed + 1, T=5, H=4, Hk=2, dtype=dtype)
    _, st = rotary.linear_attention(q0, k0, v0, causal=causal, seq_axis=-3, decay=dec, return_state=True,
                                    backend="numpy")
    gs = (rng.standard_normal(st.S.shape).astype(dtype), rng.standard_normal(st.z.shape).astype(dtype))
    kw = dict(causal=causal, seq_axis=-3, decay=dec, spec=SPEC, chunk=16)
    return linear_attention_backward, (q, k, v, g), st, gs, kw


@pytest.mark.interop("Dask (NumPy chunks)", "cpu", "numba, numpy", "linear attention backward, threaded scheduler")
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_linear_attention_backward_chunked_sequence(causal, backend):
    """The backward on Dask arrays chunked along the sequence axis (uneven chunks, k and v chunked otherwise) gives
    Dask arrays chunked like q, k, v: the in-memory call's gradients and the float64 oracle's (autograd of the
    quadratic form, test_linear_attention_backward), with a carried state and a gradient at the state out, and
    without them (the oracle's part needs torch)."""
    tlab = _autograd_oracle()
    backward, (q, k, v, g), st, gs, kw = _backward_case(causal)
    kw["backend"] = backend
    chunks = (20, 30, 14, 32)
    dq, dk, dv, dg = (da.from_array(a, chunks=(2, c, a.shape[2], a.shape[3]))
                      for a, c in ((q, chunks), (k, 48), (v, (50, 46)), (g, chunks)))
    T, B, Hk = q.shape[1], 2, 2
    for state, grad_state in ((st, gs), (None, None), (st, None), (None, gs)):
        got = backward(dq, dk, dv, dg, state=state, grad_state=grad_state, **kw)
        assert all(isinstance(x, da.Array) for x in got[:3])
        assert got[0].chunks[1] == got[1].chunks[1] == got[2].chunks[1] == chunks
        assert (got[3] is None) == (state is None)
        with dask.config.set(scheduler="threads"):
            res = dask.compute(*got[:3], *(got[3] or ()))
        want = backward(q, k, v, g, state=state, grad_state=grad_state, **kw)
        for a, b in zip(res, [*want[:3], *(want[3] or ())]):
            assert a.shape == b.shape and a.dtype == b.dtype
            assert_close(a, b, rtol=1e-10, atol=1e-10)
        if tlab is None:
            continue
        S0 = np.zeros((B, Hk, 32, 8)) if state is None else state.S
        z0 = np.zeros((B, Hk, 32)) if state is None else state.z
        pos = (5 if state is not None else 0) + np.arange(T)[None]
        oracle = tlab.oracle_grads(q, k, v, S0, z0, pos, SPEC.inv_freq(), g, grad_state, **tlab._spec_oracle_kw(
            SPEC, causal=causal, feature_map="elu", eps=1e-6, normalize=True,
            decay=None if kw["decay"] is None else np.broadcast_to(kw["decay"], (B, Hk)).copy()))
        for a, b in zip(res, oracle[:len(res)]):
            assert tlab.rel_err(a, b) <= 1e-9
    assert len(dict(got[0].__dask_graph__())) <= 40 * len(chunks)   # O(number of chunks)


def test_linear_attention_backward_float32_and_errors():
    """float32 blocks within the float64 oracle's float32 tolerance (with torch); bad grad_o / grad_state named."""
    tlab = _autograd_oracle()
    backward, (q, k, v, g), _, _, kw = _backward_case(True, seed=21, T=64, dtype=np.float32)
    dq, dk, dv, dg = (da.from_array(a, chunks=(2, 16, a.shape[2], a.shape[3])) for a in (q, k, v, g))
    with dask.config.set(scheduler="threads"):
        res = dask.compute(*backward(dq, dk, dv, dg, **kw)[:3])
    oracle = [None] * 3 if tlab is None else tlab.oracle_grads(q, k, v, np.zeros((2, 2, 32, 8)), np.zeros((2, 2, 32)), np.arange(64)[None],
                               SPEC.inv_freq(), g, None, **tlab._spec_oracle_kw(
                                   SPEC, causal=True, feature_map="elu", eps=1e-6, normalize=True,
                                   decay=np.broadcast_to(kw["decay"], (2, 2)).copy()))
    for a, b in zip(res, oracle):
        assert a.dtype == np.float32 and (b is None or tlab.rel_err(a, b) <= 1e-4)
    with pytest.raises(ValueError, match=r"grad_o is chunked along axes \[2\].*rechunk"):
        backward(dq, dk, dv, da.from_array(g, chunks=(2, 16, 2, 8)), **kw)
    with pytest.raises(TypeError, match="grad_o must be a Dask array"):
        backward(dq, dk, dv, g, **kw)
    with pytest.raises(ValueError, match="grad_o must have the output's shape"):
        backward(dq, dk, dv, dg[..., :4], **kw)
    with pytest.raises(ValueError, match=r"grad_state\[0\] \(dL/dS\) must have"):
        backward(dq, dk, dv, dg, grad_state=(np.zeros((2, 2, 3, 8)), None), **kw)


@pytest.fixture(scope="module")
def cluster_client():
    distributed = pytest.importorskip("distributed")
    cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                                       memory_limit="1GiB")
    client = distributed.Client(cluster, timeout=60)
    try:
        yield client
    finally:
        client.close(timeout=30)
        cluster.close(timeout=30)


@pytest.mark.interop("Dask (NumPy chunks)", "cpu", "numba", "distributed LocalCluster, 2 worker processes")
def test_local_cluster_two_worker_processes(cluster_client):
    assert len(cluster_client.scheduler_info()["workers"]) == 2
    q, k, v = _data(6, T=128)
    dq, dk, dv = (da.from_array(a, chunks=(2, 32, 3, a.shape[3])) for a in (q, k, v))
    r = rotary.apply(dq, 11, seq_axis=-3)
    o, st = rotary.linear_attention(dq, dk, dv, causal=True, seq_axis=-3, return_state=True)
    r_c, o_c, S_c = cluster_client.compute([r, o, st.S], sync=True)
    assert_close(r_c, _oracle_bshd(q, np.broadcast_to(np.arange(128) + 11, (2, 128))))
    assert_close(o_c, _la_oracle(q, k, v, True), rtol=3e-5, atol=3e-5)
    assert_close(S_c, rotary.linear_attention(q, k, v, causal=True, seq_axis=-3, return_state=True)[1].S,
                 rtol=3e-5, atol=3e-4)
    o_nc = cluster_client.compute(rotary.linear_attention(dq, dk, dv, seq_axis=-3), sync=True)
    assert_close(o_nc, _la_oracle(q, k, v, False), rtol=3e-5, atol=3e-5)
    # the backward's graph on the worker processes: the in-memory gradients
    from rotary.attn.linear_backward import linear_attention_backward

    g = np.random.default_rng(7).standard_normal((2, 128, 3, 8)).astype(np.float32)
    grads = linear_attention_backward(dq, dk, dv, da.from_array(g, chunks=(2, 32, 3, 8)), causal=True, seq_axis=-3)
    for got, want in zip(cluster_client.compute(list(grads[:3]), sync=True),
                         linear_attention_backward(q, k, v, g, causal=True, seq_axis=-3)[:3]):
        assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.interop("Dask (CuPy chunks)", "cuda", "cupy", "threaded scheduler, linear attention")
def test_cupy_chunks():
    if "cupy" not in AVAILABLE:
        pytest.skip("needs a CUDA device and CuPy")
    import cupy

    q, k, v = _data(7)
    dq, dk, dv = (da.from_array(a, chunks=(2, 32, 3, a.shape[3])).map_blocks(cupy.asarray) for a in (q, k, v))
    with dask.config.set(scheduler="threads"):
        r = rotary.apply(dq, 3, seq_axis=-3)
        assert isinstance(r._meta, cupy.ndarray)
        assert_close(cupy.asnumpy(r.compute()), _oracle_bshd(q, np.broadcast_to(np.arange(96) + 3, (2, 96))))
        o = rotary.linear_attention(dq, dk, dv, causal=True, seq_axis=-3)
        assert_close(cupy.asnumpy(o.compute()), _la_oracle(q, k, v, True), rtol=3e-5, atol=3e-5)


def test_packed_and_multi_axis_positions():
    x = np.random.default_rng(9).standard_normal((40, 4, 16)).astype(np.float32)
    dx = da.from_array(x, chunks=(8, 4, 16))
    cu = np.array([0, 10, 40])
    with dask.config.set(scheduler="threads"):
        np.testing.assert_array_equal(rotary.apply(dx, seq_axis=-3, cu_seqlens=cu).compute(),
                                      rotary.apply(x, seq_axis=-3, cu_seqlens=cu))
        spec = rotary.RopeSpec(16, mrope_section=[2, 3, 3])
        pos = np.random.default_rng(10).integers(0, 100, (40, 3))
        np.testing.assert_array_equal(rotary.apply(dx, pos, spec=spec, seq_axis=-3).compute(),
                                      rotary.apply(x, pos, spec=spec, seq_axis=-3))


@pytest.mark.interop("Dask (NumPy chunks)", "cpu", "numba, numpy", "rerotate, threaded scheduler")
def test_rerotate_blockwise():
    k = np.random.default_rng(12).standard_normal((2, 40, 4, 16)).astype(np.float32)
    src = np.random.default_rng(13).integers(0, 1000, (2, 40))
    dk = da.from_array(k, chunks=(1, 16, 4, 16))
    with dask.config.set(scheduler="threads"):
        for f in (src, src[0]):
            r = rotary.rerotate(dk, f, f + 5, seq_axis=-3)
            assert r.chunks == dk.chunks
            np.testing.assert_array_equal(r.compute(), rotary.rerotate(k, f, f + 5, seq_axis=-3))
            # moving keys rotated at f to f + 5 equals rotating the unrotated keys at f + 5
            unrotated = rotary.apply(k, f, seq_axis=-3, inverse=True)
            assert_close(r.compute(), rotary.apply(unrotated, f + 5, seq_axis=-3), rtol=1e-5, atol=1e-5)
