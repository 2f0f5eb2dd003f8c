"""The remote tier on a real single-node redis-server: two "hosts" (two segments) share it.

Host B reuses host A's pages byte for byte; lookups batch into one round trip; corrupted,
foreign or truncated values are counted misses, never loaded; a killed, paused, restarted
(empty), flushed or full server leaves the host tier serving; a process killed mid-fetch has
its fresh pages reclaimed; bad URLs and configs are ConfigErrors; no password leaks.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

import hostkv
from hostkv.remote import (
    RedisBackend,
    RemoteConfig,
    RemoteTier,
    chain_keys,
    encode_value,
    layout_fingerprint,
    parse_url,
)

from lib.redislib import RedisServer, TLSFiles, redis_server  # noqa: F401  (a fixture)
from lib.remotelib import (  # noqa: F401  (make_host is a fixture)
    PAGE_BYTES,
    PAGE_SIZE,
    WAIT,
    fast_config,
    host_config,
    make_host,
    prompt,
    wait_until,
)
from workers import remote_worker


def commandstat(server: RedisServer, command: str) -> int:
    """How many times the server ran `command` (INFO commandstats)."""
    for line in server.cli("info", "commandstats").splitlines():
        if line.startswith(f"cmdstat_{command}:"):
            return int(line.split("calls=")[1].split(",")[0])
    return 0


# -- two hosts, one store -------------------------------------------------------------------

def test_host_b_reuses_host_a_pages_byte_identical(redis_server, new_name, procs):
    """Two segments, each used by its own worker process: B's prefill shrinks to the tokens
    A did not have, and the pages B reuses hold A's bytes exactly."""
    import multiprocessing
    tokens = prompt(4 * PAGE_SIZE * 5 + 3)            # 20 full pages + 3 tokens
    names = [new_name(), new_name()]
    caches = [hostkv.HostKVCache.create(n, host_config()) for n in names]
    results = multiprocessing.get_context("spawn").Queue()
    try:
        a = procs(remote_worker.compute_and_publish, names[0], redis_server.url, tokens, 5,
                  results)
        kind, written, written_pages = results.get(timeout=WAIT)
        a.join(WAIT)
        assert (kind, a.exitcode, written_pages) == ("a", 0, 20)
        b = procs(remote_worker.fetch_and_reuse, names[1], redis_server.url, tokens, results)
        kind, inserted, reused_tokens, reused, hits = results.get(timeout=WAIT)
        b.join(WAIT)
        assert (kind, b.exitcode, inserted, hits) == ("b", 0, 20, 20)
        assert reused_tokens == 20 * PAGE_SIZE           # B prefills only the last 3 tokens
        assert reused == written
        for cache in caches:
            cache.check()
        assert caches[1].stats().cached_pages == 20
    finally:
        for cache in caches:
            cache.close()


class CountingBackend(RedisBackend):
    """The real Redis backend, counting the tier's calls into it."""

    def __init__(self, config: RemoteConfig) -> None:
        super().__init__(config)
        self.streamed = 0

    def get_streamed(self, groups):
        self.streamed += 1
        return super().get_streamed(groups)


def test_a_batch_of_lookups_is_one_round_trip_and_pollable(redis_server, make_host):
    a = make_host(fast_config(redis_server.url))
    b = make_host(fast_config(redis_server.url))
    b.tier.close()
    backend = CountingBackend(fast_config(redis_server.url))
    b.tier = RemoteTier(b.cache, fast_config(redis_server.url), backend=backend)
    prompts = [prompt(PAGE_SIZE * 6 + 1, seed) for seed in range(4)]
    written = [a.compute(p, seed) for seed, p in enumerate(prompts)]
    before = commandstat(redis_server, "mget")
    lookups = b.tier.lookup_many(prompts)
    for look in lookups:
        assert look.wait(WAIT) == 6 and look.done() and look.status == "hit"
    # One call: one MGET per prompt, all sent in one write, their replies read in turn.
    assert backend.streamed == 1
    assert commandstat(redis_server, "mget") - before == 4
    for p, pages in zip(prompts, written):
        assert b.reuse(p) == (6 * PAGE_SIZE, pages)
    stats = b.tier.stats()
    assert (stats.fetches, stats.hit_pages, stats.inserted_pages) == (1, 24, 24)
    assert stats.bytes_down > 24 * PAGE_BYTES and stats.fetch_latency_histogram[1:] != (0,) * 31
    # Nothing left to ask for: the host has every reusable page now.
    assert b.tier.lookup(prompts[0]).wait(WAIT) == 0
    assert b.tier.stats().fetches == 1


