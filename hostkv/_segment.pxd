# The mapped segment: a SegmentLock (_lock.pxd: the lock, the undo log and every field of a
# handle) with its lifecycle, this process's lease on it, and the hooks later layers add to
# recovery and to the reaping of a dead process.

from libc.stdint cimport int32_t, int64_t, uint64_t
from hostkv._layout cimport HkvConfig, HkvLease, HkvRegions
from hostkv._lock cimport SegmentLock

ctypedef int (*rederive_hook)(Segment seg) except -1
ctypedef int (*dead_lease_hook)(Segment seg, int32_t slot) except -1


cdef class Segment(SegmentLock):
    cdef _map(self, name, int fd, int64_t size)
    cdef _populate_metadata(self)
    cdef _initialise(self, HkvConfig* ccfg, HkvRegions* regions)
    cdef _bind_regions(self)
    cdef _validate(self)
    cdef int dead_leases(self) except -1
    cdef bint has_live_member(self, int32_t slot, uint64_t generation) except -1
    cdef int sweep_leases(self) except -1
    cdef HkvLease* lease_at(self, int32_t slot) except NULL


cdef int add_rederive_hook(rederive_hook hook) except -1
cdef int add_dead_lease_hook(dead_lease_hook hook) except -1
