"""The connector's scheduler side: lookups, borrows, the step's copies, commits, releases.

It runs in vLLM's engine-core process over one :class:`hostkv.WorkerView`; the workers only
copy (``hostkv.vllm.worker``).

The protocol, per request (docs/vllm.md, "Never wrong KV", says it with every failure):

- A request that is a hostkv sequence borrowed ``reused_pages`` pages (loaded into its
  blocks in its first step) and reserved pages for the rest. Blocks ``[0, scheduled_upto)``
  are cached or being saved; ``[0, confirmed_upto)`` hold KV that every rank wrote;
  ``[0, committed_pages)`` are visible to every engine.
- Each step's save of a request covers one contiguous range ``[start, end)`` of its blocks,
  planned only for blocks whose every token id is known and whose KV is complete after the
  step. The range counts as written only when every rank confirmed the step without a
  failure and ``start == confirmed_upto``: a range never commits across a gap.
- A failed save or load on any rank, a lost step (an older step some rank never
  confirmed) or a failed token append *freezes* the request: its committed point never
  moves again and nothing more of it is saved. Its later steps were planned before the
  failure was known and may rest on KV that some rank never had.
- Blocks promised as hits that hostkv could not hold (evicted between lookup and borrow,
  or whose load was dropped) go to vLLM as load errors, and the request saves nothing
  until vLLM schedules it again from the first of them: until then every step computes on
  top of blocks that were never loaded (asynchronous scheduling plans a step before the
  previous one's errors are known).
- A block that holds no valid KV (reported bad, or loaded by a load that failed) leaves
  vLLM's own prefix cache at once (``evict_blocks``), since with the "recompute" policy
  vLLM keeps it there for other requests; any other request that already holds it as a
  computed block (a prefix-cache hit in the same or the next step) freezes.
- Work that cannot run (the lock not had, an error while planning) never forgets a
  promise: the step's metadata reports every promised load as a bad block, keeps the
  finishing requests and names the preempted ones, and the requests it scheduled freeze
  (the blocks vLLM gave them in that step are not recorded); a report that could not be
  taken is taken at the next step.

A model with a windowed KV-cache group (vLLM's hybrid manager: sliding-window or
chunked-local attention) has a block table per group, and a windowed group's table holds
vLLM's null block once a block left the layers' span (the window, or the chunks before the
current one). Its hits load asynchronously: the request waits (``WAITING_FOR_REMOTE_KVS``) until
every rank reports its load finished, and a load that cannot be made whole (evicted, not
planned, failed on a rank) is reported failed for the whole request, which vLLM then
computes from its first token; hostkv offers it no hit again, so a load that keeps failing
cannot hold it back. Block-level errors would not do: vLLM takes none for a model of
several groups, and recomputing from a bad block would attend to window blocks it never
allocated. vLLM itself keeps the blocks of a request that finishes while its load is
outstanding until the load is reported. A save that would read a windowed group's null
block freezes the request (the page's KV for those layers is gone).

With window parts (``HostKVSettings.window_parts``) a windowed group's layers live in the
pages' parts, which the part LRU may take from a page that stays cached: a hit ends where
the pages its window reads all have parts (``hostkv.vllm.window``), the borrow reads the
held pages' parts again against the blocks vLLM gave (a needed part gone in between fails
the whole load), and the metadata names each load's and save's parts. A save writes a
page's window layers into its part, or, for a page that got none, skips them (the page is
committed without them; no hit needs them). A borrowed prefix stays locked until the
request's release, so its parts cannot go before the load is over.

A model with recurrent-state layers (Mamba, linear attention) has a state group: a hit must
end at a page holding the state, the state is loaded into the hit's last block, and a page
is saved with the state vLLM offered for its end in that step, or without one
(``hostkv.vllm.state`` says the protocol).
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Deque, Dict, List, NamedTuple, Optional, Set, Tuple

import numpy as np
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from hostkv._tokens import as_tokens
from hostkv.cache import HostKVCache, PrefixMatch
from hostkv.vllm.groups import NULL_BLOCK, real_blocks
from hostkv.vllm.identity import RequestIdentity, bypass_cause, fields_digest, multimodal_key
from hostkv.vllm.layout import EngineKV
from hostkv.vllm.metadata import HostKVConnectorMetadata, HostKVWorkerMetadata
from hostkv.vllm.metrics import TIER_COUNTERS, Counters, Failures
from hostkv.vllm.settings import HostKVSettings
from hostkv.vllm.state import offered_state_blocks, pages_with_state, state_blocks_to_load
from hostkv.vllm.window import window_hit
from hostkv.worker_view import SequenceRequest, WorkerView

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from hostkv.remote.tier import RemoteLookup, RemoteTier

__all__ = ["SchedulerSide"]

_MAX_REMEMBERED_HASHES = 1 << 20
_MAX_REMOTE_DONE = 1 << 16

logger = logging.getLogger("hostkv.vllm")


def _namespace(base: bytes, cache_salt: Optional[str], lora: str | bytes | None,
               inputs: bytes = b"") -> int:
    """The namespace of a request: the engine's identity (base), its cache salt, its LoRA
    adapter's key and its multimodal items' key (hostkv.vllm.identity), each
    length-prefixed, so that no salt's text can pass for another salt and adapter."""
    digest = fields_digest(base, b"salt", cache_salt or "", b"lora", lora or b"",
                           b"inputs", inputs)
    return int.from_bytes(digest[:8], "little")


