# The page pool's metadata: per-page refcounts, the free-page stack, per-page token ids.
#
# A page is free exactly when its refcount is 0; the free stack lists those pages and is
# derived state (recovery rebuilds it from the refcounts). Every function here runs inside an
# open mutation (Segment.begin/commit/end) and changes shared state only by logged stores.

from libc.stdint cimport int32_t, int64_t
from hostkv._segment cimport Segment


cdef inline int32_t* page_refcounts(Segment seg) noexcept nogil:
    return <int32_t*>(seg.base + seg.hdr.hdr_regions.reg_page_refcounts)


cdef inline int32_t* page_free_stack(Segment seg) noexcept nogil:
    return <int32_t*>(seg.base + seg.hdr.hdr_regions.reg_page_free_stack)


cdef inline int32_t* page_tokens(Segment seg, int32_t page) noexcept nogil:
    """The page_size token ids of a page (its caller has bounds-checked page)."""
    return (<int32_t*>(seg.base + seg.hdr.hdr_regions.reg_page_tokens)
            + <int64_t>page * seg.hdr.hdr_config.cfg_page_size)


cdef int page_index_corrupt(Segment seg, int64_t page) except -1


cdef inline int check_page_index(Segment seg, int64_t page) except -1:
    """CorruptionError unless page names a page of the pool."""
    if page < 0 or page >= seg.hdr.hdr_config.cfg_num_pages:
        page_index_corrupt(seg, page)
    return 0


cdef int pages_alloc(Segment seg, int64_t count, int32_t* out) except -1
cdef int page_incref(Segment seg, int32_t page) except -1
cdef int page_decref(Segment seg, int32_t page) except -1
