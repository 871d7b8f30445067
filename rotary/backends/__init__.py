"""Backend registry: name -> lazily imported module, with availability and a reason.

Every backend module implements the same primitives on *canonical views* made by the frontend.
They never compute frequencies: they receive cos/sin tables (from ``rotary.spec.tables``) and rows.

``rotate(items, cos, sin, rows, *, rotary_dim, layout, inverse, out_layout=None) -> list``
    items: sequence of ``(x, out)``. ``x`` is a 4-D array ``(B, S, H, D)`` of the backend's array
    type with arbitrary strides (B = batch-like axes merged, S = sequence, H = head-like axes
    merged, D = head_dim). ``out`` is None (allocate) or an array of the same shape and dtype,
    possibly ``x`` itself (in place). q and k of one call come as two items with the same B and S
    and possibly different H (GQA); a backend should process them in one pass/launch.
    cos, sin: ``(R, rotary_dim // 2)`` float32 (float64 when x is float64), attention scaling
    already multiplied in. rows: ``(Bp, S)`` int64 with Bp in {1, B}; token (b, s) uses table row
    ``rows[b if Bp > 1 else 0, s]``. Pair i of layout "half" is (i, i + rotary_dim/2), of layout
    "interleaved" (2i, 2i+1); ``y_a = x_a c - x_b s``, ``y_b = x_b c + x_a s`` with s negated when
    ``inverse``. Pairs are read in ``layout`` and written in ``out_layout`` (None: ``layout``): with the
    other layout, y_a and y_b of pair i go to the output coordinates of pair i in ``out_layout`` (the
    frontend's ``out_pairs``; DeepSeek's interleaved-to-half rotation), and no out is its x (the frontend
    never passes one; a backend may refuse it). The frontend passes ``out_layout`` only when it differs
    from ``layout``. Coordinates >= rotary_dim are copied unchanged. fp16/bf16 are computed in fp32.
    Returns the output arrays in item order.

``linear_attention(q, k, v, cos, sin, rows, *, rotary_dim, layout, causal, feature_map, eps, chunk, state,
decay=None, normalize=True[, cu_seqlens=None])``
    -> ``(o, (S, z))``; see ``rotary.attn.linear`` for the semantics. q is ``(B, S, H, m)``,
    k ``(B, S, Hk, m)`` and v ``(B, S, Hk, dv)`` with H a multiple G of Hk (GQA): q head h reads
    k/v head h // G. ``state`` is None or ``(S, z)`` with S ``(B, Hk, m, dv)`` and z ``(B, Hk, m)``
    or None (zeros), per k/v head, in the work dtype; it is read-only: a backend returns a new state
    and never writes into the old one. ``decay``: None or a float64 NumPy ``(B, Hk)`` of gammas in
    (0, 1] (host memory; all ones unless causal). ``normalize=False``: o is the numerator alone.
    A module with ``PACKED_LINEAR_ATTENTION = True`` also takes ``cu_seqlens`` (host int64 ``(N + 1,)``
    offsets; q, k, v of batch 1, rows ``(1, T)``): a packed batch of N sequences in one call, sequence n
    its tokens ``cu_seqlens[n]:cu_seqlens[n + 1]`` with state and decay row n (state ``(N, Hk, ...)``).

``linear_attention_backward(q, k, v, cos, sin, rows, grad_o, *, rotary_dim, layout, causal, feature_map, eps, chunk,
state, decay=None, normalize=True, grad_state=None)`` -> ``(dq, dk, dv, dstate)``
    The vector-Jacobian product of ``linear_attention`` (same arguments and conventions, no ``cu_seqlens``):
    ``grad_o`` ``(B, S, H, dv)`` is dL/do, ``grad_state`` None or ``(G_S, G_z)`` (either None: zeros) is dL/d
    of the returned state ``(S, z)`` (training over chunks with a carried state). Returns dq, dk, dv in q's,
    k's, v's dtypes (gradients through the feature map; k's and v's summed over the G q heads of their GQA
    group) and ``dstate = (dS, dz)`` ``(B, Hk, m, dv)``, ``(B, Hk, m)`` in the work dtype, the gradient at the
    state passed in (dz also when its z was None), or None when ``state`` is None. Inputs are read-only.
    Formulas: :mod:`rotary.backends.numpy_linear_backward` (the NumPy reference, any array-API namespace).
    A backend without it: the frontend (:func:`rotary.attn.linear_backward.linear_attention_backward`) takes
    the reference under backend="auto".

``append_kv(k, v, cos, sin, rows, slots, stores, *, rotary_dim, layout, offset, kv_dtype, norm=None)``
    KV append (:func:`rotary.kv_append`, :class:`rotary.KVCache`): k ``(T, Hk, D)`` and v ``(T, Hk, D)`` (any
    strides, one float dtype) are T tokens; token t's key is rotated with table row ``rows[t]`` (cos/sin as for
    ``rotate``, pairs in ``[offset, offset + rotary_dim)``, the other coordinates unrotated) and written with its
    value into slot ``slots[t]`` of ``stores = (k_entries, v_entries, k_scales, v_scales)``: entries ``(P, Hk, D)``
    C-contiguous, scales ``(P, Hk)`` in the work dtype or None. ``slots[t] < 0`` marks a padding token: nothing
    of it is read or written (vLLM's -1); the other slots are distinct and ``< P`` (the frontend checked them).
    ``kv_dtype`` names the entries' format in :data:`rotary.backends.kv_entries.KV_FORMATS` (passed explicitly,
    never inferred from a storage dtype): None, the entries are k's dtype (one rounding of the work-dtype
    rotation); "int8" / "float8_e4m3", quantized per (token, head) (float8 stored as uint8 bits). rows and slots
    are int64 arrays of the backend's array type. ``norm = (weight, eps)`` (None: none): each key head x is first
    normed in the work dtype, ``y_j = (x_j * inv) * weight_j`` with ``inv = 1 / sqrt(sum_j x_j^2 / D + eps)`` (the
    per-head RMSNorm of Qwen3 / Gemma 3 before RoPE; weight a ``(D,)`` C-contiguous work-dtype array of the
    backend's type, eps a float >= 0), then rotated; values are never normed.
    :func:`rotary.backends.kv_entries.append_kv` is the reference
    (any array-API namespace) and the NumPy backend's primitive. A module offers the formats listed in its
    ``VARIANTS["append_kv"]``.

``paged_attention(q, stores, block_table, page_size, seq_lens, q_starts, *, scale, softcap, window, causal, kv_dtype, rotation=None, norm=None) -> o``
    Softmax attention over pages where they lie (:func:`rotary.paged_attention`, ``attention(q, cache)``): q
    ``(T, Hq, D)`` C-contiguous, Hq a multiple G of Hk (q head h reads k/v head h // G), rotated as it is read when
    ``rotation = (cos, sin, rows, rotary_dim, layout, offset)`` is given (row r at table row ``rows[r]``, rows a
    ``(T,)`` int64 array of the backend's type, pairs as ``append_kv`` rotates a key, in the work dtype and not
    rounded to q's dtype: FlashInfer's fused RoPE), taken as rotated when None; each q row normed first (in the work
    dtype, before the rotation and the scale) when ``norm = (weight, eps)`` is given, as ``append_kv`` norms a key;
    ``stores`` as
    for ``append_kv`` (the entries of format ``kv_dtype``, dequantized as ``append_kv`` quantized them);
    ``block_table`` ``(n, W)``, ``seq_lens`` ``(n,)`` and ``q_starts`` ``(n + 1,)`` int64 arrays of the
    backend's array type (host NumPy for CPU backends). Sequence i holds keys ``0 .. seq_lens[i] - 1``, key p in
    slot ``block_table[i, p // page_size] * page_size + p % page_size``; its queries are q's rows
    ``q_starts[i] .. q_starts[i + 1] - 1`` (``c_i`` of them, ``c_i <= seq_lens[i]``), query j at position
    ``seq_lens[i] - c_i + j``, seeing keys ``p <= pos`` and ``pos - p < window`` with ``causal`` (every key
    without; with a window, keys before a query's window are never read, and pages wholly before the first
    query's window may be -1 in the table: an engine gave them back). Scores ``cap(scale <q, k>)`` with
    ``cap(x) = softcap tanh(x / softcap)`` (softcap None: none),
    window None: none. A dense decode step is ``q_starts = arange(n + 1) * s``. A query that sees no key gets
    0. Returns o ``(T, Hq, D)`` in q's dtype. The frontend checked shapes, dtypes, q_starts and, for host
    tables, that every page read is in the pool; kernels check nothing. A module offers the formats in its
    ``VARIANTS["paged_attention"]``; :func:`rotary.backends.kv_entries.paged_attention` (keys gathered
    through the table, the online-softmax engine) is the NumPy backend's and the reference.

Capabilities a backend may add (the frontend asks ``hasattr(module, name)``, never for a backend by name):

``prepare_rotation(views, out_views, *, seq_len, rotary_dim, layout, inverse, offset, dtype, table[, out_layout]) -> prepared or None``
    A rotation prepared for one geometry (``rotary.Rope``'s decode path): ``views`` are canonical views
    of the inputs from ``offset`` on, ``out_views`` those of outputs like the ones a call makes (the view
    itself: in place). ``prepared.run(xs, outs, rows, start, table)`` rotates C-contiguous ``xs`` into
    new arrays (``outs[i] is None``), into separate C-contiguous outs, or in place (``outs[i] is xs[i]``), token (b, s) at position
    ``rows[b or 0, s] + start``, with ``table = (base, end, cos, sin, on_device)`` holding positions
    ``base .. end-1`` in rows 0.. (``on_device(to_device)`` gives the cos/sin on a device, cached). It
    returns the outputs; :data:`OUTSIDE_TABLE` when a position falls outside the table and nothing was
    written (the caller grows the table and runs again); None when it cannot take the call (the caller
    takes the general path). ``out_layout`` (passed only when it differs from ``layout``): the outputs' pair
    layout, as for ``rotate``; a backend that cannot write it returns None from ``prepare_rotation`` (the
    general path takes those calls). ``prepared.device_rows``: True when ``rows`` may be a device int64 array
    (used as table rows as they are, not range-checked). ``empty(shape, dtype)`` allocates outputs.
``prepare_append_kv(k, v, cos, sin, rows, slots, *, rotary_dim, layout, offset, kv_dtype) -> run``
``prepare_paged_attention(q, block_table, page_size, seq_lens, q_starts, *, scale, softcap, window, causal, kv_dtype, rotation=None) -> run``
    The KV primitives prepared once for the layers of a step (:class:`rotary.KVCache`): ``run(k, v, stores,
    norm=None)`` appends k and v shaped and strided as the given ones, ``run(q, stores, norm=None) -> o`` attends q
    shaped as the given one, into / over any stores of the same format (each layer's, with each layer's norm
    weights); the other arguments are fixed. A backend without
    them is called through its ``append_kv`` / ``paged_attention`` with the same arguments. An append's run may
    have ``run.moved(cos, sin, rows, slots) -> run or None``: the same append at other rows and slots (host int64,
    its tokens' shape) of the same cos/sin tables (identical objects), for a decode chain's next step; None when it
    cannot (the caller prepares anew). A run reads its rows and slots when it runs: given the very arrays it reads
    (which their caller rewrote in place), ``moved`` may return the run itself.
``LINEAR_CHUNK_STATES = True``
    A causal ``linear_attention`` call without ``cu_seqlens`` takes ``keep_chunk_states=True`` and returns
    ``(o, state, chunk_states)``: the states before each chunk as it carried them (an object of the backend's own,
    None for an empty call), which its ``linear_attention_backward(..., chunk_states=)`` of the same inputs, chunk,
    state and decay reads in place of sweeping k and v again (raising ValueError for another call's shapes or
    chunk). The frontend wraps them in :class:`rotary.attn.linear_state.SavedForBackward`.
``prepare_stores(stores, kv_dtype) -> prepared``
    Stores made ready once for the prepared runs above (e.g. flattened), which then take ``prepared`` in place of
    ``stores``; its owner (a cache's layer) keeps it as long as the stores (a backend keeps no such memo itself).
``table_converter(x) -> (device_key, convert)``
    Where the backend's cos/sin tables live (device tables cached per device key).
``VARIANTS``: ``{capability: tuple of variants}`` for capabilities that come in variants (the KV formats of
``append_kv`` and ``paged_attention``); :func:`supports` reads it. A backend module also has ``NAME``,
``accepts(x) -> bool`` (can it take this array type?) and may
raise ImportError at import when its dependency is missing (the registry turns that into the
"what to install" message).
"""

