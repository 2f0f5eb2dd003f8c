# cython: language_level=3, embedsignature=True
"""The segment's lock and its undo log: what every mutation of shared state runs through.

SegmentLock takes the robust lock (spinning briefly, then waiting until a CLOCK_MONOTONIC
deadline), opens a mutation whose logged stores (_lock.pxd) it publishes with one store at
commit or rolls back at end, and counts the steps the crash tests kill a process at.
Segment (_segment.pyx) derives from it: recovery after a dead holder (_recover), the lease
sweep that begin() runs once a second (sweep_leases) and taking a lease again after a fork
(_after_fork) are Segment's, as are create, attach and close.
"""

import atexit

from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t
from libc.string cimport memcmp, memcpy

from hostkv._crash cimport CRASH_EXIT, armed_for_new_segments, crash_mode, crash_now
from hostkv._format cimport shape_problem, tables_problem
from hostkv._layout cimport *
from hostkv._leases cimport await_handoff, fork_epoch, lock_contended, mutex_kind_problem
from hostkv.includes.system cimport *

from hostkv.errors import CapacityError, CorruptionError, LockTimeoutError, os_error

SWEEP_INTERVAL_NS = 1_000_000_000
EXIT_LOCK_TIMEOUT = 0.1      # the most a lock waits once the interpreter is exiting
cdef int64_t EXIT_LOCK_TIMEOUT_NS = 100_000_000
cdef bint _exiting = False


def _at_exit():
    global _exiting
    _exiting = True


# Runs before the interpreter tears modules down (and with them the handles still open).
atexit.register(_at_exit)


cdef inline void record_duration(int64_t* histogram, int64_t* total, int64_t ns) noexcept nogil:
    """Counts a duration in its log2 bucket: bucket b holds [2^(b-1), 2^b) ns, 0 holds 0."""
    cdef int bucket = 0
    if ns > 0:
        bucket = 64 - count_leading_zeros(<uint64_t>ns)
        if bucket >= HKV_HISTOGRAM_BUCKETS:
            bucket = HKV_HISTOGRAM_BUCKETS - 1
    else:
        ns = 0
    histogram[bucket] += 1
    total[0] += ns


cdef int check_mutex(SegmentLock seg, pthread_mutex_t* m, str what) except -1:
    """Refuses (CorruptionError) a mutex whose kind word is not the one hostkv writes:
    checked before every lock of a segment mutex, since glibc trusts it."""
    problem = mutex_kind_problem(m, what)
    if problem is not None:
        seg.corrupt(problem)
    return 0


cdef int check_shape(SegmentLock seg) except -1:
    """Checks the header fields that every bounds check rests on, before anything trusts
    them (_format.shape_problem, tables_problem). Runs at every lock and in the unlocked
    readers: a few dozen integer operations, no loop over the segment.

    The config and region offsets last found sound are kept: equal bytes need no
    recomputing at every lock. Threads of one process can share them because it holds the
    GIL throughout and only ever stores bytes equal to a header it has just validated."""
    cdef HkvHeader* hdr = seg.hdr
    cdef HkvRegions regions
    if not (seg.shape_checked and memcmp(&hdr.hdr_config, &seg.shape_config, sizeof(HkvConfig)) == 0
            and memcmp(&hdr.hdr_regions, &seg.shape_regions, sizeof(HkvRegions)) == 0):
        seg.shape_checked = False
        problem = shape_problem(hdr, seg.size, seg.undo_capacity)
        if problem is not None:
            seg.corrupt(problem)
        memcpy(&seg.shape_config, &hdr.hdr_config, sizeof(HkvConfig))
        memcpy(&seg.shape_regions, &hdr.hdr_regions, sizeof(HkvRegions))
        seg.shape_checked = True
    memcpy(&regions, &seg.shape_regions, sizeof(HkvRegions))     # as checked, not as now
    problem = tables_problem(seg.base, hdr, &regions)
    if problem is not None:
        seg.corrupt(problem)
    return 0


