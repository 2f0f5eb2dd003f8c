"""Attach and a creator still initialising.

A creator writes a header that says what the segment is (magic, format, config, regions,
creator pid, state INITIALISING) before sizing it, then reserves its memory chunk by chunk,
publishing the bytes reserved so far, then writes its tables and says READY. An attacher
waits for all of that within ready_timeout, says how far the creator got when it times
out, and refuses a segment that is not hostkv's (zeros, garbage) at once.
"""

from __future__ import annotations

import os
import struct
import threading
import time

import numpy as np
import posix_ipc
import pytest

from hostkv import (
    AbandonedSegmentError,
    HostKVCache,
    IncompatibleSegmentError,
    SegmentInUseError,
    _format,
    _segment,
)

from conftest import small_config
from lib.rawseg import RawSegment, hold_creator_mark

LAYOUT = _segment.layout_info()
HEADER = LAYOUT["header"]
HEADER_SIZE = LAYOUT["sizes"]["HkvHeader"]
STATE_INITIALISING, STATE_READY = 1, 2


def _image_of_a_closed_segment(name: str) -> bytes:
    """The bytes of a freshly created (and closed: no live lease) small segment."""
    with HostKVCache.create(name, small_config()):
        pass
    with RawSegment(name) as raw:
        return raw.read(0, raw.size)


def _header(image: bytes, state: int, reserved: int) -> bytes:
    header = bytearray(image[:HEADER_SIZE])
    struct.pack_into("<I", header, HEADER["hdr_state"], state)
    struct.pack_into("<q", header, HEADER["hdr_reserved_bytes"], reserved)
    return bytes(header)


def _empty_segment(name: str, creator: bool = True) -> int:
    """A new empty segment file; creator: holding the creator's mark on it, as a live
    creator does until READY."""
    shm = posix_ipc.SharedMemory("/" + name, posix_ipc.O_CREX, mode=0o600, size=0)
    if creator:
        hold_creator_mark(shm.fd)
    return shm.fd


def _attach_in_thread(name, **kwargs):
    result: list = []

    def run():
        try:
            result.append(HostKVCache.attach(name, **kwargs))
        except BaseException as exc:  # noqa: BLE001
            result.append(exc)

    t = threading.Thread(target=run)
    t.start()
    return t, result


def test_attach_waits_for_a_creator_that_has_not_sized_the_segment(segment_name, new_name):
    # Before: attach failed at once ("shorter than a hostkv header") if it opened the
    # segment between the creator's shm_open and its sizing, whatever ready_timeout said.
    image = _image_of_a_closed_segment(new_name())
    total = len(image)
    fd = _empty_segment(segment_name)
    try:
        t, result = _attach_in_thread(segment_name, ready_timeout=120)
        # Play the creator, step by step, while the attacher waits.
        os.pwrite(fd, _header(image, STATE_INITIALISING, 0), 0)
        os.ftruncate(fd, total)
        os.pwrite(fd, image[HEADER_SIZE:], HEADER_SIZE)
        os.pwrite(fd, _header(image, STATE_INITIALISING, total), 0)
        os.pwrite(fd, _header(image, STATE_READY, total), 0)
    finally:
        os.close(fd)
    t.join(120)
    assert not t.is_alive()
    [cache] = result
    assert isinstance(cache, HostKVCache), repr(cache)
    try:
        cache.check()
        assert cache.stats().active_processes == 1
    finally:
        cache.close()


@pytest.mark.parametrize("fraction", [0.0, 0.4, 1.0])
def test_a_timeout_says_how_far_the_creator_got(segment_name, new_name, fraction):
    image = _image_of_a_closed_segment(new_name())
    total = len(image)
    fd = _empty_segment(segment_name)
    try:
        os.pwrite(fd, _header(image, STATE_INITIALISING, int(total * fraction)), 0)
        os.ftruncate(fd, total)
        # A live creator (it holds its mark) that makes no progress.
        with pytest.raises(IncompatibleSegmentError) as info:
            HostKVCache.attach(segment_name, ready_timeout=0.2)
    finally:
        os.close(fd)
    assert not isinstance(info.value, AbandonedSegmentError)
    text = str(info.value)
    assert "still being created by pid" in text and "did not become ready" in text
    if fraction < 1:
        assert f"{fraction * 100:.0f}% of its {total} bytes reserved" in text
    else:
        assert "all of its memory reserved" in text
    assert "no progress while waiting" in text


