"""JAX arrays: correct under jit, grad and vmap; positions static or traced; nothing traced is cached."""

import numpy as np
import pytest

import rotary
from rotary.spec import tables as _tables
from rotary.testing import assert_close, attention_quadratic, linear_attention_quadratic, rope_complex

jax = pytest.importorskip("jax")
jnp = jax.numpy
SPEC = rotary.RopeSpec(64, base=500000.0)


def _x(shape, seed=0, dtype=np.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(dtype))


def _oracle(x, positions, spec=SPEC, inverse=False):
    p = np.asarray(positions)
    return rope_complex(np.asarray(x, np.float64), -p if inverse else p, spec.inv_freq(), layout=spec.layout,
                        scale=spec.attention_scaling)


@pytest.mark.interop("JAX", "cpu", "reference (jax.numpy)", "jit, grad")
def test_jit_then_grad_then_jit_again_no_leaked_tracer():
    """The reported bug: after a jit, the cos/sin cache held a traced array and the next grad/jit failed."""
    x = _x((2, 8, 64))
    f = jax.jit(lambda a: rotary.apply(a, spec=SPEC, seq_axis=-2))
    assert_close(f(x), _oracle(x, np.arange(8)))
    g = jax.grad(lambda a: rotary.apply(a, spec=SPEC, seq_axis=-2).sum())(x)
    # d/dx sum(R x) = R^T 1 = the inverse rotation of ones
    assert_close(g, _oracle(np.ones(x.shape), np.arange(8), inverse=True))
    assert_close(jax.jit(lambda a: rotary.apply(a, 3, spec=SPEC, seq_axis=-2) * 2)(x), 2 * _oracle(x, np.arange(8) + 3))
    def arrays(value):                                     # the arrays of a cache entry, nested tuples flattened
        for item in value if isinstance(value, tuple) else (value,):
            if isinstance(item, tuple):
                yield from arrays(item)
            elif not isinstance(item, (int, np.integer)):
                yield item

    for entry, _ in _tables._cache.values():               # only host tables are cached
        assert all(isinstance(a, np.ndarray) for a in arrays(entry)), [type(a) for a in arrays(entry)]


@pytest.mark.interop("JAX", "cpu", "reference (jax.numpy)", "vmap, jit")
def test_vmap_and_concrete_positions_exact():
    x = _x((3, 5, 64), seed=1)
    big = np.array([0, 1, 2**20, 2**31 - 2, 123456789])
    y = jax.vmap(lambda a: rotary.apply(a, big, spec=SPEC, seq_axis=-2))(x)
    assert_close(y, _oracle(x, big))
    q, k = _x((2, 5, 4, 64), 2), _x((2, 5, 1, 64), 3)
    pos = np.stack([big, big[::-1]])
    qr, kr = jax.jit(lambda a, b: rotary.apply_qk(a, b, pos, spec=SPEC, seq_axis=-3))(q, k)
    assert_close(qr, np.moveaxis(_oracle(np.moveaxis(np.asarray(q), 2, 1), pos[:, None]), 1, 2))
    assert_close(kr, np.moveaxis(_oracle(np.moveaxis(np.asarray(k), 2, 1), pos[:, None]), 1, 2))


@pytest.mark.interop("JAX", "cpu", "reference (jax.numpy)", "jit with traced positions, grad")
@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_traced_positions(layout):
    spec = rotary.RopeSpec(64, layout=layout, base=10000.0)
    x = _x((2, 6, 64), seed=4)
    f = jax.jit(lambda a, p: rotary.apply(a, p, spec=spec, seq_axis=-2))
    for pos in (np.arange(6, dtype=np.int32), np.array([0, 2**31 - 1, -2**31, 7, -5, 2**24 + 3], np.int32)):
        assert_close(f(x, jnp.asarray(pos)), _oracle(x, pos, spec), atol=3e-6, rtol=3e-6)
    per_batch = np.array([[1, 2, 3, 4, 5, 6], [10**9, 10**9 + 1, 5, 4, 3, 2]], np.int32)
    assert_close(f(x, jnp.asarray(per_batch)), _oracle(x, per_batch[:, :], spec), atol=3e-6, rtol=3e-6)
    offset = jax.jit(lambda a, p: rotary.apply(a, p, spec=spec, inverse=True, seq_axis=-2))(x, jnp.int32(1000))
    assert_close(offset, _oracle(x, np.arange(6) + 1000, spec, inverse=True), atol=3e-6, rtol=3e-6)
    g = jax.jit(jax.grad(lambda a, p: (rotary.apply(a, p, spec=spec, seq_axis=-2) ** 2).sum()))(x, jnp.asarray(per_batch))
    assert_close(g, 2 * np.asarray(x, np.float64), atol=2e-5, rtol=2e-5)   # rotations keep norms


