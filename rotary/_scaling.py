"""Length-extension rules: scaled inverse frequencies and attention factors (float64, host).

Every rule maps the base frequencies ``omega_i = base**(-2i/d)`` (d = rotary_dim,
i = 0..d/2-1) to scaled ones, and gives the attention factor ``A`` that HF multiplies
into cos and sin. Parameter names are HF's (``rope_scaling`` / ``rope_parameters``).

Public to the package (used by ``_spec.py`` only):

- ``ROPE_TYPES``
- ``canonical_scaling(scaling, *, rotary_dim, head_dim, base, max_position_embeddings)`` -> hashable, validated
- ``scaled_inv_freq(base, rotary_dim, scaling, *, seq_len, max_position_embeddings, head_dim)``
  -> (inv_freq float64 array of length d/2, attention_scaling float)
- ``depends_on_seq_len(scaling)`` -> bool
- ``spec_kwargs_from_hf_config(config)`` -> dict of RopeSpec keyword arguments
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

ROPE_TYPES = ("default", "linear")


def _freeze(value: Any) -> Any:
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), _freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple, np.ndarray)):
        return tuple(_freeze(v) for v in (value.tolist() if isinstance(value, np.ndarray) else value))
    return value


def canonical_scaling(scaling, *, rotary_dim: int, head_dim: int, base: float, max_position_embeddings):
    """Validate ``scaling`` and return it as a sorted tuple of (key, value) pairs (hashable), or None."""
    if scaling is None:
        return None
    if isinstance(scaling, tuple):
        scaling = dict(scaling)
    if not isinstance(scaling, Mapping):
        raise TypeError(f"scaling must be a dict like {{'rope_type': 'linear', 'factor': 2.0}} or None, got {type(scaling).__name__}")
    params = dict(scaling)
    rope_type = params.pop("rope_type", params.pop("type", None))
    if rope_type is None:
        raise ValueError("scaling must have a 'rope_type' key (one of %s)" % ", ".join(ROPE_TYPES))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"scaling['rope_type'] must be one of {', '.join(ROPE_TYPES)}; got {rope_type!r}")
    if rope_type == "default":
        return None
    if rope_type == "linear":
        factor = params.get("factor")
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not factor >= 1.0:
            raise ValueError(f"scaling['factor'] must be a float >= 1 for rope_type 'linear'; got {factor!r}")
    params["rope_type"] = rope_type
    return _freeze(params)


def depends_on_seq_len(scaling) -> bool:
    return False


def scaled_inv_freq(base: float, rotary_dim: int, scaling, *, seq_len, max_position_embeddings, head_dim):
    """Return (inv_freq, attention_scaling); inv_freq_i = base**(-2i/d), then the rule."""
    inv_freq = 1.0 / (float(base) ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim))
    if scaling is None:
        return inv_freq, 1.0
    params = dict(scaling)
    if params["rope_type"] == "linear":
        return inv_freq / float(params["factor"]), 1.0
    raise AssertionError(params["rope_type"])


def spec_kwargs_from_hf_config(config: Mapping) -> dict:
    """RopeSpec keyword arguments from an HF config dict (4.x ``rope_scaling`` or 5.x ``rope_parameters``)."""
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a dict (an HF config.json), got {type(config).__name__}")
    params = dict(config.get("rope_parameters") or {})
    base = params.pop("rope_theta", config.get("rope_theta", 10000.0))
    scaling = params or config.get("rope_scaling")
    head_dim = config.get("head_dim")
    if head_dim is None:
        try:
            head_dim = config["hidden_size"] // config["num_attention_heads"]
        except KeyError as exc:
            raise ValueError("config needs 'head_dim' or both 'hidden_size' and 'num_attention_heads'") from exc
    prf = params.pop("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    rotary_dim = int(head_dim * prf)
    if scaling and dict(scaling).get("rope_type", dict(scaling).get("type")) == "default":
        scaling = None
    return dict(head_dim=int(head_dim), rotary_dim=rotary_dim, base=float(base), scaling=scaling,
                max_position_embeddings=config.get("max_position_embeddings"))
