# cython: language_level=3, embedsignature=True
"""Sequence records and their page lists, in the segment.

A sequence belongs to one lease (process). It holds the prefix it borrowed from the tree by a
lock on the node that prefix ends at (so none of it can be evicted under it), and one
reference to each of its own pages, which its page list records. When it commits, the lock
moves to the node its committed pages end at. The structures are in _layout.pxd
(HkvSequence, HkvSeqPage); the batch calls that use these building blocks are _sequences'.
Every function here that changes a record runs inside an open mutation.
"""

import numpy as np

from libc.stdint cimport int32_t, int64_t, uint64_t
from libc.stdlib cimport free, malloc

from hostkv._layout cimport (
    HkvLease, HkvRadixNode, HkvSeqPage, HkvSequence, HkvSlab, HKV_LEASE_ACTIVE,
    HKV_SEQ_PAGES_PER_ENTRY)
from hostkv._lock cimport check_open, log_store_i32, log_store_i64
from hostkv._pages cimport check_page_index, page_decref, page_refcounts
from hostkv._radix cimport Tree, tree_lock, tree_of, tree_unlock
from hostkv._segment cimport Segment, add_dead_lease_hook, add_rederive_hook
from hostkv._slab cimport (
    slab_alloc_many, slab_check, slab_check_index, slab_free, slab_freed_in_mutation,
    slab_note_free, slab_record, slab_rederive)

from hostkv.errors import CapacityError, SequenceError


cdef HkvSequence* sequence_at(Segment seg, int64_t index) except NULL:
    cdef HkvSlab* slab = sequence_slab(seg)
    cdef HkvSequence* seq
    slab_check_index(seg, slab, index, "sequence")
    seq = <HkvSequence*>slab_record(slab, <int32_t>index)
    if seq.sq_slab.sr_in_use != 1:
        seg.corrupt(f"sequence record {index} is referenced but free")
    return seq


cdef HkvSeqPage* page_entry_at(Segment seg, int64_t index) except NULL:
    cdef HkvSlab* slab = page_list_slab(seg)
    slab_check_index(seg, slab, index, "sequence page")
    return <HkvSeqPage*>slab_record(slab, <int32_t>index)


# -- building blocks (inside an open mutation) ---------------------------------------------------

cdef int32_t new_sequence(Segment seg, int64_t seq_id, uint64_t namespace, int32_t lock_node,
                          int32_t view, str call, int64_t batch, int64_t still_needed) except -1:
    """Takes a sequence record for this lease and fills it: no pages yet, holding lock_node
    (-1: none), stamped with the caller's view number and a new generation. Returns the
    record's index.

    Raises:
        CapacityError: every record is in use (the message names the call and its batch).
    """
    cdef HkvSlab* slab = sequence_slab(seg)
    cdef int32_t record
    cdef int taken = slab_alloc_many(seg, slab, 1, &record)
    cdef HkvSequence* seq
    if taken == 0:
        raise CapacityError(
            f"segment {seg.name!r}: all {slab.sl_capacity} sequence records "
            f"are in use; raise max_sequences ({call} of {batch})",
            resource="sequences", needed=still_needed, available=0)
    seq = sequence_at(seg, record)
    if taken == 2:
        # Free when the mutation began: a rollback frees it again (see slab_alloc_many).
        seq.sq_lease_slot = seg.lease_slot
        seq.sq_num_pages = 0
        seq.sq_lease_generation = seg.lease_generation
        seq.sq_seq_id = seq_id
        seq.sq_namespace = namespace
        seq.sq_first_page = -1
        seq.sq_last_page = -1
        seq.sq_lock_node = lock_node
        seq.sq_view = view
    else:
        log_store_i32(seg, &seq.sq_lease_slot, seg.lease_slot)
        log_store_i32(seg, &seq.sq_num_pages, 0)
        log_store_i64(seg, <int64_t*>&seq.sq_lease_generation, <int64_t>seg.lease_generation)
        log_store_i64(seg, &seq.sq_seq_id, seq_id)
        log_store_i64(seg, <int64_t*>&seq.sq_namespace, <int64_t>namespace)
        log_store_i32(seg, &seq.sq_first_page, -1)
        log_store_i32(seg, &seq.sq_last_page, -1)
        log_store_i32(seg, &seq.sq_lock_node, lock_node)
        log_store_i32(seg, &seq.sq_view, view)
    # Logged either way: a rollback gives the record back its generation exactly.
    log_store_i64(seg, &seq.sq_generation, seq.sq_generation + 1)
    return record


