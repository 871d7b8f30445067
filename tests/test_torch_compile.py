"""torch.compile: rotary's custom ops (rotary/interop/torch_ops.py) trace with fullgraph=True, match eager and
the float64 oracles, pass torch.library.opcheck, and a tiny Llama block trains compiled without recompiles."""

import math

import numpy as np
import pytest

import rotary
from rotary.testing import assert_close, attention_quadratic, linear_attention_quadratic, rope_complex, to_numpy64

torch = pytest.importorskip("torch")
if not hasattr(torch.library, "custom_op"):
    pytest.skip("rotary's custom ops need torch 2.4 or later", allow_module_level=True)

from rotary.interop import torch_ops  # noqa: E402  (registers the ops and their Dynamo handlers)

SPEC = rotary.RopeSpec(16, base=500.0)


def _compile(fn, backend="aot_eager"):
    """fullgraph: any graph break is an error. aot_eager traces the fake implementations and the autograd
    formulas through AOTAutograd without Inductor's code generation (seconds, not tens of seconds)."""
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend=backend)


def _rand(*shape, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).requires_grad_(grad)


def _bhsd(a):
    """(B, S, H, D) -> float64 (B, H, S, D) for the oracles."""
    return np.moveaxis(to_numpy64(a), 2, 1)


def test_apply_fullgraph_matches_eager_and_oracle_and_backward():
    x = _rand(2, 6, 3, 16, grad=True)
    f = _compile(lambda x, p: rotary.apply(x, p, spec=SPEC, seq_axis=-3))
    for offset in (0, 5, 11):
        pos = torch.arange(offset, offset + 6)
        y = f(x, pos)
        assert_close(y, rotary.apply(x.detach(), offset, spec=SPEC, seq_axis=-3), rtol=1e-6, atol=1e-6)
        assert_close(y.detach().transpose(1, 2),
                     rope_complex(_bhsd(x.detach()), pos.numpy(), SPEC.inv_freq()))
        g = _rand(2, 6, 3, 16, seed=1)
        (dx,) = torch.autograd.grad(y, x, g)   # the adjoint: the inverse rotation of g
        assert_close(dx, rotary.apply(g, offset, spec=SPEC, seq_axis=-3, inverse=True), rtol=1e-6, atol=1e-6)


def test_apply_qk_gqa_fullgraph_int_offset_spec_kwargs():
    q, k = _rand(1, 5, 4, 16, grad=True), _rand(1, 5, 2, 16, seed=1, grad=True)
    f = _compile(lambda q, k, off: rotary.apply_qk(q, k, off, base=500.0, seq_axis=-3))
    for offset in (3, 9):   # an int offset: one recompile to a dynamic one, then none
        qr, kr = f(q, k, offset)
        eq, ek = rotary.apply_qk(q.detach(), k.detach(), offset, spec=SPEC, seq_axis=-3)
        assert_close(qr, eq, rtol=1e-6, atol=1e-6)
        assert_close(kr, ek, rtol=1e-6, atol=1e-6)
        pos = np.arange(offset, offset + 5)
        assert_close(kr.detach().transpose(1, 2), rope_complex(_bhsd(k.detach()), pos, SPEC.inv_freq()))
    dq, dk = torch.autograd.grad((qr * 2).sum() + kr.sum(), (q, k))
    assert_close(dq, rotary.apply(torch.full_like(q, 2.0), 9, spec=SPEC, seq_axis=-3, inverse=True), atol=1e-6)
    assert_close(dk, rotary.apply(torch.ones_like(k), 9, spec=SPEC, seq_axis=-3, inverse=True), atol=1e-6)
    with torch.compiler.set_stance("fail_on_recompile"):
        f(q, k, 17)


