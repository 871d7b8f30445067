"""The package's NumPy decoder (rotary.examples.decoder: one multi-layer rotary.KVCache per kind of layer, a packed
prefill of a ragged batch, decode steps with attention(q, cache.layer(i))) against Hugging Face transformers'
``generate`` (tests/test_engine_hf.py checks the engine over it).

Llama 3.1 (llama3 scaling), Qwen3 (q/k norms, YaRN) and Gemma 3 text (sliding layers on the local base,
global layers on rope_theta with linear scaling) with tiny random weights in float64: a left-padded batch of
three prompts (5, 9, 2 tokens) decoded greedily gives HF's tokens, and the logits of every step agree to 1e-9.

HF computes a few things in float32 even in a float64 model, ~1e-7 relative, which would hide anything below
that: the RoPE angles (``inv_freq`` is a float32 buffer and ``position_ids.float() * inv_freq`` float32),
RMSNorm (``x.to(float32)``) and eager attention's softmax (``dtype=torch.float32``). The oracle here is HF's
model with those three made float64: inv_freq checked against rotary's to float32 rounding and then taken in
float64 from the spec (HF's attention_scaling kept), its RMSNorm formulas without the cast, and SDPA attention.

The other tests need no torch: int8 / float8_e4m3 cache entries against the float64 cache (the numbers
docs/decoding.md quotes), a paged cache against the contiguous one, EOS stopping, and the sliding cache
(cache.slide) against a fresh prefill of the tokens it keeps.
"""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import rotary
from rotary.examples import decoder as dec

ROOT = Path(__file__).resolve().parent.parent
FAMILIES = ("llama", "qwen3", "gemma3")
PROMPTS = [[5, 17, 3, 42, 8], [7, 9, 11, 13, 15, 17, 19, 21, 23], [60, 2]]
NEW_TOKENS = 8
PAD = 0




# -- the HF oracle ---------------------------------------------------------------------------------------------
def _hf_config(family):
    transformers = pytest.importorskip("transformers")
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("the HF configs here are transformers 5.x's (rope_parameters)")
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=80, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-6, pad_token_id=PAD, eos_token_id=None,
                  bos_token_id=None, attn_implementation="sdpa")
    if family == "llama":
        return transformers.LlamaForCausalLM, transformers.LlamaConfig(
            num_hidden_layers=2, rope_theta=500000.0, tie_word_embeddings=False, **common,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 32})
    if family == "qwen3":
        return transformers.Qwen3ForCausalLM, transformers.Qwen3Config(
            num_hidden_layers=2, rope_theta=1000000.0, tie_word_embeddings=False, **common,
            rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32})
    return transformers.Gemma3ForCausalLM, transformers.Gemma3TextConfig(
        num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=4, query_pre_attn_scalar=24, rope_theta=1000000.0, rope_local_base_freq=10000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0}, final_logit_softcapping=30.0, **common)


def _float64_oracle(model, cfg):
    """HF's model with its float32 steps made float64 (see the module docstring)."""
    torch = pytest.importorskip("torch")
    rope = model.model.rotary_emb
    gemma = cfg.family == "gemma3"
    freqs, scaling = {}, {}
    for spec, layer_type in zip(cfg.specs, cfg.layer_types):
        key = layer_type if gemma else None
        hf_inv = getattr(rope, f"{layer_type}_inv_freq" if gemma else "inv_freq")
        np.testing.assert_allclose(spec.inv_freq(), hf_inv.double().numpy(), rtol=2e-7, atol=0)   # float32 rounding
        freqs[key] = torch.tensor(spec.inv_freq(), dtype=torch.float64)
        scaling[key] = getattr(rope, f"{layer_type}_attention_scaling" if gemma else "attention_scaling")

    def rope_forward(x, position_ids, layer_type=None):
        angles = position_ids[..., None].double() * freqs[layer_type]
        emb = torch.cat((angles, angles), dim=-1)
        return emb.cos() * scaling[layer_type], emb.sin() * scaling[layer_type]

    rope.forward = rope_forward
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = _norm_forward(torch, module, gemma)
    return model


def _norm_forward(torch, module, gemma):
    eps = module.eps if gemma else module.variance_epsilon

    def forward(x):   # HF's formulas, without their x.to(float32)
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return y * (1.0 + module.weight) if gemma else module.weight * y

    return forward


