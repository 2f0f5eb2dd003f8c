"""RemoteConfig(write_policy="evict") on a real redis-server: pages go to the store just before
the host evicts them, and only then.

Host A's pool is small (16 pages of 4 tokens; the writer's headroom is 4 pages), so a few
prompts put it under eviction pressure. A page A evicts was written first and host B fetches
it byte for byte; a page A never came near evicting is never sent; nothing is sent twice; a
dead or paused server never blocks A's allocations or evictions.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import hostkv
from hostkv.remote import RemoteConfig, chain_keys, layout_fingerprint
from hostkv.remote.backend import RedisBackend

from lib.redislib import redis_server  # noqa: F401  (a fixture)
from lib.remotelib import (  # noqa: F401  (make_host is a fixture)
    PAGE_SIZE,
    WAIT,
    fast_config,
    make_host,
    prompt,
)

SMALL = dict(num_pages=16)           # 3 full pages + 1 partial per prompt below


def evict_config(url: str, **overrides) -> RemoteConfig:
    values = dict(write_policy="evict", evict_headroom=0.25)     # 4 of 16 pages
    values.update(overrides)
    return fast_config(url, **values)


def prompts(count: int, seed: int = 0) -> list:
    return [prompt(3 * PAGE_SIZE + 1, seed * 1000 + i) for i in range(count)]


def stored_keys(server) -> set:
    return {k for k in server.cli("--scan", "--pattern", "t:*").split()}


def keys_of(host, tokens, pages: int) -> set:
    return {k.decode() for k in chain_keys(b"t", 0, layout_fingerprint(host.cache.config),
                                           tokens, PAGE_SIZE, pages)}


def test_a_page_evicted_on_a_is_fetched_byte_identical_by_b(redis_server, make_host):
    a = make_host(evict_config(redis_server.url), **SMALL)
    b = make_host(fast_config(redis_server.url))
    ps = prompts(8)
    written = [a.compute(tokens, seed) for seed, tokens in enumerate(ps)]
    stats = a.cache.stats()
    assert stats.evicted_pages >= 9                       # the first prompts are gone ...
    for tokens in ps[:3]:
        assert len(a.cache.match_prefix(tokens).pages) == 0
    tier = a.tier.stats()
    assert tier.written_pages >= stats.evicted_pages and tier.writes_dropped == 0
    for seed, tokens in enumerate(ps[:3]):                # ... and B has them, byte for byte
        assert b.tier.fetch(tokens, timeout=WAIT) == 3
        assert b.reuse(tokens) == (3 * PAGE_SIZE, written[seed])
    assert b.tier.stats().invalid_pages == {}


def test_a_bad_value_the_tier_fetched_is_replaced_when_the_page_nears_eviction(redis_server,
                                                                               make_host):
    """A value that fails its checks under a page's key (here garbage): A's fetch finds it
    (a counted miss), A computes the page itself, and when the page nears eviction the
    writer sends it without asking (EXPIRE would find the bad value there and renew it):
    B then fetches A's bytes."""
    import redis
    a = make_host(evict_config(redis_server.url, ttl_seconds=1000), **SMALL)
    b = make_host(fast_config(redis_server.url))
    tokens = prompt(3 * PAGE_SIZE + 1, 42)
    key = chain_keys(b"t", 0, layout_fingerprint(a.cache.config), tokens, PAGE_SIZE, 1)[0]
    client = redis.Redis(port=redis_server.port)
    client.set(key, b"garbage: not a hostkv value", ex=50)
    assert a.tier.fetch(tokens, timeout=WAIT) == 0
    assert a.tier.stats().invalid_pages == {"truncated": 1}
    written = a.compute(tokens, 1)
    for seed, other in enumerate(prompts(6, seed=3)):      # pressure: A evicts it
        a.compute(other, 10 + seed)
    assert a.tier.flush(WAIT)
    assert len(a.cache.match_prefix(tokens).pages) == 0
    assert client.get(key) != b"garbage: not a hostkv value"
    assert client.ttl(key) > 50
    client.close()
    assert b.tier.fetch(tokens, timeout=WAIT) == 3
    assert b.reuse(tokens) == (3 * PAGE_SIZE, written)
    assert b.tier.stats().invalid_pages == {}


def test_only_a_good_value_clears_a_key_found_invalid(redis_server, make_host):
    """A key whose value failed its checks stays to be sent while the store only says a
    value is there (EXPIRE: the bad one, or not), and is cleared once a good value is known
    (fetched, or stored by this writer)."""
    host = make_host(evict_config(redis_server.url), **SMALL)
    writer = host.tier._evict_writer
    key = b"t:" + bytes(16).hex().encode()
    writer.note_invalid([key])
    writer._remember_present([key], valid=False)         # an EXPIRE found a value
    assert key in writer._invalid and not writer._is_known(key, time.monotonic())
    writer.note_present([key])                           # a good value was fetched
    assert key not in writer._invalid and writer._is_known(key, time.monotonic())


