"""The Numba backend against float64 oracles: options, strides, in place, fp16, huge positions and
indices, linear attention, and the kernels' pure-Python bodies (``py_func``) so coverage sees them."""

import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("numba")

import rotary  # noqa: E402
from rotary.spec import tables as _tables
from rotary import testing  # noqa: E402
from rotary.backends.numba_kernels import common, rotation, simd  # noqa: E402
from rotary.backends.numba_kernels import linear_attention as la_kernels  # noqa: E402
from rotary.backends import numba as nb  # noqa: E402
from rotary.backends import numba_runtime as nb_runtime  # noqa: E402  (the size rule)

DTYPES = [np.float16, np.float32, np.float64]


def oracle_bshd(x, positions, spec, inverse=False):
    """float64 rope_2x2 oracle for (B, S, H, D) inputs; positions (S,) or (B, S)."""
    pos = np.asarray(positions)
    pos = pos[None, None, :] if pos.ndim == 1 else pos[:, None, :]
    y = testing.rope_2x2(np.moveaxis(np.asarray(x, np.float64), 1, 2), pos, spec.inv_freq(), layout=spec.layout,
                         scale=spec.attention_scaling, inverse=inverse)
    return np.moveaxis(y, 2, 1)


def _qk(rng, dtype, B=2, S=7, Hq=4, Hk=2, D=10):
    q = rng.standard_normal((B, S, Hq, D)).astype(dtype)
    k = rng.standard_normal((B, S, Hk, D)).astype(dtype)
    return q, k


# -- rotation against the oracle -------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("head_dim,rotary_dim", [(10, 10), (10, 6), (9, 8), (9, 4)])
@pytest.mark.parametrize("inverse", [False, True])
def test_apply_qk_matches_oracle(rng, dtype, layout, head_dim, rotary_dim, inverse):
    q, k = _qk(rng, dtype, D=head_dim)
    spec = rotary.RopeSpec(head_dim, rotary_dim=rotary_dim, layout=layout)
    positions = np.array([[0, 1, 5, 900, 3, 2, 4000], [7, 8, 9, 10, 11, 12, 13]])
    q0, k0 = q.copy(), k.copy()
    qr, kr = rotary.apply_qk(q, k, positions, spec=spec, seq_axis=1, inverse=inverse, backend="numba")
    testing.assert_close(qr, oracle_bshd(q, positions, spec, inverse), like=q)
    testing.assert_close(kr, oracle_bshd(k, positions, spec, inverse), like=k)
    np.testing.assert_array_equal(q, q0)   # inputs untouched without out=
    np.testing.assert_array_equal(k, k0)


@pytest.mark.parametrize("positions", [None, 17, "seq", "batch_seq"])
def test_position_kinds(rng, positions):
    q, k = _qk(rng, np.float32, S=5)
    spec = rotary.RopeSpec(10, base=500.0)
    expected_pos = {None: np.arange(5), 17: 17 + np.arange(5), "seq": np.array([4, 0, 3, 1, 2]),
                    "batch_seq": np.array([[1, 2, 3, 4, 5], [50, 40, 30, 20, 10]])}[positions]
    arg = positions if positions in (None, 17) else expected_pos
    qr, kr = rotary.apply_qk(q, k, arg, spec=spec, seq_axis=1, backend="numba")
    testing.assert_close(qr, oracle_bshd(q, expected_pos, spec))
    testing.assert_close(kr, oracle_bshd(k, expected_pos, spec))


@pytest.mark.parametrize("scaling", [{"rope_type": "linear", "factor": 4.0},
                                     {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64},
                                     {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}])
def test_scaling_tables_come_from_the_spec(rng, scaling):
    x = rng.standard_normal((1, 300, 2, 16)).astype(np.float32)
    spec = rotary.RopeSpec(16, scaling=scaling, max_position_embeddings=512)
    y = rotary.apply(x, spec=spec, seq_axis=1, backend="numba")
    testing.assert_close(y, oracle_bshd(x, np.arange(300), spec))


def test_float32_rounds_like_the_numpy_reference(rng):
    """fastmath off: one multiply and one add per term, no FMA, so fp32 results equal NumPy's bit for bit."""
    q, k = _qk(rng, np.float32, B=3, S=50, Hq=8, Hk=2, D=64)
    for layout in ("half", "interleaved"):
        a = rotary.apply_qk(q, k, seq_axis=1, layout=layout, backend="numba")
        b = rotary.apply_qk(q, k, seq_axis=1, layout=layout, backend="numpy")
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)


def test_huge_positions_exact_angles(rng):
    """Position 2**31 - 1 against cos/sin of the exactly reduced angle (mpmath, 40 digits)."""
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 40
    spec = rotary.RopeSpec(8)
    pos = np.array([2**31 - 1, 2**31 - 2, 2**30 + 12345])
    x = rng.standard_normal((1, 3, 1, 8))
    expected = np.empty_like(x)
    for s, p in enumerate(pos):
        for i, w in enumerate(spec.inv_freq()):
            theta = mpmath.mpf(int(p)) * mpmath.mpf(float(w))    # exact product of the float64 frequency
            c, sn = float(mpmath.cos(theta)), float(mpmath.sin(theta))
            a, b = x[0, s, 0, i], x[0, s, 0, i + 4]
            expected[0, s, 0, i], expected[0, s, 0, i + 4] = a * c - b * sn, b * c + a * sn
    for dtype, atol in ((np.float32, 2e-6), (np.float64, 1e-6)):   # float64: p * w rounds at 2**31 * 2**-53
        y = rotary.apply(x.astype(dtype), pos, spec=spec, seq_axis=1, backend="numba")
        np.testing.assert_allclose(y.astype(np.float64), expected, atol=atol, rtol=0)


# -- strides, views, in place ------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_bhsd_and_strided_views_are_not_copied(rng, dtype):
    base = rng.standard_normal((2, 6, 11, 24)).astype(dtype)   # (B, H, S, 2*D)
    views = {"bhsd": base[..., :12], "step2": base[..., ::2], "reversed": base[:, ::-1, ::-1, 12:]}
    spec = rotary.RopeSpec(12, rotary_dim=8)
    for name, x in views.items():
        flat = nb.flat_view(x)
        assert flat is not None and np.shares_memory(flat[0].view(x.dtype), base), name
        y = rotary.apply(x, spec=spec, seq_axis=-2, backend="numba")
        expected = np.swapaxes(oracle_bshd(np.swapaxes(x, 1, 2), np.arange(11), spec), 1, 2)
        testing.assert_close(y, expected, like=x, err_msg=name)


@pytest.mark.parametrize("dtype", DTYPES)
def test_in_place_on_strided_views(rng, dtype):
    base = rng.standard_normal((2, 9, 6, 20)).astype(dtype)
    q = base[:, :, :4, :9]       # BSHD view with odd head dim, strided heads and tokens
    k = base[:, :, 4:, 11:]
    q0, k0, base0 = q.copy(), k.copy(), base.copy()
    spec = rotary.RopeSpec(9, layout="interleaved")
    qr, kr = rotary.apply_qk(q, k, 3, spec=spec, seq_axis=1, out=(q, k), backend="numba")
    assert qr is q and kr is k
    testing.assert_close(q, oracle_bshd(q0, 3 + np.arange(9), spec))
    testing.assert_close(k, oracle_bshd(k0, 3 + np.arange(9), spec))
    np.testing.assert_array_equal(base[:, :, :4, 9:], base0[:, :, :4, 9:])   # untouched around the views
    np.testing.assert_array_equal(base[:, :, 4:, 9:11], base0[:, :, 4:, 9:11])