# ---------------------------------------------------------------------------------------------
# The lock

cdef class SegmentLock:
    """A handle's lock on its segment and the undo log of its open mutation (every field of
    a handle is here: see _lock.pxd). Not made on its own: Segment is the handle.
    """

    def __cinit__(self):
        cdef int64_t step
        cdef int mode
        self.base = NULL
        self.hdr = NULL
        self.closed = True
        self.lease_slot = -1
        self.fd = -1
        self.lease_holder = NULL
        self.crash_countdown = 0
        self.crash_mode = CRASH_EXIT
        self.exports = 0
        self.hash_mask = <uint64_t>-1
        if armed_for_new_segments(&step, &mode):
            # Test-only (see _arm_new_segments): crashing inside create, attach or
            # recovery, before a caller could arm the handle itself.
            self.crash_mode = mode
            self.crash_countdown = step

    cdef int begin(self) except -1:
        """Takes the lock and opens a mutation; recovers first if the last holder died.

        Counts the call as in flight until end(), so that close() in another thread waits
        for it instead of unmapping under it."""
        cdef pthread_t me = pthread_self()
        if self.closed:
            raise ValueError("the segment is closed")
        if self.fork_epoch != fork_epoch():
            self._after_fork()
        if self.closing and not pthread_equal(self.closing_thread, me):
            raise ValueError("the segment is closed (another thread is closing it)")
        # Threads of this process serialise on the mutex like processes do (the kernel
        # tracks the owning thread); only the thread that holds it must not lock it again:
        # a normal-type mutex would deadlock, and an error-checking one breaks across PID
        # namespaces (see _layout.pxd). All of this object's fields are written under the
        # GIL, so the owner test below sees either this thread's own write or another's.
        if self.locked and pthread_equal(self.lock_owner, me):
            raise RuntimeError("hostkv segment lock is not re-entrant: this thread holds it")
        self.in_flight += 1
        try:
            self._acquire()
        except BaseException:
            self.in_flight -= 1
            raise
        return 0

    cdef int _acquire(self) except -1:
        """begin()'s work: lock, recover, sweep when due. Raises with the lock not held."""
        cdef int rc
        cdef int64_t wait_start, timeout_ns
        cdef bint waited, gave_way, slept = False
        check_mutex(self, &self.hdr.hdr_mutex, "the segment lock")
        wait_start = now_ns(CLOCK_MONOTONIC)
        gave_way = self.handoff_due
        if gave_way:
            self.handoff_due = False
            with nogil:
                await_handoff(&self.hdr.hdr_mutex)
        rc = pthread_mutex_trylock(&self.hdr.hdr_mutex)
        waited = rc == EBUSY or gave_way
        timeout_ns = self.lock_timeout_ns
        if _exiting and timeout_ns > EXIT_LOCK_TIMEOUT_NS:
            # The interpreter is exiting (closing what is left open): a process that
            # cannot give its lease back at once leaves it to the next sweep, as a death
            # would, rather than stall its exit for the full timeout.
            timeout_ns = EXIT_LOCK_TIMEOUT_NS
        if rc == EBUSY:
            with nogil:
                rc = lock_contended(&self.hdr.hdr_mutex, timeout_ns, &slept)
        if rc == ETIMEDOUT:
            raise LockTimeoutError(
                f"segment {self.name!r}: lock not acquired within "
                f"{timeout_ns / 1e9:g} s; another process holds it (stopped or stuck)")
        if rc == ENOTRECOVERABLE:
            raise CorruptionError(
                f"segment {self.name!r}: an earlier recovery failed; the segment is unusable, "
                "unlink it and create it again")
        if rc != 0 and rc != EOWNERDEAD:
            raise os_error(rc, "lock segment", self.name)
        self.locked = True
        self.lock_owner = pthread_self()
        self.took_asleep = slept
        # Taken at the first try: no wait to time (and one clock read fewer a lock).
        self.locked_at_ns = now_ns(CLOCK_MONOTONIC) if waited else wait_start
        record_duration(self.metrics.mt_lock_wait_histogram, &self.metrics.mt_lock_wait_ns,
                        self.locked_at_ns - wait_start)
        self.metrics.mt_lock_acquisitions += 1
        if rc == EOWNERDEAD:
            # The holder died mid-mutation. Roll it back, re-derive, and only then say the
            # state is consistent. If that fails, the segment is marked corrupt, so that every
            # later locker gets CorruptionError from the state word. The mutex is not left
            # ENOTRECOVERABLE: glibc's pthread_mutex_trylock (2.36) returns ENOTRECOVERABLE
            # with the lock word still taken, so the locker after that one would wait for a
            # lock nobody holds (LockTimeoutError) instead of hearing CorruptionError
            # (found by tests/test_corruption.py).
            try:
                self._recover(True)
            except BaseException:
                self.hdr.hdr_state = HKV_STATE_CORRUPT
                pthread_mutex_consistent(&self.hdr.hdr_mutex)
                self.locked = False
                pthread_mutex_unlock(&self.hdr.hdr_mutex)
                raise
            pthread_mutex_consistent(&self.hdr.hdr_mutex)
        try:
            check_shape(self)
            if self.hdr.hdr_state != HKV_STATE_READY:
                raise CorruptionError(f"segment {self.name!r} is marked corrupt; unlink it")
            if self.hdr.hdr_undo_count != 0:
                self._recover(True)
            self._start_undo_log()
            self.reaped_by_begin = 0
            # The stamp is this handle's own: CLOCK_MONOTONIC differs between time
            # namespaces, so it is never compared with another process's.
            if not self.observer and self.locked_at_ns - self.last_sweep_ns > SWEEP_INTERVAL_NS:
                self.reaped_by_begin = self.sweep_leases()
                self.commit()
        except BaseException:
            self._unlock()      # rolls back a half-done sweep and unlocks
            raise
        return 0

    cdef int _start_undo_log(self) except -1:
        """Starts this holder's undo log at its home in the ring: lease slot k's home is
        entry (k + 1) * capacity / (max_processes + 1), rounded to a cache line; handles
        without a lease start at 0. Two processes taking turns at the lock then write their
        own logs' cache lines, not each other's (the log was half of the lines a request
        wrote). Called with the lock held and the log empty, so a death right
        here leaves nothing to replay, wherever the start points."""
        cdef int64_t stride = (self.undo_capacity // (self.hdr.hdr_config.cfg_max_processes + 1)) & ~(<int64_t>3)
        cdef int64_t home = 0
        if self.lease_slot >= 0:
            home = (self.lease_slot + 1) * stride
            if home >= self.undo_capacity:
                home = 0
        self.hdr.hdr_undo_start = <int32_t>home
        self.undo_start = home
        self.num_freed_slabs = 0
        return 0

    cdef int commit(self) except -1:
        """Publishes the open mutation: its last logged store, then the log cleared."""
        log_store_i64(self, <int64_t*>&self.hdr.hdr_generation, <int64_t>self.hdr.hdr_generation + 1)
        if self.crash_countdown > 0:
            self.crash_point()
        hkv_compiler_barrier()
        self.hdr.hdr_undo_count = 0
        self.num_freed_slabs = 0
        return 0

    cdef void end(self) noexcept:
        """Rolls back what is not committed, then unlocks. Safe to call in any state: a
        thread that does not hold the lock changes nothing."""
        if not self.locked or not pthread_equal(self.lock_owner, pthread_self()):
            return
        self._unlock()
        self.in_flight -= 1

    cdef void _unlock(self) noexcept:
        """Rolls back what is not committed, then unlocks (the caller holds the lock)."""
        if self.hdr.hdr_undo_count != 0:
            try:
                self._recover(False)
            except BaseException:
                # Rollback itself found the segment unusable: mark it, so that nobody works
                # on it again. The exception that brought us here is the one the caller sees.
                self.hdr.hdr_state = HKV_STATE_CORRUPT
        record_duration(self.metrics.mt_lock_hold_histogram, &self.metrics.mt_lock_hold_ns,
                        now_ns(CLOCK_MONOTONIC) - self.locked_at_ns)
        self.locked = False
        # A holder that slept for the lock finds the waiters bit set by glibc itself (it
        # cannot know whether others still sleep): only a lock taken without sleeping,
        # by a locker that came later than a sleeper, hands off.
        self.handoff_due = (not self.took_asleep
                            and hkv_mutex_has_sleepers(&self.hdr.hdr_mutex))
        pthread_mutex_unlock(&self.hdr.hdr_mutex)

    cdef int rollback_to(self, int64_t mark) except -1:
        """Undoes the open mutation's stores made since savepoint `mark` (a log position),
        keeping the earlier ones: an all-or-nothing step inside a larger mutation."""
        cdef int64_t i = self.hdr.hdr_undo_count - 1
        cdef HkvUndoEntry* entry
        cdef uint64_t where, width
        if mark < 0 or mark > self.hdr.hdr_undo_count:
            self.corrupt(f"savepoint {mark} outside the undo log [0, {self.hdr.hdr_undo_count}]")
        while i >= mark:
            entry = undo_entry(self, i)
            where = entry.ue_where & HKV_UNDO_OFFSET_MASK
            width = entry.ue_where >> HKV_UNDO_WIDTH_SHIFT
            if width == 4:
                (<uint32_t*>(self.base + where))[0] = <uint32_t>entry.ue_old
            else:
                (<uint64_t*>(self.base + where))[0] = entry.ue_old
            hkv_compiler_barrier()
            self.hdr.hdr_undo_count = i     # each undone entry leaves the log at once
            i -= 1
        return 0

    cdef int corrupt(self, str what) except -1:
        raise CorruptionError(f"segment {self.name!r}: {what}")

    cdef int undo_full(self) except -1:
        raise CapacityError(
            f"segment {self.name!r}: this operation needs more than the undo log's "
            f"{self.undo_capacity} entries; split the batch or raise undo_log_capacity",
            resource="undo log", needed=self.undo_capacity + 1, available=self.undo_capacity)

    cdef int sweep_leases(self) except -1:
        """Frees the leases of dead processes and what they held; returns how many. begin()
        runs it once a second. Segment (_segment.pyx), which owns the lease table, does the
        sweeping: a SegmentLock alone has nothing to sweep."""
        return 0

    # -- crash points and other test hooks -----------------------------------------------------

    cdef int crash_point(self) except -1:
        """Counts a step of the open mutation; at the armed step, dies or raises (tests only)."""
        self.crash_countdown -= 1
        if self.crash_countdown != 0:
            return 0
        return crash_now(self.crash_mode)

    def _arm_crash_point(self, long step, str mode="exit"):
        """Test hook: at the `step`-th logged store or commit from now, _exit or raise.

        mode is "exit" (the process dies with status 77), "keyboard_interrupt" or
        "memory_error". step 0 disarms.
        """
        cdef int parsed = crash_mode(mode)
        if step < 0:
            raise ValueError(f"crash step must be >= 0, got {step}")
        self.crash_mode = parsed
        self.crash_countdown = step

    def _make_sweep_due(self):
        """Test hook: this handle's next lock sweeps the lease table (as a second after
        its last sweep would)."""
        self.last_sweep_ns = 0

    def _set_hash_mask(self, uint64_t mask):
        """Test hook: page hashes are ANDed with mask in this process (0: all collide)."""
        self.hash_mask = mask

    @property
    def crash_steps_left(self):
        """Steps left before an armed crash point fires (0: disarmed or already fired)."""
        return self.crash_countdown

    # -- calls ---------------------------------------------------------------------------------

    def run_locked(self, fn, *args):
        """Calls fn(*args) holding the lock as a read-only step (no mutation is opened)."""
        self.begin()
        try:
            return fn(*args)
        finally:
            self.end()

    def _check_open(self):
        if self.closed:
            raise ValueError("the segment is closed")
