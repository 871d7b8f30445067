"""The one normaliser of the frontend: axes, positions, canonical views, out buffers and the backend.

Every entry point (``apply``, ``apply_qk``, ``Rope``, ``attention``, ``linear_attention``,
``rerotate``) calls these, so each input form is parsed in one place:

- axes: ``seq_axis`` -> the canonical 4-D view ``(B, S, H, D)`` (B = the axes before the sequence
  axis, merged; H = the axes between the sequence axis and the last, merged; no copy when the strides
  allow it);
- positions: None / int offset / (S,) / (batch, S) / multi-axis (S, n) or (batch, S, n) / packed
  (cu_seqlens) / continuing a linear-attention state -> an int64 (or float64) host array ``(Bp, S[, n])``
  with Bp in {1, B}; :func:`prepared_rows` is the same parse for a prepared call's common forms;
- out buffers: shape, dtype, device and overlap rules;
- the backend: ``backend=`` and the arrays -> a backend module that has the capability asked for.
"""

from __future__ import annotations

import functools
import math
import numbers
import operator

import numpy as np
from array_api_compat import (array_namespace, device as xp_device, is_cupy_array, is_jax_array,
                              is_numpy_array)

_INT64_MAX = 2**63 - 1

from .. import backends as _backends
from ..spec import packing as _packing
from ..spec.rope_spec import RopeSpec
from ..spec.validators import check_float, to_numpy  # noqa: F401  (part of the normaliser's vocabulary)

_SPEC_KEYWORDS = ("base", "layout", "rotary_dim", "scaling", "max_position_embeddings", "rotary_offset")


# -- arrays and the spec ----------------------------------------------------------------------------
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


def normalize_seq_axis(seq_axis, ndim: int, name: str = "x") -> int:
    if isinstance(seq_axis, bool):
        raise TypeError("seq_axis must be an integer, got bool")
    try:
        seq_axis = operator.index(seq_axis)
    except TypeError:
        raise TypeError(f"seq_axis must be an integer, got {type(seq_axis).__name__}") from None
    if ndim < 2:
        raise ValueError(f"{name} must have at least 2 dimensions (..., seq, dim), got shape with ndim={ndim}")
    if not -ndim <= seq_axis < ndim or seq_axis % ndim == ndim - 1:
        raise ValueError(f"seq_axis must name an axis of {name} (ndim={ndim}) other than the last (head_dim) axis: "
                         f"one of {list(range(ndim - 1))} or {list(range(-ndim, -1))}, got {seq_axis}")
    return seq_axis % ndim


