"""RemoteTier: a shared second tier under one host's segment, on a remote key-value store.

Read path. ``lookup(tokens)`` only queues the request (the engine's thread pays a copy of
the token ids and a lock-free append). The tier's fetch thread finds how much of the prompt
is cached locally (``match_prefix``), asks the store for the next pages of the chain in one
round trip (all queued lookups together), checks every value (codec.decode_value), and
copies the hits into fresh local pages through the public core: a WorkerView allocates the
prompt's prefix (borrowing the local part, fresh pages for the rest), the KV bytes go into
the fresh pages, then commit and release. From then on every process on the host reuses
them through its ordinary allocation. The engine polls ``RemoteLookup.done()`` (or waits),
then allocates as usual. No network wait and no copy ever happens under the segment's lock:
the lock is held only inside the core's allocate/commit/release calls.

Write path: write-through on commit (``RemoteConfig(write_policy="through")``, the default;
``"evict"`` writes pages just before eviction instead: see evict.py, and the README for
the two measured side by side). ``publish``/``commit``/``release`` queue the token ids
of newly committed pages (nothing else on the engine's thread). The writer thread asks the
store which of them exist (one pipeline of EXPIRE, which also renews their TTL: no local
"already sent" memory, so a flushed or restarted store is refilled), borrows the missing
ones by allocating their prefix plus one token (a borrowed page cannot be evicted or rewritten while it copies the bytes),
releases them, and sends the values in one pipeline. (Borrowing is an allocation: it counts
in the segment's lookup stats and refreshes the pages' recency, as the fetch path's
inserts do.)

Faults. Every store call is bounded by the socket timeouts. A circuit breaker opens after
``failure_threshold`` consecutive failures: while open, lookups resolve at once as skipped and
writes are dropped (both counted), so the host tier serves at full speed; after a backoff
(doubling up to ``backoff_max``) one probe goes through, and success closes it.

Threads and processes. The tier works on the engine's own handle (no lease slot of its
own): its fetch thread and its writer each have their own WorkerView on it, and the core's
lock serialises them with the engine's threads as it does processes. Close the tier before
the cache (the cache refuses to unmap the pool under the tier's threads). A process killed
mid-fetch leaves a live sequence on its lease: the core reaps it like any dead process's,
freeing the fresh pages (they were never committed). A tier does not survive fork: make one
per process.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import os
import threading
import time
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from hostkv._tokens import as_namespace, as_tokens
from hostkv.cache import HostKVCache
from hostkv.errors import CapacityError, ConfigError, HostKVError, OutOfPagesError
from hostkv.remote import codec
from hostkv.remote.backend import (
    UNAVAILABLE,
    RemoteBackend,
    RemoteError,
    RemoteFullError,
    backend_for,
)
from hostkv.remote.config import RemoteConfig
from hostkv.remote.evict import EvictWriter
from hostkv.remote.shared_stats import SlotWriter, writer_for
from hostkv.worker_view import SequenceAllocation, SequenceRequest, WorkerView

__all__ = ["RemoteLookup", "RemoteStats", "RemoteTier"]

log = logging.getLogger("hostkv.remote")

_HISTOGRAM_BUCKETS = 32
# Reasons decode_value gives for a value it refuses ("missing" aside); any other is "other".
INVALID_REASONS = ("truncated", "magic", "format", "layout", "namespace", "tokens", "checksum")


@dataclasses.dataclass(frozen=True)
class RemoteStats:
    """One process's remote-tier counters (the segment's own are in HostKVCache.stats()).

    Attributes:
        lookups: Lookups queued.
        lookups_skipped: Lookups answered at once without asking the store (breaker open,
            queue full, tier closed).
        fetches: Round trips to the store for lookups.
        hit_pages: Pages found in the store and valid.
        miss_pages: Pages asked for and absent.
        invalid_pages: Values that failed a check, by reason ("layout", "tokens",
            "checksum", "truncated", "namespace", "format", "magic"): never loaded.
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
            durations in [2**(b-1), 2**b) us.
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
        """The counters in Prometheus' text format, for an engine's own /metrics."""
        lines = []
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            name = f"{prefix}_{field.name}"
            if field.name == "invalid_pages":
                lines.append(f"# TYPE {name} counter")
                lines.extend(f'{name}{{reason="{r}"}} {n}' for r, n in sorted(value.items()))
            elif field.name == "fetch_latency_histogram":
                lines.append(f"# TYPE {prefix}_fetch_latency_us histogram")
                running = 0
                for bucket, count in enumerate(value):
                    running += count
                    lines.append(f'{prefix}_fetch_latency_us_bucket{{le="{1 << bucket}"}} {running}')
                lines.append(f'{prefix}_fetch_latency_us_bucket{{le="+Inf"}} {running}')
                lines.append(f"{prefix}_fetch_latency_us_count {running}")
            else:
                kind = "gauge" if field.name in ("queue_depth", "breaker_open") else "counter"
                lines.append(f"# TYPE {name} {kind}")
                lines.append(f"{name} {float(value) if isinstance(value, float) else int(value)}")
        return "\n".join(lines) + "\n"