class _Req:
    """The scheduler's state of one request that is a hostkv sequence."""

    __slots__ = ("req_id", "request", "seq_id", "namespace", "reused_pages", "blocks",
                 "seq_tokens", "scheduled_upto", "confirmed_upto", "committed_pages",
                 "inflight", "frozen", "recompute_from", "finished")

    def __init__(self, req_id: str, request: Any, seq_id: int, namespace: int,
                 reused_pages: int, seq_tokens: int, blocks: List[List[int]]) -> None:
        self.req_id = req_id
        self.request = request
        self.seq_id = seq_id
        self.namespace = namespace
        self.reused_pages = reused_pages
        self.blocks = blocks                  # vLLM's block table, one list per group
        self.seq_tokens = seq_tokens          # tokens the WorkerView's sequence holds
        self.scheduled_upto = reused_pages    # blocks [0, this) are cached or being saved
        self.confirmed_upto = reused_pages    # blocks [0, this) hold written KV
        self.committed_pages = reused_pages
        # step -> the blocks [start, end) its save covers (None: a load only)
        self.inflight: Dict[int, Optional[Tuple[int, int]]] = {}
        # A failed or lost step: nothing more is saved or committed.
        self.frozen = False
        # The first block vLLM was told is bad: no save until vLLM computes from it again.
        self.recompute_from: Optional[int] = None
        self.finished = False

    def block_slice(self, start: int, end: int) -> List[List[int]]:
        """Blocks [start, end) of every group."""
        return [group[start:end] for group in self.blocks]

    def freeze(self) -> None:
        """Nothing more of this request is saved or committed (a step it took part in
        failed or was lost on some rank)."""
        self.frozen = True

    def bad_from(self, block: int) -> None:
        """vLLM was told that blocks from ``block`` on hold no valid KV: what it computes
        on top of them is not saved until it computes from ``block`` again."""
        if self.recompute_from is None or block < self.recompute_from:
            self.recompute_from = block


class _Load(NamedTuple):
    """A borrowed prefix to copy into the request's blocks at the next step."""

    st: _Req
    pages: List[int]
    blocks: List[List[int]]              # one list per group
    parts: Optional[List[int]] = None    # the pages' window parts (window parts only)


