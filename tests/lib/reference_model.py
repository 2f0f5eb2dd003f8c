"""A pure-Python reference model of hostkv's radix prefix cache (the compiled tree's twin).

It is written from the contract (docs/design.md, "Semantics", and the summary below), not
from _radix.pyx, so that the hypothesis state machine in test_radix_model.py can drive both
side by side and any difference is a finding in one of them. It is also the plain baseline for
benchmarks: dict-based nodes, O(1) child lookup by the first page's token tuple, a match
costs O(pages matched), an eviction heapifies the unlocked leaves once (as SGLang's
RadixCache does).

The contract, in short:

* A page holds ``page_size`` token ids; only full pages are cached or matched.
* A node covers a run of >= 1 pages under one namespace; its children are keyed by their
  first page's token tuple. There are no root nodes: ``top[namespace]`` maps first pages to
  top-level nodes.
* ``insert`` adds the pages beyond the longest cached prefix as ONE new node, a child of the
  last matched node; a match ending inside a node splits it into a head (the matched pages,
  taking the node's place) and a tail (the rest, the old node, now the head's child).
* ``borrow`` matches and locks; a match ending inside a node splits it so the lock covers
  exactly the borrowed pages. A lock on a node also locks every ancestor (counts per node).
* Recency is a global tick, advanced once per use (a borrow that matched, an insert that
  cached or re-found pages); a use stamps the tick on the node and all its ancestors. A new
  node starts at the current tick and is then touched; a split head copies the old node's
  stamp. ``match`` is pure: no stamp, no counter.
* Eviction takes unlocked leaves in exact least-recently-used order (a tie is a bug in the
  model's bookkeeping and fails an assert); a leaf larger than what is still needed is trimmed
  from its tail; a parent that becomes an unlocked leaf joins the candidates.
* Node records are limited to ``node_capacity``. When short, insert and borrow first evict
  whole LRU leaves off their own path; insert raises ModelCapacityError (nothing changed) when
  even that is not enough, borrow stops at the previous node boundary instead.
"""

from __future__ import annotations

import heapq
from typing import Dict, Iterable, List, Optional, Set, Tuple

__all__ = ["ModelCapacityError", "ModelNode", "RadixModel"]

PageKey = Tuple[int, ...]


class ModelCapacityError(Exception):
    """No node record is free even after evicting every unlocked leaf off the caller's path."""


class ModelNode:
    """One node: a run of pages under one namespace."""

    __slots__ = ("id", "parent", "namespace", "keys", "pages", "children", "lock", "last_access")

    def __init__(self, node_id: int, parent: Optional["ModelNode"], namespace: int,
                 keys: List[PageKey], pages: List[int], last_access: int) -> None:
        self.id = node_id                   # creation order; only breaks heap ties, never decides
        self.parent = parent
        self.namespace = namespace
        self.keys = keys                    # one token tuple per page
        self.pages = pages                  # the page index holding each page's KV
        self.children: Dict[PageKey, ModelNode] = {}    # first page's tokens -> child
        self.lock = 0
        self.last_access = last_access

    def __repr__(self) -> str:
        return (f"<ModelNode {self.id} ns={self.namespace} pages={self.pages} lock={self.lock} "
                f"t={self.last_access} children={len(self.children)}>")


