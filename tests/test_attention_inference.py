"""rotary.attention for inference: KV cache (q shorter than k), explicit positions, GQA, sliding window,
soft-capping, pre-rotated inputs and packed batches, against the quadratic float64 oracle
(rotary.testing.attention_quadratic); the blocked online softmax with tiny blocks so every path
(skipped, partially masked and full blocks; several q blocks) runs."""

import numpy as np
import pytest

import rotary
from rotary import RopeSpec, testing
from rotary.attn import softmax as _attention
from rotary.backends import online_softmax as _blocks

from .conftest import backend_params

SPEC = RopeSpec(16, base=500.0)


def _tol(dtype):
    return dict(rtol=1e-11, atol=1e-11) if dtype == np.float64 else dict(rtol=2e-5, atol=2e-5)


@pytest.fixture(params=["one block", "tiny blocks", "tiny blocks, array-API path"])
def blocks(request, monkeypatch):
    """block_size to pass (NumPy inputs take the tile loop whatever their size); "tiny blocks" also splits q
    into many row blocks; the last runs NumPy inputs through the array-API path (the one CuPy, torch and
    small NumPy calls take) instead of the NumPy tile loop."""
    monkeypatch.setattr(_attention, "_TILES_MIN_SCORES", 0)   # the tile loop even for these small inputs
    if request.param.startswith("tiny blocks"):
        monkeypatch.setattr(_blocks, "_SCORE_BLOCK_ELEMENTS", 1)
        if "array-API" in request.param:
            monkeypatch.setattr(_attention, "_NUMPY_TILES", False)
        return 3
    return 512


def _bhsd(rng, dtype, B=2, Hq=4, Hk=2, Sq=5, Sk=11, d=16, dv=6):
    q = rng.standard_normal((B, Hq, Sq, d)).astype(dtype)
    k = rng.standard_normal((B, Hk, Sk, d)).astype(dtype)
    v = rng.standard_normal((B, Hk, Sk, dv)).astype(dtype)
    return q, k, v


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("backend", backend_params())
def test_kv_cache_end_aligned_causal_gqa(backend, dtype, blocks, rng):
    q, k, v = _bhsd(rng, dtype)
    off = 40
    kp = off + np.arange(11)
    o = rotary.attention(q, k, v, off, causal=True, spec=SPEC, backend=backend, block_size=blocks, seq_axis=-2)
    ref = testing.attention_quadratic(q, k, v, kp[-5:], kp, SPEC.inv_freq(), causal=True)
    testing.assert_close(o, ref, like=q, **_tol(dtype))
    # BSHD gives the same
    o2 = rotary.attention(*(np.swapaxes(a, 1, 2) for a in (q, k, v)), off, causal=True, spec=SPEC, seq_axis=1,
                          backend=backend, block_size=blocks)
    np.testing.assert_allclose(np.swapaxes(o2, 1, 2), o, **_tol(dtype))


@pytest.mark.parametrize("backend", backend_params())
def test_window_softcap_and_explicit_positions(backend, blocks, rng):
    q, k, v = _bhsd(rng, np.float64, Sq=7, Sk=13)
    kp = np.stack([np.arange(13) * 2, np.arange(13) + 5])        # per-batch, gaps
    qp = np.stack([np.arange(7) * 3 + 1, np.arange(7) + 11])
    o = rotary.attention(q, k, v, q_positions=qp, k_positions=kp, causal=True, window=4, softcap=2.5, scale=0.7,
                         spec=SPEC, backend=backend, block_size=blocks, seq_axis=-2)
    ref = testing.attention_quadratic(q, k, v, qp, kp, SPEC.inv_freq(), causal=True, window=4, softcap=2.5,
                                      scale=0.7)
    testing.assert_close(o, ref, like=q)


def test_row_without_visible_keys_is_zero(rng):
    q, k, v = _bhsd(rng, np.float64, Sq=1, Sk=4)
    o = rotary.attention(q, k, v, q_positions=np.array([100]), k_positions=np.arange(4), causal=True, window=3,
                         spec=SPEC, backend="numpy", seq_axis=-2)
    assert np.all(o == 0)