@pytest.mark.parametrize("window, softcap", [(None, None), (3, 5.0)])
def test_attention_fullgraph_matches_eager_oracle_and_eager_grads(window, softcap):
    q = _rand(2, 7, 4, 16, grad=True)
    k, v = _rand(2, 9, 2, 16, seed=1, grad=True), _rand(2, 9, 2, 8, seed=2, grad=True)
    kw = dict(spec=SPEC, seq_axis=-3, causal=True, window=window, softcap=softcap, block_size=4)
    f = _compile(lambda q, k, v, p: rotary.attention(q, k, v, p, **kw))
    pos = torch.arange(4, 13)
    o = f(q, k, v, pos)
    qe, ke, ve = (a.detach().requires_grad_(True) for a in (q, k, v))
    oe = rotary.attention(qe, ke, ve, pos, **kw)
    assert_close(o, oe.detach(), rtol=1e-5, atol=1e-6)
    expected = attention_quadratic(_bhsd(q.detach()), _bhsd(k.detach()), _bhsd(v.detach()), pos.numpy()[2:],
                                   pos.numpy(), SPEC.inv_freq(), causal=True, window=window, softcap=softcap)
    assert_close(o.detach().transpose(1, 2), expected)
    g = _rand(2, 7, 4, 8, seed=3)
    grads = torch.autograd.grad(o, (q, k, v), g)
    for got, want in zip(grads, torch.autograd.grad(oe, (qe, ke, ve), g)):
        assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_linear_attention_fullgraph_matches_eager_oracle_and_grads():
    q, k = _rand(1, 6, 2, 16, grad=True), _rand(1, 6, 2, 16, seed=1, grad=True)
    v = _rand(1, 6, 2, 8, seed=2, grad=True)
    kw = dict(spec=SPEC, seq_axis=-3, causal=True)
    f = _compile(lambda q, k, v, p: rotary.linear_attention(q, k, v, p, **kw))
    pos = torch.arange(2, 8)
    o = f(q, k, v, pos)
    qe, ke, ve = (a.detach().requires_grad_(True) for a in (q, k, v))
    oe = rotary.linear_attention(qe, ke, ve, pos, **kw)
    assert_close(o, oe.detach(), rtol=1e-5, atol=1e-6)
    expected = linear_attention_quadratic(_bhsd(q.detach()), _bhsd(k.detach()), _bhsd(v.detach()), pos.numpy(),
                                          SPEC.inv_freq(), causal=True)
    assert_close(o.detach().transpose(1, 2), expected)
    g = _rand(1, 6, 2, 8, seed=3)
    for got, want in zip(torch.autograd.grad(o, (q, k, v), g), torch.autograd.grad(oe, (qe, ke, ve), g)):
        assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_opcheck_every_op():
    key = torch_ops.spec_key(SPEC, {})
    q, k = _rand(1, 5, 4, 16, grad=True), _rand(1, 5, 2, 16, seed=1, grad=True)
    v = _rand(1, 5, 2, 8, seed=2, grad=True)
    pos = torch.arange(3, 8)
    ops = torch.ops.rotary
    cases = [
        (ops.rotate, (q, pos, 0, key, -3, False, "auto")),
        (ops.rotate, (k, None, 4, key, -3, True, "auto")),
        (ops.rotate_qk, (q, k, pos, 0, key, -3, False, "auto")),
        (ops.attention, (q, k, v, pos, 0, None, None, key, -3, True, None, True, None, None, 512, "auto")),
        (ops.attention, (q, k, v, None, 2, None, None, key, -3, False, 0.5, True, None, 3.0, 2, "auto")),
        (ops.linear_attention, (q, k, v, pos, 0, key, -3, True, "elu", 1e-6, 64, None, True, "auto")),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)


def test_ops_gradcheck_float64():
    """The ops' autograd: rotation's (inverse rotation, twice differentiable) and the attention ops'
    (a VJP of the recomputed eager path), against finite differences (the NumPy backend: no float64
    Numba compile)."""
    key = torch_ops.spec_key(rotary.RopeSpec(4, base=100.0), {})
    pos = torch.arange(2, 6)
    q = _rand(1, 4, 2, 4).double().requires_grad_(True)
    k = _rand(1, 4, 1, 4, seed=1).double().requires_grad_(True)
    v = _rand(1, 4, 1, 2, seed=2).double().requires_grad_(True)
    ops = torch.ops.rotary
    rotate = lambda x: ops.rotate(x, pos, 0, key, -3, False, "numpy")  # noqa: E731
    assert torch.autograd.gradcheck(rotate, (q,)) and torch.autograd.gradgradcheck(rotate, (q,))
    assert torch.autograd.gradcheck(lambda q, k: ops.rotate_qk(q, k, None, 3, key, -3, True, "numpy"), (q, k))
    assert torch.autograd.gradcheck(
        lambda q, k, v: ops.attention(q, k, v, pos, 0, None, None, key, -3, True, None, True, 3, 4.0, 2, "numpy"),
        (q, k, v))
    assert torch.autograd.gradcheck(
        lambda q, k, v: ops.linear_attention(q, k, v, pos, 0, key, -3, True, "elu", 1e-6, 2, None, True, "numpy"),
        (q, k, v))


