"""`python -m hostkv bench`: seeded engine workloads, several processes, the KV data path.

Sections of the report:

* engine: each workload replayed through a WorkerView as an engine would run it (allocate
  with prefix reuse, then release with commit), beside the same flow on the pure-Python
  reference model (tests/reference_model.py, when run from a source checkout) and the C-level
  ceilings (token comparison with memcmp, copying pages of the pool);
* eviction: the cost of `cache.evict` per evicted token on a filled tree;
* decode: `append_tokens` per sequence per step at batch 1 to 128, beside a Python
  list.append per sequence (the least an engine's own bookkeeping costs);
* processes: the shared-prompt and multi-turn workloads split across 1, 2 and 4 spawned
  processes sharing one segment (aggregate throughput, lock or call latency percentiles);
* data path: gathering and scattering KV pages through `cache.pages_tensor()` against a
  plain torch tensor and numpy;
* pool faults: copying into a freshly attached pool, cold and after `start_prefault()`,
  against a copy between two pre-faulted numpy buffers;
* tree: the workloads as match-then-insert straight on the compiled tree (no WorkerView).

Every figure is reported beside a baseline measured in the same process, because the machines
this runs on are shared and noisy: ratios hold where absolute numbers drift.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import math
import multiprocessing
import os
import platform
import queue
import sys
import threading
import time
import traceback
import uuid
import zlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from hostkv import _pages, _radix
from hostkv.cache import HostKVCache
from hostkv.config import HostKVConfig, KVLayout
from hostkv.worker_view import SequenceRequest, WorkerView

PAGE_SIZE = 16
VOCAB = 32_000
PROCESS_COUNTS = (1, 2, 4)
ENGINE_ROUNDS = 3               # turns each engine-section peer takes (its fastest is kept)
EVICT_CHUNK_PAGES = 64          # pages per cache.evict call when timing eviction
# The data path's KV layout: 16 layers x 4 KV heads x 64 dims in bfloat16 is 16 KiB per
# token, 256 KiB per 16-token page (a 7B-class model's 2 MiB pages would not fit the pool).
DATA_LAYOUT = KVLayout(num_layers=16, num_kv_heads=4, head_dim=64, dtype="bfloat16")
GATHER_PAGES = 64


# -- workloads ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Workload:
    """A named list of requests (token arrays) and the pool size to replay them with.

    Attributes:
        name: The workload's name in the report.
        requests: Prompt token arrays, in arrival order.
        streams: Per request, the conversation it belongs to: requests of one stream depend
            on each other (a chat's turns), so one process replays a stream, in order.
        pool_fraction: The pool's size as a fraction of the working set (1.0: no eviction).
    """

    name: str
    requests: List[np.ndarray]
    streams: List[int]
    pool_fraction: float = 1.0

    @property
    def tokens(self) -> int:
        return sum(len(r) for r in self.requests)

    @property
    def max_pages(self) -> int:
        """Full pages of all requests together (an upper bound of the working set)."""
        return sum(len(r) // PAGE_SIZE for r in self.requests)

    def working_set_pages(self) -> int:
        """Distinct cacheable pages: full pages with distinct prefixes across all requests."""
        ids: Dict[Tuple[int, bytes], int] = {}
        for tokens in self.requests:
            parent = -1
            full = len(tokens) // PAGE_SIZE
            for page in tokens[:full * PAGE_SIZE].reshape(full, PAGE_SIZE):
                parent = ids.setdefault((parent, page.tobytes()), len(ids))
        return len(ids)

    def pool_pages(self, live: int = 1) -> int:
        """The pool for a replay: pool_fraction of the working set, plus room for `live`
        sequences of the largest request (one per process replaying at once)."""
        largest = max(-(-len(r) // PAGE_SIZE) for r in self.requests)
        return int(math.ceil(self.working_set_pages() * self.pool_fraction)) + live * largest + 16

    def share(self, index: int, count: int) -> List[int]:
        """The requests process `index` of `count` replays: every stream that is index mod
        count, in arrival order."""
        return [i for i, stream in enumerate(self.streams) if stream % count == index]


Requests = Tuple[List[np.ndarray], List[int]]      # requests and their streams


def shared_prompts(rng: np.random.Generator, num_requests: int) -> Requests:
    """8 system prompts of 2,048 tokens, picked at random; each request adds a unique
    256-token suffix. Every request is a stream of its own."""
    prompts = [rng.integers(0, VOCAB, 2048, dtype=np.int32) for _ in range(8)]
    picks = rng.integers(0, len(prompts), num_requests)
    requests = [np.concatenate([prompts[p], rng.integers(0, VOCAB, 256, dtype=np.int32)])
                for p in picks]
    return requests, list(range(num_requests))


def multi_turn(rng: np.random.Generator, num_chats: int, turns: int = 10) -> Requests:
    """Chats whose every turn resends the whole context plus ~200 new tokens; interleaved
    turn by turn. A chat is a stream."""
    contexts = [np.empty(0, dtype=np.int32) for _ in range(num_chats)]
    requests = []
    for _ in range(turns):
        for c in range(num_chats):
            grow = int(rng.integers(150, 251))
            contexts[c] = np.concatenate([contexts[c], rng.integers(0, VOCAB, grow, dtype=np.int32)])
            requests.append(contexts[c])
    return requests, list(range(num_chats)) * turns


def no_sharing(rng: np.random.Generator, num_requests: int) -> Requests:
    """Random 1,024-token prompts: nothing to reuse, every page is new."""
    return ([rng.integers(0, VOCAB, 1024, dtype=np.int32) for _ in range(num_requests)],
            list(range(num_requests)))


def short_prompts(rng: np.random.Generator, num_requests: int) -> Requests:
    """Prompts of 100-300 tokens: one of 16 shared 96-token preambles and a unique rest,
    where a request's fixed cost, not its length, decides the speed."""
    preambles = [rng.integers(0, VOCAB, 96, dtype=np.int32) for _ in range(16)]
    picks = rng.integers(0, len(preambles), num_requests)
    rests = rng.integers(4, 205, num_requests)
    requests = [np.concatenate([preambles[p], rng.integers(0, VOCAB, int(r), dtype=np.int32)])
                for p, r in zip(picks, rests)]
    return requests, list(range(num_requests))


GENERATORS: Dict[str, Callable[[np.random.Generator, int], Requests]] = {
    "short-prompt": short_prompts,
    "shared-prompt": shared_prompts,
    "multi-turn": multi_turn,
    "no-sharing": no_sharing,
}


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    """How to build a workload: small and picklable, so spawned processes rebuild the very
    same requests from it instead of receiving them.

    Attributes:
        name: The name in the report.
        kind: A key of GENERATORS.
        size: Requests (shared-prompt, no-sharing) or chats (multi-turn).
        seed: The generator's seed (mixed with the name, so workloads differ).
        pool_fraction: See Workload.
    """

    name: str
    kind: str
    size: int
    seed: int
    pool_fraction: float = 1.0

    def build(self) -> Workload:
        rng = np.random.default_rng([self.seed, zlib.crc32(self.name.encode())])
        requests, streams = GENERATORS[self.kind](rng, self.size)
        return Workload(self.name, requests, streams, self.pool_fraction)


def workload_specs(quick: bool, seed: int) -> List[WorkloadSpec]:
    """The engine workloads (the eviction one: shared prompts in a pool of a quarter of
    their working set)."""
    return [
        WorkloadSpec("shared-prompt", "shared-prompt", 300 if quick else 2000, seed),
        WorkloadSpec("multi-turn", "multi-turn", 12 if quick else 60, seed),
        WorkloadSpec("no-sharing", "no-sharing", 200 if quick else 1000, seed),
        WorkloadSpec("short-prompt", "short-prompt", 500 if quick else 5000, seed),
        WorkloadSpec("eviction", "shared-prompt", 300 if quick else 2000, seed, pool_fraction=0.25),
    ]


# -- engines: one replay loop drives either the WorkerView or the reference model ---------------


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


# -- segments ------------------------------------------------------------------------------------


def _segment_name() -> str:
    return f"hostkv-bench-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _create(num_pages: int, requests: int, **config: Any) -> HostKVCache:
    """A fresh segment for a benchmark (64-byte stand-in pages unless a layout is given)."""
    config.setdefault("page_bytes", 64)
    return HostKVCache.create(_segment_name(), HostKVConfig(
        num_pages=num_pages, page_size=PAGE_SIZE,
        radix_node_capacity=max(4096, 2 * requests), **config))


def _destroy(cache: HostKVCache) -> None:
    """Closes and unlinks a benchmark's segment (unlinks it even while views pin the map)."""
    try:
        cache.close()
    finally:
        HostKVCache.unlink_segment(cache.name)


def lock_metrics(cache: HostKVCache) -> Optional[Dict[str, np.ndarray]]:
    """The segment's lock counters, if this build keeps them (cache.metrics(), or fields of
    cache.stats()): acquisitions, total wait and hold ns, and the wait and hold histograms
    (log2 ns buckets) as arrays, so that two snapshots subtract."""
    source = cache.metrics() if hasattr(cache, "metrics") else cache.stats()
    names = ("lock_acquisitions", "lock_wait_ns", "lock_hold_ns",
             "lock_wait_histogram", "lock_hold_histogram")
    if not all(hasattr(source, name) for name in names):
        return None
    return {name: np.asarray(getattr(source, name), dtype=np.int64) for name in names}


def lock_summary(before: Dict[str, np.ndarray], after: Dict[str, np.ndarray]) -> Dict[str, float]:
    """Lock wait and hold between two lock_metrics snapshots: p50 and p99 (upper bounds of
    their log2 buckets) and means, in ns."""
    delta = {name: after[name] - before[name] for name in after}
    acquisitions = max(int(delta["lock_acquisitions"]), 1)
    out: Dict[str, float] = {"acquisitions": int(delta["lock_acquisitions"])}
    for kind in ("wait", "hold"):
        histogram = delta[f"lock_{kind}_histogram"]
        out[f"{kind}_p50_ns"] = histogram_percentile(histogram, 0.5)
        out[f"{kind}_p99_ns"] = histogram_percentile(histogram, 0.99)
        out[f"{kind}_mean_ns"] = int(delta[f"lock_{kind}_ns"]) / acquisitions
        out[f"{kind}_total_ns"] = int(delta[f"lock_{kind}_ns"])
    return out


def histogram_percentile(histogram: np.ndarray, q: float) -> float:
    """The q-quantile of a log2 histogram (entry b counts [2^(b-1), 2^b) ns, entry 0 zero)
    as the upper bound of its bucket, in ns."""
    total = int(histogram.sum())
    if total == 0:
        return 0.0
    bucket = int(np.searchsorted(np.cumsum(histogram), q * total))
    return 0.0 if bucket == 0 else float(2 ** bucket)


def latency_summary(latencies_ns: np.ndarray) -> Dict[str, float]:
    """p50 and p99 of call latencies, in µs."""
    if not len(latencies_ns):
        return {"p50_us": 0.0, "p99_us": 0.0}
    p50, p99 = np.percentile(latencies_ns, [50, 99])
    return {"p50_us": float(p50) / 1e3, "p99_us": float(p99) / 1e3}


# -- engine section ------------------------------------------------------------------------------


def _figures(tokens: int, requests: int, elapsed: float, reused: int, evicted: int
             ) -> Dict[str, Any]:
    """The figures of one replay: throughput, latency per request, hit rate, evictions."""
    return {
        "tokens_per_s": tokens / elapsed,
        "us_per_request": elapsed / requests * 1e6,
        "hit_rate": reused / tokens,
        "evicted_pages": evicted,
        "seconds": elapsed,
    }


def run_engine_compiled(workload: Workload, num_pages: int, as_lists: bool = False
                        ) -> Dict[str, Any]:
    """Replays the workload through a WorkerView on a fresh segment; as_lists hands the
    prompts over as Python lists (vLLM's and SGLang's own format), converted untimed."""
    requests = ([tokens.tolist() for tokens in workload.requests] if as_lists
                else workload.requests)
    cache = _create(num_pages, len(workload.requests))
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


# -- eviction ------------------------------------------------------------------------------------


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


# -- several processes ---------------------------------------------------------------------------


@contextlib.contextmanager
def _replay_job(name: str, spec: WorkloadSpec, index: int, count: int
                ) -> Iterator[Callable[[], Dict[str, Any]]]:
    """Worker `index` of `count`: attaches, opens its WorkerView and yields the replay of its
    share of the workload (Workload.share)."""
    workload = spec.build()
    seq_ids = workload.share(index, count)
    requests = [workload.requests[i] for i in seq_ids]
    cache = HostKVCache.attach(name)
    try:
        with WorkerView(cache) as view:
            engine = ViewEngine(view)

            def run() -> Dict[str, Any]:
                reused, latencies = replay(engine, requests, seq_ids)
                return {"reused": reused, "tokens": sum(len(r) for r in requests),
                        "latencies": latencies}

            yield run
    finally:
        cache.close()


@contextlib.contextmanager
def _spin_job(iterations: int, index: int, count: int) -> Iterator[Callable[[], Dict[str, Any]]]:
    """The control: a pure-Python loop, to see how many cores the processes really get."""
    def run() -> Dict[str, Any]:
        total = 0
        for i in range(iterations):
            total += i
        return {"iterations": iterations}

    yield run


def _worker_main(job: Callable[..., Any], job_args: Tuple[Any, ...], index: int, count: int,
                 barriers: Tuple[Any, Any], results: Any) -> None:
    """A spawned worker: prepares its job, says so at the first barrier, starts at the
    second with the others, and puts its start and end times and figures (or its
    traceback) on results."""
    try:
        with job(*job_args, index, count) as run:
            for barrier in barriers:
                barrier.wait()
            start = time.perf_counter()
            figures = run()
            end = time.perf_counter()
            results.put({"index": index, "start": start, "end": end, **figures})
    except BaseException:
        for barrier in barriers:
            barrier.abort()
        results.put({"index": index, "error": traceback.format_exc()})


def _run_spawned(job: Callable[..., Any], job_args: Tuple[Any, ...], count: int,
                 at_start: Callable[[], Any] = lambda: None, timeout: float = 300.0
                 ) -> Tuple[Any, List[Dict[str, Any]], float]:
    """Runs job in `count` spawned processes released together once all are prepared;
    calls at_start in between, so that what it reads (the lock's counters) is read before
    any worker starts and after every worker's preparation.

    Returns:
        (what at_start returned, each worker's result, seconds from the first start to the
        last end).
    """
    ctx = multiprocessing.get_context("spawn")
    prepared, go = ctx.Barrier(count + 1), ctx.Barrier(count + 1)
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker_main,
                         args=(job, job_args, i, count, (prepared, go), results))
             for i in range(count)]
    for p in procs:
        p.start()
    started = None
    try:
        prepared.wait(timeout)
        started = at_start()
        go.wait(timeout)
    except threading.BrokenBarrierError:
        pass                        # a worker failed before the start: _collect says why
    except BaseException:
        go.abort()                  # the workers give up instead of waiting for ever
        raise
    outcomes = _collect(procs, results, count, timeout)
    return started, outcomes, max(o["end"] for o in outcomes) - min(o["start"] for o in outcomes)


