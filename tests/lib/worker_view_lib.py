"""Helpers of the WorkerView tests: a small pool, the `make` fixture, and snapshots of
everything a failed mutation must leave as it was (see test_worker_view.py)."""

from __future__ import annotations

import dataclasses
import time

import pytest

import hostkv
from hostkv import HostKVCache, SequenceRequest as R, WorkerView
from hostkv import _introspect, _sequences


PS = 4                      # tokens per page in these tests
POOL = 32                   # pages in the default pool
# A cached 3-page prefix and two other prompts that share nothing with it or each other.
P = list(range(1000, 1012))
Q = list(range(2000, 2008))
Z = list(range(3000, 3012))

# How long after a forced sweep a snapshot pair is trusted to see no periodic sweep
# (_segment.SWEEP_INTERVAL_NS is one second).
QUIET_S = 0.8


def config(**overrides) -> hostkv.HostKVConfig:
    values = dict(num_pages=POOL, page_size=PS, page_bytes=64, max_processes=8)
    values.update(overrides)
    return hostkv.HostKVConfig(**values)


def pages_for(n: int) -> int:
    return -(-n // PS)


@pytest.fixture
def make(segment_name, new_name):
    """Creates (cache, view) pairs; views then caches are closed in teardown."""
    opened = []

    def factory(**overrides):
        name = segment_name if not opened else new_name()
        cache = HostKVCache.create(name, config(**overrides))
        view = WorkerView(cache)
        opened.append((cache, view))
        return cache, view

    yield factory
    for cache, view in reversed(opened):
        try:
            view.close()
        finally:
            try:
                cache.close()
            except BufferError:
                pass


# -- snapshots -------------------------------------------------------------------------------------


@dataclasses.dataclass
class Snapshot:
    taken_at: float
    stats: hostkv.CacheStats
    tree: set
    records: list
    view: object


def view_state(view: WorkerView):
    """The view's own bookkeeping, comparable with ==."""
    states = {}
    for sid in view.live_sequences:
        s = view.state(sid)
        states[sid] = (s.namespace, s.num_tokens, tuple(s.tokens.tolist()), s.reused_tokens,
                       s.committed_tokens, s.cacheable_tokens, tuple(s.pages.tolist()),
                       tuple(view.page_table(sid).tolist()))
    return view.stats(), states


def snapshot(cache: HostKVCache, view: WorkerView = None, quiet: bool = False) -> Snapshot:
    """Everything a failed call must leave as it was. quiet: force a sweep first, so the next
    second has no periodic one (which would commit a mutation and move `generation`)."""
    if quiet:
        cache.reap()
    taken_at = time.monotonic()
    cache.check()
    seg = cache._segment
    return Snapshot(
        taken_at=taken_at,
        stats=cache.stats(),
        tree=seg.run_locked(_introspect.tree_contents, seg),
        records=sorted(seg.run_locked(_sequences.live_sequences, seg)),
        view=view_state(view) if view is not None else None,
    )


def assert_unchanged(before: Snapshot, after: Snapshot, rolled_back: bool) -> None:
    b = dataclasses.asdict(before.stats)
    a = dataclasses.asdict(after.stats)
    for field in ("generation", "rollbacks"):
        b.pop(field)
        a.pop(field)
    assert a == b
    assert after.stats.rollbacks == before.stats.rollbacks + (1 if rolled_back else 0)
    if after.taken_at - before.taken_at < QUIET_S:
        assert after.stats.generation == before.stats.generation
    else:                   # a slow machine: a periodic sweep may have committed once
        assert after.stats.generation - before.stats.generation in (0, 1)
    assert after.tree == before.tree
    assert after.records == before.records
    assert after.view == before.view


def cache_prefix(view: WorkerView, tokens, namespace: int = 0, seq_id: int = 999) -> None:
    """Puts tokens' full pages in the tree (allocate, then release with commit)."""
    view.allocate_pages_for_sequences_with_prefix([R(seq_id, tokens, namespace)])
    view.release([seq_id])


def tree_pages(cache: HostKVCache) -> set:
    seg = cache._segment
    return {p for _, _, pages, _ in seg.run_locked(_introspect.tree_contents, seg) for p in pages}


LIVE = 7                     # a live sequence in the validation fixture


def _torch():
    return pytest.importorskip("torch")


@pytest.fixture
def busy(make):
    """A cache with a cached prefix P, a cached Q, and a live sequence LIVE borrowing P."""
    cache, view = make()
    cache_prefix(view, P)
    cache_prefix(view, Q)
    (alloc,) = view.allocate_pages_for_sequences_with_prefix([R(LIVE, P + [1, 2])])
    assert alloc.reused_tokens == 12
    return cache, view
