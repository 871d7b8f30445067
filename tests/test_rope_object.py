"""rotary.Rope: the prepared object gives apply/apply_qk's results (bit for bit) on every call form, through
its fast path (prepared geometry) and its general path, on NumPy, Numba and the CUDA kernels via the host
shim (the same launch path as CuPy: prepared launch arguments, one launch per call)."""

import numpy as np
import pytest

import rotary
from rotary.backends import cupy as cuda_backend
from rotary import RopeSpec, testing

from .conftest import backend_params
from .cuda_shim import host
from .test_cuda_kernels_cpu import kernels  # noqa: F401  (host-shim fixture)

SPEC = RopeSpec(32, base=10000.0)


def _qk(rng, dtype, B=3, S=2, Hq=4, Hk=2, D=32):
    return (rng.standard_normal((B, S, Hq, D)).astype(dtype), rng.standard_normal((B, S, Hk, D)).astype(dtype))


POSITIONS = {
    "none": lambda rng, B, S: None,
    "offset": lambda rng, B, S: 300,
    "shared": lambda rng, B, S: rng.integers(0, 600, size=S),
    "per_batch": lambda rng, B, S: rng.integers(0, 600, size=(B, S)),
    "int32": lambda rng, B, S: rng.integers(0, 600, size=(B, S)).astype(np.int32),
    "past_table": lambda rng, B, S: rng.integers(5000, 9000, size=(B, S)),
    "negative": lambda rng, B, S: -rng.integers(1, 50, size=(B, S)),
}


@pytest.mark.parametrize("kind", list(POSITIONS))
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("backend", backend_params())
def test_rope_equals_apply_qk(backend, dtype, kind, rng):
    if backend == "cupy":
        pytest.skip("the CuPy path is checked on the GPU (benchmarks/gpu_check.py) and through the host shim")
    rope = rotary.Rope(SPEC, backend=backend, dtype=dtype, seq_axis=-2)
    q, k = _qk(rng, dtype)
    for step in range(3):   # first call: validation + preparation; later calls: the prepared path
        pos = POSITIONS[kind](rng, 3, 2)
        got = rope(q, k, pos, seq_axis=1)
        want = rotary.apply_qk(q, k, pos, spec=SPEC, seq_axis=1, backend=backend)
        for g, w in zip(got, want):
            assert type(g) is np.ndarray and g.dtype == dtype
            np.testing.assert_array_equal(g, w)
        x = rope.apply(k, pos, seq_axis=1, inverse=True)
        np.testing.assert_array_equal(x, rotary.apply(k, pos, spec=SPEC, seq_axis=1, inverse=True, backend=backend))
    if backend != "numpy" and kind not in ("int32", "negative"):
        assert rope._plans, "the prepared path was never taken"


@pytest.mark.parametrize("backend", backend_params())
def test_rope_in_place_bhsd_packed_and_oracle(backend, rng):
    if backend == "cupy":
        pytest.skip("checked through the host shim here")
    rope = rotary.Rope(SPEC, backend=backend, dtype=np.float64, max_positions=1024, seq_axis=-2)
    q, k = (np.swapaxes(a, 1, 2).copy() for a in _qk(rng, np.float64))   # BHSD
    for _ in range(2):
        pos = rng.integers(0, 1024, size=(3, 2))
        qq, kk = q.copy(), k.copy()
        res = rope(qq, kk, pos, out=(qq, kk))
        assert res[0] is qq and res[1] is kk
        testing.assert_close(qq, testing.rope_2x2(q, pos[:, None, :], SPEC.inv_freq()))
        testing.assert_close(kk, testing.rope_2x2(k, pos[:, None, :], SPEC.inv_freq()))
    t = rng.standard_normal((7, 4, 32))   # packed (T, H, D)
    cu = np.array([0, 2, 7])
    for _ in range(2):
        got = rope.apply(t, seq_axis=0, cu_seqlens=cu, seqlen_offsets=[5, 9])
        np.testing.assert_array_equal(got, rotary.apply(t, spec=SPEC, seq_axis=0, cu_seqlens=cu,
                                                        seqlen_offsets=[5, 9], backend=backend))


