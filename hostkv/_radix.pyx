# cython: language_level=3, embedsignature=True
"""The radix-tree prefix cache in the segment: match, borrow (lock), insert, evict, check.

Every function that changes the tree runs inside an open mutation and changes shared state
only through logged stores, so an exception or a death at any step rolls back whole. The
memory map is in _layout.pxd, the structure in _radix.pxd.
"""

import heapq

import numpy as np
cimport numpy as cnp

from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t
from libc.string cimport memcmp, memcpy
from cpython.object cimport PyObject

from hostkv._layout cimport (
    HkvHeader, HkvMetrics, HkvRadixNode, HkvRadixState, HkvSlab, HkvSlabRecord, HKV_HINT_SLOTS)
from hostkv._lock cimport check_open, log_store_i32, log_store_i64
from hostkv._segment cimport Segment, add_rederive_hook
from hostkv._slab cimport (
    slab_alloc, slab_check, slab_check_index, slab_free, slab_record, slab_rederive)
from hostkv._pages cimport check_page_index, page_decref, page_incref, page_refcounts

from hostkv.errors import CapacityError, CorruptionError

cnp.import_array()

cdef enum:
    NOT_IN_TREE = -2        # reg_page_next value of a page the tree does not hold
    END_OF_NODE = -1


# -- access ------------------------------------------------------------------------------------

cdef Tree tree_of(Segment seg) noexcept:
    cdef Tree t
    cdef HkvHeader* hdr = seg.hdr
    t.slab = <HkvSlab*>(seg.base + hdr.hdr_regions.reg_radix_nodes)
    t.state = &hdr.hdr_radix
    t.table = <int32_t*>(seg.base + hdr.hdr_regions.reg_radix_table)
    t.heap = <int32_t*>(seg.base + hdr.hdr_regions.reg_radix_heap)
    t.page_next = <int32_t*>(seg.base + hdr.hdr_regions.reg_page_next)
    t.page_tokens = <int32_t*>(seg.base + hdr.hdr_regions.reg_page_tokens)
    t.page_size = hdr.hdr_config.cfg_page_size
    t.node_capacity = hdr.hdr_config.cfg_radix_node_capacity
    t.num_pages = hdr.hdr_config.cfg_num_pages
    t.table_mask = hdr.hdr_radix.rt_table_capacity - 1
    t.hash_mask = seg.hash_mask
    return t


cdef inline HkvRadixNode* node_ptr(Tree* t, int32_t index) noexcept nogil:
    return <HkvRadixNode*>slab_record(t.slab, index)


cdef HkvRadixNode* node_at(Segment seg, Tree* t, int64_t index) except NULL:
    """The in-use node at index, bounds-checked."""
    cdef HkvRadixNode* node
    if index < 0 or index >= t.node_capacity:
        seg.corrupt(f"radix node index {index} outside [0, {t.node_capacity})")
    node = node_ptr(t, <int32_t>index)
    if node.rn_slab.sr_in_use != 1:
        seg.corrupt(f"radix node {index} is referenced but free")
    return node


cdef inline const int32_t* tokens_of(Tree* t, int32_t page) noexcept nogil:
    return t.page_tokens + <int64_t>page * t.page_size


# -- hashing -----------------------------------------------------------------------------------

cdef inline uint64_t mix64(uint64_t x) noexcept nogil:
    # The finaliser of SplitMix64: every input bit affects every output bit.
    x ^= x >> 30
    x *= 0xBF58476D1CE4E5B9ULL
    x ^= x >> 27
    x *= 0x94D049BB133111EBULL
    x ^= x >> 31
    return x


cdef inline uint64_t page_hash(Tree* t, const int32_t* tokens) noexcept nogil:
    """A hash of one page's token ids. It only finds candidates: matches compare tokens."""
    cdef uint64_t h = 0x9E3779B97F4A7C15ULL
    cdef int32_t i
    for i in range(t.page_size):
        h = (h ^ <uint32_t>tokens[i]) * 0x100000001B3ULL
        h ^= h >> 29
    return mix64(h) & t.hash_mask


cdef uint64_t tree_page_hash(Tree* t, const int32_t* tokens) noexcept nogil:
    return page_hash(t, tokens)


cdef inline void hint_evicted(Segment seg, uint64_t key_hash) noexcept nogil:
    # Metrics only (not logged): lets a later miss on this page be told apart as "evicted".
    seg.metrics.mt_evicted_hashes[key_hash & (HKV_HINT_SLOTS - 1)] = key_hash


cdef inline int64_t home_slot(Tree* t, int32_t parent, uint64_t namespace, uint64_t key_hash) noexcept nogil:
    return <int64_t>(mix64(key_hash ^ mix64(<uint64_t>(parent + 1) ^ (namespace * 0x9E3779B97F4A7C15ULL)))
                     & <uint64_t>t.table_mask)


cdef inline bint pages_equal(Tree* t, const int32_t* a, const int32_t* b) noexcept nogil:
    # A plain loop, not memcmp: pages are short (often 16 ids), and the compiler vectorises
    # this without a library call per page.
    cdef int32_t i
    cdef int32_t diff = 0
    for i in range(t.page_size):
        diff |= a[i] ^ b[i]
    return diff == 0


# -- the child table ---------------------------------------------------------------------------

cdef int32_t table_find(Tree* t, int32_t parent, uint64_t namespace, const int32_t* first_tokens) noexcept nogil:
    """The child of parent whose first page holds first_tokens; -1 if none, -2 if corrupt."""
    cdef uint64_t key_hash = page_hash(t, first_tokens)
    cdef int64_t slot = home_slot(t, parent, namespace, key_hash)
    cdef int64_t probes
    cdef int32_t entry
    cdef HkvRadixNode* node
    for probes in range(t.table_mask + 1):
        entry = t.table[slot]
        if entry == -1:
            return -1
        if entry < 0 or entry >= t.node_capacity:
            return -2
        node = node_ptr(t, entry)
        if (node.rn_parent == parent and node.rn_namespace == namespace
                and node.rn_key_hash == key_hash):
            if node.rn_first_page < 0 or node.rn_first_page >= t.num_pages:
                return -2
            if pages_equal(t, tokens_of(t, node.rn_first_page), first_tokens):
                return entry
        slot = (slot + 1) & t.table_mask
    return -2


cdef int64_t table_slot_of(Segment seg, Tree* t, int32_t index) except -1:
    """The table slot that holds node index (probing from its home slot)."""
    cdef HkvRadixNode* node = node_at(seg, t, index)
    cdef int64_t slot = home_slot(t, node.rn_parent, node.rn_namespace, node.rn_key_hash)
    cdef int64_t probes
    for probes in range(t.table_mask + 1):
        if t.table[slot] == index:
            return slot
        if t.table[slot] == -1:
            break
        slot = (slot + 1) & t.table_mask
    seg.corrupt(f"radix node {index} is missing from the child table")


cdef int table_insert(Segment seg, Tree* t, int32_t index) except -1:
    cdef HkvRadixNode* node = node_at(seg, t, index)
    cdef int64_t slot = home_slot(t, node.rn_parent, node.rn_namespace, node.rn_key_hash)
    cdef int64_t probes
    for probes in range(t.table_mask + 1):
        if t.table[slot] == -1:
            log_store_i32(seg, &t.table[slot], index)
            return 0
        slot = (slot + 1) & t.table_mask
    seg.corrupt("the child table is full")


