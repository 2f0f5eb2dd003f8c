"""HostKVCache.eviction_candidates and WorkerView.hold_cached_pages: the two core calls a tier
uses to write pages out just before they are evicted (hostkv.remote's write_policy="evict").

eviction_candidates must list exactly what eviction takes next, in order, and change
nothing; a hold must keep pages from eviction while changing nothing else that decides
eviction (no recency, no stats, no fresh page, no eviction of its own). Both are checked
against the core's real eviction; the hold's mutation is crashed at every step.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

import hostkv
from hostkv import _introspect, _sequences
from hostkv.errors import CapacityError, SequenceError

from lib import crashlib
from conftest import small_config
from lib.rawseg import MetadataSnapshot
from lib.crashlib import crash_every_step, snapshot

PAGE = 4


def cached_tree(cache):
    return cache._segment.run_locked(_introspect.tree_contents, cache._segment)


def lru(cache):
    return cache._segment.run_locked(crashlib.lru_state, cache._segment)


def fill(cache, prompts, namespace=0):
    """Commits each prompt (its full pages) from one sequence, one after the other."""
    with hostkv.WorkerView(cache) as view:
        for seq_id, prompt in enumerate(prompts):
            view.allocate_pages_for_sequences_with_prefix(
                [hostkv.SequenceRequest(seq_id, list(prompt) + [1], namespace)])
            view.release([seq_id])


def random_prompts(rng, count):
    """Prompts of 1-5 pages sharing prefixes with earlier ones, so the tree branches."""
    prompts = []
    for _ in range(count):
        if prompts and rng.random() < 0.6:
            base = rng.choice(prompts)
            keep = rng.randrange(0, len(base) // PAGE + 1) * PAGE
            prompt = base[:keep]
        else:
            prompt = []
        prompt = prompt + [rng.randrange(0, 50) for _ in range(rng.randrange(1, 4) * PAGE)]
        prompts.append(prompt[:5 * PAGE])
    return prompts


@pytest.mark.parametrize("seed", range(12))
def test_candidates_are_what_eviction_takes_in_order(segment_name, seed):
    rng = random.Random(seed)
    cache = hostkv.HostKVCache.create(segment_name, small_config(num_pages=96, page_size=PAGE))
    try:
        fill(cache, random_prompts(rng, 14))
        # Some recency shuffled by re-borrowing prompts' prefixes.
        with hostkv.WorkerView(cache) as view:
            for seq_id, entry in enumerate(sorted(cached_tree(cache))[:4]):
                view.allocate_pages_for_sequences_with_prefix(
                    [hostkv.SequenceRequest(100 + seq_id, list(entry[1]) + [1], entry[0])])
                view.release([100 + seq_id], commit=False)
        before = snapshot(cache)
        lru_before = lru(cache)
        evictable = cache.stats().evictable_pages
        candidates = cache.eviction_candidates(10**9)
        assert snapshot(cache) == before and lru(cache) == lru_before      # a pure lookup
        assert sum(c.num_pages for c in candidates) == cache.stats().cached_pages == evictable
        for c in candidates:
            assert type(c) is hostkv.EvictionCandidate          # a public name
            assert len(c.tokens) == len(c.pages) * PAGE and 1 <= c.num_pages <= len(c.pages)
            assert list(cache.match_prefix(c.tokens, c.namespace).pages) == list(c.pages)
        # Positions run on without gaps; reading the order in pieces gives the same nodes.
        assert [c.position for c in candidates] == list(np.cumsum(
            [0] + [c.num_pages for c in candidates])[:-1])
        pieces, offset = [], 0
        while offset < evictable:
            piece = cache.eviction_candidates(3, skip_pages=offset)
            assert piece and piece[0].position <= offset
            pieces += [c for c in piece if c.position >= offset]
            offset = piece[-1].position + piece[-1].num_pages
        assert [(c.position, c.tokens.tobytes()) for c in pieces] == [
            (c.position, c.tokens.tobytes()) for c in candidates]
        assert snapshot(cache) == before
        # Evicting node by node takes exactly each candidate's own pages, in the listed order.
        for c in candidates:
            assert cache.evict(c.num_pages) == c.num_pages
            kept = len(c.pages) - c.num_pages
            assert len(cache.match_prefix(c.tokens, c.namespace).pages) == kept
        assert cache.stats().cached_pages == 0
    finally:
        cache.close()


def test_candidates_stop_at_max_pages_and_skip_borrowed_paths(cache):
    fill(cache, [[1] * 8, [2] * 12, [3] * 4])
    first = cache.eviction_candidates(1)
    assert len(first) == 1 and list(first[0].tokens) == [1] * 8     # oldest first, whole node
    assert cache.eviction_candidates(0) == []
    assert cache.eviction_candidates(10, skip_pages=100) == []
    assert [c.position for c in cache.eviction_candidates(10, skip_pages=2)] == [2, 5]
    assert [list(c.tokens[:1]) for c in cache.eviction_candidates(3)] == [[1], [2]]
    with hostkv.WorkerView(cache) as view:
        view.allocate_pages_for_sequences_with_prefix([hostkv.SequenceRequest(9, [2] * 13)])
        listed = cache.eviction_candidates(100)
        assert [list(c.tokens[:1]) for c in listed] == [[1], [3]]   # the borrowed path is not
    cache.check()


def test_a_parent_is_listed_after_all_its_children(cache):
    fill(cache, [[5] * 4 + [6] * 4, [5] * 4 + [7] * 4])
    listed = cache.eviction_candidates(100)
    assert [c.tokens[-1] for c in listed] == [6, 7, 5]
    assert [c.num_pages for c in listed] == [1, 1, 1]


@pytest.mark.parametrize("bad", [True, 1.0, "3", -1, 2**63, None])
def test_candidates_bad_input(cache, bad):
    fill(cache, [[1] * 8])
    before = snapshot(cache)
    with pytest.raises(ValueError, match="max_pages"):
        cache.eviction_candidates(bad)
    with pytest.raises(ValueError, match="skip_pages"):
        cache.eviction_candidates(4, skip_pages=bad)
    assert snapshot(cache) == before


def test_candidates_of_a_closed_cache(segment_name):
    cache = hostkv.HostKVCache.create(segment_name, small_config())
    cache.close()
    with pytest.raises(ValueError):
        cache.eviction_candidates(1)


def test_hold_keeps_pages_without_changing_recency_stats_or_free_pages(cache):
    fill(cache, [[1] * 8, [2] * 8])
    stats = cache.stats()
    lru_before = lru(cache)
    with hostkv.WorkerView(cache) as view:
        held = view.hold_cached_pages([hostkv.SequenceRequest(7, [1] * 8 + [4]),
                                       hostkv.SequenceRequest(8, [9] * 8)])
        assert held[0].reused_tokens == 8 and list(held[0].page_table) == list(
            cache.match_prefix([1] * 8).pages)
        assert held[1].reused_tokens == 0 and len(held[1].page_table) == 0
        after = cache.stats()
        assert (after.free_pages, after.lookups, after.hit_tokens, after.pages_allocated) == (
            stats.free_pages, stats.lookups, stats.hit_tokens, stats.pages_allocated)
        assert after.borrowed_pages == 2
        assert lru(cache) == lru_before
        assert view.state(7).num_tokens == 8 and view.state(8).num_tokens == 0
        # Held pages survive any eviction; the rest goes.
        assert cache.evict(100) == 2
        assert len(cache.match_prefix([1] * 8).pages) == 2
        cache.check()
        assert view.release([7, 8], commit=False) == [2, 0]
    assert cache.stats().evictable_pages == 2
    cache.check()


@pytest.mark.parametrize("capacity", [2, 3])
def test_hold_ending_inside_a_node_never_evicts_for_its_split(segment_name, capacity):
    """With every node record in use, a hold that would split a node takes only whole
    nodes (no eviction to get a record, where an allocation would evict); with a record
    free it splits."""
    cache = hostkv.HostKVCache.create(
        segment_name, small_config(num_pages=24, page_size=PAGE, radix_node_capacity=capacity))
    try:
        fill(cache, [[3] * 12, [4] * 8])
        before = cached_tree(cache)
        evicted = cache.stats().evicted_pages
        with hostkv.WorkerView(cache) as view:
            held = view.hold_cached_pages([hostkv.SequenceRequest(1, [3] * 8)])
            assert held[0].reused_tokens == (0 if capacity == 2 else 8)
            assert cache.stats().evicted_pages == evicted
            assert cache.stats().tree_nodes == (2 if capacity == 2 else 3)
            if capacity == 2:
                assert cached_tree(cache) == before
            cache.check()
    finally:
        cache.close()


def rolled_back_state(cache):
    """The state a rolled-back mutation must leave as it was: refcounts, free pages and
    leases (crashlib), the tree and every live sequence."""
    seg = cache._segment
    return (snapshot(cache), seg.run_locked(_sequences.live_sequences, seg),
            frozenset(_introspect.tree_contents(seg)))


def metadata(cache):
    """Every metadata byte of the segment, to prove a refused hold wrote none (a crashlib
    snapshot would not see a sequence record taken)."""
    cache.reap()                  # no periodic sweep due during the comparison
    snap = MetadataSnapshot(cache)
    return snap, snap.take()


def test_hold_runs_out_of_sequence_records_changes_nothing(segment_name):
    cache = hostkv.HostKVCache.create(segment_name, small_config(max_sequences=2))
    try:
        fill(cache, [[1] * 8])
        before = rolled_back_state(cache)
        with hostkv.WorkerView(cache) as view:
            with pytest.raises(CapacityError):
                view.hold_cached_pages([hostkv.SequenceRequest(i, [1] * 8) for i in range(3)])
            # Found short under the lock and rolled back: the log's bytes and the rollback
            # counter moved, nothing else.
            assert rolled_back_state(cache) == before and view.live_sequences == []
    finally:
        cache.close()


@pytest.mark.parametrize("requests, error", [
    ([hostkv.SequenceRequest(1, [1] * 4), hostkv.SequenceRequest(1, [2] * 4)], SequenceError),
    ([hostkv.SequenceRequest(1, [])], SequenceError),
    ([hostkv.SequenceRequest(1, [-1, 2])], ValueError),
    ([hostkv.SequenceRequest(1, [2**31])], ValueError),
    ([hostkv.SequenceRequest(1, [1.5])], ValueError),
    ([hostkv.SequenceRequest(1, [1] * 4, namespace=-1)], ValueError),
    ([hostkv.SequenceRequest(True, [1] * 4)], SequenceError),
    ([(1, [1] * 4)], SequenceError),
    (hostkv.SequenceRequest(1, [1] * 4), SequenceError),
    ("abc", SequenceError),
])
def test_hold_bad_input_changes_nothing(cache, requests, error):
    fill(cache, [[1] * 8])
    snap, before = metadata(cache)
    with hostkv.WorkerView(cache) as view:
        with pytest.raises(error):
            view.hold_cached_pages(requests)
        assert not snap.diff(before, snap.take()) and view.live_sequences == []


def test_hold_of_a_live_id(cache):
    fill(cache, [[1] * 8])
    with hostkv.WorkerView(cache) as view:
        view.hold_cached_pages([hostkv.SequenceRequest(1, [1] * 8)])
        snap, before = metadata(cache)
        with pytest.raises(SequenceError):
            view.hold_cached_pages([hostkv.SequenceRequest(1, [1] * 8)])
        assert not snap.diff(before, snap.take())


def test_compiled_hold_refuses_raw_bad_arrays(cache):
    seg = cache._segment
    ids = np.array([1], dtype=np.int64)
    with pytest.raises(ValueError):
        _sequences.hold(seg, [np.array([1, 2], dtype=np.int64)], ids, [0], 1)
    with pytest.raises(ValueError):
        _sequences.hold(seg, [[1, 2, 3, 4]], ids, [0], 1)
    with pytest.raises(ValueError):
        _sequences.hold(seg, [np.array([1, 2], dtype=np.int32)], ids, [-1], 1)
    with pytest.raises(ValueError):
        _sequences.hold(seg, [np.array([1, 2], dtype=np.int32)],
                        np.array([1], dtype=np.int32), [0], 1)
    with pytest.raises(ValueError):
        _sequences.hold(seg, [np.array([1, 2], dtype=np.int32)], ids, [0, 0], 1)
    cache.check()


SYSTEM = list(range(100, 112))          # three full pages


@pytest.fixture
def hold_cache(segment_name):
    cache = hostkv.HostKVCache.create(
        segment_name, small_config(num_pages=24, page_size=PAGE, radix_node_capacity=8))
    fill(cache, [SYSTEM, list(range(200, 208))])
    yield cache
    cache.close()


@pytest.fixture
def crash_snapshots(monkeypatch):
    monkeypatch.setitem(crashlib.OPTIONS, "exact_references", True)
    monkeypatch.setitem(crashlib.OPTIONS, "counters", False)
    monkeypatch.setitem(crashlib.EXTRA_STATE, "tree",
                        lambda seg: frozenset(_introspect.tree_contents(seg)))
    monkeypatch.setitem(crashlib.EXTRA_STATE, "sequences", lambda seg: frozenset(
        (s[2], s[3], s[4]) for s in _sequences.live_sequences(seg)))
    monkeypatch.setitem(crashlib.EXTRA_STATE, "lru", crashlib.lru_state)


def hold_op(cache, ctx):
    held = hostkv.WorkerView(cache).hold_cached_pages([
        hostkv.SequenceRequest(1, SYSTEM[:8]),              # ends inside a node: a split
        hostkv.SequenceRequest(2, list(range(200, 208))),
        hostkv.SequenceRequest(3, [1, 2, 3, 4])])           # nothing cached
    assert [h.reused_tokens for h in held] == [8, 8, 0]


def held_view(cache):
    view = hostkv.WorkerView(cache)
    view.hold_cached_pages([hostkv.SequenceRequest(1, SYSTEM[:8]),
                            hostkv.SequenceRequest(2, list(range(200, 208)))])
    return view


def release_held_op(cache, view):
    view.release([1, 2], commit=False)


def test_hold_crash_at_every_step(hold_cache, crash_snapshots):
    def held_without_touch(before, after):
        # A touch would make the system prompt's path the newest; the other prompt, cached
        # last, must stay the newest, and the clock must not move.
        lru_before, lru_after = dict(before.extra)["lru"], dict(after.extra)["lru"]
        tree = dict(after.extra)["tree"]
        newest = next(pages[0] for _ns, tokens, pages, _locks in tree if tokens[0] == 200)
        ranks = {first: rank for first, _count, rank in lru_after[1]}
        if lru_before[0] != lru_after[0] or ranks[newest] != max(ranks.values()):
            return "the hold refreshed recency"
        return None

    steps = crash_every_step(hold_cache, hold_op, expect_after=held_without_touch,
                             unreaped=True)
    assert steps > 20


def test_release_of_held_pages_crash_at_every_step(hold_cache, crash_snapshots):
    steps = crash_every_step(hold_cache, release_held_op, setup=held_view, unreaped=True)
    assert steps > 5


@pytest.mark.parametrize("mode", ["keyboard_interrupt", "memory_error"])
def test_hold_exceptions_mid_batch_roll_back(hold_cache, crash_snapshots, mode):
    steps = crashlib.raise_every_step(hold_cache, hold_op, None, mode)
    assert steps > 20


def test_skipping_stops_at_the_first_candidate_listed(segment_name):
    """skip_pages skips the coldest nodes while they fit it, then lists every node after:
    a later, smaller node that would still fit what is left of the budget is not left out
    (found in review: the evict writer's offsets fall inside nodes, and the node at
    position 7 below went missing, so it could be evicted unsent)."""
    cfg = small_config(num_pages=64, page_size=4)
    with hostkv.HostKVCache.create(segment_name, cfg) as cache:
        view = hostkv.WorkerView(cache)
        for seq_id, pages in [(1, 3), (2, 4), (3, 2), (4, 1)]:
            tokens = list(range(1000 * seq_id, 1000 * seq_id + 4 * pages + 1))
            view.allocate_pages_for_sequences_with_prefix(
                [hostkv.SequenceRequest(seq_id, tokens, namespace=seq_id)])
            view.release([seq_id])
        everything = [(c.num_pages, c.position) for c in cache.eviction_candidates(100, 0)]
        assert everything == [(3, 0), (4, 3), (2, 7), (1, 9)]
        for skip, expected in [(3, everything[1:]), (5, everything[1:]), (7, everything[2:]),
                               (9, everything[3:]), (10, [])]:
            got = [(c.num_pages, c.position) for c in cache.eviction_candidates(100, skip)]
            assert got == expected, skip
        view.close()


def test_a_hold_of_no_pages_then_a_decode_step(segment_name):
    """A hold that found nothing cached is a sequence of no tokens; a decode step on it
    gets a page and records its token (it raised IndexError at every step before)."""
    with hostkv.HostKVCache.create(segment_name, small_config(num_pages=16, page_size=4)) as cache:
        view = hostkv.WorkerView(cache)
        (held,) = view.hold_cached_pages([hostkv.SequenceRequest(1, [1, 2, 3, 4, 5])])
        assert held.reused_tokens == 0 and len(held.page_table) == 0
        view.append_tokens([1], [7])
        view.append_tokens([1], [8])
        state = view.state(1)
        assert state.tokens.tolist() == [7, 8] and len(state.pages) == 1
        view.release([1], commit=False)
        cache.check()
        view.close()
