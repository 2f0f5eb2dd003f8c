# cython: language_level=3, embedsignature=True
"""The radix-tree prefix cache in the segment: match, borrow (lock), insert, evict.

Every function that changes the tree runs inside an open mutation and changes shared state
only through logged stores, so an exception or a death at any step rolls back whole. The
memory map is in _layout.pxd, the structure and its small accessors in _radix.pxd; the walks
that read the tree without changing it (its check, its dumps, the eviction order) are
_introspect's, and the token input both read is _tokens'.
"""

import numpy as np
cimport numpy as cnp

from libc.stdint cimport int32_t, int64_t, uint64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcmp

from hostkv._layout cimport HkvHeader, HkvNodeParts, HkvRadixNode, HkvSlab, HKV_HINT_SLOTS
from hostkv._lock cimport check_open, log_store_i32, log_store_i64
from hostkv._pages cimport (check_page_index, page_decref, page_incref, page_refcounts, part_donate,
                            part_free)
from hostkv._segment cimport Segment, add_rederive_hook
from hostkv._slab cimport slab_alloc, slab_free, slab_rederive
from hostkv._tokens cimport check_i32

from hostkv.errors import CapacityError

cnp.import_array()


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
    t.has_parts = hdr.hdr_config.cfg_num_parts > 0
    t.node_parts = <HkvNodeParts*>(seg.base + hdr.hdr_regions.reg_node_parts)
    t.part_heap = <int32_t*>(seg.base + hdr.hdr_regions.reg_part_heap)
    t.parts = &hdr.hdr_parts
    t.page_part = <int32_t*>(seg.base + hdr.hdr_regions.reg_page_part)
    return t


cdef HkvRadixNode* node_at(Segment seg, Tree* t, int64_t index) except NULL:
    """The in-use node at index, bounds-checked."""
    cdef HkvRadixNode* node
    if index < 0 or index >= t.node_capacity:
        seg.corrupt(f"radix node index {index} outside [0, {t.node_capacity})")
    node = node_ptr(t, <int32_t>index)
    if node.rn_slab.sr_in_use != 1:
        seg.corrupt(f"radix node {index} is referenced but free")
    return node


# -- hashing -----------------------------------------------------------------------------------

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


# -- the heaps: the eviction heap of unlocked leaves by (last access, index), and the part LRU
# of nodes holding window parts by (np_key, first page); `parts` says which (see _radix.pxd)

cdef str heap_name(bint parts):
    return "part heap" if parts else "eviction heap"


cdef int heap_put(Segment seg, Tree* t, int32_t pos, int32_t index, bint parts=False) except -1:
    cdef int32_t* slots = heap_slots(t, parts)
    cdef int32_t* place
    node_at(seg, t, index)
    place = heap_place(t, parts, index)
    # An entry a sift leaves where it was is already there: no stores to log.
    if slots[pos] != index:
        log_store_i32(seg, &slots[pos], index)
    if place[0] != pos:
        log_store_i32(seg, place, pos)
    return 0


cdef int32_t heap_entry(Segment seg, Tree* t, int64_t pos, bint parts=False) except -1:
    """The heap's entry at pos: the position checked against the heap's size, the size
    against the capacity and the entry against the node table (all read from the segment)."""
    cdef int32_t size = heap_size(t, parts)[0]
    cdef int32_t entry
    if size < 0 or size > t.node_capacity or pos < 0 or pos >= size:
        seg.corrupt(f"{heap_name(parts)} position {pos} outside its size {size} "
                    f"(capacity {t.node_capacity})")
    entry = heap_slots(t, parts)[pos]
    if entry < 0 or entry >= t.node_capacity:
        seg.corrupt(f"{heap_name(parts)} entry {pos} is node {entry}, outside "
                    f"[0, {t.node_capacity})")
    return entry


cdef int heap_sift(Segment seg, Tree* t, int32_t pos, bint parts=False) except -1:
    """Moves the entry at pos up or down until the heap order holds again."""
    cdef int32_t size = heap_size(t, parts)[0]
    cdef int32_t entry = heap_entry(seg, t, pos, parts), parent, child, other
    while pos > 0:
        parent = (pos - 1) // 2
        other = heap_entry(seg, t, parent, parts)
        if not heap_order(t, parts, entry, other):
            break
        heap_put(seg, t, pos, other, parts)
        pos = parent
    while True:
        child = 2 * pos + 1
        if child >= size:
            break
        other = heap_entry(seg, t, child, parts)
        if child + 1 < size and heap_order(t, parts, heap_entry(seg, t, child + 1, parts), other):
            child += 1
            other = heap_slots(t, parts)[child]
        if not heap_order(t, parts, other, entry):
            break
        heap_put(seg, t, pos, other, parts)
        pos = child
    heap_put(seg, t, pos, entry, parts)
    return 0


