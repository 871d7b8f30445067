"""No silent axis (issue 37): an input of 3 or more dimensions names its sequence axis, by seq_axis= or a tensor
layout= ("bshd", "bhsd", "thd", ...); a forgotten one raises an error that says which to pass, on every entry
point; the spec's pair layouts ("half", "interleaved") stay what layout= meant before."""

import numpy as np
import pytest

import rotary
from rotary import testing

SPEC = rotary.RopeSpec(16, base=10000.0)


def _bshd(rng, B=2, S=5, H=3, D=16, dtype=np.float32):
    return rng.standard_normal((B, S, H, D)).astype(dtype)


CALLS = {
    "apply": lambda q, k, v, **kw: rotary.apply(q, spec=SPEC, **kw),
    "apply_qk": lambda q, k, v, **kw: rotary.apply_qk(q, k, spec=SPEC, **kw),
    "attention": lambda q, k, v, **kw: rotary.attention(q, k, v, causal=True, spec=SPEC, **kw),
    "linear_attention": lambda q, k, v, **kw: rotary.linear_attention(q, k, v, causal=True, spec=SPEC, **kw),
    "rerotate": lambda q, k, v, **kw: rotary.rerotate(k, 0, 3, spec=SPEC, **kw),
    "Rope": lambda q, k, v, **kw: rotary.Rope(SPEC)(q, k, **kw),
}


@pytest.mark.parametrize("entry", sorted(CALLS))
def test_a_forgotten_axis_is_an_error_that_names_both_ways(rng, entry):
    q, k, v = _bshd(rng), _bshd(rng), _bshd(rng)
    with pytest.raises(ValueError, match=r"name its sequence axis.*seq_axis=1 / layout='bshd'"):
        CALLS[entry](q, k, v)


@pytest.mark.parametrize("entry", sorted(CALLS))
def test_layout_and_seq_axis_name_the_same_axis(rng, entry):
    q, k, v = _bshd(rng), _bshd(rng), _bshd(rng)
    want = CALLS[entry](q, k, v, seq_axis=1)
    for kw in ({"layout": "bshd"}, {"seq_axis": "bshd"}, {"layout": "bshd", "seq_axis": 1}, {"seq_axis": -3}):
        got = CALLS[entry](q, k, v, **kw)
        for a, b in zip(np.atleast_1d(got) if isinstance(got, np.ndarray) else got,
                        np.atleast_1d(want) if isinstance(want, np.ndarray) else want):
            np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="pass one of them"):
        CALLS[entry](q, k, v, layout="bshd", seq_axis=2)


def test_layouts_name_their_sequence_axis(rng):
    x = rng.standard_normal((2, 3, 5, 16)).astype(np.float32)
    for layout, ax in (("bhsd", 2), ("bshd", 1), ("sbhd", 0), ("BHSD", 2)):
        np.testing.assert_array_equal(rotary.apply(x, spec=SPEC, layout=layout), rotary.apply(x, spec=SPEC, seq_axis=ax))
    t = rng.standard_normal((7, 3, 16)).astype(np.float32)
    for layout, ax in (("thd", 0), ("shd", 0), ("hsd", 1), ("bsd", 1)):
        np.testing.assert_array_equal(rotary.apply(t, spec=SPEC, layout=layout), rotary.apply(t, spec=SPEC, seq_axis=ax))
    two = rng.standard_normal((7, 16))
    want = testing.rope_2x2(two, np.arange(7), SPEC.inv_freq())
    testing.assert_close(rotary.apply(two, spec=SPEC), want, like=two)   # 2-D: (seq, dim), nothing to name


def test_pair_layouts_stay_spec_keywords(rng):
    x = _bshd(rng)
    y = rotary.apply(x, base=10000.0, layout="interleaved", seq_axis=1)
    np.testing.assert_array_equal(y, rotary.apply(x, spec=SPEC.replace(layout="interleaved"), seq_axis=1))
    y = rotary.apply(x, base=10000.0, layout="half", seq_axis="bshd")
    np.testing.assert_array_equal(y, rotary.apply(x, spec=SPEC, seq_axis=1))


