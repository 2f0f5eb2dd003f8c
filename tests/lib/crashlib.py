"""Crash at every step: run a mutation in a forked child that dies at logged store N.

The compiled core counts every logged store (and each commit) of a mutation as a step; an
armed Segment `_exit`s with status 77 at step N (or raises, in a live process). For N = 1,
2, ... a child attaches, arms, runs the operation and dies; the parent then recovers (its next
lock sees EOWNERDEAD), runs check(), and requires the state to equal the state before the
operation. The loop ends at the first N the operation survives, whose result must be the
state after it. That is SQLite's and Samba tdb's crash-test method.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional

import numpy as np

import hostkv
from hostkv import _introspect, _pages, _segment, _sequences

from conftest import run_in_fork
from lib.rawseg import LAYOUT, RawSegment

CRASH_STATUS = 77

# A forked child's handles live until its os._exit, as a killed process's would: none is
# closed (no lease given back, no sequence released) on the way out.
_HELD_BY_CHILD: list = []
MAX_STEPS = 10_000


@dataclass(frozen=True)
class Snapshot:
    """The semantic state of a segment: what must be identical before and after a crash."""

    refcounts: bytes
    free_pages: int
    live_leases: frozenset
    pages_allocated: int
    pages_freed: int
    extra: tuple = ()
    # Window parts: each page's part (-1 none), the free count and the counters. Which part
    # a page has is compared too: recovery restores links, never reassigns them.
    parts: tuple = ()

    def differences(self, other: "Snapshot") -> str:
        out = []
        for field in ("free_pages", "live_leases", "pages_allocated", "pages_freed", "extra",
                      "parts"):
            if getattr(self, field) != getattr(other, field):
                out.append(f"{field}: {getattr(self, field)!r} != {getattr(other, field)!r}")
        if self.refcounts != other.refcounts:
            a = np.frombuffer(self.refcounts, np.int32)
            b = np.frombuffer(other.refcounts, np.int32)
            idx = np.nonzero(a != b)[0][:8]
            out.append(f"refcounts differ at pages {idx.tolist()}: {a[idx].tolist()} != {b[idx].tolist()}")
        return "; ".join(out)


# Later layers (tree, sequences) add their state here: name -> fn(segment) -> hashable.
EXTRA_STATE: Dict[str, Callable] = {}

# Tests of the lower layers hold raw page references (outside any sequence), so by default
# check() only requires refcounts to be at least what the tree and sequences hold.
# "counters": compare the cumulative page counters too (off when each round's setup step
# allocates afresh, as the sequence tests' do).
OPTIONS = {"exact_references": False, "counters": True}


def snapshot(cache: hostkv.HostKVCache) -> Snapshot:
    """Reaps dead leases, checks every invariant, then captures the state under the lock."""
    cache.reap()
    cache.check(exact_references=OPTIONS["exact_references"])
    seg = cache._segment

    def capture():
        info = seg.header_info()
        leases = frozenset((slot, gen) for slot, state, _pid, gen, _t in seg.leases())
        extra = tuple((key, fn(seg)) for key, fn in sorted(EXTRA_STATE.items()))
        return Snapshot(
            refcounts=_pages.refcounts(seg).tobytes(),
            free_pages=info["free_pages"],
            live_leases=leases,
            pages_allocated=info["stats"]["st_pages_allocated"] if OPTIONS["counters"] else 0,
            pages_freed=info["stats"]["st_pages_freed"] if OPTIONS["counters"] else 0,
            extra=extra,
            parts=part_state(seg, info),
        )

    return seg.run_locked(capture)


def part_state(seg, info) -> tuple:
    """The window parts' semantic state (call with the lock held): each page's part, the
    free count, and the counters (those only with OPTIONS["counters"])."""
    page_part, _ = _pages.part_links(seg)
    parts = info["parts"]
    counters = (parts["pt_parts_allocated"], parts["pt_parts_freed"], parts["pt_parts_donated"],
                parts["pt_pages_without_part"], parts["pt_parts_evicted"]
                ) if OPTIONS["counters"] else ()
    # Each node's part count too. Its LRU key is not compared: the key is lazy (an eviction
    # re-keys a stale one to the node's last access before taking anything, so the order
    # parts go in is the tree's recency, which lru_state compares), and recovery may park
    # or re-key a locked node where a clean run would not; check() requires every key to
    # be at most its node's last access.
    lru = frozenset((first_page, count) for first_page, count, _
                    in _introspect.part_lru_state(seg))
    return (page_part.tobytes(), parts["pt_free_parts"], parts["pt_tree_parts"], counters, lru)


def lru_state(seg) -> tuple:
    """The LRU clock and every cached node's last-access stamp, read from the raw bytes
    (call with the lock held). A node is named by its first page (a page is in one node at
    most), not by its record. Each round of a crash test's setup touches the tree (moving
    the clock) the same way, so absolute stamps differ from round to round; what is
    compared is the order of the stamps (each node's dense rank, oldest 0) and how far the
    clock is ahead of the newest stamp: a crash that left the clock moved without the
    touch, or a touch without the clock, changes one of them."""
    info = seg.header_info()
    start = info["regions"]["reg_radix_nodes"]
    slab, node = LAYOUT["slab"], LAYOUT["radix_node"]
    with RawSegment(seg.name) as raw:
        head = np.frombuffer(raw.read(start, start + LAYOUT["sizes"]["HkvSlab"]), np.int32)
        capacity = int(head[slab["sl_capacity"] // 4])
        size = int(head[slab["sl_record_size"] // 4])
        records = raw.read(start + LAYOUT["sizes"]["HkvSlab"],
                           start + LAYOUT["sizes"]["HkvSlab"] + capacity * size)
    nodes = set()
    in_use_at = node["rn_slab"] + 4                     # HkvSlabRecord.sr_in_use
    for i in range(capacity):
        rec = records[i * size:(i + 1) * size]
        if int.from_bytes(rec[in_use_at:in_use_at + 4], "little") != 1:
            continue

        def field(name, width):
            at = node[name]
            return int.from_bytes(rec[at:at + width], "little", signed=True)

        nodes.add((field("rn_first_page", 4), field("rn_num_pages", 4),
                   field("rn_last_access", 8)))
    stamps = sorted({stamp for _, _, stamp in nodes})
    rank = {stamp: i for i, stamp in enumerate(stamps)}
    ahead = info["radix"]["rt_tick"] - (stamps[-1] if stamps else 0)
    return (ahead, frozenset((first, count, rank[stamp]) for first, count, stamp in nodes))


def unreaped_snapshot(name: str) -> tuple:
    """The state as a dead process left it, before anyone reaps it: an observer (which never
    sweeps) takes the lock, recovering a dead holder's log, checks every invariant (exact
    references where OPTIONS says so), and captures the free count, how many leases are
    taken, the tree, the LRU ages and the sequences of every lease, the dead one's
    included. Each round of a crash test's setup is handed other page numbers (reaping
    returns pages to the free stack in another order), so the sequences are compared by
    (id, namespace, own pages' count) and the refcounts as a sorted multiset; the check
    ties them to the pages. Lease slots and generations differ from one child to the next,
    so only their number is compared."""
    observer = hostkv.HostKVCache.attach(name, lease=False)
    try:
        return observer._segment.run_locked(capture_unreaped, observer)
    finally:
        observer.close()


def capture_unreaped(cache: hostkv.HostKVCache) -> tuple:
    """unreaped_snapshot's capture, for a caller that holds the lock already."""
    seg = cache._segment
    cache._check_locked(OPTIONS["exact_references"])
    info = seg.header_info()
    sequences = frozenset((s[2], s[3], len(s[4])) for s in _sequences.live_sequences(seg))
    return (tuple(sorted(_pages.refcounts(seg).tolist())), info["free_pages"],
            len(seg.leases()), frozenset(_introspect.tree_contents(seg)), lru_state(seg), sequences)


def run_in_child(name: str, op: Optional[Callable], ctx, crash_at: int, env_crash: bool = False,
                 setup: Optional[Callable] = None) -> int:
    """Forks; the child attaches, runs setup(cache) unarmed (its result replaces ctx), arms
    the crash point, runs op(cache, ctx). Returns its exit status. op None: setup only.

    With env_crash every new handle of the child is armed (_segment._arm_new_segments)
    before attach, so the steps of attach itself (registration, recovery, sweep) count too.
    """
    def child() -> int:
        if env_crash:
            _segment._arm_new_segments(crash_at)
        cache = hostkv.HostKVCache.attach(name)
        context = setup(cache) if setup is not None else ctx
        if not env_crash:
            cache._segment._arm_crash_point(crash_at)
        _HELD_BY_CHILD.append((cache, context))
        if op is not None:
            op(cache, context)
        cache._segment._arm_crash_point(0)
        return 0

    return run_in_fork(child)


def run_observer_in_child(name: str, action: Callable, crash_at: int) -> int:
    """Forks; the child attaches as an observer (no lease taken, no sweep on its own), arms
    the crash point through _arm_crash_point and runs action(segment): the steps counted
    are action's alone (a sweep by seg.reap(), a registration by seg._register_lease()).
    Returns its exit status."""
    def child() -> int:
        observer = hostkv.HostKVCache.attach(name, lease=False)
        _HELD_BY_CHILD.append(observer)
        observer._segment._arm_crash_point(crash_at)
        action(observer._segment)
        observer._segment._arm_crash_point(0)
        return 0

    return run_in_fork(child)


def crash_every_step(
    cache: hostkv.HostKVCache,
    op: Callable,
    ctx=None,
    expect_after: Optional[Callable[[Snapshot, Snapshot], Optional[str]]] = None,
    env_crash: bool = False,
    setup: Optional[Callable] = None,
    unreaped: bool = False,
) -> int:
    """Crashes `op` at step 1, 2, ... until it completes; returns how many steps it crashed at.

    After each death, the parent's next lock recovers; the state must equal the state before.
    With setup, each child first runs setup(cache) (whose result is op's ctx) unarmed; the
    state "before" is then that of a child that ran setup and died (and was reaped).
    expect_after(before, after) returns None if the completed operation's result is right,
    else a description of what is wrong.

    With unreaped, each crashed child's state is also compared before it is reaped (the
    sequences it held, as setup left them): reaping releases whatever a dead process held,
    so after the reap a record the recovery left wrong could look the same as a right one.
    """
    before_unreaped = None
    if setup is not None or unreaped:
        assert run_in_child(cache.name, None, None, 0, setup=setup) == 0
        if unreaped:
            before_unreaped = unreaped_snapshot(cache.name)
    before = snapshot(cache)
    recoveries = cache.stats().recoveries
    for step in range(1, MAX_STEPS):
        status = run_in_child(cache.name, op, ctx, step, env_crash=env_crash, setup=setup)
        if before_unreaped is not None and status == CRASH_STATUS:
            after_crash_unreaped = unreaped_snapshot(cache.name)
        state = snapshot(cache)
        if status == 0:
            if expect_after is not None:
                problem = expect_after(before, state)
                assert problem is None, f"after a completed {op.__name__}: {problem}"
            return step - 1
        assert status == CRASH_STATUS, f"child exited with {status} at step {step}"
        assert state == before, f"{op.__name__} crashed at step {step}: {before.differences(state)}"
        if before_unreaped is not None:
            assert after_crash_unreaped == before_unreaped, (
                f"{op.__name__} crashed at step {step}: the dead process's state before reaping "
                "differs from what setup left")
        assert cache.stats().recoveries >= recoveries
    raise AssertionError(f"{op.__name__} never completed within {MAX_STEPS} steps")


def raise_every_step(cache: hostkv.HostKVCache, op: Callable, ctx, mode: str) -> int:
    """Injects an exception (mode: keyboard_interrupt / memory_error) at every step in this
    process; each must leave the state exactly as before. Returns the steps tried."""
    expected_exc = KeyboardInterrupt if mode == "keyboard_interrupt" else MemoryError
    before = snapshot(cache)
    for step in range(1, MAX_STEPS):
        cache._segment._arm_crash_point(step, mode)
        try:
            op(cache, ctx)
        except expected_exc:
            cache._segment._arm_crash_point(0)
            state = snapshot(cache)
            assert state == before, f"{op.__name__} raised at step {step}: {before.differences(state)}"
            continue
        finally:
            cache._segment._arm_crash_point(0)
        return step - 1
    raise AssertionError(f"{op.__name__} never completed within {MAX_STEPS} steps")
