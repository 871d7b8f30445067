"""config.json dicts in the shapes model repositories ship them, read by ``RopeSpec.from_hf_config``
and compared with what HF's own config class + text rotary module compute from a deep copy of the
same dict (HF's config classes rewrite a nested ``rope_scaling`` in place: each side gets its own copy,
and the dict handed to rotary is checked unchanged afterwards).

For every corpus entry and every RoPE layer type: HF's cos/sin, inv_freq, attention factor, softmax
factor and its own apply function against the spec (tests/hf_zoo.py ``compare`` / ``compare_rotation``);
the per-layer map (``layers_from_hf_config``) against HF's ``layer_types`` and NoPE layers; and the dict
read against the config object HF builds from it. The generated class-defaults table
(rotary/spec/hf_defaults.py) is checked against the installed transformers.

Backends: every spec read here uses existing spec features (base/scaling, partial rotary dims, per-layer
types, mrope_section chunked/interleaved), which tests/test_conformance.py and tests/test_multi_axis.py
run on NumPy, Numba and the CUDA host shim; the reading adds no new rotation form.
"""

import copy
import importlib
import warnings

import numpy as np
import pytest

from rotary import RopeSpec

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.peer, pytest.mark.skipif(int(transformers.__version__.split(".")[0]) < 5,
                                                   reason="needs transformers >= 5 (rope_parameters)")]


def _longrope_factors(n, lo, hi):
    return [float(v) for v in np.round(np.linspace(lo, hi, n), 4)]


QWEN2_VL_TOP = {   # Qwen/Qwen2-VL-7B-Instruct: text fields on top of the composite, "type": "mrope"
    "architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl", "hidden_size": 3584,
    "intermediate_size": 18944, "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
    "max_position_embeddings": 32768, "max_window_layers": 28, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 32768, "tie_word_embeddings": False, "use_sliding_window": False, "vocab_size": 152064,
    "vision_config": {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16, "in_chans": 3,
                      "hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2, "spatial_patch_size": 14,
                      "temporal_patch_size": 2},
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
}

PHI3_MINI_128K = {   # microsoft/Phi-3-mini-128k-instruct (first release: "su")
    "model_type": "phi3", "hidden_size": 3072, "num_attention_heads": 32, "num_key_value_heads": 32,
    "num_hidden_layers": 32, "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
    "rope_theta": 10000.0, "sliding_window": 262144,
    "rope_scaling": {"type": "su", "long_factor": _longrope_factors(48, 1.0, 60.0),
                     "short_factor": _longrope_factors(48, 1.0, 1.2)},
}

GEMMA3_4B = {   # google/gemma-3-4b-it: a sparse text_config (head_dim, heads, thetas from the class)
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "boi_token_index": 255999,
    "eoi_token_index": 256000, "image_token_index": 262144, "mm_tokens_per_image": 256,
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                    "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                      "model_type": "siglip_vision_model",
                      "num_attention_heads": 16, "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False},
}

