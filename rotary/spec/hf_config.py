"""HF transformers configs -> RopeSpec keyword arguments (what each model family's HF code computes).

A ``PretrainedConfig`` is read through its attributes (so ``attribute_map`` aliases such as JetMoE's
``head_dim -> kv_channels`` apply), a ``config.json`` dict through its keys plus the aliases HF's
model families use (:data:`ALIASES`, :data:`MODEL_ALIASES`). A multimodal config's text model
(``text_config``, ...) is read when the top level has no RoPE parameters.

What is read, in HF's order of precedence:

- RoPE parameters: ``rope_parameters`` (transformers 5; flat, or one dict per layer type, e.g.
  ``{"full_attention": {...}, "sliding_attention": {...}}``), else ``rope_scaling`` + top-level
  ``rope_theta`` / ``partial_rotary_factor`` (4.x; GPT-NeoX's ``rotary_emb_base`` / ``rotary_pct``).
- head_dim: the layer type's override (Gemma 4's ``per_layer_config``: the global head dim of
  full-attention layers), else ``head_dim`` (or its alias), else ``hidden_size // num_attention_heads``.
- rotary dims: ``int(head_dim * partial_rotary_factor)`` (rounded up to even: HF's
  ``arange(0, d, 2)`` gives ceil(d/2) pairs at ``base**(-2i/d)``, e.g. GLM-4.5's d = 21 -> 11 pairs
  rotating 22 coordinates), else GPT-J/CodeGen's ``rotary_dim``, else the whole head.
- MLA (DeepSeek-V2/V3, Kimi, GLM-4.7-Flash, ...; ``qk_rope_head_dim`` + ``qk_nope_head_dim``): the
  q/k head is ``[nope | rope]`` of qk_nope_head_dim + qk_rope_head_dim coordinates and the rope part
  rotates. ``head="rope"`` (default) gives the spec of the rope part (head_dim = qk_rope_head_dim,
  what HF's rotary module builds; MLA families' config.json read as HF's config class does);
  ``head="qk"`` the whole head (``rotary_offset`` = qk_nope_head_dim); ``head="indexer"`` DeepSeek
  V3.2's DSA lightning indexer: heads of ``index_head_dim`` laid out ``[rope | rest]``, the same
  frequencies, half-split pairs (interleaved for GLM-MoE-DSA) while the main MLA attention is
  interleaved.
- M-RoPE: ``mrope_section`` / ``mrope_interleaved`` from the rope dict, else the family's HF default
  (:data:`MROPE_DEFAULTS`), with the family's assignment of sections to pairs.
- layout: the pairing the family's HF attention uses (:data:`INTERLEAVED_FAMILIES`; DeepSeek-style
  ``rope_interleave``), unless the caller passes ``layout=``.
"""

from __future__ import annotations

import copy
import json
import math
import os
from collections.abc import Mapping

from . import scaling as _scaling
from .validators import as_finite, as_int

#: MLA families whose HF config sets ``head_dim = qk_rope_head_dim``
MLA_ROPE_HEAD_FAMILIES = ("axk1", "axk2", "bailing_hybrid", "deepseek_v2", "deepseek_v3", "deepseek_v32",
                          "glm4_moe_lite", "glm_moe_dsa", "hy_v4", "hy_v4_vl", "kimi_linear", "minicpm3",
                          "mistral_large4", "youtu")

#: config.json aliases (first present wins), from HF's ``attribute_map`` s
ALIASES = {
    "head_dim": ("head_dim", "attention_head_dim", "kv_channels", "d_kv"),
    "hidden_size": ("hidden_size", "n_embd", "d_model", "embed_dim", "emb_dim"),
    "num_attention_heads": ("num_attention_heads", "n_head", "n_heads", "num_heads", "decoder_num_attention_heads",
                            "attention_heads"),
    "max_position_embeddings": ("max_position_embeddings", "n_positions", "max_seq_len", "model_max_length",
                                "context_length"),
    "rope_theta": ("rope_theta", "rotary_emb_base"),
    "partial_rotary_factor": ("partial_rotary_factor", "rotary_pct"),
}

#: per model_type aliases that differ from the generic ones (HF's attribute_map of that family)
MODEL_ALIASES = {
    # MLA families: HF's config sets head_dim = qk_rope_head_dim (the part its rotary module builds);
    # a config.json (DeepSeek-V3's has no head_dim) must not fall back to hidden_size // heads
    **{family: {"head_dim": ("qk_rope_head_dim",)} for family in MLA_ROPE_HEAD_FAMILIES},
    "longcat_flash": {"head_dim": ("head_dim", "qk_rope_head_dim")},
    "zamba2": {"head_dim": ("attention_head_dim",)},
    "zamba": {"head_dim": ("attention_head_dim",)},
}

#: model families whose HF attention pairs coordinates (2i, 2i+1) (rotate_every_two, complex
#: multiplication, repeat_interleave'd cos/sin, an unconditional ``apply_rotary_pos_emb_interleave``, or a
#: ``rope_interleave`` that defaults to True: axk1, deepseek_v3, glm4_moe_lite, mistral4, youtu)
INTERLEAVED_FAMILIES = frozenset({
    "axk1", "axk2", "deepseek_v3", "glm4_moe_lite", "mistral4", "youtu", "bailing_hybrid", "blt", "codegen", "cohere", "cohere2", "deepseek_v2", "deepseek_v32",
    "deepseek_v4", "dots3_note", "ernie4_5", "ernie4_5_moe", "ernie4_5_vl_moe", "glm", "glm4", "glm4v", "glm_moe_dsa",
    "glm_ocr", "gptj", "helium", "llama4", "llama4_text", "longcat_flash",
    "mistral_large4", "moonshine", "moonshine_streaming", "cohere2_moe", "hy_v4_vl", "openai_privacy_filter",
    "pe_audio", "pe_audio_video", "pe_video",
    # transformers 5.25: ergo (new; its rotate_half pairs (2i, 2i+1)); hy_v4 (now apply_rotary_pos_emb_interleave,
    # DeepSeek's interleaved pairs, where 5.24 and earlier applied Llama's rotate_half)
    "ergo", "hy_v4",
})