cdef int heap_push(Segment seg, Tree* t, int32_t index, bint parts=False) except -1:
    cdef int32_t pos = heap_size(t, parts)[0]
    if pos < 0 or pos >= t.node_capacity:
        seg.corrupt(f"{heap_name(parts)} size {pos} outside [0, {t.node_capacity})")
    log_store_i32(seg, heap_size(t, parts), pos + 1)
    log_store_i32(seg, &heap_slots(t, parts)[pos], index)
    heap_sift(seg, t, pos, parts)
    return 0


cdef int heap_remove(Segment seg, Tree* t, int32_t index, bint parts=False) except -1:
    cdef int32_t pos, moved
    cdef int32_t last = heap_size(t, parts)[0] - 1
    node_at(seg, t, index)
    pos = heap_place(t, parts, index)[0]
    if pos < 0 or pos > last or heap_entry(seg, t, pos, parts) != index:
        seg.corrupt(f"radix node {index} has {heap_name(parts)} position {pos}, not in the heap")
    moved = heap_entry(seg, t, last, parts)
    log_store_i32(seg, heap_size(t, parts), last)
    log_store_i32(seg, heap_place(t, parts, index), -1)
    if pos != last:
        log_store_i32(seg, &heap_slots(t, parts)[pos], moved)
        heap_sift(seg, t, pos, parts)
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


# -- the part LRU: nodes holding window parts, in the heap with parts=True ----------------------

cdef int part_heap_push(Segment seg, Tree* t, int32_t index) except -1:
    """Enters a node (not in the part heap) at its current recency."""
    return part_heap_push_keyed(seg, t, index, node_at(seg, t, index).rn_last_access)


cdef int part_heap_push_keyed(Segment seg, Tree* t, int32_t index, int64_t key) except -1:
    """Enters a node (not in the part heap) with the given recency key."""
    node_at(seg, t, index)
    if t.node_parts[index].np_heap_pos != -1:
        seg.corrupt(f"radix node {index} entered the part heap twice")
    if t.node_parts[index].np_key != key:
        log_store_i64(seg, &t.node_parts[index].np_key, key)
    heap_push(seg, t, index, True)
    return 0


cdef int node_parts_gain(Segment seg, Tree* t, int32_t index, int32_t count) except -1:
    """count more of the node's pages have a part; an unlocked node enters the heap."""
    cdef HkvNodeParts* np = &t.node_parts[index]
    cdef HkvRadixNode* node = node_at(seg, t, index)
    if count <= 0:
        return 0
    log_store_i32(seg, &np.np_count, np.np_count + count)
    log_store_i64(seg, &t.parts.pt_tree_parts, t.parts.pt_tree_parts + count)
    if np.np_heap_pos < 0 and node.rn_lock_count == 0:
        part_heap_push(seg, t, index)
    return 0


cdef int node_parts_lose(Segment seg, Tree* t, int32_t index, int32_t count) except -1:
    """count of the node's parts left it (its pages left the tree); at 0 it leaves the heap."""
    cdef HkvNodeParts* np = &t.node_parts[index]
    if count <= 0:
        return 0
    if count > np.np_count:
        seg.corrupt(f"radix node {index} loses {count} parts but counts {np.np_count}")
    log_store_i32(seg, &np.np_count, np.np_count - count)
    log_store_i64(seg, &t.parts.pt_tree_parts, t.parts.pt_tree_parts - count)
    if np.np_count == 0 and np.np_heap_pos >= 0:
        heap_remove(seg, t, index, True)
    return 0


cdef int32_t count_parts(Segment seg, Tree* t, int32_t page, int32_t num_pages) except -1:
    """How many of num_pages linked pages from page have a part."""
    cdef int32_t i, count = 0
    if num_pages < 0 or num_pages > t.num_pages:
        seg.corrupt(f"a run of {num_pages} pages in a pool of {t.num_pages}")
    for i in range(num_pages):
        check_page_index(seg, page)
        if t.page_part[page] != -1:
            count += 1
        page = t.page_next[page]
    return count


cdef int64_t evict_node_parts(Segment seg, Tree* t, int32_t index) except -1:
    """Frees every part of an unlocked node's pages (the pages stay cached)."""
    cdef HkvRadixNode* node = node_at(seg, t, index)
    cdef int32_t page = node.rn_first_page, i, freed = 0
    if node.rn_num_pages < 1 or node.rn_num_pages > t.num_pages:
        seg.corrupt(f"radix node {index} covers {node.rn_num_pages} pages")
    for i in range(node.rn_num_pages):
        check_page_index(seg, page)
        if t.page_part[page] != -1:
            part_free(seg, page)
            freed += 1
        page = t.page_next[page]
    if freed == 0 or freed != t.node_parts[index].np_count:
        # (0: a node in the heap without parts; taking nothing would loop for ever.)
        seg.corrupt(f"radix node {index} in the part heap counts "
                    f"{t.node_parts[index].np_count} parts but its pages have {freed}")
    node_parts_lose(seg, t, index, freed)
    log_store_i64(seg, &t.parts.pt_parts_evicted, t.parts.pt_parts_evicted + freed)
    return freed


