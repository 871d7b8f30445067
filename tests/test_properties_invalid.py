"""Property-based tests of the invalid side (issue 25): each drawn invalid call (a state of another
configuration, mismatched cu_seqlens / seqlen_offsets, bad M-RoPE sections, positions out of range for
int64 or of the wrong kind or shape) raises ValueError or TypeError whose message names the argument,
on every entry point that takes it; never an IndexError, OverflowError or a silent result. The cases
first found this way are in the catalogue (rotary/conformance/error_cases.py).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, strategies as st

import rotary

from . import _props as P

INT64_MAX = 2**63 - 1
backends = st.sampled_from(P.BACKENDS)


def assert_clear_error(call, names):
    """call() raises ValueError/TypeError naming one of ``names``."""
    with pytest.raises((ValueError, TypeError)) as info:
        call()
    message = str(info.value)
    assert any(n in message for n in names), f"{type(info.value).__name__} does not name {names}: {message}"


# -- linear-attention states of another configuration -----------------------------------------------------
@P.examples(100)
@given(change=st.sampled_from(["spec", "feature_map", "decay", "normalize", "heads", "dv", "batch", "gqa", "m",
                               "packed"]),
       causal=st.booleans(), backend=backends, seed=st.integers(0, 2**31))
def test_state_of_another_configuration(change, causal, backend, seed):
    r = np.random.default_rng(seed)
    q = r.standard_normal((2, 2, 4, 8)).astype(np.float32)
    kw = dict(causal=True, backend=backend, seq_axis=-2) if change == "decay" else dict(causal=causal, backend=backend, seq_axis=-2)
    _, state = rotary.linear_attention(q, q, q, return_state=True, **kw)
    a = b = c = q
    extra = {}
    if change == "spec":
        extra["spec"] = rotary.RopeSpec(8, base=123.0)
    elif change == "feature_map":
        extra["feature_map"] = "relu"
    elif change == "decay":
        extra["decay"] = 0.5
    elif change == "normalize":
        extra["normalize"] = False
    elif change == "heads":
        a = b = c = q[:, :1]
    elif change == "dv":
        c = q[..., :5]
    elif change == "batch":
        a = b = c = q[:1]
    elif change == "gqa":
        b = c = q[:, :1]
    elif change == "m":
        a = b = q[..., :6]
    else:   # a packed call with the state of a padded batch
        a = b = c = q[0].transpose(1, 0, 2).reshape(8, 1, 8)[:, :, :8]
        extra = dict(seq_axis=0, cu_seqlens=np.array([0, 3, 8]))
    assert_clear_error(lambda: rotary.linear_attention(a, b, c, state=state, **dict(kw, **extra)),
                       ["state", "spec", "head", "shape"])


# -- packed batches -------------------------------------------------------------------------------------
@st.composite
def bad_cu_seqlens(draw):
    lens = draw(st.lists(st.integers(0, 4), min_size=1, max_size=4))
    cu = [0] + list(np.cumsum(lens))
    T = cu[-1]
    how = draw(st.sampled_from(["end+", "end-", "start", "decreasing", "float", "2d", "empty", "huge"]))
    if how == "end+":
        cu[-1] += draw(st.integers(1, 3))
    elif how == "end-":
        if T == 0:
            cu[-1] = -1
        else:
            cu[-1] -= draw(st.integers(1, T))
            if len(cu) > 2 and cu[-1] < cu[-2]:
                pass   # also decreasing: still invalid
    elif how == "start":
        cu[0] = draw(st.sampled_from([1, -1]))
    elif how == "decreasing":
        cu = [0, T + 1, T] if T else [0, 2, 0]
    elif how == "float":
        cu = np.array(cu, np.float64)
    elif how == "2d":
        cu = np.array([cu, cu])
    elif how == "empty":
        cu = np.zeros(0, np.int64)
    else:
        cu = [0, INT64_MAX, T] if T != INT64_MAX else [0, 1, T]
    return cu, T


def entry_points(x, cu, backend, extra=None):
    """Every call that takes cu_seqlens, packed (T, H, d) input."""
    extra = extra or {}
    return [
        lambda: rotary.apply(x, seq_axis=0, cu_seqlens=cu, backend=backend, **extra),
        lambda: rotary.apply_qk(x, x, seq_axis=0, cu_seqlens=cu, backend=backend, **extra),
        lambda: rotary.Rope(rotary.RopeSpec(x.shape[-1]), backend=backend, seq_axis=-2)(x, x, seq_axis=0, cu_seqlens=cu, **extra),
        lambda: rotary.attention(x, x, x, seq_axis=0, cu_seqlens=cu, backend=backend, **extra),
        lambda: rotary.linear_attention(x, x, x, seq_axis=0, cu_seqlens=cu, backend=backend, **extra),
    ]


@P.examples(100)
@given(bad=bad_cu_seqlens(), backend=backends, which=st.integers(0, 4))
def test_mismatched_cu_seqlens(bad, backend, which):
    cu, T = bad
    x = np.zeros((max(T, 0), 2, 8), np.float32)
    assert_clear_error(entry_points(x, cu, backend)[which], ["cu_seqlens"])


@P.examples(60)
@given(lens=st.lists(st.integers(0, 4), min_size=1, max_size=3), backend=backends, which=st.integers(0, 4),
       how=st.sampled_from(["length", "float", "wrap", "2**63", "2d"]))
def test_bad_seqlen_offsets(lens, backend, which, how):
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    N, T = len(lens), int(cu[-1])
    if how == "wrap" and max(lens) < 2:   # a sequence of 2 tokens or more starting at INT64_MAX wraps
        lens = lens + [2]
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        N, T = len(lens), int(cu[-1])
    offsets = {"length": np.zeros(N + 1, np.int64), "float": np.zeros(N) + 0.5, "2d": np.zeros((N, 1), np.int64),
               "wrap": np.full(N, INT64_MAX, np.int64), "2**63": 2**63}[how]
    x = np.zeros((T, 2, 8), np.float32)
    assert_clear_error(entry_points(x, cu, backend, dict(seqlen_offsets=offsets))[which], ["seqlen_offsets"])


def test_cu_seqlens_k_mismatch():
    x = np.zeros((7, 2, 8), np.float32)
    for cu_k in ([0, 3, 6], [0, 7], [0, 4, 3, 7], np.array([0, 3, 7.0])):
        assert_clear_error(lambda: rotary.attention(x, x, x, seq_axis=0, cu_seqlens=[0, 3, 7], cu_seqlens_k=cu_k),
                           ["cu_seqlens_k"])


# -- M-RoPE sections ------------------------------------------------------------------------------------
@P.examples(100)
@given(section=st.lists(st.one_of(st.integers(-2, 6), st.floats(0.5, 3.5)), min_size=0, max_size=5),
       rotary_dim=st.sampled_from([4, 8, 12]), layout=st.sampled_from(["chunked", "interleaved", "ernie"]))
def test_bad_mrope_sections(section, rotary_dim, layout):
    # three non-negative ints; chunked and ernie sections sum to rotary_dim/2, interleaved ones need not (HF's
    # interleaved rule reads t wherever no h/w slot falls)
    ok = (len(section) == 3 and all(isinstance(s, int) and s >= 0 for s in section)
          and (sum(section) == rotary_dim // 2 or layout == "interleaved"))
    call = lambda: rotary.RopeSpec(rotary_dim, mrope_section=section, mrope_layout=layout)  # noqa: E731
    if ok:
        call()
    else:
        assert_clear_error(call, ["mrope_section"])


# -- positions out of range, of the wrong kind or shape --------------------------------------------------
@st.composite
def bad_positions(draw, S):
    how = draw(st.sampled_from(["offset-wrap", "uint64", "float", "nan", "shape", "batch", "bool", "str",
                                "float-offset", "2d-for-1d"]))
    if how == "offset-wrap":
        return draw(st.integers(INT64_MAX - S + 2, 2**70)) if S else 2**64
    if how == "uint64":
        a = np.zeros(S, np.uint64)
        if S:
            a[draw(st.integers(0, S - 1))] = np.uint64(2**63 + draw(st.integers(0, 1000)))
            return a
        return np.uint64(2**64 - 1)
    if how == "float":
        return np.arange(S) + 0.5 if S else np.array(0.5)
    if how == "nan":
        return np.full(S, np.nan) if S else np.array(np.nan)
    if how == "shape":
        return np.arange(S + draw(st.integers(1, 3)))
    if how == "batch":
        return np.zeros((5, S), np.int64)
    if how == "bool":
        return True
    if how == "str":
        return np.array(["a"] * max(S, 1))
    if how == "float-offset":
        return 1.5
    return np.zeros((S, 2), np.int64) if S != 2 else np.zeros((S, 5), np.int64)


@P.examples(200)
@given(S=st.integers(0, 5), data=st.data(), backend=backends,
       entry=st.sampled_from(["apply", "apply_qk", "Rope", "attention", "linear_attention", "rerotate-from",
                              "rerotate-to", "q_positions"]))
def test_bad_positions(S, data, backend, entry):
    p = data.draw(bad_positions(S))
    x = np.zeros((2, 3, S, 8), np.float32)   # batch 2 (a batch of 5 positions is wrong)
    calls = {
        "apply": (lambda: rotary.apply(x, p, backend=backend, seq_axis=-2), ["positions"]),
        "apply_qk": (lambda: rotary.apply_qk(x, x, p, backend=backend, seq_axis=-2), ["positions"]),
        "Rope": (lambda: rotary.Rope(rotary.RopeSpec(8), backend=backend, seq_axis=-2)(x, x, p), ["positions"]),
        "attention": (lambda: rotary.attention(x, x, x, p, backend=backend, seq_axis=-2), ["positions"]),
        "linear_attention": (lambda: rotary.linear_attention(x, x, x, p, backend=backend, seq_axis=-2), ["positions"]),
        "rerotate-from": (lambda: rotary.rerotate(x, p, 0, backend=backend, seq_axis=-2), ["from_positions"]),
        "rerotate-to": (lambda: rotary.rerotate(x, 0, p, backend=backend, seq_axis=-2), ["to_positions"]),
        "q_positions": (lambda: rotary.attention(x, x, x, q_positions=p, k_positions=np.arange(S), backend=backend, seq_axis=-2),
                        ["q_positions"]),
    }
    call, names = calls[entry]
    assert_clear_error(call, names)


@P.examples(20)
@given(S=st.integers(1, 5), n_axes=st.integers(2, 3), backend=backends,
       how=st.sampled_from(["nan", "inf", "1d", "wrong-axes", "int-offset"]))
def test_bad_multi_axis_positions(S, n_axes, backend, how):
    spec = rotary.RopeSpec.axial(12, axes=n_axes, float_positions=how in ("nan", "inf"))
    p = {"nan": np.full((S, n_axes), np.nan), "inf": np.full((S, n_axes), np.inf), "1d": np.arange(S),
         "wrong-axes": np.zeros((S, n_axes + 1), np.int64), "int-offset": 3}[how]
    x = np.zeros((1, S, 12), np.float32)
    assert_clear_error(lambda: rotary.apply(x, p, spec=spec, backend=backend, seq_axis=-2), ["positions"])