def test_a_stream_left_half_read_does_not_poison_the_connection(redis_server):
    import redis
    client = redis.Redis(port=redis_server.port)
    client.mset({b"k1": b"one", b"k2": b"two", b"k3": b"three"})
    backend = RedisBackend(fast_config(redis_server.url))
    try:
        stream = backend.get_streamed([[b"k1"], [b"k2"], [b"k3", b"nope"]])
        assert next(stream) == [b"one"]
        stream.close()                       # two replies never read
        assert backend.get_many([b"k3", b"k2"]) == [b"three", b"two"]
        assert list(backend.get_streamed([[b"k2"], [], [b"k1"]])) == [[b"two"], [], [b"one"]]
    finally:
        backend.close()
        client.close()


def test_bytes_in_flight_bound_a_fetch_and_the_rest_comes_on_asking_again(redis_server,
                                                                           make_host):
    a = make_host(fast_config(redis_server.url))
    b = make_host(fast_config(redis_server.url, max_bytes_in_flight=3 * PAGE_BYTES))
    prompts = [prompt(PAGE_SIZE * 4 + 1, seed) for seed in (1, 2)]
    written = [a.compute(p, seed) for seed, p in zip((1, 2), prompts)]
    first, second = b.tier.lookup_many(prompts)
    assert (first.wait(WAIT), first.status) == (3, "hit")
    assert (second.wait(WAIT), second.status) == (0, "skipped")
    assert b.tier.fetch(prompts[0], timeout=WAIT) == 1       # the page it could not take
    assert b.tier.fetch(prompts[1], timeout=WAIT) == 3
    assert b.reuse(prompts[0]) == (4 * PAGE_SIZE, written[0])
    b.tier.lookup(prompts[1])
    assert b.tier.flush(WAIT) and b.tier.stats().queue_depth == 0
    assert b.reuse(prompts[1]) == (4 * PAGE_SIZE, written[1])


def test_only_pages_after_the_local_prefix_are_asked_for(redis_server, make_host):
    a = make_host(fast_config(redis_server.url))
    b = make_host(fast_config(redis_server.url))
    tokens = prompt(PAGE_SIZE * 8 + 2)
    written = a.compute(tokens, 1)
    local = b.compute(tokens[:PAGE_SIZE * 3], 99)        # B computed the first 3 pages itself
    assert b.tier.fetch(tokens, timeout=WAIT) == 5
    stats = b.tier.stats()
    assert stats.hit_pages == 5 and stats.miss_pages == 0
    reused, pages = b.reuse(tokens)
    assert reused == 8 * PAGE_SIZE
    assert pages == local + written[3:]                  # B's own first pages, A's others


def test_namespaces_and_layouts_never_share_pages(redis_server, make_host):
    a = make_host(fast_config(redis_server.url))
    b = make_host(fast_config(redis_server.url))
    other_layout = make_host(fast_config(redis_server.url), page_bytes=PAGE_BYTES * 2)
    tokens = prompt(PAGE_SIZE * 4 + 1)
    a.compute(tokens, 1, namespace=7)
    assert b.tier.fetch(tokens, namespace=8, timeout=WAIT) == 0
    assert other_layout.tier.fetch(tokens, namespace=7, timeout=WAIT) == 0
    assert other_layout.reuse(tokens, namespace=7)[0] == 0
    assert b.tier.fetch(tokens, namespace=7, timeout=WAIT) == 4
    assert b.tier.stats().miss_pages == 4


