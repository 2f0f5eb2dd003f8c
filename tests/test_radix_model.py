"""The compiled radix tree against the pure-Python reference model, step by step.

A hypothesis RuleBasedStateMachine drives a small cache (8 node records, 48 pages of 2
tokens) and tests/lib/reference_model.RadixModel with the same calls: insert, match, borrow,
unlock and evict, in namespaces 0, 1 and 2**64-1, with token pages drawn from three patterns
so that prefixes are shared, nodes split and the node records run out. After every step the
tree's contents, its counters and cache.check() must agree with the model. A second machine
makes every page hash collide, so only the token comparison keeps matches exact. A seeded
random walk makes the same comparison for 2000 steps and asserts that it reached the rare
paths (CapacityError, a borrow without a record for its split), which a short hypothesis run
may miss.

HOSTKV_LONG=1 runs many more and longer examples.
"""

from __future__ import annotations

import collections
import os
import random
import uuid

import numpy as np
import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import hostkv

from conftest import unlink_quietly
from hostkv import _introspect, _pages, _radix
from lib.reference_model import ModelCapacityError, RadixModel

PAGE_SIZE = 2
NUM_PAGES = 48
# Window parts for a quarter of the pages: inserts take them from the least recently used
# unlocked node or run short of them, so pages without a part reach the tree and later
# inserts of the same tokens donate theirs.
NUM_PARTS = 12
NODE_CAPACITY = 8
NAMESPACES = (0, 1, 2**64 - 1)
# Two patterns share their first token (so a page differs only past its first id), one uses
# the largest token id.
PATTERNS = ((7, 8), (7, 9), (2**31 - 1, 0))

LONG = os.environ.get("HOSTKV_LONG") == "1"
SETTINGS = settings(
    max_examples=1000 if LONG else 100,
    stateful_step_count=100 if LONG else 50,
    deadline=None,
)

namespaces = st.sampled_from(NAMESPACES)
patterns = st.sampled_from(PATTERNS)


@st.composite
def token_lists(draw, min_pages=0, max_pages=6):
    """Whole pages from PATTERNS, sometimes followed by a partial page."""
    pages = draw(st.lists(patterns, min_size=min_pages, max_size=max_pages))
    tokens = [t for page in pages for t in page]
    if draw(st.booleans()):
        tokens.append(draw(st.sampled_from((7, 2**31 - 1))))
    return tokens


def as_array(tokens) -> np.ndarray:
    return np.array(tokens, dtype=np.int32)