@pytest.mark.parametrize("content", ["zeros", "garbage"])
def test_a_segment_that_is_not_hostkv_is_refused_at_once(segment_name, content):
    # Not after the full ready_timeout: the creator writes the magic before sizing, so a
    # sized segment without it is not hostkv's. (A timeout of an hour: had attach waited,
    # the join below would give up and the test fail.)
    fd = _empty_segment(segment_name)
    try:
        size = 1 << 20
        data = bytes(size) if content == "zeros" else np.random.default_rng(1).bytes(size)
        os.pwrite(fd, data, 0)
    finally:
        os.close(fd)
    t, result = _attach_in_thread(segment_name, ready_timeout=3600)
    t.join(60)
    assert not t.is_alive()
    [exc] = result
    assert isinstance(exc, IncompatibleSegmentError)
    assert "not a hostkv segment" in str(exc)


def test_create_publishes_its_reservation(cache):
    info = cache._segment.header_info()
    assert info["reserved_bytes"] == info["regions"]["reg_total_size"]


def test_the_default_ready_timeout_fits_a_real_pool():
    # The README's 65,536 x 2 MiB pool takes ~23 s to reserve at ~5.7 GB/s (measured).
    assert _segment.DEFAULT_READY_TIMEOUT >= 60


# -- a creator that dies, a creator that is slow ---------------------------------------------

PACE_CHUNK = 64 << 10           # small chunks, so that a small segment takes many steps


def _paced_creator(name: str, delay: float) -> None:
    """Creates a small segment, reserving 64 KiB at a time and sleeping `delay` after each,
    then stays attached until killed."""
    _format._pace_reservation(PACE_CHUNK, delay)
    cache = HostKVCache.create(name, small_config())
    time.sleep(3600)
    cache.close()


def _steps(name: str) -> int:
    """The creator's published step count, read behind hostkv's back (0 before the header)."""
    try:
        with open(f"/dev/shm/{name}", "rb") as f:
            data = f.read(HEADER_SIZE)
    except FileNotFoundError:
        return 0
    if len(data) < HEADER_SIZE:
        return 0
    return struct.unpack_from("<Q", data, HEADER["hdr_create_steps"])[0]


def _wait_for_steps(name: str, steps: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while _steps(name) < steps:
        assert time.monotonic() < deadline, f"the creator of {name} made no progress"
        time.sleep(0.01)


def test_a_creator_killed_mid_create_is_detected_at_once_and_replaced(segment_name, procs):
    # Before: the half-made segment was waited for until ready_timeout, then refused with
    # "no progress", forever: every engine blocked until someone unlinked it by hand.
    creator = procs(_paced_creator, segment_name, 10.0)
    _wait_for_steps(segment_name, 2)                 # in the middle of its reservation
    creator.kill()
    creator.join(60)
    t, result = _attach_in_thread(segment_name, ready_timeout=3600)
    t.join(30)
    assert not t.is_alive(), "attach waited for a dead creator"
    [exc] = result
    assert isinstance(exc, AbandonedSegmentError), repr(exc)
    assert "abandoned by its creator" in str(exc)
    # Nobody holds it: the next opener replaces it.
    inode = os.stat(f"/dev/shm/{segment_name}")
    fresh = HostKVCache.replace_segment(segment_name, small_config(),
                                        expect_inode=(inode.st_dev, inode.st_ino))
    assert fresh is not None
    try:
        fresh.check()
        again = HostKVCache.attach(segment_name, ready_timeout=5)
        try:
            assert again.segment_id == fresh.segment_id
        finally:
            again.close()
    finally:
        fresh.close()


def test_a_slow_creator_is_waited_for_past_ready_timeout(segment_name, procs):
    # Before: ready_timeout bounded the whole wait, so a pool that took longer to reserve
    # than it failed every attacher; now it bounds a stall.
    procs(_paced_creator, segment_name, 0.1)         # ~24 chunks of 64 KiB: ~2.4 s
    _wait_for_steps(segment_name, 1)
    start = time.monotonic()
    cache = HostKVCache.attach(segment_name, ready_timeout=0.5)
    waited = time.monotonic() - start
    try:
        cache.check()
        assert waited > 0.5, waited                 # it did wait past ready_timeout
    finally:
        cache.close()


def test_replace_refuses_a_segment_in_use(segment_name):
    with HostKVCache.create(segment_name, small_config()) as user:
        with pytest.raises(SegmentInUseError):
            HostKVCache.replace_segment(segment_name, small_config())
        # An observer holds no lock: it never keeps a segment from being replaced.
        user.close()
        observer = HostKVCache.attach(segment_name, lease=False)
        try:
            fresh = HostKVCache.replace_segment(segment_name, small_config())
            assert fresh is not None
            assert fresh.segment_id != observer.segment_id
            fresh.close()
        finally:
            observer.close()
