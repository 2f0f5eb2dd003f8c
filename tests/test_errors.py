"""Tests of hostkv.errors: the hierarchy, errno mapping and posix_ipc translation."""

from __future__ import annotations

import errno
import os
import pickle
import uuid

import posix_ipc
import pytest

from hostkv.errors import (
    CapacityError,
    ConfigError,
    CorruptionError,
    ForeignSegmentError,
    HostKVError,
    IncompatibleSegmentError,
    LockTimeoutError,
    OutOfPagesError,
    SegmentError,
    SegmentExistsError,
    SegmentNotFoundError,
    SegmentPermissionError,
    SequenceError,
    os_error,
    translate_posix_ipc,
)


@pytest.fixture
def shm_name():
    name = f"/hostkv-test-{uuid.uuid4().hex}"
    yield name
    try:
        posix_ipc.unlink_shared_memory(name)
    except posix_ipc.ExistentialError:
        pass


@pytest.mark.parametrize(
    "cls, bases",
    [
        (ConfigError, (HostKVError, ValueError)),
        (SequenceError, (HostKVError, ValueError)),
        (OutOfPagesError, (HostKVError,)),
        (CapacityError, (HostKVError,)),
        (CorruptionError, (HostKVError,)),
        (IncompatibleSegmentError, (HostKVError,)),
        (ForeignSegmentError, (IncompatibleSegmentError, PermissionError, OSError)),
        (SegmentError, (HostKVError, OSError)),
        (SegmentExistsError, (SegmentError, FileExistsError, OSError)),
        (SegmentNotFoundError, (SegmentError, FileNotFoundError, OSError)),
        (SegmentPermissionError, (SegmentError, PermissionError, OSError)),
        (LockTimeoutError, (HostKVError, TimeoutError, OSError)),
    ],
)
def test_hierarchy(cls, bases):
    for base in bases:
        assert issubclass(cls, base)
    assert issubclass(cls, HostKVError)


def test_not_accidentally_builtin():
    assert not issubclass(IncompatibleSegmentError, OSError)
    assert not issubclass(CorruptionError, (ValueError, OSError))
    assert not issubclass(OutOfPagesError, (ValueError, OSError))
    assert not issubclass(SegmentNotFoundError, FileExistsError)


def test_segment_exists_keeps_errno():
    exc = SegmentExistsError(errno.EEXIST, "create segment: File exists", "kv")
    assert isinstance(exc, FileExistsError)
    assert isinstance(exc, HostKVError)
    assert exc.errno == errno.EEXIST
    assert exc.strerror == "create segment: File exists"
    assert exc.filename == "kv"
    with pytest.raises(FileExistsError):
        raise exc


def test_lock_timeout_message():
    exc = LockTimeoutError("lock not acquired within 2.0 s")
    assert isinstance(exc, TimeoutError)
    assert isinstance(exc, HostKVError)
    assert str(exc) == "lock not acquired within 2.0 s"
    assert exc.errno is None
    with pytest.raises(TimeoutError, match="2.0 s"):
        raise exc


def test_foreign_segment_error():
    exc = ForeignSegmentError("segment kv belongs to uid 1000, not 1001")
    assert isinstance(exc, IncompatibleSegmentError)
    assert isinstance(exc, PermissionError)
    assert str(exc) == "segment kv belongs to uid 1000, not 1001"
    with pytest.raises(IncompatibleSegmentError):
        raise exc


def test_out_of_pages_and_capacity_attributes():
    exc = OutOfPagesError("batch needs 10 pages, 4 free", needed=10, available=4)
    assert (exc.needed, exc.available) == (10, 4)
    assert str(exc) == "batch needs 10 pages, 4 free"
    default = OutOfPagesError()
    assert default.needed is None and default.available is None
    cap = CapacityError("radix nodes exhausted", resource="radix nodes", needed=3, available=0)
    assert (cap.resource, cap.needed, cap.available) == ("radix nodes", 3, 0)
    assert CapacityError().resource is None


