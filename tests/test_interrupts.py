"""Stale sequence records and interrupted calls.

The compiled layer names a sequence by (record, sequence id, record generation) and checks
all three on every use, so a stale name is a SequenceError and never touches a record that
another view was given since. A WorkerView's bookkeeping changes with the compiled call or
not at all: an exception that lands between the two (a KeyboardInterrupt) leaves the view
unsettled, and its next call reads its records back from the segment first.

The interrupts are injected deterministically: by wrapping the real compiled entry point
(it runs, then the wrapper raises), and by a trace function that raises KeyboardInterrupt
at the k-th line the view executes, for every k until the call completes.
"""

from __future__ import annotations

import sys

import pytest

import hostkv
from hostkv import (
    SequenceError, SequenceRequest as R, WorkerView, _sequences, _viewstate, worker_view)

from conftest import small_config
from lib.rawseg import MetadataSnapshot

PS = 4
SYS = list(range(100, 112))             # three full pages, cached by the fixture


@pytest.fixture
def icache(segment_name):
    cache = hostkv.HostKVCache.create(segment_name, small_config(num_pages=48, page_size=PS))
    with WorkerView(cache) as view:
        view.allocate_pages_for_sequences_with_prefix([R(0, SYS + [1])])
        view.release([0])
    yield cache
    cache.close()


def interrupted_after(monkeypatch, name: str) -> None:
    """Makes _sequences.<name> run for real, then raise KeyboardInterrupt (as a Ctrl-C that
    arrives just as the compiled call returns). The names are the view's calls: each maps
    to the compiled call it makes (which also checks its requests, plans its commits or
    steps its sequences)."""
    name = {"allocate": "allocate_requests", "append": "append_tokens",
            "commit": "commit_view_sequences", "release": "release_sequences"}[name]
    real = getattr(_sequences, name)

    def call_then_interrupt(*args):
        real(*args)
        raise KeyboardInterrupt(f"injected after _sequences.{name} returned")

    monkeypatch.setattr(_sequences, name, call_then_interrupt)


def segment_sequences(cache):
    """(lease slot, seq id, namespace, own pages) of every live sequence in the segment."""
    seg = cache._segment
    return sorted((s[1], s[2], s[3], s[4]) for s in seg.run_locked(_sequences.live_sequences, seg))


def test_a_stale_release_cannot_release_another_views_sequence(icache, monkeypatch):
    """The case that made records carry a generation: A's release is interrupted after the
    compiled release returned; B is given A's old record; A.close() must not release B's
    sequence, C must not be given B's pages, and B's release must not free C's."""
    a, b, c = WorkerView(icache), WorkerView(icache), WorkerView(icache)
    a.allocate_pages_for_sequences_with_prefix([R(7, SYS + [1, 2, 3])])
    record = a._sequences[7].record
    interrupted_after(monkeypatch, "release")
    with pytest.raises(KeyboardInterrupt):
        a.release([7], commit=False)
    monkeypatch.undo()
    b_alloc = b.allocate_pages_for_sequences_with_prefix([R(7, SYS + [4, 5, 6])])[0]
    assert b._sequences[7].record == record         # the record A still names is B's now
    b_pages = b_alloc.page_table.tolist()
    a.close()                                         # must not touch B's sequence
    assert [s[1] for s in segment_sequences(icache)] == [7]
    c_alloc = c.allocate_pages_for_sequences_with_prefix([R(8, [9] * 40)])[0]
    own_b = set(b_pages[b_alloc.num_shared_pages:])
    assert not own_b & set(c_alloc.page_table.tolist()), "C was handed B's pages"
    icache.check()
    b.release([7], commit=False)
    assert [s[1] for s in segment_sequences(icache)] == [8]   # C's sequence survived B's release
    icache.check()
    c.close()
    b.close()
    assert icache.stats().active_sequences == 0
    icache.check()


