"""Random kill -9 soak: worker processes run real traffic on one segment while the parent
SIGKILLs one at random times and starts a replacement; some workers also carry an armed
crash point, so that some deaths land inside the lock, mid-mutation.

Afterwards (every worker stopped) one reap must reclaim everything the dead held: no live
sequence, no borrowed page, every page free or cached, every invariant exact, and the tree
still serves a committed prefix.

The segment has window parts for a quarter of its pages. Workers write a pattern derived
from the namespace and the tokens into the part of each prompt page they compute, and check
it in the part of every page a hit serves them; afterwards every cached prompt page's part
must still hold its pattern, and every part must be free or a cached page's.

By default it runs about 45 s and needs at least 20 kills; HOSTKV_LONG=1 runs until 1000
kills. Run with -s to see the counts.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time

import numpy as np
import pytest

from hostkv import HostKVCache, SequenceRequest as R, WorkerView, _introspect

from conftest import report_counts
from workers import soak_worker

LONG = os.environ.get("HOSTKV_LONG") == "1"
WORKERS = 3
DURATION = float(os.environ.get("HOSTKV_SOAK_SECONDS", 45))   # of killing, by default
MIN_KILLS = 20
LONG_KILLS = 1000
ARMED_SHARE = 0.4               # workers with a crash point
JOIN_TIMEOUT = 20.0
CHECK_EVERY = 3.0               # the parent's own check() while the workers run
CRASH_STATUS = 77

ctx = multiprocessing.get_context("spawn")


class Worker:
    def __init__(self, name: str, seed: int, armed: bool) -> None:
        self.ops = ctx.Value("q", 0, lock=False)
        self.armed = armed
        self.proc = ctx.Process(target=soak_worker.main, args=(name, seed, self.ops, armed),
                                daemon=True)
        self.proc.start()


@pytest.fixture
def workers():
    """The live workers, by slot; any left are killed in teardown, failures included."""
    table = {}
    yield table
    for w in table.values():
        if w.proc.is_alive():
            w.proc.kill()
        w.proc.join(JOIN_TIMEOUT)


def test_random_kill_9_soak(segment_name, workers, record_property):
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    seed_base = rng.randrange(1 << 30)
    cache = HostKVCache.create(segment_name, soak_worker.config())
    num_pages = cache.config.num_pages
    counts = dict(kills=0, kills_armed=0, crash_point_deaths=0, spawned=0, ops=0)
    failures = []

    def spawn(slot: int) -> None:
        counts["spawned"] += 1
        workers[slot] = Worker(segment_name, seed_base + counts["spawned"],
                               armed=rng.random() < ARMED_SHARE)

    def retire(slot: int, killed: bool) -> None:
        w = workers.pop(slot)
        w.proc.join(JOIN_TIMEOUT)
        assert not w.proc.is_alive(), f"worker {w.proc.pid} did not die"
        counts["ops"] += w.ops.value
        code = w.proc.exitcode
        if code == CRASH_STATUS and w.armed:
            counts["crash_point_deaths"] += 1      # (maybe just before the kill)
        elif killed and code == -signal.SIGKILL:
            counts["kills"] += 1
            counts["kills_armed"] += w.armed
        else:
            failures.append(f"worker {w.proc.pid} (armed={w.armed}) exited with {code}")

    for slot in range(WORKERS):
        spawn(slot)
    start = time.monotonic()
    last_check = start
    try:
        while not failures:
            elapsed = time.monotonic() - start
            if (counts["kills"] >= LONG_KILLS) if LONG else (elapsed >= DURATION):
                break
            time.sleep(rng.uniform(0.01, 0.25))
            # Workers that died on their own: an armed crash point (77) or a failure.
            for slot in [s for s, w in workers.items() if not w.proc.is_alive()]:
                retire(slot, killed=False)
                spawn(slot)
            # kill -9 one that is running traffic, at a random moment.
            running = [s for s, w in workers.items() if w.proc.is_alive() and w.ops.value > 0]
            if running:
                slot = rng.choice(running)
                workers[slot].proc.kill()
                retire(slot, killed=True)
                spawn(slot)
            if time.monotonic() - last_check > CHECK_EVERY:
                cache.check()           # exact, while processes live, die and recover
                last_check = time.monotonic()
        # Stop everyone: kill -9 the rest too. Process.kill(), not os.kill(pid): a worker that
        # died at its crash point since the last look may already be reaped (is_alive() above
        # waits for it), and then its pid is gone (ProcessLookupError) or, worse, reused.
        # Process.kill() sends nothing to a reaped child and ignores one that has just gone;
        # retire() counts it by its exit status either way.
        for slot in list(workers):
            workers[slot].proc.kill()
            retire(slot, killed=True)
        elapsed = time.monotonic() - start
        assert not failures, "; ".join(failures) + " (see the worker's traceback above)"

        reaped = cache.reap()
        stats = cache.stats()
        summary = (f"soak (seed {seed_base}): {counts['kills']} kill -9s ({counts['kills_armed']} of armed workers), "
                   f"{counts['crash_point_deaths']} deaths at a crash point inside the lock, "
                   f"{counts['spawned']} workers, {counts['ops']} batch operations in "
                   f"{elapsed:.0f} s; {stats.recoveries} recoveries of dead lock holders, "
                   f"{stats.leases_reaped} dead processes reaped ({reaped} by the final reap); "
                   f"{stats.cached_pages} pages cached, {stats.hit_tokens} of "
                   f"{stats.lookup_tokens} prompt tokens reused; window parts: "
                   f"{stats.tree_parts} of {stats.num_parts} cached, {stats.parts_evicted} "
                   f"evicted, {stats.parts_donated} donated, {stats.pages_without_part} pages "
                   "went without")
        report_counts(summary)
        record_property("soak_summary", summary)

        # Every reference of the dead is reclaimed; nothing leaked.
        assert stats.active_sequences == 0, summary
        assert stats.active_processes == 1, summary
        assert stats.borrowed_pages == 0, summary
        cache.check()
        assert stats.free_pages + stats.cached_pages == num_pages, summary
        assert counts["kills"] >= (LONG_KILLS if LONG else MIN_KILLS), summary
        if counts["crash_point_deaths"]:
            assert stats.recoveries > 0, summary
        # The traffic really shared prefixes across processes.
        assert stats.inserted_pages > 0 and stats.hit_tokens > 0, summary

        # The window parts: none leaked (every part is free or a cached page's), the part
        # LRU ran, and every cached prompt page's part holds its pattern.
        assert stats.free_parts + stats.tree_parts == stats.num_parts, summary
        assert stats.parts_evicted > 0 and stats.pages_without_part > 0, summary
        contents = cache._segment.run_locked(_introspect.tree_contents, cache._segment)
        parts = cache.parts_array()
        checked = 0
        for namespace, tokens, pages, _ in contents:
            page_parts = cache.page_parts(np.asarray(pages, dtype=np.int32))
            for i, part in enumerate(page_parts.tolist()):
                if part == -1 or max(tokens[:(i + 1) * 4]) >= 60_000:
                    continue            # no part, or a decode page (its part is never read)
                want = soak_worker.part_pattern(namespace, tokens[:(i + 1) * 4])
                assert bytes(parts[part]) == want, (namespace, i, pages[i], part)
                checked += 1
        assert checked > 0, summary
        del parts

        # The tree is still usable: a committed prefix is reused by a fresh allocation.
        prompt = soak_worker.PREFIXES[-1]
        with WorkerView(cache) as view:
            view.allocate_pages_for_sequences_with_prefix([R(1, prompt + [7])])
            view.release([1])
            alloc = view.allocate_pages_for_sequences_with_prefix([R(2, prompt + [8, 9])])[0]
            assert alloc.reused_tokens == len(prompt)
            assert (cache.match_prefix(prompt).pages == alloc.page_table[:len(prompt) // 4]).all()
            view.release([2])
        cache.check()
        stats = cache.stats()
        assert stats.free_pages + stats.cached_pages == num_pages
    finally:
        cache.close()
