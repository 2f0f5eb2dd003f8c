"""The remote tier's circuit breaker: a store that keeps failing is left alone for a while.

Every store call is bounded by the socket timeouts. The breaker opens after
``failure_threshold`` consecutive failures: while open, lookups resolve at once as skipped and
writes are dropped (both counted), so the host tier serves at full speed; after a backoff
(doubling up to ``backoff_max``) one probe goes through, and success closes it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

from hostkv.remote.config import RemoteConfig

__all__ = ["Breaker"]

log = logging.getLogger("hostkv.remote")


class Breaker:
    """Closed -> (failure_threshold failures) -> open for a backoff -> one probe -> closed or
    open again for twice as long (up to backoff_max).

    A probe that never reports back (its batch turned out to have nothing to send, or
    failed for a reason that is not the store's) expires after one store call's timeouts,
    and the next call probes again: the breaker can never stay open for good."""

    def __init__(self, config: RemoteConfig,
                 on_change: Optional[Callable[[bool, bool], None]] = None) -> None:
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

    def holding_off(self) -> bool:
        """True while the breaker is open and its backoff runs: new work is refused at the
        door (a lookup skipped, a write dropped) instead of queued. No lock: a stale answer
        costs one lookup or write either way."""
        return self.is_open and time.monotonic() < self._open_until

    def allow(self) -> bool:
        """Whether a store call may go now: always while closed; once the backoff ran out,
        one probe at a time while open."""
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
        """The store answered: closes the breaker."""
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
        """A store call failed: one more towards opening, or open again for longer after a
        failed probe."""
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