def test_forms_without_an_op_run_eagerly_with_a_graph_break():
    """out= (and the other forms the ops do not take) run eagerly: right results, a graph break, and
    fullgraph=True names the reason."""
    x = _rand(1, 4, 2, 16)
    out = torch.empty_like(x)
    fn = lambda x, out: rotary.apply(x, 2, spec=SPEC, seq_axis=-3, out=out) * 1  # noqa: E731
    f = _compile(fn, backend="eager")
    with pytest.raises(Exception, match="no custom op"):
        f(x, out)
    torch._dynamo.reset()
    y = torch.compile(fn, backend="eager")(x, out)
    assert_close(y, rotary.apply(x, 2, spec=SPEC, seq_axis=-3), rtol=1e-6, atol=1e-6)
    assert_close(out, y, rtol=0, atol=0)


def test_spec_key_round_trips():
    spec = rotary.RopeSpec(32, base=1e6, scaling={"rope_type": "yarn", "factor": 4.0,
                                                  "original_max_position_embeddings": 64}, layout="interleaved")
    key = torch_ops.spec_key(spec, {})
    torch_ops._SPECS.pop(key)   # as in another process: rebuilt from the key
    torch_ops._RESOLVED.clear()
    assert torch_ops._spec(key, 32) == spec
    scaling = {"rope_type": "linear", "factor": np.float64(2.0)}
    kw = torch_ops.spec_key(None, {"base": np.float32(500.0), "scaling": scaling})   # keywords: no head_dim in it
    assert torch_ops.spec_key(None, {"scaling": scaling, "base": 500.0}) == kw
    torch_ops._SPECS.pop(kw)
    for head_dim in (16, 8):   # resolved against the op's input
        assert torch_ops._spec(kw, head_dim) == rotary.RopeSpec(head_dim, base=500.0, scaling=scaling)
    assert torch_ops.spec_key(None, {}) == "" and torch_ops._spec("", 8) is None
    with pytest.raises(TypeError, match="not both"):
        torch_ops.spec_key(spec, {"base": 2.0})
    with pytest.raises(TypeError, match="unexpected keyword"):
        torch_ops.spec_key(None, {"bsae": 2.0})


# -- dynamic shapes (torch.compile(..., dynamic=True)) --------------------------------------------------
def _dynamic_case(what):
    """(function, args of two shapes) for one of the four entry points (sizes >= 2: Dynamo specializes 0 and 1;
    no two sizes equal: it would guard on their equality)."""
    spec = rotary.RopeSpec(16, base=500.0)
    if what == "apply":
        return (lambda x, p: rotary.apply(x, p, spec=spec, seq_axis=-3),
                [(_rand(b, s, 3, 16, seed=s, grad=True), torch.arange(2, 2 + s)) for b, s in ((5, 6), (7, 9))])
    if what == "apply_qk":   # spec keywords and an int offset
        return (lambda q, k, off: rotary.apply_qk(q, k, off, base=500.0, seq_axis=-3),
                [(_rand(b, s, 4, 16, seed=s, grad=True), _rand(b, s, 2, 16, seed=s + 1, grad=True), off)
                 for b, s, off in ((3, 5, 13), (5, 7, 21))])
    if what == "attention":
        return (lambda q, k, v, p: rotary.attention(q, k, v, p, spec=spec, seq_axis=-3, causal=True, softcap=5.0,
                                                    block_size=4),
                [(_rand(b, s, 4, 16, seed=s, grad=True), _rand(b, s, 2, 16, seed=s + 1, grad=True),
                  _rand(b, s, 2, 8, seed=s + 2, grad=True), torch.arange(1, 1 + s)) for b, s in ((3, 6), (5, 11))])
    return (lambda q, k, v, p: rotary.linear_attention(q, k, v, p, spec=spec, seq_axis=-3, causal=True),
            [(_rand(b, s, 2, 16, seed=s, grad=True), _rand(b, s, 2, 16, seed=s + 1, grad=True),
              _rand(b, s, 2, 8, seed=s + 2, grad=True), torch.arange(s)) for b, s in ((3, 6), (5, 10))])


