# cython: language_level=3, embedsignature=True
"""The page pool: allocation, reference counts, token ids, window parts.

Window parts (a segment with num_parts > 0) follow their pages' lives:

- pages_alloc gives a free part to each fresh page it hands out, the last pages of the call
  first (a later hit ends at a sequence's end, and needs the parts of its last pages); a
  page that finds none free is still handed out, without a part (counted), never an error;
- the last reference to a page frees its part with it;
- part_donate moves a written part from a sequence's own page to the tree's page of the
  same tokens, when a commit finds the tree already holding a page without one.

So a tree page's part, when it has one, holds the KV its writer wrote with the page (a
commit vouches for the whole page, part included), and a private page's part is its
holder's alone.
"""

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


cdef int part_index_corrupt(Segment seg, int64_t part) except -1:
    seg.corrupt(f"part index {part} outside [0, {seg.hdr.hdr_config.cfg_num_parts})")
    return 0


cdef inline int check_part_index(Segment seg, int64_t part) except -1:
    if part < 0 or part >= seg.hdr.hdr_config.cfg_num_parts:
        part_index_corrupt(seg, part)
    return 0


cdef int parts_give(Segment seg, const int32_t* pages, int64_t count) except -1:
    """Gives each of the last min(count, free parts) of `count` fresh pages a free part."""
    cdef HkvHeader* hdr = seg.hdr
    cdef int32_t* page_part = page_parts(seg)
    cdef int32_t* part_page = part_pages(seg)
    cdef int32_t* stack = part_free_stack(seg)
    cdef int64_t free_parts = hdr.hdr_parts.pt_free_parts
    cdef int64_t give, j
    cdef int32_t page, part
    if free_parts < 0 or free_parts > hdr.hdr_config.cfg_num_parts:
        seg.corrupt(f"free part count {free_parts} outside [0, {hdr.hdr_config.cfg_num_parts}]")
    give = min(count, free_parts)
    for j in range(give):
        page = pages[count - give + j]
        part = stack[free_parts - 1 - j]
        check_part_index(seg, part)
        if part_page[part] != -1:
            seg.corrupt(f"part {part} is on the free stack but belongs to page {part_page[part]}")
        if page_part[page] != -1:
            seg.corrupt(f"page {page} was free with part {page_part[page]}")
        log_store_i32(seg, &part_page[part], page)
        log_store_i32(seg, &page_part[page], part)
    log_store_i64(seg, &hdr.hdr_parts.pt_free_parts, free_parts - give)
    if give:
        log_store_i64(seg, &hdr.hdr_parts.pt_parts_allocated,
                      hdr.hdr_parts.pt_parts_allocated + give)
    if give < count:
        log_store_i64(seg, &hdr.hdr_parts.pt_pages_without_part,
                      hdr.hdr_parts.pt_pages_without_part + count - give)
    return 0


cdef int part_free(Segment seg, int32_t page) except -1:
    """Puts a page's part (it has one) back on the free stack."""
    cdef HkvHeader* hdr = seg.hdr
    cdef int32_t* page_part = page_parts(seg)
    cdef int32_t* part_page = part_pages(seg)
    cdef int64_t free_parts = hdr.hdr_parts.pt_free_parts
    cdef int32_t part = page_part[page]
    check_part_index(seg, part)
    if part_page[part] != page:
        seg.corrupt(f"page {page} names part {part}, which names page {part_page[part]}")
    if free_parts < 0 or free_parts >= hdr.hdr_config.cfg_num_parts:
        seg.corrupt(f"free part count {free_parts} cannot take one more part")
    log_store_i32(seg, &part_free_stack(seg)[free_parts], part)
    log_store_i64(seg, &hdr.hdr_parts.pt_free_parts, free_parts + 1)
    log_store_i64(seg, &hdr.hdr_parts.pt_parts_freed, hdr.hdr_parts.pt_parts_freed + 1)
    log_store_i32(seg, &part_page[part], -1)
    log_store_i32(seg, &page_part[page], -1)
    return 0


