"""Crash at every step: run a mutation in a forked child that dies at logged store N.

The compiled core counts every logged store (and each commit) of a mutation as a step; an
armed Segment `_exit`s with status 77 at step N (or raises, in a live process). For N = 1,
2, ... a child attaches, arms, runs the operation and dies; the parent then recovers (its next
lock sees EOWNERDEAD), runs check(), and requires the state to equal the state before the
operation. The loop ends at the first N the operation survives, whose result must be the
state after it. That is SQLite's and Samba tdb's crash-test method.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Dict, Optional

import numpy as np

import hostkv
from hostkv import _pages, _segment

CRASH_STATUS = 77
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

    def differences(self, other: "Snapshot") -> str:
        out = []
        for field in ("free_pages", "live_leases", "pages_allocated", "pages_freed", "extra"):
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
        )

    return seg.run_locked(capture)


def run_in_child(name: str, op: Optional[Callable], ctx, crash_at: int, env_crash: bool = False,
                 setup: Optional[Callable] = None) -> int:
    """Forks; the child attaches, runs setup(cache) unarmed (its result replaces ctx), arms
    the crash point, runs op(cache, ctx). Returns its exit status. op None: setup only.

    With env_crash every new handle of the child is armed (_segment._arm_new_segments)
    before attach, so the steps of attach itself (registration, recovery, sweep) count too.
    """
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        status = 1
        try:
            if env_crash:
                _segment._arm_new_segments(crash_at)
            cache = hostkv.HostKVCache.attach(name)
            if setup is not None:
                ctx = setup(cache)
            if not env_crash:
                cache._segment._arm_crash_point(crash_at)
            if op is not None:
                op(cache, ctx)
            cache._segment._arm_crash_point(0)
            status = 0
        except BaseException:  # noqa: BLE001 - report through the exit status
            import traceback

            traceback.print_exc()
            status = 2
        finally:
            os._exit(status)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def crash_every_step(
    cache: hostkv.HostKVCache,
    op: Callable,
    ctx=None,
    expect_after: Optional[Callable[[Snapshot, Snapshot], Optional[str]]] = None,
    env_crash: bool = False,
    setup: Optional[Callable] = None,
) -> int:
    """Crashes `op` at step 1, 2, ... until it completes; returns how many steps it crashed at.

    After each death, the parent's next lock recovers; the state must equal the state before.
    With setup, each child first runs setup(cache) (whose result is op's ctx) unarmed; the
    state "before" is then that of a child that ran setup and died (and was reaped).
    expect_after(before, after) returns None if the completed operation's result is right,
    else a description of what is wrong.
    """
    if setup is not None:
        assert run_in_child(cache.name, None, None, 0, setup=setup) == 0
    before = snapshot(cache)
    recoveries = cache.stats().recoveries
    for step in range(1, MAX_STEPS):
        status = run_in_child(cache.name, op, ctx, step, env_crash=env_crash, setup=setup)
        state = snapshot(cache)
        if status == 0:
            if expect_after is not None:
                problem = expect_after(before, state)
                assert problem is None, f"after a completed {op.__name__}: {problem}"
            return step - 1
        assert status == CRASH_STATUS, f"child exited with {status} at step {step}"
        assert state == before, f"{op.__name__} crashed at step {step}: {before.differences(state)}"
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
