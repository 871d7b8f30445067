"""The KV cache: stateless primitives over caller-owned pools and tables (:mod:`.primitives`: ``kv_append``,
``paged_attention``; planned once per step and run per layer in :mod:`.prepared`; engines' tables in
:mod:`.tables`) and :class:`KVCache`, a thin owner of pools, tables and
lengths over them (:mod:`.store`), with its page book (:mod:`.pages`: holder counts, the prefix cache)."""

from .prepared import PreparedKVAppend, PreparedPagedAttention, prepare_kv_append, prepare_paged_attention
from .primitives import kv_append, paged_attention
from .store import KVCache, KVCacheFullError, KVCacheLayer, KVChunk

__all__ = ["KVCache", "KVCacheFullError", "KVCacheLayer", "KVChunk", "PreparedKVAppend", "PreparedPagedAttention",
           "kv_append", "paged_attention", "prepare_kv_append", "prepare_paged_attention"]
