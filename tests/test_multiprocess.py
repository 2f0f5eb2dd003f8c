"""Real processes sharing one segment: the pool, dead leases, killed and stopped lock holders, fork.

Children are started with the spawn context (a fresh interpreter, as engine workers are), joined
with a timeout, and their exit codes asserted. The worker functions live at module level so
that spawn can import them. No test asserts a duration: a lock timeout is only required to end.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import struct
import time

import numpy as np
import pytest

from hostkv import HostKVCache, LockTimeoutError
from hostkv import _pages, _segment

from conftest import small_config, fork_quietly
from lib.rawseg import RawSegment

CHILD_TIMEOUT = 60
CRASH_STATUS = 77          # _segment's CRASH_EXIT_STATUS: a crash point's _exit code
HEADER = _segment.layout_info()["header"]

ctx = multiprocessing.get_context("spawn")




def poke(name: str, offset: int, fmt: str, *values) -> None:
    """Writes values into the segment's bytes at offset, behind hostkv's back."""
    with RawSegment(name) as raw:
        struct.pack_into(fmt, raw.map, offset, *values)


def finished(p, expected_exitcode: int) -> None:
    p.join(CHILD_TIMEOUT)
    assert not p.is_alive(), "child did not finish"
    assert p.exitcode == expected_exitcode


# -- workers (run in spawned children) ---------------------------------------------------------


def _write_page(name: str, page: int, seed: int) -> None:
    cache = HostKVCache.attach(name)
    pool = cache.pages_array()
    pool[page] = (np.arange(pool.shape[1]) + seed).astype(np.uint8)
    del pool
    cache.close()


def _attach_and_vanish(name: str) -> None:
    # Attach, then leave without close(): as a crash would, with the lease still held. (The
    # handle must stay referenced: a collected handle closes itself and gives the lease back.)
    cache = HostKVCache.attach(name)
    os._exit(0 if not cache.closed else 1)


def _die_mid_alloc(name: str) -> None:
    cache = HostKVCache.attach(name)
    seg = cache._segment
    # Step 1 is the first page's refcount store, step 2 the second's: the process _exits
    # (status 77) with the lock held and the mutation half done.
    seg._arm_crash_point(2, "exit")
    _pages.alloc_pages(seg, 3)
    os._exit(1)                             # the crash point did not fire


def _signal_and_sleep(event, seconds: float) -> None:
    event.set()
    time.sleep(seconds)


def _hold_lock(name: str, event) -> None:
    cache = HostKVCache.attach(name)
    # Holds the segment's lock, tells the parent, then sleeps until killed.
    cache._segment.run_locked(_signal_and_sleep, event, 600)
    os._exit(1)


def _check_until_stopped(name: str, started, stop) -> None:
    """Calls check() back to back, each holding the lock ~1 ms, until stop is set (raw page
    references of the parent's are allowed)."""
    cache = HostKVCache.attach(name)
    cache.check(exact_references=False)
    started.set()
    while not stop.is_set():
        cache.check(exact_references=False)
    cache.close()


# -- tests -------------------------------------------------------------------------------------


def test_processes_share_the_pool(cache, segment_name, procs):
    k = 11
    p = procs(_write_page, segment_name, k, 3)
    finished(p, 0)
    pool = cache.pages_array()
    assert (pool[k] == (np.arange(64) + 3).astype(np.uint8)).all()
    assert (pool[k - 1] == 0).all() and (pool[k + 1] == 0).all()
    del pool
    st = cache.stats()
    assert st.active_processes == 1          # the child closed: its lease is back
    assert st.leases_reaped == 0
    cache.check(exact_references=False)


def test_dead_process_lease_is_reaped(cache, segment_name, procs):
    before = cache.stats()
    p = procs(_attach_and_vanish, segment_name)
    finished(p, 0)
    assert cache.reap() == 1
    st = cache.stats()
    assert st.active_processes == 1
    assert st.leases_reaped == before.leases_reaped + 1
    cache.check(exact_references=False)
    assert cache.reap() == 0


def test_reap_counts_what_a_sweep_due_at_the_same_time_found(cache, segment_name, procs):
    # docs/design.md: a sweep runs at least once a second while the lock is in use. When one is due
    # as reap() takes the lock (forced here through a test hook), the dead lease
    # is reaped by that call all the same, and reap() must count it.
    before = cache.stats()
    p = procs(_attach_and_vanish, segment_name)
    finished(p, 0)
    cache._segment._make_sweep_due()
    assert cache.reap() == 1
    st = cache.stats()
    assert st.active_processes == 1
    assert st.leases_reaped == before.leases_reaped + 1
    cache.check(exact_references=False)


def test_attach_reclaims_a_dead_lease_when_all_slots_are_taken(segment_name, procs):
    with HostKVCache.create(segment_name, small_config(max_processes=2)) as cache:
        p = procs(_attach_and_vanish, segment_name)
        finished(p, 0)
        # Both slots are marked active; one holder is dead. docs/design.md: attach sweeps.
        with HostKVCache.attach(segment_name) as other:
            st = other.stats()
            assert st.active_processes == 2
            assert st.leases_reaped == 1
            other.check(exact_references=False)
        cache.check(exact_references=False)


def test_death_while_holding_the_lock_mid_mutation_is_recovered(cache, segment_name, procs):
    held = _pages.alloc_pages(cache._segment, 4)
    before = cache.stats()
    refcounts_before = _pages.refcounts(cache._segment)
    p = procs(_die_mid_alloc, segment_name)
    finished(p, CRASH_STATUS)
    st = cache.stats()                       # locks: EOWNERDEAD, rolls the half-alloc back
    assert st.recoveries == before.recoveries + 1
    assert st.free_pages == before.free_pages
    assert st.pages_allocated == before.pages_allocated
    assert (_pages.refcounts(cache._segment) == refcounts_before).all()
    cache.check(exact_references=False)
    cache.reap()
    assert cache.stats().active_processes == 1
    # Still fully usable: every free page can be taken and given back.
    more = _pages.alloc_pages(cache._segment, before.free_pages)
    _pages.free_pages(cache._segment, np.concatenate([held, more]))
    assert cache.stats().free_pages == 32
    cache.check(exact_references=False)


def test_sigkill_while_holding_the_lock(cache, segment_name, procs):
    before = cache.stats()
    event = ctx.Event()
    p = procs(_hold_lock, segment_name, event)
    assert event.wait(CHILD_TIMEOUT), "child did not take the lock"
    os.kill(p.pid, signal.SIGKILL)
    finished(p, -signal.SIGKILL)
    st = cache.stats()                       # EOWNERDEAD: nothing to roll back
    assert st.free_pages == before.free_pages
    cache.check(exact_references=False)
    cache.reap()
    assert cache.stats().active_processes == 1
    pages = _pages.alloc_pages(cache._segment, 3)
    _pages.free_pages(cache._segment, pages)
    cache.check(exact_references=False)


def test_a_process_locking_back_to_back_does_not_starve_another(segment_name, procs):
    # A just-freed mutex goes to whoever asks first, and a process re-locking at once asks
    # before the waiter its unlock woke can run. It now gives way to that waiter, so the
    # calls here get the lock within a short timeout while another process polls check().
    cfg = small_config(num_pages=4096, max_sequences=64)
    with HostKVCache.create(segment_name, cfg, lock_timeout=1) as cache:
        started, stop = ctx.Event(), ctx.Event()
        p = procs(_check_until_stopped, segment_name, started, stop)
        try:
            assert started.wait(CHILD_TIMEOUT), "child did not attach"
            deadline = time.monotonic() + 4          # several lock timeouts
            while time.monotonic() < deadline:
                _pages.free_pages(cache._segment, _pages.alloc_pages(cache._segment, 2))
        finally:
            stop.set()
        finished(p, 0)
        cache.check()


def test_stopped_holder_times_out_then_is_recovered_when_killed(cache, segment_name, procs):
    # attach itself takes the lock, so the impatient handle attaches before the child holds it.
    impatient = HostKVCache.attach(segment_name, lock_timeout=0.5)
    try:
        recoveries = cache.stats().recoveries
        event = ctx.Event()
        p = procs(_hold_lock, segment_name, event)
        assert event.wait(CHILD_TIMEOUT), "child did not take the lock"
        os.kill(p.pid, signal.SIGSTOP)
        with pytest.raises(LockTimeoutError) as info:
            impatient.stats()
        assert isinstance(info.value, TimeoutError)
        with pytest.raises(LockTimeoutError):
            _pages.alloc_pages(impatient._segment, 1)
        # A stopped holder is alive: nothing was recovered (read without the lock).
        assert impatient._segment.header_info()["stats"]["st_recoveries"] == recoveries
        os.kill(p.pid, signal.SIGCONT)
        p.kill()
        finished(p, -signal.SIGKILL)
        st = impatient.stats()               # now the holder is dead: EOWNERDEAD
        assert st.free_pages == 32
        assert st.recoveries == recoveries   # it held the lock but mutated nothing
        impatient.check(exact_references=False)
        impatient.reap()
        assert impatient.stats().active_processes == 2
        cache.check(exact_references=False)
    finally:
        impatient.close()
    assert cache.stats().active_processes == 1


def test_forked_child_takes_its_own_lease(cache):
    parent_slot = cache._segment.lease_slot_index
    assert parent_slot >= 0
    before = cache.stats()
    pid = fork_quietly()
    if pid == 0:                             # the child: never return into pytest
        status = 3
        try:
            st = cache.stats()
            slot = cache._segment.lease_slot_index
            ok = slot >= 0 and slot != parent_slot and st.active_processes == 2
            status = 0 if ok else 1
        except BaseException:
            status = 2
        finally:
            os._exit(status)
    _, wait_status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(wait_status) == 0
    # The parent's lease is untouched; the child's is dead now.
    assert cache._segment.lease_slot_index == parent_slot
    assert cache.reap() == 1
    st = cache.stats()
    assert st.active_processes == 1
    assert st.leases_reaped == before.leases_reaped + 1
    cache.check(exact_references=False)
