"""The remote tier on a real 3-master Redis Cluster (redis-server --cluster-enabled yes x3,
redis-cli --cluster create): pages spread over every node, two hosts share them byte for
byte, and a node killed mid-write loses nothing local and never hands out a partial value."""

from __future__ import annotations

import numpy as np
import redis

import hostkv
from hostkv.remote import chain_keys, layout_fingerprint
from lib.redislib import redis_cluster, redis_cluster_module  # noqa: F401  (a fixture)
from lib.remotelib import (  # noqa: F401  (make_host is a fixture)
    PAGE_SIZE,
    WAIT,
    fast_config,
    make_host,
    prompt,
    wait_until,
)


def node_slots(cluster, index: int) -> list:
    """The slot ranges the cluster's node `index` serves (ask before it dies)."""
    client = redis.Redis(port=cluster.servers[index].port)
    try:
        table = client.execute_command("CLUSTER", "SLOTS")
    finally:
        client.close()
    port = cluster.servers[index].port
    return [(int(entry[0]), int(entry[1])) for entry in table if int(entry[2][1]) == port]


def first_on(ranges: list, host, tokens, pages: int) -> int:
    """The first of the prompt's pages [0, pages) whose key falls in the slot ranges
    (pages if none)."""
    keys = chain_keys(b"t", 0, layout_fingerprint(host.cache.config), tokens, PAGE_SIZE, pages)
    for page, key in enumerate(keys):
        slot = redis.cluster.key_slot(key)
        if any(lo <= slot <= hi for lo, hi in ranges):
            return page
    return pages


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
        ranges = node_slots(cluster, 1)
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
        # While the node is down, B's lookups fail fast and B serves locally. B loads at
        # most the pages before the first one on the dead node (none once the others call
        # the cluster down: CLUSTERDOWN, with full coverage required), and only A's bytes.
        early = b.tier.fetch(prompts[0], timeout=WAIT)
        assert early in (0, first_on(ranges, b, prompts[0], 8))
        assert b.reuse(prompts[0]) == (early * PAGE_SIZE, written[0][:early])
        # The node comes back empty (same slots, no data): what B loads now is exactly what
        # A wrote, or nothing; chains stop at the pages the dead node lost.
        cluster.servers[1].start()
        wait_until(lambda: all("cluster_state:ok" in s.cli("cluster", "info")
                               for s in cluster.servers), "the cluster to recover")
        wait_until(lambda: b.tier.lookup(prompt(9, 7)).wait(WAIT) == 0
                   and not b.tier.stats().breaker_open, "B's breaker to close")
        inserted = b.tier.fetch_many(prompts, timeout=WAIT)
        assert sum(inserted) > 0 and min(inserted) < 8       # some found, some chains cut
        for i, (tokens, count, pages) in enumerate(zip(prompts, inserted, written)):
            reused, got = b.reuse(tokens)
            total = count + (early if i == 0 else 0)
            assert reused == total * PAGE_SIZE
            assert got == pages[:total]
        assert sum(b.tier.stats().invalid_pages.values()) == 0


