# cython: language_level=3, embedsignature=True
"""The shared-memory segment: create, attach, map, close, leases, recovery.

The memory map is in _layout.pxd. A Segment is a SegmentLock (_lock.pyx: the robust lock and
the undo log every mutation runs through) that this module gives a lifecycle, this process's
lease and the recovery of a dead holder's mutation. It owns the header and the lease table;
the page pool (_pages) and later layers register hooks that recovery and the lease sweep
call, so this layer needs to know nothing of theirs. Below it: _format (what a header says,
and the checks on it), _geometry (where the regions lie), _leases (robust mutexes and the
lease thread), _crash (the tests' crash points).
"""

import errno
import fcntl
import glob
import numbers
import os
import re
import time

import posix_ipc

from cpython.buffer cimport PyBUF_FORMAT
from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t

from hostkv._format cimport (
    check_format, config_impossible, config_to_c, config_values, creator_step, expected_format,
    header_snapshot, metrics_snapshot, reserve_memory, wait_ready, write_first_header)
from hostkv._geometry cimport advise_range, compute_regions, init_tables
from hostkv._layout cimport *
from hostkv._leases cimport (
    LEASE_DROP, LeaseHolder, fork_epoch, init_robust_mutex, lease_call, lease_holder_start, lease_holder_stop,
    lease_list, lease_table_problem, probe_mutex, take_lease_mutex)
from hostkv._lock cimport SegmentLock, check_mutex, check_shape, log_store_i32, log_store_i64, undo_entry
from hostkv.includes.system cimport *

from hostkv.errors import (
    CapacityError,
    CorruptionError,
    ForeignSegmentError,
    IncompatibleSegmentError,
    LockTimeoutError,
    SegmentExistsError,
    SegmentInUseError,
    os_error,
    translate_posix_ipc,
)
# Defined in the layers below; named here too, where callers and tests have always found them.
from hostkv._crash import _arm_new_segments
from hostkv._format import RESERVE_CHUNK
from hostkv.errors import SegmentError as SegmentError_
from hostkv._geometry import MADV, layout_info
from hostkv._leases import MUTEX_KIND, MUTEX_KIND_OFFSET
from hostkv._lock import EXIT_LOCK_TIMEOUT, SWEEP_INTERVAL_NS


# ---------------------------------------------------------------------------------------------
# Hooks: what later layers add to recovery and to the reaping of a dead process.

cdef enum:
    MAX_HOOKS = 8

cdef rederive_hook _rederive_hooks[MAX_HOOKS]
cdef int _num_rederive_hooks = 0
cdef dead_lease_hook _dead_lease_hooks[MAX_HOOKS]
cdef int _num_dead_lease_hooks = 0


cdef int add_rederive_hook(rederive_hook hook) except -1:
    """Registers a function that rebuilds derived state (free lists, counters) after rollback.

    Hooks run in registration order, which is import order: lower layers first.
    """
    global _num_rederive_hooks
    cdef int i
    for i in range(_num_rederive_hooks):
        if _rederive_hooks[i] == hook:
            return 0
    if _num_rederive_hooks == MAX_HOOKS:
        raise RuntimeError("too many rederive hooks")
    _rederive_hooks[_num_rederive_hooks] = hook
    _num_rederive_hooks += 1
    return 0


cdef int add_dead_lease_hook(dead_lease_hook hook) except -1:
    """Registers a function that releases what a dead process held (its sequences)."""
    global _num_dead_lease_hooks
    cdef int i
    for i in range(_num_dead_lease_hooks):
        if _dead_lease_hooks[i] == hook:
            return 0
    if _num_dead_lease_hooks == MAX_HOOKS:
        raise RuntimeError("too many dead-lease hooks")
    _dead_lease_hooks[_num_dead_lease_hooks] = hook
    _num_dead_lease_hooks += 1
    return 0


# ---------------------------------------------------------------------------------------------
# Names and timeouts

_NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,200}")
SEGMENT_MODE = 0o600
DEFAULT_LOCK_TIMEOUT = 10.0
# Creating a segment reserves all of its memory (posix_fallocate; ~5.7 GB/s on tmpfs was
# measured): the README's 65,536 x 2 MiB pool takes ~23 s. Attachers wait up to
# this long for a creator that is still at it: 120 s covers a pool of ~600 GB.
DEFAULT_READY_TIMEOUT = 120.0
MAX_TIMEOUT = 1e9            # about 31 years: beyond it a deadline in ns would overflow


def check_name(name):
    """Returns the posix_ipc name ('/' + name) or raises ValueError for a bad segment name."""
    if not isinstance(name, str):
        raise ValueError(f"segment name must be a str, got {type(name).__name__}")
    if not _NAME_RE.fullmatch(name) or set(name) == {"."}:
        raise ValueError(
            "segment name must be 1-200 characters of letters, digits, '-', '_' and '.', "
            f"and not only dots; got {name!r}")
    return "/" + name


# Linux's shm_open keeps its objects here (glibc's __shm_directory): segments are opened and
# created through it directly where posix_ipc has no call for the job (O_TMPFILE, flock).
SHM_DIR = "/dev/shm"
# How long an attacher waits for the shared lock while a replacer holds the exclusive one
# (it holds it only to unlink the old file), and how often it opens the name again when it
# finds the file it opened already unlinked.
REPLACER_WAIT = 5.0
MAX_REOPENS = 100


def shm_path(name):
    """The file of segment `name` (a checked name)."""
    return f"{SHM_DIR}/{name}"


def unlink_side_objects(name):
    """Removes the NAME@... objects kept beside a segment (a segment's name never holds '@',
    so this removes no other segment)."""
    for path in glob.glob(f"{SHM_DIR}/{glob.escape(name)}@*"):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


