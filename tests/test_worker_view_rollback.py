"""WorkerView: a batch short of pages, sequences, page-list records, undo-log entries or
radix nodes rolls back whole, to the exact snapshot it started from."""

from __future__ import annotations

import pytest

import hostkv
from hostkv import CapacityError, HostKVCache, OutOfPagesError, SequenceRequest as R, WorkerView

from lib.worker_view_lib import (
    LIVE,
    P,
    POOL,
    PS,
    Q,
    Z,
    assert_unchanged,
    busy,  # noqa: F401 - a fixture
    cache_prefix,
    config,
    make,  # noqa: F401 - a fixture
    snapshot,
)


# -- shortages roll back whole -----------------------------------------------------------------


def test_out_of_pages_rolls_back_borrows_splits_and_evictions(busy):
    cache, view = busy
    # Request 10 borrows 2 of P's 3 pages (a split, a lock, a touch, hit counters); request
    # 11 evicts Q and still cannot have its pages.
    free = cache.stats().free_pages
    batch = [R(10, P[:8] + [9]), R(11, list(range(5000, 5000 + PS * (free + 2))))]
    before = snapshot(cache, view, quiet=True)
    with pytest.raises(OutOfPagesError):
        view.allocate_pages_for_sequences_with_prefix(batch)
    assert_unchanged(before, snapshot(cache, view), rolled_back=True)
    assert cache.match_prefix(Q).num_tokens == len(Q)
    # The same ids, a batch that fits.
    allocs = view.allocate_pages_for_sequences_with_prefix([R(10, P[:8] + [9]), R(11, [1])])
    assert [a.reused_tokens for a in allocs] == [8, 0]
    cache.check()


def test_out_of_pages_after_evicting_everything_evictable(make):
    cache, view = make()
    cache_prefix(view, list(range(100, 133)))           # 8 pages cached, evictable
    st = cache.stats()
    assert (st.free_pages, st.evictable_pages) == (POOL - 8, 8)
    before = snapshot(cache, view, quiet=True)
    # Each request fits the pool alone, the batch does not: it evicts everything, then
    # gives up. (A single request bigger than the pool is refused before the lock.)
    with pytest.raises(OutOfPagesError, match="more than the pool's 32 pages in all"):
        view.allocate_pages_for_sequences_with_prefix(
            [R(1, list(range(PS * (POOL - 4)))), R(2, list(range(5000, 5000 + PS * 5)))])
    assert_unchanged(before, snapshot(cache, view), rolled_back=True)
    # A batch of exactly every free and evictable page fits, evicting the whole tree.
    allocs = view.allocate_pages_for_sequences_with_prefix(
        [R(1, list(range(PS * (POOL - 2)))), R(2, list(range(50, 50 + 2 * PS)))])
    assert sum(len(a.page_table) for a in allocs) == POOL
    st = cache.stats()
    assert (st.free_pages, st.cached_pages, st.evicted_pages) == (0, 0, 8)
    cache.check()


def test_out_of_pages_error_reports_needed_and_available(make):
    # errors.OutOfPagesError: "available: Pages that were free or evictable". The tree's 8
    # evictable pages count, though the failed call evicted them before it gave up.
    cache, view = make()
    cache_prefix(view, list(range(100, 133)))           # 8 pages cached, evictable
    with pytest.raises(OutOfPagesError) as info:
        view.allocate_pages_for_sequences_with_prefix([R(1, list(range(PS * 40)))])
    assert info.value.needed == 40
    assert info.value.available == POOL


