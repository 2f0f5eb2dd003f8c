# cython: language_level=3, embedsignature=True
"""Fixed-size record pools with free lists; see _slab.pxd. Its Python-level names are test
hooks (tests/test_slab.py)."""

from libc.stdint cimport int32_t, int64_t
from libc.stdlib cimport free, malloc

from hostkv._layout cimport HkvSlab, HkvSlabRecord
from hostkv._lock cimport check_open, log_store_i32
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


# -- test hooks ------------------------------------------------------------------------------
# The allocator's callers are all cdef functions of other modules, so it needs no
# Python-level names. These three let tests/test_slab.py drive it directly, as
# tests/test_pages.py drives _pages through its entry points. A record they take belongs to
# no structure: take records of the sequence-page slab (only the sequences' page lists reach
# it; the tree and the lease sweep walk the other two slabs' records in use) and give them
# back before cache.check(), which counts every page-list record in use.

cdef HkvSlab* slab_of(Segment seg, str region) except NULL:
    """The slab at the header's region `region`, or ValueError."""
    cdef int64_t offset
    check_open(seg)
    if region == "reg_radix_nodes":
        offset = seg.hdr.hdr_regions.reg_radix_nodes
    elif region == "reg_sequences":
        offset = seg.hdr.hdr_regions.reg_sequences
    elif region == "reg_sequence_pages":
        offset = seg.hdr.hdr_regions.reg_sequence_pages
    else:
        raise ValueError("slab region must be reg_radix_nodes, reg_sequences or "
                         f"reg_sequence_pages, got {region!r}")
    return <HkvSlab*>(seg.base + offset)


def _mutate(Segment seg, str region, ops, bint commit=True):
    """Test hook: runs ops on the slab at `region` in one mutation; returns their results.

    Each op is ("alloc",): slab_alloc, whose result is the index taken, or -1 when none is
    free; ("alloc_many", count): slab_alloc_many, whose result is (indexes, 1 or 2), or
    None when fewer than count are free (then it takes none); ("free", index): slab_free,
    whose result is None. commit=False ends the mutation without committing it: a rollback,
    as after an exception.

    Raises:
        CorruptionError: an index outside the slab, or a record freed twice (the mutation
            is rolled back).
    """
    cdef HkvSlab* slab = slab_of(seg, region)
    cdef int32_t* out
    cdef int64_t count, k
    cdef int taken
    results = []
    seg.begin()
    try:
        for op in ops:
            if op[0] == "alloc":
                results.append(slab_alloc(seg, slab))
            elif op[0] == "alloc_many":
                count = op[1]
                out = <int32_t*>malloc(max(count, 1) * sizeof(int32_t))
                if out == NULL:
                    raise MemoryError()
                try:
                    taken = slab_alloc_many(seg, slab, count, out)
                    results.append(None if taken == 0 else ([out[k] for k in range(count)], taken))
                finally:
                    free(out)
            elif op[0] == "free":
                slab_free(seg, slab, op[1])
                results.append(None)
            else:
                raise ValueError(f"slab op must be alloc, alloc_many or free, got {op[0]!r}")
        if commit:
            seg.commit()
    finally:
        seg.end()
    return results


def _state(Segment seg, str region):
    """Test hook: the slab at `region` as a dict: capacity, record_size, free_head, used, and
    per record in_use (its flag) and next_free (its free-list link). It reads without the
    lock: call it through seg.run_locked for a consistent view."""
    cdef HkvSlab* slab = slab_of(seg, region)
    cdef HkvSlabRecord* record
    cdef int32_t i
    in_use = []
    next_free = []
    for i in range(slab.sl_capacity):
        record = slab_record(slab, i)
        in_use.append(record.sr_in_use)
        next_free.append(record.sr_next_free)
    return {"capacity": slab.sl_capacity, "record_size": slab.sl_record_size,
            "free_head": slab.sl_free_head, "used": slab.sl_used, "in_use": in_use,
            "next_free": next_free}


def _check(Segment seg, str region):
    """Test hook: slab_check of the slab at `region`; call it with the lock held.

    Raises:
        CorruptionError: the free list is not exactly the records not in use, each once, or
            the used count disagrees.
    """
    slab_check(seg, slab_of(seg, region), region)
