"""The remote tier's write path: what sends pages to the store, and write-through.

Two policies write (``RemoteConfig.write_policy``): write-through on commit ("through", the
default: ThroughWriter, here) and write-on-evict ("evict": evict.py's EvictWriter, which
sends pages just before eviction instead; the README has the two measured side by side).
Both send through one StoreWriter: the chain keys of a path, one pipeline of EXPIRE asking
the store which pages it has (which also renews their TTL), the copy and encoding of pages
their caller holds, one pipeline sending them; every outcome counted, the breaker told.

Write-through. ``publish``/``commit``/``release`` queue the token ids of newly committed
pages (nothing else on the engine's thread). The writer thread asks the store which of them
exist (no local "already sent" memory, so a flushed or restarted store is refilled), borrows
the missing ones by allocating their prefix plus one token (a borrowed page cannot be
evicted or rewritten while it copies the bytes), releases them, and sends the values in one
pipeline. (Borrowing is an allocation: it counts in the segment's lookup stats and
refreshes the pages' recency, as the fetch path's inserts do.)
"""

from __future__ import annotations

import itertools
import logging
import threading
from typing import List, Optional, Tuple

import numpy as np

from hostkv.config import HostKVConfig
from hostkv.errors import CapacityError, OutOfPagesError
from hostkv.remote import codec
from hostkv.remote.backend import RemoteBackend, RemoteError, RemoteFullError
from hostkv.remote.breaker import Breaker
from hostkv.remote.config import RemoteConfig
from hostkv.remote.stats import TierCounters
from hostkv.remote.workqueue import WorkQueue, WriteJob
from hostkv.worker_view import SequenceAllocation, SequenceRequest, WorkerView

__all__ = ["StoreWriter", "ThroughWriter", "Todo"]

log = logging.getLogger("hostkv.remote")

#: Pages to send of one path: (namespace, the path's tokens, the chain keys of its pages,
#: the pages to copy and send).
Todo = Tuple[int, np.ndarray, List[bytes], List[int]]


