"""A progress bar that redraws in place on a terminal and prints one plain line elsewhere.

A bar redrawn with carriage returns is for a person watching a terminal. Written to a file or
a pipe (a CI log, ``2>log``, a test's captured output) every frame lands in the output, all on
one ever longer line. So off a terminal a phase prints a single plain line when it ends.
The examples and the command-line tools draw their bars here, so that this is decided once.
"""

from __future__ import annotations

import sys
from typing import Optional, TextIO

__all__ = ["Progress"]


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):    # no isatty(), or a closed file
        return False


class Progress:
    """One phase's progress bar: ``update(done)`` as work completes, ``close()`` at the end.

    On a terminal each update redraws ``label [####....] done/total`` in place and close()
    ends the line; on anything else updates print nothing and close() prints
    ``label done/total`` once. Also a context manager that closes on exit, errors included,
    so that a traceback starts on a line of its own.

    Args:
        label: the phase's name, printed first.
        total: the amount of work in the phase (requests, pages, ...).
        stream: where to write; sys.stderr (as it is at construction) by default.
        width: the bar's width in characters.
    """

    def __init__(self, label: str, total: int, stream: Optional[TextIO] = None,
                 width: int = 30) -> None:
        self.label = label
        self.total = total
        self.done = 0
        self.width = width
        self.stream = sys.stderr if stream is None else stream
        self.tty = _isatty(self.stream)
        self._closed = False

    def update(self, done: int) -> None:
        """Record that `done` of `total` are complete (an absolute count, not an increment)."""
        self.done = done
        if self.tty:
            filled = self.width * min(done, self.total) // max(self.total, 1)
            bar = "#" * filled + "." * (self.width - filled)
            self.stream.write(f"\r{self.label:<10} [{bar}] {done}/{self.total}")
            self.stream.flush()

    def close(self) -> None:
        """End the phase: end the bar's line, or print the one plain line. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.tty:
            self.stream.write("\n")
        else:
            self.stream.write(f"{self.label:<10} {self.done}/{self.total}\n")
        self.stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
