"""torch tensors: CPU through the NumPy/Numba kernels, results as torch tensors, out= in place, autograd."""

import numpy as np
import pytest

import rotary
from rotary.testing import assert_close, linear_attention_quadratic, rope_complex, to_numpy64

from .conftest import AVAILABLE

torch = pytest.importorskip("torch")
CPU_BACKENDS = [b for b in ("numba", "numpy") if b in AVAILABLE]
DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]


def _oracle(x, positions, spec, inverse=False):
    """float64 oracle over (B, S, H, D) -> the seq axis is 1: move heads before seq for rope_complex."""
    x64 = np.moveaxis(to_numpy64(x), 2, 1)                     # (B, H, S, D)
    p = np.asarray(positions)[:, None, :] if np.ndim(positions) == 2 else positions
    y = rope_complex(x64, p if not inverse else -np.asarray(p), spec.inv_freq(), layout=spec.layout,
                     scale=spec.attention_scaling)
    return np.moveaxis(y, 1, 2)


@pytest.mark.interop("torch", "cpu", "numba, numpy", "-")
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_cpu_tensors_match_oracle_and_numpy(backend, dtype, layout):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 33, 4, 64, generator=g).to(dtype)
    k = torch.randn(2, 33, 2, 64, generator=g).to(dtype)
    q0, k0 = q.clone(), k.clone()
    spec = rotary.RopeSpec(64, layout=layout, base=500000.0)
    pos = np.stack([np.arange(33) + 7, np.arange(33) * 3 + 1000])
    qr, kr = rotary.apply_qk(q, k, torch.from_numpy(pos), spec=spec, seq_axis=-3, backend=backend)
    for r, x in ((qr, q), (kr, k)):
        assert isinstance(r, torch.Tensor) and r.dtype == dtype and r.device == x.device and r.shape == x.shape
        assert_close(r, _oracle(x, pos, spec))
    assert torch.equal(q, q0) and torch.equal(k, k0)            # inputs untouched
    if dtype != torch.bfloat16:                                 # the same kernels as NumPy arrays: same bits, strides
        qn, kn = rotary.apply_qk(q.numpy(), k.numpy(), pos, spec=spec, seq_axis=-3, backend=backend)
        assert np.array_equal(qr.numpy(), qn) and np.array_equal(kr.numpy(), kn)
        assert qr.stride() == tuple(s // qn.itemsize for s in qn.strides)


@pytest.mark.interop("torch", "cpu", "numba, numpy", "-")
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_strided_and_bhsd_views(backend):
    g = torch.Generator().manual_seed(1)
    base = torch.randn(3, 8, 20, 96, generator=g)
    x = base[:, :, 2:18, :64].transpose(1, 2)                   # (B, S, H, D) view with gaps, non-contiguous
    y = rotary.apply(x, 5, seq_axis=-3, backend=backend)
    assert_close(y, _oracle(x, np.arange(16) + 5, rotary.RopeSpec(64)))
    xh = base[..., :64]                                         # BHSD, seq_axis=-2
    yh = rotary.apply(xh, seq_axis=-2, backend=backend)
    assert_close(yh.transpose(1, 2), _oracle(xh.transpose(1, 2), np.arange(20), rotary.RopeSpec(64)))


@pytest.mark.interop("torch", "cpu", "numba, numpy", "out= in place")
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_out_in_place_and_separate(backend, dtype):
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 16, 4, 32, generator=g).to(dtype)
    k = torch.randn(1, 16, 1, 32, generator=g).to(dtype)
    expect_q, expect_k = _oracle(q, np.arange(16), rotary.RopeSpec(32)), _oracle(k, np.arange(16), rotary.RopeSpec(32))
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    r = rotary.apply_qk(q, k, seq_axis=-3, out=(qo, ko), backend=backend)
    assert r[0] is qo and r[1] is ko
    assert_close(qo, expect_q)
    assert_close(ko, expect_k)
    ptr = q.data_ptr()
    r = rotary.apply_qk(q, k, seq_axis=-3, out=(q, k), backend=backend)
    assert r[0] is q and q.data_ptr() == ptr
    assert_close(q, expect_q)
    assert_close(k, expect_k)
    with pytest.raises(ValueError, match="shape"):
        rotary.apply(q, seq_axis=-3, out=torch.empty(1, 16, 4, 30, dtype=dtype), backend=backend)


