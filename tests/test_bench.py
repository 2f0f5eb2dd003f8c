"""`python -m hostkv bench --section`: the sections named run alone, and the report holds
only them. (The whole quick run is tests/test_cli.py's smoke test; speed is never asserted.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hostkv import bench

BASE_KEYS = {"machine", "seed", "quick", "page_size", "reference_model"}


def run_bench(tmp_path, *args: str) -> tuple:
    out = tmp_path / "bench.json"
    result = subprocess.run([sys.executable, "-m", "hostkv", "bench", "--quick", "--json",
                             str(out), *args], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout, json.loads(out.read_text())


def test_sections_named_run_alone(tmp_path):
    stdout, report = run_bench(tmp_path, "--section", "decode", "--section", "eviction")
    assert set(report) == BASE_KEYS | {"eviction", "eviction_by_demand", "decode"}
    titles = {line.split(":")[0] for line in stdout.splitlines() if ":" in line}
    assert {"decode", "eviction"} <= titles
    assert not titles & {"engine", "processes", "KV data path", "pool faults", "tree",
                         "C-level ceilings (one core)"}


def test_engine_without_the_data_path_has_no_copy_ratio(tmp_path):
    # The page-copy ceiling is the data path's: without it the engine rows say n/a.
    stdout, report = run_bench(tmp_path, "--section", "engine")
    assert set(report) == BASE_KEYS | {"ceilings", "engine", "engine_rounds"}
    assert set(report["ceilings"]) == {"compare_tokens_per_s"}
    assert all("vs_kv_copy" not in row for row in report["engine"])
    assert "page copy" not in stdout and "n/a" in stdout


def test_an_unknown_section_is_refused(tmp_path):
    result = subprocess.run([sys.executable, "-m", "hostkv", "bench", "--section", "nope"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "invalid choice: 'nope'" in result.stderr
    with pytest.raises(ValueError, match="unknown bench sections"):
        bench.run(sections=["nope"])


def test_the_copy_engine_section_alone(tmp_path):
    pytest.importorskip("torch")
    stdout, report = run_bench(tmp_path, "--section", "copy-engine")
    assert set(report) == BASE_KEYS | {"copy_engine"}
    step = report["copy_engine"]
    assert step["prefault_state"] == "done"
    assert step["step_bytes"] == step["step_pages"] * step["page_bytes"]
    rates = step["gbytes_per_s"]
    assert set(rates) == set(step["vs_limit"]) == set(step["page_faults"]) == set(bench.STEP_OPS)
    assert all(0 < rate["median"] <= rate["best"] for rate in rates.values())
    assert step["vs_limit"][step["limit"]] == 1.0
    # A mapping attached just before faults on its first save; a pre-faulted one does not
    # (or far less: one fault per 2 MiB where the tmpfs gives huge pages).
    assert step["page_faults"]["cold_save"] > step["page_faults"]["warm_save"]
    assert "copy engine: one engine step's" in stdout and "load, cold pool" in stdout
    # The other block layouts, warm, in the same rounds.
    assert set(step["layouts"]) == set(bench.STEP_LAYOUTS)
    for row in step["layouts"].values():
        assert row["save_gbytes_per_s"] > 0 and row["load_gbytes_per_s"] > 0
        assert row["save_vs_limit"] == row["save_gbytes_per_s"] / rates[step["limit"]]["median"]
    assert "save, cold, no populate" in stdout and "flashinfer-HND" in stdout
    assert step["stream_store_bytes"] in (0, 16, 32)


def test_the_pool_faults_section_times_the_engines_populate(tmp_path):
    stdout, report = run_bench(tmp_path, "--section", "pool-faults")
    faults = report["pool_faults"]
    assert set(faults["gbytes_per_s"]) == {"cold", "prefaulted", "plain", "prefault"}
    assert faults["populated_gbytes_per_s"] > 0
    # What the kernel gave of the huge pages hostkv advised (none on a huge=never tmpfs).
    assert faults["huge_mapped_bytes"] is None or 0 <= faults["huge_mapped_bytes"] <= faults["pool_bytes"]
    if faults["huge_policy"] == "never":
        assert faults["huge_mapped_bytes"] in (0, None)
    assert "cold after the copy engine's populate_pages" in stdout


def test_the_copy_engine_section_without_torch(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)         # import torch raises ImportError
    step = bench.copy_engine_step(quick=True, seed=0)
    assert step == {"skipped": "torch is not installed"}
    assert bench.report._format_copy_engine(step) == [
        "copy engine: skipped: torch is not installed"]


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.skipif(_has_cuda(), reason="a CUDA device is here: the section runs")
def test_the_gpu_copy_section_says_it_was_skipped_without_a_device(tmp_path):
    stdout, report = run_bench(tmp_path, "--section", "gpu-copy")
    assert set(report) == BASE_KEYS | {"gpu_copy"}
    reason = report["gpu_copy"]["skipped"]
    assert reason in ("no CUDA device", "torch is not installed")
    assert f"gpu copy: skipped: {reason}" in stdout


@pytest.mark.skipif(not _has_cuda(), reason="no CUDA device here")
def test_the_gpu_copy_section_on_a_device(tmp_path):
    stdout, report = run_bench(tmp_path, "--section", "gpu-copy")
    step = report["gpu_copy"]
    assert step["bytes_exact"] is True, step
    assert step["register_failed"] is None and step["registered_bytes"] > 0, step
    for name in bench.GPU_OPS:
        assert 0 < step["gbytes_per_s"][name]["median"] <= step["gbytes_per_s"][name]["best"]
    assert step["matmul"]["ms_alone"] > 0 and step["matmul"]["slowdown"] > 0
    assert "save / pinned d2h" in stdout and "matmul bf16" in stdout


def test_the_window_parts_section_alone(tmp_path):
    """Both segments replay the same workload (same hits); the one with parts really ran
    short of them, so the part LRU was on the timed path."""
    stdout, report = run_bench(tmp_path, "--section", "window-parts")
    assert set(report) == BASE_KEYS | {"window_parts"}
    assert [row["workload"] for row in report["window_parts"]] == ["shared-prompt", "multi-turn"]
    for row in report["window_parts"]:
        assert row["num_parts"] == max(1, row["num_pages"] // 8)
        assert row["parts"]["evicted"] > 0 and row["ratio"] > 0
        assert row["hit_rate_with"] == row["hit_rate_without"] > 0
    assert "window parts:" in stdout