class _OneDeadNode(RedisBackend):
    """A redis-server as a cluster would answer with the node of the keys in ``dead`` down:
    asks about them get no answer, and they are not stored while the others are."""

    def __init__(self, config: RemoteConfig) -> None:
        super().__init__(config)
        self.dead: set = set()
        self.sent: list = []

    def touch_many(self, keys, ttl_seconds):
        answers = iter(super().touch_many([k for k in keys if k not in self.dead], ttl_seconds))
        return [None if k in self.dead else next(answers) for k in keys]

    def put_many(self, items, ttl_seconds):
        self.sent += [k for k, _ in items]
        live = [(k, v) for k, v in items if k not in self.dead]
        return super().put_many(live, ttl_seconds) + len(items) - len(live)


def test_a_bad_value_on_a_dead_node_is_sent_again_once_a_poll(redis_server, new_name):
    """A page whose value failed its checks is sent unasked; when its node is down the
    writer waits for its next poll before it sends it again, instead of at once (it
    would send it to the dead node as fast as it can, and hold the segment's lock as
    often)."""
    import redis

    from lib.remotelib import Host, host_config

    config = evict_config(redis_server.url, ttl_seconds=1000, evict_poll_seconds=0.05)
    backend = _OneDeadNode(config)
    host = Host(new_name(), config, host_config(**SMALL), backend=backend)
    try:
        tokens = prompt(3 * PAGE_SIZE + 1, 42)
        key = chain_keys(b"t", 0, layout_fingerprint(host.cache.config), tokens, PAGE_SIZE,
                         1)[0]
        client = redis.Redis(port=redis_server.port)
        client.set(key, b"garbage: not a hostkv value", ex=50)
        client.close()
        assert host.tier.fetch(tokens, timeout=WAIT) == 0
        backend.dead.add(key)
        start = time.monotonic()
        for other in [tokens] + prompts(6, seed=3):          # the host evicts it
            seq_id = next(host._ids)
            host.view.allocate_pages_for_sequences_with_prefix(
                [hostkv.SequenceRequest(seq_id, other, 0)])
            host.tier.release(host.view, [seq_id])
            host.tier.flush(0.5)
        polls = (time.monotonic() - start) / 0.05
        # Sent, and at most about once a poll (rounds a flush asks for besides); a writer
        # that sent it again at once sent it thousands of times here.
        assert 0 < backend.sent.count(key) <= 2 * polls + 10
    finally:
        host.close()


def test_a_page_never_near_eviction_is_not_sent(redis_server, make_host):
    # A big pool: nothing is ever near eviction, nothing is sent.
    roomy = make_host(evict_config(redis_server.url))
    for seed, tokens in enumerate(prompts(5, 1)):
        roomy.compute(tokens, seed)
    assert roomy.tier.flush(WAIT)
    assert roomy.tier.stats().written_pages == 0 and stored_keys(redis_server) == set()
    # A small one: 5 prompts leave 1 page free, 3 short of the headroom; the coldest node
    # (the first prompt's 3 pages) is sent, nothing else.
    a = make_host(evict_config(redis_server.url), **SMALL)
    ps = prompts(5, 2)
    for seed, tokens in enumerate(ps[:4]):
        a.compute(tokens, seed)
    assert a.tier.stats().written_pages == 0 and stored_keys(redis_server) == set()
    a.compute(ps[4], 4)
    assert a.cache.stats().free_pages == 1 and a.cache.stats().evicted_pages == 0
    assert a.tier.stats().written_pages == 3
    assert stored_keys(redis_server) == keys_of(a, ps[0], 3)
    b = make_host(fast_config(redis_server.url))
    for tokens in ps[1:]:
        assert b.tier.fetch(tokens, timeout=WAIT) == 0


def test_nothing_is_sent_twice(redis_server, make_host):
    a = make_host(evict_config(redis_server.url), **SMALL)
    ps = prompts(5, 3)
    for seed, tokens in enumerate(ps):
        a.compute(tokens, seed)
    assert a.tier.stats().written_pages == 3
    sets = int(redis_server.cli("info", "commandstats").split("cmdstat_set:calls=")[1]
               .split(",")[0])
    for _ in range(5):                  # the same coldest node, looked at again and again
        assert a.tier.flush(WAIT)
    assert a.tier.stats().written_pages == 3
    assert int(redis_server.cli("info", "commandstats").split("cmdstat_set:calls=")[1]
               .split(",")[0]) == sets
    # Pages B fetched from the store are not sent back when B evicts them.
    b = make_host(evict_config(redis_server.url), **SMALL)
    assert b.tier.fetch(ps[0], timeout=WAIT) == 3
    for seed, tokens in enumerate(prompts(6, 4)):
        b.compute(tokens, seed)
    assert len(b.cache.match_prefix(ps[0]).pages) == 0          # evicted on B
    stats = b.tier.stats()
    assert stats.written_pages > 0
    assert stored_keys(redis_server) >= keys_of(a, ps[0], 3)
    assert b.tier._evict_writer.known_skipped > 0


