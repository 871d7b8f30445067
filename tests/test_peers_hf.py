"""HF transformers as a peer oracle: every rope type's inv_freq and attention factor, and end-to-end
rotations against HF's own Llama, GPT-NeoX and GPT-J code.

HF computes frequencies and angles in float32: ``inv_freq`` carries about 1e-7 relative error
(``base ** (fp32 exponent)``), so frequencies are compared at rtol 2e-6; end-to-end rotations are
compared with a tolerance made from HF's actual float32 angle error (measured against float64
angles), and ours are checked against a float64 oracle at float32's own tolerance.
"""

import warnings

import numpy as np
import pytest

import rotary
from rotary import testing as T

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
rope_utils = pytest.importorskip("transformers.modeling_rope_utils")

pytestmark = pytest.mark.peer

INV_FREQ_RTOL = 2e-6

#: rotary follows transformers 5's rope semantics (``rope_parameters``; YaRN mscale / truncate / implicit
#: factor; LongRoPE reading original_max_position_embeddings from the rope dict). 4.x lacks some of these.
requires_v5 = pytest.mark.skipif(int(transformers.__version__.split(".")[0]) < 5,
                                 reason=f"needs transformers >= 5 (rope_parameters), found {transformers.__version__}")


def _llama_config(head_dim, rope_parameters, max_position_embeddings, **extra):
    """A small LlamaConfig (the vehicle HF's rope init functions read) with these rope parameters."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.LlamaConfig(hidden_size=2 * head_dim, num_attention_heads=2, num_key_value_heads=1,
                                        head_dim=head_dim, num_hidden_layers=1, intermediate_size=8, vocab_size=16,
                                        max_position_embeddings=max_position_embeddings,
                                        rope_parameters=dict(rope_parameters), **extra)


def _hf_init(config, seq_len, rope_type=None):
    rope_type = rope_type or config.rope_parameters["rope_type"]
    if rope_type == "default" and "default" not in rope_utils.ROPE_INIT_FUNCTIONS:   # transformers >= 5
        return transformers.models.llama.modeling_llama.LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    if rope_type not in rope_utils.ROPE_INIT_FUNCTIONS:
        pytest.skip(f"this transformers has no rope_type {rope_type!r}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return rope_utils.ROPE_INIT_FUNCTIONS[rope_type](config, None, seq_len=seq_len)


_RNG = np.random.default_rng(7)
PHI3_SHORT = (1.0 + 0.1 * _RNG.random(48)).round(4).tolist()
PHI3_LONG = (1.0 + 40.0 * _RNG.random(48) ** 2).round(4).tolist()

# name: (head_dim, rope_parameters (with rope_theta), max_position_embeddings, seq_lens to try)
CASES = {
    "default": (64, {"rope_type": "default", "rope_theta": 10000.0}, 2048, [None]),
    "linear": (128, {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}, 16384, [None]),
    "linear-partial": (128, {"rope_type": "linear", "factor": 2.5, "rope_theta": 10000.0,
                             "partial_rotary_factor": 0.5}, 4096, [None]),
    "dynamic": (128, {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}, 4096,
                [None, 1, 4096, 4097, 8192, 16384, 100000]),
    "dynamic-partial": (80, {"rope_type": "dynamic", "factor": 3.0, "rope_theta": 1e6,
                             "partial_rotary_factor": 0.4}, 2048, [None, 2049, 9000]),
    "yarn-qwen2": (128, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
                         "rope_theta": 1e6}, 131072, [None]),
    "yarn-gpt-oss": (64, {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                          "truncate": False, "original_max_position_embeddings": 4096, "rope_theta": 150000.0},
                     131072, [None]),
    "yarn-deepseek-mscale": (64, {"rope_type": "yarn", "factor": 40.0, "beta_fast": 32, "beta_slow": 1,
                                  "mscale": 1.0, "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
                                  "rope_theta": 10000.0}, 163840, [None]),
    "yarn-equal-mscales": (64, {"rope_type": "yarn", "factor": 16.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                "original_max_position_embeddings": 16384, "rope_theta": 1e6}, 262144, [None]),
    "yarn-attention-factor": (128, {"rope_type": "yarn", "factor": 8.0, "attention_factor": 0.9,
                                    "beta_fast": 16.0, "beta_slow": 2.0, "original_max_position_embeddings": 2048,
                                    "rope_theta": 10000.0}, 16384, [None]),
    "yarn-implicit-factor": (64, {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 4096,
                                  "rope_theta": 10000.0}, 16384, [None]),
    "yarn-partial": (128, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048,
                           "rope_theta": 10000.0, "partial_rotary_factor": 0.5}, 8192, [None]),
    "llama3.1": (128, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192, "rope_theta": 500000.0}, 131072, [None]),
    "llama4": (128, {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_theta": 500000.0}, 262144, [None]),
    "longrope-phi3": (96, {"rope_type": "longrope", "short_factor": PHI3_SHORT, "long_factor": PHI3_LONG,
                           "original_max_position_embeddings": 4096, "rope_theta": 10000.0}, 131072,
                      [None, 1, 4096, 4097, 131072]),
    "longrope-explicit": (96, {"rope_type": "longrope", "short_factor": PHI3_SHORT, "long_factor": PHI3_LONG,
                               "factor": 8.0, "attention_factor": 1.25, "original_max_position_embeddings": 2048,
                               "rope_theta": 10000.0}, 16384, [None, 2049]),
    "proportional": (256, {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
                     8192, [None]),
    "proportional-factor": (128, {"rope_type": "proportional", "partial_rotary_factor": 0.5, "factor": 2.0,
                                  "rope_theta": 10000.0}, 8192, [None]),
}


@requires_v5
@pytest.mark.parametrize("name", list(CASES))
def test_inv_freq_and_attention_factor_match_hf(name):
    head_dim, params, max_pos, seq_lens = CASES[name]
    config = _llama_config(head_dim, params, max_pos)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        spec = rotary.RopeSpec.from_hf_config(config)
    assert spec.rope_type == params["rope_type"]
    for seq_len in seq_lens:
        hf_inv_freq, hf_attention = _hf_init(config, seq_len)
        hf_inv_freq = hf_inv_freq.double().numpy()
        ours = spec.inv_freq(seq_len)
        assert ours.shape == hf_inv_freq.shape, (name, seq_len)
        np.testing.assert_allclose(ours, hf_inv_freq, rtol=INV_FREQ_RTOL, atol=0, err_msg=f"{name} seq_len={seq_len}")
        np.testing.assert_allclose(spec.attention_scaling_at(seq_len), float(hf_attention), rtol=1e-12,
                                   err_msg=f"{name} seq_len={seq_len}")


@requires_v5
def test_hf_yarn_ramp_truncation_matters():
    """truncate=False must differ from truncate=True (the off-by-one-ramp-step pitfall) and both match HF."""
    head_dim, params, max_pos, _ = CASES["yarn-gpt-oss"]
    truncated = dict(params, truncate=True)
    ours = {t: rotary.RopeSpec.from_hf_config(_llama_config(head_dim, p, max_pos)).inv_freq()
            for t, p in ((False, params), (True, truncated))}
    assert not np.allclose(ours[False], ours[True], rtol=1e-3)
    hf = _hf_init(_llama_config(head_dim, truncated, max_pos), None)[0].double().numpy()
    np.testing.assert_allclose(ours[True], hf, rtol=INV_FREQ_RTOL)


@pytest.mark.parametrize("name", ["default", "linear", "dynamic", "llama3.1", "llama4"])
def test_legacy_rope_scaling_kwargs_match_hf(name):
    """transformers 4.x style (rope_theta + rope_scaling with 'type'), on whichever version is installed."""
    head_dim, params, max_pos, seq_lens = CASES[name]
    params = dict(params)
    theta, rope_type = params.pop("rope_theta"), params.pop("rope_type")
    scaling = None if rope_type == "default" else {"type": rope_type, **params}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = transformers.LlamaConfig(hidden_size=2 * head_dim, num_attention_heads=2, num_hidden_layers=1,
                                          intermediate_size=8, vocab_size=16, max_position_embeddings=max_pos,
                                          rope_theta=theta, rope_scaling=scaling)
        spec = rotary.RopeSpec.from_hf_config(config)
    assert spec == rotary.RopeSpec.from_hf_config({"hidden_size": 2 * head_dim, "num_attention_heads": 2,
                                                   "max_position_embeddings": max_pos, "rope_theta": theta,
                                                   "rope_scaling": scaling})
    for seq_len in seq_lens:
        hf_inv_freq, hf_attention = _hf_init(config, seq_len, rope_type)
        np.testing.assert_allclose(spec.inv_freq(seq_len), hf_inv_freq.double().numpy(), rtol=INV_FREQ_RTOL)
        assert spec.attention_scaling_at(seq_len) == pytest.approx(float(hf_attention), rel=1e-12)


# -- end to end ------------------------------------------------------------------------------------
def _hf_angle_error(inv_freq_hf, positions, inv_freq64):
    """max |theta_hf - theta_64|: HF's fp32 product p * inv_freq against the float64 one."""
    p = torch.as_tensor(positions, dtype=torch.float32)[..., None]
    theta_hf = (p * inv_freq_hf.float()[None]).double().numpy()
    return float(np.max(np.abs(theta_hf - np.asarray(positions, dtype=np.float64)[..., None] * inv_freq64)))


