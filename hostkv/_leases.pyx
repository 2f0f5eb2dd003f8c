# cython: language_level=3, embedsignature=True
"""Robust mutexes and the lease thread: the layer below the segment's lock and its leases.

Every mutex hostkv keeps in a segment is robust, process-shared, of normal type and without
a priority protocol (init_robust_mutex); glibc believes the kind word stored in it at every
lock, so one read from a segment someone else wrote is checked first (mutex_kind_problem).
"""

import os

from libc.stdint cimport int32_t, int64_t
from libc.stdlib cimport calloc, free

from hostkv._layout cimport HkvLease, HKV_LEASE_ACTIVE, HKV_LEASE_FREE
from hostkv.includes.system cimport *

from hostkv.errors import os_error


cdef int LOCK_SPINS = 400        # ~10 us of pause instructions before blocking
# How long a locker gives way to a waiter its own process's last unlock woke (await_handoff):
# a woken thread runs within tens of microseconds, even on a loaded two-core machine.
cdef int64_t HANDOFF_BOUND_NS = 1_000_000


# ---------------------------------------------------------------------------------------------
# Fork: a child never uses its parent's lease (the parent's lease thread holds that slot, and
# is not in the child). A handle notes the epoch it took its lease in; another epoch means it
# was inherited through a fork.

cdef long _fork_epoch = 0


cdef long fork_epoch() noexcept:
    """How many forks this process's line has gone through since it imported hostkv."""
    return _fork_epoch


def _after_fork_in_child():
    global _fork_epoch
    _fork_epoch += 1


os.register_at_fork(after_in_child=_after_fork_in_child)


# ---------------------------------------------------------------------------------------------
# Robust mutexes


cdef int init_robust_mutex(pthread_mutex_t* mutex) except -1:
    """Initialises a robust, process-shared, normal-type mutex without priority inheritance."""
    cdef pthread_mutexattr_t attr
    cdef int rc = pthread_mutexattr_init(&attr)
    if rc == 0:
        rc = pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED)
    if rc == 0:
        rc = pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST)
    if rc == 0:
        rc = pthread_mutexattr_settype(&attr, PTHREAD_MUTEX_NORMAL)
    if rc == 0:
        rc = pthread_mutexattr_setprotocol(&attr, PTHREAD_PRIO_NONE)
    if rc == 0:
        rc = pthread_mutex_init(mutex, &attr)
    pthread_mutexattr_destroy(&attr)
    if rc != 0:
        raise os_error(rc, "pthread_mutex_init")
    return 0


cdef int reference_mutex_kind() except? -2:
    """The kind word init_robust_mutex writes (-1 where the libc's layout is unknown)."""
    cdef pthread_mutex_t m
    cdef int kind
    init_robust_mutex(&m)
    kind = hkv_mutex_kind(&m)
    pthread_mutex_destroy(&m)
    return kind


cdef int _mutex_kind = reference_mutex_kind()
MUTEX_KIND = _mutex_kind                     # for tests: what every segment mutex must say
MUTEX_KIND_OFFSET = HKV_MUTEX_KIND_OFFSET    # ... at this byte offset in pthread_mutex_t


cdef str mutex_kind_problem(pthread_mutex_t* m, str what):
    """What is wrong with a mutex whose kind word is not the one hostkv writes (None: nothing,
    or a libc whose layout is unknown): to be checked before every lock of a segment mutex,
    since glibc trusts it."""
    cdef int kind
    if _mutex_kind == -1:
        return None
    kind = hkv_mutex_kind(m)
    if kind != _mutex_kind:
        return (f"{what} has mutex kind {kind:#x}, not {_mutex_kind:#x} (robust, process-shared, "
                "normal type, no priority protocol): refusing to lock it")
    return None


cdef int lock_contended(pthread_mutex_t* m, int64_t timeout_ns, bint* slept) noexcept nogil:
    """Locks m, which a trylock found taken, within timeout_ns; returns pthread's answer
    (ETIMEDOUT at the bound, EOWNERDEAD for a dead holder's). Sets slept[0] when it waited
    in the kernel rather than spinning.

    Holds are a few microseconds: it spins that long before sleeping in the kernel, whose
    wake-up costs more than the wait (glibc's adaptive mutexes do the same, but cannot be
    robust). The deadline is on CLOCK_MONOTONIC: a wall-clock jump must not stretch or cut
    the wait (see hkv_mutex_lock_until)."""
    cdef int rc = EBUSY, spins
    cdef int64_t deadline_ns
    cdef timespec deadline
    slept[0] = False
    for spins in range(LOCK_SPINS):
        cpu_relax()
        rc = pthread_mutex_trylock(m)
        if rc != EBUSY:
            return rc
    slept[0] = True
    deadline_ns = now_ns(CLOCK_MONOTONIC) + timeout_ns
    deadline.tv_sec = deadline_ns // 1_000_000_000
    deadline.tv_nsec = deadline_ns % 1_000_000_000
    rc = hkv_mutex_lock_until(m, &deadline)
    while rc == EINTR:
        rc = hkv_mutex_lock_until(m, &deadline)
    return rc


cdef void await_handoff(pthread_mutex_t* m) noexcept nogil:
    """Gives way, at most HANDOFF_BOUND_NS, until someone holds m: called before locking m
    by a process whose last unlock of m woke a sleeping waiter.

    glibc's mutexes let a newcomer take a just-freed lock before the waiter the unlock woke
    runs (barging). A thread that calls the core back to back then takes the lock every
    time, and a waiter in another thread or process can starve until its timeout: a thread
    polling check() made three others of its process time out after 10 s. Yielding the
    core until the woken waiter has the lock ends that; the bound keeps a waiter that
    timed out or died meanwhile from stalling anyone."""
    cdef int64_t deadline_ns = now_ns(CLOCK_MONOTONIC) + HANDOFF_BOUND_NS
    while not hkv_mutex_is_held(m) and now_ns(CLOCK_MONOTONIC) < deadline_ns:
        sched_yield()