def test_separate_out_buffers_and_tail_copy(rng):
    q, k = _qk(rng, np.float32, D=9)
    out_q, out_k = np.full_like(q, np.nan), np.full_like(k, np.nan)
    spec = rotary.RopeSpec(9, rotary_dim=4)
    rotary.apply_qk(q, k, spec=spec, seq_axis=1, out=(out_q, out_k), backend="numba")
    testing.assert_close(out_q, oracle_bshd(q, np.arange(7), spec))
    testing.assert_close(out_k, oracle_bshd(k, np.arange(7), spec))


def test_strides_not_multiple_of_itemsize(rng):
    """An unaligned view (byte strides not multiples of 4) goes through a copy and comes back right."""
    raw = np.zeros(4 * 3 * 18 + 8, dtype=np.uint8)
    x = np.ndarray((1, 3, 1, 4), dtype=np.float32, buffer=raw, offset=1, strides=(54, 18, 18, 4))
    x[...] = rng.standard_normal(x.shape)
    assert nb.flat_view(x) is None
    x0 = x.copy()
    spec = rotary.RopeSpec(4)
    y = rotary.apply(x, spec=spec, seq_axis=1, backend="numba")
    testing.assert_close(y, oracle_bshd(x0, np.arange(3), spec))
    rotary.apply(x, spec=spec, seq_axis=1, out=x, backend="numba")
    testing.assert_close(x, oracle_bshd(x0, np.arange(3), spec))


def test_empty_inputs():
    q = np.zeros((2, 0, 3, 8), np.float32)
    qr, kr = rotary.apply_qk(q, q[:, :, :1], seq_axis=1, backend="numba")
    assert qr.shape == q.shape and kr.shape == (2, 0, 1, 8)


def test_parallel_and_serial_kernels_agree(rng, monkeypatch):
    q, k = _qk(rng, np.float32, B=2, S=300, Hq=8, Hk=2, D=32)
    assert q.size + k.size >= nb_runtime.PARALLEL_MIN_ELEMENTS
    parallel = rotary.apply_qk(q, k, seq_axis=1, backend="numba")
    monkeypatch.setattr(nb_runtime, "PARALLEL_MIN_ELEMENTS", 1 << 62)
    serial = rotary.apply_qk(q, k, seq_axis=1, backend="numba")
    for a, b in zip(parallel, serial):
        np.testing.assert_array_equal(a, b)
    testing.assert_close(parallel[0], oracle_bshd(q, np.arange(300), rotary.RopeSpec(32)))


def jitted(helper):
    """A jitted call of a kernel helper (the helpers are plain Python functions, ``register_jitable`` or lowered
    in place: compiled only inside a jitted caller); the wrapper is cached per helper."""
    if helper not in _JITTED:
        from numba import njit

        _JITTED[helper] = njit(lambda *args: helper(*args))
    return _JITTED[helper]


_JITTED: dict = {}


