"""The remote tier's counters, shared by every process of a host, for `python -m hostkv stats`.

A tier's counters live in its process (``RemoteTier.stats()``); the CLI attaches the segment
from another process and cannot see them. So each tier also publishes them in a small side
block of shared memory beside the segment, which ``stats`` reads and sums.

Where. ``/dev/shm/NAME@remote-stats-INODE``: NAME is the segment's name and INODE the inode
of its shared-memory object, so a segment unlinked and created again under the same name
never reads (or adds to) the counters of the one before. A segment's name never contains
'@', so no side block is ever mistaken for a segment; ``HostKVCache.unlink_segment`` (and
``python -m hostkv unlink``) removes every ``NAME@...`` object with the segment. The core
segment's layout is untouched: the block is created by the first tier of the segment (a
file written whole under a temporary name, then hard-linked into place, so no process ever
maps a half-initialised block), with the segment's file mode.

Layout (native 64-bit words). A 4 KiB header: magic, version, slots, words per slot, the
number of counters, then the counters' names (NUL-separated ASCII), so a reader of another
hostkv version sums by name. Then one slot per lease slot of the segment (max_processes),
each a multiple of 64 bytes: owner word (the lease generation of the process that writes
it), three gauges (tiers open in that process, their queue depth, how many have their
breaker open), four reserved words, then the counters.

Who writes. Slot i belongs to the process holding the segment's lease slot i, and only to
it (one SlotWriter per process and lease, shared by its tiers under a thread lock): no
lock between processes, nothing under the segment's lock. Each counter is one aligned
64-bit word, written with a single store, and only ever grows.

What a reader gets (the guarantees):
- every counter at a value it really had: an aligned 8-byte store is single-copy atomic on
  x86-64 and AArch64, so no torn word;
- totals that never go backwards between two reads: no word is ever reset or decreased,
  and a process killed at any instruction leaves each of its words at a value it had;
- no atomic snapshot across counters: between two stores of one update a reader may see,
  say, a fetch's hit_pages and not yet its bytes_down (as with any scrape of independent
  counters);
- cumulative totals across processes: a dead process's counters stay in its slot and in
  the totals; when another process later takes that lease slot and makes a tier, it takes
  the slot over and counts on top (reclaimed, never reset);
- gauges only of live processes: a slot's gauges count while its owner's lease is alive
  and of the generation the slot records (a dead process's queue is not reported).
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import threading
import uuid
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

__all__ = ["SlotWriter", "read_totals", "side_path", "writer_for"]

log = logging.getLogger("hostkv.remote")

SHM_DIR = "/dev/shm"        # where Linux's shm_open (posix_ipc) keeps segments
MAGIC = int.from_bytes(b"HKVRMST1", "little")
VERSION = 1
HEADER_BYTES = 4096
_HEADER = struct.Struct("=QQQQQ")   # magic, version, slots, words per slot, counters
_NAMES_AT = 64
SLOT_HEADER_WORDS = 8
W_OWNER, W_TIERS, W_QUEUE, W_BREAKER = 0, 1, 2, 3
GAUGES = {"tiers": W_TIERS, "queue_depth": W_QUEUE, "breaker_open": W_BREAKER}


def side_path(name: str, inode: int) -> str:
    """The side block of segment `name` whose shared-memory object has inode `inode`."""
    return f"{SHM_DIR}/{name}@remote-stats-{inode}"


def _segment_inode(name: str) -> Optional[os.stat_result]:
    try:
        return os.stat(f"{SHM_DIR}/{name}")
    except OSError:
        return None


class _Block:
    """One mapping of a side block in this process."""

    def __init__(self, path: str, mm: mmap.mmap) -> None:
        self.path = path
        self._mm = mm
        if len(mm) < HEADER_BYTES:
            raise ValueError(f"{path}: {len(mm)} bytes, shorter than a side block's header")
        magic, version, slots, slot_words, count = _HEADER.unpack_from(mm, 0)
        if magic != MAGIC or version != VERSION:
            raise ValueError(f"{path}: not a hostkv remote-stats block of version {VERSION}")
        raw = bytes(mm[_NAMES_AT:HEADER_BYTES]).split(b"\0")[:count]
        self.names = [n.decode("ascii") for n in raw]
        if (len(self.names) != count or slot_words < SLOT_HEADER_WORDS + count
                or slot_words % 8 or len(mm) < HEADER_BYTES + slots * slot_words * 8):
            raise ValueError(f"{path}: damaged header")
        self.slots = slots
        self.slot_words = slot_words
        self.index = {n: SLOT_HEADER_WORDS + i for i, n in enumerate(self.names)}
        # Item stores through a 'Q' memoryview are one 8-byte memcpy: a single store.
        self.words = memoryview(mm).cast("Q")

    def at(self, slot: int, word: int) -> int:
        return (HEADER_BYTES // 8) + slot * self.slot_words + word

    def close(self) -> None:
        self.words.release()
        self._mm.close()


def _block_bytes(slots: int, names: Sequence[str]) -> Tuple[bytes, int]:
    slot_words = -(-(SLOT_HEADER_WORDS + len(names)) // 8) * 8
    table = b"\0".join(n.encode("ascii") for n in names)
    if _NAMES_AT + len(table) > HEADER_BYTES:
        raise ValueError("too many counter names for the side block's header")
    header = bytearray(HEADER_BYTES)
    _HEADER.pack_into(header, 0, MAGIC, VERSION, slots, slot_words, len(names))
    header[_NAMES_AT:_NAMES_AT + len(table)] = table
    return bytes(header), HEADER_BYTES + slots * slot_words * 8


def _open_block(path: str, mode: int, slots: int, names: Sequence[str]) -> _Block:
    """Opens the side block at path, creating it first if it does not exist."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        # Written whole under a temporary name, then linked into place: a process that
        # opens the path sees a complete block or none. Losing the race is fine.
        header, size = _block_bytes(slots, names)
        tmp = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
        try:
            os.fchmod(fd, mode)         # past the umask, like the segment's own mode
            os.ftruncate(fd, size)
            # Reserved now, as the segment's memory is: a store into an unbacked page of a
            # full /dev/shm would kill the process with SIGBUS (ENOSPC here: not shared).
            os.posix_fallocate(fd, 0, size)
            os.pwrite(fd, header, 0)
            try:
                os.link(tmp, path)
            except FileExistsError:
                os.close(fd)
                fd = os.open(path, os.O_RDWR)
        except BaseException:
            os.close(fd)
            raise
        finally:
            os.unlink(tmp)
    try:
        size = os.fstat(fd).st_size
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    try:
        return _Block(path, mm)
    except BaseException:
        mm.close()
        raise


