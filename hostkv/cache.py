"""HostKVCache: one process's handle on a shared hostkv segment.

The compiled modules do everything that touches shared memory; this class is the public
face over them: create or attach, stats, check, reap, zero-copy views of the page pool, and
the pre-faulting of this process's mapping of the pool off the serving path.
"""

from __future__ import annotations

import dataclasses
import errno
import glob
import logging
import os
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import posix_ipc

from hostkv import _histogram, _introspect, _pages, _radix, _segment, _sequences
from hostkv._tokens import as_namespace, as_tokens
from hostkv._validate import int_in
from hostkv.config import KV_KINDS, HostKVConfig, KVLayout, dtype_from_code
from hostkv.errors import (
    AbandonedSegmentError,
    ConfigError,
    IncompatibleSegmentError,
    SegmentExistsError,
    SegmentFormatError,
    SegmentNotFoundError,
    os_error,
    translate_posix_ipc,
)

__all__ = ["CacheMetrics", "CacheStats", "EvictionCandidate", "HostKVCache", "PrefaultStatus",
           "PrefixMatch"]

log = logging.getLogger("hostkv")


@dataclasses.dataclass(frozen=True)
class PrefixMatch:
    """The longest cached page-aligned prefix of a token sequence.

    Attributes:
        num_tokens: Tokens covered, a multiple of page_size (0 when nothing matched).
        pages: The pages holding their KV, np.int32, num_tokens // page_size of them.
    """

    num_tokens: int
    pages: np.ndarray


@dataclasses.dataclass(frozen=True)
class EvictionCandidate:
    """A cached node that eviction would take soon, as eviction_candidates() saw it.

    Attributes:
        namespace: The node's namespace.
        tokens: The token ids of its whole path, from the top of the tree to the node's end
            (np.int32, a multiple of page_size).
        pages: The pages of that path at the time of the call (np.int32); they may be
            evicted and reused as soon as the call returns: hold them
            (WorkerView.hold_cached_pages) before reading their KV.
        num_pages: The node's own pages: the last num_pages of the path.
        position: The pages eviction would take before the node's own (its place in the
            order; the next node's is position + num_pages).
    """

    namespace: int
    tokens: np.ndarray
    pages: np.ndarray
    num_pages: int
    position: int


@dataclasses.dataclass(frozen=True)
class CacheStats:
    """A consistent snapshot of a segment's counters, shared by every process.

    Attributes:
        free_pages: Pages no one references.
        cached_pages: Pages held by the radix tree.
        borrowed_pages: Tree pages that a live sequence holds too (not evictable).
        active_sequences: Live sequences across all processes.
        active_processes: Attached processes (live leases).
        lookups: Allocation requests that looked for a prefix.
        lookup_tokens: Their prompt tokens.
        hit_tokens: Their reused tokens.
        evicted_pages: Tree pages evicted so far.
        inserted_pages: Pages the tree adopted so far.
        tree_nodes: Radix-tree node records in use.
        evictable_pages: Cached pages no borrower protects (evictable, leaves first).
        pages_allocated: Pages handed out so far.
        pages_freed: Pages returned to the free list so far.
        recoveries: Mutations of dead lock holders rolled back.
        rollbacks: Mutations rolled back after an exception in a live process (a call
            that fails after its first logged store counts here, though it changed nothing).
        leases_reaped: Dead processes whose references were released.
        generation: Committed mutations so far.
        num_parts: Window parts in the segment (0: none; the rest are then 0 too).
        free_parts: Parts no page holds.
        parts_allocated: Parts given to fresh pages so far.
        parts_freed: Parts returned to the free list so far.
        parts_donated: Parts a commit moved from its own page to the tree's page of the
            same tokens, which had none.
        pages_without_part: Fresh pages that found no part free (in a segment with parts).
        tree_parts: Parts of pages the tree holds.
        parts_evicted: Tree parts taken for fresh pages so far, least recently used node
            first (their pages stayed cached).
    """

    free_pages: int
    cached_pages: int
    borrowed_pages: int
    active_sequences: int
    active_processes: int
    lookups: int
    lookup_tokens: int
    hit_tokens: int
    evicted_pages: int
    inserted_pages: int
    tree_nodes: int
    evictable_pages: int
    pages_allocated: int
    pages_freed: int
    recoveries: int
    rollbacks: int
    leases_reaped: int
    generation: int
    num_parts: int = 0
    free_parts: int = 0
    parts_allocated: int = 0
    parts_freed: int = 0
    parts_donated: int = 0
    pages_without_part: int = 0
    tree_parts: int = 0
    parts_evicted: int = 0


