# cython: language_level=3, embedsignature=True
"""The shared-memory segment: create, attach, map, the robust lock, the undo log, leases.

The memory map is in _layout.pxd. This module owns the header and the lease table; the page
pool (_pages) and later layers register hooks that recovery and the lease sweep call, so this
layer needs to know nothing of theirs.
"""

import atexit
import math
import numbers
import os
import re
import time

import posix_ipc

from cpython.buffer cimport PyBUF_WRITABLE, PyBUF_ND, PyBUF_STRIDES, PyBUF_FORMAT
from cpython.bytes cimport PyBytes_FromStringAndSize
from libc.errno cimport errno
from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free
from libc.string cimport memcmp, memcpy, memset

from hostkv._layout cimport *
from hostkv.includes.system cimport *

from hostkv.errors import (
    CapacityError,
    CorruptionError,
    ForeignSegmentError,
    IncompatibleSegmentError,
    LockTimeoutError,
    SegmentFormatError,
    os_error,
    translate_posix_ipc,
)
from hostkv.config import DTYPE_CODES, KV_KINDS


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
# Fork: a child never uses its parent's lease (the parent's lease thread holds that slot).

cdef long _fork_epoch = 0


def _after_fork_in_child():
    global _fork_epoch
    _fork_epoch += 1


os.register_at_fork(after_in_child=_after_fork_in_child)


# ---------------------------------------------------------------------------------------------
# Crash points for new handles (tests only)
#
# The crash tests kill a process at every step of create, attach and recovery too, which run
# before a caller holds the handle to arm it. They used to arm every new handle through an
# environment variable, which any process honoured: a stray HOSTKV_CRASH_AT could make a
# production process _exit (issue 10). Now only a call in the process itself arms them; no
# environment variable is read, and a process that never calls this never crashes on purpose.

_arm_new_segments_at = None


def _arm_new_segments(long step, str mode="exit"):
    """Test hook: every Segment made from now on in this process is armed as by
    _arm_crash_point(step, mode), counted from its first logged store. step 0 disarms."""
    global _arm_new_segments_at
    if mode not in ("exit", "keyboard_interrupt", "memory_error"):
        raise ValueError(f"crash mode must be exit, keyboard_interrupt or memory_error, got {mode!r}")
    if step < 0:
        raise ValueError(f"crash step must be >= 0, got {step}")
    _arm_new_segments_at = (step, mode) if step else None


# ---------------------------------------------------------------------------------------------
# Names, time, mutexes

_NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,200}")
SEGMENT_MODE = 0o600
DEFAULT_LOCK_TIMEOUT = 10.0
# Creating a segment reserves all of its memory (posix_fallocate; ~5.7 GB/s on tmpfs was
# measured, issue 10): the README's 65,536 x 2 MiB pool takes ~23 s. Attachers wait up to
# this long for a creator that is still at it: 120 s covers a pool of ~600 GB.
DEFAULT_READY_TIMEOUT = 120.0
RESERVE_CHUNK = 256 << 20    # the creator publishes its progress after each chunk
SWEEP_INTERVAL_NS = 1_000_000_000
# The madvise(2) advice that Segment.advise_pool takes, by name (values from linux/mman.h).
MADV = {"MADV_WILLNEED": MADV_WILLNEED, "MADV_HUGEPAGE": MADV_HUGEPAGE,
        "MADV_POPULATE_READ": MADV_POPULATE_READ, "MADV_POPULATE_WRITE": MADV_POPULATE_WRITE}
cdef int LOCK_SPINS = 400        # ~10 us of pause instructions before blocking
EXIT_LOCK_TIMEOUT = 0.1      # the most a lock waits once the interpreter is exiting
cdef int64_t EXIT_LOCK_TIMEOUT_NS = 100_000_000
cdef bint _exiting = False


def _at_exit():
    global _exiting
    _exiting = True


# Runs before the interpreter tears modules down (and with them the handles still open).
atexit.register(_at_exit)


cdef extern from *:
    """
    #include <pthread.h>
    #include <time.h>
    /* Locks m, waiting until the CLOCK_MONOTONIC deadline at most. glibc 2.30+ has
       pthread_mutex_clocklock; before it, the remaining time is turned into a
       CLOCK_REALTIME deadline (a wall-clock jump during the wait then still moves it). */
    static int hkv_mutex_lock_until(pthread_mutex_t* m, const struct timespec* deadline) {
    #if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 30))
        return pthread_mutex_clocklock(m, CLOCK_MONOTONIC, deadline);
    #else
        struct timespec now, real;
        long long left;
        clock_gettime(CLOCK_MONOTONIC, &now);
        left = (long long)(deadline->tv_sec - now.tv_sec) * 1000000000LL
               + (deadline->tv_nsec - now.tv_nsec);
        if (left < 0) left = 0;
        clock_gettime(CLOCK_REALTIME, &real);
        left += real.tv_nsec;
        real.tv_sec += left / 1000000000LL;
        real.tv_nsec = left % 1000000000LL;
        return pthread_mutex_timedlock(m, &real);
    #endif
    }
    """
    int hkv_mutex_lock_until(pthread_mutex_t* m, const timespec* deadline) noexcept nogil
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


cdef inline int64_t now_ns(int clock) noexcept nogil:
    cdef timespec ts
    clock_gettime(clock, &ts)
    return <int64_t>ts.tv_sec * 1_000_000_000 + ts.tv_nsec


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


cdef extern from *:
    """
    #include <stddef.h>
    /* The mutex's kind word: its type, robust, priority-protocol and process-shared bits.
       glibc keeps it in __data.__kind and believes it at every lock: another kind read from
       a segment someone else wrote (PRIO_PROTECT, 0x40, aborts glibc; 0-3 or 0x20/0x30
       make a lock that is not robust or uses priority inheritance) is refused instead. */
    #ifdef __GLIBC__
    static inline int hkv_mutex_kind(pthread_mutex_t* m) {
        return __atomic_load_n(&m->__data.__kind, __ATOMIC_RELAXED);
    }
    #define HKV_MUTEX_KIND_OFFSET ((int)offsetof(pthread_mutex_t, __data.__kind))
    #else
    static inline int hkv_mutex_kind(pthread_mutex_t* m) { (void)m; return -1; }
    #define HKV_MUTEX_KIND_OFFSET (-1)
    #endif
    """
    int hkv_mutex_kind(pthread_mutex_t* m) noexcept nogil
    int HKV_MUTEX_KIND_OFFSET


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


cdef int check_mutex(Segment seg, pthread_mutex_t* m, str what) except -1:
    """Refuses (CorruptionError) a mutex whose kind word is not the one hostkv writes:
    checked before every lock of a segment mutex, since glibc trusts it."""
    cdef int kind
    if _mutex_kind == -1:
        return 0
    kind = hkv_mutex_kind(m)
    if kind != _mutex_kind:
        seg.corrupt(
            f"{what} has mutex kind {kind:#x}, not {_mutex_kind:#x} (robust, process-shared, "
            "normal type, no priority protocol): refusing to lock it")
    return 0


