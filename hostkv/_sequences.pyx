# cython: language_level=3, embedsignature=True
"""Sequence records and the batch entry points: allocate, append, commit, release.

A sequence belongs to one lease (process). It holds the prefix it borrowed from the tree by a
lock on the node that prefix ends at (so none of it can be evicted under it), and one
reference to each of its own pages, which its page list records. When it commits, the lock
moves to the node its committed pages end at. Each entry point is one lock and one mutation for a whole batch; the
policy (what to reuse, what to commit) is WorkerView's, in Python.
"""

import numbers
from collections.abc import Iterable

cimport cython

import numpy as np
cimport numpy as cnp
from cpython.object cimport PyObject_IsInstance

from libc.stdint cimport int32_t, int64_t, uint64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy

from hostkv._layout cimport (
    HkvHeader, HkvLease, HkvMetrics, HkvNamespaceStats, HkvRadixNode, HkvSeqPage, HkvSequence,
    HkvSlab, HKV_HINT_SLOTS, HKV_LEASE_ACTIVE, HKV_NAMESPACE_SLOTS, HKV_SEQ_PAGES_PER_ENTRY)
from hostkv._lock cimport check_open, log_store_i32, log_store_i64
from hostkv._segment cimport Segment, add_dead_lease_hook, add_rederive_hook
from hostkv._slab cimport (
    slab_alloc_many, slab_check, slab_check_index, slab_free, slab_freed_in_mutation,
    slab_note_free, slab_record, slab_rederive)
from hostkv._pages cimport check_page_index, page_decref, page_refcounts, pages_alloc
from hostkv._requests cimport SequenceRequest, new_allocation
from hostkv._radix cimport (
    BORROW_MAY_EVICT, BORROW_REFRESH, Tree, checked_i32_copy, node_depth, sequence_tokens,
    tree_borrow, tree_evict_pages, tree_insert, tree_lock, tree_of, tree_page_hash, tree_unlock)

from hostkv._tokens import BYTES_LIKE as _BYTES_LIKE, as_namespace, as_seq_id, as_tokens
from hostkv.errors import CapacityError, CorruptionError, OutOfPagesError, SequenceError

cdef object INT64_MIN = -(2**63), INT64_MAX = 2**63 - 1, NAMESPACE_LIMIT = 2**64
cdef int64_t INT32_MAX = 2**31 - 1

cnp.import_array()


cdef inline HkvSlab* sequence_slab(Segment seg) noexcept nogil:
    return <HkvSlab*>(seg.base + seg.hdr.hdr_regions.reg_sequences)


cdef inline HkvSlab* page_list_slab(Segment seg) noexcept nogil:
    return <HkvSlab*>(seg.base + seg.hdr.hdr_regions.reg_sequence_pages)


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


cdef inline int32_t* i32(cnp.ndarray arr) noexcept:
    return <int32_t*>cnp.PyArray_DATA(arr)


# -- building blocks (inside an open mutation) ---------------------------------------------------

class SweepNeeded(OutOfPagesError):
    """Raised inside a batch that is short of pages while a dead process still holds some.

    Reaping commits one dead sequence at a time, which cannot happen inside the batch's own
    mutation (a later failure must undo the batch whole), so the batch is rolled back, the
    caller reaps and tries once more.
    """


cdef int ensure_free_pages(Segment seg, Tree* t, int64_t needed) except -1:
    """Makes `needed` pages free by evicting LRU tree pages; first, if a dead process holds
    pages, raises SweepNeeded (reclaim the dead before evicting the cache).

    Returns 1 when it succeeded, 0 when even eviction cannot free enough (the caller raises).
    """
    cdef int64_t short
    if seg.hdr.hdr_free_pages >= needed:
        return 1
    if seg.dead_leases() > 0:
        raise SweepNeeded(
            f"segment {seg.name!r}: {needed} pages needed, {seg.hdr.hdr_free_pages} free, and "
            "dead processes hold pages: reap them (cache.reap()) and try again",
            needed=needed, available=seg.hdr.hdr_free_pages)
    while seg.hdr.hdr_free_pages < needed and t.state.rt_heap_size > 0:
        short = needed - seg.hdr.hdr_free_pages
        if tree_evict_pages(seg, t, short) == 0:
            break
    return 1 if seg.hdr.hdr_free_pages >= needed else 0


cdef str out_of_pages_holders(Segment seg, Tree* t, int64_t needed):
    """Says where a pool's pages are when eviction could not free `needed` of them."""
    cdef int64_t num_pages = seg.hdr.hdr_config.cfg_num_pages
    if needed > num_pages:
        return f"more than the pool's {num_pages} pages in all"
    return (f"the other {num_pages - seg.hdr.hdr_free_pages} pages are held by live sequences "
            "(their own pages, and the cached prefixes they borrow)")


cdef int check_lease(Segment seg) except -1:
    """Sequences belong to a lease: refuses a handle without one (or one being closed)."""
    if seg.lease_slot < 0:
        if seg.closing:
            # Another thread's close() has given the lease back and is about to unmap.
            raise ValueError("the segment is closed (another thread is closing it)")
        raise SequenceError("this handle has no lease (attached with lease=False)")
    return 0


cdef cnp.ndarray raw_token_array(list token_arrays, int64_t i):
    """token_arrays[i], checked to be what the compiled calls read raw (what WorkerView's
    as_tokens makes): a contiguous 1-D np.int32 array. ValueError otherwise."""
    tokens = token_arrays[i]
    if (not isinstance(tokens, np.ndarray) or tokens.ndim != 1
            or cnp.PyArray_TYPE(tokens) != cnp.NPY_INT32
            or not cnp.PyArray_IS_C_CONTIGUOUS(tokens) or not cnp.PyArray_ISNOTSWAPPED(tokens)
            or not cnp.PyArray_ISALIGNED(tokens)):
        raise ValueError(f"token_arrays[{i}] must be a contiguous, aligned, native-order "
                         "1-D np.int32 array")
    return tokens


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


