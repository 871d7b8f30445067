"""linear_backward.cu (the CUDA backward of linear attention with RoPE, issue 45) run on the CPU through
tests/cuda_shim, with the plans the CuPy backend launches (``rotary.backends.cupy.plan_linear_attention_backward``).

The oracle is tests/test_linear_attention_backward.py's (the quadratic T x T form in torch float64, its own angles,
pairs and feature maps, differentiated by torch.autograd; no second oracle here): its grid of every causal /
normalize / layout / feature map with GQA groups, decay, partial rotary, a state in, a gradient on the state out,
chunks that do and do not divide T and per-batch positions, at two block sizes, float64 to 1e-9 of the largest
entry and float32 to 5e-5 (check_primitive's tolerances); then dv tiles (small shared-memory budgets), float16 and
strided views, the frontend taking the capability, the refusals, the CuPy glue (a NumPy-backed stand-in for CuPy),
and the geometry. The scratch buffers are filled with NaN before each launch (a value the kernels read without
writing it shows).
"""

from __future__ import annotations

import numpy as np
import pytest

from rotary import backends as registry
from rotary.backends import cupy as cb

from .cuda_shim.kv_backend import register, run_linear_attention_backward, shim_backend
from .test_cuda_kernels_cpu import FakeCupyArray, fake_cupy, kernels  # noqa: F401 (fixtures)
from .test_linear_attention_backward import _GRID, _case, check_primitive, make_inputs, oracle_grads, rel_err

pytestmark = pytest.mark.cuda_cpu


@pytest.fixture
def shim(kernels, monkeypatch):
    """Install the shim backend ("cuda-shim") with the given block size for the test."""

    def install(**geometry):
        return register(monkeypatch, shim_backend(kernels, **geometry)).NAME

    return install


def _oracle(x, case, **extra):
    """(dq, dk, dv, dS0, dz0) of tests/test_linear_attention_backward.py's oracle for make_inputs' ``x``."""
    B, _, Hk, m = x["k"].shape
    S0, z0 = x["state"] or (np.zeros((B, Hk, m, x["v"].shape[-1])), np.zeros((B, Hk, m)))
    return oracle_grads(x["q"], x["k"], x["v"], S0, z0, x["positions"], x["inv_freq"], x["grad_o"],
                        x["grad_state"], layout=case["layout"], scale=x["scale"], causal=case["causal"],
                        feature_map=case["feature_map"], eps=1e-6, decay=x["decay"], normalize=case["normalize"],
                        **extra)


def _run(kernels, x, case, chunk, **options):
    return run_linear_attention_backward(kernels, x["q"], x["k"], x["v"], x["cos"], x["sin"], x["rows"], x["grad_o"],
                                         rotary_dim=case["rotary_dim"], layout=case["layout"], causal=case["causal"],
                                         feature_map=case["feature_map"], eps=1e-6, chunk=chunk, state=x["state"],
                                         decay=x["decay"], normalize=case["normalize"], grad_state=x["grad_state"],
                                         **options)


def _assert_matches(got, want, tol, what):
    names = ("dq", "dk", "dv", "dS", "dz")
    for name, a, b in zip(names, got[:3] + tuple(got[3] or ()), want):
        assert rel_err(a, b) <= tol, (name, rel_err(a, b), what)


# -- the oracle's grid -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("threads", [32, 5])
@pytest.mark.parametrize("i", range(len(_GRID)), ids=lambda i: "-".join(str(v) for v in _GRID[i]))
def test_grid_matches_autograd_of_the_quadratic_oracle(shim, i, threads):
    check_primitive(shim(threads=threads), _case(i), seed=i)


@pytest.mark.parametrize("i", [0, 3, 5, 10, 13, 17, 22])
def test_grid_float32(shim, i):
    check_primitive(shim(threads=32), _case(i), dtype=np.float32, seed=100 + i)


# -- dv tiles, budgets, block sizes ------------------------------------------------------------------------------
@pytest.mark.parametrize("causal,decay,normalize,fmap,groups,threads,budget", [
    (True, True, True, "elu", 2, 32, 9000),
    (True, False, False, "relu", 1, 7, 5000),
    (False, False, True, "identity", 3, 1, 4000),
    (False, False, False, "elu", 2, 64, 3000),
    (True, True, True, "relu", 3, 128, 4000),
])
def test_dv_tiles_and_small_budgets(kernels, causal, decay, normalize, fmap, groups, threads, budget):
    """dv split into tiles (each tile's parts of dÂ, dB̂ and gN . N summed by the finishing kernel), short chunks
    from small shared-memory budgets, 1 to 128 threads: the oracle's gradients."""
    rng = np.random.default_rng(budget + threads)
    case = dict(causal=causal, normalize=normalize, layout="interleaved" if groups % 2 else "half", feature_map=fmap,
                rotary_dim=6)
    x = make_inputs(rng, B=2, T=11, groups=groups, m=6, dv=40, rotary_dim=6, layout=case["layout"], decay=decay,
                    batch_rows=True)
    plans = []
    got = _run(kernels, x, case, 16, threads=threads, shared_mem_limit=budget, plans=plans)
    chunked = plans[0]
    geometry = cb.linear_backward_geometry(2, 2, 6, 40, 8, 16, threads=threads, shared_mem_limit=budget)
    assert geometry.n_tiles > 1 and geometry.chunk < 11 and chunked.grid == 2 * 2 * geometry.n_tiles
    assert [p.kernel for p in plans] == list(cb.linear_backward_kernel_names("float64"))
    _assert_matches(got, _oracle(x, case), 1e-9, (budget, threads))


