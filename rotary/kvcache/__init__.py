"""The KV cache: stateless primitives over caller-owned pools and tables (:mod:`.primitives`: ``kv_append``,
``paged_attention``) and :class:`KVCache`, a thin owner of pools, tables and lengths over them (:mod:`.store`)."""

from .primitives import kv_append, paged_attention
from .store import KVCache, KVCacheFullError

__all__ = ["KVCache", "KVCacheFullError", "kv_append", "paged_attention"]
