# cython: language_level=3, embedsignature=True
"""What a segment says it is: the format word, the config packed into the header, the checks
every bounds check rests on, and the header's first words at create and attach.

Everything read from a segment is untrusted (see _layout.pxd): the checks here run before
anything follows an offset the header gives, and say what is wrong in words; the caller
raises (Segment.corrupt names the segment).
"""

import os
import time

from cpython.bytes cimport PyBytes_FromStringAndSize
from libc.stdint cimport int64_t, uint32_t, uint64_t
from libc.string cimport memcmp, memcpy, memset

from hostkv._geometry cimport compute_regions, radix_table_capacity
from hostkv._layout cimport *
from hostkv.includes.system cimport *

from hostkv.config import DTYPE_CODES, KV_KINDS
from hostkv.errors import (
    AbandonedSegmentError,
    CorruptionError,
    IncompatibleSegmentError,
    SegmentFormatError,
    os_error,
)

RESERVE_CHUNK = 256 << 20    # the creator publishes its progress after each chunk

# Tests pace a creator (_pace_reservation): chunk bytes and seconds of sleep after each
# chunk. Only a call in the process sets them; nothing from the environment.
cdef int64_t _reserve_chunk = RESERVE_CHUNK
cdef double _reserve_delay = 0.0


def _pace_reservation(chunk_bytes=RESERVE_CHUNK, delay=0.0):
    """For tests: reserve `chunk_bytes` at a time and sleep `delay` seconds after each
    chunk, so a test can watch (or kill) a creator in the middle of its reservation."""
    global _reserve_chunk, _reserve_delay
    if chunk_bytes <= 0 or delay < 0:
        raise ValueError(f"chunk_bytes must be > 0 and delay >= 0, got {chunk_bytes}, {delay}")
    _reserve_chunk = chunk_bytes
    _reserve_delay = delay


cdef uint64_t new_segment_id() except 0:
    """A random 64-bit id, never 0 (0 means "unknown" to whoever compares ids)."""
    cdef uint64_t sid = 0
    while sid == 0:
        sid = int.from_bytes(os.urandom(8), "little")
    return sid


# ---------------------------------------------------------------------------------------------
# The format word: what a segment was built with

cdef HkvFormat expected_format() noexcept:
    cdef HkvFormat fmt
    memset(&fmt, 0, sizeof(fmt))
    fmt.fmt_layout_version = HKV_LAYOUT_VERSION
    fmt.fmt_byte_order = HKV_BYTE_ORDER_MARK
    fmt.fmt_pointer_size = sizeof(void*)
    fmt.fmt_mutex_size = sizeof(pthread_mutex_t)
    fmt.fmt_header_size = sizeof(HkvHeader)
    fmt.fmt_lease_size = sizeof(HkvLease)
    fmt.fmt_undo_entry_size = sizeof(HkvUndoEntry)
    fmt.fmt_slab_size = sizeof(HkvSlab)
    fmt.fmt_radix_node_size = sizeof(HkvRadixNode)
    fmt.fmt_sequence_size = sizeof(HkvSequence)
    fmt.fmt_metrics_size = sizeof(HkvMetrics)
    return fmt


cdef int check_format(name, HkvFormat* got_format) except -1:
    """IncompatibleSegmentError unless the segment's format word is this build's."""
    cdef dict got = got_format[0]
    cdef dict want = expected_format()
    for field in _FORMAT_FIELDS:
        if got[field] != want[field]:
            raise SegmentFormatError(
                f"segment {name!r} has another format: {field} is {got[field]}, "
                f"this hostkv expects {want[field]}")
    return 0


_FORMAT_FIELDS = ("fmt_layout_version", "fmt_byte_order", "fmt_pointer_size", "fmt_mutex_size",
                  "fmt_header_size", "fmt_lease_size", "fmt_undo_entry_size", "fmt_slab_size",
                  "fmt_radix_node_size", "fmt_sequence_size", "fmt_metrics_size")


# ---------------------------------------------------------------------------------------------
# The config in the header

