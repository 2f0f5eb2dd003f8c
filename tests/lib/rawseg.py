"""Raw access to a segment's bytes, behind hostkv's back: for snapshots and for corruption.

A segment is the file /dev/shm/<name>; mapping it with Python's mmap gives the bytes every
process sees, without going through (or trusting) hostkv. Offsets come from hostkv's own
layout description (`_segment.layout_info()`) and the header's region table, so nothing here
hard-codes the memory map.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
from typing import Dict, List, Tuple

import numpy as np

from hostkv import _segment

LAYOUT = _segment.layout_info()
MUTEX_SIZE = LAYOUT["sizes"]["pthread_mutex_t"]
LEASE_SIZE = LAYOUT["sizes"]["HkvLease"]
HEADER_SIZE = LAYOUT["sizes"]["HkvHeader"]


def shm_path(name: str) -> str:
    return "/dev/shm/" + name


def hold_creator_mark(fd: int) -> None:
    """Takes the creator's mark on a segment file (as hostkv's creator does until READY: an
    open-file-description write lock on byte 0, compat.h), for tests that play the creator.
    It goes when the file description closes."""
    # struct flock on 64-bit Linux: short l_type, short l_whence, off_t l_start, off_t l_len,
    # pid_t l_pid (0 for F_OFD_* calls), padded to 32 bytes.
    lock = struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, 0, 1, 0)
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, lock)


class RawSegment:
    """A writable mmap of the whole segment file (closed by close() or the context)."""

    def __init__(self, name: str) -> None:
        fd = os.open(shm_path(name), os.O_RDWR)
        try:
            self.size = os.fstat(fd).st_size
            self.map = mmap.mmap(fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)

    def close(self) -> None:
        self.map.close()

    def __enter__(self) -> "RawSegment":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def read(self, start: int, end: int) -> bytes:
        return self.map[start:end]


def regions(info: dict) -> List[Tuple[str, int, int]]:
    """(name, start, end) of every metadata region, in address order, from a header_info()
    dict: the header, then each region up to the next; the last one ends at reg_pool."""
    offsets = {k: v for k, v in info["regions"].items()
               if k not in ("reg_pool", "reg_part_pool", "reg_total_size")}
    ordered = sorted(offsets.items(), key=lambda kv: kv[1])
    out = [("header", 0, ordered[0][1])]
    for i, (key, start) in enumerate(ordered):
        end = ordered[i + 1][1] if i + 1 < len(ordered) else info["regions"]["reg_pool"]
        out.append((key[len("reg_"):], start, end))
    return out


def mutex_ranges(info: dict, max_processes: int) -> List[Tuple[int, int]]:
    """The byte ranges of every pthread mutex in the metadata: the header's lock and each
    lease slot's lock (their bytes belong to libc and the kernel, not to hostkv)."""
    hdr_mutex = LAYOUT["header"]["hdr_mutex"]
    out = [(hdr_mutex, hdr_mutex + MUTEX_SIZE)]
    leases = info["regions"]["reg_leases"]
    ls_mutex = LAYOUT["lease"]["ls_mutex"]
    for slot in range(max_processes):
        start = leases + slot * LEASE_SIZE + ls_mutex
        out.append((start, start + MUTEX_SIZE))
    return out


def lock_metric_ranges(info: dict, histogram_buckets: int) -> List[Tuple[int, int]]:
    """The metrics region's lock timing fields (acquisitions, wait and hold sums, the two
    histograms): every lock, even a read-only one, adds to them, unlogged by design."""
    start = info["regions"].get("reg_metrics")
    if start is None:
        return []
    return [(start, start + 8 * (3 + 2 * histogram_buckets))]


def field_range(name: str) -> Tuple[int, int]:
    """A header field's bytes (8-byte fields only)."""
    at = LAYOUT["header"][name]
    return (at, at + 8)


class MetadataSnapshot:
    """Every metadata byte (everything before the page pool) except the fields that change
    on any lock: the mutexes, the lock timing metrics and the periodic sweep's clock. The
    generation counter is compared unless the sweep clock moved (a periodic sweep commits
    and bumps it): take the snapshot right after cache.reap(), and none is due for a second.
    Compare two with `diff`."""

    def __init__(self, cache) -> None:
        seg = cache._segment
        self.name = cache.name
        self.info = seg.run_locked(seg.header_info)
        metrics = seg.run_locked(seg.metrics_info) if hasattr(seg, "metrics_info") else None
        buckets = len(metrics["lock_wait_histogram"]) if metrics else 0
        self.pool = self.info["regions"]["reg_pool"]
        self.regions = regions(self.info)
        excluded = mutex_ranges(self.info, cache.config.max_processes)
        excluded += lock_metric_ranges(self.info, buckets)
        excluded.append(field_range("hdr_reserved_bytes"))
        self.mask = np.ones(self.pool, dtype=bool)
        for start, end in excluded:
            self.mask[start:end] = False
        self.excluded = excluded

    def take(self) -> np.ndarray:
        with RawSegment(self.name) as raw:
            data = np.frombuffer(raw.read(0, self.pool), dtype=np.uint8).copy()
        self.sweeps = getattr(self, "sweeps", set())
        start, end = field_range("hdr_reserved_bytes")
        self.sweeps.add(data[start:end].tobytes())
        data[~self.mask] = 0
        return data

    def diff(self, before: np.ndarray, after: np.ndarray) -> str:
        """'' if equal, else where they differ (region and offset of the first few bytes)."""
        if len(self.sweeps) > 1:
            # A periodic sweep ran in between (a slow machine): its commit bumped the
            # generation, legitimately.
            before, after = before.copy(), after.copy()
            start, end = field_range("hdr_generation")
            before[start:end] = after[start:end] = 0
        changed = np.nonzero(before != after)[0]
        if not changed.size:
            return ""
        where = []
        for offset in changed[:8].tolist():
            region = next(r for r in self.regions if r[1] <= offset < r[2])
            where.append(f"{region[0]}+{offset - region[1]} ({before[offset]}->{after[offset]})")
        return f"{changed.size} metadata byte(s) changed: " + ", ".join(where)


def corruptible_ranges(info: dict, max_processes: int) -> Dict[str, List[Tuple[int, int]]]:
    """Region name -> byte ranges that corruption may hit: all metadata except the magic,
    the format word and the mutexes (a trashed mutex is libc's business, a trashed magic or
    format is attach's, both tested elsewhere)."""
    hdr = LAYOUT["header"]
    holes = [(0, hdr["hdr_config"])]                       # magic and format word
    holes += mutex_ranges(info, max_processes)
    out: Dict[str, List[Tuple[int, int]]] = {}
    for name, start, end in regions(info):
        ranges = [(start, end)]
        for h_start, h_end in holes:
            split = []
            for r_start, r_end in ranges:
                if h_end <= r_start or h_start >= r_end:
                    split.append((r_start, r_end))
                    continue
                if r_start < h_start:
                    split.append((r_start, h_start))
                if h_end < r_end:
                    split.append((h_end, r_end))
            ranges = split
        out[name] = [r for r in ranges if r[1] > r[0]]
    return {k: v for k, v in out.items() if v}
