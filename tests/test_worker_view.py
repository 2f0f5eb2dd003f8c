"""WorkerView: batch allocation with prefix reuse, decode steps, commit and release, in one process.

Every failure is checked for an exact rollback: the segment's counters (all of them), the
radix tree's contents, the live sequence records, cache.check() (exact reference accounting:
these tests hold no raw references) and the view's own bookkeeping must be what they were,
and the ids of the failed batch must be usable at once. The only counter a failed mutation
may move is ``rollbacks`` (+1 when the failure came after a logged store); ``generation``
counts committed mutations, so it must not move either - snapshots are taken inside a
"quiet" window (a forced sweep just before), because a lock taken more than a second after
the last sweep sweeps the leases again and commits that as a mutation of its own.

Multiprocess behaviour (prefix reuse across processes, dead processes) is in
test_worker_view_multiprocess.py; the model-based test in test_worker_view_model.py.
"""

from __future__ import annotations

import copy
import dataclasses
import multiprocessing
import os
import pickle
import time
import weakref
from unittest import mock

import numpy as np
import pytest

import hostkv
from hostkv import (
    CapacityError,
    HostKVCache,
    OutOfPagesError,
    SequenceError,
    SequenceRequest as R,
    WorkerView,
)
from hostkv import _introspect, _sequences, _tokens, _viewstate

from conftest import fork_quietly

PS = 4                      # tokens per page in these tests
POOL = 32                   # pages in the default pool
# A cached 3-page prefix and two other prompts that share nothing with it or each other.
P = list(range(1000, 1012))
Q = list(range(2000, 2008))
Z = list(range(3000, 3012))

# How long after a forced sweep a snapshot pair is trusted to see no periodic sweep
# (_segment.SWEEP_INTERVAL_NS is one second).
QUIET_S = 0.8


def config(**overrides) -> hostkv.HostKVConfig:
    values = dict(num_pages=POOL, page_size=PS, page_bytes=64, max_processes=8)
    values.update(overrides)
    return hostkv.HostKVConfig(**values)


