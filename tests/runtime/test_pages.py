"""The page allocator's prefix cache on the host: matching, sharing, refcounts, eviction."""
from __future__ import annotations

import numpy as np
import pytest

from rjax.runtime.pages import NO_PAGE, PageAllocator, PagesExhaustedError, page_hashes

PS = 4


def _alloc(n_pages=8, n_slots=3, max_pages=4, prefix_cache=True):
    return PageAllocator(n_pages, n_slots, max_pages, PS, prefix_cache=prefix_cache)


def _run(a, slot, tokens, total, shared=()):
    """Admit `tokens` into `slot` with room for `total` positions, as the serving engine does."""
    a.reserve(slot, a.pages_for(total), shared)
    a.grow(slot, len(tokens))


def test_hashes_chain_over_the_prefix():
    a = page_hashes(list(range(12)), PS, 3)
    b = page_hashes([99] + list(range(1, 12)), PS, 3)
    assert len(set(a)) == 3
    # Pages 2 and 3 hold the same tokens in both, but their prefixes differ: other hashes.
    assert all(x != y for x, y in zip(a, b))
    assert page_hashes(list(range(12)), PS, 2) == a[:2]


def test_match_shares_full_pages_but_never_the_last_token():
    a = _alloc()
    prompt = list(range(10))                    # pages [0-3], [4-7], partial [8, 9]
    _run(a, 0, prompt, 12)
    a.register(0, prompt)
    assert a.match(prompt) == list(a.tables[0, :2])
    assert a.match(list(range(8))) == [a.tables[0, 0]]   # the page with token 7 is prefilled again
    assert a.match(list(range(9))) == list(a.tables[0, :2])
    assert a.match([0, 1, 2, 9, 4, 5, 6, 7, 8]) == []
    assert a.match(list(range(4)) + [50, 51, 52, 53, 54]) == [a.tables[0, 0]]


def test_shared_pages_are_refcounted_and_cached_after_release():
    a = _alloc()
    prompt = list(range(9))
    _run(a, 0, prompt, 12)
    a.register(0, prompt)
    shared = a.match(prompt + [100])
    assert len(shared) == 2
    _run(a, 1, prompt + [100], 12, shared)
    assert list(a.tables[1, :2]) == shared and a.tables[1, 2] not in shared
    assert list(a.refs[shared]) == [2, 2]
    a.release(0)
    assert list(a.refs[shared]) == [1, 1] and a.n_cached == 0
    a.release(1)
    assert a.refs.sum() == 0 and a.n_cached == 2 and a.n_held == 0
    assert a.n_free + a.n_cached == a.n_pages and a.unreserved == a.n_pages
    assert a.stats.hits == 1 and a.stats.pages_reused == 2 and a.stats.tokens_saved == 8
    assert a.match(prompt) == shared  # still found after both released


def test_cached_pages_are_evicted_lru_only_when_the_free_list_is_empty():
    a = _alloc(n_pages=4, max_pages=4)
    first, second = list(range(5)), list(range(20, 25))
    _run(a, 0, first, 5)
    a.register(0, first)
    a.release(0)
    _run(a, 0, second, 5)
    a.register(0, second)
    a.release(0)
    assert a.n_cached == 2 and a.n_free == 2 and a.unreserved == 4
    # Three new pages: both free ones, then the least recently used cached page (first's).
    _run(a, 1, list(range(40, 49)), 12)
    assert a.stats.evictions == 1
    assert a.match(first) == [] and len(a.match(second)) == 1


def test_reservations_stay_exact_with_shared_pages():
    a = _alloc(n_pages=6, n_slots=3, max_pages=4)
    prompt = list(range(9))
    _run(a, 0, prompt, 16)                      # 4 pages promised, 3 held
    a.register(0, prompt)
    assert a.unreserved == 2
    shared = a.match(prompt)
    # Two shared (held, so they cost nothing) plus two new: fits exactly.
    assert a.fits(4, shared) and not a.fits(4)
    _run(a, 1, prompt, 16, shared)
    assert a.unreserved == 0
    with pytest.raises(PagesExhaustedError):
        a.reserve(2, 1)
    # Every promised page can be taken.
    a.grow(0, 16)
    a.grow(1, 16)
    assert a.n_free == 0


def test_idle_cached_pages_count_once_when_shared():
    a = _alloc(n_pages=4, n_slots=2, max_pages=4)
    prompt = list(range(9))
    _run(a, 0, prompt, 9)
    a.register(0, prompt)
    a.release(0)                                # 2 pages cached, 2 free (the partial one freed)
    shared = a.match(prompt)
    assert len(shared) == 2 and a.unreserved == 4
    # Sharing the two cached pages takes them out of what others can be promised.
    assert a.fits(4, shared) and not a.fits(5, shared)
    _run(a, 1, prompt, 16, shared)
    assert a.unreserved == 0 and a.n_cached == 0


def test_off_matches_nothing_and_frees_everything():
    a = _alloc(prefix_cache=False)
    prompt = list(range(9))
    _run(a, 0, prompt, 12)
    a.register(0, prompt)
    assert a.match(prompt) == []
    a.release(0)
    assert a.n_free == a.n_pages and a.n_cached == 0 and a.stats.lookups == 0


def test_a_duplicate_computed_page_stays_private():
    a = _alloc()
    prompt = list(range(9))
    _run(a, 0, prompt, 9)
    _run(a, 1, prompt, 9)                       # admitted together: both compute the prefix
    a.register(0, prompt)
    a.register(1, prompt)
    assert a.match(prompt) == list(a.tables[0, :2])
    a.release(1)
    assert a.n_cached == 0                      # slot 1's copies go back to the free list
    a.release(0)
    assert a.n_cached == 2 and a.n_free == a.n_pages - 2


def test_clear_cache():
    a = _alloc()
    prompt = list(range(9))
    _run(a, 0, prompt, 9)
    a.register(0, prompt)
    a.release(0)
    a.clear_cache()
    assert a.n_cached == 0 and a.n_free == a.n_pages and a.match(prompt) == []
    assert (a.tables == NO_PAGE).all() and np.all(a.refs == 0)
