"""Always-on metrics in the segment: lock histograms, miss reasons, per-namespace tokens,
and their export (`python -m hostkv stats NAME --json | --prometheus`)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

import hostkv
from hostkv import SequenceRequest as Req

from conftest import small_config

SYSTEM = list(range(100, 116))      # four pages of 4 tokens


@pytest.fixture
def cache(segment_name):
    c = hostkv.HostKVCache.create(segment_name, small_config(num_pages=64, prefix_min_reuse_pages=2))
    yield c
    c.close()


def serve(view, seq_id, tokens, namespace=0):
    (alloc,) = view.allocate_pages_for_sequences_with_prefix([Req(seq_id, tokens, namespace)])
    view.release([seq_id])
    return alloc.reused_tokens


def test_miss_reasons_and_namespace_tokens(cache):
    view = hostkv.WorkerView(cache)
    assert serve(view, 1, SYSTEM + [1]) == 0                    # no prefix: nothing cached
    assert serve(view, 2, SYSTEM + [2]) == 16                   # full hit
    assert serve(view, 3, SYSTEM + [3], namespace=7) == 0       # cached in another namespace
    assert serve(view, 4, SYSTEM[:4] + [9] * 5) == 0            # one page < minimum of two
    cache.evict(100)
    assert serve(view, 5, SYSTEM + [5]) == 0                    # cached, then evicted
    metrics = cache.metrics()
    assert metrics.full_hits == 1
    assert metrics.misses == {"no_prefix": 1, "namespace": 1, "below_minimum": 1, "evicted": 1}
    assert metrics.namespaces == {0: (17 * 3 + 9, 16), 7: (17, 0)}
    cache.check()


def test_failed_batch_counts_nothing(cache):
    view = hostkv.WorkerView(cache)
    serve(view, 1, SYSTEM + [1])
    before = cache.metrics()
    with pytest.raises(hostkv.OutOfPagesError):
        view.allocate_pages_for_sequences_with_prefix([Req(2, SYSTEM + [2]), Req(3, list(range(1000)))])
    after = cache.metrics()
    assert (after.full_hits, after.misses, after.namespaces) == (
        before.full_hits, before.misses, before.namespaces)
    assert cache.stats().lookups == 1


def test_namespaces_beyond_the_table_count_as_other(cache):
    view = hostkv.WorkerView(cache)
    for ns in range(70):
        serve(view, ns, [1, 2, 3, 4, 5], namespace=ns)
    namespaces = cache.metrics().namespaces
    assert len(namespaces) == 64 and "other" in namespaces
    assert sum(lookup for lookup, _ in namespaces.values()) == 70 * 5


def test_lock_histograms_count_every_acquisition(cache):
    before = cache.metrics()
    for _ in range(10):
        cache.stats()
    after = cache.metrics()
    # metrics() itself takes the lock once more each time.
    assert after.lock_acquisitions - before.lock_acquisitions == 11
    assert sum(after.lock_wait_histogram) == after.lock_acquisitions
    assert sum(after.lock_hold_histogram) >= after.lock_acquisitions - 1   # this one still held
    assert 0 < after.percentile_ns("hold", 0.5) <= after.percentile_ns("hold", 0.99)


def test_a_percentile_in_entry_0_is_zero(cache):
    """Entry 0 counts the acquisitions taken at the first try, recorded as a wait of exactly
    0 ns (not timed): a percentile that falls there is 0, not the 1 ns above it."""
    import dataclasses

    buckets = len(cache.metrics().lock_wait_histogram)
    metrics = dataclasses.replace(cache.metrics(),
                                  lock_wait_histogram=(98, 0, 0, 1, 1) + (0,) * (buckets - 5))
    assert metrics.percentile_ns("wait", 0.5) == 0
    assert metrics.percentile_ns("wait", 0.99) == 8
    assert metrics.percentile_ns("wait", 1.0) == 16
    empty = dataclasses.replace(metrics, lock_wait_histogram=(0,) * buckets)
    assert empty.percentile_ns("wait", 0.5) == 0


def test_prometheus_and_json_export(cache):
    serve(hostkv.WorkerView(cache), 1, SYSTEM + [1])
    run = lambda *a: subprocess.run([sys.executable, "-m", "hostkv", "stats", cache.name, *a],
                                    capture_output=True, text=True, timeout=60)
    prom = run("--prometheus")
    assert prom.returncode == 0, prom.stderr
    sample = re.compile(r'^hostkv_[a-z_]+\{segment="[^"]+"(,[a-z]+="[^"]*")*\} [0-9.e+-]+$')
    lines = prom.stdout.strip().splitlines()
    for line in lines:
        assert line.startswith("# HELP ") or line.startswith("# TYPE ") or sample.match(line), line
    text = prom.stdout
    assert 'hostkv_misses_total{segment="%s",reason="no_prefix"} 1' % cache.name in text
    assert "# TYPE hostkv_lock_wait_seconds histogram" in text
    assert 'le="+Inf"' in text and "hostkv_cached_pages{" in text
    js = run("--json")
    assert js.returncode == 0
    data = json.loads(js.stdout)
    assert data["cached_pages"] == 4 and data["metrics"]["misses"]["no_prefix"] == 1
    assert data["metrics"]["namespaces"]["0"]["lookup_tokens"] == 17
