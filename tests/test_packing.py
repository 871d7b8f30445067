"""Packed variable-length batches (cu_seqlens, flash-attn's varlen/THD form): rotary.spec.packing and
``cu_seqlens=`` on apply/apply_qk, against each sequence rotated alone and the float64 oracle, on every
backend (the CUDA kernels through the host shim)."""

import numpy as np
import pytest

import rotary
from rotary import RopeSpec, testing
from rotary.spec.packing import pack

from .conftest import backend_params
from .test_cuda_kernels_cpu import kernels, use_backend  # noqa: F401  (host-shim fixtures)

SPEC = RopeSpec(32, base=10000.0)


# -- rotary.spec.packing ------------------------------------------------------------------------------
def test_pack_positions_and_ids():
    p = pack(np.array([0, 3, 3, 7], np.int32), 7, seqlen_offsets=[5, 0, 100])
    assert p.positions.dtype == np.int64 and p.seq_ids.dtype == np.int64
    assert p.positions.tolist() == [5, 6, 7, 100, 101, 102, 103]
    assert p.seq_ids.tolist() == [0, 0, 0, 2, 2, 2, 2]
    assert p.lengths.tolist() == [3, 0, 4] and p.starts.tolist() == [0, 3, 3]
    assert p.n_seqs == 3 and p.n_tokens == 7
    q = pack([0, 2], 2, seqlen_offsets=9)
    assert q.positions.tolist() == [9, 10] and q.offsets.tolist() == [9]
    empty = pack([0], 0)
    assert empty.n_seqs == 0 and empty.positions.shape == (0,)


@pytest.mark.parametrize("cu, n, match", [
    ([1, 3, 5], 5, "start at 0"),
    ([0, 3, 2, 5], 5, "non-decreasing"),
    ([0, 3, 4], 5, "end at the token count 5"),
    ([], 0, "must be a 1-D array"),
    ([[0, 1]], 1, "must be a 1-D array"),
])
def test_pack_bad_cu_seqlens(cu, n, match):
    with pytest.raises(ValueError, match="cu_seqlens.*" + match):
        pack(np.asarray(cu, dtype=np.int64), n)


def test_pack_bad_types_and_offsets():
    with pytest.raises(TypeError, match="cu_seqlens must have an integer dtype"):
        pack(np.array([0.0, 2.0]), 2)
    with pytest.raises(TypeError, match="cu_seqlens.*bool"):
        pack(np.array([False, True]), 1)
    with pytest.raises(ValueError, match=r"seqlen_offsets must have one offset per sequence, shape \(2,\)"):
        pack([0, 1, 3], 3, seqlen_offsets=[1, 2, 3])
    with pytest.raises(TypeError, match="seqlen_offsets must have an integer dtype"):
        pack([0, 1, 3], 3, seqlen_offsets=np.array([1.0, 2.0]))


# -- apply / apply_qk with cu_seqlens --------------------------------------------------------------
def _packed_case(rng, dtype, lengths=(5, 1, 0, 12, 3), hq=4, hk=2, d=32):
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    T = int(cu[-1])
    q = rng.standard_normal((T, hq, d)).astype(dtype)
    k = rng.standard_normal((T, hk, d)).astype(dtype)
    offsets = rng.integers(0, 3000, size=len(lengths))
    return cu, q, k, offsets


def _oracle(x, cu, offsets, spec):
    """float64 rotation of each packed sequence alone, positions offset + 0..len-1."""
    y = np.empty(x.shape, np.float64)
    for n in range(len(cu) - 1):
        a, b = cu[n], cu[n + 1]
        pos = offsets[n] + np.arange(b - a)
        xs = np.moveaxis(np.asarray(x[a:b], np.float64), 0, -2)   # (H, len, d)
        y[a:b] = np.moveaxis(testing.rope_2x2(xs, pos, spec.inv_freq(), layout=spec.layout,
                                              scale=spec.attention_scaling), -2, 0)
    return y


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("backend", backend_params())
def test_apply_qk_packed_matches_each_sequence_alone(backend, dtype, layout, rng):
    spec = RopeSpec(32, base=10000.0, layout=layout)
    cu, q, k, offsets = _packed_case(rng, dtype)
    q_rot, k_rot = rotary.apply_qk(q, k, spec=spec, seq_axis=0, cu_seqlens=cu, seqlen_offsets=offsets,
                                   backend=backend)
    testing.assert_close(q_rot, _oracle(q, cu, offsets, spec), like=q)
    testing.assert_close(k_rot, _oracle(k, cu, offsets, spec), like=k)
    for n in range(len(cu) - 1):   # the same as running each sequence alone
        a, b = cu[n], cu[n + 1]
        qa, ka = rotary.apply_qk(q[a:b], k[a:b], int(offsets[n]), spec=spec, seq_axis=0, backend=backend)
        np.testing.assert_array_equal(q_rot[a:b], qa)
        np.testing.assert_array_equal(k_rot[a:b], ka)
    # apply: positions restart at 0 without offsets; (1, T, H, D) works as packed input too
    x_rot = rotary.apply(q[None], spec=spec, seq_axis=1, cu_seqlens=cu, backend=backend)
    testing.assert_close(x_rot[0], _oracle(q, cu, np.zeros(len(cu) - 1, int), spec), like=q)


