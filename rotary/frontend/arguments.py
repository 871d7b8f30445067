"""The arguments every entry point shares besides arrays' axes and positions: the array namespace, the spec
(``spec=`` or its keywords) and the backend (``backend=`` and the capability asked for), with the backend's
cos/sin table placement (:func:`table_converter`)."""

from __future__ import annotations

import functools

import numpy as np
from array_api_compat import array_namespace, device as xp_device, is_numpy_array

from .. import backends as _backends
from ..spec.rope_spec import RopeSpec

_SPEC_KEYWORDS = ("base", "layout", "rotary_dim", "scaling", "max_position_embeddings", "rotary_offset")


@functools.lru_cache(maxsize=1)
def _numpy_namespace():
    """``array_namespace`` of plain NumPy arrays (array_api_compat.numpy), resolved once."""
    return array_namespace(np.empty(0))


def _plain_numpy(arrays) -> bool:
    """True when every array is exactly ``np.ndarray`` (no subclass): the frontend's cheap path."""
    for a in arrays:
        if type(a) is not np.ndarray:
            return False
    return True


def namespace(arrays, names):
    if _plain_numpy(arrays):
        return _numpy_namespace()
    for a, name in zip(arrays, names):
        if isinstance(a, (list, tuple)) or np.isscalar(a):
            raise TypeError(f"{name} must be an array (NumPy, CuPy, torch, JAX, array-API), got {type(a).__name__}")
    try:
        return array_namespace(*arrays)
    except TypeError as exc:
        raise TypeError(f"{', '.join(names)} must be arrays of one array library: {exc}") from None


def resolve_spec(spec, spec_kwargs: dict, head_dim: int, name: str = "x") -> RopeSpec:
    """The spec to use: ``spec`` itself (checked against head_dim) or one built from keywords."""
    unknown = spec_kwargs and set(spec_kwargs) - set(_SPEC_KEYWORDS)
    if unknown:
        raise TypeError(f"unexpected keyword argument(s) {sorted(unknown)}; spec keywords are {_SPEC_KEYWORDS}")
    if spec is None:
        return RopeSpec(head_dim, **spec_kwargs)
    if spec_kwargs:
        raise TypeError(f"pass either spec= or the spec keywords {sorted(spec_kwargs)}, not both")
    if not isinstance(spec, RopeSpec):
        raise TypeError(f"spec must be a rotary.RopeSpec, got {type(spec).__name__}")
    if spec.head_dim != head_dim:
        where = (f" (the spec rotates coordinates [{spec.rotary_offset}, {spec.rotary_offset + spec.rotary_dim}) of "
                 f"its head: rotary_offset={spec.rotary_offset})" if spec.rotary_offset else "")
        raise ValueError(f"spec.head_dim ({spec.head_dim}) does not match {name}.shape[-1] ({head_dim}){where}")
    return spec



_ANY_VARIANT = object()


def pick_backend(arrays, backend, capability: str | None = "rotate", variant=_ANY_VARIANT, variant_name="variant"):
    """The backend module for ``backend=`` ("auto" or a name) and these arrays, with ``capability``
    (a primitive such as "rotate" or "linear_attention"; None: whatever the registry picks) and, when given,
    its ``variant`` (e.g. a KV format, named ``variant_name`` in errors: the backend's ``VARIANTS``). "auto"
    falls back to the NumPy reference when the backend it picks lacks the capability or variant; a named
    backend without it is NotImplementedError."""
    module = _backends.pick(arrays, backend)
    if capability is None or _backends.supports(module, capability, variant, any_variant=variant is _ANY_VARIANT):
        return module
    if backend == "auto":
        return _backends.get("numpy")
    what = capability if variant is _ANY_VARIANT else f"{capability} for {variant_name}={variant!r}"
    raise NotImplementedError(f"backend {backend!r} has no {what}; use backend='numpy' or 'auto'")


def table_converter(module, x, xp):
    """(device_key, convert) for the cos/sin tables of ``module`` and input ``x`` (see ``spec.tables.lookup``):
    the backend's own ``table_converter`` capability, host tables for NumPy, else the array's namespace."""
    if hasattr(module, "table_converter"):
        return module.table_converter(x)
    if type(x) is np.ndarray or is_numpy_array(x):
        return "numpy", None
    dev = xp_device(x)
    # device key None: host tables are cached, converted per call (a JAX trace's arrays never enter the cache)
    return None, (lambda a: xp.asarray(np.array(a), device=dev))
