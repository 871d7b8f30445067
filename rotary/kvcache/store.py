"""``rotary.KVCache``: a preallocated cache of rotated keys and values that rotates k as it writes it.

Storage is one pool of *slots* (one token of one sequence), ``(slots, kv_heads, head_dim)`` for keys and
values (plus ``(slots, kv_heads)`` scales when quantized). A sequence's token at position p lives in slot

    slot(b, p) = block_table[b, p // page_size] * page_size + p % page_size

A contiguous cache (``capacity=``) is the special case page_size = capacity with page b given to sequence b,
so its pool is ``(batch, capacity, kv_heads, head_dim)`` seen flat; a paged cache (``page_size=`` +
``num_pages=``) takes pages from a pool as its sequences grow (the pool's arrays grow with the pages in use,
doubling up to ``num_pages``) and gets them back from :meth:`KVCache.free` / :meth:`KVCache.reset`.

:meth:`KVCache.append` rotates the new keys at each sequence's next positions (``lengths[b] ..``) and writes
keys and values into their slots in one backend call (the ``append_kv`` primitive: no intermediate rotated
array); ``rotary.attention(q, cache)`` attends over it (:mod:`rotary.kvcache.attend`).
"""

from __future__ import annotations

import numpy as np

from .. import backends as _backends
from ..backends import kv_entries
from ..frontend.arguments import resolve_spec, table_converter
from ..frontend.positions import normalize_positions
from ..spec import tables as _tables
from ..spec.packing import check_cu_seqlens
from ..spec.rope_spec import RopeSpec

_FLOAT_DTYPES = (np.float16, np.float32, np.float64)
_LAYOUTS = ("bshd", "bhsd")


class KVCacheFullError(ValueError):
    """An append that does not fit: past a sequence's capacity, or no free page left (the cache is unchanged)."""


def _dtype(dtype, name):
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{name} must be a NumPy float dtype (float16/float32/float64), got {dtype!r}") from None
    if dt not in [np.dtype(d) for d in _FLOAT_DTYPES]:
        raise TypeError(f"{name} must be float16, float32 or float64, got {dt}")
    return dt


def _positive(value, name, *, allow_none=False):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