@pytest.mark.parametrize("bad, match", [("bsd", "names 3 axes"), ("bsh", "one letter each"), ("bxhd", "one letter each"), ("bhds", "one letter each"),
                                        ("bbsd", "one letter each"), ("bhd", "one letter each"), ("stbd", "one letter each")])
def test_bad_layouts(rng, bad, match):
    with pytest.raises(ValueError, match=match):
        rotary.apply(_bshd(rng), spec=SPEC, layout=bad)


def test_rope_holds_the_axis_once(rng):
    q, k = _bshd(rng, H=4), _bshd(rng, H=2)
    want = rotary.apply_qk(q, k, 3, spec=SPEC, seq_axis=1)
    for rope in (rotary.Rope(SPEC, layout="bshd"), rotary.Rope(SPEC, seq_axis=1)):
        for _ in range(2):   # the general path, then the plan
            for a, b in zip(rope(q, k, 3), want):
                np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(rope.apply(q, 3), want[0])
    bhsd = np.ascontiguousarray(q.transpose(0, 2, 1, 3))
    np.testing.assert_array_equal(rotary.Rope(SPEC, layout="bshd").apply(bhsd, 3, seq_axis=2),
                                  want[0].transpose(0, 2, 1, 3))   # a call's own seq_axis overrides
    with pytest.raises(ValueError, match="one letter each"):
        rotary.Rope(SPEC, layout="nope")


def test_gqa_attention_without_axis_points_at_the_axis(rng):
    """The issue's case: q (2, 16, 32, 128), k/v (2, 16, 8, 128) BSHD without seq_axis once said q_len (32) >
    k_len (8); now the error names the sequence axis."""
    spec = rotary.RopeSpec(128)
    q = rng.standard_normal((2, 16, 32, 128)).astype(np.float32)
    kv = rng.standard_normal((2, 16, 8, 128)).astype(np.float32)
    with pytest.raises(ValueError, match="name its sequence axis") as err:
        rotary.attention(q, kv, kv, causal=True, spec=spec)
    assert "q_len" not in str(err.value)


def test_a_bound_spec_holds_the_axis_for_every_entry_point(rng):
    """rotary.bind(spec, layout="bshd") passes the spec, the axis and the backend to each function it wraps: the same
    arrays as the functions called with them; a call's own keywords win."""
    b = rotary.bind(SPEC, layout="bshd", backend="numpy")
    q, k, v = _bshd(rng, H=4), _bshd(rng, H=2), _bshd(rng, H=2)
    kw = dict(spec=SPEC, seq_axis=1, backend="numpy")
    np.testing.assert_array_equal(b.apply(q, 3), rotary.apply(q, 3, **kw))
    for a, w in zip(b.apply_qk(q, k, 3), rotary.apply_qk(q, k, 3, **kw)):
        np.testing.assert_array_equal(a, w)
    np.testing.assert_array_equal(b.attention(q, k, v, causal=True), rotary.attention(q, k, v, causal=True, **kw))
    np.testing.assert_array_equal(b.linear_attention(q, k, v, causal=True),
                                  rotary.linear_attention(q, k, v, causal=True, **kw))
    np.testing.assert_array_equal(b.rerotate(k, 0, 5), rotary.rerotate(k, 0, 5, **kw))
    bhsd = np.ascontiguousarray(q.transpose(0, 2, 1, 3))
    np.testing.assert_array_equal(b.apply(bhsd, 3, seq_axis=2), rotary.apply(q, 3, **kw).transpose(0, 2, 1, 3))
    with pytest.raises(TypeError, match="RopeSpec"):
        rotary.bind("llama")
    with pytest.raises(ValueError, match="one letter each"):
        rotary.bind(SPEC, layout="half")