@dataclasses.dataclass(frozen=True)
class CacheMetrics:
    """The segment's always-on metrics, shared by every process.

    Attributes:
        lock_acquisitions: Times any process took the segment's lock (failed calls that
            took it included; these and the lock times are never rolled back).
        lock_wait_ns, lock_hold_ns: Total nanoseconds spent waiting for it and holding it.
        lock_wait_histogram, lock_hold_histogram: Counts per log2 bucket: entry b counts
            durations in [2**(b-1), 2**b) ns (entry 0: zero).
        full_hits: Allocation requests that reused every page they could.
        misses: Requests that reused less, by the reason the match stopped: "no_prefix"
            (never cached, or diverged), "namespace" (cached under another namespace),
            "below_minimum" (matched fewer than prefix_min_reuse_pages), "evicted" (cached,
            then evicted). The namespace and evicted reasons come from best-effort hint
            tables and may be under-counted.
        namespaces: Per namespace (up to 63, then "other"): (lookup tokens, hit tokens).
    """

    lock_acquisitions: int
    lock_wait_ns: int
    lock_hold_ns: int
    lock_wait_histogram: Tuple[int, ...]
    lock_hold_histogram: Tuple[int, ...]
    full_hits: int
    misses: Dict[str, int]
    namespaces: Dict[Any, Tuple[int, int]]

    @staticmethod
    def bucket_upper_ns(bucket: int) -> int:
        """The exclusive upper bound, in ns, of histogram entry `bucket`."""
        return _histogram.upper(bucket)

    def percentile_ns(self, which: str, fraction: float) -> int:
        """An upper bound of the given percentile (0 < fraction <= 1) of lock "wait" or
        "hold" times, from the histogram: the top of the bucket it falls in, or 0 when it
        falls in entry 0 (acquisitions that did not wait; see hostkv/_histogram.py)."""
        histogram = self.lock_wait_histogram if which == "wait" else self.lock_hold_histogram
        return _histogram.percentile(histogram, fraction)


@dataclasses.dataclass(frozen=True)
class PrefaultStatus:
    """Where the pre-faulting of this process's mapping of the page pool stands
    (HostKVCache.start_prefault), and whether the mapping was advised to use huge pages.

    Attributes:
        state: "idle" (not started in this process), "running", "done", "stopped" (close()
            ended it first), or "failed" (see error).
        done_bytes: Bytes of the pool populated so far.
        total_bytes: The pool's bytes, num_pages * page_bytes.
        method: The madvise advice that ran: "MADV_POPULATE_READ" (Linux 5.14+), else
            "MADV_POPULATE_WRITE", else "MADV_WILLNEED" (which only starts the kernel reading
            pages in, mapping none), each tried where the kernel refused the one before;
            "" before the first chunk.
        seconds: How long it ran (so far, while running).
        error: Why it failed, "" otherwise.
        huge_pages: "advised" (madvise(MADV_HUGEPAGE) was applied to this mapping of the
            pool at create or attach), "off" (not applied: the segment's tmpfs gives no huge
            pages, see huge_policy) or "refused" (the kernel refused it). Advised is not
            huge: the pool's memory is reserved at create, before any mapping can advise
            it, so it is in huge pages only where the tmpfs gives them unasked
            (huge_policy "within_size", "always" or "force"; see docs/design.md, "Huge pages for the pool").
        huge_policy: The huge-page policy of the tmpfs that holds segments (/dev/shm): its
            mount's huge= option ("never", "advise", "within_size", "always"), or "deny" or
            "force" where /sys/kernel/mm/transparent_hugepage/shmem_enabled overrides every
            mount; "" where the kernel has no transparent huge pages or it could not be read.
    """

    state: str
    done_bytes: int
    total_bytes: int
    method: str
    seconds: float
    error: str
    huge_pages: str
    huge_policy: str


def _lease_args(slot: Any, generation: Any) -> Tuple[int, int]:
    """A lease's (slot, generation), checked: an int32 and a uint64."""
    return (int_in(slot, -2**31, 2**31, ValueError, "slot", "an integer", "be an int32"),
            int_in(generation, 0, 2**64, ValueError, "generation", "an integer",
                   "be in [0, 2**64)"))