#: M-RoPE families: (default mrope_section, mrope layout), as each HF text rotary module defaults them
MROPE_DEFAULTS = {
    "qwen2_vl": ((16, 24, 24), "chunked"), "qwen2_5_vl": ((16, 24, 24), "chunked"),
    "qwen2_5_omni": ((16, 24, 24), "chunked"), "paddleocr_vl": ((16, 24, 24), "chunked"),
    "qwen3_vl": ((24, 20, 20), "interleaved"), "qwen3_vl_moe": ((24, 20, 20), "interleaved"),
    "qwen3_omni_moe": ((24, 20, 20), "interleaved"), "cosmos3_edge": ((24, 20, 20), "interleaved"),
    "hy_v4_vl": ((24, 20, 20), "interleaved"), "cohere_compass": ((24, 20, 20), "interleaved"),
    "qwen3_5": ((11, 11, 10), "interleaved"), "qwen3_5_moe": ((11, 11, 10), "interleaved"),
    "qwen4_exp": ((11, 11, 10), "interleaved"),
    "glm4v": ((8, 12, 12), "chunked"), "glm4v_moe": ((8, 12, 12), "chunked"), "glm_ocr": ((8, 12, 12), "chunked"),
    "glm_image": ((8, 12, 12), "chunked"),
    "ernie4_5_vl_moe": ((22, 22, 20), "ernie"),
}

#: HunYuan-VL's XD-RoPE: the sections split the doubled cos/sin row cat(f, f), coordinate chunk j reading
#: axis j, so the two coordinates (i, i + d/2) of a half-split pair read different axes
XD_ROPE_FAMILIES = frozenset({"hunyuan_vl"})

#: two-axis (row, col) text RoPE: pair i reads coordinate i % 2 (NeoMME)
TWO_AXIS_FAMILIES = frozenset({"neomme"})

#: families whose HF attention multiplies the softmax scale by mscale(factor, mscale_all_dim)**2 for
#: any rope_type other than "default" (DeepSeek-V2/V3's ``yarn_apply_mscale``)
SOFTMAX_MSCALE_FAMILIES = frozenset({
    "axk1", "axk2", "bailing_hybrid", "deepseek_v2", "deepseek_v3", "deepseek_v32", "glm4_moe_lite", "glm_moe_dsa",
    "hy_v4", "hy_v4_vl", "longcat_flash", "minicpm3", "mistral4", "mistral_large4", "youtu",
})

#: families whose HF ``rotate_half`` returns (x2, -x1): every pair turns by -theta (nanochat); the spec
#: then carries the negated frequencies
BACKWARDS_FAMILIES = frozenset({"nanochat"})

#: the model families the tables above speak of (everything else follows HF's generic Llama rules)
KNOWN_FAMILIES = (INTERLEAVED_FAMILIES | set(MROPE_DEFAULTS) | TWO_AXIS_FAMILIES | SOFTMAX_MSCALE_FAMILIES
                  | BACKWARDS_FAMILIES | set(MODEL_ALIASES))

#: containers of a multimodal model's text config, tried in order when the top level has no RoPE
TEXT_CONFIG_KEYS = ("text_config", "llm_config", "language_config", "thinker_config", "decoder")


class ConfigError(ValueError):
    """A config value rotary cannot read (names the config key)."""


def load_config(path) -> dict:
    """The dict of an HF ``config.json``: ``path`` (str or os.PathLike) names the file or a checkpoint folder
    holding one. FileNotFoundError naming the path when there is none; ConfigError for a file that is not a
    JSON object (bad JSON, nested past Python's recursion limit, a list, ...)."""
    path = os.fspath(path)
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.exists(file):
        where = f"the folder {path!r} has no config.json" if file != path else f"{path!r} does not exist"
        raise FileNotFoundError(f"HF config not found: {where} (pass a config.json, a checkpoint folder holding one, "
                                "a dict or a PretrainedConfig)")
    try:
        with open(file, "rb") as fh:
            config = json.loads(fh.read().decode("utf-8"))
    except RecursionError:
        raise ConfigError(f"{file!r} nests JSON deeper than Python's recursion limit: not an HF config.json") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{file!r} is not a JSON file (an HF config.json): {exc}"[:500]) from None
    if not isinstance(config, dict):
        raise ConfigError(f"{file!r} holds a JSON {type(config).__name__}, not an object (an HF config.json)")
    return config


class _Reader:
    """Read access to one config level: attributes of a PretrainedConfig, keys (+ aliases) of a dict."""

    def __init__(self, config, where: str = "config", model_type=None):
        if isinstance(config, (str, os.PathLike)):   # a config.json or a checkpoint folder
            config = load_config(config)
        if isinstance(config, Mapping):
            self.is_dict = True
        elif callable(getattr(config, "to_dict", None)):
            self.is_dict = False
        else:
            raise TypeError(f"{where} must be a dict (an HF config.json), a path to a config.json or checkpoint "
                            f"folder, or a PretrainedConfig, got {type(config).__name__}")
        self.config, self.where = config, where
        self.model_type = self.raw("model_type") or model_type
        if self.model_type is not None and not isinstance(self.model_type, str):
            raise ConfigError(f"{where}['model_type'] must be a string (the HF model type), got "
                              f"{type(self.model_type).__name__} {self.model_type!r}")
        types = self.raw("layer_types")
        if types is not None and (not isinstance(types, (list, tuple))
                                  or not all(isinstance(t, (str, int)) and not isinstance(t, bool) for t in types)):
            raise ConfigError(f"{where}{'[' + repr('layer_types') + ']' if self.is_dict else '.layer_types'} must be "
                              f"a list of layer type names, got {type(types).__name__} {types!r}"[:300])

    def raw(self, key):
        if self.is_dict:
            return self.config.get(key)
        try:
            return getattr(self.config, key, None)
        except Exception:  # noqa: BLE001 - HF raises for per-layer attributes read globally
            return None

    def get(self, key):
        """The value under ``key`` or, in a dict, its first present alias."""
        if not self.is_dict:
            return self.raw(key)
        for name in MODEL_ALIASES.get(self.model_type, {}).get(key, ()) + ALIASES.get(key, (key,)):
            if self.config.get(name) is not None:
                return self.config[name]
        return None

    def name(self, key) -> str:
        """Where ``key`` was read, for messages: config['kv_channels'] for an alias."""
        if self.is_dict:
            for name in MODEL_ALIASES.get(self.model_type, {}).get(key, ()) + ALIASES.get(key, (key,)):
                if self.config.get(name) is not None:
                    return f"{self.where}[{name!r}]"
        return f"{self.where}.{key}" if not self.is_dict else f"{self.where}[{key!r}]"

    def sub(self, key):
        value = self.raw(key)
        if value is None or not (isinstance(value, Mapping) or callable(getattr(value, "to_dict", None))):
            return None
        where = f"{self.where}[{key!r}]" if self.is_dict else f"{self.where}.{key}"
        return _Reader(value, where, None)


# -- checked reads ---------------------------------------------------------------------------------
def _number(value, where: str) -> float:
    return as_finite(value, where, error=ConfigError)