@pytest.mark.parametrize("entry", ["commit", "release", "append_tokens"])
def test_the_compiled_layer_refuses_a_stale_name_and_changes_nothing(icache, entry):
    view = WorkerView(icache)
    view.allocate_pages_for_sequences_with_prefix([R(3, SYS + [1, 2, 3, 4])])
    seq = view._sequences[3]
    seg = icache._segment
    tokens, pages = seq.tokens, seq.pages
    stale = [(seq.record, 3, seq.generation - 1), (seq.record, 4, seq.generation)]
    icache.reap()
    snap = MetadataSnapshot(icache)
    before = snap.take()
    for record, seq_id, generation in stale:
        with pytest.raises(SequenceError, match="released|record now holds"):
            if entry == "append_tokens":
                # 16 tokens in 4 full pages: the step takes a page, under the stale name.
                stale_seq = _viewstate.ViewSequence(seq_id, record, generation, 0,
                                                    tokens.copy(), 0, 0, pages.copy())
                _sequences.append_tokens(seg, [stale_seq], [5], PS)
            else:
                getattr(_sequences, entry)(seg, [record], [seq_id], [generation], [tokens],
                                           [pages], [4], [0])
    assert not snap.diff(before, snap.take())
    # A free record is "released already", not corruption.
    view.release([3])
    with pytest.raises(SequenceError, match="not live"):
        _sequences.release(seg, [seq.record], [3], [seq.generation], [tokens], [pages], [0], [0])
    view.close()
    icache.check()


@pytest.mark.parametrize("entry", ["allocate", "append", "commit", "release"])
def test_an_interrupt_after_each_compiled_call_settles(icache, monkeypatch, entry):
    view = WorkerView(icache)
    view.allocate_pages_for_sequences_with_prefix([R(1, SYS + [1, 2, 3, 4]), R(2, [5, 6, 7])])
    interrupted_after(monkeypatch, entry)
    with pytest.raises(KeyboardInterrupt):
        if entry == "allocate":
            view.allocate_pages_for_sequences_with_prefix([R(3, SYS + [8]), R(4, [9])])
        elif entry == "append":
            view.append_tokens([1, 2], [10, 11])     # sequence 1 needs a page, 2 does not
        elif entry == "commit":
            view.commit([1])
        else:
            view.release([1, 2])
    monkeypatch.undo()
    assert_agrees(icache, view)
    if entry == "allocate":
        # Undone whole: the caller never got the allocations, and may ask again.
        assert sorted(view.live_sequences) == [1, 2]
        assert sorted(s[1] for s in segment_sequences(icache)) == [1, 2]
        view.allocate_pages_for_sequences_with_prefix([R(3, SYS + [8]), R(4, [9])])
    elif entry == "append":
        # The compiled call did the step's bookkeeping itself: the step happened whole.
        assert view.state(1).num_tokens == 17 and view.state(2).num_tokens == 4
        assert len(view.page_table(1)) == 5 and view.state(1).tokens[-1] == 10
        assert view.state(2).tokens[-1] == 11
    elif entry == "commit":
        assert view.commit([1]) == [4]
    else:
        assert view.live_sequences == []
        assert segment_sequences(icache) == []
    assert_agrees(icache, view)
    view.close()
    assert icache.stats().active_sequences == 0
    icache.check()