# ---------------------------------------------------------------------------------------------
# The lease thread: holds this process's lease mutex for as long as the process lives.
#
# A robust mutex is owned by the thread that locked it and turns owner-dead when that thread
# exits, so the lease cannot be held by whichever Python thread happened to attach: one
# dedicated C thread takes it and blocks until told to let go.

cdef enum LeaseCommand:
    LEASE_IDLE = 0
    LEASE_TAKE = 1          # trylock target; owner-dead counts as taken (after consistent)
    LEASE_DROP = 2          # unlock target, keep running
    LEASE_EXIT = 3          # unlock target if held, then exit

ctypedef struct LeaseHolder:
    pthread_mutex_t mutex
    pthread_cond_t cond
    int command
    int result
    bint holding
    pthread_mutex_t* target
    pthread_t thread


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


# ---------------------------------------------------------------------------------------------
# The layout: where each region goes for a given config.

cdef inline int64_t align_up(int64_t value, int64_t alignment) noexcept nogil:
    return (value + alignment - 1) // alignment * alignment


cdef int64_t radix_table_capacity(int64_t node_capacity) noexcept nogil:
    """The child hash table's slots: a power of two at least twice the node capacity, so
    linear probing stays short (load factor <= 1/2)."""
    cdef int64_t capacity = 16
    while capacity < 2 * node_capacity:
        capacity *= 2
    return capacity


cdef int compute_regions(const HkvConfig* cfg, HkvRegions* out) except -1:
    """Lays the regions out one after another. Both create and attach call this."""
    cdef int64_t at = align_up(sizeof(HkvHeader), HKV_CACHE_LINE)
    memset(out, 0, sizeof(HkvRegions))
    out.reg_leases = at
    at = align_up(at + <int64_t>cfg.cfg_max_processes * sizeof(HkvLease), HKV_CACHE_LINE)
    out.reg_metrics = at
    at = align_up(at + sizeof(HkvMetrics), HKV_CACHE_LINE)
    out.reg_undo = at
    at = align_up(at + <int64_t>cfg.cfg_undo_log_capacity * sizeof(HkvUndoEntry), HKV_CACHE_LINE)
    out.reg_page_refcounts = at
    at = align_up(at + cfg.cfg_num_pages * 4, HKV_CACHE_LINE)
    out.reg_page_free_stack = at
    at = align_up(at + cfg.cfg_num_pages * 4, HKV_CACHE_LINE)
    out.reg_page_tokens = at
    at = align_up(at + cfg.cfg_num_pages * cfg.cfg_page_size * 4, HKV_CACHE_LINE)
    out.reg_page_next = at
    at = align_up(at + cfg.cfg_num_pages * 4, HKV_CACHE_LINE)
    out.reg_radix_nodes = at
    at = align_up(at + sizeof(HkvSlab) + <int64_t>cfg.cfg_radix_node_capacity * sizeof(HkvRadixNode),
                  HKV_CACHE_LINE)
    out.reg_radix_table = at
    at = align_up(at + radix_table_capacity(cfg.cfg_radix_node_capacity) * 4, HKV_CACHE_LINE)
    out.reg_radix_heap = at
    at = align_up(at + <int64_t>cfg.cfg_radix_node_capacity * 4, HKV_CACHE_LINE)
    out.reg_sequences = at
    at = align_up(at + sizeof(HkvSlab) + <int64_t>cfg.cfg_max_sequences * sizeof(HkvSequence),
                  HKV_CACHE_LINE)
    out.reg_sequence_pages = at
    at = align_up(at + sizeof(HkvSlab)
                  + <int64_t>cfg.cfg_sequence_page_node_capacity * sizeof(HkvSeqPage), 4096)
    out.reg_pool = at
    out.reg_total_size = at + cfg.cfg_num_pages * cfg.cfg_page_bytes
    return 0


cdef int check_shape(Segment seg) except -1:
    """Checks the header fields that every bounds check rests on, before anything trusts
    them: the config is sane, the region offsets are the ones it implies and end where the
    mapping ends, and the tables' fixed sizes match it. None of these changes after create,
    so a difference is corruption. Runs at every lock and in the unlocked readers (a few
    dozen integer operations, no loop over the segment)."""
    cdef HkvHeader* hdr = seg.hdr
    cdef HkvConfig* c = &hdr.hdr_config
    cdef HkvRegions regions
    cdef HkvSlab* slab
    if not (seg.shape_checked and memcmp(c, &seg.shape_config, sizeof(HkvConfig)) == 0
            and memcmp(&hdr.hdr_regions, &seg.shape_regions, sizeof(HkvRegions)) == 0):
        seg.shape_checked = False
        if (c.cfg_num_pages <= 0 or c.cfg_num_pages >= 2**31 or c.cfg_page_size <= 0
                or c.cfg_page_size > 2**20 or c.cfg_page_bytes <= 0 or c.cfg_page_bytes >= 2**46
                or c.cfg_max_processes <= 0 or c.cfg_undo_log_capacity <= 0
                or c.cfg_radix_node_capacity < 0 or c.cfg_sequence_page_node_capacity < 0
                or c.cfg_max_sequences < 0 or c.cfg_num_pages * c.cfg_page_bytes >= 2**46
                or c.cfg_undo_log_capacity != seg.undo_capacity):
            seg.corrupt("the header's config is impossible or changed")
        compute_regions(c, &regions)
        if (memcmp(&regions, &hdr.hdr_regions, sizeof(HkvRegions)) != 0
                or regions.reg_total_size != <int64_t>seg.size):
            seg.corrupt("the header's region offsets disagree with its config or the mapping")
        memcpy(&seg.shape_config, c, sizeof(HkvConfig))
        memcpy(&seg.shape_regions, &hdr.hdr_regions, sizeof(HkvRegions))
        seg.shape_checked = True
    memcpy(&regions, &seg.shape_regions, sizeof(HkvRegions))     # as checked, not as now
    if hdr.hdr_radix.rt_table_capacity != radix_table_capacity(c.cfg_radix_node_capacity):
        seg.corrupt(f"child table capacity {hdr.hdr_radix.rt_table_capacity} disagrees with the config")
    slab = <HkvSlab*>(seg.base + regions.reg_radix_nodes)
    if slab.sl_capacity != c.cfg_radix_node_capacity or slab.sl_record_size != sizeof(HkvRadixNode):
        seg.corrupt("the radix node table's header disagrees with the config")
    slab = <HkvSlab*>(seg.base + regions.reg_sequences)
    if slab.sl_capacity != c.cfg_max_sequences or slab.sl_record_size != sizeof(HkvSequence):
        seg.corrupt("the sequence table's header disagrees with the config")
    slab = <HkvSlab*>(seg.base + regions.reg_sequence_pages)
    if (slab.sl_capacity != c.cfg_sequence_page_node_capacity
            or slab.sl_record_size != sizeof(HkvSeqPage)):
        seg.corrupt("the page-list table's header disagrees with the config")
    return 0