def test_state_layers_are_part_of_the_layout_fingerprint():
    """Pages whose state layers' slots hold states never share remote values with pages of
    the same shape that hold K/V there (or states in other layers)."""
    def fingerprint(state_layers):
        layout = hostkv.KVLayout(4, 2, 64, "bfloat16", state_layers=state_layers)
        return layout_fingerprint(hostkv.HostKVConfig(num_pages=8, page_size=16,
                                                      kv_layout=layout))

    assert len({fingerprint(()), fingerprint((0, 2)), fingerprint((1, 3))}) == 3
    assert fingerprint((0, 2)) == fingerprint([0, 2])


# -- values that must not be loaded ----------------------------------------------------------

def _corrupt(kind: str, value: bytes, other_layout_value: bytes) -> bytes:
    from hostkv.remote.codec import HEADER
    data = bytearray(value)
    # The header's last fields: namespace u64, then the key's 16-byte digest.
    key_at = HEADER.size - 16
    namespace_at = key_at - 8
    if kind == "checksum":
        data[-1] ^= 0x40                                  # one bit of the KV
    elif kind == "tokens":
        data[HEADER.size] ^= 1                           # the first token id
    elif kind == "truncated":
        del data[-7:]                                    # a value cut short
    elif kind == "magic":
        data[0:4] = b"XXXX"
    elif kind == "format":
        data[4] = 99
    elif kind == "namespace":
        data[namespace_at] ^= 1
    elif kind == "key":
        data[key_at] ^= 1
    elif kind == "layout":
        return other_layout_value                        # same tokens, another layout
    return bytes(data)


@pytest.mark.parametrize("kind", ["checksum", "tokens", "truncated", "magic", "format",
                                  "namespace", "key", "layout"])
def test_a_value_failing_any_check_is_a_counted_miss(redis_server, make_host, kind):
    import redis
    a = make_host(fast_config(redis_server.url))
    b = make_host(fast_config(redis_server.url))
    tokens = prompt(PAGE_SIZE * 5 + 1)
    written = a.compute(tokens, 3)
    client = redis.Redis(port=redis_server.port)
    keys = chain_keys(b"t", 0, layout_fingerprint(b.cache.config), tokens, PAGE_SIZE, 5)
    other = host_config(page_bytes=PAGE_BYTES * 2)
    foreign = encode_value(layout_fingerprint(other), 0, tokens[2 * PAGE_SIZE:3 * PAGE_SIZE],
                           bytes(PAGE_BYTES * 2), key=keys[2])
    client.set(keys[2], _corrupt(kind, client.get(keys[2]), foreign))   # page 2 of 5
    assert b.tier.fetch(tokens, timeout=WAIT) == 2      # pages 0-1 only: the chain stops
    stats = b.tier.stats()
    assert stats.invalid_pages == {kind if kind != "layout" else "layout": 1}
    reused, pages = b.reuse(tokens)
    assert (reused, pages) == (2 * PAGE_SIZE, written[:2])
    # Local service goes on: B computes the rest itself.
    b.compute(tokens, 4)
    assert b.reuse(tokens)[0] == 5 * PAGE_SIZE
    client.close()


def test_a_value_names_its_key_and_a_malformed_key_is_refused():
    """encode_value writes the digest of the key it is stored under, decode_value refuses
    it under any other key, and a key chain_keys could not have made is a ValueError."""
    from hostkv.remote.codec import decode_value, key_digest

    fingerprint = layout_fingerprint(host_config())
    tokens = prompt(2 * PAGE_SIZE)
    first, second = chain_keys(b"t", 0, fingerprint, tokens, PAGE_SIZE, 2)
    assert len(key_digest(first)) == 16 and key_digest(first) != key_digest(second)
    value = encode_value(fingerprint, 0, tokens[:PAGE_SIZE], bytes(PAGE_BYTES), key=first)
    page = tokens[:PAGE_SIZE]
    assert decode_value(value, fingerprint, 0, page, PAGE_BYTES, key=first)[1] == ""
    assert decode_value(value, fingerprint, 0, page, PAGE_BYTES, key=second) == (None, "key")
    for bad in (b"t", b"t:" + b"zz" * 16, b"t:" + first[2:-2], b"t:" + b"\xff" * 32):
        with pytest.raises(ValueError, match="not a hostkv remote key"):
            encode_value(fingerprint, 0, page, bytes(PAGE_BYTES), key=bad)


