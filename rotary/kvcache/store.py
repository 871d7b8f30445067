"""``rotary.KVCache``: a thin owner of KV pools, block tables and lengths over the stateless primitives.

Storage is two pools ``(pages, page_size, kv_heads, head_dim)`` of keys and values (vLLM's flash layout; plus
``(pages, page_size, kv_heads)`` scales when quantized), whose flat view is one *slot* per token of a sequence.
A sequence's token at position p lives in slot

    slot(b, p) = block_table[b, p // page_size] * page_size + p % page_size

A contiguous cache (``capacity=``) is the special case page_size = capacity with page b given to sequence b; a
paged cache (``page_size=`` + ``num_pages=``) takes pages from a pool as its sequences grow (the pools grow with
the pages in use, doubling up to ``num_pages``) and gets them back from :meth:`KVCache.free` / :meth:`KVCache.reset`.

The cache only keeps books (which pages, how long each sequence is): :meth:`KVCache.append` computes the slots and
positions of the new tokens and runs the plan of :func:`rotary.kv_append`; ``rotary.attention(q, cache)`` runs the
plan of :func:`rotary.paged_attention` over the sequences' rows of the block table (see :mod:`.primitives`).
"""

from __future__ import annotations

import numpy as np

from .. import backends as _backends
from ..backends import kv_entries
from ..frontend.arguments import pick_backend, resolve_spec, table_converter
from ..spec.packing import check_cu_seqlens, host_int_array
from ..spec.rope_spec import RopeSpec
from ..spec.validators import as_int
from . import primitives as _kv

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
    """A cache of rotated keys and values for ``batch`` sequences, written by :meth:`append`: a thin owner of pools,
    block table and lengths over :func:`rotary.kv_append` and :func:`rotary.paged_attention`.

    Parameters
    ----------
    spec : RopeSpec
        How keys are rotated (any spec: scaling rules, partial rotary, interleaved pairs, rotary_offset;
        multi-axis specs take explicit ``positions=`` in :meth:`append`).
    batch, kv_heads, head_dim : int
        Sequences held, key/value heads, head size (keys and values share it).
    capacity : int, optional
        Tokens per sequence of a contiguous cache: pools ``(batch, capacity, kv_heads, head_dim)``.
    page_size, num_pages : int, optional
        A paged cache instead: pages of ``page_size`` tokens from a pool of at most ``num_pages`` pages,
        shared by all sequences (with ``capacity``: also a per-sequence limit; ``num_pages`` then defaults to
        every sequence at capacity). The pools grow with the pages in use either way.
    dtype : float dtype
        The dtype of the keys/values given to :meth:`append` and returned by :meth:`keys` / attention.
    kv_dtype : None, "int8" or "float8_e4m3"
        Quantized entries with one scale per (token, head) (:data:`rotary.backends.kv_entries.KV_FORMATS`).
    backend : "auto", "numpy", "numba" or "cupy"
        Where the cache lives and which kernels write it (CuPy: device arrays). A named backend without the
        kv_dtype raises NotImplementedError; "auto" falls back to NumPy.
    layout : "bshd" or "bhsd"
        The axes of the dense k, v and q this cache takes ((n, s, heads, d) or (n, heads, s, d)).

    Notes
    -----
    ``copy.copy``, ``copy.deepcopy`` and ``pickle`` give independent caches (the pools copied).
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
        fmt = kv_entries.kv_format(kv_dtype)
        if fmt.fp32_work_only and self.dtype == np.float64:
            raise ValueError(f"kv_dtype={kv_dtype!r} needs dtype float16 or float32 (its entries are rounded from "
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
        self.backend = backend
        self._bind_backend()
        self.work = np.dtype(np.float64 if self.dtype == np.float64 else np.float32)
        self.lengths = np.zeros(self.batch, dtype=np.int64)
        self.block_table = np.full((self.batch, pages_per_seq), -1, dtype=np.int64)
        self._pools = self._region = None
        if self.paged:
            self._free_pages = []
            self._pool_pages = 0
            self._grow_pool(min(self.num_pages, self.batch))
        else:
            self.block_table[:, 0] = np.arange(self.batch)
            self._grow_pool(self.batch)

    def _bind_backend(self):
        """The backend module (its append_kv with this kv_dtype; a named backend without it raises) and what
        derives from it; run again when a cache is unpickled (modules are not pickled)."""
        backend = self.backend
        if backend == "auto":
            probe = np.empty(0, self.dtype)
        else:
            probe = getattr(_backends.get(backend), "empty", np.empty)((0,), self.dtype)
        self.module = pick_backend([probe], backend, "append_kv", self.kv_dtype, "kv_dtype")
        self._empty = getattr(self.module, "empty", np.empty)
        self._convert = table_converter(self.module, probe, None)[1]   # host index arrays to the pools' type
        self._array_type = type(probe) if backend != "auto" else np.ndarray
        self._plans = {}
        self._all_ids = np.arange(self.batch, dtype=np.int64)
        self._all_ids.flags.writeable = False

    # -- storage ------------------------------------------------------------------------------------------
    @property
    def entry_dtype(self):
        """The dtype of the stored entries: the cache's dtype, int8, or uint8 (float8_e4m3fn bits)."""
        return kv_entries.entry_dtype(self.kv_dtype, self.dtype)

    def _grow_pool(self, pages):
        """Make the pools ``pages`` pages (copying what they hold); new pages join the free list."""
        old = self._pools
        shape = (pages, self.page_size, self.kv_heads, self.head_dim)
        parts = [(shape, self.entry_dtype)] * 2 + ([(shape[:3], self.work)] * 2 if self.kv_dtype is not None else [])
        if self._array_type is np.ndarray:   # one host buffer, each pool 64-byte aligned in it: the region
            pools, self._region = _carve(parts)   # an input's memory is tested against (check_memory)
        else:
            pools, self._region = [self._empty(s, dt) for s, dt in parts], None
        pools += [None] * (4 - len(pools))
        if old is not None:
            held = old[0].shape[0]
            for new, prev in zip(pools, old):
                if new is not None:
                    new[:held] = prev
        if self.paged:
            self._free_pages.extend(range(pages - 1, self._pool_pages - 1, -1))   # popped lowest first
            self._pool_pages = pages
        self._pools = tuple(pools)
        self._stores = _kv.flat_stores(pools[0], pools[1], self.scales)
        self._plans = {}   # plans are per pool geometry

    @property
    def k_pool(self):
        """Keys ``(pages, page_size, kv_heads, head_dim)`` (entries of the cache's format), as kv_append takes them."""
        return self._pools[0]

    @property
    def v_pool(self):
        """Values ``(pages, page_size, kv_heads, head_dim)``."""
        return self._pools[1]

    @property
    def scales(self):
        """(k scales, v scales) ``(pages, page_size, kv_heads)`` of a quantized cache, else None."""
        return None if self._pools[2] is None else (self._pools[2], self._pools[3])

    @property
    def stores(self):
        """(k entries, v entries, k scales, v scales): the pools' flat slot views, scales None unless quantized."""
        return self._stores

    @property
    def nbytes(self) -> int:
        """Bytes of the pool arrays now allocated (a paged cache's grow with the pages in use)."""
        return int(sum(a.nbytes for a in self._pools if a is not None))

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

    def _plan(self, arrays, names, capability):
        """The primitives' plan for these inputs over this cache's pools (kept per input geometry)."""
        x = arrays[0]
        key = (capability, type(x), x.dtype, x.shape, x.strides) + ((arrays[1].strides,) if len(arrays) > 1 else ())
        plan = self._plans.get(key)
        if plan is None:
            plan = _kv.kv_plan(arrays, names, self._pools[0], self._pools[1], self.scales, spec=self.spec,
                               kv_dtype=self.kv_dtype, backend=self.backend, capability=capability)
            self._plans[key] = plan
        return plan

    # -- bookkeeping ----------------------------------------------------------------------------------------
    def _seq_ids(self, seq_ids, n, name="seq_ids"):
        if seq_ids is None:
            if n is not None and n != self.batch:
                raise ValueError(f"{n} sequences given without seq_ids, but the cache holds {self.batch}; "
                                 "pass seq_ids= (which sequences these are)")
            return self._all_ids
        if isinstance(seq_ids, (int, np.integer)) and not isinstance(seq_ids, (bool, np.bool_)):
            seq_ids = [seq_ids]
        ids = host_int_array(seq_ids, name)
        if ids.ndim != 1:
            raise TypeError(f"{name} must be a 1-D integer array (sequence indices), got shape {ids.shape}")
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
    def _check_type(self, a, name):
        """a is an array of this cache's array type and float dtype (clear errors for anything else)."""
        if type(a) is self._array_type and a.dtype == self.dtype:
            return
        if not hasattr(a, "dtype") or not hasattr(a, "shape"):
            raise TypeError(f"{name} must be an array, got {type(a).__name__}")
        if not isinstance(a, self._array_type):
            raise TypeError(f"{name} is a {type(a).__module__}.{type(a).__name__}; this cache holds "
                            f"{self._array_type.__module__}.{self._array_type.__name__} arrays (backend "
                            f"{self.module.NAME!r}): convert it")
        raise TypeError(f"{name} has dtype {a.dtype} but the cache holds {self.dtype}: cast {name} to {self.dtype}")

    def _dense(self, a, name):
        """(n, s, heads, d) view of a dense k/v in the cache's layout."""
        if a.ndim != 4:
            raise ValueError(f"{name} must be 4-D ({self.layout}: "
                             f"{'(n, s, heads, head_dim)' if self.layout == 'bshd' else '(n, heads, s, head_dim)'}), "
                             f"or packed (tokens, heads, head_dim) with cu_seqlens; got shape {tuple(a.shape)}")
        return a if self.layout == "bshd" else a.transpose(0, 2, 1, 3)

    def append(self, k, v, seq_ids=None, *, cu_seqlens=None, positions=None):
        """Append the next tokens of sequences ``seq_ids`` (all when None): k rotated at each sequence's
        positions ``lengths[b] .. lengths[b] + s - 1`` and written with v into their slots in one pass
        (:func:`rotary.kv_append`'s plan).

        k, v : (n, s, kv_heads, head_dim) in the cache's layout, or packed (tokens, kv_heads, head_dim) with
        ``cu_seqlens`` (n + 1 offsets, flash-attn's convention: sequence i's tokens cu[i]:cu[i+1]).
        positions : optional rotation positions instead of the lengths ((n, s[, n_axes]), or (tokens[, n_axes])
        packed); required for multi-axis specs (not M-RoPE text). The cache is unchanged when an argument is wrong.
        """
        self._check_type(k, "k")
        self._check_type(v, "v")
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
            kt = kd.reshape(n * s, kd.shape[2], kd.shape[3])
            vt = vd.reshape(n * s, vd.shape[2], vd.shape[3])
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
        plan = self._plan((kt, vt), ("k", "v"), "append_kv")
        _kv.check_memory((k, v), ("k", "v"), self._pools[0], self._pools[1], self.scales, self._region)
        if positions is None and not self.spec.multi_axis:
            pos, token_positions = tok_pos, True   # the token positions themselves
        elif positions is None and self.spec.mrope_section is None:
            raise ValueError("this multi-axis spec needs positions= (each new key's coordinates) in append")
        else:
            pos, token_positions = self._given_positions(positions, tok_pos.size, n, counts, "positions")
        self._take_pages(ids, new_lengths)   # the last check; from here on the cache changes
        if self.paged:
            slots = self.block_table[tok_seq, tok_pos // self.page_size] * self.page_size + tok_pos % self.page_size
        else:   # page b is sequence b's, page_size = capacity
            slots = tok_seq * self.page_size + tok_pos
        plan.append(kt, vt, self._stores, slots, pos, token_positions)
        self.lengths[ids] = new_lengths

    def _given_positions(self, positions, n_tokens, n, counts, name):
        """Rotation positions given as dense (n, s[, n_axes]) (``counts`` None) or packed (T[, n_axes]); None: the
        tokens' own (M-RoPE text)."""
        if positions is None:
            positions = np.zeros(0, np.int64)   # (not reached: callers pass token positions then)
        if counts is None and n:
            p = np.asarray(positions) if isinstance(positions, (list, tuple)) else positions
            s = n_tokens // n
            if not hasattr(p, "shape") or tuple(p.shape[:2]) != (n, s):
                raise ValueError(f"{name} must have shape ({n}, {s}{', n_axes' if self.spec.multi_axis else ''}) "
                                 f"(one per new token), got {getattr(p, 'shape', type(p).__name__)}")
            positions = p.reshape((n * s,) + tuple(p.shape[2:]))
        return _kv.token_rotation_positions(self.spec, positions, n_tokens, name)

    # -- reading -----------------------------------------------------------------------------------------------
    def _gather(self, which, slots):
        """Entries of ``slots`` (host int64) from store ``which`` (0 keys, 1 values), dequantized, cache dtype."""
        from array_api_compat import array_namespace

        xp = array_namespace(self._stores[which])
        idx = self._convert(slots) if self._convert else slots
        values = kv_entries.gather_entries(self._stores, which, idx, kv_entries.kv_format(self.kv_dtype), self.work)
        return xp.astype(values, self.dtype)

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
        own keys where they lie (:func:`rotary.paged_attention`'s plan over this cache's block table): query j of
        sequence b sits at position ``lengths[b] - s + j`` and is rotated there (or at ``q_positions``)."""
        self._check_type(q, "q")
        qp, counts, dense_shape = _kv.packed_queries(q, cu_seqlens, self.layout)
        ids = self._seq_ids(seq_ids, counts.size)
        lens = self.lengths[ids]
        _kv.check_query_counts(counts, lens, ids)
        plan = self._plan((qp,), ("q",), "paged_attention")
        causal, window, softcap, scale = _kv.attention_options(causal, window, softcap, scale, self.spec,
                                                               self.head_dim)
        qr = _kv.rotate_queries(plan, qp, q_positions, lens, counts, dense_shape, self.backend)
        q_starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        table = self.block_table if ids is self._all_ids else self.block_table[ids]
        o = plan.attend(qr, self._stores, table, self.page_size, lens, q_starts, scale=scale, softcap=softcap,
                        window=window, causal=causal)
        if dense_shape is None:
            return o
        o = o.reshape(dense_shape)
        return o if self.layout == "bshd" else o.transpose(0, 2, 1, 3)

    # -- moving keys ---------------------------------------------------------------------------------------------
    def slide(self, *, sinks, window, seq_ids=None):
        """StreamingLLM's cache: keep each sequence's first ``sinks`` tokens and its last ``window`` ones,
        renumbered to positions ``sinks .. sinks + window - 1``; the kept keys move there by
        :func:`rotary.rerotate` (one rotation by the position difference; quantized keys are dequantized,
        moved and quantized again). Sequences holding at most ``sinks + window`` tokens are unchanged.
        A spec whose angles depend on the sequence length (dynamic NTK, LongRoPE) cannot move keys: refused."""
        from ..attn.rerotate import rerotate

        sinks = as_int(sinks, "sinks")
        if sinks < 0:
            raise ValueError(f"sinks must be >= 0, got {sinks}")
        window = _positive(window, "window")
        if self.spec.multi_axis:
            raise ValueError("slide renumbers 1-D positions; this cache's spec is multi-axis")
        _refuse_length_dependent(self.spec, "slide")
        for b in self._seq_ids(seq_ids, None).tolist():
            length = int(self.lengths[b])
            if length <= sinks + window:
                continue
            old_slots = self.slots(b, length - window, length)
            new_slots = self.slots(b, sinks, sinks + window)
            old_pos = np.arange(length - window, length, dtype=np.int64)
            keys = self._gather(0, old_slots)
            moved = rerotate(keys, old_pos, old_pos - (length - window - sinks), spec=self.spec, seq_axis=0,
                             backend=self.backend)
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

    # -- copies ----------------------------------------------------------------------------------------------------
    def __getstate__(self):
        """What a copy or a pickle holds: every field but the backend module and what derives from it."""
        state = {k: v for k, v in self.__dict__.items()
                 if k not in ("module", "_empty", "_convert", "_array_type", "_plans", "_all_ids", "_stores",
                              "_region")}
        if not self.paged:
            state.pop("_free_pages", None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._bind_backend()
        pools, self._region = list(self._pools), None
        if self._array_type is np.ndarray:   # back into one buffer (the region check_memory tests first)
            held = [a for a in pools if a is not None]
            carved, self._region = _carve([(a.shape, a.dtype) for a in held])
            for new, a in zip(carved, held):
                new[...] = a
            pools = carved + [None] * (4 - len(carved))
        self._pools = tuple(pools)
        self._stores = _kv.flat_stores(pools[0], pools[1], self.scales)

    def __copy__(self):
        """An independent cache (pools, tables and lengths copied): appending to the copy leaves this one as it is."""
        import copy

        return copy.deepcopy(self)

    def __deepcopy__(self, memo):
        import copy

        new = object.__new__(type(self))
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        return new

    def __repr__(self):
        kind = (f"paged, page_size={self.page_size}, num_pages={self.num_pages}" if self.paged
                else f"capacity={self.capacity}")
        return (f"KVCache(batch={self.batch}, kv_heads={self.kv_heads}, head_dim={self.head_dim}, {kind}, "
                f"dtype={self.dtype}, kv_dtype={self.kv_dtype!r}, backend={self.module.NAME!r}, "
                f"lengths={self.lengths.tolist()})")


def _carve(parts, align=64):
    """Host arrays of these (shape, dtype) parts in one new buffer, each starting at a multiple of ``align``
    bytes; returns (arrays, the buffer)."""
    sizes = [int(np.prod(shape)) * np.dtype(dt).itemsize for shape, dt in parts]
    starts = np.cumsum([0] + [-(-n // align) * align for n in sizes])
    raw = np.empty(int(starts[-1]) + align, np.uint8)
    base = -raw.ctypes.data % align
    arrays = [raw[base + a:base + a + n].view(dt).reshape(shape)
              for (shape, dt), a, n in zip(parts, starts.tolist(), sizes)]
    return arrays, raw


def _refuse_length_dependent(spec, what):
    if spec.depends_on_seq_len:
        raise ValueError(f"{what} moves cached keys to other positions by one re-rotation, exact only for a spec "
                         f"whose angles do not depend on the sequence length; this spec's do ({spec!r}): "
                         "rebuild the keys at their new positions instead")
