"""Replacing a stale segment while many processes open it at once.

Every attached handle holds a shared flock on the segment's file; a replacer takes the
exclusive lock without waiting, so it replaces only what nobody uses, and lookers (who hold
neither a lease nor the lock) never count as users. Tensor-parallel workers of one engine
start together: every one of them must come out attached to the same, new segment.
"""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import threading
import time

import pytest

from hostkv import HostKVCache, SegmentInUseError

from conftest import small_config, unlink_quietly

PROCESSES = 4
TRIALS = 12
STALE = dict(page_bytes=64)
WANTED = dict(page_bytes=128)


def _opener(commands, answers, barrier) -> None:
    """Opens the segment each command names, all at once with the others, and answers
    (segment id, page_bytes) or the error; keeps it attached until every opener answered."""
    while True:
        name = commands.get()
        if name is None:
            return
        barrier.wait()
        try:
            cache = HostKVCache.open(name, small_config(**WANTED), ready_timeout=30)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            answers.put(("error", repr(exc)))
            barrier.wait()
            continue
        answers.put(("ok", (cache.segment_id, cache.config.page_bytes)))
        barrier.wait()                       # all answered: each counted the others
        cache.close()


@pytest.fixture
def openers():
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(PROCESSES)
    answers = ctx.Queue()
    queues = [ctx.Queue() for _ in range(PROCESSES)]
    procs = [ctx.Process(target=_opener, args=(q, answers, barrier), daemon=True)
             for q in queues]
    for p in procs:
        p.start()

    def run(name: str) -> list:
        for q in queues:
            q.put(name)
        return [answers.get(timeout=120) for _ in procs]

    yield run
    for q in queues:
        q.put(None)
    for p in procs:
        p.join(60)
        if p.is_alive():
            p.kill()
            p.join()
        assert p.exitcode == 0


def test_processes_starting_at_once_on_a_stale_segment_all_succeed(segment_name, openers):
    # Before: every opener that looked at the stale segment took a lease in it, so openers
    # starting together counted each other as live holders, and some of them refused it.
    for trial in range(TRIALS):
        name = f"{segment_name}-{trial}"
        try:
            HostKVCache.create(name, small_config(**STALE)).close()   # stale: nobody holds it
            answers = openers(name)
            assert [kind for kind, _ in answers] == ["ok"] * PROCESSES, (trial, answers)
            ids = {sid for _, (sid, _) in answers}
            assert len(ids) == 1, (trial, answers)           # one and the same new segment
            assert {page_bytes for _, (_, page_bytes) in answers} == {WANTED["page_bytes"]}
            with HostKVCache.attach(name) as after:
                assert after.segment_id in ids
                after.check()
        finally:
            unlink_quietly(name)


def test_processes_starting_at_once_on_no_segment_all_share_one(segment_name, openers):
    for trial in range(4):
        name = f"{segment_name}-{trial}"
        try:
            answers = openers(name)
            assert [kind for kind, _ in answers] == ["ok"] * PROCESSES, (trial, answers)
            assert len({sid for _, (sid, _) in answers}) == 1
        finally:
            unlink_quietly(name)


def test_a_stale_segment_in_use_is_not_replaced(segment_name):
    with HostKVCache.create(segment_name, small_config(**STALE)) as user:
        with pytest.raises(SegmentInUseError):
            HostKVCache.open(segment_name, small_config(**WANTED))
        user.check()
        assert os.path.exists(f"/dev/shm/{segment_name}")


def test_an_attacher_that_opened_the_old_file_opens_the_new_one(segment_name):
    # Play a replacer by hand: it holds the old file's exclusive lock while an attacher
    # that already opened the old file waits for its shared lock; it unlinks and creates
    # anew, then lets go: the attacher finds its file unlinked and opens the name again.
    HostKVCache.create(segment_name, small_config(**STALE)).close()
    path = f"/dev/shm/{segment_name}"
    fd = os.open(path, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    result: list = []
    t = threading.Thread(target=lambda: result.append(HostKVCache.attach(segment_name)))
    t.start()
    time.sleep(0.3)                           # the attacher opened the old file and waits
    assert not result
    os.unlink(path)
    fresh = HostKVCache.create(segment_name, small_config(**WANTED))
    os.close(fd)                              # the replacer lets go
    t.join(30)
    try:
        [again] = result
        assert again.segment_id == fresh.segment_id
        assert again.config.page_bytes == WANTED["page_bytes"]
        again.close()
    finally:
        fresh.close()
