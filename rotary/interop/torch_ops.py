"""rotary as torch custom ops, for ``torch.compile`` (``fullgraph=True``).

Four ops in the ``rotary`` namespace (``torch.library.custom_op``): ``torch.ops.rotary.rotate``,
``rotate_qk``, ``attention`` and ``linear_attention``, each with a fake (meta) implementation and
autograd. Their real implementation is the eager torch path of :mod:`.torch_adapter` (the Numba / CUDA
kernels, exact angles from host tables), so a compiled model computes what an eager one does.

Dynamo does not trace rotary's Python for these calls: :func:`register` installs
``torch.compiler.substitute_in_graph`` handlers for ``rotary.apply``, ``apply_qk``, ``attention`` and
``linear_attention`` that call the ops directly. A spec is not a tensor: it reaches the ops as a string
(:func:`spec_key`: a spec's fields, or the spec keywords, as JSON; the op resolves keywords against its own
input's head_dim), computed once at trace time by ``torch.compiler.assume_constant_result`` from the spec
object and the keywords only, never from a shape, so ``dynamic=True`` (symbolic shapes) traces too. Positions
are a tensor argument (no recompile when their values change) or an int offset (a SymInt: one recompile to a
dynamic offset, none with ``dynamic=True``).

Backward: rotation's is the rotation by the opposite angle (the op itself with ``inverse`` flipped, so
double backward works too); attention's and linear attention's are one op each
(``attention_backward``, ``linear_attention_backward``). Attention's recomputes the forward through rotary's
differentiable eager path (torch operations on the tensors, rotation through the kernels) and takes its
vector-Jacobian product with ``torch.func.vjp``; linear attention's calls the backend's
``linear_attention_backward`` primitive (:mod:`rotary.attn.linear_backward`: chunked, memory O(T d), no
recomputed graph). Neither has a double backward (linear attention's raises an error saying so).

Only torch's public surface: ``torch.library.custom_op`` / ``register_fake`` / ``register_autograd``,
``torch.func.vjp`` and ``torch.compiler`` (``substitute_in_graph``, ``assume_constant_result``, ``disable``).
What that costs, against the private APIs used before (docs/interop.md): a call without an op, after its
graph break, has its frontend Python traced by Dynamo (more graph breaks, about a second more compile time)
instead of being skipped whole.

Calls the ops cannot express (``out=``, ``cu_seqlens``, a callable feature map, a linear-attention
``state``, positions that are neither a tensor nor an int, non-tensor inputs: any keyword of the
frontend's signature outside what an op takes, set away from its default) run eagerly: a graph break
(``fullgraph=True`` raises, naming the reason).

:mod:`.torch_adapter` imports this module (the first rotary call on a torch tensor registers the ops);
the Dynamo handlers (:func:`register`) follow when ``torch._dynamo`` is loaded (at once if it is, else
by an import hook, :mod:`.torch_hook`: ``torch.compile`` loads it before tracing). A model compiled
before rotary ever saw a torch tensor gets graph breaks on its first compile (Dynamo traces rotary's
Python up to the adapter's import, after which the adapter runs eagerly); ``import
rotary.interop.torch_ops`` or ``rotary.interop.torch_hook.install()`` (torch-free) before compiling
avoids that.
"""

from __future__ import annotations

import json
import types

import numpy as np
import torch

from ..attn.linear import linear_attention as _linear_attention
from ..attn.softmax import attention as _attention
from ..frontend.rotate import apply as _apply
from ..frontend.rotate import apply_qk as _apply_qk
from ..frontend.axes import normalize_seq_axis, take_tensor_layout
from ..frontend.arguments import _SPEC_KEYWORDS as SPEC_KEYWORDS
from ..frontend.normalize import resolve_spec
from ..spec.rope_spec import RopeSpec

_NS = "rotary"
_SPECS: dict[str, RopeSpec | dict] = {}   # key -> the spec object, or the spec keywords, it was made from
_RESOLVED: dict[tuple[str, int], RopeSpec] = {}   # (key, head_dim) -> the spec the op's call uses


