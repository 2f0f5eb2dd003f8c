"""The write-on-evict writer of a RemoteTier (``RemoteConfig(write_policy="evict")``).

Eviction itself happens inside the core's allocation, under the segment's lock, and hands
the page to another sequence in the same call: nothing outside the core ever sees an
evicted page's bytes, and copying them under the lock is what the design forbids. So the
writer sends pages just *before* they are evicted ("write-before-evict"):

1. It watches the pool (once per ``evict_poll_seconds``, and whenever the engine commits or
   releases through the tier). While free pages stay above ``evict_headroom`` of the pool,
   eviction is not near and nothing is sent.
2. Below it, it asks the core which cached nodes eviction would take next, in order, until
   they cover the shortfall (``HostKVCache.eviction_candidates``: a pure lookup, token ids
   only, nothing refreshed), in windows of 4 x ``write_batch_pages`` pages (one short hold
   of the lock each: ~0.1 ms for 256 pages of ~100-page paths here) starting where the
   last look found everything sent, and from the coldest page once per poll interval.
3. Pages already known to be in the store are skipped: ones this writer sent or found there
   (remembered for ``min(ttl/2, 300 s)``) and ones the tier fetched from it. For the rest,
   one pipeline of EXPIRE asks the store (and renews the ones it has, as write-through does),
   but for pages whose value the tier's fetch found failing a check (corrupt, foreign,
   truncated): EXPIRE would find that value there and keep it alive, so they are sent,
   replacing it.
4. It holds the missing pages (``WorkerView.hold_cached_pages``: a sequence that borrows
   them without using them, so they cannot be evicted or rewritten while copied, and
   nothing that decides eviction changes: no recency refreshed, no lookup counted, no
   fresh page taken, nothing evicted), copies and encodes them, releases, and sends the
   values in one pipeline. No KV byte is copied under the segment's lock and no network
   wait happens inside a core call.

Which pages: a candidate node's own pages, and the pages of its chain before it that the
store lacks. A remote reader walks a prompt's chain from its first page and stops at the
first miss, so an evicted page whose prefix stays hot here (never evicted, never sent)
would be out of every other host's reach; its prefix goes with it (once). Pages that are
neither near eviction nor on the chain of one that is are never sent.

It is a race, not a hook: an allocation that needs more pages than the headroom before the
writer's next look evicts pages unsent (the segment's ``evicted_pages`` against the tier's
``written_pages`` + ``present_pages`` says how often), and while the writer holds up to
``write_batch_pages`` cold pages (the copy, ~1 ms), an allocation evicts the next ones
instead. A held page is never an OutOfPagesError for the engine only if the pool has more
than ``write_batch_pages`` pages beyond what the engine's own sequences hold; the
write-through writer's borrow has the same bound.
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
import threading
import time
from typing import Dict, List, Optional, Tuple

import numpy as np

from hostkv.cache import HostKVCache
from hostkv.errors import CapacityError, OutOfPagesError
from hostkv.remote.config import RemoteConfig
from hostkv.remote.stats import TierCounters
from hostkv.remote.writer import StoreWriter, Todo
from hostkv.worker_view import SequenceRequest, WorkerView

__all__ = ["EvictWriter"]

log = logging.getLogger("hostkv.remote")

_REMEMBER_MAX_SECONDS = 300.0
_KEY_MEMO_PATHS = 1024       # paths whose chain keys are kept (a path: tokens + 16 B a page)


class EvictWriter:
    """The thread that writes pages near eviction to the store, for one RemoteTier.

    Built and owned by RemoteTier; it shares the tier's handle (the engine's), store writer
    (backend, breaker) and counters, and keeps its own WorkerView (one per thread).
    """

    def __init__(self, cache: HostKVCache, config: RemoteConfig, store: StoreWriter,
                 counters: TierCounters) -> None:
        """Prepares the writer; start() starts its thread."""
        self._handle = cache
        self._store = store
        self._counters = counters
        cfg = cache.config
        self._num_pages = cfg.num_pages
        self._page_size = cfg.page_size
        self._headroom = max(1, math.ceil(config.evict_headroom * cfg.num_pages))
        self._poll = config.evict_poll_seconds
        ttl = config.ttl_seconds
        self._remember = min(ttl / 2, _REMEMBER_MAX_SECONDS) if ttl else _REMEMBER_MAX_SECONDS
        # Keys known to be in the store -> when we learnt it (monotonic); bounded.
        self._known: "collections.OrderedDict[bytes, float]" = collections.OrderedDict()
        self._known_cap = max(1024, 4 * cfg.num_pages)
        self._known_lock = threading.Lock()
        # Keys whose value in the store failed a check when the tier fetched it: sent, not
        # asked about (under _known_lock; bounded like _known).
        self._invalid: "collections.OrderedDict[bytes, None]" = collections.OrderedDict()
        self._key_memo: "collections.OrderedDict[Tuple[int, bytes], List[bytes]]" = (
            collections.OrderedDict())
        self._view = WorkerView(cache)
        self._seq_ids = itertools.count(1)
        self._wake = threading.Condition()
        self._kicks = 0             # rounds asked for (flush)
        self._rounds_done = 0       # rounds finished
        self._stop = False
        # (free pages, evicted pages) at the last look that left nothing to send, and when.
        self._settled: Tuple[int, int] = (-1, -1)
        self._settled_at = 0.0
        # Pages from the cold end of the eviction order found all sent at the last look,
        # the segment's evicted_pages then, and when the last pass from the cold end began.
        self._verified = 0
        self._verified_evicted = 0
        self._swept_at = 0.0
        #: Send a near-eviction page's missing chain prefix too (see the module docstring).
        #: The benchmark turns it off to measure the pages alone.
        self.send_prefix = True
        self.known_skipped = 0      # pages skipped because they were known to be there
        self._thread = threading.Thread(target=self._loop, name="hostkv-remote-evict",
                                        daemon=True)

    def start(self) -> None:
        """Starts the thread."""
        self._thread.start()

    def wake(self) -> None:
        """Looks at the pool now, not at the next poll (the engine committed or released)."""
        with self._wake:
            self._wake.notify_all()

    def note_present(self, keys: List[bytes]) -> None:
        """Remembers keys whose value in the store is known to be good (the tier fetched
        it, or this writer stored it)."""
        self._remember_present(keys, valid=True)

    def _remember_present(self, keys: List[bytes], valid: bool) -> None:
        """Remembers keys the store holds; ``valid``: their values are known good (else the
        store only said a value exists, which says nothing of a key found invalid)."""
        now = time.monotonic()
        with self._known_lock:
            for key in keys:
                if valid:
                    self._invalid.pop(key, None)
                elif key in self._invalid:
                    continue
                self._known[key] = now
                self._known.move_to_end(key)
            while len(self._known) > self._known_cap:
                self._known.popitem(last=False)

    def note_invalid(self, keys: List[bytes]) -> None:
        """Remembers keys whose value in the store failed a check (the tier fetched it):
        their pages are sent when near eviction, never asked about."""
        with self._known_lock:
            for key in keys:
                self._known.pop(key, None)
                self._invalid[key] = None
                self._invalid.move_to_end(key)
            while len(self._invalid) > self._known_cap:
                self._invalid.popitem(last=False)

    def _is_known(self, key: bytes, now: float) -> bool:
        with self._known_lock:
            when = self._known.get(key)
            if when is None:
                return False
            if now - when > self._remember:
                del self._known[key]
                return False
            return True

    def _keys(self, namespace: int, tokens: np.ndarray, num_pages: int) -> List[bytes]:
        """The chain keys of a path, memoised: the same cold paths come back at every look,
        and hashing the raw tokens is ~100x cheaper than a BLAKE2b per page."""
        memo_key = (namespace, tokens.tobytes())
        keys = self._key_memo.get(memo_key)
        if keys is None:
            keys = self._store.chain_keys(namespace, tokens, num_pages)
            self._key_memo[memo_key] = keys
            while len(self._key_memo) > _KEY_MEMO_PATHS:
                self._key_memo.popitem(last=False)
        else:
            self._key_memo.move_to_end(memo_key)
        return keys

    def flush(self, timeout: Optional[float]) -> bool:
        """Runs one full round after this call (sending what is near eviction now) and waits
        for it; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._wake:
            self._kicks += 1
            wanted = self._kicks
            self._wake.notify_all()
            while self._rounds_done < wanted and not self._stop and self._thread.is_alive():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._wake.wait(0.05 if left is None else min(left, 0.05))
        return True

    def stop(self) -> None:
        """Asks the thread to stop (close() joins it)."""
        with self._wake:
            self._stop = True
            self._wake.notify_all()

    def join(self, timeout: float) -> None:
        """Waits for the thread to end."""
        self._thread.join(timeout)

    def is_alive(self) -> bool:
        """True while the thread runs."""
        return self._thread.is_alive()

    def close_view(self) -> None:
        """Releases the writer's sequences (after the thread stopped)."""
        self._view.close()

    # -- the thread ----------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._wake:
                if not self._stop and self._rounds_done >= self._kicks:
                    self._wake.wait(self._poll)
                if self._stop:
                    self._rounds_done = self._kicks
                    self._wake.notify_all()
                    return
                kicks = self._kicks
                forced = sweep = self._rounds_done < kicks
            try:
                # A round sends at most write_batch_pages: go on while it had work.
                while self._round(forced, sweep) and not self._stop:
                    forced, sweep = True, False
            except Exception:     # a bug must not kill the thread: the host tier goes on
                log.exception("hostkv remote tier: write-on-evict round failed")
                self._counters.add(errors=1)
            with self._wake:
                self._rounds_done = max(self._rounds_done, kicks)
                self._wake.notify_all()

    def _round(self, forced: bool, sweep: bool) -> bool:
        """One look at the pool and at most one batch sent. True if it sent or asked about
        pages (there may be more to do), False when nothing near eviction is unsent.
        forced: look even if nothing changed; sweep: read from the coldest page."""
        store = self._store
        handle = self._handle
        stats = handle.stats()
        short = self._headroom - stats.free_pages
        # The coldest pages change when free pages shrink (more of them are near eviction)
        # or pages are evicted; a commit adds only the hottest. A busy engine wakes the
        # writer at every commit: unless one of those changed since the last look that found
        # everything sent (or flush() asks, or a poll interval passed), one stats() call is
        # all such a wake costs.
        state = (stats.free_pages, stats.evicted_pages)
        now = time.monotonic()
        if not forced and state == self._settled and now - self._settled_at < self._poll:
            return False
        if short <= 0:
            self._settled, self._settled_at = state, now
            self._verified = 0
            return False
        # Read the eviction order in windows of a few batches (each one short hold of the
        # lock), from where the last look found everything sent: the pages evicted since
        # then came off that end. A full pass from the coldest page once per poll interval
        # (or when flush() asks) catches what moved in behind the cursor.
        if sweep or now - self._swept_at >= self._poll:
            offset = 0
            self._swept_at = now
        else:
            offset = max(0, self._verified - (stats.evicted_pages - self._verified_evicted))
        ps = self._page_size
        limit = store.write_limit
        window = 4 * limit
        # (namespace, tokens of the path up to the last page to send, keys, pages to send)
        jobs: List[Todo] = []
        chosen: Dict[bytes, bool] = {}
        total = 0
        while offset < short and not jobs:
            candidates = handle.eviction_candidates(min(window, short - offset), offset)
            if not candidates:
                break
            for cand in candidates:
                num_path = len(cand.pages)
                first = 0 if self.send_prefix else num_path - cand.num_pages
                keys = self._keys(cand.namespace, cand.tokens, num_path)
                todo = []
                for page in range(first, num_path):
                    key = keys[page]
                    if key in chosen:
                        continue
                    if self._is_known(key, now):
                        self.known_skipped += 1
                        continue
                    todo.append(page)
                    chosen[key] = True
                if not todo:
                    if not jobs:
                        offset = cand.position + cand.num_pages     # all sent up to here
                    continue
                if total + len(todo) > limit:
                    if total:
                        break                      # the next round takes it whole
                    # A node longer than a batch: its head first (a reader needs the
                    # chain's start), the rest next round.
                    todo = todo[:limit]
                jobs.append((cand.namespace, cand.tokens[:(todo[-1] + 1) * ps], keys, todo))
                total += len(todo)
                if total >= limit:
                    break
        self._verified, self._verified_evicted = offset, stats.evicted_pages
        if not jobs:
            self._settled, self._settled_at = state, now
            return False
        if not store.allow():
            return False             # nothing is lost: the pages are looked at again
        with self._known_lock:
            invalid = {keys[p] for _, _, keys, todo in jobs for p in todo
                       if keys[p] in self._invalid}
        asking = [keys[p] for _, _, keys, todo in jobs for p in todo if keys[p] not in invalid]
        present = store.ask(asking)
        if present is None:
            return False
        there = [key for key, flag in zip(asking, present) if flag]
        self._remember_present(there, valid=False)
        self._counters.add(present_pages=len(there))
        # A page whose node did not answer (None) is not sent: that node is down; the page
        # is looked at again at the next round.
        unknown = {key for key, flag in zip(asking, present) if flag is None}
        there_set = set(there)
        missing = []
        for namespace, tokens, keys, todo in jobs:
            pages = [p for p in todo if keys[p] not in there_set and keys[p] not in unknown]
            if pages:
                missing.append((namespace, tokens, keys, pages))
        if not missing:
            return not unknown       # a node that did not answer: wait for the next poll
        items = self._hold_and_encode(missing)
        if items is None:
            return False             # no sequence record to hold with: try at the next look
        if not items:
            return True              # all evicted meanwhile: look again
        not_stored = store.send(items)
        if not_stored is None:
            return False
        if not_stored:
            # A cluster node lost some (which ones is not known): nothing is remembered, and
            # the next poll asks again. Not at once: keys found invalid are sent unasked,
            # and would go to the dead node again and again.
            return False
        self.note_present([key for key, _ in items])
        return True

    def _hold_and_encode(self, missing: List[Todo]) -> Optional[List[Tuple[bytes, bytes]]]:
        """Holds the pages (no recency refreshed, nothing evicted), copies and encodes them,
        releases them. Pages evicted since eviction_candidates are dropped (counted)."""
        requests = [SequenceRequest(next(self._seq_ids), tokens, namespace)
                    for namespace, tokens, _keys, _pages in missing]
        try:
            holds = self._view.hold_cached_pages(requests)
        except (OutOfPagesError, CapacityError) as exc:
            log.debug("hostkv remote tier: cannot hold pages to write: %s", exc)
            self._counters.add(writes_dropped=sum(len(p) for _, _, _, p in missing))
            return None
        return self._store.encode_held(self._view, missing, holds)
