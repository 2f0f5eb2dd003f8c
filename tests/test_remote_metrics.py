"""The remote tier's counters in `python -m hostkv stats`: every process's tier publishes its
counters in the segment's side block (hostkv/remote/shared_stats.py); the CLI, attached from
another process, sums them (`--json`, `--prometheus`, text). Counters of dead processes stay
in the totals; their gauges do not; a process that later takes a dead one's lease slot
counts on top; unlinking the segment removes the block. Real redis-server, real processes."""

from __future__ import annotations

import glob
import json
import multiprocessing
import os
import re
import subprocess
import sys

import hostkv
from hostkv.remote import RemoteTier
from hostkv.remote.tier import SHARED_COUNTERS
from lib.redislib import redis_server  # noqa: F401  (a fixture)
from lib.remotelib import (  # noqa: F401  (make_host is a fixture)
    PAGE_SIZE,
    WAIT,
    fast_config,
    host_config,
    make_host,
    prompt,
    wait_until,
)
from workers import remote_stats_worker

SAMPLE = re.compile(r'^hostkv_[a-z_]+\{segment="[^"]+"(,[a-z]+="[^"]*")*\} [0-9.e+-]+$')


def cli(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "hostkv", *args], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def stats_json(name: str) -> dict:
    return json.loads(cli("stats", name, "--json"))


def check_exposition(text: str) -> dict:
    """Checks the Prometheus text format (0.0.4) line by line: HELP and TYPE once per
    metric family, before its samples; returns {sample name and labels: value}."""
    samples = {}
    typed = {}
    for line in text.strip().splitlines():
        if line.startswith("# HELP "):
            continue
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split(" ")
            assert family not in typed, f"family {family} typed twice"
            assert kind in ("counter", "gauge", "histogram"), line
            typed[family] = kind
            continue
        assert SAMPLE.match(line), line
        key, value = line.rsplit(" ", 1)
        family = key.split("{")[0]
        base = re.sub(r"_(bucket|sum|count)$", "", family)
        assert family in typed or (base in typed and typed[base] == "histogram"), line
        assert key not in samples, f"sample {key} twice"
        samples[key] = float(value)
    return samples


def test_counters_of_two_processes_are_summed_in_stats(redis_server, make_host, new_name,
                                                       procs, tmp_path):
    a = make_host(fast_config(redis_server.url), num_pages=128)
    prompts = [prompt(PAGE_SIZE * n + 1, 300 + n) for n in (3, 5, 7)]
    for seed, tokens in enumerate(prompts):
        a.compute(tokens, seed)
    name = new_name()
    cache = hostkv.HostKVCache.create(name, host_config())
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    done = str(tmp_path / "done")
    try:
        # Before any tier ran on the segment: stats is exactly as without the remote tier.
        plain = stats_json(name)
        assert "remote" not in plain
        assert "hostkv_remote" not in cli("stats", name, "--prometheus")
        assert "remote" not in cli("stats", name)

        workers = [procs(remote_stats_worker.fetch_and_wait, name, redis_server.url,
                         prompts[i], results, done) for i in (0, 1)]
        got = [results.get(timeout=WAIT) for _ in workers]
        assert sorted(inserted for inserted, _ in got) == [3, 5]
        local = [stats for _, stats in got]
        data = stats_json(name)
        remote = data["remote"]
        assert {k: data[k] for k in plain if k != "metrics"}.keys() == \
            {k for k in plain if k != "metrics"}
        for field in ("lookups", "fetches", "hit_pages", "inserted_pages", "bytes_down"):
            assert remote[field] == sum(getattr(s, field) for s in local), field
        assert remote["hit_pages"] == 8 and remote["errors"] == 0
        assert (remote["processes"], remote["tiers"], remote["queue_depth"],
                remote["breaker_open"]) == (2, 2, 0, 0)
        assert sum(remote["fetch_latency_histogram"]) == 2
        assert abs(remote["fetch_seconds"] - sum(s.fetch_seconds for s in local)) < 1e-6
        assert set(remote["invalid_pages"]) >= {"checksum", "layout", "tokens"}

        samples = check_exposition(cli("stats", name, "--prometheus"))
        label = f'{{segment="{name}"}}'
        assert samples[f"hostkv_remote_hit_pages_total{label}"] == 8
        assert samples[f"hostkv_remote_processes{label}"] == 2
        assert samples[f'hostkv_remote_fetch_seconds_count{label}'] == 2
        assert samples[f'hostkv_remote_fetch_seconds_bucket{{segment="{name}",le="+Inf"}}'] == 2
        assert samples[f'hostkv_remote_invalid_pages_total{{segment="{name}",reason="tokens"}}'] \
            == 0
        assert samples[f"hostkv_cached_pages{label}"] == 8     # the segment's own, unchanged
        text = cli("stats", name)
        assert "remote tier (every process):" in text and re.search(r"hit_pages\s+8", text)

        # One worker dies: its counters stay in the totals, its gauges leave them.
        workers[0].kill()
        workers[0].join(WAIT)
        remote = stats_json(name)["remote"]
        assert remote["hit_pages"] == 8 and remote["processes"] == 1 and remote["tiers"] == 1
        # The next process takes the dead one's lease slot (the lowest free), and its slot
        # in the side block: it counts on top of what the dead one counted.
        assert cache.reap() == 1
        third = procs(remote_stats_worker.fetch_and_wait, name, redis_server.url, prompts[2],
                      results, done)
        inserted, stats = results.get(timeout=WAIT)
        assert inserted == 7
        remote = stats_json(name)["remote"]
        assert remote["hit_pages"] == 15 and remote["fetches"] == 3
        assert remote["processes"] == 2
        open(done, "w").close()
        for worker in (workers[1], third):
            worker.join(WAIT)
            assert worker.exitcode == 0
        remote = stats_json(name)["remote"]
        assert remote["hit_pages"] == 15 and (remote["processes"], remote["tiers"]) == (0, 0)
    finally:
        open(done, "w").close()
        cache.close()
    assert glob.glob(f"/dev/shm/{name}@*")
    cli("unlink", name)
    assert glob.glob(f"/dev/shm/{name}@*") == []