class Twin:
    """A compiled cache and a RadixModel, driven by the same calls and compared after each.

    The hypothesis machines and the seeded random walk below share it. `note` receives a
    short description of notable outcomes (hypothesis.event, or a Counter's update).
    """

    def __init__(self, name: str, hash_mask=None, note=lambda what: None) -> None:
        config = hostkv.HostKVConfig(num_pages=NUM_PAGES, page_size=PAGE_SIZE, page_bytes=16,
                                     radix_node_capacity=NODE_CAPACITY, max_processes=4,
                                     num_parts=NUM_PARTS, part_bytes=8)
        self.name = name
        self.note = note
        self.cache = hostkv.HostKVCache.create(name, config)
        self.seg = self.cache._segment
        if hash_mask is not None:
            self.seg._set_hash_mask(hash_mask)
        self.model = RadixModel(PAGE_SIZE, NODE_CAPACITY)
        self.held = []      # (compiled node, model node) of each lock not yet undone
        self.inserted = []  # (namespace, tokens) of every insert so far: prefixes to reuse
        # The window parts' model: which pages hold one (which part is the core's choice),
        # and the counters. A fresh batch's last pages take the free parts; a freed page's
        # part is free again; an insert moves a part from the caller's page to the tree's
        # page of the same tokens when only the caller's has one.
        self.with_part = set()
        self.parts_allocated = self.parts_freed = self.parts_donated = self.parts_evicted = 0
        self.pages_without_part = 0

    def close(self) -> None:
        try:
            self.cache.close()
        finally:
            unlink_quietly(self.name)

    # -- operations --------------------------------------------------------------------------

    def evict(self, num_pages: int) -> int:
        got = self.cache.evict(num_pages)
        released = self.model.evict_pages(num_pages)
        assert got == len(released), f"evict({num_pages}): tree {got}, model {released}"
        self.drop_parts(released)
        # The test holds no references: every page the tree let go is free now.
        rc = self.seg.run_locked(_pages.refcounts, self.seg)
        assert all(rc[p] == 0 for p in released), (released, rc[released])
        return got

    def insert(self, tokens, namespace) -> None:
        """Allocates the pages (evicting in both when short), inserts them in both, then drops
        the test's own references, so the tree's pages end with refcount 1."""
        n = len(tokens) // PAGE_SIZE
        free = self.cache.stats().free_pages
        if free < n:
            self.evict(n - free)
            if self.cache.stats().free_pages < n:
                self.note("insert: skipped, pages all borrowed")
                return
        self.evict_parts(n)
        pages = _pages.alloc_pages(self.seg, n)
        give = min(n, NUM_PARTS - len(self.with_part))
        self.with_part.update(pages[n - give:].tolist())
        self.parts_allocated += give
        self.pages_without_part += n - give
        self.inserted.append((namespace, tokens[:n * PAGE_SIZE]))
        adopted = 0
        try:
            try:
                got = _radix.insert(self.seg, as_array(tokens), pages, namespace)
            except hostkv.CapacityError as exc:
                assert exc.resource == "radix nodes"
                got = None
            try:
                want = self.model.insert(tokens, pages, namespace)
            except ModelCapacityError:
                want = None
            assert (got is None) == (want is None), f"insert: tree {got}, model {want}"
            if got is None:
                self.note("insert: CapacityError")
                return
            existing, tree_pages, node = got
            self.note(f"insert: {'all' if existing == n else 'some' if existing else 'no'} "
                      "pages existed")
            assert existing == want[0], f"existing: tree {existing}, model {want[0]}"
            assert tree_pages.dtype == np.int32
            assert tree_pages.tolist() == want[1]
            assert tree_pages[existing:].tolist() == pages[existing:].tolist()
            assert (node == -1) == (want[2] is None)
            adopted = n - existing
            for own, cached in zip(pages[:existing].tolist(), tree_pages[:existing].tolist()):
                if own != cached and own in self.with_part and cached not in self.with_part:
                    self.with_part.remove(own)
                    self.with_part.add(cached)
                    self.parts_donated += 1
                    self.note("insert: a part donated")
        finally:
            _pages.free_pages(self.seg, pages)
            # The pages the tree did not adopt went back with the test's reference.
            self.drop_parts(pages[:n - adopted].tolist())

    def evict_parts(self, need: int) -> None:
        """Frees parts for `need` fresh pages as an allocation does, in both: the model
        takes every part of the unlocked node with parts of least (last access, first
        page), until enough are free."""
        got = _radix.evict_parts(self.seg, need)
        want = 0
        while NUM_PARTS - len(self.with_part) < need:
            candidates = [node for node in self.model.live
                          if node.lock == 0 and self.with_part.intersection(node.pages)]
            if not candidates:
                break
            victim = min(candidates, key=lambda node: (node.last_access, node.pages[0]))
            if any(node.lock and self.with_part.intersection(node.pages)
                   and (node.last_access, node.pages[0]) < (victim.last_access, victim.pages[0])
                   for node in self.model.live):
                # A locked node less recently used than the victim: the core met it first
                # and parked it (or had parked it earlier).
                self.note("parts: evicted past an older locked node")
            taken = self.with_part.intersection(victim.pages)
            self.with_part -= taken
            want += len(taken)
            self.note("parts: a node's parts evicted")
        assert got == want, f"evict_parts({need}): tree {got}, model {want}"
        self.parts_evicted += want
        self.parts_freed += want

    def drop_parts(self, freed) -> None:
        for page in list(freed):
            if page in self.with_part:
                self.with_part.remove(page)
                self.parts_freed += 1

    def match(self, tokens, namespace) -> None:
        got = _radix.match(self.seg, as_array(tokens), namespace)
        assert got.dtype == np.int32
        assert got.tolist() == self.model.match(tokens, namespace)
        public = self.cache.match_prefix(tokens, namespace=namespace)
        assert public.num_tokens == len(got) * PAGE_SIZE
        assert public.pages.tolist() == got.tolist()

    def borrow(self, tokens, namespace) -> None:
        matched = len(self.model.match(tokens, namespace))
        pages, node = _radix.borrow(self.seg, as_array(tokens), namespace)
        want_pages, want_node = self.model.borrow(tokens, namespace)
        assert pages.dtype == np.int32
        assert pages.tolist() == want_pages, f"borrow: tree {pages}, model {want_pages}"
        assert (node == -1) == (want_node is None)
        if node != -1:
            self.held.append((node, want_node))
        if len(want_pages) < matched:
            self.note("borrow: stopped at a node boundary, no record for a split")
        self.note("borrow: hit" if want_pages else "borrow: miss")

    def unlock(self, pick: int) -> None:
        if not self.held:
            return
        node, model_node = self.held.pop(pick % len(self.held))
        _radix.unlock(self.seg, node)
        self.model.unlock(model_node)

    # -- comparison --------------------------------------------------------------------------

    def compare(self) -> None:
        # The test locks through the internal API, not through sequences: no sequence holds
        # these locks, so the cross-layer reference check must not require exact counts.
        self.cache.check(exact_references=False)
        self.model.check()
        got = self.seg.run_locked(_introspect.tree_contents, self.seg)
        want = self.model.contents()
        assert got == want, f"only in tree: {got - want}; only in model: {want - got}"
        s = self.cache.stats()
        m = self.model
        assert (s.cached_pages, s.borrowed_pages, s.evictable_pages, s.tree_nodes) == (
            m.cached, m.protected, m.cached - m.protected, m.nodes)
        assert (s.lookups, s.lookup_tokens, s.hit_tokens) == (
            m.lookups, m.lookup_tokens, m.hit_tokens)
        assert (s.inserted_pages, s.evicted_pages) == (m.inserted, m.evicted)
        # The test holds no pages between steps: every used page is the tree's.
        assert s.free_pages == NUM_PAGES - s.cached_pages
        # Borrows and inserts evict leaves for node records too: a page that left the tree
        # (the test holds none) went free, its part with it.
        self.drop_parts(self.with_part - self.model.cached_page_set)
        page_part = self.seg.run_locked(_pages.part_links, self.seg)[0]
        assert set(np.nonzero(page_part != -1)[0].tolist()) == self.with_part
        assert (s.free_parts, s.tree_parts, s.parts_allocated, s.parts_freed, s.parts_donated,
                s.pages_without_part, s.parts_evicted) == (
            NUM_PARTS - len(self.with_part), len(self.with_part), self.parts_allocated,
            self.parts_freed, self.parts_donated, self.pages_without_part, self.parts_evicted)