# What a tier publishes for `python -m hostkv stats` (shared_stats.py): every counter of
# RemoteStats by name, the fetch time in ns, and the grouped ones as "group:item".
SHARED_COUNTERS = tuple(
    [f.name for f in dataclasses.fields(RemoteStats)
     if f.name not in ("invalid_pages", "breaker_open", "queue_depth", "fetch_seconds",
                       "fetch_latency_histogram")]
    + ["fetch_ns"]
    + [f"invalid_pages:{reason}" for reason in INVALID_REASONS + ("other",)]
    + [f"fetch_latency_us:{bucket}" for bucket in range(_HISTOGRAM_BUCKETS)])


class RemoteLookup:
    """A queued lookup: poll done(), or wait(). Never raises a store error: a failure is a
    miss (status "error"), the host tier carries on.

    Attributes:
        status: "pending", then "hit" (pages inserted), "miss", "local" (nothing to ask:
            the host had every reusable page), "error" (the store failed) or "skipped"
            (not asked: breaker open, queue full, tier closed).
        inserted_pages: Pages the lookup put into the local segment.
    """

    __slots__ = ("tokens", "namespace", "status", "inserted_pages", "_event")

    def __init__(self, tokens: np.ndarray, namespace: int) -> None:
        self.tokens = tokens
        self.namespace = namespace
        self.status = "pending"
        self.inserted_pages = 0
        self._event = threading.Event()

    def _finish(self, status: str, inserted_pages: int = 0) -> None:
        self.status = status
        self.inserted_pages = inserted_pages
        self._event.set()

    def done(self) -> bool:
        """True once the lookup finished (its pages, if any, are in the segment)."""
        return self._event.is_set()

    def wait(self, timeout: Optional[float] = None) -> int:
        """Waits up to timeout seconds (None: until done); returns the pages inserted so far
        (0 if it is still pending: the engine may go ahead, the pages arrive later)."""
        self._event.wait(timeout)
        return self.inserted_pages if self._event.is_set() else 0

    def __repr__(self) -> str:
        return (f"<RemoteLookup {len(self.tokens)} tokens ns={self.namespace} {self.status} "
                f"inserted={self.inserted_pages}>")


class _Breaker:
    """Closed -> (failure_threshold failures) -> open for a backoff -> one probe -> closed or
    open again for twice as long (up to backoff_max).

    A probe that never reports back (its batch turned out to have nothing to send, or
    failed for a reason that is not the store's) expires after one store call's timeouts,
    and the next call probes again: the breaker can never stay open for good."""

    def __init__(self, config: RemoteConfig, on_change: Any = None) -> None:
        self._config = config
        self._on_change = on_change     # (is_open, opened_now), called under the lock
        self._lock = threading.Lock()
        self._failures = 0
        self._open_until = 0.0
        self._backoff = config.backoff_initial
        self._probing = False
        self._probe_until = 0.0
        self._probe_seconds = config.connect_timeout + config.socket_timeout + 1.0
        self.is_open = False
        self.opens = 0

    def allow(self) -> bool:
        with self._lock:
            if not self.is_open:
                return True
            now = time.monotonic()
            if now < self._open_until or (self._probing and now < self._probe_until):
                return False
            self._probing = True
            self._probe_until = now + self._probe_seconds
            return True

    def success(self) -> None:
        with self._lock:
            if self.is_open:
                log.info("hostkv remote tier: the store answers again; breaker closed")
            self._failures = 0
            self._probing = False
            self.is_open = False
            self._backoff = self._config.backoff_initial
            if self._on_change is not None:
                self._on_change(False, False)

    def failure(self, where: str, exc: BaseException) -> None:
        with self._lock:
            self._failures += 1
            opened = False
            if self._probing or (not self.is_open
                                 and self._failures >= self._config.failure_threshold):
                if not self.is_open:
                    self.opens += 1
                    opened = True
                    log.warning("hostkv remote tier: %s failing (%s); serving from host memory "
                                "only, retrying in %.1f s", where, exc, self._backoff)
                self.is_open = True
                self._probing = False
                self._open_until = time.monotonic() + self._backoff
                self._backoff = min(self._backoff * 2 or self._config.backoff_initial,
                                    self._config.backoff_max)
            if self._on_change is not None:
                self._on_change(self.is_open, opened)



