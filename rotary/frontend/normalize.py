"""The one normaliser's vocabulary, in one import: every entry point (``apply``, ``apply_qk``, ``Rope``,
``attention``, ``linear_attention``, ``rerotate``) parses its inputs with these, each idea in its own module:

- :mod:`.arguments`: the array namespace, the spec (``spec=`` or its keywords), the backend and its tables;
- :mod:`.axes`: ``seq_axis`` and the canonical ``(B, S, H, D)`` view;
- :mod:`.positions`: every form of positions -> int64 (or float64) host rows ``(Bp, S[, n])``;
- :mod:`.buffers`: ``out=`` buffers and the memory-overlap rules;
- :mod:`.plan`: what a rotation call proves of its geometry, built once and reused (apply, apply_qk, Rope).
"""

from __future__ import annotations

from ..spec.validators import check_float, to_numpy  # noqa: F401
from .arguments import namespace, pick_backend, resolve_spec, table_converter  # noqa: F401
from .axes import (canonical, canonical_axes, canonical_layout, canonical_shape, canonical_view,  # noqa: F401
                   from_canonical, normalize_seq_axis, to_canonical)
from .buffers import check_cross_overlap, check_out, overlaps, same_view  # noqa: F401
from .positions import (next_position, normalize_positions, offset_positions, packed_positions,  # noqa: F401
                        prepared_rows, spread_positions, start_positions)