cdef HkvSeqPage* list_entry_at(Segment seg, int64_t index) except NULL:
    """Entry `index` of a sequence's page list: in use, holding 1..12 pages."""
    cdef HkvSeqPage* entry = page_entry_at(seg, index)
    if entry.sp_slab.sr_in_use != 1:
        seg.corrupt(f"page-list record {index} is listed but free")
    if entry.sp_count < 1 or entry.sp_count > HKV_SEQ_PAGES_PER_ENTRY:
        seg.corrupt(f"page-list record {index} holds {entry.sp_count} pages")
    return entry


cdef list listed_pages(Segment seg, HkvSequence* seq, int32_t index):
    """A sequence's own pages, in order, from its page list (every index checked)."""
    cdef int32_t entry_index = seq.sq_first_page, k
    cdef HkvSeqPage* entry
    cdef list pages = []
    while entry_index != -1:
        entry = list_entry_at(seg, entry_index)
        for k in range(entry.sp_count):
            check_page_index(seg, entry.sp_pages[k])
            pages.append(entry.sp_pages[k])
        if len(pages) > seq.sq_num_pages:
            seg.corrupt(f"sequence {index}'s page list is longer than its {seq.sq_num_pages} pages")
        entry_index = entry.sp_next
    return pages


cdef int extend_page_list(Segment seg, HkvSequence* seq, const int32_t* pages,
                          int64_t count) except -1:
    """Adds `count` pages (already referenced for this sequence) to the end of its page
    list: into the room its last entry has, then into new entries taken from the free list
    in one step.

    Stores into a slot past an entry's count, and into an entry that was free when the
    mutation began, are not logged: a rollback restores the counts (or frees the entry),
    and nothing reads past a count. Where the mutation has freed a page-list record (whose
    rollback would bring its old slots back in use), every store is logged."""
    cdef HkvSlab* slab = page_list_slab(seg)
    cdef bint unlogged = not slab_freed_in_mutation(seg, slab)
    cdef HkvSeqPage* entry
    cdef int32_t* entries
    cdef int32_t first_entry
    cdef int64_t k, j, here, done = 0, new_entries
    cdef int taken
    if count <= 0:
        return 0
    if seq.sq_last_page != -1:
        entry = list_entry_at(seg, seq.sq_last_page)
        done = min(HKV_SEQ_PAGES_PER_ENTRY - entry.sp_count, count)
        for j in range(done):
            if unlogged:
                entry.sp_pages[entry.sp_count + j] = pages[j]
            else:
                log_store_i32(seg, &entry.sp_pages[entry.sp_count + j], pages[j])
        if done:
            log_store_i32(seg, &entry.sp_count, entry.sp_count + <int32_t>done)
    if done < count:
        new_entries = (count - done + HKV_SEQ_PAGES_PER_ENTRY - 1) // HKV_SEQ_PAGES_PER_ENTRY
        entries = (&first_entry if new_entries == 1
                   else <int32_t*>malloc(new_entries * sizeof(int32_t)))
        if entries == NULL:
            raise MemoryError()
        try:
            taken = slab_alloc_many(seg, slab, new_entries, entries)
            if taken == 0:
                raise CapacityError(
                    f"segment {seg.name!r}: every sequence page-list record is in use "
                    f"(capacity {slab.sl_capacity}); raise sequence_page_node_capacity",
                    resource="sequence page nodes", needed=new_entries,
                    available=slab.sl_capacity - slab.sl_used)
            for k in range(new_entries):
                entry = <HkvSeqPage*>slab_record(slab, entries[k])
                here = min(HKV_SEQ_PAGES_PER_ENTRY, count - done)
                if taken == 2:
                    # Free when the mutation began: a rollback frees it again.
                    entry.sp_next = entries[k + 1] if k + 1 < new_entries else -1
                    entry.sp_count = <int32_t>here
                    for j in range(here):
                        entry.sp_pages[j] = pages[done + j]
                else:
                    log_store_i32(seg, &entry.sp_next,
                                  entries[k + 1] if k + 1 < new_entries else -1)
                    log_store_i32(seg, &entry.sp_count, <int32_t>here)
                    for j in range(here):
                        log_store_i32(seg, &entry.sp_pages[j], pages[done + j])
                done += here
            if seq.sq_last_page == -1:
                log_store_i32(seg, &seq.sq_first_page, entries[0])
            else:
                log_store_i32(seg, &page_entry_at(seg, seq.sq_last_page).sp_next, entries[0])
            log_store_i32(seg, &seq.sq_last_page, entries[new_entries - 1])
        finally:
            if entries != &first_entry:
                free(entries)
    log_store_i32(seg, &seq.sq_num_pages, seq.sq_num_pages + <int32_t>count)
    return 0


