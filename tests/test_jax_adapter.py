"""JAX arrays: correct under jit, grad and vmap; positions static or traced; nothing traced is cached."""

import numpy as np
import pytest

import rotary
from rotary.spec import tables as _tables
from rotary.testing import assert_close, linear_attention_quadratic, rope_complex

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
    f = jax.jit(lambda a: rotary.apply(a, spec=SPEC))
    assert_close(f(x), _oracle(x, np.arange(8)))
    g = jax.grad(lambda a: rotary.apply(a, spec=SPEC).sum())(x)
    # d/dx sum(R x) = R^T 1 = the inverse rotation of ones
    assert_close(g, _oracle(np.ones(x.shape), np.arange(8), inverse=True))
    assert_close(jax.jit(lambda a: rotary.apply(a, 3, spec=SPEC) * 2)(x), 2 * _oracle(x, np.arange(8) + 3))
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
    y = jax.vmap(lambda a: rotary.apply(a, big, spec=SPEC))(x)
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
    f = jax.jit(lambda a, p: rotary.apply(a, p, spec=spec))
    for pos in (np.arange(6, dtype=np.int32), np.array([0, 2**31 - 1, -2**31, 7, -5, 2**24 + 3], np.int32)):
        assert_close(f(x, jnp.asarray(pos)), _oracle(x, pos, spec), atol=3e-6, rtol=3e-6)
    per_batch = np.array([[1, 2, 3, 4, 5, 6], [10**9, 10**9 + 1, 5, 4, 3, 2]], np.int32)
    assert_close(f(x, jnp.asarray(per_batch)), _oracle(x, per_batch[:, :], spec), atol=3e-6, rtol=3e-6)
    offset = jax.jit(lambda a, p: rotary.apply(a, p, spec=spec, inverse=True))(x, jnp.int32(1000))
    assert_close(offset, _oracle(x, np.arange(6) + 1000, spec, inverse=True), atol=3e-6, rtol=3e-6)
    g = jax.jit(jax.grad(lambda a, p: (rotary.apply(a, p, spec=spec) ** 2).sum()))(x, jnp.asarray(per_batch))
    assert_close(g, 2 * np.asarray(x, np.float64), atol=2e-5, rtol=2e-5)   # rotations keep norms


def test_traced_positions_need_static_for_length_dependent_specs():
    spec = rotary.RopeSpec(16, scaling={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=8)
    with pytest.raises(ValueError, match="static_argnums"):
        jax.jit(lambda a, p: rotary.apply(a, p, spec=spec))(_x((4, 16)), jnp.arange(4))


def test_errors():
    x = _x((4, 16))
    with pytest.raises(TypeError, match=r"out= is not supported for JAX arrays.*return value"):
        jax.jit(lambda a: rotary.apply(a, out=a))(x)
    with pytest.raises(ValueError, match="backend='numba' does not take JAX arrays"):
        rotary.apply(x, backend="numba")


@pytest.mark.interop("JAX", "cpu", "reference (jax.numpy)", "linear attention under jit, grad")
@pytest.mark.parametrize("causal", [False, True])
def test_linear_attention_jit_grad(causal):
    q, k, v = _x((2, 9, 16), 5), _x((2, 9, 16), 6), _x((2, 9, 8), 7)
    spec = rotary.RopeSpec(16)
    f = jax.jit(lambda a, b, c: rotary.linear_attention(a, b, c, causal=causal, spec=spec))
    exp = linear_attention_quadratic(q, k, v, np.arange(9), spec.inv_freq(), causal=causal)
    assert_close(f(q, k, v), exp, rtol=2e-5, atol=2e-5)
    g = jax.grad(lambda a: rotary.linear_attention(a, k, v, causal=causal, spec=spec).sum())(q)
    eps = 1e-3                                            # a central difference on one coordinate
    dq = np.zeros(q.shape, np.float32)
    dq[1, 4, 3] = eps
    num = (linear_attention_quadratic(np.asarray(q) + dq, k, v, np.arange(9), spec.inv_freq(), causal=causal).sum()
           - linear_attention_quadratic(np.asarray(q) - dq, k, v, np.arange(9), spec.inv_freq(), causal=causal).sum())
    assert abs(float(g[1, 4, 3]) - num / (2 * eps)) < 1e-3
    with pytest.raises(ValueError, match="concrete positions"):
        jax.jit(lambda a, p: rotary.linear_attention(a, a, a, p))(q, jnp.arange(9))


def test_vmap_over_traced_positions_and_state_resume_under_jit():
    rng = np.random.default_rng(11)
    xs = _x((3, 8, 16), 12)
    ps = rng.integers(0, 10**6, (3, 8)).astype(np.int32)
    y = jax.vmap(lambda a, p: rotary.apply(a, p))(xs, jnp.asarray(ps))
    for i in range(3):
        assert_close(y[i], rope_complex(np.asarray(xs[i], np.float64), ps[i], rotary.RopeSpec(16).inv_freq()),
                     atol=3e-6, rtol=3e-6)
    q, k, v = _x((30, 2, 16), 13), _x((30, 2, 16), 14), _x((30, 2, 8), 15)
    o1, st = rotary.linear_attention(q[:20], k[:20], v[:20], causal=True, seq_axis=-3, return_state=True)
    o2 = jax.jit(lambda a, b, c: rotary.linear_attention(a, b, c, causal=True, seq_axis=-3, state=st))(
        q[20:], k[20:], v[20:])
    expect = rotary.linear_attention(*(np.asarray(a) for a in (q, k, v)), causal=True, seq_axis=-3)
    assert_close(jnp.concatenate([o1, o2]), expect, rtol=1e-5, atol=1e-5)