class HostKVCache:
    """A handle on a hostkv segment: the shared page pool and prefix cache.

    Make one with :meth:`create` (a new segment) or :meth:`attach` (an existing one). Each
    handle holds a lease on the segment until :meth:`close`; a process that dies without
    closing has its lease, and what its sequences held, reclaimed by the others. Usable as a
    context manager (closes on exit; :meth:`unlink` removes the segment's name).
    """

    def __init__(self, segment: _segment.Segment) -> None:
        """Wraps an open Segment; use create() or attach() instead."""
        self._segment = segment
        self._pool_span = segment.pool_span()
        values, layout = segment.config_values()
        if layout is not None:
            (num_layers, num_kv_heads, head_dim, dtype_code, kind_code, state_layers,
             window_layers) = layout
            kinds = {code: kind for kind, code in KV_KINDS.items()}
            try:
                dtype = dtype_from_code(dtype_code)
                if kind_code not in kinds:
                    raise ConfigError(f"KV layout kind code {kind_code} is not one of "
                                      f"{sorted(kinds)}")
                values["kv_layout"] = KVLayout(num_layers, num_kv_heads, head_dim, dtype,
                                               kinds[kind_code], state_layers, window_layers)
            except ConfigError as exc:
                raise IncompatibleSegmentError(f"segment {segment.name!r}: {exc}") from None
        self._config = HostKVConfig(**values)
        self._prefault_run: Optional[_PrefaultRun] = None
        self._huge_policy = _shmem_huge_policy()
        self._huge_pages = _advise_huge_pages(segment, self._pool_bytes, self._huge_policy)

    @classmethod
    def create(cls, name: str, config: HostKVConfig, *, lock_timeout: float = 10.0) -> "HostKVCache":
        """Creates the segment `name` (mode 0600, memory reserved up front) and attaches.

        Args:
            name: Letters, digits, '-', '_' and '.', at most 200 characters.
            config: The configuration; 0 capacities are derived (apply_runtime_defaults).
            lock_timeout: Seconds any operation waits for the segment's lock.

        Raises:
            ValueError: A bad name or timeout.
            ConfigError: A bad config.
            SegmentExistsError: The name is taken.
            SegmentError: The OS refused (errno ENOSPC when /dev/shm is too full).
        """
        if not isinstance(config, HostKVConfig):
            raise ConfigError(f"config must be a HostKVConfig, got {type(config).__name__}")
        resolved = config.apply_runtime_defaults()
        return cls(_segment.Segment.create(name, resolved, lock_timeout=lock_timeout))

    @classmethod
    def attach(
        cls,
        name: str,
        *,
        expected_config: Optional[HostKVConfig] = None,
        lock_timeout: float = 10.0,
        ready_timeout: float = _segment.DEFAULT_READY_TIMEOUT,
        trust_other_users: bool = False,
        lease: bool = True,
    ) -> "HostKVCache":
        """Attaches to an existing segment, reading its config from the header.

        Args:
            name: The segment's name.
            expected_config: If given, the segment's config must equal it once resolved.
            lock_timeout: Seconds any operation waits for the segment's lock.
            ready_timeout: Seconds without progress after which a segment still being
                created is given up on (default 120); a creator that keeps reserving (all
                of the pool's memory, ~5 GB/s on tmpfs) is waited for however long it
                takes. A timeout says how far the creator got.
            trust_other_users: Attach even if another user owns the segment or other users
                may write it.
            lease: False attaches as an observer (for inspection tools): no lease slot is
                taken and no dead process is reaped, so attaching changes nothing.

        Raises:
            SegmentNotFoundError: No segment of that name.
            ForeignSegmentError: Owned by another user or writable by others.
            IncompatibleSegmentError: Not a hostkv segment (refused at once), another
                format, a config other than expected_config, or a creator that made no
                progress for ready_timeout (the message says how much it had reserved).
            AbandonedSegmentError: Its creator died before it was ready (at once).
        """
        if expected_config is not None and lease:
            # Refuse a segment of another config before taking a lease in it (registering
            # and giving back a lease would change the lease table): an observer's attach
            # changes nothing. The config is compared again below, under the lease.
            cls.attach(name, expected_config=expected_config, lock_timeout=lock_timeout,
                       ready_timeout=ready_timeout, trust_other_users=trust_other_users,
                       lease=False).close()
        segment = _segment.Segment.attach(
            name, lock_timeout=lock_timeout, ready_timeout=ready_timeout,
            trust_other_users=trust_other_users, lease=lease)
        try:
            cache = cls(segment)
            if expected_config is not None:
                cache._compare_config(expected_config.apply_runtime_defaults())
        except BaseException:
            segment.close()
            raise
        return cache

    def _compare_config(self, expected: HostKVConfig) -> None:
        differing = [
            f"{field.name}: segment has {getattr(self._config, field.name)!r}, "
            f"expected {getattr(expected, field.name)!r}"
            for field in dataclasses.fields(HostKVConfig)
            if getattr(self._config, field.name) != getattr(expected, field.name)
        ]
        if differing:
            raise IncompatibleSegmentError(
                f"segment {self.name!r} has another config: " + "; ".join(differing))

    @classmethod
    def open(
        cls,
        name: str,
        config: HostKVConfig,
        *,
        compatible: Optional[Callable[[HostKVConfig], bool]] = None,
        may_replace: Optional[Callable[[IncompatibleSegmentError, Optional[HostKVConfig]], bool]] = None,
        lock_timeout: float = 10.0,
        ready_timeout: float = _segment.DEFAULT_READY_TIMEOUT,
        attempts: int = 50,
    ) -> "HostKVCache":
        """Attaches `name`, or creates it with `config` where none exists, atomically across
        processes; replaces a stale one that nobody has attached.

        Processes starting together all succeed: the create is exclusive (the others
        attach, waiting while the creator makes progress); a stale segment (another format,
        a config `compatible` refuses, or abandoned by a creator that died) is looked at
        without a lease or a lock (attach(lease=False)), so lookers never count as users,
        and replaced through :meth:`replace_segment`, which one of them wins and the others
        then attach.

        Args:
            name: The segment's name.
            config: The config of a segment this call creates.
            compatible: Whether an existing segment's config will do (default: the same
                KV layout, page size, page bytes and window parts).
            may_replace: Called with the reason (an IncompatibleSegmentError) and the
                found config (None where unreadable) before replacing; False or raising
                refuses. Default: replace.
            lock_timeout, ready_timeout: As for :meth:`attach`.
            attempts: Looks at the name at most this many times while it keeps changing.

        Raises:
            SegmentInUseError: a stale segment that live processes have attached.
            IncompatibleSegmentError: may_replace refused (its reason), or the name kept
                changing.
            HostKVError: the segment could not be created or attached.
        """
        resolved = config.apply_runtime_defaults()
        if compatible is None:
            def compatible(found: HostKVConfig) -> bool:
                return (found.kv_layout == resolved.kv_layout
                        and found.page_size == resolved.page_size
                        and found.page_bytes == resolved.page_bytes
                        and found.num_parts == resolved.num_parts
                        and found.part_bytes == resolved.part_bytes)
        delay = 0.001
        for _ in range(attempts):
            try:
                st = os.stat(_segment.shm_path(name))
                inode: Optional[Tuple[int, int]] = (st.st_dev, st.st_ino)
            except FileNotFoundError:
                inode = None
            found: Optional[HostKVConfig] = None
            try:
                probe = cls.attach(name, lock_timeout=lock_timeout, ready_timeout=ready_timeout,
                                   lease=False)
            except SegmentNotFoundError:
                try:
                    return cls.create(name, resolved, lock_timeout=lock_timeout)
                except SegmentExistsError:
                    continue                     # another process created it first
            except (SegmentFormatError, AbandonedSegmentError) as exc:
                reason: IncompatibleSegmentError = exc
            else:
                try:
                    found = probe.config
                finally:
                    probe.close()
                if compatible(found):
                    try:
                        cache = cls.attach(name, lock_timeout=lock_timeout,
                                           ready_timeout=ready_timeout)
                    except (SegmentNotFoundError, SegmentFormatError, AbandonedSegmentError):
                        continue                 # changed since the look: look again
                    if compatible(cache.config):
                        return cache
                    cache.close()
                    continue
                reason = IncompatibleSegmentError(
                    f"segment {name!r} holds pages this process cannot use (page_size "
                    f"{found.page_size}, page_bytes {found.page_bytes}, {found.kv_layout})")
            if inode is None:
                continue
            if may_replace is not None and not may_replace(reason, found):
                raise reason
            fresh = cls.replace_segment(name, resolved, lock_timeout=lock_timeout,
                                        expect_inode=inode)
            if fresh is not None:
                log.warning("hostkv: replaced segment %r (%s)", name, reason)
                return fresh
            time.sleep(delay)                    # another process is replacing it
            delay = min(delay * 2, 0.05)
        raise IncompatibleSegmentError(
            f"segment {name!r} kept changing while opening it ({attempts} looks)")

    @classmethod
    def replace_segment(
        cls,
        name: str,
        config: HostKVConfig,
        *,
        lock_timeout: float = 10.0,
        expect_inode: Optional[Tuple[int, int]] = None,
    ) -> Optional["HostKVCache"]:
        """Unlinks the segment `name` if no live process has it attached, and creates it
        anew with `config` (as :meth:`create`): for a segment found stale (another format,
        another page layout, or abandoned by a creator that died).

        Every attached handle holds a shared ``flock`` on the segment's file while it is
        open; this takes the exclusive lock without waiting, so it replaces only a segment
        nobody uses, as the kernel knows it (in any PID namespace; the lock goes when a
        process dies). Looking at a segment (``attach(lease=False)``) takes no lock.

        Args:
            name: The segment's name.
            config: The new segment's configuration.
            lock_timeout: The new handle's lock timeout.
            expect_inode: (st_dev, st_ino) of the file the caller found stale (see
                ``os.stat("/dev/shm/" + name)``): another file under the name now is left
                alone.

        Returns:
            The new segment's handle, or None when there was nothing to do yet: the name
            is another file than expect_inode, another process is replacing it or just did,
            or another created it first. Look again (attach).

        Raises:
            SegmentInUseError: live processes have it attached.
            SegmentError: the OS refused.
        """
        if not isinstance(config, HostKVConfig):
            raise ConfigError(f"config must be a HostKVConfig, got {type(config).__name__}")
        segment = _segment.Segment.replace(name, config.apply_runtime_defaults(),
                                           lock_timeout=lock_timeout, expect_inode=expect_inode)
        return None if segment is None else cls(segment)

    @staticmethod
    def unlink_segment(name: str) -> None:
        """Removes the segment's name, and the side objects kept beside it (NAME@..., such
        as the remote tier's shared counters); processes that mapped them keep their mapping.

        Raises:
            SegmentNotFoundError: No segment of that name.
        """
        posix_name = _segment.check_name(name)
        try:
            posix_ipc.unlink_shared_memory(posix_name)
        except posix_ipc.Error as exc:
            raise translate_posix_ipc(exc, "unlink segment", name, creating=False) from None
        # A segment's name never holds '@' (check_name), so this removes no other segment.
        # Linux's shm_open keeps its objects in /dev/shm.
        for path in glob.glob(f"/dev/shm/{glob.escape(name)}@*"):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    # -- properties ---------------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The segment's name (without the leading '/')."""
        return self._segment.name

    @property
    def segment_id(self) -> int:
        """The segment's random 64-bit id, never 0, fixed when it was created.

        Two handles with the same name but other ids mapped different segments (one was
        unlinked and made again between their opens): page numbers from one mean nothing
        in the other. The vLLM connector's scheduler sends it to its workers each step.
        """
        return self._segment.segment_id

    @property
    def config(self) -> HostKVConfig:
        """The segment's resolved configuration, as stored in its header."""
        return self._config

    @property
    def closed(self) -> bool:
        """True after close()."""
        return self._segment.closed

    @property
    def _pool_bytes(self) -> int:
        # The page pool and, with window parts, the part pool after it: the bytes engines
        # write, pre-faulted and advised as one range (read at open: it never changes).
        return self._pool_span

    # -- operations ---------------------------------------------------------------------------

    def stats(self) -> CacheStats:
        """A consistent snapshot of the shared counters (taken under the lock)."""
        info = self._segment.run_locked(self._segment.header_info)
        st = info["stats"]
        radix = info["radix"]
        parts = info["parts"]
        return CacheStats(
            free_pages=info["free_pages"],
            cached_pages=radix["rt_cached_pages"],
            borrowed_pages=radix["rt_protected_pages"],
            active_sequences=info["active_sequences"],
            active_processes=info["active_leases"],
            lookups=st["st_lookups"],
            lookup_tokens=st["st_lookup_tokens"],
            hit_tokens=st["st_hit_tokens"],
            evicted_pages=st["st_evicted_pages"],
            inserted_pages=st["st_inserted_pages"],
            tree_nodes=info["tree_nodes"],
            evictable_pages=radix["rt_cached_pages"] - radix["rt_protected_pages"],
            pages_allocated=st["st_pages_allocated"],
            pages_freed=st["st_pages_freed"],
            recoveries=st["st_recoveries"],
            rollbacks=st["st_rollbacks"],
            leases_reaped=st["st_leases_reaped"],
            generation=info["generation"],
            num_parts=self._config.num_parts,
            free_parts=parts["pt_free_parts"],
            parts_allocated=parts["pt_parts_allocated"],
            parts_freed=parts["pt_parts_freed"],
            parts_donated=parts["pt_parts_donated"],
            pages_without_part=parts["pt_pages_without_part"],
            tree_parts=parts["pt_tree_parts"],
            parts_evicted=parts["pt_parts_evicted"],
        )

    def metrics(self) -> CacheMetrics:
        """The lock histograms, miss reasons and per-namespace counters (under the lock)."""
        info = self._segment.run_locked(self._segment.metrics_info)
        return CacheMetrics(
            lock_acquisitions=info["lock_acquisitions"], lock_wait_ns=info["lock_wait_ns"],
            lock_hold_ns=info["lock_hold_ns"],
            lock_wait_histogram=tuple(info["lock_wait_histogram"]),
            lock_hold_histogram=tuple(info["lock_hold_histogram"]),
            full_hits=info["full_hits"], misses=info["misses"], namespaces=info["namespaces"])

    def check(self, exact_references: bool = True) -> None:
        """Walks every invariant of the segment under the lock.

        Args:
            exact_references: Require each page's refcount to be exactly its tree reference
                plus one per sequence holding it, and each node's lock count exactly the
                sequence locks through it. Tests that hold raw references through the
                internal page API pass False (then these are lower bounds).

        Raises:
            CorruptionError: The first broken invariant, named.
        """
        self._segment.run_locked(self._check_locked, exact_references)

    def _check_locked(self, exact_references: bool) -> None:
        self._segment.check_header()
        _pages.check_pages(self._segment)
        _introspect.check_tree(self._segment)
        _sequences.check_references(self._segment, exact_references)

    def match_prefix(self, tokens: Any, namespace: int = 0) -> PrefixMatch:
        """The longest cached page-aligned prefix of tokens in namespace: a pure lookup.

        It borrows nothing, refreshes no recency and counts in no stats; the pages may be
        evicted as soon as it returns. Engines borrow through WorkerView's allocation.

        Raises:
            ValueError: token ids outside [0, 2**31), not integers, or a bad namespace.
        """
        arr = as_tokens(tokens)
        pages = _radix.match(self._segment, arr, as_namespace(namespace))
        return PrefixMatch(num_tokens=len(pages) * self._config.page_size, pages=pages)

    def eviction_candidates(self, max_pages: int, skip_pages: int = 0
                            ) -> List[EvictionCandidate]:
        """The cached nodes the next evictions would take, in the order they would go, until
        they cover max_pages pages (or every evictable page): a pure lookup, like
        match_prefix (no recency refreshed, nothing held, no stats).

        For a tier that saves pages elsewhere before they are evicted (hostkv.remote's
        write-on-evict). The order is the core's: least recently used unlocked leaves
        first, a node whose children all went joining in its turn; pages borrowed by a live
        sequence are never listed. The last node is listed whole, though eviction may trim
        only its tail. Token ids and page indices are copied under the lock, KV bytes never:
        the lock is held ~0.2 ms per 256 pages listed (paths of ~100 pages, here), so list
        a long order in pieces with skip_pages.

        Args:
            max_pages: List nodes until they cover this many pages.
            skip_pages: First pass over (unlisted, uncopied) the nodes eviction would take
                first, as long as they fit in this many pages.

        Raises:
            ValueError: max_pages or skip_pages is not an int (a bool, a float, a str) or
                is outside [0, 2**63).
        """
        max_pages = _page_count(max_pages, "max_pages")
        skip_pages = _page_count(skip_pages, "skip_pages")
        return [EvictionCandidate(int(namespace), tokens, pages, int(num_pages), int(position))
                for namespace, tokens, pages, num_pages, position
                in _introspect.eviction_candidates(self._segment, max_pages, skip_pages)]

    def evict(self, num_pages: int) -> int:
        """Evicts up to num_pages cached pages that no borrower holds, least recently used
        leaves first. Returns how many pages the tree let go.

        Raises:
            ValueError: num_pages is not an int (a bool, a float, a str) or is outside
                [0, 2**63).
        """
        return _radix.evict(self._segment, _page_count(num_pages, "num_pages"))

    def reap(self) -> int:
        """Releases what dead processes held, now. Returns how many dead processes it found.

        A dead process whose lease group still has a live member (see
        :meth:`join_lease_group`) is left as it is, its pages quarantined, until the last
        member has closed or died."""
        return self._segment.reap()

    @property
    def lease_identity(self) -> Optional[Tuple[int, int]]:
        """(slot, generation) of this handle's lease in the segment (None: an observer).

        Another process of the same job passes it to :meth:`join_lease_group`."""
        return self._segment.lease_identity()

    def lease_alive(self, slot: int, generation: int) -> bool:
        """Whether lease (slot, generation) is held by a live process. One probe of its
        mutex, no lock: cheap enough to ask before each submission of copies."""
        return self._segment.lease_alive_as(*_lease_args(slot, generation))

    def join_lease_group(self, slot: int, generation: int) -> bool:
        """Makes this handle's lease a member of lease (slot, generation)'s group: this
        process writes pages that lease's sequences reserved (a vLLM worker for its
        engine's scheduler, which owns the sequences).

        If that lease's process dies while this one lives, its sequences are not released
        and their pages are not handed out to anyone (they stay quarantined): this process
        may still be writing them. The sweep after this handle's close, or its process's
        death, releases them (the last live member's, where several joined). Call it before
        the first copy into those pages.

        Returns:
            True once joined (idempotent); False when that lease is not held by a live
            process: nothing its sequences reserved may be written.

        Raises:
            ValueError: an observer's handle, a lease outside the table, or its own lease.
            LockTimeoutError: the segment's lock was not had within lock_timeout.
        """
        return self._segment.join_lease_group(*_lease_args(slot, generation))

    def pages_array(self) -> np.ndarray:
        """The page pool as a writable uint8 array [num_pages, page_bytes], without copying.

        The array keeps the mapping alive: close() raises while any view exists.

        Raises:
            ValueError: the cache is closed.
            CorruptionError: the header's pool geometry is damaged.
        """
        if self._segment.closed:
            raise ValueError("the segment is closed")
        # Through memoryview: np.asarray swallows an exception from the buffer protocol and
        # returns a 0-d object array instead (numpy 2.x), hiding a CorruptionError.
        return np.asarray(memoryview(self._segment))

    def page_parts(self, pages: Any) -> np.ndarray:
        """The window part of each listed page (np.int32, -1: none), read under the lock.

        What pins a part: a live sequence's own pages keep theirs until it commits them
        (a commit may hand a part to the tree's page of the same tokens) or lets them go;
        the pages of a prefix it borrowed or holds (locked from the borrow to its release)
        keep theirs and may only gain one. A tree page nobody has locked may lose its part
        to the part LRU at any allocation, whatever page references exist.

        Raises:
            ValueError: a page index outside the pool.
        """
        return _pages.page_parts_of(self._segment, pages)

    def parts_array(self) -> np.ndarray:
        """The window parts' bytes as a writable uint8 array [num_parts, part_bytes],
        without copying (empty, [0, 0], in a segment without parts). Like pages_array(), it
        keeps the mapping alive: close() raises while any view exists.

        Raises:
            ValueError: the cache is closed.
        """
        if self._segment.closed:
            raise ValueError("the segment is closed")
        return np.asarray(memoryview(self._segment.part_pool()))

    def pages_tensor(self, dtype: Any = None, shape: Optional[Tuple[int, ...]] = None) -> Any:
        """The page pool as a torch tensor, without copying.

        Args:
            dtype: A torch dtype; defaults to the KVLayout's dtype, or torch.uint8.
            shape: The tensor's shape; its first dimension must be num_pages and the rest
                must hold exactly page_bytes. Defaults to (num_pages, *kv_layout.page_shape)
                with a KVLayout, else (num_pages, page_bytes).

        Raises:
            ImportError: torch is not installed (pip install 'hostkv[torch]').
            ValueError: The dtype and shape do not tile a page exactly.
        """
        try:
            import torch
        except ImportError as exc:
            raise ImportError(
                "pages_tensor needs torch; install it with pip install 'hostkv[torch]'") from exc
        cfg = self._config
        layout = cfg.kv_layout
        if dtype is None:
            dtype = getattr(torch, layout.dtype) if layout is not None else torch.uint8
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"dtype must be a torch.dtype, got {dtype!r}")
        if shape is None:
            if layout is not None and dtype == getattr(torch, layout.dtype):
                shape = (cfg.num_pages,) + tuple(layout.page_shape(cfg.page_size))
            else:
                itemsize = torch.empty((), dtype=dtype).element_size()
                if cfg.page_bytes % itemsize:
                    raise ValueError(
                        f"page_bytes {cfg.page_bytes} is not a multiple of {dtype}'s "
                        f"{itemsize} bytes")
                shape = (cfg.num_pages, cfg.page_bytes // itemsize)
        shape = tuple(int(d) for d in shape)
        itemsize = torch.empty((), dtype=dtype).element_size()
        per_page = itemsize * int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else itemsize
        if not shape or shape[0] != cfg.num_pages or per_page != cfg.page_bytes or min(shape) <= 0:
            raise ValueError(
                f"shape {shape} of {dtype} does not tile the pool: the first dimension must be "
                f"num_pages={cfg.num_pages} and the rest must hold page_bytes={cfg.page_bytes}")
        flat = self.pages_array().reshape(-1)
        return torch.from_numpy(flat).view(dtype).view(shape)

    def parts_tensor(self) -> Any:
        """The window parts' bytes as a uint8 torch tensor [num_parts, part_bytes], without
        copying (as :meth:`parts_array`; [0, 0] in a segment without parts).

        Raises:
            ImportError: torch is not installed (pip install 'hostkv[torch]').
            ValueError: the cache is closed.
        """
        try:
            import torch
        except ImportError as exc:
            raise ImportError(
                "parts_tensor needs torch; install it with pip install 'hostkv[torch]'") from exc
        return torch.from_numpy(self.parts_array())

    # -- pre-faulting -------------------------------------------------------------------------

    def start_prefault(self) -> None:
        """Starts populating this process's page tables for the whole page pool, in a daemon
        thread, so that the first saves into the pool do not pay a page fault per 4 KiB.

        Each process maps the segment on its own and faults every page of the pool the first
        time it touches it, though another process touched it before (and a forked child
        starts cold too: fork copies no page tables of a shared mapping). The thread calls
        madvise(MADV_POPULATE_READ) on 64 MiB at a time without the GIL; on a tmpfs that
        maps the pages writable without changing a byte of them (other processes' KV is
        there). Where the kernel refuses it (before Linux 5.14) it falls back to
        MADV_POPULATE_WRITE, then to MADV_WILLNEED. Saves and loads may run meanwhile.

        Idempotent: once per process and mapping (again only after a close() that failed
        had stopped it); prefault_status() says how far it got. A failure of the thread is
        logged once (logger "hostkv") and recorded in the status, never raised. close()
        stops the thread between chunks and waits for it.

        Raises:
            ValueError: the cache is closed.
        """
        segment = self._segment
        with _prefault_lock:
            if segment.closed or segment.closing:
                raise ValueError("the segment is closed")
            run = self._current_run()
            if run is not None and run.state != "stopped":
                return
            run = _PrefaultRun(self._pool_bytes)
            # A daemon: an interpreter that exits without close() does not wait for it (the
            # process's exit ends the call in flight; nothing is left half-written).
            run.thread = threading.Thread(
                target=_prefault, args=(segment, run), name=f"hostkv-prefault-{self.name}",
                daemon=True)
            self._prefault_run = run
            run.thread.start()

    def prefault_status(self) -> PrefaultStatus:
        """Where start_prefault stands in this process (never raises, closed or not)."""
        with _prefault_lock:
            run = self._current_run()
            if run is None:
                state, done, method, seconds, error = "idle", 0, "", 0.0, ""
            else:
                end = run.ended if run.ended is not None else time.monotonic()
                state, done, method, seconds, error = (
                    run.state, run.done_bytes, run.method, end - run.started, run.error)
        return PrefaultStatus(
            state=state, done_bytes=done, total_bytes=self._pool_bytes, method=method,
            seconds=seconds, error=error, huge_pages=self._huge_pages,
            huge_policy=self._huge_policy)

    def _current_run(self) -> Optional["_PrefaultRun"]:
        """This process's run (under _prefault_lock): a forked child's inherited run is the
        parent's, whose thread is not in the child, so the child starts from idle."""
        run = self._prefault_run
        if run is not None and run.fork_epoch != _fork_epoch:
            run = self._prefault_run = None
        return run

    def _join_prefault(self) -> None:
        """Waits for this process's prefault thread to end: the segment is closed, so the
        thread stops before its next chunk (it is refused the chunk if it did not look)."""
        with _prefault_lock:
            run = self._current_run()
        if run is None or run.thread is None or run.thread is threading.current_thread():
            return
        run.thread.join(_PREFAULT_JOIN_TIMEOUT)

    # -- closing ------------------------------------------------------------------------------

    def close(self) -> None:
        """Gives up this process's lease and unmaps the segment (the segment lives on).

        Other threads' calls already in flight finish first (new ones are refused with
        ValueError meanwhile); close() waits for them at most lock_timeout + 1 s.

        Raises:
            BufferError: numpy or torch views of the pool are still alive (in a forked
                child too: it inherits its parent's views).
            LockTimeoutError: other threads' calls were still in flight after the wait;
                the cache stays open.
            RuntimeError: called from inside a call on this cache (its lock is held).
        """
        # The segment's close waits for a madvise chunk in flight and refuses the next one,
        # so the prefault thread never advises an unmapped range; it then ends at once.
        self._segment.close()
        self._join_prefault()

    def unlink(self) -> None:
        """Removes the segment's name, so no new process can attach (mappings live on)."""
        self.unlink_segment(self.name)

    def __enter__(self) -> "HostKVCache":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self._config.num_pages} pages"
        return f"<HostKVCache {self.name!r} {state}>"


