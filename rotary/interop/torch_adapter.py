"""torch adapter: CPU tensors through the NumPy/Numba kernels, CUDA tensors through the CuPy kernels.

No copy on the way in or out: a CPU tensor is handed to the core as its ``Tensor.numpy()`` view (the
same memory, any strides), a CUDA tensor as a CuPy array through DLPack (run on torch's current
stream); results come back with ``torch.from_numpy`` / ``torch.from_dlpack``, so dtype, device and
strides follow the NumPy contract, and ``out=`` tensors are written in place. bfloat16 (no NumPy or
CuPy dtype) is computed in float32 on the CPU (one cast each way) and goes to the CuPy kernels as
torch tensors on CUDA (their bfloat16 instantiation; ``out=`` then costs one copy).

Autograd: when grad is enabled and an input requires grad, rotation runs inside
:class:`torch.autograd.Function` ``_Rotate`` whose backward is the same rotation with ``inverse``
flipped (``(a R_p)^T = a R_{-p}``, a the attention scaling); double backward works the same way.
Linear attention with grad runs as the custom op ``torch.ops.rotary.linear_attention`` (:mod:`.torch_ops`:
the kernels forward, the backend's ``linear_attention_backward`` primitive backward) when the op takes the
call (a named feature map, no state, no ``return_state``, no packing); other calls with grad, and callable
feature maps, run the reference array-API path on the tensors themselves (torch operations, differentiable
by torch; also with :data:`OP_BACKWARD` = False); see docs/interop.md.

Importing this module registers rotary's torch custom ops and their ``torch.compile`` handlers
(:mod:`.torch_ops`; torch 2.4 or later), so a model that has called rotary once compiles with
``fullgraph=True``.
"""

from __future__ import annotations

import sys

import numpy as np

from .. import backends as _backends
from ..frontend.dispatch import with_arrays


def _torch():
    import torch

    return torch


def _register_ops():
    """rotary's custom ops and Dynamo handlers (:mod:`.torch_ops`), where this torch has the API."""
    torch = _torch()
    if not hasattr(torch.library, "custom_op"):   # torch 2.4+
        return
    if "torch._dynamo" in sys.modules:   # maybe inside a call Dynamo compiles: register with Dynamo off
        from . import torch_hook

        torch_hook.install()
    else:
        from . import torch_ops  # noqa: F401  (the ops now; Dynamo's handlers when torch._dynamo loads)


_register_ops()


def _eager_under_dynamo():
    """With Dynamo loaded (this import may come from a call that torch.compile is tracing, before the
    handlers of :mod:`.torch_ops` existed): the adapter's entry points run eagerly under Dynamo (a graph
    break) instead of Dynamo tracing them (NumPy views of fake tensors cannot work)."""
    if "torch._dynamo" not in sys.modules:
        return
    disable = _torch().compiler.disable
    reason = "rotary's torch adapter runs eagerly (this call has no custom op, see docs/interop.md)"
    glob = globals()
    for name in ("rotate", "linear_attention"):
        if not getattr(glob[name], "_rotary_eager", False):   # (once: the hook and the import may both ask)
            glob[name] = disable(glob[name], reason=reason)
            glob[name]._rotary_eager = True


def _needs_grad(tensors) -> bool:
    torch = _torch()
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def _check_device(tensors, names, backend):
    """Every tensor on one device, and a backend that runs there (ValueError naming the fix)."""
    torch = _torch()
    dev = tensors[0].device
    for t, name in zip(tensors, names):
        if isinstance(t, torch.Tensor) and t.device != dev:
            raise ValueError(f"{name} is on {t.device}, {names[0]} on {dev}: move them to one device")
    runs_on = _backends.device_of(backend)
    if runs_on == "cuda" and dev.type != "cuda":
        raise ValueError(f"backend={backend!r} needs CUDA tensors, but {names[0]} is on {dev}: move the tensors "
                         f"with .cuda(), or pass backend='auto' (Numba on the CPU)")
    if runs_on == "cpu" and dev.type == "cuda":
        raise ValueError(f"backend={backend!r} runs on the CPU, but {names[0]} is on {dev}: pass backend='auto' "
                         "or 'cupy' (the CUDA kernels), or move the tensors with .cpu()")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"{names[0]} is on {dev}; rotary's kernels run on cpu and cuda tensors: move it with "
                         ".cpu() (or use the array-API reference path through another library)")
    return dev