@pytest.mark.parametrize("seed", range(10))
def test_random_problems(kernels, seed):
    """Random shapes (odd m and dv, partial rotary), options, chunks (1 to past T), block sizes and budgets."""
    rng = np.random.default_rng(1000 + seed)
    m = int(rng.integers(2, 14))
    r = 2 * int(rng.integers(1, m // 2 + 1))
    causal = bool(rng.integers(2))
    case = dict(causal=causal, normalize=bool(rng.integers(2)), layout=str(rng.choice(["half", "interleaved"])),
                feature_map=str(rng.choice(["elu", "relu", "identity"])), rotary_dim=r)
    x = make_inputs(rng, B=int(rng.integers(1, 3)), T=int(rng.integers(1, 20)), Hk=int(rng.integers(1, 3)),
                    groups=int(rng.integers(1, 4)), m=m, dv=int(rng.integers(1, 12)), rotary_dim=r,
                    layout=case["layout"], decay=causal and bool(rng.integers(2)), batch_rows=bool(rng.integers(2)))
    chunk, threads = int(rng.integers(1, 24)), int(rng.choice([1, 3, 32, 96]))
    budget = int(rng.choice([2500, 6000, cb.SHARED_MEM_LIMIT]))
    try:
        cb.linear_backward_geometry(1, 1, m, x["v"].shape[-1], 8, chunk, shared_mem_limit=budget)
    except ValueError:
        budget = cb.SHARED_MEM_LIMIT
    got = _run(kernels, x, case, chunk, threads=threads, shared_mem_limit=budget)
    _assert_matches(got, _oracle(x, case), 1e-9, (case, chunk, threads, budget))


def test_float16_and_strided_views(kernels):
    """float16 (computed in float32, gradients rounded to float16) against the oracle on the rounded inputs, and
    views with steps, offsets and a reversed sequence give the bits of their contiguous copies."""
    rng = np.random.default_rng(16)
    case = dict(causal=True, normalize=True, layout="half", feature_map="elu", rotary_dim=8)
    x = make_inputs(rng, T=9, groups=2, decay=True, dtype=np.float16)
    got = _run(kernels, x, case, 4, threads=32)
    assert all(a.dtype == np.float16 for a in got[:3]) and got[3][0].dtype == np.float32
    want = _oracle({n: (np.float64(a) if isinstance(a, np.ndarray) and a.dtype == np.float16 else a)
                    for n, a in x.items()}, case)
    _assert_matches(got, want, 2e-2, "float16")

    x = make_inputs(rng, T=10, groups=3, m=8, dv=6, decay=True)
    big = rng.standard_normal((2, 10, 6, 40))
    x["q"] = big[:, :, :, 1:17:2]                                        # steps along the features
    x["k"] = np.ascontiguousarray(big[:, ::-1, :2, 20:28])[:, ::-1]      # a reversed sequence
    x["v"] = big[:, :, 2:4, 30:36]
    x["grad_o"] = np.moveaxis(rng.standard_normal((2, 6, 10, 6)), 1, 2)    # a bhsd array's bshd view
    strided = _run(kernels, x, case, 3, threads=7)
    for n in ("q", "k", "v", "grad_o"):
        x[n] = np.ascontiguousarray(x[n])
    contiguous = _run(kernels, x, case, 3, threads=7)
    for a, b in zip(strided[:3] + strided[3], contiguous[:3] + contiguous[3]):
        np.testing.assert_array_equal(a, b)
    _assert_matches(contiguous, _oracle(x, case), 1e-9, "strided")


def test_empty_sequence_and_no_value_columns(kernels):
    """T = 0: no launch, the state's gradient passes through; dv = 0: only the finishing kernel (dk from the
    gradient on z, dq zero), as the NumPy reference."""
    from rotary.backends.numpy_linear_backward import linear_attention_backward as reference

    rng = np.random.default_rng(3)
    case = dict(causal=True, normalize=True, layout="half", feature_map="elu", rotary_dim=8)
    x = make_inputs(rng, T=0, decay=True)
    plans = []
    dq, dk, dv, (dS, dz) = _run(kernels, x, case, 4, plans=plans)
    assert not plans and dq.shape == x["q"].shape and not dq.size
    np.testing.assert_array_equal(dS, x["grad_state"][0])
    np.testing.assert_array_equal(dz, x["grad_state"][1])
    for causal in (True, False):
        x = make_inputs(rng, T=6, dv=0, decay=causal)
        case = dict(case, causal=causal)
        got = _run(kernels, x, case, 4, plans=plans)
        want = reference(x["q"], x["k"], x["v"], x["cos"], x["sin"], x["rows"], x["grad_o"], rotary_dim=8,
                         layout="half", causal=causal, feature_map="elu", eps=1e-6, chunk=4, state=x["state"],
                         decay=x["decay"], normalize=True, grad_state=x["grad_state"])
        assert plans[-1].kernel.startswith("linear_backward_finish") and len(plans) == 1 + (not causal)
        _assert_matches(got, want[:3] + want[3], 1e-12, "dv = 0")
        assert np.abs(got[1]).max() > 0 and not np.abs(got[0]).max()


# -- the frontend and the refusals ---------------------------------------------------------------------------------
def test_frontend_takes_the_capability(shim, monkeypatch):
    """rotary.attn.linear_backward.linear_attention_backward asks the backend for the capability: the shim backend
    (the CuPy backend's plans) is called, and its gradients are the NumPy reference's (bhsd, GQA on the heads axis,
    decay, a state, rotary_offset, a gradient on the state out)."""
    import rotary
    from rotary.attn.linear_backward import linear_attention_backward
    from rotary.frontend.arguments import pick_backend

    assert hasattr(cb, "linear_attention_backward")
    name = shim(threads=32)
    module = registry.get(name)
    assert pick_backend([np.zeros(1)], name, "linear_attention_backward") is module
    calls = []
    real = module.linear_attention_backward
    monkeypatch.setattr(module, "linear_attention_backward", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    rng = np.random.default_rng(5)
    q = rng.standard_normal((2, 4, 9, 12))
    k, v = rng.standard_normal((2, 2, 9, 12)), rng.standard_normal((2, 2, 9, 7))
    g = rng.standard_normal((2, 4, 9, 7))
    spec = rotary.RopeSpec(12, rotary_dim=8, rotary_offset=2, base=500.0)
    state = rotary.linear_attention(q[:, :, :5], k[:, :, :5], v[:, :, :5], causal=True, spec=spec, seq_axis=2,
                                    decay=0.9, return_state=True, backend="numpy")[1]
    grad_state = (rng.standard_normal(state.S.shape), rng.standard_normal(state.z.shape))
    kw = dict(causal=True, spec=spec, seq_axis=2, chunk=3, decay=0.9, state=state, grad_state=grad_state)
    got = linear_attention_backward(q[:, :, 5:], k[:, :, 5:], v[:, :, 5:], g[:, :, 5:], backend=name, **kw)
    want = linear_attention_backward(q[:, :, 5:], k[:, :, 5:], v[:, :, 5:], g[:, :, 5:], backend="numpy", **kw)
    assert len(calls) == 1
    for a, b in zip(got[:3] + got[3], want[:3] + want[3]):
        assert rel_err(a, b) <= 1e-12


def _refusal(module, **change):
    rng = np.random.default_rng(1)
    x = make_inputs(rng, T=4)
    args = dict(q=x["q"], k=x["k"], v=x["v"], cos=x["cos"], sin=x["sin"], rows=x["rows"], grad_o=x["grad_o"])
    kw = dict(rotary_dim=8, layout="half", causal=True, feature_map="elu", eps=1e-6, chunk=2, state=None)
    for key, value in change.items():
        (args if key in args else kw)[key] = value(args[key]) if callable(value) else value
    with pytest.raises((ValueError, TypeError)) as info:
        module.linear_attention_backward(*args.values(), **kw)
    return info.type, str(info.value)


@pytest.mark.parametrize("change", [
    dict(causal=False, decay=np.full((2, 2), 0.5)),
    dict(grad_o=lambda g: g[:, :3]),
    dict(feature_map="softmax"),
    dict(k=lambda k: np.concatenate([k, k[:, :, :1]], axis=2), v=lambda v: np.concatenate([v, v[:, :, :1]], axis=2)),
], ids=["decay-noncausal", "grad_o-shape", "feature_map", "heads"])
def test_refusals_are_the_numba_and_numpy_backwards(shim, change):
    """What the Numba backward (else the NumPy reference) refuses, the CUDA glue refuses with the same error."""
    module = registry.get(shim(threads=32))
    other = registry.get("numba") if registry.available_backends()["numba"][0] else registry.get("numpy")
    assert _refusal(module, **change) == _refusal(other, **change)


def test_head_dims_too_large_for_shared_memory_name_them():
    with pytest.raises(ValueError, match="m=16384, dv=64"):
        cb.linear_backward_geometry(1, 1, 16384, 64, 4, 64, shared_mem_limit=cb.LINEAR_BACKWARD_SHARED_MEM_LIMIT)


# -- the CuPy glue on a NumPy-backed stand-in for CuPy --------------------------------------------------------------
@pytest.mark.parametrize("causal", [True, False])
def test_cupy_glue_linear_attention_backward(fake_cupy, causal):  # noqa: F811
    """cupy.linear_attention_backward: the two kernels from the linear_backward module, CuPy-type results in q's
    dtype (dstate in the work dtype), inputs untouched, grad_o of another dtype cast; the oracle's gradients."""
    rng = np.random.default_rng(11)
    case = dict(causal=causal, normalize=True, layout="half", feature_map="elu", rotary_dim=8)
    x = make_inputs(rng, T=8, groups=2, decay=causal, dtype=np.float32)
    args = [fake_cupy.wrap(x[n]) for n in ("q", "k", "v", "cos", "sin")] + [fake_cupy.wrap(np.int64(x["rows"]))]
    go = fake_cupy.wrap(x["grad_o"].astype(np.float64))
    state = tuple(fake_cupy.wrap(np.float32(a)) for a in x["state"])
    copies = [np.array(a) for a in args[:3] + [go]]
    dq, dk, dv, (dS, dz) = cb.linear_attention_backward(
        *args, go, rotary_dim=8, layout="half", causal=causal, feature_map="elu", eps=1e-6, chunk=4, state=state,
        decay=x["decay"], normalize=True, grad_state=x["grad_state"])
    assert fake_cupy.launched == list(cb.linear_backward_kernel_names("float32"))
    assert all(isinstance(a, FakeCupyArray) for a in (dq, dk, dv, dS, dz))
    assert dq.dtype == dk.dtype == dv.dtype == np.float32 and dS.dtype == dz.dtype == np.float32
    for a, c in zip(args[:3] + [go], copies):
        np.testing.assert_array_equal(a, c)
    x["state"] = tuple(np.float64(np.float32(a)) for a in x["state"])
    _assert_matches((dq, dk, dv, (dS, dz)), _oracle({n: np.float64(a) if isinstance(a, np.ndarray) else a
                                                    for n, a in x.items()}, case), 5e-5, "glue")
    dq, dk, dv, dstate = cb.linear_attention_backward(
        *(a[:, :0] for a in args[:3]), *args[3:], go[:, :0], rotary_dim=8, layout="half", causal=causal,
        feature_map="elu", eps=1e-6, chunk=4, state=None, decay=x["decay"])
    assert dstate is None and dq.shape == (2, 0, 4, 8) and len(fake_cupy.launched) == 2


# -- geometry ------------------------------------------------------------------------------------------------------
def test_backward_geometry_fits_and_prefers_wide_tiles():
    for itemsize in (4, 8):
        for m, dv in ((8, 8), (64, 64), (128, 128), (256, 64), (33, 17)):
            for limit in (cb.SHARED_MEM_LIMIT, cb.LINEAR_BACKWARD_SHARED_MEM_LIMIT):
                g = cb.linear_backward_geometry(2, 3, m, dv, itemsize, 64, shared_mem_limit=limit)
                assert g.shared_mem == cb.linear_backward_shared_bytes(m, g.chunk, g.dv_tile, itemsize) <= limit
                assert g.finish_shared_mem == cb.linear_backward_finish_shared_bytes(m, g.finish_chunk, itemsize)
                assert g.finish_shared_mem <= limit and g.finish_grid == 6
                assert g.n_tiles == -(-dv // g.dv_tile) and g.grid == 6 * g.n_tiles
                if limit > cb.SHARED_MEM_LIMIT:
                    assert g.dv_tile >= min(dv, 16), (itemsize, m, dv, g)
    g = cb.linear_backward_geometry(1, 1, 64, 64, 4, 64, shared_mem_limit=cb.LINEAR_BACKWARD_SHARED_MEM_LIMIT)
    assert g.n_tiles == 1 and g.chunk >= 16
    assert cb.linear_backward_geometry(1, 1, 8, 8, 4, 5).chunk == 5   # never longer than asked for
    assert cb.name_expressions("linear_backward", "bfloat16") == [
        "linear_backward_chunked<rotary_bfloat16, float>", "linear_backward_finish<rotary_bfloat16, float>"]
