"""``out=`` buffers and memory overlap: shape, dtype, type and device of an out, and the rules on memory that
a call's arrays share (an out is its input itself or shares no memory with it; q's and k's outs share none
with the other operand). :func:`check_memory` is what a plan re-checks on every call: memory can change
between calls whose shapes, strides and dtypes are the same."""

from __future__ import annotations

import weakref

import numpy as np
from array_api_compat import array_namespace, device as xp_device, is_cupy_array, is_jax_array, is_numpy_array


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
    """Validate an ``out=`` array for input ``x``: its type, shape, dtype and device (what a plan's key fixes);
    the rules on its memory are :func:`check_memory`'s."""
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
    if not is_numpy_array(out) and xp_device(out) != xp_device(x):
        raise ValueError(f"{name} is on device {xp_device(out)}, {xname} on {xp_device(x)}")


def out_names(names):
    """The names errors give the outs of a call's inputs ``names``: "out" for one input, "out for q" for two."""
    return ("out",) if len(names) == 1 else tuple(f"out for {name}" for name in names)


def check_memory(xs, outs, names, separate=False) -> bool:
    """The rules on the memory of a call's arrays, checked on every call (a plan's key fixes shapes, strides and
    dtypes, not addresses or the writeable flag): a NumPy out is writable and either its input's own view (in
    place) or shares no memory with it; with two inputs (q, k), :func:`check_cross_overlap`. Returns True when
    every separate out (not its input itself) shares no memory with any array of the call, False when one is
    its input's memory through another view object (valid: in place). ``separate`` (a call that writes its
    pairs in another layout than it reads them, ``out_pairs``): an out that shares any memory with its input
    is a ValueError naming the out."""
    apart = True
    for i, out in enumerate(outs):
        if out is None:
            continue
        x = xs[i]
        if separate and (out is x or overlaps(out, x)):
            raise ValueError(f"{out_names(names)[i]} shares memory with {names[i]}, but out_pairs writes the pairs to "
                             f"other coordinates than it reads them from (no call in place): pass a separate buffer")
        if type(out) is np.ndarray or is_numpy_array(out):
            if not out.flags.writeable:
                raise ValueError(f"{out_names(names)[i]} is read-only")
            if out is not x and np.may_share_memory(out, x):
                if not same_view(out, x):
                    raise ValueError(f"{out_names(names)[i]} overlaps {names[i]} without being {names[i]} itself; "
                                     f"pass out={names[i]} for in place or a separate buffer")
                apart = False
    if len(xs) == 2 and (outs[0] is not None or outs[1] is not None):
        check_cross_overlap(xs, outs, names)
    return apart


class CheckedBuffers:
    """The arrays of a call whose memory rules (:func:`check_memory`) passed, held by weak reference with their
    shapes, dtypes, layouts and writeable flags: a later call of the same live objects, unchanged, has the same
    addresses and extents (a NumPy or CuPy array's memory does not move while the object lives), so the rules'
    verdict on them stands without recomputing it, and :meth:`same` costs a few attribute reads where the overlap
    tests cost ~1.5 us. Anything else (another object, a reshaped view, a flag turned read-only) is a miss: the
    caller runs :func:`check_memory` and records the new arrays. A C-contiguous array's layout is its shape and
    that flag (strides differ only on axes of length 1, never stepped along); any other's, its strides."""

    __slots__ = ("held", "repeats", "nones", "count", "extra", "value")

    def __init__(self, arrays, extra, value):
        first = {}   # id -> the position an object first stands at (in place: an out is its input)
        held, repeats, nones = [], [], []
        for i, a in enumerate(arrays):
            if a is None:
                nones.append(i)
            elif id(a) in first:
                repeats.append((i, first[id(a)]))
            else:
                first[id(a)] = i
                held.append((i, weakref.ref(a), a.shape, a.dtype, None if _c_contiguous(a) else a.strides,
                             a.flags.writeable if type(a) is np.ndarray else None))
        self.held, self.repeats, self.nones = tuple(held), tuple(repeats), tuple(nones)
        self.count = len(arrays)
        self.extra, self.value = extra, value   # the call's other key (compared), what the caller keeps with it

    def same(self, arrays, extra) -> bool:
        """Whether ``arrays`` are the recorded objects, alive and unchanged, and ``extra`` the recorded extra key
        (an object recorded at two positions, e.g. an out that is its input, is checked once and must stand at
        both again)."""
        if extra != self.extra or len(arrays) != self.count:
            return False
        for i in self.nones:
            if arrays[i] is not None:
                return False
        for i, j in self.repeats:
            if arrays[i] is not arrays[j]:
                return False
        for i, ref, shape, dtype, strides, writeable in self.held:
            a = arrays[i]
            if ref() is not a or a.shape != shape or a.dtype != dtype:
                return False
            if strides is None:   # recorded C-contiguous: one flags object answers both
                flags = a.flags
                if not flags.c_contiguous or writeable is not None and flags.writeable != writeable:
                    return False
            elif a.strides != strides or writeable is not None and a.flags.writeable != writeable:
                return False
        return True

    @staticmethod
    def record(arrays, extra, value):
        """A record of these arrays, or None when one cannot be held by weak reference."""
        try:
            return CheckedBuffers(arrays, extra, value)
        except TypeError:
            return None


def _c_contiguous(a) -> bool:
    flags = getattr(a, "flags", None)
    return flags is not None and bool(flags.c_contiguous)


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
