# cython: language_level=3, embedsignature=True
"""Where each region of a segment lies for a given config, the tables a new segment starts
with, the kernel's advice on a range of the mapping, and every field's offset for the tests
that pin the layout.

Both create and attach lay the regions out with compute_regions: attach recomputes them from
the header's config and refuses a header whose offsets differ (see _format.shape_problem).
"""

from libc.errno cimport errno
from libc.stdint cimport int32_t, int64_t
from libc.string cimport memset

from hostkv._layout cimport *
from hostkv.includes.system cimport *


# The madvise(2) advice that Segment.advise_pool takes, by name (values from linux/mman.h).
MADV = {"MADV_WILLNEED": MADV_WILLNEED, "MADV_HUGEPAGE": MADV_HUGEPAGE,
        "MADV_POPULATE_READ": MADV_POPULATE_READ, "MADV_POPULATE_WRITE": MADV_POPULATE_WRITE}


cdef int64_t radix_table_capacity(int64_t node_capacity) noexcept nogil:
    """The child hash table's slots: a power of two at least twice the node capacity, so
    linear probing stays short (load factor <= 1/2)."""
    cdef int64_t capacity = 16
    while capacity < 2 * node_capacity:
        capacity *= 2
    return capacity


cdef int compute_regions(const HkvConfig* cfg, HkvRegions* out) except -1:
    """Lays the regions out one after another. Both create and attach call this."""
    cdef int64_t at = align_up(sizeof(HkvHeader), HKV_CACHE_LINE)
    cdef int64_t node_parts
    memset(out, 0, sizeof(HkvRegions))
    out.reg_leases = at
    at = align_up(at + <int64_t>cfg.cfg_max_processes * sizeof(HkvLease), HKV_CACHE_LINE)
    out.reg_metrics = at
    at = align_up(at + sizeof(HkvMetrics), HKV_CACHE_LINE)
    out.reg_undo = at
    at = align_up(at + <int64_t>cfg.cfg_undo_log_capacity * sizeof(HkvUndoEntry), HKV_CACHE_LINE)
    out.reg_page_refcounts = at
    at = align_up(at + cfg.cfg_num_pages * 4, HKV_CACHE_LINE)
    out.reg_page_free_stack = at
    at = align_up(at + cfg.cfg_num_pages * 4, HKV_CACHE_LINE)
    out.reg_page_tokens = at
    at = align_up(at + cfg.cfg_num_pages * cfg.cfg_page_size * 4, HKV_CACHE_LINE)
    out.reg_page_next = at
    at = align_up(at + cfg.cfg_num_pages * 4, HKV_CACHE_LINE)
    out.reg_page_part = at
    at = align_up(at + cfg.cfg_num_pages * 4, HKV_CACHE_LINE)
    out.reg_part_page = at
    at = align_up(at + cfg.cfg_num_parts * 4, HKV_CACHE_LINE)
    out.reg_part_free_stack = at
    at = align_up(at + cfg.cfg_num_parts * 4, HKV_CACHE_LINE)
    out.reg_radix_nodes = at
    at = align_up(at + sizeof(HkvSlab) + <int64_t>cfg.cfg_radix_node_capacity * sizeof(HkvRadixNode),
                  HKV_CACHE_LINE)
    out.reg_radix_table = at
    at = align_up(at + radix_table_capacity(cfg.cfg_radix_node_capacity) * 4, HKV_CACHE_LINE)
    out.reg_radix_heap = at
    at = align_up(at + <int64_t>cfg.cfg_radix_node_capacity * 4, HKV_CACHE_LINE)
    # The part LRU's tables exist only in a segment with parts.
    node_parts = cfg.cfg_radix_node_capacity if cfg.cfg_num_parts > 0 else 0
    out.reg_node_parts = at
    at = align_up(at + node_parts * sizeof(HkvNodeParts), HKV_CACHE_LINE)
    out.reg_part_heap = at
    at = align_up(at + node_parts * 4, HKV_CACHE_LINE)
    out.reg_sequences = at
    at = align_up(at + sizeof(HkvSlab) + <int64_t>cfg.cfg_max_sequences * sizeof(HkvSequence),
                  HKV_CACHE_LINE)
    out.reg_sequence_pages = at
    at = align_up(at + sizeof(HkvSlab)
                  + <int64_t>cfg.cfg_sequence_page_node_capacity * sizeof(HkvSeqPage), 4096)
    out.reg_pool = at
    # The parts follow the pages, so that the bytes engines write are one range.
    at += cfg.cfg_num_pages * cfg.cfg_page_bytes
    if cfg.cfg_num_parts > 0:
        at = align_up(at, 4096)
    out.reg_part_pool = at
    out.reg_total_size = at + cfg.cfg_num_parts * cfg.cfg_part_bytes
    return 0


