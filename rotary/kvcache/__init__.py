"""The KV cache: rotated keys and values written in one pass (:mod:`.store`), attention over it (:mod:`.attend`)."""

from .store import KVCache, KVCacheFullError

__all__ = ["KVCache", "KVCacheFullError"]