class _Bridge:
    """Converts tensors to the core's arrays (zero copy) and results back, for one call."""

    def __init__(self, device):
        torch = _torch()
        self.cuda = device.type == "cuda"
        self.stream = None
        if self.cuda:
            _backends.get("cupy")   # BackendUnavailableError saying what to install when CuPy/CUDA is missing
            import cupy

            from ..backends.cupy import _external_stream

            index = device.index if device.index is not None else torch.cuda.current_device()
            self.device = cupy.cuda.Device(index)
            self.stream = _external_stream(cupy, torch.cuda.current_stream(device), index)

    def native(self, t) -> bool:
        """False for tensors the core takes as torch tensors (bfloat16 on CUDA: the CuPy backend's own
        torch exchange)."""
        return not (self.cuda and t.dtype == _torch().bfloat16)

    def to_core(self, t):
        """A NumPy (CPU) or CuPy (CUDA) view of t; CPU bfloat16 becomes a float32 copy."""
        if t is None:
            return None
        torch = _torch()
        t = t.detach()
        if not self.cuda:
            if t.dtype == torch.bfloat16:
                return t.float().numpy()
            return t.resolve_conj().resolve_neg().numpy()
        if not self.native(t):
            return t
        import cupy

        return cupy.from_dlpack(t)

    def from_core(self, a, like):
        torch = _torch()
        if a is None or isinstance(a, torch.Tensor):
            return a
        t = torch.from_numpy(a) if isinstance(a, np.ndarray) else torch.from_dlpack(a)
        return t.to(like.dtype) if t.dtype != like.dtype else t

    def __enter__(self):
        if self.cuda:
            self.device.__enter__()
            self.stream.__enter__()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.stream.__exit__(*exc)
            self.device.__exit__(*exc)


def _rotate_plain(core, xs, outs, names, positions, kwargs):
    torch = _torch()
    for out, name in zip(outs, names):
        if out is not None and not isinstance(out, torch.Tensor):
            raise TypeError(f"out for {name} must be a torch tensor like {name}, got {type(out).__name__}")
    dev = _check_device(list(xs) + [o for o in outs if o is not None], list(names) + ["out"] * len(outs),
                        kwargs.get("backend", "auto"))
    with _Bridge(dev) as bridge:
        if any(not bridge.native(x) for x in xs):   # bfloat16 on CUDA: the torch path of the CuPy backend
            return core(list(xs), list(outs), names, positions, **kwargs)
        core_xs = [bridge.to_core(x) for x in xs]
        core_outs, copies = [], []
        for x, xc, out, name in zip(xs, core_xs, outs, names):
            copy = out is not None and x.dtype == torch.bfloat16   # CPU bfloat16: computed in a float32 copy
            if copy and (out.dtype != x.dtype or tuple(out.shape) != tuple(x.shape)):
                raise ValueError(f"out for {name} must have {name}'s shape {tuple(x.shape)} and dtype {x.dtype}, "
                                 f"got {tuple(out.shape)} {out.dtype}")
            core_outs.append(None if out is None or copy else xc if out is x else bridge.to_core(out))
            copies.append(copy)
        results = core(core_xs, core_outs, names, positions, **kwargs)
        final = []
        for x, out, res, copy in zip(xs, outs, results, copies):
            if out is None:
                final.append(bridge.from_core(res, x))
                continue
            if copy:
                out.copy_(torch.from_numpy(res))
            final.append(out)
        return final