@pytest.mark.parametrize(
    "exc",
    [
        OutOfPagesError("short", needed=3, available=1),
        CapacityError("full", resource="lease slots", needed=1, available=0),
        os_error(errno.EEXIST, "create segment", "kv"),
        os_error(errno.ENOSPC, "posix_fallocate", "kv"),
        LockTimeoutError("lock not acquired within 1.0 s"),
        ForeignSegmentError("foreign"),
        ConfigError("bad"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_pickle_round_trip(exc):
    # Multiprocess tests and engines send exceptions between processes.
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is type(exc)
    assert str(back) == str(exc)
    assert back.__dict__ == exc.__dict__
    if isinstance(exc, OSError):
        assert (back.errno, back.strerror, back.filename) == (
            exc.errno, exc.strerror, exc.filename)


@pytest.mark.parametrize(
    "code, cls, builtin",
    [
        (errno.EEXIST, SegmentExistsError, FileExistsError),
        (errno.ENOENT, SegmentNotFoundError, FileNotFoundError),
        (errno.EACCES, SegmentPermissionError, PermissionError),
        (errno.EPERM, SegmentPermissionError, PermissionError),
        (errno.ENOSPC, SegmentError, OSError),
        (errno.EINVAL, SegmentError, OSError),
    ],
)
def test_os_error_mapping(code, cls, builtin):
    exc = os_error(code, "create segment", "kv")
    assert type(exc) is cls
    assert isinstance(exc, builtin)
    assert isinstance(exc, HostKVError)
    assert exc.errno == code
    assert exc.strerror == f"create segment: {os.strerror(code)}"
    assert exc.filename == "kv"
    assert "create segment" in str(exc)


def test_os_error_without_name():
    exc = os_error(errno.ENOSPC, "posix_fallocate")
    assert exc.filename is None
    assert str(exc) == f"[Errno {errno.ENOSPC}] posix_fallocate: {os.strerror(errno.ENOSPC)}"


def test_translate_real_existential_error_on_create(shm_name):
    mem = posix_ipc.SharedMemory(shm_name, posix_ipc.O_CREX, size=4096)
    mem.close_fd()
    with pytest.raises(posix_ipc.ExistentialError) as info:
        posix_ipc.SharedMemory(shm_name, posix_ipc.O_CREX, size=4096)
    exc = translate_posix_ipc(info.value, "create segment", "kv", creating=True)
    assert type(exc) is SegmentExistsError
    assert isinstance(exc, FileExistsError)
    assert exc.errno == errno.EEXIST
    assert exc.filename == "kv"


def test_translate_real_existential_error_on_attach(shm_name):
    with pytest.raises(posix_ipc.ExistentialError) as info:
        posix_ipc.SharedMemory(shm_name)
    exc = translate_posix_ipc(info.value, "attach segment", "kv", creating=False)
    assert type(exc) is SegmentNotFoundError
    assert isinstance(exc, FileNotFoundError)
    assert exc.errno == errno.ENOENT
    assert exc.strerror == f"attach segment: {os.strerror(errno.ENOENT)}"


def test_translate_permissions_error():
    exc = translate_posix_ipc(posix_ipc.PermissionsError("Permission denied"),
                              "attach segment", "kv", creating=False)
    assert type(exc) is SegmentPermissionError
    assert isinstance(exc, PermissionError)
    assert exc.errno == errno.EACCES


def test_translate_generic_posix_ipc_error():
    exc = translate_posix_ipc(posix_ipc.Error("something odd"), "map segment", "kv",
                              creating=False)
    assert type(exc) is SegmentError
    assert exc.errno == 0
    assert "something odd" in str(exc) and "map segment" in str(exc)
    err = posix_ipc.Error("no space")
    err.errno = errno.ENOSPC
    exc = translate_posix_ipc(err, "create segment", "kv", creating=True)
    assert type(exc) is SegmentError
    assert exc.errno == errno.ENOSPC


def test_translate_builtin_os_error():
    exc = translate_posix_ipc(OSError(errno.ENOSPC, "No space left on device"),
                              "resize segment", "kv", creating=True)
    assert type(exc) is SegmentError
    assert exc.errno == errno.ENOSPC