def _integer(value, where: str) -> int:
    return as_int(value, where, error=ConfigError, integral_float=True)


#: more layers than any model has: a larger num_hidden_layers is a broken config (and a list that long a hang)
_MAX_LAYERS = 1_000_000
#: the largest head_dim a config may give (no model comes near)
_MAX_HEAD_DIM = 1 << 16


def _layer_count(value, where: str) -> int:
    """num_hidden_layers (or a layer interval) checked: an integer in 0 .. _MAX_LAYERS."""
    n = _integer(value, where)
    if not 0 <= n <= _MAX_LAYERS:
        raise ConfigError(f"{where} must be an integer in [0, {_MAX_LAYERS}], got {n}")
    return n


def _rope_parameter_dicts(params, where: str) -> dict:
    """A per-layer-type rope_parameters as a dict of copied dicts (or None entries), checked."""
    if not isinstance(params, Mapping):
        raise ConfigError(f"{where} must be a dict, got {type(params).__name__}")
    out = {}
    for k, v in params.items():
        if v is not None and not isinstance(v, Mapping):
            raise ConfigError(f"{where}[{k!r}] must be a dict or null, got {type(v).__name__} {v!r}")
        out[k] = None if v is None else dict(v)
    return out


def _has_rope(reader: _Reader) -> bool:
    return any(reader.get(k) is not None for k in ("rope_parameters", "rope_scaling", "rope_theta"))


def text_reader(config) -> _Reader:
    """The reader of the config level that holds the RoPE parameters (a multimodal config's text model),
    a config.json level rewritten as the family's HF config class reads it (:func:`as_hf_class_reads`)."""
    return as_hf_class_reads(_text_level(config))


def _text_level(config) -> _Reader:
    reader = _Reader(config)
    if _has_rope(reader):
        return reader
    first = None
    for key in TEXT_CONFIG_KEYS:
        sub = reader.sub(key)
        if sub is not None:
            sub.model_type = sub.model_type or reader.model_type
            if _has_rope(sub):
                return sub
            for key2 in TEXT_CONFIG_KEYS:   # e.g. Qwen2.5-Omni: thinker_config.text_config
                sub2 = sub.sub(key2)
                if sub2 is not None and _has_rope(sub2):
                    sub2.model_type = sub2.model_type or sub.model_type
                    return sub2
            first = first or sub
    # no level names RoPE parameters: the text model's (a sparse Gemma 3 text_config relies on the class's
    # defaults), else the top
    if first is not None and reader.is_dict and reader.get("head_dim") is None and reader.get("hidden_size") is None:
        return first
    return reader


#: model_type suffixes of a family's sub-models that share its RoPE code (stripped to find the family)
SUB_MODEL_SUFFIXES = ("_text", "_thinker", "_talker", "_patcher", "_local_encoder", "_local_decoder", "_encoder",
                      "_global_transformer")


def _family(reader: _Reader) -> str | None:
    """The model family whose HF code the tables describe: ``model_type`` with sub-model suffixes
    stripped ("qwen2_5_vl_text" -> "qwen2_5_vl", "blt_patcher" -> "blt")."""
    mt = reader.model_type
    if not isinstance(mt, str):
        return None
    stripped = True
    while stripped and mt not in KNOWN_FAMILIES:
        stripped = False
        for suffix in SUB_MODEL_SUFFIXES:
            if mt.endswith(suffix):
                mt, stripped = mt[: -len(suffix)], True
    return mt


# -- config.json levels read as HF's config classes read them ------------------------------------------
# HF's config classes rewrite the RoPE fields of a config.json before any model code sees them (each
# family's ``convert_rope_params_to_dict`` / ``__post_init__``). A dict level is read through a rewritten
# copy (the caller's dict is never modified); a PretrainedConfig has been rewritten by HF already.

def _scaling_or_params(c: dict):
    """The key HF reads the flat RoPE dict from (``rope_scaling`` wins, as in HF) and its value, or (None, None)."""
    for key in ("rope_scaling", "rope_parameters"):
        if isinstance(c.get(key), Mapping) and c[key]:
            return key, dict(c[key])
    return None, None


def _mrope_is_default(c: dict) -> dict:
    """Qwen2-VL / Qwen2.5-VL: ``{"type": "mrope", "mrope_section": [...]}`` is default frequencies + the section."""
    key, params = _scaling_or_params(c)
    if params is not None and params.get("rope_type", params.get("type")) == "mrope":
        params.pop("type", None)
        c[key] = {**params, "rope_type": "default"}
    return c


def _longrope_aliases(c: dict) -> dict:
    """Phi-3 / Phi-4-multimodal: the first checkpoints' "su" and "yarn" are LongRoPE."""
    key, params = _scaling_or_params(c)
    if params is not None and params.get("rope_type", params.get("type")) in ("su", "yarn"):
        params.pop("type", None)
        c[key] = {**params, "rope_type": "longrope"}
    return c


def _pattern_types(c: dict, every, full_when, default_layers):
    """``layer_types`` as the family's config class derives it when the config.json has none."""
    if c.get("layer_types") is None:
        n = c.get("num_hidden_layers", default_layers)
        n = _layer_count(n, "config['num_hidden_layers']")
        c["layer_types"] = ["full_attention" if full_when(i, every) else "sliding_attention" for i in range(n)]
    return c


def _local_global(c: dict, *, global_theta_key: str, local_theta_key, default_theta: dict,
                  scaling_on_sliding: bool) -> dict:
    """Gemma 3 / Gemma 3n / ModernBERT / OLMo 3: a config.json without ``rope_parameters`` gives
    {"full_attention": {rope_scaling, theta = rope_theta}, "sliding_attention": {theta = the local key}}
    (HF's ``convert_rope_params_to_dict`` of these families; rope_scaling on full layers only, ModernBERT's
    on both)."""
    params = c.get("rope_parameters")
    nested = isinstance(params, Mapping) and any(isinstance(v, Mapping) for v in params.values())
    if params is not None and not nested:
        return c   # a flat rope_parameters: read as given
    params = _rope_parameter_dicts(params or {"sliding_attention": {"rope_type": "default"},
                                              "full_attention": {"rope_type": "default"}}, "config['rope_parameters']")
    scaling = c.get("rope_scaling")
    if isinstance(scaling, Mapping):
        params["full_attention"] = {**(params.get("full_attention") or {"rope_type": "default"}), **scaling}
        if scaling_on_sliding:
            params["sliding_attention"] = {**(params.get("sliding_attention") or {"rope_type": "default"}),
                                           **scaling}
    full = params.get("full_attention") or {"rope_type": "default"}
    full.setdefault("rope_theta", c.get(global_theta_key, default_theta["global"]))
    sliding = params.get("sliding_attention") or {"rope_type": "default"}
    local = None if local_theta_key is None else c.get(local_theta_key)
    sliding.setdefault("rope_theta", default_theta["local"] if local is None else local)
    params["full_attention"], params["sliding_attention"] = full, sliding
    c = {k: v for k, v in c.items() if k not in ("rope_scaling", global_theta_key, local_theta_key)}
    c["rope_parameters"] = params
    return c


