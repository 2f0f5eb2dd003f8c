"""inspect on a big tree takes the lock in bounded pieces, so it never stalls the engines.

Copying the whole tree (every node's whole path) under one hold of the lock takes 0.8 s for
4,000 nodes, longer than a worker's lock timeout for a full tree, so `python -m hostkv
inspect` reads at most INSPECT_CHUNK_NODES node records per hold. The tests check that a big
tree is reported whole, that each hold reads a bounded piece, and that a tree changed between
two pieces is reported as not consistent.
"""

from __future__ import annotations

import math

import numpy as np

import hostkv
from hostkv import _introspect, _pages, _radix
from hostkv import __main__ as cli

from conftest import small_config

PAGE = 4
WIDE = 3000              # top-level nodes of one page each
DEEP = 40                # one path of DEEP one-page nodes


def _insert(seg, tokens):
    tokens = np.asarray(tokens, dtype=np.int32)
    pages = _pages.alloc_pages(seg, len(tokens) // PAGE)
    _radix.insert(seg, tokens, pages, 0)
    _pages.free_pages(seg, pages)        # the tree keeps its own references


def _big_tree(name):
    cfg = small_config(num_pages=4096, page_size=PAGE, page_bytes=16, radix_node_capacity=4096)
    cache = hostkv.HostKVCache.create(name, cfg)
    seg = cache._segment
    for i in range(WIDE):
        _insert(seg, [10_000 + i] * PAGE)
    deep = list(range(1, DEEP * PAGE + 1))
    for n in range(1, DEEP + 1):         # each longer prefix splits off one more node
        _insert(seg, deep[:n * PAGE])
    return cache, deep


class CountingSegment:
    """The observer's segment, counting its lock holds and what each returned; with
    `meddle`, something changes the tree between holds (as engines do)."""

    def __init__(self, real, meddle=None):
        self.real = real
        self.meddle = meddle
        self.holds = []

    def run_locked(self, fn, seg, *args):
        result = self.real.run_locked(fn, self.real, *args)
        self.holds.append(len(result[0]))
        if self.meddle is not None:
            self.meddle()
        return result


def test_inspect_reports_a_big_tree(segment_name):
    cache, deep = _big_tree(segment_name)
    try:
        assert cache.stats().tree_nodes == WIDE + DEEP
        report = cli.inspect_segment(segment_name)
        tree = report["tree"]
        assert tree["nodes"] == WIDE + DEEP
        assert tree["depth_pages"] == DEEP
        assert tree["consistent"] is True
        top = tree["largest_prefixes"][0]
        assert top["tokens"] == DEEP * PAGE
        assert top["first_tokens"] == deep[:_introspect.INSPECT_TOKENS]
        # The summary's path lengths are those of the full copy (tree_contents).
        seg = cache._segment
        contents = seg.run_locked(_introspect.tree_contents, seg)
        nodes, consistent = cli.tree_summary(seg)
        assert consistent
        by_length = sorted(len(pages) for _, _, pages, _ in contents)
        assert sorted(p for p, _ in cli._paths(nodes).values()) == by_length
    finally:
        cache.close()


def test_inspect_holds_the_lock_for_bounded_pieces(segment_name):
    cache, _ = _big_tree(segment_name)
    try:
        counting = CountingSegment(cache._segment)
        nodes, consistent = cli.tree_summary(counting)
        assert consistent and len(nodes) == WIDE + DEEP
        capacity = cache.config.radix_node_capacity
        # One hold per piece of INSPECT_CHUNK_NODES records, each returning no more.
        assert len(counting.holds) == math.ceil(capacity / cli.INSPECT_CHUNK_NODES) > 1
        assert max(counting.holds) <= cli.INSPECT_CHUNK_NODES
        assert sum(counting.holds) == WIDE + DEEP
        # The piece itself is bounded by its argument.
        seg = cache._segment
        chunk, next_start, _ = seg.run_locked(_introspect.tree_summary_chunk, seg, 0, 100)
        assert len(chunk) <= 100 and next_start == 100
    finally:
        cache.close()


def test_a_tree_that_changes_between_pieces_is_reported_as_such(segment_name):
    cache, _ = _big_tree(segment_name)
    try:
        seg = cache._segment
        counter = iter(range(1_000_000))

        def meddle():
            _insert(seg, [50_000 + next(counter)] * PAGE)

        nodes, consistent = cli.tree_summary(CountingSegment(seg, meddle))
        assert not consistent
        assert len(nodes) >= WIDE + DEEP
    finally:
        cache.close()