def _hf_model(family):
    torch = pytest.importorskip("torch")
    cls, config = _hf_config(family)
    torch.manual_seed(0)
    model = cls(config).double().eval()
    with torch.no_grad():   # weights of a size that makes the logits spread (HF's init: std 0.02)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(-0.5, 0.5) if family == "gemma3" else p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    cfg = dec.Config.from_hf(model.config.to_dict())
    weights = {name: p.detach().numpy().copy() for name, p in model.state_dict().items()}
    return _float64_oracle(model, cfg), cfg, weights


def _hf_generate(model, prompts, max_new_tokens, **kwargs):
    """HF greedy generate on the left-padded batch: (new tokens (n, steps), logits (n, steps, vocab)). generate
    hands out float32 logits, so the logits are HF's float64 forward over the padded prompts + the new tokens
    (causal: position width - 1 + j gives step j's logits), checked against generate's to float32 rounding."""
    torch = pytest.importorskip("torch")
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[PAD] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                             pad_token_id=PAD, output_logits=True, return_dict_in_generate=True, **kwargs)
        new = out.sequences[:, width:]
        full_mask = torch.cat([mask, torch.ones_like(new)], dim=1)
        logits = model(out.sequences, attention_mask=full_mask).logits[:, width - 1:-1].numpy()
    generated = torch.stack(out.logits, dim=1).numpy()
    assert generated.dtype == np.float32 and logits.dtype == np.float64
    steps = generated.shape[1]
    np.testing.assert_allclose(generated, logits[:, :steps], rtol=0, atol=1e-5 * np.abs(logits).max())
    return new.numpy(), logits


@pytest.fixture(scope="module", params=FAMILIES)
def hf_family(request):
    return request.param, *_hf_model(request.param)


@pytest.mark.peer
def test_config_reads_each_family(hf_family):
    family, model, cfg, _ = hf_family
    assert cfg.family == family and len(cfg.specs) == cfg.num_hidden_layers
    if family == "gemma3":   # local and global layers: two specs, the window only on the sliding ones
        local, glob = cfg.specs[0], cfg.specs[1]
        assert local.base == 10000.0 and glob.base == 1000000.0 and glob.scaling is not None and local.scaling is None
        decoder = dec.Decoder(cfg, dec.random_weights(cfg))
        assert decoder.attn_args[0]["scale"] == 24 ** -0.5
        cache = decoder.new_cache(2, 16, page_size=4)   # one cache per kind: sliding layers 0, 2; global layer 1
        assert [(c.layers, c.window) for c in cache.caches] == [(2, 4), (1, None)]
        assert cache.layers_of == [[0, 2], [1]] and cache.caches[0].spec == local and cache.caches[1].spec == glob
    else:
        assert cfg.specs[0].scaling_dict["rope_type"] == {"llama": "llama3", "qwen3": "yarn"}[family]


#: the backends the caches of the decoder run on (NumPy arrays: not CuPy)
HOST_BACKENDS = [pytest.param(b, marks=() if ok else pytest.mark.skip(reason=why), id=b)
                 for b, (ok, why) in rotary.available_backends().items() if b != "cupy"]


@pytest.mark.peer
@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_generate_matches_hf(hf_family, backend):
    """A ragged batch (5, 9, 2 tokens): our packed prefill + decode steps against HF's left-padded generate."""
    family, model, cfg, weights = hf_family
    tokens, logits = dec.generate(dec.Decoder(cfg, weights), PROMPTS, NEW_TOKENS, return_logits=True,
                                  backend=backend)
    hf_tokens, hf_logits = _hf_generate(model, PROMPTS, NEW_TOKENS)
    assert tokens == hf_tokens.tolist(), family
    ours = np.array(logits)                                     # (n, steps, vocab)
    assert ours.shape == hf_logits.shape
    scale = np.abs(hf_logits).max()
    err = np.abs(ours - hf_logits).max()
    assert err <= 1e-9 * max(1.0, scale), f"{family}: max |logit difference| {err:.3g} (logits up to {scale:.3g})"


