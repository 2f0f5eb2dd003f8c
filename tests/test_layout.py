"""Pins the memory layout of a hostkv segment (hostkv/_layout.pxd).

Every process that maps a segment reads the same bytes through these offsets, whatever
hostkv build it runs. A layout change that keeps HKV_LAYOUT_VERSION would let an old and a
new build attach to each other's segments and misread every field, so the values below are
written out literally: a change to the layout must fail this test, and whoever changes the
layout must bump HKV_LAYOUT_VERSION in _layout.pxd and update the literal values here.
"""

from __future__ import annotations

import os

import hostkv
from hostkv import _segment

from conftest import small_config

# A layout change must bump HKV_LAYOUT_VERSION (hostkv/_layout.pxd), then update these.
EXPECTED_LAYOUT = {
    "layout_version": 13,
    "magic": 0x3130564B54534F48,  # "HOSTKV01" read as a little-endian u64
    "sizes": {
        "HkvHeader": 896,
        "HkvLease": 128,
        "HkvUndoEntry": 16,
        "HkvSlab": 16,
        "HkvRadixNode": 64,
        "HkvSequence": 64,
        "HkvSeqPage": 64,
        "HkvMetrics": 101056,
        "pthread_mutex_t": 40,
        "HkvNodeParts": 16,
    },
    "header": {
        "hdr_magic": 0,
        "hdr_format": 8,
        "fmt_layout_version": 8,
        "fmt_mutex_size": 20,
        "fmt_slab_size": 36,
        "hdr_config": 56,
        "cfg_num_pages": 56,
        "cfg_page_bytes": 64,
        "cfg_num_parts": 72,
        "cfg_part_bytes": 80,
        "cfg_page_size": 88,
        "cfg_max_processes": 116,
        "cfg_undo_log_capacity": 120,
        "cfg_kv_dtype_code": 136,
        "cfg_kv_kind": 140,
        "cfg_kv_state_layers": 144,
        "cfg_kv_window_layers": 272,
        "hdr_regions": 400,
        "reg_leases": 400,
        "reg_metrics": 408,
        "reg_undo": 416,
        "reg_page_refcounts": 424,
        "reg_page_free_stack": 432,
        "reg_page_tokens": 440,
        "reg_page_next": 448,
        "reg_page_part": 456,
        "reg_part_page": 464,
        "reg_part_free_stack": 472,
        "reg_radix_nodes": 480,
        "reg_radix_table": 488,
        "reg_radix_heap": 496,
        "reg_node_parts": 504,
        "reg_part_heap": 512,
        "reg_sequences": 520,
        "reg_sequence_pages": 528,
        "reg_pool": 536,
        "reg_part_pool": 544,
        "reg_total_size": 552,
        "hdr_state": 560,
        "hdr_creator_pid": 564,
        "hdr_generation": 568,
        "hdr_reserved_bytes": 576,
        "hdr_free_pages": 584,
        "hdr_active_leases": 592,
        "hdr_undo_start": 596,
        "hdr_undo_count": 600,
        "hdr_stats": 608,
        "st_recoveries": 624,
        "st_evicted_pages": 672,
        "hdr_radix": 704,
        "rt_tick": 704,
        "rt_table_capacity": 712,
        "rt_heap_size": 716,
        "rt_cached_pages": 720,
        "rt_protected_pages": 728,
        "rt_evictable_leaf_pages": 736,
        "hdr_parts": 752,
        "pt_free_parts": 752,
        "pt_pages_without_part": 784,
        "pt_tree_parts": 792,
        "pt_heap_size": 808,
        "hdr_segment_id": 816,
        "hdr_create_steps": 824,
        "hdr_mutex": 832,
    },
    "lease": {
        "ls_mutex": 0,
        "ls_state": 40,
        "ls_pid": 44,
        "ls_generation": 48,
        "ls_registered_ns": 56,
        "ls_parent_slot": 64,
        "ls_parent_generation": 72,
    },
    "undo": {
        "ue_where": 0,
        "ue_old": 8,
    },
    "slab": {
        "sl_capacity": 0,
        "sl_record_size": 4,
        "sl_free_head": 8,
        "sl_used": 12,
    },
    "radix_node": {
        "rn_slab": 0,
        "rn_parent": 8,
        "rn_num_pages": 12,
        "rn_first_page": 16,
        "rn_num_children": 20,
        "rn_lock_count": 24,
        "rn_heap_pos": 28,
        "rn_namespace": 32,
        "rn_key_hash": 40,
        "rn_last_access": 48,
    },
    "sequence": {
        "sq_slab": 0,
        "sq_lease_slot": 8,
        "sq_num_pages": 12,
        "sq_lease_generation": 16,
        "sq_seq_id": 24,
        "sq_namespace": 32,
        "sq_first_page": 40,
        "sq_last_page": 44,
        "sq_lock_node": 48,
        "sq_view": 52,
        "sq_generation": 56,
    },
    "sequence_page": {
        "sp_slab": 0,
        "sp_next": 8,
        "sp_count": 12,
        "sp_pages": 16,
    },
}

CACHE_LINE = 64
PAGE = 4096


def test_layout_is_pinned():
    # A layout change must bump HKV_LAYOUT_VERSION; then update EXPECTED_LAYOUT above.
    assert _segment.layout_info() == EXPECTED_LAYOUT


def test_layout_sections_one_by_one():
    # The same comparison section by section, so a failure names the struct that moved.
    info = _segment.layout_info()
    assert set(info) == set(EXPECTED_LAYOUT)
    for section in ("sizes", "header", "lease", "undo", "slab", "radix_node", "sequence",
                    "sequence_page"):
        assert info[section] == EXPECTED_LAYOUT[section], section
    assert info["layout_version"] == EXPECTED_LAYOUT["layout_version"]
    assert info["magic"] == EXPECTED_LAYOUT["magic"]


