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


def _rotate(x, angles, rotary_dim, layout, scale, offset=0):
    """Pairs (i, i + r/2) or (2i, 2i+1) of x's features offset .. offset + rotary_dim turned by ``angles``
    (.., half), times ``scale``; the other features unchanged."""
    half = rotary_dim // 2
    i = torch.arange(half)
    ia, ib = (i + offset, i + half + offset) if layout == "half" else (2 * i + offset, 2 * i + 1 + offset)
    c, s = scale * torch.cos(angles), scale * torch.sin(angles)
    xa, xb = x[..., ia], x[..., ib]
    y = x.clone()
    y[..., ia] = xa * c - xb * s
    y[..., ib] = xb * c + xa * s
    return y


def oracle(q, k, v, S0, z0, positions, inv_freq, *, layout, scale, causal, feature_map, eps, decay, normalize,
           offset=0):
    """(o, S_out, z_out) of linear attention with RoPE as T x T matrices, torch float64, differentiable.

    q (B, T, H, m), k (B, T, Hk, m), v (B, T, Hk, dv), S0 (B, Hk, m, dv), z0 (B, Hk, m), positions (Bp, T)
    int, inv_freq (r/2,), decay None or (B, Hk). ``o_t = sum_s D_ts <R_t a_t, R_s b_s> v_s / (sum_s D_ts a_t .
    b_s + eps)`` plus the state's terms, D_ts = gamma^(t-s) for s <= t (causal) or 1."""
    B, T, H, m = q.shape
    Hk = k.shape[2]
    G = H // Hk
    angles = (positions[..., None].double() * inv_freq)[:, :, None, :]             # (Bp, T, 1, half)
    a, b = _phi(q, feature_map), _phi(k, feature_map)
    ah = _rotate(a, angles, 2 * inv_freq.shape[0], layout, scale, offset)
    bh = _rotate(b, angles, 2 * inv_freq.shape[0], layout, scale, offset)
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


# -- the frontend ----------------------------------------------------------------------------------------------------
from rotary.attn.linear_backward import linear_attention_backward  # noqa: E402


def _spec_oracle_kw(spec, **kw):
    return dict(layout=spec.layout, scale=spec.attention_scaling, offset=spec.rotary_offset, **kw)


def test_frontend_bshd_gqa_decay_state_continues():
    """(batch, seq, heads, d), GQA 4/2, per-head decay, the state of an earlier call (positions from its
    next_position) and a gradient on the state out."""
    rng = np.random.default_rng(11)
    B, T, H, Hk, m, dv = 2, 9, 4, 2, 8, 6
    spec = rotary.RopeSpec(m, base=50.0)
    gamma = np.array([0.8, 0.95])
    q0, k0, v0 = (rng.standard_normal(s) for s in ((B, 4, H, m), (B, 4, Hk, m), (B, 4, Hk, dv)))
    _, st = rotary.linear_attention(q0, k0, v0, causal=True, spec=spec, seq_axis=1, decay=gamma, return_state=True,
                                    backend="numpy")
    q, k, v = rng.standard_normal((B, T, H, m)), rng.standard_normal((B, T, Hk, m)), rng.standard_normal((B, T, Hk, dv))
    go = rng.standard_normal((B, T, H, dv))
    gs = (rng.standard_normal((B, Hk, m, dv)), rng.standard_normal((B, Hk, m)))
    kw = dict(causal=True, spec=spec, seq_axis=1, decay=gamma, state=st, chunk=4)
    dq, dk, dv_, (dS, dz) = linear_attention_backward(q, k, v, go, grad_state=gs, **kw)
    want = oracle_grads(q, k, v, st.S, st.z, 4 + np.arange(T)[None], spec.inv_freq(), go, gs,
                        **_spec_oracle_kw(spec, causal=True, feature_map="elu", eps=1e-6,
                                          decay=np.broadcast_to(gamma, (B, Hk)).copy(), normalize=True))
    for name, a, b in zip(("dq", "dk", "dv", "dS", "dz"), (dq, dk, dv_, dS, dz), want):
        assert rel_err(a, b) <= 1e-9, (name, rel_err(a, b))