@pytest.mark.interop("torch", "cpu", "numba, numpy", "autograd (rotation)")
def test_backward_is_the_inverse_rotation():
    g = torch.Generator().manual_seed(3)
    spec = rotary.RopeSpec(16, scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
    assert spec.attention_scaling != 1.0                        # the transpose keeps the scaling: a R^T
    x = torch.randn(2, 5, 3, 16, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(2, 5, 1, 16, dtype=torch.float64, generator=g, requires_grad=True)
    pos = np.array([[0, 3, 9, 100, 1000], [5, 4, 3, 2, 1]])
    fn = lambda a, b: rotary.apply_qk(a, b, pos, spec=spec, seq_axis=-3)
    assert torch.autograd.gradcheck(fn, (x, k))
    assert torch.autograd.gradgradcheck(fn, (x, k))
    assert torch.autograd.gradcheck(lambda a: rotary.apply(a, pos, spec=spec, seq_axis=-3, inverse=True), (x,))
    y = rotary.apply(x, pos, spec=spec, seq_axis=-3)
    assert y.requires_grad and "Rotate" in type(y.grad_fn).__name__
    gy = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, gy)
    assert_close(dx, _oracle(gy.detach(), pos, spec, inverse=True))   # explicit: a R_{-p} dy
    xf = x.detach().float().requires_grad_()
    rotary.apply(xf, seq_axis=-3, backend="numba" if "numba" in AVAILABLE else "numpy").sum().backward()
    assert xf.grad.dtype == torch.float32 and xf.grad.shape == xf.shape


@pytest.mark.interop("torch", "cpu", "numba, numpy", "autograd (rotation)")
def test_autograd_only_inputs_that_require_grad():
    q = torch.randn(1, 4, 2, 8, requires_grad=True)
    k = torch.randn(1, 4, 1, 8)
    qr, kr = rotary.apply_qk(q, k, seq_axis=-3)
    assert qr.requires_grad and not kr.requires_grad or kr.grad_fn is not None
    (qr.sum() + kr.sum()).backward()
    assert q.grad is not None and k.grad is None
    with torch.no_grad():
        assert not rotary.apply(q, seq_axis=-3).requires_grad


def test_errors_name_the_fix():
    x = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match=r"backend='cupy' needs CUDA tensors.*\.cuda\(\)"):
        rotary.apply(x, backend="cupy", seq_axis=-2)
    xg = x.clone().requires_grad_()
    with pytest.raises(ValueError, match="out= is not supported when an input requires grad"):
        rotary.apply(xg, out=torch.empty_like(x), seq_axis=-2)
    with pytest.raises(TypeError, match="out for x must be a torch tensor"):
        rotary.apply(x, out=np.empty((1, 4, 2, 8), np.float32), seq_axis=-2)
    with pytest.raises(TypeError, match="real floating"):
        rotary.apply(torch.ones(1, 4, 2, 8, dtype=torch.int32), seq_axis=-2)


@pytest.mark.interop("torch", "cpu", "numba, numpy", "linear attention; its autograd on the reference path")
@pytest.mark.parametrize("causal", [False, True])
def test_linear_attention_kernels_and_reference_autograd(causal):
    g = torch.Generator().manual_seed(4)
    q, k = torch.randn(2, 40, 3, 16, generator=g), torch.randn(2, 40, 3, 16, generator=g)
    v = torch.randn(2, 40, 3, 8, generator=g)
    spec = rotary.RopeSpec(16)
    exp = np.moveaxis(linear_attention_quadratic(*(np.moveaxis(to_numpy64(a), 2, 1) for a in (q, k, v)),
                                                 np.arange(40), spec.inv_freq(), causal=causal), 1, 2)
    for backend in CPU_BACKENDS:
        o, st = rotary.linear_attention(q, k, v, causal=causal, seq_axis=-3, return_state=True, backend=backend)
        assert isinstance(o, torch.Tensor) and o.dtype == q.dtype and isinstance(st.S, torch.Tensor)
        assert_close(o, exp, rtol=2e-5, atol=2e-5)
        on = rotary.linear_attention(q.numpy(), k.numpy(), v.numpy(), causal=causal, seq_axis=-3, backend=backend)
        assert np.array_equal(o.numpy(), on)                    # the kernels themselves, no copy
        # resume from the torch state: the same as one call
        o1, st1 = rotary.linear_attention(q[:, :25], k[:, :25], v[:, :25], causal=causal, seq_axis=-3,
                                          return_state=True, backend=backend)
        o2 = rotary.linear_attention(q[:, 25:], k[:, 25:], v[:, 25:], causal=causal, seq_axis=-3, state=st1,
                                     backend=backend)
        if causal:
            assert_close(torch.cat([o1, o2], 1), exp, rtol=2e-5, atol=2e-5)
    # autograd: the differentiable reference path on the tensors (float64 gradcheck)
    args = [a[:1, :6, :1].double().requires_grad_() for a in (q, k, v)]
    fn = lambda a, b, c: rotary.linear_attention(a, b, c, causal=causal, seq_axis=-3)
    assert torch.autograd.gradcheck(fn, args)
    o = fn(*args)
    assert_close(o, np.moveaxis(linear_attention_quadratic(*(np.moveaxis(to_numpy64(a), 2, 1) for a in args),
                                                           np.arange(6), spec.inv_freq(), causal=causal), 1, 2))
    with pytest.raises(ValueError, match="backend='numba' cannot run"):
        rotary.linear_attention(*args, backend="numba", seq_axis=-2, feature_map=lambda x: x)