cdef int table_remove(Segment seg, Tree* t, int32_t index) except -1:
    """Removes a node by backward-shift deletion: no tombstones, probe runs stay short."""
    cdef int64_t hole = table_slot_of(seg, t, index)
    cdef int64_t slot = (hole + 1) & t.table_mask
    cdef int64_t home
    cdef int32_t entry
    cdef HkvRadixNode* node
    while True:
        entry = t.table[slot]
        if entry == -1:
            break
        node = node_at(seg, t, entry)
        home = home_slot(t, node.rn_parent, node.rn_namespace, node.rn_key_hash)
        # The entry may move back into the hole unless its home lies cyclically in (hole, slot].
        if ((slot - home) & t.table_mask) >= ((slot - hole) & t.table_mask):
            log_store_i32(seg, &t.table[hole], entry)
            hole = slot
        slot = (slot + 1) & t.table_mask
    log_store_i32(seg, &t.table[hole], -1)
    return 0


# -- the eviction heap: evictable leaves by (last access, index) --------------------------------

cdef inline bint heap_before(Tree* t, int32_t a, int32_t b) noexcept nogil:
    cdef HkvRadixNode* na = node_ptr(t, a)
    cdef HkvRadixNode* nb = node_ptr(t, b)
    return na.rn_last_access < nb.rn_last_access or (
        na.rn_last_access == nb.rn_last_access and a < b)


cdef int heap_put(Segment seg, Tree* t, int32_t pos, int32_t index) except -1:
    cdef HkvRadixNode* node = node_at(seg, t, index)
    # An entry a sift leaves where it was is already there: no stores to log.
    if t.heap[pos] != index:
        log_store_i32(seg, &t.heap[pos], index)
    if node.rn_heap_pos != pos:
        log_store_i32(seg, &node.rn_heap_pos, pos)
    return 0


cdef int32_t heap_entry(Segment seg, Tree* t, int64_t pos) except -1:
    """The heap's entry at pos: the position checked against the heap's size, the size
    against the capacity and the entry against the node table (all read from the segment)."""
    cdef int32_t size = t.state.rt_heap_size
    cdef int32_t entry
    if size < 0 or size > t.node_capacity or pos < 0 or pos >= size:
        seg.corrupt(f"eviction heap position {pos} outside its size {size} "
                    f"(capacity {t.node_capacity})")
    entry = t.heap[pos]
    if entry < 0 or entry >= t.node_capacity:
        seg.corrupt(f"eviction heap entry {pos} is node {entry}, outside [0, {t.node_capacity})")
    return entry


cdef int heap_sift(Segment seg, Tree* t, int32_t pos) except -1:
    """Moves the entry at pos up or down until the heap order holds again."""
    cdef int32_t size = t.state.rt_heap_size
    cdef int32_t entry = heap_entry(seg, t, pos), parent, child, other
    while pos > 0:
        parent = (pos - 1) // 2
        other = heap_entry(seg, t, parent)
        if not heap_before(t, entry, other):
            break
        heap_put(seg, t, pos, other)
        pos = parent
    while True:
        child = 2 * pos + 1
        if child >= size:
            break
        other = heap_entry(seg, t, child)
        if child + 1 < size and heap_before(t, heap_entry(seg, t, child + 1), other):
            child += 1
            other = t.heap[child]
        if not heap_before(t, other, entry):
            break
        heap_put(seg, t, pos, other)
        pos = child
    heap_put(seg, t, pos, entry)
    return 0


cdef int heap_push(Segment seg, Tree* t, int32_t index) except -1:
    cdef int32_t pos = t.state.rt_heap_size
    if pos < 0 or pos >= t.node_capacity:
        seg.corrupt(f"eviction heap size {pos} outside [0, {t.node_capacity})")
    log_store_i32(seg, &t.state.rt_heap_size, pos + 1)
    log_store_i32(seg, &t.heap[pos], index)
    heap_sift(seg, t, pos)
    return 0


cdef int heap_remove(Segment seg, Tree* t, int32_t index) except -1:
    cdef HkvRadixNode* node = node_at(seg, t, index)
    cdef int32_t pos = node.rn_heap_pos
    cdef int32_t last = t.state.rt_heap_size - 1
    cdef int32_t moved
    if pos < 0 or pos > last or heap_entry(seg, t, pos) != index:
        seg.corrupt(f"radix node {index} has heap position {pos}, not in the heap")
    moved = heap_entry(seg, t, last)
    log_store_i32(seg, &t.state.rt_heap_size, last)
    log_store_i32(seg, &node.rn_heap_pos, -1)
    if pos != last:
        log_store_i32(seg, &t.heap[pos], moved)
        heap_sift(seg, t, pos)
    return 0


cdef int update_evictable(Segment seg, Tree* t, int32_t index) except -1:
    """Puts a node in the heap, or takes it out, as its evictability now says."""
    cdef HkvRadixNode* node = node_at(seg, t, index)
    cdef bint evictable = node.rn_lock_count == 0 and node.rn_num_children == 0
    if evictable and node.rn_heap_pos < 0:
        heap_push(seg, t, index)
        log_store_i64(seg, &t.state.rt_evictable_leaf_pages,
                      t.state.rt_evictable_leaf_pages + node.rn_num_pages)
    elif not evictable and node.rn_heap_pos >= 0:
        heap_remove(seg, t, index)
        log_store_i64(seg, &t.state.rt_evictable_leaf_pages,
                      t.state.rt_evictable_leaf_pages - node.rn_num_pages)
    return 0


# -- paths: lock, unlock, touch ----------------------------------------------------------------

cdef int tree_lock(Segment seg, Tree* t, int32_t index) except -1:
    """Locks a node and its ancestors: none of them can be evicted until tree_unlock."""
    cdef HkvRadixNode* node
    cdef int32_t steps = 0
    while index != -1:
        node = node_at(seg, t, index)
        if node.rn_lock_count == 0:
            log_store_i64(seg, &t.state.rt_protected_pages,
                          t.state.rt_protected_pages + node.rn_num_pages)
        log_store_i32(seg, &node.rn_lock_count, node.rn_lock_count + 1)
        if node.rn_heap_pos >= 0:
            update_evictable(seg, t, index)
        index = node.rn_parent
        steps += 1
        if steps > t.node_capacity:
            seg.corrupt("a cycle in the radix tree's parent links")
    return 0


cdef int tree_unlock(Segment seg, Tree* t, int32_t index) except -1:
    """Undoes one tree_lock of the same node."""
    cdef HkvRadixNode* node
    cdef int32_t steps = 0
    while index != -1:
        node = node_at(seg, t, index)
        if node.rn_lock_count <= 0:
            seg.corrupt(f"radix node {index} unlocked more often than locked")
        log_store_i32(seg, &node.rn_lock_count, node.rn_lock_count - 1)
        if node.rn_lock_count == 0:
            log_store_i64(seg, &t.state.rt_protected_pages,
                          t.state.rt_protected_pages - node.rn_num_pages)
            update_evictable(seg, t, index)
        index = node.rn_parent
        steps += 1
        if steps > t.node_capacity:
            seg.corrupt("a cycle in the radix tree's parent links")
    return 0


cdef int touch(Segment seg, Tree* t, int32_t index) except -1:
    """Marks a node and its ancestors as used now (a borrow or a commit)."""
    cdef HkvRadixNode* node
    cdef int64_t tick = t.state.rt_tick + 1
    cdef int32_t steps = 0
    log_store_i64(seg, &t.state.rt_tick, tick)
    while index != -1:
        node = node_at(seg, t, index)
        log_store_i64(seg, &node.rn_last_access, tick)
        if node.rn_heap_pos >= 0:
            heap_sift(seg, t, node.rn_heap_pos)
        index = node.rn_parent
        steps += 1
        if steps > t.node_capacity:
            seg.corrupt("a cycle in the radix tree's parent links")
    return 0


# -- walking -----------------------------------------------------------------------------------

