"""rotary: Rotary Position Embedding (RoPE) for NumPy, Numba, CuPy and any array-API library.

``rotary.apply(q, positions)`` rotates q the way HF / Meta / GPT-J / NeoX do; ``RopeSpec`` holds the
frequency and layout conventions (every length-extension rule); ``attention`` and
``linear_attention`` run the attention forms RoPE exists for. Backends import lazily.
"""

__version__ = "0.1.0"

from ._api import apply, apply_qk
from ._attention import attention
from ._diagnostics import convert_layout, decay_curve, permute_weights
from ._linear_attention import LinearAttentionState, linear_attention
from ._positions import grid_positions, mrope_next_positions, mrope_positions
from ._rerotate import rerotate
from ._rope import Rope
from ._spec import LAYOUTS, RopeSpec
from ._tables import clear_cache, set_table_cache_limit, table_cache_info
from .backends import BackendUnavailableError, available_backends

__all__ = [
    "__version__",
    "RopeSpec",
    "LAYOUTS",
    "apply",
    "apply_qk",
    "Rope",
    "rerotate",
    "attention",
    "linear_attention",
    "LinearAttentionState",
    "grid_positions",
    "mrope_positions",
    "mrope_next_positions",
    "decay_curve",
    "convert_layout",
    "permute_weights",
    "available_backends",
    "BackendUnavailableError",
    "clear_cache",
    "set_table_cache_limit",
    "table_cache_info",
]