def _rotate_function():
    torch = _torch()

    class _Rotate(torch.autograd.Function):
        """y = a R_p x on rotary's kernels; dx = a R_{-p} dy (the same call with inverse flipped)."""

        @staticmethod
        def forward(core, names, positions, kwargs, *xs):
            return tuple(_rotate_plain(core, xs, [None] * len(xs), names, positions, kwargs))

        @staticmethod
        def setup_context(ctx, inputs, output):   # the separate form torch.func transforms need (torch_ops' VJP)
            ctx.call = inputs[:4]

        @staticmethod
        def backward(ctx, *grads):
            core, names, positions, kwargs = ctx.call
            back = dict(kwargs, inverse=not kwargs.get("inverse", False))
            want = [i for i, g in enumerate(grads) if g is not None and ctx.needs_input_grad[4 + i]]
            result = [None] * len(grads)
            if want:
                gs = [grads[i] for i in want]
                if kwargs.get("out_pairs") is not None:
                    back = _swap_pairs(back, int(gs[0].shape[-1]), names[0])
                rotated = rotate(core, gs, [None] * len(gs), [names[i] for i in want], positions, **back)
                for i, g in zip(want, rotated):
                    result[i] = g
            return (None, None, None, None, *result)

    return _Rotate


_ROTATE = []


def _swap_pairs(kwargs, head_dim, name):
    """The backward call's keywords of a rotation with ``out_pairs``: it read pairs in the spec's layout and wrote
    them in out_pairs, so the gradient's pairs are read in out_pairs and written in the spec's layout."""
    from ..frontend.arguments import resolve_spec

    spec = resolve_spec(kwargs.get("spec"), dict(kwargs.get("spec_kwargs") or {}), head_dim, name)
    if kwargs["out_pairs"] == spec.layout:
        return kwargs
    return dict(kwargs, spec=spec.replace(layout=kwargs["out_pairs"]), spec_kwargs={}, out_pairs=spec.layout)


def rotate(core, xs, outs, names, positions, **kwargs):
    """``rotary.frontend.rotate.rotate_arrays`` for torch tensors (see the module docstring)."""
    torch = _torch()
    for x, name in zip(xs, names):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch tensor like {names[0]}, got {type(x).__name__}")
    if _needs_grad(xs):
        if any(o is not None for o in outs):
            raise ValueError("out= is not supported when an input requires grad (autograd needs a new tensor); "
                             "drop out=, or call under torch.no_grad()")
        if not _ROTATE:
            _ROTATE.append(_rotate_function())
        return list(_ROTATE[0].apply(core, tuple(names), positions, kwargs, *xs))
    return _rotate_plain(core, xs, outs, names, positions, kwargs)


#: Eager autograd of ``rotary.linear_attention`` through ``torch.ops.rotary.linear_attention`` (the kernels'
#: forward, the ``linear_attention_backward`` primitive as its backward) for the calls the op takes. False: the
#: differentiable reference path (torch operations on the tensors; double backward, forward-mode AD).
OP_BACKWARD = True

#: the frontend keywords whose defaults an op call keeps (a state, packing: the reference path)
_NO_OP = (("state", None), ("return_state", False), ("cu_seqlens", None), ("seqlen_offsets", None))


def _op_call(q, k, v, positions, kwargs):
    """The arguments of ``torch.ops.rotary.linear_attention`` for this call, or None when the op cannot take it:
    a callable feature map, a state, ``return_state=True``, a packed batch, positions that are not None, an
    int, a tensor or integers (those become an int64 tensor), or a torch without custom ops."""
    torch = _torch()
    if not hasattr(torch.library, "custom_op") or callable(kwargs.get("feature_map", "elu")):
        return None
    if any(kwargs.get(name, default) is not default for name, default in _NO_OP):
        return None
    if positions is not None and not isinstance(positions, (int, torch.Tensor)) or isinstance(positions, bool):
        try:
            ints = np.asarray(positions)
        except (TypeError, ValueError):   # (a CuPy array: the reference path takes it)
            return None
        if ints.dtype.kind not in "iu":
            return None
        positions = torch.from_numpy(ints.astype(np.int64))
    if isinstance(positions, torch.Tensor) and (positions.dtype.is_floating_point or positions.dtype.is_complex):
        return None
    from . import torch_ops

    named = _frontend_keywords()
    call = dict(kwargs, q=q, k=k, v=v, positions=positions)
    spec_kwargs = {name: value for name, value in kwargs.items() if name not in named}
    return torch_ops.linear_op_args(call, spec_kwargs)


