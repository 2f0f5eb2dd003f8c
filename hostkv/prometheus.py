"""Every Prometheus metric hostkv renders, named and rendered in one place.

Prometheus' text exposition format, version 0.0.4, with its naming conventions: ``hostkv_``
and what is measured, in base units (seconds, not µs or ns); a counter's family and samples
end in ``_total``, as Prometheus' client libraries name them, a gauge's and a histogram's do
not; a histogram has cumulative ``_bucket`` samples (``le`` in seconds), ``_sum`` and
``_count``. One name per counter: a remote tier's fetches are its fetch histogram's
``_count``, not a counter of their own as well.

What is rendered here, all under the same names:

- a segment's stats and metrics, labelled ``segment`` (``python -m hostkv stats NAME
  --prometheus``): gauges ``hostkv_<stat>``, counters ``hostkv_<stat>_total``, histograms
  ``hostkv_lock_wait_seconds`` and ``hostkv_lock_hold_seconds``;
- a remote tier's counters, ``hostkv_remote_<counter>_total``, gauges and the histogram
  ``hostkv_remote_fetch_seconds``: every process's summed (the same command, labelled
  ``segment``), or one process's, unlabelled, from ``RemoteStats.prometheus_text()`` for an
  engine's own /metrics.

vLLM's connector counters (hostkv/vllm/metrics.py) are not rendered here: they go into
vLLM's own registry under vLLM's convention, ``vllm:hostkv_<counter>`` (its client adds
``_total``), beside vLLM's metrics and labelled by engine.

Pure Python: it renders numbers it is given and imports no compiled module.
"""

from __future__ import annotations

from typing import Any, List, Mapping, Optional, Sequence, Tuple

from hostkv import _histogram

__all__ = ["remote_text", "segment_text"]

Labels = Sequence[Tuple[str, Any]]

# The segment's stats that are gauges (the others are counters), and what each says.
_STAT_GAUGES = {
    "free_pages": "Pages no one references.",
    "cached_pages": "Pages held by the radix tree.",
    "borrowed_pages": "Tree pages a live sequence holds (not evictable).",
    "evictable_pages": "Cached pages no sequence protects.",
    "active_sequences": "Live sequences across all processes.",
    "active_processes": "Attached processes (live leases).",
    "tree_nodes": "Radix-tree node records in use.",
    "num_parts": "Window parts in the segment (0: none).",
    "free_parts": "Window parts no page holds.",
    "tree_parts": "Window parts of pages the radix tree holds.",
}

# A remote tier's gauges (the summed ones of every process; a RemoteStats has the last two).
_REMOTE_GAUGES = {
    "processes": "Live processes with a remote tier on this segment.",
    "tiers": "Remote tiers open in those processes.",
    "queue_depth": "Remote lookups and writes waiting now.",
    "breaker_open": "Remote tiers whose circuit breaker is open now.",
}

# A remote tier's values that are parts of its fetch histogram, not metrics of their own:
# fetches is its _count, fetch_seconds its _sum.
_REMOTE_IN_HISTOGRAM = ("fetches", "fetch_seconds")


class _Text:
    """Families in the text format, every sample with the same base labels."""

    def __init__(self, labels: Labels) -> None:
        self._labels = list(labels)
        self._lines: List[str] = []

    def family(self, name: str, kind: str, text: str) -> None:
        self._lines.append(f"# HELP {name} {text}")
        self._lines.append(f"# TYPE {name} {kind}")

    def sample(self, name: str, value: Any, labels: Labels = ()) -> None:
        pairs = self._labels + list(labels)
        shown = "{" + ",".join(f'{k}="{v}"' for k, v in pairs) + "}" if pairs else ""
        self._lines.append(f"{name}{shown} {int(value) if isinstance(value, bool) else value}")

    def metric(self, name: str, kind: str, text: str, samples: Sequence[Tuple[Labels, Any]]
               ) -> None:
        self.family(name, kind, text)
        for labels, value in samples:
            self.sample(name, value, labels)

    def histogram(self, name: str, text: str, counts: Sequence[int], units_per_second: float,
                  sum_seconds: float) -> None:
        """A log2 histogram (hostkv/_histogram.py) of durations counted in a unit of
        1 / units_per_second seconds, rendered in seconds."""
        self.family(name, "histogram", text)
        running = 0
        for bucket, count in enumerate(counts):
            running += count
            upper = _histogram.upper(bucket) / units_per_second
            self.sample(f"{name}_bucket", running, (("le", f"{upper:.9g}"),))
        self.sample(f"{name}_bucket", running, (("le", "+Inf"),))
        self.sample(f"{name}_sum", f"{sum_seconds:.9f}")
        self.sample(f"{name}_count", running)

    def text(self) -> str:
        return "\n".join(self._lines) + "\n"


