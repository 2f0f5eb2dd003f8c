"""`python -m hostkv create`: an operator sizes a segment up front, for a KV layout of either
kind (mha, mla) or a number of bytes a page, and engines attach it."""

from __future__ import annotations

import subprocess
import sys

import pytest

import hostkv
from hostkv._units import parse_size


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hostkv", *args], capture_output=True,
                          text=True, timeout=120)


def test_create_with_a_kv_layout(segment_name):
    done = run_cli("create", segment_name, "--size", "8MiB", "--page-size", "32",
                   "--layers", "2", "--kv-heads", "2", "--head-dim", "64", "--dtype", "float32")
    assert done.returncode == 0, done.stderr
    assert "128 pages of 65536 bytes" in done.stdout
    with hostkv.HostKVCache.attach(segment_name) as cache:
        assert cache.config.num_pages == 128 and cache.config.page_size == 32
        assert cache.config.kv_layout == hostkv.KVLayout(2, 2, 64, "float32")
        assert cache.stats().active_sequences == 0
    again = run_cli("create", segment_name, "--num-pages", "4", "--page-bytes", "64")
    assert again.returncode == 2 and "exists" in again.stderr


def test_create_with_page_bytes_and_bad_arguments(segment_name):
    done = run_cli("create", segment_name, "--num-pages", "16", "--page-bytes", "256",
                   "--page-size", "4")
    assert done.returncode == 0, done.stderr
    with hostkv.HostKVCache.attach(segment_name) as cache:
        assert (cache.config.num_pages, cache.config.page_bytes) == (16, 256)
    for args in (["--size", "10"],                                      # no layout
                 ["--size", "10", "--page-bytes", "256"],               # under one page
                 ["--size", "lots", "--page-bytes", "256"],
                 ["--size", "1MiB", "--layers", "2"]):                  # half a layout
        bad = run_cli("create", segment_name + "-x", *args)
        assert bad.returncode == 2, (args, bad.stdout)
    with pytest.raises(hostkv.SegmentNotFoundError):
        hostkv.HostKVCache.attach(segment_name + "-x")


def test_create_an_mla_segment(new_name):
    """--kind mla: a page holds one latent vector of --head-dim elements a token and layer;
    --kv-heads may be left out (it is 1). A layout that is not MLA's, or half of one, is
    refused and creates nothing."""
    name = new_name()
    done = run_cli("create", name, "--num-pages", "4", "--page-size", "64", "--kind", "mla",
                   "--layers", "3", "--head-dim", "576", "--dtype", "bfloat16")
    assert done.returncode == 0, done.stderr
    assert "4 pages of 221184 bytes" in done.stdout             # 3 layers x 64 x 576 x 2
    with hostkv.HostKVCache.attach(name) as cache:
        assert cache.config.kv_layout == hostkv.KVLayout(3, 1, 576, "bfloat16", kind="mla")
    for args, said in (
            (["--kind", "mla", "--kv-heads", "2", "--layers", "3", "--head-dim", "576"],
             "num_kv_heads must be 1"),
            (["--kind", "mla", "--head-dim", "576"],
             "an MLA KV layout needs --layers and --head-dim"),
            (["--kind", "mla", "--page-bytes", "256"],
             "an MLA KV layout needs --layers and --head-dim"),
            (["--kind", "gqa", "--layers", "3", "--kv-heads", "2", "--head-dim", "64"],
             "invalid choice: 'gqa'")):
        refused = new_name()
        bad = run_cli("create", refused, "--num-pages", "4", *args)
        assert bad.returncode == 2 and said in bad.stderr, (args, bad.stderr)
        with pytest.raises(hostkv.SegmentNotFoundError):
            hostkv.HostKVCache.attach(refused)


