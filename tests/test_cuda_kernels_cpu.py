"""The CUDA kernel sources, run on the CPU through tests/cuda_shim, against float64 oracles.

The same .cu files NVRTC compiles for the GPU are built with the host C++ compiler (one host thread
per CUDA thread, std::barrier for __syncthreads) and launched with the same plans
(``rotary.backends.cupy.plan_rotate`` / ``plan_linear_attention``) the CuPy backend uses, with
NumPy arrays in place of CuPy arrays. Small block sizes make small inputs span many blocks.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import rotary
from rotary import RopeSpec
from rotary.conformance import cases as conformance
from rotary import backends as registry
from rotary.backends import cupy as cb
from rotary.spec import hf_vision
from rotary.testing import rope_complex, tolerance

from .cuda_shim import host
from .cuda_shim.kv_backend import dtype_name as _dtype_name, run_linear_attention, shared_kernels, shim_backend  # noqa: F401
from .cuda_shim.kv_backend import register as shim_register

pytestmark = pytest.mark.cuda_cpu

#: (threads per block, tokens per block cap): default geometry, and tiny blocks spanning many blocks
GEOMETRIES = {"default": (256, None), "tiny": (5, 1), "small": (32, 3)}


@pytest.fixture(scope="session")
def kernels():
    # one build per process, in a fixed directory named by the sources' digest (shared with the KV-cache tests)
    return shared_kernels()


@pytest.fixture
def use_backend(kernels, monkeypatch):
    """Register a shim backend under the name "cuda-shim" for the frontend (restored afterwards)."""

    def register(**geometry):
        return shim_register(monkeypatch, shim_backend(kernels, **geometry)).NAME

    return register


# -- rotation: the conformance suite through the frontend -------------------------------------------
@pytest.mark.parametrize("geometry", list(GEOMETRIES))
@pytest.mark.parametrize("case", conformance.cases(), ids=lambda c: c.name)
def test_conformance_case(case, geometry, use_backend):
    if geometry != "default" and case.scaling is not None:
        pytest.skip("scaling rules change the tables, not the kernel; default geometry covers them")
    threads, tpb = GEOMETRIES[geometry]
    name = use_backend(threads=threads, max_tokens_per_block=tpb)
    result = conformance.run_case(case, name)
    assert result.passed, f"{case.name}: max error {result.max_error:.3g} (tol {result.tolerance:.1g}) {result.detail}"


@pytest.mark.parametrize("threads", [32, 128])
@pytest.mark.parametrize("case", conformance.linear_cases(), ids=lambda c: c.name)
def test_linear_conformance_case(case, threads, use_backend):
    """The linear-attention conformance cases through the CUDA kernel against the quadratic oracle."""
    result = conformance.run_linear_case(case, use_backend(threads=threads))
    assert result.passed, f"{case.name}: error {result.max_error:.3g} (tol {result.tolerance:.1g}) {result.detail}"


# -- rotation: direct launches -----------------------------------------------------------------------
def _tables(spec, positions, work=np.float32):
    cos, sin = spec.cos_sin(np.asarray(positions), dtype=work)
    return np.ascontiguousarray(cos), np.ascontiguousarray(sin)


def _oracle(x, positions, spec, inverse=False):
    """float64 oracle for (B, S, H, D) x with positions (S,) or (B, S)."""
    xs = np.moveaxis(np.asarray(x, np.float64), 2, 1)  # (B, H, S, D)
    p = np.asarray(positions)
    p = p[:, None, :] if p.ndim == 2 else p
    inv = spec.inv_freq()
    return np.moveaxis(rope_complex(xs, p, -inv if inverse else inv, layout=spec.layout), 1, 2)


# -- one rounding contract for every pair rotation ------------------------------------------------------
@pytest.fixture(scope="module")
def contracted_kernels():
    """The rotation and KV kernels (float32, float64) and the planted ones, built with FMA contraction on."""
    import os
    import tempfile
    from pathlib import Path

    flags = host.contracting_flags()
    if host.compiler() is None or flags is None:
        pytest.skip("no host C++ compiler, or no FMA instructions on this CPU to contract into")
    return host.build(Path(tempfile.gettempdir()) / f"rotary-cuda-shim-fma-{os.getuid()}", planted=True,
                      families=("rope", "kv_cache"), dtypes=("float32", "float64"), extra_flags=flags,
                      opt="-O2")   # GCC forms FMAs at -O2 (its widening_mul pass)


def _numpy_rotation(x, cos, sin, rows, layout):
    """NumPy's rotation of x (T, H, D) in x's dtype, every product and sum rounded on its own:
    y_a = x_a c - x_b s, y_b = x_b c + x_a s."""
    half = cos.shape[1]
    ia = 2 * np.arange(half) if layout == "interleaved" else np.arange(half)
    ib = ia + (1 if layout == "interleaved" else half)
    c, s = cos[rows][:, None, :], sin[rows][:, None, :]
    y = x.copy()
    y[..., ia] = x[..., ia] * c - x[..., ib] * s
    y[..., ib] = x[..., ib] * c + x[..., ia] * s
    return y


def test_pair_rotation_is_never_fused_into_an_fma(contracted_kernels, rng):
    """With contraction on (the host compiler fusing a * c - b * s into an FMA where it can, as NVRTC does by
    default on the device), a plainly written rotation (planted.cu; rope.cu's before rotate_pair) rounds differently
    from NumPy, while rope_rotate and kv_append, both through rotary_common.cuh's rotate_pair, keep NumPy's bits:
    the key the KV cache writes is the key rotary.apply rotates, bit for bit (tests/test_nvrtc.py checks the
    device side: no fma.rn in their PTX)."""
    n = 4096
    a, b, c, s = (rng.standard_normal(n).astype(np.float32) for _ in range(4))
    plain, paired = np.empty(n, np.float32), np.empty(n, np.float32)
    contracted_kernels.launch(cb.Launch("planted", "planted_fused_rotation", 1, 32, 0,
                                        (a, b, c, s, plain, paired, np.int32(n))))
    want = a * c - b * s
    assert not np.array_equal(plain, want), "the contracted build fused nothing: the check below would prove nothing"
    np.testing.assert_array_equal(paired, want)
    T, H, D = 64, 2, 32
    for dtype in ("float32", "float64"):
        for layout in ("half", "interleaved"):
            spec = RopeSpec(D, layout=layout)
            cos, sin = _tables(spec, np.arange(4096), np.float64 if dtype == "float64" else np.float32)
            rows = rng.integers(0, 4096, T).astype(np.int64)
            x = rng.standard_normal((T, H, D)).astype(dtype)
            want = _numpy_rotation(x, cos, sin, rows, layout)
            y = np.empty_like(x)
            contracted_kernels.launch(cb.plan_rotate([(x[None], y[None])], cos, sin, rows[None], dtype_name=dtype,
                                                     rotary_dim=D, layout=layout, inverse=False, address=host.address,
                                                     threads=32))
            np.testing.assert_array_equal(y.view(np.uint8), want.view(np.uint8), err_msg=f"rope {dtype} {layout}")
            stores = (np.empty_like(x), np.empty_like(x), None, None)
            contracted_kernels.launch(cb.plan_append_kv(x, x, cos, sin, rows, np.arange(T, dtype=np.int64), stores,
                                                        dtype_name=dtype, rotary_dim=D, layout=layout, offset=0,
                                                        kv_dtype=None))
            np.testing.assert_array_equal(stores[0].view(np.uint8), y.view(np.uint8), err_msg=f"kv {dtype} {layout}")


def _guarded(shape, dtype, rng, pad=7, fill=np.nan):
    """A (shape) view inside a larger buffer filled with ``fill``; returns (view, buffer, mask of the view)."""
    size = int(np.prod(shape))
    buf = np.full(size + 2 * pad, fill, dtype=dtype)
    view = buf[pad:pad + size].reshape(shape)
    view[...] = rng.standard_normal(shape).astype(dtype)
    mask = np.zeros(buf.shape, bool)
    mask[pad:pad + size] = True
    return view, buf, mask


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("head_dim,rotary_dim", [(24, 12), (20, 20), (19, 18), (40, 6), (64, 64)])
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("inplace", [False, True])
def test_rotate_writes_only_its_elements(kernels, layout, head_dim, rotary_dim, dtype, inplace, rng):
    """Partial rotary_dim (not a power of two), odd head_dim, GQA, per-batch positions; writes stay in bounds."""
    B, S, Hq, Hk = 2, 5, 3, 1
    spec = RopeSpec(head_dim, rotary_dim=rotary_dim, layout=layout)
    positions = rng.integers(0, 50, size=(B, S))
    work = np.float64 if dtype == "float64" else np.float32
    cos, sin = _tables(spec, np.arange(50), work)
    q, qbuf, qmask = _guarded((B, S, Hq, head_dim), dtype, rng)
    k, kbuf, kmask = _guarded((B, S, Hk, head_dim), dtype, rng)
    q0, k0 = q.copy(), k.copy()
    if inplace:
        items, qo, ko = [(q, q), (k, k)], q, k
        qobuf, kobuf = qbuf, kbuf
    else:
        qo, qobuf, _ = _guarded(q.shape, dtype, rng, fill=np.inf)
        ko, kobuf, _ = _guarded(k.shape, dtype, rng, fill=np.inf)
        items = [(q, qo), (k, ko)]
    plan = cb.plan_rotate(items, cos, sin, positions.astype(np.int64), dtype_name=dtype, rotary_dim=rotary_dim,
                          layout=layout, inverse=False, address=host.address, threads=7, max_tokens_per_block=2)
    assert plan.grid >= (B * S + 1) // 2  # many blocks for a small input
    kernels.launch(plan)
    rtol, atol = tolerance(dtype)
    np.testing.assert_allclose(qo.astype(np.float64), _oracle(q0, positions, spec), rtol=rtol, atol=atol)
    np.testing.assert_allclose(ko.astype(np.float64), _oracle(k0, positions, spec), rtol=rtol, atol=atol)
    for buf, mask, fill in ((qobuf, qmask, np.nan if inplace else np.inf), (kobuf, kmask, np.nan if inplace else np.inf)):
        outside = buf[~mask]
        assert np.all(np.isnan(outside)) if inplace else np.all(outside == fill), "wrote outside the output"
    if not inplace:
        np.testing.assert_array_equal(q, q0)
        np.testing.assert_array_equal(k, k0)


def test_vector_width_follows_alignment(kernels, rng):
    """Aligned contiguous fp16 takes 16-byte accesses; an odd element offset falls back to scalars."""
    spec = RopeSpec(64)
    cos, sin = _tables(spec, np.arange(8))
    buf = rng.standard_normal(2 * 8 * 4 * 64 + 8).astype(np.float16)
    rows = np.arange(8, dtype=np.int64)[None]
    results = {}
    for offset in (0, 1, 2, 4):
        x = buf[offset:offset + 2 * 8 * 4 * 64].reshape(2, 8, 4, 64)
        y = np.empty_like(x)
        plan = cb.plan_rotate([(x, y)], cos, sin, rows, dtype_name="float16", rotary_dim=64, layout="half",
                              inverse=False, address=host.address, threads=32)
        results[offset] = int(plan.kernel.split(",")[2])
        kernels.launch(plan)
        np.testing.assert_allclose(y.astype(np.float64), _oracle(x, np.arange(8), spec), rtol=2e-3, atol=2e-3)
    if host.address(buf) % 16 == 0:
        assert results == {0: 8, 1: 1, 2: 2, 4: 4}


def test_inverse_undoes_rotation_huge_positions(kernels, rng):
    spec = RopeSpec(32, layout="interleaved")
    positions = np.array([[2**31 - 1, 2**31 - 7, 12345678901, 0, 5]])
    uniq, rows = np.unique(positions, return_inverse=True)
    cos, sin = _tables(spec, uniq)
    x = rng.standard_normal((1, 5, 2, 32)).astype(np.float32)
    y, back = np.empty_like(x), np.empty_like(x)
    rows = rows.reshape(positions.shape).astype(np.int64)
    for src, dst, inverse in ((x, y, False), (y, back, True)):
        kernels.launch(cb.plan_rotate([(src, dst)], cos, sin, rows, dtype_name="float32", rotary_dim=32,
                                      layout="interleaved", inverse=inverse, address=host.address, threads=3))
    np.testing.assert_allclose(y, _oracle(x, positions, spec), rtol=2e-6, atol=5e-6)
    np.testing.assert_allclose(back, x, rtol=1e-5, atol=1e-5)


def _to_bf16_bits(a):
    """float32 -> bfloat16 bits, round to nearest even (NumPy reimplementation for the test)."""
    u = np.asarray(a, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _from_bf16_bits(b):
    return (b.astype(np.uint32) << 16).view(np.float32)


def test_bfloat16_storage(kernels, rng):
    spec = RopeSpec(48, rotary_dim=32)
    positions = np.arange(9)
    cos, sin = _tables(spec, positions)
    x32 = rng.standard_normal((1, 9, 3, 48)).astype(np.float32)
    x = _to_bf16_bits(x32)
    y = np.empty_like(x)
    plan = cb.plan_rotate([(x, y)], cos, sin, positions[None].astype(np.int64), dtype_name="bfloat16",
                          rotary_dim=32, layout="half", inverse=False, address=host.address, threads=16)
    assert plan.kernel.startswith("rope_rotate<rotary_bfloat16, float")
    kernels.launch(plan)
    ref = _oracle(_from_bf16_bits(x), positions, spec)
    np.testing.assert_allclose(_from_bf16_bits(y), ref, rtol=1.6e-2, atol=1.6e-2)
    # the kernel's rounding is round-to-nearest-even of the fp32 result
    np.testing.assert_array_equal(y[..., 32:], x[..., 32:])


def test_int64_offsets_beyond_2_31_elements(kernels, rng):
    """A batch stride of 2**31 + 16 elements (lazily allocated memory): offsets must not wrap in 32 bits."""
    stride = 2**31 + 16
    try:
        buf = np.zeros(stride + 4 * 64, dtype=np.float16)
    except MemoryError:
        pytest.skip("cannot reserve 4 GiB of virtual memory here")
    x = np.lib.stride_tricks.as_strided(buf, (2, 2, 2, 64), (stride * 2, 2 * 64 * 2, 64 * 2, 2))
    x[...] = rng.standard_normal(x.shape).astype(np.float16)
    x0 = x.copy()
    spec = RopeSpec(64)
    cos, sin = _tables(spec, np.arange(2))
    plan = cb.plan_rotate([(x, x)], cos, sin, np.arange(2, dtype=np.int64)[None], dtype_name="float16",
                          rotary_dim=64, layout="half", inverse=False, address=host.address, threads=32)
    kernels.launch(plan)
    np.testing.assert_allclose(x.astype(np.float64), _oracle(x0, np.arange(2), spec), rtol=2e-3, atol=2e-3)
    assert not buf[4 * 64:stride].any()


def test_rotate_geometry_is_linear_in_tokens():
    for n_tokens in (1, 7, 32, 65536):
        for units in (1, 13, 320):
            grid, block, tpb, smem = cb.rotate_geometry(n_tokens, units, 32 + 2 * 64 * 4)
            assert grid * tpb >= n_tokens > (grid - 1) * tpb
            assert 1 <= block <= 256 and smem == tpb * (32 + 2 * 64 * 4) <= cb.SHARED_MEM_LIMIT
    grid, block, tpb, _ = cb.rotate_geometry(65536, 40 * 8, 544)
    assert (grid, block, tpb) == (16384, 256, 4)


# -- rotation: pairs written in another layout than read (out_pairs) ----------------------------------------
def _moved(y, rotary_dim, layout, out_layout):
    """y (pairs in ``layout`` over its first rotary_dim coordinates) with the pairs moved to ``out_layout``."""
    return y if out_layout == layout else rotary.convert_layout(y, to=out_layout, rotary_dim=rotary_dim)


MIXED = [("interleaved", "half"), ("half", "interleaved")]


@pytest.mark.parametrize("layout,out_layout", MIXED)
@pytest.mark.parametrize("head_dim,rotary_dim", [(24, 12), (20, 20), (19, 18), (40, 6), (64, 64), (80, 64)])
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_rotate_mixed_layouts_writes_only_its_elements(kernels, layout, out_layout, head_dim, rotary_dim, dtype, rng):
    """rope_rotate<..., INTERLEAVED, !INTERLEAVED>: the oracle's values at the out layout's coordinates, the
    same-layout kernel's bits moved (same products and sums), GQA in one launch, nothing written outside the
    outputs, the inputs untouched."""
    B, S, Hq, Hk = 2, 5, 3, 1
    spec = RopeSpec(head_dim, rotary_dim=rotary_dim, layout=layout)
    positions = rng.integers(0, 50, size=(B, S)).astype(np.int64)
    work = np.float64 if dtype == "float64" else np.float32
    cos, sin = _tables(spec, np.arange(50), work)
    q, _, _ = _guarded((B, S, Hq, head_dim), dtype, rng)
    k, _, _ = _guarded((B, S, Hk, head_dim), dtype, rng)
    q0, k0 = q.copy(), k.copy()
    qo, qobuf, qmask = _guarded(q.shape, dtype, rng, fill=np.inf)
    ko, kobuf, kmask = _guarded(k.shape, dtype, rng, fill=np.inf)
    plan = cb.plan_rotate([(q, qo), (k, ko)], cos, sin, positions, dtype_name=dtype, rotary_dim=rotary_dim,
                          layout=layout, inverse=False, address=host.address, threads=7, max_tokens_per_block=2,
                          out_layout=out_layout)
    assert plan.kernel.endswith(f"{layout == 'interleaved'}, {out_layout == 'interleaved'}>".lower())
    kernels.launch(plan)
    rtol, atol = tolerance(dtype)
    for got, x in ((qo, q0), (ko, k0)):
        want = _moved(_oracle(x, positions, spec), rotary_dim, layout, out_layout)
        np.testing.assert_allclose(got.astype(np.float64), want, rtol=rtol, atol=atol)
        same = np.empty_like(x)
        kernels.launch(cb.plan_rotate([(x, same)], cos, sin, positions, dtype_name=dtype, rotary_dim=rotary_dim,
                                      layout=layout, inverse=False, address=host.address, threads=7))
        np.testing.assert_array_equal(got, _moved(same, rotary_dim, layout, out_layout))
    for buf, mask in ((qobuf, qmask), (kobuf, kmask)):
        assert np.all(buf[~mask] == np.inf), "wrote outside the output"
    np.testing.assert_array_equal(q, q0)
    np.testing.assert_array_equal(k, k0)


@pytest.mark.parametrize("layout,out_layout", MIXED)
def test_mixed_layouts_vector_widths_and_strides(kernels, layout, out_layout, rng):
    """Aligned contiguous fp16 takes 16-byte accesses (V=8) in the mixed kernels too; an odd element offset
    and a strided head fall back to narrower / scalar accesses; all equal the oracle; inverse undoes it."""
    spec = RopeSpec(64, layout=layout)
    cos, sin = _tables(spec, np.arange(8))
    rows = np.arange(8, dtype=np.int64)[None]
    buf = rng.standard_normal(2 * 8 * 4 * 128 + 8).astype(np.float16)
    widths = {}
    for offset, step in ((0, 1), (1, 1), (2, 1), (4, 1), (0, 2)):
        x = buf[offset:offset + 2 * 8 * 4 * 64 * step].reshape(2, 8, 4, 64 * step)[..., ::step]
        y = np.empty(x.shape, x.dtype)
        plan = cb.plan_rotate([(x, y)], cos, sin, rows, dtype_name="float16", rotary_dim=64, layout=layout,
                              inverse=False, address=host.address, threads=32, out_layout=out_layout)
        widths[(offset, step)] = int(plan.kernel.split(",")[2])
        kernels.launch(plan)
        want = _moved(_oracle(x, np.arange(8), spec), 64, layout, out_layout)
        np.testing.assert_allclose(y.astype(np.float64), want, rtol=2e-3, atol=2e-3)
        back = np.empty_like(y)   # the other direction, inverse: reads out_layout, writes layout
        kernels.launch(cb.plan_rotate([(y, back)], cos, sin, rows, dtype_name="float16", rotary_dim=64,
                                      layout=out_layout, inverse=True, address=host.address, threads=32,
                                      out_layout=layout))
        np.testing.assert_allclose(back.astype(np.float64), x.astype(np.float64), rtol=4e-3, atol=4e-3)
    assert widths[(0, 2)] == 1
    if host.address(buf) % 16 == 0:
        assert widths[(0, 1)] == 8 and widths[(1, 1)] == 1 and widths[(2, 1)] == 2 and widths[(4, 1)] == 4


def test_mixed_layouts_bfloat16_and_plan_rules(kernels, rng):
    """bfloat16 storage in a mixed kernel; plan_rotate refuses y is x when the layouts differ, and caches the
    mixed and the same-layout launches of one geometry apart."""
    spec = RopeSpec(48, rotary_dim=32, layout="interleaved")
    positions = np.arange(9)
    cos, sin = _tables(spec, positions)
    rows = positions[None].astype(np.int64)
    x32 = rng.standard_normal((1, 9, 3, 48)).astype(np.float32)
    x = _to_bf16_bits(x32)
    y = np.empty_like(x)
    kw = dict(dtype_name="bfloat16", rotary_dim=32, layout="interleaved", inverse=False, address=host.address,
              threads=16)
    plan = cb.plan_rotate([(x, y)], cos, sin, rows, out_layout="half", **kw)
    assert plan.kernel.startswith("rope_rotate<rotary_bfloat16, float") and plan.kernel.endswith("true, false>")
    kernels.launch(plan)
    ref = _moved(_oracle(_from_bf16_bits(x), positions, spec), 32, "interleaved", "half")
    np.testing.assert_allclose(_from_bf16_bits(y), ref, rtol=1.6e-2, atol=1.6e-2)
    np.testing.assert_array_equal(y[..., 32:], x[..., 32:])
    assert cb.plan_rotate([(x, y)], cos, sin, rows, **kw).kernel.endswith(", true>")   # cached apart
    with pytest.raises(ValueError, match="y cannot be x"):
        cb.plan_rotate([(x, x)], cos, sin, rows, out_layout="half", **kw)


@pytest.mark.parametrize("layout,out_pairs", MIXED)
def test_mixed_layouts_through_the_frontend(use_backend, layout, out_pairs, rng):
    """apply_qk(out_pairs=...) on the shim backend (the frontend passes out_layout to the backend's rotate),
    strided inputs, an offset spec; in place is refused before any launch."""
    name = use_backend(threads=32, max_tokens_per_block=3)
    spec = RopeSpec(40, rotary_dim=24, rotary_offset=8, layout=layout)
    q = rng.standard_normal((2, 6, 4, 80)).astype(np.float32)[..., ::2]
    k = rng.standard_normal((2, 6, 2, 40)).astype(np.float32)
    pos = rng.integers(0, 900, size=(2, 6))
    qr, kr = rotary.apply_qk(q, k, pos, spec=spec, seq_axis=1, out_pairs=out_pairs, backend=name)
    want = rotary.apply_qk(q, k, pos, spec=spec, seq_axis=1, out_pairs=out_pairs, backend="numpy")
    for g, w in zip((qr, kr), want):
        np.testing.assert_allclose(g, w, rtol=2e-6, atol=2e-6)
    with pytest.raises(ValueError, match="out for q is q itself"):
        rotary.apply_qk(q, k, pos, spec=spec, seq_axis=1, out=(q, k), out_pairs=out_pairs, backend=name)


@pytest.mark.parametrize("layout,out_pairs", MIXED)
def test_rope_cuda_launch_path_with_out_pairs(kernels, layout, out_pairs, rng):
    """Rope's prepared CuPy launch (template + array slots) of a mixed-layout geometry, through the shim's
    launcher: the mixed kernel, the oracle's values, new arrays and separate outs."""
    spec = RopeSpec(64, rotary_dim=48, layout=layout)
    rope = rotary.Rope(spec, backend="numpy", dtype=np.float32, seq_axis=1)
    q = rng.standard_normal((5, 1, 8, 64)).astype(np.float32)
    k = rng.standard_normal((5, 1, 2, 64)).astype(np.float32)
    launched = []
    hooks = dict(address=host.address, launch=lambda plan, name: (launched.append(plan.kernel),
                                                                   kernels.launch(plan)),
                 empty=np.empty, to_device=lambda a: a)
    rope._prepare_device_path((q, k), seq_axis=1, backend=cb, out_pairs=out_pairs, **hooks)
    qo, ko = np.empty_like(q), np.empty_like(k)
    rope._prepare_device_path((q, k), (qo, ko), seq_axis=1, backend=cb, out_pairs=out_pairs, **hooks)
    for step in range(3):
        pos = rng.integers(0, 3000, size=(5, 1))
        want = rotary.apply_qk(q, k, pos, spec=spec, seq_axis=1, out_pairs=out_pairs, backend="numpy")
        got = rope(q, k, pos, out_pairs=out_pairs)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=2e-6, atol=2e-6)
        got = rope(q, k, pos, out=(qo, ko), out_pairs=out_pairs)
        assert got[0] is qo and got[1] is ko
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=2e-6, atol=2e-6)
    assert len(launched) == 6 and all(cb.kernel_group(n) == "mixed" for n in launched)


