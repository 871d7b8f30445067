"""A decoder-only transformer in NumPy + rotary, with one multi-layer :class:`rotary.KVCache` per kind of layer.

Three families, read from a Hugging Face config (``config.json`` as a dict, or ``PretrainedConfig.to_dict()``):

* Llama 3.1 (``model_type`` "llama"): RMSNorm, SwiGLU MLP, ``rope_type`` "llama3" frequency scaling;
* Qwen3 ("qwen3"): Llama plus an RMSNorm over each q and k head before RoPE (``q_norm``/``k_norm``: fused into
  the cache's append and attention, ``k_norm=`` / ``q_norm=``), here with YaRN scaling (its attention factor lives
  in the rotation, as in HF);
* Gemma 3 text ("gemma3_text"): ``q_norm``/``k_norm``, RMSNorms with ``(1 + weight)``, embeddings times
  sqrt(hidden), the softmax scale ``query_pre_attn_scalar**-0.5``, a ``gelu_pytorch_tanh`` MLP between
  pre- and post-feedforward norms, and two kinds of layers (``layer_types``): sliding-window layers rotated
  with ``rope_local_base_freq`` and global layers rotated with ``rope_theta`` (and its ``rope_scaling``)
  (``rotary.RopeSpec.layers_from_hf_config`` gives each layer's spec).

The caches (:class:`ModelCache`): the layers of one kind (one spec, one window) share one ``KVCache(layers=n)``:
one page pool and one block table, a step's pages taken and lengths advanced once (``reserve``), then every layer
writes its keys into the same slots (``cache.layer(i).append``) and attends over them. Gemma's sliding layers get
a cache made with ``window=sliding_window`` (pages wholly outside the window go back to the pool), its global
layers another. The host work of a layer is the same whatever the number of sequences or layers: no per-layer
block tables or slot mappings.

The weights are a dict of NumPy arrays under HF's state_dict names (``random_weights`` makes some;
``tests/test_decoding_hf.py`` copies them from random-weight HF models and checks that ``generate`` gives
HF ``model.generate``'s tokens and logits for a left-padded batch). ``generate`` prefills prompts of different
lengths in one packed pass (``cu_seqlens``) and then decodes one token per sequence per step; the caches do the
position work (each sequence's keys are rotated at its own positions as they are appended, each query at its
position when it attends). :mod:`rotary.examples.engine` schedules requests over the same ``Decoder.forward``.

Run ``python -m rotary.examples.decoder`` for greedy tokens of the three families with random weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

import rotary

FAMILIES = {"llama": "llama", "qwen3": "qwen3", "gemma3_text": "gemma3"}   # HF model_type -> family


@dataclass
class Config:
    """What the decoder reads from an HF config (``Config.from_hf``)."""

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

    def layer_windows(self) -> list:
        """Each layer's sliding window (None for a global layer)."""
        return [self.sliding_window if kind == "sliding_attention" else None for kind in self.layer_types]


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


