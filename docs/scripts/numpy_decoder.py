"""A Llama-style decoder in NumPy + rotary: greedy decoding with a KV cache, a packed (varlen) prefill of
several prompts in one pass, and a sliding cache with attention sinks whose keys are re-rotated.

No torch: the weights are a dict of NumPy arrays under Hugging Face's names (``random_weights`` makes
them; ``tests/test_decoding_hf.py`` copies them from a random-weight ``LlamaForCausalLM`` /
``MistralForCausalLM`` and checks the logits of every step against HF's own DynamicCache loop).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import rotary


@dataclass
class Config:
    vocab_size: int = 128
    hidden_size: int = 64
    intermediate_size: int = 96
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    sliding_window: int | None = None   # Mistral: each query sees itself and the window-1 keys before it


def random_weights(cfg: Config, seed: int = 0, dtype=np.float32) -> dict:
    """Random weights under HF Llama's parameter names."""
    rng = np.random.default_rng(seed)
    d, hd = cfg.hidden_size, cfg.head_dim

    def w(*shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(dtype)

    weights = {"model.embed_tokens.weight": w(cfg.vocab_size, d), "model.norm.weight": np.ones(d, dtype),
               "lm_head.weight": w(cfg.vocab_size, d)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        weights.update({
            p + "input_layernorm.weight": np.ones(d, dtype), p + "post_attention_layernorm.weight": np.ones(d, dtype),
            p + "self_attn.q_proj.weight": w(cfg.num_attention_heads * hd, d),
            p + "self_attn.k_proj.weight": w(cfg.num_key_value_heads * hd, d),
            p + "self_attn.v_proj.weight": w(cfg.num_key_value_heads * hd, d),
            p + "self_attn.o_proj.weight": w(d, cfg.num_attention_heads * hd),
            p + "mlp.gate_proj.weight": w(cfg.intermediate_size, d),
            p + "mlp.up_proj.weight": w(cfg.intermediate_size, d),
            p + "mlp.down_proj.weight": w(d, cfg.intermediate_size),
        })
    return weights


def rms_norm(x, weight, eps):
    x64 = x.astype(np.float32) if x.dtype != np.float64 else x
    return (x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)).astype(x.dtype) * weight


def silu(x):
    return x / (1.0 + np.exp(-x))


class Sequence:
    """One sequence's KV cache: per layer rotated keys and values (L, heads, head_dim), and the position
    its next token gets."""

    def __init__(self, n_layers):
        self.keys = [None] * n_layers
        self.values = [None] * n_layers
        self.next_position = 0

    def __len__(self):
        return 0 if self.keys[0] is None else self.keys[0].shape[0]


class Decoder:
    def __init__(self, cfg: Config, weights: dict, backend: str = "auto"):
        self.cfg, self.w, self.backend = cfg, weights, backend
        self.spec = rotary.RopeSpec(cfg.head_dim, base=cfg.rope_theta)
        self.rope = rotary.Rope(self.spec, backend=backend, dtype=weights["lm_head.weight"].dtype, seq_axis=-2)

    def new_sequence(self) -> Sequence:
        return Sequence(self.cfg.num_hidden_layers)

    def forward(self, tokens, seqs: list) -> np.ndarray:
        """Run the new ``tokens`` of each sequence (a list of int lists, one per entry of ``seqs``) as one
        packed batch; appends to the caches; returns the logits of each sequence's last new token."""
        cfg, w = self.cfg, self.w
        lengths = np.array([len(t) for t in tokens])
        cu = np.concatenate([[0], np.cumsum(lengths)])
        offsets = np.array([s.next_position for s in seqs])
        positions = np.concatenate([o + np.arange(n) for o, n in zip(offsets, lengths)])
        x = w["model.embed_tokens.weight"][np.concatenate(tokens)]          # (T, hidden)
        T, hd = x.shape[0], cfg.head_dim
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            h = rms_norm(x, w[p + "input_layernorm.weight"], cfg.rms_norm_eps)
            q = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(T, cfg.num_attention_heads, hd)
            k = (h @ w[p + "self_attn.k_proj.weight"].T).reshape(T, cfg.num_key_value_heads, hd)
            v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(T, cfg.num_key_value_heads, hd)
            q, k = self.rope(q, k, positions, seq_axis=0)                  # packed: per-token positions
            for n, s in enumerate(seqs):                                    # the cache keeps rotated keys
                a, b = cu[n], cu[n + 1]
                s.keys[i] = k[a:b] if s.keys[i] is None else np.concatenate([s.keys[i], k[a:b]])
                s.values[i] = v[a:b] if s.values[i] is None else np.concatenate([s.values[i], v[a:b]])
            cu_k = np.concatenate([[0], np.cumsum([len(s.keys[i]) for s in seqs])])
            keys = np.concatenate([s.keys[i] for s in seqs])
            values = np.concatenate([s.values[i] for s in seqs])
            o = rotary.attention(q, keys, values, causal=True, rope=False, seq_axis=0, cu_seqlens=cu,
                                 cu_seqlens_k=cu_k, window=cfg.sliding_window)   # each sequence alone
            x = x + o.reshape(T, -1) @ w[p + "self_attn.o_proj.weight"].T
            h = rms_norm(x, w[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
            mlp = silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)
            x = x + mlp @ w[p + "mlp.down_proj.weight"].T
        for s, n in zip(seqs, lengths):
            s.next_position += int(n)
        last = rms_norm(x[cu[1:] - 1], w["model.norm.weight"], cfg.rms_norm_eps)
        return last @ w["lm_head.weight"].T

    def evict(self, seq: Sequence, sinks: int, window: int) -> None:
        """Sliding cache with attention sinks (StreamingLLM): keep the first ``sinks`` tokens and the last
        ``window``; the kept recent keys move to the positions right after the sinks, in one
        re-rotation per layer (no unrotated copy is kept), and the next token continues from there."""
        n = len(seq)
        if n <= sinks + window:
            return
        old = np.arange(n - window, n)
        new = np.arange(sinks, sinks + window)
        for i in range(self.cfg.num_hidden_layers):
            recent = rotary.rerotate(seq.keys[i][n - window:], old, new, spec=self.spec, seq_axis=0,
                                     backend=self.backend)
            seq.keys[i] = np.concatenate([seq.keys[i][:sinks], recent])
            seq.values[i] = np.concatenate([seq.values[i][:sinks], seq.values[i][n - window:]])
        seq.next_position = sinks + window


def greedy(decoder: Decoder, prompts: list, steps: int, *, sinks: int | None = None, window: int | None = None):
    """Greedy decoding of several prompts: one packed prefill, then one token per sequence per step
    (also packed). With ``sinks``/``window`` the caches slide. Returns the generated token lists."""
    seqs = [decoder.new_sequence() for _ in prompts]
    logits = decoder.forward([list(p) for p in prompts], seqs)
    out = [[] for _ in prompts]
    for _ in range(steps):
        nxt = [int(t) for t in np.argmax(logits, axis=-1)]
        for o, t in zip(out, nxt):
            o.append(t)
        if sinks is not None:
            for s in seqs:
                decoder.evict(s, sinks, window)
        logits = decoder.forward([[t] for t in nxt], seqs)
    return out


if __name__ == "__main__":
    cfg = Config()
    dec = Decoder(cfg, random_weights(cfg))
    print(greedy(dec, [[1, 2, 3, 4, 5], [7, 8]], steps=8))
    print(greedy(dec, [[1, 2, 3, 4, 5], [7, 8]], steps=8, sinks=2, window=4))
