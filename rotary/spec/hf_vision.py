"""HF vision-tower configs -> the axial RoPE spec the tower's HF rotary module builds.

One table (:data:`VISION_TOWERS`, keyed by the vision config's ``model_type``) says, per tower, how HF's
module turns the config into frequencies and which coordinate each rotated pair reads; the specs are
checked against HF's own modules and apply functions in tests/test_peers_vision_towers.py and
tests/test_peers_multi_axis.py, and docs/models.md lists the table. Every tower here is an existing
spec form (``RopeSpec.axial`` or frequencies + pair axes), so every backend runs it.

Generic axial tower (Qwen2-VL and most others): ``dim = head_dim or hidden_size // num_attention_heads``,
each axis a set of ``dim / 4`` frequencies ``base**(-arange(0, dim/2, 2) / (dim/2))``, the pairs of the
first half reading the first coordinate of HF's position ids.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from . import hf_config as _hf

#: the positions of towers that call HF's ``get_vision_position_ids(grid_thw, merge)``
QWEN_POSITIONS = "grid_positions(h, w, spatial_merge_size=the tower's merge size) per frame"

#: vision model_type -> (family shown in docs, HF rotary class, what differs from the generic tower,
#: the positions HF builds, spelled with rotary's helpers)
VISION_TOWERS = {
    "qwen2_vl_vision": ("Qwen2-VL", "Qwen2VLVisionRotaryEmbedding", {"dim_key": "embed_dim"},
                        "grid_positions(h, w, spatial_merge_size=2) per frame"),
    "qwen2_5_vl_vision": ("Qwen2.5-VL", "Qwen2_5_VLVisionRotaryEmbedding", {},
                          "grid_positions(h, w, spatial_merge_size=2) per frame, then permuted by HF's window index "
                          "(get_vision_window_index), as the tokens are"),
    "qwen3_vl_vision": ("Qwen3-VL", "Qwen3VLVisionRotaryEmbedding", {},
                        "grid_positions(h, w, spatial_merge_size=2) per frame"),
    "qwen3_vl_moe_vision": ("Qwen3-VL-MoE", "Qwen3VLMoeVisionRotaryEmbedding", {},
                            "grid_positions(h, w, spatial_merge_size=2) per frame"),
    "glm4v_vision": ("GLM-4V", "Glm4vVisionRotaryEmbedding", {},
                     "grid_positions(h, w, spatial_merge_size=2) per frame"),
    "glm4v_moe_vision": ("GLM-4V-MoE", "Glm4vMoeVisionRotaryEmbedding", {},
                         "grid_positions(h, w, spatial_merge_size=2) per frame"),
    "glm_ocr_vision": ("GLM-OCR", "GlmOcrVisionRotaryEmbedding", {},
                       "grid_positions(h, w, spatial_merge_size=2) per frame"),
    "paddleocr_vl_vision": ("PaddleOCR-VL", "PaddleOCRVisionRotaryEmbedding", {},
                            "grid_positions(h, w) per frame"),
    "lfm3_vl_vision": ("LFM3-VL", "Lfm3VlVisionRotaryEmbedding", {},
                       "grid_positions(h, w, spatial_merge_size=2) per frame"),
    "mlcd_vision_model": ("MLCD", "MLCDRotaryEmbedding", {},
                          "grid_positions(h, w); the CLS token turns by the learned class_pos_emb angles "
                          "(RopeSpec.from_inv_freq(class_pos_emb) at position 1)"),
    "step3p5_vision": ("Step3p7", "Step3p7VisionRotaryEmbedding", {"axis_order": (1, 0)},
                       "grid_positions(h, w) per frame; pairs read w before h"),
    "minimax_m3_vl_vision": ("MiniMax-M3-VL", "MiniMaxM3VLVisionRotaryEmbedding", {"axes": 3},
                             "grid_positions(h, w, t, spatial_merge_size=2) (t, h, w)"),
    **{mt: (family, cls_name, {}, QWEN_POSITIONS) for mt, family, cls_name in (
        ("cohere_compass_vision", "Cohere Compass", "CohereCompassVisionRotaryEmbedding"),
        ("dots3_note_vision_encoder", "dots3_note", "Dots3NoteVisionRotaryEmbedding"),
        ("ernie4_5_vl_moe_vision", "ERNIE-4.5-VL", "Ernie4_5_VLMoeVisionRotaryEmbedding"),
        ("exaone4_5_vision", "EXAONE 4.5", "Exaone4_5_VisionRotaryEmbedding"),
        ("glm5_next_vision", "GLM-5-Next", "Glm5NextVisionRotaryEmbedding"),
        ("muse_glimmer_vision", "Muse Glimmer", "MuseGlimmerVisionRotaryEmbedding"),
        ("muse_spark_vision", "Muse Spark", "MuseSparkVisionRotaryEmbedding"),
        ("qwen2_5_omni_vision_encoder", "Qwen2.5-Omni", "Qwen2_5OmniVisionRotaryEmbedding"),
        ("qwen3_omni_moe_vision_encoder", "Qwen3-Omni", "Qwen3OmniMoeVisionRotaryEmbedding"),
        ("qwen3_5_vision", "Qwen3.5", "Qwen3_5VisionRotaryEmbedding"),
        ("qwen3_5_moe_vision", "Qwen3.5-MoE", "Qwen3_5MoeVisionRotaryEmbedding"),
        ("qwen4_exp_vision", "Qwen4-Exp", "Qwen4ExpVisionRotaryEmbedding"),
        ("video_llama_3_vision", "VideoLLaMA3", "VideoLlama3VisionRotaryEmbedding"))},
    "inkling2_vision": ("Inkling2", "Inkling2VisionRotaryEmbedding", {"layout": "interleaved", "axis_order": (1, 0)},
                        QWEN_POSITIONS),
    "kimi_k25_vision": ("Kimi-K2.5", "Kimi_K25VisionRotaryEmbedding", {"alternate": (1, 0)},
                        "grid_positions(h, w) per frame; pairs alternate w, h with frequency j = pair // 2"),
    "pixtral": ("Pixtral", "PixtralVisionRotaryEmbedding", {"frequencies": "strided"},
                "grid_positions(h, w) per image; frequencies strided (rows the even, columns the odd of the 1-D set)"),
    "sam3_vit_model": ("SAM 3 ViT", "Sam3ViTRotaryEmbedding", {"layout": "interleaved", "axis_order": (1, 0)},
                       "grid_positions(window, window) on windowed layers; global layers: grid_positions(h, w) "
                       "with frequency_scale=window_size / w"),
    "sam2_video": ("SAM 2 video memory attention", "Sam2VideoVisionRotaryEmbedding",
                   {"layout": "interleaved", "axis_order": (1, 0), "dims": "sam2_memory"},
                   "grid_positions(*reversed(memory_attention_rope_feat_sizes)), np.tile'd over memory frames; "
                   "object-pointer keys unrotated"),
    "llama4_vision_model": ("Llama 4 vision", "Llama4VisionRotaryEmbedding",
                            {"layout": "interleaved", "axis_order": (1, 0)},
                            "np.concatenate([grid_positions(n, n) + 1, [[0, 0]]]) (n = image_size // patch_size, "
                            "1-based; the CLS token last, at (0, 0): unrotated)"),
    "sam3_tracker_video": ("SAM 3 tracker video memory attention", "Sam3TrackerVideoVisionRotaryEmbedding",
                           {"layout": "interleaved", "axis_order": (1, 0), "dims": "sam2_memory"},
                           "as SAM 2 video's"),
    "edgetam_video": ("EdgeTAM video memory attention", "EdgeTamVideoVisionRotaryEmbedding",
                      {"layout": "interleaved", "axis_order": (1, 0), "dims": "sam2_memory"},
                      "queries: grid_positions(*reversed(memory_attention_rope_feat_sizes)); keys per memory frame: "
                      "temporal tokens unrotated, then grid_positions(*reversed(memory_attention_rope_k_sizes)); "
                      "object-pointer keys unrotated"),
    "dinov3_vit": ("DINOv3", "DINOv3ViTRopePositionEmbedding",
                   {"frequency_scale": 2 * math.pi, "float_positions": True, "base_key": "rope_theta"},
                   "grid_positions(h, w, normalized=True) on the patch tokens; cls and register tokens unrotated"),
    "sapiens2": ("Sapiens2", "Sapiens2RopePositionEmbedding",
                 {"frequency_scale": 2 * math.pi, "float_positions": True, "base_key": "rope_theta"},
                 "grid_positions(h, w, normalized=True) on the patch tokens (DINOv3's form); cls and register "
                 "tokens unrotated"),
    "efficientloftr": ("EfficientLoFTR", "EfficientLoFTRRotaryEmbedding", {"dims": "efficientloftr"},
                       "grid_positions(h', w') + 1 over the aggregated coarse grid; the whole hidden rotated "
                       "before the head split"),
}


#: towers no single spec reproduces, with what does (the specs to apply one after the other)
SPLIT_TOWERS = {
    "gemma4_vision": ("Gemma 4 vision", "Gemma4VisionRotaryEmbedding",
                      "apply_multidimensional_rope splits the head into two halves, each rotated half-split within "
                      "itself (pairs (i, i + d/4) by x, (d/2 + i, 3d/4 + i) by y): two blocks, not one pair layout. "
                      "Apply RopeSpec(d, rotary_dim=d // 2, frequencies=f, pair_axes=(0,) * (d // 4), n_axes=2) and "
                      "then the same with rotary_offset=d // 2 and pair_axes=(1,) * (d // 4), f = base**(-4j/d) "
                      "(j < d/4), at HF's pixel_position_ids (x, y) = grid_positions(h, w)[:, ::-1]"),
}


def _levels(reader, depth=0):
    yield reader
    if depth >= 3 or not reader.is_dict and not hasattr(reader.config, "to_dict"):
        return
    for key in ("vision_config", "backbone_config", "vision_tower_config"):
        sub = reader.sub(key)
        if sub is not None:
            if not isinstance(sub.model_type, str) and isinstance(reader.model_type, str):
                sub.model_type = f"{reader.model_type}_vision"   # an old config.json's vision_config
            yield from _levels(sub, depth + 1)


def vision_reader(config):
    """The reader of a config's vision tower level with RoPE (the config itself, its ``vision_config``,
    SAM 3's ``vision_config.backbone_config``), or None."""
    for reader in _levels(_hf._Reader(config)):
        if reader.model_type in VISION_TOWERS or reader.model_type in SPLIT_TOWERS:
            return _hf.as_hf_class_reads(reader)
    return None


