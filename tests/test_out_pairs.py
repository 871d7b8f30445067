"""``out_pairs``: pairs read in the spec's layout and written in another one in the same pass (DeepSeek MLA's
``apply_rotary_pos_emb_interleave``: interleaved q/k in, half-split pairs out; and the way back).

Checked against two oracles of their own: a float64 NumPy one written here (de-interleave, then the half-split
rotation with cos/sin computed in float64 from the spec's inv_freq, then re-interleave when asked) and HF
DeepSeek-V3's ``apply_rotary_pos_emb_interleave`` (transformers, in float64), on the NumPy and Numba backends:
float16/32/64, partial rotary, both directions, apply / apply_qk (GQA) / Rope, strided inputs, out= buffers,
inverse; the results are also the same-layout rotation's bits with the pairs moved (same products and sums).
The CUDA kernels' cases are in tests/test_cuda_kernels_cpu.py (host shim) and the conformance suite.
"""

from __future__ import annotations

import numpy as np
import pytest

import rotary
from rotary import RopeSpec

from .conftest import backend_params

BACKENDS = [p for p in backend_params() if p.values[0] != "cupy"]
DIRECTIONS = [("interleaved", "half"), ("half", "interleaved")]
TOL = {np.float16: (2e-3, 2e-3), np.float32: (2e-6, 2e-6), np.float64: (1e-12, 1e-12)}


def _rel_close(got, want, dtype):
    rtol, atol = TOL[np.dtype(dtype).type]
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=rtol, atol=atol)


def oracle(x, positions, spec, out_pairs, *, seq_axis, inverse=False):
    """float64: x's pairs de-interleaved (layout "interleaved") into half-split order, the half-split rotation
    (``x * cos + rotate_half(x) * sin``) with float64 angles from ``spec.inv_freq()``, then re-interleaved when
    ``out_pairs`` is "interleaved". positions: (S,) or (B, S) ints; x: any axes, the sequence axis ``seq_axis``."""
    x = np.asarray(x, np.float64)
    ax = seq_axis % x.ndim
    xs = np.moveaxis(x, ax, -2)                                        # (..., S, D)
    off, r = spec.rotary_offset, spec.rotary_dim
    half = r // 2
    p = np.asarray(positions, np.float64)
    ang = p[..., None] * spec.inv_freq()                              # (S, half) or (B, S, half)
    if ang.ndim == 3:
        ang = ang.reshape((ang.shape[0],) + (1,) * (xs.ndim - 3) + ang.shape[1:])
    cos, sin = np.cos(ang), np.sin(ang)
    if inverse:
        sin = -sin
    part = xs[..., off:off + r]
    if spec.layout == "interleaved":   # HF: x.view(..., d // 2, 2).transpose(-1, -2).reshape(..., d)
        part = part.reshape(part.shape[:-1] + (half, 2)).swapaxes(-1, -2).reshape(part.shape)
    cos2, sin2 = np.concatenate([cos, cos], -1), np.concatenate([sin, sin], -1)
    rotate_half = np.concatenate([-part[..., half:], part[..., :half]], -1)
    y_half = part * cos2 + rotate_half * sin2                          # pairs (i, i + half)
    if out_pairs == "interleaved":
        y_half = y_half.reshape(y_half.shape[:-1] + (2, half)).swapaxes(-1, -2).reshape(y_half.shape)
    y = xs.copy()
    y[..., off:off + r] = y_half
    return np.moveaxis(y, -2, ax)


def _data(rng, shape, dtype, strided=False):
    if strided:   # every other element of a wider head, sequence reversed: no unit stride anywhere useful
        full = rng.standard_normal(shape[:-1] + (2 * shape[-1],)).astype(dtype)
        return np.flip(full[..., ::2], axis=1)
    return rng.standard_normal(shape).astype(dtype)


