"""Every bad input is a ValueError/TypeError naming the argument; nothing is silently broadcast."""

import numpy as np
import pytest

import rotary
from rotary.backends import BackendUnavailableError

X = np.zeros((2, 5, 8), dtype=np.float32)


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(rotary_dim=7), ValueError, "rotary_dim"),
    (dict(rotary_dim=10), ValueError, "rotary_dim"),
    (dict(rotary_dim=0), ValueError, "rotary_dim"),
    (dict(rotary_dim=4.0), TypeError, "rotary_dim"),
    (dict(base=0.0), ValueError, "base"),
    (dict(base=-1.0), ValueError, "base"),
    (dict(base=float("inf")), ValueError, "base"),
    (dict(base="1e4"), TypeError, "base"),
    (dict(layout="neox"), ValueError, "layout"),
    (dict(scaling={"rope_type": "nope"}), ValueError, "rope_type"),
    (dict(scaling={"factor": 2.0}), ValueError, "rope_type"),
    (dict(scaling={"rope_type": "linear"}), ValueError, "factor"),
    (dict(scaling="linear"), TypeError, "scaling"),
    (dict(max_position_embeddings=0), ValueError, "max_position_embeddings"),
    (dict(colour="red"), TypeError, "unexpected keyword"),
])
def test_bad_spec_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        rotary.apply(X, seq_axis=-2, **kwargs)


def test_bad_head_dim():
    with pytest.raises(ValueError, match="head_dim"):
        rotary.RopeSpec(0)
    with pytest.raises(TypeError, match="head_dim"):
        rotary.RopeSpec(64.0)


def test_spec_and_keywords_conflict_and_head_dim_mismatch():
    with pytest.raises(TypeError, match="either spec"):
        rotary.apply(X, spec=rotary.RopeSpec(8), base=5.0, seq_axis=-2)
    with pytest.raises(ValueError, match=r"spec.head_dim \(16\) does not match x.shape\[-1\] \(8\)"):
        rotary.apply(X, spec=rotary.RopeSpec(16), seq_axis=-2)
    with pytest.raises(TypeError, match="spec must be a rotary.RopeSpec"):
        rotary.apply(X, spec={"base": 1.0}, seq_axis=-2)


@pytest.mark.parametrize("positions, exc, match", [
    (np.arange(4), ValueError, r"positions of shape \(4,\)"),
    (np.zeros((3, 5), dtype=int), ValueError, "never broadcast"),
    (np.zeros((2, 1), dtype=int), ValueError, "positions"),
    (np.zeros((2, 5, 1), dtype=int), ValueError, "positions"),
    (np.arange(5.0), TypeError, "integer dtype"),
    (2.0, TypeError, "float"),
    (True, TypeError, "bool"),
    ([0, 1, 2, 3, 4.5], TypeError, "integer dtype"),
])
def test_bad_positions(positions, exc, match):
    with pytest.raises(exc, match=match):
        rotary.apply(X, positions, seq_axis=-2)


def test_positions_on_heads_axis_are_rejected():
    x = np.zeros((2, 4, 5, 8), dtype=np.float32)     # (B, H, S, D): positions (H, S) must not pass as (B, S)
    with pytest.raises(ValueError, match="positions"):
        rotary.apply(x, np.zeros((4, 5), dtype=int), seq_axis=-2)
    with pytest.raises(ValueError, match="no batch axis"):
        rotary.apply(np.zeros((5, 8), dtype=np.float32), np.zeros((1, 5), dtype=int), seq_axis=-2)


@pytest.mark.parametrize("x, exc, match", [
    (np.zeros((2, 5, 8), dtype=np.int32), TypeError, "real floating"),
    (np.zeros((2, 5, 8), dtype=np.complex64), TypeError, "real floating"),
    (np.zeros(8, dtype=np.float32), ValueError, "at least 2 dimensions"),
    ([[0.0] * 8] * 5, TypeError, "must be an array"),
])
def test_bad_x(x, exc, match):
    with pytest.raises(exc, match=match):
        rotary.apply(x, seq_axis=-2)


@pytest.mark.parametrize("seq_axis, exc, match", [
    (-1, ValueError, "seq_axis"), (2, ValueError, "seq_axis"), (3, ValueError, "seq_axis"),
    (-4, ValueError, "seq_axis"), (1.0, TypeError, "seq_axis"), (True, TypeError, "seq_axis"),
])
def test_bad_seq_axis(seq_axis, exc, match):
    with pytest.raises(exc, match=match):
        rotary.apply(X, seq_axis=seq_axis)


@pytest.mark.parametrize("out, exc, match", [
    (np.zeros((2, 5, 9), dtype=np.float32), ValueError, "shape"),
    (np.zeros((2, 5, 8), dtype=np.float64), ValueError, "dtype"),
    ([0.0], TypeError, "out"),
])
def test_bad_out(out, exc, match):
    with pytest.raises(exc, match=match):
        rotary.apply(X, out=out, seq_axis=-2)


def test_out_partially_overlapping_input_is_rejected():
    buf = np.zeros((3, 5, 8), dtype=np.float32)
    with pytest.raises(ValueError, match="overlaps"):
        rotary.apply(buf[:2], out=buf[1:], seq_axis=-2)


def test_out_read_only_is_rejected():
    out = np.zeros_like(X)
    out.setflags(write=False)
    with pytest.raises(ValueError, match="read-only"):
        rotary.apply(X, out=out, seq_axis=-2)


def test_apply_qk_mismatches():
    q = np.zeros((2, 5, 4, 8), dtype=np.float32)
    with pytest.raises(ValueError, match="k of shape"):
        rotary.apply_qk(q, np.zeros((2, 6, 4, 8), dtype=np.float32), seq_axis=-3)
    with pytest.raises(ValueError, match="k of shape"):
        rotary.apply_qk(q, np.zeros((2, 5, 4, 6), dtype=np.float32), seq_axis=-3)
    with pytest.raises(ValueError, match="number of dimensions"):
        rotary.apply_qk(q, np.zeros((5, 4, 8), dtype=np.float32), seq_axis=-3)
    with pytest.raises(TypeError, match="pair"):
        rotary.apply_qk(q, q, out=q, seq_axis=-2)


def test_bad_backend_and_inverse():
    with pytest.raises(ValueError, match="backend must be"):
        rotary.apply(X, backend="tpu", seq_axis=-2)
    with pytest.raises(TypeError, match="inverse"):
        rotary.apply(X, inverse=1, seq_axis=-2)


def test_missing_backend_says_what_to_install(monkeypatch):
    from rotary import backends

    monkeypatch.setitem(backends._MODULES, "numba", "rotary.backends._definitely_missing")
    backends._reset_for_tests()
    try:
        with pytest.raises(BackendUnavailableError, match=r"pip install 'rotary\[numba\]'"):
            rotary.apply(X, backend="numba", seq_axis=-2)
        ok, reason = rotary.available_backends()["numba"]
        assert not ok and "pip install" in reason
    finally:
        monkeypatch.undo()
        backends._reset_for_tests()


def test_decay_curve_bad_input():
    with pytest.raises(ValueError, match="head_dim"):
        rotary.decay_curve(7, 10)
    with pytest.raises(ValueError, match="max_distance"):
        rotary.decay_curve(8, -1)
    with pytest.raises(ValueError, match="base"):
        rotary.decay_curve(8, 10, base=0.0)