class ModelCache:
    """The KV caches of one model: one ``rotary.KVCache(layers=n)`` per kind of layer (layers with the same spec
    and window), all with the same sequence slots, so that a sequence is one slot number in every cache.

    ``layer(i)`` is layer i's view (``append`` / ``attend`` / ``keys`` / ``values``); ``add``, ``free``, ``fork``,
    ``truncate``, ``reserve``, ``export``, ``insert`` and ``slide`` do the same to every cache. ``caches`` lists
    the ``KVCache`` objects, ``kinds`` their (spec, window) and ``layers_of`` the model layers each holds.
    """

    def __init__(self, cfg: Config, batch: int, *, capacity=None, page_size=None, num_pages=None,
                 dtype=np.float32, kv_dtype=None, backend="auto"):
        groups = {}   # (spec, window) -> the model layers of that kind
        for i, (spec, window) in enumerate(zip(cfg.specs, cfg.layer_windows())):
            groups.setdefault((spec, window), []).append(i)
        self.kinds, self.layers_of, self.caches = list(groups), list(groups.values()), []
        self._layers = [None] * cfg.num_hidden_layers
        for (spec, window), layers in groups.items():
            cache = rotary.KVCache(spec, batch=batch, kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                                   capacity=capacity, page_size=page_size, num_pages=num_pages, dtype=dtype,
                                   kv_dtype=kv_dtype, backend=backend, layers=len(layers), window=window)
            self.caches.append(cache)
            for j, i in enumerate(layers):
                self._layers[i] = cache.layer(j)

    def layer(self, i):
        """Model layer ``i``: a layer of its kind's cache (``rotary.attention(q, cache.layer(i), ...)``)."""
        return self._layers[i]

    # -- what every cache agrees on ---------------------------------------------------------------------------
    @property
    def lengths(self) -> np.ndarray:
        """Tokens each sequence slot holds (the same in every cache)."""
        return self.caches[0].lengths

    @property
    def active(self) -> np.ndarray:
        return self.caches[0].active

    @property
    def batch(self) -> int:
        return self.caches[0].batch

    @property
    def page_size(self) -> int:
        return self.caches[0].page_size

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.caches)

    @property
    def free_pages(self) -> int:
        """Pages the fullest cache can still give (0 for a contiguous cache)."""
        return min(c.free_pages for c in self.caches)

    # -- the same to every cache ----------------------------------------------------------------------------------
    def add(self, tokens=None) -> int:
        """A free sequence slot (``KVCache.add``); with ``tokens`` (a paged cache) the prompt pages every cache
        keeps from earlier prompts are shared, and ``lengths[slot]`` says how many prompt tokens need no prefill
        (the fewest any cache has: a cache holding more is truncated to it)."""
        slots = {c.add(tokens) for c in self.caches}
        assert len(slots) == 1, f"the caches handed out different slots {slots}"
        slot = slots.pop()
        cached = min(int(c.lengths[slot]) for c in self.caches)
        for c in self.caches:
            if c.lengths[slot] > cached:
                c.truncate([slot], cached)
        return slot

    def reserve(self, seq_ids, tokens):
        """Start a step: ``tokens`` new tokens (one count per sequence) for sequences ``seq_ids``, pages taken and
        lengths advanced once per cache; every layer then appends them."""
        for c in self.caches:
            c.reserve(seq_ids, tokens)

    def free(self, seq_ids):
        for c in self.caches:
            c.free(seq_ids)

    def fork(self, src, dst=None, length=None) -> int:
        """A new sequence holding ``src``'s first ``length`` tokens (pages shared, copied on write)."""
        dst = self.caches[0].fork(src, dst, length)
        for c in self.caches[1:]:
            c.fork(src, dst, length)
        return dst

    def truncate(self, seq_ids, lengths):
        for c in self.caches:
            c.truncate(seq_ids, lengths)

    def export(self, seq_id, start=0, stop=None) -> tuple:
        """One ``rotary.KVChunk`` per cache: keys and values of every layer of that kind."""
        return tuple(c.export(seq_id, start, stop) for c in self.caches)

    def insert(self, seq_id, chunks):
        """Append the chunks of ``export`` (one per cache) to sequence ``seq_id``, re-rotated to its length."""
        for c, chunk in zip(self.caches, chunks):
            c.insert(seq_id, chunk)

    def slide(self, *, sinks, window, seq_ids=None):
        for c in self.caches:
            c.slide(sinks=sinks, window=window, seq_ids=seq_ids)


class Decoder:
    """The model: ``forward`` runs new tokens of some sequences through every layer, appending their keys and
    values to a :class:`ModelCache` (``new_cache``)."""

    def __init__(self, cfg: Config, weights: dict):
        self.cfg, self.w = cfg, weights
        self.dtype = weights["model.embed_tokens.weight"].dtype
        self.gemma = cfg.family == "gemma3"
        # HF keeps Gemma's sqrt(hidden) as a float32 buffer
        self.embed_scale = float(np.float32(math.sqrt(cfg.hidden_size))) if self.gemma else 1.0
        self.lm_head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])   # tied when absent
        self.act = gelu_tanh if self.gemma else silu
        self.attn_args = []   # per layer: what rotary.attention needs besides q and the cache (the window: the cache's)
        for spec in cfg.specs:
            scale = None      # default: head_dim**-0.5 (times the spec's softmax_scale_factor)
            if cfg.query_pre_attn_scalar is not None:
                scale = cfg.query_pre_attn_scalar ** -0.5 * spec.softmax_scale_factor
            self.attn_args.append(dict(scale=scale, softcap=cfg.attn_logit_softcapping))
        # Qwen3, Gemma 3: an RMSNorm of each q and k head before RoPE, fused into the cache's append (k) and attention
        # (q); Gemma's weights as (1 + weight)
        self.k_norm_args, self.q_norm_args = [], []
        for i in range(cfg.num_hidden_layers):
            if cfg.family == "llama":
                self.k_norm_args.append({})
                self.q_norm_args.append({})
                continue
            p = f"model.layers.{i}.self_attn."
            k_w, q_w = (weights[p + name] + 1.0 if self.gemma else weights[p + name] for name in ("k_norm.weight",
                                                                                               "q_norm.weight"))
            self.k_norm_args.append(dict(k_norm=k_w, norm_eps=cfg.rms_norm_eps))
            self.q_norm_args.append(dict(q_norm=q_w, norm_eps=cfg.rms_norm_eps))

    def new_cache(self, batch: int, capacity=None, *, page_size=None, num_pages=None, kv_dtype=None,
                  backend="auto") -> ModelCache:
        """The caches for ``batch`` sequences: contiguous (``capacity`` tokens each), or paged (``page_size``;
        a pool of ``num_pages`` pages, by default big enough for every sequence at ``capacity``)."""
        return ModelCache(self.cfg, batch, capacity=capacity, page_size=page_size, num_pages=num_pages,
                          dtype=self.dtype, kv_dtype=kv_dtype, backend=backend)

    def norm(self, x, name):
        """HF's RMSNorm over the last axis; Gemma's scales by (1 + weight)."""
        weight = self.w[name] + 1.0 if self.gemma else self.w[name]
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.cfg.rms_norm_eps) * weight

    def forward(self, tokens: list, cache: ModelCache, seq_ids=None, *, positions=None,
                all_logits=False) -> np.ndarray:
        """One step: the new ``tokens`` of sequences ``seq_ids`` (a list of token lists, one per sequence, of any
        lengths: prefill chunks and decode tokens together; ``seq_ids`` None: sequences 0, 1, ...) packed along one
        token axis (``cu_seqlens``). Sequence b's tokens go at positions ``lengths[b] ..``, or are rotated at
        ``positions`` (one per token, packed) when given. Returns the logits of each sequence's last token
        ``(n, vocab)``, or of every token ``(tokens, vocab)`` with ``all_logits``."""
        cfg, w = self.cfg, self.w
        counts = np.array([len(t) for t in tokens], np.int64)
        cu = np.concatenate([[0], np.cumsum(counts)])
        ids = np.arange(len(tokens)) if seq_ids is None else np.asarray(seq_ids, np.int64)
        cache.reserve(ids, counts)          # the step's pages and lengths, once per kind of layer
        x = w["model.embed_tokens.weight"][np.concatenate(tokens)] * self.embed_scale   # (T, hidden)
        T, hq, hk, hd = x.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        for i in range(cfg.num_hidden_layers):
            p, layer = f"model.layers.{i}.", cache.layer(i)
            h = self.norm(x, p + "input_layernorm.weight")
            q = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(T, hq, hd)
            k = (h @ w[p + "self_attn.k_proj.weight"].T).reshape(T, hk, hd)
            v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(T, hk, hd)
            # k normed (Qwen3, Gemma 3) and rotated at each token's position as it is written; q normed and rotated at
            # its position as the attention reads it
            layer.append(k, v, ids, cu_seqlens=cu, positions=positions, **self.k_norm_args[i])
            o = layer.attend(q, seq_ids=ids, cu_seqlens=cu, q_positions=positions, **self.attn_args[i],
                             **self.q_norm_args[i])
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
        logits = self.norm(x if all_logits else x[cu[1:] - 1], "model.norm.weight") @ self.lm_head.T
        if cfg.final_logit_softcapping is not None:
            c = cfg.final_logit_softcapping
            logits = c * np.tanh(logits / c)
        return logits


