"""Small (decode-sized) calls: the frontend's cheap path for plain NumPy arrays, the Numba glue's
cached geometry and cheap buffers, and the parallel/serial choice give the float64 oracle's results
and bit-identical results to the general path (array subclasses, merged head axes, strided buffers)."""

import itertools

import numpy as np
import pytest

import rotary
from rotary import testing
from rotary.backends import available_backends

BACKENDS = [pytest.param(name, marks=() if ok else pytest.mark.skip(reason=reason), id=name)
            for name, (ok, reason) in available_backends().items() if name in ("numpy", "numba")]
DTYPES = [np.float16, np.float32, np.float64]


class _Sub(np.ndarray):
    """An ndarray subclass: takes the frontend's general (array-API namespace) path."""


def _decode_inputs(rng, dtype, B=4, S=1, Hq=8, Hk=2, D=16, bhsd=False):
    """q, k in BSHD (or BHSD) and the matching seq_axis."""
    shape_q, shape_k = ((B, Hq, S, D), (B, Hk, S, D)) if bhsd else ((B, S, Hq, D), (B, S, Hk, D))
    q = rng.standard_normal(shape_q).astype(dtype)
    k = rng.standard_normal(shape_k).astype(dtype)
    return q, k, (2 if bhsd else 1)


def _positions(kind, rng, B, S):
    if kind == "per_batch":
        return rng.integers(0, 5000, size=(B, S))
    if kind == "per_batch_int32":
        return rng.integers(0, 5000, size=(B, S)).astype(np.int32)
    if kind == "offset":
        return 1234
    if kind == "shared":
        return np.arange(S) + 77
    return None


def _oracle(x, positions, spec, seq_axis, inverse=False):
    """float64 rope_2x2 of x (BSHD when seq_axis == 1, BHSD when 2) at positions of any accepted form."""
    B, S = x.shape[0], x.shape[seq_axis]
    if positions is None:
        pos = np.broadcast_to(np.arange(S), (B, S))
    elif isinstance(positions, int):
        pos = np.broadcast_to(np.arange(S) + positions, (B, S))
    else:
        pos = np.broadcast_to(np.asarray(positions, np.int64), (B, S))
    bhsd = np.moveaxis(np.asarray(x, np.float64), 1, 2) if seq_axis == 1 else np.asarray(x, np.float64)
    y = testing.rope_2x2(bhsd, pos[:, None, :], spec.inv_freq(), layout=spec.layout,
                         scale=spec.attention_scaling, inverse=inverse)
    return np.moveaxis(y, 2, 1) if seq_axis == 1 else y


def _general_path(q, k, positions, spec, seq_axis, inverse, backend):
    """The same call through the general frontend: subclass inputs and an extra size-1 head axis (merged axes)."""
    extra = -2 if seq_axis == 1 else seq_axis   # BSHD -> (B, S, H, 1, D); BHSD -> (B, H, 1, S, D)
    qs, ks = np.expand_dims(q, extra).view(_Sub), np.expand_dims(k, extra).view(_Sub)
    ax = seq_axis if seq_axis == 1 else seq_axis + 1
    qr, kr = rotary.apply_qk(qs, ks, positions, spec=spec, seq_axis=ax, inverse=inverse, backend=backend)
    return np.squeeze(np.asarray(qr), extra), np.squeeze(np.asarray(kr), extra)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bhsd", [False, True], ids=["BSHD", "BHSD"])
@pytest.mark.parametrize("pos_kind", ["per_batch", "per_batch_int32", "offset", "shared", "none"])
@pytest.mark.parametrize("S", [1, 3])
def test_decode_matches_oracle_and_general_path(rng, backend, dtype, bhsd, pos_kind, S):
    q, k, ax = _decode_inputs(rng, dtype, S=S, bhsd=bhsd)
    q0, k0 = q.copy(), k.copy()
    spec = rotary.RopeSpec(16, base=500000.0)
    positions = _positions(pos_kind, rng, q.shape[0], S)
    qr, kr = rotary.apply_qk(q, k, positions, spec=spec, seq_axis=ax, backend=backend)
    assert type(qr) is np.ndarray and type(kr) is np.ndarray
    assert qr.dtype == dtype and kr.dtype == dtype and qr.shape == q.shape and kr.shape == k.shape
    np.testing.assert_array_equal(q, q0)   # inputs untouched
    np.testing.assert_array_equal(k, k0)
    testing.assert_close(qr, _oracle(q, positions, spec, ax), like=q)
    testing.assert_close(kr, _oracle(k, positions, spec, ax), like=k)
    gq, gk = _general_path(q, k, positions, spec, ax, False, backend)
    np.testing.assert_array_equal(qr, gq)
    np.testing.assert_array_equal(kr, gk)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bhsd", [False, True], ids=["BSHD", "BHSD"])