class StoreWriter:
    """Asks the store about pages and sends it pages, for both write policies of a tier.

    Shares the tier's backend, breaker and counters, and holds the cache's page pool until
    drop_pool(). Used by one thread per policy, each copying off its own view's sequences.
    """

    def __init__(self, cache_config: HostKVConfig, config: RemoteConfig,
                 backend: RemoteBackend, breaker: Breaker, counters: TierCounters,
                 pool: np.ndarray) -> None:
        """Args:
            cache_config: The cache's config (its page geometry and layout).
            config: The tier's.
            pool: The cache's page pool (HostKVCache.pages_array()).
        """
        self._config = config
        self._backend = backend
        self._breaker = breaker
        self._counters = counters
        self._pool: Optional[np.ndarray] = pool
        self._page_size = cache_config.page_size
        self._fingerprint = codec.layout_fingerprint(cache_config)
        self._prefix = config.key_prefix.encode()
        #: Pages one batch sends at most: write_batch_pages, fewer if max_bytes_in_flight
        #: holds fewer.
        self.write_limit = max(1, min(config.write_batch_pages,
                                      config.max_bytes_in_flight // cache_config.page_bytes))

    def chain_keys(self, namespace: int, tokens: np.ndarray, num_pages: int) -> List[bytes]:
        """The store's keys of the first num_pages pages of a path (codec.chain_keys)."""
        return codec.chain_keys(self._prefix, namespace, self._fingerprint, tokens,
                                self._page_size, num_pages)

    def allow(self) -> bool:
        """Whether a batch may go to the store now (the breaker's allow: one probe at a time
        while it is open)."""
        return self._breaker.allow()

    def ask(self, keys: List[bytes]) -> Optional[List[Optional[bool]]]:
        """Which keys the store holds, renewing their TTL: True or False each, None where
        the key's node did not answer (one error counted). None in all when the store
        failed (counted, and the breaker told): the caller keeps or drops its pages."""
        try:
            present = self._backend.touch_many(keys, self._config.ttl_seconds)
        except RemoteError as exc:
            self._breaker.failure(self._config.redacted_url, exc)
            self._counters.add(errors=1)
            return None
        unknown = sum(1 for flag in present if flag is None)
        if unknown < len(present):
            self._breaker.success()               # some node answered
        if unknown:
            self._counters.add(errors=1)
        return present

    def send(self, items: List[Tuple[bytes, bytes]]) -> Optional[int]:
        """Stores encoded pages; returns how many were not stored (a cluster node down
        while the others stored theirs: which ones is not known), or None when the store
        refused them all. Every outcome is counted; the breaker is told of failures."""
        try:
            not_stored = self._backend.put_many(items, self._config.ttl_seconds)
        except RemoteFullError as exc:
            # The store answered (out of memory, say): reads may still work, so the breaker
            # stays closed; the pages are dropped and counted.
            log.debug("hostkv remote tier: the store refused %d values: %s", len(items), exc)
            self._counters.add(errors=1, writes_dropped=len(items))
            return None
        except RemoteError as exc:
            self._breaker.failure(self._config.redacted_url, exc)
            self._counters.add(errors=1, writes_dropped=len(items))
            return None
        if not_stored < len(items):
            self._breaker.success()
        if not_stored:
            self._counters.add(errors=1, writes_dropped=not_stored, unavailable_pages=not_stored)
        self._counters.add(written_pages=len(items) - not_stored,
                           bytes_up=sum(len(v) for _, v in items))
        return not_stored

    def encode_held(self, view: WorkerView, todo: List[Todo],
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
                    self._counters.add(writes_dropped=gone)
                for page in pages:
                    if page < held:
                        items.append((keys[page], codec.encode_value(
                            self._fingerprint, namespace, tokens[page * ps:(page + 1) * ps],
                            pool[hold.page_table[page]], key=keys[page])))
        finally:
            view.release([hold.seq_id for hold in holds], commit=False)
        return items

    def drop_pool(self) -> None:
        """Lets go of the pool (the tier is closing, or a forked child's copy of it)."""
        self._pool = None


class ThroughWriter:
    """The write-through thread of one RemoteTier (write_policy="through"): sends the pages
    the engine committed, taken from the tier's queue. It has its own WorkerView."""

    def __init__(self, store: StoreWriter, queue: WorkQueue, counters: TierCounters,
                 view: WorkerView, page_size: int) -> None:
        """Prepares the thread; start() starts it."""
        self._store = store
        self._queue = queue
        self._counters = counters
        self._view = view
        self._page_size = page_size
        self._seq_ids = itertools.count(1)
        self._thread = threading.Thread(target=self._write_loop, name="hostkv-remote-write",
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

    def publish(self, namespace: int, tokens: np.ndarray, pages: int, first: int,
                computed: int) -> None:
        """Queues the write of pages [first, pages) of tokens (first < pages <= the full
        pages of tokens); the pages from computed on are sent without asking the store."""
        ps = self._page_size
        limit = self._store.write_limit
        # Jobs of at most one write batch each: the writer never holds more than that.
        jobs = []
        for start in range(first, pages, limit):
            end = min(pages, start + limit)
            jobs.append(WriteJob(namespace, tokens[:end * ps].copy(), start, computed,
                                 end - start))
        self._counters.add(published_pages=pages - first)
        dropped = self._queue.put_writes(jobs)
        if dropped:
            self._counters.add(writes_dropped=dropped)

    # -- the thread ----------------------------------------------------------------------------

    def _write_loop(self) -> None:
        limit = self._store.write_limit
        while True:
            batch = self._queue.take_writes(limit)
            if batch is None:
                return
            try:
                self._write(batch)
            except Exception:
                log.exception("hostkv remote tier: write failed")
                self._counters.add(errors=1)
            finally:
                self._queue.writes_done()

    def _write(self, batch: List[WriteJob]) -> None:
        ps = self._page_size
        store = self._store
        jobs = []             # (namespace, tokens, keys, pages to ask about, pages to send)
        for namespace, tokens, first, computed, _ in batch:
            num_pages = len(tokens) // ps
            keys = store.chain_keys(namespace, tokens, num_pages)
            split = min(max(first, computed), num_pages)
            jobs.append((namespace, tokens, keys, list(range(first, split)),
                         list(range(split, num_pages))))
        total = sum(len(ask) + len(send) for _, _, _, ask, send in jobs)
        if not store.allow():
            self._counters.add(writes_dropped=total)
            return
        asking = [keys[p] for _, _, keys, ask, _ in jobs for p in ask]
        present: List[Optional[bool]] = []
        if asking:
            answer = store.ask(asking)
            if answer is None:
                self._counters.add(writes_dropped=total)
                return
            present = answer
        offset = 0
        todo: List[Todo] = []
        for namespace, tokens, keys, ask, send in jobs:
            flags = present[offset:offset + len(ask)]
            offset += len(ask)
            self._counters.add(present_pages=sum(1 for flag in flags if flag))
            # A page whose node did not answer (None) is not sent: that node is down.
            lost = sum(1 for flag in flags if flag is None)
            if lost:
                self._counters.add(writes_dropped=lost, unavailable_pages=lost)
            missing = [p for p, there in zip(ask, flags) if there is False] + send
            if missing:
                todo.append((namespace, tokens, keys, missing))
        if not todo:
            return
        items = self._borrow_and_encode(todo)
        if items:
            store.send(items)

    def _borrow_and_encode(self, todo: List[Todo]) -> List[Tuple[bytes, bytes]]:
        """Borrows the pages to send (their prefix plus one token: the core then holds every
        one of them for us), copies and encodes them, and gives them back."""
        ps = self._page_size
        requests = []
        for namespace, tokens, _keys, missing in todo:
            upto = (max(missing) + 1) * ps
            requests.append(SequenceRequest(next(self._seq_ids),
                                            np.append(tokens[:upto], np.int32(0)), namespace))
        try:
            allocs = self._view.allocate_pages_for_sequences_with_prefix(requests)
        except (OutOfPagesError, CapacityError):
            self._counters.add(writes_dropped=sum(len(m) for _, _, _, m in todo))
            return []
        return self._store.encode_held(self._view, todo, allocs)
