# The memory map of a hostkv segment: the one place that says where every shared byte lives.
#
# A segment is one POSIX shared-memory object that every worker process maps, each at its own
# address, so nothing in it is a pointer: records name each other by int32 index, regions are
# found by byte offset from the segment start. Regions, in order (each 64-byte aligned; the
# page pool 4096-aligned):
#
#   offset 0            HkvHeader            magic, format, config, region offsets, state,
#                                            the robust mutex, counters, stats
#   reg_leases          HkvLease[max_processes]      one slot per attached process
#   reg_metrics         HkvMetrics           lock histograms, miss reasons, per-namespace hits
#   reg_undo            HkvUndoEntry[undo_log_capacity]  the undo log of the open mutation: a
#                                            ring; each lease starts its mutations at its own
#                                            home in it, so that a lock hand-over between two
#                                            processes does not move the log's cache lines
#   reg_page_refcounts  int32[num_pages]     references to each page (tree + sequences); 0 = free
#   reg_page_free_stack int32[num_pages]     free page indexes; entries [0, hdr_free_pages) valid
#   reg_page_tokens     int32[num_pages * page_size]  the token ids whose KV each page holds
#   reg_page_next       int32[num_pages]     next page of the same radix node; -1 ends a
#                                            node, -2: the page is not in the tree
#   reg_page_part       int32[num_pages]     the page's window part, -1 none
#   reg_part_page       int32[num_parts]     the part's page, -1: the part is free
#   reg_part_free_stack int32[num_parts]     free part indexes; entries [0, pt_free_parts) valid
#   reg_radix_nodes     HkvSlab + HkvRadixNode[radix_node_capacity]  the tree's nodes
#   reg_radix_table     int32[rt_table_capacity]  child hash table: (parent, first-page hash)
#                                            -> node, open addressing, -1 = empty
#   reg_radix_heap      int32[radix_node_capacity]  min-heap of evictable leaves by last access
#   reg_node_parts      HkvNodeParts[radix_node_capacity]  each node's window-part count and
#                                            its place in the part LRU (none without parts)
#   reg_part_heap       int32[radix_node_capacity]  the part LRU: a min-heap of nodes holding
#                                            parts, by (np_key, first page) (none without parts)
#   reg_sequences       HkvSlab + HkvSequence[max_sequences]  live sequences of every process
#   reg_sequence_pages  HkvSlab + HkvSeqPage[sequence_page_node_capacity]  their page lists
#   reg_pool            uint8[num_pages * page_bytes]  the KV bytes; with reg_part_pool the
#                                            only regions engines write
#   reg_part_pool       uint8[num_parts * part_bytes]  window parts' bytes, 4096-aligned right
#                                            after the page pool, so [reg_pool, reg_total_size)
#                                            is one range to advise or register
#
# Window parts (num_parts > 0) hold bytes a page may or may not have: the KV of a model's
# sliding-window layers, which a hit needs only for the pages just before its end. A part
# lives and dies with its page: fresh pages take one while any is free, the last reference
# to a page frees its part, and a commit whose page the tree already holds without a part
# hands its own page's part over (see _pages.pyx and docs/design.md, "Window parts"). The
# tree's parts can also go on their own, least recently used node first (the part LRU in
# _radix.pyx), when fresh pages need them.
#
# Field prefixes say which struct a name belongs to (as LMDB's mdb.c does). Per-process slots
# are padded to whole cache lines so two processes never share one. tests/test_layout.py pins
# every offset below: changing one is a conscious act that bumps HKV_LAYOUT_VERSION.
#
# Everything read from a segment is untrusted. Code that follows an index or an offset found
# here bounds-checks it first and reports CorruptionError, never dereferences it blindly.

from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t
from hostkv.includes.system cimport pthread_mutex_t

