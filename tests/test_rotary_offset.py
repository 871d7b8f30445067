"""``rotary_offset``: a head laid out as [nope | rope | rest] rotates coordinates [off, off + rotary_dim)
in one call (MLA's [nope | rope] q/k heads; vLLM's rope_dim_offset, ggml's n_offs), every other
coordinate passing through bit for bit, on every backend and through every entry point."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

import rotary
from rotary import RopeSpec
from rotary.backends import available_backends
from rotary.testing import attention_quadratic, linear_attention_quadratic, rope_complex, tolerance

BACKENDS = [b for b in ("numpy", "numba") if available_backends()[b][0]]
#: (head_dim, rotary_dim, rotary_offset): DeepSeek MLA [nope 128 | rope 64], a rope block in the middle
#: of the head ([5 | 8 | 9]), and the default rotary_dim (the rest of the head from the offset)
GEOMETRIES = [(192, 64, 128), (22, 8, 5), (24, None, 8)]


def peer_rope(x, positions, spec):
    """vLLM-style float64 oracle: split the head into [nope | rope | rest], rotate the rope slice with
    explicit cos/sin (NeoX: first/second half; GPT-J: even/odd), concatenate. x (..., seq, heads, d),
    positions broadcastable to (..., seq); small positions (the plain product p * w is exact enough)."""
    x = np.asarray(x, np.float64)
    off, r = spec.rotary_offset, spec.rotary_dim
    nope, rot, rest = x[..., :off], x[..., off:off + r], x[..., off + r:]
    theta = np.asarray(positions, np.float64)[..., None] * spec.inv_freq()
    cos = (np.cos(theta) * spec.attention_scaling)[..., None, :]   # (..., seq, 1, r/2): shared by the heads
    sin = (np.sin(theta) * spec.attention_scaling)[..., None, :]
    if spec.layout == "half":
        x1, x2 = rot[..., :r // 2], rot[..., r // 2:]
        rot = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rot = np.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(rot.shape)
    return np.concatenate([nope, rot, rest], axis=-1)


def _passthrough(spec):
    """Index of the coordinates that must pass through unchanged."""
    keep = np.ones(spec.head_dim, bool)
    keep[spec.rotary_offset:spec.rotary_offset + spec.rotary_dim] = False
    return keep


@pytest.fixture
def rng():
    return np.random.default_rng(7)


# -- rotation -----------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("head_dim,rotary_dim,offset", GEOMETRIES)
def test_rotates_the_slice_and_passes_the_rest_through(backend, layout, dtype, head_dim, rotary_dim, offset, rng):
    spec = RopeSpec(head_dim, rotary_dim=rotary_dim, rotary_offset=offset, layout=layout)
    B, S, H = 2, 7, 3
    x = rng.standard_normal((B, S, H, head_dim)).astype(dtype)
    x0 = x.copy()
    pos = rng.integers(0, 90, size=(B, S))
    want = peer_rope(x, pos, spec)
    y = rotary.apply(x, pos, spec=spec, seq_axis=-3, backend=backend)
    rtol, atol = tolerance(dtype)
    np.testing.assert_allclose(y.astype(np.float64), want, rtol=rtol, atol=atol)
    keep = _passthrough(spec)
    assert np.array_equal(y[..., keep], x[..., keep]) and np.array_equal(x, x0)   # bit for bit; x untouched
    out = np.full_like(x, np.nan)
    assert rotary.apply(x, pos, spec=spec, seq_axis=-3, backend=backend, out=out) is out
    assert np.array_equal(out, y)
    inplace = x.copy()
    assert rotary.apply(inplace, pos, spec=spec, seq_axis=-3, backend=backend, out=inplace) is inplace
    assert np.array_equal(inplace, y)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_views_and_inverse(backend, rng):
    """A BHSD view of a fused buffer, in place, then the inverse: back to the input (pass-through exact)."""
    spec = RopeSpec(40, rotary_dim=16, rotary_offset=12, layout="interleaved")
    fused = rng.standard_normal((2, 9, 3, 2 * 40))            # (B, S, H, [q | k]) -> q is a strided view
    q = fused[..., :40].transpose(0, 2, 1, 3)                 # (B, H, S, d), seq_axis=-2
    q0, k_part = q.copy(), fused[..., 40:].copy()
    y = rotary.apply(q, 5, spec=spec, backend=backend, seq_axis=-2)
    np.testing.assert_allclose(y, np.swapaxes(peer_rope(np.swapaxes(q, 1, 2), np.arange(9) + 5, spec), 1, 2),
                               rtol=1e-12, atol=1e-12)
    rotary.apply(q, 5, spec=spec, backend=backend, out=q, seq_axis=-2)
    assert np.array_equal(q, y) and np.array_equal(fused[..., 40:], k_part)   # the neighbour untouched
    back = rotary.apply(q, 5, spec=spec, backend=backend, inverse=True, seq_axis=-2)
    np.testing.assert_allclose(back, q0, rtol=1e-12, atol=1e-12)
    assert np.array_equal(back[..., _passthrough(spec)], q0[..., _passthrough(spec)])


@pytest.mark.parametrize("backend", BACKENDS)
def test_apply_qk_gqa_and_the_rope_object(backend, rng):
    spec = RopeSpec(48, rotary_dim=16, rotary_offset=32, layout="interleaved")   # an MLA-like [32 | 16] head
    q = rng.standard_normal((6, 4, 48)).astype(np.float32)
    k = rng.standard_normal((6, 1, 48)).astype(np.float32)
    pos = np.arange(6) + 40
    rq, rk = rotary.apply_qk(q, k, pos, spec=spec, seq_axis=-3, backend=backend)
    rtol, atol = tolerance("float32")
    np.testing.assert_allclose(rq, peer_rope(q, pos, spec), rtol=rtol, atol=atol)
    np.testing.assert_allclose(rk, peer_rope(k, pos, spec), rtol=rtol, atol=atol)
    rope = rotary.Rope(spec, backend=backend, dtype=np.float32, seq_axis=-2)
    for _ in range(3):   # first call validates, later calls would take the prepared path
        oq, ok = rope(q, k, pos, seq_axis=-3)
        assert np.array_equal(oq, rq) and np.array_equal(ok, rk)
    qi, ki = q.copy(), k.copy()
    rope(qi, ki, pos, seq_axis=-3, out=(qi, ki))
    assert np.array_equal(qi, rq) and np.array_equal(ki, rk)
    assert np.array_equal(rope.apply(q, pos, seq_axis=-3), rq)


def test_spec_keywords_on_apply(rng):
    x = rng.standard_normal((5, 20))
    a = rotary.apply(x, rotary_offset=4, rotary_dim=8, layout="interleaved", seq_axis=-2)
    b = rotary.apply(x, spec=RopeSpec(20, rotary_dim=8, rotary_offset=4, layout="interleaved"), seq_axis=-2)
    assert np.array_equal(a, b)
    np.testing.assert_allclose(a, peer_rope(x[:, None], np.arange(5), RopeSpec(20, rotary_dim=8, rotary_offset=4,
                                                                                  layout="interleaved"))[:, 0],
                               rtol=1e-12, atol=1e-12)


def test_packed_batch_equals_one_call_per_sequence(rng):
    spec = RopeSpec(24, rotary_dim=8, rotary_offset=10)
    cu = np.array([0, 3, 8, 12])
    x = rng.standard_normal((12, 2, 24))
    y = rotary.apply(x, spec=spec, seq_axis=0, cu_seqlens=cu, seqlen_offsets=[0, 7, 100])
    for n, start in enumerate((0, 7, 100)):
        part = x[cu[n]:cu[n + 1]]
        np.testing.assert_allclose(y[cu[n]:cu[n + 1]], peer_rope(part, np.arange(len(part)) + start, spec),
                                   rtol=1e-12, atol=1e-12)


def test_multi_axis_spec_with_offset(rng):
    """M-RoPE behind 8 unrotated coordinates: pair i reads coordinate pair_axes[i], from coordinate 8 on."""
    inner = RopeSpec(24, mrope_section=(4, 4, 4), layout="half")
    spec = inner.replace(head_dim=32, rotary_offset=8)
    assert spec.multi_axis and spec.rotary_dim == 24 and spec.pair_axes().tolist() == inner.pair_axes().tolist()
    x = rng.standard_normal((10, 3, 32))
    pos = rng.integers(0, 50, size=(10, 3))
    y = rotary.apply(x, pos, spec=spec, seq_axis=0)
    want = rope_complex(np.swapaxes(x, 0, 1), pos, spec.inv_freq(), layout="half", pair_axes=spec.pair_axes(),
                        rotary_offset=8)
    np.testing.assert_allclose(y, np.swapaxes(want, 0, 1), rtol=1e-12, atol=1e-12)
    assert np.array_equal(y[..., :8], x[..., :8])


def test_scaled_and_custom_frequencies_see_the_head_from_the_offset():
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    a = RopeSpec(64, scaling=yarn, max_position_embeddings=256)
    b = RopeSpec(192, rotary_offset=128, scaling=yarn, max_position_embeddings=256)
    assert b.rotary_dim == 64
    np.testing.assert_array_equal(a.inv_freq(), b.inv_freq())
    assert a.attention_scaling == b.attention_scaling
    custom = RopeSpec.from_inv_freq([1.0, 0.5, -0.25], head_dim=6).replace(head_dim=10, rotary_offset=4)
    assert custom.inv_freq().tolist() == [1.0, 0.5, -0.25]


# -- the spec -----------------------------------------------------------------------------------
def test_spec_value_semantics():
    spec = RopeSpec(192, rotary_dim=64, rotary_offset=128, layout="interleaved")
    plain = RopeSpec(192, rotary_dim=64, layout="interleaved")
    assert spec != plain and hash(spec) != hash(plain)
    assert spec == RopeSpec(192, rotary_dim=64, rotary_offset=128, layout="interleaved")
    assert "rotary_offset=128" in repr(spec) and "rotary_offset" not in repr(plain)
    assert "rotary_dim" not in repr(spec)   # the default: the rest of the head
    assert pickle.loads(pickle.dumps(spec)) == spec
    assert spec.replace(rotary_offset=0) == plain
    assert eval(repr(spec), {"RopeSpec": RopeSpec}) == spec
    a, b = spec.pair_indices()
    assert a.tolist()[:2] == [128, 130] and b.tolist()[:2] == [129, 131] and b.max() == 191
    assert RopeSpec(23, rotary_offset=4).rotary_dim == 18      # odd rest: its last coordinate passes through
    assert RopeSpec(24, rotary_offset=np.int64(4)).rotary_offset == 4


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(rotary_offset=-1), ValueError, ("rotary_offset", ">= 0")),
    (dict(rotary_offset=2.0), TypeError, ("rotary_offset", "integer")),
    (dict(rotary_offset=True), TypeError, ("rotary_offset", "bool")),
    (dict(rotary_offset="4"), TypeError, ("rotary_offset", "integer")),
    (dict(rotary_offset=12, rotary_dim=16), ValueError, ("rotary_offset + rotary_dim (12 + 16)", "head_dim (24)")),
    (dict(rotary_offset=23), ValueError, ("head_dim - rotary_offset", ">= 2")),
])
def test_bad_rotary_offset(kwargs, error, words):
    with pytest.raises(error) as info:
        RopeSpec(24, **kwargs)
    assert type(info.value) is error and all(w in str(info.value) for w in words), str(info.value)


def test_head_dim_mismatch_names_the_offset():
    with pytest.raises(ValueError, match=r"spec.head_dim \(24\) does not match x.shape\[-1\] \(20\).*rotary_offset=8"):
        rotary.apply(np.ones((3, 20)), spec=RopeSpec(24, rotary_offset=8), seq_axis=-2)


# -- rerotate, attention, linear attention --------------------------------------------------------
def test_rerotate_moves_keys_and_keeps_the_nope_part(rng):
    spec = RopeSpec(40, rotary_dim=16, rotary_offset=24, layout="interleaved")
    k = rng.standard_normal((2, 8, 40))
    rotated = rotary.apply(k, 10, spec=spec, seq_axis=-2)
    moved = rotary.rerotate(rotated, 10, 3, spec=spec, seq_axis=-2)
    np.testing.assert_allclose(moved, peer_rope(np.swapaxes(k, 0, 1), np.arange(8) + 3, spec).swapaxes(0, 1),
                               rtol=1e-12, atol=1e-12)
    assert np.array_equal(moved[..., :24], k[..., :24])
    with pytest.raises(ValueError, match="rotary_offset"):
        rotary.rerotate(rotated, 10, 3, spec=spec, to_spec=spec.replace(rotary_offset=0), seq_axis=-2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_rotates_q_and_k_from_the_offset(backend, rng):
    spec = RopeSpec(24, rotary_dim=8, rotary_offset=16, layout="interleaved", softmax_scale_factor=1.5)
    q = rng.standard_normal((2, 4, 6, 24))     # (B, H, S, d)
    k = rng.standard_normal((2, 2, 9, 24))
    v = rng.standard_normal((2, 2, 9, 5))
    o = rotary.attention(q, k, v, spec=spec, causal=True, backend=backend, seq_axis=-2)
    kp = np.arange(9)
    want = attention_quadratic(q, k, v, kp[3:], kp, spec.inv_freq(), layout="interleaved", causal=True,
                               scale=1.5 / np.sqrt(24), rotary_offset=16)
    np.testing.assert_allclose(o, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [True, False])
def test_linear_attention_from_the_offset_and_resume(backend, causal, rng):
    spec = RopeSpec(12, rotary_dim=6, rotary_offset=4, base=100.0)
    q, k = rng.standard_normal((2, 3, 10, 12)), rng.standard_normal((2, 3, 10, 12))
    v = rng.standard_normal((2, 3, 10, 5))
    o = rotary.linear_attention(q, k, v, spec=spec, causal=causal, backend=backend, seq_axis=-2)
    want = linear_attention_quadratic(q, k, v, np.arange(10), spec.inv_freq(), causal=causal, rotary_offset=4)
    np.testing.assert_allclose(o, want, rtol=1e-10, atol=1e-10)
    if causal:   # split and resume: the state carries the head's own feature order
        o1, state = rotary.linear_attention(q[:, :, :6], k[:, :, :6], v[:, :, :6], spec=spec, causal=True,
                                            backend=backend, return_state=True, seq_axis=-2)
        o2 = rotary.linear_attention(q[:, :, 6:], k[:, :, 6:], v[:, :, 6:], causal=True, backend=backend, state=state, seq_axis=-2)
        np.testing.assert_allclose(np.concatenate([o1, o2], axis=2), want, rtol=1e-10, atol=1e-10)
        # z sums phi(k) over the tokens: coordinate j of the state is coordinate j of the head
        z = np.asarray(state.z).reshape(2, 3, 12)
        phi_k = np.where(k[:, :, :6] > 0, k[:, :, :6] + 1.0, np.exp(k[:, :, :6]))
        np.testing.assert_allclose(z, phi_k.sum(axis=2), rtol=1e-10, atol=1e-10)


# -- layout conversion ------------------------------------------------------------------------------
def test_convert_layout_and_permute_weights_with_offset(rng):
    x = rng.standard_normal((5, 3, 20))
    inter = RopeSpec(20, rotary_dim=8, rotary_offset=6, layout="interleaved")
    half = inter.replace(layout="half")
    conv = lambda a: rotary.convert_layout(a, to="half", rotary_dim=8, rotary_offset=6)
    np.testing.assert_allclose(rotary.apply(conv(x), spec=half, seq_axis=0),
                               conv(rotary.apply(x, spec=inter, seq_axis=0)), rtol=1e-12, atol=1e-12)
    assert np.array_equal(conv(x)[..., :6], x[..., :6]) and np.array_equal(conv(x)[..., 14:], x[..., 14:])
    w = rng.standard_normal((3 * 20, 7))
    pw = rotary.permute_weights(w, 3, head_dim=20, rotary_dim=8, rotary_offset=6, to="half")
    np.testing.assert_array_equal(pw.reshape(3, 20, 7), conv(w.reshape(3, 20, 7).swapaxes(1, 2)).swapaxes(1, 2))


# -- adapters -------------------------------------------------------------------------------------
def _reference(x, spec, pos):
    return rotary.apply(np.asarray(x, np.float32), pos, spec=spec, backend="numpy", seq_axis=-2)


def test_torch_adapter(rng):
    torch = pytest.importorskip("torch")
    spec = RopeSpec(24, rotary_dim=8, rotary_offset=12, layout="interleaved")
    x = rng.standard_normal((2, 6, 24)).astype(np.float32)
    t = torch.tensor(x, requires_grad=True)
    y = rotary.apply(t, 3, spec=spec, seq_axis=-2)
    assert isinstance(y, torch.Tensor)
    np.testing.assert_array_equal(y.detach().numpy(), _reference(x, spec, 3))
    y.sum().backward()   # the gradient of a rotation is the inverse rotation of ones
    np.testing.assert_allclose(t.grad.numpy(), rotary.apply(np.ones_like(x), 3, spec=spec, inverse=True, seq_axis=-2),
                               rtol=1e-6, atol=1e-6)
    tb = torch.tensor(x).to(torch.bfloat16)
    yb = rotary.apply(tb, 3, spec=spec, seq_axis=-2)
    assert yb.dtype == torch.bfloat16 and torch.equal(yb[..., :12], tb[..., :12])


def test_jax_adapter_concrete_and_traced(rng):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    spec = RopeSpec(24, rotary_dim=8, rotary_offset=12)
    x = rng.standard_normal((2, 6, 24)).astype(np.float32)
    want = _reference(x, spec, np.arange(6) + 3)
    np.testing.assert_allclose(np.asarray(rotary.apply(jnp.asarray(x), 3, spec=spec, seq_axis=-2)), want, rtol=2e-6, atol=2e-6)
    traced = jax.jit(lambda a, p: rotary.apply(a, p, spec=spec, seq_axis=-2))(jnp.asarray(x), jnp.arange(6) + 3)
    np.testing.assert_allclose(np.asarray(traced), want, rtol=2e-6, atol=2e-6)
    assert np.array_equal(np.asarray(traced)[..., :12], x[..., :12])


def test_dask_adapter(rng):
    da = pytest.importorskip("dask.array")
    spec = RopeSpec(24, rotary_dim=8, rotary_offset=12)
    x = rng.standard_normal((4, 10, 24)).astype(np.float32)
    y = rotary.apply(da.from_array(x, chunks=(2, 5, 24)), spec=spec, seq_axis=-2)
    np.testing.assert_array_equal(y.compute(), _reference(x, spec, None))


def test_bfloat16_numpy(rng):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    spec = RopeSpec(24, rotary_dim=8, rotary_offset=12)
    x = rng.standard_normal((2, 6, 24)).astype(ml_dtypes.bfloat16)
    y = rotary.apply(x, spec=spec, seq_axis=-2)
    assert y.dtype == x.dtype and np.array_equal(y[..., :12].view(np.uint16), x[..., :12].view(np.uint16))
    np.testing.assert_allclose(y.astype(np.float64), peer_rope(x.astype(np.float64)[:, :, None], np.arange(6), spec)[:, :, 0],
                               rtol=1.6e-2, atol=1.6e-2)


# -- HF configs: MLA's whole q/k head and DeepSeek-V3.2's DSA indexer --------------------------------
def _hf_module(family):
    transformers = pytest.importorskip("transformers")
    import importlib

    try:
        return transformers.AutoConfig.for_model(family), importlib.import_module(
            f"transformers.models.{family}.modeling_{family}")
    except (ImportError, ValueError, KeyError):
        pytest.skip(f"transformers has no {family}")


def _hf_cos_sin(module, config, positions, spec):
    """HF's (cos, sin) in its format (``cat(freqs, freqs)``, times its attention scaling), in float64 from
    HF's own inv_freq and attention scaling (its module computes them in float32: 1e-4 off at p = 4095);
    HF's inv_freq agrees with the spec's (the zoo test checks every family's to the last bit)."""
    torch = pytest.importorskip("torch")
    rotary_cls = next(getattr(module, n) for n in dir(module) if n.endswith("RotaryEmbedding"))
    emb = rotary_cls(config=config)
    inv_freq = emb.inv_freq.double().numpy()
    np.testing.assert_allclose(inv_freq, spec.inv_freq(), rtol=1e-6)
    theta = np.asarray(positions, np.float64)[None, :, None] * spec.inv_freq()
    theta = np.concatenate([theta, theta], axis=-1)
    scale = float(emb.attention_scaling)
    return torch.as_tensor(np.cos(theta) * scale), torch.as_tensor(np.sin(theta) * scale)


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v32", "glm_moe_dsa", "mistral4"])
def test_mla_qk_head_matches_hf_attention(family, rng):
    """head="qk": HF's attention splits q into [q_pass | q_rot] (qk_nope_head_dim + qk_rope_head_dim),
    rotates q_rot and concatenates; one rotary call on the whole head gives the same."""
    torch = pytest.importorskip("torch")
    config, module = _hf_module(family)
    spec = RopeSpec.from_hf_config(config, head="qk")
    nope, rope = config.qk_nope_head_dim, config.qk_rope_head_dim
    assert (spec.head_dim, spec.rotary_offset, spec.rotary_dim) == (nope + rope, nope, rope)
    positions = np.array([0, 1, 2, 17, 300, 4095])
    cos, sin = _hf_cos_sin(module, config, positions, spec)
    q = rng.standard_normal((1, 2, len(positions), nope + rope))     # (B, H, S, D), as HF's attention
    q_pass, q_rot = torch.split(torch.as_tensor(q), [nope, rope], dim=-1)
    interleave = getattr(config, "rope_interleave", True) or family in ("deepseek_v32", "glm_moe_dsa")
    fn = module.apply_rotary_pos_emb_interleave if interleave else module.apply_rotary_pos_emb
    hf = torch.cat((q_pass, fn(q_rot, q_rot, cos, sin)[0]), dim=-1).numpy()
    ours = rotary.apply(q, positions, spec=spec, seq_axis=-2)
    if interleave:   # HF's interleave helper reads pairs (2i, 2i+1) and writes them de-interleaved (same scores)
        ours = rotary.convert_layout(ours, to="half", rotary_offset=nope)
    np.testing.assert_allclose(ours, hf, rtol=1e-12, atol=1e-12)
    assert np.array_equal(ours[..., :nope], q[..., :nope])
    part = RopeSpec.from_hf_config(config)   # the default: the rotary module's head (Mistral 4's is the whole head)
    np.testing.assert_array_equal(part.inv_freq(), spec.inv_freq())
    assert (part.attention_scaling, part.softmax_scale_factor, part.layout) == (
        spec.attention_scaling, spec.softmax_scale_factor, spec.layout)


@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa"])
def test_dsa_indexer_head_matches_hf_indexer(family, rng):
    """head="indexer": the lightning indexer's heads are [rope | rest] of index_head_dim; DeepSeek-V3.2
    pairs them half-split (while its MLA attention is interleaved), GLM-MoE-DSA interleaved."""
    torch = pytest.importorskip("torch")
    config, module = _hf_module(family)
    spec = RopeSpec.from_hf_config(config, head="indexer")
    rope, dim = config.qk_rope_head_dim, config.index_head_dim
    assert (spec.head_dim, spec.rotary_dim, spec.rotary_offset) == (dim, rope, 0)
    assert spec.layout == ("half" if family == "deepseek_v32" else "interleaved")
    assert RopeSpec.from_hf_config(config).layout == "interleaved" and spec.softmax_scale_factor == 1.0
    positions = np.array([0, 3, 9, 1000])
    cos, sin = _hf_cos_sin(module, config, positions, spec)
    q = rng.standard_normal((1, len(positions), 3, dim))              # (B, S, H, D), as HF's indexer
    q_rot, q_pass = torch.split(torch.as_tensor(q), [rope, dim - rope], dim=-1)
    fn = module.apply_rotary_pos_emb if family == "deepseek_v32" else module.apply_rotary_pos_emb_interleave
    hf = torch.cat([fn(q_rot, q_rot, cos, sin, unsqueeze_dim=2)[0], q_pass], dim=-1).numpy()
    ours = rotary.apply(q, positions, spec=spec, seq_axis=-3)
    if spec.layout == "interleaved":   # HF's interleave helper writes its pairs de-interleaved (same scores)
        ours = rotary.convert_layout(ours, to="half", rotary_dim=rope)
    np.testing.assert_allclose(ours, hf, rtol=1e-12, atol=1e-12)


def test_mla_config_json_reads_like_hf():
    """A DeepSeek-V3 config.json has neither head_dim nor rope_interleave: HF's config class sets head_dim =
    qk_rope_head_dim and rope_interleave=True; a dict must give the same spec (it gave head_dim 56, "half")."""
    config = {"model_type": "deepseek_v3", "hidden_size": 7168, "num_attention_heads": 128, "qk_nope_head_dim": 128,
              "qk_rope_head_dim": 64, "v_head_dim": 128, "max_position_embeddings": 163840, "rope_theta": 10000,
              "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                               "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}}
    spec = RopeSpec.from_hf_config(config)
    assert (spec.head_dim, spec.rotary_dim, spec.layout) == (64, 64, "interleaved")
    qk = RopeSpec.from_hf_config(config, head="qk")
    assert (qk.head_dim, qk.rotary_offset, qk.rotary_dim, qk.layout) == (192, 128, 64, "interleaved")
    np.testing.assert_array_equal(qk.inv_freq(), spec.inv_freq())
    assert qk.softmax_scale_factor == spec.softmax_scale_factor > 1
    assert RopeSpec.from_hf_config({**config, "rope_interleave": False}).layout == "half"
    assert RopeSpec.from_hf_config({"hidden_size": 256, "num_attention_heads": 4}, head="qk").rotary_offset == 0
    with pytest.raises(ValueError, match="index_head_dim"):
        RopeSpec.from_hf_config(config, head="indexer")
    with pytest.raises(ValueError, match="head must be one of"):
        RopeSpec.from_hf_config(config, head="q")