def _shim_rope(kernels, rng):  # noqa: F811
    """A Rope whose CuPy launch path is prepared with the host shim (NumPy arrays, the shim's launcher)."""
    rope = rotary.Rope(SPEC, backend="numpy", dtype=np.float32, seq_axis=-2)
    q, k = _qk(rng, np.float32, B=5, S=1, Hq=8, Hk=2)
    hooks = dict(address=host.address, launch=lambda plan, name: kernels.launch(plan), empty=np.empty,
                 to_device=lambda a: a)
    rope._prepare_device_path((q, k), seq_axis=1, backend=cuda_backend, **hooks)
    return rope, q, k, hooks


def test_rope_cuda_launch_path_through_host_shim(kernels, rng):  # noqa: F811
    """The CuPy path's prepared launch (template + array slots) with the shim's launcher on NumPy arrays."""
    rope, q, k, hooks = _shim_rope(kernels, rng)
    for step in range(3):
        pos = rng.integers(0, 3000, size=(5, 1))   # past the first table: it grows
        qr, kr = rope(q, k, pos, seq_axis=1)
        testing.assert_close(qr, np.swapaxes(testing.rope_2x2(np.swapaxes(q, 1, 2), pos[:, None, :],
                                                              SPEC.inv_freq()), 1, 2), like=q)
        testing.assert_close(kr, np.swapaxes(testing.rope_2x2(np.swapaxes(k, 1, 2), pos[:, None, :],
                                                              SPEC.inv_freq()), 1, 2), like=k)
    qq, kk = q.copy(), k.copy()
    rope._prepare_device_path((qq, kk), (qq, kk), seq_axis=1, backend=cuda_backend, **hooks)
    rope(qq, kk, pos, seq_axis=1, out=(qq, kk))
    np.testing.assert_array_equal(qq, qr)


@pytest.mark.parametrize("in_place", [False, True])
def test_rope_cupy_device_positions(in_place, rng):
    """On the GPU: the prepared launch with CuPy arrays and device positions equals apply_qk."""
    reasons = rotary.available_backends()
    if not reasons["cupy"][0]:
        pytest.skip(reasons["cupy"][1])
    import cupy

    rope = rotary.Rope(SPEC, backend="cupy", dtype=np.float32, max_positions=4096, seq_axis=-2)
    q, k = (cupy.asarray(a) for a in _qk(rng, np.float32, B=32, S=1, Hq=8, Hk=2))
    for _ in range(3):
        pos = cupy.asarray(rng.integers(0, 4096, size=(32, 1)))
        want = rotary.apply_qk(q, k, pos, spec=SPEC, seq_axis=1, backend="cupy")
        if in_place:
            qq, kk = q.copy(), k.copy()
            got = rope(qq, kk, pos, seq_axis=1, out=(qq, kk))
        else:
            got = rope(q, k, pos, seq_axis=1)
        for g, w in zip(got, want):
            assert type(g) is cupy.ndarray
            np.testing.assert_array_equal(cupy.asnumpy(g), cupy.asnumpy(w))
    assert rope._plans


def test_rope_bad_input(rng):
    with pytest.raises(TypeError, match="spec must be a rotary.RopeSpec"):
        rotary.Rope(32, seq_axis=-2)
    with pytest.raises(TypeError, match="dtype must be float16, float32 or float64"):
        rotary.Rope(SPEC, dtype=np.int32, seq_axis=-2)
    with pytest.raises(ValueError, match="max_positions must be > 0"):
        rotary.Rope(SPEC, max_positions=0, seq_axis=-2)
    with pytest.raises(ValueError, match="backend must be"):
        rotary.Rope(SPEC, backend="tpu", seq_axis=-2)
    rope = rotary.Rope(SPEC, backend="numpy", seq_axis=-2)
    q, k = _qk(rng, np.float32)
    rope(q, k, seq_axis=1)
    rope(q, k, seq_axis=1)
    with pytest.raises(ValueError, match="positions of shape"):
        rope(q, k, np.arange(3), seq_axis=1)
    with pytest.raises(TypeError, match="out must be None or a pair"):
        rope(q, k, seq_axis=1, out=q)
    with pytest.raises(ValueError, match="cu_seqlens must end at the token count"):
        rope.apply(q[0], seq_axis=0, cu_seqlens=[0, 1])


