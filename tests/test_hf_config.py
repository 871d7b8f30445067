"""RopeSpec.from_hf_config on config.json dicts (no transformers needed): per-layer-type parameters,
aliases, multimodal text configs, M-RoPE defaults, odd rotary dims, MLA softmax factor, bad input.
The zoo test (tests/test_hf_zoo.py) checks the same reader against every HF text rotary class."""

import math

import numpy as np
import pytest

from rotary import RopeSpec

GEMMA3 = {"model_type": "gemma3_text", "head_dim": 256, "hidden_size": 2560, "num_attention_heads": 8,
          "max_position_embeddings": 131072, "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
          "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}

GEMMA4 = {"model_type": "gemma4_text", "head_dim": 256, "hidden_size": 2560, "num_attention_heads": 8,
          "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
          "per_layer_config": {"05": {"head_dim": 512}},
          "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                              "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                 "rope_theta": 1e6}}}


def test_per_layer_type():
    with pytest.raises(ValueError, match=r"per layer type \(full_attention, sliding_attention\).*layer_type"):
        RopeSpec.from_hf_config(GEMMA3)
    full = RopeSpec.from_hf_config(GEMMA3, layer_type="full_attention")
    sliding = RopeSpec.from_hf_config(GEMMA3, layer_type="sliding_attention")
    assert full == RopeSpec(256, base=1e6, scaling={"rope_type": "linear", "factor": 8.0},
                            max_position_embeddings=131072)
    assert sliding == RopeSpec(256, base=10000.0, max_position_embeddings=131072)
    with pytest.raises(ValueError, match=r"layer_type must be one of \['full_attention', 'sliding_attention'\]"):
        RopeSpec.from_hf_config(GEMMA3, layer_type="global")
    specs = RopeSpec.per_layer_from_hf_config(GEMMA3)
    assert specs == {"full_attention": full, "sliding_attention": sliding}
    layers = RopeSpec.layers_from_hf_config(GEMMA3)
    assert layers == [sliding] * 5 + [full]


def test_gemma4_global_head_dim_per_layer():
    full = RopeSpec.from_hf_config(GEMMA4, layer_type="full_attention")
    assert (full.head_dim, full.rotary_dim, full.rope_type) == (512, 512, "proportional")
    # proportional: the first int(0.25 * 512 // 2) = 64 pairs rotate, at base**(-2i/512)
    freqs = full.inv_freq()
    np.testing.assert_allclose(freqs[:64], 1e6 ** (-np.arange(0, 128, 2) / 512), rtol=1e-15)
    assert np.all(freqs[64:] == 0)
    layers = RopeSpec.layers_from_hf_config(GEMMA4)
    assert [s.head_dim for s in layers] == [256] * 5 + [512]
    bad = {**GEMMA4, "layer_types": GEMMA4["layer_types"] + ["full_attention"],
           "per_layer_config": {"05": {"head_dim": 512}, "06": {"head_dim": 384}}}
    with pytest.raises(ValueError, match="layers 5 and 6 of type 'full_attention' different head_dim"):
        RopeSpec.from_hf_config(bad, layer_type="full_attention")
    assert [s.head_dim for s in RopeSpec.layers_from_hf_config(bad)][-2:] == [512, 384]


def test_flat_config_with_layer_types():
    config = {"head_dim": 64, "rope_theta": 5e5, "layer_types": ["linear_attention", "full_attention"]}
    spec = RopeSpec(64, base=5e5)
    assert RopeSpec.from_hf_config(config, layer_type="full_attention") == spec
    assert RopeSpec.per_layer_from_hf_config(config) == {"linear_attention": spec, "full_attention": spec}
    assert RopeSpec.per_layer_from_hf_config({"head_dim": 64}) == {"default": RopeSpec(64)}
    with pytest.raises(ValueError, match="layer_type"):
        RopeSpec.from_hf_config({"head_dim": 64}, layer_type="full_attention")