cdef int set_lock(Segment seg, Tree* t, HkvSequence* seq, int32_t node) except -1:
    """Moves the sequence's one tree lock to node (lock first, so nothing is briefly free)."""
    cdef int32_t old = seq.sq_lock_node
    if node == old:
        return 0
    if node != -1:
        tree_lock(seg, t, node)
    log_store_i32(seg, &seq.sq_lock_node, node)
    if old != -1:
        tree_unlock(seg, t, old)
    return 0


cdef int release_sequence(Segment seg, Tree* t, int32_t index, const int32_t* adopted=NULL,
                          int64_t num_adopted=0) except -1:
    """Drops everything a sequence holds: its lock, its page references (but those of the
    num_adopted pages listed in adopted, which the tree took over in this mutation: they
    must be a run of its list, in order), its records."""
    cdef HkvSequence* seq = sequence_at(seg, index)
    cdef HkvSlab* list_slab = page_list_slab(seg)
    cdef int32_t entry_index = seq.sq_first_page, next_index
    cdef int32_t count = 0
    cdef int32_t free_head = list_slab.sl_free_head
    cdef int64_t skipped = 0
    cdef int32_t freed = 0, k, page
    cdef HkvSeqPage* entry
    set_lock(seg, t, seq, -1)
    if entry_index != -1:
        slab_note_free(seg, list_slab)
    while entry_index != -1:
        entry = list_entry_at(seg, entry_index)
        for k in range(entry.sp_count):
            page = entry.sp_pages[k]
            if skipped < num_adopted and page == adopted[skipped]:
                skipped += 1                     # the tree holds this reference now
            else:
                page_decref(seg, page)
        count += entry.sp_count
        if count > seq.sq_num_pages:
            seg.corrupt(f"sequence {index}'s page list is longer than its {seq.sq_num_pages} pages")
        next_index = entry.sp_next
        # Pushed on the free list one by one, its head and count stored once at the end.
        log_store_i32(seg, &entry.sp_slab.sr_in_use, 0)
        log_store_i32(seg, &entry.sp_slab.sr_next_free, free_head)
        free_head = entry_index
        freed += 1
        entry_index = next_index
    if count != seq.sq_num_pages:
        seg.corrupt(f"sequence {index} lists {count} pages, counts {seq.sq_num_pages}")
    if skipped != num_adopted:
        seg.corrupt(f"sequence {index}'s list holds {skipped} of the {num_adopted} pages the "
                    "tree adopted from it")
    if freed:
        log_store_i32(seg, &list_slab.sl_free_head, free_head)
        log_store_i32(seg, &list_slab.sl_used, list_slab.sl_used - freed)
    slab_free(seg, sequence_slab(seg), index)
    return 0