def test_frontend_bhsd_noncausal_unnormalized_relu_rotary_offset_per_batch_positions():
    rng = np.random.default_rng(12)
    B, T, H, Hk, m, dv = 2, 7, 3, 1, 10, 4
    spec = rotary.RopeSpec(m, base=30.0, rotary_dim=6, rotary_offset=2, layout="interleaved")
    q, k, v = rng.standard_normal((B, H, T, m)), rng.standard_normal((B, Hk, T, m)), rng.standard_normal((B, Hk, T, dv))
    go = rng.standard_normal((B, H, T, dv))
    pos = np.stack([np.arange(T), 10 + np.arange(T)])
    dq, dk, dv_, dstate = linear_attention_backward(q, k, v, go, pos, causal=False, spec=spec, seq_axis=-2,
                                                    feature_map="relu", normalize=False, chunk=3)
    assert dstate is None
    t = lambda x: np.moveaxis(x, 1, 2)   # noqa: E731  (B, H, T, .) <-> (B, T, H, .)
    want = oracle_grads(t(q), t(k), t(v), np.zeros((B, Hk, m, dv)), np.zeros((B, Hk, m)), pos, spec.inv_freq(),
                        t(go), None, **_spec_oracle_kw(spec, causal=False, feature_map="relu", eps=1e-6, decay=None,
                                                       normalize=False))
    for name, a, b in zip(("dq", "dk", "dv"), (dq, dk, dv_), want):
        assert rel_err(a, t(b)) <= 1e-9, (name, rel_err(a, t(b)))


def test_frontend_gqa_on_a_middle_axis_with_a_state():
    """q (B, T, 4, 2, m), k (B, T, 2, 2, m): GQA on axis 2, not the innermost head axis (the state's axes are
    reordered for the backend and back)."""
    rng = np.random.default_rng(13)
    B, T, m, dv = 2, 6, 8, 3
    spec = rotary.RopeSpec(m, base=20.0, layout="interleaved")
    q, k, v = (rng.standard_normal(s) for s in ((B, T, 4, 2, m), (B, T, 2, 2, m), (B, T, 2, 2, dv)))
    _, st = rotary.linear_attention(q[:, :2], k[:, :2], v[:, :2], causal=True, spec=spec, seq_axis=1,
                                    return_state=True, backend="numpy")
    go = rng.standard_normal((B, T, 4, 2, dv))
    gs = (rng.standard_normal(st.S.shape), rng.standard_normal(st.z.shape))
    dq, dk, dv_, (dS, dz) = linear_attention_backward(q, k, v, go, causal=True, spec=spec, seq_axis=1, state=st,
                                                      grad_state=gs, chunk=4)
    flat = lambda x: np.moveaxis(x, 3, 2).reshape(B, T, -1, x.shape[-1])              # noqa: E731  head j*G + h
    unflat = lambda x, h: np.moveaxis(x.reshape(B, T, 2, h, x.shape[-1]), 2, 3)       # noqa: E731
    sflat = lambda x: np.moveaxis(x, 2, 1).reshape((B, 4) + x.shape[3:])              # noqa: E731  (B, hk, j, ..)
    sunflat = lambda x: np.moveaxis(x.reshape((B, 2, 2) + x.shape[2:]), 1, 2)         # noqa: E731
    want = oracle_grads(flat(q), flat(k), flat(v), sflat(st.S), sflat(st.z), 2 + np.arange(T)[None], spec.inv_freq(),
                        flat(go), (sflat(gs[0]), sflat(gs[1])),
                        **_spec_oracle_kw(spec, causal=True, feature_map="elu", eps=1e-6, decay=None, normalize=True))
    want = (unflat(want[0], 4), unflat(want[1], 2), unflat(want[2], 2), sunflat(want[3]), sunflat(want[4]))
    for name, a, b in zip(("dq", "dk", "dv", "dS", "dz"), (dq, dk, dv_, dS, dz), want):
        assert rel_err(a, b) <= 1e-9, (name, rel_err(a, b))


@pytest.mark.parametrize("kind", ["torch", "jax", "float32"])
def test_frontend_other_arrays_and_float32(kind, request):
    """torch tensors and JAX arrays through the reference (any array-API namespace): their type back, the NumPy
    result; float32 within the float64 oracle at float32's tolerance."""
    rng = np.random.default_rng(14)
    q, k, v, go = (rng.standard_normal((1, 6, 2, 8)) for _ in range(4))
    v, go = v[..., :5], go[..., :5]
    kw = dict(causal=True, base=100.0, seq_axis=1, decay=0.9, chunk=4)
    ref = linear_attention_backward(q, k, v, go, **kw)[:3]
    if kind == "float32":
        got = linear_attention_backward(*(x.astype(np.float32) for x in (q, k, v, go)), **kw)[:3]
        assert all(g.dtype == np.float32 for g in got)
        assert all(rel_err(g, r) <= 2e-5 for g, r in zip(got, ref))
        return
    if kind == "torch":
        args = [torch.tensor(x) for x in (q, k, v, go)]
        got = linear_attention_backward(*args, **kw)[:3]
        assert all(isinstance(g, torch.Tensor) for g in got)
        got = [g.numpy() for g in got]
    else:
        jax, _ = request.getfixturevalue("jax64")
        run = jax.jit(lambda *a: linear_attention_backward(*a, **kw)[:3])
        got = run(*(jax.numpy.asarray(x) for x in (q, k, v, go)))
        got = [np.asarray(g) for g in got]
    assert all(rel_err(g, r) <= 1e-12 for g, r in zip(got, ref))