# -- specs as strings ----------------------------------------------------------------------------
def _plain(value):
    """JSON for the NumPy values a spec keyword may hold (exact: float64/float32 scalars and arrays as Python
    floats and lists)."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"a spec keyword's value of type {type(value).__name__} is not a number, string, list or dict")


def spec_key(spec, spec_kwargs) -> str:
    """The op argument for ``spec`` or the spec keywords ``**spec_kwargs``: ``""`` for neither, ``"spec:"`` and
    the spec's fields as JSON, or ``"keywords:"`` and the keywords as JSON (resolved by the op against its
    input's head_dim, so the key never depends on a shape: a symbolic head_dim under ``dynamic=True`` stays
    out of it). Evaluated at trace time (``torch.compiler.assume_constant_result``: a constant of the graph);
    the objects are kept here, so the op finds the very spec object back in this process."""
    if spec is None and not spec_kwargs:
        return ""
    if spec is not None:
        if spec_kwargs:
            raise TypeError(f"pass either spec= or the spec keywords {sorted(spec_kwargs)}, not both")
        if not isinstance(spec, RopeSpec):
            raise TypeError(f"spec must be a rotary.RopeSpec, got {type(spec).__name__}")
        key = "spec:" + json.dumps(spec._init_kwargs(), sort_keys=True)
        _SPECS.setdefault(key, spec)
        return key
    unknown = set(spec_kwargs) - set(SPEC_KEYWORDS)
    if unknown:
        raise TypeError(f"unexpected keyword argument(s) {sorted(unknown)}; spec keywords are {SPEC_KEYWORDS}")
    key = "keywords:" + json.dumps(dict(spec_kwargs), sort_keys=True, default=_plain)
    _SPECS.setdefault(key, dict(spec_kwargs))
    return key


def _spec(key: str, head_dim: int, name: str = "x"):
    """The spec of a key at this head_dim: the registered spec object, or one built from the keywords (once per
    key and head_dim), or rebuilt from the JSON (a graph from another process); None for ``""``."""
    if not key:
        return None
    found = _RESOLVED.get((key, head_dim))
    if found is not None:
        return found
    kind, _, text = key.partition(":")
    given = _SPECS.get(key)
    if given is None:
        given = json.loads(text)
        given = _SPECS.setdefault(key, RopeSpec(**given) if kind == "spec" else given)
    if kind == "spec":
        spec = resolve_spec(given, {}, head_dim, name)
    else:
        spec = resolve_spec(None, dict(given), head_dim, name)
    _RESOLVED[(key, head_dim)] = spec
    return spec


def _positions(positions, offset):
    return offset if positions is None else positions


def _fresh(t, inputs):
    """t as an op output: contiguous (what the fake implementations promise) and no input's memory."""
    t = t.contiguous()
    if any(t.untyped_storage().data_ptr() == a.untyped_storage().data_ptr() for a in inputs if a is not None):
        t = t.clone()
    return t


def _host(positions):
    """Tensor positions as a NumPy array, read before :func:`_vjp` (a tensor's data cannot be read inside
    ``torch.func`` transforms; positions are not differentiated)."""
    return positions.detach().cpu().numpy() if isinstance(positions, torch.Tensor) else positions


def _vjp(forward, inputs, grad):
    """Gradients of ``forward(*inputs)`` against ``grad``, through rotary's differentiable eager path.

    This runs inside an op's implementation, below the autograd keys the dispatcher has already passed (plain
    ``torch.autograd`` records nothing there): ``torch.func.vjp`` differentiates on its own transform level,
    which works at any depth of dispatch."""
    with torch.enable_grad():
        _, pullback = torch.func.vjp(forward, *inputs)
        grads = pullback(grad)
    return tuple(torch.zeros_like(a) if g is None else g.contiguous() for a, g in zip(inputs, grads))


# -- rotation --------------------------------------------------------------------------------------
@torch.library.custom_op(f"{_NS}::rotate", mutates_args=())
def rotate(x: torch.Tensor, positions: torch.Tensor | None, offset: int, spec: str, seq_axis: int, inverse: bool,
           backend: str) -> torch.Tensor:
    """``rotary.apply(x, positions or offset, spec=..., seq_axis=..., inverse=...)``."""
    with torch.no_grad():
        y = _apply(x, _positions(positions, offset), spec=_spec(spec, x.shape[-1]), seq_axis=seq_axis,
                   inverse=inverse, backend=backend)
    return _fresh(y, [x])


@rotate.register_fake
def _(x, positions, offset, spec, seq_axis, inverse, backend):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _rotate_setup(ctx, inputs, output):
    x, positions, offset, spec, seq_axis, inverse, backend = inputs
    ctx.save_for_backward(positions)
    ctx.args = (offset, spec, seq_axis, inverse, backend)


