"""`python -m hostkv bench --remote URL`: the remote tier against plain redis-py, same server.

    python -m hostkv bench --remote redis://127.0.0.1:6379/0 [--pages 1024] [--page-kib 256]
    python -m hostkv bench --remote redis+cluster://h1:7000,h2:7001,h3:7002 --quick

Four figures, each against a baseline measured in the same run:

1. Fetch: a host with an empty segment fetches every page another host wrote (lookups for
   all the prompts queued together: one round trip), checks each value and copies it into
   fresh local pages. Baseline: one plain pipelined MGET (``mget_nonatomic`` on a cluster)
   of the same keys by redis-py, the bytes left in Python. Target: >= 0.8x its throughput.
2. A remote miss on the engine's thread: allocate + release of a prompt nobody has, alone
   and after ``tier.lookup()`` (queued, not waited for). Target: no cost beyond queueing.
   The blocking form (``fetch``: a round trip) is shown beside it.
3. Write-behind: the host releases sequences through the tier and the writer sends them
   (borrow, copy, checksum, pipelined SET; then again, best of the repeats, into a store
   without those keys). Baseline: plain pipelined SETs of the same values by redis-py,
   interleaved with the tier's runs.
4. Write policies (``write_policy="through"`` vs ``"evict"``) on one workload: host A, a
   small segment under eviction pressure, serves multi-turn chats over a few shared system
   prompts (KV written into every fresh page, released through its tier); then host B, a
   roomy segment, serves the same requests, and host C other chats over the same system
   prompts, each fetching from the store before every request. Per policy: pages and
   bytes A sent, how many of the pages A evicted were in the store in time, A's wall time
   against the same loop with no tier (the baseline), A's engine thread's time in
   release, and the pages B and C got from the store and the tokens they still prefilled. "evict, pages only" sends the
   evicted pages without the chain prefix they need (a remote reader walks from page 0).

Keys go under a fresh prefix and are deleted at the end; segments are unlinked.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from typing import Any, Dict, List, Optional

import numpy as np

import hostkv
from hostkv.remote.backend import RedisBackend
from hostkv.remote.codec import chain_keys, layout_fingerprint
from hostkv.remote.config import RemoteConfig
from hostkv.remote.tier import RemoteTier

__all__ = ["main", "run"]

PAGE_SIZE = 16


def _segment(name: str, pages: int, page_bytes: int) -> hostkv.HostKVCache:
    return hostkv.HostKVCache.create(name, hostkv.HostKVConfig(
        num_pages=pages + 64, page_size=PAGE_SIZE, page_bytes=page_bytes, max_processes=8))


def _best(values: List[float]) -> float:
    return min(values)


def run(url: str, pages: int, page_kib: int, repeats: int, seed: int) -> Dict[str, Any]:
    """Runs the three measurements; returns the figures (seconds, bytes, ratios)."""
    page_bytes = page_kib * 1024
    prefix = f"hostkv-bench-{uuid.uuid4().hex[:10]}"
    config = RemoteConfig(url, key_prefix=prefix, max_queue=1 << 16,
                          max_bytes_in_flight=max(256 << 20, 2 * pages * page_bytes),
                          socket_timeout=30.0, connect_timeout=5.0)
    backend = RedisBackend(config)
    backend.ping()
    client = backend._client
    # The baseline: redis-py as an application would use it, defaults and all.
    import redis
    parsed = config.parsed
    if parsed.cluster:
        from redis.cluster import ClusterNode, RedisCluster
        plain_client: Any = RedisCluster(
            startup_nodes=[ClusterNode(h, p) for h, p in parsed.nodes],
            username=parsed.username, password=parsed.password, ssl=parsed.tls,
            **parsed.tls_options)
    else:
        plain_client = redis.Redis.from_url(url)
    rng = np.random.default_rng(seed)
    per_prompt = 32                                      # pages per prompt
    prompts = [rng.integers(0, 30_000, per_prompt * PAGE_SIZE + 1, dtype=np.int32)
               for _ in range(max(1, pages // per_prompt))]
    total_pages = len(prompts) * per_prompt
    names = [f"hostkv-bench-remote-{os.getpid()}-{uuid.uuid4().hex[:6]}-{h}" for h in "abc"]
    caches = []
    out: Dict[str, Any] = {"url": config.redacted_url, "pages": total_pages,
                           "page_bytes": page_bytes}
    try:
        a = _segment(names[0], total_pages, page_bytes)
        caches.append(a)
        b = _segment(names[1], total_pages, page_bytes)
        caches.append(b)
        # -- 3. write-behind ------------------------------------------------------------
        view = hostkv.WorkerView(a)
        pool = a.pages_array()
        tier_a = RemoteTier(a, config)
        allocs = view.allocate_pages_for_sequences_with_prefix(
            [hostkv.SequenceRequest(i, p) for i, p in enumerate(prompts)])
        for alloc in allocs:
            for page in alloc.page_table:
                pool[page] = rng.integers(0, 256, page_bytes, dtype=np.uint8)
        del pool
        start = time.perf_counter()
        tier_a.release(view, list(range(len(prompts))))
        assert tier_a.flush(600)
        write_s = [time.perf_counter() - start]
        write_stats = tier_a.stats()
        keys = []
        for p in prompts:
            keys += chain_keys(prefix.encode(), 0, layout_fingerprint(b.config), p, PAGE_SIZE,
                               per_prompt)
        fetched = backend.get_many(keys)
        values = [v for v in fetched if isinstance(v, bytes)]
        if len(values) != len(keys):
            raise RuntimeError(f"the writer stored {len(values)} of {len(keys)} pages")
        value_bytes = sum(len(v) for v in values)
        plain_set = []
        for repeat in range(repeats):     # interleaved: both see the same machine load
            scratch = [(k + b":plain", v) for k, v in zip(keys, values)]
            start = time.perf_counter()
            for first in range(0, len(scratch), 64):
                pipe = plain_client.pipeline(transaction=False)
                for key, value in scratch[first:first + 64]:
                    pipe.set(key, value, ex=600)
                pipe.execute()
            plain_set.append(time.perf_counter() - start)
            client.delete(*[k for k, _ in scratch])      # split by slot on a cluster
            if repeat < repeats - 1:
                # The tier again, into a store without those keys as the first time (and
                # as the baseline's, deleted each time): publish resends every page.
                client.delete(*keys)
                start = time.perf_counter()
                for p in prompts:
                    tier_a.publish(p, 0, computed_from=0)
                assert tier_a.flush(600)
                write_s.append(time.perf_counter() - start)
        tier_a.close()
        view.close()
        out["write_behind"] = {
            "seconds": _best(write_s), "first_seconds": write_s[0],
            "pages": write_stats.written_pages,
            "GB_per_s": value_bytes / _best(write_s) / 1e9,
            "plain_pipelined_set_GB_per_s": value_bytes / _best(plain_set) / 1e9,
            "ratio": _best(plain_set) / _best(write_s)}
        # -- 1. fetch ----------------------------------------------------------------------
        tier_b = RemoteTier(b, config)
        fetch_s = []
        mget_s = []
        for _ in range(repeats):            # interleaved: both see the same machine load
            b.evict(b.config.num_pages)
            assert b.stats().cached_pages == 0
            start = time.perf_counter()
            got = tier_b.fetch_many(prompts, timeout=600)
            fetch_s.append(time.perf_counter() - start)
            assert sum(got) == total_pages, f"fetched {sum(got)} of {total_pages} pages"
            start = time.perf_counter()
            plain = (plain_client.mget_nonatomic(keys) if parsed.cluster
                     else plain_client.mget(keys))
            mget_s.append(time.perf_counter() - start)
            assert len(plain) == len(keys)
            del plain
        out["fetch"] = {
            "seconds": _best(fetch_s), "GB_per_s": value_bytes / _best(fetch_s) / 1e9,
            "plain_mget_seconds": _best(mget_s),
            "plain_mget_GB_per_s": value_bytes / _best(mget_s) / 1e9,
            "ratio": _best(mget_s) / _best(fetch_s)}
        # -- 2. a miss on the engine's thread ---------------------------------------------
        c = _segment(names[2], 256, page_bytes)
        caches.append(c)
        tier_c = RemoteTier(c, config)
        view_c = hostkv.WorkerView(c)
        misses = [rng.integers(0, 30_000, 8 * PAGE_SIZE + 1, dtype=np.int32) for _ in range(200)]

        def engine(lookup: str) -> float:
            times = []
            for i, tokens in enumerate(misses):
                start = time.perf_counter_ns()
                if lookup == "call":
                    tier_c.lookup(tokens)
                    times.append(time.perf_counter_ns() - start)
                    tier_c.flush(60)
                    continue
                if lookup == "queued":
                    tier_c.lookup(tokens)
                elif lookup == "blocking":
                    tier_c.fetch(tokens)
                view_c.allocate_pages_for_sequences_with_prefix(
                    [hostkv.SequenceRequest(i, tokens)])
                view_c.release([i], commit=False)
                times.append(time.perf_counter_ns() - start)
                tier_c.flush(60)            # the fetch thread idle again between samples
            return statistics.median(times) / 1e3

        engine("none")                       # warm up
        out["miss_on_engine_thread_us"] = {
            "allocate_alone": engine("none"), "lookup_call_alone": engine("call"),
            "lookup_queued_then_allocate": engine("queued"),
            "blocking_fetch_then_allocate": engine("blocking")}
        out["remote_stats_b"] = {k: v for k, v in tier_b.stats().__dict__.items()
                                 if k != "fetch_latency_histogram"}
        tier_b.close()
        tier_c.close()
        view_c.close()
    finally:
        for cache, name in zip(caches, names):
            try:
                cache.close()
            finally:
                hostkv.HostKVCache.unlink_segment(name)
        try:
            for key in client.scan_iter(match=f"{prefix}:*", count=1000):
                client.delete(key)
        finally:
            backend.close()
            plain_client.close()
    return out


POLICIES = ("none", "through", "evict", "evict, pages only")


def _chat_requests(rng: np.random.Generator, count: int, systems: List[np.ndarray]
                   ) -> List[np.ndarray]:
    """count prompts: chats of 2-4 turns over the 3 system prompts, each turn resending the
    chat so far plus 2-6 new pages (an answer and a question); full pages plus one token."""
    prompts: List[np.ndarray] = []
    chat = 0
    while len(prompts) < count:
        history = systems[chat % 3]
        for _ in range(int(rng.integers(2, 5))):
            history = np.concatenate([history, rng.integers(
                0, 30_000, int(rng.integers(2, 7)) * PAGE_SIZE, dtype=np.int32)])
            prompts.append(np.append(history, np.int32(1)))
        chat += 1
    return prompts[:count]


def _serve(cache: hostkv.HostKVCache, tier: Optional[RemoteTier], prompts: List[np.ndarray],
           fetch: bool, prefill_tokens_per_s: float) -> Dict[str, Any]:
    """Serves prompts one at a time: (fetch,) allocate, "prefill" (write KV into the fresh
    pages, and wait as a device computing them at prefill_tokens_per_s would: the engine's
    thread waits without the GIL), release (through the tier when there is one and not
    fetching)."""
    view = hostkv.WorkerView(cache)
    pool = cache.pages_array()
    tier_ns = 0
    prefilled = reused = 0
    start = time.perf_counter()
    for seq_id, tokens in enumerate(prompts):
        if fetch and tier is not None:
            tier.fetch(tokens, timeout=60)
        alloc = view.allocate_pages_for_sequences_with_prefix(
            [hostkv.SequenceRequest(seq_id, tokens)])[0]
        fresh = alloc.page_table[alloc.num_shared_pages:]
        pool[fresh] = seq_id & 0xFF                   # "KV": one store per byte, as a prefill
        time.sleep((len(tokens) - alloc.reused_tokens) / prefill_tokens_per_s)
        prefilled += len(tokens) - alloc.reused_tokens
        reused += alloc.reused_tokens
        began = time.perf_counter_ns()
        if tier is not None and not fetch:
            tier.release(view, [seq_id])
        else:
            view.release([seq_id])
        tier_ns += time.perf_counter_ns() - began
    seconds = time.perf_counter() - start
    del pool
    view.close()
    return {"seconds": seconds, "release_us_per_request": tier_ns / 1e3 / len(prompts),
            "prefilled_tokens": prefilled, "reused_tokens": reused}


def _host_a(url: str, policy: str, prefix: str, pool_pages: int, page_bytes: int,
            prompts: List[np.ndarray], prefill_tokens_per_s: float) -> Dict[str, Any]:
    """Host A under one policy, on a fresh segment and key prefix: its figures."""
    name = f"hostkv-bench-policy-{os.getpid()}-{uuid.uuid4().hex[:6]}-a"
    a = hostkv.HostKVCache.create(name, hostkv.HostKVConfig(
        num_pages=pool_pages, page_size=PAGE_SIZE, page_bytes=page_bytes, max_processes=8))
    try:
        tier = None
        if policy != "none":
            tier = RemoteTier(a, RemoteConfig(
                url, key_prefix=prefix, socket_timeout=30.0, connect_timeout=5.0,
                max_queue=1 << 16, write_policy="through" if policy == "through" else "evict"))
            if tier._evict_writer is not None:
                tier._evict_writer.send_prefix = policy == "evict"
        try:
            served = _serve(a, tier, prompts, False, prefill_tokens_per_s)
            row: Dict[str, Any] = {"a_seconds": served["seconds"],
                                   "a_release_us": served["release_us_per_request"],
                                   "a_evicted_pages": a.stats().evicted_pages}
            if tier is not None:
                assert tier.flush(600)
                st = tier.stats()
                row.update(sent_pages=st.written_pages, sent_bytes=st.bytes_up,
                           writes_dropped=st.writes_dropped)
                # Of the distinct pages A evicted, how many the store had in time.
                fingerprint = layout_fingerprint(a.config)
                local, every = set(), set()
                for tokens in prompts:
                    keys = chain_keys(prefix.encode(), 0, fingerprint, tokens, PAGE_SIZE,
                                      len(tokens) // PAGE_SIZE)
                    every.update(keys)
                    local.update(keys[:len(a.match_prefix(tokens).pages)])
                evicted = sorted(every - local)
                present = tier._backend.touch_many(evicted, 600) if evicted else []
                # None: the key's node did not answer (a cluster's); not known to be there.
                row.update(evicted_distinct=len(evicted),
                           evicted_in_store=sum(1 for there in present if there))
        finally:
            if tier is not None:
                tier.close()
    finally:
        try:
            a.close()
        finally:
            hostkv.HostKVCache.unlink_segment(name)
    return row


def _other_host(url: str, prefix: str, page_bytes: int, traffic: List[np.ndarray],
                prefill_tokens_per_s: float) -> Dict[str, Any]:
    """A roomy host serving traffic, fetching from the store before each request."""
    name = f"hostkv-bench-policy-{os.getpid()}-{uuid.uuid4().hex[:6]}-b"
    b = hostkv.HostKVCache.create(name, hostkv.HostKVConfig(
        num_pages=sum(len(p) // PAGE_SIZE for p in traffic) + 64, page_size=PAGE_SIZE,
        page_bytes=page_bytes, max_processes=8))
    try:
        with RemoteTier(b, RemoteConfig(url, key_prefix=prefix, socket_timeout=30.0,
                                        connect_timeout=5.0)) as tier:
            served = _serve(b, tier, traffic, True, prefill_tokens_per_s)
            return {"fetched_pages": tier.stats().inserted_pages,
                    "prefilled_tokens": served["prefilled_tokens"]}
    finally:
        try:
            b.close()
        finally:
            hostkv.HostKVCache.unlink_segment(name)


def run_policies(url: str, page_kib: int, requests: int, pool_pages: int, seed: int,
                 prefill_tokens_per_s: float = 100_000.0, repeats: int = 1) -> Dict[str, Any]:
    """Measurement 4: the write policies side by side on one workload (see the module
    docstring). Host A runs `repeats` times per policy, the policies interleaved (each
    round sees the same machine load), each time on a fresh segment and key prefix; its
    wall time and release cost are the best of them, the rest from the last round. Then
    hosts B and C read what the last round wrote."""
    page_bytes = page_kib * 1024
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, 30_000, 16 * PAGE_SIZE, dtype=np.int32) for _ in range(3)]
    prompts = _chat_requests(rng, requests, systems)
    # Another host's own traffic: other chats over the same system prompts.
    others = _chat_requests(np.random.default_rng(seed + 1), requests, systems)
    root = f"hostkv-bench-{uuid.uuid4().hex[:10]}"
    probe = RedisBackend(RemoteConfig(url, key_prefix=root))
    probe.ping()
    client = probe._client
    out: Dict[str, Any] = {"requests": len(prompts), "pool_pages": pool_pages,
                           "prefill_tokens_per_s": prefill_tokens_per_s,
                           "page_bytes": page_bytes, "repeats": repeats,
                           "prompt_pages": sum(len(p) // PAGE_SIZE for p in prompts),
                           "other_prompt_pages": sum(len(p) // PAGE_SIZE for p in others)}
    try:
        rows: Dict[str, Dict[str, Any]] = {}
        prefixes: Dict[str, str] = {}
        for round_ in range(repeats):
            for index, policy in enumerate(POLICIES):
                prefixes[policy] = f"{root}-{index}-{round_}"
                row = _host_a(url, policy, prefixes[policy], pool_pages, page_bytes, prompts,
                              prefill_tokens_per_s)
                best = rows.get(policy)
                if best is not None:
                    row["a_seconds"] = min(row["a_seconds"], best["a_seconds"])
                    row["a_release_us"] = min(row["a_release_us"], best["a_release_us"])
                rows[policy] = row
        for policy in POLICIES:
            row = rows[policy]
            # B: A's requests again (a router that moved them); C: other chats.
            for key, traffic in (("b", prompts), ("c", others)):
                got = _other_host(url, prefixes[policy], page_bytes, traffic,
                                  prefill_tokens_per_s)
                row[f"{key}_fetched_pages"] = got["fetched_pages"]
                row[f"{key}_prefilled_tokens"] = got["prefilled_tokens"]
            out[policy] = row
    finally:
        try:
            for key in client.scan_iter(match=f"{root}-*", count=1000):
                client.delete(key)
        finally:
            probe.close()
    return out


def print_policies(result: Dict[str, Any]) -> None:
    """The write-policy table of measurement 4."""
    base = result["none"]
    print(f"  write policies: {result['requests']} chat requests ({result['prompt_pages']} "
          f"prompt pages) on host A ({result['pool_pages']} pages of "
          f"{result['page_bytes'] // 1024} KiB, {base['a_evicted_pages']} evicted; prefill "
          f"{result['prefill_tokens_per_s']:.0f} tokens/s); then host B serves the same "
          f"requests, host C other chats ({result['other_prompt_pages']} prompt pages) over "
          "the same system prompts")
    print(f"    {'policy':<18} {'A sent':>7} {'MiB':>6} {'evicted, in store':>18} "
          f"{'A wall':>7} {'A release':>10} {'B fetched':>10} {'B prefill':>10} "
          f"{'C fetched':>10} {'C prefill':>10}")
    for policy in POLICIES:
        row = result[policy]
        saved = (f"{row['evicted_in_store']}/{row['evicted_distinct']}"
                 if "evicted_distinct" in row else "-")
        print(f"    {policy:<18} {row.get('sent_pages', 0):>7} "
              f"{row.get('sent_bytes', 0) / 2**20:>6.1f} {saved:>18} "
              f"{row['a_seconds'] / base['a_seconds']:>6.2f}x {row['a_release_us']:>7.0f} us "
              f"{row['b_fetched_pages']:>10} {row['b_prefilled_tokens']:>10} "
              f"{row['c_fetched_pages']:>10} {row['c_prefilled_tokens']:>10}")


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of `python -m hostkv bench --remote URL`."""
    parser = argparse.ArgumentParser(prog="python -m hostkv bench --remote",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--remote", metavar="URL", required=True)
    parser.add_argument("--pages", type=int, default=1024, help="pages to move (default 1024)")
    parser.add_argument("--page-kib", type=int, default=256, help="KiB per page (default 256)")
    parser.add_argument("--repeats", type=int, default=3, help="best of (default 3)")
    parser.add_argument("--quick", action="store_true", help="256 pages of 64 KiB, best of 5")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--policy-requests", type=int, default=240,
                        help="requests of the write-policy comparison (default 240; 0 skips it)")
    parser.add_argument("--policy-pool", type=int, default=512,
                        help="host A's pages in the write-policy comparison (default 512)")
    parser.add_argument("--policy-page-kib", type=int, default=32,
                        help="KiB per page in the write-policy comparison (default 32)")
    parser.add_argument("--policy-prefill", type=float, default=100_000.0, metavar="TOK_S",
                        help="the simulated engine's prefill speed, tokens/s (default 100000)")
    args = parser.parse_args(argv)
    if args.quick:
        args.pages, args.page_kib, args.repeats = 256, 64, 5
        args.policy_requests, args.policy_pool = min(args.policy_requests, 120), 256
    if args.pages < 32 or args.page_kib < 1 or args.repeats < 1:
        parser.error("--pages must be at least 32, --page-kib and --repeats at least 1")
    if args.policy_requests < 0 or args.policy_page_kib < 1 or not (
            0 < args.policy_prefill < float("inf")) or (
            args.policy_requests and args.policy_pool < 256):
        parser.error("--policy-requests must be >= 0, --policy-page-kib >= 1 and "
                     "--policy-pool >= 256 (one chat's prompt must fit)")
    try:
        result = run(args.remote, args.pages, args.page_kib, args.repeats, args.seed)
        if args.policy_requests:
            result["write_policies"] = run_policies(args.remote, args.policy_page_kib,
                                                    args.policy_requests, args.policy_pool,
                                                    args.seed, args.policy_prefill,
                                                    args.repeats)
    except hostkv.ConfigError as exc:
        parser.error(str(exc))
    mb = result["pages"] * result["page_bytes"] / 2**20
    print(f"remote tier vs plain redis-py on {result['url']}: {result['pages']} pages of "
          f"{result['page_bytes'] // 1024} KiB ({mb:.0f} MiB)")
    f, w, m = result["fetch"], result["write_behind"], result["miss_on_engine_thread_us"]
    print(f"  fetch into local pages  {f['GB_per_s']:6.2f} GB/s   plain MGET "
          f"{f['plain_mget_GB_per_s']:6.2f} GB/s   ratio {f['ratio']:.2f}x (target >= 0.8x)")
    print(f"  write-behind            {w['GB_per_s']:6.2f} GB/s   plain SET pipeline "
          f"{w['plain_pipelined_set_GB_per_s']:6.2f} GB/s   ratio {w['ratio']:.2f}x")
    print(f"  engine thread, a miss:  allocate alone {m['allocate_alone']:.0f} us; lookup() "
          f"call {m['lookup_call_alone']:.0f} us; queued lookup + allocate "
          f"{m['lookup_queued_then_allocate']:.0f} us (the fetch thread runs beside it); "
          f"blocking fetch + allocate {m['blocking_fetch_then_allocate']:.0f} us (medians)")
    if "write_policies" in result:
        print_policies(result["write_policies"])
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
