"""Length-extension rules: reference values, edge cases, validation, spec identity, HF config ingestion.

Reference values are the (own) float64 vectors of docs/reference rope-anchors.md (B4-B7); the
formulas are also checked against direct float64 transcriptions. No torch needed (HF itself is
compared in test_peers_hf.py).
"""

import copy
import math
import warnings

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import rotary
from rotary import RopeSpec
from rotary.spec.scaling import ROPE_TYPES, yarn_correction_range, yarn_mscale


def omega(base, d):
    """HF's base frequencies 1 / base**(2i/d), in float64."""
    return 1.0 / base ** (np.arange(0, d, 2, dtype=np.float64) / d)


def yarn(factor=4.0, L0=4096, **extra):
    return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": L0, **extra}


def llama3(factor=8.0, lf=1.0, hf=4.0, L0=8192):
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": lf, "high_freq_factor": hf,
            "original_max_position_embeddings": L0}


def longrope(d=128, L0=4096, **extra):
    return {"rope_type": "longrope", "short_factor": [1.0 + i / 100 for i in range(d // 2)],
            "long_factor": [2.0 + i for i in range(d // 2)], "original_max_position_embeddings": L0, **extra}


# -- reference values (rope-anchors.md, (own)) -----------------------------------------------------
@pytest.mark.parametrize("d, base, L0, expected", [
    (128, 1e4, 4096, (20, 46)), (64, 1e4, 4096, (10, 23)), (128, 1e6, 32768, (23, 40)), (64, 1.5e5, 4096, (8, 18)),
])
def test_yarn_truncated_correction_range(d, base, L0, expected):
    assert yarn_correction_range(base, d, L0, 32, 1, truncate=True) == expected


def test_yarn_fractional_correction_range_and_clamp():
    low, high = yarn_correction_range(1e4, 128, 4096, 32, 1, truncate=False)
    assert low == pytest.approx(20.9445, abs=1e-4) and high == pytest.approx(45.0269, abs=1e-4)
    # high clamps to d - 1 (not d/2 - 1), low to 0
    low, high = yarn_correction_range(1e4, 16, 10**9, 32, 1e-3)
    assert high == 15 and low > 7
    assert yarn_correction_range(1e4, 16, 4, 32, 1)[0] == 0


@pytest.mark.parametrize("s, g", [(2, 1.069315), (4, 1.138629), (8, 1.207944), (16, 1.277259), (32, 1.346574),
                                  (40, 1.368888), (1, 1.0), (0.5, 1.0)])
def test_yarn_g(s, g):
    assert yarn_mscale(s) == pytest.approx(g, abs=1e-6)


@pytest.mark.parametrize("s, A", [(2, 1.040833), (4, 1.080123), (8, 1.118034), (16, 1.154701)])
def test_longrope_default_attention_factor(s, A):
    assert RopeSpec(128, scaling=longrope(factor=s)).attention_scaling == pytest.approx(A, abs=1e-6)


def test_llama3_bands_for_llama_3_1():
    spec = RopeSpec(128, base=5e5, scaling=llama3())
    ratio = omega(5e5, 128) / spec.inv_freq()
    assert np.sum(ratio == 1.0) == 29 and np.sum(ratio == 8.0) == 29
    medium = ratio[(ratio != 1.0) & (ratio != 8.0)]
    np.testing.assert_allclose(medium, [1.2075, 1.5534, 2.0263, 2.6945, 3.6843, 5.2573], atol=1e-4)
    assert spec.attention_scaling == 1.0
    # the pairs are ordered: unchanged (high frequency) first, then medium, then divided
    assert np.all(np.diff(ratio) >= 0)


@pytest.mark.parametrize("n, expected", [(None, 1e4), (1, 1e4), (4096, 1e4), (8192, 30527.74), (16384, 72195.86)])
def test_dynamic_ntk_bases(n, expected):
    spec = RopeSpec(128, scaling={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=4096)
    inv_freq = spec.inv_freq(n)
    assert inv_freq[1] ** (-64) == pytest.approx(expected, abs=0.01)
    np.testing.assert_allclose(inv_freq, omega(inv_freq[1] ** (-64), 128), rtol=1e-13)
    assert spec.depends_on_seq_len and spec.attention_scaling_at(n) == 1.0
    if n is None or n <= 4096:   # HF's reset: within the context, the original frequencies exactly
        np.testing.assert_array_equal(inv_freq, RopeSpec(128).inv_freq())


def test_static_ntk_and_linear():
    spec = RopeSpec(64, base=1e4, scaling={"rope_type": "ntk", "factor": 4})
    np.testing.assert_allclose(spec.inv_freq(), omega(1e4 * 4 ** (64 / 62), 64), rtol=1e-14)
    assert not spec.depends_on_seq_len
    lin = RopeSpec(64, scaling={"rope_type": "linear", "factor": 2.5})
    np.testing.assert_allclose(lin.inv_freq(), omega(1e4, 64) / 2.5, rtol=1e-15)
    assert lin.inv_freq(10**6).tolist() == lin.inv_freq().tolist()


# -- YaRN ------------------------------------------------------------------------------------------
def _yarn_oracle(d, base, s, L0, beta_fast=32, beta_slow=1, truncate=True):
    """Direct float64 transcription of HF's _compute_yarn_parameters (inv_freq only)."""
    low = d * math.log(L0 / (beta_fast * 2 * math.pi)) / (2 * math.log(base))
    high = d * math.log(L0 / (beta_slow * 2 * math.pi)) / (2 * math.log(base))
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(d // 2) - low) / (high - low), 0, 1)
    w = omega(base, d)
    return w / s * ramp + w * (1 - ramp)


@pytest.mark.parametrize("d, base, s, L0, truncate", [
    (128, 1e4, 4.0, 4096, True), (128, 1e4, 4.0, 4096, False), (64, 1.5e5, 32.0, 4096, False),
    (128, 1e6, 4.0, 32768, True), (96, 1e4, 16.0, 2048, True),
])
def test_yarn_inv_freq(d, base, s, L0, truncate):
    spec = RopeSpec(d, base=base, scaling=yarn(s, L0, truncate=truncate))
    np.testing.assert_allclose(spec.inv_freq(), _yarn_oracle(d, base, s, L0, truncate=truncate), rtol=1e-14)
    assert spec.attention_scaling == pytest.approx(0.1 * math.log(s) + 1, rel=1e-15)
    low, high = yarn_correction_range(base, d, L0, 32, 1, truncate)
    w, ours = omega(base, d), spec.inv_freq()
    i = np.arange(d // 2)
    np.testing.assert_array_equal(ours[i <= low], w[i <= low])              # extrapolated: unchanged
    np.testing.assert_allclose(ours[i >= high], w[i >= high] / s, rtol=1e-15)  # interpolated: omega / s


def test_yarn_truncate_false_differs():
    a = RopeSpec(64, base=1.5e5, scaling=yarn(32.0, 4096, truncate=False))
    b = RopeSpec(64, base=1.5e5, scaling=yarn(32.0, 4096))
    assert a != b and not np.allclose(a.inv_freq(), b.inv_freq(), rtol=1e-3)


def test_yarn_degenerate_ramp_low_equals_high():
    spec = RopeSpec(64, scaling=yarn(4.0, 4096, beta_fast=2.0, beta_slow=2.0, truncate=False))
    low, high = yarn_correction_range(1e4, 64, 4096, 2.0, 2.0, False)
    assert low == high
    inv_freq, w = spec.inv_freq(), omega(1e4, 64)
    assert np.all(np.isfinite(inv_freq))
    i = np.arange(32)
    np.testing.assert_array_equal(inv_freq[i <= low], w[i <= low])
    np.testing.assert_allclose(inv_freq[i > low + 0.001], w[i > low + 0.001] / 4, rtol=1e-15)


@pytest.mark.parametrize("extra, expected", [
    ({}, 0.1 * math.log(40) + 1),
    ({"mscale": 1.0, "mscale_all_dim": 0.707}, (0.1 * math.log(40) + 1) / (0.0707 * math.log(40) + 1)),
    ({"mscale": 0.707, "mscale_all_dim": 0.707}, 1.0),                  # DeepSeek-V2: the ratio is 1
    ({"mscale": 1.0, "mscale_all_dim": 0}, 0.1 * math.log(40) + 1),     # both must be truthy
    ({"mscale": 1.0}, 0.1 * math.log(40) + 1),
    ({"attention_factor": 0.5, "mscale": 1.0, "mscale_all_dim": 0.707}, 0.5),   # explicit wins
])
def test_yarn_attention_factor(extra, expected):
    assert RopeSpec(64, scaling=yarn(40.0, 4096, **extra)).attention_scaling == pytest.approx(expected, rel=1e-14)


def test_yarn_hf_defaults_and_or_semantics():
    plain = RopeSpec(64, scaling=yarn())
    assert plain == RopeSpec(64, scaling=yarn(beta_fast=32, beta_slow=1, truncate=True))
    assert plain == RopeSpec(64, scaling=yarn(beta_fast=0, beta_slow=None))     # HF: `beta_fast or 32`
    assert plain.scaling_dict["beta_fast"] == 32.0 and plain.scaling_dict["truncate"] is True
    # factor None -> max_position_embeddings / L0; L0 missing -> max_position_embeddings
    implicit = RopeSpec(64, scaling={"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 4096},
                        max_position_embeddings=16384)
    assert implicit.scaling_dict["factor"] == 4.0
    np.testing.assert_array_equal(implicit.inv_freq(), plain.inv_freq())
    no_l0 = RopeSpec(64, scaling={"rope_type": "yarn", "factor": 4.0}, max_position_embeddings=4096)
    assert no_l0.scaling_dict["original_max_position_embeddings"] == 4096


# -- llama3 / Llama 4 ------------------------------------------------------------------------------
def test_llama4_degenerate_band():
    spec = RopeSpec(128, base=5e5, scaling=llama3(factor=16.0, lf=1.0, hf=1.0))
    w = omega(5e5, 128)
    inv_freq = spec.inv_freq()
    assert np.all(np.isfinite(inv_freq))
    wavelen = 2 * np.pi / w
    np.testing.assert_array_equal(inv_freq[wavelen < 8192], w[wavelen < 8192])
    np.testing.assert_allclose(inv_freq[wavelen > 8192], w[wavelen > 8192] / 16, rtol=1e-15)


def test_llama3_continuous_at_band_edges():
    """sigma is 1 at wavelength L0/hf and 0 at L0/lf, so omega'/omega has no jump at either edge."""
    L0, factor, lf, hf = 8192, 8.0, 1.0, 4.0
    for edge, expected in ((L0 / hf, 1.0), (L0 / lf, factor)):
        for side in (1 - 1e-9, 1 + 1e-9):
            base = (edge * side / (2 * math.pi)) ** 2     # d = 4: pair 1 has wavelength 2*pi*sqrt(base)
            spec = RopeSpec(4, base=base, scaling=llama3(factor, lf, hf, L0))
            assert omega(base, 4)[1] / spec.inv_freq()[1] == pytest.approx(expected, rel=1e-7)


def test_llama4_wavelength_exactly_on_the_degenerate_band():
    """lf == hf and a wavelength exactly L0/lf: HF computes 0/0 there; we give omega/s (vLLM's choice)."""
    lf = 3 / (2 * math.pi)
    assert 3 / lf == 2 * math.pi                                 # d = 2: omega_0 = 1, wavelength 2*pi
    spec = RopeSpec(2, scaling=llama3(factor=16.0, lf=lf, hf=lf, L0=3))
    assert spec.inv_freq().tolist() == [1 / 16]


@settings(max_examples=60, deadline=None)
@given(d=st.sampled_from([8, 32, 64, 128]), log_base=st.floats(2, 14), factor=st.floats(1, 64),
       lf=st.floats(0.25, 4), ratio=st.floats(1, 8), log_l0=st.integers(6, 17))
def test_llama3_ratio_monotone_and_bounded(d, log_base, factor, lf, ratio, log_l0):
    base = math.exp(log_base)
    spec = RopeSpec(d, base=base, scaling=llama3(factor, lf, lf * ratio, 2 ** log_l0))
    r = omega(base, d) / spec.inv_freq()
    assert np.all(np.isfinite(r)) and np.all(r >= 1 - 1e-12) and np.all(r <= factor * (1 + 1e-12))
    assert np.all(np.diff(r) >= -1e-9 * factor)


@settings(max_examples=60, deadline=None)
@given(d=st.sampled_from([8, 32, 64, 128]), log_base=st.floats(2, 14), factor=st.floats(1, 64),
       log_l0=st.integers(6, 17), truncate=st.booleans(), betas=st.tuples(st.floats(0.1, 64), st.floats(0.1, 64)))
def test_yarn_ratio_monotone_and_bounded(d, log_base, factor, log_l0, truncate, betas):
    base = math.exp(log_base)
    spec = RopeSpec(d, base=base, scaling=yarn(factor, 2 ** log_l0, beta_fast=max(betas), beta_slow=min(betas),
                                               truncate=truncate))
    r = omega(base, d) / spec.inv_freq()
    assert np.all(np.isfinite(r)) and np.all(r >= 1 - 1e-12) and np.all(r <= factor * (1 + 1e-12))
    assert np.all(np.diff(r) >= -1e-9 * factor)


# -- LongRoPE / proportional -----------------------------------------------------------------------
def test_longrope_short_long_switch():
    params = longrope(d=16, L0=4096)
    spec = RopeSpec(16, scaling=params, max_position_embeddings=131072)
    w = omega(1e4, 16)
    short, long = np.array(params["short_factor"]), np.array(params["long_factor"])
    assert spec.depends_on_seq_len
    for seq_len, ext in ((None, short), (1, short), (4096, short), (4097, long), (131072, long), (10**7, long)):
        np.testing.assert_allclose(spec.inv_freq(seq_len), w / ext, rtol=1e-15)
    assert spec.attention_scaling == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)), rel=1e-14)
    assert spec.attention_scaling_at(10**6) == spec.attention_scaling


@pytest.mark.parametrize("extra, max_pos, expected", [
    ({"factor": 1.0}, None, 1.0), ({"factor": 0.5}, None, 1.0), ({"attention_factor": 1.3}, 65536, 1.3),
    ({}, 4096, 1.0), ({}, 8192, math.sqrt(1 + math.log(2) / math.log(4096))),
])
def test_longrope_attention_factor_cases(extra, max_pos, expected):
    spec = RopeSpec(16, scaling=longrope(d=16, **extra), max_position_embeddings=max_pos)
    assert spec.attention_scaling == pytest.approx(expected, rel=1e-14)


def test_su_alias_is_longrope():
    params = longrope(d=16, factor=4.0)
    a = RopeSpec(16, scaling=params)
    b = RopeSpec(16, scaling={**{k: v for k, v in params.items() if k != "rope_type"}, "type": "su"})
    assert a == b and hash(a) == hash(b) and b.rope_type == "longrope"


def test_proportional():
    spec = RopeSpec(256, base=1e6, scaling={"rope_type": "proportional", "partial_rotary_factor": 0.25, "factor": 2.0})
    inv_freq = spec.inv_freq()
    assert inv_freq.shape == (128,) and spec.rotary_dim == 256
    np.testing.assert_allclose(inv_freq[:32], 1e6 ** (-np.arange(0, 64, 2) / 256) / 2, rtol=1e-15)
    assert np.all(inv_freq[32:] == 0)
    x = np.random.default_rng(0).standard_normal((5, 256))
    y = rotary.apply(x, np.arange(5) * 1000, spec=spec)
    np.testing.assert_array_equal(y[:, 32:128], x[:, 32:128])       # zero-frequency pairs stay put
    np.testing.assert_array_equal(y[:, 160:], x[:, 160:])


# -- validation ------------------------------------------------------------------------------------
BAD = [
    ({"rope_type": "ntk-by-parts", "factor": 2}, {}, "rope_type", ["default", "linear", "yarn", "llama3", "longrope"]),
    ({"factor": 2.0}, {}, "rope_type", []),
    ({"rope_type": 3}, {}, "rope_type", []),
    ({"rope_type": "linear"}, {}, "factor", ["required"]),
    ({"rope_type": "linear", "factor": 0.0}, {}, "factor", ["> 0"]),
    ({"rope_type": "ntk", "factor": 0.5}, {}, "factor", [">= 1"]),
    ({"rope_type": "linear", "factor": "2"}, {}, "factor", []),
    ({"rope_type": "linear", "factor": True}, {}, "factor", []),
    ({"rope_type": "ntk", "factor": float("nan")}, {}, "factor", []),
    ({"rope_type": "ntk", "factor": 2.0}, {"head_dim": 2}, "rotary_dim", []),
    ({"rope_type": "dynamic", "factor": float("inf")}, {"max_position_embeddings": 4096}, "factor", []),
    ({"rope_type": "dynamic", "factor": 2.0}, {}, "max_position_embeddings", []),
    ({"rope_type": "yarn", "factor": 4.0}, {}, "original_max_position_embeddings", []),
    ({"rope_type": "yarn", "original_max_position_embeddings": 4096}, {}, "factor", []),
    (yarn(factor=0.9), {}, "factor", []),
    ({"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 4096}, {"max_position_embeddings": 2048},
     "factor", [">= 1"]),
    (yarn(original_max_position_embeddings=4096.5), {}, "original_max_position_embeddings", ["integer"]),
    (yarn(L0=0), {}, "original_max_position_embeddings", []),
    (yarn(beta_fast=1.0, beta_slow=32.0), {}, "beta_fast", ["beta_slow"]),
    (yarn(beta_fast=-3.0), {}, "beta_fast", []),
    (yarn(truncate="no"), {}, "truncate", []),
    (yarn(attention_factor=0.0), {}, "attention_factor", []),
    (yarn(mscale="big"), {}, "mscale", []),
    ({**llama3(), "low_freq_factor": None}, {}, "low_freq_factor", []),
    (llama3(lf=4.0, hf=1.0), {}, "high_freq_factor", ["low_freq_factor"]),
    (llama3(lf=0.0), {}, "low_freq_factor", []),
    (llama3(factor=0.0), {}, "factor", []),
    ({k: v for k, v in llama3().items() if k != "original_max_position_embeddings"}, {},
     "original_max_position_embeddings", []),
    ({**longrope(), "short_factor": [1.0] * 63}, {}, "short_factor", ["64", "63"]),
    ({**longrope(), "long_factor": None}, {}, "long_factor", []),
    ({**longrope(), "long_factor": "1,2"}, {}, "long_factor", []),
    ({**longrope(), "long_factor": [1.0] * 63 + [0.0]}, {}, "long_factor", ["> 0"]),
    ({**longrope(), "factor": -1.0}, {}, "factor", []),
    ({**longrope(), "factor": 4.0, "attention_factor": "1"}, {}, "attention_factor", []),
    ({k: v for k, v in longrope().items() if k != "original_max_position_embeddings"}, {},
     "original_max_position_embeddings", []),
    ({k: v for k, v in longrope().items() if k != "original_max_position_embeddings"},
     {"max_position_embeddings": 8192}, None, []),
    ({**longrope(), "factor": None}, {}, "factor", ["max_position_embeddings"]),
    ({"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}, {}, "rope_theta", ["base"]),
    ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}, {}, "partial_rotary_factor", ["rotary_dim"]),
    ({"rope_type": "proportional", "partial_rotary_factor": 1.5}, {}, "partial_rotary_factor", []),
    ({"rope_type": "proportional"}, {"rotary_dim": 64}, "rotary_dim", []),
]


@pytest.mark.parametrize("scaling, kwargs, name, words", BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_invalid_scaling_raises_value_error_naming_the_parameter(scaling, kwargs, name, words):
    kwargs = dict(kwargs)
    head_dim = kwargs.pop("head_dim", 128)
    if name is None:   # a valid case in the table's neighbourhood: must construct
        RopeSpec(head_dim, scaling=scaling, **kwargs)
        return
    with pytest.raises(ValueError) as info:
        RopeSpec(head_dim, scaling=scaling, **kwargs)
    message = str(info.value)
    assert name in message, message
    for word in words:
        assert word in message, message


def test_linear_factor_below_one_is_mlx_scale():
    """MLX's ``scale`` (and ggml's ``freq_scale``) > 1 is a linear factor 1/scale in (0, 1): accepted with
    a warning, and the rotation at p equals the plain one at p * scale."""
    with pytest.warns(UserWarning, match="< 1 for rope_type 'linear'"):
        spec = RopeSpec(16, scaling={"rope_type": "linear", "factor": 0.5})
    np.testing.assert_array_equal(spec.inv_freq(), RopeSpec(16).inv_freq() * 2.0)
    x = np.random.default_rng(0).standard_normal((6, 16))
    np.testing.assert_allclose(rotary.apply(x, spec=spec), rotary.apply(x, np.arange(6) * 2, spec=RopeSpec(16)),
                               rtol=0, atol=1e-15)


def test_scaling_not_a_dict_is_type_error():
    with pytest.raises(TypeError, match="scaling"):
        RopeSpec(64, scaling=["linear", 2.0])


def test_unknown_keys_warn_and_are_ignored():
    with pytest.warns(UserWarning, match="low_freq_factor"):
        spec = RopeSpec(64, scaling={"rope_type": "linear", "factor": 2.0, "low_freq_factor": 1.0})
    assert spec == RopeSpec(64, scaling={"rope_type": "linear", "factor": 2.0})


def test_rope_types_listed():
    assert set(ROPE_TYPES) >= {"default", "linear", "ntk", "dynamic", "yarn", "llama3", "longrope"}


# -- spec identity ---------------------------------------------------------------------------------
VARIANTS = {
    "linear": ({"rope_type": "linear", "factor": 2.0}, {"factor": 3.0}),
    "ntk": ({"rope_type": "ntk", "factor": 2.0}, {"factor": 2.5}),
    "dynamic": ({"rope_type": "dynamic", "factor": 2.0}, {"factor": 4.0}),
    "yarn": (yarn(), {"factor": 8.0, "original_max_position_embeddings": 2048, "beta_fast": 16.0, "beta_slow": 2.0,
                      "truncate": False, "attention_factor": 1.1, "mscale": 0.5, "mscale_all_dim": 0.7}),
    "llama3": (llama3(), {"factor": 16.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
                          "original_max_position_embeddings": 4096}),
    "longrope": (longrope(), {"short_factor": [1.0] * 64, "long_factor": [3.0] * 64, "factor": 3.0,
                              "original_max_position_embeddings": 2048, "attention_factor": 1.2}),
    "proportional": ({"rope_type": "proportional", "partial_rotary_factor": 0.5}, {"partial_rotary_factor": 0.25,
                                                                                    "factor": 2.0}),
}


@pytest.mark.parametrize("rope_type", list(VARIANTS))
def test_specs_differ_when_any_scaling_parameter_differs(rope_type):
    params, changes = VARIANTS[rope_type]
    kwargs = {"max_position_embeddings": 8192}
    spec = RopeSpec(128, scaling=params, **kwargs)
    assert spec == RopeSpec(128, scaling=copy.deepcopy(params), **kwargs)
    assert hash(spec) == hash(RopeSpec(128, scaling=copy.deepcopy(params), **kwargs))
    for key, value in changes.items():
        other = RopeSpec(128, scaling={**params, key: value}, **kwargs)
        assert other != spec and hash(other) != hash(spec), key
    assert spec != spec.replace(scaling=None) and spec != spec.replace(max_position_embeddings=16384)
    # a spec rebuilt from its own scaling_dict is the same spec (the canonical form is a fixed point)
    assert RopeSpec(128, scaling=spec.scaling_dict, **kwargs) == spec
    assert spec.replace(layout="interleaved").scaling == spec.scaling


def test_spec_equivalent_spellings_are_equal():
    a = RopeSpec(64, scaling={"rope_type": "linear", "factor": 2})
    assert a == RopeSpec(64, scaling={"type": "linear", "factor": 2.0})
    assert a == RopeSpec(64, scaling={"rope_type": "linear", "factor": np.float32(2.0), "rope_theta": 10000})
    assert RopeSpec(64, scaling={"rope_type": "default"}) == RopeSpec(64)
    assert RopeSpec(64, scaling={"type": "default"}).scaling is None


def test_scaling_input_not_mutated():
    params = longrope(d=16, factor=None)
    before = copy.deepcopy(params)
    RopeSpec(16, scaling=params, max_position_embeddings=65536)
    assert params == before


# -- HF config ingestion ---------------------------------------------------------------------------
LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
    "max_position_embeddings": 131072, "model_type": "llama", "rope_theta": 500000.0,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "torch_dtype": "bfloat16", "transformers_version": "4.43.0.dev0",
}
QWEN2_YARN = {
    "architectures": ["Qwen2ForCausalLM"], "hidden_size": 3584, "num_attention_heads": 28, "num_key_value_heads": 4,
    "max_position_embeddings": 32768, "model_type": "qwen2", "rope_theta": 1000000.0,
    "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"},
}
PHI3_MINI_128K = {
    "architectures": ["Phi3ForCausalLM"], "hidden_size": 3072, "num_attention_heads": 32,
    "max_position_embeddings": 131072, "original_max_position_embeddings": 4096, "model_type": "phi3",
    "rope_theta": 10000.0, "sliding_window": 262144,
    "rope_scaling": {"type": "longrope", "short_factor": [1.05] * 48, "long_factor": [1.0 + i for i in range(48)]},
}
GPT_NEOX_20B = {"hidden_size": 6144, "num_attention_heads": 64, "rotary_pct": 0.25, "rotary_emb_base": 10000,
                "max_position_embeddings": 2048, "model_type": "gpt_neox"}
GPT_J_6B = {"n_embd": 4096, "n_head": 16, "rotary_dim": 64, "n_positions": 2048, "model_type": "gptj"}
V5_YARN = {"head_dim": 128, "hidden_size": 2048, "num_attention_heads": 32, "max_position_embeddings": 131072,
           "rope_parameters": {"rope_theta": 1e6, "rope_type": "yarn", "factor": 4.0,
                               "original_max_position_embeddings": 32768, "partial_rotary_factor": 0.5}}


def test_from_hf_llama_3_1_8b():
    spec = RopeSpec.from_hf_config(LLAMA_31_8B)
    assert (spec.head_dim, spec.rotary_dim, spec.base, spec.max_position_embeddings) == (128, 128, 5e5, 131072)
    assert spec == RopeSpec(128, base=5e5, scaling=llama3(), max_position_embeddings=131072)


def test_from_hf_qwen2_yarn():
    spec = RopeSpec.from_hf_config(QWEN2_YARN)
    assert (spec.head_dim, spec.rotary_dim, spec.base) == (128, 128, 1e6)
    assert spec.rope_type == "yarn" and spec.scaling_dict["factor"] == 4.0
    assert spec.attention_scaling == pytest.approx(0.1 * math.log(4) + 1)
    np.testing.assert_allclose(spec.inv_freq(), _yarn_oracle(128, 1e6, 4.0, 32768), rtol=1e-14)


@pytest.mark.parametrize("rope_type", ["longrope", "su"])
def test_from_hf_phi3_longrope(rope_type):
    config = copy.deepcopy(PHI3_MINI_128K)
    config["rope_scaling"]["type"] = rope_type
    config["rope_scaling"]["original_max_position_embeddings"] = 999   # top level wins, as in HF
    spec = RopeSpec.from_hf_config(config)
    assert (spec.head_dim, spec.rotary_dim, spec.rope_type) == (96, 96, "longrope")
    assert spec.scaling_dict["original_max_position_embeddings"] == 4096
    assert spec.scaling_dict["factor"] == 32.0
    assert spec.attention_scaling == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
    w = omega(1e4, 96)
    np.testing.assert_allclose(spec.inv_freq(4096), w / 1.05, rtol=1e-15)
    np.testing.assert_allclose(spec.inv_freq(4097), w / np.arange(1.0, 49.0), rtol=1e-15)


def test_from_hf_gpt_neox_partial_rotary():
    spec = RopeSpec.from_hf_config(GPT_NEOX_20B)
    assert (spec.head_dim, spec.rotary_dim, spec.base, spec.scaling) == (96, 24, 1e4, None)
    newer = {"hidden_size": 512, "num_attention_heads": 4, "partial_rotary_factor": 0.25, "rope_theta": 10000}
    assert RopeSpec.from_hf_config(newer).rotary_dim == 32


def test_from_hf_gpt_j():
    spec = RopeSpec.from_hf_config(GPT_J_6B, layout="interleaved")
    assert (spec.head_dim, spec.rotary_dim, spec.layout, spec.max_position_embeddings) == (256, 64, "interleaved", 2048)


def test_from_hf_v5_rope_parameters():
    spec = RopeSpec.from_hf_config(V5_YARN)
    assert (spec.head_dim, spec.rotary_dim, spec.base) == (128, 64, 1e6)
    assert spec == RopeSpec(128, rotary_dim=64, base=1e6, scaling=yarn(4.0, 32768), max_position_embeddings=131072)
    plain = {"head_dim": 64, "hidden_size": 1024, "num_attention_heads": 16,
             "rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}}
    assert RopeSpec.from_hf_config(plain) == RopeSpec(64, base=5e5)
    assert RopeSpec.from_hf_config({**plain, "rope_parameters": {"rope_theta": 5e5}}) == RopeSpec(64, base=5e5)


def test_from_hf_defaults_and_errors():
    assert RopeSpec.from_hf_config({"hidden_size": 64, "num_attention_heads": 1}) == RopeSpec(64)
    with pytest.raises(ValueError, match="head_dim"):
        RopeSpec.from_hf_config({"rope_theta": 1e4})
    with pytest.raises(ValueError, match="rope_parameters"):
        RopeSpec.from_hf_config({"head_dim": 64, "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}})
    with pytest.raises(ValueError, match="rope_type"):
        RopeSpec.from_hf_config({"head_dim": 64, "rope_scaling": {"type": "magic", "factor": 2}})
    with pytest.raises(ValueError, match="rope_scaling"):
        RopeSpec.from_hf_config({"head_dim": 64, "rope_scaling": 2.0})
    with pytest.raises(TypeError, match="config"):
        RopeSpec.from_hf_config([("head_dim", 64)])


def test_from_hf_config_not_mutated():
    for config in (LLAMA_31_8B, QWEN2_YARN, PHI3_MINI_128K, V5_YARN):
        before = copy.deepcopy(config)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            RopeSpec.from_hf_config(config)
        assert config == before


def test_vllm_ntk_recipe_from_porting_doc():
    """docs/porting.md: vLLM's ntk (base * s, every frequency / s^(2/d)) via frequencies=, exactly; it is not
    rotary's "ntk" (2.2% apart at s = 4, d = 128)."""
    d, s, base = 128, 4.0, 10000.0
    vllm = 1.0 / (base * s) ** (np.arange(0, d, 2, dtype=np.float64) / d) / s ** (2 / d)   # vLLM's _compute_inv_freq
    recipe = RopeSpec(d, frequencies=RopeSpec(d, base=base).inv_freq() / s ** ((2 * np.arange(d // 2) + 2) / d))
    np.testing.assert_allclose(recipe.inv_freq(), vllm, rtol=1e-14)
    ours = RopeSpec(d, base=base, scaling={"rope_type": "ntk", "factor": s}).inv_freq()
    assert abs(np.max(ours / vllm) - 4 ** (1 / 64)) < 1e-12   # the largest gap, at pair 0: 2.2%