def unique_name() -> str:
    return f"hostkv-test-{os.getpid()}-{uuid.uuid4().hex[:12]}-radix-model"


class RadixMachine(RuleBasedStateMachine):
    """Hypothesis chooses the calls; the Twin makes them and compares."""

    hash_mask = None

    def __init__(self) -> None:
        super().__init__()
        self.twin = Twin(unique_name(), self.hash_mask, note=event)

    def teardown(self) -> None:
        self.twin.close()

    def _request(self, data, min_pages, max_pages):
        """(tokens, namespace): mostly a page-aligned prefix of an earlier insert, cut and
        extended, so that requests share prefixes, end inside nodes and diverge mid-path;
        sometimes fresh tokens or another namespace. (Hypothesis favours small draws, so the
        common choice is the small value.)"""
        inserted = self.twin.inserted
        if inserted and data.draw(st.integers(0, 3), label="fresh") < 3:
            namespace, base = data.draw(st.sampled_from(inserted), label="base")
            if data.draw(st.integers(0, 7), label="other namespace") == 7:
                namespace = data.draw(namespaces, label="namespace")
            base_pages = len(base) // PAGE_SIZE
            cut = data.draw(st.one_of(st.integers(1, base_pages), st.just(0)), label="cut")
            cut = min(cut, max_pages)
            extra = data.draw(token_lists(min_pages=max(0, min_pages - cut),
                                          max_pages=max_pages - cut), label="extension")
            tokens = base[:cut * PAGE_SIZE] + extra
        else:
            namespace = data.draw(namespaces, label="namespace")
            tokens = data.draw(token_lists(min_pages=min_pages, max_pages=max_pages),
                               label="tokens")
        return tokens, namespace

    @initialize(data=st.data())
    def seed(self, data):
        for _ in range(data.draw(st.integers(0, 4), label="seed inserts")):
            self.twin.insert(*self._request(data, 1, 6))

    @rule(data=st.data())
    def insert(self, data):
        self.twin.insert(*self._request(data, 1, 6))

    @rule(data=st.data())
    def insert_again(self, data):
        # A second insert rule doubles inserts' share of the steps: they build what the
        # other rules exercise.
        self.twin.insert(*self._request(data, 1, 6))

    @rule(data=st.data())
    def match(self, data):
        self.twin.match(*self._request(data, 0, 7))

    @rule(data=st.data())
    def borrow(self, data):
        self.twin.borrow(*self._request(data, 0, 7))

    @rule(data=st.data())
    def borrow_again(self, data):
        # Twice as many borrows as unlocks: locks pile up until node records run short.
        self.twin.borrow(*self._request(data, 0, 7))

    @rule(pick=st.integers(min_value=0, max_value=1000))
    def unlock(self, pick):
        self.twin.unlock(pick)

    @rule(num_pages=st.integers(min_value=0, max_value=12))
    def evict(self, num_pages):
        got = self.twin.evict(num_pages)
        event("evict: all asked" if got == num_pages else "evict: fewer than asked")

    @invariant()
    def agrees_with_model(self):
        self.twin.compare()