def _base(reader, key):
    params = reader.get("rope_parameters")
    if key is None and isinstance(params, Mapping) and params.get("rope_theta") is not None:
        return _hf._number(params["rope_theta"], f"{reader.name('rope_parameters')}['rope_theta']")
    value = reader.get(key or "rope_theta")
    return 10000.0 if value is None else _hf._number(value, reader.name(key or "rope_theta"))


def vision_spec(config, spec_class):
    """(spec, family, HF class, positions) of the vision tower in ``config``; ValueError when there is none.
    ``spec_class`` is :class:`rotary.spec.rope_spec.RopeSpec` (passed in, so that this module never imports
    rope_spec, whose ``RopeSpec.from_hf_vision_config`` calls this: imports run one way)."""
    reader = vision_reader(config)
    if reader is None:
        raise _hf.ConfigError(f"config has no vision tower with RoPE that rotary knows (model types "
                              f"{', '.join(sorted(VISION_TOWERS))})")
    if reader.model_type in SPLIT_TOWERS:
        family, cls_name, why = SPLIT_TOWERS[reader.model_type]
        raise _hf.ConfigError(f"{reader.where}: {family} ({cls_name}) is not one spec: {why}")
    family, cls_name, rule, positions = VISION_TOWERS[reader.model_type]
    base = _base(reader, rule.get("base_key"))
    dims = rule.get("dims")
    if dims == "sam2_memory":
        hidden = _hf._integer(reader.get("memory_attention_hidden_size"), reader.name("memory_attention_hidden_size"))
        rate = _hf._integer(reader.get("memory_attention_downsample_rate"),
                            reader.name("memory_attention_downsample_rate"))
        heads = _hf._integer(reader.get("memory_attention_num_attention_heads"),
                             reader.name("memory_attention_num_attention_heads"))
        dim = hidden // (rate * heads)
    elif reader.get("head_dim") is not None and rule.get("dim_key") is None:
        dim = _hf._integer(reader.get("head_dim"), reader.name("head_dim"))
    else:
        key = rule.get("dim_key", "hidden_size")
        hidden, heads = reader.get(key), reader.get("num_attention_heads")
        if hidden is None or heads is None:
            raise _hf.ConfigError(f"{reader.where} needs '{key}' and 'num_attention_heads' (or 'head_dim')")
        dim = _hf._integer(hidden, reader.name(key)) // _hf._integer(heads, reader.name("num_attention_heads"))
    if dims == "efficientloftr":
        # HF: frequencies of d = int(head_dim * partial_rotary_factor), laid on the whole hidden, pair m
        # reading the row (m even) or the column (m odd) with frequency m // 2
        params = reader.get("rope_parameters") or {}
        factor = _hf._number(params.get("partial_rotary_factor", 1.0), "partial_rotary_factor")
        hidden = _hf._integer(reader.get("hidden_size"), reader.name("hidden_size"))
        d = int(dim * factor)
        phi = [base ** (-i / d) for i in range(0, d, 2)]
        pairs = hidden // 2
        if pairs != 2 * len(phi):
            raise _hf.ConfigError(f"{reader.where}: EfficientLoFTR's {len(phi)} frequencies do not fill the "
                                  f"{pairs} pairs of hidden_size {hidden} twice (HF's emb would not fit)")
        spec = spec_class(hidden, base=base, layout="interleaved", frequencies=tuple(f for f in phi for _ in (0, 1)),
                          pair_axes=tuple(m % 2 for m in range(pairs)), n_axes=2)
        return spec, family, cls_name, positions
    if rule.get("alternate"):
        # pairs alternate between the axes, each frequency of the per-axis set used by both (Kimi-K2.5)
        group = spec_class.axial(dim, axes=2, base=base).frequencies[: dim // 4]
        order = rule["alternate"]
        spec = spec_class(dim, base=base, layout=rule.get("layout", "half"),
                          frequencies=tuple(f for f in group for _ in (0, 1)),
                          pair_axes=tuple(order[m % 2] for m in range(2 * len(group))), n_axes=2)
        return spec, family, cls_name, positions
    axes = rule.get("axes", 2)
    rotary_dim = axes * 2 * ((dim // axes) // 2) if axes != 2 else None
    spec = spec_class.axial(dim, axes=axes, base=base, layout=rule.get("layout", "half"), rotary_dim=rotary_dim,
                            frequencies=rule.get("frequencies", "per_axis"), axis_order=rule.get("axis_order"),
                            frequency_scale=rule.get("frequency_scale", 1.0),
                            float_positions=rule.get("float_positions", False))
    return spec, family, cls_name, positions