cdef int count_lookup(Segment seg, Tree* t, const int32_t* tokens, int64_t num_tokens,
                      uint64_t namespace, int64_t reusable, int64_t found, int64_t kept,
                      int32_t min_reuse_pages) except -1:
    """Counts one allocation request in the shared stats and metrics (logged: a batch that
    fails counts nothing). found: pages the borrow matched; kept: pages it kept."""
    cdef HkvHeader* hdr = seg.hdr
    cdef HkvMetrics* m = seg.metrics
    cdef HkvNamespaceStats* slot = namespace_slot(seg, namespace)
    cdef int64_t* reason
    cdef uint64_t next_hash
    cdef int32_t page_size = hdr.hdr_config.cfg_page_size
    cdef int64_t at
    log_store_i64(seg, &hdr.hdr_stats.st_lookups, hdr.hdr_stats.st_lookups + 1)
    log_store_i64(seg, &hdr.hdr_stats.st_lookup_tokens, hdr.hdr_stats.st_lookup_tokens + num_tokens)
    log_store_i64(seg, &hdr.hdr_stats.st_hit_tokens, hdr.hdr_stats.st_hit_tokens + kept * page_size)
    log_store_i64(seg, &slot.ns_lookup_tokens, slot.ns_lookup_tokens + num_tokens)
    log_store_i64(seg, &slot.ns_hit_tokens, slot.ns_hit_tokens + kept * page_size)
    if reusable <= 0:
        return 0
    if kept == reusable:
        reason = &m.mt_full_hits
    elif 0 < found < min_reuse_pages:
        reason = &m.mt_miss_below_minimum
    else:
        # Why did the match stop at page `found`? The hint tables remember recently evicted
        # pages and top-level pages of every namespace (best effort, see HkvMetrics).
        next_hash = tree_page_hash(t, tokens + found * page_size)
        at = next_hash & (HKV_HINT_SLOTS - 1)
        if m.mt_evicted_hashes[at] == next_hash:
            reason = &m.mt_miss_evicted
        elif found == 0 and m.mt_top_hashes[at] == next_hash and m.mt_top_namespaces[at] != namespace:
            reason = &m.mt_miss_namespace
        else:
            reason = &m.mt_miss_no_prefix
    log_store_i64(seg, reason, reason[0] + 1)
    return 0


cdef HkvNamespaceStats* namespace_slot(Segment seg, uint64_t namespace) except NULL:
    """The counters of a namespace: claimed on first use; past the table, the last "other"."""
    cdef HkvMetrics* m = seg.metrics
    cdef int64_t start = <int64_t>((namespace * 0x9E3779B97F4A7C15ULL) >> 58)   # 0..63
    cdef int64_t probe, i
    cdef HkvNamespaceStats* slot
    for probe in range(HKV_NAMESPACE_SLOTS - 1):
        i = (start + probe) % (HKV_NAMESPACE_SLOTS - 1)
        slot = &m.mt_namespaces[i]
        if slot.ns_used and slot.ns_namespace == namespace:
            return slot
        if not slot.ns_used:
            log_store_i64(seg, <int64_t*>&slot.ns_namespace, <int64_t>namespace)
            log_store_i64(seg, &slot.ns_used, 1)
            return slot
    slot = &m.mt_namespaces[HKV_NAMESPACE_SLOTS - 1]
    if not slot.ns_used:
        log_store_i64(seg, &slot.ns_used, 1)
    return slot


# -- the batch entry points --------------------------------------------------------------------------

cdef HkvSequence* owned_sequence(Segment seg, int64_t index, int64_t seq_id,
                                 int64_t generation) except NULL:
    """The caller's live sequence record `index`: in use, this process's lease, the caller's
    sequence id and the record's generation at its allocation. Anything else is a stale
    handle (released already, the record reused since, or another process's) and a
    SequenceError, never a change to a record someone else now owns (issue 10, item 3)."""
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


# -- the view's side of a sequence -------------------------------------------------------------

@cython.final                     # no subclass can skip filling it
@cython.auto_pickle(False)        # names a record of this process's view: never pickled
cdef class ViewSequence:
    """A WorkerView's own bookkeeping of one live sequence (process-private).

    The segment's record is named by (record, seq_id, generation). Compiled so that the
    view's calls fill, step and release these without Python per sequence; what to do with
    them (the view's policy) stays in worker_view.py.

    Attributes:
        seq_id, record, generation, namespace: the sequence and its segment record (the
            record's generation at allocation names this use of it).
        tokens: its token ids (np.int32, the view's own, never the caller's); the first
            num_tokens are used, the rest is room (grown by doubling).
        num_tokens: tokens so far; cacheable_tokens: leading tokens with known ids.
        reused_tokens: prompt tokens borrowed at allocation.
        committed_pages: leading pages the cache holds for it.
        pages: its page table (np.int32); the first num_pages are used. The allocation's
            table is shared with the caller read-only, so a step never writes into it: it
            grows into an array of the view's own first.
    """

    cdef readonly int64_t seq_id
    cdef readonly int64_t record      # checked against the segment at every use
    cdef readonly int64_t generation
    cdef uint64_t _namespace
    cdef readonly cnp.ndarray tokens
    cdef readonly int64_t num_tokens, cacheable_tokens, reused_tokens, num_pages
    cdef public int64_t committed_pages
    cdef readonly cnp.ndarray pages
    cdef int64_t step_mark            # the last decode step that listed it (see append_tokens)

    def __init__(self, int64_t seq_id, int64_t record, int64_t generation, uint64_t namespace,
                 cnp.ndarray tokens, int64_t reused_tokens, int64_t reused_pages,
                 cnp.ndarray pages):
        if not (plain_int32(tokens) and plain_int32(pages)):
            raise ValueError("a ViewSequence needs contiguous, aligned, native-order 1-D "
                             "np.int32 tokens and pages")
        fill_view_sequence(self, seq_id, record, generation, namespace, tokens, reused_tokens,
                           reused_pages, pages)

    @property
    def namespace(self):
        return self._namespace