# (id, config.json, HF text rotary class)
CORPUS = [
    ("llama2-no-theta", {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 32,
                         "num_key_value_heads": 32, "max_position_embeddings": 4096, "rope_scaling": None},
     "LlamaRotaryEmbedding"),
    ("llama-type-linear", {"model_type": "llama", "hidden_size": 5120, "num_attention_heads": 40,
                           "num_hidden_layers": 40,
                           "max_position_embeddings": 16384, "rope_scaling": {"type": "linear", "factor": 8.0}},
     "LlamaRotaryEmbedding"),
    ("llama-type-dynamic", {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32,
                            "num_hidden_layers": 32, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
     "LlamaRotaryEmbedding"),
    ("llama3.1", {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 32,
                  "num_key_value_heads": 8, "max_position_embeddings": 131072, "rope_theta": 500000.0,
                  "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 8192, "rope_type": "llama3"}},
     "LlamaRotaryEmbedding"),
    ("mistral-7b", {"model_type": "mistral", "hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 32,
                    "num_key_value_heads": 8, "max_position_embeddings": 32768, "rope_theta": 10000.0,
                    "sliding_window": 4096}, "MistralRotaryEmbedding"),
    ("mistral-nemo", {"model_type": "mistral", "hidden_size": 5120, "num_attention_heads": 32, "head_dim": 128,
                      "num_hidden_layers": 40, "num_key_value_heads": 8, "max_position_embeddings": 1024000,
                      "rope_theta": 1000000.0, "sliding_window": None}, "MistralRotaryEmbedding"),
    ("mixtral-no-theta", {"model_type": "mixtral", "hidden_size": 4096, "num_attention_heads": 32,
                          "num_hidden_layers": 32, "num_key_value_heads": 8, "max_position_embeddings": 32768},
     "MixtralRotaryEmbedding"),
    ("qwen2-yarn-type", {"model_type": "qwen2", "hidden_size": 3584, "num_attention_heads": 28, "num_hidden_layers": 28,
                         "num_key_value_heads": 4, "max_position_embeddings": 131072, "rope_theta": 1000000.0,
                         "use_sliding_window": False, "sliding_window": 131072, "max_window_layers": 28,
                         "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}},
     "Qwen2RotaryEmbedding"),
    ("qwen3", {"model_type": "qwen3", "head_dim": 128, "hidden_size": 4096, "num_attention_heads": 32,
               "num_hidden_layers": 36, "num_key_value_heads": 8, "max_position_embeddings": 40960,
               "rope_theta": 1000000.0, "rope_scaling": None}, "Qwen3RotaryEmbedding"),
    ("qwen2-vl-top-mrope", QWEN2_VL_TOP, "Qwen2VLRotaryEmbedding"),
    ("qwen2.5-vl-top-mrope", {**QWEN2_VL_TOP, "model_type": "qwen2_5_vl",
                              "architectures": ["Qwen2_5_VLForConditionalGeneration"],
                              "vision_config": {"depth": 32, "hidden_size": 1280, "out_hidden_size": 3584,
                                                "num_heads": 16, "window_size": 112,
                                                "fullatt_block_indexes": [7, 15, 23, 31]}},
     "Qwen2_5_VLRotaryEmbedding"),
    ("qwen2.5-vl-text-config", {"model_type": "qwen2_5_vl", "text_config": {
        "model_type": "qwen2_5_vl_text", "hidden_size": 2048, "num_attention_heads": 16, "num_hidden_layers": 36,
        "num_key_value_heads": 2, "max_position_embeddings": 128000, "rope_theta": 1000000.0,
        "rope_scaling": {"mrope_section": [16, 24, 24], "rope_type": "default", "type": "default"}},
        "vision_config": {"depth": 32, "hidden_size": 1280, "out_hidden_size": 2048}},
     "Qwen2_5_VLRotaryEmbedding"),
    ("qwen3-vl", {"model_type": "qwen3_vl", "text_config": {
        "model_type": "qwen3_vl_text", "head_dim": 128, "hidden_size": 4096, "num_attention_heads": 32,
        "num_hidden_layers": 36, "num_key_value_heads": 8, "max_position_embeddings": 262144, "rope_theta": 5000000.0,
        "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"}}},
     "Qwen3VLTextRotaryEmbedding"),
    ("phi3.5-longrope", {**PHI3_MINI_128K, "rope_scaling": {**PHI3_MINI_128K["rope_scaling"], "type": "longrope"}},
     "Phi3RotaryEmbedding"),
    ("phi4-mini-partial-longrope", {
        "model_type": "phi3", "hidden_size": 3072, "num_attention_heads": 24, "num_key_value_heads": 8,
        "num_hidden_layers": 32, "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
        "partial_rotary_factor": 0.75, "rope_theta": 10000.0,
        "rope_scaling": {"type": "longrope", "long_factor": _longrope_factors(48, 1.0, 40.0),
                         "short_factor": _longrope_factors(48, 1.0, 1.1)}}, "Phi3RotaryEmbedding"),
    ("gemma2", {"model_type": "gemma2", "head_dim": 256, "hidden_size": 3584, "num_attention_heads": 16,
                "num_hidden_layers": 42, "num_key_value_heads": 8, "max_position_embeddings": 8192,
                "rope_theta": 10000.0, "sliding_window": 4096}, "Gemma2RotaryEmbedding"),
    ("gemma3-1b-pattern", {"model_type": "gemma3_text", "head_dim": 256, "hidden_size": 1152, "num_attention_heads": 4,
                           "num_hidden_layers": 26, "num_key_value_heads": 1, "max_position_embeddings": 32768,
                           "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000,
                           "sliding_window": 512, "sliding_window_pattern": 6}, "Gemma3RotaryEmbedding"),
    ("gemma3-4b-sparse", GEMMA3_4B, "Gemma3RotaryEmbedding"),
    ("gemma3-27b", {**GEMMA3_4B, "text_config": {
        "head_dim": 128, "hidden_size": 5376, "model_type": "gemma3_text", "num_attention_heads": 32,
        "num_hidden_layers": 62, "num_key_value_heads": 16, "query_pre_attn_scalar": 168,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024,
        "rope_local_base_freq": 20000.0, "sliding_window_pattern": 4}}, "Gemma3RotaryEmbedding"),
    ("deepseek-v3", {"model_type": "deepseek_v3", "hidden_size": 7168, "num_attention_heads": 128,
                     "num_hidden_layers": 61, "num_key_value_heads": 128, "qk_nope_head_dim": 128,
                     "qk_rope_head_dim": 64,
                     "v_head_dim": 128, "kv_lora_rank": 512, "q_lora_rank": 1536, "max_position_embeddings": 163840,
                     "rope_theta": 10000,
                     "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                      "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                      "type": "yarn"}},
     "DeepseekV3RotaryEmbedding"),
    ("deepseek-v2-lite", {"model_type": "deepseek_v2", "hidden_size": 2048, "num_attention_heads": 16,
                          "num_hidden_layers": 27, "num_key_value_heads": 16, "qk_nope_head_dim": 128,
                          "qk_rope_head_dim": 64, "v_head_dim": 128, "kv_lora_rank": 512, "q_lora_rank": None,
                          "max_position_embeddings": 163840, "rope_theta": 10000,
                          "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707,
                                           "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
                                           "type": "yarn"}}, "DeepseekV2RotaryEmbedding"),
    ("glm-4-9b", {"model_type": "glm", "head_dim": 128, "hidden_size": 4096, "num_attention_heads": 32,
                  "num_hidden_layers": 40, "num_key_value_heads": 2, "max_position_embeddings": 131072,
                  "partial_rotary_factor": 0.5, "rope_theta": 10000.0}, "GlmRotaryEmbedding"),
    ("glm-4.5-air", {"model_type": "glm4_moe", "head_dim": 128, "hidden_size": 4096, "num_attention_heads": 96,
                     "num_hidden_layers": 46, "num_key_value_heads": 8, "max_position_embeddings": 131072,
                     "partial_rotary_factor": 0.5, "rope_theta": 1000000, "rope_scaling": None},
     "Glm4MoeRotaryEmbedding"),
    ("glm-4.1v-mrope", {"model_type": "glm4v", "text_config": {
        "model_type": "glm4v_text", "hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 40,
        "num_key_value_heads": 2, "max_position_embeddings": 65536, "partial_rotary_factor": 0.5, "rope_theta": 10000,
        "rope_scaling": {"type": "default", "mrope_section": [8, 12, 12]}}}, "Glm4vTextRotaryEmbedding"),
    ("llama4-scout-chunked", {"model_type": "llama4", "text_config": {
        "model_type": "llama4_text", "hidden_size": 5120, "num_attention_heads": 40, "head_dim": 128,
        "num_hidden_layers": 48, "num_key_value_heads": 8, "attention_chunk_size": 8192, "rope_theta": 500000.0,
        "max_position_embeddings": 10485760, "interleave_moe_layer_step": 1, "use_qk_norm": True,
        "rope_scaling": {"factor": 16.0, "high_freq_factor": 1.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"}}},
     "Llama4TextRotaryEmbedding"),
    ("smollm3-nope", {"model_type": "smollm3", "hidden_size": 2048, "num_attention_heads": 16,
                      "num_hidden_layers": 36, "num_key_value_heads": 4, "max_position_embeddings": 65536,
                      "rope_theta": 5000000.0, "no_rope_layer_interval": 4}, "SmolLM3RotaryEmbedding"),
    ("gpt-neox-pythia", {"model_type": "gpt_neox", "hidden_size": 512, "num_attention_heads": 8,
                         "num_hidden_layers": 6, "max_position_embeddings": 2048, "rotary_emb_base": 10000,
                         "rotary_pct": 0.25}, "GPTNeoXRotaryEmbedding"),
    ("gpt-neox-class-rotary-pct", {"model_type": "gpt_neox", "hidden_size": 6144, "num_attention_heads": 64,
                                   "num_hidden_layers": 44, "max_position_embeddings": 2048},
     "GPTNeoXRotaryEmbedding"),
    ("olmo3-yarn", {"model_type": "olmo3", "hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 32,
                    "num_key_value_heads": 32, "max_position_embeddings": 65536, "rope_theta": 500000,
                    "sliding_window": 4096,
                    "rope_scaling": {"attention_factor": 1.2079441541679836, "beta_fast": 32, "beta_slow": 1,
                                     "factor": 8.0, "original_max_position_embeddings": 8192, "rope_type": "yarn"}},
     "Olmo3RotaryEmbedding"),
    ("modernbert-base", {"model_type": "modernbert", "hidden_size": 768, "num_attention_heads": 12,
                         "num_hidden_layers": 22, "max_position_embeddings": 8192, "global_rope_theta": 160000.0,
                         "local_rope_theta": 10000.0, "global_attn_every_n_layers": 3, "local_attention": 128},
     "ModernBertRotaryEmbedding"),
    ("minimax-m2-rotary-dim", {"model_type": "minimax_m2", "head_dim": 128, "rotary_dim": 64, "hidden_size": 3072,
                               "num_attention_heads": 48, "num_hidden_layers": 62, "num_key_value_heads": 8,
                               "max_position_embeddings": 196608, "rope_theta": 5000000}, "MiniMaxM2RotaryEmbedding"),
    ("neomme-class-defaults", {"model_type": "neomme", "hidden_size": 1024, "num_attention_heads": 16,
                               "num_hidden_layers": 17, "num_key_value_heads": 4}, "NeoMMERotaryEmbedding"),
    ("cohere2-pattern", {"model_type": "cohere2", "hidden_size": 4096, "num_attention_heads": 32,
                         "num_hidden_layers": 32, "num_key_value_heads": 8, "max_position_embeddings": 8192,
                         "rope_theta": 50000, "sliding_window": 4096, "sliding_window_pattern": 4},
     "Cohere2RotaryEmbedding"),
]


def _hf_config(d):
    """HF's config object built from a deep copy of ``d`` (the way from_pretrained reads a config.json)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoConfig.for_model(**copy.deepcopy(d))


def _hf_case(config, cls_name):
    from tests import hf_zoo

    text = config.get_text_config()
    module = importlib.import_module(type(text).__module__.replace(".configuration_", ".modeling_"))
    cls = getattr(module, cls_name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mod = cls(text)
    case = hf_zoo.Case(type(text).__module__.split(".")[2], cls_name, config=text, module=mod)
    buffers = dict(mod.named_buffers())
    per_type = sorted(k[: -len("_inv_freq")] for k in buffers if k.endswith("_inv_freq") and "original" not in k)
    import inspect
    forward = list(inspect.signature(cls.forward).parameters)
    case.layer_types = per_type if "layer_type" in forward and per_type else [None]
    return case, text


@pytest.mark.parametrize("name, config_json, cls_name", CORPUS, ids=[c[0] for c in CORPUS])
def test_config_json_reads_as_hf(name, config_json, cls_name):
    from tests import hf_zoo

    pristine = copy.deepcopy(config_json)
    mine = copy.deepcopy(config_json)
    per_layer = RopeSpec.per_layer_from_hf_config(mine)
    layers = RopeSpec.layers_from_hf_config(mine)
    assert mine == pristine, "rotary modified the config dict"

    config = _hf_config(config_json)          # HF from its own deep copy, after rotary read its own
    assert config_json == pristine
    case, text = _hf_case(config, cls_name)
    rng = np.random.default_rng(0)
    for layer_type in case.layer_types:
        key = layer_type or next(iter(per_layer))
        spec = per_layer[key] if layer_type is None or layer_type in per_layer else None
        assert spec is not None, f"{name}: HF has RoPE layer type {layer_type!r}, rotary {list(per_layer)}"
        problems = hf_zoo.compare(case, layer_type, spec) or hf_zoo.compare_rotation(case, layer_type, spec, rng)
        assert not problems, f"{name}[{layer_type}]: " + "; ".join(problems)
    if layer_type is None:
        assert len(set(per_layer.values())) == 1, f"{name}: HF has one RoPE, rotary {per_layer}"

    # the per-layer map: HF's layer types, None where HF's attention skips RoPE
    n = text.num_hidden_layers
    assert len(layers) == n
    hf_types = getattr(text, "layer_types", None)
    nope = getattr(text, "no_rope_layers", None)
    for i in range(n):
        if nope is not None and not nope[i]:
            assert layers[i] is None, f"{name}: layer {i} is NoPE in HF, rotary rotates it"
            continue
        expected = per_layer[hf_types[i]] if hf_types and hf_types[i] in per_layer else next(iter(per_layer.values()))
        assert layers[i] == expected, f"{name}: layer {i} ({hf_types[i] if hf_types else ''})"

    # the dict reads as the config object HF builds from it (a flat RoPE: the same spec; the object may name
    # layer types its class derives, e.g. Qwen2's full/sliding from max_window_layers, where the dict has none)
    from_object = RopeSpec.per_layer_from_hf_config(config)
    if list(per_layer) == ["default"]:
        assert set(from_object.values()) == set(per_layer.values())
    else:
        assert from_object == per_layer
    assert RopeSpec.layers_from_hf_config(config) == layers


def test_phi3_su_config_json():
    """Phi-3-mini-128k's first config.json ("type": "su", original_max_position_embeddings on top): HF 5.0-5.24's
    config class renames su to longrope only after copying original_max_position_embeddings (which it does for
    longrope, not su), then its validation raises; 5.25 reads it. rotary reads it as the hub's later "longrope"
    revision, which HF reads (the phi3.5-longrope corpus entry checks that one against HF's module); where HF
    reads the su file itself, its rotary module must agree with rotary's spec."""
    from tests import hf_zoo

    longrope = {**PHI3_MINI_128K, "rope_scaling": {**PHI3_MINI_128K["rope_scaling"], "type": "longrope"}}
    spec = RopeSpec.from_hf_config(copy.deepcopy(PHI3_MINI_128K))
    assert spec == RopeSpec.from_hf_config(longrope) and spec.rope_type == "longrope"
    assert spec.scaling_dict["original_max_position_embeddings"] == 4096
    try:
        config = _hf_config(PHI3_MINI_128K)
    except KeyError as exc:                     # transformers 5.0-5.24
        assert "original_max_position_embeddings" in str(exc)
        return
    case, _ = _hf_case(config, "Phi3RotaryEmbedding")
    for layer_type in case.layer_types:
        problems = hf_zoo.compare(case, layer_type, spec) or hf_zoo.compare_rotation(case, layer_type, spec,
                                                                                     np.random.default_rng(0))
        assert not problems, "; ".join(problems)


def test_hf_rewrites_nested_rope_scaling_in_place():
    """Why every side gets its own copy: HF's config class rewrites the caller's nested dict."""
    d = copy.deepcopy(QWEN2_VL_TOP)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.AutoConfig.for_model(**d)
    assert d["rope_scaling"] != QWEN2_VL_TOP["rope_scaling"]   # HF wrote rope_type/rope_theta into it
    assert RopeSpec.from_hf_config(d) == RopeSpec.from_hf_config(copy.deepcopy(QWEN2_VL_TOP))


def test_class_defaults_table_is_generated_from_transformers():
    from rotary.spec import hf_defaults as _hf_defaults
    from tests import hf_class_defaults

    if _hf_defaults.TRANSFORMERS_VERSION != transformers.__version__:
        pytest.skip(f"rotary/spec/hf_defaults.py was generated with transformers {_hf_defaults.TRANSFORMERS_VERSION}")
    defaults, text_types = hf_class_defaults.generate()
    assert _hf_defaults.DEFAULTS == defaults and _hf_defaults.TEXT_MODEL_TYPES == text_types, \
        "rotary/spec/hf_defaults.py is stale: run python -m tests.hf_class_defaults"