@pytest.mark.interop("torch", "cpu", "numba", "torch.compile fullgraph, dynamic=True, autograd")
@pytest.mark.parametrize("what", ["apply", "apply_qk", "attention", "linear_attention"])
def test_dynamic_shapes_fullgraph_forward_and_backward(what):
    """torch.compile(f, fullgraph=True, dynamic=True): each entry point traces once with symbolic shapes (the
    spec never depends on them), a second batch/sequence length runs without a recompile, and outputs and
    gradients equal eager."""
    from torch._dynamo.utils import counters

    fn, calls = _dynamic_case(what)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend="aot_eager")
    for i, args in enumerate(calls):
        stance = torch.compiler.set_stance("fail_on_recompile" if i else "default")
        with stance:
            out = compiled(*args)
        eager_args = [a.detach().requires_grad_(True) if isinstance(a, torch.Tensor) and a.requires_grad else a
                      for a in args]
        want = fn(*eager_args)
        outs, wants = (out, want) if isinstance(out, tuple) else ((out,), (want,))
        for got, exp in zip(outs, wants):
            assert_close(got, exp.detach(), rtol=1e-5, atol=1e-6)
        leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        eager_leaves = [a for a in eager_args if isinstance(a, torch.Tensor) and a.requires_grad]
        cot = [_rand(*o.shape, seed=7) for o in outs]
        got_grads = torch.autograd.grad(outs, leaves, cot)
        want_grads = torch.autograd.grad(wants, eager_leaves, cot)
        for got, exp in zip(got_grads, want_grads):
            assert_close(got, exp, rtol=1e-5, atol=1e-6)
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]


def test_compile_path_uses_no_private_torch_api():
    """The ops, their autograd and the Dynamo handlers use torch's public surface (torch.library.custom_op,
    register_fake / register_autograd, torch.func, torch.compiler): no torch._C dispatch-key guards and no
    Dynamo internals (issue 44)."""
    import inspect

    from rotary.interop import torch_adapter, torch_hook

    for module in (torch_ops, torch_adapter, torch_hook):
        source = inspect.getsource(module)
        for private in ("_ForceDispatchKeyGuard", "set_code_exec_strategy", "torch._C", "FrameExecStrategy",
                        "from torch._", "import torch._"):
            assert private not in source, (module.__name__, private)


# -- a tiny Llama block --------------------------------------------------------------------------------
D, HQ, HKV, HD, FF, S = 32, 4, 2, 8, 48, 6
LLAMA_SPEC = rotary.RopeSpec(HD, base=10000.0)


def _hf_rope(x, pos):
    """HF's rotate_half RoPE on (B, H, S, D), cos/sin in float32 (LlamaRotaryEmbedding)."""
    inv = 1.0 / (10000.0 ** (torch.arange(0, HD, 2, dtype=torch.float32) / HD))
    emb = torch.cat([pos.float()[:, None] * inv[None, :]] * 2, dim=-1)
    cos, sin = emb.cos(), emb.sin()
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Block(torch.nn.Module):
    def __init__(self, reference=False):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.reference = reference
        init = lambda *s: torch.nn.Parameter(torch.randn(*s, generator=g) / math.sqrt(s[-1]))  # noqa: E731
        self.norm1, self.norm2 = torch.nn.Parameter(torch.ones(D)), torch.nn.Parameter(torch.ones(D))
        self.wq, self.wk, self.wv = init(HQ * HD, D), init(HKV * HD, D), init(HKV * HD, D)
        self.wo, self.gate, self.up, self.down = init(D, HQ * HD), init(FF, D), init(FF, D), init(D, FF)

    @staticmethod
    def _rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    def forward(self, x, pos):
        B = x.shape[0]
        h = self._rms(x, self.norm1)
        q = (h @ self.wq.T).view(B, S, HQ, HD)
        k = (h @ self.wk.T).view(B, S, HKV, HD)
        v = (h @ self.wv.T).view(B, S, HKV, HD)
        if self.reference:
            q, k, v = (a.transpose(1, 2) for a in (q, k, v))
            q, k = _hf_rope(q, pos), _hf_rope(k, pos)
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            o = o.transpose(1, 2)
        else:
            q, k = rotary.apply_qk(q, k, pos, spec=LLAMA_SPEC, seq_axis=-3)
            o = rotary.attention(q, k, v, pos, causal=True, rope=False, seq_axis=-3)
        x = x + o.reshape(B, S, HQ * HD) @ self.wo.T
        h = self._rms(x, self.norm2)
        return x + (torch.nn.functional.silu(h @ self.gate.T) * (h @ self.up.T)) @ self.down.T