class RadixModel:
    """The reference radix prefix cache. Tokens are any sequence of ints (list, tuple, numpy)."""

    def __init__(self, page_size: int, node_capacity: int) -> None:
        if page_size < 1 or node_capacity < 1:
            raise ValueError(
                f"page_size {page_size} and node_capacity {node_capacity} must be >= 1")
        self.page_size = page_size
        self.node_capacity = node_capacity
        self.top: Dict[int, Dict[PageKey, ModelNode]] = {}
        self.live: Set[ModelNode] = set()
        self.cached_page_set: Set[int] = set()
        self.tick = 0
        self._next_id = 0
        # Counters; each compares with the CacheStats field in parentheses.
        self.cached = 0         # pages held by the tree                 (cached_pages)
        self.protected = 0      # pages of locked nodes                  (borrowed_pages)
        self.nodes = 0          # nodes in use                           (tree_nodes)
        self.lookups = 0        # borrows                                (lookups)
        self.lookup_tokens = 0  # their tokens, partial pages included   (lookup_tokens)
        self.hit_tokens = 0     # their borrowed tokens                  (hit_tokens)
        self.inserted = 0       # pages adopted                          (inserted_pages)
        self.evicted = 0        # pages let go                           (evicted_pages)

    # -- helpers -------------------------------------------------------------------------------

    def page_keys(self, tokens: Iterable[int]) -> Tuple[List[PageKey], int]:
        """The full pages of tokens as tuples, and the number of tokens."""
        toks = tokens.tolist() if hasattr(tokens, "tolist") else [int(t) for t in tokens]
        ps = self.page_size
        n = len(toks) // ps
        return [tuple(toks[i * ps:(i + 1) * ps]) for i in range(n)], len(toks)

    def _siblings(self, parent: Optional[ModelNode], namespace: int) -> Dict[PageKey, ModelNode]:
        if parent is not None:
            return parent.children
        return self.top.setdefault(namespace, {})

    def _walk(self, keys: List[PageKey], namespace: int):
        """(matched pages, deepest node with a matched page or None, its matched page count)."""
        pages: List[int] = []
        node: Optional[ModelNode] = None
        in_node = 0
        children = self.top.get(namespace)
        pos = 0
        while children and pos < len(keys):
            child = children.get(keys[pos])
            if child is None:
                break
            in_node = 0
            for key, page in zip(child.keys, child.pages):
                if pos == len(keys) or keys[pos] != key:
                    break
                pages.append(page)
                pos += 1
                in_node += 1
            node = child
            if in_node < len(child.keys):
                break
            children = child.children
        return pages, node, in_node

    def _touch(self, node: Optional[ModelNode]) -> None:
        self.tick += 1
        while node is not None:
            node.last_access = self.tick
            node = node.parent

    def _lock(self, node: Optional[ModelNode]) -> None:
        while node is not None:
            if node.lock == 0:
                self.protected += len(node.pages)
            node.lock += 1
            node = node.parent

    def _unlock(self, node: Optional[ModelNode]) -> None:
        while node is not None:
            if node.lock <= 0:
                raise ValueError(f"{node!r} unlocked more often than locked")
            node.lock -= 1
            if node.lock == 0:
                self.protected -= len(node.pages)
            node = node.parent

    def _new_node(self, parent, namespace, keys, pages, last_access) -> ModelNode:
        node = ModelNode(self._next_id, parent, namespace, keys, pages, last_access)
        self._next_id += 1
        self.live.add(node)
        self.nodes += 1
        return node

    def _split(self, node: ModelNode, head_pages: int) -> ModelNode:
        """Splits node after head_pages pages. The new head takes the node's place; the node
        keeps its identity (and so its lock handles) as the tail."""
        assert 0 < head_pages < len(node.pages)
        head = self._new_node(node.parent, node.namespace, node.keys[:head_pages],
                              node.pages[:head_pages], node.last_access)
        head.lock = node.lock
        self._siblings(node.parent, node.namespace)[head.keys[0]] = head
        node.keys = node.keys[head_pages:]
        node.pages = node.pages[head_pages:]
        node.parent = head
        head.children[node.keys[0]] = node
        return head

    def _is_evictable(self, node: ModelNode) -> bool:
        return node.lock == 0 and not node.children

    def _evictable_heap(self) -> list:
        heap = [(n.last_access, n.id, n) for n in self.live if self._is_evictable(n)]
        heapq.heapify(heap)
        return heap

    @staticmethod
    def _pop_lru(heap: list) -> ModelNode:
        access, _, node = heapq.heappop(heap)
        assert not heap or heap[0][0] != access, (
            f"two evictable leaves share last access {access}: {node!r} and {heap[0][2]!r}")
        return node

    def _remove_leaf(self, node: ModelNode, heap: list) -> List[int]:
        assert self._is_evictable(node), node
        parent = node.parent
        siblings = self._siblings(parent, node.namespace)
        del siblings[node.keys[0]]
        if parent is None and not siblings:
            del self.top[node.namespace]
        self.live.discard(node)
        self.nodes -= 1
        self.cached -= len(node.pages)
        self.cached_page_set.difference_update(node.pages)
        if parent is not None and self._is_evictable(parent):
            heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return node.pages

    def _trim_leaf(self, node: ModelNode, drop: int) -> List[int]:
        assert 0 < drop < len(node.pages)
        dropped = node.pages[-drop:]
        self.cached_page_set.difference_update(dropped)
        del node.keys[-drop:]
        del node.pages[-drop:]
        self.cached -= drop
        return dropped

    def _freeable_records(self, protect: Optional[ModelNode]) -> int:
        """Records that evicting whole leaves could free with protect's path kept: every
        unlocked node off that path (its subtree is unlocked and off the path too)."""
        path = set()
        while protect is not None:
            path.add(protect)
            protect = protect.parent
        return sum(1 for n in self.live if n.lock == 0 and n not in path)

    def _free_records(self, want: int, protect: Optional[ModelNode]) -> None:
        """Evicts whole LRU leaves, never protect's path, until `want` records are free."""
        self._lock(protect)
        heap = self._evictable_heap()
        while self.node_capacity - self.nodes < want and heap:
            self.evicted += len(self._remove_leaf(self._pop_lru(heap), heap))
        self._unlock(protect)

    # -- the operations --------------------------------------------------------------------------

    def match(self, tokens: Iterable[int], namespace: int = 0) -> List[int]:
        """The pages of the longest cached page-aligned prefix. Changes nothing."""
        keys, _ = self.page_keys(tokens)
        return self._walk(keys, namespace)[0]

    def borrow(self, tokens: Iterable[int], namespace: int = 0):
        """Matches and locks the longest cached prefix: (pages, node to unlock, or None)."""
        keys, num_tokens = self.page_keys(tokens)
        self.lookups += 1
        self.lookup_tokens += num_tokens
        pages, node, in_node = self._walk(keys, namespace)
        if node is not None and in_node < len(node.pages):
            if self.nodes >= self.node_capacity:
                self._free_records(1, node)
            if self.nodes < self.node_capacity:
                node = self._split(node, in_node)
            else:
                del pages[len(pages) - in_node:]
                node = node.parent
        if node is None:
            return [], None
        self._lock(node)
        self._touch(node)
        self.hit_tokens += len(pages) * self.page_size
        return pages, node

    def unlock(self, node: ModelNode) -> None:
        """Undoes one borrow (or insert with lock=True) of node."""
        self._unlock(node)

    def insert(self, tokens: Iterable[int], pages: Iterable[int], namespace: int = 0,
               lock: bool = False):
        """Caches the full pages of tokens: (existing, tree pages, node of the last page).

        When every page is cached already and the match ends inside a node, that node is
        split there, as a borrow would (evicting an LRU leaf off the path for the record if
        needed), so that locking the node returned locks exactly these pages; with no record
        to be had, the whole node is returned (and touched, and locked with lock=True).

        Raises:
            ValueError: too few pages, or a page to adopt is already cached or listed twice.
            ModelCapacityError: no node record even after eviction; nothing changed.
        """
        keys, _ = self.page_keys(tokens)
        n = len(keys)
        pages = pages.tolist() if hasattr(pages, "tolist") else [int(p) for p in pages]
        if len(pages) < n:
            raise ValueError(f"{n} full pages of tokens but only {len(pages)} pages given")
        if n == 0:
            return 0, [], None
        tree_pages, node, in_node = self._walk(keys, namespace)
        existing = len(tree_pages)
        if existing == n:
            if in_node < len(node.pages):
                if self.nodes >= self.node_capacity:
                    self._free_records(1, node)
                if self.nodes < self.node_capacity:
                    node = self._split(node, in_node)
            self._touch(node)
            if lock:
                self._lock(node)
            return existing, tree_pages, node
        new_pages = pages[existing:n]
        if len(set(new_pages)) != len(new_pages) or self.cached_page_set.intersection(new_pages):
            raise ValueError(f"pages {new_pages} repeat or are already cached")
        partial = node is not None and in_node < len(node.pages)
        needed = 2 if partial else 1
        free = self.node_capacity - self.nodes
        if free < needed:
            if free + self._freeable_records(node) < needed:
                raise ModelCapacityError(f"{needed} node records needed, {free} free")
            self._free_records(needed, node)
        parent = self._split(node, in_node) if partial else node
        new = self._new_node(parent, namespace, keys[existing:], new_pages, self.tick)
        self._siblings(parent, namespace)[keys[existing]] = new
        self.cached += len(new_pages)
        self.inserted += len(new_pages)
        self.cached_page_set.update(new_pages)
        self._touch(new)
        if lock:
            self._lock(new)
        return existing, tree_pages + new_pages, new

    def evict_pages(self, num_pages: int) -> List[int]:
        """Evicts up to num_pages pages of unlocked leaves, LRU first; returns the pages the
        tree let go, in eviction order (the compiled tree returns their number)."""
        heap = self._evictable_heap()
        released: List[int] = []
        while len(released) < num_pages and heap:
            node = self._pop_lru(heap)
            if len(node.pages) <= num_pages - len(released):
                released += self._remove_leaf(node, heap)
            else:
                released += self._trim_leaf(node, num_pages - len(released))
        self.evicted += len(released)
        return released

    # -- inspection ------------------------------------------------------------------------------

    def path(self, node: ModelNode) -> Tuple[int, tuple, tuple]:
        """(namespace, tokens of the whole path to node's end, pages of that path)."""
        chain = []
        while node is not None:
            chain.append(node)
            node = node.parent
        tokens: List[int] = []
        pages: List[int] = []
        for n in reversed(chain):
            for key in n.keys:
                tokens.extend(key)
            pages.extend(n.pages)
        return chain[0].namespace, tuple(tokens), tuple(pages)

    def contents(self) -> Set[Tuple[int, tuple, tuple, int]]:
        """One (namespace, path tokens, path pages, lock count) per node, as tree_contents."""
        return {self.path(n) + (n.lock,) for n in self.live}

    def check(self) -> None:
        """Asserts the model's own bookkeeping (counters re-derived from the nodes)."""
        assert self.nodes == len(self.live) <= self.node_capacity
        assert self.cached == sum(len(n.pages) for n in self.live) == len(self.cached_page_set)
        assert self.protected == sum(len(n.pages) for n in self.live if n.lock)
        for n in self.live:
            assert n.pages and len(n.pages) == len(n.keys), n
            assert n.lock >= sum(c.lock for c in n.children.values()), n
            assert self._siblings(n.parent, n.namespace).get(n.keys[0]) is n, n
            if n.parent is not None:
                assert n.parent in self.live and n.parent.namespace == n.namespace, n
                assert n.parent.last_access >= n.last_access, n