@pytest.mark.parametrize("backend", backend_params())
def test_pre_rotated_mode_and_sliding_window_decode(backend, blocks, rng):
    """rope=False on q, k rotated by the caller equals rope=True; a decode step over a rotated cache."""
    q, k, v = _bhsd(rng, np.float32, Sq=1, Sk=20)
    kp = np.arange(20) + 7
    k_rot = rotary.apply(k, kp, spec=SPEC, backend=backend, seq_axis=-2)
    q_rot = rotary.apply(q, kp[-1:], spec=SPEC, backend=backend, seq_axis=-2)
    o = rotary.attention(q_rot, k_rot, v, 7, causal=True, window=6, rope=False, backend=backend, block_size=blocks, seq_axis=-2)
    ref = testing.attention_quadratic(q, k, v, kp[-1:], kp, SPEC.inv_freq(), causal=True, window=6)
    testing.assert_close(o, ref, like=q)
    o2 = rotary.attention(q, k, v, 7, causal=True, window=6, spec=SPEC, backend=backend, block_size=blocks, seq_axis=-2)
    np.testing.assert_allclose(o2, o, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", backend_params())
def test_non_causal_more_queries_than_keys(backend, rng):
    q, k, v = _bhsd(rng, np.float64, Sq=9, Sk=4)
    o = rotary.attention(q, k, v, spec=SPEC, backend=backend, block_size=2, seq_axis=-2)
    ref = testing.attention_quadratic(q, k, v, np.arange(-5, 4), np.arange(4), SPEC.inv_freq())
    testing.assert_close(o, ref, like=q)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("backend", backend_params())
def test_packed_never_mixes_sequences(backend, dtype, blocks, rng):
    lq, lk = [3, 1, 0, 6], [5, 9, 2, 6]
    cu_q = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lk)])
    offsets = np.array([0, 100, 3, 17])
    q = rng.standard_normal((cu_q[-1], 4, 16)).astype(dtype)
    k = rng.standard_normal((cu_k[-1], 2, 16)).astype(dtype)
    v = rng.standard_normal((cu_k[-1], 2, 8)).astype(dtype)
    o = rotary.attention(q, k, v, causal=True, window=5, spec=SPEC, seq_axis=0, cu_seqlens=cu_q, cu_seqlens_k=cu_k,
                         seqlen_offsets=offsets, backend=backend, block_size=blocks)
    assert o.shape == (cu_q[-1], 4, 8) and o.dtype == dtype
    for n in range(4):
        a, b, c, e = cu_q[n], cu_q[n + 1], cu_k[n], cu_k[n + 1]
        if a == b:
            continue
        kp = offsets[n] + np.arange(lk[n])
        ref = testing.attention_quadratic(*(np.swapaxes(x, 0, 1) for x in (q[a:b], k[c:e], v[c:e])),
                                          kp[lk[n] - lq[n]:], kp, SPEC.inv_freq(), causal=True, window=5)
        testing.assert_close(o[a:b], np.swapaxes(ref, 0, 1), like=q, **_tol(dtype))
        alone = rotary.attention(q[a:b], k[c:e], v[c:e], int(offsets[n]), causal=True, window=5, spec=SPEC,
                                 seq_axis=0, backend=backend)
        np.testing.assert_allclose(o[a:b], alone, **_tol(dtype))


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_gqa_groups_bshd_window_softcap_kv_cache(dtype, blocks, rng):
    """4 q heads per k/v head in one matmul, BSHD, heads on axis 2, q shorter than k, window and softcap."""
    B, Sq, Sk, Hq, Hk, d = 2, 6, 17, 8, 2, 16
    q = rng.standard_normal((B, Sq, Hq, d)).astype(dtype)
    k = rng.standard_normal((B, Sk, Hk, d)).astype(dtype)
    v = rng.standard_normal((B, Sk, Hk, 5)).astype(dtype)
    o = rotary.attention(q, k, v, 9, causal=True, window=7, softcap=3.0, spec=SPEC, seq_axis=1, block_size=blocks)
    assert o.shape == (B, Sq, Hq, 5) and o.dtype == dtype
    kp = 9 + np.arange(Sk)
    ref = testing.attention_quadratic(*(np.swapaxes(a, 1, 2) for a in (q, k, v)), kp[-Sq:], kp, SPEC.inv_freq(),
                                      causal=True, window=7, softcap=3.0)
    tol = dict(rtol=5e-3, atol=5e-3) if dtype == np.float16 else _tol(dtype)
    testing.assert_close(o, np.swapaxes(ref, 1, 2), like=q, **tol)


