"""hostkv.cuda_copy: the copy engine's GPU path gives the CPU path's page bytes.

The GPU path's address arithmetic (the 2-D copies of a staged page, per layout and per
tensor-parallel head slice), its staging pieces and its stream and event ordering run here on
every machine: ``tests/lib/cuda_standin.py`` stands in for CUDA's primitives over CPU
tensors (``host_memcpy2d_function`` for ``cuMemcpy2DAsync``), the copier is the real one, and
the result must equal what the CPU copy engine writes and reads, byte for byte. The tests marked ``cuda`` run the whole path (side streams, events, the
pool registered) on a CUDA device and skip only where none exists.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import hostkv  # noqa: E402
from hostkv import copy_engine  # noqa: E402
from hostkv._cudacopy import host_memcpy2d_function, memcpy2d_batch  # noqa: E402
from hostkv.copy_engine import CopyEngine  # noqa: E402
from hostkv._copyplan import CopyPlan  # noqa: E402
from hostkv.cuda_copy import (  # noqa: E402
    DEFAULT_STAGING_BYTES, CudaCopier, HostRegistration, copies_for_pages, plan_pieces,
    run_offsets)
from lib.cuda_standin import RecordingCuda  # noqa: E402
from lib.kv_layouts import (  # noqa: E402, F401  (make_cache: a fixture)
    DIM, HEADS, LAYERS, TOKENS, as_flash_attn, as_flashinfer_hnd, as_vllm, as_vllm_mla,
    make_cache, reference_kv)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")

LAYOUTS = [(copy_engine.VLLM, as_vllm, "mha"), (copy_engine.FLASH_ATTN, as_flash_attn, "mha"),
           (copy_engine.FLASHINFER_HND, as_flashinfer_hnd, "mha"),
           (copy_engine.VLLM_MLA, as_vllm_mla, "mla")]



def test_run_offsets_walk_the_grid_row_major():
    assert run_offsets((), ()).tolist() == [0]
    assert run_offsets((2, 3), (100, 10)).tolist() == [0, 10, 20, 100, 110, 120]


def test_memcpy2d_batch_copies_every_row_at_both_pitches_and_refuses_unequal_arrays():
    host = np.zeros(64, dtype=np.uint8)
    device = np.arange(64, dtype=np.uint8)
    u = lambda *v: np.array(v, dtype=np.uint64)          # noqa: E731
    # Device -> host: 3 rows of 4 bytes, 8 apart on the device side, 16 apart on the host.
    n = memcpy2d_batch(host_memcpy2d_function(), True, u(host.ctypes.data),
                       u(device.ctypes.data + 1), u(16), u(8), u(4), u(3), 0)
    assert n == 1
    assert host[0:4].tolist() == [1, 2, 3, 4] and host[16:20].tolist() == [9, 10, 11, 12]
    assert host[32:36].tolist() == [17, 18, 19, 20] and host[4:16].tolist() == [0] * 12
    back = np.zeros(64, dtype=np.uint8)
    memcpy2d_batch(host_memcpy2d_function(), False, u(host.ctypes.data),
                   u(back.ctypes.data), u(16), u(4), u(4), u(3), 0)
    assert back[:12].tolist() == [1, 2, 3, 4, 9, 10, 11, 12, 17, 18, 19, 20]
    with pytest.raises(ValueError, match="1 host addresses, 2 device"):
        memcpy2d_batch(host_memcpy2d_function(), True, u(0), u(0, 0), u(1), u(1), u(1), u(1), 0)
    with pytest.raises(ValueError, match="no copy function"):
        memcpy2d_batch(0, True, u(0), u(0), u(1), u(1), u(1), u(1), 0)
    # A row wider than its pitch is the driver's CUDA_ERROR_INVALID_VALUE.
    with pytest.raises(RuntimeError, match="copy 0 of 1 failed with CUDA error 1"):
        memcpy2d_batch(host_memcpy2d_function(), True, u(host.ctypes.data),
                       u(device.ctypes.data), u(2), u(8), u(4), u(1), 0)


class _EventAfter:
    """Stands in for a torch.cuda.Event that completes after ``polls`` queries (the
    transfer's own logic, not CUDA's, is under test)."""

    def __init__(self, polls):
        self.polls = polls
        self.synchronized = False

    def query(self):
        self.polls -= 1
        return self.polls < 0 or self.synchronized

    def synchronize(self):
        self.synchronized = True


def test_a_cuda_transfers_wait_keeps_to_its_timeout():
    import time

    from hostkv.cuda_copy import _CudaTransfer
    never = _CudaTransfer(8, _EventAfter(10 ** 9), time.perf_counter())
    start = time.monotonic()
    assert never.wait(timeout=0.02) is False and not never.done()
    assert time.monotonic() - start >= 0.02
    soon = _CudaTransfer(8, _EventAfter(3), time.perf_counter())
    assert soon.wait(timeout=5.0) is True and soon.done() and soon.seconds > 0
    blocking = _CudaTransfer(8, _EventAfter(10 ** 9), time.perf_counter())
    assert blocking.wait() is True and blocking.event.synchronized


def test_the_gpu_path_holds_no_reference_back_to_its_engine(make_cache):
    """The copier the engine builds for CUDA tensors (here over CPU tensors, with the
    recording stand-in for CUDA) holds the engine's views and the pool's addresses, never the engine: so once
    the engine is closed and dropped, nothing keeps the pool's views alive, and the cache
    closes at once, without the garbage collector (a cycle would make close() raise
    BufferError at a worker's shutdown, and the lease be held until the process exits)."""
    import gc
    import weakref

    layout = hostkv.KVLayout(LAYERS, HEADS, DIM, "float32")
    cache = make_cache(layout)
    tensors = [as_vllm(kv) for kv in reference_kv()]
    enabled = gc.isenabled()
    gc.disable()                       # a collection could break a cycle by chance
    try:
        engine = CopyEngine(cache.pages_tensor(), layout, TOKENS, tensors, copy_engine.VLLM)
        engine._cuda = engine._cuda_copier(cuda=RecordingCuda(), register=False)
        assert isinstance(engine._cuda, CudaCopier)
        keep = engine.submit_save([3, 1], [0, 5])
        engine.close()
        gone = weakref.ref(engine)
        del engine, keep
        cache.close()
        assert gone() is None
    finally:
        if enabled:
            gc.enable()


# MLA pages have one latent per token: no head slices.
SLICED = [pytest.param(block_layout, build, kind, heads, id=f"{name}-{rank}")
          for (block_layout, build, kind), name in zip(LAYOUTS, ["vllm", "flash-attn",
                                                                 "flashinfer-HND", "mla"])
          for heads, rank in [(None, "all"), ((0, 2), "rank0of2"), ((2, 4), "rank1of2")]
          if kind == "mha" or heads is None]


@pytest.mark.parametrize("block_layout,build,kind,heads", SLICED)
def test_gpu_path_runs_give_the_cpu_paths_bytes(make_cache, block_layout, build, kind, heads):
    total = 1 if kind == "mla" else HEADS
    dim = 24 if kind == "mla" else DIM
    layout = hostkv.KVLayout(LAYERS, total, dim, "bfloat16", kind=kind)
    first, stop = heads or (0, total)
    ref = reference_kv(kv=layout.kv_planes, heads=stop - first, dim=dim, dtype=torch.bfloat16)
    tensors = [build(kv) for kv in ref]
    blocks, pages = np.array([7, 0, 3, 11], dtype=np.int64), np.array([2, 9, 0, 4],
                                                                     dtype=np.int64)
    cpu_cache, gpu_cache = make_cache(layout), make_cache(layout)
    cpu_pool, gpu_pool = cpu_cache.pages_tensor(), gpu_cache.pages_tensor()
    CopyEngine(cpu_pool, layout, TOKENS, tensors, block_layout, heads=heads).save(blocks, pages)
    page = LAYERS * layout.kv_planes * TOKENS * (stop - first) * dim * 2
    # Whole, in groups of one layer over the 4 pages, in groups of one page over every layer:
    # every way through the staging gives the same bytes.
    for staging in (None, 4 * page // LAYERS + 1, page):
        gpu_pool.zero_()
        engine = CopyEngine(gpu_pool, layout, TOKENS, tensors, block_layout, heads=heads)
        engine._cuda = engine._cuda_copier(cuda=RecordingCuda(), register=False,
                                           staging_bytes=staging)
        engine.save(blocks, pages)
        assert torch.equal(gpu_pool, cpu_pool), staging
        # And back: the pages into zeroed blocks.
        back = [torch.zeros_like(t) for t in tensors]
        loader = CopyEngine(gpu_pool, layout, TOKENS, back, block_layout, heads=heads)
        loader._cuda = loader._cuda_copier(cuda=RecordingCuda(), register=False,
                                           staging_bytes=staging)
        targets = [1, 5, 6, 10]
        loader.submit_load(pages, targets)
        for layer in range(LAYERS):
            want = torch.zeros_like(ref[layer])
            want[targets] = ref[layer][torch.from_numpy(blocks)]
            assert torch.equal(back[layer], build(want)), (staging, layer)
        engine.close()
        loader.close()
        del engine, loader
    del cpu_pool, gpu_pool


@cuda
@pytest.mark.parametrize("block_layout,build,kind", LAYOUTS,
                         ids=["vllm", "flash-attn", "flashinfer-HND", "mla"])
def test_cuda_saves_and_loads_are_byte_exact(make_cache, block_layout, build, kind):
    total = 1 if kind == "mla" else HEADS
    dim = 24 if kind == "mla" else DIM
    layout = hostkv.KVLayout(LAYERS, total, dim, "bfloat16", kind=kind)
    ref = reference_kv(kv=layout.kv_planes, heads=total, dim=dim, dtype=torch.bfloat16)
    cpu_tensors = [build(kv) for kv in ref]
    gpu_tensors = [t.cuda() for t in cpu_tensors]
    blocks, pages = [7, 0, 3, 11], [2, 9, 0, 4]
    cpu_cache, gpu_cache = make_cache(layout), make_cache(layout)
    cpu_pool, gpu_pool = cpu_cache.pages_tensor(), gpu_cache.pages_tensor()
    CopyEngine(cpu_pool, layout, TOKENS, cpu_tensors, block_layout).save(blocks, pages)
    engine = CopyEngine(gpu_pool, layout, TOKENS, gpu_tensors, block_layout)
    transfer = engine.submit_save(blocks, pages)
    assert transfer.wait() and transfer.error is None
    assert torch.equal(gpu_pool, cpu_pool)
    back = [torch.zeros_like(t) for t in gpu_tensors]
    loader = CopyEngine(gpu_pool, layout, TOKENS, back, block_layout)
    load = loader.submit_load(pages, [1, 5, 6, 10])
    for layer in range(LAYERS):
        load.wait_layer(layer)
    torch.cuda.synchronize()
    for layer in range(LAYERS):
        want = torch.zeros_like(ref[layer])
        want[[1, 5, 6, 10]] = ref[layer][blocks]
        assert torch.equal(back[layer].cpu(), build(want))
    engine.close()
    loader.close()
    del engine, loader, transfer, load, cpu_pool, gpu_pool


# -- stream and event ordering, staging, copy counts, registration (the recording stand-in) --

def _recorded_engine(make_cache, tensors=None, staging=None, cuda=None, heads=None):
    """A CopyEngine over CPU tensors whose GPU path runs on the recording stand-in."""
    layout = hostkv.KVLayout(LAYERS, HEADS, DIM, "float32")
    cache = make_cache(layout)
    first, stop = heads or (0, HEADS)
    tensors = tensors or [as_vllm(kv) for kv in reference_kv(heads=stop - first)]
    engine = CopyEngine(cache.pages_tensor(), layout, TOKENS, tensors, copy_engine.VLLM,
                        heads=heads)
    cuda = cuda or RecordingCuda()
    engine._cuda = engine._cuda_copier(cuda=cuda, register=False, staging_bytes=staging)
    return engine, cuda, cache


def _position(log, entry):
    return log.index(entry)


def test_a_save_waits_for_the_forward_by_event_and_never_blocks_the_host(make_cache):
    engine, cuda, _ = _recorded_engine(make_cache)
    copier = engine._cuda
    cuda.note("forward")                                    # the forward wrote the KV
    transfer = engine.submit_save([3, 1, 7], [0, 5, 2])
    log = cuda.log
    assert cuda.syncs() == []                               # the host waited for nothing
    save = copier.save_stream.name
    ready = [e for e in log if e[0] == "record" and e[1] == "compute"]
    assert len(ready) == 1 and _position(log, ready[0]) > _position(log, ("kernel", "compute",
                                                                          "forward"))
    wait = ("wait", save, ready[0][2])
    use = ("use", save)
    # The save stream waits for the compute stream's event before anything runs on it.
    assert _position(log, wait) < _position(log, use)
    upload = ("upload", save, "pinned", "non_blocking")
    dma = [e for e in log if e[0] == "dma"]
    assert dma and all(e[1] == save and e[2] == "to_host" and e[4] == save for e in dma)
    done = ("record", save, transfer.event.id)
    assert (_position(log, use) < _position(log, upload) < _position(log, dma[0])
            < _position(log, done) < _position(log, ("end", save)))
    # The index tensors live until the event completes, and not after.
    assert not transfer.done() and len(transfer.keep) == 2
    cuda.complete()
    assert transfer.done() and transfer.keep == [] and transfer.error is None
    engine.close()


def test_a_load_runs_on_the_high_priority_stream_and_the_forward_waits_by_event(make_cache):
    engine, cuda, _ = _recorded_engine(make_cache)
    copier = engine._cuda
    assert copier.load_stream.priority == cuda.priorities()[1]      # the highest
    assert copier.save_stream.priority == cuda.priorities()[0]      # the lowest
    transfer = engine.submit_load([0, 5], [3, 1])
    load = copier.load_stream.name
    assert [e for e in cuda.log if e[0] == "dma"] == [("dma", load, "to_device", 2, load)]
    transfer.wait_all_layers()
    assert cuda.log[-1] == ("wait", "compute", transfer.event.id)
    transfer.wait_layer(1)
    assert cuda.log[-1] == ("wait", "compute", transfer.layer_events[1].id)
    assert cuda.syncs() == []
    engine.close()


def test_a_load_that_fails_half_way_makes_the_forward_wait_for_what_it_enqueued(make_cache):
    # Staging of one page a piece: a load of 3 pages is 3 pieces; the second one fails.
    page = LAYERS * 2 * TOKENS * HEADS * DIM * 4
    engine, cuda, _ = _recorded_engine(make_cache, staging=page, cuda=RecordingCuda(fail_enqueue=2))
    copier = engine._cuda
    with pytest.raises(RuntimeError, match="CUDA error"):
        engine.submit_load([0, 5, 2], [3, 1, 7])
    load = copier.load_stream.name
    dma = [i for i, e in enumerate(cuda.log) if e[0] == "dma"]
    assert len(dma) == 1                                    # the first piece was enqueued
    fence = [e for e in cuda.log if e[0] == "record" and e[1] == load][-1]
    assert _position(cuda.log, fence) > dma[0]
    assert ("wait", "compute", fence[2]) in cuda.log        # the forward waits for it
    assert len(copier._orphans) == 1 and len(copier._orphans[0][1]) == 2
    cuda.complete()
    engine.submit_load([0], [3])                            # a later call lets them go
    assert copier._orphans == []
    engine.close()


def test_a_save_that_fails_half_way_waits_for_what_it_enqueued(make_cache):
    # The caller releases a failed save's pages at once, and another process may write
    # one: the pieces enqueued before the failure must be over before the error goes up.
    page = LAYERS * 2 * TOKENS * HEADS * DIM * 4
    engine, cuda, _ = _recorded_engine(make_cache, staging=page, cuda=RecordingCuda(fail_enqueue=2))
    copier = engine._cuda
    with pytest.raises(RuntimeError, match="CUDA error"):
        engine.submit_save([3, 1, 7], [0, 5, 2])            # 3 pieces, the second fails
    save = copier.save_stream.name
    dma = [i for i, e in enumerate(cuda.log) if e[0] == "dma"]
    assert len(dma) == 1 and cuda.log[dma[0]][2] == "to_host"    # the first piece
    fence = [e for e in cuda.log if e[0] == "record" and e[1] == save][-1]
    assert _position(cuda.log, fence) > dma[0]
    assert cuda.log[-1] == ("sync", "event", fence[2])      # the host waited for it
    assert copier._orphans == []
    engine.close()


def test_staging_is_allocated_once_and_bounds_every_transfer(make_cache):
    page = LAYERS * 2 * TOKENS * HEADS * DIM * 4
    engine, cuda, _ = _recorded_engine(make_cache, staging=2 * page)
    allocs = [e for e in cuda.log if e[0] == "alloc"]
    assert allocs == [("alloc", 2 * page), ("alloc", 2 * page)]     # save's, load's
    assert engine.stats().staging_bytes == 4 * page
    before = len(cuda.log)
    engine.submit_save(list(range(9)), list(range(9)))      # 9 pages through 2: 5 pieces
    engine.submit_load(list(range(9)), list(range(9)))
    assert [e for e in cuda.log[before:] if e[0] == "alloc"] == []
    assert engine.stats().pieces == 5 + 5
    engine.close()


def test_pieces_go_by_layers_then_by_pages():
    assert plan_pieces(4, 3, 10, 120) == [(0, 4, 0, 3)]
    assert plan_pieces(4, 3, 10, 80) == [(0, 4, 0, 2), (0, 4, 2, 3)]
    assert plan_pieces(4, 3, 10, 30) == [(0, 1, 0, 3), (1, 2, 0, 3), (2, 3, 0, 3), (3, 4, 0, 3)]
    assert plan_pieces(5, 3, 10, 60) == [(0, 5, 0, 1), (0, 5, 1, 2), (0, 5, 2, 3)]
    assert plan_pieces(7, 3, 10, 65) == [(0, 2, 0, 3), (2, 4, 0, 3), (4, 6, 0, 3), (6, 7, 0, 3)]
    with pytest.raises(ValueError, match="holds no page"):
        plan_pieces(1, 3, 10, 29)


@pytest.mark.parametrize("heads,world", [(None, 1), ((0, 2), 2), ((1, 2), 4)])
def test_one_copy_a_page_every_layer_at_any_tensor_parallel_degree(make_cache, heads, world):
    engine, cuda, _ = _recorded_engine(make_cache, heads=heads)
    before = engine.stats().copy_calls
    engine.submit_save([3, 1, 7, 0], [9, 5, 2, 7])          # no two pages adjacent
    assert engine.stats().copy_calls - before == 4
    engine.submit_save([3, 1, 7], [4, 5, 6])                 # adjacent: one copy
    assert engine.stats().copy_calls - before == 5
    engine.close()


def test_adjacent_pages_merge_but_never_across_a_registration_chunk():
    plan = CopyPlan((32,), (4096,), (1024,), 1024)           # TP rows: 1 KiB at 4 KiB pitch
    copies = copies_for_pages(plan, np.array([0, 1, 2, 3, 5]), 0, 32 * 4096, 0, 32 * 1024, 2)
    assert copies.host.tolist() == [0, 2 * 32 * 4096, 5 * 32 * 4096]
    assert copies.height.tolist() == [64, 64, 32]          # chunks: pages {0,1}, {2,3}, {4,5}
    assert copies.device.tolist() == [0, 2 * 32 * 1024, 4 * 32 * 1024]
    whole = CopyPlan((), (), (), 8192)                       # TP=1: a page is one run
    copies = copies_for_pages(whole, np.array([4, 5, 6]), 0, 8192, 0, 8192, 1 << 40)
    assert len(copies) == 1 and copies.height.tolist() == [3] and copies.width.tolist() == [8192]


def test_a_2k_prefill_at_tp2_of_an_8b_model_is_128_copies_not_131072():
    """The example that made the old path's cost plain: 32 layers, 8 KV heads of 128, bf16,
    16-token blocks, TP=2 (4 heads a rank): 128 pages of 1 MiB a rank. One run per (K|V,
    token, layer) row was 131,072 calls of 1 KiB; one 2-D copy a page is 128 at most."""
    layers, heads, dim, tokens, item = 32, 8, 128, 16, 2
    layer_bytes = 2 * tokens * (heads // 2) * dim * item
    pieces = plan_pieces(128, layers, layer_bytes, DEFAULT_STAGING_BYTES)
    assert pieces == [(0, 128, 0, 32)]
    row = (heads // 2) * dim * item
    plan = CopyPlan.build((layers, 2, tokens, heads // 2, dim),
                          [2 * tokens * heads * dim * item, tokens * heads * dim * item,
                           heads * dim * item, dim * item, item],
                          [2 * tokens * row, tokens * row, row, dim * item, item], item)
    assert plan.shape == (layers * 2 * tokens,) and plan.run == row
    pages = np.random.default_rng(0).permutation(100_000)[:128]
    copies = copies_for_pages(plan, pages, 0, layers * 2 * tokens * heads * dim * item, 0,
                              layers * layer_bytes, 1 << 40)
    assert len(copies) <= 128 and 131_072 == 128 * layers * 2 * tokens


def test_registration_goes_in_whole_pages_and_counts_and_logs_each_failure_once(caplog):
    cuda = RecordingCuda(register_codes=[0, 2, 2, 0])
    page = 3 << 20                                          # 3 MiB pages, 8 MiB chunks
    with caplog.at_level("WARNING", logger="hostkv.cuda"):
        registration = HostRegistration(cuda, 1 << 30, 10 * page, page, chunk_bytes=8 << 20)
        assert registration.finished.wait(10)
    assert registration.pages_per_chunk == 2
    assert [(a - (1 << 30)) % page for a, _, _ in cuda.registered] == [0] * 5
    assert [n for _, n, _ in cuda.registered] == [2 * page] * 5
    assert registration.failures == 2 and "CUDA error 2" in registration.failed
    assert registration.registered_bytes == 3 * 2 * page
    assert len([r for r in caplog.records if "CUDA error 2" in r.getMessage()]) == 1
    registration.close()
    assert [e for e in cuda.log if e[0] == "unregister"] == [
        ("unregister", (1 << 30) + i * 2 * page) for i in (0, 3, 4)]


def test_an_exception_in_the_registration_thread_is_logged_and_counted(caplog):
    cuda = RecordingCuda(fail_bind=RuntimeError("no such device"))
    with caplog.at_level("WARNING", logger="hostkv.cuda"):
        registration = HostRegistration(cuda, 0, 1 << 20, 4096)
        assert registration.finished.wait(10)
    assert registration.failures == 1 and "no such device" in registration.failed
    assert any("no such device" in r.getMessage() for r in caplog.records)
    registration.close()


def test_the_copy_engine_and_its_cuda_half_import_in_one_direction():
    import ast
    import inspect

    from hostkv import cuda_copy
    tree = ast.parse(inspect.getsource(cuda_copy))
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                 for alias in node.names}
    assert "hostkv.copy_engine" not in imported and "hostkv" not in imported


def _wait_registered(engine, timeout=60.0):
    registration = engine.registration()
    registration.finished.wait(timeout)
    if registration.registered_bytes < registration.nbytes:
        pytest.skip(f"the pool was not registered with CUDA: {registration.failed}")


@cuda
@pytest.mark.parametrize("heads", [None, (2, 4)], ids=["tp1", "rank1of2"])
def test_on_a_gpu_a_step_never_synchronizes_the_host(make_cache, heads):
    """torch raises on any call that would make the host wait for the device (a pageable
    upload, an ``.item()``, a blocking copy) while the sync debug mode is "error"; a save
    and a load through a registered pool make none, and come to one copy a page."""
    layout = hostkv.KVLayout(LAYERS, HEADS, DIM, "bfloat16")
    first, stop = heads or (0, HEADS)
    ref = reference_kv(heads=stop - first, dtype=torch.bfloat16)
    tensors = [as_vllm(kv).cuda() for kv in ref]
    cache = make_cache(layout)
    pool = cache.pages_tensor()
    engine = CopyEngine(pool, layout, TOKENS, tensors, copy_engine.VLLM, heads=heads)
    try:
        _wait_registered(engine)
        engine.submit_save([0], [0]).wait()              # first calls (allocator, driver)
        before = engine.stats().copy_calls
        torch.cuda.set_sync_debug_mode("error")
        try:
            save = engine.submit_save([7, 0, 3, 11], [2, 9, 0, 4])
            load = engine.submit_load([2, 9], [1, 5])
            load.wait_all_layers()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert engine.stats().copy_calls - before == 4 + 2
        assert save.wait() and load.wait() and save.error is None
        cpu_pool = make_cache(layout).pages_tensor()
        CopyEngine(cpu_pool, layout, TOKENS, [t.cpu() for t in tensors], copy_engine.VLLM,
                   heads=heads).save([7, 0, 3, 11], [2, 9, 0, 4])
        assert torch.equal(pool, cpu_pool)
        del cpu_pool
    finally:
        engine.close()
        del engine, pool


@cuda
def test_on_a_gpu_a_transfer_larger_than_the_staging_runs_in_pieces(make_cache):
    layout = hostkv.KVLayout(LAYERS, HEADS, DIM, "bfloat16")
    ref = reference_kv(dtype=torch.bfloat16)
    tensors = [as_vllm(kv).cuda() for kv in ref]
    page = layout.page_bytes(TOKENS)
    cache, cpu_cache = make_cache(layout), make_cache(layout)
    pool, cpu_pool = cache.pages_tensor(), cpu_cache.pages_tensor()
    engine = CopyEngine(pool, layout, TOKENS, tensors, copy_engine.VLLM, staging_bytes=page)
    try:
        assert engine.stats().staging_bytes == 2 * page
        blocks, pages = [7, 0, 3, 11, 5], [2, 9, 0, 4, 6]
        assert engine.submit_save(blocks, pages).wait()
        assert engine.stats().pieces == 5
        CopyEngine(cpu_pool, layout, TOKENS, [as_vllm(kv) for kv in ref],
                   copy_engine.VLLM).save(blocks, pages)
        assert torch.equal(pool, cpu_pool)
    finally:
        engine.close()
        del engine, pool, cpu_pool