def normalize_positions(positions, lead_shape: tuple, seq_len: int, name: str = "positions",
                        canonical_batch: int | None = None, spec: RopeSpec | None = None) -> np.ndarray:
    """int64 array (Bp, S), Bp in {1, canonical_batch}; (Bp, S, n_axes) for a multi-axis ``spec``
    (float64 for a spec with ``float_positions``).

    None -> 0..S-1; an integer -> offset + 0..S-1; an integer array of shape (S,) or (batch, S)
    with batch = lead_shape[0]. A multi-axis spec takes (S, n_axes) or (batch, S, n_axes), and None
    or an integer for M-RoPE only (text tokens: the same position on every axis). ``canonical_batch``
    (default lead_shape[0]) is the B of the canonical view (see :func:`canonical_axes`); rows are
    repeated when it merges more axes.
    """
    n_axes = spec.n_axes if spec is not None and spec.multi_axis else 0
    float_ok = spec is not None and spec.float_positions
    if n_axes and (positions is None or isinstance(positions, (int, np.integer))) and spec.mrope_section is None:
        raise ValueError(f"{name} must give the {n_axes} coordinates of every token for this multi-axis spec: an "
                         f"array of shape ({seq_len}, {n_axes}) or (batch, {seq_len}, {n_axes}) (e.g. "
                         "rotary.grid_positions(h, w)); only M-RoPE specs take None or an offset (text positions)")
    if positions is None:
        return spread_positions(np.arange(seq_len, dtype=np.int64)[None, :], n_axes)
    if isinstance(positions, bool) or (isinstance(positions, np.ndarray) and positions.dtype == bool):
        raise TypeError(f"{name} must be None, an integer offset or an integer array, got a bool")
    if isinstance(positions, (int, np.integer)):
        return spread_positions(offset_positions(positions, seq_len, name)[None, :], n_axes)
    if isinstance(positions, float):
        raise TypeError(f"{name} must be None, an integer offset or an integer array, got float {positions!r}")
    p = to_numpy(positions, name)
    if p.size == 0 and p.dtype.kind not in "iu" and not (float_ok and p.dtype.kind == "f"):
        p = p.astype(np.int64)   # an empty list ([] is float64 to NumPy): no values, so no wrong dtype
    if p.dtype.kind not in ("iuf" if float_ok else "iu"):
        if p.dtype.kind == "f":
            raise TypeError(f"{name} must have an integer dtype, got {p.dtype} (real-valued coordinates need a spec "
                            "with float_positions=True)")
        raise TypeError(f"{name} must have an integer dtype, got {p.dtype}")
    if p.dtype.kind == "f":
        p = p.astype(np.float64, copy=False)
        if not np.all(np.isfinite(p)):
            raise ValueError(f"{name} must be finite")
    else:
        if p.dtype == np.uint64 and p.size and p.max() > np.iinfo(np.int64).max:
            raise ValueError(f"{name} does not fit in int64")
        p = p.astype(np.int64, copy=False)
    if n_axes:
        if p.ndim == 0 or p.shape[-1] != n_axes:
            raise ValueError(f"{name} of shape {p.shape} must carry the spec's {n_axes} coordinates on a trailing "
                             f"axis: ({seq_len}, {n_axes}) or (batch, {seq_len}, {n_axes}) (HF's multi-axis "
                             f"position_ids ({n_axes}, batch, seq) become np.moveaxis(position_ids, 0, -1); 1-D ids, "
                             "which HF's text models expand to every axis, become "
                             f"np.repeat(ids[..., None], {n_axes}, axis=-1))")
        core = p.shape[:-1]
    else:
        core = p.shape
        if spec is not None and p.ndim >= 1 and p.shape[-1] != seq_len and p.ndim <= 3 and p.shape[-1] in (2, 3):
            raise ValueError(f"{name} of shape {p.shape} look like multi-axis coordinates, but this spec is 1-D "
                             f"(one position per token): pass shape ({seq_len},) or (batch, {seq_len}), or a "
                             "multi-axis spec (mrope_section=, RopeSpec.axial)")
    if len(core) == 0:
        if n_axes:
            raise ValueError(f"{name} of shape {p.shape} needs a sequence axis: ({seq_len}, {n_axes})")
        return offset_positions(p[()], seq_len, name)[None, :]
    tail = (n_axes,) if n_axes else ()
    if len(core) == 1:
        if core[0] != seq_len:
            raise ValueError(f"{name} of shape {p.shape} does not match the sequence length {seq_len} "
                             f"(expected shape {(seq_len, *tail)} or "
                             f"({lead_shape[0] if lead_shape else 'batch'}, {seq_len}{', ' + str(n_axes) if n_axes else ''}))")
        return np.ascontiguousarray(p[None])
    if len(core) == 2:
        if not lead_shape:
            raise ValueError(f"{name} of shape {p.shape} has a batch axis but the input has no batch axis before the "
                             f"sequence axis; pass shape {(seq_len, *tail)}")
        if core != (lead_shape[0], seq_len):
            raise ValueError(f"{name} of shape {p.shape} must be {(seq_len, *tail)} or (batch, seq{', n_axes' if n_axes else ''}) "
                             f"= {(lead_shape[0], seq_len, *tail)}; positions are never broadcast onto other axes")
        rep = (canonical_batch or lead_shape[0]) // lead_shape[0] if lead_shape[0] else 1
        if rep > 1:
            p = np.repeat(p, rep, axis=0)
        return np.ascontiguousarray(p)
    raise ValueError(f"{name} must be None, an integer, or an array of shape {(seq_len, *tail)} or "
                     f"(batch, {seq_len}{', ' + str(n_axes) if n_axes else ''}); got shape {p.shape}")