# -- the oracle itself against HF DeepSeek-V3 ------------------------------------------------------------
def _hf_interleave():
    torch = pytest.importorskip("torch")
    try:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave
    except ImportError as exc:
        pytest.skip(f"transformers' DeepSeek-V3 is not importable: {exc}")
    return torch, apply_rotary_pos_emb_interleave


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_deepseek_mla_equals_hf_apply_rotary_pos_emb_interleave(backend, dtype, rng):
    """q_pe / k_pe of DeepSeek MLA (BHSD, rope head 64, one shared k head): HF's rotation in float64, and the
    oracle of this file, against apply_qk(layout="interleaved", out_pairs="half")."""
    torch, hf = _hf_interleave()
    B, H, S, D = 2, 4, 7, 64
    spec = RopeSpec(D, base=10000.0, layout="interleaved")
    q, k = rng.standard_normal((B, H, S, D)).astype(dtype), rng.standard_normal((B, 1, S, D)).astype(dtype)
    pos = rng.integers(0, 4000, size=(B, S))
    freqs = pos[..., None].astype(np.float64) * spec.inv_freq()
    emb = np.concatenate([freqs, freqs], -1)                          # HF's cos/sin: cat(freqs, freqs)
    cos, sin = (torch.from_numpy(f(emb)) for f in (np.cos, np.sin))
    hq, hk = hf(torch.from_numpy(q.astype(np.float64)), torch.from_numpy(k.astype(np.float64)), cos, sin)
    np.testing.assert_allclose(oracle(q, pos, spec, "half", seq_axis=2), hq.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(oracle(k, pos, spec, "half", seq_axis=2), hk.numpy(), rtol=1e-12, atol=1e-12)
    qr, kr = rotary.apply_qk(q, k, pos, spec=spec, seq_axis=2, out_pairs="half", backend=backend)
    assert qr.dtype == dtype and kr.dtype == dtype and qr.shape == q.shape and kr.shape == k.shape
    _rel_close(qr, hq.numpy(), dtype)
    _rel_close(kr, hk.numpy(), dtype)


# -- apply / apply_qk against the oracle -----------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("layout,out_pairs", DIRECTIONS)
@pytest.mark.parametrize("head_dim,rotary_dim", [(64, 64), (24, 16), (20, 12), (80, 64)])
def test_apply_qk_gqa(backend, dtype, layout, out_pairs, head_dim, rotary_dim, rng):
    """BSHD q (8 heads) and k (2 heads), per-batch positions, partial rotary: the rest is copied unchanged."""
    spec = RopeSpec(head_dim, rotary_dim=rotary_dim, layout=layout)
    q, k = _data(rng, (2, 9, 8, head_dim), dtype), _data(rng, (2, 9, 2, head_dim), dtype)
    q0, k0 = q.copy(), k.copy()
    pos = rng.integers(0, 3000, size=(2, 9))
    for inverse in (False, True):
        qr, kr = rotary.apply_qk(q, k, pos, spec=spec, seq_axis=1, inverse=inverse, out_pairs=out_pairs,
                                 backend=backend)
        _rel_close(qr, oracle(q, pos, spec, out_pairs, seq_axis=1, inverse=inverse), dtype)
        _rel_close(kr, oracle(k, pos, spec, out_pairs, seq_axis=1, inverse=inverse), dtype)
        np.testing.assert_array_equal(qr[..., rotary_dim:], q[..., rotary_dim:])
        np.testing.assert_array_equal(kr[..., rotary_dim:], k[..., rotary_dim:])
    np.testing.assert_array_equal(q, q0)
    np.testing.assert_array_equal(k, k0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("layout,out_pairs", DIRECTIONS)
def test_strided_inputs_and_out_buffers(backend, dtype, layout, out_pairs, rng):
    """Non-contiguous inputs (strided head, reversed sequence) into separate out= buffers (contiguous, and a
    strided view of a larger buffer whose other elements must stay untouched), apply and apply_qk."""
    spec = RopeSpec(24, rotary_dim=16, layout=layout)
    q, k = _data(rng, (2, 6, 4, 24), dtype, strided=True), _data(rng, (2, 6, 2, 24), dtype, strided=True)
    assert not q.flags.c_contiguous
    pos = 37
    want_q = oracle(q, np.arange(6) + pos, spec, out_pairs, seq_axis=1)
    want_k = oracle(k, np.arange(6) + pos, spec, out_pairs, seq_axis=1)
    y = np.full(q.shape, np.nan, dtype)
    got = rotary.apply(q, pos, spec=spec, seq_axis=1, out=y, out_pairs=out_pairs, backend=backend)
    assert got is y
    _rel_close(y, want_q, dtype)
    big_q, big_k = np.full((2, 6, 4, 48), 7, dtype), np.full((2, 6, 2, 48), 7, dtype)
    qo, ko = big_q[..., 1::2], big_k[..., 1::2]
    got = rotary.apply_qk(q, k, pos, spec=spec, seq_axis=1, out=(qo, ko), out_pairs=out_pairs, backend=backend)
    assert got[0] is qo and got[1] is ko
    _rel_close(qo, want_q, dtype)
    _rel_close(ko, want_k, dtype)
    assert (big_q[..., 0::2] == 7).all() and (big_k[..., 0::2] == 7).all()
    qo2 = np.empty_like(q)   # one out given, the other allocated
    got = rotary.apply_qk(q, k, pos, spec=spec, seq_axis=1, out=(qo2, None), out_pairs=out_pairs, backend=backend)
    assert got[0] is qo2
    _rel_close(got[0], want_q, dtype)
    _rel_close(got[1], want_k, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout,out_pairs", DIRECTIONS)
@pytest.mark.parametrize("seq_axis,shape", [(0, (11, 3, 32)), (2, (2, 3, 5, 32)), (-2, (4, 32))])
def test_axes_and_offset_spec(backend, layout, out_pairs, seq_axis, shape, rng):
    """Other axis orders (SHD, BHSD, 2-D), and a spec with rotary_offset ([nope | rope | rest] heads)."""
    for spec in (RopeSpec(32, rotary_dim=24, layout=layout),
                 RopeSpec(32, rotary_dim=16, rotary_offset=8, layout=layout)):
        x = _data(rng, shape, np.float32)
        seq = shape[seq_axis]
        got = rotary.apply(x, 5, spec=spec, seq_axis=seq_axis, out_pairs=out_pairs, backend=backend)
        _rel_close(got, oracle(x, np.arange(seq) + 5, spec, out_pairs, seq_axis=seq_axis), np.float32)
        if spec.rotary_offset:
            np.testing.assert_array_equal(got[..., :8], x[..., :8])
            np.testing.assert_array_equal(got[..., 24:], x[..., 24:])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("layout,out_pairs", DIRECTIONS)
def test_bits_are_the_same_layout_rotation_moved(backend, dtype, layout, out_pairs, rng):
    """The same products and sums as the same-layout rotation: its bits, with the pairs at their out_pairs
    coordinates (rotary.convert_layout), unit-stride and strided heads (SIMD and scalar loops alike)."""
    spec = RopeSpec(72, rotary_dim=68, layout=layout)   # 34 pairs: whole registers and a remainder
    for strided in (False, True):
        q, k = _data(rng, (3, 5, 4, 72), dtype, strided), _data(rng, (3, 5, 1, 72), dtype, strided)
        pos = rng.integers(0, 9000, size=(3, 5))
        same = rotary.apply_qk(q, k, pos, spec=spec, seq_axis=1, backend=backend)
        moved = rotary.apply_qk(q, k, pos, spec=spec, seq_axis=1, out_pairs=out_pairs, backend=backend)
        for s, m in zip(same, moved):
            np.testing.assert_array_equal(rotary.convert_layout(s, to=out_pairs, rotary_dim=68), m)


def test_numpy_and_numba_agree_bit_for_bit(rng):
    if not rotary.available_backends()["numba"][0]:
        pytest.skip("numba is not installed")
    for dtype in (np.float16, np.float32, np.float64):
        for layout, out_pairs in DIRECTIONS:
            spec = RopeSpec(40, rotary_dim=36, layout=layout)
            q, k = _data(rng, (2, 7, 3, 40), dtype), _data(rng, (2, 7, 1, 40), dtype)
            a = rotary.apply_qk(q, k, 11, spec=spec, seq_axis=1, out_pairs=out_pairs, backend="numpy")
            b = rotary.apply_qk(q, k, 11, spec=spec, seq_axis=1, out_pairs=out_pairs, backend="numba")
            for x, y in zip(a, b):
                np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout,out_pairs", DIRECTIONS)
def test_the_other_direction_undoes_it(backend, layout, out_pairs, rng):
    """Rotating interleaved->half and then back with inverse=True (read half, write interleaved) gives x."""
    x = _data(rng, (2, 9, 3, 32), np.float64)
    pos = rng.integers(0, 500, size=(2, 9))
    y = rotary.apply(x, pos, layout=layout, seq_axis=1, out_pairs=out_pairs, backend=backend)
    back = rotary.apply(y, pos, layout=out_pairs, seq_axis=1, out_pairs=layout, inverse=True, backend=backend)
    np.testing.assert_allclose(back, x, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_pairs_equal_to_the_layout_is_the_usual_call(backend, rng):
    """out_pairs equal to the spec's layout is the plain call (in place allowed)."""
    for layout in ("half", "interleaved"):
        x = _data(rng, (2, 6, 4, 32), np.float32)
        want = rotary.apply(x, 3, layout=layout, seq_axis=1, backend=backend)
        np.testing.assert_array_equal(rotary.apply(x, 3, layout=layout, seq_axis=1, out_pairs=layout,
                                                   backend=backend), want)
        xx = x.copy()
        assert rotary.apply(xx, 3, layout=layout, seq_axis=1, out=xx, out_pairs=layout, backend=backend) is xx
        np.testing.assert_array_equal(xx, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_planned_calls_keep_out_pairs_apart(backend, rng):
    """Repeated calls of one geometry (a cached plan) with and without out_pairs each give their own result."""
    spec = RopeSpec(32, layout="interleaved")
    q, k = _data(rng, (4, 1, 8, 32), np.float32), _data(rng, (4, 1, 2, 32), np.float32)
    for _ in range(3):
        for out_pairs in (None, "half", "interleaved"):
            pos = rng.integers(0, 2000, size=(4, 1))
            qr, kr = rotary.apply_qk(q, k, pos, spec=spec, seq_axis=1, out_pairs=out_pairs, backend=backend)
            _rel_close(qr, oracle(q, pos, spec, out_pairs or "interleaved", seq_axis=1), np.float32)
            _rel_close(kr, oracle(k, pos, spec, out_pairs or "interleaved", seq_axis=1), np.float32)


# -- Rope ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
@pytest.mark.parametrize("layout,out_pairs", DIRECTIONS)
def test_rope_prepared_path(backend, dtype, layout, out_pairs, rng):
    """Rope(...)(q, k, out_pairs=...) and rope.apply: the first call validates, later ones take the prepared
    path (decode: one token per sequence, positions past the first table); into new arrays and into outs."""
    spec = RopeSpec(64, rotary_dim=48, layout=layout)
    rope = rotary.Rope(spec, backend=backend, dtype=dtype, seq_axis=1)
    q, k = _data(rng, (5, 1, 8, 64), dtype), _data(rng, (5, 1, 2, 64), dtype)
    qo, ko = np.empty_like(q), np.empty_like(k)
    for step in range(4):
        pos = rng.integers(0, 3000, size=(5, 1))
        want_q, want_k = (oracle(a, pos, spec, out_pairs, seq_axis=1) for a in (q, k))
        qr, kr = rope(q, k, pos, out_pairs=out_pairs)
        _rel_close(qr, want_q, dtype)
        _rel_close(kr, want_k, dtype)
        got = rope(q, k, pos, out=(qo, ko), out_pairs=out_pairs)
        assert got[0] is qo and got[1] is ko
        np.testing.assert_array_equal(qo, qr)
        np.testing.assert_array_equal(ko, kr)
        _rel_close(rope.apply(k, pos, out_pairs=out_pairs), want_k, dtype)
        _rel_close(rope.apply(k, pos, inverse=True, out_pairs=out_pairs),
                   oracle(k, pos, spec, out_pairs, seq_axis=1, inverse=True), dtype)
        same = rope(q, k, pos)   # the plain call of the same geometry: its own plan
        _rel_close(same[0], oracle(q, pos, spec, layout, seq_axis=1), dtype)
    if backend == "numba" and dtype == np.float32:
        assert any(p.out_layout == out_pairs for p in rope._plans.values()), "the prepared path was never taken"


# -- errors ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_out_pairs_values(backend, rng):
    x = _data(rng, (4, 16), np.float32)
    q, k = _data(rng, (1, 4, 2, 16), np.float32), _data(rng, (1, 4, 1, 16), np.float32)
    rope = rotary.Rope(RopeSpec(16), backend=backend, seq_axis=1)
    for bad in ("full", "Half", "", 1, True, ["half"], ("half",)):
        with pytest.raises(ValueError, match="out_pairs"):
            rotary.apply(x, out_pairs=bad, backend=backend)
        with pytest.raises(ValueError, match="out_pairs"):
            rotary.apply_qk(q, k, seq_axis=1, out_pairs=bad, backend=backend)
        with pytest.raises(ValueError, match="out_pairs"):
            rope(q, k, out_pairs=bad)
        with pytest.raises(ValueError, match="out_pairs"):
            rope.apply(q, out_pairs=bad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_in_place_with_another_layout_is_refused(backend, rng):
    """out is x, out a view of x's memory (another object, a shifted view), q's out k's input: ValueErrors naming
    the out; nothing is written."""
    spec = RopeSpec(16, layout="interleaved")
    x = _data(rng, (5, 16), np.float32)
    x0 = x.copy()
    for out in (x, x.view(), x[::-1][::-1]):
        with pytest.raises(ValueError, match=r"^out (is x itself|shares memory with x)"):
            rotary.apply(x, spec=spec, out=out, out_pairs="half", backend=backend)
    buf = np.zeros(16 * 6, np.float32)
    src, dst = buf[:80].reshape(5, 16), buf[16:].reshape(5, 16)   # partial overlap
    with pytest.raises(ValueError, match="out"):
        rotary.apply(src, spec=spec, out=dst, out_pairs="half", backend=backend)
    q, k = _data(rng, (1, 5, 4, 16), np.float32), _data(rng, (1, 5, 2, 16), np.float32)
    with pytest.raises(ValueError, match="out for q is q itself"):
        rotary.apply_qk(q, k, spec=spec, seq_axis=1, out=(q, k), out_pairs="half", backend=backend)
    with pytest.raises(ValueError, match="out for k is k itself"):
        rotary.apply_qk(q, k, spec=spec, seq_axis=1, out=(None, k), out_pairs="half", backend=backend)
    with pytest.raises(ValueError, match="out for k shares memory with k"):
        rotary.apply_qk(q, k, spec=spec, seq_axis=1, out=(None, k[:]), out_pairs="half", backend=backend)
    rope = rotary.Rope(spec, backend=backend, seq_axis=1)
    qo, ko = np.empty_like(q), np.empty_like(k)
    rope(q, k, out=(qo, ko), out_pairs="half")
    rope(q, k, out=(qo, ko), out_pairs="half")   # planned
    with pytest.raises(ValueError, match="out for q"):
        rope(q, k, out=(q, k), out_pairs="half")
    with pytest.raises(ValueError, match="out for q shares memory with q"):
        rope(q, k, out=(q[:], ko), out_pairs="half")   # the planned geometry, another view of q's memory
    with pytest.raises(ValueError, match="out"):
        rope.apply(k, out=k, out_pairs="half")
    np.testing.assert_array_equal(x, x0)


def test_backend_primitives_refuse_in_place_with_another_layout(rng):
    """The backend contract: no out is its x when out_layout differs (the Numba kernels would read written
    pairs); the NumPy reference writes permuted from its block buffer."""
    from rotary.backends import numpy as ref

    spec = RopeSpec(16, layout="interleaved")
    x = _data(rng, (1, 4, 2, 16), np.float32)
    cos, sin = spec.cos_sin(np.arange(4), dtype=np.float32)
    rows = np.arange(4, dtype=np.int64)[None]
    y = ref.rotate([(x, None)], cos, sin, rows, rotary_dim=16, layout="interleaved", inverse=False,
                   out_layout="half")[0]
    _rel_close(y, oracle(x, np.arange(4), spec, "half", seq_axis=1), np.float32)
    if rotary.available_backends()["numba"][0]:
        from rotary.backends import numba as nb

        z = nb.rotate([(x, None)], cos, sin, rows, rotary_dim=16, layout="interleaved", inverse=False,
                      out_layout="half")[0]
        np.testing.assert_array_equal(z, y)
        with pytest.raises(ValueError, match="in place"):
            nb.rotate([(x, x)], cos, sin, rows, rotary_dim=16, layout="interleaved", inverse=False,
                      out_layout="half")


# -- other array libraries (through their adapters) --------------------------------------------------------
def test_torch_tensors_and_autograd(rng):
    """torch CPU tensors take out_pairs; the backward reads the gradient's pairs in out_pairs and writes them in
    the spec's layout (gradcheck), out= tensors are written, in place refused."""
    torch = pytest.importorskip("torch")
    spec = RopeSpec(16, rotary_dim=12, layout="interleaved")
    x = torch.from_numpy(_data(rng, (5, 3, 16), np.float64)).requires_grad_()
    y = rotary.apply(x, 3, spec=spec, seq_axis=0, out_pairs="half")
    np.testing.assert_allclose(y.detach().numpy(), oracle(x.detach().numpy(), np.arange(5) + 3, spec, "half",
                                                          seq_axis=0), rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda t: rotary.apply(t, 3, spec=spec, seq_axis=0, out_pairs="half"), (x,))
    q = torch.from_numpy(_data(rng, (5, 4, 16), np.float64)).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda a, b: rotary.apply_qk(a, b, 3, layout="half", rotary_dim=12, seq_axis=0, out_pairs="interleaved"),
        (q, x))
    with torch.no_grad():
        xt = x.detach().float()
        out = torch.empty_like(xt)
        assert rotary.apply(xt, 3, spec=spec, seq_axis=0, out=out, out_pairs="half") is out
        with pytest.raises(ValueError, match="out"):
            rotary.apply(xt, 3, spec=spec, seq_axis=0, out=xt, out_pairs="half")


def test_jax_traced_and_concrete(rng):
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    spec = RopeSpec(16, rotary_dim=12, layout="interleaved")
    x = _data(rng, (5, 3, 16), np.float32)
    want = oracle(x, np.arange(5) + 3, spec, "half", seq_axis=0)
    traced = jax.jit(lambda a, p: rotary.apply(a, p, spec=spec, seq_axis=0, out_pairs="half"))
    _rel_close(np.asarray(traced(jnp.asarray(x), 3)), want, np.float32)
    _rel_close(np.asarray(rotary.apply(jnp.asarray(x), 3, spec=spec, seq_axis=0, out_pairs="half")), want, np.float32)
    with pytest.raises(ValueError, match="out_pairs"):
        traced = jax.jit(lambda a, p: rotary.apply(a, p, spec=spec, seq_axis=0, out_pairs="full"))
        traced(jnp.asarray(x), 3)
