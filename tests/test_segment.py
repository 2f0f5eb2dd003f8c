"""Tests of one process's view of a segment: create, attach, checks at attach, pages, views.

Segments that hostkv must refuse (another format, a short or half-made segment, a foreign
owner) are made or damaged here by hand, with posix_ipc and mmap at the offsets that
hostkv._segment.layout_info() reports, never by guessing offsets.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import math
import multiprocessing
import os
import struct

import numpy as np
import posix_ipc
import pytest

import hostkv
from hostkv import (
    CapacityError,
    CorruptionError,
    ForeignSegmentError,
    HostKVCache,
    IncompatibleSegmentError,
    KVLayout,
    OutOfPagesError,
    SegmentError,
    SegmentExistsError,
    SegmentNotFoundError,
)
from hostkv import _pages, _segment

from conftest import small_config
from lib.rawseg import RawSegment

LAYOUT = _segment.layout_info()
HEADER = LAYOUT["header"]
HEADER_SIZE = LAYOUT["sizes"]["HkvHeader"]
STATE_INITIALISING = 1
CHILD_TIMEOUT = 60


# -- helpers -----------------------------------------------------------------------------------


def mapped(name: str) -> RawSegment:
    """Maps the segment `name` by hand, behind hostkv's back (use as a context manager)."""
    return RawSegment(name)


def poke(name: str, offset: int, fmt: str, *values) -> None:
    with mapped(name) as raw:
        struct.pack_into(fmt, raw.map, offset, *values)


def peek(name: str, offset: int, fmt: str):
    with mapped(name) as raw:
        return struct.unpack_from(fmt, raw.map, offset)


def created_and_closed(name: str, config=None) -> hostkv.HostKVConfig:
    """Creates a segment, closes it (the name lives on) and returns its resolved config."""
    with HostKVCache.create(name, config or small_config()) as c:
        return c.config


def snapshot(c: HostKVCache):
    """What a failed call must leave unchanged: the stats, every refcount, the lease table.

    generation is left out: any locker may run the periodic lease sweep (at least once a
    second, docs/design.md "Dead processes"), which is a committed mutation of its own.
    """
    stats = dataclasses.replace(c.stats(), generation=0)
    return stats, _pages.refcounts(c._segment).tolist(), c._segment.leases()


@pytest.fixture
def no_syscalls(segment_name, monkeypatch):
    """Makes any posix_ipc call that touches the system fail the test.

    Depends on segment_name so that the name is unlinked after the patch is undone.
    """

    def forbidden(*args, **kwargs):
        raise AssertionError(f"system call made with {args!r}")

    monkeypatch.setattr(posix_ipc, "SharedMemory", forbidden)
    monkeypatch.setattr(posix_ipc, "unlink_shared_memory", forbidden)


# -- create, attach, close ---------------------------------------------------------------------


def test_create_then_attach_share_config_and_count_leases(segment_name):
    cfg = small_config()
    with HostKVCache.create(segment_name, cfg) as a:
        b = HostKVCache.attach(segment_name)
        try:
            assert a.name == b.name == segment_name
            assert a.config == b.config == cfg.apply_runtime_defaults()
            assert a.config.is_resolved
            assert a.stats().active_processes == 2
            assert b.stats().active_processes == 2
            assert a._segment.lease_slot_index != b._segment.lease_slot_index
        finally:
            b.close()
        assert b.closed and not a.closed
        assert a.stats().active_processes == 1
        a.check(exact_references=False)


@pytest.mark.parametrize("close_first", ["creator", "attacher"])
def test_close_of_one_handle_leaves_the_other_working(segment_name, close_first):
    a = HostKVCache.create(segment_name, small_config())
    b = HostKVCache.attach(segment_name)
    gone, kept = (a, b) if close_first == "creator" else (b, a)
    try:
        pages = _pages.alloc_pages(a._segment, 2)
        gone.close()
        assert gone.closed
        st = kept.stats()
        assert st.active_processes == 1
        assert st.free_pages == 30
        more = _pages.alloc_pages(kept._segment, 3)
        _pages.free_pages(kept._segment, np.concatenate([pages, more]))
        assert kept.stats().free_pages == 32
        kept.check(exact_references=False)
    finally:
        a.close()
        b.close()


