"""HF's vision rotary classes not covered by tests/test_peers_multi_axis.py, each against rotary through
the public API: the model's own rotary module and the apply function its attention calls, on the
positions the model's own code builds (``transformers.vision_utils.get_vision_position_ids``, the
model's ``precompute_positions`` / inline grids), matched token for token by ``rotary.grid_positions``.

SAM 2 video memory attention (x-first interleaved pairs; cross-attention keys of several memory frames
repeat the query grid, object-pointer keys unrotated), EfficientLoFTR (partial_rotary_factor 4: the whole
hidden rotated before the head split, row/col alternating pair by pair, 1-based grid), MLCD (CLS token
turned by learned angles), PaddleOCR-VL, Step3p7 (w before h), LFM3-VL and MiniMax-M3-VL (3 axes t/h/w,
78 of 80 dims). Configs are HF's defaults; no weights.

Backends: every spec here is an existing spec form (axial frequencies and pair axes, interleaved or
half pairs, a partial rotary dim, caller-supplied frequencies), which tests/test_multi_axis.py and
tests/test_conformance.py run on NumPy, Numba and the CUDA host shim; these tests use the default backend.
"""

import importlib
import math
import warnings

import numpy as np
import pytest

import rotary

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.peer, pytest.mark.skipif(int(transformers.__version__.split(".")[0]) < 5,
                                                   reason="needs transformers >= 5 (rope_parameters)")]


def _module(name):
    return importlib.import_module(f"transformers.models.{name}.modeling_{name}")


