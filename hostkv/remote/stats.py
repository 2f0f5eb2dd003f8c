"""A remote tier's counters: kept in its process (RemoteTier.stats()) and published in the
segment's side block for `python -m hostkv stats` (shared_stats.py).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Any, Dict, Optional, Tuple

from hostkv import _histogram, prometheus
from hostkv.remote.shared_stats import SlotWriter, writer_for

__all__ = ["HISTOGRAM_BUCKETS", "INVALID_REASONS", "SHARED_COUNTERS", "RemoteStats",
           "TierCounters"]

HISTOGRAM_BUCKETS = 32
# Reasons decode_value gives for a value it refuses ("missing" aside); any other is "other".
INVALID_REASONS = ("truncated", "magic", "format", "layout", "namespace", "key", "tokens",
                   "checksum")


@dataclasses.dataclass(frozen=True)
class RemoteStats:
    """One process's remote-tier counters (the segment's own are in HostKVCache.stats()).

    Attributes:
        lookups: Lookups queued.
        lookups_skipped: Lookups answered at once without asking the store (breaker open,
            queue full, tier closed).
        fetches: Round trips to the store for lookups (in Prometheus, the count of the
            fetch_seconds histogram).
        hit_pages: Pages found in the store and valid.
        miss_pages: Pages asked for and absent.
        invalid_pages: Values that failed a check, by reason ("layout", "tokens",
            "checksum", "truncated", "namespace", "key", "format", "magic"): never loaded.
            A segment whose shared counters were made by a version without a reason
            does not sum that reason's counts across processes.
        inserted_pages: Fetched pages now in the local segment.
        insert_failed: Fetched pages not inserted (no local pages free, or the local prefix
            they follow was evicted meanwhile).
        published_pages: Pages queued for writing.
        written_pages: Pages sent to the store.
        present_pages: Pages not sent because the store had them (their TTL renewed).
        writes_dropped: Pages not written: queue full, breaker open, too many bytes in
            flight, a store error, or evicted locally before the writer could borrow them.
        errors: Store calls that failed (timeouts, refused connections, errors), whole or
            in part (a cluster node down while the others answered).
        unavailable_pages: Pages not fetched or written because their cluster node was
            down while others answered (a lookup's chain stops at the first of them).
        breaker_opens: Times the circuit breaker opened.
        breaker_open: Whether it is open now.
        bytes_up, bytes_down: Value bytes sent and received.
        queue_depth: Lookups and writes waiting now.
        fetch_seconds: Total time of the lookups' round trips.
        fetch_latency_histogram: Round trips per log2 bucket of microseconds: entry b counts
            durations in [2**(b-1), 2**b) us, entry 0 those under 1 us (whole us: 0).
    """

    lookups: int
    lookups_skipped: int
    fetches: int
    hit_pages: int
    miss_pages: int
    invalid_pages: Dict[str, int]
    inserted_pages: int
    insert_failed: int
    published_pages: int
    written_pages: int
    present_pages: int
    writes_dropped: int
    errors: int
    unavailable_pages: int
    breaker_opens: int
    breaker_open: bool
    bytes_up: int
    bytes_down: int
    queue_depth: int
    fetch_seconds: float
    fetch_latency_histogram: Tuple[int, ...]

    def prometheus_text(self, prefix: str = "hostkv_remote") -> str:
        """The counters in Prometheus' text format, for an engine's own /metrics, under the
        names `python -m hostkv stats --prometheus` gives every process's sums
        (hostkv/prometheus.py): ``<prefix>_<counter>_total``, the gauges, and the histogram
        ``<prefix>_fetch_seconds``."""
        return prometheus.remote_text(dataclasses.asdict(self), prefix=prefix)


# What a tier publishes for `python -m hostkv stats` (shared_stats.py): every counter of
# RemoteStats by name, the fetch time in ns, and the grouped ones as "group:item".
SHARED_COUNTERS = tuple(
    [f.name for f in dataclasses.fields(RemoteStats)
     if f.name not in ("invalid_pages", "breaker_open", "queue_depth", "fetch_seconds",
                       "fetch_latency_histogram")]
    + ["fetch_ns"]
    + [f"invalid_pages:{reason}" for reason in INVALID_REASONS + ("other",)]
    + [f"fetch_latency_us:{bucket}" for bucket in range(HISTOGRAM_BUCKETS)])


class TierCounters:
    """One tier's counters, and its share of its process's slot in the side block (None:
    not shared). Thread-safe: the engine's threads and the tier's add to them."""

    def __init__(self, cache: Any) -> None:
        """Takes this process's slot of the cache's side block (shared_stats.writer_for)."""
        self._lock = threading.Lock()
        self._counts: Dict[str, Any] = collections.Counter()
        self._invalid: Dict[str, int] = collections.Counter()
        self._histogram = [0] * HISTOGRAM_BUCKETS
        self._fetch_seconds = 0.0
        self._shared: Optional[SlotWriter] = writer_for(cache, SHARED_COUNTERS)
        # The gauges this tier has put in the slot.
        self._shared_depth = 0
        self._shared_breaker = 0

    def add(self, **amounts: Any) -> None:
        """Adds to counters of RemoteStats by name."""
        with self._lock:
            for key, amount in amounts.items():
                self._counts[key] += amount
        if self._shared is not None:
            self._shared.add(amounts)

    def invalid(self, reason: str) -> None:
        """Counts a value decode_value refused, by its reason."""
        with self._lock:
            self._invalid[reason] += 1
        if self._shared is not None:
            self._shared.add({f"invalid_pages:"
                              f"{reason if reason in INVALID_REASONS else 'other'}": 1})

    def fetched(self, elapsed: float) -> None:
        """Counts one lookup round trip of elapsed seconds."""
        bucket = _histogram.bucket_of(int(elapsed * 1e6), HISTOGRAM_BUCKETS)
        with self._lock:
            self._counts["fetches"] += 1
            self._fetch_seconds += elapsed
            self._histogram[bucket] += 1
        if self._shared is not None:
            self._shared.add({"fetches": 1, "fetch_ns": int(elapsed * 1e9),
                              f"fetch_latency_us:{bucket}": 1})

    def queue_depth(self, depth: int) -> None:
        """Publishes the tier's queue depth (call holding the queue's lock)."""
        if self._shared is not None:
            self._shared.gauge("queue_depth", depth - self._shared_depth)
            self._shared_depth = depth

    def breaker_changed(self, is_open: bool, opened: bool) -> None:
        """Publishes the breaker's state (Breaker's on_change, called under its lock)."""
        if self._shared is not None:
            if opened:
                self._shared.add({"breaker_opens": 1})
            self._shared.gauge("breaker_open", int(is_open) - self._shared_breaker)
            self._shared_breaker = int(is_open)

    def snapshot(self, queue_depth: int, breaker_opens: int, breaker_open: bool) -> RemoteStats:
        """The counters now, with the gauges the caller read."""
        with self._lock:
            c = dict(self._counts)
            invalid = dict(self._invalid)
            histogram = tuple(self._histogram)
            seconds = self._fetch_seconds
        get = lambda key: int(c.get(key, 0))  # noqa: E731
        return RemoteStats(
            lookups=get("lookups"), lookups_skipped=get("lookups_skipped"),
            fetches=get("fetches"), hit_pages=get("hit_pages"), miss_pages=get("miss_pages"),
            invalid_pages=invalid, inserted_pages=get("inserted_pages"),
            insert_failed=get("insert_failed"), published_pages=get("published_pages"),
            written_pages=get("written_pages"), present_pages=get("present_pages"),
            writes_dropped=get("writes_dropped"), errors=get("errors"),
            unavailable_pages=get("unavailable_pages"),
            breaker_opens=breaker_opens, breaker_open=breaker_open,
            bytes_up=get("bytes_up"), bytes_down=get("bytes_down"), queue_depth=queue_depth,
            fetch_seconds=seconds, fetch_latency_histogram=histogram)

    def forget_shared(self) -> None:
        """Lets go of the slot without touching it (a forked child: the slot, and the lock
        that guards it, are the parent's)."""
        self._shared = None

    def release_shared(self) -> None:
        """Takes this tier's gauges out of the slot and lets go of it (once nothing of the
        tier writes to it any more)."""
        shared, self._shared = self._shared, None
        if shared is not None:
            shared.gauge("breaker_open", -self._shared_breaker)
            shared.release()
