"""The connector's counters: what it logs once, counts, and hands vLLM's stats and Prometheus."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from hostkv.vllm.timing import DESCRIPTIONS as _TIMING_DESCRIPTIONS
from hostkv.vllm.timing import TIMING_COUNTERS

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["COUNTERS", "Counters", "Failures", "HostKVConnectorStats", "HostKVPromMetrics",
           "TIER_COUNTERS", "registry_counters"]

logger = logging.getLogger("hostkv.vllm")


class Failures:
    """Counts serving-path failures by cause; logs the first of each cause."""

    def __init__(self) -> None:
        self.counts: Dict[str, int] = {}

    def note(self, where: str, exc: BaseException) -> None:
        cause = f"{where}: {type(exc).__name__}"
        count = self.counts.get(cause, 0)
        self.counts[cause] = count + 1
        if count == 0:
            # The text, not the exception: a handler that keeps records (pytest's, a
            # memory handler) would otherwise keep its traceback's frames, and with them
            # views of the pool that block the segment's close.
            logger.warning("hostkv: %s (%s); the request goes on without the cache (logged "
                           "once per cause, counted in the connector stats)", cause, str(exc))



COUNTERS = ("lookups", "lookup_tokens", "hit_tokens", "borrowed_tokens", "bad_blocks",
             "loaded_pages", "loaded_bytes", "load_s", "saved_pages", "saved_bytes", "save_s",
             "committed_pages", "preempted", "failures", "prefaulted_bytes",
             "registered_bytes", "register_failures", "bypassed_requests", "copy_calls",
             # The remote tier (scheduler side; zero without one). Per request:
             "remote_lookups", "remote_hit_tokens", "remote_wait_s", "remote_timeouts",
             "remote_failed",
             # the tier's own counters (RemoteStats), as increments:
             "remote_fetched_pages", "remote_invalid_pages", "remote_published_pages",
             "remote_written_pages", "remote_writes_dropped", "remote_errors",
             "remote_bytes_down", "remote_bytes_up", "remote_breaker_opens",
             # Where the serving path's time goes, by phase (hostkv.vllm.timing):
             *TIMING_COUNTERS)

# RemoteStats fields whose increments the connector reports, by counter.
TIER_COUNTERS = {"remote_fetched_pages": "inserted_pages",
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
    "prefaulted_bytes": "Pool bytes each worker mapped ahead of its first copies into them",
    "registered_bytes": "Pool bytes each GPU worker registered with CUDA for DMA",
    "register_failures": "GPU workers whose registration of the pool failed (copies slower)",
    "bypassed_requests": "Requests never looked up nor saved: their token ids do not say "
                         "what their KV is (prompt embeddings)",
    "copy_calls": "Copy calls the workers' saves and loads made (DMA calls on a GPU; "
                  "compiled copy calls on a CPU)",
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
    **_TIMING_DESCRIPTIONS,
}


@dataclasses.dataclass
class HostKVConnectorStats(KVConnectorStats):
    """Counters since the last report: lookups and hits (scheduler side), pages and bytes
    loaded and saved and the seconds it took (worker side), and failures (both)."""

    def reset(self) -> None:
        """Zeroes every counter."""
        self.data = {key: 0 for key in COUNTERS}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Adds another report's counters to this one."""
        for key, value in (other.data or {}).items():
            if isinstance(value, (int, float)):
                self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> Dict[str, Any]:
        """The counters, plus load and save throughput in GB/s."""
        out: Dict[str, Any] = {key: self.data.get(key, 0) for key in COUNTERS}
        for what in ("load", "save"):
            seconds = out[f"{what}_s"]
            moved = out["loaded_bytes" if what == "load" else "saved_bytes"]
            out[f"{what}_GBps"] = round(moved / seconds / 1e9, 3) if seconds else 0.0
        return out

    def is_empty(self) -> bool:
        """True when nothing was counted."""
        return not any(self.data.get(key) for key in COUNTERS)


class HostKVPromMetrics(KVConnectorPromMetrics):
    """The connector's counters as Prometheus counters ``vllm:hostkv_<counter>_total``,
    per engine, beside vLLM's own (``/metrics`` of ``vllm serve``, ``LLM.get_metrics()``
    when stats are logged)."""

    def __init__(self, vllm_config: "VllmConfig", metric_types: Dict[Any, Any],
                 labelnames: List[str],
                 per_engine_labelvalues: Dict[int, List[object]]) -> None:
        """Registers one counter per key of the connector's stats."""
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        # Counters per engine (vLLM's helper is typed for any of its metric kinds).
        self.counters: Dict[str, Dict[int, Any]] = {
            key: create_metric_per_engine(
                self._counter_cls(name=f"vllm:hostkv_{key}", documentation=_DESCRIPTIONS[key],
                                  labelnames=labelnames),
                per_engine_labelvalues)
            for key in COUNTERS}

    def observe(self, transfer_stats_data: Dict[str, Any], engine_idx: int = 0) -> None:
        """Adds one report's counters (all are increments since the last report)."""
        for key, value in (transfer_stats_data or {}).items():
            counter = self.counters.get(key)
            if counter is not None and isinstance(value, (int, float)) and value > 0:
                counter[engine_idx].inc(value)


def registry_counters() -> Dict[str, float]:
    """hostkv's connector counters so far in this process's Prometheus registry (where an
    ``LLM`` that logs stats keeps them), by key ("save_s", "loaded_pages", ...), summed over
    engines. Read from the registry rather than ``LLM.get_metrics()``, which truncates
    counters to integers (the seconds counters are fractions)."""
    from prometheus_client import REGISTRY

    totals: Dict[str, float] = {}
    for metric in REGISTRY.collect():
        if metric.type == "counter" and metric.name.startswith("vllm:hostkv_"):
            key = metric.name[len("vllm:hostkv_"):]
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    totals[key] = totals.get(key, 0.0) + float(sample.value)
    return totals


class Counters:
    """The counters since the last report (one object per connector, both sides)."""

    # The phase timers (hostkv.vllm.timing) count something at every step, while the
    # other counters count only steps that look up, copy or commit. A report carries
    # them at most this often on their own, so that a decode step, which did nothing
    # else, does not ship a stats object from every worker to the scheduler and on to
    # vLLM's front end each time.
    TIMING_REPORT_S = 1.0

    def __init__(self) -> None:
        self.values: Dict[str, float] = {key: 0 for key in COUNTERS}
        self._reported = time.monotonic()

    def add(self, key: str, value: float) -> None:
        """Adds to one counter."""
        self.values[key] += value

    def take(self) -> Optional[HostKVConnectorStats]:
        """The counters since the last report, and zero them; None if they are all zero,
        or only the phase timers counted and the last report is under
        ``TIMING_REPORT_S`` old (they are kept for the next)."""
        values = self.values
        if not any(values[key] for key in _EVENT_COUNTERS):
            if not any(values.values()):
                return None
            if time.monotonic() - self._reported < self.TIMING_REPORT_S:
                return None
        stats = HostKVConnectorStats(data=dict(values))
        self.values = {key: 0 for key in COUNTERS}
        self._reported = time.monotonic()
        return stats


# The counters that are not phase timers: any of them reports at once.
_EVENT_COUNTERS = tuple(key for key in COUNTERS if key not in TIMING_COUNTERS)

