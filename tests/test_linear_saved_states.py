"""A causal linear-attention forward keeps its states before each chunk for the backward (issue 45):
``linear_attention(..., save_for_backward=True)`` and ``linear_attention_backward(..., saved=)`` on the frontend,
``keep_chunk_states`` / ``chunk_states`` on a backend with ``LINEAR_CHUNK_STATES`` (Numba).

The kept states are checked against the torch float64 oracle of test_linear_attention_backward (the state after
each prefix of the sequence), the gradients through them against the oracle's autograd (1e-9 in float64) and
against the backward that sweeps k and v itself (the same bits); a ``saved`` of other arrays or another chunk is
refused; every call that keeps nothing (another backend, non-causal, packed, torch / JAX / Dask arrays) says None.
"""

import numpy as np
import pytest

import rotary
from rotary import backends as _backends
from rotary.attn.linear_backward import linear_attention_backward

from .test_linear_attention_backward import _GRID, _case, make_inputs, oracle, oracle_grads, rel_err

torch = pytest.importorskip("torch")

KEEPING = [name for name, (ok, _) in rotary.available_backends().items()
           if ok and getattr(_backends.get(name), "LINEAR_CHUNK_STATES", False)]
CAUSAL = [i for i in range(len(_GRID)) if _GRID[i][0]]
pytestmark = pytest.mark.skipif(not KEEPING, reason="no backend keeps chunk states (numba unavailable)")


def _primitive_call(backend, i, dtype=np.float64, seed=0):
    case = _case(i)
    rng = np.random.default_rng(seed)
    T, chunk = case["T_chunk"]
    x = make_inputs(rng, T=T, groups=case["groups"], rotary_dim=case["rotary_dim"], layout=case["layout"],
                    decay=case["decay"], state=case["state"], grad_state=case["grad_state"],
                    batch_rows=case["batch_rows"], dtype=dtype)
    kw = dict(rotary_dim=case["rotary_dim"], layout=case["layout"], causal=True, feature_map=case["feature_map"],
              eps=1e-6, chunk=chunk, decay=x["decay"], normalize=case["normalize"])
    return case, x, kw, _backends.get(backend)