cdef object TOKEN_LIMIT = 2**31
cdef int64_t last_step_mark = 0       # numbers append_tokens calls (see ViewSequence.step_mark)


cdef bint plain_int32(cnp.ndarray arr) noexcept:
    """A contiguous, aligned, native-order 1-D np.int32 array (read raw by the C code)."""
    return (arr is not None and cnp.PyArray_TYPE(arr) == cnp.NPY_INT32
            and cnp.PyArray_NDIM(arr) == 1 and cnp.PyArray_IS_C_CONTIGUOUS(arr)
            and cnp.PyArray_ISNOTSWAPPED(arr) and cnp.PyArray_ISALIGNED(arr))


cdef int check_filled(ViewSequence seq) except -1:
    """Refuses a ViewSequence made without its __init__ (its arrays are None)."""
    if seq.tokens is None or seq.pages is None:
        raise ValueError("this ViewSequence was never filled (made without __init__)")
    return 0


cdef int fill_view_sequence(ViewSequence seq, int64_t seq_id, int64_t record, int64_t generation,
                            uint64_t namespace, cnp.ndarray tokens, int64_t reused_tokens,
                            int64_t reused_pages, cnp.ndarray pages) except -1:
    seq.seq_id = seq_id
    seq.record = record
    seq.generation = generation
    seq._namespace = namespace
    # Exact-size arrays: the first decode step grows them, so most sequences of a
    # prefill-heavy load never pay for room they do not use.
    seq.tokens = tokens
    seq.num_tokens = seq.cacheable_tokens = tokens.shape[0]
    seq.reused_tokens = reused_tokens
    seq.committed_pages = reused_pages
    seq.pages = pages
    seq.num_pages = pages.shape[0]
    return 0


cdef cnp.ndarray grown(cnp.ndarray arr, int64_t used, int64_t least):
    """A new writable int32 array of twice arr's length (at least `least`), holding arr's
    first `used` ids."""
    cdef int64_t size = max(2 * arr.shape[0], least)
    cdef cnp.ndarray out = cnp.PyArray_EMPTY(1, [size], cnp.NPY_INT32, 0)
    memcpy(cnp.PyArray_DATA(out), cnp.PyArray_DATA(arr), used * sizeof(int32_t))
    return out


cdef int reserve_token(ViewSequence seq) except -1:
    """Makes room for one more token (may allocate; changes nothing the view can see)."""
    if seq.num_tokens == seq.tokens.shape[0]:
        seq.tokens = grown(seq.tokens, seq.num_tokens, 16)
    return 0


cdef int reserve_page(ViewSequence seq) except -1:
    """Makes room for one more page in an array of the view's own (the allocation's table is
    the caller's to read: never written)."""
    if (seq.num_pages == seq.pages.shape[0]
            or not cnp.PyArray_CHKFLAGS(seq.pages, cnp.NPY_ARRAY_WRITEABLE)):
        seq.pages = grown(seq.pages, seq.num_pages, 4)
    return 0


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


cdef int64_t* i64(cnp.ndarray arr) noexcept:
    return <int64_t*>cnp.PyArray_DATA(arr)


@cython.final
@cython.auto_pickle(False)        # names this process's segment handle: never pickled
cdef class ViewState:
    """What a WorkerView hands each of its compiled calls as one argument: its segment, its
    sequences by id, its policy numbers, and its counters, which the calls update in C with
    the bookkeeping they count.

    Attributes:
        segment: the view's open segment.
        live: seq id -> ViewSequence, the view's sequences.
        page_size, pool_pages: the segment's page size and its pool's size in pages.
        reuse_enabled, min_reuse_pages, min_store_pages: the view's prefix policy.
        view: the view's number, stamped on its records.
        requests, prompt_tokens, reused_tokens, committed_pages: the view's counters.
    """

    cdef readonly Segment segment
    cdef readonly dict live
    cdef readonly int32_t page_size, min_reuse_pages, min_store_pages, view
    cdef readonly int64_t pool_pages
    cdef readonly bint reuse_enabled
    cdef public int64_t requests, prompt_tokens, reused_tokens, committed_pages

    def __init__(self, Segment segment not None, dict live not None, int32_t page_size,
                 int64_t pool_pages, bint reuse_enabled, int32_t min_reuse_pages,
                 int32_t min_store_pages, int32_t view):
        if page_size <= 0:
            raise ValueError(f"page size must be positive, got {page_size}")
        self.segment = segment
        self.live = live
        self.page_size = page_size
        self.pool_pages = pool_pages
        self.reuse_enabled = reuse_enabled
        self.min_reuse_pages = min_reuse_pages
        self.min_store_pages = min_store_pages
        self.view = view


cdef int check_state(ViewState state) except -1:
    """Refuses a ViewState made without its __init__ (its segment and dict are None)."""
    if state.segment is None or state.live is None:
        raise ValueError("this ViewState was never filled (made without __init__)")
    return 0


