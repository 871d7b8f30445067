"""The backward of linear attention with RoPE (issue 45): the ``linear_attention_backward`` primitive of every
backend that has it, the frontend :func:`rotary.attn.linear_backward.linear_attention_backward`, torch autograd
through the custom op and JAX's ``custom_vjp``.

The oracle is independent of the library: the quadratic (T x T) form of the forward written here in plain torch
float64 (its own angles ``p * inv_freq``, its own pair indices, its own feature maps, decay as
``gamma^(t-s)`` on the T x T matrix, the state as ``gamma^(t+1) S0``), differentiated by torch.autograd;
gradients (dq, dk, dv, and at a carried state) of ``sum(o * grad_o) + sum(S_out * G_S) + sum(z_out * G_z)``
compared to 1e-9 of their largest entry in float64.
"""

import itertools

import numpy as np
import pytest

import rotary
from rotary import backends as _backends

torch = pytest.importorskip("torch")

BACKWARD_BACKENDS = [name for name, (ok, _) in rotary.available_backends().items()
                     if ok and hasattr(_backends.get(name), "linear_attention_backward") and name != "cupy"]
FEATURE_MAPS = ("elu", "relu", "identity")


# -- the oracle --------------------------------------------------------------------------------------------------
def _phi(x, name):
    if name == "elu":
        return torch.where(x > 0, x + 1.0, torch.exp(torch.clamp(x, max=0.0)))
    if name == "relu":
        return torch.relu(x)
    return x


def _rotate(x, angles, rotary_dim, layout, scale):
    """Pairs (i, i + r/2) or (2i, 2i+1) of x's first rotary_dim features turned by ``angles`` (.., half), times
    ``scale``; the other features unchanged."""
    half = rotary_dim // 2
    i = torch.arange(half)
    ia, ib = (i, i + half) if layout == "half" else (2 * i, 2 * i + 1)
    c, s = scale * torch.cos(angles), scale * torch.sin(angles)
    xa, xb = x[..., ia], x[..., ib]
    y = x.clone()
    y[..., ia] = xa * c - xb * s
    y[..., ib] = xb * c + xa * s
    return y


def oracle(q, k, v, S0, z0, positions, inv_freq, *, layout, scale, causal, feature_map, eps, decay, normalize):
    """(o, S_out, z_out) of linear attention with RoPE as T x T matrices, torch float64, differentiable.

    q (B, T, H, m), k (B, T, Hk, m), v (B, T, Hk, dv), S0 (B, Hk, m, dv), z0 (B, Hk, m), positions (Bp, T)
    int, inv_freq (r/2,), decay None or (B, Hk). ``o_t = sum_s D_ts <R_t a_t, R_s b_s> v_s / (sum_s D_ts a_t .
    b_s + eps)`` plus the state's terms, D_ts = gamma^(t-s) for s <= t (causal) or 1."""
    B, T, H, m = q.shape
    Hk = k.shape[2]
    G = H // Hk
    angles = (positions[..., None].double() * inv_freq)[:, :, None, :]             # (Bp, T, 1, half)
    a, b = _phi(q, feature_map), _phi(k, feature_map)
    ah = _rotate(a, angles, 2 * inv_freq.shape[0], layout, scale)
    bh = _rotate(b, angles, 2 * inv_freq.shape[0], layout, scale)
    gamma = torch.ones(B, Hk, dtype=torch.float64) if decay is None else decay
    t = torch.arange(T)
    lag = (t[:, None] - t[None, :]).double()
    if causal:
        D = torch.where(lag >= 0, gamma[..., None, None] ** lag.clamp(min=0), torch.zeros((), dtype=torch.float64))
        inter = gamma[..., None] ** (t + 1).double()                              # gamma^(t+1): the state's weight
        keep = gamma ** T
    else:
        D = torch.ones(B, Hk, T, T, dtype=torch.float64)
        inter = torch.ones(B, Hk, T, dtype=torch.float64)
        keep = torch.ones_like(gamma)
    tail = gamma[..., None] ** (T - 1 - t).double() if causal else torch.ones(B, Hk, T, dtype=torch.float64)

    def heads(x):                                                                  # per k/v head -> per q head
        return x.repeat_interleave(G, dim=1)

    bhq, bq, vq = (x.repeat_interleave(G, dim=2) for x in (bh, b, v))
    num = torch.einsum("bhts,bshd->bthd", torch.einsum("bthm,bshm->bhts", ah, bhq) * heads(D), vq)
    num = num + torch.einsum("bthm,bhmd->bthd", ah, heads(S0)) * heads(inter).permute(0, 2, 1)[..., None]
    S_out = S0 * keep[..., None, None] + torch.einsum("bshm,bshd,bhs->bhmd", bh, v, tail)
    z_out = z0 * keep[..., None] + torch.einsum("bshm,bhs->bhm", b, tail)
    if not normalize:
        return num, S_out, z_out
    den = (torch.einsum("bthm,bshm->bhts", a, bq) * heads(D)).sum(-1).permute(0, 2, 1)
    den = den + torch.einsum("bthm,bhm->bth", a, heads(z0)) * heads(inter).permute(0, 2, 1)
    return num / (den + eps)[..., None], S_out, z_out