@pytest.mark.parametrize("backend", backend_params())
def test_apply_packed_in_place_and_explicit_positions(backend, rng):
    cu, q, _, offsets = _packed_case(rng, np.float32)
    expected = _oracle(q, cu, offsets, SPEC)
    x = q.copy()
    assert rotary.apply(x, spec=SPEC, seq_axis=0, cu_seqlens=cu, seqlen_offsets=offsets, out=x,
                        backend=backend) is x
    testing.assert_close(x, expected, like=q)
    pos = pack(cu, q.shape[0], offsets).positions
    np.testing.assert_array_equal(rotary.apply(q, pos, spec=SPEC, seq_axis=0, cu_seqlens=cu, backend=backend), x)


def test_apply_packed_cuda_kernels_through_host_shim(use_backend, rng):  # noqa: F811 (the fixture)
    name = use_backend(threads=32, max_tokens_per_block=3)
    for dtype in (np.float32, np.float64):
        cu, q, k, offsets = _packed_case(rng, dtype)
        q_rot, k_rot = rotary.apply_qk(q, k, spec=SPEC, seq_axis=0, cu_seqlens=cu, seqlen_offsets=offsets,
                                       backend=name)
        testing.assert_close(q_rot, _oracle(q, cu, offsets, SPEC), like=q)
        testing.assert_close(k_rot, _oracle(k, cu, offsets, SPEC), like=k)


def test_apply_packed_bad_input(rng):
    cu, q, k, _ = _packed_case(rng, np.float32)
    T = q.shape[0]
    with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
        rotary.apply(q, spec=SPEC, seq_axis=0, cu_seqlens=cu + 1)
    with pytest.raises(ValueError, match="cu_seqlens must end at the token count"):
        rotary.apply(q, spec=SPEC, seq_axis=0, cu_seqlens=np.array([0, T - 1]))
    with pytest.raises(ValueError, match="pass seq_axis=0"):
        rotary.apply(q, spec=SPEC, cu_seqlens=cu, seq_axis=-2)   # seq_axis=-2 reads the heads axis as tokens
    with pytest.raises(ValueError, match="non-decreasing"):
        rotary.apply_qk(q, k, spec=SPEC, seq_axis=0, cu_seqlens=np.array([0, 4, 2, T]))
    with pytest.raises(ValueError, match="seqlen_offsets must have one offset per sequence"):
        rotary.apply(q, spec=SPEC, seq_axis=0, cu_seqlens=cu, seqlen_offsets=[1, 2])
    with pytest.raises(ValueError, match="cu_seqlens needs packed input"):
        rotary.apply(np.stack([q, q]), spec=SPEC, seq_axis=1, cu_seqlens=cu)
    with pytest.raises(ValueError, match="seqlen_offsets needs cu_seqlens"):
        rotary.apply(q, spec=SPEC, seq_axis=0, seqlen_offsets=[1])
    with pytest.raises(ValueError, match="not both"):
        rotary.apply(q, np.arange(T), spec=SPEC, seq_axis=0, cu_seqlens=cu, seqlen_offsets=0)


@pytest.mark.parametrize("backend", backend_params())
def test_apply_packed_mrope_text_positions(backend, rng):
    """An M-RoPE spec: packed text tokens get their restarted position on every axis, as each sequence alone."""
    spec = RopeSpec(32, mrope_section=(4, 6, 6))
    cu, q, _, offsets = _packed_case(rng, np.float32)
    y = rotary.apply(q, spec=spec, seq_axis=0, cu_seqlens=cu, seqlen_offsets=offsets, backend=backend)
    for n in range(len(cu) - 1):
        a, b = cu[n], cu[n + 1]
        np.testing.assert_array_equal(y[a:b], rotary.apply(q[a:b], int(offsets[n]), spec=spec, seq_axis=0,
                                                           backend=backend))
    testing.assert_close(y, _oracle(q, cu, offsets, spec), like=q)   # text tokens: plain 1-D RoPE