cdef HkvFormat expected_format() noexcept:
    cdef HkvFormat fmt
    memset(&fmt, 0, sizeof(fmt))
    fmt.fmt_layout_version = HKV_LAYOUT_VERSION
    fmt.fmt_byte_order = HKV_BYTE_ORDER_MARK
    fmt.fmt_pointer_size = sizeof(void*)
    fmt.fmt_mutex_size = sizeof(pthread_mutex_t)
    fmt.fmt_header_size = sizeof(HkvHeader)
    fmt.fmt_lease_size = sizeof(HkvLease)
    fmt.fmt_undo_entry_size = sizeof(HkvUndoEntry)
    fmt.fmt_slab_size = sizeof(HkvSlab)
    fmt.fmt_radix_node_size = sizeof(HkvRadixNode)
    fmt.fmt_sequence_size = sizeof(HkvSequence)
    fmt.fmt_metrics_size = sizeof(HkvMetrics)
    return fmt


cdef int check_format(name, HkvFormat* got_format) except -1:
    """IncompatibleSegmentError unless the segment's format word is this build's."""
    cdef dict got = got_format[0]
    cdef dict want = expected_format()
    for field in _FORMAT_FIELDS:
        if got[field] != want[field]:
            raise SegmentFormatError(
                f"segment {name!r} has another format: {field} is {got[field]}, "
                f"this hostkv expects {want[field]}")
    return 0


_FORMAT_FIELDS = ("fmt_layout_version", "fmt_byte_order", "fmt_pointer_size", "fmt_mutex_size",
                  "fmt_header_size", "fmt_lease_size", "fmt_undo_entry_size", "fmt_slab_size",
                  "fmt_radix_node_size", "fmt_sequence_size", "fmt_metrics_size")

# HostKVConfig field -> HkvConfig field. The KVLayout is stored as four fields.
_CONFIG_FIELDS = (
    ("num_pages", "cfg_num_pages"),
    ("page_size", "cfg_page_size"),
    ("page_bytes", "cfg_page_bytes"),
    ("enable_prefix_reuse", "cfg_enable_prefix_reuse"),
    ("prefix_min_reuse_pages", "cfg_prefix_min_reuse_pages"),
    ("prefix_min_store_pages", "cfg_prefix_min_store_pages"),
    ("radix_node_capacity", "cfg_radix_node_capacity"),
    ("sequence_page_node_capacity", "cfg_sequence_page_node_capacity"),
    ("max_sequences", "cfg_max_sequences"),
    ("max_processes", "cfg_max_processes"),
    ("undo_log_capacity", "cfg_undo_log_capacity"),
)


cdef HkvConfig config_to_c(object config) except *:
    """Packs a resolved HostKVConfig into the header's form."""
    cdef HkvConfig c
    memset(&c, 0, sizeof(c))
    values = {cname: int(getattr(config, pyname)) for pyname, cname in _CONFIG_FIELDS}
    layout = config.kv_layout
    if layout is not None:
        values.update(cfg_kv_num_layers=layout.num_layers, cfg_kv_num_kv_heads=layout.num_kv_heads,
                      cfg_kv_head_dim=layout.head_dim, cfg_kv_dtype_code=DTYPE_CODES[layout.dtype],
                      cfg_kv_kind=KV_KINDS[layout.kind])
    c.cfg_num_pages = values["cfg_num_pages"]
    c.cfg_page_bytes = values["cfg_page_bytes"]
    c.cfg_page_size = values["cfg_page_size"]
    c.cfg_enable_prefix_reuse = values["cfg_enable_prefix_reuse"]
    c.cfg_prefix_min_reuse_pages = values["cfg_prefix_min_reuse_pages"]
    c.cfg_prefix_min_store_pages = values["cfg_prefix_min_store_pages"]
    c.cfg_radix_node_capacity = values["cfg_radix_node_capacity"]
    c.cfg_sequence_page_node_capacity = values["cfg_sequence_page_node_capacity"]
    c.cfg_max_sequences = values["cfg_max_sequences"]
    c.cfg_max_processes = values["cfg_max_processes"]
    c.cfg_undo_log_capacity = values["cfg_undo_log_capacity"]
    c.cfg_kv_num_layers = values.get("cfg_kv_num_layers", 0)
    c.cfg_kv_num_kv_heads = values.get("cfg_kv_num_kv_heads", 0)
    c.cfg_kv_head_dim = values.get("cfg_kv_head_dim", 0)
    c.cfg_kv_dtype_code = values.get("cfg_kv_dtype_code", 0)
    c.cfg_kv_kind = values.get("cfg_kv_kind", 0)
    return c


# ---------------------------------------------------------------------------------------------
# The segment

