"""Crash at every step of the worker view's batch operations: allocate, append, commit,
release, and the reaping of a dead process's sequences."""

from __future__ import annotations

import pytest

import hostkv
from hostkv import _radix, _sequences

import crashlib
from conftest import small_config
from crashlib import crash_every_step

PAGE = 4
SYSTEM = list(range(100, 112))          # three full pages shared by every request


@pytest.fixture(autouse=True)
def sequence_snapshots(monkeypatch):
    """Snapshots with the tree and the live sequences; exact reference accounting; no
    cumulative counters (every round's setup allocates afresh)."""
    monkeypatch.setitem(crashlib.OPTIONS, "exact_references", True)
    monkeypatch.setitem(crashlib.OPTIONS, "counters", False)
    monkeypatch.setitem(crashlib.EXTRA_STATE, "tree", lambda seg: frozenset(_radix.tree_contents(seg)))
    monkeypatch.setitem(crashlib.EXTRA_STATE, "sequences",
                        lambda seg: frozenset((s[2], s[3], s[4]) for s in _sequences.live_sequences(seg)))


@pytest.fixture
def view_cache(segment_name):
    cache = hostkv.HostKVCache.create(
        segment_name, small_config(num_pages=24, page_size=PAGE, radix_node_capacity=8))
    # Cache the system prompt once, from a sequence of this process.
    with hostkv.WorkerView(cache) as view:
        view.allocate_pages_for_sequences_with_prefix([hostkv.SequenceRequest(0, SYSTEM + [1])])
        view.release([0])
    yield cache
    cache.close()


def requests():
    return [hostkv.SequenceRequest(1, SYSTEM[:8] + [7, 7, 7]),      # borrows 2 pages: a split
            hostkv.SequenceRequest(2, SYSTEM + [5, 6, 7, 8, 9]),
            hostkv.SequenceRequest(3, [1, 2, 3])]


def allocate_op(cache, ctx):
    hostkv.WorkerView(cache).allocate_pages_for_sequences_with_prefix(requests())


def allocated_view(cache):
    view = hostkv.WorkerView(cache)
    view.allocate_pages_for_sequences_with_prefix(requests())
    return view


def decoded_view(cache):
    view = allocated_view(cache)
    view.append_tokens([1, 2, 3], [11, 12, None])
    return view


def append_op(cache, view):
    # decoded_view left 12, 18 and 4 tokens: sequences 1 and 3 need a page for this one.
    view.append_tokens([1, 2, 3], [21, 22, 23])


def commit_op(cache, view):
    view.commit([1, 2, 3])


def release_op(cache, view):
    view.release([1, 2, 3], commit=True)


def test_batch_allocate_crash_at_every_step(view_cache):
    steps = crash_every_step(view_cache, allocate_op)
    assert steps > 50


def test_append_crash_at_every_step(view_cache):
    steps = crash_every_step(view_cache, append_op, setup=decoded_view)
    assert steps > 10


def test_commit_crash_at_every_step(view_cache):
    steps = crash_every_step(view_cache, commit_op, setup=decoded_view)
    assert steps > 30


def test_release_crash_at_every_step(view_cache):
    steps = crash_every_step(view_cache, release_op, setup=decoded_view)
    assert steps > 50


def test_reap_of_dead_sequences_crash_at_every_step(view_cache):
    """The sweep that releases a dead process's sequences, crashed at every step."""
    for step in range(1, 500):
        # A child that allocates sequences and dies: its lease and sequences are garbage.
        assert crashlib.run_in_child(view_cache.name, None, None, 0, setup=decoded_view) == 0
        # An armed child whose attach sweeps it (env-armed so attach's steps count).
        status = crashlib.run_in_child(view_cache.name, lambda c, _: None, None, step,
                                       env_crash=True)
        view_cache.reap()
        view_cache.check()
        assert view_cache.stats().active_sequences == 0
        if status == 0:
            break
        assert status == crashlib.CRASH_STATUS
    else:
        raise AssertionError("the sweep never completed")
    assert step > 30


@pytest.mark.parametrize("mode", ["keyboard_interrupt", "memory_error"])
def test_exceptions_mid_batch_roll_back(view_cache, mode):
    before = crashlib.snapshot(view_cache)
    for step in range(1, 1000):
        view_cache._segment._arm_crash_point(step, mode)
        view = hostkv.WorkerView(view_cache)
        try:
            view.allocate_pages_for_sequences_with_prefix(requests())
        except (KeyboardInterrupt, MemoryError):
            view_cache._segment._arm_crash_point(0)
            assert crashlib.snapshot(view_cache) == before
            continue
        view_cache._segment._arm_crash_point(0)
        view.release([1, 2, 3], commit=False)
        break
    assert step > 50
