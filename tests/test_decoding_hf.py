"""The docs' NumPy decoder (docs/scripts/numpy_decoder.py: rotary.Rope, packed prefill, KV cache of rotated
keys, rotary.attention with rope=False and cu_seqlens, sliding window) against Hugging Face's own decode
loop: LlamaForCausalLM and MistralForCausalLM (sliding_window) with random weights and a DynamicCache,
prefill + several greedy decode steps, logits compared at every step (float64)."""

import dataclasses
import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

import rotary


ROOT = Path(__file__).resolve().parent.parent


def _decoder_module():
    path = ROOT / "docs" / "scripts" / "numpy_decoder.py"
    spec = importlib.util.spec_from_file_location("numpy_decoder_under_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _hf_model(kind, sliding_window):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
                  attn_implementation="eager", tie_word_embeddings=False)
    torch.manual_seed(0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.MistralConfig(sliding_window=sliding_window, **common)
        model = transformers.MistralForCausalLM(cfg)
    with torch.no_grad():   # non-trivial norms
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model.double().eval(), cfg


@pytest.mark.parametrize("kind, window", [("llama", None), ("mistral", 5)])
def test_numpy_decoder_matches_hf_dynamic_cache(kind, window):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    dec_mod = _decoder_module()
    model, hf_cfg = _hf_model(kind, window)
    spec = rotary.RopeSpec.from_hf_config(hf_cfg.to_dict())
    cfg = dec_mod.Config(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         rope_theta=float(spec.base), rms_norm_eps=1e-6, sliding_window=window)
    weights = {name: p.detach().numpy().copy() for name, p in model.state_dict().items()}
    decoder = dec_mod.Decoder(cfg, weights, backend="numba" if "numba" in rotary.backends.names() else "numpy")
    assert decoder.spec.inv_freq().tolist() == spec.inv_freq().tolist()

    prompts = [[3, 14, 15, 92, 65, 35, 89, 79], [2, 71, 82]]
    steps = 6
    seqs = [decoder.new_sequence() for _ in prompts]
    ours = [decoder.forward([list(p) for p in prompts], seqs)]        # one packed prefill
    tokens = [[] for _ in prompts]
    for _ in range(steps):
        nxt = [int(t) for t in np.argmax(ours[-1], axis=-1)]
        for t, n in zip(tokens, nxt):
            t.append(n)
        ours.append(decoder.forward([[n] for n in nxt], seqs))
    for n, prompt in enumerate(prompts):                              # HF: each prompt alone, DynamicCache
        cache = transformers.DynamicCache(config=hf_cfg)
        with torch.no_grad():
            out = model(torch.tensor([prompt]), cache=cache, use_cache=True)
            theirs = [out.logits[0, -1].numpy()]
            for t in tokens[n]:
                out = model(torch.tensor([[t]]), cache=cache, use_cache=True)
                theirs.append(out.logits[0, -1].numpy())
        for step, (a, b) in enumerate(zip(ours, theirs)):
            # HF makes cos/sin in float32 even for a float64 model (its inv_freq buffer): ~1e-7 relative
            np.testing.assert_allclose(a[n], b, rtol=1e-5, atol=1e-6, err_msg=f"{kind} sequence {n} step {step}")
    if window:   # the window mattered: without it the long prompt's last logits differ from HF's
        full = dec_mod.Decoder(dataclasses.replace(cfg, sliding_window=None), weights, backend="numpy")
        seq = full.new_sequence()
        logits = full.forward([prompts[0] + tokens[0]], [seq])
        assert np.abs(logits[0] - ours[-1][0]).max() > 1e-3