def _cuda_or_skip():
    if not torch.cuda.is_available() or "cupy" not in AVAILABLE:
        pytest.skip("needs a CUDA device for torch and CuPy")


@pytest.mark.gpu
@pytest.mark.interop("torch", "cuda", "cupy", "out= in place, autograd (rotation), linear attention")
def test_cuda_tensors_zero_copy_out_and_autograd():
    _cuda_or_skip()
    g = torch.Generator(device="cuda").manual_seed(5)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        q = torch.randn(2, 9, 4, 64, device="cuda", generator=g).to(dtype)
        k = torch.randn(2, 9, 1, 64, device="cuda", generator=g).to(dtype)
        qr, kr = rotary.apply_qk(q, k, seq_axis=-3)
        assert qr.device == q.device and qr.dtype == dtype
        assert_close(qr, _oracle(q, np.arange(9), rotary.RopeSpec(64)))
        ptr = q.data_ptr()
        rotary.apply_qk(q, k, seq_axis=-3, out=(q, k))
        assert q.data_ptr() == ptr
        assert torch.equal(q, qr)                              # in place: the same kernel, the same bits
    x = torch.randn(2, 5, 3, 16, dtype=torch.float64, device="cuda", requires_grad=True)
    assert torch.autograd.gradcheck(lambda a: rotary.apply(a, 3, seq_axis=-3), (x,))
    qkv = [torch.randn(1, 40, 2, 16, device="cuda") for _ in range(3)]
    o = rotary.linear_attention(*qkv, causal=True, seq_axis=-3)
    on = rotary.linear_attention(*(a.cpu() for a in qkv), causal=True, seq_axis=-3)
    assert o.is_cuda and torch.allclose(o.cpu(), on, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="backend='numba' runs on the CPU"):
        rotary.apply(x.detach(), backend="numba", seq_axis=-2)


def test_linear_attention_gqa_decay_state_and_multi_axis_positions():
    rng = np.random.default_rng(8)
    q, k = rng.standard_normal((1, 40, 4, 16), dtype=np.float32), rng.standard_normal((1, 40, 2, 16), dtype=np.float32)
    v = rng.standard_normal((1, 40, 2, 8), dtype=np.float32)
    dec = np.array([0.9, 0.99])
    t = [torch.from_numpy(a) for a in (q, k, v)]
    o1, s1 = rotary.linear_attention(*(a[:, :25] for a in t), causal=True, seq_axis=-3, decay=dec, return_state=True)
    assert isinstance(s1.S, torch.Tensor) and s1.groups == 2 and s1.decay is not None
    o2 = rotary.linear_attention(*(a[:, 25:] for a in t), causal=True, seq_axis=-3, decay=dec, state=s1)
    expect = rotary.linear_attention(q, k, v, causal=True, seq_axis=-3, decay=dec)
    assert_close(torch.cat([o1, o2], 1), expect, rtol=1e-5, atol=1e-5)
    spec = rotary.RopeSpec(16, mrope_section=[2, 3, 3])
    pos = rng.integers(0, 100, (40, 3))
    assert np.array_equal(rotary.apply(t[0], pos, spec=spec, seq_axis=-3).numpy(),
                          rotary.apply(q, pos, spec=spec, seq_axis=-3))


@pytest.mark.interop("torch", "cpu", "numba, numpy", "rerotate, autograd")
def test_rerotate_tensors_and_grad():
    rng = np.random.default_rng(14)
    k = rng.standard_normal((2, 12, 2, 16)).astype(np.float32)
    src = rng.integers(0, 1000, (2, 12))
    r = rotary.rerotate(torch.from_numpy(k), src, src + 37, seq_axis=-3)
    assert isinstance(r, torch.Tensor) and np.array_equal(r.numpy(), rotary.rerotate(k, src, src + 37, seq_axis=-3))
    kg = torch.from_numpy(k[:, :4, :1]).double().requires_grad_()
    assert torch.autograd.gradcheck(lambda a: rotary.rerotate(a, src[:, :4], src[:, :4] + 37, seq_axis=-3), (kg,))