def oracle_grads(q, k, v, S0, z0, positions, inv_freq, grad_o, grad_state, **kw):
    """(dq, dk, dv, dS0, dz0) of the oracle by torch.autograd, float64 NumPy."""
    leaves = [torch.tensor(np.asarray(x, np.float64), requires_grad=True) for x in (q, k, v, S0, z0)]
    o, S_out, z_out = oracle(*leaves, torch.as_tensor(positions), torch.as_tensor(inv_freq, dtype=torch.float64),
                             decay=None if kw.get("decay") is None else torch.as_tensor(kw["decay"]),
                             **{n: w for n, w in kw.items() if n != "decay"})
    loss = (o * torch.as_tensor(grad_o, dtype=torch.float64)).sum()
    if grad_state is not None:
        loss = loss + (S_out * torch.as_tensor(grad_state[0])).sum() + (z_out * torch.as_tensor(grad_state[1])).sum()
    loss.backward()
    return tuple(np.zeros(x.shape) if x.grad is None else x.grad.numpy() for x in leaves)


def rel_err(actual, desired):
    actual, desired = np.asarray(actual, np.float64), np.asarray(desired, np.float64)
    assert actual.shape == desired.shape, (actual.shape, desired.shape)
    if desired.size == 0:
        return 0.0
    return float(np.abs(actual - desired).max() / max(np.abs(desired).max(), 1e-300))


# -- the primitive -------------------------------------------------------------------------------------------------
#: (causal, normalize, layout, feature_map) all 24 ways; the other options cycle through their values so that each
#: value meets every causal / normalize pair: GQA groups, decay, partial rotary, state in, gradient on the state
#: out, (T, chunk) with chunks that divide T and that do not, per-batch positions. One token always comes with a
#: state: without one, o_0 = scale^2 (a.b) v / (a.b + eps) hardly depends on q (dq ~ eps, all cancellation).
_GRID = list(itertools.product((True, False), (True, False), ("half", "interleaved"), FEATURE_MAPS))
_T_CHUNK = [(7, 3), (8, 4), (9, 16), (12, 5), (1, 4), (10, 1)]