cdef int tree_walk(Tree* t, const int32_t* tokens, int64_t num_pages, uint64_t namespace,
                   int32_t* out_pages, Walk* walk) noexcept nogil:
    """Matches tokens (num_pages full pages) against the tree without changing anything.

    Fills walk; out_pages (if not NULL) receives the matched pages. Returns -1 with
    walk.error set when an index read from the segment is out of range or a walk loops.
    """
    return tree_walk_below(t, -1, 0, tokens, num_pages, namespace, out_pages, walk)


cdef int tree_walk_below(Tree* t, int32_t start_node, int64_t start_pages,
                         const int32_t* tokens, int64_t num_pages, uint64_t namespace,
                         int32_t* out_pages, Walk* walk) noexcept nogil:
    """tree_walk from the end of start_node, taken as the first start_pages pages matched
    (-1 and 0: from the root). out_pages[:start_pages] is left as it was."""
    cdef int32_t parent = start_node, child, page, in_node
    cdef int64_t pos = start_pages, depth = 0
    cdef HkvRadixNode* node
    walk.matched = start_pages
    walk.node = start_node
    walk.node_matched = node_ptr(t, start_node).rn_num_pages if start_node != -1 else 0
    walk.error = 0
    while pos < num_pages:
        child = table_find(t, parent, namespace, tokens + pos * t.page_size)
        if child == -1:
            break
        if child < -1:
            walk.error = 1
            return -1
        node = node_ptr(t, child)
        page = node.rn_first_page
        in_node = 0
        # The first page was compared by table_find; compare the rest page by page.
        while in_node < node.rn_num_pages and pos < num_pages:
            if page < 0 or page >= t.num_pages:
                walk.error = 1
                return -1
            if in_node > 0 and not pages_equal(t, tokens_of(t, page), tokens + pos * t.page_size):
                break
            if out_pages != NULL:
                out_pages[pos] = page
            pos += 1
            in_node += 1
            page = t.page_next[page]
        walk.node = child
        walk.node_matched = in_node
        walk.matched = pos
        if in_node < node.rn_num_pages:
            break
        parent = child
        depth += 1
        if depth > t.node_capacity:
            walk.error = 1
            return -1
    return 0


cdef int walk_or_raise(Segment seg, Tree* t, const int32_t* tokens, int64_t num_pages,
                       uint64_t namespace, int32_t* out_pages, Walk* walk,
                       int32_t start_node=-1, int64_t start_pages=0) except -1:
    with nogil:
        tree_walk_below(t, start_node, start_pages, tokens, num_pages, namespace, out_pages,
                        walk)
    if walk.error:
        seg.corrupt("a radix walk met an out-of-range index or a cycle")
    return 0


# -- structural changes --------------------------------------------------------------------------

cdef int32_t page_at(Segment seg, Tree* t, HkvRadixNode* node, int32_t offset) except -1:
    """The page `offset` links after the node's first page."""
    cdef int32_t page = node.rn_first_page
    cdef int32_t i
    for i in range(offset):
        check_page_index(seg, page)
        page = t.page_next[page]
    check_page_index(seg, page)
    return page


cdef int32_t split(Segment seg, Tree* t, int32_t index, int32_t head_pages) except -1:
    """Splits a node after head_pages pages; returns the new node, which takes the head.

    The new head takes the old node's place under its parent (same table key); the old node
    keeps its identity, its children and its locks, now covering only the tail.
    """
    cdef HkvRadixNode* node = node_at(seg, t, index)
    cdef HkvRadixNode* head
    cdef int32_t head_index, last_head_page, tail_first
    if head_pages <= 0 or head_pages >= node.rn_num_pages:
        seg.corrupt(f"split of a {node.rn_num_pages}-page node at {head_pages}")
    head_index = slab_alloc(seg, t.slab)
    if head_index < 0:
        raise CapacityError("no radix node record free for a split", resource="radix nodes",
                            needed=1, available=0)
    head = node_at(seg, t, head_index)
    last_head_page = page_at(seg, t, node, head_pages - 1)
    tail_first = t.page_next[last_head_page]
    check_page_index(seg, tail_first)
    log_store_i32(seg, &head.rn_parent, node.rn_parent)
    log_store_i32(seg, &head.rn_num_pages, head_pages)
    log_store_i32(seg, &head.rn_first_page, node.rn_first_page)
    log_store_i32(seg, &head.rn_num_children, 1)
    log_store_i32(seg, &head.rn_lock_count, node.rn_lock_count)
    log_store_i32(seg, &head.rn_heap_pos, -1)
    log_store_i64(seg, <int64_t*>&head.rn_namespace, <int64_t>node.rn_namespace)
    log_store_i64(seg, <int64_t*>&head.rn_key_hash, <int64_t>node.rn_key_hash)
    log_store_i64(seg, &head.rn_last_access, node.rn_last_access)
    log_store_i32(seg, &t.table[table_slot_of(seg, t, index)], head_index)
    log_store_i32(seg, &t.page_next[last_head_page], END_OF_NODE)
    log_store_i32(seg, &node.rn_parent, head_index)
    log_store_i32(seg, &node.rn_first_page, tail_first)
    log_store_i32(seg, &node.rn_num_pages, node.rn_num_pages - head_pages)
    log_store_i64(seg, <int64_t*>&node.rn_key_hash, <int64_t>page_hash(t, tokens_of(t, tail_first)))
    table_insert(seg, t, index)
    if node.rn_heap_pos >= 0:
        log_store_i64(seg, &t.state.rt_evictable_leaf_pages,
                      t.state.rt_evictable_leaf_pages - head_pages)
    return head_index


cdef int release_pages(Segment seg, Tree* t, int32_t page, int32_t count) except -1:
    """Drops the tree's reference to `count` linked pages starting at page."""
    cdef int32_t i, next_page
    for i in range(count):
        check_page_index(seg, page)
        next_page = t.page_next[page]
        log_store_i32(seg, &t.page_next[page], NOT_IN_TREE)
        page_decref(seg, page)
        page = next_page
    return 0


cdef int remove_leaf(Segment seg, Tree* t, int32_t index) except -1:
    """Evicts a whole evictable leaf: its pages, its table entry, its record."""
    cdef HkvRadixNode* node = node_at(seg, t, index)
    cdef int32_t parent = node.rn_parent
    cdef int32_t count = node.rn_num_pages
    if count < 1 or count > t.num_pages:
        seg.corrupt(f"radix node {index} covers {count} pages")
    heap_remove(seg, t, index)
    hint_evicted(seg, node.rn_key_hash)
    log_store_i64(seg, &t.state.rt_evictable_leaf_pages, t.state.rt_evictable_leaf_pages - count)
    log_store_i64(seg, &t.state.rt_cached_pages, t.state.rt_cached_pages - count)
    release_pages(seg, t, node.rn_first_page, count)
    table_remove(seg, t, index)
    slab_free(seg, t.slab, index)
    if parent != -1:
        node = node_at(seg, t, parent)
        log_store_i32(seg, &node.rn_num_children, node.rn_num_children - 1)
        update_evictable(seg, t, parent)
    return count


cdef int trim_leaf(Segment seg, Tree* t, int32_t index, int32_t drop) except -1:
    """Evicts the last `drop` pages of an evictable leaf, keeping at least one."""
    cdef HkvRadixNode* node = node_at(seg, t, index)
    cdef int32_t keep = node.rn_num_pages - drop
    cdef int32_t last_kept
    if drop <= 0 or keep <= 0:
        seg.corrupt(f"trim of {drop} pages from a {node.rn_num_pages}-page leaf")
    last_kept = page_at(seg, t, node, keep - 1)
    check_page_index(seg, t.page_next[last_kept])
    hint_evicted(seg, page_hash(t, tokens_of(t, t.page_next[last_kept])))
    release_pages(seg, t, t.page_next[last_kept], drop)
    log_store_i32(seg, &t.page_next[last_kept], END_OF_NODE)
    log_store_i32(seg, &node.rn_num_pages, keep)
    log_store_i64(seg, &t.state.rt_evictable_leaf_pages, t.state.rt_evictable_leaf_pages - drop)
    log_store_i64(seg, &t.state.rt_cached_pages, t.state.rt_cached_pages - drop)
    return 0


