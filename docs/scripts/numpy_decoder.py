"""A decoder-only transformer in NumPy + rotary, with one rotary.KVCache per layer.

Three families, read from a Hugging Face config (``config.json`` as a dict, or ``PretrainedConfig.to_dict()``):

* Llama 3.1 (``model_type`` "llama"): RMSNorm, SwiGLU MLP, ``rope_type`` "llama3" frequency scaling;
* Qwen3 ("qwen3"): Llama plus an RMSNorm over each q and k head before RoPE (``q_norm``/``k_norm``), here with
  YaRN scaling (its attention factor lives in the rotation, as in HF);
* Gemma 3 text ("gemma3_text"): ``q_norm``/``k_norm``, RMSNorms with ``(1 + weight)``, embeddings times
  sqrt(hidden), the softmax scale ``query_pre_attn_scalar**-0.5``, a ``gelu_pytorch_tanh`` MLP between
  pre- and post-feedforward norms, and two kinds of layers (``layer_types``): sliding-window layers rotated
  with ``rope_local_base_freq`` and global layers rotated with ``rope_theta`` (and its ``rope_scaling``), so
  each layer's cache has its own spec (``rotary.RopeSpec.layers_from_hf_config``).

The weights are a dict of NumPy arrays under HF's state_dict names (``random_weights`` makes some;
``tests/test_decoding_hf.py`` copies them from random-weight HF models and checks that ``generate`` gives
HF ``model.generate``'s tokens and logits for a left-padded batch). ``generate`` prefills prompts of different
lengths in one packed pass per layer (``cu_seqlens``) and then decodes one token per sequence per step; the
caches do the position work (each sequence's keys are rotated at its own positions as they are appended,
each query at its position when it attends).

Run ``python docs/scripts/numpy_decoder.py`` for greedy tokens of the three families with random weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

import rotary

FAMILIES = {"llama": "llama", "qwen3": "qwen3", "gemma3_text": "gemma3"}   # HF model_type -> family


@dataclass
class Config:
    family: str                        # "llama", "qwen3" or "gemma3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    specs: list                        # one rotary.RopeSpec per layer
    layer_types: list                  # "full_attention" or "sliding_attention" per layer
    sliding_window: int | None = None  # a sliding layer's query sees itself and the window-1 keys before it
    query_pre_attn_scalar: float | None = None   # Gemma: softmax scale query_pre_attn_scalar**-0.5
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None

    @classmethod
    def from_hf(cls, hf: dict) -> "Config":
        family = FAMILIES[hf["model_type"]]
        unsupported = [key for key in ("attention_bias", "mlp_bias", "use_bidirectional_attention") if hf.get(key)]
        if unsupported:
            raise NotImplementedError(f"this decoder has no {', '.join(unsupported)}")
        n = hf["num_hidden_layers"]
        return cls(family=family, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
                   intermediate_size=hf["intermediate_size"], num_hidden_layers=n,
                   num_attention_heads=hf["num_attention_heads"], num_key_value_heads=hf["num_key_value_heads"],
                   head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
                   rms_norm_eps=hf["rms_norm_eps"], specs=rotary.RopeSpec.layers_from_hf_config(hf),
                   layer_types=hf.get("layer_types") or ["full_attention"] * n, sliding_window=hf.get("sliding_window"),
                   query_pre_attn_scalar=hf.get("query_pre_attn_scalar") if family == "gemma3" else None,
                   attn_logit_softcapping=hf.get("attn_logit_softcapping"),
                   final_logit_softcapping=hf.get("final_logit_softcapping"))


def hf_config(family: str, **overrides) -> dict:
    """A small config.json of each family (what ``Config.from_hf`` reads), e.g. for ``random_weights``."""
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=256)
    if family == "llama":
        c = dict(model_type="llama", rope_theta=500000.0, rope_scaling=dict(
            rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=32))
    elif family == "qwen3":
        c = dict(model_type="qwen3", rope_theta=1000000.0, rope_scaling=dict(
            rope_type="yarn", factor=4.0, original_max_position_embeddings=32))
    else:
        c = dict(model_type="gemma3_text", rope_theta=1000000.0, rope_local_base_freq=10000.0,
                 rope_scaling=dict(rope_type="linear", factor=8.0), sliding_window=4, query_pre_attn_scalar=16,
                 layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    return {**common, **c, **overrides}


def random_weights(cfg: Config, seed: int = 0, dtype=np.float32) -> dict:
    """Random weights under HF's parameter names for ``cfg.family``."""
    rng = np.random.default_rng(seed)
    d, hd, gemma = cfg.hidden_size, cfg.head_dim, cfg.family == "gemma3"

    def w(*shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(dtype)

    def norm(n):   # Gemma's norms multiply by (1 + weight): weights near 0; the others' near 1
        return (rng.uniform(-0.5, 0.5, n) + (0.0 if gemma else 1.0)).astype(dtype)

    weights = {"model.embed_tokens.weight": w(cfg.vocab_size, d), "model.norm.weight": norm(d)}
    if not gemma:   # Gemma ties lm_head to the embeddings
        weights["lm_head.weight"] = w(cfg.vocab_size, d)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        weights.update({
            p + "input_layernorm.weight": norm(d), p + "post_attention_layernorm.weight": norm(d),
            p + "self_attn.q_proj.weight": w(cfg.num_attention_heads * hd, d),
            p + "self_attn.k_proj.weight": w(cfg.num_key_value_heads * hd, d),
            p + "self_attn.v_proj.weight": w(cfg.num_key_value_heads * hd, d),
            p + "self_attn.o_proj.weight": w(d, cfg.num_attention_heads * hd),
            p + "mlp.gate_proj.weight": w(cfg.intermediate_size, d),
            p + "mlp.up_proj.weight": w(cfg.intermediate_size, d),
            p + "mlp.down_proj.weight": w(d, cfg.intermediate_size),
        })
        if cfg.family in ("qwen3", "gemma3"):
            weights.update({p + "self_attn.q_norm.weight": norm(hd), p + "self_attn.k_norm.weight": norm(hd)})
        if gemma:
            weights.update({p + "pre_feedforward_layernorm.weight": norm(d),
                            p + "post_feedforward_layernorm.weight": norm(d)})
    return weights


def silu(x):
    return x / (1.0 + np.exp(-x))


def gelu_tanh(x):   # HF's gelu_pytorch_tanh
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


class Decoder:
    """The model: ``forward`` runs new tokens of some sequences through every layer, appending their keys and
    values to the layer caches (``new_caches``)."""

    def __init__(self, cfg: Config, weights: dict):
        self.cfg, self.w = cfg, weights
        self.dtype = weights["model.embed_tokens.weight"].dtype
        self.gemma = cfg.family == "gemma3"
        # HF keeps Gemma's sqrt(hidden) as a float32 buffer
        self.embed_scale = float(np.float32(math.sqrt(cfg.hidden_size))) if self.gemma else 1.0
        self.lm_head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])   # tied when absent
        self.act = gelu_tanh if self.gemma else silu
        self.attn_args = []   # per layer: what rotary.attention needs besides q and the cache
        for spec, kind in zip(cfg.specs, cfg.layer_types):
            scale = None      # default: head_dim**-0.5 (times the spec's softmax_scale_factor)
            if cfg.query_pre_attn_scalar is not None:
                scale = cfg.query_pre_attn_scalar ** -0.5 * spec.softmax_scale_factor
            self.attn_args.append(dict(causal=True, scale=scale, softcap=cfg.attn_logit_softcapping,
                                       window=cfg.sliding_window if kind == "sliding_attention" else None))

    def new_caches(self, batch: int, capacity: int, *, page_size=None, kv_dtype=None, backend="auto") -> list:
        """One KVCache per layer (each with its layer's spec) for ``batch`` sequences of up to ``capacity``
        tokens: contiguous, or paged (``page_size``; a pool big enough for every sequence at full length)."""
        cfg = self.cfg
        size = dict(capacity=capacity) if page_size is None else \
            dict(capacity=capacity, page_size=page_size, num_pages=batch * -(-capacity // page_size))
        return [rotary.KVCache(spec, batch=batch, kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                               dtype=self.dtype, kv_dtype=kv_dtype, backend=backend, **size)
                for spec in cfg.specs]

    def norm(self, x, name):
        """HF's RMSNorm over the last axis; Gemma's scales by (1 + weight)."""
        weight = self.w[name] + 1.0 if self.gemma else self.w[name]
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.cfg.rms_norm_eps) * weight

    def forward(self, tokens: list, caches: list, seq_ids=None) -> np.ndarray:
        """Run the new ``tokens`` of sequences ``seq_ids`` (all when None; a list of token lists, one per sequence)
        and return the logits of each sequence's last token (n, vocab). Several tokens per sequence (a prefill)
        go as one packed batch (cu_seqlens); one per sequence (a decode step) as (n, 1, heads, head_dim)."""
        cfg, w = self.cfg, self.w
        counts = [len(t) for t in tokens]
        cu = np.concatenate([[0], np.cumsum(counts)])
        step = max(counts) == 1
        x = w["model.embed_tokens.weight"][np.concatenate(tokens)] * self.embed_scale   # (T, hidden)
        T, hq, hk, hd = x.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        for i, cache in enumerate(caches):
            p = f"model.layers.{i}."
            h = self.norm(x, p + "input_layernorm.weight")
            q = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(T, hq, hd)
            k = (h @ w[p + "self_attn.k_proj.weight"].T).reshape(T, hk, hd)
            v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(T, hk, hd)
            if cfg.family != "llama":   # Qwen3, Gemma 3: RMSNorm of each head before RoPE
                q, k = self.norm(q, p + "self_attn.q_norm.weight"), self.norm(k, p + "self_attn.k_norm.weight")
            if step:    # (n, 1, heads, head_dim): k rotated at position lengths[b] as it is written
                cache.append(k[:, None], v[:, None], seq_ids)
                o = rotary.attention(q[:, None], cache, seq_ids=seq_ids, **self.attn_args[i])
            else:       # packed: sequence b's tokens cu[b]:cu[b+1], at positions lengths[b] ..
                cache.append(k, v, seq_ids, cu_seqlens=cu)
                o = rotary.attention(q, cache, seq_ids=seq_ids, cu_seqlens=cu, **self.attn_args[i])
            o = o.reshape(T, hq * hd) @ w[p + "self_attn.o_proj.weight"].T
            if self.gemma:   # norms after attention and around the MLP
                x = x + self.norm(o, p + "post_attention_layernorm.weight")
                h = self.norm(x, p + "pre_feedforward_layernorm.weight")
            else:
                x = x + o
                h = self.norm(x, p + "post_attention_layernorm.weight")
            mlp = (self.act(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)) \
                @ w[p + "mlp.down_proj.weight"].T
            x = x + (self.norm(mlp, p + "post_feedforward_layernorm.weight") if self.gemma else mlp)
        logits = self.norm(x[cu[1:] - 1], "model.norm.weight") @ self.lm_head.T
        if cfg.final_logit_softcapping is not None:
            c = cfg.final_logit_softcapping
            logits = c * np.tanh(logits / c)
        return logits


def generate(decoder: Decoder, prompts: list, max_new_tokens: int, *, eos_token_id=None, sinks=None, window=None,
             return_logits=False, **cache_args):
    """Greedy decoding of several prompts (token lists of any lengths): one packed prefill, then one token per
    sequence per step. A sequence that emits ``eos_token_id`` stops (its cache entries are freed). With
    ``sinks``/``window`` the caches slide (StreamingLLM: the first ``sinks`` tokens and the last ``window``).
    ``cache_args`` go to ``Decoder.new_caches`` (``page_size``, ``kv_dtype``, ``backend``). Returns the new
    tokens of each prompt, and with ``return_logits`` also the logits (vocab,) each of them was picked from."""
    n = len(prompts)
    caches = decoder.new_caches(n, max(len(p) for p in prompts) + max_new_tokens, **cache_args)
    logits = decoder.forward([list(p) for p in prompts], caches)
    tokens, picked = [[] for _ in prompts], [[] for _ in prompts]
    active = np.arange(n)                     # the sequences still decoding
    for step in range(max_new_tokens):
        nxt = np.argmax(logits, axis=-1)
        for b, t, row in zip(active, nxt, logits):
            tokens[b].append(int(t))
            picked[b].append(row)
        if eos_token_id is not None:
            done = nxt == eos_token_id
            for cache in caches:
                cache.free(active[done])
            active, nxt = active[~done], nxt[~done]
        if step == max_new_tokens - 1 or active.size == 0:
            break
        if sinks is not None:
            for cache in caches:
                cache.slide(sinks=sinks, window=window, seq_ids=active)
        logits = decoder.forward([[int(t)] for t in nxt], caches, seq_ids=active)
    return (tokens, picked) if return_logits else tokens


if __name__ == "__main__":
    prompts = [[5, 17, 3, 42, 8], [7, 9, 11, 13, 15, 17, 19, 21, 23], [60, 2]]
    for family in ("llama", "qwen3", "gemma3"):
        cfg = Config.from_hf(hf_config(family))
        decoder = Decoder(cfg, random_weights(cfg, seed=1))
        print(f"{family:7s}", generate(decoder, prompts, max_new_tokens=8))
        print(f"{'':7s}", generate(decoder, prompts, max_new_tokens=8, page_size=4, kv_dtype="int8"),
              "(paged, int8 entries)")
    print(f"{'':7s}", generate(decoder, prompts, max_new_tokens=8, sinks=2, window=4), "(sliding cache: 2 sinks + 4)")
