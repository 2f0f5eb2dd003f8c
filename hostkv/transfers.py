"""Copies that finish later: a handle to poll, and the thread that runs CPU copies.

An engine saves a step's KV after its forward wrote it, and must not wait for the copy:
the next step's work can go on while the bytes move. :meth:`CopyEngine.submit_save
<hostkv.copy_engine.CopyEngine.submit_save>` therefore answers a :class:`Transfer` at once;
the engine polls :meth:`Transfer.done` at a later step and only then tells the cache the
pages hold their KV (and only then may it reuse the blocks the copy reads).

On a CPU there is no copy engine beside the cores: a :class:`CopyThread` runs the copies,
in submission order, with the GIL released inside the compiled loop. On a GPU the copies
are enqueued on a side stream and a Transfer wraps the CUDA event recorded after them
(``hostkv.cuda_copy``).

Needs nothing beyond the standard library.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from typing import Any, Callable, Deque, List, Optional, Tuple

__all__ = ["CopyThread", "Transfer"]


class Transfer:
    """One submitted copy: poll :meth:`done`, or :meth:`wait` for it.

    Attributes:
        nbytes: Bytes the copy moves (0 for one that moves nothing).
        error: The exception the copy raised, once done; None if it succeeded.
        seconds: How long the copy ran, once done (on a GPU: from submission until its
            completion was seen, an upper bound).
    """

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.error: Optional[BaseException] = None
        self.seconds = 0.0
        self._finished = threading.Event()
        # What the copy reads or writes that must stay alive until it is done (device
        # staging buffers, index tensors).
        self.keep: List[Any] = []

    @classmethod
    def finished(cls, nbytes: int, error: Optional[BaseException] = None) -> "Transfer":
        """A transfer that is already over (a copy run inline, or one that moved nothing)."""
        transfer = cls(nbytes)
        transfer._finish(error)
        return transfer

    def _finish(self, error: Optional[BaseException] = None) -> None:
        # Without its traceback: the frames would keep the copy's buffers alive.
        self.error = error.with_traceback(None) if error is not None else None
        self.keep = []
        self._finished.set()

    def done(self) -> bool:
        """True once the copy is over (succeeded or failed); never blocks."""
        return self._finished.is_set()

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Blocks until the copy is over or ``timeout`` seconds passed; True if over."""
        return self._finished.wait(timeout)

    def wait_layer(self, layer: int) -> None:
        """For a load: orders what the engine runs next after layer ``layer``'s copy.
        A CPU load is over before its transfer is answered: nothing to do."""

    def wait_all_layers(self) -> None:
        """For a load: orders what the engine runs next after every layer's copy."""


class CopyThread:
    """A daemon thread that runs submitted copies one after another, in order.

    A copy is a callable; its exception is caught and kept on its Transfer, never raised
    in the thread. ``close`` lets the queued copies finish and joins the thread.

    Args:
        name: The thread's name (shows in debuggers and ``py-spy``).
    """

    def __init__(self, name: str = "hostkv-copy") -> None:
        self._name = name
        self._queue: Deque[Tuple[Callable[[], None], Transfer]] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._thread: Optional[threading.Thread] = None
        self._pid = os.getpid()

    def submit(self, copy: Callable[[], None], nbytes: int) -> Transfer:
        """Queues ``copy``; answers its Transfer at once.

        Raises:
            RuntimeError: the thread was closed.
        """
        transfer = Transfer(nbytes)
        if self._pid != os.getpid():
            # A forked child: the parent's queued copies and thread are not this
            # process's (the copies would write the parent's pages a second time).
            self._queue = collections.deque()
            self._cond = threading.Condition()
            self._thread = None
            self._pid = os.getpid()
        with self._cond:
            if self._closed:
                raise RuntimeError("hostkv: the copy thread is closed")
            if self._thread is None or not self._thread.is_alive():
                # Started on first use, not at construction: most engines build one and
                # fork workers before the first copy.
                self._thread = threading.Thread(target=self._run, name=self._name,
                                                daemon=True)
                self._thread.start()
            self._queue.append((copy, transfer))
            self._cond.notify()
        return transfer

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                copy, transfer = self._queue[0]
            started = time.perf_counter()
            try:
                copy()
            except BaseException as exc:  # noqa: BLE001 - kept on the transfer
                error: Optional[BaseException] = exc
            else:
                error = None
            transfer.seconds = time.perf_counter() - started
            with self._cond:
                self._queue.popleft()
            transfer._finish(error)

    def close(self, timeout: Optional[float] = None) -> None:
        """Lets the queued copies finish, then stops the thread (waits up to ``timeout``)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