class CollidingRadixMachine(RadixMachine):
    """The same, with every page hash equal: only the token comparison tells pages apart."""

    hash_mask = 0


TestRadixModel = RadixMachine.TestCase
TestRadixModel.settings = SETTINGS
TestRadixModelCollidingHashes = CollidingRadixMachine.TestCase
TestRadixModelCollidingHashes.settings = SETTINGS


# -- a seeded random walk: the same comparison, with every rare path reached for sure ----------


def random_request(rng: random.Random, twin: Twin, min_pages: int, max_pages: int):
    if twin.inserted and rng.random() < 0.8:
        namespace, base = rng.choice(twin.inserted)
        if rng.random() < 0.1:
            namespace = rng.choice(NAMESPACES)
        cut = min(rng.randint(0, len(base) // PAGE_SIZE), max_pages)
        tokens = base[:cut * PAGE_SIZE]
        extra_pages = rng.randint(max(0, min_pages - cut), max_pages - cut)
    else:
        namespace = rng.choice(NAMESPACES)
        tokens = []
        extra_pages = rng.randint(min_pages, max_pages)
    for _ in range(extra_pages):
        tokens = tokens + list(rng.choice(PATTERNS))
    if rng.random() < 0.3:
        tokens = tokens + [rng.choice((7, 2**31 - 1))]
    return tokens, namespace


@pytest.mark.parametrize("hash_mask", [None, 0], ids=["hashed", "colliding"])
def test_seeded_walk_agrees_with_model(segment_name, hash_mask):
    """2000 random steps (fixed seed) compared after each; the walk must reach the rare
    paths: CapacityError on insert, a borrow that stops at a node boundary, trims."""
    rng = random.Random(20240601)
    seen = collections.Counter()
    twin = Twin(segment_name, hash_mask, note=lambda what: seen.update([what]))
    try:
        for _ in range(2000 if not LONG else 20000):
            op = rng.choices(("insert", "match", "borrow", "unlock", "evict"),
                             weights=(4, 2, 4, 2, 1))[0]
            if op == "insert":
                twin.insert(*random_request(rng, twin, 1, 6))
            elif op == "match":
                twin.match(*random_request(rng, twin, 0, 7))
            elif op == "borrow":
                twin.borrow(*random_request(rng, twin, 0, 7))
            elif op == "unlock":
                twin.unlock(rng.randrange(1000))
            else:
                twin.evict(rng.randint(0, 12))
            twin.compare()
    finally:
        twin.close()
    assert seen["insert: CapacityError"] > 0, seen
    assert seen["borrow: stopped at a node boundary, no record for a split"] > 0, seen
    assert seen["insert: some pages existed"] > 0 and seen["borrow: hit"] > 0, seen
    assert seen["insert: a part donated"] > 0, seen
    assert seen["parts: a node's parts evicted"] > 0, seen
    assert seen["parts: evicted past an older locked node"] > 0, seen
