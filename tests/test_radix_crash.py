"""Crash at every step of the tree's mutations: insert, split, borrow, unlock, evict."""

from __future__ import annotations

import numpy as np
import pytest

import hostkv
from hostkv import _introspect, _pages, _radix

from lib import crashlib
from conftest import small_config
from lib.crashlib import crash_every_step, raise_every_step

PAGE = 4


@pytest.fixture(autouse=True)
def tree_in_snapshots(monkeypatch):
    """Crash snapshots include the whole tree: every path, its pages and its locks, the
    header's radix state (the LRU clock among it) and the order of the last-access stamps."""
    monkeypatch.setitem(crashlib.EXTRA_STATE, "tree", lambda seg: frozenset(_introspect.tree_contents(seg)))
    monkeypatch.setitem(crashlib.EXTRA_STATE, "radix",
                        lambda seg: tuple(sorted(seg.header_info()["radix"].items())))
    monkeypatch.setitem(crashlib.EXTRA_STATE, "lru", crashlib.lru_state)   # last-access stamps


@pytest.fixture(params=[0, 6], ids=["no-parts", "parts"])
def tree_cache(segment_name, request):
    # With 6 window parts for 40 pages, inserts cache pages with and without parts.
    parts = dict(num_parts=request.param, part_bytes=16 if request.param else 0)
    cache = hostkv.HostKVCache.create(
        segment_name, small_config(num_pages=40, page_size=PAGE, radix_node_capacity=6, **parts))
    yield cache
    cache.close()


def tokens(*page_values):
    """Pages of PAGE tokens: page value v fills its page with v*10 + 0..3."""
    return np.concatenate([np.arange(v * 10, v * 10 + PAGE, dtype=np.int32) for v in page_values])


def held_insert(cache, toks):
    """Caches toks in fresh pages, then drops this process's own references."""
    seg = cache._segment
    pages = _pages.alloc_pages(seg, len(toks) // PAGE)
    existing, _, _ = _radix.insert(seg, toks, pages, 0)
    _pages.free_pages(seg, pages)
    return existing


def insert_op(cache, ctx):
    toks, pages = ctx
    _radix.insert(cache._segment, toks, pages, 0)


def borrow_op(cache, ctx):
    _radix.borrow(cache._segment, ctx, 0)


def unlock_op(cache, ctx):
    _radix.unlock(cache._segment, ctx)


def evict_op(cache, ctx):
    cache.evict(ctx)


def expect_contents_change(predicate):
    def check(before, after):
        return None if predicate(dict(before.extra), dict(after.extra)) else "unexpected tree after"
    return check


def test_insert_new_node_crash_at_every_step(tree_cache):
    held_insert(tree_cache, tokens(1, 2, 3))
    toks = tokens(1, 2, 3, 4, 5)
    pages = _pages.alloc_pages(tree_cache._segment, 5)
    steps = crash_every_step(
        tree_cache, insert_op, (toks, pages),
        expect_after=expect_contents_change(lambda b, a: len(a["tree"]) == len(b["tree"]) + 1))
    assert steps > 10


def test_insert_with_split_crash_at_every_step(tree_cache):
    held_insert(tree_cache, tokens(1, 2, 3, 4))
    toks = tokens(1, 2, 7, 8)
    pages = _pages.alloc_pages(tree_cache._segment, 4)
    steps = crash_every_step(
        tree_cache, insert_op, (toks, pages),
        expect_after=expect_contents_change(lambda b, a: len(a["tree"]) == len(b["tree"]) + 2))
    assert steps > 20


def test_insert_evicting_records_crash_at_every_step(tree_cache):
    # Six node records: fill them, then insert something needing two (split + new node).
    for v in range(6):
        held_insert(tree_cache, tokens(v * 3 + 1, v * 3 + 2))
    assert tree_cache.stats().tree_nodes == 6
    toks = tokens(16, 9, 9)             # splits the last-inserted node (16, 17)
    pages = _pages.alloc_pages(tree_cache._segment, 3)
    steps = crash_every_step(tree_cache, insert_op, (toks, pages))
    assert steps > 20


def test_borrow_with_split_crash_at_every_step(tree_cache):
    held_insert(tree_cache, tokens(1, 2, 3, 4))
    steps = crash_every_step(
        tree_cache, borrow_op, tokens(1, 2, 5),
        expect_after=expect_contents_change(lambda b, a: len(a["tree"]) == 2))
    assert steps > 10


def test_unlock_crash_at_every_step(tree_cache):
    held_insert(tree_cache, tokens(1, 2, 3, 4))
    _, node = _radix.borrow(tree_cache._segment, tokens(1, 2, 3), 0)
    steps = crash_every_step(tree_cache, unlock_op, node)
    assert steps > 3


def test_evict_whole_and_trim_crash_at_every_step(tree_cache):
    held_insert(tree_cache, tokens(1, 2, 3))
    held_insert(tree_cache, tokens(4, 5, 6))
    held_insert(tree_cache, tokens(4, 5, 7, 8))   # splits (4, 5, 6): three leaves, one parent
    cached = tree_cache.stats().cached_pages
    steps = crash_every_step(
        tree_cache, evict_op, 5,
        expect_after=lambda b, a: None if a.free_pages == b.free_pages + 5 else "5 pages not freed")
    assert steps > 20
    assert tree_cache.stats().cached_pages == cached - 5


def test_insert_donating_parts_crash_at_every_step(segment_name):
    """The tree holds pages without window parts (cached while parts ran out); an insert of
    the same tokens in pages that have parts hands theirs to the tree's pages, and adopts its
    new pages with their parts. Crashed at every step, nothing of it may remain."""
    cache = hostkv.HostKVCache.create(
        segment_name, small_config(num_pages=40, page_size=PAGE, radix_node_capacity=6,
                                   num_parts=4, part_bytes=16))
    try:
        seg = cache._segment
        hog = _pages.alloc_pages(seg, 4)             # every part, for now
        held_insert(cache, tokens(1, 2, 3))          # cached without parts
        _pages.free_pages(seg, hog)
        toks = tokens(1, 2, 3, 4)
        pages = _pages.alloc_pages(seg, 4)           # each with a part
        assert (cache.page_parts(pages) != -1).all()
        tree_pages = _radix.match(seg, toks, 0)
        assert (cache.page_parts(tree_pages) == -1).all()

        def donated(before, after):
            page_part = np.frombuffer(after.parts[0], np.int32)
            if not ((page_part[tree_pages] != -1).all() and (page_part[pages[:3]] == -1).all()
                    and page_part[pages[3]] != -1):
                return f"parts after the insert: {page_part.tolist()}"
            return None

        steps = crash_every_step(cache, insert_op, (toks, pages), expect_after=donated)
        assert steps > 15
        assert cache.stats().parts_donated == 3
        _pages.free_pages(seg, pages)               # the donors' and the adopted page's own refs
        cache.check()
        assert cache.stats().free_parts == 0        # three donated parts and the adopted one
    finally:
        cache.close()


@pytest.mark.parametrize("mode", ["keyboard_interrupt", "memory_error"])
def test_exceptions_mid_tree_mutation_roll_back(tree_cache, mode):
    held_insert(tree_cache, tokens(1, 2, 3, 4))
    toks = tokens(1, 2, 7, 8)
    pages = _pages.alloc_pages(tree_cache._segment, 4)
    assert raise_every_step(tree_cache, insert_op, (toks, pages), mode) > 20
    assert raise_every_step(tree_cache, evict_op, 3, mode) > 5
    tree_cache.check(exact_references=False)