def _rotate_backward(ctx, grad):
    (positions,) = ctx.saved_tensors
    offset, spec, seq_axis, inverse, backend = ctx.args
    return rotate(grad, positions, offset, spec, seq_axis, not inverse, backend), None, None, None, None, None, None


rotate.register_autograd(_rotate_backward, setup_context=_rotate_setup)


@torch.library.custom_op(f"{_NS}::rotate_qk", mutates_args=())
def rotate_qk(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor | None, offset: int, spec: str,
              seq_axis: int, inverse: bool, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``rotary.apply_qk(q, k, positions or offset, ...)``: q and k in one pass (GQA head counts)."""
    with torch.no_grad():
        qr, kr = _apply_qk(q, k, _positions(positions, offset), spec=_spec(spec, q.shape[-1], "q"),
                           seq_axis=seq_axis, inverse=inverse, backend=backend)
    return _fresh(qr, [q, k]), _fresh(kr, [q, k])


@rotate_qk.register_fake
def _(q, k, positions, offset, spec, seq_axis, inverse, backend):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format))


def _rotate_qk_setup(ctx, inputs, output):
    q, k, positions, offset, spec, seq_axis, inverse, backend = inputs
    ctx.save_for_backward(positions)
    ctx.args = (offset, spec, seq_axis, inverse, backend)


def _rotate_qk_backward(ctx, gq, gk):
    (positions,) = ctx.saved_tensors
    offset, spec, seq_axis, inverse, backend = ctx.args
    back = (positions, offset, spec, seq_axis, not inverse, backend)
    if gq is not None and gk is not None:
        dq, dk = rotate_qk(gq, gk, *back)
    else:
        dq = None if gq is None else rotate(gq, *back)
        dk = None if gk is None else rotate(gk, *back)
    return dq, dk, None, None, None, None, None, None


rotate_qk.register_autograd(_rotate_qk_backward, setup_context=_rotate_qk_setup)


# -- softmax attention -----------------------------------------------------------------------------
def _attention_call(q, k, v, positions, offset, q_positions, k_positions, spec, seq_axis, causal, scale, rope,
                    window, softcap, block_size, backend):
    kw = dict(causal=causal, scale=scale, spec=_spec(spec, q.shape[-1], "q"), seq_axis=seq_axis, rope=rope,
              window=window, softcap=softcap, block_size=block_size, backend=backend)
    if q_positions is not None:
        return _attention(q, k, v, q_positions=q_positions, k_positions=k_positions, **kw)
    return _attention(q, k, v, _positions(positions, offset), **kw)


@torch.library.custom_op(f"{_NS}::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | None, offset: int,
              q_positions: torch.Tensor | None, k_positions: torch.Tensor | None, spec: str, seq_axis: int,
              causal: bool, scale: float | None, rope: bool, window: int | None, softcap: float | None,
              block_size: int, backend: str) -> torch.Tensor:
    """``rotary.attention`` (softmax attention with RoPE on q and k; GQA, causal, window, softcap)."""
    with torch.no_grad():
        o = _attention_call(q, k, v, positions, offset, q_positions, k_positions, spec, seq_axis, causal, scale,
                            rope, window, softcap, block_size, backend)
    return _fresh(o, [q, k, v])


@attention.register_fake
def _(q, k, v, *args):
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


@torch.library.custom_op(f"{_NS}::attention_backward", mutates_args=())
def attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       positions: torch.Tensor | None, offset: int, q_positions: torch.Tensor | None,
                       k_positions: torch.Tensor | None, spec: str, seq_axis: int, causal: bool,
                       scale: float | None, rope: bool, window: int | None, softcap: float | None, block_size: int,
                       backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of :func:`attention`: the eager differentiable path recomputed, its VJP."""
    rest = (_host(positions), offset, _host(q_positions), _host(k_positions), spec, seq_axis, causal, scale, rope,
            window, softcap, block_size, backend)
    return _vjp(lambda q, k, v: _attention_call(q, k, v, *rest), (q, k, v), grad)


@attention_backward.register_fake
def _(grad, q, k, v, *args):
    return tuple(torch.empty_like(a, memory_format=torch.contiguous_format) for a in (q, k, v))


def _attention_setup(ctx, inputs, output):
    q, k, v, positions, offset, q_positions, k_positions, *rest = inputs
    ctx.save_for_backward(q, k, v, positions, q_positions, k_positions)
    ctx.args = (offset, *rest)


def _attention_backward(ctx, grad):
    q, k, v, positions, q_positions, k_positions = ctx.saved_tensors
    offset, *rest = ctx.args
    dq, dk, dv = attention_backward(grad, q, k, v, positions, offset, q_positions, k_positions, *rest)
    return (dq, dk, dv) + (None,) * 13


attention.register_autograd(_attention_backward, setup_context=_attention_setup)


# -- linear attention ------------------------------------------------------------------------------
def _decay(decay, decay_heads):
    """The frontend's ``decay``: the scalar, or the per-head values of ``decay_heads`` (a float64 tensor in k's
    axes other than the sequence and last ones, or any shape that broadcasts to them) as a NumPy array."""
    return decay if decay_heads is None else decay_heads.detach().cpu().numpy()


def _linear_call(q, k, v, positions, offset, spec, seq_axis, causal, feature_map, eps, chunk, decay, normalize,
                 backend, decay_heads=None):
    return _linear_attention(q, k, v, _positions(positions, offset), causal=causal, feature_map=feature_map, eps=eps,
                             spec=_spec(spec, q.shape[-1], "q"), seq_axis=seq_axis, chunk=chunk,
                             decay=_decay(decay, decay_heads), normalize=normalize, backend=backend)


@torch.library.custom_op(f"{_NS}::linear_attention", mutates_args=())
def linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | None, offset: int,
                     spec: str, seq_axis: int, causal: bool, feature_map: str, eps: float, chunk: int,
                     decay: float | None, normalize: bool, backend: str,
                     decay_heads: torch.Tensor | None = None) -> torch.Tensor:
    """``rotary.linear_attention`` with a named feature map and no state (``decay_heads``: a per-head decay as a
    float64 tensor, ``decay`` then None)."""
    with torch.no_grad():
        o = _linear_call(q, k, v, positions, offset, spec, seq_axis, causal, feature_map, eps, chunk, decay,
                         normalize, backend, decay_heads)
    return _fresh(o, [q, k, v])


