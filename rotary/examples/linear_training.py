"""Training a small RoFormer-style linear-attention model in NumPy, with rotary's forward and backward kernels.

The model: token embeddings, ``layers`` residual blocks of causal linear attention with RoPE (RoFormer eq. 19:
elu + 1 features, the rotation on q and k in the numerator only), and a linear read-out to the vocabulary::

    h_0 = E[x]      h_(l+1) = h_l + LA(h_l Wq_l, h_l Wk_l, h_l Wv_l) Wo_l      logits = h_L W_out

The task: copy. A sequence of ``n = seq // 2`` random tokens (1 .. vocab-1), a separator 0, then the same tokens
again; from the separator on, each position predicts the token ``n`` places back (a fixed relative offset, the
kind of position RoPE's relative rotation expresses). The loss is the mean cross-entropy over those positions.

:func:`train` runs it in NumPy: the attention's forward is :func:`rotary.linear_attention`, its backward
:func:`rotary.attn.linear_backward.linear_attention_backward` (the Numba kernels when numba is installed, else the
NumPy reference), every other gradient is written out here, and Adam updates the float32 weights.
:func:`train_torch` trains the same model from the same initial weights on the same batches with torch autograd
through the reference path's torch operations (``rotary.interop.torch_adapter.OP_BACKWARD = False``: no rotary
backward involved) and torch's Adam; the two loss curves agree to float32 rounding (``tests/test_linear_training.py``).

Run ``python -m rotary.examples.linear_training`` for both curves side by side.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import rotary
from rotary.attn.linear_backward import linear_attention_backward


@dataclass(frozen=True)
class Config:
    """The model, the task and the optimizer."""

    vocab: int = 16          # token 0 is the separator
    width: int = 64          # model width D
    heads: int = 4
    head_dim: int = 16
    layers: int = 2
    seq: int = 32            # tokens per sequence: seq // 2 to copy, the separator, the copy
    batch: int = 32
    steps: int = 300
    lr: float = 0.01         # Adam (betas 0.9, 0.999, eps 1e-8)
    base: float = 100.0      # RoPE base of the head_dim-wide rotation
    seed: int = 0
    backend: str = "auto"    # of the attention's forward and backward (train only)

    @property
    def spec(self):
        return rotary.RopeSpec(self.head_dim, base=self.base)


def init_params(cfg: Config) -> dict:
    """Float32 weights: embeddings N(0, 0.25), projections N(0, 1 / fan_in)."""
    rng = np.random.default_rng(cfg.seed)
    D, HD = cfg.width, cfg.heads * cfg.head_dim

    def normal(shape, std):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    params = {"E": normal((cfg.vocab, D), 0.5), "W_out": normal((D, cfg.vocab), D ** -0.5)}
    for layer in range(cfg.layers):
        for name in ("Wq", "Wk", "Wv"):
            params[f"{name}{layer}"] = normal((D, HD), D ** -0.5)
        params[f"Wo{layer}"] = normal((HD, D), HD ** -0.5)
    return params


def batches(cfg: Config):
    """Copy-task batches forever: (tokens, targets, mask), int64 (batch, seq) and a bool mask of the positions
    scored (from the separator on)."""
    rng = np.random.default_rng(cfg.seed + 1)
    n = cfg.seq // 2
    mask = np.broadcast_to(np.arange(cfg.seq) >= n, (cfg.batch, cfg.seq))
    while True:
        x = rng.integers(1, cfg.vocab, (cfg.batch, n))
        tokens = np.concatenate([x, np.zeros((cfg.batch, 1), np.int64), x], 1)[:, :cfg.seq]
        targets = np.concatenate([np.zeros((cfg.batch, n), np.int64), x], 1)[:, :cfg.seq]
        yield tokens, targets, mask


def loss_and_grads(params: dict, tokens, targets, mask, cfg: Config):
    """(loss, accuracy, grads) of one batch: forward with :func:`rotary.linear_attention` (which keeps its chunk
    states for the backward where the backend can: ``save_for_backward=True``), backward by hand with
    :func:`~rotary.attn.linear_backward.linear_attention_backward` for the attention (``saved=``: no second sweep
    over k and v)."""
    B, T = tokens.shape
    H, d = cfg.heads, cfg.head_dim
    kw = dict(causal=True, spec=cfg.spec, seq_axis=1, backend=cfg.backend)
    h = params["E"][tokens]                                             # (B, T, D)
    saved = []
    for layer in range(cfg.layers):
        q, k, v = ((h @ params[f"{n}{layer}"]).reshape(B, T, H, d) for n in ("Wq", "Wk", "Wv"))
        o, states = rotary.linear_attention(q, k, v, save_for_backward=True, **kw)
        o = o.reshape(B, T, H * d)
        saved.append((h, q, k, v, o, states))
        h = h + o @ params[f"Wo{layer}"]
    logits = h @ params["W_out"]                                        # (B, T, V)
    shifted = logits - logits.max(-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    count = int(mask.sum())
    nll = -np.take_along_axis(logp, targets[..., None], -1)[..., 0]
    loss = float((nll * mask).sum() / count)
    accuracy = float(((logits.argmax(-1) == targets) & mask).sum() / count)

    grads = {}
    dlogits = np.exp(logp)                                              # softmax - onehot, over the scored positions
    np.put_along_axis(dlogits, targets[..., None], np.take_along_axis(dlogits, targets[..., None], -1) - 1, -1)
    dlogits *= (mask / count)[..., None].astype(np.float32)
    grads["W_out"] = np.einsum("btd,btv->dv", h, dlogits)
    dh = dlogits @ params["W_out"].T
    for layer in reversed(range(cfg.layers)):
        h_in, q, k, v, o, states = saved[layer]
        grads[f"Wo{layer}"] = np.einsum("btj,btd->jd", o, dh)
        do = (dh @ params[f"Wo{layer}"].T).reshape(B, T, H, d)
        dq, dk, dv, _ = linear_attention_backward(q, k, v, do, saved=states, **kw)
        for name, g in (("Wq", dq), ("Wk", dk), ("Wv", dv)):
            g = g.reshape(B, T, H * d)
            grads[f"{name}{layer}"] = np.einsum("btd,btj->dj", h_in, g)
            dh = dh + g @ params[f"{name}{layer}"].T
    grads["E"] = np.zeros_like(params["E"])
    np.add.at(grads["E"], tokens, dh)
    return loss, accuracy, grads


class Adam:
    """Adam (Kingma & Ba) with bias correction, as torch.optim.Adam computes it (float32 state)."""

    def __init__(self, params: dict, lr: float, betas=(0.9, 0.999), eps=1e-8):
        self.lr, self.betas, self.eps, self.t = lr, betas, eps, 0
        self.m = {n: np.zeros_like(p) for n, p in params.items()}
        self.v = {n: np.zeros_like(p) for n, p in params.items()}

    def step(self, params: dict, grads: dict):
        self.t += 1
        b1, b2 = self.betas
        c1, c2 = 1 - b1 ** self.t, 1 - b2 ** self.t
        for n, g in grads.items():
            self.m[n] = b1 * self.m[n] + (1 - b1) * g
            self.v[n] = b2 * self.v[n] + (1 - b2) * g * g
            denom = np.sqrt(self.v[n]) / np.float32(np.sqrt(c2)) + np.float32(self.eps)
            params[n] -= np.float32(self.lr / c1) * self.m[n] / denom


def train(cfg: Config = Config(), params: dict | None = None):
    """Train in NumPy with rotary's kernels; returns (losses, accuracies) per step (and updates ``params`` in place
    when given: from :func:`init_params` otherwise)."""
    params = init_params(cfg) if params is None else params
    opt = Adam(params, cfg.lr)
    losses, accuracies = [], []
    data = batches(cfg)
    for _ in range(cfg.steps):
        loss, accuracy, grads = loss_and_grads(params, *next(data), cfg)
        opt.step(params, grads)
        losses.append(loss)
        accuracies.append(accuracy)
    return np.array(losses), np.array(accuracies)


def train_torch(cfg: Config = Config()):
    """The same model, initial weights and batches, trained with torch autograd through the reference path's torch
    operations and ``torch.optim.Adam``; returns (losses, accuracies) per step."""
    import torch

    from ..interop import torch_adapter

    params = {n: torch.tensor(p, requires_grad=True) for n, p in init_params(cfg).items()}
    opt = torch.optim.Adam(params.values(), lr=cfg.lr)
    H, d = cfg.heads, cfg.head_dim
    spec = cfg.spec
    losses, accuracies = [], []
    data = batches(cfg)
    before, torch_adapter.OP_BACKWARD = torch_adapter.OP_BACKWARD, False   # torch differentiates torch operations
    try:
        for _ in range(cfg.steps):
            tokens, targets, mask = (torch.as_tensor(np.array(a)) for a in next(data))
            B, T = tokens.shape
            h = params["E"][tokens]
            for layer in range(cfg.layers):
                q, k, v = ((h @ params[f"{n}{layer}"]).reshape(B, T, H, d) for n in ("Wq", "Wk", "Wv"))
                o = rotary.linear_attention(q, k, v, causal=True, spec=spec, seq_axis=1)
                h = h + o.reshape(B, T, H * d) @ params[f"Wo{layer}"]
            logits = h @ params["W_out"]
            nll = -torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
            loss = (nll * mask).sum() / mask.sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            accuracies.append((((logits.argmax(-1) == targets) & mask).sum() / mask.sum()).item())
    finally:
        torch_adapter.OP_BACKWARD = before
    return np.array(losses), np.array(accuracies)


def main():
    import time

    cfg = Config()
    t0 = time.perf_counter()
    ours, acc = train(cfg)
    t1 = time.perf_counter()
    print(f"NumPy + rotary ({cfg.backend}): {cfg.steps} steps in {t1 - t0:.1f} s")
    try:
        ref, ref_acc = train_torch(cfg)
        print(f"torch autograd: {cfg.steps} steps in {time.perf_counter() - t1:.1f} s")
    except ImportError:
        ref = ref_acc = None
    print("step   loss (rotary)   loss (torch)   accuracy")
    for s in list(range(0, cfg.steps, max(1, cfg.steps // 10))) + [cfg.steps - 1]:
        other = "" if ref is None else f"{ref[s]:.5f}"
        print(f"{s:4d}   {ours[s]:.5f}         {other:13s}  {acc[s]:.3f}")


if __name__ == "__main__":
    main()