def test_struct_invariants():
    info = _segment.layout_info()
    sizes, header = info["sizes"], info["header"]
    # Per-process lease slots fill whole cache lines; the mutex has its own line.
    assert sizes["HkvLease"] % CACHE_LINE == 0
    assert sizes["HkvHeader"] % CACHE_LINE == 0
    assert header["hdr_mutex"] % CACHE_LINE == 0
    assert header["hdr_mutex"] + sizes["pthread_mutex_t"] <= sizes["HkvHeader"]
    # 8-byte fields are 8-byte aligned (undo entries store them in one go).
    for field in ("hdr_magic", "cfg_num_pages", "cfg_page_bytes", "reg_leases", "reg_pool",
                  "reg_total_size", "hdr_generation", "hdr_reserved_bytes", "hdr_free_pages",
                  "hdr_undo_count", "hdr_stats", "st_recoveries"):
        assert header[field] % 8 == 0, field
    assert info["magic"].to_bytes(8, "little") == b"HOSTKV01"


def test_the_format_word_matches_layout_info(cache):
    info = _segment.layout_info()
    fmt = cache._segment.header_info()["format"]
    assert fmt["fmt_layout_version"] == info["layout_version"]
    assert fmt["fmt_header_size"] == info["sizes"]["HkvHeader"]
    assert fmt["fmt_lease_size"] == info["sizes"]["HkvLease"]
    assert fmt["fmt_undo_entry_size"] == info["sizes"]["HkvUndoEntry"]
    assert fmt["fmt_slab_size"] == info["sizes"]["HkvSlab"]
    assert fmt["fmt_mutex_size"] == info["sizes"]["pthread_mutex_t"]
    assert fmt["fmt_pointer_size"] == 8


def _check_regions(c: hostkv.HostKVCache) -> None:
    info = _segment.layout_info()
    cfg = c.config
    regions = c._segment.header_info()["regions"]
    for key in ("reg_leases", "reg_undo", "reg_page_refcounts", "reg_page_free_stack",
                "reg_page_tokens", "reg_pool"):
        assert regions[key] % CACHE_LINE == 0, (key, regions[key])
    assert regions["reg_pool"] % PAGE == 0, regions["reg_pool"]
    # In order, each region large enough for its contents, nothing overlapping.
    assert regions["reg_leases"] >= info["sizes"]["HkvHeader"]
    assert regions["reg_undo"] >= regions["reg_leases"] + cfg.max_processes * info["sizes"]["HkvLease"]
    assert (regions["reg_page_refcounts"]
            >= regions["reg_undo"] + cfg.undo_log_capacity * info["sizes"]["HkvUndoEntry"])
    assert regions["reg_page_free_stack"] >= regions["reg_page_refcounts"] + 4 * cfg.num_pages
    assert regions["reg_page_tokens"] >= regions["reg_page_free_stack"] + 4 * cfg.num_pages
    assert regions["reg_page_next"] >= regions["reg_page_tokens"] + 4 * cfg.num_pages * cfg.page_size
    assert regions["reg_page_part"] >= regions["reg_page_next"] + 4 * cfg.num_pages
    assert regions["reg_part_page"] >= regions["reg_page_part"] + 4 * cfg.num_pages
    assert regions["reg_part_free_stack"] >= regions["reg_part_page"] + 4 * cfg.num_parts
    assert regions["reg_radix_nodes"] >= regions["reg_part_free_stack"] + 4 * cfg.num_parts
    assert regions["reg_pool"] >= regions["reg_radix_nodes"]
    if cfg.num_parts:
        # The part pool follows the page pool, 4096-aligned, and ends the segment.
        assert regions["reg_part_pool"] % PAGE == 0
        assert regions["reg_part_pool"] >= regions["reg_pool"] + cfg.num_pages * cfg.page_bytes
        assert regions["reg_part_pool"] - regions["reg_pool"] < cfg.num_pages * cfg.page_bytes + PAGE
    else:
        assert regions["reg_part_pool"] == regions["reg_pool"] + cfg.num_pages * cfg.page_bytes
    assert regions["reg_total_size"] == regions["reg_part_pool"] + cfg.num_parts * cfg.part_bytes
    assert os.stat("/dev/shm/" + c.name).st_size == regions["reg_total_size"]
    # The page pool view starts at reg_pool: 4096-aligned in this process's address space too.
    assert c._segment.pool_address() % PAGE == 0


def test_region_offsets_are_aligned(cache):
    _check_regions(cache)


def test_region_offsets_are_aligned_for_odd_sizes(new_name):
    # Sizes chosen so that no region ends on a cache line by accident.
    cfg = small_config(num_pages=37, page_size=2, page_bytes=72, max_processes=3,
                       undo_log_capacity=259, radix_node_capacity=3,
                       sequence_page_node_capacity=7, max_sequences=3)
    with hostkv.HostKVCache.create(new_name(), cfg) as c:
        _check_regions(c)


def test_region_offsets_with_window_parts(new_name):
    # Odd sizes again, with parts: the part pool's start is padded to 4096, the tables' are
    # cache-line aligned.
    cfg = small_config(num_pages=37, page_size=2, page_bytes=72, num_parts=5, part_bytes=24,
                       max_processes=3, undo_log_capacity=259, radix_node_capacity=3,
                       sequence_page_node_capacity=7, max_sequences=3)
    with hostkv.HostKVCache.create(new_name(), cfg) as c:
        _check_regions(c)
        regions = c._segment.header_info()["regions"]
        for key in ("reg_page_part", "reg_part_page", "reg_part_free_stack"):
            assert regions[key] % CACHE_LINE == 0, (key, regions[key])