def _config(module, cls_name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return getattr(module, cls_name)() if hasattr(module, cls_name) else getattr(transformers, cls_name)()


def _close(ours, hf, x, max_coordinate, spec):
    """fp32: HF's angles float(p) * inv_freq_fp32 carry ~p * max(freq) * 6e-7 rad; 1e-5 of |x| besides."""
    bound = max_coordinate * float(np.max(np.abs(spec.inv_freq()))) * 6e-7 + 1e-5
    np.testing.assert_allclose(ours, hf.double().numpy(), rtol=0, atol=float(np.max(np.abs(x))) * math.sqrt(2) * bound)


def _grid_thw(*shapes):
    return torch.tensor(shapes, dtype=torch.long)


def _hf_vision_positions(grid_thw, merge, include_temporal=False):
    from transformers.vision_utils import get_vision_position_ids

    return get_vision_position_ids(grid_thw, merge, include_temporal=include_temporal)


# -- Qwen-style towers: get_vision_position_ids + apply_rotary_pos_emb_vision ------------------------------
#: family: (package, merge size HF's tower passes to get_vision_position_ids: "config" = spatial_merge_size,
#: whether it asks for the temporal column, the spec spelled out as docs/multi-axis.md shows it)
QWEN_STYLE = {
    "qwen2_vl": ("qwen2_vl", "config", False, lambda c: rotary.RopeSpec.axial(c.embed_dim // c.num_heads, axes=2)),
    "qwen2_5_vl": ("qwen2_5_vl", "config", False,
                   lambda c: rotary.RopeSpec.axial(c.hidden_size // c.num_heads, axes=2)),
    "qwen3_vl": ("qwen3_vl", "config", False, lambda c: rotary.RopeSpec.axial(c.hidden_size // c.num_heads, axes=2)),
    "qwen3_vl_moe": ("qwen3_vl_moe", "config", False,
                     lambda c: rotary.RopeSpec.axial(c.hidden_size // c.num_heads, axes=2)),
    "glm4v": ("glm4v", "config", False, lambda c: rotary.RopeSpec.axial(c.hidden_size // c.num_heads, axes=2)),
    "glm4v_moe": ("glm4v_moe", "config", False, lambda c: rotary.RopeSpec.axial(c.hidden_size // c.num_heads, axes=2)),
    "glm_ocr": ("glm_ocr", "config", False, lambda c: rotary.RopeSpec.axial(c.hidden_size // c.num_heads, axes=2)),
    "paddleocr_vl": ("paddleocr_vl", 1, False, lambda c: rotary.RopeSpec.axial(c.hidden_size // c.num_attention_heads,
                                                                              axes=2)),
    "step3p7": ("step3p7", 1, False, lambda c: rotary.RopeSpec.axial(c.hidden_size // c.num_attention_heads, axes=2,
                                                                     axis_order=(1, 0))),
    "lfm3_vl": ("lfm3_vl", "config", False, lambda c: rotary.RopeSpec.axial(
        c.hidden_size // c.num_attention_heads, axes=2, base=c.rope_parameters["rope_theta"])),
    "minimax_m3_vl": ("minimax_m3_vl", "config", True, lambda c: rotary.RopeSpec.axial(
        c.hidden_size // c.num_attention_heads, axes=3, rotary_dim=78)),
}


def _axial(c, **kw):
    heads = getattr(c, "num_attention_heads", None) or c.num_heads
    return rotary.RopeSpec.axial(c.hidden_size // heads, axes=2, base=c.rope_parameters["rope_theta"], **kw)


def _alternating(c):   # Kimi-K2.5: pair m reads w (m even) or h (m odd), frequency m // 2 of the per-axis set
    half = _axial(c).frequencies[: c.hidden_size // c.num_attention_heads // 4]
    return rotary.RopeSpec(c.hidden_size // c.num_attention_heads, frequencies=tuple(np.repeat(half, 2).tolist()),
                           pair_axes=(1, 0) * len(half), n_axes=2)


#: towers whose model type AutoConfig builds directly (no composite config): (package, vision model type, ...)
QWEN_STYLE.update({
    "cohere_compass": ("cohere_compass", "config", False, _axial),
    "dots3_note": ("dots3_note", "config", False, _axial),
    "ernie4_5_vl_moe": ("ernie4_5_vl_moe", "config", False, _axial),
    "exaone4_5": ("exaone4_5", "config", False, _axial),
    "glm5_next": ("glm5_next", "config", False, _axial),
    "muse_glimmer": ("muse_glimmer", 1, False, _axial),
    "muse_spark": ("muse_spark", 1, False, _axial),
    "qwen2_5_omni": ("qwen2_5_omni", "config", False, _axial),
    "qwen3_omni_moe": ("qwen3_omni_moe", "config", False, _axial),
    "qwen3_5": ("qwen3_5", "config", False, _axial),
    "qwen3_5_moe": ("qwen3_5_moe", "config", False, _axial),
    "qwen4_exp": ("qwen4_exp", "config", False, _axial),
    "video_llama_3": ("video_llama_3", 1, False, _axial),
    "inkling2": ("inkling2", "config", False, lambda c: _axial(c, layout="interleaved", axis_order=(1, 0))),
    "kimi_k25": ("kimi_k25", 1, False, _alternating),
})

#: the vision model type of each package's default config (composites: their vision_config)
VISION_TYPES = {"cohere_compass": "cohere_compass_vision", "dots3_note": "dots3_note_vision_encoder",
                "ernie4_5_vl_moe": "ernie4_5_vl_moe_vision", "exaone4_5": "exaone4_5_vision",
                "glm5_next": "glm5_next_vision", "muse_glimmer": "muse_glimmer_vision",
                "muse_spark": "muse_spark_vision",
                "qwen2_5_omni": "qwen2_5_omni_vision_encoder", "qwen3_omni_moe": "qwen3_omni_moe_vision_encoder",
                "qwen3_5": "qwen3_5_vision", "qwen3_5_moe": "qwen3_5_moe_vision", "qwen4_exp": "qwen4_exp_vision",
                "video_llama_3": "video_llama_3_vision", "inkling2": "inkling2_vision", "kimi_k25": "kimi_k25_vision"}


def _vision_config(family):
    if family in VISION_TYPES:   # the vision config itself (some composites nest it deeper than vision_config)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = transformers.AutoConfig.for_model(VISION_TYPES[family])
        return config, config
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        top = transformers.AutoConfig.for_model(family)
    return top, top.vision_config


@pytest.mark.parametrize("family", sorted(QWEN_STYLE))
def test_qwen_style_vision_tower_matches_hf(family):
    from rotary.spec.hf_vision import VISION_TOWERS

    package, merge, temporal, spelled = QWEN_STYLE[family]
    mod = _module(package)
    top, config = _vision_config(family)
    spec = rotary.RopeSpec.from_hf_vision_config(top)
    assert spec == spelled(config) == rotary.RopeSpec.from_hf_vision_config(top.to_dict())
    merge = getattr(config, "spatial_merge_size", 1) if merge == "config" else merge
    head_dim = spec.head_dim
    grid = _grid_thw((1, 6, 8), (2, 4, 4), (1, 2, 10))      # an image, a 2-frame video, a wide image
    hf_pos = _hf_vision_positions(grid, merge, include_temporal=temporal)
    # rotary's helper gives HF's ids token for token
    ours_pos = np.concatenate([rotary.grid_positions(h, w, t, spatial_merge_size=merge) if temporal
                               else np.tile(rotary.grid_positions(h, w, spatial_merge_size=merge), (t, 1))
                               for t, h, w in grid.tolist()])
    np.testing.assert_array_equal(ours_pos, hf_pos.numpy())
    rope = getattr(mod, VISION_TOWERS[config.model_type][1])(config)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((len(ours_pos), 2, head_dim)).astype(np.float32)        # (seq, heads, dim)
    k = rng.standard_normal(q.shape).astype(np.float32)
    with torch.no_grad():
        cos, sin = rope(torch.from_numpy(q), hf_pos)
        hf_q, hf_k = mod.apply_rotary_pos_emb_vision(torch.from_numpy(q), torch.from_numpy(k), cos, sin)
    assert cos.shape[-1] == spec.rotary_dim
    ours_q, ours_k = rotary.apply_qk(q, k, ours_pos, spec=spec, seq_axis=-3)
    _close(ours_q, hf_q, q, ours_pos.max(), spec)
    _close(ours_k, hf_k, k, ours_pos.max(), spec)
    if spec.n_axes == 2:   # the coordinate assignment is what makes it match: the other one does not
        wrong = rotary.apply(q, ours_pos, spec=spec.replace(pair_axes=tuple(1 - a for a in spec.pair_axes())),
                             seq_axis=-3)
        assert np.max(np.abs(wrong - hf_q.numpy())) > 0.1


def test_mlcd_matches_hf_with_its_learned_cls_angles():
    """MLCD: patches on the row-major grid, axial (h, w) half-split; the CLS token (prepended) turns by the
    learned class_pos_emb angles: a spec of those angles as frequencies at position 1."""
    mod = _module("mlcd")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = transformers.MLCDVisionConfig(num_hidden_layers=1, intermediate_size=64)   # default heads
    head_dim = config.hidden_size // config.num_attention_heads
    model = mod.MLCDVisionModel(config).eval()
    h, w = 3, 5
    hpos = torch.arange(h).unsqueeze(1).expand(-1, w)
    wpos = torch.arange(w).unsqueeze(0).expand(h, -1)
    hf_pos = torch.stack([hpos.flatten(), wpos.flatten()], dim=-1)    # MLCDVisionModel.forward's own grid
    np.testing.assert_array_equal(rotary.grid_positions(h, w), hf_pos.numpy())
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 1 + h * w, 2, head_dim)).astype(np.float32)          # (batch, seq, heads, dim)
    k = rng.standard_normal(q.shape).astype(np.float32)
    with torch.no_grad():
        cos, sin = model.vision_rotary_embedding(torch.zeros(1), hf_pos)
        cls = torch.cat([model.class_pos_emb, model.class_pos_emb], dim=-1)
        cos, sin = torch.cat([cls.cos(), cos], dim=0), torch.cat([cls.sin(), sin], dim=0)
        hf_q, hf_k = mod.apply_rotary_pos_emb_vision(torch.from_numpy(q), torch.from_numpy(k), cos, sin)
    spec = rotary.RopeSpec.axial(head_dim, axes=2, base=config.rope_parameters["rope_theta"])
    assert rotary.RopeSpec.from_hf_vision_config(config) == spec
    ours_q, ours_k = rotary.apply_qk(q[:, 1:], k[:, 1:], rotary.grid_positions(h, w), spec=spec, seq_axis=-3)
    _close(ours_q, hf_q[:, 1:], q[:, 1:], max(h, w), spec)
    _close(ours_k, hf_k[:, 1:], k[:, 1:], max(h, w), spec)
    cls_spec = rotary.RopeSpec.from_inv_freq(model.class_pos_emb.detach().double().numpy()[0], head_dim=head_dim)
    cq = rotary.apply(q[:, :1], np.ones(1, dtype=np.int64), spec=cls_spec, seq_axis=-3)
    _close(cq, hf_q[:, :1], q[:, :1], 1, cls_spec)


def test_efficientloftr_matches_hf():
    """EfficientLoFTR: partial_rotary_factor 4 of head_dim 32 gives 64 frequencies base**(-2j/128); HF rotates
    the whole hidden (256) before splitting heads, pair m = (2m, 2m+1) reading the row if m is even and the
    column if odd, both with frequency j = m // 2; the grid is 1-based (cumsum of ones)."""
    mod = _module("efficientloftr")
    config = _config(transformers, "EfficientLoFTRConfig")
    rope = mod.EfficientLoFTRRotaryEmbedding(config)
    feats = torch.zeros(1, config.hidden_size, 4 * 6 + 3, 4 * 5 + 1)       # a coarse feature map (h, w)
    with torch.no_grad():
        cos, sin = rope(feats)
    eh = (feats.shape[-2] - config.q_aggregation_kernel_size) // config.q_aggregation_stride + 1
    ew = (feats.shape[-1] - config.q_aggregation_kernel_size) // config.q_aggregation_stride + 1
    assert cos.shape == (1, eh, ew, config.hidden_size)
    head_dim = config.hidden_size // config.num_attention_heads
    d = int(head_dim * config.rope_parameters["partial_rotary_factor"])          # 128
    phi = config.rope_parameters["rope_theta"] ** (-np.arange(0, d, 2) / d)       # 64 frequencies
    spec = rotary.RopeSpec(config.hidden_size, base=config.rope_parameters["rope_theta"], layout="interleaved",
                           frequencies=tuple(np.repeat(phi, 2).tolist()),
                           pair_axes=tuple(i % 2 for i in range(config.hidden_size // 2)), n_axes=2)
    table = rotary.RopeSpec.from_hf_vision_config(config)
    np.testing.assert_allclose(table.inv_freq(), spec.inv_freq(), rtol=1e-15, atol=0)
    assert table.replace(frequencies=spec.frequencies) == spec
    pos = rotary.grid_positions(eh, ew) + 1
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, eh * ew, config.hidden_size)).astype(np.float32)   # (batch, seq, hidden)
    y = rng.standard_normal(x.shape).astype(np.float32)
    tx, ty = torch.from_numpy(x)[:, :, None, :], torch.from_numpy(y)[:, :, None, :]   # HF's view (b, s, 1, hidden)
    with torch.no_grad():
        hq, hk = mod.apply_rotary_pos_emb(tx, ty, cos.reshape(1, eh * ew, -1), sin.reshape(1, eh * ew, -1),
                                          unsqueeze_dim=2)
    oq, ok = rotary.apply_qk(x, y, pos, spec=spec, seq_axis=-2)
    _close(oq, hq[:, :, 0], x, pos.max(), spec)
    _close(ok, hk[:, :, 0], y, pos.max(), spec)


@pytest.mark.parametrize("package, prefix", [("sam2_video", "Sam2Video"), ("sam3_tracker_video", "Sam3TrackerVideo")])
@pytest.mark.parametrize("frames, pointers", [(1, 0), (3, 4)])
def test_sam2_video_memory_attention_matches_hf(package, prefix, frames, pointers):
    """SAM 2 video memory attention: positions stored (x, y) = (col, row); cat(freq_x, freq_y) repeat_interleave'd:
    interleaved pairs, the first half reading the column. Cross-attention keys hold ``frames`` memory frames
    (the query grid repeated, HF's repeat_freqs_k) and ``pointers`` object-pointer tokens left unrotated."""
    mod = _module(package)
    config = _config(transformers, f"{prefix}Config")
    hf_pos = getattr(mod, f"{prefix}MemoryAttention").precompute_positions(config)
    fw, fh = config.memory_attention_rope_feat_sizes
    pos = rotary.grid_positions(fh, fw)
    np.testing.assert_array_equal(pos[:, ::-1], hf_pos.numpy())
    head_dim = config.memory_attention_hidden_size // (config.memory_attention_downsample_rate
                                                       * config.memory_attention_num_attention_heads)
    spec = rotary.RopeSpec.axial(head_dim, axes=2, base=config.rope_parameters["rope_theta"], layout="interleaved",
                                 axis_order=(1, 0))
    assert rotary.RopeSpec.from_hf_vision_config(config) == spec
    rope = getattr(mod, f"{prefix}VisionRotaryEmbedding")(config)
    rng = np.random.default_rng(3)
    n = len(pos)
    q = rng.standard_normal((1, 1, n, head_dim)).astype(np.float32)              # (batch, heads, seq, dim)
    k = rng.standard_normal((1, 1, frames * n + pointers, head_dim)).astype(np.float32)
    with torch.no_grad():
        cos, sin = rope(torch.zeros(1), hf_pos)
        hf_q, hf_k = mod.apply_rotary_pos_emb_2d(torch.from_numpy(q), torch.from_numpy(k), cos, sin,
                                                 num_k_exclude_rope=pointers, repeat_freqs_k=frames > 1)
    ours_q = rotary.apply(q, pos, spec=spec, seq_axis=-2)
    ours_k = rotary.apply(k[..., : frames * n, :], np.tile(pos, (frames, 1)), spec=spec, seq_axis=-2)
    _close(ours_q, hf_q, q, pos.max(), spec)
    _close(ours_k, hf_k[..., : frames * n, :], k[..., : frames * n, :], pos.max(), spec)
    np.testing.assert_array_equal(hf_k[..., frames * n:, :].numpy(), k[..., frames * n:, :])


@pytest.mark.parametrize("frames, temporal, pointers", [(1, 0, 0), (2, 3, 4)])
def test_edgetam_video_memory_attention_matches_hf(frames, temporal, pointers):
    """EdgeTAM video: the SAM 2 form, with the keys on their own (smaller) grid: each memory frame holds
    ``temporal`` unrotated tokens, then the spatial tokens of memory_attention_rope_k_sizes; object pointers
    at the end stay unrotated (HF's apply_rotary_pos_emb_2d_cross_attn)."""
    mod = _module("edgetam_video")
    config = _config(transformers, "EdgeTamVideoConfig")
    spec = rotary.RopeSpec.from_hf_vision_config(config)
    assert spec == rotary.RopeSpec.axial(256, axes=2, layout="interleaved", axis_order=(1, 0))
    q_hf = mod.EdgeTamVideoMemoryAttention.precompute_positions(config)
    k_hf = mod.EdgeTamVideoMemoryAttention.precompute_positions(config, is_key=True)
    q_pos = rotary.grid_positions(*reversed(config.memory_attention_rope_feat_sizes))
    k_pos = rotary.grid_positions(*reversed(config.memory_attention_rope_k_sizes))
    np.testing.assert_array_equal(q_pos[:, ::-1], q_hf.numpy())
    np.testing.assert_array_equal(k_pos[:, ::-1], k_hf.numpy())
    rope = mod.EdgeTamVideoVisionRotaryEmbedding(config)
    rng = np.random.default_rng(5)
    group = temporal + len(k_pos)
    q = rng.standard_normal((1, 1, len(q_pos), spec.head_dim)).astype(np.float32)
    k = rng.standard_normal((1, 1, frames * group + pointers, spec.head_dim)).astype(np.float32)
    with torch.no_grad():
        cos, sin = rope(torch.zeros(1), q_hf)
        cos_k, sin_k = rope(torch.zeros(1), k_hf)
        hf_q, hf_k = mod.apply_rotary_pos_emb_2d_cross_attn(torch.from_numpy(q), torch.from_numpy(k), cos, sin, cos_k,
                                                            sin_k, num_k_exclude_rope=pointers, repeat_freqs_k=frames)
    _close(rotary.apply(q, q_pos, spec=spec, seq_axis=-2), hf_q, q, q_pos.max(), spec)
    grouped = k[..., : frames * group, :].reshape(1, 1, frames, group, spec.head_dim)
    spatial = grouped[..., temporal:, :].reshape(1, 1, -1, spec.head_dim)
    ours = rotary.apply(spatial, np.tile(k_pos, (frames, 1)), spec=spec, seq_axis=-2)
    hf_grouped = hf_k[..., : frames * group, :].reshape(1, 1, frames, group, spec.head_dim)
    _close(ours, hf_grouped[..., temporal:, :].reshape(1, 1, -1, spec.head_dim), spatial, k_pos.max(), spec)
    np.testing.assert_array_equal(hf_grouped[..., :temporal, :].numpy(), grouped[..., :temporal, :])
    np.testing.assert_array_equal(hf_k[..., frames * group:, :].numpy(), k[..., frames * group:, :])


def test_sapiens2_matches_hf():
    """Sapiens2: DINOv3's form (patch centres in [-1, 1], 2 pi * coordinate * base**(-4j/d), prefix tokens
    unrotated) on a 1024-wide, 16-head ViT with 8 register tokens."""
    mod = _module("sapiens2")
    config = _config(transformers, "Sapiens2Config")
    head_dim = config.hidden_size // config.num_attention_heads
    spec = rotary.RopeSpec.axial(head_dim, axes=2, base=config.rope_theta, frequency_scale=2 * math.pi,
                                 float_positions=True)
    assert rotary.RopeSpec.from_hf_vision_config(config) == spec
    rope = mod.Sapiens2RopePositionEmbedding(config).eval()
    h, w = 3, 5
    with torch.no_grad():
        cos, sin = rope(torch.zeros(1, 3, h * config.patch_size, w * config.patch_size))
    prefix = 1 + config.num_register_tokens
    rng = np.random.default_rng(6)
    q = rng.standard_normal((1, 2, prefix + h * w, head_dim)).astype(np.float32)
    with torch.no_grad():
        hq, _ = mod.apply_rotary_pos_emb(torch.from_numpy(q), torch.from_numpy(q), cos, sin)
    pos = rotary.grid_positions(h, w, normalized=True)
    ours = rotary.apply(q[..., prefix:, :], pos, spec=spec, seq_axis=-2)
    _close(ours, hq[..., prefix:, :], q[..., prefix:, :], 1.0, spec)
    np.testing.assert_array_equal(hq[..., :prefix, :].numpy(), q[..., :prefix, :])


def test_gemma4_vision_is_two_half_split_blocks():
    """Gemma 4's vision attention rotates each half of the head half-split within itself (x on the first, y on
    the second): no single spec, two applied one after the other (rotary_offset for the second) match HF;
    from_hf_vision_config says so."""
    mod = _module("gemma4")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = transformers.AutoConfig.for_model("gemma4_vision")
    d, base = config.head_dim, config.rope_parameters["rope_theta"]
    with pytest.raises(ValueError, match=r"not one spec: .*rotary_offset=d // 2"):
        rotary.RopeSpec.from_hf_vision_config(config)
    h, w = 4, 6
    pos = rotary.grid_positions(h, w)
    pixel_position_ids = torch.from_numpy(pos[:, ::-1].copy())[None]            # (batch, patches, 2) = (x, y)
    rope = mod.Gemma4VisionRotaryEmbedding(config)
    rng = np.random.default_rng(7)
    q = rng.standard_normal((1, h * w, 2, d)).astype(np.float32)                 # (batch, seq, heads, dim)
    with torch.no_grad():
        cos, sin = rope(torch.zeros(1), pixel_position_ids)
        hq = mod.apply_multidimensional_rope(torch.from_numpy(q), cos, sin, pixel_position_ids)
    f = tuple((base ** (-np.arange(0, d // 2, 2) / (d // 2))).tolist())          # base**(-4j/d), j < d/4
    first = rotary.RopeSpec(d, rotary_dim=d // 2, frequencies=f, pair_axes=(0,) * (d // 4), n_axes=2)
    second = first.replace(rotary_offset=d // 2, pair_axes=(1,) * (d // 4))
    xy = pos[:, ::-1]
    ours = rotary.apply(rotary.apply(q, xy, spec=first, seq_axis=-3), xy, spec=second, seq_axis=-3)
    _close(ours, hq, q, pos.max(), first)
    one = rotary.apply(q, xy, spec=rotary.RopeSpec.axial(d, axes=2, base=base), seq_axis=-3)
    assert np.max(np.abs(one - hq.numpy())) > 0.1                                 # the one-block axial spec differs


def test_llama4_vision_matches_hf():
    """Llama 4's vision encoder: complex (interleaved) pairs, the first half reading x = col + 1 and the
    second y = row + 1 (1-based, row-major patches); the CLS token is appended last with angle 0 (rotary:
    coordinates (0, 0))."""
    mod = _module("llama4")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = transformers.Llama4VisionConfig(image_size=70, patch_size=14)    # a 5 x 5 patch grid
    n = config.image_size // config.patch_size
    head_dim = config.hidden_size // config.num_attention_heads
    spec = rotary.RopeSpec.axial(head_dim, axes=2, base=config.rope_parameters["rope_theta"], layout="interleaved",
                                 axis_order=(1, 0))
    assert rotary.RopeSpec.from_hf_vision_config(config) == spec
    pos = np.concatenate([rotary.grid_positions(n, n) + 1, [[0, 0]]])
    freqs_ci = mod.Llama4VisionRotaryEmbedding(config).freqs_ci
    rng = np.random.default_rng(4)
    q = rng.standard_normal((2, len(pos), 3, head_dim)).astype(np.float32)         # (batch, seq, heads, dim)
    k = rng.standard_normal(q.shape).astype(np.float32)
    with torch.no_grad():
        hf_q, hf_k = mod.vision_apply_rotary_emb(torch.from_numpy(q), torch.from_numpy(k), freqs_ci)
    ours_q, ours_k = rotary.apply_qk(q, k, pos, spec=spec, seq_axis=-3)
    _close(ours_q, hf_q, q, pos.max(), spec)
    _close(ours_k, hf_k, k, pos.max(), spec)
    np.testing.assert_allclose(ours_q[:, -1], q[:, -1], rtol=0, atol=0)


#: every tower of rotary's vision table and the test here or in tests/test_peers_multi_axis.py that checks it
COVERED = {**{_vision_config(f)[1].model_type: "test_qwen_style_vision_tower_matches_hf" for f in QWEN_STYLE},
           "mlcd_vision_model": "test_mlcd_matches_hf_with_its_learned_cls_angles",
           "efficientloftr": "test_efficientloftr_matches_hf",
           "sam2_video": "test_sam2_video_memory_attention_matches_hf",
           "llama4_vision_model": "test_llama4_vision_matches_hf",
           "sam3_tracker_video": "test_sam2_video_memory_attention_matches_hf",
           "edgetam_video": "test_edgetam_video_memory_attention_matches_hf",
           "sapiens2": "test_sapiens2_matches_hf",
           "pixtral": "test_peers_multi_axis.test_pixtral_vision_matches_hf",
           "sam3_vit_model": "test_peers_multi_axis.test_sam3_vision_matches_hf",
           "dinov3_vit": "test_peers_multi_axis.test_dinov3_matches_hf"}


def test_every_vision_tower_of_the_table_is_checked_against_hf():
    from rotary.spec.hf_vision import VISION_TOWERS
    from tests import test_peers_multi_axis

    assert set(VISION_TOWERS) == set(COVERED)
    for name in COVERED.values():
        module, _, fn = name.rpartition(".")
        assert callable(getattr(test_peers_multi_axis, fn, None) if module else globals().get(fn)), name