from __future__ import annotations

import importlib
import threading

import numpy as np

_MODULES = {
    "numpy": "rotary.backends.numpy",
    "numba": "rotary.backends.numba",
    "cupy": "rotary.backends.cupy",
}
_INSTALL = {
    "numpy": "numpy is a core dependency; reinstall rotary",
    "numba": "pip install 'rotary[numba]'",
    "cupy": "pip install 'rotary[cuda12]' or 'rotary[cuda13]' (CuPy) and use a machine with a CUDA GPU",
}
#: Where each backend's arrays live ("cpu": host memory, "cuda": a CUDA device), for adapters that
#: check a tensor's device before a call (see :func:`device_of`).
_DEVICES = {"numpy": "cpu", "numba": "cpu", "cupy": "cuda"}
#: What a prepared rotation's ``run`` returns when a position falls outside its table (nothing written).
OUTSIDE_TABLE = "outside the table"

#: Order in which backend="auto" tries backends for a given input.
AUTO_ORDER = ("cupy", "numba", "numpy")

_lock = threading.Lock()
_loaded: dict = {}
_errors: dict = {}


class BackendUnavailableError(ImportError):
    """Raised when a requested backend cannot be used here; the message says what to install."""


def names() -> tuple[str, ...]:
    return tuple(_MODULES)