# -- linear attention ----------------------------------------------------------------------------------
def _phi(x, feature_map):
    if feature_map == "elu":
        return np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0)))
    if feature_map == "relu":
        return np.maximum(x, 0.0)
    return x


def la_oracle(q, k, v, positions, spec, *, causal, feature_map, eps, state=None):
    """Quadratic float64 reference ((Â B̂^T) ⊙ M) V / (rowsum((A B^T) ⊙ M) + eps) plus a carried state."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    B, T, H, m = q.shape
    a, b = _phi(q, feature_map), _phi(k, feature_map)
    p = np.asarray(positions)
    p = p[:, None, :] if p.ndim == 2 else p
    rot = lambda x: np.moveaxis(rope_complex(np.moveaxis(x, 2, 1), p, spec.inv_freq(), layout=spec.layout), 1, 2)
    ah, bh = rot(a), rot(b)
    mask = np.tril(np.ones((T, T))) if causal else np.ones((T, T))
    num = np.einsum("bthm,bshm,ts,bshv->bthv", ah, bh, mask, v)
    den = np.einsum("bthm,bshm,ts->bth", a, b, mask)
    S = np.einsum("bshm,bshv->bhmv", bh, v)
    z = b.sum(axis=1)
    if state is not None:
        S0, z0 = (np.asarray(s, np.float64) for s in state)
        num = num + np.einsum("bthm,bhmv->bthv", ah, S0)
        den = den + np.einsum("bthm,bhm->bth", a, z0)
        S, z = S + S0, z + z0
    return num / (den[..., None] + eps), (S, z)


def _rel(actual, desired):
    actual, desired = np.asarray(actual, np.float64), np.asarray(desired, np.float64)
    return np.linalg.norm(actual - desired) / max(np.linalg.norm(desired), 1e-300)


LA_CASES = {
    # name: (B, T, H, m, dv, rotary_dim, layout, chunk, threads, shared_mem_limit)
    "basic": (2, 37, 2, 16, 16, 16, "half", 16, 64, cb.SHARED_MEM_LIMIT),
    "chunk-1": (1, 33, 1, 8, 8, 8, "interleaved", 32, 64, cb.SHARED_MEM_LIMIT),
    "chunk+1": (1, 17, 1, 8, 8, 8, "half", 16, 16, cb.SHARED_MEM_LIMIT),
    "T1": (2, 1, 3, 8, 4, 8, "half", 64, 16, cb.SHARED_MEM_LIMIT),
    "odd-m-partial": (1, 21, 2, 13, 10, 8, "interleaved", 8, 32, cb.SHARED_MEM_LIMIT),
    "dv-tiles": (1, 40, 1, 16, 70, 12, "half", 16, 64, cb.SHARED_MEM_LIMIT),
    "tiny-smem": (1, 29, 2, 24, 20, 24, "half", 64, 8, 4096),
}


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("feature_map", ["elu", "relu", "identity"])
@pytest.mark.parametrize("case", list(LA_CASES))
def test_linear_attention_matches_quadratic_oracle(kernels, case, feature_map, causal, rng):
    B, T, H, m, dv, r, layout, chunk, threads, limit = LA_CASES[case]
    spec = RopeSpec(m, rotary_dim=r, layout=layout)
    positions = rng.integers(0, 100, size=(B, T))
    cos, sin = _tables(spec, np.arange(100))
    q = rng.standard_normal((B, T, H, m)).astype(np.float32)
    k = rng.standard_normal((B, T, H, m)).astype(np.float32)
    v = rng.standard_normal((B, T, H, dv)).astype(np.float32)
    eps = 1e-3 if feature_map == "elu" else 1.0  # relu/identity denominators can be ~0; keep o O(1)
    if feature_map == "identity":
        q, k = np.abs(q), np.abs(k)
    o, (S, z) = run_linear_attention(kernels, q, k, v, cos, sin, positions.astype(np.int64), rotary_dim=r,
                                     layout=layout, causal=causal, feature_map=feature_map, eps=eps, chunk=chunk,
                                     state=None, threads=threads, shared_mem_limit=limit)
    ref, (S_ref, z_ref) = la_oracle(q, k, v, positions, spec, causal=causal, feature_map=feature_map, eps=eps)
    assert o.dtype == np.float32 and S.dtype == np.float32 and z.dtype == np.float32
    assert _rel(o, ref) < 1e-5 and _rel(S, S_ref) < 1e-5 and _rel(z, z_ref) < 1e-5


@pytest.mark.parametrize("dtype,tol", [("float64", 1e-12), ("float16", 1e-3), ("bfloat16", 8e-3)])
def test_linear_attention_dtypes_and_strides(kernels, dtype, tol, rng):
    B, T, H, m, dv = 2, 45, 2, 12, 9
    spec = RopeSpec(m)
    positions = np.arange(T)
    work = np.float64 if dtype == "float64" else np.float32
    cos, sin = _tables(spec, positions, work)
    full = rng.standard_normal((B, T, H, 2 * m))
    q64, k64 = full[..., ::2], full[..., 1::2][:, ::-1]   # strided, one reversed
    v64 = rng.standard_normal((B, T, H, dv))
    if dtype == "bfloat16":
        q, k, v = (_to_bf16_bits(a) for a in (q64, k64, v64))
        q64, k64, v64 = (_from_bf16_bits(a) for a in (q, k, v))
    else:
        q, k, v = (a.astype(dtype) for a in (q64, k64, v64))
        q64, k64, v64 = (a.astype(np.float64) for a in (q, k, v))
    o, (S, z) = run_linear_attention(kernels, q, k, v, cos, sin, positions[None].astype(np.int64), rotary_dim=m,
                                     layout="half", causal=True, feature_map="elu", eps=1e-6, chunk=16,
                                     state=None, threads=32, dtype_name=dtype)
    ref, (S_ref, _) = la_oracle(q64, k64, v64, positions, spec, causal=True, feature_map="elu", eps=1e-6)
    out = _from_bf16_bits(o) if dtype == "bfloat16" else o
    assert _rel(out, ref) < tol and _rel(S, S_ref) < max(tol, 1e-6)
    assert S.dtype == work


@pytest.mark.parametrize("causal", [True, False])
def test_linear_attention_split_resume_equals_one_call(kernels, causal, rng):
    B, T, H, m, dv = 1, 50, 2, 8, 6
    spec = RopeSpec(m)
    cos, sin = _tables(spec, np.arange(T))
    q, k, v = (rng.standard_normal((B, T, H, d)).astype(np.float32) for d in (m, m, dv))
    kw = dict(rotary_dim=m, layout="half", causal=causal, feature_map="elu", eps=1e-6, chunk=16, threads=32)
    rows = np.arange(T, dtype=np.int64)[None]
    o_all, (S_all, z_all) = run_linear_attention(kernels, q, k, v, cos, sin, rows, state=None, **kw)
    split = 23
    o1, st = run_linear_attention(kernels, q[:, :split], k[:, :split], v[:, :split], cos, sin, rows[:, :split],
                                  state=None, **kw)
    o2, (S2, z2) = run_linear_attention(kernels, q[:, split:], k[:, split:], v[:, split:], cos, sin, rows[:, split:],
                                        state=st, **kw)
    np.testing.assert_allclose(S2, S_all, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(z2, z_all, rtol=1e-5, atol=1e-5)
    if causal:
        np.testing.assert_allclose(np.concatenate([o1, o2], axis=1), o_all, rtol=1e-5, atol=1e-6)
    ref, _ = la_oracle(q[:, split:], k[:, split:], v[:, split:], np.arange(split, T), spec, causal=causal,
                       feature_map="elu", eps=1e-6, state=st)
    assert _rel(o2, ref) < 1e-5


def test_linear_attention_geometry_fits():
    for m, dv, itemsize in ((128, 128, 4), (64, 64, 4), (128, 128, 8), (13, 7, 4), (256, 256, 4)):
        grid, block, c, dt, smem = cb.linear_attention_geometry(2, 3, m, dv, itemsize, 64)
        assert smem <= cb.SHARED_MEM_LIMIT and 1 <= c <= 64 and 1 <= dt <= min(dv, 64)
        assert grid == 6 * -(-dv // dt)
    with pytest.raises(ValueError, match="too large"):
        cb.linear_attention_geometry(1, 1, 8192, 64, 4, 64)


@pytest.mark.parametrize("causal", [True, False])
def test_linear_attention_frontend_prefill_then_decode(use_backend, causal, rng):
    """rotary.linear_attention through the shim backend equals the NumPy backend, state carried across calls."""
    from rotary import linear_attention

    name = use_backend(threads=32)
    q, k = (rng.standard_normal((2, 3, 30, 16)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((2, 3, 30, 10)).astype(np.float32)
    kw = dict(causal=causal, spec=RopeSpec(16, layout="interleaved"), return_state=True, chunk=8, seq_axis=-2)
    results = {}
    for backend in ("numpy", name):
        o1, st = linear_attention(q[:, :, :25], k[:, :, :25], v[:, :, :25], backend=backend, **kw)
        o2, st = linear_attention(q[:, :, 25:], k[:, :, 25:], v[:, :, 25:], state=st, backend=backend, **kw)
        results[backend] = (o1, o2, st.S, st.z)
    for ours, ref in zip(results[name], results["numpy"]):
        assert ours.dtype == ref.dtype and ours.shape == ref.shape
        assert _rel(ours, ref) < 1e-5


GQA_DECAY_CASES = {   # (H, Hk, decay, normalize, causal, dtype)
    "gqa-2": (4, 2, None, True, True, np.float32),
    "mqa-noncausal": (6, 1, None, True, False, np.float32),
    "retnet": (4, 4, 1 - 2.0 ** (-5 - np.arange(4)), False, True, np.float32),
    "near-zero-gqa": (4, 2, np.array([1e-6, 1e-30]), True, True, np.float64),
    "near-one": (2, 2, 1 - 1e-7, True, True, np.float32),
    "mixed-fp64": (4, 2, np.array([1.0, 0.3]), False, True, np.float64),
    "numerator-noncausal": (2, 1, None, False, False, np.float64),
}


@pytest.mark.parametrize("threads", [32, 128])
@pytest.mark.parametrize("case", list(GQA_DECAY_CASES))
def test_linear_attention_gqa_decay_normalize(use_backend, case, threads, rng):
    """GQA, decay and normalize=False through the CUDA kernel (prefill in pieces, then one-token steps)
    against the quadratic float64 oracle with k/v heads repeated to q's heads."""
    from rotary import linear_attention
    from rotary.testing import linear_attention_quadratic

    H, Hk, decay, normalize, causal, dtype = GQA_DECAY_CASES[case]
    name = use_backend(threads=threads)
    T, d, dv = 27, 8, 6
    q = rng.standard_normal((2, H, T, d)).astype(dtype)
    k = rng.standard_normal((2, Hk, T, d)).astype(dtype)
    v = rng.standard_normal((2, Hk, T, dv)).astype(dtype)
    spec = RopeSpec(d, base=100.0)
    G = H // Hk
    gamma = None if decay is None else np.repeat(np.broadcast_to(np.asarray(decay, np.float64), (Hk,)), G)
    rep = (lambda a: np.repeat(a.astype(np.float64), G, axis=1))
    ref = linear_attention_quadratic(q, rep(k), rep(v), np.arange(T), spec.inv_freq(), causal=causal,
                                     decay=gamma,
                                     normalize=normalize)
    if not causal:   # calls chained by a state are block-causal
        ref[:, :, :20] = linear_attention_quadratic(q[:, :, :20], rep(k)[:, :, :20], rep(v)[:, :, :20],
                                                    np.arange(20), spec.inv_freq(), normalize=normalize)
    kw = dict(causal=causal, spec=spec, return_state=True, chunk=8, decay=decay, normalize=normalize, backend=name, seq_axis=-2)
    pieces, st = [], None
    cuts = (0, 20, 21, 22, 27) if causal else (0, 20, 27)
    for s0, s1 in zip(cuts, cuts[1:]):
        o, st = linear_attention(q[:, :, s0:s1], k[:, :, s0:s1], v[:, :, s0:s1], state=st, **kw)
        pieces.append(o)
    o = np.concatenate(pieces, axis=2)
    tol = 1e-12 if dtype == np.float64 else 2e-5
    assert _rel(o, ref) < tol
    assert st.S.shape == (2, Hk, d, dv) and (st.z is None) == (not normalize)


