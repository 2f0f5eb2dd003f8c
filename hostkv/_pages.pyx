# cython: language_level=3, embedsignature=True
"""The page pool: allocation, reference counts, token ids, and zero-copy views of the bytes."""

import numpy as np
cimport numpy as cnp

from libc.stdint cimport int32_t, int64_t

from hostkv._layout cimport HkvHeader
from hostkv._lock cimport check_open, log_store_i32, log_store_i64
from hostkv._segment cimport Segment, add_rederive_hook

from hostkv.errors import CorruptionError, OutOfPagesError

cnp.import_array()


cdef int page_index_corrupt(Segment seg, int64_t page) except -1:
    """check_page_index's failure, out of line (the check itself is inlined everywhere)."""
    seg.corrupt(f"page index {page} outside [0, {seg.hdr.hdr_config.cfg_num_pages})")
    return 0


cdef int pages_alloc(Segment seg, int64_t count, int32_t* out) except -1:
    """Takes `count` free pages (refcount 0 -> 1) into out; OutOfPagesError changes nothing."""
    cdef HkvHeader* hdr = seg.hdr
    cdef int32_t* refcounts = page_refcounts(seg)
    cdef int32_t* stack = page_free_stack(seg)
    cdef int64_t free_pages = hdr.hdr_free_pages
    cdef int64_t i
    cdef int32_t page
    if count < 0:
        raise ValueError(f"page count must be >= 0, got {count}")
    if free_pages < 0 or free_pages > hdr.hdr_config.cfg_num_pages:
        seg.corrupt(f"free page count {free_pages} outside [0, {hdr.hdr_config.cfg_num_pages}]")
    if count > free_pages:
        raise OutOfPagesError(
            f"segment {seg.name!r}: {count} pages needed, {free_pages} free",
            needed=count, available=free_pages)
    for i in range(count):
        page = stack[free_pages - 1 - i]
        check_page_index(seg, page)
        if refcounts[page] != 0:
            seg.corrupt(f"page {page} is on the free stack with refcount {refcounts[page]}")
        log_store_i32(seg, &refcounts[page], 1)
        out[i] = page
    log_store_i64(seg, &hdr.hdr_free_pages, free_pages - count)
    log_store_i64(seg, &hdr.hdr_stats.st_pages_allocated, hdr.hdr_stats.st_pages_allocated + count)
    return 0


cdef int page_incref(Segment seg, int32_t page) except -1:
    """Adds a reference to a page that is already referenced."""
    cdef int32_t* refcounts = page_refcounts(seg)
    check_page_index(seg, page)
    if refcounts[page] <= 0:
        seg.corrupt(f"page {page}: a reference added to a free page")
    log_store_i32(seg, &refcounts[page], refcounts[page] + 1)
    return 0


cdef int page_decref(Segment seg, int32_t page) except -1:
    """Drops a reference; the last one puts the page back on the free stack."""
    cdef HkvHeader* hdr = seg.hdr
    cdef int32_t* refcounts = page_refcounts(seg)
    cdef int64_t free_pages = hdr.hdr_free_pages
    check_page_index(seg, page)
    if refcounts[page] <= 0:
        seg.corrupt(f"page {page} released while free (double free)")
    if refcounts[page] == 1:
        if free_pages < 0 or free_pages >= hdr.hdr_config.cfg_num_pages:
            seg.corrupt(f"free page count {free_pages} cannot take one more page")
        log_store_i32(seg, &page_free_stack(seg)[free_pages], page)
        log_store_i64(seg, &hdr.hdr_free_pages, free_pages + 1)
        log_store_i64(seg, &hdr.hdr_stats.st_pages_freed, hdr.hdr_stats.st_pages_freed + 1)
    log_store_i32(seg, &refcounts[page], refcounts[page] - 1)
    return 0


cdef int rederive_free_stack(Segment seg) except -1:
    """Rebuilds the free stack and its count from the refcounts (recovery, creation)."""
    cdef int32_t* refcounts = page_refcounts(seg)
    cdef int32_t* stack = page_free_stack(seg)
    cdef int64_t n = seg.hdr.hdr_config.cfg_num_pages
    cdef int64_t page, top = 0
    # Highest index deepest, so that pops hand out low pages first, as after creation.
    page = n - 1
    while page >= 0:
        if refcounts[page] < 0:
            seg.corrupt(f"page {page} has refcount {refcounts[page]}")
        if refcounts[page] == 0:
            stack[top] = <int32_t>page
            top += 1
        page -= 1
    seg.hdr.hdr_free_pages = top
    return 0


