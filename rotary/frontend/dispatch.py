"""Dispatch of torch tensors, JAX arrays and Dask arrays to their adapters.

``rotary.interop.torch_adapter``, ``rotary.interop.jax_adapter``, ``rotary.interop.dask_adapter`` and ``rotary.interop.bf16_adapter`` (ml_dtypes bfloat16) each turn their library's arrays into what the
backend primitives take (NumPy/CuPy views, host tables) and back. The frontend functions are wrapped
once (:func:`dispatch`): plain NumPy/CuPy calls pay one type check; an adapter receives the wrapped
function itself (``core``) and every keyword unchanged, so keywords added to the frontend pass through.
No adapter imports its library before an array of that library arrives.
"""

from __future__ import annotations

import functools
import importlib

import numpy as np

from .axes import take_tensor_layout

_MODULES = {"torch": "rotary.interop.torch_adapter", "jax": "rotary.interop.jax_adapter", "jaxlib": "rotary.interop.jax_adapter", "dask": "rotary.interop.dask_adapter",
            "bfloat16": "rotary.interop.bf16_adapter"}


def library(a) -> str | None:
    """'torch', 'jax' or 'dask' for an array of that library (tracers included), 'bfloat16' for an
    ``ml_dtypes.bfloat16`` NumPy array, else None."""
    if a is None:
        return None
    if isinstance(a, np.ndarray):
        dtype = a.dtype   # (kind first: dtype.name is a slow property)
        return "bfloat16" if dtype.kind == "V" and dtype.name == "bfloat16" else None
    root = type(a).__module__.partition(".")[0]
    if root in _MODULES:
        return "jax" if root == "jaxlib" else root
    return None


def adapter_for(arrays):
    """The adapter module for these arrays, or None (NumPy, CuPy, array-API namespaces: the core).

    A Dask array anywhere wins (its blocks go back through the frontend); otherwise the first torch or
    JAX array decides, and mixing libraries is left to the frontend's namespace check."""
    found = None
    for a in arrays:
        name = library(a)
        if name == "dask":
            found = name
            break
        if name is not None and found is None:
            found = name
    return None if found is None else importlib.import_module(_MODULES[found])


def dispatch(kind: str, n_arrays: int):
    """Decorator for a frontend function whose first ``n_arrays`` positional arguments are arrays (or,
    for ``kind="rotate"``, whose first argument is the list of arrays): calls are handed to
    ``adapter.<kind>(core, *args, **kwargs)`` when an adapter takes the arrays and has that function (else
    ``core`` runs: e.g. torch tensors in ``attention``, which the core computes through the dispatched
    rotations)."""

    def wrap(core):
        @functools.wraps(core)
        def frontend(*args, **kwargs):
            if "layout" in kwargs:   # a tensor layout ("bshd") names the sequence axis, for the adapters too
                kwargs["seq_axis"], rest = take_tensor_layout(kwargs.get("seq_axis"), {"layout": kwargs["layout"]})
                if not rest:
                    del kwargs["layout"]
            arrays = args[0] if kind == "rotate" else args[:n_arrays]
            first = arrays[0]
            if type(first) is np.ndarray and first.dtype.kind == "f" and (
                    len(arrays) == 1 or all(type(a) is np.ndarray and a.dtype.kind == "f" for a in arrays)):
                return core(*args, **kwargs)   # the common case: plain NumPy floats (no bfloat16 among them)
            run = getattr(adapter_for(arrays), kind, None)   # an adapter without this kind: the core takes them
            if run is None:
                return core(*args, **kwargs)
            return run(core, *args, **kwargs)

        frontend.core = core
        return frontend

    return wrap


def with_arrays(state, S, z):
    """A linear-attention ``state`` with its arrays S and z replaced (every other field kept, whatever
    fields the state has)."""
    rebuild, args = state.__reduce__()
    return rebuild(S, z, *args[2:])