cdef int64_t tree_evict_pages(Segment seg, Tree* t, int64_t want) except -1:
    """Evicts up to `want` pages, least recently used leaves first, trimming the last one.

    Returns the pages the tree let go (they are free unless a sequence still holds them).
    """
    cdef int64_t evicted = 0
    cdef int32_t leaf
    cdef HkvRadixNode* node
    while evicted < want and t.state.rt_heap_size > 0:
        leaf = t.heap[0]
        node = node_at(seg, t, leaf)
        if node.rn_num_pages <= want - evicted:
            evicted += remove_leaf(seg, t, leaf)
        else:
            trim_leaf(seg, t, leaf, <int32_t>(want - evicted))
            evicted = want
    if evicted:
        log_store_i64(seg, &seg.hdr.hdr_stats.st_evicted_pages,
                      seg.hdr.hdr_stats.st_evicted_pages + evicted)
    return evicted


cdef int evict_records(Segment seg, Tree* t, int32_t want, int32_t protect) except -1:
    """Evicts whole LRU leaves until `want` node records are free; `protect` (and its path)
    is locked meanwhile so the caller's own path survives. Returns records now free."""
    cdef int64_t evicted = 0
    if protect != -1:
        tree_lock(seg, t, protect)
    while t.slab.sl_capacity - t.slab.sl_used < want and t.state.rt_heap_size > 0:
        evicted += remove_leaf(seg, t, t.heap[0])
    if protect != -1:
        tree_unlock(seg, t, protect)
    if evicted:
        log_store_i64(seg, &seg.hdr.hdr_stats.st_evicted_pages,
                      seg.hdr.hdr_stats.st_evicted_pages + evicted)
    return t.slab.sl_capacity - t.slab.sl_used


# -- the operations ------------------------------------------------------------------------------

cdef int64_t tree_borrow(Segment seg, Tree* t, const int32_t* tokens, int64_t num_pages,
                         uint64_t namespace, int32_t* out_pages, int32_t* out_node,
                         int flags) except -1:
    """Matches and locks the longest cached prefix of num_pages pages; returns its pages.

    A match that ends inside a node splits it (with BORROW_MAY_EVICT, evicting an LRU leaf
    for the record if needed), so the lock covers exactly the borrowed pages; when no record
    can be had, the borrow stops at the previous node boundary instead. *out_node is the
    node to unlock later, or -1 when nothing matched. With BORROW_REFRESH, touches the path
    (a borrow is a use).
    """
    cdef Walk walk
    cdef int64_t matched
    cdef int32_t node_index
    cdef HkvRadixNode* node
    out_node[0] = -1
    walk_or_raise(seg, t, tokens, num_pages, namespace, out_pages, &walk)
    if walk.matched == 0:
        return 0
    matched = walk.matched
    node_index = walk.node
    node = node_at(seg, t, node_index)
    if walk.node_matched < node.rn_num_pages:
        if t.slab.sl_used >= t.slab.sl_capacity and flags & BORROW_MAY_EVICT:
            evict_records(seg, t, 1, node_index)
        if t.slab.sl_used < t.slab.sl_capacity:
            node_index = split(seg, t, node_index, walk.node_matched)
        else:
            matched -= walk.node_matched
            node_index = node.rn_parent
    if node_index == -1:
        return 0
    tree_lock(seg, t, node_index)
    if flags & BORROW_REFRESH:
        touch(seg, t, node_index)
    out_node[0] = node_index
    return matched


cdef int64_t node_depth(Segment seg, Tree* t, int32_t index) except -1:
    """The pages on the path from the root to the end of a node."""
    cdef int64_t pages = 0
    cdef int32_t steps = 0
    cdef HkvRadixNode* node
    while index != -1:
        node = node_at(seg, t, index)
        pages += node.rn_num_pages
        index = node.rn_parent
        steps += 1
        if steps > t.node_capacity:
            seg.corrupt("a cycle in the radix tree's parent links")
    return pages


cdef int64_t tree_insert(Segment seg, Tree* t, const int32_t* tokens, const int32_t* pages,
                         int64_t num_pages, uint64_t namespace, int32_t* out_tree_pages,
                         int32_t* out_node, int32_t below=-1, bint adopt=False) except -1:
    """Caches num_pages full pages of tokens, held in `pages`, under namespace.

    Pages already cached under the same tokens win: out_tree_pages[i] receives the tree's
    page for each of the request's pages, and the return value says how many leading pages
    were already cached (the caller keeps its own copies of those; the tree adopted the
    rest, adding its own reference). *out_node is the node of the last page. Touches the
    path (a commit is a use).

    below: a node the caller holds locked whose path is the first pages of tokens (a
    sequence's borrowed or committed prefix, whose KV its later pages were computed on):
    the walk starts at its end instead of comparing that prefix again, and
    out_tree_pages[:its depth] is left as it was. -1, or a node deeper than num_pages:
    from the root.

    adopt: the caller hands its own reference on each page the tree adopts over to the tree
    (it must drop none of those afterwards), instead of the tree adding one: a sequence
    that commits and is released in one mutation saves two logged stores a page.

    Raises:
        CapacityError: no node record even after eviction (the caller rolls back).
        ValueError: a page is outside the pool, free, listed twice, or already in the tree
            at another place.
    """
    cdef Walk walk
    cdef int64_t existing, i
    cdef int32_t parent, needed, new_index, page, node_index
    cdef HkvRadixNode* node
    cdef bint partial
    cdef int32_t* refcounts = page_refcounts(seg)
    cdef int64_t below_pages = 0
    out_node[0] = -1
    if num_pages <= 0:
        return 0
    if below != -1:
        below_pages = node_depth(seg, t, below)
        if below_pages > num_pages:
            below, below_pages = -1, 0
    walk_or_raise(seg, t, tokens, num_pages, namespace, out_tree_pages, &walk, below, below_pages)
    existing = walk.matched
    partial = walk.node != -1 and walk.node_matched < node_at(seg, t, walk.node).rn_num_pages
    if existing == num_pages:
        node_index = walk.node
        if partial:
            # Everything is cached already, ending inside a node: split it there (as a
            # borrow does) so that a caller locking out_node locks only these pages; with
            # no record to be had, out_node is the whole node (it locks a little more).
            if t.slab.sl_used >= t.slab.sl_capacity:
                evict_records(seg, t, 1, node_index)
            if t.slab.sl_used < t.slab.sl_capacity:
                node_index = split(seg, t, node_index, walk.node_matched)
        touch(seg, t, node_index)
        out_node[0] = node_index
        return existing
    for i in range(existing, num_pages):
        page = pages[i]
        if page < 0 or page >= t.num_pages:
            raise ValueError(f"page {page} is outside the pool [0, {t.num_pages})")
        if refcounts[page] <= 0:
            raise ValueError(f"page {page} is free: only held pages can be cached")
        if t.page_next[page] != NOT_IN_TREE:
            raise ValueError(f"page {page} is already cached (or listed twice)")
    needed = 2 if partial else 1
    if t.slab.sl_capacity - t.slab.sl_used < needed:
        if evict_records(seg, t, needed, walk.node) < needed:
            raise CapacityError(
                f"segment {seg.name!r}: no radix node record free (capacity "
                f"{t.node_capacity}, all on locked paths); raise radix_node_capacity",
                resource="radix nodes", needed=needed,
                available=t.slab.sl_capacity - t.slab.sl_used)
    parent = walk.node
    if partial:
        parent = split(seg, t, walk.node, walk.node_matched)
    new_index = slab_alloc(seg, t.slab)
    node = node_at(seg, t, new_index)
    for i in range(existing, num_pages):
        page = pages[i]
        if t.page_next[page] != NOT_IN_TREE:
            raise ValueError(f"page {page} is listed twice")
        if not pages_equal(t, tokens_of(t, page), tokens + i * t.page_size):
            write_tokens(seg, t, page, tokens + i * t.page_size)
        if not adopt:
            page_incref(seg, page)
        # One store per page: its link to the next page of the node, or the node's end.
        log_store_i32(seg, &t.page_next[page], pages[i + 1] if i + 1 < num_pages else END_OF_NODE)
        out_tree_pages[i] = page
    log_store_i32(seg, &node.rn_parent, parent)
    log_store_i32(seg, &node.rn_num_pages, <int32_t>(num_pages - existing))
    log_store_i32(seg, &node.rn_first_page, pages[existing])
    log_store_i32(seg, &node.rn_num_children, 0)
    log_store_i32(seg, &node.rn_lock_count, 0)
    log_store_i32(seg, &node.rn_heap_pos, -1)
    log_store_i64(seg, <int64_t*>&node.rn_namespace, <int64_t>namespace)
    log_store_i64(seg, <int64_t*>&node.rn_key_hash,
                  <int64_t>page_hash(t, tokens + existing * t.page_size))
    log_store_i64(seg, &node.rn_last_access, t.state.rt_tick)
    table_insert(seg, t, new_index)
    if parent != -1:
        node = node_at(seg, t, parent)
        log_store_i32(seg, &node.rn_num_children, node.rn_num_children + 1)
        update_evictable(seg, t, parent)
    else:
        # Metrics only: lets a miss in another namespace be told apart as "namespace".
        node = node_at(seg, t, new_index)
        seg.metrics.mt_top_hashes[node.rn_key_hash & (HKV_HINT_SLOTS - 1)] = node.rn_key_hash
        seg.metrics.mt_top_namespaces[node.rn_key_hash & (HKV_HINT_SLOTS - 1)] = namespace
    log_store_i64(seg, &t.state.rt_cached_pages, t.state.rt_cached_pages + num_pages - existing)
    log_store_i64(seg, &seg.hdr.hdr_stats.st_inserted_pages,
                  seg.hdr.hdr_stats.st_inserted_pages + num_pages - existing)
    # Touched before it enters the heap, so that it enters it once, at its final recency.
    touch(seg, t, new_index)
    update_evictable(seg, t, new_index)
    out_node[0] = new_index
    return existing