def test_frontend_empty_sequence_and_errors():
    rng = np.random.default_rng(15)
    q, k, v = rng.standard_normal((1, 3, 2, 8)), rng.standard_normal((1, 3, 2, 8)), rng.standard_normal((1, 3, 2, 4))
    _, st = rotary.linear_attention(q, k, v, causal=True, base=100.0, seq_axis=1, return_state=True)
    gs = (rng.standard_normal(st.S.shape), rng.standard_normal(st.z.shape))
    e = np.zeros((1, 0, 2, 8))
    dq, dk, dv, (dS, dz) = linear_attention_backward(e, e, e[..., :4], e[..., :4], causal=True, seq_axis=1, state=st,
                                                     grad_state=gs)
    assert dq.shape == e.shape and np.array_equal(dS, gs[0]) and np.array_equal(dz, gs[1])
    go = rng.standard_normal((1, 3, 2, 4))
    with pytest.raises(ValueError, match="grad_o"):
        linear_attention_backward(q, k, v, go[:, :2], seq_axis=1)
    with pytest.raises(TypeError, match="feature_map"):
        linear_attention_backward(q, k, v, go, seq_axis=1, feature_map=lambda x: x * x)
    with pytest.raises(NotImplementedError, match="cu_seqlens"):
        linear_attention_backward(q[0], k[0], v[0], go[0], seq_axis=0, cu_seqlens=np.array([0, 1, 3]))
    with pytest.raises(ValueError, match="grad_state"):
        linear_attention_backward(q, k, v, go, seq_axis=1, causal=True, state=st, grad_state=(gs[0][..., :2], None))
    with pytest.raises(ValueError, match="decay"):
        linear_attention_backward(q, k, v, go, seq_axis=1, causal=False, decay=0.5)


def test_frontend_named_backend_without_the_primitive(monkeypatch):
    """backend="auto" falls back to the NumPy reference; a named backend without ``linear_attention_backward``
    is NotImplementedError naming it."""
    import types

    rng = np.random.default_rng(16)
    q, k, v, go = (rng.standard_normal((1, 3, 2, 8)) for _ in range(4))
    fake = types.SimpleNamespace(NAME="fake", accepts=lambda x: True)
    real_pick = _backends.pick
    monkeypatch.setattr(_backends, "pick", lambda arrays, name: fake if name in ("fake", "auto") else
                        real_pick(arrays, name))
    with pytest.raises(NotImplementedError, match="linear_attention_backward"):
        linear_attention_backward(q, k, v, go, seq_axis=1, backend="fake")
    ref = linear_attention_backward(q, k, v, go, seq_axis=1, backend="numpy")
    for a, b in zip(linear_attention_backward(q, k, v, go, seq_axis=1, backend="auto")[:3], ref[:3]):
        np.testing.assert_array_equal(a, b)


# -- torch autograd: the custom op's backward calls the primitive ------------------------------------------------
def _op(spec_obj, seq_axis, causal, feature_map, chunk, decay, normalize, backend="auto", positions=None, offset=0):
    from rotary.interop import torch_ops

    key = torch_ops.spec_key(spec_obj, {})
    return lambda q, k, v: torch.ops.rotary.linear_attention(q, k, v, positions, offset, key, seq_axis, causal,
                                                             feature_map, 1e-6, chunk, decay, normalize, backend)


_OP_CASES = [
    dict(causal=True, feature_map="elu", chunk=2, decay=0.8, normalize=True, layout="half", Hk=1),
    dict(causal=False, feature_map="relu", chunk=3, decay=None, normalize=False, layout="interleaved", Hk=2),
    dict(causal=True, feature_map="identity", chunk=4, decay=0.9, normalize=False, layout="interleaved", Hk=1),
]


@pytest.mark.parametrize("c", _OP_CASES, ids=lambda c: f"{c['feature_map']}-causal{c['causal']}")
def test_torch_op_gradcheck_float64(c):
    spec = rotary.RopeSpec(4, base=100.0, layout=c["layout"])
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 5, 2, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 5, c["Hk"], 4, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 5, c["Hk"], 3, generator=gen, dtype=torch.float64, requires_grad=True)
    f = _op(spec, -3, c["causal"], c["feature_map"], c["chunk"], c["decay"], c["normalize"],
            positions=torch.arange(2, 7))
    assert torch.autograd.gradcheck(f, (q, k, v))