def _gemma3(c: dict) -> dict:
    c = _pattern_types(c, c.get("sliding_window_pattern", 6), lambda i, k: not (i + 1) % k, 26)
    return _local_global(c, global_theta_key="rope_theta", local_theta_key="rope_local_base_freq",
                         default_theta={"global": 1e6, "local": 1e4}, scaling_on_sliding=False)


def _gemma3n(c: dict) -> dict:
    c = _pattern_types(c, 5, lambda i, k: not (i + 1) % k, 35)
    return _local_global(c, global_theta_key="rope_theta", local_theta_key="rope_local_base_freq",
                         default_theta={"global": 1e6, "local": 1e4}, scaling_on_sliding=False)


def _modernbert(c: dict) -> dict:
    c = _pattern_types(c, c.get("global_attn_every_n_layers", 3), lambda i, k: not i % k, 22)
    return _local_global(c, global_theta_key="global_rope_theta", local_theta_key="local_rope_theta",
                         default_theta={"global": 160_000.0, "local": 10_000.0}, scaling_on_sliding=True)


def _olmo3(c: dict) -> dict:
    # HF pops rope_theta for the full layers; the sliding layers then get the class default 5e5 (HF's code)
    c = _pattern_types(c, 4, lambda i, k: not (i + 1) % k, 32)
    return _local_global(c, global_theta_key="rope_theta", local_theta_key=None,
                         default_theta={"global": 500_000.0, "local": 500_000.0}, scaling_on_sliding=False)


def _every_second(c: dict) -> dict:   # Gemma 2
    return _pattern_types(c, 2, lambda i, k: not (i + 1) % k, 26)


def _cohere2(c: dict) -> dict:
    return _pattern_types(c, c.get("sliding_window_pattern", 4), lambda i, k: not (i + 1) % k, 40)


def _gpt_neox(c: dict) -> dict:
    """GPT-NeoX's class defaults: rotary_pct 0.25, rotary_emb_base 10000."""
    if c.get("partial_rotary_factor") is None and c.get("rotary_pct") is None:
        c["rotary_pct"] = 0.25
    return c


def _minimax_m2(c: dict) -> dict:
    """MiniMax-M2's checkpoints give partial RoPE as ``rotary_dim``: partial_rotary_factor = rotary_dim / head_dim."""
    if c.get("rotary_dim") is not None and c.get("partial_rotary_factor") is None and c.get("head_dim"):
        c["partial_rotary_factor"] = _integer(c["rotary_dim"], "config['rotary_dim']") / _integer(
            c["head_dim"], "config['head_dim']")
    return c


def _hunyuan_vl(c: dict) -> dict:
    """HunYuan-VL: ``xdrope_section`` is ``mrope_section``, rope type "xdrope" is "dynamic"."""
    key, params = _scaling_or_params(c)
    if params is None:
        return c
    if "xdrope_section" in params:
        legacy = params.pop("xdrope_section")
        if params.get("mrope_section") is not None and [float(v) for v in params["mrope_section"]] != \
                [float(v) for v in legacy]:
            raise ConfigError(f"config[{key!r}] has both mrope_section {params['mrope_section']} and xdrope_section "
                              f"{legacy}, and they differ")
        params.setdefault("mrope_section", legacy)
    if params.get("rope_type", params.get("type")) == "xdrope":
        params.pop("type", None)
        params["rope_type"] = "dynamic"
    c[key] = params
    return c


def _drop_dangling_flat_keys(c: dict) -> dict:
    """Cohere Compass / ZAYA hub configs: rope_parameters per layer type plus dangling flat rope_theta /
    rope_type keys, which HF's config class drops."""
    params = c.get("rope_parameters")
    types = c.get("layer_types") or ()
    if isinstance(params, Mapping) and set(params) & set(types):
        c["rope_parameters"] = {k: v for k, v in params.items() if k not in ("rope_theta", "rope_type")}
    return c


def _nope_every(c: dict, interval=None) -> dict:
    """Llama 4 / SmolLM3 / Mistral-Large-4: ``no_rope_layers`` (1 = the layer uses RoPE, 0 = NoPE), by
    default a NoPE layer every ``no_rope_layer_interval`` (4) layers, as HF's class derives it."""
    if not c.get("no_rope_layers"):
        n = _layer_count(c.get("num_hidden_layers"), "config['num_hidden_layers']")
        k = _layer_count(c.get("no_rope_layer_interval", 4) if interval is None else interval,
                         "config['no_rope_layer_interval']")
        if k == 0:
            raise ConfigError("config['no_rope_layer_interval'] must be >= 1, got 0")
        c["no_rope_layers"] = [int((i + 1) % k != 0) for i in range(n)]
    return c


def _llama4(c: dict) -> dict:
    c = _nope_every(c, c.get("no_rope_layer_interval", 4))
    if c.get("layer_types") is None:
        chunked = c.get("attention_chunk_size") is not None
        c["layer_types"] = ["chunked_attention" if rope and chunked else "full_attention"
                            for rope in c["no_rope_layers"]]
    return c


def _smollm3(c: dict) -> dict:
    c = _nope_every(c)
    if c.get("layer_types") is None:
        sliding = c.get("use_sliding_window") and c.get("sliding_window") is not None
        c["layer_types"] = ["sliding_attention" if sliding and not rope else "full_attention"
                            for rope in c["no_rope_layers"]]
    return c


def _neomme(c: dict) -> dict:
    """NeoMME: layer types full every 6th layer and the last; per layer type rope_theta (top-level
    rope_theta, else 1e6 full / 1e4 sliding) and partial_rotary_factor (0.25 full / 1.0 sliding)."""
    if c.get("layer_types") is None:
        n = _layer_count(c.get("num_hidden_layers", 17), "config['num_hidden_layers']")
        c["layer_types"] = ["full_attention" if (i + 1) % 6 == 0 or i == n - 1 else "sliding_attention"
                            for i in range(n)]
    params = c.get("rope_parameters")
    params = _rope_parameter_dicts(params or {}, "config['rope_parameters']")
    theta = c.pop("rope_theta", None)
    for lt in dict.fromkeys(c["layer_types"]):
        layer = params.setdefault(lt, {})
        layer.setdefault("rope_type", "default")
        layer.setdefault("rope_theta", theta if theta is not None else
                         {"full_attention": 1e6, "sliding_attention": 1e4}.get(lt))
        factor = {"full_attention": 0.25, "sliding_attention": 1.0}.get(lt)
        if factor is not None:
            layer.setdefault("partial_rotary_factor", factor)
    c["rope_parameters"] = params
    return c


