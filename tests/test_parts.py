"""Window parts: records a page may or may not have, in a second pool of the segment.

Unit tests of the parts' life (hostkv/_pages.pyx): fresh pages take free parts, the last
pages of an allocation first; a page that finds none is handed out without one; the last
reference to a page frees its part; a commit hands a part to the tree's page of the same
tokens when that has none. The model test (test_radix_model.py), the crash tests
(test_crash.py, test_radix_crash.py, test_worker_view_crash.py) and the corruption test
run with parts as well.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import hostkv
from hostkv import ConfigError, _pages, _radix

from conftest import small_config
from lib.rawseg import LAYOUT, RawSegment

PAGE = 4


@pytest.fixture
def parts_cache(segment_name):
    cache = hostkv.HostKVCache.create(
        segment_name, small_config(num_pages=16, page_size=PAGE, num_parts=4, part_bytes=24))
    yield cache
    cache.close()


def tokens(*page_values):
    return np.concatenate([np.arange(v * 10, v * 10 + PAGE, dtype=np.int32) for v in page_values])


@pytest.mark.parametrize("fields, message", [
    (dict(num_parts=4), "must both be 0"),
    (dict(part_bytes=8), "must both be 0"),
    (dict(num_parts=-1, part_bytes=8), "num_parts must be >= 0"),
    (dict(num_parts=2**31, part_bytes=8), "num_parts must be < 2\\*\\*31"),
    (dict(num_parts=2**20, part_bytes=2**27), "num_parts \\* part_bytes"),
    (dict(num_parts=True, part_bytes=8), "num_parts"),
])
def test_config_refuses_bad_parts(fields, message):
    with pytest.raises(ConfigError, match=message):
        small_config(**fields)


def test_the_undo_log_grows_with_the_parts():
    plain = small_config().apply_runtime_defaults()
    with_parts = small_config(num_parts=1000, part_bytes=8).apply_runtime_defaults()
    # 4096 node records (derived for a small pool): 13 bits, 16 + 4 * 13 entries a part.
    assert with_parts.undo_log_capacity == plain.undo_log_capacity + (16 + 4 * 13) * 1000


def test_attach_sees_the_parts(parts_cache):
    with hostkv.HostKVCache.attach(parts_cache.name) as other:
        assert (other.config.num_parts, other.config.part_bytes) == (4, 24)
        assert other.config == parts_cache.config
    s = parts_cache.stats()
    assert (s.num_parts, s.free_parts, s.parts_allocated, s.pages_without_part) == (4, 4, 0, 0)


def test_a_segment_without_parts_has_none(cache):
    pages = _pages.alloc_pages(cache._segment, 3)
    assert cache.page_parts(pages).tolist() == [-1, -1, -1]
    assert cache.parts_array().shape == (0, 0)
    s = cache.stats()
    assert (s.num_parts, s.free_parts, s.parts_allocated, s.pages_without_part) == (0, 0, 0, 0)
    assert cache._segment.pool_span() == cache.config.num_pages * cache.config.page_bytes


def test_fresh_pages_take_parts_last_pages_first(parts_cache):
    seg = parts_cache._segment
    first = _pages.alloc_pages(seg, 3)
    assert (parts_cache.page_parts(first) != -1).all()
    second = _pages.alloc_pages(seg, 3)          # one part left: the last page takes it
    parts = parts_cache.page_parts(second)
    assert (parts[:2] == -1).all() and parts[2] != -1
    all_parts = np.concatenate([parts_cache.page_parts(first), parts[2:]])
    assert sorted(all_parts.tolist()) == [0, 1, 2, 3]
    s = parts_cache.stats()
    assert (s.free_parts, s.parts_allocated, s.pages_without_part) == (0, 4, 2)
    parts_cache.check(exact_references=False)
    # The last reference frees a page's part; a page without one frees none.
    _pages.free_pages(seg, second)
    s = parts_cache.stats()
    assert (s.free_parts, s.parts_freed) == (1, 1)
    again = _pages.alloc_pages(seg, 2)
    assert parts_cache.page_parts(again)[1] == parts[2]
    parts_cache.check(exact_references=False)


def test_a_shared_page_keeps_its_part_until_its_last_reference(parts_cache):
    seg = parts_cache._segment
    pages = _pages.alloc_pages(seg, 2)
    held = parts_cache.page_parts(pages)
    _radix.insert(seg, tokens(1, 2), pages, 0)    # the tree takes a reference
    _pages.free_pages(seg, pages)                 # the allocator's goes
    assert parts_cache.page_parts(pages).tolist() == held.tolist()
    assert parts_cache.stats().free_parts == 2
    assert parts_cache.evict(2) == 2              # the tree's was the last
    assert parts_cache.page_parts(pages).tolist() == [-1, -1]
    assert parts_cache.stats().free_parts == 4
    parts_cache.check()


def test_a_commit_donates_parts_to_cached_pages_without_one(parts_cache):
    seg = parts_cache._segment
    hog = _pages.alloc_pages(seg, 4)
    first = _pages.alloc_pages(seg, 3)            # no part left
    _radix.insert(seg, tokens(1, 2, 3), first, 0)
    _pages.free_pages(seg, np.concatenate([hog, first]))
    second = _pages.alloc_pages(seg, 4)           # the same three pages, and one more
    parts = parts_cache.page_parts(second)
    assert (parts != -1).all()
    existing, tree_pages, _ = _radix.insert(seg, tokens(1, 2, 3, 4), second, 0)
    assert existing == 3 and tree_pages[:3].tolist() == first.tolist()
    # The cached pages took the caller's parts; its own copies of them have none now.
    assert parts_cache.page_parts(first).tolist() == parts[:3].tolist()
    assert parts_cache.page_parts(second).tolist() == [-1, -1, -1, parts[3]]
    assert parts_cache.stats().parts_donated == 3
    _pages.free_pages(seg, second)
    parts_cache.check()
    assert parts_cache.stats().free_parts == 0


def test_a_commit_never_takes_a_part_from_a_page_it_does_not_own(parts_cache):
    """Only a private page its caller holds gives its part, not a page of the tree (another
    node's, however its tokens look)."""
    seg = parts_cache._segment
    hog = _pages.alloc_pages(seg, 4)
    partless = _pages.alloc_pages(seg, 2)
    _radix.insert(seg, tokens(1, 2), partless, 0)
    _pages.free_pages(seg, partless)
    _pages.free_pages(seg, hog[:2])
    with_parts = _pages.alloc_pages(seg, 2)
    _radix.insert(seg, tokens(5, 6), with_parts, 0)     # tree pages, with parts
    _pages.free_pages(seg, with_parts)
    # An insert of (1, 2) naming the tree's pages of (5, 6) as its own: they keep theirs.
    _radix.insert(seg, tokens(1, 2), with_parts, 0)
    assert (parts_cache.page_parts(with_parts) != -1).all()
    assert (parts_cache.page_parts(partless) == -1).all()
    assert parts_cache.stats().parts_donated == 0
    parts_cache.check(exact_references=False)


def test_the_part_pool_is_writable_and_after_the_page_pool(parts_cache):
    parts = parts_cache.parts_array()
    pages = parts_cache.pages_array()
    assert parts.shape == (4, 24) and parts.dtype == np.uint8
    parts[:] = np.arange(96, dtype=np.uint8).reshape(4, 24)
    with hostkv.HostKVCache.attach(parts_cache.name) as other:
        assert (other.parts_array() == parts).all()
        del other
    assert pages.ctypes.data + pages.nbytes <= parts.ctypes.data
    assert parts.ctypes.data % 4096 == 0
    span = parts_cache._segment.pool_span()
    assert span == parts.ctypes.data + parts.nbytes - pages.ctypes.data
    # A view of the parts keeps the mapping, like one of the pages.
    del pages
    with pytest.raises(BufferError):
        parts_cache.close()
    del parts
    parts_cache.close()


def test_open_takes_other_parts_for_another_config(parts_cache):
    """HostKVCache.open's default compatibility compares the parts: a segment with parts is
    not one without (a writer that fills no parts would commit pages with parts unwritten)."""
    plain = dataclasses.replace(parts_cache.config, num_parts=0, part_bytes=0)
    refusals = []

    def refuse(reason, found):
        refusals.append(found)
        return False

    with pytest.raises(hostkv.IncompatibleSegmentError):
        hostkv.HostKVCache.open(parts_cache.name, plain, may_replace=refuse)
    assert refusals[0].num_parts == 4
    with hostkv.HostKVCache.open(parts_cache.name, parts_cache.config) as same:
        assert same.config.num_parts == 4


def test_the_remote_tier_refuses_a_segment_with_parts(parts_cache):
    from hostkv.remote import RemoteTier
    with pytest.raises(ConfigError, match="does not carry window parts yet"):
        RemoteTier(parts_cache, "redis://127.0.0.1:1")


def test_page_parts_refuses_a_page_outside_the_pool(parts_cache):
    with pytest.raises(ValueError, match="must be in \\[0, 16\\)"):
        parts_cache.page_parts([0, 16])


@pytest.mark.parametrize("damage", ["page names another part", "part out of range",
                                    "free part held", "free page keeps a part"])
def test_check_finds_broken_part_links(parts_cache, damage):
    seg = parts_cache._segment
    pages = _pages.alloc_pages(seg, 2)
    page_part, part_page = seg.run_locked(_pages.part_links, seg)
    regions = seg.header_info()["regions"]
    with RawSegment(parts_cache.name) as raw:
        i32 = np.frombuffer(raw.map, dtype=np.int32)
        if damage == "page names another part":
            i32[regions["reg_page_part"] // 4 + pages[0]] = page_part[pages[1]]
        elif damage == "part out of range":
            i32[regions["reg_page_part"] // 4 + pages[0]] = 4
        elif damage == "free part held":
            free = int(np.nonzero(part_page == -1)[0][0])
            i32[regions["reg_part_page"] // 4 + free] = 9
        else:
            i32[regions["reg_page_part"] // 4 + 12] = int(np.nonzero(part_page == -1)[0][0])
        del i32
    with pytest.raises(hostkv.CorruptionError):
        parts_cache.check(exact_references=False)


# -- the part LRU -------------------------------------------------------------------------------

@pytest.fixture
def lru_cache(segment_name):
    cache = hostkv.HostKVCache.create(
        segment_name, small_config(num_pages=32, page_size=PAGE, num_parts=6, part_bytes=8))
    yield cache
    cache.close()


def cached(cache, *page_values):
    """Caches pages of tokens(*page_values) in fresh pages, as an allocation would (freeing
    parts first); returns the pages."""
    seg = cache._segment
    _radix.evict_parts(seg, len(page_values))
    pages = _pages.alloc_pages(seg, len(page_values))
    _radix.insert(seg, tokens(*page_values), pages, 0)
    _pages.free_pages(seg, pages)
    return pages


def has_parts(cache, pages):
    return (cache.page_parts(pages) != -1).tolist()


def test_parts_go_least_recently_used_node_first(lru_cache):
    seg = lru_cache._segment
    a = cached(lru_cache, 1, 2)
    b = cached(lru_cache, 3, 4)
    c = cached(lru_cache, 5, 6)                  # every part in use, A oldest
    assert lru_cache.stats().tree_parts == 6
    _, node_a = _radix.borrow(seg, tokens(1, 2), 0)   # A: used now, and locked
    assert _radix.evict_parts(seg, 2) == 2       # A is locked (parked): B goes
    assert (has_parts(lru_cache, a), has_parts(lru_cache, b), has_parts(lru_cache, c)) == (
        [True, True], [False, False], [True, True])
    lru_cache.check(exact_references=False)
    _radix.unlock(seg, node_a)                   # A back in the LRU, as recent as its use
    lru_cache.check()
    assert _radix.evict_parts(seg, 4) == 2       # C is older than A now
    assert has_parts(lru_cache, a) == [True, True] and has_parts(lru_cache, c) == [False, False]
    # A use since a node entered the LRU counts: D was cached before E, then used.
    d = cached(lru_cache, 7, 8)
    e = cached(lru_cache, 9)
    _, node_d = _radix.borrow(seg, tokens(7, 8), 0)
    _radix.unlock(seg, node_d)
    assert _radix.evict_parts(seg, 3) == 2       # A (oldest use), not D
    assert has_parts(lru_cache, a) == [False, False]
    assert _radix.evict_parts(seg, 4) == 1       # then E, older than D's use
    assert has_parts(lru_cache, e) == [False] and has_parts(lru_cache, d) == [True, True]
    s = lru_cache.stats()
    assert (s.parts_evicted, s.tree_parts, s.free_parts, s.cached_pages) == (7, 2, 4, 9)
    lru_cache.check()


def test_an_allocation_takes_parts_from_the_lru_but_never_a_borrowed_prefix(lru_cache):
    """A batch borrows its prefix before anything is evicted: its window parts stay, the
    least recently used other node's parts go, and the fresh pages get them."""
    cached(lru_cache, 1, 2, 3)
    other = cached(lru_cache, 4, 5, 6)
    with hostkv.WorkerView(lru_cache) as view:
        alloc = view.allocate_pages_for_sequences_with_prefix(
            [hostkv.SequenceRequest(1, tokens(1, 2, 3, 7, 8).tolist() + [1])])[0]
        assert alloc.reused_tokens == 3 * PAGE
        assert has_parts(lru_cache, alloc.page_table[:3]) == [True] * 3
        assert has_parts(lru_cache, alloc.page_table[3:]) == [True] * 3
        assert has_parts(lru_cache, other) == [False] * 3
        view.release([1])
    assert lru_cache.stats().parts_evicted == 3
    lru_cache.check()


def test_a_split_keeps_each_half_parts_and_recency(lru_cache):
    seg = lru_cache._segment
    hog = _pages.alloc_pages(seg, 4)             # two parts left: the last two pages take them
    whole = cached(lru_cache, 1, 2, 3, 4)
    _pages.free_pages(seg, hog)
    assert has_parts(lru_cache, whole) == [False, False, True, True]
    later = cached(lru_cache, 9, 9)
    _radix.borrow(seg, tokens(1, 2, 3), 0)       # splits (1, 2, 3 | 4), locks the head
    lru_cache.check(exact_references=False)
    # The head (locked) keeps its part; the tail's goes first, older than (9, 9).
    assert _radix.evict_parts(seg, 3) == 1
    assert has_parts(lru_cache, whole) == [False, False, True, False]
    assert has_parts(lru_cache, later) == [True, True]
    lru_cache.check(exact_references=False)


# -- the part LRU crashed at every step ----------------------------------------------------------

@pytest.fixture
def tree_in_snapshots(monkeypatch):
    """Crash snapshots include the tree, its counters and its recency order (as
    test_radix_crash.py's); the parts' state is in every snapshot already."""
    from hostkv import _introspect
    from lib import crashlib
    monkeypatch.setitem(crashlib.EXTRA_STATE, "tree",
                        lambda seg: frozenset(_introspect.tree_contents(seg)))
    monkeypatch.setitem(crashlib.EXTRA_STATE, "radix",
                        lambda seg: tuple(sorted(seg.header_info()["radix"].items())))
    monkeypatch.setitem(crashlib.EXTRA_STATE, "lru", crashlib.lru_state)


def test_part_eviction_crash_at_every_step(lru_cache, tree_in_snapshots):
    """An eviction that parks a locked node, re-keys a used one and takes two nodes' parts,
    crashed at every step: nothing of it remains; completed, the right nodes lost theirs."""
    from lib.crashlib import crash_every_step
    seg = lru_cache._segment
    a = cached(lru_cache, 1, 2)
    b = cached(lru_cache, 3)
    c = cached(lru_cache, 4, 5)
    d = cached(lru_cache, 6)
    _radix.borrow(seg, tokens(1, 2), 0)          # A: locked (parked when met)
    _, node_b = _radix.borrow(seg, tokens(3), 0)
    _radix.unlock(seg, node_b)                   # B: used since it entered (re-keyed)

    def parts_of_c_then_d(before, after):
        page_part = np.frombuffer(after.parts[0], np.int32)
        kept = [(page_part[list(pages)] != -1).all() for pages in (a, b)]
        gone = [(page_part[list(pages)] == -1).all() for pages in (c, d)]
        return None if all(kept) and all(gone) else f"parts after: {page_part.tolist()}"

    steps = crash_every_step(lru_cache, lambda cache, need: _radix.evict_parts(cache._segment, need),
                             3, expect_after=parts_of_c_then_d)
    assert steps > 15
    assert lru_cache.stats().parts_evicted == 3
    lru_cache.check(exact_references=False)


def test_unlock_of_a_parked_node_crash_at_every_step(lru_cache, tree_in_snapshots):
    from lib.crashlib import crash_every_step
    seg = lru_cache._segment
    cached(lru_cache, 1, 2)
    cached(lru_cache, 3, 4, 5, 6)
    _, node = _radix.borrow(seg, tokens(1, 2), 0)
    _radix.borrow(seg, tokens(3, 4, 5, 6), 0)    # every node locked: nothing to evict
    assert _radix.evict_parts(seg, 6) == 0      # both parked
    lru_cache.check(exact_references=False)
    steps = crash_every_step(lru_cache, lambda cache, node: _radix.unlock(cache._segment, node),
                             node)
    assert steps > 5
    lru_cache.check(exact_references=False)
    assert _radix.evict_parts(seg, 2) == 2       # back in the LRU, and taken


def test_split_of_a_parked_node_crash_at_every_step(lru_cache, tree_in_snapshots):
    """A node the part LRU parked (locked when met) split by a shorter borrow: both halves
    stay out of the heap while locked, and go back in at their last unlock."""
    from lib.crashlib import crash_every_step
    seg = lru_cache._segment
    whole = cached(lru_cache, 1, 2, 3, 4)
    other = cached(lru_cache, 5, 6)
    _, node = _radix.borrow(seg, tokens(1, 2, 3, 4), 0)
    assert _radix.evict_parts(seg, 4) == 2        # parks (1..4), takes (5, 6)'s
    assert has_parts(lru_cache, other) == [False, False]
    steps = crash_every_step(lru_cache, lambda cache, toks: _radix.borrow(cache._segment, toks, 0),
                             tokens(1, 2, 9))
    assert steps > 10
    lru_cache.check(exact_references=False)
    assert _radix.evict_parts(seg, 6) == 0        # every node with parts is locked
    _radix.unlock(seg, node)
    lru_cache.check(exact_references=False)


def test_donation_to_a_locked_node_crash_at_every_step(lru_cache, tree_in_snapshots):
    """The tree's pages without parts are borrowed (locked) when a commit donates parts to
    them: the node counts them but stays out of the heap until its unlock, and the
    borrower's pages only gain parts."""
    from lib.crashlib import crash_every_step
    seg = lru_cache._segment
    hog = _pages.alloc_pages(seg, 6)
    partless = cached(lru_cache, 1, 2)
    _pages.free_pages(seg, hog)
    _, node = _radix.borrow(seg, tokens(1, 2), 0)
    donors = _pages.alloc_pages(seg, 3)

    def donated(before, after):
        page_part = np.frombuffer(after.parts[0], np.int32)
        return None if (page_part[partless] != -1).all() else f"parts: {page_part.tolist()}"

    steps = crash_every_step(lru_cache, lambda cache, ctx: _radix.insert(cache._segment, *ctx, 0),
                             (tokens(1, 2, 3), donors), expect_after=donated)
    assert steps > 10
    lru_cache.check(exact_references=False)
    assert _radix.evict_parts(seg, 6) == 1        # (3)'s, not the locked node's two
    _radix.unlock(seg, node)
    assert _radix.evict_parts(seg, 6) == 2        # in the LRU again after its unlock
    _pages.free_pages(seg, donors)
    lru_cache.check()


@pytest.mark.parametrize("mode", ["keyboard_interrupt", "memory_error"])
def test_exceptions_mid_part_eviction_roll_back(lru_cache, tree_in_snapshots, mode):
    from lib.crashlib import raise_every_step
    seg = lru_cache._segment
    cached(lru_cache, 1, 2)
    cached(lru_cache, 3, 4)
    cached(lru_cache, 5, 6)
    _radix.borrow(seg, tokens(1, 2), 0)
    assert raise_every_step(lru_cache, lambda cache, need: _radix.evict_parts(cache._segment, need),
                            4, mode) > 10
    lru_cache.check(exact_references=False)


def test_the_default_undo_log_fits_an_allocation_that_evicts_every_part(segment_name):
    """The worst case for the log, at a size where the parts' share of it dominates: 131,072
    one-page nodes, each with a part, all unlocked, then one batch whose fresh pages need
    every part: each node gives its part, with a removal from a heap 17 levels deep. (A
    budget of 8 entries a part raised CapacityError here.)"""
    num_pages, num_parts = 262_144, 131_072
    config = hostkv.HostKVConfig(num_pages=num_pages, page_size=PAGE, page_bytes=16,
                                 num_parts=num_parts, part_bytes=16, max_sequences=8,
                                 max_processes=4)
    with hostkv.HostKVCache.create(segment_name, config) as cache:
        seg = cache._segment
        for i in range(num_parts):
            pages = _pages.alloc_pages(seg, 1)
            _radix.insert(seg, np.full(PAGE, i, dtype=np.int32), pages, 0)
            _pages.free_pages(seg, pages)
        s = cache.stats()
        assert (s.tree_parts, s.free_parts, s.tree_nodes) == (num_parts, 0, num_parts)
        with hostkv.WorkerView(cache) as view:
            view.allocate_pages_for_sequences_with_prefix(
                [hostkv.SequenceRequest(1, [num_parts + 1] * (num_parts * PAGE))])
            s = cache.stats()
            assert (s.parts_evicted, s.tree_parts, s.pages_without_part) == (num_parts, 0, 0)
            view.release([1], commit=False)
        cache.check()


@pytest.mark.parametrize("damage", ["part heap size", "node page count"])
def test_a_damaged_part_lru_is_corruption_not_a_crash(lru_cache, damage):
    """Each in a child process, so that a crash would show as a signal: a split with a
    part heap size far past the table, and a part eviction of a node whose page count is
    past the pool, both report CorruptionError."""
    from conftest import run_in_fork
    seg = lru_cache._segment
    cached(lru_cache, 1, 2, 3)
    regions = seg.header_info()["regions"]
    if damage == "part heap size":
        offset, value, op = LAYOUT["header"]["pt_heap_size"], 200_000_000, \
            lambda: _radix.borrow(seg, tokens(1, 2), 0)          # a split of a node in the heap
    else:
        # A node claiming 2**31 - 1 pages, whose last page links back to its first: without
        # the cap, the walk would go round for seconds and report nothing.
        pages = _radix.match(seg, tokens(1, 2, 3), 0)
        with RawSegment(lru_cache.name) as raw:
            node = int.from_bytes(raw.read(regions["reg_part_heap"],
                                           regions["reg_part_heap"] + 4), "little")
            link = regions["reg_page_next"] + 4 * int(pages[-1])
            raw.map[link:link + 4] = int(pages[0]).to_bytes(4, "little")
        record = (regions["reg_radix_nodes"] + LAYOUT["sizes"]["HkvSlab"]
                  + node * LAYOUT["sizes"]["HkvRadixNode"])
        offset, value, op = record + LAYOUT["radix_node"]["rn_num_pages"], 2**31 - 1, \
            lambda: _radix.evict_parts(seg, 6)
    with RawSegment(lru_cache.name) as raw:
        raw.map[offset:offset + 4] = value.to_bytes(4, "little")

    def body():
        try:
            op()
        except hostkv.CorruptionError:
            return 0
        return 1

    assert run_in_fork(body) == 0


def test_the_undo_budget_a_part_covers_its_worst_case(segment_name):
    """Measured, not assumed: one allocation takes every part of 16,384 one-page nodes, each
    used since it entered the part heap (so each is re-keyed, then removed). The logged
    stores it makes, counted by the crash-point counter, stay within the derived budget a
    part (12 + 2 bits a part, the first budget, was short here)."""
    from hostkv.config import _undo_per_part
    n = 16_384
    config = hostkv.HostKVConfig(num_pages=2 * n, page_size=PAGE, page_bytes=16, num_parts=n,
                                 part_bytes=16, max_sequences=1, max_processes=4)
    with hostkv.HostKVCache.create(segment_name, config) as cache:
        seg = cache._segment
        for i in range(n):
            pages = _pages.alloc_pages(seg, 1)
            _radix.insert(seg, np.full(PAGE, i, dtype=np.int32), pages, 0)
            _pages.free_pages(seg, pages)
        for i in range(n):
            _, node = _radix.borrow(seg, np.full(PAGE, i, dtype=np.int32), 0)
            _radix.unlock(seg, node)
        with hostkv.WorkerView(cache) as view:
            far = 1 << 40
            seg._arm_crash_point(far, "memory_error")
            try:
                view.allocate_pages_for_sequences_with_prefix(
                    [hostkv.SequenceRequest(1, [n + 7] * (n * PAGE))])
                used = far - seg.crash_steps_left
            finally:
                seg._arm_crash_point(0)
            assert cache.stats().parts_evicted == n
            view.release([1], commit=False)
        cache.check()
    per_part = used / n
    budget = _undo_per_part(cache.config.radix_node_capacity)
    assert 12 + 2 * cache.config.radix_node_capacity.bit_length() < per_part <= budget, (
        per_part, budget)


def test_a_buffer_asked_of_a_closed_segment_is_refused(segment_name):
    """Of the page pool or the part pool, after close(): ValueError, not a read of the
    unmapped header (in a child, so that a crash would show as a signal)."""
    from conftest import run_in_fork
    cache = hostkv.HostKVCache.create(
        segment_name, small_config(num_parts=4, part_bytes=8))
    seg = cache._segment
    pool = seg.part_pool()
    cache.close()

    def body():
        for exporter in (seg, pool):
            try:
                memoryview(exporter)
            except ValueError as exc:
                assert "closed" in str(exc)
            else:
                return 1
        return 0

    assert run_in_fork(body) == 0


def test_a_forked_child_uses_the_parts_through_the_inherited_handle(parts_cache):
    """After fork the child's handle (re-registered with its own lease) allocates, writes
    its pages' parts and commits; the parent reads them under the cached prefix."""
    from conftest import run_in_fork
    prompt = tokens(1, 2).tolist() + [0]

    def child():
        with hostkv.WorkerView(parts_cache) as view:
            alloc = view.allocate_pages_for_sequences_with_prefix(
                [hostkv.SequenceRequest(1, prompt)])[0]
            parts = parts_cache.page_parts(alloc.page_table)
            assert (parts != -1).all()
            parts_cache.parts_array()[parts[:2]] = 7
            view.release([1])
        return 0

    assert run_in_fork(child) == 0
    parts_cache.reap()
    cached = parts_cache.match_prefix(prompt).pages
    assert len(cached) == 2
    assert (parts_cache.parts_array()[parts_cache.page_parts(cached)] == 7).all()
    parts_cache.check()