def allocate_requests(ViewState state not None, requests, list seq_ids):
    """WorkerView's allocation in one call: checks a batch of its SequenceRequests as
    checked_requests does, allocates them (allocate_sequences), all before anything shared
    is touched or nothing at all, then records each in state.live (seq id -> ViewSequence)
    and counts the batch in state's counters.

    Returns one SequenceAllocation per request, in order. seq_ids names the ids that may
    have been recorded, for a caller interrupted midway.

    Raises:
        SequenceError, ValueError, OutOfPagesError: a bad request (nothing changed).
        OutOfPagesError, CapacityError: nothing changed.
    """
    cdef Py_ssize_t i, n
    cdef int64_t prompt_tokens = 0, reused_tokens = 0
    cdef int32_t page_size = state.page_size
    cdef Segment seg = state.segment
    cdef dict live = state.live
    cdef list token_arrays, namespaces, sequences, allocations
    cdef ViewSequence seq
    check_state(state)
    token_arrays, namespaces = checked_requests(requests, live, page_size, state.pool_pages,
                                                seq_ids)
    n = len(token_arrays)
    if n == 0:
        return []
    check_open(seg)
    if page_size != seg.hdr.hdr_config.cfg_page_size:
        raise ValueError(f"page size {page_size} is not the segment's "
                         f"{seg.hdr.hdr_config.cfg_page_size}")
    sequences = []
    for i in range(n):
        seq = ViewSequence.__new__(ViewSequence)
        seq.seq_id = seq_ids[i]
        seq._namespace = namespaces[i]
        seq.tokens = token_arrays[i]
        seq.num_tokens = seq.cacheable_tokens = seq.tokens.shape[0]
        sequences.append(seq)
    allocate_sequences(seg, sequences, page_size,
                       state.reuse_enabled, state.min_reuse_pages, state.view)
    allocations = []
    for i in range(n):
        seq = sequences[i]
        live[seq.seq_id] = seq
        allocations.append(new_allocation(seq.seq_id, seq.reused_tokens, seq.pages, page_size))
        prompt_tokens += seq.num_tokens
        reused_tokens += seq.reused_tokens
    state.requests += n
    state.prompt_tokens += prompt_tokens
    state.reused_tokens += reused_tokens
    return allocations


def check_requests(requests, dict live, list seq_ids):
    """checked_requests without the pool's size (WorkerView.hold_cached_pages: a hold takes
    no page): returns (token arrays, namespaces)."""
    return checked_requests(requests, live, 1, 0, seq_ids)


cdef tuple checked_requests(requests, dict live, int32_t page_size, int64_t pool_pages,
                            list seq_ids):
    """Checks a batch of a WorkerView's SequenceRequests as the view
    documents, in the order it documents, and reads each prompt into an int32 array of the
    view's own and each namespace; touches nothing shared. pool_pages > 0: a prompt longer
    than the pool (in pages of page_size) is an OutOfPagesError.

    seq_ids is emptied, then receives each request's id once it is checked to be new to
    the view (live: the view's sequences by id), so that a caller interrupted midway knows
    which ids may have been recorded. Returns (token arrays, namespaces)."""
    cdef Py_ssize_t index, n
    cdef int64_t num_tokens, pages
    cdef cnp.ndarray tokens
    cdef bint exact
    cdef set seen
    cdef list token_arrays = [], namespaces = []
    del seq_ids[:]
    n = len(requests)
    seen = set() if n > 1 else None
    for index in range(n):
        request = requests[index]
        # A plain SequenceRequest's fields are read as struct members. Anything else that
        # Python calls one (a subclass, which may make a field a property; a test's mock)
        # is read through its attributes, as any Python caller would read it.
        exact = type(request) is SequenceRequest
        if not exact and not PyObject_IsInstance(request, SequenceRequest):
            raise SequenceError(f"requests[{index}] is a {type(request).__name__}, "
                                "not a SequenceRequest")
        seq_id = (<SequenceRequest>request).seq_id if exact else request.seq_id
        if type(seq_id) is not int or not INT64_MIN <= seq_id <= INT64_MAX:
            seq_id = as_seq_id(seq_id)
        if seen is not None:
            if seq_id in seen:
                raise SequenceError(f"sequence {seq_id} appears twice in the batch")
            seen.add(seq_id)
        if seq_id in live:
            raise SequenceError(f"sequence {seq_id} is already live in this view")
        seq_ids.append(seq_id)
        tokens = private_tokens((<SequenceRequest>request).tokens if exact else request.tokens,
                                index)
        num_tokens = tokens.shape[0]
        if num_tokens == 0:
            raise SequenceError(f"sequence {seq_id} has an empty prompt")
        pages = (num_tokens + page_size - 1) // page_size
        if 0 < pool_pages < pages:
            # Can never fit, whatever is evicted: say so before locking (and evicting).
            raise OutOfPagesError(
                f"sequence {seq_id}'s prompt of {num_tokens} tokens needs {pages} pages, more "
                f"than the pool's {pool_pages} pages in all", needed=pages, available=pool_pages)
        token_arrays.append(tokens)
        namespace = (<SequenceRequest>request).namespace if exact else request.namespace
        if type(namespace) is not int or not 0 <= namespace < NAMESPACE_LIMIT:
            namespace = as_namespace(namespace)
        namespaces.append(namespace)
    return token_arrays, namespaces


cdef cnp.ndarray private_tokens(raw, Py_ssize_t index):
    """A request's prompt as a new contiguous int32 array (never the caller's memory): lists,
    tuples and int32 arrays in one C call each, anything else through as_tokens."""
    cdef object tokens = None
    if type(raw) is list or type(raw) is tuple:
        tokens = sequence_tokens(raw, "requests", index)
    elif (type(raw) is np.ndarray and cnp.PyArray_TYPE(raw) == cnp.NPY_INT32
          and cnp.PyArray_NDIM(raw) == 1 and cnp.PyArray_IS_C_CONTIGUOUS(raw)
          and cnp.PyArray_ISNOTSWAPPED(raw) and cnp.PyArray_ISALIGNED(raw)):
        tokens = checked_i32_copy(raw)
    if tokens is None:
        tokens = as_tokens(raw, f"requests[{index}].tokens", True)
    return tokens