def test_traced_positions_need_static_for_length_dependent_specs():
    spec = rotary.RopeSpec(16, scaling={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=8)
    with pytest.raises(ValueError, match="static_argnums"):
        jax.jit(lambda a, p: rotary.apply(a, p, spec=spec, seq_axis=-2))(_x((4, 16)), jnp.arange(4))


def test_errors():
    x = _x((4, 16))
    with pytest.raises(TypeError, match=r"out= is not supported for JAX arrays.*return value"):
        jax.jit(lambda a: rotary.apply(a, out=a, seq_axis=-2))(x)
    with pytest.raises(ValueError, match="backend='numba' does not take JAX arrays"):
        rotary.apply(x, backend="numba", seq_axis=-2)


@pytest.mark.interop("JAX", "cpu", "reference (jax.numpy)", "linear attention under jit, grad")
@pytest.mark.parametrize("causal", [False, True])
def test_linear_attention_jit_grad(causal):
    q, k, v = _x((2, 9, 16), 5), _x((2, 9, 16), 6), _x((2, 9, 8), 7)
    spec = rotary.RopeSpec(16)
    f = jax.jit(lambda a, b, c: rotary.linear_attention(a, b, c, causal=causal, spec=spec, seq_axis=-2))
    exp = linear_attention_quadratic(q, k, v, np.arange(9), spec.inv_freq(), causal=causal)
    assert_close(f(q, k, v), exp, rtol=2e-5, atol=2e-5)
    g = jax.grad(lambda a: rotary.linear_attention(a, k, v, causal=causal, spec=spec, seq_axis=-2).sum())(q)
    eps = 1e-3                                            # a central difference on one coordinate
    dq = np.zeros(q.shape, np.float32)
    dq[1, 4, 3] = eps
    num = (linear_attention_quadratic(np.asarray(q) + dq, k, v, np.arange(9), spec.inv_freq(), causal=causal).sum()
           - linear_attention_quadratic(np.asarray(q) - dq, k, v, np.arange(9), spec.inv_freq(), causal=causal).sum())
    assert abs(float(g[1, 4, 3]) - num / (2 * eps)) < 1e-3
    traced = jax.jit(lambda a, p: rotary.linear_attention(a, a, a, p, causal=causal, spec=spec, seq_axis=-2))(q, jnp.arange(9) + 50)
    assert_close(traced, linear_attention_quadratic(q, q, q, np.arange(9) + 50, spec.inv_freq(), causal=causal),
                 rtol=2e-5, atol=2e-5)


def test_vmap_over_traced_positions_and_state_resume_under_jit():
    rng = np.random.default_rng(11)
    xs = _x((3, 8, 16), 12)
    ps = rng.integers(0, 10**6, (3, 8)).astype(np.int32)
    y = jax.vmap(lambda a, p: rotary.apply(a, p, seq_axis=-2))(xs, jnp.asarray(ps))
    for i in range(3):
        assert_close(y[i], rope_complex(np.asarray(xs[i], np.float64), ps[i], rotary.RopeSpec(16).inv_freq()),
                     atol=3e-6, rtol=3e-6)
    q, k, v = _x((30, 2, 16), 13), _x((30, 2, 16), 14), _x((30, 2, 8), 15)
    o1, st = rotary.linear_attention(q[:20], k[:20], v[:20], causal=True, seq_axis=-3, return_state=True)
    o2 = jax.jit(lambda a, b, c: rotary.linear_attention(a, b, c, causal=True, seq_axis=-3, state=st))(
        q[20:], k[20:], v[20:])
    expect = rotary.linear_attention(*(np.asarray(a) for a in (q, k, v)), causal=True, seq_axis=-3)
    assert_close(jnp.concatenate([o1, o2]), expect, rtol=1e-5, atol=1e-5)


# -- attention and linear attention with traced positions --------------------------------------------
def _bhsd(a):
    return np.moveaxis(np.asarray(a, np.float64), 2, 1)   # (B, S, H, d) -> (B, H, S, d) for the oracles


def _qkv(seed, s=11, hq=4, hk=2, d=16, dv=8):
    return _x((2, s, hq, d), seed), _x((2, s, hk, d), seed + 1), _x((2, s, hk, dv), seed + 2)


def _attention_oracle(q, k, v, qpos, kpos, spec, **kw):
    qp, kp = np.asarray(qpos), np.asarray(kpos)
    return np.moveaxis(attention_quadratic(_bhsd(q), _bhsd(k), _bhsd(v), qp, kp, spec.inv_freq(), layout=spec.layout,
                                           rotation_scale=spec.attention_scaling, **kw), 1, 2)


@pytest.mark.interop("JAX", "cpu", "reference (jax.numpy)", "attention under jit with traced positions, grad")
@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_attention_traced_positions(layout):
    """Causal GQA attention, jitted with a traced offset and traced (batch, S) positions, equals the eager NumPy
    backend (float32) and the float64 oracle; several key blocks (block_size=4) with a padded last one."""
    spec = rotary.RopeSpec(16, base=10000.0, layout=layout)
    q, k, v = _qkv(20)
    host = [np.asarray(a) for a in (q, k, v)]
    rng = np.random.default_rng(21)
    per_batch = np.sort(rng.integers(0, 10**6, (2, 11)), axis=1).astype(np.int32)
    f = jax.jit(lambda a, b, c, p: rotary.attention(a, b, c, p, causal=True, spec=spec, seq_axis=-3, block_size=4))
    for pos, full in ((jnp.int32(1000), np.arange(11) + 1000), (jnp.asarray(per_batch), per_batch)):
        o = f(q, k, v, pos)
        assert o.dtype == q.dtype and o.shape == q.shape[:-1] + (8,)
        eager = rotary.attention(*host, full, causal=True, spec=spec, seq_axis=-3, backend="numpy", block_size=4)
        assert_close(o, eager, rtol=2e-6, atol=2e-6)
        assert_close(o, _attention_oracle(q, k, v, full, full, spec, causal=True), rtol=1e-5, atol=1e-5)
    # explicit q/k positions with a sliding window; fewer queries than keys (a chunk after a cache)
    g = jax.jit(lambda a, b, c, qp, kp: rotary.attention(a, b, c, q_positions=qp, k_positions=kp, causal=True,
                                                         window=5, spec=spec, seq_axis=-3))
    o = g(q[:, 7:], k, v, jnp.arange(7, 11) + 3, jnp.int32(3))
    assert_close(o, _attention_oracle(q[:, 7:], k, v, np.arange(7, 11) + 3, np.arange(11) + 3, spec, causal=True,
                                      window=5), rtol=1e-5, atol=1e-5)
    # non-causal (positions rotate only) and a traced scale
    h = jax.jit(lambda a, b, c, p, s: rotary.attention(a, b, c, p, scale=s, spec=spec, seq_axis=-3))
    o = h(q, k, v, jnp.int32(77), jnp.float32(0.3))
    assert_close(o, _attention_oracle(q, k, v, np.arange(11) + 77, np.arange(11) + 77, spec, scale=0.3),
                 rtol=1e-5, atol=1e-5)


def test_attention_traced_positions_nan_rules_and_softcap():
    """The traced path keeps the frontend's rules: a hidden key's NaN value reaches no query (query 5 sees it);
    a query whose window holds no key gets 0; soft-capping as on the host."""
    spec = rotary.RopeSpec(16, base=10000.0)
    q, k, v = _qkv(70, s=6)
    v = v.at[:, 5, 1, 2].set(jnp.nan)
    kw = dict(causal=True, softcap=5.0, spec=spec, seq_axis=-3, block_size=4)
    o = jax.jit(lambda a, b, c, p: rotary.attention(a, b, c, p, **kw))(q, k, v, jnp.int32(3))
    eager = rotary.attention(*(np.asarray(a) for a in (q, k, v)), 3, backend="numpy", **kw)
    np.testing.assert_array_equal(np.isnan(np.asarray(o)), np.isnan(eager))
    assert np.isnan(eager[:, 5, 2:, 2]).all() and not np.isnan(eager[:, :5]).any()
    assert_close(jnp.nan_to_num(o), np.nan_to_num(eager), rtol=2e-6, atol=2e-6)
    o = jax.jit(lambda a, b, c, qp: rotary.attention(a, b, c, q_positions=qp, k_positions=0, causal=True, window=2,
                                                     spec=spec, seq_axis=-3))(q[:, :1], k, v, jnp.int32(9))
    assert not bool(jnp.any(o))                             # keys 0..5, window [8, 9]: none visible


def test_attention_decode_loop_carries_its_position():
    """A jitted decode loop (lax.fori_loop) whose carry holds the position: query t sees the cache's keys
    0..t; the outputs equal one causal call over the whole sequence."""
    spec = rotary.RopeSpec(16, base=10000.0)
    q, k, v = _qkv(30, s=9)

    @jax.jit
    def decode(q, k, v, start):
        def body(t, carry):
            out, pos = carry
            qt = jax.lax.dynamic_slice_in_dim(q, t, 1, axis=1)
            o = rotary.attention(qt, k, v, q_positions=pos, k_positions=start, causal=True, spec=spec, seq_axis=-3)
            return jax.lax.dynamic_update_slice_in_dim(out, o, t, axis=1), pos + 1

        out = jnp.zeros(q.shape[:-1] + (v.shape[-1],), q.dtype)
        return jax.lax.fori_loop(0, q.shape[1], body, (out, start))[0]

    o = decode(q, k, v, jnp.int32(40))
    expect = rotary.attention(*(np.asarray(a) for a in (q, k, v)), 40, causal=True, spec=spec, seq_axis=-3)
    assert_close(o, expect, rtol=2e-6, atol=2e-6)
    assert_close(o, _attention_oracle(q, k, v, np.arange(9) + 40, np.arange(9) + 40, spec, causal=True),
                 rtol=1e-5, atol=1e-5)


def test_attention_grad_with_traced_positions():
    spec = rotary.RopeSpec(16, base=10000.0)
    q, k, v = _qkv(40, s=7)
    pos = np.array([[3, 5, 8, 13, 21, 34, 55], [0, 1, 2, 3, 4, 5, 6]], np.int32)

    def loss(a, b, c, p):
        return (rotary.attention(a, b, c, p, causal=True, spec=spec, seq_axis=-3, block_size=3) ** 2).sum()

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, jnp.asarray(pos))
    static = jax.grad(lambda a, b, c: loss(a, b, c, pos), argnums=(0, 1, 2))(q, k, v)   # concrete positions
    for g, s in zip(grads, static):
        assert bool(jnp.all(jnp.isfinite(g)))
        assert_close(g, np.asarray(s, np.float64), rtol=2e-5, atol=2e-5)
    eps = 1e-3                                            # a central difference of the float64 oracle
    for i, (idx, arr) in enumerate((((1, 4, 3, 2), q), ((0, 2, 1, 5), k), ((1, 6, 0, 7), v))):
        d = np.zeros(arr.shape)
        d[idx] = eps
        args = [np.asarray(a, np.float64) for a in (q, k, v)]
        up, down = list(args), list(args)
        up[i], down[i] = args[i] + d, args[i] - d
        num = ((_attention_oracle(*up, pos, pos, spec, causal=True) ** 2).sum()
               - (_attention_oracle(*down, pos, pos, spec, causal=True) ** 2).sum()) / (2 * eps)
        assert abs(float(grads[i][idx]) - num) < 2e-3 * max(1.0, abs(num))