OFFSET_SPEC = RopeSpec(48, rotary_dim=16, rotary_offset=24, layout="interleaved")   # [24 | rope 16 | 8]


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("seq_axis", [1, 2])
@pytest.mark.parametrize("in_place", [False, True])
def test_rope_fast_path_with_rotary_offset(dtype, seq_axis, in_place, rng):
    """The prepared Numba path rotates from the offset on: bit for bit apply_qk, nope part untouched."""
    rope = rotary.Rope(OFFSET_SPEC, backend="numba", dtype=dtype, seq_axis=-2)
    q, k = _qk(rng, dtype, D=48)
    if seq_axis == 2:
        q, k = (np.swapaxes(a, 1, 2).copy() for a in (q, k))   # BHSD, contiguous
    for _ in range(3):
        pos = rng.integers(0, 600, size=(3, 2))
        want = rotary.apply_qk(q, k, pos, spec=OFFSET_SPEC, seq_axis=seq_axis, backend="numba")
        if in_place:
            qq, kk = q.copy(), k.copy()
            got = rope(qq, kk, pos, seq_axis=seq_axis, out=(qq, kk))
            assert got[0] is qq and got[1] is kk
        else:
            got = rope(q, k, pos, seq_axis=seq_axis)
        for g, w, x in zip(got, want, (q, k)):
            np.testing.assert_array_equal(g, w)
            assert np.array_equal(g[..., :24], x[..., :24]) and np.array_equal(g[..., 40:], x[..., 40:])
    assert rope._plans, "the prepared path was never taken"


@pytest.mark.parametrize("in_place", [False, True])
def test_rope_cuda_launch_path_with_rotary_offset(kernels, in_place, rng):  # noqa: F811
    """The CuPy launch path's pointers start at the offset; the nope part is copied or left alone."""
    rope = rotary.Rope(OFFSET_SPEC, backend="numpy", dtype=np.float32, seq_axis=-2)
    q, k = _qk(rng, np.float32, B=5, S=1, Hq=8, Hk=2, D=48)
    hooks = dict(address=host.address, launch=lambda plan, name: kernels.launch(plan), empty=np.empty,
                 to_device=lambda a: a)
    qq, kk = (q.copy(), k.copy()) if in_place else (q, k)
    rope._prepare_device_path((qq, kk), (qq, kk) if in_place else None, seq_axis=1, backend=cuda_backend, **hooks)
    pos = rng.integers(0, 3000, size=(5, 1))
    want = [np.swapaxes(testing.rope_complex(np.swapaxes(a, 1, 2), pos[:, None, :], OFFSET_SPEC.inv_freq(),
                                             layout="interleaved", rotary_offset=24), 1, 2) for a in (q, k)]
    got = rope(qq, kk, pos, seq_axis=1, out=(qq, kk) if in_place else None)
    for g, w, x in zip(got, want, (q, k)):
        testing.assert_close(g, w, like=x)
        assert np.array_equal(g[..., :24], x[..., :24]) and np.array_equal(g[..., 40:], x[..., 40:])


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_rope_fast_path_bhsd_out_of_place(dtype, rng):
    """A BHSD call with a new output: the prepared geometry must be that of the output the call allocates
    (x's shape: a transposed canonical view), not of a BSHD-ordered buffer (calls 2.. were wrong)."""
    rope = rotary.Rope(SPEC, backend="numba", dtype=dtype, seq_axis=-2)
    q, k = (np.swapaxes(a, 1, 2).copy() for a in _qk(rng, dtype))   # (B, H, S, D)
    for _ in range(3):
        pos = rng.integers(0, 600, size=(3, 2))
        for g, w in zip(rope(q, k, pos, seq_axis=2), rotary.apply_qk(q, k, pos, spec=SPEC, seq_axis=2, backend="numba")):
            np.testing.assert_array_equal(g, w)
    assert rope._plans