cdef int init_tables(char* base, HkvHeader* hdr, const HkvConfig* cfg,
                     const HkvRegions* regions) except -1:
    """Writes a new segment's tables as an empty cache has them: every page free, none in
    the tree, an empty child table, the record pools' headers. Nobody else reads them before
    the header's state is READY."""
    cdef int32_t* free_stack
    cdef int32_t* page_next
    cdef int32_t* part_stack
    cdef HkvNodeParts* node_parts
    cdef HkvSlab* slab
    cdef int64_t i, n = cfg.cfg_num_pages, num_parts = cfg.cfg_num_parts
    # Every page starts free; popping from the top hands out pages 0, 1, 2, ...
    free_stack = <int32_t*>(base + regions.reg_page_free_stack)
    for i in range(n):
        free_stack[i] = <int32_t>(n - 1 - i)
    hdr.hdr_free_pages = n
    page_next = <int32_t*>(base + regions.reg_page_next)
    for i in range(n):
        page_next[i] = -2                  # not in the tree (see _radix.pxd)
    # No page has a part and every part is free, handed out 0, 1, 2, ... as pages are.
    memset(base + regions.reg_page_part, 0xFF, n * 4)
    memset(base + regions.reg_part_page, 0xFF, num_parts * 4)
    part_stack = <int32_t*>(base + regions.reg_part_free_stack)
    for i in range(num_parts):
        part_stack[i] = <int32_t>(num_parts - 1 - i)
    hdr.hdr_parts.pt_free_parts = num_parts
    # No node holds a part, none is in the part heap.
    node_parts = <HkvNodeParts*>(base + regions.reg_node_parts)
    for i in range(cfg.cfg_radix_node_capacity if num_parts > 0 else 0):
        node_parts[i].np_count = 0
        node_parts[i].np_heap_pos = -1
        node_parts[i].np_key = 0
    hdr.hdr_radix.rt_table_capacity = <int32_t>radix_table_capacity(cfg.cfg_radix_node_capacity)
    memset(base + regions.reg_radix_table, 0xFF, hdr.hdr_radix.rt_table_capacity * 4)
    slab = <HkvSlab*>(base + regions.reg_radix_nodes)
    slab.sl_capacity = cfg.cfg_radix_node_capacity
    slab.sl_record_size = sizeof(HkvRadixNode)
    slab = <HkvSlab*>(base + regions.reg_sequences)
    slab.sl_capacity = cfg.cfg_max_sequences
    slab.sl_record_size = sizeof(HkvSequence)
    slab = <HkvSlab*>(base + regions.reg_sequence_pages)
    slab.sl_capacity = cfg.cfg_sequence_page_node_capacity
    slab.sl_record_size = sizeof(HkvSeqPage)
    return 0


cdef int advise_range(char* at, size_t length, int advice) noexcept nogil:
    """madvise(2) on [at, at + length) of this process's mapping, widened to whole OS pages.
    Returns 0, or the errno it failed with.

    madvise wants a page-aligned start; the bytes this adds before the range are the
    mapping's own, and no advice hostkv gives changes them."""
    cdef size_t os_page = <size_t>sysconf(_SC_PAGESIZE)
    cdef size_t addr = <size_t>at
    cdef size_t lo = addr & ~(os_page - 1)
    if madvise(<void*>lo, addr + length - lo, advice) != 0:
        return errno
    return 0


cdef dict _offsets(const char* base, list fields):
    return {name: <Py_ssize_t>(<const char*><size_t>addr - base) for name, addr in fields}