def test_a_dead_master_fails_only_its_own_keys(make_host):
    """A master killed with no replica to take over, in a cluster that keeps serving the
    other slots (cluster-require-full-coverage no): lookups load every page before the
    first one on the dead node, count the rest as unavailable and an error, and never
    open the breaker, however often they hit the dead node; writes to the live nodes go
    on. The node back (empty): the chains fill again."""
    with redis_cluster(full_coverage=False) as cluster:
        a = make_host(fast_config(cluster.url), num_pages=512)
        b = make_host(fast_config(cluster.url), num_pages=512)
        prompts = [prompt(PAGE_SIZE * 8 + 1, 500 + seed) for seed in range(12)]
        written = [a.compute(tokens, seed) for seed, tokens in enumerate(prompts)]
        ranges = node_slots(cluster, 1)
        cut = [first_on(ranges, b, tokens, 8) for tokens in prompts]
        assert 0 < sum(cut) < 8 * len(prompts) and min(cut) < 8   # some pages on each side
        dead = cluster.servers[1]
        dead.kill()
        wait_until(lambda: "master,fail " in cluster.servers[0].cli("cluster", "nodes"),
                   "the live masters to mark the dead one failed")
        assert "cluster_state:ok" in cluster.servers[0].cli("cluster", "info")

        assert b.tier.fetch_many(prompts, timeout=WAIT) == cut
        stats = b.tier.stats()
        assert stats.unavailable_pages == sum(8 - c for c in cut)
        assert stats.errors >= 1 and stats.hit_pages == sum(cut)
        assert stats.invalid_pages == {} and stats.breaker_opens == 0
        for tokens, count, pages in zip(prompts, cut, written):
            assert b.reuse(tokens) == (count * PAGE_SIZE, pages[:count])
        # Lookups whose next page is on the dead node, again and again: each is an error,
        # none opens the breaker (the dead node is skipped while it backs off, probed
        # after), and a lookup of live pages still loads.
        for _ in range(6):
            assert b.tier.fetch(prompts[cut.index(min(cut))], timeout=WAIT) == 0
        assert b.tier.stats().breaker_opens == 0 and not b.tier.stats().breaker_open
        # Writes go on to the live nodes: a new prompt's pages land there, the dead
        # node's are dropped and counted.
        before = a.tier.stats()
        fresh = prompt(PAGE_SIZE * 8 + 1, 999)
        fresh_written = a.compute(fresh, 999)
        after = a.tier.stats()
        fresh_cut = first_on(ranges, b, fresh, 8)
        assert after.written_pages - before.written_pages + \
            after.unavailable_pages - before.unavailable_pages == 8
        assert after.breaker_opens == 0
        assert b.tier.fetch(fresh, timeout=WAIT) == fresh_cut
        assert b.reuse(fresh) == (fresh_cut * PAGE_SIZE, fresh_written[:fresh_cut])
        # The node comes back empty: the live nodes' pages are still there; B asks again.
        dead.start()
        wait_until(lambda: all("cluster_state:ok" in s.cli("cluster", "info")
                               for s in cluster.servers), "the cluster to recover")
        wait_until(lambda: "fail" not in cluster.servers[0].cli("cluster", "nodes"),
                   "the node to be seen alive")
        a.compute(prompts[0], 0)          # A writes its pages again (they are missing)
        wait_until(lambda: b.tier.fetch(prompts[0], timeout=WAIT) > 0 or
                   b.reuse(prompts[0])[0] == 8 * PAGE_SIZE, "B to fetch from the node back")
        assert b.reuse(prompts[0]) == (8 * PAGE_SIZE, written[0])


def test_every_master_paused_opens_the_breaker_and_it_closes_again(make_host):
    """Every master stopped (SIGSTOP): lookups fail, and as every master is failed or
    backing off, the store counts as down and the breaker opens (lookups then cost
    nothing); resumed, the nodes answer again and the breaker closes (found in review:
    the stream's bookkeeping after its last answer never ran, so the breaker never opened
    and recovered nodes stayed marked down)."""
    with redis_cluster() as cluster:
        a = make_host(fast_config(cluster.url), num_pages=128)
        tokens = prompt(PAGE_SIZE * 4 + 1, 77)
        a.compute(tokens, 1)
        # A long backoff: once open, the breaker stays open for the lookup checked below.
        b = make_host(fast_config(cluster.url, backoff_initial=3.0, backoff_max=3.0),
                      num_pages=128)
        assert b.tier.lookup(prompt(PAGE_SIZE * 4 + 1, 98)).wait(WAIT) == 0   # connected
        for server in cluster.servers:
            server.pause()
        try:
            # Each lookup waits out a read timeout per node it asks (~1-2 s here) until
            # every master is marked failed; failure_threshold of them open the breaker.
            for attempt in range(12):
                b.tier.lookup(prompt(PAGE_SIZE * 4 + 1, 200 + attempt)).wait(WAIT)
                if b.tier.stats().breaker_open:
                    break
            assert b.tier.stats().breaker_open, "every master stopped, and the breaker shut"
            skipped = b.tier.lookup(prompt(PAGE_SIZE * 4 + 1, 300))
            assert skipped.wait(WAIT) == 0
            assert skipped.status == "skipped"          # not sent: no timeout to wait out
        finally:
            for server in cluster.servers:
                server.resume()

        def fetched():
            look = b.tier.lookup(tokens)
            look.wait(WAIT)
            return look.inserted_pages == 4
        wait_until(fetched, "the resumed cluster to serve the pages again")
        assert not b.tier.stats().breaker_open
