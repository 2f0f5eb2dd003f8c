# The robust, process-shared mutexes that the segment lock and every lease are, and the
# thread that holds this process's lease.
#
# A lease is a slot of the lease table (HkvLease, _layout.pxd) whose mutex its process
# holds for as long as it lives: when the process dies the kernel makes the mutex
# owner-dead, and the next probe of it (probe_mutex) tells a dead process from a live one.
# Taking, giving back and reaping leases are mutations of the segment (Segment in
# _segment.pyx); this module has no Segment: it is the layer below.

from libc.stdint cimport int32_t, int64_t
from hostkv._layout cimport HkvLease
from hostkv.includes.system cimport pthread_cond_t, pthread_mutex_t, pthread_t

cdef enum LeaseCommand:
    LEASE_IDLE = 0
    LEASE_TAKE = 1          # trylock target; owner-dead counts as taken (after consistent)
    LEASE_DROP = 2          # unlock target, keep running
    LEASE_EXIT = 3          # unlock target if held, then exit

# The lease thread's mailbox (process-private, never in the segment).
ctypedef struct LeaseHolder:
    pthread_mutex_t mutex
    pthread_cond_t cond
    int command
    int result
    bint holding
    pthread_mutex_t* target
    pthread_t thread


cdef long fork_epoch() noexcept
cdef int init_robust_mutex(pthread_mutex_t* mutex) except -1
cdef str mutex_kind_problem(pthread_mutex_t* m, str what)
cdef int lock_contended(pthread_mutex_t* m, int64_t timeout_ns, bint* slept) noexcept nogil
cdef void await_handoff(pthread_mutex_t* m) noexcept nogil
cdef int probe_mutex(pthread_mutex_t* m) noexcept nogil

cdef LeaseHolder* lease_holder_start() except NULL
cdef void lease_holder_stop(LeaseHolder* h) noexcept nogil
cdef int lease_call(LeaseHolder* h, int command, pthread_mutex_t* target) noexcept nogil
cdef int take_lease_mutex(LeaseHolder* h, pthread_mutex_t* target) except -1

cdef list lease_list(HkvLease* table, int32_t num_slots)
cdef str lease_table_problem(HkvLease* table, int32_t num_slots, int32_t active_leases)