def test_null_layer_type_has_no_rope():
    config = {"head_dim": 64, "layer_types": ["conv", "full_attention"],
              "rope_parameters": {"full_attention": {"rope_theta": 1e6}, "conv": None}}
    assert RopeSpec.layers_from_hf_config(config) == [None, RopeSpec(64, base=1e6)]
    with pytest.raises(ValueError, match="'conv' has no RoPE"):
        RopeSpec.from_hf_config(config, layer_type="conv")


@pytest.mark.parametrize("config, head_dim, rotary_dim", [
    ({"model_type": "jetmoe", "hidden_size": 2048, "num_attention_heads": 32, "kv_channels": 128}, 128, 128),
    ({"model_type": "zamba2", "hidden_size": 2560, "num_attention_heads": 32, "kv_channels": 80,
      "attention_head_dim": 160}, 160, 160),
    ({"model_type": "glm4_moe_lite", "hidden_size": 2048, "num_attention_heads": 20, "qk_rope_head_dim": 64,
      "qk_nope_head_dim": 192}, 64, 64),
    ({"model_type": "dbrx", "d_model": 6144, "n_heads": 48, "max_seq_len": 32768,
      "attn_config": {"rope_theta": 500000}}, 128, 128),
    ({"model_type": "gpt_neox", "hidden_size": 512, "num_attention_heads": 4, "rotary_pct": 0.25,
      "rotary_emb_base": 10000}, 128, 32),
    ({"model_type": "minimax_m3_vl_text", "head_dim": 128, "rotary_dim": 64, "hidden_size": 6144,
      "num_attention_heads": 64}, 128, 128),    # HF rotates the whole head: rotary_dim is unused there
])
def test_aliases(config, head_dim, rotary_dim):
    spec = RopeSpec.from_hf_config(config)
    assert (spec.head_dim, spec.rotary_dim) == (head_dim, rotary_dim)
    if "attn_config" in config:
        assert spec.base == 500000.0 and spec.max_position_embeddings == 32768