@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_out_and_in_place_equal_the_fresh_result(rng, backend, dtype, bhsd, layout):
    q, k, ax = _decode_inputs(rng, dtype, B=3, S=1, Hq=4, Hk=1, D=12, bhsd=bhsd)
    spec = rotary.RopeSpec(12, rotary_dim=8, base=10000.0, layout=layout)   # a pass-through tail
    positions = rng.integers(0, 3000, size=(3, 1))
    fresh = rotary.apply_qk(q, k, positions, spec=spec, seq_axis=ax, backend=backend, inverse=True)
    testing.assert_close(fresh[0], _oracle(q, positions, spec, ax, inverse=True), like=q)

    outs = (np.full_like(q, np.nan), np.full_like(k, np.nan))
    got = rotary.apply_qk(q, k, positions, spec=spec, seq_axis=ax, backend=backend, inverse=True, out=outs)
    assert got[0] is outs[0] and got[1] is outs[1]
    # out buffers with other strides than x: each vector padded to 16 values, axis 2 reversed
    strided = tuple(np.full(a.shape[:3] + (16,), np.nan, dtype)[:, :, ::-1, :12] for a in (q, k))
    got_strided = rotary.apply_qk(q, k, positions, spec=spec, seq_axis=ax, backend=backend, inverse=True,
                                  out=strided)
    qi, ki = q.copy(), k.copy()
    in_place = rotary.apply_qk(qi, ki, positions, spec=spec, seq_axis=ax, backend=backend, inverse=True,
                               out=(qi, ki))
    assert in_place[0] is qi and in_place[1] is ki
    only_q = rotary.apply_qk(q, k, positions, spec=spec, seq_axis=ax, backend=backend, inverse=True,
                             out=(np.empty_like(q), None))
    for result in (got, got_strided, in_place, only_q):
        np.testing.assert_array_equal(result[0], fresh[0])
        np.testing.assert_array_equal(result[1], fresh[1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_apply_single_array_and_repeated_calls(rng, backend):
    """apply() on decode shapes, alternating layouts and in-place flags (the Numba geometry cache's keys)."""
    spec = rotary.RopeSpec(16, base=500000.0)
    for step, (dtype, bhsd, in_place) in enumerate(itertools.product(DTYPES, [False, True], [False, True])):
        x, _, ax = _decode_inputs(rng, dtype, B=2, S=1 + step % 2, Hq=3, bhsd=bhsd)
        positions = rng.integers(0, 100, size=(2, x.shape[ax]))
        expected = _oracle(x, positions, spec, ax)
        work = x.copy()
        y = rotary.apply(work, positions, spec=spec, seq_axis=ax, backend=backend, out=work if in_place else None)
        assert (y is work) == in_place
        testing.assert_close(y, expected, like=x)


@pytest.mark.parametrize("backend", BACKENDS)
def test_three_dimensional_and_seq_first_inputs(rng, backend):
    """Shapes whose canonical view merges or adds axes (not the transposition shortcut)."""
    spec = rotary.RopeSpec(8)
    x = rng.standard_normal((3, 5, 8)).astype(np.float32)   # (H, S, D), seq_axis=-2
    y = rotary.apply(x, 7, spec=spec, backend=backend, seq_axis=-2)
    testing.assert_close(y, testing.rope_2x2(x, np.arange(5) + 7, spec.inv_freq()), like=x)
    x = rng.standard_normal((5, 3, 8)).astype(np.float32)   # (S, H, D), seq_axis=0
    y = rotary.apply(x, None, spec=spec, seq_axis=0, backend=backend)
    expected = np.moveaxis(testing.rope_2x2(np.moveaxis(x, 0, 1), np.arange(5), spec.inv_freq()), 1, 0)
    testing.assert_close(y, expected, like=x)


def test_parallel_and_serial_kernels_agree_on_decode(rng, monkeypatch):
    pytest.importorskip("numba")
    from rotary.backends import numba as nb
    from rotary.backends import numba_runtime as nb_runtime  # noqa: E402  (the size rule)

    q, k, ax = _decode_inputs(rng, np.float32, B=8, S=1, Hq=8, Hk=2, D=64)
    spec = rotary.RopeSpec(64, base=500000.0)
    positions = rng.integers(0, 8000, size=(8, 1))
    for knob in ("PARALLEL_MIN_ELEMENTS", "DECODE_PARALLEL_MIN_ELEMENTS", "PARALLEL_MIN_TOKENS"):
        monkeypatch.setattr(nb_runtime, knob, 0)
    parallel = rotary.apply_qk(q, k, positions, spec=spec, seq_axis=ax, backend="numba")
    monkeypatch.setattr(nb_runtime, "PARALLEL_MIN_ELEMENTS", 1 << 62)
    serial = rotary.apply_qk(q, k, positions, spec=spec, seq_axis=ax, backend="numba")
    for a, b in zip(parallel, serial):
        np.testing.assert_array_equal(a, b)
    testing.assert_close(parallel[0], _oracle(q, positions, spec, ax), like=q)


def test_decode_kernel_can_be_fixed(rng, monkeypatch):
    """Rope decode in the middle size range runs the kernel DECODE_KERNEL names ("auto": the size rule, parallel,
    serial under OMP_WAIT_POLICY=PASSIVE; "serial"; "parallel"), every one with equal bits and the oracle's values."""
    pytest.importorskip("numba")
    from rotary.backends import numba as nb
    from rotary.backends import numba_runtime as nb_runtime  # noqa: E402  (the size rule)
    from rotary.backends.numba_kernels import rotation

    q, k, ax = _decode_inputs(rng, np.float32, B=32, S=1, Hq=32, Hk=8, D=128)
    assert nb_runtime.PARALLEL_MIN_ELEMENTS <= q.size + k.size < nb_runtime.DECODE_PARALLEL_MIN_ELEMENTS
    spec = rotary.RopeSpec(128, base=500000.0)
    positions = rng.integers(0, 8000, size=(32, 1))
    rope = rotary.Rope(spec, backend="numba", max_positions=8192, seq_axis=-2)
    ran = []
    for name in ("rotate_qk_serial", "rotate_qk_parallel"):
        kernel = getattr(rotation, name)
        monkeypatch.setattr(rotation, name, lambda *a, _k=kernel, _n=name: (ran.append(_n), _k(*a))[1])
    results = {}
    for mode, passive, expected in (("auto", False, "parallel"), ("auto", True, "serial"), ("serial", False, "serial"),
                                    ("parallel", True, "parallel")):
        monkeypatch.setattr(nb_runtime, "DECODE_KERNEL", mode)
        monkeypatch.setattr(nb_runtime, "_PASSIVE_WORKERS", passive)   # OMP_WAIT_POLICY=PASSIVE: auto keeps decode serial
        rope(q, k, positions, seq_axis=ax)                    # validated: the general path; the plan from here on
        ran.clear()
        results[mode] = rope(q, k, positions, seq_axis=ax)
        assert ran == [f"rotate_qk_{expected}"], mode
    for mode in ("serial", "parallel"):
        for a, b in zip(results["auto"], results[mode]):
            np.testing.assert_array_equal(a, b)
    testing.assert_close(results["auto"][0], _oracle(q, positions, spec, ax), like=q)


@pytest.mark.parametrize("make", [
    lambda a: a.transpose(0, 2, 1, 3),               # a transposition of a dense block
    lambda a: a[:, ::-1].transpose(0, 2, 1, 3),      # a negative stride
    lambda a: a[:, :, 1:, ::2],                      # not dense
    lambda a: a[:1, :1, :1],                          # size-1 axes
], ids=["transposed", "negative", "sparse", "size1"])
def test_flat_view_addresses_every_element(make):
    pytest.importorskip("numba")
    from rotary.backends import numba as nb
    from rotary.backends import numba_runtime as nb_runtime  # noqa: E402  (the size rule)

    base = np.arange(2 * 3 * 4 * 6, dtype=np.float32).reshape(2, 3, 4, 6)
    a = make(base)
    buf, offset, strides = nb.flat_view(a)
    for idx in np.ndindex(a.shape):
        assert buf[offset + sum(i * s for i, s in zip(idx, strides))] == a[idx]


# -- errors on the cheap path: the same messages as before -------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_decode_inputs_raise_the_same_errors(rng, backend):
    q, k, ax = _decode_inputs(rng, np.float32)
    spec = rotary.RopeSpec(16)
    with pytest.raises(TypeError, match="q must have a real floating dtype"):
        rotary.apply_qk(q.astype(np.int32), k, spec=spec, seq_axis=ax, backend=backend)
    with pytest.raises(TypeError, match="k must have a real floating dtype"):
        rotary.apply_qk(q, k.astype(np.complex64), spec=spec, seq_axis=ax, backend=backend)
    with pytest.raises(ValueError, match=r"positions of shape \(4, 2\)"):
        rotary.apply_qk(q, k, np.zeros((4, 2), np.int64), spec=spec, seq_axis=ax, backend=backend)
    with pytest.raises(TypeError, match="positions must have an integer dtype"):
        rotary.apply_qk(q, k, np.zeros((4, 1)), spec=spec, seq_axis=ax, backend=backend)
    with pytest.raises(ValueError, match="k of shape"):
        rotary.apply_qk(q, k[:3], spec=spec, seq_axis=ax, backend=backend)
    with pytest.raises(ValueError, match="out for q must have q's dtype"):
        rotary.apply_qk(q, k, spec=spec, seq_axis=ax, backend=backend, out=(q.astype(np.float64), None))
    with pytest.raises(ValueError, match="out for k is read-only"):
        ro = np.empty_like(k)
        ro.setflags(write=False)
        rotary.apply_qk(q, k, spec=spec, seq_axis=ax, backend=backend, out=(None, ro))
    buf = np.zeros((5,) + q.shape[1:], np.float32)
    with pytest.raises(ValueError, match="overlaps"):
        rotary.apply(buf[:4], spec=spec, seq_axis=ax, backend=backend, out=buf[1:])
    with pytest.raises(ValueError, match=r"spec.head_dim \(8\) does not match q.shape\[-1\] \(16\)"):
        rotary.apply_qk(q, k, spec=rotary.RopeSpec(8), seq_axis=ax, backend=backend)
    with pytest.raises(ValueError, match="seq_axis"):
        rotary.apply_qk(q, k, spec=spec, seq_axis=3, backend=backend)


# -- the plans of plain NumPy calls (a geometry validated once) --------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_validated_geometry_keeps_every_check(rng, backend, monkeypatch):
    """After a call has validated a geometry (its plan is kept), calls with the same shapes, strides and
    dtype still get the general path's errors for what a plan cannot prove: positions, read-only or
    overlapping outs, another spec; and its results match the oracle with the general path not run."""
    from rotary.frontend import plan as _rotate

    monkeypatch.setattr(_rotate, "_plans", {})   # room for this test's plans (the cache holds 64)
    spec = rotary.RopeSpec(16, base=500.0)
    q, k, ax = _decode_inputs(rng, np.float32, Hq=2, Hk=2)   # q and k of one shape: outs can be swapped
    q_out, k_out = np.empty_like(q), np.empty_like(k)
    pos = rng.integers(0, 3000, size=(4, 1))
    for out in (None, (q_out, k_out)):
        rotary.apply_qk(q, k, pos, spec=spec, seq_axis=ax, backend=backend, out=out)   # validates, keeps a plan
    general = []
    monkeypatch.setattr(_rotate, "normalize_positions", lambda *a, **kw: general.append(1) or
                        normalize_positions(*a, **kw))
    for positions in (pos, 7, None, np.array([11], np.int64)):
        for out in (None, (q_out, k_out)):
            got = rotary.apply_qk(q, k, positions, spec=spec, seq_axis=ax, backend=backend, out=out)
            for x, y in zip((q, k), got):
                np.testing.assert_allclose(y, _oracle(x, positions, spec, ax), rtol=2e-5, atol=2e-5)
            if out is not None:
                assert got[0] is q_out and got[1] is k_out
    assert not general, "a call of a validated geometry ran the general path"
    with pytest.raises(ValueError, match=r"positions of shape \(4, 2\)"):
        rotary.apply_qk(q, k, np.zeros((4, 2), np.int64), spec=spec, seq_axis=ax, backend=backend)
    with pytest.raises(TypeError, match="positions must have an integer dtype"):
        rotary.apply_qk(q, k, np.zeros((4, 1)), spec=spec, seq_axis=ax, backend=backend)
    with pytest.raises(ValueError, match="outside int64"):
        rotary.apply_qk(q, k, 2**63, spec=spec, seq_axis=ax, backend=backend)
    with pytest.raises(ValueError, match=r"spec.head_dim \(8\)"):
        rotary.apply_qk(q, k, pos, spec=rotary.RopeSpec(8), seq_axis=ax, backend=backend)
    ro = np.empty_like(k)
    ro.setflags(write=False)
    with pytest.raises(ValueError, match="out for k is read-only"):
        rotary.apply_qk(q, k, pos, spec=spec, seq_axis=ax, backend=backend, out=(q_out, ro))
    with pytest.raises(ValueError, match="overlaps"):
        rotary.apply_qk(q, k, pos, spec=spec, seq_axis=ax, backend=backend, out=(k, q))   # each the other input
    with pytest.raises(ValueError, match="overlap"):
        rotary.apply_qk(q, k, pos, spec=spec, seq_axis=ax, backend=backend, out=(q_out, q_out))
    both = np.empty((2,) + q.shape, np.float32)   # disjoint views of one buffer: fine (general path)
    rotary.apply_qk(q, k, pos, spec=spec, seq_axis=ax, backend=backend, out=(both[0], both[1]))
    np.testing.assert_allclose(both[0], _oracle(q, pos, spec, ax), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(both[1], _oracle(k, pos, spec, ax), rtol=2e-5, atol=2e-5)
    q0 = q.copy()
    rotary.apply_qk(q, k, pos, spec=spec, seq_axis=ax, backend=backend, out=(q_out, k_out))
    np.testing.assert_array_equal(q, q0)   # inputs never written by a separate-out call


from rotary.frontend.normalize import normalize_positions  # noqa: E402  (the real one, for the counting stand-in)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_plan_gives_the_general_paths_bits(rng, backend, dtype, monkeypatch):
    """The second call of a geometry (its plan) equals the first (the general path) bit for bit: BSHD,
    BHSD (no plan: a transposed view), (S, H, D) with seq_axis=0, apply and apply_qk, new outputs, in
    place and separate outs, positions None / int / (S,) / (B, S)."""
    from rotary.frontend import plan as _rotate

    monkeypatch.setattr(_rotate, "_plans", {})
    spec = rotary.RopeSpec(16, base=1000.0)
    forms = []
    for bhsd in (False, True):
        q, k, ax = _decode_inputs(rng, dtype, S=3, bhsd=bhsd)
        forms.append((q, k, ax, rng.integers(0, 900, size=(4, 3))))
    q3, k3 = q[0].transpose(1, 0, 2).copy(), k[0].transpose(1, 0, 2).copy()   # (S, H, D)
    forms.append((q3, k3, 0, np.arange(3) + 40))
    for q, k, ax, pos in forms:
        for positions in (pos, None, 17):
            for mode in ("new", "separate", "in place"):
                results = []
                for _ in range(2):
                    qi, ki = q.copy(), k.copy()
                    out = {"new": None, "separate": (np.empty_like(q), np.empty_like(k)), "in place": (qi, ki)}[mode]
                    got = rotary.apply_qk(qi, ki, positions, spec=spec, seq_axis=ax, backend=backend, out=out)
                    one = rotary.apply(qi if mode != "in place" else q.copy(), positions, spec=spec, seq_axis=ax,
                                       backend=backend)
                    results.append((got[0].copy(), got[1].copy(), one))
                for a, b in zip(*results):
                    np.testing.assert_array_equal(a, b)
                np.testing.assert_allclose(results[0][0].astype(np.float64), _oracle_any(q, positions, spec, ax),
                                           **_TOL[np.dtype(dtype).name])
    assert _rotate._plans, "no plan was made"


_TOL = {"float16": dict(rtol=2e-3, atol=4e-3), "float32": dict(rtol=2e-5, atol=2e-5),
        "float64": dict(rtol=1e-12, atol=1e-12)}


def _oracle_any(x, positions, spec, ax):
    """float64 oracle for BSHD (ax=1), BHSD (ax=2) or (S, H, D) (ax=0) input."""
    if ax == 0:
        return _oracle(x[None], positions, spec, 1)[0]
    return _oracle(x, positions, spec, ax)


def test_decode_kernel_environment_variable_is_checked():
    pytest.importorskip("numba")
    import os
    import subprocess
    import sys

    env = dict(os.environ, ROTARY_NUMBA_DECODE_KERNEL="fastest")
    run = subprocess.run([sys.executable, "-c", "import rotary.backends.numba"], env=env, capture_output=True,
                         text=True)
    assert run.returncode != 0 and "ROTARY_NUMBA_DECODE_KERNEL" in run.stderr and "'fastest'" in run.stderr
    env["ROTARY_NUMBA_DECODE_KERNEL"] = "serial"
    run = subprocess.run([sys.executable, "-c", "import rotary.backends.numba_runtime as r; print(r.DECODE_KERNEL)"],
                         env=env, capture_output=True, text=True)
    assert run.stdout.strip() == "serial", run.stderr


@pytest.mark.parametrize("backend", BACKENDS)
def test_apply_qk_plans_use_the_cached_table_and_fall_back(rng, backend, monkeypatch):
    """A planned apply_qk decode call rotates with the cached dense table while it holds the positions
    (no lookup: counted here), and takes lookup's path for positions past it, a cleared cache, another
    dtype, an offset and a spec whose frequencies depend on the positions; every result against the
    float64 oracle."""
    from rotary.frontend import plan as frontend_plan
    from rotary.spec import tables

    lookups = []
    real_lookup = tables.lookup
    monkeypatch.setattr(frontend_plan._tables, "lookup", lambda *a, **kw: (lookups.append(1), real_lookup(*a, **kw))[1])
    spec = rotary.RopeSpec(64, base=10000.0)
    for dtype in (np.float32, np.float64):
        q, k, ax = _decode_inputs(rng, dtype, B=8, S=1, Hq=4, Hk=2, D=64)
        for positions in (rng.integers(0, 500, (8, 1)), rng.integers(0, 500, (8, 1)), rng.integers(90000, 99000, (8, 1)),
                          rng.integers(0, 500, (8, 1)), 7, None):
            for _ in range(2):
                got = rotary.apply_qk(q, k, positions, spec=spec, seq_axis=ax, backend=backend)
                testing.assert_close(got[0], _oracle(q, positions, spec, ax), like=q)
                testing.assert_close(got[1], _oracle(k, positions, spec, ax), like=k)
        tables.clear_cache()
        positions = rng.integers(0, 500, (8, 1))
        got = rotary.apply_qk(q, k, positions, spec=spec, seq_axis=ax, backend=backend)
        testing.assert_close(got[0], _oracle(q, positions, spec, ax), like=q)
    q, k, ax = _decode_inputs(rng, np.float32, B=8, S=1, Hq=4, Hk=2, D=64)
    rotary.apply_qk(q, k, rng.integers(0, 500, (8, 1)), spec=spec, seq_axis=ax, backend=backend)   # remakes the table
    lookups.clear()
    for _ in range(3):
        positions = rng.integers(0, 500, (8, 1))
        got = rotary.apply_qk(q, k, positions, spec=spec, seq_axis=ax, backend=backend)
        testing.assert_close(got[0], _oracle(q, positions, spec, ax), like=q)
    plan_backends = {"numba"}   # backends with prepare_rotation (the cached-table path): no lookup once planned
    if backend in plan_backends:
        assert len(lookups) == 0, lookups
    dynamic = rotary.RopeSpec(64, scaling={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=64)
    assert tables.dense_key(dynamic, np.float32) is None
    for positions in (rng.integers(0, 50, (8, 1)), rng.integers(100, 400, (8, 1))):
        for _ in range(2):
            got = rotary.apply_qk(q, k, positions, spec=dynamic, seq_axis=ax, backend=backend)
            expected = rotary.apply_qk(q.astype(np.float64), k.astype(np.float64), positions, spec=dynamic, seq_axis=ax,
                                       backend="numpy")
            testing.assert_close(got[0], expected[0], like=q)
