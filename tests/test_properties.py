"""Property-based tests of the rotation surface (issue 25): apply / apply_qk / Rope / rerotate / RopeSpec's
tables over drawn geometries, positions, dtypes, layouts, M-RoPE and axial specs, against the float64
oracles of tests/_props.py, on NumPy and Numba.

Budgets: see tests/_props.py (``HYPOTHESIS_PROFILE=thorough`` for 20x the examples).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, strategies as st

import rotary

from . import _props as P

backends = st.sampled_from(P.BACKENDS)
dtypes = st.sampled_from(["float16", "float32", "float64"])


@st.composite
def rotation_calls(draw, spec_strategy=None, big=False):
    """(spec, x (B, S, H, D) or (S, D), seq_axis, positions, dtype) for apply."""
    spec = draw(spec_strategy or P.plain_specs())
    dtype = draw(dtypes)
    S = draw(st.integers(0, 9))
    form = draw(st.sampled_from(["bshd", "bhsd", "sd"]))
    B, H = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    shape = {"bshd": (B, S, H, spec.head_dim), "bhsd": (B, H, S, spec.head_dim), "sd": (S, spec.head_dim)}[form]
    seq_axis = {"bshd": -3, "bhsd": -2, "sd": 0}[form]
    x = P.data(draw, shape, dtype, nonfinite=draw(st.booleans()))
    positions = P.positions_1d(draw, S, batch=None if form == "sd" else B, big=big and dtype == "float64")
    return spec, x, seq_axis, positions, dtype


def oracle_for(x, seq_axis, positions, spec, inverse=False):
    xs = np.moveaxis(np.asarray(x, np.float64), seq_axis, -2)
    S = xs.shape[-2]
    p = P.positions_array(positions, S)
    want = P.spec_oracle(xs, p, spec, inverse=inverse)
    return np.moveaxis(want, -2, seq_axis)


@P.examples(150)
@given(call=rotation_calls(big=True), backend=backends, inverse=st.booleans(), inplace=st.booleans())
def test_apply_matches_the_oracle(call, backend, inverse, inplace):
    """Any 1-D spec (offset, partial rotary_dim, both layouts), any dtype, positions None / offsets /
    arrays / per batch up to 2**53 (float64), NaN/inf data propagated pair by pair, in place or not."""
    spec, x, seq_axis, positions, dtype = call
    x0 = x.copy()
    want = oracle_for(x, seq_axis, positions, spec, inverse)
    y = rotary.apply(x, positions, spec=spec, seq_axis=seq_axis, inverse=inverse, backend=backend,
                     out=x if inplace else None)
    assert y.dtype == x0.dtype and y.shape == x0.shape
    P.assert_matches(y, want, dtype)
    if not inplace:
        np.testing.assert_array_equal(x, x0)   # the input is never mutated


@P.examples(80)
@given(call=rotation_calls(), backend=backends, kdtype=dtypes, kheads=st.integers(1, 2), alias=st.booleans())
def test_apply_qk_mixed_dtypes_gqa_and_aliasing(call, backend, kdtype, kheads, alias):
    """q and k of different dtypes and head counts rotate each in its own precision; q passed as k too
    (aliasing) gives two rotations of the same array, the input unchanged."""
    spec, q, seq_axis, positions, dtype = call
    assume(q.ndim == 4)
    hax = 2 if seq_axis == -3 else 1
    kshape = list(q.shape)
    kshape[hax] = kheads
    k = q if alias else np.random.default_rng(1).standard_normal(kshape).astype(kdtype)
    q0, k0 = q.copy(), k.copy()
    qr, kr = rotary.apply_qk(q, k, positions, spec=spec, seq_axis=seq_axis, backend=backend)
    P.assert_matches(qr, oracle_for(q0, seq_axis, positions, spec), dtype)
    P.assert_matches(kr, oracle_for(k0, seq_axis, positions, spec), k0.dtype)
    np.testing.assert_array_equal(q, q0)
    if alias:
        np.testing.assert_array_equal(qr, kr)


@P.examples(60)
@given(call=rotation_calls(), backend=backends, shift=st.integers(1, 5))
def test_out_overlapping_the_input_is_refused_or_exact(call, backend, shift):
    """out= a view of the same buffer shifted by a few elements: either a clear error naming out, or the
    exact result (never a silently corrupted one)."""
    spec, x, seq_axis, positions, dtype = call
    assume(x.size > 0)
    buf = np.empty(x.size + shift, x.dtype)
    buf[:x.size] = x.reshape(-1)
    xin = buf[:x.size].reshape(x.shape)
    out = buf[shift:].reshape(x.shape)
    want = oracle_for(x, seq_axis, positions, spec)
    try:
        y = rotary.apply(xin, positions, spec=spec, seq_axis=seq_axis, backend=backend, out=out)
    except ValueError as exc:
        assert "out" in str(exc) and "overlap" in str(exc), exc
        return
    P.assert_matches(y, want, dtype)


@P.examples(80)
@given(spec=P.mrope_specs(), backend=backends, S=st.integers(0, 8), B=st.integers(1, 2),
       dtype=st.sampled_from(["float32", "float64"]), text=st.booleans())
def test_mrope_every_layout(spec, backend, S, B, dtype, text):
    """M-RoPE (chunked, interleaved, ernie): pair i reads the coordinate the documented rule gives; text
    positions (an offset) rotate every axis alike."""
    assert np.array_equal(spec.pair_axes(), P.pair_axes_oracle(spec))
    rng = np.random.default_rng(S * 7 + B)
    x = rng.standard_normal((B, 2, S, spec.head_dim)).astype(dtype)
    if text:
        positions, coords = 3, np.repeat((np.arange(S) + 3)[:, None], 3, axis=1)
    else:
        coords = rng.integers(0, 300, size=(B, S, 3))
        positions = coords
    y = rotary.apply(x, positions, spec=spec, backend=backend, seq_axis=-2)
    want = P.spec_oracle(x, coords, spec)
    P.assert_matches(y, want, dtype)


@P.examples(80)
@given(spec=P.axial_specs(), backend=backends, h=st.integers(1, 4), w=st.integers(1, 4),
       dtype=st.sampled_from(["float32", "float64"]))
def test_axial_specs_with_grid_positions(spec, backend, h, w, dtype):
    """Axial (vision) specs with their position helper (grid_positions, normalized for float positions)."""
    if spec.n_axes == 1:
        coords = np.arange(h * w)[:, None]
    elif spec.n_axes == 2:
        coords = rotary.grid_positions(h, w, normalized=spec.float_positions)
    else:
        coords = rotary.grid_positions(h, w, 2)
    if spec.float_positions and spec.n_axes != 2:
        coords = np.asarray(coords, np.float64) * 0.37 - 0.5
    grid = np.asarray(coords)
    if not spec.float_positions:
        assert grid.dtype.kind in "iu"
    S = grid.shape[0]
    x = np.random.default_rng(h * 5 + w).standard_normal((1, 3, S, spec.head_dim)).astype(dtype)
    y = rotary.apply(x, grid, spec=spec, backend=backend, seq_axis=-2)
    P.assert_matches(y, P.spec_oracle(x, grid, spec), dtype)


@P.examples(10)
@given(h=st.integers(1, 5), w=st.integers(1, 5), t=st.integers(1, 3), merge=st.sampled_from([1, 2]))
def test_grid_positions_oracle(h, w, t, merge):
    """grid_positions: (t, row, col) of each token, row-major, after spatial merging."""
    assume(h % merge == 0 and w % merge == 0)
    g = rotary.grid_positions(h, w, t, spatial_merge_size=merge)
    tt, rr, cc = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
    if merge > 1:   # tokens ordered by merged block, then within it (HF's window order)
        order = np.lexsort((cc.ravel() % merge, rr.ravel() % merge, cc.ravel() // merge, rr.ravel() // merge,
                            tt.ravel()))
    else:
        order = np.arange(t * h * w)
    want = np.stack([tt.ravel(), rr.ravel(), cc.ravel()], axis=1)[order]
    np.testing.assert_array_equal(np.asarray(g), want)


@P.examples(80)
@given(spec=P.plain_specs(), backend=backends, S=st.integers(0, 8), seed=st.integers(0, 2**31),
       big=st.booleans(), dtype=st.sampled_from(["float32", "float64"]))
def test_rerotate_equals_rotating_at_the_destination(spec, backend, S, seed, big, dtype):
    """rerotate(apply(k, src), src, dst) == the oracle's rotation at dst, positions anywhere below 2**53
    (deltas up to 2**54: beyond float64's integers). Positions past 2**53 are rounded to float64 by the
    library (documented in rotary.spec.angles), so the exact oracle stops there."""
    rng = np.random.default_rng(seed)
    lim = 2**53 - 1 if big else 10**6
    src = rng.integers(-lim, lim, size=S, dtype=np.int64)
    dst = rng.integers(-lim, lim, size=S, dtype=np.int64)
    k = rng.standard_normal((2, S, spec.head_dim)).astype(dtype)
    moved = rotary.rerotate(rotary.apply(k, src, spec=spec, backend=backend, seq_axis=-2), src, dst, spec=spec, backend=backend, seq_axis=-2)
    # float32 tables at |p| ~ 2**62: both sides round their own angles; compare with the exact oracle
    P.assert_matches(moved, P.spec_oracle(k, dst, spec), "float32" if dtype == "float32" else "float64")


@P.examples(60)
@given(spec=P.plain_specs(), start=st.one_of(st.integers(0, 50), st.integers(10**6, 10**9)),
       steps=st.lists(st.integers(1, 4), min_size=2, max_size=12), backend=backends,
       dtype=st.sampled_from(["float32", "float64"]), max_positions=st.sampled_from([None, 4, 64]))
def test_rope_decode_loop_grows_and_windows_its_tables(spec, start, steps, backend, dtype, max_positions):
    """One Rope object over a decode loop: prefill then steps of 1-4 tokens far beyond its tables (grown
    on demand, or windowed around positions near 10**9), each equal to the oracle."""
    rope = rotary.Rope(spec, backend=backend, dtype=dtype, max_positions=max_positions, seq_axis=-2)
    rng = np.random.default_rng(start)
    pos = start
    for n in steps:
        q = rng.standard_normal((1, 2, n, spec.head_dim)).astype(dtype)
        k = rng.standard_normal((1, 1, n, spec.head_dim)).astype(dtype)
        qr, kr = rope(q, k, pos)
        p = np.arange(n) + pos
        P.assert_matches(qr, P.spec_oracle(q, p, spec), dtype)
        P.assert_matches(kr, P.spec_oracle(k, p, spec), dtype)
        pos += n


@P.examples(30)
@given(spec=P.plain_specs(max_head_dim=16), prompt=st.integers(1, 6), steps=st.integers(1, 5),
       backend=backends, window=st.sampled_from([None, 3]))
def test_rope_with_attention_decode_steps(spec, prompt, steps, backend, window):
    """Prefill then decode: keys rotated once by a Rope and cached, each step's query attends to the
    cache with rope=False; equals softmax attention over the oracle's rotated q and k."""
    rope = rotary.Rope(spec, backend=backend, dtype=np.float64, seq_axis=-2)
    rng = np.random.default_rng(prompt * 10 + steps)
    T = prompt + steps
    q_all = rng.standard_normal((1, 2, T, spec.head_dim))
    k_all = rng.standard_normal((1, 1, T, spec.head_dim))
    v_all = rng.standard_normal((1, 1, T, 3))
    cache = []
    bounds = [(0, prompt)] + [(t, t + 1) for t in range(prompt, T)]
    for s0, s1 in bounds:
        qr, kr = rope(q_all[:, :, s0:s1], k_all[:, :, s0:s1], s0)
        cache.append(kr)
        keys = np.concatenate(cache, axis=2)
        o = rotary.attention(qr, keys, v_all[:, :, :s1], q_positions=np.arange(s0, s1), k_positions=np.arange(s1),
                             causal=True, window=window, rope=False, backend=backend, seq_axis=-2)
        qo = P.spec_oracle(q_all[:, :, s0:s1], np.arange(s0, s1), spec)
        ko = P.spec_oracle(k_all[:, :, :s1], np.arange(s1), spec)
        t, s = np.arange(s0, s1)[:, None], np.arange(s1)[None, :]
        vis = (s <= t) & ((t - s < window) if window else True)
        want = P.softmax_attention_oracle(qo, ko, v_all[:, :, :s1], vis, spec.head_dim ** -0.5)
        P.assert_matches(o, want, "float64")


@P.examples(50)
@given(spec=P.plain_specs(), S=st.integers(0, 6), seed=st.integers(0, 2**31))
def test_cos_sin_tables_match_the_oracle(spec, S, seed):
    """spec.cos_sin / angles at positions up to 2**53, and inv_freq = base**(-2i/rotary_dim)."""
    i = np.arange(spec.rotary_dim // 2)
    np.testing.assert_allclose(spec.inv_freq(), spec.base ** (-2.0 * i / spec.rotary_dim), rtol=1e-13)
    p = np.random.default_rng(seed).integers(-(2**53) + 1, 2**53, size=S, dtype=np.int64)
    ang = P.exact_angles(p, spec.inv_freq())
    cos, sin = spec.cos_sin(p, dtype=np.float64)
    np.testing.assert_allclose(cos, np.cos(ang), atol=1e-14)
    np.testing.assert_allclose(sin, np.sin(ang), atol=1e-14)


@P.examples(50)
@given(spec=P.axial_specs(float_positions=True), S=st.integers(1, 6), seed=st.integers(0, 2**31),
       backend=backends, scale=st.sampled_from([1.0, 1e3, 1e7]))
def test_float_positions(spec, S, seed, backend, scale):
    """Real-valued coordinates (DINOv3-style), small and large, against exact angles of the float64 values."""
    coords = np.random.default_rng(seed).uniform(-1, 1, size=(S, spec.n_axes)) * scale
    x = np.random.default_rng(seed + 1).standard_normal((2, S, spec.head_dim))
    y = rotary.apply(x, coords, spec=spec, backend=backend, seq_axis=-2)
    P.assert_matches(y, P.spec_oracle(x, coords, spec), "float64")


@pytest.mark.parametrize("backend", P.BACKENDS)
def test_empty_and_zero_size_calls(backend):
    """Zero tokens, heads or batch with every positions form: empty results of the right shape."""
    spec = rotary.RopeSpec(8)
    for shape in ((0, 8), (2, 0, 8), (0, 3, 8), (2, 3, 0, 8)):
        x = np.zeros(shape, np.float32)
        S = shape[-2]
        for p in (None, 5, [], np.zeros(S, np.int64)):
            if isinstance(p, list) and S:
                continue
            assert rotary.apply(x, p, spec=spec, backend=backend, seq_axis=-2).shape == shape


@P.examples(40)
@given(call=rotation_calls(), backend=backends, mode=st.sampled_from(["q-as-k-inplace", "shared-out", "out-is-k",
                                                                       "rope-inplace", "rope-shared"]))
def test_aliased_outputs_are_refused_or_exact(call, backend, mode):
    """q passed as k with out=(q, q), one buffer for both outputs, q's output being k: refused with an
    error naming out, or exact (never one result overwritten by the other)."""
    spec, x, seq_axis, positions, dtype = call
    x0 = x.copy()
    want = oracle_for(x0, seq_axis, positions, spec)
    o = np.empty_like(x)
    k = x.copy()
    rope = rotary.Rope(spec, backend=backend, dtype=x.dtype, seq_axis=-2) if mode.startswith("rope") else None
    calls = {
        "q-as-k-inplace": lambda: rotary.apply_qk(x, x, positions, spec=spec, seq_axis=seq_axis, out=(x, x),
                                                  backend=backend),
        "shared-out": lambda: rotary.apply_qk(x, k, positions, spec=spec, seq_axis=seq_axis, out=(o, o),
                                              backend=backend),
        "out-is-k": lambda: rotary.apply_qk(x, k, positions, spec=spec, seq_axis=seq_axis, out=(k, None),
                                            backend=backend),
        "rope-inplace": lambda: rope(x, x, positions, seq_axis=seq_axis, out=(x, x)),
        "rope-shared": lambda: rope(x, k, positions, seq_axis=seq_axis, out=(o, o)),
    }
    try:
        qr, kr = calls[mode]()
    except ValueError as exc:
        assert "out" in str(exc) and "overlap" in str(exc), exc
        np.testing.assert_array_equal(x, x0)   # refused before writing anything
        return
    P.assert_matches(qr, want, dtype)
    P.assert_matches(kr, want, dtype)


def mrope_positions_oracle(kinds, grids, merge):
    """HF 5.x get_rope_index's rule for text and image runs (Qwen2-VL), written here: a text token takes
    (p, p, p) and p += 1; an image run of grid (t, h, w) takes (p + f, p + r, p + c) for its t (h/m) (w/m)
    tokens, frame-major then row-major, and p += max(h, w) // m (HF's ``current_pos``; t is not counted)."""
    out, p, g, i = [], 0, 0, 0
    while i < len(kinds):
        if kinds[i] == 0:
            out.append((p, p, p))
            p += 1
            i += 1
            continue
        t, h, w = grids[g]
        g += 1
        hh, ww = h // merge, w // merge
        block = [(p + f, p + r, p + c) for f in range(t) for r in range(hh) for c in range(ww)]
        out.extend(block)
        i += len(block)
        p += max(h, w) // merge
    return np.array(out, np.int64).reshape(-1, 3)


@P.examples(40)
@given(runs=st.lists(st.one_of(st.integers(1, 3), st.tuples(st.integers(1, 2), st.integers(1, 3), st.integers(1, 3))),
                     min_size=1, max_size=4),
       merge=st.sampled_from([1, 2]), steps=st.integers(0, 3), backend=backends)
def test_mrope_positions_helpers_and_rotation(runs, merge, steps, backend):
    """mrope_positions (text and image runs) against the rule written here; mrope_next_positions continues
    every axis from max + 1; the M-RoPE rotation at those positions against the oracle."""
    kinds, grids = [], []
    for run in runs:
        if isinstance(run, int):
            kinds += [0] * run
        else:
            t, h, w = run[0], run[1] * merge, run[2] * merge
            grids.append((t, h, w))
            kinds += [1] * (t * run[1] * run[2])
    kinds = np.array(kinds)
    thw = np.array(grids, np.int64).reshape(-1, 3) if grids else None
    pos, deltas = rotary.mrope_positions(mm_token_type_ids=kinds, image_grid_thw=thw, spatial_merge_size=merge,
                                         model_type="qwen2_vl")
    want = mrope_positions_oracle(kinds, grids, merge)
    np.testing.assert_array_equal(pos, want)
    np.testing.assert_array_equal(np.asarray(deltas).reshape(-1), [want.max() + 1 - len(kinds)])
    nxt = rotary.mrope_next_positions(pos, steps)
    np.testing.assert_array_equal(nxt, np.repeat((want.max() + 1 + np.arange(steps))[:, None], 3, axis=1))
    spec = rotary.RopeSpec(16, mrope_section=[2, 3, 3])
    x = np.random.default_rng(len(kinds)).standard_normal((1, 2, len(kinds) + steps, 16))
    allpos = np.concatenate([pos, nxt])
    P.assert_matches(rotary.apply(x, allpos, spec=spec, backend=backend, seq_axis=-2), P.spec_oracle(x, allpos, spec), "float64")


@P.examples(40)
@given(spec=st.one_of(P.plain_specs(), P.mrope_specs()), lens=st.lists(st.integers(0, 5), min_size=1, max_size=4),
       offsets=st.sampled_from([None, "int", "array"]), entry=st.sampled_from(["apply", "apply_qk", "Rope"]),
       backend=backends, dtype=st.sampled_from(["float32", "float64"]), seed=st.integers(0, 2**31))
def test_packed_rotation(spec, lens, offsets, entry, backend, dtype, seed):
    """cu_seqlens (empty sequences too) through apply, apply_qk and Rope: positions restart per sequence at
    seqlen_offsets (an int or one per sequence)."""
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    T = int(cu[-1])
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, 2, spec.head_dim)).astype(dtype)
    so = {None: None, "int": 7, "array": rng.integers(0, 10**5, len(lens))}[offsets]
    kw = dict(seq_axis=0, cu_seqlens=cu, seqlen_offsets=so)
    if entry == "apply":
        y = rotary.apply(x, spec=spec, backend=backend, **kw)
    elif entry == "apply_qk":
        y = rotary.apply_qk(x, x[:, :1], spec=spec, backend=backend, **kw)[0]
    else:
        y = rotary.Rope(spec, backend=backend, dtype=x.dtype, seq_axis=-2)(x, x[:, :1], **kw)[0]
    base = np.zeros(len(lens), np.int64) if so is None else np.broadcast_to(so, (len(lens),))
    p = np.concatenate([np.arange(n) + b for n, b in zip(lens, base)]).astype(np.int64)
    if spec.multi_axis:
        p = np.repeat(p[:, None], 3, axis=1)   # text positions on every axis
    want = np.moveaxis(P.spec_oracle(np.moveaxis(x.astype(np.float64), 0, 1), p, spec), 1, 0)
    P.assert_matches(y, want, dtype)