cdef int64_t ensure_free_parts(Segment seg, Tree* t, int64_t need) except -1:
    """Evicts tree parts, least recently used unlocked node first (all of its parts), until
    `need` parts are free or no unlocked node has any. Never raises for a shortage: a page
    without a part is still a page. Returns the parts evicted.

    The heap is lazy: a node a borrower locked since it entered is parked (out of the heap,
    back at its last unlock), and one used since is re-keyed and sifted, before anything is
    taken. So the node taken is exactly the unlocked node with parts of least (last access,
    first page): any other one's true recency is at least its key, which is at least this
    one's."""
    cdef int64_t evicted = 0
    cdef int32_t index
    cdef HkvRadixNode* node
    if not t.has_parts:
        return 0
    while t.parts.pt_free_parts < need and t.parts.pt_heap_size > 0:
        index = heap_entry(seg, t, 0, True)
        node = node_at(seg, t, index)
        if node.rn_lock_count > 0:
            heap_remove(seg, t, index, True)
        elif t.node_parts[index].np_key < node.rn_last_access:
            log_store_i64(seg, &t.node_parts[index].np_key, node.rn_last_access)
            heap_sift(seg, t, 0, True)
        else:
            evicted += evict_node_parts(seg, t, index)
    return evicted


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
            if (t.has_parts and t.node_parts[index].np_count > 0
                    and t.node_parts[index].np_heap_pos < 0):
                part_heap_push(seg, t, index)      # parked by an eviction while locked
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
                         int32_t* out_pages, Walk* walk, int32_t* out_nodes=NULL) noexcept nogil:
    """tree_walk from the end of start_node, taken as the first start_pages pages matched
    (-1 and 0: from the root). out_pages[:start_pages] is left as it was; out_nodes (if not
    NULL) receives the node of each matched page from start_pages on."""
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
            if out_nodes != NULL:
                out_nodes[pos] = child
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
                       int32_t start_node=-1, int64_t start_pages=0,
                       int32_t* out_nodes=NULL) except -1:
    with nogil:
        tree_walk_below(t, start_node, start_pages, tokens, num_pages, namespace, out_pages,
                        walk, out_nodes)
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
    if t.has_parts:
        split_parts(seg, t, index, head_index, head_pages)
    return head_index


cdef int split_parts(Segment seg, Tree* t, int32_t index, int32_t head_index,
                     int32_t head_pages) except -1:
    """The head of a split takes the parts of its pages and the node's recency key; each
    is in the part heap if the node was and it has parts. The node's first page changed,
    which breaks its ties in the heap: it is sifted."""
    cdef HkvNodeParts* np = &t.node_parts[index]
    cdef HkvNodeParts* head = &t.node_parts[head_index]
    cdef int32_t moved = count_parts(seg, t, node_at(seg, t, head_index).rn_first_page,
                                     head_pages)
    if head.np_count != 0 or head.np_heap_pos != -1:
        seg.corrupt(f"a free radix node record {head_index} had parts or a heap place")
    if head.np_key != np.np_key:
        log_store_i64(seg, &head.np_key, np.np_key)
    if moved > np.np_count:
        seg.corrupt(f"radix node {index} counts {np.np_count} parts, its head has {moved}")
    if moved:
        log_store_i32(seg, &head.np_count, moved)
        log_store_i32(seg, &np.np_count, np.np_count - moved)
        if np.np_heap_pos >= 0:
            # Same recency as the node: entered with the node's key, not the current tick.
            part_heap_push_keyed(seg, t, head_index, np.np_key)
    if np.np_heap_pos >= 0:
        if np.np_count == 0:
            heap_remove(seg, t, index, True)
        else:
            heap_sift(seg, t, np.np_heap_pos, True)
    return 0


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
    if t.has_parts:
        # Its parts go with its pages (freed, unless a sequence still holds a page).
        node_parts_lose(seg, t, index, t.node_parts[index].np_count)
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
    if t.has_parts:
        node_parts_lose(seg, t, index, count_parts(seg, t, t.page_next[last_kept], drop))
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
    out_tree_pages[:its depth] is left as it was.

    Window parts: a page the tree adopts keeps its part; one of the leading pages the tree
    already held hands its part to the tree's page when that has none (donate_parts). -1, or a node deeper than num_pages:
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
    cdef int32_t* walk_nodes = NULL
    out_node[0] = -1
    if num_pages <= 0:
        return 0
    if below != -1:
        below_pages = node_depth(seg, t, below)
        if below_pages > num_pages:
            below, below_pages = -1, 0
    if t.has_parts and num_pages > below_pages:
        walk_nodes = <int32_t*>malloc(num_pages * sizeof(int32_t))
        if walk_nodes == NULL:
            raise MemoryError()
    try:
        walk_or_raise(seg, t, tokens, num_pages, namespace, out_tree_pages, &walk, below,
                      below_pages, walk_nodes)
        existing = walk.matched
        if walk_nodes != NULL:
            donate_parts(seg, t, pages, out_tree_pages, walk_nodes, below_pages, existing)
    finally:
        free(walk_nodes)
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
    if t.has_parts:
        node_parts_gain(seg, t, new_index,
                        count_parts(seg, t, pages[existing], <int32_t>(num_pages - existing)))
    out_node[0] = new_index
    return existing


