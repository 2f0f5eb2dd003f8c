"""WorkerView: decode steps, commit (idempotent, minimum store, dedup) and release."""

from __future__ import annotations


import numpy as np
import pytest

from hostkv import OutOfPagesError, SequenceError, SequenceRequest as R

from lib.worker_view_lib import (
    P,
    POOL,
    PS,
    Z,
    assert_unchanged,
    cache_prefix,
    make,  # noqa: F401 - a fixture
    pages_for,
    snapshot,
)


# -- decode ------------------------------------------------------------------------------------


def test_a_sequence_holds_ceil_n_over_page_size_pages_at_every_step(make):
    cache, view = make(num_pages=64)
    prompts = {1: [1], 2: [1, 2, 3, 4], 3: [1, 2, 3, 4, 5], 4: list(range(8)), 5: list(range(7))}
    view.allocate_pages_for_sequences_with_prefix([R(s, t) for s, t in prompts.items()])
    tables = {s: view.page_table(s).tolist() for s in prompts}
    for s, t in prompts.items():
        assert len(tables[s]) == pages_for(len(t))
    ids = list(prompts)
    for step in range(13):
        view.append_tokens(ids, [100 + step] * len(ids))
        held = 0
        for s in ids:
            n = len(prompts[s]) + step + 1
            table = view.page_table(s).tolist()
            assert len(table) == pages_for(n)
            # Earlier pages never move; a new page comes only when the last one was full.
            assert table[:len(tables[s])] == tables[s]
            assert len(table) - len(tables[s]) == (1 if (n - 1) % PS == 0 else 0)
            tables[s] = table
            state = view.state(s)
            assert state.num_tokens == n
            assert state.tokens.tolist() == prompts[s] + list(range(100, 100 + step + 1))
            held += len(table)
        all_pages = [p for t in tables.values() for p in t]
        assert len(set(all_pages)) == len(all_pages)
        assert cache.stats().free_pages == 64 - held
    cache.check()


def test_decode_pages_are_reusable_after_commit(make):
    cache, view = make()
    prompt = [1, 2, 3, 4, 5]
    view.allocate_pages_for_sequences_with_prefix([R(1, prompt)])
    decoded = list(range(50, 61))
    for i, token in enumerate(decoded[:5]):
        view.append_tokens([1], [token])
    # 10 tokens: 2 full pages, the second filled by decode.
    assert view.commit([1]) == [2]
    assert cache.match_prefix(prompt + decoded[:5]).num_tokens == 8
    for token in decoded[5:]:
        view.append_tokens([1], [token])
    assert view.commit([1]) == [4]
    tokens = prompt + decoded
    assert view.state(1).committed_tokens == 16
    (alloc,) = view.allocate_pages_for_sequences_with_prefix([R(2, tokens + [99])])
    assert alloc.reused_tokens == 16
    assert alloc.page_table[:4].tolist() == view.page_table(1).tolist()
    # The adopted pages are the tree's and the sequence's: nothing was copied.
    assert cache.stats().free_pages == POOL - 4 - 1
    view.release([1, 2])
    assert cache.stats().free_pages == POOL - 4
    cache.check()


def test_none_token_stops_only_its_own_sequence(make):
    cache, view = make()
    base = {1: [10, 11, 12, 13], 2: [20, 21, 22, 23], 3: [30, 31, 32, 33]}
    view.allocate_pages_for_sequences_with_prefix([R(s, t) for s, t in base.items()])
    view.append_tokens([1, 2, 3], [None, 24, 34])
    for k in range(5, 12):
        view.append_tokens([1, 2, 3], [k, 20 + k, 30 + k] if k != 9 else [k, None, 30 + k])
    s1, s2, s3 = view.state(1), view.state(2), view.state(3)
    assert (s1.num_tokens, s2.num_tokens, s3.num_tokens) == (12, 12, 12)
    assert (s1.cacheable_tokens, s2.cacheable_tokens, s3.cacheable_tokens) == (4, 9, 12)
    assert s1.tokens[4] == 0 and s2.tokens[9] == 0
    assert len(view.page_table(1)) == 3
    assert view.commit([1, 2, 3]) == [1, 2, 3]
    assert cache.match_prefix(s1.tokens).num_tokens == 4
    assert cache.match_prefix(s2.tokens).num_tokens == 8
    assert cache.match_prefix(s3.tokens).num_tokens == 12
    # More known tokens do not make the None position cacheable again.
    view.append_tokens([1], [77])
    assert view.commit([1]) == [1]
    assert view.release([1, 2, 3]) == [1, 2, 3]
    assert cache.stats().cached_pages == 6
    cache.check()


