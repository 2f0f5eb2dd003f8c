"""A corrupted segment is an error, never a crash: seeded random bytes of the metadata are
flipped through a raw mmap, then every kind of operation runs on it.

Each case runs in a subprocess (tests/workers/corruption_worker.py, several cases per
process), so that a segfault is a test failure with a clear exit status instead of a dead
pytest, and a hang is a timeout. An operation must raise a hostkv error (CorruptionError, mostly) or a
ValueError, or return a correct-looking answer; anything else (IndexError, OverflowError,
SystemError, MemoryError, a death by signal, a hang) fails the test, naming the seed.

Reproduce one case with `python tests/workers/corruption_worker.py some-name SEED`.
HOSTKV_LONG=1 runs 20000 cases instead of 400.
"""

from __future__ import annotations

import collections
import glob
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time

import posix_ipc
import pytest

from hostkv import CorruptionError, HostKVCache, SequenceRequest as R, WorkerView

from conftest import report_counts, small_config
from lib.rawseg import RawSegment

LONG = os.environ.get("HOSTKV_LONG") == "1"
CASES = 20000 if LONG else 400
BATCH = 25                      # cases per subprocess
TIMEOUT = 20                    # seconds per subprocess (a batch takes well under 5)
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "corruption_worker.py")


def _cleanup(prefix: str) -> None:
    for path in glob.glob(f"/dev/shm/{prefix}-*"):
        try:
            posix_ipc.unlink_shared_memory("/" + os.path.basename(path))
        except posix_ipc.ExistentialError:
            pass


def _run_batch(prefix: str, seeds: list):
    """Runs seeds in one subprocess; returns (results by seed, failure or None, seeds left)."""
    try:
        proc = subprocess.run([sys.executable, WORKER, prefix, *map(str, seeds)],
                              capture_output=True, text=True, timeout=TIMEOUT)
        stdout, stderr, rc, timed_out = proc.stdout, proc.stderr, proc.returncode, False
    except subprocess.TimeoutExpired as exc:
        stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        stderr = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        rc, timed_out = None, True
    results = {}
    started = None
    flips = ""
    for line in stdout.splitlines():
        kind, _, rest = line.partition(" ")
        if kind == "START":
            started = int(rest)
            flips = ""
        elif kind == "FLIPS":
            flips = rest.partition(" ")[2]
        elif kind == "DONE":
            seed, _, payload = rest.partition(" ")
            results[int(seed)] = json.loads(payload)
            started = None
    failure = None
    left = []
    if started is not None:
        if timed_out:
            why = f"hung (no answer within {TIMEOUT} s)"
        elif rc is not None and rc < 0:
            why = f"killed by signal {signal.Signals(-rc).name}"
        else:
            why = f"exited with status {rc} mid-case"
        failure = (started, f"seed {started}: the worker {why}; flips {flips}\n{stderr[-3000:]}")
        left = seeds[seeds.index(started) + 1:]
    elif rc not in (0, 3):
        failure = (None, f"worker exited with {rc} between cases\n{stderr[-3000:]}")
    return results, failure, left


def test_corrupted_metadata_never_crashes(segment_name):
    prefix = segment_name + "-c"
    pending = list(range(CASES))
    results = {}
    failures = []
    try:
        while pending:
            batch, pending = pending[:BATCH], pending[BATCH:]
            got, failure, left = _run_batch(prefix, batch)
            results.update(got)
            if failure is not None:
                failures.append(failure[1])
            pending = left + pending
    finally:
        _cleanup(prefix)

    bad = [f"seed {seed}: flips {r['flips']}: " + "; ".join(r["bad"])
           for seed, r in sorted(results.items()) if r["bad"]]
    outcomes = collections.Counter(o for r in results.values() for o in r["outcomes"].values())
    detected = sum(1 for r in results.values() if "CorruptionError" in r["outcomes"].values())
    summary = (f"corruption: {len(results) + len(failures)} cases, {len(results)} completed, "
               f"{len(failures)} crashed or hung, {len(bad)} with a bad answer; "
               f"{detected} cases raised CorruptionError; operation outcomes {dict(outcomes)}")
    report_counts(summary)
    assert not failures, f"{len(failures)} case(s) crashed or hung:\n" + "\n".join(failures[:5])
    assert not bad, f"{len(bad)} case(s) misbehaved:\n" + "\n".join(bad[:5])
    assert len(results) == CASES
    # The corruption is real: a good share of cases must have been caught as such.
    assert detected > CASES // 4, summary


# -- a recovery that fails on corrupted data ----------------------------------------------------

CHILD_TIMEOUT = 20.0
ctx = multiprocessing.get_context("spawn")


def _die_inside_the_lock(name: str) -> None:
    """Spawned child: attaches and dies (crash point, status 77) in the middle of a batch."""
    cache = HostKVCache.attach(name)
    view = WorkerView(cache)
    cache._segment._arm_crash_point(12)
    view.allocate_pages_for_sequences_with_prefix([R(1, list(range(10)))])
    os._exit(0)                         # not reached: the crash point fires first


def test_a_failed_recovery_leaves_no_lock_held(segment_name):
    # A dead lock holder's undo log is replayed by the next locker; here the state it
    # re-derives from is corrupt, so recovery fails. Every later locker, in this process
    # or another, must hear CorruptionError at once: not wait out the lock timeout for a
    # lock left held (glibc's pthread_mutex_trylock answers ENOTRECOVERABLE with the lock
    # word still taken, so the segment's mutex must never be left unrecoverable).
    # A long lock timeout, so that "at once" and "after the timeout" cannot be confused on
    # a loaded machine (this is about not hanging, not about speed).
    cache = HostKVCache.create(segment_name, small_config(), lock_timeout=30.0)
    info = cache._segment.header_info()
    p = ctx.Process(target=_die_inside_the_lock, args=(segment_name,))
    p.start()
    p.join(CHILD_TIMEOUT)
    assert p.exitcode == 77
    last = cache.config.num_pages - 1               # a page the dead batch never touched
    at = info["regions"]["reg_page_refcounts"] + 4 * last
    with RawSegment(segment_name) as raw:
        raw.map[at:at + 4] = (-5).to_bytes(4, "little", signed=True)
    for _ in range(3):
        started = time.monotonic()
        with pytest.raises(CorruptionError):
            cache.stats()
        assert time.monotonic() - started < 15.0
    started = time.monotonic()
    with pytest.raises(CorruptionError):
        HostKVCache.attach(segment_name, lock_timeout=30.0)
    assert time.monotonic() - started < 15.0
    # Closing cannot give the lease back through a corrupt segment; it still unmaps.
    with pytest.raises(CorruptionError):
        cache.close()
    assert cache.closed