#: family -> how its HF config class rewrites a config.json level (see each function)
CLASS_READS = {
    "qwen2_vl": _mrope_is_default, "qwen2_5_vl": _mrope_is_default,
    "phi3": _longrope_aliases, "phi4_multimodal": _longrope_aliases,
    "gemma3": _gemma3, "gemma3n": _gemma3n, "modernbert": _modernbert, "olmo3": _olmo3,
    "gemma2": _every_second, "cohere2": _cohere2,
    "gpt_neox": _gpt_neox, "minimax_m2": _minimax_m2, "hunyuan_vl": _hunyuan_vl,
    "cohere_compass": _drop_dangling_flat_keys, "zaya": _drop_dangling_flat_keys,
    "neomme": _neomme, "llama4": _llama4, "llama4_text": _llama4, "smollm3": _smollm3, "mistral_large4": _nope_every,
}

#: families whose attention skips RoPE on the layers where ``no_rope_layers[i] == 0`` (NoPE layers)
NOPE_LAYER_FAMILIES = frozenset({"llama4", "llama4_text", "smollm3", "mistral_large4"})


def _class_defaults(reader: _Reader) -> dict:
    """What HF's config class of this level's model type fills in for the fields the dict leaves out (the
    generated :mod:`rotary.spec.hf_defaults` table; a composite model type stands for its text model), skipping
    a field when the dict has any of its aliases."""
    from . import hf_defaults as _hf_defaults

    mt = reader.model_type
    if not isinstance(mt, str):
        return {}
    defaults = _hf_defaults.DEFAULTS.get(_hf_defaults.TEXT_MODEL_TYPES.get(mt, mt)) or {}
    out = {}
    for name, value in defaults.items():
        names = {name}
        for group in (ALIASES, MODEL_ALIASES.get(mt, {}), MODEL_ALIASES.get(_family(reader), {})):
            for key, aliases in group.items():
                if name == key or name in aliases:
                    names |= {key, *aliases}
        if not any(n in reader.config for n in names):
            out[name] = value
    return out


def as_hf_class_reads(reader: _Reader) -> _Reader:
    """``reader`` over a copy of its config.json level as the family's HF config class reads it: the class's
    defaults for left-out fields (:func:`_class_defaults`), then the family's rewrites (:data:`CLASS_READS`).
    A PretrainedConfig (HF has done both) as is; the caller's dict is never modified."""
    if not reader.is_dict:
        return reader
    defaults = _class_defaults(reader)
    rewrite = CLASS_READS.get(_family(reader))
    if rewrite is None and not defaults:
        return reader
    try:
        config = {**copy.deepcopy(dict(reader.config)), **defaults}
    except RecursionError:
        raise ConfigError(f"{reader.where} nests values deeper than Python's recursion limit: not an HF "
                          "config") from None
    if rewrite is not None:
        config = rewrite(config)
    return _Reader(config, reader.where, reader.model_type)


def _rope_labels(reader: _Reader) -> tuple:
    labels = reader.raw("_rope_type_labels") or reader.get("layer_types") or ()
    if isinstance(labels, (str, bytes, Mapping)) or not hasattr(labels, "__iter__"):
        raise ConfigError(f"{reader.name('layer_types')} must be a list of layer type names, got "
                          f"{type(labels).__name__} {labels!r}")
    return tuple(labels)


#: families whose HF config class derives per-layer-type RoPE and head-dim defaults that their config.json
#: leaves implicit (DeepSeek-V4: head_dim 512, rotary fraction 64/512, "main" and "compress" layers with
#: compress_rope_theta and YaRN; dots3_note: head_dim 256, sliding-window layers with their own theta and
#: heads): a dict without per-layer-type rope_parameters would read as one flat spec, wrong for some layers
CLASS_DERIVED_ROPE_FAMILIES = frozenset({"deepseek_v4", "dots3_note"})


def rope_dicts(reader: _Reader) -> tuple[dict | None, dict | None]:
    """(flat rope parameters, per-layer-type dicts) of a config; exactly one is not None (or both None)."""
    params = reader.get("rope_parameters")
    if (reader.is_dict and _family(reader) in CLASS_DERIVED_ROPE_FAMILIES
            and not (isinstance(params, Mapping) and params and all(isinstance(v, Mapping) or v is None
                                                                   for v in params.values()))):
        raise ConfigError(f"{reader.where}: a {reader.model_type} config.json leaves the RoPE of its layer types "
                          "(and its head_dim default) to HF's config class; pass the config object "
                          "(transformers.AutoConfig.from_pretrained(...)) or a dict with rope_parameters per "
                          "layer type and head_dim")
    if params is not None and not isinstance(params, Mapping):
        raise ConfigError(f"{reader.name('rope_parameters')} must be a dict, got {type(params).__name__}")
    if params:
        labels = _rope_labels(reader)
        nested = [k for k in params if k in labels] if labels else []
        dicts = [k for k, v in params.items() if isinstance(v, Mapping)]
        if dicts and all(isinstance(v, Mapping) or v is None for v in params.values()):
            nested = list(params)   # every value a dict: per layer type (HF also keeps unused types)
        elif dicts:
            nested = list(dict.fromkeys(nested + dicts))
        if nested:
            extra = [k for k in params if k not in nested]
            if extra:
                raise ConfigError(f"{reader.name('rope_parameters')} mixes per-layer-type dicts ({', '.join(nested)}) "
                                  f"with flat keys {extra}")
            for k in nested:
                if params[k] is not None and not isinstance(params[k], Mapping):
                    raise ConfigError(f"{reader.name('rope_parameters')}[{k!r}] must be a dict or null, "
                                      f"got {type(params[k]).__name__}")
            return None, {k: (None if params[k] is None else dict(params[k])) for k in nested}
    scaling = reader.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, Mapping):
        raise ConfigError(f"{reader.name('rope_scaling')} must be a dict or null, got {type(scaling).__name__}")
    return {**(scaling or {}), **(params or {})}, None


def layer_types(config) -> list[str]:
    """The RoPE layer types a config defines (the keys of a per-layer-type ``rope_parameters``), or []."""
    _, nested = rope_dicts(text_reader(config))
    return [] if nested is None else [k for k, v in nested.items() if v is not None]


