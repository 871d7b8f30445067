"""rotary.context_parallel_positions: TransformerEngine's load-balanced context-parallel split (each
sequence in 2 * cp_size chunks, rank r holding chunks r and 2 * cp_size - 1 - r), for bshd/sbhd and
packed thd. Rotating every rank's local tokens at these positions and scattering them back must equal
rotating the whole sequence, on every backend."""

import numpy as np
import pytest

import rotary
from rotary import RopeSpec

from .conftest import backend_params

SPEC = RopeSpec(16, base=10000.0)
cpp = rotary.context_parallel_positions


def _split_cases():
    """(seq_len, cp_size) pairs with seq_len a multiple of 2 * cp_size (any length for cp_size 1)."""
    return [(7, 1), (8, 1), (8, 2), (16, 2), (12, 3), (24, 3), (16, 4), (40, 5), (0, 2)]


def _thd_global_indices(positions, local_cu, cu):
    """Where the rank's local packed tokens sit in the full packed batch."""
    return positions + np.repeat(np.asarray(cu[:-1], np.int64), np.diff(local_cu))


# -- (1) a partition of the sequence, equal counts -----------------------------------------------------
@pytest.mark.parametrize("seq_len, cp_size", _split_cases())
def test_ranks_partition_the_sequence(seq_len, cp_size):
    parts = [cpp(seq_len, cp_size, r) for r in range(cp_size)]
    for p in parts:
        assert p.dtype == np.int64 and p.shape == (seq_len // cp_size,)
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(seq_len))