cdef extern from *:
    """
    #include <pthread.h>
    #include <stddef.h>
    #include <stdint.h>

    #define HKV_MAGIC 0x3130564b54534f48ULL     /* "HOSTKV01" read as a little-endian u64 */
    #define HKV_LAYOUT_VERSION 13u
    #define HKV_STATE_LAYER_WORDS 16             /* a bitmap of 1024 page layers */
    #define HKV_BYTE_ORDER_MARK 0x01020304u
    #define HKV_CACHE_LINE 64

    /* What a segment was built with. Attach refuses a segment whose format word differs:
       another hostkv version, another libc (mutex size) or another architecture. */
    typedef struct {
        uint32_t fmt_layout_version;   /* HKV_LAYOUT_VERSION */
        uint32_t fmt_byte_order;       /* HKV_BYTE_ORDER_MARK as written by the creator */
        uint32_t fmt_pointer_size;     /* sizeof(void*) */
        uint32_t fmt_mutex_size;       /* sizeof(pthread_mutex_t) */
        uint32_t fmt_header_size;      /* sizeof(HkvHeader) */
        uint32_t fmt_lease_size;       /* sizeof(HkvLease) */
        uint32_t fmt_undo_entry_size;  /* sizeof(HkvUndoEntry) */
        uint32_t fmt_slab_size;        /* sizeof(HkvSlab) */
        uint32_t fmt_radix_node_size;  /* sizeof(HkvRadixNode) */
        uint32_t fmt_sequence_size;    /* sizeof(HkvSequence) */
        uint32_t fmt_metrics_size;     /* sizeof(HkvMetrics) */
        uint32_t fmt_reserved;
    } HkvFormat;

    /* The resolved HostKVConfig, so that attach needs no config of its own. */
    typedef struct {
        int64_t cfg_num_pages;
        int64_t cfg_page_bytes;                  /* bytes of KV per page */
        int64_t cfg_num_parts;                   /* window parts, 0 = none */
        int64_t cfg_part_bytes;                  /* bytes per part; 0 exactly when num_parts is */
        int32_t cfg_page_size;                   /* tokens per page, a power of two */
        int32_t cfg_enable_prefix_reuse;         /* 0 or 1 */
        int32_t cfg_prefix_min_reuse_pages;
        int32_t cfg_prefix_min_store_pages;
        int32_t cfg_radix_node_capacity;
        int32_t cfg_sequence_page_node_capacity;
        int32_t cfg_max_sequences;
        int32_t cfg_max_processes;
        int32_t cfg_undo_log_capacity;           /* entries */
        int32_t cfg_kv_num_layers;               /* the KVLayout; all four 0 when none was given */
        int32_t cfg_kv_num_kv_heads;
        int32_t cfg_kv_head_dim;
        int32_t cfg_kv_dtype_code;               /* hostkv.config.DTYPE_CODES */
        int32_t cfg_kv_kind;                     /* hostkv.config.KV_KINDS (0: mha, 1: mla) */
        uint64_t cfg_kv_state_layers[HKV_STATE_LAYER_WORDS];  /* KVLayout.state_layers: bit i
                                                    of word i // 64, layer i's slot holds a
                                                    recurrent state, not K/V */
        uint64_t cfg_kv_window_layers[HKV_STATE_LAYER_WORDS]; /* KVLayout.window_layers: bit i
                                                    of word i // 64, layer i's KV lives in
                                                    window parts, not in the page */
    } HkvConfig;

    /* Byte offsets of the regions from the start of the segment. */
    typedef struct {
        int64_t reg_leases;
        int64_t reg_metrics;
        int64_t reg_undo;
        int64_t reg_page_refcounts;
        int64_t reg_page_free_stack;
        int64_t reg_page_tokens;
        int64_t reg_page_next;
        int64_t reg_page_part;
        int64_t reg_part_page;
        int64_t reg_part_free_stack;
        int64_t reg_radix_nodes;
        int64_t reg_radix_table;
        int64_t reg_radix_heap;
        int64_t reg_node_parts;
        int64_t reg_part_heap;
        int64_t reg_sequences;
        int64_t reg_sequence_pages;
        int64_t reg_pool;
        int64_t reg_part_pool;
        int64_t reg_total_size;                  /* the whole segment; attach compares fstat */
    } HkvRegions;

    /* Counters every process adds to; they survive the process that counted. */
    typedef struct {
        int64_t st_pages_allocated;
        int64_t st_pages_freed;
        int64_t st_recoveries;                   /* undo logs of dead lock holders replayed */
        int64_t st_leases_reaped;                /* dead processes found by a sweep */
        int64_t st_lookups;                      /* prefix borrows (allocation requests) */
        int64_t st_lookup_tokens;                /* their tokens */
        int64_t st_hit_tokens;                   /* their tokens served from the tree */
        int64_t st_inserted_pages;               /* pages the tree adopted */
        int64_t st_evicted_pages;                /* pages the tree let go to make room */
        int64_t st_rollbacks;                    /* mutations undone after an exception */
        int64_t st_reserved[2];
    } HkvStats;

    /* The radix tree's bookkeeping; every count is kept exactly, O(1) per change. */
    typedef struct {
        int64_t rt_tick;                         /* logical clock of borrows and commits */
        int32_t rt_table_capacity;               /* power of two, >= 2 * radix_node_capacity */
        int32_t rt_heap_size;                    /* evictable leaves */
        int64_t rt_cached_pages;                 /* pages held by the tree */
        int64_t rt_protected_pages;              /* pages of nodes some borrower has locked */
        int64_t rt_evictable_leaf_pages;         /* pages of the nodes in the heap */
        int64_t rt_reserved;
    } HkvRadixState;

    /* The window parts' bookkeeping (all 0 in a segment without parts). */
    typedef struct {
        int64_t pt_free_parts;                   /* valid entries of the part free stack */
        int64_t pt_parts_allocated;              /* parts given to fresh pages so far */
        int64_t pt_parts_freed;                  /* parts back on the free stack so far */
        int64_t pt_parts_donated;                /* parts a commit handed to the tree's page */
        int64_t pt_pages_without_part;           /* fresh pages that found no part free */
        int64_t pt_tree_parts;                   /* parts of pages the tree holds: the sum
                                                    of every node's np_count */
        int64_t pt_parts_evicted;                /* tree parts the part LRU took so far */
        int32_t pt_heap_size;                    /* nodes in the part LRU's heap */
        int32_t pt_reserved;
    } HkvPartState;

    /* A radix node's window parts (reg_node_parts[node], beside the node's record). A node
       with parts that no borrower locks is always in the part heap; a locked one may be
       out of it ("parked" by an eviction that met it), and returns at its last unlock. */
    typedef struct {
        int32_t np_count;                        /* the node's pages that have a part */
        int32_t np_heap_pos;                     /* index in the part heap, -1 if not in it */
        int64_t np_key;                          /* rn_last_access when it entered the heap or
                                                    was last re-keyed: <= rn_last_access; an
                                                    eviction re-keys a stale one before taking it */
    } HkvNodeParts;

    enum {
        HKV_STATE_INITIALISING = 1,              /* creator still reserving and writing; attach
                                                    waits. The header's magic, format, config,
                                                    regions and creator pid are written first,
                                                    before the segment is sized */
        HKV_STATE_READY = 2,
        HKV_STATE_CORRUPT = 3                    /* recovery failed; every operation refuses */
    };

    typedef struct {
        uint64_t hdr_magic;                      /* HKV_MAGIC */
        HkvFormat hdr_format;
        HkvConfig hdr_config;
        HkvRegions hdr_regions;
        uint32_t hdr_state;                      /* HKV_STATE_*; READY is written last at create */
        int32_t hdr_creator_pid;                 /* display only */
        uint64_t hdr_generation;                 /* committed mutations so far */
        int64_t hdr_reserved_bytes;              /* bytes of the segment its creator has reserved
                                                    (posix_fallocate) so far: its progress while
                                                    INITIALISING, for attachers that wait */
        int64_t hdr_free_pages;                  /* valid entries of the page free stack */
        int32_t hdr_active_leases;
        int32_t hdr_undo_start;                  /* where the open mutation's undo log starts in
                                                    the ring of entries: its holder's home */
        int64_t hdr_undo_count;                  /* entries of the open mutation's undo log; 0 = none open */
        HkvStats hdr_stats;
        HkvRadixState hdr_radix;
        HkvPartState hdr_parts;
        uint64_t hdr_segment_id;                 /* random, never 0, written at create (with the
                                                    first header): which segment of this name a
                                                    process mapped. An engine's scheduler sends
                                                    it to its workers, which copy nothing into
                                                    a segment of another id (one unlinked and
                                                    made again between their opens) */
        uint64_t hdr_create_steps;               /* +1 at each step of the creator's work (each
                                                    chunk reserved, each table written): an
                                                    attacher waits while it moves, and gives up
                                                    only once it stalls for ready_timeout */
        /* The one lock over all shared state: robust, process-shared, normal type, no
           priority inheritance (PI and error-checking mutexes compare TIDs, which break
           across PID namespaces). On its own cache line. */
        pthread_mutex_t hdr_mutex __attribute__((aligned(HKV_CACHE_LINE)));
    } __attribute__((aligned(HKV_CACHE_LINE))) HkvHeader;

    enum { HKV_LEASE_FREE = 0, HKV_LEASE_ACTIVE = 1 };

    /* One attached process. Its lease thread holds ls_mutex for the life of the process, so
       the kernel's robust-futex list marks it owner-dead when the process dies, in whatever
       PID namespace: a sweep's trylock then says EOWNERDEAD instead of EBUSY. */
    typedef struct {
        pthread_mutex_t ls_mutex;
        uint32_t ls_state;                       /* HKV_LEASE_FREE / HKV_LEASE_ACTIVE */
        int32_t ls_pid;                          /* display only: pids are not trusted */
        uint64_t ls_generation;                  /* bumped at each registration of this slot */
        int64_t ls_registered_ns;                /* CLOCK_REALTIME at registration, for inspect */
        int32_t ls_parent_slot;                  /* the lease this process works for (a vLLM
                                                    worker: its engine's scheduler, which owns
                                                    the sequences whose pages it writes), valid
                                                    when ls_parent_generation != 0. While this lease lives, a dead parent's
                                                    sequences are not released (their pages
                                                    stay quarantined): this process may still
                                                    be writing them */
        int32_t ls_reserved;
        uint64_t ls_parent_generation;           /* the parent's ls_generation when joined (a
                                                    slot taken again is another process); 0:
                                                    no parent (every registration sets 0) */
    } __attribute__((aligned(HKV_CACHE_LINE))) HkvLease;

    /* One logged store: before any store to shared state a mutation appends (where, old
       value). ue_where is the byte offset of the field from the segment start, with the
       store's width in bytes (4 or 8) in its top byte. */
    typedef struct {
        uint64_t ue_where;
        uint64_t ue_old;
    } HkvUndoEntry;

    /* The head of a fixed-size record pool (see _slab.pxd): records follow it. */
    typedef struct {
        int32_t sl_capacity;
        int32_t sl_record_size;                  /* bytes, a multiple of 8 */
        int32_t sl_free_head;                    /* first free record, -1 when none */
        int32_t sl_used;                         /* records in use */
    } HkvSlab;

    /* The first field of every slab record. */
    typedef struct {
        int32_t sr_next_free;                    /* the next free record while free; -1 ends */
        int32_t sr_in_use;                       /* 1 in use, 0 free: recovery rebuilds the free list from it */
    } HkvSlabRecord;

    /* A radix-tree node: a run of one or more full pages under its parent. Its pages are
       rn_first_page and the pages reached from it through reg_page_next. */
    typedef struct {
        HkvSlabRecord rn_slab;
        int32_t rn_parent;                       /* -1: a top-level node of namespace rn_namespace */
        int32_t rn_num_pages;                    /* >= 1 */
        int32_t rn_first_page;
        int32_t rn_num_children;
        int32_t rn_lock_count;                   /* locked paths running through this node */
        int32_t rn_heap_pos;                     /* index in the eviction heap, -1 if not an evictable leaf */
        uint64_t rn_namespace;
        uint64_t rn_key_hash;                    /* hash of the first page's token ids */
        int64_t rn_last_access;                  /* rt_tick of the last borrow or commit through it */
        int64_t rn_reserved;
    } HkvRadixNode;

    /* A live sequence: owned by one lease, holding its borrowed prefix by one lock on a
       radix node and one reference to each of its own pages, which its list records. */
    typedef struct {
        HkvSlabRecord sq_slab;
        int32_t sq_lease_slot;                   /* the owning process's lease */
        int32_t sq_num_pages;                    /* its own pages: those in its list */
        uint64_t sq_lease_generation;            /* the owner lease's ls_generation */
        int64_t sq_seq_id;                       /* the owner's id for it: checked on every use */
        uint64_t sq_namespace;
        int32_t sq_first_page;                   /* first HkvSeqPage, -1 when none */
        int32_t sq_last_page;                    /* last HkvSeqPage, for O(1) appends */
        int32_t sq_lock_node;                    /* the radix node it has locked, -1 none */
        int32_t sq_view;                         /* the owner process's WorkerView number (its
                                                    views find their records after an interrupt) */
        int64_t sq_generation;                   /* +1 at each allocation of this record: a view's
                                                    (record, generation) never names a later use */
    } HkvSequence;

    /* A run of a sequence's page list, in order: one cache line holds twelve pages, so a
       sequence of n own pages takes ceil(n / 12) records (one record a page cost eight
       undo entries to list and free). Slots past sp_count are nobody's. */
    #define HKV_SEQ_PAGES_PER_ENTRY 12
    typedef struct {
        HkvSlabRecord sp_slab;
        int32_t sp_next;                         /* next HkvSeqPage, -1 ends the list */
        int32_t sp_count;                        /* pages in sp_pages: 1..12 */
        int32_t sp_pages[HKV_SEQ_PAGES_PER_ENTRY];
    } HkvSeqPage;

    #define HKV_HISTOGRAM_BUCKETS 40      /* bucket b counts durations in [2^(b-1), 2^b) ns */
    #define HKV_HINT_SLOTS 4096           /* direct-mapped hint tables, power of two */
    #define HKV_NAMESPACE_SLOTS 64        /* per-namespace counters; the last one is "other" */

    typedef struct {
        uint64_t ns_namespace;
        int64_t ns_used;                         /* 1 once the slot names a namespace */
        int64_t ns_lookup_tokens;
        int64_t ns_hit_tokens;
    } HkvNamespaceStats;

    /* Metrics cheap enough to stay on. Lock times are written by the lock holder without
       logging (a rolled-back mutation still waited and held); miss reasons and namespace
       counters are logged with the allocation they describe, so a failed batch counts
       nothing. The hint tables are best effort: a slot may be overwritten by another hash. */
    typedef struct {
        int64_t mt_lock_acquisitions;
        int64_t mt_lock_wait_ns;                 /* sums, for means */
        int64_t mt_lock_hold_ns;
        int64_t mt_lock_wait_histogram[HKV_HISTOGRAM_BUCKETS];
        int64_t mt_lock_hold_histogram[HKV_HISTOGRAM_BUCKETS];
        int64_t mt_full_hits;                    /* requests that reused all they could */
        int64_t mt_miss_no_prefix;               /* the next page was never cached (or diverged) */
        int64_t mt_miss_namespace;               /* cached, but under another namespace */
        int64_t mt_miss_below_minimum;           /* matched fewer than prefix_min_reuse_pages */
        int64_t mt_miss_evicted;                 /* the next page was cached and then evicted */
        uint64_t mt_evicted_hashes[HKV_HINT_SLOTS];   /* first-page hashes of evicted runs */
        uint64_t mt_top_hashes[HKV_HINT_SLOTS];       /* first-page hashes of top-level nodes */
        uint64_t mt_top_namespaces[HKV_HINT_SLOTS];   /* ... and their namespaces */
        HkvNamespaceStats mt_namespaces[HKV_NAMESPACE_SLOTS];
    } HkvMetrics;

    #define HKV_UNDO_WIDTH_SHIFT 56
    #define HKV_UNDO_OFFSET_MASK ((1ULL << HKV_UNDO_WIDTH_SHIFT) - 1)

    _Static_assert(sizeof(HkvLease) % HKV_CACHE_LINE == 0, "lease slots fill whole cache lines");
    _Static_assert(offsetof(HkvHeader, hdr_mutex) % HKV_CACHE_LINE == 0, "mutex on its own line");
    _Static_assert(sizeof(HkvUndoEntry) == 16, "undo entries are two words");
    _Static_assert(sizeof(HkvRadixNode) == 64, "a radix node is one cache line");
    _Static_assert(sizeof(HkvNodeParts) == 16, "four nodes' parts a cache line");
    _Static_assert(offsetof(HkvRadixNode, rn_slab) == 0, "slab records start with HkvSlabRecord");
    _Static_assert(sizeof(HkvSequence) == 64, "a sequence is one cache line");
    _Static_assert(sizeof(HkvSeqPage) == 64, "a page-list entry is one cache line");
    """
    uint64_t HKV_MAGIC
    uint32_t HKV_LAYOUT_VERSION
    int HKV_STATE_LAYER_WORDS
    uint32_t HKV_BYTE_ORDER_MARK
    int HKV_CACHE_LINE
    int HKV_UNDO_WIDTH_SHIFT
    uint64_t HKV_UNDO_OFFSET_MASK

    enum:
        HKV_STATE_INITIALISING
        HKV_STATE_READY
        HKV_STATE_CORRUPT
        HKV_LEASE_FREE
        HKV_LEASE_ACTIVE

    ctypedef struct HkvFormat:
        uint32_t fmt_layout_version
        uint32_t fmt_byte_order
        uint32_t fmt_pointer_size
        uint32_t fmt_mutex_size
        uint32_t fmt_header_size
        uint32_t fmt_lease_size
        uint32_t fmt_undo_entry_size
        uint32_t fmt_slab_size
        uint32_t fmt_radix_node_size
        uint32_t fmt_sequence_size
        uint32_t fmt_metrics_size
        uint32_t fmt_reserved

    ctypedef struct HkvConfig:
        int64_t cfg_num_pages
        int64_t cfg_page_bytes
        int64_t cfg_num_parts
        int64_t cfg_part_bytes
        int32_t cfg_page_size
        int32_t cfg_enable_prefix_reuse
        int32_t cfg_prefix_min_reuse_pages
        int32_t cfg_prefix_min_store_pages
        int32_t cfg_radix_node_capacity
        int32_t cfg_sequence_page_node_capacity
        int32_t cfg_max_sequences
        int32_t cfg_max_processes
        int32_t cfg_undo_log_capacity
        int32_t cfg_kv_num_layers
        int32_t cfg_kv_num_kv_heads
        int32_t cfg_kv_head_dim
        int32_t cfg_kv_dtype_code
        int32_t cfg_kv_kind
        uint64_t cfg_kv_state_layers[16]
        uint64_t cfg_kv_window_layers[16]

    ctypedef struct HkvRegions:
        int64_t reg_leases
        int64_t reg_metrics
        int64_t reg_undo
        int64_t reg_page_refcounts
        int64_t reg_page_free_stack
        int64_t reg_page_tokens
        int64_t reg_page_next
        int64_t reg_page_part
        int64_t reg_part_page
        int64_t reg_part_free_stack
        int64_t reg_radix_nodes
        int64_t reg_radix_table
        int64_t reg_radix_heap
        int64_t reg_node_parts
        int64_t reg_part_heap
        int64_t reg_sequences
        int64_t reg_sequence_pages
        int64_t reg_pool
        int64_t reg_part_pool
        int64_t reg_total_size

    ctypedef struct HkvStats:
        int64_t st_pages_allocated
        int64_t st_pages_freed
        int64_t st_recoveries
        int64_t st_leases_reaped
        int64_t st_lookups
        int64_t st_lookup_tokens
        int64_t st_hit_tokens
        int64_t st_inserted_pages
        int64_t st_evicted_pages
        int64_t st_rollbacks
        int64_t st_reserved[2]

    ctypedef struct HkvRadixState:
        int64_t rt_tick
        int32_t rt_table_capacity
        int32_t rt_heap_size
        int64_t rt_cached_pages
        int64_t rt_protected_pages
        int64_t rt_evictable_leaf_pages
        int64_t rt_reserved

    ctypedef struct HkvPartState:
        int64_t pt_free_parts
        int64_t pt_parts_allocated
        int64_t pt_parts_freed
        int64_t pt_parts_donated
        int64_t pt_pages_without_part
        int64_t pt_tree_parts
        int64_t pt_parts_evicted
        int32_t pt_heap_size
        int32_t pt_reserved

    ctypedef struct HkvNodeParts:
        int32_t np_count
        int32_t np_heap_pos
        int64_t np_key

    ctypedef struct HkvHeader:
        uint64_t hdr_magic
        HkvFormat hdr_format
        HkvConfig hdr_config
        HkvRegions hdr_regions
        uint32_t hdr_state
        int32_t hdr_creator_pid
        uint64_t hdr_generation
        int64_t hdr_reserved_bytes
        int64_t hdr_free_pages
        int32_t hdr_active_leases
        int32_t hdr_undo_start
        int64_t hdr_undo_count
        HkvStats hdr_stats
        HkvRadixState hdr_radix
        HkvPartState hdr_parts
        uint64_t hdr_segment_id
        uint64_t hdr_create_steps
        pthread_mutex_t hdr_mutex

    ctypedef struct HkvLease:
        pthread_mutex_t ls_mutex
        uint32_t ls_state
        int32_t ls_pid
        uint64_t ls_generation
        int64_t ls_registered_ns
        int32_t ls_parent_slot
        int32_t ls_reserved
        uint64_t ls_parent_generation

    ctypedef struct HkvUndoEntry:
        uint64_t ue_where
        uint64_t ue_old

    ctypedef struct HkvSlab:
        int32_t sl_capacity
        int32_t sl_record_size
        int32_t sl_free_head
        int32_t sl_used

    ctypedef struct HkvSlabRecord:
        int32_t sr_next_free
        int32_t sr_in_use

    enum:
        HKV_HISTOGRAM_BUCKETS
        HKV_HINT_SLOTS
        HKV_NAMESPACE_SLOTS
        HKV_SEQ_PAGES_PER_ENTRY

    ctypedef struct HkvNamespaceStats:
        uint64_t ns_namespace
        int64_t ns_used
        int64_t ns_lookup_tokens
        int64_t ns_hit_tokens

    ctypedef struct HkvMetrics:
        int64_t mt_lock_acquisitions
        int64_t mt_lock_wait_ns
        int64_t mt_lock_hold_ns
        int64_t mt_lock_wait_histogram[HKV_HISTOGRAM_BUCKETS]
        int64_t mt_lock_hold_histogram[HKV_HISTOGRAM_BUCKETS]
        int64_t mt_full_hits
        int64_t mt_miss_no_prefix
        int64_t mt_miss_namespace
        int64_t mt_miss_below_minimum
        int64_t mt_miss_evicted
        uint64_t mt_evicted_hashes[HKV_HINT_SLOTS]
        uint64_t mt_top_hashes[HKV_HINT_SLOTS]
        uint64_t mt_top_namespaces[HKV_HINT_SLOTS]
        HkvNamespaceStats mt_namespaces[HKV_NAMESPACE_SLOTS]

    ctypedef struct HkvSequence:
        HkvSlabRecord sq_slab
        int32_t sq_lease_slot
        int32_t sq_num_pages
        uint64_t sq_lease_generation
        int64_t sq_seq_id
        uint64_t sq_namespace
        int32_t sq_first_page
        int32_t sq_last_page
        int32_t sq_lock_node
        int32_t sq_view
        int64_t sq_generation

    ctypedef struct HkvSeqPage:
        HkvSlabRecord sp_slab
        int32_t sp_next
        int32_t sp_count
        int32_t sp_pages[HKV_SEQ_PAGES_PER_ENTRY]

    ctypedef struct HkvRadixNode:
        HkvSlabRecord rn_slab
        int32_t rn_parent
        int32_t rn_num_pages
        int32_t rn_first_page
        int32_t rn_num_children
        int32_t rn_lock_count
        int32_t rn_heap_pos
        uint64_t rn_namespace
        uint64_t rn_key_hash
        int64_t rn_last_access
        int64_t rn_reserved