def _collect(procs: List[Any], results: Any, count: int, timeout: float) -> List[Dict[str, Any]]:
    """Every worker's result; raises RuntimeError with the first worker's traceback."""
    outcomes: List[Dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    try:
        while len(outcomes) < count:
            try:
                outcomes.append(results.get(timeout=max(0.1, deadline - time.monotonic())))
            except queue.Empty:
                raise RuntimeError(f"bench workers gave {len(outcomes)} of {count} results "
                                   f"in {timeout:.0f} s") from None
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    errors = [o["error"] for o in outcomes if "error" in o]
    if errors:
        raise RuntimeError("a bench worker failed:\n" + errors[0])
    return outcomes


def run_processes(spec: WorkloadSpec, count: int) -> Dict[str, Any]:
    """Replays the workload from `count` spawned processes sharing one fresh segment."""
    workload = spec.build()
    cache = _create(workload.pool_pages(live=count), len(workload.requests))
    try:
        before, outcomes, elapsed = _run_spawned(_replay_job, (cache.name, spec), count,
                                                 at_start=lambda: lock_metrics(cache))
        after = lock_metrics(cache)
        evicted = cache.stats().evicted_pages
        cache.check()
    finally:
        _destroy(cache)
    row = _figures(sum(o["tokens"] for o in outcomes), len(workload.requests), elapsed,
                   sum(o["reused"] for o in outcomes), evicted)
    latencies = np.concatenate([o["latencies"] for o in outcomes])
    row.update({"workload": spec.name, "processes": count, "requests": len(workload.requests),
                "call_latency": latency_summary(latencies)})
    if before is not None and after is not None:
        row["lock"] = lock_summary(before, after)
        row["lock_held_fraction"] = row["lock"]["hold_total_ns"] / (elapsed * 1e9)
    return row


def cpu_rate(count: int, iterations: int) -> float:
    """Aggregate loop iterations per second of `count` processes spinning at once."""
    _, _, elapsed = _run_spawned(_spin_job, (iterations,), count)
    return count * iterations / elapsed


def process_scaling(specs: Sequence[WorkloadSpec], quick: bool) -> List[Dict[str, Any]]:
    """Each workload from 1, 2 and 4 processes, best of `repeats` runs; ratios are to the
    1-process run. Beside each run, as many processes spinning in a pure-Python loop measure
    the parallelism the machine gave right then (a shared 2-core machine may give none)."""
    iterations = 1_000_000 if quick else 5_000_000
    repeats = 1 if quick else 3
    rows = []
    for spec in specs:
        single: Dict[str, Any] = {}
        for count in PROCESS_COUNTS:
            cpu = max(cpu_rate(count, iterations) for _ in range(repeats))
            row = max((run_processes(spec, count) for _ in range(repeats)),
                      key=lambda r: r["tokens_per_s"])
            row.update({"repeats": repeats, "cpu_iterations_per_s": cpu})
            single = single or row
            row["vs_one_process"] = row["tokens_per_s"] / single["tokens_per_s"]
            row["cpu_vs_one_process"] = cpu / single["cpu_iterations_per_s"]
            rows.append(row)
    return rows


def process_specs(quick: bool, seed: int) -> List[WorkloadSpec]:
    """The process section's workloads: shared-prompt and multi-turn, four times the engine
    section's size in a full run, so that a run lasts long enough to compare."""
    scale = 1 if quick else 4
    return [dataclasses.replace(spec, size=spec.size * scale)
            for spec in workload_specs(quick, seed) if spec.name in ("shared-prompt", "multi-turn")]


# -- the KV data path ----------------------------------------------------------------------------


def _median_rates(ops: Dict[str, Callable[[], None]], nbytes: int, seconds: float,
                  rounds: int = 9) -> Dict[str, float]:
    """Bytes per second of each op (median of rounds). The ops take turns within a round,
    so that a noisy neighbour slows them alike, in a new seeded order each round, so that
    no op always follows the same one (and inherits its dirty cache lines)."""
    for op in ops.values():
        op()                                            # warm up (first touch, allocations)
    calls = {}
    for name, op in ops.items():
        start = time.perf_counter()
        n = 0
        while time.perf_counter() - start < seconds / rounds / len(ops):
            op()
            n += 1
        calls[name] = max(n, 1)
    samples: Dict[str, List[float]] = {name: [] for name in ops}
    order = list(ops)
    shuffle = np.random.default_rng(0).shuffle
    for _ in range(rounds):
        shuffle(order)
        for name in order:
            op = ops[name]
            start = time.perf_counter()
            for _ in range(calls[name]):
                op()
            samples[name].append(nbytes * calls[name] / (time.perf_counter() - start))
    return {name: float(np.median(rates)) for name, rates in samples.items()}


class _Rotation:
    """Hands out its items in turn, so that repeated ops touch different pages."""

    def __init__(self, items: Sequence[Any]) -> None:
        self._items = items
        self._next = 0

    def __call__(self) -> Any:
        item = self._items[self._next]
        self._next = (self._next + 1) % len(self._items)
        return item


def data_path(quick: bool, seed: int) -> Dict[str, Any]:
    """Gathers GATHER_PAGES random pages into a preallocated destination and scatters them
    back: through pages_tensor(), a plain torch tensor of the same shape, and numpy on
    pages_array(); plus the memcpy ceiling, copying as many contiguous pages of the pool."""
    num_pages = 256 if quick else 4096                  # 64 MiB or 1 GiB at 256 KiB a page
    page_bytes = DATA_LAYOUT.page_bytes(PAGE_SIZE)
    rng = np.random.default_rng(seed)
    batches = [rng.choice(num_pages, GATHER_PAGES, replace=False) for _ in range(16)]
    starts = rng.integers(0, num_pages - GATHER_PAGES, 16).tolist()
    report: Dict[str, Any] = {"layout": dataclasses.asdict(DATA_LAYOUT), "page_bytes": page_bytes,
                              "pool_bytes": num_pages * page_bytes, "pages_per_op": GATHER_PAGES}
    cache = _create(num_pages, 0, page_bytes=0, kv_layout=DATA_LAYOUT)
    try:
        ops = _numpy_ops(cache, _Rotation(batches), _Rotation(starts))
        ops.update(_torch_ops(cache, batches, report))
        with _one_torch_thread():
            rates = _median_rates(ops, GATHER_PAGES * page_bytes, 2.0 if quick else 12.0)
        del ops                                         # drop the views before closing
    finally:
        _destroy(cache)
    report["gbytes_per_s"] = {name: rate / 1e9 for name, rate in rates.items()}
    if "tensor_gather" in rates:
        report["pages_tensor_vs_plain"] = {kind: rates[f"tensor_{kind}"] / rates[f"plain_{kind}"]
                                           for kind in ("gather", "scatter")}
    return report


@contextlib.contextmanager
def _one_torch_thread() -> Iterator[None]:
    """Runs torch on one thread, as numpy and the copy ceiling run: on a small shared machine
    torch's thread pool turns a 1 ms gather into hundreds of ms whenever a neighbour holds a
    core, so ratios would measure the neighbour."""
    try:
        import torch
    except ImportError:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _numpy_ops(cache: HostKVCache, batch: Callable[[], np.ndarray],
               start: Callable[[], int]) -> Dict[str, Callable[[], None]]:
    """The copy ceiling (contiguous pages), take(out=) gathers, fancy-index scatters."""
    pool = cache.pages_array()
    pool.fill(1)                                        # touch the pool once
    host = np.empty((GATHER_PAGES, pool.shape[1]), dtype=np.uint8)

    def copy_ceiling() -> None:
        first = start()
        np.copyto(host, pool[first:first + GATHER_PAGES])

    def numpy_gather() -> None:
        # mode="clip": with the default "raise", numpy copies through a temporary buffer.
        np.take(pool, batch(), axis=0, out=host, mode="clip")

    def numpy_scatter() -> None:
        pool[batch()] = host

    return {"copy_ceiling": copy_ceiling, "numpy_gather": numpy_gather,
            "numpy_scatter": numpy_scatter}


def _torch_ops(cache: HostKVCache, batches: List[np.ndarray],
               report: Dict[str, Any]) -> Dict[str, Callable[[], None]]:
    """index_select gathers and index_copy_ scatters on pages_tensor() and on a plain tensor
    of the same shape; none (and a note in the report) without torch."""
    try:
        import torch
    except ImportError:
        report["torch"] = "skipped: torch is not installed"
        return {}
    report["torch_threads"] = 1
    shared = cache.pages_tensor()
    plain = torch.ones_like(shared)
    dst = torch.empty((GATHER_PAGES,) + tuple(shared.shape[1:]), dtype=shared.dtype)
    index = _Rotation([torch.from_numpy(b.astype(np.int64)) for b in batches])
    return {
        "tensor_gather": lambda: torch.index_select(shared, 0, index(), out=dst),
        "plain_gather": lambda: torch.index_select(plain, 0, index(), out=dst),
        "tensor_scatter": lambda: shared.index_copy_(0, index(), dst),
        "plain_scatter": lambda: plain.index_copy_(0, index(), dst),
    }


# -- pool faults ----------------------------------------------------------------------------------


def pool_faults(quick: bool) -> Dict[str, Any]:
    """np.copyto of the whole pool from a pre-faulted buffer, through a handle attached just
    before, so that its mapping has no page table entries yet (each attach maps anew, as
    another process would): cold, and after start_prefault() has finished (timed too),
    beside np.copyto between two pre-faulted numpy buffers of the same size. The three take
    turns within each round, in a new order each round; medians are reported."""
    nbytes = (64 if quick else 512) << 20
    rounds = 3 if quick else 7
    page_bytes = DATA_LAYOUT.page_bytes(PAGE_SIZE)
    src = np.ones(nbytes, np.uint8)                     # both written: faulted in
    dst = np.zeros(nbytes, np.uint8)
    samples: Dict[str, List[float]] = {"cold": [], "prefaulted": [], "plain": [], "prefault": []}
    last: Dict[str, Any] = {}                           # the last prefault's status
    creator = _create(nbytes // page_bytes, 0, page_bytes=0, kv_layout=DATA_LAYOUT)
    try:
        def into_pool(prefault: bool) -> float:
            handle = HostKVCache.attach(creator.name)
            try:
                if prefault:
                    handle.start_prefault()
                    while handle.prefault_status().state == "running":
                        time.sleep(0.001)
                    status = handle.prefault_status()
                    samples["prefault"].append(status.done_bytes / max(status.seconds, 1e-9))
                    last.update(method=status.method, prefault_state=status.state,
                                huge_pages=status.huge_pages, huge_policy=status.huge_policy)
                pool = handle.pages_array().reshape(-1)
                start = time.perf_counter()
                np.copyto(pool, src)
                elapsed = time.perf_counter() - start
                del pool                                # before close()
            finally:
                handle.close()
            return nbytes / elapsed

        def plain() -> float:
            start = time.perf_counter()
            np.copyto(dst, src)
            return nbytes / (time.perf_counter() - start)

        ops: Dict[str, Callable[[], float]] = {
            "cold": lambda: into_pool(False), "prefaulted": lambda: into_pool(True),
            "plain": plain}
        order = list(ops)
        shuffle = np.random.default_rng(0).shuffle
        for _ in range(rounds):
            shuffle(order)
            for name in order:
                samples[name].append(ops[name]())
    finally:
        _destroy(creator)
    return {"pool_bytes": nbytes, "rounds": rounds, **last,
            "gbytes_per_s": {name: float(np.median(rates)) / 1e9
                             for name, rates in samples.items()}}


# -- the tree section (no WorkerView) ------------------------------------------------------------


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


# -- ceilings, machine, the whole run --------------------------------------------------------------


def _load_reference_model() -> Any:
    """The pure-Python reference model from a source checkout's tests/, or None."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "tests", "reference_model.py")
    if not os.path.exists(path):
        return None
    spec = importlib.util.spec_from_file_location("hostkv_reference_model", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def compare_ceiling(seconds: float = 0.3) -> float:
    """Tokens per second that a C loop compares page by page with memcmp (one core)."""
    a = np.arange(1 << 16, dtype=np.int32)
    b = a.copy()
    repeats = 1
    while True:
        start = time.perf_counter()
        _radix._compare_ceiling(a, b, PAGE_SIZE, repeats)
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return len(a) * repeats / elapsed
        repeats *= 2


def machine_info() -> Dict[str, Any]:
    """Cores, CPU model, python, numpy and torch versions."""
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        import torch
        torch_version = torch.__version__
    except ImportError:
        torch_version = None
    return {"cpu": cpu, "cores": len(os.sched_getaffinity(0)), "cpus": os.cpu_count(),
            "load_average_1m": os.getloadavg()[0],
            "platform": platform.platform(), "python": platform.python_version(),
            "numpy": np.__version__, "torch": torch_version}


def run(quick: bool = False, seed: int = 0) -> Dict[str, Any]:
    """Runs every section; returns the results as a JSON-ready dict."""
    model_module = _load_reference_model()
    specs = workload_specs(quick, seed)
    workloads = {spec.name: spec.build() for spec in specs}
    kv = data_path(quick, seed)
    ceilings = {
        "compare_tokens_per_s": compare_ceiling(0.1 if quick else 0.5),
        "copy_bytes_per_s": kv["gbytes_per_s"]["copy_ceiling"] * 1e9,
    }
    ceilings["copy_tokens_per_s"] = ceilings["copy_bytes_per_s"] / DATA_LAYOUT.token_bytes
    rounds = 1 if quick else ENGINE_ROUNDS
    engine = [engine_row(w, model_module, ceilings, rounds) for w in workloads.values()]
    return {
        "machine": machine_info(),
        "seed": seed,
        "quick": quick,
        "page_size": PAGE_SIZE,
        "reference_model": model_module is not None,
        "ceilings": ceilings,
        "engine": engine,
        "engine_rounds": rounds,
        "eviction": eviction_cost(workloads["eviction"], model_module),
        "eviction_by_demand": eviction_by_demand(workloads["shared-prompt"]),
        "decode": decode_steps(quick, seed),
        "processes": process_scaling(process_specs(quick, seed), quick),
        "data_path": kv,
        "pool_faults": pool_faults(quick),
        "tree": [tree_row(workloads[n], model_module, ceilings)
                 for n in ("shared-prompt", "multi-turn")],
    }


# -- decode steps -------------------------------------------------------------------------------


DECODE_BATCHES = (1, 8, 32, 128)


def decode_steps(quick: bool, seed: int) -> List[Dict[str, Any]]:
    """append_tokens through a WorkerView: one decode step of a batch of sequences per call
    (a 100-token prompt each; a page is taken every PAGE_SIZE steps), ns per sequence per
    step at each batch size, beside the least an engine's own bookkeeping costs (a Python
    list.append per sequence per step), timed alternately in the same process."""
    steps = 64 if quick else 512
    rng = np.random.default_rng(seed)
    rows = []
    for batch in DECODE_BATCHES:
        cache = _create(batch * (steps // PAGE_SIZE + 10) + 64, batch)
        try:
            view = WorkerView(cache)
            step_tokens = rng.integers(0, VOCAB, (steps, batch)).tolist()
            best = {"view": float("inf"), "list": float("inf")}
            for rep in range(3):
                seq_ids = list(range(rep * batch, (rep + 1) * batch))
                view.allocate_pages_for_sequences_with_prefix(
                    [SequenceRequest(s, rng.integers(0, VOCAB, 100).tolist()) for s in seq_ids])
                start = time.perf_counter()
                for tokens in step_tokens:
                    view.append_tokens(seq_ids, tokens)
                best["view"] = min(best["view"], time.perf_counter() - start)
                view.release(seq_ids, commit=False)
                histories: List[List[int]] = [[] for _ in range(batch)]
                start = time.perf_counter()
                for tokens in step_tokens:
                    for history, token in zip(histories, tokens):
                        history.append(token)
                best["list"] = min(best["list"], time.perf_counter() - start)
            view.close()
        finally:
            _destroy(cache)
        view_ns = best["view"] / (steps * batch) * 1e9
        list_ns = best["list"] / (steps * batch) * 1e9
        rows.append({"batch": batch, "steps": steps, "ns_per_sequence_step": view_ns,
                     "list_append_ns": list_ns, "vs_list_append": view_ns / list_ns})
    return rows


# -- the table -------------------------------------------------------------------------------------


def _ratio(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.1f}x"


def _run_line(label: str, figures: Dict[str, Any], requests: Any, extra: str = "") -> str:
    return (f"{label:<15} {requests:>8} {figures['tokens_per_s'] / 1e6:>9.2f} "
            f"{figures['us_per_request']:>8.1f} {figures['hit_rate']:>8.1%} "
            f"{figures['evicted_pages']:>8}{extra}")


def _percent(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def _format_runs(title: str, rows: List[Dict[str, Any]], engine: bool) -> List[str]:
    """A section of compiled rows, each followed by its reference row; the engine section
    adds the KV-copy ratio and the share of the time the segment's lock was held."""
    header = (f"{'workload':<15} {'requests':>8} {'M tok/s':>9} {'us/req':>8} {'hit rate':>8} "
              f"{'evicted':>8} {'x ref':>7} {'% cmp':>6}"
              + (f" {'x copy':>7} {'locked':>7} {'x chain':>7}" if engine else ""))
    lines = [title, header]
    for row in rows:
        extra = (f" {_ratio(row.get('speedup_vs_reference')):>7} "
                 f"{row['compare_ceiling_fraction']:>6.1%}")
        if engine:
            extra += (f" {_ratio(row.get('vs_kv_copy')):>7} "
                      f"{_percent(row['compiled'].get('lock_held_fraction')):>7} "
                      f"{_ratio(row.get('speedup_vs_hash_chain')):>7}")
        lines.append(_run_line(row["workload"], row["compiled"], row["requests"], extra))
        if "compiled_list" in row:
            chain = (f" {'':>6} {'':>7} {'':>7} {_ratio(row['list_speedup_vs_hash_chain']):>7}"
                     if "list_speedup_vs_hash_chain" in row else "")
            lines.append(_run_line("  list input", row["compiled_list"], "",
                                   f" {_ratio(row.get('list_speedup_vs_reference')):>7}" + chain))
        if "reference" in row:
            lines.append(_run_line("  reference", row["reference"], ""))
        if "hash_chain" in row:
            lines.append(_run_line("  hash chain", row["hash_chain"], ""))
    return lines


def _format_processes(rows: List[Dict[str, Any]]) -> List[str]:
    """The process-scaling section: aggregate throughput, call and lock latencies (µs)."""
    has_lock = any("lock" in row for row in rows)
    latencies = ["call p50", "call p99"] + (
        ["wait p50", "wait p99", "hold p50", "hold p99"] if has_lock else [])
    lines = [
        "processes: the requests split across N spawned processes sharing one segment, each "
        "with its own WorkerView (best of the repeats; latencies in us)",
        f"{'workload':<15} {'requests':>8} {'procs':>5} {'M tok/s':>8} {'x 1 proc':>8} "
        f"{'cpu x':>6} {'hit rate':>8}" + "".join(f" {name:>8}" for name in latencies)
        + (f" {'hold avg':>8} {'locked':>7}" if has_lock else ""),
    ]
    for row in rows:
        values = [row["call_latency"]["p50_us"], row["call_latency"]["p99_us"]]
        if has_lock:
            values += [row["lock"][f"{kind}_{q}_ns"] / 1e3
                       for kind in ("wait", "hold") for q in ("p50", "p99")]
        lines.append(
            f"{row['workload']:<15} {row['requests']:>8} {row['processes']:>5} "
            f"{row['tokens_per_s'] / 1e6:>8.2f} {row['vs_one_process']:>7.2f}x "
            f"{row['cpu_vs_one_process']:>5.2f}x {row['hit_rate']:>8.1%}"
            + "".join(f" {value:>8.1f}" for value in values)
            + (f" {row['lock']['hold_mean_ns'] / 1e3:>8.2f}"
               f" {_percent(row.get('lock_held_fraction')):>7}" if has_lock else ""))
    lines.append("cpu x: as many processes spinning in a Python loop over one, just before: the "
                 "parallelism the machine gave")
    lines.append("call: one WorkerView call timed by its caller (lock wait + hold + Python)")
    if has_lock:
        lines.append("wait/hold: the segment's lock histograms (upper bounds of log2 buckets); "
                     "hold avg: mean hold per acquisition (exact: does a hold get longer when "
                     "processes share the lock?); locked: share of the wall time the lock was "
                     "held")
    return lines


def _format_decode(rows: List[Dict[str, Any]]) -> List[str]:
    lines = ["decode: append_tokens(seq_ids, tokens) through a WorkerView, one step of the "
             "batch per call (best of 3)",
             "batch   steps  ns/seq/step  list.append ns  x list.append"]
    for row in rows:
        lines.append(f"{row['batch']:5d} {row['steps']:7d} {row['ns_per_sequence_step']:12.0f} "
                     f"{row['list_append_ns']:15.1f} {row['vs_list_append']:14.1f}")
    lines.append("x list.append: the step's time over a Python loop that appends each token to "
                 "a list per sequence (the least an engine's own bookkeeping costs)")
    return lines


def _format_data_path(kv: Dict[str, Any]) -> List[str]:
    """The KV data path section: GB/s of each op and the pages_tensor / plain ratios."""
    layout = kv["layout"]
    rates = kv["gbytes_per_s"]
    lines = [
        f"KV data path: {kv['pages_per_op']} random pages of {kv['page_bytes'] // 1024} KiB "
        f"(KVLayout({layout['num_layers']}, {layout['num_kv_heads']}, {layout['head_dim']}, "
        f"{layout['dtype']}), pool {kv['pool_bytes'] / 2**30:.2f} GiB), GB/s, one thread",
        f"{'op':<8} {'pages_tensor':>12} {'plain':>8} {'ratio':>6} {'numpy':>8}",
    ]
    for kind in ("gather", "scatter"):
        if "pages_tensor_vs_plain" in kv:
            torch_part = (f"{rates[f'tensor_{kind}']:>12.1f} {rates[f'plain_{kind}']:>8.1f} "
                          f"{kv['pages_tensor_vs_plain'][kind]:>6.2f}")
        else:
            torch_part = f"{'n/a':>12} {'n/a':>8} {'n/a':>6}"
        lines.append(f"{kind:<8} {torch_part} {rates[f'numpy_{kind}']:>8.1f}")
    lines.append(f"{'copy':<8} {'':>12} {'':>8} {'':>6} {rates['copy_ceiling']:>8.1f}")
    lines.append("gather: index_select(out=) into a preallocated tensor (numpy: take(out=)); "
                 "scatter: index_copy_ (numpy: pool[idx] = ...); copy: as many contiguous "
                 "pages (the ceiling)")
    if "torch" in kv:
        lines.append(f"torch: {kv['torch']}")
    return lines


def _format_pool_faults(pf: Dict[str, Any]) -> List[str]:
    """The pool-faults section: GB/s of a copy into a fresh mapping, cold and pre-faulted."""
    rates = pf["gbytes_per_s"]
    return [
        f"pool faults: np.copyto of {pf['pool_bytes'] >> 20} MiB into a freshly attached pool, "
        f"GB/s, median of {pf['rounds']} interleaved rounds",
        f"cold {rates['cold']:.1f}; after start_prefault() {rates['prefaulted']:.1f}; plain "
        f"(between pre-faulted numpy buffers) {rates['plain']:.1f}; the prefault itself "
        f"{rates['prefault']:.1f} ({pf['method']}, {pf['prefault_state']})",
        f"huge pages: {pf['huge_pages']} (tmpfs policy {pf['huge_policy'] or 'unknown'})",
    ]


def format_table(report: Dict[str, Any]) -> str:
    """The report as plain-text tables."""
    m = report["machine"]
    c = report["ceilings"]
    ev = report["eviction"]
    lines = [
        f"{m['cpu']}, {m['cores']} cores; Python {m['python']}, numpy {m['numpy']}, "
        f"torch {m['torch'] or 'not installed'}; page size {report['page_size']}, "
        f"seed {report['seed']}{' (quick)' if report['quick'] else ''}; load average "
        f"{m['load_average_1m']:.2f} at the start",
        f"C-level ceilings (one core): token compare {c['compare_tokens_per_s'] / 1e9:.2f} G "
        f"tokens/s (memcmp); page copy {c['copy_bytes_per_s'] / 1e9:.1f} GB/s (numpy copy of "
        f"{report['data_path']['pages_per_op']} contiguous pool pages) = "
        f"{c['copy_tokens_per_s'] / 1e6:.2f} M tokens/s of KV at "
        f"{DATA_LAYOUT.token_bytes // 1024} KiB/token",
        "",
    ]
    lines += _format_runs("engine: allocate -> release (commit) per request through a "
                          "WorkerView; reference: RadixModel + free list", report["engine"],
                          engine=True)
    lines.append("x ref: tokens/s over the reference's (us/req improves by the same factor); "
                 "the same flow and LRU should reuse and evict exactly as the reference does")
    lines.append("% cmp: of the token-compare ceiling; x copy: over copying those tokens' KV at "
                 "the page-copy ceiling; locked: share of the time the segment's lock was held")
    lines.append("x chain: tokens/s over the hash chain's (vLLM's algorithm: chained page "
                 "hashes in a dict, re-implemented without pages, refcounts or eviction; lists "
                 "in); not run where the pool is too small to cache everything")
    lines.append("rows: numpy int32 input; list input: the same prompts as Python lists (the "
                 "engines' own format), converted inside the timed calls; us/req: one request "
                 "per call (batch 1), allocate + release; hostkv and the hash chain take "
                 f"turns, {report['engine_rounds']} runs each, and keep their fastest")
    ref = (f"; reference {ev['reference_ns_per_token']:.0f} ns/token "
           f"({ev['speedup_vs_reference']:.1f}x)" if "reference_ns_per_token" in ev else "")
    lines += ["", f"eviction: cache.evict({ev['chunk_pages']}) until empty on the "
              f"{ev['workload']} workload's tree: {ev['ns_per_token']:.1f} ns per evicted token"
              f"{ref}",
              f"eviction by demand: one allocation of {report['eviction_by_demand']['allocated_pages']} "
              f"pages that evicts {report['eviction_by_demand']['evicted_pages']} on the "
              f"{report['eviction_by_demand']['workload']} workload's cache: "
              f"{report['eviction_by_demand']['ns_per_token']:.1f} ns per evicted token", ""]
    lines += _format_decode(report["decode"])
    lines.append("")
    lines += _format_processes(report["processes"])
    lines.append("")
    lines += _format_data_path(report["data_path"])
    lines.append("")
    lines += _format_pool_faults(report["pool_faults"])
    lines.append("")
    lines += _format_runs("tree: match then insert straight on _radix (no WorkerView)",
                          report["tree"], engine=False)
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of `python -m hostkv bench`."""
    parser = argparse.ArgumentParser(prog="python -m hostkv bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small workloads (CI smoke test)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    report = run(quick=args.quick, seed=args.seed)
    print(format_table(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0