@linear_attention.register_fake
def _(q, k, v, *args):
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


@torch.library.custom_op(f"{_NS}::linear_attention_backward", mutates_args=())
def linear_attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              positions: torch.Tensor | None, offset: int, spec: str, seq_axis: int, causal: bool,
                              feature_map: str, eps: float, chunk: int, decay: float | None, normalize: bool,
                              backend: str, decay_heads: torch.Tensor | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of :func:`linear_attention`: the backend's ``linear_attention_backward`` primitive through
    :func:`rotary.attn.linear_backward.linear_attention_backward` (CPU tensors as NumPy views: the Numba kernels
    where the backend has them, else the NumPy reference; CUDA tensors through the reference's torch
    operations). A backend named for the forward that has no backward primitive leaves the choice to "auto"."""
    from .. import backends as _backends
    from ..attn.linear_backward import linear_attention_backward as _backward

    if backend != "auto" and not _backends.supports(_backends.get(backend), "linear_attention_backward"):
        backend = "auto"
    cpu = q.device.type == "cpu"

    def arg(t):
        t = t.detach()
        if not cpu:
            return t
        return (t.float() if t.dtype in (torch.bfloat16,) else t).numpy()

    with torch.no_grad():
        dq, dk, dv, _ = _backward(arg(q), arg(k), arg(v), arg(grad), _positions(_host(positions), offset),
                                  causal=causal, feature_map=feature_map, eps=eps,
                                  spec=_spec(spec, q.shape[-1], "q"), seq_axis=seq_axis, chunk=chunk,
                                  decay=_decay(decay, decay_heads), normalize=normalize, backend=backend)
    if cpu:
        dq, dk, dv = (torch.from_numpy(np.ascontiguousarray(d)) for d in (dq, dk, dv))
    return tuple(_fresh(d.to(a.dtype), [grad, q, k, v]) for d, a in zip((dq, dk, dv), (q, k, v)))


@linear_attention_backward.register_fake
def _(grad, q, k, v, *args):
    return tuple(torch.empty_like(a, memory_format=torch.contiguous_format) for a in (q, k, v))


def _no_double_backward(ctx, *grads):
    raise RuntimeError("rotary.linear_attention has no double backward: its backward (the backend's "
                       "linear_attention_backward primitive) is not differentiable again; use torch.func / eager "
                       "autograd through the reference path for higher derivatives")


linear_attention_backward.register_autograd(_no_double_backward, setup_context=lambda ctx, inputs, output: None)


def _linear_setup(ctx, inputs, output):
    q, k, v, positions, *rest = inputs
    ctx.save_for_backward(q, k, v, positions)
    ctx.args = tuple(rest)


def _linear_backward(ctx, grad):
    q, k, v, positions = ctx.saved_tensors
    dq, dk, dv = linear_attention_backward(grad, q, k, v, positions, *ctx.args)
    return (dq, dk, dv) + (None,) * 12


linear_attention.register_autograd(_linear_backward, setup_context=_linear_setup)


# -- what Dynamo traces instead of rotary's Python -------------------------------------------------
_EAGER = ("rotary.{}: this call's form (out=, cu_seqlens, a state, a callable feature map, positions that are "
          "neither a torch tensor nor an int, or non-tensor inputs) has no custom op; it runs eagerly (a graph "
          "break). See docs/interop.md, torch.compile")


def _eager_copy(fn):
    """A copy of fn that the handlers below do not replace, run eagerly under Dynamo (a graph break;
    fullgraph=True reports the reason)."""
    copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__dict__.update(fn.__dict__)
    return torch.compiler.disable(copy, reason=_EAGER.format(fn.__name__))


def _split(positions):
    """(tensor or None, int offset) for the ops, or None for positions they do not take."""
    if positions is None:
        return None, 0
    if isinstance(positions, torch.Tensor):
        return positions, 0
    if isinstance(positions, int) and not isinstance(positions, bool):
        return None, positions
    return None


def _tensors(*arrays):
    return all(isinstance(a, torch.Tensor) for a in arrays)


def _signature(fn):
    """(positional parameter names, {keyword: default}) of a frontend function, read once at registration
    (the handlers follow the frontend's signature, whatever keywords it gains)."""
    import inspect

    params = inspect.signature(fn).parameters.values()
    positional = tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
    defaults = {p.name: p.default for p in params if p.default is not p.empty}
    named = frozenset(p.name for p in params if p.kind is not p.VAR_KEYWORD)
    return positional, defaults, named


def _handler(original, arrays, taken, to_op):
    """A Dynamo handler for ``original``: ``to_op(call, spec_kwargs)`` builds the op call when the call
    passes ``arrays`` as torch tensors, positions the ops take, and no keyword outside ``taken`` away from
    its default; any other call runs eagerly (:func:`_eager_copy`)."""
    positional, defaults, named = _signature(original)
    eager = _eager_copy(original)
    others = tuple((name, default) for name, default in defaults.items() if name not in taken)

    @torch.compiler.substitute_in_graph(original, skip_signature_check=True)
    def handler(*args, **kwargs):
        if len(args) <= len(positional):
            call = dict(zip(positional, args))
            call.update(kwargs)
            spec_kwargs = {name: value for name, value in kwargs.items() if name not in named}
            plain = (_tensors(*(call.get(name) for name in arrays)) and _split(call.get("positions")) is not None
                     and all(call.get(name, default) is default for name, default in others))
            if plain:
                result = to_op(call, spec_kwargs)
                if result is not None:
                    return result
        return eager(*args, **kwargs)

    return handler


def _get(call, name, default):
    return call[name] if name in call else default


def _axis(call, spec_kwargs, x, name):
    """The call's sequence axis as the int the ops take (``seq_axis`` or a tensor ``layout=``, which leaves the
    spec keywords), with the frontend's own rule: named for 3 or more dimensions."""
    seq_axis, rest = take_tensor_layout(call.get("seq_axis"), spec_kwargs)
    if rest is not spec_kwargs:
        spec_kwargs.clear()
        spec_kwargs.update(rest)
    return normalize_seq_axis(seq_axis, x.ndim, name)


def _split_decay(decay):
    """(decay, decay_heads) for the linear-attention ops: a scalar (or None) as itself, per-head values (a NumPy
    array, or the tensor Dynamo makes of one) as a float64 tensor."""
    if decay is None or isinstance(decay, (int, float)) and not isinstance(decay, bool):
        return decay, None
    if isinstance(decay, np.generic) or (isinstance(decay, np.ndarray) and decay.ndim == 0):
        return float(decay), None
    return None, torch.as_tensor(decay, dtype=torch.float64)


def linear_op_args(call, spec_kwargs):
    """The arguments of ``torch.ops.rotary.linear_attention`` for a ``rotary.linear_attention`` call (``call``: its
    arguments by name, q, k and v torch tensors, positions a tensor, an int or None; ``spec_kwargs``: its spec
    keywords), or None when the call has no op form (a callable feature map). The Dynamo handler and the torch
    adapter's eager autograd (:func:`rotary.interop.torch_adapter.linear_attention`) both build the op call
    here."""
    q = call["q"]
    feature_map = _get(call, "feature_map", "elu")
    if not isinstance(feature_map, str):
        return None
    axis = _axis(call, spec_kwargs, q, "q")
    tensor, offset = _split(call.get("positions"))
    key = spec_key(_get(call, "spec", None), spec_kwargs)
    decay, decay_heads = _split_decay(_get(call, "decay", None))
    return (q, call["k"], call["v"], tensor, offset, key, axis, _get(call, "causal", False), feature_map,
            _get(call, "eps", 1e-6), _get(call, "chunk", 64), decay, _get(call, "normalize", True),
            _get(call, "backend", "auto"), decay_heads)


def _handlers():
    def rotate_op(call, spec_kwargs):
        x = call["x"]
        axis = _axis(call, spec_kwargs, x, "x")
        tensor, offset = _split(call.get("positions"))
        key = spec_key(_get(call, "spec", None), spec_kwargs)
        return torch.ops.rotary.rotate(x, tensor, offset, key, axis,
                                       _get(call, "inverse", False), _get(call, "backend", "auto"))

    def rotate_qk_op(call, spec_kwargs):
        q, k = call["q"], call["k"]
        axis = _axis(call, spec_kwargs, q, "q")
        tensor, offset = _split(call.get("positions"))
        key = spec_key(_get(call, "spec", None), spec_kwargs)
        return torch.ops.rotary.rotate_qk(q, k, tensor, offset, key, axis,
                                          _get(call, "inverse", False), _get(call, "backend", "auto"))

    def attention_op(call, spec_kwargs):
        q, k, v = call["q"], call["k"], call["v"]
        axis = _axis(call, spec_kwargs, q, "q")
        positions = call.get("positions")
        qp, kp = call.get("q_positions"), call.get("k_positions")
        if qp is not None or kp is not None:
            if positions is not None or not _tensors(qp, kp):
                return None
        tensor, offset = _split(positions)
        rope = _get(call, "rope", True)
        key = spec_key(_get(call, "spec", None), spec_kwargs)
        return torch.ops.rotary.attention(
            q, k, v, tensor, offset, qp, kp, key, axis, _get(call, "causal", False),
            _get(call, "scale", None), rope, _get(call, "window", None), _get(call, "softcap", None),
            _get(call, "block_size", 512), _get(call, "backend", "auto"))

    def linear_op(call, spec_kwargs):
        args = linear_op_args(call, spec_kwargs)
        return None if args is None else torch.ops.rotary.linear_attention(*args)

    common = {"positions", "spec", "seq_axis", "backend"}
    return (
        _handler(_apply, ("x",), common | {"x", "inverse"}, rotate_op),
        _handler(_apply_qk, ("q", "k"), common | {"q", "k", "inverse"}, rotate_qk_op),
        _handler(_attention, ("q", "k", "v"), common | {"q", "k", "v", "causal", "scale", "rope", "q_positions",
                                                        "k_positions", "window", "softcap", "block_size"},
                 attention_op),
        _handler(_linear_attention, ("q", "k", "v"), common | {"q", "k", "v", "causal", "feature_map", "eps",
                                                               "chunk", "decay", "normalize"}, linear_op),
    )


_HANDLERS = []


def register():
    """Install the Dynamo handlers (once, even after a failure: Dynamo refuses a second handler for a
    function; the ops themselves are registered by importing this module). Imports ``torch._dynamo``
    (about a second): :func:`.torch_hook.install` calls it when Dynamo loads."""
    if _HANDLERS:
        return _HANDLERS[0]
    _HANDLERS.append(None)
    torch.compiler.assume_constant_result(spec_key)   # marks spec_key in place: Dynamo calls it at trace time
    _HANDLERS[0] = _handlers()
    return _HANDLERS[0]


from . import torch_hook  # noqa: E402

torch_hook.install()