def layout_info():
    """The byte offset of every header and lease field and each struct's size.

    tests/test_layout.py pins these: a change here is a format change (bump
    HKV_LAYOUT_VERSION).
    """
    cdef HkvHeader h
    cdef HkvLease l
    cdef HkvUndoEntry u
    cdef HkvSlab s
    cdef HkvRadixNode n
    cdef HkvSequence q
    cdef HkvSeqPage sp
    cdef const char* hb = <const char*>&h
    header = _offsets(hb, [
        ("hdr_magic", <size_t>&h.hdr_magic),
        ("hdr_format", <size_t>&h.hdr_format),
        ("fmt_layout_version", <size_t>&h.hdr_format.fmt_layout_version),
        ("fmt_mutex_size", <size_t>&h.hdr_format.fmt_mutex_size),
        ("fmt_slab_size", <size_t>&h.hdr_format.fmt_slab_size),
        ("hdr_config", <size_t>&h.hdr_config),
        ("cfg_num_pages", <size_t>&h.hdr_config.cfg_num_pages),
        ("cfg_page_bytes", <size_t>&h.hdr_config.cfg_page_bytes),
        ("cfg_num_parts", <size_t>&h.hdr_config.cfg_num_parts),
        ("cfg_part_bytes", <size_t>&h.hdr_config.cfg_part_bytes),
        ("cfg_page_size", <size_t>&h.hdr_config.cfg_page_size),
        ("cfg_max_processes", <size_t>&h.hdr_config.cfg_max_processes),
        ("cfg_undo_log_capacity", <size_t>&h.hdr_config.cfg_undo_log_capacity),
        ("cfg_kv_dtype_code", <size_t>&h.hdr_config.cfg_kv_dtype_code),
        ("cfg_kv_kind", <size_t>&h.hdr_config.cfg_kv_kind),
        ("cfg_kv_state_layers", <size_t>&h.hdr_config.cfg_kv_state_layers),
        ("cfg_kv_window_layers", <size_t>&h.hdr_config.cfg_kv_window_layers),
        ("hdr_regions", <size_t>&h.hdr_regions),
        ("reg_leases", <size_t>&h.hdr_regions.reg_leases),
        ("reg_metrics", <size_t>&h.hdr_regions.reg_metrics),
        ("reg_undo", <size_t>&h.hdr_regions.reg_undo),
        ("reg_page_refcounts", <size_t>&h.hdr_regions.reg_page_refcounts),
        ("reg_page_free_stack", <size_t>&h.hdr_regions.reg_page_free_stack),
        ("reg_page_tokens", <size_t>&h.hdr_regions.reg_page_tokens),
        ("reg_page_next", <size_t>&h.hdr_regions.reg_page_next),
        ("reg_page_part", <size_t>&h.hdr_regions.reg_page_part),
        ("reg_part_page", <size_t>&h.hdr_regions.reg_part_page),
        ("reg_part_free_stack", <size_t>&h.hdr_regions.reg_part_free_stack),
        ("reg_radix_nodes", <size_t>&h.hdr_regions.reg_radix_nodes),
        ("reg_radix_table", <size_t>&h.hdr_regions.reg_radix_table),
        ("reg_radix_heap", <size_t>&h.hdr_regions.reg_radix_heap),
        ("reg_node_parts", <size_t>&h.hdr_regions.reg_node_parts),
        ("reg_part_heap", <size_t>&h.hdr_regions.reg_part_heap),
        ("reg_sequences", <size_t>&h.hdr_regions.reg_sequences),
        ("reg_sequence_pages", <size_t>&h.hdr_regions.reg_sequence_pages),
        ("reg_pool", <size_t>&h.hdr_regions.reg_pool),
        ("reg_part_pool", <size_t>&h.hdr_regions.reg_part_pool),
        ("reg_total_size", <size_t>&h.hdr_regions.reg_total_size),
        ("hdr_state", <size_t>&h.hdr_state),
        ("hdr_creator_pid", <size_t>&h.hdr_creator_pid),
        ("hdr_generation", <size_t>&h.hdr_generation),
        ("hdr_reserved_bytes", <size_t>&h.hdr_reserved_bytes),
        ("hdr_free_pages", <size_t>&h.hdr_free_pages),
        ("hdr_active_leases", <size_t>&h.hdr_active_leases),
        ("hdr_undo_start", <size_t>&h.hdr_undo_start),
        ("hdr_undo_count", <size_t>&h.hdr_undo_count),
        ("hdr_stats", <size_t>&h.hdr_stats),
        ("st_recoveries", <size_t>&h.hdr_stats.st_recoveries),
        ("st_evicted_pages", <size_t>&h.hdr_stats.st_evicted_pages),
        ("hdr_radix", <size_t>&h.hdr_radix),
        ("rt_tick", <size_t>&h.hdr_radix.rt_tick),
        ("rt_table_capacity", <size_t>&h.hdr_radix.rt_table_capacity),
        ("rt_heap_size", <size_t>&h.hdr_radix.rt_heap_size),
        ("rt_cached_pages", <size_t>&h.hdr_radix.rt_cached_pages),
        ("rt_protected_pages", <size_t>&h.hdr_radix.rt_protected_pages),
        ("rt_evictable_leaf_pages", <size_t>&h.hdr_radix.rt_evictable_leaf_pages),
        ("hdr_parts", <size_t>&h.hdr_parts),
        ("pt_free_parts", <size_t>&h.hdr_parts.pt_free_parts),
        ("pt_pages_without_part", <size_t>&h.hdr_parts.pt_pages_without_part),
        ("pt_tree_parts", <size_t>&h.hdr_parts.pt_tree_parts),
        ("pt_heap_size", <size_t>&h.hdr_parts.pt_heap_size),
        ("hdr_segment_id", <size_t>&h.hdr_segment_id),
        ("hdr_create_steps", <size_t>&h.hdr_create_steps),
        ("hdr_mutex", <size_t>&h.hdr_mutex),
    ])
    lease = _offsets(<const char*>&l, [
        ("ls_mutex", <size_t>&l.ls_mutex),
        ("ls_state", <size_t>&l.ls_state),
        ("ls_pid", <size_t>&l.ls_pid),
        ("ls_generation", <size_t>&l.ls_generation),
        ("ls_registered_ns", <size_t>&l.ls_registered_ns),
        ("ls_parent_slot", <size_t>&l.ls_parent_slot),
        ("ls_parent_generation", <size_t>&l.ls_parent_generation),
    ])
    undo = _offsets(<const char*>&u, [("ue_where", <size_t>&u.ue_where), ("ue_old", <size_t>&u.ue_old)])
    slab = _offsets(<const char*>&s, [
        ("sl_capacity", <size_t>&s.sl_capacity), ("sl_record_size", <size_t>&s.sl_record_size),
        ("sl_free_head", <size_t>&s.sl_free_head), ("sl_used", <size_t>&s.sl_used)])
    node = _offsets(<const char*>&n, [
        ("rn_slab", <size_t>&n.rn_slab), ("rn_parent", <size_t>&n.rn_parent),
        ("rn_num_pages", <size_t>&n.rn_num_pages), ("rn_first_page", <size_t>&n.rn_first_page),
        ("rn_num_children", <size_t>&n.rn_num_children), ("rn_lock_count", <size_t>&n.rn_lock_count),
        ("rn_heap_pos", <size_t>&n.rn_heap_pos), ("rn_namespace", <size_t>&n.rn_namespace),
        ("rn_key_hash", <size_t>&n.rn_key_hash), ("rn_last_access", <size_t>&n.rn_last_access)])
    sequence = _offsets(<const char*>&q, [
        ("sq_slab", <size_t>&q.sq_slab), ("sq_lease_slot", <size_t>&q.sq_lease_slot),
        ("sq_num_pages", <size_t>&q.sq_num_pages),
        ("sq_lease_generation", <size_t>&q.sq_lease_generation),
        ("sq_seq_id", <size_t>&q.sq_seq_id), ("sq_namespace", <size_t>&q.sq_namespace),
        ("sq_first_page", <size_t>&q.sq_first_page), ("sq_last_page", <size_t>&q.sq_last_page),
        ("sq_lock_node", <size_t>&q.sq_lock_node), ("sq_view", <size_t>&q.sq_view),
        ("sq_generation", <size_t>&q.sq_generation)])
    sequence_page = _offsets(<const char*>&sp, [
        ("sp_slab", <size_t>&sp.sp_slab), ("sp_next", <size_t>&sp.sp_next),
        ("sp_count", <size_t>&sp.sp_count), ("sp_pages", <size_t>&sp.sp_pages)])
    return {
        "layout_version": HKV_LAYOUT_VERSION,
        "magic": HKV_MAGIC,
        "sizes": {"HkvHeader": sizeof(HkvHeader), "HkvLease": sizeof(HkvLease),
                  "HkvUndoEntry": sizeof(HkvUndoEntry), "HkvSlab": sizeof(HkvSlab),
                  "HkvRadixNode": sizeof(HkvRadixNode), "HkvSequence": sizeof(HkvSequence),
                  "HkvSeqPage": sizeof(HkvSeqPage), "HkvMetrics": sizeof(HkvMetrics),
                  "HkvNodeParts": sizeof(HkvNodeParts),
                  "pthread_mutex_t": sizeof(pthread_mutex_t)},
        "header": header, "lease": lease, "undo": undo, "slab": slab, "radix_node": node,
        "sequence": sequence, "sequence_page": sequence_page,
    }