def test_append_out_of_pages_leaves_every_sequence_unchanged(make):
    cache, view = make(num_pages=8)
    cache_prefix(view, [9, 9, 9, 9, 9])           # 1 cached page, evictable
    view.allocate_pages_for_sequences_with_prefix(
        [R(1, [1, 2, 3, 4]), R(2, [5, 6, 7, 8]), R(3, [1, 2, 3]), R(4, list(range(13)))])
    assert cache.stats().free_pages == 0
    before = snapshot(cache, view, quiet=True)
    with pytest.raises(OutOfPagesError):
        # 1 and 2 need a page each, 3 does not; none free, one evictable: one short.
        view.append_tokens([3, 1, 2], [4, 5, 9])
    assert_unchanged(before, snapshot(cache, view), rolled_back=True)
    view.release([4], commit=False)
    view.append_tokens([3, 1, 2], [4, 5, 9])
    assert [len(view.page_table(s)) for s in (1, 2, 3)] == [2, 2, 1]
    assert view.state(3).tokens.tolist() == [1, 2, 3, 4]
    assert cache.match_prefix([9, 9, 9, 9]).num_tokens == 4      # no eviction was needed
    cache.check()


def test_append_evicts_when_short(make):
    cache, view = make(num_pages=8)
    cache_prefix(view, [9, 9, 9, 9, 9])
    view.allocate_pages_for_sequences_with_prefix([R(1, [1, 2, 3, 4]), R(2, list(range(24)))])
    assert cache.stats().free_pages == 0
    view.append_tokens([1], [5])
    assert cache.stats().evicted_pages == 1
    assert len(view.page_table(1)) == 2
    cache.check()


BAD_STEPS = {
    "unknown-id": (lambda: ([1, 42], [5, 5]), SequenceError),
    "id-twice": (lambda: ([1, 1], [5, 5]), SequenceError),
    "id-bool": (lambda: ([True], [5]), SequenceError),
    "ids-a-string": (lambda: ("12", [5, 5]), SequenceError),
    "ids-an-int": (lambda: (1, [5]), SequenceError),
    "fewer-tokens": (lambda: ([1, 2], [5]), SequenceError),
    "more-tokens": (lambda: ([1, 2], [5, 6, 7]), SequenceError),
    "token-negative": (lambda: ([1, 2], [5, -1]), ValueError),
    "token-2**31": (lambda: ([1, 2], [5, 2**31]), ValueError),
    "token-float": (lambda: ([1, 2], [5, 6.0]), ValueError),
    "token-bool": (lambda: ([1, 2], [5, True]), ValueError),
    "token-str": (lambda: ([1, 2], [5, "6"]), ValueError),
}


@pytest.mark.parametrize("case", sorted(BAD_STEPS))
def test_bad_decode_step_changes_nothing(make, case):
    cache, view = make()
    view.allocate_pages_for_sequences_with_prefix([R(1, [1, 2, 3, 4]), R(2, [5, 6, 7, 8])])
    make_bad, error = BAD_STEPS[case]
    before = snapshot(cache, view, quiet=True)
    with pytest.raises(error):
        view.append_tokens(*make_bad())
    assert_unchanged(before, snapshot(cache, view), rolled_back=False)
    view.append_tokens([1, 2], [np.int64(5), np.uint32(9)])
    assert view.state(2).tokens.tolist() == [5, 6, 7, 8, 9]