cdef int part_donate(Segment seg, int32_t from_page, int32_t to_page) except -1:
    """Moves from_page's part to to_page when from_page has one and to_page has none.

    The caller vouches that both pages hold the KV of the same tokens after the same prefix
    and that from_page's part was written (a commit of from_page). Returns 1 if it moved."""
    cdef HkvHeader* hdr = seg.hdr
    cdef int32_t* page_part
    cdef int32_t* part_page
    cdef int32_t part
    if hdr.hdr_config.cfg_num_parts == 0:
        return 0
    check_page_index(seg, from_page)
    check_page_index(seg, to_page)
    page_part = page_parts(seg)
    part_page = part_pages(seg)
    part = page_part[from_page]
    if part == -1 or page_part[to_page] != -1:
        return 0
    check_part_index(seg, part)
    if part_page[part] != from_page:
        seg.corrupt(f"page {from_page} names part {part}, which names page {part_page[part]}")
    log_store_i32(seg, &page_part[from_page], -1)
    log_store_i32(seg, &page_part[to_page], part)
    log_store_i32(seg, &part_page[part], to_page)
    log_store_i64(seg, &hdr.hdr_parts.pt_parts_donated, hdr.hdr_parts.pt_parts_donated + 1)
    return 1


cdef int pages_alloc(Segment seg, int64_t count, int32_t* out) except -1:
    """Takes `count` free pages (refcount 0 -> 1) into out, each with a window part while
    any is free (see the module docstring); OutOfPagesError changes nothing."""
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
    if hdr.hdr_config.cfg_num_parts > 0 and count > 0:
        parts_give(seg, out, count)
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
    """Drops a reference; the last one puts the page (and its part) back on the free stacks."""
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
        if hdr.hdr_config.cfg_num_parts > 0 and page_parts(seg)[page] != -1:
            part_free(seg, page)
    log_store_i32(seg, &refcounts[page], refcounts[page] - 1)
    return 0


cdef int rederive_free_stack(Segment seg) except -1:
    """Rebuilds the free stacks of pages and parts and their counts from the refcounts and
    the parts' pages (recovery, creation)."""
    cdef int32_t* refcounts = page_refcounts(seg)
    cdef int32_t* stack = page_free_stack(seg)
    cdef int32_t* part_page = part_pages(seg)
    cdef int64_t n = seg.hdr.hdr_config.cfg_num_pages
    cdef int64_t page, part, top = 0
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
    stack = part_free_stack(seg)
    top = 0
    part = seg.hdr.hdr_config.cfg_num_parts - 1
    while part >= 0:
        if part_page[part] == -1:
            stack[top] = <int32_t>part
            top += 1
        part -= 1
    seg.hdr.hdr_parts.pt_free_parts = top
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


def page_parts_of(Segment seg, pages):
    """Each listed page's window part (np.int32, -1: none), read under the lock.

    A private page's part stays until its holder commits or frees the page; a cached page's
    part stays while a borrower has the page's node locked (the part LRU skips locked nodes,
    and a donation only gives a part to a page that had none). See HostKVCache.page_parts.
    """
    cdef cnp.ndarray arr = _page_array(seg, pages)
    cdef cnp.ndarray out = np.full(arr.shape[0], -1, dtype=np.int32)
    cdef const int32_t* data = <const int32_t*>cnp.PyArray_DATA(arr)
    cdef int32_t* result = <int32_t*>cnp.PyArray_DATA(out)
    cdef int32_t* page_part
    cdef int32_t* part_page
    cdef int64_t i
    cdef int32_t part
    if seg.hdr.hdr_config.cfg_num_parts == 0 or arr.shape[0] == 0:
        return out
    seg.begin()
    try:
        page_part = page_parts(seg)
        part_page = part_pages(seg)
        for i in range(arr.shape[0]):
            part = page_part[data[i]]
            if part != -1:
                check_part_index(seg, part)
                if part_page[part] != data[i]:
                    seg.corrupt(f"page {data[i]} names part {part}, which names page "
                                f"{part_page[part]}")
            result[i] = part
    finally:
        seg.end()
    return out


