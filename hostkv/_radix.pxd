# The radix tree over token pages, in the segment; see _radix.pyx for the operations.
#
# Nodes are HkvRadixNode records in a slab. A node covers one or more full pages: its first
# page is rn_first_page, the others follow through the per-page link array reg_page_next
# (-1 ends a node, -2 marks a page the tree does not hold). Children are found in O(1) by a
# hash table keyed by (parent, namespace, hash of the child's first page); every candidate is
# confirmed by comparing the page's token ids, so a hash collision never makes a match.
# There are no root records: a node whose rn_parent is -1 is a top-level node of its
# rn_namespace. Evictable nodes (unlocked leaves) sit in a min-heap by last access.
#
# In a segment with window parts, each node also counts its pages that have a part
# (reg_node_parts), and the nodes with parts sit in a second min-heap, the part LRU, by
# (np_key, first page): when fresh pages need parts, the least recently used unlocked node
# gives up all of its parts, its pages staying cached (SGLang tombstones a node's
# sliding-window KV likewise). Locking touches nothing of it; the eviction parks a locked
# node it meets (out of the heap until its last unlock) and re-keys a stale one.

from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t
from hostkv._layout cimport HkvNodeParts, HkvPartState, HkvRadixNode, HkvRadixState, HkvSlab
from hostkv._segment cimport Segment
from hostkv._slab cimport slab_record

cdef enum:
    NOT_IN_TREE = -2        # reg_page_next value of a page the tree does not hold
    END_OF_NODE = -1


ctypedef struct Tree:
    HkvSlab* slab
    HkvRadixState* state
    int32_t* table
    int32_t* heap
    int32_t* page_next
    int32_t* page_tokens
    int32_t page_size
    int32_t node_capacity
    int64_t num_pages
    int64_t table_mask
    uint64_t hash_mask
    bint has_parts          # the segment has window parts: the fields below are used
    HkvNodeParts* node_parts
    int32_t* part_heap
    HkvPartState* parts
    int32_t* page_part


ctypedef struct Walk:
    int64_t matched         # pages matched from the start of the request
    int32_t node            # the deepest node with a matched page, -1 if none
    int32_t node_matched    # how many of that node's pages matched (all of them, or a prefix)
    int error               # 0, or a walk found a bad index or a cycle


# -- access ----------------------------------------------------------------------------------

cdef Tree tree_of(Segment seg) noexcept
cdef HkvRadixNode* node_at(Segment seg, Tree* t, int64_t index) except NULL
cdef int32_t table_find(Tree* t, int32_t parent, uint64_t namespace,
                        const int32_t* first_tokens) noexcept nogil
cdef int32_t heap_entry(Segment seg, Tree* t, int64_t pos, bint parts=*) except -1


# The small accessors every reader of the tree inlines (_radix, and _introspect's walks).

cdef inline HkvRadixNode* node_ptr(Tree* t, int32_t index) noexcept nogil:
    return <HkvRadixNode*>slab_record(t.slab, index)


cdef inline const int32_t* tokens_of(Tree* t, int32_t page) noexcept nogil:
    return t.page_tokens + <int64_t>page * t.page_size


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


cdef inline bint part_heap_before(Tree* t, int32_t a, int32_t b) noexcept nogil:
    # Least recently used first. A touch stamps one tick on a whole path, so ties are
    # common; the first page breaks them (it names a node as its index does, and a model
    # of the tree knows it).
    cdef int64_t ka = t.node_parts[a].np_key
    cdef int64_t kb = t.node_parts[b].np_key
    return ka < kb or (ka == kb and node_ptr(t, a).rn_first_page < node_ptr(t, b).rn_first_page)


cdef inline bint heap_before(Tree* t, int32_t a, int32_t b) noexcept nogil:
    cdef HkvRadixNode* na = node_ptr(t, a)
    cdef HkvRadixNode* nb = node_ptr(t, b)
    return na.rn_last_access < nb.rn_last_access or (
        na.rn_last_access == nb.rn_last_access and a < b)


# The tree's two heaps share one implementation (_radix.pyx, "the heaps"), told apart by a
# flag: parts=False is the eviction heap of unlocked leaves, parts=True the part LRU. Each
# accessor below is a branch on that flag, not an indirect call.

cdef inline int32_t* heap_slots(Tree* t, bint parts) noexcept nogil:
    return t.part_heap if parts else t.heap


cdef inline int32_t* heap_size(Tree* t, bint parts) noexcept nogil:
    return &t.parts.pt_heap_size if parts else &t.state.rt_heap_size


cdef inline int32_t* heap_place(Tree* t, bint parts, int32_t index) noexcept nogil:
    """Where a node's position in the heap is kept (-1: not in it)."""
    return &t.node_parts[index].np_heap_pos if parts else &node_ptr(t, index).rn_heap_pos


cdef inline bint heap_order(Tree* t, bint parts, int32_t a, int32_t b) noexcept nogil:
    return part_heap_before(t, a, b) if parts else heap_before(t, a, b)


# -- the operations ------------------------------------------------------------------------------

cdef int tree_walk(Tree* t, const int32_t* tokens, int64_t num_pages, uint64_t namespace,
                   int32_t* out_pages, Walk* walk) noexcept nogil
# tree_borrow's flags: a borrow that is a use refreshes recency; one that may evict a leaf
# for the node record its split needs. Engines' allocations pass both; a tier copying cold
# pages out passes neither (it must not change what is evicted next).
cdef enum:
    BORROW_REFRESH = 1
    BORROW_MAY_EVICT = 2

cdef int64_t tree_borrow(Segment seg, Tree* t, const int32_t* tokens, int64_t num_pages,
                         uint64_t namespace, int32_t* out_pages, int32_t* out_node,
                         int flags) except -1
cdef int tree_lock(Segment seg, Tree* t, int32_t node) except -1
cdef int tree_unlock(Segment seg, Tree* t, int32_t node) except -1
cdef int64_t node_depth(Segment seg, Tree* t, int32_t index) except -1
cdef int64_t tree_insert(Segment seg, Tree* t, const int32_t* tokens, const int32_t* pages,
                         int64_t num_pages, uint64_t namespace, int32_t* out_tree_pages,
                         int32_t* out_node, int32_t below=*, bint adopt=*) except -1
cdef int64_t tree_evict_pages(Segment seg, Tree* t, int64_t want) except -1
cdef int64_t ensure_free_parts(Segment seg, Tree* t, int64_t need) except -1
