"""The carried state of linear attention (:class:`LinearAttentionState`) and the checks that a state
continues a call: same spec, feature map, decay, normalize, GQA groups and shapes."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import numbers
import sys
import warnings

import numpy as np

from ..backends.feature_maps import NAMES
from ..frontend.normalize import namespace
from ..spec.rope_spec import RopeSpec

FEATURE_MAPS = NAMES   # the names linear attention takes (rotary.backends.feature_maps)


class LinearAttentionState:
    """The carried sums of linear attention after some tokens; immutable.

    Attributes
    ----------
    S : array (..., m, dv)
        ``sum_s gamma^(T-1-s) (R_{p_s} phi(k_s)) v_s^T``; ``...`` are k's axes other than the sequence
        and last axes: the state is kept per k/v head (with GQA, H_kv heads, not q's H).
    z : array (..., m) or None
        ``sum_s gamma^(T-1-s) phi(k_s)`` (unrotated); None when ``normalize=False``.
    next_position : int or int64 ndarray (batch,)
        The position the next token gets when a call passes ``positions=None``.
    spec : RopeSpec
    feature_map : str or callable
    decay : float64 ndarray of k's head axes (read-only), or None
        gamma per k/v head, as broadcast by the call that made the state (None: no decay).
    normalize : bool
    groups : int
        q heads per k/v head (1 without GQA).

    S and z are float32 (float64 for float64 inputs; never float16), of the inputs' array type and
    device. A state only continues calls with the same spec, feature map, decay, normalize, groups
    and shapes (ValueError).
    """

    __slots__ = ("S", "z", "next_position", "spec", "feature_map", "decay", "normalize", "groups", "_step")

    def __init__(self, S, z, next_position, *, spec, feature_map="elu", decay=None, normalize=True, groups=1):
        if not isinstance(spec, RopeSpec):
            raise TypeError(f"spec must be a rotary.RopeSpec, got {type(spec).__name__}")
        if not isinstance(normalize, (bool, np.bool_)):
            raise TypeError(f"normalize must be a bool, got {type(normalize).__name__}")
        if isinstance(groups, (bool, np.bool_)) or not isinstance(groups, numbers.Integral) or groups < 1:
            raise ValueError(f"groups must be an integer >= 1 (q heads per k/v head), got {groups!r}")
        check_feature_map(feature_map)
        for name, value in (("S", S), ("z", z)):
            if value is not None and (isinstance(value, (list, tuple)) or not hasattr(value, "shape")
                                      or getattr(value.dtype, "kind", "f") not in "f"):
                raise TypeError(f"state {name} must be a real floating array (NumPy, CuPy, torch, ...), got "
                                f"{type(value).__name__}{' of dtype ' + str(value.dtype) if hasattr(value, 'dtype') else ''}")
        if len(S.shape) < 2:
            raise ValueError(f"state S must be (..., m, dv), got S {tuple(S.shape)}")
        if z is None:
            if normalize:
                raise ValueError("state z is None, which only a normalize=False state may be")
        elif tuple(z.shape) != tuple(S.shape[:-1]):
            raise ValueError(f"state S must be (..., m, dv) and z (..., m); got S {tuple(S.shape)}, z {tuple(z.shape)}")
        if decay is not None:
            decay = np.array(decay, dtype=np.float64, copy=True)
            if decay.shape != tuple(S.shape[:-2]) or not np.all((decay > 0) & (decay <= 1)):
                raise ValueError(f"state decay must be None or values in (0, 1] of shape {tuple(S.shape[:-2])}, "
                                 f"got {decay!r}")
            decay.setflags(write=False)
        if S.shape[-2] != spec.head_dim:
            raise ValueError(f"state S has feature dim {S.shape[-2]}, spec.head_dim is {spec.head_dim}")
        if isinstance(next_position, (bool, np.bool_)):
            raise TypeError("next_position must be an int or an integer array, got a bool")
        if isinstance(next_position, numbers.Integral):
            next_position = int(next_position)
        else:
            next_position = np.array(next_position, copy=True)
            if next_position.dtype.kind not in "iu" or next_position.ndim != 1:
                raise TypeError(f"next_position must be an int or a 1-D integer array, got {next_position!r}")
            next_position = next_position.astype(np.int64)
            next_position.setflags(write=False)
        for name, value in (("S", S), ("z", z), ("next_position", next_position), ("spec", spec),
                            ("feature_map", feature_map), ("decay", decay), ("normalize", bool(normalize)),
                            ("groups", int(groups)), ("_step", None)):
            object.__setattr__(self, name, value)

    @classmethod
    def _trusted(cls, S, z, next_position, spec, feature_map, decay, normalize, groups, step=None):
        """A state from fields the frontend has already checked (decay read-only float64 or None,
        next_position an int or a read-only int64 array): no validation, for the per-token decode path.
        ``step``: the prepared decode step (:class:`_DecodeStep`) the next call may reuse."""
        self = object.__new__(cls)
        for name, value in (("S", S), ("z", z), ("next_position", next_position), ("spec", spec),
                            ("feature_map", feature_map), ("decay", decay), ("normalize", normalize),
                            ("groups", groups), ("_step", step)):
            object.__setattr__(self, name, value)
        return self

    def __setattr__(self, name, value):
        raise AttributeError("LinearAttentionState is immutable")

    def __reduce__(self):
        return (_rebuild_state, (self.S, self.z, self.next_position, self.spec, self.feature_map, self.decay,
                                 self.normalize, self.groups))

    def __repr__(self):
        z = None if self.z is None else tuple(self.z.shape)
        return (f"LinearAttentionState(S{tuple(self.S.shape)} {self.S.dtype}, z={z}, "
                f"next_position={self.next_position!r}, spec={self.spec!r}, feature_map={self.feature_map!r}, "
                f"decay={self.decay!r}, normalize={self.normalize}, groups={self.groups})")


class SavedForBackward:
    """What a causal :func:`rotary.linear_attention` forward kept for its backward (``save_for_backward=True``):
    the backend's states before each chunk (``module``'s own object), read by
    :func:`rotary.attn.linear_backward.linear_attention_backward` (``saved=``) in place of a second sweep over k and
    v. ``inputs`` fingerprints the k and v it was made from (their memory, shapes and strides), the chunk and
    causality: a backward of other arrays or another chunk refuses it. Opaque: nothing here is for reading."""

    __slots__ = ("module", "states", "inputs")

    def __init__(self, module, states, inputs):
        self.module, self.states, self.inputs = module, states, inputs

    def __repr__(self):
        return f"<linear attention states saved for the backward by the {self.module.NAME} backend>"


def saved_fingerprint(k, v, chunk, causal):
    """The fingerprint :class:`SavedForBackward` keeps of k and v (NumPy arrays: memory, shape, strides, dtype),
    the chunk and causality."""
    def one(x):
        return (x.__array_interface__["data"][0], x.shape, x.strides, x.dtype.str) if type(x) is np.ndarray \
            else (id(x), tuple(x.shape))
    return one(k), one(v), int(chunk), bool(causal)


def _rebuild_state(S, z, next_position, spec, feature_map, decay=None, normalize=True, groups=1):
    return LinearAttentionState(S, z, next_position, spec=spec, feature_map=feature_map, decay=decay,
                                normalize=normalize, groups=groups)


def check_feature_map(feature_map):
    if callable(feature_map):
        return
    if not isinstance(feature_map, str) or feature_map not in FEATURE_MAPS:
        raise ValueError(f"feature_map must be one of {FEATURE_MAPS} or a callable, got {feature_map!r}")


def check_state(state, q, spec, feature_map, kv_other, m, dv, decay, normalize, groups):
    if not isinstance(state, LinearAttentionState):
        raise TypeError(f"state must be a rotary.LinearAttentionState or None, got {type(state).__name__}")
    if not (type(q) is type(state.S) is np.ndarray and (state.z is None or type(state.z) is np.ndarray)):
        namespace([q, state.S] + ([state.z] if state.z is not None else []), ["q", "state.S", "state.z"][:2 + (
            state.z is not None)])
    expected = (*kv_other, m, dv)
    if tuple(state.S.shape) != expected:
        raise ValueError(f"state belongs to inputs with S of shape {tuple(state.S.shape)}; this call needs "
                         f"{expected} (k's axes other than seq and last, then m, dv)")
    if state.spec is not spec and state.spec != spec:
        raise ValueError(f"state was made with {state.spec!r}, this call uses {spec!r}")
    if state.feature_map is not feature_map and state.feature_map != feature_map:
        raise ValueError(f"state was made with feature_map={state.feature_map!r}, this call uses {feature_map!r}")
    same_decay = (state.decay is None and decay is None) or (
        state.decay is not None and decay is not None and np.array_equal(state.decay, decay))
    if not same_decay:
        raise ValueError(f"state was made with decay={state.decay!r}, this call uses decay={decay!r}")
    if state.normalize != normalize:
        raise ValueError(f"state was made with normalize={state.normalize}, this call uses normalize={normalize}")
    if state.groups != groups:
        raise ValueError(f"state was made with {state.groups} q heads per k/v head (GQA groups), this call has "
                         f"{groups}")


# -- a JAX pytree as soon as jax is imported -----------------------------------------------------------------
class _Frozen:
    """A hashable, comparable holder of a state's decay (a read-only NumPy array or None) for pytree aux data."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        a, b = self.value, getattr(other, "value", object())
        return isinstance(other, _Frozen) and (a is b or (a is not None and b is not None
                                                          and a.shape == b.shape and np.array_equal(a, b)))

    def __hash__(self):
        return 0 if self.value is None else hash((self.value.shape, self.value.tobytes()))