cdef class Segment:
    """One mapping of a hostkv segment, with this process's lease on it.

    Use create() or attach(); close() gives the lease up and unmaps. Not for direct use by
    engines: HostKVCache wraps it.
    """

    def __cinit__(self):
        self.base = NULL
        self.hdr = NULL
        self.closed = True
        self.lease_slot = -1
        self.lease_holder = NULL
        self.crash_countdown = 0
        self.crash_mode = CRASH_EXIT
        self.exports = 0
        self.hash_mask = <uint64_t>-1
        if _arm_new_segments_at is not None:
            # Test-only (see _arm_new_segments): crashing inside create, attach or
            # recovery, before a caller could arm the handle itself.
            self._arm_crash_point(*_arm_new_segments_at)

    # -- opening ---------------------------------------------------------------------------

    @staticmethod
    def create(name, object config, lock_timeout=DEFAULT_LOCK_TIMEOUT):
        """Creates the segment `name` for a resolved HostKVConfig and attaches to it.

        Raises:
            ValueError: a bad name or timeout.
            SegmentExistsError: a segment of that name exists.
            SegmentError: the OS refused (ENOSPC when /dev/shm cannot hold it).
        """
        cdef Segment seg = Segment.__new__(Segment)
        cdef HkvConfig ccfg
        cdef HkvRegions regions
        posix_name = check_name(name)
        seg.lock_timeout_ns = <int64_t>(check_timeout("lock_timeout", lock_timeout) * 1e9)
        ccfg = config_to_c(config)
        compute_regions(&ccfg, &regions)
        try:
            shm = posix_ipc.SharedMemory(posix_name, posix_ipc.O_CREX, mode=SEGMENT_MODE)
        except posix_ipc.Error as exc:
            raise translate_posix_ipc(exc, "create segment", name, creating=True) from None
        try:
            try:
                seg._reserve(name, shm.fd, &ccfg, &regions)
            finally:
                shm.close_fd()
            seg._initialise(&ccfg, &regions)
            seg.last_sweep_ns = now_ns(CLOCK_MONOTONIC)    # nobody to reap in a new segment
            seg._register_lease()
        except BaseException:
            seg._stop_lease_holder()
            seg._unmap()
            try:
                shm.unlink()
            except posix_ipc.Error:
                pass
            raise
        return seg

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
        try:
            # size=0: posix_ipc resizes an existing segment to any non-zero size it is given.
            shm = posix_ipc.SharedMemory(posix_name, 0, size=0)
        except posix_ipc.Error as exc:
            raise translate_posix_ipc(exc, "attach segment", name, creating=False) from None
        try:
            st = os.fstat(shm.fd)
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
            size = seg._wait_ready(shm.fd, ready_seconds)
            seg._map(name, shm.fd, size)
        finally:
            shm.close_fd()
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
        self.fork_epoch = _fork_epoch

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

    cdef _reserve(self, name, int fd, HkvConfig* ccfg, HkvRegions* regions):
        """Writes the header's identity, sizes the segment, reserves its memory, maps it.

        The first bytes an attacher can see are a header that says what this is (magic,
        format, config, regions, creator pid) in state INITIALISING: pwrite extends the
        file only once the header's bytes are in it, so a segment of at least a header's
        size that does not start with the magic is not hostkv's, at once. Then the memory
        is reserved chunk by chunk (on a full /dev/shm this fails with ENOSPC here instead
        of a SIGBUS at the first touch of an unbacked page later), publishing the bytes
        reserved so far, so that an attacher that times out can say how far it got."""
        cdef HkvHeader first
        cdef int64_t at = 0, chunk, total = regions.reg_total_size
        cdef int rc
        memset(&first, 0, sizeof(HkvHeader))
        first.hdr_magic = HKV_MAGIC
        first.hdr_format = expected_format()
        first.hdr_config = ccfg[0]
        first.hdr_regions = regions[0]
        first.hdr_state = HKV_STATE_INITIALISING
        first.hdr_creator_pid = getpid()
        data = PyBytes_FromStringAndSize(<char*>&first, sizeof(HkvHeader))
        try:
            written = os.pwrite(fd, data, 0)
            if written != len(data):
                raise OSError(ENOSPC, "short write")
            os.ftruncate(fd, total)
        except OSError as exc:
            raise os_error(exc.errno or EINVAL, "write the header of segment", name) from None
        # Reserving chunk by chunk, unlike one posix_fallocate of the whole, would fill
        # memory before a too-big request fails (tmpfs refuses a single request larger than
        # the filesystem at once): refuse what cannot fit before reserving any of it.
        vfs = os.fstatvfs(fd)
        if vfs.f_blocks and total > vfs.f_bavail * vfs.f_frsize:
            raise os_error(ENOSPC, f"reserve {total} bytes for segment (only "
                           f"{vfs.f_bavail * vfs.f_frsize} free)", name)
        self._map(name, fd, total)
        while at < total:
            chunk = min(<int64_t>RESERVE_CHUNK, total - at)
            with nogil:
                rc = posix_fallocate(fd, at, chunk)
            if rc != 0:
                raise os_error(rc, f"reserve {total} bytes for segment", name)
            at += chunk
            hkv_store_release_i64(&self.hdr.hdr_reserved_bytes, at)

    cdef _initialise(self, HkvConfig* ccfg, HkvRegions* regions):
        """Writes a fresh header and tables. Nobody else reads them before state is READY."""
        cdef HkvHeader* hdr = self.hdr
        cdef int32_t* free_stack
        cdef HkvSlab* slab
        cdef int32_t* page_next
        cdef int64_t i, n = ccfg.cfg_num_pages
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
        # Every page starts free; popping from the top hands out pages 0, 1, 2, ...
        free_stack = <int32_t*>(self.base + regions.reg_page_free_stack)
        for i in range(n):
            free_stack[i] = <int32_t>(n - 1 - i)
        hdr.hdr_free_pages = n
        page_next = <int32_t*>(self.base + regions.reg_page_next)
        for i in range(n):
            page_next[i] = -2                  # not in the tree (see _radix.pxd)
        hdr.hdr_radix.rt_table_capacity = <int32_t>radix_table_capacity(ccfg.cfg_radix_node_capacity)
        memset(self.base + regions.reg_radix_table, 0xFF, hdr.hdr_radix.rt_table_capacity * 4)
        slab = <HkvSlab*>(self.base + regions.reg_radix_nodes)
        slab.sl_capacity = ccfg.cfg_radix_node_capacity
        slab.sl_record_size = sizeof(HkvRadixNode)
        slab = <HkvSlab*>(self.base + regions.reg_sequences)
        slab.sl_capacity = ccfg.cfg_max_sequences
        slab.sl_record_size = sizeof(HkvSequence)
        slab = <HkvSlab*>(self.base + regions.reg_sequence_pages)
        slab.sl_capacity = ccfg.cfg_sequence_page_node_capacity
        slab.sl_record_size = sizeof(HkvSeqPage)
        self._bind_regions()
        for i in range(_num_rederive_hooks):
            _rederive_hooks[i](self)
        hdr.hdr_magic = HKV_MAGIC
        __atomic_store_release_u32(&hdr.hdr_state, HKV_STATE_READY)

    cdef _bind_regions(self):
        self.metrics = <HkvMetrics*>(self.base + self.hdr.hdr_regions.reg_metrics)
        self.undo = <HkvUndoEntry*>(self.base + self.hdr.hdr_regions.reg_undo)
        self.undo_capacity = self.hdr.hdr_config.cfg_undo_log_capacity

    def _wait_ready(self, int fd, double timeout):
        """Waits until the segment is sized and READY; returns its size (to map).

        Reads the header with pread, so nothing is mapped before the creator has sized
        the segment. A creator between shm_open and writing its header leaves a segment
        shorter than a header: that is waited for. A header without the magic, or of
        another format, is refused at once: the creator writes those first.
        """
        cdef HkvHeader h
        cdef Py_ssize_t header_size = sizeof(HkvHeader)
        cdef uint32_t state = 0
        deadline = time.monotonic() + timeout
        delay = 0.0005
        first_reserved = None
        size = 0
        have_header = False
        while True:
            size = os.fstat(fd).st_size
            if size >= header_size:
                data = os.pread(fd, header_size, 0)
                if len(data) == header_size:
                    memcpy(&h, <char*>data, header_size)
                    have_header = True
                    if h.hdr_magic != HKV_MAGIC:
                        raise IncompatibleSegmentError(
                            f"segment {self.name!r} is not a hostkv segment (bad magic)")
                    check_format(self.name, &h.hdr_format)
                    state = h.hdr_state
                    if state == HKV_STATE_READY or state == HKV_STATE_CORRUPT:
                        return size
                    if state != HKV_STATE_INITIALISING:
                        raise CorruptionError(
                            f"segment {self.name!r}: the header's state word is {state}")
                    if first_reserved is None:
                        first_reserved = h.hdr_reserved_bytes
            if time.monotonic() >= deadline:
                break
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        if not have_header:
            raise IncompatibleSegmentError(
                f"segment {self.name!r} is {size} bytes after {timeout:g} s, shorter than a "
                f"hostkv header ({header_size} bytes): not a hostkv segment, or its creator "
                "died before writing its header; unlink it and create it again")
        total = h.hdr_regions.reg_total_size
        reserved = h.hdr_reserved_bytes
        percent = 100.0 * reserved / total if total > 0 else 0.0
        if reserved >= total:
            progress = "all of its memory reserved, its tables still being written"
        else:
            progress = f"{percent:.0f}% of its {total} bytes reserved"
        if first_reserved is not None and reserved == first_reserved:
            advice = ("no progress while waiting: its creator may have died; unlink it and "
                      "create it again")
        else:
            advice = "still progressing: pass a longer ready_timeout"
        raise IncompatibleSegmentError(
            f"segment {self.name!r} did not become ready within {timeout:g} s: still being "
            f"created by pid {h.hdr_creator_pid}, {progress}; {advice}")

    cdef _validate(self):
        """Checks an attached header: magic, format word, config sanity, region offsets."""
        cdef HkvHeader* hdr = self.hdr
        cdef HkvFormat fmt = expected_format()
        cdef HkvRegions regions
        cdef HkvConfig* c = &hdr.hdr_config
        if hdr.hdr_magic != HKV_MAGIC:
            raise IncompatibleSegmentError(f"segment {self.name!r} is not a hostkv segment (bad magic)")
        check_format(self.name, &hdr.hdr_format)
        if (c.cfg_num_pages <= 0 or c.cfg_num_pages >= 2**31 or c.cfg_page_size <= 0
                or c.cfg_page_bytes <= 0 or c.cfg_max_processes <= 0
                or c.cfg_undo_log_capacity <= 0 or c.cfg_radix_node_capacity < 0
                or c.cfg_sequence_page_node_capacity < 0 or c.cfg_max_sequences < 0
                or c.cfg_num_pages * c.cfg_page_bytes >= 2**46):
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

    # -- the lock ----------------------------------------------------------------------------

    cdef int begin(self) except -1:
        """Takes the lock and opens a mutation; recovers first if the last holder died.

        Counts the call as in flight until end(), so that close() in another thread waits
        for it instead of unmapping under it."""
        cdef pthread_t me = pthread_self()
        if self.closed:
            raise ValueError("the segment is closed")
        if self.fork_epoch != _fork_epoch:
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
        cdef timespec deadline
        cdef int64_t deadline_ns, wait_start, timeout_ns
        cdef int spins
        cdef bint waited
        check_mutex(self, &self.hdr.hdr_mutex, "the segment lock")
        wait_start = now_ns(CLOCK_MONOTONIC)
        rc = pthread_mutex_trylock(&self.hdr.hdr_mutex)
        waited = rc == EBUSY
        if rc == EBUSY:
            # Holds are a few microseconds: spin that long before sleeping in the kernel,
            # whose wake-up costs more than the wait (glibc's adaptive mutexes do the same,
            # but cannot be robust).
            with nogil:
                for spins in range(LOCK_SPINS):
                    cpu_relax()
                    rc = pthread_mutex_trylock(&self.hdr.hdr_mutex)
                    if rc != EBUSY:
                        break
        timeout_ns = self.lock_timeout_ns
        if _exiting and timeout_ns > EXIT_LOCK_TIMEOUT_NS:
            # The interpreter is exiting (closing what is left open): a process that
            # cannot give its lease back at once leaves it to the next sweep, as a death
            # would, rather than stall its exit for the full timeout (issue 10).
            timeout_ns = EXIT_LOCK_TIMEOUT_NS
        if rc == EBUSY:
            # A CLOCK_MONOTONIC deadline: a wall-clock jump must not stretch or cut the
            # wait (issue 10); see hkv_mutex_lock_until.
            deadline_ns = now_ns(CLOCK_MONOTONIC) + timeout_ns
            deadline.tv_sec = deadline_ns // 1_000_000_000
            deadline.tv_nsec = deadline_ns % 1_000_000_000
            with nogil:
                rc = hkv_mutex_lock_until(&self.hdr.hdr_mutex, &deadline)
                while rc == EINTR:
                    rc = hkv_mutex_lock_until(&self.hdr.hdr_mutex, &deadline)
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
            # namespaces, so it is never compared with another process's (issue 10).
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
        wrote, issue 12). Called with the lock held and the log empty, so a death right
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
        pthread_mutex_unlock(&self.hdr.hdr_mutex)

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

    cdef int crash_point(self) except -1:
        """Counts a step of the open mutation; at the armed step, dies or raises (tests only)."""
        self.crash_countdown -= 1
        if self.crash_countdown != 0:
            return 0
        if self.crash_mode == CRASH_EXIT:
            _exit(CRASH_EXIT_STATUS)
        if self.crash_mode == CRASH_RAISE_KEYBOARD_INTERRUPT:
            raise KeyboardInterrupt("injected at a crash point")
        raise MemoryError("injected at a crash point")

    def _arm_crash_point(self, long step, str mode="exit"):
        """Test hook: at the `step`-th logged store or commit from now, _exit or raise.

        mode is "exit" (the process dies with status 77), "keyboard_interrupt" or
        "memory_error". step 0 disarms.
        """
        modes = {"exit": CRASH_EXIT, "keyboard_interrupt": CRASH_RAISE_KEYBOARD_INTERRUPT,
                 "memory_error": CRASH_RAISE_MEMORY_ERROR}
        if mode not in modes:
            raise ValueError(f"crash mode must be one of {sorted(modes)}, got {mode!r}")
        if step < 0:
            raise ValueError(f"crash step must be >= 0, got {step}")
        self.crash_mode = modes[mode]
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
        cdef int rc
        if self.lease_holder == NULL:
            self.lease_holder = lease_holder_start()
        holder = <LeaseHolder*>self.lease_holder
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
                with nogil:
                    rc = lease_call(holder, LEASE_TAKE, &lease.ls_mutex)
                if rc == ENOTRECOVERABLE:
                    # A free slot whose mutex a failed sweep left unrecoverable: nobody can
                    # be waiting on it (only trylock touches lease mutexes), so start afresh.
                    init_robust_mutex(&lease.ls_mutex)
                    with nogil:
                        rc = lease_call(holder, LEASE_TAKE, &lease.ls_mutex)
                if rc != 0:
                    continue
                try:
                    log_store_i32(self, <int32_t*>&lease.ls_state, HKV_LEASE_ACTIVE)
                    log_store_i32(self, &lease.ls_pid, getpid())
                    log_store_i64(self, <int64_t*>&lease.ls_generation, <int64_t>lease.ls_generation + 1)
                    log_store_i64(self, &lease.ls_registered_ns, now_ns(CLOCK_REALTIME))
                    log_store_i32(self, &self.hdr.hdr_active_leases, self.hdr.hdr_active_leases + 1)
                    self.commit()
                except BaseException:
                    with nogil:
                        lease_call(holder, LEASE_DROP, NULL)
                    raise
                self.lease_slot = slot
                self.lease_generation = lease.ls_generation
                self.fork_epoch = _fork_epoch
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
            if lease.ls_state == HKV_LEASE_ACTIVE and lease.ls_generation == self.lease_generation:
                for i in range(_num_dead_lease_hooks):
                    _dead_lease_hooks[i](self, self.lease_slot)
                log_store_i32(self, <int32_t*>&lease.ls_state, HKV_LEASE_FREE)
                log_store_i32(self, &self.hdr.hdr_active_leases, self.hdr.hdr_active_leases - 1)
            self.commit()
        finally:
            self.end()
        self.lease_slot = -1
        with nogil:
            lease_call(<LeaseHolder*>self.lease_holder, LEASE_DROP, NULL)

    cdef int dead_leases(self) except -1:
        """How many lease slots are held by dead processes (probes only, changes nothing
        the sweep would not)."""
        cdef int32_t slot
        cdef int dead = 0
        for slot in range(self.hdr.hdr_config.cfg_max_processes):
            if slot != self.lease_slot and self.lease_at(slot).ls_state == HKV_LEASE_ACTIVE:
                if not self.lease_alive(slot):
                    dead += 1
        return dead

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
            rc = pthread_mutex_trylock(&lease.ls_mutex)
            if rc == EBUSY:
                continue                       # its lease thread holds it: alive
            if rc == EOWNERDEAD:
                pthread_mutex_consistent(&lease.ls_mutex)
            if rc == 0 or rc == EOWNERDEAD:
                # Unheld or owner-dead: the process is gone (a live one always holds it).
                pthread_mutex_unlock(&lease.ls_mutex)
            elif rc != ENOTRECOVERABLE:
                raise os_error(rc, f"probe lease slot {slot}", self.name)
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
        self.fork_epoch = _fork_epoch
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
        if self.fork_epoch != _fork_epoch:
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
            if self.fork_epoch == _fork_epoch and self.lease_slot >= 0:
                self._release_lease()
        finally:
            self._stop_lease_holder()
            self._unmap()
            self.closing = False

    def _stop_lease_holder(self):
        """Stops this process's lease thread (unlocking the lease mutex if it holds it)."""
        if self.lease_holder != NULL and self.fork_epoch == _fork_epoch:
            with nogil:
                lease_holder_stop(<LeaseHolder*>self.lease_holder)
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
        cdef dict c = self.hdr.hdr_config
        values = {pyname: c[cname] for pyname, cname in _CONFIG_FIELDS}
        values["enable_prefix_reuse"] = bool(values["enable_prefix_reuse"])
        layout = None
        if c["cfg_kv_num_layers"]:
            layout = (c["cfg_kv_num_layers"], c["cfg_kv_num_kv_heads"], c["cfg_kv_head_dim"],
                      c["cfg_kv_dtype_code"], c["cfg_kv_kind"])
        return values, layout

    def header_info(self):
        """A snapshot of the header (format, regions, state, counters) as plain dicts."""
        self._check_open()
        check_shape(self)
        cdef dict hdr = self.hdr[0]
        return {
            "format": dict(hdr["hdr_format"]),
            "regions": dict(hdr["hdr_regions"]),
            "state": hdr["hdr_state"],
            "creator_pid": hdr["hdr_creator_pid"],
            "reserved_bytes": hdr["hdr_reserved_bytes"],
            "generation": hdr["hdr_generation"],
            "free_pages": hdr["hdr_free_pages"],
            "active_leases": hdr["hdr_active_leases"],
            "tree_nodes": (<HkvSlab*>(self.base + self.hdr.hdr_regions.reg_radix_nodes)).sl_used,
            "active_sequences": (<HkvSlab*>(self.base + self.hdr.hdr_regions.reg_sequences)).sl_used,
            "sequence_pages": (<HkvSlab*>(self.base + self.hdr.hdr_regions.reg_sequence_pages)).sl_used,
            "undo_count": hdr["hdr_undo_count"],
            "stats": {k: v for k, v in dict(hdr["hdr_stats"]).items() if k != "st_reserved"},
            "radix": {k: v for k, v in dict(hdr["hdr_radix"]).items() if k != "rt_reserved"},
        }

    def lease_alive(self, int32_t slot):
        """Whether the process holding lease slot is alive (its lease mutex is held).

        Probing an owner-dead mutex takes it for an instant, marks it consistent and lets
        go; the sweep treats such a slot as dead either way, so nothing else changes."""
        cdef HkvLease* lease
        cdef int rc
        self._check_open()
        check_shape(self)
        lease = self.lease_at(slot)
        if lease.ls_state != HKV_LEASE_ACTIVE:
            return False
        if slot == self.lease_slot and self.fork_epoch == _fork_epoch:
            return True
        check_mutex(self, &lease.ls_mutex, f"lease slot {slot}")
        rc = pthread_mutex_trylock(&lease.ls_mutex)
        if rc == EBUSY:
            return True
        if rc == EOWNERDEAD:
            pthread_mutex_consistent(&lease.ls_mutex)
        if rc == 0 or rc == EOWNERDEAD:
            pthread_mutex_unlock(&lease.ls_mutex)
        return False

    def metrics_info(self):
        """The metrics region as plain Python values (call with the lock held)."""
        cdef HkvMetrics* m
        cdef int i
        self._check_open()
        m = self.metrics
        namespaces = {}
        for i in range(HKV_NAMESPACE_SLOTS):
            if m.mt_namespaces[i].ns_used:
                key = "other" if i == HKV_NAMESPACE_SLOTS - 1 else m.mt_namespaces[i].ns_namespace
                namespaces[key] = (m.mt_namespaces[i].ns_lookup_tokens, m.mt_namespaces[i].ns_hit_tokens)
        return {
            "lock_acquisitions": m.mt_lock_acquisitions,
            "lock_wait_ns": m.mt_lock_wait_ns,
            "lock_hold_ns": m.mt_lock_hold_ns,
            "lock_wait_histogram": [m.mt_lock_wait_histogram[i] for i in range(HKV_HISTOGRAM_BUCKETS)],
            "lock_hold_histogram": [m.mt_lock_hold_histogram[i] for i in range(HKV_HISTOGRAM_BUCKETS)],
            "full_hits": m.mt_full_hits,
            "misses": {"no_prefix": m.mt_miss_no_prefix, "namespace": m.mt_miss_namespace,
                       "below_minimum": m.mt_miss_below_minimum, "evicted": m.mt_miss_evicted},
            "namespaces": namespaces,
        }

    def leases(self):
        """The lease table: (slot, state, pid, generation, registered_ns) of every used slot."""
        cdef HkvLease* lease
        self._check_open()
        check_shape(self)
        out = []
        for slot in range(self.hdr.hdr_config.cfg_max_processes):
            lease = self.lease_at(slot)
            if lease.ls_state != HKV_LEASE_FREE:
                out.append((slot, lease.ls_state, lease.ls_pid, lease.ls_generation,
                            lease.ls_registered_ns))
        return out

    @property
    def free_pages(self):
        """Free pages now (a single read, no lock: a hint that may be stale at once)."""
        self._check_open()
        return self.hdr.hdr_free_pages

    @property
    def lease_slot_index(self):
        """This process's lease slot, or -1."""
        return self.lease_slot

    def check_header(self):
        """Checks this layer's invariants (call with the lock held, via _locked_check)."""
        cdef HkvLease* lease
        cdef int32_t active = 0
        if self.hdr.hdr_magic != HKV_MAGIC:
            self.corrupt("bad magic")
        if self.hdr.hdr_undo_count != 0:
            self.corrupt(f"undo log holds {self.hdr.hdr_undo_count} entries outside a mutation")
        for slot in range(self.hdr.hdr_config.cfg_max_processes):
            lease = self.lease_at(slot)
            if lease.ls_state == HKV_LEASE_ACTIVE:
                active += 1
            elif lease.ls_state != HKV_LEASE_FREE:
                self.corrupt(f"lease slot {slot} has state {lease.ls_state}")
        if active != self.hdr.hdr_active_leases:
            self.corrupt(f"{active} active lease slots, header counts {self.hdr.hdr_active_leases}")
        if self.lease_slot >= 0 and self.fork_epoch == _fork_epoch:
            lease = self.lease_at(self.lease_slot)
            if lease.ls_state != HKV_LEASE_ACTIVE or lease.ls_generation != self.lease_generation:
                self.corrupt(f"this process's lease (slot {self.lease_slot}) was taken away")

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

    # -- the page pool's bytes -----------------------------------------------------------------

    def pool_address(self):
        """The address of the page pool in this process (for views; changes per process)."""
        self._check_open()
        check_shape(self)
        return <size_t>(self.base + self.hdr.hdr_regions.reg_pool)

    def advise_pool(self, int64_t start, int64_t length, int advice):
        """madvise(2) on bytes [start, start + length) of this process's mapping of the page
        pool, widened to whole OS pages, without the GIL. Returns 0, or the errno it failed
        with (the caller decides: EINVAL from an older kernel means "try another advice").

        Counts as a call in flight, so close() in another thread waits for it rather than
        unmap the range under it, and refuses it once close() has begun.

        Raises:
            ValueError: the segment is closed or closing, or the range is not in the pool.
        """
        cdef pthread_t me = pthread_self()
        cdef int64_t pool_bytes
        cdef size_t os_page, addr, lo
        cdef int rc, err = 0
        if self.closed:
            raise ValueError("the segment is closed")
        if self.fork_epoch != _fork_epoch:
            self._after_fork()
        if self.closing and not pthread_equal(self.closing_thread, me):
            raise ValueError("the segment is closed (another thread is closing it)")
        check_shape(self)
        pool_bytes = self.hdr.hdr_config.cfg_num_pages * self.hdr.hdr_config.cfg_page_bytes
        if not (0 <= start <= pool_bytes and 0 <= length <= pool_bytes - start):
            raise ValueError(
                f"range [{start}, {start} + {length}) is not in the page pool of {pool_bytes} bytes")
        if length == 0:
            return 0
        # madvise wants a page-aligned start; the bytes this adds before the range are the
        # pool's or the metadata's, in this mapping, and no advice used here changes them.
        os_page = <size_t>sysconf(_SC_PAGESIZE)
        addr = <size_t>(self.base + self.hdr.hdr_regions.reg_pool + start)
        lo = addr & ~(os_page - 1)
        self.in_flight += 1
        with nogil:
            rc = madvise(<void*>lo, addr + <size_t>length - lo, advice)
            if rc != 0:
                err = errno
        self.in_flight -= 1
        return err

    def __getbuffer__(self, Py_buffer* view, int flags):
        # The page pool as a writable uint8 [num_pages, page_bytes] buffer: numpy and torch
        # views keep this object alive and counted, so close() can refuse to unmap under them.
        if self.closed or self.closing:
            raise ValueError("the segment is closed")
        check_shape(self)
        self.exports += 1
        view.buf = self.base + self.hdr.hdr_regions.reg_pool
        view.obj = self
        view.len = self.hdr.hdr_config.cfg_num_pages * self.hdr.hdr_config.cfg_page_bytes
        view.readonly = 0
        view.itemsize = 1
        view.format = NULL
        if flags & PyBUF_FORMAT:
            view.format = b"B"
        view.ndim = 2
        view.shape = <Py_ssize_t*>&self._pool_shape[0]
        view.strides = <Py_ssize_t*>&self._pool_strides[0]
        view.suboffsets = NULL
        view.internal = NULL
        self._pool_shape[0] = self.hdr.hdr_config.cfg_num_pages
        self._pool_shape[1] = self.hdr.hdr_config.cfg_page_bytes
        self._pool_strides[0] = self.hdr.hdr_config.cfg_page_bytes
        self._pool_strides[1] = 1

    def __releasebuffer__(self, Py_buffer* view):
        self.exports -= 1


