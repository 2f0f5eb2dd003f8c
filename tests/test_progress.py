"""Progress bars redraw in place only on a terminal; anywhere else a phase is one plain line."""

from __future__ import annotations

import io
import os
import select

import pytest

from hostkv._progress import Progress


def test_off_a_terminal_a_phase_is_one_plain_line():
    out = io.StringIO()
    bar = Progress("reuse", 3, stream=out)
    for done in range(1, 4):
        bar.update(done)
    assert out.getvalue() == ""
    bar.close()
    bar.close()
    assert out.getvalue() == "reuse      3/3\n"


def test_a_phase_that_fails_still_ends_its_line():
    out = io.StringIO()
    with pytest.raises(RuntimeError):
        with Progress("no reuse", 48, stream=out) as bar:
            bar.update(5)
            raise RuntimeError("a worker process failed")
    assert out.getvalue() == "no reuse   5/48\n"


def test_on_a_terminal_the_bar_redraws_in_place():
    master, slave = os.openpty()
    try:
        with open(slave, "w", closefd=False) as tty:
            with Progress("reuse", 4, stream=tty, width=8) as bar:
                bar.update(1)
                bar.update(4)
        text = b""
        while select.select([master], [], [], 1.0)[0]:
            text += os.read(master, 4096)
            if text.endswith(b"\n"):
                break
    finally:
        os.close(slave)
        os.close(master)
    # (a terminal in its usual mode turns the final "\n" into "\r\n")
    assert text.replace(b"\r\n", b"\n") == (b"\rreuse      [##......] 1/4"
                                            b"\rreuse      [########] 4/4\n")


def test_a_closed_or_plain_stream_counts_as_no_terminal():
    closed = io.StringIO()
    closed.close()
    assert not Progress("x", 1, stream=closed).tty

    class Bare:                 # a write()-only object, as some loggers hand out
        def write(self, text: str) -> int:
            return len(text)

        def flush(self) -> None:
            pass

    assert not Progress("x", 1, stream=Bare()).tty
