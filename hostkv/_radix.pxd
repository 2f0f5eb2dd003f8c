# The radix tree over token pages, in the segment; see _radix.pyx for the operations.
#
# Nodes are HkvRadixNode records in a slab. A node covers one or more full pages: its first
# page is rn_first_page, the others follow through the per-page link array reg_page_next
# (-1 ends a node, -2 marks a page the tree does not hold). Children are found in O(1) by a
# hash table keyed by (parent, namespace, hash of the child's first page); every candidate is
# confirmed by comparing the page's token ids, so a hash collision never makes a match.
# There are no root records: a node whose rn_parent is -1 is a top-level node of its
# rn_namespace. Evictable nodes (unlocked leaves) sit in a min-heap by last access.

from libc.stdint cimport int32_t, int64_t, uint64_t
cimport numpy as cnp
from hostkv._layout cimport HkvRadixNode, HkvRadixState, HkvSlab
from hostkv._segment cimport Segment


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


ctypedef struct Walk:
    int64_t matched         # pages matched from the start of the request
    int32_t node            # the deepest node with a matched page, -1 if none
    int32_t node_matched    # how many of that node's pages matched (all of them, or a prefix)
    int error               # 0, or a walk found a bad index or a cycle


cdef Tree tree_of(Segment seg) noexcept
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
cdef int tree_check(Segment seg) except -1
cdef uint64_t tree_page_hash(Tree* t, const int32_t* tokens) noexcept nogil
# Token input read in C (see tokens_from_sequence and checked_copy): a new int32 array, or
# None when the general path must decide.
cdef object sequence_tokens(object seq, str what, Py_ssize_t request)
cdef object checked_i32_copy(cnp.ndarray tokens)
