"""RemoteTier: a shared second tier under one host's segment, on a remote key-value store.

The tier is a façade over the pieces that do the work, one job each:

- fetch.py: the read path. ``lookup(tokens)`` only queues the request; one thread asks the
  store for the prompt's next pages after its local prefix and copies the hits into fresh
  local pages through the public core (allocate, copy, commit, release).
- writer.py: the write path. A StoreWriter asks the store which pages it has and sends it
  the ones it lacks, for both write policies: write-through on commit (ThroughWriter, there;
  ``RemoteConfig(write_policy="through")``, the default) and write-on-evict (evict.py's
  EvictWriter, ``"evict"``).
- workqueue.py: what waits for those threads, under one lock and one bound.
- breaker.py: the circuit breaker (faults). stats.py: the counters (RemoteStats).

No network wait and no copy ever happens under the segment's lock, nor on the engine's
thread: the engine only queues, and polls ``RemoteLookup.done()`` (or waits).

Threads and processes. The tier works on the engine's own handle (no lease slot of its
own): its fetch thread and its writer each have their own WorkerView on it, and the core's
lock serialises them with the engine's threads as it does processes. Close the tier before
the cache (the cache refuses to unmap the pool under the tier's threads). A process killed
mid-fetch leaves a live sequence on its lease: the core reaps it like any dead process's,
freeing the fresh pages (they were never committed). A tier does not survive fork: make one
per process.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, List, Optional, Sequence, Union

from hostkv._tokens import as_namespace, as_tokens
from hostkv.cache import HostKVCache
from hostkv.errors import ConfigError, HostKVError
from hostkv.remote.backend import RemoteBackend, backend_for
from hostkv.remote.breaker import Breaker
from hostkv.remote.config import RemoteConfig
from hostkv.remote.evict import EvictWriter
from hostkv.remote.fetch import Fetcher, RemoteLookup
# RemoteStats and SHARED_COUNTERS lived here before stats.py: still importable from here.
from hostkv.remote.stats import SHARED_COUNTERS, RemoteStats, TierCounters
from hostkv.remote.workqueue import WorkQueue
from hostkv.remote.writer import StoreWriter, ThroughWriter
from hostkv.worker_view import SequenceRequest, WorkerView

__all__ = ["RemoteLookup", "RemoteStats", "RemoteTier", "SHARED_COUNTERS",
           "first_unpublished_page"]

log = logging.getLogger("hostkv.remote")


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
            ConfigError: a bad config, prefix reuse disabled on the segment, a segment with
                window parts, or redis-py missing. Connecting is lazy: an unreachable store is not an error here.
        """
        if isinstance(config, str):
            config = RemoteConfig(config)
        if not isinstance(config, RemoteConfig):
            raise ConfigError(f"config must be a RemoteConfig or a URL, got {type(config).__name__}")
        if not isinstance(cache, HostKVCache):
            raise ConfigError(f"cache must be a HostKVCache, got {type(cache).__name__}")
        if not cache.config.enable_prefix_reuse:
            raise ConfigError("the remote tier needs a segment with enable_prefix_reuse=True")
        if cache.config.num_parts:
            # Its values carry a page's bytes only: a fetched page would be committed with
            # a part nobody wrote.
            raise ConfigError(
                f"the remote tier does not carry window parts yet; segment {cache.name!r} "
                f"has {cache.config.num_parts} of {cache.config.part_bytes} bytes")
        self._config = config
        self._page_size = cache.config.page_size
        self._backend = backend if backend is not None else backend_for(config)
        self._pid = os.getpid()
        self._closed = False
        # This process's slot in the segment's shared counters, taken here.
        self._counters = TierCounters(cache)
        self._breaker = Breaker(config, self._counters.breaker_changed)
        self._queue = WorkQueue(config.max_queue, self._breaker, self._counters)
        self._cond = self._queue.cond
        # The engine's own handle, shared: the core's lock serialises threads like processes
        # (each thread its own WorkerView), so the tier takes no lease slot of its own, and
        # its sequences belong to this process's lease (reaped with it if the process dies).
        # The fetch thread and the writer each have their own view: they never wait for
        # each other outside the core's lock.
        self._fetch_view = WorkerView(cache)
        self._write_view = WorkerView(cache)
        # The store writer and the fetcher each hold a view of the pool until close():
        # cache.close() raises BufferError while the tier is open, rather than unmap the
        # pool under its threads' copies. (No local variable holds one: a frame kept alive
        # by a traceback, say the one of a warning that a log handler keeps, would keep it
        # after close().)
        self._store = StoreWriter(cache.config, config, self._backend, self._breaker,
                                  self._counters, cache.pages_array())
        self._evict_writer: Optional[EvictWriter] = None
        self._through: Optional[ThroughWriter] = None
        if config.write_policy == "evict":
            self._evict_writer = EvictWriter(cache, config, self._store, self._counters)
        else:
            self._through = ThroughWriter(self._store, self._queue, self._counters,
                                          self._write_view, self._page_size)
        self._fetcher = Fetcher(
            cache, config, self._backend, self._breaker, self._counters, self._queue,
            cache.pages_array(), self._fetch_view,
            on_present=None if self._evict_writer is None else self._evict_writer.note_present,
            on_invalid=None if self._evict_writer is None else self._evict_writer.note_invalid)
        self._fetcher.start()
        if self._through is not None:
            self._through.start()
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
        self._counters.add(lookups=len(lookups))
        self._fetcher.skip(self._queue.put_lookups(lookups))
        return lookups

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
        assert self._through is not None
        full = len(arr) // self._page_size
        pages = full if num_pages is None else min(int(num_pages), full)
        first = max(0, int(first_page))
        if pages <= first:
            return
        ns = as_namespace(namespace)
        computed = pages if computed_from is None else max(0, int(computed_from))
        self._through.publish(ns, arr, pages, first, computed)

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
        if not self._queue.wait_idle(deadline):
            return False
        if self._evict_writer is not None:
            return self._evict_writer.flush(
                None if deadline is None else max(0.0, deadline - time.monotonic()))
        return True

    def stats(self) -> RemoteStats:
        """A snapshot of this process's remote-tier counters."""
        return self._counters.snapshot(self._queue.depth(), self._breaker.opens,
                                       self._breaker.is_open)

    # Tests: the fetch thread's state, and a hook it calls with an insert's fresh pages
    # before their commit.

    @property
    def _fetching(self) -> bool:
        return self._queue.fetching

    @property
    def _hook(self) -> Any:
        return self._fetcher.hook

    @_hook.setter
    def _hook(self, hook: Any) -> None:
        self._fetcher.hook = hook

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
            self._counters.forget_shared()
            self._fetcher.drop_pool()
            self._store.drop_pool()
            return
        self._closed = True
        pending, dropped = self._queue.close()
        self._fetcher.skip(pending)
        if dropped:
            self._counters.add(writes_dropped=dropped)
        writer = self._evict_writer
        if writer is not None:
            writer.stop()
        threads: List[Any] = [thread for thread in (self._fetcher, self._through, writer)
                              if thread is not None]
        for thread in threads:
            thread.join(timeout + self._config.socket_timeout + self._config.connect_timeout)
        self._backend.close()
        if any(thread.is_alive() for thread in threads):
            # Its view and the pool stay referenced: cache.close() then refuses to unmap
            # under it (BufferError) instead of faulting the thread.
            log.warning("hostkv remote tier: a thread did not stop; leaving its views open")
            return
        if writer is not None:
            writer.close_view()
        self._fetcher.close()
        self._write_view.close()
        self._store.drop_pool()
        # The threads are gone: nothing of this tier writes to the slot any more.
        self._counters.release_shared()

    def __enter__(self) -> "RemoteTier":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("breaker open" if self._breaker.is_open else "open")
        return f"<RemoteTier {self._config.redacted_url} prefix={self._config.key_prefix!r} {state}>"