def test_gauges_follow_the_queue_and_the_breaker(redis_server, make_host):
    """Two tiers of one process share its slot; queue depth and breaker state are live."""
    from hostkv.__main__ import remote_totals

    # A long socket timeout: the fetch thread waits on a paused server for seconds.
    host = make_host(fast_config(redis_server.url, socket_timeout=5.0))
    second = RemoteTier(host.cache, fast_config(redis_server.url))
    name = host.cache.name

    def totals() -> dict:
        return remote_totals(host.cache._segment, name)

    try:
        assert (totals()["processes"], totals()["tiers"]) == (1, 2)
        redis_server.pause()
        try:
            first = host.tier.lookup(prompt(PAGE_SIZE * 2 + 1, 1))
            wait_until(lambda: host.tier._fetching, "the fetch thread to wait on the store")
            looks = [host.tier.lookup(prompt(PAGE_SIZE * 2 + 1, seed)) for seed in range(2, 6)]
            assert totals()["queue_depth"] == 4 == host.tier.stats().queue_depth
        finally:
            redis_server.resume()
        for look in [first] + looks:
            look.wait(WAIT)
        assert totals()["queue_depth"] == 0
        redis_server.kill()                   # refused at once: the breaker opens
        wait_until(lambda: second.lookup(prompt(9, 1)).wait(WAIT) == 0
                   and second.stats().breaker_open, "the breaker to open")
        assert totals()["breaker_open"] == 1 and totals()["breaker_opens"] >= 1
        assert totals()["errors"] == host.tier.stats().errors + second.stats().errors
        redis_server.start()
        wait_until(lambda: second.lookup(prompt(9, 1)).wait(WAIT) == 0
                   and not second.stats().breaker_open, "the breaker to close")
        remote = stats_json(name)["remote"]
        assert (remote["breaker_open"], remote["queue_depth"], remote["tiers"]) == (0, 0, 2)
        assert remote["lookups"] == host.tier.stats().lookups + second.stats().lookups
    finally:
        second.close()
    assert totals()["tiers"] == 1


