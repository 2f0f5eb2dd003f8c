"""`python -m hostkv bench --remote URL`: the remote tier against plain redis-py, same server.

    python -m hostkv bench --remote redis://127.0.0.1:6379/0 [--pages 1024] [--page-kib 256]
    python -m hostkv bench --remote redis+cluster://h1:7000,h2:7001,h3:7002 --quick

Three figures, each against a baseline measured in the same run:

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
    args = parser.parse_args(argv)
    if args.quick:
        args.pages, args.page_kib, args.repeats = 256, 64, 5
    if args.pages < 32 or args.page_kib < 1 or args.repeats < 1:
        parser.error("--pages must be at least 32, --page-kib and --repeats at least 1")
    try:
        result = run(args.remote, args.pages, args.page_kib, args.repeats, args.seed)
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
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