def register_jax_pytree():
    """:class:`LinearAttentionState` as a JAX pytree (S, z, next_position the leaves; a ``lax.scan`` /
    ``fori_loop`` carry, a jitted function's result). Imports jax; once (a second call does nothing)."""
    import jax

    def flatten(st):
        return (st.S, st.z, st.next_position), (st.spec, st.feature_map, _Frozen(st.decay), st.normalize, st.groups)

    def unflatten(aux, children):
        spec, feature_map, decay, normalize, groups = aux
        return LinearAttentionState._trusted(*children, spec, feature_map, decay.value, normalize, groups)

    try:
        jax.tree_util.register_pytree_node(LinearAttentionState, flatten, unflatten)
    except ValueError:   # registered already
        pass


class AfterImport(importlib.abc.MetaPathFinder):
    """Runs a callback once a module has been imported (its body executed), then leaves sys.meta_path: how
    rotary reacts to a library's import without importing it (this pytree; torch.compile's handlers,
    :mod:`rotary.interop.torch_hook`)."""

    def __init__(self, name, callback):
        self.name, self.callback = name, callback

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module, callback = spec.loader.exec_module, self.callback

        def exec_then_call(module):
            exec_module(module)
            try:
                callback()
            except Exception as exc:   # never break the import of the module itself
                warnings.warn(f"rotary could not register its hook for {fullname}: {exc!r}", stacklevel=2)

        spec.loader.exec_module = exec_then_call
        return spec


def after_import(name, callback):
    """``callback()`` now if module ``name`` is loaded, else right after it is imported (once)."""
    if name in sys.modules:
        callback()
    elif not any(isinstance(f, AfterImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, AfterImport(name, callback))


# the state is a pytree as soon as jax is imported, before or after rotary (import rotary never imports jax)
after_import("jax", register_jax_pytree)
