"""WorkerView: prefix reuse: page-aligned, at least one token computed, minimum reuse,
namespaces, batches, reuse turned off, other views and handles."""

from __future__ import annotations


import numpy as np
import pytest

from hostkv import HostKVCache, SequenceRequest as R, WorkerView

from lib.worker_view_lib import (
    P,
    POOL,
    PS,
    Z,
    cache_prefix,
    make,  # noqa: F401 - a fixture
    pages_for,
    snapshot,
    tree_pages,
)


# -- reuse -------------------------------------------------------------------------------------


def test_offload_skip_fields(make):
    cache, view = make()
    cache_prefix(view, P)
    cached = cache.match_prefix(P).pages
    (alloc,) = view.allocate_pages_for_sequences_with_prefix([R(1, P + [7, 8, 9, 10, 11])])
    assert alloc.seq_id == 1
    assert alloc.page_size == PS
    assert alloc.reused_tokens == 12
    assert alloc.write_from_token == 12
    assert alloc.num_shared_pages == 3
    assert alloc.page_table.dtype == np.int32
    assert len(alloc.page_table) == pages_for(17)
    assert alloc.page_table[:3].tolist() == cached.tolist()
    own = alloc.page_table[3:].tolist()
    assert len(set(own)) == len(own) and not set(own) & tree_pages(cache)
    # The allocation's table is read-only: it is the view's own, no scribbling on it.
    with pytest.raises(ValueError):
        alloc.page_table[:] = -1
    assert view.page_table(1)[:3].tolist() == cached.tolist()


def test_reuse_is_page_aligned_and_always_leaves_a_token(make):
    cache, view = make()
    cache_prefix(view, P)                                   # 3 pages
    cases = [
        (P + [1], 12),
        (P, 8),                 # the whole prompt cached: its last page is computed again
        (P[:11], 8),
        (P[:9], 8),
        (P[:8], 4),
        (P[:5], 4),
        (P[:4], 0),
        (P[:1], 0),
        (P[:6] + [1, 2, 3, 4], 4),      # diverges inside the second page
        ([P[0] + 1] + P[1:], 0),        # diverges at the first token
    ]
    for i, (tokens, expected) in enumerate(cases):
        st = cache.stats()
        (alloc,) = view.allocate_pages_for_sequences_with_prefix([R(100 + i, tokens)])
        assert alloc.reused_tokens == expected, tokens
        assert alloc.reused_tokens % PS == 0 and alloc.reused_tokens < len(tokens)
        after = cache.stats()
        assert after.lookups == st.lookups + 1
        assert after.lookup_tokens == st.lookup_tokens + len(tokens)
        assert after.hit_tokens == st.hit_tokens + expected
        assert after.borrowed_pages == expected // PS
        view.release([100 + i], commit=False)
    cache.check()


def test_min_reuse_pages(make):
    cache, view = make(prefix_min_reuse_pages=2)
    cache_prefix(view, P)
    before = snapshot(cache, quiet=True)
    (alloc,) = view.allocate_pages_for_sequences_with_prefix([R(1, P[:4] + [1])])
    assert alloc.reused_tokens == 0
    after = snapshot(cache)
    # The one-page match was not borrowed: no split, no lock, no hit.
    assert {(ns, t, p) for ns, t, p, _ in after.tree} == {(ns, t, p) for ns, t, p, _ in before.tree}
    assert after.stats.tree_nodes == before.stats.tree_nodes
    assert after.stats.borrowed_pages == 0
    assert after.stats.hit_tokens == before.stats.hit_tokens
    (alloc,) = view.allocate_pages_for_sequences_with_prefix([R(2, P[:8] + [1])])
    assert alloc.reused_tokens == 8
    cache.check()


def test_namespaces_never_share(make):
    cache, view = make()
    spaces = (0, 1, 2**63 - 1)
    cache_prefix(view, P, namespace=0)
    allocs = view.allocate_pages_for_sequences_with_prefix(
        [R(1, P + [1], 1), R(2, P + [1], 2**63 - 1), R(3, P + [1], np.int64(1))])
    assert [a.reused_tokens for a in allocs] == [0, 0, 0]
    assert view.state(2).namespace == 2**63 - 1
    view.release([1, 2])
    view.release([3], commit=False)
    # Each namespace now has its own copy.
    assert cache.stats().cached_pages == 3 * 3
    for ns in spaces:
        (alloc,) = view.allocate_pages_for_sequences_with_prefix([R(9, P + [1], ns)])
        assert alloc.reused_tokens == 12
        assert alloc.page_table[:3].tolist() == cache.match_prefix(P, ns).pages.tolist()
        view.release([9], commit=False)
    assert len({tuple(cache.match_prefix(P, ns).pages) for ns in spaces}) == 3
    cache.check()


