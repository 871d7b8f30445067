"""Rough edges a new user meets integrating rotary (issue 44): HF's (1, seq) position_ids with a batch, a
NumPy-made LinearAttentionState as a lax.scan carry, float32 attention with a softcap float32 cannot hold, and the
errors of ``angles=``."""

import subprocess
import sys

import numpy as np
import pytest

import rotary
from rotary.testing import assert_close

from .conftest import AVAILABLE


# -- (1, seq) positions broadcast over the batch (as NumPy and HF do), never onto heads ----------------------
@pytest.mark.parametrize("shape, seq_axis", [((2, 5, 3, 8), -3), ((2, 3, 5, 8), -2), ((2, 5, 8), -2)])
@pytest.mark.parametrize("backend", AVAILABLE[:2])
def test_one_row_of_positions_broadcasts_over_the_batch(shape, seq_axis, backend):
    x = np.random.default_rng(0).standard_normal(shape)
    ids = np.arange(4, 9)[None]
    want = rotary.apply(x, ids[0], seq_axis=seq_axis, backend=backend)
    assert_close(rotary.apply(x, ids, seq_axis=seq_axis, backend=backend), want, rtol=0, atol=0)
    assert_close(rotary.apply(x, np.repeat(ids, 2, axis=0), seq_axis=seq_axis, backend=backend), want, rtol=0, atol=0)
    q, k = rotary.apply_qk(x, x[:, :2] if seq_axis == -2 and len(shape) == 4 else x, ids, seq_axis=seq_axis,
                           backend=backend)
    assert_close(q, want, rtol=0, atol=0)
    rope = rotary.Rope(rotary.RopeSpec(8), seq_axis=seq_axis, backend=backend, dtype=np.float64)
    for _ in range(2):   # the first call plans, the second takes the prepared path
        assert_close(rope.apply(x, ids), want, rtol=0, atol=0)


def test_one_row_of_positions_in_attention_and_linear_attention():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((3, 6, h, 8)) for h in (4, 2, 2))
    ids = np.arange(10, 16)[None]
    for fn in (rotary.attention, rotary.linear_attention):
        want = fn(q, k, v, ids[0], causal=True, seq_axis=-3)
        assert_close(fn(q, k, v, ids, causal=True, seq_axis=-3), want, rtol=0, atol=0)


def test_one_row_of_multi_axis_positions_broadcasts():
    spec = rotary.RopeSpec(16, mrope_section=(2, 3, 3))
    x = np.random.default_rng(2).standard_normal((2, 5, 16))
    pos = np.random.default_rng(3).integers(0, 50, (1, 5, 3))
    assert_close(rotary.apply(x, pos, spec=spec, seq_axis=-2, backend="numpy"),
                 rotary.apply(x, pos[0], spec=spec, seq_axis=-2, backend="numpy"), rtol=0, atol=0)


def test_positions_still_never_broadcast_onto_heads():
    x = np.zeros((2, 4, 5, 8), dtype=np.float32)   # (B, H, S, D): positions (H, S) must not pass as (B, S)
    with pytest.raises(ValueError, match="never broadcast"):
        rotary.apply(x, np.zeros((4, 5), dtype=int), seq_axis=-2)
    with pytest.raises(ValueError, match="no batch axis"):   # (S, D): no batch axis a leading 1 could mean
        rotary.apply(np.zeros((5, 8), dtype=np.float32), np.zeros((1, 5), dtype=int), seq_axis=-2)
    with pytest.raises(ValueError, match="never broadcast"):   # 3 rows for a batch of 2
        rotary.apply(x, np.zeros((3, 5), dtype=int), seq_axis=-2)


def test_hf_position_ids_with_a_batch_on_torch_tensors():
    torch = pytest.importorskip("torch")
    q, k = torch.randn(3, 4, 6, 8), torch.randn(3, 2, 6, 8)   # HF's (B, H, S, D) with its (1, S) position_ids
    pos = torch.arange(6)[None]
    got = rotary.apply_qk(q, k, pos, seq_axis=-2)
    want = rotary.apply_qk(q, k, pos[0], seq_axis=-2)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_one_row_of_positions_with_jax_concrete_and_traced():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    x = jnp.asarray(np.random.default_rng(6).standard_normal((2, 5, 3, 8)), jnp.float32)
    k = x[:, :, :1]
    p = jnp.arange(3, 8)[None]
    want = rotary.apply(x, p[0], seq_axis=-3)
    assert_close(rotary.apply(x, p, seq_axis=-3), want, rtol=0, atol=0)
    assert_close(jax.jit(lambda x, p: rotary.apply(x, p, seq_axis=-3))(x, p), want, rtol=1e-6, atol=1e-6)
    for fn in (rotary.attention, rotary.linear_attention):
        want = fn(x, k, k, p[0], causal=True, seq_axis=-3)
        got = jax.jit(lambda q, k, p: fn(q, k, k, p, causal=True, seq_axis=-3))(x, k, p)
        assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_one_row_of_positions_with_dask():
    da = pytest.importorskip("dask.array")
    x = np.random.default_rng(7).standard_normal((2, 5, 3, 8))
    d = da.from_array(x, chunks=(1, 5, 3, 8))
    ids = np.arange(3, 8)[None]
    assert_close(rotary.apply(d, ids, seq_axis=-3).compute(), rotary.apply(x, ids[0], seq_axis=-3), rtol=0, atol=0)