# -- pre-faulting ---------------------------------------------------------------------------

# 64 MiB a call: ~13 ms of faults at the 5 GB/s measured cold, so progress shows and close()
# waits about that long at most for the chunk in flight.
PREFAULT_CHUNK = 64 << 20
# Read first: on a tmpfs it maps the pages writable as well (a tmpfs tracks no writes through
# the page tables, so the saves that follow take no fault), and it populates pages that exist
# 2.3x faster than MADV_POPULATE_WRITE (8.8 against 3.9 GB/s, 512 MiB, 4 KiB pages); pages
# that do not exist yet it allocates, as fast. Write where a kernel refuses read.
_PREFAULT_METHODS = ("MADV_POPULATE_READ", "MADV_POPULATE_WRITE", "MADV_WILLNEED")
_PREFAULT_RETRIES = 3          # EAGAIN/EINTR on a chunk: transient, tried again this often
_PREFAULT_JOIN_TIMEOUT = 10.0  # a closed segment refuses the thread's next call: it ends soon

# Guards every _PrefaultRun's fields and every cache's _prefault_run. A forked child gets a
# new one (a thread of the parent may have held it at fork), and a new fork epoch, which
# marks the runs it inherited as its parent's (their threads are not in the child).
_prefault_lock = threading.Lock()
_fork_epoch = 0