def test_multimodal_text_config_and_mrope():
    qwen2vl = {"model_type": "qwen2_vl", "vision_config": {"depth": 32},
               "text_config": {"model_type": "qwen2_vl_text", "hidden_size": 3584, "num_attention_heads": 28,
                               "rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                                                   "mrope_section": [16, 24, 24]}}}
    spec = RopeSpec.from_hf_config(qwen2vl)
    assert (spec.head_dim, spec.mrope_section, spec.mrope_interleaved, spec.layout) == (128, (16, 24, 24), False,
                                                                                        "half")
    # the family's HF default applies when the config has no mrope_section
    qwen3vl = {"model_type": "qwen3_vl", "text_config": {"head_dim": 128, "rope_theta": 5e6,
                                                         "rope_scaling": {"rope_type": "default"}}}
    spec = RopeSpec.from_hf_config(qwen3vl)
    assert (spec.mrope_section, spec.mrope_interleaved, spec.mrope_layout) == ((24, 20, 20), True, "interleaved")
    glm4v = {"model_type": "glm4v", "text_config": {"model_type": "glm4v_text", "hidden_size": 4096,
                                                    "num_attention_heads": 32,
                                                    "rope_parameters": {"rope_theta": 10000.0,
                                                                        "partial_rotary_factor": 0.5,
                                                                        "mrope_section": [8, 12, 12]}}}
    spec = RopeSpec.from_hf_config(glm4v)
    assert (spec.rotary_dim, spec.mrope_layout, spec.layout) == (64, "chunked", "interleaved")
    ernie = {"model_type": "ernie4_5_vl_moe", "text_config": {"hidden_size": 2560, "num_attention_heads": 20,
                                                             "rope_theta": 5e5}}
    spec = RopeSpec.from_hf_config(ernie)
    assert (spec.mrope_section, spec.mrope_layout, spec.layout) == ((22, 22, 20), "ernie", "interleaved")
    # an explicit layout overrides the family's
    assert RopeSpec.from_hf_config(ernie, layout="half").layout == "half"


def test_odd_rotary_dim_as_hf():
    # GLM-4.5 default: head 4096 // 96 = 42, partial 0.5 -> d = 21: inv_freq = base**(-arange(0, 21, 2)/21)
    spec = RopeSpec.from_hf_config({"model_type": "glm4_moe", "hidden_size": 4096, "num_attention_heads": 96,
                                    "rope_parameters": {"rope_theta": 10000.0, "partial_rotary_factor": 0.5}})
    assert (spec.head_dim, spec.rotary_dim) == (42, 22)
    np.testing.assert_allclose(spec.inv_freq(), 10000.0 ** (-np.arange(0, 21, 2) / 21), rtol=1e-15)
    with pytest.raises(ValueError, match="odd rotary dim 21"):
        RopeSpec.from_hf_config({"hidden_size": 4096, "num_attention_heads": 96, "partial_rotary_factor": 0.5,
                                 "rope_scaling": {"rope_type": "linear", "factor": 2.0}})


def test_deepseek_softmax_scale_factor():
    config = {"model_type": "deepseek_v3", "hidden_size": 7168, "num_attention_heads": 128, "head_dim": 64,
              "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "rope_interleave": True,
              "max_position_embeddings": 163840,
              "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                               "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096},
              "rope_theta": 10000}
    spec = RopeSpec.from_hf_config(config)
    assert spec.layout == "interleaved" and spec.rotary_dim == 64
    assert spec.attention_scaling == 1.0      # mscale / mscale_all_dim
    assert spec.softmax_scale_factor == pytest.approx((0.1 * math.log(40) + 1) ** 2, rel=1e-15)
    # a Llama-family yarn config: HF's attention does not rescale the softmax
    plain = RopeSpec.from_hf_config({**config, "model_type": "llama", "rope_interleave": None})
    assert plain.softmax_scale_factor == 1.0 and plain.layout == "half"


def test_nanochat_turns_pairs_backwards():
    spec = RopeSpec.from_hf_config({"model_type": "nanochat", "hidden_size": 768, "num_attention_heads": 6})
    np.testing.assert_allclose(spec.inv_freq(), -(10000.0 ** (-np.arange(0, 128, 2) / 128)), rtol=1e-15)


@pytest.mark.parametrize("config, key", [
    ({"head_dim": 64, "rope_theta": "abc"}, r"config\['rope_theta'\]"),
    ({"head_dim": 64, "rope_parameters": {"rope_theta": "abc"}}, r"config\['rope_parameters'\]\['rope_theta'\]"),
    ({"head_dim": 64, "partial_rotary_factor": "0.5"}, r"config\['partial_rotary_factor'\]"),
    ({"head_dim": 64.7}, r"config\['head_dim'\]"),
    ({"hidden_size": "4096", "num_attention_heads": 32}, r"config\['hidden_size'\]"),
    ({"head_dim": 64, "max_position_embeddings": 1.5}, r"config\['max_position_embeddings'\]"),
    ({"head_dim": 64, "partial_rotary_factor": 1.5}, r"config\['partial_rotary_factor'\]"),
    ({"head_dim": 64, "rope_scaling": {"type": "linear", "factor": "2"}}, r"config\['rope_scaling'\].*factor"),
    ({"head_dim": 64, "rope_parameters": {"full_attention": {"rope_theta": 1e4}, "rope_type": "default"}},
     "mixes per-layer-type dicts"),
    ({"model_type": "qwen2_vl", "head_dim": 128, "rope_parameters": {"mrope_section": [16, 24, "x"]}},
     r"mrope_section'\]\[2\]"),
])
def test_bad_values_name_the_config_key(config, key):
    with pytest.raises((ValueError, TypeError), match=key):
        RopeSpec.from_hf_config(config)


def test_pretrained_like_object_read_through_attributes():
    class Config:   # attribute access only, like a PretrainedConfig with attribute_map aliases resolved
        model_type = "jetmoe"
        head_dim = 128          # what attribute_map head_dim -> kv_channels gives
        hidden_size = 2048
        num_attention_heads = 32
        rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
        max_position_embeddings = 4096

        def to_dict(self):      # loses the alias: kv_channels only
            return {"kv_channels": 128, "hidden_size": 2048, "num_attention_heads": 32}

    assert RopeSpec.from_hf_config(Config()) == RopeSpec(128, max_position_embeddings=4096)


def test_inspect_cli(tmp_path, capsys):
    import json

    from rotary.__main__ import main

    path = tmp_path / "config.json"
    path.write_text(json.dumps({**GEMMA3, "layer_types": GEMMA3["layer_types"] * 2}))
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "[full_attention]" in out and "[sliding_attention]" in out and "scaling            factor=8" in out
    assert "layers             0-4 sliding_attention, 5 full_attention, 6-10 sliding_attention, 11 full_attention" in out
    assert main(["inspect", str(path), "--layer-type", "sliding_attention"]) == 0
    out = capsys.readouterr().out
    assert "[sliding_attention]" in out and "full_attention" not in out
    assert main(["inspect", str(path), "--layer-type", "global"]) == 2
    assert "layer_type must be one of" in capsys.readouterr().err
    path.write_text(json.dumps({"model_type": "deepseek_v3", "head_dim": 64, "hidden_size": 7168,
                                "num_attention_heads": 128, "rope_theta": 10000, "rope_interleave": True,
                                "max_position_embeddings": 163840,
                                "rope_scaling": {"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                                                 "original_max_position_embeddings": 4096}}))
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "[all layers]" in out and "layout             interleaved" in out
    assert f"softmax factor     {(0.1 * math.log(40) + 1) ** 2:.9g}" in out
    path.write_text("{not json")
    assert main(["inspect", str(path)]) == 2


def test_from_inv_freq_with_attention_scaling():
    freqs = [0.5, -0.25, 1e-3]
    spec = RopeSpec.from_inv_freq(freqs, head_dim=8, layout="interleaved", attention_scaling=1.25)
    assert (spec.head_dim, spec.rotary_dim, spec.layout, spec.attention_scaling) == (8, 6, "interleaved", 1.25)
    np.testing.assert_array_equal(spec.inv_freq(), freqs)
    cos, sin = spec.cos_sin(np.array([0, 3]), dtype=np.float64)
    np.testing.assert_allclose(cos[1], 1.25 * np.cos(3 * np.array(freqs)), rtol=0, atol=1e-15)
    np.testing.assert_allclose(sin[1], 1.25 * np.sin(3 * np.array(freqs)), rtol=0, atol=1e-15)
    with pytest.raises(ValueError, match="attention_factor must be a finite number > 0"):
        RopeSpec.from_inv_freq(freqs, attention_scaling=0.0)
    with pytest.raises(ValueError, match="attention_factor= goes with frequencies="):
        RopeSpec(8, attention_factor=2.0)
    with pytest.raises(ValueError, match="inv_freq must be a 1-D"):
        RopeSpec.from_inv_freq([[1.0]])


@pytest.mark.parametrize("family", ["deepseek_v4", "dots3_note"])
def test_class_derived_rope_families_need_per_layer_rope_parameters(family):
    """DeepSeek-V4 and dots3_note: HF's config class derives per-layer-type RoPE and head-dim defaults that a
    config.json leaves implicit, so a bare config.json is a clear error (it used to read as one flat spec of
    hidden_size // heads), while the config object's own dict (rope_parameters per layer type) still reads
    as the object does."""
    bare = {"model_type": family, "hidden_size": 4096, "num_attention_heads": 64, "rope_theta": 10000.0}
    with pytest.raises(ValueError, match=f"a {family} config.json leaves the RoPE of its layer types"):
        RopeSpec.from_hf_config(bare)
    with pytest.raises(ValueError, match="AutoConfig"):
        RopeSpec.per_layer_from_hf_config(bare)
    transformers = pytest.importorskip("transformers")
    try:
        config = transformers.AutoConfig.for_model(family)
    except (ValueError, KeyError) as exc:   # an older transformers without this family
        pytest.skip(f"transformers {transformers.__version__} has no {family}: {exc}")
    assert RopeSpec.per_layer_from_hf_config(config.to_dict()) == RopeSpec.per_layer_from_hf_config(config)


def test_inspect_prints_which_coordinate_each_pair_reads():
    """`python -m rotary inspect`: the complete pair -> coordinate assignment of every multi-axis spec, checked
    against the spec's own pair_axes() (runs for chunked sections, one letter per pair otherwise)."""
    from rotary.cli.inspect import inspect_config

    qwen2vl = {"model_type": "qwen2_vl", "hidden_size": 3584, "num_attention_heads": 28, "rope_theta": 1e6,
               "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}}
    out = inspect_config(qwen2vl)
    assert "sections (t, h, w) [16, 24, 24], assignment chunked" in out
    assert "pairs read         0-15 t, 16-39 h, 40-63 w" in out
    qwen3vl = {"model_type": "qwen3_vl", "text_config": {"head_dim": 128, "rope_theta": 5e6,
                                                         "rope_scaling": {"rope_type": "default"}}}
    out = inspect_config(qwen3vl)
    letters = "".join(part for line in out.splitlines() if "pairs read" in line or "(from pair" in line
                      for part in [line.replace("pairs read", "").split()[0]])
    axes = RopeSpec.from_hf_config(qwen3vl).pair_axes()
    assert letters == "".join("thw"[a] for a in axes) and letters.startswith("thwthw") and letters.endswith("tttt")
    out = inspect_config({"model_type": "neomme", "head_dim": 64, "hidden_size": 1024, "num_attention_heads": 16})
    assert "pairs read         0101" in out and "coordinate index" in out


def test_inspect_prints_the_vision_tower():
    """A composite config.json: the text spec, then the vision tower's (RopeSpec.from_hf_vision_config) with
    its pair -> (row, col) assignment and the positions HF builds; a vision tower's own config: only that.
    (tests/test_peers_vision_towers.py checks each tower of the table against HF.)"""
    from rotary.cli.inspect import inspect_config

    qwen2vl = {"model_type": "qwen2_vl", "hidden_size": 3584, "num_attention_heads": 28, "rope_theta": 1e6,
               "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
               "vision_config": {"depth": 32, "embed_dim": 1280, "num_heads": 16, "hidden_size": 3584}}
    out = inspect_config(qwen2vl)
    text, vision = out.split("[vision: Qwen2-VL, HF Qwen2VLVisionRotaryEmbedding]")
    assert "pairs read         0-15 t, 16-39 h, 40-63 w" in text
    assert "head / rotary dims 80 / 80 (40 pairs)" in vision and "pairs read         0-19 r, 20-39 c" in vision
    assert "spatial_merge_size=2" in vision
    assert RopeSpec.from_hf_vision_config(qwen2vl) == RopeSpec.axial(80, axes=2)
    step = inspect_config({"model_type": "step3p5_vision", "hidden_size": 1536, "num_attention_heads": 16})
    assert step.startswith("[vision: Step3p7") and "pairs read         0-23 c, 24-47 r" in step
    with pytest.raises(ValueError, match="no vision tower with RoPE"):
        RopeSpec.from_hf_vision_config({"model_type": "llama", "head_dim": 64})


def test_from_hf_config_takes_a_path_or_checkpoint_folder(tmp_path):
    """A config.json path (str or os.PathLike) or a checkpoint folder holding one reads as its dict does, for
    every from_hf_* reader; a missing file or a folder without config.json names the path."""
    import json

    folder = tmp_path / "Gemma-3"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(GEMMA3))
    expected = RopeSpec.from_hf_config(GEMMA3, layer_type="full_attention")
    for source in (folder, str(folder), folder / "config.json", str(folder / "config.json")):
        assert RopeSpec.from_hf_config(source, layer_type="full_attention") == expected
        assert RopeSpec.per_layer_from_hf_config(source) == RopeSpec.per_layer_from_hf_config(GEMMA3)
        assert RopeSpec.layers_from_hf_config(source) == RopeSpec.layers_from_hf_config(GEMMA3)
    vision = {"model_type": "qwen2_vl", "hidden_size": 3584, "num_attention_heads": 28, "rope_theta": 1e6,
              "vision_config": {"depth": 32, "embed_dim": 1280, "num_heads": 16, "hidden_size": 3584}}
    (tmp_path / "vision.json").write_text(json.dumps(vision))
    assert RopeSpec.from_hf_vision_config(tmp_path / "vision.json") == RopeSpec.from_hf_vision_config(vision)
    with pytest.raises(FileNotFoundError, match="nope.json"):
        RopeSpec.from_hf_config(tmp_path / "nope.json")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="empty.* has no config.json"):
        RopeSpec.from_hf_config(str(empty))
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="list.json.*JSON list, not an object"):
        RopeSpec.from_hf_config(tmp_path / "list.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="bad.json.*not a JSON file"):
        RopeSpec.from_hf_config(tmp_path / "bad.json")


def test_inspect_cli_reads_a_checkpoint_folder_and_refuses_deep_json(tmp_path, capsys):
    """`python -m rotary inspect FOLDER` reads FOLDER/config.json; JSON nested past the recursion limit (at the
    top, or inside a config the family's class rewrites) and a missing path are exit 2 with one line, never
    a traceback."""
    import json
    import subprocess
    import sys

    from rotary.__main__ import main

    (tmp_path / "config.json").write_text(json.dumps(GEMMA3))
    assert main(["inspect", str(tmp_path)]) == 0
    assert "[full_attention]" in capsys.readouterr().out
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    nested = tmp_path / "nested.json"
    nested.write_text('{"model_type": "gemma3", "x": ' + "[" * 900 + "]" * 900 + "}")
    for path, words in ((deep, "deep.json"), (nested, "recursion limit"), (tmp_path / "nope", "nope")):
        assert main(["inspect", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("rotary inspect: ") and words in err and "Traceback" not in err, err
    out = subprocess.run([sys.executable, "-m", "rotary", "inspect", str(deep)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and "recursion limit" in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_llama3_without_original_max_position_embeddings_warns_and_falls_back():
    """HF 5 fills a llama3 rope dict's missing original_max_position_embeddings with max_position_embeddings
    (standardize_rope_params); rotary does the same and says so, naming the key and the value used."""
    import warnings

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    config = {"hidden_size": 4096, "num_attention_heads": 32, "rope_theta": 5e5, "max_position_embeddings": 131072,
              "rope_scaling": scaling}
    with pytest.warns(UserWarning, match=r"original_max_position_embeddings'\] is missing.*"
                                         r"max_position_embeddings = 131072"):
        spec = RopeSpec.from_hf_config(config)
    assert spec.scaling_dict["original_max_position_embeddings"] == 131072
    with pytest.warns(UserWarning, match="original_max_position_embeddings"):
        assert RopeSpec(128, base=5e5, scaling=scaling, max_position_embeddings=131072) == spec
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # given (in the rope dict or at the top level): no warning
        full = {**scaling, "original_max_position_embeddings": 8192}
        assert RopeSpec.from_hf_config({**config, "rope_scaling": full}).scaling_dict[
            "original_max_position_embeddings"] == 8192
        top = RopeSpec.from_hf_config({**config, "original_max_position_embeddings": 8192})
        assert top.scaling_dict["original_max_position_embeddings"] == 8192


# -- extreme scaling values: a spec that evaluates finitely everywhere, or a ConfigError naming the key ------------
_EXTREMES = (0.0, 5e-324, 1e-308, 1e-300, 1e-7, 0.25, 1e7, 1e300, 1e308, -1.0, -1e308, 10**400, float("nan"),
             float("inf"))
_LLAMA = {"hidden_size": 128, "num_attention_heads": 4, "rope_theta": 1e4, "max_position_embeddings": 256}
_MLA = {"model_type": "deepseek_v3", "hidden_size": 256, "num_attention_heads": 4, "qk_rope_head_dim": 32,
        "qk_nope_head_dim": 32, "rope_theta": 1e4, "max_position_embeddings": 256}
_RULES = {   # rope dict, the config it sits in, the float keys to push to extremes
    "linear": ({"rope_type": "linear", "factor": 2.0}, _LLAMA, ("factor",)),
    "ntk": ({"rope_type": "ntk", "factor": 2.0}, _LLAMA, ("factor",)),
    "dynamic": ({"rope_type": "dynamic", "factor": 2.0}, _LLAMA, ("factor",)),
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32.0,
              "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}, _MLA,
             ("factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor")),
    "llama3": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}, _LLAMA, ("factor", "low_freq_factor", "high_freq_factor")),
    "longrope": ({"rope_type": "longrope", "factor": 4.0, "original_max_position_embeddings": 64,
                  "short_factor": [1.0] * 16, "long_factor": [2.0] * 16}, _LLAMA,
                 ("factor", "attention_factor", "short_factor", "long_factor")),
    "proportional": ({"rope_type": "proportional", "factor": 2.0, "partial_rotary_factor": 0.5}, _LLAMA,
                     ("factor", "partial_rotary_factor")),
}
_CASES = [(rule, key, value) for rule, (_, _, keys) in _RULES.items() for key in keys for value in _EXTREMES]


def _finite_everywhere(spec):
    """inv_freq finite >= 0 and the attention / softmax factors finite > 0 at the original context and far past
    it; the rotation of ones finite at positions up to 2**40."""
    for seq_len in (None, 10**6, 2**40):
        inv_freq = spec.inv_freq(seq_len)
        assert np.all(np.isfinite(inv_freq)) and np.all(inv_freq >= 0), (seq_len, inv_freq)
        attention = spec.attention_scaling_at(seq_len)
        assert math.isfinite(attention) and attention > 0, (seq_len, attention)
    assert math.isfinite(spec.softmax_scale_factor) and spec.softmax_scale_factor > 0
    import rotary

    y = rotary.apply(np.ones((4, spec.head_dim)), np.array([0, 1, 2**20, 2**40]), spec=spec, backend="numpy")
    assert np.all(np.isfinite(y)), y


@pytest.mark.parametrize("rule, key, value", _CASES, ids=[f"{r}-{k}-{v!r:.12}" for r, k, v in _CASES])
def test_extreme_scaling_values_evaluate_or_name_the_key(rule, key, value):
    """Every float key of every scaling rule at extreme values: from_hf_config gives a spec whose frequencies,
    attention factor and rotation stay finite, or a ConfigError naming the key; never NaN, a bare
    ZeroDivisionError / OverflowError, or ValueError('math domain error')."""
    import warnings

    from rotary.spec.hf_config import ConfigError

    rope, base_config, _ = _RULES[rule]
    if key in ("short_factor", "long_factor"):
        rope = {**rope, key: [value] + rope[key][1:]}
    else:
        rope = {**rope, key: value}
    config = {**base_config, "rope_scaling": rope}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # a linear factor < 1 warns
        try:
            spec = RopeSpec.from_hf_config(config)
        except ConfigError as exc:
            assert f"'{key}'" in str(exc) and "math domain" not in str(exc), str(exc)
            return
        _finite_everywhere(spec)


@pytest.mark.parametrize("rope, words", [
    ({"rope_type": "linear", "factor": 1e-308}, ("['factor']", "1e-308")),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 1e308},
     ("['beta_fast']", "1e+308")),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2**70},
     ("original_max_position_embeddings", str(2**70))),
    ({"rope_type": "longrope", "original_max_position_embeddings": 64, "short_factor": [1e-308] + [1.0] * 15,
      "long_factor": [1.0] * 16}, ("['short_factor']", "1e-308")),
])
def test_scaling_values_past_their_range_are_config_errors(rope, words):
    """The issue-37 cases: a linear factor of 1e-308 (NaN outputs) and beta_fast=1e308 ("math domain error")
    are ConfigErrors naming the key and the value; RopeSpec(scaling=...) raises the same as a ValueError."""
    from rotary.spec.hf_config import ConfigError

    with pytest.raises(ConfigError) as info:
        RopeSpec.from_hf_config({**_LLAMA, "rope_scaling": rope})
    for word in words:
        assert word in str(info.value), str(info.value)
    with pytest.raises(ValueError) as info:
        RopeSpec(32, scaling=rope, max_position_embeddings=256)
    assert all(word in str(info.value) for word in words), str(info.value)
