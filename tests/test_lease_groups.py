"""A dead scheduler's pages stay quarantined while its workers may still write them.

A vLLM engine's scheduler owns the sequences (it reserved their pages); its workers, other
processes with leases of their own, write KV into those pages, and may still be draining
saves when the scheduler dies. A worker's lease names the scheduler's as its parent
(join_lease_group): while a member of the group lives, the sweep leaves the dead parent's
sequences as they are, and their pages are handed to nobody; once the last member is gone
(closed or dead) the next sweep releases them.
"""

from __future__ import annotations

import multiprocessing
import os
import signal

import numpy as np
import pytest

import hostkv
from hostkv import HostKVCache, SequenceRequest, WorkerView

from conftest import run_in_fork, small_config
from lib import crashlib
from lib.crashlib import CRASH_STATUS, run_in_child, run_observer_in_child, snapshot
from lib.rawseg import LAYOUT, RawSegment

PAGE_SIZE = 4
NUM_PAGES = 16
RESERVED = 6                      # the scheduler's sequence: 6 pages of its own


def _config():
    return small_config(num_pages=NUM_PAGES, page_size=PAGE_SIZE, max_processes=8)


def _tokens(first: int, pages: int) -> list:
    return list(range(first, first + pages * PAGE_SIZE))


def _scheduler(name, answers, commands) -> None:
    """Reserves RESERVED pages in one sequence, answers its lease and pages, then closes
    its handle if told "close" (commands, if any), and waits to be killed."""
    cache = HostKVCache.attach(name)
    view = WorkerView(cache)
    [alloc] = view.allocate_pages_for_sequences_with_prefix(
        [SequenceRequest(1, _tokens(10_000, RESERVED))])
    answers.put((cache.lease_identity, [int(p) for p in alloc.page_table[:RESERVED]]))
    if commands is not None and commands.get() == "close":
        cache.close()             # a clean exit while its worker lives
        answers.put("closed")
    signal.pause()


def _worker(name, answers, commands, parent) -> None:
    """Joins the scheduler's lease group, answers, then closes or dies as told."""
    cache = HostKVCache.attach(name)
    answers.put(cache.join_lease_group(*parent))
    how = commands.get()
    if how == "close":
        cache.close()
        answers.put("closed")
        signal.pause()
    os._exit(0)                   # without closing: a dead lease


@pytest.fixture
def ctx():
    return multiprocessing.get_context("spawn")


@pytest.mark.parametrize("scheduler_ends", ["killed", "closed"])
@pytest.mark.parametrize("worker_ends", ["killed", "closed"])
def test_a_dead_schedulers_pages_are_not_reused_until_its_worker_is_gone(
        segment_name, procs, ctx, worker_ends, scheduler_ends):
    # Before: the sweep freed the dead scheduler's reserved pages at once (and a clean
    # close freed them itself), and the free stack handed the latest freed out first:
    # another engine got a page a dying worker was still writing.
    cache = HostKVCache.create(segment_name, _config())
    answers, commands = ctx.Queue(), ctx.Queue()
    scheduler_commands, worker_commands = ctx.Queue(), ctx.Queue()
    scheduler = procs(_scheduler, segment_name, answers, scheduler_commands)
    lease, reserved = answers.get(timeout=60)
    worker = procs(_worker, segment_name, answers, worker_commands, lease)
    commands = worker_commands
    assert answers.get(timeout=60) is True
    if scheduler_ends == "closed":
        scheduler_commands.put("close")
        assert answers.get(timeout=60) == "closed"
    else:
        scheduler_commands.put("wait")
        scheduler.kill()
        scheduler.join(60)
    assert not cache.lease_alive(*lease)
    view = WorkerView(cache)
    try:
        # The scheduler is dead, its worker alive: nothing is reaped, its pages stay taken.
        assert cache.reap() == 0
        cache.check()
        free = NUM_PAGES - RESERVED
        assert cache.stats().free_pages == free
        [alloc] = view.allocate_pages_for_sequences_with_prefix(
            [SequenceRequest(7, _tokens(0, free))])
        assert not set(alloc.page_table.tolist()) & set(reserved)
        with pytest.raises(hostkv.OutOfPagesError):
            view.allocate_pages_for_sequences_with_prefix([SequenceRequest(8, _tokens(500, 1))])
        cache.check()
        view.release([7], commit=False)
        # The worker goes: the next sweep releases the scheduler's sequence (and the
        # worker's lease, if it died).
        commands.put("close" if worker_ends == "closed" else "exit")
        if worker_ends == "closed":
            assert answers.get(timeout=60) == "closed"
        else:
            worker.join(60)
            assert worker.exitcode == 0
        reaped = cache.reap()
        assert reaped == (1 if worker_ends == "closed" else 2)
        cache.check()
        assert cache.stats().free_pages == NUM_PAGES
        [alloc] = view.allocate_pages_for_sequences_with_prefix(
            [SequenceRequest(9, _tokens(0, NUM_PAGES))])
        assert set(reserved) <= set(alloc.page_table.tolist())
        view.release([9], commit=False)
        cache.check()
    finally:
        view.close()
        cache.close()


