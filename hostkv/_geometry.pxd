# Where each region of a segment lies for a given config (the map itself is _layout.pxd),
# the tables a new segment starts with, and the kernel's advice on ranges of the mapping.

from libc.stdint cimport int64_t
from hostkv._layout cimport HkvConfig, HkvHeader, HkvRegions


cdef inline int64_t align_up(int64_t value, int64_t alignment) noexcept nogil:
    return (value + alignment - 1) // alignment * alignment


cdef int64_t radix_table_capacity(int64_t node_capacity) noexcept nogil
cdef int compute_regions(const HkvConfig* cfg, HkvRegions* out) except -1
cdef int init_tables(char* base, HkvHeader* hdr, const HkvConfig* cfg,
                     const HkvRegions* regions) except -1
cdef int advise_range(char* at, size_t length, int advice) noexcept nogil
