"""hostkv._slab, the fixed-size record pools (radix nodes, sequences, page lists) on their own:
allocation from the free list, free, reuse (the record freed last is taken first), a full slab
refusing without a change, bad frees and corrupt free lists found as CorruptionError, the free
list rebuilt from the in-use flags by a rollback, and a death or an exception at every logged
store of a mutation leaving the slab as it was.

The allocator has only cdef callers; these tests drive it through its test hooks
(_slab._mutate, _state, _check), on the sequence-page slab: its records are reached only
through sequences' page lists, so records the tests hold disturb nothing else (the tree and
the lease sweep walk the other two slabs). Every test gives its records back before
cache.check(), which counts the page-list records in use. A pure-Python model of the free
list (SlabModel) says what each mutation must leave.
"""

from __future__ import annotations

import random
import struct
from typing import List, Optional, Sequence, Tuple

import numpy as np
import pytest

import hostkv
from hostkv import _slab
from conftest import small_config
from lib import crashlib
from lib.rawseg import LAYOUT, RawSegment

REGION = "reg_sequence_pages"
CAPACITY = 8                     # records in the page-list slab of these tests
Op = Tuple


@pytest.fixture
def cache(segment_name):
    """A small cache whose page-list slab has CAPACITY records."""
    c = hostkv.HostKVCache.create(segment_name,
                                  small_config(sequence_page_node_capacity=CAPACITY))
    try:
        yield c
    finally:
        c.close()


def mutate(cache: hostkv.HostKVCache, *ops: Op, commit: bool = True) -> list:
    """The ops in one mutation of the page-list slab (see _slab._mutate)."""
    return _slab._mutate(cache._segment, REGION, ops, commit)


def state(cache: hostkv.HostKVCache, region: str = REGION) -> dict:
    """The slab's header and records' slab fields, read under the lock."""
    return cache._segment.run_locked(_slab._state, cache._segment, region)


def check(cache: hostkv.HostKVCache, region: str = REGION) -> None:
    """The slab's own invariants (CorruptionError otherwise)."""
    cache._segment.run_locked(_slab._check, cache._segment, region)


def free_list(st: dict) -> List[int]:
    """The free list in order, from its head (at most capacity + 1 links: a cycle shows)."""
    out: List[int] = []
    at = st["free_head"]
    while at != -1 and len(out) <= st["capacity"]:
        out.append(at)
        at = st["next_free"][at]
    return out


def in_use(st: dict) -> List[int]:
    """The records whose in-use flag is set."""
    return [i for i, flag in enumerate(st["in_use"]) if flag]


def give_back(cache: hostkv.HostKVCache) -> None:
    """Frees every record in use, then checks the whole segment."""
    held = in_use(state(cache))
    if held:
        mutate(cache, *(("free", i) for i in held))
    assert state(cache)["used"] == 0
    cache.check()


class SlabModel:
    """The allocator's contract in Python: a LIFO free list beside the in-use flags.

    alloc takes the head; alloc_many takes the first `count` in list order, or nothing when
    fewer are free, and says 2 when the mutation has freed no record yet (the records it
    takes were free when the mutation began) and 1 otherwise; free pushes the record on the
    head. A rollback that undid any store rebuilds the list lowest index first."""

    def __init__(self, st: dict) -> None:
        self.free = free_list(st)
        self.used = set(in_use(st))

    def run(self, ops: Sequence[Op], commit: bool = True) -> list:
        """Applies ops as one mutation; returns what _slab._mutate must return."""
        free, used = list(self.free), set(self.used)
        results: list = []
        freed = logged = False
        for op in ops:
            if op[0] == "alloc":
                if not free:
                    results.append(-1)
                    continue
                index = free.pop(0)
                used.add(index)
                results.append(index)
                logged = True
            elif op[0] == "alloc_many":
                count = op[1]
                if count > len(free):
                    results.append(None)
                    continue
                taken, free = free[:count], free[count:]
                used.update(taken)
                # A count of 0 takes nothing and answers 1 (log everything) all the same.
                results.append((taken, 1 if freed or count <= 0 else 2))
                logged = logged or count > 0
            else:
                used.remove(op[1])
                free.insert(0, op[1])
                results.append(None)
                freed = logged = True
        if commit:
            self.free, self.used = free, used
        elif logged:
            self.free = sorted(set(range(CAPACITY)) - self.used)
        return results

    def assert_matches(self, st: dict) -> None:
        """The slab holds exactly the model's state, free-list order included."""
        assert set(in_use(st)) == self.used and st["used"] == len(self.used)
        assert free_list(st) == self.free


# -- allocation, free, reuse ---------------------------------------------------------------------


