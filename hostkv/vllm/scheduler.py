"""The connector's scheduler side: lookups, borrows, the step's copies, commits, releases.

It runs in vLLM's engine-core process over one :class:`hostkv.WorkerView`; the workers only
copy (``hostkv.vllm.worker``). A page becomes visible to other engines (committed) only
after every tensor-parallel rank confirmed its save.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from typing import TYPE_CHECKING, Any, Deque, Dict, List, Optional, Set, Tuple

import numpy as np
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from hostkv._tokens import as_tokens
from hostkv.cache import HostKVCache
from hostkv.vllm.identity import RequestIdentity, bypass_cause, fields_digest, multimodal_key
from hostkv.vllm.metadata import HostKVConnectorMetadata, HostKVWorkerMetadata
from hostkv.vllm.metrics import TIER_COUNTERS, Counters, Failures
from hostkv.vllm.settings import HostKVSettings
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
                 "inflight", "stop_saving", "skip_saves_once", "finished")

    def __init__(self, req_id: str, request: Any, seq_id: int, namespace: int,
                 reused_pages: int, seq_tokens: int, blocks: List[int]) -> None:
        self.req_id = req_id
        self.request = request
        self.seq_id = seq_id
        self.namespace = namespace
        self.reused_pages = reused_pages
        self.blocks = blocks
        self.seq_tokens = seq_tokens          # tokens the WorkerView's sequence holds
        self.scheduled_upto = reused_pages    # blocks [0, this) are cached or being saved
        self.confirmed_upto = reused_pages    # blocks [0, this) hold written KV
        self.committed_pages = reused_pages
        self.inflight: Dict[int, Optional[int]] = {}   # step -> save end (None: a load only)
        self.stop_saving = False
        self.skip_saves_once = False
        self.finished = False


class SchedulerSide:
    """Everything the connector does in vLLM's engine-core (scheduler) process."""

    def __init__(self, cache: HostKVCache, settings: HostKVSettings, block_size: int,
                 namespace_base: bytes, failures: Failures, counters: Counters,
                 tier: Optional["RemoteTier"] = None, tp_world: int = 1) -> None:
        self.cache = cache
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
        self.reqs: Dict[str, _Req] = {}
        self.retiring: List[_Req] = []
        self.step = 0
        self.steps: Dict[int, List[_Req]] = {}
        self.pending_loads: List[Tuple[str, List[int], List[int]]] = []
        self.pending_bad: List[int] = []
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
            gone = [h for h in hashes[match.num_tokens // self.block_size:
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
        return match.num_tokens - num_computed_tokens, False

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
        bs = self.block_size
        block_ids = list(blocks.get_block_ids()[0])
        local_blocks = local // bs
        promised = (local + num_external_tokens) // bs
        seq_id = next(self.seq_ids)
        try:
            alloc = self.view.allocate_pages_for_sequences_with_prefix(
                [SequenceRequest(seq_id, tokens, namespace)])[0]
        except Exception as exc:          # noqa: BLE001 - fail open: vLLM recomputes
            self.failures.note("allocate", exc)
            self.counters.add("failures", 1)
            if promised > local_blocks:
                self.pending_bad.extend(block_ids[local_blocks:promised])
                self.counters.add("bad_blocks", promised - local_blocks)
            return
        reused = alloc.reused_tokens // bs
        self.counters.add("borrowed_tokens", alloc.reused_tokens)
        st = _Req(req_id, request, seq_id, namespace, reused, len(tokens), block_ids)
        self.reqs[req_id] = st
        load_end = min(reused, promised)
        if load_end > local_blocks:
            self.pending_loads.append((req_id, alloc.page_table[local_blocks:load_end].tolist(),
                                       block_ids[local_blocks:load_end]))
        if promised > max(load_end, local_blocks):
            # Evicted between lookup and borrow: never load what is not held. vLLM
            # recomputes these blocks; this step's KV of the request rests on them, so
            # none of it is saved.
            bad = block_ids[max(load_end, local_blocks):promised]
            self.pending_bad.extend(bad)
            self.counters.add("bad_blocks", len(bad))
            st.skip_saves_once = True

    def build_connector_meta(self, out: "SchedulerOutput") -> HostKVConnectorMetadata:
        self.step += 1
        step = self.step
        while self.finished_late:
            late = self.finished_late.popleft()
            if not self.request_finished(late):
                # vLLM was told to keep its blocks: the workers must report it.
                self.finishing.append(late.request_id)
        meta = HostKVConnectorMetadata(step=step, loads=self.pending_loads,
                                       bad_blocks=self.pending_bad, finishing=self.finishing)
        self.pending_loads, self.pending_bad, self.finishing = [], [], []
        involved: Dict[str, _Req] = {}
        for req_id, _, _ in meta.loads:
            st = self.reqs.get(req_id)
            if st is not None:
                st.inflight[step] = None
                involved[req_id] = st
        plans: List[Tuple[_Req, int]] = []
        scheduled = out.num_scheduled_tokens
        for new in out.scheduled_new_reqs:
            st = self.reqs.get(new.req_id)
            if st is not None:
                st.blocks = list(new.block_ids[0])
                self._plan(st, new.num_computed_tokens + scheduled.get(new.req_id, 0), plans)
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self.reqs.get(req_id)
            if st is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if new_blocks is not None:
                if req_id in cached.resumed_req_ids:
                    st.blocks = list(new_blocks[0])
                else:
                    st.blocks.extend(new_blocks[0])
            self._plan(st, cached.num_computed_tokens[i] + scheduled.get(req_id, 0), plans)
        self._append_tokens(plans)
        for st, end in plans:
            if st.stop_saving or st.seq_tokens < end * self.block_size:
                continue
            pages = self.view.page_table(st.seq_id)[st.scheduled_upto:end].tolist()
            meta.saves.append((st.req_id, st.blocks[st.scheduled_upto:end], pages))
            st.scheduled_upto = end
            st.inflight[step] = end
            involved[st.req_id] = st
        for req_id in getattr(out, "preempted_req_ids", None) or ():
            meta.preempted.append(req_id)
            st = self.reqs.pop(req_id, None)
            if st is not None:
                # vLLM freed its blocks; it comes back through update_state_after_alloc.
                self.counters.add("preempted", 1)
                self._retire(st)
        if involved:
            self.steps[step] = list(involved.values())
        return meta

    def _plan(self, st: _Req, computed_end: int, plans: List[Tuple[_Req, int]]) -> None:
        if st.skip_saves_once:
            st.skip_saves_once = False
            return
        if st.stop_saving:
            return
        # Only blocks whose every token id is known now (asynchronous scheduling may run a
        # step ahead of the sampled tokens) and whose KV is complete after this step.
        end = min(computed_end, st.request.num_tokens) // self.block_size
        end = min(end, len(st.blocks))
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
                    st.stop_saving = True
                return
            for st, _ in todo:
                st.seq_tokens += 1
            position += 1
            todo = [(st, toks) for st, toks in todo if len(toks) > position]

    def update_connector_output(self, output: "KVConnectorOutput") -> None:
        report = output.kv_connector_worker_meta
        changed: Dict[int, _Req] = {}
        if isinstance(report, HostKVWorkerMetadata):
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

    def _confirm(self, step: int, failed_ids: Set[str], changed: Dict[int, "_Req"]) -> None:
        """Every rank confirmed ``step``: its saves hold written KV, but those that failed."""
        # Each rank confirms its steps in order: an older step that some rank never
        # confirmed never will be, and its saves are lost.
        for lost in [s for s in self.steps if s < step]:
            self.confirming.pop(lost, None)
            for st in self.steps.pop(lost):
                st.inflight.pop(lost, None)
                st.stop_saving = True
                changed[st.seq_id] = st
        for st in self.steps.pop(step, ()):
            end = st.inflight.pop(step, None)
            if st.req_id in failed_ids:
                st.stop_saving = True
            elif end is not None and end > st.confirmed_upto:
                st.confirmed_upto = end
            changed[st.seq_id] = st

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
                self._hash_events(st, st.committed_pages, pages)
                if self.tier is not None:
                    self._publish(st, pages)
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
        keep them until the workers report the request finished sending)."""
        req_id = request.request_id
        self.lookups.pop(req_id, None)
        self.remote_pending.pop(req_id, None)
        self.remote_done.pop(req_id, None)
        st = self.reqs.pop(req_id, None)
        if st is None:
            return False
        saving = bool(self.settings.async_saves) and any(
            end is not None for end in st.inflight.values())
        self._retire(st)
        if saving:
            self.finishing.append(req_id)
        return saving

    def finish_later(self, request: "Request") -> bool:
        """A request that finished while this side could not look (lock busy, error):
        retired at the next step, and vLLM keeps its blocks until the workers report it
        (they do at once if no save of it runs). Safe without the lock."""
        if not self.settings.async_saves:
            return False
        self.finished_late.append(request)
        return True

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

