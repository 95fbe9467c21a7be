"""Host-side bookkeeping of a paged KV cache's pages: which slot holds which page, what each slot
has been promised, and the prefix cache (full pages found again by their content).

Every page is in one of three states:
  free    in the free list, holding nothing anyone will read;
  held    in the block table of one or more slots (`refs` counts them);
  cached  held by no slot, but its K/V is kept and indexed by content, so that a later prompt
          with the same prefix points its table at it instead of computing it again. Cached
          pages are evicted, least recently used first, only when a slot needs a fresh page and
          the free list is empty: the cache costs nothing when memory is short.

A full page is identified by a hash chained over its tokens and its predecessor's hash, so a hash
names the whole prefix up to the end of that page, wherever it appears. Only full pages are
shared, and a prompt matches at most up to the page before its last token, so a slot always
writes its own pages: shared pages are never written.

Admission stays exact: `reserve` promises a slot every page it may need (shared ones counted
as held), and refuses what free plus cached pages, less what is already promised, cannot cover.
A running sequence therefore never runs out of pages.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib

import numpy as np

from rjax.math.paged_cache import NO_PAGE


class PagesExhaustedError(RuntimeError):
    """A reservation or growth beyond what the pool or the slot's promise holds."""


@dataclasses.dataclass
class PrefixCacheStats:
    lookups: int = 0          # prompts matched against the cache
    hits: int = 0             # of those, prompts that shared at least one page
    pages_reused: int = 0     # pages shared instead of computed
    tokens_saved: int = 0     # prompt tokens not prefilled
    evictions: int = 0        # cached pages given to a new use


def page_hashes(tokens, page_size: int, n_pages: int) -> list[bytes]:
    """Chained hashes of the first n_pages full pages of `tokens`."""
    ids = np.asarray(tokens[: n_pages * page_size], np.int64)
    out, prev = [], b""
    for i in range(n_pages):
        prev = hashlib.blake2b(prev + ids[i * page_size:(i + 1) * page_size].tobytes(), digest_size=16).digest()
        out.append(prev)
    return out


