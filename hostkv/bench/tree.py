"""The tree section: the workloads as match-then-insert straight on the compiled tree (no
WorkerView), beside the reference model."""

from __future__ import annotations

import time
from typing import Any, Dict

import numpy as np

from hostkv import _pages, _radix
from hostkv.bench.common import _create, _destroy, _figures
from hostkv.bench.workloads import PAGE_SIZE, Workload


def run_tree_compiled(workload: Workload, num_pages: int) -> Dict[str, Any]:
    """Replays the workload straight on the tree: match, allocate, insert, release."""
    cache = _create(num_pages, len(workload.requests))
    seg = cache._segment
    hit_tokens = 0
    evicted = 0
    try:
        start = time.perf_counter()
        for tokens in workload.requests:
            matched = _radix.match(seg, tokens, 0)
            full = len(tokens) // PAGE_SIZE
            missing = full - len(matched)
            hit_tokens += len(matched) * PAGE_SIZE
            if missing:
                short = missing - seg.free_pages
                if short > 0:
                    evicted += _radix.evict(seg, short)
                page_table = np.empty(full, dtype=np.int32)
                page_table[:len(matched)] = matched
                page_table[len(matched):] = own = _pages.alloc_pages(seg, missing)
                _radix.insert(seg, tokens, page_table, 0)
                _pages.free_pages(seg, own)
        elapsed = time.perf_counter() - start
        cache.check()
    finally:
        _destroy(cache)
    return _figures(workload.tokens, len(workload.requests), elapsed, hit_tokens, evicted)


def run_tree_reference(model_module: Any, workload: Workload, num_pages: int) -> Dict[str, Any]:
    """The same replay against the pure-Python reference model (the baseline)."""
    model = model_module.RadixModel(PAGE_SIZE, max(4096, 2 * len(workload.requests)))
    free = list(range(num_pages - 1, -1, -1))
    hit_tokens = 0
    evicted = 0
    start = time.perf_counter()
    for tokens in workload.requests:
        matched = model.match(tokens, 0)
        full = len(tokens) // PAGE_SIZE
        missing = full - len(matched)
        hit_tokens += len(matched) * PAGE_SIZE
        if missing:
            if missing > len(free):
                released = model.evict_pages(missing - len(free))
                evicted += len(released)
                free.extend(released)
            own = [free.pop() for _ in range(missing)]
            model.insert(tokens, list(matched) + own, 0)
    elapsed = time.perf_counter() - start
    return _figures(workload.tokens, len(workload.requests), elapsed, hit_tokens, evicted)


def tree_row(workload: Workload, model_module: Any, ceilings: Dict[str, float]) -> Dict[str, Any]:
    """One workload of the tree section."""
    num_pages = workload.max_pages + 64
    compiled = run_tree_compiled(workload, num_pages)
    row: Dict[str, Any] = {
        "workload": workload.name, "requests": len(workload.requests),
        "tokens": workload.tokens, "compiled": compiled,
        "compare_ceiling_fraction": compiled["tokens_per_s"] / ceilings["compare_tokens_per_s"],
    }
    if model_module is not None:
        reference = run_tree_reference(model_module, workload, num_pages)
        row["reference"] = reference
        row["speedup_vs_reference"] = compiled["tokens_per_s"] / reference["tokens_per_s"]
    return row