@pytest.mark.parametrize("backend", KEEPING)
@pytest.mark.parametrize("i", CAUSAL, ids=lambda i: "-".join(str(v) for v in _GRID[i]))
def test_kept_states_are_the_prefix_states_and_the_backward_reads_them(backend, i):
    """Every causal grid case (GQA, decay, partial rotary, a state in, chunks that do and do not divide T): the
    state before chunk c is the oracle's state after tokens 0 .. c * chunk - 1; the backward through the kept
    states matches the oracle's gradients and the sweeping backward bit for bit."""
    case, x, kw, module = _primitive_call(backend, i, seed=i)
    o, _, kept = module.linear_attention(x["q"], x["k"], x["v"], x["cos"], x["sin"], x["rows"], state=x["state"],
                                         keep_chunk_states=True, **kw)
    o_plain = module.linear_attention(x["q"], x["k"], x["v"], x["cos"], x["sin"], x["rows"], state=x["state"],
                                      **kw)[0]
    T, chunk = case["T_chunk"]
    step = max(1, min(chunk, T))
    if T > 1:   # (one token: the decode kernel without them, another summation order)
        np.testing.assert_array_equal(o, o_plain)
    B, _, Hk, m = x["k"].shape
    dv = x["v"].shape[-1]
    S0, z0 = x["state"] if x["state"] is not None else (np.zeros((B, Hk, m, dv)), np.zeros((B, Hk, m)))
    n_chunks = -(-T // step)
    rows_per_chunk = kept.s.shape[2] // n_chunks
    for c in range(n_chunks):
        t0 = c * step
        _, S_want, z_want = oracle(*(torch.tensor(a[:, :t0]) for a in (x["q"], x["k"], x["v"])), torch.tensor(S0),
                                   torch.tensor(z0), torch.as_tensor(x["positions"][:, :t0]),
                                   torch.as_tensor(x["inv_freq"]), layout=case["layout"], scale=x["scale"],
                                   causal=True, feature_map=case["feature_map"], eps=1e-6,
                                   decay=None if x["decay"] is None else torch.as_tensor(x["decay"]), normalize=True)
        S_got = kept.s[:, :, c * rows_per_chunk:c * rows_per_chunk + dv, :m].transpose(0, 1, 3, 2)
        assert rel_err(S_got, S_want.numpy()) <= 1e-12, (c, rel_err(S_got, S_want.numpy()))
        assert rel_err(kept.z[:, :, c], z_want.numpy()) <= 1e-12
    args = (x["q"], x["k"], x["v"], x["cos"], x["sin"], x["rows"], x["grad_o"])
    got = module.linear_attention_backward(*args, state=x["state"], grad_state=x["grad_state"], chunk_states=kept,
                                           **kw)
    swept = module.linear_attention_backward(*args, state=x["state"], grad_state=x["grad_state"], **kw)
    want = oracle_grads(x["q"], x["k"], x["v"], S0, z0, x["positions"], x["inv_freq"], x["grad_o"],
                        x["grad_state"], layout=case["layout"], scale=x["scale"], causal=True,
                        feature_map=case["feature_map"], eps=1e-6, decay=x["decay"], normalize=case["normalize"])
    flat = lambda g: tuple(g[:3]) + (tuple(g[3]) if g[3] is not None else ())   # noqa: E731
    for name, a, b, c in zip(("dq", "dk", "dv", "dS", "dz"), flat(got), flat(swept), want):
        np.testing.assert_array_equal(a, b, err_msg=name)
        assert rel_err(a, c) <= 1e-9, (name, rel_err(a, c))


@pytest.mark.parametrize("backend", KEEPING)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_kept_states_in_float32_work(backend, dtype):
    case, x, kw, module = _primitive_call(backend, CAUSAL[3], dtype=dtype, seed=7)
    kept = module.linear_attention(x["q"], x["k"], x["v"], x["cos"].astype(np.float32), x["sin"].astype(np.float32),
                                   x["rows"], state=x["state"], keep_chunk_states=True, **kw)[2]
    assert kept.s.dtype == np.float32 and kept.z.dtype == np.float64
    args = (x["q"], x["k"], x["v"], x["cos"], x["sin"], x["rows"], x["grad_o"])
    got = module.linear_attention_backward(*args, state=x["state"], chunk_states=kept, **kw)
    swept = module.linear_attention_backward(*args, state=x["state"], **kw)
    for a, b in zip(got[:3], swept[:3]):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("backend", KEEPING)
def test_the_backend_refuses_states_of_another_call(backend):
    case, x, kw, module = _primitive_call(backend, CAUSAL[0])
    kept = module.linear_attention(x["q"], x["k"], x["v"], x["cos"], x["sin"], x["rows"], state=x["state"],
                                   keep_chunk_states=True, **kw)[2]
    args = (x["q"][:, :-1], x["k"][:, :-1], x["v"][:, :-1], x["cos"], x["sin"], x["rows"][:, :-1],
            x["grad_o"][:, :-1])
    with pytest.raises(ValueError, match="chunk_states belong to another call"):
        module.linear_attention_backward(*args, state=x["state"], chunk_states=kept, **kw)
    with pytest.raises(ValueError, match="chunk_states belong to another call"):
        module.linear_attention_backward(x["q"], x["k"], x["v"], x["cos"], x["sin"], x["rows"], x["grad_o"],
                                         state=x["state"], chunk_states=kept, **dict(kw, chunk=kw["chunk"] + 1))


# -- the frontend ------------------------------------------------------------------------------------------------
def _inputs(rng, B=2, T=150, H=4, Hk=2, m=16, dv=12, dtype=np.float32):
    return (rng.standard_normal((B, T, H, m)).astype(dtype), rng.standard_normal((B, T, Hk, m)).astype(dtype),
            rng.standard_normal((B, T, Hk, dv)).astype(dtype), rng.standard_normal((B, T, H, dv)).astype(dtype))


@pytest.mark.parametrize("backend", KEEPING)
def test_frontend_save_for_backward_gqa_decay_state(backend):
    """(o, saved) and (o, state, saved); the backward with saved gives the bits of the one without, through GQA,
    per-head decay, a carried state in and a gradient on the state out."""
    rng = np.random.default_rng(3)
    q, k, v, g = _inputs(rng)
    kw = dict(causal=True, layout="bshd", base=100.0, chunk=32, decay=np.array([0.9, 0.99]), backend=backend)
    _, st = rotary.linear_attention(q[:, :10], k[:, :10], v[:, :10], return_state=True, **kw)
    kw["state"] = st
    o_plain = rotary.linear_attention(q, k, v, **kw)
    o, saved = rotary.linear_attention(q, k, v, save_for_backward=True, **kw)
    np.testing.assert_array_equal(o, o_plain)
    assert saved is not None and backend in repr(saved)
    o2, st2, saved2 = rotary.linear_attention(q, k, v, save_for_backward=True, return_state=True, **kw)
    np.testing.assert_array_equal(o2, o_plain)
    assert st2.S.shape == st.S.shape and saved2 is not None
    gs = (rng.standard_normal(st.S.shape), rng.standard_normal(st.z.shape))
    plain = linear_attention_backward(q, k, v, g, grad_state=gs, **kw)
    through = linear_attention_backward(q, k, v, g, grad_state=gs, saved=saved, **kw)
    for a, b in zip(plain[:3] + plain[3], through[:3] + through[3]):
        np.testing.assert_array_equal(a, b)


def test_frontend_keeps_nothing_where_it_cannot(rng=np.random.default_rng(4)):
    q, k, v, g = _inputs(rng, T=40)
    kw = dict(layout="bshd", base=100.0, chunk=16)
    assert rotary.linear_attention(q, k, v, causal=False, save_for_backward=True, **kw)[1] is None
    assert rotary.linear_attention(q, k, v, causal=True, backend="numpy", save_for_backward=True, **kw)[1] is None
    assert rotary.linear_attention(q[:, :0], k[:, :0], v[:, :0], causal=True, save_for_backward=True, **kw)[1] is None
    o, st, saved = rotary.linear_attention(q[:1], k[:1], v[:1], causal=True, save_for_backward=True,
                                           return_state=True, cu_seqlens=np.array([0, 15, 40]), layout="bshd",
                                           base=100.0, chunk=16)
    assert saved is None and st.S.shape[0] == 2
    with pytest.raises(TypeError, match="save_for_backward must be a bool"):
        rotary.linear_attention(q, k, v, causal=True, save_for_backward=1, **kw)


@pytest.mark.parametrize("backend", KEEPING)
def test_frontend_refuses_a_saved_of_another_forward(backend):
    rng = np.random.default_rng(5)
    q, k, v, g = _inputs(rng, T=70)
    kw = dict(causal=True, layout="bshd", base=100.0, chunk=16, backend=backend)
    _, saved = rotary.linear_attention(q, k, v, save_for_backward=True, **kw)
    for call in (lambda: linear_attention_backward(q, k.copy(), v, g, saved=saved, **kw),
                 lambda: linear_attention_backward(q, k, v, g, saved=saved, **dict(kw, chunk=32)),
                 lambda: linear_attention_backward(q, k, v, g, saved=saved, **dict(kw, causal=False))):
        with pytest.raises(ValueError, match="saved belongs to another forward"):
            call()
    with pytest.raises(TypeError, match="saved must be what linear_attention"):
        linear_attention_backward(q, k, v, g, saved=(1, 2), **kw)
    # another backend than the one that kept them: ignored (it sweeps k and v itself), the same gradients
    got = linear_attention_backward(q, k, v, g, saved=saved, **dict(kw, backend="numpy"))
    want = linear_attention_backward(q, k, v, g, **dict(kw, backend="numpy"))
    for a, b in zip(got[:3], want[:3]):
        np.testing.assert_array_equal(a, b)


def test_torch_jax_dask_arrays_keep_nothing():
    """Their autograd keeps its own residuals: save_for_backward gives None last, and the call otherwise as without."""
    rng = np.random.default_rng(6)
    q = rng.standard_normal((1, 40, 2, 8)).astype(np.float32)
    kw = dict(causal=True, layout="bshd", chunk=16, base=100.0)
    want = rotary.linear_attention(q, q, q, **kw)
    t = torch.from_numpy(q)
    o, saved = rotary.linear_attention(t, t, t, save_for_backward=True, **kw)
    assert saved is None and np.allclose(o.numpy(), want, atol=1e-5)
    o, st, saved = rotary.linear_attention(t, t, t, save_for_backward=True, return_state=True, **kw)
    assert saved is None and isinstance(st.S, torch.Tensor)
    jnp = pytest.importorskip("jax.numpy")
    o, saved = rotary.linear_attention(jnp.asarray(q), jnp.asarray(q), jnp.asarray(q), save_for_backward=True, **kw)
    assert saved is None and np.allclose(np.asarray(o), want, atol=1e-5)
    da = pytest.importorskip("dask.array")
    d = da.from_array(q, chunks=(1, 20, 2, 8))
    o, saved = rotary.linear_attention(d, d, d, save_for_backward=True, **kw)
    assert saved is None and np.allclose(o.compute(), want, atol=1e-5)
    with pytest.raises(ValueError, match="saved: a Dask forward keeps no chunk states"):
        linear_attention_backward(d, d, d, d, saved=object(), **kw)