def _layer_overrides(reader: _Reader, layer_type):
    """A reader of the per-layer config of ``layer_type`` (Gemma 4's global head dim), or ``reader``."""
    if layer_type is None:
        return reader
    if not reader.is_dict:
        per_layer = reader.raw("per_layer_config")
        if per_layer is not None:
            try:
                layer = per_layer[layer_type]
            except (KeyError, IndexError, TypeError, ValueError):
                return reader
            sub = _Reader(layer, f"{reader.where}.per_layer_config[{layer_type!r}]", reader.model_type)
            return sub
        return reader
    per_layer = reader.raw("per_layer_config")
    types = reader.get("layer_types")
    if not per_layer or not types:
        return reader
    if not isinstance(per_layer, Mapping):
        raise ConfigError(f"{reader.name('per_layer_config')} must be a dict of layer index -> overrides")
    chosen, first = None, None
    for index, lt in enumerate(types):
        if lt != layer_type:
            continue
        override = per_layer.get(str(index), per_layer.get(f"{index:02d}", per_layer.get(index))) or {}
        head = override.get("head_dim")
        if first is None:
            first, chosen = index, head
        elif head != chosen:
            raise ConfigError(f"{reader.name('per_layer_config')} gives layers {first} and {index} of type "
                              f"{layer_type!r} different head_dim ({chosen} and {head}); read them per layer with "
                              "RopeSpec.layers_from_hf_config")
    if chosen is None:
        return reader
    return _Reader({**reader.config, "head_dim": chosen}, reader.where, reader.model_type)


def _layer_reader(reader: _Reader, index: int):
    per_layer = reader.raw("per_layer_config")
    if reader.is_dict and isinstance(per_layer, Mapping):
        override = per_layer.get(str(index), per_layer.get(f"{index:02d}", per_layer.get(index)))
        if override:
            return _Reader({**reader.config, **override}, reader.where, reader.model_type)
    elif per_layer is not None and not reader.is_dict:
        try:
            return _Reader(per_layer[index], f"{reader.where}.per_layer_config[{index}]", reader.model_type)
        except (KeyError, IndexError, TypeError, ValueError):
            pass
    return reader


# -- the spec --------------------------------------------------------------------------------------
def spec_kwargs(config, layer_type=None, *, _reader=None) -> dict:
    """RopeSpec keyword arguments (with "head_dim" and "layout") for one layer type of an HF config."""
    reader = _reader or text_reader(config)
    flat, nested = rope_dicts(reader)
    if nested is not None:
        usable = [k for k, v in nested.items() if v is not None]
        if layer_type is None:
            raise ConfigError(f"{reader.name('rope_parameters')} is per layer type ({', '.join(usable)}); pass "
                              "layer_type= one of them, or use RopeSpec.per_layer_from_hf_config")
        if layer_type not in nested:
            raise ConfigError(f"layer_type must be one of {usable}, got {layer_type!r}")
        if nested[layer_type] is None:
            raise ValueError(f"layer type {layer_type!r} has no RoPE (its rope_parameters entry is null)")
        params = dict(nested[layer_type])
        where = f"{reader.name('rope_parameters')}[{layer_type!r}]"
    else:
        if layer_type is not None:
            types = list(dict.fromkeys(reader.get("layer_types") or []))
            if layer_type not in types:
                raise ValueError(f"layer_type must be one of the config's layer types {types}, got {layer_type!r}"
                                 if types else f"layer_type={layer_type!r} given, but this config has no layer types")
        params = dict(flat)
        where = reader.name("rope_parameters") if reader.get("rope_parameters") else reader.name("rope_scaling")
    layer = _layer_overrides(reader, layer_type)
    return _kwargs_from(layer, params, where)


