# cython: language_level=3, embedsignature=True
"""Fixed-size record pools with free lists; see _slab.pxd."""

from libc.stdint cimport int32_t, int64_t

from hostkv._layout cimport HkvSlab, HkvSlabRecord
from hostkv._lock cimport log_store_i32
from hostkv._segment cimport Segment


cdef int slab_index_corrupt(Segment seg, HkvSlab* slab, int64_t index, str what) except -1:
    """slab_check_index's failure, out of line (the check itself is inlined everywhere)."""
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


cdef int slab_alloc_many(Segment seg, HkvSlab* slab, int64_t count, int32_t* out) except -1:
    """Takes `count` free records into out and marks them in use, logging each in-use flag
    and the free list's head and count once. Returns 0, changing nothing, when fewer are free.

    Returns 2 when the open mutation had freed no record of this slab: each record taken was
    then free when the mutation began, so any rollback (to its start, or to a savepoint
    before this call) frees it again, and stores into its fields made right after this call,
    before any later savepoint, need no undo entries (nothing reads a free record's fields;
    its free-list link is not one of them). Returns 1 otherwise: log every store."""
    cdef int32_t index = slab.sl_free_head
    cdef HkvSlabRecord* record
    cdef int64_t k
    if count <= 0:
        return 1
    if count > <int64_t>slab.sl_capacity - slab.sl_used:
        return 0
    for k in range(count):
        if index == -1:
            seg.corrupt(f"the free list ends after {k} records; the header counts "
                        f"{slab.sl_capacity - slab.sl_used} free")
        slab_check_index(seg, slab, index, "free record")
        record = slab_record(slab, index)
        if record.sr_in_use:
            seg.corrupt(f"record {index} is on the free list but in use")
        log_store_i32(seg, &record.sr_in_use, 1)
        out[k] = index
        index = record.sr_next_free
    log_store_i32(seg, &slab.sl_free_head, index)
    log_store_i32(seg, &slab.sl_used, slab.sl_used + <int32_t>count)
    return 1 if slab_freed_in_mutation(seg, slab) else 2


cdef int slab_note_free(Segment seg, HkvSlab* slab) except -1:
    """Remembers, until the mutation ends, that it freed a record of this slab."""
    if slab_freed_in_mutation(seg, slab):
        return 0
    if seg.num_freed_slabs == 4:
        seg.num_freed_slabs = -1
    else:
        seg.freed_slabs[seg.num_freed_slabs] = <void*>slab
        seg.num_freed_slabs += 1
    return 0


cdef int slab_free(Segment seg, HkvSlab* slab, int32_t index) except -1:
    """Returns a record to the free list."""
    cdef HkvSlabRecord* record
    slab_check_index(seg, slab, index, "record")
    slab_note_free(seg, slab)
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