def _load(name: str):
    module = _loaded.get(name)   # the common case, without the lock (entries are only added under it)
    if module is not None or name in _errors:
        return module
    with _lock:
        if name in _loaded:
            return _loaded[name]
        if name in _errors:
            return None
        try:
            module = importlib.import_module(_MODULES[name])
            ok, reason = module.availability()
        except ImportError as exc:
            ok, reason, module = False, f"{exc}", None
        except Exception as exc:  # a broken install must not break the other backends
            ok, reason, module = False, f"{type(exc).__name__}: {exc}", None
        if ok:
            _loaded[name] = module
            return module
        _errors[name] = reason
        return None


def get(name: str):
    """The backend module called ``name``; BackendUnavailableError says why not and what to install."""
    if name not in _MODULES:
        raise ValueError(f"backend must be 'auto' or one of {', '.join(_MODULES)}; got {name!r}")
    module = _load(name)
    if module is None:
        raise BackendUnavailableError(
            f"backend {name!r} is not available here: {_errors[name]}. To use it: {_INSTALL[name]}")
    return module


def loaded(name: str):
    """The module of backend ``name`` if the registry has loaded it, else None (never imports): a cached
    plan holding a module checks it is still the registry's (tests replace and reset backends)."""
    return _loaded.get(name)