class _PrefaultRun:
    """One pre-faulting of one mapping in this process: its thread and its progress."""

    def __init__(self, total_bytes: int) -> None:
        self.fork_epoch = _fork_epoch
        self.total_bytes = total_bytes
        self.state = "running"
        self.done_bytes = 0
        self.method = ""
        self.error = ""
        self.started = time.monotonic()
        self.ended: Optional[float] = None
        self.thread: Optional[threading.Thread] = None

    def finish(self, state: str, error: str = "") -> None:
        with _prefault_lock:
            self.state = state
            self.error = error
            self.ended = time.monotonic()


def _prefault(segment: _segment.Segment, run: _PrefaultRun) -> None:
    """The prefault thread: advises the pool chunk by chunk until done, refused or stopped."""
    methods = list(_PREFAULT_METHODS)
    at, retries = 0, 0
    try:
        while at < run.total_bytes:
            if segment.closing or segment.closed:
                run.finish("stopped")
                return
            length = min(PREFAULT_CHUNK, run.total_bytes - at)
            try:
                err = segment.advise_pool(at, length, _segment.MADV[methods[0]])
            except ValueError:
                run.finish("stopped")          # close() began since the test above
                return
            if err == errno.EINVAL and at == 0 and len(methods) > 1:
                # An older kernel that does not know this advice: the next one does less.
                log.debug("segment %r: %s refused (%s); trying %s", segment.name, methods[0],
                          os.strerror(err), methods[1])
                methods.pop(0)
                continue
            if err in (errno.EAGAIN, errno.EINTR) and retries < _PREFAULT_RETRIES:
                retries += 1
                continue
            if err:
                raise os_error(err, f"madvise({methods[0]}) of the page pool", segment.name)
            at += length
            retries = 0
            with _prefault_lock:
                run.done_bytes = at
                run.method = methods[0]
        run.finish("done")
    except Exception as exc:  # noqa: BLE001 - a background thread: recorded, never raised
        log.warning("segment %r: pre-faulting the page pool failed after %d of %d bytes: %s",
                    segment.name, at, run.total_bytes, exc)
        run.finish("failed", str(exc))


