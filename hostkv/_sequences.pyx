# cython: language_level=3, embedsignature=True
"""The batch entry points over sequences: allocate, hold, append, commit, release.

Each entry point is one lock and one mutation for a whole batch, made of the record and
page-list building blocks in _records; the policy (what to reuse, what to commit) is
WorkerView's, in Python, and its bookkeeping of each sequence is _viewstate's.
"""

import numbers
from collections.abc import Iterable

import numpy as np
cimport numpy as cnp
from cpython.object cimport PyObject_IsInstance

from libc.stdint cimport int32_t, int64_t, uint64_t
from libc.stdlib cimport free, malloc

from hostkv._layout cimport (
    HkvHeader, HkvMetrics, HkvNamespaceStats, HkvSequence, HKV_HINT_SLOTS, HKV_NAMESPACE_SLOTS)
from hostkv._lock cimport check_open, log_store_i64
from hostkv._pages cimport pages_alloc
from hostkv._radix cimport (
    BORROW_MAY_EVICT, BORROW_REFRESH, Tree, ensure_free_parts, node_depth, page_hash,
    tree_borrow, tree_evict_pages, tree_insert, tree_of)
from hostkv._records cimport (
    extend_page_list, new_sequence, owned_by_view, owned_sequence, release_sequence,
    sequence_at, set_lock)
from hostkv._requests cimport SequenceRequest, new_allocation
from hostkv._segment cimport Segment
from hostkv._tokens cimport checked_i32_copy, sequence_tokens
from hostkv._viewstate cimport (
    ViewSequence, ViewState, check_filled, check_state, needs_page, note_cached,
    pages_to_commit, push_page, push_token, reserve_page, reserve_token)

from hostkv._tokens import BYTES_LIKE as _BYTES_LIKE, as_namespace, as_seq_id, as_tokens
from hostkv.errors import CapacityError, OutOfPagesError, SequenceError
# Defined in the layers below; named here too, where callers and tests have always found them.
from hostkv._records import check_references, live_sequences
from hostkv._viewstate import live_of

cdef object INT64_MIN = -(2**63), INT64_MAX = 2**63 - 1, NAMESPACE_LIMIT = 2**64
cdef int64_t INT32_MAX = 2**31 - 1

cnp.import_array()


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
        next_hash = page_hash(t, tokens + found * page_size)
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

cdef object TOKEN_LIMIT = 2**31
cdef int64_t last_step_mark = 0       # numbers append_tokens calls (see ViewSequence.step_mark)


cdef int64_t* i64(cnp.ndarray arr) noexcept:
    return <int64_t*>cnp.PyArray_DATA(arr)


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
            # Window parts for the fresh pages, taken from the least recently used unlocked
            # nodes (the batch's borrowed prefixes are locked); short of them, pages go
            # without.
            ensure_free_parts(seg, &t, batch_fresh)
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
        ensure_free_parts(seg, &t, n)
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
            show up only as "0 pages cached"; the caller's whole mutation is rolled back,
            as for any operation too big for the log.
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
        counts.append(pages_to_commit(full, min_store_pages, seq.committed_pages))
    cached = commit_sequences(seg, sequences, counts, True)
    for i in range(n):
        seq = sequences[i]
        note_cached(state, seq, cached[i])
        out.append(seq.committed_pages)
        state.live.pop(seq.seq_id, None)
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
