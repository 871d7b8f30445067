"""The Numba paged-attention kernel's tiles (``numba_kernels/kv_cache.py``): scores of ``max(4, lanes)`` keys at a
time folded into one vector (:func:`tile_scores`), four q rows of one key range (a query's GQA group, or rows of
several queries that see the same keys) sharing each key and value vector (:func:`tile_scores_rows`,
:func:`add_weighted_rows`), eight accumulator vectors per row (:func:`add_weighted`), weights by the vector exp
(:func:`rotary.backends.numba_kernels.simd.vexp`).

Every path against the float64 oracle (test_kv_split_k's ``_check``: :func:`rotary.testing.paged_attention64`,
q rotated by :func:`rotary.testing.rope_complex`): head dims with no whole vector past a tile's (20), with a tail
past the last whole vector (72, 136), and of whole quads and octets of vectors (128, 256); GQA 1, 2, 3, 4, 8 (rows
taken four at a time where four share a range, one at a time otherwise); a task per sequence (every k/v head block
by block: in address order, every head's rows in turn, where rows come in fours of one range; else head after
head) and a task per k/v head; float32, float64 and int8 entries; dense decode and packed mixed steps, causal and
not, window and softcap. And ``vexp`` / ``vmax_lanes`` compiled against
their Python forms and NumPy's exp.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("numba")

from numba import njit  # noqa: E402

from rotary.backends import numba_kv  # noqa: E402
from rotary.backends.numba_kernels import kv_cache as kernels, simd  # noqa: E402

from .test_kv_split_k import CASES, _check, _stores, _table  # noqa: E402


@pytest.fixture(params=["all heads", "per head"])
def task_mode(request, monkeypatch):
    """The kernel's two task shapes: a task per sequence taking every k/v head block by block (``all_heads``: what a
    serial call and a parallel call with enough sequences run), or a task per (sequence, k/v head) (the parallel
    kernel forced, with too few sequences for the threads); the mode that ran is checked after. (Each run of the
    parallel kernel with many sequences: test_kv_split_k.)"""
    ran = []
    for name in ("paged_attention_serial", "paged_attention_parallel"):
        kernel = getattr(kernels, name)
        # all_heads: the third last argument (then the norm's two markers)
        monkeypatch.setattr(kernels, name, lambda *a, _k=kernel: (ran.append(a[-3]), _k(*a))[1])
    if request.param == "per head":
        monkeypatch.setattr(numba_kv, "ATTENTION_PARALLEL_MIN_WORK", 0)
        monkeypatch.setattr(numba_kv, "SPLIT_TASKS_PER_THREAD", 1 << 40)
        monkeypatch.setattr(numba_kv, "ALL_HEADS_TASKS_PER_THREAD", 1 << 40)
        monkeypatch.setattr(numba_kv, "EVEN_SPLIT_MIN_KEYS", 1 << 62)
    else:   # the serial kernel (a parallel one with many sequences takes the same path)
        monkeypatch.setattr(numba_kv, "ATTENTION_PARALLEL_MIN_WORK", 1 << 62)
    yield
    assert ran and set(ran) == {request.param == "all heads"}, ran


@pytest.mark.parametrize("head_dim", [20, 72, 128, 136, 256])
@pytest.mark.parametrize("groups", [1, 2, 3, 4, 8])
def test_tiles_decode_and_mixed_against_the_oracle(rng, task_mode, head_dim, groups):
    """A mixed step (a prefill chunk of 5 queries, decode tokens, a whole prefill of 9) and a dense decode step, fp32
    entries, every case (causal, window + softcap, not causal, a small window), q rotated in the kernel and not."""
    _check(rng, np.float32, None, [150, 70, 9, 1], [5, 1, 9, 1], 1, q_heads=2 * groups, kv_heads=2,
           head_dim=head_dim, page_size=16, cases=CASES)
    _check(rng, np.float32, None, [100, 33, 64], [1, 1, 1], 1, q_heads=2 * groups, kv_heads=2, head_dim=head_dim,
           page_size=16, cases=CASES[:2], rotate=(True,))


@pytest.mark.parametrize("dtype, kv_dtype", [(np.float64, None), (np.float32, "int8"), (np.float64, "int8"),
                                             (np.float16, None)])
@pytest.mark.parametrize("head_dim", [20, 72, 128])
def test_tiles_other_entries(rng, task_mode, dtype, kv_dtype, head_dim):
    """float64 work (8 lanes with AVX-512: tiles of 8 keys), int8 entries (scales per key), float16 bits; GQA 4 and
    1."""
    for q_heads in (8, 2):
        _check(rng, dtype, kv_dtype, [90, 40, 7], [3, 1, 7], 1, q_heads=q_heads, kv_heads=2, head_dim=head_dim,
               page_size=8, cases=CASES[:3])


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
@pytest.mark.parametrize("groups, counts, head_dim", [(4, [1, 3, 4, 2], 128), (8, [1, 2, 1], 72), (4, [1, 1], 20)])
def test_every_head_in_address_order(rng, monkeypatch, kv_dtype, groups, counts, head_dim):
    """A task taking every k/v head whose rows come in fours of one key range (GQA 4 and 8) reads each block whole
    and scores and accumulates every head's rows in address order (tile_scores_heads, add_weighted_heads): 8 k/v
    heads, ragged lengths (a last partial page, fewer keys than a tile), several queries a sequence up to a row block
    (each query's four rows see their own keys), every case, against the oracle; and bit for bit the output of a task
    per k/v head (the same operations per row)."""
    seq_lens = [150, 37, 9, 64][:len(counts)]
    monkeypatch.setattr(numba_kv, "ATTENTION_PARALLEL_MIN_WORK", 1 << 62)   # serial: all heads
    _check(rng, np.float32, kv_dtype, seq_lens, counts, 1, q_heads=8 * groups, kv_heads=8, head_dim=head_dim,
           page_size=16, cases=CASES)
    table, n_pages = _table(rng, seq_lens, 16)
    stores = _stores(rng, kv_dtype, np.float32, n_pages * 16, 8, head_dim)
    q_starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    q = rng.standard_normal((int(q_starts[-1]), 8 * groups, head_dim)).astype(np.float32)
    for kw in CASES:
        kw = dict(dict(scale=head_dim ** -0.5, softcap=None, window=None, causal=True), **kw)
        runs = []
        for per_head in (False, True):
            monkeypatch.setattr(numba_kv, "ATTENTION_PARALLEL_MIN_WORK", 0 if per_head else 1 << 62)
            monkeypatch.setattr(numba_kv, "SPLIT_TASKS_PER_THREAD", 1 << 40 if per_head else 4)
            runs.append(numba_kv.prepare_paged_attention(q, table, 16, np.asarray(seq_lens, np.int64), q_starts,
                                                         kv_dtype=kv_dtype, **kw)(q, stores))
        np.testing.assert_array_equal(runs[0], runs[1])


def test_vexp_and_vmax_lanes_against_their_python_forms():
    """vexp: within 4 ulp of float64 exp on [-87, 88] (float32) and [-708, 709] (float64), 0 below, e^-inf = 0,
    NaN kept, its Python form the same bits as the compiled one; vmax_lanes: the largest lane, and its Python form's
    result with a NaN lane."""
    @njit
    def run(x, out, top):
        width = simd.lanes(x)
        for i in range(0, x.shape[0], width):
            v = simd.vload(x, i)
            simd.vstore(out, i, simd.vexp(v))
            top[i // width] = simd.vmax_lanes(v)

    rng = np.random.default_rng(0)
    for dtype, lo, hi in ((np.float32, -87.0, 88.0), (np.float64, -708.0, 709.0)):
        width = simd.VECTOR_BYTES // np.dtype(dtype).itemsize
        x = np.concatenate([rng.uniform(lo, hi, 4000), rng.uniform(-3, 3, 4000), [0.0, -0.0, 1e-30, -1e-30]])
        x = np.concatenate([x, [lo - 1.0, -1e4, -np.inf, np.nan]]).astype(dtype)
        x = np.concatenate([x, np.zeros(-len(x) % width, dtype)])
        out, top = np.empty_like(x), np.empty(len(x) // width, dtype)
        run(x, out, top)
        finite = (x >= lo) & (x <= hi)
        want = np.exp(x[finite].astype(np.float64))
        ulp = np.spacing(want.astype(dtype)).astype(np.float64)
        assert np.max(np.abs(out[finite] - want) / ulp) <= 4
        assert np.all(out[np.isneginf(x) | (x < lo)] == 0) and np.isnan(out[np.isnan(x)]).all()
        np.testing.assert_array_equal(simd.vexp(x), out)   # the Python form: the same bits
        blocks = x.reshape(-1, width)
        plain = ~np.isnan(blocks).any(axis=1)
        np.testing.assert_array_equal(top[plain], blocks[plain].max(axis=1))
        np.testing.assert_array_equal(top, [simd.vmax_lanes(b) for b in blocks])