cdef int probe_mutex(pthread_mutex_t* m) noexcept nogil:
    """Whether a lease mutex's process lives: EBUSY (it holds the mutex), else pthread's
    answer to a trylock, the mutex left unheld (0 or EOWNERDEAD: the holder is gone).

    Probing an owner-dead mutex takes it for an instant, marks it consistent and lets go:
    a slot found so is treated as dead either way, so nothing else changes."""
    cdef int rc = pthread_mutex_trylock(m)
    if rc == EBUSY:
        return rc
    if rc == EOWNERDEAD:
        pthread_mutex_consistent(m)
    if rc == 0 or rc == EOWNERDEAD:
        pthread_mutex_unlock(m)
    return rc


# ---------------------------------------------------------------------------------------------
# The lease thread: holds this process's lease mutex for as long as the process lives.
#
# A robust mutex is owned by the thread that locked it and turns owner-dead when that thread
# exits, so the lease cannot be held by whichever Python thread happened to attach: one
# dedicated C thread takes it and blocks until told to let go.

cdef void* lease_thread_main(void* arg) noexcept nogil:
    cdef LeaseHolder* h = <LeaseHolder*>arg
    cdef int rc
    pthread_mutex_lock(&h.mutex)
    while True:
        while h.command == LEASE_IDLE:
            pthread_cond_wait(&h.cond, &h.mutex)
        if h.command == LEASE_TAKE:
            rc = pthread_mutex_trylock(h.target)
            if rc == EOWNERDEAD:
                # The slot's previous owner died after its lease was released or before it
                # was recorded: nothing else guards this mutex, so it is simply ours now.
                rc = pthread_mutex_consistent(h.target)
            h.holding = rc == 0
            h.result = rc
        elif h.command == LEASE_DROP or h.command == LEASE_EXIT:
            if h.holding:
                pthread_mutex_unlock(h.target)
                h.holding = False
            h.result = 0
        if h.command == LEASE_EXIT:
            h.command = LEASE_IDLE
            pthread_cond_broadcast(&h.cond)
            pthread_mutex_unlock(&h.mutex)
            return NULL
        h.command = LEASE_IDLE
        pthread_cond_broadcast(&h.cond)


cdef int lease_call(LeaseHolder* h, int command, pthread_mutex_t* target) noexcept nogil:
    """Has the lease thread carry out a LeaseCommand (on target, unless NULL: the last one)
    and waits for its answer."""
    cdef int rc
    pthread_mutex_lock(&h.mutex)
    if target != NULL:
        h.target = target
    h.command = command
    pthread_cond_broadcast(&h.cond)
    while h.command != LEASE_IDLE:
        pthread_cond_wait(&h.cond, &h.mutex)
    rc = h.result
    pthread_mutex_unlock(&h.mutex)
    return rc


cdef LeaseHolder* lease_holder_start() except NULL:
    cdef LeaseHolder* h = <LeaseHolder*>calloc(1, sizeof(LeaseHolder))
    cdef int rc
    if h == NULL:
        raise MemoryError()
    pthread_mutex_init(&h.mutex, NULL)
    pthread_cond_init(&h.cond, NULL)
    rc = pthread_create(&h.thread, NULL, lease_thread_main, h)
    if rc != 0:
        pthread_cond_destroy(&h.cond)
        pthread_mutex_destroy(&h.mutex)
        free(h)
        raise os_error(rc, "pthread_create (lease thread)")
    return h


cdef void lease_holder_stop(LeaseHolder* h) noexcept nogil:
    lease_call(h, LEASE_EXIT, NULL)
    pthread_join(h.thread, NULL)
    pthread_cond_destroy(&h.cond)
    pthread_mutex_destroy(&h.mutex)
    free(h)


cdef int take_lease_mutex(LeaseHolder* h, pthread_mutex_t* target) except -1:
    """Has the lease thread take a free slot's mutex; returns pthread's answer (0: taken)."""
    cdef int rc
    with nogil:
        rc = lease_call(h, LEASE_TAKE, target)
    if rc == ENOTRECOVERABLE:
        # A free slot whose mutex a failed sweep left unrecoverable: nobody can be waiting
        # on it (only trylock touches lease mutexes), so start afresh.
        init_robust_mutex(target)
        with nogil:
            rc = lease_call(h, LEASE_TAKE, target)
    return rc


# ---------------------------------------------------------------------------------------------
# The lease table, read

cdef list lease_list(HkvLease* table, int32_t num_slots):
    """(slot, state, pid, generation, registered_ns) of every used slot."""
    cdef HkvLease* lease
    cdef int32_t slot
    out = []
    for slot in range(num_slots):
        lease = table + slot
        if lease.ls_state != HKV_LEASE_FREE:
            out.append((slot, lease.ls_state, lease.ls_pid, lease.ls_generation,
                        lease.ls_registered_ns))
    return out


cdef str lease_table_problem(HkvLease* table, int32_t num_slots, int32_t active_leases):
    """What is wrong with the lease table (None: nothing): a state that is neither free nor
    active, or a count of active slots other than the header's."""
    cdef HkvLease* lease
    cdef int32_t slot, active = 0
    for slot in range(num_slots):
        lease = table + slot
        if lease.ls_state == HKV_LEASE_ACTIVE:
            active += 1
        elif lease.ls_state != HKV_LEASE_FREE:
            return f"lease slot {slot} has state {lease.ls_state}"
    if active != active_leases:
        return f"{active} active lease slots, header counts {active_leases}"
    return None
