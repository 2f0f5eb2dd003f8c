# cython: language_level=3, embedsignature=True
"""Fixed-size record pools with free lists; see _slab.pxd."""

from libc.stdint cimport int32_t, int64_t

from hostkv._layout cimport HkvSlab, HkvSlabRecord
from hostkv._segment cimport Segment, log_store_i32


cdef int slab_check_index(Segment seg, HkvSlab* slab, int64_t index, str what) except -1:
    if index < 0 or index >= slab.sl_capacity:
        seg.corrupt(f"{what} index {index} outside [0, {slab.sl_capacity})")
    return 0


cdef int32_t slab_alloc(Segment seg, HkvSlab* slab) except -2:
    """Takes a free record and marks it in use; returns its index, or -1 when none is free."""
    cdef int32_t index = slab.sl_free_head
    cdef HkvSlabRecord* record
    if index == -1:
        return -1
    slab_check_index(seg, slab, index, "free record")
    record = slab_record(slab, index)
    if record.sr_in_use:
        seg.corrupt(f"record {index} is on the free list but in use")
    log_store_i32(seg, &slab.sl_free_head, record.sr_next_free)
    log_store_i32(seg, &record.sr_in_use, 1)
    log_store_i32(seg, &slab.sl_used, slab.sl_used + 1)
    return index


cdef int slab_free(Segment seg, HkvSlab* slab, int32_t index) except -1:
    """Returns a record to the free list."""
    cdef HkvSlabRecord* record
    slab_check_index(seg, slab, index, "record")
    record = slab_record(slab, index)
    if not record.sr_in_use:
        seg.corrupt(f"record {index} freed twice")
    log_store_i32(seg, &record.sr_in_use, 0)
    log_store_i32(seg, &record.sr_next_free, slab.sl_free_head)
    log_store_i32(seg, &slab.sl_free_head, index)
    log_store_i32(seg, &slab.sl_used, slab.sl_used - 1)
    return 0


cdef int slab_rederive(Segment seg, HkvSlab* slab) except -1:
    """Rebuilds the free list (lowest index first) and the used count from the in-use flags."""
    cdef int32_t index = slab.sl_capacity - 1
    cdef int32_t head = -1, used = 0
    cdef HkvSlabRecord* record
    while index >= 0:
        record = slab_record(slab, index)
        if record.sr_in_use == 0:
            record.sr_next_free = head
            head = index
        elif record.sr_in_use == 1:
            used += 1
        else:
            seg.corrupt(f"record {index} has in-use flag {record.sr_in_use}")
        index -= 1
    slab.sl_free_head = head
    slab.sl_used = used
    return 0


cdef int slab_check(Segment seg, HkvSlab* slab, str what) except -1:
    """The free list holds exactly the records not in use, each once; the count agrees."""
    cdef int32_t index = slab.sl_free_head
    cdef int64_t free_count = 0, used = 0, i
    cdef HkvSlabRecord* record
    while index != -1:
        slab_check_index(seg, slab, index, f"{what} free list")
        record = slab_record(slab, index)
        if record.sr_in_use:
            seg.corrupt(f"{what} record {index} is on the free list but in use")
        free_count += 1
        if free_count > slab.sl_capacity:
            seg.corrupt(f"{what} free list has a cycle")
        index = record.sr_next_free
    for i in range(slab.sl_capacity):
        if slab_record(slab, <int32_t>i).sr_in_use:
            used += 1
    if used != slab.sl_used or used + free_count != slab.sl_capacity:
        seg.corrupt(f"{what}: {used} records in use, {free_count} free, header says "
                    f"{slab.sl_used} used of {slab.sl_capacity}")
    return 0
