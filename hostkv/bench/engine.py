"""The engine section: each workload through a WorkerView, beside the reference model and
the hash chain, and their ratios to the C-level ceilings."""

from __future__ import annotations

import time
from typing import Any, Dict, List

from hostkv.bench.common import (_create, _destroy, _figures, latency_summary, lock_metrics,
                                  lock_summary)
from hostkv.bench.engines import HashChainEngine, ReferenceEngine, ViewEngine, replay
from hostkv.bench.workloads import Workload
from hostkv.worker_view import WorkerView

ENGINE_ROUNDS = 3               # turns each engine-section peer takes (its fastest is kept)


def run_engine_compiled(workload: Workload, num_pages: int, as_lists: bool = False,
                        **config: Any) -> Dict[str, Any]:
    """Replays the workload through a WorkerView on a fresh segment; as_lists hands the
    prompts over as Python lists (vLLM's and SGLang's own format), converted untimed;
    config: more HostKVConfig fields (window parts)."""
    requests = ([tokens.tolist() for tokens in workload.requests] if as_lists
                else workload.requests)
    cache = _create(num_pages, len(workload.requests), **config)
    try:
        with WorkerView(cache) as view:
            before = lock_metrics(cache)
            start = time.perf_counter()
            reused, latencies = replay(ViewEngine(view), requests,
                                       range(len(workload.requests)))
            elapsed = time.perf_counter() - start
            after = lock_metrics(cache)
        stats = cache.stats()
        cache.check()
    finally:
        _destroy(cache)
    figures = _figures(workload.tokens, len(workload.requests), elapsed, reused,
                       stats.evicted_pages)
    figures["call_latency"] = latency_summary(latencies)
    if stats.num_parts:
        figures["parts"] = {"evicted": stats.parts_evicted, "donated": stats.parts_donated,
                            "pages_without": stats.pages_without_part}
    if before is not None and after is not None:
        figures["lock"] = lock_summary(before, after)
        figures["lock_held_fraction"] = figures["lock"]["hold_total_ns"] / (elapsed * 1e9)
    return figures


def run_engine_reference(model_module: Any, workload: Workload, num_pages: int) -> Dict[str, Any]:
    """Replays the workload through the same flow on the reference model."""
    engine = ReferenceEngine(model_module, num_pages, max(4096, 2 * len(workload.requests)))
    start = time.perf_counter()
    reused, latencies = replay(engine, workload.requests, range(len(workload.requests)))
    elapsed = time.perf_counter() - start
    figures = _figures(workload.tokens, len(workload.requests), elapsed, reused,
                       engine.evicted_pages)
    figures["call_latency"] = latency_summary(latencies)
    return figures


def run_engine_hash_chain(workload: Workload) -> Dict[str, Any]:
    """Replays the workload through HashChainEngine (prompts as lists, converted untimed)."""
    requests = [tokens.tolist() for tokens in workload.requests]
    start = time.perf_counter()
    reused, latencies = replay(HashChainEngine(), requests, range(len(requests)))
    elapsed = time.perf_counter() - start
    figures = _figures(workload.tokens, len(requests), elapsed, reused, 0)
    figures["call_latency"] = latency_summary(latencies)
    return figures


def _fastest(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    return min(runs, key=lambda figures: figures["seconds"])


def engine_row(workload: Workload, model_module: Any, ceilings: Dict[str, float],
               rounds: int = ENGINE_ROUNDS) -> Dict[str, Any]:
    """One workload of the engine section: compiled, reference, and their ratios.

    The WorkerView (numpy and list input) and the hash chain run `rounds` times, taking
    turns, and each keeps its fastest run: on a shared machine a burst of other work then
    slows all of them alike or none, instead of tilting one ratio."""
    num_pages = workload.pool_pages()
    chained = workload.pool_fraction == 1.0
    compiled_runs, listed_runs, chain_runs = [], [], []
    for _ in range(rounds):
        compiled_runs.append(run_engine_compiled(workload, num_pages))
        listed_runs.append(run_engine_compiled(workload, num_pages, as_lists=True))
        if chained:
            # Without eviction the hash chain reuses exactly what the tree does (it cannot
            # evict).
            chain_runs.append(run_engine_hash_chain(workload))
    compiled = _fastest(compiled_runs)
    row: Dict[str, Any] = {
        "workload": workload.name, "requests": len(workload.requests),
        "tokens": workload.tokens, "pool_pages": num_pages,
        "pool_fraction": workload.pool_fraction, "compiled": compiled,
        "compare_ceiling_fraction": compiled["tokens_per_s"] / ceilings["compare_tokens_per_s"],
    }
    if ceilings.get("copy_tokens_per_s"):
        row["vs_kv_copy"] = compiled["tokens_per_s"] / ceilings["copy_tokens_per_s"]
    listed = _fastest(listed_runs)
    row["compiled_list"] = listed
    if chained:
        chain = _fastest(chain_runs)
        row["hash_chain"] = chain
        row["speedup_vs_hash_chain"] = compiled["tokens_per_s"] / chain["tokens_per_s"]
        row["list_speedup_vs_hash_chain"] = listed["tokens_per_s"] / chain["tokens_per_s"]
    if model_module is not None:
        reference = run_engine_reference(model_module, workload, num_pages)
        row["reference"] = reference
        row["speedup_vs_reference"] = compiled["tokens_per_s"] / reference["tokens_per_s"]
        row["list_speedup_vs_reference"] = listed["tokens_per_s"] / reference["tokens_per_s"]
    return row