def pages_for(n: int) -> int:
    return -(-n // PS)


@pytest.fixture
def make(segment_name, new_name):
    """Creates (cache, view) pairs; views then caches are closed in teardown."""
    opened = []

    def factory(**overrides):
        name = segment_name if not opened else new_name()
        cache = HostKVCache.create(name, config(**overrides))
        view = WorkerView(cache)
        opened.append((cache, view))
        return cache, view

    yield factory
    for cache, view in reversed(opened):
        try:
            view.close()
        finally:
            try:
                cache.close()
            except BufferError:
                pass


# -- snapshots -------------------------------------------------------------------------------------


@dataclasses.dataclass
class Snapshot:
    taken_at: float
    stats: hostkv.CacheStats
    tree: set
    records: list
    view: object


def view_state(view: WorkerView):
    """The view's own bookkeeping, comparable with ==."""
    states = {}
    for sid in view.live_sequences:
        s = view.state(sid)
        states[sid] = (s.namespace, s.num_tokens, tuple(s.tokens.tolist()), s.reused_tokens,
                       s.committed_tokens, s.cacheable_tokens, tuple(s.pages.tolist()),
                       tuple(view.page_table(sid).tolist()))
    return view.stats(), states


def snapshot(cache: HostKVCache, view: WorkerView = None, quiet: bool = False) -> Snapshot:
    """Everything a failed call must leave as it was. quiet: force a sweep first, so the next
    second has no periodic one (which would commit a mutation and move `generation`)."""
    if quiet:
        cache.reap()
    taken_at = time.monotonic()
    cache.check()
    seg = cache._segment
    return Snapshot(
        taken_at=taken_at,
        stats=cache.stats(),
        tree=seg.run_locked(_introspect.tree_contents, seg),
        records=sorted(seg.run_locked(_sequences.live_sequences, seg)),
        view=view_state(view) if view is not None else None,
    )


def assert_unchanged(before: Snapshot, after: Snapshot, rolled_back: bool) -> None:
    b = dataclasses.asdict(before.stats)
    a = dataclasses.asdict(after.stats)
    for field in ("generation", "rollbacks"):
        b.pop(field)
        a.pop(field)
    assert a == b
    assert after.stats.rollbacks == before.stats.rollbacks + (1 if rolled_back else 0)
    if after.taken_at - before.taken_at < QUIET_S:
        assert after.stats.generation == before.stats.generation
    else:                   # a slow machine: a periodic sweep may have committed once
        assert after.stats.generation - before.stats.generation in (0, 1)
    assert after.tree == before.tree
    assert after.records == before.records
    assert after.view == before.view


def cache_prefix(view: WorkerView, tokens, namespace: int = 0, seq_id: int = 999) -> None:
    """Puts tokens' full pages in the tree (allocate, then release with commit)."""
    view.allocate_pages_for_sequences_with_prefix([R(seq_id, tokens, namespace)])
    view.release([seq_id])


def tree_pages(cache: HostKVCache) -> set:
    seg = cache._segment
    return {p for _, _, pages, _ in seg.run_locked(_introspect.tree_contents, seg) for p in pages}


# -- input validation --------------------------------------------------------------------------

LIVE = 7                     # a live sequence in the validation fixture


def _torch():
    return pytest.importorskip("torch")


# Each case: a function giving the bad batch (after a valid first request where it is a list),
# and the error expected. Ids and tokens are judged before anything touches the segment.
BAD_BATCHES = {
    "id-bool": (lambda: [R(True, [1, 2])], SequenceError),
    "id-numpy-bool": (lambda: [R(np.bool_(True), [1, 2])], SequenceError),
    "id-float": (lambda: [R(1.0, [1, 2])], SequenceError),
    "id-str": (lambda: [R("1", [1, 2])], SequenceError),
    "id-none": (lambda: [R(None, [1, 2])], SequenceError),
    "id-above-int64": (lambda: [R(2**63, [1, 2])], SequenceError),
    "id-below-int64": (lambda: [R(-2**63 - 1, [1, 2])], SequenceError),
    "id-twice": (lambda: [R(5, [1, 2]), R(np.int64(5), [3, 4])], SequenceError),
    "id-live": (lambda: [R(LIVE, [1, 2])], SequenceError),
    "prompt-empty-list": (lambda: [R(5, [])], SequenceError),
    "prompt-empty-array": (lambda: [R(5, np.empty(0, dtype=np.int32))], SequenceError),
    "prompt-empty-tensor": (lambda: [R(5, _torch().empty(0, dtype=_torch().int64))],
                            SequenceError),
    "token-negative": (lambda: [R(5, [1, -1])], ValueError),
    "token-2**31": (lambda: [R(5, [1, 2**31])], ValueError),
    "token-2**63": (lambda: [R(5, [1, 2**63])], ValueError),
    "token-2**64": (lambda: [R(5, [1, 2**64])], ValueError),
    "token-float": (lambda: [R(5, [1, 2.0])], ValueError),
    "token-bool": (lambda: [R(5, [True, False])], ValueError),
    "token-str": (lambda: [R(5, "12")], ValueError),
    "token-none": (lambda: [R(5, None)], ValueError),
    "token-none-inside": (lambda: [R(5, [1, None])], ValueError),
    "token-float-array": (lambda: [R(5, np.ones(3, dtype=np.float32))], ValueError),
    "token-2d-array": (lambda: [R(5, np.ones((2, 2), dtype=np.int32))], ValueError),
    "token-int32-array-negative": (lambda: [R(5, np.array([3, -4], dtype=np.int32))],
                                   ValueError),
    "token-int64-array-big": (lambda: [R(5, np.array([3, 2**31], dtype=np.int64))], ValueError),
    "token-uint32-array-big": (lambda: [R(5, np.array([3, 2**31], dtype=np.uint32))],
                               ValueError),
    "token-tensor-negative": (lambda: [R(5, _torch().tensor([1, -1]))], ValueError),
    "token-tensor-float": (lambda: [R(5, _torch().tensor([1.0, 2.0]))], ValueError),
    "namespace-negative": (lambda: [R(5, [1, 2], -1)], ValueError),
    "namespace-2**64": (lambda: [R(5, [1, 2], 2**64)], ValueError),
    "namespace-float": (lambda: [R(5, [1, 2], 1.0)], ValueError),
    "namespace-bool": (lambda: [R(5, [1, 2], True)], ValueError),
    "namespace-str": (lambda: [R(5, [1, 2], "0")], ValueError),
    "request-not-a-request": (lambda: [(5, [1, 2])], SequenceError),
}

# Not a list of requests at all.
BAD_CONTAINERS = {
    "single-request": (lambda: R(5, [1, 2]), SequenceError),
    "generator": (lambda: (r for r in [R(5, [1, 2])]), SequenceError),
    "none": (lambda: None, SequenceError),
    "dict": (lambda: {5: [1, 2]}, SequenceError),
}


@pytest.fixture
def busy(make):
    """A cache with a cached prefix P, a cached Q, and a live sequence LIVE borrowing P."""
    cache, view = make()
    cache_prefix(view, P)
    cache_prefix(view, Q)
    (alloc,) = view.allocate_pages_for_sequences_with_prefix([R(LIVE, P + [1, 2])])
    assert alloc.reused_tokens == 12
    return cache, view


def _assert_rejected_untouched(cache, view, batch, error):
    seg = cache._segment
    before = snapshot(cache, view, quiet=True)
    # Any logged store (the first step of any mutation) would raise MemoryError here instead.
    seg._arm_crash_point(1, "memory_error")
    try:
        with pytest.raises(error):
            view.allocate_pages_for_sequences_with_prefix(batch)
        assert seg.crash_steps_left == 1, "validation touched the segment"
    finally:
        seg._arm_crash_point(0)
    assert_unchanged(before, snapshot(cache, view), rolled_back=False)


@pytest.mark.parametrize("case", sorted(BAD_BATCHES))
def test_bad_request_rejects_the_whole_batch_before_touching_the_segment(busy, case):
    cache, view = busy
    make_bad, error = BAD_BATCHES[case]
    # The valid first request would borrow P: it must not have.
    batch = [R(10, P + [5])] + make_bad()
    _assert_rejected_untouched(cache, view, batch, error)
    # The same ids are usable at once.
    allocs = view.allocate_pages_for_sequences_with_prefix([R(10, P + [5]), R(5, [1, 2])])
    assert [a.reused_tokens for a in allocs] == [12, 0]
    view.release([10, 5], commit=False)
    cache.check()


@pytest.mark.parametrize("case", sorted(BAD_CONTAINERS))
def test_bad_batch_container_is_rejected(busy, case):
    cache, view = busy
    make_bad, error = BAD_CONTAINERS[case]
    _assert_rejected_untouched(cache, view, make_bad(), error)


def test_empty_batch_allocates_nothing(busy):
    cache, view = busy
    before = snapshot(cache, view, quiet=True)
    assert view.allocate_pages_for_sequences_with_prefix([]) == []
    assert view.allocate_pages_for_sequences_with_prefix(()) == []
    assert_unchanged(before, snapshot(cache, view), rolled_back=False)


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


# -- reuse -------------------------------------------------------------------------------------


def test_offload_skip_fields(make):
    cache, view = make()
    cache_prefix(view, P)
    cached = cache.match_prefix(P).pages
    (alloc,) = view.allocate_pages_for_sequences_with_prefix([R(1, P + [7, 8, 9, 10, 11])])
    assert alloc.seq_id == 1
    assert alloc.page_size == PS
    assert alloc.reused_tokens == 12
    assert alloc.write_from_token == 12
    assert alloc.num_shared_pages == 3
    assert alloc.page_table.dtype == np.int32
    assert len(alloc.page_table) == pages_for(17)
    assert alloc.page_table[:3].tolist() == cached.tolist()
    own = alloc.page_table[3:].tolist()
    assert len(set(own)) == len(own) and not set(own) & tree_pages(cache)
    # The allocation's table is read-only: it is the view's own, no scribbling on it.
    with pytest.raises(ValueError):
        alloc.page_table[:] = -1
    assert view.page_table(1)[:3].tolist() == cached.tolist()


def test_reuse_is_page_aligned_and_always_leaves_a_token(make):
    cache, view = make()
    cache_prefix(view, P)                                   # 3 pages
    cases = [
        (P + [1], 12),
        (P, 8),                 # the whole prompt cached: its last page is computed again
        (P[:11], 8),
        (P[:9], 8),
        (P[:8], 4),
        (P[:5], 4),
        (P[:4], 0),
        (P[:1], 0),
        (P[:6] + [1, 2, 3, 4], 4),      # diverges inside the second page
        ([P[0] + 1] + P[1:], 0),        # diverges at the first token
    ]
    for i, (tokens, expected) in enumerate(cases):
        st = cache.stats()
        (alloc,) = view.allocate_pages_for_sequences_with_prefix([R(100 + i, tokens)])
        assert alloc.reused_tokens == expected, tokens
        assert alloc.reused_tokens % PS == 0 and alloc.reused_tokens < len(tokens)
        after = cache.stats()
        assert after.lookups == st.lookups + 1
        assert after.lookup_tokens == st.lookup_tokens + len(tokens)
        assert after.hit_tokens == st.hit_tokens + expected
        assert after.borrowed_pages == expected // PS
        view.release([100 + i], commit=False)
    cache.check()


def test_min_reuse_pages(make):
    cache, view = make(prefix_min_reuse_pages=2)
    cache_prefix(view, P)
    before = snapshot(cache, quiet=True)
    (alloc,) = view.allocate_pages_for_sequences_with_prefix([R(1, P[:4] + [1])])
    assert alloc.reused_tokens == 0
    after = snapshot(cache)
    # The one-page match was not borrowed: no split, no lock, no hit.
    assert {(ns, t, p) for ns, t, p, _ in after.tree} == {(ns, t, p) for ns, t, p, _ in before.tree}
    assert after.stats.tree_nodes == before.stats.tree_nodes
    assert after.stats.borrowed_pages == 0
    assert after.stats.hit_tokens == before.stats.hit_tokens
    (alloc,) = view.allocate_pages_for_sequences_with_prefix([R(2, P[:8] + [1])])
    assert alloc.reused_tokens == 8
    cache.check()


def test_namespaces_never_share(make):
    cache, view = make()
    spaces = (0, 1, 2**63 - 1)
    cache_prefix(view, P, namespace=0)
    allocs = view.allocate_pages_for_sequences_with_prefix(
        [R(1, P + [1], 1), R(2, P + [1], 2**63 - 1), R(3, P + [1], np.int64(1))])
    assert [a.reused_tokens for a in allocs] == [0, 0, 0]
    assert view.state(2).namespace == 2**63 - 1
    view.release([1, 2])
    view.release([3], commit=False)
    # Each namespace now has its own copy.
    assert cache.stats().cached_pages == 3 * 3
    for ns in spaces:
        (alloc,) = view.allocate_pages_for_sequences_with_prefix([R(9, P + [1], ns)])
        assert alloc.reused_tokens == 12
        assert alloc.page_table[:3].tolist() == cache.match_prefix(P, ns).pages.tolist()
        view.release([9], commit=False)
    assert len({tuple(cache.match_prefix(P, ns).pages) for ns in spaces}) == 3
    cache.check()


@pytest.mark.parametrize("namespace", [2**63, 2**64 - 1, np.uint64(2**64 - 1)])
def test_namespaces_above_int64_max(make, namespace):
    # docs/design.md: "Namespaces are unsigned 64-bit"; as_namespace accepts [0, 2**64).
    cache, view = make()
    (alloc,) = view.allocate_pages_for_sequences_with_prefix([R(1, P + [1], namespace)])
    assert alloc.reused_tokens == 0
    assert view.state(1).namespace == int(namespace)
    assert view.release([1]) == [3]
    assert cache.match_prefix(P, namespace).num_tokens == 12
    assert cache.match_prefix(P, 0).num_tokens == 0
    (alloc,) = view.allocate_pages_for_sequences_with_prefix([R(2, P + [2], namespace)])
    assert alloc.reused_tokens == 12
    view.release([2])
    cache.check()


def test_batch_requests_all_borrow_a_prefix_cached_before_the_batch(make):
    cache, view = make()
    cache_prefix(view, P)
    cached = cache.match_prefix(P).pages.tolist()
    allocs = view.allocate_pages_for_sequences_with_prefix(
        [R(1, P + [1]), R(2, P + [2]), R(3, P[:8] + [3, 4])])
    assert [a.reused_tokens for a in allocs] == [12, 12, 8]
    assert allocs[0].page_table[:3].tolist() == cached
    assert allocs[1].page_table[:3].tolist() == cached
    assert allocs[2].page_table[:2].tolist() == cached[:2]
    own = [p for a in allocs for p in a.page_table[a.num_shared_pages:].tolist()]
    assert len(set(own)) == len(own) and not set(own) & set(cached)
    st = cache.stats()
    assert st.borrowed_pages == 3
    assert st.hit_tokens == 12 + 12 + 8
    assert st.free_pages == POOL - 3 - len(own)
    cache.check()


def test_batch_requests_do_not_see_each_others_pages(make):
    cache, view = make()
    allocs = view.allocate_pages_for_sequences_with_prefix([R(1, Z + [1]), R(2, Z + [2])])
    assert [a.reused_tokens for a in allocs] == [0, 0]
    assert not set(allocs[0].page_table.tolist()) & set(allocs[1].page_table.tolist())
    # Both commit at release: the tree keeps one copy (the first's), the duplicate is freed.
    assert view.release([1, 2]) == [3, 3]
    st = cache.stats()
    assert st.cached_pages == 3
    assert st.free_pages == POOL - 3
    assert cache.match_prefix(Z).pages.tolist() == allocs[0].page_table[:3].tolist()
    cache.check()


def _assert_reuse_off(cache, view):
    assert cache.config.enable_prefix_reuse is False
    cache_prefix(view, P)
    assert cache.stats().cached_pages == 0
    allocs = view.allocate_pages_for_sequences_with_prefix([R(1, P + [1]), R(2, P + [2])])
    assert [a.reused_tokens for a in allocs] == [0, 0]
    view.append_tokens([1, 2], [5, 6])
    assert view.commit([1, 2]) == [0, 0]
    assert view.state(1).committed_tokens == 0
    assert view.release([1, 2]) == [0, 0]
    st = cache.stats()
    assert (st.cached_pages, st.tree_nodes, st.hit_tokens, st.inserted_pages) == (0, 0, 0, 0)
    assert st.free_pages == POOL
    assert cache.match_prefix(P).num_tokens == 0
    cache.check()


def test_prefix_reuse_disabled_by_config(make):
    cache, view = make(enable_prefix_reuse=False)
    _assert_reuse_off(cache, view)


def test_prefix_reuse_disabled_by_env_at_create(make, monkeypatch):
    monkeypatch.setenv("HOSTKV_ENABLE_PREFIX_REUSE", "0")
    cache, view = make()                # the config says True; the env wins at create
    monkeypatch.delenv("HOSTKV_ENABLE_PREFIX_REUSE")
    _assert_reuse_off(cache, view)
    # Attaching reads the segment's config: still off.
    with HostKVCache.attach(cache.name) as other, WorkerView(other) as other_view:
        _assert_reuse_off(other, other_view)


def test_env_at_attach_does_not_change_the_segment(make, monkeypatch):
    cache, view = make()
    monkeypatch.setenv("HOSTKV_ENABLE_PREFIX_REUSE", "0")
    with HostKVCache.attach(cache.name) as other, WorkerView(other) as other_view:
        assert other.config.enable_prefix_reuse is True
        cache_prefix(other_view, P)
        (alloc,) = view.allocate_pages_for_sequences_with_prefix([R(1, P + [1])])
        assert alloc.reused_tokens == 12


def test_other_views_and_handles_see_commits(make):
    cache, view = make()
    other_view = WorkerView(cache)
    with HostKVCache.attach(cache.name) as other, WorkerView(other) as third:
        view.allocate_pages_for_sequences_with_prefix([R(1, P + [1])])
        # Ids are per view: the same id in another view is another sequence.
        (a,) = other_view.allocate_pages_for_sequences_with_prefix([R(1, P + [1])])
        assert a.reused_tokens == 0
        assert view.commit([1]) == [3]
        (b,) = third.allocate_pages_for_sequences_with_prefix([R(1, P + [2])])
        assert b.reused_tokens == 12
        assert b.page_table[:3].tolist() == view.page_table(1)[:3].tolist()
        third.release([1])
        other_view.release([1])
        view.release([1])
        other.check()
    other_view.close()
    assert cache.stats().free_pages == POOL - 3
    cache.check()


# -- decode ------------------------------------------------------------------------------------


def test_a_sequence_holds_ceil_n_over_page_size_pages_at_every_step(make):
    cache, view = make(num_pages=64)
    prompts = {1: [1], 2: [1, 2, 3, 4], 3: [1, 2, 3, 4, 5], 4: list(range(8)), 5: list(range(7))}
    view.allocate_pages_for_sequences_with_prefix([R(s, t) for s, t in prompts.items()])
    tables = {s: view.page_table(s).tolist() for s in prompts}
    for s, t in prompts.items():
        assert len(tables[s]) == pages_for(len(t))
    ids = list(prompts)
    for step in range(13):
        view.append_tokens(ids, [100 + step] * len(ids))
        held = 0
        for s in ids:
            n = len(prompts[s]) + step + 1
            table = view.page_table(s).tolist()
            assert len(table) == pages_for(n)
            # Earlier pages never move; a new page comes only when the last one was full.
            assert table[:len(tables[s])] == tables[s]
            assert len(table) - len(tables[s]) == (1 if (n - 1) % PS == 0 else 0)
            tables[s] = table
            state = view.state(s)
            assert state.num_tokens == n
            assert state.tokens.tolist() == prompts[s] + list(range(100, 100 + step + 1))
            held += len(table)
        all_pages = [p for t in tables.values() for p in t]
        assert len(set(all_pages)) == len(all_pages)
        assert cache.stats().free_pages == 64 - held
    cache.check()


def test_decode_pages_are_reusable_after_commit(make):
    cache, view = make()
    prompt = [1, 2, 3, 4, 5]
    view.allocate_pages_for_sequences_with_prefix([R(1, prompt)])
    decoded = list(range(50, 61))
    for i, token in enumerate(decoded[:5]):
        view.append_tokens([1], [token])
    # 10 tokens: 2 full pages, the second filled by decode.
    assert view.commit([1]) == [2]
    assert cache.match_prefix(prompt + decoded[:5]).num_tokens == 8
    for token in decoded[5:]:
        view.append_tokens([1], [token])
    assert view.commit([1]) == [4]
    tokens = prompt + decoded
    assert view.state(1).committed_tokens == 16
    (alloc,) = view.allocate_pages_for_sequences_with_prefix([R(2, tokens + [99])])
    assert alloc.reused_tokens == 16
    assert alloc.page_table[:4].tolist() == view.page_table(1).tolist()
    # The adopted pages are the tree's and the sequence's: nothing was copied.
    assert cache.stats().free_pages == POOL - 4 - 1
    view.release([1, 2])
    assert cache.stats().free_pages == POOL - 4
    cache.check()


def test_none_token_stops_only_its_own_sequence(make):
    cache, view = make()
    base = {1: [10, 11, 12, 13], 2: [20, 21, 22, 23], 3: [30, 31, 32, 33]}
    view.allocate_pages_for_sequences_with_prefix([R(s, t) for s, t in base.items()])
    view.append_tokens([1, 2, 3], [None, 24, 34])
    for k in range(5, 12):
        view.append_tokens([1, 2, 3], [k, 20 + k, 30 + k] if k != 9 else [k, None, 30 + k])
    s1, s2, s3 = view.state(1), view.state(2), view.state(3)
    assert (s1.num_tokens, s2.num_tokens, s3.num_tokens) == (12, 12, 12)
    assert (s1.cacheable_tokens, s2.cacheable_tokens, s3.cacheable_tokens) == (4, 9, 12)
    assert s1.tokens[4] == 0 and s2.tokens[9] == 0
    assert len(view.page_table(1)) == 3
    assert view.commit([1, 2, 3]) == [1, 2, 3]
    assert cache.match_prefix(s1.tokens).num_tokens == 4
    assert cache.match_prefix(s2.tokens).num_tokens == 8
    assert cache.match_prefix(s3.tokens).num_tokens == 12
    # More known tokens do not make the None position cacheable again.
    view.append_tokens([1], [77])
    assert view.commit([1]) == [1]
    assert view.release([1, 2, 3]) == [1, 2, 3]
    assert cache.stats().cached_pages == 6
    cache.check()


def test_append_out_of_pages_leaves_every_sequence_unchanged(make):
    cache, view = make(num_pages=8)
    cache_prefix(view, [9, 9, 9, 9, 9])           # 1 cached page, evictable
    view.allocate_pages_for_sequences_with_prefix(
        [R(1, [1, 2, 3, 4]), R(2, [5, 6, 7, 8]), R(3, [1, 2, 3]), R(4, list(range(13)))])
    assert cache.stats().free_pages == 0
    before = snapshot(cache, view, quiet=True)
    with pytest.raises(OutOfPagesError):
        # 1 and 2 need a page each, 3 does not; none free, one evictable: one short.
        view.append_tokens([3, 1, 2], [4, 5, 9])
    assert_unchanged(before, snapshot(cache, view), rolled_back=True)
    view.release([4], commit=False)
    view.append_tokens([3, 1, 2], [4, 5, 9])
    assert [len(view.page_table(s)) for s in (1, 2, 3)] == [2, 2, 1]
    assert view.state(3).tokens.tolist() == [1, 2, 3, 4]
    assert cache.match_prefix([9, 9, 9, 9]).num_tokens == 4      # no eviction was needed
    cache.check()


def test_append_evicts_when_short(make):
    cache, view = make(num_pages=8)
    cache_prefix(view, [9, 9, 9, 9, 9])
    view.allocate_pages_for_sequences_with_prefix([R(1, [1, 2, 3, 4]), R(2, list(range(24)))])
    assert cache.stats().free_pages == 0
    view.append_tokens([1], [5])
    assert cache.stats().evicted_pages == 1
    assert len(view.page_table(1)) == 2
    cache.check()


BAD_STEPS = {
    "unknown-id": (lambda: ([1, 42], [5, 5]), SequenceError),
    "id-twice": (lambda: ([1, 1], [5, 5]), SequenceError),
    "id-bool": (lambda: ([True], [5]), SequenceError),
    "ids-a-string": (lambda: ("12", [5, 5]), SequenceError),
    "ids-an-int": (lambda: (1, [5]), SequenceError),
    "fewer-tokens": (lambda: ([1, 2], [5]), SequenceError),
    "more-tokens": (lambda: ([1, 2], [5, 6, 7]), SequenceError),
    "token-negative": (lambda: ([1, 2], [5, -1]), ValueError),
    "token-2**31": (lambda: ([1, 2], [5, 2**31]), ValueError),
    "token-float": (lambda: ([1, 2], [5, 6.0]), ValueError),
    "token-bool": (lambda: ([1, 2], [5, True]), ValueError),
    "token-str": (lambda: ([1, 2], [5, "6"]), ValueError),
}


@pytest.mark.parametrize("case", sorted(BAD_STEPS))
def test_bad_decode_step_changes_nothing(make, case):
    cache, view = make()
    view.allocate_pages_for_sequences_with_prefix([R(1, [1, 2, 3, 4]), R(2, [5, 6, 7, 8])])
    make_bad, error = BAD_STEPS[case]
    before = snapshot(cache, view, quiet=True)
    with pytest.raises(error):
        view.append_tokens(*make_bad())
    assert_unchanged(before, snapshot(cache, view), rolled_back=False)
    view.append_tokens([1, 2], [np.int64(5), np.uint32(9)])
    assert view.state(2).tokens.tolist() == [5, 6, 7, 8, 9]


def test_commit_is_idempotent_and_respects_num_tokens(make):
    cache, view = make()
    view.allocate_pages_for_sequences_with_prefix(
        [R(1, list(range(14))), R(2, list(range(50, 63)))])
    assert view.commit([1], num_tokens=4) == [1]
    assert view.commit([1, 2], num_tokens=[9, 3]) == [2, 0]
    assert view.commit([1], num_tokens=1) == [2]           # never goes back
    assert cache.stats().cached_pages == 2
    assert view.commit([1, 2]) == [3, 3]
    before = snapshot(cache, view, quiet=True)
    assert view.commit([1, 2]) == [3, 3]
    assert view.commit([2, 1], num_tokens=100) == [3, 3]
    assert_unchanged(before, snapshot(cache, view), rolled_back=False)
    for bad in (dict(num_tokens=-1), dict(num_tokens=[4])):
        with pytest.raises(SequenceError):
            view.commit([1, 2], **bad)
    for ids in ([42], [1, 1], [1, 42]):
        with pytest.raises(SequenceError):
            view.commit(ids)
    assert_unchanged(before, snapshot(cache, view), rolled_back=False)
    cache.check()


def test_commit_respects_min_store_pages(make):
    cache, view = make(prefix_min_store_pages=2)
    view.allocate_pages_for_sequences_with_prefix([R(1, [1, 2, 3, 4, 5])])
    assert view.commit([1]) == [0]
    assert cache.stats().cached_pages == 0
    view.append_tokens([1], [6])
    view.append_tokens([1], [7])
    view.append_tokens([1], [8])
    assert view.commit([1]) == [2]
    assert cache.stats().cached_pages == 2
    # A release with one full page caches nothing either.
    view.allocate_pages_for_sequences_with_prefix([R(2, [9, 9, 9, 9, 9])])
    assert view.release([2]) == [0]
    assert cache.stats().cached_pages == 2
    cache.check()


def test_commit_dedupes_and_release_frees_the_duplicates(make):
    cache, view = make()
    view.allocate_pages_for_sequences_with_prefix([R(1, Z + [1]), R(2, Z + [1])])
    assert view.commit([1]) == [3]
    first = view.page_table(1)[:3].tolist()
    assert view.commit([2]) == [3]          # found in the cache: the tree keeps one copy
    st = cache.stats()
    assert st.cached_pages == 3
    assert st.free_pages == POOL - 4 - 4
    assert cache.match_prefix(Z).pages.tolist() == first
    assert view.state(2).committed_tokens == 12
    view.release([2])
    assert cache.stats().free_pages == POOL - 4     # 2's own copies are freed
    view.release([1])
    assert cache.stats().free_pages == POOL - 3
    cache.check()


def test_release_without_commit_frees_private_pages_and_keeps_borrowed_ones(make):
    cache, view = make()
    cache_prefix(view, P)
    view.allocate_pages_for_sequences_with_prefix([R(1, P + list(range(9)))])
    view.append_tokens([1], [5])
    assert view.release([1], commit=False) == [3]     # the borrowed pages stay cached
    st = cache.stats()
    assert (st.cached_pages, st.free_pages, st.active_sequences) == (3, POOL - 3, 0)
    assert cache.match_prefix(P + list(range(9))).num_tokens == 12
    cache.check()


def test_release_commits_then_frees_and_ids_are_reusable(make):
    cache, view = make()
    view.allocate_pages_for_sequences_with_prefix([R(1, Z + [1, 2]), R(2, [7])])
    with pytest.raises(SequenceError):
        view.release([1, 42])               # one unknown id: nothing is released
    assert sorted(view.live_sequences) == [1, 2]
    assert view.release([1, 2]) == [3, 0]
    assert view.live_sequences == []
    st = cache.stats()
    assert (st.cached_pages, st.free_pages, st.active_sequences) == (3, POOL - 3, 0)
    for call in (lambda: view.release([1]), lambda: view.commit([1]),
                 lambda: view.append_tokens([1], [1]), lambda: view.page_table(1),
                 lambda: view.state(1)):
        with pytest.raises(SequenceError):
            call()
    allocs = view.allocate_pages_for_sequences_with_prefix([R(1, Z + [3]), R(2, Z + [4])])
    assert [a.reused_tokens for a in allocs] == [12, 12]
    cache.check()


# -- the rest of the view's surface ---------------------------------------------------------------


def test_close_releases_live_sequences_without_commit(make):
    cache, view = make()
    cache_prefix(view, P)
    view.allocate_pages_for_sequences_with_prefix([R(1, P + [1]), R(2, Z + [2])])
    view.append_tokens([1, 2], [3, 4])
    view.close()
    st = cache.stats()
    assert (st.active_sequences, st.cached_pages, st.free_pages) == (0, 3, POOL - 3)
    assert cache.match_prefix(Z).num_tokens == 0
    view.close()                            # idempotent
    for call in (lambda: view.allocate_pages_for_sequences_with_prefix([R(1, [1])]),
                 lambda: view.append_tokens([1], [1]), lambda: view.commit([1]),
                 lambda: view.release([1]), lambda: view.page_table(1)):
        with pytest.raises(ValueError):
            call()
    with WorkerView(cache) as other:
        other.allocate_pages_for_sequences_with_prefix([R(1, Z + [1])])
    assert cache.stats().active_sequences == 0
    assert cache.stats().cached_pages == 3
    cache.check()


def test_closing_the_cache_first_releases_the_views_sequences(segment_name):
    cache = HostKVCache.create(segment_name, config())
    view = WorkerView(cache)
    view.allocate_pages_for_sequences_with_prefix([R(1, P + [1])])
    cache.close()
    view.close()                            # nothing left to release, and no error
    with HostKVCache.attach(segment_name) as again:
        st = again.stats()
        assert (st.active_sequences, st.free_pages) == (0, POOL)
        again.check()


def test_worker_view_needs_an_open_cache(segment_name):
    with pytest.raises(TypeError):
        WorkerView(object())
    cache = HostKVCache.create(segment_name, config())
    cache.close()
    with pytest.raises(ValueError):
        WorkerView(cache)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_forked_child_cannot_use_the_parents_view(make):
    cache, view = make()
    view.allocate_pages_for_sequences_with_prefix([R(1, P + [1])])
    pid = fork_quietly()
    if pid == 0:                            # the child: never return into pytest
        status = 3
        try:
            failures = 0
            for call in (lambda: view.allocate_pages_for_sequences_with_prefix([R(2, [1])]),
                         lambda: view.append_tokens([1], [1]), lambda: view.commit([1]),
                         lambda: view.release([1]), lambda: view.page_table(1),
                         lambda: view.state(1)):
                try:
                    call()
                except SequenceError:
                    pass
                else:
                    failures += 1
            view.close()                    # must not release the parent's sequence
            with WorkerView(cache) as own:  # a view of its own works
                (a,) = own.allocate_pages_for_sequences_with_prefix([R(1, P + [2])])
                if a.reused_tokens != 0 or cache.stats().active_sequences != 2:
                    failures += 1
            status = 0 if failures == 0 else 1
        except BaseException:
            status = 2
        finally:
            os._exit(status)
    _, wait_status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(wait_status) == 0
    assert view.live_sequences == [1]
    assert cache.reap() == 1                # the child's lease
    st = cache.stats()
    assert st.active_sequences == 1
    assert len(view.page_table(1)) == 4
    view.append_tokens([1], [2])
    assert view.release([1]) == [3]
    cache.check()


def test_a_decode_step_never_writes_into_the_allocations_table(make):
    """The allocation's page table is the caller's to read: a step that takes a page grows
    the view's own table instead, whatever room the shared one has."""
    cache, view = make()
    (alloc,) = view.allocate_pages_for_sequences_with_prefix([R(1, list(range(1, 9)))])
    before = alloc.page_table.tolist()
    assert len(before) == 2                          # both pages full: the next token needs one
    for token in range(20, 25):
        view.append_tokens([1], [token])
    assert alloc.page_table.tolist() == before and not alloc.page_table.flags.writeable
    table = view.page_table(1)
    assert len(table) == 4 and table[:2].tolist() == before
    assert len(set(table.tolist())) == 4
    assert view.state(1).tokens.tolist() == list(range(1, 9)) + list(range(20, 25))
    view.release([1])
    cache.check()


def test_page_table_is_a_read_only_view(make):
    cache, view = make()
    view.allocate_pages_for_sequences_with_prefix([R(1, [1, 2, 3, 4, 5])])
    table = view.page_table(1)
    assert table.dtype == np.int32
    assert not table.flags.writeable
    with pytest.raises(ValueError):
        table[0] = 3
    assert len(table) == 2


def test_state_is_a_snapshot(make):
    cache, view = make()
    cache_prefix(view, P)
    view.allocate_pages_for_sequences_with_prefix([R(1, np.array(P + [7, 8], np.int64), 5)])
    view.allocate_pages_for_sequences_with_prefix([R(2, P + [7, 8], 0)])
    s = view.state(2)
    assert isinstance(s, hostkv.PrefixSequenceState)
    assert (s.seq_id, s.namespace, s.num_tokens, s.reused_tokens, s.committed_tokens,
            s.cacheable_tokens) == (2, 0, 14, 12, 12, 14)
    assert s.tokens.dtype == np.int32 and s.tokens.tolist() == P + [7, 8]
    assert s.pages.dtype == np.int32 and s.pages.tolist() == view.page_table(2).tolist()
    assert view.state(1).namespace == 5 and view.state(1).reused_tokens == 0
    # A copy: later steps and scribbles do not reach it, nor it the view.
    s.tokens[:] = 0
    s.pages[:] = 0
    view.append_tokens([2], [None])
    view.append_tokens([2], [9])
    assert (s.num_tokens, s.cacheable_tokens) == (14, 14)
    t = view.state(2)
    assert (t.num_tokens, t.cacheable_tokens, t.committed_tokens) == (16, 14, 12)
    assert t.tokens.tolist() == P + [7, 8, 0, 9]
    assert len(t.pages) == 4 and t.pages[:3].tolist() == cache.match_prefix(P).pages.tolist()
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.num_tokens = 3


def test_view_stats(make):
    cache, view = make()
    assert view.stats() == hostkv.WorkerViewStats(0, 0, 0, 0, 0)
    cache_prefix(view, P)
    assert view.stats() == hostkv.WorkerViewStats(1, 12, 0, 3, 0)
    view.allocate_pages_for_sequences_with_prefix([R(1, P + [1, 2, 3, 4, 5]), R(2, [1])])
    assert view.stats() == hostkv.WorkerViewStats(3, 12 + 17 + 1, 12, 3, 2)
    view.commit([1])                        # one more page beyond the 3 borrowed
    assert view.stats().committed_pages == 4
    view.release([1, 2])
    assert view.stats() == hostkv.WorkerViewStats(3, 30, 12, 4, 0)


def test_token_and_id_types_are_accepted(make):
    torch = pytest.importorskip("torch")
    cache, view = make(num_pages=64)
    cache_prefix(view, P)
    tokens = P + [7, 8, 9]
    inputs = [
        tokens,
        tuple(tokens),
        [np.int64(t) for t in tokens],
        np.array(tokens, dtype=np.int64),
        np.array(tokens, dtype=np.uint16),
        np.repeat(np.array(tokens, dtype=np.int32), 2)[::2],       # not contiguous
        torch.tensor(tokens, dtype=torch.int64),
        torch.tensor(tokens, dtype=torch.int32),
    ]
    ids = [0, -1, 2**63 - 1, -2**63, np.int64(5), np.uint8(6), np.int32(-7), 8]
    allocs = view.allocate_pages_for_sequences_with_prefix(
        [R(i, t) for i, t in zip(ids, inputs)])
    for alloc, i in zip(allocs, ids):
        assert alloc.seq_id == int(i) and type(alloc.seq_id) is int
        assert alloc.reused_tokens == 12
        assert view.state(i).tokens.tolist() == tokens
    assert sorted(view.live_sequences) == sorted(int(i) for i in ids)
    # The view keeps its own copy of the prompt, whatever memory the caller's came in.
    arr = np.array(tokens, dtype=np.int32)
    wide = np.array([7] + tokens, dtype=np.int32)
    tensor = torch.tensor(tokens, dtype=torch.int32)
    view.allocate_pages_for_sequences_with_prefix(
        [R(100, arr), R(101, wide[1:]), R(102, tensor)])
    arr[:] = 0
    wide[:] = 0
    tensor[:] = 0
    for seq_id in (100, 101, 102):
        assert view.state(seq_id).tokens.tolist() == tokens
    view.release([int(i) for i in ids] + [100, 101, 102])
    assert cache.match_prefix(tokens).num_tokens == 12
    cache.check()


def test_list_input_reads_exactly_like_numpy(make):
    """Lists and tuples of ints are read in the compiled layer (the engines' own format):
    the same ids, reuse and page tables as the same tokens in an int32 array, across the
    digit boundaries of Python's int representation."""
    from array import array
    cache, view = make(num_pages=128)
    edge = [0, 1, 2**15 - 1, 2**15, 2**30 - 1, 2**30, 2**31 - 2, 2**31 - 1]
    prompt = P + edge * 4 + [5]
    cache_prefix(view, prompt[:-1])
    arr = np.array(prompt, dtype=np.int32)
    want = view.allocate_pages_for_sequences_with_prefix([R(1, arr)])[0]
    assert want.reused_tokens == len(prompt) - 1
    inputs = [prompt, tuple(prompt), array("i", prompt), array("q", prompt)]
    for seq_id, tokens in enumerate(inputs, start=2):
        got = view.allocate_pages_for_sequences_with_prefix([R(seq_id, tokens)])[0]
        assert got.reused_tokens == want.reused_tokens
        shared = want.reused_tokens // want.page_size
        assert (got.page_table[:shared] == want.page_table[:shared]).all()
        assert view.state(seq_id).tokens.tolist() == prompt
        assert cache.match_prefix(tokens).num_tokens == cache.match_prefix(arr).num_tokens
    assert _tokens.tokens_from_sequence(prompt, "t").tolist() == prompt
    assert _tokens.tokens_from_sequence([], "t").dtype == np.int32
    # Not all plain ints: the general path decides (numpy integers are accepted there).
    assert _tokens.tokens_from_sequence([1, np.int64(2)], "t") is None
    with pytest.raises(ValueError, match=r"^requests\[0\]\.tokens\[3\] = 2147483648 is outside"):
        view.allocate_pages_for_sequences_with_prefix([R(50, [1, 2, 3, 2**31])])
    # The request is named by its place in the batch, whatever its input type.
    for bad in ([7, -1], (7, -1), np.array([7, -1], dtype=np.int32), array("i", [7, -1])):
        with pytest.raises(ValueError, match=r"^requests\[1\]\.tokens\[1\] = -1 is outside"):
            view.allocate_pages_for_sequences_with_prefix([R(50, [1]), R(51, bad)])
    with pytest.raises(ValueError, match=r"tokens\[0\] = -1 is outside"):
        cache.match_prefix((-1, 2))
    view.release([1, 2, 3, 4, 5])
    cache.check()


def test_batch_borrows_every_prefix_before_evicting_for_any(make):
    """A request's eviction must not take the prefix another request of the same batch
    matched: every prefix is borrowed first, then the batch's fresh pages are freed by
    evicting only what nobody in the batch borrowed."""
    cache, view = make(num_pages=16)
    x = list(range(5000, 5000 + 4 * PS))          # 4 pages, cached first: the LRU victim
    y = list(range(6000, 6000 + 4 * PS))          # 4 pages, cached later
    cache_prefix(view, x, seq_id=900)
    cache_prefix(view, y, seq_id=901)
    assert cache.stats().free_pages == 8
    fresh_only = list(range(7000, 7000 + 10 * PS))    # 10 new pages: 2 must be evicted
    allocs = view.allocate_pages_for_sequences_with_prefix(
        [R(1, fresh_only), R(2, x + [1])])
    assert allocs[0].reused_tokens == 0
    assert allocs[1].reused_tokens == len(x)      # x stayed whole; y paid for the batch
    assert cache.match_prefix(y).num_tokens == 1 * PS
    view.release([1, 2], commit=False)
    cache.check()


def test_out_of_pages_says_where_the_pages_are(make):
    cache, view = make(num_pages=16)
    with pytest.raises(hostkv.OutOfPagesError, match="more than the pool's 16 pages in all"):
        view.allocate_pages_for_sequences_with_prefix([R(1, list(range(17 * PS)))])
    view.allocate_pages_for_sequences_with_prefix([R(2, list(range(10 * PS)))])
    with pytest.raises(hostkv.OutOfPagesError,
                       match=r"needs 7 new pages, the other 10 pages are held by live "
                             r"sequences \(their own pages, and the cached prefixes they "
                             r"borrow\); only 6 are free or evictable"):
        view.allocate_pages_for_sequences_with_prefix([R(3, list(range(9000, 9000 + 7 * PS)))])
    view.release([2])
    cache.check()


def test_requests_and_allocations_are_immutable_values(make):
    """Both are compiled (a Python __init__ per request cost more than the rest of
    the view's Python): they keep what they had as frozen dataclasses - keywords, a default
    namespace, value equality, hashing, repr, pattern matching, pickling, subclassing - and
    refuse every assignment."""
    cache, view = make(num_pages=16)
    request = R(1, P + [1])
    assert request == R(seq_id=1, tokens=P + [1], namespace=0) != R(1, P + [1], 2)
    assert request != (1, P + [1], 0) and R(1, [2]) != object()
    assert hash(R(1, (1, 2))) == hash(R(1, (1, 2))) != hash(R(2, (1, 2)))
    with pytest.raises(TypeError):
        hash(request)                            # its tokens are a list, as a dataclass's
    assert repr(R(1, [2])) == "SequenceRequest(seq_id=1, tokens=[2], namespace=0)"
    assert pickle.loads(pickle.dumps(request)) == request
    match request:
        case R(seq_id, tokens, namespace):
            assert (seq_id, tokens, namespace) == (1, P + [1], 0)
        case _:
            pytest.fail("a SequenceRequest matches its positional fields")
    for field in ("seq_id", "tokens", "namespace", "other"):
        with pytest.raises(AttributeError):
            setattr(request, field, 2)
    (alloc,) = view.allocate_pages_for_sequences_with_prefix([request])
    assert type(alloc) is hostkv.SequenceAllocation
    assert alloc == hostkv.SequenceAllocation(1, 0, alloc.page_table, PS)
    assert alloc != hostkv.SequenceAllocation(1, PS, alloc.page_table, PS)
    assert (alloc.num_shared_pages, alloc.write_from_token) == (0, 0)
    assert repr(alloc).startswith("SequenceAllocation(seq_id=1, reused_tokens=0, ")
    copy = pickle.loads(pickle.dumps(alloc))
    assert copy.page_table.tolist() == alloc.page_table.tolist() and copy.page_size == PS
    for field in ("seq_id", "reused_tokens", "page_table", "page_size", "num_shared_pages"):
        with pytest.raises(AttributeError):
            setattr(alloc, field, 2)
    with pytest.raises(TypeError):
        R(1)                                     # tokens are required, as before
    view.release([1])

    class TaggedRequest(R):
        """An engine's own request type, with a field of its own."""

        def __init__(self, seq_id, tokens, tag):
            super().__init__(seq_id, tokens)
            self.tag = tag

    (alloc,) = view.allocate_pages_for_sequences_with_prefix([TaggedRequest(2, P + [1], "a")])
    assert alloc.seq_id == 2 and view.live_sequences == [2]
    assert repr(TaggedRequest(3, [4], "b")).endswith(
        ".TaggedRequest(seq_id=3, tokens=[4], namespace=0)")   # its __qualname__, as before
    view.release([2])
    weakref.ref(request)                         # as a dataclass instance could be


class TenantRequest(hostkv.SequenceRequest):
    """An engine's request type: its namespace is a property of its own field, and its
    __init__ takes other arguments than SequenceRequest's."""

    def __init__(self, seq_id, tokens, *, tenant):
        super().__init__(seq_id, tokens)
        self.tenant = tenant

    @property
    def namespace(self):
        return {"a": 1, "b": 2}[self.tenant]


def _namespace_in_child(request):
    return type(request).__name__, request.namespace, request.tenant


def test_a_subclass_of_sequence_request_is_read_as_python_reads_it(make):
    """A subclass's fields are what its attributes say (a property over a field included),
    and a copy, a pickle or a spawned process keeps its own state without running its
    __init__: a request never silently falls back to another namespace (found in review of
    the compiled types)."""
    cache, view = make(num_pages=16)
    a, b = TenantRequest(1, P + [1], tenant="a"), TenantRequest(2, P + [1], tenant="b")
    assert repr(b).endswith("TenantRequest(seq_id=2, tokens=%r, namespace=2)" % (P + [1]))
    assert a != b and a == TenantRequest(1, P + [1], tenant="a")
    view.allocate_pages_for_sequences_with_prefix([a])
    view.release([1])
    (alloc,) = view.allocate_pages_for_sequences_with_prefix([b])
    assert alloc.reused_tokens == 0              # tenant b never reuses tenant a's prefix
    assert view.state(2).namespace == 2
    (alloc,) = view.allocate_pages_for_sequences_with_prefix([TenantRequest(3, P + [1],
                                                                            tenant="a")])
    assert alloc.reused_tokens == len(P)
    view.release([2, 3])
    for clone in (pickle.loads(pickle.dumps(b)), copy.copy(b), copy.deepcopy(b)):
        assert type(clone) is TenantRequest and clone == b
        assert (clone.namespace, clone.tenant, clone.seq_id) == (2, "b", 2)
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        assert pool.apply(_namespace_in_child, (b,)) == ("TenantRequest", 2, "b")


def test_a_look_alike_of_sequence_request_is_read_through_its_attributes(make):
    """What isinstance calls a SequenceRequest (a test's Mock with its spec) is read through
    its attributes, never as the compiled struct it is not."""
    cache, view = make(num_pages=16)
    fake = mock.Mock(spec=hostkv.SequenceRequest)
    fake.seq_id, fake.tokens, fake.namespace = 4, P + [1], 0
    (alloc,) = view.allocate_pages_for_sequences_with_prefix([fake])
    assert alloc.seq_id == 4 and alloc.page_table.shape == (4,)
    view.release([4])
    with pytest.raises(SequenceError, match="requests.0. is a Mock, not a SequenceRequest"):
        view.allocate_pages_for_sequences_with_prefix([mock.Mock()])
    blank = hostkv.SequenceRequest.__new__(hostkv.SequenceRequest)
    with pytest.raises(SequenceError, match="sequence ids must be integers, got None"):
        view.allocate_pages_for_sequences_with_prefix([blank])
    assert view.live_sequences == []
    cache.check()


def test_a_commit_continues_below_the_prefix_the_sequence_holds(make):
    """Commit and release insert a sequence's pages from the end of the prefix it holds
    (the prefix is not compared again). That node may have been split by another
    sequence meanwhile (it keeps its identity as the tail) or have gained children: the
    pages still land right after the prefix, and every prompt matches as it should."""
    cache, view = make(num_pages=64)
    cache_prefix(view, P)                                        # one 3-page node
    x = [7000 + i for i in range(2 * PS + 1)]
    (held,) = view.allocate_pages_for_sequences_with_prefix([R(1, P + x)])
    assert held.reused_tokens == 12
    # Another sequence ends inside P's node (a split: its first page becomes the head) and
    # another puts a sibling of x under P.
    y = [8000 + i for i in range(PS + 1)]
    cache_prefix(view, P[:PS] + y, seq_id=2)
    cache_prefix(view, P + [9000 + i for i in range(PS + 1)], seq_id=3)
    assert view.commit([1]) == [5]
    assert view.release([1]) == [5]
    assert cache.match_prefix(P + x).num_tokens == 20
    assert cache.match_prefix(P + x).pages[:3].tolist() == held.page_table[:3].tolist()
    assert cache.match_prefix(P[:PS] + y).num_tokens == 8
    assert cache.match_prefix(P + [9000 + i for i in range(PS)]).num_tokens == 16
    # Namespaces stay apart: the same tokens in another namespace match nothing.
    assert cache.match_prefix(P + x, namespace=5).num_tokens == 0
    cache.check(exact_references=True)


def test_a_release_hands_its_references_to_the_tree_and_refuses_pages_it_never_held(make):
    """A release that commits lets the tree take over the sequence's own references
    instead of adding one and dropping one: the refcounts come out exact. Handed
    pages the sequence's list does not hold (another sequence's), the compiled release
    refuses the whole mutation and changes nothing."""
    cache, view = make(num_pages=64)
    view.allocate_pages_for_sequences_with_prefix([R(1, Q + [1]), R(2, Z + [2])])
    assert view.release([1]) == [2]
    cache.check(exact_references=True)
    seq = view._sequences[2]
    other = view.allocate_pages_for_sequences_with_prefix([R(3, Z + [3])])[0].page_table
    wrong = seq.pages.copy()
    wrong[:3] = other[:3]                      # held pages, not in the tree, not sequence 2's
    before = snapshot(cache, view, quiet=True)
    with pytest.raises(hostkv.CorruptionError, match="adopted"):
        _sequences.release(cache._segment, [seq.record], [2], [seq.generation], [seq.tokens],
                           [wrong], [3], [0])
    assert_unchanged(before, snapshot(cache, view), rolled_back=True)
    assert view.release([2, 3]) == [3, 3]
    cache.check(exact_references=True)


def test_page_lists_fill_twelve_pages_a_record_across_decode_steps(make):
    """A sequence's page list holds twelve pages a record: a prompt fills whole records
    and part of one, decode steps fill its room before taking a record, and the segment's
    list always equals the view's page table; a release gives every record back."""
    cache, view = make(num_pages=128)
    seg = cache._segment
    (alloc,) = view.allocate_pages_for_sequences_with_prefix(
        [R(1, list(range(4000, 4000 + 25 * PS)))])               # 25 pages: 12 + 12 + 1

    def listed():
        (record, _, _, pages), = _sequences.view_sequences(seg, view._number)
        return pages

    assert listed() == alloc.page_table.tolist()
    for step in range(12 * PS):                                  # 12 more pages, one by one
        view.append_tokens([1], [step])
        assert listed() == view.page_table(1).tolist()
    assert len(listed()) == 37
    cache.check(exact_references=True)
    view.release([1])
    assert _sequences.view_sequences(seg, view._number) == []
    cache.check(exact_references=True)          # every page-list record is free again


def test_a_commit_never_locks_past_what_it_matched(make):
    """Found in review: a commit whose pages were all cached, ending inside a
    node it could not split (no node record free), locked that whole node; the next commit
    then continued below its end without comparing, and hung this sequence's KV under
    another prompt's pages. The lock must stay where the sequence's tokens were matched."""
    cache, view = make(num_pages=64, radix_node_capacity=2)
    page = lambda x: [x] * PS
    a = page(1) + page(2) + page(3) + page(4)                      # X: a0 a1 a2 a3
    s = page(1) + page(2) + page(7) + page(8) + page(9) + page(10)  # S: a0 a1 b2 b3 b4 b5
    view.allocate_pages_for_sequences_with_prefix([R(1, s + [0])])  # nothing cached yet
    cache_prefix(view, a + [0], seq_id=2)
    view.allocate_pages_for_sequences_with_prefix([R(3, page(20) + page(21) + [0])])
    view.commit([3])                                     # the second (last) node record
    view.commit([1], num_tokens=2 * PS)                  # all cached, inside X, no split
    view.release([3], commit=False)
    view.commit([1])
    cache.check(exact_references=True)
    # Pages 4 and 5 of S hold KV computed after b2 b3: never an answer for a2 a3.
    assert cache.match_prefix(a + page(9) + page(10)).num_tokens == 4 * PS
    assert cache.match_prefix(a).num_tokens == 4 * PS
    view.release([1])
    cache.check(exact_references=True)


def test_big_endian_int32_prompts_are_read_as_their_ids(make):
    """Found in review: a '>i4' array is NPY_INT32 too, and the compiled fast
    path copied its bytes raw, caching ids 1 << 24, 2 << 24, ... for 1, 2, ... It is
    converted like any other dtype; the raw compiled calls refuse it."""
    cache, view = make(num_pages=32)
    ids = list(range(1, 10))
    big = np.array(ids, dtype=">i4")
    (alloc,) = view.allocate_pages_for_sequences_with_prefix([R(1, big)])
    assert view.state(1).tokens.tolist() == ids
    view.release([1])
    assert cache.match_prefix(ids).num_tokens == 8
    assert cache.match_prefix(big).num_tokens == 8
    assert cache.match_prefix([i << 24 for i in ids]).num_tokens == 0
    (again,) = view.allocate_pages_for_sequences_with_prefix([R(2, big)])
    assert again.reused_tokens == 8
    view.release([2])
    with pytest.raises(ValueError, match="contiguous 1-D np.int32"):
        _tokens.checked_copy(big)
    with pytest.raises(ValueError, match="native-order"):
        _sequences.hold(cache._segment, [big], np.array([3], dtype=np.int64), [0], view._number)
    cache.check(exact_references=True)


def test_a_closed_cache_still_names_the_bad_request_first(segment_name):
    """The view's documented errors come before "closed", as they did when the view checked
    requests in Python (a regression found in review)."""
    cache = hostkv.HostKVCache.create(segment_name, hostkv.HostKVConfig(
        num_pages=32, page_size=PS, page_bytes=64))
    view = WorkerView(cache)
    cache.close()
    with pytest.raises(SequenceError, match="empty prompt"):
        view.allocate_pages_for_sequences_with_prefix([R(1, [])])
    with pytest.raises(ValueError, match=r"tokens\[0\] = -1 is outside"):
        view.allocate_pages_for_sequences_with_prefix([R(1, [-1])])
    with pytest.raises(SequenceError, match="not a SequenceRequest"):
        view.allocate_pages_for_sequences_with_prefix(["x"])
    with pytest.raises(ValueError, match="closed"):
        view.allocate_pages_for_sequences_with_prefix([R(1, [1, 2])])


# -- the view's compiled bookkeeping (ViewSequence, the compiled decode step) -------------------


def _hold_pages_and_die(name: str) -> None:
    view = WorkerView(HostKVCache.attach(name))
    view.allocate_pages_for_sequences_with_prefix([R(1, list(range(1000, 1060)))])  # 15 pages
    os._exit(0)                                            # dies holding them


def test_a_generator_of_tokens_survives_the_retry_after_a_reap(segment_name, procs):
    """A step short of pages while a dead process holds some reaps and tries again: the
    token ids must still be there, whatever iterable they came in."""
    cache = HostKVCache.create(segment_name, config(num_pages=16))
    try:
        view = WorkerView(cache)
        view.allocate_pages_for_sequences_with_prefix([R(7, [1, 2, 3, 4])])   # the 16th page
        child = procs(_hold_pages_and_die, segment_name)
        child.join(60)
        assert child.exitcode == 0
        view.append_tokens([7], (token for token in [42]))   # needs a page: reap, retry
        assert view.state(7).tokens.tolist() == [1, 2, 3, 4, 42]
        assert len(view.page_table(7)) == 2
        view.close()
        cache.check()
    finally:
        cache.close()


def test_the_commit_rule_is_one_for_the_view_and_its_release(make):
    # What WorkerView's commit plans (in Python) and what release_sequences commits (in C)
    # come from one definition: at least min_store_pages full pages, more than committed.
    cache, view = make()
    state = _viewstate.ViewState(cache._segment, {}, PS, 64, True, 1, 3, 1)
    assert [state.pages_to_commit(full, 0) for full in range(5)] == [0, 0, 0, 3, 4]
    assert [state.pages_to_commit(full, 3) for full in range(6)] == [0, 0, 0, 0, 4, 5]
    assert state.pages_to_commit(7, 9) == 0


def test_a_view_sequence_is_whole_or_refused(make):
    cache, view = make()
    view.allocate_pages_for_sequences_with_prefix([R(1, [1, 2, 3, 4, 5])])
    seq = view._sequences[1]
    # Made without __init__: refused, never a crash.
    empty = _viewstate.ViewSequence.__new__(_viewstate.ViewSequence)
    with pytest.raises(ValueError, match="never filled"):
        _sequences.append_tokens(cache._segment, [empty], [1], PS)
    with pytest.raises(ValueError, match="never filled"):
        _sequences.commit_view_sequences(view._state, [empty], [1])
    with pytest.raises(TypeError):
        type("Sub", (_viewstate.ViewSequence,), {})       # nothing can skip filling it
    # A view's state made without __init__, or without a segment: refused, never a crash.
    blank = _viewstate.ViewState.__new__(_viewstate.ViewState)
    with pytest.raises(ValueError, match="never filled"):
        _sequences.release_sequences(blank, [], True)
    with pytest.raises(ValueError, match="never filled"):
        _sequences.allocate_requests(blank, [R(9, [1, 2])], [])
    with pytest.raises(ValueError, match="never filled"):
        _sequences.commit_view_sequences(blank, [], [])
    with pytest.raises(TypeError):
        _viewstate.ViewState(None, {}, PS, 64, True, 1, 1, 1)
    # Arrays the C code could not read raw are refused.
    for bad in (np.arange(4, dtype=">i4"), np.arange(4, dtype=np.int64),
                np.arange(8, dtype=np.int32)[::2]):
        with pytest.raises(ValueError, match="native-order"):
            _viewstate.ViewSequence(1, seq.record, seq.generation, 0, bad, 0, 0, seq.pages)
    # A sequence listed twice in one step is refused before anything changes.
    before = (seq.num_tokens, seq.num_pages, cache.stats().free_pages)
    with pytest.raises(SequenceError, match="listed twice"):
        _sequences.append_tokens(cache._segment, [seq, seq], [6, 7], PS)
    assert (seq.num_tokens, seq.num_pages, cache.stats().free_pages) == before
    # The raw commit and release name a bad record or namespace clearly.
    tokens, pages = seq.tokens[:seq.num_tokens], seq.pages[:seq.num_pages]
    for record in (2**31, -2**40):
        with pytest.raises(SequenceError, match="outside"):
            _sequences.release(cache._segment, [record], [1], [seq.generation], [tokens],
                               [pages], [0], [0])
    for namespace in (-1, 2**64):
        with pytest.raises(ValueError, match="namespaces"):
            _sequences.release(cache._segment, [seq.record], [1], [seq.generation], [tokens],
                               [pages], [0], [namespace])
    # Arrays of more or fewer than one dimension are not sequences of ids or tokens.
    with pytest.raises(SequenceError, match="sequence of ids"):
        view.append_tokens(np.array(1), [5])
    with pytest.raises(ValueError, match="sequence of token ids"):
        view.append_tokens([1], np.array(5))
    assert view.state(1).num_tokens == 5
    view.release([1])
    cache.check()
