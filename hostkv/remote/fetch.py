"""The remote tier's read path: lookups queued by the engine, answered by one thread.

``RemoteTier.lookup(tokens)`` only queues the request (the engine's thread pays a copy of
the token ids and a lock-free append). The fetch thread finds how much of the prompt is
cached locally (``match_prefix``), asks the store for the next pages of the chain in one
round trip (all queued lookups together), checks every value (codec.decode_value), and
copies the hits into fresh local pages through the public core: a WorkerView allocates the
prompt's prefix (borrowing the local part, fresh pages for the rest), the KV bytes go into
the fresh pages, then commit and release. From then on every process on the host reuses
them through its ordinary allocation. The engine polls ``RemoteLookup.done()`` (or waits),
then allocates as usual. No network wait and no copy ever happens under the segment's lock:
the lock is held only inside the core's allocate/commit/release calls. (The inserts are
allocations: they count in the segment's lookup stats and refresh the pages' recency.)
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Any, Callable, List, Optional

import numpy as np

from hostkv.cache import HostKVCache
from hostkv.errors import CapacityError, OutOfPagesError
from hostkv.remote import codec
from hostkv.remote.backend import UNAVAILABLE, RemoteBackend, RemoteError
from hostkv.remote.breaker import Breaker
from hostkv.remote.config import RemoteConfig
from hostkv.remote.stats import TierCounters
from hostkv.remote.workqueue import WorkQueue
from hostkv.worker_view import SequenceRequest, WorkerView

__all__ = ["Fetcher", "RemoteLookup"]

log = logging.getLogger("hostkv.remote")


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


class Fetcher:
    """The fetch thread of one RemoteTier: takes the queued lookups, asks the store, inserts
    what it found. Built and owned by RemoteTier, on the tier's handle, backend, breaker,
    counters and queue; it has its own WorkerView."""

    def __init__(self, cache: HostKVCache, config: RemoteConfig, backend: RemoteBackend,
                 breaker: Breaker, counters: TierCounters, queue: WorkQueue, pool: np.ndarray,
                 view: WorkerView,
                 on_present: Optional[Callable[[List[bytes]], None]] = None,
                 on_invalid: Optional[Callable[[List[bytes]], None]] = None) -> None:
        """Prepares the thread; start() starts it.

        Args:
            pool: The cache's page pool (HostKVCache.pages_array()), held until close().
            view: The thread's own WorkerView on cache.
            on_present: Called with the keys of pages inserted (the store has them).
            on_invalid: Called with the key of a value that failed a check (the store's
                value under it must be replaced, not kept).
        """
        cfg = cache.config
        self._handle = cache
        self._config = config
        self._backend = backend
        self._breaker = breaker
        self._counters = counters
        self._queue = queue
        self._pool: Optional[np.ndarray] = pool
        self._view = view
        self._on_present = on_present
        self._on_invalid = on_invalid
        self._page_size = cfg.page_size
        self._page_bytes = cfg.page_bytes
        self._min_reuse = cfg.prefix_min_reuse_pages
        self._fingerprint = codec.layout_fingerprint(cfg)
        self._prefix = config.key_prefix.encode()
        self._seq_ids = itertools.count(1)
        #: Tests: called with the fresh pages of an insert before their commit.
        self.hook: Any = None
        self._thread = threading.Thread(target=self._fetch_loop, name="hostkv-remote-fetch",
                                        daemon=True)

    def start(self) -> None:
        """Starts the thread."""
        self._thread.start()

    def join(self, timeout: float) -> None:
        """Waits for the thread to end (once the queue is closed)."""
        self._thread.join(timeout)

    def is_alive(self) -> bool:
        """True while the thread runs."""
        return self._thread.is_alive()

    def skip(self, lookups: List[RemoteLookup]) -> None:
        """Answers lookups that were never asked (queue full, breaker open, tier closed)."""
        for item in lookups:
            item._finish("skipped")
        if lookups:
            self._counters.add(lookups_skipped=len(lookups))

    def drop_pool(self) -> None:
        """Lets go of the pool (a forked child's copy of the tier)."""
        self._pool = None

    def close(self) -> None:
        """Releases the thread's sequences and the pool (after the thread ended)."""
        self._view.close()
        self._pool = None

    # -- the thread ----------------------------------------------------------------------------

    def _fetch_loop(self) -> None:
        while True:
            batch = self._queue.take_lookups()
            if batch is None:
                return
            try:
                self._fetch(batch)
            except Exception:    # a bug must not kill the thread and hang every waiter
                log.exception("hostkv remote tier: fetch failed")
                self._counters.add(errors=1)
            finally:
                for item in batch:
                    if not item.done():
                        item._finish("error")
                self._queue.lookups_done()

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
                self._counters.add(lookups_skipped=1)
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
            self._counters.add(lookups_skipped=len(plans))
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
            self._counters.add(errors=1)
            for item, _, _ in plans[done:]:
                item._finish("error")
            return
        finally:
            close = getattr(stream, "close", None)
            if close is not None:
                close()
        self._counters.fetched(time.perf_counter() - began)

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
                self._counters.add(unavailable_pages=cut, errors=int(first_cut))
                break
            kv, reason = codec.decode_value(
                value, self._fingerprint, item.namespace,
                item.tokens[page * ps:(page + 1) * ps], self._page_bytes, key=keys[index])
            if kv is None:
                # The chain stops at the first page not usable: later pages need it.
                if reason == "missing":
                    self._counters.add(miss_pages=len(keys) - index)
                else:
                    self._counters.invalid(reason)
                    log.warning("hostkv remote tier: a value failed its %s check; "
                                "treated as a miss", reason)
                    if self._on_invalid is not None:
                        self._on_invalid([keys[index]])
                break
            kvs.append(kv)
        self._counters.add(hit_pages=len(kvs), bytes_down=sum(
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
        view = self._view
        try:
            alloc = view.allocate_pages_for_sequences_with_prefix(
                [SequenceRequest(seq_id, item.tokens[:end * ps], item.namespace)])[0]
        except (OutOfPagesError, CapacityError) as exc:
            log.debug("hostkv remote tier: no room for %d fetched pages: %s", len(kvs), exc)
            self._counters.add(insert_failed=len(kvs))
            return 0
        try:
            reused = alloc.reused_tokens // ps
            if reused < start:
                # The local prefix was evicted since match_prefix: its fresh pages would hold
                # no KV. Drop the fetch; the next lookup starts from what is cached then.
                view.release([seq_id], commit=False)
                self._counters.add(insert_failed=len(kvs))
                return 0
            pool = self._pool
            assert pool is not None
            table = alloc.page_table
            # Our own fresh pages (reused..end): nobody else can see them until the commit.
            for page in range(reused, end):
                pool[table[page]] = np.frombuffer(kvs[page - start], dtype=np.uint8)
            if self.hook is not None:
                self.hook(table[reused:end])
            view.commit([seq_id], end * ps)
            view.release([seq_id], commit=False)
        except BaseException:
            if seq_id in view.live_sequences:
                view.release([seq_id], commit=False)
            raise
        self._counters.add(inserted_pages=len(kvs))
        if self._on_present is not None:
            self._on_present(keys)
        return len(kvs)