@pytest.mark.parametrize("family", ["axk1", "axk2", "bailing_hybrid", "deepseek_v2", "deepseek_v3", "deepseek_v32",
                                    "glm4_moe_lite", "glm_moe_dsa", "hy_v4", "kimi_linear", "longcat_flash",
                                    "minicpm3", "mistral4", "mistral_large4", "youtu"])
def test_mla_dict_without_head_dim_and_rope_interleave_matches_the_config_class(family):
    config, _ = _hf_module(family)
    raw = {k: v for k, v in config.to_dict().items() if k not in ("head_dim", "rope_interleave")}
    for head in ("rope", "qk"):
        assert RopeSpec.from_hf_config(raw, head=head) == RopeSpec.from_hf_config(config, head=head)


def test_inspect_cli_head(tmp_path, capsys):
    import json

    from rotary.__main__ import main

    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "deepseek_v32", "hidden_size": 7168, "num_attention_heads": 128,
                                "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "index_head_dim": 128,
                                "rope_theta": 10000}))
    assert main(["inspect", str(path), "--head", "qk"]) == 0
    out = capsys.readouterr().out
    assert "head / rotary dims 192 / 64 (32 pairs), rotated from coordinate 128" in out and "interleaved" in out
    assert main(["inspect", str(path), "--head", "indexer"]) == 0
    out = capsys.readouterr().out
    assert "head / rotary dims 128 / 64 (32 pairs)\n" in out and "layout             half" in out