def test_join_refuses_a_dead_or_reused_lease(segment_name, procs, ctx):
    with HostKVCache.create(segment_name, _config()) as cache:
        answers, commands = ctx.Queue(), ctx.Queue()
        scheduler = procs(_scheduler, segment_name, answers, commands)
        lease, _ = answers.get(timeout=60)
        slot, generation = lease
        assert cache.lease_alive(slot, generation)
        assert not cache.lease_alive(slot, generation + 1)      # a later registration
        scheduler.kill()
        scheduler.join(60)
        assert cache.join_lease_group(slot, generation) is False  # dead: nothing to write
        assert cache.reap() == 1                                  # no member: freed at once
        assert cache.join_lease_group(slot, generation) is False
        with pytest.raises(ValueError):
            cache.join_lease_group(*cache.lease_identity)
        with pytest.raises(ValueError):
            cache.join_lease_group(999, 1)
        cache.check()


# -- crash at every step of the new mutations ------------------------------------------------

def _parent_fields(name: str, slot: int) -> tuple:
    """(ls_parent_slot, ls_parent_generation) of lease slot `slot`, from the raw bytes."""
    lease = LAYOUT["lease"]
    with RawSegment(name) as raw:
        start = int.from_bytes(raw.read(LAYOUT["header"]["reg_leases"],
                                        LAYOUT["header"]["reg_leases"] + 8), "little")
        at = start + slot * LAYOUT["sizes"]["HkvLease"]
        parent_slot = int.from_bytes(raw.read(at + lease["ls_parent_slot"],
                                              at + lease["ls_parent_slot"] + 4), "little",
                                     signed=True)
        generation = int.from_bytes(raw.read(at + lease["ls_parent_generation"],
                                             at + lease["ls_parent_generation"] + 8), "little")
    return parent_slot, generation


def _join(cache, parent):
    assert cache.join_lease_group(*parent)


def test_join_crash_at_every_step(segment_name):
    """A worker killed at every logged store of its join: recovery leaves its lease as
    registered (no parent), and the dead lease is reaped like any other."""
    cache = HostKVCache.create(segment_name, _config())
    try:
        parent = cache.lease_identity
        before = snapshot(cache)
        for step in range(1, 20):
            status = run_in_child(segment_name, _join, parent, step)
            observer = HostKVCache.attach(segment_name, lease=False)
            try:
                observer.check()                 # recovers the dead child's mutation first
                [dead] = [s for s, *_ in observer._segment.leases() if s != parent[0]]
            finally:
                observer.close()
            if status == 0:
                assert _parent_fields(segment_name, dead) == parent
                break
            assert status == CRASH_STATUS
            assert _parent_fields(segment_name, dead)[1] == 0, f"step {step}"
            assert snapshot(cache) == before
        else:
            raise AssertionError("join never completed")
        assert step > 2
        assert snapshot(cache) == before         # a dead member of a live parent's group
    finally:
        cache.close()


_KEEP: list = []                  # a forked child's handles, alive until its _exit (a death)


def _dead_group(name: str) -> list:
    """A scheduler that reserved pages and a worker that joined it, both dead: returns the
    scheduler's pages."""
    read_pages, write_pages = os.pipe()
    go_read, go_write = os.pipe()
    ident_read, ident_write = os.pipe()

    def scheduler() -> int:
        cache = HostKVCache.attach(name)
        view = WorkerView(cache)
        [alloc] = view.allocate_pages_for_sequences_with_prefix(
            [SequenceRequest(1, _tokens(10_000, 3))])
        os.write(write_pages, np.asarray(alloc.page_table[:3], np.int32).tobytes())
        os.write(ident_write, np.asarray(cache.lease_identity, np.int64).tobytes())
        _KEEP.append((cache, view))
        os.read(go_read, 1)                      # then die, holding the sequence
        return 0

    pid = os.fork()
    if pid == 0:
        os._exit(scheduler())
    pages = np.frombuffer(os.read(read_pages, 12), np.int32).tolist()
    ident = tuple(np.frombuffer(os.read(ident_read, 16), np.int64).tolist())

    def worker() -> int:
        cache = HostKVCache.attach(name)
        _KEEP.append(cache)
        return 0 if cache.join_lease_group(*ident) else 3    # dies with its lease

    assert run_in_fork(worker) == 0
    os.write(go_write, b"x")
    os.waitpid(pid, 0)
    for fd in (read_pages, write_pages, go_read, go_write, ident_read, ident_write):
        os.close(fd)
    return pages


def test_reaping_a_dead_group_crash_at_every_step(segment_name, monkeypatch):
    """A dead scheduler whose only worker died too is reaped by a sweep crashed at every
    step: each death leaves the state for the next sweep, which releases it whole."""
    # Each round allocates afresh: the cumulative page counters move every round.
    monkeypatch.setitem(crashlib.OPTIONS, "counters", False)
    cache = HostKVCache.create(segment_name, _config())
    try:
        before = snapshot(cache)
        for step in range(1, 80):
            _dead_group(segment_name)
            assert len(cache._segment.leases()) == 3
            status = run_observer_in_child(segment_name, lambda s: s.reap(), step)
            state = snapshot(cache)
            assert state == before, f"reap crashed at step {step}: {before.differences(state)}"
            assert len(cache._segment.leases()) == 1
            if status == 0:
                break
            assert status == CRASH_STATUS
        else:
            raise AssertionError("the sweep never completed")
        assert step > 5
    finally:
        cache.close()
