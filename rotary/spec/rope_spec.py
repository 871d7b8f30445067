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
from functools import lru_cache

import numpy as np

from . import angles as _angles, scaling as _scaling
from .validators import as_int, int_tuple, positive_real

LAYOUTS = ("half", "interleaved")
TWO_PI = 2.0 * math.pi


#: How an M-RoPE spec assigns its ``mrope_section`` sizes (pairs per t/h/w axis) to pairs, as in HF:
#: "chunked" (Qwen2-VL, Qwen2.5-VL, GLM-4V): sections in order, pairs [0, s0) read t, then h, then w;
#: "interleaved" (Qwen3-VL, Qwen3.5; HF ``mrope_interleaved=True``): pair i reads h when i % 3 == 1 and
#: i < 3*s1, w when i % 3 == 2 and i < 3*s2, t otherwise;
#: "ernie" (ERNIE-4.5-VL): the first s0 + s1 pairs alternate h, w, h, w, ..., the last s2 read t.
MROPE_LAYOUTS = ("chunked", "interleaved", "ernie")


def mrope_pair_axes(mrope_section, mrope_layout: str, half: int | None = None) -> tuple:
    """The coordinate (0 = t, 1 = h, 2 = w) each of ``half`` pairs (default sum(mrope_section)) reads for an
    M-RoPE section split (see MROPE_LAYOUTS)."""
    s = list(mrope_section)
    half = sum(s) if half is None else half
    if mrope_layout == "chunked":
        axes = [a for a, n in enumerate(s) for _ in range(n)]
    elif mrope_layout == "interleaved":
        axes = [0] * half
        for axis in (1, 2):
            for i in range(axis, min(3 * s[axis], half), 3):
                axes[i] = axis
    else:  # "ernie": sections are (h, w, t)
        hw = s[0] + s[1]
        axes = [1 + (i % 2) for i in range(hw)] + [0] * (half - hw)
    return tuple(axes)