def _after_fork_in_child() -> None:
    global _prefault_lock, _fork_epoch
    _prefault_lock = threading.Lock()
    _fork_epoch += 1


os.register_at_fork(after_in_child=_after_fork_in_child)


# -- huge pages -----------------------------------------------------------------------------

_SHMEM_ENABLED = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"
_MOUNTINFO = "/proc/self/mountinfo"
SHM_DIR = "/dev/shm"      # where Linux's shm_open keeps its objects


def _shmem_huge_policy(shm_dir: str = SHM_DIR, shmem_enabled: str = _SHMEM_ENABLED,
                       mountinfo: str = _MOUNTINFO) -> str:
    """The huge-page policy of the tmpfs that holds segments, as PrefaultStatus.huge_policy
    describes it.

    shmem_enabled governs only the kernel's internal shmem mount (SysV shm, memfd, shared
    anonymous maps), except for its emergency values "deny" and "force", which override
    every tmpfs; a tmpfs mount such as /dev/shm follows its own huge= option, "never" by
    default (Documentation/admin-guide/mm/transhuge.rst, "Hugepages in tmpfs/shmem")."""
    try:
        with open(shmem_enabled) as f:
            line = f.read()
    except OSError:
        return ""                         # a kernel without transparent huge pages
    if "[deny]" in line or "[force]" in line:
        return "deny" if "[deny]" in line else "force"
    best: Optional[Tuple[str, str, str]] = None
    try:
        with open(mountinfo) as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields, rest = left.split(), right.split()
                if len(fields) < 5 or len(rest) < 3:
                    continue
                point = fields[4].replace("\\040", " ")
                under = shm_dir == point or shm_dir.startswith(point.rstrip("/") + "/")
                # The longest mount point holding shm_dir; of equal ones the last, mounted
                # over the others.
                if under and (best is None or len(point) >= len(best[0])):
                    best = (point, rest[0], rest[2])
    except OSError:
        return ""
    if best is None or best[1] != "tmpfs":
        return "never"
    for option in best[2].split(","):
        if option.startswith("huge="):
            return option[len("huge="):]
    return "never"


def _advise_huge_pages(segment: _segment.Segment, pool_bytes: int, policy: str) -> str:
    """Advises this mapping of the pool to use huge pages where the segment's tmpfs can give
    them (PrefaultStatus.huge_pages says what happened). Cheap: it only marks the mapping.
    Under huge=within_size or always the pool's pages are huge from create on and the advice
    changes nothing. Under huge=advise it lets huge pages of the file be mapped huge here,
    but the pool's own pages were reserved at create, with no mapping to advise, and stay
    small (khugepaged was not seen to collapse them: none of a 16 MiB pool in 80 s, 6.18)."""
    if policy in ("", "never", "deny"):
        return "off"
    err = segment.advise_pool(0, pool_bytes, _segment.MADV["MADV_HUGEPAGE"])
    if err:
        log.debug("segment %r: madvise(MADV_HUGEPAGE) refused: %s", segment.name,
                  os.strerror(err))
        return "refused"
    return "advised"


def _page_count(value: Any, what: str) -> int:
    """A count of pages as an int in [0, 2**63), or ValueError naming it."""
    return int_in(value, 0, 2**63, ValueError, what, "an int", "be in [0, 2**63)")
