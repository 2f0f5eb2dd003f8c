"""Threads of one process sharing one HostKVCache.

docs/design.md, "Threads": one HostKVCache may be used by any number of threads of its
process, each thread with its own WorkerView, and the segment lock serialises them like
processes. The lock is a robust process-shared mutex, and the kernel tracks which thread
holds it; only a thread that already holds it must be refused (a normal-type mutex would
deadlock on itself).
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from hostkv import HostKVCache, LockTimeoutError, SequenceRequest, WorkerView

from conftest import small_config

PAGE = 4
ENGINE_THREADS = 4
ROUNDS = 150
STARVE_SECONDS = 4            # several lock timeouts of back-to-back locking


def _engine(cache, index, rounds, errors, counts):
    """One worker thread: allocate (sharing a prefix with the other threads), decode a few
    tokens, commit, release; every call on its own view."""
    rng = np.random.default_rng(index)
    shared = list(range(1, 3 * PAGE + 1))            # three pages every thread shares
    requests = prompt_tokens = 0
    try:
        with WorkerView(cache) as view:
            for r in range(rounds):
                seq_ids = [r * 2, r * 2 + 1]
                reqs = [SequenceRequest(s, shared + rng.integers(100, 1000, PAGE + s % 3).tolist())
                        for s in seq_ids]
                view.allocate_pages_for_sequences_with_prefix(reqs)
                requests += len(reqs)
                prompt_tokens += sum(len(q.tokens) for q in reqs)
                for _ in range(PAGE + 1):
                    view.append_tokens(seq_ids, rng.integers(100, 1000, 2).tolist())
                view.commit(seq_ids[:1])
                view.release(seq_ids, commit=r % 2 == 0)
            counts[index] = (requests, prompt_tokens, view.stats().reused_tokens)
    except BaseException as exc:  # noqa: BLE001 - reported to the main thread
        errors.append((f"engine {index}", repr(exc)))


def _observer(fn, stop, errors, what, calls):
    try:
        while not stop.is_set():
            fn()
            calls[what] = calls.get(what, 0) + 1
    except BaseException as exc:  # noqa: BLE001
        errors.append((what, repr(exc)))


@pytest.mark.parametrize("num_parts", [0, 32], ids=["no-parts", "parts"])
def test_threads_with_own_views_serialise_on_the_segment_lock(segment_name, num_parts):
    # The "locked" flag once belonged to the handle, so every thread but the holder got
    # RuntimeError("not re-entrant") on nearly every call. With window parts (a part for
    # every eighth page), the threads' allocations take them from each other's nodes.
    cfg = small_config(num_pages=256, max_sequences=64, page_size=PAGE, num_parts=num_parts,
                       part_bytes=16 if num_parts else 0)
    with HostKVCache.create(segment_name, cfg) as cache:
        errors: list = []
        counts: dict = {}
        calls: dict = {}
        stop = threading.Event()
        observers = [
            threading.Thread(target=_observer, args=(cache.stats, stop, errors, "stats", calls)),
            threading.Thread(target=_observer,
                             args=(lambda: cache.check(), stop, errors, "check", calls)),
            threading.Thread(target=_observer,
                             args=(lambda: cache.page_parts(range(cfg.num_pages)), stop, errors,
                                   "page_parts", calls)),
        ]
        engines = [threading.Thread(target=_engine, args=(cache, i, ROUNDS, errors, counts))
                   for i in range(ENGINE_THREADS)]
        for t in observers + engines:
            t.start()
        for t in engines:
            t.join(120)
        stop.set()
        for t in observers:
            t.join(120)
        assert not any(t.is_alive() for t in observers + engines)
        assert errors == []
        assert calls.get("stats", 0) > 0 and calls.get("check", 0) > 0

        cache.check()
        stats = cache.stats()
        requests = sum(c[0] for c in counts.values())
        assert len(counts) == ENGINE_THREADS
        assert requests == ENGINE_THREADS * ROUNDS * 2
        # Exact counts: every request counted once, every page back in the pool or the tree.
        assert stats.lookups == requests
        assert stats.lookup_tokens == sum(c[1] for c in counts.values())
        assert stats.hit_tokens == sum(c[2] for c in counts.values())
        assert stats.active_sequences == 0
        assert stats.borrowed_pages == 0
        assert stats.free_pages + stats.cached_pages == cfg.num_pages
        assert stats.pages_allocated - stats.pages_freed == stats.cached_pages
        assert stats.rollbacks == 0 and stats.recoveries == 0
        # The shared prefix was reused across threads.
        assert stats.hit_tokens > 0
        # No part leaked: each is free or a cached page's.
        assert stats.free_parts + stats.tree_parts == num_parts
        if num_parts:
            assert stats.parts_evicted > 0 and calls.get("page_parts", 0) > 0


def test_the_holding_thread_may_not_lock_again(cache):
    # Re-entry by the SAME thread is still refused (a normal mutex would deadlock on itself).
    with pytest.raises(RuntimeError, match="re-entrant"):
        cache._segment.run_locked(cache.stats)
    cache.check()           # the refused call left the lock free


def test_another_thread_waits_for_the_lock_and_times_out_like_a_process(segment_name):
    # The same timeout as between processes: a thread that cannot get the lock within
    # lock_timeout gets LockTimeoutError, and succeeds once the holder lets go.
    with HostKVCache.create(segment_name, small_config(), lock_timeout=0.2) as cache:
        holding, release = threading.Event(), threading.Event()
        outcome: list = []

        def hold():
            holding.set()
            release.wait(60)

        holder = threading.Thread(target=cache._segment.run_locked, args=(hold,))
        holder.start()
        try:
            assert holding.wait(60)

            def other():
                try:
                    cache.stats()
                    outcome.append("ok")
                except LockTimeoutError:
                    outcome.append("timeout")

            t = threading.Thread(target=other)
            t.start()
            t.join(60)
            assert outcome == ["timeout"]
        finally:
            release.set()
            holder.join(60)
        assert cache.stats().active_sequences == 0
        cache.check()


def test_a_thread_waiting_for_the_lock_gets_it_when_the_holder_lets_go(segment_name):
    with HostKVCache.create(segment_name, small_config(), lock_timeout=60) as cache:
        holding, release = threading.Event(), threading.Event()
        got: list = []

        def hold():
            holding.set()
            release.wait(60)

        holder = threading.Thread(target=cache._segment.run_locked, args=(hold,))
        holder.start()
        assert holding.wait(60)
        waiter = threading.Thread(target=lambda: got.append(cache.stats().free_pages))
        waiter.start()
        release.set()
        holder.join(60)
        waiter.join(60)
        assert got == [cache.config.num_pages]


def test_a_thread_locking_back_to_back_does_not_starve_another(segment_name):
    # glibc's mutex lets a newcomer take a just-freed lock before the waiter it woke runs, so
    # a thread that re-locks at once (a check() poller) kept the lock for the full timeout
    # while three engine threads of its process waited. Its process now gives way to the
    # woken waiter, so every call here gets the lock well within a short timeout.
    cfg = small_config(num_pages=256, max_sequences=64, page_size=PAGE)
    with HostKVCache.create(segment_name, cfg, lock_timeout=1) as cache:
        stop = threading.Event()
        errors: list = []
        calls: dict = {}
        poller = threading.Thread(target=_observer,
                                  args=(lambda: cache.check(), stop, errors, "check", calls))
        poller.start()
        try:
            while not calls and poller.is_alive():
                time.sleep(0.001)
            with WorkerView(cache) as view:
                deadline, r = time.monotonic() + STARVE_SECONDS, 0
                while time.monotonic() < deadline:
                    view.allocate_pages_for_sequences_with_prefix(
                        [SequenceRequest(r, list(range(1, 3 * PAGE + 1)) + [100 + r % 900])])
                    view.release([r], commit=True)
                    r += 1
        finally:
            stop.set()
            poller.join(60)
        assert errors == [] and calls["check"] > 0
        cache.check()


def test_a_holder_that_slept_for_the_lock_hands_nothing_off(segment_name):
    # glibc marks a lock taken after sleeping as having waiters, whether or not any remain:
    # if its unlock handed off on that bit, the next lock of an idle segment would give
    # way for 1 ms to nobody. Only the holder that came first (it found the lock free) and
    # left a sleeper behind hands off.
    with HostKVCache.create(segment_name, small_config(), lock_timeout=60) as cache:
        holding, release = threading.Event(), threading.Event()

        def hold():
            holding.set()
            release.wait(60)

        holder = threading.Thread(target=cache._segment.run_locked, args=(hold,))
        holder.start()
        assert holding.wait(60)
        waiter = threading.Thread(target=cache.stats)
        waiter.start()
        time.sleep(0.2)                 # well past its spin: asleep in the kernel
        release.set()
        holder.join(60)
        waiter.join(60)
        assert not holder.is_alive() and not waiter.is_alive()
        assert cache._segment.handoff_due is False
        cache.check()


def test_views_in_threads_allocate_distinct_pages(segment_name):
    # Pages handed to live sequences of different threads never overlap.
    cfg = small_config(num_pages=128, max_sequences=64, page_size=PAGE)
    with HostKVCache.create(segment_name, cfg) as cache:
        tables: dict = {}
        errors: list = []
        barrier = threading.Barrier(4)

        def run(i):
            try:
                view = WorkerView(cache)
                barrier.wait(60)
                allocs = view.allocate_pages_for_sequences_with_prefix(
                    [SequenceRequest(s, [1000 * i + s + k for k in range(3 * PAGE)])
                     for s in range(4)])
                tables[i] = np.concatenate([a.page_table for a in allocs])
                barrier.wait(60)
                view.close()
            except BaseException as exc:  # noqa: BLE001
                errors.append(repr(exc))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert errors == []
        pages = np.concatenate(list(tables.values()))
        assert len(pages) == len(set(pages.tolist())) == 4 * 4 * 3
        cache.check()
        assert cache.stats().active_sequences == 0



# -- close() while other threads are inside calls ---------------------------------------------


def _wait_for(predicate, what):
    for _ in range(60_000):
        if predicate():
            return
        time.sleep(0.001)
    raise AssertionError(f"timed out waiting for {what}")


def test_close_waits_for_a_call_in_flight_in_another_thread(segment_name):
    # Before the fix, close() unmapped under the other thread's call (SIGSEGV, or
    # "sequence record 0 is referenced but free" in that thread).
    cache = HostKVCache.create(segment_name, small_config(), lock_timeout=60)
    holding, release = threading.Event(), threading.Event()
    results: list = []

    def hold():
        holding.set()
        release.wait(60)
        return cache._segment.header_info()["free_pages"]    # reads the mapping after close began

    holder = threading.Thread(target=lambda: results.append(cache._segment.run_locked(hold)))
    holder.start()
    assert holding.wait(60)
    closer = threading.Thread(target=cache.close)
    closer.start()
    _wait_for(lambda: cache._segment.closing, "close() to start waiting")
    assert not cache.closed
    # New calls are refused while close() waits.
    with pytest.raises(ValueError, match="closed"):
        cache.stats()
    release.set()
    holder.join(60)
    closer.join(60)
    assert results == [cache.config.num_pages]
    assert cache.closed
    with HostKVCache.attach(segment_name) as other:
        other.check()
        assert other.stats().active_processes == 1      # the closed handle gave its lease up


def test_close_gives_up_after_the_bound_and_the_handle_stays_usable(segment_name):
    with HostKVCache.create(segment_name, small_config(), lock_timeout=0.2) as cache:
        holding, release = threading.Event(), threading.Event()

        def hold():
            holding.set()
            release.wait(60)

        holder = threading.Thread(target=cache._segment.run_locked, args=(hold,))
        holder.start()
        try:
            assert holding.wait(60)
            with pytest.raises(LockTimeoutError, match="in flight"):
                cache.close()
            assert not cache.closed and not cache._segment.closing
        finally:
            release.set()
            holder.join(60)
        assert cache.stats().free_pages == cache.config.num_pages
        cache.check()
    assert cache.closed


def test_close_from_inside_a_call_is_refused(cache):
    with pytest.raises(RuntimeError, match="inside a call"):
        cache._segment.run_locked(cache.close)
    assert not cache.closed
    cache.check()


def test_close_while_views_of_threads_run(segment_name):
    # Engine threads hammer the cache while the main thread closes it: each call either
    # completes or is refused with ValueError; nothing crashes, nothing is corrupt.
    cfg = small_config(num_pages=128, max_sequences=64, page_size=PAGE)
    for trial in range(3):
        cache = HostKVCache.create(segment_name, cfg)
        errors: list = []
        started = threading.Barrier(ENGINE_THREADS + 1)

        def run(i):
            view = WorkerView(cache)
            started.wait(60)
            try:
                for r in range(10_000):
                    view.allocate_pages_for_sequences_with_prefix(
                        [SequenceRequest(r, list(range(1, 2 * PAGE + 2)))])
                    view.release([r])
            except ValueError as exc:
                if "closed" not in str(exc):
                    errors.append(repr(exc))
            except BaseException as exc:  # noqa: BLE001
                errors.append(repr(exc))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(ENGINE_THREADS)]
        for t in threads:
            t.start()
        started.wait(60)
        time.sleep(0.01 * trial)
        cache.close()
        for t in threads:
            t.join(60)
        assert errors == []
        with HostKVCache.attach(segment_name) as other:
            other.reap()
            other.check()
            assert other.stats().active_sequences == 0
        HostKVCache.unlink_segment(segment_name)


def test_no_new_pool_view_while_close_waits(segment_name):
    # A view made while close() waits for calls in flight would be unmapped under it.
    cache = HostKVCache.create(segment_name, small_config(), lock_timeout=60)
    holding, release = threading.Event(), threading.Event()

    def hold():
        holding.set()
        release.wait(60)

    holder = threading.Thread(target=cache._segment.run_locked, args=(hold,))
    holder.start()
    closer = None
    try:
        assert holding.wait(60)
        closer = threading.Thread(target=cache.close)
        closer.start()
        _wait_for(lambda: cache._segment.closing, "close() to start waiting")
        with pytest.raises(ValueError, match="closed"):
            cache.pages_array()
    finally:
        release.set()
        holder.join(60)
        if closer is not None:
            closer.join(60)
    assert cache.closed
