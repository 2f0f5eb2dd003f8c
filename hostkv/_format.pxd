# What a segment says it is: its header's format word and config, checked before anything
# trusts them, and the header's first and last words at create and attach.

from libc.stdint cimport int64_t
from hostkv._layout cimport HkvConfig, HkvFormat, HkvHeader, HkvMetrics, HkvRegions


cdef HkvFormat expected_format() noexcept
cdef int check_format(name, HkvFormat* got_format) except -1
cdef HkvConfig config_to_c(object config) except *
cdef tuple config_values(const HkvConfig* c)
cdef bint config_impossible(const HkvConfig* c) except -1
cdef str shape_problem(HkvHeader* hdr, size_t size, int64_t undo_capacity)
cdef str tables_problem(char* base, HkvHeader* hdr, const HkvRegions* regions)

cdef int write_first_header(name, int fd, const HkvConfig* ccfg,
                            const HkvRegions* regions) except -1
cdef int reserve_memory(name, int fd, int64_t total, HkvHeader* hdr) except -1
cdef void creator_step(HkvHeader* hdr) noexcept nogil
cdef bint creator_gone(int fd) except -1
cdef int64_t wait_ready(name, int fd, double timeout) except -1

cdef dict header_snapshot(HkvHeader* hdr, char* base)
cdef dict metrics_snapshot(HkvMetrics* m)