@pytest.mark.parametrize("causal", [False, True])
def test_packed_one_sweep_equals_each_sequence_alone(causal, blocks, rng):
    """Sequences sharing tiles (one block holds several; tiny blocks straddle boundaries), GQA, non-causal
    too (the sequence mask alone), against the oracle per sequence."""
    lens = [4, 1, 7, 3, 5]
    cu = np.concatenate([[0], np.cumsum(lens)])
    q = rng.standard_normal((cu[-1], 6, 16))
    k = rng.standard_normal((cu[-1], 3, 16))
    v = rng.standard_normal((cu[-1], 3, 4))
    o = rotary.attention(q, k, v, causal=causal, spec=SPEC, seq_axis=0, cu_seqlens=cu, block_size=blocks)
    for n, L in enumerate(lens):
        a, b = cu[n], cu[n + 1]
        ref = testing.attention_quadratic(*(np.swapaxes(x[a:b], 0, 1) for x in (q, k, v)), np.arange(L),
                                          np.arange(L), SPEC.inv_freq(), causal=causal)
        testing.assert_close(o[a:b], np.swapaxes(ref, 0, 1), like=q)


def test_tile_schedule_skips_hidden_blocks():
    """Causal 8x8 in blocks of 2: the 6 tiles above the diagonal are skipped, the 4 diagonal ones carry a
    mask and the 6 below none; packed: no tile pairs two sequences, tiles inside one sequence need no mask."""
    pos = np.arange(8)[None]
    tiles = [(q0, k0, h is None) for q0, _, row in _blocks.tiles(_blocks.Mask(pos, pos, None, None, True, None),
                                                                       8, 8, 2, 2) for k0, _, h in row]
    assert [t[:2] for t in tiles] == [(q0, k0) for q0 in range(0, 8, 2) for k0 in range(0, q0 + 1, 2)]
    assert sum(not full for *_, full in tiles) == 4
    seq = np.repeat([0, 1], 4)
    packed = _blocks.Mask(np.tile(np.arange(4), 2)[None], np.tile(np.arange(4), 2)[None], seq, seq, False, None)
    assert [(q0, k0, h is None) for q0, _, row in _blocks.tiles(packed, 8, 8, 4, 4) for k0, _, h in row] == [
        (0, 0, True), (4, 4, True)]


MROPE = RopeSpec(16, mrope_section=(4, 2, 2), base=500.0)


def _mrope_oracle(q, k, v, qpos3, kpos3, q_mask, k_mask, **kw):
    """q, k, v (H, S, *): rotated by M-RoPE at (S, 3) positions (rope_complex), masked by 1-D coordinates."""
    axes, inv = MROPE.pair_axes(), MROPE.inv_freq()
    qr = testing.rope_complex(q, qpos3, inv, pair_axes=axes)
    kr = testing.rope_complex(k, kpos3, inv, pair_axes=axes)
    return testing.attention_quadratic(qr, kr, v, q_mask, k_mask, causal=True, **kw)


def _image_positions(n):
    """(n, 3) M-RoPE positions: a text run, a 2x3 image block, text again (text rows equal on every axis)."""
    t = np.arange(3)
    img = np.stack([np.full(6, 3), 3 + np.repeat(np.arange(2), 3), 3 + np.tile(np.arange(3), 2)], axis=1)
    rest = 6 + np.arange(n - 9)
    return np.concatenate([np.repeat(t[:, None], 3, 1), img, np.repeat(rest[:, None], 3, 1)])


def test_mrope_mask_is_token_order_unless_mask_positions_given(blocks, rng):
    """Multi-axis positions mask by token index, end-aligned (a KV cache); q_mask_positions/k_mask_positions
    replace it (here text positions with a gap and a window that the gap changes)."""
    Sq, Sk = 4, 13
    q = rng.standard_normal((4, Sq, 16))
    k, v = rng.standard_normal((2, 2, Sk, 16))
    kpos3 = _image_positions(Sk)
    o = rotary.attention(q, k, v, kpos3, causal=True, window=5, spec=MROPE, block_size=blocks, seq_axis=-2)
    ref = _mrope_oracle(q, k, v, kpos3[-Sq:], kpos3, np.arange(Sk - Sq, Sk), np.arange(Sk), window=5)
    testing.assert_close(o, ref)
    k_mask = np.concatenate([np.arange(9), 20 + np.arange(Sk - 9)])   # a gap of 11 after the 9th token
    o2 = rotary.attention(q, k, v, kpos3, causal=True, window=5, spec=MROPE, block_size=blocks,
                          q_mask_positions=k_mask[-Sq:], k_mask_positions=k_mask, seq_axis=-2)
    ref2 = _mrope_oracle(q, k, v, kpos3[-Sq:], kpos3, k_mask[-Sq:], k_mask, window=5)
    testing.assert_close(o2, ref2)
    assert not np.allclose(o2, o)