_INT64 = np.iinfo(np.int64)


def offset_positions(offset, seq_len: int, name: str = "positions") -> np.ndarray:
    """int64 ``offset + 0..seq_len-1``; ValueError when a position falls outside int64 (never wraps)."""
    offset = int(offset)
    last = offset + max(seq_len - 1, 0)
    if offset < _INT64.min or last > _INT64.max:
        raise ValueError(f"{name}: offset {offset} with {seq_len} tokens gives positions {offset}..{last}, outside "
                         f"int64 [{_INT64.min}, {_INT64.max}] (angles are exact below 2**53)")
    return np.arange(seq_len, dtype=np.int64) + np.int64(offset)


def spread_positions(p: np.ndarray, n_axes: int) -> np.ndarray:
    """(Bp, S) text positions -> (Bp, S, n_axes) with the same value on every axis (n_axes > 0)."""
    if not n_axes:
        return p
    return np.ascontiguousarray(np.broadcast_to(p[..., None], p.shape + (n_axes,)))


# -- canonical views -----------------------------------------------------------------------------
def _merge(shape, strides):
    """(size, stride) of a run of axes merged into one, or None if the strides do not allow a view."""
    dims = [(n, s) for n, s in zip(shape, strides) if n != 1]
    size = math.prod(shape)
    if not dims:
        return size, 0
    for (n0, s0), (n1, s1) in zip(dims, dims[1:]):
        if s0 != s1 * n1:
            return None
    return size, dims[-1][1]


def canonical_axes(ndim: int, seq_axis: int):
    """(batch_axes, head_axes) of the canonical (B, S, H, D) view.

    B is axis 0 (when the sequence axis is not axis 0) and H merges every other axis except the
    sequence and the last one: BSHD -> (B, S, H, D), BHSD -> (B, S, H, D) as a transposed view.
    Only when axes lie both between axis 0 and the sequence axis and after it (e.g. (B, G, S, H, D))
    do all leading axes go to B.
    """
    batch, heads, _, _ = canonical_layout(ndim, seq_axis)
    return list(batch), list(heads)


@functools.lru_cache(maxsize=256)
def canonical_layout(ndim: int, seq_axis: int):
    """(batch axes, head axes, perm to (B, S, H, D) order, that perm or None when no axes merge).

    The last entry is the transposition that *is* the canonical view when B and H are one axis each
    (4-D BSHD: the identity; 4-D BHSD: (0, 2, 1, 3)); then views need no stride arithmetic.
    """
    lead, mid = tuple(range(seq_axis)), tuple(range(seq_axis + 1, ndim - 1))
    if len(lead) > 1 and mid:
        batch, heads = lead, mid
    else:
        batch, heads = lead[:1], lead[1:] + mid
    perm = batch + (seq_axis,) + heads + (ndim - 1,)
    return batch, heads, perm, (perm if len(batch) == 1 and len(heads) == 1 else None)


def canonical_shape(shape, seq_axis):
    batch, heads, _, _ = canonical_layout(len(shape), seq_axis)
    return (math.prod(shape[i] for i in batch), shape[seq_axis], math.prod(shape[i] for i in heads), shape[-1])


def _canonical_perm(ndim, seq_axis):
    return list(canonical_layout(ndim, seq_axis)[2])


def canonical_view(x, seq_axis):
    """A no-copy (B, S, H, D) view of a NumPy/CuPy array, or None if its strides do not allow one."""
    shape, strides = x.shape, x.strides
    batch, heads, perm, plain = canonical_layout(len(shape), seq_axis)
    if plain is not None:   # one batch axis, one head axis: a transposition (or x itself)
        return x if plain == tuple(range(len(shape))) else x.transpose(plain)
    b = _merge([shape[i] for i in batch], [strides[i] for i in batch])
    h = _merge([shape[i] for i in heads], [strides[i] for i in heads])
    if b is None or h is None:
        return None
    new_shape = (b[0], shape[seq_axis], h[0], shape[-1])
    new_strides = (b[1], strides[seq_axis], h[1], strides[-1])
    if is_numpy_array(x):
        return np.lib.stride_tricks.as_strided(x, new_shape, new_strides, writeable=x.flags.writeable)
    import cupy  # only reached for CuPy arrays

    return cupy.lib.stride_tricks.as_strided(x, new_shape, new_strides)