cdef int write_tokens(Segment seg, Tree* t, int32_t page, const int32_t* tokens) except -1:
    """Records the token ids of a page the caller holds privately (not in the tree).

    Not logged, deliberately: nobody but the holder reads a private page's ids, and the ids
    are those whose KV the holder wrote into the page, true whether or not the insert that
    writes them commits.
    """
    cdef int32_t* slots = t.page_tokens + <int64_t>page * t.page_size
    cdef int32_t i
    for i in range(t.page_size):
        slots[i] = tokens[i]
    return 0


# -- recovery and checking -------------------------------------------------------------------------

cdef int rederive_tree(Segment seg) except -1:
    """Rebuilds the node free list, the eviction heap and the page counts from the nodes."""
    cdef Tree t = tree_of(seg)
    cdef int32_t i, size = 0
    cdef int64_t cached = 0, protected = 0, evictable = 0
    cdef HkvRadixNode* node
    slab_rederive(seg, t.slab)
    for i in range(t.node_capacity):
        node = node_ptr(&t, i)
        node.rn_heap_pos = -1
        if node.rn_slab.sr_in_use != 1:
            continue
        cached += node.rn_num_pages
        if node.rn_lock_count > 0:
            protected += node.rn_num_pages
        elif node.rn_num_children == 0:
            t.heap[size] = i
            node.rn_heap_pos = size
            size += 1
            evictable += node.rn_num_pages
    t.state.rt_heap_size = size
    t.state.rt_cached_pages = cached
    t.state.rt_protected_pages = protected
    t.state.rt_evictable_leaf_pages = evictable
    # Heapify bottom-up; these stores are recovery's own, not a mutation's (nothing is logged).
    i = size // 2 - 1
    while i >= 0:
        sift_down_unlogged(&t, i)
        i -= 1
    return 0


cdef void sift_down_unlogged(Tree* t, int32_t pos) noexcept nogil:
    cdef int32_t size = t.state.rt_heap_size
    cdef int32_t entry = t.heap[pos], child
    while True:
        child = 2 * pos + 1
        if child >= size:
            break
        if child + 1 < size and heap_before(t, t.heap[child + 1], t.heap[child]):
            child += 1
        if not heap_before(t, t.heap[child], entry):
            break
        t.heap[pos] = t.heap[child]
        node_ptr(t, t.heap[pos]).rn_heap_pos = pos
        pos = child
    t.heap[pos] = entry
    node_ptr(t, entry).rn_heap_pos = pos


add_rederive_hook(rederive_tree)