def test_context_manager_closes_on_exit(segment_name):
    with HostKVCache.create(segment_name, small_config()) as c:
        assert not c.closed
        c.stats()
    assert c.closed
    with pytest.raises(ZeroDivisionError):
        with HostKVCache.attach(segment_name) as d:
            1 / 0
    assert d.closed
    # Closing gives the lease back; the segment itself lives on until unlinked.
    with HostKVCache.attach(segment_name) as e:
        assert e.stats().active_processes == 1


def test_a_collected_handle_gives_its_lease_back(cache, segment_name):
    HostKVCache.attach(segment_name)         # not kept: collected at once, and closed
    assert cache.stats().active_processes == 1
    assert cache.reap() == 0
    cache.check(exact_references=False)


def test_create_twice_is_segment_exists_error(cache, segment_name):
    with pytest.raises(SegmentExistsError) as info:
        HostKVCache.create(segment_name, small_config())
    assert isinstance(info.value, FileExistsError)
    assert isinstance(info.value, SegmentError)
    assert info.value.errno == errno.EEXIST
    # The existing segment is untouched.
    assert cache.stats().active_processes == 1
    cache.check(exact_references=False)


def test_attach_missing_is_segment_not_found(segment_name):
    with pytest.raises(SegmentNotFoundError) as info:
        HostKVCache.attach(segment_name)
    assert isinstance(info.value, FileNotFoundError)
    assert info.value.errno == errno.ENOENT


def test_unlink_missing_is_segment_not_found(segment_name):
    with pytest.raises(SegmentNotFoundError) as info:
        HostKVCache.unlink_segment(segment_name)
    assert info.value.errno == errno.ENOENT


def test_unlink_removes_the_name_but_not_the_mapping(cache, segment_name):
    cache.unlink()
    with pytest.raises(SegmentNotFoundError):
        HostKVCache.attach(segment_name)
    # Mapped processes keep working.
    assert cache.stats().free_pages == 32
    cache.check(exact_references=False)


def test_a_200_character_name_is_fine(segment_name, new_name):
    name = new_name("x" * (200 - len(segment_name)))
    assert len(name) == 200
    with HostKVCache.create(name, small_config()) as c:
        assert c.name == name
    HostKVCache.unlink_segment(name)


BAD_NAMES = ["", "a/b", "/abc", "x" * 201, "a\x00b", "..", ".", "sp ace", "é", 123, None,
             b"bytes"]


@pytest.mark.parametrize("bad", BAD_NAMES, ids=repr)
def test_bad_name_is_value_error_before_any_system_call(no_syscalls, bad):
    with pytest.raises(ValueError):
        HostKVCache.create(bad, small_config())
    with pytest.raises(ValueError):
        HostKVCache.attach(bad)
    with pytest.raises(ValueError):
        HostKVCache.unlink_segment(bad)


BAD_TIMEOUTS = [0, 0.0, -1, -0.5, math.nan, math.inf, -math.inf, "x", None]


@pytest.mark.parametrize("bad", BAD_TIMEOUTS, ids=repr)
def test_bad_timeouts_are_value_errors(no_syscalls, segment_name, bad):
    with pytest.raises(ValueError):
        HostKVCache.create(segment_name, small_config(), lock_timeout=bad)
    with pytest.raises(ValueError):
        HostKVCache.attach(segment_name, lock_timeout=bad)
    with pytest.raises(ValueError):
        HostKVCache.attach(segment_name, ready_timeout=bad)