# -- int64 index arithmetic ------------------------------------------------------------------------
def test_element_offset_is_int64():
    args = (5, 3 * 2**31 + 1, 2**33 + 7, 2**32 - 1, 3, 2**20, 1000)
    expected = 5 + 3 * (3 * 2**31 + 1) + 2**20 * (2**33 + 7) + 1000 * (2**32 - 1)
    assert expected > 2**53 // 1024 and expected < 2**63
    assert jitted(common.element_offset)(*args) == expected
    assert common.element_offset(*args) == expected     # the Python form (lowered in place when compiled)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_in_place_helpers_match_their_python_forms(dtype):
    """The helpers lowered in place (no compiled function of their own) against their Python forms: imin / imax /
    padded in int64 (a uint64 argument wraps as np.int64 does), tile_width, aligned_zeros (zeroed, C-contiguous,
    64-byte aligned, its own memory: it outlives the call), load / store (float16 bits rounded through float32
    to nearest even)."""
    from numba import njit

    @njit(cache=False)
    def ints(a, b, u):
        return common.imin(a, b), common.imax(a, b), la_kernels.padded(a, b), common.imin(u, a)

    for a, b in ((5, 3), (-4, 7), (0, 8), (2**40 + 3, 2**33)):
        expected = (min(a, b), max(a, b), la_kernels.padded(a, b) if a >= 0 else None)
        got = ints(a, b, np.uint64(2**63 + 5))
        assert got[:2] == expected[:2] and (a < 0 or got[2] == expected[2] == -(-a // b) * b)
        assert got[3] == min(np.uint64(2**63 + 5).astype(np.int64), a)
    assert jitted(la_kernels.tile_width)(np.empty(1, dtype)) == 2 * simd.VECTOR_BYTES // np.dtype(dtype).itemsize

    @njit(cache=False)
    def zeros(rows, cols, like):
        a = la_kernels.aligned_zeros(rows, cols, like.dtype)
        a[rows - 1, cols - 1] = 1.5
        return a

    for rows, cols in ((1, 1), (3, 17), (64, 65)):
        a = zeros(rows, cols, np.empty(1, dtype))
        assert a.shape == (rows, cols) and a.dtype == dtype and a.flags.c_contiguous and a.flags.owndata is False
        assert a.ctypes.data % 64 == 0 and a.sum() == 1.5 and a[-1, -1] == 1.5
        np.testing.assert_array_equal(zeros.py_func(rows, cols, np.empty(1, dtype)), a)

    @njit(cache=False)
    def load_store(buf, i, out, j, value):
        common.store(out, j, value)
        return common.load(buf, i)

    x = np.arange(6, dtype=dtype)
    out = np.zeros(4, dtype)
    assert load_store(x, 4, out, 3, 2.25) == 4 and out[3] == 2.25   # flat indices 0..size-1, no wraparound
    bits = np.array([1.0, 65504.0, 2.0**-24], np.float16).view(np.uint16)
    half_out = np.zeros(3, np.uint16)
    for i, value in enumerate((1.0 + 2.0**-11, 1e6, -(2.0**-25) * 1.5)):   # a tie (to even), overflow, a subnormal
        got = load_store(bits, i, half_out, i, value)
        assert got == np.float32(bits[i:i + 1].view(np.float16)[0])
        with np.errstate(over="ignore"):
            assert half_out[i] == np.float16(np.float32(value)).view(np.uint16)


def test_strides_beyond_int32_on_a_sparse_file(rng, tmp_path):
    """Tokens 2**31 + 64 elements apart (an 8 GiB sparse mapping; two pages are touched)."""
    gap = 2**31 + 64
    try:
        mm = np.memmap(tmp_path / "sparse.bin", dtype=np.float32, mode="w+", shape=(gap + 8,))
    except (OSError, ValueError) as exc:   # pragma: no cover - filesystems without sparse files
        pytest.skip(f"no sparse 8 GiB mapping here: {exc}")
    x = np.lib.stride_tricks.as_strided(mm, shape=(1, 2, 1, 8), strides=(0, gap * 4, 0, 4))
    x[...] = rng.standard_normal(x.shape)
    x0 = np.array(x)
    spec = rotary.RopeSpec(8)
    rotary.apply(x, [5, 2**31 - 1], spec=spec, seq_axis=1, out=x, backend="numba")
    testing.assert_close(np.array(x), oracle_bshd(x0, np.array([5, 2**31 - 1]), spec), atol=3e-6, rtol=3e-6)
    del x, mm


# -- linear attention ----------------------------------------------------------------------------------
def phi64(x, feature_map):
    x = np.asarray(x, dtype=np.float64)
    return {"elu": lambda: np.where(x > 0, x + 1, np.exp(np.minimum(x, 0))), "relu": lambda: np.maximum(x, 0),
            "identity": lambda: x}[feature_map]()


def linear_oracle(q, k, v, positions, spec, causal, feature_map, eps, state=None):
    """Quadratic float64 reference on (B, T, H, d) inputs; state (S0, z0) of shape (B, H, m, dv), (B, H, m)."""
    a, b = phi64(q, feature_map), phi64(k, feature_map)
    a_hat, b_hat = oracle_bshd(a, positions, spec), oracle_bshd(b, positions, spec)
    T = q.shape[1]
    mask = np.tril(np.ones((T, T))) if causal else np.ones((T, T))
    num = np.einsum("bthm,bshm,ts,bshd->bthd", a_hat, b_hat, mask, np.asarray(v, np.float64))
    den = np.einsum("bthm,bshm,ts->bth", a, b, mask)
    if state is not None:
        num = num + np.einsum("bthm,bhmd->bthd", a_hat, state[0])
        den = den + np.einsum("bthm,bhm->bth", a, state[1])
    new_s = np.einsum("bshm,bshd->bhmd", b_hat, np.asarray(v, np.float64))
    new_z = b.sum(axis=1)
    if state is not None:
        new_s, new_z = new_s + state[0], new_z + state[1]
    return num / (den[..., None] + eps), (new_s, new_z)


def _linear_inputs(rng, dtype, B=2, T=37, H=3, m=9, dv=5):
    q, k = (rng.standard_normal((B, T, H, m)).astype(dtype) for _ in range(2))
    v = rng.standard_normal((B, T, H, dv)).astype(dtype)
    return q, k, v


def _run_linear(q, k, v, spec, positions, *, causal, feature_map="elu", eps=1e-6, chunk=8, state=None):
    work = np.float64 if q.dtype == np.float64 else np.float32
    cos, sin, rows = _tables.lookup(spec, np.asarray(positions).reshape(-1, q.shape[1]), dtype=work)
    return nb.linear_attention(q, k, v, cos, sin, rows, rotary_dim=spec.rotary_dim, layout=spec.layout,
                               causal=causal, feature_map=feature_map, eps=eps, chunk=chunk, state=state)


LINEAR_TOL = {np.float64: 1e-12, np.float32: 1e-5, np.float16: 2e-3}


def _rel(actual, desired):
    return np.linalg.norm(np.asarray(actual, np.float64) - desired) / np.linalg.norm(desired)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("feature_map", ["elu", "relu", "identity"])
@pytest.mark.parametrize("chunk", [1, 8, 37, 64])
def test_linear_attention_matches_quadratic_oracle(rng, dtype, causal, feature_map, chunk):
    q, k, v = _linear_inputs(rng, dtype)
    if feature_map == "identity":   # positive features keep the denominator away from 0
        q, k = np.abs(q), np.abs(k)
    spec = rotary.RopeSpec(9, rotary_dim=6, layout="interleaved")
    positions = np.array([np.arange(37) + 3, np.arange(37) * 2])
    work = np.float64 if dtype == np.float64 else np.float32
    state = (rng.random((2, 3, 9, 5)).astype(work), rng.random((2, 3, 9)).astype(work))
    o, (S, z) = _run_linear(q, k, v, spec, positions, causal=causal, feature_map=feature_map, chunk=chunk,
                            state=state)
    expected, (S_ref, z_ref) = linear_oracle(q, k, v, positions, spec, causal, feature_map, 1e-6,
                                             tuple(a.astype(np.float64) for a in state))
    assert o.dtype == dtype and S.dtype == work and z.dtype == work
    tol = LINEAR_TOL[dtype]
    assert _rel(o, expected) <= tol
    assert _rel(S, S_ref) <= max(tol, 1e-6) and _rel(z, z_ref) <= max(tol, 1e-6)


def test_linear_attention_strided_bhsd_views(rng):
    base = rng.standard_normal((3, 2, 40, 16))          # (tensor, B, S, H*... ) -> BHSD-like views
    q = base[0].reshape(2, 40, 2, 8).transpose(0, 1, 2, 3)[:, :, :, :]
    k = base[1][:, ::-1].reshape(2, 40, 2, 8)
    v = np.swapaxes(rng.standard_normal((2, 2, 40, 6)), 1, 2)   # (B, S, H, dv) with S and H swapped strides
    spec = rotary.RopeSpec(8)
    o, _ = _run_linear(q, k, v, spec, np.arange(40), causal=True, chunk=16)
    expected, _ = linear_oracle(q, k, v, np.arange(40), spec, True, "elu", 1e-6)
    assert _rel(o, expected) <= 1e-12


def test_linear_attention_split_equals_one_call(rng):
    q, k, v = _linear_inputs(rng, np.float64, T=50)
    spec = rotary.RopeSpec(9)
    full, state_full = _run_linear(q, k, v, spec, np.arange(50), causal=True, chunk=16)
    first, state = _run_linear(q[:, :21], k[:, :21], v[:, :21], spec, np.arange(21), causal=True, chunk=16)
    second, state = _run_linear(q[:, 21:], k[:, 21:], v[:, 21:], spec, np.arange(21, 50), causal=True, chunk=16,
                                state=state)
    np.testing.assert_allclose(np.concatenate([first, second], axis=1), full, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(state[0], state_full[0], rtol=1e-12, atol=1e-12)


def test_linear_attention_frontend_uses_numba(rng):
    q, k, v = _linear_inputs(rng, np.float32, B=1, T=20, H=2, m=8, dv=8)
    o = rotary.linear_attention(q, k, v, causal=True, seq_axis=1, backend="numba")
    expected, _ = linear_oracle(q, k, v, np.arange(20), rotary.RopeSpec(8), True, "elu", 1e-6)
    assert _rel(o, expected) <= 1e-5


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_register_tiles_match_numpy(rng, dtype):
    """madd_tile / matmul_tiles / dot_f64 (compiled, and their Python bodies) against NumPy products."""
    w = jitted(la_kernels.tile_width)(np.empty(1, dtype))
    r = la_kernels.TILE_ROWS
    a = rng.standard_normal((2 * r, 13)).astype(dtype)
    b = rng.standard_normal((13, 2 * w)).astype(dtype)
    c = rng.standard_normal((2 * r, 2 * w)).astype(dtype)
    tol = 1e-5 if dtype == np.float32 else 1e-13
    for madd_tile, rows in ((jitted(la_kernels.madd_tile), r), (la_kernels.madd_tile, r)):   # compiled, Python
        got = c.copy()
        madd_tile(a, b, got, rows, w, 13, True)        # the second tile of rows and of columns, accumulate
        expected = c.astype(np.float64)
        expected[rows:2 * rows, w:] += a[rows:2 * rows].astype(np.float64) @ b[:, w:]
        assert _rel(got, expected) <= tol
        got = c.copy()
        madd_tile(a, b, got, 0, 0, 5, False)            # overwrite with a depth-5 product
        expected = c.astype(np.float64)
        expected[:rows, :w] = a[:rows, :5].astype(np.float64) @ b[:5, :w]
        assert _rel(got, expected) <= tol
    got = np.full_like(c, np.nan)
    jitted(la_kernels.matmul_tiles)(a, b, got, 2 * r, 13, 2 * w)
    assert _rel(got, a.astype(np.float64) @ b) <= tol
    n = 3 * simd.lanes(np.empty(1, np.float64)) + 3                 # whole vectors and a tail
    x, y = rng.standard_normal((2, n))
    for dot_f64 in (jitted(la_kernels.dot_f64), la_kernels.dot_f64):
        assert abs(dot_f64(x, y, n) - x @ y) <= 1e-13 * np.abs(x * y).sum()
        x32 = x.astype(np.float32)                                    # float32 x: widened exactly
        assert abs(dot_f64(x32, y, n) - x32.astype(np.float64) @ y) <= 1e-13 * np.abs(x * y).sum()
        assert abs(dot_f64(x32, y, n - 2) - x32[:-2].astype(np.float64) @ y[:-2]) <= 1e-13 * np.abs(x * y).sum()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_row_finite_finds_every_nan_and_inf(dtype):
    """row_finite (the causal kernel's check before it recomputes a row) is False for a NaN, +inf or -inf at any
    column, in the whole vectors and in the tail, and True for finite rows with huge and tiny values."""
    rng = np.random.default_rng(5)
    n = 3 * simd.lanes(np.empty(1, dtype)) + 5
    from numba import njit

    row_finite = la_kernels.row_finite
    check = njit(lambda row, n: row_finite(row, n))   # (an inline="always" helper: a call with named arguments)
    for finite in (rng.standard_normal(n).astype(dtype), np.full(n, np.finfo(dtype).max, dtype),
                   np.full(n, np.finfo(dtype).tiny, dtype)):
        assert check(finite, n)
        for bad in (np.nan, np.inf, -np.inf):
            for column in range(n):
                row = finite.copy()
                row[column] = bad
                assert not check(row, n), (bad, column)
                assert check(row, column)                     # the columns before it are finite


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_feature_maps_give_the_reference_bits(dtype):
    """simd.feature compiled on vectors and on scalars, and called from Python, gives
    rotary.backends.feature_maps.feature_map's bits for identity, relu and elu + 1: at the exp's clamps and
    flush (-87 / -708, 88 / 709), 0 and -0 (relu(-0) = +0), +-inf (relu(-inf) = +0, elu(-inf) = +0), NaN (kept)."""
    from numba import njit

    from rotary.backends import feature_maps

    @njit
    def both(x, feature_map):
        vector, scalar = np.empty_like(x), np.empty_like(x)
        width = simd.lanes(x)
        for j in range(0, x.shape[0], width):
            simd.vstore(vector, j, simd.feature(simd.vload(x, j), feature_map))
        for j in range(x.shape[0]):
            scalar[j] = simd.feature(x[j], feature_map)
        return vector, scalar

    special = [0.0, -0.0, 1e-30, -1e-30, -86.9, -87.0, -87.5, -100.0, 87.9, 88.0, 88.5, 1e30, -1e30, -707.9, -708.0,
               -708.5, 708.9, 709.5, np.inf, -np.inf, np.nan, -np.nan, 0.5, -0.5, -1.0, -20.0, -3.0]
    with np.errstate(over="ignore"):
        x = np.concatenate([special, np.linspace(-750, 750, 1997), np.random.default_rng(0).standard_normal(3000)])
        x = np.resize(x.astype(dtype), len(x) // 64 * 64 + 64)
    x[-1] = np.array(0x7FC12345 if dtype == np.float32 else 0x7FF8000012345678,
                     np.uint32 if dtype == np.float32 else np.uint64).view(dtype)   # a NaN with a payload
    for name, code in feature_maps.CODES.items():
        expected = feature_maps.feature_map(x, name)
        vector, scalar = both(x, np.int64(code))
        np.testing.assert_array_equal(vector.view(np.uint8), expected.view(np.uint8), err_msg=name)
        np.testing.assert_array_equal(scalar.view(np.uint8), expected.view(np.uint8), err_msg=name)
        python = np.array([simd.feature(value, code) for value in x[:64]], dtype)
        np.testing.assert_array_equal(python.view(np.uint8), expected[:64].view(np.uint8), err_msg=name)
    relu = both(np.array([-0.0, -np.inf, -3.0] + [1.0] * 61, dtype), np.int64(feature_maps.CODES["relu"]))
    assert all(np.signbit(r[:3]).sum() == 0 and (r[:3] == 0).all() for r in relu)


def test_float16_bits_convert_exactly():
    """load / vload widen every float16 bit pattern to NumPy's float32 bits (normals, subnormals, +-0, +-inf, NaN
    payloads); store / vstore round float32 values to NumPy's float16 bits (ties to even, overflow to inf,
    subnormals, NaN payloads): integer operations, no half-precision LLVM instruction (no F16C needed)."""
    from numba import njit

    @njit
    def widen(bits, out):
        width = simd.lanes(bits)
        for j in range(0, bits.shape[0], width):
            simd.vstore(out[0], j, simd.vload(bits, j))
        for j in range(bits.shape[0]):
            out[1, j] = common.load(bits, j)

    @njit
    def narrow(values, out):
        width = simd.lanes(values)
        for j in range(0, values.shape[0], width):
            simd.vstore(out[0], j, simd.vload(values, j))
        for j in range(values.shape[0]):
            common.store(out[1], j, values[j])

    bits = np.arange(1 << 16, dtype=np.uint16)
    wide = np.empty((2, bits.size), np.float32)
    widen(bits, wide)
    expected = bits.view(np.float16).astype(np.float32).view(np.uint32)
    np.testing.assert_array_equal(wide[0].view(np.uint32), expected)
    np.testing.assert_array_equal(wide[1].view(np.uint32), expected)
    rng = np.random.default_rng(4)
    halves = bits.view(np.float16).astype(np.float32)
    finite = np.sort(halves[np.isfinite(halves)])
    ties = (finite[:-1].astype(np.float64) + finite[1:]) / 2            # exactly halfway: to even
    nans = np.array([0x7F800001, 0x7FC00000, 0x7F802000, 0xFF800001, 0x7FFFFFFF], np.uint32).view(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        ties = ties.astype(np.float32)
        others = np.array([65504, 65519.99, 65520, 1e9, -1e9, 2.0**-25, 2.0**-26, 3 * 2.0**-26, 1e-30, -1e-30, np.inf,
                           -np.inf], np.float32)
        scaled = (rng.standard_normal(5000) * 10.0 ** rng.integers(-9, 6, 5000)).astype(np.float32)
    values = np.concatenate([halves, ties, np.nextafter(ties, np.float32(np.inf)), np.nextafter(ties, np.float32(-np.inf)),
                             others, scaled, nans])   # float32 throughout: the signalling NaNs keep their bits
    values = np.resize(values, len(values) // 64 * 64 + 64)
    out = np.empty((2, values.size), np.uint16)
    narrow(values, out)
    with np.errstate(over="ignore", invalid="ignore"):
        expected = values.astype(np.float16).view(np.uint16)
    np.testing.assert_array_equal(out[0], expected)
    np.testing.assert_array_equal(out[1], expected)


@pytest.mark.parametrize("S", [1, 9])
def test_zero_denominator_gives_nan_in_that_row_only(rng, S):
    """eps=0, relu and a q row all negative: that row's denominator is 0, its output NaN (0 / 0, as NumPy's);
    the other rows are finite and match the NumPy backend (the one-token step and the chunked kernel)."""
    q, k, v = (rng.standard_normal((2, S, 2, 16)).astype(np.float32) for _ in range(3))
    k = np.abs(k) + 0.1
    q[1, -1, 0] = -np.abs(q[1, -1, 0]) - 0.1
    state = (rng.random((2, 2, 16, 16)).astype(np.float32), rng.random((2, 2, 16)).astype(np.float32))
    kw = dict(causal=True, seq_axis=1, feature_map="relu", eps=0.0, spec=rotary.RopeSpec(16))
    for backend in ("numba", "numpy"):
        with np.errstate(divide="ignore", invalid="ignore"):
            o = rotary.linear_attention(q, k, v, **kw, backend=backend)
        bad = np.zeros(o.shape, bool)
        bad[1, -1, 0] = True
        assert np.isnan(o[bad]).all() and np.isfinite(o[~bad]).all(), backend
        if backend == "numba":
            numba_o = o
    np.testing.assert_allclose(numba_o[~bad], o[~bad], rtol=1e-4, atol=1e-5)


def test_helpers_are_plain_python_functions():
    """Every public function of the kernel modules is a plain Python function that runs outside compiled code
    (register_jitable helpers, lowered-in-place building blocks) except the kernels the backend calls, which
    are cached dispatchers; a few run from Python on small arrays."""
    import types as pytypes

    kernels = {rotation.rotate_qk_parallel, rotation.rotate_qk_streamed, rotation.rotate_qk_serial,
               la_kernels.linear_attention_tasks, la_kernels.linear_attention_step}
    for kernel in kernels:
        assert kernel.targetoptions.get("error_model") == "numpy" and not kernel.targetoptions.get("fastmath")
    for module in (common, rotation, la_kernels, simd):
        for name, obj in vars(module).items():
            if name.startswith("_") or any(obj is k for k in kernels) or getattr(obj, "__module__", None) != module.__name__:
                continue
            if callable(obj) and not isinstance(obj, type):
                assert isinstance(obj, pytypes.FunctionType), (module.__name__, name, obj)
    x = np.arange(64, dtype=np.float32)
    assert simd.vsum(simd.vload(x, 0)) == x[:simd.lanes(x)].sum()
    assert rotation.rows_in_table(np.zeros((1, 3), np.int64), 2, 3) and not rotation.rows_in_table(
        np.zeros((1, 3), np.int64), 3, 3)
    assert la_kernels.row_finite(x, 64) and la_kernels.dot_f64(x, np.ones(64), 64) == x.sum()


# -- the kernels' bodies as plain Python (small inputs; coverage sees these lines) ----------------
@pytest.fixture
def pure_python(monkeypatch):
    """Swap every compiled kernel of the kernel modules (and every module's name for one) for its Python
    function while the test runs."""
    for module in (common, rotation, la_kernels, simd):
        for name in dir(module):
            obj = getattr(module, name)
            if hasattr(obj, "py_func") and hasattr(obj, "signatures"):
                monkeypatch.setattr(module, name, obj.py_func)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_rotate_kernel_in_pure_python(rng, pure_python, dtype, layout):
    base = rng.standard_normal((2, 3, 4, 16)).astype(dtype)
    q, k = base[:, :, :2, :7], base[:, :, 2:, ::-2][..., :7]   # unit and negative last-axis strides
    spec = rotary.RopeSpec(7, rotary_dim=4, layout=layout)
    for inverse in (False, True):
        qr, kr = rotary.apply_qk(q, k, [[1, 2, 3], [9, 8, 7]], spec=spec, seq_axis=1, inverse=inverse,
                                 backend="numba")
        pos = np.array([[1, 2, 3], [9, 8, 7]])
        testing.assert_close(qr, oracle_bshd(q, pos, spec, inverse), like=q)
        testing.assert_close(kr, oracle_bshd(k, pos, spec, inverse), like=k)


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
@pytest.mark.parametrize("causal", [True, False])
def test_linear_kernel_in_pure_python(rng, pure_python, dtype, causal):
    q, k, v = _linear_inputs(rng, dtype, B=1, T=11, H=2, m=5, dv=3)
    spec = rotary.RopeSpec(5, rotary_dim=4)
    for feature_map in ("elu", "relu", "identity"):
        qq, kk = (np.abs(q), np.abs(k)) if feature_map == "identity" else (q, k)
        o, _ = _run_linear(qq, kk, v, spec, np.arange(11), causal=causal, feature_map=feature_map, chunk=4)
        expected, _ = linear_oracle(qq, kk, v, np.arange(11), spec, causal, feature_map, 1e-6)
        assert _rel(o, expected) <= LINEAR_TOL[dtype]


# -- module surface ---------------------------------------------------------------------------------
def test_module_surface():
    assert nb.NAME == "numba" and nb.availability() == (True, "ok")
    assert nb.accepts(np.zeros(3, np.float16)) and nb.accepts(np.zeros(3, np.float64))
    assert not nb.accepts(np.zeros(3, np.int32)) and not nb.accepts([1.0, 2.0])
    assert rotary.backends.get("numba") is nb
    for kernel in (rotation.rotate_qk_parallel, rotation.rotate_qk_streamed, rotation.rotate_qk_serial,
                   la_kernels.linear_attention_tasks, la_kernels.linear_attention_step):
        assert type(kernel._cache).__name__ != "NullCache"   # cache=True (tests/test_cli_warm.py: hits on disk)
        assert not kernel.targetoptions.get("fastmath")


def test_unknown_feature_map_is_a_value_error(rng):
    q, k, v = _linear_inputs(rng, np.float32, T=4)
    with pytest.raises(ValueError, match="feature_map"):
        _run_linear(q, k, v, rotary.RopeSpec(9), np.arange(4), causal=True, feature_map="softmax")


def test_import_rotary_does_not_import_numba():
    code = "import sys, rotary; assert 'numba' not in sys.modules, 'numba imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.slow
@pytest.mark.parametrize("cpu", ["generic", "haswell"])
def test_linear_attention_on_narrower_vector_targets(cpu, tmp_path):
    """The register tiles follow the target's vector width (16 bytes generic, 32 AVX2, 64 AVX-512):
    compiled for a narrower target in a fresh process (own cache dir), results equal the float64 oracle."""
    code = f"""
import numpy as np, rotary
from rotary import testing
from rotary.backends.numba_kernels import simd
assert simd.VECTOR_BYTES == {16 if cpu == "generic" else 32}, simd.VECTOR_BYTES
rng = np.random.default_rng(5)
for dtype, tol in ((np.float32, 3e-5), (np.float64, 1e-10)):
    q, k = (rng.standard_normal((2, 3, 45, 11)).astype(dtype) for _ in range(2))
    v = rng.standard_normal((2, 3, 45, 7)).astype(dtype)
    spec = rotary.RopeSpec(11, rotary_dim=8, layout="interleaved")
    for causal in (True, False):
        o = rotary.linear_attention(q, k, v, 5, causal=causal, chunk=16, spec=spec, seq_axis=-2, backend="numba")
        ref = testing.linear_attention_quadratic(q, k, v, 5 + np.arange(45), spec.inv_freq(), layout="interleaved",
                                                 causal=causal)
        err = np.abs(o - ref).max() / np.sqrt((ref ** 2).mean())
        assert err < tol, (dtype, causal, err)
print("ok")
"""
    env = dict(os.environ, NUMBA_CPU_NAME=cpu, NUMBA_CACHE_DIR=str(tmp_path))
    env.pop("NUMBA_CPU_FEATURES", None)
    if cpu == "haswell":   # AVX2 without AVX-512, as on most laptops
        env["NUMBA_CPU_FEATURES"] = "+64bit,+sse,+sse2,+sse3,+ssse3,+sse4.1,+sse4.2,+popcnt,+cx16,+avx,+avx2,+fma,+f16c"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr


# -- SIMD rotation of unit-stride vectors (rotate_pairs_simd) against the scalar loop ----------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("serial", [True, False])
def test_simd_rotation_equals_scalar_loop(rng, monkeypatch, dtype, layout, serial):
    """Whole registers (and a scalar remainder: rotary_dim 72 -> 36 pairs) give the scalar strided loop's
    exact bits, out of place and in place, serial and parallel kernel; and match the float64 oracle."""
    monkeypatch.setattr(nb_runtime, "PARALLEL_MIN_ELEMENTS", 1 << 40 if serial else 0)
    monkeypatch.setattr(nb_runtime, "PARALLEL_MIN_TOKENS", 0)
    spec = rotary.RopeSpec(128, rotary_dim=72, layout=layout)
    pos = rng.integers(0, 500, size=(3, 2))
    q = rng.standard_normal((3, 2, 4, 128)).astype(dtype)
    k = rng.standard_normal((3, 2, 2, 128)).astype(dtype)
    for inverse in (False, True):
        fast = rotary.apply_qk(q, k, pos, spec=spec, seq_axis=1, inverse=inverse, backend="numba")
        outs = tuple(np.zeros(x.shape[:-1] + (256,), dtype)[..., ::2] for x in (q, k))   # stride 2: scalar loop
        scalar = rotary.apply_qk(q, k, pos, spec=spec, seq_axis=1, inverse=inverse, out=outs, backend="numba")
        qi, ki = q.copy(), k.copy()
        rotary.apply_qk(qi, ki, pos, spec=spec, seq_axis=1, inverse=inverse, out=(qi, ki), backend="numba")
        for f, s, i, x in zip(fast, scalar, (qi, ki), (q, k)):
            np.testing.assert_array_equal(f, s)
            np.testing.assert_array_equal(i, s)
            testing.assert_close(f, oracle_bshd(x, pos, spec, inverse), like=x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary_dim,head_dim", [(32, 128), (80, 128), (24, 70)])
@pytest.mark.parametrize("serial", [True, False])
def test_partial_rotary_tail_is_copied_bit_for_bit(rng, monkeypatch, dtype, rotary_dim, head_dim, serial):
    """Partial rotary into separate outputs: the coordinates past rotary_dim are the input's bits (NaN
    payloads, -0.0, infinities; copied a register at a time, then element by element), the rotated ones
    match the oracle; both kernels, whole registers of pairs and a scalar remainder."""
    monkeypatch.setattr(nb_runtime, "PARALLEL_MIN_ELEMENTS", 1 << 40 if serial else 0)
    monkeypatch.setattr(nb_runtime, "PARALLEL_MIN_TOKENS", 0)
    spec = rotary.RopeSpec(head_dim, rotary_dim=rotary_dim)
    pos = rng.integers(0, 500, size=(2, 3))
    q = rng.standard_normal((2, 3, 4, head_dim)).astype(dtype)
    k = rng.standard_normal((2, 3, 2, head_dim)).astype(dtype)
    bits = q.view(np.uint16 if dtype == np.float16 else np.uint32 if dtype == np.float32 else np.uint64)
    specials = np.array([np.nan, -0.0, np.inf, -np.inf], dtype)
    q[..., rotary_dim:rotary_dim + 4] = specials
    q[0, 0, 0, -1] = np.nan
    bits[0, 0, 0, -1] |= bits.dtype.type(1)   # a NaN with a payload bit (NumPy 1.26: no uint64 | int)
    qr, kr = rotary.apply_qk(q, k, pos, spec=spec, seq_axis=1, backend="numba")
    for x, y in ((q, qr), (k, kr)):
        np.testing.assert_array_equal(y[..., rotary_dim:].view(np.uint8), x[..., rotary_dim:].view(np.uint8))
        testing.assert_close(y[..., :rotary_dim], oracle_bshd(x, pos, spec)[..., :rotary_dim], like=x)


# -- rotation: large separate outputs written by non-temporal stores ---------------------------------
def _streaming_geometry(monkeypatch, min_bytes):
    """Separate outputs from ``min_bytes`` on stream (the geometry cache emptied: it holds the flag)."""
    monkeypatch.setattr(rotation, "STREAM_MIN_BYTES", min_bytes)
    monkeypatch.setattr(nb, "_geo_cache", {})


def test_stream_flag_marks_large_separate_outputs(monkeypatch):
    """GEO_STREAM: a separate output of >= STREAM_MIN_BYTES in float32/float64; never in place, never float16
    bits, never below the size."""
    x = np.zeros((2, 8, 4, 64), np.float32)
    _streaming_geometry(monkeypatch, x.nbytes)
    assert nb._geometry_row(x, np.empty_like(x))[2][common.GEO_STREAM] == 1
    assert nb._geometry_row(x, x)[2][common.GEO_STREAM] == 0
    assert nb._geometry_row(x[:1], np.empty_like(x[:1]))[2][common.GEO_STREAM] == 0
    h = np.zeros((4, 8, 4, 64), np.float16)
    assert nb._geometry_row(h, np.empty_like(h))[2][common.GEO_STREAM] == 0


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("serial", [True, False])
def test_streamed_rotation_equals_cached_stores(rng, monkeypatch, dtype, layout, serial):
    """Outputs written by non-temporal stores (every size streams here, in the parallel kernel; the serial one,
    for small calls, has no streamed path) hold the bits of the ordinary stores and match the float64 oracle:
    new outputs, out= buffers (NumPy's 16-byte alignment), an out= view 4 or 8 bytes off a 16-byte boundary
    (ordinary stores there), transposed BHSD outputs."""
    monkeypatch.setattr(nb_runtime, "PARALLEL_MIN_ELEMENTS", 1 << 40 if serial else 0)
    monkeypatch.setattr(nb_runtime, "PARALLEL_MIN_TOKENS", 0)
    spec = rotary.RopeSpec(64, layout=layout)
    pos = rng.integers(0, 3000, size=(3, 5))
    q = rng.standard_normal((3, 5, 4, 64)).astype(dtype)
    k = rng.standard_normal((3, 5, 2, 64)).astype(dtype)
    _streaming_geometry(monkeypatch, 1 << 40)
    cached = rotary.apply_qk(q, k, pos, spec=spec, seq_axis=1, backend="numba")
    _streaming_geometry(monkeypatch, 0)
    new = rotary.apply_qk(q, k, pos, spec=spec, seq_axis=1, backend="numba")
    outs = (np.empty_like(q), np.empty_like(k))
    given = rotary.apply_qk(q, k, pos, spec=spec, seq_axis=1, out=outs, backend="numba")
    assert given[0] is outs[0] and given[1] is outs[1]
    raws = [np.zeros(x.size + 1, dtype) for x in (q, k)]
    off = tuple(r[1:].reshape(x.shape) for r, x in zip(raws, (q, k)))   # one element off NumPy's alignment
    assert off[0].ctypes.data % 16 != 0
    shifted = rotary.apply_qk(q, k, pos, spec=spec, seq_axis=1, out=off, backend="numba")
    bhsd = tuple(np.empty((x.shape[0], x.shape[2], x.shape[1], x.shape[3]), dtype).transpose(0, 2, 1, 3)
                 for x in (q, k))
    transposed = rotary.apply_qk(q, k, pos, spec=spec, seq_axis=1, out=bhsd, backend="numba")
    for i, x in enumerate((q, k)):
        for got in (new, given, shifted, transposed):
            np.testing.assert_array_equal(got[i], cached[i])
        testing.assert_close(cached[i], oracle_bshd(x, pos, spec), like=x)


def test_streamed_kernel_runs_for_large_separate_outputs(rng, monkeypatch):
    """The parallel calls whose geometry marks an output for non-temporal stores (a separate output of at least
    STREAM_MIN_BYTES) run rotate_qk_streamed; in place or below the size, rotate_qk_parallel (no stream path
    compiled in); both equal the oracle."""
    monkeypatch.setattr(nb_runtime, "PARALLEL_MIN_ELEMENTS", 0)
    monkeypatch.setattr(nb_runtime, "PARALLEL_MIN_TOKENS", 0)
    ran = []
    for name in ("rotate_qk_parallel", "rotate_qk_streamed", "rotate_qk_serial"):
        kernel = getattr(rotation, name)
        monkeypatch.setattr(rotation, name, lambda *a, _k=kernel, _n=name: (ran.append(_n), _k(*a))[1])
    spec = rotary.RopeSpec(64)
    for T, in_place, expected in ((16, False, "rotate_qk_streamed"), (17, True, "rotate_qk_parallel"),
                                  (3, False, "rotate_qk_parallel")):
        q = rng.standard_normal((1, T, 4, 64)).astype(np.float32)   # a shape per case: a plan of its own
        _streaming_geometry(monkeypatch, 16 * 4 * 64 * 4)
        pos = np.arange(T)
        x = q.copy()
        ran.clear()
        got = rotary.apply(x, pos, spec=spec, seq_axis=1, backend="numba", out=x if in_place else None)
        assert ran == [expected], (T, in_place, ran)
        testing.assert_close(got, oracle_bshd(q, pos[None], spec), like=q)


def test_rotate_pairs_stream_compiles_to_non_temporal_stores():
    """rotate_pairs_stream (the streamed heads' body) writes by MOVNTPS / MOVNTPD, and the bits of
    rotate_pairs_simd."""
    from numba import njit

    @njit(cache=False)   # not cached: its machine code is inspected
    def streamed(x, o, cos, sin):
        n = rotation.rotate_pairs_stream(x, 0, o, 0, cos, sin, 1, 32, False, False)
        simd.store_fence()
        return n

    @njit(cache=False)
    def cached(x, o, cos, sin):
        return rotation.rotate_pairs_simd(x, 0, o, 0, cos, sin, 1, 32, False, False)

    rng = np.random.default_rng(0)
    x, cos, sin = (rng.standard_normal(shape).astype(np.float32) for shape in ((64,), (4, 32), (4, 32)))
    a, b = np.zeros(64, np.float32), np.zeros(64, np.float32)
    assert streamed(x, a, cos, sin) == cached(x, b, cos, sin) == 32
    np.testing.assert_array_equal(a, b)
    assert "movntp" in streamed.inspect_asm(streamed.signatures[0])


# -- linear attention: borrowed work buffers ----------------------------------------------------------
@pytest.mark.parametrize("groups,decayed", [(1, False), (2, True)])
@pytest.mark.parametrize("causal", [True, False])
def test_linear_attention_task_range_equals_single_tasks(rng, causal, groups, decayed):
    """One call over all (batch, k/v head) tasks (work buffers borrowed: views without refcounts, owners
    kept alive to the end; one set of buffers serving every task of the range) gives exactly the bits of
    one call per task, tasks in reverse order: nothing of a task leaks into the next. Also with GQA (two
    q heads per k/v head) and decay."""
    from rotary.backends.numpy_linear import decay_powers

    decayed = decayed and causal
    B, T, H, m, dv = 2, 37, 4, 20, 9
    Hk = H // groups
    q = rng.standard_normal((B, T, H, m)).astype(np.float32)
    k = rng.standard_normal((B, T, Hk, m)).astype(np.float32)
    v = rng.standard_normal((B, T, Hk, dv)).astype(np.float32)
    cos, sin, rows = _tables.lookup(rotary.RopeSpec(m), np.arange(T)[None], dtype=np.float32)
    cos, sin, rows = (np.ascontiguousarray(a) for a in (cos, sin, rows.astype(np.int64)))
    ss = rng.standard_normal((B, Hk, m, dv)).astype(np.float32)
    sz = rng.random((B, Hk, m)).astype(np.float32)
    geo = np.array([[0, T * n * d, n * d, d, 1] for n, d in ((H, m), (Hk, m), (Hk, dv), (H, dv))], np.int64)
    for chunk in (5, 16, 37):
        powers = decay_powers(rng.uniform(0.5, 1.0, (B, Hk)), chunk) if decayed else np.ones((1, 1, 1))
        outs = []
        for one_range in (True, False):
            o = np.zeros((B, T, H, dv), np.float32)
            ns, nz = np.zeros_like(ss), np.zeros_like(sz)
            args = (q.ravel(), k.ravel(), v.ravel(), o.ravel(), geo, cos, sin, rows, ss, sz, ns, nz)
            tail = (groups, powers if decayed else None, True)
            ranges = [(0, B * Hk)] if one_range else [(t, t + 1) for t in reversed(range(B * Hk))]
            for first, last in ranges:
                la_kernels.linear_attention_tasks(*args, T, m // 2, m, False, True if causal else None, 1, 1e-6, chunk, *tail,
                                               np.zeros(0, np.int64), None, None, first, last)
            outs.append((o, ns, nz))
        for x, y in zip(*outs):
            np.testing.assert_array_equal(x, y)


def test_linear_attention_thread_split_is_bit_identical(rng):
    """Ranges of (batch, k/v head) tasks on several threads give the bits of one thread (each task is
    computed by one thread, whatever the split)."""
    import numba

    q = rng.standard_normal((3, 21, 4, 8)).astype(np.float32)
    k, v = (rng.standard_normal((3, 21, 2, d)).astype(np.float32) for d in (8, 5))
    cos, sin, rows = _tables.lookup(rotary.RopeSpec(8), np.arange(21)[None], dtype=np.float32)
    kw = dict(rotary_dim=8, layout="half", causal=True, feature_map="elu", eps=1e-6, chunk=8, state=None,
              decay=np.full((3, 2), 0.9))
    saved = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = nb.linear_attention(q, k, v, cos, sin, rows, **kw)
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
        many = nb.linear_attention(q, k, v, cos, sin, rows, **kw)
    finally:
        numba.set_num_threads(saved)
    for x, y in zip((one[0], *one[1]), (many[0], *many[1])):
        np.testing.assert_array_equal(x, y)


# -- linear attention: large outputs written by non-temporal stores -----------------------------------
@pytest.mark.parametrize("dtype,causal", [(np.float32, True), (np.float32, False), (np.float64, True)])
def test_linear_attention_streamed_output_equals_cached_stores(rng, dtype, causal):
    """An output of >= STREAM_MIN_BYTES is written by non-temporal stores (store_row's stream path): the same
    bits as the ordinary stores of a smaller call. Causal: the first 256 tokens of a 4 MiB call against a
    call on those tokens alone (nothing later reaches them); non-causal: the kernel called directly on o
    at an aligned and a misaligned address (one element off: the ordinary stores), the same bits."""
    H, m, dv = 8, 16, 16
    T = la_kernels.STREAM_MIN_BYTES // (H * dv * np.dtype(dtype).itemsize)
    q, k, v = (rng.standard_normal((1, T, H, d)).astype(dtype) for d in (m, m, dv))
    spec = rotary.RopeSpec(m)
    if causal:
        o_big, (s_big, z_big) = _run_linear(q, k, v, spec, np.arange(T)[None], causal=True, chunk=64)
        assert o_big.ctypes.data % simd.VECTOR_BYTES == 0   # the backend allocates o aligned
        n = 256
        o_small, _ = _run_linear(q[:, :n], k[:, :n], v[:, :n], spec, np.arange(n)[None], causal=True, chunk=64)
        np.testing.assert_array_equal(o_big[:, :n], o_small)
        assert np.isfinite(o_big).all() and np.abs(o_big[:, -1]).sum() > 0
        return
    cos, sin, rows = _tables.lookup(spec, np.arange(T)[None], dtype=dtype)
    cos, sin, rows = (np.ascontiguousarray(a) for a in (cos, sin, rows.astype(np.int64)))
    geo = np.array([[0, T * H * d, H * d, d, 1] for d in (m, m, dv, dv)], np.int64)
    outs = []
    for shift in (0, 1):
        raw = nb._aligned_empty((T * H * dv + 1,), dtype)
        o = raw[shift:shift + T * H * dv]
        ss, sz = np.zeros((1, H, m, dv), dtype), np.zeros((1, H, m), dtype)
        ns, nz = np.empty_like(ss), np.empty_like(sz)
        la_kernels.linear_attention_tasks(q.ravel(), k.ravel(), v.ravel(), o, geo, cos, sin, rows, ss, sz, ns, nz, T,
                                          m // 2, m, False, None, 1, 1e-6, 64, 1, None, True,
                                          np.zeros(0, np.int64), None, None, 0, H)
        outs.append(o.copy())
    np.testing.assert_array_equal(outs[0], outs[1])
    expected, _ = nb.linear_attention(q, k, v, cos, sin, rows, rotary_dim=m, layout="half", causal=False,
                                      feature_map="elu", eps=1e-6, chunk=64, state=None)
    np.testing.assert_array_equal(outs[0].reshape(expected.shape), expected)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n,m,rows,cols", [(64, 64, 64, 64), (37, 20, 64, 40), (5, 9, 8, 16), (3, 64, 3, 3),
                                           (40, 48, 40, 40)])
def test_transpose_rows_equals_numpy(rng, dtype, n, m, rows, cols):
    """transpose_rows (register blocks where the buffers hold them, scalar remainders) writes src[:n].T into
    dest[:m, :n] exactly, whatever the padding; the blocks' scratch columns past n stay inside dest."""
    from numba import njit

    @njit
    def run(src, dest, n):
        la_kernels.transpose_rows(src, dest, n)

    src = rng.standard_normal((max(rows, n), m)).astype(dtype)
    dest = np.full((max(m, 4), max(cols, n)), np.nan, dtype)
    run(src, dest, n)
    np.testing.assert_array_equal(dest[:m, :n], src[:n].T)
    vector = np.empty((simd.lanes(src[0]), simd.lanes(src[0])), dtype)
    block = rng.standard_normal(vector.shape).astype(dtype)
    simd.vtranspose(block, 0, block.shape[1], vector, 0, vector.shape[1])   # the pure-Python form
    np.testing.assert_array_equal(vector, block.T)


_NRT_BALANCE_PROBE = """
import numpy as np, rotary
from numba.core.runtime import rtsys
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((2, 70, 4, 32)).astype(np.float32) for _ in range(3))
qk = rng.standard_normal((32, 1, 8, 64)).astype(np.float32), rng.standard_normal((32, 1, 2, 64)).astype(np.float32)
rope = rotary.Rope(rotary.RopeSpec(64), backend="numba", max_positions=4096)
pos = np.arange(32).reshape(32, 1)

def calls():
    for causal in (True, False):
        rotary.linear_attention(q, k, v, causal=causal, seq_axis=1, backend="numba", chunk=16)
    rotary.linear_attention(q[:, :1], k[:, :1], v[:, :1], causal=True, seq_axis=1, backend="numba",
                            return_state=True)
    rope(*qk, pos, seq_axis=1)
    rotary.apply_qk(*qk, pos, spec=rope.spec, seq_axis=1, backend="numba")

calls()
before = rtsys.get_allocation_stats()
for _ in range(50):
    calls()
after = rtsys.get_allocation_stats()
print(after.alloc - after.free - (before.alloc - before.free), after.mi_alloc - after.mi_free - (before.mi_alloc - before.mi_free))
"""


def test_kernels_release_every_allocation():
    """Numba's runtime counts allocations and meminfos (NUMBA_NRT_STATS=1, a fresh process): after 50 rounds of
    linear attention (causal, non-causal, a one-token step), a Rope call and apply_qk, as many were freed as made.
    The borrowed views and the aligned work buffers must leave none behind."""
    env = dict(os.environ, NUMBA_NRT_STATS="1")
    out = subprocess.run([sys.executable, "-c", _NRT_BALANCE_PROBE], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["0", "0"], out.stdout