cdef extern from *:
    """
    static inline int count_leading_zeros(uint64_t x) { return __builtin_clzll(x); }
    static inline void cpu_relax(void) {
    #if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
    #elif defined(__aarch64__)
        __asm__ __volatile__("yield");
    #endif
    }
    """
    int count_leading_zeros(uint64_t x) noexcept nogil
    void cpu_relax() noexcept nogil


cdef extern from *:
    """
    static inline void __atomic_store_release_u32(uint32_t* p, uint32_t v) {
        __atomic_store_n(p, v, __ATOMIC_RELEASE);
    }
    static inline uint32_t __atomic_load_acquire_u32(uint32_t* p) {
        return __atomic_load_n(p, __ATOMIC_ACQUIRE);
    }
    static inline void hkv_store_release_i64(int64_t* p, int64_t v) {
        __atomic_store_n(p, v, __ATOMIC_RELEASE);
    }
    """
    void __atomic_store_release_u32(uint32_t* p, uint32_t v) noexcept nogil
    void hkv_store_release_i64(int64_t* p, int64_t v) noexcept nogil
    uint32_t __atomic_load_acquire_u32(uint32_t* p) noexcept nogil


cdef dict _offsets(const char* base, list fields):
    return {name: <Py_ssize_t>(<const char*><size_t>addr - base) for name, addr in fields}