@pytest.mark.parametrize("huge", [1e12, 1e300])
def test_huge_finite_lock_timeout_is_accepted_or_a_value_error(cache, segment_name, huge):
    # A finite timeout beyond what int64 nanoseconds hold: either clamp it or refuse it as a
    # bad timeout; anything else (OverflowError) leaks an implementation detail.
    try:
        other = HostKVCache.attach(segment_name, lock_timeout=huge)
    except ValueError:
        pass
    else:
        with other:
            other.stats()


# -- attach checks -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, overrides",
    [("page_size", dict(page_size=8)), ("num_pages", dict(num_pages=64)),
     ("page_bytes", dict(page_bytes=128)), ("max_processes", dict(max_processes=9))],
)
def test_attach_with_another_expected_config_is_incompatible(cache, segment_name, field, overrides):
    with pytest.raises(IncompatibleSegmentError, match=field):
        HostKVCache.attach(segment_name, expected_config=small_config(**overrides))
    # The refused attach gave its lease back.
    assert cache.stats().active_processes == 1
    cache.check(exact_references=False)


def test_attach_with_an_equal_unresolved_config_is_fine(cache, segment_name):
    expected = small_config()          # capacities left at 0: resolved before comparing
    assert not expected.is_resolved
    with HostKVCache.attach(segment_name, expected_config=expected) as other:
        assert other.config == cache.config
    with HostKVCache.attach(segment_name, expected_config=cache.config) as other:
        assert other.config == cache.config


def test_another_layout_version_is_incompatible(segment_name):
    created_and_closed(segment_name)
    offset = HEADER["fmt_layout_version"]
    (version,) = peek(segment_name, offset, "<I")
    assert version == LAYOUT["layout_version"]
    poke(segment_name, offset, "<I", version + 1)
    with pytest.raises(IncompatibleSegmentError, match="fmt_layout_version"):
        HostKVCache.attach(segment_name)
    # The refused attach changed nothing: with the version restored it attaches.
    poke(segment_name, offset, "<I", version)
    with HostKVCache.attach(segment_name) as c:
        assert c.stats().active_processes == 1
        c.check(exact_references=False)


def test_state_layers_round_trip_through_the_header_and_a_damaged_bitmap_is_refused(
        segment_name):
    """KVLayout.state_layers is a bitmap in the header's config: an attach reads back
    exactly the layers written; a bit past the layout's layers, or any in a segment without
    a layout (a damaged header), is refused, naming it, and changes nothing."""
    layout = hostkv.KVLayout(70, 1, 8, "float32", state_layers=(0, 2, 63, 64, 69))
    created_and_closed(segment_name, small_config(page_bytes=0, kv_layout=layout))
    with HostKVCache.attach(segment_name) as c:
        assert c.config.kv_layout == layout
    words = peek(segment_name, HEADER["cfg_kv_state_layers"], "<16Q")
    assert words[:2] == ((1 << 0) | (1 << 2) | (1 << 63), (1 << 0) | (1 << 5))
    assert not any(words[2:])
    poke(segment_name, HEADER["cfg_kv_state_layers"] + 8, "<Q", words[1] | (1 << 6))
    with pytest.raises(IncompatibleSegmentError, match="state_layers"):
        HostKVCache.attach(segment_name)
    poke(segment_name, HEADER["cfg_kv_state_layers"] + 8, "<Q", words[1])
    with HostKVCache.attach(segment_name) as c:
        assert c.config.kv_layout == layout
    # A segment without a layout has no state layers either.
    HostKVCache.unlink_segment(segment_name)
    created_and_closed(segment_name)
    poke(segment_name, HEADER["cfg_kv_state_layers"], "<Q", 1)
    with pytest.raises(IncompatibleSegmentError, match=segment_name):
        HostKVCache.attach(segment_name)


def test_another_mutex_size_is_incompatible(segment_name):
    created_and_closed(segment_name)
    poke(segment_name, HEADER["fmt_mutex_size"], "<I", LAYOUT["sizes"]["pthread_mutex_t"] + 8)
    with pytest.raises(IncompatibleSegmentError, match="fmt_mutex_size"):
        HostKVCache.attach(segment_name)