cdef int donate_parts(Segment seg, Tree* t, const int32_t* pages, const int32_t* tree_pages,
                      const int32_t* nodes, int64_t start, int64_t end) except -1:
    """For each of the caller's pages in [start, end) that the tree already holds as another
    page: if the tree's page has no window part and the caller's has one, the part moves
    to the tree's page (its writer computed it on the same prefix; SGLang adopts an insert's
    sliding-window KV into a node that lost its own likewise). Only a private page the
    caller holds gives: never a page of the tree, or one the caller does not hold."""
    cdef int32_t* refcounts = page_refcounts(seg)
    cdef int64_t i
    cdef int32_t page
    for i in range(start, end):
        page = pages[i]
        if (page == tree_pages[i] or page < 0 or page >= t.num_pages or refcounts[page] <= 0
                or t.page_next[page] != NOT_IN_TREE):
            continue
        if part_donate(seg, page, tree_pages[i]):
            node_parts_gain(seg, t, nodes[i], 1)
    return 0


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


# -- recovery ------------------------------------------------------------------------------------

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
    if t.has_parts:
        rederive_parts(&t)
    return 0


cdef int rederive_parts(Tree* t) except -1:
    """Rebuilds each node's part count, pt_tree_parts and the part heap (the unlocked
    nodes with parts, by their logged keys) from the pages' parts. A page index out of range
    stops its node's count: check() reports it."""
    cdef int32_t i, k, page, count, size = 0
    cdef int64_t tree_parts = 0
    cdef HkvRadixNode* node
    cdef HkvNodeParts* np
    for i in range(t.node_capacity):
        node = node_ptr(t, i)
        np = &t.node_parts[i]
        np.np_heap_pos = -1
        np.np_count = 0
        if node.rn_slab.sr_in_use != 1:
            continue
        count = 0
        page = node.rn_first_page
        for k in range(min(node.rn_num_pages, t.num_pages)):
            if page < 0 or page >= t.num_pages:
                break
            if t.page_part[page] != -1:
                count += 1
            page = t.page_next[page]
        np.np_count = count
        tree_parts += count
        if count > 0 and node.rn_lock_count == 0:
            t.part_heap[size] = i
            np.np_heap_pos = size
            size += 1
    t.parts.pt_heap_size = size
    t.parts.pt_tree_parts = tree_parts
    i = size // 2 - 1
    while i >= 0:
        sift_down_unlogged(t, i, True)
        i -= 1
    return 0


cdef void sift_down_unlogged(Tree* t, int32_t pos, bint parts=False) noexcept nogil:
    cdef int32_t size = heap_size(t, parts)[0]
    cdef int32_t* slots = heap_slots(t, parts)
    cdef int32_t entry = slots[pos], child
    while True:
        child = 2 * pos + 1
        if child >= size:
            break
        if child + 1 < size and heap_order(t, parts, slots[child + 1], slots[child]):
            child += 1
        if not heap_order(t, parts, slots[child], entry):
            break
        slots[pos] = slots[child]
        heap_place(t, parts, slots[pos])[0] = pos
        pos = child
    slots[pos] = entry
    heap_place(t, parts, entry)[0] = pos


add_rederive_hook(rederive_tree)


# -- Python entry points (each one lock, one mutation) -----------------------------------------------

cdef inline int32_t* i32_data(cnp.ndarray arr) noexcept:
    return <int32_t*>cnp.PyArray_DATA(arr)


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


def evict_parts(Segment seg, int64_t want_free):
    """Evicts window parts of cached pages, least recently used unlocked node first, until
    want_free parts are free (or no unlocked node has any); returns how many went. What an
    allocation does before it hands out fresh pages."""
    cdef Tree t
    cdef int64_t evicted
    check_open(seg)
    if want_free < 0:
        raise ValueError(f"want_free must be >= 0, got {want_free}")
    seg.begin()
    try:
        t = tree_of(seg)
        evicted = ensure_free_parts(seg, &t, want_free)
        seg.commit()
    finally:
        seg.end()
    return evicted


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