@pytest.mark.parametrize("backend", ["numba", "numpy"])
def test_rope_decoding_far_from_zero_stays_prepared(backend, rng):
    """Positions past the dense table (a long context): Rope holds a window of the table (rows =
    positions - base) and keeps giving the float64 oracle's results, step after step and across windows."""
    if not rotary.available_backends()[backend][0]:
        pytest.skip(rotary.available_backends()[backend][1])
    spec = RopeSpec(64, base=5e5)
    rope = rotary.Rope(spec, backend=backend, dtype=np.float64, seq_axis=-2)
    q, k = _qk(rng, np.float64, B=4, S=1, Hq=4, Hk=2, D=64)
    start = 3_000_000 - 100
    for step in range(0, 700, 7):
        pos = start + step + np.arange(4, dtype=np.int64)[:, None] * 3
        qr, kr = rope(q, k, pos, seq_axis=1)
        for x, r in ((q, qr), (k, kr)):
            want = np.swapaxes(testing.rope_2x2(np.swapaxes(x, 1, 2), pos[:, None, :], spec.inv_freq()), 1, 2)
            testing.assert_close(r, want, like=x)
    if backend == "numba":
        assert rope._plans and rope._table[0] > 0   # the prepared path with a window table
    if backend == "numba":
        for _ in range(2):                         # (the first call of a new geometry prepares it)
            rope(q, k, 5, seq_axis=1)              # back near 0: the dense table again
        assert rope._table[0] == 0


def test_rope_cuda_launch_path_far_positions_through_host_shim(kernels, rng):  # noqa: F811
    """The CuPy launch path with host positions far from 0 (a window table, rows shifted on the host)."""
    rope, q, k, hooks = _shim_rope(kernels, rng)
    for step in range(3):
        pos = 2**33 + 1000 * step + rng.integers(0, 50, size=(5, 1))
        qr, kr = rope(q, k, pos, seq_axis=1)
        assert rope._table[0] > 0
        for x, r in ((q, qr), (k, kr)):
            want = np.swapaxes(testing.rope_2x2(np.swapaxes(x, 1, 2).astype(np.float64), pos[:, None, :],
                                                SPEC.inv_freq()), 1, 2)
            testing.assert_close(r, want, like=x)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_rope_numba_positions_checked_by_the_kernel(dtype, rng):
    """The prepared Numba path hands positions to the kernel as they are (the kernel checks them against the
    table and writes nothing when one falls outside): in place, a step past the table grows it and still
    equals the float64 oracle; positions near the int64 limit give apply_qk's error, not wrapped rows."""
    spec = RopeSpec(32, base=10000.0)
    rope = rotary.Rope(spec, backend="numba", dtype=dtype, max_positions=16, seq_axis=-2)
    q, k = _qk(rng, dtype, B=3, S=1)
    qi, ki = q.copy(), k.copy()
    for pos in (np.array([[1], [2], [3]]), np.array([[4], [40_000], [5]]), np.array([[7], [8], [9]]), 12):
        rope(qi, ki, pos, seq_axis=1, out=(qi, ki))
        p = np.broadcast_to(np.asarray(pos), (3, 1))
        for x, r in ((q, qi), (k, ki)):
            want = np.swapaxes(testing.rope_2x2(np.swapaxes(x, 1, 2), p[:, None, :], spec.inv_freq()), 1, 2)
            testing.assert_close(r, want, like=x)
        qi[...], ki[...] = q, k
    assert rope._plans and rope._table[1] > 40_000
    big = np.array([[0], [2 ** 63 - 1], [5]])   # the largest int64 position: rotated, as apply_qk does
    for got, want in zip(rope(q, k, big, seq_axis=1), rotary.apply_qk(q, k, big, spec=spec, seq_axis=1)):
        np.testing.assert_array_equal(got, want)
    q2, k2 = _qk(rng, dtype, B=3, S=2)
    for pos in (2 ** 63 - 1, 2 ** 63):   # a second token past the int64 limit, an offset past it
        with pytest.raises((ValueError, OverflowError)) as got:
            rope(q2, k2, pos, seq_axis=1)
        with pytest.raises(got.type) as want:
            rotary.apply_qk(q2, k2, pos, spec=spec, seq_axis=1, backend="numba")
        assert str(got.value) == str(want.value)


def _count_general_calls(monkeypatch):
    """A list that gets one entry per call of the general path (rotate_arrays) made by Rope."""
    import rotary.frontend.rope as rope_module

    calls, general = [], rope_module.rotate_arrays
    monkeypatch.setattr(rope_module, "rotate_arrays", lambda *a, **kw: calls.append(1) or general(*a, **kw))
    return calls


