"""The one plan of a rotation geometry (rotary/frontend/plan.py): a call whose geometry was checked before
still gets every check of what can change between calls with the same key (the memory the arrays share,
the writeable flag), on apply/apply_qk's cached plans and on Rope's."""

import numpy as np
import pytest

import rotary
from rotary import testing
from rotary.frontend import plan as _plan

BACKENDS = [name for name, (ok, _) in rotary.available_backends().items() if ok and name != "cupy"]


def _qk_buffer(rng, dtype=np.float32, B=4, S=1, H=2, D=16):
    """(2, B, S, H, D) memory whose [0] and [1] are q and k of one geometry (same shapes and strides)."""
    return rng.standard_normal((2, B, S, H, D)).astype(dtype)


def _callers(spec, backend):
    rope = rotary.Rope(spec, backend=backend, dtype=np.float32)
    return {
        "apply_qk": lambda q, k, pos, out: rotary.apply_qk(q, k, pos, spec=spec, seq_axis=1, backend=backend, out=out),
        "Rope": lambda q, k, pos, out: rope(q, k, pos, seq_axis=1, out=out),
    }


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("caller", ["apply_qk", "Rope"])
def test_in_place_overlap_is_refused_after_a_planned_call(rng, backend, caller, monkeypatch):
    """An in-place call whose q and k are the same memory (or overlap) raises after valid in-place calls of the
    same geometry made a plan, as on the general path; the memory is left as it was."""
    monkeypatch.setattr(_plan, "_plans", {})
    spec = rotary.RopeSpec(16, base=10000.0)
    call = _callers(spec, backend)[caller]
    pos = rng.integers(0, 100, size=(4, 1))
    for _ in range(3):   # valid: q and k apart, in place (the first call checks, the later ones run the plan)
        buf = _qk_buffer(rng)
        q, k = buf[0], buf[1]
        want = [testing.rope_2x2(np.swapaxes(x, 1, 2).astype(np.float64), pos[:, None, :], spec.inv_freq())
                for x in (q, k)]
        call(q, k, pos, (q, k))
        for x, w in zip((q, k), want):
            testing.assert_close(x, np.swapaxes(w, 1, 2), like=x)
    buf = _qk_buffer(rng)
    q, k = buf[0], buf[0][...]   # the same memory through two view objects, the geometry of the plan
    kept = buf.copy()
    with pytest.raises(ValueError, match="overlaps"):
        call(q, k, pos, (q, k))
    np.testing.assert_array_equal(buf, kept)
    flat = rng.standard_normal(2 * 4 * 2 * 16).astype(np.float32)
    q = flat[:4 * 2 * 16].reshape(4, 1, 2, 16)
    k = flat[16:16 + 4 * 2 * 16].reshape(4, 1, 2, 16)   # k starts inside q: a partial overlap
    kept = flat.copy()
    with pytest.raises(ValueError, match="overlaps"):
        call(q, k, pos, (q, k))
    np.testing.assert_array_equal(flat, kept)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("caller", ["apply_qk", "Rope"])
