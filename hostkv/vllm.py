"""HostKVConnector: vLLM's V1 KV-connector API over a hostkv segment.

Several vLLM engines on one host share one cache of KV pages in shared memory, with no
server process: every engine's scheduler and worker processes attach the segment. Load it
with::

    --kv-transfer-config '{"kv_connector": "HostKVConnector",
                           "kv_connector_module_path": "hostkv.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"segment": "NAME"}}'

A hostkv page is one vLLM block (page_size = block_size) of every layer, laid out as
``KVLayout(num_layers, num_kv_heads, head_size, dtype)`` from vLLM's KV-cache spec.

How a request flows (the scheduler side runs in vLLM's engine-core process):

1. ``get_num_new_matched_tokens``: a pure lookup (``match_prefix``) of the request's tokens;
   what lies beyond vLLM's own (local) hit is offered as external tokens.
2. ``update_state_after_alloc``: the request becomes a hostkv sequence
   (``allocate_pages_for_sequences_with_prefix``): it borrows the cached prefix, so no
   process can evict it before it is loaded, and gets private pages for the rest. If the
   borrow found less than was promised (another engine evicted pages in between), the
   missing blocks are reported to vLLM through ``get_block_ids_with_load_errors`` and vLLM
   recomputes them: a page is loaded only if it was verified and held.
3. ``build_connector_meta``: per step, which pages to load into which blocks, and which
   newly computed blocks (prompt or decode) to save into which private pages.
4. The workers copy (``start_load_kv`` before the forward, ``wait_for_save`` after it), in
   one batched index gather/scatter per layer, and report each step back
   (``build_connector_worker_meta``).
5. ``update_connector_output``: the scheduler commits the pages whose save a worker
   confirmed (only then do other engines see them) and releases finished requests.

Across hosts (``"remote": URL`` in the extra config): the scheduler runs a
``hostkv.remote.RemoteTier`` over its segment. In step 1, a prompt that goes beyond what the
host holds starts a lookup of the rest on the tier's fetch thread, and the answer is None
(vLLM's "ask again later": the request waits, others are scheduled) until the fetched pages
are in the host's segment, the lookup failed, or ``remote_wait`` passed; then the lookup
above runs, and the pages are borrowed and loaded like any others (never wrong KV: the tier
checks each value's tokens, layout and checksum before inserting it, and a page is loaded
only if it is held). In step 5, the pages committed are queued to the tier's writer
(write-through on commit). Remote keys use the request's namespace (model, layout, salt,
LoRA, ``namespace``), so they separate exactly as the host's pages do.

Fail open: no error of the cache (a lock timeout, a full pool, a corrupt or missing
segment) leaves a connector method on the serving path; it becomes a miss or a skipped
save, counted in the stats and logged once per cause; a remote tier down or slow costs a
request at most ``remote_wait`` (nothing once its circuit breaker is open), counted too.
Engine start-up (a bad config or remote URL, a segment of another layout) does raise, with
an error that says why.

Only vLLM processes import this module; ``import hostkv`` never needs vLLM or torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Optional, Set, Tuple

import numpy as np
import torch
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.metrics.utils import create_metric_per_engine

from hostkv._tokens import as_tokens
from hostkv._units import parse_size
from hostkv.cache import HostKVCache
from hostkv.config import HostKVConfig, KVLayout
from hostkv.errors import (
    ConfigError,
    IncompatibleSegmentError,
    SegmentExistsError,
    SegmentNotFoundError,
)
from hostkv.remote.config import RemoteConfig, _number
from hostkv.worker_view import SequenceRequest, WorkerView

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from hostkv.remote.tier import RemoteLookup, RemoteTier

__all__ = [
    "HostKVConnector",
    "HostKVConnectorMetadata",
    "HostKVConnectorStats",
    "HostKVPromMetrics",
    "HostKVSettings",
    "HostKVWorkerMetadata",
    "kv_layout_from_spec",
    "open_segment",
    "parse_size",
]

logger = logging.getLogger("hostkv.vllm")

@dataclasses.dataclass(frozen=True)
class HostKVSettings:
    """The connector's keys in ``kv_connector_extra_config``, with their defaults.

    Attributes:
        segment: The segment's name (required); the first engine creates it.
        size: The pool's size when this engine creates the segment: bytes, or a string
            such as ``"8GiB"``. Ignored when ``num_pages`` is set or the segment exists.
        num_pages: The pool's size in pages (one vLLM block of every layer each), 0: use
            ``size``.
        lock_timeout: Seconds a serving-path call waits for the segment's lock before it
            gives up (a miss, or a skipped save).
        ready_timeout: Seconds to wait for a segment that another engine is creating.
        namespace: Extra text mixed into every request's namespace: engines with other
            values never share pages (the model's name, dtype and layout, each request's
            cache_salt and LoRA adapter are always mixed in).
        max_processes: Lease slots when this engine creates the segment (0: hostkv's
            default, 64): each engine takes two to three (scheduler, workers); a remote
            tier shares its process's.
        remote: The remote tier shared by every host (key ``remote``: a URL such as
            ``redis://host:6379/0`` or ``redis+cluster://h1:7000,h2:7000``), None: off.
            Keys ``remote_<field>`` set the other RemoteConfig fields (``remote_key_prefix``,
            ``remote_ttl_seconds``, ``remote_socket_timeout``, ``remote_connect_timeout``,
            ``remote_max_bytes_in_flight``, ...).
        remote_wait: Seconds a request whose prompt goes beyond the host's cache waits
            for the remote tier's answer (vLLM schedules other requests meanwhile); past
            it the request goes on without, and what arrives later serves later requests.
            0: never wait (the lookup still runs, for the requests that follow).
    """

    segment: str
    size: int = 1 << 30
    num_pages: int = 0
    lock_timeout: float = 1.0
    ready_timeout: float = 30.0
    namespace: str = ""
    max_processes: int = 0
    remote: Optional[RemoteConfig] = None
    remote_wait: float = 0.5

    @classmethod
    def from_extra_config(cls, extra: Optional[Dict[str, Any]]) -> "HostKVSettings":
        """Reads and checks ``kv_connector_extra_config``.

        Raises:
            ValueError: a missing segment, an unknown key or a bad value (named); a bad
                remote URL or setting is a ConfigError (a ValueError) naming it.
        """
        extra = dict(extra or {})
        remote_fields = {f"remote_{field.name}": field.name
                         for field in dataclasses.fields(RemoteConfig) if field.name != "url"}
        known = {field.name for field in dataclasses.fields(cls)} | set(remote_fields)
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"hostkv: unknown kv_connector_extra_config keys {unknown}; "
                             f"known: {sorted(known)}")
        if not isinstance(extra.get("segment"), str) or not extra["segment"]:
            raise ValueError("hostkv: kv_connector_extra_config needs 'segment': the name "
                             "of the shared segment")
        values: Dict[str, Any] = {"segment": extra["segment"]}
        if "size" in extra:
            values["size"] = parse_size(extra["size"])
        for key in ("num_pages", "max_processes"):
            if key in extra:
                value = extra[key]
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise ValueError(f"hostkv: {key} must be an integer >= 0, got {value!r}")
                values[key] = value
        for key in ("lock_timeout", "ready_timeout"):
            if key in extra:
                value = extra[key]
                if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                    raise ValueError(f"hostkv: {key} must be seconds > 0, got {value!r}")
                values[key] = float(value)
        if "namespace" in extra:
            values["namespace"] = str(extra["namespace"])
        url = extra.get("remote")
        options = {field: extra[key] for key, field in remote_fields.items() if key in extra}
        if url is None or url == "":
            orphans = sorted(set(extra) & (set(remote_fields) | {"remote_wait"}))
            if orphans:
                raise ConfigError(f"hostkv: {orphans} set without 'remote' (the remote "
                                  "tier's URL)")
        else:
            # RemoteConfig checks the URL and every value, naming it (the password masked).
            try:
                values["remote"] = RemoteConfig(url, **options)
            except ConfigError as exc:
                raise ConfigError(f"hostkv: kv_connector_extra_config 'remote': {exc}") from None
            if "remote_wait" in extra:
                values["remote_wait"] = float(_number(
                    extra["remote_wait"], "hostkv: remote_wait (seconds)", 0, 600, False))
        return cls(**values)


def kv_layout_from_spec(kv_cache_config: "KVCacheConfig") -> Tuple[KVLayout, int, List[str]]:
    """The page layout for vLLM's KV-cache config: (layout, page_size, layer names in order).

    Raises:
        ValueError: a KV cache hostkv cannot hold (several cache groups, as hybrid models
            have; attention other than full attention with K and V of one size; a block
            size that is not a power of two).
    """
    groups = list(kv_cache_config.kv_cache_groups)
    if len(groups) != 1:
        raise ValueError(f"hostkv holds one KV-cache group (full attention in every layer); "
                         f"this model has {len(groups)}")
    spec = groups[0].kv_cache_spec
    # Exactly full attention: its subclasses (MLA, for one) lay blocks out otherwise.
    if not isinstance(spec, FullAttentionSpec) or type(spec) is not FullAttentionSpec:
        raise ValueError(f"hostkv holds full attention with K and V of one head size; the "
                         f"model's KV cache is {type(spec).__name__}")
    head_size_v = getattr(spec, "head_size_v", spec.head_size)
    if head_size_v != spec.head_size:
        raise ValueError(f"hostkv holds K and V of one head size; the model's are "
                         f"{spec.head_size} and {head_size_v}")
    layers = list(groups[0].layer_names)
    dtype = str(spec.dtype).replace("torch.", "")
    layout = KVLayout(num_layers=len(layers), num_kv_heads=spec.num_kv_heads,
                      head_dim=spec.head_size, dtype=dtype)
    block_size = int(spec.block_size)
    if block_size & (block_size - 1):
        raise ValueError(f"hostkv pages hold a power-of-two number of tokens; vLLM's block "
                         f"size is {block_size}")
    return layout, block_size, layers


def _describe_layout(layout: Optional[KVLayout], page_size: int) -> str:
    if layout is None:
        return f"no KV layout, {page_size} tokens a page"
    return (f"{layout.num_layers} layers x {layout.num_kv_heads} KV heads x head_dim "
            f"{layout.head_dim} {layout.dtype}, {page_size} tokens a page")


def open_segment(settings: HostKVSettings, layout: KVLayout, page_size: int) -> HostKVCache:
    """Attaches the segment, or creates it if none exists, atomically across engines.

    Two engines starting at once both try; the create is exclusive, so exactly one wins and
    the other attaches (waiting up to ``ready_timeout`` for the creator to finish).

    Raises:
        IncompatibleSegmentError: the segment holds another layout or page size (the
            message names both).
        HostKVError: the segment could not be created or attached.
    """
    page_bytes = layout.page_bytes(page_size)
    num_pages = settings.num_pages or max(1, settings.size // page_bytes)
    config = HostKVConfig(num_pages=num_pages, page_size=page_size, kv_layout=layout,
                          max_processes=settings.max_processes)
    cache = None
    for _ in range(20):
        try:
            cache = HostKVCache.attach(settings.segment, lock_timeout=settings.lock_timeout,
                                       ready_timeout=settings.ready_timeout)
            break
        except SegmentNotFoundError:
            pass
        try:
            cache = HostKVCache.create(settings.segment, config,
                                       lock_timeout=settings.lock_timeout)
            logger.info("hostkv: created segment %r: %d pages of %d bytes (%s)",
                        settings.segment, num_pages, page_bytes,
                        _describe_layout(layout, page_size))
            break
        except SegmentExistsError:
            # Another engine created it between our attach and create: attach again.
            continue
    if cache is None:
        raise IncompatibleSegmentError(
            f"hostkv: segment {settings.segment!r} kept appearing and vanishing")
    have = cache.config
    if have.kv_layout != layout or have.page_size != page_size:
        cache.close()
        raise IncompatibleSegmentError(
            f"hostkv: segment {settings.segment!r} holds pages of "
            f"{_describe_layout(have.kv_layout, have.page_size)}, but this engine's KV cache "
            f"is {_describe_layout(layout, page_size)}: use another segment for this model")
    return cache


def _namespace(base: bytes, cache_salt: Optional[str], lora: Optional[str]) -> int:
    digest = hashlib.blake2b(base, digest_size=8)
    digest.update(b"\0salt\0" + (cache_salt or "").encode())
    digest.update(b"\0lora\0" + (lora or "").encode())
    return int.from_bytes(digest.digest(), "little")


_MAX_REMEMBERED_HASHES = 1 << 20
_MAX_REMOTE_DONE = 1 << 16


class _Failures:
    """Counts serving-path failures by cause; logs the first of each cause."""

    def __init__(self) -> None:
        self.counts: Dict[str, int] = {}

    def note(self, where: str, exc: BaseException) -> None:
        cause = f"{where}: {type(exc).__name__}"
        count = self.counts.get(cause, 0)
        self.counts[cause] = count + 1
        if count == 0:
            logger.warning("hostkv: %s (%s); the request goes on without the cache (logged "
                           "once per cause, counted in the connector stats)", cause, exc)


# -- what the scheduler tells the workers, and what they answer ---------------------------------


@dataclasses.dataclass
class HostKVConnectorMetadata(KVConnectorMetadata):
    """One step's copies, from the scheduler to the workers.

    Attributes:
        step: The scheduler's step number (the workers confirm steps by it).
        loads: (req_id, hostkv pages, vLLM blocks) to copy pool -> blocks before the forward.
        saves: (req_id, vLLM blocks, hostkv pages) to copy blocks -> pool after the forward.
        bad_blocks: Blocks promised as external hits that hostkv could not hold (evicted
            between lookup and borrow); the workers report them as load errors.
    """

    step: int = 0
    loads: List[Tuple[str, List[int], List[int]]] = dataclasses.field(default_factory=list)
    saves: List[Tuple[str, List[int], List[int]]] = dataclasses.field(default_factory=list)
    bad_blocks: List[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class HostKVWorkerMetadata(KVConnectorWorkerMetadata):
    """Steps the workers finished: (step, request ids whose copies failed)."""

    done: List[Tuple[int, List[str]]] = dataclasses.field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Merges another worker's report: a request failed if it failed anywhere."""
        merged: Dict[int, Set[str]] = {}
        for step, failed in self.done + getattr(other, "done", []):
            merged.setdefault(step, set()).update(failed)
        return HostKVWorkerMetadata(done=[(step, sorted(failed))
                                          for step, failed in sorted(merged.items())])


_COUNTERS = ("lookups", "lookup_tokens", "hit_tokens", "borrowed_tokens", "bad_blocks",
             "loaded_pages", "loaded_bytes", "load_s", "saved_pages", "saved_bytes", "save_s",
             "committed_pages", "preempted", "failures",
             # The remote tier (scheduler side; zero without one). Per request:
             "remote_lookups", "remote_hit_tokens", "remote_wait_s", "remote_timeouts",
             "remote_failed",
             # the tier's own counters (RemoteStats), as increments:
             "remote_fetched_pages", "remote_invalid_pages", "remote_published_pages",
             "remote_written_pages", "remote_writes_dropped", "remote_errors",
             "remote_bytes_down", "remote_bytes_up", "remote_breaker_opens")

# RemoteStats fields whose increments the connector reports, by counter.
_TIER_COUNTERS = {"remote_fetched_pages": "inserted_pages",
                  "remote_published_pages": "published_pages",
                  "remote_written_pages": "written_pages",
                  "remote_writes_dropped": "writes_dropped", "remote_errors": "errors",
                  "remote_bytes_down": "bytes_down", "remote_bytes_up": "bytes_up",
                  "remote_breaker_opens": "breaker_opens"}

_DESCRIPTIONS = {
    "lookups": "Requests looked up in hostkv",
    "lookup_tokens": "Prompt tokens of the requests looked up",
    "hit_tokens": "Prompt tokens hostkv offered beyond vLLM's own prefix cache",
    "borrowed_tokens": "Prompt tokens borrowed from hostkv's pages",
    "bad_blocks": "Blocks promised but evicted before the borrow (recomputed)",
    "loaded_pages": "Pages copied from hostkv into vLLM's blocks",
    "loaded_bytes": "Bytes copied from hostkv into vLLM's blocks",
    "load_s": "Seconds spent copying pages into blocks",
    "saved_pages": "Blocks copied into hostkv's pages",
    "saved_bytes": "Bytes copied into hostkv's pages",
    "save_s": "Seconds spent copying blocks into pages",
    "committed_pages": "Pages this engine made visible to every engine on the host",
    "preempted": "Requests vLLM preempted while they were hostkv sequences",
    "failures": "Serving-path failures that became a miss or a skipped save",
    "remote_lookups": "Requests whose prompt was looked up in the remote tier",
    "remote_hit_tokens": "Prompt tokens the remote tier added to the host's cache for them",
    "remote_wait_s": "Seconds requests waited for the remote tier",
    "remote_timeouts": "Remote lookups that took longer than remote_wait (request went on)",
    "remote_failed": "Remote lookups that failed or were skipped (request went on)",
    "remote_fetched_pages": "Pages fetched from the remote tier into the host's segment",
    "remote_invalid_pages": "Remote values that failed a check (a miss, never loaded)",
    "remote_published_pages": "Committed pages queued for writing to the remote tier",
    "remote_written_pages": "Pages written to the remote tier",
    "remote_writes_dropped": "Pages not written to the remote tier (queue, breaker, errors)",
    "remote_errors": "Remote store calls that failed",
    "remote_bytes_down": "Value bytes received from the remote tier",
    "remote_bytes_up": "Value bytes sent to the remote tier",
    "remote_breaker_opens": "Times the remote tier's circuit breaker opened",
}


@dataclasses.dataclass
class HostKVConnectorStats(KVConnectorStats):
    """Counters since the last report: lookups and hits (scheduler side), pages and bytes
    loaded and saved and the seconds it took (worker side), and failures (both)."""

    def reset(self) -> None:
        """Zeroes every counter."""
        self.data = {key: 0 for key in _COUNTERS}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Adds another report's counters to this one."""
        for key, value in (other.data or {}).items():
            if isinstance(value, (int, float)):
                self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> Dict[str, Any]:
        """The counters, plus load and save throughput in GB/s."""
        out: Dict[str, Any] = {key: self.data.get(key, 0) for key in _COUNTERS}
        for what in ("load", "save"):
            seconds = out[f"{what}_s"]
            moved = out["loaded_bytes" if what == "load" else "saved_bytes"]
            out[f"{what}_GBps"] = round(moved / seconds / 1e9, 3) if seconds else 0.0
        return out

    def is_empty(self) -> bool:
        """True when nothing was counted."""
        return not any(self.data.get(key) for key in _COUNTERS)


class HostKVPromMetrics(KVConnectorPromMetrics):
    """The connector's counters as Prometheus counters ``vllm:hostkv_<counter>_total``,
    per engine, beside vLLM's own (``/metrics`` of ``vllm serve``, ``LLM.get_metrics()``
    when stats are logged)."""

    def __init__(self, vllm_config: "VllmConfig", metric_types: Dict[Any, Any],
                 labelnames: List[str],
                 per_engine_labelvalues: Dict[int, List[object]]) -> None:
        """Registers one counter per key of the connector's stats."""
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {
            key: create_metric_per_engine(
                self._counter_cls(name=f"vllm:hostkv_{key}", documentation=_DESCRIPTIONS[key],
                                  labelnames=labelnames),
                per_engine_labelvalues)
            for key in _COUNTERS}

    def observe(self, transfer_stats_data: Dict[str, Any], engine_idx: int = 0) -> None:
        """Adds one report's counters (all are increments since the last report)."""
        for key, value in (transfer_stats_data or {}).items():
            counter = self.counters.get(key)
            if counter is not None and isinstance(value, (int, float)) and value > 0:
                counter[engine_idx].inc(value)


class _Counters:
    def __init__(self) -> None:
        self.values: Dict[str, float] = {key: 0 for key in _COUNTERS}

    def add(self, key: str, value: float) -> None:
        self.values[key] += value

    def take(self) -> Optional[HostKVConnectorStats]:
        if not any(self.values.values()):
            return None
        stats = HostKVConnectorStats(data=dict(self.values))
        self.values = {key: 0 for key in _COUNTERS}
        return stats


# -- the scheduler side ----------------------------------------------------------------------------


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


class _SchedulerSide:
    """Everything the connector does in vLLM's engine-core (scheduler) process."""

    def __init__(self, cache: HostKVCache, settings: HostKVSettings, block_size: int,
                 namespace_base: bytes, failures: _Failures, counters: _Counters,
                 tier: Optional["RemoteTier"] = None) -> None:
        self.cache = cache
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

    # -- helpers ---------------------------------------------------------------------------------

    def _tokens_and_namespace(self, request: "Request") -> Tuple[np.ndarray, int]:
        ids = request.all_token_ids
        # vLLM hands tokens as a Python list (inside a ConstantList): hostkv reads the
        # ConstantList's own list in one C loop (~1 ns a token), faster than the wrapper's
        # item-by-item protocol. Out-of-range ids raise ValueError: a miss.
        tokens = as_tokens(getattr(ids, "_x", ids))
        lora = request.lora_request.lora_name if request.lora_request is not None else None
        return tokens, _namespace(self.namespace_base, request.cache_salt, lora)

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
        now = {key: getattr(stats, field) for key, field in _TIER_COUNTERS.items()}
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
        meta = HostKVConnectorMetadata(step=step, loads=self.pending_loads,
                                       bad_blocks=self.pending_bad)
        self.pending_loads, self.pending_bad = [], []
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
            for step, failed in report.done:
                failed_ids = set(failed)
                # Steps are confirmed in order: an older unconfirmed one never will be.
                for lost in [s for s in self.steps if s < step]:
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
        live = [st for st in changed.values()
                if not st.finished and st.confirmed_upto > st.committed_pages]
        if live:
            self._commit(live)
        if self.retiring:
            done = [st for st in self.retiring if not st.inflight]
            if done:
                self._release(done)

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

    def request_finished(self, request: "Request") -> None:
        self.lookups.pop(request.request_id, None)
        self.remote_pending.pop(request.request_id, None)
        self.remote_done.pop(request.request_id, None)
        st = self.reqs.pop(request.request_id, None)
        if st is not None:
            self._retire(st)

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


# -- the worker side ----------------------------------------------------------------------------


class _WorkerSide:
    """Everything the connector does in a vLLM worker process: the copies."""

    def __init__(self, cache: HostKVCache, layout: KVLayout, page_size: int,
                 layer_names: List[str], failures: _Failures, counters: _Counters) -> None:
        self.cache = cache
        self.layout = layout
        self.page_size = page_size
        self.layer_index = {name: i for i, name in enumerate(layer_names)}
        self.failures = failures
        self.counters = counters
        pool = cache.pages_tensor()            # [pages, layers, 2, page_size, heads, dim]
        self.pool = pool
        self.pool_by_layer = pool.view(pool.shape[0], layout.num_layers, -1)
        self.pool_by_kv = pool.view(pool.shape[0], layout.num_layers, 2, -1)
        # (vLLM's per-block view of a layer [blocks, n], the pool's [pages, n]) pairs.
        self.parts: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self.page_bytes = layout.page_bytes(page_size)
        self.bad_blocks: Set[int] = set()
        self.done: List[Tuple[int, List[str]]] = []
        self.load_failed: Set[str] = set()

    def register_kv_caches(self, kv_caches: Dict[str, torch.Tensor]) -> None:
        per_layer = self.page_size * self.layout.num_kv_heads * self.layout.head_dim
        parts = []
        for name, kv in kv_caches.items():
            if name not in self.layer_index:
                raise ValueError(f"hostkv: vLLM registered KV cache layer {name!r}, which "
                                 "is not in its KV-cache spec")
            layer = self.layer_index[name]
            if kv.dtype != getattr(torch, self.layout.dtype):
                raise ValueError(f"hostkv: layer {name!r} has dtype {kv.dtype}, the segment "
                                 f"{self.layout.dtype}")
            if kv.dim() >= 2 and kv.shape[1] == 2 and kv[0].numel() == 2 * per_layer:
                # [blocks, 2, block_size, heads * dim] (the CPU backend): K and V of a block
                # are one contiguous run, like a page's layer.
                parts.append((kv.view(kv.shape[0], -1), self.pool_by_layer[:, layer]))
            elif kv.dim() >= 2 and kv.shape[0] == 2 and kv[0, 0].numel() == per_layer:
                # [2, blocks, block_size, heads, dim] (flash attention): K and V apart.
                for half in (0, 1):
                    parts.append((kv[half].reshape(kv.shape[1], -1),
                                  self.pool_by_kv[:, layer, half]))
            else:
                raise ValueError(f"hostkv: layer {name!r} KV cache has shape "
                                 f"{tuple(kv.shape)}, which hostkv cannot map to pages of "
                                 f"{_describe_layout(self.layout, self.page_size)}")
            if parts[-1][0].stride(-1) != 1:
                raise ValueError(f"hostkv: layer {name!r} KV cache blocks are not contiguous")
        if len(kv_caches) != self.layout.num_layers:
            raise ValueError(f"hostkv: vLLM registered {len(kv_caches)} KV cache layers, "
                             f"the spec has {self.layout.num_layers}")
        self.parts = parts

    def _copy(self, pages: List[int], blocks: List[int], to_pool: bool) -> None:
        pages_t = torch.tensor(pages, dtype=torch.int64)
        for cache_part, pool_part in self.parts:
            blocks_t = torch.tensor(blocks, dtype=torch.int64, device=cache_part.device)
            if to_pool:
                pool_part.index_copy_(0, pages_t,
                                      cache_part.index_select(0, blocks_t).to("cpu"))
            else:
                cache_part.index_copy_(0, blocks_t,
                                       pool_part.index_select(0, pages_t).to(cache_part.device))

    def start_load_kv(self, meta: HostKVConnectorMetadata) -> None:
        self.bad_blocks.update(meta.bad_blocks)
        self.load_failed = set()
        if not meta.loads:
            return
        pages = [p for _, ps, _ in meta.loads for p in ps]
        blocks = [b for _, _, bs in meta.loads for b in bs]
        start = time.perf_counter()
        try:
            self._copy(pages, blocks, to_pool=False)
        except Exception as exc:          # noqa: BLE001 - fail open: vLLM recomputes
            self.failures.note("load", exc)
            self.counters.add("failures", 1)
            self.bad_blocks.update(blocks)
            self.load_failed = {req_id for req_id, _, _ in meta.loads}
            return
        self.counters.add("load_s", time.perf_counter() - start)
        self.counters.add("loaded_pages", len(pages))
        self.counters.add("loaded_bytes", len(pages) * self.page_bytes)

    def wait_for_save(self, meta: HostKVConnectorMetadata) -> None:
        failed = sorted(self.load_failed)
        saves = [s for s in meta.saves if s[0] not in self.load_failed]
        if saves:
            blocks = [b for _, bs, _ in saves for b in bs]
            pages = [p for _, _, ps in saves for p in ps]
            start = time.perf_counter()
            try:
                self._copy(pages, blocks, to_pool=True)
                self.counters.add("save_s", time.perf_counter() - start)
                self.counters.add("saved_pages", len(pages))
                self.counters.add("saved_bytes", len(pages) * self.page_bytes)
            except Exception as exc:      # noqa: BLE001 - fail open: nothing is committed
                self.failures.note("save", exc)
                self.counters.add("failures", 1)
                failed = sorted(set(failed) | {req_id for req_id, _, _ in saves})
        if meta.loads or meta.saves:
            self.done.append((meta.step, failed))
        self.load_failed = set()

    def shutdown(self) -> None:
        self.parts = []
        del self.pool, self.pool_by_layer, self.pool_by_kv
        self.cache.close()


class HostKVConnector(KVConnectorBase_V1):
    """vLLM V1 KV connector over a hostkv segment shared by every engine on the host.

    See the module docstring for the flow and ``HostKVSettings`` for the
    ``kv_connector_extra_config`` keys. Construction (engine start-up) raises on a bad
    config or a segment of another layout; every serving-path method fails open.
    """

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig") -> None:
        """Attaches (or creates) the segment for this engine's scheduler or worker.

        Raises:
            ValueError: a bad ``kv_connector_extra_config`` or a KV cache hostkv cannot hold.
            IncompatibleSegmentError: the segment holds another layout.
        """
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        parallel = vllm_config.parallel_config
        if parallel.tensor_parallel_size * parallel.pipeline_parallel_size != 1:
            raise ValueError("hostkv: tensor and pipeline parallelism are not supported yet "
                             f"(tp={parallel.tensor_parallel_size}, "
                             f"pp={parallel.pipeline_parallel_size})")
        self._settings = HostKVSettings.from_extra_config(
            self._kv_transfer_config.kv_connector_extra_config)
        self._layout, self._page_size, layer_names = kv_layout_from_spec(kv_cache_config)
        model = vllm_config.model_config
        self._namespace_base = "\0".join([
            "hostkv-vllm-1", str(model.model), str(getattr(model, "revision", "") or ""),
            self._layout.dtype, str(self._layout.num_layers), str(self._layout.num_kv_heads),
            str(self._layout.head_dim), self._settings.namespace]).encode()
        self._failures = _Failures()
        self._counters = _Counters()
        self._cache = open_segment(self._settings, self._layout, self._page_size)
        self._sched: Optional[_SchedulerSide] = None
        self._worker: Optional[_WorkerSide] = None
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
            self._sched = _SchedulerSide(self._cache, self._settings, self._page_size,
                                         self._namespace_base, self._failures, self._counters,
                                         tier)
        else:
            self._worker = _WorkerSide(self._cache, self._layout, self._page_size,
                                       layer_names, self._failures, self._counters)

    @property
    def requires_kv_delivery(self) -> bool:
        """A cache: a dropped save is only a future miss."""
        return False

    def _fail(self, where: str, exc: BaseException) -> None:
        self._failures.note(where, exc)
        self._counters.add("failures", 1)

    # -- worker side ------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Dict[str, torch.Tensor]) -> None:
        """Maps vLLM's per-layer KV tensors onto the pool's pages (start-up: raises)."""
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        """Copies this step's borrowed pages into their blocks (before the forward)."""
        if self._worker is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if isinstance(meta, HostKVConnectorMetadata):
            self._worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: start_load_kv copies every layer before the forward."""
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: Any, **kwargs: Any) -> None:
        """Nothing per layer: wait_for_save copies every layer at once after the forward."""
        return

    def wait_for_save(self) -> None:
        """Copies this step's computed blocks into their reserved pages."""
        if self._worker is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if isinstance(meta, HostKVConnectorMetadata):
            try:
                self._worker.wait_for_save(meta)
            except Exception as exc:      # noqa: BLE001 - fail open
                self._fail("wait_for_save", exc)

    def get_block_ids_with_load_errors(self) -> Set[int]:
        """Blocks promised as hits that hostkv could not load: vLLM recomputes them."""
        if self._worker is None or not self._worker.bad_blocks:
            return set()
        bad, self._worker.bad_blocks = self._worker.bad_blocks, set()
        return bad

    def build_connector_worker_meta(self) -> Optional[KVConnectorWorkerMetadata]:
        """The steps whose copies finished since the last report, and what failed."""
        if self._worker is None or not self._worker.done:
            return None
        done, self._worker.done = self._worker.done, []
        return HostKVWorkerMetadata(done=done)

    # -- scheduler side --------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> Tuple[Optional[int], bool]:
        """Tokens hostkv holds beyond vLLM's local hit (a pure lookup; a miss on error).

        With a remote tier, a prompt that goes beyond what the host holds first starts a
        lookup of the rest there and answers None ("ask again later": vLLM schedules
        other requests meanwhile) until the fetched pages are in the host's segment, or
        ``remote_wait`` seconds have passed, or the lookup failed; then it answers from
        the host's segment like any lookup."""
        sched = self._sched
        if sched is None or not sched.lock.acquire(timeout=self._settings.lock_timeout):
            return 0, False
        try:
            return sched.get_num_new_matched_tokens(request, num_computed_tokens)
        except Exception as exc:          # noqa: BLE001 - fail open: a miss
            self._fail("lookup", exc)
            return 0, False
        finally:
            sched.lock.release()

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        """Borrows the request's cached prefix and reserves pages for the rest."""
        sched = self._sched
        if sched is None:
            return
        if not sched.lock.acquire(timeout=self._settings.lock_timeout):
            self._fail("update_state_after_alloc", TimeoutError("connector lock"))
            return
        try:
            sched.update_state_after_alloc(request, blocks, num_external_tokens)
        except Exception as exc:          # noqa: BLE001 - fail open
            self._fail("update_state_after_alloc", exc)
        finally:
            sched.lock.release()

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        """This step's loads and saves, per request."""
        sched = self._sched
        if sched is None:
            return HostKVConnectorMetadata()
        if not sched.lock.acquire(timeout=self._settings.lock_timeout):
            self._fail("build_connector_meta", TimeoutError("connector lock"))
            return HostKVConnectorMetadata()
        try:
            return sched.build_connector_meta(scheduler_output)
        except Exception as exc:          # noqa: BLE001 - fail open: no copies this step
            self._fail("build_connector_meta", exc)
            return HostKVConnectorMetadata()
        finally:
            sched.lock.release()

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        """Commits the pages whose saves the workers confirmed; releases finished requests."""
        sched = self._sched
        if sched is None:
            return
        if not sched.lock.acquire(timeout=self._settings.lock_timeout):
            self._fail("update_connector_output", TimeoutError("connector lock"))
            return
        try:
            sched.update_connector_output(connector_output)
        except Exception as exc:          # noqa: BLE001 - fail open
            self._fail("update_connector_output", exc)
        finally:
            sched.lock.release()

    def request_finished(self, request: "Request",
                         block_ids: List[int]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        """Releases the request once its last saves are confirmed; vLLM may free its
        blocks now (every save was copied during the step that scheduled it)."""
        sched = self._sched
        if sched is None:
            return False, None
        if not sched.lock.acquire(timeout=self._settings.lock_timeout):
            self._fail("request_finished", TimeoutError("connector lock"))
            return False, None
        try:
            sched.request_finished(request)
        except Exception as exc:          # noqa: BLE001 - fail open
            self._fail("request_finished", exc)
        finally:
            sched.lock.release()
        return False, None

    def take_events(self) -> Iterable[KVCacheEvent]:
        """BlockStored for pages this engine put in the cache, BlockRemoved for those it
        found gone (medium "CPU")."""
        sched = self._sched
        if sched is None or not sched.events:
            return ()
        if not sched.lock.acquire(timeout=self._settings.lock_timeout):
            return ()                     # they wait for the next call
        try:
            return sched.take_events()
        finally:
            sched.lock.release()

    def get_kv_connector_stats(self) -> Optional[KVConnectorStats]:
        """Hits, pages and bytes loaded and saved, copy time and failures since last time;
        with a remote tier, its lookups, waits, fetched and written pages and errors."""
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
        return HostKVConnectorStats(data=dict(data or {key: 0 for key in _COUNTERS}))

    def shutdown(self) -> None:
        """Releases this engine's sequences (without commit) and detaches the segment."""
        try:
            if self._sched is not None:
                self._sched.shutdown()
            elif self._worker is not None:
                self._worker.shutdown()
        except Exception as exc:          # noqa: BLE001 - the dead-lease sweep cleans up
            self._fail("shutdown", exc)