cdef int allocate_sequences(Segment seg, list sequences, int32_t page_size, bint reuse,
                            int32_t min_reuse_pages, int32_t view) except -1:
    """Allocates a batch of new ViewSequences under one lock, all or nothing.

    Each comes with its seq id, namespace and tokens set, and nothing else. With reuse, it
    borrows up to (num_tokens - 1) // page_size cached pages (the last token is always
    computed, so the engine has logits to sample from), kept only if at least
    min_reuse_pages match; then it takes the rest of its ceil(num_tokens / page_size)
    pages (evicting as needed) and a record stamped with the caller's view number.
    Every request borrows its prefix before anything is evicted for the batch, so one
    request's eviction never takes the prefix another request of the same batch matched.
    Fills each sequence's record, generation, page table (read-only: it is handed to the
    caller) and reused tokens; a sequence of a batch that raised stays unfilled.

    Raises:
        OutOfPagesError, CapacityError: nothing changed.
    """
    cdef Tree t
    cdef int32_t record
    cdef Py_ssize_t i, n = len(sequences)
    cdef int64_t total, matched, found, fresh, mark, reusable
    cdef int64_t batch_fresh = 0        # fresh pages the whole batch needs
    cdef cnp.ndarray table
    cdef ViewSequence seq
    cdef HkvSequence* rec
    cdef HkvHeader* hdr
    cdef int32_t one_node
    # Per request: the node its borrow locked (-1: none), until its record holds the lock.
    cdef int32_t* nodes = &one_node if n == 1 else <int32_t*>malloc(n * sizeof(int32_t))
    if nodes == NULL:
        raise MemoryError()
    try:
        for i in range(n):
            # Made before the lock: other processes do not wait for our allocator.
            seq = sequences[i]
            seq.num_pages = (seq.num_tokens + page_size - 1) // page_size
            seq.pages = cnp.PyArray_EMPTY(1, [seq.num_pages], cnp.NPY_INT32, 0)
        check_lease(seg)
        seg.begin()
        try:
            t = tree_of(seg)
            hdr = seg.hdr
            # 1. Borrow every request's prefix: a locked node cannot be evicted below.
            for i in range(n):
                seq = sequences[i]
                total = seq.num_pages
                table = seq.pages
                matched = found = 0
                nodes[i] = -1
                reusable = (seq.num_tokens - 1) // page_size if reuse else 0
                if reusable > 0:
                    mark = hdr.hdr_undo_count
                    matched = found = tree_borrow(seg, &t, i32(seq.tokens), reusable,
                                                  seq._namespace, i32(table), &nodes[i],
                                                  BORROW_REFRESH | BORROW_MAY_EVICT)
                    if matched < min_reuse_pages:
                        # Too short to be worth it: undo the borrow whole (split, lock, touch).
                        seg.rollback_to(mark)
                        matched = 0
                        nodes[i] = -1
                count_lookup(seg, &t, i32(seq.tokens), seq.num_tokens, seq._namespace,
                             reusable, found, matched, min_reuse_pages)
                batch_fresh += total - matched
                seq.committed_pages = matched
            # 2. Free the batch's fresh pages at once, evicting only what nobody borrowed.
            if not ensure_free_pages(seg, &t, batch_fresh):
                raise OutOfPagesError(
                    f"segment {seg.name!r}: the batch of {n} needs {batch_fresh} new pages, "
                    f"{out_of_pages_holders(seg, &t, batch_fresh)}; only {hdr.hdr_free_pages} "
                    "are free or evictable",
                    needed=batch_fresh, available=hdr.hdr_free_pages)
            # 3. Record the sequences and hand out their fresh pages.
            for i in range(n):
                seq = sequences[i]
                matched = seq.committed_pages
                fresh = seq.num_pages - matched
                # The borrow locked the node (if any) for this sequence: it is the sequence's.
                record = new_sequence(seg, seq.seq_id, seq._namespace, nodes[i], view, "batch",
                                      n, n - i)
                rec = sequence_at(seg, record)
                # The borrowed prefix is held by the lock on its node (it cannot be evicted
                # while locked), not by page references: only its own pages are listed.
                pages_alloc(seg, fresh, i32(seq.pages) + matched)
                extend_page_list(seg, rec, i32(seq.pages) + matched, fresh)
                cnp.PyArray_CLEARFLAGS(seq.pages, cnp.NPY_ARRAY_WRITEABLE)
                seq.record = record
                seq.generation = rec.sq_generation
                seq.reused_tokens = matched * page_size
            seg.commit()
        finally:
            seg.end()
    finally:
        if nodes != &one_node:
            free(nodes)
    return 0


