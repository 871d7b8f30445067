"""HF transformers as the peer oracle for multi-axis RoPE: each model's own rotary class and apply
function against ``rotary.apply_qk`` with an explicitly built spec.

Text (M-RoPE): qwen2_vl, qwen2_5_vl, qwen3_vl, qwen3_5, glm4v, ernie4_5_vl_moe, with real (t, h, w)
positions of a mixed text / image / video prompt from ``rotary.mrope_positions``, shifted far into the
context for one batch row. Vision (axial): qwen2_vl, pixtral, sam3 (windowed and global layers),
dinov3. Configs are HF's defaults (with a checkpoint's rope keys where the default lacks them);
no weights.

HF forms angles in float32 (``float(p) * inv_freq_fp32``), so its angle error grows with the
coordinate: rotations are compared at ``|pair| * (max coordinate * max frequency * 6e-7 + 4e-6)``,
cos/sin tables at the same angle bound. A wrong pair -> axis assignment moves coordinates by O(1).
"""

import importlib
import math
import warnings

import numpy as np
import pytest

import rotary

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.peer,
              pytest.mark.skipif(int(transformers.__version__.split(".")[0]) < 5,
                                 reason="needs transformers >= 5 (rope_parameters, mm_token_type_ids)")]

ANGLE_RTOL = 6e-7   # float32 p * inv_freq: inv_freq within ~2 ulp, product within 1/2 ulp


def _module(name):
    return importlib.import_module(f"transformers.models.{name}.modeling_{name}")


def _config(cls_name, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return getattr(transformers, cls_name)(**kwargs)


def _angle_bound(spec, max_coordinate):
    return max_coordinate * float(np.max(spec.inv_freq())) * ANGLE_RTOL + 1e-6


def _tolerance(angle_bound, x):
    pair = float(np.max(np.abs(x))) * math.sqrt(2.0)
    return pair * (angle_bound + 4e-6)


def _hf_layout(values, spec):
    """(…, rotary_dim/2) per-pair values laid out as HF's (…, rotary_dim) cos/sin."""
    if spec.layout == "half":
        return np.concatenate([values, values], axis=-1)
    return np.repeat(values, 2, axis=-1)


# -- text: M-RoPE -------------------------------------------------------------------------------------
#: model: (module, rotary class, apply function, text config class, rope_parameters, spec, get_rope_index model_type)
TEXT = {
    "qwen2_vl": ("qwen2_vl", "Qwen2VLRotaryEmbedding", "apply_rotary_pos_emb", "Qwen2VLTextConfig",
                 {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]},
                 rotary.RopeSpec(128, base=1e6, mrope_section=(16, 24, 24))),
    "qwen2_5_vl": ("qwen2_5_vl", "Qwen2_5_VLRotaryEmbedding", "apply_rotary_pos_emb", "Qwen2_5_VLTextConfig",
                   {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]},
                   rotary.RopeSpec(128, base=1e6, mrope_section=(16, 24, 24))),
    "qwen3_vl": ("qwen3_vl", "Qwen3VLTextRotaryEmbedding", "apply_rotary_pos_emb", "Qwen3VLTextConfig",
                 {"rope_type": "default", "rope_theta": 5e6, "mrope_section": [24, 20, 20], "mrope_interleaved": True},
                 rotary.RopeSpec(128, base=5e6, mrope_section=(24, 20, 20), mrope_interleaved=True)),
    "qwen3_5": ("qwen3_5", "Qwen3_5TextRotaryEmbedding", "apply_rotary_pos_emb", "Qwen3_5TextConfig",
                {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                 "mrope_section": [11, 11, 10], "mrope_interleaved": True},
                rotary.RopeSpec(256, rotary_dim=64, base=1e7, mrope_section=(11, 11, 10), mrope_interleaved=True)),
    "glm4v": ("glm4v", "Glm4vTextRotaryEmbedding", "apply_rotary_pos_emb", "Glm4vTextConfig",
              {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5, "mrope_section": [8, 12, 12]},
              rotary.RopeSpec(128, rotary_dim=64, base=1e4, layout="interleaved", mrope_section=(8, 12, 12))),
    "ernie4_5_vl_moe": ("ernie4_5_vl_moe", "Ernie4_5_VLMoeTextRotaryEmbedding", "apply_rotary_pos_emb",
                        "Ernie4_5_VLMoeTextConfig",
                        {"rope_type": "default", "rope_theta": 5e5, "mrope_section": [22, 22, 20]},
                        rotary.RopeSpec(128, base=5e5, layout="interleaved", mrope_section=(22, 22, 20),
                                        mrope_layout="ernie")),
}