def test_each_slab_is_sized_by_the_config_and_starts_free(cache):
    config = cache.config
    expected = {"reg_radix_nodes": (config.radix_node_capacity, "HkvRadixNode"),
                "reg_sequences": (config.max_sequences, "HkvSequence"),
                "reg_sequence_pages": (CAPACITY, "HkvSeqPage")}
    for region, (capacity, record) in expected.items():
        st = state(cache, region)
        assert (st["capacity"], st["record_size"]) == (capacity, LAYOUT["sizes"][record])
        assert st["used"] == 0 and in_use(st) == []
        assert free_list(st) == list(range(capacity))      # lowest index first
        check(cache, region)


def test_alloc_takes_the_head_and_free_pushes_back(cache):
    assert mutate(cache, ("alloc",), ("alloc",), ("alloc",)) == [0, 1, 2]
    st = state(cache)
    assert in_use(st) == [0, 1, 2] and st["used"] == 3
    assert free_list(st) == [3, 4, 5, 6, 7]
    assert mutate(cache, ("free", 1)) == [None]
    assert free_list(state(cache)) == [1, 3, 4, 5, 6, 7]
    # Reuse: the record freed last is the next one taken.
    assert mutate(cache, ("alloc",)) == [1]
    mutate(cache, ("free", 2), ("free", 0))
    st = state(cache)
    assert in_use(st) == [1] and st["used"] == 1
    assert free_list(st) == [0, 2, 3, 4, 5, 6, 7]
    check(cache)
    give_back(cache)


def test_alloc_many_takes_in_list_order_and_says_when_its_stores_need_no_log(cache):
    # Nothing freed yet in the mutation: the records were free when it began (2).
    assert mutate(cache, ("alloc_many", 3)) == [([0, 1, 2], 2)]
    # A record freed earlier in the same mutation is taken again first: its rollback would
    # bring its old fields back in use, so every store into it must be logged (1).
    assert mutate(cache, ("free", 1), ("alloc_many", 2)) == [None, ([1, 3], 1)]
    # Freed by an earlier, committed mutation: free when this one began (2).
    mutate(cache, ("free", 3))
    assert mutate(cache, ("alloc_many", 1)) == [([3], 2)]
    st = state(cache)
    assert in_use(st) == [0, 1, 2, 3] and free_list(st) == [4, 5, 6, 7]
    check(cache)
    give_back(cache)


def test_the_allocator_matches_its_model(cache):
    """Seeded random mutations of one to four ops, a quarter of them rolled back: after each,
    every result, the in-use flags and the free list's order are the model's."""
    rng = random.Random(23)
    model = SlabModel(state(cache))
    for _ in range(300):
        ops: list = []
        used = set(model.used)
        for _ in range(rng.randint(1, 4)):
            kind = rng.choice(["alloc", "alloc_many", "free"])
            if kind == "free" and used:
                index = rng.choice(sorted(used))
                used.discard(index)
                ops.append(("free", index))
            elif kind == "alloc_many":
                ops.append(("alloc_many", rng.randint(0, 4)))
            else:
                ops.append(("alloc",))
        commit = rng.random() < 0.75
        expected = model.run(ops, commit)
        assert mutate(cache, *ops, commit=commit) == expected, ops
        model.assert_matches(state(cache))
        check(cache)
    give_back(cache)


# -- exhaustion and bad input --------------------------------------------------------------------


def test_a_full_slab_refuses_and_changes_nothing(cache):
    assert mutate(cache, ("alloc_many", CAPACITY)) == [(list(range(CAPACITY)), 2)]
    full = state(cache)
    assert full["used"] == CAPACITY and full["free_head"] == -1
    assert mutate(cache, ("alloc",)) == [-1]
    assert mutate(cache, ("alloc_many", 1)) == [None]
    assert state(cache) == full
    mutate(cache, ("free", 5), ("free", 2), ("free", 6))
    partly = state(cache)
    assert mutate(cache, ("alloc_many", 4)) == [None]       # more than are free: none taken
    assert state(cache) == partly
    assert mutate(cache, ("alloc_many", 3)) == [([6, 2, 5], 2)]
    check(cache)
    full = state(cache)
    assert in_use(full) == list(range(CAPACITY)) and full["free_head"] == -1

    # What the slab's callers make of its refusal: a WorkerView allocation whose page list
    # needs a record is a CapacityError naming the resource and the setting, and changes
    # nothing.
    stats = cache.stats()
    with hostkv.WorkerView(cache) as view:
        with pytest.raises(hostkv.CapacityError,
                           match="raise sequence_page_node_capacity") as info:
            view.allocate_pages_for_sequences_with_prefix(
                [hostkv.SequenceRequest(1, list(range(8)))])
        assert info.value.resource == "sequence page nodes"
        assert state(cache) == full
        after = cache.stats()
        assert (after.free_pages, after.active_sequences) == (stats.free_pages, 0)
        give_back(cache)
        view.allocate_pages_for_sequences_with_prefix(
            [hostkv.SequenceRequest(1, list(range(8)))])
        assert state(cache)["used"] == 1
        view.release([1])
    cache.check()