def test_bad_magic_is_incompatible(segment_name):
    created_and_closed(segment_name)
    poke(segment_name, HEADER["hdr_magic"], "<Q", 0x0123456789ABCDEF)
    with pytest.raises(IncompatibleSegmentError, match="magic"):
        HostKVCache.attach(segment_name)


@pytest.mark.parametrize("size", [0, 100, HEADER_SIZE - 1])
def test_short_segment_is_incompatible(segment_name, size):
    shm = posix_ipc.SharedMemory("/" + segment_name, posix_ipc.O_CREX, mode=0o600, size=size)
    shm.close_fd()
    # Waited for (a creator between shm_open and writing its header), then refused.
    with pytest.raises(IncompatibleSegmentError, match="shorter than a hostkv header"):
        HostKVCache.attach(segment_name, ready_timeout=0.2)


@pytest.mark.parametrize("with_magic", [True, False])
def test_segment_that_never_becomes_ready_times_out(segment_name, new_name, with_magic):
    # A creator that died while initialising: the state word stays INITIALISING (or 0).
    shm = posix_ipc.SharedMemory(
        "/" + segment_name, posix_ipc.O_CREX, mode=0o600, size=HEADER_SIZE)
    shm.close_fd()
    if with_magic:
        # A real header (magic, format), as a creator writes it first.
        real = new_name()
        created_and_closed(real)
        with RawSegment(real) as raw:
            header = raw.read(0, HEADER_SIZE)
        with RawSegment(segment_name) as raw:
            raw.map[0:HEADER_SIZE] = header
        poke(segment_name, HEADER["hdr_state"], "<I", STATE_INITIALISING)
    # A header without the magic is refused at once (the creator writes it first).
    with pytest.raises(IncompatibleSegmentError, match="ready" if with_magic else "not a hostkv"):
        HostKVCache.attach(segment_name, ready_timeout=0.2)


@pytest.mark.parametrize("delta", [4096, -4096])
def test_size_other_than_the_header_says_is_incompatible(segment_name, delta):
    created_and_closed(segment_name)
    shm = posix_ipc.SharedMemory("/" + segment_name, 0, size=0)
    try:
        os.ftruncate(shm.fd, os.fstat(shm.fd).st_size + delta)
    finally:
        shm.close_fd()
    with pytest.raises(IncompatibleSegmentError):
        HostKVCache.attach(segment_name)


# -- owner and mode ----------------------------------------------------------------------------


def test_created_segment_has_mode_0600(cache, segment_name):
    st = os.stat("/dev/shm/" + segment_name)
    assert st.st_mode & 0o777 == 0o600
    assert st.st_uid == os.getuid()


def _chmod(name: str, mode: int) -> None:
    shm = posix_ipc.SharedMemory("/" + name, 0, size=0)
    try:
        os.fchmod(shm.fd, mode)
    finally:
        shm.close_fd()


@pytest.mark.parametrize("mode", [0o666, 0o620, 0o602])
def test_segment_writable_by_others_is_foreign(cache, segment_name, mode):
    _chmod(segment_name, mode)
    with pytest.raises(ForeignSegmentError) as info:
        HostKVCache.attach(segment_name)
    assert isinstance(info.value, PermissionError)
    assert isinstance(info.value, IncompatibleSegmentError)
    with HostKVCache.attach(segment_name, trust_other_users=True) as other:
        assert other.stats().active_processes == 2
        other.check(exact_references=False)


def test_segment_of_another_user_is_foreign(cache, segment_name):
    if os.geteuid() != 0:
        pytest.skip("changing a segment's owner needs root (os.fchown)")
    shm = posix_ipc.SharedMemory("/" + segment_name, 0, size=0)
    try:
        os.fchown(shm.fd, 12345, -1)
    finally:
        shm.close_fd()
    with pytest.raises(ForeignSegmentError, match="12345") as info:
        HostKVCache.attach(segment_name)
    assert isinstance(info.value, PermissionError)
    with HostKVCache.attach(segment_name, trust_other_users=True) as other:
        assert other.stats().active_processes == 2