#: model -> model_type whose get_rope_index rule makes its positions (ERNIE's own is not ported: Qwen2-VL's stands in)
POSITION_RULE = {"qwen2_vl": "qwen2_vl", "qwen2_5_vl": "qwen2_5_vl", "qwen3_vl": "qwen3_vl", "qwen3_5": "qwen3_5",
                 "glm4v": "glm4v", "ernie4_5_vl_moe": "qwen2_vl"}


def _mixed_positions(model_type, far=40_000):
    """(2, seq, 3) M-RoPE ids of a text / image / video / text prompt; row 1 shifted by ``far`` (a long context)."""
    frames = rotary.spec.positions.VIDEO_RULES[model_type] == "frames"
    image = [1] * (3 * 4)                                              # grid (1, 6, 8), merge 2
    video = ([0, 0] + [2] * 4) * 2 if frames else [2] * 8              # grid (2, 4, 4): 2 frames of 2x2
    types_ = np.array([[0] * 5 + image + [0] * 3 + video + [0] * 4] * 2)
    kwargs = {"second_per_grid_ts": [0.5, 0.5]} if model_type == "qwen2_5_vl" else {}
    pos, _ = rotary.mrope_positions(mm_token_type_ids=types_, image_grid_thw=[[1, 6, 8]] * 2,
                                    video_grid_thw=[[2, 4, 4]] * 2,
                                    spatial_merge_size=2, tokens_per_second=2, model_type=model_type, **kwargs)
    pos[1] += far
    assert len(np.unique(pos[0, :, 1] - pos[0, :, 2])) > 1 and len(np.unique(pos[0, :, 0] - pos[0, :, 1])) > 1
    return pos


def _hf_text(model):
    module, rope_cls, apply_name, cfg_cls, rope_parameters, spec = TEXT[model]
    mod = _module(module)
    config = _config(cfg_cls, rope_parameters=dict(rope_parameters))
    return mod, getattr(mod, rope_cls)(config), getattr(mod, apply_name), config, spec