# -- the CuPy glue (rotary/backends/cupy.py) with a NumPy-backed stand-in for CuPy ---------------------
class _FakeDevice:
    id = 0

    def __init__(self, index=0):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class FakeCupyArray(np.ndarray):
    """A NumPy array that looks like a CuPy array to the backend (.data.ptr, .device.id)."""

    @property
    def data(self):
        return types.SimpleNamespace(ptr=host.address(self))

    @property
    def device(self):
        return _FakeDevice()


@pytest.fixture
def fake_cupy(kernels, monkeypatch):
    """sys.modules["cupy"] replaced by NumPy-backed stand-ins whose RawModule launches through the shim."""
    import sys

    wrap = lambda a: np.asarray(a).view(FakeCupyArray)
    launched = []

    class RawModule:
        def __init__(self, code, options, name_expressions):
            assert code in {cb.source_text(f) for f in cb.SOURCES} and tuple(options) == cb.NVRTC_OPTIONS
            self.names = list(name_expressions)

        def get_function(self, name):
            assert name in self.names

            def call(grid, block, args, shared_mem=0):
                assert all(isinstance(a, np.ndarray) or type(a) in host.SCALARS for a in args)
                launched.append(name)
                kernels.launch(cb.Launch("?", name, grid[0], block[0], shared_mem, tuple(args)))

            return call

    fake = types.ModuleType("cupy")
    fake.ndarray = FakeCupyArray
    fake.float32, fake.float64, fake.int64 = np.float32, np.float64, np.int64
    fake.asarray = lambda a, dtype=None: wrap(np.asarray(a, dtype))
    fake.ascontiguousarray = lambda a, dtype=None: wrap(np.ascontiguousarray(a, dtype))
    fake.empty = lambda shape, dtype=np.float64: wrap(np.empty(shape, dtype))
    fake.zeros = lambda shape, dtype=np.float64: wrap(np.zeros(shape, dtype))
    fake.array = lambda a, dtype=None, order="K", copy=True: wrap(np.array(a, dtype, order=order, copy=copy))
    fake.RawModule = RawModule
    fake.cuda = types.SimpleNamespace(Device=_FakeDevice,
                                      runtime=types.SimpleNamespace(getDevice=lambda: 0, getDeviceCount=lambda: 1,
                                                                    deviceGetAttribute=lambda attr, dev: 232448))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(cb, "_modules", {})
    monkeypatch.setattr(cb, "_kernels", {})
    return types.SimpleNamespace(wrap=wrap, launched=launched)


