"""Text rotary modules HF cannot run on their default configs: HF's behaviour next to rotary's clear error
(what is missing, what HF does, what the released checkpoints set). The fixed configs are in the zoo
(tests/hf_zoo.py CONFIG_FIXES); HunYuan-VL's XD-RoPE is shown not to be a rotation on image tokens."""

import importlib
import re
import warnings

import numpy as np
import pytest

import rotary
from rotary import RopeSpec

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.peer, pytest.mark.skipif(int(transformers.__version__.split(".")[0]) < 5,
                                                   reason="needs transformers >= 5 (rope_parameters)")]


def _text_config(model_type):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoConfig.for_model(model_type).get_text_config()


def _module(config, cls_name):
    mod = importlib.import_module(type(config).__module__.replace(".configuration_", ".modeling_"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return mod, getattr(mod, cls_name)(config)


@pytest.mark.parametrize("model_type, cls_name, fix", [
    ("glm4v", "Glm4vTextRotaryEmbedding", "partial_rotary_factor 0.5"),
    ("glm_image", "GlmImageTextRotaryEmbedding", "partial_rotary_factor 0.5"),
    ("glm4v_moe", "Glm4vMoeTextRotaryEmbedding", "head_dim 128"),
])
def test_glm4v_family_default_section_does_not_fit_the_head(model_type, cls_name, fix):
    config = _text_config(model_type)
    _, module = _module(config, cls_name)
    pos = torch.arange(8)[None, None].expand(3, 1, 8)
    with pytest.raises(RuntimeError, match="split_with_sizes"):
        module(torch.zeros(1), pos)
    with pytest.raises(ValueError, match=r"mrope_section'\] \[8, 12, 12\] covers 32 pairs.*HF's rotary module splits "
                                         rf"cos/sin by the section and raises.*released checkpoints set {fix}"):
        RopeSpec.from_hf_config(config)
    # the suggested fix is what the zoo's CONFIG_FIXES apply, and then HF and rotary agree (tests/test_hf_zoo.py)
    if fix.startswith("partial"):
        config.rope_parameters = {**config.rope_parameters, "partial_rotary_factor": 0.5}
    else:
        config.head_dim = 128
    assert RopeSpec.from_hf_config(config).rotary_dim == 64


def test_qwen3_omni_thinker_default_odd_head():
    """2048 // 28 = 73: HF's module builds 37 pairs (cos/sin 74 wide), and its apply function cannot rotate a
    73-wide head; rotary says so instead of rotating 72 coordinates."""
    config = _text_config("qwen3_omni_moe")
    assert config.hidden_size // config.num_attention_heads == 73 and getattr(config, "head_dim", None) is None
    mod, module = _module(config, "Qwen3OmniMoeThinkerTextRotaryEmbedding")
    cos, sin = module(torch.zeros(1), torch.arange(4)[None, None].expand(3, 1, 4))
    assert cos.shape[-1] == 74
    q = torch.zeros(1, 1, 4, 73)
    with pytest.raises(RuntimeError):
        mod.apply_rotary_pos_emb(q, q, cos, sin)
    with pytest.raises(ValueError, match=r"odd head_dim 73 rotated whole: HF's rotary module builds 37 pairs \(74 "):
        RopeSpec.from_hf_config(config)
    config.head_dim = 128
    assert RopeSpec.from_hf_config(config).rotary_dim == 128


def test_hunyuan_vl_default_config_has_no_section():
    config = _text_config("hunyuan_vl")
    _, module = _module(config, "HunYuanVLRotaryEmbedding")
    with pytest.raises(TypeError, match="NoneType"):
        module(torch.zeros(1), torch.arange(4)[None])
    with pytest.raises(ValueError, match=r"no mrope_section \(or xdrope_section\).*TypeError.*1-D RopeSpec\(128"):
        RopeSpec.from_hf_config(config)


def test_hunyuan_vl_xd_rope_is_not_a_rotation_on_image_tokens():
    """HunYuan-OCR's config.json shape ("type": "xdrope", "xdrope_section": [16, 16, 16, 16]): HF splits the
    doubled row cat(f, f) into four coordinate chunks, one per axis (seq, w, h, image index). Where every axis
    carries the same position it is 1-D RoPE (rotary's suggested spec matches HF through HF's apply function);
    where they differ, pair norms are not kept (no rotation, so no spec) and rotary refuses the config."""
    d = {"model_type": "hunyuan_vl", "text_config": {
        "model_type": "hunyuan_vl_text", "hidden_size": 1024, "num_attention_heads": 16, "head_dim": 128,
        "num_hidden_layers": 2, "num_key_value_heads": 8, "max_position_embeddings": 32768, "rope_theta": 10000.0,
        "rope_scaling": {"type": "xdrope", "xdrope_section": [16, 16, 16, 16], "alpha": 1000.0, "factor": 1.0}}}
    with pytest.raises(ValueError, match=r"XD-RoPE splits the doubled cos/sin row cat\(f, f\) of width 128 into "
                                         r"coordinate chunks \(0-31 axis 0, 32-63 axis 1, 64-95 axis 2, 96-127 axis "
                                         r"3\).*coordinates i and i \+ 64"):
        RopeSpec.from_hf_config(d)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = transformers.AutoConfig.for_model(**d).get_text_config()
    assert config.rope_parameters["mrope_section"] == [16, 16, 16, 16]
    mod, module = _module(config, "HunYuanVLRotaryEmbedding")
    plain = re.search(r"1-D (RopeSpec\(.*\))$", _error(d)).group(1)
    spec = eval(plain, {"RopeSpec": RopeSpec})   # noqa: S307 - the message's own spelling of the spec
    assert spec.scaling is None and spec.base == pytest.approx(10000.0 * 1000.0 ** (128 / 126), rel=1e-15)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 2, 6, 128)).astype(np.float32)
    same = torch.arange(6)[None, None].expand(4, 1, 6)
    with torch.no_grad():
        cos, sin = module(torch.zeros(1), same)
        hq, _ = mod.apply_rotary_pos_emb(torch.from_numpy(q), torch.from_numpy(q), cos, sin)
    np.testing.assert_allclose(spec.inv_freq(), module.inv_freq.double().numpy(), rtol=2e-6)   # HF: NTK-alpha
    out = rotary.apply(q, np.arange(6), spec=spec, backend="numpy", seq_axis=-2)
    np.testing.assert_allclose(out, hq.numpy(), rtol=0, atol=1e-5 * np.abs(q).max())
    image = same.clone()
    image[1:, 0, 2:] = torch.tensor([[0, 1, 2, 3], [0, 0, 1, 1], [0, 0, 0, 0]])   # w, h, image index
    with torch.no_grad():
        cos, sin = module(torch.zeros(1), image)
        hq, _ = mod.apply_rotary_pos_emb(torch.from_numpy(q), torch.from_numpy(q), cos, sin)
    hq = hq.double().numpy()
    norms_in = q[..., :64] ** 2 + q[..., 64:] ** 2
    norms_out = hq[..., :64] ** 2 + hq[..., 64:] ** 2
    assert np.allclose(norms_in[:, :, :2], norms_out[:, :, :2], rtol=1e-5)       # text tokens: a rotation
    assert not np.allclose(norms_in[:, :, 2:], norms_out[:, :, 2:], rtol=1e-3)   # image tokens: not one


def _error(config):
    try:
        RopeSpec.from_hf_config(config)
    except ValueError as exc:
        return str(exc)
    raise AssertionError("no error")