def first_unpublished_page(committed_pages: int, reused_pages: int) -> int:
    """The first page of a sequence the tier has not been given yet: 0 until the sequence
    committed a page of its own (its borrowed prefix goes once, with that), then its
    committed pages."""
    return 0 if committed_pages <= reused_pages else committed_pages


class RemoteTier:
    """The remote tier of one process over a HostKVCache (see the module docstring).

    Usable as a context manager; close() stops its threads (the cache stays open).
    """

    def __init__(self, cache: HostKVCache, config: Union[RemoteConfig, str], *,
                 backend: Optional[RemoteBackend] = None) -> None:
        """Starts the tier's threads on an open cache.

        Args:
            cache: The host tier; the tier works on this handle (its threads have their
                own WorkerViews on it) and takes no lease of its own. Close the tier first.
            config: A RemoteConfig, or a URL (all other settings default).
            backend: A store other than the one the URL names (another implementation of
                RemoteBackend); the URL still identifies it in messages.

        Raises:
            ConfigError: a bad config, prefix reuse disabled on the segment, or redis-py
                missing. Connecting is lazy: an unreachable store is not an error here.
        """
        if isinstance(config, str):
            config = RemoteConfig(config)
        if not isinstance(config, RemoteConfig):
            raise ConfigError(f"config must be a RemoteConfig or a URL, got {type(config).__name__}")
        if not isinstance(cache, HostKVCache):
            raise ConfigError(f"cache must be a HostKVCache, got {type(cache).__name__}")
        if not cache.config.enable_prefix_reuse:
            raise ConfigError("the remote tier needs a segment with enable_prefix_reuse=True")
        self._config = config
        cfg = cache.config
        self._page_size = cfg.page_size
        self._page_bytes = cfg.page_bytes
        self._min_reuse = cfg.prefix_min_reuse_pages
        self._fingerprint = codec.layout_fingerprint(cfg)
        self._prefix = config.key_prefix.encode()
        self._write_limit = max(1, min(config.write_batch_pages,
                                       config.max_bytes_in_flight // cfg.page_bytes))
        self._backend = backend if backend is not None else backend_for(config)
        # The engine's own handle, shared: the core's lock serialises threads like processes
        # (each thread its own WorkerView), so the tier takes no lease slot of its own, and
        # its sequences belong to this process's lease (reaped with it if the process dies).
        # The fetch thread and the writer each have their own view: they never wait for
        # each other outside the core's lock.
        self._handle = cache
        self._fetch_view = WorkerView(cache)
        self._write_view = WorkerView(cache)
        # Held until close(): cache.close() raises BufferError while the tier is open,
        # rather than unmap the pool under its threads' copies.
        self._pool: Optional[np.ndarray] = cache.pages_array()
        self._seq_ids = itertools.count(1)
        self._pid = os.getpid()
        self._breaker = _Breaker(config, self._breaker_changed)
        self._cond = threading.Condition()
        self._lookups: Deque[RemoteLookup] = collections.deque()
        # (namespace, tokens, first page, first page this host computed itself)
        self._writes: Deque[Tuple[int, np.ndarray, int, int]] = collections.deque()
        self._writing = False
        self._fetching = False
        self._closed = False
        self._counts: Dict[str, Any] = collections.Counter()
        self._invalid: Dict[str, int] = collections.Counter()
        self._histogram = [0] * _HISTOGRAM_BUCKETS
        self._fetch_seconds = 0.0
        self._stats_lock = threading.Lock()
        self._hook: Any = None       # tests: called with the fresh pages before their commit
        # This process's slot in the segment's shared counters (None: not shared), and the
        # gauges this tier has put there.
        self._shared: Optional[SlotWriter] = writer_for(cache, SHARED_COUNTERS)
        self._shared_depth = 0
        self._shared_breaker = 0
        self._threads = [threading.Thread(target=self._fetch_loop, name="hostkv-remote-fetch",
                                          daemon=True)]
        self._evict_writer: Optional[EvictWriter] = None
        if config.write_policy == "evict":
            self._evict_writer = EvictWriter(self)
        else:
            self._threads.append(threading.Thread(target=self._write_loop,
                                                  name="hostkv-remote-write", daemon=True))
        for thread in self._threads:
            thread.start()
        if self._evict_writer is not None:
            self._evict_writer.start()

    # -- the engine's side -----------------------------------------------------------------------

    @property
    def config(self) -> RemoteConfig:
        """The tier's configuration."""
        return self._config

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("the RemoteTier is closed")
        if os.getpid() != self._pid:
            raise HostKVError("a RemoteTier belongs to the process that made it; a forked "
                              "child must make its own")

    def _count(self, **amounts: Any) -> None:
        with self._stats_lock:
            for key, amount in amounts.items():
                self._counts[key] += amount
        if self._shared is not None:
            self._shared.add(amounts)

    def _depth_changed(self) -> None:
        """Publishes the queue depth's change (call holding self._cond)."""
        if self._shared is not None:
            depth = len(self._lookups) + len(self._writes)
            self._shared.gauge("queue_depth", depth - self._shared_depth)
            self._shared_depth = depth

    def _breaker_changed(self, is_open: bool, opened: bool) -> None:
        if self._shared is not None:
            if opened:
                self._shared.add({"breaker_opens": 1})
            self._shared.gauge("breaker_open", int(is_open) - self._shared_breaker)
            self._shared_breaker = int(is_open)

    def lookup(self, tokens: Any, namespace: int = 0) -> RemoteLookup:
        """Queues a lookup of the prompt's next pages after its local prefix; returns at once.

        Raises:
            ValueError: bad token ids or namespace, or the tier is closed.
        """
        return self.lookup_many([(tokens, namespace)])[0]

    def lookup_many(self, prompts: Sequence[Any]) -> List[RemoteLookup]:
        """Queues lookups for a batch: (tokens, namespace) pairs, SequenceRequests, or bare
        token lists or arrays (a tuple is always read as a (tokens, namespace) pair). Queued
        together, they share one round trip to the store.

        Raises:
            ValueError: bad token ids or namespace, or the tier is closed.
        """
        self._check_open()
        lookups = []
        for prompt in prompts:
            if isinstance(prompt, SequenceRequest):
                tokens, namespace = prompt.tokens, prompt.namespace
            elif isinstance(prompt, tuple) and len(prompt) == 2:
                tokens, namespace = prompt
            else:
                tokens, namespace = prompt, 0
            lookups.append(RemoteLookup(as_tokens(tokens).copy(), as_namespace(namespace)))
        self._count(lookups=len(lookups))
        with self._cond:
            room = self._config.max_queue - len(self._lookups) - len(self._writes)
            if not self._breaker.is_open or self._breaker_probe_due():
                queued, skipped = lookups[:max(room, 0)], lookups[max(room, 0):]
            else:
                queued, skipped = [], lookups
            self._lookups.extend(queued)
            if queued:
                self._depth_changed()
                self._cond.notify_all()
        for item in skipped:
            item._finish("skipped")
        if skipped:
            self._count(lookups_skipped=len(skipped))
        return lookups

    def _breaker_probe_due(self) -> bool:
        return time.monotonic() >= self._breaker._open_until

    def fetch(self, tokens: Any, namespace: int = 0, timeout: Optional[float] = None) -> int:
        """The blocking form of lookup: returns the pages inserted (0 on a miss, an error or
        after timeout seconds; the fetch still completes in the background then)."""
        return self.lookup(tokens, namespace).wait(timeout)

    def fetch_many(self, prompts: Sequence[Any], timeout: Optional[float] = None) -> List[int]:
        """lookup_many, then waits for all of them (at most timeout seconds in all)."""
        lookups = self.lookup_many(prompts)
        deadline = None if timeout is None else time.monotonic() + timeout
        for item in lookups:
            item.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return [item.inserted_pages if item.done() else 0 for item in lookups]

    def publish(self, tokens: Any, namespace: int = 0, num_pages: Optional[int] = None,
                first_page: int = 0, computed_from: Optional[int] = None) -> None:
        """Queues the write of pages [first_page, num_pages) of tokens, which the host has
        committed (num_pages default: every full page). Pages no longer cached locally by
        the time the writer gets to them are skipped (counted in writes_dropped).

        computed_from: pages from this one on were computed here, so the store is unlikely
        to have them: they are sent without asking first. Pages before it (a borrowed
        prefix) are sent only if the store lacks them, and get their TTL renewed. Default:
        ask for every page."""
        self._check_open()
        arr = as_tokens(tokens)
        if self._evict_writer is not None:
            # write_policy="evict": committed pages are written when eviction nears them.
            as_namespace(namespace)
            self._evict_writer.wake()
            return
        full = len(arr) // self._page_size
        pages = full if num_pages is None else min(int(num_pages), full)
        first = max(0, int(first_page))
        if pages <= first:
            return
        ns = as_namespace(namespace)
        ps = self._page_size
        computed = pages if computed_from is None else max(0, int(computed_from))
        # Jobs of at most one write batch each: the writer never holds more than that.
        jobs = [(ns, arr[:min(pages, start + self._write_limit) * ps].copy(), start, computed)
                for start in range(first, pages, self._write_limit)]
        self._count(published_pages=pages - first)
        dropped = 0
        with self._cond:
            for job in jobs:
                if (self._breaker.is_open and not self._breaker_probe_due()) or (
                        len(self._lookups) + len(self._writes) >= self._config.max_queue):
                    dropped += self._job_pages(job)
                else:
                    self._writes.append(job)
            self._depth_changed()
            self._cond.notify_all()
        if dropped:
            self._count(writes_dropped=dropped)

    def commit(self, view: WorkerView, seq_ids: Sequence[Any],
               num_tokens: Union[None, int, Sequence[int]] = None) -> List[int]:
        """view.commit(seq_ids, num_tokens), then publish the pages it newly committed.

        A sequence's first publish includes the prefix it borrowed: the writer's EXPIRE
        then renews the TTL of prefixes every host keeps reusing locally, and refills a
        store that was flushed or restarted (the values it has cost one small command)."""
        self._check_open()
        before = [self._published_from(view.state(seq_id)) for seq_id in seq_ids]
        counts = view.commit(seq_ids, num_tokens)
        if self._evict_writer is not None:
            self._evict_writer.wake()
            return counts
        for seq_id, first, pages in zip(seq_ids, before, counts):
            if pages > first:
                state = view.state(seq_id)
                self.publish(state.tokens, state.namespace, pages, first,
                             state.reused_tokens // self._page_size)
        return counts

    def release(self, view: WorkerView, seq_ids: Sequence[Any], commit: bool = True) -> List[int]:
        """view.release(seq_ids, commit), then publish the pages it newly committed (see
        commit)."""
        self._check_open()
        if self._evict_writer is not None:
            counts = view.release(seq_ids, commit)
            self._evict_writer.wake()
            return counts
        states = [view.state(seq_id) for seq_id in seq_ids] if commit else []
        counts = view.release(seq_ids, commit)
        for state, pages in zip(states, counts):
            first = self._published_from(state)
            if pages > first:
                self.publish(state.tokens, state.namespace, pages, first,
                             state.reused_tokens // self._page_size)
        return counts

    def _published_from(self, state: Any) -> int:
        return first_unpublished_page(state.committed_tokens // self._page_size,
                                      state.reused_tokens // self._page_size)

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Waits until every queued lookup and write is done; False on timeout. With
        write_policy="evict", also runs a round of the evict writer (sending what is near
        eviction now) and waits for it."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._lookups or self._writes or self._writing or self._fetching:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(0.05 if left is None else min(left, 0.05))
        if self._evict_writer is not None:
            return self._evict_writer.flush(
                None if deadline is None else max(0.0, deadline - time.monotonic()))
        return True

    def stats(self) -> RemoteStats:
        """A snapshot of this process's remote-tier counters."""
        with self._stats_lock:
            c = dict(self._counts)
            invalid = dict(self._invalid)
            histogram = tuple(self._histogram)
            seconds = self._fetch_seconds
        with self._cond:
            depth = len(self._lookups) + len(self._writes)
        get = lambda key: int(c.get(key, 0))  # noqa: E731
        return RemoteStats(
            lookups=get("lookups"), lookups_skipped=get("lookups_skipped"),
            fetches=get("fetches"), hit_pages=get("hit_pages"), miss_pages=get("miss_pages"),
            invalid_pages=invalid, inserted_pages=get("inserted_pages"),
            insert_failed=get("insert_failed"), published_pages=get("published_pages"),
            written_pages=get("written_pages"), present_pages=get("present_pages"),
            writes_dropped=get("writes_dropped"), errors=get("errors"),
            unavailable_pages=get("unavailable_pages"),
            breaker_opens=self._breaker.opens, breaker_open=self._breaker.is_open,
            bytes_up=get("bytes_up"), bytes_down=get("bytes_down"), queue_depth=depth,
            fetch_seconds=seconds, fetch_latency_histogram=histogram)

    # -- the fetch thread ----------------------------------------------------------------------

    def _fetch_loop(self) -> None:
        while True:
            with self._cond:
                while not self._lookups and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                batch = list(self._lookups)
                self._lookups.clear()
                self._depth_changed()
                self._fetching = True
            try:
                self._fetch(batch)
            except Exception:    # a bug must not kill the thread and hang every waiter
                log.exception("hostkv remote tier: fetch failed")
                self._count(errors=1)
            finally:
                for item in batch:
                    if not item.done():
                        item._finish("error")
                with self._cond:
                    self._fetching = False
                    self._cond.notify_all()

    def _fetch(self, batch: List[RemoteLookup]) -> None:
        ps = self._page_size
        plans = []            # (lookup, start page, keys of the pages asked for)
        budget = max(1, self._config.max_bytes_in_flight // self._page_bytes)
        for item in batch:
            local = len(self._handle.match_prefix(item.tokens, item.namespace).pages)
            # Allocation reuses at most (n - 1) // page_size pages; a prefix shorter than
            # prefix_min_reuse_pages is not borrowed, so fetch from page 0 then.
            stop = (len(item.tokens) - 1) // ps
            start = local if local >= self._min_reuse else 0
            if stop <= start:
                item._finish("local")
                continue
            stop = min(stop, start + self._config.max_fetch_pages, start + budget)
            if stop <= start:
                # This batch already asks for max_bytes_in_flight: the engine may ask again.
                item._finish("skipped")
                self._count(lookups_skipped=1)
                continue
            budget -= stop - start
            keys = codec.chain_keys(self._prefix, item.namespace, self._fingerprint,
                                    item.tokens, ps, stop)
            plans.append((item, start, keys[start:]))
        if not plans:
            return
        if not self._breaker.allow():
            for item, _, _ in plans:
                item._finish("skipped")
            self._count(lookups_skipped=len(plans))
            return
        began = time.perf_counter()
        stream = iter(self._backend.get_streamed([keys for _, _, keys in plans]))
        done = 0
        answered = False
        cut = 0
        try:
            for (item, start, keys), values in zip(plans, stream):
                if len(values) != len(keys):
                    raise RemoteError(f"asked for {len(keys)} values, got {len(values)}")
                if not answered and any(v is not UNAVAILABLE for v in values):
                    # Some node answered: the store is up, even if a node of it is not.
                    answered = True
                    self._breaker.success()
                cut += self._take(item, start, keys, values, first_cut=not cut)
                done += 1
            # Resume the stream past its last answer: a cluster backend's bookkeeping (the
            # nodes that answered again; every master down, a RemoteError) runs there, and
            # close() would skip it.
            for _ in stream:
                raise RemoteError("the store sent more answers than were asked for")
        except RemoteError as exc:
            self._breaker.failure(self._config.redacted_url, exc)
            self._count(errors=1)
            for item, _, _ in plans[done:]:
                item._finish("error")
            return
        finally:
            close = getattr(stream, "close", None)
            if close is not None:
                close()
        elapsed = time.perf_counter() - began
        bucket = min(int(elapsed * 1e6).bit_length(), _HISTOGRAM_BUCKETS - 1)
        with self._stats_lock:
            self._counts["fetches"] += 1
            self._fetch_seconds += elapsed
            self._histogram[bucket] += 1
        if self._shared is not None:
            self._shared.add({"fetches": 1, "fetch_ns": int(elapsed * 1e9),
                              f"fetch_latency_us:{bucket}": 1})

    def _take(self, item: RemoteLookup, start: int, keys: List[bytes],
              values: List[Optional[bytes]], first_cut: bool = True) -> int:
        """Checks one lookup's values and inserts the valid leading run of them. Returns
        the pages cut off because their node did not answer (0 if none); the first cut of
        a call counts its one error (before the lookup finishes)."""
        ps = self._page_size
        kvs = []
        cut = 0
        for index, value in enumerate(values):
            page = start + index
            if value is UNAVAILABLE:
                # Its node is down: the pages before it stand, the chain stops here.
                cut = len(keys) - index
                self._count(unavailable_pages=cut, errors=int(first_cut))
                break
            kv, reason = codec.decode_value(
                value, self._fingerprint, item.namespace,
                item.tokens[page * ps:(page + 1) * ps], self._page_bytes)
            if kv is None:
                # The chain stops at the first page not usable: later pages need it.
                if reason == "missing":
                    self._count(miss_pages=len(keys) - index)
                else:
                    with self._stats_lock:
                        self._invalid[reason] += 1
                    if self._shared is not None:
                        self._shared.add({f"invalid_pages:"
                                          f"{reason if reason in INVALID_REASONS else 'other'}": 1})
                    log.warning("hostkv remote tier: a value failed its %s check; "
                                "treated as a miss", reason)
                break
            kvs.append(kv)
        self._count(hit_pages=len(kvs), bytes_down=sum(
            len(v) for v in values if v is not None and v is not UNAVAILABLE))
        if not kvs:
            item._finish("error" if cut else "miss")
            return cut
        inserted = self._insert(item, start, kvs, keys[:len(kvs)])
        item._finish("hit" if inserted else "miss", inserted)
        return cut

    def _insert(self, item: RemoteLookup, start: int, kvs: List[memoryview],
                keys: List[bytes]) -> int:
        """Copies fetched pages [start, start + len(kvs)) into fresh local pages and commits
        them. Returns how many pages it inserted (0 when it could not)."""
        ps = self._page_size
        end = start + len(kvs)
        seq_id = next(self._seq_ids)
        view = self._fetch_view
        try:
            alloc = view.allocate_pages_for_sequences_with_prefix(
                [SequenceRequest(seq_id, item.tokens[:end * ps], item.namespace)])[0]
        except (OutOfPagesError, CapacityError) as exc:
            log.debug("hostkv remote tier: no room for %d fetched pages: %s", len(kvs), exc)
            self._count(insert_failed=len(kvs))
            return 0
        try:
            reused = alloc.reused_tokens // ps
            if reused < start:
                # The local prefix was evicted since match_prefix: its fresh pages would hold
                # no KV. Drop the fetch; the next lookup starts from what is cached then.
                view.release([seq_id], commit=False)
                self._count(insert_failed=len(kvs))
                return 0
            pool = self._pool
            assert pool is not None
            table = alloc.page_table
            # Our own fresh pages (reused..end): nobody else can see them until the commit.
            for page in range(reused, end):
                pool[table[page]] = np.frombuffer(kvs[page - start], dtype=np.uint8)
            if self._hook is not None:
                self._hook(table[reused:end])
            view.commit([seq_id], end * ps)
            view.release([seq_id], commit=False)
        except BaseException:
            if seq_id in view.live_sequences:
                view.release([seq_id], commit=False)
            raise
        self._count(inserted_pages=len(kvs))
        if self._evict_writer is not None:
            self._evict_writer.note_present(keys)
        return len(kvs)

    # -- the writer thread -----------------------------------------------------------------------

    def _write_loop(self) -> None:
        limit = self._write_limit
        while True:
            with self._cond:
                while not self._writes and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                batch = [self._writes.popleft()]
                pages = self._job_pages(batch[0])
                while self._writes and pages + self._job_pages(self._writes[0]) <= limit:
                    job = self._writes.popleft()
                    batch.append(job)
                    pages += self._job_pages(job)
                self._depth_changed()
                self._writing = True
            try:
                self._write(batch)
            except Exception:
                log.exception("hostkv remote tier: write failed")
                self._count(errors=1)
            finally:
                with self._cond:
                    self._writing = False
                    self._cond.notify_all()

    def _job_pages(self, job: Tuple[int, np.ndarray, int, int]) -> int:
        return len(job[1]) // self._page_size - job[2]

    def _write(self, batch: List[Tuple[int, np.ndarray, int, int]]) -> None:
        ps = self._page_size
        jobs = []             # (namespace, tokens, keys, pages to ask about, pages to send)
        for namespace, tokens, first, computed in batch:
            num_pages = len(tokens) // ps
            keys = codec.chain_keys(self._prefix, namespace, self._fingerprint, tokens, ps,
                                    num_pages)
            split = min(max(first, computed), num_pages)
            jobs.append((namespace, tokens, keys, list(range(first, split)),
                         list(range(split, num_pages))))
        total = sum(len(ask) + len(send) for _, _, _, ask, send in jobs)
        if not self._breaker.allow():
            self._count(writes_dropped=total)
            return
        asking = [keys[p] for _, _, keys, ask, _ in jobs for p in ask]
        present: List[Optional[bool]] = []
        if asking:
            answer = self._ask_store(asking)
            if answer is None:
                self._count(writes_dropped=total)
                return
            present = answer
        offset = 0
        todo = []
        for namespace, tokens, keys, ask, send in jobs:
            flags = present[offset:offset + len(ask)]
            offset += len(ask)
            self._count(present_pages=sum(1 for flag in flags if flag))
            # A page whose node did not answer (None) is not sent: that node is down.
            lost = sum(1 for flag in flags if flag is None)
            if lost:
                self._count(writes_dropped=lost, unavailable_pages=lost)
            missing = [p for p, there in zip(ask, flags) if there is False] + send
            if missing:
                todo.append((namespace, tokens, keys, missing))
        if not todo:
            return
        items = self._borrow_and_encode(todo)
        if items:
            self._send(items)

    def _ask_store(self, keys: List[bytes]) -> Optional[List[Optional[bool]]]:
        """Which keys the store holds, renewing their TTL: True or False each, None where
        the key's node did not answer (one error counted). None in all when the store
        failed (counted, and the breaker told): the caller keeps or drops its pages."""
        try:
            present = self._backend.touch_many(keys, self._config.ttl_seconds)
        except RemoteError as exc:
            self._breaker.failure(self._config.redacted_url, exc)
            self._count(errors=1)
            return None
        unknown = sum(1 for flag in present if flag is None)
        if unknown < len(present):
            self._breaker.success()               # some node answered
        if unknown:
            self._count(errors=1)
        return present

    def _send(self, items: List[Tuple[bytes, bytes]]) -> Optional[int]:
        """Stores encoded pages; returns how many were not stored (a cluster node down
        while the others stored theirs: which ones is not known), or None when the store
        refused them all. Every outcome is counted; the breaker is told of failures."""
        try:
            not_stored = self._backend.put_many(items, self._config.ttl_seconds)
        except RemoteFullError as exc:
            # The store answered (out of memory, say): reads may still work, so the breaker
            # stays closed; the pages are dropped and counted.
            log.debug("hostkv remote tier: the store refused %d values: %s", len(items), exc)
            self._count(errors=1, writes_dropped=len(items))
            return None
        except RemoteError as exc:
            self._breaker.failure(self._config.redacted_url, exc)
            self._count(errors=1, writes_dropped=len(items))
            return None
        if not_stored < len(items):
            self._breaker.success()
        if not_stored:
            self._count(errors=1, writes_dropped=not_stored, unavailable_pages=not_stored)
        self._count(written_pages=len(items) - not_stored,
                    bytes_up=sum(len(v) for _, v in items))
        return not_stored

    def _borrow_and_encode(self, todo: List[Tuple[int, np.ndarray, List[bytes], List[int]]]
                           ) -> List[Tuple[bytes, bytes]]:
        """Borrows the pages to send (their prefix plus one token: the core then holds every
        one of them for us), copies and encodes them, and gives them back."""
        ps = self._page_size
        requests = []
        for namespace, tokens, _keys, missing in todo:
            upto = (max(missing) + 1) * ps
            requests.append(SequenceRequest(next(self._seq_ids),
                                            np.append(tokens[:upto], np.int32(0)), namespace))
        try:
            allocs = self._write_view.allocate_pages_for_sequences_with_prefix(requests)
        except (OutOfPagesError, CapacityError):
            self._count(writes_dropped=sum(len(m) for _, _, _, m in todo))
            return []
        return self._encode_held(self._write_view, todo, allocs)

    def _encode_held(self, view: WorkerView,
                     todo: List[Tuple[int, np.ndarray, List[bytes], List[int]]],
                     holds: List[SequenceAllocation]) -> List[Tuple[bytes, bytes]]:
        """Copies and encodes each job's listed pages off the pages its sequence holds (an
        allocation or a hold of view's, one per job), then releases the sequences. Pages no
        longer held (evicted since they were chosen) are dropped, counted."""
        ps = self._page_size
        items = []
        try:
            pool = self._pool
            assert pool is not None
            for (namespace, tokens, keys, pages), hold in zip(todo, holds):
                held = hold.reused_tokens // ps
                gone = sum(1 for page in pages if page >= held)
                if gone:
                    self._count(writes_dropped=gone)
                for page in pages:
                    if page < held:
                        items.append((keys[page], codec.encode_value(
                            self._fingerprint, namespace, tokens[page * ps:(page + 1) * ps],
                            pool[hold.page_table[page]])))
        finally:
            view.release([hold.seq_id for hold in holds], commit=False)
        return items

    # -- closing -------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """True after close()."""
        return self._closed

    def close(self, timeout: float = 5.0) -> None:
        """Stops the threads (queued lookups resolve as skipped, queued writes are dropped)
        and releases the tier's sequences; the cache stays open. Idempotent."""
        if self._closed:
            return
        if os.getpid() != self._pid:
            # A forked child: the threads, the shared slot and the locks are the parent's (a
            # lock one of its threads held at the fork stays held here for good). Let go of
            # the child's references only, so that its cache can close.
            self._closed = True
            self._shared = None
            self._pool = None
            return
        with self._cond:
            self._closed = True
            pending = list(self._lookups)
            self._lookups.clear()
            dropped = sum(self._job_pages(job) for job in self._writes)
            self._writes.clear()
            self._depth_changed()
            self._cond.notify_all()
        for item in pending:
            item._finish("skipped")
        self._count(lookups_skipped=len(pending), writes_dropped=dropped)
        writer = self._evict_writer
        if writer is not None:
            writer.stop()
        for thread in self._threads:
            thread.join(timeout + self._config.socket_timeout + self._config.connect_timeout)
        if writer is not None:
            writer.join(timeout + self._config.socket_timeout + self._config.connect_timeout)
        self._backend.close()
        if any(thread.is_alive() for thread in self._threads) or (
                writer is not None and writer.is_alive()):
            # Its view and the pool stay referenced: cache.close() then refuses to unmap
            # under it (BufferError) instead of faulting the thread.
            log.warning("hostkv remote tier: a thread did not stop; leaving its views open")
            return
        if writer is not None:
            writer.close_view()
        self._fetch_view.close()
        self._write_view.close()
        self._pool = None
        shared, self._shared = self._shared, None
        if shared is not None:
            # The threads are gone: nothing of this tier writes to the slot any more.
            shared.gauge("breaker_open", -self._shared_breaker)
            shared.release()

    def __enter__(self) -> "RemoteTier":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("breaker open" if self._breaker.is_open else "open")
        return f"<RemoteTier {self._config.redacted_url} prefix={self._config.key_prefix!r} {state}>"