_KEYWORDS = []


def _frontend_keywords():
    """The names of ``rotary.linear_attention``'s own parameters (the rest of a call's keywords: spec keywords)."""
    if not _KEYWORDS:
        import inspect

        from ..attn.linear import linear_attention as frontend

        _KEYWORDS.append(frozenset(inspect.signature(frontend).parameters) - {"spec_kwargs"})
    return _KEYWORDS[0]


def linear_attention(core, q, k, v, positions=None, **kwargs):
    """``rotary.linear_attention`` for torch tensors: kernels when no grad is needed and the feature map
    is a name; with grad, the custom op ``torch.ops.rotary.linear_attention`` (the kernels forward, the
    backward primitive backward: :data:`OP_BACKWARD`) for the calls it takes; else the reference path on the
    tensors (differentiable; a callable feature map sees torch tensors)."""
    if kwargs.pop("save_for_backward", False):   # torch autograd keeps its own: nothing saved here
        from ..attn.linear import nothing_saved

        return nothing_saved(linear_attention(core, q, k, v, positions, **kwargs), kwargs.get("return_state"))
    torch = _torch()
    names = ("q", "k", "v")
    for a, name in zip((q, k, v), names):
        if not isinstance(a, torch.Tensor):
            raise TypeError(f"{name} must be a torch tensor like q, got {type(a).__name__}")
    backend = kwargs.get("backend", "auto")
    state = kwargs.get("state")
    state_arrays = [] if state is None else [getattr(state, "S", None), getattr(state, "z", None)]
    for a, name in zip(state_arrays, ("state.S", "state.z")):
        if not isinstance(a, torch.Tensor) and not (a is None and name == "state.z"):
            raise TypeError(f"{name} must be a torch tensor like q (a state from a torch call), got "
                            f"{type(a).__module__}.{type(a).__name__}")
    state_arrays = [a for a in state_arrays if a is not None]
    dev = _check_device([q, k, v] + state_arrays, list(names) + ["state.S", "state.z"], backend)
    grad = _needs_grad([q, k, v] + state_arrays)
    if grad and OP_BACKWARD:
        op_args = _op_call(q, k, v, positions, kwargs)
        if op_args is not None:   # the kernels forward and the backward primitive (torch.ops.rotary.linear_attention)
            try:
                return torch.ops.rotary.linear_attention(*op_args)
            except RuntimeError as exc:   # inside torch.func transforms (grad, vjp, jacrev), which a custom op's
                if "functorch" not in str(exc):   # autograd refuses before it computes: the reference path below
                    raise
    reference = grad or callable(kwargs.get("feature_map", "elu")) or (dev.type == "cpu" and q.dtype == torch.bfloat16)
    if reference:
        if backend not in ("auto", "numpy"):
            raise ValueError(f"backend={backend!r} cannot run this linear_attention call (inputs that require grad "
                             "with a callable feature map, a state, return_state=True or cu_seqlens, or a callable "
                             "feature map, use the differentiable reference path): pass backend='auto' or 'numpy', "
                             "or call under torch.no_grad() with a named feature_map")
        return core(q, k, v, positions, **dict(kwargs, backend="numpy"))
    with _Bridge(dev) as bridge:
        if not bridge.native(q):
            return core(q, k, v, positions, **kwargs)
        args = [bridge.to_core(a) for a in (q, k, v)]
        if state is not None:
            kwargs = dict(kwargs, state=with_arrays(state, bridge.to_core(state.S), bridge.to_core(state.z)))
        result = core(*args, positions, **kwargs)
        if not kwargs.get("return_state", False):
            return bridge.from_core(result, q)
        o, st = result
        like = torch.empty(0, dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)
        return bridge.from_core(o, q), with_arrays(st, bridge.from_core(st.S, like), bridge.from_core(st.z, like))


_eager_under_dynamo()