def to_canonical(x, seq_axis, xp):
    """(B, S, H, D) array for any namespace: a view when possible (NumPy/CuPy), else a copy."""
    perm = _canonical_perm(x.ndim, seq_axis)
    return xp.reshape(xp.permute_dims(x, tuple(perm)), canonical_shape(tuple(x.shape), seq_axis))


def canonical(x, ax, xp):
    """The (B, S, H, D) view of x (NumPy/CuPy: no copy when the strides allow one)."""
    if is_numpy_array(x) or is_cupy_array(x):
        view = canonical_view(x, ax)
        return view if view is not None else to_canonical(x.copy(), ax, xp)
    return to_canonical(x, ax, xp)


def from_canonical(y, shape, seq_axis, xp):
    """Inverse of :func:`to_canonical` for a (B, S, H, D) result: an array of ``shape``."""
    _, _, perm, plain = canonical_layout(len(shape), seq_axis)
    if plain is not None and type(y) is np.ndarray:
        return y if plain == tuple(range(len(shape))) else y.transpose(_inverse_perm(plain))
    y = xp.reshape(y, tuple(shape[i] for i in perm))
    return xp.permute_dims(y, tuple(int(i) for i in np.argsort(perm)))


@functools.lru_cache(maxsize=64)
def _inverse_perm(perm):
    return tuple(int(i) for i in np.argsort(perm))


def same_view(a, b) -> bool:
    if a is b:
        return True
    if type(a) is np.ndarray and type(b) is np.ndarray:   # cheap tests first (__array_interface__ is slow)
        if a.shape != b.shape or a.strides != b.strides or not np.may_share_memory(a, b):
            return False
    try:
        if is_numpy_array(a):
            ptr = a.__array_interface__["data"][0], b.__array_interface__["data"][0]
        else:
            ptr = a.data.ptr, b.data.ptr
        return ptr[0] == ptr[1] and a.shape == b.shape and a.strides == b.strides
    except Exception:
        return False


def check_out(out, x, xp, name="out", xname="x"):
    """Validate an ``out=`` array for input ``x``."""
    if out is None:
        return
    if not (type(out) is np.ndarray and type(x) is np.ndarray):
        try:
            out_xp = array_namespace(out)
        except TypeError:
            raise TypeError(f"{name} must be an array like {xname}, got {type(out).__name__}") from None
        if out_xp is not xp and type(out) is not type(x):
            raise TypeError(f"{name} must be the same array type as {xname} ({type(x).__name__}), "
                            f"got {type(out).__name__}")
        if is_jax_array(out):
            raise TypeError(f"{name}= is not supported for JAX arrays (they are immutable); use the return value")
    if tuple(out.shape) != tuple(x.shape):
        raise ValueError(f"{name} must have {xname}'s shape {tuple(x.shape)}, got {tuple(out.shape)}")
    if out.dtype != x.dtype:
        raise ValueError(f"{name} must have {xname}'s dtype {x.dtype}, got {out.dtype}")
    if is_numpy_array(out):
        if not out.flags.writeable:
            raise ValueError(f"{name} is read-only")
        if np.may_share_memory(out, x) and not same_view(out, x):
            raise ValueError(f"{name} overlaps {xname} without being {xname} itself; pass out={xname} "
                             "for in place or a separate buffer")
    elif xp_device(out) != xp_device(x):
        raise ValueError(f"{name} is on device {xp_device(out)}, {xname} on {xp_device(x)}")


