# A WorkerView's compiled bookkeeping (process-private, never in the segment), for the
# batch calls (_sequences) to cimport: ViewSequence, one live sequence as the view knows it,
# and ViewState, what the view hands each compiled call; the small steps of a decode step
# and the commit rule inline here.

cimport cython
cimport numpy as cnp
from libc.stdint cimport int32_t, int64_t, uint64_t
from hostkv._segment cimport Segment


@cython.final
cdef class ViewSequence:
    cdef readonly int64_t seq_id
    cdef readonly int64_t record      # checked against the segment at every use
    cdef readonly int64_t generation
    cdef uint64_t _namespace
    cdef readonly cnp.ndarray tokens
    cdef readonly int64_t num_tokens, cacheable_tokens, reused_tokens, num_pages
    cdef public int64_t committed_pages
    cdef readonly cnp.ndarray pages
    cdef int64_t step_mark            # the last decode step that listed it (see append_tokens)


@cython.final
cdef class ViewState:
    cdef readonly Segment segment
    cdef readonly dict live
    cdef readonly int32_t page_size, min_reuse_pages, min_store_pages, view
    cdef readonly int64_t pool_pages
    cdef readonly bint reuse_enabled
    cdef public int64_t requests, prompt_tokens, reused_tokens, committed_pages


cdef bint plain_int32(cnp.ndarray arr) noexcept
cdef int check_filled(ViewSequence seq) except -1
cdef int fill_view_sequence(ViewSequence seq, int64_t seq_id, int64_t record, int64_t generation,
                            uint64_t namespace, cnp.ndarray tokens, int64_t reused_tokens,
                            int64_t reused_pages, cnp.ndarray pages) except -1
cdef cnp.ndarray grown(cnp.ndarray arr, int64_t used, int64_t least)
cdef int reserve_token(ViewSequence seq) except -1
cdef int reserve_page(ViewSequence seq) except -1
cdef int check_state(ViewState state) except -1
cdef int note_cached(ViewState state, ViewSequence seq, int64_t pages) except -1


cdef inline bint needs_page(ViewSequence seq, int32_t page_size) noexcept:
    """Its last page is full: its next token takes a new one."""
    return seq.num_tokens == seq.num_pages * page_size


cdef inline void push_page(ViewSequence seq, int32_t page) noexcept:
    """Appends a page after reserve_page. Cannot fail."""
    (<int32_t*>cnp.PyArray_DATA(seq.pages))[seq.num_pages] = page
    seq.num_pages += 1


cdef inline void push_token(ViewSequence seq, int64_t token) noexcept:
    """Appends a token after reserve_token (-1: unknown, stored as 0). Cannot fail."""
    cdef int32_t* data = <int32_t*>cnp.PyArray_DATA(seq.tokens)
    if token < 0:
        data[seq.num_tokens] = 0
        seq.cacheable_tokens = min(seq.cacheable_tokens, seq.num_tokens)
    else:
        data[seq.num_tokens] = <int32_t>token
        if seq.cacheable_tokens == seq.num_tokens:
            seq.cacheable_tokens += 1
    seq.num_tokens += 1


cdef inline int64_t pages_to_commit(int64_t full_pages, int64_t min_store_pages,
                                    int64_t committed_pages) noexcept:
    """The commit rule, WorkerView's and release's alike (ViewState.pages_to_commit is it
    for Python): a sequence whose first full_pages pages are full and known caches them all
    when they are at least min_store_pages and more than the committed_pages it has cached
    already; otherwise a commit caches nothing new (0)."""
    return full_pages if full_pages >= min_store_pages and full_pages > committed_pages else 0
