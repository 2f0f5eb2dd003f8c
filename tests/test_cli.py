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
        # Read without the lock: a locked call may run this process's own once-a-second
        # lease sweep, which commits (and bumps the generation) when the CLI runs are slow.
        generation = cache._segment.header_info()["generation"]

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
        after = cache._segment.header_info()
        assert after["generation"] == generation and after["active_leases"] == 1
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
    """The benchmark's quick run: every section is there and its hit rates make sense.
    Speed is never asserted (shared machines are noisy)."""
    out = tmp_path / "bench.json"
    result = run_cli("bench", "--quick", "--json", str(out))
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    for section in ("engine:", "eviction:", "processes:", "KV data path:", "pool faults:",
                    "tree:"):
        assert section in result.stdout

    assert report["ceilings"]["compare_tokens_per_s"] > 0
    assert report["ceilings"]["copy_bytes_per_s"] > 0
    assert report["reference_model"]            # run from a source checkout
    engine = {row["workload"]: row for row in report["engine"]}
    assert set(engine) == {"shared-prompt", "multi-turn", "no-sharing", "short-prompt",
                           "eviction"}
    for name, row in engine.items():
        compiled = row["compiled"]
        # List input is the same requests in another format: the same reuse and evictions.
        assert row["compiled_list"]["hit_rate"] == compiled["hit_rate"]
        assert row["compiled_list"]["evicted_pages"] == compiled["evicted_pages"]
        # The hash chain (vLLM's algorithm) runs where nothing is evicted, and then reuses
        # exactly what the tree reuses.
        if name == "eviction":
            assert "hash_chain" not in row
        else:
            assert row["hash_chain"]["hit_rate"] == compiled["hit_rate"]
            assert row["speedup_vs_hash_chain"] > 0 and row["list_speedup_vs_hash_chain"] > 0
        assert compiled["tokens_per_s"] > 0 and compiled["call_latency"]["p99_us"] > 0
        if name == "no-sharing":
            assert compiled["hit_rate"] == 0
        elif name == "short-prompt":
            assert compiled["hit_rate"] > 0.3        # a 96-token preamble of 100-300
        else:
            assert compiled["hit_rate"] > 0.5
        assert (compiled["evicted_pages"] > 0) == (name == "eviction")
        # The reference runs the same engine flow with the same LRU: the same reuse and the
        # same evictions, page for page.
        assert row["reference"]["hit_rate"] == compiled["hit_rate"]
        assert row["reference"]["evicted_pages"] == compiled["evicted_pages"]

    eviction = report["eviction"]
    assert eviction["evicted_pages"] > 0 and eviction["ns_per_token"] > 0
    demand = report["eviction_by_demand"]
    assert 0 < demand["evicted_pages"] < demand["allocated_pages"] and demand["ns_per_token"] > 0

    decode = {row["batch"]: row for row in report["decode"]}
    assert set(decode) == {1, 8, 32, 128}
    for row in decode.values():
        assert row["ns_per_sequence_step"] > 0 and row["list_append_ns"] > 0
        assert row["vs_list_append"] == row["ns_per_sequence_step"] / row["list_append_ns"]

    runs = {(row["workload"], row["processes"]): row for row in report["processes"]}
    assert set(runs) == {(w, n) for w in ("shared-prompt", "multi-turn") for n in (1, 2, 4)}
    for (name, count), row in runs.items():
        assert row["hit_rate"] > 0.5 and row["tokens_per_s"] > 0
        assert row["call_latency"]["p50_us"] > 0
        assert row["vs_one_process"] == row["tokens_per_s"] / runs[(name, 1)]["tokens_per_s"]
        if "lock" in row:
            # The counters are read after every worker attached and before any started:
            # the workers' own requests, at least one lock per allocate and per release.
            assert row["lock"]["acquisitions"] >= 2 * row["requests"]
            assert row["lock"]["hold_mean_ns"] > 0

    rates = report["data_path"]["gbytes_per_s"]
    assert {"copy_ceiling", "numpy_gather", "numpy_scatter"} <= set(rates)
    if report["machine"]["torch"]:
        assert {"tensor_gather", "plain_gather", "tensor_scatter", "plain_scatter"} <= set(rates)
        assert set(report["data_path"]["pages_tensor_vs_plain"]) == {"gather", "scatter"}
    assert all(rate > 0 for rate in rates.values())

    faults = report["pool_faults"]
    assert faults["prefault_state"] == "done"
    assert set(faults["gbytes_per_s"]) == {"cold", "prefaulted", "plain", "prefault"}
    assert all(rate > 0 for rate in faults["gbytes_per_s"].values())

    tree = {row["workload"]: row for row in report["tree"]}
    assert set(tree) == {"shared-prompt", "multi-turn"}
    for row in tree.values():
        assert row["compiled"]["hit_rate"] > 0.5
        assert row["reference"]["hit_rate"] == row["compiled"]["hit_rate"]