@pytest.mark.parametrize("model", sorted(TEXT))
def test_text_mrope_matches_hf(model):
    mod, rope, hf_apply, config, spec = _hf_text(model)
    pos = _mixed_positions(POSITION_RULE[model])
    B, S = pos.shape[:2]
    rng = np.random.default_rng(len(model))
    q = rng.standard_normal((B, 4, S, spec.head_dim)).astype(np.float32)
    k = rng.standard_normal((B, 2, S, spec.head_dim)).astype(np.float32)
    hf_position_ids = torch.from_numpy(np.moveaxis(pos, -1, 0).copy())           # HF's (3, batch, seq)
    with torch.no_grad():
        cos, sin = rope(torch.from_numpy(q), hf_position_ids)
        hf_q, hf_k = hf_apply(torch.from_numpy(q), torch.from_numpy(k), cos, sin)
    bound = _angle_bound(spec, pos.max())
    # the spec's per-pair cos/sin, laid out as HF's table
    ours_cos, ours_sin = spec.cos_sin(pos, dtype=np.float64)
    assert ours_cos.shape == (B, S, spec.rotary_dim // 2)
    np.testing.assert_allclose(_hf_layout(ours_cos, spec), cos.double().numpy(), rtol=0, atol=bound)
    np.testing.assert_allclose(_hf_layout(ours_sin, spec), sin.double().numpy(), rtol=0, atol=bound)
    for backend in ("numpy", "numba"):
        ours_q, ours_k = rotary.apply_qk(q, k, pos, spec=spec, seq_axis=-2, backend=backend)
        for ours, hf, x in ((ours_q, hf_q, q), (ours_k, hf_k, k)):
            np.testing.assert_allclose(ours, hf.numpy(), rtol=0, atol=_tolerance(bound, x), err_msg=f"{model} {backend}")
            np.testing.assert_array_equal(ours[..., spec.rotary_dim:], x[..., spec.rotary_dim:])


@pytest.mark.parametrize("model", sorted(TEXT))
def test_text_mrope_needs_its_own_assignment(model):
    """The check above can fail: the same sections assigned the other ways disagree with HF."""
    mod, rope, hf_apply, config, spec = _hf_text(model)
    pos = _mixed_positions(POSITION_RULE[model])
    with torch.no_grad():
        cos, _ = rope(torch.zeros(1), torch.from_numpy(np.moveaxis(pos, -1, 0).copy()))
    for layout in rotary.spec.rope_spec.MROPE_LAYOUTS:
        if layout != spec.mrope_layout:
            other = spec.replace(mrope_layout=layout, mrope_interleaved=None)
            assert np.max(np.abs(_hf_layout(other.cos_sin(pos, dtype=np.float64)[0], spec) - cos.double().numpy())) > 0.1


@pytest.mark.parametrize("model", sorted(TEXT))
def test_text_spec_from_hf_config(model):
    """RopeSpec.from_hf_config reads the M-RoPE keys into the same spec as built by hand."""
    _, _, _, config, spec = _hf_text(model)
    from_config = rotary.RopeSpec.from_hf_config(config)
    if not from_config.multi_axis:
        pytest.skip("RopeSpec.from_hf_config does not read mrope_section yet")
    assert from_config.pair_axes().tolist() == spec.pair_axes().tolist()
    assert from_config.replace(max_position_embeddings=None) == spec


# -- vision: axial ------------------------------------------------------------------------------------
def _check_vision(q, k, hf_q, hf_k, ours_q, ours_k, bound):
    for ours, hf, x in ((ours_q, hf_q, q), (ours_k, hf_k, k)):
        np.testing.assert_allclose(ours, hf.numpy(), rtol=0, atol=_tolerance(bound, x))


def test_qwen2_vl_vision_matches_hf():
    mod = _module("qwen2_vl")
    config = _config("Qwen2VLVisionConfig")
    head_dim = config.embed_dim // config.num_attention_heads                     # 80
    rope = mod.Qwen2VLVisionRotaryEmbedding(config)
    spec = rotary.RopeSpec.axial(head_dim, axes=2, base=config.rope_parameters["rope_theta"])
    assert rotary.RopeSpec.from_hf_vision_config(config) == spec
    m = config.spatial_merge_size
    # two images and a 2-frame video, patches in the vision tower's merge-block order
    pos = np.concatenate([rotary.grid_positions(6, 8, spatial_merge_size=m),
                          rotary.grid_positions(4, 2, spatial_merge_size=m),
                          np.tile(rotary.grid_positions(4, 4, spatial_merge_size=m), (2, 1))])
    rng = np.random.default_rng(0)
    q = rng.standard_normal((len(pos), config.num_attention_heads, head_dim)).astype(np.float32)   # (seq, heads, dim)
    k = rng.standard_normal(q.shape).astype(np.float32)
    with torch.no_grad():
        cos, sin = rope(torch.from_numpy(q), torch.from_numpy(pos))
        hf_q, hf_k = mod.apply_rotary_pos_emb_vision(torch.from_numpy(q), torch.from_numpy(k), cos, sin)
    np.testing.assert_allclose(_hf_layout(spec.cos_sin(pos, dtype=np.float64)[0], spec), cos.double().numpy(),
                               rtol=0, atol=_angle_bound(spec, pos.max()))
    ours_q, ours_k = rotary.apply_qk(q, k, pos, spec=spec, seq_axis=-3)
    _check_vision(q, k, hf_q, hf_k, ours_q, ours_k, _angle_bound(spec, pos.max()))


def test_pixtral_vision_matches_hf():
    mod = _module("pixtral")
    config = _config("PixtralVisionConfig")
    rope = mod.PixtralVisionRotaryEmbedding(config)
    spec = rotary.RopeSpec.axial(config.head_dim, axes=2, base=config.rope_parameters["rope_theta"],
                                 frequencies="strided")
    assert rotary.RopeSpec.from_hf_vision_config(config) == spec
    pos = np.concatenate([rotary.grid_positions(5, 7), rotary.grid_positions(3, 2)])   # two images, row-major
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, config.num_attention_heads, len(pos), config.head_dim)).astype(np.float32)
    k = rng.standard_normal(q.shape).astype(np.float32)
    with torch.no_grad():
        cos, sin = rope(torch.from_numpy(q), torch.from_numpy(pos))
        hf_q, hf_k = mod.apply_rotary_pos_emb(torch.from_numpy(q), torch.from_numpy(k), cos, sin, unsqueeze_dim=0)
    ours_q, ours_k = rotary.apply_qk(q, k, pos, spec=spec, seq_axis=-2)
    _check_vision(q, k, hf_q, hf_k, ours_q, ours_k, _angle_bound(spec, pos.max()))
    # the strided frequency split is what makes it Pixtral: the per-axis one disagrees
    per_axis = rotary.apply(q, pos, spec=spec.replace(frequencies=rotary.RopeSpec.axial(
        config.head_dim, axes=2, base=config.rope_parameters["rope_theta"]).frequencies), seq_axis=-2)
    assert np.max(np.abs(per_axis - hf_q.numpy())) > 0.1