def _tolerance(angle_error, scale, x):
    # a pair rotated by an angle off by e moves by at most |pair| * e; float32 rounding on top.
    pair_norm = float(np.max(np.abs(x))) * np.sqrt(2.0)
    return scale * pair_norm * angle_error + 4e-6 * max(1.0, scale * pair_norm)


E2E = ["default", "linear", "dynamic", "yarn-qwen2", "yarn-gpt-oss", "yarn-deepseek-mscale", "llama3.1", "llama4",
       "longrope-phi3", "longrope-explicit"]


@requires_v5
@pytest.mark.parametrize("name", E2E)
@pytest.mark.parametrize("max_position", [300, 5000])
def test_apply_qk_matches_hf_llama(name, max_position):
    """(B, H, S, D) float32 q/k with per-row position ids, against LlamaRotaryEmbedding + apply_rotary_pos_emb.

    max_position 5000 crosses L0 for dynamic (4096) and longrope-phi3 (4096); HF's seq_len (and ours)
    is max(position_ids) + 1 over the whole batch.
    """
    from transformers.models.llama import modeling_llama as llama

    head_dim, params, max_pos, _ = CASES[name]
    config = _llama_config(head_dim, params, max_pos)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        spec = rotary.RopeSpec.from_hf_config(config)
    rng = np.random.default_rng(0)
    B, Hq, Hk, S = 2, 3, 1, 17   # GQA: one k head for three q heads
    q = rng.standard_normal((B, Hq, S, head_dim)).astype(np.float32)
    k = rng.standard_normal((B, Hk, S, head_dim)).astype(np.float32)
    positions = np.stack([np.sort(rng.choice(max_position, S, replace=False)),
                          np.arange(S) + max_position - S]).astype(np.int64)

    rope = llama.LlamaRotaryEmbedding(config)
    with torch.no_grad():
        cos, sin = rope(torch.from_numpy(q), torch.from_numpy(positions))
        hf_q, hf_k = llama.apply_rotary_pos_emb(torch.from_numpy(q), torch.from_numpy(k), cos, sin)
    ours_q, ours_k = rotary.apply_qk(q, k, positions, spec=spec, seq_axis=-2)
    assert ours_q.dtype == np.float32 and ours_k.dtype == np.float32

    seq_len = int(positions.max()) + 1
    inv64 = spec.inv_freq(seq_len)
    scale = spec.attention_scaling_at(seq_len)
    assert scale == pytest.approx(rope.attention_scaling, rel=1e-12)
    error = _hf_angle_error(rope.inv_freq, positions, inv64)
    for ours, hf, x in ((ours_q, hf_q, q), (ours_k, hf_k, k)):
        np.testing.assert_allclose(ours, hf.numpy(), rtol=0, atol=_tolerance(error, scale, x), err_msg=name)
        ref = T.rope_2x2(x, positions[:, None, :], inv64, layout="half", scale=scale)
        T.assert_close(ours, ref, like=x, atol=2e-6 * max(1.0, scale) * float(np.max(np.abs(x))) * 2)