def test_bad_frees_are_corruption_and_undo_the_whole_mutation(cache):
    mutate(cache, ("alloc_many", 3))
    before = state(cache)
    with pytest.raises(hostkv.CorruptionError, match="record 5 freed twice"):
        mutate(cache, ("free", 0), ("free", 5))
    with pytest.raises(hostkv.CorruptionError, match=r"record index 8 outside \[0, 8\)"):
        mutate(cache, ("alloc",), ("free", CAPACITY))
    with pytest.raises(hostkv.CorruptionError, match=r"record index -1 outside \[0, 8\)"):
        mutate(cache, ("free", -1))
    st = state(cache)
    assert in_use(st) == in_use(before) == [0, 1, 2] and st["used"] == 3
    assert free_list(st) == [3, 4, 5, 6, 7]
    check(cache)
    with pytest.raises(ValueError, match="slab region must be"):
        _slab._state(cache._segment, "reg_pages")
    with pytest.raises(ValueError, match="slab op must be"):
        mutate(cache, ("take", 1))
    assert state(cache) == st
    give_back(cache)


# -- corrupt free lists, and the rebuild from the in-use flags -----------------------------------


def poke(cache: hostkv.HostKVCache, at: int, value: int) -> None:
    """Writes an int32 at offset `at` of the segment, behind hostkv's back."""
    with RawSegment(cache.name) as raw:
        struct.pack_into("<i", raw.map, at, value)


def slab_at(cache: hostkv.HostKVCache) -> int:
    return cache._segment.header_info()["regions"][REGION]


def next_free_at(cache: hostkv.HostKVCache, index: int) -> int:
    """The offset of record index's sr_next_free: HkvSlabRecord's first field (_layout.pxd),
    the first field of an HkvSeqPage."""
    record_size = LAYOUT["sizes"]["HkvSeqPage"]
    return (slab_at(cache) + LAYOUT["sizes"]["HkvSlab"] + index * record_size
            + LAYOUT["sequence_page"]["sp_slab"])


@pytest.mark.parametrize("damage, found", [
    ("head in use", r"record 1 is on the free list but in use"),
    ("head out of range", r"free list index 8 outside \[0, 8\)"),
    ("cycle", r"free list has a cycle"),
    ("used count", r"3 records in use, 5 free, header says 4 used of 8"),
])
def test_a_corrupt_free_list_is_found_and_a_rollback_rebuilds_it(cache, damage, found):
    mutate(cache, ("alloc_many", 3))
    good = state(cache)
    if damage == "head in use":
        poke(cache, slab_at(cache) + LAYOUT["slab"]["sl_free_head"], 1)
    elif damage == "head out of range":
        poke(cache, slab_at(cache) + LAYOUT["slab"]["sl_free_head"], CAPACITY)
    elif damage == "cycle":
        poke(cache, next_free_at(cache, 4), 3)          # 3 -> 4 -> 3 -> ...
    else:
        poke(cache, slab_at(cache) + LAYOUT["slab"]["sl_used"], 4)
    with pytest.raises(hostkv.CorruptionError, match=found):
        check(cache)
    if damage == "head in use":
        # Taking from it is refused too: a record in use is never handed out twice.
        with pytest.raises(hostkv.CorruptionError, match="record 1 is on the free list but in use"):
            mutate(cache, ("alloc",))
    # The in-use flags are the truth: a rollback (as recovery after a death does) rebuilds
    # the free list and the count from them.
    mutate(cache, ("free", 0), commit=False)
    st = state(cache)
    assert in_use(st) == in_use(good) and st["used"] == good["used"]
    assert free_list(st) == [3, 4, 5, 6, 7]
    check(cache)
    give_back(cache)


# -- crash consistency ---------------------------------------------------------------------------

# Mutations of a slab holding records 0, 1 and 3, its free list 4, 2, 5, 6, 7 (not in index
# order, as frees leave it, so that the rebuild by a recovery shows).
CRASH_CASES = {
    "alloc_many": [("alloc_many", 3)],
    "alloc twice": [("alloc",), ("alloc",)],
    "free twice": [("free", 0), ("free", 3)],
    "free then take it again": [("free", 1), ("alloc_many", 2)],
}