def layout_info():
    """The byte offset of every header and lease field and each struct's size.

    tests/test_layout.py pins these: a change here is a format change (bump
    HKV_LAYOUT_VERSION).
    """
    cdef HkvHeader h
    cdef HkvLease l
    cdef HkvUndoEntry u
    cdef HkvSlab s
    cdef HkvRadixNode n
    cdef HkvSequence q
    cdef HkvSeqPage sp
    cdef const char* hb = <const char*>&h
    header = _offsets(hb, [
        ("hdr_magic", <size_t>&h.hdr_magic),
        ("hdr_format", <size_t>&h.hdr_format),
        ("fmt_layout_version", <size_t>&h.hdr_format.fmt_layout_version),
        ("fmt_mutex_size", <size_t>&h.hdr_format.fmt_mutex_size),
        ("fmt_slab_size", <size_t>&h.hdr_format.fmt_slab_size),
        ("hdr_config", <size_t>&h.hdr_config),
        ("cfg_num_pages", <size_t>&h.hdr_config.cfg_num_pages),
        ("cfg_page_bytes", <size_t>&h.hdr_config.cfg_page_bytes),
        ("cfg_page_size", <size_t>&h.hdr_config.cfg_page_size),
        ("cfg_max_processes", <size_t>&h.hdr_config.cfg_max_processes),
        ("cfg_undo_log_capacity", <size_t>&h.hdr_config.cfg_undo_log_capacity),
        ("cfg_kv_dtype_code", <size_t>&h.hdr_config.cfg_kv_dtype_code),
        ("cfg_kv_kind", <size_t>&h.hdr_config.cfg_kv_kind),
        ("hdr_regions", <size_t>&h.hdr_regions),
        ("reg_leases", <size_t>&h.hdr_regions.reg_leases),
        ("reg_metrics", <size_t>&h.hdr_regions.reg_metrics),
        ("reg_undo", <size_t>&h.hdr_regions.reg_undo),
        ("reg_page_refcounts", <size_t>&h.hdr_regions.reg_page_refcounts),
        ("reg_page_free_stack", <size_t>&h.hdr_regions.reg_page_free_stack),
        ("reg_page_tokens", <size_t>&h.hdr_regions.reg_page_tokens),
        ("reg_page_next", <size_t>&h.hdr_regions.reg_page_next),
        ("reg_radix_nodes", <size_t>&h.hdr_regions.reg_radix_nodes),
        ("reg_radix_table", <size_t>&h.hdr_regions.reg_radix_table),
        ("reg_radix_heap", <size_t>&h.hdr_regions.reg_radix_heap),
        ("reg_sequences", <size_t>&h.hdr_regions.reg_sequences),
        ("reg_sequence_pages", <size_t>&h.hdr_regions.reg_sequence_pages),
        ("reg_pool", <size_t>&h.hdr_regions.reg_pool),
        ("reg_total_size", <size_t>&h.hdr_regions.reg_total_size),
        ("hdr_state", <size_t>&h.hdr_state),
        ("hdr_creator_pid", <size_t>&h.hdr_creator_pid),
        ("hdr_generation", <size_t>&h.hdr_generation),
        ("hdr_reserved_bytes", <size_t>&h.hdr_reserved_bytes),
        ("hdr_free_pages", <size_t>&h.hdr_free_pages),
        ("hdr_active_leases", <size_t>&h.hdr_active_leases),
        ("hdr_undo_start", <size_t>&h.hdr_undo_start),
        ("hdr_undo_count", <size_t>&h.hdr_undo_count),
        ("hdr_stats", <size_t>&h.hdr_stats),
        ("st_recoveries", <size_t>&h.hdr_stats.st_recoveries),
        ("st_evicted_pages", <size_t>&h.hdr_stats.st_evicted_pages),
        ("hdr_radix", <size_t>&h.hdr_radix),
        ("rt_tick", <size_t>&h.hdr_radix.rt_tick),
        ("rt_table_capacity", <size_t>&h.hdr_radix.rt_table_capacity),
        ("rt_heap_size", <size_t>&h.hdr_radix.rt_heap_size),
        ("rt_cached_pages", <size_t>&h.hdr_radix.rt_cached_pages),
        ("rt_protected_pages", <size_t>&h.hdr_radix.rt_protected_pages),
        ("rt_evictable_leaf_pages", <size_t>&h.hdr_radix.rt_evictable_leaf_pages),
        ("hdr_mutex", <size_t>&h.hdr_mutex),
    ])
    lease = _offsets(<const char*>&l, [
        ("ls_mutex", <size_t>&l.ls_mutex),
        ("ls_state", <size_t>&l.ls_state),
        ("ls_pid", <size_t>&l.ls_pid),
        ("ls_generation", <size_t>&l.ls_generation),
        ("ls_registered_ns", <size_t>&l.ls_registered_ns),
    ])
    undo = _offsets(<const char*>&u, [("ue_where", <size_t>&u.ue_where), ("ue_old", <size_t>&u.ue_old)])
    slab = _offsets(<const char*>&s, [
        ("sl_capacity", <size_t>&s.sl_capacity), ("sl_record_size", <size_t>&s.sl_record_size),
        ("sl_free_head", <size_t>&s.sl_free_head), ("sl_used", <size_t>&s.sl_used)])
    node = _offsets(<const char*>&n, [
        ("rn_slab", <size_t>&n.rn_slab), ("rn_parent", <size_t>&n.rn_parent),
        ("rn_num_pages", <size_t>&n.rn_num_pages), ("rn_first_page", <size_t>&n.rn_first_page),
        ("rn_num_children", <size_t>&n.rn_num_children), ("rn_lock_count", <size_t>&n.rn_lock_count),
        ("rn_heap_pos", <size_t>&n.rn_heap_pos), ("rn_namespace", <size_t>&n.rn_namespace),
        ("rn_key_hash", <size_t>&n.rn_key_hash), ("rn_last_access", <size_t>&n.rn_last_access)])
    sequence = _offsets(<const char*>&q, [
        ("sq_slab", <size_t>&q.sq_slab), ("sq_lease_slot", <size_t>&q.sq_lease_slot),
        ("sq_num_pages", <size_t>&q.sq_num_pages),
        ("sq_lease_generation", <size_t>&q.sq_lease_generation),
        ("sq_seq_id", <size_t>&q.sq_seq_id), ("sq_namespace", <size_t>&q.sq_namespace),
        ("sq_first_page", <size_t>&q.sq_first_page), ("sq_last_page", <size_t>&q.sq_last_page),
        ("sq_lock_node", <size_t>&q.sq_lock_node), ("sq_view", <size_t>&q.sq_view),
        ("sq_generation", <size_t>&q.sq_generation)])
    sequence_page = _offsets(<const char*>&sp, [
        ("sp_slab", <size_t>&sp.sp_slab), ("sp_next", <size_t>&sp.sp_next),
        ("sp_count", <size_t>&sp.sp_count), ("sp_pages", <size_t>&sp.sp_pages)])
    return {
        "layout_version": HKV_LAYOUT_VERSION,
        "magic": HKV_MAGIC,
        "sizes": {"HkvHeader": sizeof(HkvHeader), "HkvLease": sizeof(HkvLease),
                  "HkvUndoEntry": sizeof(HkvUndoEntry), "HkvSlab": sizeof(HkvSlab),
                  "HkvRadixNode": sizeof(HkvRadixNode), "HkvSequence": sizeof(HkvSequence),
                  "HkvSeqPage": sizeof(HkvSeqPage), "HkvMetrics": sizeof(HkvMetrics),
                  "pthread_mutex_t": sizeof(pthread_mutex_t)},
        "header": header, "lease": lease, "undo": undo, "slab": slab, "radix_node": node,
        "sequence": sequence, "sequence_page": sequence_page,
    }