def test_mrope_packed_equals_each_sequence_alone(blocks, rng):
    """Packed multi-axis attention (per-token (T, 3) positions) masks each sequence by its own token order,
    end-aligned, as the unpacked call does; explicit per-token mask positions likewise."""
    lq, lk = [2, 4], [10, 12]
    cu_q, cu_k = np.concatenate([[0], np.cumsum(lq)]), np.concatenate([[0], np.cumsum(lk)])
    q = rng.standard_normal((cu_q[-1], 2, 16))
    k, v = rng.standard_normal((2, cu_k[-1], 1, 16))
    kpos3 = [_image_positions(n) for n in lk]
    qpos3 = np.concatenate([p[-n:] for p, n in zip(kpos3, lq)])
    k_mask = np.concatenate([np.arange(n) * 2 for n in lk])   # explicit mask coordinates, per token
    q_mask = np.concatenate([(np.arange(n) * 2)[-m:] for n, m in zip(lk, lq)])
    for extra in ({}, dict(q_mask_positions=q_mask, k_mask_positions=k_mask)):
        o = rotary.attention(q, k, v, q_positions=qpos3, k_positions=np.concatenate(kpos3), causal=True, window=6,
                             spec=MROPE, seq_axis=0, cu_seqlens=cu_q, cu_seqlens_k=cu_k, block_size=blocks, **extra)
        for n in range(2):
            a, b, c, e = cu_q[n], cu_q[n + 1], cu_k[n], cu_k[n + 1]
            alone_extra = {key: val[a:b] if key[0] == "q" else val[c:e] for key, val in extra.items()}
            alone = rotary.attention(q[a:b], k[c:e], v[c:e], q_positions=qpos3[a:b], k_positions=kpos3[n],
                                     causal=True, window=6, spec=MROPE, seq_axis=0, **alone_extra)
            np.testing.assert_allclose(o[a:b], alone, rtol=1e-12, atol=1e-12)
            qm = extra["q_mask_positions"][a:b] if extra else np.arange(lk[n] - lq[n], lk[n])
            km = extra["k_mask_positions"][c:e] if extra else np.arange(lk[n])
            ref = _mrope_oracle(*(np.swapaxes(x, 0, 1) for x in (q[a:b], k[c:e], v[c:e])), qpos3[a:b], kpos3[n],
                                qm, km, window=6)
            testing.assert_close(o[a:b], np.swapaxes(ref, 0, 1))


@pytest.mark.parametrize("blas_per_thread", [True, False], ids=["threads", "serial fallback"])
def test_heads_over_threads_and_serial_fallback(blas_per_thread, monkeypatch, rng):
    """The k/v heads shared out over threads (single-threaded BLAS each) or, where no BLAS can be limited,
    one serial loop: both match the oracle."""
    if blas_per_thread and _blocks._blas_controller() is None:
        pytest.skip("threadpoolctl finds no BLAS it can limit in this process")
    if not blas_per_thread:
        monkeypatch.setattr(_blocks, "_blas_controller", lambda: None)
    monkeypatch.setattr(_blocks, "_cpu_count", lambda: 3)   # 3 threads for 4 k/v heads: uneven shares
    monkeypatch.setattr(_blocks, "_numba_threads", lambda: 8)
    monkeypatch.setattr(_attention, "_TILES_MIN_SCORES", 0)
    q, k, v = _bhsd(rng, np.float32, B=2, Hq=8, Hk=2, Sq=9, Sk=30)
    o = rotary.attention(q, k, v, 5, causal=True, window=11, spec=SPEC, block_size=4, seq_axis=-2)
    kp = 5 + np.arange(30)
    ref = testing.attention_quadratic(q, k, v, kp[-9:], kp, SPEC.inv_freq(), causal=True, window=11)
    testing.assert_close(o, ref, like=q, **_tol(np.float32))


