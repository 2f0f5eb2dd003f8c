"""What waits for a remote tier's threads: lookups for the fetch thread, writes for the
write-through writer, under one lock and one bound.

The engine's thread only appends here (and is refused, not made to wait, when the queue is
full or the breaker holds off); each thread takes its whole batch at once, so nothing the
engine does waits for a round trip to the store.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Deque, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from hostkv.remote.breaker import Breaker
from hostkv.remote.stats import TierCounters

__all__ = ["WorkQueue", "WriteJob"]


class WriteJob(NamedTuple):
    """Pages [first, num_pages) of tokens for the store (at most one write batch of them).

    Attributes:
        namespace: The sequence's namespace.
        tokens: The token ids of its first num_pages pages (a private copy).
        first: The first page to write.
        computed: The first page this host computed itself: the pages before it (borrowed)
            are sent only if the store lacks them.
        pages: The pages to write, num_pages - first.
    """

    namespace: int
    tokens: np.ndarray
    first: int
    computed: int
    pages: int


class WorkQueue:
    """The lookups and writes waiting, at most max_queue of both together.

    ``cond`` guards everything here; the threads sleep on it. ``fetching`` and ``writing``
    say that a thread works on a batch it took (flush waits for them too).
    """

    def __init__(self, max_queue: int, breaker: Breaker, counters: TierCounters) -> None:
        self._max_queue = max_queue
        self._breaker = breaker
        self._counters = counters
        self.cond = threading.Condition()
        self.lookups: Deque[Any] = collections.deque()
        self.writes: Deque[WriteJob] = collections.deque()
        self.fetching = False
        self.writing = False
        self.closed = False

    def depth(self) -> int:
        """Lookups and writes waiting now."""
        with self.cond:
            return len(self.lookups) + len(self.writes)

    def _depth_changed(self) -> None:
        self._counters.queue_depth(len(self.lookups) + len(self.writes))

    def put_lookups(self, lookups: List[Any]) -> List[Any]:
        """Queues what fits of lookups; returns the ones refused (queue full, or the breaker
        holds off), which the caller answers at once."""
        with self.cond:
            room = max(self._max_queue - len(self.lookups) - len(self.writes), 0)
            if self._breaker.holding_off():
                queued, refused = [], lookups
            else:
                queued, refused = lookups[:room], lookups[room:]
            self.lookups.extend(queued)
            if queued:
                self._depth_changed()
                self.cond.notify_all()
        return refused

    def put_writes(self, jobs: Sequence[WriteJob]) -> int:
        """Queues each job that fits (in order); returns the pages of those refused."""
        refused = 0
        with self.cond:
            for job in jobs:
                if self._breaker.holding_off() or (
                        len(self.lookups) + len(self.writes) >= self._max_queue):
                    refused += job.pages
                else:
                    self.writes.append(job)
            self._depth_changed()
            self.cond.notify_all()
        return refused

    def take_lookups(self) -> Optional[List[Any]]:
        """Waits for lookups and takes every one (fetching is True until lookups_done());
        None once the queue is closed."""
        with self.cond:
            while not self.lookups and not self.closed:
                self.cond.wait()
            if self.closed:
                return None
            batch = list(self.lookups)
            self.lookups.clear()
            self._depth_changed()
            self.fetching = True
            return batch

    def lookups_done(self) -> None:
        """The fetch thread finished the batch it took."""
        with self.cond:
            self.fetching = False
            self.cond.notify_all()

    def take_writes(self, limit: int) -> Optional[List[WriteJob]]:
        """Waits for writes and takes the first ones, up to limit pages (at least one job;
        writing is True until writes_done()); None once the queue is closed."""
        with self.cond:
            while not self.writes and not self.closed:
                self.cond.wait()
            if self.closed:
                return None
            batch = [self.writes.popleft()]
            pages = batch[0].pages
            while self.writes and pages + self.writes[0].pages <= limit:
                job = self.writes.popleft()
                batch.append(job)
                pages += job.pages
            self._depth_changed()
            self.writing = True
            return batch

    def writes_done(self) -> None:
        """The writer finished the batch it took."""
        with self.cond:
            self.writing = False
            self.cond.notify_all()

    def wait_idle(self, deadline: Optional[float]) -> bool:
        """Waits until nothing is queued or being worked on; False at the deadline
        (time.monotonic(); None: no deadline)."""
        with self.cond:
            while self.lookups or self.writes or self.writing or self.fetching:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self.cond.wait(0.05 if left is None else min(left, 0.05))
        return True

    def close(self) -> Tuple[List[Any], int]:
        """Closes the queue and wakes the threads, which then end. Returns the lookups that
        were waiting and the pages of the writes that were (both dropped)."""
        with self.cond:
            self.closed = True
            pending = list(self.lookups)
            self.lookups.clear()
            dropped = sum(job.pages for job in self.writes)
            self.writes.clear()
            self._depth_changed()
            self.cond.notify_all()
        return pending, dropped