def generate(decoder: Decoder, prompts: list, max_new_tokens: int, *, eos_token_id=None, sinks=None, window=None,
             return_logits=False, **cache_args):
    """Greedy decoding of several prompts (token lists of any lengths): one packed prefill, then one token per
    sequence per step. A sequence that emits ``eos_token_id`` stops (its cache entries are freed). With
    ``sinks``/``window`` the caches slide (StreamingLLM: the first ``sinks`` tokens and the last ``window``; not for
    a model with sliding-window layers, whose cache gives its pages back itself). ``cache_args`` go to
    ``Decoder.new_cache`` (``page_size``, ``kv_dtype``, ``backend``). Returns the new tokens of each prompt, and with
    ``return_logits`` also the logits (vocab,) each of them was picked from."""
    cache = decoder.new_cache(len(prompts), max(len(p) for p in prompts) + max_new_tokens, **cache_args)
    active = np.array([cache.add() for _ in prompts])   # the sequences still decoding
    logits = decoder.forward([list(p) for p in prompts], cache, active)
    tokens, picked = [[] for _ in prompts], [[] for _ in prompts]
    for step in range(max_new_tokens):
        nxt = np.argmax(logits, axis=-1)
        for b, t, row in zip(active, nxt, logits):
            tokens[b].append(int(t))
            picked[b].append(row)
        if eos_token_id is not None:
            done = nxt == eos_token_id
            cache.free(active[done])
            active, nxt = active[~done], nxt[~done]
        if step == max_new_tokens - 1 or active.size == 0:
            break
        if sinks is not None:
            cache.slide(sinks=sinks, window=window, seq_ids=active)
        logits = decoder.forward([[int(t)] for t in nxt], cache, active)
    return (tokens, picked) if return_logits else tokens


def main():
    """Greedy tokens of the three families with random weights (``python -m rotary.examples.decoder``)."""
    prompts = [[5, 17, 3, 42, 8], [7, 9, 11, 13, 15, 17, 19, 21, 23], [60, 2]]
    decoders = {}
    for family in ("llama", "qwen3", "gemma3"):
        cfg = Config.from_hf(hf_config(family))
        decoders[family] = decoder = Decoder(cfg, random_weights(cfg, seed=1))
        print(f"{family:7s}", generate(decoder, prompts, max_new_tokens=8))
        print(f"{'':7s}", generate(decoder, prompts, max_new_tokens=8, page_size=4, kv_dtype="int8"),
              "(paged, int8 entries)")
    print(f"{'':7s}", generate(decoders["llama"], prompts, max_new_tokens=8, sinks=2, window=4),
          "(llama, sliding cache: 2 sinks + 4)")


if __name__ == "__main__":
    main()
