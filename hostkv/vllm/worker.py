"""The connector's worker side: each step's copies between vLLM's KV blocks and the pages.

One runs in every vLLM worker process (one per tensor-parallel rank). It maps the worker's
per-layer KV tensors onto the pool once (a :class:`hostkv.copy_engine.CopyEngine`, its
slice of the heads), copies what the scheduler's metadata says, and reports each step back
with its rank, so the scheduler commits a page only after every rank saved its slice.

Saves are submitted after the forward and finish beside the next steps (``async_saves``):
a step is reported once its copies are over, steps in order. A finished request whose
saves still run keeps its blocks (the scheduler told vLLM so) until this worker reports
it finished sending; a preempted one's saves are waited for before the blocks are reused.

A model of several KV-cache groups (``hostkv.vllm.groups``) loads asynchronously: each
load's request is reported received once its copies are over, and failed as well if they
failed or could not run (vLLM takes no block-level load errors for such a model).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Deque, Dict, List, Optional, Set, Tuple

import torch

from hostkv.cache import HostKVCache
from hostkv.errors import IncompatibleSegmentError
from hostkv.vllm.groups import GroupCopies, GroupTransfer, real_blocks
from hostkv.vllm.layout import EngineKV, describe_layout
from hostkv.vllm.metadata import HostKVConnectorMetadata
from hostkv.vllm.metrics import Counters, Failures

__all__ = ["WorkerSide"]


@dataclasses.dataclass
class _StepCopies:
    """One step's copies on this worker, until they are over and reported."""

    step: int
    save: Optional[GroupTransfer]
    load: Optional[GroupTransfer]
    failed: Set[str]               # requests whose copies failed
    saving: List[str]              # requests whose blocks the save reads
    pages: int
    loading: List[str] = dataclasses.field(default_factory=list)  # requests loaded
    loaded_blocks: List[int] = dataclasses.field(default_factory=list)


