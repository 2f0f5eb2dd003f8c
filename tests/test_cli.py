"""`python -m hostkv`: inspect, stats, check, unlink and the benchmark's smoke run."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

import hostkv
from hostkv import _pages, _radix

from conftest import small_config


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hostkv", *args], capture_output=True,
                          text=True, timeout=120)


def test_inspect_stats_check_unlink(segment_name):
    cache = hostkv.HostKVCache.create(segment_name, small_config())
    try:
        tokens = np.arange(12, dtype=np.int32)
        pages = _pages.alloc_pages(cache._segment, 3)
        _radix.insert(cache._segment, tokens, pages, 0)
        _pages.free_pages(cache._segment, pages)   # the tree keeps its own references
        generation = cache.stats().generation

        inspect = run_cli("inspect", segment_name, "--json")
        assert inspect.returncode == 0, inspect.stderr
        report = json.loads(inspect.stdout)
        assert report["state"] == "ready"
        assert report["tree"]["nodes"] == 1 and report["tree"]["depth_pages"] == 3
        assert [lease["alive"] for lease in report["leases"]] == [True]
        assert "largest_prefixes" in report["tree"]

        stats = run_cli("stats", segment_name, "--json")
        assert stats.returncode == 0, stats.stderr
        assert json.loads(stats.stdout)["cached_pages"] == 3

        check = run_cli("check", segment_name)
        assert check.returncode == 0 and "ok" in check.stdout

        # Observers take no lease and reap nobody: the segment did not change.
        after = cache.stats()
        assert after.generation == generation and after.active_processes == 1
    finally:
        cache.close()
    unlink = run_cli("unlink", segment_name)
    assert unlink.returncode == 0
    missing = run_cli("stats", segment_name)
    assert missing.returncode == 2 and "No such file" in missing.stderr


def test_check_reports_corruption_with_status_1(segment_name):
    cache = hostkv.HostKVCache.create(segment_name, small_config())
    try:
        refcounts_at = cache._segment.header_info()["regions"]["reg_page_refcounts"]
        import mmap
        import posix_ipc

        shm = posix_ipc.SharedMemory("/" + segment_name)
        raw = mmap.mmap(shm.fd, shm.size)
        shm.close_fd()
        raw[refcounts_at:refcounts_at + 4] = (7).to_bytes(4, "little")
        raw.close()
        result = run_cli("check", segment_name)
        assert result.returncode == 1 and "CORRUPT" in result.stderr
    finally:
        cache.close()


def test_bench_quick_smoke(tmp_path):
    out = tmp_path / "bench.json"
    result = run_cli("bench", "--quick", "--json", str(out))
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    names = {row["workload"] for row in report["workloads"]}
    assert {"shared-prompt", "multi-turn"} <= names
    for row in report["workloads"]:
        assert row["compiled"]["hit_rate"] > 0.5
        assert row["compiled"]["tokens_per_s"] > 0
