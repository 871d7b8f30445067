"""A spec bound to its arrays' layout: ``rotary.bind(spec, layout="bshd")`` holds the spec, the sequence axis and
the backend once, and its ``apply`` / ``apply_qk`` / ``attention`` / ``linear_attention`` / ``rerotate`` pass them
to the functions of those names (a call's own keywords win)."""

from __future__ import annotations

from ..frontend.axes import layout_seq_axis
from ..frontend.rotate import apply, apply_qk
from ..spec.rope_spec import RopeSpec
from .linear import linear_attention
from .rerotate import rerotate
from .softmax import attention


class BoundSpec:
    """``spec``, ``seq_axis`` (an int, or the tensor layout ``layout``) and ``backend``, held for every call."""

    __slots__ = ("spec", "seq_axis", "backend")

    def __init__(self, spec, *, layout=None, seq_axis=None, backend="auto"):
        if not isinstance(spec, RopeSpec):
            raise TypeError(f"spec must be a rotary.RopeSpec, got {type(spec).__name__}")
        if layout is not None:
            if not isinstance(layout, str):
                raise TypeError(f"layout must be a string such as 'bshd', got {type(layout).__name__}")
            layout_seq_axis(layout, len(layout), "the inputs")   # a valid tensor layout
        self.spec, self.backend = spec, backend
        self.seq_axis = seq_axis if layout is None else (layout if seq_axis is None else (layout, seq_axis))

    def __repr__(self):
        return f"rotary.bind({self.spec!r}, seq_axis={self.seq_axis!r}, backend={self.backend!r})"

    def _kw(self, kwargs):
        kwargs.setdefault("seq_axis", self.seq_axis)
        kwargs.setdefault("backend", self.backend)
        return kwargs

    def apply(self, x, positions=None, **kwargs):
        """:func:`rotary.apply` with the bound spec, axis and backend."""
        return apply(x, positions, spec=self.spec, **self._kw(kwargs))

    def apply_qk(self, q, k, positions=None, **kwargs):
        """:func:`rotary.apply_qk` with the bound spec, axis and backend."""
        return apply_qk(q, k, positions, spec=self.spec, **self._kw(kwargs))

    def attention(self, q, k, v, positions=None, **kwargs):
        """:func:`rotary.attention` with the bound spec, axis and backend."""
        return attention(q, k, v, positions, spec=self.spec, **self._kw(kwargs))

    def linear_attention(self, q, k, v, positions=None, **kwargs):
        """:func:`rotary.linear_attention` with the bound axis and backend, and the bound spec unless a
        ``state`` (which carries its own) is given."""
        if kwargs.get("state") is None:
            kwargs.setdefault("spec", self.spec)
        return linear_attention(q, k, v, positions, **self._kw(kwargs))

    def rerotate(self, k, from_positions, to_positions, **kwargs):
        """:func:`rotary.rerotate` with the bound spec, axis and backend."""
        return rerotate(k, from_positions, to_positions, spec=self.spec, **self._kw(kwargs))


def bind(spec, *, layout=None, seq_axis=None, backend="auto") -> BoundSpec:
    """``spec`` with its arrays' layout ("bshd", "bhsd", "thd", ...) or ``seq_axis`` and a backend, held once."""
    return BoundSpec(spec, layout=layout, seq_axis=seq_axis, backend=backend)