def test_cupy_glue_rotate(fake_cupy, rng):
    assert cb.availability() == (True, "ok")
    spec = RopeSpec(24, rotary_dim=20)
    positions = rng.integers(0, 30, size=(2, 7))
    cos, sin = (fake_cupy.wrap(a) for a in _tables(spec, np.arange(30)))
    rows = fake_cupy.wrap(positions.astype(np.int64))
    q = fake_cupy.wrap(rng.standard_normal((2, 7, 4, 24)).astype(np.float32))
    k = fake_cupy.wrap(rng.standard_normal((2, 7, 2, 24)).astype(np.float32))
    assert cb.accepts(q) and not cb.accepts(np.asarray(q))
    q0, k0 = np.array(q), np.array(k)
    qr, kr = cb.rotate([(q, None), (k, None)], cos, sin, rows, rotary_dim=20, layout="half", inverse=False)
    assert fake_cupy.launched == ["rope_rotate<float, float, 2, false>"]  # q and k in one launch
    assert isinstance(qr, FakeCupyArray) and qr.dtype == np.float32
    np.testing.assert_allclose(qr, _oracle(q0, positions, spec), rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(kr, _oracle(k0, positions, spec), rtol=2e-6, atol=2e-6)
    np.testing.assert_array_equal(q, q0)
    out = cb.rotate([(q, q), (k, k)], cos, sin, rows, rotary_dim=20, layout="half", inverse=False)
    assert out[0] is q and out[1] is k and len(fake_cupy.launched) == 2
    np.testing.assert_allclose(q, qr)
    k64 = fake_cupy.wrap(k0.astype(np.float64))
    qr2, kr2 = cb.rotate([(fake_cupy.wrap(q0), None), (k64, None)], cos, sin, rows, rotary_dim=20, layout="half",
                         inverse=False)
    assert fake_cupy.launched[2:] == ["rope_rotate<float, float, 2, false>", "rope_rotate<double, double, 2, false>"]
    np.testing.assert_allclose(kr2, _oracle(k0, positions, spec), rtol=1e-6, atol=1e-6)


def test_cupy_glue_rotate_out_layout(fake_cupy, rng):
    """cupy.rotate(out_layout=...): the mixed kernel, from a module of the mixed instantiations only (built when
    first asked for; the same-layout calls keep their module)."""
    spec = RopeSpec(24, rotary_dim=20, layout="interleaved")
    positions = rng.integers(0, 30, size=(2, 7))
    cos, sin = (fake_cupy.wrap(a) for a in _tables(spec, np.arange(30)))
    rows = fake_cupy.wrap(positions.astype(np.int64))
    q = fake_cupy.wrap(rng.standard_normal((2, 7, 4, 24)).astype(np.float32))
    k = fake_cupy.wrap(rng.standard_normal((2, 7, 2, 24)).astype(np.float32))
    q0, k0 = np.array(q), np.array(k)
    qr, kr = cb.rotate([(q, None), (k, None)], cos, sin, rows, rotary_dim=20, layout="interleaved", inverse=False,
                       out_layout="half")
    assert fake_cupy.launched == ["rope_rotate<float, float, 2, true, false>"]
    assert list(cb._modules) == [(0, "rope", "float32", "mixed")]
    assert set(next(iter(cb._modules.values())).names) == set(cb.name_expressions("rope", "float32", "mixed"))
    for got, x in ((qr, q0), (kr, k0)):
        want = _moved(_oracle(x, positions, spec), 20, "interleaved", "half")
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)
    np.testing.assert_array_equal(q, q0)
    cb.rotate([(q, None)], cos, sin, rows, rotary_dim=20, layout="interleaved", inverse=False)
    assert fake_cupy.launched[1] == "rope_rotate<float, float, 2, true>"
    assert sorted(key[3] for key in cb._modules) == ["", "mixed"]


