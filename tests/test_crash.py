"""Crash at every step of every mutation of the segment layer, and exceptions in between."""

from __future__ import annotations

import os

import pytest

import hostkv
from hostkv import _pages

from conftest import small_config
from lib.rawseg import LAYOUT, RawSegment
from lib.crashlib import (CRASH_STATUS, crash_every_step, raise_every_step, run_in_child,
                      run_observer_in_child, snapshot)


# -- the operations: op(cache, ctx) performs one mutation ------------------------------------

def alloc_three(cache, ctx):
    _pages.alloc_pages(cache._segment, 3)


def free_given(cache, ctx):
    _pages.free_pages(cache._segment, ctx)


def attach_only(cache, ctx):
    """The child's attach is the operation (armed through the environment)."""


def close_lease(cache, ctx):
    cache.close()


def reap_dead(cache, ctx):
    cache.reap()


def _dead_child(name):
    """A process that attaches and dies without closing: a dead lease to reap."""
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            cache = hostkv.HostKVCache.attach(name)  # noqa: F841 - kept alive until _exit
            status = 0
        finally:
            os._exit(status)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def _prepare_pages(cache):
    """Some pages allocated, one of them twice referenced, so free has both cases."""
    held = _pages.alloc_pages(cache._segment, 4)
    return held


@pytest.fixture(params=[0, 5], ids=["no-parts", "parts"])
def crash_cache(segment_name, request):
    # With 5 window parts for 16 pages, allocations run short of parts and frees return them.
    parts = dict(num_parts=request.param, part_bytes=16 if request.param else 0)
    cache = hostkv.HostKVCache.create(segment_name,
                                      small_config(num_pages=16, max_processes=4, **parts))
    yield cache
    cache.close()


def expect_allocated(n):
    def check(before, after):
        if after.free_pages != before.free_pages - n:
            return f"free pages {before.free_pages} -> {after.free_pages}, expected -{n}"
        return None
    return check


def test_page_allocate_crash_at_every_step(crash_cache):
    _prepare_pages(crash_cache)
    steps = crash_every_step(crash_cache, alloc_three, expect_after=expect_allocated(3))
    assert steps >= 5  # 3 refcounts, free count, counter, generation


def test_page_free_crash_at_every_step(crash_cache):
    held = _prepare_pages(crash_cache)
    steps = crash_every_step(crash_cache, free_given, ctx=held[:3], expect_after=expect_allocated(-3))
    assert steps >= 9


def test_lease_register_crash_at_every_step(crash_cache):
    # The child's attach (registration, then a sweep) is armed from its environment.
    steps = crash_every_step(crash_cache, attach_only, env_crash=True)
    assert steps >= 5


def test_lease_release_crash_at_every_step(crash_cache):
    steps = crash_every_step(crash_cache, close_lease)
    assert steps >= 2


def test_reap_crash_at_every_step(crash_cache):
    """A dead lease, reaped by a sweep crashed at every step: after the parent's own reap
    the whole state (refcounts, free pages, leases, counters) is as before the dead child.
    Every round needs a dead lease to reap, so this loop is written out; the sweeping child
    is an observer armed through _arm_crash_point (its attach sweeps nothing)."""
    before = snapshot(crash_cache)
    for step in range(1, 50):
        _dead_child(crash_cache.name)
        seg = crash_cache._segment
        assert len(seg.leases()) == 2
        status = run_observer_in_child(crash_cache.name, lambda s: s.reap(), step)
        state = snapshot(crash_cache)
        assert state == before, f"reap crashed at step {step}: {before.differences(state)}"
        assert len(seg.leases()) == 1
        if status == 0:
            break
        assert status == CRASH_STATUS
    else:
        raise AssertionError("the sweep never completed")
    assert step > 3


def test_crash_during_recovery_is_recovered(crash_cache):
    """A process killed while replaying the undo log leaves it to the next locker."""
    held = _prepare_pages(crash_cache)
    before = snapshot(crash_cache)
    # Leave a mutation half done: 6 logged stores of the free of three pages.
    assert run_in_child(crash_cache.name, free_given, held[:3], 6) == CRASH_STATUS
    # Now crash the recovering process at each step of its replay until one finishes.
    for step in range(1, 40):
        status = run_in_child(crash_cache.name, attach_only, None, step, env_crash=True)
        if status == 0:
            break
        assert status == CRASH_STATUS
    else:
        raise AssertionError("recovery never completed")
    assert step > 2, "the replay should have had several steps to crash at"
    assert snapshot(crash_cache) == before


@pytest.mark.parametrize("mode", ["keyboard_interrupt", "memory_error"])
def test_exception_mid_mutation_rolls_back(crash_cache, mode):
    held = _prepare_pages(crash_cache)
    assert raise_every_step(crash_cache, alloc_three, None, mode) >= 5
    assert raise_every_step(crash_cache, free_given, held[:3], mode) >= 9
    stats = crash_cache.stats()
    assert stats.rollbacks > 0 and stats.recoveries == 0
    crash_cache.check(exact_references=False)


def test_undo_log_full_is_capacity_error_and_rolls_back(segment_name):
    cfg = small_config(num_pages=512, undo_log_capacity=256)
    with hostkv.HostKVCache.create(segment_name, cfg) as cache:
        before = snapshot(cache)
        with pytest.raises(hostkv.CapacityError, match="undo log") as info:
            _pages.alloc_pages(cache._segment, 300)
        assert info.value.resource == "undo log"
        assert snapshot(cache) == before


def alloc_many(cache, ctx):
    _pages.alloc_pages(cache._segment, 120)


def test_undo_log_that_wraps_around_its_ring_is_replayed_at_every_step(segment_name):
    """Each lease starts its undo log at its own home in the ring of entries (so two
    processes taking turns at the lock write their own cache lines). With 256 entries
    and 2 lease slots the child's slot 1 starts at entry 168, so allocating 120 pages
    (about 125 logged stores) wraps past the region's end: a death at any step must still
    be replayed to the state before."""
    cfg = small_config(num_pages=512, undo_log_capacity=256, max_processes=2)
    with hostkv.HostKVCache.create(segment_name, cfg) as cache:
        before = snapshot(cache)
        assert run_in_child(cache.name, alloc_many, None, 110) == CRASH_STATUS
        with RawSegment(cache.name) as raw:       # read before anyone recovers it
            start = int.from_bytes(raw.read(LAYOUT["header"]["hdr_undo_start"],
                                            LAYOUT["header"]["hdr_undo_start"] + 4), "little")
            count = int.from_bytes(raw.read(LAYOUT["header"]["hdr_undo_count"],
                                            LAYOUT["header"]["hdr_undo_count"] + 8), "little")
        assert (start, count) == (168, 110)      # the child's home; 110 entries: wrapped
        assert snapshot(cache) == before
        steps = crash_every_step(cache, alloc_many, expect_after=expect_allocated(120))
        assert steps > 256 - 168
        # The parent's own mutations start at its home, slot 0's: entry 84.
        _pages.alloc_pages(cache._segment, 1)
        with RawSegment(cache.name) as raw:
            start = int.from_bytes(raw.read(LAYOUT["header"]["hdr_undo_start"],
                                            LAYOUT["header"]["hdr_undo_start"] + 4), "little")
        assert start == 84
        cache.check(exact_references=False)       # the test holds raw page references