class RopeSpec:
    """Frequencies and layout of one RoPE convention.

    Parameters
    ----------
    head_dim : int
        Size of the last axis of q/k.
    rotary_dim : int, optional
        Number of coordinates that rotate, from ``rotary_offset`` on (even, <= head_dim - rotary_offset).
        Defaults to head_dim - rotary_offset, minus 1 when that is odd (the last coordinate then passes
        through).
    base : float
        ``rope_theta``; ``omega_i = base**(-2i/rotary_dim)``.
    layout : {"half", "interleaved"}
        Which coordinates pair up (see module docstring).
    scaling : dict, optional
        A length-extension rule with HF key names, e.g. ``{"rope_type": "yarn", "factor": 4.0,
        "original_max_position_embeddings": 4096}``.
    max_position_embeddings : int, optional
        The model's context length (used by "dynamic", "yarn" and "longrope").
    mrope_section : sequence of 3 ints, optional
        M-RoPE (multimodal LLMs): pairs per t/h/w coordinate, summing to rotary_dim/2; positions then
        carry 3 coordinates on a trailing axis. ``mrope_interleaved=True`` (Qwen3-VL) or
        ``mrope_layout`` picks the assignment (:data:`MROPE_LAYOUTS`).
    pair_axes : sequence of ints, optional
        Any other multi-axis assignment: the coordinate each of the rotary_dim/2 pairs reads
        (``RopeSpec.axial`` builds it for vision encoders). ``n_axes`` = max + 1 unless given.
    frequencies : sequence of floats, optional
        The rotary_dim/2 angular frequencies, used instead of ``base**(-2i/rotary_dim)`` (no
        ``scaling`` then). A negative frequency turns its pair the other way (nanochat's convention).
    float_positions : bool
        Positions are real coordinates (e.g. DINOv3's patch centres in [-1, 1]); otherwise integers.
    attention_factor : float, optional
        With ``frequencies=``: the factor multiplied into cos and sin (HF's attention scaling), 1.0 if
        not given.
    rotary_offset : int
        The first rotated coordinate of the last axis (vLLM's ``rope_dim_offset``, ggml's ``n_offs``):
        coordinates ``[rotary_offset, rotary_offset + rotary_dim)`` rotate with the spec's layout, all
        others pass through, so a head laid out as ``[nope | rope]`` (MLA) rotates in one call.
        Default 0; ``rotary_offset + rotary_dim <= head_dim``. Frequencies and scaling rules see the
        head from ``rotary_offset`` on (``head_dim - rotary_offset`` coordinates).
    softmax_scale_factor : float
        Multiplies the attention's softmax scale (``1/sqrt(d)``): DeepSeek-V2/V3-style YaRN models use
        ``mscale(factor, mscale_all_dim)**2`` with ``mscale(s, m) = 0.1*m*ln(s) + 1``
        (``from_hf_config`` sets it where HF's attention applies it); 1.0 otherwise.

    Notes
    -----
    Specs are immutable and hashable; two specs are equal exactly when every field is equal.
    A multi-axis spec (``n_axes > 1``) rotates pair i at position vector p by ``p[pair_axes[i]] * omega_i``.
    """

    #: the stored fields, in order; value semantics (equality, hash, pickling, replace, repr) follow them
    _FIELDS = ("head_dim", "rotary_dim", "base", "layout", "scaling", "max_position_embeddings",
               "frequencies", "_pair_axes", "n_axes", "mrope_section", "mrope_layout", "float_positions",
               "softmax_scale_factor", "attention_factor", "rotary_offset")
    __slots__ = _FIELDS + ("_hash",)

    def __init__(self, head_dim, *, rotary_dim=None, base=10000.0, layout="half", scaling=None,
                 max_position_embeddings=None, mrope_section=None, mrope_interleaved=None, mrope_layout=None,
                 pair_axes=None, n_axes=None, frequencies=None, float_positions=False, softmax_scale_factor=1.0,
                 attention_factor=None, rotary_offset=0):
        head_dim = as_int(head_dim, "head_dim")
        if head_dim < 1:
            raise ValueError(f"head_dim must be >= 1, got {head_dim}")
        rotary_offset = as_int(rotary_offset, "rotary_offset")
        if rotary_offset < 0:
            raise ValueError(f"rotary_offset must be >= 0, got {rotary_offset}")
        rotated_part = head_dim - rotary_offset   # the coordinates from rotary_offset on
        if rotary_dim is None:
            if rotated_part < 2:
                raise ValueError(f"head_dim - rotary_offset must be >= 2 (at least one rotated pair), got head_dim "
                                 f"{head_dim} with rotary_offset {rotary_offset}")
            rotary_dim = rotated_part - (rotated_part % 2)
        rotary_dim = as_int(rotary_dim, "rotary_dim")
        if rotary_dim % 2 or rotary_dim < 2:
            raise ValueError(f"rotary_dim must be an even integer >= 2, got {rotary_dim}")
        if rotary_dim > rotated_part:
            if rotary_offset:
                raise ValueError(f"rotary_offset + rotary_dim ({rotary_offset} + {rotary_dim}) must be <= head_dim "
                                 f"({head_dim})")
            raise ValueError(f"rotary_dim must be <= head_dim ({head_dim}), got {rotary_dim}")
        if isinstance(base, bool) or not isinstance(base, (int, float, np.integer, np.floating)):
            raise TypeError(f"base must be a real number, got {type(base).__name__}")
        base = float(base)
        if not (base > 0.0 and math.isfinite(base)):
            raise ValueError(f"base must be a finite number > 0, got {base}")
        if base == 1.0 and frequencies is None:
            raise ValueError("base must not be 1 (every frequency would be 1)")
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if max_position_embeddings is not None:
            max_position_embeddings = as_int(max_position_embeddings, "max_position_embeddings")
            if max_position_embeddings < 1:
                raise ValueError(f"max_position_embeddings must be >= 1, got {max_position_embeddings}")
        scaling = _scaling.canonical_scaling(scaling, rotary_dim=rotary_dim, head_dim=rotated_part, base=base,
                                             max_position_embeddings=max_position_embeddings)
        half = rotary_dim // 2
        frequencies = _check_frequencies(frequencies, half, scaling)
        pair_axes, n_axes, mrope_section, mrope_layout = _check_axes(
            half, mrope_section, mrope_interleaved, mrope_layout, pair_axes, n_axes)
        if not isinstance(float_positions, (bool, np.bool_)):
            raise TypeError(f"float_positions must be a bool, got {type(float_positions).__name__}")
        softmax_scale_factor = positive_real(softmax_scale_factor, "softmax_scale_factor")
        if attention_factor is not None:
            if frequencies is None:
                raise ValueError("attention_factor= goes with frequencies= (a scaling rule sets its own factor)")
            attention_factor = positive_real(attention_factor, "attention_factor")
        values = dict(head_dim=head_dim, rotary_dim=rotary_dim, base=base, layout=layout, scaling=scaling,
                      max_position_embeddings=max_position_embeddings, frequencies=frequencies,
                      _pair_axes=pair_axes, n_axes=n_axes, mrope_section=mrope_section, mrope_layout=mrope_layout,
                      float_positions=bool(float_positions), softmax_scale_factor=softmax_scale_factor,
                      attention_factor=attention_factor, rotary_offset=rotary_offset)
        for name in self._FIELDS:
            object.__setattr__(self, name, values[name])
        object.__setattr__(self, "_hash", hash(self._key()))
        if scaling is not None:
            _check_evaluates(self)

    # -- value semantics -------------------------------------------------------------------
    def __setattr__(self, name, value):
        raise AttributeError("RopeSpec is immutable; use spec.replace(...)")

    def _key(self):
        return tuple(getattr(self, name) for name in self._FIELDS)

    def __eq__(self, other):
        return isinstance(other, RopeSpec) and self._key() == other._key()

    def __hash__(self):
        return self._hash

    def __reduce__(self):  # pickling: rebuild through __init__ (the fields are immutable)
        return (_rebuild_spec, (self._init_kwargs(),))

    def _init_kwargs(self) -> dict:
        """Keyword arguments that rebuild this spec through ``RopeSpec(**kwargs)``."""
        kwargs = {name.lstrip("_"): getattr(self, name) for name in self._FIELDS}
        kwargs["scaling"] = self.scaling_dict
        if self.mrope_section is not None:   # pair_axes follow from the sections
            kwargs["pair_axes"] = None
        else:
            kwargs["mrope_layout"] = None
        return kwargs

    def __repr__(self):
        rest = self.head_dim - self.rotary_offset
        defaults = {"rotary_dim": rest - rest % 2, "rotary_offset": 0, "scaling": None, "max_position_embeddings": None,
                    "frequencies": None, "pair_axes": None, "n_axes": 1, "mrope_section": None,
                    "mrope_layout": None, "float_positions": False, "softmax_scale_factor": 1.0,
                    "attention_factor": None}
        parts = [str(self.head_dim)]
        for name, value in self._init_kwargs().items():
            if name == "head_dim" or (name in defaults and value == defaults[name]):
                continue
            if name == "n_axes" and self._pair_axes is not None and value == max(self._pair_axes) + 1:
                continue
            if name == "mrope_layout" and value == "interleaved":
                name, value = "mrope_interleaved", True
            elif name == "mrope_layout" and value == "chunked":
                continue
            parts.append(f"{name}={_short(value)}")
        return f"RopeSpec({', '.join(parts)})"

    def replace(self, **changes) -> "RopeSpec":
        """A copy with some fields changed, e.g. ``spec.replace(layout="interleaved")``."""
        fields = self._init_kwargs()
        if changes.keys() & {"mrope_section", "mrope_interleaved", "mrope_layout"}:
            fields["pair_axes"], fields["n_axes"] = None, None
            if "mrope_interleaved" in changes:
                fields["mrope_layout"] = None
        if changes.keys() & {"pair_axes", "n_axes"}:
            fields["mrope_section"] = fields["mrope_layout"] = None
            if "n_axes" not in changes:
                fields["n_axes"] = None
        if "rotary_dim" in changes and "pair_axes" not in changes and fields.get("pair_axes") is not None:
            raise ValueError("pass pair_axes= too when changing the rotary_dim of a multi-axis spec")
        fields.update(changes)
        head_dim = fields.pop("head_dim")
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

    # -- multi-axis ------------------------------------------------------------------------
    @property
    def mrope_interleaved(self) -> bool:
        """HF's ``mrope_interleaved``: True for the Qwen3-VL t,h,w,t,h,w... assignment."""
        return self.mrope_layout == "interleaved"

    @property
    def multi_axis(self) -> bool:
        """True when positions carry several coordinates on a trailing axis (``n_axes`` of them)."""
        return self._pair_axes is not None

    def pair_axes(self) -> np.ndarray:
        """int64 array of length rotary_dim/2: the coordinate each pair reads (zeros for a 1-D spec)."""
        if self._pair_axes is None:
            return np.zeros(self.rotary_dim // 2, dtype=np.int64)
        return np.array(self._pair_axes, dtype=np.int64)

    @classmethod
    def axial(cls, head_dim, *, axes=2, base=10000.0, layout="half", rotary_dim=None, frequencies="per_axis",
              axis_order=None, frequency_scale=1.0, float_positions=False) -> "RopeSpec":
        """A vision encoder's axial (2-D / 3-D) RoPE: the rotary pairs split into ``axes`` equal groups,
        group g reading coordinate ``axis_order[g]`` (default 0, 1, ...: e.g. (row, col)).

        ``frequencies``:
          - "per_axis": every group has the 1-D set of dim rotary_dim/axes, ``phi_j = base**(-2j*axes/rotary_dim)``
            (Qwen2-VL / Qwen2.5-VL / Qwen3-VL / GLM-4V vision, SAM 2/3, EVA/timm, DINOv3 with
            ``frequency_scale=2*pi`` and float positions);
          - "strided": group g takes every axes-th frequency of the full set starting at g,
            ``omega_{axes*j + g}`` (Pixtral).
        ``frequency_scale`` multiplies every frequency (DINOv3: 2*pi, angles = 2*pi*coord/period).
        Layout "half" pairs (i, i + rotary_dim/2) (HF ``rotate_half``); "interleaved" pairs
        (2i, 2i+1) (SAM's complex form). Group g holds pairs [g*n, (g+1)*n), n = rotary_dim/(2*axes).
        """
        head_dim = as_int(head_dim, "head_dim")
        axes = as_int(axes, "axes")
        if axes < 1:
            raise ValueError(f"axes must be >= 1, got {axes}")
        if rotary_dim is None:
            rotary_dim = head_dim - head_dim % (2 * axes)
        rotary_dim = as_int(rotary_dim, "rotary_dim")
        if rotary_dim < 2 * axes or rotary_dim % (2 * axes):
            raise ValueError(f"rotary_dim must be a positive multiple of 2*axes = {2 * axes} for an axial spec, "
                             f"got {rotary_dim}")
        if axis_order is None:
            axis_order = tuple(range(axes))
        axis_order = int_tuple(axis_order, "axis_order")
        if sorted(axis_order) != list(range(axes)):
            raise ValueError(f"axis_order must be a permutation of 0..{axes - 1}, got {axis_order}")
        if isinstance(frequency_scale, bool) or not isinstance(frequency_scale, (int, float, np.integer, np.floating)) \
                or not (math.isfinite(frequency_scale) and frequency_scale > 0):
            raise ValueError(f"frequency_scale must be a finite number > 0, got {frequency_scale!r}")
        if isinstance(base, bool) or not isinstance(base, (int, float, np.integer, np.floating)) \
                or not (math.isfinite(base) and base > 0 and base != 1):
            raise ValueError(f"base must be a finite number > 0 other than 1, got {base!r}")
        n = rotary_dim // (2 * axes)
        if frequencies == "per_axis":
            group = _scaling._base_inv_freq(float(base), 2 * n)
            freqs = np.tile(group, axes)
        elif frequencies == "strided":
            full = _scaling._base_inv_freq(float(base), rotary_dim)
            freqs = np.concatenate([full[g::axes] for g in range(axes)])
        else:
            raise ValueError(f"frequencies must be 'per_axis' or 'strided', got {frequencies!r}")
        freqs = freqs * float(frequency_scale)
        pair_axes = tuple(axis_order[g] for g in range(axes) for _ in range(n))
        return cls(head_dim, rotary_dim=rotary_dim, base=base, layout=layout, frequencies=tuple(freqs.tolist()),
                   pair_axes=pair_axes, n_axes=axes, float_positions=float_positions)

    @classmethod
    def from_inv_freq(cls, inv_freq, *, head_dim=None, layout: str = "half",
                      attention_scaling: float = 1.0) -> "RopeSpec":
        """A spec from caller-supplied per-pair frequencies (learned or custom ``inv_freq``, e.g. an HF
        module's ``inv_freq`` buffer): pair i turns by ``position * inv_freq[i]``, cos and sin are
        multiplied by ``attention_scaling``. rotary_dim = 2 * len(inv_freq); head_dim defaults to it."""
        values = np.asarray(inv_freq)
        if values.ndim != 1 or values.shape[0] < 1:
            raise ValueError(f"inv_freq must be a 1-D sequence of at least one frequency, got shape {values.shape}")
        rotary_dim = 2 * values.shape[0]
        head_dim = rotary_dim if head_dim is None else head_dim
        return cls(head_dim, rotary_dim=rotary_dim, layout=layout, frequencies=values,
                   attention_factor=attention_scaling)

    @classmethod
    def from_hf_config(cls, config, *, layer_type: str | None = None, layout: str | None = None,
                       head: str = "rope") -> "RopeSpec":
        """Build a spec from an HF ``config.json`` (a dict, a transformers ``PretrainedConfig``, or a path to
        the file or to a checkpoint folder holding it), as the model family's HF code computes it (see ``docs/models.md`` for the families checked).

        Reads ``rope_parameters`` (5.x; flat or per layer type) or ``rope_theta`` + ``rope_scaling``
        (4.x), ``partial_rotary_factor``, head_dim (``head_dim`` and its aliases, or ``hidden_size //
        num_attention_heads``), ``max_position_embeddings``, M-RoPE's ``mrope_section`` /
        ``mrope_interleaved`` (with the family's HF defaults); a multimodal config's ``text_config``
        when the top level has no RoPE parameters.

        ``layer_type`` picks one entry of a per-layer-type config (``{"full_attention": {...},
        "sliding_attention": {...}}``, required there). ``layout``: None (default) gives the pairing the
        family's HF attention uses ("interleaved" for GLM, ERNIE, Cohere, GPT-J, DeepSeek with
        ``rope_interleave``, ...; "half" otherwise); a string overrides it, e.g. for a checkpoint whose
        q/k weights were permuted to the other layout.

        ``head`` (MLA models, ``qk_nope_head_dim`` + ``qk_rope_head_dim``): "rope" (default) is the rotated
        part as HF's rotary module builds it (head_dim = qk_rope_head_dim); "qk" the whole q/k head laid
        out ``[nope | rope]`` (``rotary_offset`` = qk_nope_head_dim; the same as "rope" without MLA);
        "indexer" DeepSeek-V3.2's DSA lightning indexer: ``index_head_dim`` heads laid out
        ``[rope | rest]`` with half-split pairs (GLM-MoE-DSA: interleaved), the same frequencies.
        """
        from . import hf_config as _hf_config

        kwargs = _hf_config.head_kwargs(config, _hf_config.spec_kwargs(config, layer_type), head)
        return cls._from_hf_kwargs(kwargs, layout)

    @classmethod
    def from_hf_vision_config(cls, config) -> "RopeSpec":
        """The axial spec of the vision tower in an HF config (a dict, a PretrainedConfig, or a path to a
        config.json or its checkpoint folder: the config itself,
        its ``vision_config``, SAM 3's ``backbone_config``), as the tower's HF rotary module builds it:
        which coordinate each pair reads, the per-axis frequencies, the pair layout (see
        ``rotary.spec.hf_vision.VISION_TOWERS`` and docs/models.md for the towers and the positions HF
        builds for them)."""
        from . import hf_vision

        return hf_vision.vision_spec(config, RopeSpec)[0]

    @classmethod
    def per_layer_from_hf_config(cls, config, *, layout: str | None = None, head: str = "rope") -> dict:
        """{layer type: spec} of a config: one entry per RoPE layer type of a per-layer-type config,
        one per ``layer_types`` entry of a flat config (all equal), ``{"default": spec}`` otherwise.
        ``head`` as in :meth:`from_hf_config`."""
        from . import hf_config as _hf_config

        return {lt: cls._from_hf_kwargs(_hf_config.head_kwargs(config, kw, head), layout)
                for lt, kw in _hf_config.per_layer_kwargs(config).items()}

    @classmethod
    def layers_from_hf_config(cls, config, *, layout: str | None = None) -> list:
        """The spec of each layer index (``config.layer_types``, per-layer overrides such as Gemma 4's
        global head dim applied), None for a layer whose type has no RoPE."""
        from . import hf_config as _hf_config

        cache = {}
        out = []
        for kw in _hf_config.layer_kwargs(config):
            if kw is None:
                out.append(None)
                continue
            key = repr(sorted(kw.items()))
            if key not in cache:
                cache[key] = cls._from_hf_kwargs(kw, layout)
            out.append(cache[key])
        return out

    @classmethod
    def _from_hf_kwargs(cls, kwargs: dict, layout) -> "RopeSpec":
        kwargs = dict(kwargs)
        head_dim = kwargs.pop("head_dim")
        config_layout = kwargs.pop("layout", "half")
        where = kwargs.pop("where", "config")
        try:
            return cls(head_dim, layout=config_layout if layout is None else layout, **kwargs)
        except (ValueError, TypeError) as exc:   # name the config entry the bad value came from
            from .hf_config import ConfigError

            raise ConfigError(f"{where}: {exc}") from None

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
        return _inv_freq_and_scaling(self, self._seq_len(seq_len))[0].copy()

    def _seq_len(self, seq_len):
        """``seq_len`` checked (None or an integer >= 1), and None for rules that do not depend on it."""
        if seq_len is None:
            return None
        seq_len = as_int(seq_len, "seq_len")
        if seq_len < 1:
            raise ValueError(f"seq_len must be an integer >= 1 (max position + 1) or None, got {seq_len}")
        return seq_len if self.depends_on_seq_len else None

    @property
    def attention_scaling(self) -> float:
        """HF's attention factor, multiplied into cos and sin (1.0 for most rules)."""
        return _inv_freq_and_scaling(self, None)[1]

    def attention_scaling_at(self, seq_len: int | None) -> float:
        """:attr:`attention_scaling` for a sequence of ``seq_len`` (max position + 1) tokens."""
        return _inv_freq_and_scaling(self, self._seq_len(seq_len))[1]

    # -- angles and cos/sin ----------------------------------------------------------------
    def angles(self, positions, seq_len: int | None = None) -> np.ndarray:
        """float64 angles ``position * inv_freq`` reduced to [-pi, pi], shape positions.shape[:-1] + (d/2,)
        for a multi-axis spec (positions (..., n_axes); pair i reads coordinate ``pair_axes[i]``) and
        positions.shape + (d/2,) otherwise.

        The product is formed exactly and reduced mod 2*pi in double-double (``rotary.spec.angles``):
        the angle is within about one ulp of pi of the exact ``p * w mod 2 pi`` (w the float64
        inv_freq) at every position below 2**53, so float64 data gets an exact rotation.
        """
        positions = self.check_positions(positions)
        if self._pair_axes is None:
            return self.pair_angles(positions[..., None], seq_len)
        return self.pair_angles(positions[..., self.pair_axes()], seq_len)

    def pair_angles(self, coordinates, seq_len: int | None = None) -> np.ndarray:
        """float64 angles ``coordinates[..., i] * inv_freq[i]`` reduced to [-pi, pi] exactly: the angle of pair i
        at the coordinate it reads (``coordinates`` broadcasts against (d/2,))."""
        return _angles.reduced_angles(coordinates, _freq_turns(self, self._seq_len(seq_len)))

    def check_positions(self, positions, name: str = "positions") -> np.ndarray:
        """``positions`` as a NumPy array checked against the spec: integers (reals for a
        ``float_positions`` spec) and, for a multi-axis spec, a trailing axis of n_axes coordinates."""
        positions = np.asarray(positions)
        kinds = "iuf" if self.float_positions else "iu"
        if positions.size == 0 and positions.dtype.kind not in kinds:
            positions = positions.astype(np.int64)   # an empty list: no values, so no wrong dtype
        if positions.dtype.kind not in kinds:
            what = "real numbers" if self.float_positions else "integers (this spec has float_positions=False)"
            raise TypeError(f"{name} must be {what}, got dtype {positions.dtype}")
        if self.float_positions and positions.dtype.kind == "f" and not np.all(np.isfinite(positions)):
            raise ValueError(f"{name} must be finite")
        if self._pair_axes is not None and (positions.ndim == 0 or positions.shape[-1] != self.n_axes):
            raise ValueError(f"{name} of shape {positions.shape} must carry this spec's {self.n_axes} coordinates "
                             f"on a trailing axis: (..., {self.n_axes})")
        return positions

    def cos_sin(self, positions, seq_len: int | None = None, dtype=np.float32):
        """(cos, sin) of the angles, times ``attention_scaling``, cast to ``dtype`` at the end; shape
        positions.shape + (d/2,), or positions.shape[:-1] + (d/2,) for a multi-axis spec."""
        positions = self.check_positions(positions)
        coords = positions[..., None] if self._pair_axes is None else positions[..., self.pair_axes()]
        return self.pair_cos_sin(coords, seq_len, dtype)

    def pair_cos_sin(self, coordinates, seq_len: int | None = None, dtype=np.float32):
        """(cos, sin) of :meth:`pair_angles` (times ``attention_scaling``): ``coordinates[..., None]``
        gives every pair's value at one coordinate (the rows of a per-position table)."""
        seq_len = self._seq_len(seq_len)
        try:
            table_dtype = np.dtype(dtype)
        except TypeError:
            raise TypeError(f"dtype must be a floating dtype (float16/float32/float64), got {dtype!r}") from None
        if table_dtype.kind != "f" or table_dtype.itemsize > 8:
            raise TypeError(f"dtype must be a floating dtype (float16/float32/float64), got {table_dtype}")
        return _angles.cos_sin(coordinates, _freq_turns(self, seq_len), _inv_freq_and_scaling(self, seq_len)[1],
                               table_dtype)

    # -- layout helpers --------------------------------------------------------------------
    def pair_indices(self) -> tuple[np.ndarray, np.ndarray]:
        """(a, b): coordinate indices (in the head, ``rotary_offset`` included) of the two members of each
        rotated pair, each of length d/2."""
        half = self.rotary_dim // 2
        i = np.arange(half) + self.rotary_offset
        if self.layout == "half":
            return i, i + half
        return i + np.arange(half), i + np.arange(half) + 1


def _short(value) -> str:
    """repr, with long tuples (per-pair frequencies and axes) shortened."""
    if isinstance(value, tuple) and len(value) > 8:
        return f"({', '.join(repr(v) for v in value[:3])}, ... {len(value)} values)"
    return repr(value)


def _rebuild_spec(kwargs):
    kwargs = dict(kwargs)
    return RopeSpec(kwargs.pop("head_dim"), **kwargs)


def _check_frequencies(frequencies, half: int, scaling):
    if frequencies is None:
        return None
    if scaling is not None:
        raise ValueError("frequencies= replaces the base frequencies; it cannot be combined with scaling=")
    values = np.asarray(frequencies)
    if values.ndim != 1 or values.shape[0] != half or values.dtype.kind not in "iuf":
        raise ValueError(f"frequencies must be a 1-D sequence of rotary_dim/2 = {half} real numbers, got "
                         f"{values.dtype} of shape {values.shape}")
    values = values.astype(np.float64)
    if not np.all(np.isfinite(values)):
        raise ValueError("frequencies must be finite")
    return tuple(values.tolist())


def _check_axes(half, mrope_section, mrope_interleaved, mrope_layout, pair_axes, n_axes):
    """(pair_axes, n_axes, mrope_section, mrope_layout), validated; all None for a 1-D spec."""
    if mrope_interleaved is not None and not isinstance(mrope_interleaved, (bool, np.bool_)):
        raise TypeError(f"mrope_interleaved must be a bool, got {type(mrope_interleaved).__name__}")
    if mrope_section is None:
        if mrope_interleaved or mrope_layout is not None:
            raise ValueError("mrope_interleaved / mrope_layout need mrope_section")
    else:
        if pair_axes is not None:
            raise ValueError("pass either mrope_section= or pair_axes=, not both")
        mrope_section = int_tuple(mrope_section, "mrope_section")
        if len(mrope_section) != 3 or min(mrope_section) < 0:
            raise ValueError(f"mrope_section must be 3 non-negative integers (pairs per t, h, w axis), "
                             f"got {mrope_section}")
        if sum(mrope_section) != half and mrope_layout != "interleaved" and not (
                mrope_layout is None and mrope_interleaved):
            raise ValueError(f"mrope_section {mrope_section} must sum to rotary_dim/2 = {half}, "
                             f"got {sum(mrope_section)}")
        if mrope_layout is None:
            mrope_layout = "interleaved" if mrope_interleaved else "chunked"
        elif mrope_layout not in MROPE_LAYOUTS:
            raise ValueError(f"mrope_layout must be one of {MROPE_LAYOUTS}, got {mrope_layout!r}")
        elif mrope_interleaved is not None and bool(mrope_interleaved) != (mrope_layout == "interleaved"):
            raise ValueError(f"mrope_interleaved={mrope_interleaved} disagrees with mrope_layout={mrope_layout!r}")
        if n_axes is not None and as_int(n_axes, "n_axes") != 3:
            raise ValueError(f"an M-RoPE spec has n_axes = 3, got {n_axes}")
        pair_axes, n_axes = mrope_pair_axes(mrope_section, mrope_layout, half), 3
        return pair_axes, n_axes, mrope_section, mrope_layout
    if pair_axes is None:
        if n_axes is not None and as_int(n_axes, "n_axes") != 1:
            raise ValueError(f"n_axes={n_axes} needs pair_axes= (or mrope_section=)")
        return None, 1, None, None
    pair_axes = int_tuple(pair_axes, "pair_axes")
    if len(pair_axes) != half:
        raise ValueError(f"pair_axes must have rotary_dim/2 = {half} entries, got {len(pair_axes)}")
    if min(pair_axes) < 0:
        raise ValueError(f"pair_axes entries must be >= 0, got {pair_axes}")
    n_axes = max(pair_axes) + 1 if n_axes is None else as_int(n_axes, "n_axes")
    if n_axes <= max(pair_axes):
        raise ValueError(f"pair_axes reads coordinate {max(pair_axes)} but n_axes is {n_axes}")
    return pair_axes, n_axes, None, None


def _check_evaluates(spec: RopeSpec) -> None:
    """A spec that constructs must also evaluate: finite frequencies >= 0 and a finite attention factor
    > 0 at the original context and, for length-dependent rules, at 4x the model's context."""
    lengths = [None]
    if spec.depends_on_seq_len:
        lengths.append(4 * max(spec.max_position_embeddings or 1, dict(spec.scaling).get("original_max_position_embeddings") or 1))
    for seq_len in lengths:
        at = "" if seq_len is None else f" at seq_len={seq_len}"
        try:
            with np.errstate(all="ignore"):
                inv_freq, attention = _inv_freq_and_scaling(spec, seq_len)
        except ArithmeticError as exc:
            raise ValueError(f"scaling {spec.scaling_dict} cannot be evaluated{at}: {type(exc).__name__}: {exc}") from None
        if not (np.all(np.isfinite(inv_freq)) and np.all(inv_freq >= 0)):
            raise ValueError(f"scaling {spec.scaling_dict} gives non-finite or negative frequencies{at}")
        if not (math.isfinite(attention) and attention > 0):
            raise ValueError(f"scaling {spec.scaling_dict} gives attention factor {attention!r}{at}; it must be finite "
                             "and > 0 (check 'factor', 'mscale', 'mscale_all_dim', 'attention_factor')")


@lru_cache(maxsize=512)
def _inv_freq_and_scaling(spec: RopeSpec, seq_len):
    if spec.frequencies is not None:
        inv_freq = np.array(spec.frequencies, dtype=np.float64)
        attention = 1.0 if spec.attention_factor is None else spec.attention_factor
    else:
        inv_freq, attention = _scaling.scaled_inv_freq(spec.base, spec.rotary_dim, spec.scaling, seq_len=seq_len,
                                                       max_position_embeddings=spec.max_position_embeddings,
                                                       head_dim=spec.head_dim - spec.rotary_offset)
    inv_freq = np.ascontiguousarray(inv_freq, dtype=np.float64)
    inv_freq.setflags(write=False)
    return inv_freq, float(attention)


@lru_cache(maxsize=512)
def _freq_turns(spec: RopeSpec, seq_len):
    """The per-frequency constants of :func:`rotary.spec.angles.reduced_angles` (inv_freq / 2 pi, split)."""
    return _angles.turns(_inv_freq_and_scaling(spec, seq_len)[0])
