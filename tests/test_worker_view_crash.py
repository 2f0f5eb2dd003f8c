"""Crash at every step of the worker view's batch operations: allocate, append, commit,
release, and the reaping of a dead process's sequences.

Every state compared includes the tree, the live sequences, the LRU clock and every node's
last-access stamp; a crashed process's state is compared before it is reaped too (see
crashlib.crash_every_step's `unreaped`). The cases include allocation under eviction
pressure, below prefix_min_reuse_pages (a savepoint rollback), a borrow that evicts for its
split, a commit whose insert finds no node record, lease registration when every slot is
taken and after fork, and a death holding the lock after a commit."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest

import hostkv
from hostkv import _introspect, _sequences

from lib import crashlib
from conftest import small_config
from lib.crashlib import crash_every_step

PAGE = 4
SYSTEM = list(range(100, 112))          # three full pages shared by every request


@pytest.fixture(autouse=True)
def sequence_snapshots(monkeypatch):
    """Snapshots with the tree and the live sequences; exact reference accounting; no
    cumulative counters (every round's setup allocates afresh)."""
    monkeypatch.setitem(crashlib.OPTIONS, "exact_references", True)
    monkeypatch.setitem(crashlib.OPTIONS, "counters", False)
    monkeypatch.setitem(crashlib.EXTRA_STATE, "tree", lambda seg: frozenset(_introspect.tree_contents(seg)))
    monkeypatch.setitem(crashlib.EXTRA_STATE, "sequences",
                        lambda seg: frozenset((s[2], s[3], s[4]) for s in _sequences.live_sequences(seg)))
    monkeypatch.setitem(crashlib.EXTRA_STATE, "lru", crashlib.lru_state)


@pytest.fixture(params=[0, 6], ids=["no-parts", "parts"])
def view_cache(segment_name, request):
    # With 6 window parts for 24 pages, batches run short of parts, and commits donate parts
    # to cached pages that have none.
    parts = dict(num_parts=request.param, part_bytes=16 if request.param else 0)
    cache = hostkv.HostKVCache.create(
        segment_name, small_config(num_pages=24, page_size=PAGE, radix_node_capacity=8, **parts))
    # Cache the system prompt once, from a sequence of this process.
    with hostkv.WorkerView(cache) as view:
        view.allocate_pages_for_sequences_with_prefix([hostkv.SequenceRequest(0, SYSTEM + [1])])
        view.release([0])
    yield cache
    cache.close()


def requests():
    return [hostkv.SequenceRequest(1, SYSTEM[:8] + [7, 7, 7]),      # borrows 2 pages: a split
            hostkv.SequenceRequest(2, SYSTEM + [5, 6, 7, 8, 9]),
            hostkv.SequenceRequest(3, [1, 2, 3])]


def allocate_op(cache, ctx, make_requests=requests):
    hostkv.WorkerView(cache).allocate_pages_for_sequences_with_prefix(make_requests())


def allocated_view(cache, make_requests=requests):
    view = hostkv.WorkerView(cache)
    view.allocate_pages_for_sequences_with_prefix(make_requests())
    return view


def decoded_view(cache):
    view = allocated_view(cache)
    view.append_tokens([1, 2, 3], [11, 12, None])
    return view


def append_op(cache, view):
    # decoded_view left 12, 18 and 4 tokens: sequences 1 and 3 need a page for this one.
    view.append_tokens([1, 2, 3], [21, 22, 23])


def commit_op(cache, view):
    view.commit([1, 2, 3])


def release_op(cache, view):
    view.release([1, 2, 3], commit=True)


def test_batch_allocate_crash_at_every_step(view_cache):
    steps = crash_every_step(view_cache, allocate_op, unreaped=True)
    assert steps > 50


def test_append_crash_at_every_step(view_cache):
    steps = crash_every_step(view_cache, append_op, setup=decoded_view, unreaped=True)
    assert steps > 5           # 10 logged stores since page lists hold twelve pages a record


def test_commit_crash_at_every_step(view_cache):
    steps = crash_every_step(view_cache, commit_op, setup=decoded_view, unreaped=True)
    assert steps > 30


def test_release_crash_at_every_step(view_cache):
    steps = crash_every_step(view_cache, release_op, setup=decoded_view, unreaped=True)
    assert steps > 50


def dead_holder(cache) -> None:
    """A process that allocates and decodes sequences, then dies holding them."""
    assert crashlib.run_in_child(cache.name, None, None, 0, setup=decoded_view) == 0


def crash_sweep_every_step(cache, action, min_steps: int) -> int:
    """A dead process holds sequences; a child runs action (which sweeps it), crashed at
    every step. Each time, before anyone else reaps: the dead process's sequences are a
    subset of what it held, each exactly as it held it (the sweep releases them one whole
    sequence per mutation); then, after the parent's reap, the whole state equals the state
    after an uncrashed sweep."""
    dead_holder(cache)
    held = crashlib.unreaped_snapshot(cache.name)[5]
    assert len(held) == 3
    after = crashlib.snapshot(cache)                 # reaped by the parent: the reference
    for step in range(1, 500):
        dead_holder(cache)
        status = crashlib.run_observer_in_child(cache.name, action, step)
        left = crashlib.unreaped_snapshot(cache.name)[5]
        assert left <= held, f"step {step}: {left - held}"
        state = crashlib.snapshot(cache)
        assert state == after, f"crashed at step {step}: {after.differences(state)}"
        assert cache.stats().active_sequences == 0
        if status == 0:
            break
        assert status == crashlib.CRASH_STATUS
    else:
        raise AssertionError("the sweep never completed")
    assert step > min_steps
    return step


def test_reap_of_dead_sequences_crash_at_every_step(view_cache):
    """The sweep that releases a dead process's sequences, crashed at every step."""
    crash_sweep_every_step(view_cache, lambda seg: seg.reap(), 30)


@pytest.fixture
def two_slot_cache(segment_name):
    cache = hostkv.HostKVCache.create(
        segment_name, small_config(num_pages=24, page_size=PAGE, radix_node_capacity=8,
                                   max_processes=2))
    with hostkv.WorkerView(cache) as view:
        view.allocate_pages_for_sequences_with_prefix([hostkv.SequenceRequest(0, SYSTEM + [1])])
        view.release([0])
    yield cache
    cache.close()


def test_registration_when_every_slot_is_taken_crash_at_every_step(two_slot_cache):
    """Two lease slots: this process's and a dead process's, which holds sequences. A new
    process's registration finds no free slot, sweeps (releasing the dead one's sequences
    one per mutation) and takes the slot: crashed at every step of it."""
    crash_sweep_every_step(two_slot_cache, lambda seg: seg._register_lease(), 30)


def test_registration_after_fork_crash_at_every_step(view_cache):
    """A process holding sequences forks; the child's first call registers a lease of its
    own (the parent's lease thread is not in the child), crashed at every step. The
    parent's sequences are untouched by it, dead or alive."""
    def fork_then_register(cache, ctx):
        view = decoded_view(cache)                  # noqa: F841 - its sequences stay held
        cache._segment._arm_crash_point(ctx)
        pid = os.fork()
        if pid == 0:
            status = 2
            try:
                cache.stats()                       # the first lock in the child registers
                status = 0
            finally:
                os._exit(status)
        cache._segment._arm_crash_point(0)
        _, status = os.waitpid(pid, 0)
        os._exit(os.waitstatus_to_exitcode(status))

    assert crashlib.run_in_child(view_cache.name, None, None, 0, setup=decoded_view) == 0
    held = crashlib.unreaped_snapshot(view_cache.name)[5]
    after = crashlib.snapshot(view_cache)
    for step in range(1, 500):
        # Armed by the op itself (ctx = step), after its setup: crash_at 0 leaves it alone.
        status = crashlib.run_in_child(view_cache.name, fork_then_register, step, 0)
        unreaped = crashlib.unreaped_snapshot(view_cache.name)[5]
        assert unreaped == held, f"step {step}: the parent's sequences changed"
        state = crashlib.snapshot(view_cache)
        assert state == after, f"crashed at step {step}: {after.differences(state)}"
        if status == 0:
            break
        assert status == crashlib.CRASH_STATUS, status
    else:
        raise AssertionError("registration after fork never completed")
    assert step > 5


def full_pool_view(cache):
    """Fills the pool with cached, evictable prefixes (LRU: the first is the oldest)."""
    view = hostkv.WorkerView(cache)
    for i in range(4):
        prompt = [5000 + 100 * i + t for t in range(4 * PAGE + 1)]
        view.allocate_pages_for_sequences_with_prefix([hostkv.SequenceRequest(10 + i, prompt)])
        view.release([10 + i])
    return view


def test_allocate_under_eviction_pressure_crash_at_every_step(view_cache):
    full_pool_view(view_cache)
    free = view_cache.stats().free_pages
    assert free < 12

    def pressed_allocate(cache, ctx):
        hostkv.WorkerView(cache).allocate_pages_for_sequences_with_prefix(
            [hostkv.SequenceRequest(1, SYSTEM[:8] + [7] * 9),
             hostkv.SequenceRequest(2, list(range(7000, 7000 + 4 * PAGE)))])

    def tree_pages(snap):
        return {p for _ns, _tokens, pages, _locks in dict(snap.extra)["tree"] for p in pages}

    def evicted(before, after):
        # The child that completed is dead and reaped by now: its own pages are free again,
        # the cached pages it evicted are gone from the tree.
        if not tree_pages(after) < tree_pages(before):
            return "nothing was evicted"
        return None

    steps = crash_every_step(view_cache, pressed_allocate, expect_after=evicted, unreaped=True)
    assert steps > 50


def test_allocate_below_min_reuse_pages_crash_at_every_step(segment_name):
    """A match shorter than prefix_min_reuse_pages is borrowed, then undone to a savepoint
    (its split, lock and touch), and the request allocated fresh."""
    cache = hostkv.HostKVCache.create(
        segment_name, small_config(num_pages=24, page_size=PAGE, radix_node_capacity=8,
                                   prefix_min_reuse_pages=3))
    try:
        with hostkv.WorkerView(cache) as view:
            view.allocate_pages_for_sequences_with_prefix([hostkv.SequenceRequest(0, SYSTEM + [1])])
            view.release([0])

        def short_match(cache, ctx):
            allocs = hostkv.WorkerView(cache).allocate_pages_for_sequences_with_prefix(
                [hostkv.SequenceRequest(1, SYSTEM[:8] + [7, 7, 7])])
            assert allocs[0].reused_tokens == 0

        steps = crash_every_step(cache, short_match, unreaped=True)
        assert steps > 20
    finally:
        cache.close()


def test_borrow_that_evicts_for_its_split_crash_at_every_step(segment_name):
    """Every node record in use, one of them evictable: a borrow ending inside a node must
    evict that one to get a record for the split."""
    cache = hostkv.HostKVCache.create(
        segment_name, small_config(num_pages=24, page_size=PAGE, radix_node_capacity=2))
    try:
        with hostkv.WorkerView(cache) as view:
            for seq_id, prompt in ((0, SYSTEM + [1]), (1, list(range(7000, 7009)))):
                view.allocate_pages_for_sequences_with_prefix([hostkv.SequenceRequest(seq_id, prompt)])
                view.release([seq_id])
        assert cache.stats().tree_nodes == 2

        def split_borrow(cache, ctx):
            allocs = hostkv.WorkerView(cache).allocate_pages_for_sequences_with_prefix(
                [hostkv.SequenceRequest(1, SYSTEM[:8] + [7, 7, 7])])
            assert allocs[0].reused_tokens == 8

        def split_and_evicted(before, after):
            tree = dict(after.extra)["tree"]
            if any(tokens[:1] == (7000,) for _ns, tokens, _pages, _locks in tree):
                return "the other node was not evicted for the split"
            return None

        steps = crash_every_step(cache, split_borrow, expect_after=split_and_evicted,
                                 unreaped=True)
        assert steps > 20
    finally:
        cache.close()


def test_commit_without_a_node_record_crash_at_every_step(segment_name):
    """Both node records end up on locked paths within one commit batch: sequence 5's pages
    are found cached (its lock moves onto their node, logged stores), then sequence 3's
    insert finds no record even after trying to evict, is undone to its savepoint, and
    caches nothing (best effort) while sequence 5's part stands."""
    cache = hostkv.HostKVCache.create(
        segment_name, small_config(num_pages=24, page_size=PAGE, radix_node_capacity=2,
                                   prefix_min_reuse_pages=3))
    twin = list(range(7000, 7009))          # cached as 2 pages: too short to be borrowed
    try:
        with hostkv.WorkerView(cache) as view:
            for seq_id, prompt in ((0, SYSTEM + [1]), (1, twin)):
                view.allocate_pages_for_sequences_with_prefix([hostkv.SequenceRequest(seq_id, prompt)])
                view.release([seq_id])
        assert cache.stats().tree_nodes == 2

        def one_locked_node(cache):
            view = hostkv.WorkerView(cache)
            allocs = view.allocate_pages_for_sequences_with_prefix(
                [hostkv.SequenceRequest(1, SYSTEM + [1]), hostkv.SequenceRequest(5, twin),
                 hostkv.SequenceRequest(3, list(range(8000, 8009)))])
            assert [a.reused_tokens for a in allocs] == [12, 0, 0]
            return view

        def commit_without_record(cache, view):
            assert view.commit([5, 3]) == [2, 0]

        steps = crash_every_step(cache, commit_without_record, setup=one_locked_node,
                                 unreaped=True)
        assert steps > 5
    finally:
        cache.close()


def test_release_donating_parts_crash_at_every_step(segment_name):
    """A prompt cached while window parts ran out (its pages have none), then computed again
    by a sequence whose pages have parts (too short a match to borrow): its release with
    commit finds the pages cached and hands its parts to them, freeing its own pages.
    Crashed at every step, the state is as setup left it; completed, the cached pages have
    parts."""
    cache = hostkv.HostKVCache.create(
        segment_name, small_config(num_pages=24, page_size=PAGE, radix_node_capacity=8,
                                   num_parts=5, part_bytes=16, prefix_min_reuse_pages=4))
    prompt = list(range(500, 513))          # three full pages and one token
    try:
        with hostkv.WorkerView(cache) as view:
            hog = view.allocate_pages_for_sequences_with_prefix(
                [hostkv.SequenceRequest(9, list(range(900, 920)))])[0]
            first = view.allocate_pages_for_sequences_with_prefix(
                [hostkv.SequenceRequest(1, prompt)])[0]
            assert (cache.page_parts(hog.page_table) != -1).all()
            assert (cache.page_parts(first.page_table) == -1).all()
            view.release([9], commit=False)
            view.release([1], commit=True)  # cached, without parts
        cached = cache.match_prefix(prompt).pages
        assert len(cached) == 3 and (cache.page_parts(cached) == -1).all()

        def computed_again(cache):
            view = hostkv.WorkerView(cache)
            second = view.allocate_pages_for_sequences_with_prefix(
                [hostkv.SequenceRequest(2, prompt)])[0]
            assert second.reused_tokens == 0
            assert (cache.page_parts(second.page_table) != -1).all()
            return view

        steps = crash_every_step(cache, lambda cache, view: view.release([2], commit=True),
                                 setup=computed_again, unreaped=True)
        assert steps > 5
        cache.check()
        assert (cache.page_parts(cached) != -1).all()
        assert cache.stats().free_parts == 2        # the donor's partial page freed its own
    finally:
        cache.close()


LOCKED_DEATHS = {
    "allocate": (None, lambda cache, view: allocated_view(cache)),
    "append": (decoded_view, append_op),
    "commit": (decoded_view, commit_op),
    "release": (decoded_view, release_op),
}


@pytest.mark.parametrize("name", sorted(LOCKED_DEATHS))
def test_death_holding_the_lock_after_a_commit(view_cache, name, tmp_path):
    """A process dies holding the lock right after its operation committed (log empty):
    the next locker finds EOWNERDEAD, rolls back nothing, re-derives, and the state is
    exactly what the process saw, under the lock, just before it died."""
    setup, op = LOCKED_DEATHS[name]
    seen = tmp_path / "state.pickle"

    def then_die_locked(cache, view):
        op(cache, view)

        def record_and_die():
            seen.write_bytes(pickle.dumps(crashlib.capture_unreaped(cache)))
            os._exit(crashlib.CRASH_STATUS)

        cache._segment.run_locked(record_and_die)

    recoveries = view_cache.stats().recoveries
    status = crashlib.run_in_child(view_cache.name, then_die_locked, None, 0, setup=setup)
    assert status == crashlib.CRASH_STATUS
    at_death = pickle.loads(seen.read_bytes())
    assert bool(at_death[5]) == (name != "release"), at_death[5]
    assert crashlib.unreaped_snapshot(view_cache.name) == at_death
    assert view_cache.stats().recoveries == recoveries      # an empty log: nothing rolled back
    view_cache.reap()
    view_cache.check()
    assert view_cache.stats().active_sequences == 0


@pytest.mark.parametrize("mode", ["keyboard_interrupt", "memory_error"])
def test_exceptions_mid_batch_roll_back(view_cache, mode):
    before = crashlib.snapshot(view_cache)
    for step in range(1, 1000):
        view_cache._segment._arm_crash_point(step, mode)
        view = hostkv.WorkerView(view_cache)
        try:
            view.allocate_pages_for_sequences_with_prefix(requests())
        except (KeyboardInterrupt, MemoryError):
            view_cache._segment._arm_crash_point(0)
            assert crashlib.snapshot(view_cache) == before
            continue
        view_cache._segment._arm_crash_point(0)
        view.release([1, 2, 3], commit=False)
        break
    assert step > 50


# -- page lists longer than one record (twelve pages a record, layout 7) ---------------------

@pytest.fixture
def long_cache(segment_name):
    cache = hostkv.HostKVCache.create(
        segment_name, small_config(num_pages=96, page_size=PAGE, radix_node_capacity=8))
    yield cache
    cache.close()


def long_requests():
    return [hostkv.SequenceRequest(1, list(range(1000, 1000 + 12 * PAGE))),  # one full record
            hostkv.SequenceRequest(2, list(range(2000, 2000 + 30 * PAGE + 1)))]  # 31: three


def long_allocated_view(cache):
    return allocated_view(cache, long_requests)


def test_allocate_filling_several_page_list_records_crash_at_every_step(long_cache):
    steps = crash_every_step(long_cache, lambda cache, ctx: allocate_op(cache, ctx, long_requests),
                             unreaped=True)
    assert steps > 50


def test_append_starting_a_page_list_record_crash_at_every_step(long_cache):
    # Sequence 1 needs its 13th page, in a new record; sequence 2's token fits its last page.
    steps = crash_every_step(long_cache, lambda cache, view: view.append_tokens([1, 2], [5, 6]),
                             setup=long_allocated_view, unreaped=True)
    assert steps > 5


def test_release_freeing_several_page_list_records_crash_at_every_step(long_cache):
    steps = crash_every_step(long_cache, lambda cache, view: view.release([1, 2], commit=True),
                             setup=long_allocated_view, unreaped=True)
    assert steps > 50
