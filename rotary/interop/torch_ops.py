"""rotary as torch custom ops, for ``torch.compile`` (``fullgraph=True``) and ``torch.export``.

Four ops in the ``rotary`` namespace (``torch.library.custom_op``): ``torch.ops.rotary.rotate``,
``rotate_qk``, ``attention`` and ``linear_attention``, each with a fake (meta) implementation and
autograd. Their real implementation is the eager torch path of :mod:`.torch_adapter` (the Numba / CUDA
kernels, exact angles from host tables), so a compiled model computes what an eager one does.

Dynamo never traces rotary's Python: :func:`register` installs ``torch.compiler.substitute_in_graph``
handlers for ``rotary.apply``, ``apply_qk``, ``attention`` and ``linear_attention`` that call the ops
directly. A spec is not a tensor: it reaches the ops as a string (its fields as JSON, the same spec
rebuilt on the other side; :func:`spec_key`), evaluated once at trace time. Positions are a tensor
argument (no recompile when their values change) or an int offset (a SymInt: one recompile to a
dynamic offset, none with ``dynamic=True``).

Backward: rotation's is the rotation by the opposite angle (the op itself with ``inverse`` flipped, so
double backward works too); attention's and linear attention's are one op each
(``attention_backward``, ``linear_attention_backward``) whose implementation recomputes the forward
through rotary's differentiable eager path (torch operations on the tensors, rotation through the
kernels) and takes its vector-Jacobian product; they have no double backward.

Calls the ops cannot express (``out=``, ``cu_seqlens``, a callable feature map, a linear-attention
``state``, positions that are neither a tensor nor an int, non-tensor inputs) run eagerly: a graph
break (``fullgraph=True`` raises, naming the reason).

:mod:`.torch_adapter` imports this module (the first rotary call on a torch tensor registers the ops);
the Dynamo handlers (:func:`register`) follow when ``torch._dynamo`` is loaded (at once if it is, else
by an import hook: ``torch.compile`` loads it before tracing). A model compiled before rotary ever saw
a torch tensor and before this module was imported traces rotary's Python (graph breaks): call the
model once eagerly, or ``import rotary.interop.torch_ops`` first.
"""

from __future__ import annotations

import functools
import json
import types

import torch

from .. import attention as _attention
from .. import apply as _apply
from .. import apply_qk as _apply_qk
from .. import linear_attention as _linear_attention
from ..frontend.normalize import resolve_spec
from ..spec.rope_spec import RopeSpec

_NS = "rotary"
_SPECS: dict[str, RopeSpec | None] = {}


# -- specs as strings ----------------------------------------------------------------------------
def spec_key(spec, spec_kwargs, head_dim, name="x") -> str:
    """The op argument for ``spec``/``**spec_kwargs`` at this head_dim: the resolved spec's fields as
    JSON ("" for no spec). Evaluated at trace time (a constant of the graph)."""
    if spec is None and not spec_kwargs and head_dim is None:
        return ""
    spec = resolve_spec(spec, dict(spec_kwargs), int(head_dim), name)
    key = json.dumps(spec._init_kwargs(), sort_keys=True)
    _SPECS.setdefault(key, spec)
    return key


def _spec(key: str):
    """The spec of a key (the registered object, or rebuilt from the JSON in another process)."""
    if not key:
        return None
    spec = _SPECS.get(key)
    if spec is None:
        spec = _SPECS.setdefault(key, RopeSpec(**json.loads(key)))
    return spec


def _positions(positions, offset):
    return offset if positions is None else positions


def _fresh(t, inputs):
    """t as an op output: contiguous (what the fake implementations promise) and no input's memory."""
    t = t.contiguous()
    if any(t.untyped_storage().data_ptr() == a.untyped_storage().data_ptr() for a in inputs if a is not None):
        t = t.clone()
    return t


class _AutogradOn:
    """Autograd recorded inside an op's implementation (the dispatcher excludes the autograd keys below
    an op's autograd kernel; the backward ops re-run a differentiable forward)."""

    def __enter__(self):
        exclude = torch._C._dispatch_tls_local_exclude_set()
        for key in ("AutogradCPU", "AutogradCUDA", "AutogradOther", "ADInplaceOrView"):
            exclude = exclude.remove(getattr(torch._C.DispatchKey, key))
        self._guard = torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)
        self._guard.__enter__()
        self._grad = torch.enable_grad()
        self._grad.__enter__()
        return self

    def __exit__(self, *exc):
        self._grad.__exit__(*exc)
        self._guard.__exit__(*exc)


