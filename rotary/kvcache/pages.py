"""The page book of a paged :class:`rotary.KVCache`: which pages are free, how many holders each page has, and the
prefix cache (full pages keyed by the token ids they hold).

A page's *count* is the number of holders: each sequence whose block table names it, plus the prefix cache when
it keeps the page for later requests. A page goes back to the free list when its count reaches 0, never twice.
A full page of a prompt is kept under the hash of its tokens and of every token before it (vLLM's and SGLang's
prefix key: equal keys, equal keys and values); a new request whose prompt starts with kept pages shares them.
Pages only the prefix cache holds are given back, least recently used first, when the pool has no free page.
"""

from __future__ import annotations

import numpy as np


class PageBook:
    """Free pages, holder counts and the prefix cache of a pool of at most ``num_pages`` pages, of which the first
    ``allocated`` exist (the pool's arrays grow; :meth:`grow` adds pages to the free list)."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self.allocated = 0
        self.free_list: list = []                       # popped from the end: lowest page first
        self.counts = np.zeros(num_pages, np.int64)     # holders of each page
        self.prefix: dict = {}                          # hash of (tokens so far) -> page, least recently used first
        self.hash_of: dict = {}                         # page -> its prefix hash
        self.maybe_shared = False                       # False: no page has two holders (a step skips the test)

    # -- sizes ---------------------------------------------------------------------------------------------------
    def available(self) -> int:
        """Pages a request can still get: free, not yet allocated, or held by the prefix cache alone."""
        kept_only = int(np.count_nonzero(self.counts[list(self.prefix.values())] == 1)) if self.prefix else 0
        return len(self.free_list) + self.num_pages - self.allocated + kept_only

    def has(self, pages: int) -> bool:
        """Whether ``pages`` pages are :meth:`available` (the prefix cache counted only when the rest is short: a
        decode step's check stays O(1))."""
        return pages <= len(self.free_list) + self.num_pages - self.allocated or pages <= self.available()

    def grow(self, pages: int) -> None:
        """The pool now has ``pages`` pages: the new ones join the free list."""
        self.free_list.extend(range(pages - 1, self.allocated - 1, -1))
        self.allocated = pages

    # -- holders -------------------------------------------------------------------------------------------------
    def take(self) -> int:
        """A free page with one holder (evicting the least recently used page only the prefix cache holds when the
        free list is empty; the caller made sure one is available)."""
        if not self.free_list:
            for h, page in self.prefix.items():
                if self.counts[page] == 1:
                    self._forget(h, page)
                    self.counts[page] = 0
                    self.free_list.append(page)
                    break
        page = self.free_list.pop()
        self.counts[page] = 1
        return page

    def share(self, pages) -> None:
        """One holder more for each entry of ``pages`` that is >= 0 (a page named twice: two holders more)."""
        pages = np.asarray(pages, np.int64)
        held = pages[pages >= 0]
        np.add.at(self.counts, held, 1)
        self.maybe_shared = self.maybe_shared or bool(held.size)

    def release(self, pages) -> None:
        """One holder fewer for each entry of ``pages`` that is >= 0 (block table entries of one or several
        sequences: a page named twice loses two holders); a page no one holds is free."""
        pages = np.asarray(pages, np.int64)
        pages = pages[pages >= 0]
        if pages.size == 0:
            return
        np.subtract.at(self.counts, pages, 1)
        freed = np.unique(pages[self.counts[pages] == 0])
        self.free_list.extend(freed[::-1].tolist())
        if self.maybe_shared:
            self.maybe_shared = bool(np.any(self.counts > 1))

    def reset(self) -> None:
        """Every page free, the prefix cache empty."""
        self.counts[:] = 0
        self.maybe_shared = False
        self.prefix.clear()
        self.hash_of.clear()
        self.free_list = list(range(self.allocated - 1, -1, -1))

    # -- the prefix cache ----------------------------------------------------------------------------------------
    @staticmethod
    def hashes(tokens, page_size: int, pages: int) -> list:
        """The prefix keys of the first ``pages`` full pages of ``tokens``: each the hash of the previous key and
        the page's token ids."""
        keys, h = [], None
        for j in range(pages):
            h = hash((h, tuple(tokens[j * page_size:(j + 1) * page_size])))
            keys.append(h)
        return keys

    def lookup(self, keys) -> list:
        """The kept pages of the longest run of ``keys`` from the first (each marked most recently used)."""
        pages = []
        for h in keys:
            page = self.prefix.get(h)
            if page is None:
                break
            self.prefix[h] = self.prefix.pop(h)   # most recently used: to the end
            pages.append(page)
        return pages

    def keep(self, key, page: int) -> None:
        """Keep ``page`` under prefix key ``key`` (the cache holds it too) unless a page is kept under it already."""
        if key in self.prefix or page in self.hash_of:
            return
        self.prefix[key] = page
        self.hash_of[page] = key
        self.counts[page] += 1
        self.maybe_shared = self.maybe_shared or self.counts[page] > 1

    def _forget(self, key, page) -> None:
        del self.prefix[key]
        del self.hash_of[page]

    def kept(self) -> int:
        """Pages the prefix cache keeps."""
        return len(self.prefix)