cdef int release_dead_lease(Segment seg, int32_t slot) except -1:
    """The dead-lease hook: releases every sequence of the lease, without committing them.

    Each release is committed on its own (the sweep runs with no other change open), so a
    process holding more than one undo log's worth is still reclaimed; a death midway
    leaves the rest for the next sweep.
    """
    cdef HkvSlab* slab = sequence_slab(seg)
    cdef HkvSequence* seq
    cdef int32_t i
    cdef Tree t = tree_of(seg)
    for i in range(slab.sl_capacity):
        seq = <HkvSequence*>slab_record(slab, i)
        if seq.sq_slab.sr_in_use == 1 and seq.sq_lease_slot == slot:
            release_sequence(seg, &t, i)
            seg.commit()
    return 0


cdef int rederive_sequences(Segment seg) except -1:
    slab_rederive(seg, sequence_slab(seg))
    slab_rederive(seg, page_list_slab(seg))
    return 0


add_dead_lease_hook(release_dead_lease)
add_rederive_hook(rederive_sequences)


# -- the caller's records ----------------------------------------------------------------------

cdef HkvSequence* owned_sequence(Segment seg, int64_t index, int64_t seq_id,
                                 int64_t generation) except NULL:
    """The caller's live sequence record `index`: in use, this process's lease, the caller's
    sequence id and the record's generation at its allocation. Anything else is a stale
    handle (released already, the record reused since, or another process's) and a
    SequenceError, never a change to a record someone else now owns."""
    cdef HkvSlab* slab = sequence_slab(seg)
    cdef HkvSequence* seq
    if index < 0 or index >= slab.sl_capacity:
        raise SequenceError(f"sequence record {index} is outside [0, {slab.sl_capacity})")
    seq = <HkvSequence*>slab_record(slab, <int32_t>index)
    if seq.sq_slab.sr_in_use != 1:
        raise SequenceError(
            f"sequence {seq_id} (record {index}) is not live: released already")
    if seq.sq_lease_slot != seg.lease_slot or seq.sq_lease_generation != seg.lease_generation:
        raise SequenceError(
            f"sequence record {index} belongs to lease slot {seq.sq_lease_slot}, not to this "
            "process's lease (released already, or a view from another process)")
    if seq.sq_seq_id != seq_id or seq.sq_generation != generation:
        raise SequenceError(
            f"sequence {seq_id} (record {index}, generation {generation}) was released: the "
            f"record now holds sequence {seq.sq_seq_id}, generation {seq.sq_generation}")
    return seq


cdef list owned_by_view(Segment seg, int32_t view):
    cdef HkvSlab* slab = sequence_slab(seg)
    cdef HkvSequence* seq
    cdef int32_t i, entry_index, count
    cdef HkvSeqPage* entry
    out = []
    for i in range(slab.sl_capacity):
        seq = <HkvSequence*>slab_record(slab, i)
        if (seq.sq_slab.sr_in_use != 1 or seq.sq_view != view
                or seq.sq_lease_slot != seg.lease_slot
                or seq.sq_lease_generation != seg.lease_generation):
            continue
        out.append((i, seq.sq_generation, seq.sq_seq_id, listed_pages(seg, seq, i)))
    return out


# -- checking ------------------------------------------------------------------------------------------