cdef int tree_check(Segment seg) except -1:
    """Checks every invariant of the tree (the lock is held). Raises CorruptionError."""
    cdef Tree t = tree_of(seg)
    cdef int32_t i, j, page, steps, parent
    cdef int64_t cached = 0, protected = 0, evictable = 0, in_table = 0, heap_entries = 0
    cdef HkvRadixNode* node
    cdef HkvRadixNode* up
    cdef int32_t* refcounts = page_refcounts(seg)
    slab_check(seg, t.slab, "radix node")
    if t.state.rt_heap_size < 0 or t.state.rt_heap_size > t.node_capacity:
        seg.corrupt(f"eviction heap size {t.state.rt_heap_size} outside [0, {t.node_capacity}]")
    owner = np.full(t.num_pages, -1, dtype=np.int64)
    children = np.zeros(t.node_capacity, dtype=np.int64)
    child_locks = np.zeros(t.node_capacity, dtype=np.int64)
    for i in range(t.node_capacity):
        node = node_ptr(&t, i)
        if node.rn_slab.sr_in_use != 1:
            continue
        if node.rn_num_pages < 1:
            seg.corrupt(f"radix node {i} covers {node.rn_num_pages} pages")
        if node.rn_lock_count < 0:
            seg.corrupt(f"radix node {i} has lock count {node.rn_lock_count}")
        parent = node.rn_parent
        if parent != -1:
            up = node_at(seg, &t, parent)
            if up.rn_namespace != node.rn_namespace:
                seg.corrupt(f"radix node {i} is in another namespace than its parent {parent}")
            children[parent] += 1
            child_locks[parent] += node.rn_lock_count
        # Every node reaches a top-level node: no cycles, no orphans.
        steps = 0
        j = parent
        while j != -1:
            j = node_at(seg, &t, j).rn_parent
            steps += 1
            if steps > t.node_capacity:
                seg.corrupt(f"radix node {i}: a cycle in its parent links")
        # Its pages: in range, held, each in exactly one node, the last one ends the node.
        page = node.rn_first_page
        for j in range(node.rn_num_pages):
            check_page_index(seg, page)
            if owner[page] != -1:
                seg.corrupt(f"page {page} is in radix nodes {owner[page]} and {i}")
            owner[page] = i
            if refcounts[page] < 1:
                seg.corrupt(f"page {page} of radix node {i} has refcount {refcounts[page]}")
            if j == node.rn_num_pages - 1:
                if t.page_next[page] != END_OF_NODE:
                    seg.corrupt(f"radix node {i}'s last page {page} links on to {t.page_next[page]}")
            page = t.page_next[page]
        if node.rn_key_hash != page_hash(&t, tokens_of(&t, node.rn_first_page)):
            seg.corrupt(f"radix node {i}'s key hash does not match its first page")
        if table_find(&t, node.rn_parent, node.rn_namespace, tokens_of(&t, node.rn_first_page)) != i:
            seg.corrupt(f"radix node {i} is not found by a lookup of its first page")
        cached += node.rn_num_pages
        if node.rn_lock_count > 0:
            protected += node.rn_num_pages
        if node.rn_lock_count == 0 and node.rn_num_children == 0:
            evictable += node.rn_num_pages
            if node.rn_heap_pos < 0 or node.rn_heap_pos >= t.state.rt_heap_size or t.heap[node.rn_heap_pos] != i:
                seg.corrupt(f"radix node {i} is an unlocked leaf but not in the eviction heap")
        elif node.rn_heap_pos != -1:
            seg.corrupt(f"radix node {i} is in the eviction heap but not evictable")
    for i in range(t.node_capacity):
        node = node_ptr(&t, i)
        if node.rn_slab.sr_in_use != 1:
            continue
        if children[i] != node.rn_num_children:
            seg.corrupt(f"radix node {i} counts {node.rn_num_children} children, has {children[i]}")
        if child_locks[i] > node.rn_lock_count:
            seg.corrupt(f"radix node {i} has lock count {node.rn_lock_count} below its "
                        f"children's {child_locks[i]}")
    for page in range(t.num_pages):
        if (owner[page] == -1) != (t.page_next[page] == NOT_IN_TREE):
            seg.corrupt(f"page {page}: tree link {t.page_next[page]} but owner {owner[page]}")
    for j in range(t.table_mask + 1):
        if t.table[j] != -1:
            node_at(seg, &t, t.table[j])
            in_table += 1
    if in_table != t.slab.sl_used:
        seg.corrupt(f"the child table holds {in_table} nodes, {t.slab.sl_used} are in use")
    for j in range(t.state.rt_heap_size):
        if j > 0 and heap_before(&t, heap_entry(seg, &t, j), heap_entry(seg, &t, (j - 1) // 2)):
            seg.corrupt(f"the eviction heap is out of order at {j}")
    if (cached != t.state.rt_cached_pages or protected != t.state.rt_protected_pages
            or evictable != t.state.rt_evictable_leaf_pages):
        seg.corrupt(
            f"tree counts: cached {t.state.rt_cached_pages} (walked {cached}), protected "
            f"{t.state.rt_protected_pages} (walked {protected}), evictable leaf pages "
            f"{t.state.rt_evictable_leaf_pages} (walked {evictable})")
    return 0


# -- Python entry points (each one lock, one mutation) -----------------------------------------------

cdef inline int32_t* i32_data(cnp.ndarray arr) noexcept:
    return <int32_t*>cnp.PyArray_DATA(arr)


cdef int check_i32(cnp.ndarray arr, str what) except -1:
    """The compiled entry points read arrays raw: they must be 1-D, int32 and contiguous."""
    if (arr.ndim != 1 or cnp.PyArray_TYPE(arr) != cnp.NPY_INT32
            or not cnp.PyArray_IS_C_CONTIGUOUS(arr) or not cnp.PyArray_ISNOTSWAPPED(arr)
            or not cnp.PyArray_ISALIGNED(arr)):
        # (A big-endian '>i4' array is NPY_INT32 too: read raw, its ids would be others.)
        raise ValueError(f"{what} must be a contiguous 1-D np.int32 array, got {arr.dtype} "
                         f"with shape {(<object>arr).shape}")
    return 0


cdef int64_t full_pages(Segment seg, cnp.ndarray tokens) except -1:
    """How many full pages tokens fill. Read before taking the lock (whose begin() checks the
    rest of the header), so the page size is checked here: 0 would divide by zero."""
    cdef int32_t page_size = seg.hdr.hdr_config.cfg_page_size
    if page_size <= 0:
        seg.corrupt(f"page size {page_size} in the header")
    return tokens.shape[0] // page_size


def match(Segment seg, cnp.ndarray tokens, uint64_t namespace):
    """The longest cached page-aligned prefix of tokens: (num_pages, pages). A pure lookup."""
    cdef Tree t
    cdef Walk walk
    cdef int64_t num_pages
    cdef cnp.ndarray pages
    check_i32(tokens, "tokens")
    check_open(seg)
    num_pages = full_pages(seg, tokens)
    pages = np.empty(num_pages, dtype=np.int32)
    seg.begin()
    try:
        t = tree_of(seg)
        walk_or_raise(seg, &t, i32_data(tokens), num_pages, namespace, i32_data(pages), &walk)
    finally:
        seg.end()
    return pages[:walk.matched]


def borrow(Segment seg, cnp.ndarray tokens, uint64_t namespace):
    """Locks the longest cached prefix: (pages, node to unlock). Counts as a lookup."""
    cdef Tree t
    cdef int32_t node = -1
    cdef int64_t matched
    cdef int32_t page_size
    cdef int64_t num_pages
    cdef cnp.ndarray pages
    cdef HkvHeader* hdr
    check_i32(tokens, "tokens")
    check_open(seg)
    num_pages = full_pages(seg, tokens)
    page_size = seg.hdr.hdr_config.cfg_page_size
    pages = np.empty(num_pages, dtype=np.int32)
    seg.begin()
    try:
        t = tree_of(seg)
        hdr = seg.hdr
        matched = tree_borrow(seg, &t, i32_data(tokens), num_pages, namespace, i32_data(pages), &node,
                              BORROW_REFRESH | BORROW_MAY_EVICT)
        log_store_i64(seg, &hdr.hdr_stats.st_lookups, hdr.hdr_stats.st_lookups + 1)
        log_store_i64(seg, &hdr.hdr_stats.st_lookup_tokens,
                      hdr.hdr_stats.st_lookup_tokens + tokens.shape[0])
        log_store_i64(seg, &hdr.hdr_stats.st_hit_tokens,
                      hdr.hdr_stats.st_hit_tokens + matched * page_size)
        seg.commit()
    finally:
        seg.end()
    return pages[:matched], node


def unlock(Segment seg, int32_t node):
    """Releases a lock taken by borrow() (or insert(..., lock=True))."""
    cdef Tree t
    check_open(seg)
    seg.begin()
    try:
        t = tree_of(seg)
        tree_unlock(seg, &t, node)
        seg.commit()
    finally:
        seg.end()


def insert(Segment seg, cnp.ndarray tokens, cnp.ndarray pages, uint64_t namespace, bint lock=False):
    """Caches the full pages of tokens held in pages: (existing, tree_pages, node).

    existing: how many leading pages were already cached (those of `pages` stay the
    caller's); tree_pages: the tree's page for every full page; node: locked if lock=True.
    """
    cdef Tree t
    cdef int32_t node = -1
    cdef int64_t existing
    cdef int64_t num_pages
    cdef cnp.ndarray tree_pages
    check_i32(tokens, "tokens")
    check_i32(pages, "pages")
    check_open(seg)
    num_pages = full_pages(seg, tokens)
    tree_pages = np.empty(num_pages, dtype=np.int32)
    if pages.shape[0] < num_pages:
        raise ValueError(f"{num_pages} full pages of tokens but only {pages.shape[0]} pages given")
    seg.begin()
    try:
        t = tree_of(seg)
        existing = tree_insert(seg, &t, i32_data(tokens), i32_data(pages), num_pages, namespace,
                               i32_data(tree_pages), &node)
        if lock and node != -1:
            tree_lock(seg, &t, node)
        seg.commit()
    finally:
        seg.end()
    return existing, tree_pages, node


def evict(Segment seg, int64_t num_pages):
    """Evicts up to num_pages unlocked pages, LRU leaves first; returns how many went."""
    cdef Tree t
    cdef int64_t evicted
    check_open(seg)
    if num_pages < 0:
        raise ValueError(f"num_pages must be >= 0, got {num_pages}")
    seg.begin()
    try:
        t = tree_of(seg)
        evicted = tree_evict_pages(seg, &t, num_pages)
        seg.commit()
    finally:
        seg.end()
    return evicted


cdef tuple path_of(Segment seg, Tree* t, int32_t index):
    """(namespace, tokens, pages) of the whole path from the top of the tree to the end of
    node `index`: the token ids are copied (the KV bytes are not). C loops into two fresh
    arrays: this runs under the lock, once per listed node."""
    cdef HkvRadixNode* node
    cdef int32_t steps = 0, page, j, current = index
    cdef int64_t total = 0, at
    cdef cnp.ndarray pages, tokens
    cdef int32_t* out_pages
    cdef int32_t* out_tokens
    # First pass: the path's length (bounded: a cycle is corruption, not a hang).
    while current != -1:
        node = node_at(seg, t, current)
        if node.rn_num_pages < 1:
            seg.corrupt(f"radix node {current} covers {node.rn_num_pages} pages")
        total += node.rn_num_pages
        if total > t.num_pages:
            seg.corrupt(f"radix node {index}'s path holds more pages than the pool")
        current = node.rn_parent
        steps += 1
        if steps > t.node_capacity:
            seg.corrupt("a cycle in the radix tree's parent links")
    pages = np.empty(total, dtype=np.int32)
    tokens = np.empty(total * t.page_size, dtype=np.int32)
    out_pages = <int32_t*>cnp.PyArray_DATA(pages)
    out_tokens = <int32_t*>cnp.PyArray_DATA(tokens)
    # Second pass, from the node up: each node's pages fill the path from its end backwards.
    at = total
    current = index
    while current != -1:
        node = node_at(seg, t, current)
        at -= node.rn_num_pages
        page = node.rn_first_page
        for j in range(node.rn_num_pages):
            check_page_index(seg, page)
            out_pages[at + j] = page
            memcpy(out_tokens + (at + j) * t.page_size, tokens_of(t, page),
                   <size_t>t.page_size * sizeof(int32_t))
            page = t.page_next[page]
        current = node.rn_parent
    return node_at(seg, t, index).rn_namespace, tokens, pages


def eviction_candidates(Segment seg, int64_t max_pages, int64_t skip_pages=0):
    """The nodes the next evictions would take, in that order, until they cover max_pages
    pages (or every evictable page): a list of (namespace, path tokens, path pages, node
    pages, position), the node's own pages being the last `node pages` of its path, and
    position the pages eviction would take before them. With skip_pages,
    the nodes eviction would take first, as long as they fit in skip_pages pages, are
    passed over unlisted (and uncopied): a caller reads a long order in short holds.

    Reads only, under one lock: nothing changes, no recency is refreshed. Eviction takes
    the least recently used unlocked leaf, and a node whose children all went becomes a
    leaf in its turn; this replays that order on a best-first walk of the heap (O(k log k)
    for k nodes listed, not O(heap)) and the parent links, without changing either. Ties
    fall as in the heap, by node index. Eviction may trim the last node from its tail
    instead of taking it whole; it is listed whole. Only token ids and page indices are
    copied under the lock, never KV bytes.

    Raises:
        ValueError: max_pages < 0.
        CorruptionError: a bad index or a cycle in the tree.
    """
    cdef Tree t
    cdef int64_t taken = 0, skipped = 0, rounds = 0
    cdef int32_t index, pos, child, parent, size, left
    cdef HkvRadixNode* node
    cdef HkvRadixNode* up
    check_open(seg)
    if max_pages < 0 or skip_pages < 0:
        raise ValueError(f"max_pages and skip_pages must be >= 0, got {max_pages}, {skip_pages}")
    out = []
    seg.begin()
    try:
        t = tree_of(seg)
        size = t.state.rt_heap_size
        if size < 0 or size > t.node_capacity:
            seg.corrupt(f"eviction heap size {size} outside [0, {t.node_capacity}]")
        frontier = []       # (last access, node, heap position or -1 for a node made a leaf)
        if size > 0 and max_pages > 0:
            index = heap_entry(seg, &t, 0)
            frontier.append((node_at(seg, &t, index).rn_last_access, index, 0))
        remaining = {}      # parent -> its children not listed yet
        listed = set()
        while frontier and taken < max_pages:
            rounds += 1
            if rounds > 2 * <int64_t>t.node_capacity + 2:
                seg.corrupt("the eviction heap or the parent links loop")
            _, index, pos = heapq.heappop(frontier)
            if pos >= 0:
                # The heap's order puts each entry's children after it: walk them lazily.
                for child in (2 * pos + 1, 2 * pos + 2):
                    if child < size:
                        parent = heap_entry(seg, &t, child)
                        heapq.heappush(frontier,
                                       (node_at(seg, &t, parent).rn_last_access, parent, child))
            if index in listed:
                seg.corrupt(f"radix node {index} is both in the eviction heap and a parent")
            listed.add(index)
            node = node_at(seg, &t, index)
            if node.rn_lock_count != 0:
                seg.corrupt(f"radix node {index} is in the eviction heap but locked")
            if not taken and skipped + node.rn_num_pages <= skip_pages:
                # Skipping stops at the first node listed: a later, smaller node that would
                # still fit the budget is next in the order, not to be left out.
                skipped += node.rn_num_pages
            else:
                namespace, tokens, pages = path_of(seg, &t, index)
                out.append((namespace, tokens, pages, node.rn_num_pages, skipped + taken))
                taken += node.rn_num_pages
            parent = node.rn_parent
            if parent != -1:
                up = node_at(seg, &t, parent)
                left = remaining.get(parent, up.rn_num_children) - 1
                remaining[parent] = left
                if left == 0 and up.rn_lock_count == 0:
                    heapq.heappush(frontier, (up.rn_last_access, parent, -1))
    finally:
        seg.end()
    return out


def check_tree(Segment seg):
    """Checks the tree's invariants; call with the lock held."""
    check_open(seg)
    tree_check(seg)


def tree_contents(Segment seg):
    """Every cached node as (namespace, tokens of its whole path, pages of its whole path,
    lock count): a set, for tests and inspect. Call with the lock held."""
    cdef Tree t
    cdef int32_t i, j, k, page, index, steps
    cdef HkvRadixNode* node
    check_open(seg)
    t = tree_of(seg)
    out = set()
    for i in range(t.node_capacity):
        node = node_ptr(&t, i)
        if node.rn_slab.sr_in_use != 1:
            continue
        chain = []
        index = i
        steps = 0
        while index != -1:
            chain.append(index)
            index = node_at(seg, &t, index).rn_parent
            steps += 1
            if steps > t.node_capacity:
                seg.corrupt("a cycle in the radix tree's parent links")
        tokens = []
        pages = []
        for index in reversed(chain):
            node = node_at(seg, &t, index)
            page = node.rn_first_page
            for j in range(node.rn_num_pages):
                check_page_index(seg, page)
                for k in range(t.page_size):
                    tokens.append(t.page_tokens[<int64_t>page * t.page_size + k])
                pages.append(page)
                page = t.page_next[page]
                if len(pages) > t.num_pages:
                    # Each page is in one node at most: a longer path loops (a cycle of
                    # page links, or a corrupt page count).
                    seg.corrupt(f"radix node {i}'s path holds more pages than the pool")
        node = node_ptr(&t, i)
        out.add((node.rn_namespace, tuple(tokens), tuple(pages), node.rn_lock_count))
    return out


INSPECT_TOKENS = 8          # leading tokens of each node that inspect shows


def tree_summary_chunk(Segment seg, int32_t start, int32_t max_nodes):
    """A bounded piece of the tree for inspect: the nodes in use among records [start,
    start + max_nodes), each as (index, parent, num_pages, namespace, lock_count, its first
    INSPECT_TOKENS token ids). Returns (nodes, next start, generation); next start is -1
    after the last record. Call with the lock held; the cost is O(max_nodes), so an observer
    walks a big tree in many short holds instead of one long one (issue 10)."""
    cdef Tree t
    cdef int32_t i, end, page, k, steps
    cdef HkvRadixNode* node
    check_open(seg)
    if max_nodes <= 0:
        raise ValueError(f"max_nodes must be positive, got {max_nodes}")
    t = tree_of(seg)
    if start < 0 or start > t.node_capacity:
        raise ValueError(f"start must be in [0, {t.node_capacity}], got {start}")
    end = start + max_nodes if max_nodes < t.node_capacity - start else t.node_capacity
    out = []
    for i in range(start, end):
        node = node_ptr(&t, i)
        if node.rn_slab.sr_in_use != 1:
            continue
        tokens = []
        page = node.rn_first_page
        steps = 0
        while len(tokens) < INSPECT_TOKENS and steps < node.rn_num_pages:
            check_page_index(seg, page)
            for k in range(min(t.page_size, INSPECT_TOKENS - len(tokens))):
                tokens.append(t.page_tokens[<int64_t>page * t.page_size + k])
            page = t.page_next[page]
            steps += 1
        out.append((i, node.rn_parent, node.rn_num_pages, node.rn_namespace,
                    node.rn_lock_count, tuple(tokens)))
    return out, (end if end < t.node_capacity else -1), seg.hdr.hdr_generation


def _compare_ceiling(cnp.ndarray a, cnp.ndarray b, int64_t page_size, int64_t repeats):
    """Benchmark helper: compares two int32 token arrays page by page with memcmp, as a match
    does, `repeats` times; returns how many pages compared equal (so the loop is not elided)."""
    cdef int64_t n = a.shape[0] // page_size, r, i, equal = 0
    cdef const int32_t* pa = <const int32_t*>cnp.PyArray_DATA(a)
    cdef const int32_t* pb = <const int32_t*>cnp.PyArray_DATA(b)
    with nogil:
        for r in range(repeats):
            for i in range(n):
                if memcmp(pa + i * page_size, pb + i * page_size, <size_t>page_size * 4) == 0:
                    equal += 1
    return equal


cdef int64_t first_negative(const int32_t* data, int64_t n) noexcept nogil:
    """The index of the first negative id of data[:n], or -1. It ORs blocks of ids (a loop
    without a branch, which the compiler vectorizes: ~0.05 ns an id, where a loop that
    stops at the first negative id costs ~0.8) and looks for the index only in a block
    whose OR is negative."""
    cdef int64_t i = 0, j, end
    cdef int32_t acc
    while i < n:
        end = min(i + 4096, n)
        acc = 0
        for j in range(i, end):
            acc = acc | data[j]
        if acc < 0:
            for j in range(i, end):
                if data[j] < 0:
                    return j
        i = end
    return -1


def first_bad_token(cnp.ndarray tokens):
    """The index of the first token id outside [0, 2**31) in a contiguous int32 array, or -1.

    (For int32 only negative ids can be out of range.) A C loop: validating a prompt costs
    a fraction of a microsecond, not a numpy reduction's call overhead."""
    cdef int64_t found
    check_i32(tokens, "tokens")
    with nogil:
        found = first_negative(<const int32_t*>cnp.PyArray_DATA(tokens), tokens.shape[0])
    return found


def checked_copy(cnp.ndarray tokens):
    """A new array holding a copy of a contiguous int32 token array, or None when an id is
    outside [0, 2**31) (first_bad_token says which): one C call where a check and a numpy
    copy would be two, for a caller that must not keep the caller's own memory."""
    check_i32(tokens, "tokens")
    return checked_i32_copy(tokens)


cdef object checked_i32_copy(cnp.ndarray tokens):
    """checked_copy of an array already known to be contiguous, aligned, native int32."""
    cdef int64_t n = tokens.shape[0], found
    cdef cnp.ndarray out = cnp.PyArray_EMPTY(1, [n], cnp.NPY_INT32, 0)
    with nogil:
        memcpy(cnp.PyArray_DATA(out), cnp.PyArray_DATA(tokens), <size_t>n * 4)
        found = first_negative(<const int32_t*>cnp.PyArray_DATA(out), n)
    return out if found < 0 else None


cdef extern from "Python.h":
    bint PyLong_CheckExact(PyObject* obj) noexcept
    PyObject** PySequence_Fast_ITEMS(object seq) noexcept
    Py_ssize_t PySequence_Fast_GET_SIZE(object seq) noexcept

cdef extern from *:
    """
    #if PY_VERSION_HEX < 0x030B0000
    #include "longintrepr.h"
    #endif
    /* An exact int's value when it lies in [0, 2**31), else -1. Reads a small int's digits
       directly, as Cython's own conversions do: a token costs a load, not a call. */
    static inline long long hkv_token_value(PyObject* obj) {
    #if PY_VERSION_HEX >= 0x030C0000
        if (PyUnstable_Long_IsCompact((PyLongObject*)obj)) {
            Py_ssize_t v = PyUnstable_Long_CompactValue((PyLongObject*)obj);
            return (v >= 0 && v < 2147483648LL) ? (long long)v : -1;
        }
        return -1;
    #else
        /* ob_size is the digit count, negative for negative ints. */
        Py_ssize_t size = Py_SIZE(obj), i;
        const digit* d = ((PyLongObject*)obj)->ob_digit;
        long long v = 0;
        if (__builtin_expect(size == 1, 1)) return (long long)d[0];      /* < 2**PyLong_SHIFT <= 2**30 */
        if (size < 0 || size > (31 + PyLong_SHIFT - 1) / PyLong_SHIFT) return -1;
        for (i = size - 1; i >= 0; i--) v = (v << PyLong_SHIFT) | (long long)d[i];
        return v < 2147483648LL ? v : -1;
    #endif
    }
    """
    long long hkv_token_value(PyObject* obj) noexcept


def tokens_from_sequence(object seq, str what):
    """Reads a list or tuple of Python ints as a new contiguous np.int32 array, or None.

    The engines' own format (vLLM and SGLang hold prompts as Python lists) read in one C
    loop, with no intermediate numpy conversion: a few ns per token. Returns None when an
    item is not exactly an int (a bool, a numpy integer, anything else), so the caller's
    general path decides; no Python code runs while the items are read, so the sequence
    cannot change under the loop.

    Raises:
        ValueError: an id outside [0, 2**31), naming its index and value.
    """
    if type(seq) is not list and type(seq) is not tuple:
        raise TypeError(f"tokens_from_sequence needs a list or tuple, got {type(seq).__name__}")
    return sequence_tokens(seq, what, -1)


cdef object sequence_tokens(object seq, str what, Py_ssize_t request):
    """tokens_from_sequence for a list or tuple. The sequence is named `what` in errors, or,
    with request >= 0, `what[request].tokens`: a batch's caller then formats no name for
    the requests that have no error."""
    cdef Py_ssize_t i, n = PySequence_Fast_GET_SIZE(seq)
    cdef PyObject** items
    cdef PyObject* item
    cdef long long value
    cdef cnp.ndarray out = cnp.PyArray_EMPTY(1, [n], cnp.NPY_INT32, 0)
    cdef int32_t* dst = <int32_t*>cnp.PyArray_DATA(out)
    # The items are read only now, after the one allocation, with nothing in between that
    # could run Python code (a list's item array moves when the list grows).
    items = PySequence_Fast_ITEMS(seq)
    for i in range(n):
        item = items[i]
        if not PyLong_CheckExact(item):
            return None
        value = hkv_token_value(item)
        if value < 0:
            name = what if request < 0 else f"{what}[{request}].tokens"
            raise ValueError(f"{name}[{i}] = {<object>item} is outside [0, 2**31)")
        dst[i] = <int32_t>value
    return out