@pytest.mark.interop("JAX", "cpu", "reference (jax.numpy)", "linear attention under jit with traced positions, scan")
def test_linear_attention_traced_positions_and_scan_decode():
    spec = rotary.RopeSpec(16, base=10000.0)
    q, k, v = _x((2, 12, 2, 16), 50), _x((2, 12, 2, 16), 51), _x((2, 12, 2, 8), 52)
    host = [np.asarray(a) for a in (q, k, v)]
    f = jax.jit(lambda a, b, c, p: rotary.linear_attention(a, b, c, p, causal=True, spec=spec, seq_axis=-3))
    per_batch = np.stack([np.arange(12) + 10**6, np.arange(12) * 3]).astype(np.int32)
    for pos, full in ((jnp.int32(500), np.arange(12) + 500), (jnp.asarray(per_batch), per_batch)):
        o = f(q, k, v, pos)
        eager = rotary.linear_attention(*host, full, causal=True, spec=spec, seq_axis=-3, backend="numpy")
        assert_close(o, eager, rtol=2e-5, atol=2e-5)
        expect = linear_attention_quadratic(*(_bhsd(a) for a in (q, k, v)), np.asarray(full)[:, None] if
                                            np.ndim(full) == 2 else full, spec.inv_freq(), causal=True)
        assert_close(o, np.moveaxis(expect, 1, 2), rtol=2e-5, atol=2e-5)
    # prefill 4 tokens eagerly, then a jitted lax.scan of one-token steps carrying the state (a pytree) with
    # its traced next position
    o0, st = rotary.linear_attention(q[:, :4], k[:, :4], v[:, :4], 100, causal=True, spec=spec, seq_axis=-3,
                                     return_state=True)

    def step(state, qkv):
        a, b, c = (x[:, None] for x in qkv)
        o, state = rotary.linear_attention(a, b, c, causal=True, seq_axis=-3, state=state, return_state=True)
        return state, o[:, 0]

    run = jax.jit(lambda state, xs: jax.lax.scan(step, state, xs))
    st_end, outs = run(st, tuple(jnp.moveaxis(a[:, 4:], 1, 0) for a in (q, k, v)))
    o = jnp.concatenate([o0, jnp.moveaxis(outs, 0, 1)], axis=1)
    whole = rotary.linear_attention(*host, 100, causal=True, spec=spec, seq_axis=-3, backend="numpy",
                                    return_state=True)
    assert_close(o, whole[0], rtol=2e-5, atol=2e-5)
    expect = linear_attention_quadratic(*(_bhsd(a) for a in (q, k, v)), np.arange(12) + 100, spec.inv_freq(),
                                        causal=True)
    assert_close(o, np.moveaxis(expect, 1, 2), rtol=2e-5, atol=2e-5)
    assert int(st_end.next_position) == 112 and st_end.spec == spec
    assert_close(st_end.S, whole[1].S, rtol=2e-5, atol=2e-5)
    # the jitted loop's state continues eagerly (its next position is a concrete JAX array)
    o13 = rotary.linear_attention(q[:, :1], k[:, :1], v[:, :1], causal=True, seq_axis=-3, state=st_end)
    expect = rotary.linear_attention(host[0][:, :1], host[1][:, :1], host[2][:, :1], causal=True, seq_axis=-3,
                                     state=whole[1])
    assert_close(o13, expect, rtol=2e-5, atol=2e-5)