class SlotWriter:
    """This process's slot in a segment's side block, for one lease; shared by every tier of
    the process on that handle (counts are added under a thread lock: one writer)."""

    def __init__(self, key: Tuple[str, int, int], block: _Block, slot: int,
                 generation: int) -> None:
        self._key = key
        self._block = block
        self._slot = slot
        self._lock = threading.Lock()
        self._users = 0
        words, at = block.words, block.at
        # Take the slot over: gauges first (the old owner's are stale), then the owner
        # word; a reader trusts the gauges only while the owner's lease lives. Counters
        # stay as they are: the totals keep what the slot's earlier owners counted.
        if words[at(slot, W_OWNER)] != generation:
            for word in GAUGES.values():
                words[at(slot, word)] = 0
            words[at(slot, W_OWNER)] = generation
        self._at = {name: at(slot, word) for name, word in block.index.items()}
        self._gauge_at = {name: at(slot, word) for name, word in GAUGES.items()}

    def add(self, amounts: Mapping[str, int]) -> None:
        """Adds to counters (names the block does not know are left out)."""
        words = self._block.words
        with self._lock:
            for name, amount in amounts.items():
                at = self._at.get(name)
                if at is not None and amount > 0:
                    words[at] = words[at] + int(amount)

    def gauge(self, name: str, delta: int) -> None:
        """Moves a gauge (tiers, queue_depth, breaker_open) by delta."""
        if delta:
            words = self._block.words
            at = self._gauge_at[name]
            with self._lock:
                words[at] = max(0, words[at] + delta)

    def _acquire(self) -> "SlotWriter":
        with self._lock:
            self._users += 1
        self.gauge("tiers", 1)
        return self

    def release(self) -> None:
        """One tier of this process is done with the slot."""
        self.gauge("tiers", -1)
        with _writers_lock:
            with self._lock:
                self._users -= 1
                last = self._users == 0
            if last and _writers.get(self._key) is self:
                del _writers[self._key]
                self._block.close()