# -- a full /dev/shm ---------------------------------------------------------------------------


def test_full_dev_shm_is_enospc_at_create_and_leaves_no_name(segment_name):
    st = os.statvfs("/dev/shm")
    if st.f_blocks == 0:
        pytest.skip("/dev/shm has no size limit to exceed")
    # Twice the free space, and also more than the whole filesystem:
    # tmpfs then refuses the reservation at once instead of filling memory first.
    target = 2 * max(st.f_bavail, st.f_blocks) * st.f_frsize
    num_pages = 1024
    page_bytes = -(-target // num_pages)
    if num_pages * page_bytes > 2**46:
        pytest.skip("/dev/shm is larger than the biggest pool a config allows")
    cfg = small_config(num_pages=num_pages, page_bytes=page_bytes)
    with pytest.raises(SegmentError) as info:
        HostKVCache.create(segment_name, cfg)
    assert info.value.errno == errno.ENOSPC
    with pytest.raises(SegmentNotFoundError):
        HostKVCache.attach(segment_name)


# -- pages -------------------------------------------------------------------------------------


def test_alloc_and_free_pages(cache):
    seg = cache._segment
    before = cache.stats()
    pages = _pages.alloc_pages(seg, 5)
    assert pages.dtype == np.int32
    assert pages.shape == (5,)
    assert len(set(pages.tolist())) == 5
    assert all(0 <= p < 32 for p in pages.tolist())
    st = cache.stats()
    assert st.free_pages == before.free_pages - 5
    assert st.pages_allocated == before.pages_allocated + 5
    assert (_pages.refcounts(seg)[pages] == 1).all()
    more = _pages.alloc_pages(seg, 27)
    assert not set(pages.tolist()) & set(more.tolist())
    assert cache.stats().free_pages == 0
    cache.check(exact_references=False)
    _pages.free_pages(seg, pages)
    _pages.free_pages(seg, more.tolist())
    st = cache.stats()
    assert st.free_pages == 32
    assert st.pages_freed == before.pages_freed + 32
    assert (_pages.refcounts(seg) == 0).all()
    cache.check(exact_references=False)


def test_alloc_zero_and_negative(cache):
    assert _pages.alloc_pages(cache._segment, 0).shape == (0,)
    with pytest.raises(ValueError):
        _pages.alloc_pages(cache._segment, -1)
    assert cache.stats().free_pages == 32


def test_alloc_more_than_free_changes_nothing(cache):
    seg = cache._segment
    held = _pages.alloc_pages(seg, 30)
    before = snapshot(cache)
    with pytest.raises(OutOfPagesError) as info:
        _pages.alloc_pages(seg, 3)
    assert info.value.needed == 3
    assert info.value.available == 2
    assert snapshot(cache) == before
    cache.check(exact_references=False)
    _pages.free_pages(seg, held)
    cache.check(exact_references=False)


def test_free_of_a_free_page_is_corruption_and_changes_nothing(cache):
    seg = cache._segment
    p, q = _pages.alloc_pages(seg, 2).tolist()
    _pages.free_pages(seg, [q])
    stats_before, refcounts_before, leases_before = snapshot(cache)
    with pytest.raises(CorruptionError):
        _pages.free_pages(seg, [q])
    # All or nothing: the first p drops p's only reference, the second must undo it.
    with pytest.raises(CorruptionError):
        _pages.free_pages(seg, [p, p])
    stats_after, refcounts_after, leases_after = snapshot(cache)
    assert refcounts_after == refcounts_before
    assert refcounts_after[p] == 1 and refcounts_after[q] == 0
    assert leases_after == leases_before
    # recoveries may count the rolled-back batch; every page count is as before.
    for field in ("free_pages", "pages_allocated", "pages_freed", "active_processes"):
        assert getattr(stats_after, field) == getattr(stats_before, field), field
    cache.check(exact_references=False)
    # p is still allocated: one free works, and a page handed out next is not p.
    others = _pages.alloc_pages(seg, 31)
    assert p not in others.tolist()
    _pages.free_pages(seg, np.append(others, p))
    assert cache.stats().free_pages == 32
    cache.check(exact_references=False)


@pytest.mark.parametrize("bad", [[32], [-1], [0, 2**31], np.array([1, 40], dtype=np.int64)],
                         ids=repr)
def test_free_of_out_of_range_page_is_value_error(cache, bad):
    seg = cache._segment
    _pages.alloc_pages(seg, 2)
    before = snapshot(cache)
    with pytest.raises(ValueError):
        _pages.free_pages(seg, bad)
    assert snapshot(cache) == before
    cache.check(exact_references=False)


@pytest.mark.parametrize("bad", [[1.0], [[0, 1]], "0"], ids=repr)
def test_free_of_non_integer_pages_is_value_error(cache, bad):
    _pages.alloc_pages(cache._segment, 2)
    with pytest.raises(ValueError):
        _pages.free_pages(cache._segment, bad)
    assert cache.stats().free_pages == 30


# -- zero-copy views ---------------------------------------------------------------------------


def test_pages_array_is_a_writable_view_of_the_pool(cache):
    a = cache.pages_array()
    b = cache.pages_array()
    assert a.shape == (32, 64)
    assert a.dtype == np.uint8
    assert a.flags.writeable
    assert a.flags.c_contiguous
    assert np.shares_memory(a, b)
    a[3, :] = 7
    assert (b[3] == 7).all()
    assert a.ctypes.data == cache._segment.pool_address()
    del a, b


def test_pool_is_shared_between_handles(cache, segment_name):
    with HostKVCache.attach(segment_name) as other:
        a = cache.pages_array()
        b = other.pages_array()
        a[5] = np.arange(64, dtype=np.uint8)
        assert (b[5] == np.arange(64)).all()
        del a, b


def test_close_refuses_while_a_view_is_alive(cache):
    a = cache.pages_array()
    row = a[2]
    with pytest.raises(BufferError):
        cache.close()
    assert not cache.closed
    del a
    with pytest.raises(BufferError):        # the slice keeps the buffer alive too
        cache.close()
    del row
    cache.close()
    assert cache.closed


@pytest.fixture
def layout_cache(segment_name):
    cfg = small_config(page_bytes=0, kv_layout=KVLayout(2, 2, 4, "float16"))
    c = HostKVCache.create(segment_name, cfg)
    try:
        yield c
    finally:
        with contextlib.suppress(BufferError):
            c.close()


def test_pages_tensor_default_shape_from_kv_layout(layout_cache):
    torch = pytest.importorskip("torch")
    cfg = layout_cache.config
    assert cfg.page_bytes == 256
    t = layout_cache.pages_tensor()
    assert t.dtype == torch.float16
    assert tuple(t.shape) == (32, 2, 2, 4, 2, 4)    # num_pages, layers, K/V, tokens, heads, dim
    assert tuple(t.shape[1:]) == cfg.kv_layout.page_shape(cfg.page_size)
    assert t.is_contiguous()
    del t


def test_pages_tensor_writes_are_visible_in_pages_array(layout_cache):
    torch = pytest.importorskip("torch")
    t = layout_cache.pages_tensor()
    a = layout_cache.pages_array()
    assert np.shares_memory(t.numpy(), a)
    t[5, 1, 0] = 1.5
    page = a[5].view(np.float16).reshape(2, 2, 4, 2, 4)
    assert (page[1, 0] == 1.5).all()
    assert (page[0] == 0).all() and (page[1, 1] == 0).all()
    a[6].view(np.float16)[:] = -2.0
    assert bool((t[6] == -2.0).all())
    assert t.data_ptr() == layout_cache._segment.pool_address()
    with pytest.raises(BufferError):
        layout_cache.close()
    del t, a, page
    layout_cache.close()
    assert layout_cache.closed


def test_pages_tensor_custom_dtype_and_shape(layout_cache):
    torch = pytest.importorskip("torch")
    t = layout_cache.pages_tensor(dtype=torch.float32, shape=(32, 64))
    assert t.dtype == torch.float32 and tuple(t.shape) == (32, 64)
    u = layout_cache.pages_tensor(dtype=torch.uint8)
    assert tuple(u.shape) == (32, 256)
    v = layout_cache.pages_tensor(dtype=torch.bfloat16, shape=(32, 4, 32))
    assert tuple(v.shape) == (32, 4, 32)
    t[1, 0] = 3.0
    assert u[1, :4].tolist() == list(np.float32(3.0).tobytes())
    del t, u, v


def test_pages_tensor_without_layout_is_uint8(cache):
    torch = pytest.importorskip("torch")
    t = cache.pages_tensor()
    assert t.dtype == torch.uint8 and tuple(t.shape) == (32, 64)
    del t


@pytest.mark.parametrize(
    "dtype_name, shape",
    [("float16", (31, 2, 2, 4, 2, 4)), ("float16", (32, 2, 2, 4, 2, 5)), ("uint8", (32, 255)),
     ("float32", (32, 2, 128)), ("uint8", ()), ("uint8", (32, 0, 256)), ("uint8", (32, -256)),
     ("uint8", (32 * 256,))],
)
def test_pages_tensor_bad_shape_is_value_error(layout_cache, dtype_name, shape):
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError):
        layout_cache.pages_tensor(dtype=getattr(torch, dtype_name), shape=shape)
    layout_cache.close()          # no view was left behind