def _step(model, x, pos):
    x = x.detach().requires_grad_(True)
    y = model(x, pos)
    loss = (y * y).mean()
    grads = torch.autograd.grad(loss, [x, *model.parameters()])
    return y.detach(), grads


@pytest.mark.interop("torch", "cpu", "numba", "torch.compile fullgraph, autograd (a Llama block)")
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_llama_block_compiles_fullgraph_forward_backward_without_recompiles(backend):
    """RMSNorm, q/k/v projections, apply_qk, causal GQA attention, o projection, SwiGLU MLP: one graph,
    forward and backward, equal to eager and to HF's rotate_half + SDPA block; new positions each step."""
    from torch._dynamo.utils import counters

    model, reference = Block(), Block(reference=True)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    for step, offset in enumerate((0, 7, 30)):
        x = _rand(2, S, D, seed=step)
        pos = torch.arange(offset, offset + S)
        if step == 1:
            stance = torch.compiler.set_stance("fail_on_recompile")
            stance.__enter__()
        y, grads = _step(compiled, x, pos)
        ye, eager = _step(model, x, pos)
        yr, ref = _step(reference, x, pos)
        assert_close(y, ye, rtol=1e-5, atol=1e-5)
        assert_close(y, yr, rtol=1e-5, atol=1e-5)
        for got, want, hf in zip(grads, eager, ref):
            assert_close(got, want, rtol=1e-5, atol=1e-6)
            assert_close(got, hf, rtol=1e-4, atol=1e-5)
    stance.__exit__(None, None, None)
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]


_FRESH = """
import sys, torch, rotary
{setup}
s = rotary.RopeSpec(8)
x = torch.randn(1, 5, 2, 8)
{before}
f = torch.compile(lambda x, p: rotary.apply(x, p, spec=s, seq_axis=-3), fullgraph=True, backend="eager")
assert torch.equal(f(x, torch.arange(3, 8)), rotary.apply(x, 3, spec=s, seq_axis=-3))
print("ok")
"""


@pytest.mark.parametrize("setup, before", [
    # the first eager call registers the ops, not Dynamo's handlers (no torch._dynamo import: ~1 s)
    ("", "rotary.apply(x, 3, spec=s, seq_axis=-3); assert 'torch._dynamo' not in sys.modules"),
    # torch_hook.install() (torch-free) before any call: the first call may be a compiled one
    ("from rotary.interop import torch_hook; torch_hook.install(); assert 'rotary.interop.torch_ops' not in "
     "sys.modules", ""),
], ids=["eager-call-first", "hook-installed"])
def test_handlers_register_when_dynamo_loads(setup, before):
    import subprocess
    import sys

    code = _FRESH.format(setup=setup, before=before)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]


def test_first_torch_call_of_rotary_under_compile():
    """The issue's case: a fresh process whose first rotary call on a torch tensor is compiled. That first
    compile traces rotary's Python up to the adapter's import (graph breaks, right results); from then
    on the handlers are there and fullgraph=True compiles."""
    import subprocess
    import sys

    code = """
import torch, rotary
s = rotary.RopeSpec(8)
x = torch.randn(1, 5, 2, 8)
f = torch.compile(lambda x: rotary.apply(x, 5, spec=s, seq_axis=-3), backend="eager")
y = f(x)
g = torch.compile(lambda x: rotary.apply(x, 5, spec=s, seq_axis=-3) * 1, fullgraph=True, backend="eager")
assert torch.equal(y, rotary.apply(x, 5, spec=s, seq_axis=-3)) and torch.equal(g(x), y)
print("ok")
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]