def assert_agrees(cache, view) -> None:
    """The view's bookkeeping names exactly the segment's records of this view."""
    live = view.live_sequences                         # settles first
    held = {r: (g, s, p) for r, g, s, p in _sequences.view_sequences(cache._segment, view._number)}
    assert sorted(s for _, s, _ in held.values()) == sorted(live)
    for seq_id in live:
        seq = view._sequences[seq_id]
        generation, held_id, pages = held[seq.record]
        assert (generation, held_id) == (seq.generation, seq_id)
        own = seq.reused_tokens // PS
        assert view.page_table(seq_id)[own:].tolist() == pages
        assert len(view.page_table(seq_id)) >= -(-view.state(seq_id).num_tokens // PS)
    cache.check()


def interrupt_at_line(k: int, call) -> bool:
    """Runs call() with a KeyboardInterrupt raised at the k-th line executed in
    worker_view.py. Returns True if the call completed first."""
    count = 0
    target = worker_view.__file__

    def local(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
            if count == k:
                raise KeyboardInterrupt(f"injected at line {frame.f_lineno}")
        return local

    def tracer(frame, event, arg):
        return local if frame.f_code.co_filename == target else None

    sys.settrace(tracer)
    try:
        call()
    finally:
        sys.settrace(None)
    return count < k


OPERATIONS = {
    "allocate": lambda v: v.allocate_pages_for_sequences_with_prefix(
        [R(3, SYS + [8, 8]), R(4, SYS[:8] + [9]), R(5, [1])]),
    "append": lambda v: v.append_tokens([1, 2], [10, None]),
    "commit": lambda v: v.commit([1, 2]),
    "release": lambda v: v.release([1, 2]),
}


@pytest.mark.parametrize("op", sorted(OPERATIONS))
def test_an_interrupt_at_every_line_leaves_the_view_as_before_or_after(icache, op):
    """Whichever line of the view the interrupt lands on, the view (after settling) and the
    segment agree, and the call happened whole or not at all."""
    completed = False
    k = 0
    while not completed:
        k += 1
        view = WorkerView(icache)
        view.allocate_pages_for_sequences_with_prefix(
            [R(1, SYS + [1, 2, 3, 4]), R(2, SYS[:8] + [6, 7, 8])])
        before = {s: view.state(s) for s in view.live_sequences}
        try:
            completed = interrupt_at_line(k, lambda: OPERATIONS[op](view))
        except KeyboardInterrupt:
            pass
        assert_agrees(icache, view)
        live = set(view.live_sequences)
        if op == "allocate":
            assert live in ({1, 2}, {1, 2, 3, 4, 5}), (k, live)
        elif op == "release":
            assert live in ({1, 2}, set()), (k, live)
        else:
            assert live == {1, 2}
        if op == "append":
            steps = {view.state(s).num_tokens - before[s].num_tokens for s in live}
            assert steps in ({0}, {1}), (k, steps)
        view.close()
        assert icache.stats().active_sequences == 0
        icache.check()
        assert k < 2000
    print(f"{op}: interrupted at {k - 1} lines")
    assert k > 10


SETTLED_AFTER = {
    # entry interrupted -> (the call, the live ids once settled)
    "allocate": (lambda v: v.allocate_pages_for_sequences_with_prefix(
        [R(3, SYS + [8, 8]), R(4, [1])]), {1, 2}),
    "append": (lambda v: v.append_tokens([1, 2], [10, 11]), {1, 2}),
    "release": (lambda v: v.release([1, 2]), set()),
}


@pytest.mark.parametrize("entry", sorted(SETTLED_AFTER))
def test_settling_is_idempotent_when_interrupted_itself(icache, monkeypatch, entry):
    """An interrupt inside the settling (at every line of it) leaves it to the next call,
    which settles the same way."""
    call, expected = SETTLED_AFTER[entry]
    k = 0
    completed = False
    while not completed:
        k += 1
        view = WorkerView(icache)
        view.allocate_pages_for_sequences_with_prefix(
            [R(1, SYS + [1, 2, 3, 4]), R(2, [5, 6, 7])])
        before = {s: view.state(s).num_tokens for s in (1, 2)}
        interrupted_after(monkeypatch, entry)
        with pytest.raises(KeyboardInterrupt):
            call(view)
        monkeypatch.undo()
        try:
            completed = interrupt_at_line(k, lambda: view.live_sequences)
        except KeyboardInterrupt:
            pass
        assert_agrees(icache, view)                 # settles again, to the same end
        assert set(view.live_sequences) == expected, (k, view.live_sequences)
        if entry == "append":                      # the step happened whole
            assert {s: view.state(s).num_tokens - 1 for s in (1, 2)} == before
        view.close()
        assert icache.stats().active_sequences == 0
        icache.check()
        assert k < 2000
    assert k > 10