def test_a_hot_prefix_goes_with_the_pages_evicted_after_it(redis_server, make_host):
    """A system prompt A keeps using is never evicted; the conversations after it are. They
    are sent with the prefix, so B can reach them from the chain's start."""
    a = make_host(evict_config(redis_server.url), **SMALL)
    system = prompt(2 * PAGE_SIZE, 9)
    turns = [np.concatenate([system, prompt(PAGE_SIZE + 1, 20 + i)]) for i in range(16)]
    written = [a.compute(tokens, seed) for seed, tokens in enumerate(turns)]
    assert len(a.cache.match_prefix(system).pages) == 2         # hot: never evicted
    assert len(a.cache.match_prefix(turns[0]).pages) == 2       # its first turn was
    b = make_host(fast_config(redis_server.url))
    assert b.tier.fetch(turns[0], timeout=WAIT) == 3
    assert b.reuse(turns[0]) == (3 * PAGE_SIZE, written[0])


@pytest.mark.parametrize("fault", ["killed", "paused"])
def test_a_dead_or_paused_server_never_blocks_eviction_or_allocation(redis_server, make_host,
                                                                   fault):
    a = make_host(evict_config(redis_server.url), **SMALL)
    getattr(redis_server, "kill" if fault == "killed" else "pause")()
    try:
        ps = prompts(10, 5)
        for seed, tokens in enumerate(ps):
            # Host.compute flushes: a round of the writer, bounded by the socket timeouts.
            a.compute(tokens, seed)
            # No page is left held by the writer (its holds end before any network call).
            assert a.cache.stats().borrowed_pages == 0
        assert a.cache.stats().evicted_pages >= 15
        for tokens in ps[-3:]:
            assert a.reuse(tokens)[0] == 3 * PAGE_SIZE
        stats = a.tier.stats()
        assert stats.errors >= 1 and stats.written_pages == 0
        assert stats.breaker_opens >= 1 or fault == "paused"
    finally:
        if fault == "paused":
            redis_server.resume()
    a.cache.check()


def test_the_through_policy_writes_at_commit(redis_server, make_host):
    """The default for comparison: everything committed is sent, pressure or not."""
    a = make_host(fast_config(redis_server.url))
    assert a.tier.config.write_policy == "through"
    for seed, tokens in enumerate(prompts(3, 6)):
        a.compute(tokens, seed)
    assert a.tier.stats().written_pages == 9 and len(stored_keys(redis_server)) == 9


@pytest.mark.parametrize("field, value", [
    ("write_policy", "behind"), ("write_policy", None), ("write_policy", "EVICT"),
    ("evict_headroom", 0), ("evict_headroom", 1.5), ("evict_headroom", "0.1"),
    ("evict_headroom", float("nan")), ("evict_poll_seconds", 0), ("evict_poll_seconds", True),
])
def test_bad_write_policy_settings_are_config_errors(field, value):
    with pytest.raises(hostkv.ConfigError, match=field):
        RemoteConfig("redis://localhost", **{field: value})


def test_the_benchmark_compares_the_policies(redis_server):
    import subprocess
    import sys
    out = subprocess.run(
        [sys.executable, "-m", "hostkv", "bench", "--remote", redis_server.url, "--pages", "32",
         "--page-kib", "4", "--repeats", "1", "--policy-requests", "60", "--policy-pool", "256",
         "--policy-page-kib", "4"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [line.strip() for line in out.stdout.splitlines()]
    rows = {}
    for label in ("none", "through", "evict", "evict, pages only"):
        found = [line for line in lines if line.startswith(label + "  ")]
        assert len(found) == 1, out.stdout
        rows[label] = found[0][len(label):].split()
    assert rows["none"][0] == "0" and int(rows["through"][0]) > int(rows["evict"][0]) > 0
    assert "evicted, in store" in out.stdout
    assert redis_server.cli("dbsize").strip() == "0"          # the benchmark cleans up
    bad = subprocess.run(
        [sys.executable, "-m", "hostkv", "bench", "--remote", redis_server.url,
         "--policy-pool", "100"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--policy-pool" in bad.stderr
