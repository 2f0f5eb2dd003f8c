# Sequence records (HkvSequence) and their page lists (HkvSeqPage), for the batch calls
# (_sequences) to cimport: the slabs they live in, and the building blocks every call that
# takes, steps, commits or releases a sequence is made of.

from libc.stdint cimport int32_t, int64_t, uint64_t
from hostkv._layout cimport HkvSeqPage, HkvSequence, HkvSlab
from hostkv._radix cimport Tree
from hostkv._segment cimport Segment


cdef inline HkvSlab* sequence_slab(Segment seg) noexcept nogil:
    return <HkvSlab*>(seg.base + seg.hdr.hdr_regions.reg_sequences)


cdef inline HkvSlab* page_list_slab(Segment seg) noexcept nogil:
    return <HkvSlab*>(seg.base + seg.hdr.hdr_regions.reg_sequence_pages)


cdef HkvSequence* sequence_at(Segment seg, int64_t index) except NULL
cdef HkvSeqPage* page_entry_at(Segment seg, int64_t index) except NULL
cdef int32_t new_sequence(Segment seg, int64_t seq_id, uint64_t namespace, int32_t lock_node,
                          int32_t view, str call, int64_t batch, int64_t still_needed) except -1
cdef HkvSeqPage* list_entry_at(Segment seg, int64_t index) except NULL
cdef list listed_pages(Segment seg, HkvSequence* seq, int32_t index)
cdef int extend_page_list(Segment seg, HkvSequence* seq, const int32_t* pages,
                          int64_t count) except -1
cdef int set_lock(Segment seg, Tree* t, HkvSequence* seq, int32_t node) except -1
cdef int release_sequence(Segment seg, Tree* t, int32_t index, const int32_t* adopted=*,
                          int64_t num_adopted=*) except -1
cdef HkvSequence* owned_sequence(Segment seg, int64_t index, int64_t seq_id,
                                 int64_t generation) except NULL
cdef list owned_by_view(Segment seg, int32_t view)