def test_failed_batch_undoes_recency_touches_and_hit_counters(make):
    cache, view = make()
    older = list(range(100, 108))
    newer = list(range(200, 208))
    cache_prefix(view, older)
    cache_prefix(view, newer)
    before = snapshot(cache, view, quiet=True)
    # Request 1 borrows `older` (touching it: it would become the most recently used);
    # request 2 cannot fit, even after evicting `newer`.
    with pytest.raises(OutOfPagesError):
        view.allocate_pages_for_sequences_with_prefix(
            [R(1, older + [1]), R(2, list(range(PS * POOL)))])
    assert_unchanged(before, snapshot(cache, view), rolled_back=True)
    # `older` is still the least recently used: it goes first.
    assert cache.evict(2) == 2
    assert cache.match_prefix(older).num_tokens == 0
    assert cache.match_prefix(newer).num_tokens == 8


def test_borrow_counts_as_use(make):
    cache, view = make()
    older = list(range(100, 108))
    newer = list(range(200, 208))
    cache_prefix(view, older)
    cache_prefix(view, newer)
    (alloc,) = view.allocate_pages_for_sequences_with_prefix([R(1, older + [1])])
    assert alloc.reused_tokens == 8
    view.release([1], commit=False)
    assert cache.evict(2) == 2
    assert cache.match_prefix(older).num_tokens == 8
    assert cache.match_prefix(newer).num_tokens == 0
    cache.check()


def test_sequence_capacity_rolls_back(make):
    cache, view = make(max_sequences=3)
    cache_prefix(view, P)
    cache_prefix(view, Q)
    view.allocate_pages_for_sequences_with_prefix([R(LIVE, [1, 2, 3])])
    free = cache.stats().free_pages
    # 10 borrows part of P (a split), 11 needs Q evicted, 12 finds no sequence record.
    batch = [R(10, P[:8] + [9]), R(11, list(range(5000, 5000 + PS * (free - 1)))), R(12, [4])]
    before = snapshot(cache, view, quiet=True)
    with pytest.raises(CapacityError) as info:
        view.allocate_pages_for_sequences_with_prefix(batch)
    assert info.value.resource == "sequences"
    assert_unchanged(before, snapshot(cache, view), rolled_back=True)
    assert cache.match_prefix(Q).num_tokens == len(Q)
    view.release([LIVE], commit=False)
    allocs = view.allocate_pages_for_sequences_with_prefix(batch)
    assert [a.reused_tokens for a in allocs] == [8, 0, 0]
    cache.check()


def test_sequence_page_list_capacity_rolls_back(make):
    # Page lists record a sequence's own pages, twelve to a record; a borrowed prefix is
    # held by its node lock.
    cache, view = make(sequence_page_node_capacity=3)
    cache_prefix(view, P)                       # page-list records are freed at release
    view.allocate_pages_for_sequences_with_prefix([R(LIVE, P + [1])])    # borrows 3: 1 record
    batch = [R(10, P[:8] + [9]), R(11, list(range(5000, 5000 + 13 * PS)))]    # 1 + 2
    before = snapshot(cache, view, quiet=True)
    with pytest.raises(CapacityError) as info:
        view.allocate_pages_for_sequences_with_prefix(batch)
    assert info.value.resource == "sequence page nodes"
    assert_unchanged(before, snapshot(cache, view), rolled_back=True)
    view.release([LIVE], commit=False)
    allocs = view.allocate_pages_for_sequences_with_prefix(batch)
    assert [a.reused_tokens for a in allocs] == [8, 0]
    cache.check()


def test_undo_log_capacity_rolls_back(make):
    cache, view = make(num_pages=400, undo_log_capacity=256)
    cache_prefix(view, P)
    view.allocate_pages_for_sequences_with_prefix([R(LIVE, P + [1])])
    batch = [R(10, P + [9]), R(11, list(range(5000, 5000 + 200 * PS)))]
    before = snapshot(cache, view, quiet=True)
    with pytest.raises(CapacityError) as info:
        view.allocate_pages_for_sequences_with_prefix(batch)
    assert info.value.resource == "undo log"
    assert_unchanged(before, snapshot(cache, view), rolled_back=True)
    allocs = view.allocate_pages_for_sequences_with_prefix([R(10, P + [9]), R(11, [1, 2])])
    assert [a.reused_tokens for a in allocs] == [12, 0]
    cache.check()