@pytest.mark.peer
def test_generate_matches_hf_prompt_by_prompt(hf_family):
    """Each prompt alone (no padding) through HF's forward gives the logits of our batched prefill."""
    torch = pytest.importorskip("torch")
    family, model, cfg, weights = hf_family
    ours = dec.Decoder(cfg, weights).forward(PROMPTS, dec.Decoder(cfg, weights).new_cache(3, 16))
    for n, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            theirs = model(torch.tensor([prompt])).logits[0, -1].numpy()
        np.testing.assert_allclose(ours[n], theirs, rtol=0, atol=1e-9, err_msg=f"{family} prompt {n}")


@pytest.mark.peer
def test_window_and_local_base_matter():
    """Gemma 3: with the sliding window or the local base taken away the logits move far past the tolerance, so
    the comparison above sees both."""
    _, cfg, weights = _hf_model("gemma3")
    _, logits = dec.generate(dec.Decoder(cfg, weights), PROMPTS, 4, return_logits=True)
    no_window = dec.Config(**{**cfg.__dict__, "sliding_window": None})
    one_base = dec.Config(**{**cfg.__dict__, "specs": [cfg.specs[1]] * cfg.num_hidden_layers})
    for changed in (no_window, one_base):
        _, other = dec.generate(dec.Decoder(changed, weights), PROMPTS, 4, return_logits=True)
        assert np.abs(np.array(other[1]) - np.array(logits[1])).max() > 1e-3


@pytest.mark.peer
def test_eos_stops_like_hf():
    """A sequence that emits eos stops (its cache entries freed; the others decode on with seq_ids); HF pads it."""
    model, cfg, weights = _hf_model("llama")
    decoder = dec.Decoder(cfg, weights)
    free_run = dec.generate(decoder, PROMPTS, NEW_TOKENS)
    # a token that one sequence first emits at step 2 or later
    b, j = next((b, j) for b, run in enumerate(free_run) for j in range(2, NEW_TOKENS) if run[j] not in run[:j])
    eos = free_run[b][j]
    tokens = dec.generate(decoder, PROMPTS, NEW_TOKENS, eos_token_id=eos, page_size=4)
    hf_tokens, _ = _hf_generate(model, PROMPTS, NEW_TOKENS, eos_token_id=eos)
    for ours, theirs in zip(tokens, hf_tokens.tolist()):
        assert ours == theirs[:len(ours)] and (len(ours) == NEW_TOKENS or ours[-1] == eos)
        assert all(t == PAD for t in theirs[len(ours):])
    assert len(tokens[b]) == j + 1 and any(len(t) == NEW_TOKENS for t in tokens)


# -- without torch: quantized and paged caches, the sliding cache ---------------------------------------------
def _random_decoder(family, dtype=np.float64, **overrides):
    cfg = dec.Config.from_hf(dec.hf_config(family, **overrides))
    return dec.Decoder(cfg, dec.random_weights(cfg, seed=3, dtype=dtype))


def _logits_along(decoder, prompts, tokens, **cache_args):
    """Teacher-forced logits (n, steps, vocab): the prompts, then the given tokens one step at a time."""
    cache = decoder.new_cache(len(prompts), max(map(len, prompts)) + len(tokens[0]), **cache_args)
    out = [decoder.forward(prompts, cache)]
    for j in range(len(tokens[0]) - 1):
        out.append(decoder.forward([[t[j]] for t in tokens], cache))
    return np.stack(out, axis=1)


#: max |logit difference| / max |logit| of a quantized cache against the float64 one, teacher-forced along the
#: float64 decoder's tokens: measured 0.87e-2 to 0.99e-2 for int8, 3.6e-2 to 7.6e-2 for float8_e4m3 (3 layers,
#: the three families; docs/decoding.md quotes them)
QUANTIZED_TOLERANCE = {"int8": 3e-2, "float8_e4m3": 0.15}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kv_dtype", ["int8", "float8_e4m3"])
def test_quantized_cache_logits(family, kv_dtype):
    oracle = _random_decoder(family)
    tokens = dec.generate(oracle, PROMPTS, NEW_TOKENS)
    exact = _logits_along(oracle, PROMPTS, tokens)
    # float8 entries are rounded from float32: a float32 model (the float32 error alone is ~1e-6)
    dtype = np.float64 if kv_dtype == "int8" else np.float32
    decoder = _random_decoder(family, dtype=dtype)
    plain = _logits_along(decoder, PROMPTS, tokens)
    quantized = _logits_along(decoder, PROMPTS, tokens, kv_dtype=kv_dtype)
    scale = np.abs(exact).max()
    err = np.abs(quantized - exact).max() / scale
    assert np.abs(plain - exact).max() / scale < 1e-5
    assert 1e-6 < err < QUANTIZED_TOLERANCE[kv_dtype], f"{family} {kv_dtype}: relative logit error {err:.3g}"


