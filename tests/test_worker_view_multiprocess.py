"""WorkerView across real processes: reuse of another process's KV, dead processes' sequences.

Children are started with the spawn context (a fresh interpreter, as engine workers are),
joined with a timeout, and their exit codes asserted; an assertion failing in a child exits
it with status 1 (its traceback goes to the test's stderr). Worker functions live at module
level so that spawn can import them.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
import zlib

import numpy as np
import pytest

import hostkv
from hostkv import HostKVCache, SequenceRequest as R, WorkerView
from hostkv import _introspect

CHILD_TIMEOUT = 60
PS = 4
PAGE_BYTES = 256
ctx = multiprocessing.get_context("spawn")

P = list(range(1000, 1012))             # a 3-page prefix


def config(**overrides) -> hostkv.HostKVConfig:
    values = dict(num_pages=64, page_size=PS, page_bytes=PAGE_BYTES, max_processes=8)
    values.update(overrides)
    return hostkv.HostKVConfig(**values)


def kv_of_page(tokens, index: int) -> np.ndarray:
    """The "KV" of page `index` of tokens: a function of every token up to the page's end,
    as real KV is of the whole prefix."""
    prefix = np.asarray(tokens[:(index + 1) * PS], dtype=np.int32)
    rng = np.random.default_rng(zlib.crc32(prefix.tobytes()))
    return rng.integers(0, 256, PAGE_BYTES, dtype=np.uint8)




def finished(p, expected_exitcode: int) -> None:
    p.join(CHILD_TIMEOUT)
    assert not p.is_alive(), "child did not finish"
    assert p.exitcode == expected_exitcode


def prefix_map(cache: HostKVCache) -> dict:
    """The tree as {(namespace, token prefix of k pages): k-th page}, and no locks left."""
    seg = cache._segment
    out = {}
    for namespace, tokens, pages, locks in seg.run_locked(_introspect.tree_contents, seg):
        assert locks == 0
        for k in range(1, len(pages) + 1):
            out[(namespace, tuple(tokens[:k * PS]))] = pages[k - 1]
    return out


# -- workers (run in spawned children) ---------------------------------------------------------


def _produce(name: str, prompt: list, decoded: list) -> None:
    """Allocates, writes the KV of every page as it fills (decode included), commits, releases."""
    cache = HostKVCache.attach(name)
    view = WorkerView(cache)
    pool = cache.pages_array()
    (alloc,) = view.allocate_pages_for_sequences_with_prefix([R(1, prompt)])
    assert alloc.reused_tokens == 0
    tokens = list(prompt)
    written = 0
    for token in decoded:
        view.append_tokens([1], [token])
        tokens.append(token)
        table = view.page_table(1)
        while (written + 1) * PS <= len(tokens):
            pool[table[written]] = kv_of_page(tokens, written)
            written += 1
    assert view.commit([1]) == [len(tokens) // PS]
    assert view.release([1]) == [len(tokens) // PS]
    del pool
    view.close()
    cache.close()


def _consume(name: str, prompt: list, expected_reuse: int) -> None:
    """Reuses the other process's pages and checks they hold the KV it wrote."""
    cache = HostKVCache.attach(name)
    view = WorkerView(cache)
    pool = cache.pages_array()
    (alloc,) = view.allocate_pages_for_sequences_with_prefix([R(7, prompt)])
    assert alloc.reused_tokens == expected_reuse, (alloc.reused_tokens, expected_reuse)
    for j in range(alloc.num_shared_pages):
        assert np.array_equal(pool[alloc.page_table[j]], kv_of_page(prompt, j)), j
    # Its own pages: written, then published in turn.
    for j in range(alloc.num_shared_pages, len(prompt) // PS):
        pool[alloc.page_table[j]] = kv_of_page(prompt, j)
    view.release([7])
    del pool
    view.close()
    cache.close()


def _hold_sequences(name: str, ready, go, how: str) -> None:
    """Allocates sequences (two borrowing P), decodes a few steps, then dies holding them."""
    cache = HostKVCache.attach(name)
    view = WorkerView(cache)
    allocs = view.allocate_pages_for_sequences_with_prefix(
        [R(1, P + [1, 2, 3]), R(2, P[:8] + [9]), R(3, list(range(5000, 5000 + 10 * PS)))])
    assert [a.reused_tokens for a in allocs] == [12, 8, 0]
    for step in range(6):
        view.append_tokens([1, 2, 3], [step, step, None if step == 2 else step])
    # Its full decoded pages are never committed: the process dies first.
    ready.set()
    if how == "exit":
        go.wait(CHILD_TIMEOUT)
        os._exit(0)                     # no close(): the lease and sequences stay behind
    time.sleep(CHILD_TIMEOUT * 10)      # until SIGKILLed
    os._exit(1)


def _hold_many_pages(name: str) -> None:
    """Accumulates 40 pages in 10 sequences, one small batch at a time, then dies."""
    cache = HostKVCache.attach(name)
    view = WorkerView(cache)
    for i in range(10):
        view.allocate_pages_for_sequences_with_prefix([R(i, list(range(16 * i, 16 * i + 16)))])
    os._exit(0)


# -- tests -------------------------------------------------------------------------------------


def test_a_prefix_written_by_one_process_is_reused_by_another(segment_name, procs):
    with HostKVCache.create(segment_name, config()) as cache:
        prompt = list(range(100, 118))                      # 4 full pages and 2 tokens
        decoded = [7, 7, 8, 8, 9, 9]                        # fill pages 5 and 6 by decode
        finished(procs(_produce, segment_name, prompt, decoded), 0)
        tokens = prompt + decoded
        st = cache.stats()
        assert (st.cached_pages, st.active_sequences, st.active_processes) == (6, 0, 1)
        assert cache.match_prefix(tokens).num_tokens == 24
        # Shares 22 tokens: 5 full pages (the fifth filled by decode), then diverges.
        other = tokens[:22] + [50, 51, 52]
        finished(procs(_consume, segment_name, other, 20), 0)
        st = cache.stats()
        assert st.hit_tokens == 20
        assert st.active_sequences == 0 and st.active_processes == 1
        # The consumer's own full page is cached too, under the shared prefix.
        assert cache.match_prefix(other).num_tokens == 24
        pool = cache.pages_array()
        pages = cache.match_prefix(other).pages
        assert all(np.array_equal(pool[p], kv_of_page(other, j)) for j, p in enumerate(pages))
        del pool
        # An equal prompt in this process sees both processes' pages.
        with WorkerView(cache) as view:
            (alloc,) = view.allocate_pages_for_sequences_with_prefix([R(1, other + [1])])
            assert alloc.reused_tokens == 24
        cache.check()


@pytest.mark.parametrize("reclaim", ["reap", "attach", "short_allocation"])
@pytest.mark.parametrize("death", ["exit", "sigkill"])
def test_a_dead_process_sequences_are_released_without_commit(segment_name, procs, death,
                                                              reclaim):
    with HostKVCache.create(segment_name, config()) as cache, WorkerView(cache) as view:
        view.allocate_pages_for_sequences_with_prefix([R(1, P + [0])])
        view.release([1])
        baseline = cache.stats()
        assert (baseline.cached_pages, baseline.free_pages) == (3, 61)
        cached = cache.match_prefix(P).pages.tolist()

        ready, go = ctx.Event(), ctx.Event()
        p = procs(_hold_sequences, segment_name, ready, go, death)
        assert ready.wait(CHILD_TIMEOUT), "child did not allocate"
        during = cache.stats()
        assert during.active_sequences == 3
        assert during.active_processes == 2
        # Own pages after 6 decode steps: 1 has 21 tokens (3 of 6 pages borrowed), 2 has 15
        # (2 of 4 borrowed), 3 has 46 (12 pages, none borrowed).
        assert during.free_pages == baseline.free_pages - 3 - 2 - 12
        assert during.borrowed_pages == 3 and during.evictable_pages == 0
        cache.check()
        # A forced sweep while the child lives finds nothing (and the next periodic sweep is
        # a second away, so what reclaims the child below is the path under test).
        assert cache.reap() == 0
        if death == "exit":
            go.set()
            finished(p, 0)
        else:
            os.kill(p.pid, signal.SIGKILL)
            finished(p, -signal.SIGKILL)

        if reclaim == "reap":
            assert cache.reap() == 1
        elif reclaim == "attach":
            with HostKVCache.attach(segment_name) as other:
                assert other.stats().leases_reaped == baseline.leases_reaped + 1
        else:
            # More pages than are free or evictable while the dead child's sequences hold
            # theirs: only reclaiming them makes the batch fit. (The reap above was well under
            # a second ago, so no periodic sweep runs first: the short allocation's own sweep
            # reclaims them, unless this machine is very slow - the outcome is the same.)
            need = during.free_pages + 1
            allocs = view.allocate_pages_for_sequences_with_prefix(
                [R(10, list(range(7000, 7000 + need * PS)))])
            assert len(allocs[0].page_table) == need
            assert cache.stats().leases_reaped == baseline.leases_reaped + 1
            view.release([10], commit=False)

        st = cache.stats()
        assert st.leases_reaped == baseline.leases_reaped + 1
        assert (st.active_sequences, st.active_processes) == (0, 1)
        assert st.free_pages == baseline.free_pages
        assert (st.cached_pages, st.borrowed_pages, st.evicted_pages) == (3, 0, 0)
        # The borrowed prefix stays cached; nothing of the child's was committed.
        assert cache.match_prefix(P).pages.tolist() == cached
        assert prefix_map(cache) == {(0, tuple(P[:k * PS])): cached[k - 1] for k in (1, 2, 3)}
        assert cache.match_prefix(list(range(5000, 5000 + 10 * PS))).num_tokens == 0
        cache.check()
        assert cache.reap() == 0


def test_a_dead_process_holding_more_than_one_undo_log_is_reaped(segment_name, procs):
    # undo_log_capacity bounds one mutation, and the child's batches each fit it; releasing
    # everything the dead child held must not be one mutation that cannot (it would fail in
    # every later lock's periodic sweep, leaving the segment unusable for every process).
    try:
        cache = HostKVCache.create(segment_name, config(undo_log_capacity=256))
    except hostkv.ConfigError:
        return          # a fix may refuse an undo log too small to release the whole pool
    try:
        finished(procs(_hold_many_pages, segment_name), 0)
        # Read through an observer, which never sweeps: the creator's own stats() would reap
        # the child itself once its periodic sweep is due (a busy machine's slow spawn).
        with HostKVCache.attach(segment_name, lease=False) as observer:
            assert observer.stats().free_pages == 64 - 40
        assert cache.reap() == 1
        st = cache.stats()
        assert (st.active_sequences, st.active_processes, st.free_pages) == (0, 1, 64)
        cache.check()
    finally:
        try:
            cache.close()
        except hostkv.HostKVError:
            pass            # the failure above already says why