_writers: Dict[Tuple[str, int, int], SlotWriter] = {}
_writers_lock = threading.Lock()


def writer_for(cache: Any, names: Sequence[str]) -> Optional[SlotWriter]:
    """This process's SlotWriter for the cache's segment and lease (made on first use), or
    None when the counters cannot be shared (no lease; no /dev/shm object; a side block
    this process may not open or of another version): the tier works on, unshared."""
    seg = cache._segment
    try:
        # Under the lock: a handle inherited through fork takes its own lease first.
        leases = seg.run_locked(seg.leases)
        slot = seg.lease_slot_index
        generation = next((gen for s, _state, _pid, gen, _at in leases if s == slot), None)
        st = _segment_inode(cache.name)
        if slot < 0 or generation is None or st is None:
            return None
        path = side_path(cache.name, st.st_ino)
        key = (path, slot, generation)
        with _writers_lock:
            writer = _writers.get(key)
            if writer is None:
                block = _open_block(path, st.st_mode & 0o666, cache.config.max_processes, names)
                if slot >= block.slots:
                    block.close()
                    return None
                writer = _writers[key] = SlotWriter(key, block, slot, generation)
            return writer._acquire()
    except (OSError, ValueError) as exc:
        log.warning("hostkv remote tier: counters not shared with `python -m hostkv stats` "
                    "(%s)", exc)
        return None


def read_totals(seg: Any, name: str) -> Optional[Dict[str, Any]]:
    """The counters of every process's tiers on segment `name`, summed (gauges of live
    processes only), or None when no tier ever published there.

    Args:
        seg: An open _segment.Segment of `name` (an observer's will do): it tells which
            lease slots are alive.

    Returns:
        {"processes": live processes with a tier, "tiers", "queue_depth", "breaker_open",
        every counter by name, and grouped ones ("invalid_pages:layout" ...) as dicts}.
    """
    st = _segment_inode(name)
    if st is None:
        return None
    path = side_path(name, st.st_ino)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        mm = mmap.mmap(fd, os.fstat(fd).st_size, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(fd)
    try:
        block = _Block(path, mm)
    except BaseException:
        mm.close()
        raise
    try:
        def lease_table() -> Dict[int, Tuple[int, bool]]:
            return {slot: (gen, seg.lease_alive(slot))
                    for slot, _state, _pid, gen, _at in seg.leases()}

        live = seg.run_locked(lease_table)
        words, at = block.words, block.at
        sums: Dict[str, int] = {n: 0 for n in block.names}
        gauges = {g: 0 for g in GAUGES}
        processes = 0
        for slot in range(block.slots):
            owner = words[at(slot, W_OWNER)]
            if owner == 0:
                continue
            for n, word in block.index.items():
                sums[n] += words[at(slot, word)]        # one 8-byte load each
            gen, alive = live.get(slot, (None, False))
            if alive and gen == owner:
                values = {g: words[at(slot, w)] for g, w in GAUGES.items()}
                if values["tiers"]:
                    processes += 1
                    for g, v in values.items():
                        gauges[g] += v
    finally:
        block.close()
    out: Dict[str, Any] = {"processes": processes, **gauges}
    for n, value in sums.items():
        group, sep, item = n.partition(":")
        if sep:
            out.setdefault(group, {})[item] = value
        else:
            out[n] = value
    for group, items in list(out.items()):
        # A group named by bucket numbers ("fetch_latency_us:0" ...) is a histogram: a list.
        if isinstance(items, dict) and items and all(k.isdigit() for k in items):
            out[group] = [items.get(str(b), 0) for b in range(max(map(int, items)) + 1)]
    return out