def part_links(Segment seg):
    """Copies of (each page's part, each part's page) as np.int32 arrays, -1 none (read
    under the caller's lock for a consistent view)."""
    cdef int32_t[::1] view
    check_open(seg)
    pages = np.full(seg.hdr.hdr_config.cfg_num_pages, -1, dtype=np.int32)
    parts = np.full(seg.hdr.hdr_config.cfg_num_parts, -1, dtype=np.int32)
    if seg.hdr.hdr_config.cfg_num_parts:
        view = <int32_t[:seg.hdr.hdr_config.cfg_num_pages]>page_parts(seg)
        pages[:] = view
        view = <int32_t[:seg.hdr.hdr_config.cfg_num_parts]>part_pages(seg)
        parts[:] = view
    return pages, parts


def refcounts(Segment seg):
    """A copy of every page's refcount (read under the caller's lock for a consistent view)."""
    cdef int32_t[::1] view
    check_open(seg)
    view = <int32_t[:seg.hdr.hdr_config.cfg_num_pages]>page_refcounts(seg)
    return np.array(view, dtype=np.int32, copy=True)


def check_pages(Segment seg):
    """Checks the pool's invariants; call with the lock held. Raises CorruptionError."""
    cdef int32_t* refcounts
    cdef int64_t i, n
    check_open(seg)
    refcounts = page_refcounts(seg)
    n = seg.hdr.hdr_config.cfg_num_pages
    for i in range(n):
        if refcounts[i] < 0:
            seg.corrupt(f"page {i} has refcount {refcounts[i]}")
    check_free_stack(seg, "page", page_free_stack(seg), seg.hdr.hdr_free_pages, n, refcounts, 0,
                     "refcount")
    check_parts(seg)


cdef int check_free_stack(Segment seg, str what, const int32_t* stack, int64_t count,
                          int64_t capacity, const int32_t* state, int32_t free_state,
                          str state_name) except -1:
    """A free stack's invariants: its count in [0, capacity], its entries in range, each
    listed once, each free (state[entry] == free_state), and every free entry listed."""
    cdef int64_t i, free_entries = 0
    cdef int32_t entry
    if count < 0 or count > capacity:
        seg.corrupt(f"free {what} count {count} outside [0, {capacity}]")
    seen = np.zeros(capacity, dtype=np.uint8)
    for i in range(count):
        entry = stack[i]
        if entry < 0 or entry >= capacity:
            seg.corrupt(f"{what} index {entry} outside [0, {capacity})")
        if seen[entry]:
            seg.corrupt(f"{what} {entry} is on the free stack twice")
        seen[entry] = 1
        if state[entry] != free_state:
            seg.corrupt(f"{what} {entry} is on the free stack with {state_name} {state[entry]}")
    for i in range(capacity):
        if state[i] == free_state:
            free_entries += 1
    if free_entries != count:
        seg.corrupt(f"{free_entries} {what}s are free but {count} are on the free stack")
    return 0


cdef int check_parts(Segment seg) except -1:
    """The window parts' invariants: page and part name each other, only held pages have a
    part, and the free stack lists exactly the parts of no page, once each."""
    cdef int32_t* refcounts = page_refcounts(seg)
    cdef int32_t* page_part = page_parts(seg)
    cdef int32_t* part_page = part_pages(seg)
    cdef int64_t n = seg.hdr.hdr_config.cfg_num_pages
    cdef int64_t num_parts = seg.hdr.hdr_config.cfg_num_parts
    cdef int64_t i
    cdef int32_t part, page
    for i in range(n):
        part = page_part[i]
        if part == -1:
            continue
        check_part_index(seg, part)
        if part_page[part] != i:
            seg.corrupt(f"page {i} names part {part}, which names page {part_page[part]}")
        if refcounts[i] == 0:
            seg.corrupt(f"free page {i} keeps part {part}")
    for i in range(num_parts):
        page = part_page[i]
        if page == -1:
            continue
        check_page_index(seg, page)
        if page_part[page] != i:
            seg.corrupt(f"part {i} names page {page}, which names part {page_part[page]}")
    check_free_stack(seg, "part", part_free_stack(seg), seg.hdr.hdr_parts.pt_free_parts,
                     num_parts, part_page, -1, "page")
    return 0