def check_references(Segment seg, bint exact):
    """Checks the sequences and the reference accounting across layers (lock held).

    Each page's refcount must be its tree reference plus one per sequence listing it, and
    each node's lock count the number of sequence locks on paths through it. With
    exact=False (tests holding raw references) both are lower bounds instead.
    """
    cdef HkvSlab* slab
    cdef HkvSlab* list_slab
    cdef HkvSequence* seq
    cdef HkvSeqPage* entry
    cdef HkvLease* lease
    cdef int32_t i, k, entry_index, count, node, steps
    cdef Tree t
    cdef int32_t* refcounts
    check_open(seg)
    slab = sequence_slab(seg)
    list_slab = page_list_slab(seg)
    t = tree_of(seg)
    refcounts = page_refcounts(seg)
    slab_check(seg, slab, "sequence")
    slab_check(seg, list_slab, "sequence page")
    expected_refs = np.zeros(t.num_pages, dtype=np.int64)
    expected_locks = np.zeros(t.node_capacity, dtype=np.int64)
    listed = np.zeros(list_slab.sl_capacity, dtype=np.uint8)
    for i in range(slab.sl_capacity):
        seq = <HkvSequence*>slab_record(slab, i)
        if seq.sq_slab.sr_in_use != 1:
            continue
        lease = seg.lease_at(seq.sq_lease_slot)
        if lease.ls_state != HKV_LEASE_ACTIVE or lease.ls_generation != seq.sq_lease_generation:
            seg.corrupt(f"sequence {i} belongs to lease slot {seq.sq_lease_slot}, which is gone")
        entry_index = seq.sq_first_page
        count = 0
        while entry_index != -1:
            entry = list_entry_at(seg, entry_index)
            if listed[entry_index]:
                seg.corrupt(f"sequence {i}'s page list reuses entry {entry_index}")
            listed[entry_index] = 1
            for k in range(entry.sp_count):
                check_page_index(seg, entry.sp_pages[k])
                expected_refs[entry.sp_pages[k]] += 1
            count += entry.sp_count
            if count > seq.sq_num_pages:
                seg.corrupt(f"sequence {i}'s page list is longer than its {seq.sq_num_pages} pages")
            if entry.sp_next == -1 and entry_index != seq.sq_last_page:
                seg.corrupt(f"sequence {i}'s last page entry is not its list's end")
            entry_index = entry.sp_next
        if count != seq.sq_num_pages:
            seg.corrupt(f"sequence {i} lists {count} pages, counts {seq.sq_num_pages}")
        node = seq.sq_lock_node
        steps = 0
        while node != -1:
            if node < 0 or node >= t.node_capacity:
                seg.corrupt(f"sequence {i} locks radix node {node}, out of range")
            expected_locks[node] += 1
            node = (<HkvRadixNode*>slab_record(t.slab, node)).rn_parent
            steps += 1
            if steps > t.node_capacity:
                seg.corrupt("a cycle in the radix tree's parent links")
    if int(listed.sum()) != list_slab.sl_used:
        seg.corrupt(f"{list_slab.sl_used} page-list entries in use, {int(listed.sum())} listed")
    tree_pages = np.frombuffer(
        (<char*>t.page_next)[:t.num_pages * 4], dtype=np.int32) != -2
    expected_refs += tree_pages
    actual = np.frombuffer((<char*>refcounts)[:t.num_pages * 4], dtype=np.int32)
    bad = np.nonzero(actual != expected_refs if exact else actual < expected_refs)[0]
    if bad.size:
        p = int(bad[0])
        seg.corrupt(f"page {p} has refcount {actual[p]}, but the tree and the sequences "
                    f"hold {expected_refs[p]} references")
    for i in range(t.node_capacity):
        if (<HkvRadixNode*>slab_record(t.slab, i)).rn_slab.sr_in_use != 1:
            continue
        count = (<HkvRadixNode*>slab_record(t.slab, i)).rn_lock_count
        if (count != expected_locks[i]) if exact else (count < expected_locks[i]):
            seg.corrupt(f"radix node {i} has lock count {count}, sequences hold "
                        f"{expected_locks[i]} locks through it")


def live_sequences(Segment seg):
    """(record, lease slot, seq id, namespace, pages) of every live sequence (lock held)."""
    cdef HkvSlab* slab
    cdef HkvSequence* seq
    cdef HkvSeqPage* entry
    cdef int32_t i, entry_index
    cdef HkvSlab* list_slab
    check_open(seg)
    slab = sequence_slab(seg)
    list_slab = page_list_slab(seg)
    out = []
    for i in range(slab.sl_capacity):
        seq = <HkvSequence*>slab_record(slab, i)
        if seq.sq_slab.sr_in_use != 1:
            continue
        out.append((i, seq.sq_lease_slot, seq.sq_seq_id, seq.sq_namespace,
                    tuple(listed_pages(seg, seq, i))))
    return out