class SchedulerSide:
    """Everything the connector does in vLLM's engine-core (scheduler) process."""

    def __init__(self, cache: HostKVCache, settings: HostKVSettings, block_size: int,
                 namespace_base: bytes, failures: Failures, counters: Counters,
                 tier: Optional["RemoteTier"] = None, tp_world: int = 1,
                 windowed_groups: Tuple[int, ...] = (), async_loads: bool = False,
                 kv: Optional[EngineKV] = None) -> None:
        self.cache = cache
        # The KV-cache groups whose tables hold null blocks (sliding windows, chunked-local
        # attention), and whether hits load asynchronously (several groups: see the module
        # docstring).
        self.windowed_groups = windowed_groups
        # The engine's pages (for their recurrent state: hostkv.vllm.state), its state
        # groups, and the groups whose block lists may name the null block.
        self.kv = kv
        self.state_groups = kv.state_groups if kv is not None else ()
        # Windowed groups' layers live in the pages' window parts.
        self.window_parts = kv is not None and bool(kv.layout.window_layers)
        self.null_groups = kv.null_groups if kv is not None else windowed_groups
        self.async_loads = async_loads
        # Requests whose asynchronous load failed: offered no hit again, so that a load
        # that keeps failing cannot hold them back.
        self.recv_failed_reqs: Dict[str, None] = {}
        if async_loads and settings.async_saves:
            # A finished request would be reported both received and finished sending:
            # vLLM frees its blocks at the first report and fails at the second.
            raise ValueError("hostkv: asynchronous loads with asynchronous saves")
        # Ranks that confirm each step's copies; a step's saves count once all of them did.
        self.tp_world = tp_world
        # step -> (ranks that confirmed it, request ids whose copies failed on any rank)
        self.confirming: Dict[int, Tuple[Set[int], Set[str]]] = {}
        # The remote tier, if any: lookups for prompts that go beyond the host's cache, and
        # the pages this engine commits, written behind (both on the tier's own threads).
        self.tier = tier
        # req_id -> (the lookup, its deadline, when it started, the request's tokens, its
        # namespace, the tokens the host had before it)
        self.remote_pending: Dict[str, Tuple["RemoteLookup", float, float, np.ndarray, int,
                                             int]] = {}
        # Requests whose remote lookup is over (one per request, until it finishes).
        self.remote_done: Dict[str, None] = {}
        self.tier_seen: Dict[str, int] = {}
        self.view = WorkerView(cache)
        self.settings = settings
        self.block_size = block_size
        self.namespace_base = namespace_base
        self.failures = failures
        self.counters = counters
        self.identity = RequestIdentity(counters)
        # vLLM may call the connector from several threads; one lock keeps this side's
        # state and its WorkerView (one per thread, by contract) consistent.
        self.lock = threading.Lock()
        self.seq_ids = itertools.count(1)
        self.lookups: Dict[str, Tuple[int, np.ndarray, int]] = {}
        # Requests whose hit the lookup walked back for missing window parts: the tokens
        # their sequence starts with, so that it borrows no page past the hit (and vLLM's
        # own) and saves the rest anew, which gives the cached pages their parts back.
        self.reuse_caps: Dict[str, int] = {}
        self.reqs: Dict[str, _Req] = {}
        self.retiring: List[_Req] = []
        self.step = 0
        self.steps: Dict[int, List[_Req]] = {}
        # step -> (request, the blocks it loaded in that step), to find who else read
        # them if the load fails.
        self.step_loads: Dict[int, List[Tuple[_Req, List[int]]]] = {}
        # Blocks with no valid KV, by the step they were found in: a request that holds
        # one as computed (a hit on it in vLLM's prefix cache) saves nothing. Kept two
        # steps, the window before vLLM's own cache forgets them.
        self.suspect_blocks: Dict[int, int] = {}
        # vLLM's KVCacheManager (bound by the connector): its prefix cache must drop the
        # blocks hostkv finds without valid KV.
        self.kv_cache_manager: Any = None
        # What the next step's metadata must carry whatever happens (handed over under
        # ``handoff``, a lock never held across a segment call, so that a step built
        # without ``lock`` still reports them): promised loads, bad blocks, finishing
        # requests.
        self.handoff = threading.Lock()
        self.pending_loads: List[_Load] = []
        self.pending_bad: List[int] = []
        # Asynchronous loads that failed before reaching the workers (several groups).
        self.pending_recv_failed: List[str] = []
        # Requests to freeze, found without ``lock`` (a step not planned, a prefix not
        # borrowed); applied before the next plan.
        self.freeze_late: Deque[_Req] = collections.deque()
        # Workers' reports that arrived while ``lock`` was busy, taken at the next call.
        self.reports_late: Deque[Any] = collections.deque()
        # Requests given a new sequence since the last step was built: one vLLM also
        # names preempted in that step was preempted and resumed in one step (its reset
        # of the prefix cache with running requests does that), and keeps the new one.
        self.allocated_since_build: Set[str] = set()
        self.events: List[KVCacheEvent] = []
        # Block hashes this engine stored, oldest first (a dict as an ordered set), capped:
        # a forgotten hash only means no BlockRemoved for it later.
        self.stored_hashes: Dict[Any, None] = {}
        # Finished requests whose blocks vLLM keeps until the workers' saves are over:
        # the next step's metadata names them.
        self.finishing: List[str] = []
        # Requests that finished while the lock was busy (appended without it).
        self.finished_late: Deque[Any] = collections.deque()

    # -- helpers ---------------------------------------------------------------------------------

    def _tokens_and_namespace(self, request: "Request") -> Tuple[np.ndarray, int]:
        ids = request.all_token_ids
        # vLLM hands tokens as a Python list (inside a ConstantList): hostkv reads the
        # ConstantList's own list in one C loop (~1 ns a token), faster than the wrapper's
        # item-by-item protocol. Out-of-range ids raise ValueError: a miss.
        tokens = as_tokens(getattr(ids, "_x", ids))
        return tokens, _namespace(self.namespace_base, request.cache_salt,
                                  self.identity.adapter_key(request.lora_request),
                                  multimodal_key(request))

    def _hash_events(self, st: _Req, start: int, end: int) -> None:
        hashes = list(getattr(st.request, "block_hashes", ()) or ())[start:end]
        if not hashes:
            return
        parent = st.request.block_hashes[start - 1] if start > 0 else None
        self.stored_hashes.update(dict.fromkeys(hashes))
        excess = len(self.stored_hashes) - _MAX_REMEMBERED_HASHES
        if excess > 0:
            for old in list(itertools.islice(self.stored_hashes, excess)):
                del self.stored_hashes[old]
        # The form vLLM's own events publish (bytes, or ints when configured so).
        hashes = [maybe_convert_block_hash(h) for h in hashes]
        parent = maybe_convert_block_hash(parent) if parent is not None else None
        tokens = [int(t) for t in st.request.all_token_ids[start * self.block_size:
                                                           start * self.block_size +
                                                           len(hashes) * self.block_size]]
        lora = st.request.lora_request
        self.events.append(BlockStored(
            block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
            block_size=self.block_size,
            lora_id=lora.lora_int_id if lora is not None else None, medium="CPU",
            lora_name=lora.lora_name if lora is not None else None))

    # -- the connector's scheduler methods ------------------------------------------------------

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> Tuple[Optional[int], bool]:
        if bypass_cause(request) is not None:
            return 0, False              # counted once, in update_state_after_alloc
        req_id = request.request_id
        if req_id in self.recv_failed_reqs:
            return 0, False
        pending = self.remote_pending.get(req_id)
        if pending is not None:
            look, deadline, began, tokens, namespace, before = pending
            if not look.done():
                if time.monotonic() < deadline:
                    return None, False          # vLLM asks again at its next step
                self.counters.add("remote_timeouts", 1)
            elif look.status in ("error", "skipped"):
                self.counters.add("remote_failed", 1)
            self.counters.add("remote_wait_s", time.monotonic() - began)
            del self.remote_pending[req_id]
            self._remote_over(req_id)
        else:
            tokens, namespace = self._tokens_and_namespace(request)
        # A lookup stops one token short of the whole request: vLLM computes at least one.
        limit = (len(tokens) - 1) // self.block_size * self.block_size
        match = self.cache.match_prefix(tokens[:limit], namespace)
        # Pages the cache holds, with or without a state (those past the hit did not leave).
        found = match.num_tokens
        self.reuse_caps.pop(req_id, None)
        if (self.state_groups or self.window_parts) and match.num_tokens:
            # A hit ends at a page that holds the state, and where the pages its window
            # reads have their parts (the pages are not held yet: the borrow reads both
            # again).
            match = PrefixMatch(
                self._whole_hit(match.pages, num_computed_tokens // self.block_size)
                * self.block_size, match.pages)
            cap = max(match.num_tokens, num_computed_tokens // self.block_size * self.block_size)
            if self.window_parts and cap < found:
                self.reuse_caps[req_id] = cap
        if pending is not None:
            if match.num_tokens > pending[5]:
                self.counters.add("remote_hit_tokens", match.num_tokens - pending[5])
        elif (self.tier is not None and req_id not in self.remote_done
              and max(match.num_tokens, num_computed_tokens) < limit
              and not getattr(request, "skip_reading_prefix_cache", False)):
            if self._remote_lookup(req_id, tokens, namespace, match.num_tokens):
                return None, False
        self.lookups[req_id] = (num_computed_tokens, tokens, namespace)
        self.counters.add("lookups", 1)
        self.counters.add("lookup_tokens", len(tokens))
        hashes = getattr(request, "block_hashes", None)
        if self.stored_hashes and hashes:
            # Blocks this engine stored that the lookup no longer finds left the cache.
            gone = [h for h in hashes[found // self.block_size:
                                      limit // self.block_size]
                    if h in self.stored_hashes]
            if gone:
                for h in gone:
                    del self.stored_hashes[h]
                self.events.append(BlockRemoved(
                    block_hashes=[maybe_convert_block_hash(h) for h in gone], medium="CPU"))
        if match.num_tokens <= num_computed_tokens:
            return 0, False
        self.counters.add("hit_tokens", match.num_tokens - num_computed_tokens)
        return match.num_tokens - num_computed_tokens, self.async_loads

    def _whole_hit(self, pages: Any, local: int) -> int:
        """The longest prefix of ``pages``, in pages, that ends at a page with the model's
        state and whose window parts are there from ``local`` on; each walk back only
        shortens it, so they take turns until neither does."""
        count = len(pages)
        while True:
            before = count
            if self.state_groups and count:
                count = self._pages_with_state(pages[:count])
            if self.window_parts and count:
                assert self.kv is not None
                count = window_hit(self.kv, self.cache.page_parts(pages[:count]).tolist(),
                                   local)
            if count == before:
                return count

    def _pages_with_state(self, pages: Any) -> int:
        """How many of a prefix's pages make the longest one ending at a page with the
        model's state (see :func:`hostkv.vllm.state.pages_with_state`)."""
        assert self.kv is not None
        pool = self.cache.pages_array()
        try:
            return pages_with_state(self.kv, pool, pages)
        finally:
            del pool                      # a view left alive would make close() raise

    def _remote_lookup(self, req_id: str, tokens: np.ndarray, namespace: int,
                       local: int) -> bool:
        """Starts the remote tier's lookup of the pages after the host's; True if the
        request should wait for it (False: the tier answered at once, or failed)."""
        assert self.tier is not None
        self.counters.add("remote_lookups", 1)
        try:
            look = self.tier.lookup(tokens, namespace)
        except Exception as exc:          # noqa: BLE001 - fail open: no remote this time
            self.failures.note("remote lookup", exc)
            self.counters.add("remote_failed", 1)
            self._remote_over(req_id)
            return False
        if look.done():
            # Answered without asking the store (breaker open, queue full): no wait.
            if look.status in ("error", "skipped"):
                self.counters.add("remote_failed", 1)
            self._remote_over(req_id)
            return False
        if self.settings.remote_wait == 0:
            # Prefetch only: this request goes on now; what arrives serves later ones.
            self._remote_over(req_id)
            return False
        now = time.monotonic()
        self.remote_pending[req_id] = (look, now + self.settings.remote_wait, now, tokens,
                                       namespace, local)
        return True

    def _remote_over(self, req_id: str) -> None:
        self.remote_done[req_id] = None
        # Forgotten oldest first if vLLM never reports a request's end: it would only
        # look it up again.
        if len(self.remote_done) > _MAX_REMOTE_DONE:
            del self.remote_done[next(iter(self.remote_done))]

    def take_tier_stats(self) -> None:
        """Adds the remote tier's counters since the last call to the connector's."""
        if self.tier is None:
            return
        stats = self.tier.stats()
        now = {key: getattr(stats, field) for key, field in TIER_COUNTERS.items()}
        now["remote_invalid_pages"] = sum(stats.invalid_pages.values())
        for key, value in now.items():
            delta = value - self.tier_seen.get(key, 0)
            if delta > 0:
                self.counters.add(key, delta)
        self.tier_seen = now

    def _publish(self, st: _Req, pages: int) -> None:
        """Queues the pages the sequence newly committed for the remote tier's writer (the
        first time with the prefix it borrowed, whose TTL the writer renews)."""
        assert self.tier is not None
        from hostkv.remote.tier import first_unpublished_page

        first = first_unpublished_page(st.committed_pages, st.reused_pages)
        try:
            self.tier.publish(st.request.all_token_ids[:pages * self.block_size],
                              st.namespace, pages, first, st.reused_pages)
        except Exception as exc:          # noqa: BLE001 - fail open: a future miss elsewhere
            self.failures.note("remote publish", exc)
            self.counters.add("failures", 1)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        cause = bypass_cause(request)
        if cause is not None:
            self.identity.bypassed(request, cause)   # never a sequence: nothing saved
            return
        req_id = request.request_id
        self.remote_pending.pop(req_id, None)
        old = self.reqs.pop(req_id, None)
        if old is not None:
            self._retire(old)            # preempted and now resumed: a fresh sequence
        looked = self.lookups.pop(req_id, None)
        if looked is None:
            tokens, namespace = self._tokens_and_namespace(request)
            local = request.num_computed_tokens
        else:
            local, tokens, namespace = looked
        cap = self.reuse_caps.pop(req_id, None)
        # The sequence starts with the tokens it borrows and one more (an allocation leaves
        # the last page of its tokens to compute); the rest are appended as they are saved
        # (the lookup walked back before pages without window parts).
        seq_tokens = tokens if cap is None else tokens[:cap + 1]
        bs = self.block_size
        block_ids = [list(group) for group in blocks.get_block_ids()]
        local_blocks = local // bs
        promised = (local + num_external_tokens) // bs
        seq_id = next(self.seq_ids)
        try:
            alloc = self.view.allocate_pages_for_sequences_with_prefix(
                [SequenceRequest(seq_id, seq_tokens, namespace)])[0]
        except Exception as exc:          # noqa: BLE001 - fail open: vLLM recomputes
            self.failures.note("allocate", exc)
            self.counters.add("failures", 1)
            if promised > local_blocks:
                self._unloadable(request, None,
                                 [group[local_blocks:promised] for group in block_ids])
            return
        reused = alloc.reused_tokens // bs
        self.counters.add("borrowed_tokens", alloc.reused_tokens)
        st = _Req(req_id, request, seq_id, namespace, reused, len(seq_tokens), block_ids)
        self.reqs[req_id] = st
        self.allocated_since_build.add(req_id)
        load_end = min(reused, promised)
        bad_start = max(load_end, local_blocks)
        if self.state_groups and load_end > local_blocks and (
                self._pages_with_state(alloc.page_table[load_end - 1:load_end]) != 1
                or any(len(st.blocks[g]) < load_end or st.blocks[g][load_end - 1] == NULL_BLOCK
                       for g in self.state_groups)):
            # Held now, the hit's last page holds no state (evicted and saved anew, without
            # one, between lookup and borrow), or vLLM gave no block to load it into. Never
            # a hit without its state.
            bad_start = local_blocks
        load_parts: Optional[List[int]] = None
        if self.window_parts and load_end > local_blocks:
            # Held now: every block vLLM kept of a windowed group is loaded from its page's
            # part, which the part LRU may have taken since the lookup.
            load_parts = self.cache.page_parts(
                alloc.page_table[local_blocks:load_end]).tolist()
            if any(st.blocks[g][i] != NULL_BLOCK and load_parts[i - local_blocks] < 0
                   for g in self.windowed_groups
                   for i in range(local_blocks, min(load_end, len(st.blocks[g])))):
                bad_start = local_blocks
        if self.async_loads and promised > local_blocks:
            if promised > bad_start:
                # Evicted between lookup and borrow: vLLM takes only whole-request
                # failures for a model of several groups, and computes it all.
                self._unloadable(request, st, st.block_slice(local_blocks, promised))
                return
        with self.handoff:
            if load_end > local_blocks:
                blocks = st.block_slice(local_blocks, load_end)
                for g in self.state_groups:
                    blocks[g] = state_blocks_to_load(st.blocks[g], local_blocks, load_end)
                self.pending_loads.append(_Load(
                    st, alloc.page_table[local_blocks:load_end].tolist(), blocks,
                    load_parts))
        if promised > bad_start:
            # Evicted between lookup and borrow: never load what is not held. vLLM
            # recomputes these blocks; until it does, the request's KV rests on them.
            st.bad_from(bad_start)
            self._unloadable(request, st, st.block_slice(bad_start, promised))

    def _unloadable(self, request: "Request", st: Optional[_Req],
                    blocks: List[List[int]]) -> None:
        """Promised blocks that will not be loaded: vLLM computes them. With one group they
        go to vLLM as bad blocks (and leave its prefix cache); with several the request's
        whole asynchronous load is reported failed. Needs only ``handoff``."""
        real = real_blocks(blocks, self.null_groups)
        if self.async_loads:
            self.recv_failed_reqs[request.request_id] = None
            if st is not None:
                # What it later computes rests on nothing hostkv loaded: nothing of this
                # attempt is saved (vLLM frees its blocks and admits it again).
                with self.handoff:
                    self.freeze_late.append(st)
            with self.handoff:
                self.pending_recv_failed.append(request.request_id)
            self.counters.add("bad_blocks", len(real))
            return
        with self.handoff:
            self.pending_bad.extend(real)
        self.counters.add("bad_blocks", len(real))
        self._invalid_in_vllm(real)

    def _invalid_in_vllm(self, blocks: List[int]) -> None:
        """Drops blocks that hold no valid KV from vLLM's prefix cache: vLLM cached them
        when it allocated them, and with the "recompute" policy it keeps them there, so a
        later request could take them as a hit before their owner recomputes them."""
        if self.kv_cache_manager is None or not blocks:
            return
        try:
            self.kv_cache_manager.evict_blocks(set(blocks))
        except Exception as exc:          # noqa: BLE001 - the suspect-block check remains
            self.failures.note("evict_blocks", exc)
            self.counters.add("failures", 1)

    def unheld_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                           num_external_tokens: int) -> None:
        """:meth:`update_state_after_alloc` when it could not run (the lock not had, an
        error): no prefix is held, so every promised block goes to vLLM as bad (or, for a
        model whose loads are asynchronous, the request's load as failed). Needs only
        ``handoff``."""
        req_id = request.request_id
        looked = self.lookups.get(req_id)
        local = looked[0] if looked is not None else request.num_computed_tokens
        bs = self.block_size
        first, promised = local // bs, (local + num_external_tokens) // bs
        old = self.reqs.get(req_id)
        if old is not None:
            with self.handoff:
                # A state this call did not replace: whatever it plans is suspect.
                self.freeze_late.append(old)
        if promised > first:
            self._unloadable(request, None, [list(group)[first:promised]
                                             for group in blocks.get_block_ids()])

    def _take_handoff(self) -> Tuple[int, List[_Load], List[int], List[str], List[str]]:
        """A new step number and what its metadata must carry: (step, loads, bad blocks,
        failed asynchronous loads, finishing requests). Needs only ``handoff``."""
        with self.handoff:
            self.step += 1
            loads, self.pending_loads = self.pending_loads, []
            bad, self.pending_bad = self.pending_bad, []
            recv_failed, self.pending_recv_failed = self.pending_recv_failed, []
            finishing, self.finishing = self.finishing, []
            return self.step, loads, bad, recv_failed, finishing

    def _drop_finished_loads(self, loads: List[_Load], bad: List[int],
                             recv_failed: List[str]) -> List[_Load]:
        """The loads whose requests have not finished. A request that finished before its
        load was sent: its blocks were never loaded, and vLLM may still hold them under
        their hashes (one group: bad blocks), or waits for its load to be reported (an
        asynchronous load: reported failed)."""
        for load in loads:
            if not load.st.finished:
                continue
            if self.async_loads:
                recv_failed.append(load.st.req_id)
            else:
                dropped = real_blocks(load.blocks, self.null_groups)
                bad.extend(dropped)
                self._invalid_in_vllm(dropped)
        return [load for load in loads if not load.st.finished]

    def build_connector_meta(self, out: "SchedulerOutput") -> HostKVConnectorMetadata:
        self._take_late()
        resumed, self.allocated_since_build = self.allocated_since_build, set()
        step, loads, bad, recv_failed, finishing = self._take_handoff()
        try:
            # Once the handoff is taken, any failure must carry what it held (the
            # connector's fallback would find it empty).
            loads = self._drop_finished_loads(loads, bad, recv_failed)
            meta = HostKVConnectorMetadata(
                step=step, loads=[(ld.st.req_id, ld.pages, ld.blocks) for ld in loads],
                bad_blocks=bad, finishing=finishing, recv_failed=recv_failed,
                load_parts={ld.st.req_id: ld.parts for ld in loads if ld.parts is not None})
            meta.segment_id = self.cache.segment_id
            meta.scheduler_lease = self.cache.lease_identity
            self.suspect_blocks = {b: s for b, s in self.suspect_blocks.items()
                                   if s >= step - 2}
            for block in bad:
                self.suspect_blocks[block] = step
            saves = self._plan_saves(out)
        except Exception as exc:          # noqa: BLE001 - fail open, forgetting nothing
            self.failures.note("build_connector_meta", exc)
            self.counters.add("failures", 1)
            return self._unplanned(step, loads, bad, recv_failed, finishing, out)
        involved: Dict[str, _Req] = {}
        for load in loads:
            load.st.inflight[step] = None
            involved[load.st.req_id] = load.st
        if loads:
            self.step_loads[step] = [(load.st, real_blocks(load.blocks, self.null_groups))
                                     for load in loads]
            if not self.async_loads:
                # The loads feed this very step's forward: vLLM must start them before
                # it. It does for the steps that admit a request with external tokens,
                # which is where every load comes from; said here so that no other path
                # can differ.
                out.has_sync_kv_loads = True
        offers = self._state_offers(out)
        for st, end, pages, parts in saves:
            if parts is not None:
                meta.save_parts[st.req_id] = parts
            blocks = st.block_slice(st.scheduled_upto, end)
            for g in self.state_groups:
                blocks[g] = offered_state_blocks(offers.get(st.req_id, ()), g,
                                                 self.block_size, st.scheduled_upto, end)
            meta.saves.append((st.req_id, blocks, pages))
            st.inflight[step] = (st.scheduled_upto, end)
            st.scheduled_upto = end
            involved[st.req_id] = st
        for req_id in getattr(out, "preempted_req_ids", None) or ():
            # Named even when resumed in this step: the workers finish its saves in
            # flight, which read blocks vLLM freed, before the forward.
            meta.preempted.append(req_id)
            if req_id in resumed:
                # Preempted and resumed in this step: update_state_after_alloc retired its
                # old sequence and made the one it goes on with.
                continue
            gone = self.reqs.pop(req_id, None)
            if gone is not None:
                # vLLM freed its blocks; it comes back through update_state_after_alloc.
                self.counters.add("preempted", 1)
                self._retire(gone)
        if involved:
            self.steps[step] = list(involved.values())
        return meta

    def _state_offers(self, out: "SchedulerOutput") -> Dict[str, List[Tuple[int, int, int]]]:
        """vLLM's offers of this step's boundary states, {request: [(group, block,
        boundary)]} (a model without state groups: none)."""
        if not self.state_groups:
            return {}
        state = getattr(out, "kv_connector_block_state", None)
        return dict(getattr(state, "boundary_state_offloads", None) or {})

    def _plan_saves(self, out: "SchedulerOutput"
                    ) -> List[Tuple[_Req, int, List[int], Optional[List[int]]]]:
        """This step's saves: (request, end, pages, their window parts or None) for blocks
        [scheduled_upto, end).
        Changes no state but the blocks vLLM gave and the tokens appended."""
        plans: List[Tuple[_Req, int]] = []
        scheduled = out.num_scheduled_tokens
        for new in out.scheduled_new_reqs:
            st = self.reqs.get(new.req_id)
            if st is not None:
                st.blocks = [list(group) for group in new.block_ids]
                self._plan(st, new.num_computed_tokens,
                           new.num_computed_tokens + scheduled.get(new.req_id, 0), plans)
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self.reqs.get(req_id)
            if st is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if new_blocks is not None:
                if req_id in cached.resumed_req_ids:
                    st.blocks = [list(group) for group in new_blocks]
                else:
                    for group, added in zip(st.blocks, new_blocks):
                        group.extend(added)
            computed = cached.num_computed_tokens[i]
            self._plan(st, computed, computed + scheduled.get(req_id, 0), plans)
        self._append_tokens(plans)
        saves = []
        for st, end in plans:
            if st.frozen or st.seq_tokens < end * self.block_size:
                continue
            pages = self.view.page_table(st.seq_id)[st.scheduled_upto:end].tolist()
            # A sequence's own pages keep their parts until it commits them.
            parts = self.cache.page_parts(pages).tolist() if self.window_parts else None
            if self.windowed_groups and not self._window_holds(st, end, parts):
                st.freeze()
                continue
            saves.append((st, end, pages, parts))
        return saves

    def _window_holds(self, st: _Req, end: int, parts: Optional[List[int]]) -> bool:
        """Whether every windowed group still holds blocks [scheduled_upto, end) of the
        request (with window parts: those of the pages that have a part; the others are
        saved without their window layers). vLLM's own table says (its copy in the
        scheduler output is only what it added): it frees a block once it left the span
        (the window, the current chunk), and gives it to others."""
        if self.kv_cache_manager is not None:
            try:
                live = self.kv_cache_manager.get_block_ids(st.req_id)
            except Exception:             # noqa: BLE001 - a request vLLM does not know
                return False
            st.blocks = [list(group) for group in live]
        start = st.scheduled_upto
        return all(len(st.blocks[g]) >= end
                   and all(block != NULL_BLOCK or (parts is not None and parts[i] < 0)
                           for i, block in enumerate(st.blocks[g][start:end]))
                   for g in self.windowed_groups)

    def _unplanned(self, step: int, loads: List[_Load], bad: List[int],
                   recv_failed: List[str], finishing: List[str],
                   out: "SchedulerOutput") -> HostKVConnectorMetadata:
        """The step's metadata when its copies could not be planned: no copies, every
        promised load reported bad (vLLM recomputes it; or, loaded asynchronously,
        reported failed), the finishing requests kept, and the preempted ones named
        (their saves in flight end before their blocks are reused). Needs only
        ``handoff``."""
        meta = HostKVConnectorMetadata(step=step, bad_blocks=list(bad), finishing=finishing,
                                       preempted=list(getattr(out, "preempted_req_ids", None)
                                                      or ()),
                                       recv_failed=list(recv_failed))
        unloaded = ({b for load in loads for b in real_blocks(load.blocks, self.null_groups)}
                    if not self.async_loads else set())
        with self.handoff:
            for load in loads:
                if self.async_loads:
                    meta.recv_failed.append(load.st.req_id)
                    self.recv_failed_reqs[load.st.req_id] = None
                else:
                    meta.bad_blocks.extend(real_blocks(load.blocks, self.null_groups))
                self.freeze_late.append(load.st)
            # Every request scheduled in this step freezes: the blocks vLLM gave it are
            # not recorded (a later save would copy the wrong blocks into its pages), and
            # one admitted after a load's owner may hold the unloaded blocks as hits.
            for req_id in list(getattr(out, "num_scheduled_tokens", None) or ()):
                scheduled = self.reqs.get(req_id)
                if scheduled is not None:
                    self.freeze_late.append(scheduled)
        if unloaded:
            self.counters.add("bad_blocks", len(unloaded))
            self._invalid_in_vllm(sorted(unloaded))
        return meta

    def meta_without_lock(self, out: "SchedulerOutput") -> HostKVConnectorMetadata:
        """:meth:`build_connector_meta` when the lock was not had: no copies this step,
        and nothing promised is forgotten (see :meth:`_unplanned`). The step has a
        number like any other: the workers confirm it (which tells the scheduler that
        older steps some rank never confirmed were lost), and the scheduler waits for no
        save of it."""
        self.allocated_since_build = set()
        step, loads, bad, recv_failed, finishing = self._take_handoff()
        return self._unplanned(step, loads, bad, recv_failed, finishing, out)

    def _take_late(self) -> None:
        """Applies what happened without the lock: requests finished, prefixes not held,
        reports not taken."""
        while self.finished_late:
            late = self.finished_late.popleft()
            saving = False
            try:
                saving = self.request_finished(late)
            finally:
                if not saving and self.settings.async_saves:
                    # vLLM was told to keep its blocks: the workers must report it, even
                    # if retiring it failed.
                    with self.handoff:
                        self.finishing.append(late.request_id)
        while self.freeze_late:
            self.freeze_late.popleft().freeze()

    def _plan(self, st: _Req, computed_start: int, computed_end: int,
              plans: List[Tuple[_Req, int]]) -> None:
        if st.frozen:
            return
        if st.recompute_from is not None:
            if computed_start > st.recompute_from * self.block_size:
                # Still computing on top of blocks vLLM was told are bad.
                return
            st.recompute_from = None
        if self.suspect_blocks:
            computed = -(-computed_start // self.block_size)
            if any(b in self.suspect_blocks
                   for b in real_blocks(st.block_slice(0, computed), self.null_groups)):
                # It reads, as computed, a block with no valid KV (a prefix-cache hit on
                # a block another request was promised and never got).
                st.freeze()
                return
        # Only blocks whose every token id is known now (asynchronous scheduling may run a
        # step ahead of the sampled tokens) and whose KV is complete after this step.
        end = min(computed_end, st.request.num_tokens) // self.block_size
        end = min([end] + [len(group) for group in st.blocks])
        if end > st.scheduled_upto:
            plans.append((st, end))

    def _append_tokens(self, plans: List[Tuple[_Req, int]]) -> None:
        """Appends the tokens the planned saves need to their sequences, one batched
        WorkerView call per token position (a decode step needs one)."""
        todo = [(st, st.request.all_token_ids[st.seq_tokens:end * self.block_size])
                for st, end in plans if st.seq_tokens < end * self.block_size]
        position = 0
        while todo:
            try:
                self.view.append_tokens([st.seq_id for st, _ in todo],
                                        [int(toks[position]) for _, toks in todo])
            except Exception as exc:      # noqa: BLE001 - fail open: stop caching these
                self.failures.note("append_tokens", exc)
                self.counters.add("failures", 1)
                for st, _ in todo:
                    # The sequence's tokens are no longer known to match the request's.
                    st.freeze()
                return
            for st, _ in todo:
                st.seq_tokens += 1
            position += 1
            todo = [(st, toks) for st, toks in todo if len(toks) > position]

    def update_connector_output(self, output: "KVConnectorOutput") -> None:
        """Takes the workers' reports (and those kept for later): confirms steps, commits
        what every rank wrote, releases retired requests."""
        self._take_failed_recvs(output)
        changed: Dict[int, _Req] = {}
        reports = []
        while self.reports_late:
            reports.append(self.reports_late.popleft())
        reports.append(output.kv_connector_worker_meta)
        for report in reports:
            if not isinstance(report, HostKVWorkerMetadata):
                continue
            for step, rank, failed in report.done:
                ranks, failed_ids = self.confirming.setdefault(step, (set(), set()))
                ranks.add(rank)
                failed_ids.update(failed)
            for step in sorted(self.confirming):
                ranks, failed_ids = self.confirming[step]
                if len(ranks) < self.tp_world:
                    continue
                del self.confirming[step]
                self._confirm(step, failed_ids, changed)
        live = [st for st in changed.values()
                if not st.finished and st.confirmed_upto > st.committed_pages]
        if live:
            self._commit(live)
        if self.retiring:
            done = [st for st in self.retiring if not st.inflight]
            if done:
                self._release(done)

    def _take_failed_recvs(self, output: "KVConnectorOutput") -> None:
        """The asynchronous loads that failed, as vLLM sees them (every rank reported, one
        of them failed; vLLM computes those requests from their first token now): their
        requests are offered no hit again. Read from the output vLLM acts on, never from
        the step reports, which travel apart (a rank's may be lost or come a step later).
        Needs no lock (one dict store a request)."""
        for req_id in getattr(output, "failed_recving", None) or ():
            if req_id in self.reqs:       # (a finished one is forgotten: nothing to keep)
                self.recv_failed_reqs[req_id] = None

    def report_later(self, output: "KVConnectorOutput") -> None:
        """Keeps a report that arrived while the lock was busy for the next call: a step
        whose report is dropped counts as lost, which freezes its requests. The failed
        loads it carries are taken now: vLLM acts on them at once."""
        self._take_failed_recvs(output)
        if output.kv_connector_worker_meta is not None:
            self.reports_late.append(output.kv_connector_worker_meta)

    def _confirm(self, step: int, failed_ids: Set[str], changed: Dict[int, "_Req"]) -> None:
        """Every rank confirmed ``step``: its saves hold written KV, but those that failed."""
        loads = self.step_loads.pop(step, ())
        garbage = {b for st, blocks in loads if st.req_id in failed_ids for b in blocks}
        if garbage and not self.async_loads:
            self._loaded_garbage(garbage, step, changed)
        # (An asynchronous load that failed is the request's alone: vLLM frees its blocks
        # without caching them and computes it from its first token; update_connector_output
        # took it from vLLM's own view of the reports.)
        # Each rank confirms its steps in order: an older step that some rank never
        # confirmed never will be. Its saves are lost, and the steps planned after it may
        # rest on them.
        for older in [s for s in self.confirming if s < step]:
            # A step without copies is in no ``steps``: its partial confirmation too.
            del self.confirming[older]
        for lost in [s for s in self.steps if s < step]:
            self.step_loads.pop(lost, None)
            for st in self.steps.pop(lost):
                st.inflight.pop(lost, None)
                st.freeze()
                changed[st.seq_id] = st
        for st in self.steps.pop(step, ()):
            saved = st.inflight.pop(step, None)
            if st.req_id in failed_ids:
                st.freeze()
            elif saved is not None and not st.frozen:
                start, end = saved
                if start == st.confirmed_upto:
                    st.confirmed_upto = end
                else:
                    st.freeze()          # a range before it was never confirmed
            changed[st.seq_id] = st

    def _loaded_garbage(self, blocks: Set[int], step: int,
                        changed: Dict[int, "_Req"]) -> None:
        """A failed load left blocks without valid KV on some rank: whoever holds them
        (the loading request, and any request that took them as vLLM prefix-cache hits
        since) saves and commits nothing more, and vLLM's prefix cache drops them."""
        for st in list(self.reqs.values()) + self.retiring:
            if not blocks.isdisjoint(real_blocks(st.blocks, self.null_groups)):
                st.freeze()
                changed[st.seq_id] = st
        for block in blocks:
            self.suspect_blocks[block] = max(self.suspect_blocks.get(block, 0), self.step)
        self._invalid_in_vllm(sorted(blocks))

    def _commit(self, states: List[_Req]) -> None:
        try:
            cached = self.view.commit([st.seq_id for st in states],
                                      [st.confirmed_upto * self.block_size for st in states])
        except Exception as exc:          # noqa: BLE001 - fail open: not shared (yet)
            self.failures.note("commit", exc)
            self.counters.add("failures", 1)
            return
        for st, pages in zip(states, cached):
            if pages > st.committed_pages:
                self.counters.add("committed_pages", pages - st.committed_pages)
                try:
                    self._hash_events(st, st.committed_pages, pages)
                    if self.tier is not None:
                        self._publish(st, pages)
                except Exception as exc:  # noqa: BLE001 - the pages are committed anyway
                    self.failures.note("commit events", exc)
                    self.counters.add("failures", 1)
                st.committed_pages = pages

    def _retire(self, st: _Req) -> None:
        st.finished = True
        self.retiring.append(st)
        if not st.inflight:
            self._release([st])

    def _release(self, states: List[_Req]) -> None:
        to_commit = [st for st in states if st.confirmed_upto > st.committed_pages]
        if to_commit:
            self._commit(to_commit)
        try:
            self.view.release([st.seq_id for st in states], commit=False)
        except Exception as exc:          # noqa: BLE001 - retried at the next step
            self.failures.note("release", exc)
            self.counters.add("failures", 1)
            return
        released = {st.seq_id for st in states}
        self.retiring = [st for st in self.retiring if st.seq_id not in released]

    def request_finished(self, request: "Request") -> bool:
        """Retires the request; True if a save of its blocks may still run (vLLM must
        keep them until the workers report the request finished sending). A request whose
        asynchronous load is outstanding vLLM keeps by itself until the load is reported
        (it knows whether it was)."""
        req_id = request.request_id
        self.lookups.pop(req_id, None)
        self.reuse_caps.pop(req_id, None)
        self.remote_pending.pop(req_id, None)
        self.remote_done.pop(req_id, None)
        self.recv_failed_reqs.pop(req_id, None)
        st = self.reqs.pop(req_id, None)
        if st is None:
            return False
        saving = bool(self.settings.async_saves) and any(
            saved is not None for saved in st.inflight.values())
        self._retire(st)
        if saving:
            with self.handoff:
                self.finishing.append(req_id)
        return saving

    def reset_cache(self) -> None:
        """vLLM reset its prefix cache with the connector's (``reset_prefix_cache(
        reset_connector=True)``, a pause with ``clear_cache``), as it does once new weights
        are loaded in place. From now on this engine looks up and saves under namespaces
        that no page written before has (a random epoch: no other engine is known to hold
        the same weights), so it never reads a page of its old weights again; the pages
        stay for other engines, whose weights did not change. Every live request freezes
        (its KV so far may be the old weights' and what follows the new ones'), lookups
        made before are forgotten (a request asks again; one waiting for the remote tier
        goes on without it), and the blocks this engine announced as stored are announced
        removed."""
        self.namespace_base = fields_digest(self.namespace_base, b"reset", os.urandom(16))
        for st in self.reqs.values():
            st.freeze()
        self.lookups.clear()
        self.reuse_caps.clear()
        for req_id in list(self.remote_pending):
            # Its pages arrive under the old namespace: the request goes on without them.
            self._remote_over(req_id)
        self.remote_pending.clear()
        if self.stored_hashes:
            # Routers that follow KV events must not send this engine requests for blocks
            # it can no longer read.
            self.events.append(BlockRemoved(
                block_hashes=[maybe_convert_block_hash(h) for h in self.stored_hashes],
                medium="CPU"))
            self.stored_hashes.clear()
        logger.info("hostkv: the prefix cache was reset (new weights?): this engine reads "
                    "and writes pages under a new namespace from now on")

    def finish_later(self, request: "Request") -> bool:
        """A request that finished while this side could not look (lock busy, error):
        retired at the next step (its sequence is released then), and with asynchronous
        saves vLLM keeps its blocks until the workers report it (they do at once if no
        save of it runs). Safe without the lock."""
        self.finished_late.append(request)
        return bool(self.settings.async_saves)

    def take_events(self) -> List[KVCacheEvent]:
        events, self.events = self.events, []
        return events

    def shutdown(self) -> None:
        try:
            if self.tier is not None:
                self.tier.close()         # queued writes are dropped (counted)
            self.view.close()
        finally:
            self.cache.close()