def test_separate_outs_are_checked_on_every_planned_call(rng, backend, caller, monkeypatch):
    """Separate out= buffers of a planned geometry: an out that overlaps the other input, two outs that overlap,
    and a read-only out raise as on the general path; the inputs are never written."""
    monkeypatch.setattr(_plan, "_plans", {})
    spec = rotary.RopeSpec(16, base=10000.0)
    call = _callers(spec, backend)[caller]
    pos = rng.integers(0, 100, size=(4, 1))
    buf = _qk_buffer(rng)
    q, k = buf[0], buf[1]
    kept = buf.copy()
    outs = _qk_buffer(rng)
    q_out, k_out = outs[0], outs[1]
    for _ in range(3):
        got = call(q, k, pos, (q_out, k_out))
        assert got[0] is q_out and got[1] is k_out
    np.testing.assert_array_equal(buf, kept)
    with pytest.raises(ValueError, match="overlaps"):
        call(q, k, pos, (k, k_out))   # out for q is k: written before k is read
    with pytest.raises(ValueError, match="overlap"):
        call(q, k, pos, (q_out, q_out[...]))
    read_only = _qk_buffer(rng)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        call(q, k, pos, (read_only[0], k_out))
    np.testing.assert_array_equal(buf, kept)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_plan_is_made_once_per_geometry(rng, backend, monkeypatch):
    """apply_qk builds one plan per geometry key (counted) and reuses it: calls with other positions, offsets and
    buffers of the same geometry build none."""
    monkeypatch.setattr(_plan, "_plans", {})
    built = []
    real = _plan.build_plan
    monkeypatch.setattr(_plan, "build_plan", lambda *a, **kw: built.append(1) or real(*a, **kw))
    spec = rotary.RopeSpec(16, base=10000.0)
    for step in range(4):
        buf = _qk_buffer(rng)
        rotary.apply_qk(buf[0], buf[1], step, spec=spec, seq_axis=1, backend=backend)
        rotary.apply_qk(buf[0], buf[1], rng.integers(0, 50, (4, 1)), spec=spec, seq_axis=1, backend=backend,
                        out=(buf[0], buf[1]))
    assert len(built) == 2, built   # new outputs, and in place


def test_apply_qk_checks_the_same_buffers_by_identity(rng, monkeypatch):
    """apply_qk with the last prepared call's live arrays, unchanged, and the same spec and options skips the plan
    lookup and the overlap tests (rotate._checked); another spec, a flag turned read-only, an alias view or swapped
    outs are checked again; results equal the first call's; the record does not keep the buffers alive."""
    import gc
    import weakref

    from rotary.frontend import buffers, rotate

    if not rotary.available_backends()["numba"][0]:
        pytest.skip(rotary.available_backends()["numba"][1])
    checks = []
    monkeypatch.setattr(rotate, "check_memory", lambda *a: (checks.append(1), buffers.check_memory(*a))[1])
    spec = rotary.RopeSpec(32, base=10000.0)
    q = rng.standard_normal((3, 2, 4, 32)).astype(np.float32)
    k = rng.standard_normal((3, 2, 4, 32)).astype(np.float32)
    q_out, k_out = np.empty_like(q), np.empty_like(k)
    want = rotary.apply_qk(q, k, 7, spec=spec, seq_axis=1, backend="numpy")
    for _ in range(2):   # the geometry's first calls (the plan prepared, then these buffers recorded)
        rotary.apply_qk(q, k, 7, spec=spec, seq_axis=1, backend="numba", out=(q_out, k_out))
    assert checks
    checks.clear()
    for _ in range(3):
        rotary.apply_qk(q, k, 7, spec=spec, seq_axis=1, backend="numba", out=(q_out, k_out))
        np.testing.assert_allclose(q_out, want[0], rtol=1e-6, atol=1e-6)
    assert not checks   # the same live buffers: the verdict kept
    other = rotary.RopeSpec(32, base=500.0)
    got = rotary.apply_qk(q, k, 7, spec=other, seq_axis=1, backend="numba", out=(q_out, k_out))
    np.testing.assert_allclose(got[0], rotary.apply_qk(q, k, 7, spec=other, seq_axis=1, backend="numpy")[0],
                               rtol=1e-6, atol=1e-6)
    assert checks   # another spec: checked again
    q_out.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        rotary.apply_qk(q, k, 7, spec=other, seq_axis=1, backend="numba", out=(q_out, k_out))
    q_out.flags.writeable = True
    with pytest.raises(ValueError, match="overlaps"):
        rotary.apply_qk(q, k, 7, spec=other, seq_axis=1, backend="numba", out=(k, q))
    n = len(checks)
    rotary.apply_qk(q, k, 7, spec=other, seq_axis=1, backend="numba", out=(q_out.view(), k_out))
    assert len(checks) == n + 1   # another object over the same memory: checked again
    q2 = q.copy()
    rotary.apply_qk(q2, k, 7, spec=other, seq_axis=1, backend="numba")
    ref = weakref.ref(q2)
    del q2
    gc.collect()
    assert ref() is None