def test_a_value_of_another_prefix_under_a_key_is_refused(redis_server, make_host):
    """Two prompts whose second pages hold the same tokens after different first pages: the
    second page's value of one, handed back under the other's key (what a store, a proxy
    or a bug that mixes up replies would do), passes the token, namespace and layout checks
    but names another key: refused, and B computes that page itself."""
    import redis
    a = make_host(fast_config(redis_server.url))
    b = make_host(fast_config(redis_server.url))
    same = prompt(PAGE_SIZE, 5)
    first = np.concatenate([prompt(PAGE_SIZE, 1), same, [7]]).astype(np.int32)
    second = np.concatenate([prompt(PAGE_SIZE, 2), same, [7]]).astype(np.int32)
    a.compute(first, 11)
    a.compute(second, 22)
    fingerprint = layout_fingerprint(b.cache.config)
    first_keys = chain_keys(b"t", 0, fingerprint, first, PAGE_SIZE, 2)
    second_keys = chain_keys(b"t", 0, fingerprint, second, PAGE_SIZE, 2)
    client = redis.Redis(port=redis_server.port)
    assert client.get(first_keys[1]) != client.get(second_keys[1])
    client.set(first_keys[1], client.get(second_keys[1]))
    client.close()
    assert b.tier.fetch(first, timeout=WAIT) == 1       # page 0 only
    assert b.tier.stats().invalid_pages == {"key": 1}
    assert b.reuse(first)[0] == PAGE_SIZE


def test_no_room_locally_is_a_counted_insert_failure(redis_server, make_host):
    a = make_host(fast_config(redis_server.url))
    b = make_host(fast_config(redis_server.url), num_pages=8)
    tokens = prompt(PAGE_SIZE * 4 + 1)
    written = a.compute(tokens, 1)
    # Every page of B is held by a live sequence: nothing can be evicted for the fetch.
    hog = b.view.allocate_pages_for_sequences_with_prefix(
        [hostkv.SequenceRequest(500, prompt(PAGE_SIZE * 8, 9))])[0]
    assert b.cache.stats().free_pages == 0
    assert b.tier.fetch(tokens, timeout=WAIT) == 0
    stats = b.tier.stats()
    assert stats.hit_pages == 4 and stats.insert_failed == 4 and stats.inserted_pages == 0
    b.view.release([hog.seq_id], commit=False)
    assert b.tier.fetch(tokens, timeout=WAIT) == 4
    assert b.reuse(tokens) == (4 * PAGE_SIZE, written)


def test_the_tier_shares_the_cache_handle_and_takes_no_lease(redis_server, make_host,
                                                            new_name):
    a = make_host(fast_config(redis_server.url))
    tokens = prompt(PAGE_SIZE * 4 + 1, 77)
    written = a.compute(tokens, 77)
    cache = hostkv.HostKVCache.create(new_name(), host_config())
    try:
        view = hostkv.WorkerView(cache)
        leases = cache._segment.leases()
        assert cache.stats().active_processes == 1
        tier = RemoteTier(cache, fast_config(redis_server.url))
        try:
            # Its two threads work through their own views on this very handle.
            assert tier._fetch_view is not tier._write_view
            assert tier._fetch_view._cache is cache and tier._write_view._cache is cache
            assert tier.fetch(tokens, timeout=WAIT) == 4
            tier.release(view, [])
            assert cache.stats().active_processes == 1
            assert cache._segment.leases() == leases
            # The cache refuses to unmap the pool under the tier's threads.
            with pytest.raises(BufferError):
                cache.close()
        finally:
            tier.close()
        alloc = view.allocate_pages_for_sequences_with_prefix(
            [hostkv.SequenceRequest(1, tokens)])[0]
        assert alloc.reused_tokens == 4 * PAGE_SIZE
        pool = cache.pages_array()
        assert [pool[p].tobytes() for p in alloc.page_table[:4]] == written
        del pool
        view.close()
        cache.check()
    finally:
        cache.close()