def overlaps(a, b) -> bool:
    """True when arrays a and b share memory: exact for NumPy, and for CuPy by address arithmetic on
    the host (:func:`_address_view`); other array types (or None) are never reported."""
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return np.may_share_memory(a, b) and np.shares_memory(a, b)
    if is_cupy_array(a) and is_cupy_array(b):
        a, b = _address_view(a), _address_view(b)
        return np.may_share_memory(a, b) and np.shares_memory(a, b)
    return False


class _AddressInterface:
    def __init__(self, interface):
        self.__array_interface__ = interface


def _address_view(a) -> np.ndarray:
    """A host NumPy array with the pointer, shape, strides and dtype of device array ``a``. It is never
    read: ``np.shares_memory`` only does arithmetic on addresses (unique across devices with CUDA's
    unified virtual addressing), so overlap of device arrays is decided without a kernel launch."""
    return np.asarray(_AddressInterface({"shape": tuple(a.shape), "typestr": np.dtype(a.dtype).str,
                                         "data": (int(a.data.ptr), True), "strides": tuple(a.strides),
                                         "version": 3}))


def check_cross_overlap(xs, outs, names):
    """apply_qk: an out of q or k must share no memory with the other input or the other out (both are
    rotated in one pass: such an out would be written before, or while, the other is read). Disjoint
    views of one buffer (q and k sliced from a fused qkv) are fine."""
    (q, k), (q_out, k_out), (nq, nk) = xs, outs, names
    in_place = q_out is q and k_out is k
    if overlaps(q_out, k):
        raise ValueError(f"out for {nq} overlaps {nk}: pass out={nk} only as {nk}'s own out, or a separate buffer")
    if not in_place and overlaps(k_out, q):
        raise ValueError(f"out for {nk} overlaps {nq}: pass out={nq} only as {nq}'s own out, or a separate buffer")
    if not in_place and overlaps(q_out, k_out):
        raise ValueError(f"out for {nq} and out for {nk} overlap; pass separate buffers")


# -- packed batches ------------------------------------------------------------------------------
def packed_positions(x, seq_axis, positions, cu_seqlens, seqlen_offsets, name="x", spec=None):
    """``positions`` for a call with ``cu_seqlens`` (a packed batch, see :mod:`rotary.spec.packing`).

    Without cu_seqlens: positions unchanged (seqlen_offsets must be None). With it: x must have no
    batch axis before its sequence axis (or one of size 1); positions None -> restarting per sequence
    at seqlen_offsets; an explicit per-token positions array is used as given. Returns
    ``(positions, packed)`` with ``packed`` None without cu_seqlens. For an M-RoPE spec the restarted
    text positions are spread over its axes, (T, n_axes).
    """
    if cu_seqlens is None:
        if seqlen_offsets is not None:
            raise ValueError("seqlen_offsets needs cu_seqlens (one offset per packed sequence); for a padded "
                             "batch pass positions=offset or positions of shape (batch, seq)")
        return positions, None
    shape = tuple(x.shape)
    ax = normalize_seq_axis(seq_axis, len(shape), name)
    if math.prod(shape[:ax]) != 1:
        raise ValueError(f"cu_seqlens needs packed input: {name} of shape {shape} has batch axes {shape[:ax]} "
                         f"before the sequence axis {ax}; pack the sequences along one token axis "
                         "(total_tokens, heads, head_dim) and pass seq_axis=0")
    try:
        packed = _packing.pack(cu_seqlens, shape[ax], seqlen_offsets)
    except ValueError as exc:
        if "token count" in str(exc) and ax != 0:
            raise ValueError(f"{exc}; {name}'s sequence axis is {ax} (seq_axis={seq_axis}): for packed "
                             "(total_tokens, heads, head_dim) input pass seq_axis=0") from None
        raise
    if positions is None:
        if isinstance(spec, RopeSpec) and spec.multi_axis and spec.mrope_section is not None:
            return spread_positions(packed.positions, spec.n_axes), packed
        return packed.positions, packed
    if seqlen_offsets is not None:
        raise ValueError("pass seqlen_offsets or per-token positions with cu_seqlens, not both")
    return positions, packed