def test_torch_op_backward_matches_the_oracle_and_has_no_double_backward():
    rng = np.random.default_rng(21)
    spec = rotary.RopeSpec(8, base=50.0, rotary_dim=6)
    q, k, v, go = (rng.standard_normal(s) for s in ((2, 7, 4, 8), (2, 7, 2, 8), (2, 7, 2, 5), (2, 7, 4, 5)))
    leaves = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
    o = _op(spec, 1, True, "elu", 3, 0.85, True, offset=4)(*leaves)
    grads = torch.autograd.grad(o, leaves, torch.tensor(go))
    want = oracle_grads(q, k, v, np.zeros((2, 2, 8, 5)), np.zeros((2, 2, 8)), 4 + np.arange(7)[None], spec.inv_freq(),
                        go, None, **_spec_oracle_kw(spec, causal=True, feature_map="elu", eps=1e-6,
                                                    decay=np.full((2, 2), 0.85), normalize=True))
    for name, a, b in zip(("dq", "dk", "dv"), grads, want):
        assert rel_err(a.numpy(), b) <= 1e-9, (name, rel_err(a.numpy(), b))
    o = _op(spec, 1, True, "elu", 3, 0.85, True)(*leaves)
    dq, = torch.autograd.grad(o, leaves[0], torch.tensor(go), create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        dq.sum().backward()


def test_torch_compiled_training_step_float32(monkeypatch):
    """A torch.compile(fullgraph=True) step's gradients (the op's backward, which calls the frontend of the
    backward primitive) against the float64 oracle."""
    from rotary.attn import linear_backward

    calls = []
    real = linear_backward.linear_attention_backward
    monkeypatch.setattr(linear_backward, "linear_attention_backward",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    rng = np.random.default_rng(22)
    spec = rotary.RopeSpec(16, base=1000.0)
    q, k, v, go = (rng.standard_normal(s).astype(np.float32) for s in ((1, 12, 4, 16), (1, 12, 2, 16),
                                                                         (1, 12, 2, 8), (1, 12, 4, 8)))
    leaves = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
    f = torch.compile(lambda q, k, v: rotary.linear_attention(q, k, v, spec=spec, seq_axis=1, causal=True, chunk=5,
                                                              decay=0.9), fullgraph=True, backend="eager")
    grads = torch.autograd.grad(f(*leaves), leaves, torch.tensor(go))
    assert calls == [1]
    want = oracle_grads(q, k, v, np.zeros((1, 2, 16, 8)), np.zeros((1, 2, 16)), np.arange(12)[None], spec.inv_freq(),
                        go, None, **_spec_oracle_kw(spec, causal=True, feature_map="elu", eps=1e-6,
                                                    decay=np.full((1, 2), 0.9), normalize=True))
    for name, a, b in zip(("dq", "dk", "dv"), grads, want):
        assert a.dtype == torch.float32 and rel_err(a.numpy(), b) <= 2e-5, (name, rel_err(a.numpy(), b))


def test_torch_eager_autograd_runs_the_op_and_its_backward(monkeypatch):
    """Eager calls on tensors that require grad (named feature map, no state, no packing) run the custom op: the
    kernels forward, the backward primitive backward (counted), backend="numba" accepted; per-head decay, spec
    keywords, a layout string and NumPy positions go through it; gradients against the float64 oracle."""
    from rotary.attn import linear_backward
    from rotary.interop import torch_adapter

    calls = []
    real = linear_backward.linear_attention_backward
    monkeypatch.setattr(linear_backward, "linear_attention_backward",
                        lambda *a, **kw: calls.append(kw["backend"]) or real(*a, **kw))
    rng = np.random.default_rng(23)
    q, k, v, go = (rng.standard_normal(s) for s in ((2, 11, 4, 8), (2, 11, 2, 8), (2, 11, 2, 5), (2, 11, 4, 5)))
    dec = np.array([0.9, 0.7])
    spec = rotary.RopeSpec(8, base=50.0, layout="interleaved")
    want = oracle_grads(q, k, v, np.zeros((2, 2, 8, 5)), np.zeros((2, 2, 8)), 3 + np.arange(11)[None],
                        spec.inv_freq(), go, None, **_spec_oracle_kw(spec, causal=True, feature_map="relu", eps=1e-6,
                                                                      decay=np.tile(dec, (2, 1)), normalize=True))
    for backend in [b for b in ("auto", "numba", "numpy") if b == "auto" or b in BACKWARD_BACKENDS]:
        leaves = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
        o = rotary.linear_attention(*leaves, np.arange(3, 14), causal=True, feature_map="relu", decay=dec, chunk=4,
                                    base=50.0, layout="interleaved", seq_axis="bshd", backend=backend)
        assert "rotary_linear_attention" in type(o.grad_fn).__name__
        grads = torch.autograd.grad(o, leaves, torch.tensor(go))
        assert calls[-1] == backend
        for name, a, b in zip(("dq", "dk", "dv"), grads, want):
            assert rel_err(a.numpy(), b) <= 1e-9, (backend, name, rel_err(a.numpy(), b))
    # the switch: the differentiable reference path (torch operations; double backward works there)
    monkeypatch.setattr(torch_adapter, "OP_BACKWARD", False)
    leaves = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
    o = rotary.linear_attention(*leaves, causal=True, seq_axis=1, decay=dec)
    assert "rotary_linear_attention" not in type(o.grad_fn).__name__
    dq, = torch.autograd.grad(o, leaves[0], torch.tensor(go), create_graph=True)
    dq.sum().backward()
    monkeypatch.setattr(torch_adapter, "OP_BACKWARD", True)
    # forms the op does not take: the reference path, and a named kernel backend refused naming the fix
    o, st = rotary.linear_attention(*leaves, causal=True, seq_axis=1, return_state=True)
    assert "rotary_linear_attention" not in type(o.grad_fn).__name__ and st.S.requires_grad
    with pytest.raises(ValueError, match="backend='numba' cannot run this linear_attention call"):
        rotary.linear_attention(*leaves, causal=True, seq_axis=1, backend="numba", feature_map=lambda x: x * x)
    # torch.func transforms (which a custom op's autograd refuses): the reference path, the oracle's gradient
    x = torch.tensor(q)
    got = torch.func.grad(lambda a: (rotary.linear_attention(a, a[:, :, :2], a[:, :, :2, :5], causal=True,
                                                             seq_axis=1) * torch.tensor(go)).sum())(x)
    parts = oracle_grads(q, q[:, :, :2], q[:, :, :2, :5], np.zeros((2, 2, 8, 5)), np.zeros((2, 2, 8)),
                         np.arange(11)[None], rotary.RopeSpec(8).inv_freq(), go, None,
                         **_spec_oracle_kw(rotary.RopeSpec(8), causal=True, feature_map="elu", eps=1e-6, decay=None,
                                           normalize=True))
    want = parts[0].copy()
    want[:, :, :2] += parts[1]
    want[:, :, :2, :5] += parts[2]
    assert rel_err(got.numpy(), want) <= 1e-9


def test_torch_compiled_per_head_decay():
    """A per-head decay (NumPy array) reaches the op as a float64 tensor under torch.compile(fullgraph=True)."""
    rng = np.random.default_rng(24)
    q, k, v, go = (rng.standard_normal(s).astype(np.float32) for s in ((1, 9, 4, 8), (1, 9, 2, 8), (1, 9, 2, 4),
                                                                         (1, 9, 4, 4)))
    dec = np.array([0.95, 0.6])
    leaves = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
    fn = lambda q, k, v: rotary.linear_attention(q, k, v, seq_axis=1, causal=True, decay=dec, chunk=4)  # noqa: E731
    o = torch.compile(fn, fullgraph=True, backend="eager")(*leaves)
    expect = rotary.linear_attention(q, k, v, seq_axis=1, causal=True, decay=dec, chunk=4)
    assert np.allclose(o.detach().numpy(), expect, rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(o, leaves, torch.tensor(go))
    want = oracle_grads(q, k, v, np.zeros((1, 2, 8, 4)), np.zeros((1, 2, 8)), np.arange(9)[None],
                        rotary.RopeSpec(8).inv_freq(), go, None,
                        **_spec_oracle_kw(rotary.RopeSpec(8), causal=True, feature_map="elu", eps=1e-6,
                                          decay=dec[None], normalize=True))
    for name, a, b in zip(("dq", "dk", "dv"), grads, want):
        assert rel_err(a.numpy(), b) <= 2e-5, (name, rel_err(a.numpy(), b))


# -- JAX: a custom_vjp whose backward is the primitive on the host ---------------------------------------------
@pytest.fixture
def jax64(monkeypatch):
    """jax with x64 on (restored after), and a count of the host backward's calls."""
    jax = pytest.importorskip("jax")
    from rotary.attn import linear_backward

    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    calls = []
    real = linear_backward.linear_attention_backward
    monkeypatch.setattr(linear_backward, "linear_attention_backward",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    yield jax, calls
    jax.config.update("jax_enable_x64", previous)


_JAX_CASES = [
    dict(causal=True, decay=0.85, feature_map="elu", normalize=True, layout="half", Hk=1, chunk=4),
    dict(causal=False, decay=None, feature_map="relu", normalize=False, layout="interleaved", Hk=2, chunk=3),
    dict(causal=True, decay=(0.7, 1.0), feature_map="identity", normalize=False, layout="interleaved", Hk=2, chunk=2),
]


@pytest.mark.parametrize("c", _JAX_CASES, ids=lambda c: f"{c['feature_map']}-causal{c['causal']}")
def test_jax_check_grads_float64(jax64, c):
    jax, calls = jax64
    from jax.test_util import check_grads

    rng = np.random.default_rng(31)
    q = jax.numpy.asarray(rng.standard_normal((2, 6, 2, 8)))
    k = jax.numpy.asarray(rng.standard_normal((2, 6, c["Hk"], 8)))
    v = jax.numpy.asarray(rng.standard_normal((2, 6, c["Hk"], 5)))
    kw = dict(causal=c["causal"], decay=c["decay"], feature_map=c["feature_map"], normalize=c["normalize"],
              chunk=c["chunk"], base=100.0, layout=c["layout"], seq_axis=1)
    f = lambda q, k, v: rotary.linear_attention(q, k, v, 3, **kw)   # noqa: E731
    check_grads(jax.jit(f), (q, k, v), order=1, modes=["rev"])
    assert calls, "the host backward was not used"
    go = rng.standard_normal((2, 6, 2, 5))
    grads = jax.jit(jax.grad(lambda q, k, v: (f(q, k, v) * go).sum(), argnums=(0, 1, 2)))(q, k, v)
    d = None if c["decay"] is None else np.broadcast_to(np.asarray(c["decay"], np.float64), (2, c["Hk"])).copy()
    spec = rotary.RopeSpec(8, base=100.0, layout=c["layout"])
    want = oracle_grads(q, k, v, np.zeros((2, c["Hk"], 8, 5)), np.zeros((2, c["Hk"], 8)), 3 + np.arange(6)[None],
                        spec.inv_freq(), go, None, **_spec_oracle_kw(spec, causal=c["causal"],
                                                                     feature_map=c["feature_map"], eps=1e-6, decay=d,
                                                                     normalize=c["normalize"]))
    for name, a, b in zip(("dq", "dk", "dv"), grads, want):
        assert rel_err(a, b) <= 1e-9, (name, rel_err(a, b))


def test_jax_state_in_and_out_vmap_and_the_switch(jax64, monkeypatch):
    """Gradients at the carried state and from the returned state (check_grads), vmap over a batch of
    examples, and HOST_BACKWARD = False: JAX's own autodiff of the forward (forward mode works there)."""
    jax, calls = jax64
    from jax.test_util import check_grads

    from rotary.frontend.dispatch import with_arrays
    from rotary.interop import jax_adapter

    rng = np.random.default_rng(32)
    q, k, v = (jax.numpy.asarray(rng.standard_normal(s)) for s in ((1, 7, 4, 8), (1, 7, 2, 8), (1, 7, 2, 3)))
    kw = dict(causal=True, base=100.0, seq_axis=1, decay=0.9, chunk=3)
    _, st = rotary.linear_attention(q[:, :3], k[:, :3], v[:, :3], return_state=True, **kw)

    def loss(q, k, v, S, z):
        o, out = rotary.linear_attention(q, k, v, state=with_arrays(st, S, z), return_state=True, **kw)
        return (o ** 2).sum() + (out.S * out.S).sum() + jax.numpy.sin(out.z).sum()

    check_grads(jax.jit(loss), (q, k, v, st.S, st.z), order=1, modes=["rev"])
    assert calls
    one = jax.grad(lambda q: (rotary.linear_attention(q[None], k, v, **kw) ** 2).sum())
    batched = jax.jit(jax.vmap(one))(q[0][None])
    single = jax.jit(jax.grad(lambda q: (rotary.linear_attention(q, k, v, **kw) ** 2).sum()))(q)
    assert rel_err(batched, single) <= 1e-12
    monkeypatch.setattr(jax_adapter, "HOST_BACKWARD", False)
    del calls[:]
    f = lambda q: rotary.linear_attention(q, k, v, **kw)   # noqa: E731
    own = jax.jit(jax.grad(lambda q: (f(q) ** 2).sum()))(q)
    assert not calls and rel_err(own, single) <= 1e-12
    jax.jit(lambda q: jax.jvp(f, (q,), (q,)))(q)            # forward mode: JAX's own autodiff


# -- the Numba kernels --------------------------------------------------------------------------------------------
@pytest.mark.skipif("numba" not in BACKWARD_BACKENDS, reason="numba backend unavailable")
def test_numba_is_auto_for_numpy_and_takes_float16_and_strided_views():
    """backend="auto" picks the Numba kernels for NumPy arrays (the capability); float16 inputs (computed in
    float32, gradients in float16) and strided views (a sliced bhsd layout) agree with the float64 oracle."""
    from rotary.frontend.arguments import pick_backend

    rng = np.random.default_rng(41)
    q = rng.standard_normal((2, 3, 9, 8))
    assert pick_backend([q], "auto", "linear_attention_backward").NAME == "numba"
    big = rng.standard_normal((4, 2 * 3, 9, 8 + 5 + 5))                   # views: every other batch row, strided
    q, k, v = big[::2, :, :, :8], big[::2, ::3, :, 8:16], big[::2, ::3, :, 13:18]
    go = rng.standard_normal((2, 6, 9, 5))
    spec = rotary.RopeSpec(8, base=100.0)
    kw = dict(causal=True, spec=spec, seq_axis=2, chunk=4, decay=0.9)
    t = lambda x: np.moveaxis(x, 1, 2)   # noqa: E731
    oracle_kw = _spec_oracle_kw(spec, causal=True, feature_map="elu", eps=1e-6, decay=np.full((2, 2), 0.9),
                                normalize=True)
    for dtype, tol in ((np.float64, 1e-9), (np.float16, 2e-2)):
        args = [np.asarray(x, dtype) for x in (q, k, v, go)]
        x64 = [t(np.asarray(x, np.float64)) for x in args]                   # float16: the rounded inputs
        want = oracle_grads(*x64[:3], np.zeros((2, 2, 8, 5)), np.zeros((2, 2, 8)), np.arange(9)[None],
                            spec.inv_freq(), x64[3], None, **oracle_kw)
        got = linear_attention_backward(*args, backend="numba", **kw)[:3]
        for name, a, b in zip(("dq", "dk", "dv"), got, want):
            assert a.dtype == dtype and rel_err(a, t(b)) <= tol, (name, dtype, rel_err(a, t(b)))


@pytest.mark.skipif("numba" not in BACKWARD_BACKENDS, reason="numba backend unavailable")
def test_warm_compiles_the_backward_kernels(monkeypatch):
    """``python -m rotary warm`` has a call that runs the Numba backward kernel (compiled into the on-disk cache for
    each dtype it is asked for)."""
    from rotary.backends import numba_runtime
    from rotary.cli import warm

    ran = []
    real = numba_runtime.run_tasks
    monkeypatch.setattr(numba_runtime, "run_tasks", lambda kernel, *a: ran.append(kernel.__name__) or real(kernel, *a))
    calls = [call for label, call in warm.warm_calls("float64") if "backward" in label]
    assert len(calls) == 1
    calls[0]()
    assert "linear_backward_tasks" in ran


@pytest.mark.skipif("numba" not in BACKWARD_BACKENDS, reason="numba backend unavailable")
def test_benchmark_script_smoke(capsys):
    """benchmarks/bench_linear_backward.py at a tiny size (rotary's rows only): a Markdown table with the
    backward / forward ratio; the chunked torch form it times agrees with rotary's gradients."""
    import importlib.util
    import os
    import types

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                        "bench_linear_backward.py")
    spec = importlib.util.spec_from_file_location("bench_linear_backward", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = types.SimpleNamespace(T=256, rounds=1, round_ms=1, quick=True, threads=1, skip="torch,jax,compile,memory")
    result = bench.main(args)
    out = capsys.readouterr().out
    assert "| rotary backward |" in out and "rotary backward / forward" in out
    assert set(result["times"]) >= {"rotary forward", "rotary backward", "rotary forward + backward"}
    q, k, v, g, rspec = bench.inputs(256)
    o, grads = bench.torch_calls(q, k, v, g, rspec, 1)[1]()
    want_o, want = bench.rotary_calls(q, k, v, g, rspec)[2]()
    assert bench.rel_error(bench.to_bshd(o.numpy()), want_o) < 1e-5
    for got, w in zip(grads, want):
        assert bench.rel_error(bench.to_bshd(got.numpy()), w) < 1e-4


_NO_JIT = """
import numpy as np, numba
from rotary.attn.linear_backward import linear_attention_backward
from rotary.backends.numba_kernels import linear_backward as lb
assert numba.config.DISABLE_JIT and not hasattr(lb.linear_backward_tasks, "signatures")
rng = np.random.default_rng(0)
for causal, decay, dtype in ((True, 0.9, np.float32), (False, None, np.float64), (True, None, np.float16)):
    q, k, v, g = (rng.standard_normal((1, 19, 2, 6)).astype(dtype) for _ in range(4))
    kw = dict(causal=causal, decay=decay, seq_axis=1, chunk=8, base=100.0, rotary_dim=4)
    got = linear_attention_backward(q, k, v, g, backend="numba", **kw)[:3]
    want = linear_attention_backward(q, k, v, g, backend="numpy", **kw)[:3]
    for a, b in zip(got, want):
        assert a.dtype == b.dtype
        err = np.abs(a.astype(np.float64) - b).max() / np.abs(b.astype(np.float64)).max()
        assert err < (1e-12 if dtype == np.float64 else 2e-3 if dtype == np.float16 else 1e-5), err
print("ok")
"""


@pytest.mark.skipif("numba" not in BACKWARD_BACKENDS, reason="numba backend unavailable")
def test_numba_backward_runs_as_plain_python_without_jit(tmp_path):
    """NUMBA_DISABLE_JIT=1: the backward kernel and every helper it calls run as Python (m = 6 and a partial rotary
    dim: the tails past whole vectors too), against the NumPy reference."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, NUMBA_DISABLE_JIT="1", PYTHONPATH=root)
    run = subprocess.run([sys.executable, "-c", _NO_JIT], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0 and "ok" in run.stdout, run.stderr[-2000:]


# -- peer: flash-linear-attention's naive references, differentiated by torch autograd -----------------------------
def _fla_naive(relative):
    """A module of the installed fla package's naive references (test_linear_attention_variants' loader)."""
    from .test_linear_attention_variants import _fla_module

    return _fla_module(relative)[1]


@pytest.mark.peer
@pytest.mark.parametrize("backend", BACKWARD_BACKENDS)
@pytest.mark.parametrize("normalize", [True, False])
def test_peer_fla_naive_recurrent_linear_attn_gradients(backend, normalize):
    """fla's naive_recurrent_linear_attn (BTHD, q scaled by d^-1/2, denominator eps 1e-10; no RoPE; it computes in
    float32), differentiated by torch autograd, against our float32 backward with identity features of positive
    inputs, eps=1e-10 and every token at one position (R = I): dq (times the scale), dk, dv."""
    import torch

    naive = _fla_naive("ops/linear_attn/naive.py")
    rng = np.random.default_rng(21)
    B, T, H, d, dv = 2, 29, 3, 8, 4
    q, k = ((np.abs(rng.standard_normal((B, T, H, d))) + 0.1).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((B, T, H, dv)).astype(np.float32)
    g = rng.standard_normal((B, T, H, dv)).astype(np.float32)
    tq, tk, tv = (torch.from_numpy(a).requires_grad_() for a in (q, k, v))
    o, _ = naive.naive_recurrent_linear_attn(tq, tk, tv, normalize=normalize)
    want = torch.autograd.grad((o * torch.from_numpy(g)).sum(), (tq, tk, tv))
    scale = d ** -0.5
    dq, dk, dv_, _ = linear_attention_backward(q * np.float32(scale), k, v, g, np.zeros(T, np.int64), causal=True,
                                               feature_map="identity", eps=1e-10, normalize=normalize, seq_axis=-3,
                                               backend=backend, chunk=8)
    for ours, theirs in zip((dq * np.float32(scale), dk, dv_), want):
        theirs = theirs.numpy()
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=2e-5 * np.abs(theirs).max())


@pytest.mark.peer
@pytest.mark.parametrize("backend", BACKWARD_BACKENDS)
def test_peer_fla_naive_retention_gradients(backend):
    """fla's naive_retention (gamma_h = 1 - 2^(-5-h), q scaled by d^-1/2, no normalization, no RoPE; float32)
    differentiated by torch autograd, against our float32 backward with identity features, normalize=False,
    RetNet's gammas as decay and every token at one position."""
    import torch

    naive = _fla_naive("ops/retention/naive.py")
    rng = np.random.default_rng(22)
    B, H, T, d, dv = 2, 4, 23, 8, 4
    q, k = (rng.standard_normal((B, H, T, d)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((B, H, T, dv)).astype(np.float32)
    g = rng.standard_normal((B, H, T, dv)).astype(np.float32)
    tq, tk, tv = (torch.from_numpy(a).requires_grad_() for a in (q, k, v))
    o = naive.naive_retention(tq, tk, tv)
    want = torch.autograd.grad((o * torch.from_numpy(g)).sum(), (tq, tk, tv))
    gammas = 1.0 - 2.0 ** (-5.0 - np.arange(H))
    scale = d ** -0.5
    dq, dk, dv_, _ = linear_attention_backward(q * np.float32(scale), k, v, g, np.zeros(T, np.int64), causal=True,
                                               feature_map="identity", normalize=False, decay=gammas, seq_axis=-2,
                                               backend=backend, chunk=8)
    for ours, theirs in zip((dq * np.float32(scale), dk, dv_), want):
        theirs = theirs.numpy()
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=2e-5 * np.abs(theirs).max())