def test_engine_threads_share_one_tier(redis_server, make_host):
    import threading
    a = make_host(fast_config(redis_server.url), num_pages=256)
    b = make_host(fast_config(redis_server.url), num_pages=256)
    prompts = [prompt(PAGE_SIZE * 5 + 1, 40 + seed) for seed in range(16)]
    written = {i: a.compute(p, i) for i, p in enumerate(prompts)}
    got: dict = {}

    def engine(first: int) -> None:
        mine = list(range(first, 16, 4))
        looks = b.tier.lookup_many([prompts[i] for i in mine])
        for i, look in zip(mine, looks):
            got[i] = look.wait(WAIT)

    threads = [threading.Thread(target=engine, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT)
    assert sorted(got) == list(range(16)) and set(got.values()) == {5}
    for i, tokens in enumerate(prompts):
        assert b.reuse(tokens) == (5 * PAGE_SIZE, written[i])


# -- a server that fails ----------------------------------------------------------------------

def test_server_killed_then_restarted_empty(redis_server, make_host):
    a = make_host(fast_config(redis_server.url))
    b = make_host(fast_config(redis_server.url))
    tokens = prompt(PAGE_SIZE * 4 + 1)
    a.compute(tokens, 1)
    redis_server.kill()
    # Lookups fail (bounded by the timeouts) until the breaker opens; then they are
    # answered at once, unasked. The host tier serves throughout.
    statuses = [b.tier.lookup(tokens).wait(WAIT) for _ in range(4)]
    assert statuses == [0, 0, 0, 0]
    stats = b.tier.stats()
    assert stats.breaker_opens >= 1 and stats.errors >= 2 and stats.inserted_pages == 0
    b.compute(tokens, 2)                      # local allocate/commit/release, writes dropped
    assert b.reuse(tokens)[0] == 4 * PAGE_SIZE
    wait_until(lambda: b.tier.stats().writes_dropped >= 4, "dropped writes to be counted")
    # Back, empty: the breaker's probe succeeds, host A's next write fills the store again.
    redis_server.start()
    wait_until(lambda: b.tier.lookup(prompt(9, 5)).wait(WAIT) == 0
               and not b.tier.stats().breaker_open, "the breaker to close")
    other = prompt(PAGE_SIZE * 3 + 1, 11)
    wait_until(lambda: a.tier.lookup(prompt(9, 6)).wait(WAIT) == 0
               and not a.tier.stats().breaker_open, "A's breaker to close")
    written = a.compute(other, 3)
    assert b.tier.fetch(other, timeout=WAIT) == 3
    assert b.reuse(other) == (3 * PAGE_SIZE, written)


def test_server_paused_does_not_hang_anyone(redis_server, make_host):
    a = make_host(fast_config(redis_server.url))
    b = make_host(fast_config(redis_server.url, max_queue=8))
    tokens = prompt(PAGE_SIZE * 4 + 1)
    written = a.compute(tokens, 1)
    redis_server.pause()
    try:
        look = b.tier.lookup(tokens)
        assert look.wait(WAIT) == 0 and look.status == "error"      # the socket timeout
        # The engine's own path never waits for the store.
        local = prompt(PAGE_SIZE * 2 + 1, 3)
        seq = b.view.allocate_pages_for_sequences_with_prefix(
            [hostkv.SequenceRequest(99, local)])[0]
        b.tier.release(b.view, [seq.seq_id])
        lookups = b.tier.lookup_many([prompt(9, 100 + s) for s in range(20)])
        for item in lookups:
            item.wait(WAIT)
        assert {item.status for item in lookups} <= {"error", "skipped"}
        assert b.tier.stats().lookups_skipped > 0
    finally:
        redis_server.resume()
    wait_until(lambda: b.tier.lookup(prompt(9, 7)).wait(WAIT) == 0
               and not b.tier.stats().breaker_open, "the breaker to close")
    assert b.tier.fetch(tokens, timeout=WAIT) == 4
    assert b.reuse(tokens) == (4 * PAGE_SIZE, written)


def test_flushed_store_is_refilled_by_later_writes(redis_server, make_host):
    a = make_host(fast_config(redis_server.url))
    b = make_host(fast_config(redis_server.url))
    tokens = prompt(PAGE_SIZE * 4 + 1)
    a.compute(tokens, 1)
    redis_server.cli("flushall")
    assert b.tier.fetch(tokens, timeout=WAIT) == 0
    # A publishes the same prefix again (a later request extends it): the writer asks the
    # store, finds it empty and sends the pages again.
    longer = np.concatenate([tokens[:PAGE_SIZE * 4], prompt(PAGE_SIZE * 2 + 1, 2)])
    written = a.compute(longer, 2)
    assert a.tier.stats().written_pages == 4 + 6
    assert b.tier.fetch(longer, timeout=WAIT) == 6
    assert b.reuse(longer) == (6 * PAGE_SIZE, written)


def test_full_store_drops_writes_and_keeps_serving_reads(redis_server, make_host):
    a = make_host(fast_config(redis_server.url), num_pages=256)
    b = make_host(fast_config(redis_server.url))
    first = prompt(PAGE_SIZE * 2 + 1, 1)
    written = a.compute(first, 1)
    redis_server.cli("config", "set", "maxmemory-policy", "noeviction")
    # A limit below what the server already uses: every write is refused (OOM), reads are
    # still served. (A limit a little above it was flaky: used_memory moves by kilobytes
    # with client buffers, so the writes sometimes fit.)
    used = int(redis_server.cli("info", "memory").split("used_memory:")[1].split()[0])
    redis_server.cli("config", "set", "maxmemory", str(used // 2))
    a.compute(prompt(PAGE_SIZE * 60 + 1, 2), 2)
    stats = a.tier.stats()
    assert stats.errors >= 1 and stats.writes_dropped > 0 and not stats.breaker_open
    assert b.tier.fetch(first, timeout=WAIT) == 2
    assert b.reuse(first) == (2 * PAGE_SIZE, written)


def test_process_killed_mid_fetch_has_its_fresh_pages_reclaimed(redis_server, make_host,
                                                                 new_name, procs, tmp_path):
    a = make_host(fast_config(redis_server.url))
    tokens = prompt(PAGE_SIZE * 6 + 1)
    a.compute(tokens, 1)
    name = new_name()
    cache = hostkv.HostKVCache.create(name, host_config())
    try:
        free = cache.stats().free_pages
        marker = str(tmp_path / "fresh-pages")
        child = procs(remote_worker.die_mid_fetch, name, redis_server.url, tokens, marker)
        child.join(WAIT)
        assert child.exitcode == -9
        with open(marker) as f:
            assert len(f.read().split()) == 6             # died holding 6 filled pages
        assert cache.reap() == 1              # the one lease: the tier shares the handle's
        stats = cache.stats()
        assert stats.free_pages == free and stats.cached_pages == 0
        assert cache.match_prefix(tokens).num_tokens == 0
        cache.check()
    finally:
        cache.close()


# -- configuration and secrets ---------------------------------------------------------------

@pytest.mark.parametrize("url", [
    "", "localhost:6379", "http://localhost", "redis://", "redis://:6379", "redis://h:0",
    "redis://h:65536", "redis://h:port", "redis://h/x", "redis://h/1?db=2", "redis://a,b",
    "redis+cluster://a:1/2", "redis://h?timeout=3", "redis://h?ssl_ca_certs=/x",
    "rediss://h?ssl_cert_reqs=maybe", "unix://", "redis://h h", "redis://h:1#frag",
    "redis://h:1:2", "redis://h?db=1&db=2", "redis://[::1/0",
])
def test_bad_urls_are_config_errors(url):
    with pytest.raises(hostkv.ConfigError):
        RemoteConfig(url)


@pytest.mark.parametrize("field, value", [
    ("key_prefix", ""), ("key_prefix", "a b"), ("key_prefix", 5), ("ttl_seconds", -1),
    ("ttl_seconds", 1.5), ("max_bytes_in_flight", 0), ("max_queue", True),
    ("socket_timeout", 0), ("socket_timeout", float("nan")), ("connect_timeout", "1"),
    ("failure_threshold", 0), ("backoff_initial", -1.0), ("backoff_max", 0.1),
    ("write_batch_pages", 0), ("max_fetch_pages", 0),
])
def test_bad_settings_are_config_errors(field, value):
    with pytest.raises(hostkv.ConfigError, match=field):
        RemoteConfig("redis://localhost", **{field: value})


def test_urls_parse_like_redis_py():
    parsed = parse_url("rediss://user:p%40ss@kv.example:7000/3?ssl_cert_reqs=none")
    assert (parsed.scheme, parsed.nodes, parsed.db, parsed.username, parsed.password,
            parsed.tls, parsed.tls_options) == (
        "rediss", (("kv.example", 7000),), 3, "user", "p@ss", True, {"ssl_cert_reqs": "none"})
    cluster = parse_url("redis+cluster://:pw@a:7000,b:7001,[::1]:7002")
    assert cluster.cluster and cluster.nodes == (("a", 7000), ("b", 7001), ("::1", 7002))
    assert cluster.password == "pw" and parse_url("redis://h").nodes == (("h", 6379),)
    assert parse_url("unix:///run/redis.sock?db=2").path == "/run/redis.sock"


def test_the_tier_needs_prefix_reuse_and_a_cache(segment_name):
    with hostkv.HostKVCache.create(segment_name, host_config(enable_prefix_reuse=False)) as c:
        with pytest.raises(hostkv.ConfigError, match="enable_prefix_reuse"):
            RemoteTier(c, "redis://127.0.0.1:1")
    with pytest.raises(hostkv.ConfigError):
        RemoteTier("not a cache", "redis://127.0.0.1:1")        # type: ignore[arg-type]
    with pytest.raises(hostkv.ConfigError):
        RemoteTier(None, 42)                                     # type: ignore[arg-type]


def test_passwords_work_and_never_show(new_name, make_host, caplog, tmp_path):
    secret = "s3cr3t-Pa55"
    server = RedisServer(str(tmp_path))
    server.start()
    try:
        server.cli("config", "set", "requirepass", secret)
        good = f"redis://default:{secret}@127.0.0.1:{server.port}/0"
        bad = f"redis://default:wrong-{secret}@127.0.0.1:{server.port}/0"
        a = make_host(fast_config(good))
        b = make_host(fast_config(good))
        tokens = prompt(PAGE_SIZE * 3 + 1)
        a.compute(tokens, 1)
        assert b.tier.fetch(tokens, timeout=WAIT) == 3
        caplog.set_level(logging.DEBUG, logger="hostkv.remote")
        c = make_host(fast_config(bad))
        assert c.tier.fetch(tokens, timeout=WAIT) == 0
        c.tier.fetch(tokens, timeout=WAIT)
        assert c.tier.stats().errors >= 1
        shown = [repr(c.tier), str(c.tier.config), repr(c.tier.config),
                 repr(c.tier.config.parsed), repr(c.tier._backend), caplog.text,
                 c.tier.stats().prometheus_text()]
        assert "***" in repr(c.tier.config) and caplog.text
        for text in shown:
            assert secret not in text
        with pytest.raises(hostkv.ConfigError) as info:
            RemoteConfig(f"redis://u:{secret}@h:99999")
        assert secret not in str(info.value)
    finally:
        server.stop()


def test_tls_from_the_url(make_host, tmp_path):
    """rediss:// with the CA from the URL shares pages; a client that cannot verify the
    server's certificate gets errors (counted, bounded), never pages, and serves locally."""
    tls = TLSFiles(str(tmp_path))
    server = RedisServer(str(tmp_path), tls=tls)
    server.start()
    try:
        url = f"rediss://127.0.0.1:{server.port}/0?ssl_ca_certs={tls.ca}"
        a = make_host(fast_config(url))
        b = make_host(fast_config(url))
        tokens = prompt(PAGE_SIZE * 3 + 1)
        written = a.compute(tokens, 1)
        assert a.tier.stats().written_pages == 3
        assert b.tier.fetch(tokens, timeout=WAIT) == 3
        assert b.reuse(tokens) == (3 * PAGE_SIZE, written)
        untrusting = make_host(fast_config(f"rediss://127.0.0.1:{server.port}/0"))
        assert untrusting.tier.fetch(tokens, timeout=WAIT) == 0
        assert untrusting.tier.stats().errors == 1
        plain = make_host(fast_config(f"redis://127.0.0.1:{server.port}/0"))
        assert plain.tier.fetch(tokens, timeout=WAIT) == 0
        assert plain.tier.stats().errors == 1
        assert plain.reuse(tokens)[0] == 0
    finally:
        server.stop()


def test_import_hostkv_and_hostkv_remote_without_redis():
    code = (
        "import sys; sys.modules['redis'] = None\n"
        "import hostkv, hostkv.remote\n"
        "cfg = hostkv.remote.RemoteConfig('redis://127.0.0.1:1')\n"
        "try:\n"
        "    hostkv.remote.RedisBackend(cfg)\n"
        "except hostkv.ConfigError as exc:\n"
        "    assert 'pip install' in str(exc); print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHONWARNINGS": "error"})
    assert out.stdout.strip() == "ok", out.stderr
    # And the core never imports the integration.
    core = subprocess.run([sys.executable, "-c", "import hostkv, sys; "
                           "print('hostkv.remote' in sys.modules, 'redis' in sys.modules)"],
                          capture_output=True, text=True, timeout=60)
    assert core.stdout.strip() == "False False", core.stderr


def test_the_remote_benchmark_runs(redis_server):
    out = subprocess.run(
        [sys.executable, "-m", "hostkv", "bench", "--remote", redis_server.url, "--pages", "32",
         "--page-kib", "4", "--repeats", "1"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "fetch into local pages" in out.stdout and "write-behind" in out.stdout
    assert "ratio" in out.stdout and "engine thread, a miss" in out.stdout
    assert redis_server.cli("dbsize").strip() == "0"          # the benchmark cleans up


def test_a_probe_that_never_reports_back_expires():
    """The open breaker lets one probe through; a probe whose caller never reports an
    outcome (its batch had nothing to send after all, or failed for a reason that is not
    the store's) expires after one call's timeouts, so the breaker cannot stay open for
    good (a probe with no outcome once kept it open until the process restarted)."""
    import time

    from hostkv.remote.breaker import Breaker as _Breaker
    config = RemoteConfig("redis://127.0.0.1:1/0", socket_timeout=0.05, connect_timeout=0.05,
                          failure_threshold=1, backoff_initial=0.01, backoff_max=0.01)
    breaker = _Breaker(config)
    breaker.failure("the store", RuntimeError("down"))
    assert breaker.is_open and not breaker.allow()
    time.sleep(0.02)
    assert breaker.allow()                   # the probe ...
    assert not breaker.allow()               # ... one at a time
    time.sleep(config.connect_timeout + config.socket_timeout + 1.05)
    assert breaker.allow()                   # the unanswered probe expired
    breaker.success()
    assert not breaker.is_open and breaker.allow()


def test_a_forked_child_closes_its_copy_of_the_tier_without_the_parents_locks(
        redis_server, make_host):
    """Found in review: a child forked while a parent thread held the tier's condition
    lock hung in tier.close(), which took that lock. The child's close now only lets go of
    its own references; the tier refuses the child's calls, and its cache then closes."""
    from conftest import run_in_fork

    host = make_host(fast_config(redis_server.url))

    def child() -> int:
        signal.alarm(30)                        # a hang would end the child, not the suite
        with pytest.raises(hostkv.HostKVError, match="forked child"):
            host.tier.lookup(prompt(PAGE_SIZE * 2 + 1))
        with pytest.raises(hostkv.HostKVError, match="forked child"):
            host.tier.release(host.view, [1])
        host.tier.close()                       # the parent's lock is held: must not wait
        host.view.close()
        host.cache.close()
        return 0

    with host.tier._cond:                       # held by a parent thread at the fork
        code = run_in_fork(child)
    assert code == 0
    # The parent's tier is untouched by the child's close.
    assert host.tier.lookup(prompt(PAGE_SIZE * 2 + 1)).wait(WAIT) == 0
    assert not host.tier.closed
