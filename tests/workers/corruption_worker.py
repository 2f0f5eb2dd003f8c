"""Run by tests/test_corruption.py in a subprocess: corrupt segments, then use them.

    python tests/workers/corruption_worker.py NAME_PREFIX SEED [SEED ...]

For each seed: create a segment with real content (a tree with several nodes and a split,
live sequences of this process, the sequences of a dead process), flip seeded random bytes
in its metadata through a raw mmap, then run every kind of operation. Each operation must
raise a hostkv error (or ValueError) or return a correct-looking answer. Prints one line per
case: "START seed" before it, "DONE seed {json}" after; an operation that raised anything
else prints "BAD seed ..." and the process exits 3 at the end. A segfault or a hang shows
as the parent sees it: a death by signal or a timeout after the last START.
"""

from __future__ import annotations

import faulthandler
import json
import os
import random
import struct
import sys
import traceback

import numpy as np

# Run as a script, its sys.path starts at tests/workers/: the helpers are imported from tests/.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import hostkv  # noqa: E402
from hostkv import (  # noqa: E402
    HostKVCache, SequenceRequest as R, WorkerView, _introspect, _sequences)
from hostkv.errors import HostKVError, LockTimeoutError  # noqa: E402

from lib import rawseg  # noqa: E402

PAGE = 4
SYS = list(range(100, 116))                  # four pages
SYS2 = list(range(500, 512))                 # three pages, namespace 7
NS2 = 7


def config() -> hostkv.HostKVConfig:
    # Window parts for a quarter of the pages: their tables are metadata to corrupt too.
    return hostkv.HostKVConfig(num_pages=48, page_size=PAGE, page_bytes=64,
                               radix_node_capacity=16, sequence_page_node_capacity=96,
                               max_sequences=16, max_processes=4, undo_log_capacity=4096,
                               num_parts=12, part_bytes=16)


def build(name: str, rng: random.Random):
    """A segment with content; returns (cache, view holding live sequences 3 and 4, the
    header's region table).

    Half the cases end with a process that dies inside the lock, mid-mutation (an armed
    crash point): the first operation after the corruption then recovers its undo log."""
    cache = HostKVCache.create(name, config(), lock_timeout=2.0)
    view = WorkerView(cache)
    view.allocate_pages_for_sequences_with_prefix(
        [R(1, SYS + [1, 2, 3, 4, 5]), R(2, SYS2 + [9] * 5, NS2), R(5, [7] * 9, 2**63 + 1)])
    view.release([1, 2, 5])
    # 3 borrows two pages of SYS's four-page node: a split. 4 reuses SYS and a tail page.
    view.allocate_pages_for_sequences_with_prefix(
        [R(3, SYS[:8] + [50, 51, 52, 53, 54]), R(4, SYS + [1, 2, 3, 4, 60, 61])])
    view.append_tokens([3, 4], [11, None])
    view.append_tokens([3, 4], [12, 13])
    view.commit([3, 4])
    info = cache._segment.run_locked(cache._segment.header_info)
    crash_at = rng.randint(1, 80) if rng.random() < 0.5 else 0
    # A process that allocates and dies without a word: its lease and sequences are garbage
    # for the next sweep to find.
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            other = HostKVCache.attach(name, lock_timeout=2.0)
            ov = WorkerView(other)
            ov.allocate_pages_for_sequences_with_prefix(
                [R(10, SYS + [70, 71, 72, 73, 74]), R(11, SYS2 + [80] * 6, NS2)])
            ov.append_tokens([10, 11], [75, None])
            ov.commit([10])
            if crash_at:
                other._segment._arm_crash_point(crash_at)
                ov.allocate_pages_for_sequences_with_prefix(
                    [R(12, SYS2 + [81] * 9, NS2), R(13, SYS[:8] + [82] * 3)])
                ov.release([10, 12], commit=True)
            status = 0
        finally:
            os._exit(status)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) in (0, 77), "the dying child failed"
    return cache, view, info


INTERESTING = [0, 1, 2, 3, -1, -2, 15, 16, 17, 47, 48, 49, 95, 96, 2**31 - 1, -2**31, 2**30,
               0x01010101, 4096]


LIVE_BYTES = 640        # the low records of a table: those in use (free lists hand out low first)