@pytest.mark.parametrize("family", FAMILIES)
def test_paged_cache_gives_the_contiguous_tokens(family):
    decoder = _random_decoder(family)
    tokens, logits = dec.generate(decoder, PROMPTS, NEW_TOKENS, return_logits=True)
    paged_tokens, paged_logits = dec.generate(decoder, PROMPTS, NEW_TOKENS, return_logits=True, page_size=4)
    assert paged_tokens == tokens
    np.testing.assert_allclose(np.array(paged_logits), np.array(logits), rtol=0, atol=1e-12)


def test_paged_cache_memory_grows_with_tokens():
    """One pool for every layer (llama: one cache of 3 layers): it grows with the pages in use, 3 per sequence after
    12 tokens; Gemma's sliding-window cache gives pages wholly outside the window back, its global cache does not."""
    decoder = _random_decoder("llama")
    paged, contiguous = decoder.new_cache(3, 64, page_size=4), decoder.new_cache(3, 64)
    assert len(paged.caches) == 1 and paged.caches[0].layers == 3
    start = paged.nbytes
    decoder.forward([[1, 2]] * 3, paged)
    assert paged.nbytes == start < contiguous.nbytes    # 3 pages of 4 tokens, one per sequence
    for _ in range(5):
        decoder.forward([[3, 4]] * 3, paged)
    assert paged.nbytes > start and paged.free_pages == paged.caches[0].num_pages - 3 * 3
    gemma = _random_decoder("gemma3")
    cache = gemma.new_cache(3, 64, page_size=4)
    for _ in range(6):
        gemma.forward([[3, 4]] * 3, cache)
    sliding, glob = cache.caches            # window 4: the last query's window and the next one's in 2 pages
    assert sliding.window == 4 and glob.window is None
    assert glob.free_pages == glob.num_pages - 9 and sliding.free_pages == sliding.num_pages - 3 * 2


def test_sliding_cache_matches_fresh_prefill_of_what_it_keeps():
    """One layer: a token's key and value depend on the token alone, so after cache.slide (2 sinks, a window of
    4) each step's logits are those of a fresh prefill of the kept tokens followed by the new one."""
    decoder = _random_decoder("llama", num_hidden_layers=1)
    sinks, window = 2, 4
    tokens, logits = dec.generate(decoder, PROMPTS, NEW_TOKENS, sinks=sinks, window=window, return_logits=True)
    for b, prompt in enumerate(PROMPTS):
        stream = list(prompt) + tokens[b]
        for j in range(1, NEW_TOKENS):
            end = len(prompt) + j                   # the new token is stream[end - 1]
            kept = stream[:end - 1] if end - 1 <= sinks + window else stream[:sinks] + stream[end - 1 - window:end - 1]
            fresh = decoder.forward([kept + [stream[end - 1]]], decoder.new_cache(1, 32))[0]
            np.testing.assert_allclose(logits[b][j], fresh, rtol=0, atol=1e-10, err_msg=f"sequence {b} step {j}")
    full = dec.generate(decoder, PROMPTS, NEW_TOKENS, return_logits=True)[1]
    assert np.abs(np.array(full[1][-1]) - np.array(logits[1][-1])).max() > 1e-3   # the slide changed something


@pytest.mark.parametrize("command", [["docs/scripts/numpy_decoder.py"], ["-m", "rotary.examples.decoder"]],
                         ids=["docs-shim", "module"])
def test_script_prints_tokens(command):
    proc = subprocess.run([sys.executable, *command], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().split("\n")
    assert [line.split()[0] for line in lines if not line.startswith(" ")] == list(FAMILIES)