# The steps of each op: its logged stores (slab_alloc logs the head, the flag and the count;
# slab_alloc_many each flag, then the head and the count once; slab_free the flag, the link,
# the head and the count); a commit adds two (the generation's logged store, the commit).
STEPS = {"alloc": 3, "free": 4}
COMMIT_STEPS = 2


def steps_of(ops: Sequence[Op]) -> int:
    """The steps at which a crash point can fire in a mutation of ops, its commit included."""
    return COMMIT_STEPS + sum(op[1] + 2 if op[0] == "alloc_many" else STEPS[op[0]]
                              for op in ops)


def held_for_crash_tests(cache: hostkv.HostKVCache) -> dict:
    mutate(cache, ("alloc_many", 5))
    mutate(cache, ("free", 2))
    mutate(cache, ("free", 4))
    st = state(cache)
    assert in_use(st) == [0, 1, 3] and free_list(st) == [4, 2, 5, 6, 7]
    return st


def assert_as_before(st: dict, before: dict, what: str) -> None:
    """The records in use and the count as before; the free list exactly the free records,
    lowest first (rebuilt by the recovery)."""
    assert in_use(st) == in_use(before) and st["used"] == before["used"], what
    assert free_list(st) == sorted(set(range(CAPACITY)) - set(in_use(before))), what


@pytest.mark.parametrize("case", sorted(CRASH_CASES))
def test_a_death_at_every_step_leaves_the_slab_as_before(cache, case):
    """A forked child runs the mutation and _exits at logged store N, for N = 1, 2, ...; the
    parent's next lock replays the dead holder's undo log. Until the mutation completes the
    slab must be as before; the completed one must be what the model says."""
    ops = CRASH_CASES[case]
    before = held_for_crash_tests(cache)

    def op(child_cache, _ctx):
        _slab._mutate(child_cache._segment, REGION, ops)

    crashed = 0
    for step in range(1, crashlib.MAX_STEPS):
        round_start = state(cache)
        status = crashlib.run_in_child(cache.name, op, None, step)
        cache.reap()                                   # recovers, and frees the dead lease
        st = state(cache)
        check(cache)
        if status == 0:
            model = SlabModel(round_start)
            model.run(ops)
            model.assert_matches(st)
            break
        assert status == crashlib.CRASH_STATUS, f"child exited with {status} at step {step}"
        assert_as_before(st, before, f"{case} crashed at step {step}")
        crashed += 1
    else:
        pytest.fail(f"{case} never completed")
    # Every logged store was a step the child died at (its first lock's sweep may add more).
    assert crashed >= steps_of(ops)
    assert cache.stats().recoveries >= crashed
    give_back(cache)


@pytest.mark.parametrize("mode, exc", [("keyboard_interrupt", KeyboardInterrupt),
                                       ("memory_error", MemoryError)])
@pytest.mark.parametrize("case", sorted(CRASH_CASES))
def test_an_exception_at_every_step_leaves_the_slab_as_before(cache, case, mode, exc):
    """The same in a live process: an exception injected at step N unwinds through end(),
    which rolls the mutation back."""
    ops = CRASH_CASES[case]
    before = held_for_crash_tests(cache)
    seg = cache._segment
    for step in range(1, crashlib.MAX_STEPS):
        round_start = state(cache)
        seg._arm_crash_point(step, mode)
        try:
            results: Optional[list] = mutate(cache, *ops)
        except exc:
            results = None
        finally:
            seg._arm_crash_point(0)
        st = state(cache)
        check(cache)
        if results is not None:
            model = SlabModel(round_start)
            assert results == model.run(ops)
            model.assert_matches(st)
            break
        assert_as_before(st, before, f"{case} raised at step {step}")
    else:
        pytest.fail(f"{case} never completed")
    assert step - 1 >= steps_of(ops)
    give_back(cache)


def test_records_are_the_slab_records_of_the_layout(cache):
    """The hooks read the bytes the layout describes: the in-use flags _state reports are the
    int32 after each record's sr_next_free, as a raw read of the segment sees them."""
    mutate(cache, ("alloc_many", 3), ("free", 1))
    st = state(cache)
    size = LAYOUT["sizes"]["HkvSeqPage"]
    with RawSegment(cache.name) as raw:
        start = slab_at(cache) + LAYOUT["sizes"]["HkvSlab"]
        records = np.frombuffer(raw.read(start, start + CAPACITY * size), np.int32)
    fields = records.reshape(CAPACITY, size // 4)[:, :2]
    assert fields[:, 0].tolist() == st["next_free"]
    assert fields[:, 1].tolist() == st["in_use"] == [1, 0, 1, 0, 0, 0, 0, 0]
    give_back(cache)
