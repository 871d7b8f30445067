"""rotary: Rotary Position Embedding (RoPE) for NumPy, Numba, CuPy and any array-API library.

``rotary.apply(q, positions)`` rotates q the way HF / Meta / GPT-J / NeoX do; ``RopeSpec`` holds the
frequency and layout conventions (every length-extension rule); ``attention`` and
``linear_attention`` run the attention forms RoPE exists for. Backends import lazily.
"""

__version__ = "0.1.0"

from .frontend.rotate import apply, apply_qk
from .attn.softmax import attention
from .spec.diagnostics import convert_layout, decay_curve, permute_weights
from .attn.linear import LinearAttentionState, linear_attention
from .spec.positions import context_parallel_positions, grid_positions, mrope_next_positions, mrope_positions
from .attn.rerotate import rerotate
from .attn.bound import BoundSpec, bind
from .frontend.rope import Rope
from .kvcache import KVCache, KVCacheFullError, kv_append, paged_attention, prepare_kv_append, prepare_paged_attention
from .spec.rope_spec import LAYOUTS, RopeSpec
from .spec.tables import clear_cache, set_table_cache_limit, table_cache_info
from .backends import BackendUnavailableError, available_backends

__all__ = [
    "__version__",
    "RopeSpec",
    "LAYOUTS",
    "apply",
    "apply_qk",
    "Rope",
    "KVCache",
    "KVCacheFullError",
    "kv_append",
    "paged_attention",
    "prepare_kv_append",
    "prepare_paged_attention",
    "bind",
    "BoundSpec",
    "rerotate",
    "attention",
    "linear_attention",
    "LinearAttentionState",
    "grid_positions",
    "mrope_positions",
    "mrope_next_positions",
    "context_parallel_positions",
    "decay_curve",
    "convert_layout",
    "permute_weights",
    "available_backends",
    "BackendUnavailableError",
    "clear_cache",
    "set_table_cache_limit",
    "table_cache_info",
]

#: submodules imported on first attribute access (``rotary.testing``, ``rotary.conformance.check``), so
#: ``import rotary`` stays cheap
_LAZY_SUBMODULES = ("testing", "conformance")


def __getattr__(name):
    if name in _LAZY_SUBMODULES:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY_SUBMODULES))


from .interop import torch_hook as _torch_hook   # noqa: E402

_torch_hook.install()   # rotary's torch.compile handlers once torch._dynamo loads (imports nothing now)