@pytest.mark.parametrize("cu, cp_size", [
    ([0, 8, 12, 12, 36], 2),
    ([0, 6, 18, 18, 30], 3),
    ([0, 3, 5, 12], 1),
    ([0], 4),
])
def test_ranks_partition_a_packed_batch(cu, cp_size):
    cu = np.asarray(cu, np.int32)
    taken = []
    for r in range(cp_size):
        pos, local_cu = cpp(cu_seqlens=cu, cp_size=cp_size, cp_rank=r)
        assert pos.dtype == np.int64 and local_cu.dtype == np.int64
        assert pos.shape == (cu[-1] // cp_size,)
        assert np.array_equal(local_cu, cu // cp_size)
        for n in range(len(cu) - 1):   # per sequence: positions inside [0, L_n), L_n / cp_size of them
            mine = pos[local_cu[n]:local_cu[n + 1]]
            assert mine.shape == ((cu[n + 1] - cu[n]) // cp_size,)
            assert np.all((mine >= 0) & (mine < cu[n + 1] - cu[n]))
        taken.append(_thd_global_indices(pos, local_cu, cu))
    assert np.array_equal(np.sort(np.concatenate(taken)), np.arange(cu[-1]))


# -- (3) the chunk order, written out by hand ----------------------------------------------------------
def test_chunk_order_by_hand():
    assert cpp(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert cpp(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert [cpp(12, 3, r).tolist() for r in range(3)] == [[0, 1, 10, 11], [2, 3, 8, 9], [4, 5, 6, 7]]
    assert [cpp(8, 4, r).tolist() for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert cpp(5, 1, 0).tolist() == [0, 1, 2, 3, 4]
    # thd, two sequences of 4 and 8 tokens, cp_size 2: every sequence split on its own
    pos0, cu0 = cpp(cu_seqlens=[0, 4, 12], cp_size=2, cp_rank=0)
    pos1, cu1 = cpp(cu_seqlens=[0, 4, 12], cp_size=2, cp_rank=1)
    assert pos0.tolist() == [0, 3, 0, 1, 6, 7] and cu0.tolist() == [0, 2, 6]
    assert pos1.tolist() == [1, 2, 2, 3, 4, 5] and cu1.tolist() == [0, 2, 6]


@pytest.mark.parametrize("seq_len, cp_size", [c for c in _split_cases() if c[1] > 1])
def test_matches_te_get_freqs_on_this_cp_rank(seq_len, cp_size):
    """TE's ``_get_freqs_on_this_cp_rank(freqs, seqlen, cp_size, cp_rank)`` (pytorch/attention/rope.py),
    transcribed: with the local length s, rows ``[r*s/2, (r+1)*s/2)`` then
    ``[cp*s - (r+1)*s/2, cp*s - r*s/2)`` of the position table."""
    table = np.arange(seq_len)
    s = seq_len // cp_size
    seg, full = s // 2, cp_size * s
    for r in range(cp_size):
        te = np.concatenate([table[r * seg:(r + 1) * seg], table[full - (r + 1) * seg:full - r * seg]])
        assert np.array_equal(cpp(seq_len, cp_size, r), te)


# -- (2) rotating the local slices == rotating the whole sequence ---------------------------------------
@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("seq_len, cp_size", [(16, 2), (24, 3), (16, 4), (9, 1)])
def test_bshd_local_rotation_equals_global(backend, seq_len, cp_size):
    rng = np.random.default_rng(seq_len * 10 + cp_size)
    x = rng.standard_normal((2, seq_len, 3, 16))
    whole = rotary.apply(x, spec=SPEC, seq_axis=-3, backend=backend)
    out = np.full_like(x, np.nan)
    for r in range(cp_size):
        pos = cpp(seq_len, cp_size, r)
        x_local = np.ascontiguousarray(x[:, pos])            # (B, seq_len // cp_size, H, D) on rank r
        out[:, pos] = rotary.apply(x_local, pos, spec=SPEC, seq_axis=-3, backend=backend)
    np.testing.assert_allclose(out, whole, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", backend_params())
def test_sbhd_apply_qk_gqa_local_rotation_equals_global(backend):
    rng = np.random.default_rng(7)
    seq_len, cp_size = 24, 3
    q = rng.standard_normal((seq_len, 2, 4, 16)).astype(np.float32)   # sbhd
    k = rng.standard_normal((seq_len, 2, 2, 16)).astype(np.float32)
    wq, wk = rotary.apply_qk(q, k, spec=SPEC, seq_axis=0, backend=backend)
    oq, ok = np.full_like(q, np.nan), np.full_like(k, np.nan)
    for r in range(cp_size):
        pos = cpp(seq_len, cp_size, r)
        oq[pos], ok[pos] = rotary.apply_qk(q[pos], k[pos], pos, spec=SPEC, seq_axis=0, backend=backend)
    np.testing.assert_allclose(oq, wq, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(ok, wk, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("cu, cp_size", [
    ([0, 8, 12, 12, 36], 2),
    ([0, 6, 18, 18, 30, 54], 3),
    ([0, 3, 5, 12], 1),
])
def test_thd_local_rotation_equals_global(backend, cu, cp_size):
    rng = np.random.default_rng(len(cu) + cp_size)
    cu = np.asarray(cu, np.int32)
    x = rng.standard_normal((int(cu[-1]), 3, 16))
    k = rng.standard_normal((int(cu[-1]), 1, 16))
    whole = rotary.apply(x, spec=SPEC, seq_axis=0, cu_seqlens=cu, backend=backend)
    wq, wk = rotary.apply_qk(x, k, spec=SPEC, seq_axis=0, cu_seqlens=cu, backend=backend)
    out, oq, ok = np.full_like(x, np.nan), np.full_like(x, np.nan), np.full_like(k, np.nan)
    for r in range(cp_size):
        pos, local_cu = cpp(cu_seqlens=cu, cp_size=cp_size, cp_rank=r)
        idx = _thd_global_indices(pos, local_cu, cu)          # the rank's (T // cp_size, H, D) tokens
        out[idx] = rotary.apply(x[idx], pos, spec=SPEC, seq_axis=0, backend=backend)
        oq[idx], ok[idx] = rotary.apply_qk(x[idx], k[idx], pos, spec=SPEC, seq_axis=0, backend=backend)
    np.testing.assert_allclose(out, whole, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(oq, wq, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ok, wk, rtol=1e-12, atol=1e-12)


# -- (4) errors name the argument ----------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(seq_len=8, cp_size=0, cp_rank=0), ValueError, r"cp_size must be >= 1, got 0"),
    (dict(seq_len=8, cp_size=-2, cp_rank=0), ValueError, r"cp_size must be >= 1"),
    (dict(seq_len=8, cp_size=2.0, cp_rank=0), TypeError, r"cp_size must be an integer"),
    (dict(seq_len=8, cp_size=True, cp_rank=0), TypeError, r"cp_size must be an integer"),
    (dict(seq_len=8, cp_size=2, cp_rank=2), ValueError, r"cp_rank must be in \[0, cp_size\) = \[0, 2\), got 2"),
    (dict(seq_len=8, cp_size=2, cp_rank=-1), ValueError, r"cp_rank must be in"),
    (dict(seq_len=8, cp_size=2, cp_rank="0"), TypeError, r"cp_rank must be an integer"),
    (dict(seq_len=8, cp_size=2), TypeError, r"cp_size= and cp_rank="),
    (dict(seq_len=6, cp_size=2, cp_rank=0), ValueError, r"seq_len must be a multiple of 2 \* cp_size = 4.*got 6"),
    (dict(seq_len=8, cp_size=3, cp_rank=1), ValueError, r"seq_len must be a multiple of 2 \* cp_size = 6"),
    (dict(seq_len=-4, cp_size=2, cp_rank=0), ValueError, r"seq_len must be >= 0"),
    (dict(seq_len=8.0, cp_size=2, cp_rank=0), TypeError, r"seq_len must be an integer"),
    (dict(cp_size=2, cp_rank=0), TypeError, r"exactly one of seq_len .* or cu_seqlens"),
    (dict(seq_len=8, cu_seqlens=[0, 8], cp_size=2, cp_rank=0), TypeError, r"exactly one of seq_len"),
    (dict(cu_seqlens=[0, 4, 6], cp_size=2, cp_rank=0), ValueError,
     r"cu_seqlens: every sequence length must be a multiple of 2 \* cp_size = 4.*sequence 1 has 2 tokens"),
    (dict(cu_seqlens=[1, 4], cp_size=1, cp_rank=0), ValueError, r"cu_seqlens must start at 0"),
    (dict(cu_seqlens=[0, 8, 4], cp_size=2, cp_rank=0), ValueError, r"cu_seqlens must be non-decreasing"),
    (dict(cu_seqlens=[], cp_size=2, cp_rank=0), ValueError, r"cu_seqlens must be a 1-D array"),
    (dict(cu_seqlens=[[0, 4]], cp_size=2, cp_rank=0), ValueError, r"cu_seqlens must be a 1-D array"),
    (dict(cu_seqlens=[0.0, 4.0], cp_size=2, cp_rank=0), TypeError, r"cu_seqlens must have an integer dtype"),
    (dict(cu_seqlens=np.array([0, 4]) > 0, cp_size=2, cp_rank=0), TypeError, r"cu_seqlens must be an integer"),
])
def test_errors_name_the_argument(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        cpp(**kwargs)


def test_exported():
    assert "context_parallel_positions" in rotary.__all__
    assert rotary.context_parallel_positions is rotary.spec.positions.context_parallel_positions