# -- a LinearAttentionState made by NumPy is a JAX pytree before any JAX call into rotary -----------------------
_SCAN = """
import sys
{first}
import numpy as np
q = np.random.default_rng(0).standard_normal((1, 4, 2, 8)).astype(np.float32)
o, state = rotary.linear_attention(q, q, q, causal=True, seq_axis=-3, return_state=True)
assert 'jax' not in sys.modules or {jax_first}
{then}
import jax, jax.numpy as jnp
def body(st, x):
    return st, x
carry, _ = jax.lax.scan(body, state, jnp.arange(3))
leaves = jax.tree_util.tree_leaves(carry)
assert len(leaves) == 3 and carry.spec == state.spec, leaves
print("ok")
"""


@pytest.mark.interop("JAX", "cpu", "reference (jax.numpy)", "a NumPy-made linear-attention state as a scan carry")
@pytest.mark.parametrize("order", ["rotary-then-jax", "jax-then-rotary"])
def test_numpy_state_is_a_scan_carry_without_a_jax_call(order):
    pytest.importorskip("jax")
    if order == "rotary-then-jax":
        code = _SCAN.format(first="import rotary", jax_first="False", then="")
    else:
        code = _SCAN.format(first="import jax\nimport rotary", jax_first="True", then="")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]


def test_import_rotary_does_not_import_jax():
    code = "import sys, rotary; print('jax' in sys.modules, 'torch' in sys.modules)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.split() == ["False", "False"], run.stderr[-2000:]


# -- float32 attention with a softcap float32 cannot hold -----------------------------------------------------
@pytest.mark.parametrize("softcap", [1e39, 1e300, 1e-46, 1e-40])
@pytest.mark.parametrize("backend", AVAILABLE[:2])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_softcap_outside_float32_is_refused_for_float32_work(softcap, backend, dtype):
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((5, 2, 8)).astype(dtype) for _ in range(3))
    with pytest.raises(ValueError, match="softcap"):
        rotary.attention(q, k, v, causal=True, seq_axis=0, softcap=softcap, backend=backend)
    # float64 holds it: the call runs and gives finite values
    o = rotary.attention(*(a.astype(np.float64) for a in (q, k, v)), causal=True, seq_axis=0, softcap=softcap,
                         backend=backend)
    assert np.all(np.isfinite(o))


@pytest.mark.parametrize("softcap", [3e38, 1e-30, 50.0])
def test_softcap_within_float32_still_runs(softcap):
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((5, 2, 8)).astype(np.float32) for _ in range(3))
    o = rotary.attention(q, k, v, causal=True, seq_axis=0, softcap=softcap)
    o64 = rotary.attention(*(a.astype(np.float64) for a in (q, k, v)), causal=True, seq_axis=0, softcap=softcap)
    assert_close(o, o64, rtol=1e-5, atol=1e-5)


def test_softcap_refused_with_a_large_scale():
    """What matters is scale / softcap (folded into q): finite in float32."""
    q = np.ones((4, 1, 8), np.float32)
    with pytest.raises(ValueError, match="softcap"):
        rotary.attention(q, q, q, causal=True, seq_axis=0, softcap=1e-36, scale=1e3)


# -- angles= errors name angles ----------------------------------------------------------------------------
def test_angles_wrong_batch_names_angles():
    x = np.ones((2, 5, 3, 8))
    with pytest.raises(ValueError) as info:
        rotary.apply(x, seq_axis=-3, angles=np.zeros((3, 5, 4)))
    message = str(info.value)
    assert "angles" in message and "(3, 5, 4)" in message and "positions" not in message, message
    with pytest.raises(ValueError, match=r"angles of shape \(2, 5, 4\)"):   # no batch axis at all
        rotary.apply(np.ones((5, 8)), seq_axis=0, angles=np.zeros((2, 5, 4)))
    # a leading 1 broadcasts over the batch, as positions do
    one = rotary.apply(x, seq_axis=-3, angles=np.full((1, 5, 4), 0.25))
    assert_close(one, rotary.apply(x, seq_axis=-3, angles=np.full((5, 4), 0.25)), rtol=0, atol=0)


def test_angles_with_cu_seqlens_names_cu_seqlens():
    x = np.ones((5, 3, 8))
    with pytest.raises(ValueError) as info:
        rotary.apply(x, seq_axis=0, angles=np.zeros((5, 4)), cu_seqlens=np.array([0, 2, 5]))
    message = str(info.value)
    assert "cu_seqlens" in message and "not both" not in message, message
    with pytest.raises(ValueError, match="cu_seqlens"):
        rotary.apply_qk(x, x, seq_axis=0, angles=np.zeros((5, 4)), cu_seqlens=np.array([0, 2, 5]))
    with pytest.raises(ValueError, match="angles or positions, not both"):   # positions really passed
        rotary.apply(x, np.arange(5), seq_axis=0, angles=np.zeros((5, 4)))
