"""What every section shares: fresh segments, lock and latency summaries, a replay's
figures."""

from __future__ import annotations

import os
import uuid
from typing import Any, Dict, Optional

import numpy as np

from hostkv import _histogram
from hostkv.bench.workloads import PAGE_SIZE
from hostkv.cache import HostKVCache
from hostkv.config import HostKVConfig


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
    """The q-quantile of a log2 histogram (hostkv._histogram's buckets), in ns."""
    return float(_histogram.percentile([int(c) for c in histogram], q))


def latency_summary(latencies_ns: np.ndarray) -> Dict[str, float]:
    """p50 and p99 of call latencies, in µs."""
    if not len(latencies_ns):
        return {"p50_us": 0.0, "p99_us": 0.0}
    p50, p99 = np.percentile(latencies_ns, [50, 99])
    return {"p50_us": float(p50) / 1e3, "p99_us": float(p99) / 1e3}


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