@pytest.mark.parametrize("window", [True, False])
def test_sam3_vision_matches_hf(window):
    """SAM 3's ViT: interleaved pairs, the first half reading the column (x) and the second the row (y);
    global layers scale the coordinates by window_size / grid width (a fraction: frequency_scale)."""
    mod = _module("sam3")
    config = _config("Sam3ViTConfig")
    head_dim = config.hidden_size // config.num_attention_heads
    window_size = config.window_size if window else 0
    hf_pos = mod.Sam3ViTLayer.precompute_positions(config, window_size)          # (N, 2) float (x, y) * scale
    if window:
        h = w = config.window_size
    else:
        h, w = config.image_size // config.patch_size, config.image_size // config.patch_size
    scale = config.window_size / w
    spec = rotary.RopeSpec.axial(head_dim, axes=2, base=config.rope_parameters["rope_theta"], layout="interleaved",
                                 axis_order=(1, 0), frequency_scale=scale)
    assert rotary.RopeSpec.from_hf_vision_config(config) == spec.replace(     # the table: windowed layers
        frequencies=tuple(np.asarray(spec.frequencies) / scale))
    pos = rotary.grid_positions(h, w)                                            # integer (row, col)
    np.testing.assert_allclose(pos[:, ::-1] * scale, hf_pos.double().numpy(), rtol=1e-6)
    rope = mod.Sam3ViTRotaryEmbedding(config)
    rng = np.random.default_rng(2)
    q = rng.standard_normal((1, 2, len(pos), head_dim)).astype(np.float32)       # (batch, heads, seq, dim)
    k = rng.standard_normal(q.shape).astype(np.float32)
    with torch.no_grad():
        cos, sin = rope(torch.from_numpy(q), hf_pos)
        hf_q, hf_k = mod.apply_rotary_pos_emb_2d(torch.from_numpy(q), torch.from_numpy(k), cos, sin)
    ours_q, ours_k = rotary.apply_qk(q, k, pos, spec=spec, seq_axis=-2)
    _check_vision(q, k, hf_q, hf_k, ours_q, ours_k, _angle_bound(spec, pos.max()))
    # the same with real-valued coordinates (HF's own (x, y) * scale) and a float_positions spec
    fspec = rotary.RopeSpec.axial(head_dim, axes=2, base=config.rope_parameters["rope_theta"], layout="interleaved",
                                  float_positions=True)
    fq, fk = rotary.apply_qk(q, k, hf_pos.double().numpy(), spec=fspec, seq_axis=-2)
    _check_vision(q, k, hf_q, hf_k, fq, fk, _angle_bound(fspec, float(hf_pos.max())))


def test_dinov3_matches_hf():
    """DINOv3: patch centres in [-1, 1], angles 2*pi * coordinate * base**(-4j/d); cls + register tokens
    pass through unrotated."""
    mod = _module("dinov3_vit")
    config = _config("DINOv3ViTConfig")
    head_dim = config.hidden_size // config.num_attention_heads
    rope = mod.DINOv3ViTRopePositionEmbedding(config).eval()   # training mode jitters the coordinates
    h, w = 5, 7
    pixels = torch.zeros(1, 3, h * config.patch_size, w * config.patch_size)
    with torch.no_grad():
        cos, sin = rope(pixels)
    prefix = 1 + config.num_register_tokens
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, config.num_attention_heads, prefix + h * w, head_dim)).astype(np.float32)
    k = rng.standard_normal(q.shape).astype(np.float32)
    with torch.no_grad():
        hf_q, hf_k = mod.apply_rotary_pos_emb(torch.from_numpy(q), torch.from_numpy(k), cos, sin)
    spec = rotary.RopeSpec.axial(head_dim, axes=2, base=config.rope_theta, frequency_scale=2 * math.pi,
                                 float_positions=True)
    assert rotary.RopeSpec.from_hf_vision_config(config) == spec
    pos = rotary.grid_positions(h, w, normalized=True)
    ours_q, ours_k = rotary.apply_qk(q[..., prefix:, :], k[..., prefix:, :], pos, spec=spec, seq_axis=-2)
    bound = _angle_bound(spec, 1.0)
    _check_vision(q[..., prefix:, :], k[..., prefix:, :], hf_q[..., prefix:, :], hf_k[..., prefix:, :],
                  ours_q, ours_k, bound)
    np.testing.assert_array_equal(hf_q[..., :prefix, :].numpy(), q[..., :prefix, :])
    np.testing.assert_allclose(_hf_layout(spec.cos_sin(pos, dtype=np.float64)[0], spec), cos.double().numpy(),
                               rtol=0, atol=bound)