def segment_text(name: str, stats: Mapping[str, Any], metrics: Any) -> str:
    """A segment's stats and metrics, labelled segment=name.

    Args:
        name: The segment's name.
        stats: Its CacheStats as a dict (dataclasses.asdict).
        metrics: Its CacheMetrics.
    """
    out = _Text((("segment", name),))
    for key, value in stats.items():
        if key in _STAT_GAUGES:
            out.metric(f"hostkv_{key}", "gauge", _STAT_GAUGES[key], [((), value)])
        else:
            out.metric(f"hostkv_{key}_total", "counter", f"{key.replace('_', ' ')} so far.",
                       [((), value)])
    for which in ("wait", "hold"):
        doing = "waiting for" if which == "wait" else "holding"
        out.histogram(f"hostkv_lock_{which}_seconds", f"Time spent {doing} the segment lock.",
                      getattr(metrics, f"lock_{which}_histogram"), 1e9,
                      getattr(metrics, f"lock_{which}_ns") / 1e9)
    out.metric("hostkv_full_hits_total", "counter",
               "Requests that reused every page they could.", [((), metrics.full_hits)])
    out.metric("hostkv_misses_total", "counter",
               "Requests that reused less than they could, by reason.",
               [((("reason", reason),), count) for reason, count in metrics.misses.items()])
    out.metric("hostkv_namespace_lookup_tokens_total", "counter",
               "Prompt tokens looked up, by namespace.",
               [((("namespace", ns),), lookup) for ns, (lookup, _) in metrics.namespaces.items()])
    out.metric("hostkv_namespace_hit_tokens_total", "counter",
               "Prompt tokens reused, by namespace.",
               [((("namespace", ns),), hit) for ns, (_, hit) in metrics.namespaces.items()])
    return out.text()


def remote_text(values: Mapping[str, Any], segment: Optional[str] = None,
                prefix: str = "hostkv_remote") -> str:
    """A remote tier's counters and gauges, and its fetch latency histogram.

    Args:
        values: RemoteStats' fields by name (dataclasses.asdict of one, or the sums of
            every process's that ``python -m hostkv stats`` reads, with their gauges):
            fetch_latency_histogram counts round trips per log2 bucket of µs, fetch_seconds
            is their total time.
        segment: Labels every sample segment=... (None: no labels).
        prefix: Of every name.
    """
    out = _Text(() if segment is None else (("segment", segment),))
    for key, value in values.items():
        name = f"{prefix}_{key}"
        if key in _REMOTE_GAUGES:
            out.metric(name, "gauge", _REMOTE_GAUGES[key], [((), value)])
        elif key == "fetch_latency_histogram":
            out.histogram(f"{prefix}_fetch_seconds", "Round trips of remote lookups.", value,
                          1e6, values.get("fetch_seconds", 0.0))
        elif key in _REMOTE_IN_HISTOGRAM:
            continue
        elif isinstance(value, Mapping):
            out.metric(f"{name}_total", "counter",
                       f"Remote tier: {key.replace('_', ' ')}, by reason.",
                       [((("reason", k),), v) for k, v in sorted(value.items())])
        else:
            out.metric(f"{name}_total", "counter",
                       f"Remote tier: {key.replace('_', ' ')} so far.", [((), value)])
    return out.text()