def test_pages_tensor_bad_dtype_is_value_error(layout_cache):
    pytest.importorskip("torch")
    with pytest.raises(ValueError):
        layout_cache.pages_tensor(dtype="float16")


# -- after close -------------------------------------------------------------------------------


AFTER_CLOSE_CALLS = {
    "stats": lambda c: c.stats(),
    "check": lambda c: c.check(exact_references=False),
    "reap": lambda c: c.reap(),
    "pages_array": lambda c: c.pages_array(),
    "alloc_pages": lambda c: _pages.alloc_pages(c._segment, 1),
    "header_info": lambda c: c._segment.header_info(),
}


@pytest.mark.parametrize("call", sorted(AFTER_CLOSE_CALLS))
def test_use_after_close_is_value_error(cache, call):
    cache.close()
    assert cache.closed
    cache.close()                           # twice is fine
    with pytest.raises(ValueError, match="closed"):
        AFTER_CLOSE_CALLS[call](cache)
    assert "closed" in repr(cache)


def _free_after_close(name: str) -> None:
    """Spawned child: frees a page through a closed segment; exit 0 iff ValueError."""
    c = HostKVCache.create(name, small_config())
    seg = c._segment
    pages = _pages.alloc_pages(seg, 1)
    c.close()
    try:
        _pages.free_pages(seg, pages)
    except ValueError as exc:
        os._exit(0 if "closed" in str(exc) else 2)
    os._exit(1)