class KVCache:
    """A cache of rotated keys and values for ``batch`` sequences, written by :meth:`append`.

    Parameters
    ----------
    spec : RopeSpec
        How keys are rotated (any spec: scaling rules, partial rotary, interleaved pairs, rotary_offset;
        multi-axis specs take explicit ``positions=`` in :meth:`append`).
    batch, kv_heads, head_dim : int
        Sequences held, key/value heads, head size (keys and values share it).
    capacity : int, optional
        Tokens per sequence of a contiguous cache: storage ``(batch, capacity, kv_heads, head_dim)``.
    page_size, num_pages : int, optional
        A paged cache instead: pages of ``page_size`` tokens from a pool of at most ``num_pages`` pages,
        shared by all sequences (with ``capacity``: also a per-sequence limit; ``num_pages`` then defaults to
        every sequence at capacity). The pool's arrays grow with the pages in use either way.
    dtype : float dtype
        The dtype of the keys/values given to :meth:`append` and returned by :meth:`keys` / attention.
    kv_dtype : None, "int8" or "float8_e4m3"
        Quantized entries with one scale per (token, head) (see :mod:`rotary.backends.kv_entries`).
    backend : "auto", "numpy", "numba" or "cupy"
        Where the cache lives and which kernels write it (CuPy: device arrays).
    layout : "bshd" or "bhsd"
        The axes of the dense k, v and q this cache takes ((n, s, heads, d) or (n, heads, s, d)).
    """

    def __init__(self, spec, *, batch, kv_heads, head_dim, capacity=None, page_size=None, num_pages=None,
                 dtype=np.float32, kv_dtype=None, backend="auto", layout="bshd"):
        if not isinstance(spec, RopeSpec):
            raise TypeError(f"spec must be a rotary.RopeSpec, got {type(spec).__name__}")
        self.batch = _positive(batch, "batch")
        self.kv_heads = _positive(kv_heads, "kv_heads")
        self.head_dim = _positive(head_dim, "head_dim")
        self.spec = resolve_spec(spec, {}, self.head_dim, "the cache's keys")
        self.dtype = _dtype(dtype, "dtype")
        if kv_dtype is not None and kv_dtype not in kv_entries.KV_LIMITS:
            raise ValueError(f"kv_dtype must be None, 'int8' or 'float8_e4m3', got {kv_dtype!r}")
        if kv_dtype == "float8_e4m3" and self.dtype == np.float64:
            raise ValueError("kv_dtype='float8_e4m3' needs dtype float16 or float32 (its entries are rounded from "
                             "float32); use kv_dtype='int8' for float64")
        self.kv_dtype = kv_dtype
        if layout not in _LAYOUTS:
            raise ValueError(f"layout must be one of {_LAYOUTS}, got {layout!r}")
        self.layout = layout
        capacity = _positive(capacity, "capacity", allow_none=True)
        page_size = _positive(page_size, "page_size", allow_none=True)
        num_pages = _positive(num_pages, "num_pages", allow_none=True)
        if page_size is None:
            if num_pages is not None:
                raise ValueError("num_pages needs page_size (a paged cache)")
            if capacity is None:
                raise ValueError("give capacity= (a contiguous cache) or page_size= and num_pages= (a paged cache)")
            self.paged = False
            self.page_size, self.num_pages, self.capacity = capacity, self.batch, capacity
            pages_per_seq = 1
        else:
            if num_pages is None:
                if capacity is None:
                    raise ValueError("a paged cache needs num_pages= (the size of its page pool) or capacity= (then "
                                     "the pool may hold every sequence at capacity)")
                num_pages = self.batch * -(-capacity // page_size)
            self.paged = True
            self.page_size, self.num_pages = page_size, num_pages
            self.capacity = capacity if capacity is not None else page_size * num_pages
            pages_per_seq = -(-self.capacity // page_size)
        probe = np.empty(0, self.dtype)
        self.module = _backends.pick([probe], backend) if backend != "cupy" else _backends.get("cupy")
        self.backend = backend
        self._empty = getattr(self.module, "empty", np.empty)
        self.work = np.float64 if self.dtype == np.float64 else np.float32
        self.lengths = np.zeros(self.batch, dtype=np.int64)
        self.block_table = np.full((self.batch, pages_per_seq), -1, dtype=np.int64)
        self._stores = None
        if self.paged:
            self._free_pages = []
            self._pool_pages = 0
            self._grow_pool(min(self.num_pages, self.batch))
        else:
            self.block_table[:, 0] = np.arange(self.batch)
            self._grow_pool(self.batch)
        self._device_key, self._convert = table_converter(self.module, self._stores[0], None)
        self._dense_key = _tables.dense_key(self.spec, self.work, self._device_key)
        self._array_type = type(self._stores[0])
        self._all_ids = np.arange(self.batch, dtype=np.int64)
        self._all_ids.flags.writeable = False

    # -- storage ------------------------------------------------------------------------------------------
    @property
    def entry_dtype(self):
        """The dtype of the stored entries: the cache's dtype, int8, or uint8 (float8_e4m3fn bits)."""
        return {None: self.dtype, "int8": np.dtype(np.int8), "float8_e4m3": np.dtype(np.uint8)}[self.kv_dtype]

    def _grow_pool(self, pages):
        """Make the pool ``pages`` pages (copying what it holds); new pages join the free list."""
        old = self._stores
        slots = pages * self.page_size
        shape = (slots, self.kv_heads, self.head_dim)
        stores = [self._empty(shape, self.entry_dtype), self._empty(shape, self.entry_dtype), None, None]
        if self.kv_dtype is not None:
            stores[2] = self._empty(shape[:2], self.work)
            stores[3] = self._empty(shape[:2], self.work)
        if old is not None:
            held = old[0].shape[0]
            for new, prev in zip(stores, old):
                if new is not None:
                    new[:held] = prev
        if self.paged:
            self._free_pages.extend(range(pages - 1, self._pool_pages - 1, -1))   # popped lowest first
            self._pool_pages = pages
        self._stores = tuple(stores)

    @property
    def stores(self):
        """(k entries, v entries, k scales, v scales): the pool arrays, scales None unless quantized."""
        return self._stores

    @property
    def nbytes(self) -> int:
        """Bytes of the pool arrays now allocated (a paged cache's grows with the pages in use)."""
        return int(sum(a.nbytes for a in self._stores if a is not None))

    @property
    def free_pages(self) -> int:
        """Pages that appends can still take (the pool's free pages and those it may still grow by)."""
        if not self.paged:
            return 0
        return len(self._free_pages) + self.num_pages - self._pool_pages

    def slots(self, b, start, stop):
        """Slots (host int64) of sequence b's positions start..stop-1 (pages already taken)."""
        p = np.arange(start, stop, dtype=np.int64)
        return self.block_table[b, p // self.page_size] * self.page_size + p % self.page_size

    # -- bookkeeping ----------------------------------------------------------------------------------------
    def _seq_ids(self, seq_ids, n, name="seq_ids"):
        if seq_ids is None:
            if n is not None and n != self.batch:
                raise ValueError(f"{n} sequences given without seq_ids, but the cache holds {self.batch}; "
                                 "pass seq_ids= (which sequences these are)")
            return np.arange(self.batch, dtype=np.int64)
        ids = np.asarray(seq_ids)
        if ids.ndim == 0:
            ids = ids[None]
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise TypeError(f"{name} must be a 1-D integer array (sequence indices), got {ids.dtype} {ids.shape}")
        ids = ids.astype(np.int64)
        bad = np.flatnonzero((ids < 0) | (ids >= self.batch))
        if bad.size:
            raise ValueError(f"{name}[{int(bad[0])}] = {int(ids[bad[0]])} is out of range for a cache of "
                             f"{self.batch} sequences")
        if np.unique(ids).size != ids.size:
            raise ValueError(f"{name} must not repeat a sequence, got {ids.tolist()}")
        if n is not None and ids.size != n:
            raise ValueError(f"{name} names {ids.size} sequences but {n} were given")
        return ids

    def free(self, seq_ids=None):
        """Forget sequences ``seq_ids`` (all when None): their lengths become 0, their pages return to the pool."""
        ids = self._seq_ids(seq_ids, None)
        for b in ids.tolist():
            if self.paged:
                pages = self.block_table[b][self.block_table[b] >= 0]
                self._free_pages.extend(sorted(pages.tolist(), reverse=True))
                self.block_table[b] = -1
            self.lengths[b] = 0

    def reset(self):
        """Empty the cache (every sequence freed)."""
        self.free(None)

    def _take_pages(self, ids, new_lengths):
        """Check that ``new_lengths`` fit (capacity, free pages), then give the sequences their pages."""
        if new_lengths.size and new_lengths.max() > self.capacity:
            over = np.flatnonzero(new_lengths > self.capacity)
            i = int(over[0])
            raise KVCacheFullError(f"sequence {int(ids[i])} would hold {int(new_lengths[i])} tokens, past the cache's "
                                   f"capacity of {self.capacity}; nothing was written")
        if not self.paged:
            return
        ps = self.page_size
        have = -(-self.lengths[ids] // ps)
        need = -(-new_lengths // ps)
        wanted = int(np.sum(need - have))
        if wanted > self.free_pages:
            short = np.flatnonzero(need > have)
            raise KVCacheFullError(f"no free page for sequence {int(ids[short[0]])}: this append needs {wanted} new "
                                   f"pages of {ps} tokens and {self.free_pages} of the pool's {self.num_pages} are "
                                   "free (free finished sequences with cache.free(seq_ids)); nothing was written")
        if wanted > len(self._free_pages):
            in_use = self._pool_pages - len(self._free_pages)
            self._grow_pool(min(self.num_pages, max(2 * self._pool_pages, in_use + wanted)))
        for b, h, n in zip(ids.tolist(), have.tolist(), need.tolist()):
            for j in range(h, n):
                self.block_table[b, j] = self._free_pages.pop()

    # -- writing -------------------------------------------------------------------------------------------------
    def _dense(self, a, name):
        """(n, s, heads, d) view of a dense k/v/q in the cache's layout."""
        if a.ndim != 4:
            raise ValueError(f"{name} must be 4-D ({self.layout}: (n, s, heads, head_dim)), got shape {tuple(a.shape)}"
                             if self.layout == "bshd" else
                             f"{name} must be 4-D (bhsd: (n, heads, s, head_dim)), got shape {tuple(a.shape)}")
        return a if self.layout == "bshd" else a.transpose(0, 2, 1, 3)

    def _check_entries(self, a, name, heads):
        """a's type and dtype are the cache's; its (dense: in the cache's layout) heads and head size are
        ``heads`` and head_dim."""
        if (type(a) is self._array_type and a.dtype == self.dtype and a.ndim == 4 and a.shape[3] == self.head_dim
                and a.shape[2 if self.layout == "bshd" else 1] == heads):
            return   # the common case: a dense array of this cache's type, dtype and heads
        if not hasattr(a, "dtype") or not hasattr(a, "shape"):
            raise TypeError(f"{name} must be an array, got {type(a).__name__}")
        if np.dtype(a.dtype) != self.dtype:
            raise TypeError(f"{name} has dtype {a.dtype} but the cache holds {self.dtype} (cast it, or make the cache "
                            f"with dtype={a.dtype})")
        if not self.module.accepts(a) and self.module is not _backends.get("numpy"):
            raise TypeError(f"{name} is a {type(a).__module__}.{type(a).__name__}; this cache lives on backend "
                            f"{self.module.NAME!r}")
        h = a.shape[1] if a.ndim == 4 and self.layout == "bhsd" else a.shape[-2] if a.ndim >= 2 else None
        if a.ndim < 3 or a.shape[-1] != self.head_dim or (heads is not None and h != heads):
            raise ValueError(f"{name} of shape {tuple(a.shape)} has {h} heads of size {a.shape[-1]}; the cache takes "
                             f"{'' if heads is None else heads} heads of size {self.head_dim} "
                             f"({'(n, s, heads, d)' if self.layout == 'bshd' else '(n, heads, s, d)'}, or packed "
                             "(tokens, heads, d) with cu_seqlens)")

    def append(self, k, v, seq_ids=None, *, cu_seqlens=None, positions=None):
        """Append the next tokens of sequences ``seq_ids`` (all when None): k rotated at each sequence's
        positions ``lengths[b] .. lengths[b] + s - 1`` and written with v into their slots in one pass.

        k, v : (n, s, kv_heads, head_dim) in the cache's layout, or packed (tokens, kv_heads, head_dim) with
        ``cu_seqlens`` (n + 1 offsets, flash-attn's convention: sequence i's tokens cu[i]:cu[i+1]).
        positions : optional rotation positions instead of the lengths ((n, s[, n_axes]), or (tokens[, n_axes])
        packed); required for multi-axis specs (not M-RoPE text). The cache is unchanged when an argument is wrong.
        """
        self._check_entries(k, "k", self.kv_heads)
        self._check_entries(v, "v", self.kv_heads)
        if k.shape != v.shape:
            raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
        if cu_seqlens is None:
            kd, vd = self._dense(k, "k"), self._dense(v, "v")
            n, s = int(kd.shape[0]), int(kd.shape[1])
            ids = self._all_ids if seq_ids is None and n == self.batch else self._seq_ids(seq_ids, n)
            start = self.lengths[ids]
            new_lengths = start + s
            tok_pos = start if s == 1 else (start[:, None] + np.arange(s, dtype=np.int64)).reshape(-1)
            tok_seq = ids if s == 1 else np.repeat(ids, s)
            counts = None
            kt = kd.reshape(n * s, self.kv_heads, self.head_dim)
            vt = vd.reshape(n * s, self.kv_heads, self.head_dim)
        else:
            if k.ndim != 3:
                raise ValueError(f"packed k (with cu_seqlens) must be (tokens, kv_heads, head_dim), got {tuple(k.shape)}")
            cu = check_cu_seqlens(cu_seqlens, int(k.shape[0]), "cu_seqlens")
            counts = np.diff(cu)
            n = counts.size
            ids = self._seq_ids(seq_ids, n)
            start = self.lengths[ids]
            new_lengths = start + counts
            tok_seq = np.repeat(ids, counts)
            tok_pos = np.arange(k.shape[0], dtype=np.int64) + np.repeat(start - cu[:-1], counts)
            kt, vt = k, v
        spec = self.spec
        if positions is None and not spec.multi_axis:
            rot_pos = None   # the token positions themselves
        elif positions is None and spec.mrope_section is None:
            raise ValueError("this multi-axis spec needs positions= (each new key's coordinates) in append")
        else:
            rot_pos = self._rotation_positions(positions, tok_pos, n, counts)
        self._take_pages(ids, new_lengths)   # the last check; from here on the cache changes
        if self.paged:
            slots = self.block_table[tok_seq, tok_pos // self.page_size] * self.page_size + tok_pos % self.page_size
        else:   # page b is sequence b's, page_size = capacity
            slots = tok_seq * self.page_size + tok_pos
        self._write(kt, vt, tok_pos if rot_pos is None else rot_pos, rot_pos is None, slots)
        self.lengths[ids] = new_lengths

    def _rotation_positions(self, positions, tok_pos, n, counts):
        """Host positions (1, T[, n_axes]) the new keys are rotated at: ``positions`` as given (dense
        (n, s[, n_axes]) when ``counts`` is None, else packed (T[, n_axes])), or the tokens' own ``tok_pos``."""
        if positions is None:
            return normalize_positions(tok_pos, (), tok_pos.size, "positions", spec=self.spec)
        p = np.asarray(positions)
        if counts is None:   # (n, s[, n_axes]) -> (T[, n_axes])
            s = tok_pos.size // n if n else 0
            if p.shape[:2] != (n, s):
                raise ValueError(f"positions must have shape ({n}, {s}{', n_axes' if self.spec.multi_axis else ''}) "
                                 f"(one per new token), got {p.shape}")
            p = p.reshape((n * s,) + p.shape[2:])
        return normalize_positions(p, (), tok_pos.size, "positions", spec=self.spec)

    def _write(self, kt, vt, pos, token_positions, slots):
        """One append_kv call: k rotated at ``pos`` (the tokens' own positions, 1-D, when ``token_positions``;
        else normalized (1, T[, n_axes])) into ``slots``, v copied (quantized when the cache is)."""
        table = _tables.cached_dense(self._dense_key) if token_positions and self._dense_key is not None else None
        if table is not None and pos.size and int(pos.max()) < table[0]:
            cos, sin, rows = table[1], table[2], pos   # the shared dense table holds these rows (lookup's own)
        else:
            cos, sin, rows = _tables.lookup(self.spec, pos[None] if token_positions else pos, dtype=self.work,
                                            device_key=self._device_key, convert=self._convert)
            rows = rows.reshape(-1)
        if self._convert is not None:
            slots = self._convert(slots)
            if rows is pos:
                rows = self._convert(rows)
        append = getattr(self.module, "append_kv", None)
        if append is None or self.kv_dtype not in getattr(self.module, "KV_DTYPES", (None,)):
            append = kv_entries.append_kv
        spec = self.spec
        append(kt, vt, cos, sin, rows, slots, self._stores, rotary_dim=spec.rotary_dim, layout=spec.layout,
               offset=spec.rotary_offset, kv_dtype=self.kv_dtype)

    # -- reading -----------------------------------------------------------------------------------------------
    def _gather(self, which, slots):
        """Entries of ``slots`` (host int64) from store ``which`` (0 keys, 1 values), dequantized, cache dtype."""
        store, scale = self._stores[which], self._stores[which + 2]
        idx = self._convert(slots) if self._convert else slots
        entries = store[idx]
        if self.kv_dtype is None:
            return entries
        from array_api_compat import array_namespace

        xp = array_namespace(entries)
        return xp.astype(kv_entries.dequantize(xp, entries, scale[idx], self.kv_dtype, self.work), self.dtype)

    def _seq(self, b):
        ids = self._seq_ids(b, None, "b")
        if ids.size != 1:
            raise ValueError("b must be one sequence index")
        return int(ids[0])

    def keys(self, b):
        """Sequence b's rotated keys ``(lengths[b], kv_heads, head_dim)`` (dequantized), in the cache's dtype."""
        b = self._seq(b)
        return self._gather(0, self.slots(b, 0, int(self.lengths[b])))

    def values(self, b):
        """Sequence b's values ``(lengths[b], kv_heads, head_dim)`` (dequantized), in the cache's dtype."""
        b = self._seq(b)
        return self._gather(1, self.slots(b, 0, int(self.lengths[b])))

    def packed(self, seq_ids):
        """(keys, values, cu_seqlens_k) of sequences ``seq_ids`` packed along one token axis (dequantized)."""
        ids = self._seq_ids(seq_ids, None)
        slots = np.concatenate([self.slots(b, 0, int(self.lengths[b])) for b in ids.tolist()]) if ids.size else \
            np.zeros(0, np.int64)
        cu = np.concatenate([[0], np.cumsum(self.lengths[ids])]).astype(np.int64)
        return self._gather(0, slots), self._gather(1, slots), cu

    def attend(self, q, *, causal=True, seq_ids=None, cu_seqlens=None, q_positions=None, scale=None, window=None,
               softcap=None, block_size=512):
        """``rotary.attention(q, cache, ...)``: attention of q, the last tokens of sequences ``seq_ids``, over their
        own keys (see :func:`rotary.kvcache.attend.cache_attention`)."""
        from .attend import cache_attention

        return cache_attention(q, self, causal=causal, seq_ids=seq_ids, cu_seqlens=cu_seqlens,
                               q_positions=q_positions, scale=scale, window=window, softcap=softcap,
                               block_size=block_size)

    # -- moving keys ---------------------------------------------------------------------------------------------
    def slide(self, *, sinks, window, seq_ids=None):
        """StreamingLLM's cache: keep each sequence's first ``sinks`` tokens and its last ``window`` ones,
        renumbered to positions ``sinks .. sinks + window - 1``; the kept keys move there by
        :func:`rotary.rerotate` (one rotation by the position difference; quantized keys are dequantized,
        moved and quantized again). Sequences holding at most ``sinks + window`` tokens are unchanged."""
        from ..attn.rerotate import rerotate

        sinks = int(sinks)
        window = _positive(window, "window")
        if sinks < 0:
            raise ValueError(f"sinks must be >= 0, got {sinks}")
        if self.spec.multi_axis:
            raise ValueError("slide renumbers 1-D positions; this cache's spec is multi-axis")
        for b in self._seq_ids(seq_ids, None).tolist():
            length = int(self.lengths[b])
            if length <= sinks + window:
                continue
            old_slots = self.slots(b, length - window, length)
            new_slots = self.slots(b, sinks, sinks + window)
            old_pos = np.arange(length - window, length, dtype=np.int64)
            keys = self._gather(0, old_slots)
            moved = rerotate(keys, old_pos, old_pos - (length - window - sinks), spec=self.spec, seq_axis=0,
                             backend=self.backend if self.backend != "auto" else "auto")
            src, dst = (self._convert(a) if self._convert else a for a in (old_slots, new_slots))
            k_store, v_store, k_scale, v_scale = self._stores
            v_store[dst] = v_store[src]
            if self.kv_dtype is None:
                k_store[dst] = moved
            else:
                from array_api_compat import array_namespace

                xp = array_namespace(moved)
                v_scale[dst] = v_scale[src]
                entries, scales = kv_entries.quantize(xp, xp.astype(moved, self.work), self.kv_dtype)
                k_store[dst], k_scale[dst] = entries, scales
            self.lengths[b] = sinks + window
            if self.paged:   # pages past the new length back to the pool
                keep = -(-(sinks + window) // self.page_size)
                pages = self.block_table[b, keep:]
                self._free_pages.extend(sorted(pages[pages >= 0].tolist(), reverse=True))
                self.block_table[b, keep:] = -1

    def __repr__(self):
        kind = (f"paged, page_size={self.page_size}, num_pages={self.num_pages}" if self.paged
                else f"capacity={self.capacity}")
        return (f"KVCache(batch={self.batch}, kv_heads={self.kv_heads}, head_dim={self.head_dim}, {kind}, "
                f"dtype={self.dtype}, kv_dtype={self.kv_dtype!r}, backend={self.module.NAME!r}, "
                f"lengths={self.lengths.tolist()})")
