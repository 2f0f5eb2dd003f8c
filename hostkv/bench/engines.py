"""The engine flows the bench replays: one replay loop drives a WorkerView, the reference
model or the hash chain (vLLM's algorithm), each as an engine would call it."""

from __future__ import annotations

import time
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np

from hostkv.bench.workloads import PAGE_SIZE
from hostkv.worker_view import SequenceRequest, WorkerView


class ViewEngine:
    """The engine flow on a WorkerView: one batch call per step, batches of one request."""

    def __init__(self, view: WorkerView) -> None:
        self._allocate_batch = view.allocate_pages_for_sequences_with_prefix
        self._release_batch = view.release

    def allocate(self, seq_id: int, tokens: np.ndarray) -> int:
        """Allocates the sequence with prefix reuse; returns its reused tokens."""
        return self._allocate_batch([SequenceRequest(seq_id, tokens)])[0].reused_tokens

    def release(self, seq_id: int) -> None:
        """Commits the sequence's full pages and drops its references."""
        self._release_batch([seq_id])


class ReferenceEngine:
    """The same flow on the reference model: borrow the longest cached prefix (capped as a
    WorkerView caps it, so the last token is always computed), take the rest of the pages
    from a free list (evicting through the model when short), insert on release. Tokens go
    to the model as numpy arrays, as an engine holds them (the model converts them once)."""

    def __init__(self, model_module: Any, num_pages: int, node_capacity: int) -> None:
        self.model = model_module.RadixModel(PAGE_SIZE, node_capacity)
        self._free = list(range(num_pages - 1, -1, -1))
        self._live: Dict[int, Tuple[np.ndarray, List[int], int, Any]] = {}

    def allocate(self, seq_id: int, tokens: np.ndarray) -> int:
        """Borrows the prefix and takes the other pages; returns the reused tokens."""
        reusable = (len(tokens) - 1) // PAGE_SIZE
        borrowed, node = self.model.borrow(tokens[:reusable * PAGE_SIZE], 0)
        needed = -(-len(tokens) // PAGE_SIZE) - len(borrowed)      # ceil: the last page too
        if needed > len(self._free):
            self._free.extend(self.model.evict_pages(needed - len(self._free)))
        if needed > len(self._free):
            raise RuntimeError(f"reference engine: {needed} pages needed, {len(self._free)} free")
        own = [self._free.pop() for _ in range(needed)]
        self._live[seq_id] = (tokens, borrowed + own, len(borrowed), node)
        return len(borrowed) * PAGE_SIZE

    def release(self, seq_id: int) -> None:
        """Inserts the full pages, frees the pages the tree did not adopt, unlocks."""
        tokens, table, reused, node = self._live.pop(seq_id)
        full = len(tokens) // PAGE_SIZE
        existing, _, _ = self.model.insert(tokens, table[:full], 0)
        # The tree adopted table[existing:full]; own pages it did not adopt go back.
        self._free.extend(table[reused:max(existing, reused)])
        self._free.extend(table[full:])
        if node is not None:
            self.model.unlock(node)

    @property
    def evicted_pages(self) -> int:
        return int(self.model.evicted)


class HashChainEngine:
    """The algorithm under vLLM's prefix cache, re-implemented as ../shared/peer-bench's
    hash-chain dict is (no vLLM code): a full page is named by hash((its parent page's
    name, tuple(its tokens))), and a dict holds the names of cached pages. Reuse is capped
    as a WorkerView caps it (the last token is always computed). No pages, refcounts or
    eviction: a lower bound on that design's cost per request. Tokens come as Python
    lists, its native format."""

    _ROOT = 0x5BD1E995

    def __init__(self) -> None:
        self._cached: Dict[int, bool] = {}
        self._live: Dict[int, Tuple[List[int], int, int]] = {}

    def allocate(self, seq_id: int, tokens: List[int]) -> int:
        """Names the prompt's reusable pages until the first one not cached; returns the
        reused tokens."""
        cached, name, matched = self._cached, self._ROOT, 0
        for start in range(0, (len(tokens) - 1) // PAGE_SIZE * PAGE_SIZE, PAGE_SIZE):
            following = hash((name, tuple(tokens[start:start + PAGE_SIZE])))
            if following not in cached:
                break
            name = following
            matched += 1
        self._live[seq_id] = (tokens, name, matched)
        return matched * PAGE_SIZE

    def release(self, seq_id: int) -> None:
        """Caches the full pages after the matched ones."""
        tokens, name, matched = self._live.pop(seq_id)
        cached = self._cached
        for start in range(matched * PAGE_SIZE, len(tokens) // PAGE_SIZE * PAGE_SIZE, PAGE_SIZE):
            name = hash((name, tuple(tokens[start:start + PAGE_SIZE])))
            cached[name] = True

    evicted_pages = 0


def replay(engine: Any, requests: Sequence[np.ndarray], seq_ids: Sequence[int]
           ) -> Tuple[int, np.ndarray]:
    """Runs allocate -> release for each request, in order.

    Returns:
        (reused tokens in all, the latency of every call in ns: allocate, release, ...).
    """
    clock = time.perf_counter_ns
    allocate, release = engine.allocate, engine.release
    stamps: List[int] = []
    stamp = stamps.append
    reused = 0
    for seq_id, tokens in zip(seq_ids, requests):
        stamp(clock())
        reused += allocate(seq_id, tokens)
        stamp(clock())
        release(seq_id)
    stamp(clock())
    return reused, np.diff(np.array(stamps, dtype=np.int64))
