"""Unit tests of the radix prefix cache: matching, dedupe, splits, locks, LRU eviction,
namespaces, node capacity, hash collisions and input validation.

The tree is driven through its internal API (hostkv._radix, first argument the segment) and
through HostKVCache.match_prefix / evict / stats / check. Pages are held by the test
(_pages.alloc_pages) while they are inserted and released right after, so the tree's pages
have refcount 1 and an evicted page becomes free.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import hostkv
from hostkv import _introspect, _pages, _radix, _tokens

from conftest import small_config

PAGE = 4
NUM_PAGES = 32
TOP_NS = 2**64 - 1


# -- helpers ------------------------------------------------------------------------------------


def make_cache(name, **overrides):
    values = dict(num_pages=NUM_PAGES, page_size=PAGE, radix_node_capacity=16)
    values.update(overrides)
    return hostkv.HostKVCache.create(name, small_config(**values))


@pytest.fixture
def tree(segment_name):
    cache = make_cache(segment_name)
    yield cache
    cache.close()


def toks(*page_values, extra=()):
    """Full pages of PAGE tokens (page value v holds v*10 + 0..3), then `extra` loose tokens."""
    parts = [np.arange(v * 10, v * 10 + PAGE, dtype=np.int32) for v in page_values]
    parts.append(np.asarray(extra, dtype=np.int32))
    return np.concatenate(parts).astype(np.int32)


def put(cache, tokens, namespace=0, lock=False):
    """Inserts tokens in freshly allocated pages and drops the test's own references.

    Returns (existing, tree_pages, node, the pages the test allocated)."""
    seg = cache._segment
    pages = _pages.alloc_pages(seg, len(tokens) // PAGE)
    try:
        existing, tree_pages, node = _radix.insert(seg, tokens, pages, namespace, lock)
    finally:
        _pages.free_pages(seg, pages)
    return existing, tree_pages, node, pages


def match(cache, tokens, namespace=0):
    return _radix.match(cache._segment, tokens, namespace).tolist()


def contents(cache):
    seg = cache._segment
    return seg.run_locked(_introspect.tree_contents, seg)


def refcounts(cache):
    seg = cache._segment
    return seg.run_locked(_pages.refcounts, seg).tolist()


def check(cache):
    # Locks taken through the internal API belong to no sequence.
    cache.check(exact_references=False)


def state(cache):
    """Everything an operation that "changes nothing" must leave as it was: the tree, every
    refcount and every counter except the generation and the rollback count."""
    stats = dataclasses.asdict(cache.stats())
    del stats["generation"], stats["rollbacks"]
    return contents(cache), refcounts(cache), stats


# -- matching -----------------------------------------------------------------------------------


def test_match_is_pure(tree):
    _, pages_a, _, _ = put(tree, toks(1, 2, 3))
    put(tree, toks(4, 5))
    _, node = _radix.borrow(tree._segment, toks(4), 0)
    before = state(tree)
    for _ in range(3):
        assert match(tree, toks(1, 2, 3)) == pages_a.tolist()
        assert match(tree, toks(1, 2, extra=[99])) == pages_a[:2].tolist()
        assert match(tree, toks(4, 5, 6)) != []
        assert tree.match_prefix(toks(1, 2, 3)).pages.tolist() == pages_a.tolist()
        assert tree.match_prefix(toks(7)).num_tokens == 0
    assert state(tree) == before
    check(tree)
    # No recency either: sequence 1 stays the least recently used leaf despite the matches.
    _radix.unlock(tree._segment, node)
    assert tree.evict(3) == 3
    assert match(tree, toks(1, 2, 3)) == []
    assert len(match(tree, toks(4, 5))) == 2


def test_match_of_empty_and_short_tokens(tree):
    put(tree, toks(1, 2))
    assert match(tree, np.empty(0, np.int32)) == []
    assert match(tree, toks(extra=[10, 11, 12])) == []     # a partial page never matches
    pm = tree.match_prefix([])
    assert pm.num_tokens == 0 and pm.pages.dtype == np.int32 and len(pm.pages) == 0


def test_every_page_aligned_prefix_matches(tree):
    seq = toks(1, 2, 3, 4, 5)
    _, pages, _, _ = put(tree, seq)
    pages = pages.tolist()
    for k in range(6):
        for loose in range(PAGE):
            query = np.concatenate([seq[:k * PAGE], np.arange(100, 100 + loose, dtype=np.int32)])
            assert match(tree, query) == pages[:k], (k, loose)
        # Diverging after k pages: at a page boundary, or only in a page's last token.
        assert match(tree, np.concatenate([seq[:k * PAGE], toks(9)])) == pages[:k]
        if k < 5:
            changed = seq[:(k + 1) * PAGE].copy()
            changed[-1] += 1000
            assert match(tree, changed) == pages[:k]
        result = tree.match_prefix(seq[:k * PAGE + 1])
        assert result.num_tokens == k * PAGE and result.pages.tolist() == pages[:k]
    assert tree.stats().tree_nodes == 1
    check(tree)


def test_partial_last_page_is_never_inserted(tree):
    seg = tree._segment
    pages = _pages.alloc_pages(seg, 3)
    existing, tree_pages, node = _radix.insert(seg, toks(1, 2, extra=[30, 31, 32]), pages, 0)
    assert (existing, tree_pages.tolist()) == (0, pages[:2].tolist())
    assert node != -1
    stats = tree.stats()
    assert (stats.cached_pages, stats.inserted_pages) == (2, 2)
    _pages.free_pages(seg, pages)
    rc = refcounts(tree)
    assert [rc[p] for p in pages] == [1, 1, 0]      # the third page stayed the caller's
    assert match(tree, toks(1, 2, 3)) == pages[:2].tolist()
    # Fewer than a page of tokens: nothing to cache, nothing changes.
    before = state(tree)
    assert _radix.insert(seg, toks(extra=[1, 2, 3]), np.empty(0, np.int32), 0)[0] == 0
    assert state(tree) == before
    check(tree)


def test_tokens_are_compared_not_just_first_pages(tree):
    """Pages that share their first token, or whose sequences share the first page, never
    match each other past the point where the tokens differ."""
    a = np.array([5, 6, 7, 8, 1, 1, 1, 1], np.int32)
    b = np.array([5, 6, 7, 9, 1, 1, 1, 1], np.int32)
    _, pa, _, _ = put(tree, a)
    assert match(tree, b) == []
    _, pb, _, _ = put(tree, b)
    assert match(tree, a) == pa.tolist() and match(tree, b) == pb.tolist()
    assert set(pa.tolist()).isdisjoint(pb.tolist())
    check(tree)


# -- insert -------------------------------------------------------------------------------------


def test_dedupe_returns_existing_and_tree_pages(tree):
    seg = tree._segment
    _, first, _, _ = put(tree, toks(1, 2))
    mine = _pages.alloc_pages(seg, 4)
    existing, tree_pages, _ = _radix.insert(seg, toks(1, 2, 3, 4), mine, 0)
    assert existing == 2
    assert tree_pages[:2].tolist() == first.tolist()           # the tree's copies win
    assert tree_pages[2:].tolist() == mine[2:].tolist()        # the rest is adopted
    rc = refcounts(tree)
    assert [rc[p] for p in mine] == [1, 1, 2, 2]               # duplicates untouched
    _pages.free_pages(seg, mine)
    rc = refcounts(tree)
    assert [rc[p] for p in mine] == [0, 0, 1, 1]
    stats = tree.stats()
    assert (stats.cached_pages, stats.inserted_pages, stats.tree_nodes) == (4, 4, 2)
    assert stats.free_pages == NUM_PAGES - 4
    # All of it cached already: nothing adopted, the caller's pages untouched.
    again = _pages.alloc_pages(seg, 3)
    existing, tree_pages, node2 = _radix.insert(seg, toks(1, 2, 3), again, 0)
    assert existing == 3 and tree_pages.tolist() == first.tolist() + [mine[2]]
    assert node2 != -1
    assert [refcounts(tree)[p] for p in again] == [1, 1, 1]
    _pages.free_pages(seg, again)
    assert tree.stats().inserted_pages == 4
    # The match ended inside the (3, 4) node: it is split there, so that a caller locking
    # node2 would lock exactly the pages it inserted.
    assert contents(tree) == {
        (0, tuple(toks(1, 2).tolist()), tuple(first.tolist()), 0),
        (0, tuple(toks(1, 2, 3).tolist()), tuple(first.tolist() + [mine[2]]), 0),
        (0, tuple(toks(1, 2, 3, 4).tolist()), tuple(first.tolist() + mine[2:].tolist()), 0),
    }
    check(tree)


def test_insert_beyond_a_mid_node_match_splits_once(tree):
    _, p, _, _ = put(tree, toks(1, 2, 3, 4))
    _, q, _, _ = put(tree, toks(1, 2, 7))
    p, q = p.tolist(), q.tolist()
    assert contents(tree) == {
        (0, tuple(toks(1, 2).tolist()), tuple(p[:2]), 0),
        (0, tuple(toks(1, 2, 3, 4).tolist()), tuple(p), 0),
        (0, tuple(toks(1, 2, 7).tolist()), tuple(p[:2] + q[2:]), 0),
    }
    assert match(tree, toks(1, 2, 3, 4)) == p
    assert match(tree, toks(1, 2, 7, 8)) == p[:2] + q[2:]
    check(tree)


def test_insert_with_lock_locks_the_new_path(tree):
    seg = tree._segment
    _, pages, node, _ = put(tree, toks(1, 2), lock=True)
    assert contents(tree) == {(0, tuple(toks(1, 2).tolist()), tuple(pages.tolist()), 1)}
    assert tree.stats().borrowed_pages == 2
    assert tree.evict(10) == 0
    _radix.unlock(seg, node)
    assert tree.evict(10) == 2
    check(tree)


# -- borrow -------------------------------------------------------------------------------------


def test_borrow_counts_stats(tree):
    seg = tree._segment
    put(tree, toks(1, 2, 3))
    pages, node = _radix.borrow(seg, toks(1, 2, extra=[1, 2]), 0)
    assert len(pages) == 2 and node != -1
    pages2, node2 = _radix.borrow(seg, toks(8, 9), 0)
    assert len(pages2) == 0 and node2 == -1
    stats = tree.stats()
    assert (stats.lookups, stats.lookup_tokens, stats.hit_tokens) == (2, 10 + 8, 8)
    _radix.unlock(seg, node)
    check(tree)


def test_borrow_splits_mid_node(tree):
    seg = tree._segment
    _, p, _, _ = put(tree, toks(1, 2, 3, 4))
    p = p.tolist()
    pages, node = _radix.borrow(seg, toks(1, 2, 9), 0)
    assert pages.tolist() == p[:2]
    assert contents(tree) == {
        (0, tuple(toks(1, 2).tolist()), tuple(p[:2]), 1),
        (0, tuple(toks(1, 2, 3, 4).tolist()), tuple(p), 0),
    }
    stats = tree.stats()
    assert (stats.tree_nodes, stats.borrowed_pages, stats.evictable_pages) == (2, 2, 2)
    check(tree)
    # Only the tail can go while the head is borrowed.
    assert tree.evict(10) == 2
    assert match(tree, toks(1, 2, 3, 4)) == p[:2]
    _radix.unlock(seg, node)
    assert tree.evict(10) == 2
    assert tree.stats().cached_pages == 0
    check(tree)


def test_lock_protects_from_evict_and_unlock_releases(tree):
    seg = tree._segment
    put(tree, toks(1, 2, 3))
    put(tree, toks(5, 6))
    pages, node = _radix.borrow(seg, toks(1, 2, 3), 0)
    assert len(pages) == 3
    pages_again, node_again = _radix.borrow(seg, toks(1, 2, 3), 0)   # locks nest
    assert (pages_again.tolist(), node_again) == (pages.tolist(), node)
    assert (0, tuple(toks(1, 2, 3).tolist()), tuple(pages.tolist()), 2) in contents(tree)
    assert tree.evict(100) == 2                     # only the unlocked sequence
    assert match(tree, toks(5, 6)) == []
    assert match(tree, toks(1, 2, 3)) == pages.tolist()
    _radix.unlock(seg, node)
    assert tree.evict(100) == 0                     # still locked once
    assert tree.stats().borrowed_pages == 3
    _radix.unlock(seg, node)
    stats = tree.stats()
    assert (stats.borrowed_pages, stats.evictable_pages) == (0, 3)
    assert tree.evict(100) == 3
    stats = tree.stats()
    assert (stats.cached_pages, stats.free_pages, stats.evicted_pages) == (0, NUM_PAGES, 5)
    check(tree)


def test_a_lock_on_a_child_protects_its_ancestors(tree):
    seg = tree._segment
    put(tree, toks(1, 2))
    put(tree, toks(1, 2, 3, 4))
    _, node = _radix.borrow(seg, toks(1, 2, 3, 4), 0)
    assert {c[3] for c in contents(tree)} == {1}
    assert tree.evict(100) == 0
    _radix.unlock(seg, node)
    assert {c[3] for c in contents(tree)} == {0}
    check(tree)


def test_borrow_evicts_an_lru_leaf_for_its_split(segment_name):
    cache = make_cache(segment_name, radix_node_capacity=2)
    try:
        seg = cache._segment
        _, p, _, _ = put(cache, toks(1, 2, 3, 4))
        put(cache, toks(7))
        # toks(7) is the most recently used, but the only leaf off the borrowed path.
        pages, node = _radix.borrow(seg, toks(1, 2), 0)
        assert pages.tolist() == p[:2].tolist()
        assert match(cache, toks(7)) == []
        stats = cache.stats()
        assert (stats.tree_nodes, stats.evicted_pages, stats.borrowed_pages) == (2, 1, 2)
        _radix.unlock(seg, node)
        check(cache)
    finally:
        cache.close()


def test_borrow_without_a_record_stops_at_a_node_boundary(segment_name):
    cache = make_cache(segment_name, radix_node_capacity=3)
    try:
        seg = cache._segment
        _, p, _, _ = put(cache, toks(1, 2))
        put(cache, toks(1, 2, 3, 4))
        put(cache, toks(7))
        _, locked = _radix.borrow(seg, toks(7), 0)
        # Every record is used and the only other leaf is on the borrowed path: no split,
        # so the borrow keeps to the whole node toks(1, 2).
        before = contents(cache)
        pages, node = _radix.borrow(seg, toks(1, 2, 3), 0)
        assert pages.tolist() == p.tolist()
        after = contents(cache)
        assert before - after == {(0, tuple(toks(1, 2).tolist()), tuple(p.tolist()), 0)}
        assert after - before == {(0, tuple(toks(1, 2).tolist()), tuple(p.tolist()), 1)}
        stats = cache.stats()
        assert (stats.lookups, stats.hit_tokens, stats.evicted_pages) == (2, 3 * PAGE, 0)
        assert stats.borrowed_pages == 3
        _radix.unlock(seg, node)
        _radix.unlock(seg, locked)
        check(cache)
    finally:
        cache.close()


def test_borrow_without_a_record_inside_a_top_level_node_borrows_nothing(segment_name):
    cache = make_cache(segment_name, radix_node_capacity=2)
    try:
        seg = cache._segment
        put(cache, toks(1, 2, 3))
        put(cache, toks(7))
        _, locked = _radix.borrow(seg, toks(7), 0)
        before = contents(cache)
        pages, node = _radix.borrow(seg, toks(1, 2), 0)
        assert (pages.tolist(), node) == ([], -1)
        assert contents(cache) == before
        stats = cache.stats()
        assert (stats.lookups, stats.lookup_tokens, stats.hit_tokens) == (2, 3 * PAGE, PAGE)
        _radix.unlock(seg, locked)
        check(cache)
    finally:
        cache.close()


# -- eviction -----------------------------------------------------------------------------------


def test_evict_follows_exact_lru_order(tree):
    seg = tree._segment
    for v in (1, 2, 3, 4, 5):
        put(tree, toks(v))                      # used in the order 1, 2, 3, 4, 5
    _, node = _radix.borrow(seg, toks(3), 0)    # a borrow is a use
    _radix.unlock(seg, node)
    put(tree, toks(1))                          # so is re-inserting cached tokens
    assert match(tree, toks(2)) != []           # a match is not
    _radix.borrow(seg, toks(9), 0)              # nor is a borrow that matched nothing
    order = []
    for _ in range(5):
        assert tree.evict(1) == 1
        order += [v for v in (1, 2, 3, 4, 5) if v not in order and match(tree, toks(v)) == []]
    assert order == [2, 4, 5, 3, 1]
    assert tree.evict(1) == 0
    check(tree)


def test_evict_trims_a_leaf_from_its_tail(tree):
    seg = tree._segment
    _, p, _, _ = put(tree, toks(1, 2, 3, 4, 5))
    p = p.tolist()
    assert tree.evict(2) == 2
    assert match(tree, toks(1, 2, 3, 4, 5)) == p[:3]
    rc = refcounts(tree)
    assert [rc[x] for x in p] == [1, 1, 1, 0, 0]
    assert contents(tree) == {(0, tuple(toks(1, 2, 3).tolist()), tuple(p[:3]), 0)}
    assert tree.evict(0) == 0
    assert tree.evict(2) == 2
    assert match(tree, toks(1, 2, 3)) == p[:1]
    stats = tree.stats()
    assert (stats.cached_pages, stats.evicted_pages, stats.tree_nodes) == (1, 4, 1)
    assert stats.free_pages == NUM_PAGES - 1
    check(tree)
    with pytest.raises(ValueError):
        _radix.evict(seg, -1)


def test_evicted_pages_someone_still_holds_stay_allocated(tree):
    seg = tree._segment
    mine = _pages.alloc_pages(seg, 2)
    _radix.insert(seg, toks(1, 2), mine, 0)        # the test keeps its own references
    free = tree.stats().free_pages
    assert tree.evict(2) == 2
    assert [refcounts(tree)[p] for p in mine] == [1, 1]
    stats = tree.stats()
    assert (stats.free_pages, stats.cached_pages, stats.evicted_pages) == (free, 0, 2)
    _pages.free_pages(seg, mine)
    assert tree.stats().free_pages == free + 2
    check(tree)


def test_evict_takes_whole_leaves_then_trims_the_next(tree):
    _, a, _, _ = put(tree, toks(1, 2))
    _, b, _, _ = put(tree, toks(3, 4, 5))
    assert tree.evict(3) == 3                  # all of 1-2 (LRU), then one page of 3-4-5
    assert match(tree, toks(1, 2)) == []
    assert match(tree, toks(3, 4, 5)) == b[:2].tolist()
    check(tree)


def test_parent_becomes_evictable_after_its_last_child(tree):
    _, a, _, _ = put(tree, toks(1, 2))
    put(tree, toks(1, 2, 3))            # child of 1-2: both used now
    put(tree, toks(1, 2, 4))            # second child: 1-2 used again
    _, c, _, _ = put(tree, toks(8))     # the most recent
    assert tree.stats().tree_nodes == 4
    assert tree.evict(1) == 1           # child 3, the LRU leaf; 1-2 still has a child
    assert match(tree, toks(1, 2, 3)) == a.tolist()
    assert tree.evict(1) == 1           # child 4: now 1-2 is a leaf, older than 8
    assert tree.evict(2) == 2           # so 1-2 goes before 8
    assert match(tree, toks(1, 2)) == []
    assert match(tree, toks(8)) == c.tolist()
    assert tree.stats().tree_nodes == 1
    check(tree)


def test_a_parent_leaf_stays_while_a_child_is_locked(tree):
    seg = tree._segment
    put(tree, toks(1, 2))
    put(tree, toks(1, 2, 3))
    put(tree, toks(1, 2, 4))
    _, node = _radix.borrow(seg, toks(1, 2, 4), 0)
    assert tree.evict(100) == 1         # only the unlocked child 3
    assert match(tree, toks(1, 2, 4)) != []
    _radix.unlock(seg, node)
    assert tree.evict(100) == 3
    check(tree)


# -- namespaces ---------------------------------------------------------------------------------


def test_namespaces_are_isolated(tree):
    seq = toks(1, 2, 3)
    _, p0, _, _ = put(tree, seq, namespace=0)
    assert match(tree, seq, TOP_NS) == []
    assert tree.match_prefix(seq, namespace=1).num_tokens == 0
    existing, p_top, _, _ = put(tree, seq, namespace=TOP_NS)
    assert existing == 0
    assert set(p0.tolist()).isdisjoint(p_top.tolist())
    assert match(tree, seq, 0) == p0.tolist()
    assert match(tree, seq, TOP_NS) == p_top.tolist()
    assert tree.match_prefix(seq, namespace=TOP_NS).pages.tolist() == p_top.tolist()
    assert tree.match_prefix(seq, namespace=np.uint64(TOP_NS)).pages.tolist() == p_top.tolist()
    assert match(tree, seq, 1) == []
    assert contents(tree) == {
        (0, tuple(seq.tolist()), tuple(p0.tolist()), 0),
        (TOP_NS, tuple(seq.tolist()), tuple(p_top.tolist()), 0),
    }
    # A borrow in one namespace locks nothing in the other.
    pages, node = _radix.borrow(tree._segment, seq, TOP_NS)
    assert pages.tolist() == p_top.tolist()
    assert tree.evict(100) == 3
    assert match(tree, seq, 0) == []
    _radix.unlock(tree._segment, node)
    check(tree)


# -- node capacity ------------------------------------------------------------------------------


def test_capacity_error_when_every_node_is_locked(segment_name):
    cache = make_cache(segment_name, radix_node_capacity=4)
    try:
        seg = cache._segment
        locks = []
        for v in (1, 2, 3, 4):
            put(cache, toks(v))
            locks.append(_radix.borrow(seg, toks(v), 0)[1])
        pages = _pages.alloc_pages(seg, 2)
        before = state(cache)
        for attempt in (toks(9, 9), toks(1, 9)):    # a new top-level node, or a child
            with pytest.raises(hostkv.CapacityError) as info:
                _radix.insert(seg, attempt, pages, 0)
            assert info.value.resource == "radix nodes"
        with pytest.raises(hostkv.CapacityError):
            _radix.insert(seg, toks(1, 9), pages, 0, True)
        assert state(cache) == before
        check(cache)
        _pages.free_pages(seg, pages)
        # One unlock makes room again (by evicting that now unlocked leaf).
        _radix.unlock(seg, locks.pop(0))
        existing, tree_pages, _, _ = put(cache, toks(9))
        assert existing == 0 and match(cache, toks(9)) == tree_pages.tolist()
        assert match(cache, toks(1)) == []
        for node in locks:
            _radix.unlock(seg, node)
        check(cache)
    finally:
        cache.close()


def test_capacity_error_after_partial_eviction_changes_nothing(segment_name):
    """An insert needing two records (split + new node) finds one evictable leaf: it must
    not keep that eviction when it fails."""
    cache = make_cache(segment_name, radix_node_capacity=4)
    try:
        seg = cache._segment
        put(cache, toks(1, 2))
        put(cache, toks(5))                         # the only evictable leaf off the path
        locks = []
        for v in (3, 4):
            put(cache, toks(v))
            locks.append(_radix.borrow(seg, toks(v), 0)[1])
        pages = _pages.alloc_pages(seg, 2)
        before = state(cache)
        rollbacks = cache.stats().rollbacks
        with pytest.raises(hostkv.CapacityError):
            _radix.insert(seg, toks(1, 6), pages, 0)  # ends inside node 1-2: split + new node
        assert state(cache) == before
        assert cache.stats().rollbacks == rollbacks + 1    # the eviction was undone
        assert match(cache, toks(5)) != []
        check(cache)
        _pages.free_pages(seg, pages)
        for node in locks:
            _radix.unlock(seg, node)
    finally:
        cache.close()


def test_insert_evicts_lru_leaves_for_records_but_never_its_own_path(segment_name):
    cache = make_cache(segment_name, radix_node_capacity=2)
    try:
        seg = cache._segment
        put(cache, toks(1))                         # least recently used...
        put(cache, toks(2))
        # ...but extending it: toks(2) goes instead.
        existing, _, _, _ = put(cache, toks(1, 3))
        assert existing == 1
        assert match(cache, toks(2)) == []
        assert len(match(cache, toks(1, 3))) == 2
        assert cache.stats().evicted_pages == 1
        check(cache)
    finally:
        cache.close()


def test_capacity_error_when_only_the_own_path_is_evictable(segment_name):
    cache = make_cache(segment_name, radix_node_capacity=2)
    try:
        seg = cache._segment
        _, a, _, _ = put(cache, toks(1))            # unlocked, but on the insert's path
        put(cache, toks(2))
        _, node = _radix.borrow(seg, toks(2), 0)
        pages = _pages.alloc_pages(seg, 2)
        before = state(cache)
        with pytest.raises(hostkv.CapacityError):
            _radix.insert(seg, toks(1, 3), pages, 0)
        assert state(cache) == before
        assert match(cache, toks(1, 3)) == a.tolist()
        _pages.free_pages(seg, pages)
        _radix.unlock(seg, node)
        check(cache)
    finally:
        cache.close()


# -- hash collisions ----------------------------------------------------------------------------


def test_colliding_hashes_never_confuse_pages(segment_name):
    cache = make_cache(segment_name)
    try:
        cache._segment._set_hash_mask(0)       # every page hashes alike, in this process
        seqs = [toks(1), toks(2, 3), toks(1, 4), toks(1, 5, 6), toks(7, 7, 7)]
        near = np.array([10, 11, 12, 99], np.int32)       # page 1 but for its last token
        seqs.append(near)
        seqs.append(np.concatenate([toks(1), near]))      # a child differing in one token
        got = {}
        for seq in seqs:
            _, tree_pages, _, _ = put(cache, seq)
            got[tuple(seq.tolist())] = tree_pages.tolist()
        check(cache)
        for seq in seqs:
            assert match(cache, seq) == got[tuple(seq.tolist())], seq
        assert match(cache, np.array([10, 11, 12, 98], np.int32)) == []
        assert match(cache, np.concatenate([toks(1), np.array([10, 11, 12, 98], np.int32)])) == \
            got[tuple(toks(1).tolist())]
        assert match(cache, toks(2, 4)) == got[tuple(toks(2, 3).tolist())][:1]
        # Removing entries from the one long probe run keeps every other entry findable.
        for _ in range(4):
            assert cache.evict(1) == 1
            check(cache)
            for seq in seqs:
                found = match(cache, seq)
                assert found == got[tuple(seq.tolist())][:len(found)]
    finally:
        cache.close()


# -- bad inputs to insert -----------------------------------------------------------------------


def test_bad_pages_raise_value_error_and_change_nothing(tree):
    seg = tree._segment
    _, cached, _, _ = put(tree, toks(1, 2))
    put(tree, toks(3))
    _, node = _radix.borrow(seg, toks(3), 0)
    held = _pages.alloc_pages(seg, 2)
    freed = _pages.alloc_pages(seg, 1)
    _pages.free_pages(seg, freed)
    bad = {
        "free page": np.array([freed[0]], np.int32),
        "cached page": np.array([cached[1]], np.int32),
        "page past the pool": np.array([NUM_PAGES], np.int32),
        "negative page": np.array([-1], np.int32),
        "listed twice": np.array([held[0], held[0]], np.int32),
        "cached page second": np.array([held[0], cached[0]], np.int32),
        "too few pages": np.array([held[0]], np.int32),
    }
    before = state(tree)
    for what, pages in bad.items():
        tokens = toks(8, 9) if len(pages) == 2 or what == "too few pages" else toks(8)
        with pytest.raises(ValueError):
            _radix.insert(seg, tokens, pages, 0)
        assert state(tree) == before, what
        check(tree)
    # The same pages behind an already cached prefix are checked too (past `existing`).
    with pytest.raises(ValueError):
        _radix.insert(seg, toks(1, 2, 8), np.array([held[0], held[1], cached[0]], np.int32), 0)
    assert state(tree) == before
    _pages.free_pages(seg, held)
    _radix.unlock(seg, node)
    check(tree)


def test_unlock_errors_leave_the_tree_intact(tree):
    seg = tree._segment
    put(tree, toks(1))
    _, node = _radix.borrow(seg, toks(1), 0)
    _radix.unlock(seg, node)
    before = state(tree)
    with pytest.raises(hostkv.HostKVError):
        _radix.unlock(seg, node)                    # more unlocks than locks
    with pytest.raises(hostkv.HostKVError):
        _radix.unlock(seg, 10_000)                  # no such node
    assert state(tree) == before
    check(tree)


# -- match_prefix input validation ---------------------------------------------------------------


def test_match_prefix_accepts_lists_numpy_and_torch(tree):
    seq = toks(1, 2, 3)
    _, pages, _, _ = put(tree, seq)
    want = pages.tolist()
    values = seq.tolist()
    accepted = [
        values,
        tuple(values),
        [np.int64(v) for v in values],
        np.array(values, dtype=np.int64),
        np.array(values, dtype=np.uint16),
        np.array(values, dtype=">i4"),
        np.repeat(seq, 2)[::2],                     # a strided int32 view
        np.array(values + [7], dtype=np.int32),     # a loose token past the pages
    ]
    torch = pytest.importorskip("torch")
    accepted += [torch.tensor(values, dtype=torch.int64), torch.tensor(values, dtype=torch.int32)]
    for tokens in accepted:
        result = tree.match_prefix(tokens)
        assert result.num_tokens == 3 * PAGE, type(tokens)
        assert result.pages.dtype == np.int32 and result.pages.tolist() == want
    assert tree.match_prefix(values, namespace=np.uint64(0)).pages.tolist() == want


@pytest.mark.parametrize("tokens", [
    [10, -1, 12, 13],
    np.array([10, -1, 12, 13], np.int32),
    [10, 11, 2**31, 13],
    np.array([10, 11, 2**31, 13], np.int64),
    np.array([10, 11, 2**31, 13], np.uint32),
    [10, 11, 2**64, 13],
    [10.0, 11.0, 12.0, 13.0],
    np.array([10.0, 11.0, 12.0, 13.0]),
    [True, False, True, False],
    np.zeros((2, 4), np.int32),
    [[10, 11, 12, 13]],
    "abcd",
    10,
], ids=lambda t: type(t).__name__ + ":" + repr(t)[:24])
def test_match_prefix_rejects_bad_tokens(tree, tokens):
    put(tree, toks(1))
    with pytest.raises(ValueError):
        tree.match_prefix(tokens)


def test_match_prefix_rejects_bad_torch_tokens(tree):
    torch = pytest.importorskip("torch")
    for tokens in (torch.tensor([10.0, 11.0, 12.0, 13.0]), torch.tensor([10, -1, 12, 13]),
                   torch.zeros((2, 4), dtype=torch.int64), torch.tensor([2**31, 0, 0, 0])):
        with pytest.raises(ValueError):
            tree.match_prefix(tokens)


@pytest.mark.parametrize("namespace", [-1, 2**64, 1.5, True, np.bool_(False), "0", None],
                         ids=repr)
def test_match_prefix_rejects_bad_namespaces(tree, namespace):
    with pytest.raises(ValueError):
        tree.match_prefix(toks(1), namespace=namespace)


@pytest.mark.parametrize("length", [1, 7, 4095, 4096, 4097, 9000])
def test_first_bad_token_finds_the_first_negative_id_in_any_block(length):
    """The check ORs blocks of 4,096 ids: a negative id must be found, and named by its
    first index, at a block's first and last id and wherever the array ends."""
    assert _tokens.first_bad_token(np.zeros(0, dtype=np.int32)) == -1
    clean = np.full(length, 2**31 - 1, dtype=np.int32)
    assert _tokens.first_bad_token(clean) == -1
    for at in sorted({0, length // 2, 4095 % length, 4096 % length, length - 1}):
        tokens = clean.copy()
        tokens[at] = -(2**31)
        tokens[-1] = -1                   # a later bad id never hides the first
        assert _tokens.first_bad_token(tokens) == at


@pytest.mark.parametrize("length", [0, 1, 4095, 4096, 4097, 9000])
def test_checked_copy_is_a_private_copy_or_none_when_any_id_is_bad(length):
    """One C call for a caller that keeps the ids: a copy that shares no memory with the
    input, or None when an id anywhere is negative (first_bad_token then says where)."""
    clean = np.arange(length, dtype=np.int32) + (2**31 - 1 - length)
    copy = _tokens.checked_copy(clean)
    np.testing.assert_array_equal(copy, clean)
    assert copy.dtype == np.int32 and copy.flags.c_contiguous and copy.flags.writeable
    assert not np.shares_memory(copy, clean)
    for at in sorted({0, length // 2, 4095 % max(length, 1), length - 1}) if length else ():
        tokens = clean.copy()
        tokens[at] = -1
        assert _tokens.checked_copy(tokens) is None
    with pytest.raises(ValueError, match="contiguous 1-D np.int32"):
        _tokens.checked_copy(np.zeros(4, dtype=np.int64))
    with pytest.raises(ValueError, match="contiguous 1-D np.int32"):
        _tokens.checked_copy(np.zeros(8, dtype=np.int32)[::2])