def test_create_a_segment_with_recurrent_state_layers(new_name):
    """--state-layers: the slots of those layers hold a recurrent state (a Qwen3-Next-like
    model's Gated DeltaNet layers). The header records them, an attach reads them back,
    inspect shows them, and an engine's layout without them is another layout. Bad lists
    are refused and create nothing."""
    import json

    name = new_name()
    done = run_cli("create", name, "--num-pages", "4", "--page-size", "128", "--layers", "4",
                   "--kv-heads", "2", "--head-dim", "64", "--state-layers", "0,2")
    assert done.returncode == 0, done.stderr
    assert "4 pages of 262144 bytes" in done.stdout             # state slots: K/V's size
    with hostkv.HostKVCache.attach(name) as cache:
        layout = cache.config.kv_layout
        assert layout == hostkv.KVLayout(4, 2, 64, "bfloat16", state_layers=(0, 2))
        assert layout != hostkv.KVLayout(4, 2, 64, "bfloat16")
    shown = run_cli("inspect", name, "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["config"]["kv_layout"]["state_layers"] == [0, 2]
    for args, said in ((["--state-layers", "0,x"], "layer indices separated by commas"),
                       (["--state-layers", "2,0"], "state_layers must be increasing"),
                       (["--state-layers", "0,1,2,3"], "leaving one K/V layer"),
                       (["--state-layers", "4"], "below num_layers 4")):
        _refused(new_name(), ["--layers", "4", *args], said)


def _refused(name, args, said):
    """create NAME of 2 KV heads of 64 with args is refused, saying said, and makes nothing."""
    bad = run_cli("create", name, "--num-pages", "4", "--kv-heads", "2", "--head-dim", "64",
                  *args)
    assert bad.returncode == 2 and said in bad.stderr, (args, bad.stderr)
    with pytest.raises(hostkv.SegmentNotFoundError):
        hostkv.HostKVCache.attach(name)


def test_create_a_segment_with_window_parts(new_name):
    name = new_name()
    done = run_cli("create", name, "--num-pages", "64", "--page-bytes", "256", "--page-size",
                   "4", "--num-parts", "8", "--part-bytes", "128")
    assert done.returncode == 0, done.stderr
    assert "64 pages of 256 bytes" in done.stdout and "8 window parts of 128 bytes" in done.stdout
    with hostkv.HostKVCache.attach(name) as cache:
        assert (cache.config.num_parts, cache.config.part_bytes) == (8, 128)
        assert cache.parts_array().shape == (8, 128)
    stats = run_cli("stats", name)
    assert stats.returncode == 0, stats.stderr
    assert any(line.split() == ["num_parts", "8"] for line in stats.stdout.splitlines())
    assert any(line.split() == ["free_parts", "8"] for line in stats.stdout.splitlines())
    prometheus = run_cli("stats", name, "--prometheus")
    assert "# TYPE hostkv_free_parts gauge" in prometheus.stdout
    assert "hostkv_parts_evicted_total" in prometheus.stdout
    refused = run_cli("create", new_name(), "--num-pages", "8", "--page-bytes", "64",
                      "--num-parts", "4")
    assert refused.returncode != 0 and "must both be 0" in refused.stderr


def test_create_a_segment_whose_window_layers_live_in_parts(new_name):
    """--window-layers: those layers' KV leaves the page for its window part, whose bytes
    follow from the layout; the header records the layers, inspect shows them, and a layout
    without them is another layout. A layout with window layers needs --num-parts."""
    import json

    name = new_name()
    done = run_cli("create", name, "--num-pages", "4", "--page-size", "16", "--layers", "6",
                   "--kv-heads", "2", "--head-dim", "64", "--window-layers", "0,1,2,3,4",
                   "--num-parts", "2")
    assert done.returncode == 0, done.stderr
    assert "4 pages of 8192 bytes" in done.stdout                # the one full layer
    assert "2 window parts of 40960 bytes" in done.stdout         # the five windowed
    with hostkv.HostKVCache.attach(name) as cache:
        layout = cache.config.kv_layout
        assert layout == hostkv.KVLayout(6, 2, 64, "bfloat16", window_layers=(0, 1, 2, 3, 4))
        assert layout != hostkv.KVLayout(6, 2, 64, "bfloat16")
        assert cache.parts_array().shape == (2, 40960)
    shown = run_cli("inspect", name, "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["config"]["kv_layout"]["window_layers"] == [0, 1, 2, 3, 4]
    for args, said in ((["--window-layers", "0,x", "--num-parts", "2"],
                        "--window-layers takes layer indices"),
                       (["--window-layers", "0,1"], "num_parts must be > 0"),
                       (["--window-layers", "0,1,2,3,4,5", "--num-parts", "2"],
                        "leaving one layer in the page")):
        _refused(new_name(), ["--layers", "6", *args], said)


def test_parse_size():
    assert parse_size(4096) == 4096
    assert parse_size("4GiB") == 4 << 30
    assert parse_size("512MB") == 512 * 10**6
    assert parse_size(" 1.5 kib ") == 1536
    for bad in ("", "-1", "4 parsecs", True, 0, "0", None):
        with pytest.raises(ValueError):
            parse_size(bad)