def _threads_used(monkeypatch, n_units=4):
    """(worker threads, BLAS thread counts seen inside the section) of one threaded section."""
    monkeypatch.setattr(_blocks, "_cpu_count", lambda: 4)
    with _blocks._blas_threads(n_units) as (n, _):
        inside = _blocks._blas_thread_counts(_blocks._blas_controller())
    return n, inside


def test_blas_limited_during_the_section_and_restored(monkeypatch):
    """BLAS runs single-threaded for the section's length only, and the user's limits stand: a
    threadpoolctl limit of 2 caps the workers at 2, a limit of 1 (or NUMBA_NUM_THREADS=1) gives the
    serial loop with the BLAS untouched; concurrent sections leave the user's count in place."""
    threadpoolctl = pytest.importorskip("threadpoolctl")
    blas = _blocks._blas_controller()
    if blas is None:
        pytest.skip("threadpoolctl finds no BLAS it can limit in this process")
    monkeypatch.setattr(_blocks, "_numba_threads", lambda: 8)
    with threadpoolctl.threadpool_limits(limits=3, user_api="blas"):
        before = _blocks._blas_thread_counts(blas)
        if max(before) != 3:
            pytest.skip(f"this BLAS cannot be set to 3 threads here ({before})")
        assert _threads_used(monkeypatch) == (3, [1] * len(before))
        assert _blocks._blas_thread_counts(blas) == before
        with threadpoolctl.threadpool_limits(limits=2, user_api="blas"):
            assert _threads_used(monkeypatch)[0] == 2
        with threadpoolctl.threadpool_limits(limits=1, user_api="blas"):
            assert _threads_used(monkeypatch) == (1, [1] * len(before))
        monkeypatch.setattr(_blocks, "_numba_threads", lambda: 1)
        assert _threads_used(monkeypatch) == (1, before)
        monkeypatch.setattr(_blocks, "_numba_threads", lambda: 8)

        import threading

        errors = []

        def call(seed):
            try:
                r = np.random.default_rng(seed)
                q, k, v = _bhsd(r, np.float32, B=1, Hq=4, Hk=4, Sq=64, Sk=64)
                o = rotary.attention(q, k, v, causal=True, spec=SPEC, block_size=8, seq_axis=-2)
                kp = np.arange(64)
                ref = testing.attention_quadratic(q, k, v, kp, kp, SPEC.inv_freq(), causal=True)
                testing.assert_close(o, ref, like=q, **_tol(np.float32))
            except Exception as exc:   # noqa: BLE001 - reported below
                errors.append(exc)

        monkeypatch.setattr(_attention, "_TILES_MIN_SCORES", 0)
        threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert _blocks._blas_thread_counts(blas) == before


def test_numba_num_threads_read_without_importing_numba(monkeypatch):
    import sys

    monkeypatch.delitem(sys.modules, "numba", raising=False)
    monkeypatch.setenv("NUMBA_NUM_THREADS", "3")
    assert _blocks._numba_threads() == 3
    monkeypatch.delenv("NUMBA_NUM_THREADS")
    assert _blocks._numba_threads() == sys.maxsize
    assert "numba" not in sys.modules


def test_softmax_scale_factor_of_the_spec(rng, monkeypatch):
    q, k, v = _bhsd(rng, np.float64)
    spec = RopeSpec(16, base=500.0)
    monkeypatch.setattr(RopeSpec, "softmax_scale_factor", 1.7, raising=False)
    o = rotary.attention(q, k, v, causal=True, spec=spec, backend="numpy", seq_axis=-2)
    kp = np.arange(11)
    ref = testing.attention_quadratic(q, k, v, kp[-5:], kp, spec.inv_freq(), causal=True, scale=1.7 / 4.0)
    testing.assert_close(o, ref, like=q)


def test_torch_inputs_through_the_array_api_path(rng):
    torch = pytest.importorskip("torch")
    q, k, v = _bhsd(rng, np.float64)
    o = rotary.attention(*(torch.from_numpy(a) for a in (q, k, v)), causal=True, window=3, softcap=3.0,
                         spec=SPEC, block_size=4, seq_axis=-2)
    assert isinstance(o, torch.Tensor)
    kp = np.arange(11)
    ref = testing.attention_quadratic(q, k, v, kp[-5:], kp, SPEC.inv_freq(), causal=True, window=3, softcap=3.0)
    testing.assert_close(o.numpy(), ref)