def test_a_process_and_every_process_name_each_metric_alike(redis_server, make_host):
    """RemoteStats.prometheus_text() (one process, for an engine's /metrics) and `stats
    --prometheus` (every process's sums) use one set of names: counters end in _total,
    latency is in seconds, and the fetches are the fetch histogram's _count, not a counter
    of their own as well."""
    host = make_host(fast_config(redis_server.url))
    host.tier.lookup(prompt(PAGE_SIZE * 2 + 1)).wait(WAIT)

    def families(text: str) -> dict:
        return {line.split(" ")[2]: line.split(" ")[3] for line in text.splitlines()
                if line.startswith("# TYPE ")}

    own_text = host.tier.stats().prometheus_text()
    own = families(own_text)
    summed = {name: kind for name, kind in
              families(cli("stats", host.cache.name, "--prometheus")).items()
              if name.startswith("hostkv_remote_")}
    assert own.items() <= summed.items()
    assert set(summed) - set(own) == {"hostkv_remote_processes", "hostkv_remote_tiers"}
    assert own["hostkv_remote_fetch_seconds"] == "histogram"
    assert all(name.endswith("_total") for name, kind in own.items() if kind == "counter")
    assert "hostkv_remote_fetches_total" not in summed
    assert not any("_us" in name or name.endswith("_ns") for name in summed)
    assert "hostkv_remote_fetch_seconds_count 1\n" in own_text
    assert "hostkv_remote_lookups_total 1\n" in own_text


def test_every_shared_counter_is_a_remote_stats_counter():
    from hostkv.remote.tier import RemoteStats
    import dataclasses
    fields = {f.name for f in dataclasses.fields(RemoteStats)}
    plain = [n for n in SHARED_COUNTERS if ":" not in n and n != "fetch_ns"]
    assert set(plain) <= fields and "hit_pages" in plain and "errors" in plain


def test_a_segment_created_again_does_not_read_the_old_ones_counters(redis_server,
                                                                     segment_name):
    """The side block is named by the segment's inode: a segment removed behind hostkv's
    back (its side block left over) and created again under the same name starts from
    nothing; unlinking through hostkv removes the blocks of both."""
    import posix_ipc

    cache = hostkv.HostKVCache.create(segment_name, host_config())
    with RemoteTier(cache, fast_config(redis_server.url)) as tier:
        tier.lookup(prompt(PAGE_SIZE * 2 + 1)).wait(WAIT)
    assert stats_json(segment_name)["remote"]["lookups"] == 1
    cache.close()
    posix_ipc.unlink_shared_memory("/" + segment_name)        # not through hostkv
    assert len(glob.glob(f"/dev/shm/{segment_name}@*")) == 1
    cache = hostkv.HostKVCache.create(segment_name, host_config())
    try:
        assert "remote" not in stats_json(segment_name)
        with RemoteTier(cache, fast_config(redis_server.url)) as tier:
            tier.lookup(prompt(PAGE_SIZE * 2 + 1)).wait(WAIT)
            tier.lookup(prompt(PAGE_SIZE * 2 + 1)).wait(WAIT)
        assert stats_json(segment_name)["remote"]["lookups"] == 2
        assert len(glob.glob(f"/dev/shm/{segment_name}@*")) == 2
    finally:
        cache.close()
    hostkv.HostKVCache.unlink_segment(segment_name)
    assert glob.glob(f"/dev/shm/{segment_name}@*") == []


def test_a_damaged_side_block_is_left_unshared_and_stats_still_answer(redis_server,
                                                                      segment_name):
    """Found in review: a file at the side block's path shorter than its header raised
    struct.error out of RemoteTier() and `python -m hostkv stats`. The tier now works on
    with its counters unshared, and stats answers without a remote section."""
    from hostkv.remote.shared_stats import side_path

    cache = hostkv.HostKVCache.create(segment_name, host_config())
    try:
        path = side_path(segment_name, os.stat(f"/dev/shm/{segment_name}").st_ino)
        with open(path, "wb") as damaged:
            damaged.write(b"123456789")
        with RemoteTier(cache, fast_config(redis_server.url)) as tier:
            tier.lookup(prompt(PAGE_SIZE * 2 + 1)).wait(WAIT)
            assert tier.stats().lookups == 1
        assert "remote" not in stats_json(segment_name)
    finally:
        cache.close()
    hostkv.HostKVCache.unlink_segment(segment_name)
    assert glob.glob(f"/dev/shm/{segment_name}@*") == []
