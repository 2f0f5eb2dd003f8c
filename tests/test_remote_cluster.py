"""The remote tier on a real 3-master Redis Cluster (redis-server --cluster-enabled yes x3,
redis-cli --cluster create): pages spread over every node, two hosts share them byte for
byte, and a node killed mid-write loses nothing local and never hands out a partial value."""

from __future__ import annotations

import numpy as np

import hostkv
from redislib import redis_cluster, redis_cluster_module  # noqa: F401  (a fixture)
from remotelib import (  # noqa: F401  (make_host is a fixture)
    PAGE_SIZE,
    WAIT,
    fast_config,
    make_host,
    prompt,
    wait_until,
)


def test_two_hosts_share_pages_across_every_node(redis_cluster_module, make_host):
    cluster = redis_cluster_module
    a = make_host(fast_config(cluster.url))
    b = make_host(fast_config(cluster.url))
    prompts = [prompt(PAGE_SIZE * 12 + 1, seed) for seed in range(3)]
    written = [a.compute(p, seed) for seed, p in enumerate(prompts)]
    assert a.tier.stats().written_pages == 36
    assert all(int(s.cli("dbsize")) > 0 for s in cluster.servers)     # keys on every node
    lookups = b.tier.lookup_many(prompts)
    assert [look.wait(WAIT) for look in lookups] == [12, 12, 12]
    assert b.tier.stats().fetches == 1
    for p, pages in zip(prompts, written):
        assert b.reuse(p) == (12 * PAGE_SIZE, pages)


def test_a_node_killed_mid_write_loses_nothing_local_and_loads_no_partial_value(make_host):
    with redis_cluster() as cluster:
        a = make_host(fast_config(cluster.url, write_batch_pages=8), num_pages=512)
        b = make_host(fast_config(cluster.url), num_pages=512)
        prompts = [prompt(PAGE_SIZE * 8 + 1, 100 + seed) for seed in range(24)]
        written = [a.compute(tokens, seed) for seed, tokens in enumerate(prompts[:8])]
        # Node 1 stops answering; the writer sends the next pipeline (its SETs reach all
        # three nodes) and waits for node 1's replies; node 1 dies right then.
        cluster.servers[1].pause()
        ids = iter(range(1000, 2000))
        pool = a.cache.pages_array()
        for seed, tokens in enumerate(prompts[8:], 8):
            alloc = a.view.allocate_pages_for_sequences_with_prefix(
                [hostkv.SequenceRequest(next(ids), tokens)])[0]
            rng = np.random.default_rng(seed)
            for page in alloc.page_table:
                pool[page] = rng.integers(0, 256, pool.shape[1], dtype=np.uint8)
            written.append([pool[p].tobytes() for p in alloc.page_table[:8]])
            a.tier.release(a.view, [alloc.seq_id])      # queued: sent in the background
        del pool
        wait_until(lambda: a.tier.stats().queue_depth < 16, "the writer to take a batch")
        cluster.servers[1].kill()
        assert a.tier.flush(WAIT)                   # no hang: errors, drops, breaker
        stats = a.tier.stats()
        assert stats.errors >= 1 and stats.writes_dropped > 0
        # Nothing local is lost: host A still reuses every prompt from its own memory.
        for tokens, pages in zip(prompts, written):
            assert a.reuse(tokens) == (8 * PAGE_SIZE, pages)
        # While the node is down, B's lookups fail fast and B serves locally.
        assert b.tier.fetch(prompts[0], timeout=WAIT) == 0
        assert b.reuse(prompts[0])[0] == 0
        # The node comes back empty (same slots, no data): what B loads now is exactly what
        # A wrote, or nothing; chains stop at the pages the dead node lost.
        cluster.servers[1].start()
        wait_until(lambda: all("cluster_state:ok" in s.cli("cluster", "info")
                               for s in cluster.servers), "the cluster to recover")
        wait_until(lambda: b.tier.lookup(prompt(9, 7)).wait(WAIT) == 0
                   and not b.tier.stats().breaker_open, "B's breaker to close")
        inserted = b.tier.fetch_many(prompts, timeout=WAIT)
        assert sum(inserted) > 0 and min(inserted) < 8       # some found, some chains cut
        for tokens, count, pages in zip(prompts, inserted, written):
            reused, got = b.reuse(tokens)
            assert reused == count * PAGE_SIZE
            assert got == pages[:count]
        assert sum(b.tier.stats().invalid_pages.values()) == 0
