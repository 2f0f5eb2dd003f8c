"""Hostile mutex bytes, in a segment other users may write.

glibc believes a mutex's kind word at every lock: with PTHREAD_MUTEX_PRIO_PROTECT (0x40) it
aborts the process (SIGABRT), and kinds 0-3, 0x20 (priority inheritance) or 0x30 give a lock
that is not robust or compares thread ids across PID namespaces. A segment another user may
write (trust_other_users=True) can carry any of these, so hostkv checks the kind word of
every mutex on attach and before each lock, and refuses with CorruptionError.

Each attempt runs in a forked child, so that an abort (the bug) fails the test instead of
killing pytest.
"""

from __future__ import annotations

import struct

import pytest

from hostkv import CorruptionError, HostKVCache, _segment

from conftest import run_in_fork, small_config
from lib.rawseg import RawSegment

LAYOUT = _segment.layout_info()
LEASE_SIZE = LAYOUT["sizes"]["HkvLease"]
KIND_AT = _segment.MUTEX_KIND_OFFSET
HOSTILE_KINDS = [0x40, 0, 1, 2, 3, 0x20, 0x30]

pytestmark = pytest.mark.skipif(KIND_AT < 0, reason="needs glibc's pthread_mutex_t layout")


def _outcome_in_child(action) -> int:
    """0: CorruptionError; 1: no error; 2: another exception; negative: killed by a signal."""
    def body() -> int:
        try:
            action()
        except CorruptionError:
            return 0
        return 1

    return run_in_fork(body)


def _mutex_offset(cache: HostKVCache, where: str) -> int:
    if where == "segment lock":
        return LAYOUT["header"]["hdr_mutex"]
    # A free lease slot: the one an attacher would take next.
    slot = 1 - cache._segment.lease_slot_index
    return (cache._segment.header_info()["regions"]["reg_leases"] + slot * LEASE_SIZE
            + LAYOUT["lease"]["ls_mutex"])


def _set_kind(name: str, offset: int, kind: int) -> int:
    with RawSegment(name) as raw:
        old = struct.unpack_from("<i", raw.map, offset + KIND_AT)[0]
        struct.pack_into("<i", raw.map, offset + KIND_AT, kind)
    return old


def test_a_fresh_segment_has_the_expected_kind(cache):
    with RawSegment(cache.name) as raw:
        kind = struct.unpack_from("<i", raw.map, LAYOUT["header"]["hdr_mutex"] + KIND_AT)[0]
    assert kind == _segment.MUTEX_KIND
    # robust (0x10) and process-shared (0x80), normal type, no priority protocol
    assert kind & 0x10 and kind & 0x80 and not kind & 0x63


@pytest.mark.parametrize("kind", HOSTILE_KINDS, ids=hex)
@pytest.mark.parametrize("where", ["segment lock", "lease slot"])
def test_attach_refuses_a_hostile_mutex_kind(segment_name, where, kind):
    cache = HostKVCache.create(segment_name, small_config(max_processes=2))
    offset = _mutex_offset(cache, where)
    old = _set_kind(segment_name, offset, kind)
    try:
        for lease in (True, False):
            outcome = _outcome_in_child(
                lambda: HostKVCache.attach(segment_name, trust_other_users=True, lease=lease))
            assert outcome == 0, f"attach(lease={lease}) with kind {kind:#x}: outcome {outcome}"
    finally:
        _set_kind(segment_name, offset, old)
        cache.check()
        cache.close()


@pytest.mark.parametrize("kind", HOSTILE_KINDS, ids=hex)
def test_a_handle_refuses_a_lock_whose_kind_changed_after_attach(segment_name, kind):
    # Checked before every lock, not only on attach: stats() on a handle attached earlier.
    cache = HostKVCache.create(segment_name, small_config())
    offset = _mutex_offset(cache, "segment lock")
    old = _set_kind(segment_name, offset, kind)
    try:
        assert _outcome_in_child(cache.stats) == 0
        with pytest.raises(CorruptionError, match="mutex kind"):
            cache.stats()
    finally:
        _set_kind(segment_name, offset, old)
        cache.check()
        cache.close()


@pytest.mark.parametrize("kind", [0x40, 0x20], ids=hex)
def test_the_sweep_refuses_a_hostile_lease_mutex(segment_name, kind):
    # A lease slot in use by a (live) process, probed by reap(): checked before the trylock.
    cache = HostKVCache.create(segment_name, small_config(max_processes=2))
    other = HostKVCache.attach(segment_name)
    slot = other._segment.lease_slot_index
    offset = (cache._segment.header_info()["regions"]["reg_leases"] + slot * LEASE_SIZE
              + LAYOUT["lease"]["ls_mutex"])
    old = _set_kind(segment_name, offset, kind)
    try:
        assert _outcome_in_child(cache.reap) == 0
        with pytest.raises(CorruptionError, match=f"lease slot {slot}"):
            cache.reap()
    finally:
        _set_kind(segment_name, offset, old)
        other.close()
        cache.check()
        cache.close()