@requires_v5
def test_apply_qk_matches_hf_gpt_neox_partial_rotary():
    """GPT-NeoX config.json (4.x keys rotary_pct / rotary_emb_base): a quarter of the head rotates."""
    from transformers.models.gpt_neox import modeling_gpt_neox as neox

    config_json = {"model_type": "gpt_neox", "hidden_size": 512, "num_attention_heads": 4, "rotary_pct": 0.25,
                   "rotary_emb_base": 10000, "max_position_embeddings": 2048, "num_hidden_layers": 1,
                   "intermediate_size": 16, "vocab_size": 16}
    spec = rotary.RopeSpec.from_hf_config(config_json)
    assert (spec.head_dim, spec.rotary_dim, spec.base) == (128, 32, 10000.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = transformers.GPTNeoXConfig(**{k: v for k, v in config_json.items() if k != "model_type"})
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 4, 9, 128)).astype(np.float32)
    k = rng.standard_normal((2, 4, 9, 128)).astype(np.float32)
    positions = np.stack([np.arange(9), np.arange(9) + 1000]).astype(np.int64)
    rope = neox.GPTNeoXRotaryEmbedding(config)
    with torch.no_grad():
        cos, sin = rope(torch.from_numpy(q), torch.from_numpy(positions))
        hf_q, hf_k = neox.apply_rotary_pos_emb(torch.from_numpy(q), torch.from_numpy(k), cos, sin)
    ours_q, ours_k = rotary.apply_qk(q, k, positions, spec=spec, seq_axis=-2)
    error = _hf_angle_error(rope.inv_freq, positions, spec.inv_freq())
    for ours, hf, x in ((ours_q, hf_q, q), (ours_k, hf_k, k)):
        np.testing.assert_allclose(ours, hf.numpy(), rtol=0, atol=_tolerance(error, 1.0, x))
        np.testing.assert_array_equal(ours[..., 32:], x[..., 32:])