def test_values_that_must_be_static_say_so():
    q, k, v = _qkv(60, s=5)
    dynamic = rotary.RopeSpec(16, scaling={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=8)
    cases = [
        ("causal", lambda p, c: rotary.attention(q, k, v, p, causal=c, seq_axis=-3), (jnp.int32(0), True)),
        ("window", lambda p, w: rotary.attention(q, k, v, p, causal=True, window=w, seq_axis=-3),
         (jnp.int32(0), 3)),
        ("block_size", lambda p, b: rotary.attention(q, k, v, p, block_size=b, seq_axis=-3), (jnp.int32(0), 2)),
        ("q_positions", lambda p, cu: rotary.attention(q[0], k[0], v[0], q_positions=p, k_positions=p, seq_axis=0,
                                                       cu_seqlens=np.array([0, 2, 5])), (jnp.arange(5), 0)),
        ("positions", lambda p, _: rotary.attention(q, k, v, p, spec=dynamic, seq_axis=-3), (jnp.int32(0), 0)),
        ("decay", lambda p, d: rotary.linear_attention(q, q, q, p, causal=True, decay=d, seq_axis=-3),
         (jnp.int32(0), 0.9)),
        ("positions", lambda p, _: rotary.linear_attention(q[0], q[0], q[0], p, seq_axis=0,
                                                           cu_seqlens=np.array([0, 2, 5])), (jnp.arange(5), 0)),
    ]
    for name, fn, args in cases:
        with pytest.raises(ValueError, match=rf"{name}.*static_argnums.*static_argnames"):
            jax.jit(fn)(*args)