def corrupt(name: str, cache, info: dict, rng: random.Random) -> list:
    """Flips 1-3 (a fifth of the cases: 4-12) seeded places in the metadata; returns what it did (for the report).

    Half the flips land in the live part of a region (its first records; the open part of
    the undo log), the others anywhere in it. Reads nothing through hostkv: a dead lock
    holder's log must stay unrecovered until the first operation."""
    targets = rawseg.corruptible_ranges(info, cache.config.max_processes)
    names = sorted(targets)
    done = []
    undo_count_at = rawseg.LAYOUT["header"]["hdr_undo_count"]
    with rawseg.RawSegment(name) as raw:
        undo_count = struct.unpack_from("<q", raw.map, undo_count_at)[0]
        for _ in range(rng.randint(1, 3) if rng.random() < 0.8 else rng.randint(4, 12)):
            region = rng.choice(names)
            ranges = targets[region]
            start, end = rng.choice(ranges)
            if rng.random() < 0.5:
                live = 16 * max(undo_count, 1) if region == "undo" else LIVE_BYTES
                end = min(end, start + live)
            kind = rng.random()
            if kind < 0.4:
                at = rng.randrange(start, end)
                value = rng.randrange(1, 256)
                raw.map[at] ^= value
                done.append((region, at, "xor", value))
            elif kind < 0.55:
                at = rng.randrange(start, end)
                bit = 1 << rng.randrange(8)
                raw.map[at] ^= bit
                done.append((region, at, "bit", bit))
            else:
                first = (start + 3) // 4 * 4
                if first + 4 > end:
                    continue
                at = first + 4 * rng.randrange((end - first) // 4)
                value = rng.choice(INTERESTING)
                raw.map[at:at + 4] = struct.pack("<i", value)
                done.append((region, at, "set", value))
    return done


class Bad(Exception):
    """An operation's answer that does not look right."""


def expect(condition: bool, what: str) -> None:
    if not condition:
        raise Bad(what)


def check_pages(pages, num_pages: int, count: int, what: str) -> None:
    arr = np.asarray(pages)
    expect(arr.dtype == np.int32 and arr.ndim == 1 and len(arr) == count,
           f"{what}: {arr.dtype} shape {arr.shape}, expected {count} int32 pages")
    expect(not arr.size or (arr.min() >= 0 and arr.max() < num_pages),
           f"{what}: page index outside the pool: {arr.tolist()}")


def run_case(prefix: str, seed: int) -> dict:
    name = f"{prefix}-{seed}"
    rng = random.Random(seed)
    outcomes = {}
    bad = []
    cache, view, info = build(name, rng)
    num_pages = cache.config.num_pages
    state = {"cache": cache, "view": view, "fresh": None}
    try:
        flips = corrupt(name, cache, info, rng)
        print(f"FLIPS {seed} {json.dumps(flips)}", flush=True)

        def op(label, fn):
            try:
                fn()
                outcomes[label] = "ok"
            except Bad as exc:
                outcomes[label] = "BAD"
                bad.append(f"{label}: wrong-looking answer: {exc}")
            except LockTimeoutError as exc:
                # Nobody else uses the segment: a lock timeout is a lock left held, a hang
                # in disguise (the lock timeout is 2 s here, 10 s by default).
                outcomes[label] = "BAD"
                bad.append(f"{label}: the lock was left held: {exc}")
            except (HostKVError, ValueError) as exc:
                outcomes[label] = type(exc).__name__
            except BaseException as exc:  # noqa: BLE001 - what the test is looking for
                outcomes[label] = "BAD"
                bad.append(f"{label}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")

        def stats():
            s = cache.stats()
            expect(isinstance(s, hostkv.CacheStats), "stats: not a CacheStats")

        def match():
            for tokens, ns in [(SYS + [1, 2, 3, 4, 5], 0), (SYS[:8] + [50, 51, 52, 53, 54], 0),
                               (SYS2 + [9] * 5, NS2), (SYS2, 0), ([7] * 9, 2**63 + 1),
                               (list(range(1000, 1040)), 0)]:
                m = cache.match_prefix(tokens, ns)
                expect(m.num_tokens % PAGE == 0 and 0 <= m.num_tokens <= len(tokens),
                       f"match: {m.num_tokens} tokens of {len(tokens)}")
                check_pages(m.pages, num_pages, m.num_tokens // PAGE, "match")

        def old_append():
            view.append_tokens([3, 4], [14, 15])

        def old_commit():
            counts = view.commit([3, 4])
            expect(all(isinstance(c, int) and c >= 0 for c in counts), f"commit: {counts}")

        requests = [R(20, SYS + [1, 2, 3, 4, 90]), R(21, SYS2 + [9, 9, 9, 9, 91], NS2),
                    R(22, SYS[:4] + [92] * 7), R(23, [93] * 6, 5)]

        def fresh_alloc():
            fresh = WorkerView(cache)
            state["fresh"] = fresh
            allocs = fresh.allocate_pages_for_sequences_with_prefix(requests)
            expect(len(allocs) == len(requests), "allocate: wrong count")
            for a, r in zip(allocs, requests):
                n = len(r.tokens)
                expect(a.reused_tokens % PAGE == 0 and 0 <= a.reused_tokens < n,
                       f"allocate: reused {a.reused_tokens} of {n}")
                check_pages(a.page_table, num_pages, -(-n // PAGE), "allocate")

        def fresh_decode():
            fresh = state["fresh"]
            live = fresh.live_sequences
            for step in range(6):
                fresh.append_tokens(live, [None if (step + i) % 5 == 4 else 200 + step
                                           for i in range(len(live))])
            for seq_id in live:
                st = fresh.state(seq_id)
                check_pages(st.pages, num_pages, -(-st.num_tokens // PAGE), "decode")

        def fresh_commit():
            fresh = state["fresh"]
            counts = fresh.commit(fresh.live_sequences)
            expect(all(c >= 0 for c in counts), f"commit: {counts}")

        def fresh_release():
            fresh = state["fresh"]
            live = fresh.live_sequences
            fresh.release(live[:2], commit=True)
            fresh.release(live[2:], commit=False)

        def evict():
            n = cache.evict(3)
            expect(isinstance(n, int) and 0 <= n <= 3, f"evict(3) returned {n}")

        def reap():
            n = cache.reap()
            expect(isinstance(n, int) and 0 <= n <= cache.config.max_processes,
                   f"reap returned {n}")

        def attach():
            other = HostKVCache.attach(name, lock_timeout=2.0)
            try:
                other.stats()
                ov = WorkerView(other)
                allocs = ov.allocate_pages_for_sequences_with_prefix([R(30, SYS + [1, 2])])
                check_pages(allocs[0].page_table, num_pages, 5, "attach+allocate")
                ov.close()
            finally:
                other.close()

        def old_release():
            view.release([3, 4])

        def close_views():
            try:
                if state["fresh"] is not None:
                    state["fresh"].close()
            finally:
                view.close()

        def metrics():
            if hasattr(cache, "metrics"):
                cache.metrics()

        def leases():
            seg = cache._segment
            # Answers only: a flipped lease state makes even this process's slot read as
            # free (check() reports that as corruption).
            alive = [seg.lease_alive(slot) for slot in range(cache.config.max_processes)]
            expect(all(isinstance(a, bool) for a in alive), f"lease_alive answered {alive}")
            seg.leases()

        def pool():
            arr = cache.pages_array()
            try:
                expect(arr.shape == (num_pages, cache.config.page_bytes), f"pool {arr.shape}")
                arr[-1, -1] = arr[0, 0]
            finally:
                del arr

        def contents():
            # What `python -m hostkv inspect` and the crash tests read under the lock.
            seg = cache._segment
            tree, live = seg.run_locked(lambda: (_introspect.tree_contents(seg),
                                                 _sequences.live_sequences(seg)))
            for _namespace, tokens, pages, _locks in tree:
                expect(len(tokens) == PAGE * len(pages), "tree_contents: tokens and pages differ")
                check_pages(np.array(pages, dtype=np.int32), num_pages, len(pages), "tree_contents")
            for entry in live:
                check_pages(np.array(entry[4], dtype=np.int32), num_pages, len(entry[4]),
                            "live_sequences")

        op("stats", stats)
        op("contents", contents)
        op("metrics", metrics)
        op("leases", leases)
        op("pool", pool)
        op("check", cache.check)
        op("match", match)
        op("old_append", old_append)
        op("old_commit", old_commit)
        op("fresh_alloc", fresh_alloc)
        if rng.random() < 0.3:
            # A second round, while the fresh view holds sequences too.
            flips += corrupt(name, cache, info, rng)
            print(f"FLIPS {seed} {json.dumps(flips)}", flush=True)
        if outcomes["fresh_alloc"] == "ok":
            op("fresh_decode", fresh_decode)
            op("fresh_commit", fresh_commit)
            op("fresh_release", fresh_release)
        op("evict", evict)
        op("reap", reap)
        op("check_after_reap", cache.check)
        op("attach", attach)
        op("old_release", old_release)
        op("close_views", close_views)
        op("check_end", cache.check)
        op("close", cache.close)
    finally:
        try:
            cache.close()
        except BaseException:  # noqa: BLE001 - closing a corrupted segment may refuse
            pass
        try:
            HostKVCache.unlink_segment(name)
        except HostKVError:
            pass
    return {"flips": flips, "outcomes": outcomes, "bad": bad}


def main(argv: list) -> int:
    faulthandler.enable()
    prefix = argv[1]
    status = 0
    for seed in (int(s) for s in argv[2:]):
        print(f"START {seed}", flush=True)
        result = run_case(prefix, seed)
        if result["bad"]:
            status = 3
            print(f"BAD {seed} {json.dumps(result)}", flush=True)
        print(f"DONE {seed} {json.dumps(result)}", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv))
