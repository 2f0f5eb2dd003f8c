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

import numpy as np
import posix_ipc
import pytest

from hostkv import HostKVCache, IncompatibleSegmentError, _segment

from conftest import small_config
from lib.rawseg import RawSegment

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


def _empty_segment(name: str) -> int:
    shm = posix_ipc.SharedMemory("/" + name, posix_ipc.O_CREX, mode=0o600, size=0)
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
    finally:
        os.close(fd)
    with pytest.raises(IncompatibleSegmentError) as info:
        HostKVCache.attach(segment_name, ready_timeout=0.2)
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
