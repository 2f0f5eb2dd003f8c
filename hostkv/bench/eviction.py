"""The eviction sections: cache.evict on a filled tree, and an allocation that has to
evict."""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, Tuple

import numpy as np

from hostkv import _pages, _radix
from hostkv.bench.common import _create, _destroy
from hostkv.bench.engines import ViewEngine, replay
from hostkv.bench.workloads import PAGE_SIZE, VOCAB, Workload
from hostkv.cache import HostKVCache
from hostkv.worker_view import SequenceRequest, WorkerView

EVICT_CHUNK_PAGES = 64          # pages per cache.evict call when timing eviction


def _fill_tree(cache: HostKVCache, workload: Workload) -> None:
    """Caches every request's full pages straight through the tree (no sequences)."""
    seg = cache._segment
    for tokens in workload.requests:
        matched = _radix.match(seg, tokens, 0)
        full = len(tokens) // PAGE_SIZE
        if full > len(matched):
            own = _pages.alloc_pages(seg, full - len(matched))
            _radix.insert(seg, tokens, np.concatenate([matched, own]).astype(np.int32), 0)
            _pages.free_pages(seg, own)


def _fill_model(model: Any, workload: Workload) -> None:
    """Caches every request's full pages in the reference model, numbering pages in turn."""
    next_page = 0
    for tokens in workload.requests:
        matched = model.match(tokens, 0)
        full = len(tokens) // PAGE_SIZE
        model.insert(tokens, matched + list(range(next_page, next_page + full - len(matched))), 0)
        next_page += full - len(matched)


def _time_evictions(evict: Callable[[int], int]) -> Tuple[int, float]:
    """Calls evict(EVICT_CHUNK_PAGES) until nothing is left; (pages evicted, seconds inside)."""
    pages = 0
    elapsed = 0.0
    while True:
        start = time.perf_counter()
        n = evict(EVICT_CHUNK_PAGES)
        elapsed += time.perf_counter() - start
        if not n:
            return pages, elapsed
        pages += n


def eviction_cost(workload: Workload, model_module: Any) -> Dict[str, Any]:
    """ns per evicted token: the workload's pages cached, then evicted in LRU order, in calls
    of EVICT_CHUNK_PAGES pages (an engine short of about one request's pages)."""
    node_capacity = max(4096, 2 * len(workload.requests))
    cache = _create(workload.working_set_pages() + 16, len(workload.requests))
    try:
        _fill_tree(cache, workload)
        pages, elapsed = _time_evictions(cache.evict)
        cache.check()
    finally:
        _destroy(cache)
    out: Dict[str, Any] = {"workload": workload.name, "chunk_pages": EVICT_CHUNK_PAGES,
                           "evicted_pages": pages,
                           "ns_per_token": elapsed / (pages * PAGE_SIZE) * 1e9}
    if model_module is not None:
        model = model_module.RadixModel(PAGE_SIZE, node_capacity)
        _fill_model(model, workload)
        ref_pages, ref_elapsed = _time_evictions(lambda n: len(model.evict_pages(n)))
        out["reference_ns_per_token"] = ref_elapsed / (ref_pages * PAGE_SIZE) * 1e9
        out["speedup_vs_reference"] = out["reference_ns_per_token"] / out["ns_per_token"]
    return out


def eviction_by_demand(workload: Workload) -> Dict[str, Any]:
    """ns per evicted token when an allocation has to evict: the workload cached through a
    WorkerView, then one request that needs every free page and half of the cached ones
    (the time includes allocating all of its pages; its tokens are new, so nothing matches)."""
    cache = _create(workload.working_set_pages() + 16, len(workload.requests) + 1)
    try:
        with WorkerView(cache) as view:
            replay(ViewEngine(view), workload.requests, range(len(workload.requests)))
            stats = cache.stats()
            to_evict = stats.cached_pages // 2
            needed = stats.free_pages + to_evict
            tokens = (np.arange(needed * PAGE_SIZE, dtype=np.int64) % (VOCAB * 4) + VOCAB
                      ).astype(np.int32)
            start = time.perf_counter()
            view.allocate_pages_for_sequences_with_prefix(
                [SequenceRequest(len(workload.requests), tokens)])
            elapsed = time.perf_counter() - start
            evicted = cache.stats().evicted_pages - stats.evicted_pages
            view.release([len(workload.requests)], commit=False)
        cache.check()
    finally:
        _destroy(cache)
    return {"workload": workload.name, "evicted_pages": evicted, "allocated_pages": needed,
            "ns_per_token": elapsed / (evicted * PAGE_SIZE) * 1e9}
