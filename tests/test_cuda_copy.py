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
from hostkv.cuda_copy import CudaCopier, run_offsets  # noqa: E402
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