def device_of(name: str) -> str | None:
    """Where backend ``name`` runs: "cpu" or "cuda"; None for "auto" (or a name the registry does not know,
    which :func:`get` refuses). Answered without importing the backend."""
    return _DEVICES.get(name)


def available_backends() -> dict[str, tuple[bool, str]]:
    """``{name: (available, reason)}`` for every backend (imports each one to find out)."""
    result = {}
    for name in _MODULES:
        module = _load(name)
        result[name] = (True, "ok") if module is not None else (False, f"{_errors[name]}; to use it: {_INSTALL[name]}")
    return result


def pick(arrays, name: str):
    """Resolve ``backend=name`` ("auto" or a name) for these input arrays; checks the backend accepts them."""
    if name == "auto":
        for candidate in AUTO_ORDER:
            module = _load(candidate)
            if module is not None and all(module.accepts(a) for a in arrays):
                return module
        raise TypeError(f"no backend accepts arrays of type {type(arrays[0]).__module__}.{type(arrays[0]).__name__}")
    if not isinstance(name, str):
        raise TypeError(f"backend must be a string, got {type(name).__name__}")
    module = get(name)
    for a in arrays:
        if not module.accepts(a):
            dtype = getattr(a, "dtype", None)
            what = f"{type(a).__module__}.{type(a).__name__}"
            if isinstance(dtype, np.dtype):
                order = {">": ", big-endian", "<": ", little-endian"}.get(dtype.byteorder, "")
                what += f" of dtype {dtype.str} ({dtype.name}{order})"
            raise TypeError(f"backend {name!r} does not take {what}; use backend='auto' or convert the array "
                            "(native byte order float16/float32/float64: x.astype(x.dtype.newbyteorder('='))")
    return module


def supports(module, capability: str, variant=None, *, any_variant: bool = True) -> bool:
    """Whether backend ``module`` has ``capability`` (a primitive's name), and with ``any_variant=False`` the
    ``variant`` of it (e.g. a KV format: ``supports(m, "append_kv", "int8", any_variant=False)``) as listed in
    its ``VARIANTS``; a capability without a VARIANTS entry has the one variant None."""
    if not hasattr(module, capability):
        return False
    return any_variant or variant in getattr(module, "VARIANTS", {}).get(capability, (None,))


def _reset_for_tests() -> None:
    with _lock:
        _loaded.clear()
        _errors.clear()
