# Fixed-size record pools in the segment, addressed by int32 index.
#
# A pool is an HkvSlab header followed by sl_capacity records of sl_record_size bytes, each
# starting with an HkvSlabRecord. Free records form a singly linked list through
# sr_next_free. The in-use flags are the truth: recovery rebuilds the free list and the used
# count from them (slab_rederive). Allocation and free are logged stores, O(1).

from libc.stdint cimport int32_t, int64_t
from hostkv._layout cimport HkvSlab, HkvSlabRecord
from hostkv._segment cimport Segment


cdef inline HkvSlabRecord* slab_record(HkvSlab* slab, int32_t index) noexcept nogil:
    """The record at index; the caller has bounds-checked it (slab_check_index)."""
    return <HkvSlabRecord*>((<char*>slab) + sizeof(HkvSlab) + <int64_t>index * slab.sl_record_size)


cdef int slab_index_corrupt(Segment seg, HkvSlab* slab, int64_t index, str what) except -1


cdef inline int slab_check_index(Segment seg, HkvSlab* slab, int64_t index, str what) except -1:
    """CorruptionError unless index names a record of the slab."""
    if index < 0 or index >= slab.sl_capacity:
        slab_index_corrupt(seg, slab, index, what)
    return 0


cdef inline bint slab_freed_in_mutation(Segment seg, HkvSlab* slab) noexcept:
    """Whether the open mutation has freed a record of this slab (so far)."""
    cdef int i
    if seg.num_freed_slabs < 0:
        return True
    for i in range(seg.num_freed_slabs):
        if seg.freed_slabs[i] == <void*>slab:
            return True
    return False


cdef int32_t slab_alloc(Segment seg, HkvSlab* slab) except -2
cdef int slab_alloc_many(Segment seg, HkvSlab* slab, int64_t count, int32_t* out) except -1
cdef int slab_free(Segment seg, HkvSlab* slab, int32_t index) except -1
cdef int slab_note_free(Segment seg, HkvSlab* slab) except -1
cdef int slab_rederive(Segment seg, HkvSlab* slab) except -1
cdef int slab_check(Segment seg, HkvSlab* slab, str what) except -1
