"""HostKVConnector: vLLM's V1 KV-connector API over a hostkv segment (the facade).

Construction reads vLLM's config (``hostkv.vllm.layout``) and builds the scheduler side
(``hostkv.vllm.scheduler``) in the engine-core process or the worker side
(``hostkv.vllm.worker``) in each worker; every serving-path method below goes through
:meth:`HostKVConnector._guarded`, which fails open.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Optional, Set, Tuple, TypeVar

import torch
from vllm.distributed.kv_events import KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from hostkv.vllm.identity import engine_identity, hf_config_as_loaded
from hostkv.vllm.layout import describe_layout, engine_kv, open_segment
from hostkv.vllm.metadata import HostKVConnectorMetadata, HostKVWorkerMetadata
from hostkv.vllm.metrics import COUNTERS, Counters, Failures, HostKVConnectorStats, HostKVPromMetrics
from hostkv.vllm.scheduler import SchedulerSide
from hostkv.vllm.settings import HostKVSettings
from hostkv.vllm.timing import PhaseClock
from hostkv.vllm.worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["HostKVConnector"]

logger = logging.getLogger("hostkv.vllm")

_T = TypeVar("_T")


def _tensor_parallel_rank() -> Optional[int]:
    """This worker's tensor-parallel rank; None outside a parallel group."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except (AssertionError, ImportError):
        return None


class HostKVConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM V1 KV connector over a hostkv segment shared by every engine on the host.

    See the module docstring for the flow and ``HostKVSettings`` for the
    ``kv_connector_extra_config`` keys. It takes part in vLLM's hybrid KV-cache manager
    (``SupportsHMA``): full-attention, sliding-window, chunked-local and recurrent-state
    groups (``hostkv.vllm.groups``, ``hostkv.vllm.state``). Construction (engine start-up)
    raises on a bad config or a segment of another layout; every serving-path method fails
    open.
    """

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig") -> None:
        """Attaches (or creates) the segment for this engine's scheduler or worker.

        Raises:
            ValueError: a bad ``kv_connector_extra_config`` or a KV cache hostkv cannot hold
                (the message names what it saw).
            IncompatibleSegmentError: the segment holds another layout and live engines
                use it.
        """
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        settings = HostKVSettings.from_extra_config(
            self._kv_transfer_config.kv_connector_extra_config)
        if settings.async_saves is None:
            # A GPU's copies run on its DMA engines beside the compute; a CPU's copy thread
            # would only take turns with the forward on the same cores.
            device = getattr(getattr(vllm_config, "device_config", None), "device_type", "")
            settings = dataclasses.replace(settings, async_saves=device not in ("cpu", ""))
        self._settings = settings
        kv = engine_kv(vllm_config, kv_cache_config, window_parts=settings.window_parts)
        self._kv = kv
        if kv.null_groups and settings.async_saves:
            # vLLM frees a windowed group's block once it left the span, and may hand a
            # state block to another request, at the next step: a save still reading it
            # would read their KV.
            logger.warning("hostkv: the model has sliding-window, chunked-local or "
                           "recurrent-state KV-cache groups: saves are synchronous "
                           "(async_saves off)")
            self._settings = settings = dataclasses.replace(settings, async_saves=False)
        rank = 0
        if role != KVConnectorRole.SCHEDULER:
            rank = _tensor_parallel_rank()
            if rank is None:
                if kv.tp_world > 1:
                    # Copying another rank's heads as rank 0's would load wrong KV.
                    raise RuntimeError(f"hostkv: the worker's connector is made outside "
                                       f"vLLM's tensor-parallel group ({kv.tp_world} ranks): "
                                       "its rank, and so its KV heads, are unknown")
                rank = 0
        layout = kv.layout
        self._failures = Failures()
        self._counters = Counters()
        self._clock = PhaseClock(self._counters)
        self._cache = open_segment(self._settings, layout, kv.page_size)
        if role == KVConnectorRole.SCHEDULER:
            logger.info("hostkv: segment %r, pages of %s%s", self._settings.segment,
                        describe_layout(layout, kv.page_size),
                        f"; {kv.parts_description()}" if kv.parts_description() else "")
        self._sched: Optional[SchedulerSide] = None
        self._worker: Optional[WorkerSide] = None
        # vLLM's KV tensors as last registered: vLLM 0.33's restore_kv_caches() names none.
        self._registered: Optional[Dict[str, torch.Tensor]] = None
        if role == KVConnectorRole.SCHEDULER:
            # vLLM 0.32 fails a request whose external blocks failed to load unless the
            # policy is "recompute"; for a cache, a block evicted between lookup and borrow
            # is a miss to recompute, never an error for the user.
            if getattr(self._kv_transfer_config, "kv_load_failure_policy",
                       "recompute") != "recompute":
                try:
                    self._kv_transfer_config.kv_load_failure_policy = "recompute"
                except Exception:         # noqa: BLE001 - a frozen config: say so
                    logger.warning("hostkv: set kv_load_failure_policy to 'recompute' in "
                                   "--kv-transfer-config, or a page evicted between lookup "
                                   "and load fails its request")
            tier = None
            if self._settings.remote is not None:
                # Only the scheduler talks to the tier: it looks prompts up and publishes
                # what the workers saved; the workers only copy pages of the host segment.
                from hostkv.remote.tier import RemoteTier

                try:
                    tier = RemoteTier(self._cache, self._settings.remote)
                except BaseException:
                    # A tier that failed half way may still pin the pool until it is
                    # collected: the close can wait, the cause must show.
                    with contextlib.suppress(BufferError):
                        self._cache.close()
                    raise
                logger.info("hostkv: remote tier %s (key prefix %r)",
                            self._settings.remote.redacted_url,
                            self._settings.remote.key_prefix)
                # The tier writes fetched pages into the pool from this process.
                self._cache.start_prefault()
            # Only the scheduler keys requests, so only it fingerprints the checkpoint.
            identity = engine_identity(vllm_config, layout, self._settings.namespace,
                                       kv.parts_description(),
                                       hf_config_as_loaded(vllm_config.model_config))
            self._sched = SchedulerSide(self._cache, self._settings, kv.page_size,
                                        identity, self._failures, self._counters,
                                        tier, tp_world=kv.tp_world,
                                        windowed_groups=kv.windowed_groups,
                                        async_loads=kv.loads_asynchronously, kv=kv)
        else:
            self._worker = WorkerSide(self._cache, kv, rank,
                                      self._failures, self._counters,
                                      async_saves=bool(self._settings.async_saves))

    @property
    def requires_kv_delivery(self) -> bool:
        """A cache: a dropped save is only a future miss."""
        return False

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any = None) -> bool:
        """False: hostkv does not follow sleep mode's remap of the KV cache. vLLM 0.33 asks
        the class (``VllmConfig`` refuses to start an engine with sleep mode on and a
        connector that answers False, naming it); 0.32 never asks. The worker does drop its
        views in :meth:`unregister_kv_caches` and copies nothing until
        :meth:`restore_kv_caches`, but that pair has not run on a vLLM that sleeps, so
        hostkv does not claim it."""
        return False

    def _fail(self, where: str, exc: BaseException) -> None:
        self._failures.note(where, exc)
        self._counters.add("failures", 1)

    def _guarded(self, where: str, default: _T, call: Callable[[SchedulerSide], _T],
                 count_timeout: bool = True,
                 fallback: Optional[Callable[[SchedulerSide], _T]] = None,
                 on_timeout: Optional[Callable[[SchedulerSide], _T]] = None) -> _T:
        """Runs a scheduler-side call under its lock, failing open: a lock not had within
        ``lock_timeout`` or any error is counted and logged once per cause, and the call
        answers ``fallback(sched)`` (which keeps every promise made to vLLM without the
        lock) or else ``default`` (a miss, no copies, nothing committed); ``on_timeout``
        replaces ``fallback`` when the lock was not had."""
        sched = self._sched
        if sched is None:
            return default
        # Every call here runs inside an engine step: its time, lock wait included, is
        # counted by phase (hostkv.vllm.timing), whether it succeeds or fails open.
        start = self._clock.now()
        try:
            if not sched.lock.acquire(timeout=self._settings.lock_timeout):
                if count_timeout:
                    self._fail(where, TimeoutError("connector lock"))
                late = on_timeout or fallback
                return default if late is None else late(sched)
            self._clock.waited(start)
            try:
                return call(sched)
            except Exception as exc:      # noqa: BLE001 - fail open
                self._fail(where, exc)
                return default if fallback is None else fallback(sched)
            finally:
                sched.lock.release()
        finally:
            self._clock.done(where, start)

    # -- worker side ------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Dict[str, torch.Tensor]) -> None:
        """Maps vLLM's per-layer KV tensors onto the pool's pages (start-up: raises)."""
        if self._worker is None:
            raise RuntimeError("hostkv: register_kv_caches on the scheduler's connector")
        self._worker.register_kv_caches(kv_caches)
        self._registered = kv_caches

    def unregister_kv_caches(self) -> None:
        """Forgets vLLM's KV tensors (they are being remapped): nothing copies until
        :meth:`restore_kv_caches`; a step's loads meanwhile are recomputed, its saves
        dropped. Idempotent, as vLLM 0.33's base asks."""
        if self._worker is not None:
            self._worker.unregister_kv_caches()

    def restore_kv_caches(self, kv_caches: Optional[Dict[str, torch.Tensor]] = None) -> None:
        """Maps vLLM's KV tensors again after :meth:`unregister_kv_caches`: the ones given,
        or (vLLM 0.33 passes none: sleep mode keeps the tensors' addresses) the ones last
        registered."""
        if kv_caches is None:
            kv_caches = self._registered
        if kv_caches is not None and self._worker is not None:
            self.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        """Copies this step's borrowed pages into their blocks (before the forward)."""
        if self._worker is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if isinstance(meta, HostKVConnectorMetadata):
            start = self._clock.now()
            try:
                self._worker.start_load_kv(meta)
            finally:
                self._clock.done("start_load_kv", start)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: start_load_kv ordered the whole forward after every
        layer's load (a full CUDA graph's replay never calls this hook)."""
        if self._worker is not None:
            try:
                self._worker.wait_for_layer_load(layer_name)
            except Exception as exc:      # noqa: BLE001 - start_load_kv already waited
                self._fail("wait_for_layer_load", exc)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Finishes the saves of requests vLLM preempted before their blocks are reused."""
        if self._worker is not None and isinstance(kv_connector_metadata,
                                                   HostKVConnectorMetadata):
            start = self._clock.now()
            try:
                self._worker.handle_preemptions(kv_connector_metadata)
            finally:
                self._clock.done("handle_preemptions", start)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: Any, **kwargs: Any) -> None:
        """Nothing per layer: wait_for_save copies every layer at once after the forward."""
        return

    def wait_for_save(self) -> None:
        """Submits this step's saves of computed blocks into their reserved pages (they
        finish beside the next steps unless ``async_saves`` is off)."""
        if self._worker is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if isinstance(meta, HostKVConnectorMetadata):
            start = self._clock.now()
            try:
                self._worker.wait_for_save(meta)
            except Exception as exc:      # noqa: BLE001 - fail open
                self._fail("wait_for_save", exc)
            self._clock.done("wait_for_save", start)

    def get_block_ids_with_load_errors(self) -> Set[int]:
        """Blocks promised as hits that hostkv could not load: vLLM recomputes them."""
        if self._worker is None or not self._worker.bad_blocks:
            return set()
        bad, self._worker.bad_blocks = self._worker.bad_blocks, set()
        return bad

    def get_finished(self, finished_req_ids: Set[str]
                     ) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        """Finished requests whose blocks vLLM kept for hostkv's saves, now over; and
        requests whose asynchronous loads are over (failed ones too: see
        :meth:`get_transfer_results`)."""
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: Set[str]) -> KVConnectorTransferResults:
        """What :meth:`get_finished` answers, with the asynchronous loads that failed
        (vLLM computes those requests from their first token)."""
        results = KVConnectorTransferResults()
        if self._worker is None:
            return results
        start = self._clock.now()
        try:
            results.finished_sending = self._worker.take_finished_sending()
            results.finished_recving, results.failed_recving = self._worker.take_received()
        except Exception as exc:          # noqa: BLE001 - reported at a later step
            self._fail("get_finished", exc)
        finally:
            self._clock.done("get_finished", start)
        return results

    def build_connector_worker_meta(self) -> Optional[KVConnectorWorkerMetadata]:
        """The steps whose copies finished since the last report, and what failed."""
        if self._worker is None:
            return None
        start = self._clock.now()
        try:
            self._worker.poll()
        except Exception as exc:          # noqa: BLE001 - reported at a later step
            self._fail("poll", exc)
        self._clock.done("build_connector_worker_meta", start)
        if not self._worker.done:
            return None
        done, self._worker.done = self._worker.done, []
        return HostKVWorkerMetadata(done=done)

    # -- scheduler side --------------------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        """Keeps vLLM's KV-cache manager: blocks hostkv finds without valid KV leave vLLM's
        prefix cache through it."""
        super().bind_kv_cache_manager(kv_cache_manager)
        if self._sched is not None:
            self._sched.kv_cache_manager = kv_cache_manager

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> Tuple[Optional[int], bool]:
        """Tokens hostkv holds beyond vLLM's local hit (a pure lookup; a miss on error).

        With a remote tier, a prompt that goes beyond what the host holds first starts a
        lookup of the rest there and answers None ("ask again later": vLLM schedules
        other requests meanwhile) until the fetched pages are in the host's segment, or
        ``remote_wait`` seconds have passed, or the lookup failed; then it answers from
        the host's segment like any lookup."""
        miss: Tuple[Optional[int], bool] = (0, False)
        return self._guarded(
            "lookup", miss,
            lambda sched: sched.get_num_new_matched_tokens(request, num_computed_tokens),
            count_timeout=False)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        """Borrows the request's cached prefix and reserves pages for the rest."""
        self._guarded("update_state_after_alloc", None,
                      lambda sched: sched.update_state_after_alloc(request, blocks,
                                                                   num_external_tokens),
                      fallback=lambda sched: sched.unheld_after_alloc(
                          request, blocks, num_external_tokens))

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        """This step's loads and saves, per request. Without the lock, or on an error: no
        copies, every promised load reported bad, nothing else forgotten."""
        return self._guarded("build_connector_meta", HostKVConnectorMetadata(),
                             lambda sched: sched.build_connector_meta(scheduler_output),
                             fallback=lambda sched: sched.meta_without_lock(scheduler_output))

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        """Commits the pages whose saves every rank confirmed; releases finished requests.
        A report that arrives while the lock is busy is taken at the next call."""
        self._guarded("update_connector_output", None,
                      lambda sched: sched.update_connector_output(connector_output),
                      on_timeout=lambda sched: sched.report_later(connector_output))

    def request_finished(self, request: "Request",
                         block_ids: List[int]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        """Releases the request once its last saves are confirmed. True (vLLM keeps its
        blocks) while a save may still read them; the workers report it finished
        sending once those saves are over."""
        sched = self._sched
        if sched is None:
            return False, None
        delay = self._guarded("request_finished", None,
                              lambda s: s.request_finished(request))
        if delay is None:
            # The lock was not had, or the call failed: whether a save still reads the
            # blocks is unknown, so vLLM keeps them until the workers say.
            delay = sched.finish_later(request)
        return delay, None

    def request_finished_all_groups(self, request: "Request", block_ids: Tuple[List[int], ...]
                                    ) -> Tuple[bool, Optional[Dict[str, Any]]]:
        """:meth:`request_finished` for an engine with vLLM's hybrid manager on (hostkv
        keeps the request's blocks itself: it needs none of these)."""
        return self.request_finished(request, list(block_ids[0]) if block_ids else [])

    def reset_cache(self) -> bool:
        """vLLM reset its prefix cache and asks the connector's to go too (after new
        weights): this engine never reads a page it could read before (see
        :meth:`SchedulerSide.reset_cache`). Waits for the connector's lock without a
        timeout, and raises on an error: a reset that did not happen must not pass for
        one."""
        sched = self._sched
        if sched is not None:
            with sched.lock:
                sched.reset_cache()
        return True

    def take_events(self) -> Iterable[KVCacheEvent]:
        """BlockStored for pages this engine put in the cache, BlockRemoved for those it
        found gone (medium "CPU"); they wait for the next call if the lock is busy."""
        if self._sched is None or not self._sched.events:
            return ()
        return self._guarded("take_events", (), lambda sched: sched.take_events(),
                             count_timeout=False)

    def get_kv_connector_stats(self) -> Optional[KVConnectorStats]:
        """Hits, pages and bytes loaded and saved, copy time and failures since last time;
        with a remote tier, its lookups, waits, fetched and written pages and errors."""
        if self._worker is not None:
            try:
                self._worker.take_prefault_progress()
            except Exception as exc:      # noqa: BLE001 - stats never fail a step
                self._fail("prefault stats", exc)
        sched = self._sched
        if sched is not None and sched.tier is not None:
            try:
                sched.take_tier_stats()
            except Exception as exc:      # noqa: BLE001 - stats never fail a step
                self._fail("remote stats", exc)
        return self._counters.take()

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig", metric_types: Dict[Any, Any],
                           labelnames: List[str],
                           per_engine_labelvalues: Dict[int, List[object]]
                           ) -> Optional[KVConnectorPromMetrics]:
        """The connector's counters for vLLM's Prometheus logger (HostKVPromMetrics)."""
        return HostKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[Dict[str, Any]] = None
                                 ) -> Optional[KVConnectorStats]:
        """Rebuilds the stats object from its serialised counters."""
        return HostKVConnectorStats(data=dict(data or {key: 0 for key in COUNTERS}))

    def shutdown(self) -> None:
        """Releases this engine's sequences (without commit) and detaches the segment."""
        try:
            if self._sched is not None:
                self._sched.shutdown()
            elif self._worker is not None:
                self._worker.shutdown()
        except Exception as exc:          # noqa: BLE001 - the dead-lease sweep cleans up
            self._fail("shutdown", exc)