def test_default_undo_log_fits_a_batch_of_max_sequences(make):
    # config.apply_runtime_defaults: undo_log_capacity 8 * num_pages + 65536 so that "a batch
    # that touches every page" fits. A batch of max_sequences one-page requests is such a
    # batch (every page, every sequence record), and nothing it needs is short.
    cache, view = make(num_pages=4096, page_bytes=16, max_sequences=0, max_processes=0)
    assert cache.config.max_sequences == 4096
    allocs = view.allocate_pages_for_sequences_with_prefix(
        [R(i, [i, i + 1, i + 2, i + 3]) for i in range(4096)])
    assert len(allocs) == 4096
    assert cache.stats().free_pages == 0
    cache.check()


def test_default_undo_log_fits_releasing_many_sequences_with_commit(make):
    # Release never fails for capacity (commit is best effort, then every reference is
    # dropped). 2048 one-page sequences, allocated in batches that fit, released in one call.
    cache, view = make(num_pages=4096, page_bytes=16, max_sequences=0, max_processes=0)
    for start in range(0, 2048, 512):
        view.allocate_pages_for_sequences_with_prefix(
            [R(i, [i, i + 1, i + 2, i + 3]) for i in range(start, start + 512)])
    assert view.release(list(range(2048))) == [1] * 2048
    st = cache.stats()
    assert (st.active_sequences, st.cached_pages, st.free_pages) == (0, 2048, 2048)
    cache.check()


def test_close_releases_more_than_one_undo_log_holds(segment_name):
    # undo_log_capacity bounds one mutation. close() has to release whatever the view holds,
    # however it was accumulated (here 10 batches that each fit).
    try:
        cache = HostKVCache.create(segment_name, config(num_pages=64, undo_log_capacity=256))
    except hostkv.ConfigError:
        return          # a fix may refuse an undo log too small to release the whole pool
    try:
        view = WorkerView(cache)
        for i in range(10):
            view.allocate_pages_for_sequences_with_prefix(
                [R(i, list(range(16 * i, 16 * i + 16)))])
        assert cache.stats().free_pages == 64 - 40
        view.close()
        st = cache.stats()
        assert (st.active_sequences, st.free_pages) == (0, 64)
        cache.check()
    finally:
        try:
            cache.close()
        except hostkv.HostKVError:
            pass            # the failure above already says why


def test_radix_node_shortage_never_fails_an_allocation_or_a_commit(make):
    cache, view = make(radix_node_capacity=2)
    cache_prefix(view, P)
    cache_prefix(view, Q)
    assert cache.stats().tree_nodes == 2
    # Both nodes locked by live borrowers: no record can be had for a split.
    view.allocate_pages_for_sequences_with_prefix([R(1, P + [1]), R(2, Q + [2])])
    (alloc,) = view.allocate_pages_for_sequences_with_prefix([R(3, P[:8] + [3])])
    # The borrow would end inside P's node: it stops at the node boundary before (nothing).
    assert alloc.reused_tokens == 0
    cache.check()
    # Commit is best effort: no record for Z's node, so nothing is cached, and no error.
    view.allocate_pages_for_sequences_with_prefix([R(4, Z + [4])])
    before = snapshot(cache, quiet=True)
    assert view.commit([4]) == [0]
    after = snapshot(cache)
    assert after.tree == before.tree
    assert after.stats.cached_pages == before.stats.cached_pages
    assert view.state(4).committed_tokens == 0
    # Once Q's borrower ends, Q's leaf is evicted to make room.
    view.release([2], commit=False)
    assert view.commit([4]) == [3]
    assert cache.match_prefix(Z).num_tokens == 12
    assert cache.match_prefix(Q).num_tokens == 0
    assert cache.stats().evicted_pages == 2
    cache.check()