# HostKVConfig field -> HkvConfig field. The KVLayout is stored as four fields.
_CONFIG_FIELDS = (
    ("num_pages", "cfg_num_pages"),
    ("page_size", "cfg_page_size"),
    ("page_bytes", "cfg_page_bytes"),
    ("num_parts", "cfg_num_parts"),
    ("part_bytes", "cfg_part_bytes"),
    ("enable_prefix_reuse", "cfg_enable_prefix_reuse"),
    ("prefix_min_reuse_pages", "cfg_prefix_min_reuse_pages"),
    ("prefix_min_store_pages", "cfg_prefix_min_store_pages"),
    ("radix_node_capacity", "cfg_radix_node_capacity"),
    ("sequence_page_node_capacity", "cfg_sequence_page_node_capacity"),
    ("max_sequences", "cfg_max_sequences"),
    ("max_processes", "cfg_max_processes"),
    ("undo_log_capacity", "cfg_undo_log_capacity"),
)


cdef HkvConfig config_to_c(object config) except *:
    """Packs a resolved HostKVConfig into the header's form."""
    cdef HkvConfig c
    memset(&c, 0, sizeof(c))
    values = {cname: int(getattr(config, pyname)) for pyname, cname in _CONFIG_FIELDS}
    layout = config.kv_layout
    if layout is not None:
        values.update(cfg_kv_num_layers=layout.num_layers, cfg_kv_num_kv_heads=layout.num_kv_heads,
                      cfg_kv_head_dim=layout.head_dim, cfg_kv_dtype_code=DTYPE_CODES[layout.dtype],
                      cfg_kv_kind=KV_KINDS[layout.kind])
    c.cfg_num_pages = values["cfg_num_pages"]
    c.cfg_page_bytes = values["cfg_page_bytes"]
    c.cfg_num_parts = values["cfg_num_parts"]
    c.cfg_part_bytes = values["cfg_part_bytes"]
    c.cfg_page_size = values["cfg_page_size"]
    c.cfg_enable_prefix_reuse = values["cfg_enable_prefix_reuse"]
    c.cfg_prefix_min_reuse_pages = values["cfg_prefix_min_reuse_pages"]
    c.cfg_prefix_min_store_pages = values["cfg_prefix_min_store_pages"]
    c.cfg_radix_node_capacity = values["cfg_radix_node_capacity"]
    c.cfg_sequence_page_node_capacity = values["cfg_sequence_page_node_capacity"]
    c.cfg_max_sequences = values["cfg_max_sequences"]
    c.cfg_max_processes = values["cfg_max_processes"]
    c.cfg_undo_log_capacity = values["cfg_undo_log_capacity"]
    c.cfg_kv_num_layers = values.get("cfg_kv_num_layers", 0)
    c.cfg_kv_num_kv_heads = values.get("cfg_kv_num_kv_heads", 0)
    c.cfg_kv_head_dim = values.get("cfg_kv_head_dim", 0)
    c.cfg_kv_dtype_code = values.get("cfg_kv_dtype_code", 0)
    c.cfg_kv_kind = values.get("cfg_kv_kind", 0)
    if layout is not None:
        for layer in layout.state_layers:
            # KVLayout bounds the layers below 64 * HKV_STATE_LAYER_WORDS.
            c.cfg_kv_state_layers[layer // 64] |= (<uint64_t>1) << (layer % 64)
        for layer in layout.window_layers:
            c.cfg_kv_window_layers[layer // 64] |= (<uint64_t>1) << (layer % 64)
    return c


cdef tuple config_values(const HkvConfig* cfg):
    """The header's config as (dict of HostKVConfig field values, kv layout or None): the
    layout as (num_layers, num_kv_heads, head_dim, dtype code, kind code, state layers,
    window layers)."""
    cdef dict c = cfg[0]
    cdef int word, bit
    values = {pyname: c[cname] for pyname, cname in _CONFIG_FIELDS}
    values["enable_prefix_reuse"] = bool(values["enable_prefix_reuse"])
    layout = None
    # Every bit as stored: KVLayout refuses one past num_layers, or any without a layout
    # (a damaged header).
    state_layers = tuple(word * 64 + bit for word in range(HKV_STATE_LAYER_WORDS)
                         for bit in range(64)
                         if (cfg.cfg_kv_state_layers[word] >> bit) & 1)
    window_layers = tuple(word * 64 + bit for word in range(HKV_STATE_LAYER_WORDS)
                          for bit in range(64)
                          if (cfg.cfg_kv_window_layers[word] >> bit) & 1)
    if c["cfg_kv_num_layers"] or state_layers or window_layers:
        layout = (c["cfg_kv_num_layers"], c["cfg_kv_num_kv_heads"], c["cfg_kv_head_dim"],
                  c["cfg_kv_dtype_code"], c["cfg_kv_kind"], state_layers, window_layers)
    return values, layout


# ---------------------------------------------------------------------------------------------
# The checks every bounds check rests on

cdef bint config_impossible(const HkvConfig* c) except -1:
    """A config no create writes: sizes that are not positive, parts without bytes (or bytes
    without parts), or pools past 2**46 bytes."""
    return (c.cfg_num_pages <= 0 or c.cfg_num_pages >= 2**31 or c.cfg_page_size <= 0
            or c.cfg_page_bytes <= 0 or c.cfg_max_processes <= 0
            or c.cfg_undo_log_capacity <= 0 or c.cfg_radix_node_capacity < 0
            or c.cfg_sequence_page_node_capacity < 0 or c.cfg_max_sequences < 0
            or c.cfg_num_pages * c.cfg_page_bytes >= 2**46
            or c.cfg_num_parts < 0 or c.cfg_num_parts >= 2**31 or c.cfg_part_bytes < 0
            or c.cfg_part_bytes >= 2**46 or (c.cfg_num_parts == 0) != (c.cfg_part_bytes == 0)
            or c.cfg_num_parts * c.cfg_part_bytes >= 2**46)


cdef str shape_problem(HkvHeader* hdr, size_t size, int64_t undo_capacity):
    """What is wrong with the header's config and region offsets (None: nothing): the config
    must be sane and the one attach found (undo_capacity), and the offsets the ones it
    implies, ending where the mapping (size bytes) ends. None of these changes after create,
    so a difference is corruption."""
    cdef HkvConfig* c = &hdr.hdr_config
    cdef HkvRegions regions
    if (config_impossible(c) or c.cfg_page_size > 2**20 or c.cfg_page_bytes >= 2**46
            or c.cfg_undo_log_capacity != undo_capacity):
        return "the header's config is impossible or changed"
    compute_regions(c, &regions)
    if (memcmp(&regions, &hdr.hdr_regions, sizeof(HkvRegions)) != 0
            or regions.reg_total_size != <int64_t>size):
        return "the header's region offsets disagree with its config or the mapping"
    return None


cdef str tables_problem(char* base, HkvHeader* hdr, const HkvRegions* regions):
    """What is wrong with the tables' fixed sizes (None: nothing), at regions (offsets
    shape_problem found sound): the child table's capacity and the record pools' headers
    must be the config's."""
    cdef HkvConfig* c = &hdr.hdr_config
    cdef HkvSlab* slab
    if hdr.hdr_radix.rt_table_capacity != radix_table_capacity(c.cfg_radix_node_capacity):
        return f"child table capacity {hdr.hdr_radix.rt_table_capacity} disagrees with the config"
    slab = <HkvSlab*>(base + regions.reg_radix_nodes)
    if slab.sl_capacity != c.cfg_radix_node_capacity or slab.sl_record_size != sizeof(HkvRadixNode):
        return "the radix node table's header disagrees with the config"
    slab = <HkvSlab*>(base + regions.reg_sequences)
    if slab.sl_capacity != c.cfg_max_sequences or slab.sl_record_size != sizeof(HkvSequence):
        return "the sequence table's header disagrees with the config"
    slab = <HkvSlab*>(base + regions.reg_sequence_pages)
    if (slab.sl_capacity != c.cfg_sequence_page_node_capacity
            or slab.sl_record_size != sizeof(HkvSeqPage)):
        return "the page-list table's header disagrees with the config"
    return None


# ---------------------------------------------------------------------------------------------
# The header's first words: written by the creator before anything else, waited for by
# attachers

cdef int write_first_header(name, int fd, const HkvConfig* ccfg,
                            const HkvRegions* regions) except -1:
    """Writes the header's identity and sizes the segment, refusing what /dev/shm cannot hold.

    The first bytes an attacher can see are a header that says what this is (magic, format,
    config, regions, creator pid) in state INITIALISING: pwrite extends the file only once
    the header's bytes are in it, so a segment of at least a header's size that does not
    start with the magic is not hostkv's, at once."""
    cdef HkvHeader first
    cdef int64_t total = regions.reg_total_size
    memset(&first, 0, sizeof(HkvHeader))
    first.hdr_magic = HKV_MAGIC
    first.hdr_format = expected_format()
    first.hdr_config = ccfg[0]
    first.hdr_regions = regions[0]
    first.hdr_state = HKV_STATE_INITIALISING
    first.hdr_creator_pid = getpid()
    first.hdr_segment_id = new_segment_id()
    data = PyBytes_FromStringAndSize(<char*>&first, sizeof(HkvHeader))
    try:
        written = os.pwrite(fd, data, 0)
        if written != len(data):
            raise OSError(ENOSPC, "short write")
        os.ftruncate(fd, total)
    except OSError as exc:
        raise os_error(exc.errno or EINVAL, "write the header of segment", name) from None
    # Reserving chunk by chunk, unlike one posix_fallocate of the whole, would fill
    # memory before a too-big request fails (tmpfs refuses a single request larger than
    # the filesystem at once): refuse what cannot fit before reserving any of it.
    vfs = os.fstatvfs(fd)
    if vfs.f_blocks and total > vfs.f_bavail * vfs.f_frsize:
        raise os_error(ENOSPC, f"reserve {total} bytes for segment (only "
                       f"{vfs.f_bavail * vfs.f_frsize} free)", name)
    return 0


cdef int reserve_memory(name, int fd, int64_t total, HkvHeader* hdr) except -1:
    """Reserves the segment's memory chunk by chunk, publishing the bytes reserved so far in
    the mapped header (hdr_reserved_bytes) and counting a step (hdr_create_steps) after each
    chunk: an attacher waits while the count moves, and says how far the creator got if it
    stalls. On a full /dev/shm this fails with ENOSPC here instead of a SIGBUS at the first
    touch of an unbacked page later."""
    cdef int64_t at = 0, chunk
    cdef int rc
    while at < total:
        chunk = min(_reserve_chunk, total - at)
        with nogil:
            rc = posix_fallocate(fd, at, chunk)
        if rc != 0:
            raise os_error(rc, f"reserve {total} bytes for segment", name)
        at += chunk
        hkv_store_release_i64(&hdr.hdr_reserved_bytes, at)
        creator_step(hdr)
        if _reserve_delay > 0:
            time.sleep(_reserve_delay)
    return 0


cdef void creator_step(HkvHeader* hdr) noexcept nogil:
    """The creator made progress (cannot fail: one release store)."""
    hkv_store_release_i64(<int64_t*>&hdr.hdr_create_steps, <int64_t>hdr.hdr_create_steps + 1)


cdef bint creator_gone(int fd) except -1:
    """Whether nobody holds the creator's mark on the segment open at fd (compat.h,
    hkv_creator_marked): its creator is dead or finished."""
    cdef int rc = hkv_creator_marked(fd)
    if rc < 0:
        raise os_error(-rc, "probe the creator's lock of segment")
    return rc == 0


cdef int64_t wait_ready(name, int fd, double timeout) except -1:
    """Waits until the segment `name` open at fd is sized and READY; returns its size (to map).

    Reads the header with pread, so nothing is mapped before the creator has sized the
    segment. A creator between shm_open and writing its header leaves a segment shorter
    than a header: that is waited for. A header without the magic, or of another format, is
    refused at once: the creator writes those first.

    The wait lasts while the creator makes progress (the file's size, its state, the bytes
    it reserved, its step count move) and ends once nothing moved for `timeout` seconds, so
    a pool that takes minutes to reserve is waited for, and a stalled creator is not. A
    creator that died (its mark, an OFD lock on the file, is gone while the state still
    says INITIALISING) is an AbandonedSegmentError at once.
    """
    cdef HkvHeader h
    cdef Py_ssize_t header_size = sizeof(HkvHeader)
    cdef uint32_t state = 0
    stalled_since = time.monotonic()
    delay = 0.0005
    first_reserved = None
    last_progress = None
    size = 0
    have_header = False
    while True:
        size = os.fstat(fd).st_size
        progress = (size,)
        if size >= header_size:
            data = os.pread(fd, header_size, 0)
            if len(data) == header_size:
                memcpy(&h, <char*>data, header_size)
                have_header = True
                if h.hdr_magic != HKV_MAGIC:
                    raise IncompatibleSegmentError(
                        f"segment {name!r} is not a hostkv segment (bad magic)")
                check_format(name, &h.hdr_format)
                state = h.hdr_state
                if state == HKV_STATE_READY or state == HKV_STATE_CORRUPT:
                    return size
                if state != HKV_STATE_INITIALISING:
                    raise CorruptionError(
                        f"segment {name!r}: the header's state word is {state}")
                if first_reserved is None:
                    first_reserved = h.hdr_reserved_bytes
                progress = (size, state, h.hdr_reserved_bytes, h.hdr_create_steps)
                if creator_gone(fd):
                    # The creator says READY before it lets go of its mark: read again.
                    data = os.pread(fd, header_size, 0)
                    memcpy(&h, <char*>data, header_size)
                    if h.hdr_state != HKV_STATE_INITIALISING:
                        continue
                    raise AbandonedSegmentError(
                        f"segment {name!r} was abandoned by its creator (pid "
                        f"{h.hdr_creator_pid}, dead or gone, after reserving "
                        f"{h.hdr_reserved_bytes} of {h.hdr_regions.reg_total_size} bytes): "
                        "it will never be ready; unlink it and create it again")
        now = time.monotonic()
        if progress != last_progress:
            last_progress = progress
            stalled_since = now
        elif now - stalled_since >= timeout:
            break
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
    if not have_header:
        raise IncompatibleSegmentError(
            f"segment {name!r} is {size} bytes after {timeout:g} s, shorter than a "
            f"hostkv header ({header_size} bytes): not a hostkv segment, or its creator "
            "died before writing its header; unlink it and create it again")
    total = h.hdr_regions.reg_total_size
    reserved = h.hdr_reserved_bytes
    percent = 100.0 * reserved / total if total > 0 else 0.0
    if reserved >= total:
        progress = "all of its memory reserved, its tables still being written"
    else:
        progress = f"{percent:.0f}% of its {total} bytes reserved"
    raise IncompatibleSegmentError(
        f"segment {name!r} did not become ready: no progress while waiting {timeout:g} s "
        f"(its ready_timeout): still being created by pid {h.hdr_creator_pid}, {progress}; "
        "its creator is alive (it holds its lock) but stopped or stuck")


# ---------------------------------------------------------------------------------------------
# Snapshots as plain Python values

cdef dict header_snapshot(HkvHeader* header, char* base):
    """The header (format, regions, state, counters) as plain dicts; its offsets sound."""
    cdef dict hdr = header[0]
    return {
        "format": dict(hdr["hdr_format"]),
        "regions": dict(hdr["hdr_regions"]),
        "state": hdr["hdr_state"],
        "creator_pid": hdr["hdr_creator_pid"],
        "reserved_bytes": hdr["hdr_reserved_bytes"],
        "segment_id": hdr["hdr_segment_id"],
        "create_steps": hdr["hdr_create_steps"],
        "generation": hdr["hdr_generation"],
        "free_pages": hdr["hdr_free_pages"],
        "active_leases": hdr["hdr_active_leases"],
        "tree_nodes": (<HkvSlab*>(base + header.hdr_regions.reg_radix_nodes)).sl_used,
        "active_sequences": (<HkvSlab*>(base + header.hdr_regions.reg_sequences)).sl_used,
        "sequence_pages": (<HkvSlab*>(base + header.hdr_regions.reg_sequence_pages)).sl_used,
        "undo_count": hdr["hdr_undo_count"],
        "stats": {k: v for k, v in dict(hdr["hdr_stats"]).items() if k != "st_reserved"},
        "radix": {k: v for k, v in dict(hdr["hdr_radix"]).items() if k != "rt_reserved"},
        "parts": {k: v for k, v in dict(hdr["hdr_parts"]).items() if k != "pt_reserved"},
    }


cdef dict metrics_snapshot(HkvMetrics* m):
    """The metrics region as plain Python values."""
    cdef int i
    namespaces = {}
    for i in range(HKV_NAMESPACE_SLOTS):
        if m.mt_namespaces[i].ns_used:
            key = "other" if i == HKV_NAMESPACE_SLOTS - 1 else m.mt_namespaces[i].ns_namespace
            namespaces[key] = (m.mt_namespaces[i].ns_lookup_tokens, m.mt_namespaces[i].ns_hit_tokens)
    return {
        "lock_acquisitions": m.mt_lock_acquisitions,
        "lock_wait_ns": m.mt_lock_wait_ns,
        "lock_hold_ns": m.mt_lock_hold_ns,
        "lock_wait_histogram": [m.mt_lock_wait_histogram[i] for i in range(HKV_HISTOGRAM_BUCKETS)],
        "lock_hold_histogram": [m.mt_lock_hold_histogram[i] for i in range(HKV_HISTOGRAM_BUCKETS)],
        "full_hits": m.mt_full_hits,
        "misses": {"no_prefix": m.mt_miss_no_prefix, "namespace": m.mt_miss_namespace,
                   "below_minimum": m.mt_miss_below_minimum, "evicted": m.mt_miss_evicted},
        "namespaces": namespaces,
    }