def _vjp(forward, inputs, grad):
    """Gradients of ``forward(*inputs)`` against ``grad``, through rotary's differentiable eager path."""
    with _AutogradOn():
        leaves = [a.detach().requires_grad_(True) for a in inputs]
        out = forward(*leaves)
        grads = torch.autograd.grad(out, leaves, grad, allow_unused=True)
    return tuple(torch.zeros_like(a) if g is None else g.contiguous() for a, g in zip(inputs, grads))


# -- rotation --------------------------------------------------------------------------------------
@torch.library.custom_op(f"{_NS}::rotate", mutates_args=())
def rotate(x: torch.Tensor, positions: torch.Tensor | None, offset: int, spec: str, seq_axis: int, inverse: bool,
           backend: str) -> torch.Tensor:
    """``rotary.apply(x, positions or offset, spec=..., seq_axis=..., inverse=...)``."""
    with torch.no_grad():
        y = _apply(x, _positions(positions, offset), spec=_spec(spec), seq_axis=seq_axis, inverse=inverse,
                   backend=backend)
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
        qr, kr = _apply_qk(q, k, _positions(positions, offset), spec=_spec(spec), seq_axis=seq_axis,
                           inverse=inverse, backend=backend)
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
    kw = dict(causal=causal, scale=scale, spec=_spec(spec), seq_axis=seq_axis, rope=rope, window=window,
              softcap=softcap, block_size=block_size, backend=backend)
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
    rest = (positions, offset, q_positions, k_positions, spec, seq_axis, causal, scale, rope, window, softcap,
            block_size, backend)
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
def _linear_call(q, k, v, positions, offset, spec, seq_axis, causal, feature_map, eps, chunk, decay, normalize,
                 backend):
    return _linear_attention(q, k, v, _positions(positions, offset), causal=causal, feature_map=feature_map, eps=eps,
                             spec=_spec(spec), seq_axis=seq_axis, chunk=chunk, decay=decay, normalize=normalize,
                             backend=backend)


@torch.library.custom_op(f"{_NS}::linear_attention", mutates_args=())
def linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | None, offset: int,
                     spec: str, seq_axis: int, causal: bool, feature_map: str, eps: float, chunk: int,
                     decay: float | None, normalize: bool, backend: str) -> torch.Tensor:
    """``rotary.linear_attention`` with a named feature map and no state."""
    with torch.no_grad():
        o = _linear_call(q, k, v, positions, offset, spec, seq_axis, causal, feature_map, eps, chunk, decay,
                         normalize, backend)
    return _fresh(o, [q, k, v])


@linear_attention.register_fake
def _(q, k, v, *args):
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