def _case(i):
    causal, normalize, layout, fm = _GRID[i]
    return dict(causal=causal, normalize=normalize, layout=layout, feature_map=fm, groups=(1, 2, 3)[i % 3],
                decay=causal and i % 4 != 3, rotary_dim=(8, 4, 6)[(i // 2) % 3],
                state=i % 4 != 2 or _T_CHUNK[i % len(_T_CHUNK)][0] == 1, grad_state=i % 6 not in (2, 3),
                T_chunk=_T_CHUNK[i % len(_T_CHUNK)], batch_rows=i % 2 == 1)


def make_inputs(rng, *, B=2, T=7, Hk=2, groups=1, m=8, dv=5, rotary_dim=8, layout="half", decay=False, state=True,
                grad_state=True, batch_rows=False, base=100.0, scale=1.25, start=3, dtype=np.float64):
    """Inputs of the primitive with tables made here from float64 angles (positions start.. per batch row)."""
    H = Hk * groups
    q = rng.standard_normal((B, T, H, m))
    k = rng.standard_normal((B, T, Hk, m))
    v = rng.standard_normal((B, T, Hk, dv))
    go = rng.standard_normal((B, T, H, dv))
    inv_freq = 1.0 / base ** (np.arange(rotary_dim // 2) * 2.0 / rotary_dim)
    positions = start + np.arange(T)[None] + (np.arange(B)[:, None] * 5 if batch_rows else 0)
    angles = positions.reshape(-1)[:, None] * inv_freq
    cos, sin = scale * np.cos(angles), scale * np.sin(angles)
    rows = np.arange(positions.size).reshape(positions.shape)
    S0 = rng.standard_normal((B, Hk, m, dv)) if state else None
    z0 = np.abs(rng.standard_normal((B, Hk, m))) + 0.5 if state else None
    gs = (rng.standard_normal((B, Hk, m, dv)), rng.standard_normal((B, Hk, m))) if grad_state else None
    d = rng.uniform(0.3, 1.0, (B, Hk)) if decay else None
    cast = (lambda x: None if x is None else x.astype(dtype))
    return dict(q=cast(q), k=cast(k), v=cast(v), grad_o=cast(go), cos=cast(cos), sin=cast(sin), rows=rows,
                state=None if S0 is None else (S0, z0), grad_state=gs, decay=d, positions=positions,
                inv_freq=inv_freq, scale=scale)


def check_primitive(backend, case, dtype=np.float64, seed=0):
    rng = np.random.default_rng(seed)
    T, chunk = case["T_chunk"]
    x = make_inputs(rng, T=T, groups=case["groups"], rotary_dim=case["rotary_dim"], layout=case["layout"],
                    decay=case["decay"], state=case["state"], grad_state=case["grad_state"],
                    batch_rows=case["batch_rows"], dtype=dtype)
    module = _backends.get(backend)
    kw = dict(rotary_dim=case["rotary_dim"], layout=case["layout"], causal=case["causal"],
              feature_map=case["feature_map"], eps=1e-6, chunk=chunk, decay=x["decay"], normalize=case["normalize"])
    copies = {n: np.copy(x[n]) for n in ("q", "k", "v", "grad_o")}
    dq, dk, dv, dstate = module.linear_attention_backward(x["q"], x["k"], x["v"], x["cos"], x["sin"], x["rows"],
                                                          x["grad_o"], state=x["state"], grad_state=x["grad_state"],
                                                          **kw)
    for n, c in copies.items():
        assert np.array_equal(x[n], c), f"{n} was written"
    assert dq.dtype == dk.dtype == dv.dtype == np.dtype(dtype)
    B, _, Hk, m = x["k"].shape
    zeros = (np.zeros((B, Hk, m, x["v"].shape[-1])), np.zeros((B, Hk, m)))
    S0, z0 = x["state"] if x["state"] is not None else zeros
    want = oracle_grads(x["q"], x["k"], x["v"], S0, z0, x["positions"], x["inv_freq"], x["grad_o"], x["grad_state"],
                        layout=case["layout"], scale=x["scale"], causal=case["causal"],
                        feature_map=case["feature_map"], eps=1e-6, decay=x["decay"], normalize=case["normalize"])
    got = (dq, dk, dv) + (dstate if x["state"] is not None else ())
    if x["state"] is None:
        assert dstate is None
    tol = 1e-9 if dtype == np.float64 else 5e-5
    for name, a, b in zip(("dq", "dk", "dv", "dS", "dz"), got, want):
        assert rel_err(a, b) <= tol, (name, rel_err(a, b), case)


@pytest.mark.parametrize("backend", BACKWARD_BACKENDS)
@pytest.mark.parametrize("i", range(len(_GRID)), ids=lambda i: "-".join(str(v) for v in _GRID[i]))
def test_primitive_matches_autograd_of_the_quadratic_oracle(backend, i):
    check_primitive(backend, _case(i), seed=i)


@pytest.mark.parametrize("backend", BACKWARD_BACKENDS)
@pytest.mark.parametrize("i", [0, 5, 13, 22])
def test_primitive_float32(backend, i):
    check_primitive(backend, _case(i), dtype=np.float32, seed=100 + i)


def test_grid_covers_every_option():
    cases = [_case(i) for i in range(len(_GRID))]
    for causal, normalize in itertools.product((True, False), (True, False)):
        sub = [c for c in cases if c["causal"] == causal and c["normalize"] == normalize]
        for key in ("groups", "rotary_dim", "state", "grad_state", "batch_rows") + (("decay",) if causal else ()):
            values = {c[key] for c in sub}
            assert len(values) > 1, (causal, normalize, key, values)
    assert {c["T_chunk"][0] % c["T_chunk"][1] == 0 for c in cases} == {True, False}
    assert any(c["T_chunk"][1] > c["T_chunk"][0] for c in cases)


@pytest.mark.parametrize("backend", BACKWARD_BACKENDS)
@pytest.mark.parametrize("causal", [True, False])
def test_primitive_empty_sequence_passes_the_state_gradient_through(backend, causal):
    rng = np.random.default_rng(7)
    x = make_inputs(rng, T=0, decay=causal)
    module = _backends.get(backend)
    dq, dk, dv, (dS, dz) = module.linear_attention_backward(
        x["q"], x["k"], x["v"], x["cos"], x["sin"], x["rows"], x["grad_o"], rotary_dim=8, layout="half",
        causal=causal, feature_map="elu", eps=1e-6, chunk=4, state=x["state"], decay=x["decay"],
        grad_state=x["grad_state"])
    assert dq.shape == x["q"].shape and dk.shape == x["k"].shape and dv.shape == x["v"].shape
    np.testing.assert_array_equal(dS, x["grad_state"][0])
    np.testing.assert_array_equal(dz, x["grad_state"][1])


def test_primitive_errors():
    rng = np.random.default_rng(1)
    x = make_inputs(rng, T=4)
    module = _backends.get("numpy")
    kw = dict(rotary_dim=8, layout="half", feature_map="elu", eps=1e-6, chunk=2, state=None)
    with pytest.raises(ValueError, match="decay"):
        module.linear_attention_backward(x["q"], x["k"], x["v"], x["cos"], x["sin"], x["rows"], x["grad_o"],
                                         causal=False, decay=np.full((2, 2), 0.5), **kw)
    with pytest.raises(ValueError, match="grad_o"):
        module.linear_attention_backward(x["q"], x["k"], x["v"], x["cos"], x["sin"], x["rows"], x["grad_o"][:, :3],
                                         causal=True, **kw)
    with pytest.raises(ValueError, match="feature_map"):
        module.linear_attention_backward(x["q"], x["k"], x["v"], x["cos"], x["sin"], x["rows"], x["grad_o"],
                                         causal=True, **dict(kw, feature_map="softmax"))