def test_free_pages_after_close_is_value_error(segment_name):
    # In a child: reading a closed segment's header dereferences NULL (SIGSEGV, exit -11).
    ctx = multiprocessing.get_context("spawn")
    p = ctx.Process(target=_free_after_close, args=(segment_name,))
    p.start()
    p.join(CHILD_TIMEOUT)
    assert p.exitcode == 0


# -- check -------------------------------------------------------------------------------------


def test_check_passes_on_a_fresh_and_a_used_cache(cache):
    cache.check(exact_references=False)
    pages = _pages.alloc_pages(cache._segment, 7)
    cache.check(exact_references=False)
    _pages.free_pages(cache._segment, pages[::2])
    cache.check(exact_references=False)


def test_check_finds_a_bad_refcount(cache, segment_name):
    regions = cache._segment.header_info()["regions"]
    _pages.alloc_pages(cache._segment, 2)       # pages 0 and 1; page 9 stays free
    at = regions["reg_page_refcounts"] + 4 * 9
    assert peek(segment_name, at, "<i") == (0,)
    poke(segment_name, at, "<i", 5)
    with pytest.raises(CorruptionError, match="page 9"):
        cache.check(exact_references=False)
    # check() reports under the lock and releases it: the cache is still usable.
    assert cache.stats().free_pages == 30
    poke(segment_name, at, "<i", 0)
    cache.check(exact_references=False)