@torch.library.custom_op(f"{_NS}::linear_attention_backward", mutates_args=())
def linear_attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              positions: torch.Tensor | None, offset: int, spec: str, seq_axis: int, causal: bool,
                              feature_map: str, eps: float, chunk: int, decay: float | None, normalize: bool,
                              backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of :func:`linear_attention` (the differentiable reference path recomputed)."""
    rest = (positions, offset, spec, seq_axis, causal, feature_map, eps, chunk, decay, normalize, backend)
    return _vjp(lambda q, k, v: _linear_call(q, k, v, *rest), (q, k, v), grad)


@linear_attention_backward.register_fake
def _(grad, q, k, v, *args):
    return tuple(torch.empty_like(a, memory_format=torch.contiguous_format) for a in (q, k, v))


def _linear_setup(ctx, inputs, output):
    q, k, v, positions, *rest = inputs
    ctx.save_for_backward(q, k, v, positions)
    ctx.args = tuple(rest)


def _linear_backward(ctx, grad):
    q, k, v, positions = ctx.saved_tensors
    dq, dk, dv = linear_attention_backward(grad, q, k, v, positions, *ctx.args)
    return (dq, dk, dv) + (None,) * 11


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


def _handlers():
    plain_apply, plain_apply_qk = _eager_copy(_apply), _eager_copy(_apply_qk)
    plain_attention, plain_linear = _eager_copy(_attention), _eager_copy(_linear_attention)
    substitute = torch.compiler.substitute_in_graph

    @substitute(_apply)
    def apply(x, positions=None, *, spec=None, seq_axis=-2, inverse=False, out=None, backend="auto",
              cu_seqlens=None, seqlen_offsets=None, **spec_kwargs):
        pos = _split(positions)
        if pos is None or out is not None or cu_seqlens is not None or seqlen_offsets is not None or not _tensors(x):
            return plain_apply(x, positions, spec=spec, seq_axis=seq_axis, inverse=inverse, out=out, backend=backend,
                               cu_seqlens=cu_seqlens, seqlen_offsets=seqlen_offsets, **spec_kwargs)
        key = spec_key(spec, spec_kwargs, x.shape[-1])
        return torch.ops.rotary.rotate(x, pos[0], pos[1], key, seq_axis, inverse, backend)

    @substitute(_apply_qk)
    def apply_qk(q, k, positions=None, *, spec=None, seq_axis=-2, inverse=False, out=None, backend="auto",
                 cu_seqlens=None, seqlen_offsets=None, **spec_kwargs):
        pos = _split(positions)
        if (pos is None or out is not None or cu_seqlens is not None or seqlen_offsets is not None
                or not _tensors(q, k)):
            return plain_apply_qk(q, k, positions, spec=spec, seq_axis=seq_axis, inverse=inverse, out=out,
                                  backend=backend, cu_seqlens=cu_seqlens, seqlen_offsets=seqlen_offsets,
                                  **spec_kwargs)
        key = spec_key(spec, spec_kwargs, q.shape[-1], "q")
        return torch.ops.rotary.rotate_qk(q, k, pos[0], pos[1], key, seq_axis, inverse, backend)

    @substitute(_attention)
    def attention(q, k, v, positions=None, *, causal=False, scale=None, spec=None, seq_axis=-2, backend="auto",
                  rope=True, q_positions=None, k_positions=None, window=None, softcap=None, cu_seqlens=None,
                  cu_seqlens_k=None, seqlen_offsets=None, q_mask_positions=None, k_mask_positions=None,
                  block_size=512, **spec_kwargs):
        pos = _split(positions)
        explicit = q_positions is not None or k_positions is not None
        if (pos is None or not _tensors(q, k, v) or cu_seqlens is not None or cu_seqlens_k is not None
                or seqlen_offsets is not None or q_mask_positions is not None or k_mask_positions is not None
                or (explicit and (positions is not None or not _tensors(q_positions, k_positions)))):
            return plain_attention(q, k, v, positions, causal=causal, scale=scale, spec=spec, seq_axis=seq_axis,
                                   backend=backend, rope=rope, q_positions=q_positions, k_positions=k_positions,
                                   window=window, softcap=softcap, cu_seqlens=cu_seqlens, cu_seqlens_k=cu_seqlens_k,
                                   seqlen_offsets=seqlen_offsets, q_mask_positions=q_mask_positions,
                                   k_mask_positions=k_mask_positions, block_size=block_size, **spec_kwargs)
        with_spec = rope or spec is not None or spec_kwargs
        key = spec_key(spec, spec_kwargs, q.shape[-1] if with_spec else None, "q")
        return torch.ops.rotary.attention(q, k, v, pos[0], pos[1], q_positions, k_positions, key, seq_axis,
                                          causal, scale, rope, window, softcap, block_size, backend)

    @substitute(_linear_attention)
    def linear_attention(q, k, v, positions=None, *, causal=False, feature_map="elu", eps=1e-6, spec=None,
                         seq_axis=-2, state=None, return_state=False, backend="auto", chunk=64, decay=None,
                         normalize=True, cu_seqlens=None, seqlen_offsets=None, **spec_kwargs):
        pos = _split(positions)
        if (pos is None or not _tensors(q, k, v) or not isinstance(feature_map, str) or state is not None
                or return_state or cu_seqlens is not None or seqlen_offsets is not None):
            return plain_linear(q, k, v, positions, causal=causal, feature_map=feature_map, eps=eps, spec=spec,
                                seq_axis=seq_axis, state=state, return_state=return_state, backend=backend,
                                chunk=chunk, decay=decay, normalize=normalize, cu_seqlens=cu_seqlens,
                                seqlen_offsets=seqlen_offsets, **spec_kwargs)
        key = spec_key(spec, spec_kwargs, q.shape[-1], "q")
        return torch.ops.rotary.linear_attention(q, k, v, pos[0], pos[1], key, seq_axis, causal, feature_map, eps,
                                                 chunk, decay, normalize, backend)

    return apply, apply_qk, attention, linear_attention


def _run_eagerly(fn):
    """Dynamo never compiles a frame of fn nor what it calls: after a graph break at a call of fn (a
    form without an op) the whole call runs eagerly instead of Dynamo tracing rotary's Python."""
    try:
        from torch._C._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy
    except ImportError:   # another torch: rotary's Python is traced there (graph breaks)
        return
    code = getattr(fn, "__wrapped__", fn).__code__
    for c in {code, fn.__code__}:
        set_code_exec_strategy(c, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))


@functools.cache
def register():
    """Install the Dynamo handlers (once; the ops themselves are registered by importing this module).
    Imports ``torch._dynamo`` (about a second): :func:`.torch_hook.install` calls it when Dynamo loads."""
    torch.compiler.assume_constant_result(spec_key)   # marks spec_key in place: Dynamo calls it at trace time
    for fn in (_apply, _apply_qk, _attention, _linear_attention):
        _run_eagerly(fn)
    return _handlers()


from . import torch_hook  # noqa: E402

torch_hook.install()
