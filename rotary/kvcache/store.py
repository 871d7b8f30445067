"""``rotary.KVCache``: a thin owner of KV pools, block tables and lengths over the stateless primitives.

Storage is two pools ``(pages, page_size, kv_heads, head_dim)`` of keys and values per layer (vLLM's flash layout;
plus ``(pages, page_size, kv_heads)`` scales when quantized), all layers in one array ``(layers, pages, ...)``
sharing one block table. The flat view of a layer's pool is one *slot* per token of a sequence:

    slot(b, p) = block_table[b, p // page_size] * page_size + p % page_size

A contiguous cache (``capacity=``) is the special case page_size = capacity with page b given to sequence b; a
paged cache (``page_size=`` + ``num_pages=``) takes pages from a pool as its sequences grow (the pools grow with the
pages in use, doubling up to ``num_pages``). Pages have holder counts (:mod:`.pages`): sequences may share pages
(:meth:`KVCache.fork`, prefix reuse through :meth:`KVCache.add`), a shared page is copied before it is written
(copy on write), and a page goes back to the pool when its last holder lets it go, never twice.

A *step* is one round of new tokens for some sequences: its pages are taken and the lengths advanced once, by the
first layer's append (or :meth:`KVCache.reserve`), and every layer then writes the same slots (:meth:`KVCache.append`
with ``layer=``, or through ``cache.layer(i)``) and attends through the same tables. The cache keeps the books; the
writing and reading are the plans of :func:`rotary.kv_append` and :func:`rotary.paged_attention`.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .. import backends as _backends
from ..backends import kv_entries
from ..frontend.arguments import pick_backend, resolve_spec, table_converter
from ..spec.packing import check_cu_seqlens, host_int_array
from ..spec.rope_spec import RopeSpec
from ..spec.validators import as_int
from . import primitives as _kv
from .pages import PageBook

_FLOAT_DTYPES = (np.float16, np.float32, np.float64)
_LAYOUTS = ("bshd", "bhsd")


class KVCacheFullError(ValueError):
    """A call that does not fit: past a sequence's capacity, no free page left, or no free sequence slot (the cache
    is unchanged)."""


class KVChunk(NamedTuple):
    """Keys and values of positions ``start .. start + n - 1`` of one sequence (:meth:`KVCache.export`): keys rotated
    there by ``spec``, both dequantized in the cache's dtype, ``(n, kv_heads, head_dim)`` (``(layers, n, ...)`` for a
    cache made with ``layers=``)."""

    keys: object
    values: object
    start: int
    spec: RopeSpec


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
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


class _Step:
    """The step under way: its sequences, token counts, slots and rotation positions, and the layers written."""

    __slots__ = ("ids", "counts", "dense", "slots", "tok_pos", "done", "left", "start", "was_in_use", "bounds")

    def __init__(self, ids, counts, dense, slots, tok_pos, layers, start, was_in_use):
        self.ids, self.counts, self.dense, self.slots, self.tok_pos = ids, counts, dense, slots, tok_pos
        self.done = [False] * layers   # which layers have written the step
        self.left = layers
        self.start, self.was_in_use = start, was_in_use
        self.bounds = None   # (min, max) of tok_pos when known

    def missing(self) -> list:
        return [i for i, d in enumerate(self.done) if not d]


class _Decode:
    """A chain of decode steps (every sequence, one token each) with nothing else changing the lengths or tables:
    each step's slots are the last one's plus one, except for the sequences whose last page is full, which take a new
    page: at the chain's step t, those at position r (mod page_size) at its first step with (r + t) % page_size == 0
    (``due``). Every other sequence writes into the page it wrote at the step before (its own: taken then, or copied
    on write by the chain's first step; the prefix cache keeps full pages only), so no step of a chain copies on
    write. ``lo``, ``hi``: the last step's smallest and largest position. ``prepared``: the last step's plain append
    (k/v geometry, plan, prepared run, entries shape), which the next step's moves one slot on
    (:meth:`KVCache._append_chained`), or None. ``start``, ``slots``: from the chain's first step on, its own arrays
    of the step's start positions (its keys' rotation rows) and slots, which each step rewrites in place once the
    step is sure to happen: a prepared run reads them when it runs, so the next step's run is the same run
    (``run.moved`` given the arrays it reads returns itself)."""

    __slots__ = ("slots", "start", "lo", "hi", "first", "_due", "t", "prepared", "ones")

    def __init__(self, step):
        self.slots, (self.lo, self.hi), self.first, self._due, self.t = step.slots, step.bounds, step.tok_pos, None, 0
        self.prepared = self.start = None
        self.ones = np.ones_like(step.slots)   # (a step's + 1 as an array: half the time of + a Python int)

    def due(self, page_size):
        """The sequences that take a page at step t (made at the chain's second step: a chain broken after its first
        costs nothing)."""
        if self._due is None:
            self._due = [[] for _ in range(page_size)]
            for b, p in enumerate(self.first.tolist()):
                self._due[p % page_size].append(b)
        return self._due[-self.t % page_size]


class KVCache:
    """A cache of rotated keys and values for ``batch`` sequences, written by :meth:`append`: a thin owner of pools,
    block table and lengths over :func:`rotary.kv_append` and :func:`rotary.paged_attention`.

    Parameters
    ----------
    spec : RopeSpec
        How keys are rotated (any spec: scaling rules, partial rotary, interleaved pairs, rotary_offset;
        multi-axis specs take explicit ``positions=`` in :meth:`append`).
    batch, kv_heads, head_dim : int
        Sequence slots, key/value heads, head size (keys and values share it).
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
    layers : int, optional
        One pool and one block table for this many layers (every layer of a step writes the same slots; see the
        module docstring). Pools, :meth:`export` and :meth:`insert` then have a leading layer axis.
    window : int, optional
        Every layer of this cache is a sliding-window layer: a query at p sees keys ``p - window < t <= p``, and
        pages wholly before every future query's window go back to the pool (positions unchanged, nothing moved).

    Notes
    -----
    ``copy.copy``, ``copy.deepcopy`` and ``pickle`` give independent caches (the pools copied).
    """

    _attends_through_cache = True   # rotary.attention(q, cache) calls its attend

    def __init__(self, spec, *, batch, kv_heads, head_dim, capacity=None, page_size=None, num_pages=None,
                 dtype=np.float32, kv_dtype=None, backend="auto", layout="bshd", layers=None, window=None):
        if not isinstance(spec, RopeSpec):
            raise TypeError(f"spec must be a rotary.RopeSpec, got {type(spec).__name__}")
        self.batch = _positive(batch, "batch")
        self.kv_heads = _positive(kv_heads, "kv_heads")
        self.head_dim = _positive(head_dim, "head_dim")
        self.layers = _positive(layers, "layers", allow_none=True)
        self.window = _positive(window, "window", allow_none=True)
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
        self._lengths = np.zeros(self.batch, dtype=np.int64)
        self._block_table = np.full((self.batch, pages_per_seq), -1, dtype=np.int64)
        self._in_use = np.zeros(self.batch, bool)
        self._tokens = {}      # sequence -> its prompt's token ids (prefix reuse) and the prefix keys of its pages
        self._step = None
        self._pools = self._region = None
        self._book = PageBook(self.num_pages) if self.paged else None
        if self.paged:
            self._grow_pool(min(self.num_pages, self.batch))
        else:
            self._block_table[:, 0] = np.arange(self.batch)
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
        self._xp = None   # the namespace of a device cache's arrays (its q/k norm weights'), None for NumPy
        if self._array_type is not np.ndarray:
            from array_api_compat import array_namespace

            self._xp = array_namespace(probe)
        self._plans = {}
        self._layer_views = {}
        self._q_starts = {}
        self._all_ids = np.arange(self.batch, dtype=np.int64)
        self._all_ids.flags.writeable = False
        self._row_starts = self._all_ids * self.page_size   # a contiguous cache's first slot of each sequence

    # -- storage ------------------------------------------------------------------------------------------
    @property
    def entry_dtype(self):
        """The dtype of the stored entries: the cache's dtype, int8, or uint8 (float8_e4m3fn bits)."""
        return kv_entries.entry_dtype(self.kv_dtype, self.dtype)

    @property
    def _n_layers(self) -> int:
        return self.layers or 1

    def _grow_pool(self, pages):
        """Make the pools ``pages`` pages (copying what they hold); new pages join the free list."""
        old = self._pools
        shape = (self._n_layers, pages, self.page_size, self.kv_heads, self.head_dim)
        parts = [(shape, self.entry_dtype)] * 2 + ([(shape[:4], self.work)] * 2 if self.kv_dtype is not None else [])
        if self._array_type is np.ndarray:   # one host buffer, each pool 64-byte aligned in it: the region
            pools, self._region = _carve(parts)   # an input's memory is tested against (check_memory)
        else:
            pools, self._region = [self._empty(s, dt) for s, dt in parts], None
        pools += [None] * (4 - len(pools))
        if old is not None:
            held = old[0].shape[1]
            for new, prev in zip(pools, old):
                if new is not None:
                    new[:, :held] = prev
        if self.paged:
            self._book.grow(pages)
        self._set_pools(pools)

    def _set_pools(self, pools):
        self._pools = tuple(pools)
        k, v, ks, vs = self._pools
        self._layer_pools = [(k[i], v[i], None if ks is None else (ks[i], vs[i])) for i in range(self._n_layers)]
        self._layer_stores = [_kv.flat_stores(*p) for p in self._layer_pools]
        prepare = getattr(self.module, "prepare_stores", None)   # what the prepared runs take (kept with the pools)
        self._run_stores = self._layer_stores if prepare is None else [
            prepare(st, self.kv_dtype) for st in self._layer_stores]
        self._plans = {}   # plans are per pool geometry
        self._append_memo = None
        self._attend_setups = {}   # plain attend calls' checked arguments, per pools (their plan)
        self._tables_changed()

    def _layer_index(self, layer):
        if type(layer) is int and 0 <= layer < len(self._layer_stores):   # the common case
            return layer
        if layer is None:
            if self.layers is not None and self.layers > 1:
                raise ValueError(f"this cache holds {self.layers} layers: pass layer= (or use cache.layer(i))")
            return 0
        i = as_int(layer, "layer")
        if not 0 <= i < self._n_layers:
            raise ValueError(f"layer must be in [0, {self._n_layers}), got {i}")
        return i

    def layer(self, i) -> "KVCacheLayer":
        """Layer ``i`` of this cache as an object with ``append`` / ``attend`` / ``keys`` / ``values`` (and
        ``rotary.attention(q, cache.layer(i))``)."""
        i = self._layer_index(i)
        view = self._layer_views.get(i)
        if view is None:
            view = self._layer_views[i] = KVCacheLayer(self, i)
        return view

    @property
    def k_pool(self):
        """Keys ``(pages, page_size, kv_heads, head_dim)`` (``(layers, ...)`` with ``layers=``), as kv_append takes them."""
        return self._pools[0] if self.layers is not None else self._pools[0][0]

    @property
    def v_pool(self):
        """Values, shaped as :attr:`k_pool`."""
        return self._pools[1] if self.layers is not None else self._pools[1][0]

    @property
    def scales(self):
        """(k scales, v scales) ``(pages, page_size, kv_heads)`` (with ``layers=``: a leading layer axis) of a
        quantized cache, else None."""
        if self._pools[2] is None:
            return None
        return (self._pools[2], self._pools[3]) if self.layers is not None else (self._pools[2][0], self._pools[3][0])

    @property
    def stores(self):
        """(k entries, v entries, k scales, v scales) of layer 0: the pools' flat slot views, scales None unless
        quantized."""
        return self._layer_stores[0]

    @property
    def nbytes(self) -> int:
        """Bytes of the pool arrays now allocated (a paged cache's grow with the pages in use)."""
        return int(sum(a.nbytes for a in self._pools if a is not None))

    @property
    def free_pages(self) -> int:
        """Pages that appends can still take: free, not yet allocated, or kept by the prefix cache alone."""
        return self._book.available() if self.paged else 0

    @property
    def active(self) -> np.ndarray:
        """The sequence slots in use (added, or appended to, and not freed), ascending."""
        return np.flatnonzero(self._in_use)

    @property
    def lengths(self) -> np.ndarray:
        """Tokens held per sequence ``(batch,)`` int64 (a read-only view: :meth:`truncate` rolls back)."""
        return _read_only(self._lengths)

    @property
    def block_table(self) -> np.ndarray:
        """Pages of each sequence ``(batch, pages per sequence)`` int64, -1 where none (a read-only view: the cache
        keeps the pages' holder counts; :meth:`fork` shares pages)."""
        return _read_only(self._block_table)

    def _tables_changed(self):
        """Lengths or block table changed: the attention prepared for the last ones, the rotation of their queries and
        the decode chain (:class:`_Decode`) are gone."""
        self._attend_memo = self._query_rotation = self._decode = None

    def slots(self, b, start, stop):
        """Slots (host int64) of sequence b's positions start..stop-1 (pages already taken)."""
        p = np.arange(start, stop, dtype=np.int64)
        return self._block_table[b, p // self.page_size] * self.page_size + p % self.page_size

    def _plan(self, arrays, names, capability):
        """The primitives' plan for these inputs over this cache's pools (kept per input geometry)."""
        x = arrays[0]
        key = (capability, type(x), x.dtype, x.shape, x.strides) + ((arrays[1].strides,) if len(arrays) > 1 else ())
        plan = self._plans.get(key)
        if plan is None:
            k_pool, v_pool, scales = self._layer_pools[0]
            plan = _kv.kv_plan(arrays, names, k_pool, v_pool, scales, spec=self.spec, kv_dtype=self.kv_dtype,
                               backend=self.backend, capability=capability)
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

    def _between_steps(self, what):
        if self._step is not None:
            missing = self._step.missing()
            raise ValueError(f"{what} waits for the step under way: layers {missing} have not appended its keys")

    def add(self, tokens=None) -> int:
        """A free sequence slot, now in use (its length 0), or KVCacheFullError when every slot is in use.

        ``tokens`` (a paged cache): the request's prompt token ids. Full pages of it that the cache keeps from
        earlier prompts (the prefix cache, keyed by the token ids of each page and all before it) are shared into
        the new sequence, whose length then counts them (at most all pages but the one holding the last prompt
        token): prefill ``tokens[cache.lengths[slot]:]`` only. The sequence's own full pages of the prompt are
        kept for later requests once written."""
        self._between_steps("add")
        free = np.flatnonzero(~self._in_use)
        if free.size == 0:
            raise KVCacheFullError(f"every one of the cache's {self.batch} sequence slots is in use: free finished "
                                   "sequences with cache.free(seq_ids)")
        b = int(free[0])
        if tokens is not None:
            tokens = [as_int(t, "tokens[i]") for t in tokens]
        self._tables_changed()
        self._in_use[b] = True
        self._lengths[b] = 0
        if tokens is not None and self.paged:
            ps = self.page_size
            keys = PageBook.hashes(tokens, ps, len(tokens) // ps)
            reuse = self._book.lookup(keys[:max(0, (len(tokens) - 1) // ps)])
            self._book.share(reuse)
            self._block_table[b, :len(reuse)] = reuse
            self._lengths[b] = len(reuse) * ps
            self._tokens[b] = [tokens, keys, len(reuse)]   # prompt, its page keys, pages kept so far
        return b

    def free(self, seq_ids=None):
        """Forget sequences ``seq_ids`` (all when None): their lengths become 0, the slots free, each of their pages
        one holder fewer (back to the pool when it has none: never twice)."""
        self._between_steps("free")
        ids = self._seq_ids(seq_ids, None)
        self._tables_changed()
        for b in ids.tolist():
            if self.paged:
                self._book.release(self._block_table[b])
                self._block_table[b] = -1
            self._lengths[b] = 0
            self._in_use[b] = False
            self._tokens.pop(b, None)

    def reset(self):
        """Empty the cache (every sequence freed, the prefix cache emptied)."""
        self._step = None
        self.free(None)
        if self.paged:
            self._book.reset()

    def _fit(self, ids, new_lengths, dry_run=False, longest=None, lengths=None, tokens=None):
        """Check that ``new_lengths`` fit (capacity, free pages, a copy of each shared partial last page), then
        (unless ``dry_run``) give the sequences their pages; returns the pages copied on write [(b, j, old, new)].
        ``longest``: the largest new length, ``lengths``: the sequences' lengths now, ``tokens``: the one count of
        new tokens of every sequence, when the caller has them."""
        if new_lengths.size and (int(new_lengths.max()) if longest is None else longest) > self.capacity:
            over = np.flatnonzero(new_lengths > self.capacity)
            i = int(over[0])
            raise KVCacheFullError(f"sequence {int(ids[i])} would hold {int(new_lengths[i])} tokens, past the cache's "
                                   f"capacity of {self.capacity}; nothing was written")
        if not self.paged:
            return []
        ps, book = self.page_size, self._book
        lengths = self._lengths[ids] if lengths is None else lengths
        used = lengths % ps   # tokens in the last page
        if tokens == 1:   # a decode step: a new page where the last is full, else a write into the last page
            grows = np.flatnonzero(used == 0)
            have, need = lengths // ps, None
            partial = np.flatnonzero(used)
            wanted = grows.size
        else:
            have = -(-lengths // ps)
            need = -(-new_lengths // ps)
            grows = np.flatnonzero(need > have)
            partial = np.flatnonzero((used != 0) & (new_lengths > lengths))   # writes into its last page
            wanted = int((need - have).sum())
        shared = []
        if partial.size and book.maybe_shared:
            last = self._block_table[ids[partial], (lengths[partial] - 1) // ps]
            shared = [(int(ids[x]), (int(lengths[x]) - 1) // ps) for x in partial[book.counts[last] > 1].tolist()]
        wanted += len(shared)
        if not book.has(wanted):
            short = grows if grows.size else np.arange(ids.size)
            raise KVCacheFullError(f"no free page for sequence {int(ids[short[0]])}: this step needs {wanted} new "
                                   f"pages of {ps} tokens and {book.available()} of the pool's {self.num_pages} are "
                                   "free (free finished sequences with cache.free(seq_ids)); nothing was written")
        if dry_run:
            return []
        if wanted > len(book.free_list) and book.allocated < self.num_pages:
            in_use = book.allocated - len(book.free_list)
            self._grow_pool(min(self.num_pages, max(2 * book.allocated, in_use + wanted)))
        copies = []
        for b, j in shared:   # copy on write: the shared partial last page becomes the sequence's own
            old, new = int(self._block_table[b, j]), book.take()
            for pool in self._pools:
                if pool is not None:
                    pool[:, new] = pool[:, old]
            book.release([old])
            self._block_table[b, j] = new
            copies.append((b, j, old, new))
        for x in grows.tolist():
            b, first = int(ids[x]), int(have[x])
            for j in range(first, first + 1 if need is None else int(need[x])):
                self._block_table[b, j] = book.take()
        return copies

    def _begin(self, ids, counts, dense, tok_pos=None):
        """A new step for sequences ``ids`` with ``counts`` new tokens each (dense: one count for all): pages taken
        (the last check: from here on the cache changes), lengths advanced, slots and token positions made."""
        every = ids is self._all_ids
        if every and dense and counts == 1:
            step = self._decode and self._next_decode_step()
            if step is None:
                step = self._begin_general(ids, counts, dense, every)
                self._decode = _Decode(step)
            return step
        return self._begin_general(ids, counts, dense, every)

    def _next_decode_step(self):
        """The decode step (every sequence, one token) after the last one, nothing changed since (``self._decode``):
        each slot one further, a new page for the sequences whose last page is full; None when the step would pass
        the capacity (the general path then raises)."""
        chain = self._decode
        if chain.hi + 2 > self.capacity:
            return None
        chain.t += 1
        due = chain.due(self.page_size) if self.paged else ()
        book = self._book
        if due and not book.has(len(due)):
            chain.t -= 1
            return None   # (the general path raises KVCacheFullError)
        self._attend_memo = self._query_rotation = None   # (_tables_changed, but for the chain)
        if chain.start is None:   # the chain's own arrays (the first step's slots are the general path's step's)
            chain.start, chain.slots = self._lengths.copy(), chain.slots + chain.ones
        else:   # rewritten in place: the last step's run reads them
            np.copyto(chain.start, self._lengths)
            np.add(chain.slots, chain.ones, out=chain.slots)
        start, slots = chain.start, chain.slots
        if due:   # their last page is full: a page each (never a copy on write: see _Decode)
            if len(due) > len(book.free_list) and book.allocated < self.num_pages:
                in_use = book.allocated - len(book.free_list)
                self._grow_pool(min(self.num_pages, max(2 * book.allocated, in_use + len(due))))
                self._decode, chain.prepared = chain, None   # (the chain goes on; its append was planned for the
                # pools before)
            ps = self.page_size
            for b in due:
                page = book.take()
                self._block_table[b, int(start[b]) // ps] = page
                slots[b] = page * ps
        chain.lo, chain.hi = chain.lo + 1, chain.hi + 1
        self._lengths += chain.ones
        if self.window is not None and self.paged:
            self._release_outside_window(self._all_ids, start)
        step = _Step(self._all_ids, 1, True, slots, start, self._n_layers, start, self._in_use.copy())
        step.bounds = (chain.lo, chain.hi)
        self._step = step
        return step

    def _begin_general(self, ids, counts, dense, every):
        """:meth:`_begin` for any step."""
        start = self._lengths.copy() if every else self._lengths[ids]
        bounds = longest = None
        if dense:
            s = int(counts)
            new_lengths = start + s
            tok_seq = ids if s == 1 else np.repeat(ids, s)
            tok_pos = start if s == 1 else (start[:, None] + np.arange(s, dtype=np.int64)).reshape(-1)
            if start.size and s:   # the positions' range, once, for the capacity check and the tables
                lo, hi = _kv.value_range(start)
                bounds, longest = (lo, hi + s - 1), hi + s
        else:
            new_lengths = start + counts
            tok_seq = np.repeat(ids, counts)
            tok_pos = np.arange(int(counts.sum()), dtype=np.int64) + np.repeat(start - (np.cumsum(counts) - counts),
                                                                              counts)
        was_in_use = self._in_use.copy() if every else self._in_use[ids]
        self._fit(ids, new_lengths, longest=longest, lengths=start, tokens=int(counts) if dense else None)
        self._tables_changed()
        if self.paged:
            slots = self._block_table[tok_seq, tok_pos // self.page_size] * self.page_size + tok_pos % self.page_size
        elif every and dense and s == 1:   # page b is sequence b's, page_size = capacity
            slots = self._row_starts + tok_pos
        else:
            slots = tok_seq * self.page_size + tok_pos
        if every:
            self._lengths[...] = new_lengths
            self._in_use[...] = True
        else:
            self._lengths[ids] = new_lengths
            self._in_use[ids] = True
        if self.window is not None and self.paged:
            self._release_outside_window(ids, start)
        step = _Step(ids, counts, dense, slots, tok_pos, self._n_layers, start, was_in_use)
        step.bounds = bounds
        self._step = step
        return step

    def _keep_prefix_pages(self, ids):
        """The prompt pages each sequence has filled, kept in the prefix cache (at the end of a step: every layer
        has written them)."""
        ps = self.page_size
        for b in ids.tolist():
            entry = self._tokens.get(b)
            if entry is None:
                continue
            tokens, keys, kept = entry
            full = min(int(self._lengths[b]), len(tokens)) // ps
            for j in range(kept, full):
                self._book.keep(keys[j], int(self._block_table[b, j]))
            entry[2] = max(kept, full)

    def _release_outside_window(self, ids, first_query):
        """Pages wholly before the window of the step's first query (and so of every later one) back to the pool."""
        ps = self.page_size
        for b, q0 in zip(ids.tolist(), first_query.tolist()):
            gone = max(0, q0 - self.window + 1) // ps
            row = self._block_table[b, :gone]
            if gone and row[-1] >= 0:
                self._book.release(row)
                row[:] = -1

    def reserve(self, seq_ids=None, tokens=1):
        """Start a step without writing: pages for ``tokens`` new tokens of each of sequences ``seq_ids`` (an int for
        all, or one count per sequence) taken and lengths advanced; every layer then appends them
        (``append(..., layer=i)``), layer 0 included."""
        self._between_steps("reserve")
        if isinstance(tokens, (int, np.integer)) and not isinstance(tokens, (bool, np.bool_)):
            ids = self._seq_ids(seq_ids, None)
            if tokens < 0:
                raise ValueError(f"tokens must be >= 0, got {tokens}")
            self._begin(ids, int(tokens), True)
        else:
            counts = host_int_array(tokens, "tokens")
            ids = self._seq_ids(seq_ids, counts.size)
            if counts.ndim != 1 or (counts.size and counts.min() < 0):
                raise ValueError(f"tokens must be an int or one count >= 0 per sequence, got {counts.tolist()}")
            self._begin(ids, counts, False)

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

    def append(self, k, v, seq_ids=None, *, cu_seqlens=None, positions=None, layer=None, k_norm=None, norm_eps=None):
        """Append the next tokens of sequences ``seq_ids`` (all when None): k rotated at each sequence's
        positions ``lengths[b] .. lengths[b] + s - 1`` and written with v into their slots in one pass
        (:func:`rotary.kv_append`'s plan).

        k, v : (n, s, kv_heads, head_dim) in the cache's layout, or packed (tokens, kv_heads, head_dim) with
        ``cu_seqlens`` (n + 1 offsets, flash-attn's convention: sequence i's tokens cu[i]:cu[i+1]).
        positions : optional rotation positions instead of the lengths ((n, s[, n_axes]), or (tokens[, n_axes])
        packed); required for multi-axis specs (not M-RoPE text).
        layer : which layer (a cache made with ``layers=``): the first layer's append of a step takes its pages and
        advances the lengths (unless :meth:`reserve` did), each other layer writes the same slots (the same
        sequences and token counts). The cache is unchanged when an argument is wrong.
        k_norm, norm_eps : the layer's per-head RMSNorm of the keys before RoPE (Qwen3's / Gemma 3's ``k_norm``
        weights, (head_dim,); Gemma's as ``1 + weight``), fused into the append (:func:`rotary.kv_append`).

        The append prepared by the step's first layer (its slots, rotation and the backend's kernel arguments) is
        run by every other layer whose k and v have the same type, dtype, shape and strides (and no seq_ids,
        cu_seqlens or positions): those layers check the layer, the step and the memory rule, nothing else changes.
        """
        norm = None if k_norm is None and norm_eps is None else self._norm(k_norm, norm_eps, "k_norm")
        if seq_ids is None and cu_seqlens is None and positions is None:
            i = 0 if layer is None and self.layers is None else self._layer_index(layer)
            if (self._append_prepared(k, v, i, norm) if self._step is not None else
                    i == 0 and self._append_chained(k, v, norm)):
                return
        self._append(k, v, seq_ids, cu_seqlens, positions, layer, norm)

    def _norm(self, weight, eps, name):
        """The backends' ``norm`` argument of a layer's q_norm / k_norm weights (:func:`rotary.kvcache.primitives.
        norm_argument`)."""
        return _kv.norm_argument(weight, eps, name, self.head_dim, self.work, self._xp)

    def _append_prepared(self, k, v, i, norm=None) -> bool:
        """Layer i's plain append through the append the step's first layer prepared, when k and v are shaped as its
        (the layer, the step and the memory rule checked); False when there is none for them."""
        memo = self._append_memo
        if memo is None or memo[0] is not self._step or type(k) is not self._array_type or \
                type(v) is not self._array_type or memo[1] != (k.dtype, k.shape, k.strides, v.dtype, v.shape, v.strides):
            return False
        step, _, run, shape = memo
        if step.done[i]:
            self._check_step(step, step.ids, step.counts, step.dense, i)   # raises: this layer has appended
        k_pool, v_pool, scales = self._layer_pools[i]
        _kv.check_memory((k, v) if norm is None else (k, v, norm[0]), ("k", "v", "k_norm"), k_pool, v_pool, scales,
                         self._region)
        run(self._tokens_view(k, shape), self._tokens_view(v, shape), self._run_stores[i], norm)
        self._done(step, i)
        return True

    def _tokens_view(self, a, shape):
        """Dense k or v (n, 1, heads, d) in the cache's layout as the (tokens, heads, d) a prepared append takes."""
        return a.reshape(shape) if self.layout == "bshd" else a.transpose(0, 2, 1, 3).reshape(shape)

    def _append_chained(self, k, v, norm=None) -> bool:
        """Layer 0's plain append of the decode step after the decode chain's last (:class:`_Decode`), through that
        step's prepared append moved one slot on (``KVPlan.prepare_append(previous=)``): the memory rule, then the
        step's capacity and pages as the general path checks them; False (nothing changed) when there is no chain or
        k and v are not shaped as its last step's."""
        chain = self._decode
        if chain is None or chain.prepared is None or self._step is not None:
            return False
        parts, plan, run, shape = chain.prepared
        if type(k) is not self._array_type or type(v) is not self._array_type or \
                parts != (k.dtype, k.shape, k.strides, v.dtype, v.shape, v.strides):
            return False
        k_pool, v_pool, scales = self._layer_pools[0]
        _kv.check_memory((k, v) if norm is None else (k, v, norm[0]), ("k", "v", "k_norm"), k_pool, v_pool, scales,
                         self._region)
        step = self._next_decode_step()   # the last check (capacity, pages); from here on the cache changes
        if step is None:
            return False   # (the general path raises)
        if self.layout == "bshd":
            kt, vt = k.reshape(shape), v.reshape(shape)
        else:
            kt, vt = self._tokens_view(k, shape), self._tokens_view(v, shape)
        if chain.prepared is None:   # the pools grew: their plan
            plan, run = self._plan((kt, vt), ("k", "v"), "append_kv"), None
        rotation = self._query_rotation = plan.rotation(step.tok_pos, True, step.bounds)
        run = plan.prepare_append(kt, vt, step.slots, rotation, previous=run)
        run(kt, vt, self._run_stores[0], norm)
        chain.prepared = (parts, plan, run, shape)
        if step.left > 1:
            self._append_memo = (step, parts, run, shape)
        self._done(step, 0)
        return True

    def _append(self, k, v, seq_ids, cu_seqlens, positions, layer, norm=None):
        """:meth:`append`'s checks and the step's books, then its prepared append (kept for the step's other layers
        when the call is a plain one: no seq_ids, cu_seqlens or positions)."""
        i = self._layer_index(layer)
        self._check_type(k, "k")
        self._check_type(v, "v")
        if k.shape != v.shape:
            raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
        if cu_seqlens is None:
            kd, vd = self._dense(k, "k"), self._dense(v, "v")
            n, s = int(kd.shape[0]), int(kd.shape[1])
            step = self._step
            if step is not None and seq_ids is None and n == step.ids.size and step.dense:
                ids = step.ids   # (the step's own; checked against it below)
            else:
                ids = self._all_ids if seq_ids is None and n == self.batch else self._seq_ids(seq_ids, n)
            counts, dense = s, True
            kt = kd.reshape(n * s, kd.shape[2], kd.shape[3])
            vt = vd.reshape(n * s, vd.shape[2], vd.shape[3])
        else:
            if k.ndim != 3:
                raise ValueError(f"packed k (with cu_seqlens) must be (tokens, kv_heads, head_dim), got {tuple(k.shape)}")
            counts = np.diff(check_cu_seqlens(cu_seqlens, int(k.shape[0]), "cu_seqlens"))
            n, dense = counts.size, False
            ids = self._seq_ids(seq_ids, n)
            kt, vt = k, v
        plan = self._plan((kt, vt), ("k", "v"), "append_kv")
        pools = self._layer_pools[i]
        _kv.check_memory((k, v) if norm is None else (k, v, norm[0]), ("k", "v", "k_norm"), pools[0], pools[1],
                         pools[2], self._region)
        step = self._step
        if step is None:
            if i != 0:
                raise ValueError(f"layer {i} appends before layer 0 has started this step: every step starts with "
                                 "layer 0's append (or cache.reserve)")
        else:
            self._check_step(step, ids, counts, dense, i)
        if positions is None and not self.spec.multi_axis:
            pos, token_positions = None, True   # the token positions themselves
        elif positions is None and self.spec.mrope_section is None:
            raise ValueError("this multi-axis spec needs positions= (each new key's coordinates) in append")
        else:
            n_tokens = int(kt.shape[0])
            pos, token_positions = self._given_positions(positions, n_tokens, n, None if dense else counts,
                                                         "positions")
        if step is None:
            step = self._begin(ids, counts, dense)   # the last check (capacity, pages); from here on the cache changes
        rotation = plan.rotation(step.tok_pos if pos is None else pos, token_positions,
                                 step.bounds if pos is None else None)
        if pos is None and step.dense and step.counts == 1 and step.ids is self._all_ids:   # a decode step of all:
            self._query_rotation = rotation   # its queries' positions (lengths - 1) are its keys' (until a change)
        run = plan.prepare_append(kt, vt, step.slots, rotation)
        run(kt, vt, self._run_stores[i], norm)
        if seq_ids is None and cu_seqlens is None and positions is None:
            parts = (k.dtype, k.shape, k.strides, v.dtype, v.shape, v.strides)
            if step.left > 1:
                self._append_memo = (step, parts, run, tuple(kt.shape))
            chain = self._decode
            if chain is not None and chain.slots is step.slots and i == 0 and cu_seqlens is None and pos is None:
                chain.prepared = (parts, plan, run, tuple(kt.shape))   # the decode chain's: the next step moves it
        self._done(step, i)

    def _check_step(self, step, ids, counts, dense, i):
        if step.done[i]:
            raise ValueError(f"layer {i} has appended this step's keys already; the step waits for layers "
                             f"{step.missing()}")
        same = (ids is step.ids or (ids.shape == step.ids.shape and bool(np.all(ids == step.ids)))) and \
            dense == step.dense and (counts == step.counts if dense else np.array_equal(counts, step.counts))
        if not same:
            raise ValueError(f"layer {i}'s append is for other sequences or token counts than this step's (sequences "
                             f"{step.ids.tolist()}): every layer of a step appends the same tokens")

    def _done(self, step, i):
        """Layer i has written the step."""
        step.done[i] = True
        step.left -= 1
        if not step.left:   # every layer has written the step
            self._step = None
            if self._tokens:
                self._keep_prefix_pages(step.ids)

    def fits(self, seq_ids=None, tokens=1) -> bool:
        """Whether a step of ``tokens`` new tokens (an int, or one count per sequence) for sequences ``seq_ids`` fits
        now (capacity, free pages, copies of shared partial pages): what :meth:`reserve` or layer 0's append would
        check, nothing changed (an engine with several caches checks each before it reserves any)."""
        if isinstance(tokens, (int, np.integer)) and not isinstance(tokens, (bool, np.bool_)):
            ids = self._seq_ids(seq_ids, None)
            counts = np.full(ids.size, int(tokens), np.int64)
        else:
            counts = host_int_array(tokens, "tokens")
            ids = self._seq_ids(seq_ids, counts.size)
        try:
            self._fit(ids, self._lengths[ids] + counts, dry_run=True)
        except KVCacheFullError:
            return False
        return True

    def cancel_step(self):
        """Undo the step under way (a :meth:`reserve`, or a step some layers have appended): the sequences' lengths
        and slots back to where they were, the pages it took back to the pool. Nothing happens between steps."""
        step = self._step
        if step is None:
            return
        self._step = None
        self._tables_changed()
        ids = step.ids
        if self.paged:
            keep = -(-step.start // self.page_size)
            for b, k in zip(ids.tolist(), keep.tolist()):
                self._book.release(self._block_table[b, k:])
                self._block_table[b, k:] = -1
        self._lengths[ids] = step.start
        self._in_use[ids] = step.was_in_use

    def _given_positions(self, positions, n_tokens, n, counts, name):
        """Rotation positions given as dense (n, s[, n_axes]) (``counts`` None) or packed (T[, n_axes])."""
        if counts is None and n:
            p = np.asarray(positions) if isinstance(positions, (list, tuple)) else positions
            s = n_tokens // n
            if not hasattr(p, "shape") or tuple(p.shape[:2]) != (n, s):
                raise ValueError(f"{name} must have shape ({n}, {s}{', n_axes' if self.spec.multi_axis else ''}) "
                                 f"(one per new token), got {getattr(p, 'shape', type(p).__name__)}")
            positions = p.reshape((n * s,) + tuple(p.shape[2:]))
        return _kv.token_rotation_positions(self.spec, positions, n_tokens, name)

    # -- reading -----------------------------------------------------------------------------------------------
    def _gather(self, which, slots, layer=0):
        """Entries of ``slots`` (host int64) from store ``which`` (0 keys, 1 values) of ``layer``, dequantized, in
        the cache's dtype."""
        from array_api_compat import array_namespace

        stores = self._layer_stores[layer]
        xp = array_namespace(stores[which])
        idx = self._convert(slots) if self._convert else slots
        values = kv_entries.gather_entries(stores, which, idx, kv_entries.kv_format(self.kv_dtype), self.work)
        return xp.astype(values, self.dtype)

    def _seq(self, b, name="b"):
        ids = self._seq_ids(b, None, name)
        if ids.size != 1:
            raise ValueError(f"{name} must be one sequence index")
        return int(ids[0])

    def held_from(self, b) -> int:
        """The first position whose key sequence b still holds (0 unless a window gave pages back)."""
        b = self._seq(b)
        if not self.paged or self.window is None:
            return 0
        row = self._block_table[b]
        first = int(np.argmax(row >= 0)) if np.any(row >= 0) else 0
        return min(first * self.page_size, int(self._lengths[b]))

    def _check_window_held(self, ids, first_query, window, what):
        """A windowed cache gives back the pages wholly before its queries' windows: refuse ``what`` when the query
        at ``first_query[x]`` of sequence ``ids[x]`` would read a key (from ``first_query - window + 1`` on) whose
        page is gone (a key never held is not read: the kernels index the block table only by held pages)."""
        if self.window is None or not self.paged or not ids.size:
            return
        need = np.maximum(first_query - window + 1, 0)
        held = self._lengths[ids]
        reads = need < held   # a sequence whose query reads a key it holds
        pages = np.minimum(need // self.page_size, self._block_table.shape[1] - 1)
        gone = reads & (self._block_table[ids, pages] < 0)
        if gone.any():
            x = int(np.flatnonzero(gone)[0])
            raise ValueError(f"{what}: sequence {int(ids[x])}'s query at position {int(first_query[x])} reads keys "
                             f"from position {int(need[x])} on, but this cache (window={self.window}) gave their "
                             f"page back (it holds keys from {self.held_from(int(ids[x]))} on); nothing was changed")

    def keys(self, b, layer=None):
        """Sequence b's rotated keys ``(lengths[b] - held_from(b), kv_heads, head_dim)`` (dequantized), in the
        cache's dtype."""
        b, i = self._seq(b), self._layer_index(layer)
        return self._gather(0, self.slots(b, self.held_from(b), int(self._lengths[b])), i)

    def values(self, b, layer=None):
        """Sequence b's values, as :meth:`keys`."""
        b, i = self._seq(b), self._layer_index(layer)
        return self._gather(1, self.slots(b, self.held_from(b), int(self._lengths[b])), i)

    def packed(self, seq_ids, layer=None):
        """(keys, values, cu_seqlens_k) of sequences ``seq_ids`` packed along one token axis (dequantized)."""
        ids, i = self._seq_ids(seq_ids, None), self._layer_index(layer)
        slots = np.concatenate([self.slots(b, self.held_from(b), int(self._lengths[b])) for b in ids.tolist()]) \
            if ids.size else np.zeros(0, np.int64)
        held = np.array([int(self._lengths[b]) - self.held_from(b) for b in ids.tolist()], np.int64)
        cu = np.concatenate([[0], np.cumsum(held)]).astype(np.int64)
        return self._gather(0, slots, i), self._gather(1, slots, i), cu

    def attend(self, q, *, causal=True, seq_ids=None, cu_seqlens=None, q_positions=None, scale=None, window=None,
               softcap=None, block_size=512, layer=None, q_norm=None, norm_eps=None):
        """``rotary.attention(q, cache, ...)``: attention of q, the last tokens of sequences ``seq_ids``, over their
        own keys where they lie (:func:`rotary.paged_attention`'s plan over this cache's block table): query j of
        sequence b sits at position ``lengths[b] - s + j`` and is rotated there (or at ``q_positions``), in the
        attention kernel. A windowed cache attends within its window (``window`` may only narrow it).
        ``q_norm``, ``norm_eps``: the layer's per-head RMSNorm of q before RoPE (Qwen3's / Gemma 3's ``q_norm``), as
        :meth:`append`'s ``k_norm``, applied in the attention kernel as q is read.

        The attention prepared by the first layer after a change of the lengths or tables (its rotation of q, tables
        and the backend's kernel arguments) is run by every other layer whose q has the same type, dtype, shape and
        strides and whose options are the same (and no seq_ids, cu_seqlens or q_positions)."""
        i = self._layer_index(layer)
        norm = None if q_norm is None and norm_eps is None else self._norm(q_norm, norm_eps, "q_norm")
        plain = seq_ids is None and cu_seqlens is None and q_positions is None
        if plain and causal is True and window is None and softcap is None and scale is None:   # the defaults
            o = self._attend_prepared(q, i, norm)
            if o is not None:
                return o
        step = self._step
        if step is not None and not step.done[i]:
            raise ValueError(f"layer {i} attends before appending this step's keys: append them first")
        key = None
        if type(q) is self._array_type and plain:
            if causal is True and window is None and softcap is None and scale is None:
                key = (q.dtype, q.shape, q.strides)
            else:
                key = (q.dtype, q.shape, q.strides, type(causal), causal, type(window), window, type(softcap),
                       softcap, type(scale), scale)
            memo = self._attend_memo
            if memo is not None and memo[0] == key:
                return memo[1](q, self._run_stores[i], norm)
        run = self._prepare_attention(q, key, causal, seq_ids, cu_seqlens, q_positions, scale, window, softcap)
        if key is not None:
            self._attend_memo = (key, run)
        return run(q, self._run_stores[i], norm)

    def _attend_prepared(self, q, i, norm=None):
        """Layer i's attention of q with the default options through the attention prepared for the current tables,
        when q is shaped as its (and the layer has appended the step's keys); None when there is none for it."""
        memo = self._attend_memo
        if memo is None or type(q) is not self._array_type or memo[0] != (q.dtype, q.shape, q.strides):
            return None
        step = self._step
        if step is not None and not step.done[i]:
            return None   # (attend raises)
        return memo[1](q, self._run_stores[i], norm)

    def _attention_setup(self, q, causal, cu_seqlens, scale, window, softcap):
        """What :meth:`attend`'s arguments give whatever the tables: (packed q, counts, dense shape, plan, causal,
        window, softcap, scale), each checked."""
        if self.window is not None:
            if window is None:
                window = self.window
            elif not causal or (isinstance(window, (int, np.integer)) and window > self.window):
                raise ValueError(f"window={window!r}: this cache keeps keys for a window of {self.window} (causal): "
                                 "a call may only narrow it")
        self._check_type(q, "q")
        qp, counts, dense_shape = _kv.packed_queries(q, cu_seqlens, self.layout)
        plan = self._plan((qp,), ("q",), "paged_attention")
        causal, window, softcap, scale = _kv.attention_options(causal, window, softcap, scale, self.spec,
                                                               self.head_dim, self.dtype)
        return qp, counts, dense_shape, plan, causal, window, softcap, scale

    def _prepare_attention(self, q, key, causal, seq_ids, cu_seqlens, q_positions, scale, window, softcap):
        """:meth:`attend`'s checks, then ``run(q, stores) -> o`` for q like this one over the current tables. The
        checks of a plain call (``key``: see :meth:`attend`) are kept across changes of the tables (per pools)."""
        setup = None if key is None else self._attend_setups.get(key)
        if setup is None:
            setup = self._attention_setup(q, causal, cu_seqlens, scale, window, softcap)
            if key is not None:
                if len(self._attend_setups) >= 16:
                    self._attend_setups.clear()
                self._attend_setups[key] = setup
        qp, counts, dense_shape, plan, causal, window, softcap, scale = setup
        ids = self._seq_ids(seq_ids, counts.size)
        every = ids is self._all_ids
        lens = self._lengths if every else self._lengths[ids]   # (the live lengths and table: any change of them
        # drops what is prepared here)
        rotation = self._query_rotation if every and q_positions is None and dense_shape is not None and \
            dense_shape[1] == 1 else None   # one query each after a decode step: at its keys' positions, all held
        if rotation is None:
            lens_range = None
            if dense_shape is not None and lens.size:   # s queries each: every sequence holds them when the shortest does
                lens_range = _kv.value_range(lens)
                if dense_shape[1] > lens_range[0]:
                    _kv.check_query_counts(counts, lens, ids)
            else:
                _kv.check_query_counts(counts, lens, ids)
            rotation = _kv.query_rotation(plan, q_positions, lens, counts, dense_shape, lens_range)
        if self.window is not None and causal:   # (a windowed cache refuses a call that is not causal)
            self._check_window_held(ids, lens - counts, window, "attend")
        q_starts = self._dense_starts(lens.size, dense_shape[1]) if dense_shape is not None else \
            np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        table = self._block_table if every else self._block_table[ids]
        packed_shape = tuple(qp.shape)
        prepared = plan.prepare_attention(_kv.contiguous(qp), table, self.page_size, lens, q_starts, scale=scale,
                                          softcap=softcap, window=window, causal=causal, rotation=rotation)
        if dense_shape is None:
            return lambda q, stores, norm: prepared(_kv.contiguous(q), stores, norm)
        if self.layout == "bshd":   # (n, s, heads, d): packed by a reshape
            def run(q, stores, norm):
                qp = q.reshape(packed_shape)
                return prepared(qp if qp.flags.c_contiguous else qp.copy(), stores, norm).reshape(dense_shape)
        else:
            def run(q, stores, norm):
                qp = q.transpose(0, 2, 1, 3).reshape(packed_shape)
                o = prepared(qp if qp.flags.c_contiguous else qp.copy(), stores, norm).reshape(dense_shape)
                return o.transpose(0, 2, 1, 3)

        return run

    def _dense_starts(self, n, s):
        """The q_starts of n sequences of s queries each, kept per (n, s) (writable, as the kernels' compiled
        signatures take them; nothing writes them)."""
        starts = self._q_starts.get((n, s))
        if starts is None:
            if len(self._q_starts) >= 16:
                self._q_starts.clear()
            starts = self._q_starts[n, s] = _kv.dense_starts(n, s)
        return starts

    # -- sharing and rolling back --------------------------------------------------------------------------------
    def fork(self, src, dst=None, length=None) -> int:
        """Sequence ``dst`` (a free slot taken as :meth:`add` does when None; a slot in use is refused) now holds
        sequence ``src``'s first ``length`` tokens (all by default): beams, parallel sampling, a shared prefix.
        A paged cache shares src's pages (each one holder more: no token copied; a shared partial last page is
        copied when either sequence writes into it); a contiguous cache copies the tokens. Returns dst."""
        self._between_steps("fork")
        src = self._seq(src, "src")
        if not self._in_use[src]:
            raise ValueError(f"src = {src} is not a sequence in use (cache.active: {self.active.tolist()})")
        held = int(self._lengths[src])
        length = held if length is None else as_int(length, "length")
        if not 0 <= length <= held:
            raise ValueError(f"length must be in [0, {held}] (the tokens sequence {src} holds), got {length}")
        if dst is None:
            if self._in_use.all():
                raise KVCacheFullError(f"every one of the cache's {self.batch} sequence slots is in use: free "
                                       "finished sequences with cache.free(seq_ids)")
            dst = int(np.flatnonzero(~self._in_use)[0])
        else:
            dst = self._seq(dst, "dst")
            if self._in_use[dst]:
                raise ValueError(f"dst = {dst} is in use: fork into a free slot (dst=None takes one)")
        self._tables_changed()
        if self.paged:
            pages = -(-length // self.page_size)
            row = self._block_table[src, :pages]
            self._book.share(row)
            self._block_table[dst, :pages] = row
        else:
            for pool in self._pools:
                if pool is not None:
                    pool[:, dst, :length] = pool[:, src, :length]
        self._lengths[dst] = length
        self._in_use[dst] = True
        entry = self._tokens.get(src)
        if entry is not None:
            tokens, keys, kept = entry
            self._tokens[dst] = [tokens, keys, min(kept, length // self.page_size)]
        return dst

    def truncate(self, seq_ids, lengths):
        """Roll sequences ``seq_ids`` back to ``lengths`` tokens (speculative decoding's rejected drafts): pages
        past the new length lose a holder (back to the pool when they have none); the next append writes from
        there."""
        self._between_steps("truncate")
        ids = self._seq_ids(seq_ids, None)
        new = host_int_array(lengths, "lengths")
        new = np.broadcast_to(new, ids.shape) if new.ndim == 0 else new
        if new.shape != ids.shape:
            raise ValueError(f"lengths must be an int or one length per sequence ({ids.size}), got shape {new.shape}")
        held = self._lengths[ids]
        bad = np.flatnonzero((new < 0) | (new > held))
        if bad.size:
            j = int(bad[0])
            raise ValueError(f"lengths[{j}] = {int(new[j])}: sequence {int(ids[j])} holds {int(held[j])} tokens; "
                             "truncate keeps 0 .. its length")
        self._check_window_held(ids, new, self.window, f"truncate to lengths {new.tolist()}")   # the next token's
        self._tables_changed()
        if self.paged:   # the pages wholly past each new length, all sequences at once
            cols = np.arange(self._block_table.shape[1])[None, :]
            past = (cols >= -(-new[:, None] // self.page_size)) & (self._block_table[ids] >= 0)
            if past.any():
                rows = self._block_table[ids]
                self._book.release(rows[past])
                rows[past] = -1
                self._block_table[ids] = rows
        self._lengths[ids] = new
        for b, n in zip(ids.tolist(), new.tolist()) if self._tokens else ():
            entry = self._tokens.get(b)
            if entry is not None:
                entry[2] = min(entry[2], n // self.page_size)

    # -- moving keys ---------------------------------------------------------------------------------------------
    def export(self, seq_id, start=0, stop=None) -> KVChunk:
        """Keys and values of sequence ``seq_id``'s positions ``start .. stop - 1`` as a :class:`KVChunk` (keys rotated
        there, dequantized), to :meth:`insert` into a sequence at another position."""
        b = self._seq(seq_id, "seq_id")
        length = int(self._lengths[b])
        stop = length if stop is None else as_int(stop, "stop")
        start = as_int(start, "start")
        if not self.held_from(b) <= start <= stop <= length:
            raise ValueError(f"start, stop must satisfy {self.held_from(b)} <= start <= stop <= {length} (the "
                             f"positions sequence {b} holds), got {start}, {stop}")
        slots = self.slots(b, start, stop)
        keys = [self._gather(0, slots, i) for i in range(self._n_layers)]
        values = [self._gather(1, slots, i) for i in range(self._n_layers)]
        if self.layers is None:
            return KVChunk(keys[0], values[0], start, self.spec)
        from array_api_compat import array_namespace

        xp = array_namespace(keys[0])
        return KVChunk(xp.stack(keys), xp.stack(values), start, self.spec)

    def insert(self, seq_id, keys, values=None, *, from_position=None, at_position=None):
        """Append a chunk of keys cached at positions ``from_position ..`` (and their values) to sequence ``seq_id``,
        whose length is ``at_position`` (default: its length), by one exact re-rotation of the keys by
        ``at_position - from_position`` (:func:`rotary.rerotate`): a document cached once, reused at any offset.
        ``keys`` may be a :class:`KVChunk` from :meth:`export` (its values, start and spec come with it). Exact for
        every spec whose angles do not depend on the sequence length; dynamic NTK and LongRoPE are refused."""
        from ..attn.rerotate import rerotate

        self._between_steps("insert")
        b = self._seq(seq_id, "seq_id")
        if isinstance(keys, KVChunk):
            if keys.spec != self.spec:
                raise ValueError("keys were rotated by another spec than this cache's (a chunk of another model or "
                                 "layer type): re-rotate them with rotary.rerotate(..., to_spec=cache.spec) first")
            if values is not None or from_position is not None:
                raise ValueError("a KVChunk brings its values and from_position: pass neither")
            keys, values, from_position = keys.keys, keys.values, keys.start
        if values is None or from_position is None:
            raise TypeError("insert needs values= and from_position= (or a KVChunk from cache.export)")
        if self.spec.multi_axis:
            raise ValueError("insert moves keys along 1-D positions; this cache's spec is multi-axis")
        _refuse_length_dependent(self.spec, "insert")
        from_position = as_int(from_position, "from_position")
        length = int(self._lengths[b])
        at_position = length if at_position is None else as_int(at_position, "at_position")
        if at_position != length:
            raise ValueError(f"at_position = {at_position}, but sequence {b} holds {length} tokens: a chunk is "
                             "appended at the sequence's length")
        if from_position < 0:
            raise ValueError(f"from_position must be >= 0, got {from_position}")
        layered = self.layers is not None
        want = 4 if layered else 3
        for a, name in ((keys, "keys"), (values, "values")):
            self._check_type(a, name)
            if a.ndim != want or tuple(a.shape[-2:]) != (self.kv_heads, self.head_dim) or \
                    (layered and a.shape[0] != self.layers):
                shape = "(layers, n, kv_heads, head_dim)" if layered else "(n, kv_heads, head_dim)"
                raise ValueError(f"{name} must be {shape} with {self.kv_heads} heads of {self.head_dim}"
                                 f"{f' and {self.layers} layers' if layered else ''}, got {tuple(a.shape)}")
        if tuple(keys.shape) != tuple(values.shape):
            raise ValueError(f"keys {tuple(keys.shape)} and values {tuple(values.shape)} must have the same shape")
        n = int(keys.shape[-3])
        step = self._begin(np.array([b], np.int64), n, True)
        src = np.arange(from_position, from_position + n, dtype=np.int64)
        for i in range(self._n_layers):
            k_i, v_i = (keys[i], values[i]) if layered else (keys, values)
            moved = rerotate(k_i, src, src + (at_position - from_position), spec=self.spec, seq_axis=0,
                             backend=self.backend)
            self._write_moved(i, step.slots, moved, v_i)
            self._done(step, i)

    def _write_moved(self, layer, dst, keys, values):
        """Write already rotated ``keys`` and ``values`` (cache dtype) into slots ``dst`` of ``layer`` (quantized
        when the cache is)."""
        from array_api_compat import array_namespace

        k_store, v_store, k_scale, v_scale = self._layer_stores[layer]
        dst = self._convert(dst) if self._convert else dst
        if self.kv_dtype is None:
            k_store[dst] = keys
            v_store[dst] = values
            return
        xp = array_namespace(keys)
        for store, scale, a in ((k_store, k_scale, keys), (v_store, v_scale, values)):
            entries, scales = kv_entries.quantize(xp, xp.astype(a, self.work), self.kv_dtype)
            store[dst], scale[dst] = entries, scales

    def slide(self, *, sinks, window, seq_ids=None):
        """StreamingLLM's cache: keep each sequence's first ``sinks`` tokens and its last ``window`` ones,
        renumbered to positions ``sinks .. sinks + window - 1``; the kept keys move there by
        :func:`rotary.rerotate` (one rotation by the position difference; quantized keys are dequantized,
        moved and quantized again). Sequences holding at most ``sinks + window`` tokens are unchanged.
        A spec whose angles depend on the sequence length (dynamic NTK, LongRoPE) cannot move keys: refused."""
        from ..attn.rerotate import rerotate

        self._between_steps("slide")
        sinks = as_int(sinks, "sinks")
        if sinks < 0:
            raise ValueError(f"sinks must be >= 0, got {sinks}")
        window = _positive(window, "window")
        if self.spec.multi_axis:
            raise ValueError("slide renumbers 1-D positions; this cache's spec is multi-axis")
        if self.window is not None:
            raise ValueError("a cache made with window= gives its pages back itself; slide is for a cache without one")
        _refuse_length_dependent(self.spec, "slide")
        ids = self._seq_ids(seq_ids, None)
        if self.paged:
            for b in ids.tolist():
                row = self._block_table[b]
                if int(self._lengths[b]) > sinks + window and np.any(self._book.counts[row[row >= 0]] > 1):
                    raise ValueError(f"slide rewrites sequence {b}'s pages in place, and it shares pages with another "
                                     "sequence or the prefix cache (fork, add(tokens=)): not moved")
        self._tables_changed()
        for b in ids.tolist():
            length = int(self._lengths[b])
            if length <= sinks + window:
                continue
            old_slots = self.slots(b, length - window, length)
            new_slots = self.slots(b, sinks, sinks + window)
            old_pos = np.arange(length - window, length, dtype=np.int64)
            for i in range(self._n_layers):
                keys = self._gather(0, old_slots, i)
                values = self._gather(1, old_slots, i)
                moved = rerotate(keys, old_pos, old_pos - (length - window - sinks), spec=self.spec, seq_axis=0,
                                 backend=self.backend)
                if self.kv_dtype is None:
                    self._write_moved(i, new_slots, moved, values)
                else:   # the values' entries and scales move as they are
                    src, dst = (self._convert(a) if self._convert else a for a in (old_slots, new_slots))
                    k_store, v_store, k_scale, v_scale = self._layer_stores[i]
                    v_store[dst], v_scale[dst] = v_store[src], v_scale[src]
                    from array_api_compat import array_namespace

                    xp = array_namespace(moved)
                    k_store[dst], k_scale[dst] = kv_entries.quantize(xp, xp.astype(moved, self.work), self.kv_dtype)
            self._lengths[b] = sinks + window
            if self.paged:   # pages past the new length back to the pool
                keep = -(-(sinks + window) // self.page_size)
                self._book.release(self._block_table[b, keep:])
                self._block_table[b, keep:] = -1

    # -- copies ----------------------------------------------------------------------------------------------------
    _DERIVED = ("module", "_empty", "_convert", "_array_type", "_xp", "_plans", "_all_ids", "_row_starts",
                "_region", "_layer_pools", "_layer_stores", "_run_stores", "_append_memo", "_attend_memo", "_attend_setups",
                "_layer_views", "_query_rotation", "_decode", "_q_starts")

    def __getstate__(self):
        """What a copy or a pickle holds: every field but the backend module and what derives from it."""
        return {k: v for k, v in self.__dict__.items() if k not in self._DERIVED}

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
        self._set_pools(pools)

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
        extra = "".join(f", {name}={getattr(self, name)}" for name in ("layers", "window")
                        if getattr(self, name) is not None)
        return (f"KVCache(batch={self.batch}, kv_heads={self.kv_heads}, head_dim={self.head_dim}, {kind}{extra}, "
                f"dtype={self.dtype}, kv_dtype={self.kv_dtype!r}, backend={self.module.NAME!r}, "
                f"lengths={self._lengths.tolist()})")


class KVCacheLayer:
    """Layer ``index`` of a :class:`KVCache` (``cache.layer(i)``): its ``append``, ``attend``, ``keys`` and ``values``,
    and ``rotary.attention(q, cache.layer(i))``."""

    __slots__ = ("cache", "index")
    _attends_through_cache = True   # rotary.attention(q, layer) calls its attend

    def __init__(self, cache, index):
        self.cache, self.index = cache, index

    def append(self, k, v, seq_ids=None, *, k_norm=None, norm_eps=None, **kwargs):
        if seq_ids is None and not kwargs:   # a decode step's call
            norm = None if k_norm is None and norm_eps is None else self.cache._norm(k_norm, norm_eps, "k_norm")
            if self.cache._append_prepared(k, v, self.index, norm):
                return None
        return self.cache.append(k, v, seq_ids, layer=self.index, k_norm=k_norm, norm_eps=norm_eps, **kwargs)

    def attend(self, q, *, q_norm=None, norm_eps=None, **kwargs):
        if not kwargs:   # a decode step's call
            norm = None if q_norm is None and norm_eps is None else self.cache._norm(q_norm, norm_eps, "q_norm")
            o = self.cache._attend_prepared(q, self.index, norm)
            if o is not None:
                return o
        return self.cache.attend(q, layer=self.index, q_norm=q_norm, norm_eps=norm_eps, **kwargs)

    def keys(self, b):
        return self.cache.keys(b, layer=self.index)

    def values(self, b):
        return self.cache.values(b, layer=self.index)

    def __getattr__(self, name):   # spec, layout, backend, lengths, ... of the cache
        return getattr(self.cache, name)

    def __repr__(self):
        return f"<layer {self.index} of {self.cache!r}>"


def _read_only(a):
    view = a.view()
    view.flags.writeable = False
    return view


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