class WorkerSide:
    """Everything the connector does in a vLLM worker process: the copies.

    Args:
        cache: This process's handle on the segment.
        kv: The engine's KV cache as hostkv pages.
        rank: This worker's tensor-parallel rank.
        failures, counters: The connector's.
    """

    def __init__(self, cache: HostKVCache, kv: EngineKV, rank: int, failures: Failures,
                 counters: Counters, async_saves: bool = False) -> None:
        self.cache = cache
        self.kv = kv
        self.rank = rank
        self.heads = kv.heads_of_rank(rank)
        self.failures = failures
        self.counters = counters
        self.engine: Optional[GroupCopies] = None
        self.bad_blocks: Set[int] = set()
        self.done: List[Tuple[int, int, List[str]]] = []
        self.load_failed: Set[str] = set()
        self.prefaulted = 0
        self.registered = 0
        self.register_failed = False
        self.copy_calls = 0
        self.async_saves = async_saves
        # A model with a windowed group: loads are asynchronous, reported per
        # request (see EngineKV.loads_asynchronously).
        self.async_loads = kv.loads_asynchronously
        self.received: Set[str] = set()
        self.recv_failed: Set[str] = set()
        # Steps whose copies are submitted and not yet reported, oldest first.
        self.inflight: Deque[_StepCopies] = collections.deque()
        # req_id -> steps in flight whose save reads its blocks.
        self.saving: Dict[str, int] = {}
        # Requests vLLM keeps the blocks of until their saves are over; then reported.
        self.finishing: Set[str] = set()
        self.finished_sending: Set[str] = set()
        self.loading: Optional[GroupTransfer] = None
        self.loading_reqs: List[str] = []
        self.loading_blocks: List[int] = []
        self.segment_id = cache.segment_id
        self.refused_step = -1
        # The scheduler's lease whose group this worker joined (see _may_copy).
        self.parent: Optional[Tuple[int, int]] = None

    def register_kv_caches(self, kv_caches: Dict[str, torch.Tensor]) -> None:
        """Maps vLLM's per-layer KV tensors onto the pages (start-up: raises, naming the
        backend and the shape it cannot map); tensors registered before are let go first."""
        kv = self.kv
        unknown = sorted(set(kv_caches) - set(kv.layer_names))
        missing = [name for name in kv.layer_names if name not in kv_caches]
        if unknown or missing:
            raise ValueError(f"hostkv: vLLM registered KV caches for layers {sorted(kv_caches)}"
                             f"; its KV-cache spec names {list(kv.layer_names)}")
        if self.engine is not None:
            # Registered again without an unregister (vLLM's restore after a remap): the
            # old tensors' copies finish, and the old engine lets the pool's CUDA
            # registration go, which the new one takes.
            self.unregister_kv_caches()
        first, stop, writes = self.heads
        # The first K/V tensor, for messages (a state layer's cache is a list of tensors).
        named = next((name for name in kv.layer_names
                      if isinstance(kv_caches[name], torch.Tensor)), kv.layer_names[0])
        tensors = [kv_caches[named] if isinstance(kv_caches[named], torch.Tensor)
                   else torch.empty(0)]
        try:
            engine = GroupCopies(self.cache.pages_tensor(), kv, kv_caches, heads=(first, stop),
                                 writes=writes, asynchronous=self.async_saves, rank=self.rank,
                                 parts_pool=(self.cache.parts_tensor()
                                             if kv.layout.window_layers else None))
        except ValueError as exc:
            if str(exc).startswith("hostkv: state layer"):
                # StateCopies names the state layer it refused, and what it saw.
                raise
            raise ValueError(
                f"hostkv: {kv.backend}'s KV cache (layer {named!r}: shape "
                f"{tuple(tensors[0].shape)}, stride {tuple(tensors[0].stride())}, "
                f"{tensors[0].dtype}) cannot be mapped onto pages of "
                f"{describe_layout(kv.layout, kv.page_size)} (KV heads [{first}, {stop}) of "
                f"rank {self.rank}): {exc}") from None
        self.engine = engine
        self.copy_calls = 0
        # Off the serving path: this process's first saves into a fresh mapping would
        # otherwise pay a page fault per 4 KiB of the pool.
        self.cache.start_prefault()

    def take_prefault_progress(self) -> None:
        """Adds the pool bytes pre-faulted (and, on a GPU, registered for DMA) since the
        last call to ``prefaulted_bytes`` (``registered_bytes``, ``register_failures``),
        and the copy calls made to ``copy_calls``."""
        done = self.cache.prefault_status().done_bytes
        if done > self.prefaulted:
            self.counters.add("prefaulted_bytes", done - self.prefaulted)
            self.prefaulted = done
        if self.engine is not None:
            calls = self.engine.copy_calls()
            if calls > self.copy_calls:
                self.counters.add("copy_calls", calls - self.copy_calls)
                self.copy_calls = calls
        registration = self.engine.registration() if self.engine is not None else None
        if registration is not None:
            if registration.registered_bytes > self.registered:
                self.counters.add("registered_bytes",
                                  registration.registered_bytes - self.registered)
                self.registered = registration.registered_bytes
            if registration.failed and not self.register_failed:
                self.register_failed = True
                self.counters.add("register_failures", 1)

    def unregister_kv_caches(self) -> None:
        """vLLM is remapping its KV tensors (sleep mode): no copy may touch the old ones."""
        self.drain()
        if self.engine is not None:
            self.engine.close()
        self.engine = None

    def _engine(self) -> GroupCopies:
        if self.engine is None:
            raise RuntimeError("vLLM's KV caches are not registered (asleep?)")
        return self.engine

    def _may_copy(self, meta: HostKVConnectorMetadata, saves: bool) -> bool:
        """Whether this step's copies may run; when not, it is counted once a step and
        logged once a cause.

        Not into another segment than the scheduler's (the name was unlinked and made
        again between their opens: its page numbers mean nothing here). Not before this
        worker joined the scheduler's lease group, so that a dead scheduler's pages stay
        quarantined while this worker may still write them. No saves once the scheduler's
        lease is dead (one probe of its mutex, no lock)."""
        theirs = getattr(meta, "segment_id", 0)
        lease = getattr(meta, "scheduler_lease", None)
        try:
            if theirs and theirs != self.segment_id:
                raise IncompatibleSegmentError(
                    f"the scheduler's segment {self.cache.name!r} has id {theirs:#x}, this "
                    f"worker mapped id {self.segment_id:#x} (unlinked and made again "
                    "between their opens): this worker copies nothing")
            if lease is not None:
                lease = (int(lease[0]), int(lease[1]))
                if lease != self.parent and lease != self.cache.lease_identity:
                    if not self.cache.join_lease_group(*lease):
                        raise IncompatibleSegmentError(
                            f"the scheduler's lease {lease} is gone: this worker copies "
                            "nothing of its")
                    self.parent = lease
                elif saves and lease == self.parent and not self.cache.lease_alive(*lease):
                    raise IncompatibleSegmentError(
                        f"the scheduler's lease {lease} is dead: this worker saves nothing")
        except Exception as exc:          # noqa: BLE001 - fail open: no copies
            if self.refused_step != meta.step:
                self.refused_step = meta.step
                self.failures.note("copies refused", exc)
                self.counters.add("failures", 1)
            return False
        return True

    def _real_blocks(self, groups: List[List[int]]) -> List[int]:
        """Every block of every group but a windowed or state group's null blocks."""
        return real_blocks(groups, self.kv.null_groups)

    def _loads_failed(self, req_ids: Set[str], blocks: List[int]) -> None:
        """Loads that failed or could not run: their blocks go to vLLM as load errors
        (it recomputes them), or, loaded asynchronously, their requests as received and
        failed (it computes them whole)."""
        self.load_failed |= req_ids
        if self.async_loads:
            self.recv_failed |= req_ids
            self.received |= req_ids
        else:
            self.bad_blocks.update(blocks)

    def start_load_kv(self, meta: HostKVConnectorMetadata) -> None:
        """Copies this step's borrowed pages into their blocks (before the forward; on a
        GPU they are enqueued, and the forward's stream waits for every layer's, without
        the host waiting)."""
        self.bad_blocks.update(meta.bad_blocks)
        self.finishing.update(meta.finishing)
        if meta.recv_failed:
            self.recv_failed.update(meta.recv_failed)
            self.received.update(meta.recv_failed)
        self.load_failed = set()
        self.loading = None
        self.loading_reqs = []
        self.loading_blocks = []
        if not meta.loads:
            return
        req_ids = {req_id for req_id, _, _ in meta.loads}
        pages = [p for _, ps, _ in meta.loads for p in ps]
        blocks = [[b for _, _, bs in meta.loads for b in bs[g]]
                  for g in range(len(self.kv.groups))]
        real = self._real_blocks(blocks)
        if not self._may_copy(meta, saves=False):
            # Its loads are recomputed, and nothing of these requests is committed.
            self._loads_failed(req_ids, real)
            return
        start = time.perf_counter()
        try:
            if self.kv.layout.window_layers:
                # (A load without its parts fails at the copy: it reads window layers.)
                parts = [q for req_id, ps, _ in meta.loads
                         for q in meta.load_parts.get(req_id, [-1] * len(ps))]
                transfer = self._engine().submit_load(pages, blocks, parts)
            else:
                transfer = self._engine().submit_load(pages, blocks)
        except Exception as exc:          # noqa: BLE001 - fail open: vLLM recomputes
            self.failures.note("load", exc)
            self.counters.add("failures", 1)
            self._loads_failed(req_ids, real)
            return
        self.loading = transfer
        self.loading_reqs = sorted(req_ids)
        self.loading_blocks = real
        # Every step, the forward waits for every layer's load before it starts: vLLM
        # replays a full CUDA graph (FULL_AND_PIECEWISE, for uniform-decode batches)
        # without running the per-layer hooks, so a wait left to wait_for_layer_load is
        # skipped on exactly those steps. On a GPU this orders the compute stream after
        # the load stream's last event; the host does not block.
        transfer.wait_all_layers()
        self.counters.add("load_s", time.perf_counter() - start)
        if self.rank == 0:                # pages once per engine; bytes as every rank moved
            self.counters.add("loaded_pages", len(pages))
        self.counters.add("loaded_bytes", transfer.nbytes)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing: :meth:`start_load_kv` already ordered the forward after every layer's
        load, since a full CUDA graph's replay never calls this."""

    def wait_for_save(self, meta: HostKVConnectorMetadata) -> None:
        """Submits this step's saves of computed blocks into their reserved pages; the
        step is reported once its copies are over (:meth:`poll`)."""
        failed = set(self.load_failed)
        saves = [s for s in meta.saves if s[0] not in self.load_failed]
        if saves and not self._may_copy(meta, saves=True):
            failed |= {req_id for req_id, _, _ in saves}
            saves = []
        transfer: Optional[GroupTransfer] = None
        saving: List[str] = []
        pages = 0
        if saves:
            try:
                # (Inside: the step is reported whatever fails here, or its loads' and
                # saves' requests would wait for a report forever.)
                blocks = [[b for _, bs, _ in saves for b in bs[g]]
                          for g in range(len(self.kv.groups))]
                page_ids = [p for _, _, ps in saves for p in ps]
                if self.kv.layout.window_layers:
                    # A save without its parts would leave the parts its pages have
                    # unwritten, and a commit vouches for them: refused, never guessed.
                    missing = [req_id for req_id, _, ps in saves
                               if len(meta.save_parts.get(req_id, ())) != len(ps)]
                    if missing or len({req_id for req_id, _, _ in saves}) != len(saves):
                        raise ValueError(f"hostkv: saves {missing or saves} lack their "
                                         "window parts (or name a request twice)")
                    parts = [q for req_id, _, ps in saves for q in meta.save_parts[req_id]]
                    transfer = self._engine().submit_save(blocks, page_ids, parts)
                else:
                    transfer = self._engine().submit_save(blocks, page_ids)
            except Exception as exc:      # noqa: BLE001 - fail open: nothing is committed
                self.failures.note("save", exc)
                self.counters.add("failures", 1)
                failed |= {req_id for req_id, _, _ in saves}
            else:
                saving = sorted({req_id for req_id, _, _ in saves})
                pages = len(page_ids)
                for req_id in saving:
                    self.saving[req_id] = self.saving.get(req_id, 0) + 1
        if meta.step > 0:
            # Every step is reported, copies or not: a later step's report is how the
            # scheduler learns that an older one's was lost, and releases what waited
            # for it.
            self.inflight.append(_StepCopies(meta.step, transfer, self.loading, failed,
                                             saving, pages, self.loading_reqs,
                                             self.loading_blocks))
        self.loading = None
        self.loading_reqs = []
        self.loading_blocks = []
        self.load_failed = set()
        if not self.async_saves:
            self.drain()
        self.poll()

    def poll(self) -> None:
        """Reports the steps whose copies are over, oldest first, and the finishing
        requests whose saves are all over."""
        while self.inflight:
            head = self.inflight[0]
            if head.save is not None and not head.save.done():
                break
            if head.load is not None and not head.load.done():
                break
            self.inflight.popleft()
            if head.load is not None and head.load.error is not None:
                # Found after the forward: vLLM still recomputes the blocks (it takes
                # load errors after the step), and the scheduler commits nothing that
                # rests on them.
                self.failures.note("load", head.load.error)
                self.counters.add("failures", 1)
                head.failed |= set(head.loading)
                if self.async_loads:
                    self.recv_failed |= set(head.loading)
                else:
                    self.bad_blocks.update(head.loaded_blocks)
            if head.load is not None and self.async_loads:
                self.received |= set(head.loading)
            save = head.save
            if save is not None:
                if save.error is not None:
                    self.failures.note("save", save.error)
                    self.counters.add("failures", 1)
                    head.failed |= set(head.saving)
                else:
                    self.counters.add("save_s", save.seconds)
                    if self.rank == 0:
                        self.counters.add("saved_pages", head.pages)
                    self.counters.add("saved_bytes", save.nbytes)
            for req_id in head.saving:
                left = self.saving[req_id] - 1
                if left:
                    self.saving[req_id] = left
                else:
                    del self.saving[req_id]
            self.done.append((head.step, self.rank, sorted(head.failed)))
        over = {req_id for req_id in self.finishing if req_id not in self.saving}
        if over:
            self.finishing -= over
            self.finished_sending |= over

    def drain(self) -> None:
        """Waits for every copy in flight, then reports (preemption, sleep, shutdown)."""
        for steps in self.inflight:
            for transfer in (steps.save, steps.load):
                if transfer is not None:
                    transfer.wait()
        self.poll()

    def handle_preemptions(self, meta: HostKVConnectorMetadata) -> None:
        """vLLM gives preempted requests' blocks to others in this step: their saves
        must be over before the forward writes those blocks."""
        if any(req_id in self.saving for req_id in meta.preempted):
            self.drain()

    def take_finished_sending(self) -> Set[str]:
        """The finishing requests whose saves are over since the last call."""
        self.poll()
        over, self.finished_sending = self.finished_sending, set()
        return over

    def take_received(self) -> Tuple[Set[str], Set[str]]:
        """(received, failed): the requests whose asynchronous loads are over since the
        last call, and those of them that failed (every failed one is also received)."""
        self.poll()
        received, self.received = self.received, set()
        failed, self.recv_failed = self.recv_failed & received, self.recv_failed - received
        return received, failed

    def shutdown(self) -> None:
        """Lets the copies in flight finish, drops the views of the pool and detaches."""
        if self.engine is not None:
            self.drain()
            self.engine.close()
        self.engine = None
        self.cache.close()