def test_commit_is_idempotent_and_respects_num_tokens(make):
    cache, view = make()
    view.allocate_pages_for_sequences_with_prefix(
        [R(1, list(range(14))), R(2, list(range(50, 63)))])
    assert view.commit([1], num_tokens=4) == [1]
    assert view.commit([1, 2], num_tokens=[9, 3]) == [2, 0]
    assert view.commit([1], num_tokens=1) == [2]           # never goes back
    assert cache.stats().cached_pages == 2
    assert view.commit([1, 2]) == [3, 3]
    before = snapshot(cache, view, quiet=True)
    assert view.commit([1, 2]) == [3, 3]
    assert view.commit([2, 1], num_tokens=100) == [3, 3]
    assert_unchanged(before, snapshot(cache, view), rolled_back=False)
    for bad in (dict(num_tokens=-1), dict(num_tokens=[4])):
        with pytest.raises(SequenceError):
            view.commit([1, 2], **bad)
    for ids in ([42], [1, 1], [1, 42]):
        with pytest.raises(SequenceError):
            view.commit(ids)
    assert_unchanged(before, snapshot(cache, view), rolled_back=False)
    cache.check()


def test_commit_respects_min_store_pages(make):
    cache, view = make(prefix_min_store_pages=2)
    view.allocate_pages_for_sequences_with_prefix([R(1, [1, 2, 3, 4, 5])])
    assert view.commit([1]) == [0]
    assert cache.stats().cached_pages == 0
    view.append_tokens([1], [6])
    view.append_tokens([1], [7])
    view.append_tokens([1], [8])
    assert view.commit([1]) == [2]
    assert cache.stats().cached_pages == 2
    # A release with one full page caches nothing either.
    view.allocate_pages_for_sequences_with_prefix([R(2, [9, 9, 9, 9, 9])])
    assert view.release([2]) == [0]
    assert cache.stats().cached_pages == 2
    cache.check()


def test_commit_dedupes_and_release_frees_the_duplicates(make):
    cache, view = make()
    view.allocate_pages_for_sequences_with_prefix([R(1, Z + [1]), R(2, Z + [1])])
    assert view.commit([1]) == [3]
    first = view.page_table(1)[:3].tolist()
    assert view.commit([2]) == [3]          # found in the cache: the tree keeps one copy
    st = cache.stats()
    assert st.cached_pages == 3
    assert st.free_pages == POOL - 4 - 4
    assert cache.match_prefix(Z).pages.tolist() == first
    assert view.state(2).committed_tokens == 12
    view.release([2])
    assert cache.stats().free_pages == POOL - 4     # 2's own copies are freed
    view.release([1])
    assert cache.stats().free_pages == POOL - 3
    cache.check()


def test_release_without_commit_frees_private_pages_and_keeps_borrowed_ones(make):
    cache, view = make()
    cache_prefix(view, P)
    view.allocate_pages_for_sequences_with_prefix([R(1, P + list(range(9)))])
    view.append_tokens([1], [5])
    assert view.release([1], commit=False) == [3]     # the borrowed pages stay cached
    st = cache.stats()
    assert (st.cached_pages, st.free_pages, st.active_sequences) == (3, POOL - 3, 0)
    assert cache.match_prefix(P + list(range(9))).num_tokens == 12
    cache.check()


def test_release_commits_then_frees_and_ids_are_reusable(make):
    cache, view = make()
    view.allocate_pages_for_sequences_with_prefix([R(1, Z + [1, 2]), R(2, [7])])
    with pytest.raises(SequenceError):
        view.release([1, 42])               # one unknown id: nothing is released
    assert sorted(view.live_sequences) == [1, 2]
    assert view.release([1, 2]) == [3, 0]
    assert view.live_sequences == []
    st = cache.stats()
    assert (st.cached_pages, st.free_pages, st.active_sequences) == (3, POOL - 3, 0)
    for call in (lambda: view.release([1]), lambda: view.commit([1]),
                 lambda: view.append_tokens([1], [1]), lambda: view.page_table(1),
                 lambda: view.state(1)):
        with pytest.raises(SequenceError):
            call()
    allocs = view.allocate_pages_for_sequences_with_prefix([R(1, Z + [3]), R(2, Z + [4])])
    assert [a.reused_tokens for a in allocs] == [12, 12]
    cache.check()