cdef int open_unnamed(name) except -2:
    """A new, nameless file in the segments' directory (O_TMPFILE), or -1 where the kernel or
    filesystem has none: the creator links it under its name once its header and its locks
    are in it, so no process ever opens a segment whose creator has not marked it."""
    try:
        return os.open(SHM_DIR, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, SEGMENT_MODE)
    except AttributeError:
        return -1
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOENT):
            return -1
        raise os_error(exc.errno or errno.EIO, "create segment", name) from None


cdef int link_unnamed(int fd, path, name) except -1:
    """Gives the nameless file at fd the name `path`, exclusively (EEXIST: another has it).

    linkat(2) with AT_SYMLINK_FOLLOW through /proc/self/fd: the way an unprivileged process
    names an O_TMPFILE file. os.link uses linkat only when given a directory fd, hence one."""
    proc_fd = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.link(str(fd), path, src_dir_fd=proc_fd, follow_symlinks=True)
    except OSError as exc:
        raise os_error(exc.errno or errno.EIO, "create segment", name) from None
    finally:
        os.close(proc_fd)
    return 0


cdef int take_shared_lock(int fd, name, double wait) except -1:
    """flock(LOCK_SH) on the segment's file: "in use", for as long as this handle is open.

    A replacer holds LOCK_EX only while it unlinks the file: wait for it (then the caller
    finds the file unlinked and opens the name again). The lock belongs to the open file
    description, so a forked child that inherits the fd holds it too, and it goes when the
    last descriptor of it closes (or the process dies): never LOCK_UN, which would drop it
    for the parent and the child at once."""
    deadline = time.monotonic() + wait
    delay = 0.0005
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return 0
        except BlockingIOError:
            pass
        except OSError as exc:
            raise os_error(exc.errno or errno.EIO, "lock segment", name) from None
        if time.monotonic() >= deadline:
            raise LockTimeoutError(
                f"segment {name!r}: another process held its file locked for replacing for "
                f"{wait:g} s")
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def check_timeout(what, value):
    """Returns value as a float of seconds, or raises ValueError for a negative or NaN one,
    or one that is not a real number (a str such as "1", a bool)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{what} must be a number of seconds, got {value!r}")
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a number of seconds, got {value!r}") from None
    if not 0 < seconds <= MAX_TIMEOUT:
        raise ValueError(
            f"{what} must be a number of seconds in (0, {MAX_TIMEOUT:g}], got {value!r}")
    return seconds


# ---------------------------------------------------------------------------------------------
# The segment

cdef class Segment(SegmentLock):
    """One mapping of a hostkv segment, with this process's lease on it.

    Use create() or attach(); close() gives the lease up and unmaps. Not for direct use by
    engines: HostKVCache wraps it.
    """

    # -- opening ---------------------------------------------------------------------------

    @staticmethod
    def create(name, object config, lock_timeout=DEFAULT_LOCK_TIMEOUT):
        """Creates the segment `name` for a resolved HostKVConfig and attaches to it.

        The file is made nameless (O_TMPFILE) and given its name only once its first header
        is written and the creator holds its two locks on it: the shared flock every user
        holds, and the creator's mark (_format.creator_gone), which it drops once the
        segment is READY. So whoever opens the name finds a header, and tells a creator at
        work from a dead one by the mark, never by its pid. Where O_TMPFILE is missing, the
        name is created exclusively and marked at once.

        Raises:
            ValueError: a bad name or timeout.
            SegmentExistsError: a segment of that name exists.
            SegmentError: the OS refused (ENOSPC when /dev/shm cannot hold it).
        """
        cdef Segment seg = Segment.__new__(Segment)
        cdef HkvConfig ccfg
        cdef HkvRegions regions
        cdef int fd, rc
        check_name(name)
        path = shm_path(name)
        seg.lock_timeout_ns = <int64_t>(check_timeout("lock_timeout", lock_timeout) * 1e9)
        ccfg = config_to_c(config)
        compute_regions(&ccfg, &regions)
        named = False
        fd = open_unnamed(name)
        if fd < 0:
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC
                             | os.O_NOFOLLOW, SEGMENT_MODE)
            except OSError as exc:
                raise os_error(exc.errno or errno.EIO, "create segment", name) from None
            named = True
        seg.fd = fd
        try:
            try:
                rc = hkv_creator_mark(fd)
                if rc != 0:
                    raise os_error(rc, "lock the new segment (creator's mark)", name)
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                os.fchmod(fd, SEGMENT_MODE)      # whatever the umask
                write_first_header(name, fd, &ccfg, &regions)
                if not named:
                    link_unnamed(fd, path, name)
                    named = True
            except OSError as exc:
                if isinstance(exc, SegmentError_):
                    raise
                raise os_error(exc.errno or errno.EIO, "create segment", name) from None
            st = os.fstat(fd)
            seg.file_dev, seg.file_ino = st.st_dev, st.st_ino
            seg._map(name, fd, regions.reg_total_size)
            reserve_memory(name, fd, regions.reg_total_size, seg.hdr)
            seg._initialise(&ccfg, &regions)
            hkv_creator_unmark(fd)               # READY is out: attachers stop asking
            seg.last_sweep_ns = now_ns(CLOCK_MONOTONIC)    # nobody to reap in a new segment
            seg._register_lease()
        except BaseException:
            seg._stop_lease_holder()
            seg._unmap()
            if named:
                # Only the file this call made: another may hold the name by now.
                try:
                    cur = os.stat(path)
                    if (cur.st_dev, cur.st_ino) == (seg.file_dev, seg.file_ino):
                        os.unlink(path)
                except OSError:
                    pass
            raise
        return seg

    @staticmethod
    def replace(name, object config, lock_timeout=DEFAULT_LOCK_TIMEOUT, expect_inode=None):
        """Unlinks the segment `name` if no live process holds it attached, and creates it
        anew (as create()). Returns the new Segment, or None where there was nothing to do
        yet: the name is another file than `expect_inode` ((st_dev, st_ino) of the one the
        caller inspected), another process is replacing it or has just done so, or another
        created it first: look again.

        Every attached handle holds flock(LOCK_SH) on the file; this takes LOCK_EX without
        waiting, so it replaces only a segment nobody uses, as the kernel knows it, across
        PID namespaces. It unlinks while it holds the exclusive lock: an attacher that had
        opened the old file finds it unlinked once it has its shared lock, and opens the
        name again.

        Raises:
            SegmentInUseError: live processes hold it attached.
            SegmentExistsError: never (another creator's segment: None).
            SegmentError: the OS refused.
        """
        cdef int fd
        check_name(name)
        check_timeout("lock_timeout", lock_timeout)
        path = shm_path(name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            fd = -1
        except OSError as exc:
            raise os_error(exc.errno or errno.EIO, "open segment to replace it", name) from None
        if fd >= 0:
            try:
                st = os.fstat(fd)
                if expect_inode is not None and (st.st_dev, st.st_ino) != tuple(expect_inode):
                    return None
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    # Users (shared holders), or another replacer (exclusive): a shared
                    # lock tells them apart.
                    try:
                        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    except BlockingIOError:
                        return None
                    if os.fstat(fd).st_nlink == 0:
                        return None
                    raise SegmentInUseError(
                        f"segment {name!r} is in use: live processes hold it attached (its "
                        "file's shared lock)") from None
                if os.fstat(fd).st_nlink == 0:
                    return None                  # replaced by another between open and lock
                try:
                    cur = os.stat(path)
                except FileNotFoundError:
                    return None
                if (cur.st_dev, cur.st_ino) != (st.st_dev, st.st_ino):
                    return None
                os.unlink(path)
                unlink_side_objects(name)
            except OSError as exc:
                if isinstance(exc, SegmentError_):
                    raise
                raise os_error(exc.errno or errno.EIO, "replace segment", name) from None
            finally:
                os.close(fd)
        try:
            return Segment.create(name, config, lock_timeout)
        except SegmentExistsError:
            return None

    @staticmethod
    def attach(name, lock_timeout=DEFAULT_LOCK_TIMEOUT, ready_timeout=DEFAULT_READY_TIMEOUT,
               bint trust_other_users=False, bint lease=True):
        """Attaches to an existing segment and takes a lease on it.

        With lease=False the handle only observes (inspection tools): it takes no lease
        slot and never sweeps, so attaching it changes nothing in the segment.

        Raises:
            ValueError: a bad name or timeout.
            SegmentNotFoundError: no segment of that name.
            ForeignSegmentError: owned by another user or writable by group/other, and
                trust_other_users is False.
            IncompatibleSegmentError: too short, another format, or never became ready.
        """
        cdef Segment seg = Segment.__new__(Segment)
        posix_name = check_name(name)
        seg.lock_timeout_ns = <int64_t>(check_timeout("lock_timeout", lock_timeout) * 1e9)
        ready_seconds = check_timeout("ready_timeout", ready_timeout)
        for attempt in range(MAX_REOPENS):
            try:
                # size=0: posix_ipc resizes an existing segment to any non-zero size it is given.
                shm = posix_ipc.SharedMemory(posix_name, 0, size=0)
            except posix_ipc.Error as exc:
                raise translate_posix_ipc(exc, "attach segment", name, creating=False) from None
            fd = shm.fd
            keep = False
            try:
                st = os.fstat(fd)
                if not trust_other_users:
                    if st.st_uid != getuid():
                        raise ForeignSegmentError(
                            f"segment {name!r} is owned by uid {st.st_uid}, not by this user "
                            f"(uid {getuid()}); pass trust_other_users=True to attach anyway")
                    if st.st_mode & 0o022:
                        raise ForeignSegmentError(
                            f"segment {name!r} has mode {st.st_mode & 0o777:o}: other users can "
                            "write it; pass trust_other_users=True to attach anyway")
                seg.name = name
                size = wait_ready(name, fd, ready_seconds)
                if lease:
                    # In use from here on; taken only once it is READY, so that waiting
                    # for a creator (who may die) never counts as using its segment.
                    take_shared_lock(fd, name, REPLACER_WAIT)
                    if os.fstat(fd).st_nlink == 0:
                        continue                 # replaced meanwhile: open the name again
                    keep = True
                seg.file_dev, seg.file_ino = st.st_dev, st.st_ino
                seg._map(name, fd, size)
            finally:
                if keep:
                    seg.fd = fd
                else:
                    shm.close_fd()
            break
        else:
            raise IncompatibleSegmentError(
                f"segment {name!r} was replaced {MAX_REOPENS} times while attaching")
        try:
            seg._validate()
            seg._populate_metadata()
            seg.observer = not lease
            if lease:
                seg._register_lease()
                seg.begin()
                try:
                    seg.sweep_leases()
                    seg.commit()
                finally:
                    seg.end()
        except BaseException:
            seg.close()
            raise
        return seg

    cdef _map(self, name, int fd, int64_t size):
        cdef void* addr
        with nogil:
            addr = mmap(NULL, <size_t>size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
        if addr == MAP_FAILED:
            import ctypes
            raise os_error(ctypes.get_errno() or 12, "mmap segment", name)
        self.base = <char*>addr
        self.hdr = <HkvHeader*>addr
        self.size = <size_t>size
        self.name = name
        self.closed = False
        self.fork_epoch = fork_epoch()

    cdef _populate_metadata(self):
        """Maps an attached segment's metadata (everything before the page pool) in now, so
        the first operations do not take a page fault per 4 KiB they touch. Best effort: a
        kernel without MADV_POPULATE_WRITE faults lazily; a segment not ready yet is skipped
        (the creator populates it in _initialise)."""
        cdef size_t length
        if self.size < sizeof(HkvHeader) or self.hdr.hdr_state != HKV_STATE_READY:
            return
        if not 0 < self.hdr.hdr_regions.reg_pool <= <int64_t>self.size:
            return                               # _validate reports this
        length = <size_t>self.hdr.hdr_regions.reg_pool
        with nogil:
            madvise(self.base, length, MADV_POPULATE_WRITE)

    cdef _initialise(self, HkvConfig* ccfg, HkvRegions* regions):
        """Writes a fresh header and tables. Nobody else reads them before state is READY."""
        cdef HkvHeader* hdr = self.hdr
        cdef int64_t i
        hdr.hdr_state = HKV_STATE_INITIALISING
        with nogil:
            madvise(self.base, <size_t>regions.reg_pool, MADV_POPULATE_WRITE)
        hdr.hdr_format = expected_format()
        hdr.hdr_config = ccfg[0]
        hdr.hdr_regions = regions[0]
        hdr.hdr_creator_pid = getpid()
        hdr.hdr_generation = 0
        hdr.hdr_undo_count = 0
        init_robust_mutex(&hdr.hdr_mutex)
        for i in range(ccfg.cfg_max_processes):
            init_robust_mutex(&(<HkvLease*>(self.base + regions.reg_leases))[i].ls_mutex)
        creator_step(hdr)
        init_tables(self.base, hdr, ccfg, regions)
        creator_step(hdr)
        self._bind_regions()
        for i in range(_num_rederive_hooks):
            _rederive_hooks[i](self)
        hdr.hdr_magic = HKV_MAGIC
        __atomic_store_release_u32(&hdr.hdr_state, HKV_STATE_READY)

    cdef _bind_regions(self):
        self.metrics = <HkvMetrics*>(self.base + self.hdr.hdr_regions.reg_metrics)
        self.undo = <HkvUndoEntry*>(self.base + self.hdr.hdr_regions.reg_undo)
        self.undo_capacity = self.hdr.hdr_config.cfg_undo_log_capacity

    cdef _validate(self):
        """Checks an attached header: magic, format word, config sanity, region offsets."""
        cdef HkvHeader* hdr = self.hdr
        cdef HkvRegions regions
        cdef HkvConfig* c = &hdr.hdr_config
        if hdr.hdr_magic != HKV_MAGIC:
            raise IncompatibleSegmentError(f"segment {self.name!r} is not a hostkv segment (bad magic)")
        check_format(self.name, &hdr.hdr_format)
        if config_impossible(c):
            raise CorruptionError(f"segment {self.name!r} has an impossible config in its header")
        compute_regions(c, &regions)
        if (<char*>&regions)[:sizeof(HkvRegions)] != (<char*>&hdr.hdr_regions)[:sizeof(HkvRegions)]:
            raise CorruptionError(f"segment {self.name!r}: region offsets disagree with its config")
        if <int64_t>self.size != regions.reg_total_size:
            raise IncompatibleSegmentError(
                f"segment {self.name!r} is {self.size} bytes but its header describes "
                f"{regions.reg_total_size}")
        # Every mutex's kind word, before anything locks one (glibc believes it).
        check_mutex(self, &hdr.hdr_mutex, "the segment lock")
        for slot in range(c.cfg_max_processes):
            check_mutex(self, &(<HkvLease*>(self.base + hdr.hdr_regions.reg_leases))[slot].ls_mutex,
                        f"lease slot {slot}")
        self._bind_regions()

    # -- recovery ------------------------------------------------------------------------------

    def _recover(self, bint after_death):
        """Replays the undo log backwards, re-derives derived state, then clears the log.

        after_death: the log is a dead holder's (counted as a recovery) rather than this
        process's own failed mutation (counted as a rollback).

        Idempotent: a death in the middle of it leaves the log as it was, and the next
        locker replays it again (each entry restores the same old value).
        """
        cdef int64_t i, n = self.hdr.hdr_undo_count
        cdef HkvUndoEntry* entry
        cdef uint64_t where, width
        cdef int64_t limit
        cdef uint64_t mutex_at = <uint64_t>(<char*>&self.hdr.hdr_mutex - self.base)
        check_shape(self)
        limit = self.hdr.hdr_regions.reg_pool
        if n < 0 or n > self.undo_capacity:
            self.corrupt(f"undo log count {n} is outside [0, {self.undo_capacity}]")
        if n and not 0 <= self.hdr.hdr_undo_start < self.undo_capacity:
            self.corrupt(f"undo log start {self.hdr.hdr_undo_start} is outside "
                         f"[0, {self.undo_capacity})")
        self.undo_start = self.hdr.hdr_undo_start     # the log's holder's, maybe a dead one's
        i = n - 1
        while i >= 0:
            entry = undo_entry(self, i)
            where = entry.ue_where & HKV_UNDO_OFFSET_MASK
            width = entry.ue_where >> HKV_UNDO_WIDTH_SHIFT
            # Only metadata is ever logged: an entry pointing at the header's own lock and
            # log bookkeeping, into the page pool, or past the end is corruption.
            if ((width != 4 and width != 8) or where % width != 0 or where < 8
                    or where + width > <uint64_t>limit
                    or (where + width > mutex_at and where < mutex_at + sizeof(pthread_mutex_t))):
                self.corrupt(f"undo entry {i} points at offset {where} width {width}")
            if self.crash_countdown > 0:
                self.crash_point()
            if width == 4:
                (<uint32_t*>(self.base + where))[0] = <uint32_t>entry.ue_old
            else:
                (<uint64_t*>(self.base + where))[0] = entry.ue_old
            i -= 1
        check_shape(self)           # a replayed entry may have hit the header's fixed part
        for i in range(_num_rederive_hooks):
            _rederive_hooks[i](self)
        hkv_compiler_barrier()
        self.hdr.hdr_undo_count = 0
        if n and after_death:
            self.hdr.hdr_stats.st_recoveries += 1
        elif n:
            self.hdr.hdr_stats.st_rollbacks += 1

    # -- leases ------------------------------------------------------------------------------

    cdef HkvLease* lease_at(self, int32_t slot) except NULL:
        if slot < 0 or slot >= self.hdr.hdr_config.cfg_max_processes:
            self.corrupt(f"lease slot {slot} out of range")
        return (<HkvLease*>(self.base + self.hdr.hdr_regions.reg_leases)) + slot

    def _register_lease(self):
        """Takes a free lease slot for this process and has the lease thread hold its mutex."""
        cdef LeaseHolder* holder
        cdef HkvLease* lease
        cdef int32_t slot, attempt
        if self.lease_holder == NULL:
            self.lease_holder = lease_holder_start()
        holder = self.lease_holder
        self.begin()
        try:
            for attempt in range(2 * self.hdr.hdr_config.cfg_max_processes):
                if attempt == self.hdr.hdr_config.cfg_max_processes:
                    # Every slot taken: reclaim the slots of dead processes (a mutation of
                    # its own, kept even if no slot comes free), then look again.
                    self.sweep_leases()
                    self.commit()
                slot = attempt % self.hdr.hdr_config.cfg_max_processes
                lease = self.lease_at(slot)
                if lease.ls_state != HKV_LEASE_FREE:
                    continue
                check_mutex(self, &lease.ls_mutex, f"lease slot {slot}")
                if take_lease_mutex(holder, &lease.ls_mutex) != 0:
                    continue
                try:
                    log_store_i32(self, <int32_t*>&lease.ls_state, HKV_LEASE_ACTIVE)
                    log_store_i32(self, &lease.ls_pid, getpid())
                    log_store_i64(self, <int64_t*>&lease.ls_generation, <int64_t>lease.ls_generation + 1)
                    log_store_i64(self, &lease.ls_registered_ns, now_ns(CLOCK_REALTIME))
                    log_store_i32(self, &lease.ls_parent_slot, -1)
                    log_store_i64(self, <int64_t*>&lease.ls_parent_generation, 0)
                    log_store_i32(self, &self.hdr.hdr_active_leases, self.hdr.hdr_active_leases + 1)
                    self.commit()
                except BaseException:
                    with nogil:
                        lease_call(holder, LEASE_DROP, NULL)
                    raise
                self.lease_slot = slot
                self.lease_generation = lease.ls_generation
                self.fork_epoch = fork_epoch()
                return slot
            raise CapacityError(
                f"segment {self.name!r}: all {self.hdr.hdr_config.cfg_max_processes} lease slots "
                "are held by live processes; raise max_processes",
                resource="lease slots", needed=1, available=0)
        finally:
            self.end()

    def _release_lease(self):
        """Gives this process's lease slot back, then lets the lease thread unlock it."""
        cdef HkvLease* lease
        if self.lease_slot < 0:
            return
        self.begin()
        try:
            lease = self.lease_at(self.lease_slot)
            if (lease.ls_state == HKV_LEASE_ACTIVE
                    and lease.ls_generation == self.lease_generation
                    and not self.has_live_member(self.lease_slot, self.lease_generation)):
                for i in range(_num_dead_lease_hooks):
                    _dead_lease_hooks[i](self, self.lease_slot)
                log_store_i32(self, <int32_t*>&lease.ls_state, HKV_LEASE_FREE)
                log_store_i32(self, &self.hdr.hdr_active_leases, self.hdr.hdr_active_leases - 1)
            # Else a live process of its group (a worker) may still write the pages its
            # sequences reserved: the slot stays as a dead lease would, quarantined, and the
            # sweep after the last member releases it. A clean close is no safer than a
            # death for a page someone else still writes.
            self.commit()
        finally:
            self.end()
        self.lease_slot = -1
        with nogil:
            lease_call(self.lease_holder, LEASE_DROP, NULL)

    cdef int dead_leases(self) except -1:
        """How many lease slots are held by dead processes that a sweep would reclaim now
        (not those quarantined for a live member of their group: see has_live_member).
        Probes only, changes nothing the sweep would not."""
        cdef int32_t slot
        cdef int dead = 0
        cdef HkvLease* lease
        for slot in range(self.hdr.hdr_config.cfg_max_processes):
            lease = self.lease_at(slot)
            if slot != self.lease_slot and lease.ls_state == HKV_LEASE_ACTIVE:
                if not self.lease_alive(slot) and not self.has_live_member(slot, lease.ls_generation):
                    dead += 1
        return dead

    cdef bint has_live_member(self, int32_t slot, uint64_t generation) except -1:
        """Whether a live process's lease names lease (slot, generation) as its parent: a
        process that works for it (a vLLM worker for its engine's scheduler) and may still
        be writing the pages its sequences reserved. While one lives, a dead parent's
        sequences stay as they are (quarantined), so no page of theirs is handed out while
        a member may write it. Compares values only: nothing read here is followed."""
        cdef int32_t other
        cdef HkvLease* lease
        for other in range(self.hdr.hdr_config.cfg_max_processes):
            if other == slot:
                continue
            lease = self.lease_at(other)
            if (lease.ls_state != HKV_LEASE_ACTIVE or lease.ls_parent_generation == 0
                    or lease.ls_parent_slot != slot or lease.ls_parent_generation != generation):
                continue
            if other == self.lease_slot and self.fork_epoch == fork_epoch():
                return True
            check_mutex(self, &lease.ls_mutex, f"lease slot {other}")
            if probe_mutex(&lease.ls_mutex) == EBUSY:
                return True
        return False

    cdef int sweep_leases(self) except -1:
        """Frees the lease of every process that has died, and what it held. Returns how
        many it freed.

        Runs with the lock held and nothing uncommitted: the dead-lease hooks commit as
        they go (one released sequence at a time), so that reclaiming a process never needs
        more than one sequence's worth of undo log."""
        cdef HkvLease* lease
        cdef int32_t slot
        cdef int rc, reaped = 0
        if self.hdr.hdr_undo_count != 0:
            raise RuntimeError("sweep_leases inside an open mutation")
        for slot in range(self.hdr.hdr_config.cfg_max_processes):
            if slot == self.lease_slot:
                continue
            lease = self.lease_at(slot)
            if lease.ls_state == HKV_LEASE_FREE:
                continue
            if lease.ls_state != HKV_LEASE_ACTIVE:
                self.corrupt(f"lease slot {slot} has state {lease.ls_state}")
            check_mutex(self, &lease.ls_mutex, f"lease slot {slot}")
            rc = probe_mutex(&lease.ls_mutex)
            if rc == EBUSY:
                continue                       # its lease thread holds it: alive
            # Unheld or owner-dead: the process is gone (a live one always holds it).
            if rc != 0 and rc != EOWNERDEAD and rc != ENOTRECOVERABLE:
                raise os_error(rc, f"probe lease slot {slot}", self.name)
            if self.has_live_member(slot, lease.ls_generation):
                continue                       # quarantined until its group's last member dies
            for i in range(_num_dead_lease_hooks):
                _dead_lease_hooks[i](self, slot)
            log_store_i32(self, <int32_t*>&lease.ls_state, HKV_LEASE_FREE)
            log_store_i32(self, &self.hdr.hdr_active_leases, self.hdr.hdr_active_leases - 1)
            log_store_i64(self, &self.hdr.hdr_stats.st_leases_reaped,
                          self.hdr.hdr_stats.st_leases_reaped + 1)
            reaped += 1
        self.last_sweep_ns = now_ns(CLOCK_MONOTONIC)
        return reaped

    def reap(self):
        """Sweeps the lease table now: releases what dead processes held. Returns how many."""
        self.begin()
        try:
            reaped = self.reaped_by_begin + self.sweep_leases()
            self.commit()
        finally:
            self.end()
        return reaped

    def _after_fork(self):
        """In a forked child: forget the parent's lease (its thread is not here) and take
        one, unless this handle is an observer (it takes none anywhere).

        The export count stays: the child inherited the parent's numpy/torch views of the
        pool along with everything else, so close() must refuse to unmap under them here
        as it does in the parent."""
        self.lease_slot = -1
        self.lease_holder = NULL        # the parent's holder; its thread does not exist here
        # A parent's thread may have held the lock at fork: that thread is not here (and
        # the mutex, in shared memory, is still the parent's to unlock).
        self._forget_parent_threads()
        self.handoff_due = False        # the parent's unlock; its waiter is the parent's
        self.fork_epoch = fork_epoch()
        if not self.observer:
            self._register_lease()

    # -- closing -----------------------------------------------------------------------------

    def close(self):
        """Gives the lease up and unmaps.

        Calls that other threads have in flight finish first: new calls are refused
        (ValueError) while close() waits for them, at most lock_timeout + 1 s (a call waits
        at most lock_timeout for the lock, then holds it briefly).

        Raises:
            BufferError: numpy/torch views of the page pool are alive.
            RuntimeError: called by the thread that holds the lock (from inside a call).
            LockTimeoutError: other threads' calls were still in flight at the bound; the
                handle stays open and usable.
        """
        cdef pthread_t me = pthread_self()
        if self.closed:
            return
        if self.fork_epoch != fork_epoch():
            self._forget_parent_threads()
        if self.exports:
            raise BufferError(
                f"segment {self.name!r}: {self.exports} numpy/torch view(s) of the page pool "
                "are still alive; delete them before close()")
        if self.locked and pthread_equal(self.lock_owner, me):
            raise RuntimeError(
                f"segment {self.name!r}: close() from inside a call on it (this thread holds "
                "its lock)")
        if self.closing:
            if pthread_equal(self.closing_thread, me):
                raise RuntimeError(f"segment {self.name!r}: close() is already running in this thread")
            # Another thread is closing it: wait for that close to end, then it is closed
            # (or that close gave up, and this one tries in its turn).
            self._wait_until(lambda: not self.closing, "another thread's close()")
            if self.closed:
                return
        self.closing = True
        self.closing_thread = me
        try:
            self._wait_until(lambda: self.in_flight == 0,
                             "calls that other threads have in flight")
            if self.exports:
                # Made by another thread before close() began refusing new views.
                raise BufferError(
                    f"segment {self.name!r}: {self.exports} numpy/torch view(s) of the page "
                    "pool are still alive; delete them before close()")
        except BaseException:
            self.closing = False
            raise
        try:
            if self.fork_epoch == fork_epoch() and self.lease_slot >= 0:
                self._release_lease()
        finally:
            self._stop_lease_holder()
            self._unmap()
            self.closing = False

    def _stop_lease_holder(self):
        """Stops this process's lease thread (unlocking the lease mutex if it holds it)."""
        if self.lease_holder != NULL and self.fork_epoch == fork_epoch():
            with nogil:
                lease_holder_stop(self.lease_holder)
        self.lease_holder = NULL

    def _wait_until(self, done, str what):
        """Sleeps (without the GIL) until done() holds, at most lock_timeout + 1 s."""
        cdef double bound = self.lock_timeout_ns / 1e9 + 1.0
        deadline = time.monotonic() + bound
        delay = 0.0001
        while not done():
            if time.monotonic() >= deadline:
                raise LockTimeoutError(
                    f"segment {self.name!r}: close() waited {bound:g} s for {what} "
                    f"({self.in_flight} in flight) to finish; the handle stays open")
            time.sleep(delay)
            delay = min(delay * 2, 0.01)

    def _forget_parent_threads(self):
        """In a forked child: the parent's other threads, their calls and their close()
        are not in this process."""
        self.locked = False
        self.in_flight = 0
        self.closing = False

    def _unmap(self):
        if self.base != NULL:
            munmap(self.base, self.size)
        if self.fd >= 0:
            # Closing (never LOCK_UN) drops this description's shared lock only when no other
            # descriptor of it stays open: a forked child's copy keeps it held.
            os.close(self.fd)
            self.fd = -1
        self.base = NULL
        self.hdr = NULL
        self.closed = True

    def __dealloc__(self):
        if self.base != NULL and self.exports == 0:
            try:
                self.close()
            except BaseException:
                pass

    # -- reading -----------------------------------------------------------------------------

    def config_values(self):
        """The header's config as a dict of HostKVConfig field values (kv layout separate)."""
        self._check_open()
        return config_values(&self.hdr.hdr_config)

    def header_info(self):
        """A snapshot of the header (format, regions, state, counters) as plain dicts."""
        self._check_open()
        check_shape(self)
        return header_snapshot(self.hdr, self.base)

    def lease_alive(self, int32_t slot):
        """Whether the process holding lease slot is alive (its lease mutex is held).

        Probing an owner-dead mutex takes it for an instant, marks it consistent and lets
        go; the sweep treats such a slot as dead either way, so nothing else changes."""
        cdef HkvLease* lease
        self._check_open()
        check_shape(self)
        lease = self.lease_at(slot)
        if lease.ls_state != HKV_LEASE_ACTIVE:
            return False
        if slot == self.lease_slot and self.fork_epoch == fork_epoch():
            return True
        check_mutex(self, &lease.ls_mutex, f"lease slot {slot}")
        return probe_mutex(&lease.ls_mutex) == EBUSY

    def lease_identity(self):
        """(slot, generation) of this handle's lease, or None for an observer."""
        self._check_open()
        if self.fork_epoch != fork_epoch():
            self._after_fork()
        if self.lease_slot < 0:
            return None
        return (self.lease_slot, self.lease_generation)

    def lease_alive_as(self, int32_t slot, uint64_t generation):
        """Whether lease (slot, generation) is held by a live process: the slot is active,
        still that registration (a slot taken again is another process), and its mutex
        held. No lock: one probe, cheap enough to ask before each submission of copies."""
        cdef HkvLease* lease
        self._check_open()
        check_shape(self)
        if not 0 <= slot < self.hdr.hdr_config.cfg_max_processes:
            return False
        lease = self.lease_at(slot)
        if lease.ls_state != HKV_LEASE_ACTIVE or lease.ls_generation != generation:
            return False
        return self.lease_alive(slot) and lease.ls_generation == generation

    def join_lease_group(self, int32_t slot, uint64_t generation):
        """Names lease (slot, generation) as the parent of this handle's lease: this process
        works for it (writes pages its sequences reserved). While this lease lives, the
        parent's sequences are not released if the parent dies: their pages stay
        quarantined, never handed out while this process may still write them; the sweep
        after this lease's end (close or death) releases them.

        Returns True once joined, False when that lease is not held by a live process (gone,
        or taken again): then nothing of it may be written. A logged mutation.

        Raises:
            ValueError: an observer (no lease), a slot outside the table, generation 0,
                or this handle's own lease.
        """
        cdef HkvLease* parent
        cdef HkvLease* own
        self._check_open()
        if self.fork_epoch != fork_epoch():
            self._after_fork()
        if self.lease_slot < 0:
            raise ValueError("an observer's handle has no lease to join a group with")
        if not 0 <= slot < self.hdr.hdr_config.cfg_max_processes or generation == 0:
            raise ValueError(
                f"lease ({slot}, {generation}) is not a lease of this segment (slots [0, "
                f"{self.hdr.hdr_config.cfg_max_processes}), generations from 1)")
        if slot == self.lease_slot:
            raise ValueError(f"lease slot {slot} is this handle's own")
        self.begin()
        try:
            parent = self.lease_at(slot)
            own = self.lease_at(self.lease_slot)
            if (parent.ls_state != HKV_LEASE_ACTIVE or parent.ls_generation != generation
                    or not self.lease_alive(slot)):
                self.commit()
                return False
            if own.ls_parent_slot != slot or own.ls_parent_generation != generation:
                log_store_i32(self, &own.ls_parent_slot, slot)
                log_store_i64(self, <int64_t*>&own.ls_parent_generation, <int64_t>generation)
            self.commit()
            return True
        finally:
            self.end()

    def metrics_info(self):
        """The metrics region as plain Python values (call with the lock held)."""
        self._check_open()
        return metrics_snapshot(self.metrics)

    def leases(self):
        """The lease table: (slot, state, pid, generation, registered_ns) of every used slot."""
        self._check_open()
        check_shape(self)
        return lease_list(<HkvLease*>(self.base + self.hdr.hdr_regions.reg_leases),
                          self.hdr.hdr_config.cfg_max_processes)

    @property
    def free_pages(self):
        """Free pages now (a single read, no lock: a hint that may be stale at once)."""
        self._check_open()
        return self.hdr.hdr_free_pages

    @property
    def segment_id(self):
        """The segment's random id (never 0), fixed at create."""
        self._check_open()
        return self.hdr.hdr_segment_id

    @property
    def file_identity(self):
        """(st_dev, st_ino) of the file this handle mapped."""
        return (self.file_dev, self.file_ino)

    @property
    def lease_slot_index(self):
        """This process's lease slot, or -1."""
        return self.lease_slot

    def check_header(self):
        """Checks this layer's invariants (call with the lock held, via _locked_check)."""
        cdef HkvLease* lease
        if self.hdr.hdr_magic != HKV_MAGIC:
            self.corrupt("bad magic")
        if self.hdr.hdr_undo_count != 0:
            self.corrupt(f"undo log holds {self.hdr.hdr_undo_count} entries outside a mutation")
        problem = lease_table_problem(<HkvLease*>(self.base + self.hdr.hdr_regions.reg_leases),
                                      self.hdr.hdr_config.cfg_max_processes,
                                      self.hdr.hdr_active_leases)
        for slot in range(self.hdr.hdr_config.cfg_max_processes):
            lease = self.lease_at(slot)
            if lease.ls_state == HKV_LEASE_ACTIVE and lease.ls_parent_generation != 0 and (
                    not 0 <= lease.ls_parent_slot < self.hdr.hdr_config.cfg_max_processes
                    or lease.ls_parent_slot == slot):
                problem = problem or (f"lease slot {slot} names lease slot "
                                      f"{lease.ls_parent_slot} as its parent")
        if problem is not None:
            self.corrupt(problem)
        if self.lease_slot >= 0 and self.fork_epoch == fork_epoch():
            lease = self.lease_at(self.lease_slot)
            if lease.ls_state != HKV_LEASE_ACTIVE or lease.ls_generation != self.lease_generation:
                self.corrupt(f"this process's lease (slot {self.lease_slot}) was taken away")

    # -- the page pool's bytes -----------------------------------------------------------------

    def pool_address(self):
        """The address of the page pool in this process (for views; changes per process)."""
        self._check_open()
        check_shape(self)
        return <size_t>(self.base + self.hdr.hdr_regions.reg_pool)

    def pool_span(self):
        """Bytes from the page pool's start to the segment's end: the page pool, then (with
        window parts) padding to 4096 and the part pool. The range engines write."""
        self._check_open()
        check_shape(self)
        return self.hdr.hdr_regions.reg_total_size - self.hdr.hdr_regions.reg_pool

    def part_pool(self):
        """The window parts' bytes as a buffer object (PartPool): np.asarray(memoryview(it))
        is a writable uint8 [num_parts, part_bytes] view that keeps this segment's mapping
        alive and counted, as views of the page pool do."""
        self._check_open()
        check_shape(self)
        return PartPool(self)

    def advise_pool(self, int64_t start, int64_t length, int advice):
        """madvise(2) on bytes [start, start + length) of this process's mapping of the page
        pool and the part pool after it (pool_span), widened to whole OS pages, without the GIL. Returns 0, or the errno it failed
        with (the caller decides: EINVAL from an older kernel means "try another advice").

        Counts as a call in flight, so close() in another thread waits for it rather than
        unmap the range under it, and refuses it once close() has begun.

        Raises:
            ValueError: the segment is closed or closing, or the range is not in the pool.
        """
        cdef pthread_t me = pthread_self()
        cdef int64_t pool_bytes
        cdef char* at
        cdef int err
        if self.closed:
            raise ValueError("the segment is closed")
        if self.fork_epoch != fork_epoch():
            self._after_fork()
        if self.closing and not pthread_equal(self.closing_thread, me):
            raise ValueError("the segment is closed (another thread is closing it)")
        check_shape(self)
        pool_bytes = self.hdr.hdr_regions.reg_total_size - self.hdr.hdr_regions.reg_pool
        if not (0 <= start <= pool_bytes and 0 <= length <= pool_bytes - start):
            raise ValueError(
                f"range [{start}, {start} + {length}) is not in the page pool of {pool_bytes} bytes")
        if length == 0:
            return 0
        at = self.base + self.hdr.hdr_regions.reg_pool + start
        self.in_flight += 1
        with nogil:
            err = advise_range(at, <size_t>length, advice)
        self.in_flight -= 1
        return err

    def __getbuffer__(self, Py_buffer* view, int flags):
        # The page pool as a writable uint8 [num_pages, page_bytes] buffer: numpy and torch
        # views keep this object alive and counted, so close() can refuse to unmap under them.
        export_rows(self, view, flags, self, False, <Py_ssize_t*>&self._pool_shape[0],
                    <Py_ssize_t*>&self._pool_strides[0])

    def __releasebuffer__(self, Py_buffer* view):
        self.exports -= 1


cdef class PartPool:
    """The window parts' bytes of a segment as a writable uint8 [num_parts, part_bytes]
    buffer (empty without parts). Each view counts as one of the segment's exports, so its
    close() refuses to unmap under a live view, as for the page pool."""

    cdef Segment segment
    cdef Py_ssize_t shape[2]
    cdef Py_ssize_t strides[2]

    def __cinit__(self, Segment segment not None):
        self.segment = segment

    def __getbuffer__(self, Py_buffer* view, int flags):
        cdef Segment seg = self.segment
        export_rows(seg, view, flags, self, True, &self.shape[0], &self.strides[0])

    def __releasebuffer__(self, Py_buffer* view):
        self.segment.exports -= 1


cdef int export_rows(Segment seg, Py_buffer* view, int flags, object owner, bint parts,
                     Py_ssize_t* shape, Py_ssize_t* strides) except -1:
    """Fills view with the page pool (or, with parts, the part pool) as writable uint8
    [rows, row bytes], owned by owner (whose __releasebuffer__ gives the export back), and
    counts the export. The header is read only once the segment is known to be mapped."""
    cdef int64_t offset, rows, row_bytes
    if seg.closed or seg.closing:
        raise ValueError("the segment is closed")
    check_shape(seg)
    if parts:
        offset = seg.hdr.hdr_regions.reg_part_pool
        rows = seg.hdr.hdr_config.cfg_num_parts
        row_bytes = seg.hdr.hdr_config.cfg_part_bytes
    else:
        offset = seg.hdr.hdr_regions.reg_pool
        rows = seg.hdr.hdr_config.cfg_num_pages
        row_bytes = seg.hdr.hdr_config.cfg_page_bytes
    seg.exports += 1
    shape[0] = rows
    shape[1] = row_bytes
    strides[0] = row_bytes
    strides[1] = 1
    view.buf = seg.base + offset
    view.obj = owner
    view.len = rows * row_bytes
    view.readonly = 0
    view.itemsize = 1
    view.format = NULL
    if flags & PyBUF_FORMAT:
        view.format = b"B"
    view.ndim = 2
    view.shape = shape
    view.strides = strides
    view.suboffsets = NULL
    view.internal = NULL
    return 0