def _kwargs_from(reader: _Reader, params: dict, where: str) -> dict:
    family = _family(reader)
    base = params.pop("rope_theta", None)
    base_where = f"{where}['rope_theta']"
    if base is None:
        base, base_where = reader.get("rope_theta"), reader.name("rope_theta")
        if base is None:
            attn = reader.sub("attn_config")   # DBRX
            if attn is not None and attn.get("rope_theta") is not None:
                base, base_where = attn.get("rope_theta"), attn.name("rope_theta")
    base = 10000.0 if base is None else _number(base, base_where)
    if not base > 0:   # base ** (-2i/d) below: a 0 divides by zero, a negative base gives complex numbers
        raise ConfigError(f"{base_where} must be a finite number > 0 (the RoPE base), got {base!r}")
    partial = params.pop("partial_rotary_factor", None)
    partial_where = f"{where}['partial_rotary_factor']"
    if partial is None:
        partial, partial_where = reader.get("partial_rotary_factor"), reader.name("partial_rotary_factor")
    if partial is not None:
        partial = _number(partial, partial_where)
        if not 0.0 < partial <= 1.0:
            raise ConfigError(f"{partial_where} must be in (0, 1], got {partial!r}")

    mrope_section = params.pop("mrope_section", None)
    mrope_interleaved = params.pop("mrope_interleaved", None)
    for key in ("mrope", "rope_deltas"):
        params.pop(key, None)

    if reader.get("head_dim") is not None:
        head_dim = _integer(reader.get("head_dim"), reader.name("head_dim"))
    else:
        hidden, heads = reader.get("hidden_size"), reader.get("num_attention_heads")
        if hidden is None or heads is None:
            raise ConfigError(f"{reader.where} needs 'head_dim' or both 'hidden_size' and 'num_attention_heads'")
        hidden = _integer(hidden, reader.name("hidden_size"))
        heads = _integer(heads, reader.name("num_attention_heads"))
        if heads < 1:
            raise ConfigError(f"{reader.name('num_attention_heads')} must be >= 1, got {heads}")
        head_dim = hidden // heads
    if head_dim < 1:
        raise ConfigError(f"{reader.name('head_dim')} must be >= 1, got {head_dim}")
    if head_dim > _MAX_HEAD_DIM:   # a broken config: its frequency tables would never finish
        raise ConfigError(f"{reader.name('head_dim')} gives head_dim {head_dim}, more than {_MAX_HEAD_DIM} (from "
                          "head_dim, or hidden_size // num_attention_heads)")
    out = {}

    rope_type = None
    if "rope_type" in params or "type" in params:
        rope_type = params.get("rope_type", params.get("type"))
        rope_type = _scaling.ROPE_TYPE_ALIASES.get(rope_type, rope_type) if isinstance(rope_type, str) else rope_type
    if rope_type in ("default", None) and not (set(params) - {"rope_type", "type"}):
        scaling = None
    elif rope_type == "default":
        scaling = None
        params = {}
    else:
        scaling = params
        if rope_type in ("llama3", "yarn", "longrope") and reader.get("original_max_position_embeddings") is not None:
            scaling["original_max_position_embeddings"] = reader.get("original_max_position_embeddings")

    frequency_dim = None
    if rope_type == "proportional":
        rotary_dim = head_dim - head_dim % 2
        if partial is not None:
            scaling["partial_rotary_factor"] = partial
    elif partial is not None:
        frequency_dim = int(head_dim * partial)
        if frequency_dim < 1:
            raise ConfigError(f"{partial_where} = {partial!r} leaves no rotary dims of head_dim {head_dim}")
        rotary_dim = frequency_dim + frequency_dim % 2
    elif reader.get("rotary_dim") is not None and family in ("gptj", "codegen", "gpt_neox", None):
        rotary_dim = _integer(reader.get("rotary_dim"), reader.name("rotary_dim"))
    else:
        rotary_dim = head_dim - head_dim % 2   # HF rotates the whole head (minimax_m3_vl's rotary_dim unused)
        if head_dim % 2 and rope_type != "proportional":
            # HF's arange(0, d, 2) / d gives (d + 1) / 2 pairs, cos/sin one coordinate wider than the head
            source = (reader.name("head_dim") if reader.get("head_dim") is not None else
                      f"{reader.name('hidden_size')} // {reader.name('num_attention_heads')}")
            raise ConfigError(f"{source} gives an odd head_dim {head_dim} rotated whole: HF's rotary module builds "
                              f"{(head_dim + 1) // 2} pairs ({head_dim + 1} coordinates of cos/sin) and its attention "
                              f"cannot apply them to a {head_dim}-wide head (HF's own config check refuses an odd "
                              "fully rotated head_dim > 4); set head_dim (or partial_rotary_factor) as the released "
                              "checkpoint does")
    if frequency_dim is not None and frequency_dim == rotary_dim:
        frequency_dim = None
    if frequency_dim is not None:
        if rotary_dim > head_dim:
            raise ConfigError(f"{partial_where} = {partial!r} gives an odd rotary dim {frequency_dim} that HF "
                              f"rounds up to {rotary_dim} > head_dim {head_dim}")
        if scaling is not None:
            raise ConfigError(f"{partial_where} = {partial!r} gives an odd rotary dim {frequency_dim}; rotary "
                              f"reproduces it only without scaling (got rope_type {rope_type!r})")
        out["frequencies"] = tuple(base ** (-i / frequency_dim) for i in range(0, frequency_dim, 2))

    if family in BACKWARDS_FAMILIES:
        if scaling is not None:
            raise ConfigError(f"{family} turns pairs by -theta; rotary reproduces it only without scaling "
                              f"(got rope_type {rope_type!r})")
        d = frequency_dim or rotary_dim
        out["frequencies"] = tuple(-(base ** (-i / d)) for i in range(0, d, 2))

    max_pos = reader.get("max_position_embeddings")
    if max_pos is not None:
        max_pos = _integer(max_pos, reader.name("max_position_embeddings"))

    if family in XD_ROPE_FAMILIES:
        _refuse_xd_rope(reader, where, mrope_section, head_dim, base, scaling)
    if mrope_section is not None or family in MROPE_DEFAULTS:
        default_section, mrope_layout = MROPE_DEFAULTS.get(family, (None, "chunked"))
        if mrope_section is None:
            mrope_section = default_section
        if mrope_interleaved is not None:
            if not isinstance(mrope_interleaved, bool):
                raise ConfigError(f"{where}['mrope_interleaved'] must be true or false, got {mrope_interleaved!r}")
            if mrope_interleaved:
                mrope_layout = "interleaved"
        if mrope_section is not None:
            if isinstance(mrope_section, (str, bytes, Mapping)) or not hasattr(mrope_section, "__iter__"):
                raise ConfigError(f"{where}['mrope_section'] must be a list of 3 integers, got "
                                  f"{type(mrope_section).__name__} {mrope_section!r}")
            out["mrope_section"] = tuple(_integer(v, f"{where}['mrope_section'][{i}]")
                                         for i, v in enumerate(mrope_section))
            out["mrope_layout"] = mrope_layout
            pairs = rotary_dim // 2
            if mrope_layout == "chunked" and sum(out["mrope_section"]) != pairs:
                need = 2 * sum(out["mrope_section"])
                factor = 1.0 if partial is None else partial
                fix = (f"partial_rotary_factor {need / head_dim:g} (rotary_dim {need} of head_dim {head_dim})"
                       if need <= head_dim and partial is None else f"head_dim {need / factor:g}")
                raise ConfigError(
                    f"{where}['mrope_section'] {list(out['mrope_section'])} covers {sum(out['mrope_section'])} pairs, "
                    f"but head_dim {head_dim} x partial_rotary_factor {partial if partial is not None else 1:g} "
                    f"rotates {pairs}: HF's rotary module splits cos/sin by the section and raises on this config "
                    f"too (split_with_sizes); the released checkpoints set {fix}")
    elif family in TWO_AXIS_FAMILIES:
        out["pair_axes"] = tuple(i % 2 for i in range(rotary_dim // 2))
        out["n_axes"] = 2
    if family in SOFTMAX_MSCALE_FAMILIES and scaling is not None and scaling.get("mscale_all_dim"):
        factor = _number(scaling.get("factor"), f"{where}['factor']")
        m = _number(scaling["mscale_all_dim"], f"{where}['mscale_all_dim']")
        if not 0.0 <= m <= _scaling.RATIO_MAX:   # the softmax factor (0.1 m ln(s) + 1)**2 stays finite and > 0
            raise ConfigError(f"{where}['mscale_all_dim'] must be a finite number >= 0 (at most "
                              f"{_scaling.RATIO_MAX:g}), got {m!r}")
        out["softmax_scale_factor"] = (0.1 * m * math.log(factor) + 1.0) ** 2 if factor > 1 else 1.0
    interleave = reader.get("rope_interleave")
    if interleave is not None:
        layout = "interleaved" if interleave else "half"
    else:
        layout = "interleaved" if family in INTERLEAVED_FAMILIES else "half"
    out.update(head_dim=head_dim, rotary_dim=rotary_dim, base=base, scaling=scaling, max_position_embeddings=max_pos,
               layout=layout, where=where)
    return out


def _refuse_xd_rope(reader, where, section, head_dim, base, scaling):
    """HunYuan-VL: no spec reproduces XD-RoPE on image tokens (see :data:`XD_ROPE_FAMILIES`); say why and
    what does hold (every axis equal: plain 1-D RoPE)."""
    if scaling and scaling.get("alpha") and scaling.get("rope_type", scaling.get("type")) == "dynamic":
        # HF's HunYuan-VL module: "dynamic" with a fixed alpha is static NTK-alpha, base * alpha**(d/(d-2))
        alpha = _number(scaling["alpha"], f"{where}['alpha']")
        try:
            base, scaling = base * alpha ** (head_dim / (head_dim - 2)), None
        except ArithmeticError:
            raise ConfigError(f"{where}['alpha'] = {alpha!r} gives no finite base * alpha**(d/(d-2)) for head_dim "
                              f"{head_dim}") from None
    plain = f"RopeSpec({head_dim}, base={base!r}" + (f", scaling={scaling!r})" if scaling else ")")
    if section is None:
        raise ConfigError(f"{where} has no mrope_section (or xdrope_section): HF's HunYuan-VL rotary module needs one "
                          "and its forward raises TypeError (len(None)) on this config. Token positions where every "
                          f"axis carries the same value (text, decoding) rotate as the 1-D {plain}")
    d = 2 * sum(int(v) for v in section)
    chunks, start = [], 0
    for j, v in enumerate(section):
        chunks.append(f"{start}-{start + 2 * int(v) - 1} axis {j}")
        start += 2 * int(v)
    raise ConfigError(f"{where}['mrope_section'] {list(section)}: HunYuan-VL's XD-RoPE splits the doubled cos/sin row "
                      f"cat(f, f) of width {d} into coordinate chunks ({', '.join(chunks)}), so coordinates i and "
                      f"i + {d // 2} of a rotate_half pair take angles from different axes: not a rotation on image "
                      "tokens, and no rotary spec reproduces it. Where every axis carries the same position (text "
                      f"tokens, decoding) it is the 1-D {plain}")


HEADS = ("rope", "qk", "indexer")

#: DSA families whose lightning indexer pairs (2i, 2i+1) (HF GLM-MoE-DSA); DeepSeek-V3.2's is half-split
INDEXER_INTERLEAVED_FAMILIES = frozenset({"glm_moe_dsa"})


def head_kwargs(config, kwargs: dict, head: str) -> dict:
    """Spec kwargs of the rope part (``spec_kwargs``) turned into those of the head ``head`` names (see
    the module docstring): "rope" as is; "qk" the MLA q/k head [nope | rope] (as is without MLA);
    "indexer" the DSA indexer's [rope | rest] head of index_head_dim."""
    if head not in HEADS:
        raise ValueError(f"head must be one of {HEADS}, got {head!r}")
    if head == "rope":
        return kwargs
    reader = text_reader(config)
    rotary_dim = kwargs["rotary_dim"]
    if head == "qk":
        if reader.get("qk_nope_head_dim") is None or reader.get("qk_rope_head_dim") is None:
            return kwargs   # no MLA: the rotary module's head is the q/k head
        nope = _integer(reader.get("qk_nope_head_dim"), reader.name("qk_nope_head_dim"))
        rope = _integer(reader.get("qk_rope_head_dim"), reader.name("qk_rope_head_dim"))
        if nope < 0 or not rotary_dim <= rope:
            raise ConfigError(f"{reader.name('qk_rope_head_dim')} = {rope} and {reader.name('qk_nope_head_dim')} = "
                              f"{nope} do not hold the {rotary_dim} rotated coordinates of head='qk'")
        return dict(kwargs, head_dim=nope + rope, rotary_offset=nope)
    if reader.get("index_head_dim") is None:
        raise ConfigError(f"head='indexer' needs a DSA config (DeepSeek-V3.2, GLM-MoE-DSA): {reader.where} has no "
                          "'index_head_dim'")
    index_dim = _integer(reader.get("index_head_dim"), reader.name("index_head_dim"))
    if index_dim < rotary_dim:
        raise ConfigError(f"{reader.name('index_head_dim')} = {index_dim} is smaller than the {rotary_dim} rotated "
                          "coordinates")
    layout = "interleaved" if _family(reader) in INDEXER_INTERLEAVED_FAMILIES else "half"
    out = dict(kwargs, head_dim=index_dim, layout=layout)
    out.pop("softmax_scale_factor", None)   # the indexer scores with index_head_dim**-0.5 (no YaRN mscale)
    return out


def per_layer_kwargs(config) -> dict:
    """{layer type: spec kwargs} for every layer type with RoPE (``{"default": ...}`` for a flat config
    without layer types; every layer type of ``layer_types`` for a flat config with them)."""
    reader = text_reader(config)
    flat, nested = rope_dicts(reader)
    if nested is not None:
        return {lt: spec_kwargs(config, lt, _reader=reader) for lt, v in nested.items() if v is not None}
    all_types = list(reader.get("layer_types") or [])
    nope = _nope_layers(reader)
    # a layer type whose layers are all NoPE (Llama 4's full_attention layers) has no RoPE
    types = list(dict.fromkeys(lt for i, lt in enumerate(all_types) if not (i < len(nope) and nope[i])))
    if not all_types:
        return {"default": spec_kwargs(config, None, _reader=reader)}
    return {lt: spec_kwargs(config, lt, _reader=reader) for lt in types}


def _nope_layers(reader: _Reader) -> list:
    """Per layer index, True where the family's attention skips RoPE (``no_rope_layers[i] == 0``)."""
    if _family(reader) not in NOPE_LAYER_FAMILIES:
        return []
    flags = reader.get("no_rope_layers")
    if flags is None:
        return []
    return [not bool(f) for f in flags]


def layer_kwargs(config) -> list:
    """Spec kwargs of each layer index (``config.layer_types``), None for a layer without RoPE (a layer type
    whose rope_parameters entry is null, or a NoPE layer of Llama 4 / SmolLM3 / Mistral-Large-4)."""
    reader = text_reader(config)
    _, nested = rope_dicts(reader)
    types = reader.get("layer_types")
    nope = _nope_layers(reader)
    if not types:
        n = reader.get("num_hidden_layers")
        if n is None:
            raise ConfigError(f"{reader.where} has neither 'layer_types' nor 'num_hidden_layers'")
        kw = spec_kwargs(config, None, _reader=reader)
        return [None if i < len(nope) and nope[i] else kw for i in range(_layer_count(n, reader.name("num_hidden_layers")))]
    out = []
    for index, lt in enumerate(types):
        if (nested is not None and nested.get(lt) is None) or (index < len(nope) and nope[index]):
            out.append(None)
            continue
        flat, _ = rope_dicts(reader)
        params = dict(nested[lt]) if nested is not None else dict(flat)
        where = reader.name("rope_parameters") + (f"[{lt!r}]" if nested is not None else "")
        out.append(_kwargs_from(_layer_reader(reader, index), params, where))
    return out