@pytest.mark.parametrize("spec", [SPEC, OFFSET_SPEC], ids=["plain", "offset"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_rope_separate_out_buffers_take_the_prepared_path(spec, dtype, rng, monkeypatch):
    """out=(q_out, k_out) with separate preallocated buffers (a flash-attn user's habit): after the first
    call, every call takes the prepared path, writes into the buffers and returns them, equal to the
    float64 oracle and to apply_qk bit for bit; the inputs are not modified."""
    if not rotary.available_backends()["numba"][0]:
        pytest.skip(rotary.available_backends()["numba"][1])
    rope = rotary.Rope(spec, backend="numba", dtype=dtype, seq_axis=-2)
    q, k = _qk(rng, dtype, B=4, S=1, Hq=8, Hk=2, D=spec.head_dim)
    q0, k0 = q.copy(), k.copy()
    q_out, k_out = np.empty_like(q), np.empty_like(k)
    steps = [rng.integers(0, 3000, size=(4, 1)) for _ in range(4)]   # past the first table on some: it grows
    wants = [rotary.apply_qk(q, k, pos, spec=spec, seq_axis=1, backend="numba") for pos in steps]
    calls = _count_general_calls(monkeypatch)
    for pos, want in zip(steps, wants):
        got = rope(q, k, pos, seq_axis=1, out=(q_out, k_out))
        assert got[0] is q_out and got[1] is k_out
        np.testing.assert_array_equal(q_out, want[0])
        np.testing.assert_array_equal(k_out, want[1])
        for x, y in ((q, q_out), (k, k_out)):
            oracle = np.swapaxes(testing.rope_2x2(np.swapaxes(x[..., spec.rotary_offset:], 1, 2), pos[:, None, :],
                                                  spec.inv_freq(), layout=spec.layout), 1, 2)
            testing.assert_close(y[..., spec.rotary_offset:], oracle, like=x)
            np.testing.assert_array_equal(y[..., :spec.rotary_offset], x[..., :spec.rotary_offset])
    np.testing.assert_array_equal(q, q0)
    np.testing.assert_array_equal(k, k0)
    assert len(calls) == 1, f"the general path ran {len(calls)} times (only the first call should)"


def test_rope_separate_out_buffers_keep_the_overlap_rules(rng, monkeypatch):
    """Buffers that alias an input or each other, or that the prepared path cannot write, are refused with
    the general path's errors after a geometry was prepared (no silent fast path)."""
    if not rotary.available_backends()["numba"][0]:
        pytest.skip(rotary.available_backends()["numba"][1])
    rope = rotary.Rope(SPEC, backend="numba", dtype=np.float32, seq_axis=-2)
    q, k = _qk(rng, np.float32, B=4, S=1, Hq=2, Hk=2)
    q_out, k_out = np.empty_like(q), np.empty_like(k)
    rope(q, k, 5, seq_axis=1, out=(q_out, k_out))   # prepares the geometry
    with pytest.raises(ValueError, match="overlaps"):
        rope(q, k, 5, seq_axis=1, out=(k, q))            # each out is the other input
    with pytest.raises(ValueError, match="overlap"):
        rope(q, k, 5, seq_axis=1, out=(q_out, q_out))    # one buffer for both
    both = np.empty((2,) + q.shape, np.float32)
    rope(q, k, 5, seq_axis=1, out=(both[0], both[1]))    # disjoint views of one buffer are fine
    want = rotary.apply_qk(q, k, 5, spec=SPEC, seq_axis=1)
    np.testing.assert_array_equal(both[0], want[0])
    np.testing.assert_array_equal(both[1], want[1])
    with pytest.raises(ValueError, match="dtype"):
        rope(q, k, 5, seq_axis=1, out=(q_out.astype(np.float64), k_out))
    with pytest.raises(TypeError, match="out"):
        rope(q, k, 5, seq_axis=1, out=(q_out.tolist(), k_out))   # not an array
    read_only = np.empty_like(q)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        rope(q, k, 5, seq_axis=1, out=(read_only, k_out))
    strided = np.empty(q.shape[:-1] + (2 * q.shape[-1],), np.float32)[..., ::2]   # not contiguous: general path
    got = rope(q, k, 5, seq_axis=1, out=(strided, k_out))
    np.testing.assert_array_equal(got[0], want[0])


def test_rope_checks_the_same_buffers_by_identity(rng, monkeypatch):
    """A call with the last call's live arrays, unchanged, skips the plan key and the overlap tests (their verdict
    holds for the same addresses and extents: CheckedBuffers); any change is seen: an out flagged read-only, an
    out reshaped in place, another object over the same memory, an out that now is the other input. The record
    holds the arrays by weak reference: dropping them frees them."""
    import gc
    import weakref

    from rotary.frontend import buffers, rope as rope_module

    if not rotary.available_backends()["numba"][0]:
        pytest.skip(rotary.available_backends()["numba"][1])
    checks = []
    monkeypatch.setattr(rope_module, "check_memory", lambda *a: (checks.append(1), buffers.check_memory(*a))[1])
    rope = rotary.Rope(SPEC, backend="numba", dtype=np.float32, seq_axis=-2)
    q, k = _qk(rng, np.float32, B=4, S=1, Hq=2, Hk=2)
    q_out, k_out = np.empty_like(q), np.empty_like(k)
    want = rotary.apply_qk(q, k, 5, spec=SPEC, seq_axis=1)
    for _ in range(3):
        rope(q, k, 5, seq_axis=1, out=(q_out, k_out))
        np.testing.assert_array_equal(q_out, want[0])
    assert len(checks) == 1   # the first prepared call checked; the same buffers again did not need to
    q_out.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        rope(q, k, 5, seq_axis=1, out=(q_out, k_out))
    q_out.flags.writeable = True
    rope(q, k, 5, seq_axis=1, out=(q_out, k_out))
    with pytest.raises(ValueError, match="overlaps"):
        rope(q, k, 5, seq_axis=1, out=(k, q))
    alias = q_out.view()   # another object over the same memory: checked again (and valid)
    n = len(checks)
    rope(q, k, 5, seq_axis=1, out=(alias, k_out))
    assert len(checks) == n + 1
    flat = q_out.reshape(-1)
    flat.shape = q_out.shape[::-1]   # the same object, reshaped in place: a miss, then the general path's error
    with pytest.raises(ValueError, match="shape"):
        rope(q, k, 5, seq_axis=1, out=(flat, k_out))
    q_out2, k_out2 = np.empty_like(q), np.empty_like(k)
    rope(q, k, 5, seq_axis=1, out=(q_out2, k_out2))
    ref = weakref.ref(q_out2)
    del q_out2
    gc.collect()
    assert ref() is None   # the record does not keep the caller's buffers alive


def test_checked_buffers_see_every_change_of_a_live_array():
    """CheckedBuffers.same: the recorded live objects, unchanged, are a hit; another extra key, an array where a
    None was, another object over the same memory, a shape, dtype, strides or writeable flag changed in place are
    each a miss (a C-contiguous record is checked by shape and that flag, any other by its strides); an object at
    two positions (in place) is checked once and must stand at both again."""
    import warnings

    from rotary.frontend.buffers import CheckedBuffers

    a = np.zeros((4, 1, 6), np.float32)
    s = np.zeros((4, 12), np.float32)[:, ::2]   # not contiguous: its strides are recorded
    record = CheckedBuffers.record((a, s, None), ("x", 1), "plan")
    assert record.value == "plan" and record.same((a, s, None), ("x", 1))
    assert not record.same((a, s, None), ("x", 2))
    assert not record.same((a, s), ("x", 1))
    assert not record.same((a, s, a), ("x", 1))
    assert not record.same((a.view(), s, None), ("x", 1))
    assert not record.same((s, a, None), ("x", 1))
    a.shape = (4, 6, 1)
    assert not record.same((a, s, None), ("x", 1))
    a.shape = (4, 1, 6)
    a.dtype = np.int32   # the same bytes read as another dtype
    assert not record.same((a, s, None), ("x", 1))
    a.dtype = np.float32
    a.flags.writeable = False
    assert not record.same((a, s, None), ("x", 1))
    a.flags.writeable = True
    assert record.same((a, s, None), ("x", 1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)   # (setting strides in place: deprecated in NumPy 2.4)
        s.strides = (48, 4)
    assert not record.same((a, s, None), ("x", 1))
    b = np.zeros((4, 1, 6), np.float32)   # in place: an object at two positions, checked once, at both again
    in_place = CheckedBuffers.record((a, b, a, b), None, "plan")
    assert len(in_place.held) == 2 and in_place.same((a, b, a, b), None)
    assert not in_place.same((a, b, a.view(), b), None) and not in_place.same((a, b, b, a), None)
    assert not in_place.same((a, b, np.zeros_like(a), b), None)
    c = np.zeros_like(a)
    apart = CheckedBuffers.record((a, b, c, b), None, "plan")
    assert apart.same((a, b, c, b), None)
    assert not apart.same((a, b, a, b), None)   # an out that was apart now is its input: a miss


def test_rope_takes_read_only_and_writable_positions_alike(rng):
    """The prepared Numba path hands the kernel writable positions (its one compiled signature): read-only
    positions are copied, never changed; both give the float64 oracle's results."""
    if not rotary.available_backends()["numba"][0]:
        pytest.skip(rotary.available_backends()["numba"][1])
    rope = rotary.Rope(SPEC, backend="numba", dtype=np.float32, max_positions=4096, seq_axis=-2)
    q, k = _qk(rng, np.float32, B=4, S=1, Hq=4, Hk=2)
    for step in range(4):
        positions = rng.integers(0, 4000, size=(4, 1))
        if step % 2:
            positions.flags.writeable = False
        before = positions.copy()
        got = rope(q, k, positions, seq_axis=1)
        np.testing.assert_array_equal(positions, before)
        assert positions.flags.writeable == (step % 2 == 0)
        for x, y in zip((q, k), got):
            testing.assert_close(y, np.swapaxes(testing.rope_2x2(np.swapaxes(x, 1, 2), positions[:, None, :],
                                                                 SPEC.inv_freq()), 1, 2), like=x)


def test_rope_separate_out_buffers_through_the_cuda_host_shim(kernels, rng):  # noqa: F811
    """The CuPy prepared launch with separate out buffers (host shim): equal to the oracle, into the buffers."""
    rope, q, k, hooks = _shim_rope(kernels, rng)
    q_out, k_out = np.empty_like(q), np.empty_like(k)
    for step in range(3):
        pos = rng.integers(0, 3000, size=(5, 1))
        got = rope(q, k, pos, seq_axis=1, out=(q_out, k_out))
        assert got[0] is q_out and got[1] is k_out
        testing.assert_close(q_out, np.swapaxes(testing.rope_2x2(np.swapaxes(q, 1, 2), pos[:, None, :],
                                                                 SPEC.inv_freq()), 1, 2), like=q)
        testing.assert_close(k_out, np.swapaxes(testing.rope_2x2(np.swapaxes(k, 1, 2), pos[:, None, :],
                                                                 SPEC.inv_freq()), 1, 2), like=k)


def _unaligned_like(x):
    """A copy of x whose data is not aligned to its item size (the entry points are compiled for aligned arrays)."""
    raw = np.empty(x.nbytes + 1, np.uint8)
    y = np.frombuffer(raw.data, dtype=x.dtype, count=x.size, offset=1).reshape(x.shape)
    y.flags.writeable = True
    y[...] = x
    assert not y.flags.aligned
    return y


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_rope_numba_plans_and_what_they_refuse(dtype, rng):
    """After the first call of a geometry, the Numba path runs the plan's prepared rotation. Every later call
    still equals the float64 oracle; arrays that are not aligned to their item size, and positions that are
    not C-contiguous, take the general path, with the same results; the caller's positions stay as they
    were (values and writeable flag)."""
    if not rotary.available_backends()["numba"][0]:
        pytest.skip(rotary.available_backends()["numba"][1])
    spec = RopeSpec(32, base=10000.0)
    rope = rotary.Rope(spec, backend="numba", dtype=dtype, max_positions=4096, seq_axis=-2)
    q, k = _qk(rng, dtype, B=4, S=1, Hq=4, Hk=2)

    def oracle(x, pos):
        p = np.broadcast_to(np.asarray(pos).reshape(-1, 1), (x.shape[0], 1))
        return np.swapaxes(testing.rope_2x2(np.swapaxes(x, 1, 2), p[:, None, :], spec.inv_freq()), 1, 2)

    positions = [rng.integers(0, 4000, size=(4, 1)) for _ in range(3)]
    for pos in positions:
        kept = pos.copy()
        got = rope(q, k, pos, seq_axis=1)
        for x, y in zip((q, k), got):
            testing.assert_close(y, oracle(x, pos), like=x)
        np.testing.assert_array_equal(pos, kept)
        assert pos.flags.writeable
    (plan,) = rope._plans.values()
    assert plan.prepared is not None, "later calls should run the prepared rotation"
    qu, ku = _unaligned_like(q), _unaligned_like(k)
    for x, y in zip((q, k), rope(qu, ku, positions[0], seq_axis=1)):
        testing.assert_close(y, oracle(x, positions[0]), like=x)
    strided = np.repeat(positions[1], 2, axis=0)[::2, 0]   # the (4,) positions at stride 2: a (4, 1) view
    assert not strided[:, None].flags.c_contiguous
    for x, y in zip((q, k), rope(q, k, strided[:, None], seq_axis=1)):
        testing.assert_close(y, oracle(x, positions[1]), like=x)
    q_out, k_out = _unaligned_like(q), _unaligned_like(k)   # unaligned out= buffers
    got = rope(q, k, positions[2], seq_axis=1, out=(q_out, k_out))
    assert got[0] is q_out and got[1] is k_out
    for x, y in zip((q, k), got):
        testing.assert_close(y, oracle(x, positions[2]), like=x)


def test_apply_qk_plans_refuse_unaligned_arrays(rng):
    """apply_qk's plans (prepared after a first call) take unaligned inputs and out= buffers to the general
    path: the same results as aligned copies, equal to the float64 oracle."""
    if not rotary.available_backends()["numba"][0]:
        pytest.skip(rotary.available_backends()["numba"][1])
    spec = RopeSpec(32, base=10000.0)
    q, k = _qk(rng, np.float32, B=4, S=1, Hq=4, Hk=2)
    pos = rng.integers(0, 500, size=(4, 1))
    want = [np.swapaxes(testing.rope_2x2(np.swapaxes(x, 1, 2), pos[:, None, :], spec.inv_freq()), 1, 2)
            for x in (q, k)]
    for _ in range(2):   # the second call runs the plan
        for w, y in zip(want, rotary.apply_qk(q, k, pos, spec=spec, seq_axis=1, backend="numba")):
            testing.assert_close(y, w, like=q)
    for w, y in zip(want, rotary.apply_qk(_unaligned_like(q), _unaligned_like(k), pos, spec=spec, seq_axis=1,
                                          backend="numba")):
        testing.assert_close(y, w, like=q)
    outs = (_unaligned_like(q), _unaligned_like(k))
    got = rotary.apply_qk(q, k, pos, spec=spec, seq_axis=1, backend="numba", out=outs)
    for w, y, o in zip(want, got, outs):
        assert y is o
        testing.assert_close(o, w, like=q)


def test_rope_defaults_to_the_auto_backend(rng, monkeypatch):
    """Rope(spec) picks its backend as every entry point does (backend="auto"): it works on an install without
    numba (the registry refusing it here) and rotates NumPy arrays equal to the float64 oracle."""
    from rotary import backends as _backends

    rope = rotary.Rope(SPEC, seq_axis=-2)
    assert rope.backend == "auto"
    monkeypatch.setattr(_backends, "_loaded", {k: v for k, v in _backends._loaded.items() if k != "numba"})
    monkeypatch.setattr(_backends, "_errors", {**_backends._errors, "numba": "No module named 'numba'"})
    rope = rotary.Rope(SPEC, dtype=np.float32, seq_axis=-2)
    q, k = _qk(rng, np.float32, B=2, S=3, Hq=4, Hk=2, D=SPEC.head_dim)
    pos = np.arange(3) + 5
    for _ in range(2):   # the general path, then the plan
        for x, y in zip((q, k), rope(q, k, pos, seq_axis=1)):
            want = np.swapaxes(testing.rope_2x2(np.swapaxes(x, 1, 2), pos, SPEC.inv_freq()), 1, 2)
            testing.assert_close(y, want, like=x)
