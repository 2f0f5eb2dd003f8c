"""The hostkv exception hierarchy, and the one place OS error codes become exceptions.

Every error hostkv raises derives from :class:`HostKVError`, and where a builtin exception
already says what went wrong the hostkv error derives from it too, so callers can catch
either (msgpack's ``FormatError(ValueError, UnpackException)`` is the model):

- :class:`ConfigError` and :class:`SequenceError` are ``ValueError`` s;
- segment failures from the operating system are ``OSError`` s that keep ``errno``,
  ``strerror`` and ``filename``, and the common codes are the matching builtin subclass
  (``FileExistsError``, ``FileNotFoundError``, ``PermissionError``), as uvloop maps codes;
- :class:`LockTimeoutError` is a ``TimeoutError``.

:func:`os_error` is the only function that turns an errno value into an exception (py-lmdb's
``error_map`` plus one raiser that formats ``"what: strerror"``), and
:func:`translate_posix_ipc` is the boundary where posix_ipc's own exceptions, which carry no
errno, are turned into ours.
"""

from __future__ import annotations

import errno as _errno
import os
from typing import Dict, Optional, Type

import posix_ipc

__all__ = [
    "AbandonedSegmentError",
    "CapacityError",
    "ConfigError",
    "CorruptionError",
    "ForeignSegmentError",
    "HostKVError",
    "IncompatibleSegmentError",
    "LockTimeoutError",
    "OutOfPagesError",
    "SegmentError",
    "SegmentExistsError",
    "SegmentFormatError",
    "SegmentInUseError",
    "SegmentNotFoundError",
    "SegmentPermissionError",
    "SequenceError",
    "os_error",
    "translate_posix_ipc",
]


class HostKVError(Exception):
    """Base class of every exception hostkv raises."""


class ConfigError(HostKVError, ValueError):
    """A configuration value is invalid; the message names the field and the value."""


class OutOfPagesError(HostKVError):
    """A batch needs more pages than are free, even after evicting every evictable page.

    Nothing was changed by the call that raised it.

    Attributes:
        needed: Pages the batch needed, or None if unknown.
        available: Pages that were free or evictable, or None if unknown.
    """

    def __init__(
        self,
        message: str = "out of pages",
        *,
        needed: Optional[int] = None,
        available: Optional[int] = None,
    ) -> None:
        super().__init__(message)
        self.needed = needed
        self.available = available


class CapacityError(HostKVError):
    """A fixed-size table of the segment is full.

    Nothing was changed by the call that raised it.

    Attributes:
        resource: What ran out: ``"radix nodes"``, ``"sequences"``, ``"undo log"``,
            ``"lease slots"``, ...
        needed: Records the operation needed, or None if unknown.
        available: Records that were free, or None if unknown.
    """

    def __init__(
        self,
        message: str = "capacity exhausted",
        *,
        resource: Optional[str] = None,
        needed: Optional[int] = None,
        available: Optional[int] = None,
    ) -> None:
        super().__init__(message)
        self.resource = resource
        self.needed = needed
        self.available = available


class SequenceError(HostKVError, ValueError):
    """A sequence id is unknown, duplicated, or used in a way its state does not allow."""


class SegmentError(HostKVError, OSError):
    """An operating-system failure on a shared-memory segment.

    Constructed like ``OSError``: ``SegmentError(errno, "what: strerror", name)``, so
    ``errno``, ``strerror`` and ``filename`` are set. Use :func:`os_error` to build one from
    an errno value; it picks the right subclass.
    """


class SegmentExistsError(SegmentError, FileExistsError):
    """Creating a segment failed because one with that name already exists (EEXIST)."""


class SegmentNotFoundError(SegmentError, FileNotFoundError):
    """Attaching or unlinking a segment failed because none has that name (ENOENT)."""


class SegmentPermissionError(SegmentError, PermissionError):
    """The operating system refused access to the segment (EACCES, EPERM)."""


class IncompatibleSegmentError(HostKVError):
    """Attach found a segment it cannot use.

    Its size, format word, layout version or stored config does not match what this build of
    hostkv expects, or its creator never finished initialising it.
    """


