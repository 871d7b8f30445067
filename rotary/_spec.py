"""RopeSpec: the one source of truth for frequencies, layouts and cos/sin values.

Everything here runs on the host in float64. Backends never compute frequencies: they get
cos/sin tables made here (see ``_tables.py``) and per-token row indices.

Rotation of pair i at position p by angle ``theta_{p,i} = p * omega_i``::

    y_a = x_a cos(theta) - x_b sin(theta)
    y_b = x_b cos(theta) + x_a sin(theta)

with (a, b) = (i, i + d/2) for layout "half" (NeoX, HF LLaMA ``rotate_half``) and
(a, b) = (2i, 2i + 1) for layout "interleaved" (RoFormer, GPT-J, Meta's complex form).
Coordinates from ``rotary_dim`` to ``head_dim`` pass through unchanged.
"""

from __future__ import annotations

import math
import operator
from functools import lru_cache

import numpy as np

from . import _scaling

LAYOUTS = ("half", "interleaved")
TWO_PI = 2.0 * math.pi


def _as_int(value, name: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}") from None


class RopeSpec:
    """Frequencies and layout of one RoPE convention.

    Parameters
    ----------
    head_dim : int
        Size of the last axis of q/k.
    rotary_dim : int, optional
        Number of leading coordinates that rotate (even, <= head_dim). Defaults to head_dim,
        or head_dim - 1 when head_dim is odd (the last coordinate then passes through).
    base : float
        ``rope_theta``; ``omega_i = base**(-2i/rotary_dim)``.
    layout : {"half", "interleaved"}
        Which coordinates pair up (see module docstring).
    scaling : dict, optional
        A length-extension rule with HF key names, e.g. ``{"rope_type": "yarn", "factor": 4.0,
        "original_max_position_embeddings": 4096}``.
    max_position_embeddings : int, optional
        The model's context length (used by "dynamic", "yarn" and "longrope").

    Notes
    -----
    Specs are immutable and hashable; two specs are equal exactly when every field is equal.
    """

    __slots__ = ("head_dim", "rotary_dim", "base", "layout", "scaling", "max_position_embeddings", "_hash")

    def __init__(self, head_dim, *, rotary_dim=None, base=10000.0, layout="half", scaling=None,
                 max_position_embeddings=None):
        head_dim = _as_int(head_dim, "head_dim")
        if head_dim < 1:
            raise ValueError(f"head_dim must be >= 1, got {head_dim}")
        if rotary_dim is None:
            rotary_dim = head_dim - (head_dim % 2)
        rotary_dim = _as_int(rotary_dim, "rotary_dim")
        if rotary_dim % 2 or rotary_dim < 2:
            raise ValueError(f"rotary_dim must be an even integer >= 2, got {rotary_dim}")
        if rotary_dim > head_dim:
            raise ValueError(f"rotary_dim must be <= head_dim ({head_dim}), got {rotary_dim}")
        if isinstance(base, bool) or not isinstance(base, (int, float, np.integer, np.floating)):
            raise TypeError(f"base must be a real number, got {type(base).__name__}")
        base = float(base)
        if not (base > 0.0 and math.isfinite(base)):
            raise ValueError(f"base must be a finite number > 0, got {base}")
        if base == 1.0:
            raise ValueError("base must not be 1 (every frequency would be 1)")
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if max_position_embeddings is not None:
            max_position_embeddings = _as_int(max_position_embeddings, "max_position_embeddings")
            if max_position_embeddings < 1:
                raise ValueError(f"max_position_embeddings must be >= 1, got {max_position_embeddings}")
        scaling = _scaling.canonical_scaling(scaling, rotary_dim=rotary_dim, head_dim=head_dim, base=base,
                                             max_position_embeddings=max_position_embeddings)
        for name, value in (("head_dim", head_dim), ("rotary_dim", rotary_dim), ("base", base),
                            ("layout", layout), ("scaling", scaling),
                            ("max_position_embeddings", max_position_embeddings)):
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_hash", hash(self._key()))

    # -- value semantics -------------------------------------------------------------------
    def __setattr__(self, name, value):
        raise AttributeError("RopeSpec is immutable; use spec.replace(...)")

    def _key(self):
        return (self.head_dim, self.rotary_dim, self.base, self.layout, self.scaling, self.max_position_embeddings)

    def __eq__(self, other):
        return isinstance(other, RopeSpec) and self._key() == other._key()

    def __hash__(self):
        return self._hash

    def __reduce__(self):  # pickling: rebuild through __init__ (the fields are immutable)
        return (_rebuild_spec, (self.head_dim, self.rotary_dim, self.base, self.layout, self.scaling_dict,
                                self.max_position_embeddings))

    def __repr__(self):
        parts = [str(self.head_dim)]
        if self.rotary_dim != self.head_dim:
            parts.append(f"rotary_dim={self.rotary_dim}")
        parts.append(f"base={self.base!r}")
        parts.append(f"layout={self.layout!r}")
        if self.scaling is not None:
            parts.append(f"scaling={self.scaling_dict!r}")
        if self.max_position_embeddings is not None:
            parts.append(f"max_position_embeddings={self.max_position_embeddings}")
        return f"RopeSpec({', '.join(parts)})"

    def replace(self, **changes) -> "RopeSpec":
        """A copy with some fields changed, e.g. ``spec.replace(layout="interleaved")``."""
        fields = dict(rotary_dim=self.rotary_dim, base=self.base, layout=self.layout,
                      scaling=self.scaling_dict, max_position_embeddings=self.max_position_embeddings)
        head_dim = changes.pop("head_dim", self.head_dim)
        fields.update(changes)
        return RopeSpec(head_dim, **fields)

    @property
    def scaling_dict(self) -> dict | None:
        """The scaling rule as a plain dict (lists for per-pair factors), or None."""
        if self.scaling is None:
            return None
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.scaling}

    @property
    def rope_type(self) -> str:
        return "default" if self.scaling is None else dict(self.scaling)["rope_type"]

    @classmethod
    def from_hf_config(cls, config, *, layout: str = "half") -> "RopeSpec":
        """Build a spec from an HF ``config.json`` dict or a transformers ``PretrainedConfig``.

        Reads ``rope_theta``, ``rope_scaling`` (transformers 4.x) or ``rope_parameters`` (5.x),
        ``partial_rotary_factor``, ``head_dim`` (or ``hidden_size // num_attention_heads``) and
        ``max_position_embeddings``. HF checkpoints use the "half" layout; pass
        ``layout="interleaved"`` for Meta / GPT-J style weights.
        """
        kwargs = _scaling.spec_kwargs_from_hf_config(config)
        head_dim = kwargs.pop("head_dim")
        return cls(head_dim, layout=layout, **kwargs)

    # -- frequencies -----------------------------------------------------------------------
    @property
    def depends_on_seq_len(self) -> bool:
        """True when inv_freq changes with the sequence length (dynamic NTK, LongRoPE)."""
        return _scaling.depends_on_seq_len(self.scaling)

    def inv_freq(self, seq_len: int | None = None) -> np.ndarray:
        """float64 array of length rotary_dim // 2: the (scaled) angular frequency of each pair.

        ``seq_len`` (max position + 1) matters only for rules that depend on it ("dynamic",
        "longrope"); None means the model's original context.
        """
        if seq_len is not None:
            seq_len = _as_int(seq_len, "seq_len")
            if seq_len < 1:
                raise ValueError(f"seq_len must be >= 1, got {seq_len}")
            if not self.depends_on_seq_len:
                seq_len = None
        return _inv_freq_and_scaling(self, seq_len)[0].copy()

    @property
    def attention_scaling(self) -> float:
        """HF's attention factor, multiplied into cos and sin (1.0 for most rules)."""
        return _inv_freq_and_scaling(self, None)[1]

    def attention_scaling_at(self, seq_len: int | None) -> float:
        if seq_len is not None and not self.depends_on_seq_len:
            seq_len = None
        return _inv_freq_and_scaling(self, seq_len)[1]

    # -- angles and cos/sin ----------------------------------------------------------------
    def angles(self, positions, seq_len: int | None = None) -> np.ndarray:
        """float64 angles ``position * inv_freq`` reduced to [-pi, pi), shape positions.shape + (d/2,).

        The product is formed in float64 (relative error 2**-53, i.e. < 3e-7 rad at position
        2**31) and reduced mod 2*pi before any cos/sin, so cos/sin stay exact to float32 at
        any position below 2**31.
        """
        positions = np.asarray(positions)
        if positions.dtype.kind not in "iu":
            raise TypeError(f"positions must be integers, got dtype {positions.dtype}")
        inv_freq = _inv_freq_and_scaling(self, seq_len if self.depends_on_seq_len else None)[0]
        theta = positions.astype(np.float64)[..., None] * inv_freq
        return np.remainder(theta + math.pi, TWO_PI) - math.pi

    def cos_sin(self, positions, seq_len: int | None = None, dtype=np.float32):
        """(cos, sin) of the angles, times ``attention_scaling``, cast to ``dtype`` at the end."""
        theta = self.angles(positions, seq_len)
        scale = self.attention_scaling_at(seq_len)
        return (np.cos(theta) * scale).astype(dtype), (np.sin(theta) * scale).astype(dtype)

    # -- layout helpers --------------------------------------------------------------------
    def pair_indices(self) -> tuple[np.ndarray, np.ndarray]:
        """(a, b): coordinate indices of the two members of each rotated pair, each of length d/2."""
        half = self.rotary_dim // 2
        i = np.arange(half)
        if self.layout == "half":
            return i, i + half
        return 2 * i, 2 * i + 1


def _rebuild_spec(head_dim, rotary_dim, base, layout, scaling, max_position_embeddings):
    return RopeSpec(head_dim, rotary_dim=rotary_dim, base=base, layout=layout, scaling=scaling,
                    max_position_embeddings=max_position_embeddings)


@lru_cache(maxsize=512)
def _inv_freq_and_scaling(spec: RopeSpec, seq_len):
    inv_freq, attention = _scaling.scaled_inv_freq(spec.base, spec.rotary_dim, spec.scaling, seq_len=seq_len,
                                                   max_position_embeddings=spec.max_position_embeddings,
                                                   head_dim=spec.head_dim)
    inv_freq = np.ascontiguousarray(inv_freq, dtype=np.float64)
    inv_freq.setflags(write=False)
    return inv_freq, float(attention)