class PageAllocator:
    """The pages of one paged cache: free list, block tables (mirrored in `tables`, copied to the
    device by `set_block_tables`), per-slot reservations and, with `prefix_cache`, the content
    index of full pages."""

    def __init__(self, n_pages: int, n_slots: int, max_pages: int, page_size: int, prefix_cache: bool = False):
        self.n_pages, self.n_slots, self.max_pages, self.page_size = n_pages, n_slots, max_pages, page_size
        self.prefix_cache = prefix_cache
        self._free = list(range(n_pages - 1, -1, -1))  # a stack: low page numbers are used first
        self.tables = np.full((n_slots, max_pages), NO_PAGE, np.int32)
        self.owned = np.zeros(n_slots, np.int64)      # pages in each slot's table
        self.reserved = np.zeros(n_slots, np.int64)   # pages promised to each slot (>= owned)
        self.refs = np.zeros(n_pages, np.int64)       # slots holding each page
        self._hash_of: dict[int, bytes] = {}          # page -> content hash (full, indexed pages)
        self._page_of: dict[bytes, int] = {}          # content hash -> page
        self._cached: collections.OrderedDict[int, None] = collections.OrderedDict()  # idle, oldest first
        self.stats = PrefixCacheStats()

    @property
    def n_free(self) -> int:
        """Pages in the free list (cached pages not counted)."""
        return len(self._free)

    @property
    def n_cached(self) -> int:
        """Pages no slot holds whose K/V is kept for the prefix cache."""
        return len(self._cached)

    @property
    def n_held(self) -> int:
        """Pages some slot holds now."""
        return self.n_pages - self.n_free - self.n_cached

    @property
    def unreserved(self) -> int:
        """Pages a new reservation can take: free and cached pages, less those already promised."""
        return self.n_free + self.n_cached - int((self.reserved - self.owned).sum())

    def pages_for(self, n_positions: int) -> int:
        return -(-n_positions // self.page_size)

    def match(self, tokens) -> list[int]:
        """Cached pages holding a prefix of `tokens`, in order (empty without the prefix cache).
        The page with the last token is never matched: that token is prefilled for its logits."""
        if not self.prefix_cache:
            return []
        return self.match_hashes(page_hashes(tokens, self.page_size, (len(tokens) - 1) // self.page_size))

    def match_hashes(self, hashes) -> list[int]:
        """Cached pages for the leading `hashes` (chained page hashes) that the cache holds."""
        pages = []
        for h in hashes[: self.max_pages]:
            page = self._page_of.get(h)
            if page is None:
                break
            pages.append(page)
        return pages

    def fits(self, n_pages: int, shared=()) -> bool:
        """Whether `reserve(slot, n_pages, shared)` would succeed for an empty slot."""
        idle = sum(p in self._cached for p in shared)
        return n_pages <= self.max_pages and n_pages - len(shared) + idle <= self.unreserved

    def reserve(self, slot: int, n_pages: int, shared=()) -> None:
        """Promise `slot` (holding nothing) n_pages pages in all, the first of them the cached
        pages `shared` (from `match`), which its table takes at once. Raises
        PagesExhaustedError when the pool cannot promise them."""
        if self.reserved[slot] or self.owned[slot]:
            raise ValueError(f"slot {slot} already holds a reservation; release it first")
        if n_pages > self.max_pages:
            raise PagesExhaustedError(f"slot {slot}: {n_pages} pages requested, a slot's block table has "
                                      f"{self.max_pages} ({self.max_pages * self.page_size} positions)")
        if len(shared) > n_pages:
            raise ValueError(f"slot {slot}: {len(shared)} shared pages exceed the {n_pages} reserved")
        if not self.fits(n_pages, shared):
            raise PagesExhaustedError(f"slot {slot}: {n_pages - len(shared)} pages requested, {self.unreserved} "
                                      f"of {self.n_pages} are unreserved")
        for col, page in enumerate(shared):
            self._cached.pop(page, None)
            self.refs[page] += 1
            self.tables[slot, col] = page
        self.owned[slot], self.reserved[slot] = len(shared), n_pages
        if self.prefix_cache:
            self.stats.lookups += 1
            self.stats.hits += bool(shared)
            self.stats.pages_reused += len(shared)
            self.stats.tokens_saved += len(shared) * self.page_size

    def _take(self) -> int:
        if self._free:
            return self._free.pop()
        page, _ = self._cached.popitem(last=False)  # the least recently used cached page
        del self._page_of[self._hash_of.pop(page)]
        self.stats.evictions += 1
        return page

    def grow(self, slot: int, n_positions: int) -> bool:
        """Give `slot` pages for positions 0 .. n_positions - 1 (within its reservation).
        -> whether its table changed. Raises PagesExhaustedError beyond the reservation."""
        need = self.pages_for(n_positions)
        if need <= self.owned[slot]:
            return False
        if need > self.reserved[slot]:
            raise PagesExhaustedError(f"slot {slot}: {n_positions} positions need {need} pages, "
                                      f"beyond its reservation of {int(self.reserved[slot])}")
        for col in range(int(self.owned[slot]), need):
            page = self._take()
            self.refs[page] = 1
            self.tables[slot, col] = page
        self.owned[slot] = need
        return True

    def register(self, slot: int, tokens) -> None:
        """Index the full pages of `slot` that hold the K/V of `tokens` (positions 0 ..
        len(tokens) - 1 of the slot), so that later prompts can share them."""
        if not self.prefix_cache:
            return
        n = min(len(tokens) // self.page_size, int(self.owned[slot]))
        for col, h in enumerate(page_hashes(tokens, self.page_size, n)):
            page = int(self.tables[slot, col])
            if page in self._hash_of or h in self._page_of:
                continue  # already indexed, or the same content computed twice: this copy stays private
            self._hash_of[page], self._page_of[h] = h, page

    def release(self, slot: int) -> None:
        """Drop `slot`'s hold on its pages and its reservation. A page no slot holds any more
        goes to the prefix cache if it is indexed, else to the free list."""
        n = int(self.owned[slot])
        for page in (int(p) for p in self.tables[slot, :n][::-1]):
            self.refs[page] -= 1
            if self.refs[page]:
                continue
            if page in self._hash_of:
                self._cached[page] = None   # most recently used last
            else:
                self._free.append(page)
        self.tables[slot] = NO_PAGE
        self.owned[slot] = 0
        self.reserved[slot] = 0

    def clear_cache(self) -> None:
        """Forget every cached page (they return to the free list); held pages stay indexed."""
        for page in self._cached:
            del self._page_of[self._hash_of.pop(page)]
            self._free.append(page)
        self._cached.clear()