# -- positions that continue a state (linear attention) ------------------------------------------
def start_positions(state, lead_shape, seq_len):
    """positions=None with a state: from the state's next position on (an int offset or (batch, seq))."""
    start = state.next_position
    if isinstance(start, int):
        return start
    if not lead_shape or start.shape != (lead_shape[0],):
        raise ValueError(f"state.next_position of shape {start.shape} does not match the batch axis "
                         f"(size {lead_shape[0] if lead_shape else 'none'}) of q")
    return start[:, None] + np.arange(seq_len, dtype=np.int64)[None, :]


def next_position(pos, lead_shape, seq_len, positions, state):
    """next_position after this call: last position + 1 (int, or (batch,) for per-batch positions)."""
    if seq_len == 0:
        if state is not None:
            return state.next_position
        return int(positions) if isinstance(positions, numbers.Integral) else 0
    if pos.ndim == 2 and pos.shape[0] == 1 and pos.dtype == np.int64:   # one row of positions (decode: one)
        last = int(pos[0, -1])
        if last == _INT64_MAX:
            raise ValueError("the last position is the largest int64: the next position (for a state) would "
                             "overflow int64")
        return last + 1
    if pos.ndim == 3 or pos.dtype.kind == "f":
        # multi-axis (M-RoPE's decode rule: every axis continues from the largest coordinate + 1) or
        # real-valued coordinates: one past the largest coordinate seen
        last = np.floor(pos.reshape(pos.shape[0], -1).max(axis=1)).astype(np.int64) + 1
    else:
        if int(pos[:, -1].max()) == _INT64_MAX:
            raise ValueError("the last position is the largest int64: the next position (for a state) would "
                             "overflow int64")
        last = pos[:, -1] + 1
    if pos.shape[0] == 1:
        return int(last[0])
    rep = pos.shape[0] // lead_shape[0]
    return last[::rep]


# -- the backend -----------------------------------------------------------------------------------
def pick_backend(arrays, backend, capability: str | None = "rotate"):
    """The backend module for ``backend=`` ("auto" or a name) and these arrays, with ``capability``
    (a primitive such as "rotate" or "linear_attention"; None: whatever the registry picks). "auto"
    falls back to the NumPy reference when the backend it picks lacks the capability; a named backend
    without it is NotImplementedError."""
    module = _backends.pick(arrays, backend)
    if capability is None or hasattr(module, capability):
        return module
    if backend == "auto":
        return _backends.get("numpy")
    raise NotImplementedError(f"backend {backend!r} has no {capability}; use backend='numpy' or 'auto'")


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


# -- a prepared call's positions (Rope) -------------------------------------------------------------
_INT64_LIMIT = 2 ** 63


def prepared_rows(positions, seq_len: int, lead0: int, batch_rep: int, default_rows, device_rows: bool = False):
    """``(rows, start)`` for the common positions of a prepared call (:class:`rotary.Rope`): token (b, s)
    is at position ``rows[b or 0, s] + start``; rows are C-contiguous aligned int64 (Bp, S) (the caller's
    positions or a view of them: backends only read them) and not range-checked (the backend checks them
    against its table). None, an int offset, a C-contiguous int64 (S,) or (batch, S) array are taken (with
    ``device_rows``, also device int64 arrays of those shapes); None is returned for anything else, which
    :func:`normalize_positions` then parses on the general path."""
    if positions is None:
        return default_rows, 0
    if type(positions) is int:
        return (default_rows, positions) if -_INT64_LIMIT <= positions < _INT64_LIMIT - seq_len else None
    if device_rows and type(positions).__module__.startswith("cupy") and positions.dtype == np.int64:
        if positions.shape == (seq_len,):
            return positions.reshape(1, seq_len), 0
        return (positions, 0) if positions.shape == (lead0, seq_len) and batch_rep == 1 else None
    if type(positions) is not np.ndarray or positions.dtype != np.int64:
        return None
    flags = positions.flags
    if not (flags.c_contiguous and flags.aligned):
        return None
    if positions.shape == (lead0, seq_len) and batch_rep == 1:
        return positions, 0
    return (positions.reshape(1, seq_len), 0) if positions.shape == (seq_len,) else None