class SegmentFormatError(IncompatibleSegmentError):
    """The segment's format word is not this build's: another hostkv version (its memory
    map or its page layout changed), another libc or another architecture.

    Nothing in such a segment can be read safely, not even its lease table; an engine
    that finds one no live process maps may replace it (``hostkv.vllm``'s
    ``replace_incompatible``).
    """


class AbandonedSegmentError(IncompatibleSegmentError):
    """The segment's creator died before the segment was ready.

    A creator holds a lock on the segment's file (an open-file-description lock, which the
    kernel drops at its death) until it is ready; a segment still initialising without it
    will never be ready. Nobody can have used it: it may be unlinked and made again
    (``HostKVCache.replace_segment``).
    """


class SegmentInUseError(IncompatibleSegmentError):
    """A segment to be replaced is still in use: a live process holds it attached.

    Every attached handle holds a shared ``flock`` on the segment's file for as long as it
    is open; a replacer must get the exclusive lock, so this is known from the kernel, in
    any PID namespace, never from pids.
    """


class ForeignSegmentError(IncompatibleSegmentError, PermissionError):
    """The segment belongs to another user, or its mode lets other users write it.

    Also a ``PermissionError``: a segment another user can write is a segment another user
    can corrupt, so attach refuses it as it would refuse missing permissions.
    """


class CorruptionError(HostKVError):
    """A value read from the segment breaks an invariant (bad index, cycle, bad count)."""


class LockTimeoutError(HostKVError, TimeoutError):
    """The segment's mutex was not acquired within the timeout.

    Constructed with a message, e.g. ``LockTimeoutError("lock not acquired within 2.0 s")``;
    being an ``OSError`` subclass, its ``errno`` is then None.
    """


# The one table from errno values to exception classes; anything else is a plain
# SegmentError that still carries its errno.
_ERRNO_CLASSES: Dict[int, Type[SegmentError]] = {
    _errno.EEXIST: SegmentExistsError,
    _errno.ENOENT: SegmentNotFoundError,
    _errno.EACCES: SegmentPermissionError,
    _errno.EPERM: SegmentPermissionError,
}


def os_error(err: int, what: str, name: Optional[str] = None) -> SegmentError:
    """Build the exception for an errno value returned by a system call.

    Args:
        err: The errno value (e.g. ``errno.ENOSPC``).
        what: What was being done, e.g. ``"posix_fallocate"`` or ``"create segment"``.
        name: The segment's name, stored as the exception's ``filename``.

    Returns:
        A :class:`SegmentError`, or its subclass for EEXIST, ENOENT, EACCES and EPERM, with
        ``errno == err`` and the message ``"{what}: {os.strerror(err)}"``. The caller raises
        it.
    """
    cls = _ERRNO_CLASSES.get(err, SegmentError)
    return cls(err, f"{what}: {os.strerror(err)}", name)


def translate_posix_ipc(
    exc: BaseException, what: str, name: Optional[str], creating: bool
) -> HostKVError:
    """Turn an exception raised by posix_ipc into the matching hostkv exception.

    posix_ipc raises its own classes and drops errno (``ExistentialError`` means EEXIST when
    creating and ENOENT otherwise), so the code is restored here, at the boundary. Raise the
    result ``from exc`` so the original stays visible.

    Args:
        exc: The exception posix_ipc raised (a ``posix_ipc.Error`` or an ``OSError``).
        what: What was being done, e.g. ``"create segment"``.
        name: The segment's name, stored as the exception's ``filename``.
        creating: Whether the call tried to create the segment (``O_CREX``).

    Returns:
        A :class:`SegmentExistsError`, :class:`SegmentNotFoundError`,
        :class:`SegmentPermissionError` or :class:`SegmentError`.
    """
    if isinstance(exc, posix_ipc.ExistentialError):
        return os_error(_errno.EEXIST if creating else _errno.ENOENT, what, name)
    if isinstance(exc, posix_ipc.PermissionsError):
        return os_error(_errno.EACCES, what, name)
    # posix_ipc raises builtin OSErrors for some calls (e.g. ftruncate); they keep errno.
    code = getattr(exc, "errno", None)
    if isinstance(code, int) and code > 0:
        return os_error(code, what, name)
    # No code to look up: os.strerror(0) would say "Success", so keep posix_ipc's own text.
    return SegmentError(0, f"{what}: {exc}", name)
