# cython: language_level=3, embedsignature=True
"""The radix tree read without changing it: the invariant check behind check(), the dumps
tests and `hostkv inspect` read (tree_contents, tree_summary_chunk), and the order the next
evictions would take (eviction_candidates), for a tier that copies cold pages out first.

Each walks the tree through _radix.pxd's accessors, bounds-checks every index it follows and
reports a bad one or a cycle as CorruptionError; none logs a store.
"""

import heapq

import numpy as np
cimport numpy as cnp

from libc.stdint cimport int32_t, int64_t
from libc.string cimport memcpy

from hostkv._layout cimport HkvRadixNode
from hostkv._lock cimport check_open
from hostkv._pages cimport check_page_index, page_refcounts
from hostkv._radix cimport (
    END_OF_NODE, NOT_IN_TREE, Tree, heap_before, heap_entry, node_at, node_ptr, page_hash,
    part_heap_before, table_find, tokens_of, tree_of)
from hostkv._segment cimport Segment
from hostkv._slab cimport slab_check

cnp.import_array()


# -- checking --------------------------------------------------------------------------------------

def check_tree(Segment seg):
    """Checks the tree's invariants; call with the lock held."""
    check_open(seg)
    tree_check(seg)


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
    if t.has_parts:
        parts_check(seg, &t)
    return 0


cdef int parts_check(Segment seg, Tree* t) except -1:
    """The part LRU's invariants (tree_check found the nodes' pages sound): each node counts
    exactly its pages that have a part, the counts sum to pt_tree_parts, every unlocked node
    with parts is in the part heap (a locked one may be parked out of it), only nodes with
    parts are, in order, and no node's key is ahead of its last access."""
    cdef int32_t i, j, page, count, size = t.parts.pt_heap_size
    cdef int64_t tree_parts = 0
    cdef HkvRadixNode* node
    if size < 0 or size > t.node_capacity:
        seg.corrupt(f"part heap size {size} outside [0, {t.node_capacity}]")
    for i in range(t.node_capacity):
        node = node_ptr(t, i)
        np = &t.node_parts[i]
        if node.rn_slab.sr_in_use != 1:
            if np.np_count != 0 or np.np_heap_pos != -1:
                seg.corrupt(f"free radix node record {i} has {np.np_count} parts or part heap "
                            f"place {np.np_heap_pos}")
            continue
        count = 0
        page = node.rn_first_page
        for j in range(node.rn_num_pages):
            if t.page_part[page] != -1:
                count += 1
            page = t.page_next[page]
        if count != np.np_count:
            seg.corrupt(f"radix node {i} counts {np.np_count} parts, its pages have {count}")
        tree_parts += count
        if np.np_key > node.rn_last_access:
            seg.corrupt(f"radix node {i}'s part key {np.np_key} is ahead of its last access "
                        f"{node.rn_last_access}")
        if np.np_heap_pos != -1:
            if np.np_heap_pos < 0 or np.np_heap_pos >= size or t.part_heap[np.np_heap_pos] != i:
                seg.corrupt(f"radix node {i} has part heap place {np.np_heap_pos}, not its own")
            if count == 0:
                seg.corrupt(f"radix node {i} is in the part heap without parts")
        elif count > 0 and node.rn_lock_count == 0:
            seg.corrupt(f"radix node {i} has {count} parts, is unlocked and not in the part heap")
    if tree_parts != t.parts.pt_tree_parts:
        seg.corrupt(f"tree parts: counted {t.parts.pt_tree_parts}, walked {tree_parts}")
    for j in range(size):
        i = heap_entry(seg, t, j, True)
        if t.node_parts[i].np_heap_pos != j:
            seg.corrupt(f"part heap entry {j} is node {i}, whose place is "
                        f"{t.node_parts[i].np_heap_pos}")
        if j > 0 and part_heap_before(t, i, heap_entry(seg, t, (j - 1) // 2, True)):
            seg.corrupt(f"the part heap is out of order at {j}")
    return 0


# -- dumps -----------------------------------------------------------------------------------------

def part_lru_state(Segment seg):
    """Every node with window parts as (first page, parts, age of its LRU key in ticks): a
    set, for tests (crash snapshots compare it). Call with the lock held."""
    cdef Tree t
    cdef int32_t i
    cdef HkvRadixNode* node
    check_open(seg)
    t = tree_of(seg)
    out = set()
    if not t.has_parts:
        return out
    for i in range(t.node_capacity):
        node = node_ptr(&t, i)
        if node.rn_slab.sr_in_use == 1 and t.node_parts[i].np_count > 0:
            out.add((node.rn_first_page, t.node_parts[i].np_count,
                     t.state.rt_tick - t.node_parts[i].np_key))
    return out


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
    walks a big tree in many short holds instead of one long one."""
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


# -- the eviction order ---------------------------------------------------------------------------

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