add_rederive_hook(rederive_free_stack)


def alloc_pages(Segment seg, int64_t count):
    """Allocates `count` pages in one mutation; returns their indexes (np.int32).

    Raises:
        OutOfPagesError: fewer than `count` pages are free (nothing changes).
    """
    cdef cnp.ndarray[int32_t, ndim=1] out = np.empty(max(count, 0), dtype=np.int32)
    check_open(seg)
    if count < 0:
        raise ValueError(f"page count must be >= 0, got {count}")
    seg.begin()
    try:
        pages_alloc(seg, count, <int32_t*>out.data)
        seg.commit()
    finally:
        seg.end()
    return out


def free_pages(Segment seg, pages):
    """Drops one reference from each page in one mutation (all or nothing).

    Raises:
        ValueError: a page index outside the pool (nothing changes).
        CorruptionError: a page that is already free (nothing changes).
    """
    cdef cnp.ndarray[int32_t, ndim=1] arr
    cdef Py_ssize_t i
    check_open(seg)
    arr = _page_array(seg, pages)
    seg.begin()
    try:
        for i in range(arr.shape[0]):
            page_decref(seg, arr[i])
        seg.commit()
    finally:
        seg.end()


def _page_array(Segment seg, pages):
    """pages as a contiguous np.int32 array, each index checked against the pool."""
    cdef cnp.ndarray arr
    cdef const int32_t* data
    cdef int64_t i, n, num_pages
    check_open(seg)
    num_pages = seg.hdr.hdr_config.cfg_num_pages
    if type(pages) is np.ndarray and pages.dtype == np.int32 and pages.ndim == 1:
        arr = np.ascontiguousarray(pages)
    else:
        given = np.asarray(pages)
        if given.ndim != 1 or not (given.dtype.kind in "iu" or given.size == 0):
            raise ValueError(
                f"pages must be a 1-D sequence of integers, got {given.dtype} shape {given.shape}")
        if given.size and (given.min() < 0 or given.max() >= num_pages):
            raise ValueError(
                f"page indexes must be in [0, {num_pages}), got {given.min()}..{given.max()}")
        arr = np.ascontiguousarray(given, dtype=np.int32)
    data = <const int32_t*>cnp.PyArray_DATA(arr)
    n = arr.shape[0]
    for i in range(n):
        if data[i] < 0 or data[i] >= num_pages:
            raise ValueError(f"page index {data[i]} is outside [0, {num_pages})")
    return arr


def refcounts(Segment seg):
    """A copy of every page's refcount (read under the caller's lock for a consistent view)."""
    cdef int32_t[::1] view
    check_open(seg)
    view = <int32_t[:seg.hdr.hdr_config.cfg_num_pages]>page_refcounts(seg)
    return np.array(view, dtype=np.int32, copy=True)


def check_pages(Segment seg):
    """Checks the pool's invariants; call with the lock held. Raises CorruptionError."""
    cdef int32_t* refcounts
    cdef int32_t* stack
    cdef int64_t n, free_pages
    cdef int64_t i, zero = 0
    cdef int32_t page
    check_open(seg)
    refcounts = page_refcounts(seg)
    stack = page_free_stack(seg)
    n = seg.hdr.hdr_config.cfg_num_pages
    free_pages = seg.hdr.hdr_free_pages
    if free_pages < 0 or free_pages > n:
        seg.corrupt(f"free page count {free_pages} outside [0, {n}]")
    seen = np.zeros(n, dtype=np.uint8)
    for i in range(free_pages):
        page = stack[i]
        check_page_index(seg, page)
        if seen[page]:
            seg.corrupt(f"page {page} is on the free stack twice")
        seen[page] = 1
        if refcounts[page] != 0:
            seg.corrupt(f"page {page} is on the free stack with refcount {refcounts[page]}")
    for i in range(n):
        if refcounts[i] < 0:
            seg.corrupt(f"page {i} has refcount {refcounts[i]}")
        if refcounts[i] == 0:
            zero += 1
    if zero != free_pages:
        seg.corrupt(f"{zero} pages have refcount 0 but {free_pages} are on the free stack")
