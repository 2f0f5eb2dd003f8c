# The segment's lock and its undo log, for the sibling modules to cimport: what every
# mutation of shared state runs through.
#
# Every store to shared state during a mutation goes through log_store_i32 / log_store_i64:
# they append (where, old value) to the undo log, then store. A mutation runs as
#
#     seg.begin()              # takes the lock; recovers first if the last holder died
#     try:
#         ...log_store_*...
#         seg.commit()         # clears the log: the single store that publishes it all
#     finally:
#         seg.end()            # rolls back if not committed (any exception), unlocks
#
# so an exception, or death at any instruction, leaves the state as before or after.
#
# SegmentLock holds every field of a handle; Segment (_segment.pxd) is a SegmentLock with a
# lifecycle (create, attach, close), a lease, and the recovery that replays a dead holder's
# log and has every layer re-derive its state: begin() calls the three methods it overrides
# (_recover, sweep_leases, _after_fork).

from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t
from hostkv._layout cimport (
    HkvConfig, HkvHeader, HkvMetrics, HkvRegions, HkvUndoEntry, HKV_UNDO_WIDTH_SHIFT)
from hostkv._leases cimport LeaseHolder
from hostkv.includes.system cimport hkv_compiler_barrier, pthread_mutex_t, pthread_t


cdef class SegmentLock:
    cdef char* base
    cdef HkvHeader* hdr
    cdef HkvUndoEntry* undo
    cdef HkvMetrics* metrics
    cdef int64_t locked_at_ns           # CLOCK_MONOTONIC when this object took the lock
    cdef int64_t last_sweep_ns          # CLOCK_MONOTONIC of this object's last lease sweep
    cdef int64_t undo_capacity
    cdef int64_t undo_start             # the open mutation's first entry in the ring (hdr_undo_start)
    cdef size_t size
    cdef int fd                         # the segment's file, open while mapped by a leased
                                        # handle: its flock(LOCK_SH) says "in use" (-1: none)
    cdef int64_t file_dev, file_ino     # which file that is (stat), for replace_segment
    cdef readonly str name
    cdef readonly bint closed
    cdef bint locked                    # a thread of this process holds hdr_mutex through this object
    cdef pthread_t lock_owner           # ... and this is that thread (valid while locked)
    cdef int in_flight                  # calls of this process's threads between begin and end
    cdef readonly bint handoff_due      # the last unlock through this object woke a sleeping
                                        # waiter: the next locker gives way first (await_handoff)
    cdef bint took_asleep               # the holder waited in the kernel for the lock: glibc
                                        # then marks it as having waiters whether or not any
                                        # remain, so its unlock hands nothing off
    cdef readonly bint closing          # close() is waiting for in-flight calls
    cdef pthread_t closing_thread       # ... in this thread
    cdef bint observer                  # attached without a lease: never sweeps
    cdef int64_t lock_timeout_ns
    cdef int reaped_by_begin            # dead leases the sweep inside the last begin() freed
    cdef int64_t crash_countdown        # > 0: die (or raise) at that many more steps
    cdef int crash_mode
    cdef int32_t lease_slot             # -1: no lease
    cdef uint64_t lease_generation
    cdef LeaseHolder* lease_holder      # process-private (_leases.pxd)
    cdef long fork_epoch                # fork_epoch() when this lease was taken
    cdef uint64_t hash_mask             # ANDed into page hashes; tests force collisions with it
    cdef Py_ssize_t exports             # live buffer views of the page pool
    cdef Py_ssize_t _pool_shape[2]
    cdef Py_ssize_t _pool_strides[2]
    # The slabs (HkvSlab*) the open mutation has freed a record of, so far: records it takes
    # from any other slab were free when it began (see _slab.slab_alloc_many). Up to 4; a 5th
    # sets num_freed_slabs to -1 (assume every slab).
    cdef void* freed_slabs[4]
    cdef int num_freed_slabs
    # The header's config and region offsets as check_shape last found them sound: equal
    # bytes need no recomputing at every lock. check_shape also runs in unlocked readers;
    # threads of one process can share these because it holds the GIL throughout and only
    # ever stores bytes equal to a header it has just validated.
    cdef HkvConfig shape_config
    cdef HkvRegions shape_regions
    cdef bint shape_checked

    cdef int begin(self) except -1
    cdef int _acquire(self) except -1
    cdef void _unlock(self) noexcept
    cdef int _start_undo_log(self) except -1
    cdef int commit(self) except -1
    cdef void end(self) noexcept
    cdef int crash_point(self) except -1
    cdef int undo_full(self) except -1
    cdef int rollback_to(self, int64_t mark) except -1
    cdef int corrupt(self, str what) except -1
    cdef int sweep_leases(self) except -1


cdef int check_mutex(SegmentLock seg, pthread_mutex_t* m, str what) except -1
cdef int check_shape(SegmentLock seg) except -1


cdef inline int check_open(SegmentLock seg) except -1:
    """Raises ValueError for a closed segment (its header is unmapped)."""
    if seg.closed:
        raise ValueError("the segment is closed")
    return 0


cdef inline HkvUndoEntry* undo_entry(SegmentLock seg, int64_t i) noexcept:
    """Entry i of the open mutation's undo log: the log starts at its holder's home in the
    ring of entries and wraps past the region's end."""
    i += seg.undo_start
    if i >= seg.undo_capacity:
        i -= seg.undo_capacity
    return seg.undo + i


cdef inline int log_store_i32(SegmentLock seg, int32_t* field, int32_t value) except -1:
    """Stores value into a shared int32 field after logging its old value."""
    cdef int64_t n = seg.hdr.hdr_undo_count
    cdef HkvUndoEntry* entry
    if n >= seg.undo_capacity:
        seg.undo_full()
    entry = undo_entry(seg, n)
    entry.ue_where = (<uint64_t>(<char*>field - seg.base)) | (<uint64_t>4 << HKV_UNDO_WIDTH_SHIFT)
    entry.ue_old = <uint32_t>field[0]
    hkv_compiler_barrier()
    seg.hdr.hdr_undo_count = n + 1
    hkv_compiler_barrier()
    if seg.crash_countdown > 0:
        seg.crash_point()
    field[0] = value
    return 0


cdef inline int log_store_i64(SegmentLock seg, int64_t* field, int64_t value) except -1:
    """Stores value into a shared int64 field after logging its old value."""
    cdef int64_t n = seg.hdr.hdr_undo_count
    cdef HkvUndoEntry* entry
    if n >= seg.undo_capacity:
        seg.undo_full()
    entry = undo_entry(seg, n)
    entry.ue_where = (<uint64_t>(<char*>field - seg.base)) | (<uint64_t>8 << HKV_UNDO_WIDTH_SHIFT)
    entry.ue_old = <uint64_t>field[0]
    hkv_compiler_barrier()
    seg.hdr.hdr_undo_count = n + 1
    hkv_compiler_barrier()
    if seg.crash_countdown > 0:
        seg.crash_point()
    field[0] = value
    return 0
