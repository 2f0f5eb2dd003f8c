"""Shared fixtures: every test gets its own segment name, unlinked afterwards, failures included."""

from __future__ import annotations

import contextlib
import glob
import multiprocessing
import os
import signal
import uuid
from typing import Callable

import posix_ipc
import pytest

import hostkv


def unlink_quietly(name: str) -> None:
    """Unlinks the segment `name` if it exists, and its side objects (NAME@...: the remote
    tier's shared counters)."""
    try:
        posix_ipc.unlink_shared_memory("/" + name)
    except posix_ipc.ExistentialError:
        pass
    for path in glob.glob(f"/dev/shm/{glob.escape(name)}@*"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


@pytest.fixture
def segment_name(request):
    """A fresh segment name; the segment (if any test created it) is unlinked in teardown."""
    names = []

    def make(suffix: str = "") -> str:
        name = f"hostkv-test-{os.getpid()}-{uuid.uuid4().hex[:12]}{suffix}"
        names.append(name)
        return name

    name = make()
    request.node.extra_segment_name = make
    yield name
    for n in names:
        unlink_quietly(n)


@pytest.fixture
def new_name(request, segment_name):
    """A factory for further unique names, unlinked in teardown like segment_name."""
    return request.node.extra_segment_name


def small_config(**overrides) -> hostkv.HostKVConfig:
    """A small pool suitable for unit tests."""
    values = dict(num_pages=32, page_size=4, page_bytes=64, max_processes=8)
    values.update(overrides)
    return hostkv.HostKVConfig(**values)


@pytest.fixture
def cache(segment_name):
    """A freshly created small cache, closed and unlinked in teardown."""
    c = hostkv.HostKVCache.create(segment_name, small_config())
    try:
        yield c
    finally:
        try:
            c.close()
        except BufferError:
            pass


CHILD_TIMEOUT = 60


def fork_quietly() -> int:
    """os.fork() in a process with threads (hostkv's lease thread), which Python 3.12+
    warns about: the tests that fork know the child only uses async-signal-safe paths."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return os.fork()


def run_in_fork(body: Callable[[], int]) -> int:
    """Runs body() in a forked child and returns the child's exit code: what body returned,
    2 if it raised (its traceback printed), negative if a signal killed it. The child never
    returns into pytest."""
    pid = fork_quietly()
    if pid == 0:
        status = 2
        try:
            status = body()
        except BaseException:  # noqa: BLE001 - reported through the exit status
            import traceback

            traceback.print_exc()
            status = 2
        finally:
            os._exit(status)
    _, wait_status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(wait_status)


@pytest.fixture
def procs():
    """Starts spawn-context children; kills any still alive in teardown, failures included."""
    ctx = multiprocessing.get_context("spawn")
    started = []

    def start(target, *args):
        p = ctx.Process(target=target, args=args, daemon=True)
        p.start()
        started.append(p)
        return p

    yield start
    for p in started:
        if p.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGCONT)     # a stopped child cannot die otherwise
            p.kill()
        p.join(CHILD_TIMEOUT)


# -- counts of the stress tests (soak, corruption, bad input) ------------------------------

STRESS_COUNTS: list = []


def report_counts(line: str) -> None:
    """Prints a stress test's counts (seen with -s) and repeats them in pytest's terminal
    summary, so that a plain run shows them too."""
    print("\n" + line)
    STRESS_COUNTS.append(line)


def pytest_terminal_summary(terminalreporter):
    if STRESS_COUNTS:
        terminalreporter.section("hostkv stress counts")
        for line in STRESS_COUNTS:
            terminalreporter.write_line(line)
