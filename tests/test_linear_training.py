"""The training example (rotary/examples/linear_training.py, docs/linear_attention.md "Training a model"): a small
RoFormer-style linear-attention model learns the copy task in NumPy with rotary's forward and backward kernels, its
loss curve the one torch autograd gives through the reference path's torch operations from the same weights on the
same batches; one step's gradients against torch autograd directly."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from rotary.examples import linear_training as lt  # noqa: E402


def _torch_grads(params, tokens, targets, mask, cfg):
    """Loss and gradients of one batch by torch autograd through the reference path (independent of the backward
    primitive)."""
    import rotary
    from rotary.interop import torch_adapter

    leaves = {n: torch.tensor(p, dtype=torch.float64, requires_grad=True) for n, p in params.items()}
    B, T = tokens.shape
    H, d = cfg.heads, cfg.head_dim
    before, torch_adapter.OP_BACKWARD = torch_adapter.OP_BACKWARD, False
    try:
        h = leaves["E"][torch.as_tensor(tokens)]
        for layer in range(cfg.layers):
            q, k, v = ((h @ leaves[f"{n}{layer}"]).reshape(B, T, H, d) for n in ("Wq", "Wk", "Wv"))
            o = rotary.linear_attention(q, k, v, causal=True, spec=cfg.spec, seq_axis=1)
            h = h + o.reshape(B, T, H * d) @ leaves[f"Wo{layer}"]
        logits = h @ leaves["W_out"]
        nll = -torch.log_softmax(logits, -1).gather(-1, torch.as_tensor(targets)[..., None])[..., 0]
        m = torch.as_tensor(np.array(mask))
        loss = (nll * m).sum() / m.sum()
        loss.backward()
    finally:
        torch_adapter.OP_BACKWARD = before
    return loss.item(), {n: p.grad.numpy() for n, p in leaves.items()}


@pytest.mark.parametrize("backend", ["auto", "numpy"])
def test_one_step_gradients_match_torch_autograd(backend):
    cfg = lt.Config(backend=backend, batch=4, seed=3)
    params = lt.init_params(cfg)
    batch = next(lt.batches(cfg))
    loss, _, grads = lt.loss_and_grads(params, *batch, cfg)
    want_loss, want = _torch_grads(params, *batch, cfg)    # float64 of the float32 weights
    assert abs(loss - want_loss) <= 1e-5 * want_loss
    assert set(grads) == set(want)
    for name, g in grads.items():
        assert g.dtype == np.float32 and g.shape == params[name].shape
        err = np.abs(g - want[name]).max() / np.abs(want[name]).max()
        assert err <= 1e-4, (name, err)


def test_copy_task_is_learned_and_the_loss_curve_is_torch_autograds():
    cfg = lt.Config()
    losses, accuracy = lt.train(cfg)
    ref, ref_accuracy = lt.train_torch(cfg)
    assert losses.shape == ref.shape == (cfg.steps,)
    assert abs(losses[0] - np.log(cfg.vocab - 1)) < 0.5                  # chance level at the start
    assert losses[-20:].mean() < 0.15 and accuracy[-20:].mean() > 0.95    # learned
    # the same curve as torch autograd's, to float32 rounding (it grows slowly along 300 Adam steps)
    rel = np.abs(losses - ref) / ref
    assert rel[:100].max() < 1e-4 and rel.max() < 2e-3, (rel[:100].max(), rel.max())