def test_inference_bad_input(rng):
    q, k, v = _bhsd(rng, np.float32, Sq=5, Sk=3)
    with pytest.raises(ValueError, match=r"q_len \(5\) > k_len \(3\) with causal=True"):
        rotary.attention(q, k, v, causal=True, spec=SPEC, seq_axis=-2)
    q, k, v = _bhsd(rng, np.float32)
    for bad in (0, -2):
        with pytest.raises(ValueError, match="window must be > 0"):
            rotary.attention(q, k, v, causal=True, window=bad, spec=SPEC, seq_axis=-2)
    with pytest.raises(ValueError, match="window .* needs causal=True"):
        rotary.attention(q, k, v, window=3, spec=SPEC, seq_axis=-2)
    with pytest.raises(TypeError, match="window must be an integer"):
        rotary.attention(q, k, v, causal=True, window=2.5, spec=SPEC, seq_axis=-2)
    with pytest.raises(ValueError, match="softcap must be > 0"):
        rotary.attention(q, k, v, softcap=0.0, spec=SPEC, seq_axis=-2)
    with pytest.raises(ValueError, match="both q_positions and k_positions"):
        rotary.attention(q, k, v, q_positions=np.arange(5), spec=SPEC, seq_axis=-2)
    with pytest.raises(ValueError, match="not both"):
        rotary.attention(q, k, v, 3, q_positions=np.arange(5), k_positions=np.arange(11), spec=SPEC, seq_axis=-2)
    with pytest.raises(ValueError, match="k_positions of shape"):
        rotary.attention(q, k, v, q_positions=np.arange(5), k_positions=np.arange(10), spec=SPEC, seq_axis=-2)
    qp, kp, vp = (np.swapaxes(a[0], 0, 1) for a in (q, k, v))   # packed (T, H, d)
    with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
        rotary.attention(qp, kp, vp, seq_axis=0, cu_seqlens=np.array([1, 5]), cu_seqlens_k=np.array([0, 11]))
    with pytest.raises(ValueError, match="cu_seqlens_k must end at the token count 11"):
        rotary.attention(qp, kp, vp, seq_axis=0, cu_seqlens=np.array([0, 5]), cu_seqlens_k=np.array([0, 10]))
    with pytest.raises(ValueError, match="as many sequences"):
        rotary.attention(qp, kp, vp, seq_axis=0, cu_seqlens=np.array([0, 5]), cu_seqlens_k=np.array([0, 1, 11]))
    with pytest.raises(ValueError, match="sequence 0 has q_len 5 > k_len 1"):
        rotary.attention(qp, kp, vp, causal=True, seq_axis=0, cu_seqlens=np.array([0, 5, 5]),
                         cu_seqlens_k=np.array([0, 1, 11]))
    with pytest.raises(ValueError, match="seqlen_offsets must have one offset per sequence"):
        rotary.attention(qp, kp, vp, seq_axis=0, cu_seqlens=np.array([0, 5]), cu_seqlens_k=np.array([0, 11]),
                         seqlen_offsets=[1, 2])
    with pytest.raises(ValueError, match="seq_axis=0"):
        rotary.attention(q, k, v, cu_seqlens=np.array([0, 5]), seq_axis=-2)
    with pytest.raises(ValueError, match="both q_mask_positions and k_mask_positions"):
        rotary.attention(q, k, v, causal=True, q_mask_positions=np.arange(5), spec=SPEC, seq_axis=-2)
    with pytest.raises(ValueError, match="need causal=True"):
        rotary.attention(q, k, v, q_mask_positions=np.arange(5), k_mask_positions=np.arange(11), spec=SPEC, seq_axis=-2)
    with pytest.raises(ValueError, match="k_mask_positions of shape"):
        rotary.attention(q, k, v, causal=True, q_mask_positions=np.arange(5), k_mask_positions=np.arange(4),
                         spec=SPEC, seq_axis=-2)
    with pytest.raises(TypeError, match="q_mask_positions must have an integer dtype"):
        rotary.attention(q, k, v, causal=True, q_mask_positions=np.arange(5.0), k_mask_positions=np.arange(11),
                         spec=SPEC, seq_axis=-2)
