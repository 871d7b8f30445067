"""The sequence axis and the canonical view: ``seq_axis`` -> ``(B, S, H, D)`` (B = the axes before the sequence
axis, merged; H = the axes between the sequence axis and the last, merged; no copy when the strides allow
it), and back."""

from __future__ import annotations

import functools
import math
import operator

import numpy as np
from array_api_compat import is_cupy_array, is_numpy_array


#: what ``layout=`` means when it is not a pair layout of the spec ("half" / "interleaved"): the order of an
#: input's axes, one letter each, "s" (or "t": packed tokens) the sequence and "d" the last (head_dim)
TENSOR_LAYOUT_LETTERS = "bshdtgn"
_PAIR_LAYOUTS = ("half", "interleaved")
_EXAMPLES = {3: "seq_axis=0 / layout='shd' for (seq, heads, head_dim) or packed 'thd', seq_axis=1 / layout='bsd' "
                "for (batch, seq, dim) or 'hsd' for (heads, seq, head_dim)",
             4: "seq_axis=1 / layout='bshd' for (batch, seq, heads, head_dim), seq_axis=2 / layout='bhsd' for "
                "(batch, heads, seq, head_dim), seq_axis=0 / layout='sbhd' for (seq, batch, heads, head_dim)"}


def take_tensor_layout(seq_axis, spec_kwargs: dict):
    """``(seq_axis, spec_kwargs)`` with a tensor layout given as ``layout=`` (e.g. "bshd"; a pair layout
    "half" / "interleaved" stays a spec keyword) moved into ``seq_axis`` (a string, or ``(layout, seq_axis)``
    when both are given: :func:`normalize_seq_axis` checks that they agree)."""
    layout = spec_kwargs.get("layout") if spec_kwargs else None
    if not isinstance(layout, str) or layout in _PAIR_LAYOUTS:
        return seq_axis, spec_kwargs
    rest = {key: value for key, value in spec_kwargs.items() if key != "layout"}
    return (layout if seq_axis is None else (layout, seq_axis)), rest


def layout_seq_axis(layout: str, ndim: int, name: str = "x") -> int:
    """The sequence axis a tensor layout names ("bshd" -> 1, "bhsd" -> 2, "thd" -> 0, ...)."""
    letters = layout.lower()
    if (len(set(letters)) != len(letters) or set(letters) - set(TENSOR_LAYOUT_LETTERS) or not letters.endswith("d")
            or sum(c in "st" for c in letters) != 1):
        raise ValueError(f"layout must be 'half' / 'interleaved' (the spec's pairs) or the order of {name}'s axes, one "
                         f"letter each with 's' (or 't', packed tokens) the sequence and 'd' last (e.g. 'bshd', "
                         f"'bhsd', 'thd'), got {layout!r}")
    if len(letters) != ndim:
        raise ValueError(f"layout={layout!r} names {len(letters)} axes, {name} has {ndim}")
    return letters.index("s") if "s" in letters else letters.index("t")


def normalize_seq_axis(seq_axis, ndim: int, name: str = "x") -> int:
    """The sequence axis (0 <= ax < ndim - 1) that ``seq_axis`` names: an int, a tensor layout string, both
    (``(layout, int)``, see :func:`take_tensor_layout`), or None: a 2-D ``(seq, dim)`` input only. An input of
    3 or more dimensions must name it (its axes are read no other way: never a silent guess)."""
    if ndim < 2:
        raise ValueError(f"{name} must have at least 2 dimensions (..., seq, dim), got shape with ndim={ndim}")
    if isinstance(seq_axis, tuple):
        layout, given = seq_axis
        ax, other = layout_seq_axis(layout, ndim, name), normalize_seq_axis(given, ndim, name)
        if ax != other:
            raise ValueError(f"layout={layout!r} puts {name}'s sequence on axis {ax}, seq_axis={given} on axis {other}: "
                             "pass one of them")
        return ax
    if isinstance(seq_axis, str):
        return layout_seq_axis(seq_axis, ndim, name)
    if seq_axis is None:
        if ndim == 2:
            return 0
        raise ValueError(f"{name} has {ndim} dimensions: name its sequence axis, "
                         f"{_EXAMPLES.get(ndim, 'seq_axis=<the axis> or layout=<one letter per axis>')}")
    if isinstance(seq_axis, bool):
        raise TypeError("seq_axis must be an integer, got bool")
    try:
        seq_axis = operator.index(seq_axis)
    except TypeError:
        raise TypeError(f"seq_axis must be an integer, a layout string or None, got {type(seq_axis).__name__}") from None
    if not -ndim <= seq_axis < ndim or seq_axis % ndim == ndim - 1:
        raise ValueError(f"seq_axis must name an axis of {name} (ndim={ndim}) other than the last (head_dim) axis: "
                         f"one of {list(range(ndim - 1))} or {list(range(-ndim, -1))}, got {seq_axis}")
    return seq_axis % ndim


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