@pytest.mark.parametrize("namespace", [2**63, 2**64 - 1, np.uint64(2**64 - 1)])
def test_namespaces_above_int64_max(make, namespace):
    # docs/design.md: "Namespaces are unsigned 64-bit"; as_namespace accepts [0, 2**64).
    cache, view = make()
    (alloc,) = view.allocate_pages_for_sequences_with_prefix([R(1, P + [1], namespace)])
    assert alloc.reused_tokens == 0
    assert view.state(1).namespace == int(namespace)
    assert view.release([1]) == [3]
    assert cache.match_prefix(P, namespace).num_tokens == 12
    assert cache.match_prefix(P, 0).num_tokens == 0
    (alloc,) = view.allocate_pages_for_sequences_with_prefix([R(2, P + [2], namespace)])
    assert alloc.reused_tokens == 12
    view.release([2])
    cache.check()


def test_batch_requests_all_borrow_a_prefix_cached_before_the_batch(make):
    cache, view = make()
    cache_prefix(view, P)
    cached = cache.match_prefix(P).pages.tolist()
    allocs = view.allocate_pages_for_sequences_with_prefix(
        [R(1, P + [1]), R(2, P + [2]), R(3, P[:8] + [3, 4])])
    assert [a.reused_tokens for a in allocs] == [12, 12, 8]
    assert allocs[0].page_table[:3].tolist() == cached
    assert allocs[1].page_table[:3].tolist() == cached
    assert allocs[2].page_table[:2].tolist() == cached[:2]
    own = [p for a in allocs for p in a.page_table[a.num_shared_pages:].tolist()]
    assert len(set(own)) == len(own) and not set(own) & set(cached)
    st = cache.stats()
    assert st.borrowed_pages == 3
    assert st.hit_tokens == 12 + 12 + 8
    assert st.free_pages == POOL - 3 - len(own)
    cache.check()


def test_batch_requests_do_not_see_each_others_pages(make):
    cache, view = make()
    allocs = view.allocate_pages_for_sequences_with_prefix([R(1, Z + [1]), R(2, Z + [2])])
    assert [a.reused_tokens for a in allocs] == [0, 0]
    assert not set(allocs[0].page_table.tolist()) & set(allocs[1].page_table.tolist())
    # Both commit at release: the tree keeps one copy (the first's), the duplicate is freed.
    assert view.release([1, 2]) == [3, 3]
    st = cache.stats()
    assert st.cached_pages == 3
    assert st.free_pages == POOL - 3
    assert cache.match_prefix(Z).pages.tolist() == allocs[0].page_table[:3].tolist()
    cache.check()


def _assert_reuse_off(cache, view):
    assert cache.config.enable_prefix_reuse is False
    cache_prefix(view, P)
    assert cache.stats().cached_pages == 0
    allocs = view.allocate_pages_for_sequences_with_prefix([R(1, P + [1]), R(2, P + [2])])
    assert [a.reused_tokens for a in allocs] == [0, 0]
    view.append_tokens([1, 2], [5, 6])
    assert view.commit([1, 2]) == [0, 0]
    assert view.state(1).committed_tokens == 0
    assert view.release([1, 2]) == [0, 0]
    st = cache.stats()
    assert (st.cached_pages, st.tree_nodes, st.hit_tokens, st.inserted_pages) == (0, 0, 0, 0)
    assert st.free_pages == POOL
    assert cache.match_prefix(P).num_tokens == 0
    cache.check()


def test_prefix_reuse_disabled_by_config(make):
    cache, view = make(enable_prefix_reuse=False)
    _assert_reuse_off(cache, view)


def test_prefix_reuse_disabled_by_env_at_create(make, monkeypatch):
    monkeypatch.setenv("HOSTKV_ENABLE_PREFIX_REUSE", "0")
    cache, view = make()                # the config says True; the env wins at create
    monkeypatch.delenv("HOSTKV_ENABLE_PREFIX_REUSE")
    _assert_reuse_off(cache, view)
    # Attaching reads the segment's config: still off.
    with HostKVCache.attach(cache.name) as other, WorkerView(other) as other_view:
        _assert_reuse_off(other, other_view)


def test_env_at_attach_does_not_change_the_segment(make, monkeypatch):
    cache, view = make()
    monkeypatch.setenv("HOSTKV_ENABLE_PREFIX_REUSE", "0")
    with HostKVCache.attach(cache.name) as other, WorkerView(other) as other_view:
        assert other.config.enable_prefix_reuse is True
        cache_prefix(other_view, P)
        (alloc,) = view.allocate_pages_for_sequences_with_prefix([R(1, P + [1])])
        assert alloc.reused_tokens == 12


def test_other_views_and_handles_see_commits(make):
    cache, view = make()
    other_view = WorkerView(cache)
    with HostKVCache.attach(cache.name) as other, WorkerView(other) as third:
        view.allocate_pages_for_sequences_with_prefix([R(1, P + [1])])
        # Ids are per view: the same id in another view is another sequence.
        (a,) = other_view.allocate_pages_for_sequences_with_prefix([R(1, P + [1])])
        assert a.reused_tokens == 0
        assert view.commit([1]) == [3]
        (b,) = third.allocate_pages_for_sequences_with_prefix([R(1, P + [2])])
        assert b.reused_tokens == 12
        assert b.page_table[:3].tolist() == view.page_table(1)[:3].tolist()
        third.release([1])
        other_view.release([1])
        view.release([1])
        other.check()
    other_view.close()
    assert cache.stats().free_pages == POOL - 3
    cache.check()