def test_check_finds_a_bad_free_count(cache, segment_name):
    poke(segment_name, HEADER["hdr_free_pages"], "<q", 31)
    with pytest.raises(CorruptionError):
        cache.check(exact_references=False)
    poke(segment_name, HEADER["hdr_free_pages"], "<q", 32)
    cache.check(exact_references=False)


def _corrupt_then_lock_twice(name: str, how: str, results) -> None:
    """Spawned child: damages the header so that begin() itself fails, then locks twice.

    Runs in its own process: a lock left held by this thread, once its segment is unmapped,
    stays on the thread's robust-mutex list and can crash the next lock of any robust mutex.
    """
    c = HostKVCache.create(name, small_config())
    regions = c._segment.header_info()["regions"]
    if how == "undo":
        # One open undo entry pointing at offset 0: recovery must call this corruption.
        poke(name, regions["reg_undo"], "<QQ", 8 << 56, 0)
        poke(name, HEADER["hdr_undo_count"], "<q", 1)
    else:
        # A lease slot in no known state, found by the periodic sweep (forced: last sweep 0).
        slot = 1 - c._segment.lease_slot_index
        poke(name, regions["reg_leases"] + slot * LAYOUT["sizes"]["HkvLease"]
             + LAYOUT["lease"]["ls_state"], "<I", 7)
        c._segment._make_sweep_due()
    for _ in range(2):
        try:
            c.stats()
            results.put("ok")
        except Exception as exc:  # noqa: BLE001 - the class is the result
            results.put(type(exc).__name__)
    try:
        other = HostKVCache.attach(name, lock_timeout=0.5)
        other.stats()
        results.put("ok")
    except Exception as exc:  # noqa: BLE001
        results.put(type(exc).__name__)
    results.close()
    results.join_thread()        # flush the queue: os._exit skips the feeder thread
    os._exit(0)


@pytest.mark.parametrize("how", ["undo", "lease_state"])
def test_corruption_found_while_locking_releases_the_lock(segment_name, how):
    # docs/design.md: a bad value is a CorruptionError, and a recovery that fails marks the
    # segment corrupt before it unlocks (LMDB, too, unlocks and reports). Every later call
    # must say CorruptionError again, not find the lock still held by the call that failed
    # (RuntimeError "not re-entrant", or LockTimeoutError).
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    p = ctx.Process(target=_corrupt_then_lock_twice, args=(segment_name, how, results))
    p.start()
    outcomes = [results.get(timeout=CHILD_TIMEOUT) for _ in range(3)]
    p.join(CHILD_TIMEOUT)
    assert p.exitcode == 0
    assert outcomes == ["CorruptionError"] * 3


# -- lease slots -------------------------------------------------------------------------------


def test_lease_slots_full_is_capacity_error_and_changes_nothing(segment_name):
    with HostKVCache.create(segment_name, small_config(max_processes=2)) as a:
        with HostKVCache.attach(segment_name) as b:
            assert a.stats().active_processes == 2
            before = snapshot(a)
            with pytest.raises(CapacityError) as info:
                HostKVCache.attach(segment_name)
            assert info.value.resource == "lease slots"
            assert snapshot(a) == before
            a.check(exact_references=False)
            b.check(exact_references=False)
        # A slot is free again.
        with HostKVCache.attach(segment_name) as c:
            assert c.stats().active_processes == 2