def hold(Segment seg, list token_arrays, cnp.ndarray seq_ids, list namespaces, int32_t view):
    """Records a batch of sequences that each hold the longest cached prefix of their tokens
    (full pages only) and nothing else, under one lock, all or nothing.

    Unlike allocate, a hold is not a use: it refreshes no recency, counts in no lookup stats,
    takes no fresh page and evicts nothing (a borrow ending inside a node splits it only if
    a node record is free, else stops at the node's start). A tier copies the held pages
    out, then releases the sequences. Returns a list of (record index, held pages, page
    table of the held pages, record generation), as an allocation does.

    Raises:
        CapacityError: sequence records ran out; nothing changed.
    """
    cdef Tree t
    cdef int32_t page_size, node, record
    cdef int64_t i, n = len(token_arrays), matched
    cdef cnp.ndarray tokens, table
    cdef HkvSequence* seq
    cdef int64_t* ids = <int64_t*>cnp.PyArray_DATA(seq_ids)
    check_open(seg)
    if (seq_ids.ndim != 1 or cnp.PyArray_TYPE(seq_ids) != cnp.NPY_INT64
            or not cnp.PyArray_IS_C_CONTIGUOUS(seq_ids)):
        raise ValueError("seq_ids must be a contiguous 1-D np.int64 array")
    if seq_ids.shape[0] != n or len(namespaces) != n:
        raise ValueError("hold needs one seq id and one namespace per token array")
    for i in range(n):
        # Read raw below: each must be what WorkerView's as_tokens makes.
        tokens = raw_token_array(token_arrays, i)
        if not isinstance(namespaces[i], int) or not 0 <= namespaces[i] < 2**64:
            raise ValueError(f"namespaces[{i}] must be an int in [0, 2**64)")
    check_lease(seg)
    results = []
    seg.begin()
    try:
        t = tree_of(seg)
        page_size = seg.hdr.hdr_config.cfg_page_size
        if page_size <= 0:
            seg.corrupt(f"page size {page_size} in the header")
        for i in range(n):
            tokens = token_arrays[i]
            table = np.empty(tokens.shape[0] // page_size, dtype=np.int32)
            node = -1
            matched = tree_borrow(seg, &t, i32(tokens), table.shape[0], namespaces[i],
                                  i32(table), &node, 0)
            record = new_sequence(seg, ids[i], namespaces[i], node, view, "hold", n, n - i)
            seq = sequence_at(seg, record)
            results.append((record, matched, table[:matched], seq.sq_generation))
        seg.commit()
    finally:
        seg.end()
    return results


cdef cnp.ndarray step_pages(Segment seg, cnp.ndarray records, cnp.ndarray seq_ids,
                            cnp.ndarray generations):
    """Gives each listed sequence one more page (a decode step filled its last one).

    records (np.int32), seq_ids and generations (np.int64) name the caller's sequences, as
    allocate returned them. All or nothing; evicts when short. Returns the new pages
    (np.int32, one per record).
    """
    cdef Tree t
    cdef int64_t i, n = records.shape[0]
    cdef int32_t* recs = i32(records)
    cdef int64_t* ids
    cdef int64_t* gens
    cdef cnp.ndarray pages = cnp.PyArray_EMPTY(1, [n], cnp.NPY_INT32, 0)
    check_open(seg)
    if (records.dtype != np.int32 or seq_ids.dtype != np.int64 or generations.dtype != np.int64
            or seq_ids.shape[0] != n or generations.shape[0] != n
            or not (records.flags.c_contiguous and seq_ids.flags.c_contiguous
                    and generations.flags.c_contiguous)):
        raise ValueError("step_pages needs contiguous int32 records and int64 seq_ids and "
                         "generations of one length")
    ids = i64(seq_ids)
    gens = i64(generations)
    if n == 0:
        return pages
    seg.begin()
    try:
        t = tree_of(seg)
        for i in range(n):
            owned_sequence(seg, recs[i], ids[i], gens[i])
        if not ensure_free_pages(seg, &t, n):
            raise OutOfPagesError(
                f"segment {seg.name!r}: this decode step needs {n} new pages, only "
                f"{seg.hdr.hdr_free_pages} can be freed: {out_of_pages_holders(seg, &t, n)}", needed=n,
                available=seg.hdr.hdr_free_pages)
        pages_alloc(seg, n, i32(pages))
        for i in range(n):
            extend_page_list(seg, owned_sequence(seg, recs[i], ids[i], gens[i]), i32(pages) + i, 1)
        seg.commit()
    finally:
        seg.end()
    return pages


cdef enum:
    COMMIT_PAGES_ON_STACK = 256


cdef int64_t commit_one(Segment seg, Tree* t, HkvSequence* seq, const int32_t* tokens,
                        const int32_t* table, int64_t num_pages, uint64_t namespace,
                        bint adopt, int64_t* adopted_from) except -1:
    """Caches a sequence's first num_pages pages; best effort for node records. Returns the
    pages the tree now holds for it (0 when radix node records ran out even after eviction:
    that insert is undone, nothing else).

    adopt (the sequence is released right after, in this mutation): the tree takes over the
    sequence's references on the pages it adopts, table[*adopted_from:num_pages], which the
    release must then not drop (*adopted_from is num_pages when it adopted none); its lock
    stays where it was, for the release to drop.

    Raises:
        CapacityError: the undo log ran out (resource "undo log"). That is not best effort:
            a log too small for the batch is a configuration error that would otherwise
            show up only as "0 pages cached" (issue 10, item 10); the caller's whole
            mutation is rolled back, as for any operation too big for the log.
    """
    cdef int32_t node = -1
    cdef int64_t mark = seg.hdr.hdr_undo_count, existing
    # Most commits fit on the stack: no allocator call while holding the lock.
    cdef int32_t on_stack[COMMIT_PAGES_ON_STACK]
    cdef int32_t* tree_pages = &on_stack[0]
    if num_pages > COMMIT_PAGES_ON_STACK:
        tree_pages = <int32_t*>malloc(num_pages * sizeof(int32_t))
    adopted_from[0] = num_pages
    if tree_pages == NULL:
        raise MemoryError()
    try:
        # From the end of the prefix the sequence holds (borrowed, or committed before):
        # its later pages' KV was computed on that prefix, which needs no comparing again.
        existing = tree_insert(seg, t, tokens, table, num_pages, namespace, tree_pages, &node,
                               seq.sq_lock_node, adopt)
        if adopt:
            # Released right after, in this mutation: moving the lock to the new node would
            # lock and then unlock it and every ancestor for nothing.
            adopted_from[0] = existing
            return num_pages
        # The lock must end exactly where this sequence's tokens have been matched, since
        # the next commit starts from its end without comparing: an insert that found every
        # page cached inside a node it could not split answers that whole node, whose later
        # pages may hold other tokens. Keep the old lock then (the prefix it ends stays
        # exact; the pages past it are the tree's or held by this sequence's references).
        if node != -1 and node_depth(seg, t, node) > num_pages:
            node = seq.sq_lock_node
        set_lock(seg, t, seq, node)
    except CapacityError as exc:
        if exc.resource != "radix nodes":
            raise
        seg.rollback_to(mark)
        adopted_from[0] = num_pages
        return 0
    finally:
        if tree_pages != &on_stack[0]:
            free(tree_pages)
    return num_pages


cdef list commit_sequences(Segment seg, list sequences, list num_pages, bint release):
    """Commits each ViewSequence's first num_pages[i] pages (best effort, where > 0), then,
    with release, releases it; one lock and one mutation. Returns the pages cached for each.

    Only a sequence's first num_pages[i] pages and their tokens are read; its record, seq id
    and generation name it to the segment, as allocate returned them."""
    cdef Tree t
    cdef Py_ssize_t i, n = len(sequences)
    cdef int64_t count, adopted_from
    cdef int32_t page_size
    cdef ViewSequence seq
    cdef HkvSequence* record
    check_open(seg)
    if len(num_pages) != n:
        raise ValueError("commit/release need one page count per sequence")
    page_size = seg.hdr.hdr_config.cfg_page_size
    for i in range(n):
        seq = sequences[i]
        check_filled(seq)
        count = num_pages[i]
        if count > 0 and (count * page_size > seq.num_tokens or count > seq.num_pages):
            raise ValueError(f"commit of {count} pages: only {seq.num_tokens} tokens and "
                             f"{seq.num_pages} pages given")
    cached = [0] * n
    seg.begin()
    try:
        t = tree_of(seg)
        for i in range(n):
            seq = sequences[i]
            owned_sequence(seg, seq.record, seq.seq_id, seq.generation)
        for i in range(n):
            seq = sequences[i]
            count = num_pages[i]
            # Checked again at each use: a record listed twice is released by its first use.
            record = owned_sequence(seg, seq.record, seq.seq_id, seq.generation)
            adopted_from = count = max(count, 0)
            if count > 0:
                cached[i] = commit_one(seg, &t, record, i32(seq.tokens), i32(seq.pages),
                                       count, seq._namespace, release, &adopted_from)
            if release:
                release_sequence(seg, &t, <int32_t>seq.record, i32(seq.pages) + adopted_from,
                                 count - adopted_from)
        seg.commit()
    finally:
        seg.end()
    return cached


cdef list named_sequences(list records, list seq_ids, list generations, list token_arrays,
                          list tables, list num_pages, list namespaces):
    """ViewSequences for the raw commit and release: (record, seq id, generation, whole token
    and page arrays, namespace) per sequence."""
    cdef Py_ssize_t i, n = len(records)
    if not (len(seq_ids) == len(generations) == len(token_arrays) == len(tables)
            == len(num_pages) == len(namespaces) == n):
        raise ValueError("commit/release need one seq id, generation, token array, table, "
                         "page count and namespace per record")
    for i in range(n):
        if not isinstance(namespaces[i], int) or not 0 <= namespaces[i] < NAMESPACE_LIMIT:
            raise ValueError(f"namespaces[{i}] must be an int in [0, 2**64)")
    return [ViewSequence(seq_ids[i], records[i], generations[i], namespaces[i],
                         token_arrays[i], 0, 0, tables[i]) for i in range(n)]


def commit(Segment seg, list records, list seq_ids, list generations, list token_arrays,
           list tables, list num_pages, list namespaces):
    """Caches the first num_pages[i] pages of each sequence; one lock for the batch.

    Best effort per sequence: returns the pages cached for each (0 where node records ran
    out even after eviction)."""
    return commit_sequences(seg, named_sequences(records, seq_ids, generations, token_arrays,
                                                 tables, num_pages, namespaces),
                            num_pages, False)


def release(Segment seg, list records, list seq_ids, list generations, list token_arrays,
            list tables, list num_pages, list namespaces):
    """Commits (where num_pages[i] > 0, best effort) then releases each sequence; one lock.

    Returns the pages cached for each."""
    return commit_sequences(seg, named_sequences(records, seq_ids, generations, token_arrays,
                                                 tables, num_pages, namespaces),
                            num_pages, True)


cdef int note_cached(ViewState state, ViewSequence seq, int64_t pages) except -1:
    """Records that the cache now holds a sequence's first `pages` pages (0: nothing new),
    counting the newly committed ones in the view's counter."""
    if pages:
        state.committed_pages += pages - seq.committed_pages
        seq.committed_pages = pages
    return 0


def commit_view_sequences(ViewState state not None, list sequences, list num_pages):
    """WorkerView's commit: caches the first num_pages[i] pages of each of its ViewSequences
    (best effort per sequence), then records and counts what each now has committed.
    Returns the pages cached for each (0 where nothing new was)."""
    cdef Py_ssize_t i
    cdef list cached
    check_state(state)
    cached = commit_sequences(state.segment, sequences, num_pages, False)
    for i in range(len(sequences)):
        note_cached(state, sequences[i], cached[i])
    return cached


def release_sequences(ViewState state not None, list sequences, bint commit):
    """WorkerView's release in one call: release() for its ViewSequences, the pages each
    commits worked out here, then each is dropped from state.live and the newly committed
    pages are counted in state.committed_pages.

    With commit (and the view's reuse enabled), a sequence caches its full known pages
    (cacheable_tokens // page_size) where there are at least min_store_pages of them and
    more than it has committed already; then every sequence is released. Returns, per
    sequence, the pages the cache held for it at the end."""
    cdef Py_ssize_t i, n = len(sequences)
    cdef Segment seg = state.segment
    cdef int32_t page_size, min_store_pages = state.min_store_pages
    cdef int64_t full
    cdef ViewSequence seq
    cdef list counts = [], cached, out = []
    check_state(state)
    check_open(seg)
    commit = commit and state.reuse_enabled
    page_size = seg.hdr.hdr_config.cfg_page_size
    for i in range(n):
        seq = sequences[i]
        full = seq.cacheable_tokens // page_size if commit else 0
        counts.append(full if full >= min_store_pages and full > seq.committed_pages else 0)
    cached = commit_sequences(seg, sequences, counts, True)
    for i in range(n):
        seq = sequences[i]
        note_cached(state, seq, cached[i])
        out.append(seq.committed_pages)
        state.live.pop(seq.seq_id, None)
    return out


def live_of(dict live, seq_ids, str what):
    """The ViewSequences of seq_ids in live (seq id -> ViewSequence), each once, in order.

    Raises:
        SequenceError: not a sequence of ids, an id listed twice, or not live (naming the
            first bad id; `what` names the caller's call).
    """
    cdef Py_ssize_t index, n
    cdef list out = []
    cdef set seen
    if type(seq_ids) is list or type(seq_ids) is tuple:
        n = len(seq_ids)
        if n == 1 and type(seq_ids[0]) is int:
            # One request per call, the engines' common case: one dict lookup.
            seq = live.get(seq_ids[0])
            if seq is not None:
                return [seq]
    elif isinstance(seq_ids, _BYTES_LIKE) or not isinstance(seq_ids, Iterable) or (
            isinstance(seq_ids, np.ndarray) and seq_ids.ndim != 1):
        raise SequenceError(f"{what} needs a sequence of ids, got {type(seq_ids).__name__}"
                            + (f" of {seq_ids.ndim} dimensions" if isinstance(seq_ids, np.ndarray)
                               else ""))
    else:
        seq_ids = list(seq_ids)
    seen = set()
    for raw in seq_ids:
        seq_id = raw if type(raw) is int and INT64_MIN <= raw <= INT64_MAX else as_seq_id(raw)
        if seq_id in seen:
            raise SequenceError(f"{what}: sequence {seq_id} is listed twice")
        seen.add(seq_id)
        seq = live.get(seq_id)
        if seq is None:
            raise SequenceError(f"{what}: sequence {seq_id} is not live in this view "
                                "(never allocated, or released already)")
        out.append(seq)
    return out


def token_list(token_ids):
    """A decode step's token ids as a list or tuple, read once (a generator is read here,
    so that a step tried again after a reap still has them).

    Raises:
        ValueError: not a sequence of token ids (bytes-like, not iterable, an array of other
            than one dimension).
    """
    if type(token_ids) is list or type(token_ids) is tuple:
        return token_ids
    if isinstance(token_ids, _BYTES_LIKE) or not isinstance(token_ids, Iterable) or (
            isinstance(token_ids, np.ndarray) and token_ids.ndim != 1):
        raise ValueError("append_tokens needs a sequence of token ids (int or None), one "
                         f"per sequence, got {type(token_ids).__name__}")
    return list(token_ids)


def append_tokens(Segment seg, list sequences, token_ids, int32_t page_size):
    """WorkerView's decode step in one call: one token id (an int in [0, 2**31), or None if
    unknown) per ViewSequence; a sequence whose last page is full gets a new page. All or
    nothing: the step's new pages are taken under one lock (evicting when short), and only
    then is each sequence given its page and token, in C that cannot fail half way.
    page_size is the segment's (the view's copy: a step that takes no page reads nothing of
    the segment).

    Raises:
        SequenceError: not one token per sequence.
        ValueError: a token id outside [0, 2**31) or not an integer (naming its sequence).
        OutOfPagesError: not enough pages even after evicting. Nothing changes when any of
            these is raised.
    """
    global last_step_mark
    cdef int64_t mark
    cdef Py_ssize_t i, n = len(sequences), needing = 0
    cdef ViewSequence seq
    cdef cnp.ndarray values, records, ids, generations, pages
    cdef int64_t* value
    cdef int32_t* recs
    cdef int64_t* seq_id_data
    cdef int64_t* gens
    cdef int32_t* new_pages
    token_ids = token_list(token_ids)
    if len(token_ids) != n:
        raise SequenceError(f"append_tokens got {n} sequence ids but {len(token_ids)} tokens")
    values = cnp.PyArray_EMPTY(1, [n], cnp.NPY_INT64, 0)
    value = i64(values)
    # A sequence listed twice would be stepped twice on one reservation: refused. Marking
    # each with this call's own number finds it without a set per step (a local copy:
    # another thread's step may take the next number while this loop runs Python code).
    last_step_mark += 1
    mark = last_step_mark
    for i in range(n):
        seq = sequences[i]
        check_filled(seq)
        if seq.step_mark == mark:
            raise SequenceError(f"append_tokens: sequence {seq.seq_id} is listed twice")
        if not 0 <= seq.record <= INT32_MAX:
            raise SequenceError(f"sequence {seq.seq_id}: record {seq.record} is no record")
        seq.step_mark = mark
        token = token_ids[i]
        if type(token) is int and 0 <= token < TOKEN_LIMIT:
            value[i] = token                             # the common case, cheaply
        elif token is None:
            value[i] = -1
        elif not isinstance(token, numbers.Integral) or isinstance(token, (bool, np.bool_)):
            raise ValueError(f"sequence {seq.seq_id}: token ids must be integers or None, "
                             f"got {token!r}")
        elif not 0 <= int(token) < TOKEN_LIMIT:
            raise ValueError(f"sequence {seq.seq_id}: token id {int(token)} is outside "
                             "[0, 2**31)")
        else:
            value[i] = int(token)
        if needs_page(seq, page_size):
            needing += 1
    # Room first (allocations that may fail), so that nothing can fail once pages are taken.
    for i in range(n):
        seq = sequences[i]
        reserve_token(seq)
        if needs_page(seq, page_size):
            reserve_page(seq)
    if needing:
        records = cnp.PyArray_EMPTY(1, [needing], cnp.NPY_INT32, 0)
        ids = cnp.PyArray_EMPTY(1, [needing], cnp.NPY_INT64, 0)
        generations = cnp.PyArray_EMPTY(1, [needing], cnp.NPY_INT64, 0)
        recs, seq_id_data, gens = i32(records), i64(ids), i64(generations)
        needing = 0
        for i in range(n):
            seq = sequences[i]
            if needs_page(seq, page_size):
                recs[needing], seq_id_data[needing] = <int32_t>seq.record, seq.seq_id
                gens[needing] = seq.generation
                needing += 1
        pages = step_pages(seg, records, ids, generations)
        new_pages = i32(pages)
        needing = 0
        for i in range(n):
            seq = sequences[i]
            if needs_page(seq, page_size):
                push_page(seq, new_pages[needing])
                needing += 1
    for i in range(n):
        push_token(<ViewSequence>sequences[i], value[i])


def view_sequences(Segment seg, int32_t view):
    """(record, generation, seq id, own pages) of every live sequence of this process's lease
    stamped with view number `view`: what a WorkerView settles its bookkeeping on after an
    interrupted call. Reads only, under one lock."""
    check_open(seg)
    seg.begin()
    try:
        return owned_by_view(seg, view)
    finally:
        seg.end()


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