@pytest.mark.parametrize("causal", [True, False])
def test_cupy_glue_linear_attention(fake_cupy, causal, rng):
    B, T, H, m, dv = 2, 20, 2, 8, 6
    spec = RopeSpec(m)
    cos, sin = (fake_cupy.wrap(a) for a in _tables(spec, np.arange(T)))
    rows = fake_cupy.wrap(np.arange(T, dtype=np.int64)[None])
    q, k = (rng.standard_normal((B, T, H, m)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((B, T, H, dv)).astype(np.float32)
    S0 = rng.standard_normal((B, H, m, dv)).astype(np.float32)
    z0 = rng.random((B, H, m)).astype(np.float32) + 1.0
    state = (fake_cupy.wrap(S0.copy()), fake_cupy.wrap(z0.copy()))
    o, (S, z) = cb.linear_attention(*(fake_cupy.wrap(a) for a in (q, k, v)), cos, sin, rows, rotary_dim=m,
                                    layout="half", causal=causal, feature_map="elu", eps=1e-6, chunk=8, state=state)
    assert fake_cupy.launched == ["linear_attention_chunked<float, float>"]
    ref, (S_ref, z_ref) = la_oracle(q, k, v, np.arange(T), spec, causal=causal, feature_map="elu", eps=1e-6,
                                    state=(S0, z0))
    assert isinstance(o, FakeCupyArray) and o.dtype == np.float32 and S.dtype == np.float32
    assert _rel(o, ref) < 1e-5 and _rel(S, S_ref) < 1e-5 and _rel(z, z_ref) < 1e-5
    np.testing.assert_array_equal(state[0], S0)   # the caller's state is not modified
    np.testing.assert_array_equal(state[1], z0)


# -- property: random shapes, strides, offsets and geometries ----------------------------------------
@st.composite
def rotate_problems(draw):
    head_dim = draw(st.integers(2, 40))
    rotary_dim = 2 * draw(st.integers(1, head_dim // 2))
    return dict(
        B=draw(st.integers(1, 3)), S=draw(st.integers(1, 9)), Hq=draw(st.integers(1, 4)), Hk=draw(st.integers(0, 3)),
        head_dim=head_dim, rotary_dim=rotary_dim, layout=draw(st.sampled_from(["half", "interleaved"])),
        dtype=draw(st.sampled_from(["float16", "float32", "float64"])), offset=draw(st.integers(0, 3)),
        step=draw(st.sampled_from([1, 1, 2])), inplace=draw(st.booleans()), inverse=draw(st.booleans()),
        threads=draw(st.sampled_from([1, 3, 32, 256])), tpb=draw(st.sampled_from([None, 1, 2])),
        seed=draw(st.integers(0, 2**32 - 1)))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(p=rotate_problems())
def test_rotate_random_problems(kernels, p):
    """Any shape/stride/offset/geometry: matches the oracle, inputs untouched, GQA pairs in one launch."""
    rng = np.random.default_rng(p["seed"])
    spec = RopeSpec(p["head_dim"], rotary_dim=p["rotary_dim"], layout=p["layout"])
    work = np.float64 if p["dtype"] == "float64" else np.float32
    positions = rng.integers(0, 64, size=(p["B"], p["S"]))
    cos, sin = _tables(spec, np.arange(64), work)

    def make(heads):
        shape = (p["B"], p["S"], heads, p["head_dim"] * p["step"])
        buf = rng.standard_normal(int(np.prod(shape)) + p["offset"]).astype(p["dtype"])
        return buf[p["offset"]:].reshape(shape)[..., ::p["step"]]

    xs = [make(p["Hq"])] + ([make(p["Hk"])] if p["Hk"] else [])
    originals = [x.copy() for x in xs]
    outs = [x if p["inplace"] else np.empty(x.shape, x.dtype) for x in xs]
    plan = cb.plan_rotate(list(zip(xs, outs)), cos, sin, positions.astype(np.int64), dtype_name=p["dtype"],
                          rotary_dim=p["rotary_dim"], layout=p["layout"], inverse=p["inverse"],
                          address=host.address, threads=p["threads"], max_tokens_per_block=p["tpb"])
    kernels.launch(plan)
    rtol, atol = tolerance(p["dtype"])
    for x0, x, y in zip(originals, xs, outs):
        np.testing.assert_allclose(y.astype(np.float64), _oracle(x0, positions, spec, p["inverse"]),
                                   rtol=rtol, atol=atol)
        if not p["inplace"]:
            np.testing.assert_array_equal(x, x0)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(p=rotate_problems(), out_other=st.booleans())
def test_rotate_random_problems_mixed_layouts(kernels, p, out_other):
    """Any shape/stride/offset/geometry with the pairs written in the other layout (or the same one, for
    comparison), separate outputs."""
    rng = np.random.default_rng(p["seed"])
    layout = p["layout"]
    out_layout = {"half": "interleaved", "interleaved": "half"}[layout] if out_other else layout
    spec = RopeSpec(p["head_dim"], rotary_dim=p["rotary_dim"], layout=layout)
    work = np.float64 if p["dtype"] == "float64" else np.float32
    positions = rng.integers(0, 64, size=(p["B"], p["S"]))
    cos, sin = _tables(spec, np.arange(64), work)

    def make(heads):
        shape = (p["B"], p["S"], heads, p["head_dim"] * p["step"])
        buf = rng.standard_normal(int(np.prod(shape)) + p["offset"]).astype(p["dtype"])
        return buf[p["offset"]:].reshape(shape)[..., ::p["step"]]

    xs = [make(p["Hq"])] + ([make(p["Hk"])] if p["Hk"] else [])
    originals = [x.copy() for x in xs]
    outs = [np.empty(x.shape, x.dtype) for x in xs]
    plan = cb.plan_rotate(list(zip(xs, outs)), cos, sin, positions.astype(np.int64), dtype_name=p["dtype"],
                          rotary_dim=p["rotary_dim"], layout=layout, inverse=p["inverse"], address=host.address,
                          threads=p["threads"], max_tokens_per_block=p["tpb"], out_layout=out_layout)
    kernels.launch(plan)
    rtol, atol = tolerance(p["dtype"])
    for x0, x, y in zip(originals, xs, outs):
        want = _moved(_oracle(x0, positions, spec, p["inverse"]), p["rotary_dim"], layout, out_layout)
        np.testing.assert_allclose(y.astype(np.float64), want, rtol=rtol, atol=atol)
        np.testing.assert_array_equal(x, x0)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(B=st.integers(1, 2), T=st.integers(1, 40), H=st.integers(1, 2), m=st.integers(2, 20), dv=st.integers(1, 12),
       causal=st.booleans(), layout=st.sampled_from(["half", "interleaved"]), chunk=st.sampled_from([1, 3, 8, 64]),
       threads=st.sampled_from([1, 7, 64]), budget=st.sampled_from([2048, cb.SHARED_MEM_LIMIT]),
       with_state=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_linear_attention_random_problems(kernels, B, T, H, m, dv, causal, layout, chunk, threads, budget, with_state,
                                          seed):
    rng = np.random.default_rng(seed)
    r = 2 * (m // 2)
    spec = RopeSpec(m, rotary_dim=r, layout=layout)
    positions = rng.integers(0, 50, size=(B, T))
    cos, sin = _tables(spec, np.arange(50))
    q, k = (rng.standard_normal((B, T, H, m)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((B, T, H, dv)).astype(np.float32)
    state = ((rng.standard_normal((B, H, m, dv)).astype(np.float32), rng.random((B, H, m)).astype(np.float32))
             if with_state else None)
    o, (S, z) = run_linear_attention(kernels, q, k, v, cos, sin, positions.astype(np.int64), rotary_dim=r,
                                     layout=layout, causal=causal, feature_map="elu", eps=1e-3, chunk=chunk,
                                     state=state, threads=threads, shared_mem_limit=budget)
    ref, (S_ref, z_ref) = la_oracle(q, k, v, positions, spec, causal=causal, feature_map="elu", eps=1e-3, state=state)
    assert _rel(o, ref) < 2e-5 and _rel(S, S_ref) < 2e-5 and _rel(z, z_ref) < 2e-5


def test_shim_reports_what_a_gpu_would_fault_on(kernels, rng):
    """The harness itself: wrong argument lists, misaligned vector accesses, shared memory overruns."""
    spec = RopeSpec(32)
    cos, sin = _tables(spec, np.arange(4))
    rows = np.arange(4, dtype=np.int64)[None]
    buf = rng.standard_normal(2 * 4 * 32 + 4).astype(np.float32)
    x = buf[:4 * 2 * 32].reshape(1, 4, 2, 32)
    y = np.empty_like(x)
    plan = cb.plan_rotate([(x, y)], cos, sin, rows, dtype_name="float32", rotary_dim=32, layout="half",
                          inverse=False, address=host.address, threads=16)
    assert plan.kernel == "rope_rotate<float, float, 4, false>"
    kernels.launch(plan)  # the valid plan runs
    with pytest.raises(RuntimeError, match="arguments"):
        kernels.launch(plan._replace(args=plan.args[:-1]))
    with pytest.raises(RuntimeError, match="bytes"):
        kernels.launch(plan._replace(args=plan.args[:-1] + (np.int64(1),)))
    shifted = buf[1:1 + 4 * 2 * 32].reshape(1, 4, 2, 32)   # 4-byte aligned only: V=4 would fault on a GPU
    with pytest.raises(RuntimeError, match="misaligned"):
        kernels.launch(plan._replace(args=(shifted,) + plan.args[1:]))
    with pytest.raises(RuntimeError, match="shared memory"):
        kernels.launch(plan._replace(shared_mem=plan.shared_mem - 8))


def test_plan_cache_substitutes_the_new_arrays(kernels, rng):
    """A cached plan (same shapes/strides/alignment) carries the new call's arrays, and holds none itself."""
    spec = RopeSpec(32, layout="interleaved")
    cos, sin = _tables(spec, np.arange(6))
    rows = np.arange(6, dtype=np.int64)[None]
    kw = dict(dtype_name="float32", rotary_dim=32, layout="interleaved", inverse=False, address=host.address,
              threads=16)
    for _ in range(3):
        q = rng.standard_normal((1, 6, 4, 32)).astype(np.float32)
        k = rng.standard_normal((1, 6, 2, 32)).astype(np.float32)
        for items in ([(q, np.empty_like(q)), (k, k)], [(q, np.empty_like(q))]):
            k0 = k.copy()
            plan = cb.plan_rotate(items, cos, sin, rows, **kw)
            uncached = cb._plan_rotate(items, cos, sin, rows, max_tokens_per_block=None,
                                       shared_mem_limit=cb.SHARED_MEM_LIMIT, **kw)
            assert plan[:5] == uncached[:5]
            assert all(a is b if isinstance(a, np.ndarray) else a == b for a, b in zip(plan.args, uncached.args))
            kernels.launch(plan)
            np.testing.assert_allclose(items[0][1], _oracle(q, np.arange(6), spec), rtol=2e-6, atol=2e-6)
            if len(items) == 2:
                np.testing.assert_allclose(k, _oracle(k0, np.arange(6), spec), rtol=2e-6, atol=2e-6)
    for _, template, _ in cb._plan_cache.values():
        assert not any(isinstance(a, np.ndarray) for a in template)


# -- exact float64 angles (issue 14): the kernels read the host tables --------------------------------
def test_float64_rotation_exact_through_kernels(use_backend, rng):
    from .test_exact_angles import SPECS, _assert_exact, _positions

    name = use_backend(threads=32, max_tokens_per_block=3)
    for spec in (SPECS["llama"], SPECS["interleaved-partial"]):
        pos = _positions(rng, 4)
        x = rng.standard_normal((1, len(pos), 2, spec.head_dim))
        _assert_exact(rotary.apply(x, pos[None], spec=spec, seq_axis=1, backend=name), x, pos, spec)


@pytest.mark.parametrize("threads", [32, 128])
@pytest.mark.parametrize("causal,decay,normalize,dtype", [(True, None, True, np.float64), (True, [0.8, 0.99], False,
                                                          np.float64), (False, None, True, np.float64),
                                                         (True, [0.7, 1.0], True, np.float32)])
def test_linear_attention_ragged_packed_batch(use_backend, threads, causal, decay, normalize, dtype, monkeypatch):
    """A ragged packed batch (cu_seqlens, one empty sequence) in one launch of the CUDA kernel (one block per
    sequence, k/v head and dv tile), each sequence against the float64 oracle on that sequence alone."""
    from .test_linear_attention_variants import ragged_against_oracle

    name = use_backend(threads=threads)
    launches = []
    real = cb.plan_linear_attention
    monkeypatch.setattr(cb, "plan_linear_attention", lambda *a, **kw: launches.append(kw) or real(*a, **kw))
    ragged_against_oracle(name, causal, normalize, dtype, decay)
    assert len(launches) == 1 and launches[0]["cu_seqlens"] is not None


# -- the HF vision towers' specs (rotary/spec/hf_vision.py) on every backend ---------------------------
#: minimal config.json dicts: the class-defaults table (rotary/spec/hf_defaults.py) fills in the heads
VISION_DICTS = {
    **{mt: {"model_type": mt, "memory_attention_hidden_size": 256, "memory_attention_downsample_rate": 1,
            "memory_attention_num_attention_heads": 1} for mt in ("sam2_video", "sam3_tracker_video", "edgetam_video")},
    "sapiens2": {"model_type": "sapiens2", "hidden_size": 1024, "num_attention_heads": 16, "rope_theta": 100.0},
    "efficientloftr": {"model_type": "efficientloftr", "hidden_size": 256, "num_attention_heads": 8,
                       "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                           "partial_rotary_factor": 4.0}},
    "dinov3_vit": {"model_type": "dinov3_vit", "hidden_size": 384, "num_attention_heads": 6, "rope_theta": 100.0},
}


@pytest.mark.parametrize("model_type", sorted(hf_vision.VISION_TOWERS))
def test_hf_vision_tower_specs_on_every_backend(model_type, use_backend, rng):
    """Each vision tower's spec (axial sections, x-first or alternating pair axes, a partial rotary dim, float
    coordinates) through NumPy, Numba and the CUDA kernels on the host shim, against the float64 complex
    oracle. tests/test_peers_vision_towers.py checks the same specs against HF."""
    spec = RopeSpec.from_hf_vision_config(VISION_DICTS.get(model_type, {"model_type": model_type}))
    h, w = 4, 6
    if spec.float_positions:
        pos = rotary.grid_positions(h, w, normalized=True)
    elif spec.n_axes == 3:
        pos = rotary.grid_positions(h, w, 2)
    else:
        pos = rotary.grid_positions(h, w) + 7
    x = rng.standard_normal((1, len(pos), 2, spec.head_dim)).astype(np.float32)
    want = rope_complex(x, pos[None, :, None, :], spec.inv_freq(), layout=spec.layout,
                        pair_axes=spec.pair_axes())
    backends = ["numpy", use_backend()] + (["numba"] if registry.available_backends()["numba"][0] else [])
    rtol, atol = tolerance(np.float32)
    for backend in backends:
        got = rotary.apply(x, pos, spec=spec, seq_axis=-3, backend=backend)
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol * 10, err_msg=f"{model_type} on {backend}")


# -- benchmarks/cuda_resources.py: the occupancy arithmetic of docs/cuda.md --------------------------
def test_occupancy_arithmetic_matches_cuda_rules():
    """Registers rounded to 8 per thread and 256 per warp, 1 KiB reserved per block, 64 warps per SM."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "cuda_resources.py"
    spec = importlib.util.spec_from_file_location("cuda_resources", path)
    cr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cr)
    assert cr.blocks_per_sm("sm_90", 32, 256, 2176)[0] == 8             # full: 64 warps
    assert cr.blocks_per_sm("sm_90", 40, 256, 2176) == (6, "registers")   # 1280 regs/warp -> 51 warps
    assert cr.blocks_per_sm("sm_90", 255, 256, 0) == (1, "registers")
    assert cr.blocks_per_sm("sm_90", 167, 128, 45508) == (3, "registers")  # 168 * 32 = 5376 -> 12 warps
    assert cr.blocks_per_sm("sm_90", 64, 128, 166660) == (1, "shared memory")
    assert cr.blocks_per_sm("sm_80", 64, 128, 96132) == (1, "shared memory")
    assert cr.occupancy("sm_90", 167, 128, 45508)[0] == pytest.approx(12 / 64)
    grids = {label: g["grid"] for label, g, *_ in cr.linear_workloads(1, 8)}
    assert grids == {"48 KiB": 32, "100 KiB": 16, "227 KiB": 16}


def test_kernels_pass_the_shim_checks_without_a_sanitizer(kernels, monkeypatch):
    """The checks that need no sanitizer runtime, on the plain build: the quick conformance cases with every
    launch run twice under two shared-memory poisons (identical outputs), exact-extent copies of the global
    buffers, three concurrent block slots and the divergent-barrier check (tests/test_cuda_sanitizers.py
    adds ASan/UBSan/TSan where the runtimes exist)."""
    # the same library (each launch sets the slots and poison it runs with)
    checked = host.HostKernels(kernels.path, kernels.entries, slots=3, guard=True, compare=True)
    shim_register(monkeypatch, shim_backend(checked, threads=32, max_tokens_per_block=3))
    for case in conformance.cases(quick=True):
        result = conformance.run_case(case, "cuda-shim")
        assert result.passed, f"{case.name}: {result.max_error:.3g} {result.detail}"
    for case in conformance.linear_cases(quick=True):
        result = conformance.run_linear_case(case, "cuda-shim")
        assert result.passed, f"{case.name}: {result.max_error:.3g} {result.detail}"
    assert checked.launches >= len(conformance.cases(quick=True))