@pytest.mark.parametrize("rotary_dim", [16, 64])
def test_apply_qk_matches_hf_gptj_interleaved(rotary_dim):
    """GPT-J's rotate_every_two on (B, S, H, D) with partial rotary_dim == layout 'interleaved'."""
    from transformers.models.gptj import modeling_gptj as gptj

    head_dim, S = 64, 11
    rng = np.random.default_rng(2)
    q = rng.standard_normal((2, S, 3, head_dim)).astype(np.float32)
    k = rng.standard_normal((2, S, 3, head_dim)).astype(np.float32)
    positions = np.stack([np.arange(S), np.arange(S) * 37 + 5]).astype(np.int64)

    sincos = gptj.create_sinusoidal_positions(int(positions.max()) + 1, rotary_dim)[torch.from_numpy(positions)]
    sin, cos = torch.split(sincos, rotary_dim // 2, dim=-1)

    def hf(x):
        x = torch.from_numpy(x)
        rot = gptj.apply_rotary_pos_emb(x[..., :rotary_dim], sin, cos)
        return torch.cat([rot, x[..., rotary_dim:]], dim=-1).numpy()

    spec = rotary.RopeSpec(head_dim, rotary_dim=rotary_dim, layout="interleaved")
    ours_q, ours_k = rotary.apply_qk(q, k, positions, spec=spec, seq_axis=1)
    hf_inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64) / rotary_dim))
    error = _hf_angle_error(hf_inv_freq, positions, spec.inv_freq())
    for ours, x in ((ours_q, q), (ours_k, k)):
        np.testing.assert_allclose(ours, hf(x), rtol=0, atol=_tolerance(error, 1.0, x))
        # and the interleaved rotation is not the half-split one (the layouts really differ)
        other = rotary.apply(x, positions, spec=spec.replace(layout="half"), seq_axis=1)
        assert np.max(np.abs(other - hf(x))) > 1e-2


@requires_v5
def test_from_hf_config_accepts_pretrained_config_and_config_json_alike():
    """A PretrainedConfig and its to_dict() / a 4.x-style config.json describe the same spec."""
    params = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
    config = _llama_config(128, params, 131072)
    legacy = {"hidden_size": 4096, "num_attention_heads": 32, "max_position_embeddings": 131072,
              "rope_theta": 500000.0, "rope_scaling": {k: v for k, v in params.items() if k != "rope_theta"}}
    a = rotary.RopeSpec.from_hf_config(config)
    assert a == rotary.RopeSpec.from_hf_config(config.to_dict()) == rotary.RopeSpec.from_hf_config(legacy)
