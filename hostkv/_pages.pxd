# The page pool's metadata: per-page refcounts, the free-page stack, per-page token ids, and
# the window parts pages may hold.
#
# A page is free exactly when its refcount is 0; the free stack lists those pages and is
# derived state (recovery rebuilds it from the refcounts). Likewise a part is free exactly
# when it names no page (part_pages[q] == -1), and page_parts/part_pages link a page and its
# part both ways. Every function here runs inside an
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


cdef inline int32_t* page_parts(Segment seg) noexcept nogil:
    """Each page's window part, -1 none (num_pages entries)."""
    return <int32_t*>(seg.base + seg.hdr.hdr_regions.reg_page_part)


cdef inline int32_t* part_pages(Segment seg) noexcept nogil:
    """Each window part's page, -1 free (num_parts entries)."""
    return <int32_t*>(seg.base + seg.hdr.hdr_regions.reg_part_page)


cdef inline int32_t* part_free_stack(Segment seg) noexcept nogil:
    return <int32_t*>(seg.base + seg.hdr.hdr_regions.reg_part_free_stack)


cdef int page_index_corrupt(Segment seg, int64_t page) except -1


cdef inline int check_page_index(Segment seg, int64_t page) except -1:
    """CorruptionError unless page names a page of the pool."""
    if page < 0 or page >= seg.hdr.hdr_config.cfg_num_pages:
        page_index_corrupt(seg, page)
    return 0


cdef int pages_alloc(Segment seg, int64_t count, int32_t* out) except -1
cdef int page_incref(Segment seg, int32_t page) except -1
cdef int page_decref(Segment seg, int32_t page) except -1
cdef int part_donate(Segment seg, int32_t from_page, int32_t to_page) except -1
cdef int part_free(Segment seg, int32_t page) except -1
